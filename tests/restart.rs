//! Runs that outlive clawmux: the binary (a child process) killed with `kill -9` or stopped with
//! SIGTERM while hundreds of runs stream from a replay gateway, then started again on the same
//! SQLite store. Every run must end exactly once; a client re-attaching with the `Last-Event-ID`
//! it last saw gets every later event, no gap, no duplicate; the deltas add up to the content; an
//! idempotent re-POST finds the same run; and no run is started twice on the gateway.

#![allow(clippy::unwrap_used)]

mod common;
#[path = "common/child.rs"]
mod child;

use child::{attach, read_stream, Clawmux, Seen};
use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway, ReplayHandle, RunStatus};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

const GW_TOKEN: &str = "restart-gw-token";

/// The long recorded run (42 `chat` events over ~3.5 s), at half speed: ~7 s per run.
fn slow_gateway() -> ReplayHandle {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cassettes/openclaw-2026.9.6-long.jsonl")).unwrap();
    let cassette = Cassette::parse(&text).unwrap();
    let cfg = ReplayConfig::new(cassette).speed(0.5).token(GW_TOKEN);
    ReplayGateway::start("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
}

/// clawmux as a child process against `gw`, on a store of its own.
fn clawmux(gw: &ReplayHandle, extra: &[(&str, &str)]) -> Clawmux {
    let mut env = vec![("CLAWMUX_DEVICE_IDENTITY", "off")];
    env.extend_from_slice(extra);
    Clawmux::new(&gw.url(), GW_TOKEN, &env)
}

fn body(i: usize, tag: &str) -> Value {
    json!({"message": format!("<{tag}-{i}> [track:long]"), "billingAccountId": format!("acct-{}", i % 7), "onDisconnect": "continue"})
}

/// Posts `n` runs (202 at once, with an Idempotency-Key each); returns their run ids.
async fn post_runs(http: &reqwest::Client, base: &str, n: usize, tag: &str) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 0..n {
        let r = http
            .post(format!("{base}/v1/runs?wait=false"))
            .header("idempotency-key", format!("{tag}-idem-{i}"))
            .json(&body(i, tag))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202, "{:?}", r.text().await);
        let doc: Value = r.json().await.unwrap();
        ids.push(doc["runId"].as_str().unwrap().to_owned());
    }
    ids
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
    reqwest::Client::builder().pool_max_idle_per_host(256).build().unwrap()
}

#[actix_rt::test]
async fn kill_9_with_200_runs_in_flight_then_a_restart_loses_nothing() {
    const N: usize = 200;
    let gw = slow_gateway();
    let http = http();
    let mut app = clawmux(&gw, &[]);
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
#[actix_rt::test]
async fn sigterm_hands_runs_off_to_the_next_start() {
    const N: usize = 50;
    let gw = slow_gateway();
    let http = http();
    let mut app = clawmux(&gw, &[]);
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
#[actix_rt::test]
async fn sigterm_with_shutdown_cancel_cancels_every_run() {
    const N: usize = 20;
    let gw = slow_gateway();
    let http = http();
    let mut app = clawmux(&gw, &[("CLAWMUX_SHUTDOWN", "cancel")]);
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
