//! Prometheus metrics of the gateway connection and the runs. Every notable event both logs and
//! counts.

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

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
    /// Gateway runs clawmux gave up on and cancelled on the gateway (`chat.abort`), by when:
    /// `at_end` (the connection was up) or `after_reconnect` (sent once the same gateway process
    /// was back), or `lost` (the gateway restarted, so the run is gone anyway).
    pub runs_abandoned: IntCounterVec,
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
                    .buckets(vec![0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0]),
            )?,
            frame_to_client: Histogram::with_opts(
                HistogramOpts::new(
                    "clawmux_frame_to_client_seconds",
                    "From a chat frame arriving on the gateway socket to its text delta stored and handed to the run's SSE clients",
                )
                .buckets(vec![0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]),
            )?,
            runs_abandoned: IntCounterVec::new(
                Opts::new(
                    "clawmux_gateway_runs_abandoned_total",
                    "Gateway runs clawmux stopped waiting for and cancelled on the gateway, so none runs on without an owner",
                ),
                &["when"],
            )?,
        };
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
        Ok(m)
    }

    /// Unregistered metrics (unit tests).
    pub fn unregistered() -> Self {
        #[allow(clippy::expect_used)]
        Self::new(&Registry::new()).expect("fresh registry accepts every metric")
    }
}
