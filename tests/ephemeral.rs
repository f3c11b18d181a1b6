//! Ephemeral runs through the API, without Docker: a fake runner plays the container. It does what
//! the real one's agent does: reads its prompt from its input directory, calls the LLM through the run's
//! unix socket (the real attribution proxy in front of the project's fake LLM), prints an envelope.
//! The real engine is in `tests/docker_ephemeral.rs`.

#![allow(clippy::unwrap_used)]

mod common;
#[path = "common/ephemeral_stack.rs"]
mod ephemeral_stack;

use async_trait::async_trait;
use clawmux::agents::AgentRegistry;
use clawmux::ephemeral::runner::{Exit, Runner, RunnerError};
use clawmux::ephemeral::EphemeralConfig;
use common::*;
use ephemeral_stack::Stack;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

const WAIT: Duration = Duration::from_secs(30);

/// A container that is a task: its "agent" makes one streamed LLM call over the socket.
#[derive(Default)]
struct SocketAgent {
    /// Container name → its input directory (prompt, config) and socket directory on the host.
    mounts: Mutex<HashMap<String, (PathBuf, PathBuf)>>,
    /// Names removed.
    removed: Mutex<Vec<String>>,
    /// Chunks each container's call received before it ended.
    chunks: Mutex<HashMap<String, usize>>,
}

/// One streamed chat call over a unix socket with forged billing headers; returns the streamed
/// text (or the status line of a refusal).
async fn call_over_socket(sock: &std::path::Path, prompt: &str, on_chunk: impl Fn()) -> Result<String, String> {
    let mut s = tokio::net::UnixStream::connect(sock).await.map_err(|e| format!("connect: {e}"))?;
    let body = json!({"model": "fake-model", "stream": true, "messages": [{"role": "user", "content": prompt}]}).to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost:8080\r\ncontent-type: application/json\r\nauthorization: Bearer sk-forged-in-container\r\nx-litellm-end-user-id: someone-else\r\nx-cogni-run-id: forged\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.map_err(|e| e.to_string())?;
    s.write_all(body.as_bytes()).await.map_err(|e| e.to_string())?;
    let mut r = BufReader::new(s);
    let mut status = String::new();
    r.read_line(&mut status).await.map_err(|e| e.to_string())?;
    if !status.contains(" 200 ") {
        return Err(status.trim().to_owned());
    }
    let mut text = String::new();
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).await.map_err(|e| e.to_string())? == 0 {
            break;
        }
        // Read to the end of the response (as an HTTP client does), not just to `[DONE]`.
        let Some(data) = line.trim().strip_prefix("data: ") else { continue };
        if let Ok(v) = serde_json::from_str::<Value>(data) {
            if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                text.push_str(c);
                on_chunk();
            }
        }
    }
    Ok(text)
}

#[async_trait]
impl Runner for SocketAgent {
    async fn start(&self, name: &str, body: bollard::models::ContainerCreateBody) -> Result<String, RunnerError> {
        let binds = body.host_config.and_then(|h| h.binds).unwrap_or_default();
        let host = |i: usize| PathBuf::from(binds[i].split(':').next().unwrap_or_default());
        self.mounts.lock().unwrap().insert(name.to_owned(), (host(0), host(1)));
        Ok(name.to_owned())
    }

    async fn wait(&self, id: &str, _limit: usize) -> Result<Exit, RunnerError> {
        let (input, sock) = self.mounts.lock().unwrap().get(id).cloned().expect("started");
        let prompt = std::fs::read_to_string(input.join("prompt.txt")).expect("prompt in the input directory");
        let id2 = id.to_owned();
        let count = || *self.chunks.lock().unwrap().entry(id2.clone()).or_default() += 1;
        let mut text = call_over_socket(&sock.join("llm.sock"), &prompt, count).await;
        if prompt.contains("TWICE") && text.is_ok() {
            text = call_over_socket(&sock.join("llm.sock"), &prompt, count).await;
        }
        match text {
            Ok(t) => Ok(Exit { code: 0, stdout: json!({"payloads": [{"text": t}], "meta": {}}).to_string().into_bytes(), ..Exit::default() }),
            Err(e) => Ok(Exit { code: 1, stderr_tail: e, ..Exit::default() }),
        }
    }

    async fn remove(&self, id: &str) {
        self.removed.lock().unwrap().push(id.to_owned());
    }

    async fn reap(&self, _owner: &str) -> Result<Vec<String>, RunnerError> {
        Ok(vec![])
    }

    async fn check_image(&self, _image: &str) -> Result<(), RunnerError> {
        Ok(())
    }
}

/// The shared stack with the socket agent as the ephemeral runner.
struct Env {
    stack: Stack,
    agent: Arc<SocketAgent>,
    /// The runs' input directories and sockets.
    root: PathBuf,
}

impl std::ops::Deref for Env {
    type Target = Stack;
    fn deref(&self) -> &Stack {
        &self.stack
    }
}

async fn env(max: usize) -> Env {
    let agent = Arc::new(SocketAgent::default());
    let root = temp_dir("ephemeral-runs");
    let agents = AgentRegistry::default_with(Some("clawmux-ephemeral:test")).expect("agents");
    let cfg = EphemeralConfig { root: root.clone(), max_concurrent: max, default_model: "fake-model".into() };
    Env { stack: ephemeral_stack::start("ephemeral", agents, Some(agent.clone()), cfg, WAIT).await, agent, root }
}

impl Env {
    async fn stop(self) {
        self.stack.stop().await;
    }
}

#[actix_rt::test]
async fn an_ephemeral_run_streams_its_answer_and_its_socket_bills_it() {
    let env = env(4).await;
    let body = json!({"message": "EPHEMERAL hello", "billingAccountId": "acct-eph", "runId": "run-eph-1", "graphId": "sandbox:openclaw-ephemeral"});
    let mut sse = SseReader::new(post_sse(&env.http, &env.base, &body, &[]).await);
    let fin = sse.terminal(WAIT).await.expect("terminal");
    assert_eq!(fin.event, "final", "{fin:?}");
    assert!(sse.text().starts_with("Reply to: EPHEMERAL hello | model=fake-model"), "{}", sse.text());

    // Upstream: the host's key and the run's billing identity, nothing the container forged.
    let entries = env.llm.entries();
    let call = entries.iter().find(|e| e["last_user"].as_str().is_some_and(|u| u.contains("EPHEMERAL hello"))).expect("the call reached the upstream");
    let h = &call["headers"];
    assert_eq!(h["authorization"], format!("Bearer {}", env.key));
    assert_eq!(h["x-litellm-end-user-id"], "acct-eph");
    assert_eq!(h["x-cogni-run-id"], "run-eph-1");
    let meta: Value = serde_json::from_str(h["x-litellm-spend-logs-metadata"].as_str().expect("metadata")).expect("json");
    assert_eq!(meta["graph_id"], "sandbox:openclaw-ephemeral");

    // Usage = the upstream's sum; one audit record.
    let usage: Vec<(u64, u64)> = entries.iter().filter(|e| e["event"] == "usage").map(|e| (e["prompt_tokens"].as_u64().unwrap_or(0), e["completion_tokens"].as_u64().unwrap_or(0))).collect();
    let doc = env.finished("run-eph-1").await;
    assert_eq!(doc["status"], "ok");
    assert_eq!(doc["usage"]["llmCalls"], 1, "{doc}");
    assert_eq!(doc["usage"]["inputTokens"], usage.iter().map(|u| u.0).sum::<u64>());
    assert_eq!(doc["usage"]["outputTokens"], usage.iter().map(|u| u.1).sum::<u64>());
    let recs = common::audit_records_once(&env.audit_dir.join("audit.jsonl"), Duration::from_secs(20), |recs| recs.iter().any(|r| r["runId"] == "run-eph-1")).await;
    let mine: Vec<&Value> = recs.iter().filter(|r| r["runId"] == "run-eph-1").collect();
    assert_eq!(mine.len(), 1, "{recs:?}");
    assert_eq!(mine[0]["billingAccountId"], "acct-eph");
    assert_eq!(mine[0]["outcome"], "ok");
    assert!(env.agent.removed.lock().unwrap().iter().any(|n| n.contains("run-eph-1")), "container removed");
    env.stop().await;
}

#[actix_rt::test]
async fn concurrent_ephemeral_runs_of_three_accounts_each_get_their_own_text_and_bill() {
    let env = env(2).await;
    let mut streams = Vec::new();
    for i in 0..6 {
        let acct = format!("acct-{}", i % 3);
        let body = json!({"message": format!("EPHRUN{i} go"), "billingAccountId": acct, "runId": format!("run-c{i}"), "graphId": "sandbox:openclaw-ephemeral"});
        streams.push((i, acct, SseReader::new(post_sse(&env.http, &env.base, &body, &[]).await)));
    }
    for (i, _, sse) in &mut streams {
        let fin = sse.terminal(WAIT).await.expect("terminal");
        assert_eq!(fin.event, "final", "{fin:?}");
        assert!(sse.text().starts_with(&format!("Reply to: EPHRUN{i} go |")), "{}", sse.text());
    }
    let entries = env.llm.entries();
    for (i, acct, _) in &streams {
        let call = entries.iter().find(|e| e["last_user"].as_str().is_some_and(|u| u.starts_with(&format!("EPHRUN{i} ")))).expect("call");
        assert_eq!(call["headers"]["x-litellm-end-user-id"], acct.as_str());
        assert_eq!(call["headers"]["x-cogni-run-id"], format!("run-c{i}"));
        assert_eq!(env.doc(&format!("run-c{i}")).await["usage"]["llmCalls"], 1);
    }
    env.stop().await;
}

#[actix_rt::test]
async fn aborting_an_ephemeral_run_cuts_its_llm_stream_and_its_socket() {
    let env = env(4).await;
    let body = json!({"message": "SLOW please", "billingAccountId": "acct-eph", "runId": "run-eph-slow", "graphId": "sandbox:openclaw-ephemeral"});
    let r = env.http.post(format!("{}/v1/runs?wait=false", env.base)).json(&body).send().await.expect("post");
    assert_eq!(r.status(), 202);
    // Wait until the agent's LLM stream is under way.
    let deadline = tokio::time::Instant::now() + WAIT;
    while env.agent.chunks.lock().unwrap().values().sum::<usize>() < 1 {
        assert!(tokio::time::Instant::now() < deadline, "the stream did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = env.http.post(format!("{}/v1/runs/run-eph-slow/abort", env.base)).send().await.expect("abort");
    assert_eq!(r.status(), 202);
    let v: Value = r.json().await.expect("json");
    assert_eq!(v["aborted"], true);
    let doc = env.finished("run-eph-slow").await;
    assert_eq!(doc["status"], "aborted", "{doc}");
    // The upstream saw the stream end early (the fake LLM's SLOW answer is 40 chunks, 1 s apart).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let ends: Vec<Value> = env.llm.entries().into_iter().filter(|e| e["event"] == "stream_end").collect();
        if let Some(e) = ends.first() {
            assert_eq!(e["completed"], false, "{e}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the upstream stream was not cut");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(env.agent.removed.lock().unwrap().iter().any(|n| n.contains("run-eph-slow")));
    // Once the run ended, its socket is gone: nothing more can be billed to it.
    let leftover = std::fs::read_dir(&env.root).map(|d| d.count()).unwrap_or(0);
    assert_eq!(leftover, 0, "the run's input directory and socket are removed");

    // A caller that goes away (onDisconnect: abort, the default) ends its run the same way.
    let body = json!({"message": "SLOW again", "billingAccountId": "acct-eph", "runId": "run-eph-gone", "graphId": "sandbox:openclaw-ephemeral"});
    let mut sse = SseReader::new(post_sse(&env.http, &env.base, &body, &[]).await);
    sse.until(WAIT, |e| e.event == "accepted").await.expect("accepted");
    let before = env.agent.chunks.lock().unwrap().values().sum::<usize>();
    let deadline = tokio::time::Instant::now() + WAIT;
    while env.agent.chunks.lock().unwrap().values().sum::<usize>() <= before {
        assert!(tokio::time::Instant::now() < deadline, "the second stream did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(sse);
    let doc = env.finished("run-eph-gone").await;
    assert_eq!(doc["status"], "aborted", "{doc}");
    assert!(doc["error"]["message"].as_str().is_some_and(|m| m.contains("disconnected")), "{doc}");
    env.stop().await;
}

#[actix_rt::test]
async fn an_ephemeral_run_over_its_accounts_budget_is_stopped() {
    let env = env(4).await;
    let r = env.http.put(format!("{}/v1/admin/accounts/acct-capped/limits", env.base)).json(&json!({"maxTokens": 10, "periodSec": 3600})).send().await.expect("limits");
    assert!(r.status().is_success(), "{:?}", r.text().await);
    // Its first call spends the budget; the second is refused and the run ends.
    let body = json!({"message": "TWICE please", "billingAccountId": "acct-capped", "runId": "run-eph-capped", "graphId": "sandbox:openclaw-ephemeral"});
    let r = env.http.post(format!("{}/v1/runs?wait=false", env.base)).json(&body).send().await.expect("post");
    assert_eq!(r.status(), 202);
    let doc = env.finished("run-eph-capped").await;
    assert_eq!(doc["error"]["code"], "budget_exceeded", "{doc}");
    assert_eq!(env.llm.entries().iter().filter(|e| e["last_user"].as_str().is_some_and(|u| u.contains("TWICE"))).count(), 1, "the refused call never reached the upstream");
    env.stop().await;
}

/// Ephemeral runs live in the one registry of live runs: runs of one `stateKey` take turns (the
/// second is `queued` and gets no container before the first ends; `ifBusy: reject` is refused),
/// and a handoff shutdown, which leaves gateway runs running, ends a running container run.
#[actix_rt::test]
async fn ephemeral_runs_of_one_state_key_take_turns_and_a_shutdown_ends_them() {
    let env = env(4).await;
    let post = |id: &str, msg: &str, extra: Value| {
        let mut body = json!({"message": msg, "billingAccountId": "acct-eph", "runId": id, "stateKey": "conv-1", "graphId": "sandbox:openclaw-ephemeral"});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        env.http.post(format!("{}/v1/runs?wait=false", env.base)).json(&body).send()
    };
    assert_eq!(post("run-key-a", "SLOW first", json!({})).await.expect("post").status(), 202);
    let deadline = tokio::time::Instant::now() + WAIT;
    while env.agent.chunks.lock().unwrap().values().sum::<usize>() < 1 {
        assert!(tokio::time::Instant::now() < deadline, "the first run's stream did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(post("run-key-b", "second", json!({})).await.expect("post").status(), 202);
    let refused = post("run-key-c", "third", json!({"ifBusy": "reject"})).await.expect("post");
    assert_eq!(refused.status(), 409, "ifBusy: reject applies to ephemeral runs");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(env.doc("run-key-b").await["status"], "queued");
    assert!(!env.agent.mounts.lock().unwrap().keys().any(|n| n.contains("run-key-b")), "no container before the first run ends");
    let r = env.http.post(format!("{}/v1/runs/run-key-a/abort", env.base)).send().await.expect("abort");
    assert_eq!(r.json::<Value>().await.expect("json")["aborted"], true);
    assert_eq!(env.finished("run-key-a").await["status"], "aborted");
    let b = env.finished("run-key-b").await;
    assert_eq!(b["status"], "ok", "{b}");
    // Counted where gateway runs are: by the registry, at the run's end.
    let metrics = env.http.get(format!("{}/metrics", env.base)).send().await.expect("metrics").text().await.expect("text");
    for series in ["sandbox_runs_total{agent=\"main\",status=\"ok\"} 1", "sandbox_runs_total{agent=\"main\",status=\"aborted\"} 1", "clawmux_runs_active 0"] {
        assert!(metrics.lines().any(|l| l == series), "{series} missing from\n{metrics}");
    }

    // Shutdown (handoff, the default) with a container run under way.
    assert_eq!(post("run-key-d", "SLOW last", json!({})).await.expect("post").status(), 202);
    let deadline = tokio::time::Instant::now() + WAIT;
    while !env.agent.chunks.lock().unwrap().keys().any(|n| n.contains("run-key-d")) {
        assert!(tokio::time::Instant::now() < deadline, "the last run's stream did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let store = env.running.state.store.clone();
    env.stop().await;
    let doc = store.view("run-key-d").await.expect("store").expect("stored").doc();
    let doc = serde_json::to_value(doc).expect("json");
    assert_eq!(doc["status"], "aborted", "{doc}");
    assert!(doc["error"]["message"].as_str().is_some_and(|m| m.contains("shut")), "{doc}");
}

/// A runner whose start-up reap waits to be let go: start-up is held there (as by a slow Docker
/// engine, a slow git relay or a long restart recovery).
struct HeldReap {
    entered: tokio::sync::Notify,
    release: tokio::sync::Notify,
}

#[async_trait]
impl Runner for HeldReap {
    async fn start(&self, _name: &str, _body: bollard::models::ContainerCreateBody) -> Result<String, RunnerError> {
        Err(RunnerError::Engine("no containers in this test".into()))
    }
    async fn wait(&self, _id: &str, _limit: usize) -> Result<Exit, RunnerError> {
        Err(RunnerError::Engine("no containers in this test".into()))
    }
    async fn remove(&self, _id: &str) {}
    async fn reap(&self, _owner: &str) -> Result<Vec<String>, RunnerError> {
        self.entered.notify_one();
        self.release.notified().await;
        Ok(vec![])
    }
    async fn check_image(&self, _image: &str) -> Result<(), RunnerError> {
        Ok(())
    }
}

/// The API port answers `503` with `Retry-After` until clawmux serves: while start-up is held
/// (here in the ephemeral runner's reap), a request is answered at once (the caller retries, or
/// goes elsewhere), where before the kernel accepted its connection and the request hung until
/// start-up was over. The port listens from the start all the same: a second clawmux cannot bind
/// it meanwhile. Once started, the same port serves.
#[actix_rt::test]
async fn the_api_port_answers_503_until_clawmux_serves() {
    use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway};
    let dir = temp_dir("held-start");
    let gw = ReplayGateway::start(std::net::SocketAddr::from(([127, 0, 0, 1], 0)), ReplayConfig::new(Cassette::bundled().expect("cassette")).speed(0.0)).expect("replay gateway");
    let runner = Arc::new(HeldReap { entered: tokio::sync::Notify::new(), release: tokio::sync::Notify::new() });
    let agents = AgentRegistry::default_with(Some("clawmux-ephemeral:test")).expect("agents");
    let eph = EphemeralConfig { root: dir.join("runs"), max_concurrent: 1, default_model: "fake-model".into() };
    let options = clawmux::server::StartOptions { agents: Some(agents), ephemeral_runner: Some(runner.clone()), ephemeral_config: Some(eph), ..Default::default() };
    let port = free_port();
    let gw_url = gw.url();
    let starting = actix_rt::spawn(async move {
        start_clawmux_opts(
            &gw_url,
            None,
            |cfg| {
                cfg.listen = std::net::SocketAddr::from(([127, 0, 0, 1], port));
                // Never called: no run is posted.
                cfg.llm_upstream_url = Some("http://127.0.0.1:9".into());
                cfg.proxy_listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
                cfg.audit_dir = dir.join("audit");
            },
            |_| {},
            options,
        )
        .await
    });
    tokio::time::timeout(WAIT, runner.entered.notified()).await.expect("start-up reached the reap");
    let http = reqwest::Client::new();
    for early in [http.get(format!("http://127.0.0.1:{port}/healthz")), http.post(format!("http://127.0.0.1:{port}/v1/runs")).json(&json!({"message": "hi", "billingAccountId": "a"}))] {
        let r = tokio::time::timeout(Duration::from_secs(5), early.send()).await.expect("answered at once, not held").expect("answered");
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
        let body: Value = r.json().await.expect("the error shape");
        assert!(body["error"]["message"].as_str().is_some_and(|m| m.contains("starting")), "{body}");
    }
    let again = std::net::TcpListener::bind(("127.0.0.1", port));
    assert!(again.is_err(), "the port could be bound by another process while clawmux starts");
    runner.release.notify_one();
    let running = tokio::time::timeout(WAIT, starting).await.expect("start-up ends").expect("start-up task");
    assert_eq!(running.addr.port(), port);
    let health = http.get(format!("http://127.0.0.1:{port}/healthz")).send().await.expect("served");
    assert_eq!(health.status(), 200);
    clawmux::server::shutdown(&running).await;
    gw.stop().await;
}
