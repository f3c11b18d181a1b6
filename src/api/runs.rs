//! `POST /v1/runs` and everything about one run or the history.

use super::sse::{sse_response, DisconnectGuard};
use super::{authorize, query_wait_false, read_body, store_unavailable, wants_sse, new_trace, ApiError, AppState, ADMIT_TIMEOUT, BODY_OVERHEAD};
use crate::request::{self, Limits, OnDisconnect, RequestError};
use crate::store::query;
use crate::store::{Insert, RunLog, RunRow, RunView, SpecRecord};
use crate::tenants::keys::{Action, Principal};
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use crate::tenants::budget::Refusal;
use clawmux_actors::messages::{AdmitError, Cancel, IfBusy, Submit};
use clawmux_actors::{CancelReason, RunSink, RunSpec};
use clawmux_protocol::session_key::Conversation;
use clawmux_protocol::{SessionKey, TraceParent};
use std::sync::Arc;
use std::time::Duration;

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

fn refusal_error(r: Refusal) -> ApiError {
    match r {
        Refusal::RateLimited { message, retry_after_sec } => {
            ApiError { retry_after: Some(retry_after_sec), ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limited", message) }
        }
        Refusal::BudgetExceeded { message, retry_after_sec } => {
            ApiError { retry_after: Some(retry_after_sec), ..ApiError::new(StatusCode::PAYMENT_REQUIRED, "budget_exceeded", message) }
        }
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
        key_id: principal.key_id().map(str::to_owned),
        webhook_url,
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
    if let (Some(plan), Some(workspace)) = (&spec.branch, &state.workspace) {
        if let Err(e) = check_branch(workspace.as_ref(), plan, branch_field(&run.request)).await {
            state.store.forget(&run.run_id).await;
            return Err(e);
        }
    }
    // Limits are counted exactly under a burst: the account's live runs and admissions of the
    // last minute are checked and counted under one lock.
    let account = run.request.billing_account_id.clone();
    let budgets = &state.tenants.budgets;
    match budgets.admit(&account, &run.run_id).await {
        Ok(Ok(())) => {}
        Ok(Err(refusal)) => {
            state.store.forget(&run.run_id).await;
            return Err(refusal_error(refusal));
        }
        Err(e) => {
            state.store.forget(&run.run_id).await;
            return Err(store_unavailable(e));
        }
    }
    let if_busy = match run.request.if_busy {
        None | Some(request::IfBusy::Enqueue) => IfBusy::Enqueue,
        Some(request::IfBusy::Reject) => IfBusy::Reject,
        Some(request::IfBusy::Interrupt) => IfBusy::Interrupt,
    };
    let admitted = match admit(&state, &log, spec, None, if_busy).await {
        Ok(a) => a,
        Err(e) => {
            budgets.release(&account, &run.run_id);
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

/// How long `POST` waits for the relay's checks of a branch run before admitting it unchecked.
const BRANCH_CHECK_TIMEOUT: Duration = Duration::from_secs(20);

/// The request field that named the branch key.
fn branch_field(r: &request::RunRequest) -> &'static str {
    match &r.branch {
        Some(b) if b.branch_name.is_some() => "branch.branchName",
        Some(b) if b.work_item_id.is_some() => "branch.workItemId",
        _ => "stateKey",
    }
}

/// A caller's mistake the relay can see before the run (`422`); a check that cannot be made
/// (the engine, the remote) admits the run, whose own steps then report what fails.
async fn check_branch(workspace: &dyn clawmux_actors::branch::Workspace, plan: &clawmux_actors::branch::BranchPlan, key_field: &str) -> Result<(), ApiError> {
    use clawmux_actors::branch::WorkspaceError as W;
    match tokio::time::timeout(BRANCH_CHECK_TIMEOUT, workspace.check(plan)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(W::UnknownBaseRef(m))) => Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "unknown_base_ref", format!("field `branch.baseRef`: {m}"))),
        Ok(Err(W::KeyConflict(m))) => Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "branch_conflict", format!("field `{key_field}`: {m}"))),
        Ok(Err(W::Failed(m))) => {
            tracing::warn!(branch = %plan.branch(), error = %m, "cannot check the branch before the run; admitting it");
            Ok(())
        }
        Err(_) => {
            tracing::warn!(branch = %plan.branch(), "the branch checks took longer than {BRANCH_CHECK_TIMEOUT:?}; admitting the run");
            Ok(())
        }
    }
}

/// Makes a stored run attributable and hands it to the registry (new runs and, with `resume`,
/// runs a restart continues).
pub async fn admit(
    state: &AppState,
    log: &Arc<RunLog>,
    spec: RunSpec,
    resume: Option<clawmux_actors::Resume>,
    if_busy: IfBusy,
) -> Result<clawmux_actors::Admitted, ApiError> {
    let trace_id = spec.traceparent.trace_id().to_owned();
    let budgets = state.tenants.budgets.clone();
    let account = spec.billing_account_id.clone();
    if resume.is_some() {
        // A continued run counts as live for its account's limits, without the checks.
        budgets.resume(&account, &spec.run_id);
    }
    {
        let (budgets, account, run_id) = (budgets.clone(), account.clone(), spec.run_id.clone());
        log.on_end(Box::new(move || budgets.release(&account, &run_id)));
    }
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
        let (b, a) = (budgets.clone(), account.clone());
        log.set_billing(billing, registry.clone(), Some(Box::new(move |tokens| b.record(&a, tokens))));
    }
    let run_id = spec.run_id.clone();
    let registry = state.registry.clone();
    let cancel_id = run_id.clone();
    log.on_failure(Box::new(move || registry.do_send(Cancel { run_id: cancel_id.clone(), reason: CancelReason::Api })));
    let sink: Arc<dyn RunSink> = log.clone();
    let admitted = state.registry.send(Submit { spec, sink, resume, if_busy }).timeout(ADMIT_TIMEOUT).await;
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
