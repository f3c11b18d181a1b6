//! The HTTP API of `docs/API.md` (actix-web): validate → submit → respond. A run's life belongs
//! to the actors (`clawmux_actors::registry`); its events and document to the run store.

use crate::agents::AgentRegistry;
use crate::config::Config;
use crate::request::{self, Limits, OnDisconnect, RequestError};
use crate::store::query;
use crate::store::{Insert, RunLog, RunRow, RunStore, RunView, SpecRecord, StoredEvent};
use actix::Addr;
use actix_web::http::header::{self, HeaderValue};
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse, ResponseError};
use actix_web_lab::sse;
use clawmux_actors::messages::{AdmitError, Cancel, Submit};
use clawmux_actors::{CancelReason, Registry, RunSink, RunSpec, StatusHandle};
use clawmux_protocol::session_key::Conversation;
use clawmux_protocol::{SessionKey, TraceParent};
use futures_util::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::broadcast::error::RecvError;

/// How long an HTTP handler waits for the registry to admit a run before answering 503.
const ADMIT_TIMEOUT: Duration = Duration::from_secs(5);
/// Comment lines keep quiet streams alive through proxies.
const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// JSON overhead allowed around a maximal `message`.
const BODY_OVERHEAD: usize = 64 * 1024;

/// Everything the handlers share.
pub struct AppState {
    /// Effective configuration.
    pub cfg: Config,
    /// Runs: live logs, stored documents and events, history.
    pub store: Arc<RunStore>,
    /// The registry of live runs (admission, cancels).
    pub registry: Addr<Registry>,
    /// Gateway status for `/readyz`.
    pub status: StatusHandle,
    /// Prometheus registry for `/metrics`.
    pub metrics: prometheus::Registry,
    /// `GET /v1/agents`.
    pub agents: AgentRegistry,
    /// Live runs by trace id (the LLM proxy attributes calls with it); `None` without a proxy.
    pub attributions: Option<Arc<crate::attribution::Attributions>>,
    /// True when `CLAWMUX_RELAY_CONTAINER` is set (branch runs are possible).
    pub relay: bool,
    /// Flips to true at shutdown: live SSE streams end (clients re-attach to the next process)
    /// and nothing new is admitted.
    pub stopping: tokio::sync::watch::Receiver<bool>,
}

/// An error answer: `{"error":{"code","message"}}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, code, message: message.into(), retry_after: None }
    }
    fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }
    fn not_found(run_id: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", format!("no run with id {run_id:?} (finished runs are kept for a bounded time)"))
    }
    fn unavailable(message: impl Into<String>) -> Self {
        Self { retry_after: Some(2), ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "gateway_unavailable", message) }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }
    fn error_response(&self) -> HttpResponse {
        let mut r = HttpResponse::build(self.status);
        if let Some(s) = self.retry_after {
            r.insert_header((header::RETRY_AFTER, s.to_string()));
        }
        r.json(serde_json::json!({"error": {"code": self.code, "message": self.message}}))
    }
}

/// Wires the routes.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(
        web::resource("/v1/runs").route(web::post().to(create_run)).route(web::get().to(list_runs)).default_service(web::to(method_not_allowed)),
    )
        .service(web::resource("/v1/runs/{run_id}").route(web::get().to(get_run)).default_service(web::to(method_not_allowed)))
        .service(web::resource("/v1/runs/{run_id}/events").route(web::get().to(run_events)).default_service(web::to(method_not_allowed)))
        .service(web::resource("/v1/runs/{run_id}/abort").route(web::post().to(abort_run)).default_service(web::to(method_not_allowed)))
        .service(web::resource("/v1/agents").route(web::get().to(list_agents)).default_service(web::to(method_not_allowed)))
        .route("/healthz", web::get().to(healthz))
        .route("/readyz", web::get().to(readyz))
        .route("/metrics", web::get().to(metrics))
        .default_service(web::to(not_found));
}

async fn not_found(req: HttpRequest) -> HttpResponse {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no such endpoint: {} {}", req.method(), req.path())).error_response()
}

async fn method_not_allowed(req: HttpRequest) -> HttpResponse {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", format!("{} is not allowed on {}", req.method(), req.path()))
        .error_response()
}

/// Bearer auth on `/v1/*`; without a configured token only loopback callers are served.
fn authorize(req: &HttpRequest, state: &AppState) -> Result<(), ApiError> {
    match &state.cfg.api_token {
        Some(token) => {
            let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(bearer_token);
            match given {
                Some(g) if constant_time_eq(g.as_bytes(), token.expose().as_bytes()) => Ok(()),
                Some(_) => Err(ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "the bearer token is not valid")),
                None => Err(ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "missing `Authorization: Bearer <token>` header")),
            }
        }
        None => match req.peer_addr() {
            Some(a) if a.ip().is_loopback() => Ok(()),
            _ => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "no CLAWMUX_API_TOKEN is configured, so only loopback clients are served",
            )),
        },
    }
}

/// The token of an `Authorization: Bearer <token>` value. The scheme is case-insensitive
/// (RFC 7235 section 2.1), one or more spaces separate it from the token.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, rest) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = rest.trim_start_matches(' ');
    (!token.is_empty()).then_some(token)
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn read_body(mut payload: web::Payload, limit: usize) -> Result<web::BytesMut, ApiError> {
    let mut body = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| ApiError::invalid(format!("cannot read the request body: {e}")))?;
        if body.len() + chunk.len() > limit {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                format!("the request body exceeds {limit} bytes (CLAWMUX_MAX_MESSAGE_BYTES plus JSON overhead)"),
            ));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

fn wants_sse(req: &HttpRequest) -> bool {
    req.headers().get_all(header::ACCEPT).filter_map(|v| v.to_str().ok()).any(|v| v.contains("text/event-stream"))
}

fn query_wait_false(req: &HttpRequest) -> Result<bool, ApiError> {
    for pair in req.query_string().split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if k == "wait" {
            return match v {
                "false" | "0" => Ok(true),
                "true" | "1" | "" => Ok(false),
                other => Err(ApiError::invalid(format!("query `wait`: {other:?} is not true or false"))),
            };
        }
    }
    Ok(false)
}

fn new_trace() -> TraceParent {
    // Random 128-bit and 64-bit ids rendered as lower-case hex; the constructor refuses the
    // (astronomically unlikely) all-zero id, in which case we draw again.
    loop {
        let trace = uuid::Uuid::new_v4().simple().to_string();
        let span = uuid::Uuid::new_v4().simple().to_string();
        if let Ok(t) = TraceParent::new(&trace, &span[..16], 1) {
            return t;
        }
    }
}

fn store_unavailable(e: impl std::fmt::Display) -> ApiError {
    ApiError { retry_after: Some(2), ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", format!("the run store is not available: {e}")) }
}

fn admit_error(e: AdmitError, run_id: &str) -> ApiError {
    match e {
        AdmitError::GatewayDown(reason) => ApiError::unavailable(format!("the gateway is not available: {reason}")),
        e @ AdmitError::AtCapacity(_) => ApiError::unavailable(e.to_string()),
        AdmitError::ShuttingDown => ApiError::unavailable("clawmux is shutting down; retry against the next instance"),
        AdmitError::Duplicate => ApiError::new(StatusCode::CONFLICT, "conflict", format!("run {run_id:?} is already in flight")),
    }
}

async fn create_run(req: HttpRequest, payload: web::Payload, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state)?;
    if *state.stopping.borrow() {
        return Err(admit_error(AdmitError::ShuttingDown, ""));
    }
    let wait_false = query_wait_false(&req)?;
    let limit = state.cfg.max_message_bytes.saturating_add(BODY_OVERHEAD);
    let body = read_body(payload, limit).await?;
    let limits = Limits {
        max_message_bytes: state.cfg.max_message_bytes,
        default_timeout_sec: state.cfg.run_timeout_sec,
        max_timeout_sec: state.cfg.max_run_timeout_sec,
    };
    let run = request::decode(&body)
        .and_then(|r| request::validate(r, limits, || uuid::Uuid::new_v4().to_string()))
        .map_err(|e| match e {
            RequestError::Invalid(m) => ApiError::invalid(m),
            RequestError::TooLarge(m) => ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", m),
        })?;
    if let Some(key) = &run.branch_key {
        if key.eq_ignore_ascii_case(&state.cfg.relay_base_ref) {
            return Err(ApiError::invalid(format!("field `branch`: branch key {key:?} is the protected base ref")));
        }
        if !state.relay {
            return Err(ApiError::invalid(
                "field `branch`: this clawmux has no git relay (CLAWMUX_RELAY_CONTAINER is not set), so it cannot work on a branch",
            ));
        }
    }
    if state.agents.get(&run.agent_id).is_none() {
        return Err(ApiError::invalid(format!("field `agentId`: unknown agent {:?} (see GET /v1/agents)", run.agent_id)));
    }
    let traceparent = match req.headers().get("traceparent") {
        None => new_trace(),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| TraceParent::parse(s).ok())
            .ok_or_else(|| ApiError::invalid("header `traceparent`: not a valid W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>)"))?,
    };
    let idempotency_key = match req.headers().get("idempotency-key") {
        None => None,
        Some(v) => match v.to_str() {
            Ok(s) if (1..=256).contains(&s.len()) => Some(s.to_owned()),
            _ => return Err(ApiError::invalid("header `Idempotency-Key`: must be 1 to 256 visible ASCII characters")),
        },
    };
    let conversation = match run.request.state_key.as_deref() {
        Some(state) => Conversation::State(state),
        None => Conversation::Run(&run.run_id),
    };
    let session_key = SessionKey::for_run(&run.agent_id, &run.request.billing_account_id, conversation)
        .map_err(|e| ApiError::invalid(format!("cannot name the run's session: {e}")))?;
    let branch = run.branch_key.as_ref().map(|key| {
        let b = run.request.branch.clone().unwrap_or_default();
        clawmux_actors::branch::BranchPlan {
            key: key.clone(),
            base_ref: b.base_ref.unwrap_or_else(|| state.cfg.relay_base_ref.clone()),
            pr_title: b.pr_title,
            pr_body: b.pr_body,
        }
    });
    let abort_on_disconnect = run.on_disconnect == OnDisconnect::Abort;
    let spec = RunSpec {
        run_id: run.run_id.clone(),
        // Fixed at admission and stored: a restart sends the same idempotency key, never a new one.
        gateway_run_id: uuid::Uuid::new_v4().to_string(),
        session_key,
        agent_id: run.agent_id.clone(),
        message: run.request.message.clone(),
        model: run.request.model.clone(),
        billing_account_id: run.request.billing_account_id.clone(),
        graph_id: run.graph_id.clone(),
        admitted_at: std::time::SystemTime::now(),
        timeout: Duration::from_secs(run.timeout_sec),
        traceparent,
        attribution_token: state.attributions.as_ref().map(|_| crate::attribution::new_token()),
        branch,
    };
    let row = RunRow {
        seq: 0,
        run_id: run.run_id.clone(),
        idempotency_key: idempotency_key.clone(),
        fingerprint: request::fingerprint(&run.request),
        billing_account_id: run.request.billing_account_id.clone(),
        state_key: run.request.state_key.clone(),
        session_key: spec.session_key.as_str().to_owned(),
        spec: SpecRecord {
            gateway_run_id: spec.gateway_run_id.clone(),
            agent_id: spec.agent_id.clone(),
            message: spec.message.clone(),
            model: spec.model.clone(),
            graph_id: spec.graph_id.clone(),
            timeout_ms: u64::try_from(spec.timeout.as_millis()).unwrap_or(u64::MAX),
            traceparent: spec.traceparent.to_string(),
            attribution_token: spec.attribution_token.clone(),
            branch: spec.branch.clone(),
            abort_on_disconnect,
        },
        status: "queued".to_owned(),
        checkpoint: None,
        gateway_run_id: None,
        content: String::new(),
        error: None,
        gateway_usage: None,
        usage: state.attributions.as_ref().map(|_| crate::attribution::Usage::default()),
        relay: None,
        created_at_ms: crate::store::now_ms(),
        finished_at_ms: None,
        last_event_id: 0,
    };
    let log = match state.store.insert(row).await.map_err(store_unavailable)? {
        Insert::New(log) => log,
        Insert::Existing(view) => return respond(&req, &state, view, wait_false, false).await,
        Insert::Conflict => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "conflict",
                format!("run {:?} already exists with a different request body", run.run_id),
            ))
        }
        Insert::IdempotencyMismatch => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency_mismatch",
                "this Idempotency-Key was used with a different request body",
            ))
        }
    };
    let admitted = match admit(&state, &log, spec, None).await {
        Ok(a) => a,
        Err(e) => {
            state.store.forget(&run.run_id).await;
            return Err(e);
        }
    };
    tracing::info!(run_id = %run.run_id, session_key = %log.doc().session_key, ?admitted, "run admitted");
    if wait_false && !wants_sse(&req) {
        // The document as stored may not show the start yet (its write is in the group commit
        // queue); the registry's answer is what holds now.
        let mut doc = log.doc();
        if admitted == clawmux_actors::Admitted::Started && doc.status == "queued" {
            doc.status = "running".to_owned();
        }
        return Ok(HttpResponse::Accepted().json(doc));
    }
    respond(&req, &state, RunView::Live(log), wait_false, abort_on_disconnect).await
}

/// Makes a stored run attributable and hands it to the registry (new runs and, with `resume`,
/// runs a restart continues).
pub async fn admit(
    state: &AppState,
    log: &Arc<RunLog>,
    spec: RunSpec,
    resume: Option<clawmux_actors::Resume>,
) -> Result<clawmux_actors::Admitted, ApiError> {
    let trace_id = spec.traceparent.trace_id().to_owned();
    if let Some(registry) = &state.attributions {
        // Attributable before admission: the gateway may call the LLM as soon as `agent` is sent.
        let mut billing = crate::attribution::RunBilling::new(
            &spec.run_id,
            &spec.billing_account_id,
            &spec.graph_id,
            spec.session_key.as_str(),
            &trace_id,
        );
        if let Some(t) = &spec.attribution_token {
            billing = billing.with_token(t.clone());
        }
        if let Some(usage) = log.stored_usage() {
            billing = billing.with_usage(usage);
        }
        let billing = Arc::new(billing);
        if let Err(owner) = registry.register(billing.clone()) {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "conflict",
                format!("the traceparent's trace id is in use by live run {owner:?}; concurrent runs need distinct trace ids"),
            ));
        }
        log.set_billing(billing, registry.clone());
    }
    let run_id = spec.run_id.clone();
    let registry = state.registry.clone();
    let cancel_id = run_id.clone();
    log.on_failure(Box::new(move || registry.do_send(Cancel { run_id: cancel_id.clone(), reason: CancelReason::Api })));
    let sink: Arc<dyn RunSink> = log.clone();
    let admitted = state.registry.send(Submit { spec, sink, resume }).timeout(ADMIT_TIMEOUT).await;
    let refusal = match admitted {
        Ok(Ok(admitted)) => return Ok(admitted),
        Ok(Err(e)) => admit_error(e, &run_id),
        Err(_) => ApiError::unavailable("clawmux is overloaded; retry shortly"),
    };
    if let Some(registry) = &state.attributions {
        registry.unregister(&trace_id, &run_id);
    }
    Err(refusal)
}

/// Answers a POST for a run: SSE, 202 at once, or the document at the end.
async fn respond(req: &HttpRequest, state: &web::Data<AppState>, view: RunView, wait_false: bool, arm: bool) -> Result<HttpResponse, ApiError> {
    let guard = DisconnectGuard { run_id: view.run_id().to_owned(), view: view.clone(), registry: state.registry.clone(), armed: arm };
    if wants_sse(req) {
        return sse_response(req, state, view, 0, guard).await;
    }
    let log = match (&view, wait_false) {
        (RunView::Live(log), false) => log.clone(),
        _ => {
            let mut g = guard;
            g.disarm();
            let status = if view.is_finished() { StatusCode::OK } else { StatusCode::ACCEPTED };
            return Ok(HttpResponse::build(status).json(view.doc()));
        }
    };
    // Dropping this future (the caller went away) drops the guard, which cancels the run.
    let mut stopping = state.stopping.clone();
    tokio::select! {
        () = log.finished() => {}
        _ = stopping.wait_for(|s| *s) => {
            // Handed off: the run goes on in the next process; this caller gets its state now.
            let mut g = guard;
            g.disarm();
            return Ok(HttpResponse::Accepted().json(log.doc()));
        }
    }
    let mut g = guard;
    g.disarm();
    Ok(HttpResponse::Ok().json(log.doc()))
}

/// Cancels the run when a caller that asked for `onDisconnect: abort` goes away before the end.
struct DisconnectGuard {
    run_id: String,
    view: RunView,
    registry: Addr<Registry>,
    armed: bool,
}

impl DisconnectGuard {
    fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for DisconnectGuard {
    fn drop(&mut self) {
        if self.armed && !self.view.is_finished() {
            tracing::info!(run_id = %self.run_id, "caller disconnected; cancelling the run (onDisconnect: abort)");
            self.registry.do_send(Cancel { run_id: self.run_id.clone(), reason: CancelReason::ClientGone });
        }
    }
}

struct SseState {
    backlog: std::vec::IntoIter<Arc<StoredEvent>>,
    rx: Option<tokio::sync::broadcast::Receiver<Arc<StoredEvent>>>,
    last_id: u64,
    done: bool,
    guard: DisconnectGuard,
    stopping: tokio::sync::watch::Receiver<bool>,
}

fn to_sse(ev: &StoredEvent) -> sse::Event {
    sse::Event::Data(sse::Data::new(ev.data.clone()).event(ev.name.as_str()).id(ev.id.to_string()))
}

async fn sse_response(
    req: &HttpRequest,
    state: &web::Data<AppState>,
    view: RunView,
    after: u64,
    guard: DisconnectGuard,
) -> Result<HttpResponse, ApiError> {
    let (backlog, rx) = match &view {
        RunView::Live(log) => log.attach(after),
        // Not live here: what the store has, then the stream closes.
        RunView::Stored(row) => {
            let events = state.store.events(&row.run_id, after).await.map_err(store_unavailable)?;
            (events.into_iter().map(Arc::new).collect(), None)
        }
    };
    let st = SseState { backlog: backlog.into_iter(), rx, last_id: after, done: false, guard, stopping: state.stopping.clone() };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let ev = match st.backlog.next() {
            Some(ev) => ev,
            None => loop {
                let rx = st.rx.as_mut()?;
                let next = tokio::select! {
                    r = rx.recv() => r,
                    _ = st.stopping.wait_for(|s| *s) => {
                        // Shutdown: end the stream cleanly, without a terminal event; the client
                        // re-attaches with Last-Event-ID to the next process. The run goes on.
                        st.guard.disarm();
                        return None;
                    }
                };
                match next {
                    Ok(ev) if ev.id <= st.last_id => continue,
                    Ok(ev) => break ev,
                    Err(RecvError::Lagged(n)) => {
                        // Too slow: drop this client (it can re-attach with Last-Event-ID); the
                        // run itself goes on.
                        tracing::warn!(run_id = %st.guard.run_id, skipped = n, "SSE client too slow; disconnecting it");
                        st.guard.disarm();
                        return None;
                    }
                    Err(RecvError::Closed) => return None,
                }
            },
        };
        st.last_id = ev.id;
        if ev.is_terminal() {
            st.done = true;
            st.guard.disarm();
        }
        Some((to_sse(&ev), st))
    });
    let mut resp = sse::Sse::from_infallible_stream(stream).with_keep_alive(KEEP_ALIVE).respond_to(req);
    resp.headers_mut().insert(header::HeaderName::from_static("x-accel-buffering"), HeaderValue::from_static("no"));
    Ok(resp.map_into_boxed_body())
}

use actix_web::Responder;

async fn find(state: &AppState, run_id: &str) -> Result<RunView, ApiError> {
    state.store.view(run_id).await.map_err(store_unavailable)?.ok_or_else(|| ApiError::not_found(run_id))
}

async fn get_run(req: HttpRequest, path: web::Path<String>, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state)?;
    Ok(HttpResponse::Ok().json(find(&state, &path).await?.doc()))
}

async fn list_runs(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state)?;
    let q = query::parse(req.query_string()).map_err(|e| {
        let what = if e.param == "query" { "the query".to_owned() } else { format!("query parameter `{}`", e.param) };
        ApiError::invalid(format!("{what}: {}", e.message))
    })?;
    let (runs, last_seq) = state.store.list(&q).await.map_err(store_unavailable)?;
    let next = if runs.len() == q.limit { last_seq.map(query::cursor) } else { None };
    Ok(HttpResponse::Ok().json(serde_json::json!({"runs": runs, "nextCursor": next})))
}

async fn run_events(req: HttpRequest, path: web::Path<String>, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state)?;
    let view = find(&state, &path).await?;
    let after = match req.headers().get("last-event-id") {
        None => 0,
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .ok_or_else(|| ApiError::invalid("header `Last-Event-ID`: must be an event id (a non-negative integer)"))?,
    };
    // Re-attaching never cancels on disconnect: only the caller that started the run decides that.
    let guard = DisconnectGuard { run_id: view.run_id().to_owned(), view: view.clone(), registry: state.registry.clone(), armed: false };
    sse_response(&req, &state, view, after, guard).await
}

async fn abort_run(req: HttpRequest, path: web::Path<String>, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state)?;
    let view = find(&state, &path).await?;
    let run_id = view.run_id().to_owned();
    if view.is_finished() {
        return Ok(HttpResponse::Accepted().json(serde_json::json!({"runId": run_id, "aborted": false})));
    }
    let found = state
        .registry
        .send(Cancel { run_id: run_id.clone(), reason: CancelReason::Api })
        .timeout(ADMIT_TIMEOUT)
        .await
        .map_err(|_| ApiError::unavailable("clawmux is overloaded; retry the abort shortly"))?;
    Ok(HttpResponse::Accepted().json(serde_json::json!({"runId": run_id, "aborted": found})))
}

async fn list_agents(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state)?;
    Ok(HttpResponse::Ok().json(&state.agents))
}

async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({"status": "ok"}))
}

async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    let s = match state.status.read() {
        Ok(s) => s.clone(),
        Err(p) => p.into_inner().clone(),
    };
    match s.ready() {
        Ok(()) => HttpResponse::Ok().json(serde_json::json!({
            "gateway": "connected",
            "protocol": s.protocol,
            "serverVersion": s.server_version,
            "sessionScopedEvents": s.session_scoped,
            "scopes": s.scopes,
            "outboundHeaders": s.outbound_headers,
        })),
        Err(reason) => HttpResponse::ServiceUnavailable().insert_header((header::RETRY_AFTER, "2")).json(serde_json::json!({
            "gateway": if s.connected { "connected" } else { "disconnected" },
            "reason": reason,
            "error": {"code": "gateway_unavailable", "message": reason},
        })),
    }
}

async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    use prometheus::Encoder;
    let mut buf = Vec::new();
    let encoder = prometheus::TextEncoder::new();
    match encoder.encode(&state.metrics.gather(), &mut buf) {
        Ok(()) => HttpResponse::Ok().content_type(encoder.format_type()).body(buf),
        Err(e) => HttpResponse::InternalServerError().body(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        for v in ["Bearer t0k", "bearer t0k", "BEARER t0k", "bEaReR   t0k"] {
            assert_eq!(bearer_token(v), Some("t0k"), "{v}");
        }
        for v in ["Basic dXNlcjpwYXNz", "Bearer", "Bearer ", "Bearert0k", "t0k", ""] {
            assert_eq!(bearer_token(v), None, "{v}");
        }
    }
}
