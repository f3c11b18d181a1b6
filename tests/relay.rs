//! The git relay against a REAL Docker engine and real git (every test here is named `docker_…`).
//!
//! Each test starts its own plain container from the project's offline base image
//! (`tests/support/docker-image.sh`: Debian minbase + git, python3) with `--network none` and
//! `sleep infinity`, clones a host bare repository's bundle into `/workspace/repo` inside it, and
//! drives [`GitRelay`] through the Docker API (bollard). Commits are made in the container's worktree
//! with `docker exec` (standing in for the agent); the host bare repository is the remote; a fake
//! GitHub REST server on 127.0.0.1 records the pull-request calls.
//!
//! Without a Docker engine or the image the tests print a skip line and pass, unless
//! `CLAWMUX_REQUIRE_DOCKER=1` (tests/run.sh sets it), where they fail.
//! Env: `CLAWMUX_BASE_IMAGE` (default `clawmux/base:bookworm`).
//!
//! `docker_gateway_agent_commit_is_relayed` is the end to end: the REAL OpenClaw gateway in a
//! container (`tests/support/gateway-container.sh start DIR`, then `CLAWMUX_RELAY_GATEWAY_ENV=DIR/env`),
//! clawmux drives agent runs whose (fake) LLM tells the real agent to commit with its `exec` tool,
//! and the relay pushes the commits. Without that env it skips, unless
//! `CLAWMUX_REQUIRE_GATEWAY_CONTAINER=1`.
//!
//! The `docker_api_…` tests go through clawmux's HTTP API (`POST /v1/runs` with `branch`, SSE, `GET
//! /v1/runs/{id}`, abort) with the relay configured from clawmux's own settings, against the same
//! gateway container (`CLAWMUX_RELAY_GATEWAY_ENV`; skipped without it unless
//! `CLAWMUX_REQUIRE_GATEWAY_CONTAINER=1`): relayed run and PR update, one key serialized and two
//! keys overlapping, no commits, waiting runs timed out / aborted, the GitHub token nowhere (also
//! with the `clawmux serve` binary configured by its environment). `docker_api_hostile_branch_keys_are_refused`
//! and `docker_api_caller_mistakes_are_422_before_the_run` need Docker only.
//!
//! `docker_relay_push_is_conditional_on_the_remote_head_it_observed` interferes with the remote
//! between the relay's look at it and its push through `RelayConfig::git_program` (a wrapper that
//! writes to the remote before running the real `git push`); the binary test puts a recording `git`
//! first on clawmux's `PATH` and checks the environment of every host git call.

#![allow(clippy::unwrap_used)]

mod common;

use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use clawmux::config::Secret;
use clawmux::relay::{ContainerExec, DockerExec, GitRelay, Recording, RelayConfig, RelayError, RelayStage};
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
    std::env::var("CLAWMUX_BASE_IMAGE").unwrap_or_else(|_| "clawmux/base:bookworm".to_owned())
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

/// The real git on this machine's `PATH`.
fn real_git() -> PathBuf {
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':').map(|d| Path::new(d).join("git")).find(|p| p.is_file()).expect("git on PATH")
}

/// Writes `text` to `path`, executable, through a child `sh`: a file this process held open for
/// writing could be inherited by a child another thread forks at that moment, and running the
/// script before that child execs fails with "Text file busy" (ETXTBSY).
fn write_script(path: &Path, text: &str) {
    sh(Command::new("sh").args(["-c", r#"printf '%s' "$1" > "$2" && chmod 755 "$2""#, "sh", text]).arg(path));
}

/// A `git` (for `RelayConfig::git_program`) that, before the first `push` it runs, runs the shell
/// script `<dir>/on-push` once: someone else's write to the remote, between the relay's look at the
/// remote and its push.
fn interfering_git(dir: &Path) -> PathBuf {
    let wrapper = dir.join("git");
    let d = dir.display();
    write_script(
        &wrapper,
        &format!(
            "#!/bin/sh\nfor a in \"$@\"; do\n  if [ \"$a\" = push ] && mv '{d}/on-push' '{d}/on-push.ran' 2>/dev/null; then sh -e '{d}/on-push.ran' || exit 99; fi\ndone\nexec '{}' \"$@\"\n",
            real_git().display()
        ),
    );
    wrapper
}

/// A `git` first on `PATH` (in `dir/bin`) that records the environment it was started with
/// (`/proc/$$/environ`) and its argv in `dir/log`, then runs the real git.
fn recording_git(dir: &Path) -> (PathBuf, PathBuf) {
    let (bin, log) = (dir.join("bin"), dir.join("log"));
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(&log).unwrap();
    let l = log.display();
    write_script(
        &bin.join("git"),
        &format!("#!/bin/sh\nn=$$-$(date +%s%N)\ncat /proc/$$/environ > '{l}/'$n.env\nprintf '%s\\0' \"$@\" > '{l}/'$n.argv\nexec '{}' \"$@\"\n", real_git().display()),
    );
    (bin, log)
}

/// What [`recording_git`] recorded: (argv, environment) per call.
fn recorded_git_calls(log: &Path) -> Vec<(Vec<String>, std::collections::BTreeMap<String, String>)> {
    let split = |b: Vec<u8>| b.split(|c| *c == 0).filter(|x| !x.is_empty()).map(|x| String::from_utf8_lossy(x).into_owned()).collect::<Vec<_>>();
    let mut out = Vec::new();
    for e in std::fs::read_dir(log).unwrap() {
        let p = e.unwrap().path();
        if p.extension().and_then(|x| x.to_str()) != Some("env") {
            continue;
        }
        let env = split(std::fs::read(&p).unwrap()).into_iter().filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned()))).collect();
        let argv = split(std::fs::read(p.with_extension("argv")).unwrap_or_default());
        out.push((argv, env));
    }
    out
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
    // Killed inside the container by its own bound (`timeout -s KILL`, counted from its start):
    // soon, but not necessarily within a fixed pause of the exec's answer.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let top = sh(Command::new("docker").args(["top", &w.ctr.id]));
        if !top.contains("sleep 37") {
            break;
        }
        assert!(Instant::now() < deadline, "the timed-out command still runs:\n{top}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
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

    // nothing new: no push (`pushed` means "this call pushed"), the existing PR is found and left alone
    let before = w.remote(&["rev-parse", "sandbox/task.0022"]);
    let o = relay.publish("task.0022", "main", None, None).await;
    assert_eq!(o.error, None, "{o:?}");
    assert_eq!((o.commit_count, o.pushed, o.pushed_commits, o.pr_number), (2, false, 0, Some(1)));
    assert_eq!(o.remote_head.as_deref(), Some(before.as_str()), "the head it found");
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
    write_script(&hook, &format!("#!/bin/sh\necho call >> '{}'\necho 'policy: sandbox branches are frozen' >&2\nexit 1\n", counter.display()));
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
    assert_eq!((o.pushed, o.pushed_commits, o.pr_number), (false, 0, Some(1)), "already pushed by the first call");
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
    assert!(e.message.contains("someone else pushed") && e.message.contains(&human), "{e}");
    assert!(!o.pushed);
    assert_eq!(o.remote_head.as_deref(), Some(human.as_str()), "the other writer's head");
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

/// Every push is conditional on the remote head the publish observed (compare-and-swap). Someone
/// else's write to `sandbox/<key>` while a publish works (here: between its look at the remote and
/// its push) is detected and reported, never overwritten, even when a plain push would be a
/// fast-forward over it (the branch moved back; the branch created meanwhile); a push by someone
/// else between two runs is reported too. The commits stay on the container's branch every time.
#[actix_rt::test]
async fn docker_relay_push_is_conditional_on_the_remote_head_it_observed() {
    if !docker_or_skip("docker_relay_push_is_conditional_on_the_remote_head_it_observed") {
        return;
    }
    let w = World::new("cas").await;
    let hooks = tempfile::tempdir().unwrap();
    let mut cfg = w.config();
    cfg.git_program = interfering_git(hooks.path());
    let (relay, _) = w.relay_with(cfg).await;
    let on_push = |script: String| std::fs::write(hooks.path().join("on-push"), script).unwrap();
    let update_ref = |branch: &str, to: &str| format!("'{}' -C '{}' update-ref refs/heads/{branch} {to}\n", real_git().display(), w.origin.display());

    relay.prepare("cas", "main").await.expect("prepare");
    w.ctr.commit("cas", "one");
    w.ctr.commit("cas", "two");
    let o = relay.publish("cas", "main", None, None).await;
    assert_eq!((o.error.clone(), o.pushed, o.pushed_commits), (None, true, 2), "{o:?}");
    let (r2, r1) = (w.remote(&["rev-parse", "sandbox/cas"]), w.remote(&["rev-parse", "sandbox/cas~1"]));

    // while the next publish works, someone moves the branch back to r1 (drops a commit)
    w.ctr.commit("cas", "three");
    on_push(update_ref("sandbox/cas", &r1));
    let o = relay.publish("cas", "main", None, None).await;
    eprintln!("concurrent push during a publish: {}", serde_json::to_string(&o).unwrap());
    assert!(hooks.path().join("on-push.ran").exists(), "the other write happened");
    let e = o.error.clone().expect("refused");
    assert_eq!(e.stage, RelayStage::Push, "{e}");
    assert!(e.message.contains("changed on the remote while this run published") && e.message.contains(&format!("from {r2} to {r1}")), "{e}");
    assert!(e.message.contains("nothing overwritten") && e.message.contains("the commits stay on the container's branch"), "{e}");
    assert_eq!((o.pushed, o.pushed_commits, o.remote_head.as_deref()), (false, 0, Some(r1.as_str())));
    assert_eq!(w.remote(&["rev-parse", "sandbox/cas"]), r1, "not overwritten");
    assert_eq!(w.ctr.count("cas"), 3, "the commits stay on the container's branch");
    assert_eq!(w.api.methods(), ["GET", "POST"], "no PR call after a refused push");

    // between two runs, someone pushes a commit of theirs on top of the branch
    sh(git(&w.seed).args(["fetch", "-q"]).arg(&w.origin).arg("sandbox/cas"));
    sh(git(&w.seed).args(["checkout", "-q", "-B", "human", "FETCH_HEAD"]));
    std::fs::write(w.seed.join("human.txt"), "mine\n").unwrap();
    sh(git(&w.seed).args(["add", "human.txt"]));
    sh(git(&w.seed).args(["commit", "-q", "-m", "a human's commit"]));
    sh(git(&w.seed).arg("push").arg("-q").arg(&w.origin).arg("human:sandbox/cas"));
    let theirs = w.remote(&["rev-parse", "sandbox/cas"]);
    w.ctr.commit("cas", "four");
    let o = relay.publish("cas", "main", None, None).await;
    eprintln!("a push by someone else between two runs: {}", serde_json::to_string(&o).unwrap());
    let e = o.error.clone().expect("refused");
    assert_eq!(e.stage, RelayStage::Apply, "{e}");
    assert!(e.message.contains("someone else pushed") && e.message.contains(&theirs) && e.message.contains("nothing overwritten"), "{e}");
    assert_eq!((o.pushed, o.remote_head.as_deref()), (false, Some(theirs.as_str())));
    assert_eq!(w.remote(&["rev-parse", "sandbox/cas"]), theirs, "not overwritten");
    assert_eq!(w.ctr.count("cas"), 4);

    // a new branch that someone else creates while the publish works: the push may only create it
    relay.prepare("cas-new", "main").await.expect("prepare");
    w.ctr.commit("cas-new", "n1");
    let main = w.remote(&["rev-parse", "main"]);
    on_push(update_ref("sandbox/cas-new", &main));
    let o = relay.publish("cas-new", "main", None, None).await;
    let e = o.error.clone().expect("refused");
    assert_eq!(e.stage, RelayStage::Push, "{e}");
    assert!(e.message.contains(&format!("from no branch to {main}")), "{e}");
    assert_eq!((o.pushed, o.remote_head.as_deref()), (false, Some(main.as_str())));
    assert_eq!(w.remote(&["rev-parse", "sandbox/cas-new"]), main, "not overwritten");
    assert_eq!(w.ctr.count("cas-new"), 1);
    // with nobody interfering, the same publish goes through
    sh(git(&w.origin).args(["update-ref", "-d", "refs/heads/sandbox/cas-new"]));
    let o = relay.publish("cas-new", "main", None, None).await;
    assert_eq!((o.error.clone(), o.pushed, o.pushed_commits), (None, true, 1), "{o:?}");
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
    // One key's runs serialised as the registry does it: one holder at a time, in arrival order.
    let locks = Arc::new(tokio::sync::Mutex::new(()));
    let (a, b) = futures_util::join!(relay.prepare("left", "main"), relay.prepare("right", "main"));
    a.expect("left");
    b.expect("right");
    w.ctr.commit("left", "l1");
    w.ctr.commit("right", "r1");
    let (a, b) = futures_util::join!(relay.publish("left", "main", None, None), relay.publish("right", "main", None, None));
    assert_eq!((a.error.clone(), b.error.clone()), (None, None), "{a:?} {b:?}");
    // in parallel: either may create its PR first
    let mut numbers = [a.pr_number, b.pr_number];
    numbers.sort();
    assert_eq!(numbers, [Some(1), Some(2)], "{a:?} {b:?}");
    assert!(w.remote_has("sandbox/left") && w.remote_has("sandbox/right"));

    // three "runs" on one key, each holding the lock from prepare to publish
    let order = Arc::new(Mutex::new(Vec::new()));
    let run = |i: usize| {
        let (relay, locks, order, ctr) = (relay.clone(), locks.clone(), order.clone(), w.ctr.id.clone());
        async move {
            let _g = locks.lock().await;
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

// ------------------------------------------------------------------------------------------------
// Through clawmux's HTTP API: `POST /v1/runs` with `branch`, the real gateway in its container, the
// relay configured from clawmux's own settings (`cfg.relay_*`, `cfg.github_*`), every result read
// back over SSE and `GET /v1/runs/{id}` (tests named `docker_api_…`)
// ------------------------------------------------------------------------------------------------

/// The gateway container's env for a `docker_api_` test, or `None` (skipped with a line) without
/// one; panics when `CLAWMUX_REQUIRE_GATEWAY_CONTAINER=1`.
fn api_gateway_env(test: &str) -> Option<std::collections::HashMap<String, String>> {
    let Ok(path) = std::env::var("CLAWMUX_RELAY_GATEWAY_ENV") else {
        assert!(
            std::env::var("CLAWMUX_REQUIRE_GATEWAY_CONTAINER").as_deref() != Ok("1"),
            "{test}: CLAWMUX_REQUIRE_GATEWAY_CONTAINER=1 but CLAWMUX_RELAY_GATEWAY_ENV is not set (tests/support/gateway-container.sh start DIR)"
        );
        eprintln!("SKIP {test}: no gateway container (tests/support/gateway-container.sh start DIR; CLAWMUX_RELAY_GATEWAY_ENV=DIR/env)");
        return None;
    };
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{test}: cannot read {path}: {e}"));
    Some(text.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect())
}

/// clawmux (in-process) with its relay pointed at the real gateway container, the host bare repo
/// and a fake GitHub API of this test; a fresh random GitHub token.
struct ApiWorld {
    ctr: String,
    origin: PathBuf,
    llm_log: PathBuf,
    api: FakeGithub,
    token: String,
    app: clawmux::server::Running,
    base: String,
    http: reqwest::Client,
    _links: tempfile::TempDir,
}

impl ApiWorld {
    /// `None` when the test is skipped (no Docker / image / gateway container).
    async fn start(test: &str) -> Option<Self> {
        if !docker_or_skip(test) {
            return None;
        }
        let env = api_gateway_env(test)?;
        capture_logs();
        let get = |k: &str| env.get(k).unwrap_or_else(|| panic!("gateway env lacks {k}")).clone();
        let (ctr, origin) = (get("CONTAINER_ID"), PathBuf::from(get("ORIGIN")));
        // The remote as clawmux would see a GitHub repository: the URL names owner/repo, so the
        // relay finds `acme/widgets.js` for the API from `CLAWMUX_RELAY_REMOTE_URL` alone (the
        // service has no separate owner/repo setting). A file:// URL through a symlink to the bare repo.
        let (links, remote_url) = github_like_remote(&origin);
        let api = FakeGithub::start().await;
        let token = format!("ghp_api_{}", uuid::Uuid::new_v4().simple());
        let (api_base, tok, workspace, ctr_id) = (api.base.clone(), token.clone(), get("WORKSPACE"), ctr.clone());
        let app = common::start_clawmux(&get("GATEWAY_URL"), Some(&get("GATEWAY_TOKEN")), move |c| {
            c.relay_container = Some(ctr_id);
            c.relay_remote_url = Some(remote_url);
            c.relay_workspace = workspace;
            c.relay_base_ref = "main".to_owned();
            c.github_api_url = api_base;
            c.github_token = Some(Secret::new(tok));
        })
        .await;
        assert!(app.state.relay, "the relay is configured");
        let base = common::base(&app);
        let http = reqwest::Client::new();
        common::wait_ready(&http, &base, Duration::from_secs(60)).await;
        Some(Self { ctr, origin, llm_log: PathBuf::from(get("LLM_LOG")), api, token, app, base, http, _links: links })
    }

    fn remote(&self, args: &[&str]) -> String {
        sh(git(&self.origin).args(args))
    }

    fn remote_has(&self, branch: &str) -> bool {
        git(&self.origin).args(["rev-parse", "--verify", "--quiet", &format!("refs/heads/{branch}")]).output().unwrap().status.success()
    }

    /// `git -C <worktree> …` inside the container (the test's own argv).
    fn ctr_git(&self, key: &str, args: &[&str]) -> String {
        let wt = format!("/workspace/wt/{key}");
        sh(Command::new("docker").args(["exec", &self.ctr, "git", "-C", &wt]).args(args))
    }

    async fn get_doc(&self, run_id: &str) -> Value {
        let r = self.http.get(format!("{}/v1/runs/{run_id}", self.base)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        r.json().await.unwrap()
    }

    /// Posts a run (SSE) and returns its reader; the POST must answer 200.
    async fn post(&self, body: &Value) -> TimedSse {
        let r = common::post_sse(&self.http, &self.base, body, &[]).await;
        assert_eq!(r.status(), 200, "POST /v1/runs: {:?}", r.text().await);
        TimedSse::new(r)
    }

    async fn stop(self) {
        self.app.server.stop(true).await;
    }
}

/// `file://…/acme/widgets.js.git`, a symlink to the host bare repo `origin`: a remote URL that
/// names owner/repo like a GitHub URL does.
fn github_like_remote(origin: &Path) -> (tempfile::TempDir, String) {
    let links = tempfile::Builder::new().prefix("clawmux-api-remote-").tempdir().unwrap();
    std::fs::create_dir(links.path().join("acme")).unwrap();
    std::os::unix::fs::symlink(origin, links.path().join("acme/widgets.js.git")).unwrap();
    let url = format!("file://{}/acme/widgets.js.git", links.path().display());
    (links, url)
}

/// A unique branch key for one test.
fn unique_key(tag: &str) -> String {
    format!("api-{tag}-{}", &uuid::Uuid::new_v4().simple().to_string()[..8])
}

/// The body of a branch run by work item id.
fn branch_body(key: &str, message: &str, branch_extra: Value) -> Value {
    let mut branch = json!({"workItemId": key});
    if let (Some(b), Some(extra)) = (branch.as_object_mut(), branch_extra.as_object()) {
        b.extend(extra.clone());
    }
    json!({"message": message, "billingAccountId": "acct-relay-api", "timeoutSec": 180, "branch": branch})
}

fn commit_msg(key: &str, mark: &str) -> String {
    format!("Do the task. COMMIT:/workspace/wt/{key}:{mark}")
}

/// An SSE stream whose events are stamped with the time the test read them.
struct TimedSse {
    stream: std::pin::Pin<Box<dyn futures_util::Stream<Item = reqwest::Result<bytes::Bytes>>>>,
    buf: String,
    events: Vec<(Instant, common::SseEvent)>,
    raw: String,
    done: bool,
}

impl TimedSse {
    fn new(r: reqwest::Response) -> Self {
        Self { stream: Box::pin(r.bytes_stream()), buf: String::new(), events: Vec::new(), raw: String::new(), done: false }
    }

    /// Reads until an event NOT yet seen satisfies `pred`, or the stream ends / `within` passes.
    async fn until(&mut self, within: Duration, pred: impl Fn(&common::SseEvent) -> bool) -> Option<common::SseEvent> {
        use futures_util::StreamExt;
        let deadline = tokio::time::Instant::now() + within;
        while !self.done {
            let chunk = match tokio::time::timeout_at(deadline, self.stream.next()).await {
                Err(_) => return None,
                Ok(None) | Ok(Some(Err(_))) => {
                    self.done = true;
                    return None;
                }
                Ok(Some(Ok(c))) => c,
            };
            let text = String::from_utf8_lossy(&chunk).into_owned();
            self.raw.push_str(&text);
            self.buf.push_str(&text);
            let mut hit = None;
            while let Some(pos) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..pos + 2).collect();
                for ev in common::parse_sse(&block) {
                    if hit.is_none() && pred(&ev) {
                        hit = Some(ev.clone());
                    }
                    self.events.push((Instant::now(), ev));
                }
            }
            if hit.is_some() {
                return hit;
            }
        }
        None
    }

    /// Reads to the terminal event (which must come within `within`).
    async fn read_to_terminal(&mut self, within: Duration) -> common::SseEvent {
        if let Some((_, e)) = self.events.iter().find(|(_, e)| e.event == "final" || e.event == "error") {
            return e.clone();
        }
        self.until(within, |e| e.event == "final" || e.event == "error").await.unwrap_or_else(|| panic!("no terminal event within {within:?}; events: {:?}", self.names()))
    }

    fn names(&self) -> Vec<String> {
        self.events.iter().map(|(_, e)| e.event.clone()).collect()
    }

    fn at(&self, name: &str) -> Instant {
        self.events.iter().find(|(_, e)| e.event == name).map(|(t, _)| *t).unwrap_or_else(|| panic!("no {name} event: {:?}", self.names()))
    }

    fn one(&self, name: &str) -> Value {
        let v: Vec<&Value> = self.events.iter().filter(|(_, e)| e.event == name).map(|(_, e)| &e.data).collect();
        assert_eq!(v.len(), 1, "exactly one {name} event: {:?}", self.names());
        v[0].clone()
    }

    fn position(&self, name: &str) -> usize {
        self.events.iter().position(|(_, e)| e.event == name).unwrap_or_else(|| panic!("no {name} event: {:?}", self.names()))
    }

    fn waited(&self) -> bool {
        self.events.iter().any(|(_, e)| e.event == "status" && e.data["phase"] == "waiting_for_branch")
    }
}

/// Reads a branch run to `final` and checks the shape every relayed run has: one `relay` event,
/// right before `final`, equal to the run document's `relay` (in `final` and in `GET`). Returns
/// (the relay event's data, the final run document).
async fn finish_branch_run(w: &ApiWorld, sse: &mut TimedSse, key: &str) -> (Value, Value) {
    let term = sse.read_to_terminal(Duration::from_secs(150)).await;
    assert_eq!(term.event, "final", "the run ends final: {} {:?}", term.data, sse.names());
    let names = sse.names();
    assert_eq!(names.first().map(String::as_str), Some(if sse.waited() { "status" } else { "accepted" }), "{names:?}");
    let relay = sse.one("relay");
    assert_eq!(sse.position("relay") + 1, sse.position("final"), "relay comes right before final: {names:?}");
    assert!(sse.position("accepted") < sse.position("relay"), "{names:?}");
    assert_eq!(term.data["relay"], relay, "final's run document carries the relay event");
    let doc = w.get_doc(term.data["runId"].as_str().unwrap()).await;
    assert_eq!(doc["status"], "ok", "{doc}");
    assert_eq!(doc["relay"], relay, "GET /v1/runs/{{id}} carries the relay event");
    assert_eq!(relay["branch"], format!("sandbox/{key}"));
    // the wire shape: camelCase, exactly these fields
    let fields: std::collections::BTreeSet<&str> = relay.as_object().unwrap().keys().map(String::as_str).collect();
    let allowed = ["branch", "commitCount", "pushed", "pushedCommits", "remoteHead", "prUrl", "prNumber", "error"];
    assert!(fields.iter().all(|f| allowed.contains(f)), "{relay}");
    (relay, doc)
}

/// A branch run by work item id through `POST /v1/runs` whose (real) agent commits in the worktree
/// clawmux prepared: `relay` (pushed, one commit, PR URL) before `final`, equal to the run
/// document's; the host remote has `sandbox/<key>` with the container's tree and the agent's
/// commit; one PR created. A second run on the key adds a commit to the same branch and updates
/// (PATCH) the same PR.
#[actix_rt::test]
async fn docker_api_branch_run_pushes_and_second_run_updates_the_same_pr() {
    let test = "docker_api_branch_run_pushes_and_second_run_updates_the_same_pr";
    let Some(w) = ApiWorld::start(test).await else { return };
    let t0 = Instant::now();
    let key = unique_key("e2e");
    let branch = format!("sandbox/{key}");

    let mut sse = w.post(&branch_body(&key, &commit_msg(&key, "m1"), json!({"prTitle": format!("Agent work on {key}"), "prBody": "run 1"}))).await;
    let (relay, doc) = finish_branch_run(&w, &mut sse, &key).await;
    eprintln!("{test}: run 1 ({:.1} s) relay event: {}", t0.elapsed().as_secs_f64(), serde_json::to_string(&relay).unwrap());
    assert_eq!(doc["content"].as_str().map(str::trim), Some("committed m1"), "the agent committed: {doc}");
    assert!(!sse.waited(), "nobody held the key");
    assert!(relay.get("error").is_none(), "{relay}");
    assert_eq!((relay["pushed"].as_bool(), relay["commitCount"].as_u64(), relay["pushedCommits"].as_u64()), (Some(true), Some(1), Some(1)), "{relay}");
    assert_eq!(relay["prUrl"], format!("{}/acme/widgets.js/pull/1", w.api.base));
    assert_eq!(relay["prNumber"], 1);
    // the remote: the agent's commit, same tree as the container's HEAD, relayed by clawmux
    assert!(w.remote_has(&branch));
    assert_eq!(w.remote(&["rev-parse", &format!("{branch}^{{tree}}")]), w.ctr_git(&key, &["rev-parse", "HEAD^{tree}"]), "same tree as the container");
    assert_eq!(relay["remoteHead"], w.remote(&["rev-parse", &branch]));
    assert_eq!(w.remote(&["show", &format!("{branch}:agent-m1.txt")]), "m1");
    assert_eq!(w.remote(&["log", "-1", "--format=%an|%cn|%s", &branch]), "Agent Test|clawmux relay|agent: m1");
    assert_eq!(w.remote(&["rev-list", "--count", &format!("main..{branch}")]), "1");
    assert_eq!(w.ctr_git(&key, &["symbolic-ref", "HEAD"]), format!("refs/heads/{branch}"), "the agent worked on the prepared branch");
    assert_eq!(w.api.methods(), ["GET", "POST"], "exactly one create");
    let create = w.api.calls().into_iter().find(|c| c.method == "POST").unwrap();
    assert_eq!((create.body["head"].as_str(), create.body["base"].as_str(), create.body["title"].as_str()), (Some(branch.as_str()), Some("main"), Some(format!("Agent work on {key}").as_str())));
    let first_remote = w.remote(&["rev-parse", &branch]);

    // the second run on the key: another commit on the same branch, the PR updated
    let t1 = Instant::now();
    let mut sse = w.post(&branch_body(&key, &commit_msg(&key, "m2"), json!({"prBody": "run 2"}))).await;
    let (relay2, doc2) = finish_branch_run(&w, &mut sse, &key).await;
    eprintln!("{test}: run 2 ({:.1} s) relay event: {}", t1.elapsed().as_secs_f64(), serde_json::to_string(&relay2).unwrap());
    assert_eq!(doc2["content"].as_str().map(str::trim), Some("committed m2"), "{doc2}");
    assert!(relay2.get("error").is_none(), "{relay2}");
    assert_eq!((relay2["pushed"].as_bool(), relay2["commitCount"].as_u64(), relay2["pushedCommits"].as_u64()), (Some(true), Some(2), Some(1)), "{relay2}");
    assert_eq!(relay2["prUrl"], relay["prUrl"], "the same PR");
    assert_eq!(w.remote(&["rev-list", "--count", &format!("main..{branch}")]), "2");
    assert_eq!(w.remote(&["rev-parse", &format!("{branch}~1")]), first_remote, "appended on top of run 1's commit");
    assert_eq!(w.remote(&["log", "--format=%s", &format!("main..{branch}")]), "agent: m2\nagent: m1");
    assert_eq!(w.remote(&["rev-parse", &format!("{branch}^{{tree}}")]), w.ctr_git(&key, &["rev-parse", "HEAD^{tree}"]));
    assert_eq!(w.api.methods(), ["GET", "POST", "GET", "PATCH"], "updated, not duplicated");
    let prs = w.api.prs();
    assert_eq!(prs.len(), 1, "still one PR");
    assert_eq!((prs[0].title.clone(), prs[0].body.as_str()), (format!("Agent work on {key}"), "run 2"));
    let patch = w.api.calls().into_iter().find(|c| c.method == "PATCH").unwrap();
    assert_eq!((patch.path.as_str(), &patch.body), ("/repos/acme/widgets.js/pulls/1", &json!({"body": "run 2"})));
    eprintln!("{test}: fake GitHub calls: {}; {:.1} s", w.api.methods().join(", "), t0.elapsed().as_secs_f64());
    w.stop().await;
}

/// Two concurrent runs on ONE key run one after the other (the second shows `waiting_for_branch`,
/// and its `accepted` comes after the first's `final`); two runs on two keys overlap (both accepted
/// before either finishes). The first runs are slow (`SLOW`: the fake LLM streams its tool call
/// over ~4 s).
#[actix_rt::test]
async fn docker_api_one_key_serializes_two_keys_overlap() {
    let test = "docker_api_one_key_serializes_two_keys_overlap";
    let Some(w) = ApiWorld::start(test).await else { return };
    let t0 = Instant::now();

    // one key
    let key = unique_key("serial");
    let mut first = w.post(&branch_body(&key, &format!("SLOW {}", commit_msg(&key, "s1")), json!({}))).await;
    first.until(Duration::from_secs(60), |e| e.event == "accepted").await.unwrap_or_else(|| panic!("run 1 accepted: {:?}", first.names()));
    let mut second = w.post(&branch_body(&key, &commit_msg(&key, "s2"), json!({}))).await;
    let waiting = second.until(Duration::from_secs(20), |e| e.event == "status").await.expect("run 2's first event");
    assert_eq!(waiting.data, json!({"phase": "waiting_for_branch", "branch": format!("sandbox/{key}")}));
    let (a, b) = futures_util::join!(finish_branch_run(&w, &mut first, &key), finish_branch_run(&w, &mut second, &key));
    let ((r1, _), (r2, _)) = (a, b);
    assert!(!first.waited());
    assert!(second.waited());
    assert!(second.at("accepted") > first.at("final"), "run 2 started after run 1 ended: run 1 {:?} / run 2 {:?}", first.names(), second.names());
    assert!(second.at("accepted") > first.at("relay"));
    assert_eq!((r1["commitCount"].as_u64(), r1["pushedCommits"].as_u64(), r1["pushed"].as_bool()), (Some(1), Some(1), Some(true)), "{r1}");
    assert_eq!((r2["commitCount"].as_u64(), r2["pushedCommits"].as_u64(), r2["pushed"].as_bool()), (Some(2), Some(1), Some(true)), "{r2}");
    let branch = format!("sandbox/{key}");
    assert_eq!(w.remote(&["log", "--format=%s", &format!("main..{branch}")]), "agent: s2\nagent: s1", "in arrival order, on one branch");
    assert_eq!(w.api.prs().len(), 1);
    eprintln!("{test}: one key: run 1 final at {:.1} s, run 2 accepted at {:.1} s", (first.at("final") - t0).as_secs_f64(), (second.at("accepted") - t0).as_secs_f64());

    // two keys, both slow, posted together
    let (ka, kb) = (unique_key("left"), unique_key("right"));
    let t1 = Instant::now();
    let (body_a, body_b) = (
        branch_body(&ka, &format!("SLOW {}", commit_msg(&ka, "l1")), json!({})),
        branch_body(&kb, &format!("SLOW {}", commit_msg(&kb, "r1")), json!({})),
    );
    let (sa, sb) = futures_util::join!(w.post(&body_a), w.post(&body_b));
    let (mut sa, mut sb) = (sa, sb);
    let (a, b) = futures_util::join!(finish_branch_run(&w, &mut sa, &ka), finish_branch_run(&w, &mut sb, &kb));
    let ((ra, _), (rb, _)) = (a, b);
    assert!(!sa.waited() && !sb.waited(), "different keys never wait for each other");
    let last_accepted = sa.at("accepted").max(sb.at("accepted"));
    let first_final = sa.at("final").min(sb.at("final"));
    assert!(last_accepted < first_final, "both accepted ({:.1} s, {:.1} s) before either finished ({:.1} s, {:.1} s)",
        (sa.at("accepted") - t1).as_secs_f64(), (sb.at("accepted") - t1).as_secs_f64(), (sa.at("final") - t1).as_secs_f64(), (sb.at("final") - t1).as_secs_f64());
    for (k, r) in [(&ka, &ra), (&kb, &rb)] {
        assert_eq!((r["commitCount"].as_u64(), r["pushed"].as_bool()), (Some(1), Some(true)), "{r}");
        assert!(w.remote_has(&format!("sandbox/{k}")));
    }
    assert_eq!(w.api.prs().len(), 3, "one PR per key");
    eprintln!(
        "{test}: two keys: accepted at {:.1} s / {:.1} s, final at {:.1} s / {:.1} s; total {:.1} s",
        (sa.at("accepted") - t1).as_secs_f64(), (sb.at("accepted") - t1).as_secs_f64(), (sa.at("final") - t1).as_secs_f64(), (sb.at("final") - t1).as_secs_f64(), t0.elapsed().as_secs_f64()
    );
    no_run_in_flight(&w.app).await;
    w.stop().await;
}

/// Runs whose agent does not commit: on a fresh key `commitCount: 0`, nothing pushed, no branch on
/// the remote, no API call; on a key that already has a relayed commit, the count stays, nothing new
/// is pushed (the remote branch is unchanged) and no PR is created or updated.
#[actix_rt::test]
async fn docker_api_run_without_commits_pushes_nothing() {
    let test = "docker_api_run_without_commits_pushes_nothing";
    let Some(w) = ApiWorld::start(test).await else { return };
    let key = unique_key("idle");
    let branch = format!("sandbox/{key}");
    let mut sse = w.post(&branch_body(&key, "Just say hello, change nothing.", json!({}))).await;
    let (relay, doc) = finish_branch_run(&w, &mut sse, &key).await;
    eprintln!("{test}: relay event without commits: {}", serde_json::to_string(&relay).unwrap());
    assert!(doc["content"].as_str().unwrap_or_default().starts_with("Reply to:"), "a plain answer: {doc}");
    assert_eq!(relay, json!({"branch": branch, "commitCount": 0, "pushed": false, "pushedCommits": 0}));
    assert!(!w.remote_has(&branch), "nothing pushed");
    assert!(w.api.calls().is_empty(), "no PR call");
    assert_eq!(w.ctr_git(&key, &["rev-list", "--count", "main..HEAD"]), "0", "the worktree exists, without commits");

    // a commit, then again a run without one
    let mut sse = w.post(&branch_body(&key, &commit_msg(&key, "once"), json!({}))).await;
    let (relay, _) = finish_branch_run(&w, &mut sse, &key).await;
    assert_eq!((relay["commitCount"].as_u64(), relay["pushed"].as_bool()), (Some(1), Some(true)), "{relay}");
    let head = w.remote(&["rev-parse", &branch]);
    let calls = w.api.calls().len();
    let mut sse = w.post(&branch_body(&key, "Nothing to do this time.", json!({}))).await;
    let (relay, _) = finish_branch_run(&w, &mut sse, &key).await;
    eprintln!("{test}: relay event of a later run without commits: {}", serde_json::to_string(&relay).unwrap());
    assert!(relay.get("error").is_none(), "{relay}");
    assert_eq!((relay["commitCount"].as_u64(), relay["pushedCommits"].as_u64(), relay["pushed"].as_bool()), (Some(1), Some(0), Some(false)), "this run pushed nothing: {relay}");
    assert_eq!(relay["remoteHead"].as_str(), Some(head.as_str()), "{relay}");
    assert_eq!(w.remote(&["rev-parse", &branch]), head, "no new push");
    let later: Vec<String> = w.api.methods().into_iter().skip(calls).collect();
    assert!(later.iter().all(|m| m == "GET"), "the PR is only looked up, never created or updated: {later:?}");
    assert_eq!(w.api.prs().len(), 1);
    w.stop().await;
}

/// The GitHub token (random, configured as `CLAWMUX_GITHUB_TOKEN` would be) is used (the fake API
/// sees it as a bearer token) and appears nowhere else: no SSE event, no run document, not in the
/// gateway container (`docker inspect`, PID 1's environment, any file), not in the LLM traffic, and
/// in no log line of clawmux (every tracing line at debug is captured).
#[actix_rt::test]
async fn docker_api_github_token_is_nowhere() {
    let test = "docker_api_github_token_is_nowhere";
    let Some(w) = ApiWorld::start(test).await else { return };
    let key = unique_key("secret");
    let mut sse = w.post(&branch_body(&key, &commit_msg(&key, "t1"), json!({"prTitle": "token test"}))).await;
    let (relay, doc) = finish_branch_run(&w, &mut sse, &key).await;
    assert_eq!(relay["pushed"], true, "{relay}");
    let run_id = doc["runId"].as_str().unwrap().to_owned();
    // and a re-attach, JSON mode
    let replay = w.http.get(format!("{}/v1/runs/{run_id}/events", w.base)).send().await.unwrap().text().await.unwrap();
    let (status, doc2) = common::post_json(&w.http, &w.base, &branch_body(&key, &commit_msg(&key, "t2"), json!({}))).await;
    assert_eq!(status, 200, "{doc2}");
    assert_eq!(doc2["relay"]["pushed"], true, "{doc2}");

    let calls = w.api.calls();
    assert!(!calls.is_empty());
    for c in &calls {
        assert_eq!(c.auth.as_deref(), Some(format!("Bearer {}", w.token).as_str()), "the API gets the token as a bearer token");
    }
    let t = &w.token;
    assert!(!sse.raw.contains(t), "token in the SSE stream");
    assert!(!replay.contains(t), "token in the replayed SSE stream");
    assert!(!doc.to_string().contains(t) && !doc2.to_string().contains(t), "token in a run document");
    assert!(!w.get_doc(&run_id).await.to_string().contains(t));
    let inspect = sh(Command::new("docker").args(["inspect", &w.ctr]));
    assert!(!inspect.contains(t), "token in docker inspect of the gateway container");
    // every process's environment (PID 1 and the gateway's node), read as the container's user
    let environ = sh(Command::new("docker").args(["exec", &w.ctr, "sh", "-c", "for p in /proc/[0-9]*; do cat $p/environ 2>/dev/null; echo; done"]));
    assert!(environ.contains("OPENCLAW_STATE_DIR"), "the environments were read");
    assert!(!environ.contains(t), "token in a container process's environment");
    let grep = Command::new("docker")
        .args(["exec", "-u", "0", &w.ctr, "timeout", "60", "grep", "-rIl", "--exclude-dir=proc", "--exclude-dir=sys", "--exclude-dir=dev", "--exclude-dir=opt", "-e", t, "/"])
        .output()
        .unwrap();
    assert_eq!(grep.status.code(), Some(1), "token found in container files: {}", String::from_utf8_lossy(&grep.stdout));
    let llm = std::fs::read_to_string(&w.llm_log).unwrap_or_default();
    assert!(!llm.contains(t), "token in the LLM traffic");
    let l = logs();
    assert!(l.contains("relay finished") && l.contains(&key), "the relay's log lines are captured");
    assert!(!l.contains(t), "token in a clawmux log line");
    w.stop().await;
}

/// Hostile branch keys are `400 invalid_request` through the API while the relay is configured,
/// whichever field carries them, and nothing reaches the container; a valid key gets past
/// validation (here to `503`: the gateway of this test is down). Needs Docker only (a plain
/// container stands in for the gateway container: the relay connects to it at startup).
#[actix_rt::test]
async fn docker_api_hostile_branch_keys_are_refused() {
    let test = "docker_api_hostile_branch_keys_are_refused";
    if !docker_or_skip(test) {
        return;
    }
    let w = World::new("hostile").await;
    let before = w.ctr.sh("find /workspace | sort");
    let (ctr, origin) = (w.ctr.id.clone(), w.origin.to_string_lossy().into_owned());
    // no gateway: validation comes first
    let app = common::start_clawmux("ws://127.0.0.1:9", None, move |c| {
        c.relay_container = Some(ctr);
        c.relay_remote_url = Some(origin);
        c.github_api_url = String::new(); // push only: a path remote names no owner/repo
    })
    .await;
    assert!(app.state.relay);
    let base = common::base(&app);
    let http = reqwest::Client::new();
    let long = "k".repeat(300);
    let hostile = ["x.lock/y", "x/y.lock/z", "../x", "-f", "a..b", "x.lock", "with space", long.as_str(), "main", "MAIN", "master", "HEAD", "/abs", "x/", "a//b", ".hidden", "x/.y", "a:b", "a~1", "a^b", "x\ny", "", "$(id)", "`id`", "a;b", "--upload-pack=touch /tmp/pwned"];
    for key in hostile {
        for field in ["workItemId", "branchName"] {
            let body = json!({"message": "m", "billingAccountId": "acct", "branch": {field: key}});
            let r = http.post(format!("{base}/v1/runs")).json(&body).send().await.unwrap();
            let status = r.status().as_u16();
            let v: Value = r.json().await.unwrap_or(Value::Null);
            assert_eq!((status, v["error"]["code"].as_str()), (400, Some("invalid_request")), "{field}={key:?}: {v}");
            assert!(v["error"]["message"].as_str().unwrap_or_default().contains(&format!("branch.{field}")), "names the field: {v}");
        }
    }
    // through the state key (opt-in): a valid stateKey that is not a valid branch key
    for state_key in ["a..b", "x.lock", "a:b", "main"] {
        let body = json!({"message": "m", "billingAccountId": "acct", "stateKey": state_key, "branch": {"useStateKey": true}});
        let r = http.post(format!("{base}/v1/runs")).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 400, "stateKey {state_key:?}");
    }
    // a hostile base ref
    for base_ref in ["--upload-pack=x", "../main", "a..b", "HEAD"] {
        let body = json!({"message": "m", "billingAccountId": "acct", "branch": {"workItemId": "fine", "baseRef": base_ref}});
        let r = http.post(format!("{base}/v1/runs")).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 400, "baseRef {base_ref:?}");
    }
    // the key equal to the base ref asked for is protected too
    let body = json!({"message": "m", "billingAccountId": "acct", "branch": {"workItemId": "develop", "baseRef": "develop"}});
    assert_eq!(http.post(format!("{base}/v1/runs")).json(&body).send().await.unwrap().status(), 400);
    // a good key passes validation (the gateway is down here: 503, not 400)
    let body = json!({"message": "m", "billingAccountId": "acct", "branch": {"workItemId": "task.0022"}});
    let r = http.post(format!("{base}/v1/runs")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 503, "{:?}", r.text().await);
    assert_eq!(w.ctr.sh("find /workspace | sort"), before, "nothing was prepared in the container");
    let q = clawmux::store::ListQuery { limit: 10, ..Default::default() };
    assert!(app.state.store.list(&q).await.unwrap().0.is_empty(), "no run was created");
    app.server.stop(true).await;
}

/// A caller's mistakes the repositories show before the run are `422`, not a run that fails later:
/// an unknown `baseRef` (`unknown_base_ref`), a key whose branch cannot exist next to a branch of
/// the container's repository or of the remote (`branch_conflict`: `a/b` when `a` exists and the
/// reverse). Each names the field; nothing is created and no run is kept. Keys that pass go on to
/// admission (here `503`: the gateway of this test is down). Needs Docker only.
#[actix_rt::test]
async fn docker_api_caller_mistakes_are_422_before_the_run() {
    let test = "docker_api_caller_mistakes_are_422_before_the_run";
    if !docker_or_skip(test) {
        return;
    }
    let w = World::new("mistakes").await;
    w.ctr.sh("git -C /workspace/repo branch sandbox/taken main && git -C /workspace/repo branch sandbox/deep/x main");
    sh(git(&w.seed).arg("push").arg("-q").arg(&w.origin).arg("main:refs/heads/sandbox/far/x"));
    let before = w.ctr.sh("find /workspace -not -path '*/logs/*' | sort; git -C /workspace/repo for-each-ref");
    let remote_before = w.remote(&["for-each-ref"]);
    let (ctr, origin) = (w.ctr.id.clone(), w.origin.to_string_lossy().into_owned());
    let app = common::start_clawmux("ws://127.0.0.1:9", None, move |c| {
        c.relay_container = Some(ctr);
        c.relay_remote_url = Some(origin);
        c.github_api_url = String::new();
    })
    .await;
    let base = common::base(&app);
    let http = reqwest::Client::new();
    let cases = [
        (json!({"workItemId": "fine", "baseRef": "nope"}), 422, "unknown_base_ref", "field `branch.baseRef`: base ref \"nope\" not found"),
        (json!({"workItemId": "taken/x"}), 422, "branch_conflict", "field `branch.workItemId`: sandbox/taken/x cannot be created: sandbox/taken exists in the container's repository"),
        (json!({"branchName": "deep"}), 422, "branch_conflict", "field `branch.branchName`: sandbox/deep cannot be created: sandbox/deep/… exists in the container's repository"),
        (json!({"branchName": "far"}), 422, "branch_conflict", "field `branch.branchName`: sandbox/far cannot be created: sandbox/far/… exists on the remote"),
        (json!({"workItemId": "far/x/y"}), 422, "branch_conflict", "field `branch.workItemId`: sandbox/far/x/y cannot be created: sandbox/far/x exists on the remote"),
        (json!({"workItemId": "taken"}), 503, "gateway_unavailable", ""),
        (json!({"workItemId": "fine", "baseRef": "main"}), 503, "gateway_unavailable", ""),
    ];
    for (branch, status, code, says) in cases {
        let body = json!({"message": "m", "billingAccountId": "acct", "branch": branch});
        let r = http.post(format!("{base}/v1/runs")).json(&body).send().await.unwrap();
        let got = r.status().as_u16();
        let v: Value = r.json().await.unwrap_or(Value::Null);
        assert_eq!((got, v["error"]["code"].as_str()), (status, Some(code)), "{body}: {v}");
        assert!(v["error"]["message"].as_str().unwrap_or_default().starts_with(says), "{body}: {v}");
        if status == 422 {
            assert!(v["error"]["message"].as_str().unwrap_or_default().len() > says.len(), "says what to do: {v}");
        }
    }
    assert_eq!(w.ctr.sh("find /workspace -not -path '*/logs/*' | sort; git -C /workspace/repo for-each-ref"), before, "nothing was created in the container");
    assert_eq!(w.remote(&["for-each-ref"]), remote_before, "nor on the remote");
    let q = clawmux::store::ListQuery { limit: 10, ..Default::default() };
    assert!(app.state.store.list(&q).await.unwrap().0.is_empty(), "no run was kept");
    app.server.stop(true).await;
}

/// The clawmux BINARY (`clawmux serve`), configured only through its environment as in production
/// (`CLAWMUX_RELAY_CONTAINER`, `CLAWMUX_RELAY_REMOTE_URL`, `CLAWMUX_GITHUB_API_URL`,
/// `CLAWMUX_GITHUB_TOKEN`, `CLAWMUX_LOG=debug`, and its other secrets: `CLAWMUX_API_TOKEN`,
/// `CLAWMUX_LLM_UPSTREAM_KEY`, `CLAWMUX_WEBHOOK_SECRET`): a branch run is relayed and its PR
/// created with the token, and the token is in none of its stderr; `clawmux doctor` shows it
/// redacted. Every host git call it makes (recorded by a `git` first on its `PATH`) gets an
/// environment of the relay's own: no variable of clawmux's but `PATH`, none of its secrets.
#[actix_rt::test]
async fn docker_api_binary_keeps_the_github_token_out_of_its_logs() {
    let test = "docker_api_binary_keeps_the_github_token_out_of_its_logs";
    if !docker_or_skip(test) {
        return;
    }
    let Some(env) = api_gateway_env(test) else { return };
    let get = |k: &str| env.get(k).unwrap_or_else(|| panic!("gateway env lacks {k}")).clone();
    let (_links, remote_url) = github_like_remote(Path::new(&get("ORIGIN")));
    let api = FakeGithub::start().await;
    let token = format!("ghp_bin_{}", uuid::Uuid::new_v4().simple());
    let dir = tempfile::Builder::new().prefix("clawmux-api-bin-").tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let stderr_path = dir.path().join("clawmux.stderr");
    let (git_bin, git_log) = recording_git(dir.path());
    let api_token = format!("api-{}", uuid::Uuid::new_v4().simple());
    let secrets = [
        ("CLAWMUX_API_TOKEN", api_token.clone()),
        ("CLAWMUX_LLM_UPSTREAM_KEY", format!("llm-{}", uuid::Uuid::new_v4().simple())),
        ("CLAWMUX_WEBHOOK_SECRET", format!("whs-{}", uuid::Uuid::new_v4().simple())),
        ("CLAWMUX_GATEWAY_TOKEN", get("GATEWAY_TOKEN")),
        ("CLAWMUX_GITHUB_TOKEN", token.clone()),
    ];
    let command = |args: &[&str]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_clawmux"));
        c.args(args)
            .env_clear()
            .env("PATH", format!("{}:{}", git_bin.display(), std::env::var("PATH").unwrap_or_default()))
            .env("HOME", dir.path())
            .env("CLAWMUX_LISTEN", format!("127.0.0.1:{port}"))
            .env("CLAWMUX_GATEWAY_URL", get("GATEWAY_URL"))
            .env("CLAWMUX_GATEWAY_TOKEN", get("GATEWAY_TOKEN"))
            .env("CLAWMUX_DEVICE_KEY_FILE", dir.path().join("device-key.json"))
            .env("CLAWMUX_RELAY_CONTAINER", get("CONTAINER_NAME"))
            .env("CLAWMUX_RELAY_REMOTE_URL", &remote_url)
            .env("CLAWMUX_RELAY_WORKSPACE", get("WORKSPACE"))
            .env("CLAWMUX_GITHUB_API_URL", &api.base)
            .env("CLAWMUX_GITHUB_TOKEN", &token)
            .env("CLAWMUX_LOG", "debug");
        for (k, v) in &secrets {
            c.env(k, v);
        }
        if let Ok(h) = std::env::var("DOCKER_HOST") {
            c.env("DOCKER_HOST", h);
        }
        c
    };
    let mut child = command(&["serve"]).stdout(std::process::Stdio::null()).stderr(std::fs::File::create(&stderr_path).unwrap()).spawn().expect("clawmux serve starts");
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let pid = child.id();
    let started = Instant::now();
    let mut auth = reqwest::header::HeaderMap::new();
    auth.insert(reqwest::header::AUTHORIZATION, format!("Bearer {api_token}").parse().unwrap());
    let http = reqwest::Client::builder().default_headers(auth).build().unwrap();
    let base = format!("http://127.0.0.1:{port}");
    loop {
        if let Ok(r) = http.get(format!("{base}/readyz")).send().await {
            if r.status() == 200 {
                break;
            }
        }
        if let Some(st) = child.try_wait().unwrap() {
            panic!("clawmux exited ({st}): {}", std::fs::read_to_string(&stderr_path).unwrap_or_default());
        }
        assert!(started.elapsed() < Duration::from_secs(60), "clawmux not ready: {}", std::fs::read_to_string(&stderr_path).unwrap_or_default());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let child = Kill(child);

    let key = unique_key("bin");
    let body = branch_body(&key, &commit_msg(&key, "b1"), json!({"prTitle": "from the binary"}));
    let (status, doc) = common::post_json(&http, &base, &body).await;
    assert_eq!(status, 200, "{doc}");
    assert_eq!(doc["status"], "ok", "{doc}");
    let relay = &doc["relay"];
    assert_eq!((relay["pushed"].as_bool(), relay["commitCount"].as_u64(), relay["prNumber"].as_u64()), (Some(true), Some(1), Some(1)), "{doc}");
    assert_eq!(api.methods(), ["GET", "POST"]);
    for c in api.calls() {
        assert_eq!(c.auth.as_deref(), Some(format!("Bearer {token}").as_str()), "the token from CLAWMUX_GITHUB_TOKEN reaches the API");
    }
    assert!(!doc.to_string().contains(&token));

    // every host git call: only the relay's own environment
    let calls = recorded_git_calls(&git_log);
    let own: Vec<_> = calls.iter().filter(|(argv, _)| argv.first().map(String::as_str) == Some("-c") && argv.get(1).map(String::as_str) == Some("credential.helper=")).collect();
    assert!(own.len() >= 5 && own.iter().any(|(a, _)| a.contains(&"clone".to_owned())) && own.iter().any(|(a, _)| a.contains(&"push".to_owned())), "the relay's host git calls were recorded: {:?}", calls.iter().map(|c| &c.0).collect::<Vec<_>>());
    let allowed = ["PATH", "HOME", "LC_ALL", "GIT_TERMINAL_PROMPT", "GIT_CONFIG_NOSYSTEM", "GIT_CONFIG_GLOBAL", "GIT_ATTR_NOSYSTEM"];
    for (argv, env) in &own {
        let keys: Vec<&str> = env.keys().map(String::as_str).collect();
        assert!(keys.iter().all(|k| allowed.contains(k)), "host git {argv:?} got {keys:?}");
        assert!(env.get("HOME").is_some_and(|h| h.contains("clawmux-relay-") && !h.starts_with(&dir.path().display().to_string())), "a HOME of the relay's own: {env:?}");
        assert_eq!((env.get("GIT_TERMINAL_PROMPT").map(String::as_str), env.get("GIT_CONFIG_NOSYSTEM").map(String::as_str)), (Some("0"), Some("1")));
    }
    for (argv, env) in &calls {
        for (k, v) in env {
            assert!(!secrets.iter().any(|(_, s)| v.contains(s.as_str())), "host git {argv:?} got a secret of clawmux's in {k}");
        }
    }
    let shown: Vec<String> = own[0].1.iter().map(|(k, v)| format!("{k}={v}")).collect();
    eprintln!("{test}: {} host git calls; the environment of one ({:?}):\n  {}", own.len(), own[0].0.iter().rev().take(3).collect::<Vec<_>>(), shown.join("\n  "));

    // a clean stop (SIGTERM), then the whole stderr
    sh(Command::new("kill").args(["-TERM", &pid.to_string()]));
    let mut child = child;
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.0.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "clawmux did not stop on SIGTERM");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stderr = std::fs::read_to_string(&stderr_path).unwrap();
    assert!(stderr.contains("git relay ready") && stderr.contains("relay finished") && stderr.contains("DEBUG"), "debug logs were written:\n{stderr}");
    assert!(!stderr.contains(&token), "token in clawmux's stderr");
    eprintln!("{test}: {} log lines at debug, none with the token", stderr.lines().count());

    // doctor prints the effective configuration: the token redacted
    let out = command(&["doctor"]).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("CLAWMUX_GITHUB_TOKEN"), "{text}");
    assert!(!text.contains(&token), "token in doctor's output:\n{text}");
}

/// Runs waiting for a busy key: one whose timeout runs out while it waits ends `timeout`, one
/// aborted through the API while it waits ends `aborted`; neither reaches the gateway (the LLM never
/// sees them), the holder finishes and relays normally, and the key is free afterwards.
#[actix_rt::test]
async fn docker_api_waiting_runs_time_out_or_abort_without_reaching_the_gateway() {
    let test = "docker_api_waiting_runs_time_out_or_abort_without_reaching_the_gateway";
    let Some(w) = ApiWorld::start(test).await else { return };
    let key = unique_key("wait");
    let mut holder = w.post(&branch_body(&key, &format!("SLOW {}", commit_msg(&key, "h1")), json!({}))).await;
    holder.until(Duration::from_secs(60), |e| e.event == "accepted").await.unwrap_or_else(|| panic!("holder accepted: {:?}", holder.names()));
    let t0 = Instant::now();
    let mut short = w.post(&json!({"message": commit_msg(&key, "w1"), "billingAccountId": "acct-relay-api", "timeoutSec": 1, "branch": {"workItemId": key}})).await;
    let abort_id = format!("run-{key}-aborted");
    let mut aborted = w.post(&json!({"message": commit_msg(&key, "w2"), "billingAccountId": "acct-relay-api", "runId": abort_id, "branch": {"workItemId": key}})).await;
    aborted.until(Duration::from_secs(20), |e| e.event == "status").await.expect("waiting");
    let r = w.http.post(format!("{}/v1/runs/{abort_id}/abort", w.base)).send().await.unwrap();
    assert_eq!(r.status(), 202);
    assert_eq!(r.json::<Value>().await.unwrap()["aborted"], true);
    let ta = aborted.read_to_terminal(Duration::from_secs(10)).await;
    assert_eq!((ta.event.as_str(), ta.data["code"].as_str()), ("error", Some("aborted")), "{}", ta.data);
    let te = short.read_to_terminal(Duration::from_secs(20)).await;
    assert_eq!((te.event.as_str(), te.data["code"].as_str()), ("error", Some("timeout")), "{}", te.data);
    assert!(te.data["message"].as_str().unwrap_or_default().contains("waiting for branch"), "{}", te.data);
    // By the run's own record (admitted → ended), not this test's clock, which also counts the
    // POSTs and the abort above on a possibly busy machine.
    let doc = w.get_doc(te.data["runId"].as_str().expect("the run id in its error event")).await;
    let took = common::doc_time(&doc, "finishedAt") - common::doc_time(&doc, "createdAt");
    assert!(took < time::Duration::seconds(3), "the wait counted toward the 1 s timeout: ended {took} after its admission");
    assert!(t0.elapsed() < Duration::from_secs(60));
    assert!(short.waited() && aborted.waited());
    for sse in [&short, &aborted] {
        assert!(!sse.names().iter().any(|n| n == "accepted" || n == "relay"), "never started: {:?}", sse.names());
    }
    assert!(holder.events.iter().all(|(_, e)| e.event != "final"), "both ended while the holder still ran");
    let (relay, _) = finish_branch_run(&w, &mut holder, &key).await;
    assert_eq!((relay["commitCount"].as_u64(), relay["pushed"].as_bool()), (Some(1), Some(true)), "{relay}");
    let llm = std::fs::read_to_string(&w.llm_log).unwrap_or_default();
    assert!(llm.contains(&format!("{key}:h1")), "the holder's run reached the LLM");
    assert!(!llm.contains(&format!("{key}:w1")) && !llm.contains(&format!("{key}:w2")), "the waiting runs never reached the gateway");
    // the key is free: the next run goes at once
    let mut next = w.post(&branch_body(&key, &commit_msg(&key, "n1"), json!({}))).await;
    let (relay, _) = finish_branch_run(&w, &mut next, &key).await;
    assert!(!next.waited());
    assert_eq!((relay["commitCount"].as_u64(), relay["pushedCommits"].as_u64()), (Some(2), Some(1)), "{relay}");
    no_run_in_flight(&w.app).await;
    w.stop().await;
}

/// Mistakes the relay can only find when the run prepares (the repository changed after the
/// `POST` checked it) end the run `relay_rejected`, not `internal`, before it reaches the gateway:
/// its base ref deleted while it queued, a branch that blocks its key created meanwhile.
#[actix_rt::test]
async fn docker_api_mistakes_found_when_preparing_end_relay_rejected() {
    let test = "docker_api_mistakes_found_when_preparing_end_relay_rejected";
    let Some(w) = ApiWorld::start(test).await else { return };
    let tag = unique_key("late");
    let state_key = format!("{tag}-s");
    let base_ref = format!("{tag}-base");
    let (k1, k2) = (format!("{tag}-1"), format!("{tag}-2/x"));
    sh(Command::new("docker").args(["exec", &w.ctr, "git", "-C", "/workspace/repo", "branch", &base_ref, "main"]));
    // a plain run holds the session key; the branch runs queue behind it, checked and admitted
    let mut holder = w.post(&json!({"message": "SLOW hold the session", "billingAccountId": "acct-relay-api", "stateKey": state_key, "runId": format!("{tag}-holder")})).await;
    holder.until(Duration::from_secs(60), |e| e.event == "accepted").await.unwrap_or_else(|| panic!("holder accepted: {:?}", holder.names()));
    let run = |key: &str, extra: Value| {
        let mut b = json!({"workItemId": key});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        json!({"message": commit_msg(key, "never"), "billingAccountId": "acct-relay-api", "stateKey": state_key, "timeoutSec": 120, "branch": b})
    };
    let mut r1 = w.post(&run(&k1, json!({"baseRef": base_ref}))).await;
    let mut r2 = w.post(&run(&k2, json!({}))).await;
    // meanwhile: the base ref is deleted, a branch blocking k2 is created
    sh(Command::new("docker").args(["exec", &w.ctr, "git", "-C", "/workspace/repo", "branch", "-D", &base_ref]));
    sh(Command::new("docker").args(["exec", &w.ctr, "git", "-C", "/workspace/repo", "branch", &format!("sandbox/{tag}-2"), "main"]));
    let r = w.http.post(format!("{}/v1/runs/{tag}-holder/abort", w.base)).send().await.unwrap();
    assert_eq!(r.status(), 202);
    for (sse, says) in [(&mut r1, format!("base ref \"{base_ref}\" not found")), (&mut r2, format!("sandbox/{tag}-2 exists in the container's repository"))] {
        let t = sse.read_to_terminal(Duration::from_secs(60)).await;
        eprintln!("{test}: {}", t.data);
        assert_eq!((t.event.as_str(), t.data["code"].as_str()), ("error", Some("relay_rejected")), "{}", t.data);
        assert!(t.data["message"].as_str().unwrap_or_default().contains(&says), "{}", t.data);
        assert!(!sse.names().iter().any(|n| n == "accepted" || n == "relay"), "never reached the gateway: {:?}", sse.names());
    }
    let llm = std::fs::read_to_string(&w.llm_log).unwrap_or_default();
    assert!(!llm.contains(&format!("{k1}:never")) && !llm.contains(&format!("{k2}:never")), "the rejected runs never reached the LLM");
    no_run_in_flight(&w.app).await;
    w.stop().await;
}

/// Every run (and its locks) leaves the registry, bounded: a run's actor leaves it right after
/// its terminal event reached the clients, not before (seen under load: a client had the end of
/// an aborted run while its actor was still on its way out).
async fn no_run_in_flight(app: &clawmux::server::Running) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = app.state.registry.send(clawmux_actors::messages::InFlight).await.unwrap();
        if n == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "{n} runs still in the registry 10 s after their ends");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
