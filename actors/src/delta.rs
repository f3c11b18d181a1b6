//! Cumulative chat text → incremental deltas, by prefix comparison.
//!
//! The gateway's `chat` deltas carry the CUMULATIVE text of the current assistant message, coalesced
//! (several LLM chunks can arrive as one delta). The reference client diffed by length, which lost
//! text when a new turn's first delta was longer than the previous turn, and repeated it when shorter.
//! This tracker compares prefixes:
//! - the new text extends the current turn's text → emit the extension;
//! - the new text is a prefix of the current turn's text (a shrink, e.g. a stale coalesced frame)
//!   → emit nothing; the text already sent stays sent;
//! - anything else is a new turn → emit a blank-line separator (the final content joins payloads by
//!   blank lines) and the whole new text.

/// Tracks one run's streamed text.
#[derive(Debug, Default, Clone)]
pub struct DeltaTracker {
    /// Cumulative text of the current turn as last seen.
    turn: String,
    /// Everything emitted so far, across turns (what the caller has concatenated).
    emitted: String,
    /// Resumed after a restart: the current turn's text is unknown, only what was emitted.
    resuming: bool,
}

impl DeltaTracker {
    /// A tracker with nothing emitted.
    pub fn new() -> Self {
        Self::default()
    }

    /// A tracker continuing a run whose deltas so far concatenate to `emitted` (a restart of
    /// clawmux lost the tracker, not the delivered text). Frames whose text was delivered already
    /// repeat nothing; the first one that goes beyond continues where `emitted` ends: its longest
    /// prefix that `emitted` already ends with is not repeated.
    pub fn resumed(emitted: String) -> Self {
        Self { turn: String::new(), resuming: !emitted.is_empty(), emitted }
    }

    /// Feeds the cumulative text of a `chat` frame; returns the increment to emit, if any.
    pub fn push(&mut self, cumulative: &str) -> Option<String> {
        if cumulative.is_empty() {
            return None;
        }
        if self.resuming {
            if self.emitted.contains(cumulative) {
                // Delivered already: the turn the restart cut is being sent again from its start
                // (the gateway retried an LLM call the restart cut short), or is not past the cut
                // yet. Wait for a frame that goes beyond what was delivered.
                return None;
            }
            self.resuming = false;
            self.turn = cumulative.to_owned();
            let k = overlap(&self.emitted, cumulative);
            // Nothing of it was delivered: a new turn; else it continues where `emitted` ends.
            let out = if k == 0 { format!("\n\n{cumulative}") } else { cumulative[k..].to_owned() };
            self.emitted.push_str(&out);
            return Some(out);
        }
        if let Some(ext) = cumulative.strip_prefix(self.turn.as_str()) {
            if ext.is_empty() {
                return None;
            }
            let ext = ext.to_owned();
            self.turn.push_str(&ext);
            self.emitted.push_str(&ext);
            return Some(ext);
        }
        if self.turn.starts_with(cumulative) {
            return None;
        }
        let mut out = String::with_capacity(cumulative.len() + 2);
        if !self.emitted.is_empty() {
            out.push_str("\n\n");
        }
        out.push_str(cumulative);
        self.turn = cumulative.to_owned();
        self.emitted.push_str(&out);
        Some(out)
    }

    /// Given the authoritative final content, the remainder still to emit so that the deltas add up
    /// to it exactly; `None` when nothing is missing or the streamed text diverged from it (then the
    /// deltas stay a prefix of what was streamed and the final document is the truth).
    pub fn complete(&mut self, content: &str) -> Option<String> {
        let rest = content.strip_prefix(self.emitted.as_str())?;
        if rest.is_empty() {
            return None;
        }
        let rest = rest.to_owned();
        self.emitted.push_str(&rest);
        self.turn.push_str(&rest);
        Some(rest)
    }

    /// Everything emitted so far.
    pub fn emitted(&self) -> &str {
        &self.emitted
    }

    /// Forgets what was emitted past `len` bytes (a delta that was not delivered after all); a
    /// `len` past the end or off a char boundary changes nothing.
    pub fn forget_after(&mut self, len: usize) {
        if self.emitted.is_char_boundary(len) {
            self.emitted.truncate(len);
        }
    }
}

/// The length of the longest prefix of `next` that `done` ends with, on a char boundary
/// (prefix function over `next`, then a scan of `done`'s tail: linear in the text sizes).
fn overlap(done: &str, next: &str) -> usize {
    // Only a prefix no longer than `done` can be a border: the table (a word per byte) is kept to
    // that, not to a whole frame's text (a resumed run's first frame may hold megabytes).
    let p = &next.as_bytes()[..next.len().min(done.len())];
    let mut fail = vec![0usize; p.len()];
    let mut k = 0;
    for i in 1..p.len() {
        while k > 0 && p[i] != p[k] {
            k = fail[k - 1];
        }
        if p[i] == p[k] {
            k += 1;
        }
        fail[i] = k;
    }
    let tail = &done.as_bytes()[done.len().saturating_sub(p.len())..];
    let mut m = 0;
    for &b in tail {
        while m > 0 && (m == p.len() || b != p[m]) {
            m = fail[m - 1];
        }
        if m < p.len() && b == p[m] {
            m += 1;
        }
    }
    // `m` is the longest border; shorter ones follow the failure chain.
    while m > 0 && !next.is_char_boundary(m) {
        m = fail[m - 1];
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The border table is kept to the text already delivered, not to the frame's: a resumed
    /// run's first frame of 25 MiB after 10 bytes needs a table of 10 words, not 25 M.
    #[test]
    fn a_long_frame_after_short_text_overlaps_without_a_frame_sized_table() {
        let next = format!("world{}", "x".repeat(1 << 20));
        assert_eq!(overlap("hello world", &next), 5);
        assert_eq!(overlap("hello", &next), 0);
        assert_eq!(overlap("", &next), 0);
        assert_eq!(overlap("héllo wé", "wé, more"), 3);
    }

    fn feed(frames: &[&str]) -> (Vec<String>, String) {
        let mut t = DeltaTracker::new();
        let out: Vec<String> = frames.iter().filter_map(|f| t.push(f)).collect();
        (out, t.emitted().to_owned())
    }

    #[test]
    fn extensions_are_emitted_once() {
        let (out, all) = feed(&["Hel", "Hello", "Hello", "Hello wor", "Hello world"]);
        assert_eq!(out, ["Hel", "lo", " wor", "ld"]);
        assert_eq!(all, "Hello world");
    }

    #[test]
    fn shrinking_text_repeats_nothing() {
        let (out, all) = feed(&["Hello world", "Hello", "Hello world!"]);
        assert_eq!(out, ["Hello world", "!"]);
        assert_eq!(all, "Hello world!");
    }

    #[test]
    fn a_longer_new_turn_loses_nothing() {
        // The reference's length diff dropped the first 5 characters of the second turn here.
        let (out, all) = feed(&["Let me", "Let me check", "Done: all tests pass", "Done: all tests pass now"]);
        assert_eq!(out, ["Let me", " check", "\n\nDone: all tests pass", " now"]);
        assert_eq!(all, "Let me check\n\nDone: all tests pass now");
    }

    #[test]
    fn a_shorter_new_turn_repeats_nothing() {
        let (out, _) = feed(&["A long first turn", "Ok", "Ok!"]);
        assert_eq!(out, ["A long first turn", "\n\nOk", "!"]);
    }

    #[test]
    fn multibyte_text_is_split_on_char_boundaries() {
        let (out, all) = feed(&["héllo", "héllo wörld ✓"]);
        assert_eq!(out, ["héllo", " wörld ✓"]);
        assert_eq!(all, "héllo wörld ✓");
    }

    #[test]
    fn complete_emits_only_a_missing_tail() {
        let mut t = DeltaTracker::new();
        t.push("Hello");
        assert_eq!(t.complete("Hello world").as_deref(), Some(" world"));
        assert_eq!(t.complete("Hello world"), None);
        assert_eq!(t.complete("Something else"), None);
    }

    #[test]
    fn a_resumed_tracker_continues_without_repeating() {
        let mut t = DeltaTracker::resumed("First turn\n\nHello wor".to_owned());
        assert_eq!(t.push("Hello world").as_deref(), Some("ld"));
        assert_eq!(t.push("Hello world!").as_deref(), Some("!"));
        assert_eq!(t.emitted(), "First turn\n\nHello world!");
        // A new turn after the restart.
        let mut t = DeltaTracker::resumed("Done".to_owned());
        assert_eq!(t.push("Next").as_deref(), Some("\n\nNext"));
        // Nothing new yet.
        let mut t = DeltaTracker::resumed("abc".to_owned());
        assert_eq!(t.push("abc"), None);
        assert_eq!(t.push("abcd").as_deref(), Some("d"));
        // Multi-byte text: the overlap never splits a character.
        let mut t = DeltaTracker::resumed("héllo wö".to_owned());
        assert_eq!(t.push("héllo wörld").as_deref(), Some("rld"));
    }

    #[test]
    fn a_turn_sent_again_from_its_start_after_a_resume_repeats_nothing() {
        // The restart cut the LLM stream too: the gateway retried the call and streams the same
        // answer again from its start.
        let mut t = DeltaTracker::resumed("Reply: w1 w2 w3".to_owned());
        for frame in ["Reply", "Reply: w1", "Reply: w1 w2 w3"] {
            assert_eq!(t.push(frame), None, "{frame}");
        }
        assert_eq!(t.push("Reply: w1 w2 w3 w4").as_deref(), Some(" w4"));
        assert_eq!(t.push("Reply: w1 w2 w3 w4 w5").as_deref(), Some(" w5"));
        assert_eq!(t.emitted(), "Reply: w1 w2 w3 w4 w5");
        // Periodic text: no later occurrence of a prefix is mistaken for the turn's start.
        let mut t = DeltaTracker::resumed("abab".to_owned());
        let out: Vec<String> = ["a", "ab", "aba", "abab", "ababc"].iter().filter_map(|f| t.push(f)).collect();
        assert_eq!(out, ["c"]);
    }

    proptest! {
        /// After a restart at any point of a turn, the deltas still concatenate to the text.
        #[test]
        fn resuming_anywhere_loses_and_repeats_nothing(turn in "[abé ]{1,30}", cut in 0usize..30, more in "[abé ]{0,10}") {
            let mut cut = cut.min(turn.len());
            while !turn.is_char_boundary(cut) { cut -= 1; }
            let full = format!("{turn}{more}");
            let mut t = DeltaTracker::resumed(turn[..cut].to_owned());
            let mut joined = turn[..cut].to_owned();
            if let Some(d) = t.push(&turn) { joined.push_str(&d); }
            if let Some(d) = t.push(&full) { joined.push_str(&d); }
            // A cut at 0 is a fresh start; otherwise the restart continues the same turn.
            prop_assert_eq!(joined, full);
        }

        /// After a restart that also cut the turn's LLM stream, the turn is streamed again from
        /// its start: the deltas still concatenate to the text, nothing repeated.
        #[test]
        fn a_turn_restreamed_after_a_resume_loses_and_repeats_nothing(turn in "[abé ]{1,30}", cut in 1usize..30, more in "[abé ]{0,10}", step in 1usize..5) {
            let mut cut = cut.min(turn.len());
            while !turn.is_char_boundary(cut) { cut -= 1; }
            prop_assume!(cut > 0);
            let full = format!("{turn}{more}");
            let mut t = DeltaTracker::resumed(turn[..cut].to_owned());
            let mut joined = turn[..cut].to_owned();
            let mut end = 0;
            while end < full.len() {
                end = (end + step).min(full.len());
                while !full.is_char_boundary(end) { end += 1; }
                if let Some(d) = t.push(&full[..end]) { joined.push_str(&d); }
            }
            prop_assert_eq!(joined, full);
        }

        /// Cumulative growth of one turn: deltas concatenate to the last text, never more.
        #[test]
        fn deltas_concatenate_to_the_cumulative_text(chunks in proptest::collection::vec(".{0,8}", 1..20)) {
            let mut t = DeltaTracker::new();
            let mut cumulative = String::new();
            let mut joined = String::new();
            for c in &chunks {
                cumulative.push_str(c);
                if let Some(d) = t.push(&cumulative) { joined.push_str(&d); }
            }
            prop_assert_eq!(joined, cumulative);
        }

        /// Whatever arrives, the emitted text is the concatenation of the increments.
        #[test]
        fn emitted_is_the_concatenation(frames in proptest::collection::vec("[ab]{0,6}", 0..30)) {
            let mut t = DeltaTracker::new();
            let mut joined = String::new();
            for f in &frames { if let Some(d) = t.push(f) { joined.push_str(&d); } }
            prop_assert_eq!(joined.as_str(), t.emitted());
        }
    }
}
