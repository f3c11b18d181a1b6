//! `/v1/admin/*`: API keys and per-account limits (the `admin` action; the admin token has it).
//! The CLI (`clawmux keys …`, `clawmux limits …`) does the same on the store directly.

use super::{authorize, read_body, store_unavailable, ApiError, AppState, ErrorBody};
use crate::store::now_ms;
use crate::store::tenants::{KeyRecord, Limits};
use crate::tenants::keys::{self, Action};
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use serde::{Deserialize, Serialize};

/// `POST /v1/admin/keys` body.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NewKey {
    /// A name for people (1 to 128 printable characters).
    #[schema(pattern = "^[^\\u0000-\\u001f\\u007f-\\u009f]{1,128}$")]
    name: String,
    /// Billing accounts the key may use and see; `["*"]` for all.
    #[schema(min_items = 1, inline)]
    accounts: Vec<AccountName>,
    /// `run`, `read`, `abort`, `admin` (at least one).
    #[schema(min_items = 1, inline)]
    actions: Vec<ActionName>,
    /// Default webhook URL of the key's runs (within `CLAWMUX_WEBHOOK_ALLOW`).
    #[serde(default)]
    webhook_url: Option<String>,
}

/// A billing account a key is given, or `*` (all).
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(transparent)]
#[schema(value_type = String, pattern = "^([A-Za-z0-9._:-]{1,128}|\\*)$")]
pub struct AccountName(String);

/// An action an API key may be given.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(transparent)]
#[schema(value_type = String, pattern = "^(run|read|abort|admin)$")]
pub struct ActionName(String);

/// `201` of `POST /v1/admin/keys`: the only answer that shows the secrets.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct CreatedKey {
    /// The bearer token, `cmx_<id>_<secret>`.
    pub key: String,
    /// Public id.
    pub id: String,
    /// A name for people.
    pub name: String,
    /// Billing accounts.
    pub accounts: Vec<String>,
    /// Actions.
    pub actions: Vec<String>,
    /// Default webhook URL.
    pub webhook_url: Option<String>,
    /// Signs the key's webhook deliveries.
    pub webhook_secret: String,
}

/// `GET /v1/admin/keys` (no secrets).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct KeyList {
    /// Every key, revoked ones included.
    pub keys: Vec<KeyRecord>,
}

/// `POST /v1/admin/keys/{keyId}/revoke`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Revoked {
    /// The key's id.
    pub id: String,
    /// Always true.
    pub revoked: bool,
}

/// `GET`/`PUT /v1/admin/accounts/{account}/limits`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AccountLimits {
    /// The account.
    pub billing_account_id: String,
    /// Its limits (absent fields: unlimited).
    pub limits: Limits,
    /// Tokens spent this period (null without a token budget).
    pub spent_tokens: Option<u64>,
    /// This period's start (ms since the epoch).
    pub period_start: Option<i64>,
    /// This period's end (ms since the epoch).
    pub period_end: Option<i64>,
}

/// One JSON value and nothing after it (as `POST /v1/runs` reads its body).
fn decode<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        ApiError::invalid(if path.is_empty() || path == "." { format!("invalid JSON body: {}", e.inner()) } else { format!("field `{path}`: {}", e.inner()) })
    })?;
    de.end().map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))?;
    Ok(value)
}

/// Create an API key.
#[utoipa::path(post, path = "/v1/admin/keys", tag = "admin", security(("bearer" = [])),
    request_body(content = NewKey, content_type = "application/json"),
    responses(
        (status = 201, description = "Created; the key and webhook secret are shown this once", body = CreatedKey),
        (status = 400, description = "Invalid request (the message names the field)", body = ErrorBody),
        (status = 401, description = "No or a wrong bearer token", body = ErrorBody),
        (status = 403, description = "Not the `admin` action, or a key wider than the caller's (an account it does not have, `*`, an action it lacks)", body = ErrorBody),
        (status = 413, description = "The body is too large", body = ErrorBody),
        (status = 503, description = "The store is not available", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    ))]
pub(super) async fn create_key(req: HttpRequest, payload: web::Payload, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let caller = authorize(&req, &state, Action::Admin).await?;
    let body = read_body(payload, 64 * 1024).await?;
    let k: NewKey = decode(&body)?;
    if k.name.is_empty() || k.name.len() > 128 || k.name.chars().any(char::is_control) {
        return Err(ApiError::invalid("field `name`: must be 1 to 128 printable characters"));
    }
    let accounts: Vec<String> = k.accounts.into_iter().map(|AccountName(a)| a).collect();
    keys::validate_accounts(&accounts).map_err(|m| ApiError::invalid(format!("field `accounts`: {m}")))?;
    let actions: Vec<Action> = k
        .actions
        .iter()
        .map(|ActionName(a)| Action::parse(a).ok_or_else(|| ApiError::invalid(format!("field `actions`: {a:?} is not one of run, read, abort, admin"))))
        .collect::<Result<_, _>>()?;
    if actions.is_empty() {
        return Err(ApiError::invalid("field `actions`: a key needs at least one action"));
    }
    if !caller.may_grant(&accounts, &actions) {
        return Err(beyond_scope("this key may only create keys for its own billing accounts, with actions it has itself"));
    }
    if let Some(url) = &k.webhook_url {
        if url.len() > crate::request::MAX_URL_BYTES {
            return Err(ApiError::invalid(format!("field `webhookUrl`: must be at most {} bytes", crate::request::MAX_URL_BYTES)));
        }
        state.tenants.allow.check(url).map_err(|m| ApiError::invalid(format!("field `webhookUrl`: {m}")))?;
    }
    let (mut record, token) = keys::generate(&k.name, accounts, actions, k.webhook_url, now_ms());
    // Made by a key: it goes when that key is revoked.
    if let crate::tenants::keys::Principal::Key(creator) = &caller {
        record.created_by = Some(creator.id.clone());
    }
    state.tenants.store.create_key(&record).await.map_err(store_unavailable)?;
    // From now on a loopback caller without credentials is no longer the admin.
    state.tenants.keys_seen.saw();
    tracing::info!(key_id = %record.id, name = %record.name, "API key created");
    // The only time the secrets are shown.
    Ok(HttpResponse::Created().json(CreatedKey {
        key: token,
        id: record.id,
        name: record.name,
        accounts: record.accounts,
        actions: record.actions,
        webhook_url: record.webhook_url,
        webhook_secret: record.webhook_secret,
    }))
}

/// List API keys (no secrets).
#[utoipa::path(get, path = "/v1/admin/keys", tag = "admin", security(("bearer" = [])),
    responses(
        (status = 200, description = "Every key (for a key with `admin` scoped to accounts: the keys of those accounts)", body = KeyList),
        (status = 401, description = "No or a wrong bearer token", body = ErrorBody),
        (status = 403, description = "Not the `admin` action", body = ErrorBody),
        (status = 503, description = "The store is not available", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    ))]
pub(super) async fn list_keys(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let caller = authorize(&req, &state, Action::Admin).await?;
    let mut keys = state.tenants.store.keys().await.map_err(store_unavailable)?;
    keys.retain(|k| caller.governs(&k.accounts));
    Ok(HttpResponse::Ok().json(KeyList { keys }))
}

/// Revoke an API key.
#[utoipa::path(post, path = "/v1/admin/keys/{key_id}/revoke", tag = "admin", security(("bearer" = [])),
    params(("key_id" = String, Path, description = "The key's public id")),
    responses(
        (status = 200, description = "Revoked, with every key it made (and they made)", body = Revoked),
        (status = 401, description = "No or a wrong bearer token", body = ErrorBody),
        (status = 403, description = "Not the `admin` action", body = ErrorBody),
        (status = 404, description = "No such key (or one with an account beyond the caller's)", body = ErrorBody),
        (status = 503, description = "The store is not available", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    ))]
pub(super) async fn revoke_key(req: HttpRequest, path: web::Path<String>, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let caller = authorize(&req, &state, Action::Admin).await?;
    let not_found = || ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no API key with id {:?}", path.as_str()));
    // A key of accounts beyond the caller's scope is one it does not know of.
    match state.tenants.store.key(&path).await.map_err(store_unavailable)? {
        Some(k) if caller.governs(&k.accounts) => {}
        _ => return Err(not_found()),
    }
    if !state.tenants.store.revoke_key(&path, now_ms()).await.map_err(store_unavailable)? {
        return Err(not_found());
    }
    tracing::info!(key_id = %path, "API key revoked, with the keys it made");
    Ok(HttpResponse::Ok().json(Revoked { id: path.into_inner(), revoked: true }))
}

fn account_of(path: &str) -> Result<String, ApiError> {
    if crate::request::is_valid_id(path) {
        Ok(path.to_owned())
    } else {
        Err(ApiError::invalid("path: the billing account must match [A-Za-z0-9._:-]{1,128}"))
    }
}

/// Set an account's limits (absent fields: unlimited).
#[utoipa::path(put, path = "/v1/admin/accounts/{account}/limits", tag = "admin", security(("bearer" = [])),
    params(("account" = String, Path, pattern = "^[A-Za-z0-9._:-]{1,128}$", description = "The billing account")),
    request_body(content = Limits, content_type = "application/json"),
    responses(
        (status = 200, description = "The account's limits now", body = AccountLimits),
        (status = 400, description = "Invalid limits or account (the message names the field)", body = ErrorBody),
        (status = 401, description = "No or a wrong bearer token", body = ErrorBody),
        (status = 403, description = "Not the `admin` action, or a key scoped to some accounts (limits are set by the admin token or a `*` admin key)", body = ErrorBody),
        (status = 413, description = "The body is too large", body = ErrorBody),
        (status = 503, description = "The store is not available", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    ))]
pub(super) async fn set_limits(req: HttpRequest, path: web::Path<String>, payload: web::Payload, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let caller = authorize(&req, &state, Action::Admin).await?;
    let account = account_of(&path)?;
    // Limits are the operator's: a key scoped to some accounts could otherwise lift its own.
    if !caller.sees("*") {
        return Err(beyond_scope("only the admin token or an admin key of every account (`*`) sets limits"));
    }
    let body = read_body(payload, 64 * 1024).await?;
    let limits: Limits = decode(&body)?;
    limits.validate().map_err(ApiError::invalid)?;
    state.tenants.budgets.set_limits(&account, limits).await.map_err(store_unavailable)?;
    get_limits_of(&state, &account).await
}

/// An account's limits and this period's spend.
#[utoipa::path(get, path = "/v1/admin/accounts/{account}/limits", tag = "admin", security(("bearer" = [])),
    params(("account" = String, Path, pattern = "^[A-Za-z0-9._:-]{1,128}$", description = "The billing account")),
    responses(
        (status = 200, description = "The account's limits", body = AccountLimits),
        (status = 400, description = "Not a billing account id", body = ErrorBody),
        (status = 401, description = "No or a wrong bearer token", body = ErrorBody),
        (status = 403, description = "Not the `admin` action, or not one of the caller's accounts", body = ErrorBody),
        (status = 503, description = "The store is not available", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    ))]
pub(super) async fn get_limits(req: HttpRequest, path: web::Path<String>, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let caller = authorize(&req, &state, Action::Admin).await?;
    let account = account_of(&path)?;
    if !caller.sees(&account) {
        return Err(beyond_scope("this key may only read the limits of its own billing accounts"));
    }
    get_limits_of(&state, &account).await
}

/// `403 forbidden`: a key with `admin` acts on its own billing accounts only.
fn beyond_scope(message: &str) -> ApiError {
    ApiError::new(StatusCode::FORBIDDEN, "forbidden", message)
}

async fn get_limits_of(state: &AppState, account: &str) -> Result<HttpResponse, ApiError> {
    let limits = state.tenants.budgets.limits(account);
    let spent = state.tenants.budgets.spent(account).await.map_err(store_unavailable)?;
    Ok(HttpResponse::Ok().json(AccountLimits {
        billing_account_id: account.to_owned(),
        limits,
        spent_tokens: spent.map(|(s, _)| s),
        period_start: spent.map(|(_, (start, _))| start),
        period_end: spent.map(|(_, (_, end))| end),
    }))
}

#[cfg(test)]
mod tests {
    /// An admin body is one JSON value: anything after it is refused, as `POST /v1/runs` does.
    #[test]
    fn an_admin_body_with_anything_after_its_json_is_refused() {
        assert!(super::decode::<serde_json::Value>(br#"{"name":"k"} "#).is_ok());
        for body in [&br#"{"name":"k"} trailing"#[..], br#"{"name":"k"}{"name":"l"}"#, b"{} 5"] {
            let e = super::decode::<serde_json::Value>(body).expect_err("refused");
            assert_eq!(e.status, actix_web::http::StatusCode::BAD_REQUEST);
        }
    }
}
