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
}

impl Shards {
    /// No shard yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes the current thread (an HTTP worker: an actix arbiter) a shard; joining twice is a
    /// no-op. Outside an arbiter it does nothing.
    pub fn join_here(&self) {
        let Some(arbiter) = actix::Arbiter::try_current() else { return };
        let me = std::thread::current().id();
        let mut joined = self.joined.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !joined.iter().any(|(t, _)| *t == me) {
            joined.push((me, arbiter));
        }
    }

    /// The current thread's arbiter when it is a shard.
    pub fn here(&self) -> Option<ArbiterHandle> {
        let me = std::thread::current().id();
        let joined = self.joined.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        joined.iter().find(|(t, _)| *t == me).map(|(_, a)| a.clone())
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
        let shards = std::sync::Arc::new(Shards::new());
        assert!(shards.here().is_none());
        let worker = actix::Arbiter::new();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let on_worker = shards.clone();
        assert!(worker.spawn(async move {
            on_worker.join_here();
            on_worker.join_here();
            let _ = tx.send(on_worker.here().is_some());
        }));
        assert!(rx.await.expect("the worker answers"), "the worker is a shard");
        assert_eq!(shards.len(), 1, "joined once");
        assert!(shards.here().is_none(), "this thread did not join");
        worker.stop();
    }
}
