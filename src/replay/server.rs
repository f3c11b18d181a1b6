//! Sockets: the accept loop, one task per connection (challenge, handshake, request loop, frame
//! writing and counting) and the `tick` task.

use super::config::MAX_BUFFERED_BYTES;
use super::methods::{self, invalid, respond};
use super::schema;
use super::state::{now_ms, wait_true, ConnKey, Outbound, Scopes, Shared};
use clawmux_protocol::frame::{encode_event, encode_response, RequestFrame};
use clawmux_protocol::handshake::{CAP_OUTBOUND_HEADERS, CAP_SESSION_SCOPED_EVENTS, CAP_TOOL_EVENTS, OPERATOR_SCOPES};
use clawmux_protocol::ErrorShape;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, WebSocketConfig};
use tokio_tungstenite::tungstenite::Message;

/// The gateway closes a socket that has not completed `connect` in time (close 1000, no reason):
/// 15 s on 2026.9.x (the official pre-auth handshake timeout), 10 s on 2026.4.x.
pub(crate) fn handshake_timeout(protocol: u32) -> Duration {
    Duration::from_secs(if protocol == 3 { 10 } else { 15 })
}
/// Frames before the handshake are capped at 64 KiB (close 1009, no reason).
const MAX_PREAUTH_PAYLOAD: usize = 64 * 1024;
/// How long a closing socket waits for the peer's close frame before dropping the TCP stream.
const CLOSE_LINGER: Duration = Duration::from_secs(1);
/// WebSocket close reasons are at most 123 bytes.
const MAX_CLOSE_REASON: usize = 123;
/// `retryAfterMs` of an `UNAVAILABLE` connect refusal, as the real gateway sends it.
pub(crate) const DEFAULT_RETRY_AFTER_MS: u64 = 500;
/// Pause between attempts to rebind the listener's port after [`ReplayHandle::set_listening`].
///
/// [`ReplayHandle::set_listening`]: super::ReplayHandle::set_listening
const REBIND_RETRY: Duration = Duration::from_millis(20);

/// Accepts sockets until the gateway stops. While `listening` is off the listener is dropped (the
/// port refuses connects) and rebound on the same address when it is switched on again.
pub(crate) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener, addr: std::net::SocketAddr) {
    let mut stopping = shared.stopping.subscribe();
    let mut listening = shared.listening.subscribe();
    let mut listener = Some(listener);
    loop {
        let wanted = *listening.borrow_and_update();
        match (&listener, wanted) {
            (Some(l), true) => tokio::select! {
                accepted = l.accept() => match accepted {
                    // Accepted in the race with `set_listening(false)`: a closed listener would
                    // have refused it, so drop it unserved.
                    Ok((stream, _peer)) if !*shared.listening.borrow() => drop(stream),
                    Ok((stream, _peer)) => {
                        let _ = stream.set_nodelay(true);
                        tokio::spawn(serve_conn(Arc::clone(&shared), stream));
                    }
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!(error = %e, "replay gateway accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                _ = listening.changed() => {}
                _ = wait_true(&mut stopping) => return,
            },
            (Some(_), false) => {
                // Dropping the listener closes the port: connects are refused from now on (and
                // ones still in the backlog are reset).
                listener = None;
                tracing::info!(%addr, "replay gateway listener closed");
            }
            (None, true) => match bind(addr) {
                Ok(l) => {
                    tracing::info!(%addr, "replay gateway listening again");
                    listener = Some(l);
                }
                Err(e) => {
                    // The port is briefly held by something else: retry until it is free (or the
                    // gateway stops); connects are refused meanwhile, as while closed.
                    tracing::warn!(%addr, error = %e, "replay gateway cannot rebind its port yet");
                    tokio::select! {
                        _ = tokio::time::sleep(REBIND_RETRY) => {}
                        _ = wait_true(&mut stopping) => return,
                    }
                }
            },
            (None, false) => tokio::select! {
                _ = listening.changed() => {}
                _ = wait_true(&mut stopping) => return,
            },
        }
    }
}

/// Binds a listener (std's bind sets `SO_REUSEADDR`, so sockets of earlier connections still in
/// `TIME_WAIT` on the port do not prevent it).
fn bind(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let l = std::net::TcpListener::bind(addr)?;
    l.set_nonblocking(true)?;
    TcpListener::from_std(l)
}

/// Resolves once the gateway is not frozen. A gone sender (the gateway is being dropped) counts
/// as thawed: nothing will freeze it again.
pub(crate) async fn thawed(rx: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = rx.wait_for(|frozen| !*frozen).await.map(|_| ());
}

/// Resolves when the freeze flag changes; never when its sender is gone (so a `select!` on it
/// does not spin).
async fn freeze_changed(rx: &mut tokio::sync::watch::Receiver<bool>) {
    if rx.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Sends `tick` `{ts}` to every handshaken connection every `tick_interval_ms`.
pub(crate) async fn tick_loop(shared: Arc<Shared>) {
    let period = Duration::from_millis(shared.cfg.tick_interval_ms);
    let mut interval = tokio::time::interval_at(Instant::now() + period, period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut stopping = shared.stopping.subscribe();
    loop {
        tokio::select! {
            _ = interval.tick() => {
                if shared.ticks_enabled.load(Ordering::Relaxed) && !*shared.frozen.borrow() {
                    let protocol = shared.protocol();
                    shared.lock().broadcast(protocol, "tick", &json!({"ts": now_ms()}), None);
                }
            }
            _ = wait_true(&mut stopping) => return,
        }
    }
}

fn truncate_reason(reason: &str) -> String {
    if reason.len() <= MAX_CLOSE_REASON {
        return reason.to_owned();
    }
    let mut end = MAX_CLOSE_REASON;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason[..end].to_owned()
}

/// What a frame did to the connection.
enum Next {
    Continue,
    Handshaken,
}

/// One socket from accept to close.
async fn serve_conn(shared: Arc<Shared>, stream: TcpStream) {
    // A frozen gateway completes no upgrade: the client's connect hangs until the thaw.
    let mut frozen = shared.frozen.subscribe();
    thawed(&mut frozen).await;
    // Leave room above maxPayload so that our own check (and its 1009) decides, not tungstenite.
    // These limits bound what we READ; what we send is not limited (tungstenite's write buffer is
    // unbounded by default), so tests can push frames of many MB (`broadcast_raw`) at a client.
    let limit = shared.cfg.max_payload.saturating_mul(2).max(1 << 20);
    let ws_cfg = WebSocketConfig::default().max_message_size(Some(limit)).max_frame_size(Some(limit));
    let Ok(mut ws) = tokio_tungstenite::accept_async_with_config(stream, Some(ws_cfg)).await else { return };

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let conn_id = uuid::Uuid::new_v4().to_string();
    let key = shared.lock().add_conn(tx.clone(), conn_id.clone());

    // The challenge nonce is random per socket and never logged.
    let mut challenge = json!({"nonce": uuid::Uuid::new_v4().to_string(), "ts": now_ms()});
    if shared.protocol() >= 4 {
        challenge["capabilities"] = json!(["model-catalog-snapshot"]);
    }
    if let Ok(text) = encode_event("connect.challenge", &challenge, None) {
        let _ = tx.send(Outbound::Text { text, event: Some("connect.challenge".to_owned()) });
    }
    drop(tx);

    let deadline = Instant::now() + handshake_timeout(shared.protocol());
    let mut handshaken = false;
    let mut close: Option<(u16, String)> = None;
    loop {
        if *frozen.borrow_and_update() {
            // Neither read nor write: the peer's frames stay in the kernel buffers, ours in `rx`.
            thawed(&mut frozen).await;
            continue;
        }
        tokio::select! {
            () = freeze_changed(&mut frozen) => {}
            out = rx.recv() => match out {
                Some(first @ Outbound::Text { .. }) => match send_burst(&shared, key, first, &mut rx, &mut ws).await {
                    Ok(None) => {}
                    Ok(Some(Outbound::Close { code, reason })) => {
                        close = Some((code, reason));
                        break;
                    }
                    Ok(Some(_)) | Err(()) => break,
                },
                Some(Outbound::Close { code, reason }) => {
                    close = Some((code, reason));
                    break;
                }
                Some(Outbound::Drop) | None => break,
            },
            msg = ws.next() => match msg {
                Some(Ok(msg @ (Message::Text(_) | Message::Binary(_)))) => {
                    // Node's `ws` hands binary frames to the gateway as text; so do we.
                    let text = match &msg {
                        Message::Binary(b) => String::from_utf8_lossy(b),
                        Message::Text(t) => std::borrow::Cow::Borrowed(t.as_str()),
                        _ => std::borrow::Cow::Borrowed(""),
                    };
                    match on_text(&shared, key, handshaken, &text) {
                        Ok(Next::Continue) => {}
                        Ok(Next::Handshaken) => handshaken = true,
                        // Closing: answers queued before the close still go out first.
                        Err((code, reason)) => {
                            flush_queued(&shared, key, &mut rx, &mut ws).await;
                            close = Some((code, reason));
                            break;
                        }
                    }
                }
                Some(Ok(Message::Close(frame))) => {
                    shared.lock().client_closed(key, frame.map_or(1005, |f| u16::from(f.code)));
                    break;
                }
                None => break,
                Some(Ok(_)) => {}
                Some(Err(tokio_tungstenite::tungstenite::Error::Capacity(_))) => {
                    close = Some((1009, String::new()));
                    break;
                }
                Some(Err(_)) => break,
            },
            _ = tokio::time::sleep_until(deadline), if !handshaken => {
                shared.lock().totals.handshakes_failed += 1;
                close = Some((1000, String::new()));
                break;
            }
        }
    }
    if let Some((code, reason)) = close {
        let frame = CloseFrame { code: CloseCode::from(code), reason: truncate_reason(&reason).into() };
        if ws.send(Message::Close(Some(frame))).await.is_ok() {
            // Let the client's close reply arrive so it sees a clean close, not a reset.
            let _ = tokio::time::timeout(CLOSE_LINGER, async { while let Some(Ok(_)) = ws.next().await {} }).await;
        }
    }
    shared.lock().remove_conn(key);
}

/// Writes frames already queued for this connection (answers that precede a close).
async fn flush_queued<S>(
    shared: &Shared,
    key: ConnKey,
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Outbound>,
    ws: &mut tokio_tungstenite::WebSocketStream<S>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    while let Ok(out) = rx.try_recv() {
        if let Outbound::Text { text, event } = out {
            let len = text.len();
            if ws.send(Message::text(text)).await.is_err() {
                return;
            }
            shared.lock().count_sent(key, len, event.as_deref());
        }
    }
}

/// Frames one burst writes at most before it flushes.
const BURST: usize = 256;

/// Writes `first` and every text frame already queued behind it (up to [`BURST`]) with ONE flush:
/// frames due at the same moment (many runs' deltas on one connection) leave in one write instead
/// of a syscall each, for this process and for the client reading them, as a busy gateway's socket
/// would carry them. Returns the close or drop met in the queue (sent after the burst), `Err` when
/// the socket failed.
async fn send_burst<S>(
    shared: &Shared,
    key: ConnKey,
    first: Outbound,
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Outbound>,
    ws: &mut tokio_tungstenite::WebSocketStream<S>,
) -> Result<Option<Outbound>, ()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut next = Some(first);
    let mut stop = None;
    let mut fed = 0;
    while let Some(out) = next.take() {
        let Outbound::Text { text, event } = out else {
            stop = Some(out);
            break;
        };
        let len = text.len();
        ws.feed(Message::text(text)).await.map_err(|_| ())?;
        shared.lock().count_sent(key, len, event.as_deref());
        fed += 1;
        if fed < BURST {
            next = rx.try_recv().ok();
        }
    }
    ws.flush().await.map_err(|_| ())?;
    Ok(stop)
}

type Closing = (u16, String);

/// Handles one inbound text frame. `Err` closes the socket with that code and reason.
fn on_text(shared: &Arc<Shared>, key: ConnKey, handshaken: bool, text: &str) -> Result<Next, Closing> {
    if !handshaken {
        let cap = MAX_PREAUTH_PAYLOAD.min(shared.cfg.max_payload);
        if text.len() > cap {
            shared.lock().totals.handshakes_failed += 1;
            return Err((1009, String::new()));
        }
        return handshake(shared, key, text).map(|()| Next::Handshaken).inspect_err(|_| {
            shared.lock().totals.handshakes_failed += 1;
        });
    }
    if text.len() > shared.cfg.max_payload {
        return Err((1009, String::new()));
    }
    let schemas = schema::for_protocol(shared.protocol());
    let Ok(frame) = serde_json::from_str::<Value>(text) else {
        tracing::debug!("replay gateway: ignoring a frame that is not JSON");
        return Ok(Next::Continue);
    };
    // Any frame that is not a valid request is answered (the connection stays): with its own id
    // when it has one, of whatever JSON type (2026.9.6 echoes `"id": 7` as is), else "invalid".
    if let Err(e) = schema::check_request_frame(&frame, &schemas) {
        let id = frame.get("id").cloned().unwrap_or_else(|| json!("invalid"));
        let error = invalid(format!("invalid request frame: {e}"));
        let res = json!({"type": "res", "id": id, "ok": false, "error": error});
        shared.lock().send_to(key, res.to_string());
        return Ok(Next::Continue);
    }
    let field = |name: &str| frame.get(name).and_then(Value::as_str).unwrap_or_default().to_owned();
    let req = RequestFrame {
        id: field("id"),
        method: field("method"),
        params: serde_json::value::to_raw_value(frame.get("params").unwrap_or(&Value::Null)).unwrap_or_else(|_| null_raw()),
        traceparent: frame.get("traceparent").and_then(Value::as_str).map(str::to_owned),
    };
    let params = frame.get("params").cloned().unwrap_or(Value::Null);
    methods::dispatch(shared, key, req, params);
    Ok(Next::Continue)
}

/// A raw JSON `null`.
fn null_raw() -> Box<serde_json::value::RawValue> {
    serde_json::value::RawValue::from_string("null".to_owned()).unwrap_or_else(|_| unreachable!("null is JSON"))
}

/// The connect params the handshake acts on (the schema allows many more).
struct Connect {
    min_protocol: u64,
    max_protocol: u64,
    role: Option<String>,
    scopes: Vec<String>,
    caps: Vec<String>,
    token: Option<String>,
    device: bool,
}

impl Connect {
    /// Reads already checked params.
    fn read(raw: &Value) -> Self {
        let strings = |name: &str| -> Vec<String> {
            raw.get(name).and_then(Value::as_array).map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect()).unwrap_or_default()
        };
        Self {
            min_protocol: raw.get("minProtocol").and_then(Value::as_u64).unwrap_or(0),
            max_protocol: raw.get("maxProtocol").and_then(Value::as_u64).unwrap_or(0),
            role: raw.get("role").and_then(Value::as_str).map(str::to_owned),
            scopes: strings("scopes"),
            caps: strings("caps"),
            token: raw.pointer("/auth/token").and_then(Value::as_str).map(str::to_owned),
            device: raw.get("device").is_some_and(Value::is_object),
        }
    }
}

/// Answers the first frame, which must be `connect`. `Err` carries the close code and reason.
fn handshake(shared: &Arc<Shared>, key: ConnKey, text: &str) -> Result<(), Closing> {
    let protocol = shared.protocol();
    let schemas = schema::for_protocol(protocol);
    // Not JSON: a plain close, no answer.
    let frame: Value = serde_json::from_str(text).map_err(|_| (1000, String::new()))?;
    // Not a valid request frame (an event, a stray field): closed without an answer.
    if schema::check_request_frame(&frame, &schemas).is_err() {
        return Err((1008, "invalid request frame".to_owned()));
    }
    let id = frame.get("id").and_then(Value::as_str).unwrap_or_default().to_owned();
    let fail = |error: ErrorShape, code: u16| -> Result<(), Closing> {
        let reason = error.message.clone();
        respond(shared, key, &id, Err(error));
        Err((code, reason))
    };
    if frame.get("method").and_then(Value::as_str) != Some("connect") {
        return fail(invalid("invalid handshake: first request must be connect"), 1008);
    }
    // The "gateway starting" window comes before anything is looked at.
    if shared.unavailable_connects.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
        let mut e = ErrorShape::new("UNAVAILABLE", "gateway starting; retry shortly");
        e.retryable = Some(true);
        e.retry_after_ms = Some(shared.unavailable_retry_after_ms.load(Ordering::SeqCst));
        e.details = Some(json!({"reason": "startup-sidecars"}));
        let _ = fail(e, 1013);
        return Err((1013, "gateway starting".to_owned()));
    }
    let raw = frame.get("params").cloned().unwrap_or(Value::Null);
    if let Err(e) = schema::check(&raw, schemas.connect, schemas.wording) {
        return fail(invalid(format!("invalid connect params: {e}")), 1008);
    }
    let params = Connect::read(&raw);
    if params.role.as_deref().is_some_and(|r| r != "operator") {
        return fail(invalid("invalid role"), 1008);
    }
    let protocol_wide = u64::from(protocol);
    if params.min_protocol > protocol_wide || params.max_protocol < protocol_wide {
        let (message, details) = if protocol >= 4 {
            (
                "protocol mismatch".to_owned(),
                json!({"code": "PROTOCOL_MISMATCH", "clientMinProtocol": params.min_protocol, "clientMaxProtocol": params.max_protocol,
                       "expectedProtocol": protocol, "minimumProbeProtocol": 3}),
            )
        } else {
            ("protocol mismatch".to_owned(), json!({"expectedProtocol": protocol}))
        };
        let mut e = invalid(message);
        e.details = Some(details);
        return fail(e, 1002);
    }
    if let Some(expected) = &shared.cfg.token {
        match params.token.as_deref().filter(|t| !t.is_empty()) {
            // Neither a token nor a device identity: the gateway wants a device to pair.
            None if !params.device => {
                let mut e = ErrorShape::new("NOT_PAIRED", "device identity required");
                e.details = Some(json!({"code": "DEVICE_IDENTITY_REQUIRED"}));
                return fail(e, 1008);
            }
            Some(given) if given == expected.as_str() => {}
            _ => {
                let mut e = invalid("unauthorized: gateway token mismatch (provide gateway auth token)");
                e.details = Some(json!({"code": "AUTH_TOKEN_MISMATCH", "authReason": "token_mismatch", "canRetryWithDeviceToken": false,
                                        "recommendedNextStep": "update_auth_credentials"}));
                return fail(e, 1008);
            }
        }
    }
    // Scopes: asked-for operator scopes only. Protocol 3 clears them without a device identity
    // (the signature is not verified here: a present `device` object is enough).
    let granted: Vec<String> = if protocol == 3 && !params.device {
        Vec::new()
    } else {
        let mut g: Vec<String> = Vec::new();
        for s in &params.scopes {
            if OPERATOR_SCOPES.contains(&s.as_str()) && !g.contains(s) {
                g.push(s.clone());
            }
        }
        g
    };
    // A gateway without the feature ignores the cap: the connection gets every run's events.
    let scoped_events = shared.cfg.session_scoped_events && params.caps.iter().any(|c| c == CAP_SESSION_SCOPED_EVENTS);
    let tool_events = protocol >= 4 && params.caps.iter().any(|c| c == CAP_TOOL_EVENTS);
    let conn_id = {
        let mut st = shared.lock();
        let Some(c) = st.conns.get_mut(&key) else { return Err((1000, String::new())) };
        c.handshaken = true;
        c.scopes = Scopes::from_granted(&granted);
        c.scoped_events = scoped_events;
        c.tool_events = tool_events;
        let conn_id = c.conn_id.clone();
        if let Some(s) = st.stats.get_mut(&key) {
            s.handshaken = true;
            s.scopes = granted.clone();
            s.session_scoped = scoped_events;
        }
        st.totals.handshakes_ok += 1;
        conn_id
    };
    let hello = hello_ok(shared, conn_id, granted);
    if let Ok(text) = encode_response(&id, Ok(&hello)) {
        shared.lock().send_to(key, text);
    }
    Ok(())
}

/// `hello-ok` with every key the release sends, valid against the official schema (protocol 4):
/// the snapshot (presence of the gateway itself, health, state versions, session defaults, ...),
/// the policy, the granted auth and an empty plugin surface (the replay has no Control UI).
fn hello_ok(shared: &Shared, conn_id: String, granted: Vec<String>) -> Value {
    let protocol = shared.protocol();
    let mut events: Vec<String> = ["connect.challenge", "agent", "chat", "tick", "shutdown"].iter().map(|s| (*s).to_owned()).collect();
    for e in &shared.event_names {
        if !events.contains(e) {
            events.push(e.clone());
        }
    }
    let now = now_ms();
    let uptime_ms = shared.lock().booted_at.map_or(0, |t| t.elapsed().as_millis() as u64);
    let version = format!("replay-{}", shared.cfg.cassette.source);
    let mut health = json!({
        "ok": true, "ts": now, "durationMs": 0, "channels": {}, "channelOrder": [], "channelLabels": {},
        "heartbeatSeconds": 0, "defaultAgentId": "main", "agents": [], "sessions": {"path": "replay://sessions", "count": 0, "recent": []},
    });
    let mut hello = json!({
        "type": "hello-ok",
        "protocol": protocol,
        "server": {"version": version, "connId": conn_id},
        "features": {"methods": methods::offered_methods(&shared.cfg), "events": events},
        "snapshot": {
            "presence": [{"host": "replay", "version": version, "mode": "gateway", "reason": "self", "ts": now}],
            "stateVersion": {"presence": 1, "health": 1},
            "uptimeMs": uptime_ms,
            "sessionDefaults": {"defaultAgentId": "main", "mainKey": "main", "mainSessionKey": "agent:main:main", "scope": "per-sender"},
        },
        "policy": {
            "maxPayload": shared.cfg.advertised_max_payload.unwrap_or(shared.cfg.max_payload as u64),
            "maxBufferedBytes": MAX_BUFFERED_BYTES,
            "tickIntervalMs": shared.cfg.advertised_tick_interval_ms.unwrap_or(shared.cfg.tick_interval_ms),
        },
    });
    let snap = &mut hello["snapshot"];
    snap["configPath"] = json!("replay://openclaw.json");
    snap["stateDir"] = json!("replay://state");
    snap["authMode"] = json!(if shared.cfg.token.is_some() { "token" } else { "none" });
    if protocol >= 4 {
        health["plugins"] = json!({"loaded": [], "errors": []});
        health["configReload"] = json!({"hotReloadStatus": "active"});
        health["eventLoop"] =
            json!({"degraded": false, "degradedSinceMs": null, "reasons": [], "intervalMs": 1000, "delayP99Ms": 0, "delayMaxMs": 0, "utilization": 0, "cpuCoreRatio": 0});
        hello["server"]["bootId"] = json!(shared.lock().boot_id.clone());
        let mut capabilities = vec!["model-catalog-snapshot"];
        // The Cogni fork says it takes per-session outboundHeaders.
        if shared.cfg.accept_outbound_headers {
            capabilities.push(CAP_OUTBOUND_HEADERS);
        }
        hello["features"]["capabilities"] = json!(capabilities);
        hello["auth"] = json!({"role": "operator", "scopes": granted, "recoveryScope": uuid::Uuid::new_v4().simple().to_string()});
        hello["controlUiWidgetKinds"] = json!([]);
        hello["pluginSurfaceUrls"] = json!({});
        let snap = &mut hello["snapshot"];
        snap["suspension"] = json!({"phase": "accepting"});
        snap["appliedConfigHash"] = json!(null);
        snap["updateSchedule"] = json!({"channel": "stable", "autoEnabled": false});
        let policy = &mut hello["policy"];
        policy["attachments"] = json!({"maxBytes": 19_464_192, "maxImageBytes": 6_291_456});
        policy["allowedSessionVisibilities"] = json!(["shared", "read-only", "suggest", "draft"]);
        policy["hasMultipleSessionSharingIdentities"] = json!(false);
    } else {
        hello["canvasHostUrl"] = json!("replay://canvas");
    }
    hello["snapshot"]["health"] = health;
    hello
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::replay::{ReplayConfig, ReplayGateway};
    use std::pin::Pin;
    use std::sync::atomic::AtomicUsize;
    use std::task::{Context, Poll};
    use tokio_tungstenite::tungstenite::protocol::Role;

    /// A socket that counts its writes.
    struct Counting(tokio::io::DuplexStream, Arc<AtomicUsize>);

    impl tokio::io::AsyncRead for Counting {
        fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut tokio::io::ReadBuf<'_>) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.0).poll_read(cx, buf)
        }
    }

    impl tokio::io::AsyncWrite for Counting {
        fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
            self.1.fetch_add(1, Ordering::SeqCst);
            Pin::new(&mut self.0).poll_write(cx, buf)
        }
        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.0).poll_flush(cx)
        }
        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.0).poll_shutdown(cx)
        }
    }

    fn text(i: usize) -> Outbound {
        Outbound::Text { text: format!("{{\"frame\":{i}}}"), event: None }
    }

    /// What the connection task reported; frames are handed to a task on the same thread, as
    /// the supervisor's mailbox takes them.
    #[derive(Clone)]
    struct Recorder {
        up: Arc<AtomicUsize>,
        /// How many frames the consumer had taken when each frame was handed on.
        seen: Arc<std::sync::Mutex<Vec<usize>>>,
        consumed: Arc<AtomicUsize>,
        to_consumer: tokio::sync::mpsc::UnboundedSender<()>,
        /// The outbound sender, kept: dropping it closes the connection.
        tx: Arc<std::sync::Mutex<Option<tokio::sync::mpsc::UnboundedSender<String>>>>,
    }

    impl clawmux_actors::connection::ConnEvents for Recorder {
        fn up(&self, _: clawmux_protocol::handshake::HelloOk, tx: tokio::sync::mpsc::UnboundedSender<String>) {
            *self.tx.lock().unwrap() = Some(tx);
            self.up.store(1, Ordering::SeqCst);
        }
        fn failed(&self, _: clawmux_actors::connection::ConnectFailure) {}
        fn frame(&self, _: Result<clawmux_protocol::Frame, clawmux_protocol::DecodeError>, _: std::time::Instant) {
            self.seen.lock().unwrap().push(self.consumed.load(Ordering::SeqCst));
            let _ = self.to_consumer.send(());
        }
        fn closed(&self, _: String) {}
    }

    /// clawmux's connection task shares its thread with the supervisor, which routes what it
    /// hands on: within a burst of frames read at once, each frame is taken (routed) before the
    /// next one is decoded, not all of them after the last (which made every frame of a burst
    /// wait for the decoding of the rest).
    #[actix_rt::test]
    async fn the_connection_task_lets_each_frame_of_a_burst_be_taken_before_the_next() {
        let gw = ReplayGateway::start("127.0.0.1:0".parse().unwrap(), ReplayConfig::default().speed(0.0).token("t")).unwrap();
        let (to_consumer, mut frames) = tokio::sync::mpsc::unbounded_channel();
        let rec = Recorder {
            up: Arc::default(),
            seen: Arc::default(),
            consumed: Arc::default(),
            to_consumer,
            tx: Arc::default(),
        };
        let consumed = rec.consumed.clone();
        actix_rt::spawn(async move {
            while frames.recv().await.is_some() {
                consumed.fetch_add(1, Ordering::SeqCst);
            }
        });
        let params = clawmux_protocol::handshake::ConnectParams::multiplexer("test", Some("t".to_owned()));
        actix_rt::spawn(clawmux_actors::connection::run(gw.url(), params, None, Duration::from_secs(10), rec.clone()));
        let deadline = Instant::now() + Duration::from_secs(10);
        while rec.up.load(Ordering::SeqCst) == 0 {
            assert!(Instant::now() < deadline, "no hello-ok");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let before = rec.seen.lock().unwrap().len();
        // Queued while frozen: they leave in one write when thawed, and arrive in one read.
        gw.set_frozen(true);
        for i in 0..10 {
            gw.broadcast_raw(&format!(r#"{{"type":"event","event":"tick","payload":{{"ts":{i}}}}}"#));
        }
        gw.set_frozen(false);
        while rec.seen.lock().unwrap().len() < before + 10 {
            assert!(Instant::now() < deadline, "the burst did not arrive");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let seen = rec.seen.lock().unwrap()[before..before + 10].to_vec();
        assert!(seen.windows(2).all(|w| w[1] == w[0] + 1), "each frame taken before the next is handed on: {seen:?}");
        gw.stop().await;
    }

    #[tokio::test]
    async fn frames_queued_together_leave_in_one_write_in_order_and_a_close_behind_them_is_returned() {
        let gw = ReplayGateway::start("127.0.0.1:0".parse().unwrap(), ReplayConfig::default().speed(0.0)).unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let key = gw.inner.shared.lock().add_conn(tx.clone(), "burst".to_owned());
        let (ours, theirs) = tokio::io::duplex(1 << 20);
        let writes = Arc::new(AtomicUsize::new(0));
        let mut ws = tokio_tungstenite::WebSocketStream::from_raw_socket(Counting(ours, writes.clone()), Role::Server, None).await;
        let mut client = tokio_tungstenite::WebSocketStream::from_raw_socket(theirs, Role::Client, None).await;
        for i in 1..10 {
            tx.send(text(i)).unwrap();
        }
        tx.send(Outbound::Close { code: 1012, reason: "restart".to_owned() }).unwrap();
        let stop = send_burst(&gw.inner.shared, key, text(0), &mut rx, &mut ws).await.unwrap();
        assert!(matches!(stop, Some(Outbound::Close { code: 1012, .. })), "the close comes back to be sent after the burst");
        assert_eq!(writes.load(Ordering::SeqCst), 1, "ten frames, one write");
        for i in 0..10 {
            let got = client.next().await.unwrap().unwrap();
            assert_eq!(got.into_text().unwrap().as_str(), format!("{{\"frame\":{i}}}"));
        }
        gw.stop().await;
    }
}
