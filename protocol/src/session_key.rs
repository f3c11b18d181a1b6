//! Session keys: how clawmux names a run's gateway session, and how the gateway canonicalises keys.
//!
//! The gateway canonicalises every key it is given: lower-cased (a few channel grammars keep the
//! case of an opaque peer id; clawmux's keys never use them), and prefixed with `agent:main:` when
//! it does not start with `agent:`. It also reads meaning into a key's shape: the segment after
//! `agent:<agentId>:` selects special session kinds (`cron:`, `subagent:`, `acp:`, `hook:`,
//! `dashboard:`...), `:thread:` anywhere marks a thread suffix, and `<channel>:<kind>:<peer>` is a
//! delivery route.
//!
//! A run's key must be **injective after that canonicalisation**: two runs share a gateway session
//! (its transcript, its queue) only when their agent, billing account and conversation are all
//! equal. Plain concatenation is not: ids may contain `:`, and `Acme` and `acme` are different
//! accounts. So every caller-chosen id is escaped into a lower-case alphabet without `:` or `.`
//! ([`escape_id`]), and the variable part is one segment behind a fixed `clawmux:` channel:
//!
//! ```text
//! agent:{agentId}:clawmux:{escape(billingAccountId)}.{s|r}.{escape(stateKey | runId)}
//! ```
//! `s` marks a conversation (`stateKey`), `r` a one-off run (`runId`), so the two never collide.
//! Because the variable part holds no `:`, no id can form `:thread:`, a special kind prefix or a
//! delivery route, and because it is already lower-case the gateway's folding leaves it unchanged:
//! the key clawmux routes by is byte-equal to the key the gateway puts into its events.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A canonical (lower-case, `agent:`-prefixed) session key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SessionKey(String);

/// Which conversation a run belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Conversation<'a> {
    /// A caller-named conversation (`stateKey`): runs of one state key share the session.
    State(&'a str),
    /// No state key: the run is its own conversation, named by its `runId`.
    Run(&'a str),
}

/// Why a session key could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionKeyError {
    /// The agent id is not one the gateway accepts unchanged.
    #[error("agent id {0:?} is not a gateway agent id ([a-z0-9][a-z0-9_-]{{0,63}})")]
    AgentId(String),
    /// An id is empty or holds a character outside `[A-Za-z0-9._:-]`.
    #[error("{0} must match [A-Za-z0-9._:-]{{1,128}}")]
    Id(&'static str),
}

/// The channel segment of every key clawmux builds.
pub const CHANNEL: &str = "clawmux";

/// True for the agent ids the gateway keeps as they are (its `normalizeAgentId` rewrites others).
pub fn is_gateway_agent_id(id: &str) -> bool {
    let b = id.as_bytes();
    (1..=64).contains(&b.len())
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'_' | b'-'))
}

/// Escapes an id of `[A-Za-z0-9._:-]` into `[a-z0-9_-]`, injectively:
/// `a-z 0-9 -` stay, `A`–`Z` become `_a`–`_z`, `.` → `_0`, `:` → `_1`, `_` → `_2`.
/// Every escape is `_` plus one character, so the code is prefix-free and decodes uniquely; the
/// output is lower-case, so the gateway's folding cannot merge two of them.
pub fn escape_id(id: &str) -> Option<String> {
    let mut out = String::with_capacity(id.len() + 4);
    for c in id.chars() {
        match c {
            'a'..='z' | '0'..='9' | '-' => out.push(c),
            'A'..='Z' => {
                out.push('_');
                out.push(c.to_ascii_lowercase());
            }
            '.' => out.push_str("_0"),
            ':' => out.push_str("_1"),
            '_' => out.push_str("_2"),
            _ => return None,
        }
    }
    Some(out)
}

/// The inverse of [`escape_id`] (tests and tools use it to read a key back).
pub fn unescape_id(s: &str) -> Option<String> {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            'a'..='z' | '0'..='9' | '-' => out.push(c),
            '_' => match chars.next()? {
                l @ 'a'..='z' => out.push(l.to_ascii_uppercase()),
                '0' => out.push('.'),
                '1' => out.push(':'),
                '2' => out.push('_'),
                _ => return None,
            },
            _ => return None,
        }
    }
    Some(out)
}

fn valid_id(s: &str) -> bool {
    (1..=128).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

impl SessionKey {
    /// The key of a run (see the module docs for the shape and why it is injective).
    pub fn for_run(agent_id: &str, billing_account_id: &str, conversation: Conversation<'_>) -> Result<Self, SessionKeyError> {
        if !is_gateway_agent_id(agent_id) {
            return Err(SessionKeyError::AgentId(agent_id.to_owned()));
        }
        let (tag, id, field) = match conversation {
            Conversation::State(s) => ('s', s, "stateKey"),
            Conversation::Run(r) => ('r', r, "runId"),
        };
        if !valid_id(billing_account_id) {
            return Err(SessionKeyError::Id("billingAccountId"));
        }
        if !valid_id(id) {
            return Err(SessionKeyError::Id(field));
        }
        let account = escape_id(billing_account_id).ok_or(SessionKeyError::Id("billingAccountId"))?;
        let id = escape_id(id).ok_or(SessionKeyError::Id(field))?;
        Ok(Self(format!("agent:{agent_id}:{CHANNEL}:{account}.{tag}.{id}")))
    }

    /// Canonicalises a key the way the gateway does for keys without case-preserving channel
    /// grammars (which clawmux never builds): lower-cased, `agent:main:` prefixed when missing.
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
    use proptest::prelude::*;

    fn key(agent: &str, account: &str, c: Conversation<'_>) -> String {
        SessionKey::for_run(agent, account, c).expect("valid ids").as_str().to_owned()
    }

    #[test]
    fn plain_ids_stay_readable() {
        assert_eq!(key("main", "acct-42", Conversation::State("c1")), "agent:main:clawmux:acct-42.s.c1");
        assert_eq!(key("main", "acct-42", Conversation::Run("r1")), "agent:main:clawmux:acct-42.r.r1");
    }

    #[test]
    fn the_collisions_of_the_old_rule_are_gone() {
        // (`t-a:x`, state `y`) vs (`t-a`, state `x:y`): the same key under plain concatenation.
        assert_ne!(key("main", "t-a:x", Conversation::State("y")), key("main", "t-a", Conversation::State("x:y")));
        // `Acme` and `acme` are different accounts; the gateway lower-cases keys.
        let (upper, lower) = (key("main", "Acme", Conversation::State("c1")), key("main", "acme", Conversation::State("c1")));
        assert_ne!(upper, lower);
        assert_eq!(upper, upper.to_lowercase(), "already canonical");
        // A state key equal to another run's id.
        assert_ne!(key("main", "a", Conversation::State("x")), key("main", "a", Conversation::Run("x")));
    }

    #[test]
    fn ids_cannot_forge_the_gateways_key_grammar() {
        for id in ["cron", "x:thread:y", "subagent:z", "direct:peer", "acp:binding:1", "Signal:Group:X"] {
            let k = key("main", id, Conversation::State(id));
            let rest = k.strip_prefix("agent:main:clawmux:").expect("fixed channel");
            assert!(!rest.contains(':'), "{k}");
            assert!(!k.contains(":thread:"), "{k}");
        }
    }

    #[test]
    fn bad_ids_are_refused() {
        assert_eq!(SessionKey::for_run("Main", "a", Conversation::Run("r")), Err(SessionKeyError::AgentId("Main".into())));
        assert!(SessionKey::for_run("main", "", Conversation::Run("r")).is_err());
        assert!(SessionKey::for_run("main", "a b", Conversation::Run("r")).is_err());
        assert_eq!(SessionKey::for_run("main", "a", Conversation::State("é")), Err(SessionKeyError::Id("stateKey")));
        assert_eq!(SessionKey::for_run("main", "a", Conversation::Run(&"x".repeat(129))), Err(SessionKeyError::Id("runId")));
    }

    #[test]
    fn canonicalize_matches_the_gateway() {
        assert_eq!(SessionKey::canonicalize("acct9:runA").as_str(), "agent:main:acct9:runa");
        assert_eq!(SessionKey::canonicalize("agent:main:Acct9:RunB").as_str(), "agent:main:acct9:runb");
    }

    #[test]
    fn matches_wire_is_exact_after_canonicalisation() {
        let k = SessionKey::for_run("main", "a", Conversation::Run("r")).expect("key");
        assert!(k.matches_wire("agent:main:clawmux:a.r.r"));
        assert!(k.matches_wire("AGENT:MAIN:CLAWMUX:A.R.R"));
        assert!(!k.matches_wire("agent:main:clawmux:a.r.r2"));
        assert!(!k.matches_wire(""));
    }

    /// Every id of up to `n` characters over an alphabet with each class of character the
    /// encoding treats differently (kept, upper-cased, each escaped one, the escape's digits).
    fn all_ids(n: usize) -> Vec<String> {
        let alphabet = ['a', 'A', 'z', '0', '1', '2', '-', '_', ':', '.'];
        let mut out: Vec<String> = vec![String::new()];
        let mut all = Vec::new();
        for _ in 0..n {
            out = out.iter().flat_map(|p| alphabet.iter().map(move |c| format!("{p}{c}"))).collect();
            all.extend(out.iter().cloned());
        }
        all
    }

    /// Exhaustive over short ids: no two (account, conversation) pairs share a key after the
    /// gateway's canonicalisation (random pairs rarely hit a near-collision; this hits them all).
    #[test]
    fn short_ids_are_injective_exhaustively() {
        let ids = all_ids(2);
        let mut seen = std::collections::HashMap::new();
        for account in &ids {
            for id in &ids {
                for state in [true, false] {
                    let conv = if state { Conversation::State(id) } else { Conversation::Run(id) };
                    let k = SessionKey::for_run("main", account, conv).expect("valid");
                    let canonical = SessionKey::canonicalize(k.as_str());
                    if let Some(prev) = seen.insert(canonical, (account.clone(), id.clone(), state)) {
                        panic!("{k} for {:?} and {prev:?}", (account, id, state));
                    }
                }
            }
        }
        let escaped: std::collections::HashSet<String> = all_ids(3).iter().map(|i| escape_id(i).expect("id")).collect();
        assert_eq!(escaped.len(), all_ids(3).len(), "escape_id is injective on ids of up to 3 characters");
    }

    fn id() -> impl Strategy<Value = String> {
        // Short ids over a small alphabet with every special character and both cases, so that
        // near-collisions (case, ':' and '.' placement, escape look-alikes) are generated often.
        "[aAbB_:.\\-0-1]{1,6}"
    }

    fn conversation() -> impl Strategy<Value = (bool, String)> {
        (any::<bool>(), id())
    }

    fn build(agent: &str, account: &str, (state, c): &(bool, String)) -> Option<String> {
        let conv = if *state { Conversation::State(c) } else { Conversation::Run(c) };
        SessionKey::for_run(agent, account, conv).ok().map(|k| k.as_str().to_owned())
    }

    proptest! {
        /// Injective after the gateway's canonicalisation: two keys that the gateway would treat
        /// as the same session come only from identical (agent, account, conversation).
        #[test]
        fn distinct_runs_never_share_a_session(
            a1 in "[a-c_-]{1,3}", acct1 in id(), c1 in conversation(),
            a2 in "[a-c_-]{1,3}", acct2 in id(), c2 in conversation(),
        ) {
            if let (Some(k1), Some(k2)) = (build(&a1, &acct1, &c1), build(&a2, &acct2, &c2)) {
                let same = SessionKey::canonicalize(&k1) == SessionKey::canonicalize(&k2);
                prop_assert_eq!(same, (a1, acct1, c1) == (a2, acct2, c2));
            }
        }

        /// Keys are already canonical, so routing by byte equality matches the gateway's frames.
        #[test]
        fn keys_are_canonical(agent in "[a-z0-9][a-z0-9_-]{0,5}", acct in id(), c in conversation()) {
            let k = build(&agent, &acct, &c).expect("valid ids build a key");
            let canonical = SessionKey::canonicalize(&k);
            prop_assert_eq!(canonical.as_str(), k.as_str());
        }

        /// Escaping round-trips over the whole id alphabet.
        #[test]
        fn escape_round_trips(s in "[A-Za-z0-9._:-]{1,40}") {
            let e = escape_id(&s).expect("id alphabet");
            prop_assert!(e.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-'));
            prop_assert_eq!(unescape_id(&e), Some(s));
        }
    }
}
