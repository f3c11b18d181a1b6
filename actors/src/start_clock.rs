//! Where a new run's wait for `accepted` goes, stage by stage (`clawmux_run_start_seconds{stage}`).
//!
//! A caller sees one number, the time from its `POST` to the `accepted` event. Behind it are four
//! waits with four different owners, and only a measurement per stage says which one to work on
//! (BENCHMARKS.md found them once with temporary builds; this keeps them measured):
//! - `admit`: request parsed → run stored and in the registry (the HTTP layer's share; observed
//!   there, not here);
//! - `turn`: admitted → the run's turn (a start slot, the session key's FIFO, a branch lock: a run
//!   queued behind another run of its session key waits here for that run's end);
//! - `configure`: turn → `agent` sent (a branch run's worktree, the model override's
//!   `sessions.patch`, `sessions.subscribe`: round trips to the gateway);
//! - `gateway`: `agent` sent → its ACK handled (the gateway's own latency and the path through the
//!   supervisor both ways).
//!
//! Only runs admitted by this process are timed: a run continued after a restart started its
//! stages in another process. An ephemeral run (its own container, no gateway session) has the
//! `admit` stage only.

use std::time::{Duration, Instant};

/// A stage of a run's start (the `stage` label's values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartStage {
    /// Request parsed → run admitted (observed by the HTTP layer).
    Admit,
    /// Admitted → the run's turn.
    Turn,
    /// Turn → `agent` sent.
    Configure,
    /// `agent` sent → ACK handled.
    Gateway,
}

impl StartStage {
    /// Every stage, in order.
    pub const ALL: [StartStage; 4] = [StartStage::Admit, StartStage::Turn, StartStage::Configure, StartStage::Gateway];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            StartStage::Admit => "admit",
            StartStage::Turn => "turn",
            StartStage::Configure => "configure",
            StartStage::Gateway => "gateway",
        }
    }
}

/// The instants a run's start passed, and which stages were already reported: each stage is
/// reported at most once per run.
#[derive(Debug, Clone)]
pub struct StartClock {
    admitted: Instant,
    turn: Option<Instant>,
    /// The latest `agent` request (a retry after the gateway said "unavailable" sends it again:
    /// the gateway's stage is the attempt it accepted).
    sent: Option<Instant>,
    configured: bool,
    accepted: bool,
}

impl StartClock {
    /// A run admitted at `admitted`.
    pub fn new(admitted: Instant) -> Self {
        Self { admitted, turn: None, sent: None, configured: false, accepted: false }
    }

    /// The run got its turn at `now` (the turn that lets it go: a branch run told to wait for its
    /// branch is still waiting): the `turn` stage's time, on the first such turn.
    pub fn turn(&mut self, now: Instant) -> Option<(StartStage, Duration)> {
        if self.turn.is_some() {
            return None;
        }
        self.turn = Some(now);
        Some((StartStage::Turn, now.saturating_duration_since(self.admitted)))
    }

    /// `agent` was sent at `now`: the `configure` stage's time on the first send after the turn.
    pub fn sent(&mut self, now: Instant) -> Option<(StartStage, Duration)> {
        self.sent = Some(now);
        let turn = self.turn?;
        if std::mem::replace(&mut self.configured, true) {
            return None;
        }
        Some((StartStage::Configure, now.saturating_duration_since(turn)))
    }

    /// The gateway's ACK was handled at `now`: the `gateway` stage's time (since the latest send),
    /// once.
    pub fn accepted(&mut self, now: Instant) -> Option<(StartStage, Duration)> {
        let sent = self.sent?;
        if std::mem::replace(&mut self.accepted, true) {
            return None;
        }
        Some((StartStage::Gateway, now.saturating_duration_since(sent)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn each_stage_is_the_time_since_the_one_before() {
        let t0 = Instant::now();
        let mut c = StartClock::new(t0);
        assert_eq!(c.turn(t0 + ms(30)), Some((StartStage::Turn, ms(30))));
        assert_eq!(c.sent(t0 + ms(45)), Some((StartStage::Configure, ms(15))));
        assert_eq!(c.accepted(t0 + ms(75)), Some((StartStage::Gateway, ms(30))));
    }

    #[test]
    fn each_stage_is_reported_once() {
        let t0 = Instant::now();
        let mut c = StartClock::new(t0);
        assert!(c.turn(t0 + ms(1)).is_some());
        assert_eq!(c.turn(t0 + ms(9)), None);
        assert!(c.sent(t0 + ms(2)).is_some());
        assert!(c.accepted(t0 + ms(3)).is_some());
        assert_eq!(c.accepted(t0 + ms(4)), None);
    }

    #[test]
    fn a_resent_agent_request_starts_the_gateway_stage_again() {
        // The first `agent` was answered "unavailable"; the retry is the attempt that was accepted.
        let t0 = Instant::now();
        let mut c = StartClock::new(t0);
        c.turn(t0);
        assert_eq!(c.sent(t0 + ms(10)), Some((StartStage::Configure, ms(10))));
        assert_eq!(c.sent(t0 + ms(500)), None, "configure is counted on the first send only");
        assert_eq!(c.accepted(t0 + ms(520)), Some((StartStage::Gateway, ms(20))));
    }

    #[test]
    fn nothing_is_reported_for_a_stage_whose_start_was_not_seen() {
        // A send without a turn (not a path a run takes) or an ACK without a send.
        let t0 = Instant::now();
        let mut c = StartClock::new(t0);
        assert_eq!(c.accepted(t0 + ms(5)), None);
        assert_eq!(c.sent(t0 + ms(5)), None);
        let mut c = StartClock::new(t0 + ms(10));
        assert_eq!(c.turn(t0), Some((StartStage::Turn, Duration::ZERO)), "a clock going back is not a negative wait");
    }
}
