//! Following a run that is live on ANOTHER replica (PostgreSQL): its events reach this replica's
//! SSE clients from the store. Every batch that stores events also sends `NOTIFY clawmux_events`
//! with each run id (delivered at commit, so a woken follower always finds the events); one
//! `LISTEN` connection per process wakes the followers of the runs named.
//!
//! A lost notification (the listening connection broke and came back) costs latency, never an
//! event: the listener wakes every follower when it reconnects, and a follower re-reads the store
//! at least every [`FALLBACK_POLL`] anyway.

use dashmap::DashMap;
use sqlx::postgres::PgListener;
use sqlx::PgPool;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::watch;

/// The channel the store's batches notify (payload: a run id).
pub const CHANNEL: &str = "clawmux_events";

/// The channel a batch notifies when it stored a run for another replica (payload: that
/// replica's id): the owner takes it up at once instead of at its next look.
pub const ASSIGNED: &str = "clawmux_assigned";

/// How often a follower re-reads the store without a notification.
pub const FALLBACK_POLL: Duration = Duration::from_secs(1);

/// The followers of this process, by run id.
pub struct Follow {
    /// The store's connections (the listener takes one for itself).
    pool: PgPool,
    /// A counter per followed run, bumped by each notification naming it.
    runs: Arc<DashMap<String, watch::Sender<u64>>>,
    /// The listener task, started by the first follower (or [`Follow::wake_on_assigned`]).
    started: OnceLock<()>,
    /// This replica's id and what to wake when another replica assigned it a run.
    assigned: Arc<OnceLock<(String, Arc<tokio::sync::Notify>)>>,
}

impl Follow {
    /// Followers over the store's `pool` (nothing runs until the first one).
    pub fn new(pool: PgPool) -> Arc<Self> {
        Arc::new(Self { pool, runs: Arc::new(DashMap::new()), started: OnceLock::new(), assigned: Arc::new(OnceLock::new()) })
    }

    /// Starts listening now; `wake` is told each time another replica assigns `replica` a run
    /// (and whenever the listener reconnects: a notification may have been missed).
    pub fn wake_on_assigned(&self, replica: &str, wake: Arc<tokio::sync::Notify>) {
        let _ = self.assigned.set((replica.to_owned(), wake));
        self.start();
    }

    fn start(&self) {
        self.started.get_or_init(|| {
            tokio::spawn(listen(self.pool.clone(), self.runs.clone(), self.assigned.clone()));
        });
    }

    /// Wakes on each notification for `run_id` (check the store after subscribing, then wait:
    /// nothing that is stored after the subscription is missed).
    pub fn subscribe(&self, run_id: &str) -> watch::Receiver<u64> {
        self.start();
        let rx = self.runs.entry(run_id.to_owned()).or_insert_with(|| watch::channel(0).0).subscribe();
        // Runs nobody follows any more are forgotten here (and at their next notification).
        self.runs.retain(|_, tx| tx.receiver_count() > 0);
        rx
    }
}

async fn listen(pool: PgPool, runs: Arc<DashMap<String, watch::Sender<u64>>>, assigned: Arc<OnceLock<(String, Arc<tokio::sync::Notify>)>>) {
    let wake_all = |runs: &DashMap<String, watch::Sender<u64>>| {
        for r in runs.iter() {
            r.send_modify(|n| *n += 1);
        }
        if let Some((_, wake)) = assigned.get() {
            wake.notify_one();
        }
    };
    let mut failing = false;
    loop {
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(e) => {
                if !failing {
                    failing = true;
                    tracing::warn!(error = %e, "cannot listen for other replicas' events; followers poll the store meanwhile");
                }
                tokio::time::sleep(FALLBACK_POLL).await;
                continue;
            }
        };
        if let Err(e) = listener.listen_all([CHANNEL, ASSIGNED]).await {
            tracing::warn!(error = %e, "cannot listen for other replicas' events; followers poll the store meanwhile");
            tokio::time::sleep(FALLBACK_POLL).await;
            continue;
        }
        failing = false;
        // What was notified while nobody listened is in the store: followers look now.
        wake_all(&runs);
        loop {
            match listener.try_recv().await {
                Ok(Some(n)) if n.channel() == ASSIGNED => {
                    if let Some((me, wake)) = assigned.get() {
                        if n.payload() == me {
                            wake.notify_one();
                        }
                    }
                }
                Ok(Some(n)) => {
                    let gone = match runs.get(n.payload()) {
                        Some(tx) => {
                            tx.send_modify(|c| *c += 1);
                            tx.receiver_count() == 0
                        }
                        None => false,
                    };
                    if gone {
                        runs.remove_if(n.payload(), |_, tx| tx.receiver_count() == 0);
                    }
                }
                // The connection broke; the listener reconnects on the next call.
                Ok(None) => wake_all(&runs),
                Err(_) => break,
            }
        }
    }
}
