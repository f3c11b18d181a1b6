//! The registry: the one place that knows which runs are live.
//!
//! It admits runs (capacity, duplicates, readiness, shutdown), creates each run's session actor,
//! and holds the locks runs take in turn: first the session key (runs of one session never
//! interleave, FIFO by admission), then the branch key (one run works on and publishes a branch at a
//! time). Taking them always in that order makes a deadlock impossible. It relays the gateway
//! connection's state to every live run, delivers cancels, and at shutdown hands runs off or cancels
//! them. The session actor owns everything else about a run (its timeout included) and reports its
//! end here.

use crate::branch::Workspace;
use crate::messages::{
    AdmitError, Admitted, IfBusy, Cancel, CancelRun, Drain, GatewayPort, GatewayUp, InFlight, Link, Lock, RegistryPort, Release, RunEnded,
    ShutdownMode, Submit, Suspend, Turn, HandOff,
};
use crate::metrics::Metrics;
use crate::queue::KeyQueue;
use crate::run::ResumeStage;
use crate::session::{SessionActor, SessionConfig};
use crate::supervisor::StatusHandle;
use actix::prelude::*;
use clawmux_protocol::SessionKey;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// Registry settings.
#[derive(Debug, Clone)]
pub struct RegistryConfig {
    /// Live runs (queued included) above which new runs are refused with 503.
    pub max_runs: usize,
    /// What each session actor gets.
    pub session: SessionConfig,
}

/// Whether a run holds a lock or waits for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    /// Not needed (yet, or any more).
    None,
    /// In the lock's queue.
    Waiting,
    /// Held.
    Held,
}

struct LiveRun {
    addr: Addr<SessionActor>,
    /// Its agent: the `agent` label of the run's metrics when it ends.
    agent_id: String,
    session_key: SessionKey,
    branch_key: Option<String>,
    admitted: Instant,
    session: Hold,
    branch: Hold,
}

/// The registry actor. Start it once, in `main`, after the supervisor.
pub struct Registry {
    cfg: RegistryConfig,
    metrics: Metrics,
    status: StatusHandle,
    gateway: GatewayPort,
    workspace: Option<Arc<dyn Workspace>>,
    /// The connection as the supervisor last reported it (new runs start with it).
    link: Option<GatewayUp>,
    live: HashMap<String, LiveRun>,
    sessions: KeyQueue<SessionKey, String>,
    branches: KeyQueue<String, String>,
    /// Set at shutdown: nothing new is admitted.
    draining: Option<ShutdownMode>,
}

impl Registry {
    /// A registry whose runs talk to `gateway` (the supervisor's port) and, for branch runs, to
    /// `workspace` (the git relay).
    pub fn new(
        cfg: RegistryConfig,
        metrics: Metrics,
        status: StatusHandle,
        gateway: GatewayPort,
        workspace: Option<Arc<dyn Workspace>>,
    ) -> Self {
        Self {
            cfg,
            metrics,
            status,
            gateway,
            workspace,
            link: None,
            live: HashMap::new(),
            sessions: KeyQueue::new(),
            branches: KeyQueue::new(),
            draining: None,
        }
    }

    fn port(ctx: &Context<Self>) -> RegistryPort {
        RegistryPort { release: ctx.address().recipient(), ended: ctx.address().recipient() }
    }

    /// Queues `run_id` for its session key; it proceeds at once when the key is free.
    fn acquire_session(&mut self, run_id: &str) {
        let Some(run) = self.live.get_mut(run_id) else { return };
        let key = run.session_key.clone();
        if self.sessions.admit(&key, run_id.to_owned()).is_some() {
            run.session = Hold::Held;
            self.after_session(run_id);
        } else {
            run.session = Hold::Waiting;
            tracing::info!(run_id = %run_id, session_key = %key, "run queued behind another run of its session");
        }
    }

    /// The run holds its session key: on to its branch key, or go.
    fn after_session(&mut self, run_id: &str) {
        let Some(run) = self.live.get_mut(run_id) else { return };
        let Some(branch) = run.branch_key.clone() else {
            run.addr.do_send(Turn::Go);
            return;
        };
        if self.branches.admit(&branch, run_id.to_owned()).is_some() {
            run.branch = Hold::Held;
            run.addr.do_send(Turn::Go);
        } else {
            run.branch = Hold::Waiting;
            run.addr.do_send(Turn::WaitingForBranch);
        }
    }

    /// Frees `lock` of `run_id` (held or waited for) and hands it to the next run in line.
    fn free(&mut self, run_id: &str, lock: Lock) {
        let Some(run) = self.live.get_mut(run_id) else { return };
        match lock {
            Lock::Session => {
                let key = run.session_key.clone();
                match std::mem::replace(&mut run.session, Hold::None) {
                    Hold::None => {}
                    Hold::Waiting => {
                        self.sessions.remove_waiting(&key, |id| id == run_id);
                    }
                    Hold::Held => self.grant_next_session(&key),
                }
            }
            Lock::Branch => {
                let Some(key) = run.branch_key.clone() else { return };
                match std::mem::replace(&mut run.branch, Hold::None) {
                    Hold::None => {}
                    Hold::Waiting => {
                        self.branches.remove_waiting(&key, |id| id == run_id);
                    }
                    Hold::Held => self.grant_next_branch(&key),
                }
            }
        }
    }

    fn grant_next_session(&mut self, key: &SessionKey) {
        // Runs that left the queue without telling (never: RunEnded removes them) are skipped.
        while let Some(next) = self.sessions.finish(key) {
            if let Some(run) = self.live.get_mut(&next) {
                run.session = Hold::Held;
                self.after_session(&next);
                return;
            }
        }
    }

    fn grant_next_branch(&mut self, key: &str) {
        while let Some(next) = self.branches.finish(&key.to_owned()) {
            if let Some(run) = self.live.get_mut(&next) {
                run.branch = Hold::Held;
                run.addr.do_send(Turn::Go);
                return;
            }
        }
    }

    fn update_gauges(&self) {
        self.metrics.runs_active.set(self.live.len() as i64);
        self.metrics.runs_queued.set(self.sessions.waiting_len() as i64);
    }
}

impl Actor for Registry {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        // Admission answers come from here; a full mailbox makes HTTP answer 503 instead of queueing
        // without bound.
        ctx.set_mailbox_capacity(4096);
    }
}

impl Handler<Submit> for Registry {
    type Result = Result<Admitted, AdmitError>;
    fn handle(&mut self, msg: Submit, ctx: &mut Context<Self>) -> Self::Result {
        if self.draining.is_some() {
            return Err(AdmitError::ShuttingDown);
        }
        if self.live.len() >= self.cfg.max_runs {
            return Err(AdmitError::AtCapacity(self.cfg.max_runs));
        }
        if self.live.contains_key(&msg.spec.run_id) {
            return Err(AdmitError::Duplicate);
        }
        if msg.resume.is_none() {
            // Connected is not enough: without the scopes every write would fail (`/readyz` says
            // why). Resumed runs are exempt: they wait for the connection themselves.
            let ready = self.status.read().map(|s| s.ready()).unwrap_or_else(|p| p.into_inner().ready());
            if let Err(reason) = ready {
                return Err(AdmitError::GatewayDown(reason));
            }
        }
        if msg.if_busy == IfBusy::Reject && self.sessions.is_busy(&msg.spec.session_key) {
            return Err(AdmitError::SessionBusy);
        }
        let run_id = msg.spec.run_id.clone();
        let session_key = msg.spec.session_key.clone();
        let agent_id = msg.spec.agent_id.clone();
        let branch_key = msg.spec.branch.as_ref().map(|b| b.key.clone());
        let publishing = matches!(msg.resume.as_ref().map(|r| &r.stage), Some(ResumeStage::Publishing { .. }));
        let interrupt_key = session_key.clone();
        let actor = SessionActor::new(
            msg.spec,
            msg.sink,
            self.gateway.clone(),
            Self::port(ctx),
            self.workspace.clone(),
            self.cfg.session.clone(),
            self.metrics.clone(),
            self.link.clone(),
            msg.resume,
        );
        let addr = actor.start();
        self.live.insert(
            run_id.clone(),
            LiveRun { addr, agent_id, session_key, branch_key, admitted: Instant::now(), session: Hold::None, branch: Hold::None },
        );
        if publishing {
            // The gateway run is over: only the branch is needed, to publish.
            if let Some(run) = self.live.get_mut(&run_id) {
                run.session = Hold::None;
            }
            self.after_session(&run_id);
        } else if msg.if_busy == IfBusy::Interrupt && self.sessions.is_busy(&interrupt_key) {
            let session_key = interrupt_key;
            // The run holding the key ends `aborted`; this one goes right after it.
            let holder = self.live.iter().find(|(_, r)| r.session_key == session_key && r.session == Hold::Held).map(|(id, r)| (id.clone(), r.addr.clone()));
            if let Some((id, addr)) = holder {
                tracing::info!(run_id = %run_id, interrupted = %id, "interrupting the running run of the session (ifBusy: interrupt)");
                addr.do_send(CancelRun(crate::run::CancelReason::Interrupted));
            }
            if let Some(run) = self.live.get_mut(&run_id) {
                run.session = Hold::Waiting;
            }
            if self.sessions.admit_front(&session_key, run_id.clone()).is_some() {
                // The holder ended meanwhile: the key was free after all.
                if let Some(run) = self.live.get_mut(&run_id) {
                    run.session = Hold::Held;
                }
                self.after_session(&run_id);
            }
        } else {
            self.acquire_session(&run_id);
        }
        self.metrics.runs_admitted.inc();
        self.update_gauges();
        let queued = self.live.get(&run_id).is_some_and(|r| r.session == Hold::Waiting);
        Ok(if queued { Admitted::Queued } else { Admitted::Started })
    }
}

impl Handler<Cancel> for Registry {
    type Result = bool;
    fn handle(&mut self, msg: Cancel, _ctx: &mut Context<Self>) -> bool {
        match self.live.get(&msg.run_id) {
            Some(run) => {
                run.addr.do_send(CancelRun(msg.reason));
                true
            }
            None => false,
        }
    }
}

impl Handler<Release> for Registry {
    type Result = ();
    fn handle(&mut self, msg: Release, _ctx: &mut Context<Self>) {
        self.free(&msg.run_id, msg.lock);
        self.update_gauges();
    }
}

impl Handler<RunEnded> for Registry {
    type Result = ();
    fn handle(&mut self, msg: RunEnded, _ctx: &mut Context<Self>) {
        self.free(&msg.run_id, Lock::Session);
        self.free(&msg.run_id, Lock::Branch);
        if let Some(run) = self.live.remove(&msg.run_id) {
            if let Some(status) = msg.status {
                self.metrics.run_finished(&run.agent_id, status, run.admitted.elapsed().as_secs_f64());
            }
        }
        self.update_gauges();
    }
}

impl Handler<Link> for Registry {
    type Result = ();
    fn handle(&mut self, msg: Link, _ctx: &mut Context<Self>) {
        self.link = msg.0.clone();
        for run in self.live.values() {
            run.addr.do_send(msg.clone());
        }
    }
}

impl Handler<Drain> for Registry {
    type Result = usize;
    fn handle(&mut self, msg: Drain, _ctx: &mut Context<Self>) -> usize {
        self.draining = Some(msg.0);
        for run in self.live.values() {
            match msg.0 {
                ShutdownMode::Handoff => run.addr.do_send(Suspend),
                ShutdownMode::Cancel => run.addr.do_send(CancelRun(crate::run::CancelReason::Shutdown)),
            }
        }
        self.live.len()
    }
}

impl Handler<HandOff> for Registry {
    type Result = bool;
    fn handle(&mut self, msg: HandOff, _ctx: &mut Context<Self>) -> bool {
        match self.live.get(&msg.run_id) {
            Some(run) => {
                // As at a handoff shutdown: the session leaves its locks and reports `RunEnded`.
                run.addr.do_send(Suspend);
                true
            }
            None => false,
        }
    }
}

impl Handler<InFlight> for Registry {
    type Result = usize;
    fn handle(&mut self, _msg: InFlight, _ctx: &mut Context<Self>) -> usize {
        self.live.len()
    }
}

#[cfg(test)]
mod tests;
