//! Test doubles for the actors' unit tests: a probe that stands in for the supervisor and the
//! registry (it records every message a session actor sends and lets the test answer), a run sink
//! that records events and checkpoints, a workspace whose steps the test finishes by hand, and
//! builders for specs and gateway answers.
#![allow(clippy::unwrap_used)]

use crate::branch::{BranchPlan, Prepared, Published, Workspace, WorkspaceError};
use crate::messages::{
    Abandon, AddRoute, Call, CallError, GatewayPort, GatewayUp, OutboundHeadersUnsupported, RegistryPort, Release, RemoveRoute, Reply,
    Routed, RunEnded, ScopeMissing,
};
use crate::run::{Checkpoint, RunEvent, RunOutcome, RunSink, RunSpec, RunStatus};
use actix::prelude::*;
use clawmux_protocol::{GatewayEvent, SessionKey, TraceParent};
use futures_util::future::BoxFuture;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{mpsc, oneshot};

/// Bound on every wait for something that takes milliseconds (generous: the machine may be loaded).
pub const WAIT: Duration = Duration::from_secs(10);

/// How long "nothing more happens" is watched for. Short: a message that should not come would
/// come within microseconds of the one that provoked it, so this only adds confidence.
pub const QUIET: Duration = Duration::from_millis(300);

/// One message a session actor sent to the supervisor or the registry.
pub enum Sent {
    /// A gateway request (answer it through `reply_to`).
    Call(Call),
    /// A route registration.
    AddRoute(AddRoute),
    /// A route removal.
    RemoveRoute(RemoveRoute),
    /// A gateway run handed over for cancelling after a reconnect.
    Abandon(Abandon),
    /// `outboundHeaders` rejected.
    HeadersUnsupported,
    /// A missing scope.
    ScopeMissing,
    /// A lock release.
    Release(Release),
    /// The run's end.
    Ended(RunEnded),
}

impl std::fmt::Debug for Sent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Sent::Call(c) => write!(f, "Call({} {})", c.method, c.params),
            Sent::AddRoute(r) => write!(f, "AddRoute({})", r.gateway_run_id),
            Sent::RemoveRoute(r) => write!(f, "RemoveRoute({})", r.gateway_run_id),
            Sent::Abandon(a) => write!(f, "{a:?}"),
            Sent::HeadersUnsupported => write!(f, "HeadersUnsupported"),
            Sent::ScopeMissing => write!(f, "ScopeMissing"),
            Sent::Release(r) => write!(f, "{r:?}"),
            Sent::Ended(e) => write!(f, "{e:?}"),
        }
    }
}

/// The actor behind the ports: forwards everything to the test.
struct ProbeActor {
    /// Where the test reads what was sent.
    tx: mpsc::UnboundedSender<Sent>,
    /// Start-slot releases, counted apart: they come at the ACK, between the messages a test
    /// follows step by step (the registry's `start_tests` test the slots themselves).
    start_releases: Arc<std::sync::atomic::AtomicUsize>,
}

impl Actor for ProbeActor {
    type Context = Context<Self>;
}

macro_rules! forward {
    ($msg:ty, $m:ident => $sent:expr) => {
        impl Handler<$msg> for ProbeActor {
            type Result = ();
            fn handle(&mut self, $m: $msg, _ctx: &mut Context<Self>) {
                let _ = self.tx.send($sent);
            }
        }
    };
}

forward!(Call, m => Sent::Call(m));
forward!(AddRoute, m => Sent::AddRoute(m));
forward!(RemoveRoute, m => Sent::RemoveRoute(m));
forward!(Abandon, m => Sent::Abandon(m));
forward!(OutboundHeadersUnsupported, _m => Sent::HeadersUnsupported);
forward!(ScopeMissing, _m => Sent::ScopeMissing);
impl Handler<Release> for ProbeActor {
    type Result = ();
    fn handle(&mut self, m: Release, _ctx: &mut Context<Self>) {
        if m.lock == crate::messages::Lock::Start {
            self.start_releases.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        } else {
            let _ = self.tx.send(Sent::Release(m));
        }
    }
}
forward!(RunEnded, m => Sent::Ended(m));

/// The test's side of the probe.
pub struct Probe {
    /// What the actors sent, in order.
    rx: mpsc::UnboundedReceiver<Sent>,
    /// The probe actor (its recipients make the ports).
    addr: Addr<ProbeActor>,
    /// Start-slot releases received (see [`ProbeActor`]).
    start_releases: Arc<std::sync::atomic::AtomicUsize>,
}

impl Probe {
    /// Starts a probe (inside a running actix System).
    pub fn start() -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let start_releases = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        Self { rx, addr: ProbeActor { tx, start_releases: start_releases.clone() }.start(), start_releases }
    }

    /// Start-slot releases received so far.
    pub fn start_releases(&self) -> usize {
        self.start_releases.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The supervisor's port, answered by this probe.
    pub fn gateway(&self) -> GatewayPort {
        GatewayPort {
            call: self.addr.clone().recipient(),
            add_route: self.addr.clone().recipient(),
            remove_route: self.addr.clone().recipient(),
            abandon: self.addr.clone().recipient(),
            headers_unsupported: self.addr.clone().recipient(),
            scope_missing: self.addr.clone().recipient(),
        }
    }

    /// The registry's port, answered by this probe.
    pub fn registry(&self) -> RegistryPort {
        RegistryPort { release: self.addr.clone().recipient(), ended: self.addr.clone().recipient() }
    }

    /// The next message; fails the test after [`WAIT`].
    pub async fn next(&mut self) -> Sent {
        match tokio::time::timeout(WAIT, self.rx.recv()).await {
            Ok(Some(s)) => s,
            _ => panic!("the actor sent nothing within {WAIT:?}"),
        }
    }

    /// The next message, which must be a call of `method`.
    pub async fn call(&mut self, method: &str) -> Call {
        match self.next().await {
            Sent::Call(c) if c.method == method => c,
            other => panic!("expected a {method} call, got {other:?}"),
        }
    }

    /// The next message, which must be a route registration.
    pub async fn add_route(&mut self) -> AddRoute {
        match self.next().await {
            Sent::AddRoute(r) => r,
            other => panic!("expected AddRoute, got {other:?}"),
        }
    }

    /// Every message until (and including) `RunEnded`, which is returned separately.
    pub async fn until_ended(&mut self) -> (Vec<Sent>, RunEnded) {
        let mut before = Vec::new();
        loop {
            match self.next().await {
                Sent::Ended(e) => return (before, e),
                other => before.push(other),
            }
        }
    }

    /// Asserts that nothing (more) arrives for a while.
    pub async fn quiet(&mut self) {
        if let Ok(Some(s)) = tokio::time::timeout(QUIET, self.rx.recv()).await {
            panic!("unexpected message: {s:?}");
        }
    }
}

/// Answers a call with an `ok` payload.
pub fn answer(call: &Call, payload: Value) {
    let raw = serde_json::value::to_raw_value(&payload).unwrap();
    call.reply_to.as_ref().expect("the call wants an answer").do_send(Reply { tag: call.tag, result: Ok(raw) });
}

/// Answers a call with a failure.
pub fn fail(call: &Call, error: CallError) {
    call.reply_to.as_ref().expect("the call wants an answer").do_send(Reply { tag: call.tag, result: Err(error) });
}

/// Answers a call with a raw payload (which may be anything a broken gateway sends).
pub fn answer_raw(call: &Call, raw: &str) {
    let raw = serde_json::value::RawValue::from_string(raw.to_owned()).unwrap();
    call.reply_to.as_ref().expect("the call wants an answer").do_send(Reply { tag: call.tag, result: Ok(raw) });
}

/// What a sink was told.
#[derive(Default)]
struct Recorded {
    /// Events, in order.
    events: Vec<RunEvent>,
    /// Checkpoints, in order.
    checkpoints: Vec<Checkpoint>,
}

/// A sink that records.
#[derive(Default, Clone)]
pub struct TestSink {
    /// Shared with the test.
    inner: Arc<Mutex<Recorded>>,
}

impl TestSink {
    /// Every event so far.
    pub fn events(&self) -> Vec<RunEvent> {
        self.inner.lock().unwrap().events.clone()
    }

    /// Every checkpoint so far.
    pub fn checkpoints(&self) -> Vec<Checkpoint> {
        self.inner.lock().unwrap().checkpoints.clone()
    }

    /// The one terminal outcome; fails unless there is exactly one and it is the last event.
    pub fn outcome(&self) -> RunOutcome {
        let events = self.events();
        let finished: Vec<&RunOutcome> = events.iter().filter_map(|e| if let RunEvent::Finished(o) = e { Some(o) } else { None }).collect();
        assert_eq!(finished.len(), 1, "exactly one terminal event: {events:?}");
        assert!(matches!(events.last(), Some(RunEvent::Finished(_))), "the terminal event is the last: {events:?}");
        finished[0].clone()
    }

    /// The terminal outcome's status and error code (`""` for ok).
    pub fn ended(&self) -> (RunStatus, &'static str) {
        let o = self.outcome();
        (o.status, o.error.as_ref().map_or("", |e| e.code.as_str()))
    }

    /// The concatenated text deltas.
    pub fn text(&self) -> String {
        self.events().iter().filter_map(|e| if let RunEvent::TextDelta(t) = e { Some(t.as_str()) } else { None }).collect()
    }

    /// Waits (bounded) until the events satisfy `pred`.
    pub async fn wait_for(&self, what: &str, pred: impl Fn(&[RunEvent]) -> bool) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !pred(&self.events()) {
            assert!(tokio::time::Instant::now() < deadline, "{what}: not within {WAIT:?}; events: {:?}", self.events());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl RunSink for TestSink {
    fn emit(&self, event: RunEvent) {
        self.inner.lock().unwrap().events.push(event);
    }
    fn checkpoint(&self, checkpoint: Checkpoint) {
        self.inner.lock().unwrap().checkpoints.push(checkpoint);
    }
}

/// The trace id of every test spec.
pub const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

/// A run of session `session` (a state key of account `acct`), admitted now.
pub fn spec(run_id: &str, session: &str, timeout: Duration) -> RunSpec {
    RunSpec {
        run_id: run_id.to_owned(),
        gateway_run_id: format!("gw-{run_id}"),
        session_key: SessionKey::canonicalize(&format!("agent:main:clawmux:acct.s.{session}")),
        agent_id: "main".to_owned(),
        message: format!("message of {run_id}"),
        model: Some("cogni/fake-model".to_owned()),
        billing_account_id: "acct".to_owned(),
        graph_id: "graph".to_owned(),
        admitted_at: SystemTime::now(),
        timeout,
        traceparent: TraceParent::parse(&format!("00-{TRACE_ID}-00f067aa0ba902b7-01")).unwrap(),
        attribution_token: None,
        branch: None,
    }
}

/// A branch plan for key `key`.
pub fn plan(key: &str) -> BranchPlan {
    BranchPlan { key: key.to_owned(), base_ref: "main".to_owned(), pr_title: None, pr_body: None }
}

/// A protocol-4 connection to process `boot`.
pub fn up(boot: &str, session_scoped: bool) -> GatewayUp {
    GatewayUp { protocol: 4, boot_id: Some(format!("boot:{boot}")), session_scoped, outbound_headers: false }
}

/// The `agent` ACK of `spec`'s run.
pub fn ack(spec: &RunSpec) -> Value {
    json!({"runId": spec.gateway_run_id, "sessionKey": spec.session_key.as_str(), "status": "accepted", "acceptedAt": 1})
}

/// The `agent` final `res` of `spec`'s run.
pub fn final_ok(spec: &RunSpec, text: &str) -> Value {
    json!({"runId": spec.gateway_run_id, "status": "ok", "summary": "completed",
           "result": {"payloads": [{"text": text}], "meta": {"agentMeta": {"usage": {"input": 11, "output": 7}}}}})
}

/// The final `res` of an aborted run (the gateway reports aborts as `timeout`/`aborted`).
pub fn final_aborted(spec: &RunSpec, partial: &str) -> Value {
    json!({"runId": spec.gateway_run_id, "status": "timeout", "summary": "aborted", "result": {"payloads": [{"text": partial}]}})
}

/// A routed `chat` delta of `spec`'s run with cumulative text `text`.
pub fn chat_delta(spec: &RunSpec, text: &str) -> Routed {
    let payload = json!({"runId": spec.gateway_run_id, "sessionKey": spec.session_key.as_str(), "state": "delta",
                         "message": {"role": "assistant", "content": [{"type": "text", "text": text}]}});
    Routed(GatewayEvent::decode("chat", Some(&payload.to_string())).unwrap(), Instant::now())
}

/// A routed `agent` lifecycle event of `spec`'s run.
pub fn lifecycle(spec: &RunSpec, phase: &str) -> Routed {
    let payload = json!({"runId": spec.gateway_run_id, "sessionKey": spec.session_key.as_str(), "stream": "lifecycle", "data": {"phase": phase}});
    Routed(GatewayEvent::decode("agent", Some(&payload.to_string())).unwrap(), Instant::now())
}

/// One step of a [`HandWorkspace`] waiting for the test: the plan it was asked for, and where the
/// test sends its result.
pub struct Step<T> {
    /// The branch the step works on.
    pub plan: BranchPlan,
    /// The step's result (dropping it leaves the step hanging forever).
    pub done: oneshot::Sender<T>,
}

/// A workspace whose `prepare` and `publish` finish when the test says so.
pub struct HandWorkspace {
    /// `prepare` calls, in order.
    prepares: mpsc::UnboundedSender<Step<Result<Prepared, WorkspaceError>>>,
    /// `publish` calls, in order.
    publishes: mpsc::UnboundedSender<Step<Published>>,
}

/// The test's side of a [`HandWorkspace`].
pub struct WorkspaceSteps {
    /// `prepare` calls.
    pub prepares: mpsc::UnboundedReceiver<Step<Result<Prepared, WorkspaceError>>>,
    /// `publish` calls.
    pub publishes: mpsc::UnboundedReceiver<Step<Published>>,
}

impl HandWorkspace {
    /// A workspace and the test's handle on it.
    pub fn pair() -> (Arc<dyn Workspace>, WorkspaceSteps) {
        let (ptx, prx) = mpsc::unbounded_channel();
        let (utx, urx) = mpsc::unbounded_channel();
        (Arc::new(Self { prepares: ptx, publishes: utx }), WorkspaceSteps { prepares: prx, publishes: urx })
    }
}

/// Sends a step to the test and waits for its result (forever when the test drops it).
fn step<T: Send + 'static>(to: &mpsc::UnboundedSender<Step<T>>, plan: &BranchPlan) -> BoxFuture<'static, T> {
    let (done, rx) = oneshot::channel();
    let _ = to.send(Step { plan: plan.clone(), done });
    Box::pin(async move {
        match rx.await {
            Ok(v) => v,
            Err(_) => std::future::pending().await,
        }
    })
}

impl Workspace for HandWorkspace {
    fn prepare(&self, plan: &BranchPlan) -> BoxFuture<'static, Result<Prepared, WorkspaceError>> {
        step(&self.prepares, plan)
    }
    fn publish(&self, plan: &BranchPlan) -> BoxFuture<'static, Published> {
        step(&self.publishes, plan)
    }
}

impl WorkspaceSteps {
    /// The next `prepare`; fails the test after [`WAIT`].
    pub async fn prepare(&mut self) -> Step<Result<Prepared, WorkspaceError>> {
        tokio::time::timeout(WAIT, self.prepares.recv()).await.ok().flatten().expect("a prepare call")
    }

    /// The next `publish`; fails the test after [`WAIT`].
    pub async fn publish(&mut self) -> Step<Published> {
        tokio::time::timeout(WAIT, self.publishes.recv()).await.ok().flatten().expect("a publish call")
    }

    /// Asserts that no step was asked for (now).
    pub fn none_asked(&mut self) {
        assert!(self.prepares.try_recv().is_err(), "an unexpected prepare");
        assert!(self.publishes.try_recv().is_err(), "an unexpected publish");
    }
}

/// The worktree a prepare of `plan` makes.
pub fn prepared(plan: &BranchPlan) -> Prepared {
    Prepared { path: format!("/workspace/wt/{}", plan.key), branch: plan.branch() }
}

/// What a publish of `plan` reports.
pub fn published(plan: &BranchPlan) -> Published {
    Published { relay: json!({"branch": plan.branch(), "commitCount": 1, "pushed": true, "pushedCommits": 1}) }
}

/// A registry under test whose supervisor is `probe`: `max_runs`, `max_starting` start slots, the
/// connection `connected` (its status handle returned, for tests that change it), `workspace` for
/// branch runs. Not started: a test may add shards first.
pub fn test_registry(
    probe: &Probe,
    max_runs: usize,
    max_starting: usize,
    connected: bool,
    workspace: Option<Arc<dyn Workspace>>,
) -> (crate::registry::Registry, crate::supervisor::StatusHandle) {
    let status: crate::supervisor::StatusHandle =
        Arc::new(std::sync::RwLock::new(crate::supervisor::GatewayStatus { connected, ..crate::supervisor::GatewayStatus::default() }));
    let session = crate::session::SessionConfig {
        recovery_window: Duration::from_secs(30),
        abort_grace: Duration::from_secs(30),
        request_timeout: Duration::from_secs(7),
        outbound_headers: crate::session::OutboundHeadersMode::Auto,
        max_output_bytes: crate::session::MAX_OUTPUT_BYTES,
    };
    let metrics = crate::metrics::Metrics::new(&prometheus::Registry::new()).expect("metrics");
    let cfg = crate::registry::RegistryConfig { max_runs, max_starting, session };
    (crate::registry::Registry::new(cfg, metrics, status.clone(), probe.gateway(), workspace), status)
}
