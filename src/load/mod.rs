//! `clawmux load`: the load driver. Runs N agent runs at concurrency C, each with a unique marker
//! in its message, reads every run's stream as it arrives, checks isolation and the SSE contract,
//! and reports throughput, latency percentiles and errors by code.
//!
//! Two designs are driven the same way and checked by the same rules, so one run of the tool can
//! compare them against the same gateway:
//! - [`Mode::Clawmux`]: `POST /v1/runs` (`Accept: text/event-stream`) to a clawmux.
//! - [`Mode::PerCall`]: the design clawmux replaces (the reference TypeScript client), driving the
//!   gateway itself: per run a new socket + handshake for `sessions.patch`, then another for
//!   `agent`, with no session-scoped delivery, so every socket receives every session's events
//!   and has to drop the foreign ones (here fail-closed, by sessionKey AND runId).
//!
//! # Layout
//! - [`check`]: the isolation checker (pure).
//! - [`stats`]: percentiles (pure).
//! - [`report`]: aggregation and rendering (pure).
//! - [`sse`]: incremental SSE parsing (pure).
//! - [`ws`]: a minimal gateway client (also used by `clawmux record`).
//!
//! Every loop is bounded: by the number of runs, by each run's timeout, and by an optional
//! deadline for the whole load; SIGINT/SIGTERM (a `stop` signal) end it early with a report.

pub mod check;
pub mod report;
pub mod sse;
pub mod stats;
pub mod ws;

use check::{check_run, new_marker, Observed, Outcome};
use clawmux_actors::delta::DeltaTracker;
use clawmux_protocol::frame::Frame;
use clawmux_protocol::methods::{decode_agent_reply, name, AgentParams, AgentReply, FinalStatus, SessionsPatchParams};
use clawmux_protocol::{ConnectParams, GatewayEvent};
use futures_util::StreamExt;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use report::{build_report, ClientFrames, LoadReport, ReportMeta, RunResult};
use serde_json::{json, Value};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use ws::GatewayConn;

/// Extra time the driver gives a run beyond the `timeoutSec` it asked for, so that the server's
/// own `timeout` error (a terminal event) arrives before the driver gives up.
const CLIENT_GRACE: Duration = Duration::from_secs(5);
/// Largest error body read from a refused `POST`.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// Which design to drive.
#[derive(Debug, Clone)]
pub enum Mode {
    /// clawmux's HTTP API at `target`.
    Clawmux,
    /// The connection-per-call design, against the gateway itself.
    PerCall {
        /// `ws://` URL of the gateway.
        gateway: String,
        /// The gateway's shared token.
        token: Option<String>,
    },
}

/// What to run.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// clawmux base URL (`http://127.0.0.1:8787`); in per-call mode only a label.
    pub target: String,
    /// Runs to start.
    pub runs: usize,
    /// Runs in flight at once.
    pub concurrency: usize,
    /// clawmux API bearer token.
    pub token: Option<String>,
    /// Message text; the run's marker goes in front of it (first line: the replay gateway echoes
    /// the first line, the fake LLM the whole message).
    pub message: String,
    /// Model for every run (`sessions.patch` in per-call mode).
    pub model: Option<String>,
    /// Billing account of the runs (clawmux mode) / of the session keys (per-call).
    pub account: String,
    /// Per-run timeout (sent as `timeoutSec`; the driver waits a little longer).
    pub timeout: Duration,
    /// Bound on the whole load: runs not started by then are not started, runs in flight are
    /// dropped (the report says `interrupted`).
    pub deadline: Option<Duration>,
    /// The design.
    pub mode: Mode,
    /// Draw a progress bar on stderr (only when stderr is a terminal).
    pub progress: bool,
}

impl LoadConfig {
    /// Defaults for the given target: 100 runs, concurrency 10, 120 s timeout.
    pub fn new(target: impl Into<String>) -> Self {
        Self {
            target: target.into(),
            runs: 100,
            concurrency: 10,
            token: None,
            message: "clawmux load test".to_owned(),
            model: None,
            account: "load".to_owned(),
            timeout: Duration::from_secs(120),
            deadline: None,
            mode: Mode::Clawmux,
            progress: false,
        }
    }
}

/// Why a load run could not start.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A value that cannot work.
    #[error("invalid load configuration: {0}")]
    Config(String),
    /// The HTTP client could not be built.
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
}

/// Counters shared by the per-call runs.
#[derive(Debug, Default)]
struct FrameCounters {
    connections: AtomicU64,
    handshakes: AtomicU64,
    frames: AtomicU64,
    bytes: AtomicU64,
    foreign: AtomicU64,
}

impl FrameCounters {
    fn snapshot(&self) -> ClientFrames {
        ClientFrames {
            connections: self.connections.load(Ordering::Relaxed),
            handshakes: self.handshakes.load(Ordering::Relaxed),
            frames_received: self.frames.load(Ordering::Relaxed),
            bytes_received: self.bytes.load(Ordering::Relaxed),
            foreign_frames_dropped: self.foreign.load(Ordering::Relaxed),
        }
    }
}

/// Everything a worker needs.
struct Ctx {
    cfg: LoadConfig,
    http: reqwest::Client,
    counters: FrameCounters,
    version: String,
}

/// Runs the load to its end (no external stop signal).
pub async fn run(cfg: LoadConfig) -> Result<LoadReport, LoadError> {
    let (_tx, rx) = watch::channel(false);
    run_until(cfg, rx).await
}

/// Runs the load; `stop` turning `true` ends it early (runs in flight are dropped, which makes
/// clawmux abort them) and the report says `interrupted`.
pub async fn run_until(cfg: LoadConfig, stop: watch::Receiver<bool>) -> Result<LoadReport, LoadError> {
    if cfg.runs == 0 || cfg.concurrency == 0 {
        return Err(LoadError::Config("--runs and --concurrency must be at least 1".to_owned()));
    }
    if cfg.timeout.is_zero() {
        return Err(LoadError::Config("--timeout-sec must be at least 1".to_owned()));
    }
    if let Mode::PerCall { gateway, .. } = &cfg.mode {
        if !(gateway.starts_with("ws://") || gateway.starts_with("wss://")) {
            return Err(LoadError::Config(format!("--gateway must be a ws:// or wss:// URL, got {gateway:?}")));
        }
    } else if !(cfg.target.starts_with("http://") || cfg.target.starts_with("https://")) {
        return Err(LoadError::Config(format!("--target must be an http:// URL, got {:?}", cfg.target)));
    }
    let concurrency = cfg.concurrency.min(cfg.runs);
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .tcp_nodelay(true)
        .build()
        .map_err(|e| LoadError::Client(e.to_string()))?;
    let mode_name = match cfg.mode {
        Mode::Clawmux => "clawmux",
        Mode::PerCall { .. } => "per-call",
    };
    let target = match &cfg.mode {
        Mode::Clawmux => cfg.target.clone(),
        Mode::PerCall { gateway, .. } => gateway.clone(),
    };
    let progress = progress_bar(cfg.progress, cfg.runs as u64);
    let ctx = Arc::new(Ctx { cfg, http, counters: FrameCounters::default(), version: env!("CARGO_PKG_VERSION").to_owned() });
    let started = Instant::now();
    let deadline = ctx.cfg.deadline.map(|d| started + d);
    let next = Arc::new(AtomicUsize::new(0));
    let results = Arc::new(Mutex::new(Vec::with_capacity(ctx.cfg.runs)));
    let errors = Arc::new(AtomicU64::new(0));
    let violations = Arc::new(AtomicU64::new(0));
    let interrupted = Arc::new(std::sync::atomic::AtomicBool::new(false));

    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (ctx, next, results, progress) = (Arc::clone(&ctx), Arc::clone(&next), Arc::clone(&results), progress.clone());
        let (errors, violations, interrupted, mut stop) = (Arc::clone(&errors), Arc::clone(&violations), Arc::clone(&interrupted), stop.clone());
        workers.spawn(async move {
            loop {
                if *stop.borrow() || deadline.is_some_and(|d| Instant::now() >= d) {
                    interrupted.store(true, Ordering::Relaxed);
                    return;
                }
                if next.fetch_add(1, Ordering::Relaxed) >= ctx.cfg.runs {
                    return;
                }
                let marker = new_marker();
                let one = one_run(&ctx, &marker);
                let bounded = async {
                    match deadline {
                        Some(d) => tokio::time::timeout_at(d, one).await.ok(),
                        None => Some(one.await),
                    }
                };
                let result = tokio::select! {
                    r = bounded => r,
                    _ = stop.wait_for(|s| *s) => None,
                };
                let result = match result {
                    Some(r) => r,
                    None => {
                        interrupted.store(true, Ordering::Relaxed);
                        unfinished(&marker, "interrupted")
                    }
                };
                if result.outcome != Outcome::Final {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
                violations.fetch_add(result.violations.len() as u64, Ordering::Relaxed);
                results.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(result);
                progress.inc(1);
                progress.set_message(format!(
                    "errors {}  violations {}",
                    errors.load(Ordering::Relaxed),
                    violations.load(Ordering::Relaxed)
                ));
                if interrupted.load(Ordering::Relaxed) {
                    return;
                }
            }
        });
    }
    while workers.join_next().await.is_some() {}
    progress.finish_and_clear();
    let duration_sec = started.elapsed().as_secs_f64();
    let results = std::mem::take(&mut *results.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
    let gateway_frames = matches!(ctx.cfg.mode, Mode::PerCall { .. }).then(|| ctx.counters.snapshot());
    let meta = ReportMeta {
        mode: mode_name.to_owned(),
        target,
        runs: ctx.cfg.runs,
        concurrency: ctx.cfg.concurrency,
        duration_sec,
        interrupted: interrupted.load(Ordering::Relaxed),
        gateway_frames,
    };
    Ok(build_report(meta, &results))
}

/// A bar with runs done, rate and errors, on stderr; hidden when stderr is not a terminal (CI
/// logs and `--json` pipelines get no escape sequences).
fn progress_bar(enabled: bool, len: u64) -> ProgressBar {
    if !enabled || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} runs  {per_sec}  {msg}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

fn unfinished(marker: &str, code: &str) -> RunResult {
    RunResult {
        marker: marker.to_owned(),
        outcome: Outcome::Error(code.to_owned()),
        violations: Vec::new(),
        accepted_ms: None,
        first_delta_ms: None,
        terminal_ms: None,
        deltas: 0,
    }
}

async fn one_run(ctx: &Ctx, marker: &str) -> RunResult {
    let limit = ctx.cfg.timeout + CLIENT_GRACE;
    let trace = match &ctx.cfg.mode {
        Mode::Clawmux => tokio::time::timeout(limit, clawmux_run(ctx, marker)).await,
        Mode::PerCall { gateway, token } => tokio::time::timeout(limit, per_call_run(ctx, gateway, token.clone(), marker)).await,
    };
    match trace {
        Ok(t) => t.into_result(marker),
        Err(_) => unfinished(marker, "client_timeout"),
    }
}

/// What one run produced before checking.
struct Trace {
    events: Vec<Observed>,
    accepted_ms: Option<f64>,
    first_delta_ms: Option<f64>,
    terminal_ms: Option<f64>,
    /// The stream reached its end (vs. the driver failing to read it).
    complete: bool,
    /// A failure before any event (HTTP refusal, connect error): the run's error code.
    failed: Option<String>,
}

impl Trace {
    fn new() -> Self {
        Self { events: Vec::new(), accepted_ms: None, first_delta_ms: None, terminal_ms: None, complete: false, failed: None }
    }

    fn failed(code: impl Into<String>) -> Self {
        Self { failed: Some(code.into()), ..Self::new() }
    }

    fn push(&mut self, ev: Observed, at_ms: f64) {
        match &ev {
            Observed::Accepted if self.accepted_ms.is_none() => self.accepted_ms = Some(at_ms),
            Observed::TextDelta(_) if self.first_delta_ms.is_none() => self.first_delta_ms = Some(at_ms),
            Observed::Final { .. } | Observed::Error { .. } if self.terminal_ms.is_none() => self.terminal_ms = Some(at_ms),
            _ => {}
        }
        self.events.push(ev);
    }

    fn into_result(self, marker: &str) -> RunResult {
        let verdict = check_run(marker, &self.events, self.complete);
        let outcome = match (self.failed, verdict.outcome) {
            (Some(code), Outcome::Unfinished) => Outcome::Error(code),
            (_, o) => o,
        };
        RunResult {
            marker: marker.to_owned(),
            outcome,
            violations: verdict.violations,
            accepted_ms: self.accepted_ms,
            first_delta_ms: self.first_delta_ms,
            terminal_ms: self.terminal_ms,
            deltas: self.events.iter().filter(|e| matches!(e, Observed::TextDelta(_))).count() as u64,
        }
    }
}

fn ms_since(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1000.0
}

/// The message of a run: marker first, on the first line.
fn run_message(ctx: &Ctx, marker: &str) -> String {
    format!("{marker} {}", ctx.cfg.message)
}

/// One run through clawmux: POST, then the SSE stream to its end.
async fn clawmux_run(ctx: &Ctx, marker: &str) -> Trace {
    let t0 = Instant::now();
    let mut body = json!({
        "message": run_message(ctx, marker),
        "billingAccountId": ctx.cfg.account,
        "timeoutSec": ctx.cfg.timeout.as_secs().max(1),
    });
    if let Some(m) = &ctx.cfg.model {
        body["model"] = json!(m);
    }
    let mut req = ctx.http.post(format!("{}/v1/runs", ctx.cfg.target.trim_end_matches('/'))).header("accept", "text/event-stream").json(&body);
    if let Some(t) = &ctx.cfg.token {
        req = req.bearer_auth(t);
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) if e.is_connect() => return Trace::failed("connect_failed"),
        Err(_) => return Trace::failed("http_error"),
    };
    let status = resp.status();
    if !status.is_success() {
        return Trace::failed(error_code_of(resp).await.unwrap_or_else(|| format!("http_{}", status.as_u16())));
    }
    let mut trace = Trace::new();
    let mut parser = sse::SseParser::new();
    let mut stream = resp.bytes_stream();
    let mut events = Vec::new();
    loop {
        match stream.next().await {
            Some(Ok(chunk)) => {
                let at = ms_since(t0);
                if parser.push(&chunk, &mut events).is_err() {
                    trace.failed = Some("bad_sse".to_owned());
                    return trace;
                }
                for ev in events.drain(..) {
                    trace.push(observe(&ev), at);
                }
            }
            Some(Err(_)) => {
                trace.failed = Some("stream_error".to_owned());
                return trace;
            }
            None => {
                trace.complete = true;
                return trace;
            }
        }
    }
}

/// The `error.code` of an API error body, if it has one.
async fn error_code_of(resp: reqwest::Response) -> Option<String> {
    let mut body = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(Ok(chunk)) = stream.next().await {
        body.extend_from_slice(&chunk);
        if body.len() > MAX_ERROR_BODY {
            return None;
        }
    }
    let v: Value = serde_json::from_slice(&body).ok()?;
    v.pointer("/error/code").and_then(Value::as_str).map(str::to_owned)
}

/// An SSE event of clawmux's contract → what the checker looks at.
fn observe(ev: &sse::RawSseEvent) -> Observed {
    let data = || serde_json::from_str::<Value>(&ev.data).unwrap_or(Value::Null);
    let text = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).unwrap_or_default().to_owned();
    match ev.event.as_str() {
        "accepted" => Observed::Accepted,
        "text_delta" => Observed::TextDelta(text(&data(), "text")),
        "final" => Observed::Final { content: text(&data(), "content") },
        "error" => {
            let d = data();
            Observed::Error { code: text(&d, "code"), message: text(&d, "message") }
        }
        other => Observed::Other(other.to_owned()),
    }
}

/// The handshake of the reference client: operator scopes, protocol 3..4, and NO
/// `session-scoped-events` (it did not know the cap, so every socket got every session's events).
fn per_call_params(version: &str, token: Option<String>) -> ConnectParams {
    // That client offered 3..4 (clawmux itself now offers exactly 4 first).
    let mut p = ConnectParams::multiplexer(version, token);
    p.min_protocol = clawmux_protocol::handshake::MIN_PROTOCOL;
    p.caps.clear();
    p
}

/// One run the reference way: socket 1 patches the session, socket 2 runs the agent and filters
/// the broadcast fail-closed.
async fn per_call_run(ctx: &Ctx, gateway: &str, token: Option<String>, marker: &str) -> Trace {
    let t0 = Instant::now();
    let c = &ctx.counters;
    let params = per_call_params(&ctx.version, token);
    let session_key = format!("agent:main:{}:{}", ctx.cfg.account, uuid::Uuid::new_v4()).to_lowercase();
    let run_id = uuid::Uuid::new_v4().to_string();
    let deadline = t0 + ctx.cfg.timeout + CLIENT_GRACE;
    let account = |conn: &GatewayConn| {
        c.frames.fetch_add(conn.frames, Ordering::Relaxed);
        c.bytes.fetch_add(conn.bytes, Ordering::Relaxed);
    };

    // Call 1: sessions.patch on its own connection.
    c.connections.fetch_add(1, Ordering::Relaxed);
    let mut conn = match GatewayConn::open(gateway, &params).await {
        Ok(conn) => conn,
        Err(e) => return Trace::failed(e.code()),
    };
    c.handshakes.fetch_add(1, Ordering::Relaxed);
    let patch = SessionsPatchParams { key: session_key.clone(), model: ctx.cfg.model.clone(), outbound_headers: None };
    let res = match conn.send(name::SESSIONS_PATCH, &patch).await {
        Ok(id) => conn.response(&id, deadline, |r| count_foreign(c, r)).await,
        Err(e) => Err(e),
    };
    account(&conn);
    conn.close().await;
    match res {
        Ok(r) if r.ok => {}
        Ok(_) => return Trace::failed("gateway_rejected"),
        Err(e) => return Trace::failed(e.code()),
    }

    // Call 2: agent on another connection.
    c.connections.fetch_add(1, Ordering::Relaxed);
    let mut conn = match GatewayConn::open(gateway, &params).await {
        Ok(conn) => conn,
        Err(e) => return Trace::failed(e.code()),
    };
    c.handshakes.fetch_add(1, Ordering::Relaxed);
    let agent = AgentParams {
        message: run_message(ctx, marker),
        agent_id: "main".to_owned(),
        session_key: session_key.clone(),
        idempotency_key: run_id.clone(),
        timeout: Some(ctx.cfg.timeout.as_secs().max(1)),
        extra_system_prompt: None,
        label: None,
    };
    let mut trace = Trace::new();
    let id = match conn.send(name::AGENT, &agent).await {
        Ok(id) => id,
        Err(e) => {
            account(&conn);
            return Trace::failed(e.code());
        }
    };
    let mut tracker = DeltaTracker::new();
    let outcome = loop {
        let r = match conn.next_until(deadline, "agent run").await {
            Ok(r) => r,
            Err(e) => break Err(e),
        };
        let at = ms_since(t0);
        match r.frame {
            Ok(Frame::Res(res)) if res.id == id => {
                if !res.ok {
                    let message = res.error.map(|e| e.message).unwrap_or_default();
                    trace.push(Observed::Error { code: "gateway_rejected".to_owned(), message }, at);
                    break Ok(());
                }
                let payload = res.payload.map(|p| p.get().to_owned()).unwrap_or_default();
                match decode_agent_reply(&payload) {
                    Ok(AgentReply::Ack(_)) => trace.push(Observed::Accepted, at),
                    Ok(AgentReply::Final(f)) => {
                        let content = f.content();
                        let ev = match f.status {
                            FinalStatus::Ok => {
                                if let Some(rest) = tracker.complete(&content) {
                                    trace.push(Observed::TextDelta(rest), at);
                                }
                                Observed::Final { content }
                            }
                            FinalStatus::Error => Observed::Error { code: "agent_error".to_owned(), message: f.summary.unwrap_or_default() },
                            FinalStatus::Timeout => {
                                let code = if f.is_abort() { "aborted" } else { "timeout" };
                                Observed::Error { code: code.to_owned(), message: f.summary.unwrap_or_default() }
                            }
                        };
                        trace.push(ev, at);
                        break Ok(());
                    }
                    Err(e) => {
                        trace.push(Observed::Error { code: "internal".to_owned(), message: e.to_string() }, at);
                        break Ok(());
                    }
                }
            }
            Ok(Frame::Event(ev)) => {
                let Some((sk, rid)) = ev.event.route_key() else { continue };
                if sk != Some(session_key.as_str()) || rid != Some(run_id.as_str()) {
                    c.foreign.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                if let GatewayEvent::Chat(chat) = ev.event {
                    use clawmux_protocol::ChatState;
                    match chat.state {
                        ChatState::Delta => {
                            if let Some(d) = chat.text().and_then(|t| tracker.push(t)) {
                                trace.push(Observed::TextDelta(d), at);
                            }
                        }
                        ChatState::Error | ChatState::Aborted => {
                            let code = if chat.state == ChatState::Aborted { "aborted" } else { "agent_error" };
                            trace.push(Observed::Error { code: code.to_owned(), message: chat.error_message.unwrap_or_default() }, at);
                            break Ok(());
                        }
                        ChatState::Final => {}
                    }
                }
            }
            _ => {}
        }
    };
    account(&conn);
    conn.close().await;
    match outcome {
        Ok(()) => trace.complete = true,
        Err(e) => trace.failed = Some(e.code().to_owned()),
    }
    trace
}

/// Counts a run-scoped event that arrived on a per-call socket while it waited for something
/// else (every such event is another run's: the socket has no run yet).
fn count_foreign(c: &FrameCounters, r: &ws::Received) {
    if let Ok(Frame::Event(ev)) = &r.frame {
        if ev.event.route_key().is_some() {
            c.foreign.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_call_handshake_has_no_session_scoped_cap() {
        let p = per_call_params("0.1.0", Some("t".into()));
        assert!(p.caps.is_empty());
        assert_eq!((p.min_protocol, p.max_protocol), (3, 4));
        assert_eq!(p.scopes.len(), 3);
        assert_eq!(p.client.id, "gateway-client");
        assert_eq!(p.client.mode, "backend");
    }

    #[test]
    fn sse_events_map_to_observations() {
        let ev = |name: &str, data: &str| sse::RawSseEvent { id: None, event: name.to_owned(), data: data.to_owned() };
        assert_eq!(observe(&ev("accepted", "{}")), Observed::Accepted);
        assert_eq!(observe(&ev("text_delta", r#"{"text":"a"}"#)), Observed::TextDelta("a".into()));
        assert_eq!(observe(&ev("final", r#"{"content":"c","status":"ok"}"#)), Observed::Final { content: "c".into() });
        assert_eq!(
            observe(&ev("error", r#"{"code":"timeout","message":"m"}"#)),
            Observed::Error { code: "timeout".into(), message: "m".into() }
        );
        assert_eq!(observe(&ev("status", r#"{"phase":"thinking"}"#)), Observed::Other("status".into()));
    }

    #[tokio::test]
    async fn bad_configs_are_refused() {
        let mut c = LoadConfig::new("http://127.0.0.1:1");
        c.runs = 0;
        assert!(matches!(run(c).await, Err(LoadError::Config(_))));
        let c = LoadConfig::new("localhost:8787");
        assert!(matches!(run(c).await, Err(LoadError::Config(_))));
        let mut c = LoadConfig::new("http://x");
        c.mode = Mode::PerCall { gateway: "http://x".into(), token: None };
        assert!(matches!(run(c).await, Err(LoadError::Config(_))));
    }
}
