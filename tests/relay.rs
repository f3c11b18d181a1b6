//! The git relay against a REAL Docker engine and real git (every test here is named `docker_…`).
//!
//! Each test starts its own plain container from the project's offline base image
//! (`tests/support/docker-image.sh`: Debian minbase + git) with `--network none` and
//! `sleep infinity`, clones a host bare repository's bundle into `/workspace/repo` inside it, and
//! drives [`GitRelay`] through the Docker API (bollard). Commits are made in the container's worktree
//! with `docker exec` (standing in for the agent); the host bare repository is the remote; a fake
//! GitHub REST server on 127.0.0.1 records the pull-request calls.
//!
//! Without a Docker engine or the image the tests print a skip line and pass, unless
//! `CLAWMUX_REQUIRE_DOCKER=1` (tests/run.sh sets it), where they fail.
//! Env: `CLAWMUX_BASE_IMAGE` (default `clawmux/base:bookworm-git`).
//!
//! `docker_gateway_agent_commit_is_relayed` is the end to end: the REAL OpenClaw gateway in a
//! container (`tests/support/gateway-container.sh start DIR`, then `CLAWMUX_RELAY_GATEWAY_ENV=DIR/env`),
//! clawmux drives agent runs whose (fake) LLM tells the real agent to commit with its `exec` tool,
//! and the relay pushes the commits. Without that env it skips, unless
//! `CLAWMUX_REQUIRE_GATEWAY_CONTAINER=1`.

#![allow(clippy::unwrap_used)]

mod common;

use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use clawmux::config::Secret;
use clawmux::relay::{BranchLocks, ContainerExec, DockerExec, GitRelay, Recording, RelayConfig, RelayError, RelayStage};
use serde_json::{json, Value};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

// ------------------------------------------------------------------------------------------------
// Harness: Docker, the container, the host remote, the fake GitHub API, log capture
// ------------------------------------------------------------------------------------------------

fn image() -> String {
    std::env::var("CLAWMUX_BASE_IMAGE").unwrap_or_else(|_| "clawmux/base:bookworm-git".to_owned())
}

/// `Ok(())` when the engine answers and the image exists; otherwise skip (or fail when required).
fn docker_or_skip(test: &str) -> bool {
    let required = std::env::var("CLAWMUX_REQUIRE_DOCKER").map(|v| v == "1").unwrap_or(false);
    let why = if !Command::new("docker").arg("info").output().map(|o| o.status.success()).unwrap_or(false) {
        Some("no Docker engine answers (run tests/support/docker.sh ensure)".to_owned())
    } else if !Command::new("docker").args(["image", "inspect", &image()]).output().map(|o| o.status.success()).unwrap_or(false) {
        Some(format!("image {} is missing (run tests/support/docker-image.sh)", image()))
    } else {
        None
    };
    match why {
        None => true,
        Some(w) if required => panic!("{test}: CLAWMUX_REQUIRE_DOCKER=1 but {w}"),
        Some(w) => {
            eprintln!("SKIP {test}: {w}");
            false
        }
    }
}

fn sh(cmd: &mut Command) -> String {
    let o = cmd.output().expect("spawn");
    assert!(o.status.success(), "{cmd:?} failed: {}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).trim_end().to_owned()
}

fn git(dir: &Path) -> Command {
    let mut c = Command::new("git");
    c.arg("-C").arg(dir).env("GIT_CONFIG_GLOBAL", "/dev/null").env("GIT_CONFIG_NOSYSTEM", "1").args(["-c", "user.name=Host Seed", "-c", "user.email=seed@example.invalid", "-c", "init.defaultBranch=main"]);
    c
}

/// A container removed (by id) on drop.
struct Container {
    id: String,
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new("docker").args(["rm", "-f", &self.id]).output();
    }
}

impl Container {
    fn start(name: &str) -> Self {
        let id = sh(Command::new("docker").args(["run", "-d", "--rm", "--network", "none", "--init", "--label", "clawmux-test=relay", "--name", name, &image(), "sleep", "infinity"]));
        Self { id }
    }
    /// `docker exec` of the test's own shell snippet (never request data).
    fn sh(&self, script: &str) -> String {
        sh(Command::new("docker").args(["exec", &self.id, "sh", "-ec", script]))
    }
    fn try_sh(&self, script: &str) -> std::process::Output {
        Command::new("docker").args(["exec", &self.id, "sh", "-ec", script]).output().expect("spawn")
    }
    /// The agent's part: a commit in the key's worktree.
    fn commit(&self, key: &str, mark: &str) {
        self.sh(&format!("cd /workspace/wt/{key} && printf '%s\\n' {mark} > agent-{mark}.txt && git add agent-{mark}.txt && git commit -q -m 'agent: {mark}'"));
    }
    fn count(&self, key: &str) -> usize {
        self.sh(&format!("git -C /workspace/wt/{key} rev-list --count main..HEAD")).parse().unwrap()
    }
    fn tree(&self, key: &str) -> String {
        self.sh(&format!("git -C /workspace/wt/{key} rev-parse HEAD^{{tree}}"))
    }
}

/// One test's world: a container with `/workspace/repo`, a host bare remote, a fake API.
struct World {
    ctr: Container,
    _tmp: tempfile::TempDir,
    origin: PathBuf,
    seed: PathBuf,
    api: FakeGithub,
    token: String,
}

static SEQ: AtomicU64 = AtomicU64::new(0);

impl World {
    async fn new(test: &str) -> Self {
        capture_logs();
        let tmp = tempfile::Builder::new().prefix("clawmux-relay-test-").tempdir().unwrap();
        let origin = tmp.path().join("origin.git");
        let seed = tmp.path().join("seed");
        sh(git(tmp.path()).args(["init", "-q", "--bare"]).arg(&origin));
        sh(git(tmp.path()).args(["init", "-q"]).arg(&seed));
        std::fs::write(seed.join("README.md"), "# widgets\n").unwrap();
        sh(git(&seed).args(["add", "README.md"]));
        sh(git(&seed).args(["commit", "-q", "-m", "initial commit"]));
        sh(git(&seed).arg("push").arg("-q").arg(&origin).arg("main"));
        let bundle = tmp.path().join("main.bundle");
        sh(git(&origin).args(["bundle", "create", "-q"]).arg(&bundle).arg("main"));
        let name = format!("clawmux-relay-{test}-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        let ctr = Container::start(&name.replace('_', "-"));
        sh(Command::new("docker").arg("cp").arg(&bundle).arg(format!("{}:/tmp/main.bundle", ctr.id)));
        ctr.sh("git clone -q -b main /tmp/main.bundle /workspace/repo && rm /tmp/main.bundle && git -C /workspace/repo config user.name 'Agent Test' && git -C /workspace/repo config user.email agent@example.invalid");
        let api = FakeGithub::start().await;
        let token = format!("ghp_test_{}", uuid::Uuid::new_v4().simple());
        Self { ctr, _tmp: tmp, origin, seed, api, token }
    }

    fn config(&self) -> RelayConfig {
        let mut c = RelayConfig::new(self.ctr.id.clone(), self.origin.to_string_lossy());
        c.github_api_url = Some(self.api.base.clone());
        c.github_repo = Some("acme/widgets.js".to_owned());
        c.token = Some(Secret::new(self.token.clone()));
        c.retries = 2;
        c.retry_backoff = Duration::from_millis(50);
        c.exec_timeout = Duration::from_secs(30);
        c
    }

    async fn relay_with(&self, cfg: RelayConfig) -> (GitRelay, Arc<Recording<DockerExec>>) {
        let exec = DockerExec::connect(None, &self.ctr.id, None).await.expect("connect");
        let rec = Arc::new(Recording::new(exec));
        let relay = GitRelay::new(cfg, rec.clone()).expect("relay");
        (relay, rec)
    }

    async fn relay(&self) -> (GitRelay, Arc<Recording<DockerExec>>) {
        self.relay_with(self.config()).await
    }

    fn remote(&self, args: &[&str]) -> String {
        sh(git(&self.origin).args(args))
    }

    fn remote_has(&self, branch: &str) -> bool {
        git(&self.origin).args(["rev-parse", "--verify", "--quiet", &format!("refs/heads/{branch}")]).output().unwrap().status.success()
    }

    /// The token must be nowhere in the container: not in its environment (`docker inspect`), and
    /// in no file (the whole filesystem but /proc, /sys, /dev).
    fn assert_token_not_in_container(&self) {
        let inspect = sh(Command::new("docker").args(["inspect", &self.ctr.id]));
        assert!(!inspect.contains(&self.token), "token in docker inspect");
        let env = self.ctr.sh("cat /proc/1/environ | tr '\\0' '\\n'");
        assert!(!env.contains(&self.token), "token in the container's environment");
        let grep = self.ctr.try_sh(&format!("grep -rIl --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev -e '{}' / ", self.token));
        assert_eq!(grep.status.code(), Some(1), "grep must find nothing: {}", String::from_utf8_lossy(&grep.stdout));
    }
}

fn assert_token_not_in_argv(rec: &Recording<DockerExec>, token: &str) {
    let calls = rec.calls();
    assert!(!calls.is_empty());
    for c in &calls {
        assert!(!c.argv.iter().any(|a| a.contains(token)), "token in exec argv {:?}", c.argv);
        assert_ne!(c.argv.first().map(String::as_str), Some("sh"), "argv only, never a shell: {:?}", c.argv);
        assert!(c.exit_code.is_some(), "every exec finished with an exit code: {:?}", c.argv);
    }
}

// ---- log capture: every tracing line of the process, at debug, into one buffer

static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();

#[derive(Clone)]
struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl Write for LogWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn capture_logs() {
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let w = LogWriter(buf.clone());
        let sub = tracing_subscriber::fmt().with_env_filter("debug").with_ansi(false).with_writer(move || w.clone()).finish();
        let _ = tracing::subscriber::set_global_default(sub);
        buf
    });
}

fn logs() -> String {
    String::from_utf8_lossy(&LOGS.get().unwrap().lock().unwrap()).into_owned()
}

// ---- the fake GitHub REST API

#[derive(Debug, Clone)]
struct Call {
    method: String,
    path: String,
    query: String,
    auth: Option<String>,
    body: Value,
}

#[derive(Debug, Clone)]
struct Pr {
    number: u64,
    head: String,
    base: String,
    title: String,
    body: String,
}

#[derive(Default)]
struct ApiState {
    calls: Mutex<Vec<Call>>,
    prs: Mutex<Vec<Pr>>,
    fail: AtomicBool,
    base: Mutex<String>,
}

struct FakeGithub {
    base: String,
    state: Arc<ApiState>,
    server: actix_web::dev::ServerHandle,
}

impl Drop for FakeGithub {
    fn drop(&mut self) {
        let h = self.server.clone();
        actix_rt::spawn(async move { h.stop(false).await });
    }
}

impl FakeGithub {
    async fn start() -> Self {
        let state = Arc::new(ApiState::default());
        let st = web::Data::from(state.clone());
        let srv = HttpServer::new(move || App::new().app_data(st.clone()).default_service(web::to(api_handler)))
            .workers(1)
            .disable_signals()
            .bind(("127.0.0.1", 0))
            .unwrap();
        let addr = srv.addrs()[0];
        let server = srv.run();
        let handle = server.handle();
        actix_rt::spawn(server);
        let base = format!("http://{addr}");
        *state.base.lock().unwrap() = base.clone();
        Self { base, state, server: handle }
    }
    fn calls(&self) -> Vec<Call> {
        self.state.calls.lock().unwrap().clone()
    }
    fn methods(&self) -> Vec<String> {
        self.calls().iter().map(|c| c.method.clone()).collect()
    }
    fn prs(&self) -> Vec<Pr> {
        self.state.prs.lock().unwrap().clone()
    }
    fn set_failing(&self, on: bool) {
        self.state.fail.store(on, Ordering::SeqCst);
    }
}

async fn api_handler(req: HttpRequest, body: web::Bytes, st: web::Data<ApiState>) -> HttpResponse {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let call = Call {
        method: req.method().to_string(),
        path: req.path().to_owned(),
        query: req.query_string().to_owned(),
        auth: req.headers().get("authorization").and_then(|v| v.to_str().ok()).map(str::to_owned),
        body: body.clone(),
    };
    st.calls.lock().unwrap().push(call.clone());
    if st.fail.load(Ordering::SeqCst) {
        return HttpResponse::InternalServerError().json(json!({"message": "boom"}));
    }
    let base = st.base.lock().unwrap().clone();
    let pr_json = |p: &Pr| json!({"number": p.number, "html_url": format!("{base}/acme/widgets.js/pull/{}", p.number), "state": "open", "title": p.title, "body": p.body, "head": {"ref": p.head}, "base": {"ref": p.base}});
    let segs: Vec<&str> = call.path.trim_matches('/').split('/').collect();
    match (call.method.as_str(), segs.as_slice()) {
        ("GET", ["repos", "acme", "widgets.js", "pulls"]) => {
            let q: Vec<(String, String)> = url_pairs(&call.query);
            let head = q.iter().find(|(k, _)| k == "head").map(|(_, v)| v.clone()).unwrap_or_default();
            let state_open = q.iter().any(|(k, v)| k == "state" && v == "open");
            let list: Vec<Value> = st.prs.lock().unwrap().iter().filter(|p| state_open && format!("acme:{}", p.head) == head).map(pr_json).collect();
            HttpResponse::Ok().json(list)
        }
        ("POST", ["repos", "acme", "widgets.js", "pulls"]) => {
            let mut prs = st.prs.lock().unwrap();
            let p = Pr {
                number: prs.len() as u64 + 1,
                head: body["head"].as_str().unwrap_or_default().to_owned(),
                base: body["base"].as_str().unwrap_or_default().to_owned(),
                title: body["title"].as_str().unwrap_or_default().to_owned(),
                body: body["body"].as_str().unwrap_or_default().to_owned(),
            };
            prs.push(p.clone());
            HttpResponse::Created().json(pr_json(&p))
        }
        ("PATCH", ["repos", "acme", "widgets.js", "pulls", n]) => {
            let mut prs = st.prs.lock().unwrap();
            match prs.iter_mut().find(|p| p.number.to_string() == *n) {
                Some(p) => {
                    if let Some(t) = body["title"].as_str() {
                        p.title = t.to_owned();
                    }
                    if let Some(b) = body["body"].as_str() {
                        p.body = b.to_owned();
                    }
                    HttpResponse::Ok().json(pr_json(p))
                }
                None => HttpResponse::NotFound().json(json!({"message": "Not Found"})),
            }
        }
        _ => HttpResponse::NotFound().json(json!({"message": "Not Found"})),
    }
}

fn url_pairs(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.replace("%3A", ":").replace("%3a", ":").replace("%2F", "/").replace("%2f", "/")))
        .collect()
}

// ------------------------------------------------------------------------------------------------
// Tests
// ------------------------------------------------------------------------------------------------

/// Exec through the Docker API: argv only, stdout and stderr apart, exit codes, workdir, timeout.
#[actix_rt::test]
async fn docker_exec_keeps_streams_apart_and_checks_exit_codes() {
    if !docker_or_skip("docker_exec_keeps_streams_apart_and_checks_exit_codes") {
        return;
    }
    let w = World::new("exec").await;
    let ex = DockerExec::connect(None, &w.ctr.id, None).await.expect("connect");
    let argv = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let t = Duration::from_secs(20);
    let o = ex.exec(&argv(&["sh", "-c", "echo out; echo err >&2; exit 3"]), None, t).await.unwrap();
    assert_eq!((o.exit_code, o.stdout_text().as_str(), String::from_utf8_lossy(&o.stderr).trim()), (3, "out", "err"));
    // an argument is never interpreted by a shell
    let hostile = "$(id); rm -rf / `id` && echo pwned";
    let o = ex.exec(&argv(&["printf", "%s", hostile]), None, t).await.unwrap();
    assert_eq!(String::from_utf8_lossy(&o.stdout), hostile);
    let o = ex.exec(&argv(&["pwd"]), Some("/workspace/repo"), t).await.unwrap();
    assert_eq!(o.stdout_text(), "/workspace/repo");
    // large output arrives whole (4 MiB)
    let o = ex.exec(&argv(&["head", "-c", "4194304", "/dev/zero"]), None, t).await.unwrap();
    assert_eq!(o.stdout.len(), 4 * 1024 * 1024);
    let small = ex.clone().with_max_output(1000);
    assert!(matches!(small.exec(&argv(&["head", "-c", "100000", "/dev/zero"]), None, t).await, Err(RelayError::OutputTooLarge { limit: 1000 })));
    // timeout: reported, and the command is killed inside the container
    let t0 = Instant::now();
    let e = ex.exec(&argv(&["sleep", "37"]), None, Duration::from_secs(1)).await.expect_err("times out");
    assert!(matches!(e, RelayError::Timeout { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(10));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let top = sh(Command::new("docker").args(["top", &w.ctr.id]));
    assert!(!top.contains("sleep 37"), "the timed-out command still runs:\n{top}");
    // a missing container
    assert!(matches!(DockerExec::connect(None, "clawmux-no-such-container", None).await, Err(RelayError::Docker(_))));
}

/// The whole happy path: prepare, agent commit, publish (branch + PR created), a second commit on
/// the same key (appended to the same branch, PR updated, not duplicated), an idempotent re-publish;
/// trees equal the container's; the token is nowhere it must not be.
#[actix_rt::test]
async fn docker_relay_pushes_branch_creates_then_updates_one_pr() {
    if !docker_or_skip("docker_relay_pushes_branch_creates_then_updates_one_pr") {
        return;
    }
    let w = World::new("happy").await;
    let (relay, rec) = w.relay().await;

    let ws = relay.prepare("task.0022", "main").await.expect("prepare");
    assert_eq!((ws.path.as_str(), ws.branch.as_str(), ws.created), ("/workspace/wt/task.0022", "sandbox/task.0022", true));
    let again = relay.prepare("task.0022", "main").await.expect("prepare again");
    assert!(!again.created, "reused");
    assert_eq!(again.head, ws.head);

    // the agent: a text file, a CRLF file and a binary file in one commit
    w.ctr.sh("cd /workspace/wt/task.0022 && printf 'a\\r\\nb\\r\\n' > crlf.txt && printf '\\000\\001\\002\\377' > bin.dat && printf 'one\\n' > agent-one.txt && git add -A && git commit -q -m 'agent: one' -m 'body line'");
    let o = relay.publish("task.0022", "main", Some("Fix the widget"), Some("first body")).await;
    assert_eq!(o.error, None, "{o:?}");
    assert_eq!((o.commit_count, o.pushed, o.pushed_commits, o.pr_number), (1, true, 1, Some(1)));
    assert_eq!(o.pr_url.as_deref(), Some(format!("{}/acme/widgets.js/pull/1", w.api.base).as_str()));
    assert_eq!(w.remote(&["rev-parse", "sandbox/task.0022^{tree}"]), w.ctr.tree("task.0022"), "same tree as the container");
    assert_eq!(o.remote_head.as_deref(), Some(w.remote(&["rev-parse", "sandbox/task.0022"]).as_str()));
    assert_eq!(w.remote(&["log", "-1", "--format=%an <%ae>|%s|%b", "sandbox/task.0022"]), "Agent Test <agent@example.invalid>|agent: one|body line");
    assert_eq!(w.remote(&["log", "-1", "--format=%cn", "sandbox/task.0022"]), "clawmux relay");
    assert_eq!(w.api.methods(), ["GET", "POST"]);
    let first_remote_commit = w.remote(&["rev-parse", "sandbox/task.0022"]);

    // a second run on the same key, after the agent set hostile repository config: no diff
    // prefixes (would break the patches) and a hook that git would run on checkout
    w.ctr.sh("cd /workspace/repo && git config diff.noprefix true && mkdir -p /workspace/evil-hooks && printf '#!/bin/sh\\ntouch /tmp/hook-ran\\n' > /workspace/evil-hooks/post-checkout && chmod +x /workspace/evil-hooks/post-checkout && git config core.hooksPath /workspace/evil-hooks");
    w.ctr.commit("task.0022", "two");
    let o = relay.publish("task.0022", "main", Some("Fix the widget, take 2"), None).await;
    assert_eq!(o.error, None, "{o:?}");
    assert_eq!((o.commit_count, o.pushed, o.pushed_commits, o.pr_number), (2, true, 1, Some(1)));
    assert_eq!(w.remote(&["rev-list", "--count", "main..sandbox/task.0022"]), "2");
    assert_eq!(w.remote(&["rev-parse", "sandbox/task.0022~1"]), first_remote_commit, "appended: the first relayed commit is kept");
    assert_eq!(w.remote(&["rev-parse", "sandbox/task.0022^{tree}"]), w.ctr.tree("task.0022"));
    assert_eq!(w.api.methods(), ["GET", "POST", "GET", "PATCH"], "updated, not duplicated");
    let prs = w.api.prs();
    assert_eq!(prs.len(), 1);
    assert_eq!((prs[0].title.as_str(), prs[0].body.as_str(), prs[0].head.as_str(), prs[0].base.as_str()), ("Fix the widget, take 2", "first body", "sandbox/task.0022", "main"));
    let patch = w.api.calls().into_iter().find(|c| c.method == "PATCH").unwrap();
    assert_eq!(patch.path, "/repos/acme/widgets.js/pulls/1");
    assert_eq!(patch.body, json!({"title": "Fix the widget, take 2"}), "only what was given");

    relay.prepare("task.0023", "main").await.expect("prepare another key");
    assert_eq!(w.ctr.try_sh("test -e /tmp/hook-ran").status.code(), Some(1), "the relay's git ran no repository hook");
    w.ctr.sh("git -C /workspace/repo worktree add -q -b plain /workspace/plain main && test -e /tmp/hook-ran"); // the hook is real

    // nothing new: no push, the existing PR is found and left alone
    let before = w.remote(&["rev-parse", "sandbox/task.0022"]);
    let o = relay.publish("task.0022", "main", None, None).await;
    assert_eq!(o.error, None, "{o:?}");
    assert_eq!((o.commit_count, o.pushed, o.pushed_commits, o.pr_number), (2, true, 0, Some(1)));
    assert_eq!(w.remote(&["rev-parse", "sandbox/task.0022"]), before);
    assert_eq!(w.api.methods(), ["GET", "POST", "GET", "PATCH", "GET"]);

    // the token: in the API's Authorization header, and nowhere else
    for c in w.api.calls() {
        assert_eq!(c.auth.as_deref(), Some(format!("Bearer {}", w.token).as_str()));
        assert!(c.query.contains("widgets.js") || c.path.contains("widgets.js"));
    }
    assert_token_not_in_argv(&rec, &w.token);
    w.assert_token_not_in_container();
    let l = logs();
    assert!(l.contains("relay: pushed"), "the relay logs what it does");
    assert!(!l.contains(&w.token), "token in a log line");
    // the host clone is gone
    assert_eq!(w.ctr.count("task.0022"), 2, "the container keeps its commits");
}

/// No commits: nothing pushed, no branch on the remote, no API call, not an error.
#[actix_rt::test]
async fn docker_relay_without_commits_pushes_nothing() {
    if !docker_or_skip("docker_relay_without_commits_pushes_nothing") {
        return;
    }
    let w = World::new("empty").await;
    let (relay, _) = w.relay().await;
    relay.prepare("idle", "main").await.expect("prepare");
    let o = relay.publish("idle", "main", Some("t"), Some("b")).await;
    assert_eq!((o.commit_count, o.pushed, o.pushed_commits, o.pr_url.as_deref(), o.error.as_ref()), (0, false, 0, None, None));
    assert!(!w.remote_has("sandbox/idle"));
    assert!(w.api.calls().is_empty());
    // a key whose worktree was never prepared is an error that says so
    let o = relay.publish("never-prepared", "main", None, None).await;
    let e = o.error.expect("error");
    assert_eq!(e.stage, RelayStage::Inspect);
    assert!(e.message.contains("/workspace/wt/never-prepared"), "{e}");
}

/// A push the remote rejects (pre-receive hook): retried a bounded number of times, reported with
/// what failed, the commits stay in the container, and a later publish pushes them.
#[actix_rt::test]
async fn docker_relay_rejected_push_is_retried_reported_and_the_commits_survive() {
    if !docker_or_skip("docker_relay_rejected_push_is_retried_reported_and_the_commits_survive") {
        return;
    }
    let w = World::new("reject").await;
    let hook = w.origin.join("hooks/pre-receive");
    let counter = w.origin.join("hook-calls");
    std::fs::write(&hook, format!("#!/bin/sh\necho call >> '{}'\necho 'policy: sandbox branches are frozen' >&2\nexit 1\n", counter.display())).unwrap();
    sh(Command::new("chmod").arg("755").arg(&hook));
    let (relay, _) = w.relay().await;
    relay.prepare("frozen", "main").await.expect("prepare");
    w.ctr.commit("frozen", "a");
    let o = relay.publish("frozen", "main", None, None).await;
    let e = o.error.clone().expect("error");
    assert_eq!((e.stage, e.attempts), (RelayStage::Push, 3), "{e}");
    assert!(e.message.contains("pre-receive hook declined") || e.message.contains("frozen"), "{e}");
    assert!(e.to_string().starts_with("push failed after 3 attempts"), "{e}");
    assert!(!o.pushed);
    assert_eq!(std::fs::read_to_string(&counter).unwrap().lines().count(), 3, "bounded: 1 + 2 retries");
    assert!(!w.remote_has("sandbox/frozen"));
    assert!(w.api.calls().is_empty(), "no PR for a branch that is not there");
    assert_eq!(w.ctr.count("frozen"), 1, "the commit survives in the container");
    // the remote accepts again: the same commits go out
    std::fs::remove_file(&hook).unwrap();
    let o = relay.publish("frozen", "main", None, None).await;
    assert_eq!(o.error, None, "{o:?}");
    assert_eq!((o.pushed, o.pushed_commits, o.pr_number), (true, 1, Some(1)));
    assert_eq!(w.remote(&["rev-parse", "sandbox/frozen^{tree}"]), w.ctr.tree("frozen"));
}

/// A failing GitHub API (500): retried, reported at stage `pull_request`; the branch is pushed and
/// the next publish creates the PR without pushing again.
#[actix_rt::test]
async fn docker_relay_failing_api_is_retried_and_reported() {
    if !docker_or_skip("docker_relay_failing_api_is_retried_and_reported") {
        return;
    }
    let w = World::new("api500").await;
    w.api.set_failing(true);
    let (relay, _) = w.relay().await;
    relay.prepare("api", "main").await.expect("prepare");
    w.ctr.commit("api", "a");
    let o = relay.publish("api", "main", Some("t"), None).await;
    let e = o.error.clone().expect("error");
    assert_eq!((e.stage, e.attempts), (RelayStage::PullRequest, 3), "{e}");
    assert!(e.message.contains("HTTP 500") && e.message.contains("boom"), "{e}");
    assert!(o.pushed && o.pr_url.is_none());
    assert_eq!(w.api.methods(), ["GET", "GET", "GET"]);
    assert!(w.remote_has("sandbox/api"));
    w.api.set_failing(false);
    let o = relay.publish("api", "main", Some("t"), None).await;
    assert_eq!(o.error, None, "{o:?}");
    assert_eq!((o.pushed, o.pushed_commits, o.pr_number), (true, 0, Some(1)));
    assert_eq!(w.api.prs().len(), 1);
    // an unreachable API is reported the same way
    let mut cfg = w.config();
    cfg.github_api_url = Some("http://127.0.0.1:9".to_owned());
    cfg.retries = 1;
    let (relay, _) = w.relay_with(cfg).await;
    let o = relay.publish("api", "main", None, None).await;
    let e = o.error.expect("error");
    assert_eq!((e.stage, e.attempts), (RelayStage::PullRequest, 2), "{e}");
}

/// The remote branch has a commit the container does not: not pushed, reported, nothing lost;
/// with `force_push` the container's branch replaces it (with a lease).
#[actix_rt::test]
async fn docker_relay_diverged_remote_is_refused_unless_force_push() {
    if !docker_or_skip("docker_relay_diverged_remote_is_refused_unless_force_push") {
        return;
    }
    let w = World::new("diverged").await;
    // someone else pushed to sandbox/shared
    sh(git(&w.seed).args(["checkout", "-q", "-b", "sandbox/shared"]));
    std::fs::write(w.seed.join("human.txt"), "by hand\n").unwrap();
    sh(git(&w.seed).args(["add", "human.txt"]));
    sh(git(&w.seed).args(["commit", "-q", "-m", "human commit"]));
    sh(git(&w.seed).arg("push").arg("-q").arg(&w.origin).arg("sandbox/shared"));
    let human = w.remote(&["rev-parse", "sandbox/shared"]);
    let (relay, _) = w.relay().await;
    relay.prepare("shared", "main").await.expect("prepare");
    w.ctr.commit("shared", "agent");
    let o = relay.publish("shared", "main", None, None).await;
    let e = o.error.clone().expect("error");
    assert_eq!(e.stage, RelayStage::Apply);
    assert!(e.message.contains("diverged"), "{e}");
    assert!(!o.pushed);
    assert_eq!(w.remote(&["rev-parse", "sandbox/shared"]), human, "the remote branch is untouched");
    assert_eq!(w.ctr.count("shared"), 1);
    assert!(w.api.calls().is_empty());

    let mut cfg = w.config();
    cfg.force_push = true;
    let (forcing, _) = w.relay_with(cfg).await;
    let o = forcing.publish("shared", "main", None, None).await;
    assert_eq!(o.error, None, "{o:?}");
    assert!(o.pushed);
    assert_eq!(w.remote(&["rev-parse", "sandbox/shared^{tree}"]), w.ctr.tree("shared"));
    assert_eq!(w.remote(&["rev-list", "--count", "main..sandbox/shared"]), "1");
}

/// Two keys at once (worktrees side by side, parallel publishes); one key under a branch lock
/// runs prepare→commit→publish strictly one after the other, in arrival order.
#[actix_rt::test]
async fn docker_relay_two_keys_in_parallel_one_key_serialized() {
    if !docker_or_skip("docker_relay_two_keys_in_parallel_one_key_serialized") {
        return;
    }
    let w = World::new("concurrent").await;
    let (relay, _) = w.relay().await;
    let locks = BranchLocks::new();
    let (a, b) = futures_util::join!(relay.prepare("left", "main"), relay.prepare("right", "main"));
    a.expect("left");
    b.expect("right");
    w.ctr.commit("left", "l1");
    w.ctr.commit("right", "r1");
    let (a, b) = futures_util::join!(relay.publish("left", "main", None, None), relay.publish("right", "main", None, None));
    assert_eq!((a.error.clone(), b.error.clone()), (None, None), "{a:?} {b:?}");
    assert_eq!((a.pr_number, b.pr_number), (Some(1), Some(2)), "{a:?} {b:?}");
    assert!(w.remote_has("sandbox/left") && w.remote_has("sandbox/right"));

    // three "runs" on one key, each holding the lock from prepare to publish
    let order = Arc::new(Mutex::new(Vec::new()));
    let run = |i: usize| {
        let (relay, locks, order, ctr) = (relay.clone(), locks.clone(), order.clone(), w.ctr.id.clone());
        async move {
            let _g = locks.lock("serial").await;
            order.lock().unwrap().push(format!("start {i}"));
            relay.prepare("serial", "main").await.expect("prepare");
            let st = Command::new("docker")
                .args(["exec", &ctr, "sh", "-ec", &format!("cd /workspace/wt/serial && echo {i} > run.txt && git add run.txt && git commit -q -m 'run {i}'")])
                .status()
                .unwrap();
            assert!(st.success());
            let o = relay.publish("serial", "main", None, None).await;
            order.lock().unwrap().push(format!("end {i}"));
            o
        }
    };
    let (o1, o2, o3) = futures_util::join!(run(1), run(2), run(3));
    for o in [&o1, &o2, &o3] {
        assert_eq!(o.error, None, "{o:?}");
        assert_eq!(o.pushed_commits, 1);
    }
    assert_eq!((o1.commit_count, o2.commit_count, o3.commit_count), (1, 2, 3));
    assert_eq!(*order.lock().unwrap(), ["start 1", "end 1", "start 2", "end 2", "start 3", "end 3"]);
    assert_eq!(w.remote(&["log", "--format=%s", "main..sandbox/serial"]), "run 3\nrun 2\nrun 1");
    assert_eq!(w.api.prs().len(), 3, "left, right, serial: one PR each");
    assert!(locks.is_empty());
}

// ------------------------------------------------------------------------------------------------
// End to end: the real OpenClaw gateway in a container, its agent commits, the relay publishes
// ------------------------------------------------------------------------------------------------

fn gateway_container_env() -> Option<std::collections::HashMap<String, String>> {
    let Ok(path) = std::env::var("CLAWMUX_RELAY_GATEWAY_ENV") else {
        assert!(
            std::env::var("CLAWMUX_REQUIRE_GATEWAY_CONTAINER").as_deref() != Ok("1"),
            "CLAWMUX_REQUIRE_GATEWAY_CONTAINER=1 but CLAWMUX_RELAY_GATEWAY_ENV is not set (tests/support/gateway-container.sh start DIR)"
        );
        eprintln!("SKIP docker_gateway_agent_commit_is_relayed: no gateway container (tests/support/gateway-container.sh start DIR; CLAWMUX_RELAY_GATEWAY_ENV=DIR/env)");
        return None;
    };
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    Some(text.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect())
}

/// Two agent runs on one branch key through clawmux and the REAL gateway: each run's agent
/// commits in the prepared worktree (a real `exec` tool call inside the container, as the gateway's
/// uid), then the relay pushes: the branch arrives in the host remote with the container's tree,
/// the PR is created once and updated by the second run. The GitHub token is in no container env,
/// no file in the container, no exec argv, no log line and no LLM request.
#[actix_rt::test]
async fn docker_gateway_agent_commit_is_relayed() {
    let Some(env) = gateway_container_env() else { return };
    capture_logs();
    let get = |k: &str| env.get(k).unwrap_or_else(|| panic!("env lacks {k}")).clone();
    let (ctr, origin) = (get("CONTAINER_ID"), PathBuf::from(get("ORIGIN")));
    let api = FakeGithub::start().await;
    let token = format!("ghp_e2e_{}", uuid::Uuid::new_v4().simple());
    let mut cfg = RelayConfig::new(ctr.clone(), origin.to_string_lossy());
    cfg.workspace_root = get("WORKSPACE");
    cfg.github_api_url = Some(api.base.clone());
    cfg.github_repo = Some("acme/widgets.js".to_owned());
    cfg.token = Some(Secret::new(token.clone()));
    cfg.retries = 1;
    cfg.retry_backoff = Duration::from_millis(100);
    let exec = DockerExec::connect(None, &ctr, None).await.expect("connect");
    let rec = Arc::new(Recording::new(exec));
    let relay = GitRelay::new(cfg, rec.clone()).expect("relay");

    let app = common::start_clawmux(&get("GATEWAY_URL"), Some(&get("GATEWAY_TOKEN")), |_| {}).await;
    let base = common::base(&app);
    let http = reqwest::Client::new();
    common::wait_ready(&http, &base, Duration::from_secs(30)).await;

    let key = format!("e2e-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let mut outcomes = Vec::new();
    for (i, mark) in ["m1", "m2"].iter().enumerate() {
        let t0 = Instant::now();
        let ws = relay.prepare(&key, "main").await.expect("prepare");
        assert_eq!(ws.created, i == 0);
        let body = json!({"message": format!("Do the task. COMMIT:{}:{mark}", ws.path), "billingAccountId": "acct-relay", "stateKey": format!("{key}-{i}")});
        let (status, doc) = common::post_json(&http, &base, &body).await;
        assert_eq!(status, 200, "{doc}");
        assert_eq!(doc["status"], "ok", "{doc}");
        assert_eq!(doc["content"].as_str().map(str::trim), Some(format!("committed {mark}").as_str()), "the agent says it committed: {doc}");
        let run_s = t0.elapsed();
        // never the agent's word: git itself
        let file = sh(Command::new("docker").args(["exec", &ctr, "cat", &format!("{}/agent-{mark}.txt", ws.path)]));
        assert_eq!(file, *mark);
        let t1 = Instant::now();
        let o = relay.publish(&key, "main", Some(&format!("Agent work on {key}")), Some(&format!("run {}", i + 1))).await;
        eprintln!("run {} took {:.1} s, relay {:.1} s; relay outcome: {}", i + 1, run_s.as_secs_f64(), t1.elapsed().as_secs_f64(), serde_json::to_string(&o).unwrap());
        assert_eq!(o.error, None, "{o:?}");
        assert_eq!((o.commit_count, o.pushed, o.pushed_commits, o.pr_number), (i + 1, true, 1, Some(1)));
        let branch = format!("sandbox/{key}");
        assert_eq!(sh(git(&origin).args(["rev-parse", &format!("{branch}^{{tree}}")])), sh(Command::new("docker").args(["exec", &ctr, "git", "-C", &ws.path, "rev-parse", "HEAD^{tree}"])));
        assert_eq!(sh(git(&origin).args(["show", &format!("{branch}:agent-{mark}.txt")])), *mark);
        assert_eq!(sh(git(&origin).args(["log", "-1", "--format=%an|%s", &branch])), format!("Agent Test|agent: {mark}"));
        outcomes.push(o);
    }
    assert_eq!(api.methods(), ["GET", "POST", "GET", "PATCH"], "one PR, created then updated");
    assert_eq!(api.prs()[0].body, "run 2");

    // the token: nowhere in the container, the execs, the logs, the LLM traffic
    let inspect = sh(Command::new("docker").args(["inspect", &ctr]));
    assert!(!inspect.contains(&token));
    let grep = Command::new("docker").args(["exec", "-u", "0", &ctr, "grep", "-rIl", "--exclude-dir=proc", "--exclude-dir=sys", "--exclude-dir=dev", "--exclude-dir=opt", "-e", &token, "/"]).output().unwrap();
    assert_eq!(grep.status.code(), Some(1), "token found in container files: {}", String::from_utf8_lossy(&grep.stdout));
    assert_token_not_in_argv(&rec, &token);
    assert!(!logs().contains(&token));
    let llm_log = std::fs::read_to_string(get("LLM_LOG")).unwrap_or_default();
    assert!(llm_log.contains("commit_call"), "the fake LLM asked for the commit");
    assert!(!llm_log.contains(&token));
    app.server.stop(true).await;
}
