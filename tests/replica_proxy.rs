//! The LLM proxy of ANY replica forwards the calls of any live run (issue 14, item 6): two clawmux
//! replicas (child processes) on one PostgreSQL database and one replay gateway (held paused, so
//! runs stay live while the test makes the calls a gateway would), the project's fake LLM as both
//! proxies' upstream. A call of a run owned by one replica, sent to the OTHER replica's proxy, is
//! forwarded with the run's billing headers and counted once in its usage; when the run ends, that
//! proxy cuts its stream and refuses its calls; a budget spent through it stops the run at its
//! owner; a takeover keeps every call counted once.
//!
//! Every test is named `pg_…` and runs in the PostgreSQL phase of tests/run.sh (a database of its
//! own on the server `CLAWMUX_TEST_PG_URL` names). Without it they are skipped, unless
//! `CLAWMUX_REQUIRE_PG=1`.

#![allow(clippy::unwrap_used)]

mod common;
#[path = "common/child.rs"]
mod child;
#[path = "common/own_postgres.rs"]
mod own_postgres;
#[path = "common/tcp_chaos.rs"]
mod tcp_chaos;

use child::{free_port, Clawmux};
use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway, ReplayHandle};
use common::{chat_body, new_traceparent, FakeLlm};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::time::Duration;
use tokio::time::Instant;

const GW_TOKEN: &str = "replica-proxy-gw-token";

async fn database(test: &str) -> Option<String> {
    let server = own_postgres::server_url(test)?;
    Some(clawmux::store::postgres::create_test_database(&server, "cmx_xattr").await.unwrap())
}

/// A paused replay gateway: every run stays live until the test lets it go on.
fn paused_gateway() -> ReplayHandle {
    let cfg = ReplayConfig::new(Cassette::bundled().unwrap()).speed(0.0).token(GW_TOKEN);
    let gw = ReplayGateway::start("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
    gw.set_paused(true);
    gw
}

/// A replica with its LLM proxy in front of `llm`.
struct Replica {
    app: Clawmux,
    /// `http://127.0.0.1:PORT` of its LLM proxy.
    proxy: String,
}

/// With leases of 3 s: a takeover within seconds.
async fn replica(id: &str, gw: &ReplayHandle, url: &str, llm: &FakeLlm, key: &str, http: &reqwest::Client) -> Replica {
    replica_with_lease(id, gw, url, llm, key, http, "3").await
}

async fn replica_with_lease(id: &str, gw: &ReplayHandle, url: &str, llm: &FakeLlm, key: &str, http: &reqwest::Client, lease_sec: &str) -> Replica {
    let proxy_port = free_port();
    let listen = format!("127.0.0.1:{proxy_port}");
    let audit = common::temp_dir(&format!("audit-{id}"));
    let mut app = Clawmux::new(
        &gw.url(),
        GW_TOKEN,
        &[
            ("CLAWMUX_DEVICE_IDENTITY", "off"),
            ("CLAWMUX_STORE_URL", url),
            ("CLAWMUX_REPLICA_ID", id),
            ("CLAWMUX_RUN_LEASE_SEC", lease_sec),
            ("CLAWMUX_PROXY_LISTEN", &listen),
            ("CLAWMUX_LLM_UPSTREAM_URL", &llm.url()),
            ("CLAWMUX_LLM_UPSTREAM_KEY", key),
            ("CLAWMUX_AUDIT_DIR", &audit.display().to_string()),
        ],
    );
    app.start(http).await;
    Replica { app, proxy: format!("http://{listen}") }
}

fn http() -> reqwest::Client {
    reqwest::Client::builder().pool_max_idle_per_host(64).timeout(Duration::from_secs(60)).build().unwrap()
}

/// Posts a run with the trace id `trace` and waits until the gateway accepted it.
async fn post_run(http: &reqwest::Client, base: &str, run_id: &str, account: &str, traceparent: &str) {
    let body = json!({"message": format!("xattr {run_id}"), "billingAccountId": account, "runId": run_id, "onDisconnect": "continue"});
    let r = http.post(format!("{base}/v1/runs?wait=false")).header("traceparent", traceparent).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 202, "{:?}", r.text().await);
    common::wait_accepted(http, base, run_id).await;
}

/// A call's traceparent: the run's trace id, a new span (as the gateway sends them).
fn call_tp(trace: &str) -> String {
    format!("00-{trace}-{}-01", &uuid::Uuid::new_v4().simple().to_string()[..16])
}

/// One call through `proxy` with `traceparent` (none: the body must name a token); its status and
/// whole answer.
async fn call(http: &reqwest::Client, proxy: &str, traceparent: Option<&str>, body: &Value) -> (u16, String) {
    let mut r = http.post(format!("{proxy}/v1/chat/completions")).json(body);
    if let Some(tp) = traceparent {
        r = r.header("traceparent", tp);
    }
    let resp = r.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap_or_default())
}

async fn doc(http: &reqwest::Client, base: &str, run_id: &str) -> Value {
    http.get(format!("{base}/v1/runs/{run_id}")).send().await.unwrap().json().await.unwrap()
}

/// What the upstream saw of a run's calls: how many, and the tokens it reported for them (a stream
/// cut before its end reported none: its usage comes last).
fn upstream_bill(llm: &FakeLlm, run_id: &str) -> (u64, u64, u64) {
    let entries = llm.entries();
    let ids: Vec<&str> = entries.iter().filter(|e| e["headers"]["x-cogni-run-id"] == run_id).filter_map(|e| e["id"].as_str()).collect();
    let cut: Vec<&str> = entries.iter().filter(|e| e["event"] == "stream_end" && e["completed"] == false).filter_map(|e| e["id"].as_str()).collect();
    let (mut input, mut output) = (0, 0);
    for e in entries.iter().filter(|e| e["event"] == "usage" && e["id"].as_str().is_some_and(|id| ids.contains(&id) && !cut.contains(&id))) {
        input += e["prompt_tokens"].as_u64().unwrap();
        output += e["completion_tokens"].as_u64().unwrap();
    }
    (input, output, ids.len() as u64)
}

/// A replay gateway of the long recording (deltas for 3.5 s at speed 1) at `speed`.
fn long_gateway(speed: f64) -> ReplayHandle {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cassettes/openclaw-2026.9.6-long.jsonl")).unwrap();
    ReplayGateway::start("127.0.0.1:0".parse().unwrap(), ReplayConfig::new(Cassette::parse(&text).unwrap()).speed(speed).token(GW_TOKEN)).unwrap()
}

/// Waits (bounded) until `app`'s log says `text`; `what` names it when it does not.
async fn until_logged(app: &Clawmux, text: &str, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !app.log().contains(text) {
        assert!(Instant::now() < deadline, "{what}: {}", app.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A streamed call of the run whose trace id is `trace` through `proxy`, read to its end in the
/// background: its status and body (with the error that cut it, if any).
fn stream_in_background(http: &reqwest::Client, proxy: &str, trace: &str, text: &str) -> tokio::task::JoinHandle<(u16, String)> {
    let (http, url, tp, body) = (http.clone(), format!("{proxy}/v1/chat/completions"), call_tp(trace), chat_body(text, true));
    tokio::spawn(async move {
        let resp = http.post(url).header("traceparent", tp).json(&body).send().await.unwrap();
        let status = resp.status().as_u16();
        let mut bytes = resp.bytes_stream();
        let mut body = String::new();
        while let Some(chunk) = bytes.next().await {
            match chunk {
                Ok(b) => body.push_str(&String::from_utf8_lossy(&b)),
                Err(e) => return (status, format!("{body}\n(cut: {e})")),
            }
        }
        (status, body)
    })
}

/// Waits (bounded) until the upstream saw a call whose last user message contains `text`.
async fn until_upstream_saw(llm: &FakeLlm, text: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !llm.entries().iter().any(|e| e["last_user"].as_str().is_some_and(|u| u.contains(text))) {
        assert!(Instant::now() < deadline, "the upstream never saw the call {text:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// True once the upstream finished a stream to its end.
fn upstream_completed_a_stream(llm: &FakeLlm) -> bool {
    llm.entries().iter().any(|e| e["event"] == "stream_end" && e["completed"] == true)
}

/// The stream `stream_in_background` reads went on to its end (`[DONE]`), and the upstream cut no
/// stream; `when`: what happened to its run meanwhile.
async fn went_on_to_its_end(stream: tokio::task::JoinHandle<(u16, String)>, llm: &FakeLlm, when: &str) {
    let (status, streamed) = tokio::time::timeout(Duration::from_secs(40), stream).await.expect("the stream hung").unwrap();
    assert_eq!(status, 200);
    assert!(streamed.contains("[DONE]"), "the stream in flight was cut when its run was {when}: {streamed}");
    let ends: Vec<Value> = llm.entries().into_iter().filter(|e| e["event"] == "stream_end").collect();
    assert!(ends.iter().all(|e| e["completed"] == true), "{ends:?}");
}

/// Waits (bounded) until `base` shows the run's usage as `(input, output, calls)`.
async fn until_usage(http: &reqwest::Client, base: &str, run_id: &str, want: (u64, u64, u64)) -> Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let d = doc(http, base, run_id).await;
        let u = &d["usage"];
        if (u["inputTokens"].as_u64(), u["outputTokens"].as_u64(), u["llmCalls"].as_u64()) == (Some(want.0), Some(want.1), Some(want.2)) {
            return d;
        }
        assert!(Instant::now() < deadline, "{base}: usage of {run_id} is not {want:?}: {d}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[actix_rt::test]
async fn pg_a_replica_forwards_the_calls_of_a_run_another_owns_billed_to_it_once_and_stops_when_it_ends() {
    let Some(url) = database("pg_a_replica_forwards_the_calls_of_a_run_another_owns").await else { return };
    let dir = common::temp_dir("xattr");
    let llm = FakeLlm::start(&dir.join("llm"));
    let gw = paused_gateway();
    let http = http();
    let key = format!("sk-upstream-{}", uuid::Uuid::new_v4().simple());
    let owner = replica("x0", &gw, &url, &llm, &key, &http).await;
    let other = replica("x1", &gw, &url, &llm, &key, &http).await;
    let (trace, traceparent) = new_traceparent();
    post_run(&http, &owner.app.base, "run-x", "acct-x", &traceparent).await;
    // Another replica refuses a second live run with the same trace id: calls could not be told apart.
    let twin = json!({"message": "twin", "billingAccountId": "acct-y", "runId": "run-twin"});
    let r = http.post(format!("{}/v1/runs?wait=false", other.app.base)).header("traceparent", &traceparent).json(&twin).send().await.unwrap();
    assert_eq!(r.status(), 409);
    // The run holding the trace id is another tenant's: the answer does not name it.
    let refused = r.text().await.unwrap();
    assert!(refused.contains("another live run uses this trace id") && !refused.contains("run-x"), "{refused}");

    // The other replica's proxy forwards it with the run's billing identity, whatever the call says.
    let (status, body) = call(&http, &other.proxy, Some(&call_tp(&trace)), &chat_body("hello XATTR1", false)).await;
    assert_eq!(status, 200, "{body}");
    let seen = llm.entries().into_iter().find(|e| e["last_user"].as_str().is_some_and(|u| u.contains("XATTR1"))).expect("the upstream saw the call");
    let h = &seen["headers"];
    assert_eq!((h["x-litellm-end-user-id"].as_str(), h["x-cogni-run-id"].as_str()), (Some("acct-x"), Some("run-x")), "{seen}");
    assert_eq!(h["authorization"], format!("Bearer {key}"));
    let meta: Value = serde_json::from_str(h["x-litellm-spend-logs-metadata"].as_str().unwrap()).unwrap();
    assert_eq!((meta["run_id"].as_str(), meta["session_key"].as_str()), (Some("run-x"), Some("agent:main:clawmux:acct-x.r.run-x")));

    // A burst, through both proxies: every call forwarded.
    let burst = (0..20).map(|i| {
        let (http, proxy, tp) = (http.clone(), if i % 2 == 0 { other.proxy.clone() } else { owner.proxy.clone() }, call_tp(&trace));
        async move { call(&http, &proxy, Some(&tp), &chat_body(&format!("burst {i}"), true)).await.0 }
    });
    assert!(futures_util::future::join_all(burst).await.iter().all(|s| *s == 200));

    // Protocol 3: the run's attribution token in the body, no traceparent.
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let token: String = sqlx::query_scalar("SELECT attribution_token FROM runs WHERE run_id = 'run-x'").fetch_one(&pool).await.unwrap();
    let p3 = json!({"model": "fake-model", "stream": false, "messages": [
        {"role": "system", "content": format!("You are helpful.\nclawmux-attribution: {token}\n(Billing ...)")},
        {"role": "user", "content": "hello XATTRP3"}]});
    let (status, body) = call(&http, &other.proxy, None, &p3).await;
    assert_eq!(status, 200, "{body}");
    let seen = llm.entries().into_iter().find(|e| e["last_user"].as_str().is_some_and(|u| u.contains("XATTRP3"))).expect("the upstream saw the call");
    assert_eq!(seen["headers"]["x-cogni-run-id"], "run-x");

    // Unknown trace id and token: refused, never forwarded.
    let (status, _) = call(&http, &other.proxy, Some(&new_traceparent().1), &chat_body("hello XATTRNOBODY", false)).await;
    assert_eq!(status, 409);
    let mut made_up = p3.clone();
    made_up["messages"][0]["content"] = json!(format!("clawmux-attribution: {}", clawmux::attribution::new_token()));
    assert_eq!(call(&http, &other.proxy, None, &made_up).await.0, 409);
    assert!(!llm.entries().iter().any(|e| e["last_user"].as_str().is_some_and(|u| u.contains("XATTRNOBODY"))));

    // Counted once, whichever proxy forwarded it: on the owner (live), the other (from the store).
    let bill = upstream_bill(&llm, "run-x");
    assert_eq!(bill.2, 22, "the calls the upstream saw for run-x");
    for base in [&owner.app.base, &other.app.base] {
        let d = until_usage(&http, base, "run-x", bill).await;
        assert_eq!(d["usage"]["source"], "proxy", "{d}");
    }
    // Every replica lists every call, whichever replica forwarded it.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let calls: Value = http.get(format!("{}/v1/runs/run-x/llm-calls", owner.app.base)).send().await.unwrap().json().await.unwrap();
        if calls["calls"].as_array().map(Vec::len) == Some(22) {
            break;
        }
        assert!(Instant::now() < deadline, "llm-calls on the owner: {calls}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A stream through the other proxy is cut when the run ends on its owner; later calls refused.
    let resp = http.post(format!("{}/v1/chat/completions", other.proxy)).header("traceparent", call_tp(&trace)).json(&chat_body("go SLOW XATTRCUT", true)).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    assert!(tokio::time::timeout(Duration::from_secs(10), stream.next()).await.unwrap().is_some_and(|c| c.is_ok()), "first chunk");
    let r = http.post(format!("{}/v1/runs/run-x/abort", owner.app.base)).send().await.unwrap();
    assert_eq!(r.status(), 202);
    let aborted = Instant::now();
    let cut = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(chunk) = stream.next().await {
            if chunk.is_err() {
                return;
            }
        }
    })
    .await;
    let took = aborted.elapsed();
    assert!(cut.is_ok(), "the stream was not cut within 10 s of the run's end");
    eprintln!("a remote run's stream cut {:.0} ms after the abort answer", took.as_secs_f64() * 1000.0);
    // Told by the store's notification (or found by the look every second when one is lost) and
    // cut: seconds at most, also through two processes and PostgreSQL on a busy machine. The
    // streams' bound is the run's end, not a minute later.
    assert!(took < Duration::from_secs(5), "cut after {took:?}");
    let (status, _) = call(&http, &other.proxy, Some(&call_tp(&trace)), &chat_body("hello XATTRLATE", false)).await;
    assert_eq!(status, 409, "a call of an ended run was forwarded");
    assert_eq!(call(&http, &other.proxy, None, &p3).await.0, 409, "a token of an ended run was accepted");

    // The cut call counts (it was forwarded), with no tokens (the upstream reports them at the end).
    let cut_id = llm.entries().into_iter().find(|e| e["last_user"].as_str().is_some_and(|u| u.contains("XATTRCUT"))).unwrap()["id"].clone();
    let deadline = Instant::now() + Duration::from_secs(10);
    // The upstream notices the cut at its next chunk (one a second).
    while !llm.entries().iter().any(|e| e["event"] == "stream_end" && e["id"] == cut_id) {
        assert!(Instant::now() < deadline, "the upstream never saw the stream end");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(llm.entries().iter().any(|e| e["event"] == "stream_end" && e["id"] == cut_id && e["completed"] == false), "the stream was not cut");
    let bill = upstream_bill(&llm, "run-x");
    assert_eq!(bill.2, 23);
    let d = until_usage(&http, &other.app.base, "run-x", bill).await;
    assert_eq!(d["status"], "aborted", "{d}");
    let stored: Vec<(String, i64)> = sqlx::query_as("SELECT replica, llm_calls FROM run_usage WHERE run_id = 'run-x' ORDER BY replica").fetch_all(&pool).await.unwrap();
    assert_eq!(stored, [("x0".to_owned(), 10), ("x1".to_owned(), 13)], "each replica's share");
    pool.close().await;
    let refusals = common::metric(&http, &other.app.base, "clawmux_proxy_refusals_total").await;
    assert!(refusals >= 4.0, "refusals counted: {refusals}");
    gw.stop().await;
}

#[actix_rt::test]
async fn pg_after_a_takeover_every_call_of_the_run_counts_once_whichever_proxy_forwarded_it() {
    let Some(url) = database("pg_after_a_takeover_every_call_counts_once").await else { return };
    let dir = common::temp_dir("xattr-takeover");
    // Streams of 6 s: one spans the takeover.
    let llm = FakeLlm::start_with(&dir.join("llm"), &[("FAKE_LLM_DELAY", "0.75")]);
    let gw = paused_gateway();
    let http = http();
    let key = format!("sk-upstream-{}", uuid::Uuid::new_v4().simple());
    let mut owner = replica("t0", &gw, &url, &llm, &key, &http).await;
    let other = replica("t1", &gw, &url, &llm, &key, &http).await;
    let (trace, traceparent) = new_traceparent();
    post_run(&http, &owner.app.base, "run-t", "acct-t", &traceparent).await;
    let before = [&owner.proxy, &owner.proxy, &other.proxy, &other.proxy, &other.proxy].map(|proxy| {
        let (http, proxy, tp) = (http.clone(), proxy.clone(), call_tp(&trace));
        async move { call(&http, &proxy, Some(&tp), &chat_body("before", true)).await.0 }
    });
    assert!(futures_util::future::join_all(before).await.iter().all(|s| *s == 200));
    until_usage(&http, &owner.app.base, "run-t", upstream_bill(&llm, "run-t")).await;
    // A stream through the survivor's proxy, in flight while the survivor takes the run over: its
    // tokens (at its end) count in the same share as the calls the survivor makes as the owner.
    let spanning = {
        let (http, proxy, tp) = (http.clone(), other.proxy.clone(), call_tp(&trace));
        tokio::spawn(async move { call(&http, &proxy, Some(&tp), &chat_body("spanning the takeover", true)).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    owner.app.kill_9();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while sqlx::query_scalar::<_, String>("SELECT owner FROM runs WHERE run_id = 'run-t'").fetch_one(&pool).await.unwrap() != "t1" {
        assert!(Instant::now() < deadline, "run-t was not taken over");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The survivor owns it now; its earlier calls and the new ones count in one share.
    let after = (0..2).map(|_| {
        let (http, proxy, tp) = (http.clone(), other.proxy.clone(), call_tp(&trace));
        async move { call(&http, &proxy, Some(&tp), &chat_body("after", true)).await.0 }
    });
    let (after, spanning) = futures_util::future::join(futures_util::future::join_all(after), spanning).await;
    assert!(after.iter().all(|s| *s == 200));
    let (status, text) = spanning.unwrap();
    assert!(status == 200 && text.contains("[DONE]"), "the spanning stream did not complete: {status} {text}");
    gw.set_paused(false);
    let deadline = Instant::now() + Duration::from_secs(30);
    while doc(&http, &other.app.base, "run-t").await["status"] != "ok" {
        assert!(Instant::now() < deadline, "run-t did not end: {}", doc(&http, &other.app.base, "run-t").await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let bill = upstream_bill(&llm, "run-t");
    assert_eq!(bill.2, 8);
    until_usage(&http, &other.app.base, "run-t", bill).await;
    let stored: Vec<(String, i64)> = sqlx::query_as("SELECT replica, llm_calls FROM run_usage WHERE run_id = 'run-t' ORDER BY replica").fetch_all(&pool).await.unwrap();
    assert_eq!(stored, [("t0".to_owned(), 2), ("t1".to_owned(), 6)]);
    // The final event's document (what clients and webhooks got) has the same usage.
    let fin: String = sqlx::query_scalar("SELECT data FROM events WHERE run_id = 'run-t' AND name = 'final'").fetch_one(&pool).await.unwrap();
    let fin: Value = serde_json::from_str(&fin).unwrap();
    assert_eq!(fin["usage"]["llmCalls"], 8, "{fin}");
    assert_eq!((fin["usage"]["inputTokens"].as_u64(), fin["usage"]["outputTokens"].as_u64()), (Some(bill.0), Some(bill.1)), "{fin}");
    pool.close().await;
    gw.stop().await;
}

/// A run taken over while its old owner is alive but cut from the database: when the old owner
/// hears it lost the run, an LLM stream in flight through its proxy goes on to its end (the run
/// goes on at the new owner; before, the old owner dropped its billing entry and cut the stream)
/// and counts once, in the old owner's share of the run's usage. Idle (a paused gateway: no
/// writes during the cut), the owner hears of the loss from its lease renewal.
#[actix_rt::test]
async fn pg_an_llm_stream_in_flight_at_an_owner_that_loses_its_run_goes_on_and_counts_once() {
    stream_through_a_lost_run(false).await;
}

/// The same with the run streaming: the owner's writes fail during the cut, so it suspends the
/// run, and when the database answers its take-back finds the run taken over (this usually comes
/// before the renewal's news).
#[actix_rt::test]
async fn pg_an_llm_stream_in_flight_at_an_owner_that_suspended_then_lost_its_run_goes_on_and_counts_once() {
    stream_through_a_lost_run(true).await;
}

async fn stream_through_a_lost_run(streaming: bool) {
    let tag = if streaming { "suspended" } else { "idle" };
    let Some(url) = database(&format!("pg_lost_inflight_{tag}")).await else { return };
    let (relay, relayed) = tcp_chaos::in_front_of_database(&url).await;
    let dir = common::temp_dir("xattr-lost-inflight");
    // 8 chunks 2 s apart: the stream outlasts the lease (3 s), the takeover and the news of it.
    let llm = FakeLlm::start_with(&dir.join("llm"), &[("FAKE_LLM_DELAY", "2.0")]);
    let gw = if streaming {
        // The long recording slowed down tenfold: deltas for ~35 s, past the stream's end.
        long_gateway(0.1)
    } else {
        paused_gateway()
    };
    let http = http();
    let key = format!("sk-upstream-{}", uuid::Uuid::new_v4().simple());
    let owner = replica("l0", &gw, relayed.as_str(), &llm, &key, &http).await;
    let other = replica("l1", &gw, &url, &llm, &key, &http).await;
    let (trace, traceparent) = new_traceparent();
    let body = json!({"message": "<lost> [track:long]", "billingAccountId": "acct-l", "runId": "run-l", "onDisconnect": "continue"});
    let r = http.post(format!("{}/v1/runs?wait=false", owner.app.base)).header("traceparent", &traceparent).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 202, "{:?}", r.text().await);
    common::wait_accepted(&http, &owner.app.base, "run-l").await;
    let stream = stream_in_background(&http, &owner.proxy, &trace, "in flight");
    until_upstream_saw(&llm, "in flight").await;
    // The owner is cut from the database: its lease runs out, the other replica takes the run.
    relay.refuse(true);
    relay.cut_all();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    until_owner(&pool, "run-l", "l1").await;
    if streaming {
        // Waited for, still cut: the takeover can come before the run's next event (the recording's
        // first delta is ~3.7 s in at a tenth of its speed, the lease 3 s), and the first write
        // that fails is what suspends it.
        until_logged(&owner.app, "suspending this run here", "the owner did not suspend the run while cut off").await;
    }
    relay.refuse(false);
    let heard = if streaming { "continued the runs suspended here" } else { "another replica took this run over" };
    until_logged(&owner.app, heard, "the old owner did not hear it lost the run").await;
    assert!(!upstream_completed_a_stream(&llm), "the upstream ended the stream before the old owner lost the run: this tested nothing");
    went_on_to_its_end(stream, &llm, "lost").await;
    let bill = upstream_bill(&llm, "run-l");
    assert_eq!(bill.2, 1, "{bill:?}");
    // Counted once, in the old owner's share, wherever the run's document is read.
    until_usage(&http, &other.app.base, "run-l", bill).await;
    until_usage(&http, &owner.app.base, "run-l", bill).await;
    let stored: Vec<(String, i64)> = sqlx::query_as("SELECT replica, llm_calls FROM run_usage WHERE run_id = 'run-l' ORDER BY replica").fetch_all(&pool).await.unwrap();
    assert_eq!(stored, [("l0".to_owned(), 1)]);
    pool.close().await;
    gw.stop().await;
}

/// `n` calls of the run whose trace id is `trace` through `proxy`, all forwarded.
async fn calls_through(http: &reqwest::Client, proxy: &str, trace: &str, n: usize, what: &str) {
    let calls = (0..n).map(|i| {
        let (http, proxy, tp) = (http.clone(), proxy.to_owned(), call_tp(trace));
        let text = format!("{what} {i}");
        async move { call(&http, &proxy, Some(&tp), &chat_body(&text, true)).await.0 }
    });
    assert!(futures_util::future::join_all(calls).await.iter().all(|s| *s == 200), "{what}: a call was not forwarded");
}

/// Waits (bounded) until `replica` owns `run_id` in the store.
async fn until_owner(pool: &sqlx::PgPool, run_id: &str, replica: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while sqlx::query_scalar::<_, String>("SELECT owner FROM runs WHERE run_id = $1").bind(run_id).fetch_one(pool).await.unwrap() != replica {
        assert!(Instant::now() < deadline, "{run_id} was not taken over by {replica}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A run taken over twice: first by a replica that forwarded NONE of its calls before (its share
/// starts empty, the old owner's is one of the others), then by one that DID (its counters of the
/// remote run are adopted, not added to its stored share), with a replica that never owned it
/// forwarding calls meanwhile. Each replica's share counts once everywhere: the owner's live
/// document (its counters plus the others' shares), every other replica's (the store's sum), the
/// final event, `run_usage` and `runs.usage`: all equal what the upstream saw (a review suspected
/// the claimer's share was summed twice after a takeover).
#[actix_rt::test]
async fn pg_a_run_taken_over_twice_counts_each_replica_share_once_in_every_document_and_row() {
    let Some(url) = database("pg_a_run_taken_over_twice_counts_each_share_once").await else { return };
    let dir = common::temp_dir("xattr-twice");
    let llm = FakeLlm::start(&dir.join("llm"));
    let gw = paused_gateway();
    let http = http();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let key = format!("sk-upstream-{}", uuid::Uuid::new_v4().simple());
    let mut first = replica("w0", &gw, &url, &llm, &key, &http).await;
    let mut second = replica("w1", &gw, &url, &llm, &key, &http).await;
    let (trace, traceparent) = new_traceparent();
    post_run(&http, &first.app.base, "run-w", "acct-w", &traceparent).await;
    // Through the owner only: w1 has no share and no counters of the run when it takes it over.
    calls_through(&http, &first.proxy, &trace, 2, "owner").await;
    let bill = upstream_bill(&llm, "run-w");
    assert_eq!(bill.2, 2);
    until_usage(&http, &second.app.base, "run-w", bill).await;
    first.app.kill_9();
    until_owner(&pool, "run-w", "w1").await;

    // A replica started after the takeover (it cannot have taken the run) forwards calls of it,
    // and so does the new owner: its live document is its counters plus w0's and w2's shares.
    let third = replica("w2", &gw, &url, &llm, &key, &http).await;
    calls_through(&http, &second.proxy, &trace, 2, "new owner").await;
    calls_through(&http, &third.proxy, &trace, 3, "not the owner").await;
    let bill = upstream_bill(&llm, "run-w");
    assert_eq!(bill.2, 7);
    for base in [&second.app.base, &third.app.base] {
        until_usage(&http, base, "run-w", bill).await;
    }

    // w2, which forwarded calls of the run, takes it over from w1: its share goes on from its
    // counters, w0's and w1's stay as they were.
    second.app.kill_9();
    until_owner(&pool, "run-w", "w2").await;
    until_usage(&http, &third.app.base, "run-w", bill).await;
    calls_through(&http, &third.proxy, &trace, 1, "last owner").await;
    gw.set_paused(false);
    let deadline = Instant::now() + Duration::from_secs(30);
    while doc(&http, &third.app.base, "run-w").await["status"] != "ok" {
        assert!(Instant::now() < deadline, "run-w did not end: {}", doc(&http, &third.app.base, "run-w").await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let bill = upstream_bill(&llm, "run-w");
    assert_eq!(bill.2, 8);
    until_usage(&http, &third.app.base, "run-w", bill).await;
    let stored: Vec<(String, i64)> = sqlx::query_as("SELECT replica, llm_calls FROM run_usage WHERE run_id = 'run-w' ORDER BY replica").fetch_all(&pool).await.unwrap();
    assert_eq!(stored, [("w0".to_owned(), 2), ("w1".to_owned(), 2), ("w2".to_owned(), 4)], "each replica's share");
    // The run's own column (written with its end from the last owner's totals) and the final
    // event's document (what clients and webhooks got) say the same.
    let column: String = sqlx::query_scalar("SELECT usage FROM runs WHERE run_id = 'run-w'").fetch_one(&pool).await.unwrap();
    let fin: String = sqlx::query_scalar("SELECT data FROM events WHERE run_id = 'run-w' AND name = 'final'").fetch_one(&pool).await.unwrap();
    let (column, fin): (Value, Value) = (serde_json::from_str(&column).unwrap(), serde_json::from_str(&fin).unwrap());
    for u in [&column, &fin["usage"]] {
        assert_eq!((u["inputTokens"].as_u64(), u["outputTokens"].as_u64(), u["llmCalls"].as_u64()), (Some(bill.0), Some(bill.1), Some(bill.2)), "{u}");
    }
    pool.close().await;
    gw.stop().await;
}

#[actix_rt::test]
async fn pg_a_budget_spent_through_another_replica_proxy_ends_the_run_budget_exceeded_at_its_owner() {
    let Some(url) = database("pg_a_budget_spent_through_another_replica").await else { return };
    let dir = common::temp_dir("xattr-budget");
    let llm = FakeLlm::start(&dir.join("llm"));
    let gw = paused_gateway();
    let http = http();
    let key = format!("sk-upstream-{}", uuid::Uuid::new_v4().simple());
    // Leases of 30 s (renewals every 10 s): only the store's wake-up explains a prompt stop.
    let owner = replica_with_lease("b0", &gw, &url, &llm, &key, &http, "30").await;
    let other = replica_with_lease("b1", &gw, &url, &llm, &key, &http, "30").await;
    // A budget smaller than one call's tokens (the fake LLM reports dozens).
    for base in [&owner.app.base, &other.app.base] {
        let r = http.put(format!("{base}/v1/admin/accounts/acct-b/limits")).json(&json!({"maxTokens": 5, "periodSec": 86400})).send().await.unwrap();
        assert_eq!(r.status(), 200, "{:?}", r.text().await);
    }
    let (trace, traceparent) = new_traceparent();
    post_run(&http, &owner.app.base, "run-b", "acct-b", &traceparent).await;
    assert_eq!(call(&http, &other.proxy, Some(&call_tp(&trace)), &chat_body("spend it", false)).await.0, 200);
    let (spent_input, spent_output, _) = upstream_bill(&llm, "run-b");
    // Charged to the account in the store, by the replica that forwarded it.
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while sqlx::query_scalar::<_, Option<i64>>("SELECT sum(tokens)::int8 FROM spend WHERE billing_account_id = 'acct-b'").fetch_one(&pool).await.unwrap()
        != Some((spent_input + spent_output) as i64)
    {
        assert!(Instant::now() < deadline, "the tokens were not charged to acct-b");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The next call is refused, and the run ends `budget_exceeded` at its owner before the answer.
    let asked = Instant::now();
    let (status, body) = call(&http, &other.proxy, Some(&call_tp(&trace)), &chat_body("one more", false)).await;
    assert_eq!(status, 409, "{body}");
    eprintln!("a budget stop through another replica: refused after {:.0} ms", asked.elapsed().as_secs_f64() * 1000.0);
    let d = doc(&http, &other.app.base, "run-b").await;
    assert_eq!((d["status"].as_str(), d["error"]["code"].as_str()), (Some("error"), Some("budget_exceeded")), "ended before the refusal was answered: {d}");
    assert!(gw.runs().iter().any(|r| r.message.contains("run-b") && r.abort_requests >= 1), "the owner cancelled the gateway run");
    pool.close().await;
    gw.stop().await;
}

/// A run suspended while its replica cannot reach the database (a partition shorter than its
/// lease) may meanwhile be taken over and ended elsewhere, and its trace id taken by another
/// account's run: its new calls through that replica's proxy are answered `503` with
/// `Retry-After: 1` (the gateway retries), not attributed to it; once the replica continues it,
/// they are forwarded again.
#[actix_rt::test]
async fn pg_a_suspended_run_calls_are_answered_503_until_its_replica_continues_it() {
    let Some(url) = database("pg_a_suspended_run_calls_are_answered_503").await else { return };
    let (relay, relayed) = tcp_chaos::in_front_of_database(&url).await;
    let dir = common::temp_dir("xattr-suspended");
    let llm = FakeLlm::start(&dir.join("llm"));
    // A long run whose deltas keep coming: the first write the database cannot take suspends it.
    let gw = long_gateway(0.3);
    let http = http();
    let key = format!("sk-upstream-{}", uuid::Uuid::new_v4().simple());
    let s0 = replica_with_lease("s0", &gw, relayed.as_str(), &llm, &key, &http, "10").await;
    let (trace, traceparent) = new_traceparent();
    let body = json!({"message": "<suspended> [track:long]", "billingAccountId": "acct-s", "runId": "run-s", "onDisconnect": "continue"});
    let r = http.post(format!("{}/v1/runs?wait=false", s0.app.base)).header("traceparent", &traceparent).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 202, "{:?}", r.text().await);
    common::wait_accepted(&http, &s0.app.base, "run-s").await;
    assert_eq!(call(&http, &s0.proxy, Some(&call_tp(&trace)), &chat_body("before", false)).await.0, 200);

    relay.refuse(true);
    relay.cut_all();
    until_logged(&s0.app, "suspending this run here", "the run was not suspended").await;
    let resp = http.post(format!("{}/v1/chat/completions", s0.proxy)).header("traceparent", call_tp(&trace)).json(&chat_body("while suspended", false)).send().await.unwrap();
    let (status, retry) = (resp.status().as_u16(), resp.headers().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_owned));
    let answer: Value = resp.json().await.unwrap();
    assert_eq!((status, retry.as_deref(), answer["error"]["code"].as_str()), (503, Some("1"), Some("attribution_unavailable")), "{answer}");
    assert!(!llm.entries().iter().any(|e| e["last_user"].as_str().is_some_and(|u| u.contains("while suspended"))), "forwarded");

    // The database answers again: the replica continues the run, whose calls are forwarded again.
    // Its document counts the call made before the outage all along (read between the attempts,
    // whichever way it is served: from the store, by the suspended or by the continued run).
    let before = upstream_bill(&llm, "run-s");
    relay.refuse(false);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut shown = Vec::new();
    loop {
        if let Ok(r) = http.get(format!("{}/v1/runs/run-s", s0.app.base)).send().await {
            if r.status() == 200 {
                let d: Value = r.json().await.unwrap();
                shown.push(d["usage"]["llmCalls"].as_u64().unwrap_or(0));
            }
        }
        let (status, body) = call(&http, &s0.proxy, Some(&call_tp(&trace)), &chat_body("after", false)).await;
        if status == 200 {
            break;
        }
        assert_eq!(status, 503, "{body}");
        assert!(Instant::now() < deadline, "the run's calls were not forwarded again: {}", s0.app.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let seen = llm.entries().into_iter().find(|e| e["last_user"].as_str().is_some_and(|u| u.contains("after"))).expect("the upstream saw the call");
    assert_eq!(seen["headers"]["x-cogni-run-id"], "run-s");
    assert!(shown.iter().all(|&n| n >= before.2), "the document forgot calls made before the outage: {shown:?} (the upstream saw {before:?})");
    until_usage(&http, &s0.app.base, "run-s", upstream_bill(&llm, "run-s")).await;
    gw.stop().await;
}

/// A streamed LLM call in flight while its run is suspended through a database outage and taken
/// back by its replica goes on to its end and counts once in the run's usage, beside the calls
/// made after. Before, taking the run back revoked the old billing entry (the proxy cut the
/// stream: the gateway's turn lost its LLM answer) and started a new counter from the store's
/// share beside the old one: the two overwrote each other's share of the run's usage.
#[actix_rt::test]
async fn pg_an_llm_stream_in_flight_through_a_suspension_and_take_back_goes_on_and_counts_once() {
    let Some(url) = database("pg_an_llm_stream_in_flight_through_a_take_back").await else { return };
    let (relay, relayed) = tcp_chaos::in_front_of_database(&url).await;
    let dir = common::temp_dir("xattr-inflight");
    // 8 chunks a second apart: the stream outlasts the outage and the take-back.
    let llm = FakeLlm::start_with(&dir.join("llm"), &[("FAKE_LLM_DELAY", "1.0")]);
    let gw = long_gateway(0.2);
    let http = http();
    let key = format!("sk-upstream-{}", uuid::Uuid::new_v4().simple());
    let s0 = replica_with_lease("s0", &gw, relayed.as_str(), &llm, &key, &http, "10").await;
    let (trace, traceparent) = new_traceparent();
    let body = json!({"message": "<in flight> [track:long]", "billingAccountId": "acct-f", "runId": "run-f", "onDisconnect": "continue"});
    let r = http.post(format!("{}/v1/runs?wait=false", s0.app.base)).header("traceparent", &traceparent).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 202, "{:?}", r.text().await);
    common::wait_accepted(&http, &s0.app.base, "run-f").await;
    let stream = stream_in_background(&http, &s0.proxy, &trace, "in flight");
    until_upstream_saw(&llm, "in flight").await;

    relay.refuse(true);
    relay.cut_all();
    until_logged(&s0.app, "suspending this run here", "the run was not suspended").await;
    relay.refuse(false);
    until_logged(&s0.app, "continued the runs suspended here", "the run was not taken back").await;
    assert!(!upstream_completed_a_stream(&llm), "the upstream ended the stream before the run was taken back: this tested nothing");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = call(&http, &s0.proxy, Some(&call_tp(&trace)), &chat_body("after", false)).await;
        if status == 200 {
            break;
        }
        assert_eq!(status, 503, "{body}");
        assert!(Instant::now() < deadline, "the run's calls were not forwarded again: {}", s0.app.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    went_on_to_its_end(stream, &llm, "taken back").await;
    let bill = upstream_bill(&llm, "run-f");
    assert_eq!(bill.2, 2, "two calls: {bill:?}");
    until_usage(&http, &s0.app.base, "run-f", bill).await;
    gw.stop().await;
}

/// A replica cut from the database cannot hear that another replica's run ended: once it has not
/// heard from the store for a while (5 s), that run's calls through its proxy are answered `503`
/// (the gateway retries) instead of forwarded and billed for a run that may be over; with the
/// database back, the end is heard and the calls are refused (`409`). Before, the cut replica kept
/// forwarding the ended run's calls for as long as it was cut off.
#[actix_rt::test]
async fn pg_a_replica_cut_from_the_database_stops_forwarding_other_replicas_runs() {
    let Some(url) = database("pg_cut_replica_stops_forwarding").await else { return };
    let (relay, relayed) = tcp_chaos::in_front_of_database(&url).await;
    let dir = common::temp_dir("xattr-cut");
    let llm = FakeLlm::start(&dir.join("llm"));
    let gw = paused_gateway();
    let http = http();
    let key = format!("sk-upstream-{}", uuid::Uuid::new_v4().simple());
    let owner = replica("c0", &gw, &url, &llm, &key, &http).await;
    let cut = replica_with_lease("c1", &gw, relayed.as_str(), &llm, &key, &http, "10").await;
    let (trace, traceparent) = new_traceparent();
    post_run(&http, &owner.app.base, "run-c", "acct-c", &traceparent).await;
    assert_eq!(call(&http, &cut.proxy, Some(&call_tp(&trace)), &chat_body("known CUTKNOWN", false)).await.0, 200, "forwarded for its owner");

    relay.refuse(true);
    relay.cut_all();
    let r = http.post(format!("{}/v1/runs/run-c/abort", owner.app.base)).send().await.unwrap();
    assert_eq!(r.status(), 202);
    let deadline = Instant::now() + Duration::from_secs(10);
    while doc(&http, &owner.app.base, "run-c").await["status"] != "aborted" {
        assert!(Instant::now() < deadline, "the owner did not end the run");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Within the trust window (5 s) and a look (1 s), with slack: every later call waits.
    let cut_at = Instant::now();
    let first_503 = loop {
        let (status, body) = call(&http, &cut.proxy, Some(&call_tp(&trace)), &chat_body("cut CUTLATE", false)).await;
        if status == 503 {
            assert!(body.contains("attribution_unavailable"), "{body}");
            break cut_at.elapsed();
        }
        assert_eq!(status, 200, "{body}");
        assert!(cut_at.elapsed() < Duration::from_secs(15), "the cut replica still forwards the ended run's calls: {}", cut.app.log());
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    eprintln!("a replica cut from the database answered a remote run's call 503 {:.1} s after the run ended", first_503.as_secs_f64());
    for _ in 0..5 {
        assert_eq!(call(&http, &cut.proxy, Some(&call_tp(&trace)), &chat_body("cut CUTLATE", false)).await.0, 503, "forwarded again while cut off");
    }

    relay.refuse(false);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body) = call(&http, &cut.proxy, Some(&call_tp(&trace)), &chat_body("back CUTBACK", false)).await;
        if status == 409 {
            break;
        }
        assert_eq!(status, 503, "{body}");
        assert!(Instant::now() < deadline, "the end was never heard once the database answered: {}", cut.app.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!llm.entries().iter().any(|e| e["last_user"].as_str().is_some_and(|u| u.contains("CUTBACK"))), "a call of the ended run was forwarded");
    gw.stop().await;
}
