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
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;

/// Largest frame accepted before `hello-ok` tells the real limit (hello-ok itself is ~100 KB).
pub const PRE_HELLO_MAX: usize = 4 * 1024 * 1024;

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
}

/// What the connection task reports.
pub trait ConnEvents: Send + 'static {
    /// Handshake done; outbound frames go to `tx`.
    fn up(&self, hello: HelloOk, tx: mpsc::UnboundedSender<String>);
    /// The attempt failed before hello-ok.
    fn failed(&self, failure: ConnectFailure);
    /// A decoded frame (or a decode error) after hello-ok.
    fn frame(&self, frame: Result<Frame, String>);
    /// The connection ended.
    fn closed(&self, reason: String);
}

/// Connects, handshakes with `params`, then pumps frames until the socket closes.
pub async fn run(url: String, params: ConnectParams, handshake_timeout: Duration, events: impl ConnEvents) {
    let config = WebSocketConfig::default().max_message_size(Some(PRE_HELLO_MAX)).max_frame_size(Some(PRE_HELLO_MAX));
    let connect = tokio_tungstenite::connect_async_with_config(url.as_str(), Some(config), false);
    let ws = match tokio::time::timeout(handshake_timeout, connect).await {
        Ok(Ok((ws, _))) => ws,
        Ok(Err(e)) => {
            events.failed(ConnectFailure { reason: format!("cannot connect to the gateway at {url}: {e}"), retry_after: None, auth: false });
            return;
        }
        Err(_) => {
            events.failed(ConnectFailure { reason: format!("connecting to the gateway at {url} timed out"), retry_after: None, auth: false });
            return;
        }
    };
    let (mut sink, mut stream) = ws.split();

    let hello = match tokio::time::timeout(handshake_timeout, handshake(&mut sink, &mut stream, &params)).await {
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
            });
            return;
        }
    };
    let max_payload = usize::try_from(hello.policy.max_payload).unwrap_or(usize::MAX);

    let (tx, mut rx) = mpsc::unbounded_channel::<String>();
    events.up(hello, tx);

    // The writer ends when the supervisor drops its sender (disconnect) or the socket fails.
    let writer = async move {
        while let Some(text) = rx.recv().await {
            if sink.send(Message::text(text)).await.is_err() {
                break;
            }
        }
        let _ = sink.close().await;
    };
    let reader = async {
        loop {
            match stream.next().await {
                Some(Ok(Message::Text(text))) => events.frame(decode_frame(text.as_str(), max_payload).map_err(|e| e.to_string())),
                Some(Ok(Message::Binary(_))) => events.frame(Err("binary frame from the gateway".to_owned())),
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

async fn handshake<S, R>(sink: &mut S, stream: &mut R, params: &ConnectParams) -> Result<HelloOk, ConnectFailure>
where
    S: futures_util::Sink<Message, Error = tokio_tungstenite::tungstenite::Error> + Unpin,
    R: futures_util::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    let fail = |reason: String| ConnectFailure { reason, retry_after: None, auth: false };
    // 1. connect.challenge (its nonce is only needed by device identities; never logged).
    loop {
        let text = next_text(stream).await.map_err(fail)?;
        match decode_frame(&text, PRE_HELLO_MAX) {
            Ok(Frame::Event(ev)) if matches!(ev.event, GatewayEvent::ConnectChallenge(_)) => break,
            Ok(_) => continue,
            Err(e) => return Err(fail(format!("the gateway sent a malformed frame during the handshake: {e}"))),
        }
    }
    // 2. connect.
    let req = encode_request("connect", "connect", params, None).map_err(|e| fail(format!("cannot encode connect: {e}")))?;
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
            return Err(explain(res.error.unwrap_or_else(|| ErrorShape::new("UNKNOWN", "no error given"))));
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

/// Turns a refused `connect` into a sentence an operator can act on.
fn explain(e: ErrorShape) -> ConnectFailure {
    let retry_after = if e.is_retryable() { Some(Duration::from_millis(e.retry_after_ms.unwrap_or(500))) } else { None };
    let detail = e.detail_code().unwrap_or_default().to_owned();
    let auth = detail.starts_with("AUTH_") || e.message.starts_with("unauthorized");
    let reason = if auth {
        format!(
            "the gateway rejected clawmux's token ({}); set CLAWMUX_GATEWAY_TOKEN to the gateway's gateway.auth.token",
            e.message
        )
    } else if detail == "PROTOCOL_MISMATCH" || e.message.contains("protocol mismatch") {
        format!("the gateway speaks a protocol outside 3..=4 ({})", e.message)
    } else if retry_after.is_some() {
        format!("the gateway is starting ({}); retrying", e.message)
    } else {
        format!("the gateway refused the connection: {e}")
    };
    ConnectFailure { reason, retry_after, auth }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_mismatch_is_explained_without_the_token() {
        let mut e = ErrorShape::new("INVALID_REQUEST", "unauthorized: gateway token mismatch (provide gateway auth token)");
        e.details = Some(serde_json::json!({"code":"AUTH_TOKEN_MISMATCH"}));
        let f = explain(e);
        assert!(f.auth);
        assert!(f.reason.contains("CLAWMUX_GATEWAY_TOKEN"));
        assert!(f.retry_after.is_none());
    }

    #[test]
    fn unavailable_is_retried_after_the_gateways_delay() {
        let mut e = ErrorShape::new("UNAVAILABLE", "gateway starting; retry shortly");
        e.retryable = Some(true);
        e.retry_after_ms = Some(750);
        let f = explain(e);
        assert_eq!(f.retry_after, Some(Duration::from_millis(750)));
        assert!(!f.auth);
    }
}
