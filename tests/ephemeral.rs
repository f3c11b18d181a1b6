//! Ephemeral runs through the API, without Docker: a fake runner plays the container. It does what
//! the real one's agent does: reads its prompt from the workspace, calls the LLM through the run's
//! unix socket (the real attribution proxy in front of the project's fake LLM), prints an envelope.
//! The real engine is in `tests/docker_ephemeral.rs`.

mod common;

use async_trait::async_trait;
use clawmux::agents::AgentRegistry;
use clawmux::ephemeral::runner::{Exit, Runner, RunnerError};
use clawmux::ephemeral::EphemeralConfig;
use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway};
use common::*;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

const WAIT: Duration = Duration::from_secs(30);

/// A container that is a task: its "agent" makes one streamed LLM call over the socket.
#[derive(Default)]
struct SocketAgent {
    /// Container name → its workspace and socket directory on the host.
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
        let (ws, sock) = self.mounts.lock().unwrap().get(id).cloned().expect("started");
        let prompt = std::fs::read_to_string(ws.join(".clawmux/prompt.txt")).expect("prompt in the workspace");
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

struct Env {
    running: clawmux::server::Running,
    base: String,
    llm: FakeLlm,
    agent: Arc<SocketAgent>,
    key: String,
    audit_dir: PathBuf,
    gw: clawmux::replay::ReplayHandle,
    http: reqwest::Client,
}

async fn env(max: usize) -> Env {
    let dir = temp_dir("ephemeral");
    let llm = FakeLlm::start(&dir.join("llm"));
    let gw = ReplayGateway::start(SocketAddr::from(([127, 0, 0, 1], 0)), ReplayConfig::new(Cassette::bundled().expect("cassette")).speed(0.0)).expect("replay gateway");
    let key = format!("sk-upstream-{}", uuid::Uuid::new_v4().simple());
    let audit_dir = dir.join("audit");
    let agent = Arc::new(SocketAgent::default());
    let options = clawmux::server::StartOptions {
        agents: Some(AgentRegistry::default_with(Some("clawmux-ephemeral:test")).expect("agents")),
        ephemeral_runner: Some(agent.clone()),
        ephemeral_config: Some(EphemeralConfig { root: dir.join("runs"), max_concurrent: max, default_model: "fake-model".into() }),
        ..Default::default()
    };
    let (k, a) = (key.clone(), audit_dir.clone());
    let running = start_clawmux_opts(
        &gw.url(),
        None,
        |cfg| {
            cfg.llm_upstream_url = Some(llm.url());
            cfg.llm_upstream_key = Some(clawmux::config::Secret::new(k));
            cfg.proxy_listen = SocketAddr::from(([127, 0, 0, 1], 0));
            cfg.audit_dir = a;
        },
        |_| {},
        options,
    )
    .await;
    let base = base(&running);
    let http = reqwest::Client::new();
    wait_ready(&http, &base, WAIT).await;
    Env { running, base, llm, agent, key, audit_dir, gw, http }
}

impl Env {
    async fn doc(&self, run_id: &str) -> Value {
        self.http.get(format!("{}/v1/runs/{run_id}", self.base)).send().await.expect("get").json().await.expect("doc")
    }
    async fn finished(&self, run_id: &str) -> Value {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let d = self.doc(run_id).await;
            if !["queued", "running"].contains(&d["status"].as_str().unwrap_or("")) {
                return d;
            }
            assert!(tokio::time::Instant::now() < deadline, "run {run_id} did not end: {d}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    async fn stop(self) {
        clawmux::server::shutdown(&self.running).await;
        self.gw.stop().await;
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
    tokio::time::sleep(Duration::from_millis(300)).await;
    let recs = clawmux::audit::read_records(&env.audit_dir.join("audit.jsonl")).expect("audit");
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
    let leftover = std::fs::read_dir(env.running.state.cfg.audit_dir.parent().expect("dir").join("runs")).map(|d| d.count()).unwrap_or(0);
    assert_eq!(leftover, 0, "the run's workspace and socket are removed");

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
