//! Three clawmux replicas (child processes) on one PostgreSQL database and one replay gateway
//! (each replica its own connection to it): a replica killed with `kill -9` has every run taken
//! over by exactly one survivor; any replica serves any run's stream; an abort posted to a replica
//! that does not own the run reaches its owner.
//!
//! Every test is named `pg_…` and runs in the PostgreSQL phase of tests/run.sh (a database of its
//! own on the server `CLAWMUX_TEST_PG_URL` names). Without it they are skipped, unless
//! `CLAWMUX_REQUIRE_PG=1`.

#![allow(clippy::unwrap_used)]

mod common;
#[path = "common/child.rs"]
mod child;
#[path = "common/own_postgres.rs"]
mod own_postgres;
#[path = "common/tcp_chaos.rs"]
mod tcp_chaos;

use child::{attach, read_stream, Clawmux, Seen};
use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway, ReplayHandle};
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

const GW_TOKEN: &str = "replicas-gw-token";

/// The shortest lease the configuration allows: takeovers within seconds.
const LEASE_SEC: &str = "3";

async fn database(test: &str) -> Option<String> {
    let server = own_postgres::server_url(test)?;
    Some(clawmux::store::postgres::create_test_database(&server, "cmx_replicas").await.unwrap())
}

/// The long recorded run (42 `chat` events over ~3.5 s at speed 1) at `speed`.
fn gateway_at(speed: f64) -> ReplayHandle {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cassettes/openclaw-2026.9.6-long.jsonl")).unwrap();
    let cfg = ReplayConfig::new(Cassette::parse(&text).unwrap()).speed(speed).token(GW_TOKEN);
    ReplayGateway::start("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
}

/// Replica `r{i}` of three, started.
async fn replicas(gw: &ReplayHandle, url: &str, http: &reqwest::Client) -> Vec<Clawmux> {
    replicas_n(gw, url, http, 3).await
}

/// Replicas `r0` … `r{n-1}`, started.
async fn replicas_n(gw: &ReplayHandle, url: &str, http: &reqwest::Client, n: usize) -> Vec<Clawmux> {
    let mut out = Vec::new();
    for i in 0..n {
        let id = format!("r{i}");
        let mut app = Clawmux::new(
            &gw.url(),
            GW_TOKEN,
            &[("CLAWMUX_DEVICE_IDENTITY", "off"), ("CLAWMUX_STORE_URL", url), ("CLAWMUX_REPLICA_ID", &id), ("CLAWMUX_RUN_LEASE_SEC", LEASE_SEC)],
        );
        app.start(http).await;
        out.push(app);
    }
    out
}

fn http() -> reqwest::Client {
    common::http_client(Some(Duration::from_secs(120)))
}

fn body(i: usize, tag: &str) -> Value {
    json!({"message": format!("<{tag}-{i}> [track:long]"), "billingAccountId": format!("acct-{}", i % 5), "onDisconnect": "continue"})
}

async fn post_run(http: &reqwest::Client, base: &str, body: &Value) -> String {
    let r = http.post(format!("{base}/v1/runs?wait=false")).json(body).send().await.unwrap();
    assert_eq!(r.status(), 202, "{:?}", r.text().await);
    r.json::<Value>().await.unwrap()["runId"].as_str().unwrap().to_owned()
}

type Streams = HashMap<String, Arc<Mutex<Seen>>>;

/// Posts `n` runs round-robin over the replicas; run `i` goes to replica `i % 3`.
async fn post_round_robin(http: &reqwest::Client, apps: &[Clawmux], n: usize, tag: &str) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 0..n {
        ids.push(post_run(http, &apps[i % apps.len()].base, &body(i, tag)).await);
    }
    ids
}

/// Attaches a reader to each run (index `i`) on `base_of(i)`, from what it has seen on.
async fn attach_each(http: &reqwest::Client, ids: &[String], seen: &Streams, base_of: impl Fn(usize) -> String, within: Duration) -> Vec<tokio::task::JoinHandle<()>> {
    let mut readers = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let s = &seen[id];
        if s.lock().unwrap().terminal().is_some() {
            continue;
        }
        let after = s.lock().unwrap().last_id();
        readers.push(tokio::spawn(read_stream(attach(http, &base_of(i), id, after).await, s.clone(), within)));
    }
    readers
}

/// Waits (bounded) until every run of `ids` streams text, and none has ended.
async fn until_all_stream(seen: &Streams, ids: &[&String]) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let streaming = ids.iter().filter(|id| !seen[**id].lock().unwrap().text().is_empty()).count();
        if streaming == ids.len() {
            break;
        }
        assert!(Instant::now() < deadline, "runs did not stream ({streaming} of {} streaming)", ids.len());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ids.iter().all(|id| seen[*id].lock().unwrap().terminal().is_none()), "runs ended before the test could act on them");
}

/// Each run's content must be its own (the replay gateway echoes the message).
fn problems(ids: &[String], seen: &Streams, tag: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let s = seen[id].lock().unwrap();
        match s.problems() {
            Some(p) => out.push(format!("{id} (run {i}): {}", p.chars().take(300).collect::<String>())),
            None => {
                let content = s.terminal().unwrap().data["content"].as_str().unwrap_or_default().to_owned();
                if !content.starts_with(&format!("<{tag}-{i}> [track:long] | ")) {
                    out.push(format!("{id}: not its own content: {content:?}"));
                }
            }
        }
    }
    out
}

#[actix_rt::test]
async fn pg_kill_9_of_one_replica_every_run_is_taken_over_by_one_survivor_and_ends_once() {
    let Some(url) = database("pg_kill_9_of_one_replica").await else { return };
    // 300 runs, 100 per replica, each ~23 s long: the victim's 100 are in flight when it dies
    // (posting and attaching 300 runs takes seconds on a loaded machine).
    const N: usize = 300;
    let gw = gateway_at(0.15);
    let http = http();
    let mut apps = replicas(&gw, &url, &http).await;
    let ids = post_round_robin(&http, &apps, N, "tk").await;
    let seen: Streams = ids.iter().map(|id| (id.clone(), Arc::default())).collect();
    let bases: Vec<String> = apps.iter().map(|a| a.base.clone()).collect();
    let readers = attach_each(&http, &ids, &seen, |i| bases[i % 3].clone(), Duration::from_secs(90)).await;
    let victims: Vec<&String> = ids.iter().step_by(3).collect();
    until_all_stream(&seen, &victims).await;

    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    apps[0].kill_9();
    let killed = Instant::now();
    let killed_ms = clawmux::store::now_ms();
    // Every run of r0 is claimed by a survivor (bounded).
    let victim_ids: Vec<String> = victims.iter().map(|s| (*s).clone()).collect();
    let claimed_after = loop {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM runs WHERE run_id = ANY($1) AND owner = 'r0'").bind(&victim_ids).fetch_one(&pool).await.unwrap();
        if left == 0 {
            break killed.elapsed();
        }
        assert!(killed.elapsed() < Duration::from_secs(60), "{left} runs of the killed replica not taken over within 60 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // r0 starts again under its id while its former runs go on elsewhere: it continues none of
    // them (they are the survivors' now), so none runs twice.
    apps[0].start(&http).await;
    assert_eq!(sqlx::query_scalar::<_, i64>("SELECT count(*) FROM runs WHERE owner = 'r0'").fetch_one(&pool).await.unwrap(), 0);
    // Its log says what it continued at start, before it says it listens.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !apps[0].log().contains("clawmux listening") {
        assert!(Instant::now() < deadline, "no 'listening' line: {}", apps[0].log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!apps[0].log().contains("continued the unfinished runs"), "the restarted replica took runs of others: {}", apps[0].log());
    // Clients of the dead replica re-attach on the run's new owner with Last-Event-ID, while the
    // runs go on.
    let owners: HashMap<String, String> = sqlx::query_as::<_, (String, String)>("SELECT run_id, owner FROM runs").fetch_all(&pool).await.unwrap().into_iter().collect();
    let base_of_owner = |id: &str| match owners[id].as_str() {
        "r1" => bases[1].clone(),
        "r2" => bases[2].clone(),
        other => panic!("run {id} owned by {other:?}"),
    };
    let mut again = Vec::new();
    for id in &victim_ids {
        let after = seen[id].lock().unwrap().last_id();
        assert!(seen[id].lock().unwrap().terminal().is_none(), "{id} ended before its replica was killed");
        again.push(tokio::spawn(read_stream(attach(&http, &base_of_owner(id), id, after).await, seen[id].clone(), Duration::from_secs(90))));
    }
    for r in readers.into_iter().chain(again) {
        r.await.unwrap();
    }
    let ended_ms: i64 = sqlx::query_scalar("SELECT max(finished_at) FROM runs WHERE run_id = ANY($1)").bind(&victim_ids).fetch_one(&pool).await.unwrap();
    eprintln!(
        "takeover after kill -9 (lease {LEASE_SEC} s): every run claimed after {:.2} s, every run ended after {:.2} s",
        claimed_after.as_secs_f64(),
        (ended_ms - killed_ms) as f64 / 1000.0
    );
    let problems = problems(&ids, &seen, "tk");
    assert!(problems.is_empty(), "{} of {N} runs wrong:\n{}", problems.len(), problems.join("\n"));

    // The store: each of the victim's runs changed hands exactly once, to a survivor; the others
    // never did; every run has exactly one terminal event.
    let rows: Vec<(String, String, i64)> = sqlx::query_as("SELECT run_id, owner, claims FROM runs").fetch_all(&pool).await.unwrap();
    assert_eq!(rows.len(), N);
    let victim_set: HashSet<&String> = victims.iter().copied().collect();
    for (id, owner, claims) in &rows {
        if victim_set.contains(id) {
            assert!(owner != "r0" && *claims == 1, "{id}: owner {owner}, claims {claims}");
        } else {
            let i = ids.iter().position(|x| x == id).unwrap();
            assert_eq!((owner.as_str(), *claims), (format!("r{}", i % 3).as_str(), 0), "{id}");
        }
    }
    let terminals: Vec<(String, i64)> =
        sqlx::query_as("SELECT run_id, count(*) FROM events WHERE name IN ('final', 'error') GROUP BY run_id").fetch_all(&pool).await.unwrap();
    assert!(terminals.len() == N && terminals.iter().all(|(_, c)| *c == 1), "terminal events per run: {terminals:?}");
    // The gateway: one run per run (its idempotency key), and no `agent` sent twice: a takeover
    // continues a run with `agent.wait` (its checkpoint says it was sent), never starts it again.
    let mut per_id: HashMap<String, usize> = HashMap::new();
    for r in gw.runs() {
        *per_id.entry(r.run_id.clone()).or_default() += 1;
    }
    assert!(per_id.len() == N && per_id.values().all(|c| *c == 1), "gateway runs: {per_id:?}");
    let requests = gw.stats().requests_received;
    assert_eq!(requests.get("agent").copied(), Some(N as u64), "agent requests: {requests:?}");
    assert!(requests.get("agent.wait").copied().unwrap_or(0) >= victims.len() as u64, "agent.wait requests: {requests:?}");
    let took: usize = apps[1..].iter().map(|a| a.log().matches("took over runs").count()).sum();
    assert!(took >= 1, "no survivor logged a takeover");
    pool.close().await;
}

#[actix_rt::test]
async fn pg_any_replica_serves_any_run_and_an_abort_posted_to_another_replica_reaches_the_owner() {
    let Some(url) = database("pg_any_replica_serves_any_run").await else { return };
    // 300 runs of ~23 s: most are still going when their first streams are cut (posting 300 runs
    // takes seconds on a loaded machine).
    const N: usize = 300;
    let gw = gateway_at(0.15);
    let http = http();
    let apps = replicas(&gw, &url, &http).await;
    let ids = post_round_robin(&http, &apps, N, "any").await;
    let seen: Streams = ids.iter().map(|id| (id.clone(), Arc::default())).collect();
    let bases: Vec<String> = apps.iter().map(|a| a.base.clone()).collect();
    // First streams on the admitting replica, cut after a while (the readers' own deadline).
    let first = attach_each(&http, &ids, &seen, |i| bases[i % 3].clone(), Duration::from_secs(3)).await;
    for r in first {
        r.await.unwrap();
    }
    let cut = ids.iter().filter(|id| seen[*id].lock().unwrap().terminal().is_none()).count();
    assert!(cut >= N / 2, "the streams were not cut mid-run: only {cut} unfinished");
    // Every stream re-attached on ANOTHER replica (not the owner): backlog from the store, then
    // the rest as it is stored, to the end.
    for r in attach_each(&http, &ids, &seen, |i| bases[(i + 1) % 3].clone(), Duration::from_secs(90)).await {
        r.await.unwrap();
    }
    let problems = problems(&ids, &seen, "any");
    assert!(problems.is_empty(), "{} of {N} runs wrong ({cut} were cut):\n{}", problems.len(), problems.join("\n"));
    // A run document from a replica that does not own the run.
    let doc: Value = http.get(format!("{}/v1/runs/{}", bases[2], ids[0])).send().await.unwrap().json().await.unwrap();
    assert_eq!(doc["status"], "ok", "{doc}");

    // Abort posted to r1 for a run of r0, followed on r2: the owner cancels the gateway run.
    let run = post_run(&http, &bases[0], &body(1000, "abort")).await;
    let follower = Arc::new(Mutex::new(Seen::default()));
    let reader = tokio::spawn(read_stream(attach(&http, &bases[2], &run, 0).await, follower.clone(), Duration::from_secs(60)));
    let deadline = Instant::now() + Duration::from_secs(30);
    while follower.lock().unwrap().text().is_empty() {
        assert!(Instant::now() < deadline, "the run did not stream");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = http.post(format!("{}/v1/runs/{run}/abort", bases[1])).send().await.unwrap();
    assert_eq!(r.status(), 202);
    let answer: Value = r.json().await.unwrap();
    assert_eq!(answer["aborted"], true, "{answer}");
    reader.await.unwrap();
    {
        let s = follower.lock().unwrap();
        let t = s.terminal().unwrap_or_else(|| panic!("no terminal event: {:?}", s.events));
        assert_eq!((t.event.as_str(), t.data["code"].as_str()), ("error", Some("aborted")), "{t:?}");
    }
    let doc: Value = http.get(format!("{}/v1/runs/{run}", bases[1])).send().await.unwrap().json().await.unwrap();
    assert_eq!(doc["status"], "aborted", "{doc}");
    let gw_run = gw.runs().into_iter().find(|r| r.message.contains("<abort-1000>")).expect("the gateway ran it");
    assert!(gw_run.abort_requests >= 1 && gw_run.aborted, "the gateway run was not cancelled: {gw_run:?}");
}

#[actix_rt::test]
async fn pg_a_handoff_shutdown_hands_the_runs_to_another_replica_at_once_not_a_lease_later() {
    let Some(url) = database("pg_handoff_to_a_replica").await else { return };
    const N: usize = 10;
    let gw = gateway_at(0.3);
    let http = http();
    // A lease far longer than the test waits: only the released leases can explain a takeover.
    let mut apps: Vec<Clawmux> = (0..2)
        .map(|i| {
            let id = format!("h{i}");
            Clawmux::new(&gw.url(), GW_TOKEN, &[("CLAWMUX_DEVICE_IDENTITY", "off"), ("CLAWMUX_STORE_URL", &url), ("CLAWMUX_REPLICA_ID", &id), ("CLAWMUX_RUN_LEASE_SEC", "600")])
        })
        .collect();
    for a in &mut apps {
        a.start(&http).await;
    }
    let mut ids = Vec::new();
    for i in 0..N {
        ids.push(post_run(&http, &apps[0].base, &body(i, "ho")).await);
    }
    let seen: Streams = ids.iter().map(|id| (id.clone(), Arc::default())).collect();
    let b0 = apps[0].base.clone();
    let readers = attach_each(&http, &ids, &seen, |_| b0.clone(), Duration::from_secs(90)).await;
    until_all_stream(&seen, &ids.iter().collect::<Vec<_>>()).await;
    let stopped = Instant::now();
    apps[0].sigterm();
    for r in readers {
        r.await.unwrap();
    }
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    loop {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM runs WHERE owner = 'h0'").fetch_one(&pool).await.unwrap();
        if left == 0 {
            break;
        }
        assert!(stopped.elapsed() < Duration::from_secs(60), "{left} runs not taken over within 60 s of the handoff (lease 600 s)");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("handoff to another replica: every run claimed {:.2} s after SIGTERM", stopped.elapsed().as_secs_f64());
    let b1 = apps[1].base.clone();
    for r in attach_each(&http, &ids, &seen, |_| b1.clone(), Duration::from_secs(90)).await {
        r.await.unwrap();
    }
    let problems = problems(&ids, &seen, "ho");
    assert!(problems.is_empty(), "{} of {N} runs wrong:\n{}", problems.len(), problems.join("\n"));
    pool.close().await;
}

#[actix_rt::test]
async fn pg_two_replicas_racing_runs_of_one_session_key_never_interleave_them_at_the_gateway() {
    let Some(url) = database("pg_session_key_fifo").await else { return };
    const N: usize = 50;
    let gw = gateway_at(5.0);
    let http = http();
    let mut apps: Vec<Clawmux> = (0..2)
        .map(|i| {
            let id = format!("f{i}");
            Clawmux::new(&gw.url(), GW_TOKEN, &[("CLAWMUX_DEVICE_IDENTITY", "off"), ("CLAWMUX_STORE_URL", &url), ("CLAWMUX_REPLICA_ID", &id), ("CLAWMUX_RUN_LEASE_SEC", LEASE_SEC)])
        })
        .collect();
    for a in &mut apps {
        a.start(&http).await;
    }
    // Both replicas admit runs of one conversation (one session key) at the same time.
    let fifo_body = |i: usize| json!({"message": format!("<fifo-{i}> [track:long]"), "billingAccountId": "acct-fifo", "stateKey": "one-conversation", "onDisconnect": "continue"});
    let posts = apps.iter().enumerate().map(|(r, app)| {
        let (http, base) = (http.clone(), app.base.clone());
        async move {
            let mut out = Vec::new();
            for i in (r..N).step_by(2) {
                out.push((i, post_run(&http, &base, &fifo_body(i)).await));
            }
            out
        }
    });
    let ids: HashMap<usize, String> = futures_util::future::join_all(posts).await.into_iter().flatten().collect();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let done: i64 = sqlx::query_scalar("SELECT count(*) FROM runs WHERE finished_at IS NOT NULL").fetch_one(&pool).await.unwrap();
        if done == N as i64 {
            break;
        }
        assert!(Instant::now() < deadline, "{done} of {N} runs ended within 90 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rows: Vec<(String, String, String)> = sqlx::query_as("SELECT run_id, status, owner FROM runs ORDER BY seq").fetch_all(&pool).await.unwrap();
    assert!(rows.iter().all(|(_, status, _)| status == "ok"), "{rows:?}");
    let admitted: Vec<&str> = rows.iter().map(|(id, _, _)| id.as_str()).collect();
    // The gateway's own record: started in admission order, each after the previous one ended.
    let mut started: Vec<(std::time::Instant, Option<std::time::Instant>, String)> = gw
        .runs()
        .into_iter()
        .map(|r| {
            let i: usize = r.message.trim_start_matches("<fifo-").split('>').next().unwrap().parse().unwrap();
            (r.accepted_at, r.finished_at, ids[&i].clone())
        })
        .collect();
    started.sort_by_key(|(at, _, _)| *at);
    let order: Vec<&str> = started.iter().map(|(_, _, id)| id.as_str()).collect();
    assert_eq!(order, admitted, "the gateway started them out of admission order");
    for w in started.windows(2) {
        let ended = w[0].1.expect("ended at the gateway");
        assert!(ended <= w[1].0, "{} started before {} ended: interleaved", w[1].2, w[0].2);
    }
    let owners: HashSet<&str> = rows.iter().map(|(_, _, o)| o.as_str()).collect();
    assert_eq!(owners.len(), 1, "one replica ran the session key: {owners:?}");
    pool.close().await;
}

/// The database goes away for longer than a lease while two replicas stream runs, then comes back:
/// no stream hangs, admission answers `503` + `Retry-After` on both replicas meanwhile and
/// recovers by itself, and no run is lost, ended twice or started twice: each replica suspends its
/// runs while the store is out of reach (their gateway runs go on, their streams end without a
/// terminal event) and continues them once it answers; clients re-attach and see each run end
/// once, `final`, as the store has it.
#[actix_rt::test]
async fn pg_a_database_outage_longer_than_a_lease_under_two_replicas_hangs_no_run_and_ends_none_twice() {
    if own_postgres::server_url("pg_a_database_outage").is_none() {
        return;
    }
    // Directly under the temp dir: the server's own user must reach its directory.
    let tmp = tempfile::Builder::new().prefix("clawmux-pg-outage.").tempdir().unwrap();
    let pg = own_postgres::OwnPostgres::start(tmp.path());
    const N: usize = 20;
    let gw = gateway_at(0.3);
    let http = http();
    let mut apps = replicas_n(&gw, &pg.url, &http, 2).await;
    let ids = post_round_robin(&http, &apps, N, "out").await;
    let seen: Streams = ids.iter().map(|id| (id.clone(), Arc::default())).collect();
    let bases: Vec<String> = apps.iter().map(|a| a.base.clone()).collect();
    let readers = attach_each(&http, &ids, &seen, |i| bases[i % 2].clone(), Duration::from_secs(120)).await;
    until_all_stream(&seen, &ids.iter().collect::<Vec<_>>()).await;

    pg.stop();
    let stopped = Instant::now();
    for (i, base) in bases.iter().enumerate() {
        let r = tokio::time::timeout(Duration::from_secs(60), http.post(format!("{base}/v1/runs?wait=false")).json(&body(100 + i, "out")).send())
            .await
            .expect("POST answered")
            .unwrap();
        let retry_after = r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned());
        assert_eq!(r.status(), 503, "replica r{i} while the database is down: {:?}", r.text().await);
        assert!(retry_after.is_some_and(|s| s.parse::<u64>().is_ok_and(|n| n > 0)), "r{i}: no Retry-After");
    }
    // Longer than a lease: every lease has expired when the database is back.
    let lease = Duration::from_secs(LEASE_SEC.parse().unwrap());
    tokio::time::sleep((lease * 2).saturating_sub(stopped.elapsed())).await;
    let cut_during_outage = ids.iter().filter(|id| seen[*id].lock().unwrap().cut > 0).count();
    pg.restart();

    for r in readers {
        tokio::time::timeout(Duration::from_secs(150), r).await.expect("a stream hung").unwrap();
    }
    // Admission recovers on both replicas by itself.
    for (i, base) in bases.iter().enumerate() {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let r = http.post(format!("{base}/v1/runs?wait=false")).json(&body(200 + i, "out")).send().await.unwrap();
            if r.status() == 202 {
                break;
            }
            assert_eq!(r.status(), 503, "r{i}: {:?}", r.text().await);
            assert!(Instant::now() < deadline, "r{i}: admission did not recover within 60 s of the database's return");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    reattach_until_ended(&http, &ids, &seen, |i| bases[(i + 1) % 2].clone()).await;
    let pool = sqlx::PgPool::connect(&pg.url).await.unwrap();
    // Give a wrong takeover the time to happen (a few takeover looks) before judging.
    tokio::time::sleep(lease * 2).await;
    let wrong = ends_as_seen(&pool, &ids, &seen).await;
    assert!(wrong.is_empty(), "{} of {N} runs wrong:\n{}", wrong.len(), wrong.join("\n"));
    let claims: i64 = sqlx::query_scalar("SELECT coalesce(sum(claims), 0)::bigint FROM runs WHERE run_id = ANY($1)").bind(&ids).fetch_one(&pool).await.unwrap();
    eprintln!("database outage of {:.1} s: every run final; {cut_during_outage} streams cut by it, {claims} claims", lease.as_secs_f64() * 2.0);
    assert!(cut_during_outage > 0, "no run was in flight when the database stopped");
    let requests = gw.stats().requests_received;
    assert_eq!(requests.get("agent").copied(), Some(N as u64 + 2), "agent requests (no run started twice): {requests:?}");
    for app in &mut apps {
        assert!(app.running(), "a replica exited while the database was down: {}", app.log());
    }
    pool.close().await;
}

/// Re-attaches every run whose client has not seen its end yet (on `base_of(i)`, with
/// `Last-Event-ID`) until each has, bounded.
async fn reattach_until_ended(http: &reqwest::Client, ids: &[String], seen: &Streams, base_of: impl Fn(usize) -> String) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let open = ids.iter().filter(|id| seen[*id].lock().unwrap().terminal().is_none()).count();
        if open == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "{open} runs never ended for their clients");
        for r in attach_each(http, ids, seen, &base_of, Duration::from_secs(60)).await {
            r.await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What is wrong with the runs' ends: each must have exactly one terminal event in the store, the
/// very one its client saw (name, id and data), and the client's whole stream must be right
/// (ids without gap or repeat, its own text, ending `final`: no run is ended by an outage).
async fn ends_as_seen(pool: &sqlx::PgPool, ids: &[String], seen: &Streams) -> Vec<String> {
    let terminals: Vec<(String, String, i64, String)> = sqlx::query_as("SELECT run_id, name, id, data FROM events WHERE run_id = ANY($1) AND name IN ('final', 'error') ORDER BY run_id, id")
        .bind(ids)
        .fetch_all(pool)
        .await
        .unwrap();
    let mut wrong = Vec::new();
    for id in ids {
        let stored: Vec<&(String, String, i64, String)> = terminals.iter().filter(|t| &t.0 == id).collect();
        let s = seen[id].lock().unwrap();
        let Some(client) = s.terminal() else {
            wrong.push(format!("{id}: the client saw no end ({} events, cut {})", s.events.len(), s.cut));
            continue;
        };
        match stored.as_slice() {
            [(_, name, eid, data)] if *name == client.event && u64::try_from(*eid).ok() == Some(client.id) && serde_json::from_str::<Value>(data).ok().as_ref() == Some(&client.data) => {}
            other => wrong.push(format!("{id}: client saw {} {} (id {}), the store has {other:?}", client.event, client.data, client.id)),
        }
        if let Some(p) = s.problems() {
            wrong.push(format!("{id}: {}", p.chars().take(300).collect::<String>()));
        }
    }
    wrong
}

/// A run the admitting replica stores for another one (its session key runs there) is answered
/// like a run of its own: `?wait=true` waits for its end (it was `202` at once before), and a
/// caller that asked for `onDisconnect: abort` cancels it by going away (it ran on before).
#[actix_rt::test]
async fn pg_a_run_stored_for_another_replica_is_waited_for_and_its_callers_disconnect_aborts_it() {
    let Some(url) = database("pg_assigned_wait_and_disconnect").await else { return };
    let gw = gateway_at(1.0);
    let http = http();
    let apps = replicas_n(&gw, &url, &http, 2).await;
    let (b0, b1) = (apps[0].base.clone(), apps[1].base.clone());
    let run = |tag: &str, on_disconnect: &str| {
        json!({"message": format!("<{tag}> [track:long]"), "billingAccountId": "acct-w", "stateKey": "shared-conversation", "onDisconnect": on_disconnect})
    };
    // r0 runs the conversation; the next runs of it posted to r1 are r0's to run.
    let first = post_run(&http, &b0, &run("first", "continue")).await;
    // Waits on r1 for a run r0 runs.
    let waited = {
        let (http, b1, body) = (http.clone(), b1.clone(), run("waited", "continue"));
        tokio::spawn(async move {
            let r = http.post(format!("{b1}/v1/runs")).json(&body).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        })
    };
    // A caller on r1 who asked for abort-on-disconnect streams the third run, then goes away
    // while it still waits for its turn.
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while sqlx::query_scalar::<_, i64>("SELECT count(*) FROM runs").fetch_one(&pool).await.unwrap() < 2 {
        assert!(Instant::now() < deadline, "the waited run was not admitted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let resp = http.post(format!("{b1}/v1/runs")).header("accept", "text/event-stream").json(&run("gone", "abort")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let gone: String = sqlx::query_scalar("SELECT run_id FROM runs WHERE spec::jsonb->>'message' LIKE '<gone>%'").fetch_one(&pool).await.unwrap();
    let owner: String = sqlx::query_scalar("SELECT owner FROM runs WHERE run_id = $1").bind(&gone).fetch_one(&pool).await.unwrap();
    assert_eq!(owner, "r0", "the third run is the session key's owner's");
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(resp);

    let (status, doc) = tokio::time::timeout(Duration::from_secs(60), waited).await.expect("the waiting POST answered").unwrap();
    assert_eq!(status, 200, "?wait=true on the replica that did not run it: {doc}");
    assert_eq!(doc["status"], "ok", "{doc}");
    assert!(doc["content"].as_str().unwrap().starts_with("<waited> [track:long] | "), "{doc}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        let doc: Value = http.get(format!("{b0}/v1/runs/{gone}")).send().await.unwrap().json().await.unwrap();
        if doc["status"] != "queued" && doc["status"] != "running" {
            break doc["status"].as_str().unwrap().to_owned();
        }
        assert!(Instant::now() < deadline, "the run whose caller went away is still {}", doc["status"]);
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(status, "aborted", "the caller went away with onDisconnect: abort");
    // It never reached the gateway: it was cancelled while it waited for its turn.
    assert!(!gw.runs().iter().any(|r| r.message.contains("<gone>")), "the aborted run was started");
    let first_doc: Value = http.get(format!("{b1}/v1/runs/{first}")).send().await.unwrap().json().await.unwrap();
    assert_eq!(first_doc["status"], "ok", "{first_doc}");
    pool.close().await;
}

/// An account's limits hold across replicas: live runs and admissions per minute are counted by
/// the database in the admitting transaction (a burst split over two replicas admits exactly the
/// limit, not the limit per replica), and a token budget spent through one replica's proxy refuses
/// the account's next run on the other (its spend is read from the store, not from a copy it
/// loaded before).
#[actix_rt::test]
async fn pg_account_limits_and_token_budgets_hold_across_replicas() {
    let Some(url) = database("pg_account_limits_across_replicas").await else { return };
    let dir = common::temp_dir("replica-limits");
    let llm = common::FakeLlm::start(&dir.join("llm"));
    let gw = gateway_at(1.0);
    gw.set_paused(true); // admitted runs stay live: they count toward the concurrency cap
    let http = http();
    let upstream = llm.url();
    let proxies: Vec<String> = (0..2).map(|_| format!("127.0.0.1:{}", child::free_port())).collect();
    let mut apps = Vec::new();
    for (i, proxy) in proxies.iter().enumerate() {
        let (id, audit) = (format!("l{i}"), dir.join(format!("audit-{i}")).display().to_string());
        let mut app = Clawmux::new(
            &gw.url(),
            GW_TOKEN,
            &[
                ("CLAWMUX_DEVICE_IDENTITY", "off"),
                ("CLAWMUX_STORE_URL", &url),
                ("CLAWMUX_REPLICA_ID", &id),
                ("CLAWMUX_RUN_LEASE_SEC", LEASE_SEC),
                ("CLAWMUX_LLM_UPSTREAM_URL", &upstream),
                ("CLAWMUX_PROXY_LISTEN", proxy),
                ("CLAWMUX_AUDIT_DIR", &audit),
            ],
        );
        app.start(&http).await;
        apps.push(app);
    }
    let bases: Vec<String> = apps.iter().map(|a| a.base.clone()).collect();
    // Set on each replica (each keeps the limits it was told; the store has them once).
    let limits = [("acct-conc", json!({"maxConcurrent": 6})), ("acct-rate", json!({"maxRunsPerMinute": 9})), ("acct-tok", json!({"maxTokens": 25, "periodSec": 86400}))];
    for base in &bases {
        for (account, l) in &limits {
            let r = http.put(format!("{base}/v1/admin/accounts/{account}/limits")).json(l).send().await.unwrap();
            assert_eq!(r.status(), 200, "{:?}", r.text().await);
        }
    }

    // 40 runs of each account, posted at once, alternating between the replicas.
    let posts: Vec<(usize, &str)> = (0..80).map(|i| (i, if i % 2 == 0 { "acct-conc" } else { "acct-rate" })).collect();
    let answers: Vec<(&str, u16, Option<u64>)> = futures_util::future::join_all(posts.iter().map(|(i, account)| {
        let (http, base) = (http.clone(), bases[(i / 2) % 2].clone());
        let body = json!({"message": format!("<lim-{i}>"), "billingAccountId": account, "onDisconnect": "continue"});
        async move {
            let r = http.post(format!("{base}/v1/runs?wait=false")).json(&body).send().await.unwrap();
            let retry = r.headers().get("retry-after").and_then(|v| v.to_str().ok()?.parse().ok());
            (*account, r.status().as_u16(), retry)
        }
    }))
    .await;
    for (account, admitted) in [("acct-conc", 6), ("acct-rate", 9)] {
        let statuses: Vec<u16> = answers.iter().filter(|a| a.0 == account).map(|a| a.1).collect();
        let ok = statuses.iter().filter(|s| **s == 202).count();
        let limited = statuses.iter().filter(|s| **s == 429).count();
        assert_eq!((ok, limited), (admitted, 40 - admitted), "{account} over two replicas: {statuses:?}");
        assert!(answers.iter().filter(|a| a.0 == account && a.1 == 429).all(|a| a.2.is_some_and(|r| r >= 1)), "{account}: 429 without Retry-After");
    }
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM runs WHERE billing_account_id IN ('acct-conc', 'acct-rate')").fetch_one(&pool).await.unwrap();
    assert_eq!(stored, 15, "refused runs left nothing behind");

    // Token budget: l1 loads the account's spend (its first run), then a run on l0 spends past the
    // cap through l0's proxy; l1 must refuse the account's next run. A conversation of the
    // account runs on l0 meanwhile: its next run, posted to l1, would be stored for l0.
    let first = post_run(&http, &bases[1], &json!({"message": "<tok-1>", "billingAccountId": "acct-tok", "onDisconnect": "continue"})).await;
    let conv = |tag: &str| json!({"message": format!("<{tag}>"), "billingAccountId": "acct-tok", "stateKey": "tok-conversation", "onDisconnect": "continue"});
    post_run(&http, &bases[0], &conv("tok-conv-1")).await;
    let (trace, traceparent) = common::new_traceparent();
    let r = http
        .post(format!("{}/v1/runs?wait=false", bases[0]))
        .header("traceparent", traceparent)
        .json(&json!({"message": "<tok-2>", "billingAccountId": "acct-tok", "onDisconnect": "continue"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    for n in 0..2 {
        let span = &uuid::Uuid::new_v4().simple().to_string()[..16];
        let r = http
            .post(format!("http://{}/v1/chat/completions", proxies[0]))
            .header("traceparent", format!("00-{trace}-{span}-01"))
            .json(&common::chat_body(&format!("TOKCALL{n} budget test padding text.."), true))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "call {n} starts under the cap");
        assert!(r.text().await.unwrap().contains("[DONE]"));
    }
    // The proxy stores a call's tokens as it sees them (group commit, within milliseconds).
    let deadline = Instant::now() + Duration::from_secs(10);
    while sqlx::query_scalar::<_, Option<i64>>("SELECT max(tokens) FROM spend WHERE billing_account_id = 'acct-tok'").fetch_one(&pool).await.unwrap().unwrap_or(0) < 25 {
        assert!(Instant::now() < deadline, "the spend was not stored");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let r = http.post(format!("{}/v1/runs?wait=false", bases[1])).json(&json!({"message": "<tok-3>", "billingAccountId": "acct-tok"})).send().await.unwrap();
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    assert_eq!((status, body["error"]["code"].as_str()), (402, Some("budget_exceeded")), "the other replica's spend counts: {body}");
    // Refused in the admitting transaction: l0, which runs the conversation, never gets it.
    let r = http.post(format!("{}/v1/runs?wait=false", bases[1])).json(&conv("tok-conv-2")).send().await.unwrap();
    assert_eq!(r.status(), 402, "{:?}", r.text().await);
    let first_doc: Value = http.get(format!("{}/v1/runs/{first}", bases[0])).send().await.unwrap().json().await.unwrap();
    assert_eq!(first_doc["status"], "running", "the account's earlier run goes on: {first_doc}");
    gw.set_paused(false);
    let deadline = Instant::now() + Duration::from_secs(60);
    while sqlx::query_scalar::<_, i64>("SELECT count(*) FROM runs WHERE billing_account_id = 'acct-tok' AND finished_at IS NULL").fetch_one(&pool).await.unwrap() > 0 {
        assert!(Instant::now() < deadline, "the account's runs did not end");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!gw.runs().iter().any(|r| r.message.contains("<tok-conv-2>")), "a run refused 402 ran on the gateway");
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM runs WHERE spec::jsonb->>'message' = '<tok-conv-2>'").fetch_one(&pool).await.unwrap();
    assert_eq!(stored, 0, "a run refused 402 was stored");
    pool.close().await;
}

/// A network partition between ONE replica and the database (the other still reaches it), for
/// longer than a lease, while both stream runs: the partitioned replica's runs are taken over by
/// the other and end exactly once; what every client sees in the end (re-attaching to the
/// reachable replica with `Last-Event-ID` whenever its stream ends without a terminal event) is
/// that one end, and no run is started twice on the gateway.
#[actix_rt::test]
async fn pg_a_partition_between_one_replica_and_the_database_ends_each_run_once_as_its_clients_see_it() {
    partition_one_replica("pg_partition_one_replica", false).await;
}

/// The same partition, but silent: packets are dropped, connections stay open (no reset). The
/// partitioned replica must find out by itself (its statements get no answer in time) and suspend
/// its runs, not hang their streams.
#[actix_rt::test]
async fn pg_a_silent_partition_between_one_replica_and_the_database_hangs_no_stream_and_ends_each_run_once() {
    partition_one_replica("pg_silent_partition", true).await;
}

async fn partition_one_replica(test: &str, silent: bool) {
    let Some(url) = database(test).await else { return };
    let (relay, relayed_url) = tcp_chaos::in_front_of_database(&url).await;
    const N: usize = 20;
    let gw = gateway_at(0.3);
    let http = http();
    let mut apps = Vec::new();
    for (id, store) in [("p0", &relayed_url), ("p1", &url)] {
        let mut app = Clawmux::new(&gw.url(), GW_TOKEN, &[("CLAWMUX_DEVICE_IDENTITY", "off"), ("CLAWMUX_STORE_URL", store), ("CLAWMUX_REPLICA_ID", id), ("CLAWMUX_RUN_LEASE_SEC", LEASE_SEC)]);
        app.start(&http).await;
        apps.push(app);
    }
    let bases: Vec<String> = apps.iter().map(|a| a.base.clone()).collect();
    let ids = post_round_robin(&http, &apps, N, "part").await;
    let seen: Streams = ids.iter().map(|id| (id.clone(), Arc::default())).collect();
    let readers = attach_each(&http, &ids, &seen, |i| bases[i % 2].clone(), Duration::from_secs(120)).await;
    until_all_stream(&seen, &ids.iter().collect::<Vec<_>>()).await;

    // p0 loses the database for two leases: its connections are reset and new ones refused, or
    // (silent) nothing passes either way while the sockets stay open.
    if silent {
        relay.stall();
    } else {
        relay.refuse(true);
        relay.cut_all();
    }
    let lease = Duration::from_secs(LEASE_SEC.parse().unwrap());
    tokio::time::sleep(lease * 2).await;
    if silent {
        relay.resume();
    } else {
        relay.refuse(false);
    }
    for r in readers {
        tokio::time::timeout(Duration::from_secs(150), r).await.expect("a stream hung").unwrap();
    }
    // Every client that has not seen an end re-attaches on p1 until it does (bounded).
    reattach_until_ended(&http, &ids, &seen, |_| bases[1].clone()).await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let wrong = ends_as_seen(&pool, &ids, &seen).await;
    let claims: i64 = sqlx::query_scalar("SELECT coalesce(sum(claims), 0)::bigint FROM runs").fetch_one(&pool).await.unwrap();
    eprintln!("partition of one replica for {:.0} s: {claims} claims", (lease * 2).as_secs_f64());
    assert!(wrong.is_empty(), "{} of {N} runs wrong:\n{}", wrong.len(), wrong.join("\n"));
    let requests = gw.stats().requests_received;
    assert_eq!(requests.get("agent").copied(), Some(N as u64), "agent requests (no run started twice): {requests:?}");
    for app in &mut apps {
        assert!(app.running(), "a replica exited during the partition: {}", app.log());
    }
    pool.close().await;
}

/// A short network blip between the ONLY replica and the database (shorter than a lease): its runs
/// are suspended while the store is out of reach and the replica itself continues them when it
/// answers again (no other replica could take them over): each ends once, `final`, as its client
/// sees it, and the gateway never started one twice.
#[actix_rt::test]
async fn pg_after_a_short_database_blip_the_only_replica_continues_its_suspended_runs() {
    let Some(url) = database("pg_blip_readopt").await else { return };
    let (relay, relayed) = tcp_chaos::in_front_of_database(&url).await;
    const N: usize = 10;
    let gw = gateway_at(0.3);
    let http = http();
    let mut app = Clawmux::new(
        &gw.url(),
        GW_TOKEN,
        &[("CLAWMUX_DEVICE_IDENTITY", "off"), ("CLAWMUX_STORE_URL", relayed.as_str()), ("CLAWMUX_REPLICA_ID", "b0"), ("CLAWMUX_RUN_LEASE_SEC", "10")],
    );
    app.start(&http).await;
    let ids = post_round_robin(&http, std::slice::from_ref(&app), N, "blip").await;
    let seen: Streams = ids.iter().map(|id| (id.clone(), Arc::default())).collect();
    let base = app.base.clone();
    let readers = attach_each(&http, &ids, &seen, |_| base.clone(), Duration::from_secs(120)).await;
    until_all_stream(&seen, &ids.iter().collect::<Vec<_>>()).await;
    // A conversation's first run streams too; its next run is posted right after the blip.
    let conversation = |i: usize| json!({"message": format!("<conv-{i}> [track:long]"), "billingAccountId": "acct-conv", "stateKey": "blip-conversation", "onDisconnect": "continue"});
    let first = post_run(&http, &base, &conversation(1)).await;
    wait_accepted_doc(&http, &base, &first).await;
    relay.refuse(true);
    relay.cut_all();
    tokio::time::sleep(Duration::from_secs(1)).await;
    relay.refuse(false);
    // Refused (503) until the replica has taken its suspended runs back; then it waits its turn
    // behind the conversation's first run, never beside it.
    let deadline = Instant::now() + Duration::from_secs(60);
    let second = loop {
        let r = http.post(format!("{base}/v1/runs?wait=false")).json(&conversation(2)).send().await.unwrap();
        if r.status() == 202 {
            break r.json::<Value>().await.unwrap()["runId"].as_str().unwrap().to_owned();
        }
        assert_eq!(r.status(), 503, "{:?}", r.text().await);
        assert!(Instant::now() < deadline, "admission did not come back after the blip");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for r in readers {
        tokio::time::timeout(Duration::from_secs(150), r).await.expect("a stream hung").unwrap();
    }
    reattach_until_ended(&http, &ids, &seen, |_| base.clone()).await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let wrong = ends_as_seen(&pool, &ids, &seen).await;
    assert!(wrong.is_empty(), "{} of {N} runs wrong:\n{}", wrong.len(), wrong.join("\n"));
    let cut = ids.iter().filter(|id| seen[*id].lock().unwrap().cut > 0).count();
    assert!(cut > 0, "no stream was cut by the blip: it tested nothing");
    assert!(app.log().contains("continued the runs suspended here"), "the replica did not continue its suspended runs: {}", app.log());
    let deadline = Instant::now() + Duration::from_secs(90);
    while sqlx::query_scalar::<_, i64>("SELECT count(*) FROM runs WHERE run_id = ANY($1) AND finished_at IS NULL").bind([&first, &second]).fetch_one(&pool).await.unwrap() > 0 {
        assert!(Instant::now() < deadline, "the conversation's runs did not end");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let conv: Vec<_> = gw.runs().into_iter().filter(|r| r.message.starts_with("<conv-")).collect();
    assert_eq!(conv.len(), 2, "{conv:?}");
    let (a, b) = if conv[0].message.starts_with("<conv-1>") { (&conv[0], &conv[1]) } else { (&conv[1], &conv[0]) };
    assert!(a.finished_at.is_some_and(|end| end <= b.accepted_at), "the conversation's second run started while its first still ran on the gateway");
    let requests = gw.stats().requests_received;
    assert_eq!(requests.get("agent").copied(), Some(N as u64 + 2), "agent requests (no run started twice): {requests:?}");
    pool.close().await;
}

/// Waits (bounded) until the gateway acknowledged the run (its document has a gateway run id).
async fn wait_accepted_doc(http: &reqwest::Client, base: &str, run_id: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let doc: Value = http.get(format!("{base}/v1/runs/{run_id}")).send().await.unwrap().json().await.unwrap();
        if !doc["gatewayRunId"].is_null() {
            return;
        }
        assert!(Instant::now() < deadline, "run {run_id} not accepted: {doc}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `ifBusy` holds for a run stored for the replica its session key runs on: `reject` is answered
/// `409 session_busy` at once by the replica that took the request (nothing stored), and
/// `interrupt` ends the running run of the session `aborted` and runs next, before a run of the
/// session that was queued earlier (it was `enqueue` for such runs before).
#[actix_rt::test]
async fn pg_if_busy_reject_and_interrupt_hold_for_a_run_stored_for_another_replica() {
    let Some(url) = database("pg_if_busy_across_replicas").await else { return };
    let gw = gateway_at(0.3);
    let http = http();
    let apps = replicas_n(&gw, &url, &http, 2).await;
    let (b0, b1) = (apps[0].base.clone(), apps[1].base.clone());
    let run = |tag: &str, if_busy: &str| {
        json!({"message": format!("<{tag}> [track:long]"), "billingAccountId": "acct-busy", "stateKey": "busy-conversation", "ifBusy": if_busy, "onDisconnect": "continue"})
    };
    let holder = post_run(&http, &b0, &run("holder", "enqueue")).await;
    let follower = Arc::new(Mutex::new(Seen::default()));
    let reader = tokio::spawn(read_stream(attach(&http, &b0, &holder, 0).await, follower.clone(), Duration::from_secs(60)));
    let deadline = Instant::now() + Duration::from_secs(30);
    while follower.lock().unwrap().text().is_empty() {
        assert!(Instant::now() < deadline, "the holder did not stream");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Queued behind the holder (on r0, through r1).
    let queued = post_run(&http, &b1, &run("queued", "enqueue")).await;
    // reject, through r1: the session is busy on r0.
    let r = http.post(format!("{b1}/v1/runs?wait=false")).json(&run("rejected", "reject")).send().await.unwrap();
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    assert_eq!((status, body["error"]["code"].as_str()), (409, Some("session_busy")), "{body}");
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM runs").fetch_one(&pool).await.unwrap();
    assert_eq!(stored, 2, "the rejected run left nothing behind");
    // interrupt, through r1: the holder ends aborted, the interrupter runs before `queued`.
    let interrupter = post_run(&http, &b1, &run("interrupter", "interrupt")).await;
    reader.await.unwrap();
    {
        let s = follower.lock().unwrap();
        let t = s.terminal().unwrap_or_else(|| panic!("the holder did not end: {:?}", s.events));
        assert_eq!((t.event.as_str(), t.data["code"].as_str()), ("error", Some("aborted")), "{t:?}");
    }
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let done: i64 = sqlx::query_scalar("SELECT count(*) FROM runs WHERE finished_at IS NOT NULL").fetch_one(&pool).await.unwrap();
        if done == 3 {
            break;
        }
        assert!(Instant::now() < deadline, "{done} of 3 runs ended within 90 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut started: Vec<(std::time::Instant, String)> = gw.runs().into_iter().map(|r| (r.accepted_at, r.message)).collect();
    started.sort();
    let order: Vec<&str> = started.iter().map(|(_, m)| m.split('>').next().unwrap_or_default()).collect();
    assert_eq!(order, ["<holder", "<interrupter", "<queued"], "the gateway's order");
    for (id, want) in [(&interrupter, "ok"), (&queued, "ok"), (&holder, "aborted")] {
        let doc: Value = http.get(format!("{b1}/v1/runs/{id}")).send().await.unwrap().json().await.unwrap();
        assert_eq!(doc["status"], want, "{doc}");
    }
    pool.close().await;
}
