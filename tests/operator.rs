//! What operators and the runs page read over HTTP, against clawmux + the replay gateway: the run
//! document's who/what fields, a run's LLM calls from the proxy's audit log (scoped like the run
//! itself), the OpenAPI document, the runs page's files and their headers, and `405` with
//! `Allow`. (The browser tests are tests/browser.rs; schemathesis checks the whole API against the
//! document in tests/run.sh.)

mod common;

use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway};
use common::*;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::Duration;

fn gateway() -> clawmux::replay::ReplayHandle {
    ReplayGateway::start(SocketAddr::from(([127, 0, 0, 1], 0)), ReplayConfig::new(Cassette::bundled().expect("cassette")).speed(0.0))
        .expect("replay gateway")
}

#[actix_rt::test]
async fn the_run_document_names_account_agent_model_conversation_and_branch() {
    let gw = gateway();
    let running = start_clawmux(&gw.url(), None, |_| {}).await;
    let base = base(&running);
    let c = reqwest::Client::new();
    wait_ready(&c, &base, Duration::from_secs(10)).await;
    let (status, doc) = post_json(
        &c,
        &base,
        &json!({"message": "hi", "billingAccountId": "acct-doc", "stateKey": "conv-1", "model": "cogni/fake-model-b", "runId": "run-doc"}),
    )
    .await;
    assert_eq!(status, 200, "{doc}");
    assert_eq!(doc["billingAccountId"], "acct-doc");
    assert_eq!(doc["agentId"], "main");
    assert_eq!(doc["model"], "cogni/fake-model-b");
    assert_eq!(doc["stateKey"], "conv-1");
    assert_eq!(doc["branch"], Value::Null, "no branch key, no branch");
    // The same in the history (from the store) and without the optional ones.
    let (_, plain) = post_json(&c, &base, &json!({"message": "hi", "billingAccountId": "acct-doc", "runId": "run-plain"})).await;
    assert_eq!((plain["model"].clone(), plain["stateKey"].clone()), (Value::Null, Value::Null));
    let list: Value = c.get(format!("{base}/v1/runs?billingAccountId=acct-doc")).send().await.expect("list").json().await.expect("json");
    assert_eq!(list["runs"][1]["runId"], "run-doc");
    assert_eq!(list["runs"][1]["model"], "cogni/fake-model-b");
    assert_eq!(list["runs"][1]["agentId"], "main");
    clawmux::server::shutdown(&running).await;
}

#[actix_rt::test]
async fn a_runs_llm_calls_come_from_the_audit_log_scoped_like_the_run() {
    let dir = temp_dir("llm-calls");
    let llm = FakeLlm::start(&dir.join("llm"));
    let gw = gateway();
    gw.set_paused(true); // the runs stay live while calls are made on their behalf
    let admin = format!("admin-{}", uuid::Uuid::new_v4().simple());
    let running = start_clawmux(&gw.url(), None, |cfg| {
        cfg.api_token = Some(clawmux::config::Secret::new(admin.clone()));
        cfg.llm_upstream_url = Some(llm.url());
        cfg.proxy_listen = SocketAddr::from(([127, 0, 0, 1], 0));
        cfg.audit_dir = dir.join("audit");
    })
    .await;
    let base = base(&running);
    let proxy = format!("http://{}", running.proxy.as_ref().expect("proxy").0);
    let c = reqwest::Client::new();
    wait_ready(&c, &base, Duration::from_secs(10)).await;

    // Two live runs of two accounts, one call for the first, two for the second.
    let mut traces = Vec::new();
    for (run, account) in [("run-a", "acct-a"), ("run-b", "acct-b")] {
        let (trace_id, traceparent) = new_traceparent();
        let r = c
            .post(format!("{base}/v1/runs?wait=false"))
            .bearer_auth(&admin)
            .header("traceparent", traceparent)
            .json(&json!({"message": "hi", "billingAccountId": account, "runId": run}))
            .send()
            .await
            .expect("post");
        assert_eq!(r.status(), 202);
        traces.push(trace_id);
    }
    for (trace, n) in [(&traces[0], 1), (&traces[1], 2)] {
        for i in 0..n {
            let tp = format!("00-{trace}-{}-01", &uuid::Uuid::new_v4().simple().to_string()[..16]);
            let r = c
                .post(format!("{proxy}/v1/chat/completions"))
                .header("traceparent", tp)
                .json(&chat_body(&format!("PROMPT-MARKER {i}"), i % 2 == 0))
                .send()
                .await
                .expect("call");
            assert_eq!(r.status(), 200);
            let _ = r.text().await;
        }
    }

    let get = |who: &str, run: &str| {
        let req = c.get(format!("{base}/v1/runs/{run}/llm-calls")).bearer_auth(who.to_owned());
        async move {
            let r = req.send().await.expect("get");
            (r.status().as_u16(), r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    // A call's audit record is written by the audit thread after its answer ended (an fsync
    // each): wait for both runs' records (bounded) before looking at them. Seen under load: the
    // list was read before the last two records were on disk.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let counts = [get(&admin, "run-a").await.1, get(&admin, "run-b").await.1].map(|v| v["calls"].as_array().map_or(0, Vec::len));
        if counts == [1, 2] || tokio::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, a) = get(&admin, "run-a").await;
    assert_eq!(status, 200, "{a}");
    assert_eq!(a["proxy"], true);
    assert_eq!(a["calls"].as_array().map(Vec::len), Some(1), "{a}");
    let call = &a["calls"][0];
    assert_eq!(call["model"], "fake-model");
    assert_eq!(call["status"], 200);
    assert_eq!(call["outcome"], "ok");
    assert!(call["inputTokens"].as_u64().is_some_and(|n| n > 0), "{call}");
    assert!(call["latencyMs"].is_u64() && call["time"].is_string() && call["streamed"] == true, "{call}");
    let (_, b) = get(&admin, "run-b").await;
    assert_eq!(b["calls"].as_array().map(Vec::len), Some(2), "{b}");
    // No prompt, completion, key or billing header in the answer.
    for text in [a.to_string(), b.to_string()] {
        for secret in ["PROMPT-MARKER", "Reply to", "authorization", "billingAccountId", "upstreamCallId"] {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
    }

    // An API key of acct-a sees run-a's calls; run-b is another tenant's: 404, as for the run.
    let key: Value = c
        .post(format!("{base}/v1/admin/keys"))
        .bearer_auth(&admin)
        .json(&json!({"name": "reader", "accounts": ["acct-a"], "actions": ["read"]}))
        .send()
        .await
        .expect("key")
        .json()
        .await
        .expect("json");
    let key = key["key"].as_str().expect("key").to_owned();
    assert_eq!(get(&key, "run-a").await.0, 200);
    let (status, e) = get(&key, "run-b").await;
    assert_eq!(status, 404, "{e}");
    assert_eq!(e["error"]["code"], "not_found");
    assert_eq!(get(&key, "no-such-run").await.0, 404);
    assert_eq!(c.get(format!("{base}/v1/runs/run-a/llm-calls")).send().await.expect("get").status(), 401, "no token, no calls");

    gw.set_paused(false);
    clawmux::server::shutdown(&running).await;
}

#[actix_rt::test]
async fn without_a_proxy_a_run_has_no_recorded_calls_and_says_why() {
    let gw = gateway();
    let running = start_clawmux(&gw.url(), None, |_| {}).await;
    let base = base(&running);
    let c = reqwest::Client::new();
    wait_ready(&c, &base, Duration::from_secs(10)).await;
    let (_, doc) = post_json(&c, &base, &json!({"message": "hi", "billingAccountId": "acct", "runId": "run-np"})).await;
    assert_eq!(doc["status"], "ok");
    let v: Value = c.get(format!("{base}/v1/runs/run-np/llm-calls")).send().await.expect("get").json().await.expect("json");
    assert_eq!(v, json!({"runId": "run-np", "proxy": false, "calls": [], "truncated": false}));
    clawmux::server::shutdown(&running).await;
}

#[actix_rt::test]
async fn the_openapi_document_the_runs_page_and_405_are_served() {
    let gw = gateway();
    let running = start_clawmux(&gw.url(), None, |_| {}).await;
    let base = base(&running);
    let c = reqwest::Client::new();
    wait_ready(&c, &base, Duration::from_secs(10)).await;

    let r = c.get(format!("{base}/openapi.json")).send().await.expect("openapi");
    assert_eq!(r.status(), 200);
    let doc: Value = r.json().await.expect("json");
    assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.1")));
    assert_eq!(doc["info"]["version"], env!("CARGO_PKG_VERSION"));

    // The page: HTML and scripts from the binary, with a policy that allows nothing else.
    for (path, ct) in [("/ui/", "text/html"), ("/ui/run", "text/html"), ("/ui/runs.js", "text/javascript"), ("/ui/style.css", "text/css")] {
        let r = c.get(format!("{base}{path}")).send().await.expect("ui");
        assert_eq!(r.status(), 200, "{path}");
        let h = r.headers();
        assert!(h["content-type"].to_str().is_ok_and(|v| v.starts_with(ct)), "{path}: {:?}", h["content-type"]);
        let csp = h["content-security-policy"].to_str().expect("csp");
        assert!(csp.contains("script-src 'self'") && csp.contains("default-src 'none'") && csp.contains("frame-ancestors 'none'"), "{csp}");
        assert_eq!(h["x-content-type-options"], "nosniff");
    }
    let r = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().expect("client").get(format!("{base}/ui")).send().await.expect("ui");
    assert_eq!((r.status().as_u16(), r.headers()["location"].to_str().ok()), (308, Some("/ui/")));
    let r = c.get(format!("{base}/ui/nothing-here.js")).send().await.expect("ui");
    assert_eq!(r.status(), 404);

    // Another method on a known path: 405, the error shape, and the methods it has.
    let r = c.delete(format!("{base}/v1/runs")).send().await.expect("delete");
    assert_eq!(r.status(), 405);
    assert_eq!(r.headers()["allow"], "GET, POST");
    let e: Value = r.json().await.expect("json");
    assert_eq!(e["error"]["code"], "method_not_allowed");
    let r = c.post(format!("{base}/healthz")).send().await.expect("post");
    assert_eq!((r.status().as_u16(), r.headers().get("allow").and_then(|v| v.to_str().ok())), (405, Some("GET")));
    clawmux::server::shutdown(&running).await;
}
