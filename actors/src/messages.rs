//! Every message between the actors, one type per intent, and the ports that carry them.
//!
//! ```text
//!  HTTP ──Submit/Cancel/Drain──▶ Registry ──Turn/Cancel/Suspend/Link──▶ Session (one per run)
//!                                   ▲  ◀──────Release/RunEnded───────────┘   │
//!             Link (up/down) ───────┘                                       │ Call, AddRoute,
//!  Supervisor ◀──────────────────────────────────────────────────────────────┘ RemoveRoute, Abandon
//!      └──Reply/Routed──▶ Session
//! ```
//! The graph has no cycle of awaited sends: every message below is sent with `do_send`, except the
//! HTTP layer's requests to the registry (`send` with a timeout).

use crate::run::{CancelReason, Resume, RunSink, RunSpec, RunStatus};
use actix::prelude::*;
use clawmux_protocol::{ErrorShape, GatewayEvent, SessionKey};
use serde_json::value::RawValue;
use std::sync::Arc;
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// Session → supervisor: requests to the gateway and the routes of its frames
// ---------------------------------------------------------------------------------------------

/// How long the supervisor waits for the answer to a [`Call`] before failing it with
/// [`CallError::TimedOut`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// `SupervisorConfig::request_timeout`: for calls the gateway answers at once.
    Default,
    /// No deadline here: the caller owns it (the `agent` request, bounded by its run's timeout).
    Caller,
    /// This long: calls that may legitimately take as long as a run (`agent.wait`).
    Up(Duration),
}

/// A request to the gateway.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Call {
    /// Method name.
    pub method: &'static str,
    /// Params (already closed-schema typed by the caller).
    pub params: serde_json::Value,
    /// W3C trace context for the frame (protocol 4 only).
    pub traceparent: Option<String>,
    /// Correlates the reply at the caller.
    pub tag: u64,
    /// Where to deliver the answer(s); `None` for fire-and-forget.
    pub reply_to: Option<Recipient<Reply>>,
    /// How long the answer may take.
    pub wait: Wait,
}

impl Call {
    /// A call answered at once, with the default request timeout.
    pub fn new(method: &'static str, params: serde_json::Value, tag: u64, reply_to: Option<Recipient<Reply>>) -> Self {
        Self { method, params, traceparent: None, tag, reply_to, wait: Wait::Default }
    }
}

/// How a call failed without a gateway answer.
#[derive(Debug, Clone, PartialEq)]
pub enum CallError {
    /// The gateway answered `ok: false`.
    Gateway(ErrorShape),
    /// The connection was down when the call was made.
    NotConnected,
    /// The connection dropped before the answer.
    Disconnected,
    /// No answer within the call's [`Wait`].
    TimedOut,
    /// The answer could not be decoded.
    Malformed(String),
}

/// The answer to a [`Call`] (for `agent`: delivered twice, ACK then final).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Reply {
    /// The caller's tag.
    pub tag: u64,
    /// Payload or error.
    pub result: Result<Box<RawValue>, CallError>,
}

/// Deliver the events of `(session_key, gateway_run_id)` to `to` (fail-closed routing: nothing
/// else reaches it).
#[derive(Message)]
#[rtype(result = "()")]
pub struct AddRoute {
    /// Canonical session key.
    pub session_key: SessionKey,
    /// The gateway run id (the `agent` idempotency key).
    pub gateway_run_id: String,
    /// The run's session actor.
    pub to: Recipient<Routed>,
}

/// Stop delivering a run's events (its end; later frames are dropped and counted).
#[derive(Message)]
#[rtype(result = "()")]
pub struct RemoveRoute {
    /// Canonical session key.
    pub session_key: SessionKey,
    /// The gateway run id.
    pub gateway_run_id: String,
}

/// A gateway run nobody waits for any more that could not be cancelled (the connection was down):
/// the supervisor cancels it once that gateway process is reachable again.
#[derive(Message, Debug, Clone, PartialEq, Eq)]
#[rtype(result = "()")]
pub struct Abandon {
    /// Canonical session key.
    pub session_key: SessionKey,
    /// The gateway run id.
    pub gateway_run_id: String,
    /// The identity of the gateway process that runs it ([`crate::instance`]; `None`: unknown).
    pub boot_id: Option<String>,
}

/// The gateway rejected `outboundHeaders`: stop sending them (auto mode).
#[derive(Message)]
#[rtype(result = "()")]
pub struct OutboundHeadersUnsupported;

/// A write was refused for a missing scope (`/readyz` shows it).
#[derive(Message)]
#[rtype(result = "()")]
pub struct ScopeMissing(pub ErrorShape);

// ---------------------------------------------------------------------------------------------
// Supervisor → sessions
// ---------------------------------------------------------------------------------------------

/// A `chat`/`agent` event whose `(sessionKey, runId)` is this run's, with the moment its frame
/// arrived (to measure clawmux's added latency).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Routed(pub GatewayEvent, pub Instant);

/// The gateway connection as sessions need it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayUp {
    /// Negotiated protocol.
    pub protocol: u32,
    /// The gateway process's identity ([`crate::instance`]: its boot id, or on protocol 3 its
    /// start time), when it can be told.
    pub boot_id: Option<String>,
    /// Events arrive only for subscribed sessions.
    pub session_scoped: bool,
    /// Send per-session outbound headers.
    pub outbound_headers: bool,
}

/// The gateway connection came up (`Some`) or went down (`None`). The supervisor tells the
/// registry, which tells every live run.
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct Link(pub Option<GatewayUp>);

/// Where the supervisor reports [`Link`] changes (it answers at once with the current state).
#[derive(Message)]
#[rtype(result = "()")]
pub struct ListenLink(pub Recipient<Link>);

// ---------------------------------------------------------------------------------------------
// HTTP → registry
// ---------------------------------------------------------------------------------------------

/// Why a run was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// The gateway connection is down.
    #[error("the gateway connection is down: {0}")]
    GatewayDown(String),
    /// Too many runs in flight.
    #[error("clawmux is at its capacity of {0} runs in flight")]
    AtCapacity(usize),
    /// A run with this id is already in flight.
    #[error("a run with this id is already in flight")]
    Duplicate,
    /// clawmux is shutting down (it admits nothing new; clients retry against the next process).
    #[error("clawmux is shutting down")]
    ShuttingDown,
    /// Another run of the session key is live and the run asked `ifBusy: reject`.
    #[error("another run of this session is in flight (ifBusy: reject)")]
    SessionBusy,
}

/// What a run does when its session key is busy (`ifBusy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IfBusy {
    /// Wait in line (FIFO).
    #[default]
    Enqueue,
    /// Refuse at once.
    Reject,
    /// Cancel the running run (`aborted`) and run next.
    Interrupt,
}

/// Admit a run (HTTP, or the restart path with `resume`). Answers once the run is admitted: its
/// session actor exists and owns it from here to its terminal event.
#[derive(Message)]
#[rtype(result = "Result<Admitted, AdmitError>")]
pub struct Submit {
    /// The run.
    pub spec: RunSpec,
    /// Where its events go.
    pub sink: Arc<dyn RunSink>,
    /// Set when a restarted clawmux continues the run.
    pub resume: Option<Resume>,
    /// What to do when the session key is busy.
    pub if_busy: IfBusy,
    /// Who runs it: `None`, a session actor on the gateway connection; otherwise the actor this
    /// makes (an ephemeral container's). Either way the registry owns the run's life: locks,
    /// cancels, shutdown, its end.
    pub external: Option<ExternalStart>,
    /// The arbiter (shard) its session actor runs on: the HTTP worker that admitted it, whose
    /// thread also commits its events and streams them to its caller. `None` (a run continued
    /// from the store): one of the registry's shards, by session key.
    pub shard: Option<actix::dev::ArbiterHandle>,
}

/// Makes the actor of a run that does not use the gateway connection, given the registry's port
/// (it reports its end there, exactly once, with `RunEnded`).
pub type ExternalStart = Box<dyn FnOnce(RegistryPort) -> ExternalRun + Send>;

/// What the registry holds of a run that does not use the gateway connection. Such a run cannot
/// be handed to the next process: at shutdown it is cancelled in either mode.
pub struct ExternalRun {
    /// `Turn::Go` once it holds its locks (it must not start before).
    pub turn: Recipient<Turn>,
    /// Cancels (abort, client gone, timeout of a queued run, shutdown).
    pub cancel: Recipient<CancelRun>,
}

/// How an admitted run stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admitted {
    /// It holds its session key: it starts now (status `running`).
    Started,
    /// It waits behind another run of its session key (status `queued`).
    Queued,
}

/// Cancel a run. Answers whether the run was live (it then ends with the reason's error).
#[derive(Message)]
#[rtype(result = "bool")]
pub struct Cancel {
    /// The API run id.
    pub run_id: String,
    /// Why.
    pub reason: CancelReason,
}

/// What to do with live runs when clawmux stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownMode {
    /// Leave gateway runs running; the next start continues them from the store.
    Handoff,
    /// Cancel every run (terminal `aborted`) and its gateway run.
    Cancel,
}

/// Stop admitting; then hand off or cancel every live run. Answers how many runs were live.
#[derive(Message)]
#[rtype(result = "usize")]
pub struct Drain(pub ShutdownMode);

/// Stop one run here without a terminal event and without cancelling its gateway run: another
/// replica took it over and continues it. Answers whether the run was live.
#[derive(Message)]
#[rtype(result = "bool")]
pub struct HandOff {
    /// The API run id.
    pub run_id: String,
}

/// Number of live runs (queued, waiting, running, publishing).
#[derive(Message)]
#[rtype(result = "usize")]
pub struct InFlight;

// ---------------------------------------------------------------------------------------------
// Registry ↔ session
// ---------------------------------------------------------------------------------------------

/// The locks a run holds in turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lock {
    /// Its session key: runs of one session never interleave (FIFO by admission).
    Session,
    /// Its branch key: one run works on (and publishes) a branch at a time.
    Branch,
    /// A start slot (`RegistryConfig::max_starting`), held from its turn to the gateway's ACK of
    /// its `agent` call: a burst of admissions starts at the gateway's pace instead of queueing
    /// thousands of requests and replies in front of the frames of runs already streaming.
    Start,
}

/// Registry → session: where the run stands in the queues.
#[derive(Message, Debug, Clone, Copy, PartialEq, Eq)]
#[rtype(result = "()")]
pub enum Turn {
    /// It holds its session key but waits for its branch key (held by an earlier run).
    WaitingForBranch,
    /// It holds every lock it needs: go.
    Go,
}

/// Session → registry: a lock is no longer needed (the session key at the gateway run's end, so
/// the next run of the session starts while this one publishes).
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct Release {
    /// The API run id.
    pub run_id: String,
    /// Which lock.
    pub lock: Lock,
}

/// Session → registry: the run emitted its terminal event (or was suspended at shutdown): forget
/// it and free whatever it still holds or waits for.
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct RunEnded {
    /// The API run id.
    pub run_id: String,
    /// How it ended (`None`: suspended for a handoff, it goes on after a restart).
    pub status: Option<RunStatus>,
}

/// Registry → session: cancel the run.
#[derive(Message, Debug, Clone, Copy)]
#[rtype(result = "()")]
pub struct CancelRun(pub CancelReason);

/// Registry → session: stop without a terminal event (handoff at shutdown; the store has the
/// run's state and the next start continues it).
#[derive(Message, Debug, Clone, Copy)]
#[rtype(result = "()")]
pub struct Suspend;

/// The supervisor-side recipients a session actor talks to (a probe in tests).
#[derive(Clone)]
pub struct GatewayPort {
    /// Requests to the gateway.
    pub call: Recipient<Call>,
    /// Route registration.
    pub add_route: Recipient<AddRoute>,
    /// Route removal.
    pub remove_route: Recipient<RemoveRoute>,
    /// Runs to cancel once the gateway is back.
    pub abandon: Recipient<Abandon>,
    /// `outboundHeaders` rejected.
    pub headers_unsupported: Recipient<OutboundHeadersUnsupported>,
    /// A scope is missing.
    pub scope_missing: Recipient<ScopeMissing>,
}

/// The registry-side recipients a session actor talks to.
#[derive(Clone)]
pub struct RegistryPort {
    /// Lock releases.
    pub release: Recipient<Release>,
    /// The end of the run.
    pub ended: Recipient<RunEnded>,
}
