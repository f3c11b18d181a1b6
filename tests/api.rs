//! clawmux end to end against the replay gateway: isolation of hundreds of concurrent runs (with
//! session-scoped and with broadcast delivery), fail-closed routing, delta edge cases, connection
//! faults (tick loss, `shutdown`, dropped connections, a restarted gateway, a gateway still
//! starting), every bad input of the HTTP contract (`/work/shared/docs/API.md`), the API's
//! behaviours and graceful shutdown.
//!
//! Runs are held open deterministically with the replay gateway's pause (the ACK still goes out,
//! so a held run has its `accepted` event and nothing else). Frames are injected with
//! `broadcast_raw`; the replay gateway answers `<first line of the message> | <recorded text>`, so a
//! marker in each message shows whose run a text belongs to. Every wait is bounded.

#![allow(clippy::unwrap_used)]

mod common;

use clawmux::config::Secret;
use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway, ReplayHandle, RunRecord, RunStatus, StepKind};
use clawmux::server::{self, Running};
use common::*;
use futures_util::{SinkExt, Stream, StreamExt};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;
use tokio::time::Instant;

/// Token of the replay gateway (clawmux must present it).
const GW_TOKEN: &str = "replay-gw-token";
/// Generous bound for things that take milliseconds.
const WAIT: Duration = Duration::from_secs(10);
/// The replayed answer of the `short` track (pinned with `[track:short]` in messages).
const SHORT_ANSWER: &str = "Hello from the fake LLM (req 8).";

// ------------------------------------------------------------------------------------------------
// Harness
// ------------------------------------------------------------------------------------------------

fn gateway(cfg: ReplayConfig) -> ReplayHandle {
    ReplayGateway::start("127.0.0.1:0".parse().unwrap(), cfg.token(GW_TOKEN)).expect("replay gateway starts")
}

/// No recorded delays: runs finish as fast as frames can move.
fn fast() -> ReplayConfig {
    ReplayConfig::default().speed(0.0)
}

fn http() -> reqwest::Client {
    common::http_client(None)
}

/// A replay gateway and a clawmux in front of it.
struct Env {
    gw: ReplayHandle,
    app: Running,
    base: String,
    http: reqwest::Client,
}

async fn env(cfg: ReplayConfig) -> Env {
    env_with(cfg, |_| {}, |_| {}).await
}

async fn env_with(
    cfg: ReplayConfig,
    tweak: impl FnOnce(&mut clawmux::config::Config),
    tweak_sup: impl FnOnce(&mut clawmux_actors::SupervisorConfig),
) -> Env {
    let gw = gateway(cfg);
    let app = start_clawmux_with(&gw.url(), Some(GW_TOKEN), tweak, tweak_sup).await;
    let base = base(&app);
    let http = http();
    wait_ready(&http, &base, WAIT).await;
    Env { gw, app, base, http }
}

impl Env {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn metric(&self, name: &str) -> f64 {
        metric(&self.http, &self.base, name).await
    }

    async fn readyz(&self) -> (u16, Value) {
        let r = self.http.get(self.url("/readyz")).send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    async fn doc(&self, run_id: &str) -> Value {
        let r = self.http.get(self.url(&format!("/v1/runs/{run_id}"))).send().await.unwrap();
        assert_eq!(r.status(), 200, "GET /v1/runs/{run_id}");
        r.json().await.unwrap()
    }

    /// POSTs a run asking for SSE; asserts `200` and returns the stream.
    async fn sse(&self, body: &Value) -> Sse {
        let resp = post_sse(&self.http, &self.base, body, &[]).await;
        assert_eq!(resp.status(), 200, "POST /v1/runs (SSE) for {body}");
        Sse::new(resp)
    }

    /// How many runs the store has (`GET /v1/runs`).
    async fn stored_runs(&self) -> usize {
        let v: Value = self.http.get(self.url("/v1/runs?limit=500")).send().await.unwrap().json().await.unwrap();
        v["runs"].as_array().map_or(0, Vec::len)
    }

    /// The gateway's record of a run, by gateway run id.
    fn gw_run(&self, gateway_run_id: &str) -> RunRecord {
        self.gw.runs().into_iter().find(|r| r.run_id == gateway_run_id).unwrap_or_else(|| panic!("gateway never saw run {gateway_run_id}"))
    }
}

/// Polls `check` until it holds; fails the test after `within`.
async fn eventually<F, Fut>(within: Duration, what: &str, mut check: F)
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

/// A run body: `first_line` is echoed by the replay gateway; the `short` track is pinned so the
/// answer is known.
fn body(first_line: &str, account: &str) -> Value {
    json!({"message": format!("{first_line} [track:short]\nthe second line is not echoed"), "billingAccountId": account})
}

/// The content the replay gateway answers to [`body`].
fn answer(first_line: &str) -> String {
    format!("{first_line} [track:short] | {SHORT_ANSWER}")
}

fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", &uuid::Uuid::new_v4().simple().to_string()[..10])
}

/// A chat event frame, as the gateway sends it (cumulative text).
fn chat_frame(session_key: Option<&str>, run_id: Option<&str>, state: &str, text: &str) -> String {
    let mut p = json!({"seq": 1, "state": state, "message": {"role": "assistant", "content": [{"type": "text", "text": text}]}});
    if let Some(s) = session_key {
        p["sessionKey"] = json!(s);
    }
    if let Some(r) = run_id {
        p["runId"] = json!(r);
    }
    json!({"type": "event", "event": "chat", "payload": p, "seq": 1}).to_string()
}

/// An agent event frame: a lifecycle `start` (a run it reached would show `status: thinking`)
/// carrying `text` as a marker.
fn agent_frame(session_key: Option<&str>, run_id: Option<&str>, text: &str) -> String {
    let mut p = json!({"seq": 1, "stream": "lifecycle", "data": {"phase": "start", "text": text}});
    if let Some(s) = session_key {
        p["sessionKey"] = json!(s);
    }
    if let Some(r) = run_id {
        p["runId"] = json!(r);
    }
    json!({"type": "event", "event": "agent", "payload": p, "seq": 1}).to_string()
}

/// Chat and agent events per run of the bundled cassette (the same for every track).
fn events_per_run() -> (u64, u64) {
    let cassette = Cassette::bundled().unwrap();
    let counts: Vec<(u64, u64)> = cassette
        .tracks
        .iter()
        .map(|t| {
            let named = |n: &str| t.steps.iter().filter(|s| matches!(&s.kind, StepKind::Event { name, .. } if name == n)).count() as u64;
            (named("chat"), named("agent"))
        })
        .collect();
    assert!(counts.windows(2).all(|w| w[0] == w[1]), "tracks differ: {counts:?}");
    assert!(counts[0].0 > 0 && counts[0].1 > 0);
    counts[0]
}

/// Asserts an error answer: status, `error.code`, a non-empty message; returns the message.
async fn expect_error(resp: reqwest::Response, status: u16, code: &str, what: &str) -> String {
    assert_eq!(resp.status().as_u16(), status, "{what}");
    let v: Value = resp.json().await.unwrap_or_else(|e| panic!("{what}: error body is not JSON: {e}"));
    assert_eq!(v["error"]["code"], code, "{what}: {v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default().to_owned();
    assert!(!msg.is_empty(), "{what}: empty message in {v}");
    msg
}

/// An RFC 3339 date-time (`2026-11-21T05:09:25.289Z`, `...+02:00`) as nanoseconds since the epoch;
/// `None` when it is not one.
fn rfc3339_nanos(s: &str) -> Option<i128> {
    let b = s.as_bytes();
    let num = |r: std::ops::Range<usize>| -> Option<i128> {
        let part = s.get(r)?;
        (!part.is_empty() && part.bytes().all(|c| c.is_ascii_digit())).then(|| part.parse().ok()).flatten()
    };
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't') || b[13] != b':' || b[16] != b':' {
        return None;
    }
    let (y, mo, d, h, mi, sec) = (num(0..4)?, num(5..7)?, num(8..10)?, num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    let mut i = 19;
    let mut frac: i128 = 0;
    if b[i] == b'.' {
        let start = i + 1;
        i = start;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        let digits = s.get(start..i)?;
        if digits.is_empty() || digits.len() > 9 {
            return None;
        }
        frac = digits.parse::<i128>().ok()? * 10i128.pow(9 - digits.len() as u32);
    }
    let offset_min = match s.get(i..)? {
        "Z" | "z" => 0,
        o if o.len() == 6 && matches!(o.as_bytes()[0], b'+' | b'-') && o.as_bytes()[3] == b':' => {
            let m = num(i + 1..i + 3)? * 60 + num(i + 4..i + 6)?;
            if o.starts_with('-') {
                -m
            } else {
                m
            }
        }
        _ => return None,
    };
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + h * 3600 + mi * 60 + sec - offset_min * 60;
    Some(secs * 1_000_000_000 + frac)
}

fn is_rfc3339(v: &Value) -> bool {
    v.as_str().and_then(rfc3339_nanos).is_some()
}

// ------------------------------------------------------------------------------------------------
// SSE reading (incremental, time-stamped, sees the end of the stream)
// ------------------------------------------------------------------------------------------------

type ByteStream = Pin<Box<dyn Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>;

/// An SSE stream read event by event. Unlike a plain body read it keeps what it has read
/// and tells a closed stream from a quiet one.
struct Sse {
    stream: ByteStream,
    buf: Vec<u8>,
    /// Every event read so far.
    events: Vec<SseEvent>,
    /// The server closed the stream.
    ended: bool,
}

impl Sse {
    fn new(resp: reqwest::Response) -> Self {
        Self { stream: Box::pin(resp.bytes_stream()), buf: Vec::new(), events: Vec::new(), ended: false }
    }

    /// The next event; `None` when the stream closed or `within` passed.
    async fn next(&mut self, within: Duration) -> Option<SseEvent> {
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

    /// Reads until an event satisfies `pred`.
    async fn until(&mut self, within: Duration, pred: impl Fn(&SseEvent) -> bool) -> Option<SseEvent> {
        let deadline = Instant::now() + within;
        loop {
            let ev = self.next(deadline.saturating_duration_since(Instant::now())).await?;
            if pred(&ev) {
                return Some(ev);
            }
        }
    }

    /// The `accepted` event (the first one); panics if it does not come.
    async fn accepted(&mut self) -> Accepted {
        let ev = self.next(WAIT).await.expect("accepted event");
        assert_eq!((ev.id, ev.event.as_str()), (1, "accepted"), "{ev:?}");
        let s = |k: &str| ev.data[k].as_str().unwrap_or_else(|| panic!("accepted lacks {k}: {ev:?}")).to_owned();
        Accepted { run_id: s("runId"), session_key: s("sessionKey"), gateway_run_id: s("gatewayRunId") }
    }

    async fn terminal(&mut self, within: Duration) -> Option<SseEvent> {
        self.until(within, |e| e.event == "final" || e.event == "error").await
    }

    /// Reads to the end of the stream; true if the server closed it within `within`.
    async fn read_to_end(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while self.next(deadline.saturating_duration_since(Instant::now())).await.is_some() {}
        self.ended
    }

    fn all(&self) -> Vec<&SseEvent> {
        self.events.iter().collect()
    }

    /// The `text_delta` texts, in order.
    fn deltas(&self) -> Vec<String> {
        self.all().iter().filter(|e| e.event == "text_delta").map(|e| e.data["text"].as_str().unwrap_or_default().to_owned()).collect()
    }

    fn text(&self) -> String {
        self.deltas().concat()
    }
}

/// What `accepted` says.
#[derive(Debug, Clone)]
struct Accepted {
    run_id: String,
    session_key: String,
    gateway_run_id: String,
}

/// The contract every finished stream keeps: ids 1..=n, `accepted` first, exactly one terminal
/// event and it is the last one.
fn assert_stream_shape(sse: &Sse, what: &str) {
    let events = sse.all();
    assert!(!events.is_empty(), "{what}: no events");
    let ids: Vec<u64> = events.iter().map(|e| e.id).collect();
    assert_eq!(ids, (1..=events.len() as u64).collect::<Vec<_>>(), "{what}: ids");
    assert_eq!(events[0].event, "accepted", "{what}");
    let terminals = events.iter().filter(|e| e.event == "final" || e.event == "error").count();
    assert_eq!(terminals, 1, "{what}: {events:?}");
    let last = events.last().unwrap();
    assert!(last.event == "final" || last.event == "error", "{what}: the terminal event is not last: {events:?}");
}

// ------------------------------------------------------------------------------------------------
// 1. Isolation of hundreds of concurrent runs
// ------------------------------------------------------------------------------------------------

/// Markers `<a0001>` / `<b0001>` found in `s`.
fn markers_in(s: &str) -> Vec<&str> {
    let b = s.as_bytes();
    (0..b.len().saturating_sub(6))
        .filter(|&i| b[i] == b'<' && matches!(b[i + 1], b'a' | b'b') && b[i + 2..i + 6].iter().all(u8::is_ascii_digit) && b[i + 6] == b'>')
        .map(|i| &s[i..i + 7])
        .collect()
}

struct IsoResult {
    marker: String,
    run_id: String,
    account: String,
    sse: Sse,
}

/// `A_RUNS` runs through clawmux A and, at the same time, `B_RUNS` through a second clawmux B on the
/// same gateway (another tenant's client). Every run must get only its own text.
async fn isolation(scoped: bool) {
    const A_RUNS: usize = 300;
    const B_RUNS: usize = 30;
    let gw = gateway(fast().session_scoped_events(scoped));
    let a = start_clawmux(&gw.url(), Some(GW_TOKEN), |_| {}).await;
    let b = start_clawmux(&gw.url(), Some(GW_TOKEN), |_| {}).await;
    let (base_a, base_b) = (base(&a), base(&b));
    let c = http();
    wait_ready(&c, &base_a, WAIT).await;
    wait_ready(&c, &base_b, WAIT).await;
    let ready: Value = c.get(format!("{base_a}/readyz")).send().await.unwrap().json().await.unwrap();
    assert_eq!(ready["sessionScopedEvents"], scoped, "{ready}");

    let tag = unique("iso");
    let mut tasks = Vec::new();
    for (side, n, base) in [("a", A_RUNS, &base_a), ("b", B_RUNS, &base_b)] {
        for i in 0..n {
            let marker = format!("<{side}{i:04}>");
            let run_id = format!("{tag}-{side}{i}");
            let account = format!("acct-{side}-{i}");
            let body = json!({"message": format!("{marker} isolation\nsecond line"), "billingAccountId": account, "runId": run_id});
            let (c, base) = (c.clone(), base.clone());
            tasks.push(tokio::spawn(async move {
                let resp = post_sse(&c, &base, &body, &[]).await;
                assert_eq!(resp.status(), 200, "{run_id}");
                let mut sse = Sse::new(resp);
                assert!(sse.read_to_end(Duration::from_secs(60)).await, "{run_id}: the stream did not close");
                IsoResult { marker, run_id, account, sse }
            }));
        }
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.expect("run task"));
    }

    let mut gateway_ids = HashMap::new();
    for r in &results {
        let what = &r.run_id;
        assert_stream_shape(&r.sse, what);
        let events = r.sse.all();
        let session_key = format!("agent:main:clawmux:{}.r.{}", r.account, r.run_id);
        assert_eq!(events[0].data["runId"], r.run_id.as_str(), "{what}");
        assert_eq!(events[0].data["sessionKey"], session_key.as_str(), "{what}");
        let gid = events[0].data["gatewayRunId"].as_str().unwrap().to_owned();
        let fin = events.last().unwrap();
        assert_eq!(fin.event, "final", "{what}: {fin:?}");
        assert_eq!(fin.data["status"], "ok", "{what}");
        assert_eq!(fin.data["sessionKey"], session_key.as_str(), "{what}");
        let content = fin.data["content"].as_str().unwrap();
        let expected_start = format!("{} isolation | Hello from the fake LLM (req ", r.marker);
        assert!(content.starts_with(&expected_start), "{what}: {content:?}");
        assert_eq!(r.sse.text(), content, "{what}: the deltas do not add up to the content");
        for e in &events {
            for m in markers_in(&e.data.to_string()) {
                assert_eq!(m, r.marker, "{what} received text of another run: {e:?}");
            }
        }
        gateway_ids.insert(gid, (session_key, r.marker.clone(), r.run_id.starts_with(&format!("{tag}-a"))));
    }

    // The gateway ran each run once, on the session key clawmux derived, over ONE connection per
    // clawmux.
    let records = gw.runs();
    assert_eq!(records.len(), A_RUNS + B_RUNS);
    let mut conns: HashMap<bool, std::collections::HashSet<String>> = HashMap::new();
    for rec in &records {
        let (session_key, marker, is_a) = gateway_ids.get(&rec.run_id).unwrap_or_else(|| panic!("unknown gateway run {}", rec.run_id));
        assert_eq!(&rec.session_key, session_key);
        assert!(rec.message.starts_with(marker.as_str()));
        assert_eq!(rec.status, RunStatus::Ok);
        conns.entry(*is_a).or_default().insert(rec.conn_id.clone());
    }
    assert_eq!(conns[&true].len(), 1, "clawmux A used more than one connection");
    assert_eq!(conns[&false].len(), 1, "clawmux B used more than one connection");
    let conn_a = conns[&true].iter().next().unwrap().clone();
    let conn_b = conns[&false].iter().next().unwrap().clone();
    assert_ne!(conn_a, conn_b);

    // What the gateway really sent each clawmux: with session-scoped events only its own runs'
    // frames; in broadcast mode every run's frames, so isolation held by clawmux's routing alone.
    let (chat, agent) = events_per_run();
    let (want_a, want_b) = if scoped { (A_RUNS as u64, B_RUNS as u64) } else { ((A_RUNS + B_RUNS) as u64, (A_RUNS + B_RUNS) as u64) };
    let gw_ref = &gw;
    let sent = |conn: String| async move {
        let stats = gw_ref.stats();
        let c = stats.connection(&conn).unwrap().clone();
        (c.events_sent.get("chat").copied().unwrap_or(0), c.events_sent.get("agent").copied().unwrap_or(0), c.session_scoped)
    };
    eventually(WAIT, "every frame counted by the gateway", || {
        let (ca, cb) = (conn_a.clone(), conn_b.clone());
        async move { sent(ca).await == (want_a * chat, want_a * agent, scoped) && sent(cb).await == (want_b * chat, want_b * agent, scoped) }
    })
    .await;

    // Everything clawmux received but did not own was dropped as another tenant's session, and
    // nothing else was dropped or malformed.
    let dropped = |base: String, reason: &'static str| {
        let c = c.clone();
        async move { metric(&c, &base, &format!("clawmux_gateway_frames_dropped_total{{reason=\"{reason}\"}}")).await }
    };
    let foreign_a = (if scoped { 0 } else { B_RUNS as u64 * (chat + agent) }) as f64;
    let foreign_b = (if scoped { 0 } else { A_RUNS as u64 * (chat + agent) }) as f64;
    eventually(WAIT, "foreign frames counted", || {
        let (ba, bb) = (base_a.clone(), base_b.clone());
        let dropped = &dropped;
        async move { dropped(ba, "foreign_session").await == foreign_a && dropped(bb, "foreign_session").await == foreign_b }
    })
    .await;
    for base in [&base_a, &base_b] {
        for reason in ["missing_session_key", "missing_run_id", "foreign_run"] {
            assert_eq!(dropped(base.clone(), reason).await, 0.0, "{base} {reason}");
        }
        assert_eq!(metric(&c, base, "clawmux_gateway_frames_malformed_total").await, 0.0);
        let finished = (if *base == base_a { A_RUNS } else { B_RUNS }) as f64;
        assert_eq!(metric(&c, base, "clawmux_runs_finished_total{status=\"ok\"}").await, finished);
    }
    server::shutdown(&a).await;
    server::shutdown(&b).await;
    gw.stop().await;
}

#[test]
fn the_rfc3339_check_is_strict() {
    assert_eq!(rfc3339_nanos("1970-01-01T00:00:00Z"), Some(0));
    assert_eq!(rfc3339_nanos("1970-01-01T01:00:00.5+01:00"), Some(500_000_000));
    assert_eq!(rfc3339_nanos("2000-03-01T00:00:00Z"), Some(951_868_800 * 1_000_000_000));
    for bad in ["", "2026-11-21", "2026-11-21 05:09:25Z", "2026-13-01T00:00:00Z", "2026-11-21T05:09:25", "2026-11-21T05:09:25.Z", "yesterday"] {
        assert_eq!(rfc3339_nanos(bad), None, "{bad}");
    }
}

#[actix_rt::test]
async fn isolation_of_300_concurrent_runs_with_session_scoped_events() {
    isolation(true).await;
}

#[actix_rt::test]
async fn isolation_of_300_concurrent_runs_with_broadcast_events() {
    isolation(false).await;
}

// Minimal raw gateway client, for the replay knob itself.
type Ws = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn ws_next(ws: &mut Ws) -> Value {
    loop {
        match tokio::time::timeout(WAIT, ws.next()).await.expect("a frame within the bound") {
            Some(Ok(tokio_tungstenite::tungstenite::Message::Text(t))) => return serde_json::from_str(t.as_str()).unwrap(),
            Some(Ok(_)) => {}
            other => panic!("connection ended: {other:?}"),
        }
    }
}

async fn ws_call(ws: &mut Ws, id: &str, method: &str, params: Value, frames: &mut Vec<Value>) -> Value {
    let req = json!({"type": "req", "id": id, "method": method, "params": params});
    ws.send(tokio_tungstenite::tungstenite::Message::text(req.to_string())).await.unwrap();
    loop {
        let f = ws_next(ws).await;
        if f["type"] == "res" && f["id"] == id {
            return f;
        }
        frames.push(f);
    }
}

#[actix_rt::test]
async fn replay_gateway_without_session_scoped_events_offers_no_subscription_and_broadcasts() {
    for scoped in [true, false] {
        let gw = gateway(fast().session_scoped_events(scoped));
        let (mut ws, _) = tokio_tungstenite::connect_async(gw.url()).await.unwrap();
        assert_eq!(ws_next(&mut ws).await["event"], "connect.challenge");
        let mut frames = Vec::new();
        let connect = json!({
            "minProtocol": 3, "maxProtocol": 4,
            "client": {"id": "gateway-client", "version": "1.0.0", "platform": "linux", "mode": "backend"},
            "role": "operator", "scopes": ["operator.read", "operator.write"], "caps": ["session-scoped-events"],
            "auth": {"token": GW_TOKEN},
        });
        let hello = ws_call(&mut ws, "c", "connect", connect, &mut frames).await;
        let methods: Vec<&str> = hello["payload"]["features"]["methods"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
        assert!(methods.contains(&"agent") && methods.contains(&"agent.wait"), "{methods:?}");
        for m in ["sessions.messages.subscribe", "sessions.messages.unsubscribe"] {
            assert_eq!(methods.contains(&m), scoped, "{m} offered: {methods:?}");
            let res = ws_call(&mut ws, m, m, json!({"key": "agent:main:a:b"}), &mut frames).await;
            if scoped {
                assert_eq!(res["ok"], true, "{res}");
            } else {
                assert_eq!(res["ok"], false, "{res}");
                assert_eq!(res["error"]["code"], "INVALID_REQUEST");
                assert_eq!(res["error"]["message"], format!("unknown method: {m}"));
            }
        }
        // The connection asked for the cap and subscribed to nothing: a gateway with the feature
        // sends it none of its own run's events, one without it sends them all.
        let params = json!({"message": "knob", "agentId": "main", "sessionKey": "agent:main:knob:1", "idempotencyKey": unique("knob")});
        let ack = ws_call(&mut ws, "run", "agent", params, &mut frames).await;
        assert_eq!(ack["payload"]["status"], "accepted");
        loop {
            let f = ws_next(&mut ws).await;
            if f["type"] == "res" && f["id"] == "run" {
                break;
            }
            frames.push(f);
        }
        let chats = frames.iter().filter(|f| f["event"] == "chat").count() as u64;
        assert_eq!(chats, if scoped { 0 } else { events_per_run().0 }, "scoped={scoped}");
        assert_eq!(gw.stats().connections[0].session_scoped, scoped);
        gw.stop().await;
    }
}

// ------------------------------------------------------------------------------------------------
// 2. Fail-closed routing
// ------------------------------------------------------------------------------------------------

#[actix_rt::test]
async fn foreign_and_malformed_frames_never_reach_a_run_and_are_counted() {
    let env = env(fast()).await;
    env.gw.set_paused(true);
    let m1 = unique("<route-one>");
    let m2 = unique("<route-two>");
    let mut one = env.sse(&body(&m1, "acct-route-1")).await;
    let mut two = env.sse(&body(&m2, "acct-route-2")).await;
    let r1 = one.accepted().await;
    let r2 = two.accepted().await;
    let (s1, g1, s2) = (r1.session_key.as_str(), r1.gateway_run_id.as_str(), r2.session_key.as_str());

    let mut expected: HashMap<&str, f64> = HashMap::new();
    let mut inject = |reason: &'static str, session: Option<&str>, run: Option<&str>| {
        let text = format!("LEAK-{reason}-{}", expected.get(reason).copied().unwrap_or(0.0));
        assert_eq!(env.gw.broadcast_raw(&chat_frame(session, run, "delta", &text)), 1);
        assert_eq!(env.gw.broadcast_raw(&agent_frame(session, run, &text)), 1);
        *expected.entry(reason).or_default() += 2.0;
    };
    inject("missing_session_key", None, Some(g1));
    inject("missing_session_key", Some(""), Some(g1));
    inject("missing_run_id", Some(s1), None);
    inject("foreign_session", Some("agent:main:intruder:x"), Some("intruder-run"));
    inject("foreign_session", Some("agent:main:intruder:x"), Some(g1)); // our run id, another session
    inject("foreign_session", Some(&s1.to_uppercase()), Some(g1)); // keys are compared canonical
    inject("foreign_run", Some(s1), Some("not-a-run-of-ours")); // our session, another run id
    inject("foreign_run", Some(s2), Some(g1)); // run one's id on run two's session
    // Malformed known frames are counted; an unknown event name is ignored, not malformed.
    let malformed = [
        r#"{"type":"event","event":"chat","payload":{"runId":"RID","sessionKey":"SK","state":"sideways","message":{"content":[{"type":"text","text":"LEAK-malformed"}]}}}"#
            .replace("RID", g1)
            .replace("SK", s1),
        r#"{"type":"event","event":"agent","payload":{"runId":"RID","sessionKey":"SK","data":{"text":"LEAK-malformed-agent"}}}"#
            .replace("RID", g1)
            .replace("SK", s1),
        "LEAK-not-json".to_owned(),
    ];
    for f in &malformed {
        env.gw.broadcast_raw(f);
    }
    let unknown = r#"{"type":"event","event":"presence.custom","payload":{"runId":"RID","sessionKey":"SK","text":"LEAK-unknown"}}"#
        .replace("RID", g1)
        .replace("SK", s1);
    env.gw.broadcast_raw(&unknown);
    // A correctly addressed frame after all of them: once it arrives, everything before it was
    // routed (one connection, one supervisor mailbox, in order).
    let echo = format!("{m1} [track:short] | ");
    env.gw.broadcast_raw(&chat_frame(Some(s1), Some(g1), "delta", &format!("{echo}Hel")));
    let sentinel = one.until(WAIT, |e| e.event == "text_delta").await.expect("the correctly routed frame");
    assert_eq!(sentinel.data["text"], format!("{echo}Hel"));
    assert_eq!(one.all().len(), 2, "only accepted and the routed delta: {:?}", one.all());
    assert!(two.next(Duration::from_millis(200)).await.is_none(), "run two got an event: {:?}", two.all());

    for (reason, n) in &expected {
        let got = env.metric(&format!("clawmux_gateway_frames_dropped_total{{reason=\"{reason}\"}}")).await;
        assert_eq!(got, *n, "{reason}");
    }
    assert_eq!(env.metric("clawmux_gateway_frames_malformed_total").await, malformed.len() as f64);

    env.gw.set_paused(false);
    for (sse, marker, what) in [(&mut one, &m1, "one"), (&mut two, &m2, "two")] {
        let fin = sse.terminal(WAIT).await.expect("terminal");
        assert!(sse.read_to_end(WAIT).await);
        assert_stream_shape(sse, what);
        assert_eq!(fin.event, "final", "{what}: {fin:?}");
        assert_eq!(fin.data["content"], answer(marker));
        assert_eq!(sse.text(), answer(marker), "{what}");
        for e in sse.all() {
            assert!(!e.data.to_string().contains("LEAK"), "{what}: a foreign or malformed frame leaked: {e:?}");
        }
    }
    // Nothing leaked into the run documents either.
    for id in [&r1.run_id, &r2.run_id] {
        assert!(!env.doc(id).await.to_string().contains("LEAK"));
    }
}

// ------------------------------------------------------------------------------------------------
// 3. Delta edge cases
// ------------------------------------------------------------------------------------------------

#[actix_rt::test]
async fn delta_edge_cases_neither_lose_nor_repeat_text() {
    let env = env(fast()).await;

    // One turn: growth, a shrink (a stale coalesced frame), repeats; then the recorded stream and
    // the final answer: the deltas add up to the content exactly, each piece once.
    env.gw.set_paused(true);
    let m = unique("<delta-one>");
    let mut sse = env.sse(&body(&m, "acct-delta")).await;
    let acc = sse.accepted().await;
    let e = format!("{m} [track:short] | ");
    for text in ["Hel", "Hello from", "Hel", "Hello from", "Hello from", "", "Hello from the"] {
        env.gw.broadcast_raw(&chat_frame(Some(&acc.session_key), Some(&acc.gateway_run_id), "delta", &format!("{e}{text}")));
    }
    sse.until(WAIT, |ev| ev.event == "text_delta" && ev.data["text"] == " the").await.expect("injected deltas");
    env.gw.set_paused(false);
    let fin = sse.terminal(WAIT).await.expect("terminal");
    assert_eq!(fin.event, "final", "{fin:?}");
    assert_eq!(fin.data["content"], answer(&m));
    assert_eq!(sse.deltas(), [format!("{e}Hel"), "lo from".into(), " the".into(), " fake".into(), " LLM".into(), " (req 8).".into()]);
    assert_eq!(sse.text(), answer(&m));

    // New turns: longer and shorter than the previous one, each introduced by a blank line, with
    // repeats and shrinks inside; ended by an abort so that only the injected text counts.
    env.gw.set_paused(true);
    let m = unique("<delta-two>");
    let mut sse = env.sse(&body(&m, "acct-delta")).await;
    let acc = sse.accepted().await;
    let frames = [
        "Let me",
        "Let me check",
        "Let me check",
        "Done: all tests pass", // a new, longer turn
        "Done: all tests pass now",
        "Done: all",                // shrink
        "Ok",                       // a new, shorter turn
        "Ok",                       // repeat
        "O",                        // shrink
        "Ok!",
    ];
    for text in frames {
        env.gw.broadcast_raw(&chat_frame(Some(&acc.session_key), Some(&acc.gateway_run_id), "delta", text));
    }
    sse.until(WAIT, |ev| ev.event == "text_delta" && ev.data["text"] == "!").await.expect("injected deltas");
    let expected = ["Let me", " check", "\n\nDone: all tests pass", " now", "\n\nOk", "!"];
    assert_eq!(sse.deltas(), expected);
    let r = env.http.post(env.url(&format!("/v1/runs/{}/abort", acc.run_id))).send().await.unwrap();
    assert_eq!(r.status(), 202);
    let fin = sse.terminal(WAIT).await.expect("terminal");
    assert_eq!((fin.event.as_str(), fin.data["code"].as_str()), ("error", Some("aborted")), "{fin:?}");
    assert_eq!(sse.deltas(), expected, "nothing after the abort");
    let doc = env.doc(&acc.run_id).await;
    assert_eq!(doc["content"], expected.concat(), "the document keeps what was streamed");
    env.gw.set_paused(false);
}

// ------------------------------------------------------------------------------------------------
// 4.–6. Connection faults
// ------------------------------------------------------------------------------------------------

#[actix_rt::test]
async fn tick_loss_is_detected_after_two_intervals_and_clawmux_reconnects() {
    // Ticks every 500 ms (dead after 1 s without one): the replay gateway ticks from the test's
    // own thread, and a stall of that thread on a busy machine must not look like a lost tick
    // (at 100 ms, 200 ms of stall did).
    let env = env(fast().tick_interval_ms(500)).await;
    let tick_timeouts = "clawmux_gateway_disconnects_total{reason=\"tick_timeout\"}";
    // With ticks flowing the connection stays up.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    assert_eq!(env.metric(tick_timeouts).await, 0.0);
    assert_eq!(env.gw.stats().handshakes_ok, 1);

    env.gw.set_ticks(false);
    let silent = Instant::now();
    let e = &env;
    eventually(WAIT, "tick timeout", || async move { e.metric(tick_timeouts).await > 0.0 }).await;
    // The last tick came at most one interval (500 ms) before the silence; dead means two
    // intervals after it, so at least ~500 ms after the silence (250 ms of it left for a stall).
    assert!(silent.elapsed() >= Duration::from_millis(250), "declared dead after {:?}", silent.elapsed());
    env.gw.set_ticks(true);
    eventually(WAIT, "reconnected", || async move { e.gw.stats().handshakes_ok >= 2 }).await;
    wait_ready(&env.http, &env.base, WAIT).await;

    let m = unique("<after-ticks>");
    let (status, doc) = post_json(&env.http, &env.base, &body(&m, "acct-tick")).await;
    assert_eq!((status, doc["status"].as_str()), (200, Some("ok")), "{doc}");
    assert_eq!(doc["content"], answer(&m));
}

/// Polls `/readyz` every few ms until it is 200 again after having been 503; returns when it went
/// down and when it came back (relative to `since`).
async fn watch_readyz_outage(env: &Env, since: Instant) -> (Duration, Duration) {
    let deadline = Instant::now() + WAIT;
    let mut down = None;
    loop {
        let (status, body) = env.readyz().await;
        match (status, down) {
            (503, None) => {
                assert_eq!(body["gateway"], "disconnected", "{body}");
                down = Some(since.elapsed());
            }
            (200, Some(d)) => return (d, since.elapsed()),
            (200 | 503, _) => {}
            (other, _) => panic!("/readyz answered {other}"),
        }
        assert!(Instant::now() < deadline, "/readyz did not go down and come back (down: {down:?})");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[actix_rt::test]
async fn gateway_shutdown_is_followed_by_a_reconnect_after_the_announced_delay() {
    // Reconnect delays up to 5 s here (the tests' 500 ms elsewhere): the announced delay is a hint
    // within that range.
    let env = env_with(fast(), |_| {}, |sup| {
        sup.backoff = clawmux_actors::backoff::Backoff::new(Duration::from_millis(50), Duration::from_secs(5), 2.0, 0.5).expect("backoff");
    })
    .await;
    env.gw.set_paused(true);
    let m = unique("<across-shutdown>");
    let mut sse = env.sse(&body(&m, "acct-shutdown")).await;
    let acc = sse.accepted().await;

    let t0 = Instant::now();
    // 1.5 s: long enough that a stall of this test's thread (the replay gateway's too) neither
    // hides the outage from /readyz nor makes "down at once" look late.
    env.gw.send_shutdown(Some(1500));
    let (down, up) = watch_readyz_outage(&env, t0).await;
    assert!(down < Duration::from_millis(1500), "went down only after {down:?}");
    assert!(up >= Duration::from_millis(1490), "reconnected after {up:?}, before the announced 1.5 s");
    assert_eq!(env.metric("clawmux_gateway_disconnects_total{reason=\"shutdown\"}").await, 1.0);
    assert_eq!(env.gw.stats().handshakes_ok, 2);

    // The run in flight across it never hangs. The contract allows `final` (recovered) or
    // `gateway_disconnected`; this gateway process kept the run (same boot id), so it must recover,
    // with all its text (its events come after the re-subscription).
    env.gw.set_paused(false);
    let fin = sse.terminal(WAIT).await.expect("the run in flight ended");
    assert!(sse.read_to_end(WAIT).await);
    assert_stream_shape(&sse, "across shutdown");
    assert_eq!(fin.event, "final", "the gateway kept the run, so it must recover: {fin:?}");
    assert_eq!(fin.data["content"], answer(&m));
    assert_eq!(sse.text(), answer(&m));
    assert_eq!(env.gw_run(&acc.gateway_run_id).status, RunStatus::Ok);

    let m = unique("<after-shutdown>");
    let (status, doc) = post_json(&env.http, &env.base, &body(&m, "acct-shutdown")).await;
    assert_eq!((status, doc["content"].as_str()), (200, Some(answer(&m).as_str())), "{doc}");
}

/// A clawmux dropped without `shutdown` (what every test does at its end) leaves no supervisor
/// behind: one that outlived its `Running` went on reconnecting to its gateway's address, so a later
/// test's gateway that got the same port counted its handshakes too (a CI failure of the test
/// above: 4 handshakes where 2 were expected).
#[actix_rt::test]
async fn a_dropped_clawmux_stops_connecting_to_its_gateway() {
    let env = env(fast()).await;
    assert_eq!(env.gw.stats().handshakes_ok, 1);
    let Env { gw, app, .. } = env;
    drop(app);
    // A supervisor still alive reconnects within its 500 ms backoff of losing the connection.
    gw.drop_connections(false);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(gw.stats().handshakes_ok, 1, "something reconnected after its clawmux was dropped");
}

#[actix_rt::test]
async fn a_dropped_connection_is_recovered_with_agent_wait() {
    let env = env(fast()).await;
    env.gw.set_paused(true);
    let m = unique("<recovered>");
    let mut sse = env.sse(&body(&m, "acct-drop")).await;
    let acc = sse.accepted().await;

    // The first reconnect is refused ("gateway starting", retry after 500 ms), so the outage is
    // long enough to see on /readyz. The run finishes on the gateway while clawmux is away: its
    // events are lost, only agent.wait can tell clawmux how it ended.
    env.gw.set_unavailable_connects(1);
    let t0 = Instant::now();
    env.gw.drop_connections(false);
    env.gw.set_paused(false);
    let (down, up) = watch_readyz_outage(&env, t0).await;
    assert!(down < up);
    assert!(env.metric("clawmux_gateway_disconnects_total{reason=\"closed\"}").await >= 1.0);

    let fin = sse.terminal(WAIT).await.expect("terminal");
    assert!(sse.read_to_end(WAIT).await);
    assert_stream_shape(&sse, "recovered run");
    assert_eq!(fin.event, "final", "{fin:?}");
    assert_eq!(fin.data["status"], "ok");
    assert_eq!(fin.data["content"], answer(&m), "the recovered run must report the gateway's answer");
    assert_eq!(sse.text(), answer(&m), "the deltas must add up to the content");
    assert_eq!(env.gw_run(&acc.gateway_run_id).status, RunStatus::Ok);
    assert!(up < WAIT);

    let m = unique("<after-drop>");
    let (status, doc) = post_json(&env.http, &env.base, &body(&m, "acct-drop")).await;
    assert_eq!((status, doc["content"].as_str()), (200, Some(answer(&m).as_str())), "{doc}");
}

/// clawmux offers exactly protocol 4 (as the official client package says general clients must)
/// and offers 3 only after a gateway refused 4 with a protocol mismatch; it keeps offering 3 to
/// that gateway on reconnects.
#[actix_rt::test]
async fn protocol_4_is_offered_first_and_3_only_after_a_mismatch() {
    for protocol in [4, 3] {
        let env = env(fast().protocol(protocol)).await;
        let m = unique("<protocol>");
        let (status, doc) = post_json(&env.http, &env.base, &body(&m, "acct-protocol")).await;
        assert_eq!((status, doc["content"].as_str()), (200, Some(answer(&m).as_str())), "protocol {protocol}: {doc}");
        let refused = if protocol == 4 { 0 } else { 1 };
        let stats = env.gw.stats();
        assert_eq!((stats.handshakes_failed, stats.handshakes_ok), (refused, 1), "protocol {protocol}");
        // A reconnect to the same gateway offers what it speaks at once.
        env.gw.drop_connections(false);
        let deadline = Instant::now() + WAIT;
        while env.gw.stats().handshakes_ok < 2 {
            assert!(Instant::now() < deadline, "protocol {protocol}: no reconnect");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(env.gw.stats().handshakes_failed, refused, "protocol {protocol}: the reconnect offered the right protocol");
    }
}

#[actix_rt::test]
async fn a_restarted_gateway_ends_runs_in_flight_with_gateway_disconnected_promptly() {
    restarted_gateway_ends_runs_promptly(fast()).await;
}

/// Protocol 3 reports no boot id: clawmux tells the restart by `snapshot.uptimeMs`. Before that,
/// the runs waited in `agent.wait` for their whole timeout on a process that never knew them (the
/// real 2026.4.12 gateway's "run hangs after the restart").
#[actix_rt::test]
async fn a_restarted_protocol_3_gateway_ends_runs_in_flight_with_gateway_disconnected_promptly() {
    restarted_gateway_ends_runs_promptly(fast().protocol(3)).await;
}

async fn restarted_gateway_ends_runs_promptly(cfg: ReplayConfig) {
    let env = env(cfg).await;
    // A real gateway takes seconds to start again; its uptime must have moved past the tolerance
    // of the start-time estimate before the simulated restart resets it.
    let up = clawmux_actors::instance::START_TOLERANCE_MS + 500;
    tokio::time::sleep(Duration::from_millis(up)).await;
    env.gw.set_paused(true);
    let mut runs = Vec::new();
    for i in 0..3 {
        let mut sse = env.sse(&body(&unique(&format!("<restart-{i}>")), &format!("acct-restart-{i}"))).await;
        let acc = sse.accepted().await;
        runs.push((sse, acc));
    }
    let t0 = Instant::now();
    env.gw.drop_connections(true);
    for (sse, acc) in &mut runs {
        let fin = sse.terminal(WAIT).await.expect("terminal");
        assert_eq!((fin.event.as_str(), fin.data["code"].as_str()), ("error", Some("gateway_disconnected")), "{fin:?}");
        assert!(sse.read_to_end(WAIT).await);
        assert_stream_shape(sse, "restart");
        assert_eq!(env.doc(&acc.run_id).await["status"], "error");
        assert_eq!(env.gw_run(&acc.gateway_run_id).status, RunStatus::Forgotten);
    }
    // Promptly: on the new boot id, not after the 30 s recovery window.
    assert!(t0.elapsed() < Duration::from_secs(3), "took {:?}", t0.elapsed());

    env.gw.set_paused(false);
    let m = unique("<after-restart>");
    let (status, doc) = post_json(&env.http, &env.base, &body(&m, "acct-restart")).await;
    assert_eq!((status, doc["content"].as_str()), (200, Some(answer(&m).as_str())), "{doc}");
}

#[actix_rt::test]
async fn a_gateway_still_starting_is_retried_until_ready() {
    let gw = gateway(fast());
    gw.set_unavailable_connects(2);
    let app = start_clawmux(&gw.url(), Some(GW_TOKEN), |_| {}).await;
    let env = Env { base: base(&app), app, gw, http: http() };
    let (status, body503) = env.readyz().await;
    assert_eq!(status, 503, "{body503}");
    assert_eq!(body503["error"]["code"], "gateway_unavailable");
    wait_ready(&env.http, &env.base, WAIT).await;
    let stats = env.gw.stats();
    assert_eq!((stats.handshakes_failed, stats.handshakes_ok), (2, 1));
    assert_eq!(env.metric("clawmux_gateway_connects_total{outcome=\"failed\"}").await, 2.0);
    let m = unique("<after-start>");
    let (status, doc) = post_json(&env.http, &env.base, &body(&m, "acct-start")).await;
    assert_eq!((status, doc["content"].as_str()), (200, Some(answer(&m).as_str())), "{doc}");
}

// ------------------------------------------------------------------------------------------------
// 7. Bad input
// ------------------------------------------------------------------------------------------------

#[actix_rt::test]
async fn every_bad_request_gets_its_status_and_code_and_a_streaming_run_is_undisturbed() {
    const MAX_MESSAGE: usize = 256;
    let env = env_with(fast(), |c| c.max_message_bytes = MAX_MESSAGE, |_| {}).await;
    env.gw.set_paused(true);
    let m = unique("<undisturbed>");
    let mut sse = env.sse(&body(&m, "acct-bad")).await;
    let acc = sse.accepted().await;

    let long = "a".repeat(129);
    let mut cases: Vec<(String, &str)> = vec![
        (r#"{"billingAccountId":"a"}"#.into(), "message"),
        (r#"{"message":"hi"}"#.into(), "billingAccountId"),
        (r#"{"message":5,"billingAccountId":"a"}"#.into(), "message"),
        (r#"{"message":"hi","billingAccountId":7}"#.into(), "billingAccountId"),
        (r#"{"message":["hi"],"billingAccountId":"a"}"#.into(), "message"),
        (r#"{"message":"hi","billingAccountId":"a","timeoutSec":"ten"}"#.into(), "timeoutSec"),
        (r#"{"message":"hi","billingAccountId":"a","timeoutSec":-1}"#.into(), "timeoutSec"),
        (r#"{"message":"hi","billingAccountId":"a","branch":"x"}"#.into(), "branch"),
        (r#"{"message":"hi","billingAccountId":"a","runId":null,"stateKey":5}"#.into(), "stateKey"),
        (r#"{"message":"","billingAccountId":"a"}"#.into(), "message"),
        (r#"{"message":"hi","billingAccountId":"a","mesage":"typo"}"#.into(), "mesage"),
        (r#"{"message":"hi","billingAccountId":"a","branch":{"branchName":"x","extra":1}}"#.into(), "extra"),
        (r#"{"message":"hi","billingAccountId":"a","timeoutSec":0}"#.into(), "timeoutSec"),
        (r#"{"message":"hi","billingAccountId":"a","timeoutSec":3601}"#.into(), "timeoutSec"),
        (r#"{"message":"hi","billingAccountId":"a","onDisconnect":"later"}"#.into(), "onDisconnect"),
        (r#"{"message":"hi","billingAccountId":"a","onDisconnect":"Abort"}"#.into(), "onDisconnect"),
        ("{not json".into(), "JSON"),
        ("".into(), "JSON"),
        ("[]".into(), "JSON"),
        ("null".into(), "JSON"),
        (r#"{"message":"hi","billingAccountId":"a"} trailing"#.into(), "JSON"),
    ];
    for (field, bad) in [
        ("billingAccountId", "a b"),
        ("billingAccountId", "a/b"),
        ("billingAccountId", "acct\u{e9}"),
        ("billingAccountId", ""),
        ("billingAccountId", long.as_str()),
        ("runId", "x/y"),
        ("runId", "../etc"),
        ("runId", long.as_str()),
        ("stateKey", "s k"),
        ("stateKey", "s\nk"),
        ("stateKey", long.as_str()),
        ("agentId", "ag$ent"),
        ("agentId", long.as_str()),
    ] {
        let mut b = json!({"message": "hi", "billingAccountId": "a"});
        b[field] = json!(bad);
        cases.push((b.to_string(), field));
    }
    let key_300 = "k".repeat(300);
    for key in ["../x", "-f", "a..b", "x.lock", "with space", key_300.as_str(), "main", "/abs", "a//b"] {
        cases.push((json!({"message": "hi", "billingAccountId": "a", "branch": {"branchName": key}}).to_string(), "branch.branchName"));
    }
    cases.push((json!({"message": "hi", "billingAccountId": "a", "branch": {"workItemId": "../x"}}).to_string(), "branch.workItemId"));
    cases.push((json!({"message": "hi", "billingAccountId": "a", "agentId": "ghost"}).to_string(), "agentId"));
    cases.push((json!({"message": "hi", "billingAccountId": "a", "graphId": "sandbox:ghost"}).to_string(), "sandbox:ghost"));

    for (i, (raw, field)) in cases.iter().enumerate() {
        // Half of them ask for SSE: the answer is the same JSON error.
        let mut req = env.http.post(env.url("/v1/runs")).header("content-type", "application/json").body(raw.clone());
        if i % 2 == 0 {
            req = req.header("accept", "text/event-stream");
        }
        let msg = expect_error(req.send().await.unwrap(), 400, "invalid_request", raw).await;
        assert!(msg.contains(field), "{raw}: the message {msg:?} does not name {field}");
    }

    // 413: a message over the limit, and a body far over the limit.
    let b = json!({"message": "x".repeat(MAX_MESSAGE + 1), "billingAccountId": "a"});
    let r = env.http.post(env.url("/v1/runs")).json(&b).send().await.unwrap();
    let msg = expect_error(r, 413, "payload_too_large", "oversize message").await;
    assert!(msg.contains("message"), "{msg}");
    let exact = json!({"message": "é".repeat(MAX_MESSAGE / 2), "billingAccountId": "a", "runId": unique("exact")});
    let huge = format!(r#"{{"message":"{}","billingAccountId":"a"}}"#, "x".repeat(2 * 1024 * 1024));
    let r = env.http.post(env.url("/v1/runs")).header("content-type", "application/json").body(huge).send().await.unwrap();
    expect_error(r, 413, "payload_too_large", "huge body").await;

    // Headers.
    for tp in ["00-xyz", "00-00000000000000000000000000000000-0000000000000000-01", "garbage", ""] {
        let r = env.http.post(env.url("/v1/runs")).header("traceparent", tp).json(&body("tp", "a")).send().await.unwrap();
        let msg = expect_error(r, 400, "invalid_request", tp).await;
        assert!(msg.contains("traceparent"), "{msg}");
    }
    for last in ["abc", "-1", "1.5"] {
        let r = env.http.get(env.url(&format!("/v1/runs/{}/events", acc.run_id))).header("last-event-id", last).send().await.unwrap();
        let msg = expect_error(r, 400, "invalid_request", last).await;
        assert!(msg.contains("Last-Event-ID"), "{msg}");
    }
    let r = env.http.post(env.url("/v1/runs?wait=maybe")).json(&body("w", "a")).send().await.unwrap();
    expect_error(r, 400, "invalid_request", "wait=maybe").await;

    // Unknown runs.
    for (method, path) in [("GET", "/v1/runs/no-such-run"), ("GET", "/v1/runs/no-such-run/events"), ("POST", "/v1/runs/no-such-run/abort")] {
        let r = env.http.request(method.parse().unwrap(), env.url(path)).send().await.unwrap();
        expect_error(r, 404, "not_found", path).await;
    }

    // None of it reached the store or the gateway, and the streaming run goes on untouched.
    assert_eq!(env.stored_runs().await, 1, "a refused request left a run behind");
    assert_eq!(env.gw.runs().len(), 1, "a refused request reached the gateway");
    assert_eq!(sse.all().len(), 1);
    env.gw.set_paused(false);
    let fin = sse.terminal(WAIT).await.expect("terminal");
    assert!(sse.read_to_end(WAIT).await);
    assert_stream_shape(&sse, "undisturbed");
    assert_eq!(fin.event, "final", "{fin:?}");
    assert_eq!(fin.data["content"], answer(&m));
    assert_eq!(sse.text(), answer(&m));

    // A message of exactly the limit (in bytes, multi-byte characters included) is accepted.
    let (status, doc) = post_json(&env.http, &env.base, &exact).await;
    assert_eq!((status, doc["status"].as_str()), (200, Some("ok")), "{doc}");
}

/// The message limit is on the message, not on its JSON: a message within it is accepted however
/// the client's encoder escapes it (`\u00e9` for `é`: three bytes of JSON per byte of message;
/// Python's `json.dumps` by default), and one byte over it is still refused.
#[actix_rt::test]
async fn a_message_within_the_limit_is_accepted_however_its_json_escapes_it() {
    const MAX_MESSAGE: usize = 128 * 1024;
    let env = env_with(fast(), |c| c.max_message_bytes = MAX_MESSAGE, |_| {}).await;
    let raw = |chars: usize, run: &str| format!(r#"{{"message":"{}","billingAccountId":"acct-esc","runId":"{run}"}}"#, "\\u00e9".repeat(chars));
    let post = |body: String| env.http.post(env.url("/v1/runs?wait=false")).header("content-type", "application/json").body(body).send();
    let r = post(raw(MAX_MESSAGE / 2, &unique("esc"))).await.unwrap();
    assert_eq!(r.status(), 202, "{:?}", r.text().await);
    let r = post(format!(r#"{{"message":"x{}","billingAccountId":"acct-esc"}}"#, "\\u00e9".repeat(MAX_MESSAGE / 2))).await.unwrap();
    let msg = expect_error(r, 413, "payload_too_large", "one byte over").await;
    assert!(msg.contains("message"), "{msg}");
}

/// Without an admin token a loopback client without credentials is the admin (a one-tenant
/// clawmux, as docs/API.md says), but not a request a proxy relayed (a reverse proxy on the same
/// host makes every caller look local), and not once an API key exists (clawmux then serves
/// several tenants: any local process, an agent with a shell among them, would be their admin).
/// A key works as before.
#[actix_rt::test]
async fn a_loopback_client_without_credentials_is_the_admin_only_while_no_key_exists() {
    let env = env(fast()).await;
    assert_eq!(env.http.get(env.url("/v1/runs")).send().await.unwrap().status(), 200, "loopback, no key: the admin");
    for (header, value) in [("x-forwarded-for", "203.0.113.7"), ("forwarded", "for=203.0.113.7"), ("x-real-ip", "203.0.113.7")] {
        let r = env.http.get(env.url("/v1/runs")).header(header, value).send().await.unwrap();
        expect_error(r, 401, "unauthorized", &format!("a request relayed with {header}")).await;
    }
    let r = env.http.post(env.url("/v1/admin/keys")).json(&json!({"name": "t", "accounts": ["acct-k"], "actions": ["read"]})).send().await.unwrap();
    assert_eq!(r.status(), 201);
    let key = r.json::<Value>().await.unwrap()["key"].as_str().unwrap().to_owned();
    for path in ["/v1/runs", "/v1/admin/keys", "/v1/agents"] {
        let r = env.http.get(env.url(path)).send().await.unwrap();
        let msg = expect_error(r, 401, "unauthorized", &format!("loopback without credentials once a key exists: {path}")).await;
        assert!(msg.contains("API keys exist"), "{msg}");
    }
    assert_eq!(env.http.get(env.url("/v1/runs")).bearer_auth(&key).send().await.unwrap().status(), 200, "the key works");
    assert_eq!(env.http.get(env.url("/healthz")).send().await.unwrap().status(), 200, "outside /v1 nothing changes");
}

#[actix_rt::test]
async fn a_configured_bearer_token_is_required_on_v1() {
    let env = env_with(fast(), |c| c.api_token = Some(Secret::new("api-s3cret")), |_| {}).await;
    let m = unique("<authed>");
    for (auth, what) in [(None, "missing"), (Some("Bearer nope"), "wrong"), (Some("api-s3cret"), "no scheme"), (Some("Basic api-s3cret"), "basic")] {
        for (method, path) in [("POST", "/v1/runs"), ("GET", "/v1/agents"), ("GET", "/v1/runs/x"), ("GET", "/v1/runs/x/events"), ("POST", "/v1/runs/x/abort")] {
            let mut req = env.http.request(method.parse().unwrap(), env.url(path)).json(&body(&m, "acct-auth"));
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            expect_error(req.send().await.unwrap(), 401, "unauthorized", &format!("{what} token on {method} {path}")).await;
        }
    }
    assert!(env.gw.runs().is_empty());
    let ok = |req: reqwest::RequestBuilder| req.header("authorization", "Bearer api-s3cret");
    let r = ok(env.http.post(env.url("/v1/runs"))).json(&body(&m, "acct-auth")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let doc: Value = r.json().await.unwrap();
    assert_eq!((doc["status"].as_str(), doc["content"].as_str()), (Some("ok"), Some(answer(&m).as_str())), "{doc}");
    let r = ok(env.http.get(env.url(&format!("/v1/runs/{}", doc["runId"].as_str().unwrap())))).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(ok(env.http.get(env.url("/v1/agents"))).send().await.unwrap().status(), 200);
    // The scheme is case-insensitive (RFC 7235): what curl users and many client libraries send.
    for scheme in ["bearer", "BEARER"] {
        let r = env.http.get(env.url("/v1/agents")).header("authorization", format!("{scheme} api-s3cret")).send().await.unwrap();
        assert_eq!(r.status(), 200, "{scheme}");
    }
    // Outside /v1 nothing needs the token.
    assert_eq!(env.http.get(env.url("/healthz")).send().await.unwrap().status(), 200);
    assert_eq!(env.http.get(env.url("/readyz")).send().await.unwrap().status(), 200);
}

#[actix_rt::test]
async fn run_id_reuse_and_idempotency_keys() {
    let env = env(fast()).await;
    let run_id = unique("reused");
    let mut b = body(&unique("<reuse>"), "acct-reuse");
    b["runId"] = json!(run_id);
    let (status, first) = post_json(&env.http, &env.base, &b).await;
    assert_eq!((status, first["status"].as_str()), (200, Some("ok")), "{first}");
    // Identical body (other field order and spacing): the same run, the same document.
    let same = format!(
        "{{ \"runId\": {}, \"billingAccountId\": \"acct-reuse\", \"message\": {} }}",
        json!(run_id),
        b["message"]
    );
    let r = env.http.post(env.url("/v1/runs")).header("content-type", "application/json").body(same).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap(), first);
    let mut other = b.clone();
    other["message"] = json!("something else");
    let r = env.http.post(env.url("/v1/runs")).json(&other).send().await.unwrap();
    expect_error(r, 409, "conflict", "reused runId, other body").await;
    let r = env.http.post(env.url("/v1/runs")).header("accept", "text/event-stream").json(&other).send().await.unwrap();
    expect_error(r, 409, "conflict", "reused runId, other body, SSE").await;
    assert_eq!(env.gw.runs().len(), 1, "a reused runId started another gateway run");

    // While a run is in flight, the identical body attaches to the same run and stream.
    env.gw.set_paused(true);
    let run_id = unique("reused-live");
    let mut b = body(&unique("<reuse-live>"), "acct-reuse");
    b["runId"] = json!(run_id);
    let mut one = env.sse(&b).await;
    let acc = one.accepted().await;
    let mut two = env.sse(&b).await;
    let again = two.accepted().await;
    assert_eq!(again.gateway_run_id, acc.gateway_run_id);
    let mut other = b.clone();
    other["timeoutSec"] = json!(30);
    let r = env.http.post(env.url("/v1/runs")).json(&other).send().await.unwrap();
    expect_error(r, 409, "conflict", "reused live runId, other body").await;
    env.gw.set_paused(false);
    for sse in [&mut one, &mut two] {
        assert_eq!(sse.terminal(WAIT).await.expect("terminal").event, "final");
    }
    assert_eq!(one.text(), two.text());
    assert_eq!(env.gw.runs().len(), 2, "an identical in-flight body started another gateway run");

    // Idempotency-Key: same key and body → the same run; same key, other body → 422; the same
    // key of another account → another run (a key is its account's own).
    let key = unique("idem");
    let b = body(&unique("<idem>"), "acct-idem");
    let post = |b: &Value| env.http.post(env.url("/v1/runs")).header("idempotency-key", key.as_str()).json(b).send();
    let r1 = post(&b).await.unwrap();
    assert_eq!(r1.status(), 200);
    let d1: Value = r1.json().await.unwrap();
    let r2 = post(&b).await.unwrap();
    assert_eq!(r2.status(), 200);
    let d2: Value = r2.json().await.unwrap();
    assert_eq!(d1, d2);
    let mut b2 = b.clone();
    b2["message"] = json!(unique("<idem-other>"));
    expect_error(post(&b2).await.unwrap(), 422, "idempotency_mismatch", "same key, other body").await;
    assert_eq!(env.gw.runs().len(), 3);
    let mut b3 = b.clone();
    b3["billingAccountId"] = json!("acct-other");
    let r3 = post(&b3).await.unwrap();
    assert_eq!(r3.status(), 200, "same key, another account");
    let d3: Value = r3.json().await.unwrap();
    assert_ne!(d3["runId"], d1["runId"], "another account's equal key found the first account's run");
    assert_eq!(d3["billingAccountId"], "acct-other");
    assert_eq!(env.gw.runs().len(), 4);
}

#[actix_rt::test]
async fn a_gateway_that_is_down_is_503_with_retry_after() {
    let env = env(fast()).await;
    env.gw.stop().await;
    let e = &env;
    eventually(WAIT, "readyz 503", || async move { e.readyz().await.0 == 503 }).await;
    for sse in [false, true] {
        let mut req = env.http.post(env.url("/v1/runs")).json(&body("<down>", "acct-down"));
        if sse {
            req = req.header("accept", "text/event-stream");
        }
        let r = req.send().await.unwrap();
        let retry = r.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
        assert!(retry.is_some_and(|s| s >= 1), "Retry-After: {:?}", r.headers().get("retry-after"));
        expect_error(r, 503, "gateway_unavailable", "gateway down").await;
    }
    // The refused run is forgotten: it can be retried with the same id later.
    assert_eq!(env.stored_runs().await, 0);
}

#[actix_rt::test]
async fn runs_over_the_configured_capacity_are_503_with_retry_after() {
    let env = env_with(fast(), |c| c.max_runs = 2, |_| {}).await;
    env.gw.set_paused(true);
    let mut held = Vec::new();
    for i in 0..2 {
        let mut sse = env.sse(&body(&unique(&format!("<cap-{i}>")), &format!("acct-cap-{i}"))).await;
        sse.accepted().await;
        held.push(sse);
    }
    let r = env.http.post(env.url("/v1/runs")).json(&body("<cap-over>", "acct-cap-over")).send().await.unwrap();
    assert!(r.headers().get("retry-after").is_some(), "{:?}", r.headers());
    expect_error(r, 503, "gateway_unavailable", "over capacity").await;
    assert_eq!(env.gw.runs().len(), 2);
    env.gw.set_paused(false);
    for sse in &mut held {
        assert_eq!(sse.terminal(WAIT).await.expect("terminal").event, "final");
    }
    // Capacity is free again.
    let m = unique("<cap-after>");
    let (status, doc) = post_json(&env.http, &env.base, &body(&m, "acct-cap")).await;
    assert_eq!((status, doc["content"].as_str()), (200, Some(answer(&m).as_str())), "{doc}");
}

// ------------------------------------------------------------------------------------------------
// 8. API behaviours
// ------------------------------------------------------------------------------------------------

#[actix_rt::test]
async fn wait_false_answers_202_and_json_waits_for_the_document() {
    let env = env(fast()).await;
    env.gw.set_paused(true);
    let m = unique("<later>");
    let r = env.http.post(env.url("/v1/runs?wait=false")).json(&body(&m, "acct-doc")).send().await.unwrap();
    assert_eq!(r.status(), 202);
    let doc: Value = r.json().await.unwrap();
    assert_eq!(doc["status"], "running", "{doc}");
    assert!(is_rfc3339(&doc["createdAt"]), "{doc}");
    assert!(doc["finishedAt"].is_null(), "{doc}");
    let run_id = doc["runId"].as_str().unwrap().to_owned();
    assert_eq!(uuid::Uuid::parse_str(&run_id).map(|u| u.get_version_num()).ok(), Some(4), "a default run id is a UUID v4");
    assert_eq!(run_id, run_id.to_lowercase());
    assert_eq!(doc["sessionKey"], format!("agent:main:clawmux:acct-doc.r.{run_id}"));
    env.gw.set_paused(false);
    let e = &env;
    let id = &run_id;
    eventually(WAIT, "run finished", || async move { e.doc(id).await["status"] == "ok" }).await;

    // JSON without wait: the final document at the end.
    let m2 = unique("<json>");
    let (status, doc) = post_json(&env.http, &env.base, &body(&m2, "Acct-Doc")).await;
    assert_eq!(status, 200);
    for (doc, marker) in [(env.doc(&run_id).await, &m), (doc, &m2)] {
        assert_eq!(doc["status"], "ok", "{doc}");
        // Upper case is escaped, never folded: "Acct-Doc" is another account than "acct-doc".
        let account = if doc["content"] == answer(&m) { "acct-doc" } else { "_acct-_doc" };
        assert_eq!(doc["sessionKey"], format!("agent:main:clawmux:{account}.r.{}", doc["runId"].as_str().unwrap()), "{doc}");
        assert_eq!(doc["content"], answer(marker));
        assert!(doc["gatewayRunId"].as_str().is_some_and(|g| !g.is_empty()), "{doc}");
        assert!(doc.get("error").is_none_or(Value::is_null), "{doc}");
        let usage = &doc["usage"];
        assert!(usage["inputTokens"].as_u64().is_some_and(|n| n > 0), "{doc}");
        assert!(usage["outputTokens"].as_u64().is_some_and(|n| n > 0), "{doc}");
        assert!(usage["llmCalls"].is_u64(), "{doc}");
        assert!(matches!(usage["source"].as_str(), Some("proxy" | "gateway")), "{doc}");
        assert!(is_rfc3339(&doc["createdAt"]) && is_rfc3339(&doc["finishedAt"]), "{doc}");
        let t = |k: &str| rfc3339_nanos(doc[k].as_str().unwrap()).unwrap();
        assert!(t("finishedAt") >= t("createdAt"), "{doc}");
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as i128;
        assert!((now - t("createdAt")).abs() < 60 * 1_000_000_000, "createdAt is not now: {doc}");
    }
}

#[actix_rt::test]
async fn last_event_id_replays_what_follows_then_continues_live() {
    let env = env(fast()).await;
    env.gw.set_paused(true);
    let m = unique("<resume>");
    let mut sse = env.sse(&body(&m, "acct-resume")).await;
    let acc = sse.accepted().await;
    let e = format!("{m} [track:short] | ");
    for t in ["Hel", "Hello"] {
        env.gw.broadcast_raw(&chat_frame(Some(&acc.session_key), Some(&acc.gateway_run_id), "delta", &format!("{e}{t}")));
    }
    sse.until(WAIT, |ev| ev.id == 3).await.expect("three events");

    // Re-attach after event 2 while the run is held: event 3 from the log, then live to the end.
    let events_url = env.url(&format!("/v1/runs/{}/events", acc.run_id));
    let r = env.http.get(&events_url).header("last-event-id", "2").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let mut again = Sse::new(r);
    let first = again.next(WAIT).await.expect("replayed event");
    assert_eq!((first.id, first.event.as_str(), first.data["text"].as_str()), (3, "text_delta", Some("lo")));
    assert!(again.next(Duration::from_millis(200)).await.is_none() && !again.ended, "nothing more until the run goes on");
    env.gw.set_paused(false);
    let fin = again.terminal(WAIT).await.expect("live terminal");
    assert_eq!(fin.event, "final");
    assert!(again.read_to_end(WAIT).await, "the re-attached stream closes after the terminal event");
    assert!(sse.read_to_end(WAIT).await);
    let ids: Vec<u64> = again.all().iter().map(|e| e.id).collect();
    let total = sse.all().len() as u64;
    assert_eq!(ids, (3..=total).collect::<Vec<_>>(), "exactly the events after 2, in order");
    let originals: Vec<(u64, String, Value)> = sse.all().iter().skip(2).map(|e| (e.id, e.event.clone(), e.data.clone())).collect();
    let resumed: Vec<(u64, String, Value)> = again.all().iter().map(|e| (e.id, e.event.clone(), e.data.clone())).collect();
    assert_eq!(resumed, originals, "the same events as the original stream");
    assert_eq!(sse.text(), answer(&m));

    // A finished run: replays and closes; with no Last-Event-ID from the start.
    for (last, from) in [(None, 1), (Some("4".to_owned()), 5), (Some(total.to_string()), total + 1)] {
        let mut req = env.http.get(&events_url);
        if let Some(l) = &last {
            req = req.header("last-event-id", l);
        }
        let mut replay = Sse::new(req.send().await.unwrap());
        assert!(replay.read_to_end(WAIT).await, "a finished run's stream closes");
        let ids: Vec<u64> = replay.all().iter().map(|e| e.id).collect();
        assert_eq!(ids, (from..=total).collect::<Vec<_>>(), "Last-Event-ID {last:?}");
    }
}

#[actix_rt::test]
async fn abort_ends_the_run_and_cancels_the_gateway_run() {
    let env = env(fast()).await;
    env.gw.set_paused(true);
    let m = unique("<abort>");
    let mut sse = env.sse(&body(&m, "acct-abort")).await;
    let acc = sse.accepted().await;
    let r = env.http.post(env.url(&format!("/v1/runs/{}/abort", acc.run_id))).send().await.unwrap();
    assert_eq!(r.status(), 202);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"runId": acc.run_id, "aborted": true}));
    let fin = sse.terminal(WAIT).await.expect("terminal");
    assert_eq!((fin.event.as_str(), fin.data["code"].as_str(), fin.data["runId"].as_str()), ("error", Some("aborted"), Some(acc.run_id.as_str())));
    assert!(sse.read_to_end(WAIT).await);
    assert_stream_shape(&sse, "aborted");
    let doc = env.doc(&acc.run_id).await;
    assert_eq!((doc["status"].as_str(), doc["error"]["code"].as_str()), (Some("aborted"), Some("aborted")), "{doc}");
    assert!(is_rfc3339(&doc["finishedAt"]));
    let rec = env.gw_run(&acc.gateway_run_id);
    assert!(rec.aborted, "the gateway run was not cancelled: {rec:?}");
    // Aborting a finished run is harmless.
    let r = env.http.post(env.url(&format!("/v1/runs/{}/abort", acc.run_id))).send().await.unwrap();
    assert_eq!(r.status(), 202);
    assert_eq!(r.json::<Value>().await.unwrap()["aborted"], false);
    env.gw.set_paused(false);
}

#[actix_rt::test]
async fn closing_the_stream_aborts_the_run_unless_on_disconnect_is_continue() {
    let env = env(fast()).await;
    env.gw.set_paused(true);
    let mut gone = env.sse(&body(&unique("<gone>"), "acct-gone")).await;
    let gone_acc = gone.accepted().await;
    let stays_marker = unique("<stays>");
    let mut b = body(&stays_marker, "acct-stays");
    b["onDisconnect"] = json!("continue");
    let mut stays = env.sse(&b).await;
    let stays_acc = stays.accepted().await;
    // A JSON caller waiting for the document goes away too.
    let json_m = unique("<json-gone>");
    // Its request is kept open (polled) until the run is on the gateway, however long that takes
    // on a busy machine, then dropped.
    let mut waiting = Box::pin(env.http.post(env.url("/v1/runs")).json(&body(&json_m, "acct-json-gone")).send());
    let started = Instant::now();
    let json_gid = loop {
        if let Some(r) = env.gw.runs().into_iter().find(|r| r.message.starts_with(&json_m)) {
            break r.run_id;
        }
        assert!(started.elapsed() < WAIT, "the JSON run did not start");
        tokio::select! {
            r = &mut waiting => panic!("a held run answered: {:?}", r.map(|r| r.status())),
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    };
    drop(waiting);
    drop(gone);
    drop(stays);

    let e = &env;
    let gid = gone_acc.gateway_run_id.clone();
    eventually(WAIT, "the abandoned run is cancelled on the gateway", || {
        let gid = gid.clone();
        async move { e.gw_run(&gid).aborted }
    })
    .await;
    eventually(WAIT, "the abandoned JSON run is cancelled on the gateway", || {
        let gid = json_gid.clone();
        async move { e.gw_run(&gid).aborted }
    })
    .await;
    let doc = env.doc(&gone_acc.run_id).await;
    assert_eq!((doc["status"].as_str(), doc["error"]["code"].as_str()), (Some("aborted"), Some("aborted")), "{doc}");
    // The other one goes on (it was closed at the same moment) and finishes.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!env.gw_run(&stays_acc.gateway_run_id).aborted);
    env.gw.set_paused(false);
    let id = stays_acc.run_id.clone();
    eventually(WAIT, "the continued run finishes", || {
        let id = id.clone();
        async move { e.doc(&id).await["status"] != "running" }
    })
    .await;
    let doc = env.doc(&stays_acc.run_id).await;
    assert_eq!((doc["status"].as_str(), doc["content"].as_str()), (Some("ok"), Some(answer(&stays_marker).as_str())), "{doc}");
    let rec = env.gw_run(&stays_acc.gateway_run_id);
    assert!(!rec.aborted && rec.status == RunStatus::Ok, "{rec:?}");
}

/// A client that stops reading its SSE stream (its TCP window shut) is cut after
/// `CLAWMUX_SEND_TIMEOUT_SEC`: actix never times a write out, so without the socket's own timeout
/// the stream (and the run's event log it holds) stayed until the client closed. Nothing is lost:
/// the run's events are all there for a re-attach.
#[actix_rt::test]
async fn a_client_that_stops_reading_is_cut_after_the_send_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let env = env_with(fast(), |c| c.send_timeout_sec = 1, |_| {}).await;
    let marker = unique("<stalled>");
    // 4 MB of text: more than the client's receive buffer, the server's send buffer and actix's.
    let big = "x".repeat(4_000_000);
    env.gw.script_runs(&marker, clawmux::replay::RunScript { before_final: vec![clawmux::replay::ScriptFrame::chat("delta", big)], ..Default::default() });
    let run_id = unique("stalled-run");
    let mut b = body(&marker, "acct-stalled");
    b["runId"] = json!(run_id);
    // Cut mid-stream on a slow machine, the run must still end `ok`.
    b["onDisconnect"] = json!("continue");
    let payload = b.to_string();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut conn = socket.connect(env.app.addr).await.unwrap();
    let head = format!(
        "POST /v1/runs HTTP/1.1\r\nhost: {}\r\naccept: text/event-stream\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        env.app.addr,
        payload.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(payload.as_bytes()).await.unwrap();
    // The run ends on the gateway and in the store while its stream is stuck in the buffers.
    let e = &env;
    eventually(WAIT, "the stalled client's run finishes", || {
        let id = run_id.clone();
        async move {
            let r = e.http.get(e.url(&format!("/v1/runs/{id}"))).send().await.unwrap();
            r.status() == 200 && r.json::<Value>().await.unwrap()["status"] == "ok"
        }
    })
    .await;
    // Well past the timeout (zero-window probes back off from 200 ms; the kernel checks at each).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let ended = tokio::time::timeout(WAIT, async {
        loop {
            match conn.read(&mut buf).await {
                Ok(0) => return "eof".to_owned(),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => return format!("{:?}", e.kind()),
            }
        }
    })
    .await;
    let text = String::from_utf8_lossy(&got);
    assert!(!text.contains("event: final"), "the stalled stream was still delivered whole ({} bytes, then {ended:?})", got.len());
    assert!(ended.is_ok(), "the connection was not cut ({} bytes read, the read then hung)", got.len());
    // Re-attaching gets every event, the big delta and the end included.
    let r = env.http.get(env.url(&format!("/v1/runs/{run_id}/events"))).header("accept", "text/event-stream").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let all = r.text().await.unwrap();
    assert!(all.contains("event: final") && all.len() > 4_000_000, "re-attached: {} bytes", all.len());
}

/// Opens a run's SSE stream on a connection of its own whose client never reads (a 4 KiB
/// receive buffer), so that the stream stalls once its buffers are full.
async fn stalled_stream(env: &Env, marker: &str, run_id: &str) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut b = body(marker, "acct-stalled");
    b["runId"] = json!(run_id);
    b["onDisconnect"] = json!("continue");
    let payload = b.to_string();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut conn = socket.connect(env.app.addr).await.unwrap();
    let head = format!(
        "POST /v1/runs HTTP/1.1\r\nhost: {}\r\naccept: text/event-stream\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        env.app.addr,
        payload.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(payload.as_bytes()).await.unwrap();
    conn
}

/// Each shard (HTTP worker) serves the streams of the runs it admitted, and a stalled client's
/// stream blocks nothing of its shard: with stalled streams on both shards, runs admitted on
/// either afterwards stream to their end, and the stalled ones stay stuck.
#[actix_rt::test]
async fn a_stalled_client_on_one_shard_holds_up_no_run_on_any_shard() {
    let env = env_with(fast(), |c| c.shards = 2, |_| {}).await;
    let marker = unique("<stalled-shard>");
    // 4 MB of text: more than the client's receive buffer, the server's send buffer and actix's.
    env.gw.script_runs(&marker, clawmux::replay::RunScript { before_final: vec![clawmux::replay::ScriptFrame::chat("delta", "x".repeat(4_000_000))], ..Default::default() });
    let shard_runs = |e: &Env| {
        let e = e.http.clone();
        let base = env.base.clone();
        async move {
            let text = e.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
            let count = |shard: &str| -> f64 {
                text.lines()
                    .find(|l| l.starts_with(&format!("clawmux_shard_runs_total{{shard=\"{shard}\"}}")))
                    .and_then(|l| l.rsplit(' ').next()?.parse().ok())
                    .unwrap_or(0.0)
            };
            (count("0"), count("1"))
        }
    };
    // New connections go to the workers in turn: four stalled streams, two on each.
    let mut stalled = Vec::new();
    for i in 0..4 {
        let run_id = unique(&format!("stalled-{i}"));
        stalled.push((stalled_stream(&env, &marker, &run_id).await, run_id));
    }
    let e = &env;
    eventually(WAIT, "the stalled clients' runs finish in the store", || {
        let ids: Vec<String> = stalled.iter().map(|(_, id)| id.clone()).collect();
        async move {
            for id in ids {
                let r = e.http.get(e.url(&format!("/v1/runs/{id}"))).send().await.unwrap();
                if r.status() != 200 || r.json::<Value>().await.unwrap()["status"] != "ok" {
                    return false;
                }
            }
            true
        }
    })
    .await;
    let (zero, one) = shard_runs(&env).await;
    assert!(zero >= 1.0 && one >= 1.0 && zero + one == 4.0, "the stalled runs are on both shards: {zero} and {one}");
    // Runs admitted now, on new connections (both workers), stream to their end at once.
    let clients: Vec<reqwest::Client> = (0..8).map(|_| http()).collect();
    let runs = clients.iter().enumerate().map(|(i, c)| {
        let marker = unique(&format!("<free-{i}>"));
        let base = env.base.clone();
        async move {
            let resp = post_sse(c, &base, &body(&marker, "acct-free"), &[]).await;
            assert_eq!(resp.status(), 200);
            let text = tokio::time::timeout(WAIT, resp.text()).await.expect("a free run's stream ends while the stalled ones are stuck").unwrap();
            let events = parse_sse(&text);
            let last = events.last().expect("events");
            assert_eq!((last.event.as_str(), last.data["content"].as_str()), ("final", Some(answer(&marker).as_str())), "{text}");
        }
    });
    futures_util::future::join_all(runs).await;
    let (zero_after, one_after) = shard_runs(&env).await;
    assert!(zero_after > zero && one_after > one, "the free runs ran on both shards: {zero_after} and {one_after}");
    // The stalled streams are still stuck: nothing of the end reached them.
    for (conn, _) in &stalled {
        let mut buf = vec![0u8; 4096];
        let n = conn.try_read(&mut buf).unwrap_or(0);
        assert!(!String::from_utf8_lossy(&buf[..n]).contains("event: final"));
    }
}

#[actix_rt::test]
async fn a_run_over_its_timeout_ends_timeout_and_is_cancelled_on_the_gateway() {
    let env = env(fast()).await;
    env.gw.set_paused(true);
    let mut b = body(&unique("<slow>"), "acct-timeout");
    b["timeoutSec"] = json!(1);
    let t0 = Instant::now();
    let mut sse = env.sse(&b).await;
    let acc = sse.accepted().await;
    let fin = sse.terminal(WAIT).await.expect("terminal");
    let took = t0.elapsed();
    assert_eq!((fin.event.as_str(), fin.data["code"].as_str()), ("error", Some("timeout")), "{fin:?}");
    assert!(took >= Duration::from_millis(950) && took < Duration::from_secs(5), "timed out after {took:?}");
    assert!(sse.read_to_end(WAIT).await);
    assert_stream_shape(&sse, "timeout");
    assert_eq!(env.doc(&acc.run_id).await["status"], "timeout");
    assert!(env.gw_run(&acc.gateway_run_id).aborted, "the gateway run was not cancelled");
    env.gw.set_paused(false);
}

#[actix_rt::test]
async fn runs_of_one_session_key_run_one_after_the_other() {
    let env = env(fast()).await;
    env.gw.set_paused(true);
    let mut b1 = body(&unique("<first>"), "acct-serial");
    b1["stateKey"] = json!("Conversation-1");
    let mut b2 = body(&unique("<second>"), "acct-serial");
    b2["stateKey"] = json!("Conversation-1");
    let mut first = env.sse(&b1).await;
    let acc1 = first.accepted().await;
    assert_eq!(acc1.session_key, "agent:main:clawmux:acct-serial.s._conversation-1");
    let mut second = env.sse(&b2).await;
    // The second waits in clawmux: not even sent to the gateway while the first is in flight.
    assert!(second.next(Duration::from_millis(400)).await.is_none(), "{:?}", second.all());
    assert_eq!(env.gw.runs().len(), 1);
    assert_eq!(env.metric("clawmux_runs_queued").await, 1.0);

    let reader = |mut sse: Sse| {
        tokio::spawn(async move {
            assert!(sse.read_to_end(WAIT).await);
            sse
        })
    };
    let (h1, h2) = (reader(first), reader(second));
    env.gw.set_paused(false);
    let (first, second) = (h1.await.unwrap(), h2.await.unwrap());
    assert_stream_shape(&first, "first");
    assert_stream_shape(&second, "second");
    assert_eq!(second.all()[0].data["sessionKey"], acc1.session_key);
    let runs = env.gw.runs();
    assert_eq!(runs.len(), 2);
    // The gateway's own clock, not arrival times on two client sockets (those two streams are
    // read by two tasks and may be scheduled in either order on a loaded machine).
    let first_end = runs[0].finished_at.expect("the first run finished");
    assert!(runs[1].accepted_at >= first_end, "the second run reached the gateway before the first ended");
    assert_eq!(runs[0].run_id, acc1.gateway_run_id, "gateway start order");
    assert_eq!(runs[1].run_id, second.all()[0].data["gatewayRunId"].as_str().unwrap());
    assert!(runs.iter().all(|r| r.session_key == acc1.session_key && r.status == RunStatus::Ok));
}

/// A run queued behind another run of its session key times out on time (its wait counts toward
/// its timeout: it must not wait for the run ahead to finish), reports `queued` while it waits, and
/// a queued run can be aborted (`aborted: true`, terminal `aborted`), never reaching the gateway.
#[actix_rt::test]
async fn a_queued_run_reports_queued_times_out_on_time_and_can_be_aborted() {
    let env = env(fast()).await;
    env.gw.set_paused(true);
    let mut ahead = body(&unique("<ahead>"), "acct-queue");
    ahead["stateKey"] = json!("conv-q");
    let mut first = env.sse(&ahead).await;
    first.accepted().await;

    let mut late = body(&unique("<late>"), "acct-queue");
    late["stateKey"] = json!("conv-q");
    late["timeoutSec"] = json!(1);
    let t0 = Instant::now();
    let r = env.http.post(env.url("/v1/runs?wait=false")).json(&late).send().await.unwrap();
    assert_eq!(r.status(), 202);
    let doc: Value = r.json().await.unwrap();
    assert_eq!(doc["status"], "queued", "{doc}");
    let late_id = doc["runId"].as_str().unwrap().to_owned();

    let mut aborted = body(&unique("<aborted>"), "acct-queue");
    aborted["stateKey"] = json!("conv-q");
    let r = env.http.post(env.url("/v1/runs?wait=false")).json(&aborted).send().await.unwrap();
    let aborted_id = r.json::<Value>().await.unwrap()["runId"].as_str().unwrap().to_owned();
    let a: Value = env.http.post(env.url(&format!("/v1/runs/{aborted_id}/abort"))).send().await.unwrap().json().await.unwrap();
    assert_eq!(a["aborted"], true, "{a}");
    let e = &env;
    let id = &aborted_id;
    eventually(WAIT, "the queued run ended aborted", || async move { e.doc(id).await["status"] == "aborted" }).await;

    let id = &late_id;
    eventually(WAIT, "the queued run timed out", || async move { e.doc(id).await["status"] == "timeout" }).await;
    // On time by its own record (admitted → ended), not by this test's clock, which also counts
    // the requests above on a possibly busy machine; the run ahead is held, so it did not wait
    // for that one either.
    let doc = env.doc(&late_id).await;
    let took = common::doc_time(&doc, "finishedAt") - common::doc_time(&doc, "createdAt");
    assert!(took >= time::Duration::milliseconds(950) && took < time::Duration::milliseconds(1800), "timed out {took} after its admission, not 1 s (+ slack): {doc}");
    assert!(t0.elapsed() < WAIT);
    assert_eq!(doc["error"]["code"], "timeout");
    // Neither reached the gateway; the run ahead is undisturbed.
    assert_eq!(env.gw.runs().len(), 1);
    env.gw.set_paused(false);
    let fin = first.terminal(WAIT).await.expect("terminal");
    assert_eq!(fin.event, "final", "{fin:?}");
}

/// Regression (cross-tenant): under plain concatenation each pair below got ONE gateway session, so
/// the two tenants shared a transcript and queued behind each other. Each pair must now get two
/// sessions: both runs are sent to the gateway at once (neither waits behind the other), their keys
/// differ, and each stream carries only its own text.
#[actix_rt::test]
async fn runs_of_different_tenants_never_share_a_session() {
    let env = env(fast()).await;
    env.gw.set_paused(true);
    let pairs = [
        ((json!("t-a:x"), Some("y"), None), (json!("t-a"), Some("x:y"), None)),
        ((json!("Acme"), Some("c1"), None), (json!("acme"), Some("c1"), None)),
        ((json!("a"), Some("x"), None), (json!("a"), None, Some("x"))),
    ];
    let mut streams = Vec::new();
    for (i, (one, two)) in pairs.iter().enumerate() {
        let mut keys = Vec::new();
        for (j, (account, state, run_id)) in [one, two].into_iter().enumerate() {
            let marker = unique(&format!("<tenant-{i}-{j}>"));
            let mut b = body(&marker, "placeholder");
            b["billingAccountId"] = account.clone();
            if let Some(s) = state {
                b["stateKey"] = json!(s);
            }
            if let Some(r) = run_id {
                b["runId"] = json!(format!("{r}"));
            }
            let mut sse = env.sse(&b).await;
            // Paused gateway: an ACK still arrives for a run the gateway got; a run queued behind
            // another of the same session would get nothing.
            let acc = sse.accepted().await;
            keys.push(acc.session_key.clone());
            streams.push((sse, marker, acc));
        }
        assert_ne!(keys[0], keys[1], "pair {i} shares a gateway session");
    }
    assert_eq!(env.metric("clawmux_runs_queued").await, 0.0, "no run waits behind another tenant's run");
    env.gw.set_paused(false);
    for (sse, marker, acc) in &mut streams {
        let fin = sse.terminal(WAIT).await.expect("terminal");
        assert_eq!(fin.event, "final", "{fin:?}");
        assert_eq!(sse.text(), answer(marker), "{acc:?}");
        assert_eq!(env.gw_run(&acc.gateway_run_id).session_key, acc.session_key, "the gateway used the key clawmux routes by");
    }
}

#[actix_rt::test]
async fn agents_healthz_readyz_and_metrics() {
    let env = env(fast()).await;
    let r = env.http.get(env.url("/v1/agents")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let agents: Value = r.json().await.unwrap();
    let list = agents["agents"].as_array().expect("agents list");
    assert!(!list.is_empty());
    for a in list {
        for k in ["agentId", "graphId", "name", "description"] {
            assert!(a[k].as_str().is_some_and(|s| !s.is_empty()), "{k} in {a}");
        }
    }
    assert!(list.iter().any(|a| a["agentId"] == agents["defaultAgentId"]), "{agents}");
    assert!(list.iter().any(|a| a["agentId"] == "main" && a["graphId"] == "sandbox:openclaw" && a["mode"] == "gateway"), "{agents}");
    assert_eq!(agents["defaultGraphId"], "sandbox:openclaw");

    assert_eq!(env.http.get(env.url("/healthz")).send().await.unwrap().status(), 200);
    let (status, ready) = env.readyz().await;
    assert_eq!(status, 200);
    assert_eq!(ready["gateway"], "connected");
    assert_eq!(ready["protocol"], 4);
    assert_eq!(ready["sessionScopedEvents"], true);
    assert_eq!(ready["serverVersion"], "replay-openclaw@2026.9.6");
    let r = env.http.get(env.url("/v1/nope")).send().await.unwrap();
    expect_error(r, 404, "not_found", "unknown endpoint").await;

    let (status, _) = post_json(&env.http, &env.base, &body("<metrics>", "acct-metrics")).await;
    assert_eq!(status, 200);
    let r = env.http.get(env.url("/metrics")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let ct = r.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    assert!(ct.starts_with("text/plain"), "{ct}");
    let text = r.text().await.unwrap();
    for name in [
        "clawmux_gateway_frames_received_total",
        "clawmux_gateway_connects_total",
        "clawmux_gateway_connected",
        "clawmux_runs_started_total",
        "clawmux_runs_finished_total",
        "clawmux_runs_active",
        "clawmux_run_duration_seconds",
        "clawmux_run_start_seconds",
        "sandbox_runs_total",
        "sandbox_run_duration_seconds",
    ] {
        assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing from\n{text}");
    }
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("not a sample: {line}"));
        // clawmux's own, and the roadmap's `sandbox_*` pair (runs per agent).
        assert!(series.starts_with("clawmux_") || series.starts_with("sandbox_run"), "{line}");
        assert!(value.parse::<f64>().is_ok(), "{line}");
    }
    assert_eq!(env.metric("clawmux_gateway_connected").await, 1.0);
    assert_eq!(env.metric("clawmux_runs_started_total").await, 1.0);
    // The registry counts a run's end when its actor tells it, just after the caller got the
    // final event: a moment later, on another thread.
    let e = &env;
    eventually(WAIT, "the run counted as finished", || async move { e.metric("clawmux_runs_active").await == 0.0 }).await;
    assert_eq!(env.metric("clawmux_runs_finished_total{status=\"ok\"}").await, 1.0);
    assert_eq!(env.metric("sandbox_runs_total{agent=\"main\",status=\"ok\"}").await, 1.0);
    assert_eq!(env.metric("sandbox_run_duration_seconds_count{agent=\"main\",status=\"ok\"}").await, 1.0);
    for stage in ["admit", "turn", "configure", "gateway"] {
        assert_eq!(env.metric(&format!("clawmux_run_start_seconds_count{{stage=\"{stage}\"}}")).await, 1.0, "{stage}");
    }
}

/// `CLAWMUX_OUTBOUND_HEADERS=auto` (the default) sends no frame the official schema refuses: a
/// stock gateway never gets `outboundHeaders` (one `sessions.patch` per run, none refused), a
/// gateway that lists the capability `session-outbound-headers` (the Cogni fork) gets them.
#[actix_rt::test]
async fn outbound_headers_go_only_to_a_gateway_that_says_it_takes_them() {
    for fork in [false, true] {
        let env = env(fast().accept_outbound_headers(fork)).await;
        let (status, doc) = post_json(&env.http, &env.base, &body(&unique("<headers>"), "acct-headers")).await;
        assert_eq!((status, doc["status"].as_str()), (200, Some("ok")), "{doc}");
        let rec = env.gw_run(doc["gatewayRunId"].as_str().unwrap());
        assert_eq!(env.gw.stats().requests_received.get("sessions.patch"), Some(&1), "fork {fork}: one patch, none refused");
        if fork {
            assert_eq!(rec.outbound_headers.get("x-cogni-run-id").map(String::as_str), doc["runId"].as_str(), "{rec:?}");
        } else {
            assert!(rec.outbound_headers.is_empty(), "{rec:?}");
        }
    }
}

#[actix_rt::test]
async fn model_override_and_trace_id_reach_the_gateway() {
    let env = env(fast()).await;
    let (trace_id, traceparent) = new_traceparent();
    let mut b = body(&unique("<model-b>"), "acct-model");
    b["model"] = json!("cogni/fake-model-b");
    let r = env.http.post(env.url("/v1/runs")).header("traceparent", traceparent.as_str()).json(&b).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let with: Value = r.json().await.unwrap();
    assert_eq!(with["status"], "ok", "{with}");
    let (status, without) = post_json(&env.http, &env.base, &body(&unique("<default>"), "acct-model")).await;
    assert_eq!((status, without["status"].as_str()), (200, Some("ok")));

    let rec = env.gw_run(with["gatewayRunId"].as_str().unwrap());
    assert_eq!(rec.model, "cogni/fake-model-b");
    assert_eq!(rec.model_override.as_deref(), Some("cogni/fake-model-b"));
    let tp = rec.traceparent.clone().expect("traceparent on the agent request");
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    assert_eq!(parts[1], trace_id, "the caller's trace id");
    assert_ne!(parts[2], traceparent.split('-').nth(2).unwrap(), "a child span, not the caller's");

    let rec = env.gw_run(without["gatewayRunId"].as_str().unwrap());
    assert_eq!(rec.model, "cogni/fake-model");
    assert_eq!(rec.model_override, None);
    let tp = rec.traceparent.clone().expect("a new trace per run");
    let own_trace = tp.split('-').nth(1).unwrap();
    assert!(own_trace.len() == 32 && own_trace != trace_id && own_trace != "0".repeat(32), "{tp}");

    // A model the gateway refuses: the run fails with its message.
    let mut b = body(&unique("<bad-model>"), "acct-model");
    b["model"] = json!("nope/no-such-model");
    let (status, doc) = post_json(&env.http, &env.base, &b).await;
    assert_eq!(status, 200);
    assert_eq!((doc["status"].as_str(), doc["error"]["code"].as_str()), (Some("error"), Some("gateway_rejected")), "{doc}");
    assert!(doc["error"]["message"].as_str().unwrap_or_default().contains("Unknown provider \"nope\""), "{doc}");
}

// ------------------------------------------------------------------------------------------------
// 9. Graceful shutdown
// ------------------------------------------------------------------------------------------------

#[actix_rt::test]
async fn graceful_shutdown_ends_every_stream_with_aborted_and_cancels_the_gateway_runs() {
    // `CLAWMUX_SHUTDOWN=cancel`: the old behaviour, for those who want it (the default hands off).
    let env = env_with(fast(), |c| c.shutdown = clawmux_actors::ShutdownMode::Cancel, |_| {}).await;
    env.gw.set_paused(true);
    let mut readers = Vec::new();
    for i in 0..4 {
        let mut sse = env.sse(&body(&unique(&format!("<bye-{i}>")), &format!("acct-bye-{i}"))).await;
        let acc = sse.accepted().await;
        readers.push((
            acc,
            tokio::spawn(async move {
                let closed = sse.read_to_end(Duration::from_secs(20)).await;
                (closed, sse)
            }),
        ));
    }
    let t0 = Instant::now();
    server::shutdown(&env.app).await;
    assert!(t0.elapsed() < Duration::from_secs(10), "shutdown took {:?}", t0.elapsed());
    for (acc, h) in readers {
        let (closed, sse) = h.await.unwrap();
        assert!(closed, "{}: the stream did not close", acc.run_id);
        assert_stream_shape(&sse, &acc.run_id);
        let last = sse.all().last().cloned().cloned().unwrap();
        assert_eq!((last.event.as_str(), last.data["code"].as_str()), ("error", Some("aborted")), "{last:?}");
        assert!(env.gw_run(&acc.gateway_run_id).aborted, "{}: the gateway run was not cancelled", acc.run_id);
    }
    // The server is gone.
    assert!(env.http.get(env.url("/healthz")).send().await.is_err());
    // And clawmux said goodbye to the gateway: its socket ended with a close frame (1000), not a
    // dropped connection.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let stats = env.gw.stats();
        let ours = stats.connections.iter().rev().find(|c| c.handshaken).cloned().expect("clawmux's connection");
        if !ours.open {
            assert_eq!(ours.client_close, Some(1000), "{ours:?}");
            break;
        }
        assert!(Instant::now() < deadline, "clawmux's gateway connection is still open after shutdown");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
