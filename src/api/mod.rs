//! The HTTP API of `docs/API.md` (actix-web): validate → submit (`crate::admission`) → respond. A
//! run's life belongs to the actors (`clawmux_actors::registry`); its events and document to the
//! run store.
//!
//! # Layout
//! - this module: the shared state, routes, the error shape, authentication (the admin token or
//!   an API key, see `crate::tenants`), health, readiness, metrics, agents.
//! - [`runs`]: `POST /v1/runs` and everything about one run or the history.
//! - [`sse`]: a run's event stream (backlog from the store, then live) and the disconnect guard.
//! - [`admin`]: `/v1/admin/*`: API keys and account limits.
//! - [`openapi`]: the OpenAPI 3.1 document of all of the above, generated from the handlers'
//!   annotations and the request and response types (`GET /openapi.json`).
//! - [`starting`]: the API port's `503` while clawmux starts, before any of the above serves.
//!
//! Every answer is a typed value whose schema is derived from the type itself, so the document
//! cannot drift from what the handlers send.

mod admin;
pub mod openapi;
mod runs;
mod sse;
pub mod starting;

use crate::agents::AgentRegistry;
use serde::Serialize;
use crate::config::Config;
use crate::store::RunStore;
use crate::tenants::keys::{Action, Principal};
use crate::tenants::{AuthError, Tenants};
use actix::Addr;
use actix_web::http::header;
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse, ResponseError};
use clawmux_actors::{Registry, StatusHandle};
use clawmux_protocol::TraceParent;
use futures_util::StreamExt;
use std::sync::Arc;
use std::time::Duration;

/// How long an HTTP handler waits for the registry before answering 503.
const ADMIT_TIMEOUT: Duration = Duration::from_secs(5);

/// Everything the handlers share.
pub struct AppState {
    /// Effective configuration.
    pub cfg: Config,
    /// Runs: live logs, stored documents and events, history.
    pub store: Arc<RunStore>,
    /// The registry of live runs (cancels).
    pub registry: Addr<Registry>,
    /// Where new runs go (`POST /v1/runs`) and stored ones continue (the restart path).
    pub admission: crate::admission::Admission,
    /// Gateway status for `/readyz`.
    pub status: StatusHandle,
    /// Prometheus registry for `/metrics`.
    pub metrics: prometheus::Registry,
    /// `clawmux_run_start_seconds`, whose `admit` stage the HTTP layer observes.
    pub run_start: prometheus::HistogramVec,
    /// `GET /v1/agents`.
    pub agents: AgentRegistry,
    /// Live runs by trace id (the LLM proxy attributes calls with it); `None` without a proxy.
    pub attributions: Option<Arc<crate::attribution::Attributions>>,
    /// True when `CLAWMUX_RELAY_CONTAINER` is set (branch runs are possible).
    pub relay: bool,
    /// The relay, for the checks of a branch run before its admission (`None`: no relay).
    pub workspace: Option<Arc<dyn clawmux_actors::branch::Workspace>>,
    /// Keys, budgets, webhooks.
    pub tenants: Arc<Tenants>,
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
    pub(crate) retry_after: Option<u64>,
    /// The methods a resource has, for the `Allow` header of a `405`.
    allow: Option<String>,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, code, message: message.into(), retry_after: None, allow: None }
    }
    pub(crate) fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }
    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }
    pub(crate) fn not_found(run_id: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", format!("no run with id {run_id:?} (finished runs are kept for a bounded time)"))
    }
    pub(crate) fn unavailable(message: impl Into<String>) -> Self {
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
        if self.status == StatusCode::METHOD_NOT_ALLOWED {
            // RFC 9110: a 405 names the methods the resource has.
            r.insert_header((header::ALLOW, self.allow.clone().unwrap_or_default()));
        }
        r.json(ErrorBody { error: ErrorDetail { code: self.code, message: self.message.clone() } })
    }
}

/// Every error answer: `{"error":{"code","message"}}`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// The `error` of an error answer (and of `/readyz` when not ready).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    /// Machine-readable: `invalid_request`, `unauthorized`, `forbidden`, `not_found`,
    /// `method_not_allowed`, `conflict`, `session_busy`, `payload_too_large`,
    /// `idempotency_mismatch`, `unknown_base_ref`, `branch_conflict`, `budget_exceeded`,
    /// `rate_limited`, `gateway_unavailable`, `store_unavailable`, `budget_unavailable`,
    /// `audit_unavailable`, `keys_busy_apart`.
    #[schema(value_type = String, pattern = "^[a-z_]+$")]
    pub code: &'static str,
    /// One sentence a person can act on.
    pub message: String,
}

/// `GET /healthz`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Health {
    /// Always `ok`: the process answers.
    #[schema(value_type = String, pattern = "^ok$")]
    pub status: &'static str,
}

/// `GET /readyz` when the gateway connection is up with the scopes clawmux needs.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Ready {
    /// `connected`.
    #[schema(value_type = String, pattern = "^connected$")]
    pub gateway: &'static str,
    /// The negotiated gateway protocol (3 or 4).
    pub protocol: Option<u32>,
    /// The gateway's release.
    pub server_version: Option<String>,
    /// Whether the gateway delivers events per session (protocol 4) or broadcasts them.
    pub session_scoped_events: bool,
    /// Scopes the gateway granted (protocol 3 reports none).
    pub scopes: Option<Vec<String>>,
    /// Whether per-session outbound (billing) headers are in use (null: not known yet).
    pub outbound_headers: Option<bool>,
}

/// `GET /readyz` when not ready.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct NotReady {
    /// `connected` or `disconnected`.
    #[schema(value_type = String, pattern = "^(connected|disconnected)$")]
    pub gateway: &'static str,
    /// Why not, in words.
    pub reason: String,
    /// The same as an error answer (`gateway_unavailable`).
    pub error: ErrorDetail,
}

/// Wires the routes (the API's, `/openapi.json` and the runs page under `/ui/`).
pub fn routes(cfg: &mut web::ServiceConfig) {
    // Another method on a known path is `405` with `Allow`, in the error shape.
    let res = |path: &str, allow: &'static str| {
        web::resource(path.to_owned()).default_service(web::to(move |req: HttpRequest| method_not_allowed(req, allow)))
    };
    cfg.service(res("/v1/runs", "GET, POST").route(web::post().to(runs::create_run)).route(web::get().to(runs::list_runs)))
        .service(res("/v1/runs/{run_id}", "GET").route(web::get().to(runs::get_run)))
        .service(res("/v1/runs/{run_id}/events", "GET").route(web::get().to(runs::run_events)))
        .service(res("/v1/runs/{run_id}/abort", "POST").route(web::post().to(runs::abort_run)))
        .service(res("/v1/runs/{run_id}/llm-calls", "GET").route(web::get().to(runs::llm_calls)))
        .service(res("/v1/agents", "GET").route(web::get().to(list_agents)))
        .service(res("/v1/admin/keys", "GET, POST").route(web::post().to(admin::create_key)).route(web::get().to(admin::list_keys)))
        .service(res("/v1/admin/keys/{key_id}/revoke", "POST").route(web::post().to(admin::revoke_key)))
        .service(
            res("/v1/admin/accounts/{account}/limits", "GET, PUT")
                .route(web::put().to(admin::set_limits))
                .route(web::get().to(admin::get_limits)),
        )
        .service(res("/healthz", "GET").route(web::get().to(healthz)))
        .service(res("/readyz", "GET").route(web::get().to(readyz)))
        .service(res("/metrics", "GET").route(web::get().to(metrics)))
        .service(res("/openapi.json", "GET").route(web::get().to(openapi::serve)));
    crate::ui::routes(cfg);
    cfg.default_service(web::to(not_found));
}

async fn not_found(req: HttpRequest) -> HttpResponse {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no such endpoint: {} {}", req.method(), req.path())).error_response()
}

async fn method_not_allowed(req: HttpRequest, allow: &'static str) -> HttpResponse {
    let message = format!("{} is not allowed on {} (allowed: {allow})", req.method(), req.path());
    ApiError { allow: Some(allow.to_owned()), ..ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", message) }
        .error_response()
}

/// Who is calling, and may they do `action`? The admin token (`CLAWMUX_API_TOKEN`) may do
/// everything; so may a loopback caller without credentials when no admin token is configured,
/// as long as no API key exists and no proxy relayed the request (`crate::tenants::loopback`). An
/// API key may do its actions on its accounts.
async fn authorize(req: &HttpRequest, state: &AppState, action: Action) -> Result<Principal, ApiError> {
    let given = req.headers().get(header::AUTHORIZATION).map(|v| v.to_str().ok().and_then(bearer_token));
    let principal = match given {
        Some(Some(token)) => state.tenants.principal(token, state.cfg.api_token.as_ref()).await.map_err(|e| match e {
            AuthError::Unavailable(m) => store_unavailable(format!("cannot check the credentials: {m}")),
            AuthError::Missing | AuthError::Invalid => ApiError::unauthorized("the bearer token is not valid (or was revoked)"),
        })?,
        Some(None) => return Err(ApiError::unauthorized("the Authorization header is not `Bearer <token>`")),
        None => match (&state.cfg.api_token, req.peer_addr()) {
            (None, Some(a)) if a.ip().is_loopback() => {
                if crate::tenants::loopback::relayed(req.headers()) {
                    return Err(ApiError::unauthorized(
                        "a request relayed by a proxy (it has forwarding headers) is not a loopback client: send an API key, or set CLAWMUX_API_TOKEN",
                    ));
                }
                match state.tenants.keys_seen.any(state.tenants.store.as_ref()).await {
                    Ok(false) => Principal::Admin,
                    Ok(true) => {
                        return Err(ApiError::unauthorized(
                            "API keys exist, so a loopback client without credentials is not the admin: send an API key, or set CLAWMUX_API_TOKEN for the admin",
                        ))
                    }
                    Err(e) => return Err(store_unavailable(format!("cannot check the credentials: {}", e.0))),
                }
            }
            (None, _) => {
                return Err(ApiError::unauthorized("no CLAWMUX_API_TOKEN is configured, so only loopback clients are served without an API key"))
            }
            (Some(_), _) => return Err(ApiError::unauthorized("missing `Authorization: Bearer <token>` header")),
        },
    };
    if !principal.can(action) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!("this API key may not {} (its actions: {})", action.as_str(), match &principal {
                Principal::Key(k) => k.actions.join(", "),
                Principal::Admin => String::new(),
            }),
        ));
    }
    Ok(principal)
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
pub(crate) async fn read_body(mut payload: web::Payload, limit: usize) -> Result<web::BytesMut, ApiError> {
    let mut body = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| ApiError::invalid(format!("cannot read the request body: {e}")))?;
        if body.len() + chunk.len() > limit {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                format!("the request body exceeds {limit} bytes (six times every field's limit together, CLAWMUX_MAX_MESSAGE_BYTES for the message, plus 16 KiB)"),
            ));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

pub(crate) fn wants_sse(req: &HttpRequest) -> bool {
    req.headers().get_all(header::ACCEPT).filter_map(|v| v.to_str().ok()).any(|v| v.contains("text/event-stream"))
}

pub(crate) fn query_wait_false(req: &HttpRequest) -> Result<bool, ApiError> {
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

pub(crate) fn new_trace() -> TraceParent {
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
/// The body's names, punctuation, enumerations, numbers and booleans, with room to spare.
const BODY_STRUCTURE: usize = 16 * 1024;

/// The largest `POST /v1/runs` body read for a message limit of `max_message` bytes: the limits
/// are on the decoded fields, and JSON may escape each of their bytes as six (`\u0061` is `a`;
/// any encoder's `\uXXXX` for non-ASCII text is up to three per byte). Each decoded field is then
/// held to its own limit.
pub(crate) fn run_body_limit(max_message: usize) -> usize {
    max_message.saturating_add(crate::request::MAX_OTHER_FIELDS_BYTES).saturating_mul(6).saturating_add(BODY_STRUCTURE)
}

/// `503 store_unavailable`. The store's own error (its address, user, driver message) goes to the
/// log, not to the caller: a tenant learns nothing of the operator's database.
pub(crate) fn store_unavailable(e: impl std::fmt::Display) -> ApiError {
    // Every request meets an outage: one line per 10 s, with how many were answered meanwhile.
    static GATE: crate::log_gate::LogGate = crate::log_gate::LogGate::new(std::time::Duration::from_secs(10));
    if let Some(also) = GATE.pass() {
        tracing::warn!(error = %e, also_answered_503_since_the_last_warning = also, "request answered 503: the run store is not available");
    }
    ApiError {
        retry_after: Some(2),
        ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", "the run store is not available right now; retry shortly")
    }
}

/// The agents runs may name.
#[utoipa::path(get, path = "/v1/agents", tag = "agents", security(("bearer" = [])),
    responses(
        (status = 200, description = "The agent registry", body = AgentRegistry),
        (status = 401, description = "No or a wrong bearer token", body = ErrorBody),
        (status = 403, description = "The API key lacks the `read` action", body = ErrorBody),
        (status = 503, description = "The credentials cannot be checked now (the store)", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    ))]
pub(crate) async fn list_agents(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Action::Read).await?;
    Ok(HttpResponse::Ok().json(&state.agents))
}

/// Liveness: `200` while the process answers.
#[utoipa::path(get, path = "/healthz", tag = "operations", security(()),
    responses((status = 200, description = "The process is up", body = Health)))]
pub(crate) async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(Health { status: "ok" })
}

/// Readiness: the gateway connection is up with the scopes clawmux needs.
#[utoipa::path(get, path = "/readyz", tag = "operations", security(()),
    responses(
        (status = 200, description = "Ready", body = Ready),
        (status = 503, description = "Not ready, and why", body = NotReady,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    ))]
pub(crate) async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    let s = match state.status.read() {
        Ok(s) => s.clone(),
        Err(p) => p.into_inner().clone(),
    };
    match s.ready() {
        Ok(()) => HttpResponse::Ok().json(Ready {
            gateway: "connected",
            protocol: s.protocol,
            server_version: s.server_version,
            session_scoped_events: s.session_scoped,
            scopes: s.scopes,
            outbound_headers: s.outbound_headers,
        }),
        Err(reason) => HttpResponse::ServiceUnavailable().insert_header((header::RETRY_AFTER, "2")).json(NotReady {
            gateway: if s.connected { "connected" } else { "disconnected" },
            error: ErrorDetail { code: "gateway_unavailable", message: reason.clone() },
            reason,
        }),
    }
}

/// Prometheus metrics (text format).
#[utoipa::path(get, path = "/metrics", tag = "operations", security(()),
    responses((status = 200, description = "Prometheus text exposition format 0.0.4", body = String, content_type = "text/plain")))]
pub(crate) async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    use prometheus::Encoder;
    let mut buf = Vec::new();
    let encoder = prometheus::TextEncoder::new();
    match encoder.encode(&state.metrics.gather(), &mut buf) {
        Ok(()) => HttpResponse::Ok().content_type(encoder.format_type()).body(buf),
        Err(e) => HttpResponse::InternalServerError().body(e.to_string()),
    }
}

#[cfg(test)]
mod body_limit_tests {
    /// A message of the limit's size fits the body read for it however JSON escapes it.
    #[test]
    fn a_maximal_message_fits_the_body_limit_in_its_most_escaped_form() {
        let max = 1 << 20;
        let escaped = format!(r#"{{"message":"{}","billingAccountId":"acct","runId":"r-1","stateKey":"s"}}"#, "\\u0001".repeat(max));
        assert!(escaped.len() <= super::run_body_limit(max), "{} > {}", escaped.len(), super::run_body_limit(max));
    }

    /// Every field at its limit, every byte escaped (`\u0061`): read whole, and valid. The limit
    /// once allowed only 64 KiB besides the message, and this body is ~220 KiB more.
    #[test]
    fn a_request_with_every_field_at_its_limit_in_its_most_escaped_form_fits() {
        use crate::request::{MAX_PR_BODY_BYTES, MAX_PR_TITLE_BYTES, MAX_URL_BYTES};
        let max = 1000;
        let esc = |n: usize| "\\u0061".repeat(n);
        let url = format!("https://h/{}", esc(MAX_URL_BYTES - "https://h/".len()));
        let body = format!(
            r#"{{"message":"{}","billingAccountId":"{}","runId":"{}","stateKey":"{}","agentId":"{}","model":"{}","graphId":"{}","timeoutSec":600,"onDisconnect":"continue","ifBusy":"enqueue","webhook":{{"url":"{url}"}},"branch":{{"branchName":"{}","workItemId":"{}","useStateKey":false,"baseRef":"{}","prTitle":"{}","prBody":"{}"}}}}"#,
            esc(max), esc(128), esc(128), esc(128), esc(128), esc(256), esc(128), esc(100), esc(100), esc(200), esc(MAX_PR_TITLE_BYTES), esc(MAX_PR_BODY_BYTES)
        );
        assert!(body.len() <= super::run_body_limit(max), "{} > {}", body.len(), super::run_body_limit(max));
        let request: crate::request::RunRequest = serde_json::from_str(&body).expect("decodes");
        let limits = crate::request::Limits { max_message_bytes: max, default_timeout_sec: 600, max_timeout_sec: 3600 };
        let valid = crate::request::validate(request, limits, || "new".into());
        assert!(valid.is_ok(), "{:?}", valid.err());
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
