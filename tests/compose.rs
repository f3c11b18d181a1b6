//! The compose stack (images/compose.yaml): clawmux, the REAL OpenClaw gateway and a REAL LiteLLM in
//! containers built offline (images/build.sh on the tests' debootstrap base), the project's fake
//! LLM on the host as LiteLLM's upstream.
//!
//! `tests/run.sh` starts the stack with `tests/support/compose-stack.sh start DIR` and runs this
//! binary with `CLAWMUX_COMPOSE_ENV=DIR/env` (`--test-threads=1`); without that variable the
//! `docker_compose_` tests say so and pass, unless `CLAWMUX_REQUIRE_COMPOSE=1`. The
//! `gateway_config_check_` tests need nothing (phase 1): they show that the invariant check
//! (tests/compose_support/invariants.rs) accepts the committed gateway config and refuses each
//! broken invariant.

mod common;
#[path = "compose_support/invariants.rs"]
mod invariants;

use common::{post_sse, SseReader};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The running stack, from `DIR/env` (tests/support/compose-stack.sh).
struct Stack(BTreeMap<String, String>);

impl Stack {
    fn get(&self, k: &str) -> &str {
        self.0.get(k).map(String::as_str).unwrap_or_else(|| panic!("{k} missing from CLAWMUX_COMPOSE_ENV"))
    }
    /// The three secrets of the env file, by name.
    fn secrets(&self) -> [(&'static str, &str); 3] {
        [("CLAWMUX_API_TOKEN", self.get("API_TOKEN")), ("CLAWMUX_GATEWAY_TOKEN", self.get("GATEWAY_TOKEN")), ("LITELLM_MASTER_KEY", self.get("LLM_KEY"))]
    }
}

fn stack(test: &str) -> Option<Stack> {
    let Some(path) = std::env::var_os("CLAWMUX_COMPOSE_ENV") else {
        assert!(
            std::env::var("CLAWMUX_REQUIRE_COMPOSE").as_deref() != Ok("1"),
            "{test}: CLAWMUX_REQUIRE_COMPOSE=1 but CLAWMUX_COMPOSE_ENV is not set (tests/support/compose-stack.sh start DIR)"
        );
        eprintln!("{test}: skipped: CLAWMUX_COMPOSE_ENV is not set (tests/support/compose-stack.sh start DIR; CLAWMUX_COMPOSE_ENV=DIR/env)");
        return None;
    };
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read CLAWMUX_COMPOSE_ENV={}: {e}", path.to_string_lossy()));
    Some(Stack(text.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect()))
}

/// Runs `cmd` to its end, bounded by `within`, with `stdin` (if any) written to it.
fn run(cmd: &mut Command, stdin: Option<&[u8]>, within: Duration) -> Output {
    cmd.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() }).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    if let (Some(data), Some(mut w)) = (stdin, child.stdin.take()) {
        w.write_all(data).expect("stdin");
    }
    let reader = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            buf
        })
    };
    let out = reader(Box::new(child.stdout.take().expect("stdout")));
    let err = reader(Box::new(child.stderr.take().expect("stderr")));
    let deadline = Instant::now() + within;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} did not finish within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output { status, stdout: out.join().expect("stdout reader"), stderr: err.join().expect("stderr reader") }
}

fn docker(args: &[&str]) -> Output {
    run(Command::new("docker").args(args), None, Duration::from_secs(180))
}

/// `docker ARGS`, which must succeed; its stdout.
fn docker_ok(args: &[&str]) -> String {
    let o = docker(args);
    assert!(o.status.success(), "docker {args:?} failed: {}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn inspect(what: &str) -> Value {
    let v: Value = serde_json::from_str(&docker_ok(&["inspect", what])).expect("docker inspect JSON");
    v[0].clone()
}

/// `KEY=VALUE` environment entries of an image or container config.
fn env_of(config: &Value) -> BTreeMap<String, String> {
    config["Env"].as_array().into_iter().flatten().filter_map(Value::as_str).filter_map(|e| e.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect()
}

/// The gateway config as the image ships it: read INSIDE the image (a container of its own, no
/// network), at the path the image tells the gateway to read; with the image's environment.
fn config_in_image(image: &str) -> (Value, BTreeMap<String, String>) {
    let env = env_of(&inspect(image)["Config"]);
    let path = env.get("OPENCLAW_CONFIG_PATH").cloned().unwrap_or_else(|| panic!("{image} sets no OPENCLAW_CONFIG_PATH"));
    let text = docker_ok(&["run", "--rm", "--network", "none", "--entrypoint", "cat", image, &path]);
    (serde_json::from_str(&text).unwrap_or_else(|e| panic!("{image}:{path} is not JSON: {e}")), env)
}

fn read_jsonl(path: &str) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

// ------------------------------------------------------------------------------------------------
// The invariant check itself (no Docker)
// ------------------------------------------------------------------------------------------------

fn committed_config() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/images/openclaw/openclaw.image.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("images/openclaw/openclaw.image.json")).expect("JSON")
}

/// The environment images/openclaw/Dockerfile gives the gateway (the part the check reads).
fn image_env() -> BTreeMap<String, String> {
    let dockerfile = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/images/openclaw/Dockerfile")).expect("Dockerfile");
    let mut env = BTreeMap::new();
    for k in ["OPENCLAW_CONFIG_READONLY", "CLAWMUX_PROXY_URL"] {
        let v = dockerfile.split_whitespace().find_map(|w| w.strip_prefix(&format!("{k}="))).unwrap_or_else(|| panic!("the Dockerfile sets no {k}"));
        env.insert(k.to_owned(), v.to_owned());
    }
    env
}

#[test]
fn gateway_config_check_accepts_the_committed_config() {
    let v = invariants::violations(&committed_config(), &image_env());
    assert!(v.is_empty(), "images/openclaw/openclaw.image.json breaks invariants:\n{}", v.join("\n"));
}

#[test]
fn gateway_config_check_refuses_each_broken_invariant() {
    type Break = fn(&mut Value, &mut BTreeMap<String, String>);
    let cases: Vec<(&str, &str, Break)> = vec![
        ("sandbox on", "invariant 13", |c, _| c["agents"]["defaults"]["sandbox"]["mode"] = json!("all")),
        ("sandbox unset", "invariant 13", |c, _| {
            c["agents"]["defaults"].as_object_mut().expect("defaults").remove("sandbox");
        }),
        ("an agent with its own sandbox", "invariant 13", |c, _| c["agents"]["list"] = json!([{"id": "x", "sandbox": {"mode": "non-main"}}])),
        ("cron on", "invariant 14", |c, _| c["cron"]["enabled"] = json!(true)),
        ("cron unset (defaults to on)", "invariant 14", |c, _| {
            c.as_object_mut().expect("config").remove("cron");
        }),
        ("elevated on", "invariant 15", |c, _| c["tools"]["elevated"]["enabled"] = json!(true)),
        ("an agent with elevated tools", "invariant 15", |c, _| c["agents"]["list"] = json!([{"id": "x", "tools": {"elevated": {"enabled": true}}}])),
        ("merge mode", "invariant 16", |c, _| c["models"]["mode"] = json!("merge")),
        ("a second provider", "invariant 16", |c, _| c["models"]["providers"]["openai"] = json!({"baseUrl": "http://127.0.0.1:8788/v1"})),
        ("provider past the proxy", "invariant 16", |c, _| c["models"]["providers"]["cogni"]["baseUrl"] = json!("https://llm.example.invalid/v1")),
        ("proxy URL from the environment points elsewhere", "invariant 16", |_, e| {
            e.insert("CLAWMUX_PROXY_URL".into(), "http://litellm:4000/v1".into());
        }),
        ("proxy URL variable unset", "invariant 16", |_, e| {
            e.remove("CLAWMUX_PROXY_URL");
        }),
        ("a model of another provider", "invariant 16", |c, _| c["agents"]["defaults"]["model"]["primary"] = json!("openai/gpt-4o")),
        ("Control UI on", "invariant 17", |c, _| c["gateway"]["controlUi"]["enabled"] = json!(true)),
        ("gateway on the LAN", "invariant 17", |c, _| c["gateway"]["bind"] = json!("lan")),
        ("heartbeats every 30m", "invariant 25", |c, _| c["agents"]["defaults"]["heartbeat"]["every"] = json!("30m")),
        ("heartbeats unset (default on)", "invariant 25", |c, _| {
            c["agents"]["defaults"].as_object_mut().expect("defaults").remove("heartbeat");
        }),
        ("an agent with heartbeats", "invariant 25", |c, _| c["agents"]["list"] = json!([{"id": "x", "heartbeat": {"every": "1h"}}])),
        ("writable config", "read-only config", |_, e| {
            e.remove("OPENCLAW_CONFIG_READONLY");
        }),
        ("an included file", "one config file", |c, _| c["tools"]["$include"] = json!("./more.json")),
        ("a plaintext token", "no secret", |c, _| c["gateway"]["auth"]["token"] = json!("s3cret")),
    ];
    for (what, expect, break_it) in cases {
        let (mut c, mut e) = (committed_config(), image_env());
        break_it(&mut c, &mut e);
        let v = invariants::violations(&c, &e);
        assert!(v.iter().any(|l| l.contains(expect)), "{what}: expected a violation of {expect}, got {v:?}");
    }
}

#[test]
fn gateway_config_check_substitutes_like_openclaw() {
    let env: BTreeMap<String, String> = [("A".to_owned(), "x".to_owned())].into();
    assert_eq!(invariants::substitute("http://${A}:1/${B}/${a}", &env), "http://x:1/${B}/${a}");
    assert_eq!(invariants::substitute("${A", &env), "${A");
}

// ------------------------------------------------------------------------------------------------
// The images
// ------------------------------------------------------------------------------------------------

/// The gateway config inside the built image, and inside the running gateway container (with the
/// stack's environment), keeps every invariant; the image runs as a non-root user whose config
/// file it cannot write, with its state in a volume and git installed.
#[test]
fn docker_compose_gateway_image_keeps_the_invariants() {
    let test = "docker_compose_gateway_image_keeps_the_invariants";
    let Some(s) = stack(test) else { return };
    let image = s.get("OPENCLAW_IMAGE");
    let (config, env) = config_in_image(image);
    let v = invariants::violations(&config, &env);
    assert!(v.is_empty(), "{image} breaks invariants:\n{}", v.join("\n"));

    // the running gateway: the file it reads and the environment it runs with
    let ctr = s.get("GATEWAY_CONTAINER");
    let ctr_env = env_of(&inspect(ctr)["Config"]);
    let path = ctr_env.get("OPENCLAW_CONFIG_PATH").expect("config path");
    let live: Value = serde_json::from_str(&docker_ok(&["exec", ctr, "cat", path])).expect("JSON");
    let v = invariants::violations(&live, &ctr_env);
    assert!(v.is_empty(), "the running gateway breaks invariants:\n{}", v.join("\n"));

    let cfg = &inspect(image)["Config"];
    assert_eq!(cfg["User"], "1000:1000", "non-root");
    assert!(cfg["Volumes"].get("/var/lib/openclaw").is_some(), "state in a volume: {}", cfg["Volumes"]);
    assert_eq!(cfg["Labels"]["org.opencontainers.image.version"], "2026.9.6", "the pinned openclaw");
    let o = docker(&["run", "--rm", "--network", "none", "--entrypoint", "sh", image, "-c", &format!("test -w {path}")]);
    assert!(!o.status.success(), "the gateway's user can write {path}");
    let git = docker_ok(&["run", "--rm", "--network", "none", "--entrypoint", "git", image, "--version"]);
    assert!(git.starts_with("git version"), "{git}");
    eprintln!("{test}: {} and the running gateway keep invariants 13-17 and 25; user 1000, read-only config, {}", image, git.trim());
}

/// The same check on an image whose config breaks invariants (built FROM the gateway image with
/// a planted config): the check reads it inside the image and names each broken invariant.
#[test]
fn docker_compose_a_broken_config_inside_an_image_is_caught() {
    let test = "docker_compose_a_broken_config_inside_an_image_is_caught";
    let Some(s) = stack(test) else { return };
    let dir = common::temp_dir("broken-gateway-image");
    let mut broken = committed_config();
    broken["cron"]["enabled"] = json!(true);
    broken["agents"]["defaults"]["heartbeat"]["every"] = json!("30m");
    std::fs::write(dir.join("openclaw.json"), broken.to_string()).expect("config");
    std::fs::write(dir.join("Dockerfile"), format!("FROM {}\nCOPY openclaw.json /etc/openclaw/openclaw.json\n", s.get("OPENCLAW_IMAGE"))).expect("Dockerfile");
    let tag = format!("clawmux-test/openclaw-broken:{}", s.get("PROJECT"));
    let dir_s = dir.to_string_lossy().into_owned();
    let o = run(Command::new("docker").env("DOCKER_BUILDKIT", "0").args(["build", "-q", "--network", "none", "-t", &tag, &dir_s]), None, Duration::from_secs(180));
    assert!(o.status.success(), "build: {}", String::from_utf8_lossy(&o.stderr));
    let (config, env) = config_in_image(&tag);
    let _ = docker(&["rmi", &tag]);
    let _ = std::fs::remove_dir_all(&dir);
    let v = invariants::violations(&config, &env);
    assert!(v.iter().any(|l| l.contains("invariant 14")) && v.iter().any(|l| l.contains("invariant 25")), "{v:?}");
    eprintln!("{test}: {v:?}");
}

/// The clawmux image: FROM scratch with clawmux, git and dash only (no coreutils, bash, curl,
/// package manager), user 10001, `clawmux serve` by default, the healthcheck is `clawmux
/// healthcheck`; git and the relay's credential helper (run by /bin/sh) work in it.
#[test]
fn docker_compose_clawmux_image_is_small_and_runs_as_non_root() {
    let test = "docker_compose_clawmux_image_is_small_and_runs_as_non_root";
    let Some(s) = stack(test) else { return };
    let image = s.get("CLAWMUX_IMAGE");
    let info = inspect(image);
    let cfg = &info["Config"];
    assert_eq!(cfg["User"], "10001:10001");
    assert_eq!(cfg["Entrypoint"], json!(["clawmux"]));
    assert_eq!(cfg["Cmd"], json!(["serve"]));
    assert_eq!(cfg["Healthcheck"]["Test"], json!(["CMD", "clawmux", "healthcheck"]));
    assert!(cfg["Volumes"].get("/var/lib/clawmux").is_some(), "{}", cfg["Volumes"]);
    let size = info["Size"].as_u64().expect("size");
    assert!(size < 80_000_000, "{image} is {size} bytes");

    // every executable file of the image's layers (`docker save`: the image, not a container)
    let dir = common::temp_dir("clawmux-image");
    let dir_s = dir.to_string_lossy().into_owned();
    let saved = run(Command::new("sh").args(["-c", &format!("docker save '{image}' | tar -xf - -C '{dir_s}'")]), None, Duration::from_secs(120));
    assert!(saved.status.success(), "{}", String::from_utf8_lossy(&saved.stderr));
    let manifest: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).expect("manifest")).expect("JSON");
    let mut listing = String::new();
    for layer in manifest[0]["Layers"].as_array().expect("layers").iter().filter_map(Value::as_str) {
        let o = run(Command::new("tar").arg("-tvf").arg(dir.join(layer)), None, Duration::from_secs(60));
        listing.push_str(&String::from_utf8_lossy(&o.stdout));
    }
    let _ = std::fs::remove_dir_all(&dir);
    let executables: Vec<&str> = listing.lines().filter(|l| l.starts_with("-rwx") || l.starts_with("-r-x") || l.starts_with("hrwx")).filter_map(|l| l.split_whitespace().nth(5)).collect();
    assert!(executables.contains(&"usr/local/bin/clawmux"), "{listing}");
    for exe in &executables {
        let ok = *exe == "usr/local/bin/clawmux" || *exe == "usr/bin/dash" || exe.starts_with("usr/lib/git-core/") || exe.starts_with("usr/lib/x86_64-linux-gnu/") || exe.starts_with("usr/lib/aarch64-linux-gnu/") || exe.starts_with("usr/lib64/");
        assert!(ok, "{image} ships the executable {exe}");
    }
    for absent in ["usr/bin/bash", "usr/bin/ls", "usr/bin/cat", "usr/bin/curl", "usr/bin/apt", "usr/bin/dpkg", "usr/bin/perl", "usr/bin/python3"] {
        assert!(!listing.lines().any(|l| l.split_whitespace().nth(5) == Some(absent)), "{image} has {absent}");
    }
    let git = docker_ok(&["run", "--rm", "--network", "none", "--entrypoint", "git", image, "--version"]);
    assert!(git.starts_with("git version"), "{git}");
    let helper = "credential.helper=!f() { test \"$1\" = get || exit 0; printf 'username=u\\npassword=from-helper\\n'; }; f";
    let o = run(Command::new("docker").args(["run", "--rm", "-i", "--network", "none", "--entrypoint", "git", image, "-c", helper, "credential", "fill"]), Some(b"protocol=https\nhost=example.invalid\n\n"), Duration::from_secs(60));
    assert!(String::from_utf8_lossy(&o.stdout).contains("password=from-helper"), "the credential helper ran: {}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));

    // the running service: uid 10001
    let pid = inspect(s.get("CLAWMUX_CONTAINER"))["State"]["Pid"].as_u64().expect("pid");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let uid = status.lines().find_map(|l| l.strip_prefix("Uid:")).expect("Uid").split_whitespace().next().expect("uid").to_owned();
    assert_eq!(uid, "10001", "clawmux runs as uid {uid}");
    eprintln!("{test}: {image}: {:.0} MB, {} executables, runs as uid {uid}", size as f64 / 1e6, executables.len());
}

// ------------------------------------------------------------------------------------------------
// The stack
// ------------------------------------------------------------------------------------------------

/// Docker's healthchecks: clawmux (`clawmux healthcheck`), the gateway (/readyz) and LiteLLM are
/// healthy; `clawmux healthcheck` fails against an address where nothing answers.
#[test]
fn docker_compose_healthchecks_report_healthy() {
    let test = "docker_compose_healthchecks_report_healthy";
    let Some(s) = stack(test) else { return };
    for key in ["CLAWMUX_CONTAINER", "GATEWAY_CONTAINER", "LITELLM_CONTAINER"] {
        let h = &inspect(s.get(key))["State"]["Health"];
        assert_eq!(h["Status"], "healthy", "{key}: {h}");
        let last = h["Log"].as_array().and_then(|l| l.last()).expect("a probe ran");
        assert_eq!(last["ExitCode"], 0, "{key}: {last}");
    }
    let ctr = s.get("CLAWMUX_CONTAINER");
    assert!(docker(&["exec", ctr, "clawmux", "healthcheck"]).status.success());
    let o = docker(&["exec", ctr, "clawmux", "healthcheck", "--url", "http://127.0.0.1:1/healthz"]);
    assert_eq!(o.status.code(), Some(1), "nothing listens on port 1: {}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("unhealthy"), "{}", String::from_utf8_lossy(&o.stderr));
}

/// `clawmux doctor` in the clawmux container: store, LLM upstream (LiteLLM, with the key) and
/// gateway all green, exit 0, no secret printed; with a wrong upstream key it says so and fails.
#[test]
fn docker_compose_doctor_is_green_in_the_clawmux_container() {
    let test = "docker_compose_doctor_is_green_in_the_clawmux_container";
    let Some(s) = stack(test) else { return };
    let ctr = s.get("CLAWMUX_CONTAINER");
    let o = docker(&["exec", ctr, "clawmux", "doctor"]);
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "doctor failed:\n{text}");
    for line in ["store (sqlite:///var/lib/clawmux/runs.db): OK", "): OK, key accepted, 1 model(s): default", "): CONNECTED", "traceparent trace id (LLM proxy on)", "): accepted", "ready: yes"] {
        assert!(text.contains(line), "doctor does not say {line:?}:\n{text}");
    }
    for (name, value) in s.secrets() {
        assert!(!text.contains(value), "doctor printed {name}");
    }
    // LiteLLM refuses a key it does not know: 401, or, without a database for virtual keys (as
    // here), 400 "No connected db."
    let o = docker(&["exec", "-e", "CLAWMUX_LLM_UPSTREAM_KEY=sk-not-the-key", ctr, "clawmux", "doctor"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "a refused key is not green:\n{text}");
    let line = text.lines().find(|l| l.starts_with("llm upstream (")).unwrap_or_default();
    assert!(line.contains("KEY REFUSED (HTTP 401)") || line.contains("FAILED: HTTP 400"), "{text}");
    eprintln!("{test}: doctor green; with a wrong upstream key: {line:?}, exit 1");
}

/// Runs posted to clawmux go through the gateway container to LiteLLM and the fake LLM: each
/// gets its own text (after a tool call the agent ran with `exec` inside the gateway container),
/// and LiteLLM, the billing truth, recorded every LLM call of each run with the run's billing
/// headers as it received them (end user = billing account, spend-log metadata = the run). The
/// fake LLM behind LiteLLM got LiteLLM's own provider key, never clawmux's.
#[tokio::test]
async fn docker_compose_runs_go_through_the_stack_and_are_billed_in_litellm() {
    let test = "docker_compose_runs_go_through_the_stack_and_are_billed_in_litellm";
    let Some(s) = stack(test) else { return };
    let base = s.get("CLAWMUX_URL").to_owned();
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(reqwest::header::AUTHORIZATION, format!("Bearer {}", s.get("API_TOKEN")).parse().expect("header"));
    let c = reqwest::Client::builder().default_headers(headers).build().expect("client");

    let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let mut runs = Vec::new();
    for i in 0..6 {
        let account = format!("acct-compose-{}", i % 3);
        let marker = format!("CMP{tag}R{i}X");
        let body = json!({"message": format!("TOOL:{marker} compose check {marker}"), "billingAccountId": account});
        let (c, base) = (c.clone(), base.clone());
        runs.push(tokio::spawn(async move {
            let resp = post_sse(&c, &base, &body, &[]).await;
            assert_eq!(resp.status(), 200, "{marker}");
            let mut sse = SseReader::new(resp);
            let t = sse.terminal(Duration::from_secs(180)).await.expect("terminal event");
            (marker, account, t, sse.text())
        }));
    }
    let mut done = Vec::new();
    for r in runs {
        done.push(r.await.expect("run task"));
    }
    let markers: Vec<String> = done.iter().map(|d| d.0.clone()).collect();
    let mut calls = 0;
    for (marker, account, t, text) in &done {
        assert_eq!(t.event, "final", "{marker}: {t:?}");
        let content = t.data["content"].as_str().unwrap_or_default();
        let run_id = t.data["runId"].as_str().expect("runId").to_owned();
        assert!(content.starts_with(&format!("Reply to: TOOL:{marker} compose check {marker} | model=fake-model | after-tool: tool-ran-{marker}")), "{marker}: {content}");
        assert!(content.starts_with(text.as_str()) && !text.is_empty(), "{marker}: streamed {text:?} vs {content:?}");
        for other in markers.iter().filter(|m| *m != marker) {
            assert!(!content.contains(other.as_str()), "{marker} got {other}'s text");
        }
        assert_eq!(t.data["usage"]["source"], "proxy", "{}", t.data);
        let n = t.data["usage"]["llmCalls"].as_u64().expect("llmCalls");
        assert!(n >= 2, "{marker}: a tool call and its follow-up: {}", t.data);

        // LiteLLM's own spend records of this run (its callback writes them after answering)
        let deadline = Instant::now() + Duration::from_secs(30);
        let recs = loop {
            let recs: Vec<Value> = read_jsonl(s.get("SPEND_LOG")).into_iter().filter(|r| r["standard"]["metadata"]["spend_logs_metadata"]["run_id"] == run_id.as_str()).collect();
            if recs.len() as u64 >= n || Instant::now() >= deadline {
                break recs;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(recs.len() as u64, n, "{marker}: LiteLLM recorded {} of the run's {n} calls", recs.len());
        for r in &recs {
            let st = &r["standard"];
            assert_eq!(r["event"], "success", "{r}");
            assert_eq!(st["end_user"], account.as_str(), "{marker}: billed to {}", st["end_user"]);
            let h = &st["metadata"]["requester_custom_headers"];
            assert_eq!(h["x-cogni-run-id"], run_id.as_str(), "{h}");
            assert_eq!(h["x-litellm-end-user-id"], account.as_str(), "{h}");
            let meta: Value = serde_json::from_str(h["x-litellm-spend-logs-metadata"].as_str().expect("metadata header")).expect("JSON");
            assert_eq!(meta["run_id"], run_id.as_str());
            assert_eq!(st["model_group"], "default", "{st}");
        }
        calls += recs.len();

        // the fake LLM behind LiteLLM: this run's calls, with LiteLLM's provider key
        let upstream: Vec<Value> = read_jsonl(s.get("LLM_LOG")).into_iter().filter(|e| e["last_user"].as_str().is_some_and(|u| u.contains(marker.as_str()))).collect();
        assert!(upstream.len() >= 2, "{marker}: the fake LLM saw {} calls", upstream.len());
        for e in &upstream {
            assert_eq!(e["headers"]["authorization"], "Bearer sk-fake-llm-any", "{e}");
        }
    }
    let log = std::fs::read_to_string(s.get("LLM_LOG")).unwrap_or_default();
    for (name, value) in s.secrets() {
        assert!(!log.contains(value), "{name} reached the fake LLM");
    }
    eprintln!("{test}: 6 runs from 3 accounts, {calls} LLM calls, each in LiteLLM's spend records with its run and account");
}

/// No secret of the env file is in the gateway container: not in its configured environment,
/// entrypoint or command, not in any of its processes' environments or arguments, not in any file
/// it can see (volumes included) but the gateway token in its token file. And each container's
/// environment holds only the secrets it needs.
#[test]
fn docker_compose_no_secret_in_the_gateway_container() {
    let test = "docker_compose_no_secret_in_the_gateway_container";
    let Some(s) = stack(test) else { return };
    let ctr = s.get("GATEWAY_CONTAINER");
    let secrets = s.secrets();

    let info = inspect(ctr).to_string();
    for (name, value) in secrets {
        assert!(!info.contains(value), "{name} is in the gateway container's configuration (docker inspect)");
    }

    // every process of the container: arguments and environment, read from the host's /proc
    // (inside, even root may not read another process's environ: no CAP_SYS_PTRACE)
    let top = docker_ok(&["top", ctr, "-eo", "pid"]);
    let pids: Vec<u32> = top.lines().skip(1).filter_map(|l| l.trim().parse().ok()).collect();
    let mut procs = String::new();
    let mut environs = 0;
    for pid in &pids {
        let (Ok(cmdline), Ok(environ)) = (std::fs::read(format!("/proc/{pid}/cmdline")), std::fs::read(format!("/proc/{pid}/environ"))) else {
            continue; // it ended meanwhile
        };
        let (cmdline, environ) = (String::from_utf8_lossy(&cmdline).replace('\0', " "), String::from_utf8_lossy(&environ).replace('\0', "\n"));
        environs += usize::from(environ.contains("OPENCLAW_CONFIG_PATH="));
        procs.push_str(&format!("== {pid}: {cmdline}\n{environ}\n"));
    }
    assert!(procs.contains("openclaw.mjs gateway run"), "the scan saw the gateway process:\n{procs}");
    assert!(environs > 0, "the scan read the gateway's environment:\n{procs}");
    let n = pids.len();
    for (name, value) in secrets {
        assert!(!procs.contains(value), "{name} is in a gateway container process's arguments or environment");
    }

    // every file (patterns on stdin: in no argument)
    let grep = |patterns: &[&str]| {
        let input = patterns.iter().map(|p| format!("{p}\n")).collect::<String>();
        let o = run(
            Command::new("docker").args(["exec", "-i", "-u", "0", ctr, "grep", "-rlF", "-f", "-", "/", "--exclude-dir=proc", "--exclude-dir=sys", "--exclude-dir=dev"]),
            Some(input.as_bytes()),
            Duration::from_secs(300),
        );
        assert!(o.status.code() == Some(0) || o.status.code() == Some(1), "grep failed: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).lines().map(str::to_owned).collect::<Vec<_>>()
    };
    let found = grep(&[s.get("API_TOKEN"), s.get("LLM_KEY")]);
    assert!(found.is_empty(), "clawmux's API token or the LLM key is in the gateway container's files: {found:?}");
    let found = grep(&[s.get("GATEWAY_TOKEN")]);
    assert_eq!(found, ["/var/lib/openclaw/secrets/gateway-token"], "the gateway token is only in its token file");
    let mode = docker_ok(&["exec", ctr, "stat", "-c", "%a %u", "/var/lib/openclaw/secrets/gateway-token"]);
    assert_eq!(mode.trim(), "600 1000", "the token file is the gateway user's alone");

    // each container's environment: only the secrets it needs
    let expected: [(&str, &[&str]); 5] = [
        ("CLAWMUX_CONTAINER", &["CLAWMUX_API_TOKEN", "CLAWMUX_GATEWAY_TOKEN", "LITELLM_MASTER_KEY"]),
        ("LITELLM_CONTAINER", &["LITELLM_MASTER_KEY"]),
        ("TOKEN_CONTAINER", &["CLAWMUX_GATEWAY_TOKEN"]),
        ("GATEWAY_CONTAINER", &[]),
        ("NET_CONTAINER", &[]),
    ];
    for (key, wanted) in expected {
        let env = inspect(s.get(key))["Config"]["Env"].to_string();
        let has: Vec<&str> = secrets.iter().filter(|(_, v)| env.contains(v)).map(|(n, _)| *n).collect();
        assert_eq!(has, wanted, "{key}'s environment holds {has:?}");
    }
    eprintln!("{test}: {n} processes and every file of the gateway container scanned; the gateway token only in its 0600 token file");
}

/// `docker-compose config` of the committed file (no override) is valid with an env file like
/// images/.env.example filled in, shares one network namespace between clawmux and the gateway,
/// and refuses to run when any one of the three secrets is missing.
#[test]
fn docker_compose_committed_file_needs_the_env_file_secrets() {
    let test = "docker_compose_committed_file_needs_the_env_file_secrets";
    let Some(_s) = stack(test) else { return };
    let dir = common::temp_dir("compose-config");
    let images = concat!(env!("CARGO_MANIFEST_DIR"), "/images");
    let example = std::fs::read_to_string(Path::new(images).join(".env.example")).expect(".env.example");
    let fill = |except: &str| -> String {
        example.lines().map(|l| if l.ends_with('=') && !l.starts_with('#') && l != format!("{except}=") { format!("{l}x{}\n", l.len()) } else { format!("{l}\n") }).collect()
    };
    let config = |name: &str, text: String| {
        let env = dir.join(name);
        std::fs::write(&env, text).expect("env file");
        let env = env.to_string_lossy().into_owned();
        run(Command::new("docker-compose").args(["-p", "cmxconfig", "--env-file", &env, "-f", &format!("{images}/compose.yaml"), "config"]), None, Duration::from_secs(60))
    };
    let ok = config("filled.env", fill(""));
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let merged = String::from_utf8_lossy(&ok.stdout);
    let shared = merged.lines().filter(|l| l.trim() == "network_mode: service:net").count();
    assert_eq!(shared, 2, "clawmux and the gateway share the pod's namespace:\n{merged}");
    for secret in ["CLAWMUX_API_TOKEN", "CLAWMUX_GATEWAY_TOKEN", "LITELLM_MASTER_KEY"] {
        let refused = config(&format!("no-{secret}.env"), fill(secret));
        let err = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success() && err.contains(&format!("set {secret} in the env file")), "without {secret}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Restarting clawmux (a deploy) or the gateway: clawmux reconnects to the gateway, a run goes
/// through the proxy again, every service is healthy again (this test returns only then, so the
/// others see a whole stack). Here the pod's namespace is the host's, which outlives any
/// container; what the pod adds on a bridge (neither restart takes the other's network away)
/// cannot be shown on this machine.
#[tokio::test]
async fn docker_compose_restarting_clawmux_or_the_gateway_recovers() {
    let test = "docker_compose_restarting_clawmux_or_the_gateway_recovers";
    let Some(s) = stack(test) else { return };
    let base = s.get("CLAWMUX_URL").to_owned();
    let auth = format!("Bearer {}", s.get("API_TOKEN"));
    let c = reqwest::Client::new();
    for key in ["CLAWMUX_CONTAINER", "GATEWAY_CONTAINER"] {
        let t0 = Instant::now();
        docker_ok(&["restart", s.get(key)]);
        // ready (bounded): the gateway connection is back
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            let ok = c.get(format!("{base}/readyz")).header("authorization", &auth).send().await.is_ok_and(|r| r.status() == 200);
            if ok {
                break;
            }
            assert!(Instant::now() < deadline, "{key}: clawmux not ready 180 s after the restart");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let ready = t0.elapsed();
        let marker = format!("RST{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let r = c.post(format!("{base}/v1/runs")).header("authorization", &auth).json(&json!({"message": format!("after restart {marker}"), "billingAccountId": "acct-restart"})).send().await.expect("POST");
        let doc: Value = r.json().await.expect("run document");
        assert_eq!(doc["status"], "ok", "{key}: {doc}");
        assert!(doc["content"].as_str().is_some_and(|t| t.contains(&marker)), "{doc}");
        assert_eq!(doc["usage"]["source"], "proxy", "the LLM call went through the proxy: {doc}");
        // healthy again (Docker's probe runs every 10 s)
        let deadline = Instant::now() + Duration::from_secs(180);
        for k in ["CLAWMUX_CONTAINER", "GATEWAY_CONTAINER", "LITELLM_CONTAINER"] {
            while inspect(s.get(k))["State"]["Health"]["Status"] != "healthy" {
                assert!(Instant::now() < deadline, "{k} not healthy 180 s after restarting {key}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        eprintln!("{test}: {key} restarted; clawmux ready after {:.1} s, a run went through", ready.as_secs_f64());
    }
}
