//! Session actors on shards (arbiters of their own): a blocked shard does not hold up runs on
//! another, cancels reach the run whatever its shard, and the runs of one session share a shard
//! and keep their order.
#![allow(clippy::unwrap_used)]

use super::*;
use crate::messages::{Call, InFlight};
use crate::run::{CancelReason, RunEvent, RunSpec, RunStatus};
use crate::testkit::*;
use clawmux_protocol::methods::name;
use std::collections::HashMap;
use std::time::Duration;

const SHARDS: usize = 2;

struct Sharded {
    reg: Addr<Registry>,
    probe: Probe,
    arbiters: Vec<Arbiter>,
}

fn sharded() -> Sharded {
    let probe = Probe::start();
    let arbiters: Vec<Arbiter> = (0..SHARDS).map(|_| Arbiter::new()).collect();
    let handles = arbiters.iter().map(Arbiter::handle).collect();
    let reg = test_registry(&probe, 100, 0, true, None).0.with_shards(handles).start();
    reg.do_send(Link(Some(up("A", false))));
    Sharded { reg, probe, arbiters }
}

/// A session name whose runs go to `shard`.
fn session_on(shard: usize) -> String {
    (0..1000).map(|i| format!("s{i}")).find(|s| shard_of(&spec("x", s, Duration::from_secs(1)).session_key, SHARDS) == Some(shard)).unwrap()
}

impl Sharded {
    async fn submit(&self, spec: &RunSpec, sink: &TestSink) -> Admitted {
        self.reg.send(Submit { spec: spec.clone(), sink: Arc::new(sink.clone()), resume: None, if_busy: IfBusy::Enqueue, external: None, shard: None }).await.unwrap().unwrap()
    }

    /// Submits a run that names its shard (as an HTTP worker admitting it does).
    async fn submit_on(&self, shard: usize, spec: &RunSpec, sink: &TestSink) -> Admitted {
        let submit = Submit {
            spec: spec.clone(),
            sink: Arc::new(sink.clone()),
            resume: None,
            if_busy: IfBusy::Enqueue,
            external: None,
            shard: Some(self.arbiters[shard].handle()),
        };
        self.reg.send(submit).await.unwrap().unwrap()
    }

    /// Holds `shard`'s thread until the returned sender is used (or dropped).
    fn hold(&self, shard: usize) -> std::sync::mpsc::Sender<()> {
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (entered_tx, entered) = std::sync::mpsc::channel::<()>();
        assert!(self.arbiters[shard].spawn(async move {
            let _ = entered_tx.send(());
            let _ = held.recv_timeout(WAIT);
        }));
        entered.recv_timeout(WAIT).unwrap();
        release
    }

    /// Answers the runs' `sessions.patch` calls until `n` `agent` calls came; returns them by gateway run id.
    async fn agents(&mut self, n: usize) -> HashMap<String, Call> {
        let mut agents = HashMap::new();
        while agents.len() < n {
            match self.probe.next().await {
                Sent::Call(c) if c.method == name::SESSIONS_PATCH => answer(&c, serde_json::json!({})),
                Sent::Call(c) if c.method == name::AGENT => {
                    agents.insert(c.params["idempotencyKey"].as_str().unwrap().to_owned(), c);
                }
                // Routes, aborts of cancelled runs, route removals: not what this waits for.
                _ => {}
            }
        }
        agents
    }
}

fn finished(sink: &TestSink) -> bool {
    matches!(sink.events().last(), Some(RunEvent::Finished(_)))
}

#[actix_rt::test]
async fn a_blocked_shard_does_not_hold_up_runs_on_another_shard() {
    let mut w = sharded();
    let (a, sa) = (spec("a", &session_on(0), Duration::from_secs(60)), TestSink::default());
    let (b, sb) = (spec("b", &session_on(1), Duration::from_secs(60)), TestSink::default());
    w.submit(&a, &sa).await;
    w.submit(&b, &sb).await;
    let agents = w.agents(2).await;
    // Shard 0's thread is held until the test lets it go.
    let (release, held) = std::sync::mpsc::channel::<()>();
    let (entered_tx, entered) = std::sync::mpsc::channel::<()>();
    assert!(w.arbiters[0].spawn(async move {
        let _ = entered_tx.send(());
        let _ = held.recv_timeout(WAIT);
    }));
    entered.recv_timeout(WAIT).unwrap();
    for (spec, text) in [(&a, "A"), (&b, "B")] {
        let call = &agents[&spec.gateway_run_id];
        answer(call, ack(spec));
        answer(call, final_ok(spec, text));
    }
    sb.wait_for("b ends while shard 0 is held", |e| matches!(e.last(), Some(RunEvent::Finished(_)))).await;
    assert_eq!(sb.ended(), (RunStatus::Ok, ""));
    assert!(!finished(&sa), "a lives on the held shard: it cannot have ended yet");
    release.send(()).unwrap();
    sa.wait_for("a ends once its shard runs again", |e| matches!(e.last(), Some(RunEvent::Finished(_)))).await;
    assert_eq!(sa.ended(), (RunStatus::Ok, ""));
}

#[actix_rt::test]
async fn cancels_reach_runs_on_every_shard_and_one_sessions_runs_keep_their_order() {
    let mut w = sharded();
    let runs: Vec<(RunSpec, TestSink)> = (0..SHARDS).map(|i| (spec(&format!("r{i}"), &session_on(i), Duration::from_secs(60)), TestSink::default())).collect();
    for (spec, sink) in &runs {
        assert_eq!(w.submit(spec, sink).await, Admitted::Started);
    }
    let agents = w.agents(SHARDS).await;
    for (spec, sink) in &runs {
        answer(&agents[&spec.gateway_run_id], ack(spec));
        sink.wait_for("accepted", |e| !e.is_empty()).await;
        assert!(w.reg.send(Cancel { run_id: spec.run_id.clone(), reason: CancelReason::Api }).await.unwrap());
    }
    // Each run, on its own shard, asks the gateway to abort its gateway run.
    let mut aborted = Vec::new();
    while aborted.len() < SHARDS {
        if let Sent::Call(c) = w.probe.next().await {
            if c.method == name::CHAT_ABORT {
                aborted.push(c.params["runId"].as_str().unwrap().to_owned());
            }
        }
    }
    aborted.sort();
    let mut want: Vec<String> = runs.iter().map(|(s, _)| s.gateway_run_id.clone()).collect();
    want.sort();
    assert_eq!(aborted, want);
    for (spec, sink) in &runs {
        answer(&agents[&spec.gateway_run_id], final_aborted(spec, ""));
        sink.wait_for("aborted", |e| matches!(e.last(), Some(RunEvent::Finished(_)))).await;
        assert_eq!(sink.ended().0, RunStatus::Aborted, "{}", spec.run_id);
    }
    // Three runs of one session: the second and third wait, then go in admission order.
    let key = session_on(1);
    let queue: Vec<(RunSpec, TestSink)> = ["q1", "q2", "q3"].iter().map(|id| (spec(id, &key, Duration::from_secs(60)), TestSink::default())).collect();
    let admitted: Vec<Admitted> = futures_util::future::join_all(queue.iter().map(|(s, k)| w.submit(s, k))).await;
    assert_eq!(admitted, [Admitted::Started, Admitted::Queued, Admitted::Queued]);
    for (spec, sink) in &queue {
        let agents = w.agents(1).await;
        let call = agents.get(&spec.gateway_run_id).unwrap_or_else(|| panic!("{} must start next", spec.run_id));
        answer(call, ack(spec));
        answer(call, final_ok(spec, "done"));
        sink.wait_for("ok", |e| matches!(e.last(), Some(RunEvent::Finished(_)))).await;
        assert_eq!(sink.ended().0, RunStatus::Ok);
    }
    let deadline = tokio::time::Instant::now() + WAIT;
    while w.reg.send(InFlight).await.unwrap() != 0 {
        assert!(tokio::time::Instant::now() < deadline, "every run left the registry");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Runs admitted on the HTTP worker that read their request name that worker as their shard
/// (`Submit::shard`), whatever their session key. The runs of one key admitted on different
/// shards still go one at a time, in admission order (the registry orders them, not a shard); an
/// abort reaches each run on the shard it lives on; and a held shard holds its own runs only.
#[actix_rt::test]
async fn one_sessions_runs_on_different_shards_keep_their_order_and_aborts_reach_their_shard() {
    let mut w = sharded();
    // The session key would put these runs on shard 0; they name their shards instead.
    let key = session_on(0);
    let q: Vec<(RunSpec, TestSink)> = ["q1", "q2", "q3"].iter().map(|id| (spec(id, &key, Duration::from_secs(60)), TestSink::default())).collect();
    assert_eq!(w.submit_on(0, &q[0].0, &q[0].1).await, Admitted::Started);
    assert_eq!(w.submit_on(1, &q[1].0, &q[1].1).await, Admitted::Queued);
    assert_eq!(w.submit_on(0, &q[2].0, &q[2].1).await, Admitted::Queued);
    let first = w.agents(1).await;
    let call = first.get(&q[0].0.gateway_run_id).expect("q1 starts first");
    answer(call, ack(&q[0].0));
    answer(call, final_ok(&q[0].0, "one"));
    q[0].1.wait_for("q1 ends", |e| matches!(e.last(), Some(RunEvent::Finished(_)))).await;
    // q2 (shard 1) is next, not q3 (shard 0, but admitted later).
    let second = w.agents(1).await;
    let call = second.get(&q[1].0.gateway_run_id).expect("q2 starts second");
    answer(call, ack(&q[1].0));
    q[1].1.wait_for("q2 accepted", |e| !e.is_empty()).await;
    // With shard 1's thread held, q2's actor cannot act on the abort: it lives there.
    let release = w.hold(1);
    assert!(w.reg.send(Cancel { run_id: q[1].0.run_id.clone(), reason: CancelReason::Api }).await.unwrap());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!finished(&q[1].1), "q2 lives on the held shard: its abort waits for it");
    // A run of another session on shard 0 goes on meanwhile.
    let (other, so) = (spec("other", &session_on(1), Duration::from_secs(60)), TestSink::default());
    assert_eq!(w.submit_on(0, &other, &so).await, Admitted::Started);
    let agents = w.agents(1).await;
    let call = agents.get(&other.gateway_run_id).expect("the other session's run starts on shard 0 while shard 1 is held");
    answer(call, ack(&other));
    answer(call, final_ok(&other, "other"));
    so.wait_for("the other run ends", |e| matches!(e.last(), Some(RunEvent::Finished(_)))).await;
    release.send(()).unwrap();
    // Shard 1 runs again: q2 asks the gateway to abort its own gateway run.
    loop {
        if let Sent::Call(c) = w.probe.next().await {
            if c.method == name::CHAT_ABORT {
                assert_eq!(c.params["runId"], q[1].0.gateway_run_id.as_str());
                break;
            }
        }
    }
    answer(call_of(&second, &q[1].0), final_aborted(&q[1].0, ""));
    q[1].1.wait_for("q2 aborted", |e| matches!(e.last(), Some(RunEvent::Finished(_)))).await;
    assert_eq!(q[1].1.ended().0, RunStatus::Aborted);
    // Then q3, last of the key.
    let third = w.agents(1).await;
    let call = third.get(&q[2].0.gateway_run_id).expect("q3 starts last");
    answer(call, ack(&q[2].0));
    answer(call, final_ok(&q[2].0, "three"));
    q[2].1.wait_for("q3 ends", |e| matches!(e.last(), Some(RunEvent::Finished(_)))).await;
    assert_eq!(q[2].1.ended().0, RunStatus::Ok);
}

fn call_of<'a>(calls: &'a HashMap<String, Call>, spec: &RunSpec) -> &'a Call {
    calls.get(&spec.gateway_run_id).unwrap()
}
