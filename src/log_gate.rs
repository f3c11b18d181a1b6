//! One warning per interval for a fault that every request meets (a store outage answered `503`
//! to each caller): the first is logged at once, the rest are counted and the count is logged
//! with the next one let through, so an outage under load is a few lines, not one per request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Lets one event through per `interval`; counts the others.
pub struct LogGate {
    interval_ms: u64,
    /// When the last event was let through (ms since the epoch; 0: never).
    last_ms: AtomicU64,
    /// Events held back since then.
    held: AtomicU64,
}

impl LogGate {
    /// A gate letting one event through per `interval`.
    pub const fn new(interval: Duration) -> Self {
        Self { interval_ms: interval.as_millis() as u64, last_ms: AtomicU64::new(0), held: AtomicU64::new(0) }
    }

    /// `Some(n)`: log this one, mentioning the `n` held back since the last; `None`: stay quiet.
    pub fn pass(&self) -> Option<u64> {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        self.pass_at(now)
    }

    fn pass_at(&self, now_ms: u64) -> Option<u64> {
        let last = self.last_ms.load(Ordering::Relaxed);
        let due = last == 0 || now_ms.saturating_sub(last) >= self.interval_ms || now_ms < last;
        // One caller wins the slot; concurrent ones are held back (and counted).
        if due && self.last_ms.compare_exchange(last, now_ms.max(1), Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            return Some(self.held.swap(0, Ordering::Relaxed));
        }
        self.held.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_per_interval_and_the_rest_counted() {
        let gate = LogGate::new(Duration::from_secs(10));
        assert_eq!(gate.pass_at(1_000), Some(0), "the first is logged");
        for t in 1_001..1_101 {
            assert_eq!(gate.pass_at(t), None);
        }
        assert_eq!(gate.pass_at(10_999), None, "still within the interval");
        assert_eq!(gate.pass_at(11_000), Some(101), "the next one says how many were held back");
        assert_eq!(gate.pass_at(11_001), None);
        // A clock stepped back does not silence the gate for good.
        assert_eq!(gate.pass_at(5_000), Some(1));
    }
}
