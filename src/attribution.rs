//! Which live run owns an LLM call: trace id → the run's billing identity, and the usage its calls
//! reported.
//!
//! A run is registered before it is admitted (the gateway may call the LLM right after `agent`) and
//! removed when its terminal event is emitted: an LLM call whose trace id belongs to no live run is
//! refused by the proxy (fail-closed). Two live runs can never share a trace id: the second is
//! refused at admission, otherwise its calls could not be told apart.
//!
//! With a store shared by replicas the registry also holds REMOTE runs: live runs another replica
//! owns whose calls this proxy forwarded (found through the store, see [`crate::remote_runs`]), until
//! they end. A process has one [`RunBilling`] per run, whichever role it has: a takeover adopts
//! the remote entry as its own run (its counters are this process's share of the run's usage),
//! so no two counters of one process ever write the same share.

use dashmap::DashMap;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use crate::expiring::ExpiringKeys;

/// The billing identity of a run and the usage of its LLM calls so far.
#[derive(Debug)]
pub struct RunBilling {
    /// API run id.
    pub run_id: String,
    /// Billing account (LiteLLM end user).
    pub billing_account_id: String,
    /// Graph id.
    pub graph_id: String,
    /// Canonical session key.
    pub session_key: String,
    /// Attempt number (0 for the first).
    pub attempt: u32,
    /// The trace id the run's LLM calls carry.
    pub trace_id: String,
    /// Input tokens reported by the upstream, summed.
    pub input_tokens: AtomicU64,
    /// Output tokens reported by the upstream, summed.
    pub output_tokens: AtomicU64,
    /// Proxied LLM calls.
    pub llm_calls: AtomicU64,
    /// The per-run token of protocol-3 attribution (carried in `extraSystemPrompt`).
    pub token: Option<String>,
    /// Cancelled when the run ends: the proxy cuts the run's in-flight LLM streams with it (on
    /// protocol 3 this is what stops an aborted run's LLM stream).
    pub revoked: tokio_util::sync::CancellationToken,
    /// Told the totals after every change, so the run store keeps them across restarts.
    on_usage: std::sync::OnceLock<UsageHook>,
    /// Orders the totals handed to `on_usage` (see `changed`).
    usage_order: std::sync::Mutex<()>,
    /// The other replicas' shares of the run's usage (a store shared by replicas), by replica id:
    /// the run's usage is this process's totals plus these.
    others: Mutex<HashMap<String, Usage>>,
    /// Set when the run is suspended here (the shared store is out of reach, see
    /// `RunLog::suspend`): another replica may take it over and end it meanwhile, and a run of
    /// another account may then take its trace id, so its NEW calls are not attributed to it
    /// (answered `503`, retried by the gateway) while the streams in flight go on. The entry is
    /// dropped when the run is found taken over; taken back, it is kept ([`Attributions::demote`]).
    suspended: AtomicBool,
}

/// The run store's hook for usage totals.
struct UsageHook(Box<dyn Fn(Usage, u64) + Send + Sync>);

impl std::fmt::Debug for UsageHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UsageHook")
    }
}

/// A run's LLM usage so far: the proxy's totals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    /// Input tokens reported by the upstream, summed.
    pub input_tokens: u64,
    /// Output tokens reported by the upstream, summed.
    pub output_tokens: u64,
    /// Proxied LLM calls.
    pub llm_calls: u64,
}

impl Usage {
    /// The larger of two readings of one run's usage, counter by counter. Each counter only
    /// grows, so each reading is a lower bound of the truth and so is their maximum.
    pub fn at_least(self, other: Usage) -> Usage {
        Usage {
            input_tokens: self.input_tokens.max(other.input_tokens),
            output_tokens: self.output_tokens.max(other.output_tokens),
            llm_calls: self.llm_calls.max(other.llm_calls),
        }
    }
}



impl RunBilling {
    /// A run's billing identity with no usage yet.
    pub fn new(run_id: &str, billing_account_id: &str, graph_id: &str, session_key: &str, trace_id: &str) -> Self {
        Self {
            run_id: run_id.to_owned(),
            billing_account_id: billing_account_id.to_owned(),
            graph_id: graph_id.to_owned(),
            session_key: session_key.to_owned(),
            attempt: 0,
            trace_id: trace_id.to_owned(),
            input_tokens: AtomicU64::new(0),
            output_tokens: AtomicU64::new(0),
            llm_calls: AtomicU64::new(0),
            token: None,
            revoked: tokio_util::sync::CancellationToken::new(),
            on_usage: std::sync::OnceLock::new(),
            usage_order: std::sync::Mutex::new(()),
            others: Mutex::new(HashMap::new()),
            suspended: AtomicBool::new(false),
        }
    }

    /// The run is suspended here: its new calls are no longer attributed to it (see the field).
    pub fn suspend(&self) {
        self.suspended.store(true, Ordering::SeqCst);
    }

    /// True once the run is suspended here.
    pub fn is_suspended(&self) -> bool {
        self.suspended.load(Ordering::SeqCst)
    }

    fn others(&self) -> MutexGuard<'_, HashMap<String, Usage>> {
        lock(&self.others)
    }

    /// Another replica's share of the run's usage (absolute totals, which only grow: a share heard
    /// out of order, or read while a newer one was notified, never lowers what is known).
    pub fn note_share(&self, replica: &str, share: Usage) {
        let mut others = self.others();
        let known = others.entry(replica.to_owned()).or_default();
        *known = Usage {
            input_tokens: known.input_tokens.max(share.input_tokens),
            output_tokens: known.output_tokens.max(share.output_tokens),
            llm_calls: known.llm_calls.max(share.llm_calls),
        };
    }

    /// The run's usage as this process knows it: its own totals plus the other replicas' shares.
    pub fn run_totals(&self) -> Usage {
        self.others().values().fold(self.totals(), |a, b| Usage {
            input_tokens: a.input_tokens.saturating_add(b.input_tokens),
            output_tokens: a.output_tokens.saturating_add(b.output_tokens),
            llm_calls: a.llm_calls.saturating_add(b.llm_calls),
        })
    }

    /// Continues the totals of a run resumed after a restart.
    pub fn with_usage(self, usage: Usage) -> Self {
        self.input_tokens.store(usage.input_tokens, Ordering::Relaxed);
        self.output_tokens.store(usage.output_tokens, Ordering::Relaxed);
        self.llm_calls.store(usage.llm_calls, Ordering::Relaxed);
        self
    }

    /// Sets the hook told the totals (and the tokens just added) after every change (once).
    pub fn on_usage(&self, hook: Box<dyn Fn(Usage, u64) + Send + Sync>) {
        let _ = self.on_usage.set(UsageHook(hook));
    }

    /// The totals so far.
    pub fn totals(&self) -> Usage {
        let (input_tokens, output_tokens, llm_calls) = self.usage();
        Usage { input_tokens, output_tokens, llm_calls }
    }

    fn changed(&self, tokens: u64) {
        if let Some(hook) = self.on_usage.get() {
            // Totals read and handed on under one lock: two calls finishing at once hand them on
            // in increasing order, so the store (which keeps the last it is given) never goes
            // back to a smaller total.
            let _in_order = lock(&self.usage_order);
            (hook.0)(self.totals(), tokens);
        }
    }

    /// Counts one proxied LLM call (at its start: a call cut short still counts).
    pub fn count_call(&self) {
        self.llm_calls.fetch_add(1, Ordering::Relaxed);
        self.changed(0);
    }

    /// With a protocol-3 attribution token.
    pub fn with_token(mut self, token: String) -> Self {
        self.token = Some(token);
        self
    }

    /// `x-litellm-spend-logs-metadata`: run id, graph id, attempt, session key.
    pub fn spend_logs_metadata(&self) -> String {
        serde_json::json!({
            "run_id": self.run_id,
            "graph_id": self.graph_id,
            "attempt": self.attempt,
            "session_key": self.session_key,
        })
        .to_string()
    }

    /// `(input, output, calls)` so far.
    pub fn usage(&self) -> (u64, u64, u64) {
        (self.input_tokens.load(Ordering::Relaxed), self.output_tokens.load(Ordering::Relaxed), self.llm_calls.load(Ordering::Relaxed))
    }

    /// Adds one call's usage. The numbers come from the upstream's answer (untrusted): the sums
    /// saturate instead of wrapping around to a small bill.
    pub fn add_usage(&self, input: u64, output: u64) {
        let add = |total: &std::sync::atomic::AtomicU64, n: u64| {
            let _ = total.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| Some(t.saturating_add(n)));
        };
        add(&self.input_tokens, input);
        add(&self.output_tokens, output);
        self.changed(input.saturating_add(output));
    }
}

/// How long the end of a run is remembered against lookups that read it before it ended (see
/// [`Attributions::add_remote`]): far longer than a lookup takes.
pub const ENDED_TTL: Duration = Duration::from_secs(60);

/// The most ended runs remembered (a burst of ends beyond it forgets the oldest first).
pub const MAX_ENDED: usize = 10_000;

/// Live runs by trace id (protocol 4) and by attribution token (protocol 3).
#[derive(Debug)]
pub struct Attributions {
    /// Runs of this process.
    by_trace: DashMap<String, Arc<RunBilling>>,
    /// Runs of this process, by protocol-3 token.
    by_token: DashMap<String, Arc<RunBilling>>,
    /// Runs other replicas own whose calls this process forwards, until they end.
    remote: Remote,
    /// Held while an entry moves or is made (a remote run added, adopted, demoted): one process
    /// has one set of counters per run. Lookups never take it.
    moves: Mutex<()>,
    /// Runs whose end this process heard of lately (told, or found by the revocation poll). A
    /// lookup may read a run as unfinished just before it ends and add it after its end was
    /// handled: kept then, the entry would live until the next poll, and a run of another account
    /// admitted meanwhile with the same trace id (trace ids are unique only among unfinished
    /// runs) would have its calls billed to the ended one. Taken under `moves`, like the entries.
    ended: Mutex<ExpiringKeys<String>>,
}

impl Default for Attributions {
    fn default() -> Self {
        Self {
            by_trace: DashMap::new(),
            by_token: DashMap::new(),
            remote: Remote::default(),
            moves: Mutex::new(()),
            ended: Mutex::new(ExpiringKeys::new(ENDED_TTL, MAX_ENDED)),
        }
    }
}

/// The runs of other replicas in the registry.
#[derive(Debug, Default)]
struct Remote {
    /// By trace id.
    by_trace: DashMap<String, Arc<RunBilling>>,
    /// By attribution token.
    by_token: DashMap<String, Arc<RunBilling>>,
    /// By run id: what the revocation (the run ended) and a takeover (adopted) find.
    by_run: DashMap<String, Arc<RunBilling>>,
}

impl Remote {
    fn insert(&self, b: &Arc<RunBilling>) {
        self.by_trace.insert(b.trace_id.clone(), b.clone());
        if let Some(t) = &b.token {
            self.by_token.insert(t.clone(), b.clone());
        }
        self.by_run.insert(b.run_id.clone(), b.clone());
    }

    fn remove(&self, run_id: &str) -> Option<Arc<RunBilling>> {
        let (_, b) = self.by_run.remove(run_id)?;
        self.by_trace.remove_if(&b.trace_id, |_, x| Arc::ptr_eq(x, &b));
        if let Some(t) = &b.token {
            self.by_token.remove_if(t, |_, x| Arc::ptr_eq(x, &b));
        }
        Some(b)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The marker the proxy looks for in a request body (see `clawmux_actors::run::attribution_prompt`).
pub const TOKEN_MARKER: &str = "clawmux-attribution: ";

/// A fresh, unguessable attribution token.
pub fn new_token() -> String {
    format!("cmx-{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple())
}

/// Whether `t` has the shape of a token [`new_token`] makes (`cmx-`
/// and 64 hex digits). Anything else belongs to no run, and is never looked up or remembered:
/// a token comes from a request body, up to its size limit.
pub fn is_token(t: &str) -> bool {
    t.len() == 68 && t.starts_with("cmx-") && t.as_bytes()[4..].iter().all(u8::is_ascii_hexdigit)
}

/// The attribution tokens named in a request body (raw bytes; JSON escaping does not touch them),
/// the first `max` distinct ones: a body of up to its size limit may hold a million markers, and
/// telling them apart one by one from all found before would hold a worker for minutes.
pub fn tokens_in(body: &[u8], max: usize) -> Vec<String> {
    let marker = TOKEN_MARKER.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i + marker.len() <= body.len() && out.len() < max {
        if &body[i..i + marker.len()] == marker {
            let start = i + marker.len();
            let end = body[start..].iter().position(|b| !(b.is_ascii_alphanumeric() || *b == b'-')).map_or(body.len(), |p| start + p);
            if let Ok(t) = std::str::from_utf8(&body[start..end]) {
                if t.starts_with("cmx-") && !out.iter().any(|o| o == t) {
                    out.push(t.to_owned());
                }
            }
            i = end;
        } else {
            i += 1;
        }
    }
    out
}

impl Attributions {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    fn moving(&self) -> MutexGuard<'_, ()> {
        lock(&self.moves)
    }

    /// Registers a live run of this process; refuses when another live run already owns the trace
    /// id. `billing` is used unless this process already forwards the run's calls as a remote run
    /// (a takeover): that entry becomes the run's, with its counters (the returned one).
    pub fn register(&self, billing: Arc<RunBilling>) -> Result<Arc<RunBilling>, String> {
        let _moving = self.moving();
        if let Some(b) = self.by_trace.get(&billing.trace_id) {
            return Err(b.run_id.clone());
        }
        let billing = self.remote.remove(&billing.run_id).unwrap_or(billing);
        self.by_trace.insert(billing.trace_id.clone(), billing.clone());
        if let Some(t) = &billing.token {
            self.by_token.insert(t.clone(), billing.clone());
        }
        Ok(billing)
    }

    /// Adds a run another replica owns, found in the store, and returns the entry its calls count
    /// in: this process's own entry of the run when it has one (a takeover or another lookup got
    /// there first), else `billing`. `None` when the run ended since the store was read (its end
    /// was heard first): it is not added, its calls belong to no live run.
    pub fn add_remote(&self, billing: Arc<RunBilling>) -> Option<Arc<RunBilling>> {
        let _moving = self.moving();
        if lock(&self.ended).contains(&billing.run_id, Instant::now()) {
            return None;
        }
        if let Some(b) = self.by_trace.get(&billing.trace_id).filter(|b| b.run_id == billing.run_id) {
            return Some(b.clone());
        }
        if let Some(b) = self.remote.by_run.get(&billing.run_id) {
            return Some(b.clone());
        }
        self.remote.insert(&billing);
        Some(billing)
    }

    /// The live run owning an attribution token (this process's, else a remote one).
    pub fn lookup_token(&self, token: &str) -> Option<Arc<RunBilling>> {
        self.by_token.get(token).or_else(|| self.remote.by_token.get(token)).map(|b| b.clone())
    }

    /// The live run owning `trace_id` (this process's, else a remote one).
    pub fn lookup(&self, trace_id: &str) -> Option<Arc<RunBilling>> {
        self.by_trace.get(trace_id).or_else(|| self.remote.by_trace.get(trace_id)).map(|b| b.clone())
    }

    /// True when `billing` is a run of this process (not a remote one).
    pub fn is_local(&self, billing: &Arc<RunBilling>) -> bool {
        self.by_trace.get(&billing.trace_id).is_some_and(|b| Arc::ptr_eq(&b, billing))
    }

    /// Forgets a run of this process (it ended). Only removes the entry if it still belongs to
    /// `run_id`.
    pub fn unregister(&self, trace_id: &str, run_id: &str) {
        if let Some((_, b)) = self.by_trace.remove_if(trace_id, |_, b| b.run_id == run_id) {
            if let Some(t) = &b.token {
                self.by_token.remove(t);
            }
            b.revoked.cancel();
        }
    }

    /// This process no longer continues a run of its own, which goes on (taken back after a store
    /// outage by a new log of it, or taken over by another replica): its entry becomes a remote
    /// run's, with its counters and its streams in flight, no longer suspended. Cancelling it
    /// instead (as at a run's end) cut the LLM calls the gateway run had in flight, and a new
    /// entry started from the store's share, which may lack the calls whose records the store
    /// has not got yet: the two counters then overwrote each other's share. A takeover here adopts
    /// the entry back ([`Self::register`]); an end heard revokes it ([`Self::revoke_remote`]).
    pub fn demote(&self, trace_id: &str, run_id: &str) {
        let _moving = self.moving();
        let Some((_, b)) = self.by_trace.remove_if(trace_id, |_, b| b.run_id == run_id) else { return };
        if let Some(t) = &b.token {
            self.by_token.remove(t);
        }
        // Its end was heard already: it belongs to no live run.
        if lock(&self.ended).contains(&b.run_id, Instant::now()) {
            b.revoked.cancel();
            return;
        }
        b.suspended.store(false, Ordering::SeqCst);
        self.remote.insert(&b);
    }

    /// A run ended (told by the store, or found ended): if it is a remote run here, its calls are
    /// refused from now on and its streams in flight are cut; either way a lookup that read it
    /// before its end does not add it afterwards ([`Self::add_remote`]). A run of this process is
    /// left alone (its own end unregisters it).
    pub fn revoke_remote(&self, run_id: &str) -> bool {
        let removed = {
            let _moving = self.moving();
            lock(&self.ended).insert(run_id.to_owned(), Instant::now());
            self.remote.remove(run_id)
        };
        match removed {
            Some(b) => {
                b.revoked.cancel();
                true
            }
            None => false,
        }
    }

    /// The remote runs (their ends are looked for in the store).
    pub fn remote_runs(&self) -> Vec<String> {
        self.remote.by_run.iter().map(|e| e.key().clone()).collect()
    }

    /// Number of live runs of this process.
    pub fn len(&self) -> usize {
        self.by_trace.len()
    }

    /// True when no run of this process is live.
    pub fn is_empty(&self) -> bool {
        self.by_trace.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Untrusted request bodies: whatever surrounds a real token, it is found and has clawmux's
        /// shape; nothing else found in the body passes [`is_token`] unless it is that shape, and no
        /// body makes the scan panic.
        #[test]
        fn tokens_in_any_body_are_found_and_only_real_ones_pass(
            before in proptest::collection::vec(any::<u8>(), 0..200),
            after in proptest::collection::vec(any::<u8>(), 0..200),
            junk in "[a-zA-Z0-9-]{0,100}",
        ) {
            let token = new_token();
            let mut body = before.clone();
            body.extend_from_slice(format!("{TOKEN_MARKER}{token}").as_bytes());
            // Ends the token (a byte it cannot contain), then more untrusted bytes.
            body.push(b'"');
            body.extend_from_slice(format!("{TOKEN_MARKER}cmx-{junk}").as_bytes());
            body.extend_from_slice(&after);
            let found = tokens_in(&body, usize::MAX);
            prop_assert!(found.contains(&token), "{found:?}");
            prop_assert!(is_token(&token));
            for t in &found {
                let shaped = t.len() == 68 && t[4..].bytes().all(|b| b.is_ascii_hexdigit());
                prop_assert_eq!(is_token(t), shaped, "{}", t);
            }
        }
    }

    /// The store keeps the last totals it is given: calls finishing at once on many threads must
    /// hand them on in increasing order (one thread's totals overtaking another's made the stored
    /// usage go back).
    #[test]
    fn totals_are_handed_on_in_increasing_order_under_concurrent_calls() {
        let b = Arc::new(RunBilling::new("r1", "acct", "g", "s", "t1"));
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let s2 = seen.clone();
        // The hook does some work before the totals reach the store (a channel send): a yield
        // stands for it.
        b.on_usage(Box::new(move |u, _| {
            std::thread::yield_now();
            s2.lock().expect("seen").push(u.input_tokens);
        }));
        let start = Arc::new(std::sync::Barrier::new(8));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (b, start) = (b.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    for _ in 0..5_000 {
                        b.add_usage(1, 1);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread");
        }
        let seen = seen.lock().expect("seen");
        assert_eq!(seen.len(), 40_000);
        assert!(seen.windows(2).all(|w| w[0] <= w[1]), "totals went back");
        assert_eq!(seen.last(), Some(&40_000));
    }


    #[test]
    fn a_trace_id_belongs_to_one_running_run() {
        let a = Attributions::new();
        a.register(Arc::new(RunBilling::new("r1", "acct", "g", "s", "t1"))).expect("first");
        assert_eq!(a.register(Arc::new(RunBilling::new("r2", "acct", "g", "s", "t1"))).map(|b| b.run_id.clone()), Err("r1".to_owned()));
        assert_eq!(a.lookup("t1").map(|b| b.run_id.clone()).as_deref(), Some("r1"));
        a.unregister("t1", "r2");
        assert!(a.lookup("t1").is_some(), "only the owner can unregister");
        a.unregister("t1", "r1");
        assert!(a.lookup("t1").is_none());
    }

    /// A body of a million distinct markers (32 MiB, the proxy's body limit) is scanned only as
    /// far as the caller needs: the first `max` distinct tokens, in order.
    #[test]
    fn a_body_of_many_markers_is_scanned_only_to_the_tokens_needed() {
        let mut body = Vec::new();
        for i in 0..1_000_000u32 {
            body.extend_from_slice(format!("{TOKEN_MARKER}cmx-{i:08x} ").as_bytes());
        }
        assert_eq!(tokens_in(&body, 2), ["cmx-00000000", "cmx-00000001"]);
        let repeated = format!("{TOKEN_MARKER}cmx-a {TOKEN_MARKER}cmx-a {TOKEN_MARKER}cmx-b");
        assert_eq!(tokens_in(repeated.as_bytes(), 2), ["cmx-a", "cmx-b"], "distinct ones");
    }

    #[test]
    fn tokens_are_found_in_bodies_and_revoked_with_the_run() {
        let a = Attributions::new();
        let tok = new_token();
        let b = Arc::new(RunBilling::new("r1", "acct", "g", "s", "t1").with_token(tok.clone()));
        a.register(b.clone()).expect("register");
        let body = format!(r#"{{"messages":[{{"role":"system","content":"... {TOKEN_MARKER}{tok}\n(Billing ...)"}}]}}"#);
        assert_eq!(tokens_in(body.as_bytes(), usize::MAX), vec![tok.clone()]);
        assert_eq!(a.lookup_token(&tok).map(|b| b.run_id.clone()).as_deref(), Some("r1"));
        assert!(tokens_in(b"no marker here", usize::MAX).is_empty());
        a.unregister("t1", "r1");
        assert!(a.lookup_token(&tok).is_none());
        assert!(b.revoked.is_cancelled());
    }

    #[test]
    fn a_remote_run_is_found_until_it_ends_and_a_takeover_adopts_its_counters() {
        let a = Attributions::new();
        let tok = new_token();
        let remote = Arc::new(RunBilling::new("r1", "acct", "g", "s", "t1").with_token(tok.clone()));
        let got = a.add_remote(remote.clone()).expect("added");
        assert!(Arc::ptr_eq(&got, &remote));
        // A second lookup of the same run (a race) gets the entry that is there: one set of counters.
        let again = a.add_remote(Arc::new(RunBilling::new("r1", "acct", "g", "s", "t1"))).expect("there");
        assert!(Arc::ptr_eq(&again, &remote));
        assert!(a.lookup("t1").is_some_and(|b| Arc::ptr_eq(&b, &remote)) && a.lookup_token(&tok).is_some());
        assert!(!a.is_local(&remote) && a.is_empty(), "a remote run is not this process's");
        assert_eq!(a.remote_runs(), ["r1"]);
        remote.count_call();

        // Taken over here: the new owner's registration gets the remote entry, counters and all.
        let adopted = a.register(Arc::new(RunBilling::new("r1", "acct", "g", "s", "t1"))).expect("adopted");
        assert!(Arc::ptr_eq(&adopted, &remote) && a.is_local(&adopted) && a.remote_runs().is_empty());
        assert_eq!(adopted.totals().llm_calls, 1);
        assert!(!a.revoke_remote("r1") && !adopted.revoked.is_cancelled(), "an end notified for a run of this process is its own business");
        a.unregister("t1", "r1");
        assert!(adopted.revoked.is_cancelled());

        // A remote run that ends is revoked: its streams are cut, its calls refused.
        let other = a.add_remote(Arc::new(RunBilling::new("r2", "acct", "g", "s", "t2").with_token(new_token()))).expect("added");
        assert!(a.revoke_remote("r2") && other.revoked.is_cancelled());
        assert!(a.lookup("t2").is_none() && a.remote_runs().is_empty());
    }

    #[test]
    fn a_run_whose_end_was_heard_before_its_lookup_finished_is_not_added() {
        let a = Attributions::new();
        // The lookup read r1 as unfinished; its end is handled before the lookup adds it.
        assert!(!a.revoke_remote("r1"), "not a remote run here yet");
        assert!(a.add_remote(Arc::new(RunBilling::new("r1", "acct-old", "g", "s", "t1"))).is_none());
        assert!(a.lookup("t1").is_none() && a.remote_runs().is_empty(), "the ended run is not kept");
        // A run of another account that took the trace id since is added as usual.
        let new = a.add_remote(Arc::new(RunBilling::new("r2", "acct-new", "g", "s", "t1"))).expect("another run");
        assert!(a.lookup("t1").is_some_and(|b| Arc::ptr_eq(&b, &new) && b.billing_account_id == "acct-new"));
    }

    #[test]
    fn ended_runs_are_remembered_in_bounded_memory() {
        let a = Attributions::new();
        for i in 0..=MAX_ENDED {
            a.revoke_remote(&format!("r{i}"));
        }
        assert_eq!(lock(&a.ended).len(), MAX_ENDED);
        // The oldest end is forgotten first; the newest still refuses a stale lookup.
        assert!(a.add_remote(Arc::new(RunBilling::new("r0", "acct", "g", "s", "t0"))).is_some());
        assert!(a.add_remote(Arc::new(RunBilling::new(&format!("r{MAX_ENDED}"), "acct", "g", "s", "tn"))).is_none());
    }

    #[test]
    fn a_suspended_run_says_so_and_its_streams_go_on() {
        let a = Attributions::new();
        let b = a.register(Arc::new(RunBilling::new("r1", "acct", "g", "s", "t1"))).expect("register");
        assert!(!b.is_suspended());
        b.suspend();
        // Still the trace id's entry (no other run may take it here), but marked: the proxy
        // answers its new calls 503; nothing cuts the streams in flight.
        assert!(a.lookup("t1").is_some_and(|x| Arc::ptr_eq(&x, &b) && x.is_suspended()));
        assert!(!b.revoked.is_cancelled());
        // Found taken over and ended: the entry goes (`RunLog::let_go_of_billing`).
        a.unregister("t1", "r1");
        assert!(a.lookup("t1").is_none());
    }

    /// A run taken back after a store outage: its entry goes on as a remote one (counters kept,
    /// streams not cut, calls attributed again) and the new log's registration adopts it.
    #[test]
    fn a_run_taken_back_keeps_its_entry_and_the_new_registration_adopts_it() {
        let a = Attributions::new();
        let b = a.register(Arc::new(RunBilling::new("r1", "acct", "g", "s", "t1").with_token(new_token()))).expect("register");
        b.count_call();
        b.add_usage(7, 3);
        b.suspend();
        a.demote("t1", "r1");
        assert!(!b.revoked.is_cancelled(), "its streams in flight were cut");
        assert!(!a.is_local(&b) && !b.is_suspended());
        assert!(a.lookup("t1").is_some_and(|x| Arc::ptr_eq(&x, &b)), "its calls are not attributed meanwhile");
        assert!(a.lookup_token(b.token.as_deref().expect("token")).is_some_and(|x| Arc::ptr_eq(&x, &b)));
        let again = a.register(Arc::new(RunBilling::new("r1", "acct", "g", "s", "t1"))).expect("register again");
        assert!(Arc::ptr_eq(&again, &b) && a.is_local(&b), "a second counter beside the first");
        assert_eq!(again.totals(), Usage { input_tokens: 7, output_tokens: 3, llm_calls: 1 });
        // Its end heard meanwhile: the entry is revoked, not kept.
        let c = a.register(Arc::new(RunBilling::new("r2", "acct", "g", "s", "t2"))).expect("register");
        a.revoke_remote("r2");
        a.demote("t2", "r2");
        assert!(c.revoked.is_cancelled() && a.lookup("t2").is_none());
        // Another run's entry under the trace id is left alone.
        a.demote("t1", "r-other");
        assert!(a.is_local(&b));
    }

    #[test]
    fn the_run_usage_is_this_process_totals_plus_the_other_shares_which_never_go_back() {
        let b = RunBilling::new("r1", "acct", "g", "s", "t1").with_usage(Usage { input_tokens: 10, output_tokens: 1, llm_calls: 1 });
        b.note_share("r-b", Usage { input_tokens: 5, output_tokens: 2, llm_calls: 2 });
        b.note_share("r-b", Usage { input_tokens: 4, output_tokens: 2, llm_calls: 1 });
        b.note_share("r-c", Usage { input_tokens: 1, output_tokens: 0, llm_calls: 1 });
        assert_eq!(b.totals(), Usage { input_tokens: 10, output_tokens: 1, llm_calls: 1 });
        assert_eq!(b.run_totals(), Usage { input_tokens: 16, output_tokens: 3, llm_calls: 4 });
    }

    #[test]
    fn metadata_names_the_run() {
        let b = RunBilling::new("r1", "acct-1", "sandbox:openclaw", "agent:main:acct-1:r1", "t");
        let m: serde_json::Value = serde_json::from_str(&b.spend_logs_metadata()).expect("json");
        assert_eq!(m["run_id"], "r1");
        assert_eq!(m["graph_id"], "sandbox:openclaw");
        assert_eq!(m["attempt"], 0);
        assert_eq!(m["session_key"], "agent:main:acct-1:r1");
    }
}
