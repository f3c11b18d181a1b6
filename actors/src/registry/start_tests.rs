//! Start slots: at most `max_starting` new runs are between their turn and the gateway's ACK at
//! once; the rest wait (`queued`) in admission order, and a cancel of a waiting run frees its place.
#![allow(clippy::unwrap_used)]

use super::*;
use crate::messages::{Call, InFlight};
use crate::run::{CancelReason, RunEvent, RunSpec, RunStatus};
use crate::testkit::*;
use clawmux_protocol::methods::name;
use std::time::Duration;

fn registry(max_starting: usize) -> (Addr<Registry>, Probe) {
    let probe = Probe::start();
    let reg = test_registry(&probe, 100, max_starting, true, None).0.start();
    reg.do_send(Link(Some(up("A", false))));
    (reg, probe)
}

/// Answers `sessions.patch` calls until the next `agent` call, which it returns.
async fn next_agent(probe: &mut Probe) -> Call {
    loop {
        match probe.next().await {
            Sent::Call(c) if c.method == name::SESSIONS_PATCH => answer(&c, serde_json::json!({})),
            Sent::Call(c) if c.method == name::AGENT => return c,
            Sent::AddRoute(_) | Sent::RemoveRoute(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}

fn ended(sink: &TestSink) -> bool {
    matches!(sink.events().last(), Some(RunEvent::Finished(_)))
}

#[actix_rt::test]
async fn a_burst_starts_a_few_runs_at_a_time_in_admission_order() {
    let (reg, mut probe) = registry(2);
    let runs: Vec<(RunSpec, TestSink)> = (0..4).map(|i| (spec(&format!("r{i}"), &format!("s{i}"), Duration::from_secs(60)), TestSink::default())).collect();
    let mut admitted = Vec::new();
    for (spec, sink) in &runs {
        let submit = Submit { spec: spec.clone(), sink: Arc::new(sink.clone()), resume: None, if_busy: IfBusy::Enqueue, external: None, shard: None };
        admitted.push(reg.send(submit).await.unwrap().unwrap());
    }
    assert_eq!(admitted, [Admitted::Started, Admitted::Started, Admitted::Queued, Admitted::Queued], "two slots");
    let first = [next_agent(&mut probe).await, next_agent(&mut probe).await];
    let ids: Vec<&str> = first.iter().map(|c| c.params["idempotencyKey"].as_str().unwrap()).collect();
    assert_eq!(ids, [runs[0].0.gateway_run_id.as_str(), runs[1].0.gateway_run_id.as_str()]);
    probe.quiet().await;
    assert!(!runs[2].1.checkpoints().contains(&crate::run::Checkpoint::Running), "r2 waits for a slot: still queued");

    // r0's ACK frees its slot: r2 (not r3) goes.
    answer(&first[0], ack(&runs[0].0));
    let third = next_agent(&mut probe).await;
    assert_eq!(third.params["idempotencyKey"], runs[2].0.gateway_run_id.as_str());
    // A cancelled waiting run leaves the line without ever starting.
    assert!(reg.send(Cancel { run_id: "r3".into(), reason: CancelReason::Api }).await.unwrap());
    runs[3].1.wait_for("r3 aborted", |e| matches!(e.last(), Some(RunEvent::Finished(_)))).await;
    assert_eq!(runs[3].1.ended().0, RunStatus::Aborted);
    for (call, spec) in [(&first[0], &runs[0].0), (&first[1], &runs[1].0), (&third, &runs[2].0)] {
        answer(call, ack(spec));
        answer(call, final_ok(spec, "done"));
    }
    for (spec, sink) in &runs[..3] {
        sink.wait_for("ok", |_| ended(sink)).await;
        assert_eq!(sink.ended().0, RunStatus::Ok, "{}", spec.run_id);
    }
    let deadline = tokio::time::Instant::now() + WAIT;
    while reg.send(InFlight).await.unwrap() != 0 {
        assert!(tokio::time::Instant::now() < deadline, "every run left the registry");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Slots are all free again: two new runs start at once.
    for i in 4..6 {
        let (spec, sink) = (spec(&format!("r{i}"), &format!("s{i}"), Duration::from_secs(60)), TestSink::default());
        let submit = Submit { spec, sink: Arc::new(sink), resume: None, if_busy: IfBusy::Enqueue, external: None, shard: None };
        assert_eq!(reg.send(submit).await.unwrap(), Ok(Admitted::Started));
    }
}
