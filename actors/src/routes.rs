//! The routing table: `(sessionKey, runId)` → the run that owns them. Fail-closed: a frame is
//! delivered only when BOTH match a registered run; everything else is dropped with a reason
//! that is counted.

use std::collections::HashMap;

/// Why a run-scoped frame was not delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// The frame has no session key.
    MissingSessionKey,
    /// The frame has no run id.
    MissingRunId,
    /// No run of this process uses the session key (another client's session).
    ForeignSession,
    /// The session is ours but the run id is not (another run on the same session, or a late frame).
    ForeignRun,
}

impl DropReason {
    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::MissingSessionKey => "missing_session_key",
            DropReason::MissingRunId => "missing_run_id",
            DropReason::ForeignSession => "foreign_session",
            DropReason::ForeignRun => "foreign_run",
        }
    }
}

/// Routes keyed by session key, then run id. Keys are stored canonical (lower-case); frames from
/// the gateway carry canonical keys, so lookups are exact byte comparisons.
#[derive(Debug)]
pub struct RouteTable<T> {
    by_session: HashMap<String, HashMap<String, T>>,
    len: usize,
}

impl<T> Default for RouteTable<T> {
    fn default() -> Self {
        Self { by_session: HashMap::new(), len: 0 }
    }
}

impl<T> RouteTable<T> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a run; returns the previous owner of the same pair, if any.
    pub fn insert(&mut self, session_key: &str, run_id: &str, target: T) -> Option<T> {
        let prev = self.by_session.entry(session_key.to_owned()).or_default().insert(run_id.to_owned(), target);
        if prev.is_none() {
            self.len += 1;
        }
        prev
    }

    /// Removes a run.
    pub fn remove(&mut self, session_key: &str, run_id: &str) -> Option<T> {
        let runs = self.by_session.get_mut(session_key)?;
        let prev = runs.remove(run_id);
        if runs.is_empty() {
            self.by_session.remove(session_key);
        }
        if prev.is_some() {
            self.len -= 1;
        }
        prev
    }

    /// The owner of a frame's `(sessionKey, runId)`, or why there is none.
    pub fn route(&self, session_key: Option<&str>, run_id: Option<&str>) -> Result<&T, DropReason> {
        let session_key = session_key.filter(|s| !s.is_empty()).ok_or(DropReason::MissingSessionKey)?;
        let run_id = run_id.filter(|s| !s.is_empty()).ok_or(DropReason::MissingRunId)?;
        let runs = self.by_session.get(session_key).ok_or(DropReason::ForeignSession)?;
        runs.get(run_id).ok_or(DropReason::ForeignRun)
    }

    /// Number of registered runs.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no run is registered.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every registered target.
    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.by_session.values().flat_map(|m| m.values())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn delivers_only_on_both_keys() {
        let mut t = RouteTable::new();
        t.insert("agent:main:a:1", "r1", 1);
        t.insert("agent:main:b:1", "r2", 2);
        assert_eq!(t.route(Some("agent:main:a:1"), Some("r1")), Ok(&1));
        assert_eq!(t.route(Some("agent:main:a:1"), Some("r2")), Err(DropReason::ForeignRun));
        assert_eq!(t.route(Some("agent:main:c:1"), Some("r1")), Err(DropReason::ForeignSession));
        assert_eq!(t.route(None, Some("r1")), Err(DropReason::MissingSessionKey));
        assert_eq!(t.route(Some(""), Some("r1")), Err(DropReason::MissingSessionKey));
        assert_eq!(t.route(Some("agent:main:a:1"), None), Err(DropReason::MissingRunId));
        assert_eq!(t.route(Some("AGENT:MAIN:A:1"), Some("r1")), Err(DropReason::ForeignSession));
    }

    #[test]
    fn remove_cleans_up() {
        let mut t = RouteTable::new();
        t.insert("s", "r", ());
        assert_eq!(t.len(), 1);
        assert!(t.remove("s", "r").is_some());
        assert!(t.remove("s", "r").is_none());
        assert!(t.is_empty());
        assert_eq!(t.route(Some("s"), Some("r")), Err(DropReason::ForeignSession));
    }

    proptest! {
        /// A frame reaches a run only if it carries exactly that run's session key and run id.
        #[test]
        fn never_delivers_to_another_run(
            runs in proptest::collection::hash_set(("[a-c]{1,2}", "[x-z]{1,2}"), 1..10),
            probe in ("[a-c]{0,2}", "[x-z]{0,2}"),
        ) {
            let mut t = RouteTable::new();
            for (s, r) in &runs { t.insert(s, r, (s.clone(), r.clone())); }
            if let Ok((s, r)) = t.route(Some(&probe.0), Some(&probe.1)) {
                prop_assert_eq!(s, &probe.0);
                prop_assert_eq!(r, &probe.1);
            } else {
                prop_assert!(!runs.contains(&probe));
            }
        }
    }
}
