//! An ephemeral run's actor: registered in the registry like a gateway run's session actor, so
//! one place owns every live run (abort, client disconnect, shutdown, capacity, session-key order).
//!
//! ```text
//! admitted ─▶ waits for Turn::Go (its session key) ─▶ Ephemeral::run (slot, container) ─▶ events
//!          ─▶ RunEnded to the registry, stop
//! ```
//! A cancel before its turn ends it at once (nothing was started); after, it pulls the run's
//! switch and the execution removes the container. Its deadline runs from admission, so the wait
//! for its turn counts too. It reports its end exactly once.

use super::flow::{Ephemeral, Job, Switch};
use actix::prelude::*;
use clawmux_actors::messages::{CancelRun, ExternalRun, RegistryPort, RunEnded, Turn};
use clawmux_actors::{CancelReason, RunEvent, RunOutcome};
use std::sync::Arc;

/// One ephemeral run.
pub struct ContainerRun {
    eph: Arc<Ephemeral>,
    /// Until its turn; taken when the execution starts.
    job: Option<Job>,
    /// What its sink is (kept after the job is taken, to emit the end).
    sink: Arc<dyn clawmux_actors::RunSink>,
    run_id: String,
    switch: Arc<Switch>,
    port: RegistryPort,
    /// Set once the end is emitted and reported: a late cancel or timer does nothing.
    ended: bool,
}

impl ContainerRun {
    /// Starts the actor of `job`; the registry calls this at admission.
    pub fn start(eph: Arc<Ephemeral>, job: Job, port: RegistryPort) -> ExternalRun {
        let (sink, run_id) = (job.sink.clone(), job.spec.run_id.clone());
        let addr = Self { eph, job: Some(job), sink, run_id, switch: Arc::new(Switch::default()), port, ended: false }.start();
        ExternalRun { turn: addr.clone().recipient(), cancel: addr.recipient() }
    }

    fn end(&mut self, outcome: RunOutcome, text: Option<String>, ctx: &mut Context<Self>) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        if let Some(text) = text {
            self.sink.emit(RunEvent::TextDelta(text));
        }
        tracing::info!(run_id = %self.run_id, status = outcome.status.as_str(), error = ?outcome.error.as_ref().map(|e| &e.message), "ephemeral run ended");
        let status = outcome.status;
        self.sink.emit(RunEvent::Finished(outcome));
        self.port.ended.do_send(RunEnded { run_id: self.run_id.clone(), status: Some(status) });
        ctx.stop();
    }

    /// Ends a run that never started (cancelled or timed out while waiting for its turn).
    fn end_unstarted(&mut self, reason: CancelReason, ctx: &mut Context<Self>) {
        if self.job.take().is_some() {
            self.end(reason.outcome(String::new()), None, ctx);
        }
    }
}

impl Actor for ContainerRun {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        // Until its turn nothing watches the deadline but this; after, the execution does.
        if let Some(job) = &self.job {
            let left = job.deadline().saturating_duration_since(std::time::Instant::now());
            ctx.run_later(left, |act, ctx| act.end_unstarted(CancelReason::Timeout, ctx));
        }
    }
}

impl Handler<Turn> for ContainerRun {
    type Result = ();
    fn handle(&mut self, msg: Turn, ctx: &mut Context<Self>) {
        // Ephemeral runs have no branch: `WaitingForBranch` never comes.
        if msg != Turn::Go {
            return;
        }
        let Some(job) = self.job.take() else { return };
        let (eph, switch) = (self.eph.clone(), self.switch.clone());
        let run = async move { eph.run(&job, &switch).await };
        ctx.spawn(run.into_actor(self).map(|(outcome, text), act, ctx| act.end(outcome, text, ctx)));
    }
}

impl Handler<CancelRun> for ContainerRun {
    type Result = ();
    fn handle(&mut self, msg: CancelRun, ctx: &mut Context<Self>) {
        if self.job.is_some() {
            self.end_unstarted(msg.0, ctx);
        } else {
            // Running: the execution removes the container and returns with this reason.
            self.switch.cancel(msg.0);
        }
    }
}
