//! The LLM attribution proxy end to end: clawmux (with the replay gateway holding a run open) in
//! front of the project's fake LLM as the upstream.

mod common;

use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway};
use common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::Duration;


#[actix_rt::test]
async fn proxy_attributes_calls_by_trace_id_overwrites_billing_headers_and_refuses_the_rest() {
    let dir = temp_dir("proxy");
    let llm = FakeLlm::start(&dir.join("llm"));
    let gw = ReplayGateway::start(SocketAddr::from(([127, 0, 0, 1], 0)), ReplayConfig::new(Cassette::bundled().expect("cassette")).speed(0.0))
        .expect("replay gateway");
    gw.set_paused(true); // the run stays live while we make LLM calls on its behalf
    let key = format!("sk-upstream-{}", uuid::Uuid::new_v4().simple());
    let audit_dir = dir.join("audit");
    let running = start_clawmux(&gw.url(), None, |cfg| {
        cfg.llm_upstream_url = Some(llm.url());
        cfg.llm_upstream_key = Some(clawmux::config::Secret::new(key.clone()));
        cfg.proxy_listen = SocketAddr::from(([127, 0, 0, 1], 0));
        cfg.audit_dir = audit_dir.clone();
    })
    .await;
    let base = base(&running);
    let proxy = format!("http://{}", running.proxy.as_ref().expect("proxy runs").0);
    let c = reqwest::Client::new();
    wait_ready(&c, &base, Duration::from_secs(10)).await;

    let (trace_id, traceparent) = new_traceparent();
    let r = c
        .post(format!("{base}/v1/runs?wait=false"))
        .header("traceparent", &traceparent)
        .json(&json!({"message": "billing run", "billingAccountId": "acct-payer", "runId": "run-billed", "graphId": "sandbox:openclaw"}))
        .send()
        .await
        .expect("post");
    assert_eq!(r.status(), 202);
    wait_accepted(&c, &base, "run-billed").await;

    // A second run may not reuse a live run's trace id: its calls could not be told apart.
    let r = c
        .post(format!("{base}/v1/runs?wait=false"))
        .header("traceparent", &traceparent)
        .json(&json!({"message": "same trace", "billingAccountId": "acct-other"}))
        .send()
        .await
        .expect("post");
    assert_eq!(r.status(), 409);
    // The run holding it may be another tenant's: the answer does not name it.
    let refused = r.text().await.expect("body");
    assert!(refused.contains("another live run uses this trace id") && !refused.contains("run-billed"), "{refused}");

    // The gateway's calls carry the same trace id with a new span id.
    let call_tp = format!("00-{trace_id}-{}-01", &uuid::Uuid::new_v4().simple().to_string()[..16]);
    let resp = c
        .post(format!("{proxy}/v1/chat/completions"))
        .header("traceparent", &call_tp)
        .header("authorization", "Bearer gateway-provider-key")
        .header("x-litellm-end-user-id", "victim-account")
        .header("x-cogni-run-id", "forged-run")
        .header("x-litellm-spend-logs-metadata", r#"{"run_id":"forged-run"}"#)
        .json(&chat_body("hello PROXYSTREAM", true))
        .send()
        .await
        .expect("proxied call");
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"].to_str().expect("ct").starts_with("text/event-stream"));
    let text = resp.text().await.expect("stream");
    assert!(text.contains("Reply to: hello PROXYSTREAM") && text.contains("[DONE]"), "{text}");
    let resp = c
        .post(format!("{proxy}/v1/chat/completions"))
        .header("traceparent", &call_tp)
        .json(&chat_body("hello PROXYPLAIN", false))
        .send()
        .await
        .expect("proxied call");
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.expect("json");
    assert!(body["choices"][0]["message"]["content"].as_str().unwrap_or_default().contains("PROXYPLAIN"));

    // What the upstream received: our key and the run's billing identity, nothing forged.
    let entries = llm.entries();
    for marker in ["PROXYSTREAM", "PROXYPLAIN"] {
        let e = entries.iter().find(|e| e["last_user"].as_str().is_some_and(|u| u.contains(marker))).expect("upstream saw the call");
        let h = &e["headers"];
        assert_eq!(h["authorization"], format!("Bearer {key}"));
        assert_eq!(h["x-litellm-end-user-id"], "acct-payer");
        assert_eq!(h["x-cogni-run-id"], "run-billed");
        let meta: Value = serde_json::from_str(h["x-litellm-spend-logs-metadata"].as_str().expect("metadata")).expect("json");
        assert_eq!(meta["run_id"], "run-billed");
        assert_eq!(meta["graph_id"], "sandbox:openclaw");
        assert_eq!(meta["session_key"], "agent:main:clawmux:acct-payer.r.run-billed");
        assert_eq!(h["traceparent"], call_tp.as_str());
    }

    // Refused: no traceparent, a made-up one, a malformed one. None reaches the upstream.
    for (tp, marker) in [(None, "NOTRACE"), (Some(new_traceparent().1), "MADEUP"), (Some("00-zz-yy-01".to_owned()), "BADTRACE")] {
        let mut req = c.post(format!("{proxy}/v1/chat/completions")).json(&chat_body(&format!("hello {marker}"), true));
        if let Some(tp) = tp {
            req = req.header("traceparent", tp);
        }
        let r = req.header("x-litellm-end-user-id", "acct-payer").send().await.expect("call");
        assert_eq!(r.status(), 409, "{marker}");
        let e: Value = r.json().await.expect("json");
        assert_eq!(e["error"]["code"], "attribution_refused");
    }
    assert!(!llm.entries().iter().any(|e| e["last_user"].as_str().is_some_and(|u| ["NOTRACE", "MADEUP", "BADTRACE"].iter().any(|m| u.contains(m)))));
    assert_eq!(metric(&c, &base, "clawmux_proxy_refusals_total").await, 3.0);
    assert!(metric(&c, &base, "clawmux_proxy_billing_header_disagreements_total").await >= 2.0, "forged headers are logged as disagreements");

    // The model list bills nothing and needs no run.
    let r = c.get(format!("{proxy}/v1/models")).send().await.expect("models");
    assert_eq!(r.status(), 200);

    // Usage in the run document is the sum of what the upstream reported, source "proxy".
    let usages: Vec<(u64, u64)> = llm
        .entries()
        .iter()
        .filter(|e| e["event"] == "usage")
        .map(|e| (e["prompt_tokens"].as_u64().unwrap_or(0), e["completion_tokens"].as_u64().unwrap_or(0)))
        .collect();
    assert_eq!(usages.len(), 2);
    let doc: Value = c.get(format!("{base}/v1/runs/run-billed")).send().await.expect("get").json().await.expect("doc");
    assert_eq!(doc["usage"]["source"], "proxy", "{doc}");
    assert_eq!(doc["usage"]["llmCalls"], 2);
    assert_eq!(doc["usage"]["inputTokens"], usages.iter().map(|u| u.0).sum::<u64>());
    assert_eq!(doc["usage"]["outputTokens"], usages.iter().map(|u| u.1).sum::<u64>());

    // Once the run ends, its trace id bills nothing more.
    let r = c.post(format!("{base}/v1/runs/run-billed/abort")).send().await.expect("abort");
    assert_eq!(r.status(), 202);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        // A call that races the run's end is cut by the proxy (the run's streams end with it): that
        // is a broken response here, not a forwarded one.
        let sent = c.post(format!("{proxy}/v1/chat/completions")).header("traceparent", &call_tp).json(&chat_body("hello LATE", true)).send().await;
        if sent.as_ref().is_ok_and(|r| r.status() == 409) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "calls for an ended run are still forwarded");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The audit log: one record per forwarded call, keyed by run id, no prompt, no key.
    let path = audit_dir.join("audit.jsonl");
    common::audit_records_once(&path, Duration::from_secs(20), |recs| recs.iter().filter(|r| r["runId"] == "run-billed" && r["outcome"] == "ok").count() >= 2).await;
    let raw = std::fs::read_to_string(&path).expect("audit log");
    assert!(!raw.contains(&key), "the upstream key is in the audit log");
    assert!(!raw.contains("PROXYSTREAM") && !raw.contains("hello"), "prompts are in the audit log");
    let recs = clawmux::audit::read_records(&path).expect("whole records");
    let billed: Vec<&Value> = recs.iter().filter(|r| r["runId"] == "run-billed").collect();
    // The two calls above completed; a LATE call that raced the abort was cut when the run ended.
    let completed: Vec<&&Value> = billed.iter().filter(|r| r["outcome"] == "ok").collect();
    assert!(completed.len() >= 2, "{recs:?}");
    for r in &billed {
        assert_eq!(r["billingAccountId"], "acct-payer");
        assert_eq!(r["status"], 200);
        assert!(r["outcome"] == "ok" || r["outcome"] == "run_ended", "{r}");
        assert!(r["upstreamCallId"].as_str().is_some_and(|s| !s.is_empty()));
    }
    for r in &completed {
        assert!(r["inputTokens"].as_u64().is_some(), "{r}");
    }
    assert!(completed.iter().any(|r| r["streamed"] == true) && completed.iter().any(|r| r["streamed"] == false));
    clawmux::server::shutdown(&running).await;
    gw.stop().await;
    let _ = std::fs::remove_dir_all(dir);
}

use common::free_port;

#[actix_rt::test]
async fn the_audit_log_survives_killing_clawmux_mid_stream() {
    let dir = temp_dir("audit-kill");
    let llm = FakeLlm::start(&dir.join("llm"));
    let gw = ReplayGateway::start(SocketAddr::from(([127, 0, 0, 1], 0)), ReplayConfig::new(Cassette::bundled().expect("cassette")).speed(0.0))
        .expect("replay gateway");
    gw.set_paused(true);
    let (api_port, proxy_port) = (free_port(), free_port());
    let key = format!("sk-upstream-{}", uuid::Uuid::new_v4().simple());
    let audit_dir = dir.join("audit");
    let stderr_path = dir.join("clawmux.log");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_clawmux"))
        .arg("serve")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("CLAWMUX_LISTEN", format!("127.0.0.1:{api_port}"))
        .env("CLAWMUX_PROXY_LISTEN", format!("127.0.0.1:{proxy_port}"))
        .env("CLAWMUX_GATEWAY_URL", gw.url())
        .env("CLAWMUX_LLM_UPSTREAM_URL", llm.url())
        .env("CLAWMUX_LLM_UPSTREAM_KEY", &key)
        .env("CLAWMUX_AUDIT_DIR", &audit_dir)
        .env("CLAWMUX_STORE_URL", format!("sqlite://{}", dir.join("runs.db").display()))
        .env("CLAWMUX_LOG", "debug")
        .env("CLAWMUX_DEVICE_IDENTITY", "off")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).expect("log file"))
        .spawn()
        .expect("clawmux binary starts");
    let base = format!("http://127.0.0.1:{api_port}");
    let proxy = format!("http://127.0.0.1:{proxy_port}");
    let c = reqwest::Client::new();
    wait_ready(&c, &base, Duration::from_secs(20)).await;
    let (trace_id, traceparent) = new_traceparent();
    let r = c
        .post(format!("{base}/v1/runs?wait=false"))
        .header("traceparent", &traceparent)
        .json(&json!({"message": "audit run", "billingAccountId": "acct-audit", "runId": "run-audit"}))
        .send()
        .await
        .expect("post");
    assert_eq!(r.status(), 202);
    wait_accepted(&c, &base, "run-audit").await;
    let call_tp = format!("00-{trace_id}-{}-01", &uuid::Uuid::new_v4().simple().to_string()[..16]);
    for i in 0..3 {
        let r = c.post(format!("{proxy}/v1/chat/completions")).header("traceparent", &call_tp).json(&chat_body(&format!("done {i}"), true)).send().await.expect("call");
        assert_eq!(r.status(), 200);
        r.text().await.expect("complete answer");
    }
    // Acknowledged = written and fsynced by the audit writer; give it a moment.
    let path = audit_dir.join("audit.jsonl");
    let audited = common::audit_records_once(&path, Duration::from_secs(20), |recs| recs.len() >= 3).await;
    assert!(audited.len() >= 3, "completed calls were not audited");
    // Kill -9 in the middle of a streamed answer.
    let resp = c.post(format!("{proxy}/v1/chat/completions")).header("traceparent", &call_tp).json(&chat_body("go SLOW now", true)).send().await.expect("call");
    let mut stream = resp.bytes_stream();
    let first = tokio::time::timeout(Duration::from_secs(10), stream.next()).await.expect("first chunk in time");
    assert!(first.is_some());
    child.kill().expect("kill -9");
    let _ = child.wait();

    let raw = std::fs::read_to_string(&path).expect("audit log");
    assert!(raw.ends_with('\n'), "no torn record");
    let recs = clawmux::audit::read_records(&path).expect("every line is a whole record");
    assert_eq!(recs.len(), 3, "the three acknowledged calls, and nothing torn: {recs:?}");
    let call_ids: Vec<String> = llm.entries().iter().filter(|e| e["event"] == "usage").filter_map(|e| e["id"].as_str().map(str::to_owned)).collect();
    for r in &recs {
        assert_eq!(r["runId"], "run-audit");
        assert!(call_ids.iter().any(|id| r["upstreamCallId"] == id.as_str()), "{r}");
    }
    // Reopening after the crash keeps every record.
    let log = clawmux::audit::AuditLog::open(&audit_dir, 1 << 20).expect("reopen");
    assert_eq!(clawmux::audit::read_records(log.path()).expect("records").len(), 3);
    // The upstream key appears in no log line.
    let logs = std::fs::read_to_string(&stderr_path).expect("log");
    assert!(logs.contains("LLM call"), "the log has the calls");
    assert!(!logs.contains(&key), "the upstream key leaked into the log");
    gw.stop().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// A port already in use (the API's or the proxy's) stops `serve` with one line naming the
/// address and its setting, and no panic (it used to panic in actix on the way out: an actor
/// started before the failing bind was dropped unpolled).
#[test]
fn a_port_in_use_stops_startup_with_one_line_naming_it() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let dir = temp_dir("port-in-use");
    for setting in ["CLAWMUX_LISTEN", "CLAWMUX_PROXY_LISTEN"] {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_clawmux"));
        cmd.arg("serve")
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", &dir)
            .env("CLAWMUX_GATEWAY_URL", "ws://127.0.0.1:9")
            .env("CLAWMUX_STORE_URL", "memory:")
            .env("CLAWMUX_DEVICE_IDENTITY", "off")
            .env("CLAWMUX_LLM_UPSTREAM_URL", "http://127.0.0.1:9")
            .env("CLAWMUX_AUDIT_DIR", dir.join("audit"))
            .env("CLAWMUX_LISTEN", "127.0.0.1:0")
            .env("CLAWMUX_PROXY_LISTEN", "127.0.0.1:0")
            .env(setting, &addr)
            .env("RUST_BACKTRACE", "0");
        let out = cmd.output().expect("clawmux runs");
        let log = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{setting}: {log}");
        assert!(!log.contains("panicked"), "{setting}: {log}");
        let last = log.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or_default();
        assert_eq!(last, format!("clawmux: cannot listen on {addr} ({setting}): Address already in use (os error 98)"), "{log}");
    }
    drop(taken);
}
