//! Cross-replica attribution: the LLM proxy of any replica sharing a PostgreSQL store forwards the
//! calls of ANY live run, so a gateway's provider can point at a load-balanced proxy address.
//!
//! ```text
//! call ── trace id / token ──▶ this process's registry (its own runs, and remote runs found before)
//!                                   │ miss
//!                                   ▼
//!                      the store: the UNFINISHED run with that trace id / token (one query per
//!                      burst; a miss is believed for MISS_TTL)        ──▶ none: refused (409)
//!                                   │ found                     a believed miss, store down: 503
//!                                   ▼
//!                      a remote run in the registry: forwarded with ITS billing headers, counted
//!                      in this process's share of its usage, until the run ends
//! ```
//! A remote run ends here when its terminal event is stored anywhere: told at once
//! (`clawmux_ended`), or found by the look every [`REVOKE_POLL`] (a notification lost while the
//! listener reconnected): its streams in flight are cut and its calls refused, as on its owner.
//! Its end is remembered for a while ([`crate::attribution::ENDED_TTL`]): a lookup that read the
//! run just before its end does not add it back. A replica that has not heard from the store for
//! [`HEARD_WITHIN`] (cut from the database, it could not hear an end) answers remote runs' calls
//! `503` until it does. A takeover here adopts the remote run as this
//! process's own (same counters).

pub mod cache;
#[cfg(test)]
pub(crate) mod tests;

use crate::attribution::{Attributions, RunBilling};
use crate::store::{AbortReason, CallKey, LiveRun, RunStore, StoreError};
use crate::tenants::budget::Budgets;
use dashmap::DashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a trace id or token the store did not know is not looked up again. Short: a run
/// admitted just after its trace id was probed has its calls answered `503` (retried by the
/// gateway) at most this long.
pub const MISS_TTL: Duration = Duration::from_secs(1);

/// The most misses remembered (calls with made-up trace ids cannot grow memory).
pub const MAX_MISSES: usize = 10_000;

/// How often the remote runs' ends are looked for in the store (besides being told).
pub const REVOKE_POLL: Duration = Duration::from_secs(1);

/// How long after the store last answered (a lookup, or a look for ends) the remote runs' calls
/// are still forwarded. A replica cut from the database cannot hear that a remote run ended: past
/// this, their calls are answered `503` (retried by the gateway) until the store answers again,
/// instead of being forwarded, and billed, for a run that may have ended long ago.
pub const HEARD_WITHIN: Duration = Duration::from_secs(5);

/// How long the proxy waits for the owner to end a run whose budget it found spent, before it
/// answers the refused call anyway.
const BUDGET_STOP_WAIT: Duration = Duration::from_secs(3);

/// How often a budget stop looks in the store for the run's end, in case the store's notification
/// of it is lost (the listener reconnecting): the notification is what normally ends the wait.
const BUDGET_STOP_POLL: Duration = Duration::from_millis(500);

/// The budget stops waiting for one run's end.
struct EndWaiters {
    /// Set once the run ended (sticky: a stop that looks after the end sees it too).
    told: tokio::sync::watch::Sender<bool>,
    /// Stops waiting: the entry goes with the last of them.
    waiting: usize,
}

/// One budget stop's wait for a run's end; dropped (the wait is over, or the refused call's
/// client went away), it forgets the run's entry once nobody else waits.
struct EndWait<'a> {
    /// Where the waits are kept.
    ends: &'a DashMap<String, EndWaiters>,
    /// The run waited for.
    run_id: String,
    /// Told when the run ended.
    told: tokio::sync::watch::Receiver<bool>,
}

impl Drop for EndWait<'_> {
    fn drop(&mut self) {
        // Counted under the map's lock of the entry: of two stops leaving at once, one removes it.
        if let dashmap::mapref::entry::Entry::Occupied(mut e) = self.ends.entry(self.run_id.clone()) {
            e.get_mut().waiting = e.get().waiting.saturating_sub(1);
            if e.get().waiting == 0 {
                e.remove();
            }
        }
    }
}

/// The runs other replicas own, as this process's LLM proxy finds them.
pub struct RemoteRuns {
    /// The shared store.
    store: Arc<RunStore>,
    /// This process's registry, where the remote runs it found are kept until they end.
    attributions: Arc<Attributions>,
    /// A remote run's tokens count toward its account's budget like any other.
    budgets: Arc<Budgets>,
    /// One query per burst, misses believed for a while.
    cache: cache::Resolver<CallKey, Arc<RunBilling>>,
    /// Budget stops waiting for their runs' ends, by run id: woken by the end's notification
    /// instead of asking the store over and over.
    ends: DashMap<String, EndWaiters>,
    /// When the store last answered about remote runs (the start of that question: what it
    /// said was true at least then).
    heard: std::sync::Mutex<Option<Instant>>,
    /// How long an answer is trusted ([`HEARD_WITHIN`]).
    heard_within: Duration,
}

impl RemoteRuns {
    /// Lookups in `store` (shared by replicas), kept in `attributions`.
    pub fn new(store: Arc<RunStore>, attributions: Arc<Attributions>, budgets: Arc<Budgets>) -> Arc<Self> {
        Self::with_ttls(store, attributions, budgets, MISS_TTL, HEARD_WITHIN)
    }

    /// The same, with misses believed for `ttl` and the store's answers trusted for
    /// `heard_within` (tests: times that suit them).
    pub fn with_ttls(store: Arc<RunStore>, attributions: Arc<Attributions>, budgets: Arc<Budgets>, ttl: Duration, heard_within: Duration) -> Arc<Self> {
        Arc::new(Self {
            store,
            attributions,
            budgets,
            cache: cache::Resolver::new(ttl, MAX_MISSES),
            ends: DashMap::new(),
            heard: std::sync::Mutex::new(None),
            heard_within,
        })
    }

    /// The store answered a question asked at `asked`.
    fn heard_at(&self, asked: Instant) {
        let mut heard = cache::lock(&self.heard);
        if heard.is_none_or(|h| h < asked) {
            *heard = Some(asked);
        }
    }

    /// Whether the store answered recently enough that the remote runs this process knows can be
    /// taken as live (an end it did not hear of is at most [`HEARD_WITHIN`] old). False on a
    /// replica cut from the database: its remote runs' calls then wait (`503`).
    pub fn ends_heard(&self) -> bool {
        let heard = *cache::lock(&self.heard);
        heard.is_some_and(|h| h.elapsed() <= self.heard_within)
    }

    /// The live run of another replica that `key` names, from then on in this process's registry;
    /// not found: no live run has it (fail-closed), or none had it a moment ago (a believed miss,
    /// see [`cache::Resolved`]).
    pub async fn find(&self, key: &CallKey) -> Result<cache::Resolved<Arc<RunBilling>>, StoreError> {
        self.cache
            .resolve(key, || async {
                let asked = Instant::now();
                let mut found = self.store.live_run(key).await?;
                if found.is_some() {
                    // This process's own writes of the run's share (it may have owned the run
                    // before) are stored before the share is read again: its counters continue
                    // from there. Only for a hit: a miss (most lookups of a flood of unknown
                    // keys) must not wait for a commit, nor for a store slow to take one.
                    self.store.flush().await;
                    found = self.store.live_run(key).await?;
                }
                // Ends told meanwhile were handled as they came: what the store knows is known.
                self.heard_at(asked);
                Ok(found.and_then(|run| self.remote(run)))
            })
            .await
    }

    /// A remote run's entry: its billing identity, counters from this process's stored share,
    /// stored as they change (never fenced: the calls were forwarded here). `None` when the run's
    /// end was heard while it was looked up (see [`Attributions::add_remote`]).
    fn remote(&self, run: LiveRun) -> Option<Arc<RunBilling>> {
        let mut b = RunBilling::new(&run.run_id, &run.billing_account_id, &run.graph_id, &run.session_key, &run.trace_id).with_usage(run.share);
        if let Some(t) = run.token {
            b = b.with_token(t);
        }
        let (budgets, account) = (self.budgets.clone(), run.billing_account_id.clone());
        b.on_usage(crate::store::live::usage_hook(self.store.writer(), run.run_id.clone(), Some(Box::new(move |t| budgets.record(&account, t)))));
        let Some(b) = self.attributions.add_remote(Arc::new(b)) else {
            tracing::info!(run_id = %run.run_id, "a run found live in the store ended meanwhile; its LLM calls are not forwarded");
            return None;
        };
        tracing::info!(run_id = %b.run_id, "forwarding the LLM calls of a run another replica owns");
        Some(b)
    }

    /// A remote run's account has spent its budget: its owner is asked to end it
    /// `budget_exceeded` (woken at once) and this waits, bounded, until the run has ended, so that
    /// the refusal reaches the gateway after the run's cancel, as on the owner itself. The end is
    /// heard as the store tells it (`clawmux_ended`, see [`Self::ended`]), with a look at the
    /// store every [`BUDGET_STOP_POLL`] in case that notification is lost.
    pub async fn stop_for_budget(&self, run_id: &str) {
        // Waiting before the abort is asked for: an end told in between is not missed.
        let mut wait = self.wait_for_end(run_id);
        match self.store.request_abort(run_id, AbortReason::BudgetExceeded).await {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                tracing::error!(run_id, error = %e, "cannot ask the owner of a run to stop it (its budget is spent); its calls are refused here meanwhile");
                return;
            }
        }
        let deadline = tokio::time::sleep(BUDGET_STOP_WAIT);
        tokio::pin!(deadline);
        let mut poll = tokio::time::interval(BUDGET_STOP_POLL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let ids = [run_id.to_owned()];
        loop {
            tokio::select! {
                // Its sender lives as long as `wait`: an error cannot happen, and would only
                // leave the polls. (The value's guard is let go inside: this future is `Send`.)
                true = async { wait.told.wait_for(|ended| *ended).await.is_ok() } => return,
                _ = poll.tick() => {
                    if self.store.ended(&ids).await.is_ok_and(|e| !e.is_empty()) {
                        return;
                    }
                }
                () = &mut deadline => break,
            }
        }
        tracing::warn!(run_id, "the owner of a run past its budget did not end it within {BUDGET_STOP_WAIT:?}");
    }

    /// Registers a wait for the end of `run_id` (see [`Self::ended`]); dropped, it is forgotten
    /// once nobody else waits for that run.
    fn wait_for_end(&self, run_id: &str) -> EndWait<'_> {
        let mut entry = self.ends.entry(run_id.to_owned()).or_insert_with(|| EndWaiters { told: tokio::sync::watch::channel(false).0, waiting: 0 });
        entry.waiting += 1;
        EndWait { ends: &self.ends, run_id: run_id.to_owned(), told: entry.told.subscribe() }
    }

    /// A run ended (told by the store): revoked if it is a remote run here, and whoever waits for
    /// its end is woken.
    pub fn ended(&self, run_id: &str) {
        if let Some(w) = self.ends.get(run_id) {
            w.told.send_replace(true);
        }
        if self.attributions.revoke_remote(run_id) {
            tracing::info!(run_id, "a run another replica owns ended; its LLM calls are no longer forwarded here");
        }
    }

    /// Budget stops waiting for a run's end (tests).
    pub fn waiting_for_ends(&self) -> usize {
        self.ends.len()
    }

    /// One look in the store for the ends of the remote runs: those ended are revoked, then the
    /// store counts as heard ([`Self::ends_heard`]). Nothing to look for is heard too.
    pub async fn look_for_ends(&self) -> Result<(), StoreError> {
        let asked = Instant::now();
        let runs = self.attributions.remote_runs();
        if !runs.is_empty() {
            for run_id in self.store.ended(&runs).await? {
                self.ended(&run_id);
            }
        }
        self.heard_at(asked);
        Ok(())
    }

    /// Looks for the ends of the remote runs every [`REVOKE_POLL`] (the notification of an end may
    /// have been lost).
    pub fn spawn_revocations(self: &Arc<Self>) {
        let me = self.clone();
        actix::spawn(async move {
            let mut every = tokio::time::interval(REVOKE_POLL);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut failing = false;
            loop {
                every.tick().await;
                match me.look_for_ends().await {
                    Ok(()) => failing = false,
                    Err(e) if !failing => {
                        failing = true;
                        tracing::warn!(error = %e, "cannot look for the ends of the runs whose LLM calls this replica forwards; their calls wait until it can");
                    }
                    Err(_) => {}
                }
            }
        });
    }
}
