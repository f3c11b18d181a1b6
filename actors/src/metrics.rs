//! Prometheus metrics of the gateway connection and the runs. Every notable event both logs and
//! counts.
//!
//! Labels take values from small fixed sets only (statuses, reasons, the agent registry's ids),
//! never run or account ids: a label value is a time series for as long as Prometheus keeps it.
//! The known values are created at zero when the metrics are, so a dashboard's `rate()` and an
//! alert see a series from the start, not only after its first event.

use crate::routes::DropReason;
use crate::run::RunStatus;
use prometheus::{Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use std::sync::Arc;

/// Every status a finished run can have.
const FINISHED: [RunStatus; 4] = [RunStatus::Ok, RunStatus::Error, RunStatus::Aborted, RunStatus::Timeout];

/// The `agent` label of a run whose agent is not in the registry the metrics were given (a run
/// continued after a restart with another registry): one series for all of them.
pub const OTHER_AGENT: &str = "other";

/// Run duration buckets (seconds), from a cached answer to the longest allowed run.
const RUN_BUCKETS: [f64; 14] = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0];

/// The actors' metrics. Cheap to clone (handles into the registry).
#[derive(Clone)]
pub struct Metrics {
    /// Frames received from the gateway, by kind (`res`, `event`).
    pub frames_received: IntCounterVec,
    /// Run-scoped frames not delivered to any run, by reason (fail-closed routing).
    pub frames_dropped: IntCounterVec,
    /// Frames that failed to decode (malformed known frames, oversize).
    pub frames_malformed: IntCounter,
    /// `res` frames whose id matched no pending request.
    pub responses_unmatched: IntCounter,
    /// Connection attempts by outcome (`ok`, `failed`).
    pub connects: IntCounterVec,
    /// Connection losses by reason (`closed`, `tick_timeout`, `shutdown`, `error`).
    pub disconnects: IntCounterVec,
    /// 1 while the gateway connection is up (after hello-ok).
    pub connected: IntGauge,
    /// Runs admitted (new and resumed after a restart).
    pub runs_admitted: IntCounter,
    /// Runs whose `agent` request was sent to the gateway.
    pub runs_started: IntCounter,
    /// Runs finished, by status.
    pub runs_finished: IntCounterVec,
    /// Runs in flight (including queued).
    pub runs_active: IntGauge,
    /// Runs waiting behind another run of the same session key.
    pub runs_queued: IntGauge,
    /// Run duration from admission to terminal event.
    pub run_duration: Histogram,
    /// clawmux's added latency: from a chat frame's bytes arriving on the gateway socket to its
    /// text delta being visible to the run's SSE clients (decode, route, diff, serialize, store,
    /// fan-out). Observed by the run store when the delta is stored.
    pub frame_to_client: Histogram,
    /// Where a new run's wait for `accepted` goes, by `stage` (see [`crate::start_clock`]).
    pub run_start: HistogramVec,
    /// Gateway runs clawmux gave up on and cancelled on the gateway (`chat.abort`), by when:
    /// `at_end` (the connection was up) or `after_reconnect` (sent once the same gateway process
    /// was back), or `lost` (the gateway restarted, so the run is gone anyway).
    pub runs_abandoned: IntCounterVec,
    /// `sandbox_runs_total{agent,status}`: the roadmap's name for finished runs, per agent.
    pub sandbox_runs: IntCounterVec,
    /// `sandbox_run_duration_seconds{agent,status}`: admission to terminal event, per agent.
    pub sandbox_run_duration: HistogramVec,
    /// The git relay's results, by `result`: `pushed`, `unchanged` (nothing new to push), `failed`.
    pub relay_results: IntCounterVec,
    /// The agent ids `agent` labels may take (the agent registry); anything else is
    /// [`OTHER_AGENT`].
    agents: Arc<[String]>,
}

impl Metrics {
    /// Creates and registers the metrics.
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let m = Self {
            frames_received: IntCounterVec::new(
                Opts::new("clawmux_gateway_frames_received_total", "Frames received from the gateway"),
                &["kind"],
            )?,
            frames_dropped: IntCounterVec::new(
                Opts::new(
                    "clawmux_gateway_frames_dropped_total",
                    "Run-scoped frames dropped because their session key and run id matched no run of this process",
                ),
                &["reason"],
            )?,
            frames_malformed: IntCounter::new("clawmux_gateway_frames_malformed_total", "Frames that failed to decode")?,
            responses_unmatched: IntCounter::new("clawmux_gateway_responses_unmatched_total", "Responses matching no pending request")?,
            connects: IntCounterVec::new(Opts::new("clawmux_gateway_connects_total", "Gateway connection attempts"), &["outcome"])?,
            disconnects: IntCounterVec::new(Opts::new("clawmux_gateway_disconnects_total", "Gateway connection losses"), &["reason"])?,
            connected: IntGauge::new("clawmux_gateway_connected", "1 while the gateway connection is up")?,
            runs_admitted: IntCounter::new("clawmux_runs_admitted_total", "Runs admitted, new and resumed after a restart")?,
            runs_started: IntCounter::new("clawmux_runs_started_total", "Runs started on the gateway")?,
            runs_finished: IntCounterVec::new(Opts::new("clawmux_runs_finished_total", "Runs finished"), &["status"])?,
            runs_active: IntGauge::new("clawmux_runs_active", "Runs in flight, including queued ones")?,
            runs_queued: IntGauge::new("clawmux_runs_queued", "Runs waiting behind another run of the same session")?,
            run_duration: Histogram::with_opts(
                HistogramOpts::new("clawmux_run_duration_seconds", "Run duration from admission to terminal event")
                    .buckets(RUN_BUCKETS.to_vec()),
            )?,
            frame_to_client: Histogram::with_opts(
                HistogramOpts::new(
                    "clawmux_frame_to_client_seconds",
                    "From a chat frame arriving on the gateway socket to its text delta, stored, taken by a live SSE client's stream (a sample per client)",
                )
                // Fine between 0.5 and 15 ms: where a store's share of p99 is read (bench/store.sh compares
                // p99 with and without the store against a 2 ms budget).
                .buckets(vec![
                    0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.025,
                    0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                ]),
            )?,
            run_start: HistogramVec::new(
                HistogramOpts::new(
                    "clawmux_run_start_seconds",
                    "A new run's start by stage: admit (request parsed to admitted), turn (to its turn: start slot, session and branch locks), configure (to agent sent), gateway (to its ACK)",
                )
                // From the ms of a quiet start to the minutes a run may wait behind its session.
                // (Finer from 10 to 300 ms: where a burst's stages were found to lie.)
                .buckets(vec![
                    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
                ]),
                &["stage"],
            )?,
            runs_abandoned: IntCounterVec::new(
                Opts::new(
                    "clawmux_gateway_runs_abandoned_total",
                    "Gateway runs clawmux stopped waiting for and cancelled on the gateway, so none runs on without an owner",
                ),
                &["when"],
            )?,
            sandbox_runs: IntCounterVec::new(Opts::new("sandbox_runs_total", "Sandbox agent runs finished, by agent and status"), &["agent", "status"])?,
            sandbox_run_duration: HistogramVec::new(
                HistogramOpts::new("sandbox_run_duration_seconds", "Sandbox agent run duration from admission to terminal event, by agent and status")
                    .buckets(RUN_BUCKETS.to_vec()),
                &["agent", "status"],
            )?,
            relay_results: IntCounterVec::new(
                Opts::new("clawmux_relay_results_total", "Git relay results of branch runs: pushed, unchanged (nothing new), failed"),
                &["result"],
            )?,
            agents: Arc::from(Vec::new()),
        };
        for r in [DropReason::MissingSessionKey, DropReason::MissingRunId, DropReason::ForeignSession, DropReason::ForeignRun] {
            m.frames_dropped.with_label_values(&[r.as_str()]);
        }
        for s in FINISHED {
            m.runs_finished.with_label_values(&[s.as_str()]);
        }
        for o in ["ok", "failed"] {
            m.connects.with_label_values(&[o]);
        }
        for k in ["res", "event"] {
            m.frames_received.with_label_values(&[k]);
        }
        for r in ["pushed", "unchanged", "failed"] {
            m.relay_results.with_label_values(&[r]);
        }
        // The supervisor's reasons for losing a connection and for abandoning a gateway run.
        for r in ["closed", "connect_failed", "shutdown", "tick_timeout"] {
            m.disconnects.with_label_values(&[r]);
        }
        for stage in crate::start_clock::StartStage::ALL {
            m.run_start.with_label_values(&[stage.as_str()]);
        }
        for w in ["at_end", "after_reconnect", "lost"] {
            m.runs_abandoned.with_label_values(&[w]);
        }
        registry.register(Box::new(m.sandbox_runs.clone()))?;
        registry.register(Box::new(m.sandbox_run_duration.clone()))?;
        registry.register(Box::new(m.relay_results.clone()))?;
        registry.register(Box::new(m.runs_abandoned.clone()))?;
        registry.register(Box::new(m.frames_received.clone()))?;
        registry.register(Box::new(m.frame_to_client.clone()))?;
        registry.register(Box::new(m.frames_dropped.clone()))?;
        registry.register(Box::new(m.frames_malformed.clone()))?;
        registry.register(Box::new(m.responses_unmatched.clone()))?;
        registry.register(Box::new(m.connects.clone()))?;
        registry.register(Box::new(m.disconnects.clone()))?;
        registry.register(Box::new(m.connected.clone()))?;
        registry.register(Box::new(m.runs_admitted.clone()))?;
        registry.register(Box::new(m.runs_started.clone()))?;
        registry.register(Box::new(m.runs_finished.clone()))?;
        registry.register(Box::new(m.runs_active.clone()))?;
        registry.register(Box::new(m.runs_queued.clone()))?;
        registry.register(Box::new(m.run_duration.clone()))?;
        registry.register(Box::new(m.run_start.clone()))?;
        Ok(m)
    }

    /// The same metrics with `agent` labels bounded to `agents` (the agent registry's ids); their
    /// series (and `other`'s) start at zero for every finished status.
    pub fn with_agents(mut self, agents: impl IntoIterator<Item = String>) -> Self {
        self.agents = agents.into_iter().collect::<Vec<_>>().into();
        for agent in self.agents.iter().map(String::as_str).chain([OTHER_AGENT]) {
            for s in FINISHED {
                self.sandbox_runs.with_label_values(&[agent, s.as_str()]);
                self.sandbox_run_duration.with_label_values(&[agent, s.as_str()]);
            }
        }
        self
    }

    /// The `agent` label of a run of `agent_id`: the id when the registry has it, else
    /// [`OTHER_AGENT`] (a label value must not come from outside a fixed set).
    pub fn agent_label<'a>(&'a self, agent_id: &'a str) -> &'a str {
        if self.agents.iter().any(|a| a == agent_id) {
            agent_id
        } else {
            OTHER_AGENT
        }
    }

    /// Observes one stage of a new run's start (`clawmux_run_start_seconds`).
    pub fn start_stage(&self, (stage, took): (crate::start_clock::StartStage, std::time::Duration)) {
        self.run_start.with_label_values(&[stage.as_str()]).observe(took.as_secs_f64());
    }

    /// Counts a finished run: `clawmux_runs_finished_total`, `clawmux_run_duration_seconds` and the
    /// per-agent `sandbox_*` pair.
    pub fn run_finished(&self, agent_id: &str, status: RunStatus, seconds: f64) {
        let agent = self.agent_label(agent_id);
        self.runs_finished.with_label_values(&[status.as_str()]).inc();
        self.run_duration.observe(seconds);
        self.sandbox_runs.with_label_values(&[agent, status.as_str()]).inc();
        self.sandbox_run_duration.with_label_values(&[agent, status.as_str()]).observe(seconds);
    }

    /// Counts a relay result (the `relay` event's data, docs/API.md): `failed` with an `error`,
    /// `pushed` when this run pushed, `unchanged` otherwise.
    pub fn relay_result(&self, relay: &serde_json::Value) {
        let result = if relay.get("error").is_some_and(|e| !e.is_null()) {
            "failed"
        } else if relay.get("pushed").and_then(serde_json::Value::as_bool) == Some(true) {
            "pushed"
        } else {
            "unchanged"
        };
        self.relay_results.with_label_values(&[result]).inc();
    }

    /// Unregistered metrics (unit tests).
    pub fn unregistered() -> Self {
        #[allow(clippy::expect_used)]
        Self::new(&Registry::new()).expect("fresh registry accepts every metric")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scrape(r: &Registry) -> String {
        use prometheus::Encoder;
        let mut buf = Vec::new();
        prometheus::TextEncoder::new().encode(&r.gather(), &mut buf).expect("encode");
        String::from_utf8(buf).expect("utf-8")
    }

    #[test]
    fn agent_labels_come_only_from_the_registry() {
        let r = Registry::new();
        let m = Metrics::new(&r).expect("metrics").with_agents(["main".to_owned()]);
        m.run_finished("main", RunStatus::Ok, 1.5);
        m.run_finished("someone-elses-agent-7f3a", RunStatus::Timeout, 600.0);
        let text = scrape(&r);
        assert!(text.contains(r#"sandbox_runs_total{agent="main",status="ok"} 1"#), "{text}");
        assert!(text.contains(r#"sandbox_runs_total{agent="other",status="timeout"} 1"#), "{text}");
        assert!(!text.contains("7f3a"), "an unknown agent id never becomes a label value");
        assert!(text.contains(r#"sandbox_run_duration_seconds_count{agent="main",status="ok"} 1"#), "{text}");
        assert!(text.contains(r#"clawmux_runs_finished_total{status="timeout"} 1"#), "{text}");
        // Known series exist from the start, at zero.
        assert!(text.contains(r#"sandbox_runs_total{agent="main",status="aborted"} 0"#), "{text}");
        assert!(text.contains(r#"clawmux_gateway_frames_dropped_total{reason="foreign_session"} 0"#), "{text}");
    }

    #[test]
    fn relay_results_are_counted_by_outcome() {
        let r = Registry::new();
        let m = Metrics::new(&r).expect("metrics");
        m.relay_result(&serde_json::json!({"branch": "sandbox/a", "pushed": true, "pushedCommits": 1}));
        m.relay_result(&serde_json::json!({"branch": "sandbox/a", "pushed": false, "pushedCommits": 0}));
        m.relay_result(&serde_json::json!({"branch": "sandbox/a", "pushed": false, "error": {"stage": "push"}}));
        m.relay_result(&serde_json::json!({"branch": "sandbox/a", "pushed": false, "error": {"stage": "push"}}));
        let text = scrape(&r);
        for (result, n) in [("pushed", 1), ("unchanged", 1), ("failed", 2)] {
            assert!(text.contains(&format!("clawmux_relay_results_total{{result=\"{result}\"}} {n}")), "{result}: {text}");
        }
    }
}
