//! Gateway faults against the REAL OpenClaw gateway (openclaw@2026.9.6, protocol 4) with LONG runs:
//! the connection cut mid-run (and kept down past a run's own timeout), the gateway frozen (a stall
//! of the path, and a real SIGSTOP), and the gateway killed and restarted. Every run is checked for
//! exactly one terminal event, its own text only, and a prompt, bounded end.
//!
//! The faults between clawmux and the gateway come from a TCP relay of ours
//! (`tests/common/tcp_chaos.rs`); freezing and killing act on the gateway process itself.
//!
//! These tests restart and SIGSTOP their gateway, so they get one of their own: `tests/run.sh`
//! starts it with `tests/support/gateway.sh start RUN_DIR v4`, runs this binary with
//! `CLAWMUX_CHAOS_GATEWAY_ENV=RUN_DIR/env` and `--test-threads=1`, and stops it by PID. Without
//! that variable the tests say so and return, unless `CLAWMUX_REQUIRE_CHAOS_GATEWAY=1`, in which
//! case they fail. (A variable of their own, not `CLAWMUX_REAL_GATEWAY_ENV`: pointed at a shared
//! gateway they would kill it under other tests.)
//!
//! Long runs use the fake LLM's `SLOW` keyword: 40 chunks, one a second. The fake LLM echoes the
//! first line of the message, so every run's reply carries its own marker.

mod common;
#[path = "common/tcp_chaos.rs"]
mod tcp_chaos;

use common::*;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tcp_chaos::ChaosRelay;
use tokio::time::Instant;

/// Words of a `SLOW` reply (tests/support/fake_llm.py: 40 chunks at 1 s).
const SLOW_WORDS: usize = 40;
/// Runs in flight per test: several accounts at once, well under the gateway's parallel limit (8).
const RUNS: usize = 4;

// -------------------------------------------------------------------------------------------------
// The gateway under test
// -------------------------------------------------------------------------------------------------

struct Gateway {
    url: String,
    addr: SocketAddr,
    token: String,
    llm_log: String,
    run_dir: String,
    gateway_pid: u32,
}

/// The gateway from `$CLAWMUX_CHAOS_GATEWAY_ENV`, read afresh (a restart rewrites it: new PID).
fn gateway() -> Option<Gateway> {
    let Ok(path) = std::env::var("CLAWMUX_CHAOS_GATEWAY_ENV") else {
        assert!(
            std::env::var("CLAWMUX_REQUIRE_CHAOS_GATEWAY").as_deref() != Ok("1"),
            "CLAWMUX_REQUIRE_CHAOS_GATEWAY=1 but CLAWMUX_CHAOS_GATEWAY_ENV is not set: run tests/run.sh"
        );
        eprintln!("chaos gateway not started (run tests/run.sh); skipping");
        return None;
    };
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    let env: HashMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
    let get = |k: &str| env.get(k).unwrap_or_else(|| panic!("{path} lacks {k}")).to_string();
    // Boot ids, agent.wait and chat.abort of agent runs are protocol 4.
    assert_eq!(env.get("GATEWAY_FLAVOR").copied().unwrap_or("v4"), "v4", "the chaos tests need the protocol-4 gateway");
    let host = get("GATEWAY_HOST");
    let port: u16 = get("GATEWAY_PORT").parse().expect("GATEWAY_PORT");
    Some(Gateway {
        url: get("GATEWAY_URL"),
        addr: SocketAddr::new(host.parse().expect("GATEWAY_HOST is an IP address"), port),
        token: get("GATEWAY_TOKEN"),
        llm_log: get("LLM_LOG"),
        run_dir: get("RUN_DIR"),
        gateway_pid: get("GATEWAY_PID").parse().expect("GATEWAY_PID"),
    })
}

fn llm_log(g: &Gateway) -> Vec<Value> {
    std::fs::read_to_string(&g.llm_log).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// Streamed LLM requests that have not ended yet.
fn open_llm_streams(g: &Gateway) -> Vec<String> {
    let log = llm_log(g);
    let ended: Vec<&str> = log.iter().filter(|e| e["event"] == "stream_end").filter_map(|e| e["id"].as_str()).collect();
    log.iter()
        .filter(|e| e["stream"] == true)
        .filter_map(|e| e["id"].as_str())
        .filter(|id| !ended.contains(id))
        .map(str::to_owned)
        .collect()
}

/// Runs the gateway runs in parallel (`max(8, 4 x CPUs)`; 8 on the 2-core machines the tests run on).
const GATEWAY_PARALLEL: usize = 8;

/// Waits (bounded) until the gateway has room for `runs` more runs, so they all start at once.
/// Runs can outlive a test: a failed test cannot always cancel its runs, and after `kill -9` +
/// restart the gateway re-runs every interrupted session by itself
/// (`[main-session-restart-recovery] started interrupted main session`), one after the other, each
/// a full `SLOW` reply. Open LLM streams count those runs (ours make one LLM call each); one slot
/// stays spare for a run that is between calls.
async fn wait_for_free_slots(g: &Gateway, runs: usize) {
    let deadline = Instant::now() + Duration::from_secs(50);
    loop {
        let open = open_llm_streams(g);
        if open.len() + runs < GATEWAY_PARALLEL {
            return;
        }
        assert!(Instant::now() < deadline, "the fake LLM is still streaming {open:?} 50 s on: the gateway is busy with leftovers");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// How the LLM stream of the run carrying `marker` ended: `Some(completed)`, or `None` when it has
/// not ended by `until`.
async fn llm_stream_end(g: &Gateway, marker: &str, until: Instant) -> Option<bool> {
    loop {
        let log = llm_log(g);
        let ids: Vec<&str> = log
            .iter()
            .filter(|e| e["last_user"].as_str().is_some_and(|u| u.contains(marker)))
            .filter_map(|e| e["id"].as_str())
            .collect();
        if let Some(end) = log.iter().find(|e| e["event"] == "stream_end" && e["id"].as_str().is_some_and(|id| ids.contains(&id))) {
            return end["completed"].as_bool();
        }
        if Instant::now() >= until {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// SIGSTOPs the gateway; SIGCONT on drop, so a failing test never leaves it stopped.
struct Frozen(u32);

impl Frozen {
    fn new(pid: u32) -> Self {
        // Never signal a PID that is no longer the gateway (a stale env file).
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        assert!(String::from_utf8_lossy(&cmdline).contains("openclaw"), "pid {pid} is not the gateway");
        signal(pid, "-STOP");
        Self(pid)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        signal(self.0, "-CONT");
    }
}

fn signal(pid: u32, sig: &str) {
    let st = std::process::Command::new("kill").args([sig, &pid.to_string()]).status().expect("kill runs");
    assert!(st.success(), "kill {sig} {pid} failed");
}

// -------------------------------------------------------------------------------------------------
// clawmux and its runs
// -------------------------------------------------------------------------------------------------

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(150)).build().expect("client")
}

async fn start(g: &Gateway, url: &str, tweak_sup: impl FnOnce(&mut clawmux_actors::SupervisorConfig)) -> (clawmux::server::Running, String) {
    let running = start_clawmux_with(url, Some(&g.token), |_| {}, tweak_sup).await;
    let base = base(&running);
    wait_ready(&client(), &base, Duration::from_secs(30)).await;
    (running, base)
}

async fn connects(base: &str) -> f64 {
    metric(&client(), base, "clawmux_gateway_connects_total{outcome=\"ok\"}").await
}

/// What one run's SSE stream showed, with arrival times.
#[derive(Default)]
struct RunLog {
    status: Option<u16>,
    events: Vec<(Instant, SseEvent)>,
    /// The whole body as received: no other run's marker may ever be in it.
    raw: String,
    /// When the server closed the stream.
    closed: Option<Instant>,
    /// Transport error, or the stream still open at the reader's deadline.
    problem: Option<String>,
}

/// One run posted with `Accept: text/event-stream`, read to its end by a task of its own.
struct Run {
    i: usize,
    marker: String,
    run_id: String,
    /// The first line of the message: the fake LLM echoes it.
    first_line: String,
    posted: Instant,
    log: Arc<Mutex<RunLog>>,
    task: tokio::task::JoinHandle<()>,
}

impl Run {
    /// Posts `SLOW <what> <marker>` for account `acct-chaos-<i>`; `extra` adds body fields.
    fn post(base: &str, tag: &str, what: &str, i: usize, extra: Value) -> Run {
        let marker = format!("CHX{tag}R{i}X");
        let run_id = format!("chaos-{tag}-{i}");
        let first_line = format!("SLOW {what} {marker}");
        let mut body = json!({"message": first_line, "billingAccountId": format!("acct-chaos-{i}"), "runId": run_id});
        if let (Some(b), Value::Object(x)) = (body.as_object_mut(), extra) {
            b.extend(x);
        }
        let log = Arc::new(Mutex::new(RunLog::default()));
        let url = format!("{base}/v1/runs");
        let task = tokio::spawn(read_run(url, body, log.clone()));
        Run { i, marker, run_id, first_line, posted: Instant::now(), log, task }
    }

    fn text(&self) -> String {
        let log = self.log.lock().expect("log");
        log.events.iter().filter(|(_, e)| e.event == "text_delta").filter_map(|(_, e)| e.data["text"].as_str()).collect()
    }

    fn deltas_between(&self, from: Instant, to: Instant) -> usize {
        let log = self.log.lock().expect("log");
        log.events.iter().filter(|(t, e)| e.event == "text_delta" && *t > from && *t < to).count()
    }

    fn terminals(&self) -> Vec<(Instant, SseEvent)> {
        let log = self.log.lock().expect("log");
        log.events.iter().filter(|(_, e)| e.event == "final" || e.event == "error").cloned().collect()
    }
}

/// The body of a run's task: POST, then read the SSE stream until the server closes it (bounded).
async fn read_run(url: String, body: Value, log: Arc<Mutex<RunLog>>) {
    use futures_util::StreamExt;
    let deadline = Instant::now() + Duration::from_secs(120);
    let resp = match client().post(url).header("accept", "text/event-stream").json(&body).send().await {
        Ok(r) => r,
        Err(e) => {
            log.lock().expect("log").problem = Some(format!("POST failed: {e}"));
            return;
        }
    };
    log.lock().expect("log").status = Some(resp.status().as_u16());
    let mut stream = resp.bytes_stream();
    let mut buf = String::new();
    loop {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Err(_) => {
                log.lock().expect("log").problem = Some("the SSE stream was still open 120 s after the POST".to_owned());
                return;
            }
            Ok(None) => {
                log.lock().expect("log").closed = Some(Instant::now());
                return;
            }
            Ok(Some(Err(e))) => {
                log.lock().expect("log").problem = Some(format!("SSE stream broke: {e}"));
                return;
            }
            Ok(Some(Ok(chunk))) => {
                let now = Instant::now();
                let text = String::from_utf8_lossy(&chunk);
                buf.push_str(&text);
                let mut l = log.lock().expect("log");
                l.raw.push_str(&text);
                while let Some(pos) = buf.find("\n\n") {
                    let block: String = buf.drain(..pos + 2).collect();
                    l.events.extend(parse_sse(&block).into_iter().map(|e| (now, e)));
                }
            }
        }
    }
}

/// Waits (bounded) until every run streamed text, and at least `min_age` passed since the first
/// post: the fault then hits runs that are well under way.
async fn wait_streaming(runs: &[Run], min_age: Duration) {
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let all = runs.iter().all(|r| !r.text().is_empty());
        if all && runs.iter().all(|r| r.posted.elapsed() >= min_age) {
            return;
        }
        for r in runs {
            let log = r.log.lock().expect("log");
            assert!(log.problem.is_none() && log.closed.is_none(), "run {} ended before streaming: {:?} {:?}", r.i, log.problem, log.events);
        }
        assert!(Instant::now() < deadline, "not every run streamed text within 40 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits for every run's task (each is bounded by its own reader deadline).
async fn join(runs: &mut [Run]) {
    for r in runs.iter_mut() {
        (&mut r.task).await.expect("run task");
    }
}

/// Collected failures: a test reports every broken expectation of every run at once.
#[derive(Default)]
struct Failures(Vec<String>);

impl Failures {
    fn check(&mut self, ok: bool, msg: impl FnOnce() -> String) {
        if !ok {
            self.0.push(msg());
        }
    }

    /// Panics with every failure; prints how long the test took either way.
    fn assert_none(self, test: &str, started: Instant) {
        eprintln!("{test}: {:.1} s", started.elapsed().as_secs_f64());
        assert!(self.0.is_empty(), "{test}: {} failure(s):\n  - {}", self.0.len(), self.0.join("\n  - "));
    }
}

/// Exactly one terminal event, the last one, then the stream closed; no transport problem; no
/// byte of another run. Returns the terminal event.
fn check_one_end(f: &mut Failures, r: &Run, all: &[Run]) -> Option<SseEvent> {
    let log = r.log.lock().expect("log");
    let i = r.i;
    f.check(log.status == Some(200), || format!("run {i}: POST answered {:?}", log.status));
    f.check(log.problem.is_none(), || format!("run {i}: {}", log.problem.as_deref().unwrap_or_default()));
    f.check(log.closed.is_some(), || format!("run {i}: the stream did not close"));
    for o in all.iter().filter(|o| o.i != r.i) {
        f.check(!log.raw.contains(&o.marker) && !log.raw.contains(&o.run_id), || format!("run {i}: foreign bytes of run {} in its stream", o.i));
    }
    let terminals: Vec<&SseEvent> = log.events.iter().map(|(_, e)| e).filter(|e| e.event == "final" || e.event == "error").collect();
    f.check(terminals.len() == 1, || format!("run {i}: {} terminal events: {terminals:?}", terminals.len()));
    let last = log.events.last().map(|(_, e)| e.clone());
    let t = terminals.first().map(|t| (*t).clone());
    f.check(t.is_some() && last.as_ref().map(|e| e.id) == t.as_ref().map(|e| e.id), || format!("run {i}: events after the terminal one: {last:?}"));
    if let Some(t) = &t {
        // `final` carries the run document, `error` {runId, code, message}: both name the run.
        f.check(t.data["runId"] == r.run_id.as_str(), || format!("run {i}: terminal event of another run: {t:?}"));
    }
    t
}

/// The run ended `final` with its own full reply, and what was streamed is a prefix of it.
fn check_full_own_text(f: &mut Failures, r: &Run, t: &Option<SseEvent>) {
    let i = r.i;
    let Some(t) = t else { return };
    if t.event != "final" {
        f.check(false, || format!("run {i}: expected final, got {} {}", t.event, t.data));
        return;
    }
    let content = t.data["content"].as_str().unwrap_or_default();
    let words: Vec<String> = (1..=SLOW_WORDS).map(|w| format!("w{w}")).collect();
    let head = format!("Reply to: {} | model=", r.first_line);
    let tail = format!(" | {}", words.join(" "));
    f.check(content.contains(&head) && content.ends_with(&tail), || format!("run {i}: not its own full reply: {content:?}"));
    let text = r.text();
    f.check(content.starts_with(&text), || format!("run {i}: streamed text {text:?} is not a prefix of the final content {content:?}"));
    f.check(text.contains(&r.marker), || format!("run {i}: own marker never streamed: {text:?}"));
}

fn tag() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..8].to_owned()
}

// -------------------------------------------------------------------------------------------------
// drop: the connection is cut mid-run
// -------------------------------------------------------------------------------------------------

/// Four 40 s runs from four accounts; the one connection is reset (RST) ~3 s in. clawmux reconnects
/// to the same gateway process, so every run must re-subscribe, keep streaming, learn its end with
/// `agent.wait` and end `final` with its own full text. `request_timeout` (clawmux's bound on one
/// ordinary request, 30 s by default) is 3 s here, far shorter than what is left of the runs, so a
/// recovery bounded by it instead of by the run's own timeout shows up in a short test.
#[actix_rt::test]
async fn live_chaos_drop_cut_mid_run_every_run_recovers_and_ends_final_with_its_own_full_text() {
    let Some(g) = gateway() else { return };
    let started = Instant::now();
    wait_for_free_slots(&g, RUNS).await;
    let relay = ChaosRelay::start(g.addr).await.expect("relay");
    let (running, base) = start(&g, &relay.url(), |sup| {
        sup.request_timeout = Duration::from_secs(3);
        sup.recovery_window = Duration::from_secs(30);
    })
    .await;
    let t = tag();
    let mut runs: Vec<Run> = (0..RUNS).map(|i| Run::post(&base, &t, "chaos drop", i, json!({}))).collect();
    wait_streaming(&runs, Duration::from_millis(2500)).await;

    let cut_at = Instant::now();
    let streamed_at_cut: Vec<usize> = runs.iter().map(|r| r.text().len()).collect();
    assert_eq!(relay.cut_all(), 1, "clawmux holds exactly one gateway connection");
    join(&mut runs).await;

    let mut f = Failures::default();
    for r in &runs {
        let end = check_one_end(&mut f, r, &runs);
        check_full_own_text(&mut f, r, &end);
        // The text kept coming over the new connection (not only the final answer at the end).
        let end_at = r.terminals().first().map(|(t, _)| *t).unwrap_or_else(Instant::now);
        let after = r.deltas_between(cut_at, end_at);
        f.check(after >= 10, || format!("run {}: only {after} text_delta events between the cut and the end", r.i));
        f.check(r.text().len() > streamed_at_cut[r.i], || format!("run {}: no text streamed after the cut", r.i));
    }
    f.check(connects(&base).await >= 2.0, || "clawmux did not reconnect".to_owned());
    f.check(relay.accepted() >= 2, || format!("the relay carried {} connections", relay.accepted()));
    clawmux::server::shutdown(&running).await;
    f.assert_none("drop", started);
}

/// A 10 s run loses its connection ~3 s in, and the gateway stays unreachable (the relay resets
/// every new connection) until after its timeout. The run must end `timeout` (not
/// `gateway_disconnected`: its own timeout is what ran out, the recovery window is 60 s), and once
/// the connection is back its gateway run must really be cancelled: the fake LLM sees its stream
/// cut (`stream_end` with `completed:false`) instead of running on to the end, ~40 s in.
#[actix_rt::test]
async fn live_chaos_drop_run_timeout_while_recovering_ends_timeout_and_is_cancelled_on_the_gateway() {
    let Some(g) = gateway() else { return };
    let started = Instant::now();
    wait_for_free_slots(&g, 1).await;
    let relay = ChaosRelay::start(g.addr).await.expect("relay");
    let (running, base) = start(&g, &relay.url(), |sup| {
        sup.request_timeout = Duration::from_secs(3);
        sup.recovery_window = Duration::from_secs(60);
    })
    .await;
    let t = tag();
    let mut runs = vec![Run::post(&base, &t, "chaos timeout", 0, json!({"timeoutSec": 10}))];
    wait_streaming(&runs, Duration::from_millis(2500)).await;

    relay.refuse(true);
    assert_eq!(relay.cut_all(), 1, "clawmux holds exactly one gateway connection");
    let run_deadline = runs[0].posted + Duration::from_secs(10);
    // Down until 3 s past the run's deadline.
    tokio::time::sleep_until(run_deadline + Duration::from_secs(3)).await;
    relay.refuse(false);
    let reopened = Instant::now();
    let refused = relay.refused();

    join(&mut runs).await;
    let r = &runs[0];
    let mut f = Failures::default();
    f.check(refused >= 1, || "clawmux never tried to reconnect during the outage".to_owned());
    let end = check_one_end(&mut f, r, &runs);
    if let Some(e) = &end {
        f.check(e.event == "error" && e.data["code"] == "timeout", || format!("run 0: expected error timeout, got {} {}", e.event, e.data));
    }
    if let Some((at, _)) = r.terminals().first() {
        f.check(*at + Duration::from_millis(500) >= run_deadline, || format!("run 0 ended {:?} before its timeout", run_deadline - *at));
        f.check(*at <= reopened + Duration::from_secs(10), || format!("run 0 ended {:?} after the gateway was reachable again", *at - reopened));
    }
    let cut = llm_stream_end(&g, &r.marker, reopened + Duration::from_secs(15)).await;
    f.check(cut == Some(false), || match cut {
        None => "the gateway run was not cancelled: its LLM stream was still running 15 s after the connection was back".to_owned(),
        Some(_) => "the gateway run was not cancelled: its LLM stream ran to its end".to_owned(),
    });
    let doc: Value = client().get(format!("{base}/v1/runs/{}", r.run_id)).send().await.expect("get").json().await.expect("doc");
    f.check(doc["status"] == "timeout", || format!("run document: {doc}"));
    clawmux::server::shutdown(&running).await;
    f.assert_none("drop + timeout", started);
}

// -------------------------------------------------------------------------------------------------
// freeze: the gateway (or the path to it) stops answering for a few seconds
// -------------------------------------------------------------------------------------------------

/// Four 40 s runs; the relay forwards nothing either way for 5 s while keeping both sockets open
/// (clawmux's supervisor sees no traffic at all). That is far below the tick watchdog's two 30 s
/// intervals, so the connection must survive: no reconnect, every run ends `final` once with its
/// own full text, and the text resumes after the stall.
#[actix_rt::test]
async fn live_chaos_freeze_stalled_path_for_5s_connection_survives_and_every_run_ends_final() {
    let Some(g) = gateway() else { return };
    let started = Instant::now();
    wait_for_free_slots(&g, RUNS).await;
    let relay = ChaosRelay::start(g.addr).await.expect("relay");
    let (running, base) = start(&g, &relay.url(), |_| {}).await;
    let t = tag();
    let mut runs: Vec<Run> = (0..RUNS).map(|i| Run::post(&base, &t, "chaos stall", i, json!({}))).collect();
    wait_streaming(&runs, Duration::from_millis(2500)).await;

    relay.stall();
    let stalled_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let resumed_at = Instant::now();
    relay.resume();
    join(&mut runs).await;

    let mut f = Failures::default();
    for r in &runs {
        let end = check_one_end(&mut f, r, &runs);
        check_full_own_text(&mut f, r, &end);
        // The stall really stopped the traffic (bytes in flight may land in the first moments)...
        let during = r.deltas_between(stalled_at + Duration::from_millis(500), resumed_at);
        f.check(during == 0, || format!("run {}: {during} text_delta events arrived during the stall", r.i));
        // ...and the run went on afterwards.
        let after = r.deltas_between(resumed_at, Instant::now());
        f.check(after >= 10, || format!("run {}: only {after} text_delta events after the stall", r.i));
    }
    f.check(connects(&base).await == 1.0, || "clawmux reconnected: a 5 s stall must not drop the connection".to_owned());
    f.check(relay.accepted() == 1, || format!("the relay carried {} connections", relay.accepted()));
    clawmux::server::shutdown(&running).await;
    f.assert_none("stall", started);
}

/// Four 40 s runs; the gateway process is SIGSTOPped for 3 s, then SIGCONTed (also on any panic).
/// The connection survives; every run ends `final` exactly once with its own full text.
#[actix_rt::test]
async fn live_chaos_freeze_sigstop_gateway_for_3s_connection_survives_and_every_run_ends_final() {
    let Some(g) = gateway() else { return };
    let started = Instant::now();
    wait_for_free_slots(&g, RUNS).await;
    let (running, base) = start(&g, &g.url, |_| {}).await;
    let t = tag();
    let mut runs: Vec<Run> = (0..RUNS).map(|i| Run::post(&base, &t, "chaos sigstop", i, json!({}))).collect();
    wait_streaming(&runs, Duration::from_millis(2500)).await;

    let frozen = Frozen::new(g.gateway_pid);
    let stopped_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let continued_at = Instant::now();
    drop(frozen);
    join(&mut runs).await;

    let mut f = Failures::default();
    for r in &runs {
        let end = check_one_end(&mut f, r, &runs);
        check_full_own_text(&mut f, r, &end);
        let during = r.deltas_between(stopped_at + Duration::from_millis(500), continued_at);
        f.check(during == 0, || format!("run {}: {during} text_delta events while the gateway was stopped", r.i));
        let after = r.deltas_between(continued_at, Instant::now());
        f.check(after >= 10, || format!("run {}: only {after} text_delta events after SIGCONT", r.i));
    }
    f.check(connects(&base).await == 1.0, || "clawmux reconnected: a 3 s freeze must not drop the connection".to_owned());
    clawmux::server::shutdown(&running).await;
    f.assert_none("sigstop", started);
}

// -------------------------------------------------------------------------------------------------
// kill: the gateway dies and comes back as a new process
// -------------------------------------------------------------------------------------------------

/// Four 40 s runs; the gateway is killed (-9) and started again on the same port and state
/// (`gateway.sh restart-gateway`). The new process has a new boot id and the runs' gateway run ids
/// died with the old one (it re-runs the interrupted sessions by itself, under new run ids, ~15 s
/// after it is ready: nothing of that may reach any caller), so every run must end exactly once
/// with `gateway_disconnected`, within a few seconds of the
/// gateway being ready again: not when the (here 60 s) recovery window runs out, and not after an
/// `agent.wait` for a run the new process never had. A new run afterwards succeeds.
#[actix_rt::test]
async fn live_chaos_kill_gateway_restart_ends_every_run_once_promptly_and_a_new_run_succeeds() {
    let Some(g) = gateway() else { return };
    let started = Instant::now();
    wait_for_free_slots(&g, RUNS).await;
    let (running, base) = start(&g, &g.url, |sup| sup.recovery_window = Duration::from_secs(60)).await;
    let t = tag();
    let mut runs: Vec<Run> = (0..RUNS).map(|i| Run::post(&base, &t, "chaos kill", i, json!({}))).collect();
    wait_streaming(&runs, Duration::from_millis(2500)).await;

    let killed_at = Instant::now();
    let run_dir = g.run_dir.clone();
    // Blocking (~10 s): on a thread of its own, so the runs' streams are read meanwhile. The
    // script returns once the new gateway's /readyz says ready.
    let (out, ready_at) = tokio::task::spawn_blocking(move || {
        let out = std::process::Command::new("bash")
            .args([concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/gateway.sh"), "restart-gateway", &run_dir])
            .output()
            .expect("gateway.sh runs");
        (out, Instant::now())
    })
    .await
    .expect("restart thread");
    assert!(out.status.success(), "restart failed: {}", String::from_utf8_lossy(&out.stderr));
    eprintln!("gateway restarted in {:?}", ready_at - killed_at);
    join(&mut runs).await;

    let mut f = Failures::default();
    for r in &runs {
        let end = check_one_end(&mut f, r, &runs);
        if let Some(e) = &end {
            f.check(e.event == "error" && e.data["code"] == "gateway_disconnected", || format!("run {}: expected error gateway_disconnected, got {} {}", r.i, e.event, e.data));
        }
        if let Some((at, _)) = r.terminals().first() {
            eprintln!("run {} ended {:?} after the kill", r.i, *at - killed_at);
            f.check(*at >= killed_at, || format!("run {}: ended before the kill", r.i));
            f.check(*at <= ready_at + Duration::from_secs(8), || format!("run {}: ended {:?} after the gateway was ready again", r.i, *at - ready_at));
        }
    }
    // A new run on the new gateway process.
    let g2 = gateway().expect("env");
    wait_ready(&client(), &base, Duration::from_secs(30)).await;
    let marker = format!("CHX{t}NEW");
    let (status, doc) = post_json(&client(), &base, &json!({"message": format!("after the kill {marker}"), "billingAccountId": "acct-chaos-new"})).await;
    f.check(status == 200 && doc["status"] == "ok", || format!("new run after the restart: {status} {doc}"));
    let content = doc["content"].as_str().unwrap_or_default();
    f.check(content.contains(&format!("Reply to: after the kill {marker} | model=")), || format!("new run: not its own reply: {doc}"));
    // The new gateway re-runs the killed runs' sessions by itself; none of that may reach this run.
    for r in &runs {
        f.check(!doc.to_string().contains(&r.marker), || format!("new run: carries killed run {}'s text: {doc}", r.i));
    }
    f.check(g2.gateway_pid != g.gateway_pid, || "the gateway PID did not change".to_owned());
    f.check(connects(&base).await >= 2.0, || "clawmux did not reconnect".to_owned());
    clawmux::server::shutdown(&running).await;
    f.assert_none("kill", started);
}

// -------------------------------------------------------------------------------------------------
// The relay itself (no gateway needed; runs with the ordinary tests)
// -------------------------------------------------------------------------------------------------

/// Cut, stall and refuse do what the live tests rely on, against an echo server.
#[actix_rt::test]
async fn chaos_relay_forwards_stalls_cuts_and_refuses() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    let echo = TcpListener::bind(("127.0.0.1", 0)).await.expect("bind");
    let echo_addr = echo.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((s, _)) = echo.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.into_split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    let relay = ChaosRelay::start(echo_addr).await.expect("relay");
    let within = Duration::from_secs(5);
    async fn read_some(s: &mut TcpStream, within: Duration) -> std::io::Result<Vec<u8>> {
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(within, s.read(&mut buf)).await.map_err(|_| std::io::ErrorKind::TimedOut)??;
        Ok(buf[..n].to_vec())
    }

    // Forwarding.
    let mut c = TcpStream::connect(relay.addr).await.expect("connect");
    c.write_all(b"ping").await.expect("write");
    assert_eq!(read_some(&mut c, within).await.expect("echo"), b"ping");

    // Stall: nothing comes back while stalled, everything after resume.
    relay.stall();
    c.write_all(b"held").await.expect("write");
    let r = read_some(&mut c, Duration::from_millis(500)).await;
    assert_eq!(r.map_err(|e| e.kind()), Err(std::io::ErrorKind::TimedOut), "bytes crossed a stalled relay");
    relay.resume();
    assert_eq!(read_some(&mut c, within).await.expect("after resume"), b"held");

    // Cut: the client sees a reset, not an orderly close.
    assert_eq!(relay.cut_all(), 1);
    let r = read_some(&mut c, within).await;
    assert_eq!(r.map_err(|e| e.kind()), Err(std::io::ErrorKind::ConnectionReset), "a cut is a reset");

    // Refuse: accepted, then reset at once; forwarding again afterwards.
    relay.refuse(true);
    let mut c = TcpStream::connect(relay.addr).await.expect("connect");
    let r = read_some(&mut c, within).await;
    assert_eq!(r.map_err(|e| e.kind()), Err(std::io::ErrorKind::ConnectionReset), "a refused connection is reset");
    assert_eq!(relay.refused(), 1);
    relay.refuse(false);
    let mut c = TcpStream::connect(relay.addr).await.expect("connect");
    c.write_all(b"again").await.expect("write");
    assert_eq!(read_some(&mut c, within).await.expect("echo"), b"again");
    assert_eq!((relay.accepted(), relay.cut_count()), (2, 1));
}
