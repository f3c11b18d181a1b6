//! The lookups of the LLM proxy in a shared store, kept cheap: concurrent lookups of one key share
//! ONE query (a burst of calls of a run costs one), and a key the store did not know is not looked
//! up again for a while (a burst of calls nobody owns costs one query per miss's lifetime, in
//! bounded memory). What was found is not kept here: the caller keeps it as a remote run until the
//! run ends. A lookup that fails is not kept either: the next call asks the store again. A miss
//! answered from memory says so ([`Resolved::MissingCached`]): the key may be known by now. A
//! lookup whose every caller went away is forgotten with the last of them, so made-up keys whose
//! callers disconnect cannot pile up either.

use crate::expiring::ExpiringKeys;
use crate::store::StoreError;
use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::OnceCell;

/// The answer a lookup gives, shared by everyone who waited for it.
type Shared<V> = Arc<OnceCell<Result<Option<V>, StoreError>>>;

/// What a lookup says of a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolved<V> {
    /// The store has it.
    Found(V),
    /// The store was asked for it just now (this call's lookup, or one it joined) and has none.
    Missing,
    /// The store had none less than the lifetime ago and was not asked again: a key that became
    /// known since (a run admitted right after) is not seen yet, so this is no proof of absence.
    MissingCached,
}

/// Single-flight lookups with a cache of misses.
pub struct Resolver<K, V> {
    /// Lookups under way, by key: whoever comes while one runs waits for its answer.
    inflight: Mutex<HashMap<K, Shared<V>>>,
    /// Keys recently not found.
    misses: Mutex<ExpiringKeys<K>>,
}

/// The guard of `m`, also after a holder panicked (every update here leaves the maps whole).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One caller's wait for a lookup. Dropped however the wait ends (answered, or the caller went
/// away mid-lookup: a gateway that closed its connection), it forgets the lookup once no one
/// waits for it any more, so keys whose every caller left never pile up in `inflight`.
struct Waiter<'a, K: Eq + Hash + Clone, V> {
    /// The lookups under way.
    inflight: &'a Mutex<HashMap<K, Shared<V>>>,
    /// The key waited for.
    key: &'a K,
    /// The lookup waited for (taken when the wait ends).
    shared: Option<Shared<V>>,
}

impl<K: Eq + Hash + Clone, V> Drop for Waiter<'_, K, V> {
    fn drop(&mut self) {
        let Some(mine) = self.shared.take() else { return };
        let mut inflight = lock(self.inflight);
        // A newer lookup of the key (ours was forgotten already) is left alone.
        let ours = inflight.get(self.key).is_some_and(|e| Arc::ptr_eq(e, &mine));
        let answered = mine.initialized();
        // Let go under the lock: the count below then sees every other waiter (joining takes the
        // lock too), and of two callers leaving at once the second sees the first gone.
        drop(mine);
        // Answered: forgotten at once, so the next call asks the store again (a hit is kept by the
        // caller, a miss in `misses`). Not answered: forgotten once the map holds the last
        // reference, i.e. no caller waits for it any more.
        if ours && (answered || inflight.get(self.key).is_some_and(|e| Arc::strong_count(e) == 1)) {
            inflight.remove(self.key);
        }
    }
}

impl<K: Eq + Hash + Clone, V: Clone> Resolver<K, V> {
    /// Misses believed for `ttl`, at most `max` of them kept.
    pub fn new(ttl: Duration, max: usize) -> Self {
        Self { inflight: Mutex::new(HashMap::new()), misses: Mutex::new(ExpiringKeys::new(ttl, max)) }
    }

    /// What `lookup` says of `key`, unless a lookup of it is under way (its answer is shared) or
    /// it was not found less than the lifetime ago ([`Resolved::MissingCached`] without asking).
    pub async fn resolve<F, Fut>(&self, key: &K, lookup: F) -> Result<Resolved<V>, StoreError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Option<V>, StoreError>>,
    {
        if lock(&self.misses).contains(key, Instant::now()) {
            return Ok(Resolved::MissingCached);
        }
        let mut waiter = Waiter { inflight: &self.inflight, key, shared: None };
        // Held by the waiter only: a caller that goes away lets go of it (see `Waiter`).
        let shared = waiter.shared.insert(lock(&self.inflight).entry(key.clone()).or_default().clone());
        // The first caller's lookup runs; the others wait for it (if its caller goes away first,
        // the next waiter runs its own).
        let answer = shared.get_or_init(lookup).await.clone();
        if let Ok(None) = answer {
            // Remembered before the lookup is forgotten: a caller in between must not ask again.
            // Once: every caller that shared the lookup gets here.
            let (mut misses, now) = (lock(&self.misses), Instant::now());
            if !misses.contains(key, now) {
                misses.insert(key.clone(), now);
            }
        }
        drop(waiter);
        answer.map(|found| found.map_or(Resolved::Missing, Resolved::Found))
    }

    /// Misses kept (tests).
    pub fn misses(&self) -> usize {
        lock(&self.misses).len()
    }

    /// Lookups under way (tests).
    pub fn inflight(&self) -> usize {
        lock(&self.inflight).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A store that answers after a while, counting the questions.
    struct Probe {
        asked: AtomicUsize,
        answer: Result<Option<u32>, StoreError>,
    }

    impl Probe {
        fn new(answer: Result<Option<u32>, StoreError>) -> Arc<Self> {
            Arc::new(Self { asked: AtomicUsize::new(0), answer })
        }

        async fn ask(&self) -> Result<Option<u32>, StoreError> {
            self.asked.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(50)).await;
            self.answer.clone()
        }
    }

    async fn burst(r: &Arc<Resolver<String, u32>>, probe: &Arc<Probe>, key: &str, n: usize) -> Vec<Result<Resolved<u32>, StoreError>> {
        let calls = (0..n).map(|_| {
            let (r, probe, key) = (r.clone(), probe.clone(), key.to_owned());
            tokio::spawn(async move { r.resolve(&key, || async { probe.ask().await }).await })
        });
        futures_util::future::join_all(calls).await.into_iter().map(|j| j.expect("task")).collect()
    }

    #[tokio::test]
    async fn a_burst_of_calls_costs_one_lookup() {
        let r = Arc::new(Resolver::new(Duration::from_secs(1), 100));
        let found = Probe::new(Ok(Some(7)));
        let answers = burst(&r, &found, "trace-a", 200).await;
        assert!(answers.iter().all(|a| *a == Ok(Resolved::Found(7))), "{answers:?}");
        assert_eq!(found.asked.load(Ordering::SeqCst), 1, "one query for the burst");
        // A hit is not kept here (the caller keeps the run): the next call asks again.
        burst(&r, &found, "trace-a", 1).await;
        assert_eq!(found.asked.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_miss_is_believed_for_its_lifetime_then_asked_again() {
        let r = Arc::new(Resolver::new(Duration::from_millis(1500), 100));
        let unknown = Probe::new(Ok(None));
        // A caller that came in while the lookup ran shares its fresh answer.
        assert!(burst(&r, &unknown, "trace-x", 50).await.iter().all(|a| matches!(a, Ok(Resolved::Missing | Resolved::MissingCached))));
        assert_eq!(unknown.asked.load(Ordering::SeqCst), 1);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let cached = burst(&r, &unknown, "trace-x", 50).await;
        assert_eq!(unknown.asked.load(Ordering::SeqCst), 1, "a miss is believed for a while");
        assert!(cached.iter().all(|a| *a == Ok(Resolved::MissingCached)), "a believed miss says so: {cached:?}");
        tokio::time::sleep(Duration::from_millis(1100)).await;
        burst(&r, &unknown, "trace-x", 50).await;
        assert_eq!(unknown.asked.load(Ordering::SeqCst), 2, "an expired miss is asked again, once");
    }

    #[tokio::test]
    async fn a_failed_lookup_is_shared_by_its_burst_but_not_kept() {
        let r = Arc::new(Resolver::new(Duration::from_secs(60), 100));
        let down = Probe::new(Err(StoreError("the database is down".into())));
        assert!(burst(&r, &down, "trace-e", 20).await.iter().all(Result::is_err));
        assert_eq!(down.asked.load(Ordering::SeqCst), 1);
        burst(&r, &down, "trace-e", 1).await;
        assert_eq!(down.asked.load(Ordering::SeqCst), 2, "an outage is not remembered as a miss");
        assert_eq!(r.misses(), 0);
    }

    #[tokio::test]
    async fn a_fresh_miss_and_a_believed_one_are_told_apart() {
        // A lifetime no test run outlasts: nothing here depends on timing.
        let r = Resolver::<String, u32>::new(Duration::from_secs(3600), 100);
        let asked = AtomicUsize::new(0);
        let lookup = || async {
            asked.fetch_add(1, Ordering::SeqCst);
            Ok(None)
        };
        assert_eq!(r.resolve(&"trace-n".to_owned(), lookup).await, Ok(Resolved::Missing));
        assert_eq!(r.resolve(&"trace-n".to_owned(), lookup).await, Ok(Resolved::MissingCached));
        assert_eq!(asked.load(Ordering::SeqCst), 1, "the second answer did not ask the store");
    }

    #[tokio::test]
    async fn a_lookup_whose_every_caller_went_away_is_forgotten() {
        let r = Resolver::<String, u32>::new(Duration::from_secs(3600), 100);
        let key = "trace-gone".to_owned();
        // A lookup that never answers (a store that hangs): its caller gives up and is dropped.
        let mut first = Box::pin(r.resolve(&key, std::future::pending));
        assert!(futures_util::poll!(first.as_mut()).is_pending());
        let mut second = Box::pin(r.resolve(&key, std::future::pending));
        assert!(futures_util::poll!(second.as_mut()).is_pending());
        assert_eq!(r.inflight(), 1, "two callers, one lookup");
        drop(first);
        assert_eq!(r.inflight(), 1, "the other caller still waits for it");
        drop(second);
        assert_eq!(r.inflight(), 0, "nobody waits: forgotten");
        // The next caller asks afresh, and its answer is not kept either.
        assert_eq!(r.resolve(&key, || async { Ok(Some(3)) }).await, Ok(Resolved::Found(3)));
        assert_eq!(r.inflight(), 0);
        // A caller dropped before its first poll holds nothing.
        drop(r.resolve(&key, std::future::pending));
        assert_eq!((r.inflight(), r.misses()), (0, 0));
    }
}
