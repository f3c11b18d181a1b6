//! The session actor driven through probes in place of the supervisor and the registry: every
//! message it sends is checked, every gateway answer is the test's. Each test ends by checking that
//! the run emitted exactly one terminal event (as its last event) and that nothing follows.
#![allow(clippy::unwrap_used)]

use super::*;
use crate::branch::{Published, WorkspaceError};
use crate::messages::{CallError, Lock, Wait};
use crate::run::{Checkpoint, ErrorCode, Phase, RunEvent, RunStatus};
use crate::start_clock::StartStage;
use crate::testkit::*;
use clawmux_protocol::{ErrorShape, TraceParent};
use serde_json::json;

/// A run under test: the actor, the probe it talks to, its sink.
struct Harness {
    addr: Addr<SessionActor>,
    probe: Probe,
    sink: TestSink,
    spec: RunSpec,
    metrics: Metrics,
}

fn cfg() -> SessionConfig {
    SessionConfig {
        recovery_window: Duration::from_secs(30),
        abort_grace: Duration::from_secs(30),
        request_timeout: Duration::from_secs(7),
        outbound_headers: OutboundHeadersMode::Auto,
        max_output_bytes: crate::session::MAX_OUTPUT_BYTES,
    }
}

fn start(spec: RunSpec, link: Option<GatewayUp>, cfg: SessionConfig, workspace: Option<Arc<dyn Workspace>>) -> Harness {
    start_with(spec, link, cfg, workspace, None)
}

fn start_with(spec: RunSpec, link: Option<GatewayUp>, cfg: SessionConfig, workspace: Option<Arc<dyn Workspace>>, resume: Option<Resume>) -> Harness {
    let probe = Probe::start();
    let sink = TestSink::default();
    let metrics = Metrics::new(&prometheus::Registry::new()).unwrap();
    let actor = SessionActor::new(
        spec.clone(),
        Arc::new(sink.clone()),
        probe.gateway(),
        probe.registry(),
        workspace,
        cfg,
        metrics.clone(),
        link,
        resume,
    );
    Harness { addr: actor.start(), probe, sink, spec, metrics }
}

fn one_minute(run_id: &str) -> RunSpec {
    spec(run_id, run_id, Duration::from_secs(60))
}

impl Harness {
    /// Gives the run its turn and answers everything up to (and returns) the `agent` call.
    async fn up_to_agent(&mut self, scoped: bool) -> Call {
        self.addr.do_send(Turn::Go);
        let route = self.probe.add_route().await;
        assert_eq!((route.session_key.as_str(), route.gateway_run_id.as_str()), (self.spec.session_key.as_str(), self.spec.gateway_run_id.as_str()));
        let patch = self.probe.call(name::SESSIONS_PATCH).await;
        answer(&patch, json!({"ok": true}));
        if scoped {
            let sub = self.probe.call(name::SESSIONS_SUBSCRIBE).await;
            answer(&sub, json!({}));
        }
        self.probe.call(name::AGENT).await
    }

    /// As `up_to_agent`, then the ACK (and waits for `accepted`).
    async fn accepted(&mut self, scoped: bool) -> Call {
        let agent = self.up_to_agent(scoped).await;
        answer(&agent, ack(&self.spec));
        self.sink.wait_for("accepted", |e| e.iter().any(|e| matches!(e, RunEvent::Accepted { .. }))).await;
        agent
    }

    /// Every message up to the end; returns them and the status `RunEnded` carried.
    async fn ended(&mut self) -> (Vec<Sent>, Option<RunStatus>) {
        let (before, ended) = self.probe.until_ended().await;
        assert_eq!(ended.run_id, self.spec.run_id);
        (before, ended.status)
    }

    /// The run is over: one terminal event, and nothing more happens even when late answers and
    /// events arrive.
    async fn settled(&mut self, agent: Option<&Call>) {
        let before = self.sink.events().len();
        if let Some(agent) = agent {
            answer(agent, final_ok(&self.spec, "late"));
        }
        self.addr.do_send(chat_delta(&self.spec, "late text"));
        self.addr.do_send(CancelRun(CancelReason::Api));
        self.probe.quiet().await;
        assert_eq!(self.sink.events().len(), before, "nothing after the terminal event: {:?}", self.sink.events());
        self.sink.outcome();
    }
}

fn methods(sent: &[Sent]) -> Vec<String> {
    sent.iter()
        .map(|s| match s {
            Sent::Call(c) => c.method.to_owned(),
            Sent::AddRoute(_) => "add_route".to_owned(),
            Sent::RemoveRoute(_) => "remove_route".to_owned(),
            Sent::Abandon(_) => "abandon".to_owned(),
            Sent::HeadersUnsupported => "headers_unsupported".to_owned(),
            Sent::ScopeMissing => "scope_missing".to_owned(),
            Sent::Release(r) => format!("release_{:?}", r.lock).to_lowercase(),
            Sent::Ended(_) => "ended".to_owned(),
        })
        .collect()
}

fn the_call<'a>(sent: &'a [Sent], method: &str) -> &'a Call {
    let mut calls = sent.iter().filter_map(|s| if let Sent::Call(c) = s { Some(c) } else { None }).filter(|c| c.method == method);
    let c = calls.next().unwrap_or_else(|| panic!("no {method} call in {:?}", methods(sent)));
    assert!(calls.next().is_none(), "{method} sent twice: {:?}", methods(sent));
    c
}

fn abort_params(spec: &RunSpec) -> serde_json::Value {
    json!({"sessionKey": spec.session_key.as_str(), "runId": spec.gateway_run_id})
}

// ---------------------------------------------------------------------------------------------
// The normal sequence
// ---------------------------------------------------------------------------------------------

#[actix_rt::test]
async fn a_run_patches_subscribes_sends_agent_streams_and_ends_once() {
    let mut h = start(one_minute("r1"), Some(up("A", true)), cfg(), None);
    h.addr.do_send(Turn::Go);
    let route = h.probe.add_route().await;
    assert_eq!(route.gateway_run_id, h.spec.gateway_run_id);
    let patch = h.probe.call(name::SESSIONS_PATCH).await;
    assert_eq!(patch.params, json!({"key": h.spec.session_key.as_str(), "model": "cogni/fake-model"}), "no outboundHeaders on this gateway");
    answer(&patch, json!({"ok": true}));
    let sub = h.probe.call(name::SESSIONS_SUBSCRIBE).await;
    assert_eq!(sub.params, json!({"key": h.spec.session_key.as_str()}));
    answer(&sub, json!({}));
    let agent = h.probe.call(name::AGENT).await;
    assert_eq!(
        agent.params,
        json!({"message": "message of r1", "agentId": "main", "sessionKey": h.spec.session_key.as_str(), "idempotencyKey": h.spec.gateway_run_id}),
        "the gateway run id is the idempotency key; no gateway-side timeout on protocol 4"
    );
    let tp = TraceParent::parse(agent.traceparent.as_deref().expect("a traceparent on the agent frame")).unwrap();
    assert_eq!(tp.trace_id(), TRACE_ID, "the caller's trace");
    assert_ne!(tp.span_id(), h.spec.traceparent.span_id(), "a child span");
    assert_eq!(agent.wait, Wait::Caller, "the run's own timeout bounds the agent request");
    assert_eq!(h.sink.checkpoints(), vec![Checkpoint::Running, Checkpoint::Sending { boot_id: Some("boot:A".to_owned()) }]);

    answer(&agent, ack(&h.spec));
    h.addr.do_send(lifecycle(&h.spec, "start"));
    h.addr.do_send(chat_delta(&h.spec, "Hel"));
    h.addr.do_send(chat_delta(&h.spec, "Hello"));
    answer(&agent, final_ok(&h.spec, "Hello world"));
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Ok));
    assert_eq!(methods(&sent), ["sessions.messages.unsubscribe", "remove_route", "release_session"]);
    assert_eq!(h.probe.start_releases(), 1, "the start slot is given back once, at the ACK");
    assert_eq!(the_call(&sent, name::SESSIONS_UNSUBSCRIBE).params, json!({"key": h.spec.session_key.as_str()}));
    assert_eq!(
        h.sink.events(),
        vec![
            RunEvent::Accepted { gateway_run_id: h.spec.gateway_run_id.clone() },
            RunEvent::Status { phase: Phase::Thinking, tool: None },
            RunEvent::TextDelta("Hel".to_owned()),
            RunEvent::TextDelta("lo".to_owned()),
            RunEvent::TextDelta(" world".to_owned()),
            RunEvent::Finished(RunOutcome::ok("Hello world".to_owned(), Some((11, 7)))),
        ]
    );
    h.settled(Some(&agent)).await;
}

/// `clawmux_run_start_seconds`: (count, sum) of one stage.
fn start_stage(m: &Metrics, stage: StartStage) -> (u64, f64) {
    let h = m.run_start.with_label_values(&[stage.as_str()]);
    (h.get_sample_count(), h.get_sample_sum())
}

/// Each stage of a run's start is timed once, from the stage before it: the turn from admission,
/// the configuration (patch, subscribe) from the turn, the gateway from `agent` to its ACK. The
/// waits are the test's (50 ms, 1 s, 2 s): each stage must hold its own wait and not the next
/// one's (the upper bounds leave that much room for a busy machine).
#[actix_rt::test]
async fn the_stages_of_a_start_are_each_timed_once() {
    let mut h = start(one_minute("r1"), Some(up("A", true)), cfg(), None);
    tokio::time::sleep(Duration::from_millis(50)).await;
    h.addr.do_send(Turn::Go);
    h.probe.add_route().await;
    let patch = h.probe.call(name::SESSIONS_PATCH).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    answer(&patch, json!({"ok": true}));
    answer(&h.probe.call(name::SESSIONS_SUBSCRIBE).await, json!({}));
    let agent = h.probe.call(name::AGENT).await;
    tokio::time::sleep(Duration::from_millis(2000)).await;
    answer(&agent, ack(&h.spec));
    h.sink.wait_for("accepted", |e| e.iter().any(|e| matches!(e, RunEvent::Accepted { .. }))).await;
    let [turn, configure, gateway] = [StartStage::Turn, StartStage::Configure, StartStage::Gateway].map(|s| start_stage(&h.metrics, s));
    assert_eq!((turn.0, configure.0, gateway.0), (1, 1, 1), "one sample per stage");
    assert!((0.05..1.0).contains(&turn.1), "turn {:.3} s", turn.1);
    assert!((1.0..2.0).contains(&configure.1), "configure {:.3} s", configure.1);
    assert!((2.0..10.0).contains(&gateway.1), "gateway {:.3} s", gateway.1);
    assert_eq!(start_stage(&h.metrics, StartStage::Admit).0, 0, "admit is the HTTP layer's");
    answer(&agent, final_ok(&h.spec, "done"));
    assert_eq!(h.ended().await.1, Some(RunStatus::Ok));
    assert_eq!(start_stage(&h.metrics, StartStage::Gateway).0, 1);
    h.settled(Some(&agent)).await;
}

/// A run continued after a restart started its stages in another process: none is timed here.
#[actix_rt::test]
async fn a_resumed_run_times_no_stage() {
    let resume = Resume { stage: ResumeStage::Start, emitted: String::new(), accepted: false };
    let mut h = start_with(one_minute("r1"), Some(up("A", true)), cfg(), None, Some(resume));
    let agent = h.accepted(true).await;
    for stage in StartStage::ALL {
        assert_eq!(start_stage(&h.metrics, stage).0, 0, "{stage:?}");
    }
    answer(&agent, final_ok(&h.spec, "done"));
    assert_eq!(h.ended().await.1, Some(RunStatus::Ok));
    h.settled(Some(&agent)).await;
}

/// The subscribe goes out with the patch, not after its answer (one gateway round trip less per
/// run), and `agent` waits for both answers, whichever comes first; a patch retried on the same
/// connection does not subscribe again.
#[actix_rt::test]
async fn the_subscribe_goes_with_the_patch_and_agent_waits_for_both_answers() {
    for subscribe_answered_first in [true, false] {
        let id = if subscribe_answered_first { "sub-first" } else { "patch-first" };
        let mut h = start(one_minute(id), Some(up("A", true)), cfg(), None);
        h.addr.do_send(Turn::Go);
        h.probe.add_route().await;
        let patch = h.probe.call(name::SESSIONS_PATCH).await;
        let sub = h.probe.call(name::SESSIONS_SUBSCRIBE).await;
        let (first, second) = if subscribe_answered_first { (&sub, &patch) } else { (&patch, &sub) };
        answer(first, json!({"ok": true}));
        h.probe.quiet().await;
        answer(second, json!({"ok": true}));
        let agent = h.probe.call(name::AGENT).await;
        answer(&agent, ack(&h.spec));
        answer(&agent, final_ok(&h.spec, "done"));
        let (sent, status) = h.ended().await;
        assert_eq!(status, Some(RunStatus::Ok), "{id}: {:?}", methods(&sent));
    }
    // A gateway refusing the patch's outboundHeaders: the patch is sent again, the subscription
    // (still this connection's) is not.
    let mut c = cfg();
    c.outbound_headers = OutboundHeadersMode::Auto;
    let mut link = up("A", true);
    link.outbound_headers = true;
    let mut h = start(one_minute("headers"), Some(link), c, None);
    h.addr.do_send(Turn::Go);
    h.probe.add_route().await;
    let patch = h.probe.call(name::SESSIONS_PATCH).await;
    let sub = h.probe.call(name::SESSIONS_SUBSCRIBE).await;
    fail(&patch, CallError::Gateway(clawmux_protocol::ErrorShape::new("INVALID_REQUEST", "invalid params: unexpected property outboundHeaders")));
    assert!(matches!(h.probe.next().await, Sent::HeadersUnsupported));
    let again = h.probe.call(name::SESSIONS_PATCH).await;
    assert!(again.params.get("outboundHeaders").is_none(), "{:?}", again.params);
    answer(&again, json!({"ok": true}));
    h.probe.quiet().await;
    answer(&sub, json!({}));
    let agent = h.probe.call(name::AGENT).await;
    answer(&agent, ack(&h.spec));
    answer(&agent, final_ok(&h.spec, "done"));
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Ok), "{:?}", methods(&sent));
    assert!(!methods(&sent).contains(&name::SESSIONS_SUBSCRIBE.to_owned()), "subscribed once: {:?}", methods(&sent));
}

/// A patch the gateway answers "unavailable" is sent again later, and its subscribe with it: the
/// first subscribe's answer, ok or failed, arriving while the run waits, neither ends the run nor
/// stands in for the new one (found by review: the run waited for an answer that never came, or
/// ended `gateway_rejected` on the first subscribe's error).
#[actix_rt::test]
async fn a_retried_patch_subscribes_again_and_the_first_subscribes_answer_is_ignored() {
    for first_subscribe_fails in [false, true] {
        let mut h = start(one_minute(if first_subscribe_fails { "sub-fails" } else { "sub-ok" }), Some(up("A", true)), cfg(), None);
        h.addr.do_send(Turn::Go);
        h.probe.add_route().await;
        let patch = h.probe.call(name::SESSIONS_PATCH).await;
        let sub = h.probe.call(name::SESSIONS_SUBSCRIBE).await;
        fail(&patch, CallError::Gateway(clawmux_protocol::ErrorShape::new("UNAVAILABLE", "gateway starting; retry shortly")));
        match first_subscribe_fails {
            true => fail(&sub, CallError::Gateway(clawmux_protocol::ErrorShape::new("UNAVAILABLE", "gateway starting; retry shortly"))),
            false => answer(&sub, json!({})),
        }
        // The retry (after ~500 ms): both again; agent only once both are answered.
        let again = h.probe.call(name::SESSIONS_PATCH).await;
        let sub_again = h.probe.call(name::SESSIONS_SUBSCRIBE).await;
        answer(&again, json!({"ok": true}));
        h.probe.quiet().await;
        answer(&sub_again, json!({}));
        let agent = h.probe.call(name::AGENT).await;
        answer(&agent, ack(&h.spec));
        answer(&agent, final_ok(&h.spec, "done"));
        let (sent, status) = h.ended().await;
        assert_eq!(status, Some(RunStatus::Ok), "{first_subscribe_fails}: {:?}", methods(&sent));
    }
}

#[actix_rt::test]
async fn a_gateway_without_session_scoped_events_gets_no_subscribe() {
    let mut h = start(one_minute("r1"), Some(up("A", false)), cfg(), None);
    let agent = h.up_to_agent(false).await;
    answer(&agent, ack(&h.spec));
    answer(&agent, final_ok(&h.spec, "done"));
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Ok));
    assert_eq!(methods(&sent), ["remove_route", "release_session"], "no unsubscribe either");
    assert_eq!(h.sink.text(), "done", "the final's text, as a delta");
    h.settled(Some(&agent)).await;
}

#[actix_rt::test]
async fn a_down_connection_at_the_turn_waits_for_it_then_starts() {
    let mut h = start(one_minute("r1"), None, cfg(), None);
    h.addr.do_send(Turn::Go);
    h.probe.add_route().await;
    h.probe.quiet().await;
    h.addr.do_send(Link(Some(up("A", false))));
    let patch = h.probe.call(name::SESSIONS_PATCH).await;
    answer(&patch, json!({}));
    let agent = h.probe.call(name::AGENT).await;
    answer(&agent, ack(&h.spec));
    answer(&agent, final_ok(&h.spec, "ok"));
    assert_eq!(h.ended().await.1, Some(RunStatus::Ok));
    h.settled(Some(&agent)).await;
}

// ---------------------------------------------------------------------------------------------
// outboundHeaders
// ---------------------------------------------------------------------------------------------

fn headers_rejected() -> CallError {
    CallError::Gateway(ErrorShape::new("INVALID_REQUEST", "invalid sessions.patch params: at root: unexpected property 'outboundHeaders'"))
}

#[actix_rt::test]
async fn rejected_outbound_headers_in_auto_mode_are_dropped_and_the_patch_repeated() {
    let link = GatewayUp { outbound_headers: true, ..up("A", false) };
    let mut h = start(one_minute("r1"), Some(link), cfg(), None);
    h.addr.do_send(Turn::Go);
    h.probe.add_route().await;
    let patch = h.probe.call(name::SESSIONS_PATCH).await;
    let headers = &patch.params["outboundHeaders"];
    assert_eq!(headers["x-litellm-end-user-id"], "acct");
    assert_eq!(headers["x-cogni-run-id"], "r1");
    fail(&patch, headers_rejected());
    assert!(matches!(h.probe.next().await, Sent::HeadersUnsupported), "the supervisor is told (for every later run)");
    let again = h.probe.call(name::SESSIONS_PATCH).await;
    assert_eq!(again.params, json!({"key": h.spec.session_key.as_str(), "model": "cogni/fake-model"}));
    answer(&again, json!({}));
    let agent = h.probe.call(name::AGENT).await;
    answer(&agent, ack(&h.spec));
    answer(&agent, final_ok(&h.spec, "fine"));
    assert_eq!(h.ended().await.1, Some(RunStatus::Ok));
    assert_eq!(h.sink.ended(), (RunStatus::Ok, ""));
    h.settled(Some(&agent)).await;
}

#[actix_rt::test]
async fn rejected_outbound_headers_when_required_fail_the_run() {
    let link = GatewayUp { outbound_headers: true, ..up("A", false) };
    let mut h = start(one_minute("r1"), Some(link), SessionConfig { outbound_headers: OutboundHeadersMode::On, ..cfg() }, None);
    h.addr.do_send(Turn::Go);
    h.probe.add_route().await;
    let patch = h.probe.call(name::SESSIONS_PATCH).await;
    fail(&patch, headers_rejected());
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Error));
    assert_eq!(methods(&sent), ["remove_route", "release_session"], "no retry, no agent");
    assert_eq!(h.sink.ended(), (RunStatus::Error, "gateway_rejected"));
    h.settled(None).await;
}

// ---------------------------------------------------------------------------------------------
// Timeouts
// ---------------------------------------------------------------------------------------------

#[actix_rt::test]
async fn a_queued_run_times_out_on_time_without_touching_the_gateway() {
    let mut h = start(spec("r1", "s", Duration::from_millis(300)), Some(up("A", false)), cfg(), None);
    let t0 = Instant::now();
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Timeout));
    assert!(t0.elapsed() < WAIT, "its timeout, not another run's end, ended it");
    assert_eq!(methods(&sent), Vec::<String>::new(), "no lock to release, nothing on the gateway");
    assert_eq!(h.sink.ended(), (RunStatus::Timeout, "timeout"));
    let msg = h.sink.outcome().error.unwrap().message;
    assert!(msg.contains("queued"), "says where it waited: {msg}");
    assert!(h.sink.checkpoints().is_empty());
    h.settled(None).await;
}

#[actix_rt::test]
async fn a_run_waiting_for_its_branch_times_out_and_says_so() {
    let mut s = spec("r1", "s", Duration::from_secs(2));
    s.branch = Some(plan("k1"));
    let (ws, mut steps) = HandWorkspace::pair();
    let mut h = start(s, Some(up("A", false)), cfg(), Some(ws));
    h.addr.do_send(Turn::WaitingForBranch);
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Timeout));
    assert_eq!(methods(&sent), ["release_session"]);
    assert_eq!(h.sink.events()[0], RunEvent::WaitingForBranch { branch: "sandbox/k1".to_owned() });
    let msg = h.sink.outcome().error.unwrap().message;
    assert!(msg.contains("waiting for branch sandbox/k1"), "{msg}");
    steps.none_asked();
    h.settled(None).await;
}

#[actix_rt::test]
async fn a_running_run_times_out_and_its_gateway_run_is_cancelled() {
    let mut h = start(spec("r1", "s", Duration::from_secs(2)), Some(up("A", true)), cfg(), None);
    let agent = h.accepted(true).await;
    h.addr.do_send(chat_delta(&h.spec, "partial"));
    let abort = h.probe.call(name::CHAT_ABORT).await;
    assert_eq!(abort.params, abort_params(&h.spec));
    answer(&abort, json!({"ok": true, "aborted": true}));
    // The gateway confirms the abort with the run's final.
    answer(&agent, final_aborted(&h.spec, "partial"));
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Timeout));
    assert_eq!(methods(&sent), ["sessions.messages.unsubscribe", "remove_route", "release_session"], "chat.abort once");
    let o = h.sink.outcome();
    assert_eq!((o.status, o.error.map(|e| e.code)), (RunStatus::Timeout, Some(ErrorCode::Timeout)));
    assert_eq!(o.content, "partial");
    h.settled(Some(&agent)).await;
}

#[actix_rt::test]
async fn a_timed_out_run_whose_gateway_never_confirms_ends_after_the_grace() {
    let c = SessionConfig { abort_grace: Duration::from_millis(200), ..cfg() };
    let mut h = start(spec("r1", "s", Duration::from_secs(2)), Some(up("A", false)), c, None);
    let agent = h.accepted(false).await;
    let abort = h.probe.call(name::CHAT_ABORT).await;
    assert_eq!(abort.params, abort_params(&h.spec));
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Timeout));
    assert_eq!(methods(&sent), ["remove_route", "release_session"], "chat.abort is not repeated");
    assert_eq!(h.sink.ended(), (RunStatus::Timeout, "timeout"));
    h.settled(Some(&agent)).await;
}

// ---------------------------------------------------------------------------------------------
// Abort in every stage
// ---------------------------------------------------------------------------------------------

#[actix_rt::test]
async fn abort_while_queued() {
    let mut h = start(one_minute("r1"), Some(up("A", false)), cfg(), None);
    h.addr.do_send(CancelRun(CancelReason::Api));
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Aborted));
    assert!(sent.is_empty(), "{:?}", methods(&sent));
    assert_eq!(h.sink.ended(), (RunStatus::Aborted, "aborted"));
    // A turn that was already on its way does not start it.
    h.addr.do_send(Turn::Go);
    h.settled(None).await;
}

#[actix_rt::test]
async fn abort_while_waiting_for_the_branch() {
    let mut s = one_minute("r1");
    s.branch = Some(plan("k1"));
    let (ws, mut steps) = HandWorkspace::pair();
    let mut h = start(s, Some(up("A", false)), cfg(), Some(ws));
    h.addr.do_send(Turn::WaitingForBranch);
    h.sink.wait_for("waiting", |e| !e.is_empty()).await;
    h.addr.do_send(CancelRun(CancelReason::Api));
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Aborted));
    assert_eq!(methods(&sent), ["release_session"]);
    h.addr.do_send(Turn::Go);
    h.settled(None).await;
    steps.none_asked();
}

#[actix_rt::test]
async fn abort_while_preparing_the_workspace() {
    let mut s = one_minute("r1");
    s.branch = Some(plan("k1"));
    let (ws, mut steps) = HandWorkspace::pair();
    let mut h = start(s, Some(up("A", false)), cfg(), Some(ws));
    h.addr.do_send(Turn::Go);
    let prep = steps.prepare().await;
    assert_eq!(prep.plan, plan("k1"));
    assert_eq!(h.sink.checkpoints(), vec![Checkpoint::Running, Checkpoint::Preparing]);
    h.addr.do_send(CancelRun(CancelReason::Api));
    match h.probe.next().await {
        Sent::Release(r) => assert_eq!(r.lock, Lock::Session, "the session's next run may start"),
        other => panic!("expected the session key's release, got {other:?}"),
    }
    assert_eq!(h.sink.ended(), (RunStatus::Aborted, "aborted"));
    // The prepare goes on in the container: the branch stays locked until it is over.
    h.probe.quiet().await;
    let _ = prep.done.send(Ok(prepared(&plan("k1"))));
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Aborted));
    assert!(sent.is_empty(), "the finished prepare starts nothing: {:?}", methods(&sent));
    h.settled(None).await;
}

#[actix_rt::test]
async fn a_handoff_does_not_wait_for_the_workspace_step_of_an_ended_run() {
    let mut s = one_minute("r1");
    s.branch = Some(plan("k1"));
    let (ws, mut steps) = HandWorkspace::pair();
    let mut h = start(s, Some(up("A", false)), cfg(), Some(ws));
    h.addr.do_send(Turn::Go);
    let _prep = steps.prepare().await;
    h.addr.do_send(CancelRun(CancelReason::Api));
    assert!(matches!(h.probe.next().await, Sent::Release(_)));
    h.addr.do_send(Suspend);
    let (sent, status) = h.ended().await;
    assert!(sent.is_empty(), "{:?}", methods(&sent));
    assert_eq!(status, Some(RunStatus::Aborted), "it did end");
    h.settled(None).await;
}

#[actix_rt::test]
async fn a_run_that_times_out_while_preparing_keeps_its_branch_until_the_prepare_is_over() {
    let mut s = spec("r1", "s", Duration::from_secs(2));
    s.branch = Some(plan("k1"));
    let (ws, mut steps) = HandWorkspace::pair();
    let mut h = start(s, Some(up("A", false)), cfg(), Some(ws));
    h.addr.do_send(Turn::Go);
    let prep = steps.prepare().await;
    h.sink.wait_for("timeout", |e| matches!(e.last(), Some(RunEvent::Finished(_)))).await;
    let msg = h.sink.outcome().error.unwrap().message;
    assert!(msg.contains("workspace"), "{msg}");
    assert!(matches!(h.probe.next().await, Sent::Release(_)));
    h.probe.quiet().await;
    let _ = prep.done.send(Err(WorkspaceError::Failed("worktree add failed".to_owned())));
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Timeout));
    assert!(sent.is_empty(), "{:?}", methods(&sent));
    assert_eq!(h.sink.ended(), (RunStatus::Timeout, "timeout"), "a late failure changes nothing");
    h.settled(None).await;
}

#[actix_rt::test]
async fn abort_while_patching_ends_at_once() {
    let mut h = start(one_minute("r1"), Some(up("A", false)), cfg(), None);
    h.addr.do_send(Turn::Go);
    h.probe.add_route().await;
    let patch = h.probe.call(name::SESSIONS_PATCH).await;
    h.addr.do_send(CancelRun(CancelReason::Api));
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Aborted));
    assert_eq!(methods(&sent), ["remove_route", "release_session"], "no agent was sent: nothing to abort");
    answer(&patch, json!({}));
    h.settled(None).await;
}

#[actix_rt::test]
async fn abort_while_running_cancels_the_gateway_run() {
    let mut h = start(one_minute("r1"), Some(up("A", false)), cfg(), None);
    let agent = h.accepted(false).await;
    h.addr.do_send(chat_delta(&h.spec, "so far"));
    h.addr.do_send(CancelRun(CancelReason::Api));
    let abort = h.probe.call(name::CHAT_ABORT).await;
    assert_eq!(abort.params, abort_params(&h.spec));
    answer(&abort, json!({"ok": true}));
    answer(&agent, final_aborted(&h.spec, "so far"));
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Aborted));
    assert_eq!(methods(&sent), ["remove_route", "release_session"]);
    let o = h.sink.outcome();
    assert_eq!((o.status, o.content.as_str()), (RunStatus::Aborted, "so far"));
    assert_eq!(o.error.unwrap().code, ErrorCode::Aborted);
    h.settled(Some(&agent)).await;
}

/// A branch run through prepare → gateway run → publish; returns the publish step (unanswered).
async fn to_publishing(h: &mut Harness, steps: &mut WorkspaceSteps) -> (Call, Step<Published>) {
    h.addr.do_send(Turn::Go);
    let prep = steps.prepare().await;
    let _ = prep.done.send(Ok(prepared(&prep.plan)));
    let agent = h.up_to_agent_after_turn().await;
    let message = agent.params["message"].as_str().unwrap().to_owned();
    assert!(message.starts_with("message of r1") && message.contains("cd /workspace/wt/k1"), "the agent is told its worktree: {message}");
    answer(&agent, ack(&h.spec));
    answer(&agent, final_ok(&h.spec, "committed"));
    let publish = steps.publish().await;
    // The session key is free while the branch publishes: the next run of the session may start.
    match h.probe.next().await {
        Sent::RemoveRoute(_) => {}
        other => panic!("expected RemoveRoute, got {other:?}"),
    }
    match h.probe.next().await {
        Sent::Release(r) => assert_eq!(r.lock, Lock::Session),
        other => panic!("expected the session key's release, got {other:?}"),
    }
    assert_eq!(
        h.sink.checkpoints().last(),
        Some(&Checkpoint::Publishing { content: "committed".to_owned(), gateway_usage: Some((11, 7)) }),
        "a restart publishes again"
    );
    (agent, publish)
}

impl Harness {
    /// After `Turn::Go` and a ready workspace: route, patch, agent.
    async fn up_to_agent_after_turn(&mut self) -> Call {
        self.probe.add_route().await;
        let patch = self.probe.call(name::SESSIONS_PATCH).await;
        answer(&patch, json!({}));
        self.probe.call(name::AGENT).await
    }
}

fn branch_run(timeout: Duration) -> (Harness, WorkspaceSteps) {
    let mut s = spec("r1", "s", timeout);
    s.branch = Some(plan("k1"));
    let (ws, steps) = HandWorkspace::pair();
    (start(s, Some(up("A", false)), cfg(), Some(ws)), steps)
}

/// A caller's mistake the relay finds when preparing (an unknown base ref, a conflicting key)
/// ends the run `relay_rejected` with the relay's reason; anything else stays `internal`. Neither
/// reaches the gateway.
#[actix_rt::test]
async fn a_refused_workspace_ends_relay_rejected_a_failed_one_internal() {
    for (err, code, says) in [
        (WorkspaceError::UnknownBaseRef("base ref \"nope\" not found".to_owned()), "relay_rejected", "cannot work on sandbox/k1: base ref \"nope\" not found"),
        (WorkspaceError::KeyConflict("sandbox/k1 conflicts with sandbox/k1/x".to_owned()), "relay_rejected", "cannot work on sandbox/k1: sandbox/k1 conflicts"),
        (WorkspaceError::Failed("docker: connection refused".to_owned()), "internal", "preparing the workspace for sandbox/k1 failed"),
    ] {
        let (mut h, mut steps) = branch_run(Duration::from_secs(60));
        h.addr.do_send(Turn::Go);
        let prep = steps.prepare().await;
        let _ = prep.done.send(Err(err));
        let (sent, status) = h.ended().await;
        assert_eq!(status, Some(RunStatus::Error));
        assert!(!methods(&sent).iter().any(|m| m == name::AGENT), "{:?}", methods(&sent));
        assert_eq!(h.sink.ended(), (RunStatus::Error, code));
        let msg = h.sink.outcome().error.unwrap().message;
        assert!(msg.contains(says), "{msg}");
        h.settled(None).await;
    }
}

#[actix_rt::test]
async fn a_branch_run_publishes_then_ends_ok() {
    let (mut h, mut steps) = branch_run(Duration::from_secs(60));
    let (agent, publish) = to_publishing(&mut h, &mut steps).await;
    h.probe.quiet().await;
    assert!(!h.sink.events().iter().any(|e| matches!(e, RunEvent::Finished(_))), "no final before the relay");
    let _ = publish.done.send(published(&plan("k1")));
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Ok));
    assert!(sent.is_empty(), "{:?}", methods(&sent));
    let events = h.sink.events();
    assert_eq!(events[events.len() - 2], RunEvent::Relay(published(&plan("k1")).relay), "relay, then final");
    assert_eq!(h.sink.ended(), (RunStatus::Ok, ""));
    h.settled(Some(&agent)).await;
}

#[actix_rt::test]
async fn abort_while_publishing() {
    let (mut h, mut steps) = branch_run(Duration::from_secs(60));
    let (agent, publish) = to_publishing(&mut h, &mut steps).await;
    h.addr.do_send(CancelRun(CancelReason::Api));
    h.sink.wait_for("aborted", |e| matches!(e.last(), Some(RunEvent::Finished(_)))).await;
    let o = h.sink.outcome();
    assert_eq!((o.status, o.content.as_str()), (RunStatus::Aborted, "committed"));
    // The gateway run is over (nothing to cancel); the publish goes on, and the branch stays
    // locked until it is over.
    h.probe.quiet().await;
    let _ = publish.done.send(published(&plan("k1")));
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Aborted));
    assert!(sent.is_empty(), "{:?}", methods(&sent));
    assert!(!h.sink.events().iter().any(|e| matches!(e, RunEvent::Relay(_))), "no relay event after the terminal event");
    h.settled(Some(&agent)).await;
}

#[actix_rt::test]
async fn publishing_is_not_cut_short_by_the_timeout() {
    let (mut h, mut steps) = branch_run(Duration::from_secs(2));
    let (agent, publish) = to_publishing(&mut h, &mut steps).await;
    // Past the run's deadline: the agent's work is done and ok, the relay goes on.
    tokio::time::sleep(Duration::from_millis(2300)).await;
    assert!(!h.sink.events().iter().any(|e| matches!(e, RunEvent::Finished(_))), "{:?}", h.sink.events());
    let _ = publish.done.send(published(&plan("k1")));
    assert_eq!(h.ended().await.1, Some(RunStatus::Ok));
    h.settled(Some(&agent)).await;
}

// ---------------------------------------------------------------------------------------------
// The connection drops mid-run
// ---------------------------------------------------------------------------------------------

#[actix_rt::test]
async fn reconnect_to_the_same_process_resubscribes_and_waits_with_the_remaining_budget() {
    let mut h = start(one_minute("r1"), Some(up("A", true)), cfg(), None);
    let agent = h.accepted(true).await;
    h.addr.do_send(chat_delta(&h.spec, "Hel"));
    fail(&agent, CallError::Disconnected);
    h.addr.do_send(Link(None));
    h.probe.quiet().await;
    h.addr.do_send(Link(Some(up("A", true))));
    let sub = h.probe.call(name::SESSIONS_SUBSCRIBE).await;
    assert_eq!(sub.params, json!({"key": h.spec.session_key.as_str()}));
    answer(&sub, json!({}));
    let wait = h.probe.call(name::AGENT_WAIT).await;
    assert_eq!(wait.params["runId"], h.spec.gateway_run_id.as_str());
    let ms = wait.params["timeoutMs"].as_u64().unwrap();
    assert!((30_000..=60_000).contains(&ms), "the run's remaining time, not a request timeout: {ms}");
    let Wait::Up(bound) = wait.wait else { panic!("agent.wait has a bound: {:?}", wait.wait) };
    let slack = bound.checked_sub(Duration::from_millis(ms)).unwrap();
    assert!(slack >= cfg().request_timeout && slack < cfg().request_timeout + Duration::from_millis(1), "{bound:?} for {ms} ms");
    answer(&wait, json!({"runId": h.spec.gateway_run_id, "status": "ok", "endedAt": 2, "terminalReply": {"text": "Hello world"}}));
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Ok));
    assert_eq!(methods(&sent), ["sessions.messages.unsubscribe", "remove_route", "release_session"], "no abort");
    assert_eq!(h.sink.text(), "Hello world", "the streamed prefix, then the rest");
    assert_eq!(h.sink.outcome().content, "Hello world");
    h.settled(Some(&agent)).await;
}

/// A run someone aborted on the gateway while clawmux was away: 2026.9.6 answers agent.wait with
/// `status: "error"` and `stopReason: "rpc"` (seen by the official-client suite: `chat.abort` adds
/// `startedAt`, `sessions.abort` does not). That is `aborted`, not an agent error.
#[actix_rt::test]
async fn a_run_aborted_while_clawmux_was_away_ends_aborted() {
    for answer_of_wait in [
        json!({"status": "error", "startedAt": 1, "endedAt": 2, "stopReason": "rpc"}),
        json!({"status": "error", "endedAt": 2, "stopReason": "rpc"}),
    ] {
        let mut h = start(one_minute("r1"), Some(up("A", true)), cfg(), None);
        let agent = h.accepted(true).await;
        fail(&agent, CallError::Disconnected);
        h.addr.do_send(Link(None));
        h.probe.quiet().await;
        h.addr.do_send(Link(Some(up("A", true))));
        answer(&h.probe.call(name::SESSIONS_SUBSCRIBE).await, json!({}));
        let wait = h.probe.call(name::AGENT_WAIT).await;
        let mut reply = answer_of_wait.clone();
        reply["runId"] = json!(h.spec.gateway_run_id);
        answer(&wait, reply);
        let (sent, status) = h.ended().await;
        assert_eq!(status, Some(RunStatus::Aborted), "{answer_of_wait}");
        assert_eq!(h.sink.ended(), (RunStatus::Aborted, "aborted"), "{answer_of_wait}");
        assert!(!methods(&sent).contains(&"chat.abort".to_owned()), "nothing left to cancel: {:?}", methods(&sent));
    }
}

#[actix_rt::test]
async fn reconnect_to_a_new_process_ends_the_run_gateway_disconnected() {
    let mut h = start(one_minute("r1"), Some(up("A", false)), cfg(), None);
    let agent = h.accepted(false).await;
    h.addr.do_send(Link(None));
    h.addr.do_send(Link(Some(up("B", false))));
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Error));
    assert_eq!(methods(&sent), ["remove_route", "release_session"], "no agent.wait the new process cannot answer, nothing to cancel");
    assert_eq!(h.sink.ended(), (RunStatus::Error, "gateway_disconnected"));
    h.settled(Some(&agent)).await;
}

#[actix_rt::test]
async fn a_connection_that_stays_down_ends_the_run_and_hands_its_gateway_run_over() {
    let c = SessionConfig { recovery_window: Duration::from_millis(300), ..cfg() };
    let mut h = start(one_minute("r1"), Some(up("A", false)), c, None);
    let agent = h.accepted(false).await;
    h.addr.do_send(Link(None));
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Error));
    assert_eq!(methods(&sent), ["abandon", "remove_route", "release_session"]);
    let Sent::Abandon(a) = &sent[0] else { unreachable!() };
    assert_eq!(
        a,
        &Abandon { session_key: h.spec.session_key.clone(), gateway_run_id: h.spec.gateway_run_id.clone(), boot_id: Some("boot:A".to_owned()) },
        "cancelled once that process is back"
    );
    assert_eq!(h.sink.ended(), (RunStatus::Error, "gateway_disconnected"));
    h.settled(Some(&agent)).await;
}

/// A gateway whose frames keep bringing new text (two messages interleaved: each frame a new
/// turn) cannot grow a run without bound: past its output limit the run ends `agent_error`, its
/// gateway run is cancelled, and its clients got no more than the limit.
#[actix_rt::test]
async fn a_run_past_its_output_limit_ends_and_is_cancelled() {
    let c = SessionConfig { max_output_bytes: 100, ..cfg() };
    let mut h = start(one_minute("r1"), Some(up("A", false)), c, None);
    let agent = h.accepted(false).await;
    let (a, b) = ("a".repeat(40), "b".repeat(40));
    for i in 0..64 {
        h.addr.do_send(chat_delta(&h.spec, if i % 2 == 0 { &a } else { &b }));
    }
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Error));
    assert_eq!(methods(&sent), ["chat.abort", "remove_route", "release_session"], "the gateway run is cancelled");
    assert_eq!(h.sink.ended(), (RunStatus::Error, "agent_error"));
    assert!(h.sink.text().len() <= 100, "{} bytes sent to the run's clients", h.sink.text().len());
    assert_eq!(h.sink.outcome().content, h.sink.text(), "the outcome holds what the clients were sent");
    h.settled(Some(&agent)).await;
    // A first frame past the limit on its own: nothing is sent, and nothing is kept.
    let mut h = start(one_minute("r2"), Some(up("A", false)), SessionConfig { max_output_bytes: 100, ..cfg() }, None);
    let agent = h.accepted(false).await;
    h.addr.do_send(chat_delta(&h.spec, &"c".repeat(500)));
    let (_, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Error));
    assert_eq!((h.sink.text().as_str(), h.sink.outcome().content.as_str()), ("", ""));
    h.settled(Some(&agent)).await;
}

/// A run ended while its subscribe is unanswered undoes it: the gateway may have applied it, and
/// it would outlive the run (every later event of the session sent to clawmux).
#[actix_rt::test]
async fn a_run_cancelled_while_subscribing_unsubscribes() {
    let mut h = start(one_minute("r1"), Some(up("A", true)), cfg(), None);
    h.addr.do_send(Turn::Go);
    h.probe.add_route().await;
    answer(&h.probe.call(name::SESSIONS_PATCH).await, json!({"ok": true}));
    let sub = h.probe.call(name::SESSIONS_SUBSCRIBE).await;
    h.addr.do_send(CancelRun(CancelReason::Api));
    let (sent, _) = h.ended().await;
    assert!(methods(&sent).contains(&name::SESSIONS_UNSUBSCRIBE.to_owned()), "{:?}", methods(&sent));
    answer(&sub, json!({}));
    h.settled(None).await;
}

/// A flapping connection: the first outage's recovery timer must not end the run in the second
/// outage (it has a window of its own); once the link is back, the run ends as the gateway says.
#[actix_rt::test]
async fn a_second_outage_gets_a_recovery_window_of_its_own() {
    // Windows of 4 s; the second outage 3 s after the first: the first's timer fires 1 s into it,
    // the second's 4 s in. The check comes 2.5 s into it: 1.5 s before the second's timer (a
    // busy machine stretching the sleeps by less than that cannot fail the test with the fix).
    let window = Duration::from_secs(4);
    let c = SessionConfig { recovery_window: window, ..cfg() };
    let mut h = start(one_minute("r1"), Some(up("A", false)), c, None);
    let agent = h.accepted(false).await;
    fail(&agent, CallError::Disconnected);
    h.addr.do_send(Link(None));
    tokio::time::sleep(Duration::from_millis(50)).await;
    h.addr.do_send(Link(Some(up("A", false))));
    let wait = h.probe.call(name::AGENT_WAIT).await;
    tokio::time::sleep(Duration::from_millis(2950)).await;
    fail(&wait, CallError::Disconnected);
    h.addr.do_send(Link(None));
    // A repeated "down" is the same outage: it does not restart the window.
    h.addr.do_send(Link(None));
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(!h.sink.events().iter().any(|e| matches!(e, RunEvent::Finished(_))), "ended inside its second outage's window: {:?}", h.sink.events());
    h.addr.do_send(Link(Some(up("A", false))));
    let wait = h.probe.call(name::AGENT_WAIT).await;
    answer(&wait, json!({"runId": h.spec.gateway_run_id, "status": "ok", "endedAt": 2, "terminalReply": {"text": "Hello world"}}));
    let (_, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Ok));
    h.settled(Some(&agent)).await;
}

// ---------------------------------------------------------------------------------------------
// A gateway that answers nonsense
// ---------------------------------------------------------------------------------------------

async fn protocol_error_cancels(answer_agent: impl FnOnce(&Harness, &Call), accepted_first: bool) {
    let mut h = start(one_minute("r1"), Some(up("A", false)), cfg(), None);
    let agent = if accepted_first { h.accepted(false).await } else { h.up_to_agent(false).await };
    answer_agent(&h, &agent);
    let (sent, status) = h.ended().await;
    assert_eq!(status, Some(RunStatus::Error));
    assert_eq!(methods(&sent), ["chat.abort", "remove_route", "release_session"], "the gateway run is cancelled");
    assert_eq!(the_call(&sent, name::CHAT_ABORT).params, abort_params(&h.spec));
    assert_eq!(h.sink.ended(), (RunStatus::Error, "gateway_protocol_error"));
    h.settled(Some(&agent)).await;
}

#[actix_rt::test]
async fn an_agent_answer_without_status_is_a_protocol_error() {
    protocol_error_cancels(|h, agent| answer(agent, json!({"runId": h.spec.gateway_run_id})), false).await;
}

#[actix_rt::test]
async fn an_agent_answer_that_is_not_an_object_is_a_protocol_error() {
    protocol_error_cancels(|_, agent| answer_raw(agent, "[1,2,3]"), false).await;
}

#[actix_rt::test]
async fn a_final_with_an_unknown_status_is_a_protocol_error() {
    protocol_error_cancels(|h, agent| answer(agent, json!({"runId": h.spec.gateway_run_id, "status": "exploded"})), true).await;
}

#[actix_rt::test]
async fn an_ack_for_another_run_is_a_protocol_error() {
    protocol_error_cancels(|h, agent| answer(agent, json!({"runId": "someone-else", "sessionKey": h.spec.session_key.as_str(), "status": "accepted"})), false)
        .await;
}

#[actix_rt::test]
async fn an_undecodable_answer_reported_by_the_supervisor_is_a_protocol_error() {
    protocol_error_cancels(|_, agent| fail(agent, CallError::Malformed("expected value at line 1".to_owned())), true).await;
}
