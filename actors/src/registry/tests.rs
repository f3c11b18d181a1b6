//! The registry with real session actors and a probe in place of the supervisor: admission, the
//! session-key queue (FIFO), the branch key held from the workspace to the end of publishing, cancels
//! of queued runs, `ifBusy`, and both shutdown modes.
#![allow(clippy::unwrap_used)]

use super::*;
use crate::branch::Workspace;
use crate::messages::{Call, InFlight};
use crate::run::{CancelReason, Checkpoint, RunEvent, RunSpec, RunStatus};
use crate::testkit::*;
use clawmux_protocol::methods::name;
use serde_json::json;
use std::time::Duration;

/// A registry under test and the probe that plays its supervisor.
struct World {
    reg: Addr<Registry>,
    probe: Probe,
    status: StatusHandle,
}

fn world(max_runs: usize, workspace: Option<Arc<dyn Workspace>>) -> World {
    let probe = Probe::start();
    let (reg, status) = test_registry(&probe, max_runs, 0, true, workspace);
    let reg = reg.start();
    reg.do_send(Link(Some(up("A", false))));
    World { reg, probe, status }
}

/// A run of session `session`, its sink.
fn run(id: &str, session: &str) -> (RunSpec, TestSink) {
    (spec(id, session, Duration::from_secs(60)), TestSink::default())
}

fn branch_run(id: &str, session: &str, key: &str) -> (RunSpec, TestSink) {
    let (mut s, sink) = run(id, session);
    s.branch = Some(plan(key));
    (s, sink)
}

impl World {
    async fn submit_with(&self, spec: &RunSpec, sink: &TestSink, if_busy: IfBusy) -> Result<Admitted, AdmitError> {
        self.reg.send(Submit { spec: spec.clone(), sink: Arc::new(sink.clone()), resume: None, if_busy, external: None, shard: None }).await.unwrap()
    }

    async fn submit(&self, spec: &RunSpec, sink: &TestSink) -> Result<Admitted, AdmitError> {
        self.submit_with(spec, sink, IfBusy::Enqueue).await
    }

    async fn cancel(&self, run_id: &str) -> bool {
        self.reg.send(Cancel { run_id: run_id.to_owned(), reason: CancelReason::Api }).await.unwrap()
    }

    async fn in_flight(&self) -> usize {
        self.reg.send(InFlight).await.unwrap()
    }

    /// Waits (bounded) until `n` runs are live.
    async fn live(&self, n: usize) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while self.in_flight().await != n {
            assert!(tokio::time::Instant::now() < deadline, "{} runs live, not {n}", self.in_flight().await);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The run's gateway start: its route, `sessions.patch` (answered), its `agent` call.
    async fn started(&mut self, spec: &RunSpec) -> Call {
        let route = self.probe.add_route().await;
        assert_eq!(route.gateway_run_id, spec.gateway_run_id, "the run that started");
        let patch = self.probe.call(name::SESSIONS_PATCH).await;
        assert_eq!(patch.params["key"], spec.session_key.as_str());
        answer(&patch, json!({}));
        let agent = self.probe.call(name::AGENT).await;
        assert_eq!(agent.params["idempotencyKey"], spec.gateway_run_id.as_str());
        agent
    }

    /// The run's `agent` is ACKed and ends ok; its route is removed.
    async fn finish_ok(&mut self, spec: &RunSpec, agent: &Call) {
        answer(agent, ack(spec));
        answer(agent, final_ok(spec, "done"));
        self.removed(spec).await;
    }

    async fn removed(&mut self, spec: &RunSpec) {
        match self.probe.next().await {
            Sent::RemoveRoute(r) => assert_eq!(r.gateway_run_id, spec.gateway_run_id),
            other => panic!("expected {}'s route removed, got {other:?}", spec.run_id),
        }
    }
}

fn has_turn(sink: &TestSink) -> bool {
    sink.checkpoints().contains(&Checkpoint::Running)
}

#[actix_rt::test]
async fn runs_of_one_session_run_one_after_another_in_admission_order() {
    let mut w = world(10, None);
    let (a, sa) = run("a", "s1");
    let (b, sb) = run("b", "s1");
    let (c, sc) = run("c", "s1");
    assert_eq!(w.submit(&a, &sa).await, Ok(Admitted::Started));
    assert_eq!(w.submit(&b, &sb).await, Ok(Admitted::Queued));
    assert_eq!(w.submit(&c, &sc).await, Ok(Admitted::Queued));
    for (spec, sink) in [(&a, &sa), (&b, &sb), (&c, &sc)] {
        let agent = w.started(spec).await;
        w.finish_ok(spec, &agent).await;
        sink.wait_for("ok", |e| matches!(e.last(), Some(RunEvent::Finished(_)))).await;
        assert_eq!(sink.ended(), (RunStatus::Ok, ""));
    }
    w.live(0).await;
    w.probe.quiet().await;
}

#[actix_rt::test]
async fn runs_of_different_sessions_run_side_by_side() {
    let mut w = world(10, None);
    let (a, sa) = run("a", "s1");
    let (b, sb) = run("b", "s2");
    assert_eq!(w.submit(&a, &sa).await, Ok(Admitted::Started));
    assert_eq!(w.submit(&b, &sb).await, Ok(Admitted::Started));
    let mut routes = vec![w.probe.add_route().await.gateway_run_id];
    // Each run's route comes before its patch; the two runs interleave freely.
    while routes.len() < 2 {
        match w.probe.next().await {
            Sent::AddRoute(r) => routes.push(r.gateway_run_id),
            Sent::Call(c) if c.method == name::SESSIONS_PATCH => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    routes.sort();
    assert_eq!(routes, [a.gateway_run_id.clone(), b.gateway_run_id.clone()], "both started before either ended");
}

#[actix_rt::test]
async fn admission_refuses_over_capacity_duplicates_a_down_gateway_and_busy_sessions_on_request() {
    let w = world(2, None);
    let (a, sa) = run("a", "s1");
    let (b, sb) = run("b", "s2");
    let (c, sc) = run("c", "s3");
    assert_eq!(w.submit(&a, &sa).await, Ok(Admitted::Started));
    assert_eq!(w.submit(&a, &sa).await, Err(AdmitError::Duplicate));
    let (busy, sbusy) = run("busy", "s1");
    assert_eq!(w.submit_with(&busy, &sbusy, IfBusy::Reject).await, Err(AdmitError::SessionBusy));
    assert_eq!(w.submit(&b, &sb).await, Ok(Admitted::Started));
    assert_eq!(w.submit(&c, &sc).await, Err(AdmitError::AtCapacity(2)), "queued runs count too");
    assert!(w.cancel("a").await);
    w.live(1).await;
    assert_eq!(w.submit(&c, &sc).await, Ok(Admitted::Started), "room again once a run ended");
    assert!(sbusy.events().is_empty() && sc.events().is_empty(), "refused runs get no events");
    w.status.write().unwrap().connected = false;
    let (d, sd) = run("d", "s4");
    assert!(w.cancel("b").await);
    w.live(1).await;
    assert!(matches!(w.submit(&d, &sd).await, Err(AdmitError::GatewayDown(_))));
}

#[actix_rt::test]
async fn a_cancelled_queued_run_leaves_the_queue_and_the_next_keeps_its_place() {
    let mut w = world(10, None);
    let (a, sa) = run("a", "s1");
    let (b, sb) = run("b", "s1");
    let (c, sc) = run("c", "s1");
    w.submit(&a, &sa).await.unwrap();
    w.submit(&b, &sb).await.unwrap();
    w.submit(&c, &sc).await.unwrap();
    let agent = w.started(&a).await;
    assert!(w.cancel("b").await, "a queued run is live");
    sb.wait_for("b aborted", |e| !e.is_empty()).await;
    assert_eq!(sb.ended(), (RunStatus::Aborted, "aborted"));
    assert!(!has_turn(&sb));
    assert!(!has_turn(&sc), "c still waits for a");
    w.finish_ok(&a, &agent).await;
    let agent = w.started(&c).await;
    w.finish_ok(&c, &agent).await;
    w.live(0).await;
    assert!(!has_turn(&sb), "b never ran");
    assert!(!w.cancel("b").await, "an ended run is not live");
    assert!(!w.cancel("nobody").await);
}

#[actix_rt::test]
async fn an_interrupting_run_cancels_the_running_one_and_goes_next() {
    let mut w = world(10, None);
    let (a, sa) = run("a", "s1");
    let (b, sb) = run("b", "s1");
    let (c, sc) = run("c", "s1");
    w.submit(&a, &sa).await.unwrap();
    let agent = w.started(&a).await;
    answer(&agent, ack(&a));
    assert_eq!(w.submit(&b, &sb).await, Ok(Admitted::Queued));
    assert_eq!(w.submit_with(&c, &sc, IfBusy::Interrupt).await, Ok(Admitted::Queued));
    let abort = w.probe.call(name::CHAT_ABORT).await;
    assert_eq!(abort.params["runId"], a.gateway_run_id.as_str());
    answer(&agent, final_aborted(&a, ""));
    w.removed(&a).await;
    sa.wait_for("a ended", |e| matches!(e.last(), Some(RunEvent::Finished(_)))).await;
    assert_eq!(sa.ended(), (RunStatus::Aborted, "aborted"));
    let agent = w.started(&c).await;
    assert!(!has_turn(&sb), "the interrupting run goes before the queued one");
    w.finish_ok(&c, &agent).await;
    let agent = w.started(&b).await;
    w.finish_ok(&b, &agent).await;
    w.live(0).await;
}

/// The branch key is taken after the session key and held until publishing ends, in admission
/// order; the session key is free while the branch publishes.
#[actix_rt::test]
async fn the_branch_key_is_held_from_the_workspace_to_the_end_of_publishing_in_order() {
    let (ws, mut steps) = HandWorkspace::pair();
    let mut w = world(10, Some(ws));
    let (r1, s1) = branch_run("r1", "s1", "k");
    let (r2, s2) = branch_run("r2", "s2", "k");
    let (r3, s3) = branch_run("r3", "s3", "k");
    let (r4, s4) = run("r4", "s1");
    for (spec, sink) in [(&r1, &s1), (&r2, &s2), (&r3, &s3)] {
        assert_eq!(w.submit(spec, sink).await, Ok(Admitted::Started), "{} holds its session key", spec.run_id);
    }
    assert_eq!(w.submit(&r4, &s4).await, Ok(Admitted::Queued), "r4 waits for r1's session key");
    let waiting = RunEvent::WaitingForBranch { branch: "sandbox/k".to_owned() };
    s2.wait_for("r2 waits", |e| e.first() == Some(&waiting)).await;
    s3.wait_for("r3 waits", |e| e.first() == Some(&waiting)).await;

    let prep = steps.prepare().await;
    assert_eq!(s1.checkpoints(), vec![Checkpoint::Running, Checkpoint::Preparing]);
    let _ = prep.done.send(Ok(prepared(&prep.plan)));
    let agent = w.started(&r1).await;
    w.finish_ok(&r1, &agent).await;
    let publish = steps.publish().await;
    // r1 publishes: its session key went to r4, its branch key stays with it.
    let agent4 = w.started(&r4).await;
    w.finish_ok(&r4, &agent4).await;
    s4.wait_for("r4 ended", |e| matches!(e.last(), Some(RunEvent::Finished(_)))).await;
    w.probe.quiet().await;
    steps.none_asked();
    assert!(!s2.checkpoints().contains(&Checkpoint::Preparing));

    let _ = publish.done.send(published(&plan("k")));
    s1.wait_for("r1 ended", |e| matches!(e.last(), Some(RunEvent::Finished(_)))).await;
    assert_eq!(s1.ended(), (RunStatus::Ok, ""));
    let prep2 = steps.prepare().await;
    assert!(s2.checkpoints().contains(&Checkpoint::Preparing), "r2, admitted before r3, goes first");
    assert!(!s3.checkpoints().contains(&Checkpoint::Preparing));
    // r2 is aborted while preparing: it ends at once, and the branch goes to the next in line once
    // the prepare under way is over.
    assert!(w.cancel("r2").await);
    s2.wait_for("r2 ended", |e| matches!(e.last(), Some(RunEvent::Finished(_)))).await;
    assert_eq!(s2.ended(), (RunStatus::Aborted, "aborted"));
    w.probe.quiet().await;
    steps.none_asked();
    let _ = prep2.done.send(Ok(prepared(&prep2.plan)));
    let prep3 = steps.prepare().await;
    assert!(s3.checkpoints().contains(&Checkpoint::Preparing));
    assert!(w.cancel("r3").await);
    let _ = prep3.done.send(Err(crate::branch::WorkspaceError::Failed("late".to_owned())));
    w.live(0).await;
}

/// Handoff: nothing ends, nothing is cancelled on the gateway, queued runs do not start; every run
/// leaves the registry and nothing new is admitted.
#[actix_rt::test]
async fn drain_in_handoff_mode_suspends_every_run_untouched() {
    let mut w = world(10, None);
    let (a, sa) = run("a", "s1");
    let (b, sb) = run("b", "s1");
    w.submit(&a, &sa).await.unwrap();
    w.submit(&b, &sb).await.unwrap();
    let agent = w.started(&a).await;
    answer(&agent, ack(&a));
    sa.wait_for("a accepted", |e| !e.is_empty()).await;
    // A cancel right behind the drain (both in the registry's mailbox before it acts: the actor
    // cannot have reported its end in between): its actor leaves without acting on it, so it is
    // not found (the caller records the abort for whoever continues the run), never taken and lost.
    let drained = w.reg.send(Drain(ShutdownMode::Handoff));
    let cancelled = w.reg.send(Cancel { run_id: a.run_id.clone(), reason: CancelReason::Api });
    assert_eq!(drained.await.unwrap(), 2);
    assert!(!cancelled.await.unwrap(), "a cancel of a suspending run was taken");
    w.removed(&a).await;
    w.live(0).await;
    w.probe.quiet().await;
    assert!(!sa.events().iter().chain(sb.events().iter()).any(|e| matches!(e, RunEvent::Finished(_))), "no terminal event");
    assert!(!has_turn(&sb), "the queued run did not start on its way out");
    let (c, sc) = run("c", "s2");
    assert_eq!(w.submit(&c, &sc).await, Err(AdmitError::ShuttingDown));
}

/// Cancel: every run ends `aborted` and the running one's gateway run is cancelled.
#[actix_rt::test]
async fn drain_in_cancel_mode_aborts_every_run_and_its_gateway_run() {
    let mut w = world(10, None);
    let (a, sa) = run("a", "s1");
    let (b, sb) = run("b", "s1");
    w.submit(&a, &sa).await.unwrap();
    w.submit(&b, &sb).await.unwrap();
    let agent = w.started(&a).await;
    answer(&agent, ack(&a));
    sa.wait_for("a accepted", |e| !e.is_empty()).await;
    assert_eq!(w.reg.send(Drain(ShutdownMode::Cancel)).await.unwrap(), 2);
    let abort = w.probe.call(name::CHAT_ABORT).await;
    assert_eq!(abort.params["runId"], a.gateway_run_id.as_str());
    answer(&agent, final_aborted(&a, ""));
    w.removed(&a).await;
    w.live(0).await;
    w.probe.quiet().await;
    assert_eq!(sa.ended(), (RunStatus::Aborted, "aborted"));
    assert_eq!(sb.ended(), (RunStatus::Aborted, "aborted"));
    assert!(!has_turn(&sb));
    let (c, sc) = run("c", "s2");
    assert_eq!(w.submit(&c, &sc).await, Err(AdmitError::ShuttingDown));
}
