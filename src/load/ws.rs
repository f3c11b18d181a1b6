//! A minimal gateway client for tools (the per-call load driver and `clawmux record`): one socket,
//! the challenge/connect handshake, numbered requests, and frames read one at a time with
//! counting. It is deliberately NOT the supervisor: the per-call design it serves opens a socket
//! per call, and the recorder wants every frame raw.

use clawmux_protocol::frame::{decode_frame, encode_request, Frame, ResponseFrame};
use clawmux_protocol::{ConnectParams, GatewayEvent, HelloOk};
use futures_util::{SinkExt, StreamExt};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// Largest frame accepted (the gateway's own `policy.maxPayload`).
pub const MAX_FRAME: usize = 26_214_400;
/// The gateway closes sockets that do not finish `connect` in 10 s; a client waits as long.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a gateway conversation failed; `code()` is the error code the load report counts.
#[derive(Debug, thiserror::Error)]
pub enum WsError {
    /// TCP/WebSocket connection failed.
    #[error("cannot connect to {url}: {reason}")]
    Connect {
        /// The URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// The handshake was refused or malformed.
    #[error("handshake failed: {0}")]
    Handshake(String),
    /// The socket closed or broke.
    #[error("gateway connection closed: {0}")]
    Closed(String),
    /// No frame within the time allowed.
    #[error("timed out waiting for the gateway ({0})")]
    Timeout(&'static str),
    /// A request could not be encoded.
    #[error("cannot encode request: {0}")]
    Encode(String),
}

impl WsError {
    /// Error code for reports.
    pub fn code(&self) -> &'static str {
        match self {
            WsError::Connect { .. } => "connect_failed",
            WsError::Handshake(_) => "handshake_failed",
            WsError::Closed(_) => "gateway_disconnected",
            WsError::Timeout(_) => "client_timeout",
            WsError::Encode(_) => "internal",
        }
    }
}

/// One received text frame: the raw text (for recorders and byte counts) and its decoding.
pub struct Received {
    /// The frame as sent.
    pub text: String,
    /// Decoded, or why not (a malformed frame is counted, not fatal).
    pub frame: Result<Frame, String>,
}

/// One open, handshaken gateway socket.
pub struct GatewayConn {
    ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
    next_id: u64,
    /// `hello-ok`.
    pub hello: HelloOk,
    /// Text frames received so far (the challenge and `hello-ok` included).
    pub frames: u64,
    /// Bytes of those frames.
    pub bytes: u64,
    /// The challenge nonce: kept only so that a recorder can prove it wrote it nowhere.
    nonce: String,
}

impl GatewayConn {
    /// Connects and handshakes. The challenge's nonce is not signed (a shared-token client does
    /// not need to) and never logged; [`GatewayConn::leaks_nonce`] checks output against it.
    pub async fn open(url: &str, params: &ConnectParams) -> Result<GatewayConn, WsError> {
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        let (ws, _) = tokio::time::timeout_at(deadline, tokio_tungstenite::connect_async(url))
            .await
            .map_err(|_| WsError::Timeout("connect"))?
            .map_err(|e| WsError::Connect { url: url.to_owned(), reason: e.to_string() })?;
        let mut conn = GatewayConn { ws, next_id: 0, hello: placeholder_hello(), frames: 0, bytes: 0, nonce: String::new() };
        // 1. The challenge.
        let first = conn.next_until(deadline, "challenge").await?;
        match first.frame {
            Ok(Frame::Event(ev)) => match ev.event {
                GatewayEvent::ConnectChallenge(c) => conn.nonce = c.nonce,
                _ => return Err(WsError::Handshake("the first frame was not connect.challenge".to_owned())),
            },
            _ => return Err(WsError::Handshake("the first frame was not connect.challenge".to_owned())),
        }
        // 2. connect → hello-ok.
        let id = conn.send("connect", params).await?;
        loop {
            let r = conn.next_until(deadline, "hello-ok").await?;
            if let Ok(Frame::Res(res)) = r.frame {
                if res.id != id {
                    continue;
                }
                if !res.ok {
                    let msg = res.error.map(|e| format!("{}: {}", e.code, e.message)).unwrap_or_default();
                    return Err(WsError::Handshake(msg));
                }
                let payload = res.payload.map(|p| p.get().to_owned()).unwrap_or_default();
                conn.hello = serde_json::from_str(&payload).map_err(|e| WsError::Handshake(format!("bad hello-ok: {e}")))?;
                return Ok(conn);
            }
        }
    }

    /// Sends a request; returns its id.
    pub async fn send<P: serde::Serialize>(&mut self, method: &str, params: &P) -> Result<String, WsError> {
        self.next_id += 1;
        let id = self.next_id.to_string();
        let text = encode_request(&id, method, params, None).map_err(|e| WsError::Encode(e.to_string()))?;
        self.ws.send(Message::text(text)).await.map_err(|e| WsError::Closed(e.to_string()))?;
        Ok(id)
    }

    /// The next text frame, waiting at most until `deadline`.
    pub async fn next_until(&mut self, deadline: Instant, waiting_for: &'static str) -> Result<Received, WsError> {
        loop {
            let msg = tokio::time::timeout_at(deadline, self.ws.next()).await.map_err(|_| WsError::Timeout(waiting_for))?;
            let text = match msg {
                Some(Ok(Message::Text(t))) => t.as_str().to_owned(),
                Some(Ok(Message::Binary(b))) => String::from_utf8_lossy(&b).into_owned(),
                Some(Ok(Message::Close(f))) => {
                    return Err(WsError::Closed(f.map(|f| format!("{} {}", u16::from(f.code), f.reason)).unwrap_or_else(|| "close".to_owned())))
                }
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(WsError::Closed(e.to_string())),
                None => return Err(WsError::Closed("end of stream".to_owned())),
            };
            self.frames += 1;
            self.bytes += text.len() as u64;
            let frame = decode_frame(&text, MAX_FRAME).map_err(|e| e.to_string());
            return Ok(Received { text, frame });
        }
    }

    /// Waits for the `res` of request `id` (frames in between are counted and handed to `other`).
    pub async fn response(
        &mut self,
        id: &str,
        deadline: Instant,
        mut other: impl FnMut(&Received),
    ) -> Result<ResponseFrame, WsError> {
        loop {
            let r = self.next_until(deadline, "response").await?;
            match r.frame {
                Ok(Frame::Res(res)) if res.id == id => return Ok(res),
                _ => other(&r),
            }
        }
    }

    /// True when `text` contains this connection's challenge nonce.
    pub fn leaks_nonce(&self, text: &str) -> bool {
        !self.nonce.is_empty() && text.contains(&self.nonce)
    }

    /// Closes politely, bounded: the per-call design closes every socket after its call.
    pub async fn close(mut self) {
        let _ = tokio::time::timeout(Duration::from_millis(500), self.ws.close(None)).await;
    }
}

fn placeholder_hello() -> HelloOk {
    HelloOk {
        kind: String::new(),
        protocol: 0,
        server: Default::default(),
        features: Default::default(),
        auth: None,
        policy: clawmux_protocol::Policy { max_payload: MAX_FRAME as u64, max_buffered_bytes: 0, tick_interval_ms: 30_000 },
        snapshot: None,
    }
}
