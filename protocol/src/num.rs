//! Numbers from the gateway that clawmux does not depend on.
//!
//! The gateway is a peer: a number it sends may be negative, fractional, beyond `u64`, or not a
//! number at all. Where clawmux only reads such a number as a hint (a `seq`, a timestamp, a
//! `retryAfterMs`), a bad value is treated as absent instead of failing the decode of the frame
//! around it: a `res` to a run's `agent` request that cannot be decoded because of its
//! `retryAfterMs` would leave the run waiting for an answer that already came. Values that are
//! decoded are then bounded where they are used (`clawmux_actors::limits`).

use serde::{Deserialize, Deserializer};

/// A whole number in `0..=u64::MAX`, or `None` for anything else (absent, `null`, negative,
/// fractional, too large, a string, ...). For `#[serde(default, deserialize_with = "...")]`.
pub fn lenient_u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Ok(serde_json::Value::deserialize(d)?.as_u64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct N {
        #[serde(default, deserialize_with = "lenient_u64")]
        n: Option<u64>,
    }

    #[test]
    fn only_whole_numbers_in_range_are_kept() {
        let n = |v: &str| serde_json::from_str::<N>(&format!(r#"{{"n":{v}}}"#)).expect("never fails on a value").n;
        assert_eq!(n("0"), Some(0));
        assert_eq!(n("18446744073709551615"), Some(u64::MAX));
        for bad in ["18446744073709551616", "-1", "1.5", "1e3", "\"7\"", "null", "[1]", "{}", "true"] {
            assert_eq!(n(bad), None, "{bad}");
        }
        assert_eq!(serde_json::from_str::<N>("{}").expect("absent").n, None);
    }
}
