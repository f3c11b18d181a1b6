//! Following a run that is live on ANOTHER replica (PostgreSQL): its events reach this replica's
//! SSE clients from the store. Every batch that stores events also sends `NOTIFY clawmux_events`
//! with each run id (delivered at commit, so a woken follower always finds the events); one
//! `LISTEN` connection per process wakes the followers of the runs named.
//!
//! A lost notification (the listening connection broke and came back) costs latency, never an
//! event: the listener wakes every follower when it reconnects, and a follower re-reads the store
//! at least every [`FALLBACK_POLL`] anyway.
//!
//! The same connection hears what the LLM proxies of other replicas need ([`Notes`], see
//! `pg_shares`): runs that ended, usage shares, aborts posted for this replica.

use super::pg_shares::{ShareNote, ABORT, ENDED, USAGE};
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

/// What this process does with the other notifications (set once, when it serves).
pub struct Notes {
    /// A run's end was stored: its LLM calls are no longer forwarded here, its streams are cut.
    pub ended: Box<dyn Fn(&str) + Send + Sync>,
    /// A replica stored its share of a run's usage (the owner's documents show it).
    pub share: Box<dyn Fn(ShareNote) + Send + Sync>,
    /// An abort was posted for a run of the replica named (the owner acts on it at once).
    pub abort: Box<dyn Fn(&str) + Send + Sync>,
    /// Notifications may have been missed (the listener reconnected): state kept from them is
    /// read again.
    pub missed: Box<dyn Fn() + Send + Sync>,
}

/// The followers of this process, by run id.
pub struct Follow {
    /// The store's connections (the listener takes one for itself).
    pool: PgPool,
    /// A counter per followed run, bumped by each notification naming it.
    runs: Arc<DashMap<String, watch::Sender<u64>>>,
    /// A counter per run whose end is awaited, bumped when its end is notified.
    ends: Arc<DashMap<String, watch::Sender<u64>>>,
    /// The listener task, started by the first follower (or [`Follow::wake_on_assigned`]).
    started: OnceLock<()>,
    /// This replica's id and what to wake when another replica assigned it a run.
    assigned: Arc<OnceLock<(String, Arc<tokio::sync::Notify>)>>,
    /// What to do with the other replicas' ends, shares and aborts.
    notes: Arc<OnceLock<Notes>>,
}

impl Follow {
    /// Followers over the store's `pool` (nothing runs until the first one).
    pub fn new(pool: PgPool) -> Arc<Self> {
        Arc::new(Self {
            pool,
            runs: Arc::new(DashMap::new()),
            ends: Arc::new(DashMap::new()),
            started: OnceLock::new(),
            assigned: Arc::new(OnceLock::new()),
            notes: Arc::new(OnceLock::new()),
        })
    }

    /// Starts listening now; `notes` hears of the other replicas' ends, shares and aborts.
    pub fn on_notes(&self, notes: Notes) {
        let _ = self.notes.set(notes);
        self.start();
    }

    /// Starts listening now; `wake` is told each time another replica assigns `replica` a run
    /// (and whenever the listener reconnects: a notification may have been missed).
    pub fn wake_on_assigned(&self, replica: &str, wake: Arc<tokio::sync::Notify>) {
        let _ = self.assigned.set((replica.to_owned(), wake));
        self.start();
    }

    fn start(&self) {
        self.started.get_or_init(|| {
            let followed = Followed { runs: self.runs.clone(), ends: self.ends.clone() };
            tokio::spawn(listen(self.pool.clone(), followed, self.assigned.clone(), self.notes.clone()));
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

    /// Wakes when the end of `run_id` is stored (by any replica), not at each of its events: for
    /// a wait on a run's end, which would otherwise read the run again at every batch of its
    /// events. Check the store after subscribing, then wait.
    pub fn subscribe_end(&self, run_id: &str) -> watch::Receiver<u64> {
        self.start();
        let rx = self.ends.entry(run_id.to_owned()).or_insert_with(|| watch::channel(0).0).subscribe();
        self.ends.retain(|_, tx| tx.receiver_count() > 0);
        rx
    }
}

/// The runs followed (each event batch) and awaited (their end), by run id.
#[derive(Clone)]
struct Followed {
    runs: Arc<DashMap<String, watch::Sender<u64>>>,
    ends: Arc<DashMap<String, watch::Sender<u64>>>,
}

impl Followed {
    /// Wakes the followers of `run_id` in `map`; forgets the run when nobody follows it.
    fn wake(map: &DashMap<String, watch::Sender<u64>>, run_id: &str) {
        let gone = match map.get(run_id) {
            Some(tx) => {
                tx.send_modify(|c| *c += 1);
                tx.receiver_count() == 0
            }
            None => false,
        };
        if gone {
            map.remove_if(run_id, |_, tx| tx.receiver_count() == 0);
        }
    }
}

async fn listen(pool: PgPool, followed: Followed, assigned: Arc<OnceLock<(String, Arc<tokio::sync::Notify>)>>, notes: Arc<OnceLock<Notes>>) {
    let wake_all = |f: &Followed| {
        for r in f.runs.iter().chain(f.ends.iter()) {
            r.send_modify(|n| *n += 1);
        }
        if let Some((_, wake)) = assigned.get() {
            wake.notify_one();
        }
        if let Some(n) = notes.get() {
            (n.missed)();
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
        if let Err(e) = listener.listen_all([CHANNEL, ASSIGNED, ENDED, USAGE, ABORT]).await {
            tracing::warn!(error = %e, "cannot listen for other replicas' events; followers poll the store meanwhile");
            tokio::time::sleep(FALLBACK_POLL).await;
            continue;
        }
        failing = false;
        // What was notified while nobody listened is in the store: followers look now.
        wake_all(&followed);
        loop {
            match listener.try_recv().await {
                Ok(Some(n)) if n.channel() == ASSIGNED => {
                    if let Some((me, wake)) = assigned.get() {
                        if n.payload() == me {
                            wake.notify_one();
                        }
                    }
                }
                Ok(Some(n)) if n.channel() == ENDED => {
                    Followed::wake(&followed.ends, n.payload());
                    if let Some(notes) = notes.get() {
                        (notes.ended)(n.payload());
                    }
                }
                Ok(Some(n)) if n.channel() == USAGE => {
                    // Another process's payload: one that cannot be read is dropped (the share is
                    // in the store; a document read from there has it).
                    if let (Some(notes), Ok(share)) = (notes.get(), serde_json::from_str::<ShareNote>(n.payload())) {
                        (notes.share)(share);
                    }
                }
                Ok(Some(n)) if n.channel() == ABORT => {
                    if let Some(notes) = notes.get() {
                        (notes.abort)(n.payload());
                    }
                }
                Ok(Some(n)) => Followed::wake(&followed.runs, n.payload()),
                // The connection broke; the listener reconnects on the next call.
                Ok(None) => wake_all(&followed),
                Err(_) => break,
            }
        }
    }
}
