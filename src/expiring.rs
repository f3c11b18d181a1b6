//! A bounded set of keys that each expire one lifetime after they were last remembered: the LLM
//! proxy's recent lookup misses (`remote_runs::cache`) and the runs that ended lately
//! (`attribution`). No dependency on the rest of the crate.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::time::{Duration, Instant};

/// Keys remembered each for one lifetime (`ttl`); at most `max` of them (the oldest go first: they
/// expire first, every key living equally long). Bounded whatever keys callers make up.
#[derive(Debug)]
pub struct ExpiringKeys<K> {
    /// Each key's expiry.
    until: HashMap<K, Instant>,
    /// Keys in the order they were remembered (with the expiry they had then).
    order: VecDeque<(K, Instant)>,
    /// How long a key is remembered.
    ttl: Duration,
    /// The most keys kept.
    max: usize,
}

impl<K: Eq + Hash + Clone> ExpiringKeys<K> {
    /// Keys remembered for `ttl`, at most `max` of them.
    pub fn new(ttl: Duration, max: usize) -> Self {
        Self { until: HashMap::new(), order: VecDeque::new(), ttl, max: max.max(1) }
    }

    /// True when `key` was remembered less than the lifetime ago.
    pub fn contains(&self, key: &K, now: Instant) -> bool {
        self.until.get(key).is_some_and(|t| *t > now)
    }

    /// Remembers `key` from `now` on.
    pub fn insert(&mut self, key: K, now: Instant) {
        while let Some((k, t)) = self.order.front() {
            if *t > now && self.order.len() < self.max {
                break;
            }
            // Expired, or the oldest of a full set. A key remembered again since has a later expiry
            // in the map: it stays.
            if self.until.get(k) == Some(t) {
                self.until.remove(k);
            }
            self.order.pop_front();
        }
        let t = now + self.ttl;
        self.until.insert(key.clone(), t);
        self.order.push_back((key, t));
    }

    /// Keys kept (tests).
    pub fn len(&self) -> usize {
        self.until.len()
    }

    /// True when no key is kept.
    pub fn is_empty(&self) -> bool {
        self.until.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_bounded_and_expire_and_the_oldest_go_first() {
        let now = Instant::now();
        let at = |s: u64| now + Duration::from_secs(s);
        let key = |k: &str| k.to_owned();
        let mut m = ExpiringKeys::new(Duration::from_secs(10), 4);
        for k in ["a", "b", "c"] {
            m.insert(key(k), now);
        }
        // Missed again later: when its first entry expires, the newer one stays.
        m.insert(key("b"), at(5));
        m.insert(key("d"), at(11));
        assert!(m.contains(&key("b"), at(12)), "b was missed again at +5 s");
        assert!(!m.contains(&key("a"), at(11)) && !m.contains(&key("c"), at(11)));
        assert_eq!(m.len(), 2, "expired keys are gone");
        // Full: the oldest goes, even before its time.
        for k in ["e", "f", "g"] {
            m.insert(key(k), at(11));
        }
        assert_eq!(m.len(), 4);
        assert!(!m.contains(&key("b"), at(11)) && m.contains(&key("g"), at(11)));
    }
}
