//! `POST /v1/runs` and everything about one run or the history.

use super::sse::{sse_response, DisconnectGuard};
use super::{authorize, query_wait_false, read_body, store_unavailable, wants_sse, new_trace, ApiError, AppState, ADMIT_TIMEOUT, BODY_OVERHEAD};
use crate::admission::{NewRun, Refused, Submitted};
use crate::request::{self, Limits, OnDisconnect, RequestError};
use crate::store::query;
use crate::store::RunView;
use crate::tenants::budget::Refusal;
use crate::tenants::keys::{Action, Principal};
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use clawmux_actors::messages::{AdmitError, Cancel};
use clawmux_actors::CancelReason;
use clawmux_protocol::TraceParent;

/// The HTTP answer to a refused admission.
fn refused(e: Refused, run_id: &str) -> ApiError {
    match e {
        Refused::Invalid(m) => ApiError::invalid(m),
        Refused::Store(e) => store_unavailable(e),
        e @ Refused::RunIdConflict(_) => ApiError::new(StatusCode::CONFLICT, "conflict", e.to_string()),
        e @ Refused::IdempotencyMismatch => ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "idempotency_mismatch", e.to_string()),
        Refused::Limit(Refusal::RateLimited { message, retry_after_sec }) => {
            ApiError { retry_after: Some(retry_after_sec), ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limited", message) }
        }
        Refused::Limit(Refusal::BudgetExceeded { message, retry_after_sec }) => {
            ApiError { retry_after: Some(retry_after_sec), ..ApiError::new(StatusCode::PAYMENT_REQUIRED, "budget_exceeded", message) }
        }
        Refused::Limit(Refusal::Unmetered { message }) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "budget_unavailable", message),
        e @ Refused::TraceInUse { .. } => ApiError::new(StatusCode::CONFLICT, "conflict", e.to_string()),
        Refused::Registry(e) => admit_error(e, run_id),
        e @ Refused::Overloaded => ApiError::unavailable(e.to_string()),
        e @ Refused::UnknownBaseRef(_) => ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "unknown_base_ref", e.to_string()),
        e @ Refused::BranchConflict { .. } => ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "branch_conflict", e.to_string()),
    }
}

fn admit_error(e: AdmitError, run_id: &str) -> ApiError {
    match e {
        AdmitError::GatewayDown(reason) => ApiError::unavailable(format!("the gateway is not available: {reason}")),
        e @ AdmitError::AtCapacity(_) => ApiError::unavailable(e.to_string()),
        AdmitError::ShuttingDown => ApiError::unavailable("clawmux is shutting down; retry against the next instance"),
        AdmitError::Duplicate => ApiError::new(StatusCode::CONFLICT, "conflict", format!("run {run_id:?} is already in flight")),
        AdmitError::SessionBusy => ApiError::new(
            StatusCode::CONFLICT,
            "session_busy",
            "another run of this session (stateKey) is in flight and the request asked for ifBusy: reject",
        ),
    }
}

pub(super) async fn create_run(req: HttpRequest, payload: web::Payload, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let principal = authorize(&req, &state, Action::Run).await?;
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
    if !principal.sees(&run.request.billing_account_id) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!("this API key may not use billing account {:?}", run.request.billing_account_id),
        ));
    }
    let webhook_url = match (&run.request.webhook, &principal) {
        (Some(w), _) => Some(w.url.clone()),
        (None, Principal::Key(k)) => k.webhook_url.clone(),
        (None, Principal::Admin) => None,
    };
    if let Some(url) = &webhook_url {
        state.tenants.allow.check(url).map_err(|m| ApiError::invalid(format!("field `webhook.url`: {m}")))?;
        if principal == Principal::Admin && state.tenants.admin_webhook_secret.is_none() {
            return Err(ApiError::invalid(
                "field `webhook`: the admin token's webhooks are signed with CLAWMUX_WEBHOOK_SECRET, which is not set (or use an API key: each has its own secret)",
            ));
        }
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
    let abort_on_disconnect = run.on_disconnect == OnDisconnect::Abort;
    let run_id = run.run_id.clone();
    let new = NewRun {
        run,
        traceparent,
        idempotency_key,
        key_id: principal.key_id().map(str::to_owned),
        webhook_url,
        default_base_ref: state.cfg.relay_base_ref.clone(),
    };
    let (log, admitted) = match state.admission.submit(new).await.map_err(|e| refused(e, &run_id))? {
        Submitted::New { log, admitted } => (log, admitted),
        Submitted::Existing(view) => return respond(&req, &state, view, wait_false, false).await,
    };
    tracing::info!(run_id = %log.run_id, session_key = %log.doc().session_key, ?admitted, "run admitted");
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

/// The run, if `principal` may see it: a run of another tenant's account is `404`, exactly like
/// a run that does not exist (its existence is not revealed).
async fn find(state: &AppState, principal: &Principal, run_id: &str) -> Result<RunView, ApiError> {
    let view = state.store.view(run_id).await.map_err(store_unavailable)?.ok_or_else(|| ApiError::not_found(run_id))?;
    if !principal.sees(&view.billing_account_id()) {
        return Err(ApiError::not_found(run_id));
    }
    Ok(view)
}

pub(super) async fn get_run(req: HttpRequest, path: web::Path<String>, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let principal = authorize(&req, &state, Action::Read).await?;
    Ok(HttpResponse::Ok().json(find(&state, &principal, &path).await?.doc()))
}

pub(super) async fn list_runs(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let principal = authorize(&req, &state, Action::Read).await?;
    let mut q = query::parse(req.query_string()).map_err(|e| {
        let what = if e.param == "query" { "the query".to_owned() } else { format!("query parameter `{}`", e.param) };
        ApiError::invalid(format!("{what}: {}", e.message))
    })?;
    q.accounts = principal.account_scope();
    let (runs, last_seq) = state.store.list(&q).await.map_err(store_unavailable)?;
    let next = last_seq.map(query::cursor);
    Ok(HttpResponse::Ok().json(serde_json::json!({"runs": runs, "nextCursor": next})))
}

pub(super) async fn run_events(req: HttpRequest, path: web::Path<String>, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let principal = authorize(&req, &state, Action::Read).await?;
    let view = find(&state, &principal, &path).await?;
    let after = match req.headers().get("last-event-id") {
        None => 0,
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .ok_or_else(|| ApiError::invalid("header `Last-Event-ID`: must be an event id (a non-negative integer)"))?,
    };
    if *state.stopping.borrow() && !view.is_finished() {
        // Its stream would end at once: the client would spin on this process until it exits.
        return Err(ApiError::unavailable("clawmux is shutting down; re-attach to the next instance"));
    }
    // Re-attaching never cancels on disconnect: only the caller that started the run decides that.
    let guard = DisconnectGuard { run_id: view.run_id().to_owned(), view: view.clone(), registry: state.registry.clone(), armed: false };
    sse_response(&req, &state, view, after, guard).await
}

pub(super) async fn abort_run(req: HttpRequest, path: web::Path<String>, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let principal = authorize(&req, &state, Action::Abort).await?;
    let view = find(&state, &principal, &path).await?;
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
