//! Which live run owns an LLM call: trace id → the run's billing identity, and the usage its calls
//! reported.
//!
//! A run is registered before it is admitted (the gateway may call the LLM right after `agent`) and
//! removed when its terminal event is emitted: an LLM call whose trace id belongs to no live run is
//! refused by the proxy (fail-closed). Two live runs can never share a trace id: the second is
//! refused at admission, otherwise its calls could not be told apart.

use dashmap::DashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

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
        }
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

/// Live runs by trace id (protocol 4) and by attribution token (protocol 3).
#[derive(Debug, Default)]
pub struct Attributions {
    by_trace: DashMap<String, Arc<RunBilling>>,
    by_token: DashMap<String, Arc<RunBilling>>,
}

/// The marker the proxy looks for in a request body (see `clawmux_actors::run::attribution_prompt`).
pub const TOKEN_MARKER: &str = "clawmux-attribution: ";

/// A fresh, unguessable attribution token.
pub fn new_token() -> String {
    format!("cmx-{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple())
}

/// The attribution tokens named in a request body (raw bytes; JSON escaping does not touch them).
pub fn tokens_in(body: &[u8]) -> Vec<String> {
    let marker = TOKEN_MARKER.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i + marker.len() <= body.len() {
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

    /// Registers a live run; refuses when another live run already owns the trace id.
    pub fn register(&self, billing: Arc<RunBilling>) -> Result<(), String> {
        match self.by_trace.entry(billing.trace_id.clone()) {
            dashmap::mapref::entry::Entry::Occupied(o) => return Err(o.get().run_id.clone()),
            dashmap::mapref::entry::Entry::Vacant(v) => {
                v.insert(billing.clone());
            }
        }
        if let Some(t) = &billing.token {
            self.by_token.insert(t.clone(), billing.clone());
        }
        Ok(())
    }

    /// The live run owning an attribution token.
    pub fn lookup_token(&self, token: &str) -> Option<Arc<RunBilling>> {
        self.by_token.get(token).map(|b| b.clone())
    }

    /// The live run owning `trace_id`.
    pub fn lookup(&self, trace_id: &str) -> Option<Arc<RunBilling>> {
        self.by_trace.get(trace_id).map(|b| b.clone())
    }

    /// Forgets a run (it ended). Only removes the entry if it still belongs to `run_id`.
    pub fn unregister(&self, trace_id: &str, run_id: &str) {
        if let Some((_, b)) = self.by_trace.remove_if(trace_id, |_, b| b.run_id == run_id) {
            if let Some(t) = &b.token {
                self.by_token.remove(t);
            }
            b.revoked.cancel();
        }
    }

    /// Number of live runs.
    pub fn len(&self) -> usize {
        self.by_trace.len()
    }

    /// True when no run is live.
    pub fn is_empty(&self) -> bool {
        self.by_trace.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_id_belongs_to_one_running_run() {
        let a = Attributions::new();
        a.register(Arc::new(RunBilling::new("r1", "acct", "g", "s", "t1"))).expect("first");
        assert_eq!(a.register(Arc::new(RunBilling::new("r2", "acct", "g", "s", "t1"))), Err("r1".to_owned()));
        assert_eq!(a.lookup("t1").map(|b| b.run_id.clone()).as_deref(), Some("r1"));
        a.unregister("t1", "r2");
        assert!(a.lookup("t1").is_some(), "only the owner can unregister");
        a.unregister("t1", "r1");
        assert!(a.lookup("t1").is_none());
    }

    #[test]
    fn tokens_are_found_in_bodies_and_revoked_with_the_run() {
        let a = Attributions::new();
        let tok = new_token();
        let b = Arc::new(RunBilling::new("r1", "acct", "g", "s", "t1").with_token(tok.clone()));
        a.register(b.clone()).expect("register");
        let body = format!(r#"{{"messages":[{{"role":"system","content":"... {TOKEN_MARKER}{tok}\n(Billing ...)"}}]}}"#);
        assert_eq!(tokens_in(body.as_bytes()), vec![tok.clone()]);
        assert_eq!(a.lookup_token(&tok).map(|b| b.run_id.clone()).as_deref(), Some("r1"));
        assert!(tokens_in(b"no marker here").is_empty());
        a.unregister("t1", "r1");
        assert!(a.lookup_token(&tok).is_none());
        assert!(b.revoked.is_cancelled());
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
