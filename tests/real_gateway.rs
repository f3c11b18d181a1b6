//! clawmux against the REAL OpenClaw gateway (openclaw@2026.9.6 on Node 24, a fake LLM of ours).
//!
//! `tests/run.sh` installs both, starts them with `tests/support/gateway.sh`, runs this binary with
//! `CLAWMUX_REAL_GATEWAY_ENV=<run dir>/env` and `--test-threads=1`, and stops them by PID.
//! Without that variable these tests say so and return, unless `CLAWMUX_REQUIRE_REAL_GATEWAY=1`
//! (set by `tests/run.sh` and CI), in which case they fail.

mod common;

use common::*;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::Duration;

/// The running real gateway, from `RUN_DIR/env`.
struct Gateway {
    url: String,
    token: String,
    llm_log: String,
    run_dir: String,
    /// `v4` (openclaw 2026.9.6) or `v3` (2026.4.12).
    flavor: String,
    /// Set when the gateway's provider points at clawmux's LLM proxy on this port.
    proxy_port: Option<u16>,
    llm_port: u16,
    gateway_pid: String,
}

impl Gateway {
    fn v3(&self) -> bool {
        self.flavor == "v3"
    }
}

/// Starts clawmux for this gateway: with the LLM proxy when the gateway's provider points at it.
async fn start_for(g: &Gateway, token: Option<&str>) -> clawmux::server::Running {
    let proxy = g.proxy_port;
    let llm = g.llm_port;
    start_clawmux(&g.url, token, |cfg| {
        if let Some(port) = proxy {
            cfg.proxy_listen = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            cfg.llm_upstream_url = Some(format!("http://127.0.0.1:{llm}"));
            cfg.llm_upstream_key = Some(clawmux::config::Secret::new("sk-test-upstream"));
            cfg.audit_dir = std::env::temp_dir().join(format!("clawmux-audit-{}", uuid::Uuid::new_v4().simple()));
        }
    })
    .await
}

fn gateway() -> Option<Gateway> {
    let Ok(path) = std::env::var("CLAWMUX_REAL_GATEWAY_ENV") else {
        assert!(
            std::env::var("CLAWMUX_REQUIRE_REAL_GATEWAY").as_deref() != Ok("1"),
            "CLAWMUX_REQUIRE_REAL_GATEWAY=1 but CLAWMUX_REAL_GATEWAY_ENV is not set: run tests/run.sh"
        );
        eprintln!("real gateway not started (run tests/run.sh); skipping");
        return None;
    };
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    let env: HashMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
    let get = |k: &str| env.get(k).unwrap_or_else(|| panic!("{path} lacks {k}")).to_string();
    Some(Gateway {
        url: get("GATEWAY_URL"),
        token: get("GATEWAY_TOKEN"),
        llm_log: get("LLM_LOG"),
        run_dir: get("RUN_DIR"),
        flavor: env.get("GATEWAY_FLAVOR").unwrap_or(&"v4").to_string(),
        proxy_port: env.get("PROXY_PORT").and_then(|p| p.parse().ok()),
        llm_port: get("LLM_PORT").parse().expect("LLM_PORT"),
        gateway_pid: get("GATEWAY_PID"),
    })
}

/// Lines of the fake LLM's request log: only complete ones (a line the fake LLM is still writing
/// is left for the next read), each parsed on its own, so a read racing a write loses nothing else.
fn llm_log(g: &Gateway) -> Vec<Value> {
    let bytes = std::fs::read(&g.llm_log).unwrap_or_default();
    let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    bytes[..complete].split(|&b| b == b'\n').filter_map(|l| serde_json::from_slice(l).ok()).collect()
}

/// The fake LLM's log entries of the calls billed to `run_id` (by clawmux's `x-cogni-run-id`
/// header), one per line, for failure messages.
fn calls_billed_to(g: &Gateway, run_id: &str) -> String {
    let lines: Vec<String> = llm_log(g)
        .iter()
        .filter(|e| e["headers"]["x-cogni-run-id"] == run_id)
        .map(|e| {
            format!(
                "  id={} reply={} n_messages={} last_user={} user_text={}",
                e["id"], e["reply"], e["n_messages"], e["last_user"], e["user_text"]
            )
        })
        .collect();
    if lines.is_empty() {
        format!("no LLM call was billed to {run_id}")
    } else {
        format!("LLM calls billed to {run_id}:\n{}", lines.join("\n"))
    }
}

/// LLM requests whose echoed user line contains `marker` (the fake LLM echoes the run's own message
/// also when the gateway retries a failed call with its continuation prompt: see fake_llm.py).
fn llm_requests_for(g: &Gateway, marker: &str) -> Vec<Value> {
    llm_log(g).into_iter().filter(|e| e["last_user"].as_str().is_some_and(|u| u.contains(marker))).collect()
}

/// Waits (bounded) until the LLM stream of the request carrying `marker` ended; returns `completed`.
async fn llm_stream_end(g: &Gateway, marker: &str, within: Duration) -> Option<bool> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let ids: Vec<String> = llm_requests_for(g, marker).iter().filter_map(|e| e["id"].as_str().map(str::to_owned)).collect();
        let end = llm_log(g).into_iter().find(|e| e["event"] == "stream_end" && e["id"].as_str().is_some_and(|id| ids.iter().any(|i| i == id)));
        if let Some(end) = end {
            return end["completed"].as_bool();
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(120)).build().expect("client")
}

#[actix_rt::test]
async fn live_eight_concurrent_runs_from_four_accounts_each_get_only_their_own_text_model_and_trace() {
    let Some(g) = gateway() else { return };
    let running = start_for(&g, Some(&g.token)).await;
    let base = base(&running);
    let c = client();
    wait_ready(&c, &base, Duration::from_secs(30)).await;

    let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let mut runs = Vec::new();
    for i in 0..8 {
        let account = format!("acct-{}", i % 4);
        let marker = format!("ISO{tag}R{i}X");
        let model = if i % 2 == 0 { "cogni/fake-model" } else { "cogni/fake-model-b" };
        let (trace_id, traceparent) = new_traceparent();
        let body = json!({"message": format!("isolation check {marker}"), "billingAccountId": account, "model": model});
        let c = c.clone();
        let base = base.clone();
        runs.push(tokio::spawn(async move {
            let resp = post_sse(&c, &base, &body, &[("traceparent", traceparent.as_str())]).await;
            assert_eq!(resp.status(), 200);
            let mut sse = SseReader::new(resp);
            let terminal = sse.terminal(Duration::from_secs(90)).await.expect("terminal event");
            (i, marker, model, trace_id, terminal, sse.text(), sse.events.clone())
        }));
    }
    let mut results = Vec::new();
    for r in runs {
        results.push(r.await.expect("run task"));
    }
    let markers: Vec<String> = results.iter().map(|r| r.1.clone()).collect();
    for (i, marker, model, trace_id, terminal, text, events) in &results {
        assert_eq!(terminal.event, "final", "run {i} ended with {terminal:?}");
        let content = terminal.data["content"].as_str().expect("content");
        assert!(content.contains(marker.as_str()), "run {i}: own marker missing from {content:?}");
        assert!(text.contains(marker.as_str()), "run {i}: own marker missing from streamed text {text:?}");
        assert!(content.starts_with(text.as_str()), "run {i}: deltas {text:?} are not a prefix of {content:?}");
        for other in markers.iter().filter(|m| *m != marker) {
            assert!(!content.contains(other.as_str()) && !text.contains(other.as_str()), "run {i} received {other}'s text");
            for e in events {
                assert!(!e.data.to_string().contains(other.as_str()), "run {i} got an event of {other}: {e:?}");
            }
        }
        // The model override reached the LLM, and only this run's requests carry its marker.
        let short_model = model.trim_start_matches("cogni/");
        assert!(content.contains(&format!("model={short_model} ")), "run {i}: expected model {short_model} in {content:?}");
        let reqs = llm_requests_for(&g, marker);
        assert!(!reqs.is_empty(), "run {i}: the LLM never saw {marker}");
        for r in &reqs {
            assert_eq!(r["model"], short_model, "run {i}: LLM request with the wrong model");
            if g.v3() {
                // Protocol 3 sends no trace id to the LLM (attribution uses the per-run token).
                assert!(r["headers"].get("traceparent").is_none(), "run {i}: unexpected traceparent on protocol 3");
            } else {
                let tp = r["headers"]["traceparent"].as_str().expect("traceparent header reaches the LLM");
                assert_eq!(tp.split('-').nth(1), Some(trace_id.as_str()), "run {i}: trace id did not reach the LLM");
            }
        }
        let accepted = events.iter().find(|e| e.event == "accepted").expect("accepted event");
        assert_eq!(accepted.id, 1, "accepted comes first");
    }
    clawmux::server::shutdown(&running).await;
}

/// Starts a SLOW run, waits for its first text, then stops it with `stop`; the LLM stream must end
/// incomplete (the gateway really cancelled the run).
async fn slow_run_is_cancelled_by(stop: &str) {
    let Some(g) = gateway() else { return };
    let running = start_for(&g, Some(&g.token)).await;
    let base = base(&running);
    let c = client();
    wait_ready(&c, &base, Duration::from_secs(30)).await;
    let marker = format!("CANCEL{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let run_id = format!("run-{marker}").to_lowercase();
    let mut body = json!({"message": format!("please go SLOW {marker}"), "billingAccountId": "acct-cancel", "runId": run_id});
    if stop == "timeout" {
        body["timeoutSec"] = json!(12);
    }
    let resp = post_sse(&c, &base, &body, &[]).await;
    let mut sse = SseReader::new(resp);
    if stop != "timeout" {
        sse.until(Duration::from_secs(60), |e| e.event == "text_delta").await.expect("the slow run streams");
    }
    match stop {
        "abort" => {
            let r = c.post(format!("{base}/v1/runs/{run_id}/abort")).send().await.expect("abort");
            assert_eq!(r.status(), 202);
            assert_eq!(r.json::<Value>().await.expect("json")["aborted"], true);
            let t = sse.terminal(Duration::from_secs(30)).await.expect("terminal after abort");
            assert_eq!(t.event, "error");
            assert_eq!(t.data["code"], "aborted");
        }
        "disconnect" => drop(sse),
        "timeout" => {
            let t = sse.terminal(Duration::from_secs(40)).await.expect("terminal at the timeout");
            assert!(!llm_requests_for(&g, &marker).is_empty(), "the LLM stream had started before the timeout");
            assert_eq!(t.event, "error");
            assert_eq!(t.data["code"], "timeout", "{t:?}");
        }
        other => panic!("unknown stop {other}"),
    }
    let completed = llm_stream_end(&g, &marker, Duration::from_secs(20)).await;
    assert_eq!(completed, Some(false), "the LLM stream must be cut short, not run to its end");
    // The run document says so too.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let doc: Value = c.get(format!("{base}/v1/runs/{run_id}")).send().await.expect("get").json().await.expect("doc");
        if doc["status"] != "running" {
            let expected = if stop == "timeout" { "timeout" } else { "aborted" };
            assert_eq!(doc["status"], expected, "{doc}");
            assert_eq!(doc["error"]["code"], expected);
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "run still running: {doc}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    clawmux::server::shutdown(&running).await;
}

#[actix_rt::test]
async fn live_abort_stops_the_llm_stream() {
    slow_run_is_cancelled_by("abort").await;
}

#[actix_rt::test]
async fn live_timeout_stops_the_llm_stream() {
    slow_run_is_cancelled_by("timeout").await;
}

#[actix_rt::test]
async fn live_client_disconnect_stops_the_llm_stream() {
    slow_run_is_cancelled_by("disconnect").await;
}

#[actix_rt::test]
async fn live_wrong_gateway_token_makes_readyz_503_with_a_reason() {
    let Some(g) = gateway() else { return };
    let running = start_for(&g, Some("not-the-token")).await;
    let base = base(&running);
    let c = client();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let r = c.get(format!("{base}/readyz")).send().await.expect("readyz");
        assert_eq!(r.status(), 503);
        let body: Value = r.json().await.expect("json");
        let reason = body["reason"].as_str().unwrap_or_default().to_owned();
        if reason.contains("token") {
            assert!(reason.contains("CLAWMUX_GATEWAY_TOKEN"), "{reason}");
            assert!(!reason.contains(&g.token) && !reason.contains("not-the-token"), "the reason must not echo tokens");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "no token reason in time: {body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // And runs are refused with 503 rather than hanging.
    let (status, body) = post_json(&c, &base, &json!({"message": "hi", "billingAccountId": "a"})).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "gateway_unavailable");
    clawmux::server::shutdown(&running).await;
}

#[actix_rt::test]
async fn live_killing_the_gateway_mid_run_ends_every_run_and_new_runs_succeed_after_reconnect() {
    let Some(g) = gateway() else { return };
    let running = start_for(&g, Some(&g.token)).await;
    let base = base(&running);
    let c = client();
    wait_ready(&c, &base, Duration::from_secs(30)).await;
    let tag = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let mut readers = Vec::new();
    for i in 0..3 {
        let body = json!({"message": format!("SLOW restart {tag}-{i}"), "billingAccountId": format!("acct-r{i}")});
        let resp = post_sse(&c, &base, &body, &[]).await;
        let mut sse = SseReader::new(resp);
        sse.until(Duration::from_secs(60), |e| e.event == "text_delta").await.expect("streaming before the restart");
        readers.push(sse);
    }
    let out = std::process::Command::new("bash")
        .args([concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/gateway.sh"), "restart-gateway", &g.run_dir])
        .output()
        .expect("gateway.sh runs");
    assert!(out.status.success(), "restart failed: {}", String::from_utf8_lossy(&out.stderr));
    for (i, sse) in readers.iter_mut().enumerate() {
        let t = sse.terminal(Duration::from_secs(60)).await.unwrap_or_else(|| panic!("run {i} hangs after the restart"));
        // The gateway restarted: the runs were lost with it and must say so (or, had they survived,
        // finish normally).
        assert!(t.event == "error" && t.data["code"] == "gateway_disconnected" || t.event == "final", "run {i}: {t:?}");
    }
    wait_ready(&c, &base, Duration::from_secs(60)).await;
    let marker = format!("AFTER{tag}");
    let (status, doc) = post_json(&c, &base, &json!({"message": format!("after restart {marker}"), "billingAccountId": "acct-r"})).await;
    assert_eq!(status, 200, "{doc}");
    assert_eq!(doc["status"], "ok", "{doc}");
    assert!(doc["content"].as_str().unwrap_or_default().contains(&marker), "{doc}");
    let reconnects = metric(&c, &base, "clawmux_gateway_connects_total{outcome=\"ok\"}").await;
    assert!(reconnects >= 2.0, "expected a reconnect, saw {reconnects} connects");
    clawmux::server::shutdown(&running).await;
}

// -------------------------------------------------------------------------------------------------
// Billing attribution: the gateway's model provider points at clawmux's LLM proxy (tests/run.sh
// starts a second gateway with PROVIDER_BASE_URL=http://127.0.0.1:$PROXY_PORT/v1 and passes its env
// file as CLAWMUX_BILLING_GATEWAY_ENV); the fake LLM is the proxy's upstream.
// -------------------------------------------------------------------------------------------------

/// The gateway of the billing tests: its provider must point at the proxy.
fn billing_gateway() -> Option<Gateway> {
    let g = gateway()?;
    if g.proxy_port.is_none() {
        assert!(
            std::env::var("CLAWMUX_REQUIRE_REAL_GATEWAY").as_deref() != Ok("1"),
            "the billing tests need a gateway whose provider points at the proxy (PROXY_PORT in its env file): run tests/run.sh"
        );
        eprintln!("this gateway's provider does not point at clawmux's proxy; skipping");
        return None;
    }
    Some(g)
}

#[actix_rt::test]
async fn proxied_eight_runs_from_four_accounts_bill_every_llm_call_to_its_own_run() {
    let Some(b) = billing_gateway() else { return };
    let key = format!("sk-upstream-{}", uuid::Uuid::new_v4().simple());
    let audit_dir = std::env::temp_dir().join(format!("clawmux-audit-{}", uuid::Uuid::new_v4().simple()));
    let proxy_port = b.proxy_port.expect("proxy port");
    let running = start_clawmux(&b.url, Some(&b.token), |cfg| {
        cfg.proxy_listen = std::net::SocketAddr::from(([127, 0, 0, 1], proxy_port));
        cfg.llm_upstream_url = Some(format!("http://127.0.0.1:{}", b.llm_port));
        cfg.llm_upstream_key = Some(clawmux::config::Secret::new(key.clone()));
        cfg.audit_dir = audit_dir.clone();
    })
    .await;
    let base = base(&running);
    let c = client();
    wait_ready(&c, &base, Duration::from_secs(30)).await;

    let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let mut runs = Vec::new();
    for i in 0..8 {
        let account = format!("acct-bill-{}", i % 4);
        let marker = format!("BILL{tag}R{i}X");
        let run_id = format!("run-{marker}").to_lowercase();
        // TOOL: the fake LLM first asks for an `exec` tool call, then answers: two LLM calls per run.
        let body = json!({"message": format!("TOOL:{marker} billing check {marker}"), "billingAccountId": account, "runId": run_id});
        let c = c.clone();
        let base = base.clone();
        runs.push(tokio::spawn(async move {
            let resp = post_sse(&c, &base, &body, &[]).await;
            let mut sse = SseReader::new(resp);
            let t = sse.terminal(Duration::from_secs(120)).await.expect("terminal");
            (marker, account, run_id, t, sse.events)
        }));
    }
    let mut all_events = String::new();
    for r in runs {
        let (marker, account, run_id, t, events) = r.await.expect("run");
        assert_eq!(t.event, "final", "{marker}: {t:?}\n{}", calls_billed_to(&b, &run_id));
        let content = t.data["content"].as_str().unwrap_or_default();
        assert!(content.contains("after-tool"), "{marker}: the tool round trip did not happen: {content}\n{}", calls_billed_to(&b, &run_id));
        let reqs = llm_requests_for(&b, &marker);
        assert!(
            reqs.len() >= 2,
            "{marker}: expected a tool call and a follow-up, saw {} LLM calls echoing the marker; final content: {content}\n{}",
            reqs.len(),
            calls_billed_to(&b, &run_id)
        );
        for r in &reqs {
            let h = &r["headers"];
            assert_eq!(h["x-litellm-end-user-id"], account.as_str(), "{marker}: billed to the wrong account (call {})", r["id"]);
            assert_eq!(h["x-cogni-run-id"], run_id.as_str(), "{marker}: attributed to the wrong run (call {})", r["id"]);
            let meta: Value = serde_json::from_str(h["x-litellm-spend-logs-metadata"].as_str().expect("metadata")).expect("json");
            assert_eq!(meta["run_id"], run_id.as_str());
            assert_eq!(h["authorization"], format!("Bearer {key}"));
        }
        // No request carrying another run's marker was billed to this run.
        let foreign: Vec<Value> = llm_log(&b)
            .into_iter()
            .filter(|e| e["headers"]["x-cogni-run-id"] == run_id.as_str())
            .filter(|e| !e["last_user"].as_str().unwrap_or_default().contains(&marker))
            .collect();
        assert!(foreign.is_empty(), "{marker}: calls of other runs billed here: {foreign:?}");
        // Usage in the run document = the sum of what the upstream reported for this run's calls.
        let ids: Vec<&str> = reqs.iter().filter_map(|r| r["id"].as_str()).collect();
        let log = llm_log(&b);
        let (mut input, mut output) = (0u64, 0u64);
        for u in log.iter().filter(|e| e["event"] == "usage" && e["id"].as_str().is_some_and(|id| ids.contains(&id))) {
            input += u["prompt_tokens"].as_u64().unwrap_or(0);
            output += u["completion_tokens"].as_u64().unwrap_or(0);
        }
        let doc = &t.data;
        assert_eq!(doc["usage"]["source"], "proxy", "{doc}");
        assert_eq!(doc["usage"]["llmCalls"].as_u64(), Some(reqs.len() as u64), "{doc}\n{}", calls_billed_to(&b, &run_id));
        assert_eq!(doc["usage"]["inputTokens"].as_u64(), Some(input), "{doc}\n{}", calls_billed_to(&b, &run_id));
        assert_eq!(doc["usage"]["outputTokens"].as_u64(), Some(output), "{doc}\n{}", calls_billed_to(&b, &run_id));
        for e in &events {
            all_events.push_str(&e.data.to_string());
        }
    }
    // The upstream key is nowhere the gateway or a caller could see it.
    let run_dir = std::path::Path::new(&b.run_dir);
    for f in ["openclaw.json", "gateway.log", "gateway-file.log"] {
        let text = std::fs::read_to_string(run_dir.join(f)).unwrap_or_default();
        assert!(!text.contains(&key), "the upstream key is in the gateway's {f}");
    }
    let environ = std::fs::read(format!("/proc/{}/environ", b.gateway_pid)).unwrap_or_default();
    assert!(!String::from_utf8_lossy(&environ).contains(&key), "the upstream key is in the gateway's environment");
    assert!(!all_events.contains(&key), "the upstream key is in an SSE event");
    let recs = common::audit_records_once(&audit_dir.join("audit.jsonl"), Duration::from_secs(20), |recs| recs.len() >= 16).await;
    assert!(recs.len() >= 16, "every LLM call is audited: {}", recs.len());
    let audit = std::fs::read_to_string(audit_dir.join("audit.jsonl")).expect("audit log");
    assert!(!audit.contains(&key), "the upstream key is in the audit log");
    clawmux::server::shutdown(&running).await;
    let _ = std::fs::remove_dir_all(audit_dir);
}

#[actix_rt::test]
async fn proxied_calls_that_no_running_run_owns_are_refused() {
    let Some(b) = billing_gateway() else { return };
    let audit_dir = std::env::temp_dir().join(format!("clawmux-audit-{}", uuid::Uuid::new_v4().simple()));
    let proxy_port = b.proxy_port.expect("proxy port");
    let running = start_clawmux(&b.url, Some(&b.token), |cfg| {
        cfg.proxy_listen = std::net::SocketAddr::from(([127, 0, 0, 1], proxy_port));
        cfg.llm_upstream_url = Some(format!("http://127.0.0.1:{}", b.llm_port));
        cfg.audit_dir = audit_dir.clone();
    })
    .await;
    let c = client();
    let proxy = format!("http://127.0.0.1:{proxy_port}");
    // What an agent with a shell inside the gateway container could try: call the LLM directly,
    // claiming someone else's account.
    let marker = format!("ROGUE{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    for tp in [None, Some(new_traceparent().1)] {
        let mut r = c
            .post(format!("{proxy}/v1/chat/completions"))
            .header("x-litellm-end-user-id", "acct-bill-0")
            .json(&json!({"model": "fake-model", "stream": true, "messages": [{"role": "user", "content": marker}]}));
        if let Some(tp) = tp {
            r = r.header("traceparent", tp);
        }
        assert_eq!(r.send().await.expect("call").status(), 409);
    }
    assert!(llm_requests_for(&b, &marker).is_empty(), "a refused call reached the upstream");
    clawmux::server::shutdown(&running).await;
    let _ = std::fs::remove_dir_all(audit_dir);
}

/// Tokens (prompt + completion) the fake LLM reported for its calls billed to `run_id`, and those
/// calls' replies (`tool_call`, `after_tool`, ...).
fn upstream_bill(g: &Gateway, run_id: &str) -> (u64, Vec<String>) {
    let log = llm_log(g);
    let calls: Vec<&Value> = log.iter().filter(|e| e["headers"]["x-cogni-run-id"] == run_id).collect();
    let ids: Vec<&str> = calls.iter().filter_map(|e| e["id"].as_str()).collect();
    let tokens = log
        .iter()
        .filter(|e| e["event"] == "usage" && e["id"].as_str().is_some_and(|id| ids.contains(&id)))
        .map(|e| e["prompt_tokens"].as_u64().unwrap_or(0) + e["completion_tokens"].as_u64().unwrap_or(0))
        .sum();
    (tokens, calls.iter().map(|e| e["reply"].as_str().unwrap_or_default().to_owned()).collect())
}

/// Budgets on the real gateway: four accounts run a tool round trip each (a tool call, then a
/// follow-up: two LLM calls). One account's budget is smaller than one call: its first call starts
/// under the cap and is served and billed; its second would start past the cap and is refused by
/// the proxy, so that run ends `budget_exceeded` mid-run, billed exactly what the upstream served
/// it. The other three finish, each billed exactly its calls.
#[actix_rt::test]
async fn proxied_four_accounts_one_over_budget_mid_run_is_cut_and_billed_exactly_the_others_finish() {
    let Some(b) = billing_gateway() else { return };
    let audit_dir = std::env::temp_dir().join(format!("clawmux-audit-{}", uuid::Uuid::new_v4().simple()));
    let proxy_port = b.proxy_port.expect("proxy port");
    let running = start_clawmux(&b.url, Some(&b.token), |cfg| {
        cfg.proxy_listen = std::net::SocketAddr::from(([127, 0, 0, 1], proxy_port));
        cfg.llm_upstream_url = Some(format!("http://127.0.0.1:{}", b.llm_port));
        cfg.audit_dir = audit_dir.clone();
    })
    .await;
    let base = base(&running);
    let c = client();
    wait_ready(&c, &base, Duration::from_secs(30)).await;

    let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    // Budget windows are aligned to the epoch: one of ~31 years has no boundary during the test.
    const PERIOD_SEC: u64 = 1_000_000_000;
    // Smaller than one call of the real gateway (~7500 tokens on 2026.9.6, ~4400 on 2026.4.12:
    // its system prompt).
    const CAP: u64 = 1000;
    let accounts: Vec<String> = (0..4).map(|i| format!("acct-budget-{tag}-{i}")).collect();
    for (i, account) in accounts.iter().enumerate() {
        let max = if i == 0 { CAP } else { 1_000_000_000 };
        let r = c
            .put(format!("{base}/v1/admin/accounts/{account}/limits"))
            .json(&json!({"maxTokens": max, "periodSec": PERIOD_SEC}))
            .send()
            .await
            .expect("set limits");
        assert_eq!(r.status(), 200, "{:?}", r.text().await);
    }
    let mut runs = Vec::new();
    for (i, account) in accounts.iter().enumerate() {
        let marker = format!("BUDGET{tag}R{i}X");
        let run_id = format!("run-{marker}").to_lowercase();
        let body = json!({"message": format!("TOOL:{marker} budget check {marker}"), "billingAccountId": account, "runId": run_id});
        let (c, base, account) = (c.clone(), base.clone(), account.clone());
        runs.push(tokio::spawn(async move {
            let mut sse = SseReader::new(post_sse(&c, &base, &body, &[]).await);
            let t = sse.terminal(Duration::from_secs(120)).await.expect("terminal");
            (account, run_id, t)
        }));
    }
    for (i, r) in runs.into_iter().enumerate() {
        let (account, run_id, t) = r.await.expect("run");
        let (billed, replies) = upstream_bill(&b, &run_id);
        let doc: Value = c.get(format!("{base}/v1/runs/{run_id}")).send().await.expect("get").json().await.expect("doc");
        let limits: Value = c.get(format!("{base}/v1/admin/accounts/{account}/limits")).send().await.expect("get").json().await.expect("limits");
        let usage = doc["usage"]["inputTokens"].as_u64().unwrap_or(0) + doc["usage"]["outputTokens"].as_u64().unwrap_or(0);
        assert_eq!(doc["usage"]["source"], "proxy", "{doc}");
        assert_eq!(usage, billed, "{run_id}: the run's usage is what the upstream served it: {doc}\n{}", calls_billed_to(&b, &run_id));
        assert_eq!(limits["spentTokens"].as_u64(), Some(billed), "{account}: the account's spend is its run's calls: {limits}");
        if i == 0 {
            assert_eq!((t.event.as_str(), t.data["code"].as_str()), ("error", Some("budget_exceeded")), "{t:?}\n{}", calls_billed_to(&b, &run_id));
            assert_eq!(replies, ["tool_call"], "only the call started under the cap reached the upstream\n{}", calls_billed_to(&b, &run_id));
            assert!(billed >= CAP, "the served call crossed the cap: {billed}");
            assert_eq!(doc["usage"]["llmCalls"], 1, "{doc}");
            assert_eq!(doc["error"]["code"], "budget_exceeded", "{doc}");
        } else {
            assert_eq!(t.event, "final", "{run_id}: {t:?}\n{}", calls_billed_to(&b, &run_id));
            assert!(t.data["content"].as_str().unwrap_or_default().contains("after-tool"), "{t:?}");
            assert!(replies.iter().any(|r| r == "after_tool"), "{run_id}: {replies:?}");
        }
    }
    assert!(metric(&c, &base, "clawmux_proxy_refusals_total{reason=\"budget_exceeded\"}").await >= 1.0);
    // The account's next run is refused at admission.
    let r = c.post(format!("{base}/v1/runs?wait=false")).json(&json!({"message": "more", "billingAccountId": accounts[0]})).send().await.expect("post");
    assert_eq!(r.status(), 402);
    assert!(r.headers().contains_key("retry-after"));
    clawmux::server::shutdown(&running).await;
    let _ = std::fs::remove_dir_all(audit_dir);
}


// ------------------------------------------------------------------------------------------------
// An operator connection of the test's own: what the gateway itself reports, not what clawmux says
// ------------------------------------------------------------------------------------------------

/// What the observer's connection task reports.
enum Seen {
    /// hello-ok: requests go to this sender.
    Up(tokio::sync::mpsc::UnboundedSender<String>),
    /// The handshake failed, and why.
    Failed(String),
    /// A decoded frame.
    Frame(clawmux_protocol::Frame),
    /// The connection ended, and why.
    Closed(String),
}

/// clawmux's own connection task reports into this channel (the same code clawmux connects with,
/// so the observer connects exactly as clawmux does, only without the session-scoped-events cap).
struct ObserverEvents(tokio::sync::mpsc::UnboundedSender<Seen>);

impl clawmux_actors::connection::ConnEvents for ObserverEvents {
    fn up(&self, _hello: clawmux_protocol::HelloOk, tx: tokio::sync::mpsc::UnboundedSender<String>) {
        let _ = self.0.send(Seen::Up(tx));
    }
    fn failed(&self, failure: clawmux_actors::connection::ConnectFailure) {
        let _ = self.0.send(Seen::Failed(failure.reason));
    }
    fn frame(&self, frame: Result<clawmux_protocol::Frame, clawmux_protocol::DecodeError>, _received: std::time::Instant) {
        if let Ok(f) = frame {
            let _ = self.0.send(Seen::Frame(f));
        }
    }
    fn closed(&self, reason: String) {
        let _ = self.0.send(Seen::Closed(reason));
    }
}

/// A second operator connection to the gateway, with a device identity of its own (protocol 3
/// grants scopes only to one) and WITHOUT `session-scoped-events`: the gateway then sends it every
/// session's `chat`/`agent` events, each with the session key the gateway itself put the run in.
struct Observer {
    /// Outbound frames (the connection task writes them).
    out: tokio::sync::mpsc::UnboundedSender<String>,
    /// What the connection task reports; read only while a call waits for its answer.
    rx: tokio::sync::mpsc::UnboundedReceiver<Seen>,
    /// `(sessionKey, runId)` of every run event seen so far.
    events: Vec<(Option<String>, Option<String>)>,
    /// Makes request ids unique on the connection.
    next_id: u64,
}

impl Observer {
    async fn connect(g: &Gateway) -> Self {
        let key = temp_dir("observer-device").join("device.json");
        let device = clawmux_actors::device::DeviceIdentity::load_or_create(&key).expect("observer device key");
        // 3..4: the observer watches either release.
        let mut params = clawmux_protocol::ConnectParams::multiplexer("observer", Some(g.token.clone()));
        params.min_protocol = clawmux_protocol::handshake::MIN_PROTOCOL;
        params.caps.clear();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let run = clawmux_actors::connection::run(
            g.url.clone(),
            params,
            Some(std::sync::Arc::new(device)),
            Duration::from_secs(30),
            ObserverEvents(tx),
        );
        actix_rt::spawn(run);
        let out = match tokio::time::timeout(Duration::from_secs(40), rx.recv()).await {
            Ok(Some(Seen::Up(out))) => out,
            Ok(Some(Seen::Failed(reason) | Seen::Closed(reason))) => panic!("observer connection failed: {reason}"),
            _ => panic!("observer connection: no hello-ok within 40 s"),
        };
        Self { out, rx, events: Vec::new(), next_id: 0 }
    }

    /// Calls `method` and returns its payload; run events that arrive meanwhile are kept.
    async fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = format!("obs-{}", self.next_id);
        let frame = clawmux_protocol::encode_request(&id, method, &params, None).expect("encode");
        self.out.send(frame).expect("observer connection open");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let seen = tokio::time::timeout_at(deadline, self.rx.recv()).await;
            match seen {
                Ok(Some(Seen::Frame(clawmux_protocol::Frame::Res(res)))) if res.id == id => {
                    assert!(res.ok, "{method}: {:?}", res.error);
                    return serde_json::from_str(res.payload.expect("payload").get()).expect("json payload");
                }
                Ok(Some(Seen::Frame(clawmux_protocol::Frame::Event(ev)))) => {
                    if let Some((k, r)) = ev.event.route_key() {
                        self.events.push((k.map(str::to_owned), r.map(str::to_owned)));
                    }
                }
                Ok(Some(Seen::Frame(_))) => {}
                Ok(Some(Seen::Closed(reason) | Seen::Failed(reason))) => panic!("observer connection lost: {reason}"),
                Ok(Some(Seen::Up(_))) => {}
                Ok(None) | Err(_) => panic!("{method}: no answer within 30 s"),
            }
        }
    }
}

/// Regression (cross-tenant): ids that collided under the old key rule get separate sessions on
/// the REAL gateway, as the gateway itself reports them to a connection of the test's own: every
/// `chat`/`agent` event of each run carries the key clawmux computed (and no other run's events
/// carry it), and the gateway's transcript under that key (`chat.history`) holds this run's
/// message (and on protocol 4 its run id) and no other tenant's. The second tenant's LLM context
/// does not contain the first tenant's message.
#[actix_rt::test]
async fn live_session_keys_are_injective_on_the_real_gateway() {
    let Some(g) = gateway() else { return };
    let running = start_for(&g, Some(&g.token)).await;
    let base = base(&running);
    let c = client();
    wait_ready(&c, &base, Duration::from_secs(30)).await;
    let mut observer = Observer::connect(&g).await;
    let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    // (account, stateKey, expected key): the first two were one session under plain
    // concatenation + lower-casing, and so were the last two.
    let cases = [
        ("Acme:Tenant.X_1", "Conv:1", "agent:main:clawmux:_acme_1_tenant_0_x_21.s._conv_11"),
        ("acme:tenant.x_1", "conv:1", "agent:main:clawmux:acme_1tenant_0x_21.s.conv_11"),
        ("t-a:x", "y", "agent:main:clawmux:t-a_1x.s.y"),
        ("t-a", "x:y", "agent:main:clawmux:t-a.s.x_1y"),
    ];
    let mut runs = Vec::new();
    for (i, (account, state, expected)) in cases.iter().enumerate() {
        let marker = format!("KEY{tag}T{i}X");
        let state = format!("{state}-{tag}");
        let expected = format!("{expected}-{tag}");
        let body = json!({"message": format!("key check {marker}"), "billingAccountId": account, "stateKey": state});
        let resp = post_sse(&c, &base, &body, &[]).await;
        assert_eq!(resp.status(), 200);
        let mut sse = SseReader::new(resp);
        let t = sse.terminal(Duration::from_secs(90)).await.expect("terminal");
        assert_eq!(t.event, "final", "{account}/{state}: {t:?}");
        let accepted = sse.events.iter().find(|e| e.event == "accepted").expect("accepted");
        assert_eq!(accepted.data["sessionKey"], expected.as_str(), "{account}/{state}");
        assert!(t.data["content"].as_str().unwrap_or_default().contains(&marker), "{t:?}");
        // Each conversation is new: no earlier tenant's message is in its LLM context.
        for r in llm_requests_for(&g, &marker) {
            let earlier: Vec<String> = (0..i).map(|j| format!("KEY{tag}T{j}X")).collect();
            assert_eq!(r["n_messages"].as_u64().map(|n| n <= 3), Some(true), "{marker}: a fresh session has no history: {r}");
            assert!(!earlier.iter().any(|m| r.to_string().contains(m.as_str())), "{marker} saw another tenant's message: {r}");
        }
        let gateway_run_id = accepted.data["gatewayRunId"].as_str().expect("gatewayRunId").to_owned();
        runs.push((marker, expected, gateway_run_id));
    }
    let markers: Vec<&str> = runs.iter().map(|(m, _, _)| m.as_str()).collect();
    for (marker, expected, gid) in &runs {
        // The gateway's transcript under the expected key: this run's message, nobody else's.
        let history = observer.call("chat.history", json!({"sessionKey": expected})).await;
        assert_eq!(history["sessionKey"].as_str(), Some(expected.as_str()), "{marker}: the gateway resolved the key to another session");
        let messages = history["messages"].as_array().cloned().unwrap_or_default();
        let text = Value::Array(messages.clone()).to_string();
        assert!(text.contains(marker.as_str()), "{marker}: its message is not in the gateway's session {expected}: {text}");
        for other in markers.iter().filter(|m| *m != marker) {
            assert!(!text.contains(other), "{marker}: the gateway's session {expected} holds {other}'s message");
        }
        if !g.v3() {
            // 2026.9.x stamps each assistant message with the run that wrote it.
            let run_ids: Vec<&str> = messages.iter().filter_map(|m| m.pointer("/__openclaw/runId").and_then(Value::as_str)).collect();
            assert!(!run_ids.is_empty() && run_ids.iter().all(|r| r == gid), "{marker}: runs {run_ids:?} wrote to {expected}, expected only {gid}");
        }
    }
    // Every run event the gateway broadcast (all read once the answer to a request sent after the
    // runs' ends is): a run's events carry its expected key, and the expected key carries only
    // that run.
    observer.call("health", json!({})).await;
    for (marker, expected, gid) in &runs {
        let of_run: Vec<&Option<String>> = observer.events.iter().filter(|(_, r)| r.as_deref() == Some(gid.as_str())).map(|(k, _)| k).collect();
        assert!(!of_run.is_empty(), "{marker}: the observer saw no event of run {gid}");
        assert!(of_run.iter().all(|k| k.as_deref() == Some(expected.as_str())), "{marker}: the gateway reported run {gid} in sessions {of_run:?}, not {expected}");
        let in_session: Vec<&Option<String>> = observer.events.iter().filter(|(k, _)| k.as_deref() == Some(expected.as_str())).map(|(_, r)| r).collect();
        assert!(in_session.iter().all(|r| r.as_deref() == Some(gid.as_str())), "{marker}: other runs {in_session:?} in session {expected}");
    }
    clawmux::server::shutdown(&running).await;
}
