//! Per-run results → the load report, and its two renderings (pure): a table for people and one
//! JSON object for scripts (`--json`, what `bench/run.sh` reads).

use super::check::{Outcome, Violation};
use super::stats::{summarize, Percentiles};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// How many violations are quoted in full; the rest are only counted.
pub const VIOLATION_SAMPLES: usize = 10;

/// What one run produced.
#[derive(Debug, Clone, PartialEq)]
pub struct RunResult {
    /// The run's marker (names it in violation samples).
    pub marker: String,
    /// How it ended.
    pub outcome: Outcome,
    /// Broken rules.
    pub violations: Vec<Violation>,
    /// Start of the run → `accepted` (ms).
    pub accepted_ms: Option<f64>,
    /// Start of the run → first `text_delta` (ms).
    pub first_delta_ms: Option<f64>,
    /// Start of the run → terminal event (ms).
    pub terminal_ms: Option<f64>,
    /// `text_delta` events received.
    pub deltas: u64,
}

/// Frames a per-call client received from the gateway (the cost of broadcast delivery).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientFrames {
    /// WebSocket connections opened.
    pub connections: u64,
    /// Handshakes completed.
    pub handshakes: u64,
    /// Text frames received, all connections together.
    pub frames_received: u64,
    /// Bytes of those frames.
    pub bytes_received: u64,
    /// `chat`/`agent` events dropped because their sessionKey or runId was not the run's own.
    pub foreign_frames_dropped: u64,
}

/// Latency series.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Latencies {
    /// To `accepted` (per-call: to the `agent` ACK, two connections and handshakes included).
    pub accepted: Option<Percentiles>,
    /// To the first `text_delta`.
    pub first_delta: Option<Percentiles>,
    /// To the terminal event.
    pub terminal: Option<Percentiles>,
}

/// The whole load run.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadReport {
    /// `clawmux` or `per-call`.
    pub mode: String,
    /// The clawmux URL or the gateway URL.
    pub target: String,
    /// Runs asked for.
    pub runs: usize,
    /// Runs started (fewer than `runs` when interrupted or past the deadline).
    pub started: usize,
    /// Concurrency.
    pub concurrency: usize,
    /// Runs that ended with `final`.
    pub finals: usize,
    /// Runs that ended otherwise.
    pub errors: usize,
    /// Those errors by code (run error codes, HTTP ones as `http_<status>`, driver ones).
    pub errors_by_code: BTreeMap<String, usize>,
    /// Broken rules, all runs together. Zero is the only good number.
    pub isolation_violations: usize,
    /// Broken rules by kind.
    pub violations_by_kind: BTreeMap<String, usize>,
    /// The first few broken rules, quoted.
    pub violation_samples: Vec<String>,
    /// Wall time of the whole run (s).
    pub duration_sec: f64,
    /// Runs that ended (final or error) per second of wall time.
    pub runs_per_sec: f64,
    /// Latency percentiles (ms).
    pub latency_ms: Latencies,
    /// `text_delta` events received, all runs.
    pub text_deltas: u64,
    /// Stopped early by SIGINT/SIGTERM or the overall deadline.
    pub interrupted: bool,
    /// Per-call mode only: what the gateway sent to this client.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gateway_frames: Option<ClientFrames>,
}

/// Run-independent facts of a load run, for [`build_report`].
#[derive(Debug, Clone)]
pub struct ReportMeta {
    /// See [`LoadReport::mode`].
    pub mode: String,
    /// See [`LoadReport::target`].
    pub target: String,
    /// See [`LoadReport::runs`].
    pub runs: usize,
    /// See [`LoadReport::concurrency`].
    pub concurrency: usize,
    /// See [`LoadReport::duration_sec`].
    pub duration_sec: f64,
    /// See [`LoadReport::interrupted`].
    pub interrupted: bool,
    /// See [`LoadReport::gateway_frames`].
    pub gateway_frames: Option<ClientFrames>,
}

/// Aggregates per-run results.
pub fn build_report(meta: ReportMeta, results: &[RunResult]) -> LoadReport {
    let mut errors_by_code = BTreeMap::new();
    let mut violations_by_kind = BTreeMap::new();
    let mut samples = Vec::new();
    let mut violations = 0;
    let mut finals = 0;
    for r in results {
        match &r.outcome {
            Outcome::Final => finals += 1,
            Outcome::Error(code) => *errors_by_code.entry(code.clone()).or_insert(0) += 1,
            Outcome::Unfinished => *errors_by_code.entry("unfinished".to_owned()).or_insert(0) += 1,
        }
        for v in &r.violations {
            violations += 1;
            *violations_by_kind.entry(v.kind().to_owned()).or_insert(0) += 1;
            if samples.len() < VIOLATION_SAMPLES {
                samples.push(format!("{}: {v}", r.marker));
            }
        }
    }
    let series = |f: fn(&RunResult) -> Option<f64>| summarize(&results.iter().filter_map(f).collect::<Vec<_>>());
    let ended = results.iter().filter(|r| r.outcome != Outcome::Unfinished).count();
    LoadReport {
        mode: meta.mode,
        target: meta.target,
        runs: meta.runs,
        started: results.len(),
        concurrency: meta.concurrency,
        finals,
        errors: results.len() - finals,
        errors_by_code,
        isolation_violations: violations,
        violations_by_kind,
        violation_samples: samples,
        duration_sec: meta.duration_sec,
        runs_per_sec: if meta.duration_sec > 0.0 { ended as f64 / meta.duration_sec } else { 0.0 },
        latency_ms: Latencies {
            accepted: series(|r| r.accepted_ms),
            first_delta: series(|r| r.first_delta_ms),
            terminal: series(|r| r.terminal_ms),
        },
        text_deltas: results.iter().map(|r| r.deltas).sum(),
        interrupted: meta.interrupted,
        gateway_frames: meta.gateway_frames,
    }
}

impl LoadReport {
    /// True when every run ended `final` with no violation.
    pub fn all_good(&self) -> bool {
        self.isolation_violations == 0 && self.errors == 0 && self.finals == self.runs && !self.interrupted
    }

    /// The `--json` rendering: one line, one object.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"report not serializable: {e}\"}}"))
    }

    /// The table for people.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "clawmux load ({}): {} of {} runs started, concurrency {}, target {}{}",
            self.mode,
            self.started,
            self.runs,
            self.concurrency,
            self.target,
            if self.interrupted { " (INTERRUPTED)" } else { "" }
        );
        let _ = writeln!(s, "  finals {}   errors {}   isolation violations {}", self.finals, self.errors, self.isolation_violations);
        let _ = writeln!(
            s,
            "  duration {:.2} s   throughput {:.1} runs/s   text_delta events {}",
            self.duration_sec, self.runs_per_sec, self.text_deltas
        );
        let _ = writeln!(s, "  {:<18} {:>7} {:>9} {:>9} {:>9} {:>9}", "latency (ms)", "n", "p50", "p95", "p99", "max");
        for (name, p) in
            [("accepted", &self.latency_ms.accepted), ("first text_delta", &self.latency_ms.first_delta), ("terminal", &self.latency_ms.terminal)]
        {
            match p {
                Some(p) => {
                    let _ = writeln!(s, "  {name:<18} {:>7} {:>9.1} {:>9.1} {:>9.1} {:>9.1}", p.n, p.p50, p.p95, p.p99, p.max);
                }
                None => {
                    let _ = writeln!(s, "  {name:<18} {:>7}", 0);
                }
            }
        }
        if self.errors_by_code.is_empty() {
            let _ = writeln!(s, "  errors by code: none");
        } else {
            let list: Vec<String> = self.errors_by_code.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let _ = writeln!(s, "  errors by code: {}", list.join(", "));
        }
        if let Some(g) = &self.gateway_frames {
            let _ = writeln!(
                s,
                "  gateway → this client: {} connections, {} handshakes, {} frames, {} bytes, {} foreign chat/agent frames dropped",
                g.connections, g.handshakes, g.frames_received, g.bytes_received, g.foreign_frames_dropped
            );
        }
        if !self.violation_samples.is_empty() {
            let _ = writeln!(s, "  violations:");
            for v in &self.violation_samples {
                let _ = writeln!(s, "    {v}");
            }
        }
        s
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn meta() -> ReportMeta {
        ReportMeta {
            mode: "clawmux".into(),
            target: "http://x".into(),
            runs: 3,
            concurrency: 2,
            duration_sec: 2.0,
            interrupted: false,
            gateway_frames: None,
        }
    }

    fn ok(ms: f64) -> RunResult {
        RunResult {
            marker: "m".into(),
            outcome: Outcome::Final,
            violations: vec![],
            accepted_ms: Some(ms),
            first_delta_ms: Some(ms * 2.0),
            terminal_ms: Some(ms * 3.0),
            deltas: 20,
        }
    }

    #[test]
    fn aggregates_outcomes_latencies_and_violations() {
        let mut bad = ok(9.0);
        bad.outcome = Outcome::Error("timeout".into());
        bad.violations = vec![Violation::ForeignMarker("load-x".into())];
        let r = build_report(meta(), &[ok(1.0), ok(3.0), bad]);
        assert_eq!((r.finals, r.errors, r.isolation_violations), (2, 1, 1));
        assert_eq!(r.errors_by_code.get("timeout"), Some(&1));
        assert_eq!(r.violations_by_kind.get("foreign_marker"), Some(&1));
        assert_eq!(r.latency_ms.accepted.unwrap().p50, 3.0);
        assert_eq!(r.text_deltas, 60);
        assert!((r.runs_per_sec - 1.5).abs() < 1e-9);
        assert!(!r.all_good());
        let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!(v["isolationViolations"], 1);
        assert_eq!(v["latencyMs"]["terminal"]["p99"], 27.0);
        assert!(v.get("gatewayFrames").is_none());
        let text = r.to_text();
        assert!(text.contains("isolation violations 1"), "{text}");
        assert!(text.contains("timeout=1"), "{text}");
        assert!(text.contains("text of another run (load-x)"), "{text}");
    }

    #[test]
    fn all_good_needs_every_run_final() {
        let r = build_report(meta(), &[ok(1.0), ok(1.0), ok(1.0)]);
        assert!(r.all_good());
        let r = build_report(meta(), &[ok(1.0), ok(1.0)]);
        assert!(!r.all_good(), "a missing run is not good");
    }
}
