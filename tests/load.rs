//! A small load run in the test suite: the replay gateway and clawmux in-process, the load driver
//! as a library call. 200 runs at concurrency 50, 20 deltas each, must all end `final` with zero
//! isolation violations; the per-call design against the same gateway must too, and pays for it
//! with broadcast frames. Timing is not asserted (that is `bench/run.sh`'s job).

#![allow(clippy::unwrap_used)]

mod common;

use clawmux::load::{self, LoadConfig, Mode};
use clawmux::replay::{ReplayConfig, ReplayGateway};
use common::{base, start_clawmux, wait_ready};
use std::time::Duration;

const TOKEN: &str = "load-test-gateway-token";

fn replay_config() -> ReplayConfig {
    // The bundled recording (tracks `cold` and `short`), 20 deltas per run, 5x recorded speed.
    ReplayConfig::default().speed(5.0).deltas_override(Some(20)).token(TOKEN)
}

#[actix_rt::test]
async fn two_hundred_runs_at_concurrency_fifty_are_isolated() {
    let gw = ReplayGateway::start("127.0.0.1:0".parse().unwrap(), replay_config()).unwrap();
    let running = start_clawmux(&gw.url(), Some(TOKEN), |_| {}).await;
    let url = base(&running);
    wait_ready(&reqwest::Client::new(), &url, Duration::from_secs(10)).await;

    let mut cfg = LoadConfig::new(url.clone());
    cfg.runs = 200;
    cfg.concurrency = 50;
    cfg.timeout = Duration::from_secs(30);
    cfg.deadline = Some(Duration::from_secs(120));
    let report = load::run(cfg).await.unwrap();
    assert_eq!(report.isolation_violations, 0, "{}", report.to_text());
    assert_eq!(report.finals, 200, "{}", report.to_text());
    assert!(report.all_good(), "{}", report.to_text());
    // 20 re-cut deltas per run reach the caller (a delta may carry more than one cut when
    // frames coalesce, never less text).
    assert!(report.text_deltas >= 200 * 10, "{}", report.to_text());
    let accepted = report.latency_ms.accepted.unwrap();
    assert_eq!(accepted.n, 200);

    // clawmux measured its own added latency for every delta it streamed.
    let observed = common::metric(&reqwest::Client::new(), &url, "clawmux_frame_to_client_seconds_count").await;
    assert!(observed >= 200.0 * 10.0, "frame-to-client latency observed for {observed} deltas");
    // And where each run's wait for `accepted` went, one sample per stage per run.
    for stage in ["admit", "turn", "configure", "gateway"] {
        let n = common::metric(&reqwest::Client::new(), &url, &format!("clawmux_run_start_seconds_count{{stage=\"{stage}\"}}")).await;
        assert_eq!(n, 200.0, "clawmux_run_start_seconds{{stage={stage}}}");
    }

    // The gateway sent all of it over ONE connection.
    let stats = gw.stats();
    assert_eq!(stats.handshakes_ok, 1, "{stats:?}");

    // The same load the per-call way, against the same gateway: isolated too (fail-closed
    // filtering), at the price of two handshakes per run and everyone's frames on every socket.
    let mut cfg = LoadConfig::new(url);
    cfg.runs = 100;
    cfg.concurrency = 25;
    cfg.timeout = Duration::from_secs(30);
    cfg.deadline = Some(Duration::from_secs(120));
    cfg.model = Some("cogni/fake-model".to_owned());
    cfg.mode = Mode::PerCall { gateway: gw.url(), token: Some(TOKEN.to_owned()) };
    let report = load::run(cfg).await.unwrap();
    assert!(report.all_good(), "{}", report.to_text());
    let frames = report.gateway_frames.clone().unwrap();
    assert_eq!(frames.handshakes, 200, "{}", report.to_text());
    assert!(frames.foreign_frames_dropped > 0, "{}", report.to_text());
    assert_eq!(gw.stats().handshakes_ok, 201);

    running.server.stop(true).await;
    gw.stop().await;
}

/// The checker is wired into the driver: a gateway that leaks another run's text into a stream is
/// reported as a violation, not passed.
#[actix_rt::test]
async fn a_leak_injected_by_the_gateway_is_reported() {
    // Broadcast delivery and a forged frame: another run's marker inside this run's chat text,
    // carrying this run's ids, is exactly what a leak looks like to the caller.
    let gw = ReplayGateway::start("127.0.0.1:0".parse().unwrap(), ReplayConfig::default().speed(1.0).token(TOKEN)).unwrap();
    let mut cfg = LoadConfig::new("http://unused".to_owned());
    cfg.runs = 1;
    cfg.concurrency = 1;
    cfg.timeout = Duration::from_secs(20);
    cfg.message = "[track:cold] leak probe".to_owned();
    cfg.mode = Mode::PerCall { gateway: gw.url(), token: Some(TOKEN.to_owned()) };
    let driver = tokio::spawn(load::run(cfg));
    // Wait for the run to be accepted (the cold track's first event comes 3.3 s after the ACK).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let run = loop {
        if let Some(r) = gw.runs().into_iter().next() {
            break r;
        }
        assert!(tokio::time::Instant::now() < deadline, "the run did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let foreign = "load-ffffffffffffffffffffffffffffffff";
    let frame = serde_json::json!({
        "type": "event", "event": "chat",
        "payload": {"runId": run.run_id, "sessionKey": run.session_key, "seq": 1, "state": "delta",
                    "message": {"role": "assistant", "content": [{"type": "text", "text": format!("leaked {foreign}")}]}},
    });
    assert!(gw.broadcast_raw(&frame.to_string()) >= 1);
    let report = driver.await.unwrap().unwrap();
    assert!(report.isolation_violations >= 1, "{}", report.to_text());
    assert!(report.violations_by_kind.contains_key("foreign_marker"), "{}", report.to_text());
    assert!(!report.all_good());
    gw.stop().await;
}
