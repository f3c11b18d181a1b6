//! `sqlite://PATH`: the default run store. WAL journal (readers never wait for the writer),
//! `synchronous = NORMAL` (a commit survives a crash of clawmux; the last commits before a power
//! loss may not), one write connection fed by the group-commit writer, a small read pool.
//! The schema is created and migrated at start (`migrations/sqlite/`).

use super::tenants::{DeliveryOutcome, KeyRecord, Limits, OutboxItem, TenantStore};
use super::{Applied, CheckpointRecord, EventName, ListQuery, Retention, RunPatch, RunRow, SpecRecord, Store, StoreError, StoredEvent, Write};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous};
use sqlx::{QueryBuilder, Row, Sqlite, SqlitePool};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Events per multi-row `INSERT` (4 bound values each, far below SQLite's variable limit).
const EVENTS_PER_INSERT: usize = 500;

/// The SQLite store.
pub struct SqliteStore {
    path: PathBuf,
    /// One connection: writes are serialised by the group-commit writer anyway.
    write: SqlitePool,
    read: SqlitePool,
}

impl SqliteStore {
    /// Opens (creating it on first start) the store at `path` and migrates its schema. Every
    /// error names the file.
    pub async fn open(path: &Path) -> Result<Self, StoreError> {
        let fail = |what: &str, e: &dyn std::fmt::Display| StoreError(format!("the run store {} {what}: {e}", path.display()));
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| fail("cannot be created", &e))?;
        }
        let opts = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(5));
        let write = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(opts.clone())
            .await
            .map_err(|e| fail("cannot be opened", &e))?;
        sqlx::migrate!("./migrations/sqlite").run(&write).await.map_err(|e| fail("cannot be set up", &e))?;
        // A quick read of the schema catches a file that is a database but not ours (or damaged).
        sqlx::query("SELECT count(*) FROM runs").fetch_one(&write).await.map_err(|e| fail("cannot be read", &e))?;
        let read = SqlitePoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(opts.read_only(true))
            .await
            .map_err(|e| fail("cannot be opened for reading", &e))?;
        Ok(Self { path: path.to_owned(), write, read })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn err(&self, e: sqlx::Error) -> StoreError {
        StoreError(format!("the run store {}: {e}", self.path.display()))
    }
}

fn json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "null".to_owned())
}

fn decode_row(r: &SqliteRow) -> Result<RunRow, String> {
    let text = |c: &str| r.try_get::<String, _>(c).map_err(|e| format!("column {c}: {e}"));
    let opt = |c: &str| r.try_get::<Option<String>, _>(c).map_err(|e| format!("column {c}: {e}"));
    let int = |c: &str| r.try_get::<i64, _>(c).map_err(|e| format!("column {c}: {e}"));
    let parse_opt = |c: &str| -> Result<Option<serde_json::Value>, String> {
        opt(c)?.map(|s| serde_json::from_str(&s).map_err(|e| format!("column {c}: {e}"))).transpose()
    };
    let spec: SpecRecord = serde_json::from_str(&text("spec")?).map_err(|e| format!("column spec: {e}"))?;
    let checkpoint: Option<CheckpointRecord> =
        opt("checkpoint")?.map(|s| serde_json::from_str(&s).map_err(|e| format!("column checkpoint: {e}"))).transpose()?;
    let error = match (opt("error_code")?, opt("error_message")?) {
        (Some(c), m) => Some((c, m.unwrap_or_default())),
        _ => None,
    };
    let gateway_usage = parse_opt("gateway_usage")?.map(serde_json::from_value).transpose().map_err(|e| format!("column gateway_usage: {e}"))?;
    let usage = parse_opt("usage")?.map(serde_json::from_value).transpose().map_err(|e| format!("column usage: {e}"))?;
    Ok(RunRow {
        seq: int("seq")?,
        run_id: text("run_id")?,
        idempotency_key: opt("idempotency_key")?,
        fingerprint: text("fingerprint")?,
        billing_account_id: text("billing_account_id")?,
        state_key: opt("state_key")?,
        session_key: text("session_key")?,
        spec,
        status: text("status")?,
        checkpoint,
        gateway_run_id: opt("gateway_run_id")?,
        content: text("content")?,
        error,
        gateway_usage,
        usage,
        relay: parse_opt("relay")?,
        created_at_ms: int("created_at")?,
        finished_at_ms: r.try_get::<Option<i64>, _>("finished_at").map_err(|e| format!("column finished_at: {e}"))?,
        last_event_id: u64::try_from(int("last_event_id")?).unwrap_or(0),
        key_id: opt("key_id")?,
        webhook_url: opt("webhook_url")?,
    })
}

impl SqliteStore {
    /// Rows for listings: one unreadable row (store contents are input too) is reported and
    /// skipped, never taken for another run and never hiding the others. It stays in the file.
    fn rows_lossy(&self, rows: Vec<SqliteRow>) -> Vec<RunRow> {
        rows.iter()
            .filter_map(|r| match decode_row(r) {
                Ok(row) => Some(row),
                Err(e) => {
                    let id: String = r.try_get("run_id").unwrap_or_default();
                    tracing::error!(store = %self.path.display(), run_id = %id, error = %e, "unreadable run in the store; skipped");
                    None
                }
            })
            .collect()
    }

    fn rows(&self, rows: Vec<SqliteRow>) -> Result<Vec<RunRow>, StoreError> {
        rows.iter()
            .map(|r| {
                decode_row(r).map_err(|e| {
                    let id: String = r.try_get("run_id").unwrap_or_default();
                    StoreError(format!("the run store {} holds an unreadable run {id:?}: {e}", self.path.display()))
                })
            })
            .collect()
    }

    async fn insert(&self, tx: &mut sqlx::SqliteConnection, row: &RunRow) -> Result<Applied, sqlx::Error> {
        if let Some(key) = &row.idempotency_key {
            let existing = sqlx::query("SELECT run_id, fingerprint FROM runs WHERE idempotency_key = ?").bind(key).fetch_optional(&mut *tx).await?;
            if let Some(e) = existing {
                let (id, fp): (String, String) = (e.try_get("run_id")?, e.try_get("fingerprint")?);
                return Ok(if fp == row.fingerprint { Applied::Existing { run_id: id } } else { Applied::IdempotencyMismatch });
            }
        }
        let existing = sqlx::query("SELECT fingerprint FROM runs WHERE run_id = ?").bind(&row.run_id).fetch_optional(&mut *tx).await?;
        if let Some(e) = existing {
            let fp: String = e.try_get("fingerprint")?;
            return Ok(if fp == row.fingerprint { Applied::Existing { run_id: row.run_id.clone() } } else { Applied::Conflict });
        }
        let seq: i64 = sqlx::query_scalar(
            "INSERT INTO runs (run_id, idempotency_key, fingerprint, billing_account_id, state_key, session_key, spec, status, \
             checkpoint, content, created_at, key_id, webhook_url) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING seq",
        )
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
        .fetch_one(&mut *tx)
        .await?;
        Ok(Applied::Inserted { seq })
    }

    async fn apply_tx(&self, batch: &[Write]) -> Result<Vec<Applied>, sqlx::Error> {
        let mut conn = self.write.acquire().await?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        let mut out = Vec::with_capacity(batch.len());
        // Events and row changes of the whole batch, coalesced: one multi-row insert, one update
        // per run (later changes win), whatever the batch size.
        let mut events: Vec<(&str, &StoredEvent)> = Vec::new();
        let mut patches: Vec<(&str, RunPatch, u64)> = Vec::new();
        let mut index: HashMap<&str, usize> = HashMap::new();
        for w in batch {
            out.push(match w {
                Write::Insert(row) => self.insert(&mut tx, row).await?,
                Write::Append { run_id, event, patch, webhook } => {
                    if let Some(w) = webhook {
                        let now = super::now_ms();
                        sqlx::query("INSERT INTO webhook_outbox (run_id, url, key_id, body, next_at, created_at) VALUES (?, ?, ?, ?, ?, ?)")
                            .bind(run_id)
                            .bind(&w.url)
                            .bind(&w.key_id)
                            .bind(&w.body)
                            .bind(now)
                            .bind(now)
                            .execute(&mut *tx)
                            .await?;
                    }
                    let i = *index.entry(run_id.as_str()).or_insert_with(|| {
                        patches.push((run_id.as_str(), RunPatch::default(), 0));
                        patches.len() - 1
                    });
                    patches[i].1.merge(patch.clone());
                    if let Some(e) = event {
                        patches[i].2 = patches[i].2.max(e.id);
                        events.push((run_id.as_str(), e));
                    }
                    Applied::Done
                }
                Write::Spend { account, window_start_ms, tokens } => {
                    sqlx::query(
                        "INSERT INTO spend (billing_account_id, window_start, tokens) VALUES (?, ?, ?) \
                         ON CONFLICT (billing_account_id, window_start) DO UPDATE SET tokens = tokens + excluded.tokens",
                    )
                    .bind(account)
                    .bind(window_start_ms)
                    .bind(i64::try_from(*tokens).unwrap_or(i64::MAX))
                    .execute(&mut *tx)
                    .await?;
                    Applied::Done
                }
                Write::Delete { run_id } => {
                    sqlx::query("DELETE FROM events WHERE run_id = ?").bind(run_id).execute(&mut *tx).await?;
                    sqlx::query("DELETE FROM runs WHERE run_id = ?").bind(run_id).execute(&mut *tx).await?;
                    Applied::Done
                }
            });
        }
        for chunk in events.chunks(EVENTS_PER_INSERT) {
            let mut qb = QueryBuilder::<Sqlite>::new("INSERT INTO events (run_id, id, name, data) ");
            qb.push_values(chunk, |mut b, (run_id, e)| {
                b.push_bind(run_id.to_string()).push_bind(e.id as i64).push_bind(e.name.as_str()).push_bind(e.data.clone());
            });
            qb.build().execute(&mut *tx).await?;
        }
        for (run_id, patch, last_id) in patches {
            update(&mut tx, run_id, &patch, last_id).await?;
        }
        tx.commit().await?;
        Ok(out)
    }
}

async fn update(tx: &mut sqlx::SqliteConnection, run_id: &str, p: &RunPatch, last_event_id: u64) -> Result<(), sqlx::Error> {
    let mut qb = QueryBuilder::<Sqlite>::new("UPDATE runs SET last_event_id = MAX(last_event_id, ");
    qb.push_bind(last_event_id as i64).push(")");
    if let Some(v) = &p.status {
        qb.push(", status = ").push_bind(v.clone());
    }
    if let Some(v) = &p.checkpoint {
        qb.push(", checkpoint = ").push_bind(json(v));
    }
    if let Some(v) = &p.gateway_run_id {
        qb.push(", gateway_run_id = ").push_bind(v.clone());
    }
    if let Some(v) = &p.content {
        qb.push(", content = ").push_bind(v.clone());
    }
    if let Some((code, message)) = &p.error {
        qb.push(", error_code = ").push_bind(code.clone()).push(", error_message = ").push_bind(message.clone());
    }
    if let Some(v) = &p.gateway_usage {
        qb.push(", gateway_usage = ").push_bind(json(v));
    }
    if let Some(v) = &p.usage {
        qb.push(", usage = ").push_bind(json(v));
    }
    if let Some(v) = &p.relay {
        qb.push(", relay = ").push_bind(json(v));
    }
    if let Some(v) = p.finished_at_ms {
        qb.push(", finished_at = ").push_bind(v);
    }
    qb.push(" WHERE run_id = ").push_bind(run_id.to_owned());
    qb.build().execute(&mut *tx).await?;
    Ok(())
}

#[async_trait::async_trait]
impl Store for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    async fn apply(&self, batch: &[Write]) -> Result<Vec<Applied>, StoreError> {
        self.apply_tx(batch).await.map_err(|e| self.err(e))
    }

    async fn run(&self, run_id: &str) -> Result<Option<RunRow>, StoreError> {
        let row = sqlx::query("SELECT * FROM runs WHERE run_id = ?").bind(run_id).fetch_optional(&self.read).await.map_err(|e| self.err(e))?;
        Ok(self.rows(row.into_iter().collect())?.pop())
    }

    async fn events(&self, run_id: &str, after: u64) -> Result<Vec<StoredEvent>, StoreError> {
        let rows = sqlx::query("SELECT id, name, data FROM events WHERE run_id = ? AND id > ? ORDER BY id")
            .bind(run_id)
            .bind(after as i64)
            .fetch_all(&self.read)
            .await
            .map_err(|e| self.err(e))?;
        rows.iter()
            .map(|r| {
                let id: i64 = r.try_get("id").map_err(|e| self.err(e))?;
                let name: String = r.try_get("name").map_err(|e| self.err(e))?;
                let data: String = r.try_get("data").map_err(|e| self.err(e))?;
                let name = EventName::parse(&name)
                    .ok_or_else(|| StoreError(format!("the run store {} holds an event of unknown kind {name:?}", self.path.display())))?;
                Ok(StoredEvent { id: u64::try_from(id).unwrap_or(0), name, data })
            })
            .collect()
    }

    async fn list(&self, q: &ListQuery) -> Result<Vec<RunRow>, StoreError> {
        let mut qb = QueryBuilder::<Sqlite>::new("SELECT * FROM runs WHERE seq < ");
        qb.push_bind(q.before_seq.unwrap_or(i64::MAX));
        if !q.statuses.is_empty() {
            qb.push(" AND status IN (");
            let mut sep = qb.separated(", ");
            for s in &q.statuses {
                sep.push_bind(s.clone());
            }
            qb.push(")");
        }
        if let Some(a) = &q.billing_account_id {
            qb.push(" AND billing_account_id = ").push_bind(a.clone());
        }
        if let Some(s) = &q.state_key {
            qb.push(" AND state_key = ").push_bind(s.clone());
        }
        if let Some(accounts) = &q.accounts {
            if accounts.is_empty() {
                return Ok(Vec::new());
            }
            qb.push(" AND billing_account_id IN (");
            let mut sep = qb.separated(", ");
            for a in accounts {
                sep.push_bind(a.clone());
            }
            qb.push(")");
        }
        if let Some(t) = q.since_ms {
            qb.push(" AND created_at >= ").push_bind(t);
        }
        qb.push(" ORDER BY seq DESC LIMIT ").push_bind(q.limit as i64);
        let rows = qb.build().fetch_all(&self.read).await.map_err(|e| self.err(e))?;
        Ok(self.rows_lossy(rows))
    }

    async fn unfinished(&self) -> Result<Vec<RunRow>, StoreError> {
        let rows = sqlx::query("SELECT * FROM runs WHERE finished_at IS NULL ORDER BY seq").fetch_all(&self.read).await.map_err(|e| self.err(e))?;
        Ok(self.rows_lossy(rows))
    }

    async fn sweep(&self, retention: Retention, now_ms: i64) -> Result<u64, StoreError> {
        let run = async {
            let mut conn = self.write.acquire().await?;
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            // Past the age, and beyond the newest `max_count` finished runs.
            let doomed = "SELECT run_id FROM runs WHERE finished_at IS NOT NULL AND (finished_at <= ? OR run_id IN \
                 (SELECT run_id FROM runs WHERE finished_at IS NOT NULL ORDER BY finished_at DESC, seq DESC LIMIT -1 OFFSET ?))";
            let cutoff = now_ms.saturating_sub(retention.max_age_ms);
            let max = retention.max_count as i64;
            sqlx::query(&format!("DELETE FROM events WHERE run_id IN ({doomed})")).bind(cutoff).bind(max).execute(&mut *tx).await?;
            let n = sqlx::query(&format!("DELETE FROM runs WHERE run_id IN ({doomed})")).bind(cutoff).bind(max).execute(&mut *tx).await?;
            tx.commit().await?;
            Ok::<u64, sqlx::Error>(n.rows_affected())
        };
        run.await.map_err(|e| self.err(e))
    }
}

fn decode_key(r: &SqliteRow) -> Result<KeyRecord, String> {
    let text = |c: &str| r.try_get::<String, _>(c).map_err(|e| format!("column {c}: {e}"));
    let list = |c: &str| -> Result<Vec<String>, String> { serde_json::from_str(&text(c)?).map_err(|e| format!("column {c}: {e}")) };
    Ok(KeyRecord {
        id: text("id")?,
        name: text("name")?,
        secret_sha256: text("secret_sha256")?,
        accounts: list("accounts")?,
        actions: list("actions")?,
        webhook_secret: text("webhook_secret")?,
        webhook_url: r.try_get("webhook_url").map_err(|e| format!("column webhook_url: {e}"))?,
        created_at_ms: r.try_get("created_at").map_err(|e| format!("column created_at: {e}"))?,
        revoked_at_ms: r.try_get("revoked_at").map_err(|e| format!("column revoked_at: {e}"))?,
    })
}

fn decode_limits(r: &SqliteRow) -> Result<Limits, sqlx::Error> {
    let n = |c: &str| -> Result<Option<u64>, sqlx::Error> { Ok(r.try_get::<Option<i64>, _>(c)?.map(|v| u64::try_from(v).unwrap_or(0))) };
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

#[async_trait::async_trait]
impl TenantStore for SqliteStore {
    async fn create_key(&self, key: &KeyRecord) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO api_keys (id, name, secret_sha256, accounts, actions, webhook_secret, webhook_url, created_at) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&key.id)
        .bind(&key.name)
        .bind(&key.secret_sha256)
        .bind(json(&key.accounts))
        .bind(json(&key.actions))
        .bind(&key.webhook_secret)
        .bind(&key.webhook_url)
        .bind(key.created_at_ms)
        .execute(&self.write)
        .await
        .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn key(&self, id: &str) -> Result<Option<KeyRecord>, StoreError> {
        let row = sqlx::query("SELECT * FROM api_keys WHERE id = ?").bind(id).fetch_optional(&self.read).await.map_err(|e| self.err(e))?;
        row.map(|r| decode_key(&r).map_err(|e| StoreError(format!("the run store {} holds an unreadable key: {e}", self.path.display()))))
            .transpose()
    }

    async fn keys(&self) -> Result<Vec<KeyRecord>, StoreError> {
        let rows = sqlx::query("SELECT * FROM api_keys ORDER BY created_at").fetch_all(&self.read).await.map_err(|e| self.err(e))?;
        rows.iter()
            .map(|r| decode_key(r).map_err(|e| StoreError(format!("the run store {} holds an unreadable key: {e}", self.path.display()))))
            .collect()
    }

    async fn revoke_key(&self, id: &str, at_ms: i64) -> Result<bool, StoreError> {
        let n = sqlx::query("UPDATE api_keys SET revoked_at = COALESCE(revoked_at, ?) WHERE id = ?")
            .bind(at_ms)
            .bind(id)
            .execute(&self.write)
            .await
            .map_err(|e| self.err(e))?;
        Ok(n.rows_affected() > 0)
    }

    async fn limits(&self, account: &str) -> Result<Option<Limits>, StoreError> {
        let row = sqlx::query("SELECT * FROM account_limits WHERE billing_account_id = ?")
            .bind(account)
            .fetch_optional(&self.read)
            .await
            .map_err(|e| self.err(e))?;
        row.map(|r| decode_limits(&r).map_err(|e| self.err(e))).transpose()
    }

    async fn all_limits(&self) -> Result<Vec<(String, Limits)>, StoreError> {
        let rows = sqlx::query("SELECT * FROM account_limits ORDER BY billing_account_id").fetch_all(&self.read).await.map_err(|e| self.err(e))?;
        rows.iter()
            .map(|r| Ok((r.try_get::<String, _>("billing_account_id").map_err(|e| self.err(e))?, decode_limits(r).map_err(|e| self.err(e))?)))
            .collect()
    }

    async fn set_limits(&self, account: &str, l: &Limits, at_ms: i64) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO account_limits (billing_account_id, max_tokens, period_sec, max_concurrent, max_runs_per_minute, updated_at) \
             VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (billing_account_id) DO UPDATE SET max_tokens = excluded.max_tokens, \
             period_sec = excluded.period_sec, max_concurrent = excluded.max_concurrent, \
             max_runs_per_minute = excluded.max_runs_per_minute, updated_at = excluded.updated_at",
        )
        .bind(account)
        .bind(opt_i64(l.max_tokens))
        .bind(opt_i64(l.period_sec))
        .bind(opt_i64(l.max_concurrent))
        .bind(opt_i64(l.max_runs_per_minute))
        .bind(at_ms)
        .execute(&self.write)
        .await
        .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn spend(&self, account: &str, window_start_ms: i64) -> Result<u64, StoreError> {
        let v: Option<i64> = sqlx::query_scalar("SELECT tokens FROM spend WHERE billing_account_id = ? AND window_start = ?")
            .bind(account)
            .bind(window_start_ms)
            .fetch_optional(&self.read)
            .await
            .map_err(|e| self.err(e))?;
        Ok(v.map_or(0, |v| u64::try_from(v).unwrap_or(0)))
    }

    async fn due_deliveries(&self, now_ms: i64, limit: usize) -> Result<Vec<OutboxItem>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, run_id, url, key_id, body, attempts, created_at FROM webhook_outbox \
             WHERE delivered_at IS NULL AND gave_up_at IS NULL AND next_at <= ? ORDER BY id LIMIT ?",
        )
        .bind(now_ms)
        .bind(limit as i64)
        .fetch_all(&self.read)
        .await
        .map_err(|e| self.err(e))?;
        rows.iter()
            .map(|r| {
                Ok(OutboxItem {
                    id: r.try_get("id").map_err(|e| self.err(e))?,
                    run_id: r.try_get("run_id").map_err(|e| self.err(e))?,
                    url: r.try_get("url").map_err(|e| self.err(e))?,
                    key_id: r.try_get("key_id").map_err(|e| self.err(e))?,
                    body: r.try_get("body").map_err(|e| self.err(e))?,
                    attempts: u32::try_from(r.try_get::<i64, _>("attempts").map_err(|e| self.err(e))?).unwrap_or(u32::MAX),
                    created_at_ms: r.try_get("created_at").map_err(|e| self.err(e))?,
                })
            })
            .collect()
    }

    async fn record_delivery(&self, id: i64, outcome: &DeliveryOutcome, at_ms: i64) -> Result<(), StoreError> {
        let q = match outcome {
            DeliveryOutcome::Delivered => sqlx::query("UPDATE webhook_outbox SET attempts = attempts + 1, delivered_at = ? WHERE id = ?").bind(at_ms).bind(id),
            DeliveryOutcome::Retry { next_at_ms, error } => sqlx::query(
                "UPDATE webhook_outbox SET attempts = attempts + 1, next_at = ?, last_error = ? WHERE id = ?",
            )
            .bind(*next_at_ms)
            .bind(error.clone())
            .bind(id),
            DeliveryOutcome::GaveUp { error } => sqlx::query(
                "UPDATE webhook_outbox SET attempts = attempts + 1, gave_up_at = ?, last_error = ? WHERE id = ?",
            )
            .bind(at_ms)
            .bind(error.clone())
            .bind(id),
        };
        q.execute(&self.write).await.map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn deliveries_of(&self, run_id: &str) -> Result<Vec<(u32, bool, bool, Option<String>)>, StoreError> {
        let rows = sqlx::query("SELECT attempts, delivered_at, gave_up_at, last_error FROM webhook_outbox WHERE run_id = ? ORDER BY id")
            .bind(run_id)
            .fetch_all(&self.read)
            .await
            .map_err(|e| self.err(e))?;
        rows.iter()
            .map(|r| {
                let attempts: i64 = r.try_get("attempts").map_err(|e| self.err(e))?;
                let delivered: Option<i64> = r.try_get("delivered_at").map_err(|e| self.err(e))?;
                let gave_up: Option<i64> = r.try_get("gave_up_at").map_err(|e| self.err(e))?;
                let err: Option<String> = r.try_get("last_error").map_err(|e| self.err(e))?;
                Ok((u32::try_from(attempts).unwrap_or(u32::MAX), delivered.is_some(), gave_up.is_some(), err))
            })
            .collect()
    }
}
