//! Billing attribution through a REAL LiteLLM proxy: clawmux (with the replay gateway holding runs
//! open) -> clawmux's LLM proxy -> LiteLLM (PyPI `litellm[proxy]`) -> the project's fake LLM.
//! What is checked is LiteLLM's own spend record of every call: the end user it billed and the
//! run metadata it logged, as LiteLLM computed them.
//!
//! Needs a LiteLLM started by `tests/support/litellm.sh start DIR` and `CLAWMUX_LITELLM_ENV=DIR/env`.
//! Without that variable the tests print why and pass, unless `CLAWMUX_REQUIRE_LITELLM=1`.
//! The spend records are DIR/spend.jsonl (see tests/support/litellm/clawmux_spend_log.py): per
//! call, `spend_log` = the LiteLLM_SpendLogs row LiteLLM's DB writer would insert, and `standard`
//! = fields of LiteLLM's standard logging payload.

mod common;

use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway};
use common::*;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A running LiteLLM, from `DIR/env`.
struct LiteLlm {
    url: String,
    key: String,
    spend_log: PathBuf,
    upstream_log: PathBuf,
}

/// The LiteLLM to test against, or `None` (skip) when `CLAWMUX_LITELLM_ENV` is not set.
fn litellm(test: &str) -> Option<LiteLlm> {
    let Some(path) = std::env::var_os("CLAWMUX_LITELLM_ENV") else {
        assert!(
            std::env::var("CLAWMUX_REQUIRE_LITELLM").as_deref() != Ok("1"),
            "{test}: CLAWMUX_REQUIRE_LITELLM=1 but CLAWMUX_LITELLM_ENV is not set (run tests/support/litellm.sh start DIR)"
        );
        eprintln!("{test}: skipped: CLAWMUX_LITELLM_ENV is not set (tests/support/litellm.sh start DIR; CLAWMUX_LITELLM_ENV=DIR/env)");
        return None;
    };
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read CLAWMUX_LITELLM_ENV={}: {e}", path.to_string_lossy()));
    let get = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k).and_then(|r| r.strip_prefix('=')))
            .map(str::to_owned)
            .unwrap_or_else(|| panic!("{k} missing from {}", path.to_string_lossy()))
    };
    Some(LiteLlm { url: get("LITELLM_URL"), key: get("LITELLM_KEY"), spend_log: get("SPEND_LOG").into(), upstream_log: get("LLM_LOG").into() })
}

fn read_jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// LiteLLM's spend records whose logged run metadata names `run_id`.
fn records_of(ll: &LiteLlm, run_id: &str) -> Vec<Value> {
    read_jsonl(&ll.spend_log).into_iter().filter(|r| r["standard"]["metadata"]["spend_logs_metadata"]["run_id"] == run_id).collect()
}

/// Waits (bounded) until LiteLLM has logged `n` calls for `run_id`; LiteLLM's logging callbacks
/// run after the answer is sent.
async fn wait_records(ll: &LiteLlm, run_id: &str, n: usize) -> Vec<Value> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let recs = records_of(ll, run_id);
        if recs.len() >= n {
            return recs;
        }
        assert!(tokio::time::Instant::now() < deadline, "LiteLLM logged {} of {n} calls of {run_id} within 30 s: {recs:?}", recs.len());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}


/// clawmux in-process, its proxy's upstream = LiteLLM with LiteLLM's master key; a paused replay
/// gateway keeps runs live while calls are made on their behalf.
struct Stack {
    running: clawmux::server::Running,
    gw: clawmux::replay::ReplayHandle,
    base: String,
    proxy: String,
    audit: PathBuf,
    dir: PathBuf,
    c: reqwest::Client,
}

impl Stack {
    async fn start(ll: &LiteLlm, tag: &str) -> Self {
        let dir = temp_dir(tag);
        let gw = ReplayGateway::start(SocketAddr::from(([127, 0, 0, 1], 0)), ReplayConfig::new(Cassette::bundled().expect("cassette")).speed(0.0))
            .expect("replay gateway");
        gw.set_paused(true);
        let audit = dir.join("audit");
        let running = start_clawmux(&gw.url(), None, |cfg| {
            cfg.llm_upstream_url = Some(ll.url.clone());
            cfg.llm_upstream_key = Some(clawmux::config::Secret::new(ll.key.clone()));
            cfg.proxy_listen = SocketAddr::from(([127, 0, 0, 1], 0));
            cfg.audit_dir = audit.clone();
        })
        .await;
        let base = base(&running);
        let proxy = format!("http://{}", running.proxy.as_ref().expect("proxy runs").0);
        let c = reqwest::Client::new();
        wait_ready(&c, &base, Duration::from_secs(10)).await;
        Self { running, gw, base, proxy, audit, dir, c }
    }

    /// Starts a run for `account`; returns its trace id.
    async fn run(&self, run_id: &str, account: &str) -> String {
        let (trace_id, traceparent) = new_traceparent();
        let r = self
            .c
            .post(format!("{}/v1/runs?wait=false", self.base))
            .header("traceparent", &traceparent)
            .json(&json!({"message": "litellm billing run", "billingAccountId": account, "runId": run_id, "graphId": "sandbox:openclaw"}))
            .send()
            .await
            .expect("post run");
        assert_eq!(r.status(), 202, "{}", r.text().await.unwrap_or_default());
        wait_accepted(&self.c, &self.base, run_id).await;
        trace_id
    }

    async fn stop(self) {
        clawmux::server::shutdown(&self.running).await;
        self.gw.stop().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A call traceparent of the run's trace (new span id, as the gateway sends).
fn call_traceparent(trace_id: &str) -> String {
    format!("00-{trace_id}-{}-01", &uuid::Uuid::new_v4().simple().to_string()[..16])
}

#[actix_rt::test]
async fn litellm_spend_records_carry_each_runs_billing_account_and_run_id() {
    let Some(ll) = litellm("litellm_spend_records_carry_each_runs_billing_account_and_run_id") else { return };
    let st = Stack::start(&ll, "litellm").await;
    let tag = &uuid::Uuid::new_v4().simple().to_string()[..12];
    // Two runs of two billing accounts, live at the same time.
    let runs = [(format!("run-ll-a-{tag}"), format!("acct-ll-a-{tag}")), (format!("run-ll-b-{tag}"), format!("acct-ll-b-{tag}"))];
    let mut traces = Vec::new();
    for (run_id, account) in &runs {
        traces.push(st.run(run_id, account).await);
    }

    // The model list goes through with LiteLLM's key and bills nothing.
    let r = st.c.get(format!("{}/v1/models", st.proxy)).send().await.expect("models");
    assert_eq!(r.status(), 200);
    let models: Value = r.json().await.expect("json");
    assert!(models["data"].as_array().is_some_and(|d| d.iter().any(|m| m["id"] == "fake-model")), "{models}");

    // Per run: one streamed and one non-streamed call, interleaved across the runs, each with
    // everything a client could forge: billing headers (LiteLLM reads x-litellm-customer-id even
    // before x-litellm-end-user-id), a key of its own, and billing fields in the body.
    for stream in [true, false] {
        for ((run_id, _), trace) in runs.iter().zip(&traces) {
            let mut body = chat_body(&format!("hello {run_id} stream={stream}"), stream);
            body["user"] = json!("victim-body-user");
            body["metadata"] = json!({"spend_logs_metadata": {"run_id": "forged-body-run"}});
            let resp = st
                .c
                .post(format!("{}/v1/chat/completions", st.proxy))
                .header("traceparent", call_traceparent(trace))
                .header("authorization", "Bearer sk-forged-gateway-key")
                .header("x-litellm-api-key", "sk-forged-litellm-key")
                .header("x-litellm-end-user-id", "victim-account")
                .header("x-litellm-customer-id", "victim-customer")
                .header("x-cogni-run-id", "forged-run")
                .header("x-litellm-spend-logs-metadata", r#"{"run_id":"forged-run","graph_id":"forged"}"#)
                .json(&body)
                .send()
                .await
                .expect("proxied call");
            assert_eq!(resp.status(), 200, "stream={stream}");
            if stream {
                assert!(resp.headers()["content-type"].to_str().expect("ct").starts_with("text/event-stream"));
                let text = resp.text().await.expect("stream");
                assert!(text.contains(&format!("Reply to: hello {run_id}")) && text.contains("[DONE]"), "{text}");
            } else {
                let v: Value = resp.json().await.expect("json");
                assert!(v["choices"][0]["message"]["content"].as_str().unwrap_or_default().contains(run_id.as_str()), "{v}");
            }
        }
    }

    // LiteLLM's spend records: for each run exactly its two calls, billed to its account, with
    // its run metadata, in its trace; LiteLLM priced and counted them.
    let raw = std::fs::read_to_string(&ll.spend_log).expect("spend log");
    assert!(!raw.contains(&ll.key), "LiteLLM's key is in its spend log");
    for ((run_id, account), trace) in runs.iter().zip(&traces) {
        let recs = wait_records(&ll, run_id, 2).await;
        assert_eq!(recs.len(), 2, "{run_id}: {recs:?}");
        let mut streamed = BTreeSet::new();
        for r in &recs {
            let text = r.to_string();
            assert!(!text.contains("victim") && !text.contains("forged"), "a forged value reached LiteLLM's record: {text}");
            assert_eq!(r["event"], "success", "{r}");
            let s = &r["standard"];
            assert_eq!(s["end_user"], account.as_str(), "{r}");
            assert_eq!(s["status"], "success");
            assert_eq!(s["model_group"], "fake-model");
            let meta = &s["metadata"]["spend_logs_metadata"];
            assert_eq!(meta["run_id"], run_id.as_str());
            assert_eq!(meta["graph_id"], "sandbox:openclaw");
            assert_eq!(meta["attempt"], 0);
            assert_eq!(meta["session_key"], format!("agent:main:clawmux:{account}.r.{run_id}"));
            assert_eq!(s["metadata"]["requester_custom_headers"]["x-cogni-run-id"], run_id.as_str());
            assert_eq!(s["metadata"]["requester_custom_headers"]["x-litellm-end-user-id"], account.as_str());
            assert_eq!(s["trace_id"], trace.as_str(), "LiteLLM took the trace id from the forwarded traceparent");
            // The LiteLLM_SpendLogs row.
            let row = &r["spend_log"];
            assert!(r.get("spend_log_error").is_none(), "{r}");
            assert_eq!(row["end_user"], account.as_str());
            assert_eq!(row["session_id"], trace.as_str());
            assert_eq!(row["metadata"]["spend_logs_metadata"]["run_id"], run_id.as_str());
            assert_eq!(row["status"], "success");
            let (p, c) = (row["prompt_tokens"].as_u64().expect("prompt_tokens"), row["completion_tokens"].as_u64().expect("completion_tokens"));
            assert!(p > 0 && c > 0, "{row}");
            assert_eq!((p, c), (s["prompt_tokens"].as_u64().unwrap_or(0), s["completion_tokens"].as_u64().unwrap_or(0)));
            // config.yaml prices fake-model at 1e-6 per input and 2e-6 per output token.
            let spend = row["spend"].as_f64().expect("spend");
            let expected = p as f64 * 1e-6 + c as f64 * 2e-6;
            assert!((spend - expected).abs() < 1e-9, "spend {spend}, expected {expected}: {row}");
            streamed.insert(s["stream"] == true);
        }
        assert_eq!(streamed, BTreeSet::from([false, true]), "one streamed and one plain call: {recs:?}");

        // clawmux's run usage is what LiteLLM counted, and its audit names LiteLLM's call ids.
        let doc: Value = st.c.get(format!("{}/v1/runs/{run_id}", st.base)).send().await.expect("get").json().await.expect("doc");
        assert_eq!(doc["usage"]["source"], "proxy", "{doc}");
        assert_eq!(doc["usage"]["llmCalls"], 2, "{doc}");
        assert_eq!(doc["usage"]["inputTokens"], recs.iter().map(|r| r["spend_log"]["prompt_tokens"].as_u64().unwrap_or(0)).sum::<u64>(), "{doc}");
        assert_eq!(doc["usage"]["outputTokens"], recs.iter().map(|r| r["spend_log"]["completion_tokens"].as_u64().unwrap_or(0)).sum::<u64>(), "{doc}");
        let ids: BTreeSet<String> = recs.iter().filter_map(|r| r["standard"]["litellm_call_id"].as_str().map(str::to_owned)).collect();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let audited: BTreeSet<String> = clawmux::audit::read_records(&st.audit.join("audit.jsonl"))
                .unwrap_or_default()
                .iter()
                .filter(|a| a["runId"] == run_id.as_str())
                .inspect(|a| assert_eq!(a["billingAccountId"], account.as_str()))
                .filter_map(|a| a["upstreamCallId"].as_str().map(str::to_owned))
                .collect();
            if audited == ids {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "{run_id}: audit call ids {audited:?} != LiteLLM call ids {ids:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // Nothing LiteLLM logged was billed to a forged identity.
    assert!(!read_jsonl(&ll.spend_log).iter().any(|r| {
        let s = &r["standard"];
        ["victim-account", "victim-customer", "victim-body-user"].iter().any(|v| s["end_user"] == *v)
            || s["metadata"]["spend_logs_metadata"]["run_id"] == "forged-run"
            || s["metadata"]["spend_logs_metadata"]["run_id"] == "forged-body-run"
    }));
    st.stop().await;
}

#[actix_rt::test]
async fn litellm_refused_calls_never_reach_litellm() {
    let Some(ll) = litellm("litellm_refused_calls_never_reach_litellm") else { return };
    let st = Stack::start(&ll, "litellm-refused").await;
    let tag = &uuid::Uuid::new_v4().simple().to_string()[..12];
    let (run_id, account) = (format!("run-ll-r-{tag}"), format!("acct-ll-r-{tag}"));
    let trace = st.run(&run_id, &account).await;
    // No traceparent, one no run owns, a malformed one: refused by clawmux, whatever they claim.
    let refused: Vec<String> = ["NOTRACE", "MADEUP", "BADTRACE"].iter().map(|m| format!("{m}-{tag}")).collect();
    for (marker, tp) in refused.iter().zip([None, Some(new_traceparent().1), Some("00-zz-yy-01".to_owned())]) {
        let mut req = st.c.post(format!("{}/v1/chat/completions", st.proxy)).json(&chat_body(&format!("hello {marker}"), false));
        if let Some(tp) = tp {
            req = req.header("traceparent", tp);
        }
        let r = req.header("x-litellm-end-user-id", account.as_str()).header("x-cogni-run-id", run_id.as_str()).send().await.expect("call");
        assert_eq!(r.status(), 409, "{marker}");
        let e: Value = r.json().await.expect("json");
        assert_eq!(e["error"]["code"], "attribution_refused");
    }
    // Control: a call of the live run goes through and is logged by LiteLLM.
    let control = format!("CONTROL-{tag}");
    let r = st
        .c
        .post(format!("{}/v1/chat/completions", st.proxy))
        .header("traceparent", call_traceparent(&trace))
        .json(&chat_body(&format!("hello {control}"), false))
        .send()
        .await
        .expect("call");
    assert_eq!(r.status(), 200);
    let recs = wait_records(&ll, &run_id, 1).await;
    assert_eq!(recs.len(), 1, "only the control call is billed to the run: {recs:?}");
    assert_eq!(recs[0]["standard"]["end_user"], account.as_str());
    // What reached the LLM behind LiteLLM: the control call, none of the refused ones.
    let upstream: Vec<String> = read_jsonl(&ll.upstream_log).iter().filter_map(|e| e["last_user"].as_str().map(str::to_owned)).collect();
    assert!(upstream.iter().any(|u| u.contains(&control)), "the control call did not reach the fake LLM through LiteLLM");
    for marker in &refused {
        assert!(!upstream.iter().any(|u| u.contains(marker.as_str())), "{marker} reached the LLM");
    }
    st.stop().await;
}
