//! The group commit: one task applies every write of the run store.
//!
//! Writers queue a write with a completion; the task takes whatever has queued up (up to
//! [`MAX_BATCH`]), applies it in ONE transaction, then runs the completions in order. While a batch
//! commits the next one fills, so a busy store commits many events per transaction and a quiet one
//! commits each at once: never one fsync per delta, and no timer adding latency.
//!
//! A failed batch is retried write by write, so one bad write (a full disk fails them all anyway)
//! fails only its own run, never the other runs that happened to share its transaction.

use std::collections::HashSet;
use super::{Applied, Store, StoreError, Write};
use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts, Registry};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

/// Writes per transaction at most.
pub const MAX_BATCH: usize = 2048;

/// Writes per transaction at most on a shard's lane: its commit holds up every other task of the
/// shard's thread (frames, streams, requests), ~5 µs per write.
const MAX_SHARD_BATCH: usize = 256;

/// A shard's lane that has this many writes commits at once, without yielding first.
const SHARD_ENOUGH: usize = 32;

/// What to do once a write is applied (or failed).
pub type Done = Box<dyn FnOnce(Result<Applied, StoreError>) + Send>;

#[allow(clippy::large_enum_variant)] // see `Write`
enum Job {
    Write(Write, Option<Done>),
    /// Completes once everything queued before it is applied.
    Flush(oneshot::Sender<()>),
}

/// The store's metrics.
#[derive(Clone)]
pub struct StoreMetrics {
    /// Transactions committed (or failed).
    pub commits: IntCounterVec,
    /// Writes per transaction.
    pub batch_size: Histogram,
    /// Time to apply and commit one batch.
    pub commit_seconds: Histogram,
    /// Writes that failed (their runs end `internal`, their admissions are refused).
    pub write_errors: IntCounter,
}

impl StoreMetrics {
    /// Creates and registers them.
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let m = Self {
            commits: IntCounterVec::new(Opts::new("clawmux_store_commits_total", "Run store transactions by outcome"), &["outcome"])?,
            batch_size: Histogram::with_opts(
                HistogramOpts::new("clawmux_store_batch_writes", "Writes per run store transaction (group commit)")
                    .buckets(vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2048.0]),
            )?,
            commit_seconds: Histogram::with_opts(
                HistogramOpts::new("clawmux_store_commit_seconds", "Time to apply and commit one run store transaction")
                    .buckets(vec![0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0]),
            )?,
            write_errors: IntCounter::new("clawmux_store_write_errors_total", "Run store writes that failed")?,
        };
        for o in ["ok", "failed"] {
            m.commits.with_label_values(&[o]);
        }
        registry.register(Box::new(m.commits.clone()))?;
        registry.register(Box::new(m.batch_size.clone()))?;
        registry.register(Box::new(m.commit_seconds.clone()))?;
        registry.register(Box::new(m.write_errors.clone()))?;
        Ok(m)
    }
}

/// A handle to the writer (cheap to clone): it submits to one lane, and flushes and holds across
/// all of them.
///
/// A store has a main lane, a task on a thread of its own, and, when it commits locally (SQLite,
/// `memory:`: [`Store::commits_locally`]), a lane on each shard (each HTTP worker: see
/// `src/shards.rs`). A run admitted on a shard has its log write through that shard's lane, so its
/// events are committed, made visible and streamed to its caller on the one thread that also runs
/// its session actor: no other thread is woken for them (the main lane's thread cost two wake-ups
/// per event, the largest share of clawmux's CPU per run; BENCHMARKS.md, "Shards are the HTTP
/// workers"). Each lane is a group commit of its own; a run's writes all go through one lane, so
/// they keep their order.
#[derive(Clone)]
pub struct Writer {
    /// Where this handle's writes go.
    lane: Lane,
    /// Every lane of the store.
    all: Arc<Lanes>,
}

/// One group-commit task's queue.
#[derive(Clone)]
struct Lane {
    tx: mpsc::UnboundedSender<Job>,
    /// True from a batch that failed because the store itself was out of reach ([`Store::unreachable`])
    /// until a batch commits again: a write's failure then says nothing about the write, and
    /// runs on a store shared by replicas are suspended rather than ended.
    down: Arc<AtomicBool>,
}

struct Lanes {
    store: Arc<dyn Store>,
    metrics: StoreMetrics,
    /// Runs whose writes are dropped (answered [`Applied::Fenced`], never applied), in every lane:
    /// runs suspended while the store was out of reach. Writes they queued before that must not
    /// land once it answers again: the run goes on from what the store has, under a new log.
    held: Arc<dashmap::DashSet<String>>,
    main: Lane,
    /// The shards' lanes, by thread (a few: one per HTTP worker).
    shards: std::sync::RwLock<Vec<(std::thread::ThreadId, Lane)>>,
}

impl Writer {
    /// Starts the writer's main lane on a thread of its own: commits and the completions that
    /// publish stored events never wait behind the actors' work, nor the actors behind a commit.
    pub fn start(store: Arc<dyn Store>, metrics: StoreMetrics) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let down = Arc::new(AtomicBool::new(false));
        let held = Arc::new(dashmap::DashSet::new());
        let arbiter = actix::Arbiter::new();
        if !arbiter.spawn(run(store.clone(), metrics.clone(), rx, down.clone(), held.clone(), Some(LINGER))) {
            tracing::error!("the run store's writer thread did not start");
        }
        let main = Lane { tx, down };
        let all = Arc::new(Lanes { store, metrics, held, main: main.clone(), shards: std::sync::RwLock::new(Vec::new()) });
        Self { lane: main, all }
    }

    /// Gives the current thread (a shard: an actix arbiter) a lane of its own, when the store
    /// commits locally; a no-op otherwise, or when it has one. Its commits then run on this
    /// thread, between the thread's other tasks: no linger (whatever the thread's tasks submitted
    /// since the last commit makes the next batch).
    pub fn start_lane_here(&self) {
        if !self.all.store.commits_locally() {
            return;
        }
        let me = std::thread::current().id();
        let mut shards = self.all.shards.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if shards.iter().any(|(t, _)| *t == me) {
            return;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let down = Arc::new(AtomicBool::new(false));
        actix::spawn(run(self.all.store.clone(), self.all.metrics.clone(), rx, down.clone(), self.all.held.clone(), None));
        shards.push((me, Lane { tx, down }));
    }

    /// This writer writing through the current thread's lane (a shard's), or the main lane when
    /// the thread has none.
    pub fn here(&self) -> Writer {
        let me = std::thread::current().id();
        let shards = self.all.shards.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        let lane = shards.iter().find(|(t, _)| *t == me).map_or_else(|| self.all.main.clone(), |(_, l)| l.clone());
        Writer { lane, all: self.all.clone() }
    }

    /// True when this handle writes through a shard's lane (tests).
    #[cfg(test)]
    pub fn on_a_shard_lane(&self) -> bool {
        !self.lane.tx.same_channel(&self.all.main.tx)
    }

    /// Drops every write of `run_id` from now on, in every lane, queued ones included, until
    /// [`Self::release`].
    pub fn hold(&self, run_id: &str) {
        self.all.held.insert(run_id.to_owned());
    }

    /// True while `run_id`'s writes are dropped.
    pub fn is_held(&self, run_id: &str) -> bool {
        self.all.held.contains(run_id)
    }

    /// Applies `run_id`'s writes again. Call it after a [`Self::flush`]: the writes queued while it
    /// was held are gone by then.
    pub fn release(&self, run_id: &str) {
        self.all.held.remove(run_id);
    }

    /// True when this lane's last batch failed because the store was out of reach; a completion
    /// sees whether its own write did (completions run one by one, before the next batch).
    pub fn store_down(&self) -> bool {
        self.lane.down.load(Ordering::Acquire)
    }

    /// Queues a write; `done` runs once it is applied. Never blocks.
    pub fn submit(&self, write: Write, done: Option<Done>) {
        if let Err(mpsc::error::SendError(Job::Write(_, Some(done)))) = self.lane.tx.send(Job::Write(write, done)) {
            done(Err(StoreError("the run store's writer has stopped".to_owned())));
        }
    }

    /// Applies one write and waits for it.
    pub async fn apply(&self, write: Write) -> Result<Applied, StoreError> {
        let (tx, rx) = oneshot::channel();
        self.submit(
            write,
            Some(Box::new(move |r| {
                let _ = tx.send(r);
            })),
        );
        rx.await.unwrap_or_else(|_| Err(StoreError("the run store's writer has stopped".to_owned())))
    }

    /// Waits until everything queued so far, in every lane, is applied.
    pub async fn flush(&self) {
        let lanes: Vec<Lane> = {
            let shards = self.all.shards.read().unwrap_or_else(std::sync::PoisonError::into_inner);
            std::iter::once(self.all.main.clone()).chain(shards.iter().map(|(_, l)| l.clone())).collect()
        };
        let mut waits = Vec::with_capacity(lanes.len());
        for lane in lanes {
            let (tx, rx) = oneshot::channel();
            // A lane that is gone (its shard stopped) has nothing left to apply.
            if lane.tx.send(Job::Flush(tx)).is_ok() {
                waits.push(rx);
            }
        }
        for rx in waits {
            let _ = rx.await;
        }
    }
}

/// The run whose log a write adds to (`None`: an admission, spend, a deletion, and what the LLM
/// proxy records for a run: calls that were made and billed, whichever log the run has).
fn run_of_write(w: &Write) -> Option<&str> {
    match w {
        Write::Append { run_id, .. } | Write::Fail { run_id, .. } => Some(run_id),
        Write::Insert(_) | Write::Spend { .. } | Write::Delete { .. } | Write::Usage { .. } | Write::LlmCall { .. } => None,
    }
}

/// True for a write of a run in `failed` other than its end (see `failed` in [`run`]).
fn after_failure(w: &Write, failed: &HashSet<String>) -> bool {
    matches!(w, Write::Append { run_id, .. } if failed.contains(run_id))
}

fn after_failure_error() -> StoreError {
    StoreError("an earlier write of this run failed; the run ended there".to_owned())
}

/// What the LLM proxy records about calls that were made (spend, usage shares, call records):
/// kept and written again when the store was out of reach, since nothing else would (a run goes
/// on through an outage, and so do its calls).
fn is_billing_record(w: &Write) -> bool {
    matches!(w, Write::Spend { .. } | Write::Usage { .. } | Write::LlmCall { .. })
}

/// How long a busy writer waits for more writes before a commit. Measured at C=1,000
/// (BENCHMARKS.md, "The store writer's linger"): 300 µs takes clawmux's CPU per run down ~7% and
/// adds ~0.25 ms to the median delta (p99 unchanged); 1 ms (the runtime's timer) took ~10% off
/// and added ~3 ms. A writer that committed one write last waits for nothing.
const LINGER: std::time::Duration = std::time::Duration::from_micros(300);

/// The most billing records kept for the store's return (the oldest go first beyond it).
const MAX_KEPT: usize = 100_000;

/// How soon kept billing records are tried again when nothing else is written.
const KEPT_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// One lane's group commit. `linger`: how long a busy lane waits for more writes before a commit
/// (the main lane, on a thread of its own); `None` on a shard, whose other tasks must not wait.
async fn run(
    store: Arc<dyn Store>,
    metrics: StoreMetrics,
    mut rx: mpsc::UnboundedReceiver<Job>,
    down: Arc<AtomicBool>,
    held: Arc<dashmap::DashSet<String>>,
    linger: Option<std::time::Duration>,
) {
    let mut jobs = Vec::new();
    // Billing records of batches the store could not take (out of reach), written again first.
    let mut kept: std::collections::VecDeque<Write> = std::collections::VecDeque::new();
    let mut closed = false;
    let mut last_batch = 0usize;
    // Runs a write of which failed for its own reason (not an outage), until their end (`Fail`)
    // is stored: their log ended them at that write, and the end replaces what follows it, so
    // their later writes are not applied. Before, one queued behind the failed one (a `final`
    // with its webhook) could commit: a second webhook, and after a restart a second terminal
    // event, different from the one clients saw.
    let mut failed: HashSet<String> = HashSet::new();
    loop {
        if closed && kept.is_empty() {
            // Every handle is gone and nothing is left to write.
            break;
        }
        tokio::select! {
            n = rx.recv_many(&mut jobs, if linger.is_some() { MAX_BATCH } else { MAX_SHARD_BATCH }), if !closed => closed = n == 0,
            // Nothing new to write: the kept records are tried again on their own.
            () = tokio::time::sleep(KEPT_RETRY), if !kept.is_empty() => {}
        }
        // Under load (the last batch was more than one write), wait a moment for more: one commit
        // and one wake-up of each follower's thread for more events. A thread sleep (this thread
        // is the writer's own): the runtime's timer would wait a whole millisecond or two.
        // On a shard the lane yields instead: it commits after the thread's other ready tasks
        // (the session actors handling the frames of the same burst) have queued their writes,
        // and after the runtime looked for more input once. Without it a shard committed almost
        // every write alone (1.1 writes per commit at C=1,000, against 9 on the main lane).
        let max = if linger.is_some() { MAX_BATCH } else { MAX_SHARD_BATCH };
        if !closed && jobs.len() < max {
            match linger {
                Some(linger) if last_batch > 1 => std::thread::sleep(linger),
                Some(_) => {}
                // Enough for a commit already: a yield would only make its writes wait behind
                // every other task of a busy shard.
                None if jobs.len() >= SHARD_ENOUGH => {}
                None => tokio::task::yield_now().await,
            }
            while jobs.len() < max {
                match rx.try_recv() {
                    Ok(j) => jobs.push(j),
                    Err(_) => break,
                }
            }
        }
        // A run held meanwhile (suspended, lost) is let go of: once released, its writes are a new
        // log's (it was readopted), whose end is not the failed one's.
        if !failed.is_empty() {
            failed.retain(|run| !held.contains(run.as_str()));
        }
        let mut writes: Vec<Write> = kept.drain(..).collect();
        let mut dones: Vec<Option<Done>> = std::iter::repeat_with(|| None).take(writes.len()).collect();
        let mut flushes = Vec::new();
        for job in jobs.drain(..) {
            match job {
                Job::Write(w, d) if run_of_write(&w).is_some_and(|r| held.contains(r)) => {
                    if let Some(d) = d {
                        d(Ok(Applied::Fenced));
                    }
                }
                Job::Write(w, d) if after_failure(&w, &failed) => {
                    if let Some(d) = d {
                        d(Err(after_failure_error()));
                    }
                }
                Job::Write(w, d) => {
                    writes.push(w);
                    dones.push(d);
                }
                Job::Flush(f) => flushes.push(f),
            }
        }
        if !writes.is_empty() {
            let started = Instant::now();
            // Each write's result, and whether it failed because the store was out of reach.
            let (results, lost): (Vec<Result<Applied, StoreError>>, Vec<bool>) = match store.apply(&writes).await {
                Ok(r) if r.len() == writes.len() => {
                    metrics.commits.with_label_values(&["ok"]).inc();
                    (r.into_iter().map(Ok).collect(), vec![false; writes.len()])
                }
                Err(e) if writes.len() > 1 && store.unreachable() => {
                    // Every write would wait for the store and fail alike: their runs end now.
                    metrics.commits.with_label_values(&["failed"]).inc();
                    (vec![Err(e); writes.len()], vec![true; writes.len()])
                }
                first if writes.len() == 1 => {
                    metrics.commits.with_label_values(&["failed"]).inc();
                    let r = first.and_then(|mut r| r.pop().ok_or_else(|| StoreError("the run store returned no result".to_owned())));
                    let lost = r.is_err() && store.unreachable();
                    (vec![r], vec![lost])
                }
                _ => {
                    // Isolate the failing writes: each on its own. The store may drop (and come
                    // back) meanwhile: whether it was out of reach is asked after each write, not
                    // once at the end, so that a write it failed then is kept or suspends its
                    // run like any other lost to an outage.
                    metrics.commits.with_label_values(&["failed"]).inc();
                    let (mut out, mut lost) = (Vec::with_capacity(writes.len()), Vec::with_capacity(writes.len()));
                    let mut failed_here: HashSet<String> = HashSet::new();
                    for w in &writes {
                        // A run's writes after its own failed one are not applied (see `failed`).
                        if after_failure(w, &failed_here) {
                            out.push(Err(after_failure_error()));
                            lost.push(false);
                            continue;
                        }
                        let r = store.apply(std::slice::from_ref(w)).await;
                        if let (Err(_), Write::Append { run_id, .. }) = (&r, w) {
                            if !store.unreachable() {
                                failed_here.insert(run_id.clone());
                            }
                        }
                        metrics.commits.with_label_values(&[if r.is_ok() { "ok" } else { "failed" }]).inc();
                        lost.push(r.is_err() && store.unreachable());
                        out.push(r.and_then(|mut r| r.pop().ok_or_else(|| StoreError("the run store returned no result".to_owned()))));
                    }
                    (out, lost)
                }
            };
            let out_of_reach = lost.iter().any(|l| *l);
            down.store(out_of_reach, Ordering::Release);
            for ((w, r), lost) in writes.iter().zip(&results).zip(&lost) {
                match (w, r) {
                    (Write::Append { run_id, .. }, Err(_)) if !*lost => {
                        failed.insert(run_id.clone());
                    }
                    (Write::Fail { run_id, .. }, Ok(_)) => {
                        failed.remove(run_id);
                    }
                    _ => {}
                }
                if r.is_err() && *lost && is_billing_record(w) {
                    if kept.len() == MAX_KEPT {
                        kept.pop_front();
                        tracing::error!("the run store has been out of reach too long: a billing record of an LLM call was dropped");
                    }
                    kept.push_back(w.clone());
                }
            }
            metrics.batch_size.observe(writes.len() as f64);
            last_batch = writes.len();
            metrics.commit_seconds.observe(started.elapsed().as_secs_f64());
            for ((result, done), lost) in results.into_iter().zip(dones).zip(lost) {
                if let Err(e) = &result {
                    metrics.write_errors.inc();
                    tracing::error!(error = %e, "run store write failed");
                }
                if let Some(done) = done {
                    // A write that failed for its own reason ends its run, even when another
                    // write of the batch was lost to an outage (that one's run is suspended).
                    down.store(lost, Ordering::Release);
                    done(result);
                }
            }
            down.store(out_of_reach, Ordering::Release);
        }
        for f in flushes {
            let _ = f.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{ListQuery, Retention, RunPatch, RunRow};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;

    /// Which batches a probe fails.
    type FailsWhen = Box<dyn Fn(&[Write]) -> bool + Send + Sync>;

    /// A store that records the batches it is given, holds the first one until told, and fails
    /// a batch when `fails` says so.
    struct Probe {
        batches: Mutex<Vec<Vec<String>>>,
        hold: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
        holding: AtomicBool,
        fails: FailsWhen,
        /// Failures are the store's own (a database out of reach), not the writes'.
        down: Arc<AtomicBool>,
    }

    fn run_of(w: &Write) -> String {
        match w {
            Write::Append { run_id, .. } => run_id.clone(),
            _ => String::new(),
        }
    }

    #[async_trait::async_trait]
    impl Store for Probe {
        fn kind(&self) -> &'static str {
            "probe"
        }
        async fn apply(&self, batch: &[Write]) -> Result<Vec<Applied>, StoreError> {
            // On the writer's own thread: blocking it is what a slow commit does.
            let hold = self.hold.lock().expect("hold").take();
            if let Some(rx) = hold {
                self.holding.store(true, Ordering::SeqCst);
                let _ = rx.recv_timeout(std::time::Duration::from_secs(20));
            }
            self.batches.lock().expect("batches").push(batch.iter().map(run_of).collect());
            if (self.fails)(batch) {
                return Err(StoreError("disk full".to_owned()));
            }
            Ok(batch.iter().map(|_| Applied::Done).collect())
        }
        fn unreachable(&self) -> bool {
            self.down.load(Ordering::SeqCst)
        }
        async fn run(&self, _: &str) -> Result<Option<RunRow>, StoreError> {
            Ok(None)
        }
        async fn by_idempotency_key(&self, _: &str, _: &str) -> Result<Option<RunRow>, StoreError> {
            Ok(None)
        }
        async fn raw_events(&self, _: &str, _: u64) -> Result<Vec<super::super::RawEvent>, StoreError> {
            Ok(Vec::new())
        }
        async fn list(&self, _: &ListQuery) -> Result<Vec<RunRow>, StoreError> {
            Ok(Vec::new())
        }
        async fn unfinished(&self) -> Result<Vec<RunRow>, StoreError> {
            Ok(Vec::new())
        }
        async fn sweep(&self, _: Retention, _: i64) -> Result<Vec<String>, StoreError> {
            Ok(Vec::new())
        }
    }

    /// Starts a writer over `probe` (whose first commit it holds) with a write of run "first"
    /// under way: writes submitted until the probe is let go queue behind it.
    async fn start_holding_a_first_commit(probe: &Arc<Probe>) -> (Writer, tokio::task::JoinHandle<Result<Applied, StoreError>>) {
        let writer = Writer::start(probe.clone(), StoreMetrics::new(&Registry::new()).expect("metrics"));
        let first = {
            let writer = writer.clone();
            tokio::spawn(async move { writer.apply(write("first")).await })
        };
        while !probe.holding.load(Ordering::SeqCst) {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        (writer, first)
    }

    fn write(run: &str) -> Write {
        Write::Append { run_id: run.to_owned(), event: None, patch: RunPatch { status: Some("running".into()), ..RunPatch::default() }, webhook: None }
    }

    /// Starts a writer over a probe whose first batch (one write) is held, queues `runs` behind
    /// it, lets it go and returns every result (in completion order) and the probe.
    async fn queue_behind_a_slow_commit(
        runs: &[String],
        fails: impl Fn(&[Write]) -> bool + Send + Sync + 'static,
    ) -> (Vec<(String, Result<Applied, StoreError>)>, Arc<Probe>) {
        queue_behind(runs, fails, false).await
    }

    async fn queue_behind(
        runs: &[String],
        fails: impl Fn(&[Write]) -> bool + Send + Sync + 'static,
        down: bool,
    ) -> (Vec<(String, Result<Applied, StoreError>)>, Arc<Probe>) {
        let (release, hold) = std::sync::mpsc::channel();
        let probe = Arc::new(Probe {
            batches: Mutex::default(),
            hold: Mutex::new(Some(hold)),
            holding: AtomicBool::new(false),
            fails: Box::new(fails),
            down: Arc::new(AtomicBool::new(down)),
        });
        let writer = Writer::start(probe.clone(), StoreMetrics::new(&Registry::new()).expect("metrics"));
        let first = {
            let writer = writer.clone();
            tokio::spawn(async move { writer.apply(write("first")).await })
        };
        let deadline = Instant::now() + std::time::Duration::from_secs(20);
        while !probe.holding.load(Ordering::SeqCst) {
            assert!(Instant::now() < deadline, "the first batch never reached the store");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let results = Arc::new(Mutex::new(Vec::new()));
        let (done_tx, mut done_rx) = mpsc::unbounded_channel();
        for run in runs {
            let (results, run, done_tx) = (results.clone(), run.clone(), done_tx.clone());
            writer.submit(
                write(&run),
                Some(Box::new(move |r| {
                    results.lock().expect("results").push((run, r));
                    let _ = done_tx.send(());
                })),
            );
        }
        release.send(()).expect("release");
        let _ = first.await.expect("first write");
        for _ in runs {
            tokio::time::timeout(std::time::Duration::from_secs(20), done_rx.recv()).await.expect("every waiter is told").expect("open");
        }
        let results = std::mem::take(&mut *results.lock().expect("results"));
        (results, probe)
    }

    /// A run's write that fails for its own reason (a full disk) ends the run there: its later
    /// writes, in the same batch's one-by-one retry or in later batches, are not applied until its
    /// end (`Fail`) is stored. Before, the second write of "r" below (say its `final`, with its
    /// webhook) was committed after the first had failed.
    #[actix_rt::test]
    async fn a_runs_writes_after_its_own_failed_one_are_not_applied_until_its_end_is() {
        let alone = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = alone.clone();
        let (release, hold) = std::sync::mpsc::channel();
        // A batch holding r's write fails; r's first write retried alone fails too; any later
        // write would succeed.
        let probe = Arc::new(Probe {
            batches: Mutex::default(),
            hold: Mutex::new(Some(hold)),
            holding: AtomicBool::new(false),
            fails: Box::new(move |b: &[Write]| b.iter().any(|w| run_of(w) == "r") && (b.len() > 1 || counted.fetch_add(1, Ordering::SeqCst) == 0)),
            down: Arc::new(AtomicBool::new(false)),
        });
        let (writer, first) = start_holding_a_first_commit(&probe).await;
        let results = Arc::new(Mutex::new(Vec::new()));
        let (done_tx, mut done_rx) = mpsc::unbounded_channel();
        for run in ["a", "r", "b", "r"] {
            let (results, done_tx) = (results.clone(), done_tx.clone());
            writer.submit(
                write(run),
                Some(Box::new(move |r: Result<Applied, StoreError>| {
                    results.lock().expect("results").push((run, r.is_ok()));
                    let _ = done_tx.send(());
                })),
            );
        }
        release.send(()).expect("release");
        let _ = first.await.expect("first write");
        for _ in 0..4 {
            tokio::time::timeout(std::time::Duration::from_secs(20), done_rx.recv()).await.expect("every waiter is told").expect("open");
        }
        let told = results.lock().expect("results").clone();
        assert_eq!(told, [("a", true), ("r", false), ("b", true), ("r", false)]);
        let applied_alone = |probe: &Probe| probe.batches.lock().expect("batches").iter().filter(|b| b.as_slice() == ["r"]).count();
        assert_eq!(applied_alone(&probe), 1, "r's second write reached the store after its first failed");
        // A later batch: not applied either.
        assert!(writer.apply(write("r")).await.is_err());
        assert_eq!(applied_alone(&probe), 1);
        // Its end is stored; from then on the run id's writes are applied again.
        let end = crate::store::StoredEvent { id: 2, name: crate::store::EventName::Error, data: "{}".to_owned() };
        let fail = Write::Fail { run_id: "r".to_owned(), event: end, patch: RunPatch::default(), webhook: None };
        assert!(writer.apply(fail).await.is_ok());
        assert!(writer.apply(write("r")).await.is_ok());
        assert_eq!(applied_alone(&probe), 2);
        // A run whose end was never sent (it was suspended meanwhile: its log stopped here) is let
        // go of once held; released (readopted), its new log's writes are applied.
        alone.store(0, Ordering::SeqCst);
        assert!(writer.apply(write("r")).await.is_err(), "r's write fails on its own again");
        assert!(writer.apply(write("r")).await.is_err(), "and the next is not applied");
        writer.hold("r");
        assert!(writer.apply(write("a")).await.is_ok());
        writer.release("r");
        assert!(writer.apply(write("r")).await.is_ok(), "a readopted run's writes are applied");
    }

    #[actix_rt::test]
    async fn writes_queued_behind_a_commit_are_stored_in_one_transaction_and_told_in_order() {
        let runs: Vec<String> = (0..1000).map(|i| format!("run-{i}")).collect();
        let (results, probe) = queue_behind_a_slow_commit(&runs, |_| false).await;
        let batches = probe.batches.lock().expect("batches").clone();
        assert_eq!(batches.len(), 2, "one commit for the held write, ONE for the 1000 queued behind it: {:?}", batches.iter().map(Vec::len).collect::<Vec<_>>());
        assert_eq!(batches[1], runs);
        let told: Vec<&String> = results.iter().map(|(r, _)| r).collect();
        assert_eq!(told, runs.iter().collect::<Vec<_>>(), "waiters told in submission order");
        assert!(results.iter().all(|(_, r)| r.is_ok()));
    }

    #[actix_rt::test]
    async fn a_failed_commit_fails_every_waiter_of_its_batch() {
        let runs: Vec<String> = (0..50).map(|i| format!("run-{i}")).collect();
        // A full disk: every transaction fails, the batch and each write retried alone.
        let (results, probe) = queue_behind_a_slow_commit(&runs, |b| b.iter().any(|w| run_of(w) != "first")).await;
        assert_eq!(results.len(), runs.len());
        for (run, r) in &results {
            assert_eq!(r.as_ref().err().map(|e| e.0.as_str()), Some("disk full"), "{run}");
        }
        assert_eq!(probe.batches.lock().expect("batches").len(), 2 + runs.len());
    }

    #[actix_rt::test]
    async fn a_store_out_of_reach_fails_the_whole_batch_at_once() {
        let runs: Vec<String> = (0..50).map(|i| format!("run-{i}")).collect();
        // Retried one by one, each write would wait for the database again (seconds each).
        let (results, probe) = queue_behind(&runs, |b| b.iter().any(|w| run_of(w) != "first"), true).await;
        assert_eq!(results.len(), runs.len());
        assert!(results.iter().all(|(_, r)| r.is_err()));
        assert_eq!(probe.batches.lock().expect("batches").len(), 2, "the batch was retried write by write");
    }

    /// A writer over a probe that fails every batch while `failing` says so, the store out of
    /// reach (its `down`) to begin with.
    fn out_of_reach() -> (Arc<Probe>, Arc<AtomicBool>, Writer) {
        let failing = Arc::new(AtomicBool::new(true));
        let f = failing.clone();
        let probe = Arc::new(Probe {
            batches: Mutex::default(),
            hold: Mutex::new(None),
            holding: AtomicBool::new(false),
            fails: Box::new(move |_| f.load(Ordering::SeqCst)),
            down: Arc::new(AtomicBool::new(true)),
        });
        let writer = Writer::start(probe.clone(), StoreMetrics::new(&Registry::new()).expect("metrics"));
        (probe, failing, writer)
    }

    /// A waiter of a batch the store failed learns whether the store was out of reach (its run
    /// is then suspended on a shared store, not ended) or the write failed (a full disk); a batch
    /// that commits clears it.
    #[actix_rt::test]
    async fn the_waiters_of_a_failed_batch_know_whether_the_store_was_out_of_reach() {
        let (probe, failing, writer) = out_of_reach();
        let told = |run: &str| {
            let (tx, rx) = oneshot::channel();
            let w = writer.clone();
            writer.submit(
                write(run),
                Some(Box::new(move |r| {
                    let _ = tx.send((r.is_ok(), w.store_down()));
                })),
            );
            rx
        };
        assert_eq!(told("a").await.expect("told"), (false, true), "out of reach");
        probe.down.store(false, Ordering::SeqCst);
        assert_eq!(told("b").await.expect("told"), (false, false), "a write the store refused");
        failing.store(false, Ordering::SeqCst);
        probe.down.store(true, Ordering::SeqCst);
        assert_eq!(told("c").await.expect("told"), (true, false), "committed");
    }

    /// A held run's writes, those already queued included, are dropped (answered `Fenced`),
    /// others' go through; once released (after a flush), its writes are applied again.
    #[actix_rt::test]
    async fn a_held_runs_writes_are_dropped_queued_ones_included_until_released() {
        let runs: Vec<String> = ["a", "held", "b", "held"].iter().map(|s| (*s).to_owned()).collect();
        let (release, hold) = std::sync::mpsc::channel();
        let probe = Arc::new(Probe {
            batches: Mutex::default(),
            hold: Mutex::new(Some(hold)),
            holding: AtomicBool::new(false),
            fails: Box::new(|_| false),
            down: Arc::new(AtomicBool::new(false)),
        });
        let (writer, first) = start_holding_a_first_commit(&probe).await;
        // Queued behind the commit under way, then held.
        let told: Vec<_> = runs
            .iter()
            .map(|r| {
                let (tx, rx) = oneshot::channel();
                writer.submit(
                    write(r),
                    Some(Box::new(move |res| {
                        let _ = tx.send(res);
                    })),
                );
                rx
            })
            .collect();
        writer.hold("held");
        release.send(()).expect("release");
        let _ = first.await.expect("first");
        let mut results = Vec::new();
        for rx in told {
            results.push(rx.await.expect("told").expect("no error"));
        }
        assert_eq!(results, [Applied::Done, Applied::Fenced, Applied::Done, Applied::Fenced]);
        assert_eq!(probe.batches.lock().expect("batches")[1], ["a", "b"], "the held run's writes never reached the store");
        writer.flush().await;
        writer.release("held");
        assert_eq!(writer.apply(write("held")).await.expect("applied"), Applied::Done);
    }

    /// Billing records (spend, usage shares, call records) of a batch the store could not take
    /// because it was out of reach are written again once it answers; other writes are not.
    #[actix_rt::test]
    async fn billing_records_are_written_again_once_the_store_is_back() {
        let (probe, failing, writer) = out_of_reach();
        writer.submit(Write::Spend { account: "acct".into(), window_start_ms: 0, tokens: 7, id: crate::store::BillingId::new() }, None);
        assert!(writer.apply(write("lost")).await.is_err(), "the store is out of reach");
        failing.store(false, Ordering::SeqCst);
        probe.down.store(false, Ordering::SeqCst);
        assert_eq!(writer.apply(write("next")).await.expect("applied"), Applied::Done);
        let batches = probe.batches.lock().expect("batches").clone();
        assert_eq!(batches.last().expect("a batch"), &["".to_owned(), "next".to_owned()], "the spend went again, first; the event did not: {batches:?}");
    }

    /// A batch failed for one bad write is retried write by write; the store drops during that
    /// (a spend fails then) and answers again before the end. The spend is kept and written
    /// again, and its waiter learns that the store was out of reach (its run would be suspended,
    /// not ended), the bad write's that it was not (its run ends). Before, only the last write's
    /// moment was asked: the spend was dropped and a run failed by the outage ended `internal`.
    #[actix_rt::test]
    async fn a_store_that_drops_while_a_batch_is_retried_write_by_write_keeps_its_billing_records() {
        let down = Arc::new(AtomicBool::new(false));
        let singles = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (d, n) = (down.clone(), singles.clone());
        let (release, hold) = std::sync::mpsc::channel();
        let probe = Arc::new(Probe {
            batches: Mutex::default(),
            hold: Mutex::new(Some(hold)),
            holding: AtomicBool::new(false),
            fails: Box::new(move |b| {
                if b.len() > 1 {
                    return b.iter().any(|w| run_of(w) == "bad");
                }
                if run_of(&b[0]) == "first" {
                    return false;
                }
                // The batch [spend, bad, good] retried alone: the store drops for the spend, is
                // back for the rest (the bad write fails on its own).
                match n.fetch_add(1, Ordering::SeqCst) {
                    0 => {
                        d.store(true, Ordering::SeqCst);
                        true
                    }
                    1 => {
                        d.store(false, Ordering::SeqCst);
                        true
                    }
                    _ => false,
                }
            }),
            down: down.clone(),
        });
        // A first commit held: the three writes queue behind it and go as one batch.
        let (writer, first) = start_holding_a_first_commit(&probe).await;
        let (tx, rx) = oneshot::channel();
        let w = writer.clone();
        writer.submit(
            Write::Spend { account: "acct".into(), window_start_ms: 0, tokens: 7, id: crate::store::BillingId::new() },
            Some(Box::new(move |r| {
                let _ = tx.send((r.is_ok(), w.store_down()));
            })),
        );
        let (bad_tx, bad_rx) = oneshot::channel();
        let w = writer.clone();
        writer.submit(
            write("bad"),
            Some(Box::new(move |r| {
                let _ = bad_tx.send((r.is_ok(), w.store_down()));
            })),
        );
        writer.submit(write("good"), None);
        release.send(()).expect("release");
        assert!(first.await.expect("first").is_ok());
        assert_eq!(rx.await.expect("told"), (false, true), "the spend's waiter was not told the store was out of reach");
        assert_eq!(bad_rx.await.expect("told"), (false, false), "the bad write's waiter was told of an outage: its run would be suspended, not ended");
        assert_eq!(writer.apply(write("next")).await.expect("applied"), Applied::Done);
        let batches = probe.batches.lock().expect("batches").clone();
        assert_eq!(batches[1], ["", "bad", "good"], "one batch: {batches:?}");
        assert_eq!(batches.last().expect("a batch"), &["".to_owned(), "next".to_owned()], "the spend was not written again: {batches:?}");
    }

    #[actix_rt::test]
    async fn one_bad_write_fails_only_its_own_waiter() {
        let runs: Vec<String> = (0..50).map(|i| format!("run-{i}")).collect();
        let (results, _) = queue_behind_a_slow_commit(&runs, |b| b.iter().any(|w| run_of(w) == "run-7")).await;
        for (run, r) in &results {
            assert_eq!(r.is_err(), run == "run-7", "{run}: {r:?}");
        }
    }
}
