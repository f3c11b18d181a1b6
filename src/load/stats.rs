//! Latency percentiles (pure).
//!
//! Nearest-rank percentiles over every sample: a load run has at most a few hundred thousand
//! samples, so sorting them all is cheap and exact, and an exact p99 is what a capacity decision
//! needs (histogram buckets would blur the tail this tool exists to show).

use serde::Serialize;

/// Summary of one latency series, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Percentiles {
    /// Number of samples.
    pub n: usize,
    /// Median.
    pub p50: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest sample.
    pub max: f64,
    /// Arithmetic mean.
    pub mean: f64,
}

/// Nearest-rank percentile `p` (0..=100) of sorted samples; `None` when there are none.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    let idx = rank.clamp(1, sorted.len()) - 1;
    sorted.get(idx).copied()
}

/// Summarises samples (any order; NaNs are dropped); `None` when there are none.
pub fn summarize(samples: &[f64]) -> Option<Percentiles> {
    let mut v: Vec<f64> = samples.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    Some(Percentiles {
        n: v.len(),
        p50: percentile(&v, 50.0)?,
        p95: percentile(&v, 95.0)?,
        p99: percentile(&v, 99.0)?,
        max: *v.last()?,
        mean,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = summarize(&v).unwrap();
        assert_eq!((s.n, s.p50, s.p95, s.p99, s.max), (100, 50.0, 95.0, 99.0, 100.0));
        assert!((s.mean - 50.5).abs() < 1e-9);
    }

    #[test]
    fn small_and_unsorted() {
        let s = summarize(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.p50, s.p95, s.p99, s.max), (2.0, 3.0, 3.0, 3.0));
        assert_eq!(summarize(&[7.0]).unwrap().p99, 7.0);
        assert!(summarize(&[]).is_none());
        assert!(summarize(&[f64::NAN]).is_none());
        assert_eq!(percentile(&[1.0, 2.0], 0.0), Some(1.0));
    }
}
