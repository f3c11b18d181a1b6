//! The flow with a fake runner, each run driven by its actor ([`ContainerRun`]) as the registry
//! drives it (a probe port records its end): every way a run ends, the FIFO slots, clean-up.

use super::*;
use crate::ephemeral::actor::ContainerRun;
use crate::ephemeral::runner::{Exit, RunnerError};
use actix::prelude::*;
use clawmux_actors::messages::{CancelRun, ExternalRun, RegistryPort, Release, RunEnded, Turn};
use async_trait::async_trait;
use clawmux_actors::RunStatus;
use clawmux_protocol::{SessionKey, TraceParent};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::SystemTime;
use tokio::sync::Notify;

/// What a fake container does.
#[derive(Clone)]
enum Script {
    /// Exits at once with this.
    Exit(Exit),
    /// Runs until removed.
    Hang,
    /// Runs until the test releases it, then exits with this.
    Gate(Arc<Notify>, Exit),
    /// Its image is missing.
    Missing,
    /// The engine takes this long to create and start it, and does so even when the request is
    /// dropped meanwhile (as Docker does); then it runs until removed.
    SlowCreate(Duration),
}

#[derive(Default)]
struct Seen {
    started: Vec<String>,
    /// Started and not removed since (a removal before the engine made it finds nothing).
    alive: std::collections::HashSet<String>,
    removed: Vec<String>,
    /// Prompt and config as the container would find them at start.
    files: Vec<(String, serde_json::Value)>,
    bodies: Vec<bollard::models::ContainerCreateBody>,
    reaped_owner: Option<String>,
    /// Permission bits of each run's directory (the workspace's parent) at start.
    dir_modes: Vec<u32>,
}

struct FakeRunner {
    scripts: Mutex<std::collections::HashMap<String, Script>>,
    seen: Arc<Mutex<Seen>>,
    running: Arc<AtomicUsize>,
    max_running: Arc<AtomicUsize>,
    removed: Notify,
    orphans: Vec<String>,
    /// The engine never answers the question of its cores.
    cpus_stuck: std::sync::atomic::AtomicBool,
}

impl FakeRunner {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            scripts: Mutex::new(Default::default()),
            seen: Arc::new(Mutex::new(Seen::default())),
            running: Arc::new(AtomicUsize::new(0)),
            max_running: Arc::new(AtomicUsize::new(0)),
            removed: Notify::new(),
            orphans: vec!["/old-1".into()],
            cpus_stuck: std::sync::atomic::AtomicBool::new(false),
        })
    }
    fn script(&self, run_id: &str, s: Script) {
        self.scripts.lock().expect("lock").insert(run_id.to_owned(), s);
    }
    fn seen<T>(&self, f: impl FnOnce(&Seen) -> T) -> T {
        f(&self.seen.lock().expect("lock"))
    }
    fn script_of(&self, name: &str) -> Script {
        let scripts = self.scripts.lock().expect("lock");
        scripts.iter().find(|(id, _)| name.starts_with(&format!("clawmux-eph-{id}-"))).map(|(_, s)| s.clone()).unwrap_or(Script::Hang)
    }
}

#[async_trait]
impl Runner for FakeRunner {
    async fn start(&self, name: &str, body: bollard::models::ContainerCreateBody) -> Result<String, RunnerError> {
        match self.script_of(name) {
            Script::Missing => return Err(RunnerError::MissingImage(body.image.clone().unwrap_or_default())),
            Script::SlowCreate(took) => {
                let (seen, running, max, name) = (self.seen.clone(), self.running.clone(), self.max_running.clone(), name.to_owned());
                let (made, was_made) = tokio::sync::oneshot::channel();
                // The engine's side: not cancelled with the request.
                tokio::spawn(async move {
                    tokio::time::sleep(took).await;
                    max.fetch_max(running.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
                    let mut seen = seen.lock().expect("lock");
                    seen.started.push(name.clone());
                    seen.alive.insert(name.clone());
                    drop(seen);
                    let _ = made.send(name);
                });
                return was_made.await.map_err(|_| RunnerError::Engine("the fake engine stopped".to_owned()));
            }
            _ => {}
        }
        let binds = body.host_config.as_ref().and_then(|h| h.binds.clone()).unwrap_or_default();
        let input = binds[0].split(':').next().unwrap_or_default().to_owned();
        let prompt = std::fs::read_to_string(format!("{input}/prompt.txt")).unwrap_or_default();
        let config: serde_json::Value = std::fs::read(format!("{input}/openclaw.json")).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
        let mode = {
            use std::os::unix::fs::MetadataExt;
            std::path::Path::new(&input).parent().and_then(|d| std::fs::metadata(d).ok()).map_or(0, |m| m.mode() & 0o777)
        };
        let n = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_running.fetch_max(n, Ordering::SeqCst);
        let mut seen = self.seen.lock().expect("lock");
        seen.dir_modes.push(mode);
        seen.started.push(name.to_owned());
        seen.alive.insert(name.to_owned());
        seen.files.push((prompt, config));
        seen.bodies.push(body);
        Ok(name.to_owned())
    }

    async fn wait(&self, id: &str, _limit: usize) -> Result<Exit, RunnerError> {
        match self.script_of(id) {
            Script::Exit(e) => Ok(e),
            Script::Gate(n, e) => {
                n.notified().await;
                Ok(e)
            }
            Script::Hang | Script::Missing | Script::SlowCreate(_) => std::future::pending().await,
        }
    }

    async fn remove(&self, id: &str) {
        let mut seen = self.seen.lock().expect("lock");
        if seen.alive.remove(id) {
            self.running.fetch_sub(1, Ordering::SeqCst);
        }
        seen.removed.push(id.to_owned());
        self.removed.notify_waiters();
    }

    async fn reap(&self, owner: &str) -> Result<Vec<String>, RunnerError> {
        self.seen.lock().expect("lock").reaped_owner = Some(owner.to_owned());
        Ok(self.orphans.clone())
    }

    async fn check_image(&self, _image: &str) -> Result<(), RunnerError> {
        Ok(())
    }

    async fn cpus(&self) -> Option<u32> {
        if self.cpus_stuck.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        Some(1)
    }
}

#[derive(Default)]
struct Sink {
    events: Mutex<Vec<RunEvent>>,
    checkpoints: Mutex<Vec<Checkpoint>>,
    done: Notify,
}

impl RunSink for Sink {
    fn emit(&self, event: RunEvent) {
        let end = matches!(event, RunEvent::Finished(_));
        self.events.lock().expect("lock").push(event);
        if end {
            self.done.notify_one();
        }
    }
    fn checkpoint(&self, checkpoint: Checkpoint) {
        self.checkpoints.lock().expect("lock").push(checkpoint);
    }
}

impl Sink {
    async fn outcome(&self) -> RunOutcome {
        let wait = async {
            loop {
                if let Some(RunEvent::Finished(o)) = self.events.lock().expect("lock").last().cloned() {
                    return o;
                }
                self.done.notified().await;
            }
        };
        tokio::time::timeout(Duration::from_secs(30), wait).await.expect("the run ended")
    }
    fn events(&self) -> Vec<RunEvent> {
        self.events.lock().expect("lock").clone()
    }
}

fn spec(run_id: &str, timeout: Duration) -> RunSpec {
    RunSpec {
        run_id: run_id.to_owned(),
        gateway_run_id: "g".into(),
        session_key: SessionKey::canonicalize(&format!("agent:main:acct:{run_id}")),
        agent_id: "main".into(),
        message: format!("the prompt of {run_id}; $(rm -rf /) \"quoted\""),
        model: Some("cogni/fake-model".into()),
        billing_account_id: "acct".into(),
        graph_id: "sandbox:openclaw-ephemeral".into(),
        admitted_at: SystemTime::now(),
        timeout,
        traceparent: TraceParent::parse("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01").expect("tp"),
        attribution_token: None,
        branch: None,
    }
}

struct Env {
    eph: Arc<Ephemeral>,
    runner: Arc<FakeRunner>,
    root: tempfile::TempDir,
    ends: Addr<Ends>,
}

/// Each reported end: the run id and its status.
type Ended = Vec<(String, Option<RunStatus>)>;

/// Plays the registry's side of the port: records every run's reported end.
#[derive(Default)]
struct Ends(Arc<Mutex<Ended>>);

impl Actor for Ends {
    type Context = Context<Self>;
}

impl Handler<RunEnded> for Ends {
    type Result = ();
    fn handle(&mut self, msg: RunEnded, _ctx: &mut Context<Self>) {
        self.0.lock().expect("lock").push((msg.run_id, msg.status));
    }
}

impl Handler<Release> for Ends {
    type Result = ();
    fn handle(&mut self, _msg: Release, _ctx: &mut Context<Self>) {}
}

/// What ends a run from outside.
#[derive(Message)]
#[rtype(result = "Vec<(String, Option<RunStatus>)>")]
struct Reported;

impl Handler<Reported> for Ends {
    type Result = MessageResult<Reported>;
    fn handle(&mut self, _msg: Reported, _ctx: &mut Context<Self>) -> Self::Result {
        MessageResult(self.0.lock().expect("lock").clone())
    }
}

fn env(max: usize) -> Env {
    let root = tempfile::tempdir().expect("tmp");
    let runner = FakeRunner::new();
    let cfg = EphemeralConfig { root: root.path().join("runs"), max_concurrent: max, default_model: "m".into() };
    Env { eph: Ephemeral::new(runner.clone(), None, cfg), runner, root, ends: Ends::default().start() }
}

/// A run's sink and its actor's handle.
struct Started {
    sink: Arc<Sink>,
    actor: ExternalRun,
}

impl std::ops::Deref for Started {
    type Target = Sink;
    fn deref(&self) -> &Sink {
        &self.sink
    }
}

impl Started {
    fn cancel(&self, reason: CancelReason) {
        self.actor.cancel.do_send(CancelRun(reason));
    }
}

impl Env {
    /// Admits a run and gives it its turn at once (its session key is free).
    fn run(&self, run_id: &str, timeout: Duration) -> Started {
        let started = self.admit(run_id, timeout);
        started.actor.turn.do_send(Turn::Go);
        started
    }

    /// Admits a run without giving it its turn (its session key is held by another run).
    fn admit(&self, run_id: &str, timeout: Duration) -> Started {
        let sink = Arc::new(Sink::default());
        let mut variant = EphemeralSpec::defaults("img:test");
        variant.output_bytes = 1000;
        // The runs of the CPU limit's test: a variant with two CPUs.
        if run_id.contains("cpu") {
            variant.nano_cpus = Some(2_000_000_000);
        }
        let job = Job { spec: spec(run_id, timeout), agent_id: "main".into(), variant, sink: sink.clone(), billing: None };
        let port = RegistryPort { release: self.ends.clone().recipient(), ended: self.ends.clone().recipient() };
        Started { sink, actor: ContainerRun::start(self.eph.clone(), job, port) }
    }

    /// The ends the runs reported to the registry (waits, bounded, for `n` of them).
    async fn reported(&self, n: usize) -> Vec<(String, Option<RunStatus>)> {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let ends = self.ends.send(Reported).await.expect("probe");
            if ends.len() >= n {
                return ends;
            }
            assert!(std::time::Instant::now() < deadline, "only {ends:?} reported, wanted {n}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn leftover_dirs(&self) -> usize {
        std::fs::read_dir(self.root.path().join("runs")).map(|d| d.count()).unwrap_or(0)
    }
}

fn ok_exit(text: &str) -> Exit {
    Exit { code: 0, stdout: serde_json::json!({"payloads":[{"text": text}],"meta":{"agentMeta":{"usage":{"input":5,"output":2}}}}).to_string().into_bytes(), ..Exit::default() }
}

const LONG: Duration = Duration::from_secs(600);

/// The runs directory is clawmux's own and private (every run's LLM socket, prompt and workspace
/// are below it, and the engine mounts from it as root): one left open to everyone is closed,
/// each run's directory is `0700`, and one of another user is refused (the run ends `internal`
/// naming it, and no container starts).
#[actix_rt::test]
async fn the_runs_directory_is_private_and_another_users_is_refused() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let e = env(4);
    let root = e.root.path().join("runs");
    std::fs::create_dir_all(&root).expect("mkdir");
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    e.runner.script("r-ok", Script::Exit(ok_exit("fine")));
    assert_eq!(e.run("r-ok", LONG).outcome().await.status, RunStatus::Ok);
    assert_eq!(std::fs::metadata(&root).expect("stat").mode() & 0o777, 0o700, "the runs directory is private");
    assert_eq!(e.runner.seen(|s| s.dir_modes.clone()), [0o700], "the run's directory is private");
    if !rustix::process::geteuid().is_root() {
        eprintln!("not root: the directory of another user is not tried");
        return;
    }
    std::os::unix::fs::chown(&root, Some(4242), Some(4242)).expect("chown");
    e.runner.script("r-foreign", Script::Exit(ok_exit("never")));
    let o = e.run("r-foreign", LONG).outcome().await;
    assert_eq!(o.status, RunStatus::Error);
    let message = o.error.map(|e| e.message).unwrap_or_default();
    assert!(message.contains("belongs to uid 4242"), "{message}");
    assert_eq!(e.runner.seen(|s| s.started.len()), 1, "no container for the refused run");
}

/// The runs directory's parents count too: one that other users may write without the sticky bit,
/// or one of another user, could have the runs directory swapped for theirs, so runs are refused
/// (ending `internal`, naming it, no container); a sticky one like `/tmp` is fine.
#[actix_rt::test]
async fn a_runs_directory_below_a_parent_others_may_replace_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let e = env(4);
    let parent = e.root.path();
    async fn refused(e: &Env, run_id: &str) -> String {
        e.runner.script(run_id, Script::Exit(ok_exit("never")));
        let o = e.run(run_id, LONG).outcome().await;
        assert_eq!(o.status, RunStatus::Error, "{run_id}");
        o.error.map(|e| e.message).unwrap_or_default()
    }
    std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let message = refused(&e, "r-open").await;
    assert!(message.contains(&format!("{} (a parent of the ephemeral runs directory) is writable by other users (mode 777)", parent.display())), "{message}");
    // A start-up does not empty a runs directory it cannot trust (it might be another's).
    std::fs::create_dir_all(parent.join("runs/0123456789abcdef")).expect("a leftover");
    e.eph.reap().await;
    assert_eq!(e.leftover_dirs(), 1, "leftovers removed below an unsafe parent");
    std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
    e.eph.reap().await;
    assert_eq!(e.leftover_dirs(), 0);
    e.runner.script("r-sticky", Script::Exit(ok_exit("fine")));
    assert_eq!(e.run("r-sticky", LONG).outcome().await.status, RunStatus::Ok, "a sticky parent (like /tmp) is fine");
    std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    assert_eq!(e.runner.seen(|s| s.started.len()), 1, "no container for the refused run");
    if !rustix::process::geteuid().is_root() {
        eprintln!("not root: a parent of another user is not tried");
        return;
    }
    std::os::unix::fs::chown(parent, Some(4242), Some(4242)).expect("chown");
    let message = refused(&e, "r-foreign-parent").await;
    assert!(message.contains("belongs to uid 4242, neither root nor clawmux"), "{message}");
    std::os::unix::fs::chown(parent, Some(0), Some(0)).expect("chown back");
    assert_eq!(e.runner.seen(|s| s.started.len()), 1, "no container for the refused run");
}

/// A link among the parents is followed once, when the run is prepared: the paths handed to the
/// engine are the resolved ones (nothing in them to re-point before the mount). Missing parents
/// are made `0700`, whatever the umask.
#[actix_rt::test]
async fn the_engine_is_given_resolved_paths_and_missing_parents_are_private() {
    use std::os::unix::fs::MetadataExt;
    let tmp = tempfile::tempdir().expect("tmp");
    std::fs::create_dir(tmp.path().join("real")).expect("mkdir");
    std::os::unix::fs::symlink(tmp.path().join("real"), tmp.path().join("link")).expect("symlink");
    let runner = FakeRunner::new();
    let cfg = EphemeralConfig { root: tmp.path().join("link/new/runs"), max_concurrent: 1, default_model: "m".into() };
    let e = Env { eph: Ephemeral::new(runner.clone(), None, cfg), runner, root: tmp, ends: Ends::default().start() };
    e.runner.script("r-link", Script::Exit(ok_exit("fine")));
    assert_eq!(e.run("r-link", LONG).outcome().await.status, RunStatus::Ok);
    let resolved = std::fs::canonicalize(e.root.path().join("real/new/runs")).expect("resolved");
    let binds = e.runner.seen(|s| s.bodies[0].host_config.as_ref().and_then(|h| h.binds.clone()).unwrap_or_default());
    assert!(binds.iter().all(|b| b.starts_with(&resolved.display().to_string())), "{binds:?} not below {}", resolved.display());
    let mode = std::fs::metadata(e.root.path().join("real/new")).expect("stat").mode() & 0o777;
    assert_eq!(mode, 0o700, "a parent clawmux made");
}

/// The socket-length bound holds for the resolved path: a short configured path whose link leads
/// to a long one is refused by name (the run ends `internal`, no container), not left to fail
/// when its socket is bound.
#[actix_rt::test]
async fn a_runs_directory_that_resolves_to_a_path_too_long_for_a_socket_is_refused() {
    let tmp = tempfile::tempdir().expect("tmp");
    let long = tmp.path().join("d".repeat(MAX_ROOT_LEN));
    std::fs::create_dir(&long).expect("mkdir");
    std::os::unix::fs::symlink(&long, tmp.path().join("l")).expect("symlink");
    let root = tmp.path().join("l/runs");
    assert!(root.as_os_str().len() <= MAX_ROOT_LEN, "the configured path itself fits");
    let runner = FakeRunner::new();
    let cfg = EphemeralConfig { root, max_concurrent: 1, default_model: "m".into() };
    let e = Env { eph: Ephemeral::new(runner.clone(), None, cfg), runner, root: tmp, ends: Ends::default().start() };
    e.runner.script("r-long", Script::Exit(ok_exit("never")));
    let o = e.run("r-long", LONG).outcome().await;
    assert_eq!(o.status, RunStatus::Error);
    let message = o.error.map(|e| e.message).unwrap_or_default();
    assert!(message.contains(&format!("longer than {} bytes", MAX_ROOT_LEN)), "{message}");
    assert_eq!(e.runner.seen(|s| s.started.len()), 0, "no container for the refused run");
}

#[actix_rt::test]
async fn a_run_streams_the_envelope_text_and_leaves_nothing_behind() {
    let e = env(4);
    e.runner.script("r-ok", Script::Exit(ok_exit("the answer")));
    let sink = e.run("r-ok", LONG);
    let o = sink.outcome().await;
    assert_eq!(o, RunOutcome::ok("the answer".into(), Some((5, 2))));
    let events = sink.events();
    assert!(matches!(&events[0], RunEvent::Accepted { gateway_run_id } if gateway_run_id.starts_with("clawmux-eph-r-ok-")), "{events:?}");
    assert_eq!(events[1], RunEvent::TextDelta("the answer".into()));
    assert_eq!(*sink.checkpoints.lock().expect("lock"), [Checkpoint::Running]);
    let labels = e.runner.seen(|s| s.bodies[0].labels.clone()).expect("labels");
    assert_eq!(labels.get(crate::ephemeral::container::LABEL_OWNER), Some(&crate::ephemeral::container::owner_of(&e.root.path().join("runs"))));
    let (started, removed, files) = e.runner.seen(|s| (s.started.clone(), s.removed.clone(), s.files.clone()));
    assert_eq!(removed, started, "the container is removed after the run");
    // The message reached the container as a file, byte for byte, never through a shell.
    assert_eq!(files[0].0, "the prompt of r-ok; $(rm -rf /) \"quoted\"");
    assert_eq!(files[0].1["models"]["mode"], "replace");
    assert_eq!(files[0].1["agents"]["defaults"]["model"]["primary"], "cogni/fake-model");
    assert_eq!(e.leftover_dirs(), 0, "the workspace is removed");
    assert_eq!(e.reported(1).await, [("r-ok".to_owned(), Some(RunStatus::Ok))], "its end, reported to the registry once");
}

#[actix_rt::test]
async fn abort_and_client_disconnect_remove_the_container_at_once() {
    let e = env(4);
    for (run, reason, want) in [("r-abort", CancelReason::Api, "aborted by request"), ("r-gone", CancelReason::ClientGone, "client disconnected")] {
        let sink = e.run(run, LONG);
        // Cancelled once its container runs.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !e.runner.seen(|s| s.started.iter().any(|n| n.contains(run))) {
            assert!(std::time::Instant::now() < deadline, "the container started");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        sink.cancel(reason);
        let o = sink.outcome().await;
        assert_eq!(o.status, RunStatus::Aborted);
        assert!(o.error.as_ref().is_some_and(|er| er.message.contains(want)), "{o:?}");
        assert!(e.runner.seen(|s| s.removed.iter().any(|n| n.contains(run))), "the container is removed");
    }
    let ends = e.reported(2).await;
    assert_eq!(ends, [("r-abort".to_owned(), Some(RunStatus::Aborted)), ("r-gone".to_owned(), Some(RunStatus::Aborted))]);
    assert_eq!(e.leftover_dirs(), 0);
}

/// A run aborted, or over its deadline, while the engine still creates its container: the run
/// ends at once (it does not wait for the engine), and the container the engine made after all
/// is removed then, not left until the next start.
#[actix_rt::test]
async fn a_run_ended_while_its_container_is_created_leaves_no_container() {
    let e = env(4);
    e.runner.script("r-abort-create", Script::SlowCreate(Duration::from_millis(2000)));
    e.runner.script("r-late-create", Script::SlowCreate(Duration::from_millis(2500)));
    let aborted = e.run("r-abort-create", LONG);
    let late = e.run("r-late-create", Duration::from_secs(1));
    tokio::time::sleep(Duration::from_millis(100)).await;
    aborted.cancel(CancelReason::Api);
    assert_eq!(aborted.outcome().await.status, RunStatus::Aborted);
    assert_eq!(late.outcome().await.status, RunStatus::Timeout);
    assert!(e.runner.seen(|s| s.started.is_empty()), "the runs' ends waited for the engine's creates");
    // Past both creates.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while e.runner.seen(|s| s.started.len()) < 2 || e.runner.running.load(Ordering::SeqCst) > 0 || e.leftover_dirs() > 0 {
        let (started, removed) = e.runner.seen(|s| (s.started.clone(), s.removed.clone()));
        assert!(std::time::Instant::now() < deadline, "a container or directory was left behind: started {started:?}, removed {removed:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A variant's CPU limit above the engine's cores (two on a one-CPU engine) is lowered to them:
/// Docker refuses the container otherwise, and every run of the variant failed.
#[actix_rt::test]
async fn the_cpu_limit_is_at_most_the_engines_cores() {
    let e = env(4);
    e.runner.script("r-cpu", Script::Exit(ok_exit("ok")));
    assert_eq!(e.run("r-cpu", LONG).outcome().await.content, "ok");
    let limit = e.runner.seen(|s| s.bodies[0].host_config.as_ref().and_then(|h| h.nano_cpus));
    assert_eq!(limit, Some(1_000_000_000), "the fake engine has one CPU");
}

/// An engine that does not say how many cores it has holds neither an abort nor a deadline up
/// (its client's timeout is 120 s): the run ends at once, and no container is made.
#[actix_rt::test]
async fn a_stuck_engine_holds_up_no_abort_and_no_deadline() {
    let e = env(4);
    // Runs named `cpu` are of a variant with a CPU limit: the engine is asked for its cores.
    e.runner.cpus_stuck.store(true, Ordering::SeqCst);
    let aborted = e.run("r-cpu-stuck-abort", LONG);
    tokio::time::sleep(Duration::from_millis(100)).await;
    aborted.cancel(CancelReason::Api);
    let o = tokio::time::timeout(Duration::from_secs(5), aborted.outcome()).await.expect("the abort ends the run at once");
    assert_eq!(o.status, RunStatus::Aborted);
    let timed = e.run("r-cpu-stuck-deadline", Duration::from_secs(1));
    let o = tokio::time::timeout(Duration::from_secs(5), timed.outcome()).await.expect("the deadline ends the run");
    assert_eq!(o.status, RunStatus::Timeout);
    assert!(e.runner.seen(|s| s.started.is_empty()), "no container was made");
}

/// The slot of a run that ended during its container's create stays taken until that container
/// is removed: the next run waits for it (runs beyond `CLAWMUX_EPHEMERAL_MAX` never run at once).
#[actix_rt::test]
async fn a_run_ended_during_its_create_holds_its_slot_until_the_container_is_gone() {
    let e = env(1);
    e.runner.script("r-slow-create", Script::SlowCreate(Duration::from_millis(1500)));
    e.runner.script("r-next", Script::Exit(ok_exit("next")));
    let slow = e.run("r-slow-create", LONG);
    tokio::time::sleep(Duration::from_millis(100)).await;
    slow.cancel(CancelReason::Api);
    assert_eq!(slow.outcome().await.status, RunStatus::Aborted);
    let next = e.run("r-next", LONG);
    assert_eq!(next.outcome().await.content, "next");
    let order = e.runner.seen(|s| s.started.clone());
    assert!(order.len() == 2 && order[0].contains("r-slow-create") && order[1].contains("r-next"), "the next run started before the slot was free: {order:?}");
    assert_eq!(e.runner.max_running.load(Ordering::SeqCst), 1);
}

/// An agent that stops at the time limit it was given (OpenClaw's `--timeout`, a grace below the
/// run's) ended the run `timeout`, however it exited: seen in the real-Docker test, OpenClaw
/// timed out at 81 s of a 90 s run and exited 1 with an error of its own, and the run ended
/// `agent_error`. An agent failing before its limit is still an agent error.
#[actix_rt::test]
async fn an_agent_that_fails_past_its_own_time_limit_ends_the_run_timeout() {
    let e = env(2);
    let failing = Exit { code: 1, stderr_tail: "embedded run timeout: runId=x timeoutMs=1000".into(), ..Exit::default() };
    let gate = Arc::new(Notify::new());
    e.runner.script("r-late", Script::Gate(gate.clone(), failing.clone()));
    e.runner.script("r-early", Script::Exit(failing));
    // 6 s: the agent's own limit is 1 s (a 5 s grace), the run's 6 s.
    let late = e.run("r-late", Duration::from_secs(6));
    let early = e.run("r-early", Duration::from_secs(6));
    let o = early.outcome().await;
    assert_eq!((o.status, o.error.map(|e| e.code)), (RunStatus::Error, Some(ErrorCode::AgentError)), "failed before its limit");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    gate.notify_one();
    let o = late.outcome().await;
    assert_eq!(o.status, RunStatus::Timeout, "{o:?}");
    let message = o.error.expect("error").message;
    assert!(message.contains("the time limit it was given (1 s)") && message.contains("embedded run timeout"), "{message}");
    // Killed for its memory after its limit: that, not the limit, ended it.
    let oom_gate = Arc::new(Notify::new());
    e.runner.script("r-oom-past-limit", Script::Gate(oom_gate.clone(), Exit { code: 137, oom_killed: true, ..Exit::default() }));
    let oom = e.run("r-oom-past-limit", Duration::from_secs(6));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    oom_gate.notify_one();
    let o = oom.outcome().await;
    assert_eq!((o.status, o.error.map(|e| e.code)), (RunStatus::Error, Some(ErrorCode::AgentError)), "an OOM kill stays an agent error");
}

#[actix_rt::test]
async fn a_run_over_its_timeout_is_killed() {
    let e = env(4);
    let sink = e.run("r-slow", Duration::from_secs(1));
    let o = sink.outcome().await;
    assert_eq!(o.status, RunStatus::Timeout);
    assert!(e.runner.seen(|s| s.removed.iter().any(|n| n.contains("r-slow"))));
    // The agent's own timeout is below the hard limit, for a clean exit.
    let cmd = e.runner.seen(|s| s.bodies[0].cmd.clone()).expect("cmd");
    assert!(cmd.contains(&"--timeout=1".to_owned()), "{cmd:?}");
}

#[actix_rt::test]
async fn bad_ends_are_agent_errors_and_the_container_is_removed() {
    let e = env(4);
    let cases = [
        ("r-exit", Script::Exit(Exit { code: 3, stderr_tail: "boom".into(), ..Exit::default() }), ErrorCode::AgentError, "code 3: boom"),
        ("r-big", Script::Exit(Exit { stdout_over_limit: true, ..Exit::default() }), ErrorCode::AgentError, "exceeded 1000 bytes"),
        ("r-env", Script::Exit(Exit { code: 0, stdout: b"{\"oops\":1}".to_vec(), ..Exit::default() }), ErrorCode::AgentError, "malformed"),
        ("r-img", Script::Missing, ErrorCode::Internal, "img:test"),
    ];
    for (run, script, code, want) in cases {
        e.runner.script(run, script);
        let o = e.run(run, LONG).outcome().await;
        let err = o.error.expect("error");
        assert_eq!(err.code, code, "{run}");
        assert!(err.message.contains(want), "{run}: {}", err.message);
        assert!(e.runner.seen(|s| s.removed.iter().any(|n| n.contains(run))), "{run}: removed");
    }
    assert_eq!(e.leftover_dirs(), 0);
}

#[actix_rt::test]
async fn runs_wait_for_a_slot_in_fifo_order_and_the_wait_counts_toward_the_timeout() {
    let e = env(1);
    let gate = Arc::new(Notify::new());
    e.runner.script("r-1", Script::Gate(gate.clone(), ok_exit("one")));
    e.runner.script("r-2", Script::Exit(ok_exit("two")));
    e.runner.script("r-3", Script::Exit(ok_exit("three")));
    let s1 = e.run("r-1", LONG);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while e.runner.seen(|s| s.started.len()) < 1 {
        assert!(std::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!e.eph.has_free_slot(), "the one slot is taken");
    let s2 = e.run("r-2", LONG);
    // r-4 waits behind r-1 longer than its timeout: it never gets a container.
    let s4 = e.run("r-4", Duration::from_secs(1));
    let s3 = e.run("r-3", LONG);
    let o4 = s4.outcome().await;
    assert_eq!(o4.status, RunStatus::Timeout);
    assert!(s4.events().iter().all(|ev| !matches!(ev, RunEvent::Accepted { .. })));
    assert_eq!(e.runner.seen(|s| s.started.len()), 1, "one slot: the others wait");
    gate.notify_one();
    for (s, text) in [(s1, "one"), (s2, "two"), (s3, "three")] {
        assert_eq!(s.outcome().await.content, text);
    }
    let order: Vec<String> = e.runner.seen(|s| s.started.clone());
    assert!(order[0].contains("r-1") && order[1].contains("r-2") && order[2].contains("r-3"), "FIFO: {order:?}");
    assert_eq!(order.len(), 3);
    assert_eq!(e.runner.max_running.load(Ordering::SeqCst), 1);
}

#[actix_rt::test]
async fn a_run_aborted_while_waiting_for_a_slot_never_starts() {
    let e = env(1);
    let s1 = e.run("r-hold", LONG);
    let s2 = e.run("r-wait", LONG);
    tokio::time::sleep(Duration::from_millis(50)).await;
    s2.cancel(CancelReason::Api);
    assert_eq!(s2.outcome().await.status, RunStatus::Aborted);
    assert!(e.runner.seen(|s| s.started.iter().all(|n| !n.contains("r-wait"))));
    s1.cancel(CancelReason::Shutdown);
    assert_eq!(s1.outcome().await.status, RunStatus::Aborted);
}

#[actix_rt::test]
async fn a_run_waiting_for_its_turn_times_out_or_is_cancelled_without_a_container() {
    let e = env(4);
    // Its session key stays held by another run: no turn comes.
    let late = e.admit("r-turnless", Duration::from_secs(1));
    assert_eq!(late.outcome().await.status, RunStatus::Timeout);
    let cancelled = e.admit("r-cancelled", LONG);
    cancelled.cancel(CancelReason::Interrupted);
    assert_eq!(cancelled.outcome().await.status, RunStatus::Aborted);
    // A turn after the end starts nothing: the run is over.
    cancelled.actor.turn.do_send(Turn::Go);
    let ends = e.reported(2).await;
    assert_eq!(ends, [("r-turnless".to_owned(), Some(RunStatus::Timeout)), ("r-cancelled".to_owned(), Some(RunStatus::Aborted))]);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(e.runner.seen(|s| s.started.is_empty()), "no container for a run that never had its turn");
    assert_eq!(e.ends.send(Reported).await.expect("probe").len(), 2, "each end reported once");
}

#[actix_rt::test]
async fn start_up_reaps_orphans_and_leftover_workspaces() {
    let e = env(1);
    std::fs::create_dir_all(e.root.path().join("runs/0123456789abcdef/in")).expect("dir");
    e.eph.reap().await;
    assert_eq!(e.leftover_dirs(), 0);
    assert_eq!(e.runner.seen(|s| s.reaped_owner.clone()), Some(crate::ephemeral::container::owner_of(&e.root.path().join("runs"))));
}

#[test]
fn the_environment_configures_slots_dir_and_model() {
    let c = EphemeralConfig::from_env(&|_| None).expect("defaults");
    assert_eq!(c.max_concurrent, 4);
    assert!(c.root.ends_with("clawmux-ephemeral"));
    let env = |k: &str| match k {
        "CLAWMUX_EPHEMERAL_MAX" => Some("2".to_owned()),
        "CLAWMUX_EPHEMERAL_DIR" => Some("/srv/eph".to_owned()),
        "CLAWMUX_EPHEMERAL_MODEL" => Some("fake-model".to_owned()),
        _ => None,
    };
    let c = EphemeralConfig::from_env(&env).expect("set");
    assert_eq!((c.max_concurrent, c.root.as_path(), c.default_model.as_str()), (2, Path::new("/srv/eph"), "fake-model"));
    for (k, v) in [("CLAWMUX_EPHEMERAL_MAX", "0"), ("CLAWMUX_EPHEMERAL_MAX", "x"), ("CLAWMUX_EPHEMERAL_DIR", "rel/dir"), ("CLAWMUX_EPHEMERAL_DIR", &format!("/{}", "d".repeat(80)))] {
        let err = EphemeralConfig::from_env(&|key| (key == k).then(|| v.to_owned())).expect_err(v);
        assert!(err.contains(k), "{err}");
    }
}
