//! The run store: every run's document, its SSE events, idempotency keys, and what a restarted
//! clawmux needs to continue it.
//!
//! # Layout
//! - this module: the rows and writes ([`RunRow`], [`Write`], [`RunPatch`]) and the one trait every
//!   backend implements ([`Store`]), selected by `CLAWMUX_STORE_URL` ([`StoreUrl`]).
//! - [`sqlite`]: the default backend (WAL, one writer connection, migrations in
//!   `migrations/sqlite/`); [`memory`]: `memory:` (nothing survives a restart); [`postgres`]:
//!   `postgres://…`, shared by replicas (migrations in `migrations/postgres/`); [`pg_shares`]: what
//!   lets any replica's LLM proxy forward a run's calls (lookups, usage shares, notifications).
//! - [`writer`]: the group commit: every write goes through one task that applies what has queued
//!   up in one transaction, then tells each writer it is stored.
//! - [`notes`]: the ends of runs the store could not record (a full disk), noted outside it so
//!   the next start does not continue a run whose end a client has seen.
//! - [`live`]: a live run's log in memory ([`live::RunLog`], the session actor's [`RunSink`]):
//!   events become visible to SSE clients only once the store has them.
//! - [`follow`]: SSE clients of a run live on another replica (PostgreSQL `LISTEN`/`NOTIFY`).
//! - [`runs`]: the facade the HTTP layer and the restart path use ([`runs::RunStore`]).
//! - [`query`]: `GET /v1/runs` filters and cursors, parsed and validated (pure).
//!
//! Invariant: an event reaches a client only after the store has it, so a client that saw event N
//! can always continue at N+1 after any crash.
//!
//! [`RunSink`]: clawmux_actors::RunSink

mod columns;
pub mod event_data;
pub mod follow;
pub mod live;
pub mod memory;
pub mod notes;
mod pg_limits;
pub mod pg_shares;
pub mod postgres;
pub mod query;
pub mod runs;
pub mod sqlite;
mod sqlite_events;
#[cfg(test)]
mod sqlite_events_tests;
pub mod tenants;
pub mod writer;
#[cfg(test)]
pub(crate) mod backend_tests;
#[cfg(test)]
mod lease_tests;
#[cfg(test)]
mod remote_run_tests;

pub use live::{RunDoc, RunLog};
pub use runs::{Insert, RunStore, RunView};

use crate::attribution::Usage;
use crate::config::Secret;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::PathBuf;

/// The name of an SSE event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, utoipa::ToSchema)]
#[schema(rename_all = "snake_case")]
pub enum EventName {
    /// The gateway acknowledged the run.
    Accepted,
    /// Progress.
    Status,
    /// Incremental text.
    TextDelta,
    /// The git relay's result.
    Relay,
    /// Terminal: the run document.
    Final,
    /// Terminal: the run's error.
    Error,
}

impl EventName {
    /// The SSE `event:` name.
    pub fn as_str(self) -> &'static str {
        match self {
            EventName::Accepted => "accepted",
            EventName::Status => "status",
            EventName::TextDelta => "text_delta",
            EventName::Relay => "relay",
            EventName::Final => "final",
            EventName::Error => "error",
        }
    }

    /// Parses a stored name (`None` for anything clawmux never writes).
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "accepted" => EventName::Accepted,
            "status" => EventName::Status,
            "text_delta" => EventName::TextDelta,
            "relay" => EventName::Relay,
            "final" => EventName::Final,
            "error" => EventName::Error,
            _ => return None,
        })
    }

    /// `final` and `error` end a run's stream.
    pub fn is_terminal(self) -> bool {
        matches!(self, EventName::Final | EventName::Error)
    }
}

/// One SSE event, serialized once and shared by every client.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredEvent {
    /// Per-run sequence number, from 1.
    pub id: u64,
    /// Event name.
    pub name: EventName,
    /// JSON data.
    pub data: String,
}

/// An event as a store holds it, its kind not checked yet: stored contents are input too (a
/// damaged row, or a kind of event a newer version wrote during a rolling upgrade). Reads that
/// must go on past one such event (continuing runs after a restart) decode them one run at a
/// time with [`decode_events`].
#[derive(Debug, Clone, PartialEq)]
pub struct RawEvent {
    /// As stored (a negative one is read as 0).
    pub id: i64,
    /// As stored.
    pub name: String,
    /// JSON data.
    pub data: String,
}

/// The error a run is ended with when its stored row cannot be read (damaged contents): taken
/// up by a restart or a takeover, it can be neither continued nor shown, and left unfinished it
/// would hold its session key (and branch key) for good, every later run of them waiting behind it.
pub const UNREADABLE_RUN: &str = "the run store holds this run in a form clawmux cannot read (damaged contents); it could not be continued and was ended";

/// A stored event this version cannot read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("holds an event of unknown kind {name:?} (event {id} of run {run_id:?})")]
pub struct Unreadable {
    /// Its run.
    pub run_id: String,
    /// Its id as stored.
    pub id: i64,
    /// Its kind as stored.
    pub name: String,
}

/// A run's stored events, checked: the first one of a kind clawmux does not write is an error.
pub fn decode_events(run_id: &str, raw: Vec<RawEvent>) -> Result<Vec<StoredEvent>, Unreadable> {
    raw.into_iter().map(|e| decode_event(run_id, e)).collect()
}

/// One stored event of `run_id`, checked.
pub fn decode_event(run_id: &str, e: RawEvent) -> Result<StoredEvent, Unreadable> {
    match EventName::parse(&e.name) {
        Some(name) => Ok(StoredEvent { id: u64::try_from(e.id).unwrap_or(0), name, data: e.data }),
        // Stored contents: named in logs and in the run's error, so at most 64 characters.
        None => Err(Unreadable { run_id: run_id.to_owned(), id: e.id, name: e.name.chars().take(64).collect() }),
    }
}

impl StoredEvent {
    /// True for `final` and `error`.
    pub fn is_terminal(&self) -> bool {
        self.name.is_terminal()
    }
}

/// What a restarted clawmux needs to run a run again: its spec, minus what has columns of its own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SpecRecord {
    /// The gateway run id (the `agent` idempotency key), fixed at admission.
    pub gateway_run_id: String,
    /// Agent id.
    pub agent_id: String,
    /// The user's message.
    pub message: String,
    /// Model override.
    pub model: Option<String>,
    /// Graph id.
    pub graph_id: String,
    /// The run's timeout in milliseconds (from `createdAt`).
    pub timeout_ms: u64,
    /// W3C traceparent (its trace id attributes the run's LLM calls).
    pub traceparent: String,
    /// Protocol-3 attribution token.
    pub attribution_token: Option<String>,
    /// The branch the run works on.
    pub branch: Option<clawmux_actors::branch::BranchPlan>,
    /// Whether the caller's disconnect cancels the run.
    pub abort_on_disconnect: bool,
    /// The request's `ifBusy`. Shared stores refuse a `reject` run at admission when its session
    /// key is busy on another replica; an `interrupt` run that has not started when it is taken up
    /// (by the replica its session key runs on, or after a restart) interrupts the run holding its
    /// session key there, as at its admission.
    #[serde(default, skip_serializing_if = "BusyPolicy::is_enqueue")]
    pub if_busy: BusyPolicy,
}

/// `ifBusy` as stored: what a run does when another run of its session key is live.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BusyPolicy {
    /// Waits its turn.
    #[default]
    Enqueue,
    /// Refused at once (`409 session_busy`).
    Reject,
    /// The running run ends `aborted`; this one goes next.
    Interrupt,
}

impl BusyPolicy {
    /// The default (not written).
    pub fn is_enqueue(&self) -> bool {
        *self == BusyPolicy::Enqueue
    }

    /// What a run continues with that has been taken up before (a restart, a takeover, after a
    /// suspension): an interrupt was done then, and must not end another run now.
    pub fn after_take_up(self) -> Self {
        match self {
            BusyPolicy::Interrupt => BusyPolicy::Enqueue,
            other => other,
        }
    }
}

/// The last checkpoint of a run (see `clawmux_actors::Checkpoint`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "stage", rename_all = "camelCase")]
pub enum CheckpointRecord {
    /// Holds its session key.
    Running,
    /// Its workspace is being prepared.
    Preparing,
    /// `agent` was sent to the gateway process with this boot id.
    #[serde(rename_all = "camelCase")]
    Sending {
        /// Boot id.
        boot_id: Option<String>,
    },
    /// The relay publishes.
    #[serde(rename_all = "camelCase")]
    Publishing {
        /// The run's final content.
        content: String,
        /// OpenClaw's own token counts.
        gateway_usage: Option<(u64, u64)>,
    },
}

/// A run as the store keeps it.
#[derive(Debug, Clone, PartialEq)]
pub struct RunRow {
    /// Admission order (assigned by the store).
    pub seq: i64,
    /// API run id.
    pub run_id: String,
    /// `Idempotency-Key` header.
    pub idempotency_key: Option<String>,
    /// Fingerprint of the request body.
    pub fingerprint: String,
    /// Billing account.
    pub billing_account_id: String,
    /// Conversation key.
    pub state_key: Option<String>,
    /// Canonical session key.
    pub session_key: String,
    /// How to run it again.
    pub spec: SpecRecord,
    /// `queued`, `running`, `ok`, `error`, `aborted`, `timeout`.
    pub status: String,
    /// The last checkpoint.
    pub checkpoint: Option<CheckpointRecord>,
    /// The gateway run id once the gateway acknowledged the run (the document's field).
    pub gateway_run_id: Option<String>,
    /// Final text.
    pub content: String,
    /// Error code and message.
    pub error: Option<(String, String)>,
    /// OpenClaw's own token counts.
    pub gateway_usage: Option<(u64, u64)>,
    /// The LLM proxy's totals (billing truth).
    pub usage: Option<Usage>,
    /// The relay's result.
    pub relay: Option<serde_json::Value>,
    /// Admission time (ms).
    pub created_at_ms: i64,
    /// End time (ms).
    pub finished_at_ms: Option<i64>,
    /// Id of the last stored event.
    pub last_event_id: u64,
    /// The API key that started the run (`None`: the admin token).
    pub key_id: Option<String>,
    /// Where the run's completion webhook goes.
    pub webhook_url: Option<String>,
}

/// Changes to a run's row; `None` leaves a column as it is.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunPatch {
    /// New status.
    pub status: Option<String>,
    /// New checkpoint.
    pub checkpoint: Option<CheckpointRecord>,
    /// The acknowledged gateway run id.
    pub gateway_run_id: Option<String>,
    /// Final text.
    pub content: Option<String>,
    /// Error code and message.
    pub error: Option<(String, String)>,
    /// OpenClaw's own token counts.
    pub gateway_usage: Option<(u64, u64)>,
    /// The proxy's totals.
    pub usage: Option<Usage>,
    /// The relay's result.
    pub relay: Option<serde_json::Value>,
    /// End time (ms).
    pub finished_at_ms: Option<i64>,
}

impl RunPatch {
    /// True when it changes nothing.
    pub fn is_empty(&self) -> bool {
        *self == RunPatch::default()
    }

    /// `later` applied after `self`: later values win.
    pub fn merge(&mut self, later: RunPatch) {
        macro_rules! take {
            ($($f:ident),*) => { $( if later.$f.is_some() { self.$f = later.$f; } )* };
        }
        take!(status, checkpoint, gateway_run_id, content, error, gateway_usage, usage, relay, finished_at_ms);
    }

    /// Applies the patch to a row.
    pub fn apply(&self, row: &mut RunRow) {
        macro_rules! set {
            ($($f:ident),*) => { $( if let Some(v) = &self.$f { row.$f = v.clone(); } )* };
        }
        set!(status, content);
        macro_rules! set_opt {
            ($($f:ident),*) => { $( if let Some(v) = &self.$f { row.$f = Some(v.clone()); } )* };
        }
        set_opt!(checkpoint, gateway_run_id, error, gateway_usage, usage, relay, finished_at_ms);
    }
}

/// One write; a batch of them is applied in one transaction.
// `Append` is the hot case (one per event): boxing its patch would add an allocation per delta.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Write {
    /// Admission: a new run unless its run id or idempotency key is taken.
    Insert(Box<RunRow>),
    /// An event (with the row changes it implies) or row changes alone.
    Append {
        /// The run.
        run_id: String,
        /// The event, if any.
        event: Option<StoredEvent>,
        /// Row changes.
        patch: RunPatch,
        /// A webhook delivery to queue with it (the terminal event: both or neither are stored).
        webhook: Option<NewDelivery>,
    },
    /// Tokens an account spent in a budget window (added to what is stored, once per `id`).
    Spend {
        /// Billing account.
        account: String,
        /// Window start (ms).
        window_start_ms: i64,
        /// Tokens to add.
        tokens: u64,
        /// This write's own id (see [`BillingId`]).
        id: BillingId,
    },
    /// The end of a run whose writes failed: its `internal` error event, which clients have seen
    /// right after the last event stored. Events the store took after that one are dropped (no
    /// client saw them), so the store ends up with exactly what clients saw.
    Fail {
        /// The run.
        run_id: String,
        /// The terminal event; its id is one past the last event clients saw.
        event: StoredEvent,
        /// Row changes (status, error, end time).
        patch: RunPatch,
        /// The run's completion webhook, queued with its end.
        webhook: Option<NewDelivery>,
    },
    /// A run whose admission failed after it was stored (so the caller can retry its id).
    Delete {
        /// The run.
        run_id: String,
    },
    /// This process's share of a run's usage: the absolute totals of the LLM calls ITS proxy
    /// forwarded for the run (idempotent: a repeated write changes nothing). Never fenced: a call a
    /// replica forwarded for a run it does not own (or no longer owns) was made and is billed.
    /// Shared stores keep one share per process and show their sum as the run's usage; the
    /// others (one process) keep it as the run's usage.
    Usage {
        /// The run.
        run_id: String,
        /// This process's totals for it.
        usage: Usage,
    },
    /// An LLM call's audit record. Shared stores keep them, so that `GET /v1/runs/{id}/llm-calls`
    /// on any replica lists the calls every replica forwarded; the others have the audit log file
    /// of their one process and drop it.
    LlmCall {
        /// This write's own id (see [`BillingId`]).
        id: BillingId,
        /// The record.
        record: Box<crate::audit::AuditRecord>,
    },
}

/// The id a billing record (spend, an LLM call's record) is written under, made once with the
/// record: written again after a commit whose outcome the writer could not know (the connection
/// lost after `COMMIT` was sent), the record is not counted twice. Stores whose commits cannot be
/// ambiguous (SQLite: a failed commit is rolled back) need not keep it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BillingId(pub String);

impl BillingId {
    /// A new one (a random UUID).
    pub fn new() -> Self {
        Self(uuid::Uuid::new_v4().to_string())
    }
}

impl Default for BillingId {
    fn default() -> Self {
        Self::new()
    }
}

/// A webhook delivery queued with a run's terminal event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewDelivery {
    /// Where to.
    pub url: String,
    /// Whose secret signs it.
    pub key_id: Option<String>,
    /// The final run document.
    pub body: String,
}

/// What a write did.
#[derive(Debug, Clone, PartialEq)]
pub enum Applied {
    /// A new run, with its admission order.
    Inserted {
        /// Admission order.
        seq: i64,
    },
    /// The same request was stored before: this is its run.
    Existing {
        /// Its run id.
        run_id: String,
    },
    /// The run id exists with a different body.
    Conflict,
    /// The idempotency key exists with a different body.
    IdempotencyMismatch,
    /// Stored.
    Done,
    /// A new run, stored for the replica that owns the earlier runs of its session or branch key
    /// (or after runs of them still waiting for their owner): that replica starts it in admission
    /// order, not this one.
    Assigned {
        /// Admission order.
        seq: i64,
    },
    /// Not stored: the run asked for `ifBusy: reject` and its session key has an unfinished run
    /// on another replica (stores shared by replicas; decided in the admitting transaction, so the
    /// other replica never sees the run).
    SessionBusy,
    /// Not stored: the run's session key and its branch key each have unfinished runs, on two
    /// different replicas. It can wait behind neither from the other's replica (each key's runs
    /// run on one replica, in order, and a branch key's lock is per process): the caller retries
    /// once one of them has finished.
    KeysOnTwoReplicas,
    /// Not stored: the run would take its billing account past its live-run or per-minute limit,
    /// or its token budget is spent, counted over every replica sharing the store (stores that
    /// count them: PostgreSQL).
    Limited {
        /// True for a spent token budget (`402`), false for the rate limits (`429`).
        budget: bool,
        /// A sentence a person can act on.
        message: String,
        /// Seconds until a retry can succeed.
        retry_after_sec: u64,
    },
    /// Not stored: the run belongs to another replica now (it took the run over after this one's
    /// lease expired). The writer stops writing for the run.
    Fenced,
    /// Not stored: another unfinished run (this one) has the new run's trace id or attribution
    /// token (shared stores; a single process refuses it in its own registry): the two runs' LLM
    /// calls could not be told apart.
    TraceInUse {
        /// The run that has it.
        run_id: String,
    },
}

/// A store failure, in words that name the store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct StoreError(pub String);

impl StoreError {
    /// Why the store failed, as a tenant is told (a run's `error`, its event, its webhook): the
    /// storage engine's own words for the common causes, else a generic one. Never the whole
    /// error: it names the operator's database file or server, which the log has.
    pub fn for_tenant(&self) -> &'static str {
        const KNOWN: [&str; 6] = [
            "database or disk is full",
            "No space left on device",
            "disk I/O error",
            "attempt to write a readonly database",
            "database disk image is malformed",
            "database is locked",
        ];
        KNOWN.into_iter().find(|k| self.0.contains(k)).unwrap_or("a storage error")
    }
}

/// `GET /v1/runs`, validated.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ListQuery {
    /// Only runs with one of these statuses (empty: all).
    pub statuses: Vec<String>,
    /// Only this billing account.
    pub billing_account_id: Option<String>,
    /// Only this conversation.
    pub state_key: Option<String>,
    /// Only runs admitted at or after this time (ms).
    pub since_ms: Option<i64>,
    /// Page size.
    pub limit: usize,
    /// Only runs admitted before this admission order (the cursor).
    pub before_seq: Option<i64>,
    /// Only runs of these billing accounts (an API key's scope; `None`: all).
    pub accounts: Option<Vec<String>>,
}

/// How long finished runs are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Finished runs older than this are deleted.
    pub max_age_ms: i64,
    /// At most this many finished runs of each billing account are kept (its oldest go first: one
    /// account's many runs do not push another's out).
    pub max_count: usize,
}

/// A run store backend. Implementations are used by one writer task (`apply`) and any number of
/// readers.
#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    /// `sqlite`, `memory`, ...
    fn kind(&self) -> &'static str;
    /// Applies a batch in one transaction; one result per write, in order. An error means nothing
    /// of the batch is stored.
    async fn apply(&self, batch: &[Write]) -> Result<Vec<Applied>, StoreError>;
    /// True when the last `apply` failed because the store itself was out of reach (a database
    /// server down), not because of its writes: the writer then fails the whole batch at once
    /// instead of retrying each write alone.
    fn unreachable(&self) -> bool {
        false
    }
    /// True when a commit is local work, short and bounded by this machine (SQLite, `memory:`),
    /// not a round trip to a server: then each shard commits its runs' writes on its own thread
    /// (see [`writer::Writer::start_lane_here`]).
    fn commits_locally(&self) -> bool {
        false
    }
    /// One run.
    async fn run(&self, run_id: &str) -> Result<Option<RunRow>, StoreError>;
    /// The run a billing account admitted under an `Idempotency-Key`, if any.
    async fn by_idempotency_key(&self, account: &str, key: &str) -> Result<Option<RunRow>, StoreError>;
    /// A run's events after `after`, in order, as stored.
    async fn raw_events(&self, run_id: &str, after: u64) -> Result<Vec<RawEvent>, StoreError>;
    /// A run's events after `after`, in order; one this version cannot read is an error naming
    /// the store.
    async fn events(&self, run_id: &str, after: u64) -> Result<Vec<StoredEvent>, StoreError> {
        decode_events(run_id, self.raw_events(run_id, after).await?).map_err(|e| StoreError(format!("the run store ({}) {e}", self.kind())))
    }
    /// History, newest first.
    async fn list(&self, query: &ListQuery) -> Result<Vec<RunRow>, StoreError>;
    /// Every run without a terminal event, in admission order.
    async fn unfinished(&self) -> Result<Vec<RunRow>, StoreError>;
    /// Deletes finished runs past the retention; returns their run ids.
    async fn sweep(&self, retention: Retention, now_ms: i64) -> Result<Vec<String>, StoreError>;
    /// The schema version the store has and the newest this build knows (`None`: no schema, as
    /// `memory:`). Reading it proves the store answers (`doctor`).
    async fn schema(&self) -> Result<Option<SchemaVersion>, StoreError> {
        Ok(None)
    }
    /// Records that this process is alive (stores shared by several processes; a no-op for the
    /// others).
    async fn heartbeat(&self, _replica: &Replica) -> Result<(), StoreError> {
        Ok(())
    }
    /// The processes that have used the store, most recent heartbeat first (`None`: the store
    /// does not track them).
    async fn replicas(&self) -> Result<Option<Vec<Replica>>, StoreError> {
        Ok(None)
    }
    /// Makes this process the owner of the runs it inserts from now on, for `lease.ms` at a time
    /// (stores shared by several processes; the others have one process per database, to which
    /// every run belongs).
    fn set_lease(&self, _lease: &Lease) {}
    /// Takes the runs this process may continue, in admission order: at start (`at_start`) the
    /// ones of its own id (a restart under the same id) and those whose lease expired; later only
    /// the expired ones of other processes, and its own expired ones, none it holds (`held`: its
    /// live logs; a claim of its own whose continuation failed halfway left them with no log to
    /// renew them) nor any of a held run's session or branch key (whoever owns its row: a run
    /// taken over while this process's renewals failed is reported lost by the next renewal,
    /// then continued by a takeover with the rest of its keys' runs).
    /// Each claimed run is this process's from then on (no other process gets it). Stores without
    /// leases: every unfinished run at start, none later.
    async fn claim(&self, _lease: &Lease, at_start: bool, _held: &[String]) -> Result<Vec<RunRow>, StoreError> {
        if at_start { self.unfinished().await } else { Ok(Vec::new()) }
    }
    /// Renews the leases of `live` (the runs this process holds) and of the runs other processes
    /// assigned it that it has not taken up yet (one statement), and reports which of `live` are
    /// another's now, and which have an abort posted elsewhere.
    async fn renew(&self, _lease: &Lease, _live: &[String]) -> Result<Renewed, StoreError> {
        Ok(Renewed::default())
    }
    /// Takes back `run_ids`, runs of this process it suspended while the store was out of
    /// reach, renewing their leases: those it still owns and that are unfinished, in admission
    /// order (the others were taken over meanwhile, or ended). Stores without leases: none.
    async fn readopt(&self, _lease: &Lease, _run_ids: &[String]) -> Result<Vec<RunRow>, StoreError> {
        Ok(Vec::new())
    }
    /// Gives up the leases of this process's unfinished runs (a handoff shutdown: they were
    /// suspended and their writes flushed), so that other processes take them over at once
    /// instead of after the lease. A no-op for stores without leases.
    async fn release(&self, _lease: &Lease) -> Result<u64, StoreError> {
        Ok(0)
    }
    /// True when several processes share the store: per-account limits are then counted by the
    /// store itself at admission ([`Applied::Limited`]) and spend is read from it, not from this
    /// process's memory.
    fn shared(&self) -> bool {
        false
    }
    /// Records an abort for the run's owner (posted to a process that does not own it), and why;
    /// false when the run is finished or unknown. Stores without leases: false (every run is
    /// local).
    async fn request_abort(&self, _run_id: &str, _reason: AbortReason) -> Result<bool, StoreError> {
        Ok(false)
    }
    /// The unfinished run an LLM call names, and this process's share of its usage so far: the
    /// LLM proxy forwards a call of a run another replica owns (shared stores). `None` on the
    /// others: one process per database, whose own registry knows every live run.
    async fn live_run(&self, _key: &CallKey) -> Result<Option<LiveRun>, StoreError> {
        Ok(None)
    }
    /// A run's stored usage split into this process's share and the other processes' (shared
    /// stores, one share per replica); `stored` is the usage its row has. The others have one
    /// process: all of it is its own.
    async fn usage_shares(&self, _run_id: &str, stored: Option<Usage>) -> Result<UsageShares, StoreError> {
        Ok(UsageShares { mine: stored.unwrap_or_default(), others: HashMap::new() })
    }
    /// Which of `run_ids` have ended (or are gone): the runs of other replicas whose LLM calls this
    /// process forwards are revoked with them. Stores without replicas: none (every run is local,
    /// and ends here).
    async fn ended(&self, _run_ids: &[String]) -> Result<Vec<String>, StoreError> {
        Ok(Vec::new())
    }
    /// A run's LLM calls as every replica recorded them (at most `limit`; the bool: more were
    /// left out), oldest first. `None`: the store keeps none (one process: its audit log file
    /// has them).
    async fn llm_calls(&self, _run_id: &str, _limit: usize) -> Result<Option<(Vec<crate::audit::LlmCall>, bool)>, StoreError> {
        Ok(None)
    }
}

/// Why an abort was posted for a run's owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortReason {
    /// `POST /v1/runs/{id}/abort` on another replica.
    Api,
    /// Another replica's LLM proxy found the run's account over its token budget: the run ends
    /// `budget_exceeded`, as when its owner's proxy finds it.
    BudgetExceeded,
}

impl AbortReason {
    /// As stored (`NULL` for [`AbortReason::Api`], as before the reason was stored).
    pub fn stored(self) -> Option<&'static str> {
        match self {
            AbortReason::Api => None,
            AbortReason::BudgetExceeded => Some("budget_exceeded"),
        }
    }

    /// From the stored value (anything unknown is a plain abort).
    pub fn parse(stored: Option<&str>) -> Self {
        match stored {
            Some("budget_exceeded") => AbortReason::BudgetExceeded,
            _ => AbortReason::Api,
        }
    }
}

/// What names the run an LLM call belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum CallKey {
    /// The trace id of the call's `traceparent` (protocol 4).
    Trace(String),
    /// The attribution token in the call's body (protocol 3).
    Token(String),
}

/// An unfinished run as the LLM proxy needs it to forward one of its calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveRun {
    /// API run id.
    pub run_id: String,
    /// Billing account (LiteLLM end user).
    pub billing_account_id: String,
    /// Graph id (in the spend logs' metadata).
    pub graph_id: String,
    /// Canonical session key (in the spend logs' metadata).
    pub session_key: String,
    /// The trace id its calls carry.
    pub trace_id: String,
    /// Its protocol-3 attribution token.
    pub token: Option<String>,
    /// This process's share of the run's usage so far: its counters continue from there.
    pub share: Usage,
}

/// A run's stored usage by process.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageShares {
    /// This process's share (its counters continue from it).
    pub mine: Usage,
    /// The other processes' shares, by replica id.
    pub others: HashMap<String, Usage>,
}

/// Who owns the runs a process admits, and for how long a renewal holds them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// `CLAWMUX_REPLICA_ID`.
    pub replica: String,
    /// `CLAWMUX_RUN_LEASE_SEC` in milliseconds.
    pub ms: i64,
}

/// What a renewal found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Renewed {
    /// Runs in memory here that another process owns now (this one was too slow to renew).
    pub lost: Vec<String>,
    /// Runs of this process with an abort posted to another process, and why.
    pub aborts: Vec<(String, AbortReason)>,
}

/// A clawmux process sharing the store, as its heartbeat row says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replica {
    /// `CLAWMUX_REPLICA_ID`.
    pub id: String,
    /// When it started (ms).
    pub started_at_ms: i64,
    /// Its last heartbeat (ms).
    pub heartbeat_at_ms: i64,
    /// The clawmux version it runs.
    pub version: String,
}

/// A durable store's schema version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchemaVersion {
    /// Migrations applied to the store.
    pub applied: i64,
    /// Migrations this build has.
    pub known: i64,
}

/// `CLAWMUX_STORE_URL`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// `sqlite://PATH` (`~/` is the home directory).
    Sqlite(PathBuf),
    /// `memory:`.
    Memory,
    /// `postgres://…` or `postgresql://…`: the URL as given (it may hold a password, hence the
    /// [`Secret`]), and the same without the password for messages.
    Postgres {
        /// The URL as given.
        url: Secret,
        /// `postgres://user@host:port/db`.
        display: String,
    },
}

impl StoreUrl {
    /// Parses a store URL.
    pub fn parse(url: &str) -> Result<Self, String> {
        if url == "memory:" || url == "memory://" {
            return Ok(StoreUrl::Memory);
        }
        if let Some(path) = url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:")) {
            if path.is_empty() {
                return Err("sqlite:// needs a file path, e.g. sqlite:///var/lib/clawmux/runs.db".to_owned());
            }
            let path = match path.strip_prefix("~/") {
                Some(rest) => std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default().join(rest),
                None => PathBuf::from(path),
            };
            return Ok(StoreUrl::Sqlite(path));
        }
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            // The message never echoes the URL: it may hold a password.
            let parsed = reqwest::Url::parse(url).map_err(|e| format!("a postgres:// URL that cannot be parsed ({e})"))?;
            if parsed.host_str().is_none_or(str::is_empty) {
                return Err("a postgres:// URL needs a host, e.g. postgres://clawmux@db.internal:5432/clawmux".to_owned());
            }
            let user = if parsed.username().is_empty() { String::new() } else { format!("{}@", parsed.username()) };
            let port = parsed.port().map(|p| format!(":{p}")).unwrap_or_default();
            let display = format!("postgres://{user}{}{port}{}", parsed.host_str().unwrap_or_default(), parsed.path());
            return Ok(StoreUrl::Postgres { url: Secret::new(url), display });
        }
        // Only the scheme is echoed: the rest may hold credentials.
        let scheme = url.split_once("://").map_or("", |(s, _)| s);
        Err(format!("a store URL with scheme {scheme:?} is not supported (sqlite://PATH or memory:)"))
    }

    /// For `doctor` and logs (no credentials in either form).
    pub fn display(&self) -> String {
        match self {
            StoreUrl::Sqlite(p) => format!("sqlite://{}", p.display()),
            StoreUrl::Memory => "memory:".to_owned(),
            StoreUrl::Postgres { display, .. } => display.clone(),
        }
    }
}

/// `text` as a text column takes it on every backend: PostgreSQL's `text` refuses U+0000 (a
/// final answer with one would fail its run `internal` there and end `ok` on SQLite), so it is
/// stored as U+FFFD. For what the gateway or the model wrote (a run's content, its error's
/// message); the events keep it, JSON-escaped.
pub fn storable_text(text: &str) -> String {
    if text.contains('\0') {
        text.replace('\0', "\u{FFFD}")
    } else {
        text.to_owned()
    }
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Stored events are input: any kind, id and data decode without a panic; a run's events
        /// are read as stored when every kind is one clawmux writes, and otherwise the first
        /// unknown one is named (a run to be continued ends `internal` then; a stream read from
        /// the store leaves such events out, see `RunStore::events`).
        #[test]
        fn stored_events_decode_or_name_the_first_unknown_kind(events in proptest::collection::vec((any::<i64>(), prop_oneof![
            Just("accepted".to_owned()), Just("text_delta".to_owned()), Just("final".to_owned()), Just("error".to_owned()), ".{0,12}"
        ], ".{0,20}"), 0..20), long in ".{60,200}") {
            let mut raw: Vec<RawEvent> = events.iter().map(|(id, name, data)| RawEvent { id: *id, name: name.clone(), data: data.clone() }).collect();
            // Sometimes a long unknown kind (it is shown cut to 64 characters).
            if events.len() % 3 == 1 {
                raw.push(RawEvent { id: 7, name: long, data: "{}".into() });
            }
            let first_unknown = raw.iter().find(|e| EventName::parse(&e.name).is_none()).cloned();
            match (decode_events("run-1", raw.clone()), first_unknown) {
                (Ok(decoded), None) => {
                    prop_assert_eq!(decoded.len(), raw.len());
                    for (d, r) in decoded.iter().zip(&raw) {
                        prop_assert_eq!(d.id, u64::try_from(r.id).unwrap_or(0));
                        prop_assert_eq!(d.name.as_str(), r.name.as_str());
                        prop_assert_eq!(&d.data, &r.data);
                    }
                }
                (Err(e), Some(u)) => {
                    let shown: String = u.name.chars().take(64).collect();
                    prop_assert_eq!((e.run_id.as_str(), e.id, e.name.as_str()), ("run-1", u.id, shown.as_str()));
                    prop_assert!(e.to_string().contains("unknown kind"));
                }
                (got, unknown) => prop_assert!(false, "decoded {:?} with the first unknown kind {:?}", got, unknown),
            }
        }
    }


    #[test]
    fn store_urls() {
        assert_eq!(StoreUrl::parse("memory:"), Ok(StoreUrl::Memory));
        assert_eq!(StoreUrl::parse("sqlite:///var/x.db"), Ok(StoreUrl::Sqlite("/var/x.db".into())));
        assert_eq!(StoreUrl::parse("sqlite:runs.db"), Ok(StoreUrl::Sqlite("runs.db".into())));
        assert!(StoreUrl::parse("sqlite://").is_err());
        let e = StoreUrl::parse("mysql://user:secret@db/x").expect_err("unknown scheme");
        assert!(!e.contains("secret"), "{e}");
        let pg = StoreUrl::parse("postgres://u:secret-pw@db.internal:5433/runs?sslmode=require").expect("postgres");
        assert_eq!(pg.display(), "postgres://u@db.internal:5433/runs");
        assert!(!format!("{pg:?}").contains("secret-pw"), "{pg:?}");
        assert!(StoreUrl::parse("postgresql://h/db").is_ok());
        assert!(StoreUrl::parse("postgres:///db").is_err_and(|e| e.contains("host")));
    }

    #[test]
    fn patches_merge_later_wins() {
        let mut a = RunPatch { status: Some("running".into()), content: Some("x".into()), ..RunPatch::default() };
        a.merge(RunPatch { status: Some("ok".into()), ..RunPatch::default() });
        assert_eq!(a.status.as_deref(), Some("ok"));
        assert_eq!(a.content.as_deref(), Some("x"));
        assert!(RunPatch::default().is_empty());
    }
}
