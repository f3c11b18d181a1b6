//! Tenants: who may do what, how much they may spend, and how they hear of a run's end.
//!
//! # Layout
//! - [`keys`]: API keys (`cmx_<id>_<secret>`, stored hashed), scoped to billing accounts and
//!   actions; the caller as a [`keys::Principal`] (pure).
//! - [`budget`]: per-account token budgets, concurrency and rate limits, enforced at admission and
//!   by the LLM proxy before every call.
//! - [`webhook`]: completion webhooks: the allow-list, signing, and the delivery worker over the
//!   store's outbox.
//! - [`loopback`]: when a loopback caller without credentials is the admin (no admin token, no
//!   API key, not relayed by a proxy).
//!
//! [`Tenants`] bundles them for the HTTP layer and the proxy.

pub mod budget;
pub mod keys;
pub mod loopback;
pub mod receiver_dns;
pub mod webhook;

use crate::config::Secret;
use crate::store::tenants::TenantStore;
use keys::Principal;
use std::sync::Arc;

/// Why a caller is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthError {
    /// No credentials where they are needed.
    Missing,
    /// Credentials that are not (or no longer) valid.
    Invalid,
    /// The store could not be asked.
    Unavailable(String),
}

/// Keys, budgets and webhooks.
pub struct Tenants {
    /// Keys, limits, spend, outbox.
    pub store: Arc<dyn TenantStore>,
    /// Budgets and rate limits.
    pub budgets: Arc<budget::Budgets>,
    /// Where webhooks may go.
    pub allow: webhook::Allow,
    /// Signs the admin token's webhooks (`CLAWMUX_WEBHOOK_SECRET`).
    pub admin_webhook_secret: Option<Secret>,
    /// Whether any API key exists (see [`loopback`]).
    pub keys_seen: loopback::KeysSeen,
}

impl Tenants {
    /// The principal behind a bearer token: the admin token, or a live API key.
    pub async fn principal(&self, token: &str, admin: Option<&Secret>) -> Result<Principal, AuthError> {
        if let Some(admin) = admin {
            if keys::constant_time_eq(token.as_bytes(), admin.expose().as_bytes()) {
                return Ok(Principal::Admin);
            }
        }
        let Some(given) = keys::parse(token) else { return Err(AuthError::Invalid) };
        // Looked up on every request: a revoked key (by the CLI, another process) is refused at once.
        match self.store.key(given.id).await {
            Ok(Some(record)) if keys::matches(&record, &given) => match makers_live(&*self.store, &record).await {
                Ok(true) => Ok(Principal::Key(Box::new(record))),
                Ok(false) => Err(AuthError::Invalid),
                Err(e) => Err(AuthError::Unavailable(e.to_string())),
            },
            Ok(_) => Err(AuthError::Invalid),
            Err(e) => Err(AuthError::Unavailable(e.to_string())),
        }
    }
}

/// The longest chain of keys made by keys that is followed; a longer one is refused.
const MAX_MAKERS: usize = 16;

/// Whether the key that made `key`, the key that made that one, and so on, are all live. Revoking
/// a key revokes the keys it made, but a key made while its maker was being revoked (its request
/// authorised just before, its row written just after) would escape that: it is refused here.
async fn makers_live(store: &dyn TenantStore, key: &crate::store::tenants::KeyRecord) -> Result<bool, crate::store::StoreError> {
    let mut maker = key.created_by.clone();
    for _ in 0..MAX_MAKERS {
        let Some(id) = maker else { return Ok(true) };
        match store.key(&id).await? {
            Some(k) if k.revoked_at_ms.is_none() => maker = k.created_by,
            // Revoked, or not there (keys are never deleted): refused.
            _ => return Ok(false),
        }
    }
    Ok(maker.is_none())
}


/// The signing secrets of webhook deliveries, from the store and the configuration.
pub struct StoreSecrets {
    /// Keys.
    pub store: Arc<dyn TenantStore>,
    /// `CLAWMUX_WEBHOOK_SECRET`.
    pub admin: Option<Secret>,
}

impl webhook::Secrets for StoreSecrets {
    fn secret(&self, key_id: Option<&str>) -> futures_util::future::BoxFuture<'_, Result<Option<String>, String>> {
        let key_id = key_id.map(str::to_owned);
        Box::pin(async move {
            match key_id {
                None => Ok(self.admin.as_ref().map(|s| s.expose().to_owned())),
                Some(id) => self.store.key(&id).await.map(|k| k.map(|k| k.webhook_secret)).map_err(|e| {
                    // The delivery's error is shown to its key's holder: the store's details go
                    // to the log only.
                    tracing::warn!(error = %e, "cannot read a webhook's signing secret");
                    "the store cannot be read right now".to_owned()
                }),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::memory::MemoryStore;

    /// A key made by a key that was revoked meanwhile (its row written after the revocation's
    /// cascade) is refused all the same, and so is one made by that one.
    #[tokio::test]
    async fn a_key_whose_maker_is_revoked_is_refused() {
        let store = MemoryStore::new();
        let make = |name: &str, by: Option<&str>| {
            let (mut k, _) = keys::generate(name, vec!["acct".into()], vec![keys::Action::Read], None, 1);
            k.created_by = by.map(str::to_owned);
            k
        };
        let boss = make("boss", None);
        store.create_key(&boss).await.expect("create");
        let early = make("early", Some(&boss.id));
        store.create_key(&early).await.expect("create");
        assert!(makers_live(&store, &early).await.expect("read"));
        assert!(store.revoke_key(&boss.id, 5).await.expect("revoke"));
        let late = make("late", Some(&boss.id));
        store.create_key(&late).await.expect("create");
        let later = make("later", Some(&late.id));
        store.create_key(&later).await.expect("create");
        assert!(!makers_live(&store, &late).await.expect("read"), "made by a revoked key");
        assert!(!makers_live(&store, &later).await.expect("read"), "made by a key made by a revoked key");
        assert!(makers_live(&store, &boss).await.expect("read"), "made by the admin token: no maker to ask");
    }
}
