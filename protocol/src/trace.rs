//! W3C `traceparent` (`00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`).
//!
//! Protocol 4 gateways forward the `traceparent` of the `agent` request frame to every LLM call of
//! the run (same trace id, new span id): the trace id is how an LLM call is tied back to its run.

use std::fmt;

/// A parsed `traceparent` header value.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TraceParent {
    /// 32 lower-case hex characters, not all zero.
    trace_id: String,
    /// 16 lower-case hex characters, not all zero.
    span_id: String,
    /// Trace flags (01 = sampled).
    flags: u8,
}

/// Why a `traceparent` value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid traceparent: {0}")]
pub struct TraceParentError(&'static str);

fn is_lower_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl TraceParent {
    /// Builds a value from ids the caller generated. Ids must be lower-case hex of the right length
    /// and not all zero.
    pub fn new(trace_id: &str, span_id: &str, flags: u8) -> Result<Self, TraceParentError> {
        if !is_lower_hex(trace_id, 32) || trace_id.bytes().all(|b| b == b'0') {
            return Err(TraceParentError("trace id must be 32 lower-case hex digits, not all zero"));
        }
        if !is_lower_hex(span_id, 16) || span_id.bytes().all(|b| b == b'0') {
            return Err(TraceParentError("span id must be 16 lower-case hex digits, not all zero"));
        }
        Ok(Self { trace_id: trace_id.to_owned(), span_id: span_id.to_owned(), flags })
    }

    /// Parses a header value (version 00 only, as the W3C spec requires of this version).
    pub fn parse(value: &str) -> Result<Self, TraceParentError> {
        let parts: Vec<&str> = value.trim().split('-').collect();
        if parts.len() != 4 {
            return Err(TraceParentError("expected 4 dash-separated fields"));
        }
        if parts[0] != "00" {
            return Err(TraceParentError("only version 00 is supported"));
        }
        if !is_lower_hex(parts[3], 2) {
            return Err(TraceParentError("flags must be 2 lower-case hex digits"));
        }
        let flags = u8::from_str_radix(parts[3], 16).map_err(|_| TraceParentError("bad flags"))?;
        Self::new(parts[1], parts[2], flags)
    }

    /// The trace id (the part shared by every span of the run).
    pub fn trace_id(&self) -> &str {
        &self.trace_id
    }

    /// The span id.
    pub fn span_id(&self) -> &str {
        &self.span_id
    }

    /// The same trace with another span id (a child span).
    pub fn with_span(&self, span_id: &str) -> Result<Self, TraceParentError> {
        Self::new(&self.trace_id, span_id, self.flags)
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "00-{}-{}-{:02x}", self.trace_id, self.span_id, self.flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let s = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let t = TraceParent::parse(s).expect("valid");
        assert_eq!(t.to_string(), s);
        assert_eq!(t.trace_id(), "0af7651916cd43dd8448eb211c80319c");
    }

    #[test]
    fn refuses_bad_values() {
        for bad in [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319-b7ad6b7169203331-01",
        ] {
            assert!(TraceParent::parse(bad).is_err(), "{bad}");
        }
    }
}
