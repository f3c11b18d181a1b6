//! The chaos tests' harness: a replay gateway with a clawmux in front of it, an incremental SSE
//! reader that sees the end of a stream, frame builders, and the expected answers of the tracks.
//! Small pieces are copied from `tests/api.rs` (kept there unchanged) so each test file stands alone.
#![allow(dead_code)]

use crate::common::{base, metric, parse_sse, post_sse, start_clawmux_with, wait_ready, SseEvent};
use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway, ReplayHandle, RunRecord, StepKind};
use clawmux::server::Running;
use futures_util::{Stream, StreamExt};
use serde_json::{json, Value};
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;
use tokio::time::Instant;

/// Token of the replay gateway (clawmux must present it).
pub const GW_TOKEN: &str = "replay-gw-token";
/// Generous bound for things that take milliseconds.
pub const WAIT: Duration = Duration::from_secs(10);
/// 1 MiB.
pub const MIB: usize = 1024 * 1024;

// ------------------------------------------------------------------------------------------------
// Gateways, tracks and their answers
// ------------------------------------------------------------------------------------------------

/// No recorded delays: runs finish as fast as frames can move (hold them with `set_paused`).
pub fn fast() -> ReplayConfig {
    ReplayConfig::default().speed(0.0)
}

/// The `long` track (42 chat deltas, final at ~3.5 s) at recorded speed.
pub fn long() -> ReplayConfig {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cassettes/openclaw-2026.9.6-long.jsonl");
    ReplayConfig::new(Cassette::from_path(path).expect("the long cassette")).speed(1.0)
}

/// The recorded answer of a track (its final `result.payloads[0].text`).
pub fn recorded_answer(cfg: &ReplayConfig, track: &str) -> String {
    let t = cfg.cassette.tracks.iter().find(|t| t.name == track).unwrap_or_else(|| panic!("no track {track}"));
    let fin = t
        .steps
        .iter()
        .find_map(|s| match &s.kind {
            StepKind::Final { payload } => payload.pointer("/result/payloads/0/text").and_then(Value::as_str),
            StepKind::Event { .. } => None,
        })
        .expect("a final with text");
    fin.to_owned()
}

/// A run body whose first line (`<marker> [track:<track>]`) the replay gateway echoes in front of
/// the recorded answer, so every text shows whose run it belongs to.
pub fn body_on(track: &str, marker: &str, account: &str) -> Value {
    json!({"message": format!("{marker} [track:{track}]\nthe second line is not echoed"), "billingAccountId": account})
}

/// The content the replay gateway answers to [`body_on`].
pub fn answer_on(track: &str, marker: &str, recorded: &str) -> String {
    format!("{marker} [track:{track}] | {recorded}")
}

/// The `short` track of the bundled cassette.
pub fn body(marker: &str, account: &str) -> Value {
    body_on("short", marker, account)
}

/// What the `short` track answers to [`body`].
pub fn answer(marker: &str) -> String {
    answer_on("short", marker, &recorded_answer(&fast(), "short"))
}

pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", &uuid::Uuid::new_v4().simple().to_string()[..10])
}

pub fn gateway(cfg: ReplayConfig) -> ReplayHandle {
    ReplayGateway::start("127.0.0.1:0".parse().expect("addr"), cfg.token(GW_TOKEN)).expect("replay gateway starts")
}

pub fn http() -> reqwest::Client {
    reqwest::Client::builder().pool_max_idle_per_host(64).build().expect("http client")
}

// ------------------------------------------------------------------------------------------------
// Env: a replay gateway and a clawmux in front of it
// ------------------------------------------------------------------------------------------------

pub struct Env {
    pub gw: ReplayHandle,
    pub app: Running,
    pub base: String,
    pub http: reqwest::Client,
}

/// A gateway with `cfg` and a ready clawmux (test backoff 50..500 ms) with `tweak_sup` applied.
pub async fn env_with(cfg: ReplayConfig, tweak_sup: impl FnOnce(&mut clawmux_actors::SupervisorConfig)) -> Env {
    let gw = gateway(cfg);
    let env = env_on(gw, tweak_sup).await;
    wait_ready(&env.http, &env.base, WAIT).await;
    env
}

pub async fn env(cfg: ReplayConfig) -> Env {
    env_with(cfg, |_| {}).await
}

/// A clawmux in front of an already started gateway; does NOT wait for readiness.
pub async fn env_on(gw: ReplayHandle, tweak_sup: impl FnOnce(&mut clawmux_actors::SupervisorConfig)) -> Env {
    record_panics();
    let app = start_clawmux_with(&gw.url(), Some(GW_TOKEN), |_| {}, tweak_sup).await;
    let base = base(&app);
    Env { gw, app, base, http: http() }
}

impl Env {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// A Prometheus sample (summed over every line starting with `name`).
    pub async fn metric(&self, name: &str) -> f64 {
        // `+ 0.0`: an empty sum is -0.0, which prints as "-0".
        metric(&self.http, &self.base, name).await + 0.0
    }

    /// The `/metrics` lines starting with `prefix`.
    pub async fn metric_lines(&self, prefix: &str) -> Vec<String> {
        let text = self.http.get(self.url("/metrics")).send().await.expect("metrics").text().await.expect("metrics body");
        text.lines().filter(|l| l.starts_with(prefix)).map(str::to_owned).collect()
    }

    /// Every disconnect, whatever its reason.
    pub async fn disconnects(&self) -> f64 {
        self.metric("clawmux_gateway_disconnects_total").await
    }

    pub async fn readyz(&self) -> (u16, Value) {
        match self.http.get(self.url("/readyz")).send().await {
            Ok(r) => (r.status().as_u16(), r.json().await.unwrap_or(Value::Null)),
            Err(e) => (0, json!({"transport error": e.to_string()})),
        }
    }

    pub async fn doc(&self, run_id: &str) -> Value {
        let r = self.http.get(self.url(&format!("/v1/runs/{run_id}"))).send().await.expect("GET run");
        assert_eq!(r.status(), 200, "GET /v1/runs/{run_id}");
        r.json().await.expect("run document")
    }

    /// POSTs a run asking for SSE; asserts `200` (with the error body in the message otherwise).
    pub async fn sse(&self, body: &Value) -> Sse {
        let resp = post_sse(&self.http, &self.base, body, &[]).await;
        let status = resp.status();
        if status != 200 {
            let text = resp.text().await.unwrap_or_default();
            panic!("POST /v1/runs (SSE) answered {status}: {text} (body {body})");
        }
        Sse::new(resp)
    }

    /// Re-attaches to a run's events from the start (`GET /v1/runs/{id}/events`).
    pub async fn reattach(&self, run_id: &str) -> Sse {
        let r = self
            .http
            .get(self.url(&format!("/v1/runs/{run_id}/events")))
            .header("accept", "text/event-stream")
            .send()
            .await
            .expect("GET events");
        assert_eq!(r.status(), 200, "GET /v1/runs/{run_id}/events");
        Sse::new(r)
    }

    /// The gateway's record of a run, by gateway run id.
    pub fn gw_run(&self, gateway_run_id: &str) -> RunRecord {
        self.gw.runs().into_iter().find(|r| r.run_id == gateway_run_id).unwrap_or_else(|| panic!("gateway never saw run {gateway_run_id}"))
    }

    /// Requests of `method` the gateway has received so far.
    pub fn requests(&self, method: &str) -> u64 {
        self.gw.stats().requests_received.get(method).copied().unwrap_or(0)
    }
}

/// Polls `check` until it holds; fails the test after `within`.
pub async fn eventually<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if check().await {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ------------------------------------------------------------------------------------------------
// Panics inside clawmux
// ------------------------------------------------------------------------------------------------

/// Panics seen so far: (thread name, message). A panic inside an actor or a task does not fail a
/// test by itself (the runtime catches it), so the hook records them.
static PANICS: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

/// Installs the recording hook (once; it chains to the previous hook, so messages still print).
pub fn record_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let thread = std::thread::current().name().unwrap_or("?").to_owned();
            if let Ok(mut p) = PANICS.lock() {
                p.push((thread, info.to_string()));
            }
            previous(info);
        }));
    });
}

/// Asserts that nothing of this test's clawmux panicked: neither on the test's own thread (where
/// the actors run; an assertion there would already have ended the test) nor on the I/O threads
/// of its actix system.
pub fn assert_no_panics(what: &str) {
    let me = std::thread::current().name().unwrap_or("?").to_owned();
    let system = format!("system:{}|", actix::System::current().id());
    let ours: Vec<(String, String)> = PANICS
        .lock()
        .map(|p| p.iter().filter(|(t, _)| *t == me || t.contains(&system)).cloned().collect())
        .unwrap_or_default();
    assert!(ours.is_empty(), "{what}: clawmux panicked: {ours:?}");
}

// ------------------------------------------------------------------------------------------------
// Frames
// ------------------------------------------------------------------------------------------------

/// A chat event frame (cumulative text), as the gateway sends it.
pub fn chat_frame(session_key: &str, run_id: &str, state: &str, text: &str) -> String {
    json!({"type": "event", "event": "chat", "seq": 1, "payload": {
        "runId": run_id, "sessionKey": session_key, "seq": 1, "state": state,
        "message": {"role": "assistant", "content": [{"type": "text", "text": text}]},
    }})
    .to_string()
}

/// An event frame of exactly `len` bytes (a padded payload), e.g. the 4,718,587-byte `health`
/// event seen from a real gateway.
pub fn padded_event(name: &str, len: usize) -> String {
    let head = format!(r#"{{"type":"event","event":"{name}","payload":{{"ok":true,"pad":""#);
    let tail = r#""}}"#;
    let pad = len.checked_sub(head.len() + tail.len()).expect("len leaves room for the frame");
    let frame = format!("{head}{}{tail}", "x".repeat(pad));
    assert_eq!(frame.len(), len);
    frame
}

// ------------------------------------------------------------------------------------------------
// SSE reading (incremental, sees the end of the stream)
// ------------------------------------------------------------------------------------------------

type ByteStream = Pin<Box<dyn Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>;

/// An SSE stream read event by event; tells a closed stream from a quiet one.
pub struct Sse {
    stream: ByteStream,
    buf: Vec<u8>,
    /// Every event read so far.
    pub events: Vec<SseEvent>,
    /// The server closed the stream.
    pub ended: bool,
}

impl Sse {
    pub fn new(resp: reqwest::Response) -> Self {
        Self { stream: Box::pin(resp.bytes_stream()), buf: Vec::new(), events: Vec::new(), ended: false }
    }

    /// The next event; `None` when the stream closed or `within` passed.
    pub async fn next(&mut self, within: Duration) -> Option<SseEvent> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(pos) = self.buf.windows(2).position(|w| w == b"\n\n") {
                let block: Vec<u8> = self.buf.drain(..pos + 2).collect();
                if let Some(ev) = parse_sse(&String::from_utf8_lossy(&block)).into_iter().next() {
                    self.events.push(ev.clone());
                    return Some(ev);
                }
                continue; // a comment (keep-alive)
            }
            if self.ended {
                return None;
            }
            match tokio::time::timeout_at(deadline, self.stream.next()).await {
                Ok(Some(Ok(chunk))) => self.buf.extend_from_slice(&chunk),
                Ok(Some(Err(_)) | None) => self.ended = true,
                Err(_) => return None,
            }
        }
    }

    /// Reads until an event satisfies `pred` (events read before count too).
    pub async fn until(&mut self, within: Duration, pred: impl Fn(&SseEvent) -> bool) -> Option<SseEvent> {
        if let Some(e) = self.events.iter().find(|e| pred(e)) {
            return Some(e.clone());
        }
        let deadline = Instant::now() + within;
        loop {
            let ev = self.next(deadline.saturating_duration_since(Instant::now())).await?;
            if pred(&ev) {
                return Some(ev);
            }
        }
    }

    /// The `accepted` event (the first one).
    pub async fn accepted(&mut self) -> Accepted {
        let ev = self.next(WAIT).await.unwrap_or_else(|| panic!("no accepted event within {WAIT:?} (the gateway never acknowledged the run)"));
        assert_eq!((ev.id, ev.event.as_str()), (1, "accepted"), "{ev:?}");
        let s = |k: &str| ev.data[k].as_str().unwrap_or_else(|| panic!("accepted lacks {k}: {ev:?}")).to_owned();
        Accepted { run_id: s("runId"), session_key: s("sessionKey"), gateway_run_id: s("gatewayRunId") }
    }

    pub async fn terminal(&mut self, within: Duration) -> Option<SseEvent> {
        self.until(within, |e| e.event == "final" || e.event == "error").await
    }

    /// Reads to the end of the stream; true if the server closed it within `within`.
    pub async fn read_to_end(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while self.next(deadline.saturating_duration_since(Instant::now())).await.is_some() {}
        self.ended
    }

    pub fn text(&self) -> String {
        self.events.iter().filter(|e| e.event == "text_delta").filter_map(|e| e.data["text"].as_str()).collect()
    }
}

/// What `accepted` says.
#[derive(Debug, Clone)]
pub struct Accepted {
    pub run_id: String,
    pub session_key: String,
    pub gateway_run_id: String,
}

/// The contract every finished stream keeps: ids 1..=n, `accepted` first, exactly one terminal
/// event and it is the last one.
pub fn assert_stream_shape(sse: &Sse, what: &str) {
    let events = &sse.events;
    assert!(!events.is_empty(), "{what}: no events");
    let ids: Vec<u64> = events.iter().map(|e| e.id).collect();
    assert_eq!(ids, (1..=events.len() as u64).collect::<Vec<_>>(), "{what}: ids");
    assert_eq!(events[0].event, "accepted", "{what}");
    let terminals = events.iter().filter(|e| e.event == "final" || e.event == "error").count();
    assert_eq!(terminals, 1, "{what}: {} terminal events: {events:?}", terminals);
    let last = events.last().expect("events");
    assert!(last.event == "final" || last.event == "error", "{what}: the terminal event is not last: {events:?}");
}

/// Exactly one terminal event, and it is the last one (ids 1..=n). For runs that may end before
/// the gateway acknowledged them (no `accepted` event).
pub fn assert_one_terminal_last(sse: &Sse, what: &str) {
    let events = &sse.events;
    let ids: Vec<u64> = events.iter().map(|e| e.id).collect();
    assert_eq!(ids, (1..=events.len() as u64).collect::<Vec<_>>(), "{what}: ids");
    let terminals = events.iter().filter(|e| e.event == "final" || e.event == "error").count();
    assert_eq!(terminals, 1, "{what}: {terminals} terminal events: {events:?}");
    assert!(events.last().is_some_and(|l| l.event == "final" || l.event == "error"), "{what}: the terminal event is not last: {events:?}");
}

/// Reads a run to its end (bounded) and checks the stream's shape; returns the terminal event.
pub async fn finish(sse: &mut Sse, within: Duration, what: &str) -> SseEvent {
    let fin = sse.terminal(within).await.unwrap_or_else(|| panic!("{what}: no terminal event within {within:?}: {:?}", sse.events));
    assert!(sse.read_to_end(WAIT).await, "{what}: the stream did not close after its terminal event");
    assert_stream_shape(sse, what);
    fin
}

/// Asserts a `final` whose content is `expected` and whose deltas add up to it exactly.
pub fn assert_final_with(fin: &SseEvent, sse: &Sse, expected: &str, what: &str) {
    assert_eq!(fin.event, "final", "{what}: expected final, got {} {}", fin.event, fin.data);
    assert_eq!(fin.data["status"], "ok", "{what}: {}", fin.data);
    assert_eq!(fin.data["content"].as_str(), Some(expected), "{what}: content");
    assert_eq!(sse.text(), expected, "{what}: the text deltas must add up to the content");
}

/// Asserts an `error` terminal event with `code`.
pub fn assert_error(fin: &SseEvent, code: &str, what: &str) {
    assert_eq!((fin.event.as_str(), fin.data["code"].as_str()), ("error", Some(code)), "{what}: {}", fin.data);
}
