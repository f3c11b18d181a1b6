//! A live run's log: what its session actor emits, on its way through the store to its clients.
//!
//! ```text
//! session actor ──emit──▶ RunLog::submit ──Write──▶ group commit ──stored──▶ visible: the log, the
//!                         (ids assigned,                                      broadcast to SSE
//!                          data serialized once)                              clients, the document
//! ```
//! An event becomes visible only once the store has it. If the store cannot take a run's writes,
//! the run ends with an `internal` error that says why, right after the last event its clients saw
//! (shown at once: they must not hang), and its session actor is cancelled, so the gateway run
//! stops too. That end is written to the store as soon as it takes writes again (retried in the
//! background), and noted outside the store first ([`super::notes`]) so that a restart before then
//! ends the run the same way instead of continuing it: no client sees two different ends.

use super::notes::EndNotes;
use super::writer::Writer;
use super::{now_ms, Applied, CheckpointRecord, EventName, NewDelivery, RunPatch, RunRow, StoreError, StoredEvent, Write};
use crate::attribution::{Attributions, RunBilling, Usage};
use clawmux_actors::{Checkpoint, RunEvent, RunSink, RunStatus};
use serde::Serialize;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Instant;
use time::OffsetDateTime;
use tokio::sync::broadcast;

/// Events buffered per live client before it counts as too slow (it is then disconnected and can
/// re-attach with `Last-Event-ID`). The ring exists only while a client is attached.
pub const CLIENT_BUFFER: usize = 256;

/// `usage` of the run document.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct DocUsage {
    /// Input tokens.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// LLM calls.
    pub llm_calls: u64,
    /// `proxy` (billing truth) or `gateway` (OpenClaw's own numbers, a hint).
    #[schema(value_type = String, pattern = "^(proxy|gateway)$")]
    pub source: &'static str,
    /// OpenClaw's own numbers when `source` is `proxy` (kept as a hint, never billed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gateway_hint: Option<GatewayHint>,
}

/// OpenClaw's own token counts.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct GatewayHint {
    /// Input tokens.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
}

/// `error` of the run document.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
pub struct DocError {
    /// Code.
    pub code: String,
    /// Message.
    pub message: String,
}

/// The run document of the contract.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunDoc {
    /// API run id.
    pub run_id: String,
    /// Canonical session key.
    pub session_key: String,
    /// Gateway run id (null until accepted).
    pub gateway_run_id: Option<String>,
    /// Who pays (operators filter and group runs by it; the runs page shows it).
    pub billing_account_id: String,
    /// The gateway agent that runs it.
    pub agent_id: String,
    /// The model override the request asked for (null: the agent's default).
    pub model: Option<String>,
    /// The conversation key (null: a one-off run).
    pub state_key: Option<String>,
    /// `sandbox/<branchKey>` for a branch run (null: no branch), known from admission on, before
    /// the relay's result.
    pub branch: Option<String>,
    /// `queued`, `running`, `ok`, `error`, `aborted`, `timeout`.
    #[schema(pattern = "^(queued|running|ok|error|aborted|timeout)$")]
    pub status: String,
    /// Final text.
    pub content: String,
    /// Why it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<DocError>,
    /// Token usage.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<DocUsage>,
    /// Git relay result: `{"branch","commitCount","pushed","pushedCommits","remoteHead"?,
    /// "prUrl"?,"prNumber"?,"error"?}` (docs/API.md).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub relay: Option<serde_json::Value>,
    /// RFC 3339.
    #[schema(format = DateTime)]
    pub created_at: String,
    /// RFC 3339 or null.
    #[schema(format = DateTime)]
    pub finished_at: Option<String>,
}

fn rfc3339_ms(ms: i64) -> String {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .ok()
        .and_then(|t| t.format(&time::format_description::well_known::Rfc3339).ok())
        .unwrap_or_default()
}

impl RunDoc {
    /// The document of a stored run; `live_usage` (the proxy's current totals) wins over the
    /// stored ones.
    pub fn from_row(row: &RunRow, live_usage: Option<Usage>) -> Self {
        let proxy = live_usage.or(row.usage);
        let gateway = |(i, o): (u64, u64)| DocUsage { input_tokens: i, output_tokens: o, llm_calls: 0, source: "gateway", gateway_hint: None };
        let usage = match (proxy, row.gateway_usage) {
            // No LLM call went through the proxy (it was not in the path): OpenClaw's numbers.
            (Some(u), Some(hint)) if u.llm_calls == 0 => Some(gateway(hint)),
            // The proxy's records are the truth; OpenClaw's own numbers stay as a hint.
            (Some(u), hint) => Some(DocUsage {
                input_tokens: u.input_tokens,
                output_tokens: u.output_tokens,
                llm_calls: u.llm_calls,
                source: "proxy",
                gateway_hint: hint.map(|(i, o)| GatewayHint { input_tokens: i, output_tokens: o }),
            }),
            (None, Some(hint)) => Some(gateway(hint)),
            (None, None) => None,
        };
        Self {
            run_id: row.run_id.clone(),
            session_key: row.session_key.clone(),
            gateway_run_id: row.gateway_run_id.clone(),
            billing_account_id: row.billing_account_id.clone(),
            agent_id: row.spec.agent_id.clone(),
            model: row.spec.model.clone(),
            state_key: row.state_key.clone(),
            branch: row.spec.branch.as_ref().map(|b| b.branch()),
            status: row.status.clone(),
            content: row.content.clone(),
            error: row.error.as_ref().map(|(code, message)| DocError { code: code.clone(), message: message.clone() }),
            usage,
            relay: row.relay.clone(),
            created_at: rfc3339_ms(row.created_at_ms),
            finished_at: row.finished_at_ms.map(rfc3339_ms),
        }
    }
}

struct LogState {
    /// The row as stored (what documents show).
    stored: RunRow,
    /// The row with every submitted change applied (what the next event's data is built from).
    latest: RunRow,
    /// Stored events, in order: what clients see.
    events: Vec<Arc<StoredEvent>>,
    /// The id of the last event submitted.
    next_id: u64,
    /// A terminal event was submitted, or the store failed: nothing more is taken.
    closed: bool,
    /// When the terminal event became visible.
    finished_at: Option<Instant>,
    /// The store has the terminal event (a store failure's end may become visible first).
    end_stored: bool,
    /// Live clients; created by the first one, dropped with the terminal event.
    tx: Option<broadcast::Sender<Arc<StoredEvent>>>,
    /// Another replica owns the run now: this log takes and publishes nothing more.
    lost: bool,
}

/// A live run's log (the session actor's [`RunSink`]).
pub struct RunLog {
    me: Weak<RunLog>,
    writer: Writer,
    /// API run id.
    pub run_id: String,
    /// Fingerprint of the request body (idempotency and run-id reuse).
    pub fingerprint: String,
    /// Whether a vanished caller cancels the run.
    pub abort_on_disconnect: bool,
    state: Mutex<LogState>,
    /// Flips to true with the terminal event (waiters that only need the end use this, so a
    /// lagging broadcast receiver can never make them miss it).
    done: tokio::sync::watch::Sender<bool>,
    /// The run's billing identity and the registry it is live in (with the LLM proxy): it stops
    /// being attributable with its terminal event.
    billing: OnceLock<(Arc<RunBilling>, Arc<Attributions>)>,
    /// Cancels the run's session actor when the store fails it.
    on_failure: OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// Told once when the run ends (its account's live-run count).
    on_end: OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// Stops the run's session actor WITHOUT cancelling its gateway run when another replica
    /// took the run over (it continues the gateway run).
    on_lost: OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// `clawmux_frame_to_client_seconds`, observed when a delta becomes visible.
    latency: Option<prometheus::Histogram>,
    /// Where an end the store cannot take is noted (durable stores only).
    notes: Option<Arc<EndNotes>>,
}

/// How long a store failure's end waits before it is written again: the first retry, the last.
const END_RETRY: (std::time::Duration, std::time::Duration) = (std::time::Duration::from_secs(1), std::time::Duration::from_secs(30));

impl RunLog {
    /// The log of a stored run, with its stored events (none for a new run).
    pub fn new(
        row: RunRow,
        events: Vec<StoredEvent>,
        writer: Writer,
        latency: Option<prometheus::Histogram>,
        notes: Option<Arc<EndNotes>>,
    ) -> Arc<Self> {
        let next_id = events.last().map_or(row.last_event_id, |e| e.id.max(row.last_event_id));
        let finished = row.finished_at_ms.is_some();
        Arc::new_cyclic(|me| RunLog {
            me: me.clone(),
            writer,
            run_id: row.run_id.clone(),
            fingerprint: row.fingerprint.clone(),
            abort_on_disconnect: row.spec.abort_on_disconnect,
            state: Mutex::new(LogState {
                latest: row.clone(),
                stored: row,
                events: events.into_iter().map(Arc::new).collect(),
                next_id,
                closed: finished,
                finished_at: finished.then(Instant::now),
                end_stored: finished,
                tx: None,
                lost: false,
            }),
            done: tokio::sync::watch::channel(finished).0,
            billing: OnceLock::new(),
            on_failure: OnceLock::new(),
            on_end: OnceLock::new(),
            on_lost: OnceLock::new(),
            latency,
            notes,
        })
    }

    fn lock(&self) -> MutexGuard<'_, LogState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Ties the run to its billing identity: its LLM calls are attributed until it ends, and the
    /// proxy's totals are stored as they change; `on_tokens` hears of every token the proxy adds
    /// (the account's budget).
    pub fn set_billing(&self, billing: Arc<RunBilling>, registry: Arc<Attributions>, on_tokens: Option<Box<dyn Fn(u64) + Send + Sync>>) {
        let writer = self.writer.clone();
        let run_id = self.run_id.clone();
        billing.on_usage(Box::new(move |usage, tokens| {
            let patch = RunPatch { usage: Some(usage), ..RunPatch::default() };
            writer.submit(Write::Append { run_id: run_id.clone(), event: None, patch, webhook: None }, None);
            if let Some(f) = &on_tokens {
                f(tokens);
            }
        }));
        let _ = self.billing.set((billing, registry));
    }

    /// What to do once when the run ends.
    pub fn on_end(&self, hook: Box<dyn Fn() + Send + Sync>) {
        let _ = self.on_end.set(hook);
    }

    /// What stops the run here when another replica took it over.
    pub fn on_lost(&self, hook: Box<dyn Fn() + Send + Sync>) {
        let _ = self.on_lost.set(hook);
    }

    /// True once another replica owns the run ([`Self::lose`]).
    pub fn is_lost(&self) -> bool {
        self.lock().lost
    }

    /// Another replica owns the run now (it took the run over: this replica's lease expired):
    /// nothing more is written or published for it here, its SSE clients' streams end without a
    /// terminal event (they re-attach, as after a handoff, and any replica serves the rest), it
    /// stops counting for its account here and its LLM calls are no longer attributed here, and
    /// its session actor stops WITHOUT cancelling the gateway run (the new owner continues it).
    /// Returns false when the run had already ended or was lost before.
    pub fn lose(&self) -> bool {
        {
            let mut st = self.lock();
            if st.lost || st.finished_at.is_some() {
                return false;
            }
            st.lost = true;
            st.closed = true;
            st.tx = None;
        }
        tracing::warn!(run_id = %self.run_id, "another replica took this run over (this one's lease expired); stopping it here without cancelling it");
        if let Some(hook) = self.on_lost.get() {
            hook();
        }
        if let Some(hook) = self.on_end.get() {
            hook();
        }
        if let Some((billing, registry)) = self.billing.get() {
            registry.unregister(&billing.trace_id, &billing.run_id);
        }
        // Waiters (`?wait=true`) stop waiting here; the run's end is the new owner's.
        self.done.send_replace(true);
        true
    }

    /// The billing account.
    pub fn billing_account_id(&self) -> String {
        self.lock().stored.billing_account_id.clone()
    }

    /// What cancels the run when the store cannot take its writes.
    pub fn on_failure(&self, hook: Box<dyn Fn() + Send + Sync>) {
        let _ = self.on_failure.set(hook);
    }

    /// The proxy's totals as stored (a resumed run's billing continues from them).
    pub fn stored_usage(&self) -> Option<Usage> {
        self.lock().stored.usage
    }

    fn live_usage(&self) -> Option<Usage> {
        self.billing.get().map(|(b, _)| b.totals())
    }

    /// The current document (as stored; usage as the proxy counts it now).
    pub fn doc(&self) -> RunDoc {
        RunDoc::from_row(&self.lock().stored, self.live_usage())
    }

    /// Resolves once the run's terminal event is visible.
    pub async fn finished(&self) {
        let mut rx = self.done.subscribe();
        let _ = rx.wait_for(|d| *d).await;
    }

    /// True once the terminal event is visible.
    pub fn is_finished(&self) -> bool {
        self.lock().finished_at.is_some()
    }

    /// How long ago the run finished (the store's cache forgets finished runs after a while).
    pub fn finished_for(&self) -> Option<std::time::Duration> {
        self.lock().finished_at.map(|t| t.elapsed())
    }

    /// True once the store has the run's terminal event (until then this log is the only place
    /// that knows how the run ended).
    pub fn end_stored(&self) -> bool {
        self.lock().end_stored
    }

    /// Stored events after `after`, and a receiver for the ones that follow (taken under the same
    /// lock, so nothing is lost or repeated between the two). `None` once the run finished.
    pub fn attach(&self, after: u64) -> (Vec<Arc<StoredEvent>>, Option<broadcast::Receiver<Arc<StoredEvent>>>) {
        let mut st = self.lock();
        let start = st.events.partition_point(|e| e.id <= after);
        let backlog = st.events[start..].to_vec();
        let rx = if st.finished_at.is_some() {
            None
        } else {
            Some(st.tx.get_or_insert_with(|| broadcast::channel(CLIENT_BUFFER).0).subscribe())
        };
        (backlog, rx)
    }

    /// The text delivered so far (the `text_delta` events, concatenated).
    pub fn emitted_text(&self) -> String {
        let st = self.lock();
        st.events
            .iter()
            .filter(|e| e.name == EventName::TextDelta)
            .filter_map(|e| serde_json::from_str::<serde_json::Value>(&e.data).ok())
            .filter_map(|v| v.get("text").and_then(|t| t.as_str()).map(str::to_owned))
            .collect()
    }

    /// True when an `accepted` event is stored.
    pub fn was_accepted(&self) -> bool {
        self.lock().events.iter().any(|e| e.name == EventName::Accepted)
    }

    /// Queues an event and/or row changes for the store; `received` is when the gateway frame
    /// behind it arrived (measured once it is visible).
    fn submit(&self, event: Option<(EventName, String)>, patch: RunPatch) {
        self.submit_received(event, patch, None, None);
    }

    fn submit_received(&self, event: Option<(EventName, String)>, patch: RunPatch, received: Option<Instant>, webhook: Option<NewDelivery>) {
        let write;
        let stored_event;
        {
            let mut st = self.lock();
            if st.closed {
                return;
            }
            let event = event.map(|(name, data)| {
                st.next_id += 1;
                StoredEvent { id: st.next_id, name, data }
            });
            if event.as_ref().is_some_and(StoredEvent::is_terminal) {
                st.closed = true;
            }
            patch.apply(&mut st.latest);
            stored_event = event.clone().map(Arc::new);
            write = Write::Append { run_id: self.run_id.clone(), event, patch: patch.clone(), webhook };
        }
        let me = self.me.clone();
        self.writer.submit(
            write,
            Some(Box::new(move |result: Result<Applied, StoreError>| {
                if let Some(log) = me.upgrade() {
                    match result {
                        Ok(Applied::Fenced) => {
                            log.lose();
                        }
                        Ok(_) => {
                            log.stored(stored_event, patch);
                            if let (Some(h), Some(t)) = (&log.latency, received) {
                                h.observe(t.elapsed().as_secs_f64());
                            }
                        }
                        Err(e) => log.fail(&e),
                    }
                }
            })),
        );
    }

    /// The store has it: apply, publish.
    fn stored(&self, event: Option<Arc<StoredEvent>>, patch: RunPatch) {
        let terminal = {
            let mut st = self.lock();
            if st.finished_at.is_some() || st.lost {
                return;
            }
            patch.apply(&mut st.stored);
            let Some(ev) = event else { return };
            st.events.push(ev.clone());
            if let Some(tx) = &st.tx {
                // No receivers is fine: the event is in the log for re-attachment.
                let _ = tx.send(ev.clone());
            }
            if ev.is_terminal() {
                st.finished_at = Some(Instant::now());
                st.end_stored = true;
                st.tx = None;
            }
            ev.is_terminal()
        };
        if terminal {
            self.end();
        }
    }

    /// The store failed this run: end it with an error that says why, and cancel it.
    fn fail(&self, e: &StoreError) {
        let (write, event) = {
            let mut st = self.lock();
            // A lost run's end is its new owner's: ending it here would write over its events.
            if st.finished_at.is_some() || st.lost {
                return;
            }
            st.closed = true;
            // Clients have seen exactly the stored events: the end follows the last of them (the
            // store drops whatever else of the run it takes meanwhile, see `Write::Fail`).
            let id = st.events.last().map_or(st.stored.last_event_id, |e| e.id.max(st.stored.last_event_id)) + 1;
            st.next_id = id;
            let message = format!("the run store cannot record this run ({e}); the run was cancelled");
            let data = serde_json::json!({"runId": self.run_id, "code": "internal", "message": message}).to_string();
            let event = StoredEvent { id, name: EventName::Error, data };
            let patch = RunPatch {
                status: Some("error".to_owned()),
                error: Some(("internal".to_owned(), message)),
                finished_at_ms: Some(now_ms()),
                ..RunPatch::default()
            };
            patch.apply(&mut st.latest);
            let usage = self.billing.get().map(|(b, _)| b.totals());
            let doc = || serde_json::to_string(&RunDoc::from_row(&st.latest, usage)).unwrap_or_default();
            let webhook = st.latest.webhook_url.clone().map(|url| NewDelivery { url, key_id: st.latest.key_id.clone(), body: doc() });
            (Write::Fail { run_id: self.run_id.clone(), event: event.clone(), patch, webhook }, Arc::new(event))
        };
        tracing::error!(run_id = %self.run_id, error = %e, "the run store failed a run; cancelling it");
        // Noted before any client can see the end: a restart ends the run the same way.
        if let Some(notes) = &self.notes {
            if let Err(n) = notes.note(&self.run_id, event.id) {
                tracing::error!(run_id = %self.run_id, error = %n, "cannot note the end of a run the store failed; a restart before the store takes it would continue the run");
            }
        }
        {
            let mut st = self.lock();
            if let Write::Fail { patch, .. } = &write {
                patch.apply(&mut st.stored);
            }
            st.events.push(event.clone());
            if let Some(tx) = &st.tx {
                let _ = tx.send(event);
            }
            st.finished_at = Some(Instant::now());
            st.tx = None;
        }
        store_end(self.me.clone(), self.writer.clone(), write, END_RETRY.0);
        if let Some(hook) = self.on_failure.get() {
            hook();
        }
        self.end();
    }

    fn end(&self) {
        if let Some(hook) = self.on_end.get() {
            hook();
        }
        if let Some((billing, registry)) = self.billing.get() {
            // LLM calls after the end belong to no run and are refused (fail-closed).
            registry.unregister(&billing.trace_id, &billing.run_id);
        }
        self.done.send_replace(true);
    }
}

/// Writes a store failure's end, again and again (backing off) until the store has it.
fn store_end(log: Weak<RunLog>, writer: Writer, write: Write, delay: std::time::Duration) {
    let again = (writer.clone(), write.clone());
    writer.submit(
        write,
        Some(Box::new(move |result: Result<Applied, StoreError>| match result {
            Ok(_) => {
                if let Some(log) = log.upgrade() {
                    log.lock().end_stored = true;
                    tracing::info!(run_id = %log.run_id, "the run store recorded the end of a run it had failed");
                }
            }
            Err(e) => {
                // Completions run on the writer's runtime; without one (it stopped) nothing could
                // store it anyway, and the note still ends the run at the next start.
                let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
                if delay == END_RETRY.0 {
                    tracing::warn!(error = %e, "the run store cannot record the end of a run yet; retrying until it can");
                }
                let (writer, write) = again;
                rt.spawn(async move {
                    tokio::time::sleep(delay).await;
                    store_end(log, writer, write, (delay * 2).min(END_RETRY.1));
                });
            }
        })),
    );
}

fn status_of(s: RunStatus) -> &'static str {
    s.as_str()
}

impl RunSink for RunLog {
    fn emit(&self, event: RunEvent) {
        match event {
            RunEvent::Accepted { gateway_run_id } => {
                let data = {
                    let st = self.lock();
                    serde_json::json!({"runId": self.run_id, "sessionKey": st.latest.session_key, "gatewayRunId": gateway_run_id})
                };
                let patch = RunPatch { gateway_run_id: Some(gateway_run_id), ..RunPatch::default() };
                self.submit(Some((EventName::Accepted, data.to_string())), patch);
            }
            RunEvent::Status { phase, tool } => {
                let data = match tool {
                    Some(t) => serde_json::json!({"phase": phase.as_str(), "tool": t}),
                    None => serde_json::json!({"phase": phase.as_str()}),
                };
                self.submit(Some((EventName::Status, data.to_string())), RunPatch::default());
            }
            RunEvent::WaitingForBranch { branch } => {
                let data = serde_json::json!({"phase": "waiting_for_branch", "branch": branch});
                self.submit(Some((EventName::Status, data.to_string())), RunPatch::default());
            }
            RunEvent::TextDelta(text) => {
                let data = serde_json::json!({ "text": text }).to_string();
                self.submit(Some((EventName::TextDelta, data)), RunPatch::default());
            }
            RunEvent::Relay(relay) => {
                let data = relay.to_string();
                self.submit(Some((EventName::Relay, data)), RunPatch { relay: Some(relay), ..RunPatch::default() });
            }
            RunEvent::Finished(outcome) => {
                let usage = self.live_usage();
                let patch = RunPatch {
                    status: Some(status_of(outcome.status).to_owned()),
                    content: Some(outcome.content.clone()),
                    error: outcome.error.as_ref().map(|e| (e.code.as_str().to_owned(), e.message.clone())),
                    gateway_usage: outcome.gateway_usage,
                    usage,
                    finished_at_ms: Some(now_ms()),
                    ..RunPatch::default()
                };
                let mut row = self.lock().latest.clone();
                patch.apply(&mut row);
                let doc = serde_json::to_string(&RunDoc::from_row(&row, usage)).unwrap_or_default();
                // Stored with the terminal event, in one transaction: delivered at least once.
                let webhook = row.webhook_url.clone().map(|url| NewDelivery { url, key_id: row.key_id.clone(), body: doc.clone() });
                let event = match (&outcome.error, outcome.status) {
                    (Some(e), s) if s != RunStatus::Ok => {
                        let data = serde_json::json!({"runId": self.run_id, "code": e.code.as_str(), "message": e.message});
                        (EventName::Error, data.to_string())
                    }
                    _ => (EventName::Final, doc),
                };
                self.submit_received(Some(event), patch, None, webhook);
            }
        }
    }

    fn text_delta(&self, text: String, received: Instant) {
        let data = serde_json::json!({ "text": text }).to_string();
        self.submit_received(Some((EventName::TextDelta, data)), RunPatch::default(), Some(received), None);
    }

    fn checkpoint(&self, checkpoint: Checkpoint) {
        let (status, checkpoint) = match checkpoint {
            Checkpoint::Running => (Some("running".to_owned()), CheckpointRecord::Running),
            Checkpoint::Preparing => (None, CheckpointRecord::Preparing),
            Checkpoint::Sending { boot_id } => (None, CheckpointRecord::Sending { boot_id }),
            Checkpoint::Publishing { content, gateway_usage } => (None, CheckpointRecord::Publishing { content, gateway_usage }),
        };
        self.submit(None, RunPatch { status, checkpoint: Some(checkpoint), ..RunPatch::default() });
    }
}
