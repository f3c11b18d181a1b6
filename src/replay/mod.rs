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
//! - `server`: accept loop, per-socket task and handshake, tick task.
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
mod methods;
mod run;
mod schema;
mod server;
mod state;

pub use cassette::{Cassette, CassetteError, RenderedRun, RunContext, Step, StepKind, Track};
pub use config::ReplayConfig;
pub use state::{ConnStats, ReplayStats, RunRecord, RunStatus};

use serde_json::json;
use state::{Outbound, Shared, State};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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
            state: Mutex::new(State { boot_id: uuid::Uuid::new_v4().to_string(), ..State::default() }),
            ticks_enabled: AtomicBool::new(true),
            unavailable_connects: AtomicUsize::new(0),
            paused: watch::channel(false).0,
            runs_changed: watch::channel(0).0,
            stopping: watch::channel(false).0,
        });
        let accept = runtime.spawn(server::accept_loop(Arc::clone(&shared), listener));
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
        let mut st = shared.lock();
        st.broadcast(shared.protocol(), "shutdown", &json!({"reason": reason, "restartExpectedMs": restart_expected_ms}), None);
        for c in st.conns.values() {
            let _ = c.tx.send(Outbound::Close { code: 1012, reason: "service restart".to_owned() });
        }
    }

    /// Refuses the next `n` connects with `UNAVAILABLE` "gateway starting; retry shortly"
    /// (close 1013), as a gateway still starting its sidecars does.
    pub fn set_unavailable_connects(&self, n: usize) {
        self.inner.shared.unavailable_connects.store(n, Ordering::SeqCst);
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
            st.broadcast(shared.protocol(), "shutdown", &json!({"reason": "gateway stopping", "restartExpectedMs": null}), None);
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
pub async fn run_standalone(listen: SocketAddr, cfg: ReplayConfig) -> io::Result<()> {
    let tracks: Vec<String> = cfg.cassette.tracks.iter().map(|t| t.name.clone()).collect();
    let source = cfg.cassette.source.clone();
    let protocol = cfg.protocol;
    let gw = ReplayGateway::start(listen, cfg)?;
    println!("replay gateway ({source}, protocol {protocol}, tracks: {}) listening on {}", tracks.join(", "), gw.url());
    wait_for_signal().await?;
    gw.stop().await;
    Ok(())
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
