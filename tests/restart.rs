//! Runs that outlive clawmux: the binary (a child process) killed with `kill -9` or stopped with
//! SIGTERM while hundreds of runs stream from a replay gateway, then started again on the same
//! SQLite store. Every run must end exactly once; a client re-attaching with the `Last-Event-ID`
//! it last saw gets every later event, no gap, no duplicate; the deltas add up to the content; an
//! idempotent re-POST finds the same run; and no run is started twice on the gateway. Also: queued
//! runs keep their admission order, runs sent but not ACKed are sent again under their stored
//! idempotency key, a gateway restarted meanwhile ends the resumed runs, and a stopping process
//! answers `503` + `Retry-After` until it exits.
//!
//! Each test also runs on PostgreSQL as `pg_<name>` (a database of its own on the server
//! `CLAWMUX_TEST_PG_URL` names; skipped without it unless `CLAWMUX_REQUIRE_PG=1`).

#![allow(clippy::unwrap_used)]

mod common;
use common::on_sqlite_and_postgres;
#[path = "common/child.rs"]
mod child;

use child::{attach, read_stream, Clawmux, Seen};
use futures_util::StreamExt;
use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway, ReplayHandle, RunScript, RunStatus};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

const GW_TOKEN: &str = "restart-gw-token";

/// The long recorded run (42 `chat` events over ~3.5 s), at half speed: ~7 s per run.
fn slow_gateway() -> ReplayHandle {
    gateway_at(0.5)
}

/// The long recorded run at `speed` (1.0 = as recorded, ~3.5 s per run).
fn gateway_at(speed: f64) -> ReplayHandle {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cassettes/openclaw-2026.9.6-long.jsonl")).unwrap();
    let cassette = Cassette::parse(&text).unwrap();
    let cfg = ReplayConfig::new(cassette).speed(speed).token(GW_TOKEN);
    ReplayGateway::start("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
}

/// clawmux as a child process against `gw`, on a store of its own of `kind` (`sqlite`: a file in
/// its directory; `postgres`: a database of its own on the test server).
async fn clawmux(kind: &str, gw: &ReplayHandle, extra: &[(&str, &str)]) -> Clawmux {
    clawmux_and_database(kind, gw, extra).await.0
}

/// [`clawmux`], and the URL of its PostgreSQL database (`None` on SQLite).
async fn clawmux_and_database(kind: &str, gw: &ReplayHandle, extra: &[(&str, &str)]) -> (Clawmux, Option<String>) {
    let pg_url = match kind {
        "postgres" => {
            let server = std::env::var("CLAWMUX_TEST_PG_URL").expect("CLAWMUX_TEST_PG_URL");
            Some(clawmux::store::postgres::create_test_database(&server, "cmx_restart").await.unwrap())
        }
        _ => None,
    };
    let mut env = vec![("CLAWMUX_DEVICE_IDENTITY", "off")];
    if let Some(u) = &pg_url {
        env.push(("CLAWMUX_STORE_URL", u.as_str()));
    }
    env.extend_from_slice(extra);
    let app = Clawmux::new(&gw.url(), GW_TOKEN, &env);
    (app, pg_url)
}

fn body(i: usize, tag: &str) -> Value {
    json!({"message": format!("<{tag}-{i}> [track:long]"), "billingAccountId": format!("acct-{}", i % 7), "onDisconnect": "continue"})
}

/// Posts `n` runs (202 at once, with an Idempotency-Key each); returns their run ids.
async fn post_runs(http: &reqwest::Client, base: &str, n: usize, tag: &str) -> Vec<String> {
    // 16 at a time, in order (run i carries tag i): one after another, 200 POSTs on a busy
    // machine took long enough for the first runs to end before the last was posted.
    futures_util::stream::iter(0..n)
        .map(|i| async move { post_run(http, base, &body(i, tag), &format!("{tag}-idem-{i}")).await })
        .buffered(16)
        .collect()
        .await
}

/// Posts one run (`wait=false`: 202 at once); returns its run id.
async fn post_run(http: &reqwest::Client, base: &str, body: &Value, idempotency_key: &str) -> String {
    let r = http.post(format!("{base}/v1/runs?wait=false")).header("idempotency-key", idempotency_key).json(body).send().await.unwrap();
    assert_eq!(r.status(), 202, "{:?}", r.text().await);
    let doc: Value = r.json().await.unwrap();
    doc["runId"].as_str().unwrap().to_owned()
}

/// Attaches a reader to every run (from `Last-Event-ID` on; runs already ended are skipped).
async fn attach_all(http: &reqwest::Client, base: &str, seen: &HashMap<String, Arc<Mutex<Seen>>>, within: Duration) -> Vec<tokio::task::JoinHandle<()>> {
    let mut readers = Vec::new();
    for (id, s) in seen {
        if s.lock().unwrap().terminal().is_some() {
            continue;
        }
        let after = s.lock().unwrap().last_id();
        let resp = attach(http, base, id, after).await;
        readers.push(tokio::spawn(read_stream(resp, s.clone(), within)));
    }
    readers
}

/// Waits (bounded) until `check` holds.
async fn eventually(within: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn doc(http: &reqwest::Client, base: &str, run_id: &str) -> Value {
    http.get(format!("{base}/v1/runs/{run_id}")).send().await.unwrap().json().await.unwrap()
}

/// Every run: ids 1..=n without gap or repeat, `accepted` first, exactly one terminal event and it
/// is `final`, the deltas add up to the content, the content is the run's own.
fn check_runs(seen: &HashMap<String, Arc<Mutex<Seen>>>, ids: &[String], tag: &str) {
    let mut problems = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let s = seen[id].lock().unwrap();
        if let Some(p) = s.problems() {
            problems.push(format!("{id}: {}", p.chars().take(300).collect::<String>()));
            continue;
        }
        let content = s.terminal().unwrap().data["content"].as_str().unwrap_or_default().to_owned();
        if !content.starts_with(&format!("<{tag}-{i}> [track:long] | ")) {
            problems.push(format!("{id}: not its own content: {:?}", content.chars().take(60).collect::<String>()));
        }
    }
    assert!(problems.is_empty(), "{} of {} runs wrong:\n{}", problems.len(), ids.len(), problems.join("\n"));
}

/// No run was started twice on the gateway: one record per gateway run id, one per run.
fn check_gateway_ran_each_once(gw: &ReplayHandle, n: usize) {
    let runs = gw.runs();
    let mut per_id: HashMap<&str, usize> = HashMap::new();
    for r in &runs {
        *per_id.entry(r.run_id.as_str()).or_default() += 1;
    }
    assert!(per_id.values().all(|c| *c == 1), "a gateway run was started twice: {per_id:?}");
    assert_eq!(runs.len(), n, "gateway runs");
}

fn http() -> reqwest::Client {
    common::http_client(None)
}

async fn case_kill_9_with_200_runs_in_flight_then_a_restart_loses_nothing(kind: &str) {
    const N: usize = 200;
    // ~14 s per run: posting and attaching 200 runs on a busy machine must not outlast them (at
    // ~7 s, more than half could end before the kill: nothing left to test).
    let gw = gateway_at(0.25);
    let http = http();
    let mut app = clawmux(kind, &gw, &[]).await;
    app.start(&http).await;
    let ids = post_runs(&http, &app.base, N, "k9").await;
    let seen: HashMap<String, Arc<Mutex<Seen>>> = ids.iter().map(|id| (id.clone(), Arc::default())).collect();
    let mut readers = Vec::new();
    for id in &ids {
        let resp = attach(&http, &app.base, id, 0).await;
        readers.push(tokio::spawn(read_stream(resp, seen[id].clone(), Duration::from_secs(60))));
    }
    // Mid-stream: most runs have text, none has finished.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let streaming = seen.values().filter(|s| s.lock().unwrap().text().len() > 20).count();
        let finished = seen.values().filter(|s| s.lock().unwrap().terminal().is_some()).count();
        if streaming >= N / 2 || finished > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "runs did not stream ({streaming} streaming)");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    app.kill_9();
    for r in readers {
        r.await.unwrap();
    }
    let cut = seen.values().filter(|s| s.lock().unwrap().terminal().is_none()).count();
    assert!(cut >= N / 2, "the kill came too late to test anything: only {cut} runs were in flight");

    app.start(&http).await;
    let started = Instant::now();
    let mut readers = Vec::new();
    for id in &ids {
        let after = seen[id].lock().unwrap().last_id();
        if seen[id].lock().unwrap().terminal().is_some() {
            continue;
        }
        let resp = attach(&http, &app.base, id, after).await;
        readers.push(tokio::spawn(read_stream(resp, seen[id].clone(), Duration::from_secs(60))));
    }
    for r in readers {
        r.await.unwrap();
    }
    eprintln!("kill -9: {cut} runs cut; all ended {:.1} s after the restart", started.elapsed().as_secs_f64());
    check_runs(&seen, &ids, "k9");
    check_gateway_ran_each_once(&gw, N);
    // An idempotent re-POST after the restart returns the same run.
    for (i, id) in ids.iter().enumerate().step_by(17) {
        let r = http
            .post(format!("{}/v1/runs?wait=false", app.base))
            .header("idempotency-key", format!("k9-idem-{i}"))
            .json(&body(i, "k9"))
            .send()
            .await
            .unwrap();
        let doc: Value = r.json().await.unwrap();
        assert_eq!(doc["runId"].as_str(), Some(id.as_str()), "{doc}");
        assert_eq!(doc["status"], "ok", "{doc}");
    }
    check_gateway_ran_each_once(&gw, N);
}

/// SIGTERM with 50 runs streaming: the process hands the runs off (streams end without a terminal
/// event, no gateway run cancelled), and the next start finishes every one.
async fn case_sigterm_hands_runs_off_to_the_next_start(kind: &str) {
    const N: usize = 50;
    let gw = slow_gateway();
    let http = http();
    let mut app = clawmux(kind, &gw, &[]).await;
    app.start(&http).await;
    let ids = post_runs(&http, &app.base, N, "term").await;
    let seen: HashMap<String, Arc<Mutex<Seen>>> = ids.iter().map(|id| (id.clone(), Arc::default())).collect();
    let mut readers = Vec::new();
    for id in &ids {
        let resp = attach(&http, &app.base, id, 0).await;
        readers.push(tokio::spawn(read_stream(resp, seen[id].clone(), Duration::from_secs(60))));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen.values().filter(|s| s.lock().unwrap().text().len() > 20).count() < N / 2 {
        assert!(Instant::now() < deadline, "runs did not stream");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = app.sigterm();
    for r in readers {
        r.await.unwrap();
    }
    let handed_off = seen.values().filter(|s| s.lock().unwrap().terminal().is_none()).count();
    assert!(handed_off >= N / 2, "only {handed_off} runs were in flight at SIGTERM");
    // The streams ended cleanly, without a terminal event, and no gateway run was cancelled.
    assert!(gw.runs().iter().all(|r| !r.aborted), "SIGTERM cancelled gateway runs");
    eprintln!("SIGTERM: exited after {:.2} s with {handed_off} runs in flight", took.as_secs_f64());

    app.start(&http).await;
    let mut readers = Vec::new();
    for id in &ids {
        if seen[id].lock().unwrap().terminal().is_some() {
            continue;
        }
        let after = seen[id].lock().unwrap().last_id();
        let resp = attach(&http, &app.base, id, after).await;
        readers.push(tokio::spawn(read_stream(resp, seen[id].clone(), Duration::from_secs(60))));
    }
    for r in readers {
        r.await.unwrap();
    }
    check_runs(&seen, &ids, "term");
    check_gateway_ran_each_once(&gw, N);
    assert!(gw.runs().iter().all(|r| r.status == RunStatus::Ok && !r.aborted));
}

/// `CLAWMUX_SHUTDOWN=cancel`: the old behaviour: every run ends `aborted` and its gateway run is
/// cancelled; nothing is left for the next start.
async fn case_sigterm_with_shutdown_cancel_cancels_every_run(kind: &str) {
    const N: usize = 20;
    let gw = slow_gateway();
    let http = http();
    let mut app = clawmux(kind, &gw, &[("CLAWMUX_SHUTDOWN", "cancel")]).await;
    app.start(&http).await;
    let ids = post_runs(&http, &app.base, N, "cancel").await;
    let seen: HashMap<String, Arc<Mutex<Seen>>> = ids.iter().map(|id| (id.clone(), Arc::default())).collect();
    let mut readers = Vec::new();
    for id in &ids {
        let resp = attach(&http, &app.base, id, 0).await;
        readers.push(tokio::spawn(read_stream(resp, seen[id].clone(), Duration::from_secs(60))));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen.values().filter(|s| !s.lock().unwrap().text().is_empty()).count() < N {
        assert!(Instant::now() < deadline, "runs did not stream");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    app.sigterm();
    for r in readers {
        r.await.unwrap();
    }
    for id in &ids {
        let s = seen[id].lock().unwrap();
        let t = s.terminal().unwrap_or_else(|| panic!("{id}: no terminal event"));
        assert_eq!((t.event.as_str(), t.data["code"].as_str()), ("error", Some("aborted")), "{id}: {t:?}");
    }
    assert_eq!(gw.runs().iter().filter(|r| r.aborted).count(), N, "every gateway run cancelled");
    // Nothing is continued by the next start.
    app.start(&http).await;
    let v: Value = http.get(format!("{}/v1/runs?status=queued,running", app.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["runs"].as_array().map(Vec::len), Some(0), "{v}");
}

/// Four runs of one conversation (same account and `stateKey`) queue behind each other; clawmux is
/// killed while the first one streams. After the restart they run in their admission order, each
/// once, and the waiting ones say `queued`. Their run ids sort the other way round, so an order by
/// id (or by anything but admission) shows.
async fn case_kill_9_keeps_queued_runs_in_their_admission_order(kind: &str) {
    const N: usize = 4;
    let gw = gateway_at(2.0);
    let http = http();
    let mut app = clawmux(kind, &gw, &[]).await;
    app.start(&http).await;
    let mut ids = Vec::new();
    for i in 0..N {
        let mut b = body(i, "queue");
        b["billingAccountId"] = json!("acct-queue");
        b["stateKey"] = json!("conversation-1");
        b["runId"] = json!(format!("run-{}-queue", N - i));
        ids.push(post_run(&http, &app.base, &b, &format!("queue-idem-{i}")).await);
    }
    let seen: HashMap<String, Arc<Mutex<Seen>>> = ids.iter().map(|id| (id.clone(), Arc::default())).collect();
    let readers = attach_all(&http, &app.base, &seen, Duration::from_secs(60)).await;
    eventually(Duration::from_secs(30), "the first run streams", || !seen[&ids[0]].lock().unwrap().text().is_empty()).await;
    // Held where it is until the checks below ran (a paused run's clock stands still).
    gw.set_paused(true);
    app.kill_9();
    for r in readers {
        r.await.unwrap();
    }
    assert_eq!(gw.runs().len(), 1, "only the first run had reached the gateway");

    app.start(&http).await;
    assert_eq!(doc(&http, &app.base, &ids[0]).await["status"], "running");
    for id in &ids[1..] {
        let d = doc(&http, &app.base, id).await;
        assert_eq!(d["status"], "queued", "{d}");
    }
    gw.set_paused(false);
    for r in attach_all(&http, &app.base, &seen, Duration::from_secs(60)).await {
        r.await.unwrap();
    }
    check_runs(&seen, &ids, "queue");
    check_gateway_ran_each_once(&gw, N);
    let started: Vec<String> = gw.runs().iter().map(|r| r.message.clone()).collect();
    let admitted: Vec<String> = (0..N).map(|i| body(i, "queue")["message"].as_str().unwrap().to_owned()).collect();
    assert_eq!(started, admitted, "the gateway got the runs in another order than they were admitted");
    let mut finished = Vec::new();
    for id in &ids {
        finished.push(doc(&http, &app.base, id).await["finishedAt"].as_str().unwrap().to_owned());
    }
    assert!(finished.windows(2).all(|w| w[0] < w[1]), "finished out of admission order: {finished:?}");
}

/// clawmux dies after sending `agent` but before the gateway's ACK reached it: once with the ACK
/// lost (the gateway has the run), once with the request lost (it has not). After the restart both
/// are sent again under their stored idempotency keys: the first is deduped (`in_flight`), the
/// second starts; each runs once on the gateway and ends with its own text.
async fn case_kill_9_before_the_ack_sends_the_run_again_under_its_key_and_the_gateway_runs_it_once(kind: &str) {
    let gw = gateway_at(2.0);
    gw.script_runs("<ack-0>", RunScript { lose_ack: true, ..RunScript::default() });
    gw.lose_agent_requests("<ack-1>", 1);
    gw.set_paused(true);
    let http = http();
    let mut app = clawmux(kind, &gw, &[]).await;
    app.start(&http).await;
    let agents = |gw: &ReplayHandle| gw.stats().requests_received.get("agent").copied().unwrap_or(0);
    let mut ids = vec![post_run(&http, &app.base, &body(0, "ack"), "ack-idem-0").await];
    ids.push(post_run(&http, &app.base, &body(1, "ack"), "ack-idem-1").await);
    eventually(Duration::from_secs(20), "both agent requests sent", || agents(&gw) == 2).await;
    assert_eq!(gw.runs().len(), 1, "the ACK-less run is on the gateway, the lost one is not");
    // Stored once this returns: the run store commits in order, so the checkpoints written before
    // the two `agent` frames went out are stored too (the restart sees both as sent, not ACKed).
    ids.push(post_run(&http, &app.base, &body(2, "ack"), "ack-idem-2").await);
    for id in &ids[..2] {
        let d = doc(&http, &app.base, id).await;
        assert!(d["gatewayRunId"].is_null(), "{id} was acknowledged: {d}");
    }
    app.kill_9();

    app.start(&http).await;
    // Both are sent again; the lost one reaches the gateway this time.
    eventually(Duration::from_secs(20), "the lost run sent again", || gw.runs().iter().any(|r| r.message.starts_with("<ack-1>"))).await;
    gw.set_paused(false);
    let seen: HashMap<String, Arc<Mutex<Seen>>> = ids.iter().map(|id| (id.clone(), Arc::default())).collect();
    for r in attach_all(&http, &app.base, &seen, Duration::from_secs(60)).await {
        r.await.unwrap();
    }
    check_runs(&seen, &ids, "ack");
    check_gateway_ran_each_once(&gw, 3);
    for (i, id) in ids.iter().enumerate() {
        let d = doc(&http, &app.base, id).await;
        let rec = gw.runs().into_iter().find(|r| r.message.starts_with(&format!("<ack-{i}>"))).unwrap();
        assert_eq!(d["gatewayRunId"].as_str(), Some(rec.run_id.as_str()), "{id}: the gateway ran it under another key");
    }
    assert!(agents(&gw) >= 4, "the two runs were not sent again: {} agent requests", agents(&gw));
}

/// The gateway restarted while clawmux was down (a new boot id, its runs gone): every resumed run
/// ends `gateway_disconnected` as soon as clawmux is connected again, without waiting out its
/// timeout, and nothing is started on the new gateway in its place.
async fn case_kill_9_then_a_gateway_restart_ends_the_resumed_runs_gateway_disconnected(kind: &str) {
    const N: usize = 5;
    let gw = slow_gateway();
    let http = http();
    let mut app = clawmux(kind, &gw, &[]).await;
    app.start(&http).await;
    let mut ids = Vec::new();
    for i in 0..N {
        let mut b = body(i, "boot");
        // Far beyond the bound below: ending by the timeout would fail the test.
        b["timeoutSec"] = json!(120);
        ids.push(post_run(&http, &app.base, &b, &format!("boot-idem-{i}")).await);
    }
    let seen: HashMap<String, Arc<Mutex<Seen>>> = ids.iter().map(|id| (id.clone(), Arc::default())).collect();
    let readers = attach_all(&http, &app.base, &seen, Duration::from_secs(60)).await;
    eventually(Duration::from_secs(30), "every run streams", || seen.values().all(|s| !s.lock().unwrap().text().is_empty())).await;
    app.kill_9();
    for r in readers {
        r.await.unwrap();
    }
    gw.drop_connections(true);

    app.start(&http).await;
    for r in attach_all(&http, &app.base, &seen, Duration::from_secs(30)).await {
        r.await.unwrap();
    }
    for id in &ids {
        let s = seen[id].lock().unwrap();
        let t = s.terminal().unwrap_or_else(|| panic!("{id}: no terminal event within 30 s of the restart"));
        assert_eq!((t.event.as_str(), t.data["code"].as_str()), ("error", Some("gateway_disconnected")), "{id}: {t:?}");
    }
    assert_eq!(gw.runs().len(), N, "a resumed run was started on the restarted gateway");
    assert!(gw.runs().iter().all(|r| r.status == RunStatus::Forgotten));
}

/// An LLM upstream whose streamed answers send their first chunk at once and the rest only once
/// `release` is set: an LLM stream through clawmux's proxy that lasts as long as the test wants.
async fn held_upstream() -> (u16, tokio::sync::watch::Sender<bool>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (release, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let mut rx = rx.clone();
            tokio::spawn(async move {
                // The request: its head, then as many body bytes as it announces.
                let mut buf = Vec::new();
                let mut chunk = [0u8; 8192];
                loop {
                    let n = sock.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                        let len = head.lines().find_map(|l| l.strip_prefix("content-length:")).and_then(|v| v.trim().parse::<usize>().ok()).unwrap_or(0);
                        if buf.len() >= end + 4 + len {
                            break;
                        }
                    }
                }
                let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
                let first = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"held\"}}]}\n\n";
                let _ = sock.write_all(format!("{head}{first}").as_bytes()).await;
                let _ = rx.wait_for(|r| *r).await;
                let _ = sock.write_all(b"data: [DONE]\n\n").await;
            });
        }
    });
    (port, release)
}

/// SIGTERM (handoff) while an LLM stream of a run is in flight through the proxy: from the moment
/// live streams end until the process exits (the proxy lets the stream finish first), a new run is
/// refused with `503` + `Retry-After`, and so is re-attaching to the unfinished run (its stream
/// would end at once); documents are still served. Then the process exits on its own.
async fn case_sigterm_refuses_new_runs_with_503_and_retry_after_until_the_process_exits(kind: &str) {
    let gw = gateway_at(1.0);
    gw.set_paused(true);
    let (upstream_port, release) = held_upstream().await;
    let proxy = format!("127.0.0.1:{}", child::free_port());
    let upstream = format!("http://127.0.0.1:{upstream_port}");
    let http = http();
    let mut app = clawmux(kind, &gw, &[("CLAWMUX_PROXY_LISTEN", proxy.as_str()), ("CLAWMUX_LLM_UPSTREAM_URL", upstream.as_str())]).await;
    app.start(&http).await;
    let (_, traceparent) = common::new_traceparent();
    let r = http.post(format!("{}/v1/runs?wait=false", app.base)).header("traceparent", &traceparent).json(&body(0, "term503")).send().await.unwrap();
    assert_eq!(r.status(), 202);
    let id = r.json::<Value>().await.unwrap()["runId"].as_str().unwrap().to_owned();
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let reader = tokio::spawn(read_stream(attach(&http, &app.base, &id, 0).await, seen.clone(), Duration::from_secs(60)));
    eventually(Duration::from_secs(20), "the run is accepted", || seen.lock().unwrap().events.iter().any(|e| e.event == "accepted")).await;
    // One of its LLM calls, made as the gateway would (same trace id), in flight through the proxy.
    let llm = http.post(format!("http://{proxy}/v1/chat/completions")).header("traceparent", &traceparent).json(&common::chat_body("hi", true)).send().await.unwrap();
    assert_eq!(llm.status(), 200);
    let mut llm = llm.bytes_stream();
    let first = tokio::time::timeout(Duration::from_secs(20), llm.next()).await.unwrap().unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("held"));

    app.send_sigterm();
    // The handoff has begun once the live stream ended (without a terminal event).
    reader.await.unwrap();
    assert!(seen.lock().unwrap().terminal().is_none());
    for i in 0..3 {
        let r = http.post(format!("{}/v1/runs?wait=false", app.base)).json(&body(i + 1, "term503")).send().await.unwrap();
        let retry = r.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
        assert_eq!((r.status().as_u16(), retry.is_some_and(|s| s >= 1)), (503, true), "a new run during the handoff: {:?}", r.headers());
        let r = http.get(format!("{}/v1/runs/{id}/events", app.base)).header("last-event-id", "1").send().await.unwrap();
        let retry = r.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
        assert_eq!((r.status().as_u16(), retry.is_some_and(|s| s >= 1)), (503, true), "re-attaching during the handoff: {:?}", r.headers());
        assert_eq!(doc(&http, &app.base, &id).await["status"], "running");
    }
    // An abort of the run, whose actor is gone and whose log is still here: never `aborted:
    // false` (that says the run had finished, and the abort was lost: the next start ran it to
    // its end). One process: `503` + `Retry-After` (retry against the next start); on a shared
    // store: recorded for whoever continues it.
    let r = http.post(format!("{}/v1/runs/{id}/abort", app.base)).send().await.unwrap();
    let (status, retry) = (r.status().as_u16(), r.headers().get("retry-after").is_some());
    let answer = r.json::<Value>().await.unwrap_or(Value::Null);
    if kind == "postgres" {
        assert_eq!((status, &answer["aborted"]), (202, &json!(true)), "an abort during the handoff: {answer}");
    } else {
        assert_eq!((status, retry), (503, true), "an abort during the handoff: {answer}");
    }
    assert!(app.running(), "exited with an LLM stream in flight through its proxy");
    assert_eq!(gw.runs().len(), 1, "a run was admitted during the handoff");
    release.send_replace(true);
    let mut rest = String::new();
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(20), llm.next()).await.unwrap() {
        rest.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    assert!(rest.contains("[DONE]"), "the LLM stream was cut at shutdown: {rest:?}");
    app.wait_exit(Duration::from_secs(30));
    assert!(http.post(format!("{}/v1/runs?wait=false", app.base)).json(&body(9, "term503")).send().await.is_err(), "still answering after exit");
}

/// Stored contents are input too: after a `kill -9`, one run's stored events are damaged (an
/// event of a kind this version does not know, as a newer version could write during a rolling
/// upgrade). The restart ends that run `internal`, saying why, and continues every other run to
/// its `final` (before, it continued none: every run stayed unfinished).
async fn case_a_run_with_an_unreadable_stored_event_ends_internal_and_the_restart_continues_the_others(kind: &str) {
    const N: usize = 6;
    let gw = slow_gateway();
    let http = http();
    let (mut app, pg_url) = clawmux_and_database(kind, &gw, &[]).await;
    app.start(&http).await;
    let ids = post_runs(&http, &app.base, N, "damaged").await;
    let seen: HashMap<String, Arc<Mutex<Seen>>> = ids.iter().map(|id| (id.clone(), Arc::default())).collect();
    let readers = attach_all(&http, &app.base, &seen, Duration::from_secs(60)).await;
    eventually(Duration::from_secs(30), "every run streams", || seen.values().all(|s| s.lock().unwrap().text().len() > 20)).await;
    app.kill_9();
    for r in readers {
        r.await.unwrap();
    }
    let damaged = &ids[2];
    let statement = format!("UPDATE events SET name = 'from_a_newer_version' WHERE run_id = '{damaged}' AND id = 2");
    match &pg_url {
        Some(url) => {
            use sqlx::Connection;
            let mut c = sqlx::PgConnection::connect(url).await.unwrap();
            assert_eq!(sqlx::query(&statement).execute(&mut c).await.unwrap().rows_affected(), 1);
        }
        None => {
            let c = rusqlite::Connection::open(app.dir.join("runs.db")).unwrap();
            assert_eq!(c.execute(&statement, []).unwrap(), 1);
        }
    }

    app.start(&http).await;
    let last_seen = seen[damaged].lock().unwrap().last_id();
    let mut others = seen.clone();
    others.remove(damaged);
    for r in attach_all(&http, &app.base, &others, Duration::from_secs(60)).await {
        r.await.unwrap();
    }
    for (i, id) in ids.iter().enumerate() {
        if id == damaged {
            continue;
        }
        let s = seen[id].lock().unwrap();
        assert!(s.problems().is_none(), "{id}: {:?}", s.problems());
        let content = s.terminal().unwrap().data["content"].as_str().unwrap_or_default().to_owned();
        assert!(content.starts_with(&format!("<damaged-{i}> [track:long] | ")), "{id}: {content:?}");
    }
    let d = doc(&http, &app.base, damaged).await;
    assert_eq!((d["status"].as_str(), d["error"]["code"].as_str()), (Some("error"), Some("internal")), "{d}");
    assert!(d["error"]["message"].as_str().unwrap().contains("from_a_newer_version"), "{d}");
    // A client re-attaching to it gets its end, numbered after every event it had.
    let resp = attach(&http, &app.base, damaged, last_seen).await;
    let after = Arc::new(Mutex::new(Seen::default()));
    read_stream(resp, after.clone(), Duration::from_secs(10)).await;
    let end = after.lock().unwrap().terminal().cloned().expect("its end");
    assert_eq!((end.event.as_str(), end.data["code"].as_str()), ("error", Some("internal")), "{end:?}");
    assert!(end.id > last_seen, "{} after {last_seen}", end.id);
    let end_id = end.id;

    // Read from the store (the next start has no log of it in memory): every event it can read,
    // the damaged one left out, then its end; not an error the client would retry for good.
    app.kill_9();
    app.start(&http).await;
    let resp = attach(&http, &app.base, damaged, 0).await;
    assert_eq!(resp.status(), 200);
    let all = Arc::new(Mutex::new(Seen::default()));
    read_stream(resp, all.clone(), Duration::from_secs(10)).await;
    let ids: Vec<u64> = all.lock().unwrap().events.iter().map(|e| e.id).collect();
    let expected: Vec<u64> = (1..=end_id).filter(|id| *id != 2).collect();
    assert_eq!(ids, expected);
    assert_eq!(all.lock().unwrap().terminal().map(|e| e.event.clone()).as_deref(), Some("error"));
}

on_sqlite_and_postgres! {
    kill_9_with_200_runs_in_flight_then_a_restart_loses_nothing, pg_kill_9_with_200_runs_in_flight_then_a_restart_loses_nothing: case_kill_9_with_200_runs_in_flight_then_a_restart_loses_nothing;
    sigterm_hands_runs_off_to_the_next_start, pg_sigterm_hands_runs_off_to_the_next_start: case_sigterm_hands_runs_off_to_the_next_start;
    sigterm_with_shutdown_cancel_cancels_every_run, pg_sigterm_with_shutdown_cancel_cancels_every_run: case_sigterm_with_shutdown_cancel_cancels_every_run;
    kill_9_keeps_queued_runs_in_their_admission_order, pg_kill_9_keeps_queued_runs_in_their_admission_order: case_kill_9_keeps_queued_runs_in_their_admission_order;
    kill_9_before_the_ack_sends_the_run_again_under_its_key_and_the_gateway_runs_it_once, pg_kill_9_before_the_ack_sends_the_run_again_under_its_key_and_the_gateway_runs_it_once: case_kill_9_before_the_ack_sends_the_run_again_under_its_key_and_the_gateway_runs_it_once;
    kill_9_then_a_gateway_restart_ends_the_resumed_runs_gateway_disconnected, pg_kill_9_then_a_gateway_restart_ends_the_resumed_runs_gateway_disconnected: case_kill_9_then_a_gateway_restart_ends_the_resumed_runs_gateway_disconnected;
    sigterm_refuses_new_runs_with_503_and_retry_after_until_the_process_exits, pg_sigterm_refuses_new_runs_with_503_and_retry_after_until_the_process_exits: case_sigterm_refuses_new_runs_with_503_and_retry_after_until_the_process_exits;
    a_run_with_an_unreadable_stored_event_ends_internal_and_the_restart_continues_the_others, pg_a_run_with_an_unreadable_stored_event_ends_internal_and_the_restart_continues_the_others: case_a_run_with_an_unreadable_stored_event_ends_internal_and_the_restart_continues_the_others;
}
