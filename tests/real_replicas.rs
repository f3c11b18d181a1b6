//! Two clawmux replicas on one PostgreSQL and one REAL OpenClaw gateway (openclaw@2026.9.6,
//! protocol 4) whose model provider is a LOAD-BALANCED address in front of both replicas' LLM
//! proxies (a TCP load balancer in this test: round robin, a replica that refuses connections is
//! skipped), the fake LLM the proxies' upstream. The gateway's calls land on either proxy, the runs
//! of one replica included; one replica is killed with `kill -9` while every run streams. Every run
//! must end once with its own text, every call the upstream saw must carry its own run's account,
//! and each run's usage must sum every call, whichever replica forwarded it (issue 14, item 6).
//!
//! `tests/run.sh` starts a gateway of its own for this binary (`PROXY_PORT` = the balancer's port,
//! `PROVIDER_BASE_URL` at it, `FAKE_LLM_CHUNKS`/`FAKE_LLM_DELAY` for answers of ~10 s) and a
//! PostgreSQL, and runs it with `CLAWMUX_REPLICAS_GATEWAY_ENV=<run dir>/env` and
//! `CLAWMUX_TEST_PG_URL`. Without them the test says so and returns, unless
//! `CLAWMUX_REQUIRE_REPLICAS_GATEWAY=1` (set by `tests/run.sh`), in which case it fails.

mod common;
#[path = "common/child.rs"]
mod child;
#[path = "common/proxied.rs"]
mod proxied;

use child::{attach, free_port, read_stream, Clawmux, Seen};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// The gateway and database started for this test.
struct Setup {
    url: String,
    token: String,
    llm_log: String,
    llm_port: u16,
    /// Where the gateway's provider sends LLM calls: the balancer listens there.
    lb_port: u16,
    /// The words of a plain answer (`FAKE_LLM_CHUNKS` of the gateway's fake LLM).
    words: usize,
    /// The PostgreSQL server (a database of the test's own is made on it).
    pg: String,
}

fn setup() -> Option<Setup> {
    let pg = std::env::var("CLAWMUX_TEST_PG_URL").ok();
    let env = proxied::env_file("CLAWMUX_REPLICAS_GATEWAY_ENV", "CLAWMUX_REQUIRE_REPLICAS_GATEWAY", "replicas gateway")?;
    let Some(pg) = pg else {
        assert!(std::env::var("CLAWMUX_REQUIRE_REPLICAS_GATEWAY").as_deref() != Ok("1"), "CLAWMUX_REQUIRE_REPLICAS_GATEWAY=1 but CLAWMUX_TEST_PG_URL is not set: run tests/run.sh");
        eprintln!("PostgreSQL not started (run tests/run.sh); skipping");
        return None;
    };
    let get = |k: &str| proxied::get(&env, k);
    Some(Setup {
        url: get("GATEWAY_URL"),
        token: get("GATEWAY_TOKEN"),
        llm_log: get("LLM_LOG"),
        llm_port: get("LLM_PORT").parse().expect("LLM_PORT"),
        lb_port: get("PROXY_PORT").parse().expect("PROXY_PORT (the gateway's provider must point at the balancer)"),
        words: std::env::var("CLAWMUX_REPLICAS_WORDS").ok().and_then(|w| w.parse().ok()).unwrap_or(20),
        pg,
    })
}

/// A TCP load balancer: each connection goes to the next backend in turn; one that refuses the
/// connection (a killed replica) is skipped. Counts the connections each backend took.
struct Balancer {
    task: tokio::task::JoinHandle<()>,
    taken: Arc<Vec<AtomicUsize>>,
}

impl Balancer {
    async fn start(port: u16, backends: Vec<std::net::SocketAddr>) -> Self {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.expect("the balancer's port is free");
        let taken: Arc<Vec<AtomicUsize>> = Arc::new(backends.iter().map(|_| AtomicUsize::new(0)).collect());
        let counts = taken.clone();
        let next = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let (backends, counts, next) = (backends.clone(), counts.clone(), next.clone());
                tokio::spawn(async move {
                    let first = next.fetch_add(1, Ordering::Relaxed);
                    for k in 0..backends.len() {
                        let i = (first + k) % backends.len();
                        if let Ok(mut upstream) = tokio::net::TcpStream::connect(backends[i]).await {
                            counts[i].fetch_add(1, Ordering::Relaxed);
                            let _ = upstream.set_nodelay(true);
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                            return;
                        }
                    }
                });
            }
        });
        Self { task, taken }
    }

    fn taken(&self) -> Vec<usize> {
        self.taken.iter().map(|c| c.load(Ordering::Relaxed)).collect()
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The fake LLM's log: only complete lines.
fn llm_log(s: &Setup) -> Vec<Value> {
    proxied::llm_log(&s.llm_log)
}

/// One run of the test.
struct Run {
    id: String,
    account: String,
    marker: String,
    message: String,
    /// The replica that admitted it (index).
    admitted_by: usize,
}

impl Run {
    /// The answer the run must end with.
    fn expected_content(&self, words: usize) -> String {
        proxied::expected_content(&self.message, &self.marker, words)
    }
}

/// 8 runs from 4 accounts, admitted alternately by two replicas, each a tool call and then an
/// answer of ~10 s; the gateway's LLM calls go through the balancer to either replica. Replica r0
/// is killed with `kill -9` while every answer streams: its proxy's streams are cut (the gateway
/// retries them, through the balancer, on r1, which forwards them as another replica's runs until
/// it has taken them over) and its runs are taken over by r1. Every run must end once with its own
/// text, every call the upstream saw must carry its run's account and id, and each run's usage
/// must be the sum of its calls on both replicas.
#[actix_rt::test]
async fn proxied_replicas_behind_a_balanced_provider_kill_9_of_one_keeps_every_run_its_text_and_its_bill() {
    let Some(s) = setup() else { return };
    let t0 = Instant::now();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(300)).build().expect("client");
    let db = clawmux::store::postgres::create_test_database(&s.pg, "cmx_real_replicas").await.expect("a database");
    let key = format!("sk-upstream-{}", uuid::Uuid::new_v4().simple());
    let upstream = format!("http://127.0.0.1:{}", s.llm_port);
    let proxy_ports = [free_port(), free_port()];
    let balancer = Balancer::start(s.lb_port, proxy_ports.iter().map(|p| std::net::SocketAddr::from(([127, 0, 0, 1], *p))).collect()).await;
    let mut apps: Vec<Clawmux> = Vec::new();
    for (i, port) in proxy_ports.iter().enumerate() {
        let (id, listen, audit) = (format!("r{i}"), format!("127.0.0.1:{port}"), common::temp_dir(&format!("real-replicas-audit-{i}")));
        let mut app = Clawmux::new(
            &s.url,
            &s.token,
            &[
                ("CLAWMUX_STORE_URL", db.as_str()),
                ("CLAWMUX_REPLICA_ID", id.as_str()),
                ("CLAWMUX_RUN_LEASE_SEC", "3"),
                ("CLAWMUX_PROXY_LISTEN", listen.as_str()),
                ("CLAWMUX_LLM_UPSTREAM_URL", upstream.as_str()),
                ("CLAWMUX_LLM_UPSTREAM_KEY", key.as_str()),
                ("CLAWMUX_AUDIT_DIR", &audit.display().to_string()),
            ],
        );
        app.start(&http).await;
        apps.push(app);
    }

    let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let runs: Vec<Run> = (0..8)
        .map(|i| {
            let marker = format!("XR{tag}R{i}X");
            Run {
                id: format!("run-{marker}").to_lowercase(),
                account: format!("acct-replicas-{}", i % 4),
                message: format!("TOOL:{marker} replicas check {marker}"),
                marker,
                admitted_by: i % 2,
            }
        })
        .collect();
    for r in &runs {
        let body = json!({"message": r.message, "billingAccountId": r.account, "runId": r.id, "timeoutSec": 300, "onDisconnect": "continue"});
        let resp = http.post(format!("{}/v1/runs?wait=false", apps[r.admitted_by].base)).json(&body).send().await.expect("post");
        assert_eq!(resp.status(), 202, "{:?}", resp.text().await);
    }
    let seen: HashMap<String, Arc<Mutex<Seen>>> = runs.iter().map(|r| (r.id.clone(), Arc::default())).collect();
    let mut readers = Vec::new();
    for r in &runs {
        let resp = attach(&http, &apps[r.admitted_by].base, &r.id, 0).await;
        readers.push(tokio::spawn(read_stream(resp, seen[&r.id].clone(), Duration::from_secs(240))));
    }
    // Mid-stream: every run is past its tool call and a few words into its answer.
    proxied::until_all(&seen, Duration::from_secs(180), "streamed their answer", |x| x.text().contains("after-tool") && x.text().contains(" w3")).await;
    apps[0].kill_9();
    let killed_at = unix_now();
    let killed = Instant::now();
    for r in &runs {
        let x = seen[&r.id].lock().expect("seen");
        assert!(x.terminal().is_none() && !x.text().contains(&format!(" w{}", s.words)), "{}: finished before the kill", r.id);
    }
    // r0's clients re-attach on r1 (serving the run from the store until it takes it over).
    let mut again = Vec::new();
    for (r, reader) in runs.iter().zip(readers) {
        if r.admitted_by == 0 {
            reader.await.expect("reader");
            let after = seen[&r.id].lock().expect("seen").last_id();
            let resp = attach(&http, &apps[1].base, &r.id, after).await;
            again.push(tokio::spawn(read_stream(resp, seen[&r.id].clone(), Duration::from_secs(240))));
        } else {
            again.push(reader);
        }
    }
    for r in again {
        r.await.expect("reader");
    }
    let ended_after = killed.elapsed();

    // Each run: its own answer, whole and once.
    let mut problems = Vec::new();
    for r in &runs {
        let x = seen[&r.id].lock().expect("seen");
        if let Some(p) = x.problems() {
            problems.push(format!("{}: {p}", r.id));
            continue;
        }
        let content = x.terminal().map(|t| t.data["content"].as_str().unwrap_or_default().to_owned()).unwrap_or_default();
        if content != r.expected_content(s.words) {
            problems.push(format!("{}: content {content:?}, expected {:?}", r.id, r.expected_content(s.words)));
        }
    }
    assert!(problems.is_empty(), "{} of {} runs wrong:\n{}\nr1's log: {}", problems.len(), runs.len(), problems.join("\n"), apps[1].log());

    // The calls: each billed to its own run and account; each run's usage is the sum of its calls,
    // whichever replica forwarded them (a call cut by the kill counts, with no tokens).
    let log = llm_log(&s);
    let calls: Vec<&Value> = log.iter().filter(|e| e["path"] == "/v1/chat/completions").collect();
    // The streams the upstream saw cut (the client went away mid-answer), with when.
    let cut_at: HashMap<&str, f64> = log
        .iter()
        .filter(|e| e["event"] == "stream_end" && e["completed"] == false)
        .filter_map(|e| Some((e["id"].as_str()?, e["ts"].as_f64()?)))
        .collect();
    let cut: Vec<&str> = cut_at.keys().copied().collect();
    let usage: HashMap<&str, (u64, u64)> = log
        .iter()
        .filter(|e| e["event"] == "usage")
        .filter_map(|e| Some((e["id"].as_str()?, (e["prompt_tokens"].as_u64()?, e["completion_tokens"].as_u64()?))))
        .collect();
    let mut cut_by_the_kill = 0;
    for r in &runs {
        let mine: Vec<&&Value> = calls.iter().filter(|e| e["last_user"].as_str().is_some_and(|u| u.contains(&r.marker))).collect();
        for c in &mine {
            let h = &c["headers"];
            assert_eq!(h["x-cogni-run-id"], r.id.as_str(), "{}: a call attributed to another run: {c}", r.id);
            assert_eq!(h["x-litellm-end-user-id"], r.account.as_str(), "{}: a call billed to another account: {c}", r.id);
            assert_eq!(h["authorization"], format!("Bearer {key}"));
        }
        let billed = calls.iter().filter(|e| e["headers"]["x-cogni-run-id"] == r.id.as_str()).count();
        assert_eq!(billed, mine.len(), "{}: calls of other runs billed to it", r.id);
        // A stream of this run cut by the kill (r0's proxy died under it) must be followed by a
        // call of the run after it: the gateway's retry, through the balancer, on r1.
        let ts = |c: &Value| c["ts"].as_f64().unwrap_or_default();
        if let Some(cut) = mine.iter().filter_map(|c| cut_at.get(c["id"].as_str()?)).copied().filter(|t| *t >= killed_at - 1.0).reduce(f64::max) {
            cut_by_the_kill += 1;
            assert!(mine.iter().any(|c| ts(c) > cut), "{}: its stream was cut by the kill and not called again", r.id);
        }
        let (input, output) = mine
            .iter()
            .filter_map(|c| c["id"].as_str())
            .filter(|id| !cut.contains(id))
            .filter_map(|id| usage.get(id))
            .fold((0, 0), |(i, o), (a, b)| (i + a, o + b));
        let doc: Value = http.get(format!("{}/v1/runs/{}", apps[1].base, r.id)).send().await.expect("get").json().await.expect("doc");
        assert_eq!(doc["status"], "ok", "{doc}");
        assert_eq!(doc["usage"]["source"], "proxy", "{doc}");
        let got = (doc["usage"]["inputTokens"].as_u64(), doc["usage"]["outputTokens"].as_u64(), doc["usage"]["llmCalls"].as_u64());
        assert_eq!(got, (Some(input), Some(output), Some(mine.len() as u64)), "{}: usage vs. the upstream's calls: {doc}", r.id);
    }
    // How many of the 8 streams went through r0 at the kill is the balancer's and the gateway's
    // connection pool's doing (3 in one run, 4 or more in others); that the kill cut at least one is what this test needs.
    assert!(cut_by_the_kill >= 1, "the kill of r0 cut no run's stream: nothing was retried on r1");
    // The balancer spread the gateway's calls over both replicas, and r1 forwarded calls of runs it
    // did not own (r0's, before it took them over, or r0's own calls before the kill).
    let taken = balancer.taken();
    assert!(taken.iter().all(|n| *n > 0), "the balancer used one replica only: {taken:?}");
    assert!(apps[1].log().contains("forwarding the LLM calls of a run another replica owns"), "r1 forwarded no call of r0's runs");
    let refused = metric_sum(&http, &apps[1].base, "clawmux_proxy_refusals_total").await;
    assert_eq!(refused, 0.0, "r1's proxy refused calls");
    eprintln!(
        "2 replicas, 8 runs, kill -9 of r0 cut {cut_by_the_kill} streams: every run ended {:.1} s after the kill; connections per replica {taken:?}; test {:.1} s",
        ended_after.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
}

async fn metric_sum(http: &reqwest::Client, base: &str, prefix: &str) -> f64 {
    let text = http.get(format!("{base}/metrics")).send().await.expect("metrics").text().await.expect("text");
    text.lines().filter(|l| l.starts_with(prefix)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or_default()
}
