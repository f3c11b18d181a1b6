//! Helpers shared by the integration tests: start clawmux in-process, post runs, read SSE.
#![allow(dead_code)]

use clawmux::config::{Config, Secret};
use clawmux::server::{self, Running};
use futures_util::StreamExt;
use serde_json::Value;
use std::net::SocketAddr;
use std::time::Duration;

/// One parsed SSE event.
#[derive(Debug, Clone)]
pub struct SseEvent {
    /// `id:`.
    pub id: u64,
    /// `event:`.
    pub event: String,
    /// `data:` as JSON.
    pub data: Value,
}

/// Starts clawmux on 127.0.0.1:0 against `gateway_url`; `tweak` adjusts the config first.
pub async fn start_clawmux(gateway_url: &str, token: Option<&str>, tweak: impl FnOnce(&mut Config)) -> Running {
    start_clawmux_with(gateway_url, token, tweak, |_| {}).await
}

/// Starts clawmux with a custom supervisor config tweak too.
pub async fn start_clawmux_with(
    gateway_url: &str,
    token: Option<&str>,
    tweak: impl FnOnce(&mut Config),
    tweak_sup: impl FnOnce(&mut clawmux_actors::SupervisorConfig),
) -> Running {
    start_clawmux_opts(gateway_url, token, tweak, tweak_sup, server::StartOptions::default()).await
}

/// Starts clawmux with some parts put in place by the test (e.g. a fake workspace).
pub async fn start_clawmux_opts(
    gateway_url: &str,
    token: Option<&str>,
    tweak: impl FnOnce(&mut Config),
    tweak_sup: impl FnOnce(&mut clawmux_actors::SupervisorConfig),
    options: server::StartOptions,
) -> Running {
    let mut cfg = Config::load(None, &|_| None).expect("default config");
    cfg.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    cfg.gateway_url = Some(gateway_url.to_owned());
    cfg.gateway_token = token.map(Secret::new);
    // Tests use a key file of their own unless they say otherwise.
    cfg.device_key_file = std::env::temp_dir().join(format!("clawmux-test-device-{}.json", std::process::id()));
    // And a run store of their own: the real default backend (SQLite), in a fresh file.
    cfg.store_url = clawmux::store::StoreUrl::Sqlite(temp_dir("store").join("runs.db"));
    tweak(&mut cfg);
    let mut sup = server::supervisor_config(&cfg, gateway_url).expect("supervisor config");
    sup.backoff = clawmux_actors::backoff::Backoff::new(Duration::from_millis(50), Duration::from_millis(500), 2.0, 0.5).expect("backoff");
    tweak_sup(&mut sup);
    server::start_with(cfg, sup, options).await.expect("clawmux starts")
}

/// Base URL of a running clawmux.
pub fn base(running: &Running) -> String {
    format!("http://{}", running.addr)
}

/// Waits until `/readyz` answers 200 (bounded).
pub async fn wait_ready(client: &reqwest::Client, base: &str, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Ok(r) = client.get(format!("{base}/readyz")).send().await {
            if r.status() == 200 {
                return;
            }
        }
        assert!(tokio::time::Instant::now() < deadline, "clawmux did not become ready within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Parses SSE text into events (comment lines ignored).
pub fn parse_sse(text: &str) -> Vec<SseEvent> {
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        let mut id = None;
        let mut event = None;
        let mut data = String::new();
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("id:") {
                id = v.trim().parse().ok();
            } else if let Some(v) = line.strip_prefix("event:") {
                event = Some(v.trim().to_owned());
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push_str(v.strip_prefix(' ').unwrap_or(v));
            }
        }
        if let (Some(id), Some(event)) = (id, event) {
            out.push(SseEvent { id, event, data: serde_json::from_str(&data).unwrap_or(Value::Null) });
        }
    }
    out
}

/// An SSE stream being read incrementally.
pub struct SseReader {
    /// The response body stream.
    stream: std::pin::Pin<Box<dyn futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>,
    buf: String,
    /// Events read so far.
    pub events: Vec<SseEvent>,
}

impl SseReader {
    /// Wraps a response.
    pub fn new(resp: reqwest::Response) -> Self {
        Self { stream: Box::pin(resp.bytes_stream()), buf: String::new(), events: Vec::new() }
    }

    /// Reads until an event satisfies `pred` (returns it) or the stream ends / `within` passes.
    pub async fn until(&mut self, within: Duration, pred: impl Fn(&SseEvent) -> bool) -> Option<SseEvent> {
        if let Some(e) = self.events.iter().find(|e| pred(e)) {
            return Some(e.clone());
        }
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let chunk = tokio::time::timeout_at(deadline, self.stream.next()).await.ok()??.ok()?;
            self.buf.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(pos) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..pos + 2).collect();
                for ev in parse_sse(&block) {
                    let hit = pred(&ev);
                    self.events.push(ev.clone());
                    if hit {
                        return Some(ev);
                    }
                }
            }
        }
    }

    /// Reads to the terminal event.
    pub async fn terminal(&mut self, within: Duration) -> Option<SseEvent> {
        self.until(within, |e| e.event == "final" || e.event == "error").await
    }

    /// Concatenated `text_delta` texts.
    pub fn text(&self) -> String {
        self.events.iter().filter(|e| e.event == "text_delta").filter_map(|e| e.data["text"].as_str()).collect()
    }
}

/// Posts a run asking for SSE.
pub async fn post_sse(client: &reqwest::Client, base: &str, body: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut req = client.post(format!("{base}/v1/runs")).header("accept", "text/event-stream").json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.send().await.expect("POST /v1/runs")
}

/// Posts a run and waits for its document (JSON mode).
pub async fn post_json(client: &reqwest::Client, base: &str, body: &Value) -> (u16, Value) {
    let r = client.post(format!("{base}/v1/runs")).json(body).send().await.expect("POST /v1/runs");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Reads `/metrics` and returns the value of the first sample whose line starts with `prefix`
/// (summed over every matching line).
pub async fn metric(client: &reqwest::Client, base: &str, prefix: &str) -> f64 {
    let text = client.get(format!("{base}/metrics")).send().await.expect("metrics").text().await.expect("metrics body");
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A fresh 32-hex trace id and its traceparent.
pub fn new_traceparent() -> (String, String) {
    let trace = uuid::Uuid::new_v4().simple().to_string();
    let span = &uuid::Uuid::new_v4().simple().to_string()[..16];
    (trace.clone(), format!("00-{trace}-{span}-01"))
}

/// The project's fake LLM (tests/support/fake_llm.py) as a child process; killed on drop.
pub struct FakeLlm {
    child: std::process::Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// Its request log (JSON lines).
    pub log: std::path::PathBuf,
}

impl FakeLlm {
    /// Starts it with a fresh log in `dir`.
    pub fn start(dir: &std::path::Path) -> Self {
        Self::start_with(dir, &[])
    }

    /// Starts it with a fresh log in `dir` and its `FAKE_LLM_*` settings (e.g. a slower stream).
    pub fn start_with(dir: &std::path::Path, env: &[(&str, &str)]) -> Self {
        std::fs::create_dir_all(dir).expect("dir");
        let port_file = dir.join("llm.port");
        let log = dir.join("llm-requests.jsonl");
        let child = std::process::Command::new("python3")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/fake_llm.py"))
            .env("FAKE_LLM_PORT", "0")
            .env("FAKE_LLM_PORT_FILE", &port_file)
            .env("FAKE_LLM_LOG", &log)
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("python3 runs the fake LLM");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let port = loop {
            if let Some(p) = std::fs::read_to_string(&port_file).ok().and_then(|s| s.trim().parse::<u16>().ok()) {
                break p;
            }
            assert!(std::time::Instant::now() < deadline, "the fake LLM did not start");
            std::thread::sleep(Duration::from_millis(20));
        };
        Self { child, port, log }
    }

    /// Its base URL (root).
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Every logged line.
    pub fn entries(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.log).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
    }
}

impl Drop for FakeLlm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh temporary directory: `$TMPDIR/clawmux-tests/<pid>/<tag>-<uuid>`.
///
/// A test process cannot clean up at its exit (statics are never dropped, and a failing test keeps
/// its files for a look), so each test process first removes the directories of earlier test
/// processes that are gone; `tests/run.sh` removes the rest when it ends.
pub fn temp_dir(tag: &str) -> std::path::PathBuf {
    static ROOT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    let root = ROOT.get_or_init(|| {
        let base = std::env::temp_dir().join("clawmux-tests");
        for entry in std::fs::read_dir(&base).into_iter().flatten().flatten() {
            let gone = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()).is_some_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists());
            if gone {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        base.join(std::process::id().to_string())
    });
    let d = root.join(format!("{tag}-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// An OpenAI chat-completions body with one user message.
pub fn chat_body(text: &str, stream: bool) -> Value {
    serde_json::json!({"model": "fake-model", "stream": stream, "stream_options": {"include_usage": true},
           "messages": [{"role": "user", "content": text}]})
}

/// Waits until the run's document shows it was accepted by the gateway.
pub async fn wait_accepted(c: &reqwest::Client, base: &str, run_id: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let doc: Value = c.get(format!("{base}/v1/runs/{run_id}")).send().await.expect("get").json().await.expect("doc");
        if !doc["gatewayRunId"].is_null() {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "run not accepted: {doc}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether a `pg_` test can run: a test server is named, or else it is skipped (unless required).
pub fn pg_available(test: &str) -> bool {
    if std::env::var("CLAWMUX_TEST_PG_URL").is_ok_and(|u| !u.is_empty()) {
        return true;
    }
    assert!(!std::env::var("CLAWMUX_REQUIRE_PG").is_ok_and(|v| v == "1"), "{test}: CLAWMUX_REQUIRE_PG=1 but CLAWMUX_TEST_PG_URL is not set");
    eprintln!("SKIP {test}: no CLAWMUX_TEST_PG_URL");
    false
}

/// Each case as `name` (SQLite) and `pg_name` (PostgreSQL).
#[allow(unused_macros)]
macro_rules! on_sqlite_and_postgres {
    ($($name:ident, $pg:ident: $case:ident);* $(;)?) => { $(
        #[actix_rt::test]
        async fn $name() {
            $case("sqlite").await;
        }

        #[actix_rt::test]
        async fn $pg() {
            if $crate::common::pg_available(stringify!($pg)) {
                $case("postgres").await;
            }
        }
    )* };
}
#[allow(unused_imports)]
pub(crate) use on_sqlite_and_postgres;

/// A port nothing listens on right now, for a server (often a child process) to bind later, on
/// every start the same. Taken BELOW the kernel's ephemeral range: a port from `bind(:0)` is an
/// ephemeral one, which any outgoing connection of another test (a database pool, an HTTP
/// client) may take as its source port before the server binds it (seen: a replica exiting at
/// start with "Address already in use"). Random in that range, checked bindable.
pub fn free_port() -> u16 {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (lo, hi) = (10_000u16, ephemeral_low.max(11_000));
    for _ in 0..1000 {
        let port = rand::Rng::gen_range(&mut rand::thread_rng(), lo..hi);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// The tests' HTTP client (`timeout`: per request). Pooled connections idle for 2 s are dropped,
/// before the server's keep-alive (actix: 5 s) closes them: a request sent on a connection the
/// server is closing at that moment fails (`IncompleteMessage`; seen in a replicas test that
/// waited 6 s between two requests).
pub fn http_client(timeout: Option<Duration>) -> reqwest::Client {
    let b = reqwest::Client::builder().pool_max_idle_per_host(256).pool_idle_timeout(Duration::from_secs(2));
    match timeout {
        Some(t) => b.timeout(t),
        None => b,
    }
    .build()
    .expect("http client")
}

/// The audit log's records once `done` holds for them, or when `within` has passed (the caller's
/// assertions then say what is missing). The proxy queues a call's record only when it has seen
/// the end of the call's stream (after the run's `final`, at times) and a thread of its own writes
/// and syncs each one: a test reading the log at once, or after a fixed pause, can miss records on
/// a busy machine.
pub async fn audit_records_once(path: &std::path::Path, within: Duration, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        // Not there yet (no call ended) or a line half written: read again.
        let records = clawmux::audit::read_records(path).unwrap_or_default();
        if done(&records) || tokio::time::Instant::now() >= deadline {
            return records;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A run document's RFC 3339 timestamp `key` (`createdAt`, `finishedAt`): tests bound a run's own
/// times with them rather than the test's clock, which also counts its requests.
pub fn doc_time(doc: &Value, key: &str) -> time::OffsetDateTime {
    time::OffsetDateTime::parse(doc[key].as_str().unwrap_or_default(), &time::format_description::well_known::Rfc3339).unwrap_or_else(|e| panic!("{key}: {e}: {doc}"))
}
