//! The supervisor actor: the ONE gateway connection of the process.
//!
//! It owns the connection state, allocates request ids and routes every `res` to whoever asked
//! (including the double `res` of `agent`), routes every `chat`/`agent` event to the session actor
//! that owns its `(sessionKey, runId)` and drops (and counts) everything else, reconnects with
//! backoff and jitter, watches `tick`s, handles `shutdown`, and cancels gateway runs their session
//! gave up on while the connection was down. It reports the connection's state to one listener (the
//! registry). It knows nothing of admission or run lifecycles, and never awaits anyone: everything
//! it sends is `do_send`.

use crate::backoff::Backoff;
use crate::connection::{self, ConnEvents, ConnectFailure};
use crate::messages::{
    Abandon, AddRoute, Call, CallError, GatewayUp, Link, ListenLink, OutboundHeadersUnsupported, RemoveRoute, Reply, Routed,
    ScopeMissing, Wait,
};
use crate::metrics::Metrics;
use crate::routes::RouteTable;
use crate::session::OutboundHeadersMode;
use actix::prelude::*;
use clawmux_protocol::handshake::{ConnectParams, HelloOk};
use clawmux_protocol::methods::name;
use clawmux_protocol::{encode_request, ErrorShape, Frame, GatewayEvent};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::mpsc;

/// The official pre-connect timeout: `DEFAULT_PREAUTH_HANDSHAKE_TIMEOUT_MS` (15 s) of
/// `@openclaw/gateway-client`, the time the gateway gives a socket to complete `connect` (2026.9.6
/// closes it, 1000, after 15 s; the official client's challenge watchdog waits as long). Waiting
/// longer for a handshake is pointless, giving up sooner cuts off a busy gateway that would still
/// have answered.
pub const PREAUTH_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(15);

/// Supervisor settings.
#[derive(Debug, Clone)]
pub struct SupervisorConfig {
    /// `ws://` or `wss://` URL of the gateway.
    pub url: String,
    /// The gateway's shared token. Only ever written into the `connect` frame.
    pub token: Option<String>,
    /// Outbound headers policy.
    pub outbound_headers: OutboundHeadersMode,
    /// Sent as `client.version`.
    pub client_version: String,
    /// Reconnect delays.
    pub backoff: Backoff,
    /// Bound on the TCP connect + WebSocket upgrade, and again on the handshake (challenge to
    /// hello-ok): [`PREAUTH_HANDSHAKE_TIMEOUT`] by default.
    pub handshake_timeout: Duration,
    /// Bound on a non-`agent` request.
    pub request_timeout: Duration,
    /// How long a run whose connection dropped waits for the connection to come back.
    pub recovery_window: Duration,
    /// How long an aborted run waits for the gateway's final answer before ending anyway.
    pub abort_grace: Duration,
    /// Runs in flight (running + queued) above which new runs are refused with 503.
    pub max_runs: usize,
    /// The device identity that signs `connect` (`None`: connect without one).
    pub device: Option<Arc<crate::device::DeviceIdentity>>,
}

impl SupervisorConfig {
    /// What the session actors need of these settings.
    pub fn session(&self) -> crate::session::SessionConfig {
        crate::session::SessionConfig {
            recovery_window: self.recovery_window,
            abort_grace: self.abort_grace,
            request_timeout: self.request_timeout,
            outbound_headers: self.outbound_headers,
            max_output_bytes: crate::session::MAX_OUTPUT_BYTES,
        }
    }

    /// Defaults for `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            token: None,
            outbound_headers: OutboundHeadersMode::Auto,
            client_version: env!("CARGO_PKG_VERSION").to_owned(),
            backoff: Backoff::default(),
            handshake_timeout: PREAUTH_HANDSHAKE_TIMEOUT,
            request_timeout: Duration::from_secs(30),
            recovery_window: Duration::from_secs(30),
            abort_grace: Duration::from_secs(10),
            max_runs: 5000,
            device: None,
        }
    }
}

/// What `/readyz` and `doctor` show about the gateway.
#[derive(Debug, Clone, Default)]
pub struct GatewayStatus {
    /// True after hello-ok, until the connection is lost.
    pub connected: bool,
    /// Negotiated protocol.
    pub protocol: Option<u32>,
    /// Gateway release.
    pub server_version: Option<String>,
    /// Granted scopes (protocol 4 reports them; protocol 3 does not).
    pub scopes: Option<Vec<String>>,
    /// True when the gateway offers `sessions.messages.subscribe` (session-scoped events).
    pub session_scoped: bool,
    /// Whether per-session outbound headers are in use (`None`: not yet known).
    pub outbound_headers: Option<bool>,
    /// Why the connection is not up (or was last lost), in words.
    pub last_error: Option<String>,
    /// When the current connection came up.
    pub connected_since: Option<SystemTime>,
    /// Successful connections since start.
    pub connections: u64,
    /// Negotiated tick interval.
    pub tick_interval_ms: Option<u64>,
    /// Negotiated max payload.
    pub max_payload: Option<u64>,
    /// The device id clawmux signs with (`None`: no device identity).
    pub device_id: Option<String>,
    /// The gateway asked for this device to be approved (pairing).
    pub pairing_required: bool,
    /// Protocol 3: whether the write probe after hello-ok succeeded (`None`: not probed yet).
    pub writes_accepted: Option<bool>,
    /// Scopes a write was refused for (protocol 3 reports no granted scopes in hello-ok, so
    /// clawmux learns them from the first writes).
    pub missing_scopes: Vec<String>,
}

impl GatewayStatus {
    /// Ready means connected with the scopes a multiplexer needs (where the gateway reports them).
    pub fn ready(&self) -> Result<(), String> {
        if !self.connected {
            return Err(self.last_error.clone().unwrap_or_else(|| "connecting to the gateway".to_owned()));
        }
        if !self.missing_scopes.is_empty() {
            return Err(format!(
                "the gateway refused scopes {:?} to clawmux; on protocol 3 scopes need a device identity (CLAWMUX_DEVICE_IDENTITY) and an operator role with those scopes",
                self.missing_scopes
            ));
        }
        if let Some(scopes) = &self.scopes {
            let missing: Vec<&str> =
                ["operator.read", "operator.write"].into_iter().filter(|s| !scopes.iter().any(|g| g == s)).collect();
            if !missing.is_empty() {
                if scopes.is_empty() && self.device_id.is_none() {
                    // Observed on 2026.9.6 over the network: the token is accepted, the scopes are
                    // silently dropped unless a paired device identity signs the connect.
                    return Err("the gateway accepted the token but granted no scopes: a gateway reached over the network grants scopes only to a paired device identity; set CLAWMUX_DEVICE_IDENTITY=auto (or on) and approve the device".to_owned());
                }
                return Err(format!(
                    "the gateway granted scopes {scopes:?} but clawmux needs {missing:?}; check the token's role and scopes"
                ));
            }
        }
        Ok(())
    }
}

/// Shared, cheaply readable status (HTTP handlers read it without messaging the actor).
pub type StatusHandle = Arc<RwLock<GatewayStatus>>;

/// Gateway runs remembered at most for cancelling after a reconnect (oldest forgotten first, with
/// a warning): a long outage must not grow memory without bound.
pub const MAX_ABANDONED: usize = 10_000;

/// What the supervisor holds, for checking its bounds (tests, diagnostics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SupervisorStats {
    /// Requests waiting for their answer: bounded by the callers alive (an `agent` request, which
    /// has no deadline of its own, is dropped once its caller is gone) plus the calls of the last
    /// request timeout.
    pub pending: usize,
    /// Runs whose frames are routed (one per live run; frames never add any).
    pub routes: usize,
    /// Gateway runs remembered for cancelling once their gateway is back (at most [`MAX_ABANDONED`]).
    pub abandoned: usize,
}

/// Asks the supervisor for its [`SupervisorStats`].
#[derive(Message, Debug, Clone, Copy)]
#[rtype(result = "SupervisorStats")]
pub struct Stats;

#[derive(Message)]
#[rtype(result = "()")]
struct ConnUp {
    generation: u64,
    hello: Box<HelloOk>,
    tx: mpsc::UnboundedSender<String>,
}

#[derive(Message)]
#[rtype(result = "()")]
struct ConnFailed {
    generation: u64,
    failure: ConnectFailure,
}

#[derive(Message)]
#[rtype(result = "()")]
struct Inbound {
    generation: u64,
    frame: Result<Frame, clawmux_protocol::DecodeError>,
    /// When the frame's bytes arrived (the start of clawmux's added latency).
    received: Instant,
}

#[derive(Message)]
#[rtype(result = "()")]
struct ConnClosed {
    generation: u64,
    reason: String,
}

/// Forwards connection-task reports into the supervisor's mailbox, tagged with the attempt's
/// generation so reports of an abandoned connection are ignored.
struct ToSupervisor {
    addr: Addr<Supervisor>,
    generation: u64,
}

impl ConnEvents for ToSupervisor {
    fn up(&self, hello: HelloOk, tx: mpsc::UnboundedSender<String>) {
        self.addr.do_send(ConnUp { generation: self.generation, hello: Box::new(hello), tx });
    }
    fn failed(&self, failure: ConnectFailure) {
        self.addr.do_send(ConnFailed { generation: self.generation, failure });
    }
    fn frame(&self, frame: Result<Frame, clawmux_protocol::DecodeError>, received: Instant) {
        self.addr.do_send(Inbound { generation: self.generation, frame, received });
    }
    fn closed(&self, reason: String) {
        self.addr.do_send(ConnClosed { generation: self.generation, reason });
    }
}

// ---------------------------------------------------------------------------------------------
// State
// ---------------------------------------------------------------------------------------------

/// The connection, as an explicit state rather than a pile of options.
enum Conn {
    /// Waiting to reconnect.
    Disconnected,
    /// A connection task is connecting and handshaking.
    Connecting { task: futures_util::future::AbortHandle },
    /// Handshake done.
    Connected(Connected),
    /// Shutting down: no reconnects.
    Stopped,
}

struct Connected {
    task: futures_util::future::AbortHandle,
    tx: mpsc::UnboundedSender<String>,
    protocol: u32,
    /// The gateway process's identity ([`crate::instance`]).
    boot_id: Option<String>,
    session_scoped: bool,
    tick_interval: Duration,
    last_tick: Instant,
}

struct Pending {
    method: &'static str,
    tag: u64,
    reply_to: Option<Recipient<Reply>>,
    /// `None` for `agent` (its session actor owns the run's timeout).
    deadline: Option<Instant>,
}

/// The supervisor actor. Start it once, in `main`.
pub struct Supervisor {
    cfg: SupervisorConfig,
    metrics: Metrics,
    status: StatusHandle,
    conn: Conn,
    /// Bumped per connection attempt; reports of older attempts are ignored.
    generation: u64,
    /// Consecutive failed attempts (for backoff); reset by hello-ok.
    attempt: u32,
    /// Delay the gateway asked for (shutdown's restartExpectedMs, UNAVAILABLE's retryAfterMs).
    next_delay_hint: Option<Duration>,
    next_request_id: u64,
    pending: HashMap<String, Pending>,
    routes: RouteTable<Recipient<Routed>>,
    /// Who hears of the connection going up and down (the registry, which tells the runs).
    listener: Option<Recipient<Link>>,
    outbound_headers_supported: Option<bool>,
    /// The protocol offered, exactly, in the next `connect`: 4 first; 3 only after the gateway
    /// refused 4 with a protocol mismatch (and back to 4 when a gateway refuses 3).
    offer: u32,
    /// Gateway runs given up on while the connection was down: cancelled once that gateway
    /// process is back, so no run goes on with no owner (and no bill payer watching).
    abandoned: std::collections::VecDeque<Abandon>,
}

impl Supervisor {
    /// The supervisor-side ports a session actor uses.
    pub fn port(addr: &Addr<Supervisor>) -> crate::messages::GatewayPort {
        crate::messages::GatewayPort {
            call: addr.clone().recipient(),
            add_route: addr.clone().recipient(),
            remove_route: addr.clone().recipient(),
            abandon: addr.clone().recipient(),
            headers_unsupported: addr.clone().recipient(),
            scope_missing: addr.clone().recipient(),
        }
    }

    /// A supervisor that will connect to `cfg.url` when started.
    pub fn new(cfg: SupervisorConfig, metrics: Metrics, status: StatusHandle) -> Self {
        let outbound_headers_supported = match cfg.outbound_headers {
            OutboundHeadersMode::On => Some(true),
            OutboundHeadersMode::Off => Some(false),
            OutboundHeadersMode::Auto => None,
        };
        Self {
            cfg,
            metrics,
            status,
            conn: Conn::Disconnected,
            generation: 0,
            attempt: 0,
            next_delay_hint: None,
            next_request_id: 0,
            pending: HashMap::new(),
            routes: RouteTable::new(),
            listener: None,
            outbound_headers_supported,
            offer: clawmux_protocol::handshake::PREFERRED_PROTOCOL,
            abandoned: std::collections::VecDeque::new(),
        }
    }

    fn set_status(&self, f: impl FnOnce(&mut GatewayStatus)) {
        match self.status.write() {
            Ok(mut s) => f(&mut s),
            Err(poisoned) => f(&mut poisoned.into_inner()),
        }
    }

    fn connect(&mut self, ctx: &mut Context<Self>) {
        if matches!(self.conn, Conn::Stopped) {
            return;
        }
        self.generation += 1;
        let events = ToSupervisor { addr: ctx.address(), generation: self.generation };
        let params = ConnectParams::multiplexer(&self.cfg.client_version, self.cfg.token.clone()).offering(self.offer);
        let (fut, task) = futures_util::future::abortable(connection::run(
            self.cfg.url.clone(),
            params,
            self.cfg.device.clone(),
            self.cfg.handshake_timeout,
            events,
        ));
        // The socket's reads, decoding and writes run on this actor's own thread (`serve` gives it
        // one, apart from admissions): a frame goes from the socket to its run's shard, and a
        // request from a run to the socket, with no other thread to wake in between (a thread of
        // their own cost a wake-up and two context switches per frame, more CPU than the routing).
        actix::spawn(async move {
            let _ = fut.await;
        });
        self.conn = Conn::Connecting { task };
    }

    fn schedule_reconnect(&mut self, ctx: &mut Context<Self>) {
        if matches!(self.conn, Conn::Stopped) {
            return;
        }
        let jittered = self.cfg.backoff.delay(self.attempt, rand::random::<f64>());
        // A delay the gateway asked for is a hint within clawmux's own range: `restartExpectedMs`
        // of 2^64 must not switch clawmux off, nor 0 make it spin.
        let delay = self
            .next_delay_hint
            .take()
            .map_or(jittered, |hint| crate::limits::reconnect_hint(hint, self.cfg.backoff.min(), self.cfg.backoff.max()));
        self.attempt = self.attempt.saturating_add(1);
        tracing::info!(delay_ms = delay.as_millis() as u64, attempt = self.attempt, "gateway reconnect scheduled");
        self.conn = Conn::Disconnected;
        ctx.run_later(delay, |act, ctx| {
            if matches!(act.conn, Conn::Disconnected) {
                act.connect(ctx);
            }
        });
    }

    /// Tears the connection down: fails pending calls, tells every run, schedules a reconnect.
    fn lost(&mut self, ctx: &mut Context<Self>, reason_label: &'static str, reason: String) {
        let was_connected = matches!(self.conn, Conn::Connected(_));
        match std::mem::replace(&mut self.conn, Conn::Disconnected) {
            Conn::Connected(c) => c.task.abort(),
            Conn::Connecting { task } => task.abort(),
            Conn::Stopped => self.conn = Conn::Stopped,
            Conn::Disconnected => {}
        }
        // Late reports of the dead connection must not be mistaken for the next one's.
        self.generation += 1;
        if was_connected {
            tracing::warn!(reason = %reason, "gateway connection lost");
            self.metrics.disconnects.with_label_values(&[reason_label]).inc();
            self.metrics.connected.set(0);
        }
        self.set_status(|s| {
            s.connected = false;
            s.connected_since = None;
            s.last_error = Some(reason.clone());
        });
        for (_, p) in self.pending.drain() {
            if let Some(r) = p.reply_to {
                r.do_send(Reply { tag: p.tag, result: Err(CallError::Disconnected) });
            }
        }
        if was_connected {
            self.announce(None);
        }
        self.schedule_reconnect(ctx);
    }

    /// Remembers a gateway run to cancel once its gateway process is reachable again.
    fn abandon(&mut self, abandoned: Abandon) {
        if self.abandoned.len() >= MAX_ABANDONED {
            if let Some(a) = self.abandoned.pop_front() {
                tracing::warn!(gateway_run_id = %a.gateway_run_id, "too many abandoned gateway runs remembered; forgetting the oldest");
            }
        }
        self.abandoned.push_back(abandoned);
        if let Conn::Connected(c) = &self.conn {
            let boot = c.boot_id.clone();
            self.cancel_abandoned(boot.as_deref());
        }
    }

    /// Cancels every remembered run on the gateway process that is connected now; runs of another
    /// process (a restart since) are gone already.
    fn cancel_abandoned(&mut self, boot_id: Option<&str>) {
        for a in std::mem::take(&mut self.abandoned) {
            // No identity to compare: cancelling a run that is gone is harmless.
            let same_process = crate::instance::still_there(a.boot_id.as_deref(), boot_id);
            if !same_process {
                self.metrics.runs_abandoned.with_label_values(&["lost"]).inc();
                continue;
            }
            tracing::info!(gateway_run_id = %a.gateway_run_id, "cancelling a gateway run clawmux gave up on");
            self.metrics.runs_abandoned.with_label_values(&["after_reconnect"]).inc();
            let params = serde_json::json!({"sessionKey": a.session_key.as_str(), "runId": a.gateway_run_id});
            self.send_fire_and_forget(name::CHAT_ABORT, params);
        }
    }

    /// Sends a call whose answer nobody needs (its `res` is counted as unmatched).
    fn send_fire_and_forget(&mut self, method: &'static str, params: serde_json::Value) {
        let Conn::Connected(c) = &self.conn else { return };
        self.next_request_id += 1;
        let id = format!("cm-{}", self.next_request_id);
        if let Ok(text) = encode_request(&id, method, &params, None) {
            let _ = c.tx.send(text);
        }
    }

    /// Tells the listener the connection's state.
    fn announce(&self, link: Option<GatewayUp>) {
        if let Some(l) = &self.listener {
            l.do_send(Link(link));
        }
    }

    fn link_info(&self) -> Option<GatewayUp> {
        match &self.conn {
            Conn::Connected(c) => Some(GatewayUp {
                protocol: c.protocol,
                boot_id: c.boot_id.clone(),
                session_scoped: c.session_scoped,
                outbound_headers: self.outbound_headers_supported == Some(true),
            }),
            _ => None,
        }
    }

    fn on_response(&mut self, res: clawmux_protocol::ResponseFrame) {
        let Some(p) = self.pending.get(&res.id) else {
            self.metrics.responses_unmatched.inc();
            tracing::debug!(id = %res.id, "response matches no pending request");
            return;
        };
        // `agent` answers twice: keep the entry after its ACK.
        let is_ack = p.method == name::AGENT && res.ok && res.payload.as_ref().is_some_and(|raw| is_accepted(raw.get()));
        let p = if is_ack {
            Pending { method: p.method, tag: p.tag, reply_to: p.reply_to.clone(), deadline: p.deadline }
        } else {
            match self.pending.remove(&res.id) {
                Some(p) => p,
                None => return,
            }
        };
        let Some(reply_to) = p.reply_to else { return };
        let result = if res.ok {
            res.payload.ok_or_else(|| CallError::Malformed("ok response without payload".to_owned()))
        } else {
            Err(CallError::Gateway(res.error.unwrap_or_else(|| ErrorShape::new("UNKNOWN", "no error given"))))
        };
        reply_to.do_send(Reply { tag: p.tag, result });
    }

    /// A `res` whose id reads but whose body does not: the request is answered `Malformed` (an
    /// `agent` call too, whether it was the ACK or the final), not left to its deadline.
    fn on_unreadable_response(&mut self, id: &str, reason: String) {
        let Some(p) = self.pending.remove(id) else {
            self.metrics.responses_unmatched.inc();
            return;
        };
        if let Some(reply_to) = p.reply_to {
            reply_to.do_send(Reply { tag: p.tag, result: Err(CallError::Malformed(format!("the answer could not be decoded: {reason}"))) });
        }
    }

    fn on_event(&mut self, ctx: &mut Context<Self>, event: GatewayEvent, received: Instant) {
        match event {
            GatewayEvent::Chat(_) | GatewayEvent::Agent(_) => {
                let target = match event.route_key() {
                    Some((sk, run)) => self.routes.route(sk, run),
                    None => return,
                };
                match target {
                    Ok(r) => r.do_send(Routed(event, received)),
                    Err(reason) => {
                        self.metrics.frames_dropped.with_label_values(&[reason.as_str()]).inc();
                    }
                }
            }
            GatewayEvent::Tick(_) => {
                if let Conn::Connected(c) = &mut self.conn {
                    c.last_tick = Instant::now();
                }
            }
            GatewayEvent::Shutdown(s) => {
                let delay = Duration::from_millis(s.restart_expected_ms.unwrap_or(0));
                tracing::warn!(reason = ?s.reason, restart_expected_ms = ?s.restart_expected_ms, "gateway announced shutdown");
                self.next_delay_hint = Some(delay);
                self.lost(ctx, "shutdown", format!("the gateway is shutting down ({})", s.reason.unwrap_or_default()));
            }
            GatewayEvent::ConnectChallenge(_) | GatewayEvent::Other { .. } => {}
        }
    }

    fn check_liveness(&mut self, ctx: &mut Context<Self>) {
        let now = Instant::now();
        if let Conn::Connected(c) = &self.conn {
            if now.duration_since(c.last_tick) > c.tick_interval * 2 {
                let reason = format!("no tick from the gateway for {:?} (two intervals); reconnecting", now.duration_since(c.last_tick));
                self.lost(ctx, "tick_timeout", reason);
                return;
            }
        }
        // A caller that is gone waits for nothing. An `agent` request has no deadline here (its run
        // owns it): without this, every run that ended before its final `res` came (a gateway that
        // never sends it) would be held for as long as the connection lives.
        self.pending.retain(|_, p| p.deadline.is_some() || p.reply_to.as_ref().is_some_and(Recipient::connected));
        let expired: Vec<String> =
            self.pending.iter().filter(|(_, p)| p.deadline.is_some_and(|d| d <= now)).map(|(id, _)| id.clone()).collect();
        for id in expired {
            if let Some(p) = self.pending.remove(&id) {
                if let Some(r) = p.reply_to {
                    r.do_send(Reply { tag: p.tag, result: Err(CallError::TimedOut) });
                }
            }
        }
    }
}

fn is_accepted(payload: &str) -> bool {
    #[derive(serde::Deserialize)]
    struct S<'a> {
        #[serde(borrow)]
        status: Option<std::borrow::Cow<'a, str>>,
    }
    serde_json::from_str::<S<'_>>(payload).ok().and_then(|s| s.status).is_some_and(|s| s == "accepted")
}

impl Actor for Supervisor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        // Bounds only `send`s that wait for room; everything reaches the supervisor by `do_send`
        // (which ignores it), so its queue is bounded by its senders: admission is bounded at the
        // registry (`CLAWMUX_MAX_RUNS`, start slots) and frames by the one connection's reads.
        ctx.set_mailbox_capacity(4096);
        self.connect(ctx);
        ctx.run_interval(Duration::from_millis(250), |act, ctx| act.check_liveness(ctx));
    }
}

impl Handler<ConnUp> for Supervisor {
    type Result = ();
    fn handle(&mut self, msg: ConnUp, ctx: &mut Context<Self>) {
        if msg.generation != self.generation {
            return;
        }
        let Conn::Connecting { task } = std::mem::replace(&mut self.conn, Conn::Disconnected) else {
            return;
        };
        let hello = msg.hello;
        // `auto`: per-session outboundHeaders only to a gateway that says it takes them; stock
        // OpenClaw's schema refuses the field, and clawmux sends it no invalid frame to find out.
        if self.cfg.outbound_headers == OutboundHeadersMode::Auto {
            self.outbound_headers_supported = Some(hello.features.has_capability(clawmux_protocol::handshake::CAP_OUTBOUND_HEADERS));
        }
        let now_ms = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let process = crate::instance::identify(
            hello.server.boot_id.as_deref(),
            hello.snapshot.as_ref().and_then(|s| s.uptime_ms),
            now_ms,
        );
        let session_scoped = hello.features.has_method(name::SESSIONS_SUBSCRIBE) && hello.protocol >= 4;
        let tick_interval = crate::limits::tick_interval(hello.policy.tick_interval_ms);
        tracing::info!(
            protocol = hello.protocol,
            server_version = %hello.server.version,
            session_scoped,
            tick_interval_ms = hello.policy.tick_interval_ms,
            max_payload = hello.policy.max_payload,
            watched_tick_ms = tick_interval.as_millis() as u64,
            "gateway connected"
        );
        self.metrics.connects.with_label_values(&["ok"]).inc();
        self.metrics.connected.set(1);
        self.attempt = 0;
        let scopes = hello.auth.as_ref().map(|a| a.scopes.clone());
        let outbound = self.outbound_headers_supported;
        self.set_status(|s| {
            s.connected = true;
            s.protocol = Some(hello.protocol);
            s.server_version = Some(hello.server.version.clone());
            s.scopes = scopes;
            s.session_scoped = session_scoped;
            s.outbound_headers = outbound;
            s.last_error = None;
            s.connected_since = Some(SystemTime::now());
            s.connections += 1;
            s.tick_interval_ms = Some(hello.policy.tick_interval_ms);
            s.max_payload = Some(crate::limits::max_payload(hello.policy.max_payload) as u64);
            s.pairing_required = false;
            s.missing_scopes.clear();
            s.writes_accepted = None;
        });
        self.conn = Conn::Connected(Connected {
            task,
            tx: msg.tx,
            protocol: hello.protocol,
            boot_id: process.clone(),
            session_scoped,
            tick_interval,
            last_tick: Instant::now(),
        });
        self.cancel_abandoned(process.as_deref());
        self.announce(self.link_info());
        if hello.auth.is_none() {
            // Protocol 3 does not say which scopes it granted: learn whether writes work with a
            // harmless one (aborting a run that does not exist).
            let params = serde_json::json!({"sessionKey": "agent:main:clawmux-probe:scopes", "runId": "clawmux-scope-probe"});
            self.handle(Call::new(name::CHAT_ABORT, params, PROBE_WRITE, Some(ctx.address().recipient())), ctx);
        }
    }
}

impl Handler<ConnFailed> for Supervisor {
    type Result = ();
    fn handle(&mut self, msg: ConnFailed, ctx: &mut Context<Self>) {
        if msg.generation != self.generation {
            return;
        }
        tracing::warn!(reason = %msg.failure.reason, "gateway connection attempt failed");
        self.metrics.connects.with_label_values(&["failed"]).inc();
        let pairing = msg.failure.pairing_required;
        self.set_status(|s| s.pairing_required = pairing);
        self.next_delay_hint = msg.failure.retry_after;
        if let Some(expected) = msg.failure.protocol_mismatch {
            let next = next_offer(self.offer, expected);
            if next != self.offer {
                tracing::info!(refused = self.offer, next, "the gateway refused the protocol offered; offering the other one");
                self.offer = next;
                // The other protocol at once (within the backoff's minimum), not after a backoff.
                self.next_delay_hint = Some(Duration::ZERO);
            }
        }
        self.lost(ctx, "connect_failed", msg.failure.reason);
    }
}

impl Handler<ConnClosed> for Supervisor {
    type Result = ();
    fn handle(&mut self, msg: ConnClosed, ctx: &mut Context<Self>) {
        if msg.generation != self.generation {
            return;
        }
        self.lost(ctx, "closed", msg.reason);
    }
}

impl Handler<Inbound> for Supervisor {
    type Result = ();
    fn handle(&mut self, msg: Inbound, ctx: &mut Context<Self>) {
        if msg.generation != self.generation {
            return;
        }
        match msg.frame {
            Ok(Frame::Res(res)) => {
                self.metrics.frames_received.with_label_values(&["res"]).inc();
                self.on_response(res);
            }
            Ok(Frame::Event(ev)) => {
                self.metrics.frames_received.with_label_values(&["event"]).inc();
                self.on_event(ctx, ev.event, msg.received);
            }
            Ok(Frame::Req(_)) => {
                self.metrics.frames_malformed.inc();
                tracing::warn!("the gateway sent a request frame; ignored");
            }
            Err(clawmux_protocol::DecodeError::MalformedResponse { id, reason }) => {
                self.metrics.frames_malformed.inc();
                tracing::warn!(%id, %reason, "malformed answer from the gateway; its caller is told");
                self.on_unreadable_response(&id, reason);
            }
            Err(e) => {
                self.metrics.frames_malformed.inc();
                tracing::warn!(error = %e, "malformed frame from the gateway dropped");
            }
        }
    }
}

impl Handler<Call> for Supervisor {
    type Result = ();
    fn handle(&mut self, msg: Call, _ctx: &mut Context<Self>) {
        let Conn::Connected(c) = &self.conn else {
            if let Some(r) = msg.reply_to {
                r.do_send(Reply { tag: msg.tag, result: Err(CallError::NotConnected) });
            }
            return;
        };
        self.next_request_id += 1;
        let id = format!("cm-{}", self.next_request_id);
        // Protocol 3 rejects the frame field outright.
        let traceparent = if c.protocol >= 4 { msg.traceparent.as_deref() } else { None };
        let text = match encode_request(&id, msg.method, &msg.params, traceparent) {
            Ok(t) => t,
            Err(e) => {
                if let Some(r) = msg.reply_to {
                    r.do_send(Reply { tag: msg.tag, result: Err(CallError::Malformed(e.to_string())) });
                }
                return;
            }
        };
        if c.tx.send(text).is_err() {
            if let Some(r) = msg.reply_to {
                r.do_send(Reply { tag: msg.tag, result: Err(CallError::Disconnected) });
            }
            return;
        }
        let deadline = match msg.wait {
            Wait::Default => Some(Instant::now() + self.cfg.request_timeout),
            Wait::Caller => None,
            Wait::Up(d) => Instant::now().checked_add(d),
        };
        self.pending.insert(id, Pending { method: msg.method, tag: msg.tag, reply_to: msg.reply_to, deadline });
    }
}

impl Handler<OutboundHeadersUnsupported> for Supervisor {
    type Result = ();
    fn handle(&mut self, _msg: OutboundHeadersUnsupported, _ctx: &mut Context<Self>) {
        if self.outbound_headers_supported != Some(false) {
            tracing::info!("the gateway rejects per-session outboundHeaders (stock OpenClaw); not sending them any more");
        }
        self.outbound_headers_supported = Some(false);
        self.set_status(|s| s.outbound_headers = Some(false));
        // Runs admitted from now on start without them.
        if matches!(self.conn, Conn::Connected(_)) {
            self.announce(self.link_info());
        }
    }
}

impl Handler<AddRoute> for Supervisor {
    type Result = ();
    fn handle(&mut self, msg: AddRoute, _ctx: &mut Context<Self>) {
        if self.routes.insert(msg.session_key.as_str(), &msg.gateway_run_id, msg.to).is_some() {
            // Gateway run ids are fresh UUIDs: a second owner is a bug, and the first one keeps
            // nothing it could be sent by mistake.
            tracing::error!(gateway_run_id = %msg.gateway_run_id, "a route was registered twice; the newer owner has it");
        }
    }
}

impl Handler<RemoveRoute> for Supervisor {
    type Result = ();
    fn handle(&mut self, msg: RemoveRoute, _ctx: &mut Context<Self>) {
        self.routes.remove(msg.session_key.as_str(), &msg.gateway_run_id);
    }
}

impl Handler<Abandon> for Supervisor {
    type Result = ();
    fn handle(&mut self, msg: Abandon, _ctx: &mut Context<Self>) {
        self.abandon(msg);
    }
}

impl Handler<Stats> for Supervisor {
    type Result = MessageResult<Stats>;
    fn handle(&mut self, _msg: Stats, _ctx: &mut Context<Self>) -> Self::Result {
        MessageResult(SupervisorStats { pending: self.pending.len(), routes: self.routes.len(), abandoned: self.abandoned.len() })
    }
}

impl Handler<ListenLink> for Supervisor {
    type Result = ();
    fn handle(&mut self, msg: ListenLink, _ctx: &mut Context<Self>) {
        // The current state at once, so a listener that arrives late misses nothing.
        msg.0.do_send(Link(self.link_info()));
        self.listener = Some(msg.0);
    }
}

/// Stops reconnecting and closes the connection (shutdown, once the runs are handed off or ended).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Disconnect;

impl Handler<Disconnect> for Supervisor {
    type Result = ();
    fn handle(&mut self, _msg: Disconnect, ctx: &mut Context<Self>) {
        let task = match std::mem::replace(&mut self.conn, Conn::Stopped) {
            // Dropping the sender ends the writer, which closes the socket with a close frame;
            // the task is stopped for good a moment later.
            Conn::Connected(c) => Some(c.task),
            Conn::Connecting { task } => {
                task.abort();
                None
            }
            _ => None,
        };
        self.metrics.connected.set(0);
        self.set_status(|s| {
            s.connected = false;
            s.last_error = Some("clawmux is shutting down".to_owned());
        });
        ctx.run_later(CLOSE_GRACE, move |_, _| {
            if let Some(t) = task {
                t.abort();
            }
        });
    }
}

/// The protocol to offer after a gateway refused `offered` saying it speaks `expected` (0: did not
/// say): that one when clawmux speaks it, else the other of the two clawmux speaks.
fn next_offer(offered: u32, expected: u32) -> u32 {
    use clawmux_protocol::handshake::{FALLBACK_PROTOCOL, MAX_PROTOCOL, MIN_PROTOCOL, PREFERRED_PROTOCOL};
    if (MIN_PROTOCOL..=MAX_PROTOCOL).contains(&expected) {
        expected
    } else if offered == PREFERRED_PROTOCOL {
        FALLBACK_PROTOCOL
    } else {
        PREFERRED_PROTOCOL
    }
}

/// How long a closing connection may take to send its close frame.
const CLOSE_GRACE: Duration = Duration::from_millis(500);

/// Reply tag of the protocol-3 write-scope probe.
const PROBE_WRITE: u64 = u64::MAX;

fn scope_of(e: &ErrorShape) -> String {
    e.message.strip_prefix("missing scope:").map(|s| s.trim().to_owned()).unwrap_or_else(|| e.message.clone())
}

impl Handler<ScopeMissing> for Supervisor {
    type Result = ();
    fn handle(&mut self, msg: ScopeMissing, _ctx: &mut Context<Self>) {
        let scope = scope_of(&msg.0);
        tracing::error!(scope = %scope, message = %msg.0.message, "the gateway refused a write for a missing scope");
        self.set_status(|s| crate::limits::note_missing_scope(&mut s.missing_scopes, &scope));
    }
}

impl Handler<Reply> for Supervisor {
    type Result = ();
    fn handle(&mut self, msg: Reply, ctx: &mut Context<Self>) {
        if msg.tag != PROBE_WRITE {
            return;
        }
        match msg.result {
            Err(CallError::Gateway(e)) if e.is_missing_scope() => {
                self.set_status(|s| s.writes_accepted = Some(false));
                self.handle(ScopeMissing(e), ctx)
            }
            Ok(_) => {
                tracing::info!("the gateway accepts clawmux's writes");
                self.set_status(|s| s.writes_accepted = Some(true));
            }
            Err(e) => tracing::warn!(error = ?e, "scope probe failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_explains_what_is_missing() {
        let mut s = GatewayStatus::default();
        assert!(s.ready().is_err(), "not connected");
        s.connected = true;
        assert!(s.ready().is_ok(), "protocol 3 reports no scopes: ready until a write is refused");
        s.scopes = Some(vec![]);
        assert!(s.ready().err().is_some_and(|r| r.contains("CLAWMUX_DEVICE_IDENTITY")), "no device: say how to fix it");
        s.device_id = Some("dev".into());
        assert!(s.ready().err().is_some_and(|r| r.contains("operator.read")));
        s.scopes = Some(vec!["operator.read".into(), "operator.write".into()]);
        assert!(s.ready().is_ok());
        s.missing_scopes = vec!["operator.admin".into()];
        assert!(s.ready().err().is_some_and(|r| r.contains("operator.admin")));
    }

    #[test]
    fn the_handshake_waits_the_official_pre_connect_timeout() {
        assert_eq!(SupervisorConfig::new("ws://x").handshake_timeout, Duration::from_millis(15_000));
    }

    #[test]
    fn a_refused_protocol_is_followed_by_the_other_one() {
        assert_eq!(next_offer(4, 3), 3, "2026.4.12 says it speaks 3");
        assert_eq!(next_offer(3, 4), 4, "a gateway upgraded to 2026.9.x");
        assert_eq!(next_offer(4, 0), 3, "no word of which: the other one");
        assert_eq!(next_offer(3, 0), 4);
        assert_eq!(next_offer(4, 5), 3, "one clawmux does not speak: the other one it does");
    }
}
