//! Branch runs through clawmux's HTTP API against the replay gateway, with a fake workspace in
//! place of the git relay (no Docker: `tests/relay.rs` has the real one). The fake behaves like the
//! relay where it matters here: a prepare or publish cannot be stopped once begun (its commands go
//! on in the container even when clawmux stops waiting), and it records when two steps of one
//! branch ever overlapped. The test decides when each held step ends.
//!
//! Covered: an abort while the workspace is PREPARED and while the run PUBLISHES is honoured
//! (`aborted: true`, terminal `aborted`) and the next run of the branch proceeds once the step under
//! way is over; a run that was publishing when clawmux stopped publishes again after a restart on
//! the same store, without asking the gateway anything about it (the gateway restarted meanwhile).
//! A caller's mistake the relay can see before the run (an unknown base ref, a conflicting branch
//! key) is a `422` and no run; one it finds only when preparing ends the run `relay_rejected`; a
//! check that cannot be made admits the run. Two replicas on one PostgreSQL store (`pg_`) never
//! work on one branch key at once.

#![allow(clippy::unwrap_used)]

mod common;
#[path = "common/own_postgres.rs"]
mod own_postgres;

use clawmux::replay::{ReplayConfig, ReplayGateway, ReplayHandle};
use clawmux::server::{self, Running, StartOptions};
use clawmux_actors::branch::{BranchPlan, Prepared, Published, Workspace, WorkspaceError};
use common::*;
use futures_util::future::BoxFuture;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

const GW_TOKEN: &str = "branch-runs-gw-token";
/// Bound on everything that takes milliseconds (generous: the machine may be loaded).
const WAIT: Duration = Duration::from_secs(15);

// ------------------------------------------------------------------------------------------------
// The fake workspace
// ------------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    /// The checks at admission (never logged: only held when asked).
    Check,
    Prepare,
    Publish,
}

/// A step that waits for the test.
struct Held {
    kind: Kind,
    key: String,
    /// Ends the step (dropping it ends the step too).
    release: oneshot::Sender<()>,
}

struct Inner {
    /// Base refs deleted from the repository since (the checks then fail for them).
    gone_refs: Mutex<HashSet<String>>,
    /// Kinds of steps that wait for the test; the others end at once.
    hold: Mutex<HashSet<Kind>>,
    /// Where held steps are announced.
    held: mpsc::UnboundedSender<Held>,
    /// Every step begun, in order.
    log: Mutex<Vec<(Kind, String)>>,
    /// Steps under way, per branch key.
    active: Mutex<HashMap<String, usize>>,
    /// Steps that began while another step of their branch was under way (must stay 0).
    overlaps: AtomicUsize,
}

/// A workspace whose steps run as detached tasks, like commands in a container.
#[derive(Clone)]
struct FakeWorkspace(Arc<Inner>);

impl FakeWorkspace {
    fn new() -> (Self, mpsc::UnboundedReceiver<Held>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let inner = Inner {
            gone_refs: Mutex::new(HashSet::new()),
            hold: Mutex::new(HashSet::new()),
            held: tx,
            log: Mutex::new(Vec::new()),
            active: Mutex::new(HashMap::new()),
            overlaps: AtomicUsize::new(0),
        };
        (Self(Arc::new(inner)), rx)
    }

    fn hold(&self, kinds: &[Kind]) {
        *self.0.hold.lock().unwrap() = kinds.iter().copied().collect();
    }

    fn log(&self) -> Vec<(Kind, String)> {
        self.0.log.lock().unwrap().clone()
    }

    fn overlaps(&self) -> usize {
        self.0.overlaps.load(Ordering::SeqCst)
    }

    /// Runs one step to its end, whoever waits for it.
    fn step<T: Send + 'static>(&self, kind: Kind, key: &str, result: T) -> BoxFuture<'static, T> {
        let inner = self.0.clone();
        let key = key.to_owned();
        let task = tokio::spawn(async move {
            inner.log.lock().unwrap().push((kind, key.clone()));
            {
                let mut active = inner.active.lock().unwrap();
                let n = active.entry(key.clone()).or_insert(0);
                if *n > 0 {
                    inner.overlaps.fetch_add(1, Ordering::SeqCst);
                }
                *n += 1;
            }
            if inner.hold.lock().unwrap().contains(&kind) {
                let (release, wait) = oneshot::channel();
                let _ = inner.held.send(Held { kind, key: key.clone(), release });
                let _ = wait.await;
            }
            if let Some(n) = inner.active.lock().unwrap().get_mut(&key) {
                *n -= 1;
            }
            result
        });
        Box::pin(async move { task.await.expect("the step's task") })
    }
}

/// The repository the fake pretends to have: base ref `nope` does not exist, keys starting with
/// `taken/` conflict with an existing branch, checks of keys starting with `unchecked` cannot be
/// made, and `late/…` keys conflict only once the run prepares (a branch created meanwhile).
impl Workspace for FakeWorkspace {
    fn check(&self, plan: &BranchPlan) -> BoxFuture<'static, Result<(), WorkspaceError>> {
        let r = if plan.base_ref == "nope" || self.0.gone_refs.lock().unwrap().contains(&plan.base_ref) {
            Err(WorkspaceError::UnknownBaseRef("base ref \"nope\" not found".to_owned()))
        } else if plan.key.starts_with("taken/") {
            Err(WorkspaceError::KeyConflict(format!("{} cannot be created: sandbox/taken exists", plan.branch())))
        } else if plan.key.starts_with("unchecked") {
            Err(WorkspaceError::Failed("docker: connection refused".to_owned()))
        } else {
            Ok(())
        };
        let (inner, key) = (self.0.clone(), plan.key.clone());
        Box::pin(async move {
            if inner.hold.lock().unwrap().contains(&Kind::Check) {
                let (release, wait) = oneshot::channel();
                let _ = inner.held.send(Held { kind: Kind::Check, key, release });
                let _ = wait.await;
            }
            r
        })
    }

    fn prepare(&self, plan: &BranchPlan) -> BoxFuture<'static, Result<Prepared, WorkspaceError>> {
        let r = if plan.key.starts_with("late/") {
            Err(WorkspaceError::KeyConflict(format!("{} cannot be created: sandbox/late exists", plan.branch())))
        } else {
            Ok(Prepared { path: format!("/workspace/wt/{}", plan.key), branch: plan.branch() })
        };
        self.step(Kind::Prepare, &plan.key, r)
    }

    fn publish(&self, plan: &BranchPlan) -> BoxFuture<'static, Published> {
        let relay = json!({"branch": plan.branch(), "commitCount": 1, "pushed": true, "pushedCommits": 1});
        self.step(Kind::Publish, &plan.key, Published { relay })
    }
}

async fn next_held(rx: &mut mpsc::UnboundedReceiver<Held>, kind: Kind, key: &str) -> Held {
    let h = tokio::time::timeout(WAIT, rx.recv()).await.ok().flatten().unwrap_or_else(|| panic!("no held {kind:?} step of {key}"));
    assert_eq!((h.kind, h.key.as_str()), (kind, key));
    h
}

// ------------------------------------------------------------------------------------------------
// Harness
// ------------------------------------------------------------------------------------------------

fn gateway() -> ReplayHandle {
    ReplayGateway::start("127.0.0.1:0".parse().unwrap(), ReplayConfig::default().speed(0.0).token(GW_TOKEN)).expect("replay gateway starts")
}

/// clawmux in front of `gw` with `workspace` as its git relay, on the SQLite store `store`.
async fn clawmux(gw: &ReplayHandle, workspace: &FakeWorkspace, store: &std::path::Path) -> (Running, String, reqwest::Client) {
    let store = store.to_owned();
    let options = StartOptions { workspace: Some(Arc::new(workspace.clone())), ..Default::default() };
    let app = start_clawmux_opts(&gw.url(), Some(GW_TOKEN), move |c| c.store_url = clawmux::store::StoreUrl::Sqlite(store), |_| {}, options).await;
    let base = base(&app);
    let http = reqwest::Client::new();
    wait_ready(&http, &base, WAIT).await;
    (app, base, http)
}

/// A branch run on `key`, in the shape `tests/relay.rs` posts them.
fn branch_body(run_id: &str, key: &str) -> Value {
    json!({"runId": run_id, "message": format!("<{run_id}> work on {key}"), "billingAccountId": "acct-branch", "timeoutSec": 60,
           "branch": {"workItemId": key}})
}

async fn post(http: &reqwest::Client, base: &str, body: &Value) -> SseReader {
    let resp = post_sse(http, base, body, &[]).await;
    assert_eq!(resp.status(), 200, "POST /v1/runs for {body}");
    SseReader::new(resp)
}

async fn abort(http: &reqwest::Client, base: &str, run_id: &str) -> Value {
    let r = http.post(format!("{base}/v1/runs/{run_id}/abort")).send().await.unwrap();
    assert_eq!(r.status(), 202);
    r.json().await.unwrap()
}

async fn doc(http: &reqwest::Client, base: &str, run_id: &str) -> Value {
    http.get(format!("{base}/v1/runs/{run_id}")).send().await.unwrap().json().await.unwrap()
}

fn names(sse: &SseReader) -> Vec<String> {
    sse.events.iter().map(|e| if e.event == "status" { format!("status:{}", e.data["phase"].as_str().unwrap_or("")) } else { e.event.clone() }).collect()
}

async fn waits_for_branch(sse: &mut SseReader, key: &str) {
    let e = sse.until(WAIT, |e| e.event == "status").await.expect("a status event");
    assert_eq!(e.data, json!({"phase": "waiting_for_branch", "branch": format!("sandbox/{key}")}));
}

/// Reads an aborted run to its end and checks its document.
async fn assert_aborted(sse: &mut SseReader, http: &reqwest::Client, base: &str, run_id: &str) {
    let t = sse.terminal(WAIT).await.unwrap_or_else(|| panic!("{run_id} ended: {:?}", names(sse)));
    assert_eq!((t.event.as_str(), t.data["code"].as_str()), ("error", Some("aborted")), "{}", t.data);
    assert!(!names(sse).contains(&"relay".to_owned()), "no relay event: {:?}", names(sse));
    let d = doc(http, base, run_id).await;
    assert_eq!(d["status"], "aborted", "{d}");
    assert_eq!(abort(http, base, run_id).await["aborted"], false, "an ended run is not aborted twice");
}

/// Reads a run to `final` and checks the relay event before it.
async fn assert_relayed(sse: &mut SseReader, key: &str) {
    let t = sse.terminal(WAIT).await.unwrap_or_else(|| panic!("run ended: {:?}", names(sse)));
    assert_eq!(t.event, "final", "{}: {:?}", t.data, names(sse));
    let n = names(sse);
    assert_eq!(n.iter().filter(|e| *e == "relay").count(), 1, "{n:?}");
    assert_eq!(n[n.len() - 2], "relay", "relay, then final: {n:?}");
    let relay = sse.events.iter().find(|e| e.event == "relay").unwrap();
    assert_eq!(relay.data["branch"], format!("sandbox/{key}"));
}

async fn in_flight(app: &Running) -> usize {
    app.state.registry.send(clawmux_actors::messages::InFlight).await.unwrap()
}

// ------------------------------------------------------------------------------------------------
// Tests
// ------------------------------------------------------------------------------------------------

#[actix_rt::test]
async fn branch_run_aborted_while_preparing_ends_aborted_and_the_next_run_of_its_branch_proceeds() {
    let gw = gateway();
    let (ws, mut held) = FakeWorkspace::new();
    let (app, base, http) = clawmux(&gw, &ws, &temp_dir("branch-prep").join("runs.db")).await;
    ws.hold(&[Kind::Prepare]);
    let mut a = post(&http, &base, &branch_body("prep-a", "k-prep")).await;
    let step = next_held(&mut held, Kind::Prepare, "k-prep").await;
    let mut b = post(&http, &base, &branch_body("prep-b", "k-prep")).await;
    waits_for_branch(&mut b, "k-prep").await;
    assert_eq!(doc(&http, &base, "prep-a").await["status"], "running", "preparing counts as running");

    assert_eq!(abort(&http, &base, "prep-a").await, json!({"runId": "prep-a", "aborted": true}));
    assert_aborted(&mut a, &http, &base, "prep-a").await;
    assert!(!names(&a).contains(&"accepted".to_owned()), "never reached the gateway: {:?}", names(&a));

    // The prepare under way goes on (as in a container); the branch is the next run's only after.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(ws.log(), [(Kind::Prepare, "k-prep".to_owned())], "b waits while a's prepare is under way");
    ws.hold(&[]);
    let _ = step.release.send(());
    assert_relayed(&mut b, "k-prep").await;
    assert_eq!(ws.log(), [(Kind::Prepare, "k-prep".to_owned()), (Kind::Prepare, "k-prep".to_owned()), (Kind::Publish, "k-prep".to_owned())]);
    assert_eq!(ws.overlaps(), 0, "two steps of one branch overlapped");
    assert_eq!(gw.runs().len(), 1, "only b ran on the gateway");
    assert!(gw.runs()[0].message.starts_with("<prep-b>"));
    assert_eq!(in_flight(&app).await, 0, "every run (and its locks) released");
    server::shutdown(&app).await;
    gw.stop().await;
}

#[actix_rt::test]
async fn branch_run_aborted_while_publishing_ends_aborted_and_the_next_run_of_its_branch_proceeds() {
    let gw = gateway();
    let (ws, mut held) = FakeWorkspace::new();
    let (app, base, http) = clawmux(&gw, &ws, &temp_dir("branch-pub").join("runs.db")).await;
    ws.hold(&[Kind::Publish]);
    let mut a = post(&http, &base, &branch_body("pub-a", "k-pub")).await;
    let step = next_held(&mut held, Kind::Publish, "k-pub").await;
    a.until(WAIT, |e| e.event == "text_delta").await.expect("a streamed its answer");
    let mut b = post(&http, &base, &branch_body("pub-b", "k-pub")).await;
    waits_for_branch(&mut b, "k-pub").await;
    assert_eq!(doc(&http, &base, "pub-a").await["status"], "running", "publishing counts as running");

    assert_eq!(abort(&http, &base, "pub-a").await, json!({"runId": "pub-a", "aborted": true}));
    assert_aborted(&mut a, &http, &base, "pub-a").await;
    assert!(names(&a).contains(&"accepted".to_owned()));

    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(ws.log().len(), 2, "b waits while a's publish is under way: {:?}", ws.log());
    ws.hold(&[]);
    let _ = step.release.send(());
    assert_relayed(&mut b, "k-pub").await;
    let kinds: Vec<Kind> = ws.log().into_iter().map(|(k, _)| k).collect();
    assert_eq!(kinds, [Kind::Prepare, Kind::Publish, Kind::Prepare, Kind::Publish]);
    assert_eq!(ws.overlaps(), 0, "two steps of one branch overlapped");
    assert_eq!(doc(&http, &base, "pub-a").await["relay"], Value::Null, "the aborted run reports no relay result");
    assert_eq!(in_flight(&app).await, 0);
    server::shutdown(&app).await;
    gw.stop().await;
}

#[actix_rt::test]
async fn branch_run_that_was_publishing_publishes_again_after_a_restart() {
    let gw = gateway();
    let store = temp_dir("branch-restart").join("runs.db");
    let (ws1, mut held) = FakeWorkspace::new();
    let (app1, base1, http) = clawmux(&gw, &ws1, &store).await;
    ws1.hold(&[Kind::Publish]);
    let mut a = post(&http, &base1, &branch_body("restart-a", "k-restart")).await;
    let _step = next_held(&mut held, Kind::Publish, "k-restart").await;
    a.until(WAIT, |e| e.event == "text_delta").await.expect("streamed");
    // A handoff: the run is left as it stands (publishing), the stream ends without a terminal event.
    server::shutdown(&app1).await;
    assert!(a.terminal(WAIT).await.is_none(), "no terminal event at a handoff: {:?}", names(&a));
    let seen = a.events.last().map_or(0, |e| e.id);
    let content = a.text();
    drop(app1);
    // The gateway restarts too (it forgets its runs): the run's gateway part is over, so that
    // changes nothing for it.
    gw.drop_connections(true);
    // As if it had been admitted before branch keys had owners: its continuation claims its key.
    let owners = |store: &std::path::Path| -> Vec<(String, String)> {
        let c = rusqlite::Connection::open(store).unwrap();
        let mut st = c.prepare("SELECT branch_key, billing_account_id FROM branch_owners").unwrap();
        st.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap().map(Result::unwrap).collect()
    };
    assert_eq!(owners(&store), [("k-restart".to_owned(), "acct-branch".to_owned())]);
    rusqlite::Connection::open(&store).unwrap().execute("DELETE FROM branch_owners", []).unwrap();

    let (ws2, _held2) = FakeWorkspace::new();
    let (app2, base2, http) = clawmux(&gw, &ws2, &store).await;
    assert_eq!(app2.resumed, 1);
    assert_eq!(owners(&store), [("k-restart".to_owned(), "acct-branch".to_owned())], "the continued run claimed its key");
    let resp = http
        .get(format!("{base2}/v1/runs/restart-a/events"))
        .header("accept", "text/event-stream")
        .header("last-event-id", seen.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut rest = SseReader::new(resp);
    assert_relayed(&mut rest, "k-restart").await;
    // The handoff ended the first stream wherever its delivery stood (under load, some stored deltas
    // may not have reached it yet): the re-attached one brings exactly the rest, no gap, no repeat.
    let rest_names = names(&rest);
    let (deltas, end) = rest_names.split_at(rest_names.len().saturating_sub(2));
    assert_eq!(end, ["relay", "final"], "{rest_names:?}");
    assert!(deltas.iter().all(|n| n == "text_delta"), "only what came after the last event seen: {rest_names:?}");
    assert!(rest.events.first().is_some_and(|e| e.id > seen), "ids continue after {seen}");
    assert!(rest.events.windows(2).all(|w| w[0].id < w[1].id), "ids in order");
    let content = format!("{content}{}", rest.text());
    assert_eq!(ws2.log(), [(Kind::Publish, "k-restart".to_owned())], "published again, not prepared again");
    let d = doc(&http, &base2, "restart-a").await;
    assert_eq!((d["status"].as_str(), d["content"].as_str()), (Some("ok"), Some(content.as_str())), "{d}");
    assert_eq!(d["relay"]["pushed"], true, "{d}");
    assert_eq!(gw.runs().len(), 1, "the gateway ran it once");
    let asked = gw.stats().requests_received;
    assert_eq!((asked.get("agent"), asked.get("agent.wait")), (Some(&1), None), "nothing asked of the gateway about it after the restart: {asked:?}");
    assert_eq!(in_flight(&app2).await, 0);
    server::shutdown(&app2).await;
    gw.stop().await;
}

/// A caller's mistake is not `internal`: an unknown base ref or a conflicting key the relay's
/// check finds is `422` (`unknown_base_ref` naming `branch.baseRef`, `branch_conflict` naming the
/// key's field) and no run exists; a conflict found only when preparing ends the run
/// `relay_rejected` before it reaches the gateway; a check that cannot be made admits the run.
#[actix_rt::test]
async fn branch_caller_mistakes_are_422_at_post_or_relay_rejected() {
    let gw = gateway();
    let (ws, _held) = FakeWorkspace::new();
    let (app, base, http) = clawmux(&gw, &ws, &temp_dir("branch-mistakes").join("runs.db")).await;
    let cases = [
        (json!({"workItemId": "fine", "baseRef": "nope"}), "unknown_base_ref", "field `branch.baseRef`: base ref \"nope\" not found"),
        (json!({"workItemId": "taken/x"}), "branch_conflict", "field `branch.workItemId`: sandbox/taken/x cannot be created"),
        (json!({"branchName": "taken/y"}), "branch_conflict", "field `branch.branchName`: sandbox/taken/y cannot be created"),
    ];
    for (i, (branch, code, says)) in cases.into_iter().enumerate() {
        let run_id = format!("mistake-{i}");
        let body = json!({"runId": run_id, "message": "m", "billingAccountId": "acct-branch", "branch": branch});
        let r = http.post(format!("{base}/v1/runs")).json(&body).send().await.unwrap();
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap();
        assert_eq!((status, v["error"]["code"].as_str()), (422, Some(code)), "{body}: {v}");
        assert!(v["error"]["message"].as_str().unwrap_or_default().starts_with(says), "{v}");
        assert_eq!(http.get(format!("{base}/v1/runs/{run_id}")).send().await.unwrap().status(), 404, "no run was kept");
    }
    assert!(ws.log().is_empty(), "nothing prepared: {:?}", ws.log());

    let mut late = post(&http, &base, &branch_body("late-a", "late/x")).await;
    let t = late.terminal(WAIT).await.unwrap_or_else(|| panic!("ended: {:?}", names(&late)));
    assert_eq!((t.event.as_str(), t.data["code"].as_str()), ("error", Some("relay_rejected")), "{}", t.data);
    assert!(t.data["message"].as_str().unwrap_or_default().contains("sandbox/late exists"), "{}", t.data);
    assert!(!names(&late).contains(&"accepted".to_owned()), "never reached the gateway: {:?}", names(&late));
    assert_eq!(doc(&http, &base, "late-a").await["error"]["code"], "relay_rejected");

    let mut unchecked = post(&http, &base, &branch_body("unchecked-a", "unchecked-1")).await;
    assert_relayed(&mut unchecked, "unchecked-1").await;
    assert_eq!(gw.runs().len(), 1, "only the unchecked run reached the gateway");
    assert_eq!(in_flight(&app).await, 0);

    // The checks come before the run is stored, yet a request repeating a stored one still gets
    // its run, even when the checks would refuse it now (its base ref was deleted since).
    let body = json!({"message": "m", "billingAccountId": "acct-branch", "branch": {"workItemId": "replayed", "baseRef": "release-1"}});
    let first: Value = http.post(format!("{base}/v1/runs?wait=false")).header("idempotency-key", "replay-1").json(&body).send().await.unwrap().json().await.unwrap();
    let run_id = first["runId"].as_str().expect("admitted").to_owned();
    ws.0.gone_refs.lock().unwrap().insert("release-1".to_owned());
    let again = http.post(format!("{base}/v1/runs?wait=false")).header("idempotency-key", "replay-1").json(&body).send().await.unwrap();
    assert!(again.status().is_success(), "the repeat got {}", again.status());
    assert_eq!(again.json::<Value>().await.unwrap()["runId"], run_id.as_str(), "the repeat is the same run");
    let fresh = http.post(format!("{base}/v1/runs?wait=false")).header("idempotency-key", "replay-2").json(&body).send().await.unwrap();
    assert_eq!(fresh.status(), 422, "a new request is checked");
    server::shutdown(&app).await;
    gw.stop().await;
}

/// A branch key (its git branch `sandbox/<key>`, worktree, lock and pull request) belongs to the
/// billing account that first ran on it: another account's run on it is `422 branch_conflict`
/// naming the key's field (not the owner), is not stored and prepares nothing; the owner's next
/// run on it, and the other account's runs on keys of its own, are relayed; a run refused for
/// another reason claims nothing (unless a run of its account claimed the key meanwhile); the
/// owner is stored (a restart keeps it). Before, the second account's run waited for the first's
/// branch lock, worked in its worktree and pushed to its pull request.
#[actix_rt::test]
async fn a_branch_key_belongs_to_the_account_that_first_ran_on_it() {
    let gw = gateway();
    let store = temp_dir("branch-owners").join("runs.db");
    let (ws, mut held) = FakeWorkspace::new();
    let (app, base, http) = clawmux(&gw, &ws, &store).await;
    let run_of = |run_id: &str, account: &str, branch: Value| json!({"runId": run_id, "message": format!("<{run_id}>"), "billingAccountId": account, "timeoutSec": 60, "branch": branch});
    let mut first = post(&http, &base, &run_of("own-1", "acct-a", json!({"workItemId": "shared"}))).await;
    assert_relayed(&mut first, "shared").await;
    let refused = |base: String, http: reqwest::Client, branch: Value, field: &'static str| async move {
        let r = http.post(format!("{base}/v1/runs")).json(&run_of("other-1", "acct-b", branch)).send().await.unwrap();
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap();
        assert_eq!((status, v["error"]["code"].as_str()), (422, Some("branch_conflict")), "{v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.starts_with(&format!("field `{field}`: branch key \"shared\" is another billing account's")) && !message.contains("acct-a"), "{message}");
        assert_eq!(http.get(format!("{base}/v1/runs/other-1")).send().await.unwrap().status(), 404, "no run was kept");
    };
    refused(base.clone(), http.clone(), json!({"workItemId": "shared"}), "branch.workItemId").await;
    refused(base.clone(), http.clone(), json!({"branchName": "shared"}), "branch.branchName").await;
    // Nor may another account's run start from the key's branch, in any spelling of it: its
    // worktree would hold that branch's work, its pull request would ask to merge into it.
    for base_ref in ["sandbox/shared", "origin/sandbox/shared", "refs/heads/sandbox/shared", "refs/remotes/origin/sandbox/shared"] {
        let r = http.post(format!("{base}/v1/runs")).json(&run_of("other-1", "acct-b", json!({"workItemId": "b-copy", "baseRef": base_ref}))).send().await.unwrap();
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap();
        assert_eq!((status, v["error"]["code"].as_str()), (422, Some("branch_conflict")), "{base_ref}: {v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.starts_with("field `branch.baseRef`: base ref") && !message.contains("acct-a"), "{message}");
        assert_eq!(http.get(format!("{base}/v1/runs/other-1")).send().await.unwrap().status(), 404, "no run was kept");
    }
    let mut own = post(&http, &base, &run_of("other-2", "acct-b", json!({"workItemId": "b-own"}))).await;
    assert_relayed(&mut own, "b-own").await;
    let mut again = post(&http, &base, &run_of("own-2", "acct-a", json!({"branchName": "shared"}))).await;
    assert_relayed(&mut again, "shared").await;
    // The owner may start a branch from its own (stacked work); and acct-b's refused runs above
    // left the key b-copy free.
    let mut stacked = post(&http, &base, &run_of("own-stacked", "acct-a", json!({"workItemId": "b-copy", "baseRef": "sandbox/shared"}))).await;
    assert_relayed(&mut stacked, "b-copy").await;
    // A request repeating a stored one gets its run, even when the base ref's key has become
    // another account's since (as for the other checks made before a run is stored).
    let early = run_of("b-early", "acct-b", json!({"workItemId": "b-early", "baseRef": "sandbox/later"}));
    let mut first_try = post(&http, &base, &early).await;
    assert_relayed(&mut first_try, "b-early").await;
    let mut later = post(&http, &base, &run_of("own-later", "acct-a", json!({"workItemId": "later"}))).await;
    assert_relayed(&mut later, "later").await;
    let r = http.post(format!("{base}/v1/runs?wait=false")).json(&early).send().await.unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap();
    assert!((200..300).contains(&status) && v["runId"] == "b-early", "the repeat did not get its run: {status} {v}");
    // A run refused for another reason (here its base ref) claims nothing: the key stays free.
    let r = http.post(format!("{base}/v1/runs")).json(&run_of("other-3", "acct-b", json!({"workItemId": "free", "baseRef": "nope"}))).send().await.unwrap();
    assert_eq!(r.status(), 422);
    let mut free = post(&http, &base, &run_of("own-3", "acct-a", json!({"workItemId": "free"}))).await;
    assert_relayed(&mut free, "free").await;
    // A refused run's claim is not let go once another run of its account claimed the key after
    // it (that run may be working on it): here the first claim's checks are held while a second
    // run is admitted and relayed, then the first is refused for its base ref.
    ws.hold(&[Kind::Check]);
    let (h, b) = (http.clone(), base.clone());
    let typo = tokio::spawn(async move { h.post(format!("{b}/v1/runs")).json(&run_of("own-4", "acct-a", json!({"workItemId": "racy", "baseRef": "nope"}))).send().await.unwrap().status() });
    let check = next_held(&mut held, Kind::Check, "racy").await;
    ws.hold(&[]);
    let mut racy = post(&http, &base, &run_of("own-5", "acct-a", json!({"workItemId": "racy"}))).await;
    assert_relayed(&mut racy, "racy").await;
    let _ = check.release.send(());
    assert_eq!(typo.await.unwrap(), 422);
    let r = http.post(format!("{base}/v1/runs")).json(&run_of("other-4", "acct-b", json!({"workItemId": "racy"}))).send().await.unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap();
    assert_eq!((status, v["error"]["code"].as_str()), (422, Some("branch_conflict")), "{v}");
    let prepared: Vec<String> = ws.log().into_iter().filter(|(k, _)| *k == Kind::Prepare).map(|(_, key)| key).collect();
    assert_eq!(prepared, ["shared", "b-own", "shared", "b-copy", "b-early", "later", "free", "racy"], "the refused runs prepared nothing");
    server::shutdown(&app).await;
    drop(app);
    let (ws2, _held2) = FakeWorkspace::new();
    let (app2, base2, http) = clawmux(&gw, &ws2, &store).await;
    refused(base2.clone(), http.clone(), json!({"workItemId": "shared"}), "branch.workItemId").await;
    server::shutdown(&app2).await;
    gw.stop().await;
}

/// A replica on the shared PostgreSQL store `url`, with `workspace` as its git relay.
async fn replica(gw: &ReplayHandle, workspace: &FakeWorkspace, url: &str, id: &str) -> (Running, String, reqwest::Client) {
    let (url, id) = (url.to_owned(), id.to_owned());
    let options = StartOptions { workspace: Some(Arc::new(workspace.clone())), ..Default::default() };
    let app = start_clawmux_opts(
        &gw.url(),
        Some(GW_TOKEN),
        move |c| {
            c.store_url = clawmux::store::StoreUrl::parse(&url).unwrap();
            c.replica_id = id;
            c.run_lease_sec = 3;
        },
        |_| {},
        options,
    )
    .await;
    let base = base(&app);
    let http = reqwest::Client::new();
    wait_ready(&http, &base, WAIT).await;
    (app, base, http)
}

/// Two replicas on one PostgreSQL database (`CLAWMUX_TEST_PG_URL`; the PostgreSQL phase of
/// tests/run.sh), sharing one workspace: a run of a branch key admitted on the other replica while
/// the first publishes is given to the first one's replica and waits for the branch there.
#[actix_rt::test]
async fn pg_two_replicas_never_work_on_one_branch_key_at_once() {
    let Some(server) = own_postgres::server_url("pg_two_replicas_never_work_on_one_branch_key_at_once") else { return };
    let url = clawmux::store::postgres::create_test_database(&server, "cmx_branch").await.unwrap();
    let gw = gateway();
    let (ws, mut held) = FakeWorkspace::new();
    let (r0, base0, http) = replica(&gw, &ws, &url, "b0").await;
    let (r1, base1, _) = replica(&gw, &ws, &url, "b1").await;
    ws.hold(&[Kind::Publish]);
    let mut a = post(&http, &base0, &branch_body("rep-a", "k-rep")).await;
    let step = next_held(&mut held, Kind::Publish, "k-rep").await;
    let mut b = post(&http, &base1, &branch_body("rep-b", "k-rep")).await;
    waits_for_branch(&mut b, "k-rep").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(ws.log().len(), 2, "b waits while a's publish is under way: {:?}", ws.log());
    ws.hold(&[]);
    let _ = step.release.send(());
    assert_relayed(&mut a, "k-rep").await;
    assert_relayed(&mut b, "k-rep").await;
    let kinds: Vec<Kind> = ws.log().into_iter().map(|(k, _)| k).collect();
    assert_eq!(kinds, [Kind::Prepare, Kind::Publish, Kind::Prepare, Kind::Publish]);
    assert_eq!(ws.overlaps(), 0, "two steps of one branch overlapped");
    server::shutdown(&r1).await;
    server::shutdown(&r0).await;
    gw.stop().await;
}

/// A branch run whose checks at admission are slow (a busy Docker engine) does not let a run of
/// its session key admitted after it on another replica, and given to this one, start before it:
/// admission order is the order the store takes them in, and a takeover waits while a run is
/// between the store and the registry (its checks come first, before either).
#[actix_rt::test]
async fn pg_a_branch_run_with_slow_checks_keeps_its_session_keys_order_across_replicas() {
    let Some(server) = own_postgres::server_url("pg_a_branch_run_with_slow_checks_keeps_its_session_keys_order_across_replicas") else { return };
    let url = clawmux::store::postgres::create_test_database(&server, "cmx_branch_order").await.unwrap();
    let gw = gateway();
    gw.set_paused(true);
    let (ws, mut held) = FakeWorkspace::new();
    let (r0, base0, http) = replica(&gw, &ws, &url, "o0").await;
    let (r1, base1, _) = replica(&gw, &ws, &url, "o1").await;
    let in_session = |run_id: &str, branch: Option<&str>| {
        let mut b = json!({"runId": run_id, "message": format!("<{run_id}>"), "billingAccountId": "acct-branch", "stateKey": "ordered", "timeoutSec": 60, "onDisconnect": "continue"});
        if let Some(key) = branch {
            b["branch"] = json!({"branchName": key});
        }
        b
    };
    let post_json = |base: &str, body: Value| {
        let (http, base) = (http.clone(), base.to_owned());
        tokio::spawn(async move { http.post(format!("{base}/v1/runs?wait=false")).json(&body).send().await.unwrap().status().as_u16() })
    };
    // r0 runs the session; a branch run of it is admitted there, its checks held.
    assert_eq!(post_json(&base0, in_session("o-first", None)).await.unwrap(), 202);
    ws.hold(&[Kind::Check]);
    let branch_run = post_json(&base0, in_session("o-branch", Some("k-ord")));
    let check = next_held(&mut held, Kind::Check, "k-ord").await;
    // Meanwhile a plain run of the session is admitted on r1, given to r0 and taken up there.
    assert_eq!(post_json(&base1, in_session("o-later", None)).await.unwrap(), 202);
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while sqlx::query_scalar::<_, i64>("SELECT count(*) FROM runs WHERE run_id = 'o-later' AND owner = 'o0' AND assigned_at IS NULL").fetch_one(&pool).await.unwrap() == 0 {
        assert!(tokio::time::Instant::now() < deadline, "r0 did not take up the run r1 admitted for it");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ws.hold(&[]);
    let _ = check.release.send(());
    assert_eq!(branch_run.await.unwrap(), 202);
    gw.set_paused(false);
    let deadline = tokio::time::Instant::now() + WAIT;
    while sqlx::query_scalar::<_, i64>("SELECT count(*) FROM runs WHERE finished_at IS NOT NULL").fetch_one(&pool).await.unwrap() < 3 {
        assert!(tokio::time::Instant::now() < deadline, "the runs did not end");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let admitted: Vec<String> = sqlx::query_scalar("SELECT run_id FROM runs ORDER BY seq").fetch_all(&pool).await.unwrap();
    let mut started: Vec<(std::time::Instant, String)> = gw.runs().into_iter().map(|r| (r.accepted_at, r.message)).collect();
    started.sort();
    let order: Vec<String> = started.into_iter().map(|(_, m)| m.trim_start_matches('<').split('>').next().unwrap_or_default().to_owned()).collect();
    assert_eq!(order, admitted, "the gateway started the session's runs out of admission order");
    for id in &admitted {
        assert_eq!(doc(&http, &base1, id).await["status"], "ok", "{id}");
    }
    pool.close().await;
    server::shutdown(&r1).await;
    server::shutdown(&r0).await;
    gw.stop().await;
}
