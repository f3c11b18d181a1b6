//! The registry: the one place that knows which runs are live.
//!
//! It admits runs (capacity, duplicates, readiness, shutdown), creates each run's actor (a session
//! actor on the gateway connection, or the one an external runner makes: an ephemeral container's),
//! and holds the locks runs take in turn: first the session key (runs of one session never
//! interleave, FIFO by admission), then the branch key (one run works on and publishes a branch at a
//! time). Taking them always in that order makes a deadlock impossible. It relays the gateway
//! connection's state to every live run, delivers cancels, and at shutdown hands runs off or cancels
//! them. The run's actor owns everything else about it (its timeout included) and reports its end
//! here. One registry for both kinds of run: abort, client disconnect, shutdown and the capacity
//! limit work the same for each.

use crate::branch::Workspace;
use crate::messages::{
    AdmitError, Admitted, Cancel, CancelRun, Drain, ExternalRun, GatewayPort, GatewayUp, IfBusy, InFlight, Link, Lock, RegistryPort, Release,
    RunEnded, ShutdownMode, Submit, Suspend, Turn, HandOff,
};
use crate::metrics::Metrics;
use crate::queue::KeyQueue;
use crate::run::ResumeStage;
use crate::session::{SessionActor, SessionConfig};
use crate::supervisor::StatusHandle;
use actix::prelude::*;
use clawmux_protocol::SessionKey;
use actix::dev::ArbiterHandle;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// Registry settings.
#[derive(Debug, Clone)]
pub struct RegistryConfig {
    /// Live runs (queued included) above which new runs are refused with 503.
    pub max_runs: usize,
    /// New gateway runs between their turn and their `agent` ACK at once (0: no limit); more wait,
    /// FIFO, `queued` (see [`Lock::Start`]). Continued and branch runs do not wait for a slot.
    pub max_starting: usize,
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

/// The actor that runs a live run.
enum RunActor {
    /// A session actor on the gateway connection.
    Session(Addr<SessionActor>),
    /// A run outside the gateway (an ephemeral container).
    External(ExternalRun),
}

impl RunActor {
    fn turn(&self, turn: Turn) {
        match self {
            Self::Session(a) => a.do_send(turn),
            Self::External(e) => e.turn.do_send(turn),
        }
    }

    fn cancel(&self, reason: crate::run::CancelReason) {
        match self {
            Self::Session(a) => a.do_send(CancelRun(reason)),
            Self::External(e) => e.cancel.do_send(CancelRun(reason)),
        }
    }
}

struct LiveRun {
    actor: RunActor,
    /// Its agent: the `agent` label of the run's metrics when it ends.
    agent_id: String,
    session_key: SessionKey,
    branch_key: Option<String>,
    admitted: Instant,
    session: Hold,
    branch: Hold,
    /// Its start slot; only for runs that take one ([`LiveRun::gated`]).
    start: Hold,
    /// A new, branch-less gateway run: it takes a start slot before it goes.
    gated: bool,
    /// Told to suspend (a handoff, a takeover elsewhere): its actor leaves without acting on a
    /// cancel, so a cancel is not its to take (the caller records it for whoever continues it).
    suspending: bool,
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
    /// Runs holding a start slot.
    starting: usize,
    /// Runs waiting for one, in order.
    start_queue: std::collections::VecDeque<String>,
    /// Set at shutdown: nothing new is admitted.
    draining: Option<ShutdownMode>,
    /// The arbiters (threads) the session actors of runs that name none ([`Submit::shard`]: runs
    /// continued from the store) run on, by session key: their frames, deltas and store writes are
    /// then handled beside the supervisor's thread, not on it. Empty: on the registry's own
    /// arbiter (tests).
    shards: Vec<ArbiterHandle>,
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
            starting: 0,
            start_queue: std::collections::VecDeque::new(),
            draining: None,
            shards: Vec::new(),
        }
    }

    /// Starts session actors on these arbiters, a run's by its session key ([`shard_of`]).
    pub fn with_shards(mut self, shards: Vec<ArbiterHandle>) -> Self {
        self.shards = shards;
        self
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
            self.go(run_id);
            return;
        };
        if self.branches.admit(&branch, run_id.to_owned()).is_some() {
            run.branch = Hold::Held;
            run.actor.turn(Turn::Go);
        } else {
            run.branch = Hold::Waiting;
            run.actor.turn(Turn::WaitingForBranch);
        }
    }

    /// Gives the run its turn, or queues it for a start slot when it takes one and none is free.
    fn go(&mut self, run_id: &str) {
        let Some(run) = self.live.get_mut(run_id) else { return };
        if !run.gated || self.cfg.max_starting == 0 {
            run.actor.turn(Turn::Go);
        } else if self.starting < self.cfg.max_starting {
            self.starting += 1;
            run.start = Hold::Held;
            run.actor.turn(Turn::Go);
        } else {
            run.start = Hold::Waiting;
            self.start_queue.push_back(run_id.to_owned());
        }
    }

    fn grant_next_start(&mut self) {
        while self.starting < self.cfg.max_starting {
            let Some(next) = self.start_queue.pop_front() else { return };
            if let Some(run) = self.live.get_mut(&next) {
                if run.start == Hold::Waiting {
                    self.starting += 1;
                    run.start = Hold::Held;
                    run.actor.turn(Turn::Go);
                }
            }
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
            Lock::Start => match std::mem::replace(&mut run.start, Hold::None) {
                Hold::None => {}
                Hold::Waiting => self.start_queue.retain(|id| id != run_id),
                Hold::Held => {
                    self.starting -= 1;
                    self.grant_next_start();
                }
            },
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
                run.actor.turn(Turn::Go);
                return;
            }
        }
    }

    fn update_gauges(&self) {
        self.metrics.runs_active.set(self.live.len() as i64);
        self.metrics.runs_queued.set((self.sessions.waiting_len() + self.start_queue.len()) as i64);
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
        if msg.resume.is_none() && msg.external.is_none() {
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
        let gated = msg.external.is_none() && msg.resume.is_none() && branch_key.is_none();
        let interrupt_key = session_key.clone();
        let actor = match msg.external {
            Some(start) => RunActor::External(start(Self::port(ctx))),
            None => {
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
                RunActor::Session(match (msg.shard, shard_of(&session_key, self.shards.len())) {
                    (Some(shard), _) => SessionActor::start_in_arbiter(&shard, move |_| actor),
                    (None, Some(i)) => SessionActor::start_in_arbiter(&self.shards[i], move |_| actor),
                    (None, None) => actor.start(),
                })
            }
        };
        self.live.insert(
            run_id.clone(),
            LiveRun {
                actor,
                agent_id,
                session_key,
                branch_key,
                admitted: Instant::now(),
                session: Hold::None,
                branch: Hold::None,
                start: Hold::None,
                gated,
                suspending: false,
            },
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
            let holder = self.live.iter().find(|(_, r)| r.session_key == session_key && r.session == Hold::Held);
            if let Some((id, run)) = holder {
                tracing::info!(run_id = %run_id, interrupted = %id, "interrupting the running run of the session (ifBusy: interrupt)");
                run.actor.cancel(crate::run::CancelReason::Interrupted);
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
        let queued = self.live.get(&run_id).is_some_and(|r| r.session == Hold::Waiting || r.start == Hold::Waiting);
        Ok(if queued { Admitted::Queued } else { Admitted::Started })
    }
}

impl Handler<Cancel> for Registry {
    type Result = bool;
    fn handle(&mut self, msg: Cancel, _ctx: &mut Context<Self>) -> bool {
        match self.live.get(&msg.run_id) {
            Some(run) if !run.suspending => {
                run.actor.cancel(msg.reason);
                true
            }
            _ => false,
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
        self.free(&msg.run_id, Lock::Start);
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
            if let RunActor::Session(addr) = &run.actor {
                addr.do_send(msg.clone());
            }
        }
    }
}

impl Handler<Drain> for Registry {
    type Result = usize;
    fn handle(&mut self, msg: Drain, _ctx: &mut Context<Self>) -> usize {
        self.draining = Some(msg.0);
        for run in self.live.values_mut() {
            match (&run.actor, msg.0) {
                (RunActor::Session(addr), ShutdownMode::Handoff) => {
                    addr.do_send(Suspend);
                    run.suspending = true;
                }
                // A container cannot be handed to the next process: its run ends now in either mode.
                (actor, _) => actor.cancel(crate::run::CancelReason::Shutdown),
            }
        }
        self.live.len()
    }
}

impl Handler<HandOff> for Registry {
    type Result = bool;
    fn handle(&mut self, msg: HandOff, _ctx: &mut Context<Self>) -> bool {
        match self.live.get_mut(&msg.run_id) {
            Some(run) => {
                match &run.actor {
                    // As at a handoff shutdown: the session leaves its locks and reports `RunEnded`.
                    RunActor::Session(addr) => {
                        addr.do_send(Suspend);
                        run.suspending = true;
                    }
                    // A container cannot be taken over (nor continued elsewhere): it is removed.
                    external => external.cancel(crate::run::CancelReason::Shutdown),
                }
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

/// The shard (of `shards`) a session key's runs go to; `None` without shards. By key, so that
/// the runs of one session share a thread; stable within a process, which is all it needs (the
/// registry, not the shard, orders them).
pub fn shard_of(key: &SessionKey, shards: usize) -> Option<usize> {
    use std::hash::{Hash, Hasher};
    if shards == 0 {
        return None;
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.as_str().hash(&mut h);
    Some((h.finish() % shards as u64) as usize)
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod external_tests;
#[cfg(test)]
mod shard_tests;
#[cfg(test)]
mod start_tests;
