//! Store faults, against the `clawmux serve` binary (a child process) and a replay gateway:
//! - a read-only store file, a corrupt one (garbage; a real store truncated): startup stops with
//!   ONE line naming the file, no panic;
//! - a full disk (the store on a small tmpfs the test fills up while runs stream): no panic, no run
//!   silently lost (a run whose events cannot be stored ends `internal` and says why), clawmux
//!   keeps serving; the end is stored once there is room again, and a restart before that ends the
//!   run the same way (never continues it: no client sees a second, different end).
//!
//! A read-only file is made with a read-only bind mount when the test runs as root (root writes a
//! mode-0444 file), with file modes otherwise. The full disk needs a tmpfs mount, so root. Without
//! root (or without the right to mount) these tests print a skip line and pass, unless
//! `CLAWMUX_REQUIRE_MOUNTS=1` (tests/run.sh sets it), where they fail. Every mount is unmounted by
//! the test that made it.

#![allow(clippy::unwrap_used)]

mod common;

use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway, ReplayHandle};
use common::{temp_dir, SseEvent, SseReader};
use serde_json::{json, Value};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tokio::time::Instant;

const GW_TOKEN: &str = "store-faults-gw-token";

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(2) == Some("0")))
        .unwrap_or(false)
}

/// Whether a test that needs `why` may be skipped here.
fn skip_without(test: &str, why: &str) -> bool {
    if std::env::var("CLAWMUX_REQUIRE_MOUNTS").is_ok_and(|v| v == "1") {
        panic!("{test}: CLAWMUX_REQUIRE_MOUNTS=1 but {why}");
    }
    eprintln!("SKIP {test}: {why}");
    true
}

/// A mount this test made; unmounted on drop.
struct Mount(PathBuf);

impl Mount {
    fn run(args: &[&str]) -> Result<(), String> {
        let out = Command::new(args[0]).args(&args[1..]).output().map_err(|e| format!("{}: {e}", args[0]))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!("{args:?}: {}", String::from_utf8_lossy(&out.stderr).trim()))
        }
    }

    /// A tmpfs of `size` (e.g. `8m`) on `dir`.
    fn tmpfs(dir: &Path, size: &str) -> Result<Self, String> {
        let d = dir.to_str().unwrap();
        Self::run(&["mount", "-t", "tmpfs", "-o", &format!("size={size},mode=0700"), "clawmux-store-test", d])?;
        Ok(Self(dir.to_owned()))
    }

    /// `dir` again, read-only, over itself.
    fn read_only(dir: &Path) -> Result<Self, String> {
        let d = dir.to_str().unwrap();
        Self::run(&["mount", "--bind", d, d])?;
        let m = Self(dir.to_owned());
        Self::run(&["mount", "-o", "remount,bind,ro", d])?;
        Ok(m)
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let d = self.0.to_str().unwrap();
        if Self::run(&["umount", d]).is_err() {
            // Something still holds a file there (a child that did not exit yet): detach it now,
            // the kernel frees it when the last file closes.
            let _ = Self::run(&["umount", "-l", d]);
        }
    }
}

use common::free_port;

/// `clawmux serve` as a child process on a store file.
struct Clawmux {
    child: Option<Child>,
    base: String,
    dir: PathBuf,
    env: Vec<(String, String)>,
    starts: usize,
}

impl Clawmux {
    fn new(gateway_url: &str, store: &Path) -> Self {
        let dir = temp_dir("store-faults");
        let port = free_port();
        let env = vec![
            ("CLAWMUX_GATEWAY_URL".to_owned(), gateway_url.to_owned()),
            ("CLAWMUX_GATEWAY_TOKEN".to_owned(), GW_TOKEN.to_owned()),
            ("CLAWMUX_LISTEN".to_owned(), format!("127.0.0.1:{port}")),
            ("CLAWMUX_STORE_URL".to_owned(), format!("sqlite://{}", store.display())),
            ("CLAWMUX_DEVICE_IDENTITY".to_owned(), "off".to_owned()),
            ("HOME".to_owned(), dir.display().to_string()),
            ("CLAWMUX_LOG".to_owned(), "info".to_owned()),
        ];
        Self { child: None, base: format!("http://127.0.0.1:{port}"), dir, env, starts: 0 }
    }

    fn spawn(&mut self) {
        self.starts += 1;
        let log = std::fs::File::create(self.log_path()).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_clawmux"))
            .arg("serve")
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join(format!("clawmux-{}.log", self.starts))
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    async fn start(&mut self, http: &reqwest::Client) {
        self.spawn();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = http.get(format!("{}/readyz", self.base)).send().await {
                if r.status() == 200 {
                    return;
                }
            }
            let exited = self.child.as_mut().unwrap().try_wait().unwrap();
            assert!(exited.is_none(), "clawmux exited ({exited:?}); log: {}", self.log());
            assert!(Instant::now() < deadline, "clawmux did not become ready; log: {}", self.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts it expecting it to refuse: its exit code and its stderr.
    fn start_expecting_failure(&mut self) -> (i32, String) {
        self.spawn();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut child = self.child.take().unwrap();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return (status.code().unwrap_or(-1), self.log());
            }
            if std::time::Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("clawmux started on a store it cannot use instead of stopping; log: {}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill_9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn sigterm(&mut self) {
        let mut c = self.child.take().unwrap();
        assert!(Command::new("kill").args(["-TERM", &c.id().to_string()]).status().unwrap().success());
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while c.try_wait().unwrap().is_none() {
            assert!(std::time::Instant::now() < deadline, "clawmux did not exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// No panic in any of its logs.
    fn assert_no_panic(&self) {
        for i in 1..=self.starts {
            let log = std::fs::read_to_string(self.dir.join(format!("clawmux-{i}.log"))).unwrap_or_default();
            assert!(!log.contains("panicked"), "clawmux panicked (start {i}): {log}");
        }
    }
}

impl Drop for Clawmux {
    fn drop(&mut self) {
        self.kill_9();
    }
}

/// The refusal is one line on stderr naming the file and saying `what`, and the process exits
/// non-zero without a panic.
fn assert_refused_in_one_line(code: i32, log: &str, store: &Path, what: &str) {
    assert_ne!(code, 0, "{log}");
    assert!(!log.contains("panicked"), "{log}");
    let last = log.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or_default();
    let expected = format!("clawmux: the run store {}", store.display());
    assert!(last.starts_with(&expected) && last.contains(what), "the last line should name the store and say {what:?}: {last:?}\n{log}");
    let mentions = log.lines().filter(|l| l.contains(&store.display().to_string())).count();
    assert_eq!(mentions, 1, "one line about the store, not {mentions}: {log}");
}

fn http() -> reqwest::Client {
    common::http_client(None)
}

/// Creates a store at `store` the way clawmux does (a command that opens it and exits).
fn create_store(store: &Path) {
    let out = Command::new(env!("CARGO_BIN_EXE_clawmux"))
        .args(["keys", "list"])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", store.parent().unwrap())
        .env("CLAWMUX_STORE_URL", format!("sqlite://{}", store.display()))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(store.exists());
}

/// Makes `path` (a file or a directory with everything in it) read-only for clawmux; `Err` when
/// this machine cannot. Undone on drop.
enum ReadOnly {
    Mount(#[allow(dead_code)] Mount),
    Modes(Vec<PathBuf>),
}

impl ReadOnly {
    fn make(path: &Path) -> Result<Self, String> {
        if is_root() {
            // Root writes a mode-0444 file: only a read-only mount stops it.
            return Mount::read_only(path).map(ReadOnly::Mount).map_err(|e| format!("running as root and cannot make a read-only bind mount: {e}"));
        }
        use std::os::unix::fs::PermissionsExt;
        let mut paths: Vec<PathBuf> = if path.is_dir() { std::fs::read_dir(path).unwrap().map(|e| e.unwrap().path()).collect() } else { Vec::new() };
        paths.push(path.to_owned());
        for p in &paths {
            let mode = if p.is_dir() { 0o555 } else { 0o444 };
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        Ok(ReadOnly::Modes(paths))
    }
}

impl Drop for ReadOnly {
    fn drop(&mut self) {
        use std::os::unix::fs::PermissionsExt;
        if let ReadOnly::Modes(paths) = self {
            for p in paths.iter() {
                let _ = std::fs::set_permissions(p, std::fs::Permissions::from_mode(if p.is_dir() { 0o755 } else { 0o644 }));
            }
        }
    }
}

#[test]
fn a_read_only_store_stops_startup_with_one_line_naming_the_file() {
    let test = "a_read_only_store_stops_startup_with_one_line_naming_the_file";
    // The store's directory read-only (nothing can be created next to it either), and the store
    // file alone (its journal and notes could be written: only a write to the store shows it).
    for whole_dir in [true, false] {
        let dir = temp_dir("store-ro");
        let store_dir = dir.join("state");
        std::fs::create_dir_all(&store_dir).unwrap();
        let store = store_dir.join("runs.db");
        create_store(&store);
        let _read_only = match ReadOnly::make(if whole_dir { &store_dir } else { &store }) {
            Ok(r) => r,
            Err(e) => {
                skip_without(test, &e);
                return;
            }
        };
        // The setup really made it unwritable (else this test would prove nothing).
        assert!(std::fs::OpenOptions::new().write(true).open(&store).is_err(), "the store is still writable");
        let mut app = Clawmux::new("ws://127.0.0.1:9", &store);
        let (code, log) = app.start_expecting_failure();
        assert_refused_in_one_line(code, &log, &store, "cannot be written");
    }
}

#[actix_rt::test]
async fn a_corrupt_store_stops_startup_with_one_line_naming_the_file() {
    let dir = temp_dir("store-corrupt");
    // Garbage.
    let garbage = dir.join("garbage.db");
    let mut bytes = Vec::with_capacity(256 * 1024);
    let mut x: u32 = 0x2545_f491;
    while bytes.len() < 256 * 1024 {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        bytes.extend_from_slice(&x.to_le_bytes());
    }
    std::fs::write(&garbage, &bytes).unwrap();
    let (code, log) = Clawmux::new("ws://127.0.0.1:9", &garbage).start_expecting_failure();
    assert_refused_in_one_line(code, &log, &garbage, "not a database");

    // A real store with finished runs, cut in half (a disk that lost its tail).
    let gw = ReplayGateway::start("127.0.0.1:0".parse().unwrap(), ReplayConfig::default().speed(0.0).token(GW_TOKEN)).unwrap();
    let store = dir.join("real.db");
    let http = http();
    let mut app = Clawmux::new(&gw.url(), &store);
    app.start(&http).await;
    for i in 0..30 {
        let r = http.post(format!("{}/v1/runs", app.base)).json(&json!({"message": format!("run {i}"), "billingAccountId": "acct"})).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.json::<Value>().await.unwrap()["status"], "ok");
    }
    app.sigterm();
    app.assert_no_panic();
    {
        let c = rusqlite::Connection::open(&store).unwrap();
        c.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())).unwrap();
    }
    for suffix in ["-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", store.display()));
    }
    let len = std::fs::metadata(&store).unwrap().len();
    assert!(len >= 64 * 1024, "the store is too small to cut: {len} bytes");
    std::fs::OpenOptions::new().write(true).open(&store).unwrap().set_len(len / 2).unwrap();
    let (code, log) = app.start_expecting_failure();
    assert_refused_in_one_line(code, &log, &store, "malformed");
}

// ------------------------------------------------------------------------------------------------
// A full disk
// ------------------------------------------------------------------------------------------------

/// The long recorded run (42 `chat` events over ~3.5 s), at half speed: ~7 s per run.
fn slow_gateway() -> ReplayHandle {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cassettes/openclaw-2026.9.6-long.jsonl")).unwrap();
    let cfg = ReplayConfig::new(Cassette::parse(&text).unwrap()).speed(0.5).token(GW_TOKEN);
    ReplayGateway::start("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
}

/// A store on a tmpfs of its own, and a file that fills it.
struct SmallDisk {
    store: PathBuf,
    filler: PathBuf,
    _mount: Mount,
}

impl SmallDisk {
    /// `None`: skipped (not root, or no right to mount).
    fn new(test: &str) -> Option<Self> {
        let dir = temp_dir("store-full").join("disk");
        std::fs::create_dir_all(&dir).unwrap();
        if !is_root() {
            skip_without(test, "a full disk needs a tmpfs mount (root)");
            return None;
        }
        let mount = match Mount::tmpfs(&dir, "8m") {
            Ok(m) => m,
            Err(e) => {
                skip_without(test, &format!("cannot mount a tmpfs: {e}"));
                return None;
            }
        };
        Some(Self { store: dir.join("runs.db"), filler: dir.join("filler"), _mount: mount })
    }

    /// Takes every free byte.
    fn fill(&self) {
        let mut f = std::fs::File::create(&self.filler).unwrap();
        let chunk = vec![0xa5u8; 16 * 1024];
        // Bounded by the tmpfs size (8 MiB = 512 chunks).
        for _ in 0..1024 {
            if f.write_all(&chunk).and_then(|()| f.flush()).is_err() {
                break;
            }
        }
        for _ in 0..4096 {
            if f.write_all(&[0xa5]).is_err() {
                return;
            }
        }
        panic!("the tmpfs did not fill up");
    }

    fn free(&self) {
        std::fs::remove_file(&self.filler).unwrap();
    }
}

/// What a client saw of one run (SSE, to its end or 60 s).
async fn watch(http: reqwest::Client, base: String, run_id: String) -> Vec<SseEvent> {
    let resp = http.get(format!("{base}/v1/runs/{run_id}/events")).header("accept", "text/event-stream").send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut sse = SseReader::new(resp);
    sse.terminal(Duration::from_secs(60)).await;
    sse.events
}

const N: usize = 40;

/// Starts `N` long runs, fills the disk while they stream, and returns what each client saw (each
/// checked: ids 1, 2, 3, … without gap, exactly one terminal event, last; `internal` ones say the
/// store is full). Returns (run id, events) and how many ended `internal`.
async fn fill_the_disk_while_runs_stream(disk: &SmallDisk, app: &Clawmux, http: &reqwest::Client, tag: &str) -> Vec<(String, Vec<SseEvent>)> {
    let mut ids = Vec::new();
    for i in 0..N {
        let body = json!({"message": format!("<{tag}-{i}> [track:long]"), "billingAccountId": "acct-full", "onDisconnect": "continue"});
        let r = http.post(format!("{}/v1/runs?wait=false", app.base)).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 202, "{:?}", r.text().await);
        ids.push(r.json::<Value>().await.unwrap()["runId"].as_str().unwrap().to_owned());
    }
    let watchers: Vec<_> = ids.iter().map(|id| tokio::spawn(watch(http.clone(), app.base.clone(), id.clone()))).collect();
    // Mid-stream: every run has text on its way, none finished.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v: Value = http.get(format!("{}/v1/runs?status=running&limit=500", app.base)).send().await.unwrap().json().await.unwrap();
        let streaming = v["runs"].as_array().unwrap().iter().filter(|r| r["gatewayRunId"].is_string()).count();
        if streaming == N {
            break;
        }
        assert!(Instant::now() < deadline, "runs did not start ({streaming} running): {}", app.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    disk.fill();
    let mut seen = Vec::new();
    for (id, w) in ids.into_iter().zip(watchers) {
        seen.push((id, w.await.unwrap()));
    }
    let mut internal = 0;
    for (id, events) in &seen {
        let got: Vec<u64> = events.iter().map(|e| e.id).collect();
        assert_eq!(got, (1..=got.len() as u64).collect::<Vec<_>>(), "{id}: event ids");
        let terminals: Vec<&SseEvent> = events.iter().filter(|e| e.event == "final" || e.event == "error").collect();
        assert_eq!(terminals.len(), 1, "{id}: {events:?}");
        let end = events.last().unwrap();
        assert!(end.event == "final" || end.event == "error", "{id}: the terminal event is not last: {events:?}");
        if end.event == "error" {
            assert_eq!(end.data["code"], "internal", "{id}: {end:?}");
            let message = end.data["message"].as_str().unwrap_or_default();
            assert!(message.contains("run store") && message.contains("full"), "{id}: the message does not say why: {message:?}");
            // The tenant is told why, never where: the operator's file path stays in the log.
            assert!(!message.contains("runs.db") && !message.contains(&*std::env::temp_dir().to_string_lossy()), "{id}: the message names the store's file: {message:?}");
            internal += 1;
        }
    }
    eprintln!("{tag}: {internal} of {N} runs ended `internal` on the full disk, the others `final`");
    // The disk filled up in the middle of the runs: most of them could not be stored.
    assert!(internal >= N / 2, "only {internal} of {N} runs ran into the full disk: {}", app.log());
    seen
}

fn internal_ends(seen: &[(String, Vec<SseEvent>)]) -> Vec<(&String, &Vec<SseEvent>)> {
    seen.iter().filter(|(_, ev)| ev.last().is_some_and(|e| e.event == "error")).map(|(id, ev)| (id, ev)).collect()
}

/// The store has exactly what each client saw, and ends each run the way its client saw it end.
async fn assert_store_matches_what_clients_saw(http: &reqwest::Client, base: &str, seen: &[(String, Vec<SseEvent>)]) {
    for (id, events) in seen {
        let end = events.last().unwrap();
        let doc: Value = http.get(format!("{base}/v1/runs/{id}")).send().await.unwrap().json().await.unwrap();
        if end.event == "error" {
            assert_eq!((doc["status"].as_str(), doc["error"]["code"].as_str()), (Some("error"), Some("internal")), "{id}: {doc}");
        } else {
            assert_eq!(doc["status"], "ok", "{id}: {doc}");
        }
        // From the start: the same events, the same end, the same ids.
        let replay = watch(http.clone(), base.to_owned(), id.clone()).await;
        let ids = |v: &[SseEvent]| v.iter().map(|e| (e.id, e.event.clone())).collect::<Vec<_>>();
        assert_eq!(ids(&replay), ids(events), "{id}: the store disagrees with what the client saw");
        assert_eq!(replay.last().unwrap().data["code"], end.data["code"], "{id}");
        // After the end a client saw: nothing more, ever (no second terminal event).
        let after = http
            .get(format!("{base}/v1/runs/{id}/events"))
            .header("accept", "text/event-stream")
            .header("last-event-id", end.id.to_string())
            .send()
            .await
            .unwrap();
        let mut sse = SseReader::new(after);
        assert!(sse.until(Duration::from_secs(5), |_| true).await.is_none(), "{id}: more after its end: {:?}", sse.events);
    }
}

#[actix_rt::test]
async fn a_full_disk_ends_runs_internal_and_once_there_is_room_stores_those_ends_and_serves_again() {
    let Some(disk) = SmallDisk::new("a_full_disk_ends_runs_internal_and_once_there_is_room_stores_those_ends_and_serves_again") else { return };
    let gw = slow_gateway();
    let http = http();
    let mut app = Clawmux::new(&gw.url(), &disk.store);
    app.start(&http).await;
    let seen = fill_the_disk_while_runs_stream(&disk, &app, &http, "room").await;
    // Still serving: alive, connected, and a new run is refused with the reason, not lost.
    assert_eq!(http.get(format!("{}/healthz", app.base)).send().await.unwrap().status(), 200);
    assert_eq!(http.get(format!("{}/readyz", app.base)).send().await.unwrap().status(), 200);
    let r = http.post(format!("{}/v1/runs", app.base)).json(&json!({"message": "while full", "billingAccountId": "acct-full"})).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "store_unavailable", "{e}");
    // The store's own error (its file, the driver's words) is in the log, not shown to callers.
    assert!(!e["error"]["message"].as_str().unwrap_or_default().contains(&*disk.store.to_string_lossy()), "{e}");

    disk.free();
    // The ends are stored (retried in the background): the store's own listing (not the process's
    // memory) shows no run unfinished and every `internal` run failed.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let v: Value = http.get(format!("{}/v1/runs?status=queued,running&limit=500", app.base)).send().await.unwrap().json().await.unwrap();
        if v["runs"].as_array().unwrap().is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "runs stay unfinished in the store after the disk has room: {v}\n{}", app.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let v: Value = http.get(format!("{}/v1/runs?status=error&limit=500", app.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["runs"].as_array().unwrap().len(), internal_ends(&seen).len(), "{v}");
    assert_store_matches_what_clients_saw(&http, &app.base, &seen).await;

    // New runs work again.
    let r = http.post(format!("{}/v1/runs", app.base)).json(&json!({"message": "<after> [track:long]", "billingAccountId": "acct-full"})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let doc: Value = r.json().await.unwrap();
    assert_eq!(doc["status"], "ok", "{doc}");

    // And all of it is durable: the same after a restart.
    app.sigterm();
    app.start(&http).await;
    assert_store_matches_what_clients_saw(&http, &app.base, &seen).await;
    app.assert_no_panic();
}

#[actix_rt::test]
async fn a_restart_before_the_disk_has_room_ends_the_failed_runs_as_their_clients_saw_never_continues_them() {
    let Some(disk) = SmallDisk::new("a_restart_before_the_disk_has_room_ends_the_failed_runs_as_their_clients_saw_never_continues_them") else { return };
    let gw = slow_gateway();
    let http = http();
    let mut app = Clawmux::new(&gw.url(), &disk.store);
    app.start(&http).await;
    let seen = fill_the_disk_while_runs_stream(&disk, &app, &http, "crash").await;
    // Killed while the store still cannot take the ends.
    app.kill_9();
    disk.free();
    app.start(&http).await;
    // Nothing was continued: every run is finished in the store at once.
    let v: Value = http.get(format!("{}/v1/runs?status=queued,running&limit=500", app.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["runs"].as_array().unwrap().len(), 0, "runs continued after the restart: {v}");
    assert_store_matches_what_clients_saw(&http, &app.base, &seen).await;
    // None is started again on the gateway.
    let mut per_run = std::collections::HashMap::new();
    for r in gw.runs() {
        *per_run.entry(r.run_id).or_insert(0) += 1;
    }
    assert!(per_run.values().all(|n| *n == 1), "{per_run:?}");
    app.assert_no_panic();
}
