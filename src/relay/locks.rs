//! Branch-key locks: one holder per branch key at a time, waiters served in arrival order.
//!
//! A run with a branch key takes its key's lock before the workspace is prepared and keeps it
//! until the relay has pushed, so two runs on one key never share a worktree, while runs on
//! different keys proceed in parallel. The registry is a [`DashMap`] of `Arc<tokio::sync::Mutex>`:
//! the map's shard guard is only held to clone the `Arc` (never across an `.await`), and tokio's
//! mutex queues waiters fairly (FIFO). An entry disappears when its last holder or waiter is gone,
//! so the map does not grow with every key ever used.

use dashmap::DashMap;
use std::sync::Arc;
use tokio::sync::{Mutex, OwnedMutexGuard};

/// Map size at which creating a new entry first sweeps unused ones.
const SWEEP_AT: usize = 1024;

/// The registry. Cheap to clone: clones share the same locks.
#[derive(Clone, Default)]
pub struct BranchLocks {
    /// Branch key → its mutex. An entry lives while someone holds or waits for that key.
    map: Arc<DashMap<String, Arc<Mutex<()>>>>,
}

/// Holding the lock of one branch key. Dropping it releases the lock (the next waiter in
/// arrival order gets it) and removes the key's entry when nobody else holds or waits for it.
pub struct BranchGuard {
    /// The key this guard holds.
    key: String,
    /// The tokio guard; `Option` so `Drop` can release it before the clean-up.
    guard: Option<OwnedMutexGuard<()>>,
    /// The registry, for the clean-up on drop.
    map: Arc<DashMap<String, Arc<Mutex<()>>>>,
}

impl std::fmt::Debug for BranchGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BranchGuard").field("key", &self.key).finish()
    }
}

impl BranchGuard {
    /// The branch key held.
    pub fn key(&self) -> &str {
        &self.key
    }
}

impl Drop for BranchGuard {
    fn drop(&mut self) {
        // Release first: our guard owns one `Arc` clone of the mutex.
        self.guard.take();
        // Under the shard's write lock nobody can clone the `Arc`, so a count of 1 (the map's own)
        // means no holder and no waiter: the entry can go. A waiter holds a clone, so a key with
        // waiters is never removed (they would otherwise lock an orphaned mutex).
        self.map.remove_if(&self.key, |_, m| Arc::strong_count(m) == 1);
    }
}

impl BranchLocks {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// The key's mutex, created when missing. The shard guard is dropped before returning.
    fn mutex(&self, key: &str) -> Arc<Mutex<()>> {
        if let Some(m) = self.map.get(key) {
            return Arc::clone(m.value());
        }
        if self.map.len() >= SWEEP_AT {
            self.sweep();
        }
        Arc::clone(self.map.entry(key.to_owned()).or_default().value())
    }

    /// Removes entries nobody holds or waits for. Guards clean up their own key; this catches the
    /// rare entry left behind by a waiter that was cancelled after the holder had released.
    pub fn sweep(&self) {
        self.map.retain(|_, m| Arc::strong_count(m) > 1);
    }

    /// Waits (in arrival order) until `key` is free and takes it.
    pub async fn lock(&self, key: &str) -> BranchGuard {
        let m = self.mutex(key);
        let guard = m.lock_owned().await;
        BranchGuard { key: key.to_owned(), guard: Some(guard), map: Arc::clone(&self.map) }
    }

    /// Takes `key` only if nobody holds it and nobody waits for it; lets a caller report
    /// "waiting for the branch lock" before it calls [`lock`](Self::lock).
    pub fn try_lock(&self, key: &str) -> Option<BranchGuard> {
        let m = self.mutex(key);
        match Arc::clone(&m).try_lock_owned() {
            Ok(guard) => Some(BranchGuard { key: key.to_owned(), guard: Some(guard), map: Arc::clone(&self.map) }),
            Err(_) => {
                drop(m);
                // we may have created the entry: remove it again when it is unused
                self.map.remove_if(key, |_, m| Arc::strong_count(m) == 1);
                None
            }
        }
    }

    /// Whether someone holds `key` right now.
    pub fn is_locked(&self, key: &str) -> bool {
        self.map.get(key).map(|m| m.value().try_lock().is_err()).unwrap_or(false)
    }

    /// Keys with a holder or waiters (for metrics and tests).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// No key is held or waited for.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::sync::mpsc;
    use tokio::time::{sleep, timeout, Instant};

    #[tokio::test]
    async fn same_key_serializes_in_arrival_order() {
        let locks = BranchLocks::new();
        let first = locks.lock("task-1").await;
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for i in 0..5 {
            let locks = locks.clone();
            let tx = tx.clone();
            tasks.push(tokio::spawn(async move {
                let _g = locks.lock("task-1").await;
                tx.send(("start", i)).expect("send");
                sleep(Duration::from_millis(5)).await;
                tx.send(("end", i)).expect("send");
            }));
            // make the arrival order unambiguous: each task is queued before the next starts
            sleep(Duration::from_millis(10)).await;
        }
        assert!(locks.is_locked("task-1"));
        assert!(rx.try_recv().is_err(), "nobody runs while the first holder has the lock");
        drop(first);
        for t in tasks {
            t.await.expect("task");
        }
        drop(tx);
        let mut seen = Vec::new();
        while let Some(e) = rx.recv().await {
            seen.push(e);
        }
        let want: Vec<_> = (0..5).flat_map(|i| [("start", i), ("end", i)]).collect();
        assert_eq!(seen, want, "one at a time, in arrival order");
        assert!(locks.is_empty(), "entries are removed when unused");
    }

    #[tokio::test]
    async fn different_keys_overlap() {
        let locks = BranchLocks::new();
        let t0 = Instant::now();
        let a = {
            let locks = locks.clone();
            tokio::spawn(async move {
                let _g = locks.lock("a").await;
                sleep(Duration::from_millis(200)).await;
            })
        };
        let b = {
            let locks = locks.clone();
            tokio::spawn(async move {
                let _g = locks.lock("b").await;
                sleep(Duration::from_millis(200)).await;
            })
        };
        a.await.expect("a");
        b.await.expect("b");
        assert!(t0.elapsed() < Duration::from_millis(380), "two keys ran in parallel: {:?}", t0.elapsed());
        assert!(locks.is_empty());
    }

    #[tokio::test]
    async fn try_lock_and_cleanup() {
        let locks = BranchLocks::new();
        let g = locks.try_lock("k").expect("free");
        assert_eq!(g.key(), "k");
        assert!(locks.try_lock("k").is_none(), "held");
        assert_eq!(locks.len(), 1);
        // a waiter keeps the entry alive after the holder is gone
        let waiter = {
            let locks = locks.clone();
            tokio::spawn(async move { locks.lock("k").await })
        };
        sleep(Duration::from_millis(20)).await;
        drop(g);
        let g2 = timeout(Duration::from_secs(2), waiter).await.expect("waiter got it").expect("join");
        assert!(locks.is_locked("k"));
        drop(g2);
        assert!(locks.is_empty());
        assert!(!locks.is_locked("k"));
        assert!(locks.try_lock("other").is_some());
        assert!(locks.is_empty(), "a dropped try_lock guard cleans up too");
    }

    #[tokio::test]
    async fn a_cancelled_waiter_does_not_leak_or_block() {
        let locks = BranchLocks::new();
        let g = locks.lock("k").await;
        let r = timeout(Duration::from_millis(30), locks.lock("k")).await;
        assert!(r.is_err(), "still held");
        drop(g);
        assert!(locks.is_empty(), "the cancelled waiter left no entry");
        let _g = timeout(Duration::from_secs(1), locks.lock("k")).await.expect("free again");
    }
}
