//! Runs whose actor is not a session actor (ephemeral containers): the registry owns them as it
//! owns gateway runs — session-key order, cancels, capacity, shutdown, their end — and they do not
//! need the gateway connection.
#![allow(clippy::unwrap_used)]

use super::*;
use crate::messages::{ExternalRun, InFlight};
use crate::run::{CancelReason, RunSpec, RunStatus};
use crate::testkit::*;
use std::sync::Mutex;
use std::time::Duration;

/// What an external run's actor was told, in order.
type Seen = Arc<Mutex<Vec<String>>>;

/// Plays an external run: records its turns and cancels; a cancel or `finish` ends it.
struct ExternalProbe {
    run_id: String,
    seen: Seen,
    port: RegistryPort,
}

impl Actor for ExternalProbe {
    type Context = Context<Self>;
}

impl Handler<Turn> for ExternalProbe {
    type Result = ();
    fn handle(&mut self, msg: Turn, _ctx: &mut Context<Self>) {
        self.seen.lock().unwrap().push(format!("{msg:?}"));
    }
}

impl Handler<CancelRun> for ExternalProbe {
    type Result = ();
    fn handle(&mut self, msg: CancelRun, ctx: &mut Context<Self>) {
        self.seen.lock().unwrap().push(format!("cancel {:?}", msg.0));
        self.port.ended.do_send(RunEnded { run_id: self.run_id.clone(), status: Some(RunStatus::Aborted) });
        ctx.stop();
    }
}

/// The run ends by itself (its container exited).
#[derive(Message)]
#[rtype(result = "()")]
struct Finish;

impl Handler<Finish> for ExternalProbe {
    type Result = ();
    fn handle(&mut self, _msg: Finish, ctx: &mut Context<Self>) {
        self.port.ended.do_send(RunEnded { run_id: self.run_id.clone(), status: Some(RunStatus::Ok) });
        ctx.stop();
    }
}

fn registry(max_runs: usize, connected: bool) -> (Addr<Registry>, Probe) {
    let probe = Probe::start();
    let reg = test_registry(&probe, max_runs, 0, connected, None).0.start();
    (reg, probe)
}

/// Submits an external run of session `session`; returns what its actor sees and its address.
async fn submit(reg: &Addr<Registry>, id: &str, session: &str) -> (Result<Admitted, AdmitError>, Seen, Arc<Mutex<Option<Addr<ExternalProbe>>>>) {
    let seen: Seen = Arc::default();
    let addr: Arc<Mutex<Option<Addr<ExternalProbe>>>> = Arc::default();
    let (s, a, run_id) = (seen.clone(), addr.clone(), id.to_owned());
    let start: crate::messages::ExternalStart = Box::new(move |port| {
        let probe = ExternalProbe { run_id, seen: s, port }.start();
        *a.lock().unwrap() = Some(probe.clone());
        ExternalRun { turn: probe.clone().recipient(), cancel: probe.recipient() }
    });
    let spec: RunSpec = spec(id, session, Duration::from_secs(60));
    let admitted = reg.send(Submit { spec, sink: Arc::new(TestSink::default()), resume: None, if_busy: IfBusy::Enqueue, external: Some(start), shard: None }).await.unwrap();
    (admitted, seen, addr)
}

/// Waits (bounded) until `seen` holds `n` entries.
async fn seen_n(seen: &Seen, n: usize) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let now = seen.lock().unwrap().clone();
        if now.len() >= n {
            return now;
        }
        assert!(tokio::time::Instant::now() < deadline, "saw only {now:?}, wanted {n} entries");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[actix_rt::test]
async fn external_runs_take_turns_by_session_key_and_need_no_gateway() {
    // Disconnected: a gateway run would be refused, an external one is admitted.
    let (reg, _probe) = registry(10, false);
    let (a, seen_a, addr_a) = submit(&reg, "a", "s1").await;
    let (b, seen_b, _) = submit(&reg, "b", "s1").await;
    assert_eq!((a, b), (Ok(Admitted::Started), Ok(Admitted::Queued)));
    assert_eq!(seen_n(&seen_a, 1).await, ["Go"]);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(seen_b.lock().unwrap().is_empty(), "b must wait for a's end");
    let addr = addr_a.lock().unwrap().clone().unwrap();
    addr.do_send(Finish);
    assert_eq!(seen_n(&seen_b, 1).await, ["Go"]);
    assert_eq!(reg.send(InFlight).await.unwrap(), 1, "a left the registry");
}

#[actix_rt::test]
async fn cancels_capacity_and_shutdown_reach_external_runs() {
    let (reg, _probe) = registry(2, true);
    let (_, seen_a, _) = submit(&reg, "a", "s1").await;
    let (_, seen_b, _) = submit(&reg, "b", "s2").await;
    let (c, _, _) = submit(&reg, "c", "s3").await;
    assert_eq!(c, Err(AdmitError::AtCapacity(2)), "external runs count toward CLAWMUX_MAX_RUNS");
    assert!(reg.send(Cancel { run_id: "a".into(), reason: CancelReason::Api }).await.unwrap());
    assert_eq!(seen_n(&seen_a, 2).await, ["Go", "cancel Api"]);
    // Handoff keeps gateway runs going for the next process; a container cannot be handed over.
    assert_eq!(reg.send(Drain(ShutdownMode::Handoff)).await.unwrap(), 1);
    assert_eq!(seen_n(&seen_b, 2).await, ["Go", "cancel Shutdown"]);
    let deadline = tokio::time::Instant::now() + WAIT;
    while reg.send(InFlight).await.unwrap() != 0 {
        assert!(tokio::time::Instant::now() < deadline, "the cancelled runs must leave the registry");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
