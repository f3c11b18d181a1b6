//! Completion webhooks: when a run ends, its final document is `POST`ed to the run's webhook URL,
//! signed, at least once (the delivery is stored in the same transaction as the run's terminal
//! event and retried with backoff for a bounded time, across restarts), never to a host the admin
//! has not allowed (`CLAWMUX_WEBHOOK_ALLOW`), and never following a redirect.
//!
//! Signature: `X-Clawmux-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`.
//! The receiver recomputes it with its key's webhook secret (shown at key creation; the admin
//! token's runs use `CLAWMUX_WEBHOOK_SECRET`), compares in constant time and rejects old `t`
//! (replays). `X-Clawmux-Delivery` is the delivery id: the same on every retry (deduplicate by it).

use crate::store::now_ms;
use crate::store::tenants::{DeliveryOutcome, OutboxItem, TenantStore};
use hmac::{Hmac, Mac};
use std::sync::Arc;
use std::time::Duration;

/// `CLAWMUX_WEBHOOK_ALLOW`: host patterns (`example.com`, `*.example.com`, `127.0.0.1:8080`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allow(Vec<String>);

impl Allow {
    /// Parses a comma-separated list (empty: nothing allowed).
    pub fn parse(list: &str) -> Self {
        Self(list.split(',').map(|p| p.trim().to_ascii_lowercase()).filter(|p| !p.is_empty()).collect())
    }

    /// Why `list` cannot be read as written, for its first entry that cannot (`None`: every one
    /// can). A port that is empty or out of range (`127.0.0.2:`, `h:99999`) read as "any port",
    /// and an IPv6 address without brackets (`fe80::1`) as its last group for a port: both
    /// opened more than the operator wrote, so they are refused at start.
    pub fn problem(list: &str) -> Option<String> {
        Self::parse(list).0.iter().find_map(|p| {
            // What follows the host: `[v6]` and `[v6]:port`, or `host` and `host:port`.
            let port = match p.strip_prefix('[') {
                Some(rest) => match rest.split_once(']') {
                    Some((_, "")) => None,
                    Some((_, after)) => Some(after.strip_prefix(':').unwrap_or(after)),
                    None => return Some(format!("entry {p:?}: an IPv6 address's bracket is not closed")),
                },
                None if p.matches(':').count() > 1 => return Some(format!("entry {p:?}: write an IPv6 address in brackets ([::1], [::1]:9000)")),
                None => p.split_once(':').map(|(_, port)| port),
            };
            match port {
                Some(port) if !matches!(port.parse::<u16>(), Ok(1..)) => {
                    Some(format!("entry {p:?}: the port must be 1 to 65535 (leave `:port` out for any port)"))
                }
                _ => None,
            }
        })
    }

    /// True when nothing is allowed.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The addresses the list names itself, with their ports (`127.0.0.1:9000`; `10.0.0.5`: any
    /// port), read as [`Self::check`] reads its patterns: a host name that resolves to one of them
    /// may lead there on that port even when it is loopback (see [`super::receiver_dns`]).
    pub fn addresses(&self) -> Vec<(std::net::IpAddr, Option<u16>)> {
        self.0
            .iter()
            .filter_map(|p| {
                let (host, port) = pattern(p);
                host.trim_start_matches('[').trim_end_matches(']').parse().ok().map(|ip| (ip, port))
            })
            .collect()
    }

    /// Checks a webhook URL: `http(s)`, no credentials, a host the list allows. Returns why not.
    pub fn check(&self, url: &str) -> Result<(), String> {
        let u = reqwest::Url::parse(url).map_err(|e| format!("is not a URL ({e})"))?;
        if !matches!(u.scheme(), "http" | "https") {
            return Err("must be an http or https URL".to_owned());
        }
        if !u.username().is_empty() || u.password().is_some() {
            return Err("must not carry credentials".to_owned());
        }
        let host = u.host_str().ok_or("has no host")?.to_ascii_lowercase();
        // An address is compared as an address: the URL's is in its canonical spelling
        // (`[::ffff:7f00:1]`), the list's as the operator wrote it (`[::ffff:127.0.0.1]`).
        let host_ip = host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>().ok();
        let port = u.port_or_known_default().unwrap_or(0);
        let allowed = self.0.iter().any(|p| {
            let (pat_host, pat_port) = pattern(p);
            let pat_ip = pat_host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>().ok();
            let host_ok = match (host_ip, pat_ip, pat_host.strip_prefix("*.")) {
                (Some(a), Some(b), _) => a == b,
                (_, _, Some(suffix)) => host.ends_with(&format!(".{suffix}")),
                _ => host == pat_host,
            };
            host_ok && pat_port.is_none_or(|pp| pp == port)
        });
        if allowed {
            Ok(())
        } else {
            Err(format!("host {host}:{port} is not allowed (CLAWMUX_WEBHOOK_ALLOW)"))
        }
    }
}

/// An allow-list pattern's host and port (`None`: any port).
fn pattern(p: &str) -> (&str, Option<u16>) {
    match p.rsplit_once(':') {
        Some((h, pt)) if pt.bytes().all(|b| b.is_ascii_digit()) => (h, pt.parse::<u16>().ok()),
        _ => (p, None),
    }
}

/// `X-Clawmux-Signature` of `body` at time `t` (unix seconds).
pub fn signature(secret: &str, t: i64, body: &str) -> String {
    let mut mac = match Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()) {
        Ok(m) => m,
        // HMAC takes keys of any length; this cannot fail.
        Err(_) => return String::new(),
    };
    mac.update(format!("{t}.{body}").as_bytes());
    format!("t={t},v1={}", hex::encode(mac.finalize().into_bytes()))
}

/// Delay before the next attempt after `attempts` failed ones: 1 s, 2 s, 4 s, … 5 min.
pub fn backoff(attempts: u32) -> Duration {
    Duration::from_secs(1u64 << attempts.min(9)).min(Duration::from_secs(300))
}

/// Where the signing secrets come from.
pub trait Secrets: Send + Sync + 'static {
    /// The secret of key `key_id`, or of the admin (`None`); `Ok(None)` when there is none (the
    /// key is gone, `CLAWMUX_WEBHOOK_SECRET` is unset), an error when it cannot be read now (the
    /// store: the delivery is tried again, not given up).
    fn secret(&self, key_id: Option<&str>) -> futures_util::future::BoxFuture<'_, Result<Option<String>, String>>;
}

/// Deliveries attempted at once: one receiver that never answers holds one of them for an
/// attempt's bound, not every other tenant's webhooks behind it.
const CONCURRENT_ATTEMPTS: usize = 16;


/// The delivery worker's settings.
#[derive(Debug, Clone)]
pub struct DeliveryConfig {
    /// How often due deliveries are looked for.
    pub poll: Duration,
    /// Deliveries are given up this long after their run ended.
    pub max_age: Duration,
    /// One attempt's bound.
    pub attempt_timeout: Duration,
    /// The allow-list: its addresses are the only loopback or link-local ones a receiver's host
    /// name may resolve to.
    pub allow: Allow,
}

/// How much longer than one attempt's bound a delivery stays taken by the replica attempting it.
const CLAIM_MARGIN_MS: i64 = 5_000;

/// Delivers due webhooks until the process ends.
pub async fn run_deliveries(store: Arc<dyn TenantStore>, secrets: Arc<dyn Secrets>, cfg: DeliveryConfig) {
    let client = match client_builder(cfg.attempt_timeout).build() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot build the webhook client; no webhook is delivered");
            return;
        }
    };
    let mut tick = tokio::time::interval(cfg.poll);
    // A slow read of the due list does not make the missed ticks fire back to back.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Attempts run as tasks of their own (they go on while the due list is read); a slot is taken
    // again from the last due list as soon as an attempt ends, not at the next tick.
    let mut tasks = tokio::task::JoinSet::new();
    let mut started: std::collections::HashMap<tokio::task::Id, (i64, Option<String>)> = std::collections::HashMap::new();
    let mut slots = Slots::default();
    let mut pending = std::collections::VecDeque::new();
    loop {
        tokio::select! {
            Some(ended) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                let task = match &ended {
                    Ok((task, ())) => *task,
                    Err(e) => e.id(),
                };
                if let Some((id, key)) = started.remove(&task) {
                    slots.done(id, &key);
                }
            }
            // Read also while every slot is taken: a slot that frees goes by the list as it is
            // now. Before, a full set of slots kept the last list, and a key with nothing under
            // way (a webhook queued meanwhile) waited until the receivers that never answer had
            // been tried through all of it, a few attempt bounds later.
            _ = tick.tick() => {
                match store.due_deliveries(now_ms(), 64).await {
                    Ok(d) => pending = d.into(),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot read due webhook deliveries");
                        continue;
                    }
                }
            }
        }
        for item in slots.pick(&mut pending) {
            let (store, client, secrets, cfg) = (store.clone(), client.clone(), secrets.clone(), cfg.clone());
            let what = (item.id, item.key_id.clone());
            let task = tasks.spawn(async move { deliver(&*store, &client, &*secrets, item, &cfg).await }).id();
            started.insert(task, what);
        }
    }
}

/// The attempts under way: how many, of which deliveries, per key.
#[derive(Default)]
struct Slots {
    ids: std::collections::HashSet<i64>,
    per_key: std::collections::HashMap<Option<String>, usize>,
}

impl Slots {
    fn free(&self) -> usize {
        CONCURRENT_ATTEMPTS.saturating_sub(self.ids.len())
    }

    /// Takes from `due` (round-robin across keys, as the store lists them) the deliveries to start
    /// now, up to the free slots: each slot to the delivery whose key has the fewest attempts
    /// under way (the first in `due` among equals). Keys whose receivers never answer then hold
    /// at most their share of the slots: a key with nothing under way goes first. One busy key
    /// alone takes them all. Deliveries under way are dropped from `due`.
    fn pick(&mut self, due: &mut std::collections::VecDeque<OutboxItem>) -> Vec<OutboxItem> {
        due.retain(|d| !self.ids.contains(&d.id));
        let mut picked = Vec::new();
        while self.free() > 0 {
            let fewest = due.iter().enumerate().min_by_key(|(i, d)| (self.per_key.get(&d.key_id).copied().unwrap_or(0), *i)).map(|(i, _)| i);
            let Some(d) = fewest.and_then(|i| due.remove(i)) else { break };
            *self.per_key.entry(d.key_id.clone()).or_default() += 1;
            self.ids.insert(d.id);
            picked.push(d);
        }
        picked
    }

    fn done(&mut self, id: i64, key: &Option<String>) {
        self.ids.remove(&id);
        if let Some(n) = self.per_key.get_mut(key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_key.remove(key);
            }
        }
    }
}

/// Takes one due delivery, attempts it and records the outcome.
async fn deliver(store: &dyn TenantStore, client: &reqwest::Client, secrets: &dyn Secrets, item: OutboxItem, cfg: &DeliveryConfig) {
    // Taken for one attempt (its bound plus a margin): another replica's loop passes it by.
    let now = now_ms();
    let until = now + i64::try_from(cfg.attempt_timeout.as_millis()).unwrap_or(i64::MAX / 2) + CLAIM_MARGIN_MS;
    match store.claim_delivery(item.id, now, until).await {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => {
            tracing::warn!(error = %e, "cannot take a webhook delivery");
            return;
        }
    }
    let outcome = attempt(client, secrets, &item, cfg).await;
    match &outcome {
        DeliveryOutcome::Delivered => tracing::info!(run_id = %item.run_id, delivery = item.id, "webhook delivered"),
        DeliveryOutcome::Retry { error, .. } => tracing::warn!(run_id = %item.run_id, delivery = item.id, error = %error, "webhook delivery failed; will retry"),
        DeliveryOutcome::GaveUp { error } => tracing::error!(run_id = %item.run_id, delivery = item.id, error = %error, "webhook delivery given up"),
    }
    if let Err(e) = store.record_delivery(item.id, &outcome, now_ms()).await {
        tracing::warn!(error = %e, "cannot record a webhook delivery");
    }
}

async fn attempt(client: &reqwest::Client, secrets: &dyn Secrets, item: &OutboxItem, cfg: &DeliveryConfig) -> DeliveryOutcome {
    let failed = |error: String| {
        let age = Duration::from_millis(u64::try_from(now_ms() - item.created_at_ms).unwrap_or(0));
        let next = backoff(item.attempts);
        if age + next > cfg.max_age {
            DeliveryOutcome::GaveUp { error }
        } else {
            DeliveryOutcome::Retry { next_at_ms: now_ms() + next.as_millis() as i64, error }
        }
    };
    let secret = match secrets.secret(item.key_id.as_deref()).await {
        Ok(Some(secret)) => secret,
        Ok(None) => return DeliveryOutcome::GaveUp { error: "no signing secret (the key is gone, or CLAWMUX_WEBHOOK_SECRET is unset)".to_owned() },
        Err(e) => return failed(format!("cannot read the signing secret: {e}")),
    };
    let pinned = match pinned_client(item, cfg).await {
        Ok(c) => c,
        Err(e) => return failed(e),
    };
    let t = now_ms() / 1000;
    let sent = pinned
        .as_ref()
        .unwrap_or(client)
        .post(&item.url)
        .header("content-type", "application/json")
        .header("x-clawmux-signature", signature(&secret, t, &item.body))
        .header("x-clawmux-delivery", item.id.to_string())
        .header("x-clawmux-run-id", &item.run_id)
        .body(item.body.clone())
        .send()
        .await;
    match sent {
        Ok(r) if r.status().is_success() => DeliveryOutcome::Delivered,
        // A redirect is not followed: it is a failure like any other (the URL is what the admin allowed).
        Ok(r) => failed(format!("the receiver answered {}", r.status())),
        Err(e) => failed(format!("cannot reach the receiver: {}", without_url(e))),
    }
}

/// For a receiver given by host name: a client that connects only to the addresses
/// [`super::receiver_dns::resolve`] leaves of the name, pinned for this attempt (a proxy the URL
/// goes through still resolves it itself). `None`: the shared client serves (an address in the
/// URL, which the allow-list checked itself; or a name that does not resolve here, with a proxy
/// configured to resolve it). The name's lookup counts in the attempt's bound.
async fn pinned_client(item: &OutboxItem, cfg: &DeliveryConfig) -> Result<Option<reqwest::Client>, String> {
    use super::receiver_dns::{resolve, Resolved};
    let url = reqwest::Url::parse(&item.url).map_err(|e| format!("is not a URL ({e})"))?;
    let Some(host) = url.domain() else { return Ok(None) };
    let port = url.port_or_known_default().unwrap_or(0);
    let started = std::time::Instant::now();
    let addrs = match resolve(host, port, &cfg.allow.addresses(), cfg.attempt_timeout / 2).await {
        Resolved::Usable(a) => a,
        Resolved::Guarded(why) => return Err(why),
        Resolved::Failed(_) if super::receiver_dns::proxied(&|k| std::env::var(k).ok()) => return Ok(None),
        Resolved::Failed(why) => return Err(why),
    };
    client_builder(cfg.attempt_timeout.saturating_sub(started.elapsed()).max(std::time::Duration::from_secs(1)))
        .resolve_to_addrs(host, &addrs)
        .build()
        .map(Some)
        .map_err(|e| format!("cannot build the webhook client: {}", without_url(e)))
}

/// The webhook client's settings, shared by the worker's client and each pinned one: a redirect is
/// never followed (the URL is what the admin allowed), and an attempt is bounded by `timeout`.
fn client_builder(timeout: Duration) -> reqwest::ClientBuilder {
    reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).timeout(timeout)
}

/// A failed request's error and its causes, without its URL: reqwest's own text names the URL,
/// and a receiver's URL may carry its capability (`https://hooks.example/T0/B0/<token>`), which
/// must not reach the logs nor the delivery's stored error.
fn without_url(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(&e);
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_allow_list_entry_that_would_open_more_than_written_is_refused() {
        for bad in ["127.0.0.2:", "hooks.example.com:99999", "h:0", "fe80::1", "::1", "a.example, 10.0.0.1:"] {
            assert!(Allow::problem(bad).is_some(), "{bad} is accepted");
        }
        for good in ["", "hooks.example.com, *.acme.io ,127.0.0.1:8080", "[::1]", "[::1]:9000", "10.0.0.5", "h:65535", "[fe80::1]:1"] {
            assert_eq!(Allow::problem(good), None, "{good}");
        }
        assert!(Allow::problem("ok.example,127.0.0.2:").expect("refused").contains("\"127.0.0.2:\""), "the entry is named");
    }

    /// Found by the fuzz target below: an address entry in another spelling than the URL
    /// parser's (`[::ffff:127.0.0.1]` against the URL's `[::ffff:7f00:1]`) matched nothing.
    #[test]
    fn an_address_entry_matches_its_address_however_spelled() {
        let a = Allow::parse("[::FFFF:127.0.0.1]:9000, [fe80::0001]");
        assert_eq!(a.check("http://[::ffff:127.0.0.1]:9000/h"), Ok(()));
        assert_eq!(a.check("http://[::ffff:7f00:1]:9000/h"), Ok(()));
        assert!(a.check("http://[::ffff:7f00:1]:9001/h").is_err(), "its port only");
        assert_eq!(a.check("http://[fe80::1]/h"), Ok(()));
        assert!(a.check("http://127.0.0.1:9000/h").is_err(), "an IPv4-mapped address is not its IPv4 address for the list");
    }

    #[test]
    fn allow_list_matches_hosts_ports_and_wildcards() {
        let a = Allow::parse("hooks.example.com, *.acme.io ,127.0.0.1:8080");
        assert!(a.check("https://hooks.example.com/x").is_ok());
        assert!(a.check("https://a.acme.io/x").is_ok());
        assert!(a.check("https://acme.io/x").is_err(), "the wildcard is for subdomains");
        assert!(a.check("http://127.0.0.1:8080/h").is_ok());
        assert!(a.check("http://127.0.0.1:8081/h").is_err());
        assert!(a.check("https://evil.com/?x=hooks.example.com").is_err());
        assert!(a.check("https://hooks.example.com.evil.com/").is_err());
        assert!(a.check("ftp://hooks.example.com/").is_err());
        assert!(a.check("https://u:p@hooks.example.com/").is_err());
        assert!(Allow::parse("").check("https://hooks.example.com/").is_err());
    }

    #[test]
    fn signatures_are_hmac_sha256_of_time_and_body() {
        // RFC 4231 style check of the construction: a different body, time or secret changes it.
        let s = signature("whsec_1", 1_700_000_000, "{}");
        assert!(s.starts_with("t=1700000000,v1=") && s.len() == "t=1700000000,v1=".len() + 64, "{s}");
        assert_ne!(s, signature("whsec_1", 1_700_000_001, "{}"));
        assert_ne!(s, signature("whsec_2", 1_700_000_000, "{}"));
        assert_ne!(s, signature("whsec_1", 1_700_000_000, "{ }"));
    }

    use crate::store::{EventName, NewDelivery, RunPatch, Store, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    /// A receiver: `/hang` is read and never answered; anything else is answered `200` and its
    /// path recorded.
    async fn receiver() -> (String, Arc<Mutex<Vec<String>>>) {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
        let addr = listener.local_addr().expect("addr");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let log = log.clone();
                tokio::spawn(async move {
                    let Some(line) = crate::test_http::request_line(&mut conn).await else { return };
                    let path = line.split(' ').nth(1).unwrap_or_default().to_owned();
                    if path == "/hang" {
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                        return;
                    }
                    log.lock().expect("log").push(path);
                    let _ = conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").await;
                });
            }
        });
        (format!("http://{addr}"), seen)
    }

    /// A finished run `run_id` of key `key` whose webhook goes to `url`.
    async fn queue(store: &crate::store::memory::MemoryStore, run_id: &str, url: String, key: &str) {
        let row = crate::store::backend_tests::row(run_id, "acct", 1);
        store.apply(&[Write::Insert(Box::new(row))]).await.expect("insert");
        let end = RunPatch { status: Some("ok".into()), finished_at_ms: Some(now_ms()), ..RunPatch::default() };
        let webhook = NewDelivery { url, key_id: Some(key.into()), body: "{}".into() };
        let event = crate::store::backend_tests::event(1, EventName::Final, "{}");
        store.apply(&[Write::Append { run_id: run_id.into(), event: Some(event), patch: end, webhook: Some(webhook) }]).await.expect("end");
    }

    /// Secrets whose store fails the first `failures` reads.
    struct Flaky(AtomicUsize);
    impl Secrets for Flaky {
        fn secret(&self, _: Option<&str>) -> futures_util::future::BoxFuture<'_, Result<Option<String>, String>> {
            let failing = self.0.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
            Box::pin(async move { if failing { Err("the store cannot be read right now".to_owned()) } else { Ok(Some("whsec_1".to_owned())) } })
        }
    }

    fn config() -> DeliveryConfig {
        DeliveryConfig { poll: Duration::from_millis(50), max_age: Duration::from_secs(3600), attempt_timeout: Duration::from_secs(30), allow: Allow::default() }
    }

    async fn until(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while !done() {
            assert!(tokio::time::Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A signing secret the store cannot read for a moment is tried again (after the backoff),
    /// not given up: the run's only completion notice arrives.
    #[tokio::test]
    async fn a_secret_that_cannot_be_read_for_a_moment_is_retried_not_given_up() {
        let (base, seen) = receiver().await;
        let store = Arc::new(crate::store::memory::MemoryStore::new());
        queue(&store, "run-1", format!("{base}/ok"), "k1").await;
        let worker = tokio::spawn(run_deliveries(store.clone(), Arc::new(Flaky(AtomicUsize::new(1))), config()));
        until("the webhook did not arrive after the store came back", || seen.lock().expect("log").len() == 1).await;
        worker.abort();
        let deliveries = store.deliveries_of("run-1").await.expect("read");
        assert_eq!(deliveries.iter().map(|d| (d.0, d.1, d.2)).collect::<Vec<_>>(), [(2, true, false)], "{deliveries:?}");
    }

    /// One tenant's receiver that never answers (each attempt bounded at 30 s here), with a
    /// backlog larger than a poll's list and than the attempts made at once, does not hold up
    /// another tenant's webhook queued after it.
    #[tokio::test]
    async fn receivers_that_never_answer_do_not_hold_up_other_webhooks() {
        let (base, seen) = receiver().await;
        let store = Arc::new(crate::store::memory::MemoryStore::new());
        for i in 0..100 {
            queue(&store, &format!("hang-{i}"), format!("{base}/hang"), "k-hang").await;
        }
        queue(&store, "run-ok", format!("{base}/ok"), "k-other").await;
        let worker = tokio::spawn(run_deliveries(store.clone(), Arc::new(Flaky(AtomicUsize::new(0))), config()));
        until("the webhook behind the hanging receivers did not arrive", || seen.lock().expect("log").len() == 1).await;
        worker.abort();
    }

    /// A failed attempt's error, logged and stored with the delivery, names the cause and never
    /// the receiver's URL (whose path may be its capability).
    #[tokio::test]
    async fn a_failed_attempt_never_records_the_receivers_url() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
        let store = Arc::new(crate::store::memory::MemoryStore::new());
        queue(&store, "run-1", format!("http://{closed}/T000/B000/capability-secret?token=also-secret"), "k1").await;
        let worker = tokio::spawn(run_deliveries(store.clone(), Arc::new(Flaky(AtomicUsize::new(0))), config()));
        let mut recorded = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while recorded.is_empty() {
            assert!(tokio::time::Instant::now() < deadline, "no attempt was recorded");
            tokio::time::sleep(Duration::from_millis(20)).await;
            recorded = store.deliveries_of("run-1").await.expect("read").into_iter().filter_map(|d| d.3).collect();
        }
        worker.abort();
        let error = &recorded[0];
        assert!(error.starts_with("cannot reach the receiver: ") && error.len() > "cannot reach the receiver: ".len(), "{error}");
        assert!(!error.contains("secret") && !error.contains(&closed.to_string()), "{error}");
    }

    /// Every slot taken by receivers that never answer: a webhook queued meanwhile for another key
    /// gets the first slot that frees (about one attempt bound, 3 s here), not a turn after the
    /// backlog the worker had listed before it was queued (three bounds and more).
    #[tokio::test]
    async fn a_freed_slot_goes_by_the_due_list_as_it_is_now() {
        let (base, seen) = receiver().await;
        let store = Arc::new(crate::store::memory::MemoryStore::new());
        for k in 0..4 {
            for i in 0..16 {
                queue(&store, &format!("hang-{k}-{i}"), format!("{base}/hang"), &format!("k-hang-{k}")).await;
            }
        }
        let cfg = DeliveryConfig { attempt_timeout: Duration::from_secs(3), ..config() };
        let worker = tokio::spawn(run_deliveries(store.clone(), Arc::new(Flaky(AtomicUsize::new(0))), cfg));
        // All slots taken: the claims of 16 attempts are stored.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            assert!(tokio::time::Instant::now() < deadline, "the slots were not all taken");
            if store.due_deliveries(now_ms(), 1000).await.expect("read").len() == 64 - CONCURRENT_ATTEMPTS {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let queued = tokio::time::Instant::now();
        queue(&store, "run-ok", format!("{base}/ok"), "k-other").await;
        until("the webhook queued behind the full slots did not arrive", || seen.lock().expect("log").len() == 1).await;
        let waited = queued.elapsed();
        worker.abort();
        assert!(waited < Duration::from_millis(6_500), "waited {waited:?} for a freed slot");
    }

    #[test]
    fn the_allow_list_names_its_addresses() {
        // As `check` reads them: a bare IPv6 address is not a pattern it matches (its last group
        // reads as a port), nor one that opens that address here.
        let a = Allow::parse("hooks.example.com, *.acme.io ,127.0.0.1:8080, 10.0.0.5, [::1]:9000, [fe80::1], 127.0.0.2:, 127.0.0.3:99999");
        let want: Vec<(std::net::IpAddr, Option<u16>)> =
            [("127.0.0.1", Some(8080)), ("10.0.0.5", None), ("::1", Some(9000)), ("fe80::1", None), ("127.0.0.2", None), ("127.0.0.3", None)].iter().map(|(i, p)| (i.parse().expect("ip"), *p)).collect();
        assert_eq!(a.addresses(), want);
    }

    /// An allowed host name whose DNS leads to this host's loopback (a tenant's name pointed at
    /// clawmux's own ports, say) is not posted to, and the stored error says why; listing the
    /// address itself allows it.
    #[tokio::test]
    async fn a_host_name_that_resolves_to_loopback_is_posted_to_only_when_its_address_is_listed() {
        let (base, seen) = receiver().await;
        let port = base.rsplit(':').next().expect("port").to_owned();
        let by_name = format!("http://localhost:{port}/by-name");
        // The address listed with another port opens nothing on this one.
        for (listed, delivered) in [(format!("localhost:{port},127.0.0.1:1,[::1]:1"), false), (format!("localhost:{port},127.0.0.1:{port},[::1]:{port}"), true)] {
            let store = Arc::new(crate::store::memory::MemoryStore::new());
            queue(&store, "run-1", by_name.clone(), "k1").await;
            let cfg = DeliveryConfig { allow: Allow::parse(&listed), ..config() };
            let worker = tokio::spawn(run_deliveries(store.clone(), Arc::new(Flaky(AtomicUsize::new(0))), cfg));
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            let outcome = loop {
                assert!(tokio::time::Instant::now() < deadline, "{listed}: no attempt was recorded");
                tokio::time::sleep(Duration::from_millis(20)).await;
                let d = store.deliveries_of("run-1").await.expect("read");
                if d.iter().any(|d| d.1 || d.3.is_some()) {
                    break d;
                }
            };
            worker.abort();
            assert_eq!(outcome[0].1, delivered, "{listed}: {outcome:?}");
            if !delivered {
                let error = outcome[0].3.clone().unwrap_or_default();
                assert!(error.contains("loopback") && error.contains("CLAWMUX_WEBHOOK_ALLOW"), "{error}");
            }
        }
        assert_eq!(seen.lock().expect("log").as_slice(), ["/by-name"], "posted to only once listed");
    }

    fn item(id: i64, key: &str) -> OutboxItem {
        OutboxItem { id, run_id: format!("r{id}"), url: "https://h/x".into(), key_id: Some(key.into()), body: "{}".into(), attempts: 0, created_at_ms: 1 }
    }

    /// The slots: a lone busy key takes them all; keys whose receivers never answer hold them all
    /// only until one frees, which goes to a key with nothing under way, ahead of their backlog.
    #[test]
    fn slots_are_shared_across_keys() {
        let ids = |v: &[OutboxItem]| v.iter().map(|d| d.id).collect::<Vec<_>>();
        // One key alone: every slot.
        let mut s = Slots::default();
        let mut due: std::collections::VecDeque<OutboxItem> = (1..=20).map(|i| item(i, "a")).collect();
        assert_eq!(ids(&s.pick(&mut due)), (1..=16).collect::<Vec<_>>());
        assert_eq!(ids(&due.iter().cloned().collect::<Vec<_>>()), (17..=20).collect::<Vec<_>>());
        // Four keys whose receivers never answer hold the 16 slots; a fifth key's delivery (first
        // in the next round-robin list) takes the first slot freed, ahead of their backlog.
        let mut s = Slots::default();
        let mut due: std::collections::VecDeque<OutboxItem> = (0..8).flat_map(|n| ["a", "b", "c", "d"].map(|k| item(100 * n + i64::from(k.as_bytes()[0]), k))).collect();
        assert_eq!(s.pick(&mut due).len(), 16);
        assert!(s.pick(&mut due).is_empty(), "no slot free");
        s.done(100 + i64::from(b'a'), &Some("a".into()));
        let mut next: std::collections::VecDeque<OutboxItem> = [item(500 + i64::from(b'a'), "a"), item(7, "e"), item(600 + i64::from(b'a'), "a")].into();
        assert_eq!(ids(&s.pick(&mut next)), [7], "the waiting key's delivery, not the busy key's backlog");
        // A delivery under way is not started twice.
        let mut again: std::collections::VecDeque<OutboxItem> = [item(7, "e")].into();
        s.done(101, &Some("b".into()));
        assert!(s.pick(&mut again).is_empty());
    }

    #[test]
    fn backoff_grows_and_is_bounded() {
        assert_eq!(backoff(0), Duration::from_secs(1));
        assert_eq!(backoff(3), Duration::from_secs(8));
        assert_eq!(backoff(40), Duration::from_secs(300));
    }
}

/// Fuzz targets of the webhook boundary: the operator's allow-list and a tenant's URL are both
/// input (clawmux must not panic on any), and the address filter's invariant holds for any DNS
/// answer.
#[cfg(test)]
mod fuzz {
    use super::super::receiver_dns::{is_guarded, usable};
    use super::Allow;
    use proptest::prelude::*;
    use std::net::{IpAddr, SocketAddr};

    fn ip() -> impl Strategy<Value = IpAddr> {
        prop_oneof![
            any::<[u8; 4]>().prop_map(IpAddr::from),
            any::<[u8; 16]>().prop_map(IpAddr::from),
            // The interesting ones, often.
            prop::sample::select(vec!["127.0.0.1", "::1", "169.254.169.254", "fd00:ec2::254", "100.100.100.200", "0.0.0.0", "::ffff:127.0.0.1", "10.0.0.5", "fe80::1"])
                .prop_map(|s| s.parse().expect("ip")),
        ]
    }

    /// An entry as an operator might write it, well or badly.
    fn entry() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z0-9.*:\\[\\]-]{0,24}",
            (ip(), prop::option::of(any::<u16>())).prop_map(|(ip, port)| match (ip, port) {
                (IpAddr::V6(v6), Some(p)) => format!("[{v6}]:{p}"),
                (IpAddr::V6(v6), None) => format!("[{v6}]"),
                (v4, Some(p)) => format!("{v4}:{p}"),
                (v4, None) => v4.to_string(),
            }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

        /// Any list and any URL: an answer, never a panic; a list that starts is one whose every
        /// address entry opens exactly the port it names (or every port when it names none).
        #[test]
        fn any_list_and_url_is_answered_and_an_accepted_entry_opens_its_port_only(
            entries in prop::collection::vec(entry(), 0..4),
            url in "[a-z:/.\\[\\]0-9@-]{0,40}",
            port in 1u16..,
        ) {
            let list = entries.join(",");
            let allow = Allow::parse(&list);
            let _ = allow.check(&url);
            let problem = Allow::problem(&list);
            if problem.is_none() {
                for (ip, listed) in allow.addresses() {
                    let host = match ip { IpAddr::V6(v6) => format!("[{v6}]"), v4 => v4.to_string() };
                    let allowed = allow.check(&format!("http://{host}:{port}/hook")).is_ok();
                    if listed.is_none_or(|p| p == port) {
                        prop_assert!(allowed, "{list}: {host}:{port} refused");
                    }
                    if let Some(p) = listed {
                        // Another entry may open the port; this one alone does not.
                        if p != port && !allow.addresses().iter().any(|(i, q)| *i == ip && q.is_none_or(|q| q == port)) {
                            prop_assert!(!allowed, "{list}: {host}:{port} allowed by {host}:{p}");
                        }
                    }
                }
            }
        }

        /// Whatever a name resolves to: a guarded address gets through only when the list names
        /// it (with the port, or with none), and an unguarded one always does.
        #[test]
        fn a_guarded_address_is_used_only_when_listed(
            resolved in prop::collection::vec((ip(), any::<u16>()), 0..6),
            listed in prop::collection::vec((ip(), prop::option::of(any::<u16>())), 0..4),
            port in any::<u16>(),
        ) {
            let resolved: Vec<SocketAddr> = resolved.into_iter().map(|(ip, p)| SocketAddr::new(ip, p)).collect();
            let kept = usable(&resolved, port, &listed);
            for a in &resolved {
                let named = listed.iter().any(|(ip, p)| *ip == a.ip() && p.is_none_or(|p| p == port));
                prop_assert_eq!(kept.contains(a), !is_guarded(a.ip()) || named, "{}", a);
            }
            prop_assert!(kept.iter().all(|a| resolved.contains(a)));
        }
    }
}
