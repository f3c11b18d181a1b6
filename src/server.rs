//! Wiring: the run store, the supervisor, the registry, the LLM proxy, the HTTP server; the restart
//! path (continuing every unfinished run of the store); shutdown (hand off or cancel).

use crate::agents::AgentRegistry;
use crate::api::{self, AppState};
use crate::config::{Config, OutboundHeaders};
use crate::store::writer::StoreMetrics;
use crate::store::{Retention, RunStore};
use actix::Actor;
use actix_web::{web, App, HttpServer};
use clawmux_actors::messages::{Drain, InFlight, ListenLink};
use clawmux_actors::metrics::Metrics;
use clawmux_actors::supervisor::Disconnect;
use clawmux_actors::{
    ErrorCode, OutboundHeadersMode, Registry, RegistryConfig, RunEvent, RunOutcome, RunSink, ShutdownMode,
    StatusHandle, Supervisor, SupervisorConfig,
};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// A running clawmux (the HTTP server and its actors).
pub struct Running {
    /// Bound HTTP address (useful with port 0).
    pub addr: SocketAddr,
    /// Stops the HTTP server.
    pub server: actix_web::dev::ServerHandle,
    /// The shared state (tests read the store and status).
    pub state: web::Data<AppState>,
    /// Resolves when the HTTP server stops.
    pub done: tokio::task::JoinHandle<std::io::Result<()>>,
    /// The LLM attribution proxy, when an upstream is configured: its bound address and handle.
    pub proxy: Option<(SocketAddr, actix_web::dev::ServerHandle)>,
    /// The supervisor (closed at shutdown).
    pub supervisor: actix::Addr<Supervisor>,
    /// Flips `AppState::stopping`.
    stopping: tokio::sync::watch::Sender<bool>,
    /// Runs continued from the store at start.
    pub resumed: usize,
    /// The threads of the session actors and of the gateway connection.
    threads: Threads,
}

/// The threads clawmux starts for its actors. They outlive the runtime that started them, so
/// whoever drops a [`Running`] without [`shutdown`] (a test, a failed start's caller) stops them
/// here: a supervisor left behind would go on reconnecting to its gateway's address for the rest of
/// the process, and a later gateway on that port would count its handshakes as another client's.
struct Threads {
    /// The session actors' threads, stopped at the end of [`shutdown`].
    shards: Vec<actix::Arbiter>,
    /// The gateway connection's and its supervisor's thread, stopped with the shards.
    gateway: actix::Arbiter,
    /// Set by [`shutdown`] once the gateway thread's own stop is scheduled (after the close frame's
    /// grace), which a drop must not cut short.
    gateway_stopping: std::sync::atomic::AtomicBool,
}

impl Drop for Threads {
    fn drop(&mut self) {
        for shard in &self.shards {
            shard.stop();
        }
        if !self.gateway_stopping.load(std::sync::atomic::Ordering::Acquire) {
            self.gateway.stop();
        }
    }
}

/// Loads (or creates) the device identity as `CLAWMUX_DEVICE_IDENTITY` says.
pub fn load_device(cfg: &Config) -> Result<Option<Arc<clawmux_actors::device::DeviceIdentity>>, String> {
    use crate::config::DeviceMode;
    use clawmux_actors::device::{DeviceError, DeviceIdentity};
    match cfg.device_identity {
        DeviceMode::Off => Ok(None),
        DeviceMode::On => DeviceIdentity::load_or_create(&cfg.device_key_file).map(|d| Some(Arc::new(d))).map_err(|e| e.to_string()),
        DeviceMode::Auto => match DeviceIdentity::load_or_create(&cfg.device_key_file) {
            Ok(d) => Ok(Some(Arc::new(d))),
            // An existing key that cannot be used is an error even in auto: silently becoming a new
            // device would lose the gateway's approval of the old one.
            Err(e @ (DeviceError::Corrupt { .. } | DeviceError::TooOpen { .. })) => Err(e.to_string()),
            Err(e) => {
                tracing::warn!(error = %e, "no device identity (CLAWMUX_DEVICE_IDENTITY=auto); connecting without one");
                Ok(None)
            }
        },
    }
}

/// Supervisor settings from the configuration (loads the device identity).
pub fn supervisor_config(cfg: &Config, gateway_url: &str) -> Result<SupervisorConfig, String> {
    let mut s = SupervisorConfig::new(gateway_url);
    s.device = load_device(cfg)?;
    s.token = cfg.gateway_token.as_ref().map(|t| t.expose().to_owned());
    s.outbound_headers = match cfg.outbound_headers {
        OutboundHeaders::On => OutboundHeadersMode::On,
        OutboundHeaders::Off => OutboundHeadersMode::Off,
        OutboundHeaders::Auto => OutboundHeadersMode::Auto,
    };
    s.max_runs = cfg.max_runs;
    Ok(s)
}

/// Parts a caller may put in place of the ones the configuration selects (tests). The default
/// takes everything from the configuration.
#[derive(Default)]
pub struct StartOptions {
    /// The workspace of branch runs, instead of the git relay `CLAWMUX_RELAY_CONTAINER` configures
    /// (tests use a fake one: no Docker, and steps that end when the test says).
    pub workspace: Option<Arc<dyn clawmux_actors::branch::Workspace>>,
    /// The agent variants, instead of `CLAWMUX_AGENTS_FILE` / the built-in default.
    pub agents: Option<AgentRegistry>,
    /// The runner of ephemeral containers, instead of the Docker engine (tests: a fake).
    pub ephemeral_runner: Option<Arc<dyn crate::ephemeral::runner::Runner>>,
    /// The ephemeral runs' settings, instead of `CLAWMUX_EPHEMERAL_*` (tests: their own directory).
    pub ephemeral_config: Option<crate::ephemeral::EphemeralConfig>,
}

/// Starts everything inside the current actix System and continues the store's unfinished runs.
/// Signals are not handled here (see [`run_until_signal`]).
pub async fn start(cfg: Config, sup: SupervisorConfig) -> std::io::Result<Running> {
    start_with(cfg, sup, StartOptions::default()).await
}

/// [`start`] with some parts given by the caller.
pub async fn start_with(cfg: Config, sup: SupervisorConfig, mut options: StartOptions) -> std::io::Result<Running> {
    let registry = prometheus::Registry::new();
    let agents = match options.agents.take() {
        Some(a) => a,
        None => AgentRegistry::from_env(&|k| std::env::var(k).ok()).map_err(std::io::Error::other)?,
    };
    let metrics = Metrics::new(&registry).map_err(std::io::Error::other)?.with_agents(agents.agent_ids());
    let store_metrics = StoreMetrics::new(&registry).map_err(std::io::Error::other)?;
    let retention = Retention {
        max_age_ms: i64::try_from(cfg.run_retention_sec.saturating_mul(1000)).unwrap_or(i64::MAX),
        max_count: cfg.run_retention_max,
    };
    // First: a store that cannot be opened stops startup with one line naming it.
    let store = RunStore::open(&cfg.store_url, retention, store_metrics, Some(metrics.frame_to_client.clone()))
        .await
        .map_err(|e| std::io::Error::other(e.0))?;
    tracing::info!(store = %store.url(), replica = %cfg.replica_id, "run store open");
    // Before anything else starts: a port in use stops startup with one line naming it. Until
    // the API serves (below), its port answers every request `503` with `Retry-After` rather than
    // leaving it hanging through the steps before (the engine, the relay, restart recovery).
    let api_starting = crate::api::starting::Starting::answer(listen_on(cfg.listen, "CLAWMUX_LISTEN")?)?;
    let proxy_listener = match cfg.llm_upstream_url {
        Some(_) => Some(listen_on(cfg.proxy_listen, "CLAWMUX_PROXY_LISTEN")?),
        None => None,
    };
    // Before anything is admitted: every run this process stores is its own.
    let lease = crate::lease::lease_of(&cfg);
    store.set_lease(&lease);
    spawn_heartbeat(store.clone(), cfg.replica_id.clone());
    // Without the LLM proxy nothing counts tokens: token budgets refuse their runs (fail-closed).
    let metered = cfg.llm_upstream_url.is_some();
    let budgets = crate::tenants::budget::Budgets::load(store.tenants(), store.writer(), metered, store.shared()).await.map_err(|e| std::io::Error::other(e.0))?;
    let tenants = Arc::new(crate::tenants::Tenants {
        store: store.tenants(),
        budgets: budgets.clone(),
        allow: crate::tenants::webhook::Allow::parse(&cfg.webhook_allow),
        admin_webhook_secret: cfg.webhook_secret.clone(),
        keys_seen: Default::default(),
    });
    let status: StatusHandle = StatusHandle::default();
    if let Ok(mut st) = status.write() {
        st.device_id = sup.device.as_ref().map(|d| d.device_id().to_owned());
    }
    let registry_cfg = RegistryConfig { max_runs: sup.max_runs, max_starting: cfg.max_starting, session: sup.session() };
    if cfg.api_token.is_none() {
        tracing::warn!("CLAWMUX_API_TOKEN is not set: the API serves loopback clients only");
    }
    let (proxy, attributions, proxy_state) = match &cfg.llm_upstream_url {
        Some(upstream) => {
            let attributions = Arc::new(crate::attribution::Attributions::new());
            let listener = proxy_listener.ok_or_else(|| std::io::Error::other("the proxy's listener was not bound"))?;
            let (addr, handle, proxy_state) = start_proxy(&cfg, listener, upstream, attributions.clone(), budgets.clone(), &store, &registry)?;
            tracing::info!(%addr, upstream = %upstream, "LLM attribution proxy listening");
            (Some((addr, handle)), Some(attributions), Some(proxy_state))
        }
        None => (None, None, None),
    };
    // The runs of other replicas whose LLM calls this proxy forwards (a shared store).
    let remote = proxy_state.as_ref().and_then(|p| p.remote.clone());
    let ephemeral = match agents.has_ephemeral() {
        false => None,
        true => {
            // Its LLM socket is the proxy: without one, an ephemeral agent could call no model.
            let Some(proxy_state) = proxy_state else {
                return Err(std::io::Error::other("an ephemeral agent variant needs the LLM proxy: set CLAWMUX_LLM_UPSTREAM_URL"));
            };
            let eph_cfg = match options.ephemeral_config.take() {
                Some(c) => c,
                None => crate::ephemeral::EphemeralConfig::from_env(&|k| std::env::var(k).ok()).map_err(std::io::Error::other)?,
            };
            let runner = match options.ephemeral_runner.take() {
                Some(r) => r,
                None => Arc::new(crate::ephemeral::runner::DockerRunner::connect().map_err(|e| std::io::Error::other(e.to_string()))?),
            };
            let eph = crate::ephemeral::Ephemeral::new(runner, Some(proxy_state), eph_cfg);
            eph.reap().await;
            Some(eph)
        }
    };
    let workspace: Option<Arc<dyn clawmux_actors::branch::Workspace>> = match options.workspace {
        Some(w) => Some(w),
        None => match crate::relay::RelayConfig::from_app_config(&cfg).map_err(std::io::Error::other)? {
            Some(rc) => {
                let relay = crate::relay::GitRelay::connect(rc).await.map_err(|e| std::io::Error::other(format!("git relay: {e}")))?;
                tracing::info!(container = %relay.config().container, "git relay ready");
                Some(Arc::new(relay))
            }
            None => None,
        },
    };
    let relay = workspace.is_some();
    // The session actors' threads: the supervisor's thread reads, decodes and routes every frame; each
    // run's own work (its deltas, its store writes, its SSE fan-out) happens on its shard.
    // Started after every step that can fail: an actor started but never polled panics in actix
    // when the runtime is dropped on the way out of a failed start.
    // The gateway connection and its supervisor on a thread of their own: frames are decoded and
    // routed there, never queued behind admissions (the registry's thread).
    let threads = Threads {
        gateway: actix::Arbiter::new(),
        shards: (0..cfg.shards).map(|_| actix::Arbiter::new()).collect(),
        gateway_stopping: std::sync::atomic::AtomicBool::new(false),
    };
    let supervisor = {
        let (metrics, status) = (metrics.clone(), status.clone());
        Supervisor::start_in_arbiter(&threads.gateway.handle(), move |_| Supervisor::new(sup, metrics, status))
    };
    let run_start = metrics.run_start.clone();
    let run_registry = Registry::new(registry_cfg, metrics, status.clone(), Supervisor::port(&supervisor), workspace.clone())
        .with_shards(threads.shards.iter().map(actix::Arbiter::handle).collect())
        .start();
    supervisor.do_send(ListenLink(run_registry.clone().recipient()));
    {
        // A run whose account's budget is spent ends `budget_exceeded` (the proxy refused its call).
        // The registry queues the cancel for the run's session while handling this message.
        let r = run_registry.clone();
        budgets.on_exceeded(Box::new(move |run_id| {
            let cancel = clawmux_actors::messages::Cancel { run_id: run_id.to_owned(), reason: clawmux_actors::CancelReason::BudgetExceeded };
            let sent = r.send(cancel).timeout(Duration::from_secs(5));
            Box::pin(async move {
                let _ = sent.await;
            })
        }));
    }
    actix::spawn(crate::tenants::webhook::run_deliveries(
        tenants.store.clone(),
        Arc::new(crate::tenants::StoreSecrets { store: tenants.store.clone(), admin: cfg.webhook_secret.clone() }),
        crate::tenants::webhook::DeliveryConfig {
            poll: Duration::from_millis(250),
            max_age: Duration::from_secs(cfg.webhook_max_age_sec),
            attempt_timeout: Duration::from_secs(10),
            allow: crate::tenants::webhook::Allow::parse(&cfg.webhook_allow),
        },
    ));
    let (stopping_tx, stopping) = tokio::sync::watch::channel(false);
    // The API's HTTP workers are the shards of the runs they admit (`src/shards.rs`).
    let shards = Arc::new(crate::shards::Shards::with_metrics(&registry).map_err(std::io::Error::other)?);
    let mut admission = crate::admission::Admission::new(store.clone(), run_registry.clone(), attributions.clone(), budgets.clone(), workspace.clone())
        .with_shards(shards.clone());
    if let Some(eph) = &ephemeral {
        admission = admission.with_ephemeral(agents.clone(), eph.clone());
    }
    let state = web::Data::new(AppState {
        cfg,
        store,
        registry: run_registry,
        admission,
        status,
        metrics: registry,
        run_start,
        agents,
        attributions,
        relay,
        workspace,
        tenants,
        stopping,
    });
    let aborts = Arc::new(tokio::sync::Notify::new());
    if state.store.shared() {
        // Before the runs are continued: an end another replica stores from now on is heard.
        let told = remote.clone();
        state.store.on_notes(
            Box::new(move |run_id| {
                if let Some(r) = &told {
                    r.ended(run_id);
                }
            }),
            aborts.clone(),
        );
        if let Some(r) = &remote {
            r.spawn_revocations();
        }
    }
    let resumed = resume(&state, &lease).await;
    if state.store.shared() {
        crate::lease::spawn(state.clone(), lease, aborts);
    }
    let sweeper = state.clone();
    actix::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(10));
        loop {
            every.tick().await;
            if let Err(e) = sweeper.store.sweep().await {
                tracing::warn!(error = %e, "run store retention sweep failed");
            }
            // Limits set with `clawmux limits set` (another process) apply within one sweep.
            if let Err(e) = sweeper.tenants.budgets.reload().await {
                tracing::warn!(error = %e, "cannot re-read account limits");
            }
        }
    });
    let api_listener = api_starting.listener().await?;
    let app_state = state.clone();
    let server = HttpServer::new(move || {
        // Called once on each worker's thread as it starts: the worker becomes a shard, with a
        // store lane of its own.
        app_state.store.start_lane_here();
        shards.join_here();
        App::new().app_data(app_state.clone()).configure(api::routes)
    })
    .workers(state.cfg.shards.max(1))
    .on_connect(tune_connection(Duration::from_secs(state.cfg.send_timeout_sec)))
        .disable_signals()
        // A caller that closes its connection is gone (`onDisconnect: abort` must cancel its run
        // now): with half-closed connections allowed, actix notices only when a write fails, i.e.
        // up to two keep-alive periods (30 s) later for a quiet SSE stream, never for a JSON wait.
        .h1_allow_half_closed(false)
        .shutdown_timeout(5)
        .listen(api_listener)?;
    let addr = server.addrs().first().copied().ok_or_else(|| std::io::Error::other("no bound address"))?;
    let server = server.run();
    let handle = server.handle();
    let done = actix::spawn(server);
    Ok(Running { addr, server: handle, state, done, proxy, supervisor, stopping: stopping_tx, resumed, threads })
}

/// Continues every unfinished run of the store this process may continue (on a shared store: its
/// own and those whose lease expired), in admission order (so each session key's and branch key's
/// queue is what it was). Returns how many.
async fn resume(state: &web::Data<AppState>, lease: &crate::store::Lease) -> usize {
    let stored = match state.store.resume(lease).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot read the unfinished runs of the store; none is continued");
            return 0;
        }
    };
    let started = std::time::Instant::now();
    let resumed = continue_runs(state, stored).await;
    if resumed > 0 {
        tracing::info!(runs = resumed, elapsed_ms = started.elapsed().as_millis() as u64, "continued the unfinished runs of the store");
    }
    resumed
}

/// Continues stored runs (a restart, a takeover) in the order given; a run that cannot be
/// continued ends with an error saying why. Returns how many were continued.
pub(crate) async fn continue_runs(state: &web::Data<AppState>, stored: Vec<(Arc<crate::store::RunLog>, crate::store::RunRow)>) -> usize {
    let mut resumed = 0;
    for (log, row) in stored {
        match state.admission.resume(&log, &row).await {
            Ok(_) => resumed += 1,
            Err(e) => {
                // Ended, not lost: the run gets its terminal event and says why.
                tracing::error!(run_id = %row.run_id, error = %e, "a stored run cannot be continued");
                // A store's error names its file or server: the tenant gets its cause only.
                let why = match &e {
                    crate::admission::Refused::Store(se) => se.for_tenant().to_owned(),
                    other => other.to_string(),
                };
                let msg = format!("clawmux could not continue the run (after a restart, a takeover or a store outage): {why}");
                log.emit(RunEvent::Finished(RunOutcome::failed(ErrorCode::Internal, msg, String::new())));
            }
        }
    }
    resumed
}

/// A listening socket on `addr` (as actix binds one: address reuse, a backlog for bursts of
/// thousands of connections); its error names the address and `setting`.
fn listen_on(addr: SocketAddr, setting: &str) -> std::io::Result<std::net::TcpListener> {
    let named = |e: std::io::Error| std::io::Error::new(e.kind(), format!("cannot listen on {addr} ({setting}): {e}"));
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4() } else { tokio::net::TcpSocket::new_v6() }.map_err(named)?;
    socket.set_reuseaddr(true).map_err(named)?;
    socket.bind(addr).map_err(named)?;
    socket.listen(LISTEN_BACKLOG).and_then(tokio::net::TcpListener::into_std).map_err(named)
}

/// Pending connections a listener holds (actix's own default): a burst of POSTs is not refused.
const LISTEN_BACKLOG: u32 = 2048;

/// Starts the LLM attribution proxy on `listener` (`cfg.proxy_listen`).
fn start_proxy(
    cfg: &Config,
    listener: std::net::TcpListener,
    upstream: &str,
    attributions: Arc<crate::attribution::Attributions>,
    budgets: Arc<crate::tenants::budget::Budgets>,
    store: &Arc<RunStore>,
    registry: &prometheus::Registry,
) -> std::io::Result<(SocketAddr, actix_web::dev::ServerHandle, web::Data<crate::proxy::ProxyState>)> {
    let audit = crate::audit::AuditLog::open(&cfg.audit_dir, cfg.audit_max_bytes)
        .map_err(|e| std::io::Error::other(format!("cannot open the audit log in {}: {e}", cfg.audit_dir.display())))?;
    tracing::info!(path = %audit.path().display(), "LLM call audit log");
    let metrics = crate::proxy::ProxyMetrics::new(registry).map_err(std::io::Error::other)?;
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .pool_idle_timeout(Duration::from_secs(60))
        .build()
        .map_err(std::io::Error::other)?;
    // Shared by replicas: the calls of their runs are forwarded here too, and every replica lists
    // the calls this one forwarded.
    let shared = store.shared();
    let remote = shared.then(|| crate::remote_runs::RemoteRuns::new(store.clone(), attributions.clone(), budgets.clone()));
    let state = web::Data::new(crate::proxy::ProxyState {
        attributions,
        upstream: upstream.to_owned(),
        key: cfg.llm_upstream_key.clone(),
        client,
        audit: crate::proxy::AuditSink::start(Arc::new(audit)),
        metrics,
        budgets: Some(budgets),
        remote,
        shared_audit: shared.then(|| store.writer()),
    });
    let shared = state.clone();
    let server = HttpServer::new(move || App::new().app_data(state.clone()).configure(crate::proxy::routes))
        .on_connect(tune_connection(Duration::from_secs(cfg.send_timeout_sec)))
        .disable_signals()
        // A handoff lets the LLM streams of the runs in flight finish before the process exits.
        .shutdown_timeout(PROXY_DRAIN.as_secs())
        // A gateway stalled between connecting and sending its request (a busy Node event loop)
        // must not get actix's 5 s `408`: OpenClaw retries it with a rewritten prompt.
        .client_request_timeout(Duration::from_secs(60))
        .listen(listener)?;
    let addr = server.addrs().first().copied().ok_or_else(|| std::io::Error::other("no bound proxy address"))?;
    let server = server.run();
    let handle = server.handle();
    actix::spawn(server);
    Ok((addr, handle, shared))
}

/// How long a stopping clawmux lets in-flight LLM streams through its proxy finish.
const PROXY_DRAIN: Duration = Duration::from_secs(30);

/// Socket options of each accepted connection (`send_timeout`: `CLAWMUX_SEND_TIMEOUT_SEC`).
fn tune_connection(send_timeout: Duration) -> impl Fn(&dyn std::any::Any, &mut actix_web::dev::Extensions) + Send + Sync + 'static {
    let ms = u32::try_from(send_timeout.as_millis()).unwrap_or(u32::MAX);
    move |conn, _ext| {
        let Some(tcp) = conn.downcast_ref::<actix_web::rt::net::TcpStream>() else { return };
        // Small SSE events must leave at once: Nagle's algorithm would hold one back until the
        // client's (delayed) ACK of the previous write.
        let _ = tcp.set_nodelay(true);
        // A client that stops reading shuts its TCP window; actix then stops polling the response
        // (an SSE stream and the run's event log it holds) and never times the write out. The
        // kernel cuts such a connection once written data has waited this long (Linux >= 5.11
        // counts a window that stays shut, RFC 5482), so the response is dropped.
        #[cfg(any(target_os = "linux", target_os = "android"))]
        if let Err(e) = rustix::net::sockopt::set_tcp_user_timeout(tcp, ms) {
            tracing::warn!(error = %e, "cannot set TCP_USER_TIMEOUT on a client connection");
        }
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        let _ = ms;
    }
}

/// Stops clawmux. `CLAWMUX_SHUTDOWN=handoff` (default): nothing new is admitted (`503`, also for
/// re-attaching to an unfinished run), live SSE streams end (clients re-attach to the next
/// process), the session actors stop without touching their gateway runs, in-flight LLM streams
/// through the proxy finish, the store is flushed, then the HTTP server stops; the next start
/// continues every run. `cancel`: every run gets its terminal event (`aborted`) and its
/// gateway run is cancelled first.
pub async fn shutdown(running: &Running) {
    let state = &running.state;
    let mode = state.cfg.shutdown;
    if mode == ShutdownMode::Handoff {
        // Streams end now (clients re-attach to the next process); in cancel mode they end with
        // their runs' terminal events.
        let _ = running.stopping.send(true);
    }
    let live = state.registry.send(Drain(mode)).await.unwrap_or(0);
    tracing::info!(live, mode = ?mode, "shutting down");
    // Every run leaves the registry: suspended session actors at once, ephemeral runs (cancelled
    // in either mode: a container cannot be handed to the next process) once their containers are
    // removed, cancelled gateway runs with their terminal events. Branch runs may still publish
    // after their gateway run ended.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(12);
    while tokio::time::Instant::now() < deadline {
        let in_flight = state.registry.send(InFlight).await.unwrap_or(0);
        if in_flight == 0 && (mode == ShutdownMode::Handoff || state.store.unfinished() == 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = running.stopping.send(true);
    running.supervisor.do_send(Disconnect);
    if let Some((_, proxy)) = &running.proxy {
        proxy.stop(true).await;
    }
    // Whatever the runs and the proxy wrote is stored before the process goes.
    state.store.flush().await;
    if mode == ShutdownMode::Handoff {
        // Other replicas sharing the store continue the suspended runs now, not a lease later.
        match state.store.release(&crate::lease::lease_of(&state.cfg)).await {
            Ok(n) if n > 0 => tracing::info!(runs = n, "handed this replica's runs to the others (leases released)"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "cannot release this replica's run leases; other replicas take its runs over once they expire"),
        }
    }
    // Last: while the proxy drains (up to 30 s), callers get `503` + `Retry-After` and documents,
    // not refused connections.
    running.server.stop(true).await;
    for shard in &running.threads.shards {
        shard.stop();
    }
    // After the supervisor's grace for the gateway's close frame (it sent `Disconnect` above). The
    // thread stops itself, so the stop happens even if the caller's runtime ends first.
    running.threads.gateway_stopping.store(true, std::sync::atomic::Ordering::Release);
    running.threads.gateway.spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        actix::Arbiter::current().stop();
    });
}

/// Runs until SIGINT or SIGTERM, then shuts down as `CLAWMUX_SHUTDOWN` says.
pub async fn run_until_signal(running: Running) -> std::io::Result<()> {
    wait_for_signal().await;
    tracing::info!("signal received; shutting down");
    shutdown(&running).await;
    match running.done.await {
        Ok(r) => r,
        Err(e) => Err(std::io::Error::other(e)),
    }
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) {
            (Ok(mut int), Ok(mut term)) => {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// How often a process renews its heartbeat row (stores shared by several processes).
const HEARTBEAT_EVERY: Duration = Duration::from_secs(5);

/// Renews this process's heartbeat row while it runs; a failure is logged once per streak (the
/// store being down is reported by admission and the writer already).
fn spawn_heartbeat(store: Arc<RunStore>, replica_id: String) {
    let started_at_ms = crate::store::now_ms();
    actix::spawn(async move {
        let mut every = tokio::time::interval(HEARTBEAT_EVERY);
        let mut failing = false;
        loop {
            every.tick().await;
            let beat = crate::store::Replica {
                id: replica_id.clone(),
                started_at_ms,
                heartbeat_at_ms: crate::store::now_ms(),
                version: env!("CARGO_PKG_VERSION").to_owned(),
            };
            match store.heartbeat(&beat).await {
                Ok(()) if failing => {
                    failing = false;
                    tracing::info!(replica = %replica_id, "heartbeat stored again");
                }
                Ok(()) => {}
                Err(e) if !failing => {
                    failing = true;
                    tracing::warn!(replica = %replica_id, error = %e, "cannot store this process's heartbeat");
                }
                Err(_) => {}
            }
        }
    });
}
