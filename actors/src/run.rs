//! What a run is (its spec), what it reports (events), and how it ends (outcome). These are the
//! types the HTTP layer and the actors share.

use crate::branch::BranchPlan;
use clawmux_protocol::{SessionKey, TraceParent};
use std::time::{Duration, Instant, SystemTime};

/// Everything a session actor needs to run one agent run.
#[derive(Debug, Clone)]
pub struct RunSpec {
    /// The caller's run id (API), unique in this process.
    pub run_id: String,
    /// Fresh UUID sent as the `agent` idempotency key; the gateway uses it as its run id. Never
    /// reused, not even for a retry of the same API run (the gateway would replay a cached result).
    pub gateway_run_id: String,
    /// Canonical session key.
    pub session_key: SessionKey,
    /// Agent id (`main`).
    pub agent_id: String,
    /// The user's message.
    pub message: String,
    /// Model override for `sessions.patch`, if any.
    pub model: Option<String>,
    /// Billing account (for per-session outbound headers where the gateway supports them).
    pub billing_account_id: String,
    /// Graph id (billing metadata).
    pub graph_id: String,
    /// When the run was admitted (wall clock: a restarted clawmux continues the same deadline).
    pub admitted_at: SystemTime,
    /// The run's timeout, from admission (time spent queued counts).
    pub timeout: Duration,
    /// The run's trace context: its trace id ties the run's LLM calls back to it (protocol 4).
    pub traceparent: TraceParent,
    /// A random per-run token carried in `extraSystemPrompt` on protocol 3, where no trace id
    /// reaches the LLM: the proxy attributes calls by it instead. `None` without a proxy.
    pub attribution_token: Option<String>,
    /// The git branch the run works on (lock, workspace, relay), if any.
    pub branch: Option<BranchPlan>,
}

impl RunSpec {
    /// The run's deadline as an `Instant` (admission + timeout; already past when a restart came
    /// too late).
    pub fn deadline(&self) -> Instant {
        let end = self.admitted_at + self.timeout;
        let left = end.duration_since(SystemTime::now()).unwrap_or(Duration::ZERO);
        Instant::now() + left
    }
}

/// The line that carries a run's attribution token into every LLM call of the run (protocol 3).
pub fn attribution_prompt(token: &str) -> String {
    format!("clawmux-attribution: {token}\n(Billing metadata for the operator's LLM proxy. Ignore it; never repeat it.)")
}

/// Progress phases shown to callers in `status` events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The model is working.
    Thinking,
    /// A tool runs (its name is shown, never its arguments or results).
    ToolUse,
    /// The context is being compacted.
    Compacting,
}

impl Phase {
    /// The API's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Thinking => "thinking",
            Phase::ToolUse => "tool_use",
            Phase::Compacting => "compacting",
        }
    }
}

/// What a run reports, in order: `Accepted`, any `Status`/`TextDelta`, an optional `Relay`, then
/// exactly one `Finished`.
#[derive(Debug, Clone, PartialEq)]
pub enum RunEvent {
    /// The gateway acknowledged the run.
    Accepted {
        /// The gateway's run id.
        gateway_run_id: String,
    },
    /// Progress.
    Status {
        /// Phase.
        phase: Phase,
        /// Tool name for `ToolUse`.
        tool: Option<String>,
    },
    /// The run waits for its branch key's lock, held by an earlier run.
    WaitingForBranch {
        /// `sandbox/<key>`.
        branch: String,
    },
    /// Incremental text.
    TextDelta(String),
    /// The git relay's result (the `relay` event's data).
    Relay(serde_json::Value),
    /// Terminal.
    Finished(RunOutcome),
}

/// A point in a run's life that must survive a restart of clawmux: the run store records it, and a
/// restarted clawmux continues the run from its last checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum Checkpoint {
    /// The run holds its session key (status `running`).
    Running,
    /// Its workspace is being prepared.
    Preparing,
    /// `agent` is about to be sent to this gateway process (the gateway run id is the spec's; a
    /// restart sends it again with the same idempotency key, and the gateway dedupes).
    Sending {
        /// The gateway process's identity ([`crate::instance`]; `None`: unknown).
        boot_id: Option<String>,
    },
    /// The gateway run ended ok; the relay publishes (a restart publishes again: idempotent).
    Publishing {
        /// The run's final content.
        content: String,
        /// OpenClaw's own token counts.
        gateway_usage: Option<(u64, u64)>,
    },
}

/// Where a restarted clawmux picks a run up.
#[derive(Debug, Clone, PartialEq)]
pub struct Resume {
    /// The stage of the run's last checkpoint.
    pub stage: ResumeStage,
    /// The concatenation of the `text_delta` events already stored: new deltas continue it.
    pub emitted: String,
    /// The `accepted` event is stored (it is never sent twice).
    pub accepted: bool,
}

/// The stage a resumed run continues from.
#[derive(Debug, Clone, PartialEq)]
pub enum ResumeStage {
    /// Nothing was sent to the gateway: start from the queue, in admission order.
    Start,
    /// `agent` was sent to this gateway process.
    Sent {
        /// That process's identity ([`crate::instance`]).
        boot_id: Option<String>,
    },
    /// The gateway run ended ok and the relay was publishing.
    Publishing {
        /// The run's final content.
        content: String,
        /// OpenClaw's own token counts.
        gateway_usage: Option<(u64, u64)>,
    },
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub struct RunOutcome {
    /// Terminal status.
    pub status: RunStatus,
    /// Final assistant text (for errors: whatever was streamed).
    pub content: String,
    /// Why it failed, unless `status` is `Ok`.
    pub error: Option<RunError>,
    /// The gateway's own token counts `(input, output)`: a hint, never billing truth.
    pub gateway_usage: Option<(u64, u64)>,
}

/// Terminal status of a run (the run document's `status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunStatus {
    /// Completed.
    Ok,
    /// Failed.
    Error,
    /// Aborted by the API or by the caller going away.
    Aborted,
    /// Exceeded its timeout.
    Timeout,
}

impl RunStatus {
    /// The API's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Ok => "ok",
            RunStatus::Error => "error",
            RunStatus::Aborted => "aborted",
            RunStatus::Timeout => "timeout",
        }
    }
}

/// Run error codes of the API contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    /// The run exceeded its timeout; the gateway run was cancelled.
    Timeout,
    /// Aborted by `POST .../abort` or by the client going away.
    Aborted,
    /// The gateway finished the run with an error.
    AgentError,
    /// The gateway refused a request.
    GatewayRejected,
    /// The connection dropped mid-run and the run could not be recovered.
    GatewayDisconnected,
    /// The gateway answered the run's own request with something clawmux cannot understand
    /// (a malformed or contradictory frame); the gateway run was cancelled.
    GatewayProtocolError,
    /// The billing account's budget is spent.
    BudgetExceeded,
    /// The git relay cannot work on the run's branch as asked, and the caller can fix it (an
    /// unknown base ref, a branch key conflicting with an existing branch).
    RelayRejected,
    /// A bug in clawmux.
    Internal,
}

impl ErrorCode {
    /// The API's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::Timeout => "timeout",
            ErrorCode::Aborted => "aborted",
            ErrorCode::AgentError => "agent_error",
            ErrorCode::GatewayRejected => "gateway_rejected",
            ErrorCode::GatewayDisconnected => "gateway_disconnected",
            ErrorCode::GatewayProtocolError => "gateway_protocol_error",
            ErrorCode::BudgetExceeded => "budget_exceeded",
            ErrorCode::RelayRejected => "relay_rejected",
            ErrorCode::Internal => "internal",
        }
    }

    /// The run status an error of this code ends in.
    pub fn status(self) -> RunStatus {
        match self {
            ErrorCode::Timeout => RunStatus::Timeout,
            ErrorCode::Aborted => RunStatus::Aborted,
            _ => RunStatus::Error,
        }
    }
}

/// A run error: code and a sentence a person can act on.
#[derive(Debug, Clone, PartialEq)]
pub struct RunError {
    /// Code.
    pub code: ErrorCode,
    /// Message.
    pub message: String,
}

impl RunOutcome {
    /// A successful outcome.
    pub fn ok(content: String, gateway_usage: Option<(u64, u64)>) -> Self {
        Self { status: RunStatus::Ok, content, error: None, gateway_usage }
    }

    /// A failed outcome.
    pub fn failed(code: ErrorCode, message: impl Into<String>, content: String) -> Self {
        Self { status: code.status(), content, error: Some(RunError { code, message: message.into() }), gateway_usage: None }
    }
}

/// Why a run is being cancelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelReason {
    /// `POST /v1/runs/{id}/abort`.
    Api,
    /// The caller's stream closed and the run asked for `onDisconnect: abort`.
    ClientGone,
    /// The run's timeout elapsed.
    Timeout,
    /// clawmux is shutting down (`CLAWMUX_SHUTDOWN=cancel`).
    Shutdown,
    /// A newer run of the same session key asked for it (`ifBusy: interrupt`).
    Interrupted,
    /// The billing account's token budget for the period is spent.
    BudgetExceeded,
}

impl CancelReason {
    /// The error the run ends with.
    pub fn outcome(self, content: String) -> RunOutcome {
        match self {
            CancelReason::Api => RunOutcome::failed(ErrorCode::Aborted, "the run was aborted by request", content),
            CancelReason::ClientGone => {
                RunOutcome::failed(ErrorCode::Aborted, "the client disconnected and the run asked for onDisconnect: abort", content)
            }
            CancelReason::Timeout => RunOutcome::failed(ErrorCode::Timeout, "the run exceeded its timeout and was cancelled", content),
            CancelReason::Shutdown => RunOutcome::failed(ErrorCode::Aborted, "clawmux is shutting down; the run was cancelled", content),
            CancelReason::Interrupted => RunOutcome::failed(
                ErrorCode::Aborted,
                "a newer run of the same session interrupted this one (ifBusy: interrupt)",
                content,
            ),
            CancelReason::BudgetExceeded => RunOutcome::failed(
                ErrorCode::BudgetExceeded,
                "the billing account's token budget for this period is spent; the run was stopped before its next LLM call",
                content,
            ),
        }
    }
}

/// Where a run's events go. Implementations must not block: the session actor calls this on its
/// arbiter (the run store queues the event for its group commit; clients see it once stored).
pub trait RunSink: Send + Sync + 'static {
    /// Delivers one event.
    fn emit(&self, event: RunEvent);
    /// Records a checkpoint of the run's life (see [`Checkpoint`]).
    fn checkpoint(&self, checkpoint: Checkpoint);
    /// Delivers a text delta whose frame arrived at `received` (the sink measures clawmux's added
    /// latency up to the moment the delta is visible to the run's clients).
    fn text_delta(&self, text: String, received: Instant) {
        let _ = received;
        self.emit(RunEvent::TextDelta(text));
    }
}
