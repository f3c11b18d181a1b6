//! The stack both ephemeral test files start: the replay gateway, the project's fake LLM behind
//! clawmux's attribution proxy (a fresh upstream key), and clawmux with the given agent variants,
//! ephemeral runner (a fake, or `None`: the Docker engine) and runs directory.
#![allow(dead_code)] // each test file uses a part

use crate::common::*;
use clawmux::agents::AgentRegistry;
use clawmux::ephemeral::runner::Runner;
use clawmux::ephemeral::EphemeralConfig;
use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway, ReplayHandle};
use serde_json::Value;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// A started stack.
pub struct Stack {
    pub running: clawmux::server::Running,
    pub base: String,
    pub llm: FakeLlm,
    /// The upstream key only the proxy holds.
    pub key: String,
    pub audit_dir: PathBuf,
    pub gw: ReplayHandle,
    pub http: reqwest::Client,
    /// How long a run may take to end (a real container's OpenClaw starts cold).
    pub wait: Duration,
}

/// Starts the stack in a fresh temporary directory named after `name`.
pub async fn start(name: &str, agents: AgentRegistry, runner: Option<Arc<dyn Runner>>, eph: EphemeralConfig, wait: Duration) -> Stack {
    let dir = temp_dir(name);
    let llm = FakeLlm::start(&dir.join("llm"));
    let gw = ReplayGateway::start(SocketAddr::from(([127, 0, 0, 1], 0)), ReplayConfig::new(Cassette::bundled().expect("cassette")).speed(0.0)).expect("replay gateway");
    let key = format!("sk-upstream-{}", uuid::Uuid::new_v4().simple());
    let audit_dir = dir.join("audit");
    let options = clawmux::server::StartOptions { agents: Some(agents), ephemeral_runner: runner, ephemeral_config: Some(eph), ..Default::default() };
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
    wait_ready(&http, &base, Duration::from_secs(30)).await;
    Stack { running, base, llm, key, audit_dir, gw, http, wait }
}

impl Stack {
    /// The run's document.
    pub async fn doc(&self, run_id: &str) -> Value {
        self.http.get(format!("{}/v1/runs/{run_id}", self.base)).send().await.expect("get").json().await.expect("doc")
    }

    /// The run's document once it ended (bounded by `wait`).
    pub async fn finished(&self, run_id: &str) -> Value {
        let deadline = tokio::time::Instant::now() + self.wait;
        loop {
            let d = self.doc(run_id).await;
            if !["queued", "running"].contains(&d["status"].as_str().unwrap_or("")) {
                return d;
            }
            assert!(tokio::time::Instant::now() < deadline, "run {run_id} did not end: {d}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Shuts clawmux down (handoff) and stops the replay gateway.
    pub async fn stop(self) {
        clawmux::server::shutdown(&self.running).await;
        self.gw.stop().await;
    }
}
