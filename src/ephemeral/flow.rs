//! One ephemeral run's execution: what its actor ([`super::actor::ContainerRun`]) runs once the
//! registry gives it its turn.
//!
//! ```text
//! admitted ─(FIFO slot: CLAWMUX_EPHEMERAL_MAX)─▶ inputs + LLM socket ─▶ container ─▶ exit
//!          ─▶ envelope ─▶ text_delta + final | error ─▶ container, socket, inputs removed
//! ```
//! The deadline is admission + the run's timeout (capped by the variant's): the waits for its
//! session key and for a slot count. Abort, timeout, client disconnect and shutdown remove the container at once (with it
//! the agent and its LLM stream; the run's end also cuts its calls in the proxy). Nothing of a run
//! outlives it: its container is removed whatever happened (one the engine was still creating
//! when the run ended, once the create is done: the run's slot and directory are held until
//! then), and a restart reaps the containers (by label) and run directories a crash or a
//! shutdown meanwhile left behind.

use super::container::{self, Plan};
use super::runner::Runner;
use super::socket::RunSocket;
use super::{openclaw_config, outcome};
use crate::agents::EphemeralSpec;
use crate::attribution::RunBilling;
use crate::proxy::ProxyState;
use actix_web::web;
use clawmux_actors::{CancelReason, Checkpoint, ErrorCode, RunEvent, RunOutcome, RunSink, RunSpec};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// What the configuration decides.
#[derive(Debug, Clone)]
pub struct EphemeralConfig {
    /// Where the runs' inputs and sockets live (bind-mounted read-only into their containers, so on the
    /// engine's host). Owned by clawmux: leftovers of a crash are removed at start.
    pub root: PathBuf,
    /// Containers at once (`CLAWMUX_EPHEMERAL_MAX`); more wait in FIFO order.
    pub max_concurrent: usize,
    /// The model of a run that names none.
    pub default_model: String,
}

impl EphemeralConfig {
    /// `CLAWMUX_EPHEMERAL_MAX` (default 4), `CLAWMUX_EPHEMERAL_DIR` (default
    /// `$TMPDIR/clawmux-ephemeral`; it must be clawmux's own, and is kept `0700`),
    /// `CLAWMUX_EPHEMERAL_MODEL` (default `default`).
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Self, String> {
        let max_concurrent = match env("CLAWMUX_EPHEMERAL_MAX").filter(|s| !s.is_empty()) {
            None => 4,
            Some(v) => match v.parse::<usize>() {
                Ok(n) if (1..=1024).contains(&n) => n,
                _ => return Err(format!("CLAWMUX_EPHEMERAL_MAX: {v:?} is not a number from 1 to 1024")),
            },
        };
        let root = env("CLAWMUX_EPHEMERAL_DIR").filter(|s| !s.is_empty()).map_or_else(|| std::env::temp_dir().join("clawmux-ephemeral"), PathBuf::from);
        if !root.is_absolute() {
            return Err(format!("CLAWMUX_EPHEMERAL_DIR: {} must be absolute (the Docker engine mounts it)", root.display()));
        }
        if root.as_os_str().len() > MAX_ROOT_LEN {
            return Err(format!("CLAWMUX_EPHEMERAL_DIR: {} is longer than {MAX_ROOT_LEN} bytes: the runs' sockets in it could not be bound", root.display()));
        }
        let default_model = env("CLAWMUX_EPHEMERAL_MODEL").filter(|s| !s.is_empty()).unwrap_or_else(|| "default".to_owned());
        Ok(Self { root, max_concurrent, default_model })
    }
}

/// Longest runs directory: `<root>/<16 hex>/sock/llm.sock` must fit a unix socket address (108
/// bytes with its NUL).
pub const MAX_ROOT_LEN: usize = 107 - "/0123456789abcdef/sock/llm.sock".len();

/// A run handed to the ephemeral runner.
pub struct Job {
    /// The run (id, message, model, admission time, timeout).
    pub spec: RunSpec,
    /// OpenClaw agent id of the variant.
    pub agent_id: String,
    /// The variant's image and limits.
    pub variant: EphemeralSpec,
    /// Where the run's events go (the run store).
    pub sink: Arc<dyn RunSink>,
    /// The run's billing identity: its LLM socket bills every call to it.
    pub billing: Option<Arc<RunBilling>>,
}

impl Job {
    /// When the run times out: admission plus its timeout (capped by the variant's).
    pub fn deadline(&self) -> std::time::Instant {
        deadline_of(&self.spec, self.spec.timeout.min(self.variant.timeout))
    }
}

/// A run's cancel switch: its actor pulls it, the execution watches it.
#[derive(Default)]
pub struct Switch {
    cancel: CancellationToken,
    reason: Mutex<Option<CancelReason>>,
}

impl Switch {
    /// Cancels the run; the first reason given is the one it ends with.
    pub fn cancel(&self, reason: CancelReason) {
        if let Ok(mut r) = self.reason.lock() {
            r.get_or_insert(reason);
        }
        self.cancel.cancel();
    }
}

/// What ephemeral runs share: the container runner, the FIFO of container slots, the settings.
/// It holds no run: each run's actor, registered in the one registry of live runs, owns it.
pub struct Ephemeral {
    runner: Arc<dyn Runner>,
    /// The attribution proxy's state, shared by every run's socket (`None`: runs get no socket;
    /// only tests of the flow run without one).
    proxy: Option<web::Data<ProxyState>>,
    cfg: EphemeralConfig,
    /// FIFO: tokio's semaphore hands permits out in request order.
    slots: Arc<tokio::sync::Semaphore>,
    /// The engine's CPUs, once it has said.
    engine_cpus: std::sync::OnceLock<u32>,
}

impl Ephemeral {
    /// The runner of ephemeral runs.
    pub fn new(runner: Arc<dyn Runner>, proxy: Option<web::Data<ProxyState>>, cfg: EphemeralConfig) -> Arc<Self> {
        let slots = Arc::new(tokio::sync::Semaphore::new(cfg.max_concurrent.max(1)));
        Arc::new(Self { runner, proxy, cfg, slots, engine_cpus: std::sync::OnceLock::new() })
    }

    /// A variant's CPU limit, at most the engine's cores: Docker refuses a limit above them, and
    /// every run of the variant would fail. Asked of the engine once it answers.
    async fn cpu_limit(&self, wanted: Option<i64>) -> Option<i64> {
        let wanted = wanted?;
        let cores = match self.engine_cpus.get() {
            Some(c) => Some(*c),
            None => {
                let c = self.runner.cpus().await;
                if let Some(c) = c {
                    let _ = self.engine_cpus.set(c);
                }
                c
            }
        };
        Some(cores.map_or(wanted, |c| wanted.min(i64::from(c) * 1_000_000_000)))
    }

    /// Removes what a previous process left: labelled containers and run directories.
    pub async fn reap(&self) {
        match self.runner.reap(&container::owner_of(&self.cfg.root)).await {
            Ok(names) if !names.is_empty() => tracing::warn!(containers = ?names, "removed ephemeral containers a previous clawmux left behind"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "cannot look for orphaned ephemeral containers"),
        }
        // Checked first: a runs directory swapped for another's would have that one emptied.
        match secure_root(&self.cfg.root) {
            Ok(root) => {
                if let Ok(entries) = std::fs::read_dir(&root) {
                    for e in entries.flatten() {
                        let _ = std::fs::remove_dir_all(e.path());
                    }
                }
            }
            Err(e) => tracing::error!(error = %e, "the ephemeral runs directory is not safe to use; leftovers not removed, and every ephemeral run will fail until it is fixed"),
        }
    }

    /// Whether a run started now would get a container slot at once.
    pub fn has_free_slot(&self) -> bool {
        self.slots.available_permits() > 0
    }

    /// Runs `job` (it waits for a slot if all are taken) until it ends or `switch` cancels it;
    /// its container, socket and inputs are gone when this returns. The run's text (if any)
    /// and its outcome, for its actor to emit.
    pub async fn run(&self, job: &Job, live: &Switch) -> (RunOutcome, Option<String>) {
        let deadline = Instant::from_std(job.deadline());
        let cancelled = |live: &Switch| {
            let reason = live.reason.lock().ok().and_then(|r| *r).unwrap_or(CancelReason::Api);
            (reason.outcome(String::new()), None)
        };
        let timed_out = || (CancelReason::Timeout.outcome(String::new()), None);
        let permit = tokio::select! {
            p = self.slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => return (RunOutcome::failed(ErrorCode::Internal, "the ephemeral runner is shut down", String::new()), None),
            },
            _ = live.cancel.cancelled() => return cancelled(live),
            _ = tokio::time::sleep_until(deadline) => return timed_out(),
        };
        job.sink.checkpoint(Checkpoint::Running);
        let nonce = uuid::Uuid::new_v4().simple().to_string();
        let name = container::name(&job.spec.run_id, &nonce[..12]);
        // Short: the socket's path must fit a unix socket address (108 bytes).
        let dir = self.cfg.root.join(&nonce[..16]);
        let (result, unfinished) = self.contained(job, live, &name, &dir, deadline).await;
        let result = match result {
            Contained::Ended(exit, None) => outcome::of(exit, job.variant.output_bytes, job.variant.memory_bytes / (1024 * 1024)),
            Contained::Ended(exit, Some(limit)) => outcome::past_its_limit(outcome::of(exit, job.variant.output_bytes, job.variant.memory_bytes / (1024 * 1024)), limit),
            Contained::Cancelled => cancelled(live),
            Contained::TimedOut => timed_out(),
            Contained::Failed(m) => (RunOutcome::failed(ErrorCode::Internal, m, String::new()), None),
        };
        match unfinished {
            None => {
                remove_run_dir(&dir, &job.spec.run_id);
                drop(permit);
            }
            // The run ended while the engine still creates its container: the create goes on
            // (dropping the request does not stop the engine), and what it made is removed once it
            // is done, then the directory its binds name (the engine would make a missing one
            // again, as root) and the slot (the container counted until then).
            Some(start) => {
                let (runner, run_id) = (self.runner.clone(), job.spec.run_id.clone());
                tokio::spawn(async move {
                    if let Ok(Ok(_)) = start.await {
                        runner.remove(&name).await;
                    }
                    remove_run_dir(&dir, &run_id);
                    drop(permit);
                });
            }
        }
        result
    }

    /// Workspace, socket, container; everything removed again before it returns, but for a
    /// container whose create was still under way when the run ended: its start, returned.
    async fn contained(&self, job: &Job, live: &Switch, name: &str, dir: &Path, deadline: Instant) -> (Contained, Option<StartTask>) {
        // The engine is asked for its cores once (a variant with `cpus`): a stuck engine must not
        // hold an abort or the deadline up for its client's timeout (120 s).
        let nano_cpus = tokio::select! {
            c = self.cpu_limit(job.variant.nano_cpus) => c,
            _ = live.cancel.cancelled() => return (Contained::Cancelled, None),
            _ = tokio::time::sleep_until(deadline) => return (Contained::TimedOut, None),
        };
        let layout = match prepare(dir, job, &self.cfg.default_model) {
            Ok(l) => l,
            Err(e) => return (Contained::Failed(format!("cannot prepare the run's directory in {}: {e}", dir.display())), None),
        };
        let socket = match (&self.proxy, &job.billing) {
            (Some(proxy), Some(billing)) => match RunSocket::start(&layout.socket_dir.join("llm.sock"), proxy.clone(), billing.clone()) {
                Ok(s) => Some(s),
                Err(e) => return (Contained::Failed(format!("cannot open the run's LLM socket: {e}")), None),
            },
            _ => None,
        };
        let input = layout.input.to_string_lossy().into_owned();
        let sock = layout.socket_dir.to_string_lossy().into_owned();
        let owner = container::owner_of(&self.cfg.root);
        let hard = deadline.saturating_duration_since(Instant::now()).as_secs().max(1);
        let agent_limit = container::agent_timeout_sec(hard);
        let plan = Plan {
            run_id: &job.spec.run_id,
            agent_id: &job.agent_id,
            spec: &job.variant,
            input_host: &input,
            socket_dir_host: &sock,
            user: layout.user,
            owner: &owner,
            agent_timeout_sec: agent_limit,
            nano_cpus,
        };
        let (result, unfinished) = self.run_container(job, live, name, container::body(&plan), deadline, agent_limit).await;
        if unfinished.is_none() {
            self.runner.remove(name).await;
        }
        if let Some(s) = socket {
            s.stop().await;
        }
        (result, unfinished)
    }

    async fn run_container(
        &self,
        job: &Job,
        live: &Switch,
        name: &str,
        body: bollard::models::ContainerCreateBody,
        deadline: Instant,
        agent_limit: u64,
    ) -> (Contained, Option<StartTask>) {
        // The create and start go on in a task of their own: when the run ends meanwhile, it
        // ends at once (the engine's client may wait up to its timeout), and the start is
        // returned for `run` to finish cleaning up after.
        let mut start: StartTask = {
            let (runner, name) = (self.runner.clone(), name.to_owned());
            tokio::spawn(async move { runner.start(&name, body).await })
        };
        let id = tokio::select! {
            r = &mut start => match r {
                Ok(Ok(id)) => id,
                Ok(Err(e)) => return (Contained::Ended(Err(e), None), None),
                Err(e) => return (Contained::Failed(format!("the container's start did not finish: {e}")), None),
            },
            _ = live.cancel.cancelled() => return (Contained::Cancelled, Some(start)),
            _ = tokio::time::sleep_until(deadline) => return (Contained::TimedOut, Some(start)),
        };
        // The agent's own time limit counts from its start in the container (a moment later).
        let agent_deadline = Instant::now() + Duration::from_secs(agent_limit);
        (self.follow(job, live, &id, name, deadline, (agent_deadline, agent_limit)).await, None)
    }

    /// The started container until it ends, the run is cancelled or its deadline passes.
    /// `agent`: when the agent's own time limit passes, and the limit (seconds).
    async fn follow(&self, job: &Job, live: &Switch, id: &str, name: &str, deadline: Instant, agent: (Instant, u64)) -> Contained {
        job.sink.emit(RunEvent::Accepted { gateway_run_id: name.to_owned() });
        let ended = tokio::select! {
            biased;
            _ = live.cancel.cancelled() => return Contained::Cancelled,
            _ = tokio::time::sleep_until(deadline) => return Contained::TimedOut,
            exit = self.runner.wait(id, job.variant.output_bytes) => exit,
        };
        // A cancel that came first is why the agent ended (e.g. its LLM call refused for the
        // budget): the run ends with the cancel's reason, not with what the agent made of it.
        if live.cancel.is_cancelled() {
            return Contained::Cancelled;
        }
        // An agent that exited after the time limit it was given stopped for that limit: the
        // run exceeded its timeout, however the agent exited (OpenClaw, timed out, may exit 1 with
        // an error of its own), not an agent error; clawmux's own deadline, a grace later, would
        // have ended it `timeout` just the same (the real-Docker test: the run's 90 s, the agent's
        // 81 s). Not a kill for memory or output, nor a container the engine lost.
        let stopped_itself = matches!(&ended, Ok(e) if !e.oom_killed && !e.stdout_over_limit);
        let late = (stopped_itself && Instant::now() >= agent.0).then_some(agent.1);
        Contained::Ended(ended, late)
    }
}

/// A container's create and start, under way in a task of its own.
type StartTask = tokio::task::JoinHandle<Result<String, super::runner::RunnerError>>;

/// Removes a run's directory (its inputs and socket); a failure is logged, the next start
/// removes what is left.
fn remove_run_dir(dir: &Path, run_id: &str) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(run_id, error = %e, dir = %dir.display(), "cannot remove an ephemeral run's directory; the next start does");
        }
    }
}

/// How the container part ended.
enum Contained {
    /// The container ended; `Some(limit)`: after the agent's own time limit (`limit` seconds).
    Ended(Result<super::runner::Exit, super::runner::RunnerError>, Option<u64>),
    Cancelled,
    TimedOut,
    Failed(String),
}

/// A run's deadline: its admission (wall clock: time queued counts) plus its timeout.
fn deadline_of(spec: &RunSpec, timeout: Duration) -> std::time::Instant {
    let end = spec.admitted_at + timeout;
    let left = end.duration_since(std::time::SystemTime::now()).unwrap_or(Duration::ZERO);
    std::time::Instant::now() + left
}

/// A prepared run directory.
struct Layout {
    input: PathBuf,
    socket_dir: PathBuf,
    user: (u32, u32),
}

/// Creates `dir/in` (config + prompt, readable by the container's user, mounted read-only) and
/// `dir/sock` (the run's LLM socket). The workspace is not here: it is the container's tmpfs.
fn prepare(dir: &Path, job: &Job, default_model: &str) -> std::io::Result<Layout> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    // Below the runs directory as resolved: the paths handed to the engine hold no link anyone
    // could re-point between this check and the mount.
    let dir = &secure_root(dir.parent().unwrap_or(dir))?.join(dir.file_name().unwrap_or_default());
    let input = dir.join("in");
    let sock = dir.join("sock");
    std::fs::create_dir(dir)?;
    // The container reaches its inputs and socket through its bind mounts, never through this
    // path: nobody else on the host needs to.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    let meta = std::fs::metadata(dir)?;
    let user = container::user_for(meta.uid(), meta.gid());
    for d in [&input, &sock] {
        std::fs::create_dir(d)?;
    }
    let model = openclaw_config::model_id(job.spec.model.as_deref(), default_model);
    let hard = job.spec.timeout.min(job.variant.timeout).as_secs();
    let config = openclaw_config::generate(&job.agent_id, &model, container::agent_timeout_sec(hard));
    std::fs::write(input.join("openclaw.json"), serde_json::to_vec_pretty(&config).map_err(std::io::Error::other)?)?;
    std::fs::write(input.join("prompt.txt"), job.spec.message.as_bytes())?;
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o755))?;
    if (meta.uid(), meta.gid()) != user {
        chown_tree(&input, user)?;
    }
    // Writable by its owner on the host only (so it can be removed); the mount is read-only.
    std::fs::set_permissions(&input, std::fs::Permissions::from_mode(0o700))?;
    Ok(Layout { input, socket_dir: sock, user })
}

/// Creates the runs directory if needed and makes sure it is clawmux's own and private (`0700`):
/// every run's LLM socket (billed to that run, forwarded with the upstream key), prompt and
/// config are below it, and the Docker engine mounts paths below it as root. A directory of
/// another user (say, created in a shared `/tmp` before clawmux first ran) or a symlink is
/// refused: whoever owns it could swap a run's directory for a link between its preparation and
/// the mount. Returns its resolved path (no link in it).
pub(crate) fn secure_root(root: &Path) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    if !root.is_absolute() {
        return Err(std::io::Error::other(format!("the ephemeral runs directory {} is not an absolute path", root.display())));
    }
    // Missing parents are made clawmux's own and private (the umask could leave them group-writable).
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(root)?;
    let meta = std::fs::symlink_metadata(root)?;
    let me = rustix::process::geteuid().as_raw();
    // Its parents too, as written (a link among them) and as resolved: whoever may replace one of
    // them can put another directory in the runs directory's place.
    let real = std::fs::canonicalize(root)?;
    let resolved = (real != root).then_some(real.as_path());
    for dir in std::iter::once(root).chain(resolved) {
        for parent in dir.ancestors().skip(1) {
            check_parent(parent, &std::fs::symlink_metadata(parent)?, me)?;
        }
    }
    if !meta.is_dir() {
        return Err(std::io::Error::other(format!("the ephemeral runs directory {} is not a directory (a symlink?)", root.display())));
    }
    if meta.uid() != me {
        return Err(std::io::Error::other(format!(
            "the ephemeral runs directory {} belongs to uid {}, not to clawmux (uid {me}); set CLAWMUX_EPHEMERAL_DIR to a directory of its own",
            root.display(),
            meta.uid()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700))?;
    }
    // The sockets are bound below the resolved path (the engine is given it too): the configured
    // one's length was checked at start, but a link in it may lead somewhere longer.
    if real.as_os_str().len() > MAX_ROOT_LEN {
        return Err(std::io::Error::other(format!(
            "the ephemeral runs directory {} resolves to {}, longer than {MAX_ROOT_LEN} bytes: the runs' sockets in it could not be bound; set CLAWMUX_EPHEMERAL_DIR to a shorter path",
            root.display(),
            real.display()
        )));
    }
    Ok(real)
}

/// A parent of the runs directory must be root's or clawmux's, and writable by nobody else unless
/// it is sticky (like `/tmp`: there only an entry's owner may rename or remove it, and the next
/// path element is checked in its turn).
fn check_parent(parent: &Path, meta: &std::fs::Metadata, me: u32) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    if meta.uid() != 0 && meta.uid() != me {
        return Err(std::io::Error::other(format!(
            "{} (a parent of the ephemeral runs directory) belongs to uid {}, neither root nor clawmux (uid {me}): its owner could swap the runs directory; set CLAWMUX_EPHEMERAL_DIR below directories of root's or clawmux's own",
            parent.display(),
            meta.uid()
        )));
    }
    let sticky = meta.mode() & 0o1000 != 0;
    if meta.is_dir() && meta.mode() & 0o022 != 0 && !sticky {
        return Err(std::io::Error::other(format!(
            "{} (a parent of the ephemeral runs directory) is writable by other users (mode {:o}) and not sticky: they could swap the runs directory; set CLAWMUX_EPHEMERAL_DIR below directories only root or clawmux can write",
            parent.display(),
            meta.mode() & 0o7777
        )));
    }
    Ok(())
}

/// Gives `path` and everything below it to `uid:gid`, never following a link.
fn chown_tree(path: &Path, (uid, gid): (u32, u32)) -> std::io::Result<()> {
    std::os::unix::fs::lchown(path, Some(uid), Some(gid))?;
    if std::fs::symlink_metadata(path)?.is_dir() {
        for e in std::fs::read_dir(path)? {
            chown_tree(&e?.path(), (uid, gid))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
