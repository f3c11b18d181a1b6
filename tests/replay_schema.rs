//! Every frame the replay gateway sends, checked against OpenClaw's own `protocol.schema.json`
//! (`@openclaw/gateway-protocol`; see `protocol/tests/schema_check`): hello-ok, every answer of the
//! methods it implements (results and refusals), the events of runs (with and without cap
//! `tool-events`), aborts, ticks and the shutdown notice. A frame that fails is allowed only as a
//! departure the REAL gateway shows too (`tests/support/schema-departures.json`, where the live
//! conformance test holds the real gateway to that list). Needs the package and Node 24:
//! `tests/run.sh` installs them and sets `CLAWMUX_REQUIRE_GATEWAY_PROTOCOL=1`.

#[path = "../protocol/tests/schema_check/mod.rs"]
mod schema_check;

use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

const TOKEN: &str = "replay-schema-token";

/// A raw client that keeps every frame it received, with the method each `res` answers.
struct Client {
    ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
    methods: HashMap<String, String>,
    frames: Vec<(Value, Option<String>)>,
    next_id: u32,
}

impl Client {
    async fn connect(url: &str, caps: &[&str]) -> Self {
        let (ws, _) = tokio_tungstenite::connect_async(url).await.expect("ws connect");
        let mut c = Self { ws, methods: HashMap::new(), frames: Vec::new(), next_id: 0 };
        c.until(|f| f["event"] == "connect.challenge").await;
        let hello = c
            .call(
                "connect",
                json!({"minProtocol": 4, "maxProtocol": 4,
                       "client": {"id": "gateway-client", "version": "schema-test", "platform": "linux", "mode": "backend"},
                       "role": "operator", "scopes": ["operator.read", "operator.write", "operator.admin"],
                       "caps": caps, "auth": {"token": TOKEN}}),
            )
            .await;
        assert_eq!(hello["ok"], true, "{hello}");
        c
    }

    async fn send(&mut self, method: &str, params: Value) -> String {
        self.next_id += 1;
        let id = format!("s-{}", self.next_id);
        self.methods.insert(id.clone(), method.to_owned());
        let frame = json!({"type": "req", "id": id, "method": method, "params": params});
        self.ws.send(Message::text(frame.to_string())).await.expect("send");
        id
    }

    /// Sends a request and returns its (first) answer.
    async fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.send(method, params).await;
        self.until(|f| f["type"] == "res" && f["id"] == id.as_str()).await
    }

    /// Reads until a frame matches (bounded: 20 s), keeping every frame.
    async fn until(&mut self, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let msg = tokio::time::timeout_at(deadline, self.ws.next()).await.expect("a frame within 20 s");
            let Some(Ok(Message::Text(text))) = msg else { panic!("socket ended: {msg:?}") };
            let frame: Value = serde_json::from_str(&text).expect("JSON frame");
            let answers = (frame["type"] == "res").then(|| frame["id"].as_str().and_then(|id| self.methods.get(id).cloned())).flatten();
            self.frames.push((frame.clone(), answers));
            if pred(&frame) {
                return frame;
            }
        }
    }
}

fn agent(message: &str, key: &str, run: &str) -> Value {
    json!({"message": message, "agentId": "main", "sessionKey": key, "idempotencyKey": run})
}

#[tokio::test]
async fn official_schema_every_frame_the_replay_gateway_sends() {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let Some(checker) = schema_check::Checker::from_env(repo.clone()) else { return };
    let cassette = Cassette::from_path(repo.join("tests/cassettes/openclaw-2026.9.6-conformance.jsonl")).expect("cassette");
    let cfg = ReplayConfig::new(cassette).token(TOKEN).speed(20.0).tick_interval_ms(50);
    let gw = ReplayGateway::start("127.0.0.1:0".parse().expect("addr"), cfg).expect("replay gateway");

    let mut a = Client::connect(&gw.url(), &["session-scoped-events", "tool-events"]).await;
    let mut b = Client::connect(&gw.url(), &[]).await;
    let key = "agent:main:schema:a";
    a.call("health", json!({})).await;
    a.call("sessions.patch", json!({"key": key, "model": "cogni/fake-model"})).await;
    a.call("sessions.patch", json!({"key": key, "label": "schema", "model": null})).await;
    a.call("sessions.messages.subscribe", json!({"key": key, "includeApprovals": true})).await;
    // A run with a tool call (its `tool` events go to `a` only), then one aborted mid-stream.
    a.send("agent", agent("TOOL:x schema [track:tool]", key, "schema-tool")).await;
    a.until(|f| f["type"] == "res" && f["payload"]["runId"] == "schema-tool" && f["payload"]["status"] == "ok").await;
    a.send("agent", agent("SLOW schema [track:slow]", key, "schema-slow")).await;
    a.until(|f| f["event"] == "chat" && f["payload"]["state"] == "delta").await;
    a.call("agent", agent("SLOW schema [track:slow]", key, "schema-slow")).await;
    a.call("chat.abort", json!({"sessionKey": key, "runId": "schema-slow"})).await;
    a.until(|f| f["type"] == "res" && f["payload"]["runId"] == "schema-slow" && f["payload"]["status"] == "timeout").await;
    a.call("agent.wait", json!({"runId": "schema-slow", "timeoutMs": 100})).await;
    a.call("agent.wait", json!({"runId": "schema-tool", "timeoutMs": 100})).await;
    a.call("agent.wait", json!({"runId": "unknown", "timeoutMs": 10})).await;
    a.call("chat.history", json!({"sessionKey": key})).await;
    a.call("sessions.abort", json!({"key": key})).await;
    a.call("sessions.messages.unsubscribe", json!({"key": key})).await;
    // Refusals.
    a.call("agent", json!({"message": "", "idempotencyKey": "x"})).await;
    a.call("nope.method", json!({})).await;
    a.call("connect", json!({})).await;
    a.ws.send(Message::text(r#"{"type":"req","method":"health"}"#)).await.expect("send");
    a.until(|f| f["type"] == "res" && f["id"] == "invalid").await;
    // Ticks, then the shutdown notice.
    a.until(|f| f["event"] == "tick").await;
    b.until(|f| f["event"] == "tick").await;
    // Without a restart hint: the field is left out, not null (the schema wants an integer).
    gw.send_shutdown(None);
    a.until(|f| f["event"] == "shutdown").await;
    b.until(|f| f["event"] == "shutdown").await;

    let frames: Vec<(Value, Option<&str>)> = a.frames.iter().chain(&b.frames).map(|(f, m)| (f.clone(), m.as_deref())).collect();
    let outcomes = checker.check_server(&frames);
    let (seen, unlisted) = schema_check::summarize(&outcomes);
    assert!(unlisted.is_empty(), "the replay gateway sends frames its schema refuses:\n{}", unlisted.join("\n"));
    // What was checked: hello-ok, chat and agent events (tool events included), ticks, shutdown.
    let checked = |def: &str| outcomes.iter().filter(|o| o["checked"].as_array().is_some_and(|c| c.iter().any(|d| d == def))).count();
    for def in ["HelloOk", "ChatDeltaEvent", "ChatFinalEvent", "ChatAbortedEvent", "AgentEvent", "TickEvent", "ShutdownEvent", "ResponseFrame"] {
        assert!(checked(def) > 0, "no frame checked against {def}");
    }
    assert!(seen.contains_key("agent-event-tool-session-row"), "the tool events reached `a`: {seen:?}");
    let listed = checker.departures();
    assert!(seen.keys().all(|id| listed.contains_key(id)), "{seen:?}");
    gw.stop().await;
}
