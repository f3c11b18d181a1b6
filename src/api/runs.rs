//! `POST /v1/runs` and everything about one run or the history.

use super::sse::{sse_response, DisconnectGuard, SseEvent};
use super::{authorize, query_wait_false, read_body, store_unavailable, wants_sse, new_trace, ApiError, AppState, ErrorBody, ADMIT_TIMEOUT};
use crate::admission::{NewRun, Refused, Submitted};
use crate::audit::LlmCall;
use crate::request::RunRequest;
use crate::store::RunDoc;
use crate::request::{self, Limits, OnDisconnect, RequestError};
use crate::store::query;
use crate::store::RunView;
use crate::tenants::budget::Refusal;
use crate::tenants::keys::{Action, Principal};
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use clawmux_actors::messages::{AdmitError, Cancel};
use clawmux_actors::start_clock::StartStage;
use clawmux_actors::CancelReason;
use clawmux_protocol::TraceParent;
use serde::Serialize;

/// `GET /v1/runs`: a page of the history.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunList {
    /// Run documents, newest first.
    pub runs: Vec<RunDoc>,
    /// The next page's `cursor`; null on the last page.
    #[schema(pattern = "^r[0-9]+$")]
    pub next_cursor: Option<String>,
}

/// `POST /v1/runs/{runId}/abort`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AbortAnswer {
    /// The run.
    pub run_id: String,
    /// True when the run was live here and is being cancelled (it ends `aborted`); false when it
    /// had already finished.
    pub aborted: bool,
}

/// `GET /v1/runs/{runId}/llm-calls`: the run's LLM calls from the proxy's audit log.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct LlmCalls {
    /// The run.
    pub run_id: String,
    /// False when this clawmux has no LLM proxy (`CLAWMUX_LLM_UPSTREAM_URL`): nothing records
    /// calls, so the list is empty whatever the run did.
    pub proxy: bool,
    /// The calls in the order they ended (time, model, status, latency, tokens; never prompts,
    /// completions or keys).
    pub calls: Vec<LlmCall>,
    /// True when the run made more calls than are listed ([`MAX_LLM_CALLS`]).
    pub truncated: bool,
}

/// The most LLM calls `GET /v1/runs/{runId}/llm-calls` lists (a bounded answer).
pub const MAX_LLM_CALLS: usize = 1000;

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
        // The other run may be another tenant's: its id is not the caller's to learn.
        Refused::TraceInUse { .. } => ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            "the traceparent's trace id is in use: another live run uses this trace id; concurrent runs need distinct trace ids",
        ),
        Refused::Registry(e) => admit_error(e, run_id),
        e @ Refused::Overloaded => ApiError::unavailable(e.to_string()),
        e @ Refused::KeysOnTwoReplicas => ApiError { retry_after: Some(5), ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "keys_busy_apart", e.to_string()) },
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

/// Start an agent run.
#[utoipa::path(post, path = "/v1/runs", tag = "runs", security(("bearer" = [])),
    request_body(content = RunRequest, content_type = "application/json"),
    params(
        ("wait" = Option<String>, Query, pattern = "^(true|false|1|0|)$",
            description = "`false` or `0`: answer `202` with the document at once (JSON mode); `true`, `1` or empty: wait"),
        ("Idempotency-Key" = Option<String>, Header, nullable = false, min_length = 1, max_length = 256,
            description = "The same key with the same body returns the same run; a key is its billing account's own"),
        ("traceparent" = Option<String>, Header, nullable = false, pattern = "^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$",
            description = "W3C trace context the run continues (its trace id attributes the run's LLM calls)"),
    ),
    responses(
        (status = 200, description = "`Accept: text/event-stream`: the run's events; otherwise the run document at the end",
            content((RunDoc = "application/json"), (SseEvent = "text/event-stream"))),
        (status = 202, description = "`?wait=false`, or clawmux handed the run off while the caller waited", body = RunDoc),
        (status = 400, description = "Invalid request (the message names the field)", body = ErrorBody),
        (status = 401, description = "No or a wrong bearer token", body = ErrorBody),
        (status = 402, description = "The account's token budget is spent", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to the next budget period"))),
        (status = 403, description = "The API key may not run, or not for this account", body = ErrorBody),
        (status = 409, description = "Run id or trace id in use, or `ifBusy: reject` and the session is busy", body = ErrorBody),
        (status = 413, description = "The body or message is too large", body = ErrorBody),
        (status = 422, description = "Idempotency mismatch, unknown base ref, branch conflict", body = ErrorBody),
        (status = 429, description = "The account's rate limits", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
        (status = 503, description = "Gateway down, at capacity, shutting down, store or budgets unavailable, or (replicas) the run's session and branch keys busy on two replicas (`keys_busy_apart`)", body = ErrorBody),
    ))]
pub(super) async fn create_run(req: HttpRequest, payload: web::Payload, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let principal = authorize(&req, &state, Action::Run).await?;
    if *state.stopping.borrow() {
        return Err(admit_error(AdmitError::ShuttingDown, ""));
    }
    let wait_false = query_wait_false(&req)?;
    let limit = super::run_body_limit(state.cfg.max_message_bytes);
    let body = read_body(payload, limit).await?;
    // The `admit` stage of `clawmux_run_start_seconds` starts with the whole request in hand.
    let parsed = std::time::Instant::now();
    let limits = Limits {
        max_message_bytes: state.cfg.max_message_bytes,
        default_timeout_sec: state.cfg.run_timeout_sec,
        max_timeout_sec: state.cfg.max_run_timeout_sec,
    };
    let mut run = request::decode(&body)
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
    if run.request.graph_id.is_none() {
        run.graph_id = state.agents.default_graph_id.clone();
    }
    let Some(variant) = state.agents.variant(&run.graph_id) else {
        return Err(ApiError::invalid(format!("field `graphId`: unknown agent variant {:?} (see GET /v1/agents)", run.graph_id)));
    };
    if variant.mode == crate::agents::Mode::Ephemeral && run.branch_key.is_some() {
        return Err(ApiError::invalid("field `branch`: ephemeral variants have no network and no git relay; use a gateway variant for branch runs"));
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
        Submitted::Elsewhere(view) => {
            // Served from the store like any run another replica owns: its stream, `?wait=true`
            // and `onDisconnect: abort` (recorded in the store for the owner) as for a run of ours.
            tracing::info!(run_id = %view.run_id(), "run admitted for the replica that runs its session key");
            return respond(&req, &state, view, wait_false, abort_on_disconnect).await;
        }
    };
    state.run_start.with_label_values(&[StartStage::Admit.as_str()]).observe(parsed.elapsed().as_secs_f64());
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
    let guard = DisconnectGuard::new(state, &view, arm);
    if wants_sse(req) {
        return sse_response(req, state, view, 0, guard).await;
    }
    let log = match (&view, wait_false) {
        (RunView::Live(log), false) => log.clone(),
        (RunView::Stored(row), false) if row.finished_at_ms.is_none() => {
            let run_id = row.run_id.clone();
            return wait_elsewhere(state, &run_id, view, guard).await;
        }
        _ => {
            let mut g = guard;
            g.disarm();
            let status = if view.is_finished() { StatusCode::OK } else { StatusCode::ACCEPTED };
            return Ok(HttpResponse::build(status).json(view.doc()));
        }
    };
    wait_live(state, log, guard).await
}

/// Waits for the end of a run live here; dropping this future (the caller went away) drops the
/// guard, which cancels the run when the caller asked for that.
async fn wait_live(state: &web::Data<AppState>, log: std::sync::Arc<crate::store::RunLog>, mut guard: DisconnectGuard) -> Result<HttpResponse, ApiError> {
    let mut stopping = state.stopping.clone();
    tokio::select! {
        () = log.finished() => {}
        _ = stopping.wait_for(|s| *s) => {
            // Handed off: the run goes on in the next process; this caller gets its state now.
            guard.disarm();
            return Ok(HttpResponse::Accepted().json(log.doc()));
        }
    }
    guard.disarm();
    if log.is_lost() {
        // Stopped here without an end (another replica took it over, or the store is out of
        // reach): it goes on; the caller gets its state now, as after a handoff.
        return Ok(HttpResponse::Accepted().json(log.doc()));
    }
    Ok(HttpResponse::Ok().json(log.doc()))
}

/// Waits for the end of a run another replica owns (PostgreSQL store), woken by the store's
/// notification of its end, re-reading at least every `FALLBACK_POLL`. Without a shared store (no follower) the run cannot be live elsewhere: its
/// document is answered at once, as before.
async fn wait_elsewhere(state: &web::Data<AppState>, run_id: &str, mut view: RunView, mut guard: DisconnectGuard) -> Result<HttpResponse, ApiError> {
    // Subscribed before the reads below: an end stored in between wakes the wait. Only the end
    // wakes it (not each batch of the run's events: a read of the run per batch, per waiting
    // caller); a takeover by this replica is seen at the next look, within `FALLBACK_POLL`.
    let Some(mut notified) = state.store.follow_end(run_id) else {
        guard.disarm();
        return Ok(HttpResponse::Accepted().json(view.doc()));
    };
    // `view` was read before the subscription: read again at once, an end stored in between is
    // seen now rather than at the next poll.
    notified.mark_changed();
    let mut stopping = state.stopping.clone();
    loop {
        if view.is_finished() {
            guard.disarm();
            return Ok(HttpResponse::Ok().json(view.doc()));
        }
        if let RunView::Live(log) = &view {
            // Taken over by this replica meanwhile.
            let log = log.clone();
            return wait_live(state, log, guard).await;
        }
        tokio::select! {
            _ = stopping.wait_for(|s| *s) => {
                guard.disarm();
                return Ok(HttpResponse::Accepted().json(view.doc()));
            }
            r = notified.changed() => {
                if r.is_err() {
                    // No notifier (cannot happen while this receiver lives): poll, never spin.
                    tokio::time::sleep(crate::store::follow::FALLBACK_POLL).await;
                }
            }
            () = tokio::time::sleep(crate::store::follow::FALLBACK_POLL) => {}
        }
        notified.borrow_and_update();
        view = match state.store.view(run_id).await {
            Ok(Some(v)) => v,
            // Gone (its admission was undone) or the store is out of reach: not the caller's
            // disconnect, so nothing is cancelled; the caller learns why.
            Ok(None) => {
                guard.disarm();
                return Err(ApiError::not_found(run_id));
            }
            Err(e) => {
                guard.disarm();
                return Err(store_unavailable(e));
            }
        };
    }
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

/// A run's document.
#[utoipa::path(get, path = "/v1/runs/{run_id}", tag = "runs", security(("bearer" = [])),
    params(("run_id" = String, Path, description = "The run id")),
    responses(
        (status = 200, description = "The run document", body = RunDoc),
        (status = 401, description = "No or a wrong bearer token", body = ErrorBody),
        (status = 403, description = "The API key lacks the `read` action", body = ErrorBody),
        (status = 404, description = "No such run (or another tenant's)", body = ErrorBody),
        (status = 503, description = "The run store is not available", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    ))]
pub(super) async fn get_run(req: HttpRequest, path: web::Path<String>, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let principal = authorize(&req, &state, Action::Read).await?;
    Ok(HttpResponse::Ok().json(find(&state, &principal, &path).await?.doc()))
}

/// Run history, newest first.
#[utoipa::path(get, path = "/v1/runs", tag = "runs", security(("bearer" = [])),
    params(
        ("status" = Option<String>, Query, pattern = "^(queued|running|ok|error|aborted|timeout)(,(queued|running|ok|error|aborted|timeout))*$",
            description = "One status or a comma list"),
        ("billingAccountId" = Option<String>, Query, pattern = "^[A-Za-z0-9._:-]{1,128}$"),
        ("stateKey" = Option<String>, Query, pattern = "^[A-Za-z0-9._:-]{1,128}$"),
        ("since" = Option<String>, Query, format = DateTime, description = "Runs admitted at or after this RFC 3339 time"),
        ("limit" = Option<u32>, Query, minimum = 1, maximum = 500, description = "Page size (default 50)"),
        ("cursor" = Option<String>, Query, pattern = "^r[1-9][0-9]{0,17}$", description = "`nextCursor` of the previous page"),
    ),
    responses(
        (status = 200, description = "A page of run documents", body = RunList),
        (status = 400, description = "A bad, unknown or repeated parameter (the message names it)", body = ErrorBody),
        (status = 401, description = "No or a wrong bearer token", body = ErrorBody),
        (status = 403, description = "The API key lacks the `read` action", body = ErrorBody),
        (status = 503, description = "The run store is not available", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    ))]
pub(super) async fn list_runs(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let principal = authorize(&req, &state, Action::Read).await?;
    let mut q = query::parse(req.query_string()).map_err(|e| {
        let what = if e.param == "query" { "the query".to_owned() } else { format!("query parameter `{}`", e.param) };
        ApiError::invalid(format!("{what}: {}", e.message))
    })?;
    q.accounts = principal.account_scope();
    let (runs, last_seq) = state.store.list(&q).await.map_err(store_unavailable)?;
    let next = last_seq.map(query::cursor);
    Ok(HttpResponse::Ok().json(RunList { runs, next_cursor: next }))
}

/// Re-attach to a run's event stream: the events after `Last-Event-ID`, then live ones.
#[utoipa::path(get, path = "/v1/runs/{run_id}/events", tag = "runs", security(("bearer" = [])),
    params(
        ("run_id" = String, Path, description = "The run id"),
        ("Last-Event-ID" = Option<String>, Header, nullable = false, pattern = "^[0-9]{1,19}$", description = "The last event id the client saw"),
    ),
    responses(
        (status = 200, description = "Server-sent events: `accepted`, `status`, `text_delta`, `relay`, then `final` or `error`",
            body = SseEvent, content_type = "text/event-stream"),
        (status = 400, description = "`Last-Event-ID` is not an event id", body = ErrorBody),
        (status = 401, description = "No or a wrong bearer token", body = ErrorBody),
        (status = 403, description = "The API key lacks the `read` action", body = ErrorBody),
        (status = 404, description = "No such run (or another tenant's)", body = ErrorBody),
        (status = 503, description = "Shutting down (re-attach to the next instance), or the store is not available", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    ))]
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
    let guard = DisconnectGuard::new(&state, &view, false);
    sse_response(&req, &state, view, after, guard).await
}

/// Abort a run.
#[utoipa::path(post, path = "/v1/runs/{run_id}/abort", tag = "runs", security(("bearer" = [])),
    params(("run_id" = String, Path, description = "The run id")),
    responses(
        (status = 202, description = "Being cancelled (`aborted: true`), or it had finished", body = AbortAnswer),
        (status = 401, description = "No or a wrong bearer token", body = ErrorBody),
        (status = 403, description = "The API key lacks the `abort` action", body = ErrorBody),
        (status = 404, description = "No such run (or another tenant's)", body = ErrorBody),
        (status = 503, description = "Overloaded, the store is not available, or (one process) the run is being handed over to the next start", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    ))]
pub(super) async fn abort_run(req: HttpRequest, path: web::Path<String>, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let principal = authorize(&req, &state, Action::Abort).await?;
    let view = find(&state, &principal, &path).await?;
    let run_id = view.run_id().to_owned();
    if view.is_finished() {
        return Ok(HttpResponse::Accepted().json(AbortAnswer { run_id, aborted: false }));
    }
    let found = state
        .registry
        .send(Cancel { run_id: run_id.clone(), reason: CancelReason::Api })
        .timeout(ADMIT_TIMEOUT)
        .await
        .map_err(|_| ApiError::unavailable("clawmux is overloaded; retry the abort shortly"))?;
    // Not found because it ended (its end on its way to the store, its actor gone): finished.
    if found || view.is_ending() {
        return Ok(HttpResponse::Accepted().json(AbortAnswer { run_id, aborted: found }));
    }
    // Unfinished, and no session actor here: live on another replica, or its log is here but
    // its actor is not (a handoff draining this process; a takeover still handing its runs to
    // the registry). Either way whoever continues it must cancel it: on a shared store the abort
    // is recorded for them (the owner's next lease renewal carries it out).
    if matches!(view, RunView::Stored(_)) || state.store.shared() {
        let recorded = state.store.request_abort(&run_id, crate::store::AbortReason::Api).await.map_err(store_unavailable)?;
        return Ok(HttpResponse::Accepted().json(AbortAnswer { run_id, aborted: recorded }));
    }
    // One process, being stopped with its runs handed to the next start: `aborted: false` would
    // say the run had finished; the caller retries against the next process.
    Err(ApiError::unavailable("clawmux is handing this run over to its next start; retry the abort shortly"))
}

/// The run's LLM calls, from the LLM proxy's audit log (a store shared by replicas: every replica's
/// records).
#[utoipa::path(get, path = "/v1/runs/{run_id}/llm-calls", tag = "runs", security(("bearer" = [])),
    params(("run_id" = String, Path, description = "The run id")),
    responses(
        (status = 200, description = "The calls (time, model, status, latency, tokens)", body = LlmCalls),
        (status = 401, description = "No or a wrong bearer token", body = ErrorBody),
        (status = 403, description = "The API key lacks the `read` action", body = ErrorBody),
        (status = 404, description = "No such run (or another tenant's)", body = ErrorBody),
        (status = 503, description = "The run store or the audit log cannot be read now", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    ))]
pub(super) async fn llm_calls(req: HttpRequest, path: web::Path<String>, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    // Scoped exactly like `GET /v1/runs/{id}`: another tenant's run is a 404.
    let principal = authorize(&req, &state, Action::Read).await?;
    let view = find(&state, &principal, &path).await?;
    let run_id = view.run_id().to_owned();
    if state.attributions.is_none() {
        return Ok(HttpResponse::Ok().json(LlmCalls { run_id, proxy: false, calls: Vec::new(), truncated: false }));
    }
    // A shared store has every replica's records: the calls any replica's proxy forwarded.
    if let Some((calls, truncated)) = state.store.llm_calls(&run_id, MAX_LLM_CALLS).await.map_err(audit_unavailable)? {
        return Ok(HttpResponse::Ok().json(LlmCalls { run_id, proxy: true, calls, truncated }));
    }
    let doc = view.doc();
    let run = crate::audit::RunOfCalls { run_id: run_id.clone(), billing_account_id: doc.billing_account_id.clone(), since_ms: created_ms(&doc.created_at) };
    let dir = state.cfg.audit_dir.clone();
    let (calls, truncated) = web::block(move || crate::audit::calls_of_run(&dir, &run, MAX_LLM_CALLS))
        .await
        .map_err(audit_unavailable)?
        .map_err(audit_unavailable)?;
    Ok(HttpResponse::Ok().json(LlmCalls { run_id, proxy: true, calls, truncated }))
}

/// The cause goes to the log only: it names the operator's audit file or database.
fn audit_unavailable(e: impl std::fmt::Display) -> ApiError {
    tracing::warn!(error = %e, "cannot read the LLM call audit log for a request");
    ApiError { retry_after: Some(2), ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "audit_unavailable", "cannot read the LLM call audit log right now; retry shortly") }
}

/// A document's `createdAt` in ms (0 when unreadable: then every audit file is read).
fn created_ms(rfc3339: &str) -> i64 {
    time::OffsetDateTime::parse(rfc3339, &time::format_description::well_known::Rfc3339)
        .map(|t| i64::try_from(t.unix_timestamp_nanos() / 1_000_000).unwrap_or(0))
        .unwrap_or(0)
}
