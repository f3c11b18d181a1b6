//! Bounds on every number the gateway sends before clawmux acts on it.
//!
//! The gateway is a peer, not an authority over clawmux: a `shutdown` that asks for a reconnect in
//! 2^64 ms, a `policy` with a zero or astronomic frame limit or tick interval, or a `retryAfterMs`
//! of years would otherwise switch clawmux off or make it allocate without bound. Each value is
//! clamped here, in one place, with the reason for its range.

use std::time::Duration;

/// Largest frame accepted before `hello-ok` tells the negotiated limit (hello-ok itself is
/// ~100 KB on 2026.9.6).
pub const PRE_HELLO_MAX_PAYLOAD: usize = 4 * 1024 * 1024;

/// Largest frame clawmux ever accepts, whatever the gateway advertises. The transport refuses
/// (and the connection drops) above this; 2.5x the 25 MiB the real gateway advertises.
pub const MAX_PAYLOAD_CAP: usize = 64 * 1024 * 1024;

/// Smallest per-frame limit clawmux applies after the handshake: older gateways advertised
/// 512 KiB and send less; a gateway advertising less (or 0) does not get to make every frame
/// undeliverable.
pub const MIN_PAYLOAD_FLOOR: usize = 1024 * 1024;

/// Tick interval range: the real gateway ticks every 30 s; tests use 100 ms. Outside this range
/// the watchdog (two intervals) would either fire between two healthy ticks or never.
pub const TICK_INTERVAL_MIN: Duration = Duration::from_millis(100);
/// See [`TICK_INTERVAL_MIN`].
pub const TICK_INTERVAL_MAX: Duration = Duration::from_secs(600);

/// The largest frame accepted after `hello-ok` advertised `advertised` bytes.
pub fn max_payload(advertised: u64) -> usize {
    usize::try_from(advertised).unwrap_or(usize::MAX).clamp(MIN_PAYLOAD_FLOOR, MAX_PAYLOAD_CAP)
}

/// The tick interval to watch for, from `policy.tickIntervalMs`.
pub fn tick_interval(advertised_ms: u64) -> Duration {
    Duration::from_millis(advertised_ms).clamp(TICK_INTERVAL_MIN, TICK_INTERVAL_MAX)
}

/// A reconnect delay the gateway asked for (`shutdown.restartExpectedMs`, a refused connect's
/// `retryAfterMs`), kept within clawmux's own backoff range: never a tight loop, never longer
/// than clawmux would wait anyway.
pub fn reconnect_hint(hint: Duration, min: Duration, max: Duration) -> Duration {
    hint.clamp(min, max)
}

/// A gateway-provided text (summary, error message) as it goes into a run's error: bounded, so a
/// hostile gateway cannot blow up run documents, logs and SSE streams.
pub fn clip(text: &str) -> String {
    clip_to(text, 1024)
}

fn clip_to(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes cut)", &text[..end], text.len() - end)
}

/// Most scopes `/readyz` lists as refused: a gateway has a handful; one that names a new "scope"
/// in every refusal (one per run) must not grow the list for as long as the connection lives.
pub const MAX_MISSING_SCOPES: usize = 16;

/// Longest scope name kept (real ones are like `operator.admin`).
const MAX_SCOPE_NAME: usize = 128;

/// Adds a scope the gateway refused to the list `/readyz` shows: clipped, once, and only while the
/// list has room (the first refusals are the ones that explain the problem).
pub fn note_missing_scope(list: &mut Vec<String>, scope: &str) {
    let scope = clip_to(scope, MAX_SCOPE_NAME);
    if list.len() < MAX_MISSING_SCOPES && !list.contains(&scope) {
        list.push(scope);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn absurd_values_are_bounded() {
        assert_eq!(max_payload(0), MIN_PAYLOAD_FLOOR);
        assert_eq!(max_payload(u64::MAX), MAX_PAYLOAD_CAP);
        assert_eq!(max_payload(26_214_400), 26_214_400, "the real gateway's policy is used as is");
        assert_eq!(tick_interval(0), TICK_INTERVAL_MIN);
        assert_eq!(tick_interval(u64::MAX), TICK_INTERVAL_MAX);
        assert_eq!(tick_interval(30_000), Duration::from_secs(30));
        let (min, max) = (Duration::from_millis(50), Duration::from_secs(30));
        assert_eq!(reconnect_hint(Duration::from_millis(u64::MAX), min, max), max);
        assert_eq!(reconnect_hint(Duration::ZERO, min, max), min);
        assert_eq!(reconnect_hint(Duration::from_millis(300), min, max), Duration::from_millis(300));
    }

    #[test]
    fn refused_scopes_are_listed_once_clipped_and_at_most_a_few() {
        let mut list = Vec::new();
        note_missing_scope(&mut list, "operator.admin");
        note_missing_scope(&mut list, "operator.admin");
        assert_eq!(list, ["operator.admin"]);
        for n in 0..1000 {
            note_missing_scope(&mut list, &format!("scope-{n}-{}", "x".repeat(n)));
        }
        assert_eq!(list.len(), MAX_MISSING_SCOPES);
        assert!(list.iter().all(|s| s.len() <= MAX_SCOPE_NAME + 32), "{list:?}");
        assert_eq!(list[1], "scope-0-", "the first refusals are kept");
    }

    #[test]
    fn clip_keeps_short_texts_and_cuts_on_a_char_boundary() {
        assert_eq!(clip("short"), "short");
        let long = "é".repeat(2000);
        let c = clip(&long);
        assert!(c.len() < 1100 && c.ends_with("bytes cut)"), "{c}");
    }

    proptest! {
        #[test]
        fn every_value_lands_in_range(v in any::<u64>()) {
            let p = max_payload(v);
            prop_assert!((MIN_PAYLOAD_FLOOR..=MAX_PAYLOAD_CAP).contains(&p));
            let t = tick_interval(v);
            prop_assert!(t >= TICK_INTERVAL_MIN && t <= TICK_INTERVAL_MAX);
            // The watchdog multiplies the interval: that must not overflow.
            prop_assert!(t.checked_mul(2).is_some());
        }
    }
}
