//! `postgres://…`: the run store on PostgreSQL, shared by every replica of clawmux. Same rows and
//! semantics as the SQLite store; the schema is created and migrated at start by sqlx's migrator
//! from `migrations/postgres/` (embedded in the binary; it takes a lock of its own, so replicas
//! starting together migrate once).
//!
//! Admission is decided by the unique constraints on `run_id` and `idempotency_key`
//! (`INSERT … ON CONFLICT DO NOTHING`, then the row that won is read): two replicas admitting the
//! same request at once store it once. A batch of the group commit is one transaction; the events
//! of a batch go in with one statement.

use super::tenants::{BranchClaim, DeliveryOutcome, KeyRecord, Limits, OutboxItem, TenantStore};
use super::columns::{decode_row, json_text as json, patch_columns, Columns};
use super::pg_limits::{self, account_lock, AccountLimits};
use super::pg_shares;
use super::{
    AbortReason, Applied, BillingId, CallKey, Lease, ListQuery, LiveRun, RawEvent, Renewed, Replica, Retention, RunPatch, RunRow, SchemaVersion, Store, StoreError,
    StoredEvent, UsageShares, Write,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgRow};
use sqlx::{PgPool, Postgres, QueryBuilder, Row, Transaction};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// The schema, embedded at build time.
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

/// Connections per process: the group-commit writer holds one per batch, readers (HTTP, history,
/// the webhook outbox) share the rest.
const POOL_SIZE: u32 = 16;

/// The writer's connections: it applies one batch at a time (a second one for a batch that
/// starts while a broken connection is being replaced).
const WRITE_POOL_SIZE: u32 = 2;

/// How long a caller waits for a connection before the store counts as unavailable (admission
/// answers `503` rather than hanging while the database is down).
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

/// How long the first connection at start may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The PostgreSQL store.
pub struct PgStore {
    /// Connections of the readers (HTTP handlers, history, the webhook outbox, heartbeats).
    pool: PgPool,
    /// The group-commit writer's own connections, opened lazily by the writer itself: a socket
    /// is driven by the runtime that opened it, and the writer runs on a thread of its own. On a
    /// connection opened by a busy HTTP thread, each round trip of a commit would also wait for
    /// that thread's event loop to turn.
    write_pool: PgPool,
    /// `postgres://user@host:port/db` (no password), for messages.
    display: String,
    /// The last `apply` failed because the database was out of reach (see [`Store::unreachable`]).
    unreachable: AtomicBool,
    /// This process as the owner of the runs it inserts, and its lease (unset: runs are inserted
    /// without an owner and writes are not fenced, e.g. `clawmux` commands other than `serve`).
    lease: OnceLock<Lease>,
    /// When the sweep last looked for records of runs that are gone (see `ORPHANS_EVERY`).
    orphans_swept: std::sync::Mutex<Option<std::time::Instant>>,
}

/// How often the sweep also looks for usage shares and call records whose run is gone: that looks
/// at every such row (~0.2 s of the database with 100,000 runs and 500,000 calls kept), where the
/// sweep otherwise reads only what it deletes; such records are rare and harmless meanwhile.
const ORPHANS_EVERY: Duration = Duration::from_secs(600);

/// The database's clock in milliseconds: every lease is set and judged by it, so replicas whose
/// clocks differ still agree on which lease expired.
const DB_NOW_MS: &str = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

impl PgStore {
    /// Connects to `url` and migrates the schema. Every error names the store (without its
    /// password).
    pub async fn open(url: &str, display: &str) -> Result<Self, StoreError> {
        let fail = |what: &str, e: &dyn std::fmt::Display| StoreError(format!("the run store {display} {what}: {e}"));
        let options = PgConnectOptions::from_str(url).map_err(|e| fail("has an invalid URL", &redact(&e.to_string(), url)))?;
        // One connection first, for its own error: the pool would only say it timed out.
        let first: Result<sqlx::PgConnection, sqlx::Error> =
            match tokio::time::timeout(CONNECT_TIMEOUT, sqlx::Connection::connect_with(&options)).await {
                Ok(r) => r,
                Err(_) => return Err(fail("cannot be reached", &format!("no answer within {CONNECT_TIMEOUT:?}"))),
            };
        sqlx::Connection::close(first.map_err(|e| fail("cannot be reached", &e))?).await.map_err(|e| fail("cannot be reached", &e))?;
        let pool = PgPoolOptions::new()
            .max_connections(POOL_SIZE)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            // A connection that broke while the database restarted is found out before use.
            .test_before_acquire(true)
            .connect_with(options.clone())
            .await
            .map_err(|e| fail("cannot be reached", &e))?;
        MIGRATOR.run(&pool).await.map_err(|e| fail("cannot be set up", &e))?;
        let write_pool = PgPoolOptions::new()
            .max_connections(WRITE_POOL_SIZE)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .test_before_acquire(true)
            .connect_lazy_with(options);
        Ok(Self { pool, write_pool, display: display.to_owned(), unreachable: AtomicBool::new(false), lease: OnceLock::new(), orphans_swept: std::sync::Mutex::new(None) })
    }

    /// The connection pool (replica coordination shares it).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn err(&self, e: impl std::fmt::Display) -> StoreError {
        StoreError(format!("the run store {}: {e}", self.display))
    }

    /// A failed `apply`: remembers whether the database itself was out of reach (then every write
    /// fails alike, and retrying them one by one would only wait [`ACQUIRE_TIMEOUT`] each).
    fn apply_err(&self, e: sqlx::Error) -> StoreError {
        self.unreachable.store(is_unreachable(&e), Ordering::Relaxed);
        self.err(e)
    }

    /// How long a transaction or a lease statement may take before the database counts as out of
    /// reach: a network partition that drops packets (no reset) would otherwise hold the writer
    /// and the renewals until the kernel gives up on the connection (minutes), with runs neither
    /// going on nor suspended. A lease's length (2–10 s): longer, and the run's lease could expire
    /// under a batch that is still trying to write it.
    fn answer_within(&self) -> Duration {
        let lease = self.lease.get().map_or(NO_ANSWER_AT_MOST, |l| Duration::from_millis(u64::try_from(l.ms).unwrap_or(0)));
        lease.clamp(NO_ANSWER_AT_LEAST, NO_ANSWER_AT_MOST)
    }

    /// The error of a statement that got no answer in time (see [`Self::answer_within`]).
    fn no_answer(&self) -> StoreError {
        self.unreachable.store(true, Ordering::Relaxed);
        StoreError(format!("the run store {}: no answer within {:?}", self.display, self.answer_within()))
    }

    /// Runs a lease statement, bounded like a transaction (see [`Self::answer_within`]).
    async fn bounded<T>(&self, f: impl std::future::Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
        tokio::time::timeout(self.answer_within(), f).await.unwrap_or_else(|_| Err(self.no_answer()))
    }
}

/// Bounds of [`PgStore::answer_within`].
const NO_ANSWER_AT_LEAST: Duration = Duration::from_secs(2);
const NO_ANSWER_AT_MOST: Duration = Duration::from_secs(10);

/// True for errors that say nothing about the writes: no connection, a broken one, the server
/// shutting down.
fn is_unreachable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::WorkerCrashed => true,
        // Class 08: connection exception; 57P01..57P03: admin shutdown, crash shutdown, cannot
        // connect now (starting up or shutting down).
        sqlx::Error::Database(d) => d.code().is_some_and(|c| c.starts_with("08") || matches!(c.as_ref(), "57P01" | "57P02" | "57P03")),
        _ => false,
    }
}

/// Creates a database of its own on the server `url` names and returns its URL (the `pg_` tests:
/// one database per test, so they run side by side on one server).
#[doc(hidden)]
pub async fn create_test_database(url: &str, prefix: &str) -> Result<String, StoreError> {
    let name = format!("{prefix}_{}", uuid::Uuid::new_v4().simple());
    let options = PgConnectOptions::from_str(url).map_err(|e| StoreError(format!("a postgres URL that cannot be used: {}", redact(&e.to_string(), url))))?;
    let mut conn: sqlx::PgConnection = sqlx::Connection::connect_with(&options).await.map_err(|e| StoreError(format!("cannot reach the test server: {e}")))?;
    sqlx::query(&format!("CREATE DATABASE \"{name}\"")).execute(&mut conn).await.map_err(|e| StoreError(format!("cannot create a test database: {e}")))?;
    let mut u = reqwest::Url::parse(url).map_err(|e| StoreError(format!("a postgres URL that cannot be parsed: {e}")))?;
    u.set_path(&format!("/{name}"));
    Ok(u.to_string())
}

/// `e` without the URL's password, should a driver message echo it.
fn redact(e: &str, url: &str) -> String {
    match reqwest::Url::parse(url).ok().and_then(|u| u.password().map(str::to_owned)) {
        Some(p) if !p.is_empty() => e.replace(&p, "<redacted>"),
        _ => e.to_owned(),
    }
}

/// A count stored as PostgreSQL's `int8`: one past its range is stored as its largest.
pub(super) fn i64_of(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn col<'r, T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>>(r: &'r PgRow, c: &str) -> Result<T, String> {
    r.try_get(c).map_err(|e| format!("column {c}: {e}"))
}

fn parse_json<T: serde::de::DeserializeOwned>(r: &PgRow, c: &str) -> Result<Option<T>, String> {
    col::<Option<String>>(r, c)?.map(|s| serde_json::from_str(&s).map_err(|e| format!("column {c}: {e}"))).transpose()
}

impl Columns for PgRow {
    fn text(&self, c: &str) -> Result<Option<String>, String> {
        col(self, c)
    }
    fn int(&self, c: &str) -> Result<Option<i64>, String> {
        col(self, c)
    }
}

impl PgStore {
    /// Rows for listings: one unreadable row is reported and skipped, never taken for another
    /// run and never hiding the others.
    fn decode_rows(&self, rows: Vec<PgRow>) -> Vec<RunRow> {
        self.split_rows(&rows).0
    }

    /// The rows that decode, and the admission order (`seq`: an integer always reads, where the
    /// run id may be what is damaged) of those that do not (each reported).
    fn split_rows(&self, rows: &[PgRow]) -> (Vec<RunRow>, Vec<i64>) {
        let mut out = Vec::with_capacity(rows.len());
        let mut unreadable = Vec::new();
        for r in rows {
            match decode_row(r) {
                Ok(row) => out.push(row),
                Err(e) => {
                    let id: String = r.try_get("run_id").unwrap_or_default();
                    tracing::error!(store = %self.display, run_id = %id, error = %e, "unreadable run in the store; skipped");
                    unreadable.extend(r.try_get::<i64, _>("seq").ok());
                }
            }
        }
        (out, unreadable)
    }

    /// Rows this replica just claimed: the readable ones, in order; the unreadable ones are
    /// ended (see [`super::UNREADABLE_RUN`]) and their end notified, so they hold no key. A
    /// failure to end them is logged, not returned: the readable runs are this replica's now and
    /// must be continued (the unreadable ones stay unfinished for the next claim to end).
    async fn decode_claimed(&self, rows: Vec<PgRow>, replica: &str) -> Vec<RunRow> {
        let (out, unreadable) = self.split_rows(&rows);
        if !unreadable.is_empty() {
            let sql = format!(
                "WITH e AS (UPDATE runs SET status = 'error', error_code = 'internal', error_message = $3, finished_at = {DB_NOW_MS} \
                   WHERE seq = ANY($1) AND owner = $2 AND finished_at IS NULL RETURNING run_id) \
                 SELECT count(pg_notify($4, run_id)) FROM e"
            );
            let ended = sqlx::query_scalar::<_, i64>(&sql).bind(&unreadable).bind(replica).bind(super::UNREADABLE_RUN).bind(pg_shares::ENDED);
            if let Err(e) = self.bounded(async { ended.fetch_one(&self.pool).await.map_err(|e| self.err(e)) }).await {
                tracing::error!(error = %e, runs = unreadable.len(), "cannot end the unreadable runs just claimed; the next claim tries again");
            }
        }
        out
    }
}

type Tx<'a> = Transaction<'a, Postgres>;

/// Sorts and deduplicates the keys a batch locks or reads: one order for every batch's locks.
pub(super) fn sorted_unique<T: Ord>(keys: &mut Vec<T>) {
    keys.sort_unstable();
    keys.dedup();
}

/// `INSERT` of a run without an owner (a store no replica serves). `$15` and `$16` (owner, lease)
/// are bound but unused: one list of arguments serves both statements.
const INSERT_UNOWNED: &str = "INSERT INTO runs (run_id, idempotency_key, fingerprint, billing_account_id, state_key, session_key, spec, status, \
     checkpoint, content, created_at, key_id, webhook_url, usage, branch_key, trace_id, attribution_token) VALUES ($1, $2, $3, $4, $5, $6, $7, \
     $8, $9, $10, $11, $12, $13, $14, $17, $18, $19) ON CONFLICT DO NOTHING RETURNING seq, NULL::text AS assigned_to";

/// `INSERT` of a replica's new run. It is this replica's, unless an unfinished run of its session
/// key (or of its branch key) belongs to another replica or still waits for its owner to take it
/// up: then it goes to the owner of the earliest one, with that run's lease (a dead owner's runs of the key expire, and are
/// claimed, together), marked assigned. (The batch holds the keys' advisory locks: two replicas
/// admitting runs of one key decide one after the other.)
fn insert_owned() -> String {
    format!(
        "INSERT INTO runs (run_id, idempotency_key, fingerprint, billing_account_id, state_key, session_key, spec, status, \
           checkpoint, content, created_at, key_id, webhook_url, usage, owner, lease_until, assigned_at, branch_key, trace_id, attribution_token) \
         SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, \
           CASE WHEN k.pending THEN COALESCE(k.owner, $15) ELSE $15 END, \
           CASE WHEN k.pending AND k.owner IS DISTINCT FROM $15 THEN k.lease_until ELSE {DB_NOW_MS} + $16::bigint END, \
           CASE WHEN k.pending THEN {DB_NOW_MS} END, $17, $18, $19 \
         FROM (SELECT (array_agg(owner ORDER BY seq))[1] AS owner, (array_agg(lease_until ORDER BY seq))[1] AS lease_until, \
                 bool_or(owner IS DISTINCT FROM $15 OR assigned_at IS NOT NULL) AS pending \
               FROM runs WHERE finished_at IS NULL AND (session_key = $6 OR branch_key = $17)) k \
         ON CONFLICT DO NOTHING RETURNING seq, CASE WHEN assigned_at IS NOT NULL THEN owner END AS assigned_to"
    )
}

async fn insert(tx: &mut Tx<'_>, row: &RunRow, lease: Option<&Lease>) -> Result<Applied, sqlx::Error> {
    // A run with a branch key has two keys; `insert_owned` gives it to the owner of the earliest
    // unfinished run of either. When the two keys' runs are on two replicas, either choice would
    // run one key on two replicas at once (a session's runs side by side, or two runs on one
    // branch: its lock is per process). Refused; decided under the batch's advisory locks of
    // both keys, as the insert is.
    if let (Some(lease), Some(branch)) = (lease, &row.spec.branch) {
        let owners: Vec<Option<String>> = sqlx::query_scalar(
            "SELECT DISTINCT COALESCE(owner, $3) FROM runs WHERE finished_at IS NULL AND (session_key = $1 OR branch_key = $2)",
        )
        .bind(&row.session_key)
        .bind(&branch.key)
        .bind(&lease.replica)
        .fetch_all(&mut **tx)
        .await?;
        if owners.len() > 1 {
            return Ok(Applied::KeysOnTwoReplicas);
        }
    }
    let sql = match lease {
        Some(_) => insert_owned(),
        None => INSERT_UNOWNED.to_owned(),
    };
    // Indexed (see `pg_shares`): the LLM proxy of any replica finds the run by them.
    let trace_id = clawmux_protocol::TraceParent::parse(&row.spec.traceparent).ok().map(|t| t.trace_id().to_owned());
    let inserted: Option<(i64, Option<String>)> = sqlx::query_as(&sql)
    .bind(&row.run_id)
    .bind(&row.idempotency_key)
    .bind(&row.fingerprint)
    .bind(&row.billing_account_id)
    .bind(&row.state_key)
    .bind(&row.session_key)
    .bind(json(&row.spec))
    .bind(&row.status)
    .bind(row.checkpoint.as_ref().map(json))
    .bind(&row.content)
    .bind(row.created_at_ms)
    .bind(&row.key_id)
    .bind(&row.webhook_url)
    .bind(row.usage.as_ref().map(json))
    .bind(lease.map(|l| l.replica.clone()))
    .bind(lease.map(|l| l.ms))
    .bind(row.spec.branch.as_ref().map(|b| b.key.clone()))
    .bind(&trace_id)
    .bind(&row.spec.attribution_token)
    .fetch_optional(&mut **tx)
    .await?;
    match inserted {
        Some((seq, None)) => return Ok(Applied::Inserted { seq }),
        Some((seq, Some(owner))) => {
            // `ifBusy: reject`: refused here when it is its session key that is busy elsewhere
            // (not only its branch key), in this transaction, so its would-be owner never sees it.
            if row.spec.if_busy == super::BusyPolicy::Reject {
                let busy: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM runs WHERE session_key = $1 AND finished_at IS NULL AND run_id <> $2)")
                    .bind(&row.session_key)
                    .bind(&row.run_id)
                    .fetch_one(&mut **tx)
                    .await?;
                if busy {
                    sqlx::query("DELETE FROM runs WHERE run_id = $1").bind(&row.run_id).execute(&mut **tx).await?;
                    return Ok(Applied::SessionBusy);
                }
            }
            // Its owner is woken at commit (see `follow`).
            sqlx::query("SELECT pg_notify($1, $2)").bind(super::follow::ASSIGNED).bind(owner).execute(&mut **tx).await?;
            return Ok(Applied::Assigned { seq });
        }
        None => {}
    }
    // A constraint said no: which row won, and is it the same request?
    if let Some(key) = &row.idempotency_key {
        let existing: Option<(String, String)> =
            sqlx::query_as("SELECT run_id, fingerprint FROM runs WHERE billing_account_id = $1 AND idempotency_key = $2")
                .bind(&row.billing_account_id)
                .bind(key)
                .fetch_optional(&mut **tx)
                .await?;
        if let Some((id, fp)) = existing {
            return Ok(if fp == row.fingerprint { Applied::Existing { run_id: id } } else { Applied::IdempotencyMismatch });
        }
    }
    let existing: Option<String> = sqlx::query_scalar("SELECT fingerprint FROM runs WHERE run_id = $1").bind(&row.run_id).fetch_optional(&mut **tx).await?;
    Ok(match existing {
        Some(fp) if fp == row.fingerprint => Applied::Existing { run_id: row.run_id.clone() },
        Some(_) => Applied::Conflict,
        None => {
            // A live run (of any replica) with the same trace id or token: refused, its calls could
            // not be told apart from the other's.
            let holder: Option<String> = sqlx::query_scalar(
                "SELECT run_id FROM runs WHERE finished_at IS NULL AND (trace_id = $1 OR attribution_token = $2) ORDER BY seq LIMIT 1",
            )
            .bind(&trace_id)
            .bind(&row.spec.attribution_token)
            .fetch_optional(&mut **tx)
            .await?;
            match holder {
                Some(run_id) => Applied::TraceInUse { run_id },
                // The winner was deleted between the two statements (its admission failed): the
                // caller retries.
                None => return Err(sqlx::Error::Protocol("a conflicting run vanished during admission; retry".to_owned())),
            }
        }
    })
}

/// Events queued by a batch, inserted with one statement.
#[derive(Default)]
struct Events {
    /// Column `run_id`, one entry per event (UNNEST takes columns, not rows).
    run_ids: Vec<String>,
    /// Column `id`.
    ids: Vec<i64>,
    /// Column `name`.
    names: Vec<&'static str>,
    /// Column `data`.
    data: Vec<String>,
}

impl Events {
    fn push(&mut self, run_id: &str, e: &StoredEvent) {
        self.run_ids.push(run_id.to_owned());
        self.ids.push(i64_of(e.id));
        self.names.push(e.name.as_str());
        self.data.push(e.data.clone());
    }

    async fn flush(&mut self, tx: &mut Tx<'_>, notify: &mut HashSet<String>) -> Result<(), sqlx::Error> {
        if self.ids.is_empty() {
            return Ok(());
        }
        notify.extend(self.run_ids.iter().cloned());
        sqlx::query("INSERT INTO events (run_id, id, name, data) SELECT * FROM UNNEST($1::text[], $2::int8[], $3::text[], $4::text[])")
            .bind(&self.run_ids)
            .bind(&self.ids)
            .bind(&self.names)
            .bind(&self.data)
            .execute(&mut **tx)
            .await?;
        *self = Events::default();
        Ok(())
    }
}

async fn queue_webhook(tx: &mut Tx<'_>, run_id: &str, w: &super::NewDelivery) -> Result<(), sqlx::Error> {
    let now = super::now_ms();
    sqlx::query("INSERT INTO webhook_outbox (run_id, url, key_id, body, next_at, created_at) VALUES ($1, $2, $3, $4, $5, $6)")
        .bind(run_id)
        .bind(&w.url)
        .bind(&w.key_id)
        .bind(&w.body)
        .bind(now)
        .bind(now)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// One run's row changes of a batch: merged changes, the highest event id, the exact last event
/// id a `Fail` sets.
#[derive(Default)]
struct Pending {
    /// The batch's changes to the row, later ones winning.
    patch: RunPatch,
    /// The highest event id of the batch's changes (the column only moves forward).
    last_id: u64,
    /// The last event id a `Fail` sets exactly (events after it were dropped).
    exact: Option<u64>,
}

async fn update(tx: &mut Tx<'_>, run_id: &str, p: &Pending) -> Result<(), sqlx::Error> {
    let mut q: QueryBuilder<'_, Postgres> = QueryBuilder::new("UPDATE runs SET last_event_id = ");
    match p.exact {
        Some(id) => {
            q.push_bind(i64_of(id));
        }
        None => {
            q.push("GREATEST(last_event_id, ").push_bind(i64_of(p.last_id)).push(")");
        }
    }
    let (columns, finished_at) = patch_columns(&p.patch);
    for (col, v) in columns {
        q.push(format!(", {col} = ")).push_bind(v);
    }
    if let Some(v) = finished_at {
        q.push(", finished_at = ").push_bind(v);
    }
    q.push(" WHERE run_id = ").push_bind(run_id.to_owned());
    q.build().execute(&mut **tx).await?;
    Ok(())
}

/// The advisory lock name of a branch key (session keys are locked by their own name; a branch
/// key can never be mistaken for one: session keys start with `agent:`).
fn branch_lock(key: &str) -> String {
    format!("branch:{key}")
}


/// Takes the advisory locks of the batch's new runs, in one order (batches of two replicas never
/// wait on each other crosswise): their session and branch keys (replicas: admissions of one key
/// on two replicas, and a takeover of its runs, see each other; see `insert_owned`, `claim`), and
/// their billing accounts that have limits (two replicas never both admit the run that crosses
/// one; see `over_limit`).
async fn lock_keys(tx: &mut Tx<'_>, batch: &[Write], session_keys: bool, limited: &HashMap<String, AccountLimits>) -> Result<(), sqlx::Error> {
    let mut keys: Vec<String> = Vec::new();
    for w in batch {
        if let Write::Insert(row) = w {
            if session_keys {
                keys.push(row.session_key.clone());
                if let Some(b) = &row.spec.branch {
                    keys.push(branch_lock(&b.key));
                }
            }
            if limited.contains_key(&row.billing_account_id) {
                keys.push(account_lock(&row.billing_account_id));
            }
        }
    }
    if keys.is_empty() {
        return Ok(());
    }
    sorted_unique(&mut keys);
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended(k, 14)) FROM UNNEST($1::text[]) WITH ORDINALITY AS t(k, n) ORDER BY n")
        .bind(&keys)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The runs of the batch's writes that another replica owns now: their writes are dropped
/// (answered [`Applied::Fenced`]), so a replica that lost a run (its lease expired and another
/// took the run over) can no longer add events or change the row. The rows that are still ours
/// are locked until the batch commits (`FOR KEY SHARE`): a takeover (`FOR UPDATE SKIP LOCKED`)
/// passes them by until then, so it never reads a run's events while a batch of its old owner
/// is still adding to them. The key-share lock does not block renewals (`FOR NO KEY UPDATE`).
async fn fence(tx: &mut Tx<'_>, batch: &[Write], lease: &Lease) -> Result<HashSet<String>, sqlx::Error> {
    let mut ids: Vec<&str> = batch
        .iter()
        .filter_map(|w| match w {
            Write::Append { run_id, .. } | Write::Fail { run_id, .. } => Some(run_id.as_str()),
            _ => None,
        })
        .collect();
    if ids.is_empty() {
        return Ok(HashSet::new());
    }
    // One order for every batch's locks.
    sorted_unique(&mut ids);
    let rows: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT run_id, owner FROM runs WHERE run_id = ANY($1) ORDER BY run_id FOR KEY SHARE")
            .bind(&ids)
            .fetch_all(&mut **tx)
            .await?;
    // A run that is not there (yet: inserted by this batch) is no one else's.
    Ok(rows.into_iter().filter(|(_, owner)| owner.as_deref() != Some(lease.replica.as_str())).map(|(id, _)| id).collect())
}

impl PgStore {
    async fn apply_tx(&self, batch: &[Write]) -> Result<Vec<Applied>, sqlx::Error> {
        let mut tx = self.write_pool.begin().await?;
        let lease = self.lease.get();
        let limited = pg_limits::limits_of(&mut tx, batch).await?;
        let batch_spend = pg_limits::batch_spend(&mut tx, batch, &limited).await?;
        lock_keys(&mut tx, batch, lease.is_some(), &limited).await?;
        let fenced = match lease {
            Some(l) => fence(&mut tx, batch, l).await?,
            None => HashSet::new(),
        };
        let mut out = Vec::with_capacity(batch.len());
        // Row changes of the whole batch, coalesced: one update per run (later changes win).
        let mut order: Vec<&str> = Vec::new();
        let mut pending: HashMap<&str, Pending> = HashMap::new();
        let mut events = Events::default();
        // Runs that got events: other replicas' followers are told at commit (see `follow`).
        let mut notify: HashSet<String> = HashSet::new();
        // Billing records: spend (tokens per account and window) and audit records of LLM calls,
        // stored at the end, each once by its id (see `BillingId`).
        let mut spends: Vec<(&BillingId, (&str, i64), u64)> = Vec::new();
        let mut calls: Vec<(&BillingId, &crate::audit::AuditRecord)> = Vec::new();
        // This replica's usage shares (the last totals per run).
        let mut shares: BTreeMap<&str, crate::attribution::Usage> = BTreeMap::new();
        for w in batch {
            out.push(match w {
                Write::Insert(row) => {
                    events.flush(&mut tx, &mut notify).await?;
                    let applied = insert(&mut tx, row, lease).await?;
                    match (&applied, limited.get(&row.billing_account_id)) {
                        (Applied::Inserted { .. } | Applied::Assigned { .. }, Some(l)) => match pg_limits::over_limit(&mut tx, row, *l, &batch_spend).await? {
                            Some(refused) => {
                                sqlx::query("DELETE FROM runs WHERE run_id = $1").bind(&row.run_id).execute(&mut *tx).await?;
                                refused
                            }
                            None => applied,
                        },
                        _ => applied,
                    }
                }
                Write::Append { run_id, .. } | Write::Fail { run_id, .. } if fenced.contains(run_id.as_str()) => Applied::Fenced,
                Write::Append { run_id, event, patch, webhook } => {
                    if let Some(w) = webhook {
                        queue_webhook(&mut tx, run_id, w).await?;
                    }
                    if let Some(e) = event {
                        events.push(run_id, e);
                    }
                    // A delta changes no column of its run: its row is left alone.
                    if !patch.is_empty() {
                        let p = pending.entry(run_id.as_str()).or_insert_with(|| {
                            order.push(run_id.as_str());
                            Pending::default()
                        });
                        p.patch.merge(patch.clone());
                        if let Some(e) = event {
                            p.last_id = p.last_id.max(e.id);
                        }
                    }
                    Applied::Done
                }
                Write::Fail { run_id, event, patch, webhook } => {
                    events.flush(&mut tx, &mut notify).await?;
                    sqlx::query("DELETE FROM events WHERE run_id = $1 AND id >= $2").bind(run_id).bind(i64_of(event.id)).execute(&mut *tx).await?;
                    events.push(run_id, event);
                    if let Some(w) = webhook {
                        queue_webhook(&mut tx, run_id, w).await?;
                    }
                    let p = pending.entry(run_id.as_str()).or_insert_with(|| {
                        order.push(run_id.as_str());
                        Pending::default()
                    });
                    p.patch.merge(patch.clone());
                    p.exact = Some(event.id);
                    Applied::Done
                }
                Write::Spend { account, window_start_ms, tokens, id } => {
                    spends.push((id, (account.as_str(), *window_start_ms), *tokens));
                    Applied::Done
                }
                Write::Delete { run_id } => {
                    events.flush(&mut tx, &mut notify).await?;
                    sqlx::query("DELETE FROM events WHERE run_id = $1").bind(run_id).execute(&mut *tx).await?;
                    sqlx::query("DELETE FROM runs WHERE run_id = $1").bind(run_id).execute(&mut *tx).await?;
                    sqlx::query("DELETE FROM run_usage WHERE run_id = $1").bind(run_id).execute(&mut *tx).await?;
                    sqlx::query("DELETE FROM llm_calls WHERE run_id = $1").bind(run_id).execute(&mut *tx).await?;
                    pending.remove(run_id.as_str());
                    shares.remove(run_id.as_str());
                    Applied::Done
                }
                // Not fenced: this replica's proxy forwarded those calls, whoever owns the run.
                Write::Usage { run_id, usage } => {
                    shares.insert(run_id.as_str(), *usage);
                    Applied::Done
                }
                Write::LlmCall { id, record } => {
                    calls.push((id, record));
                    Applied::Done
                }
            });
        }
        events.flush(&mut tx, &mut notify).await?;
        // One order of row locks for every batch.
        order.sort_unstable();
        let mut ended: Vec<&str> = Vec::new();
        for run_id in order {
            if let Some(p) = pending.get(run_id) {
                update(&mut tx, run_id, p).await?;
                if p.patch.finished_at_ms.is_some() {
                    ended.push(run_id);
                }
            }
        }
        let me = lease.map_or("", |l| l.replica.as_str());
        pg_shares::store_shares(&mut tx, me, &shares).await?;
        let mut ids: Vec<&str> = spends.iter().map(|s| s.0 .0.as_str()).chain(calls.iter().map(|c| c.0 .0.as_str())).collect();
        sorted_unique(&mut ids);
        // Each id stores one record: taken out of the set as it is used.
        let mut new = pg_shares::new_billing_ids(&mut tx, &ids, super::now_ms()).await?;
        let calls: Vec<&crate::audit::AuditRecord> = calls.into_iter().filter(|(id, _)| new.remove(id.0.as_str())).map(|(_, r)| r).collect();
        pg_shares::store_calls(&mut tx, me, &calls).await?;
        pg_shares::notify_ended(&mut tx, &ended).await?;
        // Tokens per account and window, added in a fixed order: two replicas' batches never wait
        // on each other's spend rows in opposite orders.
        let mut spend: BTreeMap<(&str, i64), u64> = BTreeMap::new();
        for (_, key, tokens) in spends.into_iter().filter(|(id, _, _)| new.remove(id.0.as_str())) {
            let t = spend.entry(key).or_default();
            *t = t.saturating_add(tokens);
        }
        for ((account, window), tokens) in spend {
            sqlx::query(
                "INSERT INTO spend (billing_account_id, window_start, tokens) VALUES ($1, $2, $3) \
                 ON CONFLICT (billing_account_id, window_start) DO UPDATE SET tokens = LEAST(spend.tokens::numeric + excluded.tokens, 9223372036854775807)::int8",
            )
            .bind(account)
            .bind(window)
            .bind(i64_of(tokens))
            .execute(&mut *tx)
            .await?;
        }
        if !notify.is_empty() {
            let ids: Vec<String> = notify.into_iter().collect();
            sqlx::query("SELECT pg_notify($1, id) FROM UNNEST($2::text[]) AS id").bind(super::follow::CHANNEL).bind(&ids).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(out)
    }
}

#[async_trait::async_trait]
impl Store for PgStore {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    fn shared(&self) -> bool {
        true
    }

    async fn apply(&self, batch: &[Write]) -> Result<Vec<Applied>, StoreError> {
        let out = match tokio::time::timeout(self.answer_within(), self.apply_tx(batch)).await {
            Ok(r) => r.map_err(|e| self.apply_err(e))?,
            Err(_) => return Err(self.no_answer()),
        };
        self.unreachable.store(false, Ordering::Relaxed);
        Ok(out)
    }

    fn unreachable(&self) -> bool {
        self.unreachable.load(Ordering::Relaxed)
    }

    async fn run(&self, run_id: &str) -> Result<Option<RunRow>, StoreError> {
        let row = sqlx::query("SELECT * FROM runs WHERE run_id = $1").bind(run_id).fetch_optional(&self.pool).await.map_err(|e| self.err(e))?;
        let mut rows = row.map(|r| self.decode_rows(vec![r])).unwrap_or_default();
        pg_shares::sum_shares(&self.pool, &mut rows).await.map_err(|e| self.err(e))?;
        Ok(rows.pop())
    }

    async fn by_idempotency_key(&self, account: &str, key: &str) -> Result<Option<RunRow>, StoreError> {
        let row = sqlx::query("SELECT * FROM runs WHERE billing_account_id = $1 AND idempotency_key = $2")
            .bind(account)
            .bind(key)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(row.map(|r| self.decode_rows(vec![r])).unwrap_or_default().pop())
    }

    async fn raw_events(&self, run_id: &str, after: u64) -> Result<Vec<RawEvent>, StoreError> {
        let rows: Vec<(i64, String, String)> = sqlx::query_as("SELECT id, name, data FROM events WHERE run_id = $1 AND id > $2 ORDER BY id")
            .bind(run_id)
            .bind(i64_of(after))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(rows.into_iter().map(|(id, name, data)| RawEvent { id, name, data }).collect())
    }

    async fn list(&self, q: &ListQuery) -> Result<Vec<RunRow>, StoreError> {
        let mut b: QueryBuilder<'_, Postgres> = QueryBuilder::new("SELECT * FROM runs WHERE seq < ");
        b.push_bind(q.before_seq.unwrap_or(i64::MAX));
        if !q.statuses.is_empty() {
            b.push(" AND status = ANY(").push_bind(q.statuses.clone()).push(")");
        }
        if let Some(accounts) = &q.accounts {
            if accounts.is_empty() {
                return Ok(Vec::new());
            }
            b.push(" AND billing_account_id = ANY(").push_bind(accounts.clone()).push(")");
        }
        if let Some(a) = &q.billing_account_id {
            b.push(" AND billing_account_id = ").push_bind(a.clone());
        }
        if let Some(s) = &q.state_key {
            b.push(" AND state_key = ").push_bind(s.clone());
        }
        if let Some(t) = q.since_ms {
            b.push(" AND created_at >= ").push_bind(t);
        }
        b.push(" ORDER BY seq DESC LIMIT ").push_bind(i64::try_from(q.limit).unwrap_or(i64::MAX));
        let rows = b.build().fetch_all(&self.pool).await.map_err(|e| self.err(e))?;
        let mut rows = self.decode_rows(rows);
        pg_shares::sum_shares(&self.pool, &mut rows).await.map_err(|e| self.err(e))?;
        Ok(rows)
    }

    async fn schema(&self) -> Result<Option<SchemaVersion>, StoreError> {
        let applied = sqlx::query_scalar::<_, Option<i64>>("SELECT max(version) FROM _sqlx_migrations WHERE success")
            .fetch_one(&self.pool)
            .await
            .map_err(|e| self.err(e))?
            .unwrap_or_default();
        Ok(Some(SchemaVersion { applied, known: MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0) }))
    }

    async fn heartbeat(&self, r: &Replica) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO replicas (id, started_at, heartbeat_at, version) VALUES ($1, $2, $3, $4) ON CONFLICT (id) DO UPDATE \
             SET started_at = excluded.started_at, heartbeat_at = excluded.heartbeat_at, version = excluded.version",
        )
        .bind(&r.id)
        .bind(r.started_at_ms)
        .bind(r.heartbeat_at_ms)
        .bind(&r.version)
        .execute(&self.pool)
        .await
        .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn replicas(&self) -> Result<Option<Vec<Replica>>, StoreError> {
        let rows: Vec<(String, i64, i64, String)> =
            sqlx::query_as("SELECT id, started_at, heartbeat_at, version FROM replicas ORDER BY heartbeat_at DESC, id LIMIT 100")
                .fetch_all(&self.pool)
                .await
                .map_err(|e| self.err(e))?;
        Ok(Some(rows.into_iter().map(|(id, started_at_ms, heartbeat_at_ms, version)| Replica { id, started_at_ms, heartbeat_at_ms, version }).collect()))
    }

    fn set_lease(&self, lease: &Lease) {
        if self.lease.set(lease.clone()).is_err() {
            tracing::warn!("the run store's owner was set twice; the first one stays");
        }
    }

    async fn claim(&self, lease: &Lease, at_start: bool, held: &[String]) -> Result<Vec<RunRow>, StoreError> {
        // Row locks decide: a run locked by another claimer (or by a batch of its owner, see
        // `fence`) is passed by, so each run goes to exactly one claimer. The runs of one session
        // key go together: a claimer takes the key's advisory lock (until it commits) before it
        // takes any of its runs, and a concurrent claimer that cannot get it leaves them all, so
        // their admission order is continued by one replica. (The CASE guards the order of
        // evaluation: only expired runs' keys are locked.)
        // Later, its own expired runs it holds no log of: a claim whose continuation failed after
        // it committed (a read of their events, say) left them owned here and renewed by nobody.
        let mine = if at_start { "owner = $1 OR ".to_owned() } else { format!("(owner = $1 AND lease_until < {DB_NOW_MS}) OR ") };
        // Never a run this replica holds a live log of (`held`), whoever owns its row now: a run
        // taken over while this replica's renewals failed, whose new owner's lease lapsed in turn,
        // would be continued a second time here beside its first actor (the new log ended at once
        // by the duplicate, and the old actor going on unseen, billed and uncounted). The next
        // renewal reports it lost instead, and a later takeover continues it from the store.
        // Nor another replica's run of a held run's session or branch key: claimed here while the
        // held one goes elsewhere, the key's runs would run on two replicas at once. (Runs
        // assigned here are of held keys by design: they wait here behind them.) `NOT IN` over
        // the held runs' keys, read once: a hashed lookup per row, whatever the number held.
        let (not_held, others_not_of_held_keys, held_keys) = if at_start {
            ("", "", "")
        } else {
            (
                "NOT (run_id = ANY($3)) AND ",
                " AND session_key NOT IN (SELECT session_key FROM held_keys) AND \
                 (branch_key IS NULL OR branch_key NOT IN (SELECT branch_key FROM held_keys WHERE branch_key IS NOT NULL))",
                "held_keys AS (SELECT session_key, branch_key FROM runs WHERE run_id = ANY($3)), ",
            )
        };
        // Runs other replicas admitted for this one (assigned) are taken up here too.
        let sql = format!(
            "WITH {held_keys}c AS (SELECT run_id, assigned_at IS NOT NULL AS was_assigned FROM runs WHERE finished_at IS NULL AND CASE WHEN {not_held}({mine}(owner = $1 AND assigned_at IS NOT NULL) \
               OR ((owner IS DISTINCT FROM $1) AND (lease_until IS NULL OR lease_until < {DB_NOW_MS}){others_not_of_held_keys})) \
               THEN pg_try_advisory_xact_lock(hashtextextended(session_key, 14)) AND (branch_key IS NULL OR \
                 pg_try_advisory_xact_lock(hashtextextended('branch:' || branch_key, 14))) ELSE false END ORDER BY seq FOR UPDATE SKIP LOCKED) \
             UPDATE runs r SET owner = $1, lease_until = {DB_NOW_MS} + $2::bigint, assigned_at = NULL, \
               claims = r.claims + CASE WHEN r.owner IS DISTINCT FROM $1 THEN 1 ELSE 0 END FROM c \
             WHERE r.run_id = c.run_id RETURNING r.*, c.was_assigned"
        );
        let rows = self
            .bounded(async {
                let q = sqlx::query(&sql).bind(&lease.replica).bind(lease.ms);
                let q = if at_start { q } else { q.bind(held) };
                q.fetch_all(&self.pool).await.map_err(|e| self.err(e))
            })
            .await?;
        let assigned: HashSet<String> = rows
            .iter()
            .filter(|r| r.try_get::<bool, _>("was_assigned").unwrap_or(false))
            .filter_map(|r| r.try_get::<String, _>("run_id").ok())
            .collect();
        let mut rows = self.decode_claimed(rows, &lease.replica).await;
        // `ifBusy: interrupt` is done once, when the replica its session key runs on first takes
        // the run up; a run claimed again (a restart, a takeover) does not interrupt again.
        for r in &mut rows {
            if !assigned.contains(&r.run_id) {
                r.spec.if_busy = r.spec.if_busy.after_take_up();
            }
        }
        rows.sort_by_key(|r| r.seq);
        pg_shares::sum_shares(&self.pool, &mut rows).await.map_err(|e| self.err(e))?;
        Ok(rows)
    }

    async fn renew(&self, lease: &Lease, live: &[String]) -> Result<Renewed, StoreError> {
        // One statement: the runs this replica holds, and those assigned to it and not yet taken
        // up (they wait behind runs of their keys it holds), are renewed (a row locked right now,
        // by a takeover or a batch's delete, is renewed next time rather than waited for: a
        // renewal never waits, so it never deadlocks with a batch); the SELECT sees the rows as
        // they were before (one snapshot), which is what decides lost runs and aborts.
        let sql = format!(
            "WITH l AS (SELECT run_id FROM runs WHERE owner = $1 AND finished_at IS NULL AND (run_id = ANY($3) OR assigned_at IS NOT NULL) \
               FOR NO KEY UPDATE SKIP LOCKED), \
             renewed AS (UPDATE runs r SET lease_until = {DB_NOW_MS} + $2::bigint FROM l WHERE r.run_id = l.run_id) \
             SELECT run_id, owner IS DISTINCT FROM $1 AS lost, abort_reason FROM runs WHERE run_id = ANY($3) AND finished_at IS NULL \
               AND (owner IS DISTINCT FROM $1 OR abort_requested_at IS NOT NULL)"
        );
        let rows: Vec<(String, bool, Option<String>)> =
            self.bounded(async { sqlx::query_as(&sql).bind(&lease.replica).bind(lease.ms).bind(live).fetch_all(&self.pool).await.map_err(|e| self.err(e)) }).await?;
        let mut out = Renewed::default();
        for (id, lost, reason) in rows {
            if lost { out.lost.push(id) } else { out.aborts.push((id, AbortReason::parse(reason.as_deref()))) }
        }
        Ok(out)
    }

    async fn readopt(&self, lease: &Lease, run_ids: &[String]) -> Result<Vec<RunRow>, StoreError> {
        // Row locks: a takeover claiming one of them at this moment either commits first (the
        // owner is then no longer this replica) or waits for this statement.
        let sql = format!(
            "UPDATE runs SET lease_until = {DB_NOW_MS} + $2::bigint WHERE owner = $1 AND run_id = ANY($3) AND finished_at IS NULL RETURNING *"
        );
        let rows = self.bounded(async { sqlx::query(&sql).bind(&lease.replica).bind(lease.ms).bind(run_ids).fetch_all(&self.pool).await.map_err(|e| self.err(e)) }).await?;
        let mut rows = self.decode_rows(rows);
        for r in &mut rows {
            r.spec.if_busy = r.spec.if_busy.after_take_up();
        }
        rows.sort_by_key(|r| r.seq);
        // Its usage is the replicas' shares, as for any run read (the row's own column is not
        // kept up to date): the document of the run taken back shows them until its billing is
        // registered again, and that billing continues from them.
        pg_shares::sum_shares(&self.pool, &mut rows).await.map_err(|e| self.err(e))?;
        Ok(rows)
    }

    async fn release(&self, lease: &Lease) -> Result<u64, StoreError> {
        // Expired, not ownerless: the same id starting again still counts them as its own.
        let r = sqlx::query("UPDATE runs SET lease_until = 0 WHERE owner = $1 AND finished_at IS NULL")
            .bind(&lease.replica)
            .execute(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(r.rows_affected())
    }

    async fn request_abort(&self, run_id: &str, reason: AbortReason) -> Result<bool, StoreError> {
        // One statement: the abort and the owner's wake-up (it acts on it at once, its renewal runs
        // when told, not a third of a lease later) are stored together or not at all.
        // (The second count is returned so that the notification is sent: a CTE nobody reads is
        // not run.)
        let (recorded, _notified): (i64, i64) = sqlx::query_as(&format!(
            "WITH a AS (UPDATE runs SET abort_requested_at = COALESCE(abort_requested_at, {DB_NOW_MS}), abort_reason = COALESCE(abort_reason, $2) \
               WHERE run_id = $1 AND finished_at IS NULL RETURNING owner), \
             n AS (SELECT pg_notify($3, owner) FROM a WHERE owner IS NOT NULL) \
             SELECT (SELECT count(*) FROM a), (SELECT count(*) FROM n)"
        ))
        .bind(run_id)
        .bind(reason.stored())
        .bind(pg_shares::ABORT)
        .fetch_one(&self.pool)
        .await
        .map_err(|e| self.err(e))?;
        Ok(recorded > 0)
    }

    async fn live_run(&self, key: &CallKey) -> Result<Option<LiveRun>, StoreError> {
        let me = self.lease.get().map_or("", |l| l.replica.as_str());
        pg_shares::live_run(&self.pool, key, me).await.map_err(|e| self.err(e))
    }

    async fn usage_shares(&self, run_id: &str, stored: Option<crate::attribution::Usage>) -> Result<UsageShares, StoreError> {
        let me = self.lease.get().map_or("", |l| l.replica.as_str());
        pg_shares::shares_of(&self.pool, run_id, stored, me).await.map_err(|e| self.err(e))
    }

    async fn ended(&self, run_ids: &[String]) -> Result<Vec<String>, StoreError> {
        // Bounded like the lease statements: the lease loop asks it for the runs it lost.
        self.bounded(async { pg_shares::ended(&self.pool, run_ids).await.map_err(|e| self.err(e)) }).await
    }

    async fn llm_calls(&self, run_id: &str, limit: usize) -> Result<Option<(Vec<crate::audit::LlmCall>, bool)>, StoreError> {
        pg_shares::calls_of(&self.pool, run_id, limit).await.map(Some).map_err(|e| self.err(e))
    }

    async fn unfinished(&self) -> Result<Vec<RunRow>, StoreError> {
        let rows = sqlx::query("SELECT * FROM runs WHERE finished_at IS NULL ORDER BY seq").fetch_all(&self.pool).await.map_err(|e| self.err(e))?;
        let mut rows = self.decode_rows(rows);
        pg_shares::sum_shares(&self.pool, &mut rows).await.map_err(|e| self.err(e))?;
        Ok(rows)
    }

    async fn sweep(&self, retention: Retention, now_ms: i64) -> Result<Vec<String>, StoreError> {
        let cutoff = now_ms.saturating_sub(retention.max_age_ms);
        let max = i64::try_from(retention.max_count).unwrap_or(i64::MAX);
        // Past the age, and beyond the newest `max_count` finished runs of their billing account
        // (numbered along `runs_account_finished`: no sort of every finished run); events, usage shares and call records first,
        // in the same statement. Now and then (see `ORPHANS_EVERY`) also the shares and call
        // records of runs that are gone (a proxy's record written after its run was swept, or
        // deleted as a refused admission, would stay forever): that looks at every such row.
        let orphans = {
            let mut last = self.orphans_swept.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let due = last.is_none_or(|t| t.elapsed() >= ORPHANS_EVERY);
            if due {
                *last = Some(std::time::Instant::now());
            }
            due
        };
        let (usage_orphans, call_orphans) = if orphans {
            (
                " OR NOT EXISTS (SELECT 1 FROM runs r WHERE r.run_id = u.run_id)",
                " OR NOT EXISTS (SELECT 1 FROM runs r WHERE r.run_id = c.run_id)",
            )
        } else {
            ("", "")
        };
        let gone = sqlx::query_scalar(&format!(
            "WITH doomed AS (SELECT run_id FROM (SELECT run_id, finished_at, ROW_NUMBER() OVER (PARTITION BY \
               billing_account_id ORDER BY finished_at DESC, seq DESC) AS nth FROM runs WHERE finished_at IS NOT NULL) n \
               WHERE finished_at <= $1 OR nth > $2), \
             gone_events AS (DELETE FROM events WHERE run_id IN (SELECT run_id FROM doomed)), \
             gone_usage AS (DELETE FROM run_usage u WHERE u.run_id IN (SELECT run_id FROM doomed){usage_orphans}), \
             gone_calls AS (DELETE FROM llm_calls c WHERE c.run_id IN (SELECT run_id FROM doomed){call_orphans}) \
             DELETE FROM runs WHERE run_id IN (SELECT run_id FROM doomed) RETURNING run_id",
        ))
        .bind(cutoff)
        .bind(max)
        .fetch_all(&self.pool)
        .await
        .map_err(|e| self.err(e))?;
        sqlx::query("DELETE FROM billing_writes WHERE written_at < $1")
            .bind(now_ms.saturating_sub(pg_shares::BILLING_IDS_KEPT_MS))
            .execute(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(gone)
    }
}

fn decode_key(r: &PgRow) -> Result<KeyRecord, String> {
    let list = |c: &str| -> Result<Vec<String>, String> { parse_json(r, c).map(Option::unwrap_or_default) };
    Ok(KeyRecord {
        id: col(r, "id")?,
        name: col(r, "name")?,
        secret_sha256: col(r, "secret_sha256")?,
        accounts: list("accounts")?,
        actions: list("actions")?,
        webhook_secret: col(r, "webhook_secret")?,
        webhook_url: col(r, "webhook_url")?,
        created_at_ms: col(r, "created_at")?,
        revoked_at_ms: col(r, "revoked_at")?,
        created_by: col(r, "created_by")?,
    })
}

fn decode_limits(r: &PgRow) -> Result<Limits, String> {
    let n = |c: &str| -> Result<Option<u64>, String> { Ok(col::<Option<i64>>(r, c)?.map(|v| u64::try_from(v).unwrap_or(0))) };
    Ok(Limits { max_tokens: n("max_tokens")?, period_sec: n("period_sec")?, max_concurrent: n("max_concurrent")?, max_runs_per_minute: n("max_runs_per_minute")? })
}

fn opt_i64(v: Option<u64>) -> Option<i64> {
    v.map(i64_of)
}

impl PgStore {
    async fn keys_where(&self, sql: &str, arg: Option<&str>) -> Result<Vec<KeyRecord>, StoreError> {
        let mut q = sqlx::query(sql);
        if let Some(a) = arg {
            q = q.bind(a.to_owned());
        }
        let rows = q.fetch_all(&self.pool).await.map_err(|e| self.err(e))?;
        rows.iter().map(|r| decode_key(r).map_err(|e| self.err(format!("holds an unreadable key: {e}")))).collect()
    }
}

#[async_trait::async_trait]
impl TenantStore for PgStore {
    async fn create_key(&self, key: &KeyRecord) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO api_keys (id, name, secret_sha256, accounts, actions, webhook_secret, webhook_url, created_at, created_by) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(&key.id)
        .bind(&key.name)
        .bind(&key.secret_sha256)
        .bind(json(&key.accounts))
        .bind(json(&key.actions))
        .bind(&key.webhook_secret)
        .bind(&key.webhook_url)
        .bind(key.created_at_ms)
        .bind(&key.created_by)
        .execute(&self.pool)
        .await
        .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn key(&self, id: &str) -> Result<Option<KeyRecord>, StoreError> {
        Ok(self.keys_where("SELECT * FROM api_keys WHERE id = $1", Some(id)).await?.pop())
    }

    async fn claim_branch(&self, branch_key: &str, account: &str, at_ms: i64, claim: &str) -> Result<BranchClaim, StoreError> {
        // One upsert: its conflict path locks and answers the row another replica committed while
        // it waited (a plain read would see the snapshot taken before).
        let (owner, first): (String, Option<String>) = sqlx::query_as(
            "INSERT INTO branch_owners (branch_key, billing_account_id, claimed_at, first_claim, last_claim) VALUES ($1, $2, $3, $4, $4) \
             ON CONFLICT (branch_key) DO UPDATE SET last_claim = CASE WHEN branch_owners.billing_account_id = EXCLUDED.billing_account_id \
             THEN EXCLUDED.last_claim ELSE branch_owners.last_claim END RETURNING billing_account_id, first_claim",
        )
        .bind(branch_key)
        .bind(account)
        .bind(at_ms)
        .bind(claim)
        .fetch_one(&self.pool)
        .await
        .map_err(|e| self.err(e))?;
        Ok(BranchClaim { owner, claimed_now: first.as_deref() == Some(claim) })
    }

    async fn branch_owner(&self, branch_key: &str) -> Result<Option<String>, StoreError> {
        self.bounded(async {
            sqlx::query_scalar("SELECT billing_account_id FROM branch_owners WHERE branch_key = $1").bind(branch_key).fetch_optional(&self.pool).await.map_err(|e| self.err(e))
        })
        .await
    }

    async fn release_branch(&self, branch_key: &str, claim: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM branch_owners WHERE branch_key = $1 AND last_claim = $2").bind(branch_key).bind(claim).execute(&self.pool).await.map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn keys(&self) -> Result<Vec<KeyRecord>, StoreError> {
        self.keys_where("SELECT * FROM api_keys ORDER BY created_at, id", None).await
    }

    async fn revoke_key(&self, id: &str, at_ms: i64) -> Result<bool, StoreError> {
        // The key, the keys it created, theirs, ... A key written while this runs may be missed
        // (the statement sees the rows of its snapshot): it is refused at authentication all the
        // same, its maker being revoked (`tenants::makers_live`).
        let r = sqlx::query(
            "WITH RECURSIVE made(id) AS (SELECT id FROM api_keys WHERE id = $2 \
               UNION SELECT k.id FROM api_keys k JOIN made m ON k.created_by = m.id) \
             UPDATE api_keys SET revoked_at = COALESCE(revoked_at, $1) WHERE id IN (SELECT id FROM made)",
        )
        .bind(at_ms)
        .bind(id)
            .execute(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(r.rows_affected() > 0)
    }

    async fn limits(&self, account: &str) -> Result<Option<Limits>, StoreError> {
        let row = sqlx::query("SELECT * FROM account_limits WHERE billing_account_id = $1")
            .bind(account)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        row.map(|r| decode_limits(&r).map_err(|e| self.err(e))).transpose()
    }

    async fn all_limits(&self) -> Result<Vec<(String, Limits)>, StoreError> {
        let rows = sqlx::query("SELECT * FROM account_limits ORDER BY billing_account_id").fetch_all(&self.pool).await.map_err(|e| self.err(e))?;
        rows.iter()
            .map(|r| Ok((col::<String>(r, "billing_account_id").map_err(|e| self.err(e))?, decode_limits(r).map_err(|e| self.err(e))?)))
            .collect()
    }

    async fn set_limits(&self, account: &str, l: &Limits, at_ms: i64) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO account_limits (billing_account_id, max_tokens, period_sec, max_concurrent, max_runs_per_minute, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (billing_account_id) DO UPDATE SET max_tokens = excluded.max_tokens, \
             period_sec = excluded.period_sec, max_concurrent = excluded.max_concurrent, \
             max_runs_per_minute = excluded.max_runs_per_minute, updated_at = excluded.updated_at",
        )
        .bind(account)
        .bind(opt_i64(l.max_tokens))
        .bind(opt_i64(l.period_sec))
        .bind(opt_i64(l.max_concurrent))
        .bind(opt_i64(l.max_runs_per_minute))
        .bind(at_ms)
        .execute(&self.pool)
        .await
        .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn spend(&self, account: &str, window_start_ms: i64) -> Result<u64, StoreError> {
        let v: Option<i64> = sqlx::query_scalar("SELECT tokens FROM spend WHERE billing_account_id = $1 AND window_start = $2")
            .bind(account)
            .bind(window_start_ms)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(v.map_or(0, |v| u64::try_from(v).unwrap_or(0)))
    }

    async fn due_deliveries(&self, now_ms: i64, limit: usize) -> Result<Vec<OutboxItem>, StoreError> {
        // A plain read: each attempt first takes its item (`claim_delivery`), so replicas share
        // the outbox without sending a webhook twice.
        let rows: Vec<(i64, String, String, Option<String>, String, i64, i64)> = sqlx::query_as(
            "SELECT id, run_id, url, key_id, body, attempts, created_at FROM \
             (SELECT o.id, o.run_id, o.url, o.key_id, o.body, o.attempts, o.created_at, \
              d.nth, ROW_NUMBER() OVER (PARTITION BY d.nth, o.attempts > 0 ORDER BY o.id) AS k FROM webhook_outbox o JOIN \
              (SELECT id, ROW_NUMBER() OVER (PARTITION BY key_id ORDER BY id) AS nth FROM webhook_outbox \
               WHERE delivered_at IS NULL AND gave_up_at IS NULL AND next_at <= $1) d ON d.id = o.id \
              WHERE d.nth <= $3) x ORDER BY nth, k, attempts > 0, id LIMIT $2",
        )
        .bind(now_ms)
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .bind(i64::try_from(super::tenants::DUE_PER_KEY).unwrap_or(i64::MAX))
        .fetch_all(&self.pool)
        .await
        .map_err(|e| self.err(e))?;
        Ok(rows
            .into_iter()
            .map(|(id, run_id, url, key_id, body, attempts, created_at_ms)| OutboxItem {
                id,
                run_id,
                url,
                key_id,
                body,
                attempts: u32::try_from(attempts).unwrap_or(u32::MAX),
                created_at_ms,
            })
            .collect())
    }

    async fn claim_delivery(&self, id: i64, now_ms: i64, until_ms: i64) -> Result<bool, StoreError> {
        // Row lock: of two replicas claiming at once, the second re-checks `next_at` after the
        // first commits and finds the delivery no longer due.
        let done = sqlx::query(
            "UPDATE webhook_outbox SET next_at = $3 WHERE id = $1 AND next_at <= $2 AND delivered_at IS NULL AND gave_up_at IS NULL",
        )
        .bind(id)
        .bind(now_ms)
        .bind(until_ms)
        .execute(&self.pool)
        .await
        .map_err(|e| self.err(e))?;
        Ok(done.rows_affected() == 1)
    }

    async fn record_delivery(&self, id: i64, outcome: &DeliveryOutcome, at_ms: i64) -> Result<(), StoreError> {
        let q = match outcome {
            DeliveryOutcome::Delivered => sqlx::query("UPDATE webhook_outbox SET attempts = attempts + 1, delivered_at = $1 WHERE id = $2").bind(at_ms).bind(id),
            DeliveryOutcome::Retry { next_at_ms, error } => {
                sqlx::query("UPDATE webhook_outbox SET attempts = attempts + 1, next_at = $1, last_error = $2 WHERE id = $3").bind(*next_at_ms).bind(error.clone()).bind(id)
            }
            DeliveryOutcome::GaveUp { error } => {
                sqlx::query("UPDATE webhook_outbox SET attempts = attempts + 1, gave_up_at = $1, last_error = $2 WHERE id = $3").bind(at_ms).bind(error.clone()).bind(id)
            }
        };
        q.execute(&self.pool).await.map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn deliveries_of(&self, run_id: &str) -> Result<Vec<(u32, bool, bool, Option<String>)>, StoreError> {
        let rows: Vec<(i64, Option<i64>, Option<i64>, Option<String>)> =
            sqlx::query_as("SELECT attempts, delivered_at, gave_up_at, last_error FROM webhook_outbox WHERE run_id = $1 ORDER BY id")
                .bind(run_id)
                .fetch_all(&self.pool)
                .await
                .map_err(|e| self.err(e))?;
        Ok(rows.into_iter().map(|(a, d, g, e)| (u32::try_from(a).unwrap_or(u32::MAX), d.is_some(), g.is_some(), e)).collect())
    }
}
