//! A restart of clawmux with runs in flight on the REAL OpenClaw gateway (openclaw@2026.9.6,
//! protocol 4) whose model provider points at clawmux's LLM proxy (the fake LLM is the proxy's
//! upstream). clawmux runs as a child process; `kill -9` takes its LLM proxy down with it, so the
//! LLM streams in flight are cut and the gateway retries them, against the restarted proxy.
//!
//! `tests/run.sh` starts a gateway of its own for this binary (`PROXY_PORT` and
//! `PROVIDER_BASE_URL` given to `tests/support/gateway.sh start`) and runs it with
//! `CLAWMUX_RESTART_GATEWAY_ENV=<run dir>/env`. Without that variable the test says so and returns,
//! unless `CLAWMUX_REQUIRE_RESTART_GATEWAY=1` (set by `tests/run.sh`), in which case it fails.

mod common;
#[path = "common/child.rs"]
mod child;
#[path = "common/proxied.rs"]
mod proxied;

use child::{attach, read_stream, Clawmux, Seen};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The gateway started for this test, from its env file.
struct Gateway {
    url: String,
    token: String,
    llm_log: String,
    llm_port: u16,
    /// Where the gateway's provider sends LLM calls: clawmux's proxy must listen there.
    proxy_port: u16,
}

fn gateway() -> Option<Gateway> {
    let env = proxied::env_file("CLAWMUX_RESTART_GATEWAY_ENV", "CLAWMUX_REQUIRE_RESTART_GATEWAY", "restart gateway")?;
    let get = |k: &str| proxied::get(&env, k);
    Some(Gateway {
        url: get("GATEWAY_URL"),
        token: get("GATEWAY_TOKEN"),
        llm_log: get("LLM_LOG"),
        llm_port: get("LLM_PORT").parse().expect("LLM_PORT"),
        proxy_port: get("PROXY_PORT").parse().expect("PROXY_PORT (the gateway's provider must point at the proxy)"),
    })
}

fn llm_log(g: &Gateway) -> Vec<Value> {
    proxied::llm_log(&g.llm_log)
}

/// One run of the test.
struct Run {
    id: String,
    account: String,
    marker: String,
    message: String,
}

impl Run {
    /// The answer the run must end with (40 words).
    fn expected_content(&self) -> String {
        proxied::expected_content(&self.message, &self.marker, 40)
    }
}

fn http() -> reqwest::Client {
    common::http_client(Some(Duration::from_secs(300)))
}


/// 8 runs from 4 accounts, each a tool call and then a slow answer (40 words, one a second).
/// clawmux is killed with `kill -9` while every answer streams, and started again on the same
/// store and proxy port. Every run must end with its own answer, whole and once (the deltas a
/// re-attaching client sees add up to it); every LLM call, the ones the gateway retried after the
/// restart included, must be billed to its own run and account with no refusal; and each run's
/// usage must be the sum of its calls on both sides of the restart, as the audit log has them.
#[actix_rt::test]
async fn proxied_restart_kill_9_mid_stream_keeps_every_run_its_text_and_its_bill() {
    let Some(g) = gateway() else { return };
    let http = http();
    let key = format!("sk-upstream-{}", uuid::Uuid::new_v4().simple());
    let audit_dir = common::temp_dir("restart-audit");
    let proxy_listen = format!("127.0.0.1:{}", g.proxy_port);
    let upstream = format!("http://127.0.0.1:{}", g.llm_port);
    let mut app = Clawmux::new(
        &g.url,
        &g.token,
        &[
            ("CLAWMUX_PROXY_LISTEN", proxy_listen.as_str()),
            ("CLAWMUX_LLM_UPSTREAM_URL", upstream.as_str()),
            ("CLAWMUX_LLM_UPSTREAM_KEY", key.as_str()),
            ("CLAWMUX_AUDIT_DIR", &audit_dir.display().to_string()),
        ],
    );
    app.start(&http).await;

    let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let runs: Vec<Run> = (0..8)
        .map(|i| {
            let marker = format!("RST{tag}R{i}X");
            // TOOL: a tool call first, then the answer; SLOW: the answer streams for 40 s.
            Run {
                id: format!("run-{marker}").to_lowercase(),
                account: format!("acct-restart-{}", i % 4),
                message: format!("TOOL:{marker} SLOW restart check {marker}"),
                marker,
            }
        })
        .collect();
    for r in &runs {
        let body = json!({"message": r.message, "billingAccountId": r.account, "runId": r.id, "timeoutSec": 300});
        let resp = http.post(format!("{}/v1/runs?wait=false", app.base)).json(&body).send().await.expect("post");
        assert_eq!(resp.status(), 202, "{:?}", resp.text().await);
    }
    let seen: HashMap<String, Arc<Mutex<Seen>>> = runs.iter().map(|r| (r.id.clone(), Arc::default())).collect();
    let mut readers = Vec::new();
    for r in &runs {
        let resp = attach(&http, &app.base, &r.id, 0).await;
        readers.push(tokio::spawn(read_stream(resp, seen[&r.id].clone(), Duration::from_secs(240))));
    }
    // Mid-stream: every run is past its tool call and a few words into its 40 s answer.
    proxied::until_all(&seen, Duration::from_secs(180), "streamed their answer", |s| s.text().contains("after-tool") && s.text().contains(" w3")).await;
    app.kill_9();
    let killed_at = unix_now();
    for r in readers {
        r.await.expect("reader");
    }
    for r in &runs {
        let s = seen[&r.id].lock().expect("seen");
        assert!(s.terminal().is_none() && !s.text().contains(" w40"), "{}: finished before the kill", r.id);
    }

    app.start(&http).await;
    let mut readers = Vec::new();
    for r in &runs {
        let after = seen[&r.id].lock().expect("seen").last_id();
        let resp = attach(&http, &app.base, &r.id, after).await;
        readers.push(tokio::spawn(read_stream(resp, seen[&r.id].clone(), Duration::from_secs(240))));
    }
    for r in readers {
        r.await.expect("reader");
    }

    // Each run: its own answer, whole and once; the deltas across both processes add up to it.
    let mut problems = Vec::new();
    for r in &runs {
        let s = seen[&r.id].lock().expect("seen");
        if let Some(p) = s.problems() {
            problems.push(format!("{}: {p}", r.id));
            continue;
        }
        let content = s.terminal().map(|t| t.data["content"].as_str().unwrap_or_default().to_owned()).unwrap_or_default();
        if content != r.expected_content() {
            problems.push(format!("{}: content {content:?}, expected {:?}", r.id, r.expected_content()));
        }
    }
    assert!(problems.is_empty(), "{} of {} runs wrong:\n{}\nclawmux log: {}", problems.len(), runs.len(), problems.join("\n"), app.log());

    // No LLM call was refused by the restarted proxy.
    let metrics = http.get(format!("{}/metrics", app.base)).send().await.expect("metrics").text().await.expect("text");
    let refused: Vec<&str> = metrics.lines().filter(|l| l.starts_with("clawmux_proxy_refusals_total") && !l.ends_with(" 0")).collect();
    assert!(refused.is_empty(), "the restarted proxy refused LLM calls: {refused:?}");

    // Every call the upstream saw is billed to the run whose message it carries, and each run made
    // calls after the restart (the retried answer).
    let log = llm_log(&g);
    let calls: Vec<&Value> = log.iter().filter(|e| e["path"] == "/v1/chat/completions").collect();
    let stream_end: HashMap<&str, bool> =
        log.iter().filter(|e| e["event"] == "stream_end").filter_map(|e| Some((e["id"].as_str()?, e["completed"].as_bool()?))).collect();
    let upstream_usage: HashMap<&str, (u64, u64)> = log
        .iter()
        .filter(|e| e["event"] == "usage")
        .filter_map(|e| Some((e["id"].as_str()?, (e["prompt_tokens"].as_u64()?, e["completion_tokens"].as_u64()?))))
        .collect();
    // Every call the upstream completed gets its record (written after the stream's end).
    let completed_ids: Vec<&str> = calls.iter().filter_map(|c| c["id"].as_str()).filter(|id| stream_end.get(id) == Some(&true)).collect();
    let audit = common::audit_records_once(&audit_dir.join("audit.jsonl"), Duration::from_secs(20), |recs| {
        completed_ids.iter().all(|id| recs.iter().any(|a| a["upstreamCallId"] == *id))
    })
    .await;
    for r in &runs {
        let mine: Vec<&&Value> = calls.iter().filter(|e| e["last_user"].as_str().is_some_and(|u| u.contains(&r.marker))).collect();
        for c in &mine {
            let h = &c["headers"];
            assert_eq!(h["x-cogni-run-id"], r.id.as_str(), "{}: a call attributed to another run: {c}", r.id);
            assert_eq!(h["x-litellm-end-user-id"], r.account.as_str(), "{}: a call billed to another account: {c}", r.id);
            assert_eq!(h["authorization"], format!("Bearer {key}"));
        }
        let billed: Vec<&&Value> = calls.iter().filter(|e| e["headers"]["x-cogni-run-id"] == r.id.as_str()).collect();
        assert_eq!(billed.len(), mine.len(), "{}: calls of other runs billed to it", r.id);
        let after_restart = mine.iter().filter(|c| c["ts"].as_f64().is_some_and(|t| t > killed_at)).count();
        assert!(after_restart >= 1, "{}: no LLM call after the restart", r.id);

        // The audit log (both processes' records) is the bill: one record per call that ended,
        // with the tokens the upstream reported; a call cut by the kill left none.
        let records: Vec<&Value> = audit.iter().filter(|a| a["runId"] == r.id.as_str()).collect();
        let completed: Vec<&str> = mine.iter().filter_map(|c| c["id"].as_str()).filter(|id| stream_end.get(id) == Some(&true)).collect();
        let mut audited: Vec<&str> = records.iter().filter_map(|a| a["upstreamCallId"].as_str()).collect();
        audited.sort_unstable();
        let mut expected = completed.clone();
        expected.sort_unstable();
        assert_eq!(audited, expected, "{}: audit records vs. the calls the upstream completed: {records:?}", r.id);
        for a in &records {
            let id = a["upstreamCallId"].as_str().unwrap_or_default();
            assert_eq!(a["billingAccountId"], r.account.as_str(), "{a}");
            let tokens = (a["inputTokens"].as_u64(), a["outputTokens"].as_u64());
            assert_eq!(tokens, upstream_usage.get(id).map(|(i, o)| (Some(*i), Some(*o))).unwrap_or_default(), "{}: {a}", r.id);
        }
        assert!(records.len() >= 2, "{}: expected the tool call before the kill and the answer after it: {records:?}", r.id);
        let input: u64 = records.iter().filter_map(|a| a["inputTokens"].as_u64()).sum();
        let output: u64 = records.iter().filter_map(|a| a["outputTokens"].as_u64()).sum();

        let doc: Value = http.get(format!("{}/v1/runs/{}", app.base, r.id)).send().await.expect("get").json().await.expect("doc");
        assert_eq!(doc["status"], "ok", "{doc}");
        assert_eq!(doc["usage"]["source"], "proxy", "{doc}");
        assert_eq!(doc["usage"]["inputTokens"].as_u64(), Some(input), "{}: usage vs. the audit log: {doc}", r.id);
        assert_eq!(doc["usage"]["outputTokens"].as_u64(), Some(output), "{}: usage vs. the audit log: {doc}", r.id);
        // Every call forwarded counts, the one the kill cut included.
        assert_eq!(doc["usage"]["llmCalls"].as_u64(), Some(mine.len() as u64), "{}: {doc}", r.id);
    }
    let _ = std::fs::remove_dir_all(&audit_dir);
}

fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or_default()
}
