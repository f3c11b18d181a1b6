//! The run store as the HTTP layer and the restart path use it: admission (idempotency, run-id
//! reuse), the logs of live runs, reads of stored ones, history, retention, and the runs a restart
//! continues.

use super::live::RunLog;
use super::memory::MemoryStore;
use super::notes::EndNotes;
use super::postgres::PgStore;
use super::sqlite::SqliteStore;
use super::writer::{StoreMetrics, Writer};
use super::tenants::TenantStore;
use super::{
    now_ms, AbortReason, Applied, CallKey, EventName, Lease, ListQuery, LiveRun, Renewed, Retention, RunDoc, RunPatch, RunRow, Store, StoreError, StoreUrl,
    StoredEvent, UsageShares, Write,
};
use crate::attribution::Usage;
use clawmux_actors::{ErrorCode, RunEvent, RunOutcome, RunSink};
use dashmap::DashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// How long a finished run's log stays in memory (re-attaching clients are served from it; after
/// that from the store).
const LINGER: Duration = Duration::from_secs(60);

/// A stored run's new log, before it goes live.
struct Built {
    log: Arc<RunLog>,
    row: RunRow,
    /// Why its events could not be read (it is ended instead of continued).
    unreadable: Option<super::Unreadable>,
}

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
    /// Stored for the replica that owns the earlier runs of its session or branch key (see
    /// [`Applied::Assigned`]): it runs there, this process serves it from the store.
    Assigned(RunView),
    /// Not stored: `ifBusy: reject` and the session key is busy on another replica (see
    /// [`Applied::SessionBusy`]).
    SessionBusy,
    /// Not stored: its session key and branch key are in use on two replicas (see
    /// [`Applied::KeysOnTwoReplicas`]).
    KeysOnTwoReplicas,
    /// Not stored: the account's live-run or per-minute limit or its token budget, counted by the
    /// store over every replica (see [`Applied::Limited`]).
    Limited {
        /// True for a spent token budget.
        budget: bool,
        /// A sentence a person can act on.
        message: String,
        /// Seconds until a retry can succeed.
        retry_after_sec: u64,
    },
    /// Not stored: this unfinished run has the same trace id (see [`Applied::TraceInUse`]).
    TraceInUse(String),
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

    /// The fingerprint of the request that started it.
    pub fn fingerprint(&self) -> String {
        match self {
            RunView::Live(log) => log.fingerprint.clone(),
            RunView::Stored(row) => row.fingerprint.clone(),
        }
    }

    /// True once it has its terminal event.
    pub fn is_finished(&self) -> bool {
        match self {
            RunView::Live(log) => log.is_finished(),
            RunView::Stored(row) => row.finished_at_ms.is_some(),
        }
    }

    /// [`Self::is_finished`], or its end decided and on its way to the store (a live run whose
    /// session actor has ended it: see [`RunLog::is_ending`]).
    pub fn is_ending(&self) -> bool {
        match self {
            RunView::Live(log) => log.is_ending(),
            RunView::Stored(_) => self.is_finished(),
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
    /// `clawmux_frame_to_client_seconds` (observed by the logs' feeds when a live client takes a delta).
    latency: Option<prometheus::Histogram>,
    /// Ends the store could not take (durable stores only): see [`super::notes`].
    notes: Option<Arc<EndNotes>>,
    /// Followers of runs live on other replicas (stores shared by replicas only).
    follow: Option<Arc<super::follow::Follow>>,
    /// Runs suspended here while the shared store was out of reach (see [`RunStore::suspend_all`]),
    /// with their logs (their LLM calls stay attributed until they go on).
    suspended: DashMap<String, Arc<RunLog>>,
    /// Runs whose admission failed after they were stored and whose deletion failed too (see
    /// [`RunStore::forget`]): held (no takeover here runs a run its caller was refused) and
    /// deleted again at each takeover.
    forgotten: dashmap::DashSet<String>,
    /// This store, for the hooks its logs are given.
    weak_self: std::sync::Weak<RunStore>,
    /// This process's replica id (set with its lease).
    me: OnceLock<String>,
    /// Stored events left out of streams lately (run, event id): each is warned of once a minute,
    /// not at every read of every follower.
    left_out: std::sync::Mutex<crate::expiring::ExpiringKeys<(String, i64)>>,
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
        let mut follow = None;
        let (backend, tenants): (Arc<dyn Store>, Arc<dyn TenantStore>) = match url {
            StoreUrl::Memory => {
                let m = Arc::new(MemoryStore::new());
                (m.clone(), m)
            }
            StoreUrl::Sqlite(path) => {
                let s = Arc::new(SqliteStore::open(path).await?);
                (s.clone(), s)
            }
            StoreUrl::Postgres { url, display } => {
                let s = Arc::new(PgStore::open(url.expose(), display).await?);
                follow = Some(super::follow::Follow::new(s.pool().clone()));
                (s.clone(), s)
            }
        };
        // Notes are a file next to an SQLite store; a PostgreSQL store is shared by replicas that
        // share no file.
        let notes = match url {
            StoreUrl::Memory | StoreUrl::Postgres { .. } => None,
            StoreUrl::Sqlite(path) => Some(Arc::new(EndNotes::open(path).map_err(StoreError)?)),
        };
        Ok(Self::build(backend, tenants, retention, metrics, url.display(), latency, notes, follow))
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
        Self::build(backend, tenants, retention, metrics, url, latency, None, None)
    }

    #[allow(clippy::too_many_arguments)] // private: the two constructors above pass everything through
    fn build(
        backend: Arc<dyn Store>,
        tenants: Arc<dyn TenantStore>,
        retention: Retention,
        metrics: StoreMetrics,
        url: String,
        latency: Option<prometheus::Histogram>,
        notes: Option<Arc<EndNotes>>,
        follow: Option<Arc<super::follow::Follow>>,
    ) -> Arc<Self> {
        let writer = Writer::start(backend.clone(), metrics);
        Arc::new_cyclic(|me| Self {
            backend,
            tenants,
            writer,
            live: DashMap::new(),
            retention,
            url,
            latency,
            notes,
            follow,
            suspended: DashMap::new(),
            forgotten: dashmap::DashSet::new(),
            weak_self: me.clone(),
            me: OnceLock::new(),
            left_out: std::sync::Mutex::new(crate::expiring::ExpiringKeys::new(Duration::from_secs(60), 1_000)),
        })
    }

    /// Keys, limits, spend and the webhook outbox of the same store.
    pub fn tenants(&self) -> Arc<dyn TenantStore> {
        self.tenants.clone()
    }

    /// The group-commit writer (its main lane).
    pub fn writer(&self) -> Writer {
        self.writer.clone()
    }

    /// Makes the current thread a shard of the store: its runs' writes commit on it (stores that
    /// commit locally; see [`Writer::start_lane_here`]).
    pub fn start_lane_here(&self) {
        self.writer.start_lane_here();
    }

    /// `sqlite://…` or `memory:`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The backend's kind.
    pub fn kind(&self) -> &'static str {
        self.backend.kind()
    }

    /// Records that this process (`replica`) is alive; see [`Store::heartbeat`].
    pub async fn heartbeat(&self, replica: &super::Replica) -> Result<(), StoreError> {
        self.backend.heartbeat(replica).await
    }

    /// The processes sharing the store; see [`Store::replicas`].
    pub async fn replicas(&self) -> Result<Option<Vec<super::Replica>>, StoreError> {
        self.backend.replicas().await
    }

    /// The backend's schema version (`None`: `memory:`); an error when it does not answer.
    pub async fn schema(&self) -> Result<Option<super::SchemaVersion>, StoreError> {
        self.backend.schema().await
    }

    /// Stores a new run unless its run id or idempotency key is taken.
    pub async fn insert(&self, mut row: RunRow) -> Result<Insert, StoreError> {
        match self.writer.here().apply(Write::Insert(Box::new(row.clone()))).await? {
            Applied::Inserted { seq } => {
                row.seq = seq;
                let log = self.new_log(row, Vec::new());
                self.live.insert(log.run_id.clone(), log.clone());
                Ok(Insert::New(log))
            }
            Applied::Assigned { seq } => {
                row.seq = seq;
                Ok(Insert::Assigned(RunView::Stored(Box::new(row))))
            }
            Applied::Existing { run_id } => match self.view(&run_id).await? {
                Some(v) => Ok(Insert::Existing(v)),
                // Swept between the two reads: the caller may start it again.
                None => Err(StoreError(format!("run {run_id:?} vanished from the store; retry"))),
            },
            Applied::Limited { budget, message, retry_after_sec } => Ok(Insert::Limited { budget, message, retry_after_sec }),
            Applied::SessionBusy => Ok(Insert::SessionBusy),
            Applied::KeysOnTwoReplicas => Ok(Insert::KeysOnTwoReplicas),
            Applied::Conflict => Ok(Insert::Conflict),
            Applied::IdempotencyMismatch => Ok(Insert::IdempotencyMismatch),
            Applied::TraceInUse { run_id } => Ok(Insert::TraceInUse(run_id)),
            Applied::Done | Applied::Fenced => Err(StoreError("the run store did not say how the admission went".to_owned())),
        }
    }

    /// True when several processes share the store (see [`super::Store::shared`]).
    pub fn shared(&self) -> bool {
        self.backend.shared()
    }

    /// A run's log; on a store shared by replicas, one whose store failure suspends this
    /// replica's runs instead of ending it.
    fn new_log(&self, row: RunRow, events: Vec<StoredEvent>) -> Arc<RunLog> {
        // The lane of the thread that makes the log: on a shard (the HTTP worker that admitted the
        // run, which runs its session actor too), that shard's.
        let log = RunLog::new(row, events, self.writer.here(), self.latency.clone(), self.notes.clone());
        if self.backend.shared() {
            let me = self.weak_self.clone();
            log.on_store_down(Box::new(move || {
                if let Some(store) = me.upgrade() {
                    store.suspend_all();
                }
            }));
        }
        log
    }

    /// The shared store is out of reach: every live run of this replica is suspended (stopped
    /// here without cancelling its gateway run, its streams ended without a terminal event, see
    /// [`RunLog::suspend`]) and remembered. Nothing of them could be stored anyway, and stopping
    /// all of them keeps each session key's runs together: none starts while an earlier one of
    /// its key still runs on the gateway. Once the store answers again, this replica continues
    /// them ([`Self::readopt`]) unless another replica took them over meanwhile (their leases
    /// expired).
    pub fn suspend_all(&self) {
        let ids: Vec<String> = self.live.iter().filter(|l| !l.is_finished() && !l.is_lost()).map(|l| l.key().clone()).collect();
        let mut n = 0;
        for id in ids {
            let Some((_, log)) = self.live.remove(&id) else { continue };
            // Before the log stops: none of its writes still queued may land later.
            self.writer.hold(&id);
            if log.suspend() {
                self.suspended.insert(id, log);
                n += 1;
            } else {
                self.writer.release(&id);
            }
        }
        if n > 0 {
            tracing::warn!(runs = n, "the run store is out of reach: suspended this replica's runs (their gateway runs go on); they continue once it answers");
        }
    }

    /// Runs suspended here and not continued yet.
    pub fn suspended(&self) -> usize {
        self.suspended.len()
    }

    /// The store answers again: takes back the suspended runs this replica still owns (another
    /// replica may have taken some over meanwhile), as live logs in admission order, for the
    /// restart path to continue. Their old logs stop attributing their LLM calls (the new ones
    /// do). On an error they stay suspended for the next attempt.
    pub async fn readopt(&self, lease: &Lease) -> Result<Vec<(Arc<RunLog>, RunRow)>, StoreError> {
        let ids: Vec<String> = self.suspended.iter().map(|e| e.key().clone()).collect();
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut rows = self.backend.readopt(lease, &ids).await?;
        // Their documents show no less than the suspended runs did, until their billing is set.
        for row in &mut rows {
            self.count_suspended_usage(row);
        }
        // Whatever their old logs queued is dropped by now; the new logs' writes go through. If
        // a read fails here, the runs stay suspended (and held) for the next attempt.
        self.writer.flush().await;
        let logs = self.build_logs(rows).await?;
        // Taken over elsewhere meanwhile: lost here (see `lose`), whether or not the renewal has
        // told yet (taking back usually comes first).
        let back: std::collections::HashSet<&str> = logs.iter().map(|b| b.row.run_id.as_str()).collect();
        let taken: Vec<String> = ids.iter().filter(|id| !back.contains(id.as_str())).cloned().collect();
        let elsewhere = self.still_running(&taken).await;
        for id in &ids {
            if let Some((_, old)) = self.suspended.remove(id) {
                // Continued here: the new log's billing adopts the old one's entry (its calls in
                // flight go on, its counters stay whole); going on elsewhere: it stays as a
                // remote run's; ended (or the store cannot say): it goes.
                old.let_go_of_billing(back.contains(id.as_str()) || elsewhere.contains(id));
            }
            self.writer.release(id);
        }
        Ok(self.go_live(logs))
    }

    /// Forgets a run whose admission failed after it was stored, so the caller can retry its id.
    pub async fn forget(&self, run_id: &str) {
        // Held until deleted: a takeover here must not claim it (its caller was refused).
        self.forgotten.insert(run_id.to_owned());
        self.live.remove(run_id);
        self.delete_forgotten(run_id).await;
    }

    async fn delete_forgotten(&self, run_id: &str) {
        match self.writer.apply(Write::Delete { run_id: run_id.to_owned() }).await {
            Ok(_) => {
                self.forgotten.remove(run_id);
            }
            Err(e) => tracing::warn!(run_id, error = %e, "cannot forget a run whose admission failed; trying again at the next takeover"),
        }
    }

    /// A live run's log (not one another replica took over: that run is served from the store).
    pub fn live(&self, run_id: &str) -> Option<Arc<RunLog>> {
        self.live.get(run_id).map(|r| r.clone()).filter(|l| !l.is_lost())
    }

    /// Wakes on each batch that stores events of `run_id` on any replica (`None`: the store is
    /// not shared, every live run is in this process).
    pub fn follow(&self, run_id: &str) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.follow.as_ref().map(|f| f.subscribe(run_id))
    }

    /// Wakes when the end of `run_id` is stored by any replica (`None`: the store is not shared).
    pub fn follow_end(&self, run_id: &str) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.follow.as_ref().map(|f| f.subscribe_end(run_id))
    }

    /// Wakes `wake` when another replica assigns `replica` a run (stores shared by replicas).
    pub fn wake_on_assigned(&self, replica: &str, wake: Arc<tokio::sync::Notify>) {
        if let Some(f) = &self.follow {
            f.wake_on_assigned(replica, wake);
        }
    }

    /// Makes this process the owner of the runs it admits; see [`Store::set_lease`].
    pub fn set_lease(&self, lease: &Lease) {
        let _ = self.me.set(lease.replica.clone());
        self.backend.set_lease(lease);
    }

    /// The unfinished run an LLM call names; see [`Store::live_run`].
    pub async fn live_run(&self, key: &CallKey) -> Result<Option<LiveRun>, StoreError> {
        self.backend.live_run(key).await
    }

    /// A run's usage by process; see [`Store::usage_shares`].
    pub async fn usage_shares(&self, run_id: &str, stored: Option<Usage>) -> Result<UsageShares, StoreError> {
        self.backend.usage_shares(run_id, stored).await
    }

    /// Which of `run_ids` have ended; see [`Store::ended`].
    pub async fn ended(&self, run_ids: &[String]) -> Result<Vec<String>, StoreError> {
        self.backend.ended(run_ids).await
    }

    /// A run's LLM calls as every replica recorded them; see [`Store::llm_calls`].
    pub async fn llm_calls(&self, run_id: &str, limit: usize) -> Result<Option<(Vec<crate::audit::LlmCall>, bool)>, StoreError> {
        self.backend.llm_calls(run_id, limit).await
    }

    /// Listens for what other replicas tell this one (stores shared by replicas; a no-op for the
    /// others): `ended` hears of each run whose end another replica stored, `abort` is woken when an
    /// abort is posted for a run of this one; usage shares reach the live runs' documents here.
    pub fn on_notes(self: &Arc<Self>, ended: Box<dyn Fn(&str) + Send + Sync>, abort: Arc<tokio::sync::Notify>) {
        let Some(follow) = &self.follow else { return };
        let me = self.me.get().cloned().unwrap_or_default();
        let (weak, mine) = (Arc::downgrade(self), me.clone());
        let share = Box::new(move |n: super::pg_shares::ShareNote| {
            // This process's own share is in its counters already.
            if n.replica == mine {
                return;
            }
            if let Some(log) = weak.upgrade().and_then(|s| s.live.get(&n.run_id).map(|l| l.clone())) {
                log.note_share(&n.replica, n.usage);
            }
        });
        let weak = Arc::downgrade(self);
        let missed = Box::new(move || {
            if let (Some(store), Ok(rt)) = (weak.upgrade(), tokio::runtime::Handle::try_current()) {
                rt.spawn(async move { store.resync_shares().await });
            }
        });
        let abort = Box::new(move |owner: &str| {
            if owner == me {
                abort.notify_one();
            }
        });
        follow.on_notes(super::follow::Notes { ended, share, abort, missed });
    }

    /// Reads the other replicas' shares of this process's live runs again (notifications of them
    /// may have been missed).
    async fn resync_shares(&self) {
        let logs: Vec<Arc<RunLog>> = self.live.iter().filter(|l| !l.is_finished() && !l.is_lost()).map(|l| l.clone()).collect();
        for log in logs {
            match self.backend.usage_shares(&log.run_id, log.stored_usage()).await {
                Ok(shares) => {
                    for (replica, share) in shares.others {
                        log.note_share(&replica, share);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the usage shares of this replica's runs again; their documents show them once notified");
                    return;
                }
            }
        }
    }

    /// Renews this process's leases; see [`Store::renew`].
    /// Renews the leases of the runs this process holds: live here (a run that ended here but
    /// whose end the store does not have yet included: no other replica may continue it) or
    /// suspended. A run it owns in the store but holds nowhere (its continuation failed halfway)
    /// is not renewed: its lease expires and it is claimed again, here or elsewhere.
    pub async fn renew(&self, lease: &Lease) -> Result<Renewed, StoreError> {
        self.backend.renew(lease, &self.held()).await
    }

    /// The runs this process holds: live here (ended here with the end not yet stored included)
    /// or suspended.
    fn held(&self) -> Vec<String> {
        let mut held: Vec<String> =
            self.live.iter().filter(|l| !l.is_lost() && (!l.is_finished() || !l.end_stored())).map(|l| l.run_id.clone()).collect();
        held.extend(self.suspended.iter().map(|e| e.key().clone()));
        held.extend(self.forgotten.iter().map(|id| id.key().clone()));
        held
    }

    /// Which of `run_ids` the store says are unfinished (none when it cannot say: a statement
    /// bounded like the lease statements).
    async fn still_running(&self, run_ids: &[String]) -> std::collections::HashSet<String> {
        if run_ids.is_empty() {
            return Default::default();
        }
        match self.backend.ended(run_ids).await {
            Ok(ended) => {
                let ended: std::collections::HashSet<String> = ended.into_iter().collect();
                run_ids.iter().filter(|id| !ended.contains(*id)).cloned().collect()
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot tell whether the runs another replica took over go on; their LLM streams in flight here are cut");
                Default::default()
            }
        }
    }

    /// Another replica owns these runs now: each is stopped here without cancelling it (see
    /// [`RunLog::lose`]) and served from the store from now on; a run suspended here is no
    /// longer taken back. Its billing entry goes on as a remote run's (its LLM streams in flight
    /// go on, and count once, in this replica's share) unless the store says it ended already
    /// (or cannot say): an ended run's entry is dropped, its trace id belongs to no live run.
    pub async fn lose_all(&self, run_ids: &[String]) {
        let elsewhere = self.still_running(run_ids).await;
        for run_id in run_ids {
            self.lose(run_id, elsewhere.contains(run_id)).await;
        }
    }

    async fn lose(&self, run_id: &str, live_elsewhere: bool) -> bool {
        if let Some((_, old)) = self.suspended.remove(run_id) {
            old.let_go_of_billing(live_elsewhere);
            // Its writes queued while it was suspended are dropped (it is held), then it is let go
            // of: nothing of it is held any more, whether or not it ever comes back here.
            self.writer.flush().await;
            self.writer.release(run_id);
            return true;
        }
        match self.live.remove(run_id) {
            Some((_, log)) => log.lose(live_elsewhere),
            None => false,
        }
    }

    /// Gives up this process's leases (handoff shutdown); see [`Store::release`].
    pub async fn release(&self, lease: &Lease) -> Result<u64, StoreError> {
        self.backend.release(lease).await
    }

    /// Records an abort for the run's owner (another replica); see [`Store::request_abort`].
    pub async fn request_abort(&self, run_id: &str, reason: AbortReason) -> Result<bool, StoreError> {
        self.backend.request_abort(run_id, reason).await
    }

    /// Takes over the runs whose owner's lease expired (see [`Store::claim`]), as live logs in
    /// admission order, for the restart path to continue.
    pub async fn take_over(&self, lease: &Lease) -> Result<Vec<(Arc<RunLog>, RunRow)>, StoreError> {
        // This process's own usage shares are stored before they are read for the runs it takes.
        self.writer.flush().await;
        let forgotten: Vec<String> = self.forgotten.iter().map(|id| id.key().clone()).collect();
        for run_id in forgotten {
            self.delete_forgotten(&run_id).await;
        }
        let rows = self.backend.claim(lease, false, &self.held()).await?;
        self.logs_of(rows).await
    }

    async fn logs_of(&self, rows: Vec<RunRow>) -> Result<Vec<(Arc<RunLog>, RunRow)>, StoreError> {
        let built = self.build_logs(rows).await?;
        Ok(self.go_live(built))
    }

    /// The logs of stored runs with their events; all or none when the store fails (a read
    /// failing partway leaves no log live that nobody continues: the runs' leases are then not
    /// renewed, and they are claimed again). A run whose stored events this version cannot read
    /// gets a log without them (numbered after them) and the reason, to be ended: it must not keep
    /// every other run from being continued.
    async fn build_logs(&self, rows: Vec<RunRow>) -> Result<Vec<Built>, StoreError> {
        // A run suspended here once, then taken over elsewhere, comes back: the writes its old
        // log queued are gone after a flush, and its new log's go through.
        if rows.iter().any(|r| self.writer.is_held(&r.run_id)) {
            self.writer.flush().await;
            for r in &rows {
                if self.suspended.get(&r.run_id).is_none() {
                    self.writer.release(&r.run_id);
                }
            }
        }
        let mut out = Vec::new();
        for mut row in rows {
            let raw = self.backend.raw_events(&row.run_id, 0).await?;
            // The ids go on after every stored one, read or not.
            let last = raw.iter().map(|e| u64::try_from(e.id).unwrap_or(0)).max().unwrap_or(0);
            let (events, unreadable) = match super::decode_events(&row.run_id, raw) {
                Ok(events) => (events, None),
                Err(e) => {
                    row.last_event_id = row.last_event_id.max(last);
                    (Vec::new(), Some(e))
                }
            };
            out.push(Built { log: self.new_log(row.clone(), events), row, unreadable });
        }
        Ok(out)
    }

    /// Makes built logs the live ones of their runs and returns those to continue, in order. A
    /// run whose events cannot be read ends here (`internal`, its gateway run not cancelled: as
    /// one that cannot be admitted again, see `server::continue_runs`); its log stays live until
    /// that end is stored.
    fn go_live(&self, built: Vec<Built>) -> Vec<(Arc<RunLog>, RunRow)> {
        let mut go_on = Vec::new();
        for Built { log, row, unreadable } in built {
            self.live.insert(row.run_id.clone(), log.clone());
            match unreadable {
                None => go_on.push((log, row)),
                Some(e) => {
                    tracing::error!(run_id = %row.run_id, store = self.kind(), error = %e, "a stored run cannot be continued: the run store holds an event of it this version cannot read; it ends `internal`");
                    let msg = format!("clawmux could not continue the run (after a restart, a takeover or a store outage): the run store {e}");
                    log.emit(RunEvent::Finished(RunOutcome::failed(ErrorCode::Internal, msg, String::new())));
                }
            }
        }
        go_on
    }

    /// The run a billing account admitted under an `Idempotency-Key`, if any.
    pub async fn by_idempotency_key(&self, account: &str, key: &str) -> Result<Option<RunRow>, StoreError> {
        self.backend.by_idempotency_key(account, key).await
    }

    /// A run, live or stored.
    pub async fn view(&self, run_id: &str) -> Result<Option<RunView>, StoreError> {
        if let Some(log) = self.live(run_id) {
            return Ok(Some(RunView::Live(log)));
        }
        let mut row = self.backend.run(run_id).await?;
        if let Some(row) = row.as_mut() {
            self.count_suspended_usage(row);
        }
        Ok(row.map(|r| RunView::Stored(Box::new(r))))
    }

    /// A run suspended here through a store outage: the calls this process counted may not be in
    /// the store yet (their records are written again once it answers), and its document must not
    /// show less than it did a moment ago.
    fn count_suspended_usage(&self, row: &mut RunRow) {
        if let Some(counted) = self.suspended.get(&row.run_id).and_then(|log| log.live_usage()) {
            row.usage = Some(row.usage.map_or(counted, |u| u.at_least(counted)));
        }
    }

    /// A stored run's events after `after`, for its clients. One of a kind this version cannot
    /// read is left out, with a warning: its run ended `internal` saying why if this version was
    /// to continue it, and a kind a newer version wrote is one an older reader need not show
    /// (its clients get every other event and the run's end, not an error they would retry).
    pub async fn events(&self, run_id: &str, after: u64) -> Result<Vec<StoredEvent>, StoreError> {
        let raw = self.backend.raw_events(run_id, after).await?;
        let mut out = Vec::with_capacity(raw.len());
        for e in raw {
            match super::decode_event(run_id, e) {
                Ok(e) => out.push(e),
                Err(e) => {
                    let now = std::time::Instant::now();
                    let mut left_out = self.left_out.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    let key = (e.run_id.clone(), e.id);
                    if !left_out.contains(&key, now) {
                        left_out.insert(key, now);
                        tracing::warn!(store = self.kind(), "a stored event is left out of a stream: the run store {e}");
                    }
                }
            }
        }
        Ok(out)
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
            .iter_mut()
            .map(|r| match self.live(&r.run_id) {
                // A live run's usage moves between writes: show it as the proxy counts it now.
                Some(log) => log.doc(),
                None => {
                    self.count_suspended_usage(r);
                    RunDoc::from_row(r, None)
                }
            })
            .collect();
        Ok((docs, last))
    }

    /// The unfinished runs of the store this process may continue (on a shared store: its own
    /// and those whose lease expired, claimed; see [`Store::claim`]) with their events, as live
    /// logs, in admission order: what a restarted clawmux continues. Runs a previous process
    /// ended because the store failed them (noted outside the store) are ended the same way
    /// first, never continued.
    pub async fn resume(&self, lease: &Lease) -> Result<Vec<(Arc<RunLog>, RunRow)>, StoreError> {
        let ended = self.end_noted_runs().await?;
        let mut rows: Vec<RunRow> = self.backend.claim(lease, true, &[]).await?.into_iter().filter(|r| !ended.contains(&r.run_id)).collect();
        if !self.backend.shared() {
            // One process: every run was taken up here before (no replica assigns runs to it).
            for r in &mut rows {
                r.spec.if_busy = r.spec.if_busy.after_take_up();
            }
        }
        self.logs_of(rows).await
    }

    /// Stores the ends a previous process noted and could not store; returns the runs that must
    /// not be continued (all noted ones: one whose end cannot be stored now either stays
    /// unfinished and noted for the next start).
    async fn end_noted_runs(&self) -> Result<std::collections::HashSet<String>, StoreError> {
        let Some(notes) = &self.notes else { return Ok(Default::default()) };
        let noted = notes.read().map_err(StoreError)?;
        let mut all_stored = true;
        let mut ended = std::collections::HashSet::new();
        for super::notes::Note { run_id, event_id, seq } in noted {
            let Some(row) = self.backend.run(&run_id).await? else { continue };
            // A note of an earlier run under this id (its end was stored, it was swept, the id
            // was taken again): not this run's end.
            if seq.is_some_and(|seq| seq != row.seq) {
                continue;
            }
            ended.insert(run_id.clone());
            if row.finished_at_ms.is_some() {
                continue;
            }
            let message = "the run store could not record this run, and clawmux stopped before it could; the run was cancelled".to_owned();
            let data = serde_json::json!({"runId": run_id, "code": "internal", "message": message}).to_string();
            let patch = RunPatch {
                status: Some("error".to_owned()),
                error: Some(("internal".to_owned(), message)),
                finished_at_ms: Some(now_ms()),
                ..RunPatch::default()
            };
            let mut doc_row = row.clone();
            patch.apply(&mut doc_row);
            let webhook = row.webhook_url.clone().map(|url| super::NewDelivery {
                url,
                key_id: row.key_id.clone(),
                body: serde_json::to_string(&RunDoc::from_row(&doc_row, None)).unwrap_or_default(),
            });
            let event = StoredEvent { id: event_id, name: EventName::Error, data };
            match self.writer.apply(Write::Fail { run_id: run_id.clone(), event, patch, webhook }).await {
                Ok(Applied::Fenced) => tracing::warn!(run_id, "a run the store failed before the restart was taken over by another replica; that replica ends it"),
                Ok(_) => tracing::warn!(run_id, "a run the store failed before the restart ends `internal`, as its clients saw"),
                Err(e) => {
                    all_stored = false;
                    tracing::error!(run_id, error = %e, "cannot store the end of a run the store failed before the restart; it stays unfinished");
                }
            }
        }
        if all_stored {
            notes.clear().map_err(StoreError)?;
        }
        Ok(ended)
    }

    /// Enforces the retention in the store and forgets the logs of runs finished a while ago (or
    /// swept from the store: a swept run is gone from every read). A log whose end the store does
    /// not have yet is kept: it is the only place that knows how the run ended.
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        self.live.retain(|_, log| !log.is_lost() && (log.finished_for().is_none_or(|d| d < LINGER) || !log.end_stored()));
        let gone = self.backend.sweep(self.retention, now_ms()).await?;
        for run_id in &gone {
            self.live.remove(run_id);
        }
        Ok(gone.len() as u64)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A store at `url` that keeps every run.
    async fn open_store(url: &StoreUrl) -> Arc<RunStore> {
        let metrics = StoreMetrics::new(&prometheus::Registry::new()).expect("metrics");
        let retention = Retention { max_age_ms: i64::MAX, max_count: usize::MAX };
        RunStore::open(url, retention, metrics, None).await.expect("opens")
    }

    /// A store over `probe` (a shared store's behaviour, in memory) that keeps every run.
    fn over_probe(probe: Arc<crate::remote_runs::tests::Probe>) -> Arc<RunStore> {
        let metrics = StoreMetrics::new(&prometheus::Registry::new()).expect("metrics");
        let retention = Retention { max_age_ms: i64::MAX, max_count: usize::MAX };
        RunStore::with_backend(probe, Arc::new(MemoryStore::new()), retention, metrics, "probe:".into(), None)
    }

    /// An end noted for a run the store failed applies to that run only: once its end is stored
    /// and it is swept, a new run under the same id (ids are the callers') is continued by a
    /// restart with every event it has. Before, the old note ended it `internal` and cut its events
    /// from the noted id on.
    #[actix_rt::test]
    async fn an_old_end_note_does_not_end_a_later_run_under_the_same_id() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("runs.db");
        let url = StoreUrl::Sqlite(path.clone());
        let open = || open_store(&url);
        let first = open().await;
        let Ok(Insert::New(log)) = first.insert(super::super::backend_tests::row("x", "acct", 1)).await else { panic!("x not stored") };
        log.emit(RunEvent::Accepted { gateway_run_id: "gw-x".to_owned() });
        for i in 0..6 {
            log.emit(RunEvent::TextDelta(format!("part {i} ")));
        }
        first.flush().await;
        let seq = first.backend.run("x").await.expect("read").expect("row").seq;
        drop(first);
        // The earlier run "x" (admitted before this one) had its end noted at event 3.
        super::super::notes::EndNotes::open(&path).expect("notes").note("x", 3, seq - 1).expect("note");

        let second = open().await;
        let lease = Lease { replica: "test".into(), ms: 60_000 };
        let continued: Vec<String> = second.resume(&lease).await.expect("resumed").into_iter().map(|(_, r)| r.run_id).collect();
        assert_eq!(continued, ["x"]);
        second.flush().await;
        let row = second.backend.run("x").await.expect("read").expect("row");
        assert!(row.finished_at_ms.is_none() && row.error.is_none(), "{row:?}");
        assert_eq!(second.backend.raw_events("x", 0).await.expect("events").len(), 7, "its events were cut");
    }

    /// An answer holding U+0000 ends its run `ok` on every backend (PostgreSQL's `text` refused it:
    /// the final write failed and the run ended `internal` there, `ok` on SQLite), its content and
    /// error message as U+FFFD.
    #[actix_rt::test]
    async fn an_answer_holding_a_nul_ends_its_run_the_same_on_every_backend() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut urls = vec![StoreUrl::Memory, StoreUrl::Sqlite(dir.path().join("runs.db"))];
        if let Some(url) = super::super::backend_tests::pg_url("an_answer_holding_a_nul_ends_its_run_the_same_on_every_backend").await {
            urls.push(StoreUrl::parse(&url).expect("pg url"));
        }
        for url in urls {
            let store = open_store(&url).await;
            for (id, outcome) in [
                ("nul-ok", RunOutcome::ok("a\0b".to_owned(), None)),
                ("nul-error", RunOutcome::failed(ErrorCode::AgentError, "bad\0news", "c\0".to_owned())),
            ] {
                let Ok(Insert::New(log)) = store.insert(super::super::backend_tests::row(id, "acct", 1)).await else { panic!("{id} not stored") };
                log.emit(RunEvent::Accepted { gateway_run_id: format!("gw-{id}") });
                log.emit(RunEvent::Finished(outcome));
            }
            store.flush().await;
            let ok = store.backend.run("nul-ok").await.expect("read").expect("row");
            assert_eq!((ok.status.as_str(), ok.content.as_str()), ("ok", "a\u{FFFD}b"), "{}", url.display());
            let failed = store.backend.run("nul-error").await.expect("read").expect("row");
            assert_eq!(failed.error, Some(("agent_error".to_owned(), "bad\u{FFFD}news".to_owned())), "{}", url.display());
        }
    }

    /// A run suspended here and then found taken over by another replica is let go of wholly: its
    /// writes are no longer held (they were, forever, when it never came back here).
    #[actix_rt::test]
    async fn a_suspended_run_lost_to_another_replica_is_no_longer_held() {
        let probe = Arc::new(crate::remote_runs::tests::Probe::default());
        let store = over_probe(probe);
        assert!(matches!(store.insert(super::super::backend_tests::row("r1", "acct", 1)).await, Ok(Insert::New(_))));
        store.suspend_all();
        assert_eq!(store.suspended(), 1);
        assert!(store.writer().is_held("r1"), "its queued writes are dropped while it is suspended");
        store.lose_all(&["r1".to_owned()]).await;
        assert_eq!(store.suspended(), 0);
        assert!(!store.writer().is_held("r1"), "still held after it was lost");
    }

    /// A run whose admission failed after it was stored, and whose deletion failed too, stays
    /// held here (a takeover here would otherwise claim it once its lease expired and run it,
    /// though its caller was refused) and is deleted at the next takeover once the store takes it.
    #[actix_rt::test]
    async fn a_forgotten_run_the_store_could_not_delete_is_held_and_deleted_later() {
        let probe = Arc::new(crate::remote_runs::tests::Probe::default());
        let store = over_probe(probe.clone());
        assert!(matches!(store.insert(super::super::backend_tests::row("r1", "acct", 1)).await, Ok(Insert::New(_))));
        probe.writes_fail.store(true, std::sync::atomic::Ordering::SeqCst);
        store.forget("r1").await;
        assert!(store.live("r1").is_none());
        assert_eq!(store.held(), ["r1"], "a run the store still has unfinished, not held here");
        probe.writes_fail.store(false, std::sync::atomic::Ordering::SeqCst);
        let lease = Lease { replica: "a".into(), ms: 60_000 };
        store.take_over(&lease).await.expect("take over");
        assert!(store.held().is_empty());
        assert!(store.backend.run("r1").await.expect("read").is_none(), "deleted once the store took it");
    }

    /// A suspended run's document counts the calls this process forwarded whose records the store
    /// has not got yet (they are written again once it answers): it never shows less than the run
    /// showed while live (before, the store's usage: here 0, then 1 again once written).
    #[actix_rt::test]
    async fn a_suspended_runs_document_counts_the_calls_whose_records_the_store_lacks() {
        let probe = Arc::new(crate::remote_runs::tests::Probe::default());
        let store = over_probe(probe.clone());
        let mut row = super::super::backend_tests::row("r1", "acct", 1);
        row.usage = Some(Usage::default());
        let Ok(Insert::New(log)) = store.insert(row).await else { panic!("r1 not stored") };
        let billing = Arc::new(crate::attribution::RunBilling::new("r1", "acct", "g", "agent:main:r1", "trace-r1"));
        log.set_billing(billing.clone(), Arc::new(crate::attribution::Attributions::new()), None);
        probe.writes_fail.store(true, std::sync::atomic::Ordering::SeqCst);
        billing.count_call();
        billing.add_usage(7, 3);
        store.flush().await;
        store.suspend_all();
        assert_eq!(probe.run("r1").await.expect("read").and_then(|r| r.usage), Some(Usage::default()), "the store has no record of the call");
        let counted = Usage { input_tokens: 7, output_tokens: 3, llm_calls: 1 };
        let Some(RunView::Stored(row)) = store.view("r1").await.expect("view") else { panic!("not served from the store") };
        assert_eq!(row.usage, Some(counted));
        let (listed, _) = store.list(&ListQuery { limit: 10, ..ListQuery::default() }).await.expect("list");
        let usage = listed.iter().map(|d| serde_json::to_value(d).expect("json")["usage"].clone()).collect::<Vec<_>>();
        assert_eq!(usage, [serde_json::json!({"inputTokens": 7, "outputTokens": 3, "llmCalls": 1, "source": "proxy"})], "the list shows what the document shows");
        // Taken back (the store answers reads; its records of the call are still to be written
        // again): the new log shows the same until its billing adopts the old one's counters.
        let lease = Lease { replica: "test".into(), ms: 60_000 };
        let back = store.readopt(&lease).await.expect("taken back");
        assert_eq!(back.len(), 1);
        assert_eq!(store.live("r1").expect("live again").doc().usage.map(|u| u.llm_calls), Some(1), "the document forgot the call");
    }

    /// Another replica's share heard of while a continued run is live here but not attributable
    /// yet counts once its billing is set (before, it was dropped until that replica wrote again).
    #[actix_rt::test]
    async fn a_share_heard_before_a_runs_billing_is_set_counts_once_it_is() {
        let probe = Arc::new(crate::remote_runs::tests::Probe::default());
        let store = over_probe(probe);
        let Ok(Insert::New(log)) = store.insert(super::super::backend_tests::row("r1", "acct", 1)).await else { panic!("r1 not stored") };
        log.note_share("b", Usage { input_tokens: 5, output_tokens: 2, llm_calls: 2 });
        log.note_share("b", Usage { input_tokens: 4, output_tokens: 2, llm_calls: 1 });
        let billing = Arc::new(crate::attribution::RunBilling::new("r1", "acct", "g", "agent:main:r1", "trace-r1").with_usage(Usage { input_tokens: 1, output_tokens: 1, llm_calls: 1 }));
        log.set_billing(billing.clone(), Arc::new(crate::attribution::Attributions::new()), None);
        assert_eq!(billing.run_totals(), Usage { input_tokens: 6, output_tokens: 3, llm_calls: 3 });
        assert_eq!(log.doc().usage.map(|u| u.llm_calls), Some(3));
    }

    /// A run lost to another replica that goes on there keeps its billing entry here as a remote
    /// run's (an LLM stream in flight through this proxy is not cut, and counts in this replica's
    /// share); one the store says ended has its entry dropped (its trace id is no live run's).
    #[actix_rt::test]
    async fn a_lost_run_that_goes_on_elsewhere_keeps_its_billing_entry_as_a_remote_one() {
        let probe = Arc::new(crate::remote_runs::tests::Probe::default());
        let store = over_probe(probe.clone());
        let registry = Arc::new(crate::attribution::Attributions::new());
        let start = |id: &'static str| {
            let (store, registry) = (&store, registry.clone());
            async move {
                let Ok(Insert::New(log)) = store.insert(super::super::backend_tests::row(id, "acct", 1)).await else { panic!("{id} not stored") };
                let b = registry.register(Arc::new(crate::attribution::RunBilling::new(id, "acct", "g", &format!("agent:main:{id}"), &format!("trace-{id}")))).expect("register");
                log.set_billing(b.clone(), registry, None);
                b
            }
        };
        // r1 and r2 suspended here, then lost (r2 ended at its new owner meanwhile); r3 lost
        // while live here.
        let (r1, r2) = (start("r1").await, start("r2").await);
        store.suspend_all();
        let r3 = start("r3").await;
        store.lose_all(&["r1".to_owned()]).await;
        probe.ended.lock().expect("ended").push("r2".into());
        store.lose_all(&["r2".to_owned(), "r3".to_owned()]).await;
        assert_eq!(store.suspended(), 0);
        assert!(store.live("r3").is_none());
        // r4 and r5 suspended here, then taken over elsewhere: the store answers again and the
        // take-back comes before the renewal's news (r5 ended meanwhile).
        let (r4, r5) = (start("r4").await, start("r5").await);
        store.suspend_all();
        probe.taken_over.lock().expect("taken").extend(["r4".to_owned(), "r5".to_owned()]);
        probe.ended.lock().expect("ended").push("r5".into());
        assert!(store.readopt(&Lease { replica: "test".into(), ms: 60_000 }).await.expect("readopt").is_empty());
        assert_eq!(store.suspended(), 0);
        for (b, kept) in [(&r1, true), (&r2, false), (&r3, true), (&r4, true), (&r5, false)] {
            assert_eq!(!b.revoked.is_cancelled(), kept, "{}: its streams in flight", b.run_id);
            assert_eq!(registry.lookup(&b.trace_id).is_some_and(|x| Arc::ptr_eq(&x, b)), kept, "{}: its entry", b.run_id);
            assert!(!registry.is_local(b), "{} still this process's run", b.run_id);
        }
    }

    /// Stored contents are input: a run whose events this version cannot read (damaged, or of a
    /// kind a newer version wrote) ends `internal` after a restart, and every other run is
    /// continued (before, the restart read all logs or none: one such run left every run
    /// unfinished, their clients waiting for good).
    #[actix_rt::test]
    async fn a_run_with_an_unreadable_event_ends_internal_and_the_others_are_continued_after_a_restart() {
        unreadable_event_after_a_restart("UPDATE events SET name = 'from_a_newer_version' WHERE run_id = 'r2' AND id = 2", "from_a_newer_version", 3).await;
    }

    /// SQLite keeps any value in any column: a damaged row whose columns do not read as their types
    /// (a blob, text that is not UTF-8, a real id) ends its own run, not every run's restart.
    #[actix_rt::test]
    async fn an_event_column_of_another_type_ends_only_its_run_after_a_restart() {
        // The end's id follows the last readable one (an id that does not read is no id).
        for (damage, end_id) in [
            ("UPDATE events SET data = X'00ff' WHERE run_id = 'r2' AND id = 2", 3),
            ("UPDATE events SET data = CAST(X'ff' AS TEXT) WHERE run_id = 'r2' AND id = 2", 3),
            ("UPDATE events SET name = X'00' WHERE run_id = 'r2' AND id = 2", 3),
            ("UPDATE events SET id = 2.5 WHERE run_id = 'r2' AND id = 2", 2),
            ("UPDATE events SET id = 'x' WHERE run_id = 'r2' AND id = 2", 2),
        ] {
            unreadable_event_after_a_restart(damage, crate::store::sqlite_events::UNREADABLE_COLUMN, end_id).await;
        }
    }

    async fn unreadable_event_after_a_restart(damage: &str, named: &str, end_id: u64) {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("runs.db");
        let url = StoreUrl::Sqlite(path.clone());
        let open = || open_store(&url);
        let first = open().await;
        for id in ["r1", "r2", "r3"] {
            let Ok(Insert::New(log)) = first.insert(super::super::backend_tests::row(id, "acct", 1)).await else { panic!("{id} not stored") };
            log.emit(RunEvent::Accepted { gateway_run_id: format!("gw-{id}") });
            log.emit(RunEvent::TextDelta(format!("text of {id}")));
        }
        first.flush().await;
        drop(first);
        let c = rusqlite::Connection::open(&path).expect("open");
        c.execute(damage, []).expect("damage");

        let second = open().await;
        let lease = Lease { replica: "test".into(), ms: 60_000 };
        let continued: Vec<String> = second.resume(&lease).await.expect("resumed").into_iter().map(|(_, r)| r.run_id).collect();
        assert_eq!(continued, ["r1", "r3"], "{damage}");
        second.flush().await;
        let r2 = second.backend.run("r2").await.expect("read").expect("r2");
        assert_eq!(r2.status, "error");
        let (code, message) = r2.error.expect("an error");
        assert_eq!(code, "internal");
        assert!(message.contains(named) && message.contains("unknown kind"), "{damage}: {message}");
        // Its end comes after the events it had (ids go on from the stored ones), and it is live
        // until that end is stored, then served as any finished run.
        let log = second.live("r2").expect("its log");
        assert!(log.is_finished());
        assert_eq!(r2.last_event_id, end_id, "{damage}");
        for id in ["r1", "r3"] {
            let log = second.live(id).expect("continued");
            assert!(!log.is_finished(), "{id}");
            let row = second.backend.run(id).await.expect("read").expect("row");
            assert!(row.finished_at_ms.is_none() && row.error.is_none(), "{id}: {row:?}");
        }
    }
}
