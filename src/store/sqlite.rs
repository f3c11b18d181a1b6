//! `sqlite://PATH`: the default run store. WAL journal (readers never wait for the writer),
//! `synchronous = NORMAL` (a commit survives a crash of clawmux; the last commits before a power
//! loss may not), one write connection shared by the group-commit writer's lanes (its main lane's
//! thread, and each shard's: a shard commits its runs' writes on its own thread), a small pool of
//! read connections, checkpoints in the background (finished with the writer paused once
//! the WAL grew, so that it restarts: [`checkpoint_round`]). The schema is created and migrated at
//! start from `migrations/sqlite/` (its version in `PRAGMA user_version`).
//!
//! rusqlite, not an async driver: a commit is local work, and costs ~30 µs
//! synchronously against ~600 µs through sqlx's per-statement hops to its worker thread (measured
//! by the `probe` below), which at a thousand concurrent runs was the added latency of every event.
//! Reads are short (by primary key, or a page of at most 500 rows) and run on the caller's thread.

use super::tenants::{BranchClaim, DeliveryOutcome, KeyRecord, Limits, OutboxItem, TenantStore};
use super::columns::{decode_row, json_text as json, patch_columns, Columns};
use super::sqlite_events::{self, LiveRows};
use super::{Applied, ListQuery, RawEvent, Retention, RunPatch, RunRow, SchemaVersion, Store, StoreError, Write};
use rusqlite::types::Value as SqlValue;
use rusqlite::{params, params_from_iter, Connection, OpenFlags, OptionalExtension, Row, Transaction, TransactionBehavior};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

/// The schema, in order; `PRAGMA user_version` says how many are applied.
pub(crate) const MIGRATIONS: [&str; 8] = [
    include_str!("../../migrations/sqlite/0001_runs.sql"),
    include_str!("../../migrations/sqlite/0002_tenants.sql"),
    include_str!("../../migrations/sqlite/0003_idempotency_per_account.sql"),
    include_str!("../../migrations/sqlite/0004_event_log.sql"),
    include_str!("../../migrations/sqlite/0005_branch_owners.sql"),
    include_str!("../../migrations/sqlite/0006_retention_per_account.sql"),
    include_str!("../../migrations/sqlite/0007_branch_claims.sql"),
    include_str!("../../migrations/sqlite/0008_key_creators.sql"),
];

/// How often the WAL is checkpointed into the database file.
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);

/// WAL frames a checkpoint may leave behind before the next one pauses the writer to finish it
/// (see [`checkpoint_round`]): about 4 MiB of 4 KiB pages.
const WAL_RESTART_FRAMES: i64 = 1000;

/// A WAL that grew past this while it could not restart (a long read) is cut back to it when it
/// restarts.
const WAL_SIZE_LIMIT: i64 = 64 * 1024 * 1024;

/// Read connections kept open.
const READ_POOL: usize = 4;

/// The SQLite store.
pub struct SqliteStore {
    path: PathBuf,
    /// The one write connection (the group-commit writer, and the rare tenant writes); shared
    /// with the checkpoint thread, which pauses the writer to let the WAL restart.
    write: Arc<Mutex<Connection>>,
    /// Idle read connections.
    read: Mutex<Vec<Connection>>,
    /// Where the events of the runs not finished are (the event log has no index: see
    /// [`sqlite_events`]).
    live: LiveRows,
}

/// The lock when it is free (`None`: held by someone else).
fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn configure(c: &Connection) -> rusqlite::Result<()> {
    c.busy_timeout(Duration::from_secs(5))?;
    // 64 MiB of page cache: the pages live runs append to stay in memory.
    c.pragma_update(None, "cache_size", -65536)?;
    c.pragma_update(None, "synchronous", "NORMAL")?;
    Ok(())
}

impl SqliteStore {
    /// Opens (creating it on first start) the store at `path` and migrates its schema. Every
    /// error names the file.
    pub async fn open(path: &Path) -> Result<Self, StoreError> {
        let fail = |what: &str, e: &dyn std::fmt::Display| StoreError(format!("the run store {} {what}: {e}", path.display()));
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| fail("cannot be created", &e))?;
        }
        let mut write = Connection::open(path).map_err(|e| fail("cannot be opened", &e))?;
        configure(&write).map_err(|e| fail("cannot be opened", &e))?;
        let mode: String = write
            .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
            .map_err(|e| fail("cannot be opened", &e))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(fail("cannot be opened", &format!("journal mode {mode} instead of WAL")));
        }
        // Checkpoints run in the background (below), not inside the writer's commits, where they
        // stalled a commit every thousand pages.
        write.pragma_update(None, "wal_autocheckpoint", 0).map_err(|e| fail("cannot be opened", &e))?;
        migrate(&mut write).map_err(|e| fail("cannot be set up", &e))?;
        // SQLite opens a file it may not write (read-only mount, immutable file, no permission)
        // read-only without a word, and every run would fail later: one committed write now makes
        // such a store stop startup instead.
        probe_write(&mut write).map_err(|e| fail("cannot be written", &e))?;
        // A quick read of the schema catches a file that is a database but not ours (or damaged).
        write
            .query_row("SELECT count(*) FROM runs", [], |r| r.get::<_, i64>(0))
            .map_err(|e| fail("cannot be read", &e))?;
        write.pragma_update(None, "journal_size_limit", WAL_SIZE_LIMIT).map_err(|e| fail("cannot be opened", &e))?;
        let live = LiveRows::rebuild(&write).map_err(|e| fail("cannot be read", &e))?;
        let checkpoint = Connection::open(path).map_err(|e| fail("cannot be opened for checkpoints", &e))?;
        configure(&checkpoint).map_err(|e| fail("cannot be opened for checkpoints", &e))?;
        let store = Self { path: path.to_owned(), write: Arc::new(Mutex::new(write)), read: Mutex::new(Vec::new()), live };
        let writer = Arc::downgrade(&store.write);
        std::thread::Builder::new()
            .name("clawmux-checkpoint".to_owned())
            .spawn(move || loop {
                std::thread::sleep(CHECKPOINT_EVERY);
                // The store is gone: so is the reason to checkpoint (and this thread's connection).
                if writer.strong_count() == 0 {
                    return;
                }
                if let Err(e) = checkpoint_round(&checkpoint, &writer, || ()) {
                    tracing::warn!(error = %e, "run store checkpoint failed");
                }
            })
            .map_err(|e| fail("cannot start its checkpoint thread", &e))?;
        Ok(store)
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True while the places of `run_id`'s events are kept in memory (a run in flight).
    #[cfg(test)]
    pub fn keeps_places_of(&self, run_id: &str) -> bool {
        self.live.keeps(run_id)
    }

    fn err(&self, e: impl std::fmt::Display) -> StoreError {
        StoreError(format!("the run store {}: {e}", self.path.display()))
    }

    /// Runs `f` on an idle read connection (opened read-only on demand, kept up to [`READ_POOL`]).
    fn read<T>(&self, f: impl FnOnce(&Connection) -> rusqlite::Result<T>) -> Result<T, StoreError> {
        let conn = lock(&self.read).pop();
        let conn = match conn {
            Some(c) => c,
            None => {
                let c = Connection::open_with_flags(&self.path, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
                    .map_err(|e| self.err(e))?;
                configure(&c).map_err(|e| self.err(e))?;
                c
            }
        };
        let out = f(&conn).map_err(|e| self.err(e));
        let mut pool = lock(&self.read);
        if pool.len() < READ_POOL {
            pool.push(conn);
        }
        out
    }
}

/// One checkpoint of the WAL into the database file, in two steps.
///
/// SQLite writes the WAL from its start again (reuses it) only once a checkpoint has copied every
/// frame in it, and a checkpoint running beside a steady stream of commits never has: at 1,000
/// concurrent runs the WAL grew without bound (300 MB for 2,000 runs), every commit extending the
/// file, which the file system zeroes block by block (15% of clawmux's CPU in `perf`). So first a
/// PASSIVE checkpoint copies what is there without stopping the writer (the bulk, and its
/// fsyncs); then, when the WAL has grown past [`WAL_RESTART_FRAMES`] since it last restarted, a
/// second one on the writer's own connection, holding it between two batches, copies just what was
/// committed meanwhile: it completes (unless a reader still needs old frames), and the next commit
/// restarts the WAL. `between` runs between the two (a test's commit; nothing otherwise).
fn checkpoint_round(checkpoint: &Connection, writer: &Weak<Mutex<Connection>>, between: impl FnOnce()) -> rusqlite::Result<()> {
    // PASSIVE: copies what no reader needs, never blocks the writer. Its row: busy, frames in the
    // WAL (when it started: commits made while it copies come after them), frames copied.
    let log: i64 = checkpoint.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| r.get(1))?;
    between();
    if log <= WAL_RESTART_FRAMES {
        // A quiet store: the WAL restarts by itself after a round no commit came between.
        return Ok(());
    }
    let Some(write) = writer.upgrade() else { return Ok(()) };
    let conn = lock(&write);
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
}

fn migrate(c: &mut Connection) -> rusqlite::Result<()> {
    let version: usize = c.query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0)).map(|v| usize::try_from(v).unwrap_or(0))?;
    if version > MIGRATIONS.len() {
        return Err(rusqlite::Error::InvalidParameterName(format!(
            "schema version {version} is newer than this clawmux knows ({}): an older build cannot open it",
            MIGRATIONS.len()
        )));
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(version) {
        let tx = c.transaction()?;
        tx.execute_batch(sql)?;
        tx.pragma_update(None, "user_version", i as i64 + 1)?;
        tx.commit()?;
    }
    Ok(())
}

/// A real write transaction that commits (and changes nothing).
fn probe_write(c: &mut Connection) -> rusqlite::Result<()> {
    let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let version: i64 = tx.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    tx.pragma_update(None, "user_version", version)?;
    tx.commit()
}

fn col<T: rusqlite::types::FromSql>(r: &Row<'_>, c: &str) -> Result<T, String> {
    r.get(c).map_err(|e| format!("column {c}: {e}"))
}

fn parse_json<T: serde::de::DeserializeOwned>(r: &Row<'_>, c: &str) -> Result<Option<T>, String> {
    col::<Option<String>>(r, c)?.map(|s| serde_json::from_str(&s).map_err(|e| format!("column {c}: {e}"))).transpose()
}

impl Columns for Row<'_> {
    fn text(&self, c: &str) -> Result<Option<String>, String> {
        col(self, c)
    }
    fn int(&self, c: &str) -> Result<Option<i64>, String> {
        col(self, c)
    }
}

impl SqliteStore {
    /// Rows for listings: one unreadable row (store contents are input too) is reported and
    /// skipped, never taken for another run and never hiding the others. It stays in the file.
    fn query_rows(&self, sql: &str, args: Vec<SqlValue>) -> Result<Vec<RunRow>, StoreError> {
        Ok(self.query_rows_naming_unreadable(sql, args)?.0)
    }

    /// The rows that decode, and the admission order (`seq`: an integer always reads, where the
    /// run id may be what is damaged) of those that do not (each reported).
    fn query_rows_naming_unreadable(&self, sql: &str, args: Vec<SqlValue>) -> Result<(Vec<RunRow>, Vec<i64>), StoreError> {
        let raw: Vec<(String, Option<i64>, Result<RunRow, String>)> = self.read(|c| {
            let mut st = c.prepare_cached(sql)?;
            let rows = st.query_map(params_from_iter(args.iter()), |r| {
                let id: String = r.get("run_id").unwrap_or_default();
                Ok((id, r.get("seq").ok(), decode_row(r)))
            })?;
            rows.collect()
        })?;
        let (mut rows, mut unreadable) = (Vec::new(), Vec::new());
        for (id, seq, row) in raw {
            match row {
                Ok(row) => rows.push(row),
                Err(e) => {
                    tracing::error!(store = %self.path.display(), run_id = %id, error = %e, "unreadable run in the store; skipped");
                    unreadable.extend(seq);
                }
            }
        }
        Ok((rows, unreadable))
    }
}

fn insert(tx: &Transaction<'_>, row: &RunRow) -> rusqlite::Result<Applied> {
    if let Some(key) = &row.idempotency_key {
        let existing: Option<(String, String)> = tx
            .prepare_cached("SELECT run_id, fingerprint FROM runs WHERE billing_account_id = ? AND idempotency_key = ?")?
            .query_row([&row.billing_account_id, key], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        if let Some((id, fp)) = existing {
            return Ok(if fp == row.fingerprint { Applied::Existing { run_id: id } } else { Applied::IdempotencyMismatch });
        }
    }
    let existing: Option<String> =
        tx.prepare_cached("SELECT fingerprint FROM runs WHERE run_id = ?")?.query_row([&row.run_id], |r| r.get(0)).optional()?;
    if let Some(fp) = existing {
        return Ok(if fp == row.fingerprint { Applied::Existing { run_id: row.run_id.clone() } } else { Applied::Conflict });
    }
    let seq: i64 = tx
        .prepare_cached(
            "INSERT INTO runs (run_id, idempotency_key, fingerprint, billing_account_id, state_key, session_key, spec, status, \
             checkpoint, content, created_at, key_id, webhook_url, usage) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING seq",
        )?
        .query_row(
            params![
                row.run_id,
                row.idempotency_key,
                row.fingerprint,
                row.billing_account_id,
                row.state_key,
                row.session_key,
                json(&row.spec),
                row.status,
                row.checkpoint.as_ref().map(json),
                row.content,
                row.created_at_ms,
                row.key_id,
                row.webhook_url,
                row.usage.as_ref().map(json),
            ],
            |r| r.get(0),
        )?;
    Ok(Applied::Inserted { seq })
}

/// A batch's row changes: one entry per run, the run id, its merged changes, the highest event
/// id, and the exact last event id a `Fail` sets.
type Patches<'a> = Vec<(&'a str, RunPatch, u64, Option<u64>)>;

fn coalesce<'a>(patches: &mut Patches<'a>, index: &mut HashMap<&'a str, usize>, run_id: &'a str, patch: &RunPatch) -> usize {
    let i = *index.entry(run_id).or_insert_with(|| {
        patches.push((run_id, RunPatch::default(), 0, None));
        patches.len() - 1
    });
    patches[i].1.merge(patch.clone());
    i
}

fn queue_webhook(tx: &Transaction<'_>, run_id: &str, w: &super::NewDelivery) -> rusqlite::Result<()> {
    let now = super::now_ms();
    tx.prepare_cached("INSERT INTO webhook_outbox (run_id, url, key_id, body, next_at, created_at) VALUES (?, ?, ?, ?, ?, ?)")?
        .execute(params![run_id, w.url, w.key_id, w.body, now, now])?;
    Ok(())
}

fn update(tx: &Transaction<'_>, run_id: &str, p: &RunPatch, last_event_id: u64) -> rusqlite::Result<()> {
    let mut sql = String::from("UPDATE runs SET last_event_id = MAX(last_event_id, ?)");
    let mut args: Vec<SqlValue> = vec![SqlValue::Integer(i64::try_from(last_event_id).unwrap_or(i64::MAX))];
    let (columns, finished_at) = patch_columns(p);
    for (col, v) in columns {
        sql.push_str(&format!(", {col} = ?"));
        args.push(SqlValue::Text(v));
    }
    if let Some(v) = finished_at {
        sql.push_str(", finished_at = ?");
        args.push(SqlValue::Integer(v));
    }
    sql.push_str(" WHERE run_id = ?");
    args.push(SqlValue::Text(run_id.to_owned()));
    tx.prepare_cached(&sql)?.execute(params_from_iter(args.iter()))?;
    Ok(())
}

impl SqliteStore {
    #[cfg(test)]
    fn apply_tx(&self, batch: &[Write]) -> rusqlite::Result<Vec<Applied>> {
        self.apply_on(&mut lock(&self.write), batch)
    }

    /// Applies `batch` in one transaction on the write connection, held by the caller.
    fn apply_on(&self, conn: &mut Connection, batch: &[Write]) -> rusqlite::Result<Vec<Applied>> {
        let tx = conn.transaction()?;
        let mut out = Vec::with_capacity(batch.len());
        // Row changes of the whole batch, coalesced: one update per run (later changes win). The
        // last event id: the highest of the batch, or exactly the id of a `Fail`.
        let mut patches: Patches<'_> = Vec::new();
        let mut index: HashMap<&str, usize> = HashMap::new();
        let mut places = sqlite_events::Batch::new(&self.live);
        {
            let mut ins_event = tx.prepare_cached("INSERT INTO events (run_id, id, name, data) VALUES (?, ?, ?, ?)")?;
            for w in batch {
                out.push(match w {
                    Write::Insert(row) => insert(&tx, row)?,
                    Write::Append { run_id, event, patch, webhook } => {
                        if let Some(w) = webhook {
                            queue_webhook(&tx, run_id, w)?;
                        }
                        if let Some(e) = event {
                            places.append(&tx, run_id, e.id, || {
                                ins_event.execute(params![run_id, i64::try_from(e.id).unwrap_or(i64::MAX), e.name.as_str(), e.data])?;
                                Ok(tx.last_insert_rowid())
                            })?;
                        }
                        // A delta changes no column of its run: its row is left alone (the last
                        // event id is the events' own maximum; the column follows real changes).
                        if !patch.is_empty() {
                            let i = coalesce(&mut patches, &mut index, run_id, patch);
                            if let Some(e) = event {
                                patches[i].2 = patches[i].2.max(e.id);
                            }
                        }
                        Applied::Done
                    }
                    Write::Fail { run_id, event, patch, webhook } => {
                        let id = i64::try_from(event.id).unwrap_or(i64::MAX);
                        places.cut_from(&tx, run_id, event.id)?;
                        places.append(&tx, run_id, event.id, || {
                            ins_event.execute(params![run_id, id, event.name.as_str(), event.data])?;
                            Ok(tx.last_insert_rowid())
                        })?;
                        if let Some(w) = webhook {
                            queue_webhook(&tx, run_id, w)?;
                        }
                        let i = coalesce(&mut patches, &mut index, run_id, patch);
                        patches[i].3 = Some(event.id);
                        Applied::Done
                    }
                    Write::Spend { account, window_start_ms, tokens, .. } => {
                        tx.prepare_cached(
                            "INSERT INTO spend (billing_account_id, window_start, tokens) VALUES (?, ?, ?) \
                             ON CONFLICT (billing_account_id, window_start) DO UPDATE SET tokens = CASE WHEN tokens > 9223372036854775807 - excluded.tokens THEN 9223372036854775807 ELSE tokens + excluded.tokens END",
                        )?
                        .execute(params![account, window_start_ms, i64::try_from(*tokens).unwrap_or(i64::MAX)])?;
                        Applied::Done
                    }
                    Write::Delete { run_id } => {
                        places.delete_all(&tx, run_id)?;
                        tx.prepare_cached("DELETE FROM runs WHERE run_id = ?")?.execute([run_id])?;
                        Applied::Done
                    }
                    // One process: its share is the run's usage.
                    Write::Usage { run_id, usage } => {
                        coalesce(&mut patches, &mut index, run_id, &RunPatch { usage: Some(*usage), ..RunPatch::default() });
                        Applied::Done
                    }
                    // The audit log file of the one process has it.
                    Write::LlmCall { .. } => Applied::Done,
                });
            }
        }
        for (run_id, patch, last_id, exact) in &patches {
            if patch.finished_at_ms.is_some() {
                places.ends(&tx, run_id)?;
            }
            update(&tx, run_id, patch, *last_id)?;
            if let Some(id) = exact {
                tx.prepare_cached("UPDATE runs SET last_event_id = ? WHERE run_id = ?")?
                    .execute(params![i64::try_from(*id).unwrap_or(i64::MAX), run_id])?;
            }
        }
        places.write(&tx)?;
        tx.commit()?;
        places.committed();
        Ok(out)
    }
}

/// The columns of a run's row ([`decode_row`]): not `*`, which would read a finished run's list of
/// event rows too (see [`sqlite_events`]).
macro_rules! select_runs {
    ($rest:literal) => {
        concat!(
            "SELECT seq, run_id, idempotency_key, fingerprint, billing_account_id, state_key, session_key, spec, status, checkpoint, \
             gateway_run_id, content, error_code, error_message, gateway_usage, usage, relay, created_at, finished_at, last_event_id, \
             key_id, webhook_url FROM runs ",
            $rest
        )
    };
}

const UNFINISHED: &str = select_runs!("WHERE finished_at IS NULL ORDER BY seq");

#[async_trait::async_trait]
impl Store for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    fn commits_locally(&self) -> bool {
        true
    }

    async fn apply(&self, batch: &[Write]) -> Result<Vec<Applied>, StoreError> {
        // On a shard's thread (or the main lane's own): a commit blocks it for its ~30-100 µs, but
        // the connection held by someone else (the checkpoint thread's hold ends with an fsync, up
        // to ~200 ms seen here; the retention sweep; another lane's commit; a tenant write) is
        // waited for without blocking the thread: it serves its other tasks meanwhile, and looks
        // again after a moment (the runtime's timer: ~1 ms).
        let mut conn = loop {
            if let Some(c) = try_lock(&self.write) {
                break c;
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        };
        self.apply_on(&mut conn, batch).map_err(|e| self.err(e))
    }

    async fn run(&self, run_id: &str) -> Result<Option<RunRow>, StoreError> {
        let mut rows = self.query_rows(select_runs!("WHERE run_id = ?"), vec![SqlValue::Text(run_id.to_owned())])?;
        Ok(rows.pop())
    }

    async fn by_idempotency_key(&self, account: &str, key: &str) -> Result<Option<RunRow>, StoreError> {
        let mut rows = self.query_rows(
            select_runs!("WHERE billing_account_id = ? AND idempotency_key = ?"),
            vec![SqlValue::Text(account.to_owned()), SqlValue::Text(key.to_owned())],
        )?;
        Ok(rows.pop())
    }

    async fn raw_events(&self, run_id: &str, after: u64) -> Result<Vec<RawEvent>, StoreError> {
        self.read(|c| sqlite_events::read(c, &self.live, run_id, after))
    }

    async fn list(&self, q: &ListQuery) -> Result<Vec<RunRow>, StoreError> {
        let mut sql = String::from(select_runs!("WHERE seq < ?"));
        let mut args = vec![SqlValue::Integer(q.before_seq.unwrap_or(i64::MAX))];
        let mut any_of = |col: &str, values: &[String]| {
            let marks = vec!["?"; values.len()].join(", ");
            sql.push_str(&format!(" AND {col} IN ({marks})"));
            args.extend(values.iter().map(|v| SqlValue::Text(v.clone())));
        };
        if !q.statuses.is_empty() {
            any_of("status", &q.statuses);
        }
        if let Some(accounts) = &q.accounts {
            if accounts.is_empty() {
                return Ok(Vec::new());
            }
            any_of("billing_account_id", accounts);
        }
        if let Some(a) = &q.billing_account_id {
            sql.push_str(" AND billing_account_id = ?");
            args.push(SqlValue::Text(a.clone()));
        }
        if let Some(s) = &q.state_key {
            sql.push_str(" AND state_key = ?");
            args.push(SqlValue::Text(s.clone()));
        }
        if let Some(t) = q.since_ms {
            sql.push_str(" AND created_at >= ?");
            args.push(SqlValue::Integer(t));
        }
        sql.push_str(" ORDER BY seq DESC LIMIT ?");
        args.push(SqlValue::Integer(i64::try_from(q.limit).unwrap_or(i64::MAX)));
        self.query_rows(&sql, args)
    }

    async fn unfinished(&self) -> Result<Vec<RunRow>, StoreError> {
        self.query_rows(UNFINISHED, Vec::new())
    }

    /// One process: every unfinished run at start, none later. One whose row cannot be read is
    /// ended (see [`super::UNREADABLE_RUN`]) instead of left unfinished for good.
    async fn claim(&self, _lease: &super::Lease, at_start: bool, _held: &[String]) -> Result<Vec<RunRow>, StoreError> {
        if !at_start {
            return Ok(Vec::new());
        }
        let (rows, unreadable) = self.query_rows_naming_unreadable(UNFINISHED, Vec::new())?;
        if !unreadable.is_empty() {
            // In one transaction. A failure is logged, not returned: the readable runs are
            // continued all the same, and the next start tries again.
            let end = || -> rusqlite::Result<()> {
                let mut conn = lock(&self.write);
                let tx = conn.transaction()?;
                {
                    let mut end = tx.prepare_cached(
                        "UPDATE runs SET status = 'error', error_code = 'internal', error_message = ?, finished_at = ? WHERE seq = ? AND finished_at IS NULL",
                    )?;
                    for seq in &unreadable {
                        end.execute(params![super::UNREADABLE_RUN, super::now_ms(), seq])?;
                    }
                }
                // Their events' lists, as any run's end writes them (from its places in memory, or
                // a scan): only those whose run id reads can have events found by it.
                let mut places = sqlite_events::Batch::new(&self.live);
                for seq in &unreadable {
                    let run = tx.prepare_cached("SELECT run_id FROM runs WHERE seq = ?")?.query_row([seq], |r| Ok(r.get::<_, String>(0).ok())).optional()?.flatten();
                    if let Some(run) = run {
                        places.ends(&tx, &run)?;
                    }
                }
                places.write(&tx)?;
                tx.commit()?;
                places.committed();
                Ok(())
            };
            match end() {
                Ok(()) => tracing::error!(store = %self.path.display(), runs = unreadable.len(), "unreadable runs in the store cannot be continued; they ended `internal`"),
                Err(e) => tracing::error!(store = %self.path.display(), error = %e, "cannot end the unreadable runs of the store; the next start tries again"),
            }
        }
        Ok(rows)
    }

    async fn schema(&self) -> Result<Option<SchemaVersion>, StoreError> {
        let applied = self.read(|c| c.query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0)))?;
        Ok(Some(SchemaVersion { applied, known: MIGRATIONS.len() as i64 }))
    }

    async fn sweep(&self, retention: Retention, now_ms: i64) -> Result<Vec<String>, StoreError> {
        let run = || -> rusqlite::Result<Vec<String>> {
            let mut conn = lock(&self.write);
            let tx = conn.transaction()?;
            // Past the age, and beyond the newest `max_count` finished runs of their billing account
            // (numbered along `runs_account_finished`: no sort).
            let doomed = "SELECT run_id FROM (SELECT run_id, finished_at, ROW_NUMBER() OVER (PARTITION BY billing_account_id \
                 ORDER BY finished_at DESC, seq DESC) AS nth FROM runs WHERE finished_at IS NOT NULL) WHERE finished_at <= ?1 OR nth > ?2";
            let cutoff = now_ms.saturating_sub(retention.max_age_ms);
            let max = i64::try_from(retention.max_count).unwrap_or(i64::MAX);
            let gone = {
                let mut st = tx.prepare(doomed)?;
                let rows = st.query_map(params![cutoff, max], |r| r.get::<_, String>(0))?;
                rows.collect::<rusqlite::Result<Vec<_>>>()?
            };
            let mut places = sqlite_events::Batch::new(&self.live);
            for run_id in &gone {
                places.delete_all(&tx, run_id)?;
                tx.prepare_cached("DELETE FROM runs WHERE run_id = ?")?.execute([run_id])?;
            }
            tx.commit()?;
            places.committed();
            Ok(gone)
        };
        run().map_err(|e| self.err(e))
    }
}

/// Revokes key `?1` at `?2` and the keys it created, theirs, and so on (a revoked key's earlier
/// revocation time stays). Affects no row when there is no key `?1`.
const REVOKE_KEY: &str = "WITH RECURSIVE made(id) AS (SELECT id FROM api_keys WHERE id = ?1 \
     UNION SELECT k.id FROM api_keys k JOIN made m ON k.created_by = m.id) \
     UPDATE api_keys SET revoked_at = COALESCE(revoked_at, ?2) WHERE id IN (SELECT id FROM made)";

/// Claims a branch key (`?1`) for an account (`?2`) at `?3` with the claim id `?4`: its first
/// claim makes it the account's; a later one of the same account becomes its last claim (see
/// [`TenantStore::release_branch`]). Answers the owner and the claim that made it theirs.
const CLAIM_BRANCH: &str = "INSERT INTO branch_owners (branch_key, billing_account_id, claimed_at, first_claim, last_claim) VALUES (?1, ?2, ?3, ?4, ?4) \
     ON CONFLICT (branch_key) DO UPDATE SET last_claim = CASE WHEN branch_owners.billing_account_id = excluded.billing_account_id \
     THEN excluded.last_claim ELSE branch_owners.last_claim END RETURNING billing_account_id, first_claim";

fn decode_key(r: &Row<'_>) -> Result<KeyRecord, String> {
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

fn decode_limits(r: &Row<'_>) -> rusqlite::Result<Limits> {
    let n = |c: &str| -> rusqlite::Result<Option<u64>> { Ok(r.get::<_, Option<i64>>(c)?.map(|v| u64::try_from(v).unwrap_or(0))) };
    Ok(Limits {
        max_tokens: n("max_tokens")?,
        period_sec: n("period_sec")?,
        max_concurrent: n("max_concurrent")?,
        max_runs_per_minute: n("max_runs_per_minute")?,
    })
}

fn opt_i64(v: Option<u64>) -> Option<i64> {
    v.map(|v| i64::try_from(v).unwrap_or(i64::MAX))
}

impl SqliteStore {
    fn write_one<T>(&self, f: impl FnOnce(&Connection) -> rusqlite::Result<T>) -> Result<T, StoreError> {
        f(&lock(&self.write)).map_err(|e| self.err(e))
    }

    fn keys_where(&self, sql: &str, arg: Option<&str>) -> Result<Vec<KeyRecord>, StoreError> {
        let raw: Vec<Result<KeyRecord, String>> = self.read(|c| {
            let mut st = c.prepare_cached(sql)?;
            let rows = match arg {
                Some(a) => st.query_map([a], |r| Ok(decode_key(r)))?.collect::<rusqlite::Result<Vec<_>>>()?,
                None => st.query_map([], |r| Ok(decode_key(r)))?.collect::<rusqlite::Result<Vec<_>>>()?,
            };
            Ok(rows)
        })?;
        raw.into_iter().map(|k| k.map_err(|e| StoreError(format!("the run store {} holds an unreadable key: {e}", self.path.display())))).collect()
    }
}

#[async_trait::async_trait]
impl TenantStore for SqliteStore {
    async fn create_key(&self, key: &KeyRecord) -> Result<(), StoreError> {
        self.write_one(|c| {
            c.execute(
                "INSERT INTO api_keys (id, name, secret_sha256, accounts, actions, webhook_secret, webhook_url, created_at, created_by) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                params![key.id, key.name, key.secret_sha256, json(&key.accounts), json(&key.actions), key.webhook_secret, key.webhook_url, key.created_at_ms, key.created_by],
            )
        })?;
        Ok(())
    }

    async fn key(&self, id: &str) -> Result<Option<KeyRecord>, StoreError> {
        Ok(self.keys_where("SELECT * FROM api_keys WHERE id = ?", Some(id))?.pop())
    }

    async fn keys(&self) -> Result<Vec<KeyRecord>, StoreError> {
        self.keys_where("SELECT * FROM api_keys ORDER BY created_at", None)
    }

    async fn revoke_key(&self, id: &str, at_ms: i64) -> Result<bool, StoreError> {
        let n = self.write_one(|c| c.execute(REVOKE_KEY, params![id, at_ms]))?;
        Ok(n > 0)
    }

    async fn claim_branch(&self, branch_key: &str, account: &str, at_ms: i64, claim: &str) -> Result<BranchClaim, StoreError> {
        self.write_one(|c| {
            let (owner, first): (String, Option<String>) = c.query_row(CLAIM_BRANCH, params![branch_key, account, at_ms, claim], |r| Ok((r.get(0)?, r.get(1)?)))?;
            Ok(BranchClaim { owner, claimed_now: first.as_deref() == Some(claim) })
        })
    }

    async fn branch_owner(&self, branch_key: &str) -> Result<Option<String>, StoreError> {
        self.read(|c| c.query_row("SELECT billing_account_id FROM branch_owners WHERE branch_key = ?", [branch_key], |r| r.get(0)).optional())
    }

    async fn release_branch(&self, branch_key: &str, claim: &str) -> Result<(), StoreError> {
        self.write_one(|c| c.execute("DELETE FROM branch_owners WHERE branch_key = ? AND last_claim = ?", params![branch_key, claim]))?;
        Ok(())
    }

    async fn limits(&self, account: &str) -> Result<Option<Limits>, StoreError> {
        self.read(|c| c.prepare_cached("SELECT * FROM account_limits WHERE billing_account_id = ?")?.query_row([account], decode_limits).optional())
    }

    async fn all_limits(&self) -> Result<Vec<(String, Limits)>, StoreError> {
        self.read(|c| {
            let mut st = c.prepare_cached("SELECT * FROM account_limits ORDER BY billing_account_id")?;
            let rows = st.query_map([], |r| Ok((r.get::<_, String>("billing_account_id")?, decode_limits(r)?)))?;
            rows.collect()
        })
    }

    async fn set_limits(&self, account: &str, l: &Limits, at_ms: i64) -> Result<(), StoreError> {
        self.write_one(|c| {
            c.execute(
                "INSERT INTO account_limits (billing_account_id, max_tokens, period_sec, max_concurrent, max_runs_per_minute, updated_at) \
                 VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (billing_account_id) DO UPDATE SET max_tokens = excluded.max_tokens, \
                 period_sec = excluded.period_sec, max_concurrent = excluded.max_concurrent, \
                 max_runs_per_minute = excluded.max_runs_per_minute, updated_at = excluded.updated_at",
                params![account, opt_i64(l.max_tokens), opt_i64(l.period_sec), opt_i64(l.max_concurrent), opt_i64(l.max_runs_per_minute), at_ms],
            )
        })?;
        Ok(())
    }

    async fn spend(&self, account: &str, window_start_ms: i64) -> Result<u64, StoreError> {
        let v: Option<i64> = self.read(|c| {
            c.prepare_cached("SELECT tokens FROM spend WHERE billing_account_id = ? AND window_start = ?")?
                .query_row(params![account, window_start_ms], |r| r.get(0))
                .optional()
        })?;
        Ok(v.map_or(0, |v| u64::try_from(v).unwrap_or(0)))
    }

    async fn due_deliveries(&self, now_ms: i64, limit: usize) -> Result<Vec<OutboxItem>, StoreError> {
        self.read(|c| {
            let mut st = c.prepare_cached(
                "SELECT id, run_id, url, key_id, body, attempts, created_at FROM \
                 (SELECT o.id, o.run_id, o.url, o.key_id, o.body, o.attempts, o.created_at, \
                  d.nth, ROW_NUMBER() OVER (PARTITION BY d.nth, o.attempts > 0 ORDER BY o.id) AS k FROM webhook_outbox o JOIN \
                  (SELECT id, ROW_NUMBER() OVER (PARTITION BY key_id ORDER BY id) AS nth FROM webhook_outbox \
                   WHERE delivered_at IS NULL AND gave_up_at IS NULL AND next_at <= ?1) d ON d.id = o.id \
                  WHERE d.nth <= ?3) x ORDER BY nth, k, attempts > 0, id LIMIT ?2",
            )?;
            let per_key = i64::try_from(super::tenants::DUE_PER_KEY).unwrap_or(i64::MAX);
            let rows = st.query_map(params![now_ms, i64::try_from(limit).unwrap_or(i64::MAX), per_key], |r| {
                Ok(OutboxItem {
                    id: r.get(0)?,
                    run_id: r.get(1)?,
                    url: r.get(2)?,
                    key_id: r.get(3)?,
                    body: r.get(4)?,
                    attempts: u32::try_from(r.get::<_, i64>(5)?).unwrap_or(u32::MAX),
                    created_at_ms: r.get(6)?,
                })
            })?;
            rows.collect()
        })
    }

    async fn record_delivery(&self, id: i64, outcome: &DeliveryOutcome, at_ms: i64) -> Result<(), StoreError> {
        self.write_one(|c| match outcome {
            DeliveryOutcome::Delivered => c.execute("UPDATE webhook_outbox SET attempts = attempts + 1, delivered_at = ? WHERE id = ?", params![at_ms, id]),
            DeliveryOutcome::Retry { next_at_ms, error } => c.execute(
                "UPDATE webhook_outbox SET attempts = attempts + 1, next_at = ?, last_error = ? WHERE id = ?",
                params![next_at_ms, error, id],
            ),
            DeliveryOutcome::GaveUp { error } => c.execute(
                "UPDATE webhook_outbox SET attempts = attempts + 1, gave_up_at = ?, last_error = ? WHERE id = ?",
                params![at_ms, error, id],
            ),
        })?;
        Ok(())
    }

    async fn deliveries_of(&self, run_id: &str) -> Result<Vec<(u32, bool, bool, Option<String>)>, StoreError> {
        self.read(|c| {
            let mut st = c.prepare_cached("SELECT attempts, delivered_at, gave_up_at, last_error FROM webhook_outbox WHERE run_id = ? ORDER BY id")?;
            let rows = st.query_map([run_id], |r| {
                Ok((
                    u32::try_from(r.get::<_, i64>(0)?).unwrap_or(u32::MAX),
                    r.get::<_, Option<i64>>(1)?.is_some(),
                    r.get::<_, Option<i64>>(2)?.is_some(),
                    r.get(3)?,
                ))
            })?;
            rows.collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::backend_tests::row;
    use crate::store::{EventName, StoredEvent};

    fn frames_in_wal(c: &Connection) -> i64 {
        c.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| r.get(1)).expect("checkpoint")
    }

    fn append(s: &SqliteStore, run: &str, id: u64) {
        let event = StoredEvent { id, name: EventName::TextDelta, data: format!("{{\"text\":\"{}\"}}", "x".repeat(3000)) };
        s.apply_tx(&[Write::Append { run_id: run.to_owned(), event: Some(event), patch: RunPatch::default(), webhook: None }]).expect("append");
    }

    /// A shard commits on its own thread: with the write connection held elsewhere (the checkpoint
    /// thread's fsync, the retention sweep, another shard's commit) its commit waits without
    /// blocking the thread, whose other tasks go on (found by review: a blocking lock held up an
    /// HTTP worker's requests and streams for as long).
    #[tokio::test(flavor = "current_thread")]
    async fn a_commit_waits_for_a_held_connection_without_blocking_its_thread() {
        let dir = tempfile::tempdir().expect("dir");
        let s = SqliteStore::open(&dir.path().join("r.db")).await.expect("open");
        let held = s.write.clone();
        let (locked, is_locked) = std::sync::mpsc::channel();
        let holder = std::thread::spawn(move || {
            let _conn = lock(&held);
            locked.send(()).expect("told");
            std::thread::sleep(std::time::Duration::from_millis(300));
        });
        is_locked.recv().expect("the connection is held");
        let ticks = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counted = ticks.clone();
        let ticker = tokio::spawn(async move {
            for _ in 0..20 {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        });
        let started = std::time::Instant::now();
        s.apply(&[Write::Insert(Box::new(row("r1", "acct", 1)))]).await.expect("applied once the connection is free");
        assert!(started.elapsed() >= std::time::Duration::from_millis(250), "it waited for the connection");
        let during = ticks.load(std::sync::atomic::Ordering::SeqCst);
        assert!(during >= 10, "the thread's other tasks ran while the commit waited: {during} ticks");
        holder.join().expect("holder");
        ticker.await.expect("ticker");
    }

    /// The WAL restarts only after a checkpoint that copied every frame in it. A checkpoint beside
    /// the writer under steady commits never has (commits land while it copies); here a reader
    /// holding an old snapshot while the first step runs leaves frames behind the same way (and
    /// goes before the second step): the round's second step copies them, and the next commit
    /// starts the WAL over instead of growing it.
    #[tokio::test]
    async fn a_checkpoint_round_lets_the_wal_restart_although_frames_were_left_behind() {
        let dir = tempfile::tempdir().expect("dir");
        let s = SqliteStore::open(&dir.path().join("r.db")).await.expect("open");
        s.apply_tx(&[Write::Insert(Box::new(row("r1", "acct", 1)))]).expect("insert");
        // Well past the frames a round leaves to the WAL to restart by itself.
        let n = WAL_RESTART_FRAMES as u64;
        for id in 1..=n {
            append(&s, "r1", id);
        }
        let reader = Connection::open(s.path()).expect("reader");
        reader.execute_batch("BEGIN").expect("begin");
        reader.query_row("SELECT count(*) FROM events", [], |r| r.get::<_, i64>(0)).expect("read");
        for id in n + 1..=n + 5 {
            append(&s, "r1", id);
        }
        let checkpoint = Connection::open(s.path()).expect("checkpoint connection");
        checkpoint_round(&checkpoint, &Arc::downgrade(&s.write), || reader.execute_batch("COMMIT").expect("reader done")).expect("round");
        append(&s, "r1", n + 6);
        let frames = frames_in_wal(&checkpoint);
        assert!(frames < 20, "the WAL did not restart: {frames} frames");
        assert_eq!(s.events("r1", 0).await.expect("events").len(), n as usize + 6, "every event is still there");
    }
}

#[cfg(test)]
mod probe {
    use super::*;
    use crate::store::{EventName, SpecRecord, StoredEvent};

    /// Not a test: `cargo test --release -p clawmux --lib store::sqlite::probe -- --ignored --nocapture`
    /// prints what a batch of events costs the SQLite store on this machine.
    #[tokio::test]
    #[ignore]
    async fn batch_cost() {
        let dir = tempfile::tempdir().expect("dir");
        let s = SqliteStore::open(&dir.path().join("r.db")).await.expect("open");
        let row = |i: usize| RunRow {
            seq: 0,
            run_id: format!("run-{i}"),
            idempotency_key: None,
            fingerprint: "f".into(),
            billing_account_id: "a".into(),
            state_key: None,
            session_key: "k".into(),
            spec: SpecRecord {
                gateway_run_id: "g".into(),
                agent_id: "main".into(),
                message: "m".into(),
                model: None,
                graph_id: "g".into(),
                timeout_ms: 1,
                traceparent: "t".into(),
                attribution_token: None,
                branch: None,
                abort_on_disconnect: true,
                if_busy: Default::default(),
            },
            status: "queued".into(),
            checkpoint: None,
            gateway_run_id: None,
            content: String::new(),
            error: None,
            gateway_usage: None,
            usage: None,
            relay: None,
            created_at_ms: 1,
            finished_at_ms: None,
            last_event_id: 0,
            key_id: None,
            webhook_url: None,
        };
        let inserts: Vec<Write> = (0..1000).map(|i| Write::Insert(Box::new(row(i)))).collect();
        s.apply(&inserts).await.expect("insert");
        let mut id = 0u64;
        for batch in [1usize, 10, 100, 1000] {
            let rounds = 20_000 / batch;
            let t0 = std::time::Instant::now();
            for r in 0..rounds {
                let writes: Vec<Write> = (0..batch)
                    .map(|i| {
                        id += 1;
                        Write::Append {
                            run_id: format!("run-{}", (r * batch + i) % 1000),
                            event: Some(StoredEvent { id: 1_000_000 + id, name: EventName::TextDelta, data: "{\"text\":\"hello world, a delta\"}".into() }),
                            patch: RunPatch::default(),
                            webhook: None,
                        }
                    })
                    .collect();
                s.apply(&writes).await.expect("apply");
            }
            let el = t0.elapsed();
            println!(
                "batch {batch:>5}: {rounds} commits, {:.1} us per event, {:.2} ms per commit",
                el.as_micros() as f64 / 20_000.0,
                el.as_secs_f64() * 1000.0 / rounds as f64
            );
        }
    }
}

#[cfg(test)]
mod sweep_probe {
    use super::*;

    /// Not a test: `cargo test --release -p clawmux --lib sqlite_sweep_cost -- --ignored --nocapture`
    /// prints what one retention sweep costs the SQLite store with many kept runs (it runs every
    /// 10 s, holding the write connection: commits wait for it).
    #[tokio::test]
    #[ignore]
    async fn sqlite_sweep_cost() {
        for runs in [10_000i64, 100_000] {
            let dir = tempfile::tempdir().expect("dir");
            let s = SqliteStore::open(&dir.path().join("r.db")).await.expect("open");
            s.write_one(|c| {
                c.execute(
                    "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < ?1) \
                     INSERT INTO runs (run_id, fingerprint, billing_account_id, session_key, spec, status, content, created_at, finished_at) \
                     SELECT 'r' || n, 'fp', 'acct', 's' || n, '{}', 'ok', '', 1, 2 + n FROM g",
                    [runs],
                )
            })
            .expect("runs");
            // The count limit just reached (nothing to delete: the steady state between ends), and
            // no limit.
            let at = usize::try_from(runs).expect("count");
            for max_count in [at, usize::MAX] {
                let keep = Retention { max_age_ms: i64::MAX, max_count };
                let t0 = std::time::Instant::now();
                for _ in 0..5 {
                    assert!(s.sweep(keep, 3).await.expect("sweep").is_empty());
                }
                println!("{runs} runs kept, max_count {max_count}: {:.2} ms per sweep", t0.elapsed().as_secs_f64() * 1000.0 / 5.0);
            }
        }
    }
}
