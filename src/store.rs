//! The run store: every run's document and event log, live subscribers, idempotency keys, and
//! bounded retention of finished runs.
//!
//! Each run's events are appended and broadcast under one short lock, so a client that re-attaches
//! (`Last-Event-ID`) gets the backlog and then the live events with no gap and no duplicate. Each
//! client reads through its own bounded broadcast receiver: a client that falls behind is
//! disconnected (it can re-attach), it never slows the run or anyone else.

use clawmux_actors::{RunEvent, RunSink, RunStatus};
use dashmap::DashMap;
use serde::Serialize;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use time::OffsetDateTime;
use tokio::sync::broadcast;

/// Events buffered per client before it counts as too slow (it is then disconnected and can
/// re-attach with `Last-Event-ID`). Every live run pre-allocates this ring, so it is kept small.
pub const CLIENT_BUFFER: usize = 256;

/// One SSE event, serialized once and shared by every client.
#[derive(Debug, Clone)]
pub struct StoredEvent {
    /// Per-run sequence number, from 1.
    pub id: u64,
    /// Event name.
    pub name: &'static str,
    /// JSON data.
    pub data: String,
}

impl StoredEvent {
    /// True for `final` and `error`.
    pub fn is_terminal(&self) -> bool {
        matches!(self.name, "final" | "error")
    }
}

/// `usage` of the run document.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    /// Input tokens.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// LLM calls.
    pub llm_calls: u64,
    /// `proxy` (billing truth) or `gateway` (OpenClaw's own numbers, a hint).
    pub source: &'static str,
    /// OpenClaw's own numbers when `source` is `proxy` (kept as a hint, never billed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gateway_hint: Option<GatewayHint>,
}

/// OpenClaw's own token counts.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GatewayHint {
    /// Input tokens.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
}

/// `error` of the run document.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DocError {
    /// Code.
    pub code: &'static str,
    /// Message.
    pub message: String,
}

/// The run document of the contract.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RunDoc {
    /// API run id.
    pub run_id: String,
    /// Canonical session key.
    pub session_key: String,
    /// Gateway run id (null until accepted).
    pub gateway_run_id: Option<String>,
    /// `running`, `ok`, `error`, `aborted`, `timeout`.
    pub status: &'static str,
    /// Final text.
    pub content: String,
    /// Why it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<DocError>,
    /// Token usage.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// Git relay result (absent until the relay exists and ran).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub relay: Option<serde_json::Value>,
    /// RFC 3339.
    pub created_at: String,
    /// RFC 3339 or null.
    pub finished_at: Option<String>,
}

fn rfc3339(t: OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339).unwrap_or_default()
}

struct RunState {
    doc: RunDoc,
    events: Vec<Arc<StoredEvent>>,
    finished_at: Option<Instant>,
    /// Live subscribers' channel; dropped with the terminal event so a finished run (kept for
    /// re-attachment) holds no ring buffer.
    tx: Option<broadcast::Sender<Arc<StoredEvent>>>,
}

/// One run in the store.
pub struct RunRecord {
    /// API run id.
    pub run_id: String,
    /// Fingerprint of the request body (idempotency and run-id reuse).
    pub fingerprint: u64,
    /// Whether a vanished caller cancels the run.
    pub abort_on_disconnect: bool,
    state: Mutex<RunState>,
    /// The run's billing identity and the registry it is live in (set when the LLM proxy is on):
    /// the run stops being attributable with its terminal event.
    billing: std::sync::OnceLock<(Arc<crate::attribution::RunBilling>, Arc<crate::attribution::Attributions>)>,
    /// Flips to true with the terminal event (waiters that only need the end use this, so a lagging
    /// broadcast receiver can never make them miss it).
    done: tokio::sync::watch::Sender<bool>,
}

impl RunRecord {
    fn lock(&self) -> MutexGuard<'_, RunState> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// The current document.
    pub fn doc(&self) -> RunDoc {
        let mut doc = self.lock().doc.clone();
        self.apply_proxy_usage(&mut doc);
        doc
    }

    /// Appends an API-level event (`relay`, a `status` the actors do not produce) unless the run
    /// already ended.
    pub fn emit_event(&self, name: &'static str, data: serde_json::Value) {
        let mut st = self.lock();
        if st.finished_at.is_some() {
            return;
        }
        self.push(&mut st, name, data.to_string());
    }

    /// Records the relay's result in the run document.
    pub fn set_relay(&self, relay: serde_json::Value) {
        self.lock().doc.relay = Some(relay);
    }

    /// Ties the run to its billing identity (its LLM calls are attributed until it ends).
    pub fn set_billing(&self, billing: Arc<crate::attribution::RunBilling>, registry: Arc<crate::attribution::Attributions>) {
        let _ = self.billing.set((billing, registry));
    }

    /// Usage from the proxy's records is the truth; OpenClaw's own numbers stay as a hint.
    fn apply_proxy_usage(&self, doc: &mut RunDoc) {
        let Some((billing, _)) = self.billing.get() else { return };
        let (input, output, calls) = billing.usage();
        if calls == 0 && doc.usage.is_some() {
            return;
        }
        let hint = doc.usage.take().map(|u| GatewayHint { input_tokens: u.input_tokens, output_tokens: u.output_tokens });
        doc.usage = Some(Usage { input_tokens: input, output_tokens: output, llm_calls: calls, source: "proxy", gateway_hint: hint });
    }

    /// Resolves once the run has its terminal event.
    pub async fn finished(&self) {
        let mut rx = self.done.subscribe();
        let _ = rx.wait_for(|d| *d).await;
    }

    /// True once the terminal event is stored.
    pub fn is_finished(&self) -> bool {
        self.lock().finished_at.is_some()
    }

    /// Events after `after`, and a receiver for the ones that follow (taken under the same lock, so
    /// nothing is lost or repeated between the two). The receiver is `None` once the run finished.
    pub fn attach(&self, after: u64) -> (Vec<Arc<StoredEvent>>, Option<broadcast::Receiver<Arc<StoredEvent>>>) {
        let st = self.lock();
        let backlog: Vec<_> = st.events.iter().filter(|e| e.id > after).cloned().collect();
        let rx = if st.finished_at.is_some() { None } else { st.tx.as_ref().map(broadcast::Sender::subscribe) };
        (backlog, rx)
    }

    fn push(&self, st: &mut RunState, name: &'static str, data: String) {
        let ev = Arc::new(StoredEvent { id: st.events.len() as u64 + 1, name, data });
        st.events.push(ev.clone());
        // No receivers is fine: the event stays in the log for re-attachment.
        if let Some(tx) = &st.tx {
            let _ = tx.send(ev);
        }
    }
}

impl RunSink for RunRecord {
    fn emit(&self, event: RunEvent) {
        let mut st = self.lock();
        if st.finished_at.is_some() {
            return;
        }
        match event {
            RunEvent::Accepted { gateway_run_id } => {
                st.doc.gateway_run_id = Some(gateway_run_id.clone());
                let data = serde_json::json!({
                    "runId": self.run_id, "sessionKey": st.doc.session_key, "gatewayRunId": gateway_run_id,
                })
                .to_string();
                self.push(&mut st, "accepted", data);
            }
            RunEvent::Status { phase, tool } => {
                let data = match tool {
                    Some(t) => serde_json::json!({"phase": phase.as_str(), "tool": t}),
                    None => serde_json::json!({"phase": phase.as_str()}),
                }
                .to_string();
                self.push(&mut st, "status", data);
            }
            RunEvent::TextDelta(text) => {
                let data = serde_json::json!({ "text": text }).to_string();
                self.push(&mut st, "text_delta", data);
            }
            RunEvent::Finished(outcome) => {
                st.doc.status = outcome.status.as_str();
                st.doc.content = outcome.content;
                st.doc.finished_at = Some(rfc3339(OffsetDateTime::now_utc()));
                if let Some((input, output)) = outcome.gateway_usage {
                    st.doc.usage = Some(Usage { input_tokens: input, output_tokens: output, llm_calls: 0, source: "gateway", gateway_hint: None });
                }
                if let Some((billing, registry)) = self.billing.get() {
                    // LLM calls after the end belong to no run and are refused (fail-closed).
                    registry.unregister(&billing.trace_id, &billing.run_id);
                }
                match (&outcome.error, outcome.status) {
                    (Some(e), s) if s != RunStatus::Ok => {
                        st.doc.error = Some(DocError { code: e.code.as_str(), message: e.message.clone() });
                        let data = serde_json::json!({"runId": self.run_id, "code": e.code.as_str(), "message": e.message}).to_string();
                        self.push(&mut st, "error", data);
                    }
                    _ => {
                        let mut doc = st.doc.clone();
                        self.apply_proxy_usage(&mut doc);
                        let data = serde_json::to_string(&doc).unwrap_or_default();
                        self.push(&mut st, "final", data);
                    }
                }
                st.finished_at = Some(Instant::now());
                st.tx = None;
                self.done.send_replace(true);
            }
        }
    }
}

/// How an insert went.
pub enum Insert {
    /// A new run was stored.
    New(Arc<RunRecord>),
    /// The same request was seen before: this is its run.
    Existing(Arc<RunRecord>),
    /// The run id exists with a different body.
    Conflict,
    /// The idempotency key exists with a different body.
    IdempotencyMismatch,
}

/// All runs of the process.
pub struct RunStore {
    runs: DashMap<String, Arc<RunRecord>>,
    /// Idempotency-Key → (fingerprint, run id).
    idempotency: DashMap<String, (u64, String)>,
    retention: Duration,
    max_finished: usize,
}

impl RunStore {
    /// A store that keeps finished runs for `retention`, at most `max_finished` of them.
    pub fn new(retention: Duration, max_finished: usize) -> Self {
        Self { runs: DashMap::new(), idempotency: DashMap::new(), retention, max_finished }
    }

    /// Looks a run up.
    pub fn get(&self, run_id: &str) -> Option<Arc<RunRecord>> {
        self.runs.get(run_id).map(|r| r.clone())
    }

    /// Stores a new run unless the run id or idempotency key is taken. Atomic per run id.
    pub fn insert(
        &self,
        run_id: &str,
        session_key: &str,
        fingerprint: u64,
        idempotency_key: Option<&str>,
        abort_on_disconnect: bool,
    ) -> Insert {
        if let Some(key) = idempotency_key {
            if let Some(existing) = self.idempotency.get(key) {
                let (fp, id) = existing.value().clone();
                drop(existing);
                if fp != fingerprint {
                    return Insert::IdempotencyMismatch;
                }
                if let Some(r) = self.get(&id) {
                    return Insert::Existing(r);
                }
            }
        }
        let entry = self.runs.entry(run_id.to_owned());
        let record = match entry {
            dashmap::mapref::entry::Entry::Occupied(o) => {
                let r = o.get().clone();
                drop(o);
                return if r.fingerprint == fingerprint { Insert::Existing(r) } else { Insert::Conflict };
            }
            dashmap::mapref::entry::Entry::Vacant(v) => {
                let (tx, _) = broadcast::channel(CLIENT_BUFFER);
                let tx = Some(tx);
                let record = Arc::new(RunRecord {
                    run_id: run_id.to_owned(),
                    fingerprint,
                    abort_on_disconnect,
                    state: Mutex::new(RunState {
                        doc: RunDoc {
                            run_id: run_id.to_owned(),
                            session_key: session_key.to_owned(),
                            gateway_run_id: None,
                            status: "running",
                            content: String::new(),
                            error: None,
                            usage: None,
                            relay: None,
                            created_at: rfc3339(OffsetDateTime::now_utc()),
                            finished_at: None,
                        },
                        events: Vec::new(),
                        finished_at: None,
                        tx,
                    }),
                    billing: std::sync::OnceLock::new(),
                    done: tokio::sync::watch::channel(false).0,
                });
                v.insert(record.clone());
                record
            }
        };
        if let Some(key) = idempotency_key {
            self.idempotency.insert(key.to_owned(), (fingerprint, run_id.to_owned()));
        }
        Insert::New(record)
    }

    /// Forgets a run that never started (admission failed), so the caller can retry with its id.
    pub fn remove_unstarted(&self, run_id: &str, idempotency_key: Option<&str>) {
        self.runs.remove(run_id);
        if let Some(key) = idempotency_key {
            self.idempotency.remove_if(key, |_, (_, id)| id == run_id);
        }
    }

    /// Drops finished runs older than the retention time, then the oldest beyond the count bound.
    pub fn sweep(&self) -> usize {
        let now = Instant::now();
        let mut finished: Vec<(Instant, String)> = self
            .runs
            .iter()
            .filter_map(|r| r.value().lock().finished_at.map(|t| (t, r.key().clone())))
            .collect();
        finished.sort();
        let over = finished.len().saturating_sub(self.max_finished);
        let mut removed = 0;
        for (i, (t, id)) in finished.iter().enumerate() {
            if i < over || now.duration_since(*t) >= self.retention {
                self.runs.remove(id);
                removed += 1;
            }
        }
        if removed > 0 {
            self.idempotency.retain(|_, (_, id)| self.runs.contains_key(id));
        }
        removed
    }

    /// Runs without their terminal event yet (shutdown waits for them, relay included).
    pub fn unfinished(&self) -> usize {
        self.runs.iter().filter(|r| !r.value().is_finished()).count()
    }

    /// Number of stored runs.
    pub fn len(&self) -> usize {
        self.runs.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clawmux_actors::{ErrorCode, RunOutcome};

    fn store() -> RunStore {
        RunStore::new(Duration::from_secs(3600), 100)
    }

    fn new(s: &RunStore, id: &str, fp: u64, key: Option<&str>) -> Arc<RunRecord> {
        match s.insert(id, "agent:main:a:r", fp, key, true) {
            Insert::New(r) => r,
            _ => panic!("expected a new run"),
        }
    }

    #[test]
    fn run_id_reuse_and_idempotency() {
        let s = store();
        new(&s, "r1", 1, Some("k1"));
        assert!(matches!(s.insert("r1", "x", 1, None, true), Insert::Existing(_)));
        assert!(matches!(s.insert("r1", "x", 2, None, true), Insert::Conflict));
        assert!(matches!(s.insert("r2", "x", 1, Some("k1"), true), Insert::Existing(r) if r.run_id == "r1"));
        assert!(matches!(s.insert("r3", "x", 9, Some("k1"), true), Insert::IdempotencyMismatch));
    }

    #[test]
    fn events_are_numbered_and_replayed_after_last_event_id() {
        let s = store();
        let r = new(&s, "r1", 1, None);
        r.emit(RunEvent::Accepted { gateway_run_id: "g".into() });
        r.emit(RunEvent::TextDelta("a".into()));
        let (backlog, rx) = r.attach(1);
        assert_eq!(backlog.iter().map(|e| (e.id, e.name)).collect::<Vec<_>>(), [(2, "text_delta")]);
        let mut rx = rx.expect("live");
        r.emit(RunEvent::Finished(RunOutcome::ok("a".into(), None)));
        let ev = rx.try_recv().expect("live event");
        assert_eq!((ev.id, ev.name), (3, "final"));
        assert!(r.is_finished());
        let (all, rx) = r.attach(0);
        assert_eq!(all.len(), 3);
        assert!(rx.is_none(), "finished runs replay and close");
        // Nothing after the terminal event.
        r.emit(RunEvent::TextDelta("late".into()));
        assert_eq!(r.attach(0).0.len(), 3);
    }

    #[test]
    fn errors_end_with_an_error_event_and_status() {
        let s = store();
        let r = new(&s, "r1", 1, None);
        r.emit(RunEvent::Finished(RunOutcome::failed(ErrorCode::Timeout, "too slow", String::new())));
        let doc = r.doc();
        assert_eq!(doc.status, "timeout");
        assert_eq!(doc.error.as_ref().map(|e| e.code), Some("timeout"));
        let (events, _) = r.attach(0);
        assert_eq!(events[0].name, "error");
        assert!(events[0].data.contains("\"code\":\"timeout\""));
    }

    #[test]
    fn sweep_keeps_running_runs_and_bounds_finished_ones() {
        let s = RunStore::new(Duration::from_secs(3600), 2);
        for i in 0..4 {
            let r = new(&s, &format!("r{i}"), i, Some(&format!("k{i}")));
            r.emit(RunEvent::Finished(RunOutcome::ok(String::new(), None)));
        }
        new(&s, "running", 99, None);
        assert_eq!(s.sweep(), 2);
        assert!(s.get("r0").is_none() && s.get("r1").is_none());
        assert!(s.get("r3").is_some() && s.get("running").is_some());
        // The idempotency key of a swept run is forgotten with it.
        assert!(matches!(s.insert("r9", "x", 1234, Some("k0"), true), Insert::New(_)));
    }
}
