//! The session actor: one per run.
//!
//! ```text
//! sessions.patch (model) → [sessions.messages.subscribe] → agent (ACK … events … final res)
//!        → [sessions.messages.unsubscribe] → RunEnded
//! ```
//! It turns gateway frames into [`RunEvent`]s, treats the `agent` final `res` as the truth, enforces
//! the run's timeout, cancels the gateway run (`chat.abort`) on timeout, abort or client disconnect,
//! and survives a dropped connection: before `agent` was sent it simply starts over once the
//! connection is back; after, it re-subscribes and asks `agent.wait` for the run's end, unless the
//! gateway restarted (new boot id) or does not come back within the recovery window, in which case
//! the run ends with `gateway_disconnected`. It never hangs: every wait has a deadline.

use crate::delta::DeltaTracker;
use crate::run::{CancelReason, ErrorCode, Phase, RunEvent, RunOutcome, RunSink, RunSpec};
use crate::limits::clip;
use crate::supervisor::{
    Abandoned, Call, CallError, OutboundHeadersUnsupported, Reply, RunEnded, Supervisor, SupervisorConfig, Wait,
};
use actix::prelude::*;
use clawmux_protocol::events::AgentSignal;
use clawmux_protocol::methods::{
    decode_agent_reply, name, AgentParams, AgentReply, AgentWaitParams, AgentWaitResult, ChatAbortParams, FinalStatus,
    SessionKeyParams, SessionsPatchParams, WaitOutcome,
};
use clawmux_protocol::{ChatState, GatewayEvent};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A `chat`/`agent` event whose `(sessionKey, runId)` is this run's, with the moment its frame
/// arrived (to measure clawmux's added latency).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Routed(pub GatewayEvent, pub Instant);

/// The gateway connection dropped.
#[derive(Message)]
#[rtype(result = "()")]
pub struct GatewayDown;

/// The gateway connection is (back) up.
#[derive(Message, Clone, Debug)]
#[rtype(result = "()")]
pub struct GatewayUp {
    /// Negotiated protocol.
    pub protocol: u32,
    /// Boot id of the gateway process, when it reports one.
    pub boot_id: Option<String>,
    /// Events arrive only for subscribed sessions.
    pub session_scoped: bool,
    /// Send per-session outbound headers.
    pub outbound_headers: bool,
}

/// Cancel the run.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Cancel(pub CancelReason);

/// Where the run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Waiting for a connection before anything was sent.
    WaitingForGateway,
    /// `sessions.patch` sent.
    Patching,
    /// `sessions.messages.subscribe` sent.
    Subscribing,
    /// `agent` sent; waiting for ACK or final.
    Running,
    /// The connection dropped after `agent` was sent; waiting for it to come back.
    Recovering,
    /// Reconnected; `agent.wait` sent.
    Waiting,
    /// Terminal event emitted.
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

/// How long to wait before asking `agent.wait` again when the gateway says the run is still
/// queued (it answers `pending` at once, without waiting).
const PENDING_RECHECK: Duration = Duration::from_secs(1);

/// One run.
pub struct SessionActor {
    spec: RunSpec,
    sink: Arc<dyn RunSink>,
    supervisor: Addr<Supervisor>,
    cfg: SupervisorConfig,
    link: Option<GatewayUp>,
    stage: Stage,
    /// When the run's timeout fires (queue time already deducted).
    deadline: Instant,
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
    subscribed: bool,
    /// `agent` was sent: from here on the gateway may be running the run.
    agent_sent: bool,
    /// The gateway reported the run's end (final `res` or a terminal `agent.wait`).
    gateway_ended: bool,
    /// `chat.abort` was sent for the run.
    abort_sent: bool,
    metrics: crate::metrics::Metrics,
}

impl SessionActor {
    /// A session actor; `link` is the connection as it is now (`None` when down), `remaining` the
    /// time left of the run's timeout.
    pub fn new(
        spec: RunSpec,
        sink: Arc<dyn RunSink>,
        supervisor: Addr<Supervisor>,
        cfg: SupervisorConfig,
        link: Option<GatewayUp>,
        remaining: Duration,
        metrics: crate::metrics::Metrics,
    ) -> Self {
        Self {
            spec,
            sink,
            supervisor,
            cfg,
            link,
            stage: Stage::WaitingForGateway,
            deadline: Instant::now() + remaining,
            agent_boot_id: None,
            accepted: false,
            tracker: DeltaTracker::new(),
            last_status: None,
            cancelling: None,
            chat_error: None,
            unavailable_retries: 0,
            subscribed: false,
            agent_sent: false,
            gateway_ended: false,
            abort_sent: false,
            metrics,
        }
    }

    fn call(&self, ctx: &mut Context<Self>, method: &'static str, params: serde_json::Value, tag: u64) {
        self.supervisor.do_send(Call::new(method, params, tag, Some(ctx.address().recipient())));
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

    /// Asks the gateway how the run ends, waiting as long as the run may still run: the generic
    /// request timeout would cut a long run's recovery short while it is still streaming.
    /// `budget` is how long the gateway may wait: the run's remaining time, or the abort grace
    /// once the run is being cancelled.
    fn send_wait(&mut self, ctx: &mut Context<Self>, budget: Duration) {
        // Node's timers fire at once above 2^31-1 ms; runs never last that long (max 3600 s).
        let timeout_ms = u64::try_from(budget.as_millis()).unwrap_or(u64::MAX).min(i32::MAX as u64);
        let params = AgentWaitParams { run_id: self.spec.gateway_run_id.clone(), timeout_ms: Some(timeout_ms) };
        let v = self.to_value(&params);
        let mut call = Call::new(name::AGENT_WAIT, v, TAG_WAIT, Some(ctx.address().recipient()));
        // The gateway answers by `timeoutMs` at the latest; the slack covers the round trip.
        call.wait = Wait::Up(budget + self.cfg.request_timeout);
        self.supervisor.do_send(call);
    }

    fn to_value<T: serde::Serialize>(&self, v: &T) -> serde_json::Value {
        serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
    }

    fn begin(&mut self, ctx: &mut Context<Self>) {
        let Some(link) = self.link.clone() else {
            self.stage = Stage::WaitingForGateway;
            self.arm_recovery_deadline(ctx);
            return;
        };
        self.stage = Stage::Patching;
        let outbound_headers = if link.outbound_headers { Some(self.billing_headers()) } else { None };
        let params = SessionsPatchParams { key: self.spec.session_key.to_string(), model: self.spec.model.clone(), outbound_headers };
        let v = self.to_value(&params);
        self.call(ctx, name::SESSIONS_PATCH, v, TAG_PATCH);
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

    fn after_patch(&mut self, ctx: &mut Context<Self>) {
        if self.link.as_ref().is_some_and(|l| l.session_scoped) {
            self.stage = Stage::Subscribing;
            let v = self.to_value(&SessionKeyParams { key: self.spec.session_key.to_string() });
            self.call(ctx, name::SESSIONS_SUBSCRIBE, v, TAG_SUBSCRIBE);
        } else {
            self.send_agent(ctx);
        }
    }

    fn send_agent(&mut self, ctx: &mut Context<Self>) {
        self.stage = Stage::Running;
        self.agent_sent = true;
        self.agent_boot_id = self.link.as_ref().and_then(|l| l.boot_id.clone());
        let v3 = self.link.as_ref().is_some_and(|l| l.protocol < 4);
        let remaining = self.deadline.saturating_duration_since(Instant::now());
        let params = AgentParams {
            message: self.spec.message.clone(),
            agent_id: self.spec.agent_id.clone(),
            session_key: self.spec.session_key.to_string(),
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
        self.supervisor.do_send(call);
    }

    fn emit_status(&mut self, phase: Phase, tool: Option<String>) {
        let next = (phase, tool);
        if self.last_status.as_ref() == Some(&next) {
            return;
        }
        self.last_status = Some(next.clone());
        self.sink.emit(RunEvent::Status { phase: next.0, tool: next.1 });
    }

    fn push_text(&mut self, cumulative: &str, received: Instant) {
        if let Some(delta) = self.tracker.push(cumulative) {
            self.sink.emit(RunEvent::TextDelta(delta));
            self.metrics.frame_to_client.observe(received.elapsed().as_secs_f64());
        }
    }

    /// Emits the terminal event once, releases the session, stops.
    fn finish(&mut self, ctx: &mut Context<Self>, mut outcome: RunOutcome) {
        if self.stage == Stage::Done {
            return;
        }
        self.stage = Stage::Done;
        if outcome.status == crate::run::RunStatus::Ok {
            if let Some(rest) = self.tracker.complete(&outcome.content) {
                self.sink.emit(RunEvent::TextDelta(rest));
            }
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
        let status = outcome.status;
        self.sink.emit(RunEvent::Finished(outcome));
        // A run clawmux stops waiting for must not go on with no owner on the gateway.
        let mut abandoned = None;
        if self.agent_sent && !self.gateway_ended {
            if self.link.is_some() {
                if !self.abort_sent {
                    self.metrics.runs_abandoned.with_label_values(&["at_end"]).inc();
                }
                self.send_abort(ctx);
            } else {
                abandoned = Some(Abandoned { boot_id: self.agent_boot_id.clone() });
            }
        }
        if self.subscribed && self.link.is_some() {
            // Fire and forget: the next run of this session may subscribe again right after.
            let v = self.to_value(&SessionKeyParams { key: self.spec.session_key.to_string() });
            self.supervisor.do_send(Call::new(name::SESSIONS_UNSUBSCRIBE, v, 0, None));
        }
        self.supervisor.do_send(RunEnded {
            run_id: self.spec.run_id.clone(),
            session_key: self.spec.session_key.clone(),
            gateway_run_id: self.spec.gateway_run_id.clone(),
            status,
            abandoned,
        });
        ctx.stop();
    }

    fn finish_from_final(&mut self, ctx: &mut Context<Self>, fin: clawmux_protocol::methods::AgentFinal) {
        self.gateway_ended = true;
        let content = fin.content();
        let usage = fin.usage_hint();
        let outcome = match (fin.status, self.cancelling) {
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
        let mut outcome = outcome;
        if outcome.gateway_usage.is_none() {
            outcome.gateway_usage = usage;
        }
        self.finish(ctx, outcome);
    }

    fn cancel(&mut self, ctx: &mut Context<Self>, reason: CancelReason) {
        if self.stage == Stage::Done || self.cancelling.is_some() {
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
            self.finish(ctx, reason.outcome(String::new()));
            return;
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
            // Nothing runs on the gateway yet (or the connection is down): end now.
            _ => self.finish(ctx, reason.outcome(String::new())),
        }
    }

    fn arm_recovery_deadline(&mut self, ctx: &mut Context<Self>) {
        let wait = self.cfg.recovery_window.min(self.deadline.saturating_duration_since(Instant::now()));
        ctx.run_later(wait, |act, ctx| {
            if matches!(act.stage, Stage::Recovering | Stage::WaitingForGateway) {
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
        if self.stage == Stage::Done {
            return;
        }
        match (tag, result) {
            (_, Err(CallError::NotConnected | CallError::Disconnected)) => {
                // GatewayDown (sent by the supervisor) drives recovery; nothing to do per call.
            }
            (TAG_PATCH, Ok(_)) if self.stage == Stage::Patching => self.after_patch(ctx),
            (TAG_PATCH, Err(CallError::Gateway(e))) if self.stage == Stage::Patching => {
                if e.message.contains("outboundHeaders") && self.cfg.outbound_headers == crate::supervisor::OutboundHeadersMode::Auto {
                    self.supervisor.do_send(OutboundHeadersUnsupported);
                    if let Some(l) = self.link.as_mut() {
                        l.outbound_headers = false;
                    }
                    self.begin(ctx);
                } else if e.is_retryable() && self.unavailable_retries < MAX_UNAVAILABLE_RETRIES {
                    self.retry_later(ctx, e.retry_after_ms);
                } else {
                    if e.is_missing_scope() {
                        self.supervisor.do_send(crate::supervisor::ScopeMissing(e.clone()));
                    }
                    self.finish(ctx, RunOutcome::failed(ErrorCode::GatewayRejected, format!("sessions.patch: {}", clip(&e.message)), String::new()));
                }
            }
            (TAG_SUBSCRIBE, result) if self.stage == Stage::Subscribing => {
                match result {
                    Ok(_) => self.subscribed = true,
                    Err(e) => tracing::warn!(run_id = %self.spec.run_id, error = ?e, "subscribe failed; the run's events may not arrive"),
                }
                self.send_agent(ctx);
            }
            (TAG_AGENT, Ok(raw)) if self.stage == Stage::Running => match decode_agent_reply(raw.get()) {
                Ok(AgentReply::Ack(ack)) => {
                    // The gateway names the session it put the run in: it must be the key clawmux
                    // routes by, or the run's frames would never reach it (or reach another run).
                    if let Some(key) = ack.session_key.as_deref().filter(|k| *k != self.spec.session_key.as_str()) {
                        let msg = format!(
                            "the gateway put the run in session {:?}, not {:?}; the run was cancelled",
                            clip(key),
                            self.spec.session_key.as_str()
                        );
                        return self.finish(ctx, RunOutcome::failed(ErrorCode::GatewayProtocolError, msg, String::new()));
                    }
                    if ack.run_id != self.spec.gateway_run_id {
                        let msg = format!("the gateway acknowledged run {:?} for run {:?}; the run was cancelled", clip(&ack.run_id), self.spec.gateway_run_id);
                        return self.finish(ctx, RunOutcome::failed(ErrorCode::GatewayProtocolError, msg, String::new()));
                    }
                    if !self.accepted {
                        self.accepted = true;
                        self.sink.emit(RunEvent::Accepted { gateway_run_id: ack.run_id });
                    }
                }
                Ok(AgentReply::Final(fin)) => {
                    if !self.accepted {
                        // A cached final without ACK (repeated key): still report acceptance first.
                        self.accepted = true;
                        self.sink.emit(RunEvent::Accepted { gateway_run_id: fin.run_id.clone() });
                    }
                    self.finish_from_final(ctx, fin);
                }
                Err(e) => self.finish(
                    ctx,
                    RunOutcome::failed(
                        ErrorCode::GatewayProtocolError,
                        format!("the gateway's answer to the run's agent request could not be understood ({}); the run was cancelled", clip(&e.to_string())),
                        String::new(),
                    ),
                ),
            },
            (TAG_AGENT, Err(CallError::Gateway(e))) if self.stage == Stage::Running => {
                if e.is_missing_scope() {
                    self.supervisor.do_send(crate::supervisor::ScopeMissing(e.clone()));
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
                // cancel it on the gateway (finish sends `chat.abort`).
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

    /// The answer to the recovery `agent.wait`.
    fn on_wait_answer(&mut self, ctx: &mut Context<Self>, raw: &str) {
        let Some(outcome) = serde_json::from_str::<AgentWaitResult>(raw).ok().and_then(|w| w.outcome()) else {
            let msg = format!("the gateway's agent.wait answer could not be understood: {}", clip(raw));
            return self.finish(ctx, RunOutcome::failed(ErrorCode::GatewayProtocolError, msg, String::new()));
        };
        if outcome != WaitOutcome::NotEnded {
            self.gateway_ended = true;
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
                self.finish(ctx, RunOutcome::ok(content, None))
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
                let budget = match self.cancelling {
                    Some(_) => self.cfg.abort_grace,
                    None => self.deadline.saturating_duration_since(Instant::now()),
                };
                let queued = serde_json::from_str::<AgentWaitResult>(raw).is_ok_and(|w| w.status == "pending");
                if queued {
                    ctx.run_later(PENDING_RECHECK, move |act, ctx| {
                        if act.stage == Stage::Waiting {
                            act.send_wait(ctx, budget);
                        }
                    });
                } else {
                    self.send_wait(ctx, budget);
                }
            }
        }
    }

    fn retry_later(&mut self, ctx: &mut Context<Self>, retry_after_ms: Option<u64>) {
        self.unavailable_retries += 1;
        let delay = Duration::from_millis(retry_after_ms.unwrap_or(500).clamp(50, 10_000));
        tracing::info!(run_id = %self.spec.run_id, delay_ms = delay.as_millis() as u64, "gateway unavailable; retrying");
        self.stage = Stage::WaitingForGateway;
        ctx.run_later(delay, |act, ctx| {
            if act.stage == Stage::WaitingForGateway {
                act.begin(ctx);
            }
        });
    }

    fn on_event(&mut self, event: GatewayEvent, received: Instant) {
        if self.stage == Stage::Done {
            return;
        }
        match event {
            GatewayEvent::Chat(chat) => match chat.state {
                ChatState::Delta | ChatState::Final | ChatState::Aborted => {
                    if let Some(text) = chat.text() {
                        self.push_text(&text, received);
                    }
                }
                ChatState::Error => {
                    self.chat_error = chat.error_message.clone().or(Some("the agent run failed".to_owned()));
                }
            },
            GatewayEvent::Agent(agent) => match agent.signal() {
                Some(AgentSignal::Lifecycle(p)) if p == "start" => self.emit_status(Phase::Thinking, None),
                Some(AgentSignal::ToolStart(tool)) => self.emit_status(Phase::ToolUse, Some(tool)),
                Some(AgentSignal::ToolEnd | AgentSignal::CompactionEnd) => self.emit_status(Phase::Thinking, None),
                Some(AgentSignal::CompactionStart) => self.emit_status(Phase::Compacting, None),
                _ => {}
            },
            _ => {}
        }
    }
}

impl Actor for SessionActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let remaining = self.deadline.saturating_duration_since(Instant::now());
        ctx.run_later(remaining, |act, ctx| act.cancel(ctx, CancelReason::Timeout));
        self.begin(ctx);
    }
}

impl Handler<Routed> for SessionActor {
    type Result = ();
    fn handle(&mut self, msg: Routed, _ctx: &mut Context<Self>) {
        self.on_event(msg.0, msg.1);
    }
}

impl Handler<Reply> for SessionActor {
    type Result = ();
    fn handle(&mut self, msg: Reply, ctx: &mut Context<Self>) {
        self.on_reply(ctx, msg.tag, msg.result);
    }
}

impl Handler<Cancel> for SessionActor {
    type Result = ();
    fn handle(&mut self, msg: Cancel, ctx: &mut Context<Self>) {
        self.cancel(ctx, msg.0);
    }
}

impl Handler<GatewayDown> for SessionActor {
    type Result = ();
    fn handle(&mut self, _msg: GatewayDown, ctx: &mut Context<Self>) {
        self.link = None;
        match self.stage {
            Stage::Done => {}
            Stage::Running | Stage::Waiting | Stage::Recovering => {
                if let Some(reason) = self.cancelling {
                    // Nothing more can be cancelled over a dead connection; end as asked.
                    self.finish(ctx, reason.outcome(String::new()));
                    return;
                }
                self.stage = Stage::Recovering;
                self.arm_recovery_deadline(ctx);
            }
            Stage::WaitingForGateway | Stage::Patching | Stage::Subscribing => {
                self.stage = Stage::WaitingForGateway;
                self.arm_recovery_deadline(ctx);
            }
        }
    }
}

impl Handler<GatewayUp> for SessionActor {
    type Result = ();
    fn handle(&mut self, msg: GatewayUp, ctx: &mut Context<Self>) {
        self.link = Some(msg.clone());
        match self.stage {
            Stage::WaitingForGateway => self.begin(ctx),
            Stage::Recovering => {
                if let (Some(before), Some(now)) = (&self.agent_boot_id, &msg.boot_id) {
                    if before != now {
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
                }
                self.stage = Stage::Waiting;
                if msg.session_scoped {
                    let v = self.to_value(&SessionKeyParams { key: self.spec.session_key.to_string() });
                    self.call(ctx, name::SESSIONS_SUBSCRIBE, v, TAG_RESUBSCRIBE);
                }
                let remaining = self.deadline.saturating_duration_since(Instant::now());
                self.send_wait(ctx, remaining);
            }
            _ => {}
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
