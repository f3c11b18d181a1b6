//! The LLM attribution proxy: an OpenAI-compatible endpoint the gateway's model provider points at.
//!
//! For every call it reads the W3C `traceparent`, finds the live run that owns its trace id, and
//! only then forwards it upstream (LiteLLM) with the upstream key injected and the billing headers
//! OVERWRITTEN from the run: `x-litellm-end-user-id`, `x-litellm-spend-logs-metadata`,
//! `x-cogni-run-id`. A call with no trace id, or one that belongs to no live run, is refused and
//! counted: an agent with a shell cannot bill another account. Answers stream back as they
//! arrive; the usage the upstream reports is summed into the run and every call is audited.
//!
//! Refusals answer `409` with a neutral message, on purpose: OpenClaw takes a `401`/`403` (and a
//! `402`) from a provider as an auth or billing failure of its API key and disables that key for
//! about a minute, for EVERY run of every tenant (observed on 2026.9.6: a late call of an ended run
//! locked all accounts out). A `409` fails only the call that made it.
//!
//! With a store shared by replicas, a call of a run another replica owns is forwarded too (see
//! [`crate::remote_runs`]). When the store cannot say whose a call is (it is down), the call is answered
//! `503` with `Retry-After`, never forwarded unattributed: OpenClaw 2026.9.6 takes a `503` as its
//! provider being overloaded, retries the call with backoff (up to 90 s) and does NOT mark the key
//! as failing (its auth-profile policy skips `overloaded`), so no other tenant is affected. The
//! same `503` answers every call that cannot be attributed for now but may be later: a trace id
//! or token the store did not know a moment ago (a believed miss: its run may have been admitted
//! since), a run suspended here while the store is out of reach (it may have ended elsewhere, its
//! trace id taken by another account's run), an account whose spend cannot be read.

use crate::attribution::{Attributions, RunBilling};
use crate::audit::{AuditLog, AuditRecord};
use crate::remote_runs::cache::Resolved;
use crate::store::{CallKey, StoreError};
use crate::tenants::budget::CallBudget;
use crate::config::Secret;
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use bytes::Bytes;
use futures_util::Stream;
use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts, Registry};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

/// Largest request body forwarded (OpenClaw sends ~40 KB).
const MAX_REQUEST_BYTES: usize = 32 * 1024 * 1024;
/// Largest non-streamed answer (it is read whole to find its usage).
const MAX_BUFFERED_RESPONSE: usize = 64 * 1024 * 1024;

/// Headers never forwarded: hop-by-hop, recomputed, or ours to set.
const DROPPED: [&str; 12] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "authorization",
];

/// The trace id of a `traceparent` header value, if it is valid.
pub fn trace_id_of(traceparent: Option<&str>) -> Option<String> {
    clawmux_protocol::TraceParent::parse(traceparent?).ok().map(|t| t.trace_id().to_owned())
}

/// Billing headers a client might send: never trusted, always removed before ours are set.
fn is_billing_header(name: &str) -> bool {
    name.starts_with("x-litellm-") || name.starts_with("x-cogni-")
}

/// The headers sent upstream: the caller's, minus hop-by-hop, auth and any billing header, plus
/// the upstream key and the run's billing headers.
pub fn upstream_headers(incoming: &[(String, String)], billing: &RunBilling, key: Option<&Secret>) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = incoming
        .iter()
        .filter(|(k, _)| {
            let k = k.to_ascii_lowercase();
            !DROPPED.contains(&k.as_str()) && !is_billing_header(&k)
        })
        .cloned()
        .collect();
    if let Some(key) = key {
        out.push(("authorization".to_owned(), format!("Bearer {}", key.expose())));
    }
    out.push(("x-litellm-end-user-id".to_owned(), billing.billing_account_id.clone()));
    out.push(("x-litellm-spend-logs-metadata".to_owned(), billing.spend_logs_metadata()));
    out.push(("x-cogni-run-id".to_owned(), billing.run_id.clone()));
    out
}

/// Finds `usage` in an OpenAI answer: `prompt_tokens`/`completion_tokens` (or `input_tokens`/
/// `output_tokens`).
pub fn usage_of(value: &serde_json::Value) -> Option<(u64, u64)> {
    let u = value.get("usage")?;
    if !u.is_object() {
        return None;
    }
    let get = |a: &str, b: &str| u.get(a).or_else(|| u.get(b)).and_then(serde_json::Value::as_u64);
    Some((get("prompt_tokens", "input_tokens").unwrap_or(0), get("completion_tokens", "output_tokens").unwrap_or(0)))
}

/// Watches an SSE byte stream for `data:` lines carrying `usage`, across chunk boundaries.
#[derive(Debug, Default)]
pub struct UsageScanner {
    line: Vec<u8>,
    /// The last usage seen (the upstream sends it once, in the last chunk).
    pub usage: Option<(u64, u64)>,
    /// `data: [DONE]` went by: the answer is complete.
    pub done: bool,
}

/// Longest SSE line kept for inspection; a longer one cannot be a usage chunk worth parsing.
const MAX_LINE: usize = 1024 * 1024;

impl UsageScanner {
    /// Feeds bytes; returns a usage found in a line completed by them.
    pub fn feed(&mut self, bytes: &[u8]) -> Option<(u64, u64)> {
        let mut found = None;
        for &b in bytes {
            if b == b'\n' {
                if let Some(u) = self.parse_line() {
                    self.usage = Some(u);
                    found = Some(u);
                }
                self.line.clear();
            } else if self.line.len() < MAX_LINE {
                self.line.push(b);
            }
        }
        found
    }

    fn parse_line(&mut self) -> Option<(u64, u64)> {
        let line = std::str::from_utf8(&self.line).ok()?.trim_end_matches('\r');
        let data = line.strip_prefix("data:")?.trim_start();
        if data == "[DONE]" {
            self.done = true;
            return None;
        }
        if !data.contains("\"usage\"") {
            return None;
        }
        usage_of(&serde_json::from_str(data).ok()?)
    }
}

/// The proxy's metrics.
#[derive(Clone)]
pub struct ProxyMetrics {
    /// Calls forwarded, by outcome (`ok`, `upstream_error`, `client_closed`, `unreachable`,
    /// `run_ended`: cut because the run ended, e.g. aborted).
    pub calls: IntCounterVec,
    /// Tokens reported by the upstream, by kind (`input`, `output`).
    pub tokens: IntCounterVec,
    /// Calls refused, by reason (`no_traceparent`, `unknown_trace`, `body_too_large`, ...; answered
    /// `503`, for now: `store_unavailable` (the shared store could not say whose the call is),
    /// `recent_miss` (no live run had its trace id or token a moment ago), `run_suspended` (its
    /// run is suspended here), `budget_unknown` (its account's spend cannot be read)).
    pub refusals: IntCounterVec,
    /// Time from forwarding a call to the upstream's response headers.
    pub upstream_latency: Histogram,
    /// Calls whose client-sent billing headers disagreed with the trace attribution.
    pub disagreements: IntCounter,
}

impl ProxyMetrics {
    /// Creates and registers the metrics.
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let m = Self {
            calls: IntCounterVec::new(Opts::new("clawmux_proxy_calls_total", "LLM calls forwarded, by outcome"), &["outcome"])?,
            tokens: IntCounterVec::new(Opts::new("clawmux_proxy_tokens_total", "Tokens reported by the upstream"), &["kind"])?,
            refusals: IntCounterVec::new(
                Opts::new("clawmux_proxy_refusals_total", "LLM calls refused because no live run owns them"),
                &["reason"],
            )?,
            upstream_latency: Histogram::with_opts(
                HistogramOpts::new("clawmux_proxy_upstream_latency_seconds", "Time to the upstream's response headers")
                    .buckets(vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]),
            )?,
            disagreements: IntCounter::new(
                "clawmux_proxy_billing_header_disagreements_total",
                "Calls whose incoming billing headers disagreed with the trace attribution",
            )?,
        };
        // Every known label value starts at zero: dashboards and alerts see the series at once.
        for o in ["ok", "upstream_error", "client_closed", "unreachable", "run_ended"] {
            m.calls.with_label_values(&[o]);
        }
        for k in ["input", "output"] {
            m.tokens.with_label_values(&[k]);
        }
        for r in [
            "no_traceparent",
            "unknown_trace",
            "unknown_token",
            "ambiguous_token",
            "body_too_large",
            "budget_exceeded",
            "store_unavailable",
            "recent_miss",
            "run_suspended",
            "budget_unknown",
            "route_not_forwarded",
        ] {
            m.refusals.with_label_values(&[r]);
        }
        registry.register(Box::new(m.calls.clone()))?;
        registry.register(Box::new(m.tokens.clone()))?;
        registry.register(Box::new(m.refusals.clone()))?;
        registry.register(Box::new(m.upstream_latency.clone()))?;
        registry.register(Box::new(m.disagreements.clone()))?;
        Ok(m)
    }
}

/// What the proxy handlers share.
pub struct ProxyState {
    /// Live runs by trace id.
    pub attributions: Arc<Attributions>,
    /// Upstream base URL (LiteLLM's root).
    pub upstream: String,
    /// Upstream key (host only).
    pub key: Option<Secret>,
    /// HTTP client.
    pub client: reqwest::Client,
    /// Audit log writer.
    pub audit: AuditSink,
    /// Metrics.
    pub metrics: ProxyMetrics,
    /// Per-account budgets: a call that would start after its account's budget is spent is
    /// refused, and its run ends `budget_exceeded`.
    pub budgets: Option<Arc<crate::tenants::budget::Budgets>>,
    /// The runs of other replicas (a store shared by replicas): their calls are forwarded too.
    pub remote: Option<Arc<crate::remote_runs::RemoteRuns>>,
    /// Where the audit records also go so that every replica lists them (a shared store).
    pub shared_audit: Option<crate::store::writer::Writer>,
}

/// Hands audit records to a writer thread (appends block on `fsync`, never the event loop).
#[derive(Clone)]
pub struct AuditSink(Option<std::sync::mpsc::Sender<AuditRecord>>);

impl AuditSink {
    /// Starts the writer thread for `log`.
    pub fn start(log: Arc<AuditLog>) -> Self {
        let (tx, rx) = std::sync::mpsc::channel::<AuditRecord>();
        let spawned = std::thread::Builder::new().name("clawmux-audit".to_owned()).spawn(move || {
            while let Ok(rec) = rx.recv() {
                if let Err(e) = log.append(&rec) {
                    tracing::error!(error = %e, run_id = %rec.run_id, "cannot write the audit record of an LLM call");
                }
            }
        });
        match spawned {
            Ok(_) => Self(Some(tx)),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the audit writer");
                Self(None)
            }
        }
    }

    /// No audit log (tests of other parts).
    pub fn disabled() -> Self {
        Self(None)
    }

    fn write(&self, rec: AuditRecord) {
        if let Some(tx) = &self.0 {
            let _ = tx.send(rec);
        }
    }
}

/// Adds `stream_options.include_usage: true` to a streamed chat request that lacks it; returns the
/// new body, or `None` when nothing had to change.
pub fn request_usage(body: &mut serde_json::Value) -> Option<Bytes> {
    let obj = body.as_object_mut()?;
    if obj.get("stream").and_then(serde_json::Value::as_bool) != Some(true) || !obj.contains_key("messages") {
        return None;
    }
    let opts = obj.entry("stream_options").or_insert_with(|| serde_json::json!({}));
    let opts = opts.as_object_mut()?;
    if opts.get("include_usage").and_then(serde_json::Value::as_bool) == Some(true) {
        return None;
    }
    opts.insert("include_usage".to_owned(), serde_json::Value::Bool(true));
    serde_json::to_vec(body).ok().map(Bytes::from)
}

/// The upstream routes a run may call, by method and exact raw path: the model inference APIs
/// (OpenAI's chat, completions, responses and embeddings, Anthropic's messages) and the model
/// list. Nothing else is forwarded: the upstream key is the operator's (LiteLLM's master key in
/// the compose stack), and an agent asking for `/v1/../key/generate` (the upstream's URL parser
/// resolves dot segments; actix does not) or `/v1/files` would reach its admin API or other
/// tenants' files with it. An exact match also refuses every encoded or doubled separator.
pub fn forwarded_route(method: &str, raw_path: &str) -> bool {
    match method {
        "POST" => matches!(raw_path, "/v1/chat/completions" | "/v1/completions" | "/v1/responses" | "/v1/embeddings" | "/v1/messages"),
        "GET" => raw_path == "/v1/models",
        _ => false,
    }
}

/// Joins the upstream root and the called path (`.../v1` roots are accepted too).
pub fn upstream_url(base: &str, path_and_query: &str) -> String {
    let base = base.trim_end_matches('/');
    let base = if path_and_query.starts_with("/v1/") || path_and_query == "/v1" { base.strip_suffix("/v1").unwrap_or(base) } else { base };
    format!("{base}{path_and_query}")
}

fn refuse(state: &ProxyState, reason: &'static str, message: String) -> HttpResponse {
    state.metrics.refusals.with_label_values(&[reason]).inc();
    tracing::warn!(reason, %message, "LLM call refused");
    HttpResponse::build(StatusCode::CONFLICT)
        .json(serde_json::json!({"error": {"code": "attribution_refused", "type": "attribution_refused", "message": message}}))
}

/// The call cannot be attributed right now (`why`, counted as `reason`): not forwarded (never
/// unattributed), retried by the gateway (see the module's doc for why `503`).
fn unavailable(state: &ProxyState, reason: &'static str, why: &str) -> HttpResponse {
    state.metrics.refusals.with_label_values(&[reason]).inc();
    tracing::warn!(reason, why, "LLM call refused for now: it cannot be attributed to a run right now");
    HttpResponse::build(StatusCode::SERVICE_UNAVAILABLE).insert_header(("retry-after", "1")).json(serde_json::json!({"error": {
        "code": "attribution_unavailable", "type": "attribution_unavailable",
        "message": "clawmux cannot attribute this call to a run right now; retry shortly"}}))
}

/// The store could not say whose a call is.
fn store_unavailable(state: &ProxyState, e: &StoreError) -> HttpResponse {
    unavailable(state, "store_unavailable", &format!("the run store cannot say which run it belongs to: {e}"))
}

/// The live run `key` names: this process's registry (its own runs, the remote runs it found
/// before), else the shared store's (a run another replica owns).
async fn find(state: &ProxyState, key: CallKey, local: Option<Arc<RunBilling>>) -> Result<Resolved<Arc<RunBilling>>, StoreError> {
    match (local, &state.remote) {
        (Some(b), _) => Ok(Resolved::Found(b)),
        (None, Some(remote)) => remote.find(&key).await,
        (None, None) => Ok(Resolved::Missing),
    }
}

fn now_rfc3339() -> String {
    time::OffsetDateTime::now_utc().format(&time::format_description::well_known::Rfc3339).unwrap_or_default()
}

/// Ends a call once: the audit record, counters and usage.
struct CallFinisher {
    state: web::Data<ProxyState>,
    billing: Arc<RunBilling>,
    record: Option<AuditRecord>,
    started: Instant,
}

impl CallFinisher {
    fn finish(&mut self, outcome: &str, usage: Option<(u64, u64)>) {
        let Some(mut rec) = self.record.take() else { return };
        rec.outcome = outcome.to_owned();
        rec.latency_ms = self.started.elapsed().as_millis() as u64;
        if let Some((i, o)) = usage {
            rec.input_tokens = Some(i);
            rec.output_tokens = Some(o);
        }
        self.state.metrics.calls.with_label_values(&[outcome]).inc();
        tracing::info!(
            run_id = %rec.run_id, status = rec.status, outcome, streamed = rec.streamed,
            input_tokens = ?rec.input_tokens, output_tokens = ?rec.output_tokens, latency_ms = rec.latency_ms,
            "LLM call"
        );
        if let Some(w) = &self.state.shared_audit {
            w.submit(crate::store::Write::LlmCall { id: crate::store::BillingId::new(), record: Box::new(rec.clone()) }, None);
        }
        self.state.audit.write(rec);
        let _ = &self.billing;
    }
}

impl Drop for CallFinisher {
    fn drop(&mut self) {
        // The gateway went away mid-answer (abort): the upstream stream is dropped with us.
        self.finish("client_closed", None);
    }
}

/// A streamed answer passed through as it arrives, metered on the way.
struct MeteredStream {
    inner: Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>>>>,
    scanner: UsageScanner,
    finisher: CallFinisher,
    /// Resolves when the run ends: the answer is cut there (an aborted run's LLM stream stops).
    revoked: Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
}

impl Stream for MeteredStream {
    type Item = Result<Bytes, actix_web::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        // A complete answer is never cut (the run may end the moment the gateway has read it).
        if self.finisher.record.is_some() && !self.scanner.done && self.revoked.as_mut().poll(cx).is_ready() {
            let usage = self.scanner.usage;
            self.finisher.finish("run_ended", usage);
            return Poll::Ready(Some(Err(actix_web::error::ErrorGone("the run this LLM call belongs to has ended"))));
        }
        if self.finisher.record.is_none() {
            return Poll::Ready(None);
        }
        match self.inner.as_mut().poll_next(cx) {
            Poll::Ready(Some(Ok(bytes))) => {
                if let Some((i, o)) = self.scanner.feed(&bytes) {
                    // Counted before the bytes go on: the gateway cannot finish the run before it.
                    self.finisher.billing.add_usage(i, o);
                    self.finisher.state.metrics.tokens.with_label_values(&["input"]).inc_by(i);
                    self.finisher.state.metrics.tokens.with_label_values(&["output"]).inc_by(o);
                }
                Poll::Ready(Some(Ok(bytes)))
            }
            Poll::Ready(Some(Err(e))) => {
                let usage = self.scanner.usage;
                self.finisher.finish("upstream_error", usage);
                Poll::Ready(Some(Err(actix_web::error::ErrorBadGateway(format!("upstream stream failed: {e}")))))
            }
            Poll::Ready(None) => {
                let usage = self.scanner.usage;
                let status = self.finisher.record.as_ref().map_or(0, |r| r.status);
                self.finisher.finish(if (200..300).contains(&status) { "ok" } else { "upstream_error" }, usage);
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// On a per-run listener (an ephemeral run's unix socket): every call on it is this run's, with no
/// trace id or token needed; a call after the run ended is refused like any unattributable call.
pub struct RunScope(pub Arc<RunBilling>);

/// Every `/v1/*` call.
pub async fn forward(req: HttpRequest, body: web::Payload, state: web::Data<ProxyState>) -> HttpResponse {
    if !forwarded_route(req.method().as_str(), req.uri().path()) {
        state.metrics.refusals.with_label_values(&["route_not_forwarded"]).inc();
        tracing::warn!(method = %req.method(), "LLM proxy call to a route it does not forward refused");
        return HttpResponse::NotFound().json(serde_json::json!({"error": {"code": "not_found",
            "message": "the LLM proxy forwards POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings, /v1/messages and GET /v1/models only"}}));
    }
    let path_and_query = req.uri().path_and_query().map_or_else(|| req.path().to_owned(), |p| p.as_str().to_owned());
    // The model list is not an LLM call and bills nothing: forwarded without attribution.
    let is_model_list = req.method() == actix_web::http::Method::GET && req.path() == "/v1/models";
    let traceparent = req.headers().get("traceparent").and_then(|v| v.to_str().ok());
    let body = match read_limited(body, MAX_REQUEST_BYTES).await {
        Ok(b) => b,
        Err(resp) => {
            state.metrics.refusals.with_label_values(&["body_too_large"]).inc();
            return resp;
        }
    };
    // Protocol 4: the trace id of the `agent` frame. Protocol 3 sends none; there the run's token
    // rides in the system prompt. Exactly one live run must match, or the call is refused.
    let scope = req.app_data::<web::Data<RunScope>>().map(|s| s.0.clone());
    let billing = match (scope, trace_id_of(traceparent)) {
        (Some(_), _) if is_model_list => None,
        (Some(run), _) if run.revoked.is_cancelled() => {
            return refuse(&state, "unknown_trace", format!("run {} has ended; its LLM socket forwards no more calls", run.run_id))
        }
        (Some(run), _) => Some(run),
        // The model list is not a run's call: no store lookup for it.
        (None, Some(trace)) if is_model_list => state.attributions.lookup(&trace),
        (None, Some(trace)) => match find(&state, CallKey::Trace(trace.clone()), state.attributions.lookup(&trace)).await {
            Ok(Resolved::Found(b)) => Some(b),
            Ok(Resolved::Missing) => {
                return refuse(&state, "unknown_trace", format!("trace id {trace} belongs to no live clawmux run; LLM calls are only forwarded for live runs"))
            }
            Ok(Resolved::MissingCached) => return unavailable(&state, "recent_miss", &format!("no live run had trace id {trace} a moment ago")),
            Err(e) => return store_unavailable(&state, &e),
        },
        (None, None) if is_model_list => None,
        (None, None) => {
            // Two are as many as the answer needs (none, one, or ambiguous).
            let tokens = crate::attribution::tokens_in(&body, 2);
            match tokens.as_slice() {
                [] => {
                    return refuse(&state, "no_traceparent", "the call carries neither a W3C traceparent nor a clawmux attribution token; it cannot be attributed to a run".to_owned())
                }
                [token] if !crate::attribution::is_token(token) => {
                    return refuse(&state, "unknown_token", "the call's attribution token belongs to no live clawmux run".to_owned())
                }
                [token] => match find(&state, CallKey::Token(token.clone()), state.attributions.lookup_token(token)).await {
                    Ok(Resolved::Found(b)) => Some(b),
                    Ok(Resolved::Missing) => return refuse(&state, "unknown_token", "the call's attribution token belongs to no live clawmux run".to_owned()),
                    Ok(Resolved::MissingCached) => return unavailable(&state, "recent_miss", "no live run had the call's attribution token a moment ago"),
                    Err(e) => return store_unavailable(&state, &e),
                },
                _ => return refuse(&state, "ambiguous_token", "the call names several attribution tokens; refusing to guess".to_owned()),
            }
        }
    };
    if let Some(b) = &billing {
        // The run ended while it was looked up (its entry was revoked as the lookup returned it).
        if b.revoked.is_cancelled() {
            return refuse(&state, "unknown_trace", format!("run {} has ended; LLM calls are only forwarded for live runs", b.run_id));
        }
        // Suspended here (the shared store is out of reach): another replica may have taken the
        // run over and ended it, and a run of another account may have its trace id by now. Its
        // new calls wait until it is taken back here or found taken over (the entry goes then).
        if b.is_suspended() {
            return unavailable(&state, "run_suspended", &format!("run {} is suspended here while the run store is out of reach", b.run_id));
        }
        // Another replica's run, and the store has not answered for a while: it may have ended
        // without this replica hearing it (cut from the database). Its calls wait for the store.
        if state.remote.as_ref().is_some_and(|r| !state.attributions.is_local(b) && !r.ends_heard()) {
            return unavailable(&state, "store_unavailable", &format!("run {} belongs to another replica and the run store has not answered for a while", b.run_id));
        }
    }
    let incoming: Vec<(String, String)> = req
        .headers()
        .iter()
        .filter_map(|(k, v)| v.to_str().ok().map(|v| (k.as_str().to_ascii_lowercase(), v.to_owned())))
        .collect();
    let url = upstream_url(&state.upstream, &path_and_query);
    let method = match reqwest::Method::from_bytes(req.method().as_str().as_bytes()) {
        Ok(m) => m,
        Err(_) => return HttpResponse::MethodNotAllowed().finish(),
    };

    let Some(billing) = billing else {
        // Model list: forward with the upstream key, nothing billed.
        let mut r = state.client.request(method, &url);
        if let Some(k) = &state.key {
            r = r.bearer_auth(k.expose());
        }
        return match r.send().await {
            Ok(resp) => relay_buffered(resp).await,
            Err(e) => HttpResponse::BadGateway().json(serde_json::json!({"error": {"code": "upstream_unreachable", "message": e.to_string()}})),
        };
    };

    // Headers a fork gateway set per session: they must agree with the trace, or we say so.
    for (name, expected) in [("x-litellm-end-user-id", &billing.billing_account_id), ("x-cogni-run-id", &billing.run_id)] {
        if let Some((_, given)) = incoming.iter().find(|(k, _)| k == name) {
            if given != expected {
                state.metrics.disagreements.inc();
                tracing::warn!(header = name, given = %given, attributed = %expected, run_id = %billing.run_id,
                    "incoming billing header disagrees with the trace attribution; the trace wins");
            }
        }
    }

    if let Some(budgets) = &state.budgets {
        match budgets.check_call(&billing.billing_account_id).await {
            CallBudget::Allowed => {}
            CallBudget::Exceeded => {
                match &state.remote {
                    // Another replica's run: its owner ends it (the cancel must come from there).
                    Some(remote) if !state.attributions.is_local(&billing) => remote.stop_for_budget(&billing.run_id).await,
                    _ => budgets.exceeded(&billing.run_id).await,
                }
                return refuse(
                    &state,
                    "budget_exceeded",
                    format!("refused by clawmux: run {} was stopped by its operator's policy for its account", billing.run_id),
                );
            }
            // Not forwarded (the budget may be spent), and nothing against the run: it goes on.
            CallBudget::Unknown => return unavailable(&state, "budget_unknown", &format!("the spend of run {}'s account cannot be read", billing.run_id)),
        }
    }
    let mut parsed: Option<serde_json::Value> = serde_json::from_slice(&body).ok();
    // Usage is billing truth only if the upstream reports it: ask for it on streams that do not
    // (protocol-3 gateways omit `stream_options`). The extra usage chunk is standard OpenAI.
    let body = match parsed.as_mut().and_then(request_usage) {
        Some(rewritten) => rewritten,
        None => body,
    };
    let model = parsed.as_ref().and_then(|v| v.get("model")).and_then(|m| m.as_str()).map(str::to_owned);
    let streamed = parsed.as_ref().and_then(|v| v.get("stream")).and_then(serde_json::Value::as_bool).unwrap_or(false);
    billing.count_call();

    let mut r = state.client.request(method, &url).body(body);
    for (k, v) in upstream_headers(&incoming, &billing, state.key.as_ref()) {
        r = r.header(k, v);
    }
    let started = Instant::now();
    let mut finisher = CallFinisher {
        state: state.clone(),
        billing: billing.clone(),
        record: Some(AuditRecord {
            time: now_rfc3339(),
            run_id: billing.run_id.clone(),
            billing_account_id: billing.billing_account_id.clone(),
            model,
            path: req.path().to_owned(),
            status: 0,
            outcome: String::new(),
            latency_ms: 0,
            streamed,
            input_tokens: None,
            output_tokens: None,
            upstream_call_id: None,
        }),
        started,
    };
    let resp = match r.send().await {
        Ok(resp) => resp,
        Err(e) => {
            finisher.finish("unreachable", None);
            return HttpResponse::BadGateway()
                .json(serde_json::json!({"error": {"code": "upstream_unreachable", "message": format!("the LLM upstream is unreachable: {e}")}}));
        }
    };
    state.metrics.upstream_latency.observe(started.elapsed().as_secs_f64());
    let status = resp.status().as_u16();
    let call_id = resp.headers().get("x-litellm-call-id").and_then(|v| v.to_str().ok()).map(str::to_owned);
    if let Some(rec) = finisher.record.as_mut() {
        rec.status = status;
        rec.upstream_call_id = call_id;
    }
    let mut out = HttpResponse::build(StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY));
    for (k, v) in resp.headers() {
        let name = k.as_str();
        if !DROPPED.contains(&name) {
            out.insert_header((name, v.as_bytes()));
        }
    }
    let is_sse = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).is_some_and(|ct| ct.starts_with("text/event-stream"));
    if is_sse {
        let revoked = Box::pin(billing.revoked.clone().cancelled_owned());
        let stream = MeteredStream { inner: Box::pin(resp.bytes_stream()), scanner: UsageScanner::default(), finisher, revoked };
        return out.streaming(stream);
    }
    match read_response_limited(resp, MAX_BUFFERED_RESPONSE).await {
        Ok(bytes) => {
            let usage = serde_json::from_slice::<serde_json::Value>(&bytes).ok().as_ref().and_then(usage_of);
            if let Some((i, o)) = usage {
                billing.add_usage(i, o);
                state.metrics.tokens.with_label_values(&["input"]).inc_by(i);
                state.metrics.tokens.with_label_values(&["output"]).inc_by(o);
            }
            finisher.finish(if (200..300).contains(&status) { "ok" } else { "upstream_error" }, usage);
            out.body(bytes)
        }
        Err(e) => {
            finisher.finish("upstream_error", None);
            HttpResponse::BadGateway().json(serde_json::json!({"error": {"code": "upstream_error", "message": e}}))
        }
    }
}

async fn relay_buffered(resp: reqwest::Response) -> HttpResponse {
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let ct = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("application/json").to_owned();
    match read_response_limited(resp, MAX_BUFFERED_RESPONSE).await {
        Ok(b) => HttpResponse::build(status).content_type(ct).body(b),
        Err(e) => HttpResponse::BadGateway().json(serde_json::json!({"error": {"code": "upstream_error", "message": e}})),
    }
}

async fn read_response_limited(resp: reqwest::Response, limit: usize) -> Result<Bytes, String> {
    use futures_util::StreamExt;
    let mut out = bytes::BytesMut::new();
    let mut s = resp.bytes_stream();
    while let Some(chunk) = s.next().await {
        let chunk = chunk.map_err(|e| format!("reading the upstream answer failed: {e}"))?;
        if out.len() + chunk.len() > limit {
            return Err(format!("the upstream answer exceeds {limit} bytes"));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out.freeze())
}

async fn read_limited(mut payload: web::Payload, limit: usize) -> Result<Bytes, HttpResponse> {
    use futures_util::StreamExt;
    let mut out = bytes::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| HttpResponse::BadRequest().json(serde_json::json!({"error": {"code": "invalid_request", "message": e.to_string()}})))?;
        if out.len() + chunk.len() > limit {
            return Err(HttpResponse::PayloadTooLarge()
                .json(serde_json::json!({"error": {"code": "payload_too_large", "message": format!("request body exceeds {limit} bytes")}})));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out.freeze())
}

/// The proxy's routes.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(web::resource("/v1/{tail:.*}").to(forward)).default_service(web::to(|| async {
        HttpResponse::NotFound().json(serde_json::json!({"error": {"code": "not_found", "message": "the LLM proxy serves /v1/* only"}}))
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::test as web_test;
    use std::sync::atomic::Ordering;

    /// A proxy whose upstream refuses connections: a call it forwards is answered `502`.
    fn proxy(attributions: Arc<Attributions>, budgets: Option<Arc<crate::tenants::budget::Budgets>>, remote: Option<Arc<crate::remote_runs::RemoteRuns>>) -> web::Data<ProxyState> {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port");
        proxy_to(&format!("http://{closed}"), attributions, budgets, remote)
    }

    fn proxy_to(
        upstream: &str,
        attributions: Arc<Attributions>,
        budgets: Option<Arc<crate::tenants::budget::Budgets>>,
        remote: Option<Arc<crate::remote_runs::RemoteRuns>>,
    ) -> web::Data<ProxyState> {
        web::Data::new(ProxyState {
            attributions,
            upstream: upstream.to_owned(),
            key: None,
            client: reqwest::Client::new(),
            audit: AuditSink::disabled(),
            metrics: ProxyMetrics::new(&Registry::new()).expect("metrics"),
            budgets,
            remote,
            shared_audit: None,
        })
    }

    /// One chat call with the trace id `trace`: its status, `Retry-After` and `error.code`.
    async fn call(state: &web::Data<ProxyState>, trace: &str) -> (u16, Option<String>, String) {
        let app = web_test::init_service(actix_web::App::new().app_data(state.clone()).configure(routes)).await;
        let req = web_test::TestRequest::post()
            .uri("/v1/chat/completions")
            .insert_header(("traceparent", format!("00-{trace}-b7ad6b7169203331-01")))
            .set_json(serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
            .to_request();
        let resp = web_test::call_service(&app, req).await;
        let status = resp.status().as_u16();
        let retry = resp.headers().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_owned);
        let body: serde_json::Value = web_test::read_body_json(resp).await;
        (status, retry, body["error"]["code"].as_str().unwrap_or_default().to_owned())
    }

    const TRACE: &str = "0af7651916cd43dd8448eb211c80319c";

    fn unavailable() -> (u16, Option<String>, String) {
        (503, Some("1".to_owned()), "attribution_unavailable".to_owned())
    }

    /// An upstream that answers every request `200 {}` and records its request lines.
    async fn recording_upstream() -> (String, Arc<std::sync::Mutex<Vec<String>>>) {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("the upstream binds");
        let addr = listener.local_addr().expect("an address");
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = seen.clone();
        actix_web::rt::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let line = crate::test_http::request_line(&mut conn).await.unwrap_or_default();
                log.lock().expect("log").push(line);
                let _ = conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}").await;
            }
        });
        (format!("http://{addr}"), seen)
    }

    /// A live run's agent (trace id or its ephemeral socket's scope) reaches the upstream's
    /// inference routes only: not its admin API through dot segments (which the upstream's URL
    /// parser resolves), encoded ones, or other `/v1` routes, all of which carry the upstream key.
    #[actix_rt::test]
    async fn only_inference_routes_are_forwarded_with_the_upstream_key() {
        let (upstream, seen) = recording_upstream().await;
        let attributions = Arc::new(Attributions::new());
        let run = attributions.register(Arc::new(RunBilling::new("run-1", "acct-1", "g", "s", TRACE))).expect("registered");
        let state = proxy_to(&upstream, attributions, None, None);
        let bad = ["/v1/../key/generate", "/v1/%2e%2e/key/generate", "/v1/%2E%2E/spend/logs", "/v1/files", "/v1//chat/completions", "/v1/chat/completions/", "/v1/chat/../../key/generate"];
        for scoped in [false, true] {
            let mut app = actix_web::App::new().app_data(state.clone());
            if scoped {
                app = app.app_data(web::Data::new(RunScope(run.clone())));
            }
            let app = web_test::init_service(app.configure(routes)).await;
            for path in bad {
                let req = web_test::TestRequest::post()
                    .uri(path)
                    .insert_header(("traceparent", format!("00-{TRACE}-b7ad6b7169203331-01")))
                    .set_json(serde_json::json!({"model": "m", "messages": []}))
                    .to_request();
                assert_eq!(web_test::call_service(&app, req).await.status().as_u16(), 404, "{path} (scoped: {scoped})");
            }
            let get = web_test::TestRequest::get().uri("/v1/../health").to_request();
            assert_eq!(web_test::call_service(&app, get).await.status().as_u16(), 404, "scoped: {scoped}");
            assert!(seen.lock().expect("log").is_empty(), "forwarded: {:?}", seen.lock().expect("log"));
            let req = web_test::TestRequest::post()
                .uri("/v1/chat/completions")
                .insert_header(("traceparent", format!("00-{TRACE}-b7ad6b7169203331-01")))
                .set_json(serde_json::json!({"model": "m", "messages": []}))
                .to_request();
            assert_eq!(web_test::call_service(&app, req).await.status().as_u16(), 200, "scoped: {scoped}");
            assert_eq!(seen.lock().expect("log").drain(..).collect::<Vec<_>>(), ["POST /v1/chat/completions HTTP/1.1"], "scoped: {scoped}");
        }
    }

    proptest::proptest! {
        /// Fuzz: of any path an agent sends, only the listed routes are forwarded, and the URL
        /// built for one (with any query) reaches that route of the upstream and no other.
        #[test]
        fn only_listed_routes_reach_the_upstream_and_only_as_themselves(
            method in proptest::prelude::prop_oneof![proptest::prelude::Just("POST"), proptest::prelude::Just("GET"), proptest::prelude::Just("PUT")],
            path in proptest::prelude::prop_oneof![
                "/v1/[a-z./%2eE_-]{0,24}",
                proptest::prelude::Just("/v1/chat/completions".to_owned()),
                proptest::prelude::Just("/v1/models".to_owned()),
                "/v1/chat/completions[/.%?#a-z]{0,6}",
            ],
            query in "[a-z=&./%]{0,12}",
            root in proptest::prelude::prop_oneof![proptest::prelude::Just("http://litellm:4000"), proptest::prelude::Just("http://127.0.0.1:9/v1/")],
        ) {
            let listed = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/messages"];
            let expected = match method {
                "POST" => listed.contains(&path.as_str()),
                "GET" => path == "/v1/models",
                _ => false,
            };
            proptest::prop_assert_eq!(forwarded_route(method, &path), expected, "{} {}", method, path);
            if expected {
                let url = upstream_url(root, &format!("{path}?{query}"));
                let parsed = reqwest::Url::parse(&url).expect("a URL");
                proptest::prop_assert_eq!(parsed.path(), path.as_str(), "{}", url);
            }
        }
    }

    #[test]
    fn forwarded_routes_are_the_inference_apis_and_the_model_list() {
        assert!(forwarded_route("POST", "/v1/chat/completions") && forwarded_route("POST", "/v1/messages") && forwarded_route("GET", "/v1/models"));
        assert!(!forwarded_route("GET", "/v1/chat/completions") && !forwarded_route("DELETE", "/v1/models") && !forwarded_route("POST", "/v1/models"));
        assert!(!forwarded_route("POST", "/v1/fine_tuning/jobs") && !forwarded_route("GET", "/v1/models/../../key/info"));
    }

    #[actix_rt::test]
    async fn a_suspended_run_new_calls_are_answered_503_not_forwarded() {
        let attributions = Arc::new(Attributions::new());
        let run = attributions.register(Arc::new(RunBilling::new("run-1", "acct-1", "g", "s", TRACE))).expect("registered");
        let state = proxy(attributions, None, None);
        assert_eq!(call(&state, TRACE).await.0, 502, "a live run's call is forwarded (to an upstream that is not there)");
        run.suspend();
        assert_eq!(call(&state, TRACE).await, unavailable(), "another replica may have ended it, another account have its trace id");
        assert_eq!(run.totals().llm_calls, 1, "the refused call is not the run's");
    }

    /// An upstream that streams one chunk of an answer at once and the rest once `go` is told.
    fn held_upstream(go: Arc<tokio::sync::Notify>) -> String {
        use futures_util::StreamExt;
        let server = actix_web::HttpServer::new(move || {
            let go = go.clone();
            actix_web::App::new().default_service(web::to(move || {
                let go = go.clone();
                async move {
                    let first = futures_util::stream::once(async { Ok::<_, actix_web::Error>(Bytes::from_static(b"data: {\"choices\":[{\"delta\":{\"content\":\"one\"}}]}\n\n")) });
                    let rest = futures_util::stream::once(async move {
                        go.notified().await;
                        Ok(Bytes::from_static(b"data: {\"choices\":[{\"delta\":{\"content\":\"two\"}}]}\n\ndata: [DONE]\n\n"))
                    });
                    HttpResponse::Ok().content_type("text/event-stream").streaming(first.chain(rest))
                }
            }))
        })
        .workers(1)
        .bind("127.0.0.1:0")
        .expect("the upstream binds");
        let addr = server.addrs().first().copied().expect("an address");
        actix_web::rt::spawn(server.run());
        format!("http://{addr}")
    }

    #[actix_rt::test]
    async fn a_stream_in_flight_goes_on_when_its_run_is_suspended() {
        let go = Arc::new(tokio::sync::Notify::new());
        let attributions = Arc::new(Attributions::new());
        let run = attributions.register(Arc::new(RunBilling::new("run-1", "acct-1", "g", "s", TRACE))).expect("registered");
        let state = proxy_to(&held_upstream(go.clone()), attributions, None, None);
        let app = web_test::init_service(actix_web::App::new().app_data(state.clone()).configure(routes)).await;
        let req = web_test::TestRequest::post()
            .uri("/v1/chat/completions")
            .insert_header(("traceparent", format!("00-{TRACE}-b7ad6b7169203331-01")))
            .set_json(serde_json::json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
            .to_request();
        let resp = web_test::call_service(&app, req).await;
        assert_eq!(resp.status(), 200);
        // Suspended mid-answer: the gateway's run goes on, and so does the answer it is reading.
        run.suspend();
        go.notify_one();
        let body = actix_web::body::to_bytes(resp.into_body()).await.expect("the stream is not cut");
        let body = String::from_utf8_lossy(&body);
        assert!(body.contains("\"two\"") && body.contains("[DONE]"), "{body}");
        assert_eq!(call(&state, TRACE).await, unavailable(), "a new call waits");
    }

    #[actix_rt::test]
    async fn a_spend_that_cannot_be_read_answers_503_and_does_not_end_the_run() {
        let (budgets, store, stops) = crate::tenants::budget::tests::flaky_budgets("acct-1", 100, true).await;
        let attributions = Arc::new(Attributions::new());
        attributions.register(Arc::new(RunBilling::new("run-1", "acct-1", "g", "s", TRACE))).expect("registered");
        let state = proxy(attributions, Some(budgets), None);
        store.down.store(true, Ordering::SeqCst);
        assert_eq!(call(&state, TRACE).await, unavailable());
        assert_eq!(stops.load(Ordering::SeqCst), 0, "a store blip is no budget stop");
        store.down.store(false, Ordering::SeqCst);
        assert_eq!(call(&state, TRACE).await.0, 502, "the spend is read again: forwarded");
    }

    /// A replica that has not heard from the shared store for a while (cut from the database)
    /// cannot know whether another replica's run ended: that run's calls wait (503), and are
    /// forwarded again once the store answers.
    #[actix_rt::test]
    async fn a_remote_runs_calls_wait_while_the_store_is_not_heard_from() {
        let probe = Arc::new(crate::remote_runs::tests::Probe::default());
        probe.put("run-1", "acct-1", TRACE);
        let (remote, attributions) = crate::remote_runs::tests::remote_runs_heard_within(probe.clone(), std::time::Duration::from_millis(200)).await;
        let state = proxy(attributions, None, Some(remote.clone()));
        assert_eq!(call(&state, TRACE).await.0, 502, "found in the store: forwarded (to an upstream that is down)");
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        assert_eq!(call(&state, TRACE).await, unavailable(), "the store has not answered since");
        probe.ends_fail.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(remote.look_for_ends().await.is_err());
        assert_eq!(call(&state, TRACE).await, unavailable());
        probe.ends_fail.store(false, std::sync::atomic::Ordering::SeqCst);
        remote.look_for_ends().await.expect("the store answers");
        assert_eq!(call(&state, TRACE).await.0, 502, "forwarded again");
    }

    /// A token that is not of the shape clawmux makes (here 1 MiB long, from the request body)
    /// is refused at once: never looked up in the store nor remembered as a miss.
    #[actix_rt::test]
    async fn a_malformed_attribution_token_is_refused_without_a_lookup() {
        let probe = Arc::new(crate::remote_runs::tests::Probe::default());
        let (remote, attributions) = crate::remote_runs::tests::remote_runs(probe.clone()).await;
        let state = proxy(attributions, None, Some(remote));
        let app = web_test::init_service(actix_web::App::new().app_data(state.clone()).configure(routes)).await;
        for token in [format!("cmx-{}", "a".repeat(1 << 20)), "cmx-short".to_owned(), format!("cmx-{}", "z".repeat(64))] {
            let content = format!("{}{token}", crate::attribution::TOKEN_MARKER);
            let req = web_test::TestRequest::post()
                .uri("/v1/chat/completions")
                .set_json(serde_json::json!({"model": "m", "messages": [{"role": "system", "content": content}]}))
                .to_request();
            let resp = web_test::call_service(&app, req).await;
            assert_eq!(resp.status().as_u16(), 409, "{}", &token[..12]);
        }
        assert_eq!(probe.lookups.load(std::sync::atomic::Ordering::SeqCst), 0, "looked up in the store");
        assert_eq!(state.metrics.refusals.with_label_values(&["unknown_token"]).get(), 3);
    }

    #[actix_rt::test]
    async fn a_believed_miss_answers_503_and_a_fresh_one_409() {
        let probe = Arc::new(crate::remote_runs::tests::Probe::default());
        let (remote, attributions) = crate::remote_runs::tests::remote_runs(probe.clone()).await;
        let state = proxy(attributions, None, Some(remote));
        assert_eq!(call(&state, TRACE).await, (409, None, "attribution_refused".to_owned()), "nobody's: refused");
        // Admitted right after (on another replica): its calls are retried until the miss expires.
        probe.put("run-1", "acct-1", TRACE);
        assert_eq!(call(&state, TRACE).await, unavailable());
    }

    fn billing() -> RunBilling {
        RunBilling::new("run-1", "acct-1", "sandbox:openclaw", "agent:main:acct-1:run-1", "0af7651916cd43dd8448eb211c80319c")
    }

    #[test]
    fn forged_billing_headers_and_auth_are_replaced() {
        let incoming = vec![
            ("authorization".to_owned(), "Bearer gateway-provider-key".to_owned()),
            ("x-litellm-end-user-id".to_owned(), "someone-else".to_owned()),
            ("X-LiteLLM-Spend-Logs-Metadata".to_owned(), "{\"run_id\":\"forged\"}".to_owned()),
            ("x-cogni-run-id".to_owned(), "forged".to_owned()),
            ("x-litellm-api-key".to_owned(), "sk-forged".to_owned()),
            ("traceparent".to_owned(), "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned()),
            ("content-type".to_owned(), "application/json".to_owned()),
            ("connection".to_owned(), "keep-alive".to_owned()),
        ];
        let out = upstream_headers(&incoming, &billing(), Some(&Secret::new("sk-upstream")));
        let get = |k: &str| out.iter().filter(|(n, _)| n.eq_ignore_ascii_case(k)).map(|(_, v)| v.as_str()).collect::<Vec<_>>();
        assert_eq!(get("authorization"), ["Bearer sk-upstream"]);
        assert_eq!(get("x-litellm-end-user-id"), ["acct-1"]);
        assert_eq!(get("x-cogni-run-id"), ["run-1"]);
        assert_eq!(get("x-litellm-api-key"), Vec::<&str>::new());
        assert_eq!(get("connection"), Vec::<&str>::new());
        assert_eq!(get("traceparent").len(), 1, "the trace goes on upstream");
        let meta: serde_json::Value = serde_json::from_str(get("x-litellm-spend-logs-metadata")[0]).expect("json");
        assert_eq!(meta["run_id"], "run-1");
    }

    #[test]
    fn trace_ids_are_read_only_from_valid_traceparents() {
        assert_eq!(trace_id_of(Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")).as_deref(), Some("0af7651916cd43dd8448eb211c80319c"));
        assert_eq!(trace_id_of(Some("garbage")), None);
        assert_eq!(trace_id_of(None), None);
    }

    #[test]
    fn usage_is_found_across_chunk_boundaries() {
        let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":120,\"completion_tokens\":7,\"total_tokens\":127}}\n\ndata: [DONE]\n\n";
        for split in 1..stream.len() {
            let mut s = UsageScanner::default();
            let mut found = None;
            for part in [&stream.as_bytes()[..split], &stream.as_bytes()[split..]] {
                if let Some(u) = s.feed(part) {
                    found = Some(u);
                }
            }
            assert_eq!(found, Some((120, 7)), "split at {split}");
        }
    }

    #[test]
    fn content_mentioning_usage_is_not_usage() {
        let mut s = UsageScanner::default();
        assert_eq!(s.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"the \\\"usage\\\" field\"}}]}\n"), None);
    }

    #[test]
    fn usage_is_requested_on_streams_that_lack_it() {
        let mut v = serde_json::json!({"model":"m","stream":true,"messages":[]});
        let out: serde_json::Value = serde_json::from_slice(&request_usage(&mut v).expect("rewritten")).expect("json");
        assert_eq!(out["stream_options"]["include_usage"], true);
        let mut v = serde_json::json!({"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[]});
        assert!(request_usage(&mut v).is_none());
        let mut v = serde_json::json!({"model":"m","stream":false,"messages":[]});
        assert!(request_usage(&mut v).is_none());
    }

    #[test]
    fn upstream_urls_join_roots_and_v1_roots() {
        assert_eq!(upstream_url("http://litellm:4000", "/v1/chat/completions"), "http://litellm:4000/v1/chat/completions");
        assert_eq!(upstream_url("http://litellm:4000/", "/v1/models"), "http://litellm:4000/v1/models");
        assert_eq!(upstream_url("http://127.0.0.1:9/v1", "/v1/chat/completions?x=1"), "http://127.0.0.1:9/v1/chat/completions?x=1");
    }
}
