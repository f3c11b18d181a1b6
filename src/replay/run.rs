//! One replayed `agent` run: ACK, wait for the session's earlier runs, the recorded events at
//! their (scaled) times, the final `res`; or, when aborted, the gateway's abort sequence.
//!
//! Each run is its own task, so runs of different sessions overlap like on the real gateway,
//! while a per-session completion chain (`tail`) serialises runs of one session.

use super::cassette::{shift_timestamps, RenderedRun, StepKind};
use super::script::{self, RunScript, ScriptFrame};
use super::state::{now_ms, wait_true, AbortKind, AbortRequest, ConnKey, RunStatus, Shared};
use clawmux_protocol::frame::encode_response;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// Everything a run task needs; built by the `agent` handler under the state lock.
pub(crate) struct RunPlan {
    /// Run id (= idempotency key).
    pub run_id: String,
    /// Canonical session key.
    pub session_key: String,
    /// The replay session's id.
    pub session_id: String,
    /// `agentId` of the request (put into synthesised abort events).
    pub agent_id: String,
    /// The requesting connection: the ACK and the final `res` go there only.
    pub requester: ConnKey,
    /// The `agent` request id (both `res` carry it).
    pub request_id: String,
    /// The track, rewritten for this run.
    pub rendered: RenderedRun,
    /// The recorded epoch ms of the recorded request (for timestamp shifting).
    pub recorded_epoch_ms: Option<i64>,
    /// When the `agent` request arrived: recorded times count from here.
    pub requested_at: Instant,
    /// Completion of the session's previous run, if it may still be going.
    pub prev: Option<watch::Receiver<bool>>,
    /// Set to `true` when this run is over (the session's next run waits for it).
    pub done: watch::Sender<bool>,
    /// Abort requests; `None` on protocol 3, where `agent` runs cannot be aborted.
    pub aborts: Option<mpsc::UnboundedReceiver<AbortRequest>>,
    /// How the run ends (the default: as recorded).
    pub script: RunScript,
}

/// Scales a recorded delay by the configured speed (0 = no delay).
pub(crate) fn scaled(speed: f64, t_ms: u64) -> Duration {
    if speed <= 0.0 {
        Duration::ZERO
    } else {
        Duration::from_secs_f64(t_ms as f64 / 1000.0 / speed)
    }
}

async fn next_abort(rx: &mut Option<mpsc::UnboundedReceiver<AbortRequest>>) -> AbortRequest {
    match rx {
        Some(r) => match r.recv().await {
            Some(a) => a,
            // Every sender is gone: the gateway forgot the run; nothing can abort it any more.
            None => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

enum Wake {
    Due,
    Abort(AbortRequest),
}

/// The run task's mutable progress.
struct Player {
    shared: Arc<Shared>,
    plan: RunPlan,
    paused: watch::Receiver<bool>,
    /// The gateway's freeze: holds the run like a pause (a stopped process has no clock).
    frozen: watch::Receiver<bool>,
    /// Time spent paused: pushes every later deadline back (a paused run's clock stands still).
    pause_shift: Duration,
    /// Cumulative text of the last chat event sent (the partial text of an abort).
    partial: String,
    /// Last per-run `seq` sent (an abort continues with `last + 1`).
    last_seq: u64,
    /// When the run started replaying (epoch ms).
    started_at: i64,
    /// Whether it started (it may still wait for an earlier run of its session).
    started: bool,
}

impl Player {
    /// Waits until `deadline` (plus time spent paused or frozen), or until an abort arrives.
    async fn wait_due(&mut self, deadline: Instant) -> Wake {
        loop {
            // Both flags are read (and marked seen) every round, so a change of either wakes us.
            let paused = *self.paused.borrow_and_update();
            let frozen = *self.frozen.borrow_and_update();
            if paused || frozen {
                let since = Instant::now();
                tokio::select! {
                    () = flag_changed(&mut self.paused) => {}
                    () = flag_changed(&mut self.frozen) => {}
                    a = next_abort(&mut self.plan.aborts) => return Wake::Abort(a),
                }
                self.pause_shift += since.elapsed();
                continue;
            }
            tokio::select! {
                _ = tokio::time::sleep_until(deadline + self.pause_shift) => return Wake::Due,
                () = flag_changed(&mut self.paused) => {}
                () = flag_changed(&mut self.frozen) => {}
                a = next_abort(&mut self.plan.aborts) => return Wake::Abort(a),
            }
        }
    }

    /// Sends one scripted frame of this run (timestamps are now's: nothing to shift).
    fn emit_scripted(&mut self, frame: ScriptFrame) {
        let protocol = self.shared.protocol();
        let p = &self.plan;
        match frame {
            ScriptFrame::Chat { state, text } => {
                let seq = self.last_seq + 1;
                let mut payload = json!({
                    "runId": p.run_id, "sessionKey": p.session_key, "agentId": p.agent_id, "seq": seq,
                    "state": state,
                    "message": {"role": "assistant", "content": [{"type": "text", "text": text}], "timestamp": now_ms()},
                });
                if state == "error" {
                    payload["errorMessage"] = json!(text);
                }
                self.shared.lock().broadcast(protocol, "chat", &payload, Some(&p.session_key));
                self.last_seq = seq;
                self.partial = text;
            }
            ScriptFrame::Event { name, mut payload } => {
                script::fill(&mut payload, "runId", &p.run_id);
                script::fill(&mut payload, "sessionKey", &p.session_key);
                self.shared.lock().broadcast(protocol, &name, &payload, Some(&p.session_key));
            }
            ScriptFrame::Res(mut payload) => {
                script::fill(&mut payload, "runId", &p.run_id);
                if let Ok(text) = encode_response(&p.request_id, Ok(&payload)) {
                    self.shared.lock().send_to(p.requester, text);
                }
            }
        }
    }

    fn shift(&self, payload: &mut Value, t_ms: u64) {
        if let Some(rec) = self.plan.recorded_epoch_ms {
            let recorded_at = rec.saturating_add(i64::try_from(t_ms).unwrap_or(i64::MAX));
            shift_timestamps(payload, now_ms() - recorded_at);
        }
    }

    fn set_status(&self, status: RunStatus) {
        let mut st = self.shared.lock();
        if let Some(idx) = st.runs.get(&self.plan.run_id).map(|r| r.record) {
            if let Some(rec) = st.records.get_mut(idx) {
                rec.status = status;
            }
        }
    }

    fn emit_event(&mut self, name: &str, mut payload: Value, t_ms: u64) {
        self.shift(&mut payload, t_ms);
        if let Some(seq) = payload.get("seq").and_then(Value::as_u64) {
            if name == "chat" || name == "agent" {
                self.last_seq = seq;
            }
        }
        let mut lifecycle_end = None;
        match name {
            "chat" => {
                if let Some(text) = payload.pointer("/message/content/0/text").and_then(Value::as_str) {
                    self.partial = text.to_owned();
                }
            }
            "agent"
                if payload.get("stream").and_then(Value::as_str) == Some("lifecycle")
                    && payload.pointer("/data/phase").and_then(Value::as_str) == Some("end") =>
            {
                lifecycle_end = payload.get("data").and_then(Value::as_object).cloned();
            }
            _ => {}
        }
        let protocol = self.shared.protocol();
        let mut st = self.shared.lock();
        st.broadcast(protocol, name, &payload, Some(&self.plan.session_key));
        if let (Some(data), Some(run)) = (lifecycle_end, st.runs.get_mut(&self.plan.run_id)) {
            // What `agent.wait` reports besides status and endedAt (protocol 4 only).
            if protocol >= 4 {
                for k in ["stopReason", "livenessState", "terminalReceipt", "terminalReply"] {
                    if let Some(v) = data.get(k) {
                        run.wait_extras.insert(k.to_owned(), v.clone());
                    }
                }
            }
        }
    }

    /// Sends the final `res` and records the run as over. Returns the abort receiver so that
    /// requests that raced with the end get their "nothing to abort" answer.
    fn finish(&mut self, payload: Value, aborted: bool, assistant_text: Option<String>) {
        let ended = now_ms();
        let status = match payload.get("status").and_then(Value::as_str) {
            Some("ok") => RunStatus::Ok,
            Some("timeout") => RunStatus::Timeout,
            _ => RunStatus::Error,
        };
        {
            let mut st = self.shared.lock();
            if let Ok(text) = encode_response(&self.plan.request_id, Ok(&payload)) {
                st.send_to(self.plan.requester, text);
            }
            if let Some(run) = st.runs.get_mut(&self.plan.run_id) {
                run.final_payload = Some(payload);
                run.ended_at = Some(ended);
                run.abort_tx = None;
                run.playing = false;
                let idx = run.record;
                if let Some(rec) = st.records.get_mut(idx) {
                    rec.status = status;
                    rec.aborted = aborted;
                    rec.finished_at = Some(std::time::Instant::now());
                }
            }
            if let Some(text) = assistant_text.filter(|t| !t.is_empty()) {
                let session = st.session_mut(&self.plan.session_key);
                session.transcript.push(json!({
                    "role": "assistant",
                    "content": [{"type": "text", "text": text}],
                    "stopReason": if aborted { "rpc" } else { "stop" },
                    "timestamp": ended,
                    "__openclaw": {"runId": self.plan.run_id},
                }));
                session.updated_at = ended;
            }
        }
        self.shared.runs_changed.send_modify(|n| *n += 1);
        let _ = self.plan.done.send(true);
        // Abort requests sent before `abort_tx` was cleared: nothing is running any more.
        if let Some(mut rx) = self.plan.aborts.take() {
            rx.close();
            while let Ok(a) = rx.try_recv() {
                answer_abort(&self.shared, &a, a.kind.nothing());
            }
        }
    }

    /// The gateway's abort sequence (observed on 2026.9.6): `chat` `aborted` with the partial
    /// text and `seq` = last + 1, lifecycle `end` `{status:"cancelled", aborted:true}`, the abort
    /// method's answer, one trailing lifecycle `error` whose per-run `seq` restarts at 1, and
    /// the `agent` final `res` `{status:"timeout", summary:"aborted", stopReason:"rpc"}`.
    ///
    /// A run aborted while still queued behind another run of its session never started: its
    /// `aborted` chat event has no message and its lifecycle `end` no `startedAt`.
    fn abort(&mut self, request: AbortRequest) {
        let now = now_ms();
        let seq = self.last_seq + 1;
        let p = &self.plan;
        let mut chat = json!({
            "runId": p.run_id, "sessionKey": p.session_key, "agentId": p.agent_id, "seq": seq,
            "state": "aborted", "stopReason": "rpc",
        });
        let mut end_data = json!({"phase": "end", "status": "cancelled", "aborted": true, "stopReason": "rpc", "endedAt": now});
        if self.started {
            chat["message"] = json!({"role": "assistant", "content": [{"type": "text", "text": self.partial}], "timestamp": now});
            end_data["startedAt"] = json!(self.started_at);
        }
        let end = json!({
            "runId": p.run_id, "sessionKey": p.session_key, "sessionId": p.session_id, "agentId": p.agent_id,
            "stream": "lifecycle", "data": end_data, "seq": seq, "ts": now,
        });
        let error = json!({
            "runId": p.run_id, "stream": "lifecycle",
            "data": {"phase": "error", "startedAt": self.started_at, "endedAt": now, "error": "This operation was aborted",
                     "aborted": true, "stopReason": "aborted", "executionSettled": true},
            "sessionKey": p.session_key, "sessionId": p.session_id, "agentId": p.agent_id, "seq": 1, "ts": now,
        });
        let protocol = self.shared.protocol();
        {
            let mut st = self.shared.lock();
            st.broadcast(protocol, "chat", &chat, Some(&p.session_key));
            st.broadcast(protocol, "agent", &end, Some(&p.session_key));
            if let Ok(text) = encode_response(&request.request_id, Ok(&request.kind.aborted(&p.run_id))) {
                st.send_to(request.conn, text);
            }
            st.broadcast(protocol, "agent", &error, Some(&p.session_key));
            // What agent.wait reports for an aborted run (2026.9.6): `error` + `rpc`, and when the
            // run started only if `chat.abort` stopped it.
            if let Some(run) = st.runs.get_mut(&p.run_id) {
                run.wait_extras.insert("status".to_owned(), json!("error"));
                run.wait_extras.insert("stopReason".to_owned(), json!("rpc"));
                if self.started && request.kind == AbortKind::Chat {
                    run.wait_extras.insert("startedAt".to_owned(), json!(self.started_at));
                }
            }
        }
        let partial = std::mem::take(&mut self.partial);
        let fin = json!({"runId": self.plan.run_id, "status": "timeout", "summary": "aborted", "stopReason": "rpc"});
        self.finish(fin, true, Some(partial));
    }
}

/// Resolves when a watch flag changes; never once its sender is gone (the gateway is being dropped
/// and nothing more will be replayed).
async fn flag_changed(rx: &mut watch::Receiver<bool>) {
    if rx.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Answers an abort method call (from a run task, to keep the gateway's frame order).
pub(crate) fn answer_abort(shared: &Shared, request: &AbortRequest, payload: Value) {
    if let Ok(text) = encode_response(&request.request_id, Ok(&payload)) {
        shared.lock().send_to(request.conn, text);
    }
}

/// Replays one run to its end.
pub(crate) async fn play(shared: Arc<Shared>, plan: RunPlan) {
    let speed = shared.cfg.speed;
    let paused = shared.paused.subscribe();
    let frozen = shared.frozen.subscribe();
    let mut player = Player {
        shared,
        plan,
        paused,
        frozen,
        pause_shift: Duration::ZERO,
        partial: String::new(),
        last_seq: 0,
        started_at: now_ms(),
        started: false,
    };

    // 1. The ACK: immediate on the gateway apart from its own latency, never held by a pause.
    tokio::time::sleep_until(player.plan.requested_at + scaled(speed, player.plan.rendered.ack_t_ms)).await;
    if !player.plan.script.lose_ack {
        let mut ack = player.plan.rendered.ack.clone();
        if let Some(obj) = ack.as_object_mut() {
            if obj.contains_key("acceptedAt") {
                obj.insert("acceptedAt".to_owned(), json!(now_ms()));
            }
        }
        if let Ok(text) = encode_response(&player.plan.request_id, Ok(&ack)) {
            player.shared.lock().send_to(player.plan.requester, text);
        }
    }

    // 2. Wait for the session's previous run (runs of one session are serialised).
    let mut base = player.plan.requested_at;
    if let Some(mut prev) = player.plan.prev.take() {
        if !*prev.borrow() {
            tokio::select! {
                // An error means the previous run was forgotten: this one may go.
                _ = wait_true(&mut prev) => {}
                a = next_abort(&mut player.plan.aborts) => {
                    player.abort(a);
                    return;
                }
            }
            base = Instant::now();
        }
    }
    player.started_at = now_ms();
    player.started = true;
    {
        let mut st = player.shared.lock();
        if let Some(run) = st.runs.get_mut(&player.plan.run_id) {
            run.playing = true;
            run.started_at = Some(player.started_at);
        }
    }
    player.set_status(RunStatus::Running);

    // 3. The recorded timeline.
    let steps = std::mem::take(&mut player.plan.rendered.steps);
    let mut finished = false;
    for step in steps {
        // Once the final is out, nothing can abort the run any more.
        let wake = player.wait_due(base + scaled(speed, step.t_ms)).await;
        if let Wake::Abort(a) = wake {
            if finished {
                answer_abort(&player.shared, &a, a.kind.nothing());
            } else {
                player.abort(a);
                return;
            }
        }
        match step.kind {
            StepKind::Event { name, payload } => player.emit_event(&name, payload, step.t_ms),
            StepKind::Final { mut payload } => {
                player.shift(&mut payload, step.t_ms);
                for frame in std::mem::take(&mut player.plan.script.before_final) {
                    player.emit_scripted(frame);
                }
                if let Some(patch) = player.plan.script.final_patch.take() {
                    script::merge(&mut payload, &patch);
                }
                let text = payload.pointer("/result/payloads/0/text").and_then(Value::as_str).map(str::to_owned);
                player.finish(payload, false, text);
                finished = true;
                for frame in std::mem::take(&mut player.plan.script.after_final) {
                    player.emit_scripted(frame);
                }
            }
        }
    }
}
