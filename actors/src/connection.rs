//! The WebSocket I/O of the one gateway connection: connect, handshake, then pump frames.
//!
//! This runs as a task beside the supervisor actor. It owns the socket; the supervisor owns every
//! decision. It reports through [`ConnEvents`] (the supervisor's mailbox in production, a channel in
//! tests) and is fed outbound frames through an unbounded channel (the supervisor never awaits).

use clawmux_protocol::handshake::{ConnectParams, HelloOk};
use clawmux_protocol::{decode_frame, encode_request, ErrorShape, Frame, GatewayEvent};
use futures_util::{SinkExt, StreamExt};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, WebSocketConfig};
use tokio_tungstenite::tungstenite::Message;

/// Largest frame accepted before `hello-ok` tells the real limit (hello-ok itself is ~100 KB).
pub const PRE_HELLO_MAX: usize = crate::limits::PRE_HELLO_MAX_PAYLOAD;

/// How one connection attempt failed.
#[derive(Debug, Clone)]
pub struct ConnectFailure {
    /// A sentence for `/readyz` and the log (never contains the token).
    pub reason: String,
    /// The gateway asked to retry after this long (`UNAVAILABLE`).
    pub retry_after: Option<Duration>,
    /// The gateway refused our credentials: retrying will not help until someone fixes config,
    /// but clawmux still retries with backoff (the operator may fix the gateway side).
    pub auth: bool,
    /// The gateway wants this device approved first (`openclaw devices approve <requestId>`, the
    /// pending request's id, which the gateway sends as `details.requestId`); clawmux keeps
    /// retrying so it becomes ready as soon as an operator approves.
    pub pairing_required: bool,
    /// The gateway refused the protocol offered (`protocol mismatch`): the one it says it speaks
    /// (`details.expectedProtocol`), or 0 when it does not say. The supervisor then offers the
    /// other protocol clawmux speaks.
    pub protocol_mismatch: Option<u32>,
}

/// What the connection task reports.
pub trait ConnEvents: Send + 'static {
    /// Handshake done; outbound frames go to `tx`.
    fn up(&self, hello: HelloOk, tx: mpsc::UnboundedSender<String>);
    /// The attempt failed before hello-ok.
    fn failed(&self, failure: ConnectFailure);
    /// A decoded frame (or a decode error) after hello-ok, with the moment its bytes arrived.
    fn frame(&self, frame: Result<Frame, clawmux_protocol::DecodeError>, received: std::time::Instant);
    /// The connection ended.
    fn closed(&self, reason: String);
}

/// Connects, handshakes with `params`, then pumps frames until the socket closes.
pub async fn run(
    url: String,
    params: ConnectParams,
    device: Option<std::sync::Arc<crate::device::DeviceIdentity>>,
    handshake_timeout: Duration,
    events: impl ConnEvents,
) {
    // The transport's bound is the largest limit a `hello-ok` can negotiate (tokio-tungstenite
    // cannot change it on an open socket); the tighter limits, before and after `hello-ok`, are
    // applied to each frame before it is parsed (`decode_frame`).
    let cap = crate::limits::MAX_PAYLOAD_CAP;
    let config = WebSocketConfig::default().max_message_size(Some(cap)).max_frame_size(Some(cap));
    // Nagle off: frames are small and latency-sensitive (a run starts with three round trips).
    let connect = tokio_tungstenite::connect_async_with_config(url.as_str(), Some(config), true);
    let ws = match tokio::time::timeout(handshake_timeout, connect).await {
        Ok(Ok((ws, _))) => ws,
        Ok(Err(e)) => {
            events.failed(ConnectFailure {
                reason: format!("cannot connect to the gateway at {url}: {e}"),
                retry_after: None,
                auth: false,
                pairing_required: false,
                protocol_mismatch: None,
            });
            return;
        }
        Err(_) => {
            events.failed(ConnectFailure {
                reason: format!("connecting to the gateway at {url} timed out"),
                retry_after: None,
                auth: false,
                pairing_required: false,
                protocol_mismatch: None,
            });
            return;
        }
    };
    let (mut sink, mut stream) = ws.split();

    let hello = match tokio::time::timeout(handshake_timeout, handshake(&mut sink, &mut stream, params, device.as_deref())).await {
        Ok(Ok(hello)) => hello,
        Ok(Err(failure)) => {
            let _ = sink.close().await;
            events.failed(failure);
            return;
        }
        Err(_) => {
            events.failed(ConnectFailure {
                reason: "the gateway did not complete the handshake in time".to_owned(),
                retry_after: None,
                auth: false,
                pairing_required: false,
                protocol_mismatch: None,
            });
            return;
        }
    };
    // The gateway's `policy.maxPayload` from here on (the real gateway advertises 25 MiB and
    // sends frames that large), within clawmux's own bounds.
    let max_payload = crate::limits::max_payload(hello.policy.max_payload);

    let (tx, mut rx) = mpsc::unbounded_channel::<String>();
    events.up(hello, tx);

    // The writer ends when the supervisor drops its sender (shutdown: `Disconnect`) or the socket
    // fails. A shutdown says goodbye with a normal close (1000), as a client should, rather than
    // a bare close frame (1005) or a dropped socket.
    let writer = async move {
        let mut failed = false;
        while let Some(text) = rx.recv().await {
            if sink.send(Message::text(text)).await.is_err() {
                failed = true;
                break;
            }
        }
        if !failed {
            let bye = CloseFrame { code: CloseCode::Normal, reason: "clawmux shutting down".into() };
            let _ = sink.send(Message::Close(Some(bye))).await;
        }
        let _ = sink.close().await;
    };
    let reader = async {
        loop {
            match stream.next().await {
                Some(Ok(Message::Text(text))) => {
                    let received = std::time::Instant::now();
                    events.frame(decode_frame(text.as_str(), max_payload), received);
                    // The supervisor shares this thread: let it route this frame before the next
                    // one of a burst is decoded, rather than after all of them.
                    tokio::task::yield_now().await;
                }
                Some(Ok(Message::Binary(_))) => events.frame(Err(clawmux_protocol::DecodeError::Malformed { what: "frame".to_owned(), reason: "a binary frame".to_owned() }), std::time::Instant::now()),
                Some(Ok(Message::Close(frame))) => {
                    return match frame {
                        Some(f) => format!("the gateway closed the connection ({} {})", u16::from(f.code), f.reason),
                        None => "the gateway closed the connection".to_owned(),
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => return format!("gateway connection error: {e}"),
                None => return "the gateway connection ended".to_owned(),
            }
        }
    };
    let reason = tokio::select! {
        reason = reader => reason,
        () = writer => "the connection to the gateway was closed".to_owned(),
    };
    events.closed(reason);
}

async fn handshake<S, R>(
    sink: &mut S,
    stream: &mut R,
    mut params: ConnectParams,
    device: Option<&crate::device::DeviceIdentity>,
) -> Result<HelloOk, ConnectFailure>
where
    S: futures_util::Sink<Message, Error = tokio_tungstenite::tungstenite::Error> + Unpin,
    R: futures_util::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    let fail = |reason: String| ConnectFailure { reason, retry_after: None, auth: false, pairing_required: false, protocol_mismatch: None };
    // 1. connect.challenge (its nonce is signed by the device identity; never logged).
    let challenge = loop {
        let text = next_text(stream).await.map_err(fail)?;
        match decode_frame(&text, PRE_HELLO_MAX) {
            Ok(Frame::Event(ev)) => match ev.event {
                GatewayEvent::ConnectChallenge(c) => break c,
                _ => continue,
            },
            Ok(_) => continue,
            Err(e) => return Err(fail(format!("the gateway sent a malformed frame during the handshake: {e}"))),
        }
    };
    // 2. connect, signed by the device when there is one.
    if let Some(device) = device {
        let signed_at_ms = challenge.ts.unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
        });
        let token = params.auth.as_ref().and_then(|a| a.token.clone());
        let proof = device.prove(&crate::device::SignParams {
            client_id: &params.client.id,
            client_mode: &params.client.mode,
            role: params.role.as_deref().unwrap_or("operator"),
            scopes: &params.scopes,
            signed_at_ms,
            token: token.as_deref(),
            nonce: &challenge.nonce,
            platform: &params.client.platform,
            device_family: params.client.device_family.as_deref(),
        });
        params.device = serde_json::to_value(proof).ok();
    }
    let device_id = device.map(|d| d.device_id().to_owned());
    let req = encode_request("connect", "connect", &params, None).map_err(|e| fail(format!("cannot encode connect: {e}")))?;
    sink.send(Message::text(req)).await.map_err(|e| fail(format!("cannot send connect: {e}")))?;
    // 3. hello-ok, matched by id (events may come first).
    loop {
        let text = next_text(stream).await.map_err(fail)?;
        let frame = decode_frame(&text, PRE_HELLO_MAX).map_err(|e| fail(format!("malformed handshake frame: {e}")))?;
        let Frame::Res(res) = frame else { continue };
        if res.id != "connect" {
            continue;
        }
        if !res.ok {
            return Err(explain(res.error.unwrap_or_else(|| ErrorShape::new("UNKNOWN", "no error given")), device_id.as_deref()));
        }
        let payload = res.payload.ok_or_else(|| fail("hello-ok without payload".to_owned()))?;
        let hello: HelloOk = serde_json::from_str(payload.get()).map_err(|e| fail(format!("malformed hello-ok: {e}")))?;
        if hello.protocol < clawmux_protocol::handshake::MIN_PROTOCOL || hello.protocol > clawmux_protocol::handshake::MAX_PROTOCOL {
            return Err(fail(format!("the gateway chose protocol {}, which clawmux does not speak", hello.protocol)));
        }
        return Ok(hello);
    }
}

async fn next_text<R>(stream: &mut R) -> Result<String, String>
where
    R: futures_util::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    loop {
        match stream.next().await {
            Some(Ok(Message::Text(t))) => return Ok(t.as_str().to_owned()),
            Some(Ok(Message::Close(f))) => {
                return Err(match f {
                    Some(f) => format!("the gateway closed the connection during the handshake ({} {})", u16::from(f.code), f.reason),
                    None => "the gateway closed the connection during the handshake".to_owned(),
                })
            }
            Some(Ok(_)) => continue,
            Some(Err(e)) => return Err(format!("gateway connection error during the handshake: {e}")),
            None => return Err("the gateway closed the connection during the handshake".to_owned()),
        }
    }
}

/// Codes a gateway uses to say the device must be paired (or present) first.
const PAIRING_CODES: [&str; 3] = ["NOT_PAIRED", "PAIRING_REQUIRED", "DEVICE_IDENTITY_REQUIRED"];

/// The pending pairing request's id from `details.requestId` (both 2026.4.12 and 2026.9.6 send
/// it), when it looks like one: it is echoed into a command line, so anything else is dropped.
fn pairing_request_id(e: &ErrorShape) -> Option<&str> {
    let id = e.details.as_ref()?.get("requestId")?.as_str()?;
    let ok = id.len() <= 128
        && id.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-'));
    ok.then_some(id)
}

/// Turns a refused `connect` into a sentence an operator can act on.
fn explain(e: ErrorShape, device_id: Option<&str>) -> ConnectFailure {
    let retry_after = if e.is_retryable() { Some(Duration::from_millis(e.retry_after_ms.unwrap_or(500))) } else { None };
    let detail = e.detail_code().unwrap_or_default().to_owned();
    let auth = detail.starts_with("AUTH_") || e.message.starts_with("unauthorized");
    let pairing = PAIRING_CODES.contains(&e.code.as_str()) || PAIRING_CODES.contains(&detail.as_str());
    // 2026.9.6 says `details.code: PROTOCOL_MISMATCH`; 2026.4.12 only `protocol mismatch` with
    // `details.expectedProtocol`.
    let mismatch = detail == "PROTOCOL_MISMATCH" || e.message.starts_with("protocol mismatch");
    let expected = e.details.as_ref().and_then(|d| d.get("expectedProtocol")).and_then(serde_json::Value::as_u64).and_then(|p| u32::try_from(p).ok());
    if pairing {
        // `openclaw devices approve` takes the pending REQUEST's id (a device id is answered with
        // "No pending device request matches ..."), so name both.
        let reason = match (device_id, pairing_request_id(&e)) {
            (Some(id), Some(request)) => format!(
                "the gateway requires this device to be paired ({}): approve it on the gateway host with `openclaw devices approve {request}` (device id {id}, pending request {request}); clawmux keeps retrying",
                e.message
            ),
            (Some(id), None) => format!(
                "the gateway requires this device to be paired ({}): on the gateway host, find the pending request of device id {id} with `openclaw devices list` and approve it with `openclaw devices approve <requestId>`; clawmux keeps retrying",
                e.message
            ),
            (None, _) => format!(
                "the gateway requires a device identity ({}): set CLAWMUX_DEVICE_IDENTITY=on (or auto) so clawmux signs its connection",
                e.message
            ),
        };
        return ConnectFailure { reason, retry_after, auth: false, pairing_required: true, protocol_mismatch: None };
    }
    let reason = if auth {
        format!(
            "the gateway rejected clawmux's token ({}); set CLAWMUX_GATEWAY_TOKEN to the gateway's gateway.auth.token",
            e.message
        )
    } else if mismatch {
        format!("the gateway refused the protocol offered ({}{})", e.message, expected.map_or(String::new(), |p| format!("; it speaks {p}")))
    } else if retry_after.is_some() {
        format!("the gateway is starting ({}); retrying", e.message)
    } else {
        format!("the gateway refused the connection: {e}")
    };
    let protocol_mismatch = mismatch.then(|| expected.unwrap_or(0));
    ConnectFailure { reason, retry_after, auth, pairing_required: false, protocol_mismatch }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_mismatch_is_explained_without_the_token() {
        let mut e = ErrorShape::new("INVALID_REQUEST", "unauthorized: gateway token mismatch (provide gateway auth token)");
        e.details = Some(serde_json::json!({"code":"AUTH_TOKEN_MISMATCH"}));
        let f = explain(e, None);
        assert!(f.auth);
        assert!(f.reason.contains("CLAWMUX_GATEWAY_TOKEN"));
        assert!(f.retry_after.is_none());
    }

    #[test]
    fn a_protocol_mismatch_says_which_protocol_the_gateway_speaks() {
        // 2026.9.6 refusing 3..3, and 2026.4.12 refusing 4..4 (as the official client sees them).
        let mut v4 = ErrorShape::new("INVALID_REQUEST", "protocol mismatch");
        v4.details = Some(serde_json::json!({"code": "PROTOCOL_MISMATCH", "clientMinProtocol": 3, "clientMaxProtocol": 3, "expectedProtocol": 4, "minimumProbeProtocol": 3}));
        assert_eq!(explain(v4, None).protocol_mismatch, Some(4));
        let mut v3 = ErrorShape::new("INVALID_REQUEST", "protocol mismatch");
        v3.details = Some(serde_json::json!({"expectedProtocol": 3}));
        let f = explain(v3, None);
        assert_eq!(f.protocol_mismatch, Some(3));
        assert!(f.reason.contains("it speaks 3"), "{}", f.reason);
        assert_eq!(explain(ErrorShape::new("INVALID_REQUEST", "protocol mismatch"), None).protocol_mismatch, Some(0));
        assert_eq!(explain(ErrorShape::new("INVALID_REQUEST", "invalid role"), None).protocol_mismatch, None);
    }

    #[test]
    fn unavailable_is_retried_after_the_gateways_delay() {
        let mut e = ErrorShape::new("UNAVAILABLE", "gateway starting; retry shortly");
        e.retryable = Some(true);
        e.retry_after_ms = Some(750);
        let f = explain(e, None);
        assert_eq!(f.retry_after, Some(Duration::from_millis(750)));
        assert!(!f.auth);
    }

    #[test]
    fn pairing_names_the_device_and_the_command() {
        for (code, detail) in [("NOT_PAIRED", None), ("INVALID_REQUEST", Some("PAIRING_REQUIRED")), ("DEVICE_IDENTITY_REQUIRED", None)] {
            let mut e = ErrorShape::new(code, "pairing required");
            e.details = detail.map(|d| serde_json::json!({ "code": d }));
            let f = explain(e, Some("abc123"));
            assert!(f.pairing_required, "{code}");
            assert!(f.reason.contains("device id abc123"), "{}", f.reason);
            assert!(f.reason.contains("openclaw devices list"), "{}", f.reason);
            assert!(f.reason.contains("openclaw devices approve <requestId>"), "{}", f.reason);
        }
    }

    #[test]
    fn pairing_names_the_pending_request_the_cli_approves() {
        // As openclaw 2026.9.6 answers a non-loopback `connect` of an unpaired device.
        let mut e = ErrorShape::new("NOT_PAIRED", "pairing required: device is not approved yet");
        e.details = Some(serde_json::json!({
            "code": "PAIRING_REQUIRED",
            "reason": "not-paired",
            "requestId": "4a2378dc-77a9-4d17-8351-1fb4d33b6a20",
            "deviceId": "abc123"
        }));
        let f = explain(e, Some("abc123"));
        assert!(f.pairing_required);
        assert!(f.reason.contains("`openclaw devices approve 4a2378dc-77a9-4d17-8351-1fb4d33b6a20`"), "{}", f.reason);
        assert!(f.reason.contains("device id abc123"), "{}", f.reason);
    }

    #[test]
    fn a_request_id_that_is_not_one_is_not_echoed() {
        let mut e = ErrorShape::new("NOT_PAIRED", "pairing required");
        e.details = Some(serde_json::json!({ "code": "PAIRING_REQUIRED", "requestId": "x; rm -rf /" }));
        let f = explain(e, Some("abc123"));
        assert!(!f.reason.contains("rm -rf"), "{}", f.reason);
        assert!(f.reason.contains("openclaw devices approve <requestId>"), "{}", f.reason);
    }
}
