//! Runs on a git branch: what they ask of the relay, and the small trait the relay implements.
//!
//! ```text
//! session key ─▶ branch key's lock ─▶ prepare worktree sandbox/<key> ─▶ gateway run (the agent is
//! told its working directory) ─▶ ok ─▶ publish (format-patch → host git am → push → PR) ─▶ `relay`
//! event ─▶ `final` ─▶ unlock
//! ```
//! The session actor runs this sequence; the registry holds the locks (one holder per key, FIFO).
//! Git, Docker and GitHub stay behind [`Workspace`], in the binary crate.

use futures_util::future::BoxFuture;

/// What the request asked of the relay.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BranchPlan {
    /// The branch key (validated): the branch is `sandbox/<key>`.
    pub key: String,
    /// Base ref of a new branch and of the pull request.
    pub base_ref: String,
    /// Pull request title.
    pub pr_title: Option<String>,
    /// Pull request body.
    pub pr_body: Option<String>,
}

impl BranchPlan {
    /// `sandbox/<key>`.
    pub fn branch(&self) -> String {
        format!("sandbox/{}", self.key)
    }
}

/// A prepared worktree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepared {
    /// Its path in the gateway container.
    pub path: String,
    /// Its branch.
    pub branch: String,
}

/// Why a workspace step did not work out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkspaceError {
    /// The base ref does not exist in the repository (the caller names another one).
    UnknownBaseRef(String),
    /// The branch key's branch cannot exist next to an existing one (`sandbox/a` blocks
    /// `sandbox/a/b` and the reverse: git stores them as a file and a directory of one name).
    KeyConflict(String),
    /// Anything else: the container, the engine, git failing.
    Failed(String),
}

impl WorkspaceError {
    /// A caller's mistake (the run ends `relay_rejected`), not a failure of clawmux's.
    pub fn is_rejection(&self) -> bool {
        !matches!(self, Self::Failed(_))
    }
}

impl std::fmt::Display for WorkspaceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::UnknownBaseRef(m) | Self::KeyConflict(m) | Self::Failed(m) => f.write_str(m),
        }
    }
}

/// What publishing did: the `relay` event's data, and whether it failed.
#[derive(Debug, Clone, PartialEq)]
pub struct Published {
    /// `{"branch","commitCount","pushed","pushedCommits","remoteHead"?,"prUrl"?,"prNumber"?,"error"?}`
    /// (`docs/API.md`).
    pub relay: serde_json::Value,
}

/// The host-side git relay, as the session actor needs it.
pub trait Workspace: Send + Sync + 'static {
    /// Before a run is admitted: what can be known now about a caller's mistake (an unknown base
    /// ref, a key conflicting with an existing branch), so that the `POST` answers it instead of
    /// the run failing later. `Err(Failed)` means "could not check", not "refused".
    fn check(&self, _plan: &BranchPlan) -> BoxFuture<'static, Result<(), WorkspaceError>> {
        Box::pin(async { Ok(()) })
    }
    /// Creates (or reuses) the worktree of `plan`'s branch in the gateway container.
    fn prepare(&self, plan: &BranchPlan) -> BoxFuture<'static, Result<Prepared, WorkspaceError>>;
    /// Takes the branch's new commits out of the container, pushes them and opens or updates the
    /// pull request. Idempotent: a second call after a crash finds nothing new or pushes the rest.
    fn publish(&self, plan: &BranchPlan) -> BoxFuture<'static, Published>;
}

/// The sentence appended to the user's message so the agent works (and commits) in its worktree.
pub fn workspace_instructions(path: &str, branch: &str) -> String {
    format!(
        "\n\n[clawmux] Your working directory for this task is the git worktree {path} (branch {branch}). \
         Run every command there (cd {path}), and commit your changes there with git before you finish. Do not push."
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instructions_name_the_worktree_and_branch() {
        let t = workspace_instructions("/workspace/wt/task.1", "sandbox/task.1");
        assert!(t.contains("cd /workspace/wt/task.1") && t.contains("sandbox/task.1") && t.contains("commit"));
    }
}
