//! The command line: `serve`, `demo`, `replay-gateway`, `doctor`, `healthcheck`, `load`, `record`.

use crate::config::{Config, LogFormat};
use crate::server;
use clap::{Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// clawmux: one multiplexed connection to an OpenClaw gateway for many concurrent agent runs.
#[derive(Debug, Parser)]
#[command(name = "clawmux", version, about)]
pub struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// The service: HTTP API + one multiplexed connection to an OpenClaw gateway.
    Serve {
        /// TOML configuration file (the environment wins over it).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// `serve` plus an in-process replay gateway (recorded real chat streams), on 127.0.0.1.
    Demo {
        /// TOML configuration file.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Replay speed (1.0 = recorded timing).
        #[arg(long, default_value_t = 1.0)]
        speed: f64,
    },
    /// A stand-alone fake OpenClaw gateway replaying a cassette.
    ReplayGateway {
        /// Cassette file (JSON lines); default: the bundled one recorded from openclaw 2026.9.6.
        #[arg(long)]
        cassette: Option<PathBuf>,
        /// Listen address.
        #[arg(long, default_value = "127.0.0.1:18789")]
        listen: SocketAddr,
        /// Replay speed factor (1.0 = recorded timing, 0 = no delays).
        #[arg(long, default_value_t = 1.0)]
        speed: f64,
        /// Protocol to speak (3 or 4).
        #[arg(long, default_value_t = 4)]
        protocol: u32,
        /// Required token (default: read CLAWMUX_REPLAY_TOKEN; none = accept any).
        #[arg(long, env = "CLAWMUX_REPLAY_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// Re-cut every track's answer into N streamed deltas (load tests: frames per run).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        deltas: Option<u32>,
        /// Interval of `tick` events in ms (the real gateway: 30000).
        #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
        tick_interval_ms: u64,
        /// Also serve the counters (connections, handshakes, frames and bytes sent per connection
        /// and in total) as JSON at http://ADDR/stats.
        #[arg(long)]
        stats_listen: Option<SocketAddr>,
    },
    /// Load driver: N runs at concurrency C, each with a unique marker; checks isolation and
    /// prints throughput and latency percentiles. Exit 0 when every run ended `final` with no
    /// violation, 1 otherwise, 2 on bad arguments.
    Load {
        /// clawmux base URL, e.g. http://127.0.0.1:8787 (required unless --direct per-call).
        #[arg(long)]
        target: Option<String>,
        /// Runs to start.
        #[arg(long)]
        runs: usize,
        /// Runs in flight at once.
        #[arg(long)]
        concurrency: usize,
        /// clawmux API bearer token (default: CLAWMUX_API_TOKEN).
        #[arg(long, env = "CLAWMUX_API_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// Message of every run; a unique marker `load-<uuid>` is put in front of it.
        #[arg(long, default_value = "clawmux load test")]
        message: String,
        /// Model of every run (e.g. cogni/fake-model).
        #[arg(long)]
        model: Option<String>,
        /// Billing account of the runs.
        #[arg(long, default_value = "load")]
        account: String,
        /// Per-run timeout in seconds (sent as timeoutSec).
        #[arg(long, default_value_t = 120)]
        timeout_sec: u64,
        /// Bound on the whole load in seconds: then runs in flight are dropped and the report
        /// says interrupted.
        #[arg(long)]
        deadline_sec: Option<u64>,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
        /// Drive the gateway directly with the connection-per-call design instead of clawmux.
        #[arg(long, value_enum, requires = "gateway")]
        direct: Option<DirectDesign>,
        /// Gateway ws:// URL for --direct.
        #[arg(long)]
        gateway: Option<String>,
        /// Gateway token for --direct (default: CLAWMUX_GATEWAY_TOKEN).
        #[arg(long, env = "CLAWMUX_GATEWAY_TOKEN", hide_env_values = true)]
        gateway_token: Option<String>,
        /// No progress bar (it is also hidden when stderr is not a terminal).
        #[arg(long)]
        no_progress: bool,
    },
    /// Record runs from a real gateway into a cassette (docs/cassette.md): one track per
    /// --message. The token and the challenge nonce are never written.
    Record {
        /// Gateway ws:// URL.
        #[arg(long)]
        gateway: String,
        /// Gateway token (default: CLAWMUX_GATEWAY_TOKEN).
        #[arg(long, env = "CLAWMUX_GATEWAY_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// Cassette file to write.
        #[arg(long)]
        out: PathBuf,
        /// A run's message (repeat for more runs/tracks).
        #[arg(long = "message", required = true)]
        messages: Vec<String>,
        /// Track names, one per --message (default run1, run2, ...).
        #[arg(long = "name")]
        names: Vec<String>,
        /// Model to patch onto each run's session (sessions.patch) first.
        #[arg(long)]
        model: Option<String>,
        /// Per-run timeout in seconds.
        #[arg(long, default_value_t = 300)]
        timeout_sec: u64,
        /// Header note (how the cassette was made).
        #[arg(long)]
        note: Option<String>,
    },
    /// Print the effective configuration (secrets redacted) and check the run store, the
    /// gateway and the LLM upstream. Exit 0 when all are usable, 1 otherwise.
    Doctor {
        /// TOML configuration file.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Probe a running `serve`'s `/healthz` (the container image's HEALTHCHECK; the image has no
    /// curl). Exit 0 on a 2xx answer within the timeout, 1 otherwise.
    Healthcheck {
        /// TOML configuration file (its `listen` names the address to probe).
        #[arg(long)]
        config: Option<PathBuf>,
        /// URL to probe instead (default: `/healthz` on `CLAWMUX_LISTEN`, a wildcard address on loopback).
        #[arg(long)]
        url: Option<String>,
        /// Seconds to wait for the answer.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=300))]
        timeout_sec: u64,
    },
    /// API keys (in the run store, `CLAWMUX_STORE_URL`): scoped to billing accounts and actions.
    Keys {
        /// TOML configuration file.
        #[arg(long)]
        config: Option<PathBuf>,
        /// What to do.
        #[command(subcommand)]
        command: crate::admin_cli::KeysCommand,
    },
    /// Per-account limits (in the run store): token budget per period, concurrency, rate.
    Limits {
        /// TOML configuration file.
        #[arg(long)]
        config: Option<PathBuf>,
        /// What to do.
        #[command(subcommand)]
        command: crate::admin_cli::LimitsCommand,
    },
}

/// Designs `clawmux load --direct` can drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DirectDesign {
    /// The reference client: a new connection + handshake for `sessions.patch`, another for
    /// `agent`, broadcast events filtered fail-closed by sessionKey and runId.
    PerCall,
}

pub use crate::exit;

fn load_config(path: Option<&PathBuf>) -> Result<Config, i32> {
    Config::load(path.map(PathBuf::as_path), &|k| std::env::var(k).ok()).map_err(|e| {
        eprintln!("clawmux: configuration error: {e}");
        exit::CONFIG
    })
}

fn init_tracing(cfg: &Config) {
    let filter = tracing_subscriber::EnvFilter::try_new(&cfg.log).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = match cfg.log_format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

/// Runs the command line; returns the exit code.
pub fn main() -> i32 {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve { config } => {
            let cfg = match load_config(config.as_ref()) {
                Ok(c) => c,
                Err(code) => return code,
            };
            let Some(url) = cfg.gateway_url.clone() else {
                eprintln!("clawmux: no gateway configured: set CLAWMUX_GATEWAY_URL (e.g. ws://127.0.0.1:18789) or gateway_url in --config");
                return exit::CONFIG;
            };
            init_tracing(&cfg);
            let sup = match server::supervisor_config(&cfg, &url) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("clawmux: device identity: {e}");
                    return exit::CONFIG;
                }
            };
            run_system(async move {
                let running = server::start(cfg, sup).await?;
                tracing::info!(addr = %running.addr, gateway = %url, "clawmux listening");
                server::run_until_signal(running).await
            })
        }
        Command::Demo { config, speed } => {
            let cfg = match load_config(config.as_ref()) {
                Ok(c) => c,
                Err(code) => return code,
            };
            init_tracing(&cfg);
            run_system(demo(cfg, speed))
        }
        Command::ReplayGateway { cassette, listen, speed, protocol, token, deltas, tick_interval_ms, stats_listen } => {
            let cfg = Config::default();
            init_tracing(&cfg);
            run_system(async move {
                let cassette = match cassette {
                    Some(p) => crate::replay::Cassette::from_path(&p),
                    None => crate::replay::Cassette::bundled(),
                }
                .map_err(std::io::Error::other)?;
                let mut rc = crate::replay::ReplayConfig::new(cassette)
                    .speed(speed)
                    .protocol(protocol)
                    .tick_interval_ms(tick_interval_ms)
                    .deltas_override(deltas.map(|n| n as usize));
                if let Some(t) = token {
                    rc = rc.token(t);
                }
                crate::replay::run_standalone(listen, rc, stats_listen).await
            })
        }
        Command::Load {
            target,
            runs,
            concurrency,
            token,
            message,
            model,
            account,
            timeout_sec,
            deadline_sec,
            json,
            direct,
            gateway,
            gateway_token,
            no_progress,
        } => {
            let mode = match (direct, gateway) {
                (Some(DirectDesign::PerCall), Some(gateway)) => crate::load::Mode::PerCall { gateway, token: gateway_token },
                _ => crate::load::Mode::Clawmux,
            };
            let target = match (target, &mode) {
                (Some(t), _) => t,
                (None, crate::load::Mode::PerCall { .. }) => String::from("http://unused"),
                (None, crate::load::Mode::Clawmux) => {
                    eprintln!("clawmux load: --target URL is required (or --direct per-call --gateway WS_URL)");
                    return exit::CONFIG;
                }
            };
            let cfg = crate::load::LoadConfig {
                target,
                runs,
                concurrency,
                token,
                message,
                model,
                account,
                timeout: Duration::from_secs(timeout_sec),
                deadline: deadline_sec.map(Duration::from_secs),
                mode,
                progress: !no_progress,
            };
            load(cfg, json)
        }
        Command::Record { gateway, token, out, messages, names, model, timeout_sec, note } => {
            let mut rc = crate::record::RecordConfig::new(gateway, messages);
            rc.token = token;
            rc.names = names;
            rc.model = model;
            rc.timeout = Duration::from_secs(timeout_sec.max(1));
            rc.note = note;
            let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("clawmux record: cannot start the runtime: {e}");
                    return exit::FAILURE;
                }
            };
            match runtime.block_on(crate::record::record(&rc)).and_then(|rec| rec.write(&out).map(|()| rec)) {
                Ok(rec) => {
                    let summary: Vec<String> = rec
                        .cassette
                        .tracks
                        .iter()
                        .map(|t| format!("{} ({} events, final at {} ms)", t.name, t.steps.len().saturating_sub(1), t.steps.iter().map(|s| s.t_ms).max().unwrap_or(0)))
                        .collect();
                    println!("clawmux record: wrote {} ({}): {}", out.display(), rec.cassette.source, summary.join(", "));
                    exit::OK
                }
                Err(e @ crate::record::RecordError::Config(_)) => {
                    eprintln!("clawmux record: {e}");
                    exit::CONFIG
                }
                Err(e) => {
                    eprintln!("clawmux record: {e}");
                    exit::FAILURE
                }
            }
        }
        Command::Doctor { config } => {
            let cfg = match load_config(config.as_ref()) {
                Ok(c) => c,
                Err(code) => return code,
            };
            run_system_code(doctor(cfg))
        }
        Command::Healthcheck { config, url, timeout_sec } => {
            let url = match url {
                Some(u) => u,
                None => match load_config(config.as_ref()) {
                    Ok(cfg) => crate::probe::healthz_url(cfg.listen),
                    Err(code) => return code,
                },
            };
            healthcheck(&url, Duration::from_secs(timeout_sec))
        }
        Command::Keys { config, command } => match load_config(config.as_ref()) {
            Ok(cfg) => run_system_code(crate::admin_cli::keys(cfg, command)),
            Err(code) => code,
        },
        Command::Limits { config, command } => match load_config(config.as_ref()) {
            Ok(cfg) => run_system_code(crate::admin_cli::limits(cfg, command)),
            Err(code) => code,
        },
    }
}

/// `clawmux load` on a multi-threaded runtime (the driver has no actors; it wants both cores).
fn load(cfg: crate::load::LoadConfig, json: bool) -> i32 {
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("clawmux load: cannot start the runtime: {e}");
            return exit::FAILURE;
        }
    };
    runtime.block_on(async move {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            if wait_for_stop_signal().await.is_ok() {
                stop_tx.send_replace(true);
            }
        });
        match crate::load::run_until(cfg, stop_rx).await {
            Ok(report) => {
                if json {
                    println!("{}", report.to_json());
                } else {
                    print!("{}", report.to_text());
                }
                if report.all_good() {
                    exit::OK
                } else {
                    exit::FAILURE
                }
            }
            Err(e @ crate::load::LoadError::Config(_)) => {
                eprintln!("clawmux load: {e}");
                exit::CONFIG
            }
            Err(e) => {
                eprintln!("clawmux load: {e}");
                exit::FAILURE
            }
        }
    })
}

/// `clawmux healthcheck`: silent when healthy (Docker keeps the output of every probe), one line
/// on stderr when not.
fn healthcheck(url: &str, timeout: Duration) -> i32 {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("clawmux healthcheck: cannot start the runtime: {e}");
            return exit::FAILURE;
        }
    };
    match runtime.block_on(crate::probe::healthz(url, timeout)) {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("clawmux healthcheck: unhealthy: {e}");
            exit::FAILURE
        }
    }
}

/// SIGINT or SIGTERM.
async fn wait_for_stop_signal() -> std::io::Result<()> {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r,
            _ = term.recv() => Ok(()),
        }
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c().await
    }
}

fn run_system(fut: impl std::future::Future<Output = std::io::Result<()>> + 'static) -> i32 {
    match actix_rt::System::new().block_on(fut) {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("clawmux: {e}");
            exit::FAILURE
        }
    }
}

fn run_system_code(fut: impl std::future::Future<Output = i32> + 'static) -> i32 {
    actix_rt::System::new().block_on(fut)
}

async fn demo(mut cfg: Config, speed: f64) -> std::io::Result<()> {
    // The demo's gateway lives only as long as the demo: its runs are not worth keeping for the
    // next start (they would end `gateway_disconnected` against a new replay gateway), unless the
    // user named a store.
    if std::env::var_os("CLAWMUX_STORE_URL").is_none() {
        cfg.store_url = crate::store::StoreUrl::Memory;
    }
    let cassette = crate::replay::Cassette::bundled().map_err(std::io::Error::other)?;
    let token = uuid::Uuid::new_v4().simple().to_string();
    let rc = crate::replay::ReplayConfig::new(cassette).speed(speed).token(token.clone());
    let gateway = crate::replay::ReplayGateway::start(SocketAddr::from(([127, 0, 0, 1], 0)), rc)?;
    cfg.gateway_url = Some(gateway.url());
    cfg.gateway_token = Some(crate::config::Secret::new(token));
    if !cfg.listen.ip().is_loopback() {
        cfg.listen = SocketAddr::from(([127, 0, 0, 1], cfg.listen.port()));
    }
    let url = gateway.url();
    let sup = server::supervisor_config(&cfg, &url).map_err(std::io::Error::other)?;
    let auth = if cfg.api_token.is_some() { " -H \"Authorization: Bearer $CLAWMUX_API_TOKEN\"" } else { "" };
    let admin_token = cfg.api_token.clone();
    let running = server::start(cfg, sup).await?;
    // Wait (bounded) for the embedded gateway connection so the printed curl works at once.
    for _ in 0..100 {
        if running.state.status.read().map(|s| s.connected).unwrap_or(false) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("clawmux demo: API on http://{} , replay gateway on {url}", running.addr);
    // A store named by the user may hold API keys: a loopback caller without credentials is then
    // no longer the admin (docs/API.md), so the example run and the curl below without a key
    // would each get `401`. Said here, once, rather than left to a bare `401`.
    let needs_key = admin_token.is_none() && running.state.tenants.keys_seen.any(running.state.tenants.store.as_ref()).await.unwrap_or(false);
    // One run at once, so the runs page has something to show before the first curl.
    let example = !needs_key && demo_example_run(running.addr, admin_token.as_ref()).await;
    println!(
        "Runs page: http://{}/ui/ {}",
        running.addr,
        if example { "(one example run started)" } else { "(it lists the runs you start)" }
    );
    if admin_token.is_some() {
        println!("  (it asks for the token: paste CLAWMUX_API_TOKEN; it stays in that browser tab)");
    }
    let auth = if needs_key {
        println!(
            "This store (CLAWMUX_STORE_URL) holds API keys, so a request without credentials is refused (401), even from this host:\n  \
             send a key of the account (CLAWMUX_API_KEY below), or set CLAWMUX_API_TOKEN for the demo and send that (README: \"Tenants\")."
        );
        " -H \"Authorization: Bearer $CLAWMUX_API_KEY\""
    } else {
        auth
    };
    println!("Stream a run (Ctrl-C stops the demo):");
    println!();
    println!(
        "  curl -N{auth} -H 'Accept: text/event-stream' -H 'Content-Type: application/json' \\\n    -d '{{\"message\":\"Hello from the clawmux demo\",\"billingAccountId\":\"demo-account\"}}' \\\n    http://{}/v1/runs",
        running.addr
    );
    println!();
    server::run_until_signal(running).await
}

/// Starts the demo's example run through its own API (`?wait=false`); false when it could not.
async fn demo_example_run(addr: SocketAddr, token: Option<&crate::config::Secret>) -> bool {
    let Ok(client) = reqwest::Client::builder().timeout(Duration::from_secs(5)).build() else { return false };
    let mut req = client
        .post(format!("http://{addr}/v1/runs?wait=false"))
        .json(&serde_json::json!({"message": "Hello from the clawmux demo (an example run)", "billingAccountId": "demo-account"}));
    if let Some(t) = token {
        req = req.bearer_auth(t.expose());
    }
    match req.send().await {
        Ok(r) if r.status().is_success() => true,
        Ok(r) => {
            tracing::warn!(status = %r.status(), "the demo's example run was refused");
            false
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot start the demo's example run");
            false
        }
    }
}

async fn doctor(cfg: Config) -> i32 {
    use actix::Actor;
    println!("clawmux doctor\n\nEffective configuration (environment over file; secrets redacted):");
    for (k, v) in cfg.describe() {
        println!("  {k:<30} {v}");
    }
    println!();
    let store_ok = doctor_store(&cfg).await;
    let upstream_ok = doctor_upstream(&cfg).await;
    let agents_ok = doctor_agents().await;
    let Some(url) = cfg.gateway_url.clone() else {
        println!("gateway: NOT CONFIGURED. Fix: set CLAWMUX_GATEWAY_URL to the gateway's ws:// URL.");
        return exit::CONFIG;
    };
    let sup = match server::supervisor_config(&cfg, &url) {
        Ok(s) => s,
        Err(e) => {
            println!("device identity: FAILED: {e}");
            return exit::CONFIG;
        }
    };
    let device = sup.device.as_ref().map(|d| (d.device_id().to_owned(), d.path().display().to_string()));
    // The same supervisor `serve` runs, so doctor sees exactly what the service would.
    let registry = prometheus::Registry::new();
    let Ok(metrics) = clawmux_actors::metrics::Metrics::new(&registry) else { return exit::FAILURE };
    let status = clawmux_actors::StatusHandle::default();
    let supervisor = clawmux_actors::Supervisor::new(sup, metrics.clone(), status.clone()).start();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let snapshot = loop {
        let s = status.read().map(|s| s.clone()).unwrap_or_default();
        let attempts_failed = metrics.connects.with_label_values(&["failed"]).get();
        let probed = s.protocol.unwrap_or(4) >= 4 || s.writes_accepted.is_some();
        if (s.connected && probed) || (!s.connected && attempts_failed > 0) || tokio::time::Instant::now() >= deadline {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    supervisor.do_send(clawmux_actors::supervisor::Disconnect);
    print!("{}", doctor_report(&url, &cfg, &snapshot, device.as_ref()));
    match (snapshot.ready(), store_ok, upstream_ok, agents_ok) {
        (Ok(()), true, true, true) => exit::OK,
        _ => exit::FAILURE,
    }
}

/// Checks the agent variant registry as `serve` loads it and, when a variant is ephemeral, that
/// the Docker engine answers and has each ephemeral image; false when a run could not start.
async fn doctor_agents() -> bool {
    let agents = match crate::agents::AgentRegistry::from_env(&|k| std::env::var(k).ok()) {
        Ok(a) => a,
        Err(e) => {
            println!("agents: FAILED: {e}\n  Fix: correct CLAWMUX_AGENTS_FILE (README: \"Execution modes\")\n");
            return false;
        }
    };
    let names: Vec<String> = agents.agents.iter().map(|a| format!("{} ({})", a.graph_id, a.mode.as_str())).collect();
    println!("agents: OK, {} (default {})", names.join(", "), agents.default_graph_id);
    if !agents.has_ephemeral() {
        println!();
        return true;
    }
    let ok = crate::ephemeral::doctor::check(&agents).await;
    println!();
    ok
}

/// Asks the LLM upstream for its model list with the proxy's key, when the proxy is configured;
/// false when the proxy's calls could not work.
async fn doctor_upstream(cfg: &Config) -> bool {
    let Some(upstream) = cfg.llm_upstream_url.as_deref() else {
        println!("llm upstream: not configured (the LLM proxy is off: set CLAWMUX_LLM_UPSTREAM_URL)\n");
        return true;
    };
    let check = crate::probe::llm_upstream(upstream, cfg.llm_upstream_key.as_ref(), Duration::from_secs(10)).await;
    let (report, ok) = crate::probe::upstream_report(upstream, &check);
    println!("{report}");
    ok
}

/// Opens the run store as `serve` would and says what it holds; false when it cannot be used.
async fn doctor_store(cfg: &Config) -> bool {
    let metrics = match crate::store::writer::StoreMetrics::new(&prometheus::Registry::new()) {
        Ok(m) => m,
        Err(_) => return false,
    };
    let retention = crate::store::Retention { max_age_ms: i64::MAX, max_count: usize::MAX };
    let fix = match cfg.store_url {
        crate::store::StoreUrl::Postgres { .. } => {
            "check that the PostgreSQL server CLAWMUX_STORE_URL names is up and reachable from here, and the user, password and database in the URL"
        }
        _ => "point CLAWMUX_STORE_URL at a writable file (sqlite://PATH) or use memory:",
    };
    let store = match crate::store::RunStore::open(&cfg.store_url, retention, metrics, None).await {
        Ok(store) => store,
        Err(e) => {
            // Reached but refused (a schema newer than this build, a file that is no store) is
            // not "not reachable".
            let what = if e.0.contains("cannot be reached") { "not reachable" } else { "not usable" };
            println!("store ({}): FAILED, {} kind, {what}: {e}\n  Fix: {fix}\n", cfg.store_url.display(), store_kind(&cfg.store_url));
            return false;
        }
    };
    let schema = store.schema().await;
    let query = crate::store::ListQuery { statuses: vec!["queued".into(), "running".into()], limit: 500, ..Default::default() };
    let unfinished = store.list(&query).await.map(|(r, _)| r.len());
    let (report, ok) = store_report(store.url(), store.kind(), &schema, &unfinished);
    print!("{report}");
    match store.replicas().await {
        Ok(Some(replicas)) => println!("{}", replicas_report(&replicas, crate::store::now_ms())),
        Ok(None) => println!(),
        Err(e) => println!("  replicas: cannot be read: {e}\n"),
    }
    if !ok {
        println!("  Fix: {fix}\n");
    }
    ok
}

/// The processes a shared store has seen, with the age of their last heartbeat (pure, tested).
pub fn replicas_report(replicas: &[crate::store::Replica], now_ms: i64) -> String {
    use std::fmt::Write;
    if replicas.is_empty() {
        return "  replicas seen: none yet\n".to_owned();
    }
    let mut out = format!("  replicas seen: {}\n", replicas.len());
    for r in replicas {
        let age = now_ms.saturating_sub(r.heartbeat_at_ms).max(0) as f64 / 1000.0;
        let _ = writeln!(out, "    {:<40} last heartbeat {age:.0} s ago (clawmux {})", r.id, r.version);
    }
    out
}

fn store_kind(url: &crate::store::StoreUrl) -> &'static str {
    match url {
        crate::store::StoreUrl::Sqlite(_) => "sqlite",
        crate::store::StoreUrl::Memory => "memory",
        crate::store::StoreUrl::Postgres { .. } => "postgres",
    }
}

/// The store line of `doctor` (pure, so it is tested): kind, reachable, schema version; whether
/// the store can be used.
pub fn store_report(
    url: &str,
    kind: &str,
    schema: &Result<Option<crate::store::SchemaVersion>, crate::store::StoreError>,
    unfinished: &Result<usize, crate::store::StoreError>,
) -> (String, bool) {
    let (schema, ok) = match schema {
        Ok(None) => ("no schema (nothing is kept)".to_owned(), true),
        Ok(Some(v)) if v.applied == v.known => (format!("schema version {}", v.applied), true),
        Ok(Some(v)) => (format!("schema version {} but this build knows {}", v.applied, v.known), false),
        Err(e) => return (format!("store ({url}): FAILED, {kind} kind, not reachable: {e}\n"), false),
    };
    let unfinished = match unfinished {
        Ok(n) => format!("{n} unfinished run(s) the next start continues"),
        Err(e) => return (format!("store ({url}): FAILED, {kind} kind, reachable, {schema}, but its runs cannot be read: {e}\n"), false),
    };
    (format!("store ({url}): {}, {kind} kind, reachable, {schema}, {unfinished}\n", if ok { "OK" } else { "FAILED" }), ok)
}

/// The gateway half of `doctor`'s output (pure, so it is tested).
pub fn doctor_report(url: &str, cfg: &Config, s: &clawmux_actors::GatewayStatus, device: Option<&(String, String)>) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let line = |out: &mut String, k: &str, v: &str| {
        let _ = writeln!(out, "  {k:<30} {v}");
    };
    let _ = writeln!(out, "gateway ({url}): {}", if s.connected { "CONNECTED" } else { "NOT CONNECTED" });
    if let Some(p) = s.protocol {
        line(&mut out, "protocol", &p.to_string());
    }
    if let Some(v) = &s.server_version {
        line(&mut out, "server version", v);
    }
    let scopes = match (&s.scopes, s.writes_accepted) {
        (Some(sc), _) => sc.join(", "),
        (None, Some(true)) => "not reported (protocol 3); writes accepted".to_owned(),
        (None, Some(false)) => format!("not reported (protocol 3); refused: {}", s.missing_scopes.join(", ")),
        (None, None) if s.connected => "not reported (protocol 3)".to_owned(),
        _ => "unknown".to_owned(),
    };
    line(&mut out, "granted scopes", &scopes);
    if s.connected {
        line(&mut out, "delivery", if s.session_scoped { "session-scoped events" } else { "broadcast (fail-closed routing is the only wall)" });
        let attribution = match (s.protocol.unwrap_or(4) >= 4, cfg.llm_upstream_url.is_some()) {
            (true, true) => "traceparent trace id (LLM proxy on)",
            (true, false) => "traceparent trace id (LLM proxy OFF: set CLAWMUX_LLM_UPSTREAM_URL)",
            (false, true) => "per-run token in extraSystemPrompt (LLM proxy on)",
            (false, false) => "none (protocol 3 and no LLM proxy: set CLAWMUX_LLM_UPSTREAM_URL)",
        };
        line(&mut out, "billing attribution", attribution);
        let abort = if s.protocol.unwrap_or(4) >= 4 { "chat.abort" } else { "agent timeout + LLM proxy cuts the run's calls" };
        line(&mut out, "abort mechanism", abort);
        let outbound = match s.outbound_headers {
            Some(true) => "accepted (per-session billing headers sent)",
            Some(false) => "not used (auto: the gateway does not list the capability session-outbound-headers)",
            None => "auto (decided when connected: by the capability session-outbound-headers in hello-ok)",
        };
        line(&mut out, "outbound headers", outbound);
    }
    let device_line = match device {
        // openclaw 2026.9.6 accepts a non-loopback `connect` without a device identity but strips
        // every scope (hello-ok `auth.scopes: []`), so the cause shows here, not as an error.
        None if s.connected && s.scopes.as_ref().is_some_and(|sc| sc.is_empty()) => {
            "none (CLAWMUX_DEVICE_IDENTITY=off or no key): the gateway granted NO scopes; a gateway reached over the network grants scopes only to a paired device identity: set CLAWMUX_DEVICE_IDENTITY=auto (or on) and approve the device".to_owned()
        }
        None => "none (CLAWMUX_DEVICE_IDENTITY=off or no key)".to_owned(),
        Some((id, path)) if s.pairing_required => {
            // `openclaw devices approve` takes the pending request's id, which only the gateway's
            // answer carries (the connection's reason quotes the exact command when it had one).
            let reason = s.last_error.as_deref().unwrap_or_default();
            let command = reason
                .split_once("`openclaw devices approve ")
                .and_then(|(_, rest)| rest.split_once('`'))
                .map(|(request, _)| request)
                .filter(|request| *request != "<requestId>")
                .map(|request| format!("run `openclaw devices approve {request}` on the gateway host"));
            let how = command.unwrap_or_else(|| {
                "on the gateway host, `openclaw devices list` shows its pending request; approve it with `openclaw devices approve <requestId>`".to_owned()
            });
            format!("{id} ({path}): PAIRING REQUIRED: {how}")
        }
        Some((id, path)) if s.connected => format!("{id} ({path}): accepted"),
        Some((id, path)) => format!("{id} ({path})"),
    };
    line(&mut out, "device identity", &device_line);
    match s.ready() {
        Ok(()) => out.push_str("ready: yes\n"),
        Err(reason) => {
            let _ = writeln!(out, "ready: NO: {reason}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config::load(None, &|_| None).expect("default config")
    }

    #[test]
    fn doctor_names_the_pending_request_to_approve() {
        let s = clawmux_actors::GatewayStatus {
            pairing_required: true,
            last_error: Some(
                "the gateway requires this device to be paired (pairing required: device is not approved yet): approve it on the gateway host with `openclaw devices approve 4a2378dc-77a9` (device id abc, pending request 4a2378dc-77a9); clawmux keeps retrying".to_owned(),
            ),
            ..Default::default()
        };
        let device = ("abc".to_owned(), "/k.json".to_owned());
        let out = doctor_report("ws://10.213.0.2:1", &cfg(), &s, Some(&device));
        assert!(out.contains("abc (/k.json): PAIRING REQUIRED: run `openclaw devices approve 4a2378dc-77a9` on the gateway host"), "{out}");
    }

    #[test]
    fn doctor_without_a_request_id_points_at_the_list() {
        let s = clawmux_actors::GatewayStatus { pairing_required: true, last_error: Some("pairing required".to_owned()), ..Default::default() };
        let device = ("abc".to_owned(), "/k.json".to_owned());
        let out = doctor_report("ws://10.213.0.2:1", &cfg(), &s, Some(&device));
        assert!(out.contains("`openclaw devices list`"), "{out}");
        assert!(!out.contains("approve abc"), "{out}");
    }

    #[test]
    fn doctor_reports_the_store_kind_reachability_and_schema_version() {
        use crate::store::{SchemaVersion, StoreError};
        let v = |applied, known| Ok(Some(SchemaVersion { applied, known }));
        let (out, ok) = store_report("postgres://cmx@db:5432/runs", "postgres", &v(2, 2), &Ok(3));
        assert!(ok && out.contains("OK, postgres kind, reachable, schema version 2, 3 unfinished"), "{out}");
        let (out, ok) = store_report("sqlite:///x.db", "sqlite", &v(3, 2), &Ok(0));
        assert!(!ok && out.contains("schema version 3 but this build knows 2"), "{out}");
        let (out, ok) = store_report("postgres://cmx@db/runs", "postgres", &Err(StoreError("connection refused".into())), &Ok(0));
        assert!(!ok && out.contains("FAILED, postgres kind, not reachable: connection refused"), "{out}");
        let (out, ok) = store_report("memory:", "memory", &Ok(None), &Ok(0));
        assert!(ok && out.contains("no schema"), "{out}");
    }

    #[test]
    fn doctor_lists_the_replicas_with_the_age_of_their_heartbeat() {
        let r = |id: &str, at| crate::store::Replica { id: id.into(), started_at_ms: 0, heartbeat_at_ms: at, version: "0.1.0".into() };
        let out = replicas_report(&[r("host-a-12", 95_000), r("host-b-7", 40_000)], 100_000);
        assert!(out.contains("replicas seen: 2"), "{out}");
        assert!(out.contains("host-a-12") && out.contains("last heartbeat 5 s ago"), "{out}");
        assert!(out.contains("host-b-7") && out.contains("last heartbeat 60 s ago"), "{out}");
        assert!(replicas_report(&[], 0).contains("none yet"));
    }

    #[test]
    fn doctor_explains_empty_scopes_without_a_device() {
        let s = clawmux_actors::GatewayStatus { connected: true, protocol: Some(4), scopes: Some(vec![]), ..Default::default() };
        let out = doctor_report("ws://10.213.0.2:1", &cfg(), &s, None);
        assert!(out.contains("granted NO scopes"), "{out}");
        assert!(out.contains("CLAWMUX_DEVICE_IDENTITY=auto"), "{out}");
    }
}
