//! Ephemeral runs on a real Docker engine with the real OpenClaw CLI in the container and the
//! project's fake LLM behind clawmux's proxy. Needs `CLAWMUX_EPHEMERAL_IMAGE` (built by
//! `images/build.sh ephemeral`) and an engine (`DOCKER_HOST`); `tests/run.sh` runs them in its
//! ephemeral phase.

mod common;
#[path = "common/ephemeral_stack.rs"]
mod ephemeral_stack;
#[path = "common/child.rs"]
mod child;

use clawmux::agents::AgentRegistry;
use clawmux::ephemeral::EphemeralConfig;
use common::*;
use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway};
use ephemeral_stack::Stack;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(120);

fn image() -> String {
    std::env::var("CLAWMUX_EPHEMERAL_IMAGE").expect("CLAWMUX_EPHEMERAL_IMAGE names the ephemeral image (images/build.sh ephemeral)")
}

fn docker(args: &[&str]) -> (bool, String) {
    let out = Command::new("docker").args(args).output().expect("the docker CLI runs");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// Bytes of the regular files below `dir` (links not followed).
fn walk_sizes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir).into_iter().flatten().flatten().map(|e| match e.file_type() {
        Ok(t) if t.is_dir() => walk_sizes(&e.path()),
        Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
        _ => 0,
    }).sum()
}

/// Containers of this clawmux (by its owner label).
fn containers(owner: &str) -> Vec<String> {
    let (_, out) = docker(&["ps", "-aq", "--filter", &format!("label=io.clawmux.ephemeral={owner}")]);
    out.lines().map(str::to_owned).filter(|l| !l.is_empty()).collect()
}

/// The shared stack with the Docker engine as the ephemeral runner.
struct Env {
    stack: Stack,
    /// This clawmux's container label (from its runs directory).
    owner: String,
}

impl std::ops::Deref for Env {
    type Target = Stack;
    fn deref(&self) -> &Stack {
        &self.stack
    }
}

async fn env(root: PathBuf) -> Env {
    let text = format!(
        "default = \"sandbox:openclaw\"\n[[agent]]\ngraph_id = \"sandbox:openclaw\"\nmode = \"gateway\"\n\
         [[agent]]\ngraph_id = \"sandbox:openclaw-ephemeral\"\nmode = \"ephemeral\"\nimage = \"{}\"\nworkspace_mb = 64\n\
         [[agent]]\ngraph_id = \"eph-small\"\nmode = \"ephemeral\"\nimage = \"{}\"\noutput_bytes = 200\n\
         [[agent]]\ngraph_id = \"eph-missing\"\nmode = \"ephemeral\"\nimage = \"clawmux/no-such-image:0\"\n",
        image(),
        image()
    );
    let agents = AgentRegistry::parse(&text, None).expect("agents");
    let cfg = EphemeralConfig { root: root.clone(), max_concurrent: 4, default_model: "fake-model".into() };
    let stack = ephemeral_stack::start("docker-eph", agents, None, cfg, WAIT).await;
    Env { stack, owner: clawmux::ephemeral::container::owner_of(&root) }
}

impl Env {
    async fn post(&self, body: Value) {
        let r = self.http.post(format!("{}/v1/runs?wait=false", self.base)).json(&body).send().await.expect("post");
        assert_eq!(r.status(), 202, "{:?}", r.text().await);
    }
    /// Waits until the fake LLM has a call whose prompt holds `marker`.
    async fn llm_called(&self, marker: &str) {
        let deadline = Instant::now() + WAIT;
        while !self.llm.entries().iter().any(|e| e["last_user"].as_str().is_some_and(|u| u.contains(marker))) {
            assert!(Instant::now() < deadline, "no LLM call for {marker}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    async fn containers_gone_within(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let left = containers(&self.owner);
            if left.is_empty() {
                return;
            }
            assert!(Instant::now() < deadline, "containers left: {left:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    /// Waits (at most 10 s) until the fake LLM saw the stream of the request carrying `marker` cut:
    /// it notices only when its next chunk cannot be written, a moment after the container died.
    async fn wait_stream_cut(&self, marker: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.stream_cut(marker) {
            assert!(Instant::now() < deadline, "{marker}: the fake LLM's stream was not cut");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn stream_cut(&self, marker: &str) -> bool {
        let entries = self.llm.entries();
        let ids: Vec<&Value> = entries.iter().filter(|e| e["last_user"].as_str().is_some_and(|u| u.contains(marker))).map(|e| &e["id"]).collect();
        entries.iter().any(|e| e["event"] == "stream_end" && ids.contains(&&e["id"]) && e["completed"] == false)
    }
    async fn stop(self) {
        self.stack.stop().await;
    }
}

#[actix_rt::test]
async fn docker_ephemeral_run_streams_is_billed_and_its_container_is_hardened() {
    let root = temp_dir("eph-root");
    let env = env(root.clone()).await;

    // A whole run: the fake LLM's text, billed to the run; the start-up cost is measured.
    let t0 = Instant::now();
    let body = json!({"message": "EPHONE hello", "billingAccountId": "acct-a", "runId": "dk-1", "graphId": "sandbox:openclaw-ephemeral"});
    let mut sse = SseReader::new(post_sse(&env.http, &env.base, &body, &[]).await);
    let fin = sse.terminal(WAIT).await.expect("terminal");
    let elapsed = t0.elapsed();
    assert_eq!(fin.event, "final", "{fin:?}");
    assert!(sse.text().starts_with("Reply to: EPHONE hello | model=fake-model"), "{}", sse.text());
    println!("ephemeral run end to end: {:.2} s", elapsed.as_secs_f64());
    let entries = env.llm.entries();
    let calls: Vec<&Value> = entries.iter().filter(|e| e["last_user"].as_str().is_some_and(|u| u.contains("EPHONE"))).collect();
    assert!(!calls.is_empty());
    for c in &calls {
        assert_eq!(c["headers"]["authorization"], format!("Bearer {}", env.key));
        assert_eq!(c["headers"]["x-litellm-end-user-id"], "acct-a");
        assert_eq!(c["headers"]["x-cogni-run-id"], "dk-1");
    }
    let ids: Vec<&Value> = calls.iter().map(|c| &c["id"]).collect();
    let usage: Vec<(u64, u64)> = entries
        .iter()
        .filter(|e| e["event"] == "usage" && ids.contains(&&e["id"]))
        .map(|e| (e["prompt_tokens"].as_u64().unwrap_or(0), e["completion_tokens"].as_u64().unwrap_or(0)))
        .collect();
    let doc = env.finished("dk-1").await;
    assert_eq!(doc["usage"]["llmCalls"], calls.len() as u64, "{doc}");
    assert_eq!(doc["usage"]["inputTokens"], usage.iter().map(|u| u.0).sum::<u64>());
    assert_eq!(doc["usage"]["outputTokens"], usage.iter().map(|u| u.1).sum::<u64>());
    env.containers_gone_within(Duration::from_secs(5)).await;

    // In flight: the inspection shows every hardening setting; no network from inside; no secret.
    env.post(json!({"message": "SLOW EPHTWO", "billingAccountId": "acct-a", "runId": "dk-2", "graphId": "sandbox:openclaw-ephemeral"})).await;
    env.llm_called("EPHTWO").await;
    let ids = containers(&env.owner);
    assert_eq!(ids.len(), 1, "{ids:?}");
    let (ok, inspect) = docker(&["inspect", &ids[0]]);
    assert!(ok, "{inspect}");
    println!("docker inspect of a running ephemeral container:\n{inspect}");
    let info: Value = serde_json::from_str(&inspect).expect("inspect json");
    let c = &info[0];
    let h = &c["HostConfig"];
    assert_eq!(h["NetworkMode"], "none");
    assert_eq!(h["CapDrop"], json!(["ALL"]));
    assert!(h["CapAdd"].is_null());
    assert_eq!(h["SecurityOpt"], json!(["no-new-privileges:true"]));
    assert_eq!(h["ReadonlyRootfs"], true);
    assert_eq!(h["Privileged"], false);
    assert!(h["Tmpfs"]["/tmp"].is_string() && h["Tmpfs"]["/run"].is_string(), "{h}");
    assert_eq!(h["Memory"], 1024 * 1024 * 1024);
    assert_eq!(h["PidsLimit"], 256);
    assert_eq!(h["NanoCpus"], 0, "no CPU limit unless the variant sets one");
    assert_eq!(c["Config"]["User"], "1000:1000");
    let binds = h["Binds"].as_array().expect("binds");
    assert_eq!(binds.len(), 2);
    assert!(!inspect.contains("docker.sock"));
    assert!(!inspect.contains(&env.key), "the upstream key is in the container's config");
    let netns: Value = c["NetworkSettings"]["Networks"].clone();
    assert!(netns.as_object().is_some_and(|n| n.keys().all(|k| k == "none")), "{netns}");
    let port = env.running.addr.port().to_string();
    let probe = format!(
        "const net=require('net');const t=(h,p)=>new Promise(r=>{{const s=net.connect({{host:h,port:p,timeout:2000}});s.on('connect',()=>{{r('OPEN '+h);s.destroy()}});s.on('error',e=>r('FAIL '+h+' '+e.code));s.on('timeout',()=>{{r('FAIL '+h+' timeout');s.destroy()}})}});\
         Promise.all([t('127.0.0.1',{port}),t('10.0.0.1',80),t('1.1.1.1',443),t('172.17.0.1',{port})]).then(r=>console.log(r.join('\\n')))"
    );
    let (_, net) = docker(&["exec", &ids[0], "node", "-e", &probe]);
    println!("connect attempts from inside:\n{net}");
    assert_eq!(net.matches("FAIL").count(), 4, "{net}");
    assert!(!net.contains("OPEN"), "{net}");
    // Nothing the agent writes reaches the host's disk: its workspace is a 64 MiB tmpfs (full at
    // that size), its inputs and socket are read-only, and the root is read-only.
    assert_eq!(h["Tmpfs"]["/workspace"], "rw,exec,nosuid,nodev,size=67108864,uid=1000,gid=1000,mode=0700", "{h}");
    // The agent runs what it writes there (Docker's tmpfs default is noexec).
    let (ok, ran) = docker(&["exec", &ids[0], "sh", "-c", "printf '#!/bin/sh\\necho ran-from-workspace\\n' > /workspace/s.sh && chmod +x /workspace/s.sh && /workspace/s.sh"]);
    assert!(ok && ran.contains("ran-from-workspace"), "{ran}");
    assert!(binds.iter().all(|b| b.as_str().is_some_and(|b| b.ends_with(":ro"))), "{binds:?}");
    let (ok, fill) = docker(&["exec", &ids[0], "dd", "if=/dev/zero", "of=/workspace/fill", "bs=1M", "count=100"]);
    assert!(!ok && fill.contains("No space left on device"), "{fill}");
    let (_, df) = docker(&["exec", &ids[0], "sh", "-c", "rm -f /workspace/fill; du -sk /workspace"]);
    println!("workspace after the fill was removed: {df}");
    for path in ["/llm-sock/x", "/clawmux-in/x", "/x", "/opt/x"] {
        let (ok, out) = docker(&["exec", &ids[0], "touch", path]);
        assert!(!ok && out.contains("Read-only file system"), "{path}: {out}");
    }
    let host_bytes: u64 = walk_sizes(&root);
    assert!(host_bytes < 64 * 1024, "the run's host directory holds {host_bytes} bytes");
    let (_, inside) = docker(&["exec", &ids[0], "sh", "-c", "env; cat /proc/1/cmdline | tr '\\0' ' '; grep -rl sk- /workspace /clawmux-in 2>/dev/null; ls -la /workspace /clawmux-in"]);
    assert!(!inside.contains(&env.key), "a secret inside the container: {inside}");
    assert!(!inside.contains("CLAWMUX_"), "clawmux's environment leaked: {inside}");
    // Abort: the container is gone within 2 s and the LLM stream was cut.
    let t = Instant::now();
    let r = env.http.post(format!("{}/v1/runs/dk-2/abort", env.base)).send().await.expect("abort");
    assert_eq!(r.status(), 202);
    env.containers_gone_within(Duration::from_secs(2)).await;
    println!("abort → container gone: {:.2} s", t.elapsed().as_secs_f64());
    assert_eq!(env.finished("dk-2").await["status"], "aborted");
    env.wait_stream_cut("EPHTWO").await;

    // Timeout: the same.
    // A stream far longer than the timeout, and a timeout far longer than OpenClaw's cold start
    // (8 s to over 30 s on this machine, by the day): the run times out during its LLM call
    // whichever day it is. With `SLOW` (40 s) and 20 s, a slow day's cold start missed the call,
    // and with 60 s a fast day's call ended first.
    env.post(json!({"message": "SLOWEST EPHTIME", "billingAccountId": "acct-a", "runId": "dk-3", "graphId": "sandbox:openclaw-ephemeral", "timeoutSec": 90})).await;
    env.llm_called("EPHTIME").await;
    let doc = env.finished("dk-3").await;
    assert_eq!(doc["status"], "timeout", "{doc}");
    env.containers_gone_within(Duration::from_secs(2)).await;
    env.wait_stream_cut("EPHTIME").await;

    // Client disconnect (onDisconnect: abort).
    let body = json!({"message": "SLOW EPHGONE", "billingAccountId": "acct-a", "runId": "dk-4", "graphId": "sandbox:openclaw-ephemeral"});
    let sse = SseReader::new(post_sse(&env.http, &env.base, &body, &[]).await);
    env.llm_called("EPHGONE").await;
    drop(sse);
    env.containers_gone_within(Duration::from_secs(2)).await;
    assert_eq!(env.finished("dk-4").await["status"], "aborted");
    env.wait_stream_cut("EPHGONE").await;

    // Output over the limit, missing image: clear errors, nothing left.
    env.post(json!({"message": "EPHBIG", "billingAccountId": "acct-a", "runId": "dk-5", "graphId": "eph-small"})).await;
    let doc = env.finished("dk-5").await;
    assert_eq!(doc["error"]["code"], "agent_error", "{doc}");
    assert!(doc["error"]["message"].as_str().is_some_and(|m| m.contains("exceeded 200 bytes")), "{doc}");
    env.post(json!({"message": "EPHNOIMG", "billingAccountId": "acct-a", "runId": "dk-6", "graphId": "eph-missing"})).await;
    let doc = env.finished("dk-6").await;
    assert_eq!(doc["error"]["code"], "internal", "{doc}");
    assert!(doc["error"]["message"].as_str().is_some_and(|m| m.contains("clawmux/no-such-image:0")), "{doc}");
    env.containers_gone_within(Duration::from_secs(5)).await;
    assert_eq!(std::fs::read_dir(&root).map(|d| d.count()).unwrap_or(0), 0, "workspaces left");
    env.stop().await;
}

#[actix_rt::test]
async fn docker_ephemeral_concurrent_runs_of_three_accounts_and_orphans_reaped_at_start() {
    let root = temp_dir("eph-root");
    // An orphan of a previous process (same directory → same owner label) is reaped at start.
    let owner = clawmux::ephemeral::container::owner_of(&root);
    let (ok, out) = docker(&["create", "--label", &format!("io.clawmux.ephemeral={owner}"), "--network", "none", &image(), "openclaw", "--version"]);
    assert!(ok, "{out}");
    assert_eq!(containers(&owner).len(), 1);
    let env = env(root).await;
    assert!(containers(&owner).is_empty(), "the orphan was reaped at start");

    let t0 = Instant::now();
    let mut streams = Vec::new();
    for i in 0..6 {
        let acct = format!("acct-{}", i % 3);
        let body = json!({"message": format!("EPHCON{i} go"), "billingAccountId": acct, "runId": format!("dk-c{i}"), "graphId": "sandbox:openclaw-ephemeral"});
        streams.push((i, acct, SseReader::new(post_sse(&env.http, &env.base, &body, &[]).await)));
    }
    for (i, _, sse) in &mut streams {
        let fin = sse.terminal(WAIT).await.expect("terminal");
        assert_eq!(fin.event, "final", "{fin:?}");
        assert!(sse.text().starts_with(&format!("Reply to: EPHCON{i} go |")), "{}", sse.text());
    }
    println!("6 ephemeral runs, 4 at once: {:.2} s", t0.elapsed().as_secs_f64());
    let entries = env.llm.entries();
    for (i, acct, _) in &streams {
        let mine: Vec<&Value> = entries.iter().filter(|e| e["last_user"].as_str().is_some_and(|u| u.starts_with(&format!("EPHCON{i} ")))).collect();
        assert!(!mine.is_empty());
        for c in mine {
            assert_eq!(c["headers"]["x-litellm-end-user-id"], acct.as_str());
            assert_eq!(c["headers"]["x-cogni-run-id"], format!("dk-c{i}"));
        }
    }
    env.containers_gone_within(Duration::from_secs(5)).await;
    env.stop().await;
}

#[actix_rt::test]
async fn docker_ephemeral_kill_9_mid_run_leaves_no_container_after_the_restart() {
    let root = temp_dir("eph-root");
    let owner = clawmux::ephemeral::container::owner_of(&root);
    let dir = temp_dir("docker-eph-kill");
    let llm = FakeLlm::start(&dir.join("llm"));
    let gw = ReplayGateway::start(SocketAddr::from(([127, 0, 0, 1], 0)), ReplayConfig::new(Cassette::bundled().expect("cassette")).speed(0.0)).expect("replay gateway");
    let docker_host = std::env::var("DOCKER_HOST").unwrap_or_default();
    let (upstream, root_s, audit) = (llm.url(), root.display().to_string(), dir.join("audit").display().to_string());
    let image = image();
    let mut env = vec![
        ("CLAWMUX_LLM_UPSTREAM_URL", upstream.as_str()),
        ("CLAWMUX_LLM_UPSTREAM_KEY", "sk-kill-test"),
        ("CLAWMUX_PROXY_LISTEN", "127.0.0.1:0"),
        ("CLAWMUX_AUDIT_DIR", audit.as_str()),
        ("CLAWMUX_EPHEMERAL_IMAGE", image.as_str()),
        ("CLAWMUX_EPHEMERAL_DIR", root_s.as_str()),
        ("CLAWMUX_EPHEMERAL_MODEL", "fake-model"),
    ];
    if !docker_host.is_empty() {
        env.push(("DOCKER_HOST", docker_host.as_str()));
    }
    let mut cm = child::Clawmux::new(&gw.url(), "t", &env);
    let http = reqwest::Client::new();
    cm.start(&http).await;
    let body = json!({"message": "SLOW EPHKILL", "billingAccountId": "acct-k", "runId": "dk-kill", "graphId": "sandbox:openclaw-ephemeral"});
    let r = http.post(format!("{}/v1/runs?wait=false", cm.base)).json(&body).send().await.expect("post");
    assert_eq!(r.status(), 202);
    let deadline = Instant::now() + WAIT;
    while !llm.entries().iter().any(|e| e["last_user"].as_str().is_some_and(|u| u.contains("EPHKILL"))) {
        assert!(Instant::now() < deadline, "no LLM call; log: {}", cm.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cm.kill_9();
    assert_eq!(containers(&owner).len(), 1, "the killed clawmux left its container running");
    cm.start(&http).await;
    assert!(containers(&owner).is_empty(), "the restart reaped the orphan; log: {}", cm.log());
    assert_eq!(std::fs::read_dir(&root).map(|d| d.count()).unwrap_or(0), 0, "workspaces left");
    let doc: Value = http.get(format!("{}/v1/runs/dk-kill", cm.base)).send().await.expect("get").json().await.expect("doc");
    assert_eq!(doc["status"], "error", "{doc}");
    assert_eq!(doc["error"]["code"], "internal", "{doc}");
    assert!(doc["error"]["message"].as_str().is_some_and(|m| m.contains("ephemeral")), "{doc}");
    cm.kill_9();
    gw.stop().await;
}
