//! A loopback gateway for driving the real supervisor actor: it completes the handshake, then
//! sends the frames a test queues, in order, across connections (after a frame the supervisor
//! takes as `shutdown` it closes the socket and goes on with the next connection, as a restarting
//! gateway does); it records the requests it receives. And probes that stand in for session
//! actors and callers, recording what the supervisor delivers to them.

use actix::prelude::*;
use clawmux_actors::messages::{CallError, Reply, Routed};
use clawmux_protocol::{decode_frame, Frame, GatewayEvent};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

/// `policy.maxPayload` the loopback gateway advertises (the real gateway's).
pub const MAX_PAYLOAD: u64 = 26_214_400;

/// Generous bound for things that take milliseconds.
pub const WAIT: Duration = Duration::from_secs(10);

/// A running loopback gateway (its task ends with the actix system it was started in).
pub struct Loopback {
    /// `ws://127.0.0.1:PORT`.
    pub url: String,
    /// Frames to send, in order.
    frames: mpsc::UnboundedSender<String>,
    /// `(method, id)` of every request received, all connections.
    requests: Arc<Mutex<Vec<(String, String)>>>,
    /// Handshakes completed.
    connections: Arc<AtomicUsize>,
}

impl Loopback {
    /// Binds 127.0.0.1:0 and serves one connection at a time.
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
        let url = format!("ws://{}", listener.local_addr().expect("addr"));
        let (tx, rx) = mpsc::unbounded_channel();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let connections = Arc::new(AtomicUsize::new(0));
        actix_rt::spawn(serve(listener, rx, Arc::clone(&requests), Arc::clone(&connections)));
        Self { url, frames: tx, requests, connections }
    }

    /// Queues a frame.
    pub fn send(&self, frame: String) {
        self.frames.send(frame).expect("the loopback gateway runs");
    }

    /// Requests received so far.
    pub fn requests(&self) -> Vec<(String, String)> {
        self.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Handshakes completed so far.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    /// Waits (bounded) until `n` requests arrived.
    pub async fn wait_requests(&self, n: usize) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while self.requests().len() < n {
            assert!(tokio::time::Instant::now() < deadline, "{} of {n} requests within {WAIT:?}", self.requests().len());
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

/// True when the supervisor will take `frame` as the gateway's `shutdown` (same decoder, same
/// limit): it then drops the connection, and later frames go to the next one.
pub fn is_shutdown(frame: &str) -> bool {
    let max = clawmux_actors::limits::max_payload(MAX_PAYLOAD);
    matches!(decode_frame(frame, max), Ok(Frame::Event(ev)) if matches!(ev.event, GatewayEvent::Shutdown(_)))
}

async fn serve(
    listener: TcpListener,
    mut frames: mpsc::UnboundedReceiver<String>,
    requests: Arc<Mutex<Vec<(String, String)>>>,
    connections: Arc<AtomicUsize>,
) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else { continue };
        let Ok(mut ws) = tokio_tungstenite::accept_async(tcp).await else { continue };
        let challenge = json!({"type": "event", "event": "connect.challenge", "payload": {"nonce": "loopback", "ts": 1}});
        if ws.send(Message::text(challenge.to_string())).await.is_err() {
            continue;
        }
        // The handshake: answer `connect` with a protocol-4 hello-ok that grants the scopes.
        let mut handshaken = false;
        while let Some(Ok(msg)) = ws.next().await {
            let Message::Text(text) = msg else { continue };
            let Ok(req) = serde_json::from_str::<Value>(text.as_str()) else { break };
            if req["method"] == "connect" {
                let hello = json!({"type": "res", "id": req["id"], "ok": true, "payload": {
                    "type": "hello-ok", "protocol": 4, "server": {"version": "loopback", "bootId": "loopback-boot"},
                    "features": {"methods": ["agent", "agent.wait", "chat.abort", "health"], "events": ["chat", "agent", "tick"]},
                    "auth": {"scopes": ["operator.read", "operator.write"]},
                    "policy": {"maxPayload": MAX_PAYLOAD, "maxBufferedBytes": 52_428_800u64, "tickIntervalMs": 30_000},
                }});
                handshaken = ws.send(Message::text(hello.to_string())).await.is_ok();
                break;
            }
        }
        if !handshaken {
            continue;
        }
        connections.fetch_add(1, Ordering::SeqCst);
        loop {
            tokio::select! {
                frame = frames.recv() => {
                    let Some(frame) = frame else { return };
                    let shutdown = is_shutdown(&frame);
                    if ws.send(Message::text(frame)).await.is_err() || shutdown {
                        let _ = ws.close(None).await;
                        break;
                    }
                }
                msg = ws.next() => match msg {
                    Some(Ok(Message::Text(text))) => {
                        if let Ok(req) = serde_json::from_str::<Value>(text.as_str()) {
                            let field = |k: &str| req[k].as_str().unwrap_or_default().to_owned();
                            if let Ok(mut r) = requests.lock() {
                                r.push((field("method"), field("id")));
                            }
                        }
                    }
                    Some(Ok(_)) => {}
                    Some(Err(_)) | None => break,
                },
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Probes
// ------------------------------------------------------------------------------------------------

/// What a run probe saw of one routed event: its session key, run id and chat text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeenEvent {
    /// `sessionKey` as the frame carried it.
    pub session_key: Option<String>,
    /// `runId` as the frame carried it.
    pub run_id: Option<String>,
    /// The cumulative text of a chat event.
    pub text: Option<String>,
}

/// Stands in for a session actor: records every event routed to it.
#[derive(Default)]
pub struct RunProbe {
    /// Every event routed here, in order: the test compares them with what the frames addressed.
    seen: Vec<SeenEvent>,
}

impl Actor for RunProbe {
    type Context = Context<Self>;
}

impl Handler<Routed> for RunProbe {
    type Result = ();
    fn handle(&mut self, msg: Routed, _ctx: &mut Context<Self>) {
        let (session_key, run_id) = msg.0.route_key().unwrap_or((None, None));
        let text = match &msg.0 {
            GatewayEvent::Chat(c) => c.text().map(str::to_owned),
            _ => None,
        };
        self.seen.push(SeenEvent { session_key: session_key.map(str::to_owned), run_id: run_id.map(str::to_owned), text });
    }
}

/// Asks a probe what it saw (answered after everything delivered to it before).
#[derive(Message)]
#[rtype(result = "Vec<SeenEvent>")]
pub struct SeenEvents;

impl Handler<SeenEvents> for RunProbe {
    type Result = MessageResult<SeenEvents>;
    fn handle(&mut self, _msg: SeenEvents, _ctx: &mut Context<Self>) -> Self::Result {
        MessageResult(self.seen.clone())
    }
}

/// One answer as a caller sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Got {
    /// `ok` with this payload (raw JSON text).
    Ok(String),
    /// The gateway's error, by code.
    Gateway(String),
    /// `ok` without a payload.
    Malformed,
    /// The connection dropped before the answer.
    Disconnected,
    /// Anything else (not expected here: no call times out, none is made while disconnected).
    Other(String),
}

/// Stands in for a caller of the supervisor: records every reply, with its tag.
#[derive(Default)]
pub struct CallProbe {
    /// Every reply with its tag, in order: a reply meant for another call would show here.
    got: Vec<(u64, Got)>,
}

impl Actor for CallProbe {
    type Context = Context<Self>;
}

impl Handler<Reply> for CallProbe {
    type Result = ();
    fn handle(&mut self, msg: Reply, _ctx: &mut Context<Self>) {
        let got = match msg.result {
            Ok(raw) => Got::Ok(raw.get().to_owned()),
            Err(CallError::Gateway(e)) => Got::Gateway(e.code),
            Err(CallError::Malformed(_)) => Got::Malformed,
            Err(CallError::Disconnected) => Got::Disconnected,
            Err(e) => Got::Other(format!("{e:?}")),
        };
        self.got.push((msg.tag, got));
    }
}

/// Asks a call probe for its replies.
#[derive(Message)]
#[rtype(result = "Vec<(u64, Got)>")]
pub struct Replies;

impl Handler<Replies> for CallProbe {
    type Result = MessageResult<Replies>;
    fn handle(&mut self, _msg: Replies, _ctx: &mut Context<Self>) -> Self::Result {
        MessageResult(self.got.clone())
    }
}

/// Stops the actor it is sent to (a caller going away).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Leave;

impl Handler<Leave> for CallProbe {
    type Result = ();
    fn handle(&mut self, _msg: Leave, ctx: &mut Context<Self>) {
        ctx.stop();
    }
}
