//! Per-account limits, enforced fail-closed: a token budget per period (spend as the LLM proxy
//! records it: the billing truth, stored, so it holds across restarts), live runs at once, and
//! admissions per minute.
//!
//! Admission asks [`Budgets::admit`] (`402 budget_exceeded` / `429 rate_limited`, with when to
//! retry); the LLM proxy asks [`Budgets::check_call`] before every call and refuses one that would
//! start after the budget is spent, which ends its run `budget_exceeded`. A call that started
//! before is allowed to finish: the account is billed exactly up to the call that crossed the cap.
//! A spend that cannot be read (the store does not answer) refuses the call too, but only for now
//! ([`CallBudget::Unknown`]): the run goes on and the gateway retries the call.

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

/// Whether a run may start another LLM call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallBudget {
    /// The account has no token budget, or has tokens left in this period.
    Allowed,
    /// The period's tokens are spent: the call is refused and the run ends `budget_exceeded`.
    Exceeded,
    /// The spend cannot be read now (the store does not answer): the call is not forwarded
    /// (fail-closed), but nothing is known against the run, which goes on; the call is retried.
    Unknown,
}

/// How long an LLM call goes by the spend last read from a store shared by replicas (per account
/// and window) instead of flushing this replica's writes and querying the store again: every call
/// of a budgeted account would otherwise cost both. Other replicas' spend of this last moment may
/// be missed for so long (a call or two past the budget at most); this replica's own is added to
/// what was read at once ([`Budgets::record`]).
pub const SHARED_SPEND_TTL: Duration = Duration::from_millis(500);

/// A spend read from a shared store, and when.
#[derive(Debug, Clone, Copy)]
struct RecentSpend {
    /// The window it is the spend of (an entry of an earlier window is stale whatever its age).
    window_start: i64,
    /// Tokens spent in it: as read, plus what this replica recorded since.
    tokens: u64,
    /// When it was read.
    read_at: Instant,
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
    /// The spend the LLM proxy read from a shared store lately, per account (see
    /// [`SHARED_SPEND_TTL`]); one entry per budgeted account, replaced each window.
    recent_spend: DashMap<String, RecentSpend>,
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
        Ok(Arc::new(Self {
            store,
            writer,
            limits,
            spend: DashMap::new(),
            recent_spend: DashMap::new(),
            accounts: DashMap::new(),
            metered,
            shared,
            cancel: OnceLock::new(),
        }))
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
                    message: crate::store::tenants::budget_spent(account, spent, max, secs_until(end)),
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
                    message: crate::store::tenants::too_many_in_flight(account, max),
                    retry_after_sec: 1,
                }));
            }
        }
        if let Some(max) = l.max_runs_per_minute {
            if a.recent.len() as u64 >= max {
                let oldest = a.recent.front().map_or(Duration::ZERO, |t| now.duration_since(*t));
                let wait = Duration::from_secs(60).saturating_sub(oldest).as_secs().max(1);
                return Ok(Err(Refusal::RateLimited {
                    message: crate::store::tenants::too_many_per_minute(account, max, wait),
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

    /// May a run of `account` start another LLM call? [`CallBudget::Exceeded`] once the period's
    /// tokens are spent; [`CallBudget::Unknown`] while the spend cannot be read.
    pub async fn check_call(&self, account: &str) -> CallBudget {
        self.check_call_at(account, Instant::now()).await
    }

    /// [`Self::check_call`] at `now` (what the recent spend's age is judged by).
    async fn check_call_at(&self, account: &str, now: Instant) -> CallBudget {
        let l = self.limits(account);
        let (Some(max), Some(period)) = (l.max_tokens, l.period_sec) else { return CallBudget::Allowed };
        let spent = if self.shared { self.recent_shared_spend(account, period, now).await } else { self.spent(account).await.map(|s| s.map_or(0, |(s, _)| s)) };
        match spent {
            Ok(spent) if spent < max => CallBudget::Allowed,
            Ok(_) => CallBudget::Exceeded,
            // Fail closed, but only for now: a store that does not answer says nothing about the
            // run, which must not end `budget_exceeded` for it.
            Err(e) => {
                tracing::error!(account, error = %e, "cannot read the spend of a budgeted account; its LLM call is refused for now (retried), its run goes on");
                CallBudget::Unknown
            }
        }
    }

    /// The spend of `account` in the current window of `period` as a store shared by replicas has
    /// it, read at most every [`SHARED_SPEND_TTL`].
    async fn recent_shared_spend(&self, account: &str, period: u64, now: Instant) -> Result<u64, StoreError> {
        let (start, _) = window(period, now_ms());
        if let Some(r) = self.recent_spend.get(account).filter(|r| r.window_start == start && now.saturating_duration_since(r.read_at) < SHARED_SPEND_TTL) {
            return Ok(r.tokens);
        }
        // What this replica has queued is stored first: the store's sum is then the account's.
        self.writer.flush().await;
        let tokens = self.store.spend(account, start).await?;
        self.recent_spend.insert(account.to_owned(), RecentSpend { window_start: start, tokens, read_at: now });
        Ok(tokens)
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
            // Read back from the store (see `spent`); the spend read lately for the LLM proxy's
            // checks counts this replica's own calls at once.
            if let Some(mut r) = self.recent_spend.get_mut(account).filter(|r| r.window_start == start) {
                r.tokens = r.tokens.saturating_add(tokens);
            }
        } else if let Some(mut s) = self.spend.get_mut(&(account.to_owned(), start)) {
            *s = s.saturating_add(tokens);
        }
        self.writer.submit(Write::Spend { account: account.to_owned(), window_start_ms: start, tokens, id: crate::store::BillingId::new() }, None);
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
pub(crate) mod tests {
    use super::*;
    use crate::store::memory::MemoryStore;
    use crate::store::tenants::{DeliveryOutcome, KeyRecord, OutboxItem};
    use crate::store::writer::StoreMetrics;
    use crate::store::Store;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// A tenant store whose spend cannot be read while `down` is set (a database out of reach),
    /// counting the reads; everything else is a memory store's.
    pub(crate) struct FlakySpend {
        /// The store behind it (also the writer's: recorded spend lands there).
        pub(crate) inner: Arc<MemoryStore>,
        /// Spend reads fail while set.
        pub(crate) down: AtomicBool,
        /// Spend reads asked.
        pub(crate) reads: AtomicUsize,
    }

    #[async_trait::async_trait]
    impl TenantStore for FlakySpend {
        async fn create_key(&self, key: &KeyRecord) -> Result<(), StoreError> {
            self.inner.create_key(key).await
        }
        async fn key(&self, id: &str) -> Result<Option<KeyRecord>, StoreError> {
            self.inner.key(id).await
        }
        async fn keys(&self) -> Result<Vec<KeyRecord>, StoreError> {
            self.inner.keys().await
        }
        async fn revoke_key(&self, id: &str, at_ms: i64) -> Result<bool, StoreError> {
            self.inner.revoke_key(id, at_ms).await
        }
        async fn claim_branch(&self, branch_key: &str, account: &str, at_ms: i64, claim: &str) -> Result<crate::store::tenants::BranchClaim, StoreError> {
            self.inner.claim_branch(branch_key, account, at_ms, claim).await
        }
        async fn release_branch(&self, branch_key: &str, claim: &str) -> Result<(), StoreError> {
            self.inner.release_branch(branch_key, claim).await
        }
        async fn branch_owner(&self, branch_key: &str) -> Result<Option<String>, StoreError> {
            self.inner.branch_owner(branch_key).await
        }
        async fn limits(&self, account: &str) -> Result<Option<Limits>, StoreError> {
            self.inner.limits(account).await
        }
        async fn all_limits(&self) -> Result<Vec<(String, Limits)>, StoreError> {
            self.inner.all_limits().await
        }
        async fn set_limits(&self, account: &str, limits: &Limits, at_ms: i64) -> Result<(), StoreError> {
            self.inner.set_limits(account, limits, at_ms).await
        }
        async fn spend(&self, account: &str, window_start_ms: i64) -> Result<u64, StoreError> {
            self.reads.fetch_add(1, Ordering::SeqCst);
            if self.down.load(Ordering::SeqCst) {
                return Err(StoreError("the database is out of reach".into()));
            }
            self.inner.spend(account, window_start_ms).await
        }
        async fn due_deliveries(&self, now_ms: i64, limit: usize) -> Result<Vec<OutboxItem>, StoreError> {
            self.inner.due_deliveries(now_ms, limit).await
        }
        async fn record_delivery(&self, id: i64, outcome: &DeliveryOutcome, at_ms: i64) -> Result<(), StoreError> {
            self.inner.record_delivery(id, outcome, at_ms).await
        }
        async fn deliveries_of(&self, run_id: &str) -> Result<Vec<(u32, bool, bool, Option<String>)>, StoreError> {
            self.inner.deliveries_of(run_id).await
        }
    }

    /// Budgets over a [`FlakySpend`] store (`shared`: as replicas sharing it), `account` with a
    /// budget of `max` tokens a day; the number of runs ended for their budget is counted.
    pub(crate) async fn flaky_budgets(account: &str, max: u64, shared: bool) -> (Arc<Budgets>, Arc<FlakySpend>, Arc<AtomicUsize>) {
        let inner = Arc::new(MemoryStore::new());
        let store = Arc::new(FlakySpend { inner: inner.clone(), down: AtomicBool::new(false), reads: AtomicUsize::new(0) });
        let writer = Writer::start(inner, StoreMetrics::new(&prometheus::Registry::new()).expect("metrics"));
        let b = Budgets::load(store.clone(), writer, true, shared).await.expect("load");
        b.set_limits(account, Limits { max_tokens: Some(max), period_sec: Some(86_400), ..Limits::default() }).await.expect("limits");
        let ended = Arc::new(AtomicUsize::new(0));
        let counted = ended.clone();
        b.on_exceeded(Box::new(move |_| {
            counted.fetch_add(1, Ordering::SeqCst);
            Box::pin(async {})
        }));
        (b, store, ended)
    }

    #[actix_rt::test]
    async fn a_spend_that_cannot_be_read_refuses_the_call_for_now_and_is_no_budget_stop() {
        for shared in [false, true] {
            let (b, store, _) = flaky_budgets("acct", 100, shared).await;
            store.down.store(true, Ordering::SeqCst);
            assert_eq!(b.check_call("acct").await, CallBudget::Unknown, "shared: {shared}");
            assert_eq!(b.check_call("no-budget").await, CallBudget::Allowed, "an account without a budget reads nothing");
            store.down.store(false, Ordering::SeqCst);
            assert_eq!(b.check_call("acct").await, CallBudget::Allowed, "shared: {shared}");
            // This process's own calls count at once (shared: on top of the spend read lately).
            b.record("acct", 150);
            assert_eq!(b.check_call("acct").await, CallBudget::Exceeded, "shared: {shared}");
        }
    }

    #[actix_rt::test]
    async fn the_spend_of_a_shared_store_is_read_at_most_every_ttl_per_account() {
        let (b, store, _) = flaky_budgets("acct", 100, true).await;
        let t0 = Instant::now();
        let reads = || store.reads.load(Ordering::SeqCst);
        assert_eq!(b.check_call_at("acct", t0).await, CallBudget::Allowed);
        assert_eq!(reads(), 1);
        assert_eq!(b.check_call_at("acct", t0 + SHARED_SPEND_TTL / 2).await, CallBudget::Allowed);
        assert_eq!(reads(), 1, "read lately: not read again");
        // Another replica spent the budget meanwhile: seen at the next read.
        store.inner.apply(&[Write::Spend { account: "acct".into(), window_start_ms: window(86_400, now_ms()).0, tokens: 100, id: crate::store::BillingId::new() }]).await.expect("spend");
        assert_eq!(b.check_call_at("acct", t0 + SHARED_SPEND_TTL).await, CallBudget::Exceeded);
        assert_eq!(reads(), 2);
        // A read that fails is not kept: the next call asks again.
        store.down.store(true, Ordering::SeqCst);
        assert_eq!(b.check_call_at("acct", t0 + SHARED_SPEND_TTL * 2).await, CallBudget::Unknown);
        store.down.store(false, Ordering::SeqCst);
        assert_eq!(b.check_call_at("acct", t0 + SHARED_SPEND_TTL * 2).await, CallBudget::Exceeded);
        assert_eq!(reads(), 4);
    }

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
