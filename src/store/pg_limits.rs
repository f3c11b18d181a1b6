//! PostgreSQL: an account's limits counted over every replica, in the admitting transaction
//! (migrations `0006_account_limits.sql`, `0007_admitted_at.sql`).
//!
//! A batch that admits runs of accounts with limits takes each such account's advisory lock (in
//! the one order of the batch's locks, see `postgres::lock_keys`), then, after each insert,
//! counts what the new run takes the account to: live runs (`maxConcurrent`), runs admitted in the
//! last minute (`maxRunsPerMinute`), tokens spent in the budget window (`maxTokens`). A run past a
//! limit is deleted in the same transaction, so no replica ever sees it: two replicas never both
//! admit the run that crosses a limit, and a refused run is never started by the replica its
//! session key runs on.

use super::{Applied, RunRow, Write};
use sqlx::{Postgres, Transaction};
use std::collections::HashMap;

type Tx<'a> = Transaction<'a, Postgres>;

/// The advisory lock name of a billing account with limits (never a session key, which starts
/// with `agent:`, nor a branch key's `branch:` name).
pub(super) fn account_lock(account: &str) -> String {
    format!("account:{account}")
}

/// An account's limits that admission counts in the store.
#[derive(Debug, Clone, Copy)]
pub(super) struct AccountLimits {
    /// Live runs at once (`maxConcurrent`).
    max_concurrent: Option<i64>,
    /// Admissions per minute (`maxRunsPerMinute`).
    max_runs_per_minute: Option<i64>,
    /// Tokens per budget window (`maxTokens`), with the window's length in seconds.
    max_tokens: Option<(i64, i64)>,
}

/// A row of `account_limits`: account, max concurrent, max per minute, max tokens, period (s).
type LimitsRow = (String, Option<i64>, Option<i64>, Option<i64>, Option<i64>);

/// Tokens a batch adds to accounts' spend, by account and window start: the batch stores them at
/// its end, and an admission in the same batch counts them (under group commit the call that
/// spends a budget often shares a batch with the account's next admission; after an outage, every
/// kept spend does).
pub(super) type BatchSpend = HashMap<(String, i64), u64>;

/// The spend of `batch` not stored yet (a record whose id a committed batch stored is not counted
/// again), for the accounts whose token budget admission checks.
pub(super) async fn batch_spend(tx: &mut Tx<'_>, batch: &[Write], limited: &HashMap<String, AccountLimits>) -> Result<BatchSpend, sqlx::Error> {
    let spends: Vec<(&str, &str, i64, u64)> = batch
        .iter()
        .filter_map(|w| match w {
            Write::Spend { account, window_start_ms, tokens, id } if limited.get(account).is_some_and(|l| l.max_tokens.is_some()) => {
                Some((id.0.as_str(), account.as_str(), *window_start_ms, *tokens))
            }
            _ => None,
        })
        .collect();
    if spends.is_empty() {
        return Ok(BatchSpend::new());
    }
    let ids: Vec<&str> = spends.iter().map(|s| s.0).collect();
    let stored: Vec<String> = sqlx::query_scalar("SELECT id FROM billing_writes WHERE id = ANY($1)").bind(&ids).fetch_all(&mut **tx).await?;
    let mut out = BatchSpend::new();
    for (id, account, window, tokens) in spends {
        if !stored.iter().any(|s| s == id) {
            let t = out.entry((account.to_owned(), window)).or_default();
            *t = t.saturating_add(tokens);
        }
    }
    Ok(out)
}

/// The limits of the billing accounts of the batch's new runs that have any.
pub(super) async fn limits_of(tx: &mut Tx<'_>, batch: &[Write]) -> Result<HashMap<String, AccountLimits>, sqlx::Error> {
    let mut accounts: Vec<&str> = batch
        .iter()
        .filter_map(|w| match w {
            Write::Insert(row) => Some(row.billing_account_id.as_str()),
            _ => None,
        })
        .collect();
    if accounts.is_empty() {
        return Ok(HashMap::new());
    }
    super::postgres::sorted_unique(&mut accounts);
    let rows: Vec<LimitsRow> = sqlx::query_as(
        "SELECT billing_account_id, max_concurrent, max_runs_per_minute, max_tokens, period_sec FROM account_limits \
         WHERE billing_account_id = ANY($1) \
           AND (max_concurrent IS NOT NULL OR max_runs_per_minute IS NOT NULL OR (max_tokens IS NOT NULL AND period_sec IS NOT NULL))",
    )
    .bind(&accounts)
    .fetch_all(&mut **tx)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(a, c, m, t, p)| (a, AccountLimits { max_concurrent: c, max_runs_per_minute: m, max_tokens: t.zip(p) }))
        .collect())
}

/// The window the per-minute limit counts admissions in.
const MINUTE_MS: i64 = 60_000;

/// The start of the current statement on the database's clock, in milliseconds.
const STATEMENT_MS: &str = "(extract(epoch from statement_timestamp()) * 1000)::bigint";

/// After `row` was inserted (it counts itself): why it takes its account past a limit, if it
/// does. Counted over every replica's runs and spend (the account's advisory lock is held, so no
/// other admission of the account is between the count and the commit). The minute is judged by
/// the database's clock (`admitted_at`, migration `0007_admitted_at.sql`), so replicas whose clocks
/// disagree still count each other's runs; the budget window is the admitting replica's (`createdAt`),
/// as the proxies' spend records are, which needs replicas' clocks to agree to within a small part
/// of the period (NTP).
pub(super) async fn over_limit(tx: &mut Tx<'_>, row: &RunRow, l: AccountLimits, in_batch: &BatchSpend) -> Result<Option<Applied>, sqlx::Error> {
    let account = &row.billing_account_id;
    if let Some((max, period_sec)) = l.max_tokens {
        let (start, end) = super::tenants::window(u64::try_from(period_sec).unwrap_or(1), row.created_at_ms);
        let spent: Option<i64> = sqlx::query_scalar("SELECT tokens FROM spend WHERE billing_account_id = $1 AND window_start = $2")
            .bind(account)
            .bind(start)
            .fetch_optional(&mut **tx)
            .await?;
        let pending = in_batch.get(&(account.clone(), start)).map_or(0, |t| i64::try_from(*t).unwrap_or(i64::MAX));
        let spent = spent.unwrap_or(0).saturating_add(pending);
        if spent >= max {
            let wait = u64::try_from(end.saturating_sub(row.created_at_ms)).unwrap_or(0).div_ceil(1000).max(1);
            return Ok(Some(Applied::Limited {
                budget: true,
                message: super::tenants::budget_spent(account, spent, max, wait),
                retry_after_sec: wait,
            }));
        }
    }
    if l.max_concurrent.is_none() && l.max_runs_per_minute.is_none() {
        return Ok(None);
    }
    // The statement's start on the database's clock: every row is compared with one instant, later
    // than the insert above (whose `admitted_at` is the database's `clock_timestamp()`). Stable
    // within the statement, so the account's `admitted_at` index serves the comparison.
    let (live, recent, oldest, now): (i64, i64, Option<i64>, i64) = sqlx::query_as(&format!(
        "SELECT count(*) FILTER (WHERE finished_at IS NULL), count(*) FILTER (WHERE admitted_at >= {STATEMENT_MS} - $2), \
           min(admitted_at) FILTER (WHERE admitted_at >= {STATEMENT_MS} - $2), {STATEMENT_MS} \
         FROM runs WHERE billing_account_id = $1 AND (finished_at IS NULL OR admitted_at >= {STATEMENT_MS} - $2)"
    ))
    .bind(account)
    .bind(MINUTE_MS)
    .fetch_one(&mut **tx)
    .await?;
    if let Some(max) = l.max_concurrent.filter(|max| live > *max) {
        return Ok(Some(Applied::Limited {
            budget: false,
            message: super::tenants::too_many_in_flight(account, max),
            retry_after_sec: 1,
        }));
    }
    if let Some(max) = l.max_runs_per_minute.filter(|max| recent > *max) {
        let wait_ms = oldest.map_or(MINUTE_MS, |t| t.saturating_add(MINUTE_MS).saturating_sub(now));
        let wait = u64::try_from(wait_ms.clamp(1, MINUTE_MS)).unwrap_or(1).div_ceil(1000).max(1);
        return Ok(Some(Applied::Limited {
            budget: false,
            message: super::tenants::too_many_per_minute(account, max, wait),
            retry_after_sec: wait,
        }));
    }
    Ok(None)
}
