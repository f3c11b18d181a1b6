//! Per-account limits, enforced fail-closed: a token budget per period (spend as the LLM proxy
//! records it: the billing truth, stored, so it holds across restarts), live runs at once, and
//! admissions per minute.
//!
//! Admission asks [`Budgets::admit`] (`402 budget_exceeded` / `429 rate_limited`, with when to
//! retry); the LLM proxy asks [`Budgets::allow_call`] before every call and refuses one that would
//! start after the budget is spent, which ends its run `budget_exceeded`. A call that started
//! before is allowed to finish: the account is billed exactly up to the call that crossed the cap.

use crate::store::tenants::{Limits, TenantStore};
use crate::store::writer::Writer;
use crate::store::{now_ms, StoreError, Write};
use dashmap::DashMap;
use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Why an admission is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// `429 rate_limited`: too many runs at once or per minute.
    RateLimited {
        /// A sentence a person can act on.
        message: String,
        /// Seconds until a retry can succeed.
        retry_after_sec: u64,
    },
    /// `402 budget_exceeded`: the account's tokens for this period are spent.
    BudgetExceeded {
        /// A sentence a person can act on.
        message: String,
        /// Seconds until the next period.
        retry_after_sec: u64,
    },
    /// `503 budget_unavailable`: the account has a token budget, but no LLM proxy counts its
    /// tokens (no `CLAWMUX_LLM_UPSTREAM_URL`): fail-closed, its runs are refused rather than run
    /// unmetered.
    Unmetered {
        /// A sentence a person can act on.
        message: String,
    },
}

#[derive(Default)]
struct Account {
    /// Live runs (admitted, not ended).
    live: HashSet<String>,
    /// Admissions of the last minute.
    recent: VecDeque<Instant>,
}

pub use crate::store::tenants::window;

/// What ends a run past its budget.
pub type Cancel = Box<dyn Fn(&str) -> futures_util::future::BoxFuture<'static, ()> + Send + Sync>;

/// Limits and spend of every account.
pub struct Budgets {
    store: Arc<dyn TenantStore>,
    writer: Writer,
    limits: DashMap<String, Limits>,
    /// Spend per (account, window start), loaded from the store on first use.
    spend: DashMap<(String, i64), u64>,
    accounts: DashMap<String, Account>,
    /// True when the LLM proxy counts every call's tokens; without it a token budget cannot hold.
    metered: bool,
    /// True when replicas share the store: live runs and admissions per minute are counted by the
    /// store at admission (over every replica), and spend is read from the store (other replicas
    /// add to it), never from this process's memory alone.
    shared: bool,
    /// Ends a run whose budget is spent (wired to the registry's cancel); resolves once the run's
    /// session has the cancel in its mailbox.
    cancel: OnceLock<Cancel>,
}

impl Budgets {
    /// Loads every account's limits; `metered`: an LLM proxy counts the tokens; `shared`: replicas
    /// share the store (see the field).
    pub async fn load(store: Arc<dyn TenantStore>, writer: Writer, metered: bool, shared: bool) -> Result<Arc<Self>, StoreError> {
        let limits = DashMap::new();
        for (a, l) in store.all_limits().await? {
            if !metered && l.max_tokens.is_some() {
                tracing::warn!(account = %a, "this billing account has a token budget, but no LLM proxy counts tokens (CLAWMUX_LLM_UPSTREAM_URL is not set): its runs are refused");
            }
            limits.insert(a, l);
        }
        Ok(Arc::new(Self { store, writer, limits, spend: DashMap::new(), accounts: DashMap::new(), metered, shared, cancel: OnceLock::new() }))
    }

    /// Re-reads every account's limits (the CLI changes them in the store of a running clawmux).
    pub async fn reload(&self) -> Result<(), StoreError> {
        let all = self.store.all_limits().await?;
        for (a, l) in all {
            self.limits.insert(a, l);
        }
        Ok(())
    }

    /// Sets what ends a run past its budget.
    pub fn on_exceeded(&self, cancel: Cancel) {
        let _ = self.cancel.set(cancel);
    }

    /// An account's limits.
    pub fn limits(&self, account: &str) -> Limits {
        self.limits.get(account).map(|l| *l).unwrap_or_default()
    }

    /// Sets an account's limits (stored first).
    pub async fn set_limits(&self, account: &str, limits: Limits) -> Result<(), StoreError> {
        self.store.set_limits(account, &limits, now_ms()).await?;
        self.limits.insert(account.to_owned(), limits);
        Ok(())
    }

    /// Tokens spent in the current window and the window, when the account has a token budget.
    pub async fn spent(&self, account: &str) -> Result<Option<(u64, (i64, i64))>, StoreError> {
        let l = self.limits(account);
        let (Some(_), Some(period)) = (l.max_tokens, l.period_sec) else { return Ok(None) };
        let w = window(period, now_ms());
        if self.shared {
            // Other replicas' proxies add to the stored spend: what this one has queued is
            // stored first, then the store's sum is the account's.
            self.writer.flush().await;
            return Ok(Some((self.store.spend(account, w.0).await?, w)));
        }
        let key = (account.to_owned(), w.0);
        if let Some(s) = self.spend.get(&key) {
            return Ok(Some((*s, w)));
        }
        // First use of this window here: what is queued for the store counts too.
        self.writer.flush().await;
        let stored = self.store.spend(account, w.0).await?;
        let s = *self.spend.entry(key).or_insert(stored);
        Ok(Some((s, w)))
    }

    /// Why a run of `account` cannot be admitted whatever the store says: the account has a token
    /// budget and nothing here counts tokens (no LLM proxy): fail-closed. Asked before the run is
    /// stored.
    pub fn unmetered(&self, account: &str) -> Option<Refusal> {
        (self.limits(account).max_tokens.is_some() && !self.metered).then(|| Refusal::Unmetered {
            message: format!(
                "billing account {account:?} has a token budget, but this clawmux has no LLM proxy (CLAWMUX_LLM_UPSTREAM_URL) to count its tokens; its runs are refused until one is configured or the budget is removed"
            ),
        })
    }

    /// Admits a run of `account` (it counts as live until [`Budgets::release`]) or says why not;
    /// asked once the run is stored (see [`Budgets::unmetered`] for what is asked before). On a
    /// shared store the store has decided (nothing is counted here).
    pub async fn admit(&self, account: &str, run_id: &str) -> Result<Result<(), Refusal>, StoreError> {
        if self.shared {
            // Tokens spent, live runs and admissions per minute: counted by the store in the
            // admission's own transaction, over every replica (`Applied::Limited`).
            return Ok(Ok(()));
        }
        let l = self.limits(account);
        if let (Some(max), Some((spent, (_, end)))) = (l.max_tokens, self.spent(account).await?) {
            if spent >= max {
                return Ok(Err(Refusal::BudgetExceeded {
                    message: format!(
                        "billing account {account:?} has spent {spent} of its {max} tokens for this period; the next period starts in {} s",
                        secs_until(end)
                    ),
                    retry_after_sec: secs_until(end),
                }));
            }
        }
        // Checked and counted under the account's entry lock: a burst is counted exactly.
        let mut a = self.accounts.entry(account.to_owned()).or_default();
        let now = Instant::now();
        while a.recent.front().is_some_and(|t| now.duration_since(*t) >= Duration::from_secs(60)) {
            a.recent.pop_front();
        }
        if let Some(max) = l.max_concurrent {
            if a.live.len() as u64 >= max {
                return Ok(Err(Refusal::RateLimited {
                    message: format!("billing account {account:?} has {max} runs in flight, its limit; retry when one ends"),
                    retry_after_sec: 1,
                }));
            }
        }
        if let Some(max) = l.max_runs_per_minute {
            if a.recent.len() as u64 >= max {
                let oldest = a.recent.front().map_or(Duration::ZERO, |t| now.duration_since(*t));
                let wait = Duration::from_secs(60).saturating_sub(oldest).as_secs().max(1);
                return Ok(Err(Refusal::RateLimited {
                    message: format!("billing account {account:?} started {max} runs in the last minute, its limit; retry in {wait} s"),
                    retry_after_sec: wait,
                }));
            }
        }
        a.live.insert(run_id.to_owned());
        a.recent.push_back(now);
        Ok(Ok(()))
    }

    /// Counts a run as live without the checks (a run continued after a restart).
    pub fn resume(&self, account: &str, run_id: &str) {
        self.accounts.entry(account.to_owned()).or_default().live.insert(run_id.to_owned());
    }

    /// A run of `account` ended (or its admission failed): it no longer counts.
    pub fn release(&self, account: &str, run_id: &str) {
        if let Some(mut a) = self.accounts.get_mut(account) {
            a.live.remove(run_id);
        }
    }

    /// May a run of `account` start another LLM call? False once the period's tokens are spent.
    pub async fn allow_call(&self, account: &str) -> bool {
        let max = self.limits(account).max_tokens;
        match (max, self.spent(account).await) {
            (Some(max), Ok(Some((spent, _)))) => spent < max,
            (_, Ok(_)) => true,
            // Fail closed: without the stored spend a budget cannot be enforced.
            (Some(_), Err(e)) => {
                tracing::error!(account, error = %e, "cannot read the spend of a budgeted account; refusing its call");
                false
            }
            (None, Err(_)) => true,
        }
    }

    /// The LLM proxy recorded `tokens` for `account`: stored, and counted at once.
    pub fn record(&self, account: &str, tokens: u64) {
        if tokens == 0 {
            return;
        }
        let l = self.limits(account);
        let Some(period) = l.period_sec.filter(|_| l.max_tokens.is_some()) else { return };
        let (start, _) = window(period, now_ms());
        if self.shared {
            // Read back from the store (see `spent`): no copy here to keep up to date.
        } else if let Some(mut s) = self.spend.get_mut(&(account.to_owned(), start)) {
            *s = s.saturating_add(tokens);
        }
        self.writer.submit(Write::Spend { account: account.to_owned(), window_start_ms: start, tokens }, None);
    }

    /// Ends `run_id`: its account's budget is spent. Resolves once the run's session has the cancel
    /// queued: the proxy answers the refused call only then, so the gateway's reaction to that
    /// answer (a failed run) reaches the session after it and the run ends `budget_exceeded`.
    pub async fn exceeded(&self, run_id: &str) {
        if let Some(cancel) = self.cancel.get() {
            cancel(run_id).await;
        }
    }
}

fn secs_until(end_ms: i64) -> u64 {
    u64::try_from((end_ms - now_ms()).max(0)).unwrap_or(0).div_ceil(1000).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::memory::MemoryStore;
    use crate::store::writer::StoreMetrics;

    async fn budgets(account: &str, limits: Limits) -> Arc<Budgets> {
        let store = Arc::new(MemoryStore::new());
        let writer = Writer::start(store.clone(), StoreMetrics::new(&prometheus::Registry::new()).expect("metrics"));
        let b = Budgets::load(store, writer, true, false).await.expect("load");
        b.set_limits(account, limits).await.expect("limits");
        b
    }

    /// Every admission of a burst is polled before any of them completes (one thread, each
    /// future in turn): a check and a count with an await between them would admit them all.
    #[actix_rt::test]
    async fn a_burst_is_counted_exactly() {
        for (limits, admitted) in [
            (Limits { max_concurrent: Some(23), ..Limits::default() }, 23),
            (Limits { max_runs_per_minute: Some(37), ..Limits::default() }, 37),
        ] {
            let b = budgets("acct", limits).await;
            let burst = (0..200).map(|i| {
                let b = b.clone();
                async move { b.admit("acct", &format!("run-{i}")).await.expect("store") }
            });
            let answers = futures_util::future::join_all(burst).await;
            assert_eq!(answers.iter().filter(|a| a.is_ok()).count(), admitted, "{limits:?}");
            assert!(answers.iter().all(|a| matches!(a, Ok(()) | Err(Refusal::RateLimited { .. }))));
        }
    }

    #[actix_rt::test]
    async fn a_released_run_frees_its_place_but_not_its_admission_of_the_minute() {
        let b = budgets("acct", Limits { max_concurrent: Some(1), max_runs_per_minute: Some(2), ..Limits::default() }).await;
        assert_eq!(b.admit("acct", "r1").await, Ok(Ok(())));
        assert!(matches!(b.admit("acct", "r2").await, Ok(Err(Refusal::RateLimited { .. }))), "one at a time");
        assert_eq!(b.admit("other", "r2").await, Ok(Ok(())), "another account has its own limits (none)");
        b.release("acct", "r1");
        assert_eq!(b.admit("acct", "r3").await, Ok(Ok(())));
        b.release("acct", "r3");
        match b.admit("acct", "r4").await {
            Ok(Err(Refusal::RateLimited { retry_after_sec, .. })) => assert!((1..=60).contains(&retry_after_sec), "{retry_after_sec}"),
            other => panic!("two admissions a minute: {other:?}"),
        }
    }

    #[test]
    fn windows_align_to_the_epoch() {
        assert_eq!(window(60, 125_000), (120_000, 180_000));
        assert_eq!(window(86_400, 86_400_000 + 5), (86_400_000, 172_800_000));
        assert_eq!(window(0, 1_500), (1_000, 2_000), "a zero period is one second, not a division by zero");
        assert_eq!(window(u64::MAX, 5).0, 0);
    }
}
