//! The replay gateway, driven over real WebSockets the way a client of the real gateway sees it.
//! Every expectation here is an observed behaviour of `openclaw@2026.9.6` (or `2026.4.12` for the
//! protocol-3 tests): see `/work/shared/peer/REPORT.md` and `REPORT-v3.md`.
//!
//! Tests run at `speed 0` (no recorded delays) or on a stretched timeline, with short ticks, and
//! every wait is bounded.

#![allow(clippy::unwrap_used)]

use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway, ReplayHandle, RunStatus, StepKind};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

const WAIT: Duration = Duration::from_secs(5);
const TOKEN: &str = "test-token-123";
const ALL_SCOPES: [&str; 3] = ["operator.read", "operator.write", "operator.admin"];

// ---------------------------------------------------------------- client -----------------------

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// A minimal gateway client that keeps every frame it receives (events that arrive while it waits
/// for a `res` stay in `backlog`), and counts frames and bytes for the stats checks.
struct Client {
    ws: Ws,
    backlog: VecDeque<Value>,
    next_id: u64,
    frames: u64,
    bytes: u64,
    closed: Option<(u16, String)>,
}

enum Read {
    Frame(Value),
    Closed(u16, String),
    Reset,
}

impl Client {
    async fn open(url: &str) -> (Client, Value) {
        let (ws, _) = tokio::time::timeout(WAIT, tokio_tungstenite::connect_async(url)).await.unwrap().unwrap();
        let mut c = Client { ws, backlog: VecDeque::new(), next_id: 0, frames: 0, bytes: 0, closed: None };
        let challenge = c.next().await.expect("challenge");
        assert_eq!(challenge["event"], "connect.challenge");
        (c, challenge)
    }

    async fn read(&mut self) -> Read {
        loop {
            match tokio::time::timeout(WAIT, self.ws.next()).await.expect("frame within 5 s") {
                Some(Ok(Message::Text(t))) => {
                    self.frames += 1;
                    self.bytes += t.len() as u64;
                    return Read::Frame(serde_json::from_str(t.as_str()).unwrap());
                }
                Some(Ok(Message::Close(frame))) => {
                    let (code, reason) = frame.map(|f| (u16::from(f.code), f.reason.as_str().to_owned())).unwrap_or((1005, String::new()));
                    self.closed = Some((code, reason.clone()));
                    return Read::Closed(code, reason);
                }
                Some(Ok(_)) => {}
                Some(Err(_)) | None => return Read::Reset,
            }
        }
    }

    /// The next frame (from the backlog first); `None` once closed.
    async fn next(&mut self) -> Option<Value> {
        if let Some(f) = self.backlog.pop_front() {
            return Some(f);
        }
        match self.read().await {
            Read::Frame(f) => Some(f),
            _ => None,
        }
    }

    /// Nothing arrives for `d` (events that would arrive are kept).
    async fn quiet_for(&mut self, d: Duration) -> Vec<Value> {
        let mut got = Vec::new();
        let deadline = tokio::time::Instant::now() + d;
        while let Ok(Some(Ok(Message::Text(t)))) = tokio::time::timeout_at(deadline, self.ws.next()).await {
            self.frames += 1;
            self.bytes += t.len() as u64;
            got.push(serde_json::from_str(t.as_str()).unwrap());
        }
        got
    }

    async fn send(&mut self, frame: Value) {
        self.ws.send(Message::text(frame.to_string())).await.unwrap();
    }

    async fn req_with(&mut self, method: &str, params: Value, traceparent: Option<&str>) -> String {
        self.next_id += 1;
        let id = format!("r{}", self.next_id);
        let mut frame = json!({"type": "req", "id": id, "method": method, "params": params});
        if let Some(t) = traceparent {
            frame["traceparent"] = json!(t);
        }
        self.send(frame).await;
        id
    }

    async fn req(&mut self, method: &str, params: Value) -> String {
        self.req_with(method, params, None).await
    }

    /// Waits for the next `res` with this id; other frames go to the backlog.
    async fn res(&mut self, id: &str) -> Value {
        if let Some(pos) = self.backlog.iter().position(|f| f["type"] == "res" && f["id"] == id) {
            return self.backlog.remove(pos).unwrap();
        }
        loop {
            match self.read().await {
                Read::Frame(f) if f["type"] == "res" && f["id"] == id => return f,
                Read::Frame(f) => self.backlog.push_back(f),
                Read::Closed(code, reason) => panic!("closed {code} {reason} while waiting for res {id}"),
                Read::Reset => panic!("reset while waiting for res {id}"),
            }
        }
    }

    async fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.req(method, params).await;
        self.res(&id).await
    }

    /// Every frame up to and including the first one matching `pred` (backlog first).
    async fn until(&mut self, pred: impl Fn(&Value) -> bool) -> Vec<Value> {
        let mut got = Vec::new();
        loop {
            let f = self.next().await.expect("connection open");
            let hit = pred(&f);
            got.push(f);
            if hit {
                return got;
            }
        }
    }

    /// Reads until the server closes; returns the close code and reason.
    async fn close_code(&mut self) -> (u16, String) {
        if let Some(c) = self.closed.clone() {
            return c;
        }
        loop {
            match self.read().await {
                Read::Frame(f) => self.backlog.push_back(f),
                Read::Closed(code, reason) => return (code, reason),
                Read::Reset => return (1006, String::new()),
            }
        }
    }
}

fn connect_params(scopes: &[&str], caps: &[&str], token: Option<&str>) -> Value {
    let mut p = json!({
        "minProtocol": 3, "maxProtocol": 4,
        "client": {"id": "gateway-client", "version": "1.0.0", "platform": "linux", "mode": "backend"},
        "role": "operator", "scopes": scopes, "caps": caps,
    });
    if let Some(t) = token {
        p["auth"] = json!({"token": t});
    }
    p
}

/// Opens a socket and sends `connect`; returns the client and the connect `res`.
async fn connect_raw(gw: &ReplayHandle, params: Value) -> (Client, Value) {
    let (mut c, _) = Client::open(&gw.url()).await;
    let id = c.req("connect", params).await;
    let res = c.res(&id).await;
    (c, res)
}

/// A handshaken client; panics if the gateway refuses.
async fn connect(gw: &ReplayHandle, scopes: &[&str], caps: &[&str]) -> (Client, Value) {
    let (c, res) = connect_raw(gw, connect_params(scopes, caps, Some(TOKEN))).await;
    assert_eq!(res["ok"], true, "{res}");
    (c, res["payload"].clone())
}

fn start(cfg: ReplayConfig) -> ReplayHandle {
    ReplayGateway::start("127.0.0.1:0".parse().unwrap(), cfg.token(TOKEN)).unwrap()
}

fn fast() -> ReplayConfig {
    ReplayConfig::default().speed(0.0)
}

fn agent_params(message: &str, session: &str, run_id: &str) -> Value {
    json!({"message": message, "agentId": "main", "sessionKey": session, "idempotencyKey": run_id})
}

fn is_final_res(id: &str) -> impl Fn(&Value) -> bool + '_ {
    move |f| f["type"] == "res" && f["id"] == id && f["payload"]["status"] != "accepted"
}

fn run_events<'a>(frames: &'a [Value], run_id: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    frames
        .iter()
        .filter(move |f| f["type"] == "event" && (f["event"] == "chat" || f["event"] == "agent") && f["payload"]["runId"] == run_id)
}

// ---------------------------------------------------------------- handshake -------------------

#[tokio::test]
async fn handshake_refusals_match_the_gateway() {
    let gw = start(fast());

    // Unknown client id: closed schema, close 1008 with the message as reason.
    let mut p = connect_params(&ALL_SCOPES, &[], Some(TOKEN));
    p["client"]["id"] = json!("cogni-rust");
    let (mut c, res) = connect_raw(&gw, p).await;
    assert_eq!(res["ok"], false);
    assert_eq!(res["error"]["code"], "INVALID_REQUEST");
    assert_eq!(res["error"]["message"], "invalid connect params: at /client/id: must be equal to one of the allowed values");
    assert_eq!(
        c.close_code().await,
        (1008, "invalid connect params: at /client/id: must be equal to one of the allowed values".to_owned())
    );

    // Unknown property anywhere in connect.
    let mut p = connect_params(&ALL_SCOPES, &[], Some(TOKEN));
    p["outboundHeaders"] = json!({});
    let (mut c, res) = connect_raw(&gw, p).await;
    assert_eq!(res["error"]["message"], "invalid connect params: at root: unexpected property 'outboundHeaders'");
    assert_eq!(c.close_code().await.0, 1008);

    // A protocol range without 4.
    let mut p = connect_params(&ALL_SCOPES, &[], Some(TOKEN));
    p["minProtocol"] = json!(3);
    p["maxProtocol"] = json!(3);
    let (mut c, res) = connect_raw(&gw, p).await;
    assert_eq!(res["error"]["code"], "INVALID_REQUEST");
    assert_eq!(res["error"]["message"], "protocol mismatch");
    assert_eq!(
        res["error"]["details"],
        json!({"code":"PROTOCOL_MISMATCH","clientMinProtocol":3,"clientMaxProtocol":3,"expectedProtocol":4,"minimumProbeProtocol":3})
    );
    assert_eq!(c.close_code().await, (1002, "protocol mismatch".to_owned()));

    // Wrong token; no token (nor a device identity): the gateway wants a device to pair.
    let (mut c, res) = connect_raw(&gw, connect_params(&ALL_SCOPES, &[], Some("nope"))).await;
    assert_eq!(res["error"]["code"], "INVALID_REQUEST");
    assert_eq!(res["error"]["message"], "unauthorized: gateway token mismatch (provide gateway auth token)");
    assert_eq!(res["error"]["details"]["code"], "AUTH_TOKEN_MISMATCH");
    assert_eq!(c.close_code().await.0, 1008);
    let (mut c, res) = connect_raw(&gw, connect_params(&ALL_SCOPES, &[], None)).await;
    assert_eq!(res["error"], json!({"code": "NOT_PAIRED", "message": "device identity required", "details": {"code": "DEVICE_IDENTITY_REQUIRED"}}));
    assert_eq!(c.close_code().await, (1008, "device identity required".to_owned()));

    // First request not `connect`.
    let (mut c, _) = Client::open(&gw.url()).await;
    let id = c.req("health", json!({})).await;
    let res = c.res(&id).await;
    assert_eq!(res["error"]["message"], "invalid handshake: first request must be connect");
    assert_eq!(c.close_code().await.0, 1008);

    // Gateway still starting: the next connect is refused, retryable; the one after works.
    gw.set_unavailable_connects(1);
    let (mut c, res) = connect_raw(&gw, connect_params(&ALL_SCOPES, &[], Some(TOKEN))).await;
    assert_eq!(
        res["error"],
        json!({"code":"UNAVAILABLE","message":"gateway starting; retry shortly","retryable":true,"retryAfterMs":500,"details":{"reason":"startup-sidecars"}})
    );
    assert_eq!(c.close_code().await, (1013, "gateway starting".to_owned()));
    let (_c, hello) = connect(&gw, &ALL_SCOPES, &[]).await;
    assert_eq!(hello["type"], "hello-ok");

    let stats = gw.stats();
    assert_eq!(stats.handshakes_failed, 7);
    assert_eq!(stats.handshakes_ok, 1);
    assert_eq!(stats.connections_opened, 8);
}

#[tokio::test]
async fn hello_ok_says_what_the_gateway_offers() {
    let gw = start(fast().tick_interval_ms(1234));
    let (mut c, challenge) = Client::open(&gw.url()).await;
    let cp = &challenge["payload"];
    assert!(cp["nonce"].as_str().is_some_and(|n| n.len() >= 32));
    assert!(cp["ts"].as_i64().is_some());
    assert_eq!(cp["capabilities"], json!(["model-catalog-snapshot"]));
    assert!(challenge.get("seq").is_none());

    let id = c.req("connect", connect_params(&["operator.read", "operator.write", "operator.pairing"], &[], Some(TOKEN))).await;
    let res = c.res(&id).await;
    let hello = &res["payload"];
    assert_eq!(hello["type"], "hello-ok");
    assert_eq!(hello["protocol"], 4);
    assert_eq!(hello["server"]["version"], "replay-openclaw@2026.9.6");
    assert!(hello["server"]["connId"].as_str().is_some_and(|s| !s.is_empty()));
    let methods: Vec<&str> = hello["features"]["methods"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    for m in [
        "health",
        "sessions.patch",
        "sessions.messages.subscribe",
        "sessions.messages.unsubscribe",
        "agent",
        "agent.wait",
        "chat.abort",
        "sessions.abort",
        "chat.history",
    ] {
        assert!(methods.contains(&m), "{m}");
    }
    let events = hello["features"]["events"].as_array().unwrap();
    for e in ["connect.challenge", "chat", "agent", "tick", "shutdown"] {
        assert!(events.contains(&json!(e)), "{e}");
    }
    // The snapshot has the process uptime (protocol 3 clients tell a restart by it) and every key
    // 2026.9.6 sends (tests/conformance.rs checks the rest against the official schema).
    assert!(hello["snapshot"]["uptimeMs"].is_u64(), "{}", hello["snapshot"]);
    let mut keys: Vec<&str> = hello["snapshot"].as_object().unwrap().keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        ["appliedConfigHash", "authMode", "configPath", "health", "presence", "sessionDefaults", "stateDir", "stateVersion", "suspension", "updateSchedule", "uptimeMs"]
    );
    assert_eq!((&hello["auth"]["role"], &hello["auth"]["scopes"]), (&json!("operator"), &json!(["operator.read", "operator.write"])));
    assert_eq!(
        hello["policy"],
        json!({"maxPayload":26214400,"maxBufferedBytes":52428800,"tickIntervalMs":1234,
               "attachments":{"maxBytes":19464192,"maxImageBytes":6291456},"allowedSessionVisibilities":["shared","read-only","suggest","draft"],
               "hasMultipleSessionSharingIdentities":false})
    );

    // Without scopes: hello-ok with none, and writes fail as on 2026.9.6.
    let (mut z, hello) = connect(&gw, &[], &[]).await;
    assert_eq!(hello["auth"]["scopes"], json!([]));
    let res = z.call("sessions.patch", json!({"key":"agent:main:a:b","model":"cogni/fake-model"})).await;
    assert_eq!(res["error"]["code"], "FORBIDDEN");
    assert_eq!(res["error"]["message"], "missing scope: operator.write");
    assert_eq!(res["error"]["details"]["code"], "MISSING_SCOPE");
    assert_eq!(z.call("health", json!({})).await["payload"]["ok"], true);
    let res = z.call("sessions.list", json!({})).await;
    assert_eq!(res["error"]["message"], "unknown method: sessions.list");
}

// ---------------------------------------------------------------- delivery --------------------

#[tokio::test]
async fn events_are_broadcast_to_every_reader_without_the_cap() {
    let gw = start(fast());
    let (mut a, _) = connect(&gw, &ALL_SCOPES, &[]).await;
    let (mut b, _) = connect(&gw, &ALL_SCOPES, &[]).await;
    let (mut r, _) = connect(&gw, &["operator.read"], &[]).await;
    let (mut z, _) = connect(&gw, &[], &[]).await;

    let id = a.req("agent", agent_params("from A", "agent:main:acct1:one", "run-one")).await;
    let on_a = a.until(is_final_res(&id)).await;
    let chat_a = run_events(&on_a, "run-one").filter(|f| f["event"] == "chat").count();
    let agent_a = run_events(&on_a, "run-one").filter(|f| f["event"] == "agent").count();
    assert!(chat_a >= 2 && agent_a >= 2, "{chat_a} {agent_a}");

    // B (another writer) and R (read only) see the same run's events, though they did not start it.
    for other in [&mut b, &mut r] {
        let got = other.until(|f| f["event"] == "chat" && f["payload"]["state"] == "final").await;
        let agent_events = got.iter().filter(|f| f["event"] == "agent").count();
        assert!(got.iter().all(|f| f["type"] == "event"));
        assert_eq!(got.iter().filter(|f| f["event"] == "chat").count(), chat_a);
        assert_eq!(agent_events, agent_a);
    }
    // Z (no scopes) receives nothing.
    assert!(z.quiet_for(Duration::from_millis(300)).await.is_empty());
}

#[tokio::test]
async fn session_scoped_events_reach_only_subscribers() {
    let gw = start(fast());
    let (mut s, _) = connect(&gw, &ALL_SCOPES, &["session-scoped-events"]).await;
    let (mut a, _) = connect(&gw, &ALL_SCOPES, &[]).await;
    let sub = s.call("sessions.messages.subscribe", json!({"key": "Acct1:Two"})).await;
    assert_eq!(sub["payload"], json!({"subscribed": true, "key": "agent:main:acct1:two"}));

    // A runs on two sessions: S sees only the subscribed one.
    let one = a.req("agent", agent_params("one", "agent:main:acct1:one", "r-one")).await;
    a.until(is_final_res(&one)).await;
    let two = a.req("agent", agent_params("two", "agent:main:acct1:two", "r-two")).await;
    a.until(is_final_res(&two)).await;
    let got = s.until(|f| f["event"] == "chat" && f["payload"]["state"] == "final").await;
    assert!(got.iter().all(|f| f["payload"]["runId"] == "r-two"), "{got:?}");

    // S's own run on an unsubscribed session: no events, but its res frames arrive.
    let own = s.req("agent", agent_params("mine", "agent:main:acct1:three", "r-three")).await;
    let frames = s.until(is_final_res(&own)).await;
    assert!(frames.iter().all(|f| f["type"] == "res"), "{frames:?}");
    assert_eq!(frames.len(), 2);

    // After unsubscribing, nothing of that session arrives any more.
    let unsub = s.call("sessions.messages.unsubscribe", json!({"key": "agent:main:acct1:two"})).await;
    assert_eq!(unsub["payload"], json!({"subscribed": false, "key": "agent:main:acct1:two"}));
    let again = a.req("agent", agent_params("two again", "agent:main:acct1:two", "r-two-b")).await;
    a.until(is_final_res(&again)).await;
    assert!(s.quiet_for(Duration::from_millis(300)).await.is_empty());
}

// ---------------------------------------------------------------- runs ------------------------

#[tokio::test]
async fn agent_answers_twice_with_the_new_ids_and_the_callers_echo() {
    let gw = start(fast());
    let (mut a, _) = connect(&gw, &ALL_SCOPES, &[]).await;
    let patch = a.call("sessions.patch", json!({"key": "Acct9:RunA", "model": "cogni/fake-model-b"})).await;
    let p = &patch["payload"];
    assert_eq!(p["ok"], true);
    assert_eq!(p["key"], "agent:main:acct9:runa");
    assert_eq!(p["entry"]["modelOverride"], "fake-model-b");
    assert_eq!(p["entry"]["providerOverride"], "cogni");
    assert_eq!(
        p["resolved"],
        json!({"modelProvider": "cogni", "model": "fake-model-b", "agentRuntime": {"id": "openclaw", "source": "implicit"},
               "runtimeSelectionLocked": false, "thinkingLevel": "off", "thinkingLevels": [{"id": "off", "label": "off"}]})
    );

    let trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let msg = "isolation-check-42 [track:short]\nsecond line is not echoed";
    let id = a.req_with("agent", agent_params(msg, "Acct9:RunA", "run-a-1"), Some(trace)).await;
    let frames = a.until(is_final_res(&id)).await;

    let ack = frames.iter().find(|f| f["type"] == "res" && f["id"] == id.as_str()).unwrap();
    assert_eq!(ack["payload"]["status"], "accepted");
    assert_eq!(ack["payload"]["runId"], "run-a-1");
    assert_eq!(ack["payload"]["sessionKey"], "agent:main:acct9:runa");
    assert_eq!(ack["payload"]["agentId"], "main");
    let fin = frames.last().unwrap();
    assert_eq!(fin["payload"]["runId"], "run-a-1");
    assert_eq!(fin["payload"]["status"], "ok");
    let echo = "isolation-check-42 [track:short] | ";
    assert_eq!(fin["payload"]["result"]["payloads"][0]["text"], format!("{echo}Hello from the fake LLM (req 8)."));
    // The ACK comes before every event, and the final `res` after all of them.
    assert_eq!(frames.iter().position(|f| f["type"] == "res"), Some(0));

    let events: Vec<&Value> = run_events(&frames, "run-a-1").collect();
    assert!(events.len() >= 10);
    assert!(events.iter().all(|f| f["payload"]["sessionKey"] == "agent:main:acct9:runa"));
    let mut last = String::new();
    for chat in events.iter().filter(|f| f["event"] == "chat") {
        let text = chat["payload"]["message"]["content"][0]["text"].as_str().unwrap();
        assert!(text.starts_with(echo) && text.starts_with(&last), "{text:?} after {last:?}");
        last = text.to_owned();
    }
    let model = events.iter().find(|f| f["payload"]["data"]["phase"] == "model").unwrap();
    assert_eq!(model["payload"]["data"]["model"], "fake-model-b");
    // Recorded timestamps are moved to now (a client computing ages must not see the recording date).
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    for f in &events {
        if let Some(ts) = f["payload"]["ts"].as_i64() {
            assert!((ts - now).abs() < 60_000, "ts {ts} vs now {now}");
        }
    }
    // Nothing of the recording's identity leaks.
    let all = serde_json::to_string(&frames).unwrap();
    assert!(!all.contains("agent:main:acct1:run7") && !all.contains("\"k7\""));
    // Top-level seq counts per connection, without gaps.
    let seqs: Vec<u64> = frames.iter().filter_map(|f| f["seq"].as_u64()).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");

    let runs = gw.runs();
    assert_eq!(runs.len(), 1);
    let r = &runs[0];
    assert_eq!((r.run_id.as_str(), r.session_key.as_str(), r.track.as_str()), ("run-a-1", "agent:main:acct9:runa", "short"));
    assert_eq!(r.model, "cogni/fake-model-b");
    assert_eq!(r.traceparent.as_deref(), Some(trace));
    assert_eq!(r.message, msg);
    assert_eq!(r.status, RunStatus::Ok);

    // The terminal snapshot, and the transcript.
    let wait = a.call("agent.wait", json!({"runId": "run-a-1", "timeoutMs": 1000})).await;
    assert_eq!(wait["payload"]["status"], "ok");
    assert!(wait["payload"]["endedAt"].as_i64().is_some());
    assert_eq!(wait["payload"]["terminalReply"]["text"], format!("{echo}Hello from the fake LLM (req 8)."));
    let history = a.call("chat.history", json!({"sessionKey": "agent:main:acct9:runa"})).await;
    let messages = history["payload"]["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[0]["content"], msg);
}

#[tokio::test]
async fn methods_refuse_what_stock_openclaw_refuses() {
    let gw = start(fast());
    let (mut a, _) = connect(&gw, &ALL_SCOPES, &[]).await;
    let res = a.call("sessions.patch", json!({"key": "k", "model": "nope/gpt-9"})).await;
    assert_eq!(res["error"]["message"], "Unknown provider \"nope\". Use /models to list providers.");
    let res = a.call("sessions.patch", json!({"key": "k", "model": "cogni/fake-model", "outboundHeaders": {"x-a": "1"}})).await;
    assert_eq!(res["error"]["message"], "invalid sessions.patch params: at root: unexpected property 'outboundHeaders'");
    let mut p = agent_params("m", "k", "i");
    p["outboundHeaders"] = json!({});
    let res = a.call("agent", p).await;
    assert_eq!(res["error"]["message"], "invalid agent params: at root: unexpected property 'outboundHeaders'");
    assert!(gw.runs().is_empty());

    // The Cogni fork accepts them, sticky per session, and they are recorded with the run.
    let fork = start(fast().accept_outbound_headers(true));
    let (mut f, _) = connect(&fork, &ALL_SCOPES, &[]).await;
    let res = f.call("sessions.patch", json!({"key": "k", "outboundHeaders": {"x-litellm-end-user-id": "acct-1"}})).await;
    assert_eq!(res["ok"], true, "{res}");
    let id = f.req("agent", agent_params("m", "k", "fork-1")).await;
    f.until(is_final_res(&id)).await;
    assert_eq!(fork.runs()[0].outbound_headers.get("x-litellm-end-user-id").map(String::as_str), Some("acct-1"));
    assert_eq!(fork.runs()[0].model, "cogni/fake-model");
}

#[tokio::test]
async fn a_repeated_idempotency_key_gets_the_cached_final_only() {
    let gw = start(fast());
    let (mut a, _) = connect(&gw, &ALL_SCOPES, &[]).await;
    let id = a.req("agent", agent_params("hello", "agent:main:a:s", "dup-1")).await;
    let first = a.until(is_final_res(&id)).await;
    let cached = first.last().unwrap()["payload"].clone();

    let id2 = a.req("agent", agent_params("something else", "agent:main:a:other", "dup-1")).await;
    let frames = a.until(|f| f["type"] == "res" && f["id"] == id2.as_str()).await;
    assert_eq!(frames.len(), 1, "{frames:?}");
    assert_eq!(frames[0]["payload"], cached);
    assert!(a.quiet_for(Duration::from_millis(300)).await.is_empty());
    assert_eq!(gw.runs().len(), 1);
}

/// As openclaw 2026.9.6 answers a repeated key of a run it is still running: ONE `res` with
/// `status: "in_flight"` (the final goes to the first request only). clawmux relies on it after a
/// restart: it sends the stored key again and, on `in_flight`, waits with `agent.wait`.
#[tokio::test]
async fn a_repeated_idempotency_key_of_a_running_run_answers_in_flight() {
    let gw = start(fast());
    gw.set_paused(true);
    let (mut a, _) = connect(&gw, &ALL_SCOPES, &[]).await;
    let id = a.req("agent", agent_params("hello", "agent:main:a:s", "dup-2")).await;
    let ack = a.until(|f| f["type"] == "res" && f["id"] == id.as_str()).await;
    assert_eq!(ack.last().unwrap()["payload"]["status"], "accepted");
    let id2 = a.req("agent", agent_params("hello", "agent:main:a:s", "dup-2")).await;
    let frames = a.until(|f| f["type"] == "res" && f["id"] == id2.as_str()).await;
    let res = frames.last().unwrap();
    assert_eq!((res["payload"]["status"].as_str(), res["payload"]["runId"].as_str()), (Some("in_flight"), Some("dup-2")), "{res}");
    gw.set_paused(false);
    let fin = a.until(is_final_res(&id)).await;
    assert_eq!(fin.last().unwrap()["payload"]["status"], "ok");
    assert!(a.quiet_for(Duration::from_millis(300)).await.iter().all(|f| f["id"] != id2.as_str()), "one res for the repeat");
    assert_eq!(gw.runs().len(), 1);
}

#[tokio::test]
async fn runs_of_one_session_are_both_acked_then_serialised() {
    // Recorded timing at 20x: a run lasts ~30 ms; the first ACK comes at ~4 ms.
    let gw = start(ReplayConfig::default().speed(20.0));
    let (mut a, _) = connect(&gw, &ALL_SCOPES, &[]).await;
    let one = a.req("agent", agent_params("one [track:short]", "agent:main:a:same", "s-1")).await;
    let two = a.req("agent", agent_params("two [track:short]", "agent:main:a:same", "s-2")).await;
    let frames = a.until(is_final_res(&two)).await;
    let pos = |pred: &dyn Fn(&Value) -> bool| frames.iter().position(pred).unwrap();
    let ack2 = pos(&|f| f["type"] == "res" && f["id"] == two.as_str() && f["payload"]["status"] == "accepted");
    let first_event_1 = pos(&|f| f["payload"]["runId"] == "s-1" && f["type"] == "event");
    let final1 = pos(&|f| is_final_res(&one)(f));
    let first_event_2 = pos(&|f| f["payload"]["runId"] == "s-2" && f["type"] == "event");
    assert!(ack2 < first_event_1, "both ACKs come first");
    assert!(final1 < first_event_2, "the second run starts after the first ended");
}

/// A real track whose timeline stops for a minute after its first chat delta: the run is
/// mid-stream when the test aborts it.
fn stalled_cassette() -> Cassette {
    let mut c = Cassette::bundled().unwrap();
    c.tracks.retain(|t| t.name == "short");
    let track = &mut c.tracks[0];
    let first_delta = track
        .steps
        .iter()
        .position(|s| matches!(&s.kind, StepKind::Event { name, payload } if name == "chat" && payload["state"] == "delta"))
        .unwrap();
    for s in &mut track.steps[first_delta + 1..] {
        s.t_ms += 60_000;
    }
    c
}

#[tokio::test]
async fn chat_abort_ends_the_run_like_the_gateway() {
    let gw = start(ReplayConfig::default().cassette(stalled_cassette()).speed(4.0));
    let (mut a, _) = connect(&gw, &ALL_SCOPES, &[]).await;
    let (mut watcher, _) = connect(&gw, &["operator.read"], &[]).await;
    let run = a.req("agent", agent_params("stop me", "agent:main:a:abort", "ab-1")).await;
    let before = a.until(|f| f["event"] == "chat").await;
    let last_seq = before.last().unwrap()["payload"]["seq"].as_u64().unwrap();

    let abort = a.call_id("chat.abort", json!({"sessionKey": "agent:main:a:abort", "runId": "ab-1"})).await;
    let frames = a.until(is_final_res(&run)).await;
    let kinds: Vec<String> = frames
        .iter()
        .map(|f| match f["type"].as_str().unwrap() {
            "event" => format!(
                "{}:{}",
                f["event"].as_str().unwrap(),
                f["payload"]["state"].as_str().or(f["payload"]["data"]["phase"].as_str()).unwrap()
            ),
            _ => format!("res:{}", f["id"].as_str().unwrap()),
        })
        .collect();
    assert_eq!(kinds, ["chat:aborted", "agent:end", format!("res:{abort}").as_str(), "agent:error", format!("res:{run}").as_str()]);

    let chat = &frames[0]["payload"];
    assert_eq!(chat["stopReason"], "rpc");
    assert_eq!(chat["seq"], last_seq + 1);
    assert_eq!(chat["message"]["content"][0]["text"], "stop me | Hello");
    let end = &frames[1]["payload"]["data"];
    assert_eq!(
        (end["status"].as_str(), end["aborted"].as_bool(), end["stopReason"].as_str()),
        (Some("cancelled"), Some(true), Some("rpc"))
    );
    assert_eq!(frames[2]["payload"], json!({"ok": true, "aborted": true, "runIds": ["ab-1"]}));
    assert_eq!(frames[3]["payload"]["seq"], 1, "the trailing lifecycle error restarts the per-run seq");
    assert_eq!(frames[3]["payload"]["data"]["error"], "This operation was aborted");
    assert_eq!(frames[4]["payload"], json!({"runId": "ab-1", "status": "timeout", "summary": "aborted", "stopReason": "rpc"}));

    // Other readers see the same events (not the res frames).
    let seen = watcher.until(|f| f["event"] == "agent" && f["payload"]["data"]["phase"] == "error").await;
    assert!(seen.iter().any(|f| f["payload"]["state"] == "aborted"));

    // Nothing left to abort.
    let again = a.call("chat.abort", json!({"sessionKey": "agent:main:a:abort"})).await;
    assert_eq!(again["payload"], json!({"ok": true, "aborted": false, "runIds": []}));
    let runs = gw.runs();
    assert_eq!((runs[0].status, runs[0].aborted), (RunStatus::Timeout, true));
    // agent.wait of an aborted run: `error` + `rpc` (2026.9.6), not the final's `timeout`.
    let wait = a.call("agent.wait", json!({"runId": "ab-1"})).await;
    assert_eq!((wait["payload"]["status"].as_str(), wait["payload"]["stopReason"].as_str()), (Some("error"), Some("rpc")), "{wait}");
}

#[tokio::test]
async fn sessions_abort_stops_the_active_run_of_a_session() {
    let gw = start(ReplayConfig::default().cassette(stalled_cassette()).speed(4.0));
    let (mut a, _) = connect(&gw, &ALL_SCOPES, &[]).await;
    let idle = a.call("sessions.abort", json!({"key": "agent:main:a:idle"})).await;
    assert_eq!(idle["payload"], json!({"ok": true, "abortedRunId": null, "status": "no-active-run"}));

    let run = a.req("agent", agent_params("stop me too", "Agent:Main:A:Sess", "sa-1")).await;
    a.until(|f| f["event"] == "chat").await;
    let abort = a.call_id("sessions.abort", json!({"key": "agent:main:a:sess"})).await;
    let frames = a.until(is_final_res(&run)).await;
    let res = frames.iter().find(|f| f["id"] == abort.as_str()).unwrap();
    assert_eq!(res["payload"], json!({"ok": true, "abortedRunId": "sa-1", "status": "aborted"}));
    assert_eq!(frames.last().unwrap()["payload"]["summary"], "aborted");
}

#[tokio::test]
async fn paused_runs_hold_after_their_ack() {
    let gw = start(fast());
    let (mut a, _) = connect(&gw, &ALL_SCOPES, &[]).await;
    gw.set_paused(true);
    let id = a.req("agent", agent_params("hold", "agent:main:a:p", "p-1")).await;
    let ack = a.res(&id).await;
    assert_eq!(ack["payload"]["status"], "accepted");
    assert!(a.quiet_for(Duration::from_millis(300)).await.is_empty());
    let wait = a.call("agent.wait", json!({"runId": "p-1", "timeoutMs": 100})).await;
    assert_eq!(wait["payload"], json!({"runId": "p-1", "status": "timeout"}));
    gw.set_paused(false);
    let frames = a.until(is_final_res(&id)).await;
    assert!(run_events(&frames, "p-1").count() >= 10);
}

// ---------------------------------------------------------------- keep-alive and faults -------

#[tokio::test]
async fn ticks_come_at_the_configured_interval() {
    let gw = start(fast().tick_interval_ms(100));
    let (mut a, hello) = connect(&gw, &[], &[]).await;
    assert_eq!(hello["policy"]["tickIntervalMs"], 100);
    let started = tokio::time::Instant::now();
    let frames = a.quiet_for(Duration::from_millis(1200)).await;
    let ticks: Vec<&Value> = frames.iter().filter(|f| f["event"] == "tick").collect();
    // The tick loop shares this test's thread: a stall delays ticks (a late one is not made up
    // for by a burst), so only "at least a few, never faster than the interval" holds on a busy
    // machine; the upper bound on a gap is loose for the same reason.
    assert!((3..=13).contains(&ticks.len()), "{} ticks in {:?}", ticks.len(), started.elapsed());
    let ts: Vec<i64> = ticks.iter().map(|t| t["payload"]["ts"].as_i64().unwrap()).collect();
    assert!(ts.windows(2).all(|w| (60..=1000).contains(&(w[1] - w[0]))), "{ts:?}");
    let seqs: Vec<u64> = ticks.iter().map(|t| t["seq"].as_u64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1));

    gw.set_ticks(false);
    a.quiet_for(Duration::from_millis(120)).await;
    assert!(a.quiet_for(Duration::from_millis(300)).await.is_empty());
}

#[tokio::test]
async fn stats_count_every_frame_and_byte_per_connection() {
    let gw = start(fast());
    let (mut a, hello) = connect(&gw, &ALL_SCOPES, &[]).await;
    let (mut b, hello_b) = connect(&gw, &["operator.read"], &[]).await;
    let id = a.req("agent", agent_params("count me", "agent:main:a:c", "c-1")).await;
    let frames = a.until(is_final_res(&id)).await;
    b.until(|f| f["event"] == "chat" && f["payload"]["state"] == "final").await;
    tokio::time::sleep(Duration::from_millis(50)).await;

    let stats = gw.stats();
    assert_eq!(stats.connections_current, 2);
    let sa = stats.connection(hello["server"]["connId"].as_str().unwrap()).unwrap();
    assert_eq!((sa.frames_sent, sa.bytes_sent), (a.frames, a.bytes));
    assert_eq!(sa.events_sent.get("chat").copied().unwrap_or(0), frames.iter().filter(|f| f["event"] == "chat").count() as u64);
    assert_eq!(sa.events_sent.get("connect.challenge"), Some(&1));
    assert_eq!(sa.scopes, ALL_SCOPES);
    let sb = stats.connection(hello_b["server"]["connId"].as_str().unwrap()).unwrap();
    assert_eq!((sb.frames_sent, sb.bytes_sent), (b.frames, b.bytes));
    assert!(sb.frames_sent < sa.frames_sent, "B gets no res frames");
}

#[tokio::test]
async fn oversized_frames_close_1009() {
    let gw = start(fast().max_payload(4096));
    let (mut a, hello) = connect(&gw, &ALL_SCOPES, &[]).await;
    assert_eq!(hello["policy"]["maxPayload"], 4096);
    let big = "x".repeat(5000);
    a.req("health", json!({"probe": big})).await;
    assert_eq!(a.close_code().await, (1009, String::new()));
}

#[tokio::test]
async fn crash_and_shutdown_look_like_the_real_thing() {
    let gw = start(ReplayConfig::default().cassette(stalled_cassette()).speed(4.0));
    let (mut a, _) = connect(&gw, &ALL_SCOPES, &[]).await;
    a.req("agent", agent_params("crash", "agent:main:a:crash", "x-1")).await;
    a.until(|f| f["event"] == "chat").await;
    gw.drop_connections(true);
    assert_eq!(a.close_code().await.0, 1006, "no close frame");

    // A restarted gateway does not know the run any more.
    let (mut b, _) = connect(&gw, &ALL_SCOPES, &[]).await;
    let wait = b.call("agent.wait", json!({"runId": "x-1", "timeoutMs": 100})).await;
    assert_eq!(wait["payload"], json!({"runId": "x-1", "status": "timeout"}));
    assert_eq!(gw.runs()[0].status, RunStatus::Forgotten);

    assert_eq!(gw.broadcast_raw(r#"{"type":"event","event":"presence","payload":{"presence":[]}}"#), 1);
    assert_eq!(b.next().await.unwrap()["event"], "presence");

    gw.send_shutdown(Some(1500));
    let shutdown = b.next().await.unwrap();
    assert_eq!(shutdown["event"], "shutdown");
    assert_eq!(shutdown["payload"], json!({"reason": "gateway restarting", "restartExpectedMs": 1500}));
    assert_eq!(b.close_code().await, (1012, "service restart".to_owned()));
    // The gateway is back at once.
    let (_c, hello) = connect(&gw, &ALL_SCOPES, &[]).await;
    assert_eq!(hello["type"], "hello-ok");
    gw.stop().await;
    assert!(tokio_tungstenite::connect_async(gw.url()).await.is_err());
}

/// `clawmux demo` starts the gateway inside the actix-rt `System` of the HTTP server.
#[test]
fn starts_inside_an_actix_system() {
    actix_rt::System::new().block_on(async {
        let gw = start(fast());
        let (mut a, _) = connect(&gw, &ALL_SCOPES, &[]).await;
        let id = a.req("agent", agent_params("from actix", "agent:main:a:actix", "actix-1")).await;
        let frames = a.until(is_final_res(&id)).await;
        assert_eq!(frames.last().unwrap()["payload"]["status"], "ok");
        gw.stop().await;
    });
}

// ---------------------------------------------------------------- protocol 3 -----------------

#[tokio::test]
async fn protocol_3_broadcasts_to_everyone_and_cannot_abort_agent_runs() {
    let v3 = Cassette::parse(include_str!("cassettes/openclaw-2026.4.12.jsonl")).unwrap();
    let gw = start(ReplayConfig::default().cassette(v3).protocol(3).speed(0.0));
    let (mut c, _) = Client::open(&gw.url()).await;
    let mut p = connect_params(&ALL_SCOPES, &[], Some(TOKEN));
    p["client"]["id"] = json!("cogni-rust");
    let id = c.req("connect", p).await;
    assert_eq!(
        c.res(&id).await["error"]["message"],
        "invalid connect params: at /client/id: must be equal to constant; at /client/id: must match a schema in anyOf"
    );
    let mut p = connect_params(&ALL_SCOPES, &[], Some(TOKEN));
    p["minProtocol"] = json!(4);
    let (mut c, res) = connect_raw(&gw, p).await;
    assert_eq!(res["error"], json!({"code": "INVALID_REQUEST", "message": "protocol mismatch", "details": {"expectedProtocol": 3}}));
    assert_eq!(c.close_code().await.0, 1002);

    // Without a device identity the scopes are cleared (and hello-ok has no `auth`).
    let (mut n, hello) = connect(&gw, &ALL_SCOPES, &[]).await;
    assert_eq!(hello["protocol"], 3);
    assert!(hello.get("auth").is_none());
    let res = n.call("sessions.patch", json!({"key": "k", "model": "cogni/fake-model"})).await;
    assert_eq!(res["error"], json!({"code": "INVALID_REQUEST", "message": "missing scope: operator.admin"}));

    let mut p = connect_params(&ALL_SCOPES, &[], Some(TOKEN));
    p["device"] = json!({"id": "d", "publicKey": "k", "signature": "s", "signedAt": 1, "nonce": "n"});
    let (mut a, res) = connect_raw(&gw, p).await;
    assert_eq!(res["ok"], true);
    let res = a.call_with_traceparent("health", json!({}), "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01").await;
    assert_eq!(res["error"]["message"], "invalid request frame: at root: unexpected property 'traceparent'");

    let run = a.req("agent", agent_params("v3 run [track:slow]", "agent:main:a:v3", "v3-1")).await;
    let ack = a.res(&run).await;
    let mut keys: Vec<&String> = ack["payload"].as_object().unwrap().keys().collect();
    keys.sort();
    assert_eq!(keys, ["acceptedAt", "runId", "status"], "no sessionKey/agentId in a v3 ACK");
    let abort = a.call("chat.abort", json!({"sessionKey": "agent:main:a:v3", "runId": "v3-1"})).await;
    assert_eq!(abort["payload"], json!({"ok": true, "aborted": false, "runIds": []}));
    let frames = a.until(is_final_res(&run)).await;
    assert_eq!(frames.last().unwrap()["payload"]["status"], "ok");
    assert!(run_events(&frames, "v3-1").all(|f| f["payload"].get("deltaText").is_none()));

    // The scope-less connection got every event too, with the same global seq numbers.
    let on_n = n.until(is_final_res_or_chat_final()).await;
    let seq_a: Vec<u64> = run_events(&frames, "v3-1").filter_map(|f| f["seq"].as_u64()).collect();
    let seq_n: Vec<u64> = run_events(&on_n, "v3-1").filter_map(|f| f["seq"].as_u64()).collect();
    assert_eq!(seq_a, seq_n);
    assert!(!seq_a.is_empty());
}

fn is_final_res_or_chat_final() -> impl Fn(&Value) -> bool {
    |f| f["event"] == "chat" && f["payload"]["state"] == "final"
}

impl Client {
    /// Sends a request and returns its id (the answer is read later, in frame order).
    async fn call_id(&mut self, method: &str, params: Value) -> String {
        self.req(method, params).await
    }

    async fn call_with_traceparent(&mut self, method: &str, params: Value, traceparent: &str) -> Value {
        let id = self.req_with(method, params, Some(traceparent)).await;
        self.res(&id).await
    }
}
