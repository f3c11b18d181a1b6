//! Tenants end to end: clawmux as a child process (its log is read; it is killed with `kill -9`
//! and started again on the same store) in front of the replay gateway and, through its LLM proxy,
//! the project's fake LLM (which reports usage).
//!
//! - API keys: each key lists, reads, re-attaches to and aborts only its accounts' runs (another
//!   tenant's run is `404`, like one that does not exist); a read-only key cannot start or abort
//!   (`403`); a key revoked with the CLI is refused at once, also when re-attaching an open
//!   stream; the store holds only the secret's hash, and no secret reaches the log.
//! - Budgets: the proxy refuses the first call that would start after the cap (the run ends
//!   `budget_exceeded`, billed exactly for the calls it made), admission answers `402` with
//!   `Retry-After`, another account goes on, and the spend survives a `kill -9`; without the proxy
//!   nothing counts tokens, so a budgeted account's runs are refused (`503 budget_unavailable`).
//! - Rate and concurrency limits: exact counts of `429` under a burst of 200 `POST`s per account.
//! - `ifBusy`: `reject` is `409 session_busy` at once; `interrupt` ends the running run `aborted`,
//!   cuts its LLM stream, and the new run runs.
//! - Webhooks: retried until accepted (across a `kill -9`), accepted exactly once, signed as the
//!   README says to verify; a URL outside `CLAWMUX_WEBHOOK_ALLOW` is `400` and never contacted; a
//!   redirect is not followed.
//!
//! Each test also runs on PostgreSQL as `pg_<name>` (a database of its own on the server
//! `CLAWMUX_TEST_PG_URL` names; skipped without it unless `CLAWMUX_REQUIRE_PG=1`).

#![allow(clippy::unwrap_used)]

mod common;
#[path = "common/child.rs"]
mod child;

use child::Clawmux;
use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway, ReplayHandle};
use common::{chat_body, new_traceparent, on_sqlite_and_postgres, temp_dir, FakeLlm, SseReader};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

const GW_TOKEN: &str = "tenants-gw-token";
/// `CLAWMUX_API_TOKEN`: the admin.
const ADMIN: &str = "tenants-admin-token-0d5e2c";
/// Budget windows are aligned to the epoch: one of ~31 years has no boundary during a test.
const PERIOD_SEC: u64 = 1_000_000_000;

/// The replay gateway, the fake LLM and clawmux (a child process, with its LLM proxy).
struct Env {
    /// `CLAWMUX_STORE_URL` of the process (and of the CLI run on its store).
    store_url: String,
    gw: ReplayHandle,
    llm: FakeLlm,
    cm: Clawmux,
    http: reqwest::Client,
    /// The LLM proxy's base URL (the same port across restarts).
    proxy: String,
}

/// An API key as created.
struct Key {
    token: String,
    id: String,
    webhook_secret: String,
}

impl Key {
    /// The secret part of `cmx_<id>_<secret>`.
    fn secret(&self) -> &str {
        self.token.rsplit('_').next().unwrap()
    }
}

impl Env {
    /// clawmux on a store of `kind` (`sqlite`: a file in its directory; `postgres`: a database of
    /// its own on the test server).
    async fn start(kind: &str, extra: &[(&str, &str)]) -> Self {
        let dir = temp_dir("tenants");
        let llm = FakeLlm::start(&dir.join("llm"));
        let cassette = Cassette::bundled().unwrap();
        let gw = ReplayGateway::start("127.0.0.1:0".parse().unwrap(), ReplayConfig::new(cassette).speed(0.0).token(GW_TOKEN)).unwrap();
        let listen = format!("127.0.0.1:{}", child::free_port());
        let (upstream, audit) = (llm.url(), dir.join("audit").display().to_string());
        let mut env = vec![
            ("CLAWMUX_DEVICE_IDENTITY", "off"),
            ("CLAWMUX_API_TOKEN", ADMIN),
            ("CLAWMUX_LLM_UPSTREAM_URL", upstream.as_str()),
            ("CLAWMUX_PROXY_LISTEN", listen.as_str()),
            ("CLAWMUX_AUDIT_DIR", audit.as_str()),
        ];
        env.extend_from_slice(extra);
        let pg_url = match kind {
            "postgres" => {
                let server = std::env::var("CLAWMUX_TEST_PG_URL").expect("CLAWMUX_TEST_PG_URL");
                Some(clawmux::store::postgres::create_test_database(&server, "cmx_tenants").await.unwrap())
            }
            _ => None,
        };
        if let Some(u) = &pg_url {
            env.push(("CLAWMUX_STORE_URL", u.as_str()));
        }
        let mut cm = Clawmux::new(&gw.url(), GW_TOKEN, &env);
        let store_url = pg_url.clone().unwrap_or_else(|| format!("sqlite://{}", cm.dir.join("runs.db").display()));
        let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
        cm.start(&http).await;
        Self { store_url, gw, llm, cm, http, proxy: format!("http://{listen}") }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.cm.base)
    }

    /// A request as `token`; returns the status and the JSON body (`Null` when there is none).
    async fn call(&self, method: reqwest::Method, token: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        let mut r = self.http.request(method, self.url(path)).bearer_auth(token);
        if let Some(b) = body {
            r = r.json(b);
        }
        let resp = r.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    async fn get(&self, token: &str, path: &str) -> (u16, Value) {
        self.call(reqwest::Method::GET, token, path, None).await
    }

    async fn create_key(&self, name: &str, accounts: &[&str], actions: &[&str]) -> Key {
        let body = json!({"name": name, "accounts": accounts, "actions": actions});
        let (status, k) = self.call(reqwest::Method::POST, ADMIN, "/v1/admin/keys", Some(&body)).await;
        assert_eq!(status, 201, "{k}");
        Key { token: k["key"].as_str().unwrap().to_owned(), id: k["id"].as_str().unwrap().to_owned(), webhook_secret: k["webhookSecret"].as_str().unwrap().to_owned() }
    }

    async fn set_limits(&self, account: &str, limits: Value) {
        let (status, body) = self.call(reqwest::Method::PUT, ADMIN, &format!("/v1/admin/accounts/{account}/limits"), Some(&limits)).await;
        assert_eq!(status, 200, "{body}");
    }

    /// `POST /v1/runs?wait=false` as `token`, with a traceparent when given.
    async fn post_run(&self, token: &str, body: &Value, traceparent: Option<&str>) -> reqwest::Response {
        let mut r = self.http.post(self.url("/v1/runs?wait=false")).bearer_auth(token).json(body);
        if let Some(tp) = traceparent {
            r = r.header("traceparent", tp);
        }
        r.send().await.unwrap()
    }

    /// Posts a run that must be admitted (`202`).
    async fn start_run(&self, token: &str, body: &Value, traceparent: Option<&str>) {
        let r = self.post_run(token, body, traceparent).await;
        assert_eq!(r.status(), 202, "{body}: {:?}", r.text().await);
    }

    /// The run's document (as the admin) once `pred` holds, polled (bounded).
    async fn doc_when(&self, run_id: &str, within: Duration, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + within;
        loop {
            let (status, doc) = self.get(ADMIN, &format!("/v1/runs/{run_id}")).await;
            if status == 200 && pred(&doc) {
                return doc;
            }
            assert!(Instant::now() < deadline, "run {run_id} did not get there within {within:?}: {status} {doc}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The run's document once its terminal event is stored.
    async fn finished(&self, run_id: &str) -> Value {
        self.doc_when(run_id, Duration::from_secs(20), |d| !d["finishedAt"].is_null()).await
    }

    /// Waits until the gateway acknowledged the run (it holds its session key).
    async fn accepted(&self, run_id: &str) {
        self.doc_when(run_id, Duration::from_secs(10), |d| !d["gatewayRunId"].is_null()).await;
    }

    /// An LLM call through the proxy on behalf of the run of `trace_id` (as the gateway makes it:
    /// the run's trace id, a span of its own).
    async fn llm_call(&self, trace_id: &str, text: &str) -> reqwest::Response {
        let span = &uuid::Uuid::new_v4().simple().to_string()[..16];
        self.http
            .post(format!("{}/v1/chat/completions", self.proxy))
            .header("traceparent", format!("00-{trace_id}-{span}-01"))
            .json(&chat_body(text, true))
            .send()
            .await
            .unwrap()
    }

    /// Tokens (prompt + completion) the fake LLM reported for the call whose message held `marker`.
    fn llm_usage_of(&self, marker: &str) -> u64 {
        let entries = self.llm.entries();
        let ids: Vec<&str> = entries.iter().filter(|e| e["last_user"].as_str().is_some_and(|u| u.contains(marker))).filter_map(|e| e["id"].as_str()).collect();
        assert_eq!(ids.len(), 1, "one upstream call carries {marker}");
        entries
            .iter()
            .filter(|e| e["event"] == "usage" && e["id"].as_str() == Some(ids[0]))
            .map(|e| e["prompt_tokens"].as_u64().unwrap() + e["completion_tokens"].as_u64().unwrap())
            .sum()
    }
}

/// `clawmux keys …` on the store of `env` (another process, as an operator runs it).
fn cli(env: &Env, args: &[&str]) -> String {
    let cm = &env.cm;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_clawmux"))
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", &cm.dir)
        .env("CLAWMUX_STORE_URL", &env.store_url)
        .output()
        .unwrap();
    assert!(out.status.success(), "clawmux {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

on_sqlite_and_postgres! {
    keys_see_only_their_accounts_runs_revocation_is_immediate_and_secrets_are_neither_stored_nor_logged, pg_keys_see_only_their_accounts_runs_revocation_is_immediate_and_secrets_are_neither_stored_nor_logged: case_keys_see_only_their_accounts_runs_revocation_is_immediate_and_secrets_are_neither_stored_nor_logged;
    a_token_budget_ends_the_run_at_the_first_call_past_the_cap_refuses_the_next_post_and_survives_a_restart, pg_a_token_budget_ends_the_run_at_the_first_call_past_the_cap_refuses_the_next_post_and_survives_a_restart: case_a_token_budget_ends_the_run_at_the_first_call_past_the_cap_refuses_the_next_post_and_survives_a_restart;
    without_the_llm_proxy_a_token_budget_refuses_its_accounts_runs, pg_without_the_llm_proxy_a_token_budget_refuses_its_accounts_runs: case_without_the_llm_proxy_a_token_budget_refuses_its_accounts_runs;
    a_scoped_admin_key_administers_its_own_accounts_only, pg_a_scoped_admin_key_administers_its_own_accounts_only: case_a_scoped_admin_key_administers_its_own_accounts_only;
    rate_and_concurrency_limits_are_counted_exactly_under_a_burst_of_200_posts_each, pg_rate_and_concurrency_limits_are_counted_exactly_under_a_burst_of_200_posts_each: case_rate_and_concurrency_limits_are_counted_exactly_under_a_burst_of_200_posts_each;
    if_busy_reject_refuses_at_once_and_interrupt_aborts_the_running_run_cutting_its_llm_stream, pg_if_busy_reject_refuses_at_once_and_interrupt_aborts_the_running_run_cutting_its_llm_stream: case_if_busy_reject_refuses_at_once_and_interrupt_aborts_the_running_run_cutting_its_llm_stream;
    webhooks_are_retried_across_a_restart_accepted_once_signed_allow_listed_and_never_redirected, pg_webhooks_are_retried_across_a_restart_accepted_once_signed_allow_listed_and_never_redirected: case_webhooks_are_retried_across_a_restart_accepted_once_signed_allow_listed_and_never_redirected;
}

/// Everything the store holds, as text: the SQLite files, or the rows of the database's keys and
/// runs.
async fn store_contents(env: &Env) -> String {
    if env.store_url.starts_with("postgres") {
        let pool = sqlx::PgPool::connect(&env.store_url).await.unwrap();
        let mut rows: Vec<(String,)> = sqlx::query_as("SELECT row_to_json(k)::text FROM api_keys k").fetch_all(&pool).await.unwrap();
        rows.extend(sqlx::query_as::<_, (String,)>("SELECT row_to_json(r)::text FROM runs r").fetch_all(&pool).await.unwrap());
        pool.close().await;
        return rows.into_iter().map(|(r,)| r).collect::<Vec<_>>().join("\n");
    }
    let mut store = Vec::new();
    for f in std::fs::read_dir(&env.cm.dir).unwrap() {
        let f = f.unwrap();
        if f.file_name().to_string_lossy().starts_with("runs.db") {
            store.extend(std::fs::read(f.path()).unwrap());
        }
    }
    String::from_utf8_lossy(&store).into_owned()
}

fn run_body(run_id: &str, account: &str) -> Value {
    json!({"message": format!("{run_id} says hello"), "billingAccountId": account, "runId": run_id, "onDisconnect": "continue"})
}

fn run_ids(list: &Value) -> Vec<String> {
    let mut ids: Vec<String> = list["runs"].as_array().unwrap().iter().map(|r| r["runId"].as_str().unwrap().to_owned()).collect();
    ids.sort();
    ids
}

async fn case_keys_see_only_their_accounts_runs_revocation_is_immediate_and_secrets_are_neither_stored_nor_logged(kind: &str) {
    // Debug logging: nothing clawmux (or a library under it) logs may carry a secret.
    let env = Env::start(kind, &[("CLAWMUX_LOG", "debug")]).await;
    env.gw.set_paused(true); // runs stay live until the end
    let a = env.create_key("team-a", &["acct-a"], &["run", "read", "abort"]).await;
    let ro = env.create_key("auditor-a", &["acct-a"], &["read"]).await;
    // Key b comes from the CLI, on the store of the running clawmux.
    let out = cli(&env, &["keys", "create", "--name", "team-b", "--accounts", "acct-b"]);
    let field = |name: &str| out.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_owned()).unwrap_or_else(|| panic!("{name} in {out}"));
    let b = Key { token: field("key:"), id: field("id:"), webhook_secret: field("webhook secret:") };

    env.start_run(&a.token, &run_body("run-of-a", "acct-a"), None).await;
    env.start_run(&b.token, &run_body("run-of-b", "acct-b"), None).await;
    env.accepted("run-of-a").await;
    env.accepted("run-of-b").await;
    let r = env.post_run(&a.token, &run_body("a-for-b", "acct-b"), None).await;
    assert_eq!(r.status(), 403, "a key starts runs only for its accounts");

    // Listing: each key its own accounts' runs; the admin all.
    assert_eq!(run_ids(&env.get(&a.token, "/v1/runs").await.1), ["run-of-a"]);
    assert_eq!(run_ids(&env.get(&b.token, "/v1/runs").await.1), ["run-of-b"]);
    assert_eq!(run_ids(&env.get(&ro.token, "/v1/runs").await.1), ["run-of-a"]);
    assert_eq!(run_ids(&env.get(&a.token, "/v1/runs?billingAccountId=acct-b").await.1), Vec::<String>::new());
    assert_eq!(run_ids(&env.get(ADMIN, "/v1/runs").await.1), ["run-of-a", "run-of-b"]);

    // Another tenant's run is answered exactly like a run that does not exist.
    let absent = env.get(&a.token, "/v1/runs/no-such-run").await;
    assert_eq!(absent.0, 404);
    for (key, other) in [(&a, "run-of-b"), (&b, "run-of-a"), (&ro, "run-of-b")] {
        let (status, body) = env.get(&key.token, &format!("/v1/runs/{other}")).await;
        assert_eq!((status, &body["error"]["code"]), (404, &absent.1["error"]["code"]), "{other}: {body}");
        let events = env.http.get(env.url(&format!("/v1/runs/{other}/events"))).bearer_auth(&key.token).header("accept", "text/event-stream").send().await.unwrap();
        assert_eq!(events.status(), 404, "re-attaching to {other}");
    }
    for (key, other) in [(&a, "run-of-b"), (&b, "run-of-a")] {
        let (status, body) = env.call(reqwest::Method::POST, &key.token, &format!("/v1/runs/{other}/abort"), None).await;
        assert_eq!((status, body["error"]["code"].as_str()), (404, Some("not_found")), "aborting {other}");
    }

    // Its own runs: read and re-attach.
    assert_eq!(env.get(&a.token, "/v1/runs/run-of-a").await.0, 200);
    assert_eq!(env.get(&ro.token, "/v1/runs/run-of-a").await.0, 200);
    let mut stream_a = SseReader::new(env.http.get(env.url("/v1/runs/run-of-a/events")).bearer_auth(&a.token).header("accept", "text/event-stream").send().await.unwrap());
    assert!(stream_a.until(Duration::from_secs(10), |e| e.event == "accepted").await.is_some());

    // Actions: a read-only key may neither start nor abort.
    let r = env.post_run(&ro.token, &run_body("run-of-ro", "acct-a"), None).await;
    assert_eq!(r.status(), 403);
    assert_eq!(env.get(ADMIN, "/v1/runs/run-of-ro").await.0, 404, "a refused run is not stored");
    let (status, _) = env.call(reqwest::Method::POST, &ro.token, "/v1/runs/run-of-a/abort", None).await;
    assert_eq!(status, 403);
    assert_eq!(env.get(&ro.token, "/v1/admin/keys").await.0, 403, "the admin action is the admin's");
    for run in ["run-of-a", "run-of-b"] {
        assert!(env.get(ADMIN, &format!("/v1/runs/{run}")).await.1["finishedAt"].is_null(), "{run} was ended by a refused abort");
    }

    // Revoked with the CLI while it has an open stream: its next request, and its re-attach, are refused.
    let mut stream_b = SseReader::new(env.http.get(env.url("/v1/runs/run-of-b/events")).bearer_auth(&b.token).header("accept", "text/event-stream").send().await.unwrap());
    let seen = stream_b.until(Duration::from_secs(10), |e| e.event == "accepted").await.expect("b's stream is open");
    assert!(cli(&env, &["keys", "revoke", &b.id]).contains("revoked"));
    let reattach = env.http.get(env.url("/v1/runs/run-of-b/events")).bearer_auth(&b.token).header("last-event-id", seen.id.to_string()).header("accept", "text/event-stream").send().await.unwrap();
    assert_eq!(reattach.status(), 401, "re-attaching with a revoked key");
    assert_eq!(env.get(&b.token, "/v1/runs/run-of-b").await.0, 401);
    assert_eq!(env.get(&b.token, "/v1/runs").await.0, 401);
    assert_eq!(env.post_run(&b.token, &run_body("b-after-revoke", "acct-b"), None).await.status(), 401);
    assert_eq!(env.get(&a.token, "/v1/runs/run-of-a").await.0, 200, "other keys go on");

    // A key aborts its own run.
    let (status, body) = env.call(reqwest::Method::POST, &a.token, "/v1/runs/run-of-a/abort", None).await;
    assert_eq!((status, &body["aborted"]), (202, &json!(true)));
    assert_eq!(env.finished("run-of-a").await["status"], "aborted");
    assert_eq!(stream_a.terminal(Duration::from_secs(10)).await.expect("a's stream ends").event, "error");
    env.gw.set_paused(false);
    assert_eq!(env.finished("run-of-b").await["status"], "ok");

    // The store keeps each key's hash, never its secret; the log names keys by id only.
    let store = store_contents(&env).await;
    let log = env.cm.log();
    assert!(log.contains("DEBUG"), "clawmux logged at debug level");
    for k in [&a, &ro, &b] {
        let hash = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(k.secret().as_bytes()));
        assert!(!store.contains(k.secret()), "key {}'s secret is in the store", k.id);
        assert!(store.contains(&k.id) && store.contains(&hash), "key {} is stored (by id, with its hash)", k.id);
        for secret in [k.secret(), k.webhook_secret.as_str()] {
            assert!(!log.contains(secret), "a secret of key {} is in clawmux's log", k.id);
        }
    }
    for k in [&a, &ro] {
        assert!(log.contains(&k.id), "the log names key {} by its id (it is the log we think)", k.id);
    }
    assert!(!log.contains(ADMIN), "the admin token is in clawmux's log");
}

/// A key with the `admin` action scoped to some accounts administers those only: it creates no
/// key wider than itself (another account, `*`, an action it lacks), lists and revokes only keys
/// of its accounts (another tenant's key is `404`, as if it did not exist), and reads only its
/// accounts' limits (`403`) and sets none (limits are the operator's: the admin token's or a `*`
/// admin key's). Before, `admin` alone was checked: such a key could make a
/// `*` key and with it read and abort every tenant's runs, revoke their keys and set their budgets
/// to zero.
async fn case_a_scoped_admin_key_administers_its_own_accounts_only(kind: &str) {
    let env = Env::start(kind, &[]).await;
    let boss_a = env.create_key("boss-a", &["acct-a"], &["admin", "read", "run"]).await;
    let b = env.create_key("team-b", &["acct-b"], &["run", "read"]).await;
    let post = |accounts: Value, actions: Value| json!({"name": "made", "accounts": accounts, "actions": actions});
    for (accounts, actions) in [
        (json!(["*"]), json!(["read"])),
        (json!(["acct-b"]), json!(["read"])),
        (json!(["acct-a", "acct-b"]), json!(["read"])),
        (json!(["acct-a"]), json!(["abort"])),
    ] {
        let (status, body) = env.call(reqwest::Method::POST, &boss_a.token, "/v1/admin/keys", Some(&post(accounts.clone(), actions.clone()))).await;
        assert_eq!((status, body["error"]["code"].as_str()), (403, Some("forbidden")), "{accounts} {actions}: {body}");
    }
    let (status, made) = env.call(reqwest::Method::POST, &boss_a.token, "/v1/admin/keys", Some(&post(json!(["acct-a"]), json!(["read"])))).await;
    assert_eq!(status, 201, "{made}");
    // Listing: its own accounts' keys (itself and the one it made), not team-b's; the admin all.
    let ids = |v: &Value| {
        let mut ids: Vec<String> = v["keys"].as_array().unwrap().iter().map(|k| k["id"].as_str().unwrap().to_owned()).collect();
        ids.sort();
        ids
    };
    let mut own = vec![boss_a.id.clone(), made["id"].as_str().unwrap().to_owned()];
    own.sort();
    assert_eq!(ids(&env.get(&boss_a.token, "/v1/admin/keys").await.1), own);
    assert_eq!(ids(&env.get(ADMIN, "/v1/admin/keys").await.1).len(), 3);
    // Revoking another tenant's key: as if it did not exist; the key still works.
    let (status, body) = env.call(reqwest::Method::POST, &boss_a.token, &format!("/v1/admin/keys/{}/revoke", b.id), None).await;
    assert_eq!((status, body["error"]["code"].as_str()), (404, Some("not_found")), "{body}");
    assert_eq!(env.get(&b.token, "/v1/runs").await.0, 200, "team-b's key was revoked by another tenant");
    let (status, _) = env.call(reqwest::Method::POST, &boss_a.token, &format!("/v1/admin/keys/{}/revoke", made["id"].as_str().unwrap()), None).await;
    assert_eq!(status, 200, "its own account's key");
    // Revoking the scoped admin key revokes what it made (and what those made), not other keys.
    let (status, second) = env.call(reqwest::Method::POST, &boss_a.token, "/v1/admin/keys", Some(&post(json!(["acct-a"]), json!(["read", "admin"])))).await;
    assert_eq!(status, 201, "{second}");
    let second_token = second["key"].as_str().unwrap().to_owned();
    let (status, third) = env.call(reqwest::Method::POST, &second_token, "/v1/admin/keys", Some(&post(json!(["acct-a"]), json!(["read"])))).await;
    assert_eq!(status, 201, "{third}");
    assert_eq!(env.get(third["key"].as_str().unwrap(), "/v1/runs").await.0, 200);
    let (status, _) = env.call(reqwest::Method::POST, ADMIN, &format!("/v1/admin/keys/{}/revoke", boss_a.id), None).await;
    assert_eq!(status, 200);
    for (token, what) in [(boss_a.token.as_str(), "the revoked key"), (second_token.as_str(), "a key it made"), (third["key"].as_str().unwrap(), "a key made by a key it made")] {
        assert_eq!(env.get(token, "/v1/runs").await.0, 401, "{what} still works");
    }
    assert_eq!(env.get(&b.token, "/v1/runs").await.0, 200, "another key was revoked with it");
    let listed = env.get(ADMIN, "/v1/admin/keys").await.1;
    let third_listed = listed["keys"].as_array().unwrap().iter().find(|k| k["id"] == third["id"]).expect("listed");
    assert_eq!(third_listed["createdBy"], second["id"], "{listed}");
    let long_url = json!({"name": "long", "accounts": ["acct-a"], "actions": ["read"], "webhookUrl": format!("https://hooks.example.com/{}", "x".repeat(3000))});
    let (status, body) = env.call(reqwest::Method::POST, ADMIN, "/v1/admin/keys", Some(&long_url)).await;
    assert_eq!((status, body["error"]["message"].as_str().is_some_and(|m| m.contains("webhookUrl"))), (400, true), "{body}");
    let boss_a = env.create_key("boss-a2", &["acct-a"], &["admin", "read", "run"]).await;
    // Limits: its accounts only.
    let cap = json!({"maxTokens": 0, "periodSec": PERIOD_SEC});
    let (status, body) = env.call(reqwest::Method::PUT, &boss_a.token, "/v1/admin/accounts/acct-b/limits", Some(&cap)).await;
    assert_eq!((status, body["error"]["code"].as_str()), (403, Some("forbidden")), "{body}");
    assert_eq!(env.get(&boss_a.token, "/v1/admin/accounts/acct-b/limits").await.0, 403);
    assert!(env.get(ADMIN, "/v1/admin/accounts/acct-b/limits").await.1["limits"]["maxTokens"].is_null(), "acct-b's budget was set by another tenant");
    // Its own account's limits: read, not set (the operator's; it could lift its own budget).
    env.set_limits("acct-a", json!({"maxConcurrent": 5})).await;
    let (status, body) = env.call(reqwest::Method::PUT, &boss_a.token, "/v1/admin/accounts/acct-a/limits", Some(&json!({}))).await;
    assert_eq!((status, body["error"]["code"].as_str()), (403, Some("forbidden")), "{body}");
    let (status, body) = env.get(&boss_a.token, "/v1/admin/accounts/acct-a/limits").await;
    assert_eq!((status, &body["limits"]["maxConcurrent"]), (200, &json!(5)), "{body}");
}

async fn case_a_token_budget_ends_the_run_at_the_first_call_past_the_cap_refuses_the_next_post_and_survives_a_restart(kind: &str) {
    let mut env = Env::start(kind, &[]).await;
    env.gw.set_paused(true);
    // Each call below is 18 tokens (fake LLM: 40 characters / 4 in, 8 words out): the second
    // call crosses the cap, the third would start past it.
    const CAP: u64 = 25;
    env.set_limits("acct-capped", json!({"maxTokens": CAP, "periodSec": PERIOD_SEC})).await;
    env.set_limits("acct-other", json!({"maxTokens": 1_000_000, "periodSec": PERIOD_SEC})).await;
    let (capped, tp) = new_traceparent();
    env.start_run(ADMIN, &run_body("run-capped", "acct-capped"), Some(&tp)).await;
    let (other, tp) = new_traceparent();
    env.start_run(ADMIN, &run_body("run-other", "acct-other"), Some(&tp)).await;
    env.accepted("run-capped").await;

    let mut used = 0;
    for marker in ["CAPCALL1", "CAPCALL2"] {
        let r = env.llm_call(&capped, &format!("{marker} budget test padding text..")).await;
        assert_eq!(r.status(), 200, "{marker} starts before the cap is reached");
        assert!(r.text().await.unwrap().contains("[DONE]"), "{marker} streams to its end");
        let before = used;
        used += env.llm_usage_of(marker);
        assert!(before < CAP, "{marker} started under the cap ({before} < {CAP})");
    }
    assert!(used >= CAP, "the test's calls cross the cap: {used}");
    let r = env.llm_call(&capped, "CAPCALL3 budget test padding text..").await;
    assert_eq!(r.status(), 409, "the first call past the cap is refused");
    assert!(!env.llm.entries().iter().any(|e| e["last_user"].as_str().is_some_and(|u| u.contains("CAPCALL3"))), "a refused call reached the upstream");
    let doc = env.finished("run-capped").await;
    assert_eq!((doc["status"].as_str(), doc["error"]["code"].as_str()), (Some("error"), Some("budget_exceeded")), "{doc}");
    assert_eq!(doc["usage"]["llmCalls"], 2, "{doc}");
    assert_eq!(doc["usage"]["inputTokens"].as_u64().unwrap() + doc["usage"]["outputTokens"].as_u64().unwrap(), used, "billed exactly the calls it made: {doc}");
    let (_, limits) = env.get(ADMIN, "/v1/admin/accounts/acct-capped/limits").await;
    assert_eq!(limits["spentTokens"], used, "{limits}");

    // The account's next run is refused at admission, with when to retry.
    assert_capped(&env, "once the cap is reached").await;

    // Another account is unaffected.
    let r = env.llm_call(&other, "OTHERCALL1 budget test padding text").await;
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("[DONE]"));
    env.start_run(ADMIN, &run_body("run-other-2", "acct-other"), None).await;

    // kill -9 once the capped run's end is stored (its spend was queued for the store before).
    env.cm.kill_9();
    env.cm.start(&env.http).await;
    assert_capped(&env, "after a restart").await;
    let (_, limits) = env.get(ADMIN, "/v1/admin/accounts/acct-capped/limits").await;
    assert_eq!(limits["spentTokens"], used, "{limits}");
    let (other2, tp) = new_traceparent();
    env.start_run(ADMIN, &run_body("run-other-3", "acct-other"), Some(&tp)).await;
    env.accepted("run-other-3").await;
    assert_eq!(env.llm_call(&other2, "OTHERCALL2 after the restart").await.status(), 200);
    env.gw.set_paused(false);
    assert_eq!(env.finished("run-other-3").await["status"], "ok");
}

async fn case_without_the_llm_proxy_a_token_budget_refuses_its_accounts_runs(kind: &str) {
    // Nothing would count the tokens: fail-closed.
    let env = Env::start(kind, &[("CLAWMUX_LLM_UPSTREAM_URL", "")]).await;
    env.set_limits("acct-budgeted", json!({"maxTokens": 1_000_000, "periodSec": PERIOD_SEC})).await;
    env.set_limits("acct-limited", json!({"maxConcurrent": 5})).await;
    let r = env.post_run(ADMIN, &run_body("run-unmetered", "acct-budgeted"), None).await;
    assert_eq!(r.status(), 503);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "budget_unavailable", "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("CLAWMUX_LLM_UPSTREAM_URL"), "{body}");
    assert_eq!(env.get(ADMIN, "/v1/runs/run-unmetered").await.0, 404);
    // Limits that need no token count still admit.
    env.start_run(ADMIN, &run_body("run-limited", "acct-limited"), None).await;
    assert_eq!(env.finished("run-limited").await["status"], "ok");
}

/// Posts a run of `acct-capped`; returns the status, the error code and `Retry-After`.
async fn post_capped(env: &Env) -> (u16, String, Option<u64>) {
    let body = run_body(&format!("capped-{}", uuid::Uuid::new_v4().simple()), "acct-capped");
    let r = env.post_run(ADMIN, &body, None).await;
    let retry = r.headers().get("retry-after").and_then(|v| v.to_str().ok()?.parse().ok());
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    (status, body["error"]["code"].as_str().unwrap_or_default().to_owned(), retry)
}

/// The account's runs are refused at admission, with when to retry (the budget period's end).
async fn assert_capped(env: &Env, when: &str) {
    let (status, code, retry) = post_capped(env).await;
    assert_eq!((status, code.as_str()), (402, "budget_exceeded"), "{when}");
    assert!(retry.is_some_and(|r| r > 0), "Retry-After: {retry:?}");
}

async fn case_rate_and_concurrency_limits_are_counted_exactly_under_a_burst_of_200_posts_each(kind: &str) {
    let env = Env::start(kind, &[]).await;
    env.gw.set_paused(true); // admitted runs stay live: they count toward the concurrency cap
    env.set_limits("acct-rate", json!({"maxRunsPerMinute": 37})).await;
    env.set_limits("acct-conc", json!({"maxConcurrent": 23})).await;
    let posts: Vec<(String, String)> =
        (0..200).flat_map(|i| [("acct-rate".to_owned(), format!("rate-{i}")), ("acct-conc".to_owned(), format!("conc-{i}"))]).collect();
    let env = Arc::new(env);
    let answers: Vec<(String, u16, Option<String>, Value)> = futures_util::stream::iter(posts)
        .map(|(account, run_id)| {
            let env = env.clone();
            async move {
                let r = env.post_run(ADMIN, &run_body(&run_id, &account), None).await;
                let retry = r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned());
                let status = r.status().as_u16();
                (account, status, retry, r.json().await.unwrap_or(Value::Null))
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    for (account, admitted) in [("acct-rate", 37), ("acct-conc", 23)] {
        let mine: Vec<_> = answers.iter().filter(|a| a.0 == account).collect();
        let ok = mine.iter().filter(|a| a.1 == 202).count();
        let limited: Vec<_> = mine.iter().filter(|a| a.1 == 429).collect();
        assert_eq!((ok, limited.len()), (admitted, 200 - admitted), "{account}: {:?}", mine.iter().map(|a| a.1).collect::<Vec<_>>());
        for (_, _, retry, body) in limited {
            assert_eq!(body["error"]["code"], "rate_limited", "{body}");
            assert!(retry.as_deref().and_then(|r| r.parse::<u64>().ok()).is_some_and(|r| r >= 1), "Retry-After: {retry:?}");
        }
        // Refused runs left nothing behind.
        let (_, list) = env.get(ADMIN, &format!("/v1/runs?billingAccountId={account}&limit=500")).await;
        assert_eq!(list["runs"].as_array().unwrap().len(), admitted, "{account}");
    }

    // The concurrency cap frees as runs end; the per-minute count does not.
    env.gw.set_paused(false);
    for i in 0..200 {
        if answers.iter().any(|a| a.0 == "acct-conc" && a.3["runId"] == format!("conc-{i}")) {
            assert_eq!(env.finished(&format!("conc-{i}")).await["status"], "ok");
        }
    }
    env.start_run(ADMIN, &run_body("conc-after", "acct-conc"), None).await;
    assert_eq!(env.post_run(ADMIN, &run_body("rate-after", "acct-rate"), None).await.status(), 429);
}

async fn case_if_busy_reject_refuses_at_once_and_interrupt_aborts_the_running_run_cutting_its_llm_stream(kind: &str) {
    let env = Env::start(kind, &[]).await;
    env.gw.set_paused(true);
    let busy = |run_id: &str, if_busy: Option<&str>| {
        let mut b = json!({"message": format!("{run_id} in the conversation"), "billingAccountId": "acct-s", "stateKey": "conv-1", "runId": run_id});
        if let Some(p) = if_busy {
            b["ifBusy"] = json!(p);
        }
        b
    };
    let (trace, tp) = new_traceparent();
    env.start_run(ADMIN, &busy("run-first", None), Some(&tp)).await;
    env.accepted("run-first").await;

    // reject: 409 at once, nothing stored; another conversation is not busy.
    let r = env.post_run(ADMIN, &busy("run-rejected", Some("reject")), None).await;
    assert_eq!(r.status(), 409);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "session_busy");
    assert_eq!(env.get(ADMIN, "/v1/runs/run-rejected").await.0, 404);
    let mut elsewhere = busy("run-elsewhere", Some("reject"));
    elsewhere["stateKey"] = json!("conv-2");
    env.start_run(ADMIN, &elsewhere, None).await;

    // The first run has an LLM stream in flight (SLOW: 40 chunks, 1 s apart).
    let resp = env.llm_call(&trace, "INTERRUPTME SLOW").await;
    assert_eq!(resp.status(), 200);
    let mut llm_stream = resp.bytes_stream();
    let first = tokio::time::timeout(Duration::from_secs(10), llm_stream.next()).await.expect("a first chunk").expect("chunk").expect("bytes");
    assert!(String::from_utf8_lossy(&first).contains("data:"));

    // interrupt: the running run ends aborted, its LLM stream is cut, then the new run runs.
    let r = env.post_run(ADMIN, &busy("run-interrupting", Some("interrupt")), None).await;
    assert_eq!(r.status(), 202);
    let doc = env.finished("run-first").await;
    assert_eq!((doc["status"].as_str(), doc["error"]["code"].as_str()), (Some("aborted"), Some("aborted")), "{doc}");
    let cut_by = Instant::now() + Duration::from_secs(15);
    // Cut: the stream ends (broken off by the proxy) long before its 40 s, without `[DONE]`.
    while let Some(Ok(chunk)) = tokio::time::timeout_at(cut_by, llm_stream.next()).await.expect("the LLM stream is cut, not played to its end (40 s)") {
        assert!(!String::from_utf8_lossy(&chunk).contains("[DONE]"), "the stream ran to its end");
    }
    let upstream_end = loop {
        let end = env.llm.entries().into_iter().find(|e| e["event"] == "stream_end");
        if let Some(e) = end {
            break e;
        }
        assert!(Instant::now() < cut_by, "the upstream stream did not end");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(upstream_end["completed"], false, "the upstream stream was cut too: {upstream_end}");
    env.accepted("run-interrupting").await;
    env.gw.set_paused(false);
    assert_eq!(env.finished("run-interrupting").await["status"], "ok");
}

/// One request a [`Receiver`] got, and what it answered.
#[derive(Debug, Clone)]
struct Hit {
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    answered: u16,
}

impl Hit {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// A webhook receiver on 127.0.0.1: records every request and answers the `n`-th (from 0) as
/// `answer(n)` says (status, extra headers).
struct Receiver {
    addr: SocketAddr,
    hits: Arc<Mutex<Vec<Hit>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    async fn start(answer: impl Fn(usize) -> (u16, Vec<(String, String)>) + Send + Sync + 'static) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hits: Arc<Mutex<Vec<Hit>>> = Arc::default();
        let (h, answer) = (hits.clone(), Arc::new(answer));
        let task = tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                let (hits, answer) = (h.clone(), answer.clone());
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(Duration::from_secs(10), serve_one(sock, hits, answer)).await;
                });
            }
        });
        Self { addr, hits, task }
    }

    fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    fn hits(&self) -> Vec<Hit> {
        self.hits.lock().unwrap().clone()
    }

    async fn until(&self, within: Duration, pred: impl Fn(&[Hit]) -> bool) -> Vec<Hit> {
        let deadline = Instant::now() + within;
        loop {
            let hits = self.hits();
            if pred(&hits) {
                return hits;
            }
            assert!(Instant::now() < deadline, "the receiver did not get there within {within:?}: {} hits", hits.len());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads one HTTP/1.1 request (head, then `content-length` bytes), records it, answers, closes.
async fn serve_one(mut sock: tokio::net::TcpStream, hits: Arc<Mutex<Vec<Hit>>>, answer: Arc<impl Fn(usize) -> (u16, Vec<(String, String)>)>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
        match sock.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) if buf.len() + n <= 1 << 20 => buf.extend_from_slice(&chunk[..n]),
            Ok(_) => return,
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let headers: Vec<(String, String)> =
        head.lines().skip(1).filter_map(|l| l.split_once(':')).map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned())).collect();
    let len: usize = headers.iter().find(|(k, _)| k == "content-length").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
    while buf.len() < head_end + len {
        match sock.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let (status, extra) = {
        let mut hits = hits.lock().unwrap();
        let (status, extra) = answer(hits.len());
        hits.push(Hit { headers, body: buf[head_end..head_end + len].to_vec(), answered: status });
        (status, extra)
    };
    let mut resp = format!("HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n");
    for (k, v) in extra {
        resp.push_str(&format!("{k}: {v}\r\n"));
    }
    resp.push_str("\r\n");
    let _ = sock.write_all(resp.as_bytes()).await;
    let _ = sock.shutdown().await;
}

/// Checks a delivery with the README's own verification code (python), as a receiver would.
fn readme_verifies(secret: &str, signature: &str, body: &[u8]) -> bool {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let start = readme.find("Verify a delivery").expect("README: Verify a delivery");
    let code = &readme[start..];
    let code = &code[code.find("```python\n").expect("a python block") + "```python\n".len()..];
    let code = &code[..code.find("```").unwrap()];
    let script = format!("{code}\nimport sys\nprint(verify(sys.argv[1], sys.argv[2], sys.stdin.buffer.read()))\n");
    let mut child = std::process::Command::new("python3")
        .args(["-c", &script, secret, signature])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), body).unwrap();
    drop(child.stdin.take());
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the README's verification code runs");
    match String::from_utf8_lossy(&out.stdout).trim() {
        "True" => true,
        "False" => false,
        other => panic!("verify printed {other:?}"),
    }
}

async fn case_webhooks_are_retried_across_a_restart_accepted_once_signed_allow_listed_and_never_redirected(kind: &str) {
    let hook = Receiver::start(|n| (if n < 3 { 500 } else { 200 }, vec![])).await;
    let forbidden = Receiver::start(|_| (200, vec![])).await;
    let target = Receiver::start(|_| (200, vec![])).await;
    let to = target.url();
    let redirect = Receiver::start(move |_| (307, vec![("location".to_owned(), to.clone())])).await;
    let allow = format!("127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}", hook.addr.port(), redirect.addr.port(), target.addr.port());
    let mut env = Env::start(kind, &[("CLAWMUX_WEBHOOK_ALLOW", &allow)]).await;
    let key = env.create_key("hooks", &["acct-w"], &["run", "read"]).await;
    let with_hook = |run_id: &str, url: &str| {
        let mut b = run_body(run_id, "acct-w");
        b["webhook"] = json!({"url": url});
        b
    };

    // Outside the allow-list: 400 at POST time (also the allowed port under another host name).
    let localhost = format!("http://localhost:{}/hook", hook.addr.port());
    for url in [forbidden.url(), localhost] {
        let r = env.post_run(&key.token, &with_hook("run-forbidden", &url), None).await;
        assert_eq!(r.status(), 400, "{url}");
        let body: Value = r.json().await.unwrap();
        assert!(body["error"]["message"].as_str().unwrap().contains("CLAWMUX_WEBHOOK_ALLOW"), "{body}");
    }
    assert_eq!(env.get(ADMIN, "/v1/runs/run-forbidden").await.0, 404);

    env.start_run(&key.token, &with_hook("run-hooked", &hook.url()), None).await;
    env.start_run(&key.token, &with_hook("run-redirected", &redirect.url()), None).await;
    assert_eq!(env.finished("run-hooked").await["status"], "ok");

    // Two failed attempts, then clawmux is killed: the delivery waits in the store.
    hook.until(Duration::from_secs(20), |h| h.len() >= 2).await;
    env.cm.kill_9();
    env.cm.start(&env.http).await;
    let hits = hook.until(Duration::from_secs(30), |h| h.iter().any(|h| h.answered == 200)).await;
    // Accepted once: no attempt after it (the worker polls every 250 ms).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let hits_later = hook.hits();
    assert_eq!(hits_later.len(), hits.len(), "attempts after the accepted one");
    assert!(hits.len() >= 4, "3 failures, then the accepted one: {}", hits.len());
    assert_eq!(hits.iter().filter(|h| h.answered == 200).count(), 1);
    let delivery = hits[0].header("x-clawmux-delivery").expect("delivery id").to_owned();
    assert!(hits.iter().all(|h| h.header("x-clawmux-delivery") == Some(delivery.as_str())), "one delivery id across retries");
    let accepted = hits.last().unwrap();
    assert_eq!(accepted.answered, 200);
    assert_eq!(accepted.header("x-clawmux-run-id"), Some("run-hooked"));
    let doc: Value = serde_json::from_slice(&accepted.body).unwrap();
    assert_eq!((doc["runId"].as_str(), doc["status"].as_str()), (Some("run-hooked"), Some("ok")), "{doc}");
    let signature = accepted.header("x-clawmux-signature").expect("signed");
    assert!(readme_verifies(&key.webhook_secret, signature, &accepted.body), "the README's check accepts the delivery");
    let mut tampered = accepted.body.clone();
    tampered.extend_from_slice(b" ");
    assert!(!readme_verifies(&key.webhook_secret, signature, &tampered), "a changed body fails the check");
    assert!(!readme_verifies("whsec_not_the_secret", signature, &accepted.body), "another secret fails the check");

    // A redirect is a failed attempt, retried at the same URL, never followed.
    redirect.until(Duration::from_secs(20), |h| h.len() >= 2 || !target.hits().is_empty()).await;
    assert!(redirect.hits().iter().all(|h| h.header("x-clawmux-run-id") == Some("run-redirected")));
    assert!(target.hits().is_empty(), "a redirect was followed");
    assert!(forbidden.hits().is_empty(), "a URL outside the allow-list was contacted");
}

/// `clawmux demo` on a store that holds API keys (the user named it) says that requests need a
/// key, prints the curl with one, and starts no example run that would only get `401`. Before, it
/// printed a curl without credentials and "it lists the runs you start": every request was `401`
/// and nothing said why.
#[test]
fn the_demo_on_a_store_with_api_keys_says_requests_need_one() {
    use std::io::BufRead;
    let dir = temp_dir("demo-keys");
    let store_url = format!("sqlite://{}", dir.join("runs.db").display());
    let clawmux = |args: &[&str]| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_clawmux"));
        c.args(args)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", &dir)
            .env("CLAWMUX_DEVICE_IDENTITY", "off")
            .env("CLAWMUX_LISTEN", "127.0.0.1:0")
            .env("CLAWMUX_STORE_URL", &store_url);
        c
    };
    let demo_says = |what: &str| {
        let mut child = clawmux(&["demo"]).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::null()).spawn().expect("demo starts");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut said = Vec::new();
        while let Ok(line) = rx.recv_timeout(Duration::from_secs(60)) {
            let last = line.starts_with("  curl");
            said.push(line);
            if last {
                break;
            }
        }
        let _ = std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
        let _ = child.wait();
        assert!(said.last().is_some_and(|l| l.starts_with("  curl")), "{what}: the demo printed no curl: {said:?}");
        said.join("\n")
    };
    // Without keys: the loopback admin, an example run, a curl without credentials.
    let before = demo_says("no keys");
    assert!(before.contains("(one example run started)") && !before.contains("Authorization"), "{before}");
    assert!(!before.contains("holds API keys"), "{before}");
    let made = clawmux(&["keys", "create", "--name", "team-a", "--accounts", "demo-account"]).output().expect("keys create");
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let after = demo_says("a key");
    assert!(after.contains("holds API keys"), "{after}");
    assert!(after.contains("Authorization: Bearer $CLAWMUX_API_KEY"), "{after}");
    assert!(after.contains("(it lists the runs you start)") && !after.contains("example run started"), "{after}");
    let _ = std::fs::remove_dir_all(&dir);
}
