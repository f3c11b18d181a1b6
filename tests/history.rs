//! Run history over HTTP (`GET /v1/runs`) and retention, against the replay gateway (no recorded
//! delays): every filter, admission order, page sizes, bad parameters, a cursor walk while runs
//! keep arriving, API-key scoping, 10,000 stored runs paged through, and
//! `CLAWMUX_RUN_RETENTION_SEC` / `_MAX` enforced by the store (SQLite and `memory:`).
//!
//! Each test also runs on PostgreSQL as `pg_<name>` (a database of its own on the server
//! `CLAWMUX_TEST_PG_URL` names; skipped without it unless `CLAWMUX_REQUIRE_PG=1`).

#![allow(clippy::unwrap_used)]

mod common;

use clawmux::replay::{ReplayConfig, ReplayGateway, ReplayHandle, RunScript};
use clawmux::server::Running;
use clawmux::store::postgres::PgStore;
use clawmux::store::sqlite::SqliteStore;
use clawmux::store::{EventName, RunPatch, RunRow, SpecRecord, Store, StoredEvent, Write};
use common::*;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tokio::time::Instant;

const GW_TOKEN: &str = "history-gw-token";
const WAIT: Duration = Duration::from_secs(10);

/// A fresh store of `kind` (`sqlite`, `memory:`, `postgres`), as a `CLAWMUX_STORE_URL`.
async fn fresh_store(kind: &str) -> String {
    match kind {
        "sqlite" => format!("sqlite://{}", temp_dir("history").join("runs.db").display()),
        "postgres" => {
            let server = std::env::var("CLAWMUX_TEST_PG_URL").expect("CLAWMUX_TEST_PG_URL");
            clawmux::store::postgres::create_test_database(&server, "cmx_history").await.unwrap()
        }
        other => other.to_owned(),
    }
}

/// Each case as `name` (on SQLite; and `memory:` where it says so) and `pg_name` (PostgreSQL).
macro_rules! on_every_store {
    ($($case:ident: $test:ident, $pg:ident, [$($kind:literal),*]);* $(;)?) => { $(
        #[actix_rt::test]
        async fn $test() {
            $case(&[$($kind),*]).await;
        }

        #[actix_rt::test]
        async fn $pg() {
            if pg_available(stringify!($pg)) {
                $case(&["postgres"]).await;
            }
        }
    )* };
}

on_every_store! {
    filters_order_page_size_and_bad_parameters:
        history_filters_order_page_size_and_bad_parameters, pg_history_filters_order_page_size_and_bad_parameters, ["sqlite"];
    cursor_walk_is_stable_while_runs_keep_arriving:
        history_cursor_walk_is_stable_while_runs_keep_arriving, pg_history_cursor_walk_is_stable_while_runs_keep_arriving, ["sqlite"];
    an_api_key_lists_only_its_accounts_runs:
        history_an_api_key_lists_only_its_accounts_runs, pg_history_an_api_key_lists_only_its_accounts_runs, ["sqlite"];
    pages_through_10000_stored_runs:
        history_pages_through_10000_stored_runs, pg_history_pages_through_10000_stored_runs, ["sqlite"];
    retention_limits_are_enforced_by_the_store:
        history_retention_limits_are_enforced_by_the_store, pg_history_retention_limits_are_enforced_by_the_store, ["sqlite", "memory:"];
}

fn gateway() -> ReplayHandle {
    ReplayGateway::start("127.0.0.1:0".parse().unwrap(), ReplayConfig::default().speed(0.0).token(GW_TOKEN)).unwrap()
}

struct Env {
    gw: ReplayHandle,
    app: Running,
    base: String,
    http: reqwest::Client,
}

/// clawmux on `gw`; `env` is read as the process environment would be (the names of the
/// configuration table).
/// `CLAWMUX_API_TOKEN`.
const ADMIN: &str = "history-admin-token-3c9a";

async fn env_with(gw: ReplayHandle, env: &[(&str, &str)]) -> Env {
    let env: HashMap<String, String> = env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    let app = start_clawmux(&gw.url(), Some(GW_TOKEN), |cfg| {
        // A test that makes API keys goes on as the admin (a loopback client without credentials
        // is the admin only while no key exists).
        cfg.api_token = Some(clawmux::config::Secret::new(ADMIN));
        let from_env = clawmux::config::Config::load(None, &|k| env.get(k).cloned()).expect("config");
        cfg.run_retention_sec = from_env.run_retention_sec;
        cfg.run_retention_max = from_env.run_retention_max;
        if env.contains_key("CLAWMUX_STORE_URL") {
            cfg.store_url = from_env.store_url;
        }
    })
    .await;
    let base = base(&app);
    // Every request as the admin, unless it names a key of its own.
    let mut admin = reqwest::header::HeaderMap::new();
    admin.insert(reqwest::header::AUTHORIZATION, format!("Bearer {ADMIN}").parse().unwrap());
    let http = reqwest::Client::builder().pool_max_idle_per_host(64).default_headers(admin).build().unwrap();
    wait_ready(&http, &base, WAIT).await;
    Env { gw, app, base, http }
}

impl Env {
    async fn get(&self, path: &str, key: Option<&str>) -> (u16, Value) {
        let mut r = self.http.get(format!("{}{path}", self.base));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        let r = r.send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    /// `GET /v1/runs?{query}`: the run ids and the next cursor.
    async fn list(&self, query: &str, key: Option<&str>) -> (Vec<String>, Option<String>) {
        let (status, v) = self.get(&format!("/v1/runs?{query}"), key).await;
        assert_eq!(status, 200, "{query}: {v}");
        let ids = v["runs"].as_array().unwrap().iter().map(|r| r["runId"].as_str().unwrap().to_owned()).collect();
        (ids, v["nextCursor"].as_str().map(str::to_owned))
    }

    /// Every page of `query`, following `nextCursor` (bounded).
    async fn walk(&self, query: &str, key: Option<&str>) -> (Vec<String>, usize) {
        let (mut all, mut next) = self.list(query, key).await;
        let mut pages = 1;
        while let Some(c) = next {
            assert!(pages < 1000, "{query}: no end");
            let (ids, n) = self.list(&format!("{query}&cursor={c}"), key).await;
            assert!(!ids.is_empty(), "{query}: an empty page with a cursor");
            all.extend(ids);
            next = n;
            pages += 1;
        }
        (all, pages)
    }

    /// Posts a run and waits for its end (JSON); returns its id and document.
    async fn run(&self, body: Value) -> (String, Value) {
        let (status, doc) = post_json(&self.http, &self.base, &body).await;
        assert_eq!(status, 200, "{doc}");
        (doc["runId"].as_str().unwrap().to_owned(), doc)
    }

    /// Posts a run with `?wait=false`; returns its id.
    async fn start(&self, body: Value) -> String {
        let r = self.http.post(format!("{}/v1/runs?wait=false", self.base)).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 202, "{:?}", r.text().await);
        r.json::<Value>().await.unwrap()["runId"].as_str().unwrap().to_owned()
    }

    async fn status_of(&self, run_id: &str) -> String {
        self.get(&format!("/v1/runs/{run_id}"), None).await.1["status"].as_str().unwrap_or_default().to_owned()
    }

    async fn until_status(&self, run_id: &str, status: &str) {
        let deadline = Instant::now() + WAIT;
        while self.status_of(run_id).await != status {
            assert!(Instant::now() < deadline, "{run_id} never became {status}: {}", self.status_of(run_id).await);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn body(tag: &str, account: &str, state_key: Option<&str>) -> Value {
    let mut b = json!({"message": format!("<{tag}>"), "billingAccountId": account, "onDisconnect": "continue"});
    if let Some(s) = state_key {
        b["stateKey"] = json!(s);
    }
    b
}

fn rfc3339_now() -> String {
    time::OffsetDateTime::now_utc().format(&time::format_description::well_known::Rfc3339).unwrap()
}

fn newest_first(ids: &[&String]) -> Vec<String> {
    ids.iter().rev().map(|s| (*s).clone()).collect()
}

async fn filters_order_page_size_and_bad_parameters(kinds: &[&str]) {
    let store_url = fresh_store(kinds[0]).await;
    let env = env_with(gateway(), &[("CLAWMUX_STORE_URL", &store_url)]).await;
    // In admission order: 55 runs of one account, then a time boundary, then one run of each
    // status over three accounts and two conversations.
    let mut order: Vec<String> = Vec::new();
    for i in 0..55 {
        order.push(env.run(body(&format!("bulk-{i}"), "acct-bulk", None)).await.0);
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let since = rfc3339_now();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let a1 = env.run(body("a1", "acct-a", Some("conv-1"))).await.0;
    let a2 = env.run(body("a2", "acct-a", Some("conv-1"))).await.0;
    let a3 = env.run(body("a3", "acct-a", None)).await.0;
    let b1 = env.run(body("b1", "acct-b", None)).await.0;
    env.gw.script_runs("<fails>", RunScript { final_patch: Some(json!({"status": "error", "summary": "scripted failure"})), ..RunScript::default() });
    let (e1, doc) = env.run(body("fails", "acct-b", Some("conv-2"))).await;
    assert_eq!(doc["status"], "error", "{doc}");
    // Held by the gateway: one running, one queued behind it, one timed out and one aborted in
    // that queue.
    env.gw.set_paused(true);
    let running = env.start(body("running", "acct-c", Some("conv-h"))).await;
    env.until_status(&running, "running").await;
    let queued = env.start(body("queued", "acct-c", Some("conv-h"))).await;
    let mut t = body("timeout", "acct-c", Some("conv-h"));
    t["timeoutSec"] = json!(1);
    let timed_out = env.start(t).await;
    let aborted = env.start(body("aborted", "acct-c", Some("conv-h"))).await;
    let (s, v) = env.get(&format!("/v1/runs/{aborted}/abort"), None).await;
    assert_eq!(s, 405, "{v}");
    let r = env.http.post(format!("{}/v1/runs/{aborted}/abort", env.base)).send().await.unwrap();
    assert_eq!(r.status(), 202);
    env.until_status(&aborted, "aborted").await;
    env.until_status(&timed_out, "timeout").await;
    assert_eq!(env.status_of(&queued).await, "queued");
    let recent = [&a1, &a2, &a3, &b1, &e1, &running, &queued, &timed_out, &aborted];
    order.extend(recent.iter().map(|s| (*s).clone()));

    // Newest first by admission order; 50 by default; up to 500.
    let all = newest_first(&order.iter().collect::<Vec<_>>());
    let (page, next) = env.list("", None).await;
    assert_eq!(page, all[..50], "default page");
    assert!(next.is_some());
    let (page, next) = env.list("limit=500", None).await;
    assert_eq!(page, all, "limit=500");
    assert_eq!(next, None, "a short page is the last");

    // Every filter, alone and together.
    let mut ok: Vec<&String> = order[..55].iter().collect();
    ok.extend([&a1, &a2, &a3, &b1]);
    for (query, expected) in [
        ("status=ok", ok),
        ("status=error", vec![&e1]),
        ("status=running", vec![&running]),
        ("status=queued", vec![&queued]),
        ("status=timeout", vec![&timed_out]),
        ("status=aborted", vec![&aborted]),
        ("status=queued,running", vec![&running, &queued]),
        ("status=error%2Caborted%2Ctimeout", vec![&e1, &timed_out, &aborted]),
        ("billingAccountId=acct-a", vec![&a1, &a2, &a3]),
        ("billingAccountId=acct-b", vec![&b1, &e1]),
        ("stateKey=conv-1", vec![&a1, &a2]),
        ("stateKey=conv-h&status=timeout,aborted", vec![&timed_out, &aborted]),
        ("billingAccountId=acct-b&stateKey=conv-1", vec![]),
        ("billingAccountId=acct-nobody", vec![]),
        ("billingAccountId=acct-a&status=ok&stateKey=conv-1&since=2000-01-01T00:00:00Z", vec![&a1, &a2]),
    ] {
        assert_eq!(env.list(&format!("{query}&limit=500"), None).await.0, newest_first(&expected), "{query}");
    }
    let since_q = since.replace(':', "%3A").replace('+', "%2B");
    assert_eq!(env.list(&format!("since={since_q}&limit=500"), None).await.0, newest_first(&recent), "since={since}");
    assert_eq!(env.list("since=2999-01-01T00:00:00Z", None).await.0, Vec::<String>::new());
    assert_eq!(env.list("since=2000-01-01T00:00:00%2B02:00&limit=500", None).await.0, all);

    // Bad parameters: 400, naming the parameter.
    for (query, names) in [
        ("limit=501", "`limit`"),
        ("limit=0", "`limit`"),
        ("limit=-1", "`limit`"),
        ("limit=ten", "`limit`"),
        ("status=done", "`status`"),
        ("status=ok,", "`status`"),
        ("status=ok&status=error", "`status`"),
        ("limit=5&limit=5", "`limit`"),
        ("since=yesterday", "`since`"),
        ("since=2026-11-23", "`since`"),
        ("cursor=nope", "`cursor`"),
        ("cursor=r0", "`cursor`"),
        ("billingAccountId=a%20b", "`billingAccountId`"),
        ("stateKey=", "`stateKey`"),
        ("colour=red", "\"colour\""),
        ("state_key=x", "\"state_key\""),
    ] {
        let (status, v) = env.get(&format!("/v1/runs?{query}"), None).await;
        assert_eq!(status, 400, "{query}: {v}");
        assert_eq!(v["error"]["code"], "invalid_request", "{query}: {v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(names), "{query}: the message does not name {names}: {message}");
    }
    env.gw.set_paused(false);
}

async fn cursor_walk_is_stable_while_runs_keep_arriving(kinds: &[&str]) {
    let store_url = fresh_store(kinds[0]).await;
    let env = env_with(gateway(), &[("CLAWMUX_STORE_URL", &store_url)]).await;
    // Every run, in admission order, with its account.
    let mut before = Vec::new();
    for i in 0..30 {
        let account = if i % 3 == 0 { "acct-x" } else { "acct-y" };
        before.push((env.run(body(&format!("before-{i}"), account, None)).await.0, account));
    }
    for query in ["limit=7", "limit=4&billingAccountId=acct-y"] {
        // Page by page, with new runs admitted between the pages (some in the filtered account).
        let (mut seen, mut next) = env.list(query, None).await;
        let mut arrived = Vec::new();
        let mut pages = 1;
        while let Some(c) = next {
            for j in 0..3 {
                arrived.push(env.run(body(&format!("during-{pages}-{j}"), "acct-y", None)).await.0);
            }
            let (ids, n) = env.list(&format!("{query}&cursor={c}"), None).await;
            seen.extend(ids);
            next = n;
            pages += 1;
            assert!(pages < 100, "{query}: no end");
        }
        let expected: Vec<String> =
            before.iter().rev().filter(|(_, a)| !query.contains("acct-y") || *a == "acct-y").map(|(id, _)| id.clone()).collect();
        let unique: HashSet<&String> = seen.iter().collect();
        assert_eq!(unique.len(), seen.len(), "{query}: a run on two pages: {seen:?}");
        assert!(seen.iter().all(|id| !arrived.contains(id)), "{query}: a run admitted after the first page appeared in the walk");
        assert_eq!(seen, expected, "{query}: the walk is not every run of the first page's time, newest first");
        // The runs that arrived are on a fresh first page, newest first.
        let (first, _) = env.list(&format!("{query}&limit=500").replace("limit=7&", "").replace("limit=4&", ""), None).await;
        assert_eq!(&first[..arrived.len()], newest_first(&arrived.iter().collect::<Vec<_>>()), "{query}");
        before.extend(arrived.into_iter().map(|id| (id, "acct-y")));
    }
}

async fn an_api_key_lists_only_its_accounts_runs(kinds: &[&str]) {
    let store_url = fresh_store(kinds[0]).await;
    let env = env_with(gateway(), &[("CLAWMUX_STORE_URL", &store_url)]).await;
    let mut of: HashMap<&str, Vec<String>> = HashMap::new();
    for i in 0..12 {
        let account = ["acct-a", "acct-b", "acct-c"][i % 3];
        of.entry(account).or_default().push(env.run(body(&format!("k{i}"), account, Some("conv-k"))).await.0);
    }
    let key = |accounts: Value, actions: Value| {
        let env = &env;
        async move {
            let r = env.http.post(format!("{}/v1/admin/keys", env.base)).json(&json!({"name": "history", "accounts": accounts, "actions": actions})).send().await.unwrap();
            assert_eq!(r.status(), 201);
            r.json::<Value>().await.unwrap()["key"].as_str().unwrap().to_owned()
        }
    };
    let a = key(json!(["acct-a"]), json!(["read"])).await;
    let ac = key(json!(["acct-a", "acct-c"]), json!(["read"])).await;
    let every = key(json!(["*"]), json!(["read"])).await;
    let runner = key(json!(["acct-a"]), json!(["run"])).await;
    let ids = |acc: &[&str]| -> HashSet<String> { acc.iter().flat_map(|a| of[a].clone()).collect() };

    let (listed, pages) = env.walk("limit=2", Some(&a)).await;
    assert_eq!(listed.iter().cloned().collect::<HashSet<_>>(), ids(&["acct-a"]), "key for acct-a");
    assert_eq!((listed.len(), pages), (4, 2));
    assert_eq!(env.walk("limit=3", Some(&ac)).await.0.into_iter().collect::<HashSet<_>>(), ids(&["acct-a", "acct-c"]));
    assert_eq!(env.walk("limit=500", Some(&every)).await.0.len(), 12);
    // Filters cannot reach past the key: another account is an empty list, never its runs.
    assert_eq!(env.list("billingAccountId=acct-b", Some(&a)).await.0, Vec::<String>::new());
    assert_eq!(env.list("stateKey=conv-k&status=ok&limit=500", Some(&a)).await.0.into_iter().collect::<HashSet<_>>(), ids(&["acct-a"]));
    // Nor can a cursor: one from the admin's walk still lists only the key's runs.
    let (_, cursor) = env.list("limit=1", None).await;
    let (ids_after, _) = env.list(&format!("limit=500&cursor={}", cursor.unwrap()), Some(&a)).await;
    assert!(ids_after.iter().all(|id| of["acct-a"].contains(id)), "{ids_after:?}");
    // Another account's run does not exist for the key; a key without `read` lists nothing.
    let (status, _) = env.get(&format!("/v1/runs/{}", of["acct-b"][0]), Some(&a)).await;
    assert_eq!(status, 404);
    let (status, v) = env.get("/v1/runs", Some(&runner)).await;
    assert_eq!(status, 403, "{v}");
}

fn stored_row(i: usize) -> RunRow {
    let run_id = format!("stored-{i:05}");
    RunRow {
        seq: 0,
        run_id: run_id.clone(),
        idempotency_key: Some(format!("idem-{i}")),
        fingerprint: format!("fp-{i}"),
        billing_account_id: format!("acct-{}", i % 7),
        state_key: None,
        session_key: format!("agent:main:clawmux:acct.r.{run_id}"),
        spec: SpecRecord {
            gateway_run_id: format!("gw-{i}"),
            agent_id: "main".into(),
            message: format!("stored run {i}"),
            model: None,
            graph_id: "g".into(),
            timeout_ms: 600_000,
            // Its own: two unfinished runs may not share a trace id.
            traceparent: format!("00-{:032x}-b7ad6b7169203331-01", i + 1),
            attribution_token: None,
            branch: None,
            abort_on_disconnect: false,
            if_busy: Default::default(),
        },
        status: "queued".into(),
        checkpoint: None,
        gateway_run_id: None,
        content: String::new(),
        error: None,
        gateway_usage: None,
        usage: None,
        relay: None,
        // Creation times out of admission order: the order is admission, not the clock.
        created_at_ms: clawmux::store::now_ms() - 1_000_000 + ((i * 7919) % 10_000) as i64,
        finished_at_ms: None,
        last_event_id: 0,
        key_id: None,
        webhook_url: None,
    }
}

/// 10,000 finished runs written through the store API (one transaction: through the HTTP API
/// they would take minutes), then read back page by page over HTTP.
async fn pages_through_10000_stored_runs(kinds: &[&str]) {
    const RUNS: usize = 10_000;
    let url = fresh_store(kinds[0]).await;
    {
        let store: Box<dyn Store> = match clawmux::store::StoreUrl::parse(&url).unwrap() {
            clawmux::store::StoreUrl::Sqlite(path) => Box::new(SqliteStore::open(&path).await.unwrap()),
            pg => Box::new(PgStore::open(&url, &pg.display()).await.unwrap()),
        };
        let now = clawmux::store::now_ms();
        let mut writes = Vec::with_capacity(RUNS * 2);
        for i in 0..RUNS {
            writes.push(Write::Insert(Box::new(stored_row(i))));
            let status = ["ok", "error", "aborted", "timeout"][i % 4];
            let end = StoredEvent { id: 1, name: if status == "ok" { EventName::Final } else { EventName::Error }, data: "{}".into() };
            let patch = RunPatch { status: Some(status.into()), finished_at_ms: Some(now), ..RunPatch::default() };
            writes.push(Write::Append { run_id: stored_row(i).run_id, event: Some(end), patch, webhook: None });
        }
        store.apply(&writes).await.unwrap();
    }
    let env = env_with(gateway(), &[("CLAWMUX_STORE_URL", &url), ("CLAWMUX_RUN_RETENTION_MAX", "20000")]).await;
    let expected: Vec<String> = (0..RUNS).rev().map(|i| stored_row(i).run_id).collect();
    let t0 = std::time::Instant::now();
    let (all, pages) = env.walk("limit=500", None).await;
    assert_eq!(pages, RUNS / 500);
    assert_eq!(all.len(), RUNS);
    assert!(all == expected, "not every run once, newest first by admission");
    // The default page size, with a filter.
    let (acct3, pages) = env.walk("billingAccountId=acct-3&status=ok,timeout", None).await;
    let expected3: Vec<String> = (0..RUNS).rev().filter(|i| i % 7 == 3 && (i % 4 == 0 || i % 4 == 3)).map(|i| stored_row(i).run_id).collect();
    assert_eq!(acct3, expected3);
    assert_eq!(pages, expected3.len().div_ceil(50));
    eprintln!("10,000 stored runs: {} pages read in {:.2} s", RUNS / 500 + pages, t0.elapsed().as_secs_f64());
    // The restart continued nothing (they are finished) and a new run is newest.
    let (id, _) = env.run(body("after", "acct-0", None)).await;
    assert_eq!(env.list("limit=1", None).await.0, [id]);
}

async fn ids_listed(env: &Env) -> HashSet<String> {
    env.walk("limit=500", None).await.0.into_iter().collect()
}

/// `CLAWMUX_RUN_RETENTION_MAX` (per billing account) and `_SEC`, on both stores: finished runs
/// past either limit are gone from every read; unfinished runs never go. (The sweep runs every
/// 10 s; the test runs it itself rather than wait.)
async fn retention_limits_are_enforced_by_the_store(kinds: &[&str]) {
    for &store in kinds {
        let store_url = fresh_store(store).await;
        // By count: the 2 newest finished runs of each billing account stay; another account's
        // run, older than all of them, is not pushed out by them.
        let env = env_with(gateway(), &[("CLAWMUX_STORE_URL", &store_url), ("CLAWMUX_RUN_RETENTION_MAX", "2")]).await;
        let other = env.run(body("other", "acct-q", None)).await.0;
        let mut done = Vec::new();
        for i in 0..5 {
            done.push(env.run(body(&format!("r{i}"), "acct-r", None)).await.0);
        }
        env.gw.set_paused(true);
        let held = env.start(body("held", "acct-r", None)).await;
        env.until_status(&held, "running").await;
        let swept = env.app.state.store.sweep().await.unwrap();
        assert_eq!(swept, 3, "{store}");
        assert_eq!(ids_listed(&env).await, [&done[3], &done[4], &held, &other].into_iter().cloned().collect(), "{store}");
        for id in &done[..3] {
            assert_eq!(env.get(&format!("/v1/runs/{id}"), None).await.0, 404, "{store}: {id} still readable");
            assert_eq!(env.get(&format!("/v1/runs/{id}/events"), None).await.0, 404, "{store}: {id} events still readable");
        }
        assert_eq!(env.get(&format!("/v1/runs/{}", done[4]), None).await.0, 200, "{store}");
        // Once the held run finishes it is the newest finished run: the oldest kept one goes.
        env.gw.set_paused(false);
        env.until_status(&held, "ok").await;
        env.app.state.store.sweep().await.unwrap();
        assert_eq!(ids_listed(&env).await, [&done[4], &held, &other].into_iter().cloned().collect(), "{store}");
        assert_eq!(env.get(&format!("/v1/runs/{other}"), None).await.0, 200, "{store}");
        drop(env);

        // By age: runs finished more than a second ago go; a run admitted more than a second ago
        // but not finished stays.
        let store_url = fresh_store(store).await;
        let env = env_with(gateway(), &[("CLAWMUX_STORE_URL", &store_url), ("CLAWMUX_RUN_RETENTION_SEC", "1")]).await;
        let mut finished = Vec::new();
        for i in 0..3 {
            finished.push(env.run(body(&format!("aged{i}"), "acct-r", None)).await.0);
        }
        env.gw.set_paused(true);
        let waiting = env.start(body("waiting", "acct-r", None)).await;
        env.until_status(&waiting, "running").await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        env.app.state.store.sweep().await.unwrap();
        let listed = ids_listed(&env).await;
        for id in &finished {
            assert!(!listed.contains(id), "{store}: {id} outlived CLAWMUX_RUN_RETENTION_SEC");
            assert_eq!(env.get(&format!("/v1/runs/{id}"), None).await.0, 404, "{store}");
        }
        assert_eq!(listed, [waiting.clone()].into_iter().collect(), "{store}: an unfinished run was swept");
        assert_eq!(env.status_of(&waiting).await, "running", "{store}");
        env.gw.set_paused(false);
    }
}
