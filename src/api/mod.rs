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

mod admin;
mod runs;
mod sse;

use crate::agents::AgentRegistry;
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
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, code, message: message.into(), retry_after: None }
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
        r.json(serde_json::json!({"error": {"code": self.code, "message": self.message}}))
    }
}

/// Wires the routes.
pub fn routes(cfg: &mut web::ServiceConfig) {
    let res = |path: &str| web::resource(path.to_owned()).default_service(web::to(method_not_allowed));
    cfg.service(res("/v1/runs").route(web::post().to(runs::create_run)).route(web::get().to(runs::list_runs)))
        .service(res("/v1/runs/{run_id}").route(web::get().to(runs::get_run)))
        .service(res("/v1/runs/{run_id}/events").route(web::get().to(runs::run_events)))
        .service(res("/v1/runs/{run_id}/abort").route(web::post().to(runs::abort_run)))
        .service(res("/v1/agents").route(web::get().to(list_agents)))
        .service(res("/v1/admin/keys").route(web::post().to(admin::create_key)).route(web::get().to(admin::list_keys)))
        .service(res("/v1/admin/keys/{key_id}/revoke").route(web::post().to(admin::revoke_key)))
        .service(res("/v1/admin/accounts/{account}/limits").route(web::put().to(admin::set_limits)).route(web::get().to(admin::get_limits)))
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

/// Who is calling, and may they do `action`? The admin token (`CLAWMUX_API_TOKEN`) may do
/// everything; so may a loopback caller without credentials when no admin token is configured. An
/// API key may do its actions on its accounts.
async fn authorize(req: &HttpRequest, state: &AppState, action: Action) -> Result<Principal, ApiError> {
    let given = req.headers().get(header::AUTHORIZATION).map(|v| v.to_str().ok().and_then(bearer_token));
    let principal = match given {
        Some(Some(token)) => state.tenants.principal(token, state.cfg.api_token.as_ref()).await.map_err(|e| match e {
            AuthError::Unavailable(m) => ApiError::unavailable(format!("cannot check the credentials: {m}")),
            AuthError::Missing | AuthError::Invalid => {
                ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "the bearer token is not valid (or was revoked)")
            }
        })?,
        Some(None) => return Err(ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "the Authorization header is not `Bearer <token>`")),
        None => match (&state.cfg.api_token, req.peer_addr()) {
            (None, Some(a)) if a.ip().is_loopback() => Principal::Admin,
            (None, _) => {
                return Err(ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "unauthorized",
                    "no CLAWMUX_API_TOKEN is configured, so only loopback clients are served without an API key",
                ))
            }
            (Some(_), _) => {
                return Err(ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "missing `Authorization: Bearer <token>` header"))
            }
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
                format!("the request body exceeds {limit} bytes (CLAWMUX_MAX_MESSAGE_BYTES plus JSON overhead)"),
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
/// JSON overhead allowed around a maximal `message`.
const BODY_OVERHEAD: usize = 64 * 1024;

pub(crate) fn store_unavailable(e: impl std::fmt::Display) -> ApiError {
    ApiError { retry_after: Some(2), ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", format!("the run store is not available: {e}")) }
}

async fn list_agents(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Action::Read).await?;
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
