//! Reconnect backoff: exponential with full jitter, pure and deterministic given a random draw.

use std::time::Duration;

/// Exponential backoff with jitter.
///
/// The `attempt`-th delay is `min(max, min_delay * factor^attempt)`, of which the last `jitter`
/// fraction is randomised, so many clients restarted together do not reconnect in lockstep.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// Delay of the first retry (before jitter).
    min: Duration,
    /// Upper bound of every delay.
    max: Duration,
    /// Growth per attempt (> 1).
    factor: f64,
    /// Fraction of the delay that is random, in [0, 1].
    jitter: f64,
}

/// Why a backoff configuration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid backoff: {0}")]
pub struct BackoffError(&'static str);

impl Backoff {
    /// Validated construction: `0 < min <= max`, `factor >= 1`, `0 <= jitter <= 1`.
    pub fn new(min: Duration, max: Duration, factor: f64, jitter: f64) -> Result<Self, BackoffError> {
        if min.is_zero() {
            return Err(BackoffError("min must be > 0"));
        }
        if min > max {
            return Err(BackoffError("min must be <= max"));
        }
        if !(factor >= 1.0 && factor.is_finite()) {
            return Err(BackoffError("factor must be >= 1"));
        }
        if !(0.0..=1.0).contains(&jitter) {
            return Err(BackoffError("jitter must be within [0, 1]"));
        }
        Ok(Self { min, max, factor, jitter })
    }

    /// The delay before retry number `attempt` (0-based), given a uniform random draw in [0, 1).
    pub fn delay(&self, attempt: u32, draw: f64) -> Duration {
        let base = self.min.as_secs_f64() * self.factor.powi(attempt.min(64) as i32);
        let capped = base.min(self.max.as_secs_f64());
        let draw = draw.clamp(0.0, 1.0);
        let secs = capped * (1.0 - self.jitter) + capped * self.jitter * draw;
        // Jitter never takes a delay below `min`: a tight loop is what backoff exists to prevent.
        Duration::from_secs_f64(secs).max(self.min).min(self.max)
    }

    /// The smallest delay.
    pub fn min(&self) -> Duration {
        self.min
    }

    /// The largest delay.
    pub fn max(&self) -> Duration {
        self.max
    }
}

impl Default for Backoff {
    /// 250 ms doubling to 30 s, half of it random.
    fn default() -> Self {
        Self { min: Duration::from_millis(250), max: Duration::from_secs(30), factor: 2.0, jitter: 0.5 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn refuses_bad_configs() {
        let s = Duration::from_secs(1);
        assert!(Backoff::new(Duration::ZERO, s, 2.0, 0.5).is_err());
        assert!(Backoff::new(s * 2, s, 2.0, 0.5).is_err());
        assert!(Backoff::new(s, s, 0.5, 0.5).is_err());
        assert!(Backoff::new(s, s, f64::NAN, 0.5).is_err());
        assert!(Backoff::new(s, s, 2.0, 1.5).is_err());
    }

    #[test]
    fn grows_then_caps() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1), 2.0, 0.0).expect("valid");
        assert_eq!(b.delay(0, 0.3), Duration::from_millis(100));
        assert_eq!(b.delay(1, 0.3), Duration::from_millis(200));
        assert_eq!(b.delay(3, 0.3), Duration::from_millis(800));
        assert_eq!(b.delay(4, 0.3), Duration::from_secs(1));
        assert_eq!(b.delay(u32::MAX, 0.3), Duration::from_secs(1));
    }

    proptest! {
        #[test]
        fn delay_is_always_within_bounds(
            min_ms in 1u64..5_000, extra_ms in 0u64..60_000, factor in 1.0f64..10.0,
            jitter in 0.0f64..=1.0, attempt in 0u32..200, draw in 0.0f64..1.0,
        ) {
            let b = Backoff::new(Duration::from_millis(min_ms), Duration::from_millis(min_ms + extra_ms), factor, jitter).expect("valid");
            let d = b.delay(attempt, draw);
            prop_assert!(d >= b.min() && d <= b.max());
        }

        #[test]
        fn delay_without_jitter_never_shrinks(min_ms in 1u64..1000, attempt in 0u32..40) {
            let b = Backoff::new(Duration::from_millis(min_ms), Duration::from_secs(600), 2.0, 0.0).expect("valid");
            prop_assert!(b.delay(attempt + 1, 0.5) >= b.delay(attempt, 0.5));
        }
    }
}
