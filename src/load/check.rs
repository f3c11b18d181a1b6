//! The isolation checker (pure): given what the driver saw of one run, in arrival order, says
//! how the run ended and which rules of the SSE contract it broke.
//!
//! Every run's message carries a unique marker (`load-<32 hex>`), and the replay gateway and the
//! fake LLM both echo the message into the answer. So a run's text shows whose run it belongs to:
//! its own marker must be there, and any OTHER marker in it is another caller's tokens leaking into
//! this stream, the one failure a multiplexer must never have. The checker finds foreign markers
//! by their shape, without knowing the other runs, so it also catches text from runs of another
//! load process or of an earlier test.

use std::fmt;

/// Prefix of every marker; the rest is a simple (32 lowercase hex digit) UUID.
pub const MARKER_PREFIX: &str = "load-";
const MARKER_HEX_LEN: usize = 32;

/// A fresh marker: `load-<uuid without dashes>`.
pub fn new_marker() -> String {
    format!("{MARKER_PREFIX}{}", uuid::Uuid::new_v4().simple())
}

/// Every marker-shaped substring of `text`, in order.
pub fn markers_in(text: &str) -> impl Iterator<Item = &str> {
    text.match_indices(MARKER_PREFIX).filter_map(move |(i, _)| {
        let end = i + MARKER_PREFIX.len() + MARKER_HEX_LEN;
        let candidate = text.get(i..end)?;
        let hex = &candidate[MARKER_PREFIX.len()..];
        hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)).then_some(candidate)
    })
}

/// One observed event of a run, reduced to what the checks need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed {
    /// `accepted`.
    Accepted,
    /// `text_delta` with its text.
    TextDelta(String),
    /// `final` with the run document's `content`.
    Final {
        /// The final text.
        content: String,
    },
    /// `error` (terminal) with its code and message.
    Error {
        /// The run error code (`timeout`, `agent_error`, ...).
        code: String,
        /// Its message (checked for foreign markers too).
        message: String,
    },
    /// Anything else (`status`, `relay`, unknown names): allowed, not checked.
    Other(String),
}

impl Observed {
    fn is_terminal(&self) -> bool {
        matches!(self, Observed::Final { .. } | Observed::Error { .. })
    }
}

/// A broken rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// The stream ended without a terminal event.
    NoTerminal,
    /// More than one terminal event.
    MultipleTerminals(usize),
    /// Events after the terminal one.
    EventAfterTerminal,
    /// A run that ended `final` did not have exactly one `accepted`.
    AcceptedCount(usize),
    /// The final text lacks the run's own marker.
    MissingOwnMarker,
    /// Another run's marker in this run's text: a leak.
    ForeignMarker(String),
    /// The concatenated deltas are not a prefix of the final content.
    DeltasNotPrefix,
}

impl Violation {
    /// A short stable name (report keys).
    pub fn kind(&self) -> &'static str {
        match self {
            Violation::NoTerminal => "no_terminal",
            Violation::MultipleTerminals(_) => "multiple_terminals",
            Violation::EventAfterTerminal => "event_after_terminal",
            Violation::AcceptedCount(_) => "accepted_count",
            Violation::MissingOwnMarker => "missing_own_marker",
            Violation::ForeignMarker(_) => "foreign_marker",
            Violation::DeltasNotPrefix => "deltas_not_prefix",
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::NoTerminal => write!(f, "stream ended without a terminal event"),
            Violation::MultipleTerminals(n) => write!(f, "{n} terminal events"),
            Violation::EventAfterTerminal => write!(f, "events after the terminal event"),
            Violation::AcceptedCount(n) => write!(f, "{n} accepted events"),
            Violation::MissingOwnMarker => write!(f, "final text lacks the run's own marker"),
            Violation::ForeignMarker(m) => write!(f, "text of another run ({m}) in this run's stream"),
            Violation::DeltasNotPrefix => write!(f, "concatenated text_delta is not a prefix of the final content"),
        }
    }
}

/// How a run ended, as the caller saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// A `final` event.
    Final,
    /// An `error` event with this code (the first one, if several).
    Error(String),
    /// No terminal event.
    Unfinished,
}

/// The checker's verdict on one run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// How it ended.
    pub outcome: Outcome,
    /// Every broken rule (empty for a good run).
    pub violations: Vec<Violation>,
}

/// Checks one run. `stream_complete` is false when the driver gave up on the stream (its own
/// timeout): then a missing terminal event is the driver's error, not the server's violation.
pub fn check_run(marker: &str, events: &[Observed], stream_complete: bool) -> Verdict {
    let mut violations = Vec::new();
    let terminals: Vec<usize> = events.iter().enumerate().filter(|(_, e)| e.is_terminal()).map(|(i, _)| i).collect();
    match terminals.len() {
        0 if stream_complete => violations.push(Violation::NoTerminal),
        0 | 1 => {}
        n => violations.push(Violation::MultipleTerminals(n)),
    }
    if let Some(&first) = terminals.first() {
        if first + 1 < events.len() && terminals.len() == 1 {
            violations.push(Violation::EventAfterTerminal);
        }
    }
    let outcome = match terminals.first().map(|&i| &events[i]) {
        Some(Observed::Final { .. }) => Outcome::Final,
        Some(Observed::Error { code, .. }) => Outcome::Error(code.clone()),
        _ => Outcome::Unfinished,
    };

    let mut streamed = String::new();
    let mut foreign: Vec<String> = Vec::new();
    let mut scan = |text: &str| {
        for m in markers_in(text) {
            if m != marker && !foreign.iter().any(|f| f == m) {
                foreign.push(m.to_owned());
            }
        }
    };
    for e in events {
        match e {
            Observed::TextDelta(t) => streamed.push_str(t),
            Observed::Final { content } => scan(content),
            Observed::Error { message, .. } => scan(message),
            Observed::Accepted | Observed::Other(_) => {}
        }
    }
    // The concatenation, not each delta: a marker may be split across two deltas.
    scan(&streamed);
    violations.extend(foreign.into_iter().map(Violation::ForeignMarker));

    if let Some(Observed::Final { content }) = terminals.first().map(|&i| &events[i]) {
        let accepted = events.iter().filter(|e| matches!(e, Observed::Accepted)).count();
        if accepted != 1 {
            violations.push(Violation::AcceptedCount(accepted));
        }
        if !content.contains(marker) {
            violations.push(Violation::MissingOwnMarker);
        }
        if !content.starts_with(&streamed) {
            violations.push(Violation::DeltasNotPrefix);
        }
    }
    Verdict { outcome, violations }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delta(s: &str) -> Observed {
        Observed::TextDelta(s.to_owned())
    }
    fn fin(s: &str) -> Observed {
        Observed::Final { content: s.to_owned() }
    }

    const ME: &str = "load-0123456789abcdef0123456789abcdef";
    const OTHER: &str = "load-fedcba9876543210fedcba9876543210";

    #[test]
    fn a_good_run_passes() {
        let text = format!("{ME} hi | Hello");
        let events = [Observed::Accepted, Observed::Other("status".into()), delta(&text[..10]), delta(&text[10..]), fin(&text)];
        let v = check_run(ME, &events, true);
        assert_eq!(v, Verdict { outcome: Outcome::Final, violations: vec![] });
    }

    /// The checker must catch a leak: a stream carrying another run's marker fails.
    #[test]
    fn a_foreign_marker_is_caught() {
        let mine = format!("{ME} hi | Hello");
        // Split across two deltas, so only the concatenation shows it.
        let leaked = format!(" and {OTHER} secret");
        let (a, b) = leaked.split_at(12);
        let events = [Observed::Accepted, delta(&mine), delta(a), delta(b), fin(&format!("{mine}{leaked}"))];
        let v = check_run(ME, &events, true);
        assert_eq!(v.outcome, Outcome::Final);
        assert_eq!(v.violations, vec![Violation::ForeignMarker(OTHER.to_owned())]);

        // Only in the final content, and in an error message: caught too.
        let v = check_run(ME, &[Observed::Accepted, fin(&format!("{ME} {OTHER}"))], true);
        assert_eq!(v.violations, vec![Violation::ForeignMarker(OTHER.to_owned())]);
        let err = Observed::Error { code: "agent_error".into(), message: format!("failed on {OTHER}") };
        assert_eq!(check_run(ME, &[err], true).violations, vec![Violation::ForeignMarker(OTHER.to_owned())]);
    }

    #[test]
    fn contract_breaks_are_reported() {
        assert_eq!(check_run(ME, &[Observed::Accepted], true).violations, vec![Violation::NoTerminal]);
        assert!(check_run(ME, &[Observed::Accepted], false).violations.is_empty(), "driver timeout is not a violation");
        let two = [Observed::Accepted, fin(ME), fin(ME)];
        assert_eq!(check_run(ME, &two, true).violations, vec![Violation::MultipleTerminals(2)]);
        let after = [Observed::Accepted, fin(ME), delta("x")];
        assert!(check_run(ME, &after, true).violations.contains(&Violation::EventAfterTerminal));
        let no_marker = [Observed::Accepted, fin("hello")];
        assert_eq!(check_run(ME, &no_marker, true).violations, vec![Violation::MissingOwnMarker]);
        let not_prefix = [Observed::Accepted, delta("abc"), fin(&format!("{ME} abd"))];
        assert_eq!(check_run(ME, &not_prefix, true).violations, vec![Violation::DeltasNotPrefix]);
        let no_accept = [fin(ME)];
        assert_eq!(check_run(ME, &no_accept, true).violations, vec![Violation::AcceptedCount(0)]);
    }

    #[test]
    fn errors_are_outcomes_not_violations() {
        let e = [Observed::Accepted, delta(ME), Observed::Error { code: "timeout".into(), message: "too slow".into() }];
        let v = check_run(ME, &e, true);
        assert_eq!(v.outcome, Outcome::Error("timeout".into()));
        assert!(v.violations.is_empty());
    }

    #[test]
    fn marker_shapes() {
        let m = new_marker();
        assert_eq!(markers_in(&format!("x{m}y")).collect::<Vec<_>>(), vec![m.as_str()]);
        assert_eq!(markers_in("load-xyz load-0123").count(), 0);
        assert_eq!(markers_in(&format!("{ME}{OTHER}")).count(), 2);
    }
}
