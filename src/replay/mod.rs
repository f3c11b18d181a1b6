//! The replay gateway: a fake OpenClaw gateway that behaves like the real one and replays
//! recorded chat streams from a cassette.
//!
//! It backs `clawmux demo`, `clawmux replay-gateway` and the fast integration tests, so every
//! behaviour here is one observed on the real gateway (`openclaw@2026.9.6`, protocol 4, and
//! `2026.4.12`, protocol 3): the challenge/connect handshake and its exact refusals, scopes,
//! broadcast of `chat`/`agent` events to every reader (or only subscribed sessions with
//! `session-scoped-events`), the double `res` of `agent`, idempotency-key dedupe, per-session
//! serialisation, aborts that end as `timeout`, ticks. A behaviour only the fake showed would be
//! worthless to the tests that rely on it.
//!
//! # Layout
//! - [`cassette`]: the cassette format (parse, validate, write) and the pure rewriting of a
//!   recorded run into a new one (ids, caller echo, model, v3 downgrade, delta re-cutting).
//! - [`config`]: [`ReplayConfig`], the knobs.
//! - `schema`: closed-schema checks with the gateway's error wording.
//! - `state`: connections, sessions, runs, delivery rules, counters (one mutex, never held
//!   across an await).
//! - `methods`: the request handlers.
//! - `run`: one task per run: ACK, recorded timeline, final, or the abort sequence.
//! - `server`: accept loop (which can close and reopen the listener), per-socket task and
//!   handshake (both can be frozen), tick task.
//! - [`script`]: scripted run endings (contradicting finals and the like) for chaos tests.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use clawmux::replay::{ReplayConfig, ReplayGateway};
//! let gw = ReplayGateway::start("127.0.0.1:0".parse().expect("addr"), ReplayConfig::default().speed(0.0))?;
//! println!("fake gateway at {}", gw.url());
//! gw.stop().await;
//! # Ok(()) }
//! ```

pub mod cassette;
pub mod config;
#[cfg(test)]
mod knob_tests;
mod methods;
mod run;
mod schema;
pub mod script;
mod server;
mod state;

pub use cassette::{Cassette, CassetteError, RenderedRun, RunContext, Step, StepKind, Track};
pub use config::ReplayConfig;
pub use script::{RunScript, ScriptFrame};
pub use state::{ConnStats, ReplayStats, RunRecord, RunStatus};

use serde_json::json;
use state::{Outbound, Shared, State};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Starts replay gateways.
#[derive(Debug)]
pub struct ReplayGateway;

impl ReplayGateway {
    /// Binds `addr` and serves on the current tokio runtime (also inside an actix-rt `System`,
    /// which runs on tokio). Fails when not called within a runtime, when the configuration is
    /// unusable ([`ReplayConfig::validate`]) or when the address cannot be bound.
    pub fn start(addr: SocketAddr, cfg: ReplayConfig) -> io::Result<ReplayHandle> {
        cfg.validate().map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| io::Error::other("ReplayGateway::start must be called within a tokio runtime"))?;
        let std_listener = std::net::TcpListener::bind(addr)?;
        std_listener.set_nonblocking(true)?;
        let local_addr = std_listener.local_addr()?;
        let listener = {
            let _guard = runtime.enter();
            tokio::net::TcpListener::from_std(std_listener)?
        };

        let mut tracks = cfg.cassette.tracks.clone();
        if let Some(n) = cfg.deltas_override {
            tracks = tracks.iter().map(|t| t.with_deltas(n)).collect();
        }
        if cfg.protocol == 3 && cfg.cassette.protocol >= 4 {
            tracks = tracks.iter().map(Track::downgraded_to_v3).collect();
        }
        let event_names = cassette::event_names(&cfg.cassette);
        let shared = Arc::new(Shared {
            cfg,
            tracks,
            event_names,
            state: Mutex::new(State {
                boot_id: uuid::Uuid::new_v4().to_string(),
                booted_at: Some(std::time::Instant::now()),
                ..State::default()
            }),
            ticks_enabled: AtomicBool::new(true),
            unavailable_connects: AtomicUsize::new(0),
            unavailable_retry_after_ms: AtomicU64::new(server::DEFAULT_RETRY_AFTER_MS),
            frozen: watch::channel(false).0,
            listening: watch::channel(true).0,
            paused: watch::channel(false).0,
            runs_changed: watch::channel(0).0,
            stopping: watch::channel(false).0,
        });
        let accept = runtime.spawn(server::accept_loop(Arc::clone(&shared), listener, local_addr));
        let ticks = runtime.spawn(server::tick_loop(Arc::clone(&shared)));
        tracing::info!(addr = %local_addr, protocol = shared.cfg.protocol, cassette = %shared.cfg.cassette.source, "replay gateway listening");
        Ok(ReplayHandle { inner: Arc::new(HandleInner { shared, local_addr, tasks: Mutex::new(vec![accept, ticks]) }) })
    }
}

#[derive(Debug)]
struct HandleInner {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

/// Control of a running replay gateway: address, counters, run records and fault injection.
/// Cheap to clone; dropping it leaves the gateway running (it ends with its runtime or `stop`).
#[derive(Debug, Clone)]
pub struct ReplayHandle {
    inner: Arc<HandleInner>,
}

impl ReplayHandle {
    /// The bound address (with the real port when started on port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr
    }

    /// `ws://127.0.0.1:PORT` (the loopback form of the bound address).
    pub fn url(&self) -> String {
        let addr = self.inner.local_addr;
        let host = if addr.ip().is_unspecified() || addr.ip().is_loopback() {
            if addr.is_ipv6() {
                "[::1]".to_owned()
            } else {
                "127.0.0.1".to_owned()
            }
        } else if addr.is_ipv6() {
            format!("[{}]", addr.ip())
        } else {
            addr.ip().to_string()
        };
        format!("ws://{host}:{}", addr.port())
    }

    /// Connection and per-connection counters.
    pub fn stats(&self) -> ReplayStats {
        self.inner.shared.lock().snapshot_stats()
    }

    /// Every run started since start, in start order (what the LLM would have received).
    pub fn runs(&self) -> Vec<RunRecord> {
        self.inner.shared.lock().records.clone()
    }

    /// Sends an arbitrary frame, verbatim, to every handshaken connection (malformed frames,
    /// unknown events, events of foreign runs...). Returns how many connections it was queued for.
    pub fn broadcast_raw(&self, frame_json: &str) -> usize {
        self.inner.shared.lock().broadcast_raw(frame_json)
    }

    /// Closes every socket abruptly (no close frame), as a crash looks to clients. With
    /// `forget_runs`, runs are also forgotten like by a restarted gateway: in-flight runs stop
    /// without any further frame, their ids (and the dedupe cache) are unknown afterwards, and
    /// the next `hello-ok` carries a new `bootId`.
    /// Without it, runs go on (their frames go nowhere) and `agent.wait` still knows them.
    pub fn drop_connections(&self, forget_runs: bool) {
        let mut st = self.inner.shared.lock();
        for c in st.conns.values() {
            let _ = c.tx.send(Outbound::Drop);
        }
        if forget_runs {
            st.boot_id = uuid::Uuid::new_v4().to_string();
            st.booted_at = Some(std::time::Instant::now());
            let runs: Vec<_> = st.runs.drain().collect();
            for (_, run) in runs {
                if let Some(task) = &run.task {
                    task.abort();
                }
                if run.final_payload.is_none() {
                    if let Some(rec) = st.records.get_mut(run.record) {
                        rec.status = RunStatus::Forgotten;
                    }
                }
            }
            for s in st.sessions.values_mut() {
                s.tail = None;
            }
        }
    }

    /// Turns `tick` events on or off (off simulates a silent, half-dead connection).
    pub fn set_ticks(&self, enabled: bool) {
        self.inner.shared.ticks_enabled.store(enabled, Ordering::Relaxed);
    }

    /// Sends `shutdown` `{reason, restartExpectedMs}` to every handshaken connection, then closes
    /// every socket with 1012 `service restart`, as the gateway does before a restart. The replay
    /// gateway keeps listening (the "restart" is instant) and keeps its runs.
    pub fn send_shutdown(&self, restart_expected_ms: Option<u64>) {
        let shared = &self.inner.shared;
        let reason = if restart_expected_ms.is_some() { "gateway restarting" } else { "gateway stopping" };
        // No `restartExpectedMs: null`: the schema's ShutdownEvent wants an integer or nothing.
        let mut payload = json!({"reason": reason});
        if let Some(ms) = restart_expected_ms {
            payload["restartExpectedMs"] = json!(ms);
        }
        let mut st = shared.lock();
        st.broadcast(shared.protocol(), "shutdown", &payload, None);
        for c in st.conns.values() {
            let _ = c.tx.send(Outbound::Close { code: 1012, reason: "service restart".to_owned() });
        }
    }

    /// Refuses the next `n` connects with `UNAVAILABLE` "gateway starting; retry shortly"
    /// (close 1013), as a gateway still starting its sidecars does.
    pub fn set_unavailable_connects(&self, n: usize) {
        self.set_unavailable_connects_retry_after(n, server::DEFAULT_RETRY_AFTER_MS);
    }

    /// Like [`Self::set_unavailable_connects`], with this `retryAfterMs` in the refusals (a faulty
    /// gateway may ask for anything, `u64::MAX` included). Later refusals keep it until changed.
    pub fn set_unavailable_connects_retry_after(&self, n: usize, retry_after_ms: u64) {
        let shared = &self.inner.shared;
        shared.unavailable_retry_after_ms.store(retry_after_ms, Ordering::SeqCst);
        shared.unavailable_connects.store(n, Ordering::SeqCst);
    }

    /// Freezes (`true`) or thaws the whole gateway, as `SIGSTOP`/`SIGCONT` would: no socket is read
    /// or written (TCP connections stay open, queued frames wait), no tick is sent, run clocks
    /// stand still, and sockets accepted meanwhile get their WebSocket upgrade only after the thaw.
    /// Clients see a silent connection and connect attempts that hang.
    pub fn set_frozen(&self, frozen: bool) {
        self.inner.shared.frozen.send_replace(frozen);
    }

    /// Closes (`false`) or reopens the listener on the same address. While closed, connects are
    /// refused (a socket accepted in the race is dropped at once); open connections are not
    /// touched: with [`Self::drop_connections`] this is a killed gateway, kept (`forget_runs`
    /// false) or restarted (`true`) when it comes back. Reopening rebinds the same port.
    pub fn set_listening(&self, listening: bool) {
        self.inner.shared.listening.send_replace(listening);
    }

    /// Runs whose message contains `marker` (the first registered marker that matches) end the way
    /// `script` says: see [`RunScript`]. Applies to runs started after the call.
    pub fn script_runs(&self, marker: &str, script: RunScript) {
        self.inner.shared.lock().scripts.push((marker.to_owned(), script));
    }

    /// Loses the next `n` `agent` requests whose message contains `marker`: they are counted in
    /// [`ReplayStats::requests_received`] (so a test sees they were sent) but never handled nor
    /// answered, as a request still in the buffers of a connection that died. Later ones (a retry
    /// with the same idempotency key) are handled as usual.
    pub fn lose_agent_requests(&self, marker: &str, n: usize) {
        self.inner.shared.lock().lost_agent_requests.push((marker.to_owned(), n));
    }

    /// Holds every run before its next event (ACKs still go out); `false` lets them go on. A
    /// paused run's recorded clock stands still, so the remaining gaps are kept.
    pub fn set_paused(&self, paused: bool) {
        self.inner.shared.paused.send_replace(paused);
    }

    /// Graceful stop: stops listening, sends `shutdown` (`gateway stopping`) and closes every
    /// socket with 1012, cancels runs in flight. Returns when the listener is closed.
    pub async fn stop(&self) {
        let shared = &self.inner.shared;
        shared.stopping.send_replace(true);
        {
            let mut st = shared.lock();
            st.broadcast(shared.protocol(), "shutdown", &json!({"reason": "gateway stopping"}), None);
            for c in st.conns.values() {
                let _ = c.tx.send(Outbound::Close { code: 1012, reason: "service restart".to_owned() });
            }
            for run in st.runs.values() {
                if let Some(task) = &run.task {
                    task.abort();
                }
            }
        }
        let tasks: Vec<JoinHandle<()>> = std::mem::take(&mut *self.inner.tasks.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        for t in tasks {
            let _ = t.await;
        }
    }
}

/// `clawmux replay-gateway`: serves until ctrl-c (or SIGTERM), printing the URL to connect to.
/// With `stats_listen`, also serves the counters as JSON (`GET /stats`, see [`stats_json`]).
pub async fn run_standalone(listen: SocketAddr, cfg: ReplayConfig, stats_listen: Option<SocketAddr>) -> io::Result<()> {
    let tracks: Vec<String> = cfg.cassette.tracks.iter().map(|t| t.name.clone()).collect();
    let source = cfg.cassette.source.clone();
    let protocol = cfg.protocol;
    let gw = ReplayGateway::start(listen, cfg)?;
    println!("replay gateway ({source}, protocol {protocol}, tracks: {}) listening on {}", tracks.join(", "), gw.url());
    let stats_task = match stats_listen {
        Some(addr) => {
            let (bound, task) = start_stats_server(addr, gw.clone())?;
            println!("replay gateway stats on http://{bound}/stats");
            Some(task)
        }
        None => None,
    };
    wait_for_signal().await?;
    if let Some(t) = stats_task {
        t.abort();
    }
    gw.stop().await;
    Ok(())
}

/// The counters as one JSON object: totals since start (`framesSent`, `bytesSent`,
/// `eventsSent` by name, connections opened and open, handshakes) and every listed connection
/// (`connId`, `open`, `handshaken`, `sessionScoped`, `framesSent`, `bytesSent`, `eventsSent`).
/// Benchmarks read it before and after a load and compare client designs by the difference.
pub fn stats_json(stats: &ReplayStats) -> serde_json::Value {
    let conns: Vec<serde_json::Value> = stats
        .connections
        .iter()
        .map(|c| {
            json!({
                "connId": c.conn_id, "open": c.open, "handshaken": c.handshaken, "scopes": c.scopes,
                "sessionScoped": c.session_scoped, "framesSent": c.frames_sent, "bytesSent": c.bytes_sent,
                "eventsSent": c.events_sent,
            })
        })
        .collect();
    json!({
        "connectionsOpened": stats.connections_opened,
        "connectionsCurrent": stats.connections_current,
        "handshakesOk": stats.handshakes_ok,
        "handshakesFailed": stats.handshakes_failed,
        "framesSent": stats.frames_sent,
        "bytesSent": stats.bytes_sent,
        "eventsSent": stats.events_sent,
        "requestsReceived": stats.requests_received,
        "connections": conns,
    })
}

/// Largest request head the stats server reads.
const STATS_MAX_REQUEST: usize = 8 * 1024;
/// How long a stats client may take to send its request.
const STATS_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Serves `GET /stats` (JSON, [`stats_json`]) on `addr` until the task is aborted. A plain
/// HTTP/1.1 responder (one request per connection, `Connection: close`): the bench script and
/// tests only need `curl`, and a web framework would add threads to the process being measured.
pub fn start_stats_server(addr: SocketAddr, gw: ReplayHandle) -> io::Result<(SocketAddr, JoinHandle<()>)> {
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| io::Error::other("the stats server must start within a tokio runtime"))?;
    let std_listener = std::net::TcpListener::bind(addr)?;
    std_listener.set_nonblocking(true)?;
    let bound = std_listener.local_addr()?;
    let listener = {
        let _guard = runtime.enter();
        tokio::net::TcpListener::from_std(std_listener)?
    };
    let task = runtime.spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            };
            let gw = gw.clone();
            tokio::spawn(async move {
                let _ = tokio::time::timeout(STATS_READ_TIMEOUT, answer_stats(stream, &gw)).await;
            });
        }
    });
    Ok((bound, task))
}

async fn answer_stats(mut stream: tokio::net::TcpStream, gw: &ReplayHandle) -> io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < STATS_MAX_REQUEST {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&buf);
    let mut parts = head.split_whitespace();
    let (method, path) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    let (status, body) = match (method, path.split('?').next().unwrap_or_default()) {
        ("GET", "/stats") => ("200 OK", stats_json(&gw.stats()).to_string()),
        ("GET", _) => ("404 Not Found", json!({"error": {"code": "not_found", "message": "only GET /stats is served here"}}).to_string()),
        _ => ("405 Method Not Allowed", json!({"error": {"code": "method_not_allowed", "message": "use GET /stats"}}).to_string()),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(unix)]
async fn wait_for_signal() -> io::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r,
        _ = term.recv() => Ok(()),
    }
}

#[cfg(not(unix))]
async fn wait_for_signal() -> io::Result<()> {
    tokio::signal::ctrl_c().await
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod stats_tests {
    use super::*;
    use futures_util::StreamExt;

    #[tokio::test]
    async fn stats_endpoint_reports_totals_and_connections() {
        let gw = ReplayGateway::start("127.0.0.1:0".parse().unwrap(), ReplayConfig::default().speed(0.0)).unwrap();
        let (addr, task) = start_stats_server("127.0.0.1:0".parse().unwrap(), gw.clone()).unwrap();
        // One socket: the gateway sends it the challenge.
        let (mut ws, _) = tokio_tungstenite::connect_async(gw.url()).await.unwrap();
        let first = tokio::time::timeout(std::time::Duration::from_secs(5), ws.next()).await.unwrap().unwrap().unwrap();
        let challenge_len = first.into_text().unwrap().len() as u64;
        let http = reqwest::Client::new();
        let v: serde_json::Value = http.get(format!("http://{addr}/stats")).send().await.unwrap().json().await.unwrap();
        assert_eq!(v["connectionsOpened"], 1);
        assert_eq!(v["framesSent"], 1);
        assert_eq!(v["bytesSent"], challenge_len);
        assert_eq!(v["eventsSent"]["connect.challenge"], 1);
        assert_eq!(v["connections"][0]["framesSent"], 1);
        assert_eq!(v["connections"][0]["handshaken"], false);
        let r = http.get(format!("http://{addr}/other")).send().await.unwrap();
        assert_eq!(r.status(), 404);
        let r = http.post(format!("http://{addr}/stats")).send().await.unwrap();
        assert_eq!(r.status(), 405);
        task.abort();
        gw.stop().await;
    }
}
