//! The host-side git relay: the agent commits inside the gateway container, the host turns those
//! commits into a pushed branch and a pull request, and no credential ever enters the container.
//!
//! - [`exec`]: [`ContainerExec`], running an argv inside the container ([`DockerExec`] through
//!   the Docker API; [`Recording`] wraps any of them and keeps every argv).
//! - [`git`]: pure argv builders, validation and parsers.
//! - `host`: git on the host (the clone, `git am`, `git push`; the token path).
//! - `github`: the pull-request calls.
//!
//! [`GitRelay::prepare`] makes sure `sandbox/<key>` has its worktree `<root>/wt/<key>` (created
//! from the base ref when missing, reused when present). [`GitRelay::publish`] counts
//! `base..HEAD` in that worktree; with commits, it extracts them with `git format-patch`, applies
//! the ones the remote branch does not have yet to a fresh host clone with `git am`, checks that
//! the result has exactly the container's tree, pushes `sandbox/<key>` conditional on the remote
//! head it observed (compare-and-swap: never over someone else's push; never forced unless
//! configured) and creates or updates the pull request. [`GitRelay::check`] finds a caller's
//! mistakes (an unknown base ref, a key whose branch conflicts with an existing one) before a run
//! is admitted. `docs/relay.md` has the whole story.

pub mod exec;
pub mod git;
mod github;
mod host;

pub use exec::{ContainerExec, DockerExec, ExecOutput, RecordedExec, Recording};

use crate::config::Secret;
use git::{Paths, Plan};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};

/// The relay's errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The branch key breaks the contract (the API answers `400` before it gets here).
    #[error("invalid branch key: {0}")]
    InvalidBranchKey(String),
    /// The base ref is not a plain ref name or commit id.
    #[error("invalid base ref: {0}")]
    InvalidRef(String),
    /// The configuration cannot work.
    #[error("relay configuration: {0}")]
    Config(String),
    /// The Docker engine or the container.
    #[error("docker: {0}")]
    Docker(String),
    /// A command did not finish in time.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// "git format-patch" and the like.
        what: String,
        /// The bound.
        after: Duration,
    },
    /// A command's output exceeded the bound.
    #[error("command output exceeds {limit} bytes")]
    OutputTooLarge {
        /// The bound.
        limit: usize,
    },
    /// A command exited non-zero.
    #[error("{what} failed (exit {exit_code}): {stderr}")]
    CommandFailed {
        /// "git worktree", "host git push", …
        what: String,
        /// Its exit code.
        exit_code: i64,
        /// Its stderr (trimmed, bounded, token redacted).
        stderr: String,
    },
    /// The container's workspace is not in the state the relay needs.
    #[error("workspace: {0}")]
    Workspace(String),
    /// The request cannot be carried out in this repository, and the caller can fix it.
    #[error("{message}")]
    Rejected {
        /// Which mistake.
        kind: Rejection,
        /// What to fix (no secret).
        message: String,
    },
    /// Local I/O (temp dir, spawning git).
    #[error("io: {0}")]
    Io(String),
}

/// A caller's mistake the relay finds in the repository (the API answers `422`, a run that finds
/// it later ends `relay_rejected`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// The base ref does not exist in the container's repository.
    UnknownBaseRef,
    /// `sandbox/<key>` cannot exist next to an existing branch (`a` blocks `a/b` and the reverse).
    KeyConflict,
}

/// The caller sees the branches in the way that are above `branch` (their names are prefixes of
/// its own key), never one below it: that is another key, perhaps another account's, whose name
/// it must not learn by asking for a prefix of it. The log has them all.
fn key_conflict(branch: &str, with: &[String], place: &str) -> RelayError {
    tracing::info!(%branch, conflicts = ?with, place, "branch key conflict");
    let mut shown: Vec<String> = with
        .iter()
        .map(|w| if branch.starts_with(&format!("{w}/")) { w.clone() } else { format!("{branch}/…") })
        .collect();
    shown.sort();
    shown.dedup();
    RelayError::Rejected {
        kind: Rejection::KeyConflict,
        message: format!(
            "{branch} cannot be created: {} exists {place}, and git cannot hold a branch and another branch under it (like `a` and `a/b`); use another branch key",
            shown.join(", ")
        ),
    }
}

/// Where the relay works, and how.
#[derive(Clone)]
pub struct RelayConfig {
    /// Name or id of the gateway container (git runs there through the Docker API).
    pub container: String,
    /// Docker endpoint (`unix://…`, `tcp://…`); `None`: `DOCKER_HOST` or the local socket.
    pub docker_host: Option<String>,
    /// `user[:group]` for execs; `None`: the container's user (must own the workspace).
    pub exec_user: Option<String>,
    /// Workspace root in the container: the repo is `<root>/repo`, worktrees `<root>/wt/<key>`.
    pub workspace_root: String,
    /// The repository the host pushes `sandbox/<key>` to (URL or path). Must not carry credentials.
    pub remote_url: String,
    /// Default base ref (`main`).
    pub base_ref: String,
    /// GitHub REST base (`https://api.github.com`); `None`: push only, no pull request.
    pub github_api_url: Option<String>,
    /// `owner/repo` for the API; `None`: taken from `remote_url`.
    pub github_repo: Option<String>,
    /// Token for push (http(s) remotes) and the API. Lives only in this process.
    pub token: Option<Secret>,
    /// Retries after a failed clone, push or API call (attempts = retries + 1).
    pub retries: u32,
    /// First backoff between attempts (doubles, capped at 30 s).
    pub retry_backoff: Duration,
    /// Overwrite a diverged remote branch (`--force-with-lease`). Off by default.
    pub force_push: bool,
    /// Bound on one container exec.
    pub exec_timeout: Duration,
    /// Bound on one host git command (clone, push, …).
    pub host_git_timeout: Duration,
    /// Bound on one GitHub API request.
    pub api_timeout: Duration,
    /// Bound on a whole publish. The per-step bounds above, times the retries, add up to hours
    /// against a remote that accepts connections and then stalls, and the run holds its branch
    /// key all that time (a run cannot be cancelled while it publishes).
    pub publish_timeout: Duration,
    /// Committer of the relayed commits on the host (authors stay the agent's).
    pub committer_name: String,
    /// Committer email.
    pub committer_email: String,
    /// The host's git binary (`git`: found on `PATH`).
    pub git_program: PathBuf,
}

impl std::fmt::Debug for RelayConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayConfig")
            .field("container", &self.container)
            .field("docker_host", &self.docker_host)
            .field("exec_user", &self.exec_user)
            .field("workspace_root", &self.workspace_root)
            .field("remote_url", &self.remote_url)
            .field("base_ref", &self.base_ref)
            .field("github_api_url", &self.github_api_url)
            .field("github_repo", &self.github_repo)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("retries", &self.retries)
            .field("force_push", &self.force_push)
            .field("publish_timeout", &self.publish_timeout)
            .field("git_program", &self.git_program)
            .finish_non_exhaustive()
    }
}

impl RelayConfig {
    /// Defaults for a container and a remote: workspace `/workspace`, base `main`, no API, 3
    /// retries from 500 ms, no force push, 60 s per exec, 300 s per host git command, 10 minutes
    /// per publish.
    pub fn new(container: impl Into<String>, remote_url: impl Into<String>) -> Self {
        Self {
            container: container.into(),
            docker_host: None,
            exec_user: None,
            workspace_root: "/workspace".to_owned(),
            remote_url: remote_url.into(),
            base_ref: "main".to_owned(),
            github_api_url: None,
            github_repo: None,
            token: None,
            retries: 3,
            retry_backoff: Duration::from_millis(500),
            force_push: false,
            exec_timeout: Duration::from_secs(60),
            host_git_timeout: Duration::from_secs(300),
            api_timeout: Duration::from_secs(30),
            publish_timeout: Duration::from_secs(600),
            committer_name: "clawmux relay".to_owned(),
            committer_email: "relay@clawmux.invalid".to_owned(),
            git_program: PathBuf::from("git"),
        }
    }

    /// From the service configuration: `None` when no relay container is configured; an error
    /// when the container is set but the remote is not.
    pub fn from_app_config(c: &crate::config::Config) -> Result<Option<Self>, String> {
        let Some(container) = c.relay_container.clone() else { return Ok(None) };
        let remote = c.relay_remote_url.clone().ok_or("CLAWMUX_RELAY_CONTAINER is set but CLAWMUX_RELAY_REMOTE_URL is not")?;
        let mut r = Self::new(container, remote);
        r.docker_host = std::env::var("DOCKER_HOST").ok().filter(|s| !s.is_empty());
        r.workspace_root = c.relay_workspace.clone();
        r.base_ref = c.relay_base_ref.clone();
        r.github_api_url = Some(c.github_api_url.clone()).filter(|s| !s.is_empty());
        r.token = c.github_token.clone();
        r.github_repo = c.github_repo.clone();
        Ok(Some(r))
    }

    fn owner_repo(&self) -> Option<(String, String)> {
        match &self.github_repo {
            Some(s) => git::parse_owner_repo(s),
            None => git::owner_repo_from_url(&self.remote_url),
        }
    }
}

/// A prepared workspace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Workspace {
    /// The worktree in the container: tell the agent to work (and commit) there.
    pub path: String,
    /// `sandbox/<key>`.
    pub branch: String,
    /// Its HEAD when prepared.
    pub head: String,
    /// Created now (false: reused from an earlier run).
    pub created: bool,
}

/// The step of [`GitRelay::publish`] that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RelayStage {
    /// Branch key, base ref or configuration.
    Validate,
    /// Reading the worktree's state in the container.
    Inspect,
    /// `git format-patch` in the container.
    Extract,
    /// Cloning or fetching the remote on the host.
    Clone,
    /// Applying the patches on the host (including "the remote branch diverged").
    Apply,
    /// `git push`.
    Push,
    /// The GitHub API.
    PullRequest,
}

impl std::fmt::Display for RelayStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Validate => "validate",
            Self::Inspect => "inspect",
            Self::Extract => "extract",
            Self::Clone => "clone",
            Self::Apply => "apply",
            Self::Push => "push",
            Self::PullRequest => "pull request",
        })
    }
}

/// What went wrong in a publish, for the run document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RelayFailure {
    /// The step.
    pub stage: RelayStage,
    /// What failed (no secret).
    pub message: String,
    /// Attempts made at that step.
    pub attempts: u32,
}

impl std::fmt::Display for RelayFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.attempts > 1 {
            write!(f, "{} failed after {} attempts: {}", self.stage, self.attempts, self.message)
        } else {
            write!(f, "{} failed: {}", self.stage, self.message)
        }
    }
}

impl RelayFailure {
    fn new(stage: RelayStage, message: impl Into<String>, attempts: u32) -> Self {
        Self { stage, message: message.into(), attempts }
    }
}

/// The result of a publish (the run document's `relay`, plus details).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RelayOutcome {
    /// `sandbox/<key>`.
    pub branch: String,
    /// Commits `base..HEAD` on the branch in the container (all of them, not only new ones).
    pub commit_count: usize,
    /// This call pushed (`false` when the remote branch already had every commit, or on an error
    /// before the push).
    pub pushed: bool,
    /// Commits this call pushed.
    pub pushed_commits: usize,
    /// The remote branch's head as this call left it (after its push) or found it (nothing
    /// pushed, or someone else's head when the branch changed or diverged); absent when the
    /// remote has no such branch or the call failed before looking.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_head: Option<String>,
    /// The pull request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pr_url: Option<String>,
    /// Its number.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pr_number: Option<u64>,
    /// What failed; the commits stay on the container's branch for the next run or a retry.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<RelayFailure>,
}

/// The relay. Cheap to share (`Arc` inside). Callers serialize per key: the registry of live runs
/// holds one lock per branch key (`clawmux_actors::registry`).
#[derive(Clone)]
pub struct GitRelay {
    /// Settings.
    cfg: Arc<RelayConfig>,
    /// How commands reach the container.
    exec: Arc<dyn ContainerExec>,
}

impl std::fmt::Debug for GitRelay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GitRelay").field("cfg", &self.cfg).finish_non_exhaustive()
    }
}

type Step<T> = Result<T, RelayFailure>;

impl GitRelay {
    /// A relay over `exec`. Checks the configuration: base ref, a remote URL without credentials,
    /// and `owner/repo` when the API is configured.
    pub fn new(cfg: RelayConfig, exec: Arc<dyn ContainerExec>) -> Result<Self, RelayError> {
        git::validate_base_ref(&cfg.base_ref).map_err(|m| RelayError::InvalidRef(format!("{:?} {m}", cfg.base_ref)))?;
        if cfg.remote_url.is_empty() {
            return Err(RelayError::Config("no remote URL".to_owned()));
        }
        if git::url_has_credentials(&cfg.remote_url) {
            return Err(RelayError::Config("the remote URL must not carry credentials: the token is passed through a credential helper".to_owned()));
        }
        if cfg.remote_url.starts_with('-') {
            return Err(RelayError::Config("the remote URL must not start with '-'".to_owned()));
        }
        if !cfg.workspace_root.starts_with('/') {
            return Err(RelayError::Config("the workspace root must be an absolute path".to_owned()));
        }
        if cfg.github_api_url.is_some() && cfg.owner_repo().is_none() {
            return Err(RelayError::Config("cannot tell the GitHub owner/repo from the remote URL: set github_repo".to_owned()));
        }
        Ok(Self { cfg: Arc::new(cfg), exec })
    }

    /// A relay that talks to the configured container through the Docker API.
    pub async fn connect(cfg: RelayConfig) -> Result<Self, RelayError> {
        let exec = DockerExec::connect(cfg.docker_host.as_deref(), &cfg.container, cfg.exec_user.as_deref()).await?;
        Self::new(cfg, Arc::new(exec))
    }

    /// The settings.
    pub fn config(&self) -> &RelayConfig {
        &self.cfg
    }

    /// The worktree path and branch of `key` (no I/O, no validation).
    pub fn paths(&self, key: &str) -> (String, String) {
        let p = Paths::new(&self.cfg.workspace_root, key);
        (p.worktree, p.branch)
    }

    async fn run(&self, argv: Vec<String>) -> Result<ExecOutput, RelayError> {
        self.exec.exec(&argv, None, self.cfg.exec_timeout).await
    }

    async fn run_ok(&self, argv: Vec<String>) -> Result<ExecOutput, RelayError> {
        let o = self.run(argv.clone()).await?;
        if !o.success() {
            return Err(RelayError::CommandFailed { what: exec::describe(&argv), exit_code: o.exit_code, stderr: o.stderr_text() });
        }
        Ok(o)
    }

    fn validate(&self, key: &str, base_ref: &str) -> Result<(), RelayError> {
        git::validate_base_ref(base_ref).map_err(|m| RelayError::InvalidRef(format!("{base_ref:?} {m}")))?;
        git::validate_key(key, base_ref).map_err(|m| RelayError::InvalidBranchKey(format!("{key:?} {m}")))?;
        Ok(())
    }

    /// Makes sure `sandbox/<key>` has its worktree `<root>/wt/<key>`: reused when it exists (and
    /// is on that branch), otherwise added (from `base_ref` when the branch is new, or on the
    /// existing branch when only the directory was gone). Every exec's exit code is checked.
    pub async fn prepare(&self, branch_key: &str, base_ref: &str) -> Result<Workspace, RelayError> {
        self.validate(branch_key, base_ref)?;
        let p = Paths::new(&self.cfg.workspace_root, branch_key);
        let list = self.run(git::worktree_list(&p)).await?;
        if !list.success() {
            return Err(RelayError::Workspace(format!("no git repository at {} in the container: {}", p.repo, list.stderr_text())));
        }
        // every publish counts the commits from the base ref: a missing one is the caller's to
        // fix, and better said before the agent works than after
        self.require_base(&p, base_ref).await?;
        let entries = git::parse_worktree_list(&String::from_utf8_lossy(&list.stdout));
        let want_ref = p.branch_ref();
        let mut created = true;
        match entries.iter().find(|e| e.path == p.worktree) {
            Some(e) if e.prunable => {
                self.run_ok(git::worktree_prune(&p)).await?;
                self.add_worktree(&p, base_ref).await?;
            }
            Some(e) => {
                if e.branch.as_deref() != Some(want_ref.as_str()) {
                    return Err(RelayError::Workspace(format!("{} is on {}, not {}", p.worktree, e.branch.as_deref().unwrap_or("a detached HEAD"), p.branch)));
                }
                created = false;
            }
            None => {
                if let Some(other) = entries.iter().find(|e| e.branch.as_deref() == Some(want_ref.as_str())) {
                    return Err(RelayError::Workspace(format!("{} is checked out at {}, not {}", p.branch, other.path, p.worktree)));
                }
                self.add_worktree(&p, base_ref).await?;
            }
        }
        let head = self.run_ok(git::verify_commit(&p.worktree, "HEAD")).await?;
        let head = git::parse_object_id(&head.stdout_text()).ok_or_else(|| RelayError::Workspace("HEAD is not a commit".to_owned()))?;
        info!(branch = %p.branch, worktree = %p.worktree, created, "relay: workspace ready");
        Ok(Workspace { path: p.worktree, branch: p.branch, head, created })
    }

    async fn add_worktree(&self, p: &Paths, base_ref: &str) -> Result<(), RelayError> {
        let exists = self.run(git::branch_exists(p)).await?;
        if exists.success() {
            self.run_ok(git::worktree_add_existing(p)).await?;
            return Ok(());
        }
        self.require_no_conflict(p, key_of(p)).await?;
        self.run_ok(git::worktree_add_new(p, base_ref)).await?;
        Ok(())
    }

    /// The base ref resolves to a commit in the container's repository.
    async fn require_base(&self, p: &Paths, base_ref: &str) -> Result<(), RelayError> {
        let base = self.run(git::verify_commit(&p.repo, base_ref)).await?;
        if !base.success() {
            return Err(RelayError::Rejected { kind: Rejection::UnknownBaseRef, message: format!("base ref {base_ref:?} not found in the repository ({} in the container)", p.repo) });
        }
        Ok(())
    }

    /// No branch of the container's repository blocks `sandbox/<key>`.
    async fn require_no_conflict(&self, p: &Paths, key: &str) -> Result<(), RelayError> {
        let out = self.run_ok(git::sandbox_branches(p, key)).await?;
        let text = out.stdout_text();
        let with = crate::refname::conflicting_branches(key, text.lines());
        if !with.is_empty() {
            return Err(key_conflict(&p.branch, &with, "in the container's repository"));
        }
        Ok(())
    }

    fn host_settings(&self, home: PathBuf, timeout: Duration) -> host::HostSettings {
        host::HostSettings { program: self.cfg.git_program.clone(), timeout, max_output: exec::DEFAULT_MAX_OUTPUT, committer: (self.cfg.committer_name.clone(), self.cfg.committer_email.clone()), home }
    }

    /// Before a run is admitted: the caller's mistakes the repositories show now. The base ref
    /// must exist in the container's repository, and no branch there or on the remote may block
    /// `sandbox/<key>`. The remote is asked with `git ls-remote` (bounded by 20 s); when it cannot
    /// be reached it is not checked (a push would report the conflict later).
    pub async fn check(&self, key: &str, base_ref: &str) -> Result<(), RelayError> {
        self.validate(key, base_ref)?;
        let p = Paths::new(&self.cfg.workspace_root, key);
        self.require_base(&p, base_ref).await?;
        self.require_no_conflict(&p, key).await?;
        let tmp = tempfile::Builder::new().prefix("clawmux-relay-check-").tempdir().map_err(|e| RelayError::Io(format!("temp dir: {e}")))?;
        let home = tmp.path().join("home");
        std::fs::create_dir(&home).map_err(|e| RelayError::Io(format!("temp dir: {e}")))?;
        let timeout = self.cfg.host_git_timeout.min(Duration::from_secs(20));
        let hg = host::HostGit::new(tmp.path(), &self.cfg.remote_url, self.cfg.token.as_ref(), self.host_settings(home, timeout));
        let [a, b] = git::remote_conflict_patterns(key);
        match hg.run(&["ls-remote", "--heads", "--", &self.cfg.remote_url, &a, &b], None).await {
            Ok(o) if o.code == 0 => {
                let text = o.text();
                let with = crate::refname::conflicting_branches(key, text.lines().filter_map(|l| l.split('\t').nth(1)));
                if !with.is_empty() {
                    return Err(key_conflict(&p.branch, &with, "on the remote"));
                }
            }
            Ok(o) => warn!(branch = %p.branch, code = o.code, error = %host::truncate(&o.stderr, 500), "relay: cannot list the remote's branches; the key is not checked against them"),
            Err(e) => warn!(branch = %p.branch, error = %e, "relay: cannot list the remote's branches; the key is not checked against them"),
        }
        Ok(())
    }

    /// Relays the commits of `sandbox/<key>`: none → nothing pushed, no PR (not an error); else
    /// the new ones are pushed and the PR is created or updated (`pr_title`/`pr_body` update an
    /// existing PR only when given). Never fails as a call: failures are in
    /// [`RelayOutcome::error`], and the commits stay in the container. Bounded as a whole by
    /// [`RelayConfig::publish_timeout`]: past it, the step it was in fails.
    pub async fn publish(&self, branch_key: &str, base_ref: &str, pr_title: Option<&str>, pr_body: Option<&str>) -> RelayOutcome {
        let (_, branch) = self.paths(branch_key);
        let mut out = RelayOutcome { branch, commit_count: 0, pushed: false, pushed_commits: 0, remote_head: None, pr_url: None, pr_number: None, error: None };
        let mut stage = RelayStage::Validate;
        let budget = self.cfg.publish_timeout;
        // Dropping the steps stops them: host git children are killed on drop and the host clone's
        // temp dir is removed; a container exec already started runs out its own bound in there.
        let steps = tokio::time::timeout(budget, self.publish_steps(branch_key, base_ref, pr_title, pr_body, &mut out, &mut stage)).await;
        match steps.unwrap_or_else(|_| Err(timed_out(stage, budget))) {
            Ok(()) => info!(branch = %out.branch, commits = out.commit_count, pushed = out.pushed, pushed_commits = out.pushed_commits, pr = ?out.pr_number, "relay: published"),
            Err(f) => {
                warn!(branch = %out.branch, commits = out.commit_count, pushed = out.pushed, stage = %f.stage, attempts = f.attempts, error = %f.message, "relay: failed");
                out.error = Some(f);
            }
        }
        out
    }

    /// The steps of [`publish`](Self::publish); `stage` follows them (for a timeout's report).
    async fn publish_steps(&self, key: &str, base_ref: &str, pr_title: Option<&str>, pr_body: Option<&str>, out: &mut RelayOutcome, stage: &mut RelayStage) -> Step<()> {
        let fail = |stage| move |e: RelayError| RelayFailure::new(stage, e.to_string(), 1);
        self.validate(key, base_ref).map_err(fail(RelayStage::Validate))?;
        let p = Paths::new(&self.cfg.workspace_root, key);
        *stage = RelayStage::Inspect;

        // 1. the container's state: on the branch, how many commits, where it forked
        let head_ref = self.run(git::head_ref(&p)).await.map_err(fail(RelayStage::Inspect))?;
        if !head_ref.success() {
            return Err(RelayFailure::new(RelayStage::Inspect, format!("{} is missing or not on a branch: {}", p.worktree, head_ref.stderr_text()), 1));
        }
        if head_ref.stdout_text() != p.branch_ref() {
            return Err(RelayFailure::new(RelayStage::Inspect, format!("{} is on {}, not {}", p.worktree, head_ref.stdout_text(), p.branch), 1));
        }
        let base = self.run(git::verify_commit(&p.worktree, base_ref)).await.map_err(fail(RelayStage::Inspect))?;
        if !base.success() {
            return Err(RelayFailure::new(RelayStage::Inspect, format!("base ref {base_ref:?} not found in the container"), 1));
        }
        let count = self.run_ok(git::count_ahead(&p, base_ref, false)).await.map_err(fail(RelayStage::Inspect))?;
        out.commit_count = git::parse_count(&count.stdout_text()).ok_or_else(|| RelayFailure::new(RelayStage::Inspect, "unreadable commit count", 1))?;
        if out.commit_count == 0 {
            info!(branch = %p.branch, "relay: no commits, nothing to push");
            return Ok(());
        }
        let merges = self.run_ok(git::count_ahead(&p, base_ref, true)).await.map_err(fail(RelayStage::Inspect))?;
        if git::parse_count(&merges.stdout_text()) != Some(0) {
            return Err(RelayFailure::new(RelayStage::Extract, "the branch has merge commits, which format-patch cannot carry", 1));
        }
        let fork = self.run_ok(git::merge_base(&p, base_ref)).await.map_err(fail(RelayStage::Inspect))?;
        let fork = git::parse_object_id(&fork.stdout_text()).ok_or_else(|| RelayFailure::new(RelayStage::Inspect, "unreadable merge base", 1))?;
        let ht = self.run_ok(git::head_and_tree(&p)).await.map_err(fail(RelayStage::Inspect))?;
        let ht_text = ht.stdout_text();
        let mut lines = ht_text.lines();
        let (Some(_head), Some(tree)) = (lines.next().and_then(git::parse_object_id), lines.next().and_then(git::parse_object_id)) else {
            return Err(RelayFailure::new(RelayStage::Inspect, "unreadable HEAD", 1));
        };

        // 2. the patches
        *stage = RelayStage::Extract;
        let mbox = self.run_ok(git::format_patch(&p, &fork)).await.map_err(fail(RelayStage::Extract))?.stdout;
        let patches = git::split_mbox(&mbox);
        if patches.len() != out.commit_count {
            return Err(RelayFailure::new(RelayStage::Extract, format!("format-patch gave {} patches for {} commits", patches.len(), out.commit_count), 1));
        }

        // 3. a fresh host clone
        *stage = RelayStage::Clone;
        let tmp = tempfile::Builder::new().prefix("clawmux-relay-").tempdir().map_err(|e| RelayFailure::new(RelayStage::Clone, format!("temp dir: {e}"), 1))?;
        let home = tmp.path().join("home");
        std::fs::create_dir(&home).map_err(|e| RelayFailure::new(RelayStage::Clone, format!("temp dir: {e}"), 1))?;
        let outer = host::HostGit::new(tmp.path(), &self.cfg.remote_url, self.cfg.token.as_ref(), self.host_settings(home, self.cfg.host_git_timeout));
        let clone_dir = tmp.path().join("repo");
        let clone_dir_s = clone_dir.to_string_lossy().into_owned();
        let attempts = self.cfg.retries + 1;
        let mut n = 0;
        loop {
            n += 1;
            match outer.ok(&["clone", "--quiet", "--no-checkout", "--no-tags", "--", &self.cfg.remote_url, &clone_dir_s], None).await {
                Ok(_) => break,
                Err(e) if n < attempts => {
                    warn!(branch = %p.branch, attempt = n, error = %e, "relay: clone failed, retrying");
                    let _ = std::fs::remove_dir_all(&clone_dir);
                    self.backoff(n).await;
                }
                Err(e) => return Err(RelayFailure::new(RelayStage::Clone, e.to_string(), n)),
            }
        }
        let hg = outer.in_dir(&clone_dir);
        *stage = RelayStage::Apply;
        if hg.run(&["cat-file", "-e", &format!("{fork}^{{commit}}")], None).await.map(|o| o.code).unwrap_or(-1) != 0 {
            return Err(RelayFailure::new(RelayStage::Apply, format!("the container's base commit {fork} is not in the remote"), 1));
        }
        let ids = hg.ok(&["patch-id", "--stable"], Some(&mbox)).await.map_err(fail(RelayStage::Apply))?;
        let container_keys = git::change_keys(&patches, &git::parse_patch_ids(&ids.text()));
        let remote_ref = format!("refs/remotes/origin/{}", p.branch);

        // 4. the remote branch's head as this publish observes it: every push below is conditional
        // on exactly that head (compare-and-swap), so what someone else pushes meanwhile is never
        // overwritten; a change of it at any point stops the publish
        let observed = remote_tip(&hg, &remote_ref).await?;
        out.remote_head = observed.clone();
        if observed.is_none() {
            let pattern = format!("refs/remotes/origin/sandbox/{}", git::key_root(key));
            let refs = hg.ok(&["for-each-ref", "--format=%(refname)", &pattern], None).await.map_err(fail(RelayStage::Push))?.text();
            let with = crate::refname::conflicting_branches(key, refs.lines());
            if !with.is_empty() {
                return Err(RelayFailure::new(RelayStage::Push, format!("{}; nothing pushed, the commits stay on the container's branch", key_conflict(&p.branch, &with, "on the remote")), 1));
            }
        }

        // 5. apply what the remote branch lacks, check the tree, push; a failed push is retried
        // after a fresh fetch that must find the same head
        let mut n = 0;
        loop {
            n += 1;
            if n > 1 {
                *stage = RelayStage::Clone;
                self.backoff(n - 1).await;
                if let Err(e) = hg.ok(&["fetch", "--quiet", "--prune", "--no-tags", "origin"], None).await {
                    if n < attempts {
                        warn!(branch = %p.branch, attempt = n, error = %e, "relay: fetch failed, retrying");
                        continue;
                    }
                    return Err(RelayFailure::new(RelayStage::Clone, e.to_string(), n));
                }
                *stage = RelayStage::Apply;
                let now = remote_tip(&hg, &remote_ref).await?;
                if now != observed {
                    out.remote_head = now.clone();
                    return Err(moved(&p.branch, observed.as_deref(), now.as_deref(), n));
                }
            }
            let (start, skip, forced) = match &observed {
                None => (fork.clone(), 0, false),
                Some(tip) => match self.plan_against(&hg, &fork, tip, &container_keys).await? {
                    Plan::Append { skip } => (tip.clone(), skip, false),
                    diverged if self.cfg.force_push => {
                        warn!(branch = %p.branch, plan = ?diverged, "relay: remote branch diverged; force_push is on, overwriting it");
                        (fork.clone(), 0, true)
                    }
                    diverged => return Err(diverged_failure(&p.branch, tip, &diverged, out.commit_count, n)),
                },
            };
            let _ = hg.run(&["am", "--abort"], None).await;
            hg.ok(&["checkout", "--quiet", "--force", "-B", &p.branch, &start], None).await.map_err(fail(RelayStage::Apply))?;
            let new = &patches[skip..];
            if !new.is_empty() {
                let feed: Vec<u8> = new.iter().flat_map(|p| p.text.iter().copied()).collect();
                if let Err(e) = hg.ok(&["am", "--quiet", "-k", "--keep-cr", "--empty=keep", "--whitespace=nowarn", "--no-3way"], Some(&feed)).await {
                    let _ = hg.run(&["am", "--abort"], None).await;
                    return Err(RelayFailure::new(RelayStage::Apply, e.to_string(), n));
                }
            }
            let host_tree = hg.ok(&["rev-parse", "HEAD^{tree}"], None).await.map_err(fail(RelayStage::Apply))?.text();
            if host_tree != tree {
                return Err(RelayFailure::new(RelayStage::Apply, format!("after applying, the tree {host_tree} differs from the container's {tree}; not pushed"), n));
            }
            let host_head = hg.ok(&["rev-parse", "HEAD"], None).await.map_err(fail(RelayStage::Apply))?.text();
            if new.is_empty() && !forced {
                // the remote branch has every commit already (a retry after a failed API call,
                // or a run that added none): nothing to push
                info!(branch = %p.branch, "relay: the remote branch is up to date, nothing pushed");
                break;
            }
            *stage = RelayStage::Push;
            let dest = format!("HEAD:{}", p.branch_ref());
            // `<ref>:` (nothing after the colon): the branch must not exist yet
            let lease = format!("--force-with-lease={}:{}", p.branch_ref(), observed.as_deref().unwrap_or(""));
            let push = hg.run(&["push", "--quiet", "--porcelain", &lease, "origin", &dest], None).await.map_err(fail(RelayStage::Push))?;
            if push.code == 0 {
                out.pushed = true;
                out.pushed_commits = new.len();
                out.remote_head = Some(host_head);
                info!(branch = %p.branch, pushed_commits = new.len(), forced, attempt = n, "relay: pushed");
                break;
            }
            let porcelain = push.text();
            if git::push_was_stale(&porcelain) {
                // the remote branch is no longer the head this publish observed
                let _ = hg.run(&["fetch", "--quiet", "--prune", "--no-tags", "origin"], None).await;
                let now = remote_tip(&hg, &remote_ref).await.unwrap_or(None);
                out.remote_head = now.clone();
                return Err(moved(&p.branch, observed.as_deref(), now.as_deref(), n));
            }
            let status: Vec<&str> = porcelain.lines().filter(|l| l.starts_with('!')).collect();
            let e = format!("host git push failed (exit {}): {} {}", push.code, host::truncate(&push.stderr, 2000), hg.redact(&status.join(" ")));
            if n < attempts {
                warn!(branch = %p.branch, attempt = n, error = %e, "relay: push failed, retrying");
                continue;
            }
            return Err(RelayFailure::new(RelayStage::Push, e, n));
        }
        drop(tmp);

        // 6. the pull request
        if let Some(api) = &self.cfg.github_api_url {
            *stage = RelayStage::PullRequest;
            let pr = self.pull_request(api, &p.branch, base_ref, pr_title, pr_body).await?;
            out.pr_number = Some(pr.number);
            out.pr_url = Some(pr.url);
        }
        Ok(())
    }

    /// The container's change keys against the remote branch's (from the fork point).
    async fn plan_against(&self, hg: &host::HostGit, fork: &str, tip: &str, container_keys: &[String]) -> Step<Plan> {
        let f = |e: RelayError| RelayFailure::new(RelayStage::Apply, e.to_string(), 1);
        let anc = hg.run(&["merge-base", "--is-ancestor", fork, tip], None).await.map_err(f)?;
        if anc.code != 0 {
            return Ok(Plan::Diverged { common: 0 });
        }
        let range = format!("{fork}..{tip}");
        // The fork point is the container's word: one far back (an agent that reset its branch to
        // the root commit) would have the host format the whole history up to the remote tip, in
        // memory, to find what counting finds: the remote branch can only be a prefix of the
        // container's commits if it has at most as many.
        let count = hg.ok(&["rev-list", "--count", &range], None).await.map_err(f)?;
        let remote = git::parse_count(&count.text()).ok_or_else(|| RelayFailure::new(RelayStage::Apply, "unreadable commit count of the remote branch", 1))?;
        if remote > container_keys.len() {
            return Ok(Plan::Longer { remote });
        }
        let mut args: Vec<&str> = git::FORMAT_PATCH_FLAGS.to_vec();
        args.push(&range);
        let mbox = hg.ok(&args, None).await.map_err(f)?.stdout;
        let patches = git::split_mbox(&mbox);
        let ids = hg.ok(&["patch-id", "--stable"], Some(&mbox)).await.map_err(f)?;
        let remote_keys = git::change_keys(&patches, &git::parse_patch_ids(&ids.text()));
        tracing::debug!(?container_keys, ?remote_keys, "relay: change keys");
        Ok(git::plan(container_keys, &remote_keys))
    }

    async fn pull_request(&self, api: &str, branch: &str, base_ref: &str, title: Option<&str>, body: Option<&str>) -> Step<github::PullRequest> {
        let (owner, repo) = self.cfg.owner_repo().ok_or_else(|| RelayFailure::new(RelayStage::PullRequest, "no owner/repo", 1))?;
        let gh = github::Github::new(api, self.cfg.token.clone(), self.cfg.api_timeout).map_err(|m| RelayFailure::new(RelayStage::PullRequest, m, 1))?;
        let attempts = self.cfg.retries + 1;
        let mut n = 0;
        loop {
            n += 1;
            let r = async {
                match gh.find_open(&owner, &repo, branch).await? {
                    Some(pr) if title.is_some() || body.is_some() => gh.update(&owner, &repo, pr.number, title, body).await,
                    Some(pr) => Ok(pr),
                    None => {
                        let t = title.map(str::to_owned).unwrap_or_else(|| branch.to_owned());
                        let b = body.map(str::to_owned).unwrap_or_else(|| format!("Commits of the agent's workspace on `{branch}`, relayed by clawmux."));
                        gh.create(&owner, &repo, branch, base_ref, &t, &b).await
                    }
                }
            }
            .await;
            match r {
                Ok(pr) => return Ok(pr),
                Err(e) if e.retryable && n < attempts => {
                    warn!(branch, attempt = n, error = %e.message, "relay: GitHub API failed, retrying");
                    self.backoff(n).await;
                }
                Err(e) => return Err(RelayFailure::new(RelayStage::PullRequest, e.message, n)),
            }
        }
    }

    async fn backoff(&self, attempt: u32) {
        let d = self.cfg.retry_backoff.saturating_mul(1u32 << attempt.saturating_sub(1).min(16)).min(Duration::from_secs(30));
        tokio::time::sleep(d).await;
    }
}

/// The head of `remote_ref` in the host clone (`None`: the remote has no such branch).
async fn remote_tip(hg: &host::HostGit, remote_ref: &str) -> Step<Option<String>> {
    let tip = hg.run(&["rev-parse", "--verify", "--quiet", remote_ref], None).await.map_err(|e| RelayFailure::new(RelayStage::Apply, e.to_string(), 1))?;
    Ok((tip.code == 0).then(|| tip.text()).filter(|t| git::is_object_id(t)))
}

/// The publish ran past its whole bound while at `stage`.
fn timed_out(stage: RelayStage, budget: Duration) -> RelayFailure {
    RelayFailure::new(stage, format!("publish timed out after {budget:?} (the bound on a whole publish, publish_timeout); stopped during this step, the commits stay on the container's branch"), 1)
}

/// The remote branch has commits the container's does not: refused (force_push is off).
fn diverged_failure(branch: &str, tip: &str, plan: &Plan, ours: usize, attempts: u32) -> RelayFailure {
    let detail = match plan {
        Plan::Longer { remote } => format!("{remote} commits since the container's fork point, more than the container's {ours}"),
        Plan::Diverged { common } => format!("{common} of its commits match the container's"),
        Plan::Append { .. } => "none".to_owned(),
    };
    RelayFailure::new(
        RelayStage::Apply,
        format!(
            "the remote branch {branch} (head {tip}) has commits the container's branch does not have ({detail}): someone else pushed to it, or the container's branch was rewritten; nothing pushed, nothing overwritten, the commits stay on the container's branch (force_push is off)"
        ),
        attempts,
    )
}

/// The remote branch changed while a publish worked: someone else pushed.
fn moved(branch: &str, observed: Option<&str>, now: Option<&str>, attempts: u32) -> RelayFailure {
    RelayFailure::new(
        RelayStage::Push,
        format!(
            "{branch} changed on the remote while this run published (from {} to {}): someone else pushed to it; nothing pushed, nothing overwritten, the commits stay on the container's branch",
            observed.unwrap_or("no branch"),
            now.unwrap_or("no branch"),
        ),
        attempts,
    )
}

/// The key of `p` (`sandbox/<key>`).
fn key_of(p: &Paths) -> &str {
    p.branch.strip_prefix("sandbox/").unwrap_or(&p.branch)
}

/// The relay as the session actors use it.
impl clawmux_actors::branch::Workspace for GitRelay {
    fn check(&self, plan: &clawmux_actors::branch::BranchPlan) -> futures_util::future::BoxFuture<'static, Result<(), clawmux_actors::branch::WorkspaceError>> {
        let relay = self.clone();
        let plan = plan.clone();
        Box::pin(async move { GitRelay::check(&relay, &plan.key, &plan.base_ref).await.map_err(workspace_error) })
    }

    fn prepare(&self, plan: &clawmux_actors::branch::BranchPlan) -> futures_util::future::BoxFuture<'static, Result<clawmux_actors::branch::Prepared, clawmux_actors::branch::WorkspaceError>> {
        let relay = self.clone();
        let plan = plan.clone();
        Box::pin(async move {
            GitRelay::prepare(&relay, &plan.key, &plan.base_ref)
                .await
                .map(|w| clawmux_actors::branch::Prepared { path: w.path, branch: w.branch })
                .map_err(workspace_error)
        })
    }

    fn publish(&self, plan: &clawmux_actors::branch::BranchPlan) -> futures_util::future::BoxFuture<'static, clawmux_actors::branch::Published> {
        let relay = self.clone();
        let plan = plan.clone();
        Box::pin(async move {
            let outcome = GitRelay::publish(&relay, &plan.key, &plan.base_ref, plan.pr_title.as_deref(), plan.pr_body.as_deref()).await;
            clawmux_actors::branch::Published { relay: serde_json::to_value(&outcome).unwrap_or(serde_json::Value::Null) }
        })
    }
}

/// A caller's mistake stays one; everything else is a failure.
fn workspace_error(e: RelayError) -> clawmux_actors::branch::WorkspaceError {
    use clawmux_actors::branch::WorkspaceError as W;
    match e {
        RelayError::Rejected { kind: Rejection::UnknownBaseRef, message } => W::UnknownBaseRef(message),
        RelayError::Rejected { kind: Rejection::KeyConflict, message } => W::KeyConflict(message),
        other => W::Failed(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::exec::fake::ScriptedExec;
    use super::*;

    fn relay(f: Arc<ScriptedExec>) -> GitRelay {
        GitRelay::new(RelayConfig::new("gw", "/srv/origin.git"), f).expect("relay")
    }

    /// A conflict names the branches above the key (prefixes of the caller's own key), never one
    /// below it: that would tell a caller another key's name (perhaps another account's) for a
    /// prefix of it.
    #[test]
    fn a_key_conflict_never_names_a_branch_below_the_key() {
        let below = key_conflict("sandbox/deep", &["sandbox/deep/secret-merger".into(), "sandbox/deep/zeta".into()], "on the remote").to_string();
        assert!(!below.contains("secret") && !below.contains("zeta"), "{below}");
        assert!(below.contains("sandbox/deep cannot be created: sandbox/deep/… exists on the remote"), "{below}");
        let above = key_conflict("sandbox/taken/x", &["sandbox/taken".into()], "in the container's repository").to_string();
        assert!(above.contains("cannot be created: sandbox/taken exists in the container's repository"), "{above}");
    }

    #[test]
    fn config_is_checked() {
        let f: Arc<dyn ContainerExec> = Arc::new(ScriptedExec::default());
        let mut c = RelayConfig::new("gw", "https://x-access-token:abc@github.com/a/b.git");
        assert!(matches!(GitRelay::new(c.clone(), f.clone()), Err(RelayError::Config(_))));
        c.remote_url = "/srv/origin.git".into();
        c.github_api_url = Some("http://127.0.0.1:1".into());
        assert!(matches!(GitRelay::new(c.clone(), f.clone()), Err(RelayError::Config(_))), "API without owner/repo");
        c.github_repo = Some("acme/widgets.js".into());
        assert!(GitRelay::new(c.clone(), f.clone()).is_ok());
        c.base_ref = "--upload-pack=x".into();
        assert!(matches!(GitRelay::new(c.clone(), f.clone()), Err(RelayError::InvalidRef(_))));
        c.base_ref = "main".into();
        c.token = Some(Secret::new("ghp_zzz"));
        assert!(!format!("{c:?}").contains("ghp_zzz"));
    }

    #[tokio::test]
    async fn hostile_keys_never_reach_the_container() {
        let f = Arc::new(ScriptedExec::default());
        let r = relay(f.clone());
        let long = "k".repeat(300);
        for k in ["../x", "-f", "a..b", "x.lock", "a b", long.as_str(), "main"] {
            assert!(matches!(r.prepare(k, "main").await, Err(RelayError::InvalidBranchKey(_))), "{k:?}");
            let o = r.publish(k, "main", None, None).await;
            assert_eq!(o.error.as_ref().map(|e| e.stage), Some(RelayStage::Validate), "{k:?}");
            assert!(!o.pushed);
        }
        assert!(matches!(r.prepare("ok", "-x").await, Err(RelayError::InvalidRef(_))));
        assert!(f.calls().is_empty(), "nothing ran");
    }

    const SHA: &str = "0123456789abcdef0123456789abcdef01234567";

    #[tokio::test]
    async fn prepare_creates_then_reuses() {
        let f = Arc::new(ScriptedExec::default());
        f.on(&["worktree", "list"], 0, "worktree /workspace/repo\nHEAD x\nbranch refs/heads/main\n", "");
        f.on(&["rev-parse", "refs/heads/sandbox/t1"], 1, "", "");
        f.on(&["rev-parse", "main^{commit}"], 0, &format!("{SHA}\n"), "");
        f.on(&["for-each-ref", "refs/heads/sandbox/t1"], 0, "refs/heads/sandbox/t10\n", "");
        f.on(&["worktree", "add"], 0, "", "");
        f.on(&["rev-parse", "HEAD^{commit}"], 0, &format!("{SHA}\n"), "");
        let r = relay(f.clone());
        let w = r.prepare("t1", "main").await.expect("prepare");
        assert_eq!(w, Workspace { path: "/workspace/wt/t1".into(), branch: "sandbox/t1".into(), head: SHA.into(), created: true });
        let add = f.calls().into_iter().find(|c| c.contains(&"add".to_owned())).expect("worktree add ran");
        assert!(add.ends_with(&["-b".into(), "sandbox/t1".into(), "/workspace/wt/t1".into(), "main".into()]));

        let f = Arc::new(ScriptedExec::default());
        f.on(&["worktree", "list"], 0, "worktree /workspace/repo\nbranch refs/heads/main\n\nworktree /workspace/wt/t1\nbranch refs/heads/sandbox/t1\n", "");
        f.on(&["rev-parse", "main^{commit}"], 0, &format!("{SHA}\n"), "");
        f.on(&["rev-parse", "HEAD^{commit}"], 0, &format!("{SHA}\n"), "");
        let w = relay(f.clone()).prepare("t1", "main").await.expect("prepare");
        assert!(!w.created);
        assert!(!f.calls().iter().any(|c| c.contains(&"add".to_owned())), "reused, not re-added");
    }

    #[tokio::test]
    async fn prepare_checks_exit_codes() {
        let f = Arc::new(ScriptedExec::default());
        f.on(&["worktree", "list"], 128, "", "fatal: not a git repository");
        let e = relay(f).prepare("t1", "main").await.expect_err("no repo");
        assert!(matches!(e, RelayError::Workspace(ref m) if m.contains("not a git repository")), "{e}");

        let f = Arc::new(ScriptedExec::default());
        f.on(&["worktree", "list"], 0, "worktree /workspace/repo\n", "");
        f.on(&["rev-parse", "refs/heads/sandbox/t1"], 1, "", "");
        f.on(&["rev-parse", "main^{commit}"], 0, SHA, "");
        f.on(&["for-each-ref"], 0, "", "");
        f.on(&["worktree", "add"], 128, "", "fatal: '/workspace/wt/t1' already exists");
        let e = relay(f).prepare("t1", "main").await.expect_err("add fails");
        assert!(matches!(e, RelayError::CommandFailed { ref what, exit_code: 128, ref stderr } if what == "git worktree" && stderr.contains("already exists")), "{e}");

        let f = Arc::new(ScriptedExec::default());
        f.on(&["worktree", "list"], 0, "worktree /workspace/wt/t1\nbranch refs/heads/other\n", "");
        f.on(&["rev-parse", "main^{commit}"], 0, SHA, "");
        let e = relay(f).prepare("t1", "main").await.expect_err("wrong branch");
        assert!(matches!(e, RelayError::Workspace(_)), "{e}");
    }

    /// An unknown base ref and a key whose branch conflicts with an existing one are the caller's
    /// to fix (`Rejected`, a run ends `relay_rejected`), found before anything is created; even
    /// a reused worktree needs its base ref (every publish counts from it).
    #[tokio::test]
    async fn prepare_and_check_reject_the_caller_s_mistakes() {
        use clawmux_actors::branch::WorkspaceError;
        let plan = |key: &str, base: &str| clawmux_actors::branch::BranchPlan { key: key.into(), base_ref: base.into(), pr_title: None, pr_body: None };
        let f = Arc::new(ScriptedExec::default());
        f.on(&["worktree", "list"], 0, "worktree /workspace/repo\n\nworktree /workspace/wt/t1\nbranch refs/heads/sandbox/t1\n", "");
        f.on(&["rev-parse", "nope^{commit}"], 1, "", "");
        let e = relay(f.clone()).prepare("t1", "nope").await.expect_err("unknown base");
        assert!(matches!(e, RelayError::Rejected { kind: Rejection::UnknownBaseRef, ref message } if message.contains("\"nope\" not found")), "{e}");
        match clawmux_actors::branch::Workspace::prepare(&relay(f.clone()), &plan("t1", "nope")).await {
            Err(WorkspaceError::UnknownBaseRef(m)) => assert!(m.contains("nope"), "{m}"),
            other => panic!("{other:?}"),
        }
        let r = relay(f.clone());
        assert!(matches!(r.check("t1", "nope").await, Err(RelayError::Rejected { kind: Rejection::UnknownBaseRef, .. })));

        for (key, existing) in [("a/b", "refs/heads/sandbox/a\n"), ("a", "refs/heads/sandbox/a/b\nrefs/heads/sandbox/a/c\n")] {
            let f = Arc::new(ScriptedExec::default());
            f.on(&["worktree", "list"], 0, "worktree /workspace/repo\n", "");
            f.on(&["rev-parse", "main^{commit}"], 0, SHA, "");
            f.on(&["rev-parse", &format!("refs/heads/sandbox/{key}")], 1, "", "");
            f.on(&["for-each-ref", "refs/heads/sandbox/a"], 0, existing, "");
            let e = relay(f.clone()).prepare(key, "main").await.expect_err("conflict");
            assert!(matches!(e, RelayError::Rejected { kind: Rejection::KeyConflict, ref message } if message.contains("use another branch key")), "{e}");
            assert!(!f.calls().iter().any(|c| c.contains(&"add".to_owned())), "nothing created");
            match relay(f.clone()).check(plan(key, "main").key.as_str(), "main").await {
                Err(RelayError::Rejected { kind: Rejection::KeyConflict, message }) => assert!(message.contains("in the container's repository"), "{message}"),
                other => panic!("{other:?}"),
            }
            assert!(matches!(relay(f).check(plan(key, "main").key.as_str(), "main").await.map_err(workspace_error), Err(WorkspaceError::KeyConflict(_))));
        }
    }

    #[tokio::test]
    async fn publish_without_commits_does_nothing_more() {
        let f = Arc::new(ScriptedExec::default());
        f.on(&["symbolic-ref"], 0, "refs/heads/sandbox/t1\n", "");
        f.on(&["rev-parse", "main^{commit}"], 0, SHA, "");
        f.on(&["rev-list", "--count"], 0, "0\n", "");
        let o = relay(f.clone()).publish("t1", "main", Some("t"), None).await;
        assert_eq!(o, RelayOutcome { branch: "sandbox/t1".into(), commit_count: 0, pushed: false, pushed_commits: 0, remote_head: None, pr_url: None, pr_number: None, error: None });
        assert!(!f.calls().iter().any(|c| c.contains(&"format-patch".to_owned())));
    }

    /// The container's side of a publish of one commit on `sandbox/<key>` forked at `fork`.
    fn one_commit_container(key: &str, fork: &str) -> Arc<ScriptedExec> {
        let f = Arc::new(ScriptedExec::default());
        f.on(&["symbolic-ref"], 0, &format!("refs/heads/sandbox/{key}\n"), "");
        f.on(&["rev-parse", "main^{commit}"], 0, &format!("{SHA}\n"), "");
        f.on(&["rev-list", "--merges"], 0, "0\n", "");
        f.on(&["rev-list", "--count"], 0, "1\n", "");
        f.on(&["merge-base"], 0, &format!("{fork}\n"), "");
        f.on(&["rev-parse", "HEAD^{tree}"], 0, &format!("{SHA}\n{SHA}\n"), "");
        let mbox = format!("From {SHA} Mon Sep 17 00:00:00 2001\nFrom: Agent <agent@example.invalid>\nDate: Mon, 1 Jan 2024 00:00:00 +0000\nSubject: one small change\n\n---\n");
        f.on(&["format-patch"], 0, &mbox, "");
        f
    }

    use super::host::scripts::{real_git, write_executable};

    fn git_in(dir: &std::path::Path, args: &[&str], stdin: Option<&[u8]>) -> String {
        use std::io::Write;
        let mut c = std::process::Command::new(real_git());
        c.arg("-C").arg(dir).args(args).env("GIT_CONFIG_GLOBAL", "/dev/null").env("GIT_CONFIG_NOSYSTEM", "1");
        c.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        let mut child = c.spawn().expect("git");
        if let Some(data) = stdin {
            child.stdin.take().expect("stdin").write_all(data).expect("write");
        }
        drop(child.stdin.take());
        let o = child.wait_with_output().expect("git");
        assert!(o.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).trim_end().to_owned()
    }

    /// An agent that resets its branch to the repository's root commit and commits once: the
    /// container's fork point is the root, and the remote branch (run 1's relayed commit on top of
    /// a long main) descends from it. Counting says the remote branch has more commits than the
    /// container's, so it is refused as diverged; no host `format-patch` covers more commits than
    /// the container has (before: `format-patch root..tip`, the whole history, in memory).
    #[tokio::test]
    async fn a_fork_point_far_back_is_not_formatted_on_the_host() {
        let tmp = tempfile::tempdir().expect("tmp");
        let origin = tmp.path().join("origin.git");
        std::fs::create_dir(&origin).expect("origin");
        git_in(&origin, &["init", "--quiet", "--bare"], None);
        // main: 200 commits; sandbox/k: run 1's relayed commit on top
        let mut stream = String::new();
        for i in 1..=201 {
            let (r, from) = if i <= 200 { ("refs/heads/main", String::new()) } else { ("refs/heads/sandbox/k", "from :200\n".to_owned()) };
            stream.push_str(&format!("commit {r}\nmark :{i}\ncommitter Seed <seed@x> {} +0000\ndata 3\nc{}\n{from}M 644 inline f\ndata {}\n{i}\n\n", 1_700_000_000 + i, i % 10, format!("{i}\n").len()));
        }
        git_in(&origin, &["fast-import", "--quiet"], Some(stream.as_bytes()));
        let root = git_in(&origin, &["rev-list", "--max-parents=0", "main"], None);
        assert_eq!(git_in(&origin, &["rev-list", "--count", &format!("{root}..sandbox/k")], None), "200");
        // a host git that logs every argv
        let log = tmp.path().join("log");
        std::fs::create_dir(&log).expect("log");
        let wrapper = tmp.path().join("git");
        write_executable(&wrapper, &format!("#!/bin/sh\nprintf '%s\\0' \"$@\" > '{}'/$$-$(date +%s%N)\nexec '{}' \"$@\"\n", log.display(), real_git().display()));
        let mut cfg = RelayConfig::new("gw", origin.to_string_lossy());
        cfg.git_program = wrapper;
        let r = GitRelay::new(cfg, one_commit_container("k", &root)).expect("relay");

        let o = r.publish("k", "main", None, None).await;
        let e = o.error.as_ref().expect("refused");
        assert_eq!(e.stage, RelayStage::Apply, "{e}");
        assert!(e.message.contains("has commits the container's branch does not have") && e.message.contains("force_push is off"), "{e}");
        assert!(!o.pushed);
        let calls: Vec<Vec<String>> = std::fs::read_dir(&log)
            .expect("log")
            .map(|f| std::fs::read(f.expect("entry").path()).expect("argv").split(|b| *b == 0).filter(|a| !a.is_empty()).map(|a| String::from_utf8_lossy(a).into_owned()).collect())
            .collect();
        assert!(calls.iter().any(|c| c.iter().any(|a| a == "clone")), "the wrapper saw the host's git calls: {calls:?}");
        for c in calls.iter().filter(|c| c.iter().any(|a| a == "format-patch")) {
            let range = c.last().expect("range");
            let covered: usize = git_in(&origin, &["rev-list", "--count", range], None).parse().expect("count");
            assert!(covered <= o.commit_count, "host format-patch of {covered} commits ({range}) for the container's {}", o.commit_count);
        }
    }

    /// A remote that accepts the connection and never answers: each clone attempt waits out
    /// the host git bound (4 attempts × 10 s here, 4 × 300 s by default); the whole publish stops
    /// at its own bound and says so.
    #[tokio::test]
    async fn a_stalled_remote_is_bounded_by_the_publish_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let server = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        });
        let mut cfg = RelayConfig::new("gw", format!("http://127.0.0.1:{port}/acme/widgets.git"));
        cfg.host_git_timeout = Duration::from_secs(10);
        cfg.retries = 3;
        cfg.retry_backoff = Duration::from_millis(10);
        cfg.publish_timeout = Duration::from_secs(2);
        let r = GitRelay::new(cfg, one_commit_container("k", SHA)).expect("relay");
        let t0 = std::time::Instant::now();
        let o = r.publish("k", "main", None, None).await;
        let took = t0.elapsed();
        server.abort();
        let e = o.error.as_ref().expect("timed out");
        assert_eq!(e.stage, RelayStage::Clone, "{e}");
        assert!(e.message.starts_with("publish timed out after 2s"), "{e}");
        assert!(!o.pushed);
        assert_eq!(o.commit_count, 1);
        assert!(took < Duration::from_secs(20), "took {took:?}");
    }

    #[tokio::test]
    async fn publish_reports_a_worktree_on_another_branch() {
        let f = Arc::new(ScriptedExec::default());
        f.on(&["symbolic-ref"], 0, "refs/heads/main\n", "");
        let o = relay(f).publish("t1", "main", None, None).await;
        let e = o.error.expect("error");
        assert_eq!(e.stage, RelayStage::Inspect);
        assert!(e.message.contains("not sandbox/t1"), "{e}");
        let json = serde_json::to_value(RelayFailure::new(RelayStage::PullRequest, "x", 3)).expect("json");
        assert_eq!(json, serde_json::json!({"stage": "pull_request", "message": "x", "attempts": 3}));
    }
}

