//! The shards: the API server's HTTP workers, one thread (an actix arbiter) per core.
//!
//! A run admitted by a `POST /v1/runs` lives on the worker that read the request: its session
//! actor runs there, its log commits there (a store lane of that thread, SQLite and `memory:`),
//! and its caller's SSE stream, which that worker serves, wakes there. So a delta crosses one
//! thread boundary, the supervisor's frame to the shard, where it crossed four before
//! (supervisor → session shard → store writer → HTTP worker), and each crossing cost a wake-up
//! of a sleeping thread, more CPU than the work itself (BENCHMARKS.md, "Shards are the HTTP
//! workers"). Runs of one session key may live on different shards: the registry, not the
//! shard, keeps them in order. Runs continued from the store (a restart, a takeover) have no
//! worker of their own and go to the registry's shards, by session key, as before.

use actix::dev::ArbiterHandle;
use std::sync::RwLock;
use std::thread::ThreadId;

/// The worker threads that joined, with their arbiters.
#[derive(Default)]
pub struct Shards {
    joined: RwLock<Vec<(ThreadId, ArbiterHandle)>>,
    /// `clawmux_shard_runs_total{shard}`: runs admitted on each shard, by the order it joined in.
    runs: Option<prometheus::IntCounterVec>,
}

impl Shards {
    /// No shard yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// No shard yet; counts the runs each one admits in `registry`.
    pub fn with_metrics(registry: &prometheus::Registry) -> prometheus::Result<Self> {
        let runs = prometheus::IntCounterVec::new(
            prometheus::Opts::new("clawmux_shard_runs_total", "Runs admitted on each shard (HTTP worker), where they live to their end"),
            &["shard"],
        )?;
        registry.register(Box::new(runs.clone()))?;
        Ok(Self { joined: RwLock::default(), runs: Some(runs) })
    }

    /// Makes the current thread (an HTTP worker: an actix arbiter) a shard; joining twice is a
    /// no-op. Outside an arbiter it does nothing.
    pub fn join_here(&self) {
        let Some(arbiter) = actix::Arbiter::try_current() else { return };
        let me = std::thread::current().id();
        let mut joined = self.joined.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !joined.iter().any(|(t, _)| *t == me) {
            if let Some(runs) = &self.runs {
                // Shown at 0 from the start: a shard that admits nothing is visible too.
                runs.with_label_values(&[&joined.len().to_string()]);
            }
            joined.push((me, arbiter));
        }
    }

    /// The current thread's arbiter when it is a shard.
    pub fn here(&self) -> Option<ArbiterHandle> {
        self.find_here().map(|(_, a)| a)
    }

    /// The current thread's place among the shards and its arbiter, when it is one.
    pub fn here_indexed(&self) -> Option<(usize, ArbiterHandle)> {
        self.find_here()
    }

    /// Counts a run admitted on shard `index` (it lives there to its end).
    pub fn admitted(&self, index: usize) {
        if let Some(runs) = &self.runs {
            runs.with_label_values(&[&index.to_string()]).inc();
        }
    }

    fn find_here(&self) -> Option<(usize, ArbiterHandle)> {
        let me = std::thread::current().id();
        let joined = self.joined.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        joined.iter().enumerate().find(|(_, (t, _))| *t == me).map(|(i, (_, a))| (i, a.clone()))
    }

    /// How many threads joined.
    pub fn len(&self) -> usize {
        self.joined.read().unwrap_or_else(std::sync::PoisonError::into_inner).len()
    }

    /// True before any thread joined.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[actix_rt::test]
    async fn a_thread_is_a_shard_once_it_joined_and_only_itself() {
        let registry = prometheus::Registry::new();
        let shards = std::sync::Arc::new(Shards::with_metrics(&registry).expect("metrics"));
        assert!(shards.here().is_none());
        let worker = actix::Arbiter::new();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let on_worker = shards.clone();
        assert!(worker.spawn(async move {
            on_worker.join_here();
            on_worker.join_here();
            let here = on_worker.here_indexed();
            if let Some((i, _)) = &here {
                on_worker.admitted(*i);
            }
            let _ = tx.send((on_worker.here().is_some(), here.map(|(i, _)| i)));
        }));
        assert_eq!(rx.await.expect("the worker answers"), (true, Some(0)), "the worker is shard 0");
        assert_eq!(shards.len(), 1, "joined once");
        assert!(shards.here().is_none() && shards.here_indexed().is_none(), "this thread did not join");
        let runs = shards.runs.as_ref().expect("counted");
        assert_eq!(runs.with_label_values(&["0"]).get(), 1, "one run on shard 0, none counted for this thread");
        assert_eq!(registry.gather().len(), 1, "registered");
        worker.stop();
    }
}
