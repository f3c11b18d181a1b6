//! The runs page (`/ui/`) in a real headless Chromium, against clawmux + the replay gateway: the
//! table lists the runs that were posted and its filters and pages work, a running run's output
//! arrives live and keeps arriving after the page's connection is cut, abort ends a run, a run's
//! LLM calls (through the proxy, in front of the fake LLM) are listed, a branch run's relay result
//! links its pull request (an http(s) one only), the token is asked for and an API key sees only
//! its runs, whatever a run carries is shown as text, never run as code, and `clawmux demo`'s
//! printed URL shows its run.
//!
//! Named `browser_*`: tests/run.sh runs them in a phase of their own (phase 1 skips them), after
//! installing Debian's chromium and chromium-driver. Screenshots go to the directory the tests
//! print (`CLAWMUX_BROWSER_ARTIFACTS`); with `CLAWMUX_UPDATE_DOCS_SCREENSHOT=1` the runs table's
//! also replaces `docs/ui-runs.png` (the README's).

mod common;
#[path = "common/tcp_chaos.rs"]
mod tcp_chaos;
#[path = "common/webdriver.rs"]
mod webdriver;

use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway, ReplayHandle};
use common::*;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::Duration;
use webdriver::{Browser, Driver};

/// Generous bounds: the machine may be busy building.
const PAGE: Duration = Duration::from_secs(20);

fn replay(speed: f64, deltas: Option<usize>) -> ReplayHandle {
    replay_of(Cassette::bundled().expect("cassette"), speed, deltas)
}

fn replay_of(cassette: Cassette, speed: f64, deltas: Option<usize>) -> ReplayHandle {
    let cfg = ReplayConfig::new(cassette).speed(speed).deltas_override(deltas);
    ReplayGateway::start(SocketAddr::from(([127, 0, 0, 1], 0)), cfg).expect("replay gateway")
}

async fn browser() -> Option<(Driver, Browser)> {
    let (chrome, driver) = webdriver::binaries()?;
    let d = Driver::start(&chrome, &driver).await;
    let b = d.browser().await;
    Some((d, b))
}

fn shot(name: &str) -> std::path::PathBuf {
    let dir = webdriver::artifacts_dir();
    eprintln!("browser test artefacts in {}", dir.display());
    dir.join(name)
}

/// Posts a run and waits for its end (JSON mode); returns its document.
async fn run_to_end(c: &reqwest::Client, base: &str, body: Value) -> Value {
    let (status, doc) = post_json(c, base, &body).await;
    assert_eq!(status, 200, "{doc}");
    doc
}

/// The run ids the table shows, in order.
const TABLE_IDS: &str = "return [...document.querySelectorAll('#runs tbody tr')].map(r => r.dataset.runId);";

async fn table_ids(b: &Browser) -> Vec<String> {
    serde_json::from_value(b.js(TABLE_IDS, json!([])).await).unwrap_or_default()
}

/// Waits until the table has loaded (a row or the "no runs" note) and returns its run ids.
async fn loaded_table(b: &Browser) -> Vec<String> {
    b.wait_for(
        "the runs table",
        PAGE,
        "return document.querySelectorAll('#runs tbody tr').length > 0 || !document.getElementById('empty').hidden;",
        |v| v == &json!(true),
    )
    .await;
    table_ids(b).await
}

#[actix_rt::test]
async fn browser_runs_table_lists_posted_runs_and_its_filters_and_pages_work() {
    let Some((_driver, b)) = browser().await else { return };
    let gw = replay(0.0, None);
    let running = start_clawmux(&gw.url(), None, |_| {}).await;
    let base = base(&running);
    let c = reqwest::Client::new();
    wait_ready(&c, &base, Duration::from_secs(10)).await;

    // One run that ends aborted: held by the paused gateway, then aborted.
    gw.set_paused(true);
    let r = c
        .post(format!("{base}/v1/runs?wait=false"))
        .json(&json!({"message": "stop me", "billingAccountId": "acct-red", "runId": "run-aborted"}))
        .send()
        .await
        .expect("post");
    assert_eq!(r.status(), 202);
    wait_accepted(&c, &base, "run-aborted").await;
    let r = c.post(format!("{base}/v1/runs/run-aborted/abort")).send().await.expect("abort");
    assert_eq!(r.status(), 202);
    // Its end first: a gateway let go now could finish it before the abort lands.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let doc: Value = c.get(format!("{base}/v1/runs/run-aborted")).send().await.expect("get").json().await.expect("doc");
        if doc["status"] == "aborted" {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the run did not end aborted: {doc}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    gw.set_paused(false);
    // Eleven that end ok, on two accounts, one with a model override and a conversation.
    let mut posted = vec!["run-aborted".to_owned()];
    for i in 0..11 {
        let account = if i % 3 == 0 { "acct-green" } else { "acct-blue" };
        let mut body = json!({"message": format!("hello {i}"), "billingAccountId": account, "runId": format!("run-{i:02}")});
        if i == 3 {
            body["model"] = json!("cogni/fake-model-b");
            body["stateKey"] = json!("conv-7");
        }
        let doc = run_to_end(&c, &base, body).await;
        assert_eq!(doc["status"], "ok", "{doc}");
        posted.push(format!("run-{i:02}"));
    }

    // Every posted run, newest first, on one page of 50.
    b.goto(&format!("{base}/ui/")).await;
    let ids = loaded_table(&b).await;
    let mut newest_first = posted.clone();
    newest_first.reverse();
    assert_eq!(ids, newest_first);
    // A row shows the run's document: status, account, agent, model, tokens, branch.
    let row = b
        .js(
            "const r = document.querySelector('#runs tbody tr[data-run-id=\"run-03\"]');
             return [...r.cells].map(c => c.textContent.trim());",
            json!([]),
        )
        .await;
    assert_eq!(row[0], "ok", "{row}");
    assert_eq!(row[1], "run-03");
    assert_eq!(row[2], "acct-green");
    assert_eq!(row[3], "main");
    assert_eq!(row[4], "cogni/fake-model-b");
    assert!(row[7].as_str().is_some_and(|t| t.contains(" / ")), "tokens in / out: {row}");
    assert_eq!(b.text("#runs tbody tr[data-run-id=\"run-aborted\"] .status").await, "aborted");
    b.screenshot(&shot("runs-table.png")).await;
    if std::env::var("CLAWMUX_UPDATE_DOCS_SCREENSHOT").as_deref() == Ok("1") {
        b.screenshot(std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/ui-runs.png"))).await;
    }

    // Filter by account, through the form.
    b.type_into("#f-account", "acct-green").await;
    b.click("#apply").await;
    b.wait_for("the account filter in the URL", PAGE, "return location.search;", |v| v.as_str().is_some_and(|s| s.contains("billingAccountId=acct-green"))).await;
    let ids = loaded_table(&b).await;
    assert_eq!(ids, ["run-09", "run-06", "run-03", "run-00"]);
    // And by status (the account filter stays).
    b.click("#f-status option[value=\"aborted\"]").await;
    b.click("#apply").await;
    b.wait_for("the status filter in the URL", PAGE, "return location.search;", |v| v.as_str().is_some_and(|s| s.contains("status=aborted"))).await;
    assert_eq!(loaded_table(&b).await, Vec::<String>::new(), "no aborted run on acct-green");
    assert!(!b.js("return document.getElementById('empty').hidden;", json!([])).await.as_bool().unwrap_or(true));
    b.type_into("#f-account", "acct-red").await;
    b.click("#apply").await;
    b.wait_for("acct-red in the URL", PAGE, "return location.search;", |v| v.as_str().is_some_and(|s| s.contains("acct-red"))).await;
    assert_eq!(loaded_table(&b).await, ["run-aborted"]);
    b.screenshot(&shot("runs-filtered.png")).await;

    // Pages of 10: the first ten, then the other two, then back.
    b.click("#reset").await;
    b.wait_for("the filters reset", PAGE, "return location.search;", |v| v == &json!("")).await;
    assert_eq!(loaded_table(&b).await.len(), 12);
    b.click("#f-limit option[value=\"10\"]").await;
    b.click("#apply").await;
    b.wait_for("limit=10 in the URL", PAGE, "return location.search;", |v| v.as_str().is_some_and(|s| s.contains("limit=10"))).await;
    assert_eq!(loaded_table(&b).await, newest_first[..10]);
    b.click("#next-page").await;
    b.wait_for("a cursor in the URL", PAGE, "return location.search;", |v| v.as_str().is_some_and(|s| s.contains("cursor="))).await;
    assert_eq!(loaded_table(&b).await, newest_first[10..]);
    assert_eq!(b.js("return document.getElementById('next-page').disabled;", json!([])).await, json!(true), "the last page");
    b.click("#first-page").await;
    b.wait_for("no cursor in the URL", PAGE, "return location.search;", |v| v.as_str().is_some_and(|s| !s.contains("cursor="))).await;
    assert_eq!(loaded_table(&b).await, newest_first[..10]);

    b.quit().await;
    clawmux::server::shutdown(&running).await;
}

#[actix_rt::test]
async fn browser_a_running_run_streams_live_resumes_after_a_cut_connection_and_abort_ends_it() {
    let Some((_driver, b)) = browser().await else { return };
    // The long recorded answer re-cut into 300 deltas at a twentieth of its speed: text starts
    // after ~7 s and arrives for a minute, a delta every ~0.2 s.
    let long = Cassette::from_path(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cassettes/openclaw-2026.9.6-long.jsonl")).expect("cassette");
    let gw = replay_of(long, 0.05, Some(300));
    let running = start_clawmux(&gw.url(), None, |_| {}).await;
    let base = base(&running);
    let c = reqwest::Client::new();
    wait_ready(&c, &base, Duration::from_secs(10)).await;
    // The browser reaches clawmux through a TCP relay the test can cut, like a dropped network.
    let relay = tcp_chaos::ChaosRelay::start(running.addr).await.expect("relay");
    let page = format!("http://{}", relay.addr);

    let r = c
        .post(format!("{base}/v1/runs?wait=false"))
        .json(&json!({"message": "a long answer", "billingAccountId": "acct-live", "runId": "run-live"}))
        .send()
        .await
        .expect("post");
    assert_eq!(r.status(), 202);

    b.goto(&format!("{page}/ui/run?id=run-live")).await;
    let output_len = "return document.getElementById('output').textContent.length;";
    let first = b.wait_for("output to appear", PAGE, output_len, |v| v.as_u64().is_some_and(|n| n > 0)).await;
    let first = first.as_u64().unwrap_or_default();
    // More arrives without a reload: the page reads the stream live.
    let grown = b.wait_for("output to grow", PAGE, output_len, |v| v.as_u64().is_some_and(|n| n > first)).await;
    assert_eq!(b.js("return document.getElementById('stream-state').dataset.state;", json!([])).await, "live");
    assert_eq!(b.text("#status").await, "running");
    assert!(!b.js("return document.getElementById('abort').hidden;", json!([])).await.as_bool().unwrap_or(true), "abort is offered");
    tracing_note(&format!("live: {first} then {grown} characters"));

    // Cut every connection between the page and clawmux (TCP reset, no goodbye).
    let cut = relay.cut_all();
    assert!(cut >= 1, "the page's stream went through the relay");
    let at_cut = b.js(output_len, json!([])).await.as_u64().unwrap_or_default();
    b.wait_for(
        "the page to re-attach",
        PAGE,
        "const s = document.getElementById('stream-state'); return [s.dataset.state, Number(s.dataset.reconnects)];",
        |v| v[0] == "live" && v[1].as_u64().is_some_and(|n| n >= 1),
    )
    .await;
    b.wait_for("output to keep growing after the cut", PAGE, output_len, |v| v.as_u64().is_some_and(|n| n > at_cut + 20)).await;
    b.screenshot(&shot("run-live.png")).await;

    // Abort from the page.
    b.click("#abort").await;
    b.wait_for("the run to end aborted", PAGE, "return document.getElementById('status').textContent;", |v| v == "aborted").await;
    assert_eq!(b.text("#error-code").await, "aborted");
    b.wait_for("the stream to end", PAGE, "return document.getElementById('stream-state').dataset.state;", |v| v == "ended").await;
    assert_eq!(b.js("return document.getElementById('abort').hidden;", json!([])).await, json!(true), "no abort for an ended run");
    let doc: Value = c.get(format!("{base}/v1/runs/run-live")).send().await.expect("get").json().await.expect("doc");
    assert_eq!(doc["status"], "aborted");

    // What the page shows is exactly the run's streamed text: nothing lost or repeated across
    // the cut (it re-attached after the last event it had).
    let events = parse_sse(&c.get(format!("{base}/v1/runs/run-live/events")).send().await.expect("events").text().await.expect("body"));
    let streamed: String = events.iter().filter(|e| e.event == "text_delta").filter_map(|e| e.data["text"].as_str()).collect();
    assert!(streamed.len() > 20);
    assert_eq!(b.text("#output").await, streamed);
    b.screenshot(&shot("run-aborted.png")).await;

    b.quit().await;
    clawmux::server::shutdown(&running).await;
}

fn tracing_note(s: &str) {
    eprintln!("{s}");
}

#[actix_rt::test]
async fn browser_a_runs_llm_calls_through_the_proxy_are_listed_without_prompts() {
    let Some((_driver, b)) = browser().await else { return };
    let dir = temp_dir("browser-llm");
    let llm = FakeLlm::start(&dir.join("llm"));
    let gw = replay(0.0, None);
    gw.set_paused(true); // the run stays live while a call is made on its behalf
    let running = start_clawmux(&gw.url(), None, |cfg| {
        cfg.llm_upstream_url = Some(llm.url());
        cfg.proxy_listen = SocketAddr::from(([127, 0, 0, 1], 0));
        cfg.audit_dir = dir.join("audit");
    })
    .await;
    let base = base(&running);
    let proxy = format!("http://{}", running.proxy.as_ref().expect("proxy").0);
    let c = reqwest::Client::new();
    wait_ready(&c, &base, Duration::from_secs(10)).await;

    let (trace_id, traceparent) = new_traceparent();
    let r = c
        .post(format!("{base}/v1/runs?wait=false"))
        .header("traceparent", &traceparent)
        .json(&json!({"message": "billed run", "billingAccountId": "acct-llm", "runId": "run-llm"}))
        .send()
        .await
        .expect("post");
    assert_eq!(r.status(), 202);
    wait_accepted(&c, &base, "run-llm").await;
    b.goto(&format!("{base}/ui/run?id=run-llm")).await;
    b.wait_for("the page to load the run", PAGE, "return document.getElementById('status').textContent;", |v| v == "running").await;
    assert_eq!(b.js("return document.querySelectorAll('#llm-calls tbody tr').length;", json!([])).await, json!(0));

    // The gateway's LLM call, as it would make it: the run's trace id, a new span.
    let call_tp = format!("00-{trace_id}-{}-01", &uuid::Uuid::new_v4().simple().to_string()[..16]);
    let resp = c
        .post(format!("{proxy}/v1/chat/completions"))
        .header("traceparent", &call_tp)
        .json(&chat_body("the SECRET-PROMPT-MARKER question", true))
        .send()
        .await
        .expect("proxied call");
    assert_eq!(resp.status(), 200);
    let _ = resp.text().await;

    // The page re-reads the calls while the run is live: the row appears.
    let row = b
        .wait_for(
            "an LLM call row",
            PAGE,
            "return [...document.querySelectorAll('#llm-calls tbody tr')].map(r => [...r.cells].map(c => c.textContent));",
            |v| v.as_array().is_some_and(|rows| rows.len() == 1),
        )
        .await;
    let cells = &row[0];
    assert_eq!(cells[1], "fake-model", "{row}");
    assert_eq!(cells[2], "200");
    assert_eq!(cells[3], "ok");
    assert!(cells[5].as_str().is_some_and(|t| t.chars().next().is_some_and(|ch| ch.is_ascii_digit())), "tokens: {row}");
    assert_eq!(cells[6], "yes");
    // Never the prompt (nor a key): the audit log does not have it, and the page shows none.
    let body = b.text("body").await;
    assert!(!body.contains("SECRET-PROMPT-MARKER"));
    b.screenshot(&shot("run-llm-calls.png")).await;

    // The run ends; its call stays listed.
    gw.set_paused(false);
    b.wait_for("the run to end", PAGE, "return document.getElementById('status').textContent;", |v| v == "ok").await;
    assert_eq!(b.js("return document.querySelectorAll('#llm-calls tbody tr').length;", json!([])).await, json!(1));
    assert_eq!(b.text("#llm-call-count").await, "1");

    b.quit().await;
    clawmux::server::shutdown(&running).await;
}

#[actix_rt::test]
async fn browser_asks_for_the_token_and_an_api_key_sees_only_its_accounts_runs() {
    let Some((_driver, b)) = browser().await else { return };
    let gw = replay(0.0, None);
    let admin = format!("admin-{}", uuid::Uuid::new_v4().simple());
    let running = start_clawmux(&gw.url(), None, |cfg| cfg.api_token = Some(clawmux::config::Secret::new(admin.clone()))).await;
    let base = base(&running);
    let c = reqwest::Client::new();
    wait_ready(&c, &base, Duration::from_secs(10)).await;
    for (run, account) in [("run-mine", "acct-mine"), ("run-theirs", "acct-theirs")] {
        let r = c
            .post(format!("{base}/v1/runs"))
            .bearer_auth(&admin)
            .json(&json!({"message": "hi", "billingAccountId": account, "runId": run}))
            .send()
            .await
            .expect("post");
        assert_eq!(r.status(), 200);
    }
    let key: Value = c
        .post(format!("{base}/v1/admin/keys"))
        .bearer_auth(&admin)
        .json(&json!({"name": "ui", "accounts": ["acct-mine"], "actions": ["read"]}))
        .send()
        .await
        .expect("key")
        .json()
        .await
        .expect("json");
    let key = key["key"].as_str().expect("key").to_owned();

    // With an admin token configured, the page gets 401 and asks.
    b.goto(&format!("{base}/ui/")).await;
    b.wait_for("the token form", PAGE, "return !document.getElementById('token-form').hidden;", |v| v == &json!(true)).await;
    assert!(table_ids(&b).await.is_empty());
    b.screenshot(&shot("token-asked.png")).await;
    b.type_into("#token", &key).await;
    b.click("#token-form button[type=submit]").await;
    assert_eq!(loaded_table(&b).await, ["run-mine"], "the key sees its account's runs only");
    // The token is in the tab's sessionStorage, never in the URL.
    assert!(!b.current_url().await.contains(&key));
    // Another account's run is a 404 for this key, on its page too.
    b.goto(&format!("{base}/ui/run?id=run-theirs")).await;
    b.wait_for("the error", PAGE, "return document.getElementById('error').textContent;", |v| v.as_str().is_some_and(|s| s.contains("no run"))).await;
    assert_eq!(b.text("#output").await, "");

    b.quit().await;
    clawmux::server::shutdown(&running).await;
}

#[actix_rt::test]
async fn browser_shows_markup_in_runs_as_text_and_runs_none_of_it() {
    let Some((_driver, b)) = browser().await else { return };
    let gw = replay(0.0, None);
    let running = start_clawmux(&gw.url(), None, |_| {}).await;
    let base = base(&running);
    let c = reqwest::Client::new();
    wait_ready(&c, &base, Duration::from_secs(10)).await;
    // The replay gateway echoes a message's first line into the run's output; a model whose
    // provider it does not know comes back in the run's error message (2026.9.6 takes any bare
    // model id, so the payload is the provider).
    let script = r#"<script>window.__xss="script";document.title="owned"</script>"#;
    let img = r#"<img src=x onerror="window.__xss='img';document.title='owned'">"#;
    let doc = run_to_end(&c, &base, json!({"message": format!("{script}{img}</pre><b>bold</b>"), "billingAccountId": "acct-x", "runId": "run-xss"})).await;
    assert!(doc["content"].as_str().is_some_and(|t| t.contains(img)), "the payload is in the output: {doc}");
    let doc = run_to_end(&c, &base, json!({"message": "hi", "billingAccountId": "acct-x", "runId": "run-xss-model", "model": format!("{img}/m")})).await;
    assert!(doc["error"]["message"].as_str().is_some_and(|m| m.contains(img)), "the payload is in the error: {doc}");

    let untouched = "return [window.__xss === undefined, document.title.startsWith('clawmux')];";
    b.goto(&format!("{base}/ui/")).await;
    loaded_table(&b).await;
    assert!(b.text("#runs").await.contains(img), "the model is shown as text");
    assert_eq!(b.js("return document.querySelectorAll('#runs img, #runs script, #runs b').length;", json!([])).await, json!(0));
    assert_eq!(b.js(untouched, json!([])).await, json!([true, true]));

    b.goto(&format!("{base}/ui/run?id=run-xss")).await;
    b.wait_for("the output", PAGE, "return document.getElementById('stream-state').dataset.state;", |v| v == "ended").await;
    let out = b.text("#output").await;
    assert!(out.contains(script) && out.contains(img) && out.contains("</pre><b>bold</b>"), "shown as text: {out}");
    assert_eq!(b.js("return document.querySelectorAll('#output *').length;", json!([])).await, json!(0), "no element made from the output");
    assert_eq!(b.js(untouched, json!([])).await, json!([true, true]));
    b.screenshot(&shot("run-xss.png")).await;

    b.goto(&format!("{base}/ui/run?id=run-xss-model")).await;
    b.wait_for("the error", PAGE, "return document.getElementById('error-message').textContent;", |v| v.as_str().is_some_and(|s| s.contains(img))).await;
    assert_eq!(b.js("return document.querySelectorAll('#run-error img, #model img').length;", json!([])).await, json!(0));
    assert_eq!(b.text("#model").await, format!("{img}/m"));
    assert_eq!(b.js(untouched, json!([])).await, json!([true, true]));

    b.quit().await;
    clawmux::server::shutdown(&running).await;
}

/// `clawmux demo` as a child process; SIGTERM (then SIGKILL) on drop.
struct Demo(std::process::Child);

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill").args(["-TERM", &self.0.id().to_string()]).status();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::time::Instant::now() < deadline {
            if matches!(self.0.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[actix_rt::test]
async fn browser_demo_prints_the_runs_page_and_it_shows_the_demos_run() {
    use std::io::BufRead;
    let Some((_driver, b)) = browser().await else { return };
    let home = temp_dir("demo-home");
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_clawmux"))
        // Half speed: its example run takes ~7 s, so the page sees it running first.
        .args(["demo", "--speed", "0.5"])
        .env("CLAWMUX_LISTEN", format!("127.0.0.1:{port}"))
        .env("HOME", &home)
        .env("CLAWMUX_DEVICE_IDENTITY", "off")
        .env_remove("CLAWMUX_API_TOKEN")
        .env_remove("CLAWMUX_STORE_URL")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("clawmux demo starts");
    let stdout = child.stdout.take().expect("stdout");
    let demo = Demo(child);
    // The URL the demo prints (read on a thread: the pipe blocks).
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("Runs page: ") {
                let _ = tx.send(rest.split_whitespace().next().unwrap_or_default().to_owned());
            }
        }
    });
    let url = rx.recv_timeout(Duration::from_secs(60)).expect("the demo prints the runs page's URL");
    assert_eq!(url, format!("http://127.0.0.1:{port}/ui/"));

    // A new user opens it: the demo's run is there (no token needed on loopback), running, and
    // the table follows it to its end without a reload.
    b.goto(&url).await;
    let rows_probe = "return [...document.querySelectorAll('#runs tbody tr')].map(r => [r.dataset.status, r.cells[2].textContent]);";
    let rows = b.wait_for("the demo's example run", PAGE, rows_probe, |v| v.as_array().is_some_and(|r| r.len() == 1)).await;
    assert_eq!(rows[0][1], "demo-account");
    assert_eq!(rows[0][0], "running", "{rows}");
    b.wait_for("the run to finish on the page", Duration::from_secs(60), rows_probe, |v| v[0][0] == "ok").await;
    b.screenshot(&shot("demo-runs.png")).await;
    b.quit().await;
    drop(demo);
}

/// A workspace whose relay always "opened" pull request 7 (`javascript:` for keys starting
/// `evil`): the branch runs of the relay test below, without Docker or GitHub.
struct PrWorkspace;

impl clawmux_actors::branch::Workspace for PrWorkspace {
    fn prepare(
        &self,
        plan: &clawmux_actors::branch::BranchPlan,
    ) -> futures_util::future::BoxFuture<'static, Result<clawmux_actors::branch::Prepared, clawmux_actors::branch::WorkspaceError>> {
        let prepared = clawmux_actors::branch::Prepared { path: format!("/workspace/wt/{}", plan.key), branch: plan.branch() };
        Box::pin(async move { Ok(prepared) })
    }

    fn publish(&self, plan: &clawmux_actors::branch::BranchPlan) -> futures_util::future::BoxFuture<'static, clawmux_actors::branch::Published> {
        let pr = if plan.key.starts_with("evil") { "javascript:window.__xss='pr'" } else { "https://git.example.test/acme/widgets/pull/7" };
        let relay = json!({"branch": plan.branch(), "commitCount": 2, "pushed": true, "pushedCommits": 2, "prUrl": pr, "prNumber": 7});
        Box::pin(async move { clawmux_actors::branch::Published { relay } })
    }
}

#[actix_rt::test]
async fn browser_a_branch_runs_relay_result_links_its_pull_request_and_only_an_http_one() {
    let Some((_driver, b)) = browser().await else { return };
    let gw = replay(0.0, None);
    let options = clawmux::server::StartOptions { workspace: Some(std::sync::Arc::new(PrWorkspace)), ..Default::default() };
    let running = start_clawmux_opts(&gw.url(), None, |_| {}, |_| {}, options).await;
    let base = base(&running);
    let c = reqwest::Client::new();
    wait_ready(&c, &base, Duration::from_secs(10)).await;
    for (run, key) in [("run-pr", "task.7"), ("run-evil", "evil.1")] {
        let doc = run_to_end(&c, &base, json!({"message": "fix it", "billingAccountId": "acct-git", "runId": run, "branch": {"branchName": key}})).await;
        assert_eq!(doc["status"], "ok", "{doc}");
        assert!(doc["relay"]["prUrl"].is_string(), "{doc}");
    }

    b.goto(&format!("{base}/ui/")).await;
    loaded_table(&b).await;
    let links = "return [...document.querySelectorAll('#runs tbody tr')].map(r => [r.dataset.runId, r.querySelector('td.branch').textContent, [...r.querySelectorAll('td.branch a')].map(a => a.href)]);";
    let rows = b.js(links, json!([])).await;
    assert_eq!(rows[1], json!(["run-pr", "sandbox/task.7 PR #7", ["https://git.example.test/acme/widgets/pull/7"]]), "{rows}");
    assert_eq!(rows[0][2], json!([]), "a javascript: URL is no link: {rows}");
    assert!(rows[0][1].as_str().is_some_and(|t| t.starts_with("sandbox/evil.1")), "{rows}");

    b.goto(&format!("{base}/ui/run?id=run-pr")).await;
    b.wait_for("the relay result", PAGE, "return document.getElementById('relay').hidden;", |v| v == &json!(false)).await;
    assert_eq!(b.text("#relay-branch").await, "sandbox/task.7");
    assert_eq!(b.text("#relay-pushed").await, "yes (2 commits)");
    assert_eq!(
        b.js("return document.querySelector('#relay-pr a').href;", json!([])).await,
        "https://git.example.test/acme/widgets/pull/7"
    );
    b.screenshot(&shot("run-relay.png")).await;
    b.goto(&format!("{base}/ui/run?id=run-evil")).await;
    b.wait_for("the relay result", PAGE, "return document.getElementById('relay').hidden;", |v| v == &json!(false)).await;
    assert_eq!(b.js("return document.querySelectorAll('#relay-pr a').length;", json!([])).await, json!(0));
    assert_eq!(b.js("return window.__xss === undefined;", json!([])).await, json!(true));

    b.quit().await;
    clawmux::server::shutdown(&running).await;
}
