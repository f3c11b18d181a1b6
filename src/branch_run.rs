//! Runs that work on a git branch: the branch key's lock, the workspace, the relay.
//!
//! ```text
//! lock(branch key) ──▶ prepare worktree sandbox/<key> in the gateway container ──▶ run (the agent is
//! told its working directory) ──▶ final `res` ──▶ publish (format-patch → host git am → push → PR)
//! ──▶ `relay` event ──▶ `final` ──▶ unlock
//! ```
//! The lock is held from before the workspace is prepared until the relay has pushed, so runs on
//! one key never interleave; runs on different keys overlap. Time spent waiting for the lock counts
//! toward the run's timeout, and a waiting run can be aborted.

use crate::api::AppState;
use crate::relay::{BranchGuard, BranchLocks, GitRelay};
use crate::store::RunRecord;
use actix_web::web;
use clawmux_actors::supervisor::{AdmitError, StartRun};
use clawmux_actors::{ErrorCode, RunEvent, RunOutcome, RunSink, RunSpec, RunStatus};
use dashmap::DashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// The relay and its locks (present when `CLAWMUX_RELAY_CONTAINER` is configured).
pub struct RelayRuntime {
    /// Git in the gateway container, push and PR on the host.
    pub relay: GitRelay,
    /// One holder per branch key.
    pub locks: BranchLocks,
}

/// Runs admitted by the API but not yet handed to the supervisor (waiting for a branch lock or
/// their workspace): cancelling the token ends them.
#[derive(Default)]
pub struct PendingRuns {
    tokens: DashMap<String, CancellationToken>,
}

impl PendingRuns {
    /// Cancels every pending run (shutdown); returns how many.
    pub fn cancel_all(&self) -> usize {
        self.tokens.iter().map(|t| t.value().cancel()).count()
    }

    /// Number of pending runs.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True when none is pending.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Cancels a pending run; false when the run is not pending.
    pub fn cancel(&self, run_id: &str) -> bool {
        match self.tokens.get(run_id) {
            Some(t) => {
                t.cancel();
                true
            }
            None => false,
        }
    }

    fn insert(&self, run_id: &str) -> CancellationToken {
        let t = CancellationToken::new();
        self.tokens.insert(run_id.to_owned(), t.clone());
        t
    }

    fn remove(&self, run_id: &str) {
        self.tokens.remove(run_id);
    }
}

/// What the request asked of the relay.
#[derive(Debug, Clone)]
pub struct BranchPlan {
    /// The branch key (validated).
    pub key: String,
    /// Base ref.
    pub base_ref: String,
    /// PR title.
    pub pr_title: Option<String>,
    /// PR body.
    pub pr_body: Option<String>,
}

/// The sentence appended to the user's message so the agent works (and commits) in its worktree.
pub fn workspace_instructions(path: &str, branch: &str) -> String {
    format!(
        "\n\n[clawmux] Your working directory for this task is the git worktree {path} (branch {branch}). \
         Run every command there (cd {path}), and commit your changes there with git before you finish. Do not push."
    )
}

/// Starts the branch run in the background; the HTTP answer does not wait for the lock.
pub fn spawn(state: web::Data<AppState>, record: Arc<RunRecord>, spec: RunSpec, plan: BranchPlan) {
    let Some(runtime) = state.relay.clone() else { return };
    let cancel = state.pending.insert(&spec.run_id);
    actix::spawn(async move {
        let run_id = spec.run_id.clone();
        run(state.clone(), runtime, record, spec, plan, cancel).await;
        state.pending.remove(&run_id);
    });
}

fn fail(record: &RunRecord, code: ErrorCode, message: impl Into<String>) {
    record.emit(RunEvent::Finished(RunOutcome::failed(code, message, String::new())));
}

async fn run(
    state: web::Data<AppState>,
    runtime: Arc<RelayRuntime>,
    record: Arc<RunRecord>,
    mut spec: RunSpec,
    plan: BranchPlan,
    cancel: CancellationToken,
) {
    let deadline = Instant::now() + spec.timeout;
    let branch = format!("sandbox/{}", plan.key);
    if runtime.locks.is_locked(&plan.key) {
        record.emit_event("status", serde_json::json!({"phase": "waiting_for_branch", "branch": branch}));
    }
    let guard = tokio::select! {
        g = runtime.locks.lock(&plan.key) => g,
        () = tokio::time::sleep_until(deadline.into()) => {
            return fail(&record, ErrorCode::Timeout, format!("the run timed out waiting for branch {branch}, held by an earlier run"));
        }
        () = cancel.cancelled() => return fail(&record, ErrorCode::Aborted, "the run was aborted while waiting for its branch"),
    };
    let workspace = tokio::select! {
        w = runtime.relay.prepare(&plan.key, &plan.base_ref) => w,
        () = tokio::time::sleep_until(deadline.into()) => {
            return fail(&record, ErrorCode::Timeout, "the run timed out while its workspace was prepared");
        }
        () = cancel.cancelled() => return fail(&record, ErrorCode::Aborted, "the run was aborted while its workspace was prepared"),
    };
    let workspace = match workspace {
        Ok(w) => w,
        Err(e) => return fail(&record, ErrorCode::Internal, format!("preparing the workspace for {branch} failed: {e}")),
    };
    tracing::info!(run_id = %spec.run_id, branch = %workspace.branch, path = %workspace.path, created = workspace.created, "workspace ready");
    spec.message.push_str(&workspace_instructions(&workspace.path, &workspace.branch));
    spec.timeout = deadline.saturating_duration_since(Instant::now());
    if spec.timeout.is_zero() {
        return fail(&record, ErrorCode::Timeout, "the run timed out before it could start");
    }
    let sink: Arc<dyn RunSink> = Arc::new(RelaySink {
        record: record.clone(),
        relay: runtime.relay.clone(),
        plan: plan.clone(),
        guard: Mutex::new(Some(guard)),
    });
    // Handed over: from here on the supervisor cancels it.
    state.pending.remove(&spec.run_id);
    let admitted = state.supervisor.send(StartRun { spec, sink }).timeout(Duration::from_secs(5)).await;
    match admitted {
        Ok(Ok(())) => {}
        Ok(Err(AdmitError::GatewayDown(reason))) => fail(&record, ErrorCode::GatewayDisconnected, format!("the gateway is not available: {reason}")),
        Ok(Err(e)) => fail(&record, ErrorCode::Internal, e.to_string()),
        Err(_) => fail(&record, ErrorCode::Internal, "clawmux is overloaded; the run could not start"),
    }
}

/// The sink of a branch run: the terminal event waits for the relay.
struct RelaySink {
    record: Arc<RunRecord>,
    relay: GitRelay,
    plan: BranchPlan,
    /// Released (dropped) once the relay has pushed, or when the run did not finish ok.
    guard: Mutex<Option<BranchGuard>>,
}

impl RelaySink {
    fn take_guard(&self) -> Option<BranchGuard> {
        match self.guard.lock() {
            Ok(mut g) => g.take(),
            Err(p) => p.into_inner().take(),
        }
    }
}

impl RunSink for RelaySink {
    fn emit(&self, event: RunEvent) {
        let RunEvent::Finished(outcome) = event else {
            self.record.emit(event);
            return;
        };
        let guard = self.take_guard();
        if outcome.status != RunStatus::Ok {
            // Whatever the agent committed stays on its branch in the container for the next run.
            drop(guard);
            self.record.emit(RunEvent::Finished(outcome));
            return;
        }
        let record = self.record.clone();
        let relay = self.relay.clone();
        let plan = self.plan.clone();
        actix::spawn(async move {
            let result = relay.publish(&plan.key, &plan.base_ref, plan.pr_title.as_deref(), plan.pr_body.as_deref()).await;
            tracing::info!(
                branch = %result.branch, commits = result.commit_count, pushed = result.pushed, pr = ?result.pr_url,
                error = ?result.error.as_ref().map(ToString::to_string), "relay finished"
            );
            let value = serde_json::to_value(&result).unwrap_or(serde_json::Value::Null);
            record.set_relay(value.clone());
            record.emit_event("relay", value);
            drop(guard);
            record.emit(RunEvent::Finished(outcome));
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instructions_name_the_worktree_and_branch() {
        let t = workspace_instructions("/workspace/wt/task.1", "sandbox/task.1");
        assert!(t.contains("cd /workspace/wt/task.1") && t.contains("sandbox/task.1") && t.contains("commit"));
    }

    #[test]
    fn pending_runs_can_be_cancelled_once_known() {
        let p = PendingRuns::default();
        assert!(!p.cancel("r"));
        let t = p.insert("r");
        assert!(p.cancel("r"));
        assert!(t.is_cancelled());
        p.remove("r");
        assert!(!p.cancel("r"));
    }
}
