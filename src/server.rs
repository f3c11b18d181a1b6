//! Wiring: the supervisor, the run store, the HTTP server, signals.

use crate::agents::AgentRegistry;
use crate::api::{self, AppState};
use crate::config::{Config, OutboundHeaders};
use crate::store::RunStore;
use actix::Actor;
use actix_web::{web, App, HttpServer};
use clawmux_actors::metrics::Metrics;
use clawmux_actors::supervisor::{Disconnect, InFlight, ShutdownAll};
use clawmux_actors::{OutboundHeadersMode, StatusHandle, Supervisor, SupervisorConfig};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// A running clawmux (the HTTP server and its supervisor).
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

/// Starts the supervisor and the HTTP server inside the current actix System. Signals are not
/// handled here (see [`run_until_signal`]).
pub async fn start(cfg: Config, sup: SupervisorConfig) -> std::io::Result<Running> {
    let registry = prometheus::Registry::new();
    let metrics = Metrics::new(&registry).map_err(std::io::Error::other)?;
    let status: StatusHandle = StatusHandle::default();
    if let Ok(mut st) = status.write() {
        st.device_id = sup.device.as_ref().map(|d| d.device_id().to_owned());
    }
    let supervisor = Supervisor::new(sup, metrics, status.clone()).start();
    let store = Arc::new(RunStore::new(Duration::from_secs(cfg.run_retention_sec), cfg.run_retention_max));
    let sweeper_store = store.clone();
    actix::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(10));
        loop {
            every.tick().await;
            sweeper_store.sweep();
        }
    });
    if cfg.api_token.is_none() {
        tracing::warn!("CLAWMUX_API_TOKEN is not set: the API serves loopback clients only");
    }
    let listen = cfg.listen;
    let (proxy, attributions) = match &cfg.llm_upstream_url {
        Some(upstream) => {
            let attributions = Arc::new(crate::attribution::Attributions::new());
            let (addr, handle) = start_proxy(&cfg, upstream, attributions.clone(), &registry)?;
            tracing::info!(%addr, upstream = %upstream, "LLM attribution proxy listening");
            (Some((addr, handle)), Some(attributions))
        }
        None => (None, None),
    };
    let relay = match crate::relay::RelayConfig::from_app_config(&cfg).map_err(std::io::Error::other)? {
        Some(rc) => {
            let relay = crate::relay::GitRelay::connect(rc)
                .await
                .map_err(|e| std::io::Error::other(format!("git relay: {e}")))?;
            tracing::info!(container = %relay.config().container, "git relay ready");
            Some(Arc::new(crate::branch_run::RelayRuntime { relay, locks: crate::relay::BranchLocks::new() }))
        }
        None => None,
    };
    let state = web::Data::new(AppState {
        cfg,
        store,
        supervisor,
        status,
        registry,
        agents: AgentRegistry::builtin(),
        attributions,
        relay,
        pending: Arc::new(crate::branch_run::PendingRuns::default()),
    });
    let app_state = state.clone();
    let server = HttpServer::new(move || App::new().app_data(app_state.clone()).configure(api::routes))
        .on_connect(no_delay)
        .disable_signals()
        // A caller that closes its connection is gone (`onDisconnect: abort` must cancel its run
        // now): with half-closed connections allowed, actix notices only when a write fails, i.e.
        // up to two keep-alive periods (30 s) later for a quiet SSE stream, never for a JSON wait.
        .h1_allow_half_closed(false)
        .shutdown_timeout(5)
        .bind(listen)?;
    let addr = server.addrs().first().copied().ok_or_else(|| std::io::Error::other("no bound address"))?;
    let server = server.run();
    let handle = server.handle();
    let done = actix::spawn(server);
    Ok(Running { addr, server: handle, state, done, proxy })
}

/// Starts the LLM attribution proxy on `cfg.proxy_listen`.
fn start_proxy(
    cfg: &Config,
    upstream: &str,
    attributions: Arc<crate::attribution::Attributions>,
    registry: &prometheus::Registry,
) -> std::io::Result<(SocketAddr, actix_web::dev::ServerHandle)> {
    let audit = crate::audit::AuditLog::open(&cfg.audit_dir, cfg.audit_max_bytes)
        .map_err(|e| std::io::Error::other(format!("cannot open the audit log in {}: {e}", cfg.audit_dir.display())))?;
    tracing::info!(path = %audit.path().display(), "LLM call audit log");
    let metrics = crate::proxy::ProxyMetrics::new(registry).map_err(std::io::Error::other)?;
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .pool_idle_timeout(Duration::from_secs(60))
        .build()
        .map_err(std::io::Error::other)?;
    let state = web::Data::new(crate::proxy::ProxyState {
        attributions,
        upstream: upstream.to_owned(),
        key: cfg.llm_upstream_key.clone(),
        client,
        audit: crate::proxy::AuditSink::start(Arc::new(audit)),
        metrics,
    });
    let server = HttpServer::new(move || App::new().app_data(state.clone()).configure(crate::proxy::routes))
        .on_connect(no_delay)
        .disable_signals()
        .shutdown_timeout(5)
        .bind(cfg.proxy_listen)?;
    let addr = server.addrs().first().copied().ok_or_else(|| std::io::Error::other("no bound proxy address"))?;
    let server = server.run();
    let handle = server.handle();
    actix::spawn(server);
    Ok((addr, handle))
}

/// Small SSE events must leave at once: Nagle's algorithm would hold one back until the client's
/// (delayed) ACK of the previous write.
fn no_delay(conn: &dyn std::any::Any, _ext: &mut actix_web::dev::Extensions) {
    if let Some(tcp) = conn.downcast_ref::<actix_web::rt::net::TcpStream>() {
        let _ = tcp.set_nodelay(true);
    }
}

/// Graceful stop: every run in flight gets a terminal event (its gateway run is cancelled), then the
/// connection and the HTTP server close.
pub async fn shutdown(running: &Running) {
    let supervisor = &running.state.supervisor;
    // Branch runs still waiting for their lock or workspace end first (aborted).
    running.state.pending.cancel_all();
    let cancelled = supervisor.send(ShutdownAll).await.unwrap_or(0);
    if cancelled > 0 {
        tracing::info!(cancelled, "shutting down: cancelling runs in flight");
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(12);
    while tokio::time::Instant::now() < deadline {
        // Runs leave the supervisor at their gateway final; a branch run still publishes after it.
        if supervisor.send(InFlight).await.unwrap_or(0) == 0 && running.state.store.unfinished() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    supervisor.do_send(Disconnect);
    running.server.stop(true).await;
    if let Some((_, proxy)) = &running.proxy {
        proxy.stop(true).await;
    }
}

/// Runs until SIGINT or SIGTERM, then shuts down gracefully.
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
