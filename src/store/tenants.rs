//! What the store keeps about tenants: API keys, per-account limits and spend, and the webhook
//! outbox. The rules that use them live in `crate::tenants`.

use super::StoreError;

/// The budget window containing `now_ms`: `[start, end)` in ms, aligned to the epoch (spend is
/// stored per window; admission and the LLM proxy judge a budget in the current one).
pub fn window(period_sec: u64, now_ms: i64) -> (i64, i64) {
    let p = i64::try_from(period_sec.max(1).saturating_mul(1000)).unwrap_or(i64::MAX);
    let start = now_ms - now_ms.rem_euclid(p);
    (start, start.saturating_add(p))
}

/// Why an account's new run is refused, in the words both admission paths use (one process:
/// `tenants::budget`; replicas on PostgreSQL: the store's `pg_limits`): its token budget is spent.
pub fn budget_spent(account: &str, spent: impl std::fmt::Display, max: impl std::fmt::Display, wait_sec: u64) -> String {
    format!("billing account {account:?} has spent {spent} of its {max} tokens for this period; the next period starts in {wait_sec} s")
}

/// See [`budget_spent`]: its runs in flight are at their limit.
pub fn too_many_in_flight(account: &str, max: impl std::fmt::Display) -> String {
    format!("billing account {account:?} has {max} runs in flight, its limit; retry when one ends")
}

/// See [`budget_spent`]: it started its limit of runs in the last minute.
pub fn too_many_per_minute(account: &str, max: impl std::fmt::Display, wait_sec: u64) -> String {
    format!("billing account {account:?} started {max} runs in the last minute, its limit; retry in {wait_sec} s")
}

use serde::{Deserialize, Serialize};

/// An API key as stored (the secret only as its SHA-256).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct KeyRecord {
    /// Public id (the middle of `cmx_<id>_<secret>`).
    pub id: String,
    /// A name for people.
    pub name: String,
    /// SHA-256 of the secret, hex.
    #[serde(skip_serializing)]
    #[schema(ignore)]
    pub secret_sha256: String,
    /// Billing accounts the key may use and see; `["*"]` for all.
    pub accounts: Vec<String>,
    /// `run`, `read`, `abort`, `admin`.
    pub actions: Vec<String>,
    /// Signs the key's webhook deliveries.
    #[serde(skip_serializing)]
    #[schema(ignore)]
    pub webhook_secret: String,
    /// Default webhook URL of the key's runs.
    pub webhook_url: Option<String>,
    /// Creation time (ms).
    pub created_at_ms: i64,
    /// Revocation time (ms); a revoked key is refused.
    pub revoked_at_ms: Option<i64>,
    /// The key that created it (`None`: the admin token or the CLI). Revoking a key revokes the
    /// keys it created, and theirs.
    pub created_by: Option<String>,
}

/// Limits of one billing account (`None`: unlimited).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Limits {
    /// Tokens (input + output, as the LLM proxy records them) per period.
    pub max_tokens: Option<u64>,
    /// The budget period in seconds (windows aligned to the Unix epoch: 86400 = UTC days).
    #[schema(minimum = 1)]
    pub period_sec: Option<u64>,
    /// Live runs at once.
    pub max_concurrent: Option<u64>,
    /// Admissions per minute (sliding).
    pub max_runs_per_minute: Option<u64>,
}

/// The largest limit the store keeps (its columns are signed 64-bit).
pub const MAX_LIMIT: u64 = i64::MAX as u64;

impl Limits {
    /// What `PUT /v1/admin/accounts/{account}/limits` refuses; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_tokens.is_some() != self.period_sec.is_some() {
            return Err("fields `maxTokens` and `periodSec` go together: a token budget is per period".to_owned());
        }
        if self.period_sec == Some(0) {
            return Err("field `periodSec`: must be at least 1".to_owned());
        }
        // A larger value would be answered as set but stored clamped (found by schemathesis).
        for (name, v) in [
            ("maxTokens", self.max_tokens),
            ("periodSec", self.period_sec),
            ("maxConcurrent", self.max_concurrent),
            ("maxRunsPerMinute", self.max_runs_per_minute),
        ] {
            if v.is_some_and(|v| v > MAX_LIMIT) {
                return Err(format!("field `{name}`: must be at most {MAX_LIMIT}"));
            }
        }
        Ok(())
    }
}

/// A webhook delivery to make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxItem {
    /// Delivery id (sent as `X-Clawmux-Delivery`).
    pub id: i64,
    /// The run it reports.
    pub run_id: String,
    /// Where to.
    pub url: String,
    /// Whose secret signs it (`None`: the admin secret, `CLAWMUX_WEBHOOK_SECRET`).
    pub key_id: Option<String>,
    /// The final run document.
    pub body: String,
    /// Attempts so far.
    pub attempts: u32,
    /// When it was queued (ms).
    pub created_at_ms: i64,
}

/// How a delivery attempt went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeliveryOutcome {
    /// Accepted (2xx).
    Delivered,
    /// Failed; try again at this time (ms).
    Retry {
        /// Next attempt.
        next_at_ms: i64,
        /// Why it failed.
        error: String,
    },
    /// Failed for the last time.
    GaveUp {
        /// Why.
        error: String,
    },
}

/// The most due deliveries of one key [`TenantStore::due_deliveries`] answers at once.
pub const DUE_PER_KEY: usize = 16;

/// Whose a branch key is, as a claim found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BranchClaim {
    /// The billing account it belongs to.
    pub owner: String,
    /// This claim made it the claimer's (nobody's before).
    pub claimed_now: bool,
}

/// The tenant half of a store backend.
#[async_trait::async_trait]
pub trait TenantStore: Send + Sync + 'static {
    /// Stores a new key.
    async fn create_key(&self, key: &KeyRecord) -> Result<(), StoreError>;
    /// One key (revoked ones too).
    async fn key(&self, id: &str) -> Result<Option<KeyRecord>, StoreError>;
    /// Every key.
    async fn keys(&self) -> Result<Vec<KeyRecord>, StoreError>;
    /// Revokes a key and every key it created (and they created, ...); false when there is none.
    async fn revoke_key(&self, id: &str, at_ms: i64) -> Result<bool, StoreError>;
    /// The billing account a branch key belongs to: the first to claim it (`account`, when no
    /// account has), for good. `claim` is the claim's own id (unique); a claim by the owning
    /// account becomes the key's last claim.
    async fn claim_branch(&self, branch_key: &str, account: &str, at_ms: i64, claim: &str) -> Result<BranchClaim, StoreError>;
    /// The billing account a branch key belongs to, if any has claimed it (a read: claims nothing).
    async fn branch_owner(&self, branch_key: &str) -> Result<Option<String>, StoreError>;
    /// Undoes the claim `claim`, made for a run that was then refused, if it is still the key's
    /// last: a later claim is a run of the same account that may be working on the key by now.
    async fn release_branch(&self, branch_key: &str, claim: &str) -> Result<(), StoreError>;
    /// An account's limits.
    async fn limits(&self, account: &str) -> Result<Option<Limits>, StoreError>;
    /// Every account's limits.
    async fn all_limits(&self) -> Result<Vec<(String, Limits)>, StoreError>;
    /// Sets an account's limits.
    async fn set_limits(&self, account: &str, limits: &Limits, at_ms: i64) -> Result<(), StoreError>;
    /// Tokens spent by an account in the window starting at `window_start_ms`.
    async fn spend(&self, account: &str, window_start_ms: i64) -> Result<u64, StoreError>;
    /// Deliveries due at `now_ms`, round-robin across keys (each key's oldest, then each key's
    /// second oldest, ...; the admin token's count as one key), at most [`DUE_PER_KEY`] of one
    /// key: one tenant's backlog (a receiver that never answers) cannot fill the list every
    /// other tenant's deliveries wait behind. Within each round, first attempts and retries are
    /// taken in turns (each in id order): a tenant with many keys (an admin key makes as many as it likes), each with
    /// a retry due, would otherwise fill the list with older ids than a first attempt's; and
    /// first attempts alone first would leave retries out for as long as new webhooks keep coming.
    async fn due_deliveries(&self, now_ms: i64, limit: usize) -> Result<Vec<OutboxItem>, StoreError>;
    /// Takes a delivery that is due at `now_ms` for one attempt, until `until_ms`: false when
    /// another replica's delivery loop took it first (or it is not due any more), so replicas
    /// sharing a store never send one webhook twice at once. A process killed during its attempt
    /// holds the delivery back until `until_ms`. One process per SQLite or memory database: there
    /// nothing else takes deliveries, so always true.
    async fn claim_delivery(&self, _id: i64, _now_ms: i64, _until_ms: i64) -> Result<bool, StoreError> {
        Ok(true)
    }
    /// Records an attempt.
    async fn record_delivery(&self, id: i64, outcome: &DeliveryOutcome, at_ms: i64) -> Result<(), StoreError>;
    /// Deliveries of a run: (attempts, delivered, gave up, last error).
    async fn deliveries_of(&self, run_id: &str) -> Result<Vec<(u32, bool, bool, Option<String>)>, StoreError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_beyond_what_the_store_keeps_are_refused() {
        let ok = Limits { max_tokens: Some(MAX_LIMIT), period_sec: Some(1), max_concurrent: Some(0), max_runs_per_minute: None };
        assert_eq!(ok.validate(), Ok(()));
        for l in [
            Limits { max_tokens: Some(MAX_LIMIT + 1), period_sec: Some(1), ..Limits::default() },
            Limits { max_tokens: Some(1), period_sec: Some(u64::MAX), ..Limits::default() },
            Limits { max_concurrent: Some(MAX_LIMIT + 1), ..Limits::default() },
            Limits { max_runs_per_minute: Some(u64::MAX), ..Limits::default() },
        ] {
            assert!(l.validate().is_err_and(|m| m.contains("at most")), "{l:?}");
        }
        assert!(Limits { max_tokens: Some(1), ..Limits::default() }.validate().is_err());
        assert!(Limits { max_tokens: Some(1), period_sec: Some(0), ..Limits::default() }.validate().is_err());
    }
}
