//! Configuration: a TOML file (`--config`) and environment variables; the environment wins.
//!
//! Names follow `docs/API.md`: `CLAWMUX_LISTEN` in the environment is `listen` in the file.
//! Secrets that must never leave the host (`CLAWMUX_LLM_UPSTREAM_KEY`, `CLAWMUX_GITHUB_TOKEN`) are
//! read from the environment only; every secret is wrapped in [`Secret`], whose `Debug`/`Display`
//! print `<redacted>`.

use serde::Deserialize;
use std::net::SocketAddr;
use std::path::Path;

/// A secret value: never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a value.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }
    /// The value, for the one place that must send it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// `CLAWMUX_OUTBOUND_HEADERS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutboundHeaders {
    /// Always send per-session headers (the Cogni fork).
    On,
    /// Never (stock OpenClaw).
    Off,
    /// Detect.
    Auto,
}

/// `CLAWMUX_LOG_FORMAT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// JSON lines.
    Json,
}

/// `CLAWMUX_DEVICE_IDENTITY`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceMode {
    /// Sign `connect` with the device key; a key that cannot be loaded or created stops startup.
    On,
    /// Never send a device identity.
    Off,
    /// Send it (default); a key file that cannot be created is a warning, not a stop. A corrupt
    /// existing key file still stops startup: silently becoming another device would lose its pairing.
    Auto,
}

/// Most session-actor threads (`CLAWMUX_SHARDS`): more than cores only adds switching.
pub const MAX_SHARDS: usize = 256;

/// The effective configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// HTTP listen address.
    pub listen: SocketAddr,
    /// Bearer token for `/v1/*`; without it only loopback clients are served.
    pub api_token: Option<Secret>,
    /// Gateway URL (`ws://` or `wss://`).
    pub gateway_url: Option<String>,
    /// Gateway shared token.
    pub gateway_token: Option<Secret>,
    /// Per-session outbound headers policy.
    pub outbound_headers: OutboundHeaders,
    /// Device identity policy.
    pub device_identity: DeviceMode,
    /// Where the device key lives (owner-only file, created on first start).
    pub device_key_file: std::path::PathBuf,
    /// Default run timeout.
    pub run_timeout_sec: u64,
    /// Largest timeout a request may ask for.
    pub max_run_timeout_sec: u64,
    /// Largest accepted `message`, in bytes.
    pub max_message_bytes: usize,
    /// Tracing filter.
    pub log: String,
    /// Log format.
    pub log_format: LogFormat,
    /// LLM attribution proxy listen address.
    pub proxy_listen: SocketAddr,
    /// Where the proxy forwards.
    pub llm_upstream_url: Option<String>,
    /// Upstream key (env only).
    pub llm_upstream_key: Option<Secret>,
    /// Directory of the LLM-call audit log.
    pub audit_dir: std::path::PathBuf,
    /// Size at which the audit log rotates.
    pub audit_max_bytes: u64,
    /// Container the relay runs git in.
    pub relay_container: Option<String>,
    /// Workspace root in that container.
    pub relay_workspace: String,
    /// Repository the relay pushes to.
    pub relay_remote_url: Option<String>,
    /// Default base ref.
    pub relay_base_ref: String,
    /// GitHub REST API base.
    pub github_api_url: String,
    /// `owner/repo` of the pull requests, when the remote URL does not name them (e.g. a mirror path).
    pub github_repo: Option<String>,
    /// GitHub token (env only).
    pub github_token: Option<Secret>,
    /// How long finished runs stay queryable.
    pub run_retention_sec: u64,
    /// How many finished runs of each billing account stay queryable.
    pub run_retention_max: usize,
    /// Runs in flight (running + queued) before new ones get 503.
    pub max_runs: usize,
    /// New gateway runs between their turn and the gateway's ACK at once (`CLAWMUX_MAX_STARTING`,
    /// 0: no limit): a burst of POSTs starts at the gateway's pace, `queued` meanwhile.
    pub max_starting: usize,
    /// The shards (`CLAWMUX_SHARDS`, default one per core): the API's HTTP workers (at least one),
    /// each running the runs it admits (`src/shards.rs`), and as many arbiters for runs continued
    /// from the store, by session key (0: those on the registry's own thread). The supervisor's
    /// thread then only decodes and routes frames.
    pub shards: usize,
    /// The run store (`CLAWMUX_STORE_URL`).
    pub store_url: crate::store::StoreUrl,
    /// What SIGTERM does with live runs (`CLAWMUX_SHUTDOWN`).
    pub shutdown: clawmux_actors::ShutdownMode,
    /// Hosts webhooks may go to (`CLAWMUX_WEBHOOK_ALLOW`, comma-separated patterns).
    pub webhook_allow: String,
    /// Signs the admin token's webhooks (env only).
    pub webhook_secret: Option<Secret>,
    /// How long a webhook delivery is retried.
    pub webhook_max_age_sec: u64,
    /// This process among the ones sharing a store (`CLAWMUX_REPLICA_ID`; default hostname-pid):
    /// its heartbeat row says it is alive.
    pub replica_id: String,
    /// How long a run stays this process's without a renewal (`CLAWMUX_RUN_LEASE_SEC`, PostgreSQL
    /// store): another replica takes a run over this long after its owner stopped renewing.
    pub run_lease_sec: u64,
    /// How long data written to a client may stay unacknowledged (`CLAWMUX_SEND_TIMEOUT_SEC`), on
    /// the API's and the proxy's connections: a client that stops reading (its TCP window stays
    /// shut) is cut after it, and so lets go of what its response holds (an SSE stream holds its
    /// run's event log). The kernel enforces it (`TCP_USER_TIMEOUT`): actix has no write timeout.
    pub send_timeout_sec: u64,
}

/// `<hostname>-<pid>`: unique among the processes sharing a store, and readable in `doctor`.
pub fn default_replica_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "clawmux".to_owned());
    format!("{host}-{}", std::process::id())
}

fn parse_replica_id(v: &str) -> Result<String, ConfigError> {
    if (1..=128).contains(&v.len()) && v.bytes().all(|b| b.is_ascii_graphic()) {
        Ok(v.to_owned())
    } else {
        Err(invalid("CLAWMUX_REPLICA_ID", "must be 1 to 128 visible ASCII characters"))
    }
}

/// `$XDG_STATE_HOME/clawmux`, else `$HOME/.local/state/clawmux`, else `./clawmux-state`.
fn state_dir() -> std::path::PathBuf {
    if let Some(d) = std::env::var_os("XDG_STATE_HOME").filter(|d| !d.is_empty()) {
        return std::path::PathBuf::from(d).join("clawmux");
    }
    if let Some(h) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        return std::path::PathBuf::from(h).join(".local/state/clawmux");
    }
    std::path::PathBuf::from("clawmux-state")
}

/// `<state dir>/audit`.
fn default_audit_dir() -> std::path::PathBuf {
    state_dir().join("audit")
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8787)),
            api_token: None,
            gateway_url: None,
            gateway_token: None,
            outbound_headers: OutboundHeaders::Auto,
            device_identity: DeviceMode::Auto,
            device_key_file: state_dir().join("device-key.json"),
            run_timeout_sec: 600,
            max_run_timeout_sec: 3600,
            max_message_bytes: 1_048_576,
            log: "info".to_owned(),
            log_format: LogFormat::Text,
            proxy_listen: SocketAddr::from(([127, 0, 0, 1], 8788)),
            llm_upstream_url: None,
            llm_upstream_key: None,
            audit_dir: default_audit_dir(),
            audit_max_bytes: 64 * 1024 * 1024,
            relay_container: None,
            relay_workspace: "/workspace".to_owned(),
            relay_remote_url: None,
            relay_base_ref: "main".to_owned(),
            github_api_url: "https://api.github.com".to_owned(),
            github_repo: None,
            github_token: None,
            run_retention_sec: 3600,
            run_retention_max: 10_000,
            max_runs: 5000,
            max_starting: 256,
            shards: std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_SHARDS),
            store_url: crate::store::StoreUrl::Sqlite(state_dir().join("runs.db")),
            shutdown: clawmux_actors::ShutdownMode::Handoff,
            webhook_allow: String::new(),
            webhook_secret: None,
            webhook_max_age_sec: 86_400,
            replica_id: default_replica_id(),
            run_lease_sec: 10,
            send_timeout_sec: 60,
        }
    }
}

/// The file's shape: every key optional, unknown keys refused (a typo must not be ignored).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<String>,
    api_token: Option<String>,
    gateway_url: Option<String>,
    gateway_token: Option<String>,
    outbound_headers: Option<OutboundHeaders>,
    device_identity: Option<DeviceMode>,
    device_key_file: Option<String>,
    run_timeout_sec: Option<u64>,
    max_run_timeout_sec: Option<u64>,
    max_message_bytes: Option<usize>,
    log: Option<String>,
    log_format: Option<LogFormat>,
    proxy_listen: Option<String>,
    llm_upstream_url: Option<String>,
    audit_dir: Option<String>,
    audit_max_bytes: Option<u64>,
    relay_container: Option<String>,
    relay_workspace: Option<String>,
    relay_remote_url: Option<String>,
    relay_base_ref: Option<String>,
    github_api_url: Option<String>,
    github_repo: Option<String>,
    run_retention_sec: Option<u64>,
    run_retention_max: Option<usize>,
    max_runs: Option<usize>,
    shards: Option<usize>,
    max_starting: Option<usize>,
    store_url: Option<String>,
    shutdown: Option<String>,
    webhook_allow: Option<String>,
    webhook_max_age_sec: Option<u64>,
    send_timeout_sec: Option<u64>,
}

/// A configuration problem, naming the setting.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// Path.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The file is not valid TOML of the expected shape.
    #[error("config file {path}: {message}")]
    Parse {
        /// Path.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// A value is invalid.
    #[error("{name}: {message}")]
    Invalid {
        /// Setting name (env spelling).
        name: &'static str,
        /// What is wrong.
        message: String,
    },
}

fn invalid(name: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { name, message: message.into() }
}

fn parse_addr(name: &'static str, v: &str) -> Result<SocketAddr, ConfigError> {
    v.parse().map_err(|_| invalid(name, format!("{v:?} is not an address like 127.0.0.1:8787")))
}

fn parse_shutdown(name: &'static str, v: &str) -> Result<clawmux_actors::ShutdownMode, ConfigError> {
    match v {
        "handoff" => Ok(clawmux_actors::ShutdownMode::Handoff),
        "cancel" => Ok(clawmux_actors::ShutdownMode::Cancel),
        other => Err(invalid(name, format!("{other:?} is not one of handoff, cancel"))),
    }
}

fn parse_num<T: std::str::FromStr>(name: &'static str, v: &str) -> Result<T, ConfigError> {
    v.trim().parse().map_err(|_| invalid(name, format!("{v:?} is not a valid number")))
}

impl Config {
    /// Loads the file (if any), then applies `env` (the process environment in production).
    pub fn load(file: Option<&Path>, env: &dyn Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let mut c = Config::default();
        if let Some(path) = file {
            let p = path.display().to_string();
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: p.clone(), source })?;
            let f: FileConfig = toml::from_str(&text).map_err(|e| ConfigError::Parse { path: p, message: e.to_string() })?;
            c.apply_file(f)?;
        }
        c.apply_env(env)?;
        c.validate()?;
        Ok(c)
    }

    fn apply_file(&mut self, f: FileConfig) -> Result<(), ConfigError> {
        if let Some(v) = f.listen {
            self.listen = parse_addr("listen", &v)?;
        }
        if let Some(v) = f.api_token {
            self.api_token = Some(Secret::new(v));
        }
        if f.gateway_url.is_some() {
            self.gateway_url = f.gateway_url;
        }
        if let Some(v) = f.gateway_token {
            self.gateway_token = Some(Secret::new(v));
        }
        if let Some(v) = f.outbound_headers {
            self.outbound_headers = v;
        }
        if let Some(v) = f.device_identity {
            self.device_identity = v;
        }
        if let Some(v) = f.device_key_file {
            self.device_key_file = v.into();
        }
        macro_rules! set {
            ($($field:ident),*) => { $( if let Some(v) = f.$field { self.$field = v; } )* };
        }
        set!(run_timeout_sec, max_run_timeout_sec, max_message_bytes, log, log_format, relay_workspace, relay_base_ref, github_api_url,
             run_retention_sec, run_retention_max, max_runs, shards, max_starting, send_timeout_sec);
        if let Some(v) = f.proxy_listen {
            self.proxy_listen = parse_addr("proxy_listen", &v)?;
        }
        if f.llm_upstream_url.is_some() {
            self.llm_upstream_url = f.llm_upstream_url;
        }
        if let Some(v) = f.audit_dir {
            self.audit_dir = v.into();
        }
        if let Some(v) = f.audit_max_bytes {
            self.audit_max_bytes = v;
        }
        if f.github_repo.is_some() {
            self.github_repo = f.github_repo;
        }
        if f.relay_container.is_some() {
            self.relay_container = f.relay_container;
        }
        if f.relay_remote_url.is_some() {
            self.relay_remote_url = f.relay_remote_url;
        }
        if let Some(v) = f.store_url {
            self.store_url = crate::store::StoreUrl::parse(&v).map_err(|m| invalid("store_url", m))?;
        }
        if let Some(v) = f.shutdown {
            self.shutdown = parse_shutdown("shutdown", &v)?;
        }
        if let Some(v) = f.webhook_allow {
            self.webhook_allow = v;
        }
        if let Some(v) = f.webhook_max_age_sec {
            self.webhook_max_age_sec = v;
        }
        Ok(())
    }

    fn apply_env(&mut self, env: &dyn Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        let get = |k: &str| env(k).filter(|v| !v.is_empty());
        if let Some(v) = get("CLAWMUX_LISTEN") {
            self.listen = parse_addr("CLAWMUX_LISTEN", &v)?;
        }
        if let Some(v) = get("CLAWMUX_API_TOKEN") {
            self.api_token = Some(Secret::new(v));
        }
        if let Some(v) = get("CLAWMUX_GATEWAY_URL") {
            self.gateway_url = Some(v);
        }
        if let Some(v) = get("CLAWMUX_GATEWAY_TOKEN") {
            self.gateway_token = Some(Secret::new(v));
        }
        if let Some(v) = get("CLAWMUX_OUTBOUND_HEADERS") {
            self.outbound_headers = match v.as_str() {
                "on" => OutboundHeaders::On,
                "off" => OutboundHeaders::Off,
                "auto" => OutboundHeaders::Auto,
                other => return Err(invalid("CLAWMUX_OUTBOUND_HEADERS", format!("{other:?} is not one of on, off, auto"))),
            };
        }
        if let Some(v) = get("CLAWMUX_DEVICE_IDENTITY") {
            self.device_identity = match v.as_str() {
                "on" => DeviceMode::On,
                "off" => DeviceMode::Off,
                "auto" => DeviceMode::Auto,
                other => return Err(invalid("CLAWMUX_DEVICE_IDENTITY", format!("{other:?} is not one of on, off, auto"))),
            };
        }
        if let Some(v) = get("CLAWMUX_DEVICE_KEY_FILE") {
            self.device_key_file = v.into();
        }
        if let Some(v) = get("CLAWMUX_RUN_TIMEOUT_SEC") {
            self.run_timeout_sec = parse_num("CLAWMUX_RUN_TIMEOUT_SEC", &v)?;
        }
        if let Some(v) = get("CLAWMUX_MAX_RUN_TIMEOUT_SEC") {
            self.max_run_timeout_sec = parse_num("CLAWMUX_MAX_RUN_TIMEOUT_SEC", &v)?;
        }
        if let Some(v) = get("CLAWMUX_MAX_MESSAGE_BYTES") {
            self.max_message_bytes = parse_num("CLAWMUX_MAX_MESSAGE_BYTES", &v)?;
        }
        if let Some(v) = get("CLAWMUX_LOG") {
            self.log = v;
        }
        if let Some(v) = get("CLAWMUX_LOG_FORMAT") {
            self.log_format = match v.as_str() {
                "json" => LogFormat::Json,
                "text" => LogFormat::Text,
                other => return Err(invalid("CLAWMUX_LOG_FORMAT", format!("{other:?} is not one of text, json"))),
            };
        }
        if let Some(v) = get("CLAWMUX_PROXY_LISTEN") {
            self.proxy_listen = parse_addr("CLAWMUX_PROXY_LISTEN", &v)?;
        }
        if let Some(v) = get("CLAWMUX_LLM_UPSTREAM_URL") {
            self.llm_upstream_url = Some(v);
        }
        if let Some(v) = get("CLAWMUX_LLM_UPSTREAM_KEY") {
            self.llm_upstream_key = Some(Secret::new(v));
        }
        if let Some(v) = get("CLAWMUX_AUDIT_DIR") {
            self.audit_dir = v.into();
        }
        if let Some(v) = get("CLAWMUX_AUDIT_MAX_BYTES") {
            self.audit_max_bytes = parse_num("CLAWMUX_AUDIT_MAX_BYTES", &v)?;
        }
        if let Some(v) = get("CLAWMUX_RELAY_CONTAINER") {
            self.relay_container = Some(v);
        }
        if let Some(v) = get("CLAWMUX_RELAY_WORKSPACE") {
            self.relay_workspace = v;
        }
        if let Some(v) = get("CLAWMUX_RELAY_REMOTE_URL") {
            self.relay_remote_url = Some(v);
        }
        if let Some(v) = get("CLAWMUX_RELAY_BASE_REF") {
            self.relay_base_ref = v;
        }
        if let Some(v) = get("CLAWMUX_GITHUB_REPO") {
            self.github_repo = Some(v);
        }
        if let Some(v) = get("CLAWMUX_GITHUB_API_URL") {
            self.github_api_url = v;
        }
        if let Some(v) = get("CLAWMUX_GITHUB_TOKEN") {
            self.github_token = Some(Secret::new(v));
        }
        if let Some(v) = get("CLAWMUX_RUN_RETENTION_SEC") {
            self.run_retention_sec = parse_num("CLAWMUX_RUN_RETENTION_SEC", &v)?;
        }
        if let Some(v) = get("CLAWMUX_RUN_RETENTION_MAX") {
            self.run_retention_max = parse_num("CLAWMUX_RUN_RETENTION_MAX", &v)?;
        }
        if let Some(v) = get("CLAWMUX_MAX_RUNS") {
            self.max_runs = parse_num("CLAWMUX_MAX_RUNS", &v)?;
        }
        if let Some(v) = get("CLAWMUX_MAX_STARTING") {
            self.max_starting = parse_num("CLAWMUX_MAX_STARTING", &v)?;
        }
        if let Some(v) = get("CLAWMUX_SHARDS") {
            self.shards = parse_num("CLAWMUX_SHARDS", &v)?;
        }
        if let Some(v) = get("CLAWMUX_STORE_URL") {
            self.store_url = crate::store::StoreUrl::parse(&v).map_err(|m| invalid("CLAWMUX_STORE_URL", m))?;
        }
        if let Some(v) = get("CLAWMUX_SHUTDOWN") {
            self.shutdown = parse_shutdown("CLAWMUX_SHUTDOWN", &v)?;
        }
        if let Some(v) = get("CLAWMUX_WEBHOOK_ALLOW") {
            self.webhook_allow = v;
        }
        if let Some(v) = get("CLAWMUX_WEBHOOK_SECRET") {
            self.webhook_secret = Some(Secret::new(v));
        }
        if let Some(v) = get("CLAWMUX_REPLICA_ID") {
            self.replica_id = parse_replica_id(&v)?;
        }
        if let Some(v) = get("CLAWMUX_RUN_LEASE_SEC") {
            self.run_lease_sec = parse_num("CLAWMUX_RUN_LEASE_SEC", &v)?;
        }
        if let Some(v) = get("CLAWMUX_SEND_TIMEOUT_SEC") {
            self.send_timeout_sec = parse_num("CLAWMUX_SEND_TIMEOUT_SEC", &v)?;
        }
        if let Some(v) = get("CLAWMUX_WEBHOOK_MAX_AGE_SEC") {
            self.webhook_max_age_sec = parse_num("CLAWMUX_WEBHOOK_MAX_AGE_SEC", &v)?;
        }
        Ok(())
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if let Some(url) = &self.gateway_url {
            if !(url.starts_with("ws://") || url.starts_with("wss://")) {
                return Err(invalid("CLAWMUX_GATEWAY_URL", format!("{url:?} must start with ws:// or wss://")));
            }
            if url.contains('@') {
                return Err(invalid("CLAWMUX_GATEWAY_URL", "must not carry credentials; use CLAWMUX_GATEWAY_TOKEN"));
            }
        }
        if self.run_timeout_sec == 0 {
            return Err(invalid("CLAWMUX_RUN_TIMEOUT_SEC", "must be at least 1"));
        }
        if self.max_run_timeout_sec < self.run_timeout_sec {
            return Err(invalid("CLAWMUX_MAX_RUN_TIMEOUT_SEC", "must be at least CLAWMUX_RUN_TIMEOUT_SEC"));
        }
        if self.max_message_bytes == 0 {
            return Err(invalid("CLAWMUX_MAX_MESSAGE_BYTES", "must be at least 1"));
        }
        if let Some(url) = &self.llm_upstream_url {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(invalid("CLAWMUX_LLM_UPSTREAM_URL", format!("{url:?} must start with http:// or https://")));
            }
            if url.contains('@') {
                return Err(invalid("CLAWMUX_LLM_UPSTREAM_URL", "must not carry credentials; use CLAWMUX_LLM_UPSTREAM_KEY"));
            }
        }
        // Renewed every third of it: under 3 s, a few slow round trips to the database would
        // hand live runs to another replica; over an hour, a dead replica's runs wait that long.
        if !(3..=3600).contains(&self.run_lease_sec) {
            return Err(invalid("CLAWMUX_RUN_LEASE_SEC", "must be between 3 and 3600 seconds"));
        }
        // Under a second cuts clients on a congested link; over an hour is no bound.
        if !(1..=3600).contains(&self.send_timeout_sec) {
            return Err(invalid("CLAWMUX_SEND_TIMEOUT_SEC", "must be between 1 and 3600 seconds"));
        }
        if self.max_runs == 0 {
            return Err(invalid("CLAWMUX_MAX_RUNS", "must be at least 1"));
        }
        if let Some(why) = crate::tenants::webhook::Allow::problem(&self.webhook_allow) {
            return Err(invalid("CLAWMUX_WEBHOOK_ALLOW", why));
        }
        if self.shards > MAX_SHARDS {
            return Err(invalid("CLAWMUX_SHARDS", format!("must be from 0 to {MAX_SHARDS}")));
        }
        Ok(())
    }

    /// The effective configuration as `doctor` prints it (secrets redacted).
    pub fn describe(&self) -> Vec<(&'static str, String)> {
        let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "(not set)".to_owned());
        let secret = |v: &Option<Secret>| if v.is_some() { "<redacted>".to_owned() } else { "(not set)".to_owned() };
        vec![
            ("CLAWMUX_LISTEN", self.listen.to_string()),
            ("CLAWMUX_API_TOKEN", secret(&self.api_token)),
            ("CLAWMUX_GATEWAY_URL", opt(&self.gateway_url)),
            ("CLAWMUX_GATEWAY_TOKEN", secret(&self.gateway_token)),
            ("CLAWMUX_OUTBOUND_HEADERS", format!("{:?}", self.outbound_headers).to_lowercase()),
            ("CLAWMUX_DEVICE_IDENTITY", format!("{:?}", self.device_identity).to_lowercase()),
            ("CLAWMUX_DEVICE_KEY_FILE", self.device_key_file.display().to_string()),
            ("CLAWMUX_RUN_TIMEOUT_SEC", self.run_timeout_sec.to_string()),
            ("CLAWMUX_MAX_RUN_TIMEOUT_SEC", self.max_run_timeout_sec.to_string()),
            ("CLAWMUX_MAX_MESSAGE_BYTES", self.max_message_bytes.to_string()),
            ("CLAWMUX_LOG", self.log.clone()),
            ("CLAWMUX_PROXY_LISTEN", self.proxy_listen.to_string()),
            ("CLAWMUX_LLM_UPSTREAM_URL", opt(&self.llm_upstream_url)),
            ("CLAWMUX_LLM_UPSTREAM_KEY", secret(&self.llm_upstream_key)),
            ("CLAWMUX_AUDIT_DIR", self.audit_dir.display().to_string()),
            ("CLAWMUX_AUDIT_MAX_BYTES", self.audit_max_bytes.to_string()),
            ("CLAWMUX_RELAY_CONTAINER", opt(&self.relay_container)),
            ("CLAWMUX_RELAY_WORKSPACE", self.relay_workspace.clone()),
            ("CLAWMUX_RELAY_REMOTE_URL", opt(&self.relay_remote_url)),
            ("CLAWMUX_RELAY_BASE_REF", self.relay_base_ref.clone()),
            ("CLAWMUX_GITHUB_API_URL", self.github_api_url.clone()),
            ("CLAWMUX_GITHUB_REPO", opt(&self.github_repo)),
            ("CLAWMUX_GITHUB_TOKEN", secret(&self.github_token)),
            ("CLAWMUX_RUN_RETENTION_SEC", self.run_retention_sec.to_string()),
            ("CLAWMUX_RUN_RETENTION_MAX", self.run_retention_max.to_string()),
            ("CLAWMUX_MAX_RUNS", self.max_runs.to_string()),
            ("CLAWMUX_SHARDS", self.shards.to_string()),
            ("CLAWMUX_MAX_STARTING", self.max_starting.to_string()),
            ("CLAWMUX_STORE_URL", self.store_url.display()),
            ("CLAWMUX_SHUTDOWN", format!("{:?}", self.shutdown).to_lowercase()),
            ("CLAWMUX_WEBHOOK_ALLOW", if self.webhook_allow.is_empty() { "(none: webhooks refused)".to_owned() } else { self.webhook_allow.clone() }),
            ("CLAWMUX_WEBHOOK_SECRET", secret(&self.webhook_secret)),
            ("CLAWMUX_WEBHOOK_MAX_AGE_SEC", self.webhook_max_age_sec.to_string()),
            ("CLAWMUX_REPLICA_ID", self.replica_id.clone()),
            ("CLAWMUX_RUN_LEASE_SEC", self.run_lease_sec.to_string()),
            ("CLAWMUX_SEND_TIMEOUT_SEC", self.send_timeout_sec.to_string()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn replica_ids_default_to_host_and_pid_and_are_checked() {
        let c = Config::load(None, &env(&[])).expect("defaults are valid");
        assert!(c.replica_id.ends_with(&format!("-{}", std::process::id())) && c.replica_id.len() > 2, "{}", c.replica_id);
        let c = Config::load(None, &env(&[("CLAWMUX_REPLICA_ID", "eu-1a")])).expect("valid");
        assert_eq!(c.replica_id, "eu-1a");
        for bad in ["has space", &"x".repeat(129), "t\u{e9}st"] {
            assert!(Config::load(None, &env(&[("CLAWMUX_REPLICA_ID", bad)])).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn shards_and_start_slots_have_defaults_and_are_checked() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(Config::load(None, &env(&[])).expect("defaults").shards, cores.min(MAX_SHARDS));
        assert_eq!(Config::load(None, &env(&[("CLAWMUX_SHARDS", "3")])).expect("valid").shards, 3);
        assert_eq!(Config::load(None, &env(&[("CLAWMUX_SHARDS", "0")])).expect("valid").shards, 0);
        assert_eq!(Config::load(None, &env(&[])).expect("defaults").max_starting, 256);
        assert_eq!(Config::load(None, &env(&[("CLAWMUX_MAX_STARTING", "0")])).expect("valid").max_starting, 0);
        assert!(Config::load(None, &env(&[("CLAWMUX_MAX_STARTING", "x")])).expect_err("x").to_string().contains("CLAWMUX_MAX_STARTING"));
        for bad in ["257", "many", "-1"] {
            let err = Config::load(None, &env(&[("CLAWMUX_SHARDS", bad)])).expect_err(bad).to_string();
            assert!(err.contains("CLAWMUX_SHARDS"), "{err}");
        }
    }

    #[test]
    fn the_send_timeout_defaults_to_a_minute_and_is_bounded() {
        assert_eq!(Config::load(None, &env(&[])).expect("defaults are valid").send_timeout_sec, 60);
        assert_eq!(Config::load(None, &env(&[("CLAWMUX_SEND_TIMEOUT_SEC", "1")])).expect("valid").send_timeout_sec, 1);
        for bad in ["0", "3601", "-1", "soon"] {
            let e = Config::load(None, &env(&[("CLAWMUX_SEND_TIMEOUT_SEC", bad)])).expect_err(bad).to_string();
            assert!(e.contains("CLAWMUX_SEND_TIMEOUT_SEC"), "{e}");
        }
    }

    #[test]
    fn run_leases_default_to_10_s_and_are_bounded() {
        assert_eq!(Config::load(None, &env(&[])).expect("defaults are valid").run_lease_sec, 10);
        assert_eq!(Config::load(None, &env(&[("CLAWMUX_RUN_LEASE_SEC", "3")])).expect("valid").run_lease_sec, 3);
        for bad in ["0", "2", "3601", "-1", "ten"] {
            let e = Config::load(None, &env(&[("CLAWMUX_RUN_LEASE_SEC", bad)])).expect_err(bad).to_string();
            assert!(e.contains("CLAWMUX_RUN_LEASE_SEC"), "{e}");
        }
    }

    #[test]
    fn defaults_follow_the_contract() {
        let c = Config::load(None, &env(&[])).expect("defaults are valid");
        assert_eq!(c.listen.to_string(), "127.0.0.1:8787");
        assert_eq!(c.run_timeout_sec, 600);
        assert_eq!(c.max_run_timeout_sec, 3600);
        assert_eq!(c.max_message_bytes, 1_048_576);
        assert_eq!(c.outbound_headers, OutboundHeaders::Auto);
        assert_eq!(c.proxy_listen.to_string(), "127.0.0.1:8788");
    }

    #[test]
    fn env_wins_over_the_file() {
        let dir = std::env::temp_dir().join(format!("clawmux-config-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("tmp dir");
        let path = dir.join("c.toml");
        std::fs::write(&path, "listen = \"127.0.0.1:9000\"\nrun_timeout_sec = 30\ngateway_url = \"ws://a:1\"\n").expect("write");
        let c = Config::load(Some(&path), &env(&[("CLAWMUX_LISTEN", "127.0.0.1:9001")])).expect("valid");
        assert_eq!(c.listen.to_string(), "127.0.0.1:9001");
        assert_eq!(c.run_timeout_sec, 30);
        assert_eq!(c.gateway_url.as_deref(), Some("ws://a:1"));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn bad_values_name_the_setting() {
        for (k, v) in [
            ("CLAWMUX_LISTEN", "nope"),
            ("CLAWMUX_GATEWAY_URL", "http://x"),
            ("CLAWMUX_OUTBOUND_HEADERS", "maybe"),
            ("CLAWMUX_RUN_TIMEOUT_SEC", "ten"),
            ("CLAWMUX_MAX_MESSAGE_BYTES", "0"),
        ] {
            let err = Config::load(None, &env(&[(k, v)])).expect_err("invalid");
            assert!(err.to_string().contains(k), "{err}");
        }
    }

    #[test]
    fn unknown_file_keys_are_refused() {
        let dir = std::env::temp_dir().join(format!("clawmux-config-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("tmp dir");
        let path = dir.join("c.toml");
        std::fs::write(&path, "lisen = \"127.0.0.1:9000\"\n").expect("write");
        let err = Config::load(Some(&path), &env(&[])).expect_err("typo refused");
        assert!(err.to_string().contains("lisen"), "{err}");
        std::fs::write(&path, "github_token = \"x\"\n").expect("write");
        assert!(Config::load(Some(&path), &env(&[])).is_err(), "host-only secrets are env-only");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn secrets_are_never_printed() {
        let c = Config::load(None, &env(&[("CLAWMUX_GATEWAY_TOKEN", "s3cret-gw"), ("CLAWMUX_GITHUB_TOKEN", "ghp_s3cret")]))
            .expect("valid");
        let printed = format!("{c:?} {:?}", c.describe());
        assert!(!printed.contains("s3cret"), "{printed}");
    }
}
