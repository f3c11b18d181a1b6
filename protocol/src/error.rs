//! The gateway's error shape, the codes a multiplexer branches on, and decoding errors.

use serde::{Deserialize, Serialize};

/// `res.error` as the gateway sends it. Extra fields are kept in `details`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ErrorShape {
    /// Machine code, e.g. `INVALID_REQUEST`, `UNAVAILABLE`.
    pub code: String,
    /// Human-readable message; the gateway's wording is passed on to API callers.
    #[serde(default)]
    pub message: String,
    /// Structured details, e.g. `{"code":"MISSING_SCOPE"}` or `{"reason":"startup-sidecars"}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub details: Option<serde_json::Value>,
    /// Set on `UNAVAILABLE`: the call may be repeated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retryable: Option<bool>,
    /// How long to wait before repeating a retryable call (bounded where it is used; a value that
    /// is not a whole number of ms is absent, so the refusal itself is still understood).
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "crate::num::lenient_u64")]
    pub retry_after_ms: Option<u64>,
}

/// Error codes a multiplexer treats differently. Anything else is [`ErrorCode::Other`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorCode {
    /// Bad params, bad token, protocol mismatch, and on protocol 3 also missing scopes.
    InvalidRequest,
    /// Protocol 4's missing-scope answer (`details.code: MISSING_SCOPE`).
    Forbidden,
    /// Temporary (gateway starting); retry after `retryAfterMs`.
    Unavailable,
    /// The agent run exceeded the gateway's own timeout.
    AgentTimeout,
    /// The device must be paired first.
    NotPaired,
    /// The device is not linked.
    NotLinked,
    /// A code this client does not branch on.
    Other,
}

impl ErrorShape {
    /// Builds an error shape (used by the replay gateway and tests).
    pub fn new(code: &str, message: impl Into<String>) -> Self {
        Self { code: code.to_owned(), message: message.into(), details: None, retryable: None, retry_after_ms: None }
    }

    /// The code as an enum.
    pub fn kind(&self) -> ErrorCode {
        match self.code.as_str() {
            "INVALID_REQUEST" => ErrorCode::InvalidRequest,
            "FORBIDDEN" => ErrorCode::Forbidden,
            "UNAVAILABLE" => ErrorCode::Unavailable,
            "AGENT_TIMEOUT" => ErrorCode::AgentTimeout,
            "NOT_PAIRED" => ErrorCode::NotPaired,
            "NOT_LINKED" => ErrorCode::NotLinked,
            _ => ErrorCode::Other,
        }
    }

    /// `details.code`, where the gateway refines the top-level code (e.g. `AUTH_TOKEN_MISMATCH`).
    pub fn detail_code(&self) -> Option<&str> {
        self.details.as_ref()?.get("code")?.as_str()
    }

    /// True when the gateway says the call may simply be repeated later.
    pub fn is_retryable(&self) -> bool {
        self.kind() == ErrorCode::Unavailable || self.retryable == Some(true)
    }

    /// True for "you lack a scope", in either protocol's wording.
    pub fn is_missing_scope(&self) -> bool {
        self.detail_code() == Some("MISSING_SCOPE") || self.message.starts_with("missing scope")
    }
}

impl std::fmt::Display for ErrorShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

/// Why an inbound frame could not be decoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The frame is larger than the negotiated `policy.maxPayload`.
    #[error("frame of {size} bytes exceeds the negotiated maximum of {max} bytes")]
    TooLarge {
        /// Size of the frame in bytes.
        size: usize,
        /// The negotiated limit.
        max: usize,
    },
    /// Not JSON, or not a frame object.
    #[error("invalid frame: {0}")]
    Json(#[from] serde_json::Error),
    /// A frame of a known kind lacks a field it must have, or has one of the wrong type.
    #[error("malformed {what}: {reason}")]
    Malformed {
        /// Which frame or event (`res`, `event chat`, ...).
        what: String,
        /// What was wrong.
        reason: String,
    },
    /// `type` is none of `req`, `res`, `event`.
    #[error("unknown frame type {0:?}")]
    UnknownType(String),
    /// A `res` whose `id` reads but whose other fields do not: its caller is told (it would
    /// otherwise wait for an answer that already came).
    #[error("malformed res {id:?}: {reason}")]
    MalformedResponse {
        /// The request it answers.
        id: String,
        /// What was wrong.
        reason: String,
    },
}
