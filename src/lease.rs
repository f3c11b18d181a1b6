//! Run ownership among replicas sharing a PostgreSQL store: each run belongs to the replica that
//! admitted it (or took it over) while that replica renews its lease.
//!
//! ```text
//! every lease/3: renew ── ONE statement renews every unfinished run of this replica; runs in
//!                         memory here that another replica owns now are stopped here (no cancel,
//!                         no writes); aborts posted to other replicas cancel their gateway runs
//!                         (at once when the store says one was posted: `clawmux_abort`); runs
//!                         suspended while the store was out of reach go on (readopt)
//! every lease/2 (at most 5 s): take over ── claim runs whose lease expired (row locks: one winner per run),
//!                         continue each through the restart path, in admission order
//! ```
//! Fencing: the store drops a batch's writes for runs another replica owns
//! ([`crate::store::Applied::Fenced`]), and a takeover passes by a run while a batch of its owner
//! is being committed. Not fenced: the gateway run itself (the old owner's session actor may still
//! be subscribed until its next renewal tells it, and reads the same events) and a branch run's
//! workspace step already under way (it may publish once more: its relay result is then dropped).

use crate::api::AppState;
use crate::store::{AbortReason, Lease};
use actix_web::web;
use std::sync::Arc;
use std::time::Duration;

/// The longest wait between two looks for runs to take over.
const TAKEOVER_AT_MOST_EVERY: Duration = Duration::from_secs(5);

/// The lease `cfg` asks for.
pub fn lease_of(cfg: &crate::config::Config) -> Lease {
    Lease { replica: cfg.replica_id.clone(), ms: i64::try_from(cfg.run_lease_sec.saturating_mul(1000)).unwrap_or(i64::MAX) }
}

/// Starts the renewal and takeover loops (stores shared by replicas only); `aborts` wakes the
/// renewal when an abort is posted for a run of this replica.
pub fn spawn(state: web::Data<AppState>, lease: Lease, aborts: Arc<tokio::sync::Notify>) {
    let period = Duration::from_millis(u64::try_from(lease.ms).unwrap_or(10_000));
    let (s, l) = (state.clone(), lease.clone());
    actix::spawn(async move {
        let mut every = tokio::time::interval(period / 3);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            tokio::select! {
                _ = every.tick() => {}
                // Another replica's proxy stopped a run of this one (its budget is spent): the run
                // must end now, before the gateway fails it on the refused call.
                () = aborts.notified() => {}
            }
            if *s.stopping.borrow() {
                // Shutting down: a handoff releases the leases at the end (renewing them then
                // would hold the suspended runs back from the other replicas).
                return;
            }
            match s.store.renew(&l).await {
                Ok(renewed) => {
                    if failing {
                        failing = false;
                        tracing::info!("run leases renewed again");
                    }
                    s.store.lose_all(&renewed.lost).await;
                    for (run_id, reason) in renewed.aborts {
                        abort_here(&s, run_id, reason).await;
                    }
                }
                Err(e) if !failing => {
                    failing = true;
                    tracing::warn!(error = %e, "cannot renew this replica's run leases; other replicas take its runs over once they expire");
                }
                Err(_) => {}
            }
        }
    });
    {
        // Runs suspended while the store was out of reach are taken back as soon as it answers:
        // until then this replica admits nothing and takes nothing over (see `readopt`).
        let (s, l) = (state.clone(), lease.clone());
        actix::spawn(async move {
            let mut every = tokio::time::interval(READOPT_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                if *s.stopping.borrow() {
                    return;
                }
                readopt(&s, &l).await;
            }
        });
    }
    let wake = Arc::new(tokio::sync::Notify::new());
    state.store.wake_on_assigned(&lease.replica, wake.clone());
    actix::spawn(async move {
        // At most every 5 s whatever the lease: runs a replica hands off at shutdown (leases
        // released) are taken over within seconds even with long leases.
        let mut every = tokio::time::interval((period / 2).min(TAKEOVER_AT_MOST_EVERY));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = every.tick() => {}
                // Another replica admitted a run for this one.
                () = wake.notified() => {}
            }
            if *state.stopping.borrow() {
                return;
            }
            take_over(&state, &lease).await;
        }
    });
}

/// How often a replica with suspended runs tries to take them back.
const READOPT_EVERY: Duration = Duration::from_millis(250);

/// Claims the runs whose owner stopped renewing and continues them here.
async fn take_over(state: &web::Data<AppState>, lease: &Lease) {
    if state.store.suspended() > 0 {
        // Its own suspended runs first: a run of one of their keys (assigned here) must not
        // start before them.
        return;
    }
    let gate = state.admission.takeover_gate();
    let _exclusive = gate.write().await;
    let claimed = match state.store.take_over(lease).await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "cannot look for runs to take over");
            return;
        }
    };
    if claimed.is_empty() {
        return;
    }
    let n = claimed.len();
    let continued = crate::server::continue_runs(state, claimed).await;
    tracing::info!(claimed = n, continued, replica = %lease.replica, "took over runs (their owner's lease expired, or another replica admitted them for this one)");
}

/// The store answers again: continues the runs this replica suspended while it was out of reach
/// (those no other replica took over meanwhile), through the restart path, before any admission
/// or takeover here (both wait while runs are suspended), so a run of their session or branch
/// keys never starts before them.
async fn readopt(state: &web::Data<AppState>, lease: &Lease) {
    if state.store.suspended() == 0 {
        return;
    }
    let gate = state.admission.takeover_gate();
    let _exclusive = gate.write().await;
    match state.store.readopt(lease).await {
        Ok(runs) => {
            let n = runs.len();
            let continued = crate::server::continue_runs(state, runs).await;
            tracing::info!(runs = n, continued, "the run store answers again: continued the runs suspended here while it was out of reach");
        }
        Err(e) => tracing::warn!(error = %e, "cannot take back the runs suspended while the run store was out of reach; trying again at the next renewal"),
    }
}

/// An abort posted to another replica, for a run of this one: cancels it like `POST …/abort`, or
/// like its own proxy does when the run's budget is spent.
async fn abort_here(state: &web::Data<AppState>, run_id: String, reason: AbortReason) {
    use clawmux_actors::CancelReason;
    let reason = match reason {
        AbortReason::Api => CancelReason::Api,
        AbortReason::BudgetExceeded => CancelReason::BudgetExceeded,
    };
    let cancel = clawmux_actors::messages::Cancel { run_id, reason };
    let _ = tokio::time::timeout(Duration::from_secs(5), state.registry.send(cancel)).await;
}
