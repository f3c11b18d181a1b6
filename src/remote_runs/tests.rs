//! [`RemoteRuns`] against a store whose answers each test chooses (no database): what a lookup
//! finds, what happens while it runs, when a run ends.

use super::cache::lock;
use super::*;
use crate::store::memory::MemoryStore;
use crate::store::writer::StoreMetrics;
use crate::store::{Applied, ListQuery, Retention, RunRow, Store, Write};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// What runs while a lookup is under way (after the store read the run, before it is added).
type Meanwhile = Box<dyn FnOnce() + Send>;

/// A store shared by replicas as the LLM proxy sees it: the unfinished runs a test put there,
/// runs that never end unless told, aborts always taken; the rest is a memory store's.
#[derive(Default)]
pub(crate) struct Probe {
    /// Runs, writes and everything else.
    mem: MemoryStore,
    /// The unfinished runs, by what names them.
    live: Mutex<HashMap<CallKey, LiveRun>>,
    /// Lookups asked.
    pub(crate) lookups: AtomicUsize,
    /// Looks for ends asked.
    pub(crate) end_looks: AtomicUsize,
    /// Happens during the next lookup.
    meanwhile: Mutex<Option<Meanwhile>>,
    /// Looks for ends fail (the database out of reach) while set.
    pub(crate) ends_fail: std::sync::atomic::AtomicBool,
    /// Runs the next look for ends finds ended.
    pub(crate) ended: Mutex<Vec<String>>,
    /// Writes fail (the database out of reach for them) while set; reads still answer.
    pub(crate) writes_fail: std::sync::atomic::AtomicBool,
    /// Runs another replica took over: not taken back here.
    pub(crate) taken_over: Mutex<Vec<String>>,
    /// Writes wait for this to be let go while set (a commit that takes long).
    pub(crate) writes_stall: Mutex<Option<Arc<tokio::sync::Semaphore>>>,
}


impl Probe {
    /// Stores an unfinished run of `account` with trace id `trace`.
    pub(crate) fn put(&self, run_id: &str, account: &str, trace: &str) {
        let run = LiveRun {
            run_id: run_id.to_owned(),
            billing_account_id: account.to_owned(),
            graph_id: "g".to_owned(),
            session_key: format!("agent:main:{run_id}"),
            trace_id: trace.to_owned(),
            token: None,
            share: crate::attribution::Usage::default(),
        };
        lock(&self.live).insert(CallKey::Trace(trace.to_owned()), run);
    }

    /// `f` happens during the next lookup, once the store has read the run.
    pub(crate) fn meanwhile(&self, f: Meanwhile) {
        *lock(&self.meanwhile) = Some(f);
    }
}

#[async_trait::async_trait]
impl Store for Probe {
    fn kind(&self) -> &'static str {
        "probe"
    }
    async fn apply(&self, batch: &[Write]) -> Result<Vec<Applied>, StoreError> {
        let stall = lock(&self.writes_stall).clone();
        if let Some(stall) = stall {
            let _ = stall.acquire().await;
        }
        if self.writes_fail.load(Ordering::SeqCst) {
            return Err(StoreError("the run store is out of reach (probe)".into()));
        }
        self.mem.apply(batch).await
    }
    async fn run(&self, run_id: &str) -> Result<Option<RunRow>, StoreError> {
        self.mem.run(run_id).await
    }
    async fn by_idempotency_key(&self, account: &str, key: &str) -> Result<Option<RunRow>, StoreError> {
        self.mem.by_idempotency_key(account, key).await
    }
    async fn raw_events(&self, run_id: &str, after: u64) -> Result<Vec<crate::store::RawEvent>, StoreError> {
        self.mem.raw_events(run_id, after).await
    }
    async fn list(&self, query: &ListQuery) -> Result<Vec<RunRow>, StoreError> {
        self.mem.list(query).await
    }
    async fn unfinished(&self) -> Result<Vec<RunRow>, StoreError> {
        self.mem.unfinished().await
    }
    async fn readopt(&self, _lease: &crate::store::Lease, run_ids: &[String]) -> Result<Vec<RunRow>, StoreError> {
        let taken = lock(&self.taken_over).clone();
        Ok(self.mem.unfinished().await?.into_iter().filter(|r| run_ids.contains(&r.run_id) && !taken.contains(&r.run_id)).collect())
    }
    async fn sweep(&self, retention: Retention, now_ms: i64) -> Result<Vec<String>, StoreError> {
        self.mem.sweep(retention, now_ms).await
    }
    fn shared(&self) -> bool {
        true
    }
    async fn live_run(&self, key: &CallKey) -> Result<Option<LiveRun>, StoreError> {
        self.lookups.fetch_add(1, Ordering::SeqCst);
        let found = lock(&self.live).get(key).cloned();
        let meanwhile = lock(&self.meanwhile).take();
        if let Some(f) = meanwhile {
            f();
        }
        Ok(found)
    }
    async fn ended(&self, run_ids: &[String]) -> Result<Vec<String>, StoreError> {
        self.end_looks.fetch_add(1, Ordering::SeqCst);
        if self.ends_fail.load(Ordering::SeqCst) {
            return Err(StoreError("the run store is out of reach (probe)".into()));
        }
        Ok(std::mem::take(&mut *lock(&self.ended)).into_iter().filter(|r| run_ids.contains(r)).collect())
    }
    async fn request_abort(&self, _run_id: &str, _reason: AbortReason) -> Result<bool, StoreError> {
        Ok(true)
    }
}

/// Remote runs over `probe`, misses believed longer than any test runs; and their registry.
pub(crate) async fn remote_runs(probe: Arc<Probe>) -> (Arc<RemoteRuns>, Arc<Attributions>) {
    remote_runs_heard_within(probe, HEARD_WITHIN).await
}

/// The same, the store's answers trusted for `heard_within`.
pub(crate) async fn remote_runs_heard_within(probe: Arc<Probe>, heard_within: Duration) -> (Arc<RemoteRuns>, Arc<Attributions>) {
    let metrics = StoreMetrics::new(&prometheus::Registry::new()).expect("metrics");
    let retention = Retention { max_age_ms: i64::MAX, max_count: usize::MAX };
    let tenants = Arc::new(MemoryStore::new());
    let store = RunStore::with_backend(probe, tenants.clone(), retention, metrics, "probe:".into(), None);
    let budgets = Budgets::load(tenants, store.writer(), true, true).await.expect("budgets");
    let attributions = Arc::new(Attributions::new());
    (RemoteRuns::with_ttls(store, attributions.clone(), budgets, Duration::from_secs(3600), heard_within), attributions)
}

const TRACE: &str = "0af7651916cd43dd8448eb211c80319c";

#[actix_rt::test]
async fn a_run_found_live_is_kept_as_a_remote_run() {
    let probe = Arc::new(Probe::default());
    probe.put("r1", "acct", TRACE);
    let (remote, attributions) = remote_runs(probe.clone()).await;
    let found = remote.find(&CallKey::Trace(TRACE.into())).await;
    assert!(matches!(&found, Ok(cache::Resolved::Found(b)) if b.run_id == "r1"), "{found:?}");
    assert_eq!(attributions.remote_runs(), ["r1"]);
}

#[actix_rt::test]
async fn a_run_whose_end_is_heard_while_it_is_looked_up_is_not_kept() {
    let probe = Arc::new(Probe::default());
    probe.put("r1", "acct-old", TRACE);
    let (remote, attributions) = remote_runs(probe.clone()).await;
    // The store read r1 as unfinished; its end (`clawmux_ended`) is handled before it is added.
    let weak = Arc::downgrade(&remote);
    probe.meanwhile(Box::new(move || {
        if let Some(r) = weak.upgrade() {
            r.ended("r1");
        }
    }));
    let found = remote.find(&CallKey::Trace(TRACE.into())).await;
    assert!(matches!(found, Ok(cache::Resolved::Missing)), "an ended run is no live run: {found:?}");
    assert!(attributions.lookup(TRACE).is_none() && attributions.remote_runs().is_empty(), "kept until the next poll");
    // And its calls are not counted as a hit later: the lookup's answer was a miss.
    assert!(matches!(remote.find(&CallKey::Trace(TRACE.into())).await, Ok(cache::Resolved::MissingCached)));
}

/// A miss does not wait for the store's writer: a flood of calls with unknown keys would each
/// wait for a commit (or for a store slow to take one). A hit still reads the run's share after
/// this process's own writes are stored.
#[actix_rt::test]
async fn a_miss_does_not_wait_for_a_commit_and_a_hit_does() {
    let probe = Arc::new(Probe::default());
    let (remote, _) = remote_runs(probe.clone()).await;
    let stall = Arc::new(tokio::sync::Semaphore::new(0));
    *lock(&probe.writes_stall) = Some(stall.clone());
    remote.store.writer().submit(Write::Delete { run_id: "gone".into() }, None);
    let miss = tokio::time::timeout(Duration::from_secs(2), remote.find(&CallKey::Trace(TRACE.into()))).await;
    assert!(matches!(miss, Ok(Ok(cache::Resolved::Missing))), "a miss waited for the stalled commit: {miss:?}");
    probe.put("r1", "acct", "1af7651916cd43dd8448eb211c80319c");
    let hit = tokio::spawn({
        let remote = remote.clone();
        async move { remote.find(&CallKey::Trace("1af7651916cd43dd8448eb211c80319c".into())).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!hit.is_finished(), "a hit read the share before this process's writes were stored");
    stall.add_permits(1_000);
    let hit = tokio::time::timeout(Duration::from_secs(5), hit).await.expect("the hit ends").expect("task");
    assert!(matches!(&hit, Ok(cache::Resolved::Found(b)) if b.run_id == "r1"), "{hit:?}");
    // The miss once; the hit twice: its share is read again once this process's writes are in.
    assert_eq!(probe.lookups.load(Ordering::SeqCst), 3);
}

#[actix_rt::test]
async fn a_believed_miss_is_told_from_a_fresh_one() {
    let probe = Arc::new(Probe::default());
    let (remote, _) = remote_runs(probe.clone()).await;
    let key = CallKey::Trace(TRACE.into());
    assert!(matches!(remote.find(&key).await, Ok(cache::Resolved::Missing)));
    // A run admitted right after with that trace id: not seen while the miss is believed, and
    // said so (the proxy answers 503, the gateway retries) rather than refused as nobody's.
    probe.put("r1", "acct", TRACE);
    assert!(matches!(remote.find(&key).await, Ok(cache::Resolved::MissingCached)));
    assert_eq!(probe.lookups.load(Ordering::SeqCst), 1);
}

#[actix_rt::test]
async fn a_budget_stop_is_over_when_the_end_is_told_not_after_polling() {
    let probe = Arc::new(Probe::default());
    let (remote, _) = remote_runs(probe.clone()).await;
    let stop = {
        let remote = remote.clone();
        tokio::spawn(async move { remote.stop_for_budget("r1").await })
    };
    // Bounded: the stop looks at the store once at first.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while probe.end_looks.load(Ordering::SeqCst) == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the stop never looked at the store");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(remote.waiting_for_ends(), 1);
    remote.ended("r1");
    // Well under the stop's own bound (3 s): it was woken, it did not wait that out.
    tokio::time::timeout(Duration::from_secs(2), stop).await.expect("woken by the end").expect("task");
    assert!(probe.end_looks.load(Ordering::SeqCst) <= 2, "polled the store: {}", probe.end_looks.load(Ordering::SeqCst));
    assert_eq!(remote.waiting_for_ends(), 0, "the wait is forgotten");
}

#[actix_rt::test]
async fn a_budget_stop_whose_caller_went_away_forgets_its_wait() {
    let probe = Arc::new(Probe::default());
    let (remote, _) = remote_runs(probe.clone()).await;
    let mut first = Box::pin(remote.stop_for_budget("r1"));
    let mut second = Box::pin(remote.stop_for_budget("r1"));
    assert!(futures_util::poll!(first.as_mut()).is_pending() && futures_util::poll!(second.as_mut()).is_pending());
    assert_eq!(remote.waiting_for_ends(), 1, "one entry per run");
    drop(first);
    assert_eq!(remote.waiting_for_ends(), 1, "the other stop still waits");
    drop(second);
    assert_eq!(remote.waiting_for_ends(), 0);
}

/// A replica cut from the database cannot hear a remote run's end: its remote runs count as
/// live only while the store answered recently (a lookup, or a look for ends), and a look that
/// finds ends revokes them before the store counts as heard again.
#[actix_rt::test]
async fn remote_runs_are_trusted_only_while_the_store_answers() {
    let probe = Arc::new(Probe::default());
    probe.put("r1", "acct", TRACE);
    let (remote, attributions) = remote_runs_heard_within(probe.clone(), Duration::from_millis(200)).await;
    assert!(!remote.ends_heard(), "nothing heard yet");
    assert!(matches!(remote.find(&CallKey::Trace(TRACE.into())).await, Ok(cache::Resolved::Found(_))));
    assert!(remote.ends_heard(), "the lookup was an answer");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!remote.ends_heard(), "no answer for longer than trusted");
    probe.ends_fail.store(true, Ordering::SeqCst);
    assert!(remote.look_for_ends().await.is_err());
    assert!(!remote.ends_heard(), "a failed look is no answer");
    probe.ends_fail.store(false, Ordering::SeqCst);
    lock(&probe.ended).push("r1".into());
    remote.look_for_ends().await.expect("the store answers again");
    assert!(remote.ends_heard());
    assert!(attributions.remote_runs().is_empty() && attributions.lookup(TRACE).is_none(), "the end it found was revoked");
}
