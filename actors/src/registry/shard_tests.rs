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
