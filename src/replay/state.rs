//! The gateway's shared state: connections (with their scopes, subscriptions and counters),
//! sessions, runs, and who receives which event.
//!
//! One `std::sync::Mutex` guards it all. It is never held across an `.await`: every operation
//! takes the lock, changes state and queues frames on per-connection unbounded channels, then
//! lets go. Queuing under the lock is what makes delivery order (and the `seq` numbering) the same
//! for every connection, as it is on the real gateway's single event loop.

use super::config::ReplayConfig;
use super::script::RunScript;
use super::Track;
use clawmux_protocol::frame::encode_event;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Mutex, MutexGuard};
use tokio::sync::{mpsc, watch};

/// Events that a `session-scoped-events` connection receives only for subscribed sessions
/// (`SESSION_SUBSCRIPTION_EVENTS` of 2026.9.x).
pub(crate) const SESSION_SCOPED_EVENTS: [&str; 5] = ["agent", "chat", "chat.side_result", "session.observer", "session.tool"];

/// How many closed connections keep their stats (a long demo must not grow without bound).
const CLOSED_STATS_KEPT: usize = 1024;

/// Internal id of a socket (the wire `connId` is a UUID kept beside it).
pub(crate) type ConnKey = u64;

/// Something for a connection's socket task to do.
#[derive(Debug)]
pub(crate) enum Outbound {
    /// Send a text frame; `event` names it for the per-connection event counters.
    Text {
        /// The encoded frame.
        text: String,
        /// Event name, when the frame is an event.
        event: Option<String>,
    },
    /// Send a close frame, then end the connection.
    Close {
        /// WebSocket close code.
        code: u16,
        /// Close reason.
        reason: String,
    },
    /// Drop the socket without a close frame (a crash, as the client sees it).
    Drop,
}

/// Granted operator scopes; admin satisfies every check and write satisfies read, as in the gateway.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Scopes {
    /// `operator.read` (or implied).
    pub read: bool,
    /// `operator.write` (or implied).
    pub write: bool,
    /// `operator.admin`.
    pub admin: bool,
}

impl Scopes {
    /// The effective scopes of a granted list.
    pub fn from_granted(granted: &[String]) -> Self {
        let has = |s: &str| granted.iter().any(|g| g == s);
        let admin = has("operator.admin");
        let write = admin || has("operator.write");
        Self { read: write || has("operator.read"), write, admin }
    }

    /// Whether the scope named `scope` is satisfied.
    pub fn allows(&self, scope: &str) -> bool {
        match scope {
            "operator.read" => self.read,
            "operator.write" => self.write,
            "operator.admin" => self.admin,
            _ => false,
        }
    }
}

/// One open socket.
#[derive(Debug)]
pub(crate) struct ConnEntry {
    /// Frames for the socket task.
    pub tx: mpsc::UnboundedSender<Outbound>,
    /// The wire `connId` (hello-ok).
    pub conn_id: String,
    /// Whether `hello-ok` was sent; only handshaken connections get events.
    pub handshaken: bool,
    /// Granted scopes (checked by methods and by event delivery).
    pub scopes: Scopes,
    /// Asked for `session-scoped-events` (protocol 4 honours it).
    pub scoped_events: bool,
    /// Sessions subscribed with `sessions.messages.subscribe` (canonical keys).
    pub subscriptions: HashSet<String>,
    /// Last top-level `seq` sent to this connection (protocol 4 counts per connection).
    pub seq: u64,
    /// Asked for `tool-events`: only such connections get `agent` events of the `tool` stream
    /// (tool arguments and results), as on 2026.9.x.
    pub tool_events: bool,
}

/// Per-connection counters, public through [`ReplayStats`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnStats {
    /// The wire `connId`.
    pub conn_id: String,
    /// Still open.
    pub open: bool,
    /// Completed the handshake.
    pub handshaken: bool,
    /// Scopes granted at the handshake.
    pub scopes: Vec<String>,
    /// Asked for `session-scoped-events`.
    pub session_scoped: bool,
    /// Text frames written to the socket (challenge, responses, events).
    pub frames_sent: u64,
    /// Bytes of those frames.
    pub bytes_sent: u64,
    /// Events written, by event name.
    pub events_sent: BTreeMap<String, u64>,
    /// The close code of the close frame the client sent (1005 for one without a code); `None`
    /// while open or when it went away without one (a dropped socket).
    pub client_close: Option<u16>,
}

/// Counters of a gateway, from [`ReplayHandle::stats`](super::ReplayHandle::stats).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayStats {
    /// Sockets accepted since start.
    pub connections_opened: u64,
    /// Sockets open now.
    pub connections_current: u64,
    /// `hello-ok` sent.
    pub handshakes_ok: u64,
    /// Connects refused (bad params, protocol, token, starting) or timed out.
    pub handshakes_failed: u64,
    /// Every connection in accept order (closed ones too, the last 1024 of them).
    pub connections: Vec<ConnStats>,
    /// Text frames written since start, all connections (including ones no longer listed):
    /// what a benchmark compares between client designs.
    pub frames_sent: u64,
    /// Bytes of those frames.
    pub bytes_sent: u64,
    /// Events written since start by event name, all connections.
    pub events_sent: BTreeMap<String, u64>,
    /// Requests received from handshaken connections since start, by method (`connect` is not
    /// counted): lets a test wait until clawmux has asked something (e.g. `agent.wait`).
    pub requests_received: BTreeMap<String, u64>,
}

impl ReplayStats {
    /// The stats of the connection with this wire `connId`.
    pub fn connection(&self, conn_id: &str) -> Option<&ConnStats> {
        self.connections.iter().find(|c| c.conn_id == conn_id)
    }
}

/// Where a run is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunStatus {
    /// ACKed, waiting for an earlier run of the same session.
    Queued,
    /// Replaying events.
    Running,
    /// Final `res` sent with `status:"ok"`.
    Ok,
    /// Final `res` sent with `status:"error"`.
    Error,
    /// Final `res` sent with `status:"timeout"` (aborted runs end so too; see `aborted`).
    Timeout,
    /// Lost in a simulated crash (`drop_connections(true)`): no final was ever sent.
    Forgotten,
}

/// What a started run looked like, for tests asserting what the gateway would forward to the LLM.
#[derive(Debug, Clone, PartialEq)]
pub struct RunRecord {
    /// Run id (= idempotency key).
    pub run_id: String,
    /// Canonical session key.
    pub session_key: String,
    /// The user message.
    pub message: String,
    /// The model in effect: the session's last `sessions.patch` model, else the default model.
    pub model: String,
    /// The session's model override, `None` when never patched (or cleared).
    pub model_override: Option<String>,
    /// The session's `outboundHeaders` (Cogni fork only), as the LLM would receive them.
    pub outbound_headers: BTreeMap<String, String>,
    /// `traceparent` of the `agent` request frame (protocol 4 forwards its trace id to the LLM).
    pub traceparent: Option<String>,
    /// `extraSystemPrompt` (copied into every LLM call's system prompt).
    pub extra_system_prompt: Option<String>,
    /// `timeout` in seconds, as asked (not enforced by the replay).
    pub timeout_s: Option<u64>,
    /// The replayed track.
    pub track: String,
    /// The requesting connection's `connId`.
    pub conn_id: String,
    /// Current status.
    pub status: RunStatus,
    /// Ended by `chat.abort` / `sessions.abort`.
    pub aborted: bool,
    /// When the gateway accepted the run, and when it sent its final `res`: the gateway's own
    /// order of events, which tests compare instead of arrival times on two client sockets.
    pub accepted_at: std::time::Instant,
    /// See [`RunRecord::accepted_at`]; `None` while running (or lost in a simulated crash).
    pub finished_at: Option<std::time::Instant>,
    /// Abort requests that named this run (by run id, with whatever session key: the gateway
    /// aborts a named run without checking it), whether or not they found it still running:
    /// whoever stops waiting for a run must cancel it, even one that looks over.
    pub abort_requests: u32,
}

/// Who asked to abort, so that the run task answers in the gateway's order (after the `aborted`
/// chat event and the lifecycle `end`, before the trailing lifecycle `error`).
#[derive(Debug)]
pub(crate) struct AbortRequest {
    /// The connection that called the abort method.
    pub conn: ConnKey,
    /// Its request id.
    pub request_id: String,
    /// Which method, hence which answer shape.
    pub kind: AbortKind,
}

/// The two abort methods answer differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AbortKind {
    /// `chat.abort` → `{ok, aborted, runIds}`.
    Chat,
    /// `sessions.abort` → `{ok, abortedRunId, status}`.
    Session,
}

impl AbortKind {
    /// The answer when a run was aborted.
    pub fn aborted(self, run_id: &str) -> Value {
        match self {
            AbortKind::Chat => serde_json::json!({"ok": true, "aborted": true, "runIds": [run_id]}),
            AbortKind::Session => serde_json::json!({"ok": true, "abortedRunId": run_id, "status": "aborted"}),
        }
    }

    /// The answer when nothing was running.
    pub fn nothing(self) -> Value {
        match self {
            AbortKind::Chat => serde_json::json!({"ok": true, "aborted": false, "runIds": []}),
            AbortKind::Session => serde_json::json!({"ok": true, "abortedRunId": null, "status": "no-active-run"}),
        }
    }
}

/// A session (created by `sessions.patch` or by the first run on its key).
#[derive(Debug)]
pub(crate) struct SessionEntry {
    /// The session's own id (replaces recorded `sessionId`s).
    pub session_id: String,
    /// `provider/model` set by `sessions.patch`.
    pub model_override: Option<String>,
    /// Cogni-fork `outboundHeaders`, sticky per session.
    pub outbound_headers: BTreeMap<String, String>,
    /// Creation time (epoch ms).
    pub created_at: i64,
    /// Last change (epoch ms).
    pub updated_at: i64,
    /// Completion signal of the last run queued on this session: the next run waits for it
    /// (runs of one session are serialised; the sender is dropped if the run is forgotten).
    pub tail: Option<watch::Receiver<bool>>,
    /// Transcript for `chat.history`: user and assistant messages.
    pub transcript: Vec<Value>,
    /// `lifecycleRevision` of the session's entry (fixed for its life).
    pub lifecycle_revision: String,
    /// `createdVia`: `operator` (made by `sessions.patch`) or `run` (by an `agent` run).
    pub created_via: &'static str,
    /// `label` set by `sessions.patch`.
    pub label: Option<String>,
    /// `modelOverrideSource`: `user` while an override is set, `default` once one was cleared.
    pub override_source: Option<&'static str>,
    /// The model changed on an existing session: protocol 4 reports `liveModelSwitchPending` and a
    /// `delivery` of kind `none` from then on (the flag until the override is cleared).
    pub live_switch_pending: bool,
    /// See [`SessionEntry::live_switch_pending`].
    pub delivery_none: bool,
}

/// A run known to the gateway (the dedupe cache is the same map: `runId` = idempotency key).
#[derive(Debug)]
pub(crate) struct RunEntry {
    /// Index into [`State::records`].
    pub record: usize,
    /// Canonical session key.
    pub session_key: String,
    /// The ACK payload, answered again to a repeated key while the run is in flight.
    pub ack: Value,
    /// The final payload once sent, answered to a repeated key afterwards.
    pub final_payload: Option<Value>,
    /// Abort requests for the run task; `None` once the run is over (or on protocol 3).
    pub abort_tx: Option<mpsc::UnboundedSender<AbortRequest>>,
    /// Whether the run task is replaying events (not queued, not finished).
    pub playing: bool,
    /// `agent.wait` extras from the lifecycle `end` (`stopReason`, `terminalReply`, ...).
    pub wait_extras: serde_json::Map<String, Value>,
    /// When it ended (epoch ms).
    pub ended_at: Option<i64>,
    /// When it started replaying (epoch ms).
    pub started_at: Option<i64>,
    /// The task, to cancel it when the gateway "crashes" and forgets runs.
    pub task: Option<tokio::task::AbortHandle>,
    /// The scripted answer to `agent.wait` ([`RunScript::wait_reply`]).
    pub wait_reply: Option<Value>,
}

/// Gateway-wide totals.
#[derive(Debug, Default)]
pub(crate) struct Totals {
    /// Sockets accepted.
    pub opened: u64,
    /// `hello-ok` sent.
    pub handshakes_ok: u64,
    /// Connects refused or timed out.
    pub handshakes_failed: u64,
    /// Text frames written, all sockets (closed ones too, even after their stats were trimmed).
    pub frames_sent: u64,
    /// Bytes of those frames.
    pub bytes_sent: u64,
    /// Events written, by name, all sockets.
    pub events_sent: BTreeMap<String, u64>,
    /// Requests received, by method.
    pub requests: BTreeMap<String, u64>,
}

/// Everything mutable.
#[derive(Debug, Default)]
pub(crate) struct State {
    /// Open sockets (handshaken or not).
    pub conns: HashMap<ConnKey, ConnEntry>,
    /// Counters per socket, kept after close for tests that look afterwards.
    pub stats: HashMap<ConnKey, ConnStats>,
    /// Accept order of `stats` (the order `ReplayStats::connections` reports).
    pub stats_order: Vec<ConnKey>,
    /// Sessions by canonical key (they outlive runs and crashes, like the gateway's store).
    pub sessions: HashMap<String, SessionEntry>,
    /// Runs by run id: the live runs and the dedupe cache of finished ones.
    pub runs: HashMap<String, RunEntry>,
    /// Every run ever started, for `ReplayHandle::runs`.
    pub records: Vec<RunRecord>,
    /// Protocol 3's one gateway-wide frame counter.
    pub global_seq: u64,
    /// Gateway-wide counters.
    pub totals: Totals,
    /// Last socket key handed out.
    pub next_conn: ConnKey,
    /// Next track in round-robin order.
    pub round_robin: usize,
    /// `hello-ok.server.bootId` (protocol 4): a new one after a simulated restart, so clients can
    /// tell a reconnect to the same process from one to a restarted gateway, as with the real one.
    pub boot_id: String,
    /// When this "process" started: `hello-ok.snapshot.uptimeMs` counts from here (protocol 3
    /// clients tell a restart by it, having no boot id); a simulated restart resets it.
    pub booted_at: Option<std::time::Instant>,
    /// Scripted run endings: a run whose message contains the marker follows the first match.
    pub scripts: Vec<(String, RunScript)>,
    /// `agent` requests still to be lost, by marker: a request whose message contains the marker
    /// is dropped unhandled (the first registered match with a count left), like a frame still in
    /// a dying connection's buffers.
    pub lost_agent_requests: Vec<(String, usize)>,
}

/// State plus the immutable configuration and the lock-free knobs.
#[derive(Debug)]
pub(crate) struct Shared {
    /// The configuration as given.
    pub cfg: ReplayConfig,
    /// The cassette's tracks prepared for this server (downgraded for protocol 3, re-cut when
    /// `deltas_override` is set), in round-robin order.
    pub tracks: Vec<Track>,
    /// Event names for `hello-ok.features.events`.
    pub event_names: Vec<String>,
    /// Everything mutable.
    pub state: Mutex<State>,
    /// `tick` events on/off.
    pub ticks_enabled: AtomicBool,
    /// Connects still to be refused with `UNAVAILABLE` "gateway starting".
    pub unavailable_connects: AtomicUsize,
    /// The `retryAfterMs` those refusals carry (500, as the real gateway; tests set absurd ones).
    pub unavailable_retry_after_ms: AtomicU64,
    /// While `true` the gateway is frozen like a stopped process: sockets are neither read nor
    /// written (TCP stays open), no ticks, run clocks stand still, new sockets get no upgrade.
    pub frozen: watch::Sender<bool>,
    /// While `false` the listener is closed (connects are refused), as with a dead gateway.
    pub listening: watch::Sender<bool>,
    /// Runs stop before their next event while `true`.
    pub paused: watch::Sender<bool>,
    /// Bumped whenever a run ends (wakes `agent.wait`).
    pub runs_changed: watch::Sender<u64>,
    /// Set by `stop()`: the accept loop and the tick task end.
    pub stopping: watch::Sender<bool>,
}

impl Shared {
    /// Locks the state; a panic elsewhere must not wedge the gateway, so poisoning is ignored.
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The protocol this gateway speaks.
    pub fn protocol(&self) -> u32 {
        self.cfg.protocol
    }
}

/// Resolves once the flag is `true` (or its sender is gone). The `watch::Ref` that `wait_for`
/// returns is dropped here, so callers' futures stay `Send`.
pub(crate) async fn wait_true(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|v| *v).await.map(|_| ());
}

/// Current time in epoch milliseconds.
pub(crate) fn now_ms() -> i64 {
    let now = time::OffsetDateTime::now_utc();
    i64::try_from(now.unix_timestamp_nanos() / 1_000_000).unwrap_or(i64::MAX)
}

impl State {
    /// Registers a new socket and returns its key.
    pub fn add_conn(&mut self, tx: mpsc::UnboundedSender<Outbound>, conn_id: String) -> ConnKey {
        self.next_conn += 1;
        let key = self.next_conn;
        self.totals.opened += 1;
        self.conns.insert(
            key,
            ConnEntry {
                tx,
                conn_id: conn_id.clone(),
                handshaken: false,
                scopes: Scopes::default(),
                scoped_events: false,
                subscriptions: HashSet::new(),
                seq: 0,
                tool_events: false,
            },
        );
        self.stats.insert(key, ConnStats { conn_id, open: true, ..ConnStats::default() });
        self.stats_order.push(key);
        self.trim_closed_stats();
        key
    }

    /// Records the close frame a client sent.
    pub fn client_closed(&mut self, key: ConnKey, code: u16) {
        if let Some(s) = self.stats.get_mut(&key) {
            s.client_close = Some(code);
        }
    }

    /// Forgets a closed socket (its stats stay).
    pub fn remove_conn(&mut self, key: ConnKey) {
        self.conns.remove(&key);
        if let Some(s) = self.stats.get_mut(&key) {
            s.open = false;
        }
    }

    fn trim_closed_stats(&mut self) {
        let closed = self.stats_order.iter().filter(|k| self.stats.get(k).is_some_and(|s| !s.open)).count();
        if closed <= CLOSED_STATS_KEPT {
            return;
        }
        let mut excess = closed - CLOSED_STATS_KEPT;
        let stats = &mut self.stats;
        self.stats_order.retain(|k| {
            if excess > 0 && stats.get(k).is_some_and(|s| !s.open) {
                stats.remove(k);
                excess -= 1;
                false
            } else {
                true
            }
        });
    }

    /// Counts a frame the socket task has written.
    pub fn count_sent(&mut self, key: ConnKey, bytes: usize, event: Option<&str>) {
        self.totals.frames_sent += 1;
        self.totals.bytes_sent += bytes as u64;
        if let Some(name) = event {
            match self.totals.events_sent.get_mut(name) {
                Some(n) => *n += 1,
                None => {
                    self.totals.events_sent.insert(name.to_owned(), 1);
                }
            }
        }
        if let Some(s) = self.stats.get_mut(&key) {
            s.frames_sent += 1;
            s.bytes_sent += bytes as u64;
            if let Some(name) = event {
                *s.events_sent.entry(name.to_owned()).or_default() += 1;
            }
        }
    }

    /// Queues a frame for one connection (a `res`, the challenge). A gone connection is ignored:
    /// the gateway does not hold answers for clients that left.
    pub fn send_to(&self, key: ConnKey, text: String) {
        if let Some(c) = self.conns.get(&key) {
            let _ = c.tx.send(Outbound::Text { text, event: None });
        }
    }

    /// Broadcasts an event with the gateway's delivery rules:
    /// - protocol 3: every handshaken connection, whatever its scopes, one global `seq`;
    /// - protocol 4: `tick`/`shutdown` to everyone; other events need `operator.read`; run-scoped
    ///   events ([`SESSION_SCOPED_EVENTS`]) go to a `session-scoped-events` connection only for
    ///   sessions it subscribed to; `agent` events of the `tool` stream only to connections with cap
    ///   `tool-events`; `seq` counts per connection.
    ///
    /// Returns how many connections it was queued for.
    pub fn broadcast(&mut self, protocol: u32, name: &str, payload: &Value, session_key: Option<&str>) -> usize {
        let global = if protocol == 3 {
            self.global_seq += 1;
            Some(self.global_seq)
        } else {
            None
        };
        let scoped = SESSION_SCOPED_EVENTS.contains(&name);
        // Tool arguments and results go only to connections that asked for them (cap `tool-events`).
        let tool_stream = name == "agent" && payload.get("stream").and_then(Value::as_str) == Some("tool");
        let everyone = matches!(name, "tick" | "shutdown");
        let mut delivered = 0;
        for c in self.conns.values_mut().filter(|c| c.handshaken) {
            if protocol != 3 {
                if !everyone && !c.scopes.read {
                    continue;
                }
                if scoped && c.scoped_events && !session_key.is_some_and(|k| c.subscriptions.contains(k)) {
                    continue;
                }
                if tool_stream && !c.tool_events {
                    continue;
                }
            }
            let seq = match global {
                Some(g) => g,
                None => {
                    c.seq += 1;
                    c.seq
                }
            };
            if let Ok(text) = encode_event(name, payload, Some(seq)) {
                if c.tx.send(Outbound::Text { text, event: Some(name.to_owned()) }).is_ok() {
                    delivered += 1;
                }
            }
        }
        delivered
    }

    /// Counts a request of a handshaken connection.
    pub fn count_request(&mut self, method: &str) {
        match self.totals.requests.get_mut(method) {
            Some(n) => *n += 1,
            None => {
                self.totals.requests.insert(method.to_owned(), 1);
            }
        }
    }

    /// Whether an `agent` request with this message is to be lost (and counts it if so).
    pub fn lose_agent_request(&mut self, message: &str) -> bool {
        match self.lost_agent_requests.iter_mut().find(|(marker, left)| *left > 0 && message.contains(marker.as_str())) {
            Some((_, left)) => {
                *left -= 1;
                true
            }
            None => false,
        }
    }

    /// The script of a run whose message contains its marker (the first registered match).
    pub fn script_for(&self, message: &str) -> Option<RunScript> {
        self.scripts.iter().find(|(marker, _)| message.contains(marker.as_str())).map(|(_, s)| s.clone())
    }

    /// Queues a raw frame for every handshaken connection (test fault injection).
    pub fn broadcast_raw(&self, frame: &str) -> usize {
        let event = serde_json::from_str::<Value>(frame).ok().and_then(|v| {
            (v.get("type").and_then(Value::as_str) == Some("event"))
                .then(|| v.get("event").and_then(Value::as_str).map(str::to_owned))
                .flatten()
        });
        self.conns
            .values()
            .filter(|c| c.handshaken)
            .filter(|c| c.tx.send(Outbound::Text { text: frame.to_owned(), event: event.clone() }).is_ok())
            .count()
    }

    /// The public stats snapshot.
    pub fn snapshot_stats(&self) -> ReplayStats {
        ReplayStats {
            connections_opened: self.totals.opened,
            connections_current: self.conns.len() as u64,
            handshakes_ok: self.totals.handshakes_ok,
            handshakes_failed: self.totals.handshakes_failed,
            connections: self.stats_order.iter().filter_map(|k| self.stats.get(k).cloned()).collect(),
            frames_sent: self.totals.frames_sent,
            bytes_sent: self.totals.bytes_sent,
            events_sent: self.totals.events_sent.clone(),
            requests_received: self.totals.requests.clone(),
        }
    }

    /// The session, created on first use (the gateway creates sessions on patch or first run).
    pub fn session_mut(&mut self, key: &str) -> &mut SessionEntry {
        self.session_made_by(key, "run")
    }

    /// The session of `key`, created (with `createdVia: via`) when it does not exist yet.
    pub fn session_made_by(&mut self, key: &str, via: &'static str) -> &mut SessionEntry {
        self.sessions.entry(key.to_owned()).or_insert_with(|| {
            let now = now_ms();
            SessionEntry {
                session_id: uuid::Uuid::new_v4().to_string(),
                model_override: None,
                outbound_headers: BTreeMap::new(),
                created_at: now,
                updated_at: now,
                tail: None,
                transcript: Vec::new(),
                lifecycle_revision: uuid::Uuid::new_v4().to_string(),
                created_via: via,
                label: None,
                override_source: None,
                live_switch_pending: false,
                delivery_none: false,
            }
        })
    }

    /// The run currently replaying on a session (what `chat.abort` without `runId` and
    /// `sessions.abort` stop), falling back to the oldest queued one.
    pub fn active_run_of(&self, session_key: &str) -> Option<String> {
        let mut candidates: Vec<(&String, &RunEntry)> =
            self.runs.iter().filter(|(_, r)| r.session_key == session_key && r.abort_tx.is_some()).collect();
        candidates.sort_by_key(|(_, r)| (!r.playing, r.record));
        candidates.first().map(|(id, _)| (*id).clone())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    fn conn(state: &mut State, scopes: &[&str], scoped: bool, subs: &[&str]) -> (ConnKey, mpsc::UnboundedReceiver<Outbound>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let key = state.add_conn(tx, format!("c{}", state.next_conn + 1));
        let c = state.conns.get_mut(&key).unwrap();
        c.handshaken = true;
        c.scopes = Scopes::from_granted(&scopes.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>());
        c.scoped_events = scoped;
        c.subscriptions = subs.iter().map(|s| (*s).to_owned()).collect();
        (key, rx)
    }

    fn seqs(rx: &mut mpsc::UnboundedReceiver<Outbound>) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        while let Ok(Outbound::Text { text, event }) = rx.try_recv() {
            let v: Value = serde_json::from_str(&text).unwrap();
            out.push((event.unwrap_or_default(), v["seq"].as_u64().unwrap()));
        }
        out
    }

    #[test]
    fn v4_delivery_follows_scopes_caps_and_subscriptions() {
        let mut s = State::default();
        let (_, mut all) = conn(&mut s, &["operator.read", "operator.write"], false, &[]);
        let (_, mut none) = conn(&mut s, &[], false, &[]);
        let (_, mut sub) = conn(&mut s, &["operator.write"], true, &["agent:main:a"]);
        let p = json!({"runId":"r"});
        s.broadcast(4, "chat", &p, Some("agent:main:a"));
        s.broadcast(4, "chat", &p, Some("agent:main:b"));
        s.broadcast(4, "task", &p, Some("agent:main:b"));
        s.broadcast(4, "tick", &json!({"ts":1}), None);
        assert_eq!(seqs(&mut all), [("chat".into(), 1), ("chat".into(), 2), ("task".into(), 3), ("tick".into(), 4)]);
        assert_eq!(seqs(&mut none), [("tick".into(), 1)]);
        assert_eq!(seqs(&mut sub), [("chat".into(), 1), ("task".into(), 2), ("tick".into(), 3)]);
    }

    #[test]
    fn v3_delivers_everything_with_one_global_seq() {
        let mut s = State::default();
        let (_, mut a) = conn(&mut s, &["operator.admin"], false, &[]);
        let (_, mut z) = conn(&mut s, &[], true, &["agent:main:x"]);
        s.broadcast(3, "chat", &json!({}), Some("agent:main:a"));
        s.broadcast(3, "agent", &json!({}), Some("agent:main:b"));
        assert_eq!(seqs(&mut a), [("chat".into(), 1), ("agent".into(), 2)]);
        assert_eq!(seqs(&mut z), [("chat".into(), 1), ("agent".into(), 2)]);
    }

    #[test]
    fn scopes_imply_like_the_gateway() {
        let s = Scopes::from_granted(&["operator.write".to_owned()]);
        assert!(s.read && s.write && !s.admin);
        let s = Scopes::from_granted(&["operator.admin".to_owned()]);
        assert!(s.allows("operator.read") && s.allows("operator.write") && s.allows("operator.admin"));
        assert!(!Scopes::default().allows("operator.read"));
    }
}
