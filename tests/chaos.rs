//! Chaos: clawmux against a hostile or faulty gateway, black-box through its HTTP API, `/metrics`
//! and `/readyz`, with the replay gateway's fault knobs (frames of any size, absurd numbers,
//! contradicting finals, frames for other runs, freeze, kill, restart, drop).
//!
//! Each test reproduces one defect found by chaos runs the way a gateway would trigger it, and
//! states the behaviour expected after the fix (the numbered list in the module's sections):
//! 1. frames up to the advertised `policy.maxPayload` are accepted; larger ones dropped and counted;
//! 2. reconnect hints (`restartExpectedMs`, `retryAfterMs`) are capped at the backoff maximum;
//! 3. a recovering run waits for its own end, not the generic request timeout, and a recovering run
//!    past its own timeout is cancelled on the gateway;
//! 4. absurd numbers (tick interval, max payload, `seq`, usage) are bounded;
//! 5. contradicting finals: one terminal event, the `agent` final `res` is the truth;
//! 6. thousands of misaddressed frames never reach a run, and are counted;
//! 7. freeze, kill (same process or restarted) and drop with long runs in flight;
//! 8. a gateway that answers a run's own requests wrongly (a malformed ACK, final or `agent.wait`
//!    answer, or one naming another session or run): the run ends `gateway_protocol_error` with one
//!    terminal event, nothing of the wrong answer reaches it, and its gateway run is cancelled.
//!
//! Every wait is bounded; sleeps only let time pass where the defect needs it to (a request
//! timeout, an outage), never to synchronise.

#![allow(clippy::unwrap_used)]

mod common;
#[path = "common/chaos.rs"]
mod harness;

use clawmux::replay::{ReplayConfig, RunRecord, RunScript, RunStatus, ScriptFrame};
use common::SseEvent;
use harness::*;
use rand::{Rng, SeedableRng};
use serde_json::json;
use std::collections::HashMap;
use std::time::Duration;
use tokio::time::Instant;

/// A short request timeout: generic calls give up after it, runs must not.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// The test backoff maximum (`common::start_clawmux_with` sets 50..500 ms).
const BACKOFF_MAX: Duration = Duration::from_millis(500);
/// What "within the backoff maximum" may take on a busy 2-core machine.
const RECONNECT_BOUND: Duration = Duration::from_secs(3);

// ------------------------------------------------------------------------------------------------
// 1. Large frames
// ------------------------------------------------------------------------------------------------

/// Holds a run, sends `frame`, then a correctly addressed delta: once the delta reaches the run,
/// the frame before it was handled (one connection, in order). Returns the env, the run and the
/// disconnect count before the frame, after checking that the delta arrived on the same connection.
async fn send_frame_before_a_sentinel(cfg: ReplayConfig, frame: &str, what: &str) -> (Env, Sse, String, f64) {
    let env = env(cfg).await;
    env.gw.set_paused(true);
    let m = unique("<big>");
    let mut sse = env.sse(&body(&m, "acct-big")).await;
    let acc = sse.accepted().await;
    let before = env.disconnects().await;
    assert_eq!(env.gw.broadcast_raw(frame), 1);
    let echo = format!("{m} [track:short] | ");
    env.gw.broadcast_raw(&chat_frame(&acc.session_key, &acc.gateway_run_id, "delta", &format!("{echo}Hel")));
    let sentinel = sse.until(Duration::from_secs(5), |e| e.event == "text_delta").await;
    let after = env.disconnects().await;
    assert!(
        sentinel.is_some() && after == before,
        "{what}: the delta sent after the {}-byte frame never reached the run (disconnects {before} -> {after}: {:?}; \
         gateway handshakes {}; clawmux's log has the close reason)",
        frame.len(),
        env.metric_lines("clawmux_gateway_disconnects_total").await,
        env.gw.stats().handshakes_ok
    );
    assert_eq!(env.gw.stats().handshakes_ok, 1, "{what}: clawmux reconnected");
    (env, sse, m, before)
}

#[actix_rt::test]
async fn a_frame_within_the_advertised_max_payload_is_accepted_without_a_disconnect() {
    // hello-ok advertises the real gateway's 26,214,400; this is the size of a real `health` event.
    let frame = padded_event("health", 4_718_587);
    let (env, mut sse, m, before) = send_frame_before_a_sentinel(fast(), &frame, "4,718,587-byte health").await;
    env.gw.set_paused(false);
    let fin = finish(&mut sse, WAIT, "after a large frame").await;
    assert_final_with(&fin, &sse, &answer(&m), "after a large frame");
    assert_eq!(env.disconnects().await, before);
    assert_eq!(env.metric("clawmux_gateway_frames_malformed_total").await, 0.0, "a valid frame is not malformed");
    assert_no_panics("a frame within the advertised max payload is accepted without a disconnect");
}

#[actix_rt::test]
async fn a_frame_above_the_advertised_max_payload_is_dropped_and_counted_without_a_disconnect() {
    // 2 MiB advertised (above clawmux's 1 MiB floor), 3 MiB sent.
    let frame = padded_event("health", 3 * MIB);
    let cfg = fast().advertise_max_payload(2 * MIB as u64);
    let (env, mut sse, m, before) = send_frame_before_a_sentinel(cfg, &frame, "3 MiB over a 2 MiB maxPayload").await;
    assert_eq!(env.metric("clawmux_gateway_frames_malformed_total").await, 1.0, "the oversized frame is counted");
    env.gw.set_paused(false);
    let fin = finish(&mut sse, WAIT, "after an oversized frame").await;
    assert_final_with(&fin, &sse, &answer(&m), "after an oversized frame");
    assert_eq!(env.disconnects().await, before);
    assert_no_panics("a frame above the advertised max payload is dropped and counted without a disconnect");
}

// ------------------------------------------------------------------------------------------------
// 2. Absurd reconnect hints
// ------------------------------------------------------------------------------------------------

/// Waits for the `n`-th successful handshake within [`RECONNECT_BOUND`].
async fn reconnected(env: &Env, n: u64, since: Instant, what: &str) {
    let deadline = since + RECONNECT_BOUND;
    while env.gw.stats().handshakes_ok < n {
        assert!(
            Instant::now() < deadline,
            "{what}: clawmux did not reconnect within {RECONNECT_BOUND:?} (backoff max {BACKOFF_MAX:?}); handshakes {}, /readyz {:?}",
            env.gw.stats().handshakes_ok,
            env.readyz().await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_ready_within(env, WAIT).await;
}

async fn wait_ready_within(env: &Env, within: Duration) {
    crate::common::wait_ready(&env.http, &env.base, within).await;
}

/// A run on a fresh session ends `final` with its text (bounded).
async fn a_run_works(env: &Env, what: &str) {
    let m = unique("<works>");
    let mut sse = env.sse(&body(&m, "acct-works")).await;
    let fin = finish(&mut sse, WAIT, what).await;
    assert_final_with(&fin, &sse, &answer(&m), what);
}

#[actix_rt::test]
async fn a_shutdown_with_an_absurd_restart_delay_reconnects_within_the_backoff_maximum() {
    let env = env(fast()).await;
    let t0 = Instant::now();
    env.gw.send_shutdown(Some(u64::MAX));
    let e = &env;
    eventually(WAIT, "the shutdown is seen", || async move { e.metric("clawmux_gateway_disconnects_total{reason=\"shutdown\"}").await == 1.0 })
        .await;
    reconnected(&env, 2, t0, "shutdown with restartExpectedMs 18446744073709551615").await;
    a_run_works(&env, "after the shutdown").await;
    assert_no_panics("a shutdown with an absurd restart delay reconnects within the backoff maximum");
}

#[actix_rt::test]
async fn an_unavailable_refusal_with_an_absurd_retry_after_is_retried_within_the_backoff_maximum() {
    // At start-up ...
    let gw = gateway(fast());
    gw.set_unavailable_connects_retry_after(1, u64::MAX);
    let t0 = Instant::now();
    let env = env_on(gw, |_| {}).await;
    reconnected(&env, 1, t0, "UNAVAILABLE retryAfterMs 18446744073709551615 at start").await;
    assert_eq!(env.gw.stats().handshakes_failed, 1);
    // ... and on a reconnect.
    env.gw.set_unavailable_connects_retry_after(1, u64::MAX);
    let t0 = Instant::now();
    env.gw.drop_connections(false);
    reconnected(&env, 2, t0, "UNAVAILABLE retryAfterMs 18446744073709551615 on reconnect").await;
    assert_eq!(env.gw.stats().handshakes_failed, 2);
    a_run_works(&env, "after the refusals").await;
    assert_no_panics("an unavailable refusal with an absurd retry after is retried within the backoff maximum");
}

// ------------------------------------------------------------------------------------------------
// 3. Recovery after a reconnect to the same gateway process
// ------------------------------------------------------------------------------------------------

#[actix_rt::test]
async fn a_long_run_outlasting_the_request_timeout_after_a_reconnect_ends_final_with_its_full_text() {
    let cfg = long();
    let recorded = recorded_answer(&cfg, "long");
    let env = env_with(cfg, |s| s.request_timeout = REQUEST_TIMEOUT).await;
    let m = unique("<long-recovery>");
    let mut sse = env.sse(&body_on("long", &m, "acct-long")).await;
    let acc = sse.accepted().await;
    sse.until(WAIT, |e| e.event == "text_delta").await.expect("the run is streaming");

    // Mid-stream: hold the run on the gateway, drop the connection. clawmux reconnects to the same
    // gateway process (same boot id) and asks `agent.wait`; the run goes on longer than the
    // generic request timeout, as long runs do.
    env.gw.set_paused(true);
    env.gw.drop_connections(false);
    let e = &env;
    eventually(WAIT, "agent.wait after the reconnect", || async move { e.requests("agent.wait") >= 1 }).await;
    tokio::time::sleep(REQUEST_TIMEOUT + Duration::from_secs(1)).await;
    env.gw.set_paused(false);

    let fin = finish(&mut sse, WAIT, "long run across a reconnect").await;
    assert_final_with(&fin, &sse, &answer_on("long", &m, &recorded), "long run across a reconnect");
    assert_eq!(env.gw_run(&acc.gateway_run_id).status, RunStatus::Ok);
    assert!(!env.gw_run(&acc.gateway_run_id).aborted);
    assert_no_panics("a long run outlasting the request timeout after a reconnect ends final with its full text");
}

#[actix_rt::test]
async fn a_recovering_run_past_its_own_timeout_ends_timeout_and_is_cancelled_on_the_gateway() {
    let env = env_with(fast(), |s| {
        s.request_timeout = Duration::from_secs(1);
        s.abort_grace = Duration::from_secs(1);
    })
    .await;
    env.gw.set_paused(true);
    let mut b = body(&unique("<recovering-timeout>"), "acct-rt");
    b["timeoutSec"] = json!(4);
    let t0 = Instant::now();
    let mut sse = env.sse(&b).await;
    let acc = sse.accepted().await;
    env.gw.drop_connections(false);
    let e = &env;
    eventually(WAIT, "agent.wait after the reconnect", || async move { e.requests("agent.wait") >= 1 }).await;

    // The gateway keeps the run (paused) past the run's own 4 s timeout.
    let fin = finish(&mut sse, WAIT, "recovering run past its timeout").await;
    let took = t0.elapsed();
    assert_error(&fin, "timeout", "recovering run past its timeout");
    assert!(took >= Duration::from_millis(3900), "ended after {took:?}, before its 4 s timeout");
    assert_eq!(env.doc(&acc.run_id).await["status"], "timeout");
    let gid = acc.gateway_run_id.clone();
    eventually(WAIT, "the timed-out run is cancelled on the gateway", || {
        let gid = gid.clone();
        async move { e.gw_run(&gid).aborted }
    })
    .await;
    env.gw.set_paused(false);
    assert_no_panics("a recovering run past its own timeout ends timeout and is cancelled on the gateway");
}

#[actix_rt::test]
async fn a_run_whose_timeout_expires_while_the_gateway_is_unreachable_is_cancelled_when_it_returns() {
    let env = env_with(fast(), |s| s.abort_grace = Duration::from_secs(1)).await;
    env.gw.set_paused(true);
    let mut b = body(&unique("<orphan>"), "acct-orphan");
    b["timeoutSec"] = json!(2);
    let mut sse = env.sse(&b).await;
    let acc = sse.accepted().await;

    // The gateway becomes unreachable (its process and the run live on) until after the timeout.
    env.gw.set_listening(false);
    env.gw.drop_connections(false);
    let fin = finish(&mut sse, WAIT, "timeout while unreachable").await;
    assert_error(&fin, "timeout", "timeout while unreachable");
    env.gw.set_listening(true);
    wait_ready_within(&env, WAIT).await;

    // The run has no owner any more: clawmux must cancel it now that it can.
    let gid = acc.gateway_run_id.clone();
    let e = &env;
    let deadline = Instant::now() + WAIT;
    while !e.gw_run(&gid).aborted {
        assert!(
            Instant::now() < deadline,
            "the gateway run was left running with no owner after its timeout: {:?}",
            e.gw_run(&gid)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    env.gw.set_paused(false);
    assert_no_panics("a run whose timeout expires while the gateway is unreachable is cancelled when it returns");
}

// ------------------------------------------------------------------------------------------------
// 4. Absurd numbers
// ------------------------------------------------------------------------------------------------

/// Under an absurd hello-ok `policy`, clawmux becomes ready, a held run gets a frame of
/// `big_frame` bytes (if any) and a delta, and ends `final` with its text; the connection stays
/// (at most `spurious_disconnects` of them: see the zero tick interval).
async fn bounded_policy(what: &str, cfg: ReplayConfig, big_frame: Option<usize>, spurious_disconnects: f64) {
    let env = env(cfg).await;
    env.gw.set_paused(true);
    let m = unique("<policy>");
    let mut sse = env.sse(&body(&m, "acct-policy")).await;
    if sse.until(WAIT, |e| e.event == "accepted").await.is_none() {
        panic!(
            "{what}: the run was never accepted within {WAIT:?}; disconnects {}, malformed frames {}, events {:?}",
            env.disconnects().await,
            env.metric("clawmux_gateway_frames_malformed_total").await,
            sse.events
        );
    }
    let acc = accepted_of(&sse);
    if let Some(len) = big_frame {
        env.gw.broadcast_raw(&padded_event("health", len));
    }
    let echo = format!("{m} [track:short] | ");
    env.gw.broadcast_raw(&chat_frame(&acc.session_key, &acc.gateway_run_id, "delta", &format!("{echo}Hel")));
    let delta = sse.until(Duration::from_secs(5), |e| e.event == "text_delta").await;
    assert!(delta.is_some(), "{what}: a delta did not reach its run; disconnects {}", env.disconnects().await);
    // Several liveness checks (every 250 ms) pass with the absurd interval in force.
    tokio::time::sleep(Duration::from_millis(600)).await;
    env.gw.set_paused(false);
    let fin = finish(&mut sse, WAIT, what).await;
    assert_final_with(&fin, &sse, &answer(&m), what);
    assert_eq!(env.readyz().await.0, 200, "{what}: not ready");
    let disconnects = env.disconnects().await;
    assert!(disconnects <= spurious_disconnects, "{what}: the connection dropped {disconnects} times");
    a_run_works(&env, what).await;
    assert_no_panics(what);
}

/// What the (already read) `accepted` event says.
fn accepted_of(sse: &Sse) -> Accepted {
    let ev = sse.events.iter().find(|e| e.event == "accepted").expect("accepted");
    let s = |k: &str| ev.data[k].as_str().unwrap().to_owned();
    Accepted { run_id: s("runId"), session_key: s("sessionKey"), gateway_run_id: s("gatewayRunId") }
}

#[actix_rt::test]
async fn a_zero_tick_interval_in_hello_ok_is_clamped() {
    // Clamped to 100 ms, a gateway ticking every 20 ms is alive. Unclamped, every liveness check
    // (every 250 ms) would find it dead. One spurious timeout is tolerated: 200 ms of silence is
    // within reach of a starved test thread on a busy machine.
    bounded_policy("tickIntervalMs 0", fast().tick_interval_ms(20).advertise_tick_interval_ms(0), None, 1.0).await;
}

#[actix_rt::test]
async fn a_u64_max_tick_interval_in_hello_ok_is_clamped() {
    bounded_policy("tickIntervalMs u64::MAX", fast().tick_interval_ms(20).advertise_tick_interval_ms(u64::MAX), None, 0.0).await;
}

#[actix_rt::test]
async fn a_zero_max_payload_in_hello_ok_is_floored() {
    bounded_policy("maxPayload 0", fast().advertise_max_payload(0), None, 0.0).await;
}

#[actix_rt::test]
async fn a_u64_max_max_payload_in_hello_ok_is_capped_and_a_5_mb_frame_passes() {
    bounded_policy("maxPayload u64::MAX", fast().advertise_max_payload(u64::MAX), Some(5_000_000), 0.0).await;
}

#[actix_rt::test]
async fn absurd_seq_and_usage_numbers_leave_runs_intact() {
    let env = env(fast()).await;

    // seq u64::MAX (per run and per connection), one past it, negative: then the recorded stream.
    env.gw.set_paused(true);
    let m = unique("<seq>");
    let mut sse = env.sse(&body(&m, "acct-seq")).await;
    let acc = sse.accepted().await;
    let (sk, gid) = (acc.session_key.as_str(), acc.gateway_run_id.as_str());
    let echo = format!("{m} [track:short] | ");
    let chat = |seq: &str, top: &str, text: &str| {
        format!(
            r#"{{"type":"event","event":"chat","seq":{top},"payload":{{"runId":"{gid}","sessionKey":"{sk}","seq":{seq},"state":"delta","message":{{"role":"assistant","content":[{{"type":"text","text":"{echo}{text}"}}]}}}}}}"#
        )
    };
    let max = u64::MAX.to_string();
    for f in [
        chat(&max, &max, "H"),
        chat("18446744073709551616", "1", "He"),
        chat("-1", "-1", "Hel"),
        format!(r#"{{"type":"event","event":"agent","seq":{max},"payload":{{"runId":"{gid}","sessionKey":"{sk}","seq":{max},"stream":"lifecycle","data":{{"phase":"start"}}}}}}"#),
        format!(r#"{{"type":"event","event":"tick","seq":{max},"payload":{{"ts":{max}}}}}"#),
    ] {
        env.gw.broadcast_raw(&f);
    }
    sse.until(WAIT, |e| e.event == "text_delta").await.expect("a delta with seq u64::MAX is still the run's text");
    env.gw.set_paused(false);
    let fin = finish(&mut sse, WAIT, "absurd seq").await;
    assert_final_with(&fin, &sse, &answer(&m), "absurd seq");

    // Huge usage numbers in the final's result.meta.agentMeta.usage.
    let marker = unique("<usage>");
    let usage = json!({"input": u64::MAX, "output": u64::MAX, "cacheRead": 1e308, "cacheWrite": -1, "total": u64::MAX});
    env.gw.script_runs(&marker, RunScript { final_patch: Some(json!({"result": {"meta": {"agentMeta": {"usage": usage}}}})), ..RunScript::default() });
    let mut sse = env.sse(&body(&marker, "acct-usage")).await;
    let acc = sse.accepted().await;
    let fin = finish(&mut sse, WAIT, "huge usage").await;
    assert_final_with(&fin, &sse, &answer(&marker), "huge usage");
    let doc = env.doc(&acc.run_id).await;
    assert_eq!((doc["status"].as_str(), doc["content"].as_str()), (Some("ok"), Some(answer(&marker).as_str())), "{doc}");
    let r = env.http.get(env.url("/metrics")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(env.readyz().await.0, 200);
    assert_eq!(env.disconnects().await, 0.0);
    assert_no_panics("absurd seq and usage numbers leave runs intact");
}

// ------------------------------------------------------------------------------------------------
// 5. Contradicting finals
// ------------------------------------------------------------------------------------------------

#[actix_rt::test]
async fn contradicting_finals_end_each_run_once_with_the_agent_final_res_content() {
    let env = env(fast()).await;
    let late_after = |frames: Vec<ScriptFrame>| RunScript { after_final: frames, ..RunScript::default() };
    // (case, script for the run's echo `e`, the content expected)
    type Case = (&'static str, Box<dyn Fn(&str) -> RunScript>, Box<dyn Fn(&str) -> String>);
    let cases: Vec<Case> = vec![
        (
            "res-differs-from-chat",
            Box::new(|e: &str| RunScript {
                final_patch: Some(json!({"result": {"payloads": [{"text": format!("{e}the authoritative answer"), "mediaUrl": null}]}})),
                ..RunScript::default()
            }),
            Box::new(|e: &str| format!("{e}the authoritative answer")),
        ),
        (
            "chat-final-differs",
            Box::new(|e: &str| RunScript { before_final: vec![ScriptFrame::chat("final", format!("{e}WRONG chat final"))], ..RunScript::default() }),
            Box::new(|e: &str| format!("{e}{}", recorded_answer(&fast(), "short"))),
        ),
        (
            "chat-error-after-res",
            Box::new(move |_e: &str| late_after(vec![ScriptFrame::chat("error", "WRONG late failure")])),
            Box::new(|e: &str| format!("{e}{}", recorded_answer(&fast(), "short"))),
        ),
        (
            "second-final-res",
            Box::new(move |e: &str| {
                late_after(vec![
                    ScriptFrame::Res(json!({"status": "error", "summary": "WRONG second final", "result": {"payloads": [{"text": format!("{e}WRONG second")}]}})),
                    ScriptFrame::Res(json!({"status": "ok", "summary": "completed", "result": {"payloads": [{"text": format!("{e}WRONG third")}]}})),
                ])
            }),
            Box::new(|e: &str| format!("{e}{}", recorded_answer(&fast(), "short"))),
        ),
        (
            "chat-error-then-ok-res",
            Box::new(|_e: &str| RunScript { before_final: vec![ScriptFrame::chat("error", "WRONG early failure")], ..RunScript::default() }),
            Box::new(|e: &str| format!("{e}{}", recorded_answer(&fast(), "short"))),
        ),
        (
            "aborted-then-ok",
            Box::new(|e: &str| RunScript { before_final: vec![ScriptFrame::chat("aborted", format!("{e}Hello from"))], ..RunScript::default() }),
            Box::new(|e: &str| format!("{e}{}", recorded_answer(&fast(), "short"))),
        ),
    ];

    let unmatched_before = env.metric("clawmux_gateway_responses_unmatched_total").await;
    let mut runs = Vec::new();
    for (i, (name, script, expected)) in cases.iter().enumerate() {
        let m = unique(&format!("<{name}>"));
        let echo = format!("{m} [track:short] | ");
        env.gw.script_runs(&m, script(&echo));
        let sse = env.sse(&body(&m, &format!("acct-contra-{i}"))).await;
        runs.push((*name, sse, expected(&echo)));
    }
    let mut ids = Vec::new();
    for (name, sse, expected) in &mut runs {
        let fin = finish(sse, WAIT, name).await;
        assert_eq!(fin.event, "final", "{name}: {}", fin.data);
        assert_eq!(fin.data["content"].as_str(), Some(expected.as_str()), "{name}: the agent final res is the truth");
        let run_id = sse.events[0].data["runId"].as_str().unwrap().to_owned();
        ids.push((*name, run_id, sse.events.len(), expected.clone()));
    }
    // The late frames reached clawmux: the two extra `res` match no request, and a frame sent now
    // (after every late frame, on the same connection) has been handled ...
    let e = &env;
    eventually(WAIT, "the duplicate final res frames arrive", || async move {
        e.metric("clawmux_gateway_responses_unmatched_total").await >= unmatched_before + 2.0
    })
    .await;
    let missing_run_id = "clawmux_gateway_frames_dropped_total{reason=\"missing_run_id\"}";
    let sentinel_before = env.metric(missing_run_id).await;
    let sentinel = json!({"type": "event", "event": "chat", "payload": {
        "sessionKey": "agent:main:sentinel", "state": "delta",
        "message": {"role": "assistant", "content": [{"type": "text", "text": "sentinel"}]},
    }});
    env.gw.broadcast_raw(&sentinel.to_string());
    eventually(WAIT, "the sentinel after the late frames is handled", || async move {
        e.metric(missing_run_id).await == sentinel_before + 1.0
    })
    .await;
    // ... and changed nothing: the documents and the stored streams are as they ended.
    for (name, run_id, n_events, expected) in &ids {
        let doc = env.doc(run_id).await;
        assert_eq!((doc["status"].as_str(), doc["content"].as_str()), (Some("ok"), Some(expected.as_str())), "{name}: {doc}");
        let mut again = env.reattach(run_id).await;
        assert!(again.read_to_end(WAIT).await, "{name}: re-attaching to a finished run must replay and close");
        assert_eq!(again.events.len(), *n_events, "{name}: events after the terminal event: {:?}", again.events);
        assert_stream_shape(&again, name);
    }
    assert_no_panics("contradicting finals end each run once with the agent final res content");
}

// ------------------------------------------------------------------------------------------------
// 6. Thousands of misaddressed frames
// ------------------------------------------------------------------------------------------------

/// A target of a generated frame: which session key and which run id it carries.
#[derive(Debug, Clone)]
enum KeyPick {
    Real(usize),
    Upper(usize),
    Foreign(u32),
    Missing,
    Empty,
}

/// What clawmux must do with a frame carrying `sk` and `run`, given the runs' (session key,
/// gateway run id): deliver it to run `i` (both match exactly), or drop it for `reason`.
fn routing(runs: &[(String, String)], sk: Option<&str>, run: Option<&str>) -> Result<usize, &'static str> {
    let sk = sk.filter(|s| !s.is_empty()).ok_or("missing_session_key")?;
    let run = run.filter(|r| !r.is_empty()).ok_or("missing_run_id")?;
    let i = runs.iter().position(|(s, _)| s == sk).ok_or("foreign_session")?;
    if runs[i].1 == run {
        Ok(i)
    } else {
        Err("foreign_run")
    }
}

fn label(p: &KeyPick, lower: &str, upper: &str) -> String {
    match p {
        KeyPick::Real(i) => format!("{lower}{i}"),
        KeyPick::Upper(i) => format!("{upper}{i}"),
        KeyPick::Foreign(k) => format!("f{lower}{k}"),
        KeyPick::Missing => format!("no{lower}"),
        KeyPick::Empty => format!("e{lower}"),
    }
}

/// Every `[to:<target>:<n>]` marker in `s`, as `<target>`.
fn targets_in(s: &str) -> Vec<String> {
    s.match_indices("[to:").filter_map(|(i, _)| s[i + 4..].split_once(':').map(|(t, _)| t.to_owned())).collect()
}

#[actix_rt::test]
async fn thousands_of_randomly_addressed_frames_reach_only_their_run_and_drops_are_counted() {
    const RUNS: usize = 16;
    const FRAMES: usize = 4000;
    let seed: u64 = std::env::var("CHAOS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed_c1a0_2026);
    eprintln!("routing chaos: seed {seed} (CHAOS_SEED={seed} replays this run)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let env = env(fast()).await;
    env.gw.set_paused(true);
    let mut runs = Vec::new();
    for i in 0..RUNS {
        let m = unique(&format!("<bulk-{i}>"));
        let mut sse = env.sse(&body(&m, &format!("acct-bulk-{i}"))).await;
        let acc = sse.accepted().await;
        runs.push((m, sse, acc));
    }
    let keys: Vec<(String, String)> = runs.iter().map(|(_, _, a)| (a.session_key.clone(), a.gateway_run_id.clone())).collect();
    let reasons = ["missing_session_key", "missing_run_id", "foreign_session", "foreign_run"];
    let mut before = HashMap::new();
    for r in reasons {
        before.insert(r, env.metric(&format!("clawmux_gateway_frames_dropped_total{{reason=\"{r}\"}}")).await);
    }

    let mut expected_drops: HashMap<&str, f64> = HashMap::new();
    let mut cumulative: Vec<String> = vec![String::new(); RUNS];
    let mut delivered = [0usize; RUNS];
    for n in 0..FRAMES {
        let a = rng.gen_range(0..RUNS);
        let sk = match rng.gen_range(0..10) {
            0..=5 => KeyPick::Real(a),
            6 => KeyPick::Upper(a),
            7 => KeyPick::Foreign(rng.gen_range(0..4)),
            8 => KeyPick::Missing,
            _ => KeyPick::Empty,
        };
        let run = match rng.gen_range(0..10) {
            0..=4 => KeyPick::Real(a),
            5 | 6 => KeyPick::Real(rng.gen_range(0..RUNS)),
            7 => KeyPick::Upper(rng.gen_range(0..RUNS)),
            8 => KeyPick::Foreign(rng.gen_range(0..4)),
            _ => if rng.gen_bool(0.5) { KeyPick::Missing } else { KeyPick::Empty },
        };
        let sk_value = match &sk {
            KeyPick::Real(i) => Some(runs[*i].2.session_key.clone()),
            KeyPick::Upper(i) => Some(runs[*i].2.session_key.to_uppercase()),
            KeyPick::Foreign(k) => Some(format!("agent:main:intruder-{k}:x")),
            KeyPick::Missing => None,
            KeyPick::Empty => Some(String::new()),
        };
        let run_value = match &run {
            KeyPick::Real(i) => Some(runs[*i].2.gateway_run_id.clone()),
            KeyPick::Upper(i) => Some(runs[*i].2.gateway_run_id.to_uppercase()),
            KeyPick::Foreign(k) => Some(format!("intruder-run-{k}")),
            KeyPick::Missing => None,
            KeyPick::Empty => Some(String::new()),
        };
        let route = routing(&keys, sk_value.as_deref(), run_value.as_deref());
        // The marker names the target: a run may only ever see its own `s<i>/r<i>`.
        let target = match route {
            Ok(i) => format!("s{i}/r{i}"),
            Err(_) => format!("{}/{}", label(&sk, "s", "S"), label(&run, "r", "R")),
        };
        let marker = format!("[to:{target}:{n}]");
        let mut payload = json!({"seq": n + 1});
        if let Some(s) = sk_value {
            payload["sessionKey"] = json!(s);
        }
        if let Some(r) = run_value {
            payload["runId"] = json!(r);
        }
        let name = if rng.gen_bool(0.7) {
            // Text for a run grows cumulatively, as the gateway's does; a misaddressed frame may
            // carry any state (a leaked `final` or `error` would end the wrong run).
            let (state, text) = match route {
                Ok(i) => {
                    cumulative[i].push_str(&marker);
                    ("delta", cumulative[i].clone())
                }
                Err(_) => (["delta", "final", "error", "aborted"][rng.gen_range(0..4)], marker.clone()),
            };
            payload["state"] = json!(state);
            payload["message"] = json!({"role": "assistant", "content": [{"type": "text", "text": text}]});
            if state == "error" {
                payload["errorMessage"] = json!(marker);
            }
            "chat"
        } else {
            payload["stream"] = json!(if rng.gen_bool(0.5) { "assistant" } else { "lifecycle" });
            payload["data"] = json!({"phase": "start", "text": marker, "delta": marker});
            "agent"
        };
        match route {
            // Only chat frames carry visible text; agent frames reach the run as status at most.
            Ok(i) if name == "chat" => delivered[i] += 1,
            Ok(_) => {}
            Err(reason) => *expected_drops.entry(reason).or_default() += 1.0,
        }
        env.gw.broadcast_raw(&json!({"type": "event", "event": name, "seq": n + 1, "payload": payload}).to_string());
    }
    // A last, correctly addressed frame per run: once it arrived, everything before was routed.
    for (i, (_, sse, acc)) in runs.iter_mut().enumerate() {
        let end = format!("{}[end:{i}]", cumulative[i]);
        env.gw.broadcast_raw(&chat_frame(&acc.session_key, &acc.gateway_run_id, "delta", &end));
        let marker = format!("[end:{i}]");
        sse.until(WAIT, |e| e.event == "text_delta" && e.data["text"].as_str().is_some_and(|t| t.contains(&marker)))
            .await
            .unwrap_or_else(|| panic!("seed {seed}: run {i} did not get its last frame: {:?}", sse.events));
    }
    for r in reasons {
        let got = env.metric(&format!("clawmux_gateway_frames_dropped_total{{reason=\"{r}\"}}")).await - before[r];
        assert_eq!(got, expected_drops.get(r).copied().unwrap_or(0.0), "seed {seed}: drops counted for {r}");
    }

    env.gw.set_paused(false);
    for (i, (m, sse, acc)) in runs.iter_mut().enumerate() {
        let what = format!("seed {seed}: run {i}");
        let fin = finish(sse, WAIT, &what).await;
        assert_eq!(fin.event, "final", "{what}: {}", fin.data);
        assert_eq!(fin.data["content"].as_str(), Some(answer(m).as_str()), "{what}");
        let own = format!("s{i}/r{i}");
        let mut seen = 0;
        for e in &sse.events {
            for t in targets_in(&e.data.to_string()) {
                assert_eq!(t, own, "{what}: a frame addressed to {t} reached run {i}: {e:?}");
                seen += 1;
            }
        }
        assert_eq!(seen, delivered[i], "{what}: every frame addressed to the run reached it once");
        assert!(!env.doc(&acc.run_id).await.to_string().contains("[to:"), "{what}: foreign text in the document");
    }
    assert_no_panics("thousands of randomly addressed frames reach only their run and drops are counted");
}

// ------------------------------------------------------------------------------------------------
// 7. Freeze, kill, drop with long runs in flight
// ------------------------------------------------------------------------------------------------

/// Runs of the `long` track from different accounts, each streaming before the fault.
struct LongRuns {
    recorded: String,
    runs: Vec<(String, Sse, Accepted)>,
}

async fn long_runs(env: &Env, n: usize, tag: &str) -> LongRuns {
    let recorded = recorded_answer(&long(), "long");
    let mut runs = Vec::new();
    for i in 0..n {
        let m = unique(&format!("<{tag}-{i}>"));
        let sse = env.sse(&body_on("long", &m, &format!("acct-{tag}-{i}"))).await;
        runs.push((m, sse));
    }
    let mut out = Vec::new();
    for (m, mut sse) in runs {
        let acc = sse.accepted().await;
        sse.until(WAIT, |e| e.event == "text_delta").await.expect("the run is streaming before the fault");
        out.push((m, sse, acc));
    }
    LongRuns { recorded, runs: out }
}

enum Expect {
    /// The gateway kept the runs and came back in time: `final` with the full own text.
    Final,
    /// The gateway restarted: `error` `gateway_disconnected`.
    Lost,
}

impl LongRuns {
    /// Every run ends with exactly one terminal event as expected, with only its own text.
    async fn end(&mut self, env: &Env, expect: Expect, what: &str) {
        let markers: Vec<String> = self.runs.iter().map(|(m, _, _)| m.clone()).collect();
        for (m, sse, acc) in &mut self.runs {
            let what = format!("{what}: {m}");
            let fin = finish(sse, Duration::from_secs(20), &what).await;
            match expect {
                Expect::Final => {
                    assert_final_with(&fin, sse, &answer_on("long", m, &self.recorded), &what);
                    assert_eq!(env.gw_run(&acc.gateway_run_id).status, RunStatus::Ok, "{what}");
                }
                Expect::Lost => {
                    assert_error(&fin, "gateway_disconnected", &what);
                    assert_eq!(env.gw_run(&acc.gateway_run_id).status, RunStatus::Forgotten, "{what}");
                }
            }
            for e in &sse.events {
                let data = e.data.to_string();
                for other in markers.iter().filter(|o| *o != m) {
                    assert!(!data.contains(other.as_str()), "{what}: text of {other} leaked: {e:?}");
                }
            }
        }
        wait_ready_within(env, WAIT).await;
    }
}

#[actix_rt::test]
async fn a_frozen_gateway_that_resumes_keeps_every_long_run() {
    // 200 ms ticks: the silence is noticed within half a second; reconnects hang for at most 1 s.
    let env = env_with(long().tick_interval_ms(200), |s| s.handshake_timeout = Duration::from_secs(1)).await;
    let mut runs = long_runs(&env, 4, "freeze").await;
    env.gw.set_frozen(true);
    let e = &env;
    eventually(WAIT, "the silent gateway is noticed", || async move {
        e.metric("clawmux_gateway_disconnects_total{reason=\"tick_timeout\"}").await >= 1.0
    })
    .await;
    // Frozen a while longer: reconnects hang (TCP accepted, no upgrade) and time out.
    eventually(WAIT, "a reconnect attempt fails against the frozen gateway", || async move {
        e.metric("clawmux_gateway_connects_total{outcome=\"failed\"}").await >= 1.0
    })
    .await;
    env.gw.set_frozen(false);
    runs.end(&env, Expect::Final, "freeze").await;
    assert!(env.gw.stats().handshakes_ok >= 2);
    assert_no_panics("a frozen gateway that resumes keeps every long run");
}

#[actix_rt::test]
async fn a_killed_gateway_that_comes_back_with_its_runs_keeps_every_long_run() {
    let env = env(long()).await;
    let mut runs = long_runs(&env, 4, "kill").await;
    env.gw.set_listening(false);
    env.gw.drop_connections(false);
    let e = &env;
    eventually(WAIT, "reconnects are refused", || async move {
        e.metric("clawmux_gateway_connects_total{outcome=\"failed\"}").await >= 2.0
    })
    .await;
    assert_eq!(env.readyz().await.0, 503);
    env.gw.set_listening(true);
    runs.end(&env, Expect::Final, "kill, same process").await;
    assert_no_panics("a killed gateway that comes back with its runs keeps every long run");
}

#[actix_rt::test]
async fn a_killed_gateway_that_restarts_ends_every_long_run_gateway_disconnected() {
    let env = env(long()).await;
    let mut runs = long_runs(&env, 4, "restart").await;
    env.gw.set_listening(false);
    env.gw.drop_connections(true);
    let e = &env;
    eventually(WAIT, "reconnects are refused", || async move {
        e.metric("clawmux_gateway_connects_total{outcome=\"failed\"}").await >= 2.0
    })
    .await;
    env.gw.set_listening(true);
    runs.end(&env, Expect::Lost, "kill, restarted").await;
    // A new run on the restarted gateway works.
    let m = unique("<after-restart>");
    let mut sse = env.sse(&body_on("long", &m, "acct-after-restart")).await;
    let fin = finish(&mut sse, WAIT, "after the restart").await;
    assert_final_with(&fin, &sse, &answer_on("long", &m, &runs.recorded), "after the restart");
    assert_no_panics("a killed gateway that restarts ends every long run gateway disconnected");
}

#[actix_rt::test]
async fn one_abrupt_drop_keeps_every_long_run() {
    let env = env(long()).await;
    let mut runs = long_runs(&env, 4, "drop").await;
    env.gw.drop_connections(false);
    runs.end(&env, Expect::Final, "drop").await;
    assert!(env.gw.stats().handshakes_ok >= 2);
    assert_no_panics("one abrupt drop keeps every long run");
}

// ------------------------------------------------------------------------------------------------
// 8. Wrong answers to a run's own requests
// ------------------------------------------------------------------------------------------------

/// What no run may ever show: the text of another run's answer a hostile gateway slipped in.
const FOREIGN: &str = "FOREIGN answer of someone else's run";

/// The gateway's record of the run whose message carries `marker` (its run id may be unknown to
/// the client: a run whose ACK was not believed has no `accepted` event).
fn gw_run_of(env: &Env, marker: &str) -> RunRecord {
    env.gw.runs().into_iter().find(|r| r.message.contains(marker)).unwrap_or_else(|| panic!("the gateway never saw a run of {marker}"))
}

/// Checks a run ended by a wrong answer: one terminal event, `error` `gateway_protocol_error`, in
/// its stream, its document and its stored events; no trace of [`FOREIGN`]; `accepted` (when the
/// ACK was believed) naming the gateway's run; and clawmux asked the gateway to cancel the run.
/// Returns the API run id.
async fn assert_protocol_error(env: &Env, sse: &mut Sse, marker: &str, accepted: bool, what: &str) -> String {
    let fin = sse.terminal(WAIT).await.unwrap_or_else(|| panic!("{what}: no terminal event within {WAIT:?}: {:?}", sse.events));
    assert!(sse.read_to_end(WAIT).await, "{what}: the stream did not close after its terminal event");
    assert_error(&fin, "gateway_protocol_error", what);
    assert_one_terminal_last(sse, what);
    let gw = gw_run_of(env, marker);
    let acc: Vec<&SseEvent> = sse.events.iter().filter(|e| e.event == "accepted").collect();
    if accepted {
        assert_eq!(acc.len(), 1, "{what}: {:?}", sse.events);
        assert_eq!(acc[0].data["gatewayRunId"].as_str(), Some(gw.run_id.as_str()), "{what}: accepted names another run");
    } else {
        assert!(acc.is_empty(), "{what}: a run whose ACK was not understood was reported accepted: {:?}", sse.events);
    }
    let run_id = fin.data["runId"].as_str().unwrap_or_else(|| panic!("{what}: error without runId: {}", fin.data)).to_owned();
    let doc = env.doc(&run_id).await;
    assert_eq!((doc["status"].as_str(), doc["error"]["code"].as_str()), (Some("error"), Some("gateway_protocol_error")), "{what}: {doc}");
    let all = format!("{:?} {doc}", sse.events);
    assert!(!all.contains(FOREIGN), "{what}: another run's answer reached the run: {all}");
    let gid = gw.run_id.clone();
    eventually(WAIT, &format!("{what}: clawmux asks the gateway to cancel the run"), || {
        let gid = gid.clone();
        async move { env.gw_run(&gid).abort_requests >= 1 }
    })
    .await;
    run_id
}

/// After the gateway run really ended (and sent whatever it still had), the run's stored events
/// are still exactly the ones streamed: one terminal event, nothing after it.
async fn assert_nothing_after_the_end(env: &Env, run_id: &str, streamed: usize, what: &str) {
    let mut again = env.reattach(run_id).await;
    assert!(again.read_to_end(WAIT).await, "{what}: re-attaching to a finished run must replay and close");
    assert_eq!(again.events.len(), streamed, "{what}: events after the terminal event: {:?}", again.events);
    assert_one_terminal_last(&again, what);
}

#[actix_rt::test]
async fn a_malformed_or_foreign_ack_ends_the_run_gateway_protocol_error_and_cancels_its_gateway_run() {
    let env = env(fast()).await;
    // Held on the gateway after its ACK: still running there when clawmux gives up on it.
    env.gw.set_paused(true);
    let cases = [
        ("ack-without-run-id", json!({"runId": null})),
        ("ack-run-id-not-a-string", json!({"runId": 42})),
        ("ack-without-status", json!({"status": null})),
        ("ack-not-an-object", json!("accepted")),
        ("ack-of-another-session", json!({"sessionKey": "agent:main:clawmux:intruder.s.conversation"})),
        ("ack-of-another-run", json!({"runId": "someone-elses-run"})),
    ];
    let mut runs = Vec::new();
    for (i, (name, patch)) in cases.iter().enumerate() {
        let m = unique(&format!("<{name}>"));
        env.gw.script_runs(&m, RunScript { ack_patch: Some(patch.clone()), ..RunScript::default() });
        let sse = env.sse(&body(&m, &format!("acct-ack-{i}"))).await;
        runs.push((*name, m, sse));
    }
    let mut ended = Vec::new();
    for (name, m, sse) in &mut runs {
        let run_id = assert_protocol_error(&env, sse, m, false, name).await;
        let gid = gw_run_of(&env, m).run_id;
        eventually(WAIT, &format!("{name}: the gateway run is cancelled"), || {
            let gid = gid.clone();
            let e = &env;
            async move { e.gw_run(&gid).aborted }
        })
        .await;
        ended.push((*name, run_id, sse.events.len(), gid));
    }
    // The cancelled runs end on the gateway (abort sequence, final `res` to the old request).
    env.gw.set_paused(false);
    for (name, run_id, n, gid) in &ended {
        let e = &env;
        eventually(WAIT, &format!("{name}: the gateway run ended"), || async move {
            !matches!(e.gw_run(gid).status, RunStatus::Queued | RunStatus::Running)
        })
        .await;
        assert_nothing_after_the_end(&env, run_id, *n, name).await;
    }
    a_run_works(&env, "after wrong ACKs").await;
    assert_eq!(env.disconnects().await, 0.0);
    assert_no_panics("a malformed or foreign ack ends the run gateway protocol error and cancels its gateway run");
}

#[actix_rt::test]
async fn a_malformed_or_foreign_final_res_ends_the_run_gateway_protocol_error() {
    let env = env(fast()).await;
    let foreign_payloads = json!({"payloads": [{"text": FOREIGN, "mediaUrl": null}]});
    let cases = [
        ("final-status-unknown", json!({"status": "exploded"})),
        ("final-without-run-id", json!({"runId": null})),
        ("final-payloads-not-a-list", json!({"result": {"payloads": "text"}})),
        ("final-not-an-object", json!(["ok"])),
        ("final-of-another-run", json!({"runId": "someone-elses-run", "result": foreign_payloads})),
    ];
    let mut runs = Vec::new();
    for (i, (name, patch)) in cases.iter().enumerate() {
        let m = unique(&format!("<{name}>"));
        env.gw.script_runs(&m, RunScript { final_patch: Some(patch.clone()), ..RunScript::default() });
        let sse = env.sse(&body(&m, &format!("acct-final-{i}"))).await;
        runs.push((*name, m, sse));
    }
    for (name, m, sse) in &mut runs {
        // The ACK was fine: the run was accepted and streamed; its answer cannot be trusted.
        let run_id = assert_protocol_error(&env, sse, m, true, name).await;
        assert_nothing_after_the_end(&env, &run_id, sse.events.len(), name).await;
    }
    a_run_works(&env, "after wrong finals").await;
    assert_eq!(env.disconnects().await, 0.0);
    assert_no_panics("a malformed or foreign final res ends the run gateway protocol error");
}

#[actix_rt::test]
async fn a_malformed_or_foreign_agent_wait_answer_in_recovery_ends_the_run_gateway_protocol_error_and_cancels_it() {
    let env = env(fast()).await;
    env.gw.set_paused(true);
    let cases = [
        ("wait-status-not-a-string", json!({"status": 7})),
        ("wait-status-unknown", json!({"status": "sideways", "endedAt": 5})),
        ("wait-not-an-object", json!("ok")),
        ("wait-ended-at-not-a-number", json!({"status": "ok", "endedAt": "yesterday"})),
        (
            "wait-of-another-run",
            json!({"runId": "someone-elses-run", "status": "ok", "endedAt": 5, "terminalReply": {"text": FOREIGN}}),
        ),
    ];
    let mut runs = Vec::new();
    for (i, (name, reply)) in cases.iter().enumerate() {
        let m = unique(&format!("<{name}>"));
        env.gw.script_runs(&m, RunScript { wait_reply: Some(reply.clone()), ..RunScript::default() });
        let mut sse = env.sse(&body(&m, &format!("acct-wait-{i}"))).await;
        sse.accepted().await;
        runs.push((*name, m, sse));
    }
    // The connection drops; clawmux reconnects to the same gateway process and asks `agent.wait`.
    env.gw.drop_connections(false);
    for (name, m, sse) in &mut runs {
        let run_id = assert_protocol_error(&env, sse, m, true, name).await;
        let gid = gw_run_of(&env, m).run_id;
        let e = &env;
        eventually(WAIT, &format!("{name}: the gateway run is cancelled"), || {
            let gid = gid.clone();
            async move { e.gw_run(&gid).aborted }
        })
        .await;
        assert_nothing_after_the_end(&env, &run_id, sse.events.len(), name).await;
    }
    assert!(env.requests("agent.wait") >= cases.len() as u64);
    env.gw.set_paused(false);
    a_run_works(&env, "after wrong agent.wait answers").await;
    assert_no_panics("a malformed or foreign agent wait answer in recovery ends the run gateway protocol error and cancels it");
}

#[actix_rt::test]
async fn an_agent_wait_answered_at_once_as_not_ended_is_not_asked_again_in_a_tight_loop() {
    // A gateway that answers every `agent.wait` at once with "the wait timed out" (the real one
    // waits up to `timeoutMs` first). clawmux asks again while the run has time: at a bounded rate,
    // not as fast as the answers come, and the run still ends at its own timeout, cancelled.
    let env = env_with(fast(), |s| s.abort_grace = Duration::from_secs(1)).await;
    env.gw.set_paused(true);
    let m = unique("<instant-wait>");
    env.gw.script_runs(&m, RunScript { wait_reply: Some(json!({"status": "timeout"})), ..RunScript::default() });
    let mut b = body(&m, "acct-instant-wait");
    b["timeoutSec"] = json!(4);
    let mut sse = env.sse(&b).await;
    let acc = sse.accepted().await;
    let before = env.requests("agent.wait");
    env.gw.drop_connections(false);
    let fin = finish(&mut sse, WAIT, "instant agent.wait answers").await;
    assert_error(&fin, "timeout", "instant agent.wait answers");
    let asked = env.requests("agent.wait") - before;
    // About one per second over the run's remaining ~4 s (plus the abort grace); unbounded, it
    // was thousands.
    assert!((1..=12).contains(&asked), "agent.wait asked {asked} times within the run's 4 s");
    let gid = acc.gateway_run_id.clone();
    let e = &env;
    eventually(WAIT, "the timed-out run is cancelled on the gateway", || {
        let gid = gid.clone();
        async move { e.gw_run(&gid).aborted }
    })
    .await;
    env.gw.set_paused(false);
    assert_no_panics("an agent wait answered at once as not ended is not asked again in a tight loop");
}
