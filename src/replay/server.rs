//! Sockets: the accept loop, one task per connection (challenge, handshake, request loop, frame
//! writing and counting) and the `tick` task.

use super::config::MAX_BUFFERED_BYTES;
use super::methods::{self, invalid, respond};
use super::schema::{self, Wording};
use super::state::{now_ms, wait_true, ConnKey, Outbound, Scopes, Shared};
use clawmux_protocol::frame::{decode_frame, encode_event, encode_response, Frame};
use clawmux_protocol::handshake::{ConnectParams, CAP_SESSION_SCOPED_EVENTS, OPERATOR_SCOPES};
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

/// The gateway closes a socket that has not completed `connect` within 10 s (close 1000).
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Frames before the handshake are capped at 64 KiB (close 1009 `preauth payload too large`).
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

    let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
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
                Some(Outbound::Text { text, event }) => {
                    let len = text.len();
                    if ws.send(Message::text(text)).await.is_err() {
                        break;
                    }
                    shared.lock().count_sent(key, len, event.as_deref());
                }
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
                Some(Ok(Message::Close(_))) | None => break,
                Some(Ok(_)) => {}
                Some(Err(tokio_tungstenite::tungstenite::Error::Capacity(_))) => {
                    close = Some((1009, "Max payload size exceeded".to_owned()));
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

type Closing = (u16, String);

/// Handles one inbound text frame. `Err` closes the socket with that code and reason.
fn on_text(shared: &Arc<Shared>, key: ConnKey, handshaken: bool, text: &str) -> Result<Next, Closing> {
    if !handshaken {
        let cap = MAX_PREAUTH_PAYLOAD.min(shared.cfg.max_payload);
        if text.len() > cap {
            shared.lock().totals.handshakes_failed += 1;
            return Err((1009, "preauth payload too large".to_owned()));
        }
        return handshake(shared, key, text).map(|()| Next::Handshaken).inspect_err(|_| {
            shared.lock().totals.handshakes_failed += 1;
        });
    }
    if text.len() > shared.cfg.max_payload {
        return Err((1009, "Max payload size exceeded".to_owned()));
    }
    let protocol = shared.protocol();
    let Ok(frame) = serde_json::from_str::<Value>(text) else {
        tracing::debug!("replay gateway: ignoring a frame that is not JSON");
        return Ok(Next::Continue);
    };
    if frame.get("type").and_then(Value::as_str) != Some("req") {
        return Ok(Next::Continue);
    }
    let id = frame.get("id").and_then(Value::as_str).unwrap_or_default().to_owned();
    if let Err(e) = schema::check_request_frame(&frame, protocol) {
        if !id.is_empty() {
            respond(shared, key, &id, Err(invalid(format!("invalid request frame: {e}"))));
        }
        return Ok(Next::Continue);
    }
    match decode_frame(text, shared.cfg.max_payload) {
        Ok(Frame::Req(req)) => {
            let params = frame.get("params").cloned().unwrap_or(Value::Null);
            methods::dispatch(shared, key, req, params);
        }
        Ok(_) => {}
        Err(e) => respond(shared, key, &id, Err(invalid(format!("invalid request frame: {e}")))),
    }
    Ok(Next::Continue)
}

/// Answers the first frame, which must be `connect`. `Err` carries the close code and reason.
fn handshake(shared: &Arc<Shared>, key: ConnKey, text: &str) -> Result<(), Closing> {
    let protocol = shared.protocol();
    let frame: Value = serde_json::from_str(text).map_err(|_| (1008, "invalid handshake".to_owned()))?;
    // A first frame that is not a request gets no answer, only the close.
    if frame.get("type").and_then(Value::as_str) != Some("req") {
        return Err((1008, "invalid handshake".to_owned()));
    }
    let id = frame.get("id").and_then(Value::as_str).unwrap_or_default().to_owned();
    let fail = |error: ErrorShape, code: u16| -> Result<(), Closing> {
        let reason = error.message.clone();
        respond(shared, key, &id, Err(error));
        Err((code, reason))
    };
    if let Err(e) = schema::check_request_frame(&frame, protocol) {
        return fail(invalid(format!("invalid request frame: {e}")), 1008);
    }
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
    let wording = if protocol == 3 { Wording::V3 } else { Wording::V4 };
    if let Err(e) = schema::check(&raw, schema::CONNECT, wording) {
        return fail(invalid(format!("invalid connect params: {e}")), 1008);
    }
    let params: ConnectParams = match serde_json::from_value(raw) {
        Ok(p) => p,
        Err(e) => return fail(invalid(format!("invalid connect params: {e}")), 1008),
    };
    if params.role.as_deref().is_some_and(|r| r != "operator") {
        return fail(invalid("invalid role"), 1008);
    }
    if params.min_protocol > protocol || params.max_protocol < protocol {
        let details = if protocol >= 4 {
            json!({"code": "PROTOCOL_MISMATCH", "clientMinProtocol": params.min_protocol, "clientMaxProtocol": params.max_protocol,
                   "expectedProtocol": protocol, "minimumProbeProtocol": 3})
        } else {
            json!({"expectedProtocol": protocol})
        };
        let mut e = invalid("protocol mismatch");
        e.details = Some(details);
        return fail(e, 1002);
    }
    if let Some(expected) = &shared.cfg.token {
        let given = params.auth.as_ref().and_then(|a| a.token.as_deref());
        if given != Some(expected.as_str()) {
            let mut e = invalid("unauthorized: gateway token mismatch (provide gateway auth token)");
            e.details = Some(json!({"code": "AUTH_TOKEN_MISMATCH", "authReason": "token_mismatch", "canRetryWithDeviceToken": false,
                                    "recommendedNextStep": "update_auth_credentials"}));
            return fail(e, 1008);
        }
    }
    // Scopes: asked-for operator scopes only. Protocol 3 clears them without a device identity
    // (the signature is not verified here: a present `device` object is enough).
    let granted: Vec<String> = if protocol == 3 && params.device.is_none() {
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
    let conn_id = {
        let mut st = shared.lock();
        let Some(c) = st.conns.get_mut(&key) else { return Err((1000, String::new())) };
        c.handshaken = true;
        c.scopes = Scopes::from_granted(&granted);
        c.scoped_events = scoped_events;
        let conn_id = c.conn_id.clone();
        if let Some(s) = st.stats.get_mut(&key) {
            s.handshaken = true;
            s.scopes = granted.clone();
            s.session_scoped = scoped_events;
        }
        st.totals.handshakes_ok += 1;
        conn_id
    };
    let mut events: Vec<String> = ["connect.challenge", "agent", "chat", "tick", "shutdown"].iter().map(|s| (*s).to_owned()).collect();
    for e in &shared.event_names {
        if !events.contains(e) {
            events.push(e.clone());
        }
    }
    let mut hello = json!({
        "type": "hello-ok",
        "protocol": protocol,
        "server": {"version": format!("replay-{}", shared.cfg.cassette.source), "connId": conn_id},
        "features": {"methods": methods::offered_methods(&shared.cfg), "events": events},
        "snapshot": {"uptimeMs": shared.lock().booted_at.map_or(0, |t| t.elapsed().as_millis() as u64)},
        "policy": {
            "maxPayload": shared.cfg.advertised_max_payload.unwrap_or(shared.cfg.max_payload as u64),
            "maxBufferedBytes": MAX_BUFFERED_BYTES,
            "tickIntervalMs": shared.cfg.advertised_tick_interval_ms.unwrap_or(shared.cfg.tick_interval_ms),
        },
    });
    if protocol >= 4 {
        hello["auth"] = json!({"role": "operator", "scopes": granted});
        hello["server"]["bootId"] = json!(shared.lock().boot_id.clone());
    }
    if let Ok(text) = encode_response(&id, Ok(&hello)) {
        shared.lock().send_to(key, text);
    }
    Ok(())
}
