//! The fault knobs of the replay gateway, checked over a raw WebSocket: what a client really sees
//! when the gateway advertises absurd policy numbers, refuses connects with any `retryAfterMs`,
//! freezes, closes its listener, sends frames of many MB, or ends a run the scripted way.

#![allow(clippy::unwrap_used)]

use super::*;
use futures_util::{SinkExt, StreamExt};
use serde_json::Value;
use std::time::Duration;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;

type Ws = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

const WAIT: Duration = Duration::from_secs(5);

fn start(cfg: ReplayConfig) -> ReplayHandle {
    ReplayGateway::start("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
}

/// The next text frame as JSON, or `None` when nothing came within `within` (or the socket ended).
async fn next(ws: &mut Ws, within: Duration) -> Option<Value> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, ws.next()).await {
            Ok(Some(Ok(Message::Text(t)))) => return serde_json::from_str(t.as_str()).ok(),
            Ok(Some(Ok(_))) => continue,
            _ => return None,
        }
    }
}

/// The next frame that satisfies `pred` (others are skipped), within [`WAIT`].
async fn next_where(ws: &mut Ws, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let f = next(ws, left).await.expect("frame within 5 s");
        if pred(&f) {
            return f;
        }
    }
}

async fn send(ws: &mut Ws, id: &str, method: &str, params: Value) {
    let frame = json!({"type": "req", "id": id, "method": method, "params": params});
    ws.send(Message::text(frame.to_string())).await.unwrap();
}

/// Opens a socket (large read limits) and sends `connect`; returns the socket and the answer.
async fn connect(gw: &ReplayHandle) -> (Ws, Value) {
    let cfg = WebSocketConfig::default().max_message_size(Some(64 << 20)).max_frame_size(Some(64 << 20));
    let (mut ws, _) = tokio_tungstenite::connect_async_with_config(gw.url(), Some(cfg), true).await.unwrap();
    let challenge = next(&mut ws, WAIT).await.unwrap();
    assert_eq!(challenge["event"], "connect.challenge");
    let params = json!({
        "minProtocol": 4, "maxProtocol": 4,
        "client": {"id": "gateway-client", "version": "1.0.0", "platform": "linux", "mode": "backend"},
        "role": "operator", "scopes": ["operator.read", "operator.write"], "caps": [],
    });
    send(&mut ws, "c", "connect", params).await;
    let res = next_where(&mut ws, |f| f["id"] == "c").await;
    (ws, res)
}

#[tokio::test]
async fn the_advertised_policy_is_independent_of_the_real_one() {
    let gw = start(ReplayConfig::default().speed(0.0).tick_interval_ms(50).advertise_tick_interval_ms(0).advertise_max_payload(u64::MAX));
    let (mut ws, hello) = connect(&gw).await;
    assert_eq!(hello["payload"]["policy"]["tickIntervalMs"], 0);
    assert_eq!(hello["payload"]["policy"]["maxPayload"], u64::MAX);
    // Ticks still come at the real cadence.
    next_where(&mut ws, |f| f["event"] == "tick").await;
    gw.stop().await;
}

#[tokio::test]
async fn unavailable_refusals_carry_the_given_retry_after() {
    let gw = start(ReplayConfig::default().speed(0.0));
    gw.set_unavailable_connects_retry_after(1, u64::MAX);
    let (_ws, res) = connect(&gw).await;
    assert_eq!(res["error"]["code"], "UNAVAILABLE");
    assert_eq!(res["error"]["retryAfterMs"], u64::MAX);
    let (_ws, res) = connect(&gw).await;
    assert_eq!(res["ok"], true, "only one connect was to be refused: {res}");
    gw.stop().await;
}

#[tokio::test]
async fn a_frozen_gateway_neither_answers_nor_ticks_until_thawed() {
    let gw = start(ReplayConfig::default().speed(0.0).tick_interval_ms(50));
    let (mut ws, _) = connect(&gw).await;
    next_where(&mut ws, |f| f["event"] == "tick").await;
    gw.set_frozen(true);
    // A tick already being written may still arrive; then silence.
    for _ in 0..20 {
        if next(&mut ws, Duration::from_millis(150)).await.is_none() {
            break;
        }
    }
    send(&mut ws, "h", "health", json!({})).await;
    assert_eq!(next(&mut ws, Duration::from_millis(400)).await, None, "a frozen gateway sent something");
    // A new socket connects (TCP) but gets no upgrade while frozen.
    let url = gw.url();
    let pending = tokio::spawn(async move { tokio_tungstenite::connect_async(url).await.is_ok() });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!pending.is_finished(), "the upgrade completed while frozen");
    gw.set_frozen(false);
    let res = next_where(&mut ws, |f| f["id"] == "h").await;
    assert_eq!(res["ok"], true);
    assert!(tokio::time::timeout(WAIT, pending).await.unwrap().unwrap(), "the upgrade completes after the thaw");
    gw.stop().await;
}

#[tokio::test]
async fn a_closed_listener_refuses_connects_and_reopens_on_the_same_port() {
    let gw = start(ReplayConfig::default().speed(0.0));
    let addr = gw.local_addr();
    gw.set_listening(false);
    let deadline = tokio::time::Instant::now() + WAIT;
    // The accept task drops the listener right after the switch; until then a socket is dropped
    // unserved, so no upgrade ever succeeds.
    while tokio::net::TcpStream::connect(addr).await.is_ok() {
        assert!(tokio::time::Instant::now() < deadline, "the port still accepts connections");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(tokio_tungstenite::connect_async(gw.url()).await.is_err());
    gw.set_listening(true);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Ok((_ws, _)) = tokio_tungstenite::connect_async(gw.url()).await {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the listener did not come back");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(gw.local_addr(), addr);
    gw.stop().await;
}

#[tokio::test]
async fn frames_of_several_mb_are_sent_intact() {
    let gw = start(ReplayConfig::default().speed(0.0));
    let (mut ws, _) = connect(&gw).await;
    let pad = "x".repeat(6_000_000);
    let frame = json!({"type": "event", "event": "health", "payload": {"pad": pad}}).to_string();
    assert_eq!(gw.broadcast_raw(&frame), 1);
    let got = next_where(&mut ws, |f| f["event"] == "health").await;
    assert_eq!(got["payload"]["pad"].as_str().map(str::len), Some(6_000_000));
    gw.stop().await;
}

#[tokio::test]
async fn a_script_surrounds_the_final_res_and_patches_it() {
    let gw = start(ReplayConfig::default().speed(0.0));
    let script = RunScript {
        final_patch: Some(json!({"result": {"payloads": [{"text": "patched"}]}})),
        before_final: vec![ScriptFrame::chat("aborted", "partial"), ScriptFrame::chat("final", "other")],
        after_final: vec![ScriptFrame::chat("error", "late"), ScriptFrame::Res(json!({"status": "error"}))],
        ..RunScript::default()
    };
    gw.script_runs("<scripted>", script);
    let (mut ws, _) = connect(&gw).await;
    let params = json!({"message": "<scripted> [track:short]", "agentId": "main", "sessionKey": "agent:main:s1", "idempotencyKey": "run-1"});
    send(&mut ws, "a", "agent", params).await;
    // Everything of the run from the scripted `aborted` on, in order.
    let mut seen = Vec::new();
    let mut started = false;
    while seen.len() < 5 {
        let f = next(&mut ws, WAIT).await.expect("the run's frames");
        let state = f["payload"]["state"].as_str().unwrap_or_default().to_owned();
        started |= state == "aborted";
        if !started {
            continue;
        }
        match (f["type"].as_str(), f["event"].as_str()) {
            (Some("event"), Some("chat")) => seen.push(format!("chat {state} {}", f["payload"]["message"]["content"][0]["text"].as_str().unwrap())),
            (Some("res"), _) => seen.push(format!("res {} {}", f["payload"]["status"], f["payload"]["result"]["payloads"][0]["text"])),
            _ => {}
        }
        if f["type"] == "res" && f["payload"]["status"] == "error" {
            assert_eq!(f["payload"]["runId"], "run-1", "runId is filled in");
        }
    }
    assert_eq!(seen[..4], ["chat aborted partial", "chat final other", "res \"ok\" \"patched\"", "chat error late"]);
    assert!(seen[4].starts_with("res \"error\""), "{seen:?}");
    let rec = gw.runs().pop().unwrap();
    assert_eq!((rec.status, rec.aborted), (RunStatus::Ok, false));
    assert_eq!(gw.stats().requests_received.get("agent"), Some(&1));
    gw.stop().await;
}

#[tokio::test]
async fn a_lost_ack_is_never_sent_and_a_repeated_key_finds_the_run() {
    let gw = start(ReplayConfig::default().speed(0.0));
    gw.set_paused(true);
    gw.script_runs("<no-ack>", RunScript { lose_ack: true, ..RunScript::default() });
    let (mut ws, _) = connect(&gw).await;
    let params = json!({"message": "<no-ack> [track:short]", "agentId": "main", "sessionKey": "agent:main:s1", "idempotencyKey": "run-1"});
    send(&mut ws, "a1", "agent", params.clone()).await;
    // The run is taken (held by the pause), but nothing answers the request.
    let deadline = tokio::time::Instant::now() + WAIT;
    while gw.runs().is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "the run was not taken");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    send(&mut ws, "h", "health", json!({})).await;
    let f = next_where(&mut ws, |f| f["type"] == "res").await;
    assert_eq!(f["id"], "h", "the ACK went out: {f}");
    // The same key again: the ACK of the run in flight, not a second run.
    send(&mut ws, "a2", "agent", params).await;
    let ack = next_where(&mut ws, |f| f["type"] == "res").await;
    assert_eq!((ack["id"].as_str(), ack["payload"]["status"].as_str(), ack["payload"]["runId"].as_str()), (Some("a2"), Some("in_flight"), Some("run-1")));
    assert_eq!(gw.runs().len(), 1);
    gw.stop().await;
}

#[tokio::test]
async fn a_lost_agent_request_is_never_seen_and_the_next_one_runs() {
    let gw = start(ReplayConfig::default().speed(0.0));
    gw.lose_agent_requests("<lost>", 1);
    let (mut ws, _) = connect(&gw).await;
    let params = json!({"message": "<lost> [track:short]", "agentId": "main", "sessionKey": "agent:main:s1", "idempotencyKey": "run-1"});
    send(&mut ws, "a1", "agent", params.clone()).await;
    send(&mut ws, "h", "health", json!({})).await;
    let f = next_where(&mut ws, |f| f["type"] == "res").await;
    assert_eq!(f["id"], "h", "the lost request was answered: {f}");
    assert!(gw.runs().is_empty());
    assert_eq!(gw.stats().requests_received.get("agent"), Some(&1));
    // Sent again: it runs, once.
    send(&mut ws, "a2", "agent", params).await;
    let ack = next_where(&mut ws, |f| f["type"] == "res").await;
    assert_eq!((ack["id"].as_str(), ack["payload"]["status"].as_str()), (Some("a2"), Some("accepted")));
    let fin = next_where(&mut ws, |f| f["type"] == "res").await;
    assert_eq!((fin["id"].as_str(), fin["payload"]["status"].as_str()), (Some("a2"), Some("ok")));
    assert_eq!(gw.runs().len(), 1);
    assert_eq!(gw.stats().requests_received.get("agent"), Some(&2));
    gw.stop().await;
}

#[tokio::test]
async fn a_script_patches_the_ack_answers_agent_wait_and_aborts_are_counted() {
    let gw = start(ReplayConfig::default().speed(0.0));
    let script = RunScript {
        ack_patch: Some(json!({"runId": null, "sessionKey": "agent:main:someone-else"})),
        wait_reply: Some(json!({"status": 7})),
        ..RunScript::default()
    };
    gw.script_runs("<ack>", script);
    gw.set_paused(true);
    let (mut ws, _) = connect(&gw).await;
    let params = json!({"message": "<ack> [track:short]", "agentId": "main", "sessionKey": "agent:main:s1", "idempotencyKey": "run-1"});
    send(&mut ws, "a", "agent", params).await;
    let ack = next_where(&mut ws, |f| f["id"] == "a").await;
    assert_eq!(ack["payload"]["status"], "accepted", "{ack}");
    assert!(ack["payload"].get("runId").is_none(), "null removes the key: {ack}");
    assert_eq!(ack["payload"]["sessionKey"], "agent:main:someone-else");
    // The scripted answer comes at once, not after the minute the wait may take.
    send(&mut ws, "w", "agent.wait", json!({"runId": "run-1", "timeoutMs": 60_000})).await;
    let wait = next_where(&mut ws, |f| f["id"] == "w").await;
    assert_eq!(wait["payload"], json!({"status": 7}));
    // Aborts naming the run are counted, and one naming it aborts it whatever session key comes
    // with it (2026.9.6 does not check that key); a later one finds nothing running.
    send(&mut ws, "x", "chat.abort", json!({"sessionKey": "agent:main:s2", "runId": "run-1"})).await;
    let res = next_where(&mut ws, |f| f["id"] == "x").await;
    assert_eq!(res["payload"]["aborted"], true, "{res}");
    send(&mut ws, "y", "chat.abort", json!({"sessionKey": "AGENT:MAIN:S1", "runId": "run-1"})).await;
    let res = next_where(&mut ws, |f| f["id"] == "y").await;
    assert_eq!(res["payload"]["aborted"], false, "{res}");
    let rec = gw.runs().pop().unwrap();
    assert_eq!((rec.abort_requests, rec.aborted), (2, true));
    send(&mut ws, "z", "chat.abort", json!({"sessionKey": "agent:main:s1", "runId": "other-run"})).await;
    next_where(&mut ws, |f| f["id"] == "z").await;
    assert_eq!(gw.runs()[0].abort_requests, 2, "an abort naming another run is not this run's");
    gw.stop().await;
}
