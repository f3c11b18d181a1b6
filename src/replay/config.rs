//! What a replay gateway is told at start: the knobs that decide which real gateway it imitates.

use super::cassette::Cassette;

/// Default `policy.tickIntervalMs` of the real gateway.
pub const DEFAULT_TICK_INTERVAL_MS: u64 = 30_000;
/// Default `policy.maxPayload` of 2026.x gateways (older ones advertised 512 KiB).
pub const DEFAULT_MAX_PAYLOAD: usize = 26_214_400;
/// `policy.maxBufferedBytes` of 2026.x gateways.
pub const MAX_BUFFERED_BYTES: u64 = 52_428_800;

/// Configuration of a [`ReplayGateway`](super::ReplayGateway). Fields are public and every field
/// has a chainable setter, so `ReplayConfig::default().speed(0.0).protocol(3)` reads as prose.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// Shared gateway token; `None` accepts any (or no) token, like a gateway with auth off.
    pub token: Option<String>,
    /// The protocol the imitated gateway speaks: 4 (`openclaw@2026.9.x`) or 3 (`2026.4.x`, with
    /// its broadcast-to-all, device-bound scopes and unabortable `agent` runs).
    pub protocol: u32,
    /// Interval of `tick` events (`policy.tickIntervalMs`); tests use tens of milliseconds.
    pub tick_interval_ms: u64,
    /// Largest inbound frame accepted (`policy.maxPayload`); larger frames close the socket 1009.
    pub max_payload: usize,
    /// Time scale of the recorded timings: 1.0 = as recorded, 10.0 = ten times faster, 0.0 = no
    /// delays at all (events still go out in recorded order).
    pub speed: f64,
    /// Models `sessions.patch` accepts (`provider/model`); the first is the agent's default model.
    pub models: Vec<String>,
    /// `true` imitates the Cogni fork, which accepts `sessions.patch` `outboundHeaders`; `false`
    /// (stock OpenClaw) rejects the field exactly as the real gateway does.
    pub accept_outbound_headers: bool,
    /// The recorded runs to replay.
    pub cassette: Cassette,
    /// Re-cut every track's answer into this many deltas (see [`Track::with_deltas`](super::Track::with_deltas));
    /// `None` replays the recorded deltas.
    pub deltas_override: Option<usize>,
    /// `true` imitates 2026.9.x, which offers `sessions.messages.subscribe`/`.unsubscribe` and
    /// honours the `session-scoped-events` cap; `false` a gateway without the feature: the two
    /// methods are not in `hello-ok.features.methods` (calling them is `unknown method`) and the
    /// cap is ignored, so every reader receives every run's events (broadcast delivery).
    pub session_scoped_events: bool,
    /// `policy.maxPayload` advertised in `hello-ok` when set, whatever the gateway really accepts
    /// ([`Self::max_payload`]): a hostile or buggy gateway can advertise anything (0, `u64::MAX`),
    /// and clients must bound what they believe. `None` advertises `max_payload`.
    pub advertised_max_payload: Option<u64>,
    /// `policy.tickIntervalMs` advertised in `hello-ok` when set, independent of the real tick
    /// cadence ([`Self::tick_interval_ms`]). `None` advertises the real interval.
    pub advertised_tick_interval_ms: Option<u64>,
}

impl Default for ReplayConfig {
    /// Protocol 4, no token, recorded timing, the bundled `openclaw@2026.9.6` cassette.
    fn default() -> Self {
        Self::new(Cassette::bundled().unwrap_or_else(|_| Cassette {
            // Unreachable in practice (the bundled cassette is unit-tested); an empty cassette makes
            // `ReplayGateway::start` refuse with a clear error instead of panicking here.
            source: "none".to_owned(),
            protocol: 4,
            recorded_at: String::new(),
            note: None,
            tracks: Vec::new(),
        }))
    }
}

impl ReplayConfig {
    /// Defaults around the given cassette.
    pub fn new(cassette: Cassette) -> Self {
        Self {
            token: None,
            protocol: 4,
            tick_interval_ms: DEFAULT_TICK_INTERVAL_MS,
            max_payload: DEFAULT_MAX_PAYLOAD,
            speed: 1.0,
            models: vec!["cogni/fake-model".to_owned(), "cogni/fake-model-b".to_owned()],
            accept_outbound_headers: false,
            cassette,
            deltas_override: None,
            session_scoped_events: true,
            advertised_max_payload: None,
            advertised_tick_interval_ms: None,
        }
    }

    /// Sets [`Self::token`].
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Sets [`Self::protocol`].
    pub fn protocol(mut self, protocol: u32) -> Self {
        self.protocol = protocol;
        self
    }

    /// Sets [`Self::tick_interval_ms`].
    pub fn tick_interval_ms(mut self, ms: u64) -> Self {
        self.tick_interval_ms = ms;
        self
    }

    /// Sets [`Self::max_payload`].
    pub fn max_payload(mut self, bytes: usize) -> Self {
        self.max_payload = bytes;
        self
    }

    /// Sets [`Self::speed`].
    pub fn speed(mut self, speed: f64) -> Self {
        self.speed = speed;
        self
    }

    /// Sets [`Self::models`].
    pub fn models(mut self, models: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.models = models.into_iter().map(Into::into).collect();
        self
    }

    /// Sets [`Self::accept_outbound_headers`].
    pub fn accept_outbound_headers(mut self, accept: bool) -> Self {
        self.accept_outbound_headers = accept;
        self
    }

    /// Sets [`Self::cassette`].
    pub fn cassette(mut self, cassette: Cassette) -> Self {
        self.cassette = cassette;
        self
    }

    /// Sets [`Self::deltas_override`].
    pub fn deltas_override(mut self, deltas: Option<usize>) -> Self {
        self.deltas_override = deltas;
        self
    }

    /// Sets [`Self::session_scoped_events`].
    pub fn session_scoped_events(mut self, offered: bool) -> Self {
        self.session_scoped_events = offered;
        self
    }

    /// Sets [`Self::advertised_max_payload`].
    pub fn advertise_max_payload(mut self, bytes: u64) -> Self {
        self.advertised_max_payload = Some(bytes);
        self
    }

    /// Sets [`Self::advertised_tick_interval_ms`].
    pub fn advertise_tick_interval_ms(mut self, ms: u64) -> Self {
        self.advertised_tick_interval_ms = Some(ms);
        self
    }

    /// Checks the values a gateway cannot run with; the message says which and why.
    pub fn validate(&self) -> Result<(), String> {
        if self.protocol != 3 && self.protocol != 4 {
            return Err(format!("protocol {} is not supported (3 or 4)", self.protocol));
        }
        if !(self.speed.is_finite() && self.speed >= 0.0) {
            return Err(format!("speed {} must be a finite number >= 0", self.speed));
        }
        if self.tick_interval_ms == 0 {
            return Err("tick_interval_ms must be > 0".to_owned());
        }
        if self.max_payload == 0 {
            return Err("max_payload must be > 0".to_owned());
        }
        if self.models.is_empty() || self.models.iter().any(|m| m.trim().is_empty()) {
            return Err("models must list at least one non-empty model".to_owned());
        }
        if self.cassette.tracks.is_empty() {
            return Err("the cassette has no tracks".to_owned());
        }
        if self.cassette.protocol == 3 && self.protocol == 4 {
            return Err(format!(
                "cassette {} was recorded on protocol 3; it lacks what protocol 4 sends (deltaText, usage, lifecycle phases) and cannot be replayed as protocol 4",
                self.cassette.source
            ));
        }
        if self.deltas_override == Some(0) {
            return Err("deltas_override must be at least 1".to_owned());
        }
        Ok(())
    }
}
