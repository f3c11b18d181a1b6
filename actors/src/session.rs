//! The session actor: one per run, from admission to its terminal event.
//!
//! ```text
//! queued ─Turn─▶ [waiting_for_branch ─Turn─▶] [preparing (worktree)] ─▶ sessions.patch (model) ─▶
//! [sessions.messages.subscribe] ─▶ agent (ACK … events … final res) ─▶ [publishing (relay)] ─▶ end
//! ```
//! It owns the run's timeout from admission (queue and lock waits count), its cancellation in every
//! stage, its checkpoints in the run store (so a restarted clawmux continues it), and the
//! conversation with the gateway: it turns frames into [`RunEvent`]s, treats the `agent` final `res`
//! as the truth, cancels the gateway run (`chat.abort`) on timeout, abort or client disconnect, and
//! survives a dropped connection: before `agent` was sent it starts over once the connection is
//! back; after, it re-subscribes and asks `agent.wait` for the run's end (waiting as long as the run
//! may still run), unless the gateway restarted (new boot id) or does not come back within the
//! recovery window. A run it stops waiting for is cancelled on the gateway, never left running
//! with no owner. Every wait has a deadline. A branch run that ends (aborted, timed out) while its
//! workspace is prepared or published ends at once, but keeps its branch key until that step is
//! over: the step's commands cannot be stopped in the container.
//!
//! It talks to the supervisor and the registry only through [`GatewayPort`] and [`RegistryPort`],
//! so tests drive it with probes.

use crate::branch::{workspace_instructions, Workspace};
use crate::delta::DeltaTracker;
use crate::limits::clip;
use crate::messages::{
    Abandon, AddRoute, Call, CallError, CancelRun, GatewayPort, GatewayUp, Link, OutboundHeadersUnsupported, RegistryPort,
    Release, Lock, RemoveRoute, Reply, Routed, RunEnded, ScopeMissing, Suspend, Turn, Wait,
};
use crate::metrics::Metrics;
use crate::run::{CancelReason, Checkpoint, ErrorCode, Phase, Resume, ResumeStage, RunEvent, RunOutcome, RunSink, RunSpec, RunStatus};
use crate::start_clock::StartClock;
use actix::prelude::*;
use clawmux_protocol::events::AgentSignal;
use clawmux_protocol::methods::{
    decode_agent_reply, name, AgentFinal, AgentParams, AgentReply, AgentWaitParams, AgentWaitResult, ChatAbortParams, FinalStatus,
    SessionKeyParams, SessionsPatchParams, WaitOutcome,
};
use clawmux_protocol::{ChatState, GatewayEvent};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Whether per-session `outboundHeaders` are sent with `sessions.patch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutboundHeadersMode {
    /// Always (the Cogni fork); a gateway that rejects them fails the run.
    On,
    /// Never (stock OpenClaw).
    Off,
    /// Only to a gateway that lists the capability `session-outbound-headers` in `hello-ok`
    /// (so a stock gateway never gets the field its schema refuses); should one still refuse them
    /// (`unexpected property 'outboundHeaders'`), the patch is repeated without them and they are
    /// not sent again on that connection.
    Auto,
}

/// What a session actor needs to know of the configuration.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// How long a run whose connection dropped waits for the connection to come back.
    pub recovery_window: Duration,
    /// How long an aborted run waits for the gateway's final answer before ending anyway.
    pub abort_grace: Duration,
    /// Slack on top of a gateway-side wait (the round trip of `agent.wait`).
    pub request_timeout: Duration,
    /// Outbound headers policy.
    pub outbound_headers: OutboundHeadersMode,
    /// The most text a run may produce. The gateway is a peer: a run whose frames keep bringing
    /// new text (two messages interleaved count each as a new turn) would grow its delta tracker,
    /// its event log and the store writer's queue shared by every run without bound. Past this the
    /// run ends `agent_error` and its gateway run is cancelled.
    pub max_output_bytes: usize,
}

/// [`SessionConfig::max_output_bytes`] by default: far beyond an agent's answer.
pub const MAX_OUTPUT_BYTES: usize = 16 << 20;

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            recovery_window: Duration::from_secs(30),
            abort_grace: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            outbound_headers: OutboundHeadersMode::Auto,
            max_output_bytes: MAX_OUTPUT_BYTES,
        }
    }
}

/// Where the run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Waiting for its session key (runs of one session run one after the other).
    Queued,
    /// Holds its session key, waits for its branch key.
    WaitingForBranch,
    /// Its worktree is being prepared in the gateway container.
    Preparing,
    /// Waiting for a connection before anything was sent to the gateway.
    WaitingForGateway,
    /// `sessions.patch` sent, and on a gateway with session-scoped events
    /// `sessions.messages.subscribe` beside it: `agent` goes once both are answered.
    Patching,
    /// `agent` sent; waiting for ACK or final.
    Running,
    /// The connection dropped after `agent` was sent; waiting for it to come back.
    Recovering,
    /// Reconnected (or resumed); `agent.wait` sent.
    Waiting,
    /// The gateway run ended ok; the relay publishes.
    Publishing,
    /// Terminal event emitted (or suspended).
    Done,
}

// Reply tags: one per request kind, so a late answer to an earlier attempt is recognisable.
const TAG_PATCH: u64 = 1;
const TAG_SUBSCRIBE: u64 = 2;
const TAG_AGENT: u64 = 3;
const TAG_WAIT: u64 = 4;
const TAG_ABORT: u64 = 5;
const TAG_RESUBSCRIBE: u64 = 6;

/// How many times a call answered `UNAVAILABLE` is repeated.
const MAX_UNAVAILABLE_RETRIES: u32 = 5;

/// How long to wait before asking `agent.wait` again after an answer that the run has not ended:
/// the gateway answers `pending` (still queued) at once, without waiting, and a faulty gateway may
/// answer anything at once; asking again straight away would be a busy loop for as long as the
/// run may run.
const NOT_ENDED_RECHECK: Duration = Duration::from_secs(1);

/// One run.
pub struct SessionActor {
    spec: RunSpec,
    sink: Arc<dyn RunSink>,
    gateway: GatewayPort,
    registry: RegistryPort,
    /// The git relay, for runs with a branch.
    workspace: Option<Arc<dyn Workspace>>,
    cfg: SessionConfig,
    metrics: Metrics,
    /// The connection as it is now (`None` when down).
    link: Option<GatewayUp>,
    /// How many times the connection went down while the run waited for it: a recovery window's
    /// timer ends the run only in the outage that armed it (a flapping connection gives each
    /// outage a window of its own).
    outages: u64,
    stage: Stage,
    /// When the run's timeout fires (admission + timeout).
    deadline: Instant,
    /// Where a restarted clawmux picks the run up (consumed when the run gets its turn).
    resume: Option<crate::run::ResumeStage>,
    /// The message sent to the agent (the user's, plus the worktree instructions of a branch run).
    message: String,
    /// Boot id of the gateway the `agent` request went to.
    agent_boot_id: Option<String>,
    accepted: bool,
    tracker: DeltaTracker,
    /// The last status sent, so repeated phases are not re-announced.
    last_status: Option<(Phase, Option<String>)>,
    /// Set once a cancel was requested; the run ends with this reason.
    cancelling: Option<CancelReason>,
    /// Text of a chat `error` event (the final `res` may follow with less detail).
    chat_error: Option<String>,
    unavailable_retries: u32,
    /// A subscribe was sent (an unsubscribe is due at the end).
    subscribed: bool,
    /// The connection outage count (`outages`) the last subscribe was sent on: a new connection
    /// needs its own.
    subscribed_on: Option<u64>,
    /// The subscribe's answer is still to come (`agent` waits for it).
    awaiting_subscribe: bool,
    /// The `sessions.patch` of the current attempt was answered ok.
    patched: bool,
    /// The supervisor routes this run's frames here.
    routed: bool,
    /// The session key is held (released at the gateway run's end).
    holds_session: bool,
    /// `agent` was sent: from here on the gateway may be running the run.
    agent_sent: bool,
    /// The gateway reported the run's end (final `res` or a terminal `agent.wait`).
    gateway_ended: bool,
    /// `chat.abort` was sent for the run.
    abort_sent: bool,
    /// A workspace step (prepare or publish) is under way. It cannot be cancelled (its commands go
    /// on in the container), so a run that ends meanwhile keeps its branch key until the step is
    /// over: the next run of the branch must not work on the worktree at the same time.
    workspace_busy: bool,
    /// How the run ended, kept for the registry while a workspace step outlives the run's end.
    ended: Option<RunStatus>,
    /// The stages of its start, timed for runs admitted here (not for runs continued after a
    /// restart).
    start_clock: Option<StartClock>,
}

impl SessionActor {
    /// A session actor for an admitted run; `link` is the connection as it is now.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        spec: RunSpec,
        sink: Arc<dyn RunSink>,
        gateway: GatewayPort,
        registry: RegistryPort,
        workspace: Option<Arc<dyn Workspace>>,
        cfg: SessionConfig,
        metrics: Metrics,
        link: Option<GatewayUp>,
        resume: Option<Resume>,
    ) -> Self {
        let deadline = spec.deadline();
        let message = spec.message.clone();
        let start_clock = resume.is_none().then(|| StartClock::new(Instant::now()));
        let (resume, tracker, accepted) = match resume {
            Some(r) => (Some(r.stage), DeltaTracker::resumed(r.emitted), r.accepted),
            None => (None, DeltaTracker::new(), false),
        };
        let agent_boot_id = match &resume {
            Some(ResumeStage::Sent { boot_id }) => boot_id.clone(),
            _ => None,
        };
        Self {
            spec,
            sink,
            gateway,
            registry,
            workspace,
            cfg,
            metrics,
            link,
            outages: 0,
            stage: Stage::Queued,
            deadline,
            resume,
            message,
            agent_boot_id,
            accepted,
            tracker,
            last_status: None,
            cancelling: None,
            chat_error: None,
            unavailable_retries: 0,
            subscribed: false,
            subscribed_on: None,
            awaiting_subscribe: false,
            patched: false,
            routed: false,
            holds_session: false,
            agent_sent: false,
            gateway_ended: false,
            abort_sent: false,
            workspace_busy: false,
            ended: None,
            start_clock,
        }
    }

    fn call(&self, ctx: &mut Context<Self>, method: &'static str, params: serde_json::Value, tag: u64) {
        self.gateway.call.do_send(Call::new(method, params, tag, Some(ctx.address().recipient())));
    }

    fn to_value<T: serde::Serialize>(&self, v: &T) -> serde_json::Value {
        serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
    }

    // -----------------------------------------------------------------------------------------
    // Turn: locks, workspace
    // -----------------------------------------------------------------------------------------

    fn on_turn(&mut self, ctx: &mut Context<Self>, turn: Turn) {
        if !matches!(self.stage, Stage::Queued | Stage::WaitingForBranch) {
            return;
        }
        if !self.holds_session && !matches!(self.resume, Some(ResumeStage::Publishing { .. })) {
            self.holds_session = true;
            self.sink.checkpoint(Checkpoint::Running);
        }
        match turn {
            Turn::WaitingForBranch => {
                self.stage = Stage::WaitingForBranch;
                let branch = self.spec.branch.as_ref().map(|b| b.branch()).unwrap_or_default();
                self.sink.emit(RunEvent::WaitingForBranch { branch });
            }
            Turn::Go => {
                if let Some(stage) = self.start_clock.as_mut().and_then(|c| c.turn(Instant::now())) {
                    self.metrics.start_stage(stage);
                }
                self.go(ctx)
            }
        }
    }

    /// The run's turn came: it starts, or continues where a restart left it.
    fn go(&mut self, ctx: &mut Context<Self>) {
        match self.resume.take() {
            Some(ResumeStage::Publishing { content, gateway_usage }) => self.publish(ctx, RunOutcome::ok(content, gateway_usage)),
            Some(ResumeStage::Sent { .. }) => {
                // The gateway has (or had) the run: recover it once the connection is up.
                self.agent_sent = true;
                self.add_route(ctx);
                self.stage = Stage::Recovering;
                if let Some(link) = self.link.clone() {
                    self.on_link_up(ctx, link);
                } else {
                    self.arm_recovery_deadline(ctx);
                }
            }
            Some(ResumeStage::Start) | None => self.prepare(ctx),
        }
    }

    /// Prepares the worktree of a branch run, then starts the gateway run.
    fn prepare(&mut self, ctx: &mut Context<Self>) {
        let (Some(plan), Some(workspace)) = (self.spec.branch.clone(), self.workspace.clone()) else {
            return self.begin(ctx);
        };
        self.stage = Stage::Preparing;
        self.sink.checkpoint(Checkpoint::Preparing);
        let fut = workspace.prepare(&plan);
        self.workspace_busy = true;
        ctx.spawn(fut.into_actor(self).map(move |result, act, ctx| {
            act.workspace_busy = false;
            if act.stage == Stage::Done {
                return act.leave(ctx);
            }
            if act.stage != Stage::Preparing {
                return;
            }
            match result {
                Ok(w) => {
                    tracing::info!(run_id = %act.spec.run_id, branch = %w.branch, path = %w.path, "workspace ready");
                    act.message.push_str(&workspace_instructions(&w.path, &w.branch));
                    act.begin(ctx);
                }
                Err(e) => {
                    let why = clip(&e.to_string());
                    let outcome = if e.is_rejection() {
                        RunOutcome::failed(ErrorCode::RelayRejected, format!("cannot work on {}: {why}", plan.branch()), String::new())
                    } else {
                        RunOutcome::failed(ErrorCode::Internal, format!("preparing the workspace for {} failed: {why}", plan.branch()), String::new())
                    };
                    act.finish(ctx, outcome);
                }
            }
        }));
    }

    /// Publishes a branch run's commits after an ok gateway run, then ends the run.
    fn publish(&mut self, ctx: &mut Context<Self>, outcome: RunOutcome) {
        let (Some(plan), Some(workspace)) = (self.spec.branch.clone(), self.workspace.clone()) else {
            return self.finish(ctx, outcome);
        };
        self.stage = Stage::Publishing;
        self.release_session();
        self.sink.checkpoint(Checkpoint::Publishing { content: outcome.content.clone(), gateway_usage: outcome.gateway_usage });
        let fut = workspace.publish(&plan);
        self.workspace_busy = true;
        ctx.spawn(fut.into_actor(self).map(move |published, act, ctx| {
            act.workspace_busy = false;
            if act.stage == Stage::Done {
                return act.leave(ctx);
            }
            if act.stage != Stage::Publishing {
                return;
            }
            tracing::info!(run_id = %act.spec.run_id, relay = %published.relay, "relay finished");
            act.metrics.relay_result(&published.relay);
            act.sink.emit(RunEvent::Relay(published.relay));
            act.finish(ctx, outcome);
        }));
    }

    fn release_session(&mut self) {
        if self.holds_session {
            self.holds_session = false;
            self.registry.release.do_send(Release { run_id: self.spec.run_id.clone(), lock: Lock::Session });
        }
    }

    fn add_route(&mut self, ctx: &mut Context<Self>) {
        if !self.routed {
            self.routed = true;
            // Sent by the same actor before any call, so the route exists before `agent` goes out.
            self.gateway.add_route.do_send(AddRoute {
                session_key: self.spec.session_key.clone(),
                gateway_run_id: self.spec.gateway_run_id.clone(),
                to: ctx.address().recipient(),
            });
        }
    }

    // -----------------------------------------------------------------------------------------
    // The gateway run
    // -----------------------------------------------------------------------------------------

    fn begin(&mut self, ctx: &mut Context<Self>) {
        self.add_route(ctx);
        let Some(link) = self.link.clone() else {
            self.stage = Stage::WaitingForGateway;
            self.arm_recovery_deadline(ctx);
            return;
        };
        self.stage = Stage::Patching;
        self.patched = false;
        let outbound_headers = if link.outbound_headers { Some(self.billing_headers()) } else { None };
        let params = SessionsPatchParams { key: self.spec.session_key.to_string(), model: self.spec.model.clone(), outbound_headers };
        let v = self.to_value(&params);
        self.call(ctx, name::SESSIONS_PATCH, v, TAG_PATCH);
        // The subscription goes out beside the patch, not after its answer: the two do not depend
        // on each other (a subscription is a filter of this connection, by key), and `agent`
        // waits for both. One gateway round trip less per run: for its `accepted`, and two
        // thread wake-ups less (BENCHMARKS.md, "Shards are the HTTP workers").
        if link.session_scoped && self.subscribed_on != Some(self.outages) {
            let v = self.to_value(&SessionKeyParams { key: self.spec.session_key.to_string() });
            self.call(ctx, name::SESSIONS_SUBSCRIBE, v, TAG_SUBSCRIBE);
            // Counted from the send: a run ended before the answer (or whose subscribe timed out)
            // may be subscribed all the same, and the subscription would outlive it (every later
            // event of the session sent to clawmux). A stray unsubscribe is harmless.
            self.subscribed = true;
            self.subscribed_on = Some(self.outages);
            self.awaiting_subscribe = true;
        }
    }

    /// Per-session billing headers for gateways that accept them (the Cogni fork).
    fn billing_headers(&self) -> BTreeMap<String, String> {
        let meta = serde_json::json!({
            "run_id": self.spec.run_id,
            "graph_id": self.spec.graph_id,
            "attempt": 0,
            "session_key": self.spec.session_key.as_str(),
        });
        BTreeMap::from([
            ("x-litellm-end-user-id".to_owned(), self.spec.billing_account_id.clone()),
            ("x-litellm-spend-logs-metadata".to_owned(), meta.to_string()),
            ("x-cogni-run-id".to_owned(), self.spec.run_id.clone()),
        ])
    }

    /// `agent` goes once the patch is answered ok and the subscribe (if one was sent) answered.
    fn after_setup(&mut self, ctx: &mut Context<Self>) {
        if self.stage == Stage::Patching && self.patched && !self.awaiting_subscribe {
            self.send_agent(ctx);
        }
    }

    fn send_agent(&mut self, ctx: &mut Context<Self>) {
        self.stage = Stage::Running;
        self.agent_boot_id = self.link.as_ref().and_then(|l| l.boot_id.clone());
        // Recorded before the frame goes out: a restart then knows the gateway may have the run.
        self.sink.checkpoint(Checkpoint::Sending { boot_id: self.agent_boot_id.clone() });
        if !self.agent_sent {
            self.agent_sent = true;
            self.metrics.runs_started.inc();
        }
        if let Some(stage) = self.start_clock.as_mut().and_then(|c| c.sent(Instant::now())) {
            self.metrics.start_stage(stage);
        }
        let v3 = self.link.as_ref().is_some_and(|l| l.protocol < 4);
        let remaining = self.deadline.saturating_duration_since(Instant::now());
        let params = AgentParams {
            message: self.message.clone(),
            agent_id: self.spec.agent_id.clone(),
            session_key: self.spec.session_key.to_string(),
            // The same key on every attempt: after a restart the gateway dedupes it (`in_flight`,
            // or the cached final) instead of starting the run twice.
            idempotency_key: self.spec.gateway_run_id.clone(),
            // Protocol 3 cannot abort an `agent` run, but it honours this bound (seconds): the run's
            // timeout then really stops the LLM stream on the gateway.
            timeout: if v3 { Some(remaining.as_secs().max(1) + u64::from(remaining.subsec_nanos() > 0)) } else { None },
            // Protocol 3 sends no trace id to the LLM; this line reaches every LLM call of the run.
            extra_system_prompt: if v3 { self.spec.attribution_token.as_deref().map(crate::run::attribution_prompt) } else { None },
            label: None,
        };
        let v = self.to_value(&params);
        // A child span of the caller's trace: same trace id (the attribution key), new span id.
        let span = uuid::Uuid::new_v4().simple().to_string();
        let traceparent = self.spec.traceparent.with_span(&span[..16]).unwrap_or_else(|_| self.spec.traceparent.clone());
        let mut call = Call::new(name::AGENT, v, TAG_AGENT, Some(ctx.address().recipient()));
        call.traceparent = Some(traceparent.to_string());
        // The run's own timeout bounds the wait for its final `res`, not the request timeout.
        call.wait = Wait::Caller;
        self.gateway.call.do_send(call);
    }

    /// Sends `chat.abort` for the gateway run (once).
    fn send_abort(&mut self, ctx: &mut Context<Self>) {
        if self.abort_sent {
            return;
        }
        self.abort_sent = true;
        let params = ChatAbortParams { session_key: self.spec.session_key.to_string(), run_id: Some(self.spec.gateway_run_id.clone()) };
        let v = self.to_value(&params);
        self.call(ctx, name::CHAT_ABORT, v, TAG_ABORT);
    }

    /// Asks the gateway how the run ends. `budget` is how long the gateway may wait: the run's
    /// remaining time (a generic request timeout would cut a long run's recovery short while it is
    /// still streaming), or the abort grace once the run is being cancelled.
    fn send_wait(&mut self, ctx: &mut Context<Self>, budget: Duration) {
        // Node's timers fire at once above 2^31-1 ms; runs never last that long (max 3600 s).
        let timeout_ms = u64::try_from(budget.as_millis()).unwrap_or(u64::MAX).min(i32::MAX as u64);
        let params = AgentWaitParams { run_id: self.spec.gateway_run_id.clone(), timeout_ms: Some(timeout_ms) };
        let v = self.to_value(&params);
        let mut call = Call::new(name::AGENT_WAIT, v, TAG_WAIT, Some(ctx.address().recipient()));
        // The gateway answers by `timeoutMs` at the latest; the slack covers the round trip.
        call.wait = Wait::Up(budget + self.cfg.request_timeout);
        self.gateway.call.do_send(call);
    }

    fn emit_status(&mut self, phase: Phase, tool: Option<String>) {
        let next = (phase, tool);
        if self.last_status.as_ref() == Some(&next) {
            return;
        }
        self.last_status = Some(next.clone());
        self.sink.emit(RunEvent::Status { phase: next.0, tool: next.1 });
    }

    fn push_text(&mut self, ctx: &mut Context<Self>, cumulative: &str, received: Instant) {
        let Some(delta) = self.tracker.push(cumulative) else { return };
        if self.tracker.emitted().len() > self.cfg.max_output_bytes {
            let message = format!("the run's output exceeded {} bytes; the gateway run was cancelled", self.cfg.max_output_bytes);
            tracing::warn!(run_id = %self.spec.run_id, "{message}");
            // The outcome's content is the text the run's clients were sent (the failed outcome
            // takes the tracker's text): not the delta that crossed the limit.
            let sent = self.tracker.emitted().len() - delta.len();
            self.tracker.forget_after(sent);
            return self.finish(ctx, RunOutcome::failed(ErrorCode::AgentError, message, String::new()));
        }
        self.sink.text_delta(delta, received);
    }

    fn accept(&mut self, gateway_run_id: String) {
        if !self.accepted {
            self.accepted = true;
            if let Some(stage) = self.start_clock.as_mut().and_then(|c| c.accepted(Instant::now())) {
                self.metrics.start_stage(stage);
            }
            self.sink.emit(RunEvent::Accepted { gateway_run_id });
            self.registry.release.do_send(Release { run_id: self.spec.run_id.clone(), lock: Lock::Start });
        }
    }

    /// The gateway run ended: ok runs with a branch publish first; everything else ends now.
    fn gateway_done(&mut self, ctx: &mut Context<Self>, outcome: RunOutcome) {
        self.gateway_ended = true;
        if outcome.status == RunStatus::Ok && self.cancelling.is_none() && self.spec.branch.is_some() {
            self.complete_text(&outcome.content);
            self.stop_gateway_side();
            return self.publish(ctx, outcome);
        }
        self.finish(ctx, outcome);
    }

    fn complete_text(&mut self, content: &str) {
        if let Some(rest) = self.tracker.complete(content) {
            self.sink.emit(RunEvent::TextDelta(rest));
        }
    }

    /// Unroutes and unsubscribes the run; cancels its gateway run if clawmux stops waiting for it
    /// before the gateway reported its end.
    fn stop_gateway_side(&mut self) {
        if self.agent_sent && !self.gateway_ended {
            if self.link.is_some() {
                if !self.abort_sent {
                    self.metrics.runs_abandoned.with_label_values(&["at_end"]).inc();
                    self.abort_sent = true;
                    let params = ChatAbortParams {
                        session_key: self.spec.session_key.to_string(),
                        run_id: Some(self.spec.gateway_run_id.clone()),
                    };
                    let v = self.to_value(&params);
                    self.gateway.call.do_send(Call::new(name::CHAT_ABORT, v, TAG_ABORT, None));
                }
            } else {
                self.gateway.abandon.do_send(Abandon {
                    session_key: self.spec.session_key.clone(),
                    gateway_run_id: self.spec.gateway_run_id.clone(),
                    boot_id: self.agent_boot_id.clone(),
                });
            }
            self.gateway_ended = true;
        }
        if self.subscribed && self.link.is_some() {
            // Fire and forget: the next run of this session may subscribe again right after.
            let v = self.to_value(&SessionKeyParams { key: self.spec.session_key.to_string() });
            self.gateway.call.do_send(Call::new(name::SESSIONS_UNSUBSCRIBE, v, 0, None));
            self.subscribed = false;
        }
        if self.routed {
            self.routed = false;
            self.gateway.remove_route.do_send(RemoveRoute {
                session_key: self.spec.session_key.clone(),
                gateway_run_id: self.spec.gateway_run_id.clone(),
            });
        }
        self.release_session();
    }

    /// Emits the terminal event once, frees everything the run holds, stops.
    fn finish(&mut self, ctx: &mut Context<Self>, mut outcome: RunOutcome) {
        if self.stage == Stage::Done {
            return;
        }
        self.stage = Stage::Done;
        if outcome.status == RunStatus::Ok {
            self.complete_text(&outcome.content);
        } else if outcome.content.is_empty() {
            outcome.content = self.tracker.emitted().to_owned();
        }
        tracing::info!(
            run_id = %self.spec.run_id,
            gateway_run_id = %self.spec.gateway_run_id,
            status = outcome.status.as_str(),
            code = outcome.error.as_ref().map(|e| e.code.as_str()).unwrap_or(""),
            "run finished"
        );
        self.ended = Some(outcome.status);
        self.sink.emit(RunEvent::Finished(outcome));
        self.stop_gateway_side();
        if self.workspace_busy {
            tracing::info!(run_id = %self.spec.run_id, "the run ended during a workspace step; its branch stays locked until the step is over");
            return;
        }
        self.leave(ctx);
    }

    /// Tells the registry the run is over (it frees every lock still held) and stops.
    fn leave(&mut self, ctx: &mut Context<Self>) {
        self.registry.ended.do_send(RunEnded { run_id: self.spec.run_id.clone(), status: self.ended });
        ctx.stop();
    }

    fn finish_from_final(&mut self, ctx: &mut Context<Self>, fin: AgentFinal) {
        self.gateway_ended = true;
        let content = fin.content();
        let usage = fin.usage_hint();
        let mut outcome = match (fin.status, self.cancelling) {
            (_, Some(reason)) if fin.status != FinalStatus::Ok || fin.is_abort() || fin.meta_aborted() => reason.outcome(content),
            (FinalStatus::Ok, None) if fin.meta_aborted() => {
                RunOutcome::failed(ErrorCode::Timeout, "the gateway stopped the run at its timeout", content)
            }
            (FinalStatus::Ok, _) => RunOutcome::ok(content, usage),
            // The real gateway reports a run aborted by someone else (e.g. while clawmux was away)
            // as `error` with `stopReason: "rpc"`.
            (FinalStatus::Error, _) if fin.stop_reason.as_deref() == Some("rpc") => {
                RunOutcome::failed(ErrorCode::Aborted, "the run was aborted on the gateway", content)
            }
            (FinalStatus::Error, _) => {
                let msg = fin.summary.clone().or_else(|| self.chat_error.clone()).unwrap_or_else(|| "the agent run failed".to_owned());
                RunOutcome::failed(ErrorCode::AgentError, clip(&msg), content)
            }
            (FinalStatus::Timeout, _) if fin.is_abort() => {
                RunOutcome::failed(ErrorCode::Aborted, "the run was aborted on the gateway", content)
            }
            (FinalStatus::Timeout, _) => RunOutcome::failed(ErrorCode::Timeout, "the gateway timed the run out", content),
        };
        if outcome.gateway_usage.is_none() {
            outcome.gateway_usage = usage;
        }
        self.gateway_done(ctx, outcome);
    }

    fn cancel(&mut self, ctx: &mut Context<Self>, reason: CancelReason) {
        if self.stage == Stage::Done || self.cancelling.is_some() {
            return;
        }
        if self.stage == Stage::Publishing && reason == CancelReason::Timeout {
            // The agent's work is done and ok; publishing has its own bounded retries.
            return;
        }
        self.cancelling = Some(reason);
        if self.link.as_ref().is_some_and(|l| l.protocol < 4) && matches!(self.stage, Stage::Running | Stage::Waiting) {
            // Protocol 3 cannot abort an `agent` run. Ending the run revokes its attribution: the
            // LLM proxy cuts its streams and refuses its further calls, so the gateway run fails at
            // its next LLM call (and a timeout is also enforced by the gateway's own `timeout`).
            self.send_abort(ctx);
            if self.spec.attribution_token.is_none() {
                tracing::warn!(run_id = %self.spec.run_id, "protocol 3 without the LLM proxy: the gateway run cannot be stopped, only abandoned");
            }
            self.gateway_ended = true;
            return self.finish(ctx, reason.outcome(String::new()));
        }
        match self.stage {
            Stage::Running | Stage::Waiting => {
                // Really stop the gateway run (the LLM stream closes); the final `res` (or the
                // pending `agent.wait`) then ends it.
                self.send_abort(ctx);
                ctx.run_later(self.cfg.abort_grace, move |act, ctx| {
                    if act.stage != Stage::Done {
                        tracing::warn!(run_id = %act.spec.run_id, "no final answer after abort; ending the run anyway");
                        act.finish(ctx, reason.outcome(String::new()));
                    }
                });
            }
            // Nothing runs on the gateway yet, the connection is down, or the relay publishes:
            // end now (a gateway run still going is cancelled by `finish`, now or after reconnect).
            _ => {
                let outcome = self.early_outcome(reason);
                self.finish(ctx, outcome)
            }
        }
    }

    /// The outcome of a run cancelled before it reached the gateway. A timeout there says what the
    /// run was waiting for: the caller sees that another run held it up, not a slow agent.
    fn early_outcome(&self, reason: CancelReason) -> RunOutcome {
        if reason != CancelReason::Timeout {
            return reason.outcome(String::new());
        }
        let waiting = match self.stage {
            Stage::Queued => "the run timed out queued behind an earlier run of its session".to_owned(),
            Stage::WaitingForBranch => {
                let branch = self.spec.branch.as_ref().map(|b| b.branch()).unwrap_or_default();
                format!("the run timed out waiting for branch {branch}, held by an earlier run")
            }
            Stage::Preparing => "the run timed out while its workspace was prepared".to_owned(),
            _ => return reason.outcome(String::new()),
        };
        RunOutcome::failed(ErrorCode::Timeout, waiting, String::new())
    }

    fn arm_recovery_deadline(&mut self, ctx: &mut Context<Self>) {
        let remaining = self.deadline.saturating_duration_since(Instant::now());
        if remaining <= self.cfg.recovery_window {
            // The run's own timeout comes first: it ends the run as `timeout` (and its gateway run
            // is cancelled once that gateway is back), never as a race between two timers.
            return;
        }
        let outage = self.outages;
        ctx.run_later(self.cfg.recovery_window, move |act, ctx| {
            if act.outages == outage && matches!(act.stage, Stage::Recovering | Stage::WaitingForGateway) && act.link.is_none() {
                act.finish(
                    ctx,
                    RunOutcome::failed(
                        ErrorCode::GatewayDisconnected,
                        "the gateway connection dropped and did not come back in time; the run could not be recovered",
                        String::new(),
                    ),
                );
            }
        });
    }

    fn on_reply(&mut self, ctx: &mut Context<Self>, tag: u64, result: Result<Box<serde_json::value::RawValue>, CallError>) {
        if matches!(self.stage, Stage::Done | Stage::Publishing) {
            return;
        }
        match (tag, result) {
            (_, Err(CallError::NotConnected | CallError::Disconnected)) => {
                // `Link(None)` drives recovery; nothing to do per call.
            }
            (TAG_PATCH, Ok(_)) if self.stage == Stage::Patching => {
                self.patched = true;
                self.after_setup(ctx);
            }
            (TAG_PATCH, Err(CallError::Gateway(e))) if self.stage == Stage::Patching => {
                if e.message.contains("outboundHeaders") && self.cfg.outbound_headers == OutboundHeadersMode::Auto {
                    self.gateway.headers_unsupported.do_send(OutboundHeadersUnsupported);
                    if let Some(l) = self.link.as_mut() {
                        l.outbound_headers = false;
                    }
                    self.begin(ctx);
                } else if e.is_retryable() && self.unavailable_retries < MAX_UNAVAILABLE_RETRIES {
                    self.retry_later(ctx, e.retry_after_ms);
                } else {
                    if e.is_missing_scope() {
                        self.gateway.scope_missing.do_send(ScopeMissing(e.clone()));
                    }
                    self.finish(ctx, RunOutcome::failed(ErrorCode::GatewayRejected, format!("sessions.patch: {}", clip(&e.message)), String::new()));
                }
            }
            (TAG_SUBSCRIBE, result) if self.stage == Stage::Patching && self.awaiting_subscribe => {
                if let Err(e) = result {
                    tracing::warn!(run_id = %self.spec.run_id, error = %describe(&e), "subscribe failed; the run's events may not arrive");
                }
                self.awaiting_subscribe = false;
                self.after_setup(ctx);
            }
            // A subscribe answered after its setup started over (a patch retried later) or after
            // `agent` went: nothing waits for it. Its error must not end the run.
            (TAG_SUBSCRIBE, _) => {}
            (TAG_AGENT, Ok(raw)) if self.stage == Stage::Running => self.on_agent_answer(ctx, raw.get()),
            (TAG_AGENT, Err(CallError::Gateway(e))) if self.stage == Stage::Running => {
                if e.is_missing_scope() {
                    self.gateway.scope_missing.do_send(ScopeMissing(e.clone()));
                }
                if !self.accepted && e.is_retryable() && self.unavailable_retries < MAX_UNAVAILABLE_RETRIES {
                    self.retry_later(ctx, e.retry_after_ms);
                } else if self.accepted {
                    self.gateway_ended = true;
                    self.finish(ctx, RunOutcome::failed(ErrorCode::AgentError, clip(&e.message), String::new()));
                } else {
                    // Refused: nothing runs on the gateway.
                    self.gateway_ended = true;
                    self.finish(ctx, RunOutcome::failed(ErrorCode::GatewayRejected, format!("agent: {}", clip(&e.message)), String::new()));
                }
            }
            (TAG_WAIT, Ok(raw)) if self.stage == Stage::Waiting => self.on_wait_answer(ctx, raw.get()),
            (TAG_WAIT, Err(CallError::TimedOut)) if self.stage == Stage::Waiting => {
                // Not even the run's own timeout (plus slack) brought an answer: give it up, and
                // cancel it on the gateway (`finish` sends `chat.abort`).
                let outcome = self.cancelling.unwrap_or(CancelReason::Timeout).outcome(String::new());
                self.finish(ctx, outcome);
            }
            (TAG_WAIT, Err(e)) if self.stage == Stage::Waiting => self.finish(
                ctx,
                RunOutcome::failed(ErrorCode::GatewayDisconnected, format!("recovery after reconnect failed: {}", describe(&e)), String::new()),
            ),
            (TAG_ABORT | TAG_RESUBSCRIBE, _) => {}
            (_, Err(CallError::TimedOut)) => self.finish(
                ctx,
                RunOutcome::failed(ErrorCode::GatewayDisconnected, "the gateway did not answer in time", String::new()),
            ),
            (_, Err(CallError::Malformed(m))) => self.finish(
                ctx,
                RunOutcome::failed(ErrorCode::GatewayProtocolError, format!("the gateway answered malformed: {}", clip(&m)), String::new()),
            ),
            (_, Err(e)) => self.finish(
                ctx,
                RunOutcome::failed(ErrorCode::GatewayRejected, format!("the gateway refused a request: {}", describe(&e)), String::new()),
            ),
            // A late answer for a stage already left (e.g. a patch answered after a reconnect).
            _ => {}
        }
    }

    /// An `ok` answer to the run's `agent` request: ACK, `in_flight` (a repeated key of a run the
    /// gateway is running: its final goes to the first request, so wait for it), or the final.
    fn on_agent_answer(&mut self, ctx: &mut Context<Self>, raw: &str) {
        let protocol_error = |msg: String| RunOutcome::failed(ErrorCode::GatewayProtocolError, msg, String::new());
        match decode_agent_reply(raw) {
            Ok(AgentReply::Ack(ack)) => {
                // The gateway names the session it put the run in: it must be the key clawmux
                // routes by, or the run's frames would never reach it (or reach another run).
                if let Some(key) = ack.session_key.as_deref().filter(|k| *k != self.spec.session_key.as_str()) {
                    let msg = format!(
                        "the gateway put the run in session {:?}, not {:?}; the run was cancelled",
                        clip(key),
                        self.spec.session_key.as_str()
                    );
                    return self.finish(ctx, protocol_error(msg));
                }
                if ack.run_id != self.spec.gateway_run_id {
                    let msg = format!("the gateway acknowledged run {:?} for run {:?}; the run was cancelled", clip(&ack.run_id), self.spec.gateway_run_id);
                    return self.finish(ctx, protocol_error(msg));
                }
                let in_flight = ack.status == "in_flight";
                self.accept(ack.run_id);
                if in_flight {
                    self.stage = Stage::Waiting;
                    let remaining = self.deadline.saturating_duration_since(Instant::now());
                    self.send_wait(ctx, remaining);
                }
            }
            Ok(AgentReply::Final(fin)) => {
                // Another run's result is not this run's answer (nor is any of its text).
                if fin.run_id != self.spec.gateway_run_id {
                    let msg = format!("the gateway answered the run's agent request with the result of run {:?}; the run was cancelled", clip(&fin.run_id));
                    return self.finish(ctx, protocol_error(msg));
                }
                // A cached final without ACK (repeated key): still report acceptance first.
                self.accept(fin.run_id.clone());
                self.finish_from_final(ctx, fin);
            }
            Err(e) => {
                let msg = format!("the gateway's answer to the run's agent request could not be understood ({}); the run was cancelled", clip(&e.to_string()));
                self.finish(ctx, protocol_error(msg));
            }
        }
    }

    /// The answer to the recovery `agent.wait`.
    fn on_wait_answer(&mut self, ctx: &mut Context<Self>, raw: &str) {
        let wait = serde_json::from_str::<AgentWaitResult>(raw).ok();
        if let Some(other) = wait.as_ref().and_then(|w| w.run_id.as_deref()).filter(|r| *r != self.spec.gateway_run_id) {
            // Another run's snapshot (and reply text) says nothing about this run.
            let msg = format!("the gateway answered the run's agent.wait with the state of run {:?}; the run was cancelled", clip(other));
            return self.finish(ctx, RunOutcome::failed(ErrorCode::GatewayProtocolError, msg, String::new()));
        }
        let Some(outcome) = wait.as_ref().and_then(AgentWaitResult::outcome) else {
            let msg = format!("the gateway's agent.wait answer could not be understood: {}", clip(raw));
            return self.finish(ctx, RunOutcome::failed(ErrorCode::GatewayProtocolError, msg, String::new()));
        };
        if outcome != WaitOutcome::NotEnded {
            self.gateway_ended = true;
            self.accept(self.spec.gateway_run_id.clone());
        }
        if let (Some(reason), false) = (self.cancelling, matches!(outcome, WaitOutcome::NotEnded | WaitOutcome::Ok(_))) {
            return self.finish(ctx, reason.outcome(String::new()));
        }
        match outcome {
            WaitOutcome::Ok(reply) => {
                // Events sent while the connection was down are lost; the gateway's final reply is
                // the answer. Keep the streamed text only when it is not a prefix of that (then it is
                // all clawmux can vouch for).
                let emitted = self.tracker.emitted();
                let content = reply.filter(|r| r.starts_with(emitted)).unwrap_or_else(|| emitted.to_owned());
                self.gateway_done(ctx, RunOutcome::ok(content, None))
            }
            WaitOutcome::Error(e) => self.finish(
                ctx,
                RunOutcome::failed(ErrorCode::AgentError, format!("the agent run failed (reported after a reconnect): {}", clip(&e)), String::new()),
            ),
            WaitOutcome::Aborted => {
                self.finish(ctx, RunOutcome::failed(ErrorCode::Aborted, "the run was aborted on the gateway", String::new()))
            }
            WaitOutcome::TimedOut => {
                self.finish(ctx, RunOutcome::failed(ErrorCode::Timeout, "the gateway timed the run out", String::new()))
            }
            // Still running (the wait expired) or still queued: wait again while the run has time;
            // past its deadline, cancel it and wait (at most the abort grace) for the gateway to
            // confirm its end. The abort grace timer ends it in any case.
            WaitOutcome::NotEnded => {
                if self.cancelling.is_none() && Instant::now() >= self.deadline {
                    self.cancel(ctx, CancelReason::Timeout);
                    if self.stage == Stage::Done {
                        return;
                    }
                }
                ctx.run_later(NOT_ENDED_RECHECK, |act, ctx| {
                    if act.stage == Stage::Waiting {
                        let budget = match act.cancelling {
                            Some(_) => act.cfg.abort_grace,
                            None => act.deadline.saturating_duration_since(Instant::now()),
                        };
                        act.send_wait(ctx, budget);
                    }
                });
            }
        }
    }

    fn retry_later(&mut self, ctx: &mut Context<Self>, retry_after_ms: Option<u64>) {
        self.unavailable_retries += 1;
        let delay = Duration::from_millis(retry_after_ms.unwrap_or(500).clamp(50, 10_000));
        tracing::info!(run_id = %self.spec.run_id, delay_ms = delay.as_millis() as u64, "gateway unavailable; retrying");
        if self.stage == Stage::Patching {
            // The setup starts over, its subscribe too: the one under way may be answered while
            // the run waits (its answer is then ignored) or may have failed.
            self.subscribed_on = None;
            self.awaiting_subscribe = false;
        }
        self.stage = Stage::WaitingForGateway;
        ctx.run_later(delay, |act, ctx| {
            if act.stage == Stage::WaitingForGateway && act.link.is_some() {
                act.begin(ctx);
            }
        });
    }

    fn on_event(&mut self, ctx: &mut Context<Self>, event: GatewayEvent, received: Instant) {
        if matches!(self.stage, Stage::Done | Stage::Publishing) {
            return;
        }
        match event {
            GatewayEvent::Chat(chat) => match chat.state {
                ChatState::Delta | ChatState::Final | ChatState::Aborted => {
                    if let Some(text) = chat.text() {
                        self.push_text(ctx, text, received);
                    }
                }
                ChatState::Error => {
                    self.chat_error = chat.error_message.clone().or(Some("the agent run failed".to_owned()));
                }
            },
            GatewayEvent::Agent(agent) => match agent.signal() {
                Some(AgentSignal::Lifecycle(p)) if p == "start" => self.emit_status(Phase::Thinking, None),
                Some(AgentSignal::ToolStart(tool)) => self.emit_status(Phase::ToolUse, Some(clip(&tool))),
                Some(AgentSignal::ToolEnd | AgentSignal::CompactionEnd) => self.emit_status(Phase::Thinking, None),
                Some(AgentSignal::CompactionStart) => self.emit_status(Phase::Compacting, None),
                _ => {}
            },
            _ => {}
        }
    }

    fn on_link_down(&mut self, ctx: &mut Context<Self>) {
        self.outages = self.outages.wrapping_add(1);
        match self.stage {
            Stage::Running | Stage::Waiting | Stage::Recovering => {
                if let Some(reason) = self.cancelling {
                    // Nothing more can be cancelled over a dead connection; end as asked (the
                    // gateway run is cancelled once that gateway is back).
                    self.finish(ctx, reason.outcome(String::new()));
                    return;
                }
                self.stage = Stage::Recovering;
                self.arm_recovery_deadline(ctx);
            }
            Stage::WaitingForGateway | Stage::Patching => {
                self.stage = Stage::WaitingForGateway;
                self.arm_recovery_deadline(ctx);
            }
            Stage::Queued | Stage::WaitingForBranch | Stage::Preparing | Stage::Publishing | Stage::Done => {}
        }
    }

    fn on_link_up(&mut self, ctx: &mut Context<Self>, link: GatewayUp) {
        match self.stage {
            Stage::WaitingForGateway => self.begin(ctx),
            Stage::Recovering => {
                if !crate::instance::still_there(self.agent_boot_id.as_deref(), link.boot_id.as_deref()) {
                    // The run died with the old gateway process: nothing to cancel, and nothing
                    // the new process could answer an `agent.wait` for.
                    self.gateway_ended = true;
                    self.finish(
                        ctx,
                        RunOutcome::failed(
                            ErrorCode::GatewayDisconnected,
                            "the gateway restarted mid-run and the run was lost with it",
                            String::new(),
                        ),
                    );
                    return;
                }
                if !self.accepted {
                    // Resumed after a restart of clawmux before the ACK was stored: send `agent`
                    // again with the same idempotency key; the gateway dedupes it.
                    return self.begin(ctx);
                }
                self.stage = Stage::Waiting;
                if link.session_scoped {
                    let v = self.to_value(&SessionKeyParams { key: self.spec.session_key.to_string() });
                    self.call(ctx, name::SESSIONS_SUBSCRIBE, v, TAG_RESUBSCRIBE);
                    self.subscribed = true;
                }
                let remaining = self.deadline.saturating_duration_since(Instant::now());
                self.send_wait(ctx, remaining);
            }
            _ => {}
        }
    }
}

impl Actor for SessionActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let remaining = self.deadline.saturating_duration_since(Instant::now());
        ctx.run_later(remaining, |act, ctx| act.cancel(ctx, CancelReason::Timeout));
    }
}

impl Handler<Turn> for SessionActor {
    type Result = ();
    fn handle(&mut self, msg: Turn, ctx: &mut Context<Self>) {
        self.on_turn(ctx, msg);
    }
}

impl Handler<Routed> for SessionActor {
    type Result = ();
    fn handle(&mut self, msg: Routed, ctx: &mut Context<Self>) {
        self.on_event(ctx, msg.0, msg.1);
    }
}

impl Handler<Reply> for SessionActor {
    type Result = ();
    fn handle(&mut self, msg: Reply, ctx: &mut Context<Self>) {
        self.on_reply(ctx, msg.tag, msg.result);
    }
}

impl Handler<CancelRun> for SessionActor {
    type Result = ();
    fn handle(&mut self, msg: CancelRun, ctx: &mut Context<Self>) {
        self.cancel(ctx, msg.0);
    }
}

impl Handler<Suspend> for SessionActor {
    type Result = ();
    fn handle(&mut self, _msg: Suspend, ctx: &mut Context<Self>) {
        if self.stage == Stage::Done {
            if self.workspace_busy {
                // Ended, waiting only for a workspace step: clawmux stops, the step with it.
                self.leave(ctx);
            }
            return;
        }
        // Handoff: the gateway run goes on; the store has the run's checkpoints and events, and the
        // next start of clawmux continues it. No terminal event, no abort.
        self.stage = Stage::Done;
        if self.routed {
            self.gateway.remove_route.do_send(RemoveRoute {
                session_key: self.spec.session_key.clone(),
                gateway_run_id: self.spec.gateway_run_id.clone(),
            });
        }
        self.registry.ended.do_send(RunEnded { run_id: self.spec.run_id.clone(), status: None });
        ctx.stop();
    }
}

impl Handler<Link> for SessionActor {
    type Result = ();
    fn handle(&mut self, msg: Link, ctx: &mut Context<Self>) {
        if self.stage == Stage::Done {
            return;
        }
        let was_up = self.link.is_some();
        self.link = msg.0.clone();
        match msg.0 {
            Some(up) => self.on_link_up(ctx, up),
            None if was_up => self.on_link_down(ctx),
            // Down already: the outage under way keeps its recovery window.
            None => {}
        }
    }
}

/// A call failure in words (never a Rust debug dump in a run's error).
fn describe(e: &CallError) -> String {
    match e {
        CallError::Gateway(e) => format!("{} {}", e.code, clip(&e.message)),
        CallError::NotConnected => "the gateway connection is down".to_owned(),
        CallError::Disconnected => "the gateway connection dropped".to_owned(),
        CallError::TimedOut => "the gateway did not answer in time".to_owned(),
        CallError::Malformed(m) => format!("malformed answer: {}", clip(m)),
    }
}

#[cfg(test)]
mod tests;
