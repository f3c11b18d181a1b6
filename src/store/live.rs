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
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Instant;
use time::OffsetDateTime;
use tokio::sync::watch;

/// Events a live client may fall behind the log before it counts as too slow (it is then
/// disconnected and can re-attach with `Last-Event-ID`). Clients read the run's log itself (see
/// [`Feed`]): nothing is buffered per client or per run for them.
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
    /// Another replica owns the run now: this log takes and publishes nothing more.
    lost: bool,
    /// Other replicas' usage shares heard of before the run's billing was set (a run continued
    /// here is live, and hears of shares, a moment before it is attributable): given to the
    /// billing when it is set, else the documents and the final event would miss them until that
    /// replica wrote again.
    early_shares: HashMap<String, Usage>,
    /// When the frames behind the latest deltas arrived, by event id (the last
    /// [`CLIENT_BUFFER`]): `clawmux_frame_to_client_seconds` is observed when a live client's
    /// stream takes the delta, on whichever thread serves it.
    received: VecDeque<(u64, Instant)>,
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
    /// The id of the last visible event, and whether the run finished (set with the terminal
    /// event): live clients ([`Feed`]) wake on it, waiters that only need the end wait for it.
    /// One channel per run, whether or not anyone listens.
    visible: watch::Sender<Visible>,
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
    /// Suspends every run of this replica when the shared store is out of reach, instead of
    /// ending this one (stores shared by replicas: another replica, or this one once the store
    /// answers again, continues them).
    on_store_down: OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// `clawmux_frame_to_client_seconds`, observed when a live client takes a delta.
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
                lost: false,
                early_shares: HashMap::new(),
                received: VecDeque::new(),
            }),
            visible: watch::channel(Visible { last_id: next_id, finished }).0,
            billing: OnceLock::new(),
            on_failure: OnceLock::new(),
            on_end: OnceLock::new(),
            on_lost: OnceLock::new(),
            on_store_down: OnceLock::new(),
            latency,
            notes,
        })
    }

    fn lock(&self) -> MutexGuard<'_, LogState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Ties the run to its billing identity: its LLM calls are attributed until it ends, and the
    /// proxy's totals are stored as they change; `on_tokens` hears of every token the proxy adds
    /// (the account's budget). A billing identity that already stores its totals (a remote run
    /// adopted by a takeover) keeps its hook: it is the same one.
    pub fn set_billing(&self, billing: Arc<RunBilling>, registry: Arc<Attributions>, on_tokens: Option<Box<dyn Fn(u64) + Send + Sync>>) {
        billing.on_usage(usage_hook(self.writer.clone(), self.run_id.clone(), on_tokens));
        // Under the state lock, as `note_share` looks: no share falls between the two.
        let mut st = self.lock();
        for (replica, share) in st.early_shares.drain() {
            billing.note_share(&replica, share);
        }
        let _ = self.billing.set((billing, registry));
    }

    /// Another replica stored its share of this run's usage: the documents this process shows
    /// count it (the store's own documents sum the shares).
    pub fn note_share(&self, replica: &str, share: Usage) {
        let mut st = self.lock();
        match self.billing.get() {
            Some((b, _)) => b.note_share(replica, share),
            None => {
                // Kept until the billing is set (the most recent share of each replica, which
                // only grows; one entry per replica).
                let e = st.early_shares.entry(replica.to_owned()).or_default();
                *e = e.at_least(share);
            }
        }
    }

    /// What to do once when the run ends.
    pub fn on_end(&self, hook: Box<dyn Fn() + Send + Sync>) {
        let _ = self.on_end.set(hook);
    }

    /// What stops the run here when another replica took it over.
    pub fn on_lost(&self, hook: Box<dyn Fn() + Send + Sync>) {
        let _ = self.on_lost.set(hook);
    }

    /// What suspends this replica's runs when the shared store is out of reach (see
    /// [`Self::suspend`]); without it (a store of one process) the run ends `internal` instead.
    pub fn on_store_down(&self, hook: Box<dyn Fn() + Send + Sync>) {
        let _ = self.on_store_down.set(hook);
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
    /// `live_elsewhere`: the store said the run goes on, so its billing entry here goes on as a
    /// remote run's (its LLM streams in flight are not cut; see [`Self::let_go_of_billing`]);
    /// else it is dropped. Returns false when the run had already ended or was lost before.
    pub fn lose(&self, live_elsewhere: bool) -> bool {
        if !self.stop_here() {
            return false;
        }
        tracing::warn!(run_id = %self.run_id, "another replica took this run over (this one's lease expired); stopping it here without cancelling it");
        self.let_go_of_billing(live_elsewhere);
        true
    }

    /// The shared store is out of reach (replicas): the run stops here exactly as when it is
    /// lost (no cancel, no more writes, streams end without a terminal event), except that its
    /// billing stays registered: its gateway run goes on, and so do its LLM streams in flight,
    /// while its new calls are answered `503` (the gateway retries them) until whoever continues
    /// it once the store answers (this replica, or another that took it over) attributes it
    /// afresh (see [`Self::let_go_of_billing`]). False when it had already ended or stopped.
    pub fn suspend(&self) -> bool {
        if !self.stop_here() {
            return false;
        }
        // Its streams in flight go on, its new calls are answered 503 (see `RunBilling::suspend`).
        if let Some((b, _)) = self.billing.get() { b.suspend(); }
        tracing::warn!(run_id = %self.run_id, "the run store is out of reach: suspending this run here without cancelling it; it goes on once the store answers");
        true
    }

    /// The run's LLM calls are no longer attributed to this log. When the run goes on (a new log
    /// of it continues here after a store outage, or another replica continues it) its billing
    /// entry goes on as a remote run's, counters and streams in flight kept, until a new log's
    /// billing here adopts it or the run's end revokes it (see [`Attributions::demote`]); when it
    /// ended, or that is not known, the entry goes and its streams in flight are cut.
    pub fn let_go_of_billing(&self, run_goes_on: bool) {
        if let Some((billing, registry)) = self.billing.get() {
            match run_goes_on {
                true => registry.demote(&billing.trace_id, &billing.run_id),
                false => registry.unregister(&billing.trace_id, &billing.run_id),
            }
        }
    }

    /// What [`Self::lose`] and [`Self::suspend`] share; false when the run had already ended or
    /// stopped here.
    fn stop_here(&self) -> bool {
        {
            let mut st = self.lock();
            if st.lost || st.finished_at.is_some() {
                return false;
            }
            st.lost = true;
            st.closed = true;
        }
        if let Some(hook) = self.on_lost.get() {
            hook();
        }
        if let Some(hook) = self.on_end.get() {
            hook();
        }
        // Waiters (`?wait=true`) stop waiting here, and live feeds end (no terminal event: the
        // run's end is the new owner's).
        self.visible.send_modify(|v| v.finished = true);
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

    /// The run's usage as this process's proxy counts it (`None` before its billing is set).
    pub(crate) fn live_usage(&self) -> Option<Usage> {
        self.billing.get().map(|(b, _)| b.run_totals())
    }

    /// The billing identity of the run, once it is live here.
    pub fn billing(&self) -> Option<Arc<RunBilling>> {
        self.billing.get().map(|(b, _)| b.clone())
    }

    /// The current document (as stored; usage as the proxy counts it now).
    pub fn doc(&self) -> RunDoc {
        RunDoc::from_row(&self.lock().stored, self.live_usage())
    }

    /// Resolves once the run's terminal event is visible.
    pub async fn finished(&self) {
        let mut rx = self.visible.subscribe();
        let _ = rx.wait_for(|v| v.finished).await;
    }

    /// True once the terminal event is visible.
    pub fn is_finished(&self) -> bool {
        self.lock().finished_at.is_some()
    }

    /// True once the run's end is decided: its terminal event handed to the store (visible or
    /// not yet), or the run ended by a store failure. Its session actor may be gone already.
    pub fn is_ending(&self) -> bool {
        let st = self.lock();
        st.closed || st.finished_at.is_some()
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

    /// Stored events after `after`, and a feed of the ones that follow (taken under the same
    /// lock, so nothing is lost or repeated between the two). `None` once the run finished.
    pub fn attach(&self, after: u64) -> (Vec<Arc<StoredEvent>>, Option<Feed>) {
        let st = self.lock();
        let start = st.events.partition_point(|e| e.id <= after);
        let backlog = st.events[start..].to_vec();
        let feed = match (st.finished_at, self.me.upgrade()) {
            (None, Some(log)) => {
                let last = backlog.last().map_or(after, |e| e.id);
                Some(Feed { log, last, visible: self.visible.subscribe() })
            }
            _ => None,
        };
        (backlog, feed)
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
                            // Whether the run still goes on elsewhere is not known here: its
                            // billing entry is dropped (see `RunStore::lose`).
                            log.lose(false);
                        }
                        Ok(_) => log.stored(stored_event, patch, received),
                        Err(e) => log.fail(&e),
                    }
                }
            })),
        );
    }

    /// The store has it: apply, publish. `received`: when the gateway frame behind the event
    /// arrived (a delta's), measured when a live client takes it.
    fn stored(&self, event: Option<Arc<StoredEvent>>, patch: RunPatch, received: Option<Instant>) {
        let terminal = {
            let mut st = self.lock();
            if st.finished_at.is_some() || st.lost {
                return;
            }
            patch.apply(&mut st.stored);
            let Some(ev) = event else { return };
            if let (Some(t), Some(_)) = (received, &self.latency) {
                if st.received.len() == CLIENT_BUFFER {
                    st.received.pop_front();
                }
                st.received.push_back((ev.id, t));
            }
            st.events.push(ev.clone());
            if ev.is_terminal() {
                st.finished_at = Some(Instant::now());
                st.end_stored = true;
            }
            // Under the lock: a feed that found nothing new marked the previous value seen.
            self.visible.send_modify(|v| v.last_id = ev.id);
            ev.is_terminal()
        };
        if terminal {
            self.end();
        }
    }

    /// The store failed this run: end it with an error that says why, and cancel it. On a store
    /// shared by replicas that is out of reach, this replica's runs are suspended instead (see
    /// [`Self::suspend`]): none is ended by a database or network outage.
    fn fail(&self, e: &StoreError) {
        if self.writer.store_down() {
            if let Some(suspend_all) = self.on_store_down.get() {
                tracing::warn!(run_id = %self.run_id, error = %e, "the run store is out of reach; suspending this replica's runs");
                suspend_all();
                return;
            }
        }
        let (write, event, seq) = {
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
            let message = format!("the run store cannot record this run ({}); the run was cancelled", e.for_tenant());
            let data = serde_json::json!({"runId": self.run_id, "code": "internal", "message": message}).to_string();
            let event = StoredEvent { id, name: EventName::Error, data };
            let patch = RunPatch {
                status: Some("error".to_owned()),
                error: Some(("internal".to_owned(), message)),
                finished_at_ms: Some(now_ms()),
                ..RunPatch::default()
            };
            patch.apply(&mut st.latest);
            let usage = self.live_usage();
            let doc = || serde_json::to_string(&RunDoc::from_row(&st.latest, usage)).unwrap_or_default();
            let webhook = st.latest.webhook_url.clone().map(|url| NewDelivery { url, key_id: st.latest.key_id.clone(), body: doc() });
            (Write::Fail { run_id: self.run_id.clone(), event: event.clone(), patch, webhook }, Arc::new(event), st.latest.seq)
        };
        tracing::error!(run_id = %self.run_id, error = %e, "the run store failed a run; cancelling it");
        // Noted before any client can see the end: a restart ends the run the same way.
        if let Some(notes) = &self.notes {
            if let Err(n) = notes.note(&self.run_id, event.id, seq) {
                tracing::error!(run_id = %self.run_id, error = %n, "cannot note the end of a run the store failed; a restart before the store takes it would continue the run");
            }
        }
        {
            let mut st = self.lock();
            if let Write::Fail { patch, .. } = &write {
                patch.apply(&mut st.stored);
            }
            st.events.push(event.clone());
            st.finished_at = Some(Instant::now());
            self.visible.send_modify(|v| v.last_id = event.id);
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
        self.visible.send_modify(|v| v.finished = true);
    }
}

/// What stores a run's usage as this process's proxy counts it: its share, absolute (see
/// [`Write::Usage`]); `on_tokens` hears of every token added (the account's budget).
pub fn usage_hook(writer: Writer, run_id: String, on_tokens: Option<Box<dyn Fn(u64) + Send + Sync>>) -> Box<dyn Fn(Usage, u64) + Send + Sync> {
    Box::new(move |usage, tokens| {
        writer.submit(Write::Usage { run_id: run_id.clone(), usage }, None);
        if let Some(f) = &on_tokens {
            f(tokens);
        }
    })
}

/// What a run's live clients wake on.
#[derive(Debug, Clone, Copy)]
struct Visible {
    /// The id of the last visible event.
    last_id: u64,
    /// The terminal event is visible.
    finished: bool,
}

/// Why a [`Feed`] has no next event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedError {
    /// The client fell more than [`CLIENT_BUFFER`] events behind; this many beyond it.
    Lagged(u64),
    /// The run finished and every event was taken.
    Closed,
}

/// A live client's view of a run's log: the events after the last one it took, as they become
/// visible. It reads the log itself, so a run keeps no per-client ring and no copies of events.
pub struct Feed {
    /// The run.
    log: Arc<RunLog>,
    /// The id of the last event taken.
    last: u64,
    /// Wakes the feed when an event becomes visible or the run finishes.
    visible: watch::Receiver<Visible>,
}

impl Feed {
    /// The next visible event after the last one taken, waiting for it if needed.
    pub async fn recv(&mut self) -> Result<Arc<StoredEvent>, FeedError> {
        loop {
            {
                let st = self.log.lock();
                let next = st.events.partition_point(|e| e.id <= self.last);
                if let Some(ev) = st.events.get(next) {
                    let behind = st.events.len() - next;
                    if behind > CLIENT_BUFFER {
                        return Err(FeedError::Lagged((behind - CLIENT_BUFFER) as u64));
                    }
                    self.last = ev.id;
                    if let Some(h) = &self.log.latency {
                        if let Some((_, t)) = st.received.iter().rev().find(|(id, _)| *id == ev.id) {
                            h.observe(t.elapsed().as_secs_f64());
                        }
                    }
                    return Ok(ev.clone());
                }
                if st.finished_at.is_some() || st.lost {
                    return Err(FeedError::Closed);
                }
                // Under the lock, so an event made visible after this look wakes the wait below.
                self.visible.borrow_and_update();
            }
            if self.visible.changed().await.is_err() {
                return Err(FeedError::Closed);
            }
        }
    }
}

/// Writes a store failure's end, again and again (backing off) until the store has it.
fn store_end(log: Weak<RunLog>, writer: Writer, write: Write, delay: std::time::Duration) {
    let again = (writer.clone(), write.clone());
    writer.submit(
        write,
        Some(Box::new(move |result: Result<Applied, StoreError>| match result {
            // Another replica took the run over (this one's lease had expired): its end is that
            // replica's to store. This log is lost like any taken-over run's: not renewed, not
            // read (the run's reads go to the store, not to the `internal` end this replica made),
            // and dropped at the next sweep.
            Ok(Applied::Fenced) => {
                if let Some(log) = log.upgrade() {
                    {
                        let mut st = log.lock();
                        st.end_stored = true;
                        st.lost = true;
                        st.closed = true;
                    }
                    tracing::warn!(run_id = %log.run_id, "a run this replica had failed was taken over by another replica before its end was stored; that replica ends it");
                }
            }
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
                let data = super::event_data::text_delta(&text);
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
                    content: Some(super::storable_text(&outcome.content)),
                    error: outcome.error.as_ref().map(|e| (e.code.as_str().to_owned(), super::storable_text(&e.message))),
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
        let data = super::event_data::text_delta(&text);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Insert, Retention, RunStore, StoreUrl};
    use clawmux_actors::RunOutcome;
    use std::time::Duration;

    /// Generous: the writer commits in the background, on a loaded machine.
    const WAIT: Duration = Duration::from_secs(20);

    /// A tenant is told why its run's store failed in the storage engine's words, never where the
    /// store is (a file path, a database server).
    #[test]
    fn a_tenant_is_told_why_the_store_failed_never_where_it_is() {
        let full = StoreError("the run store /srv/operator-secret/runs.db: database or disk is full".to_owned());
        assert_eq!(full.for_tenant(), "database or disk is full");
        let pg = StoreError("the run store postgres://clawmux@db.internal:5432/runs: error returned from database: relation \"x\" does not exist".to_owned());
        assert_eq!(pg.for_tenant(), "a storage error");
    }

    async fn live_run(run_id: &str) -> (Arc<RunStore>, Arc<RunLog>) {
        let metrics = super::super::writer::StoreMetrics::new(&prometheus::Registry::new()).expect("metrics");
        let store = RunStore::open(&StoreUrl::Memory, Retention { max_age_ms: 3_600_000, max_count: 100 }, metrics, None)
            .await
            .expect("memory store");
        let row = super::super::backend_tests::row(run_id, "acct", now_ms());
        let Ok(Insert::New(log)) = store.insert(row).await else { panic!("not inserted") };
        (store, log)
    }

    /// Waits (bounded) until the log shows `n` events.
    async fn visible(log: &RunLog, n: usize) {
        tokio::time::timeout(WAIT, async {
            while log.attach(0).0.len() < n {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the events became visible");
    }

    #[actix_rt::test]
    async fn a_feed_brings_every_later_event_in_order_then_closes() {
        let (_store, log) = live_run("r-feed").await;
        let (backlog, feed) = log.attach(0);
        assert!(backlog.is_empty());
        let mut feed = feed.expect("live");
        // Waiting before anything is visible: the wake-up must not be lost.
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            loop {
                match tokio::time::timeout(WAIT, feed.recv()).await.expect("not stuck") {
                    Ok(ev) => got.push((ev.id, ev.name)),
                    Err(e) => return (got, e),
                }
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        log.text_delta("a".into(), Instant::now());
        log.text_delta("b".into(), Instant::now());
        log.emit(RunEvent::Finished(RunOutcome::ok("ab".into(), None)));
        let (got, end) = tokio::time::timeout(WAIT, reader).await.expect("reader ends").expect("reader");
        assert_eq!(got, [(1, EventName::TextDelta), (2, EventName::TextDelta), (3, EventName::Final)]);
        assert_eq!(end, FeedError::Closed);
        // Attached after the end: the log, and no feed.
        let (backlog, feed) = log.attach(1);
        assert_eq!(backlog.iter().map(|e| e.id).collect::<Vec<_>>(), [2, 3]);
        assert!(feed.is_none());
    }

    /// A run's end is decided the moment its actor hands the terminal event over, before the store
    /// has it: an abort then must say the run had finished (its actor is gone), not wait, not
    /// `503` (schemathesis' stateful run found a `503` there).
    #[actix_rt::test]
    async fn a_run_is_ending_from_the_moment_its_end_is_handed_over() {
        let (_store, log) = live_run("r-ending").await;
        log.text_delta("a".into(), Instant::now());
        assert!(!log.is_ending());
        log.emit(RunEvent::Finished(RunOutcome::ok("a".into(), None)));
        assert!(log.is_ending(), "ending before the store has the end");
        tokio::time::timeout(WAIT, async {
            while !log.is_finished() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("finished");
        assert!(log.is_ending());
    }

    /// The end of a run this replica failed, fenced by the writer because another replica took the
    /// run over, leaves the log lost: not held (renewed) here, and not read (the run's reads go to
    /// the store, not to the `internal` end this replica made).
    #[actix_rt::test]
    async fn a_failed_runs_end_fenced_by_a_takeover_leaves_its_log_lost() {
        let (store, log) = live_run("r-fenced").await;
        assert!(store.live("r-fenced").is_some());
        log.writer.hold("r-fenced");
        let end = StoredEvent { id: 1, name: EventName::Error, data: "{}".to_owned() };
        let fail = Write::Fail { run_id: "r-fenced".to_owned(), event: end, patch: RunPatch::default(), webhook: None };
        store_end(log.me.clone(), log.writer.clone(), fail, END_RETRY.0);
        tokio::time::timeout(WAIT, async {
            while !log.is_lost() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the log is lost");
        assert!(log.end_stored(), "not held by this replica any more");
        assert!(store.live("r-fenced").is_none(), "its reads go to the store");
    }

    #[actix_rt::test]
    async fn a_feed_starts_after_the_backlog_it_came_with() {
        let (_store, log) = live_run("r-backlog").await;
        log.text_delta("a".into(), Instant::now());
        log.text_delta("b".into(), Instant::now());
        visible(&log, 2).await;
        let (backlog, feed) = log.attach(0);
        assert_eq!(backlog.len(), 2);
        let mut feed = feed.expect("live");
        log.text_delta("c".into(), Instant::now());
        let ev = tokio::time::timeout(WAIT, feed.recv()).await.expect("not stuck").expect("an event");
        assert_eq!((ev.id, ev.data.as_str()), (3, r#"{"text":"c"}"#));
    }

    #[actix_rt::test]
    async fn a_client_more_than_the_buffer_behind_is_too_slow() {
        let (_store, log) = live_run("r-slow").await;
        let (_, slow) = log.attach(0);
        let (_, keeping_up) = log.attach(0);
        let (mut slow, mut keeping_up) = (slow.expect("live"), keeping_up.expect("live"));
        for i in 0..CLIENT_BUFFER {
            log.text_delta(format!("{i} "), Instant::now());
        }
        visible(&log, CLIENT_BUFFER).await;
        // Exactly the buffer behind: still served.
        let first = keeping_up.recv().await.expect("within the buffer");
        assert_eq!(first.id, 1);
        log.text_delta("one more".into(), Instant::now());
        visible(&log, CLIENT_BUFFER + 1).await;
        assert_eq!(slow.recv().await.map(|e| e.id), Err(FeedError::Lagged(1)));
        // The other one is CLIENT_BUFFER behind again, not more.
        assert_eq!(keeping_up.recv().await.map(|e| e.id), Ok(2));
    }
}
