//! PostgreSQL: what lets the LLM proxy of ANY replica forward the calls of a run another replica
//! owns (migration `0005_attribution.sql`).
//!
//! - **Lookup.** A call names its run by trace id or attribution token; both are indexed columns
//!   of `runs`, unique among unfinished runs ([`live_run`]).
//! - **Usage shares.** Each replica stores the absolute totals of the calls ITS proxy forwarded for
//!   a run (`run_usage`, one row per run and replica, upserted: idempotent); the run's usage is
//!   their sum, computed when a run is read ([`sum_shares`]), so no replica ever writes another's
//!   row (no cross-replica row locks on live runs). A replica that takes a run over keeps
//!   counting in its own share; the old owner's stays as it was.
//! - **Notifications** (delivered at commit, see `follow`): a run's end (`clawmux_ended`: other
//!   replicas stop forwarding its calls and cut its streams), a share (`clawmux_usage`, with its
//!   totals: the owner's documents show it at once), an abort for an owner (`clawmux_abort`).

use super::postgres::i64_of;
use super::columns::json_text;
use super::{CallKey, LiveRun, RunRow, SpecRecord, UsageShares};
use crate::attribution::Usage;
use sqlx::{PgPool, Postgres, Transaction};
use std::collections::{BTreeMap, HashMap};

/// The channel of runs whose end a batch stored (payload: the run id).
pub const ENDED: &str = "clawmux_ended";
/// The channel of usage shares a batch stored (payload: a [`ShareNote`] as JSON).
pub const USAGE: &str = "clawmux_usage";
/// The channel of aborts posted for an owner (payload: the owner's replica id).
pub const ABORT: &str = "clawmux_abort";

/// A replica's share of a run's usage, as notified.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShareNote {
    /// The run.
    pub run_id: String,
    /// The replica whose share it is.
    pub replica: String,
    /// Its totals.
    #[serde(flatten)]
    pub usage: Usage,
}

/// A count read from the store: a negative one (damaged contents) reads as 0.
fn u64_of(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

/// Stores this replica's shares of a batch (the last totals per run) and notifies them. Counters
/// only grow: `GREATEST` keeps a late write of older totals from lowering a share.
pub(super) async fn store_shares(tx: &mut Transaction<'_, Postgres>, replica: &str, shares: &BTreeMap<&str, Usage>) -> Result<(), sqlx::Error> {
    if shares.is_empty() {
        return Ok(());
    }
    let runs: Vec<&str> = shares.keys().copied().collect();
    let col = |f: fn(&Usage) -> u64| shares.values().map(|u| i64_of(f(u))).collect::<Vec<i64>>();
    let (input, output, calls) = (col(|u| u.input_tokens), col(|u| u.output_tokens), col(|u| u.llm_calls));
    sqlx::query(
        "INSERT INTO run_usage (run_id, replica, input_tokens, output_tokens, llm_calls) \
         SELECT r, $2, i, o, c FROM UNNEST($1::text[], $3::int8[], $4::int8[], $5::int8[]) AS t(r, i, o, c) \
         ON CONFLICT (run_id, replica) DO UPDATE SET input_tokens = GREATEST(run_usage.input_tokens, excluded.input_tokens), \
           output_tokens = GREATEST(run_usage.output_tokens, excluded.output_tokens), llm_calls = GREATEST(run_usage.llm_calls, excluded.llm_calls)",
    )
    .bind(&runs)
    .bind(replica)
    .bind(&input)
    .bind(&output)
    .bind(&calls)
    .execute(&mut **tx)
    .await?;
    let notes: Vec<String> =
        shares.iter().map(|(run_id, usage)| json_text(&ShareNote { run_id: (*run_id).to_owned(), replica: replica.to_owned(), usage: *usage })).collect();
    sqlx::query("SELECT pg_notify($1, n) FROM UNNEST($2::text[]) AS n").bind(USAGE).bind(&notes).execute(&mut **tx).await?;
    Ok(())
}

/// Records the ids of a batch's billing records; returns those not recorded before (the records
/// to store: the others were stored by an earlier commit of the same records, whose outcome the
/// writer could not know).
pub(super) async fn new_billing_ids(tx: &mut Transaction<'_, Postgres>, ids: &[&str], now_ms: i64) -> Result<std::collections::HashSet<String>, sqlx::Error> {
    if ids.is_empty() {
        return Ok(Default::default());
    }
    let new: Vec<String> = sqlx::query_scalar("INSERT INTO billing_writes (id, written_at) SELECT UNNEST($1::text[]), $2 ON CONFLICT DO NOTHING RETURNING id")
        .bind(ids)
        .bind(now_ms)
        .fetch_all(&mut **tx)
        .await?;
    Ok(new.into_iter().collect())
}

/// How long the ids of billing records are kept: a record written again later than this after a
/// commit that did store it would be counted twice (its writer retries every second while the
/// store is out of reach, so that takes an outage of a day after the commit). Records not written
/// yet are kept in the writer's memory only (at most `MAX_KEPT`): a replica that stops during an
/// outage loses them, it never counts them twice.
pub const BILLING_IDS_KEPT_MS: i64 = 24 * 3_600_000;

/// Stores a batch's audit records of LLM calls.
pub(super) async fn store_calls(tx: &mut Transaction<'_, Postgres>, replica: &str, calls: &[&crate::audit::AuditRecord]) -> Result<(), sqlx::Error> {
    if calls.is_empty() {
        return Ok(());
    }
    let runs: Vec<&str> = calls.iter().map(|c| c.run_id.as_str()).collect();
    let records: Vec<String> = calls.iter().map(json_text).collect();
    sqlx::query("INSERT INTO llm_calls (run_id, replica, record) SELECT r, $2, c FROM UNNEST($1::text[], $3::text[]) AS t(r, c)")
        .bind(&runs)
        .bind(replica)
        .bind(&records)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Tells every replica that these runs ended (their terminal event is in this batch).
pub(super) async fn notify_ended(tx: &mut Transaction<'_, Postgres>, ended: &[&str]) -> Result<(), sqlx::Error> {
    if !ended.is_empty() {
        sqlx::query("SELECT pg_notify($1, id) FROM UNNEST($2::text[]) AS id").bind(ENDED).bind(ended).execute(&mut **tx).await?;
    }
    Ok(())
}

/// Sets each row's usage to the sum of its run's shares (a run without shares keeps its column:
/// no LLM call went through a proxy, or a process without shares wrote it). The sums saturate at
/// the largest `int8`, as each share does: the counts come from upstream answers (untrusted), and
/// two shares near the top must not fail the read of the run (or of a whole page of history).
pub(super) async fn sum_shares(pool: &PgPool, rows: &mut [RunRow]) -> Result<(), sqlx::Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let ids: Vec<&str> = rows.iter().map(|r| r.run_id.as_str()).collect();
    // `sum` of `int8` is `numeric` (no overflow there); capped before the cast back.
    let sums: Vec<(String, i64, i64, i64)> = sqlx::query_as(
        "SELECT run_id, LEAST(sum(input_tokens), 9223372036854775807)::int8, LEAST(sum(output_tokens), 9223372036854775807)::int8, \
           LEAST(sum(llm_calls), 9223372036854775807)::int8 FROM run_usage WHERE run_id = ANY($1) GROUP BY run_id",
    )
    .bind(&ids)
    .fetch_all(pool)
    .await?;
    let sums: HashMap<String, Usage> =
        sums.into_iter().map(|(id, i, o, c)| (id, Usage { input_tokens: u64_of(i), output_tokens: u64_of(o), llm_calls: u64_of(c) })).collect();
    for row in rows {
        if let Some(u) = sums.get(&row.run_id) {
            row.usage = Some(*u);
        }
    }
    Ok(())
}

/// The unfinished run `key` names, with `replica`'s share of its usage.
pub(super) async fn live_run(pool: &PgPool, key: &CallKey, replica: &str) -> Result<Option<LiveRun>, String> {
    let (column, value) = match key {
        CallKey::Trace(t) => ("trace_id", t),
        CallKey::Token(t) => ("attribution_token", t),
    };
    let sql = format!(
        "SELECT r.run_id, r.billing_account_id, r.session_key, r.spec, r.trace_id, r.attribution_token, \
           u.input_tokens, u.output_tokens, u.llm_calls \
         FROM runs r LEFT JOIN run_usage u ON u.run_id = r.run_id AND u.replica = $2 \
         WHERE r.{column} = $1 AND r.finished_at IS NULL"
    );
    type Found = (String, String, String, String, Option<String>, Option<String>, Option<i64>, Option<i64>, Option<i64>);
    let found: Option<Found> = sqlx::query_as(&sql).bind(value).bind(replica).fetch_optional(pool).await.map_err(|e| e.to_string())?;
    let Some((run_id, billing_account_id, session_key, spec, trace_id, token, i, o, c)) = found else { return Ok(None) };
    // The store's own contents, but input all the same: a bad row is an error naming the run.
    let spec: SpecRecord = serde_json::from_str(&spec).map_err(|e| format!("run {run_id:?} has an unreadable spec: {e}"))?;
    let share = Usage { input_tokens: u64_of(i.unwrap_or(0)), output_tokens: u64_of(o.unwrap_or(0)), llm_calls: u64_of(c.unwrap_or(0)) };
    Ok(Some(LiveRun { run_id, billing_account_id, graph_id: spec.graph_id, session_key, trace_id: trace_id.unwrap_or_default(), token, share }))
}

/// A run's shares: `replica`'s and the others'. A run with none at all is a run whose usage a
/// process without shares wrote (or none): its `stored` usage is taken as `replica`'s own.
pub(super) async fn shares_of(pool: &PgPool, run_id: &str, stored: Option<Usage>, replica: &str) -> Result<UsageShares, sqlx::Error> {
    let rows: Vec<(String, i64, i64, i64)> =
        sqlx::query_as("SELECT replica, input_tokens, output_tokens, llm_calls FROM run_usage WHERE run_id = $1").bind(run_id).fetch_all(pool).await?;
    if rows.is_empty() {
        return Ok(UsageShares { mine: stored.unwrap_or_default(), others: HashMap::new() });
    }
    let mut out = UsageShares::default();
    for (r, i, o, c) in rows {
        let u = Usage { input_tokens: u64_of(i), output_tokens: u64_of(o), llm_calls: u64_of(c) };
        if r == replica {
            out.mine = u;
        } else {
            out.others.insert(r, u);
        }
    }
    Ok(out)
}

/// Which of `run_ids` are finished or gone.
pub(super) async fn ended(pool: &PgPool, run_ids: &[String]) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT id FROM UNNEST($1::text[]) AS id WHERE NOT EXISTS (SELECT 1 FROM runs WHERE run_id = id AND finished_at IS NULL)")
        .bind(run_ids)
        .fetch_all(pool)
        .await
}

/// A run's recorded LLM calls, oldest first: at most `limit`, and whether more were left out.
pub(super) async fn calls_of(pool: &PgPool, run_id: &str, limit: usize) -> Result<(Vec<crate::audit::LlmCall>, bool), String> {
    let records: Vec<String> = sqlx::query_scalar("SELECT record FROM llm_calls WHERE run_id = $1 ORDER BY id LIMIT $2")
        .bind(run_id)
        .bind(i64::try_from(limit.saturating_add(1)).unwrap_or(i64::MAX))
        .fetch_all(pool)
        .await
        .map_err(|e| e.to_string())?;
    let more = records.len() > limit;
    // A record that cannot be read is skipped, as a torn line of the audit log file is.
    let calls = records.iter().take(limit).filter_map(|r| serde_json::from_str(r).ok()).collect();
    Ok((calls, more))
}
