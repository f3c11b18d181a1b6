//! The run store as the HTTP layer and the restart path use it: admission (idempotency, run-id
//! reuse), the logs of live runs, reads of stored ones, history, retention, and the runs a restart
//! continues.

use super::live::RunLog;
use super::memory::MemoryStore;
use super::sqlite::SqliteStore;
use super::writer::{StoreMetrics, Writer};
use super::tenants::TenantStore;
use super::{now_ms, Applied, ListQuery, Retention, RunDoc, RunRow, Store, StoreError, StoreUrl, StoredEvent, Write};
use dashmap::DashMap;
use std::sync::Arc;
use std::time::Duration;

/// How long a finished run's log stays in memory (re-attaching clients are served from it; after
/// that from the store).
const LINGER: Duration = Duration::from_secs(60);

/// How an admission went.
pub enum Insert {
    /// A new run was stored.
    New(Arc<RunLog>),
    /// The same request was stored before: this is its run.
    Existing(RunView),
    /// The run id exists with a different body.
    Conflict,
    /// The idempotency key exists with a different body.
    IdempotencyMismatch,
}

/// A run, live in this process or only stored.
#[derive(Clone)]
pub enum RunView {
    /// Live (or recently finished): its log.
    Live(Arc<RunLog>),
    /// Stored only (finished, or owned by no live process).
    Stored(Box<RunRow>),
}

impl RunView {
    /// Its document.
    pub fn doc(&self) -> RunDoc {
        match self {
            RunView::Live(log) => log.doc(),
            RunView::Stored(row) => RunDoc::from_row(row, None),
        }
    }

    /// Its run id.
    pub fn run_id(&self) -> &str {
        match self {
            RunView::Live(log) => &log.run_id,
            RunView::Stored(row) => &row.run_id,
        }
    }

    /// Its billing account.
    pub fn billing_account_id(&self) -> String {
        match self {
            RunView::Live(log) => log.billing_account_id(),
            RunView::Stored(row) => row.billing_account_id.clone(),
        }
    }

    /// True once it has its terminal event.
    pub fn is_finished(&self) -> bool {
        match self {
            RunView::Live(log) => log.is_finished(),
            RunView::Stored(row) => row.finished_at_ms.is_some(),
        }
    }
}

/// The run store.
pub struct RunStore {
    backend: Arc<dyn Store>,
    tenants: Arc<dyn TenantStore>,
    writer: Writer,
    /// Logs of live runs (and of runs finished less than [`LINGER`] ago).
    live: DashMap<String, Arc<RunLog>>,
    retention: Retention,
    url: String,
    /// `clawmux_frame_to_client_seconds` (observed by the logs when deltas become visible).
    latency: Option<prometheus::Histogram>,
}

impl RunStore {
    /// Opens the store `url` names and starts its writer on the current runtime. A store that
    /// cannot be opened is an error naming it (startup stops with it).
    pub async fn open(
        url: &StoreUrl,
        retention: Retention,
        metrics: StoreMetrics,
        latency: Option<prometheus::Histogram>,
    ) -> Result<Arc<Self>, StoreError> {
        let (backend, tenants): (Arc<dyn Store>, Arc<dyn TenantStore>) = match url {
            StoreUrl::Memory => {
                let m = Arc::new(MemoryStore::new());
                (m.clone(), m)
            }
            StoreUrl::Sqlite(path) => {
                let s = Arc::new(SqliteStore::open(path).await?);
                (s.clone(), s)
            }
        };
        Ok(Self::with_backend(backend, tenants, retention, metrics, url.display(), latency))
    }

    /// A store over `backend` (tests use it with a probe backend).
    pub fn with_backend(
        backend: Arc<dyn Store>,
        tenants: Arc<dyn TenantStore>,
        retention: Retention,
        metrics: StoreMetrics,
        url: String,
        latency: Option<prometheus::Histogram>,
    ) -> Arc<Self> {
        let writer = Writer::start(backend.clone(), metrics);
        Arc::new(Self { backend, tenants, writer, live: DashMap::new(), retention, url, latency })
    }

    /// Keys, limits, spend and the webhook outbox of the same store.
    pub fn tenants(&self) -> Arc<dyn TenantStore> {
        self.tenants.clone()
    }

    /// The group-commit writer.
    pub fn writer(&self) -> Writer {
        self.writer.clone()
    }

    /// `sqlite://…` or `memory:`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The backend's kind.
    pub fn kind(&self) -> &'static str {
        self.backend.kind()
    }

    /// Stores a new run unless its run id or idempotency key is taken.
    pub async fn insert(&self, mut row: RunRow) -> Result<Insert, StoreError> {
        match self.writer.apply(Write::Insert(Box::new(row.clone()))).await? {
            Applied::Inserted { seq } => {
                row.seq = seq;
                let log = RunLog::new(row, Vec::new(), self.writer.clone(), self.latency.clone());
                self.live.insert(log.run_id.clone(), log.clone());
                Ok(Insert::New(log))
            }
            Applied::Existing { run_id } => match self.view(&run_id).await? {
                Some(v) => Ok(Insert::Existing(v)),
                // Swept between the two reads: the caller may start it again.
                None => Err(StoreError(format!("run {run_id:?} vanished from the store; retry"))),
            },
            Applied::Conflict => Ok(Insert::Conflict),
            Applied::IdempotencyMismatch => Ok(Insert::IdempotencyMismatch),
            Applied::Done => Err(StoreError("the run store did not say how the admission went".to_owned())),
        }
    }

    /// Forgets a run whose admission failed after it was stored, so the caller can retry its id.
    pub async fn forget(&self, run_id: &str) {
        self.live.remove(run_id);
        if let Err(e) = self.writer.apply(Write::Delete { run_id: run_id.to_owned() }).await {
            tracing::warn!(run_id, error = %e, "cannot forget a run whose admission failed");
        }
    }

    /// A live run's log.
    pub fn live(&self, run_id: &str) -> Option<Arc<RunLog>> {
        self.live.get(run_id).map(|r| r.clone())
    }

    /// A run, live or stored.
    pub async fn view(&self, run_id: &str) -> Result<Option<RunView>, StoreError> {
        if let Some(log) = self.live(run_id) {
            return Ok(Some(RunView::Live(log)));
        }
        Ok(self.backend.run(run_id).await?.map(|r| RunView::Stored(Box::new(r))))
    }

    /// A stored run's events after `after`.
    pub async fn events(&self, run_id: &str, after: u64) -> Result<Vec<StoredEvent>, StoreError> {
        self.backend.events(run_id, after).await
    }

    /// History: documents newest first, and, when more runs follow, the admission order of the
    /// last one (the cursor). One run more than asked for is read to know whether any follows:
    /// the last page has no cursor, even when it is full.
    pub async fn list(&self, query: &ListQuery) -> Result<(Vec<RunDoc>, Option<i64>), StoreError> {
        let mut one_more = query.clone();
        one_more.limit = query.limit.saturating_add(1);
        let mut rows = self.backend.list(&one_more).await?;
        let more = rows.len() > query.limit;
        rows.truncate(query.limit);
        let last = if more { rows.last().map(|r| r.seq) } else { None };
        let docs = rows
            .iter()
            .map(|r| match self.live(&r.run_id) {
                // A live run's usage moves between writes: show it as the proxy counts it now.
                Some(log) => log.doc(),
                None => RunDoc::from_row(r, None),
            })
            .collect();
        Ok((docs, last))
    }

    /// The unfinished runs of the store with their events, as live logs, in admission order: what
    /// a restarted clawmux continues.
    pub async fn resume(&self) -> Result<Vec<(Arc<RunLog>, RunRow)>, StoreError> {
        let mut out = Vec::new();
        for row in self.backend.unfinished().await? {
            let events = self.backend.events(&row.run_id, 0).await?;
            let log = RunLog::new(row.clone(), events, self.writer.clone(), self.latency.clone());
            self.live.insert(row.run_id.clone(), log.clone());
            out.push((log, row));
        }
        Ok(out)
    }

    /// Enforces the retention in the store and forgets the logs of runs finished a while ago.
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        self.live.retain(|_, log| log.finished_for().is_none_or(|d| d < LINGER));
        self.backend.sweep(self.retention, now_ms()).await
    }

    /// Waits until every write queued so far is stored.
    pub async fn flush(&self) {
        self.writer.flush().await;
    }

    /// Live runs without their terminal event.
    pub fn unfinished(&self) -> usize {
        self.live.iter().filter(|l| !l.is_finished()).count()
    }
}
