//! The run store on a real PostgreSQL (tests/support/postgres.sh): `clawmux serve` (a child
//! process, as in tests/restart.rs) against a replay gateway, killed with `kill -9` mid-stream and
//! started again on the same database; and the database stopped under load, then started again.
//!
//! Every test is named `pg_…` and runs in the PostgreSQL phase of tests/run.sh. The restart test
//! uses a database of its own on the server `CLAWMUX_TEST_PG_URL` names; the fault test starts a
//! PostgreSQL of its own through the script (it stops it). Without `CLAWMUX_TEST_PG_URL` they are
//! skipped, unless `CLAWMUX_REQUIRE_PG=1`.

#![allow(clippy::unwrap_used)]

mod common;
#[path = "common/child.rs"]
mod child;
#[path = "common/own_postgres.rs"]
mod own_postgres;
#[path = "common/tcp_chaos.rs"]
mod tcp_chaos;

use child::{attach, read_stream, Clawmux, Seen};
use own_postgres::{server_url, OwnPostgres};
use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway, ReplayHandle};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

const GW_TOKEN: &str = "pg-gw-token";


fn password_of(url: &str) -> String {
    reqwest::Url::parse(url).unwrap().password().unwrap_or_default().to_owned()
}

/// The long recorded run (42 `chat` events over ~3.5 s) at `speed`.
fn gateway_at(speed: f64) -> ReplayHandle {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cassettes/openclaw-2026.9.6-long.jsonl")).unwrap();
    let cfg = ReplayConfig::new(Cassette::parse(&text).unwrap()).speed(speed).token(GW_TOKEN);
    ReplayGateway::start("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
}

/// `CLAWMUX_API_TOKEN`: a test that makes an API key goes on as the admin (a loopback client
/// without credentials is the admin only while no key exists).
const ADMIN: &str = "pg-admin-token-5f0e1d";

fn clawmux(gw: &ReplayHandle, store_url: &str) -> Clawmux {
    Clawmux::new(&gw.url(), GW_TOKEN, &[("CLAWMUX_DEVICE_IDENTITY", "off"), ("CLAWMUX_STORE_URL", store_url), ("CLAWMUX_API_TOKEN", ADMIN)])
}

fn body(i: usize, tag: &str) -> Value {
    json!({"message": format!("<{tag}-{i}> [track:long]"), "billingAccountId": format!("acct-{}", i % 5), "onDisconnect": "continue"})
}

async fn post(http: &reqwest::Client, base: &str, body: &Value, key: &str) -> reqwest::Response {
    http.post(format!("{base}/v1/runs?wait=false")).header("idempotency-key", key).json(body).send().await.unwrap()
}

async fn post_run(http: &reqwest::Client, base: &str, body: &Value, key: &str) -> String {
    let r = post(http, base, body, key).await;
    assert_eq!(r.status(), 202, "{:?}", r.text().await);
    let doc: Value = r.json().await.unwrap();
    doc["runId"].as_str().unwrap().to_owned()
}

/// Every request as the admin, unless it names a key of its own.
fn http() -> reqwest::Client {
    let mut admin = reqwest::header::HeaderMap::new();
    admin.insert(reqwest::header::AUTHORIZATION, format!("Bearer {ADMIN}").parse().unwrap());
    reqwest::Client::builder().pool_max_idle_per_host(256).pool_idle_timeout(Duration::from_secs(2)).timeout(Duration::from_secs(120)).default_headers(admin).build().unwrap()
}

/// Attaches a reader to every run without a terminal event yet (from its `Last-Event-ID` on).
async fn attach_all(http: &reqwest::Client, base: &str, seen: &HashMap<String, Arc<Mutex<Seen>>>, within: Duration) -> Vec<tokio::task::JoinHandle<()>> {
    let mut readers = Vec::new();
    for (id, s) in seen {
        if s.lock().unwrap().terminal().is_some() {
            continue;
        }
        let after = s.lock().unwrap().last_id();
        readers.push(tokio::spawn(read_stream(attach(http, base, id, after).await, s.clone(), within)));
    }
    readers
}

/// Waits (bounded) until at least `n` runs stream text and none has finished yet.
async fn until_streaming(seen: &HashMap<String, Arc<Mutex<Seen>>>, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let streaming = seen.values().filter(|s| s.lock().unwrap().text().len() > 20).count();
        if streaming >= n || seen.values().any(|s| s.lock().unwrap().terminal().is_some()) {
            return;
        }
        assert!(Instant::now() < deadline, "runs did not stream ({streaming} streaming)");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn history(http: &reqwest::Client, base: &str, query: &str) -> Vec<Value> {
    let page: Value = http.get(format!("{base}/v1/runs?limit=500{query}")).send().await.unwrap().json().await.unwrap();
    page["runs"].as_array().cloned().unwrap_or_default()
}

#[actix_rt::test]
async fn pg_kill_9_with_runs_in_flight_then_a_restart_on_the_same_database_loses_nothing() {
    let Some(server) = server_url("pg_kill_9") else { return };
    let url = clawmux::store::postgres::create_test_database(&server, "cmx_restart").await.unwrap();
    const N: usize = 60;
    let gw = gateway_at(0.5);
    let http = http();
    let mut app = clawmux(&gw, &url);
    app.start(&http).await;
    let mut ids = Vec::new();
    for i in 0..N {
        ids.push(post_run(&http, &app.base, &body(i, "pgk9"), &format!("pgk9-idem-{i}")).await);
    }
    let seen: HashMap<String, Arc<Mutex<Seen>>> = ids.iter().map(|id| (id.clone(), Arc::default())).collect();
    let readers = attach_all(&http, &app.base, &seen, Duration::from_secs(90)).await;
    until_streaming(&seen, N / 2).await;
    app.kill_9();
    for r in readers {
        r.await.unwrap();
    }
    let cut = seen.values().filter(|s| s.lock().unwrap().terminal().is_none()).count();
    assert!(cut >= N / 2, "the kill came too late to test anything: only {cut} runs were in flight");

    // Same database, new process: the unfinished runs are resumed from the store.
    app.start(&http).await;
    for r in attach_all(&http, &app.base, &seen, Duration::from_secs(90)).await {
        r.await.unwrap();
    }
    let mut problems = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let s = seen[id].lock().unwrap();
        match s.problems() {
            Some(p) => problems.push(format!("{id}: {}", p.chars().take(300).collect::<String>())),
            None => {
                let content = s.terminal().unwrap().data["content"].as_str().unwrap_or_default().to_owned();
                if !content.starts_with(&format!("<pgk9-{i}> [track:long] | ")) {
                    problems.push(format!("{id}: not its own content: {content:?}"));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{} of {N} runs wrong ({cut} were cut):\n{}", problems.len(), problems.join("\n"));
    // No run was started twice on the gateway.
    let mut per_id: HashMap<String, usize> = HashMap::new();
    for r in gw.runs() {
        *per_id.entry(r.run_id.clone()).or_default() += 1;
    }
    assert!(per_id.values().all(|c| *c == 1) && per_id.len() == N, "gateway runs: {per_id:?}");
    // History comes from the database: every run, finished, newest first.
    let listed = history(&http, &app.base, "").await;
    let listed_ids: Vec<&str> = listed.iter().filter_map(|d| d["runId"].as_str()).collect();
    let newest_first: Vec<&str> = ids.iter().rev().map(String::as_str).collect();
    assert_eq!(listed_ids, newest_first);
    assert!(listed.iter().all(|d| d["status"] == "ok"), "{listed:?}");
    // An idempotent re-POST after the restart finds the same run.
    let again: Value = post(&http, &app.base, &body(3, "pgk9"), "pgk9-idem-3").await.json().await.unwrap();
    assert_eq!(again["runId"].as_str(), Some(ids[3].as_str()), "{again}");
    let log = app.log();
    assert!(!log.contains(&password_of(&url)), "the database password is in the log");
    assert!(log.contains("postgres://clawmux@127.0.0.1"), "the store is named in the log: {log}");
}

#[actix_rt::test]
async fn pg_stopped_mid_load_admission_answers_503_with_retry_after_then_recovers_by_itself() {
    if server_url("pg_stopped_mid_load").is_none() {
        return;
    }
    // Directly under the temp dir: the server's own user must reach its directory.
    let tmp = tempfile::Builder::new().prefix("clawmux-pg-fault.").tempdir().unwrap();
    let pg = OwnPostgres::start(tmp.path());
    const N: usize = 20;
    let gw = gateway_at(0.5);
    let http = http();
    let mut app = clawmux(&gw, &pg.url);
    app.start(&http).await;
    let mut ids = Vec::new();
    for i in 0..N {
        ids.push(post_run(&http, &app.base, &body(i, "pgdown"), &format!("pgdown-{i}")).await);
    }
    let mut seen: HashMap<String, Arc<Mutex<Seen>>> = ids.iter().map(|id| (id.clone(), Arc::default())).collect();
    let mut readers = attach_all(&http, &app.base, &seen, Duration::from_secs(90)).await;
    // Runs whose callers stream their POST and asked for `onDisconnect: abort`: a stream the
    // outage ends is not their caller going away; they go on like the others.
    for i in 0..4 {
        let id = format!("pgdown-abort-{i}");
        let mut b = body(N + i, "pgdown");
        b["onDisconnect"] = json!("abort");
        b["runId"] = json!(id);
        let resp = http.post(format!("{}/v1/runs", app.base)).header("accept", "text/event-stream").json(&b).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        let s: Arc<Mutex<Seen>> = Arc::default();
        readers.push(tokio::spawn(read_stream(resp, s.clone(), Duration::from_secs(90))));
        seen.insert(id.clone(), s);
        ids.push(id);
    }
    until_streaming(&seen, N / 2).await;
    // An API key, to be checked while the database is down.
    let key = http.post(format!("{}/v1/admin/keys", app.base)).json(&json!({"name": "k", "accounts": ["acct-0"], "actions": ["run"]})).send().await.unwrap();
    assert_eq!(key.status(), 201);
    let key = key.json::<Value>().await.unwrap()["key"].as_str().unwrap().to_owned();

    pg.stop();
    let stopped = Instant::now();
    // Admission: 503 + Retry-After while the database is down, in bounded time.
    let r = tokio::time::timeout(Duration::from_secs(60), post(&http, &app.base, &body(100, "pgdown"), "pgdown-new")).await.expect("POST answered");
    let (status, retry_after) = (r.status(), r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned()));
    let refused: Value = r.json().await.unwrap();
    assert_eq!(status, 503, "{refused}");
    assert_eq!(refused["error"]["code"], "store_unavailable", "{refused}");
    assert!(!refused.to_string().contains("127.0.0.1") && !refused.to_string().contains("postgres"), "the store's address is the operator's: {refused}");
    assert!(retry_after.as_deref().is_some_and(|s| s.parse::<u64>().is_ok_and(|n| n > 0)), "Retry-After: {retry_after:?}");
    eprintln!("503 after {:.1} s", stopped.elapsed().as_secs_f64());
    // A request with an API key cannot have its key checked: the store's 503, not the gateway's
    // (which tells a client to try another instance).
    let r = http.post(format!("{}/v1/runs?wait=false", app.base)).bearer_auth(&key).json(&body(101, "pgdown")).send();
    let r = tokio::time::timeout(Duration::from_secs(60), r).await.expect("POST answered").unwrap();
    assert_eq!(r.status(), 503);
    let refused: Value = r.json().await.unwrap();
    assert_eq!(refused["error"]["code"], "store_unavailable", "{refused}");
    // Runs in flight are suspended, not ended: every stream ends (none hangs) without an error;
    // those that had not finished end without a terminal event (the clients re-attach).
    for r in readers {
        tokio::time::timeout(Duration::from_secs(120), r).await.expect("a stream hung").unwrap();
    }
    let mut suspended = Vec::new();
    for id in &ids {
        let s = seen[id].lock().unwrap();
        match s.terminal() {
            None => suspended.push(id.clone()),
            Some(t) => assert_eq!(t.event, "final", "{id}: ended by the outage: {:?}", t.data),
        }
    }
    assert!(!suspended.is_empty(), "no run was in flight when the database stopped");
    assert!(app.running(), "clawmux exited while the database was down; log: {}", app.log());

    // The database comes back: admission recovers by itself, and a new run finishes.
    pg.restart();
    let deadline = Instant::now() + Duration::from_secs(60);
    let run_id = loop {
        let r = post(&http, &app.base, &body(101, "pgdown"), "pgdown-after").await;
        if r.status() == 202 {
            break r.json::<Value>().await.unwrap()["runId"].as_str().unwrap().to_owned();
        }
        assert_eq!(r.status(), 503, "{:?}", r.text().await);
        assert!(Instant::now() < deadline, "admission did not recover within 60 s of the database's return");
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let after = Arc::new(Mutex::new(Seen::default()));
    read_stream(attach(&http, &app.base, &run_id, 0).await, after.clone(), Duration::from_secs(60)).await;
    assert_eq!(after.lock().unwrap().problems(), None, "the run after the database came back");
    // The suspended runs go on here: their clients re-attach with Last-Event-ID (bounded) and get
    // the rest, each run ending once, `final`, its deltas without gap or repeat.
    let deadline = Instant::now() + Duration::from_secs(120);
    while seen.values().any(|s| s.lock().unwrap().terminal().is_none()) {
        assert!(Instant::now() < deadline, "suspended runs never ended for their clients");
        for r in attach_all(&http, &app.base, &seen, Duration::from_secs(60)).await {
            r.await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for id in &ids {
        assert_eq!(seen[id].lock().unwrap().problems(), None, "{id}");
    }
    let listed = history(&http, &app.base, "").await;
    assert!(ids.iter().all(|id| listed.iter().any(|d| d["runId"] == id.as_str() && d["status"] == "ok")), "{listed:?}");
    let mut per_id: HashMap<String, usize> = HashMap::new();
    for r in gw.runs() {
        *per_id.entry(r.run_id.clone()).or_default() += 1;
    }
    assert!(per_id.values().all(|c| *c == 1), "a run was started twice on the gateway: {per_id:?}");
    eprintln!("{} of {N} runs suspended by the outage, all continued", suspended.len());
    assert!(!app.log().contains(&password_of(&pg.url)), "the database password is in the log");
}

/// `clawmux doctor` against `store_url` (and the replay gateway); its output and exit status. On
/// a thread of its own: the replay gateway runs on the test's runtime.
async fn doctor(gw: &ReplayHandle, store_url: &str) -> (String, bool) {
    let (gw_url, store_url) = (gw.url(), store_url.to_owned());
    tokio::task::spawn_blocking(move || doctor_blocking(&gw_url, &store_url)).await.unwrap()
}

fn doctor_blocking(gw_url: &str, store_url: &str) -> (String, bool) {
    let home = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_clawmux"))
        .arg("doctor")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", home.path())
        .env("CLAWMUX_GATEWAY_URL", gw_url)
        .env("CLAWMUX_GATEWAY_TOKEN", GW_TOKEN)
        .env("CLAWMUX_DEVICE_IDENTITY", "off")
        .env("CLAWMUX_STORE_URL", store_url)
        .output()
        .unwrap();
    (format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)), out.status.success())
}

#[actix_rt::test]
async fn doctor_reports_an_sqlite_store_with_its_schema_version() {
    let gw = gateway_at(1.0);
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("runs.db").display());
    let (out, ok) = doctor(&gw, &url).await;
    assert!(ok, "{out}");
    // Every migration in the repository is applied after a start.
    let newest = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/sqlite")).unwrap().count();
    assert!(out.contains(&format!("store ({url}): OK, sqlite kind, reachable, schema version {newest}, 0 unfinished")), "{out}");
}

#[actix_rt::test]
async fn pg_doctor_reports_the_store_without_its_password() {
    let Some(server) = server_url("pg_doctor") else { return };
    let url = clawmux::store::postgres::create_test_database(&server, "cmx_doctor").await.unwrap();
    let password = password_of(&url);
    let gw = gateway_at(1.0);
    // A process on the store renews its heartbeat row; doctor lists it.
    let http = http();
    let mut app = Clawmux::new(&gw.url(), GW_TOKEN, &[("CLAWMUX_DEVICE_IDENTITY", "off"), ("CLAWMUX_STORE_URL", &url), ("CLAWMUX_REPLICA_ID", "replica-doctor-7")]);
    app.start(&http).await;
    // Its first heartbeat is written at start, next to readiness: wait for the row (bounded).
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while sqlx::query_scalar::<_, i64>("SELECT count(*) FROM replicas WHERE id = 'replica-doctor-7'").fetch_one(&pool).await.unwrap() == 0 {
        assert!(Instant::now() < deadline, "no heartbeat row within 30 s; log: {}", app.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    pool.close().await;
    let (out, ok) = doctor(&gw, &url).await;
    app.kill_9();
    assert!(ok, "{out}");
    // The newest migration in the repository is the schema the store has after a start.
    let newest = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/postgres"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.split('_').next()?.parse::<u32>().ok())
        .max()
        .unwrap();
    assert!(out.contains(&format!("OK, postgres kind, reachable, schema version {newest}, 0 unfinished")), "{out}");
    let seen = out.lines().find(|l| l.contains("replica-doctor-7")).unwrap_or_else(|| panic!("the replica is not listed:\n{out}"));
    assert!(seen.contains("last heartbeat") && seen.contains("s ago"), "{seen}");
    // doctor itself is no replica: only the serving process is listed.
    assert!(out.contains("replicas seen: 1"), "{out}");
    assert!(out.contains("postgres://clawmux@127.0.0.1:"), "{out}");
    assert!(!out.contains(&password), "the password is in doctor's output:\n{out}");
    // A wrong password: not reachable, and neither password is shown.
    let wrong = url.replace(&password, "not-the-password-42");
    let (out, ok) = doctor(&gw, &wrong).await;
    assert!(!ok, "{out}");
    assert!(out.contains("FAILED, postgres kind, not reachable") && out.contains("Fix:"), "{out}");
    assert!(!out.contains(&password) && !out.contains("not-the-password-42"), "a password is in doctor's output:\n{out}");
    // A server that is not there: the same, in bounded time.
    let port = child::free_port();
    let t0 = Instant::now();
    let (out, ok) = doctor(&gw, &format!("postgres://clawmux:secret-pw-7@127.0.0.1:{port}/clawmux")).await;
    assert!(!ok && out.contains("not reachable") && !out.contains("secret-pw-7"), "{out}");
    assert!(t0.elapsed() < Duration::from_secs(60), "doctor took {:?}", t0.elapsed());
}

/// A commit that the database carries out but whose answer never arrives (the connection reset
/// after `COMMIT` went out): the writer cannot know it happened, takes the store as out of reach
/// and writes the batch's billing records again once it answers. Each is counted once: the
/// account's spend is the call's tokens, not twice them, and the call is recorded once (before,
/// both were doubled).
#[actix_rt::test]
async fn pg_billing_records_of_a_commit_whose_answer_was_lost_are_counted_once() {
    use clawmux::store::{BillingId, Write};
    let Some(server) = server_url("pg_billing_records_of_a_commit_whose_answer_was_lost") else { return };
    let url = clawmux::store::postgres::create_test_database(&server, "cmx_ambiguous").await.unwrap();
    let (relay, relayed) = tcp_chaos::in_front_of_database(&url).await;
    let store = Arc::new(clawmux::store::postgres::PgStore::open(&relayed, "ambiguous").await.unwrap());
    let registry = prometheus::Registry::new();
    let metrics = clawmux::store::writer::StoreMetrics::new(&registry).unwrap();
    let count = |name: &str, label: Option<&str>| -> f64 {
        let family = registry.gather().into_iter().find(|f| f.name() == name).unwrap();
        family.get_metric().iter().filter(|m| label.is_none_or(|l| m.get_label().iter().any(|p| p.value() == l))).map(|m| m.get_counter().get_value()).sum()
    };
    let writer = clawmux::store::writer::Writer::start(store, metrics);
    let record = clawmux::audit::AuditRecord {
        time: "2026-11-27T00:00:00Z".into(),
        run_id: "run-ambiguous".into(),
        billing_account_id: "acct-ambiguous".into(),
        model: Some("m".into()),
        path: "/v1/chat/completions".into(),
        status: 200,
        outcome: "ok".into(),
        latency_ms: 3,
        streamed: false,
        input_tokens: Some(40),
        output_tokens: Some(2),
        upstream_call_id: None,
    };
    relay.mute_after(b"COMMIT");
    // One batch, nearly always (the writer thread takes what is queued when it wakes).
    writer.submit(Write::LlmCall { id: BillingId::new(), record: Box::new(record) }, None);
    writer.submit(Write::Spend { account: "acct-ambiguous".into(), window_start_ms: 0, tokens: 42, id: BillingId::new() }, None);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !relay.muted() {
        assert!(Instant::now() < deadline, "no COMMIT went through the relay");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The database commits (its answer is dropped), then the connection is reset. Which records
    // the lost commit holds is the writer thread's timing: both, or the call alone when the thread
    // woke between the two submits (then the spend waits behind the muted commit and is written
    // after the reset); each record's id is written in the transaction that holds it.
    let direct = sqlx::PgPool::connect(&url).await.unwrap();
    let spend = || async { sqlx::query_scalar::<_, Option<i64>>("SELECT sum(tokens)::int8 FROM spend WHERE billing_account_id = 'acct-ambiguous'").fetch_one(&direct).await.unwrap() };
    let ids = || async { sqlx::query_scalar::<_, i64>("SELECT count(*) FROM billing_writes").fetch_one(&direct).await.unwrap() };
    while ids().await == 0 {
        assert!(Instant::now() < deadline, "the commit did not happen");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let in_the_lost_commit = ids().await;
    relay.cut_all();
    relay.unmute();
    // The writer takes the store as out of reach (the commit failed), then writes the records
    // again once it answers.
    let deadline = Instant::now() + Duration::from_secs(20);
    while count("clawmux_store_commits_total", Some("failed")) < 1.0 {
        assert!(Instant::now() < deadline, "the writer did not see the commit fail");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let ok_before = count("clawmux_store_commits_total", Some("ok"));
    while count("clawmux_store_commits_total", Some("ok")) <= ok_before || writer.store_down() {
        assert!(Instant::now() < deadline, "the writer did not write again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    writer.flush().await;
    if in_the_lost_commit < 2 {
        eprintln!("the writer split the two records; only the call was in the lost commit");
    }
    assert_eq!(spend().await, Some(42), "the spend was counted again");
    let calls: i64 = sqlx::query_scalar("SELECT count(*) FROM llm_calls WHERE run_id = 'run-ambiguous'").fetch_one(&direct).await.unwrap();
    assert_eq!(calls, 1, "the call was recorded again");
    assert_eq!(ids().await, 2);
}
