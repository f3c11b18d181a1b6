//! Canonical session keys.
//!
//! The gateway canonicalises every key it is given: lower-cased, and prefixed with `agent:main:`
//! when it does not start with `agent:`. clawmux builds keys already canonical so that the key it
//! routes by is byte-equal to the key the gateway puts into its events.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A canonical (lower-case, `agent:`-prefixed) session key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SessionKey(String);

impl SessionKey {
    /// The key of a run: `agent:{agentId}:{billingAccountId}:{stateKey or runId}`, lower-cased.
    pub fn for_run(agent_id: &str, billing_account_id: &str, state_or_run: &str) -> Self {
        Self(format!("agent:{agent_id}:{billing_account_id}:{state_or_run}").to_lowercase())
    }

    /// Canonicalises a key exactly as the gateway does.
    pub fn canonicalize(raw: &str) -> Self {
        let lower = raw.to_lowercase();
        if lower.starts_with("agent:") {
            Self(lower)
        } else {
            Self(format!("agent:main:{lower}"))
        }
    }

    /// The key as sent on the wire.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// True when `other` (a key from a gateway frame) names this session. Keys from frames are
    /// compared after canonicalisation, never by a looser rule.
    pub fn matches_wire(&self, other: &str) -> bool {
        self.0 == other || (other.bytes().any(|b| b.is_ascii_uppercase()) && Self::canonicalize(other) == *self)
    }
}

impl fmt::Display for SessionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for SessionKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_keys_are_lower_case() {
        let k = SessionKey::for_run("main", "Acct-42", "RunA");
        assert_eq!(k.as_str(), "agent:main:acct-42:runa");
    }

    #[test]
    fn canonicalize_matches_the_gateway() {
        assert_eq!(SessionKey::canonicalize("acct9:runA").as_str(), "agent:main:acct9:runa");
        assert_eq!(SessionKey::canonicalize("agent:main:Acct9:RunB").as_str(), "agent:main:acct9:runb");
    }

    #[test]
    fn matches_wire_is_exact_after_canonicalisation() {
        let k = SessionKey::for_run("main", "a", "r");
        assert!(k.matches_wire("agent:main:a:r"));
        assert!(k.matches_wire("AGENT:MAIN:A:R"));
        assert!(!k.matches_wire("agent:main:a:r2"));
        assert!(!k.matches_wire("agent:main:a"));
        assert!(!k.matches_wire(""));
    }
}
