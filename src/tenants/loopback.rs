//! Who a loopback caller without credentials is, when no admin token is configured: the operator
//! (admin) on a single-tenant clawmux, as docs/API.md says. Not once API keys exist (clawmux then
//! serves several tenants, and any local process, a tenant's agent with a shell on the host among
//! them, would be every tenant's admin), nor for a request a proxy relayed (a reverse proxy on
//! the same host makes every caller behind it look local).

use crate::store::tenants::TenantStore;
use crate::store::StoreError;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long "no key exists" is believed: a key the CLI (another process) makes is seen within
/// this; one made through this process's API at once.
const NONE_BELIEVED: Duration = Duration::from_secs(1);

/// Whether any API key exists (revoked ones too: keys are never deleted, so once seen, for good).
#[derive(Default)]
pub struct KeysSeen {
    seen: AtomicBool,
    /// When the store last said none exists.
    none_at: Mutex<Option<Instant>>,
}

impl KeysSeen {
    /// A key was made here.
    pub fn saw(&self) {
        self.seen.store(true, Ordering::Release);
    }

    /// Whether any key exists: read from the store at most once per [`NONE_BELIEVED`] while none
    /// does, never again once one does.
    pub async fn any(&self, store: &dyn TenantStore) -> Result<bool, StoreError> {
        if self.seen.load(Ordering::Acquire) {
            return Ok(true);
        }
        if self.none_at.lock().map(|at| at.is_some_and(|at| at.elapsed() < NONE_BELIEVED)).unwrap_or(false) {
            return Ok(false);
        }
        let any = !store.keys().await?.is_empty();
        if any {
            self.saw();
        } else if let Ok(mut at) = self.none_at.lock() {
            *at = Some(Instant::now());
        }
        Ok(any)
    }
}

/// A request a proxy relayed says so (RFC 7239 `Forwarded`, or the de-facto `X-Forwarded-For`,
/// `X-Real-IP`): its loopback peer is the proxy, not the caller.
pub fn relayed(headers: &actix_web::http::header::HeaderMap) -> bool {
    ["forwarded", "x-forwarded-for", "x-real-ip"].iter().any(|h| headers.contains_key(*h))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::memory::MemoryStore;
    use crate::store::tenants::KeyRecord;

    #[actix_rt::test]
    async fn keys_are_seen_once_made_and_for_good() {
        let store = MemoryStore::new();
        let seen = KeysSeen::default();
        assert!(!seen.any(&store).await.expect("read"));
        let key = KeyRecord {
            id: "k1".into(),
            name: "k1".into(),
            secret_sha256: "00".repeat(32),
            accounts: vec!["acct".into()],
            actions: vec!["read".into()],
            webhook_secret: "s".into(),
            webhook_url: None,
            created_at_ms: 1,
            revoked_at_ms: None,
            created_by: None,
        };
        store.create_key(&key).await.expect("create");
        // "None" is believed for a moment (another process's key is seen within it) ...
        assert!(!seen.any(&store).await.expect("read"));
        tokio::time::sleep(NONE_BELIEVED + Duration::from_millis(50)).await;
        assert!(seen.any(&store).await.expect("read"), "a key made elsewhere is seen");
        // ... a key made here at once.
        let fresh = KeysSeen::default();
        fresh.saw();
        assert!(fresh.any(&MemoryStore::new()).await.expect("read"));
    }

    #[test]
    fn a_relayed_request_is_told_by_its_forwarding_headers() {
        use actix_web::http::header::{HeaderMap, HeaderName, HeaderValue};
        assert!(!relayed(&HeaderMap::new()));
        for h in ["forwarded", "x-forwarded-for", "x-real-ip"] {
            let mut m = HeaderMap::new();
            m.insert(HeaderName::from_static(h), HeaderValue::from_static("203.0.113.7"));
            assert!(relayed(&m), "{h}");
        }
    }
}
