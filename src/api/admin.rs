//! `/v1/admin/*`: API keys and per-account limits (the `admin` action; the admin token has it).
//! The CLI (`clawmux keys …`, `clawmux limits …`) does the same on the store directly.

use super::{authorize, read_body, store_unavailable, ApiError, AppState};
use crate::store::now_ms;
use crate::store::tenants::Limits;
use crate::tenants::keys::{self, Action};
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use serde::Deserialize;

/// `POST /v1/admin/keys` body.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NewKey {
    name: String,
    accounts: Vec<String>,
    actions: Vec<String>,
    #[serde(default)]
    webhook_url: Option<String>,
}

fn decode<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        ApiError::invalid(if path.is_empty() || path == "." { format!("invalid JSON body: {}", e.inner()) } else { format!("field `{path}`: {}", e.inner()) })
    })
}

pub(super) async fn create_key(req: HttpRequest, payload: web::Payload, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Action::Admin).await?;
    let body = read_body(payload, 64 * 1024).await?;
    let k: NewKey = decode(&body)?;
    if k.name.is_empty() || k.name.len() > 128 || k.name.chars().any(char::is_control) {
        return Err(ApiError::invalid("field `name`: must be 1 to 128 printable characters"));
    }
    keys::validate_accounts(&k.accounts).map_err(|m| ApiError::invalid(format!("field `accounts`: {m}")))?;
    let actions: Vec<Action> = k
        .actions
        .iter()
        .map(|a| Action::parse(a).ok_or_else(|| ApiError::invalid(format!("field `actions`: {a:?} is not one of run, read, abort, admin"))))
        .collect::<Result<_, _>>()?;
    if actions.is_empty() {
        return Err(ApiError::invalid("field `actions`: a key needs at least one action"));
    }
    if let Some(url) = &k.webhook_url {
        state.tenants.allow.check(url).map_err(|m| ApiError::invalid(format!("field `webhookUrl`: {m}")))?;
    }
    let (record, token) = keys::generate(&k.name, k.accounts, actions, k.webhook_url, now_ms());
    state.tenants.store.create_key(&record).await.map_err(store_unavailable)?;
    tracing::info!(key_id = %record.id, name = %record.name, "API key created");
    // The only time the secrets are shown.
    Ok(HttpResponse::Created().json(serde_json::json!({
        "key": token, "id": record.id, "name": record.name, "accounts": record.accounts, "actions": record.actions,
        "webhookUrl": record.webhook_url, "webhookSecret": record.webhook_secret,
    })))
}

pub(super) async fn list_keys(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Action::Admin).await?;
    let keys = state.tenants.store.keys().await.map_err(store_unavailable)?;
    Ok(HttpResponse::Ok().json(serde_json::json!({"keys": keys})))
}

pub(super) async fn revoke_key(req: HttpRequest, path: web::Path<String>, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Action::Admin).await?;
    if !state.tenants.store.revoke_key(&path, now_ms()).await.map_err(store_unavailable)? {
        return Err(ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no API key with id {:?}", path.as_str())));
    }
    tracing::info!(key_id = %path, "API key revoked");
    Ok(HttpResponse::Ok().json(serde_json::json!({"id": path.as_str(), "revoked": true})))
}

fn account_of(path: &str) -> Result<String, ApiError> {
    if crate::request::is_valid_id(path) {
        Ok(path.to_owned())
    } else {
        Err(ApiError::invalid("path: the billing account must match [A-Za-z0-9._:-]{1,128}"))
    }
}

pub(super) async fn set_limits(req: HttpRequest, path: web::Path<String>, payload: web::Payload, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Action::Admin).await?;
    let account = account_of(&path)?;
    let body = read_body(payload, 64 * 1024).await?;
    let limits: Limits = decode(&body)?;
    limits.validate().map_err(ApiError::invalid)?;
    state.tenants.budgets.set_limits(&account, limits).await.map_err(store_unavailable)?;
    get_limits_of(&state, &account).await
}

pub(super) async fn get_limits(req: HttpRequest, path: web::Path<String>, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Action::Admin).await?;
    let account = account_of(&path)?;
    get_limits_of(&state, &account).await
}

async fn get_limits_of(state: &AppState, account: &str) -> Result<HttpResponse, ApiError> {
    let limits = state.tenants.budgets.limits(account);
    let spent = state.tenants.budgets.spent(account).await.map_err(store_unavailable)?;
    Ok(HttpResponse::Ok().json(serde_json::json!({
        "billingAccountId": account,
        "limits": limits,
        "spentTokens": spent.map(|(s, _)| s),
        "periodStart": spent.map(|(_, (start, _))| start),
        "periodEnd": spent.map(|(_, (_, end))| end),
    })))
}
