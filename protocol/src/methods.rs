//! Params and results of the methods a multiplexer calls. Params are closed (like the gateway's
//! own schemas, where one unknown field rejects the call), so the replay gateway validates with the
//! same types.

use crate::error::DecodeError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Method names.
pub mod name {
    /// Handshake.
    pub const CONNECT: &str = "connect";
    /// Set the model override (and, on the Cogni fork, `outboundHeaders`) of a session.
    pub const SESSIONS_PATCH: &str = "sessions.patch";
    /// Receive a session's events (with cap `session-scoped-events`).
    pub const SESSIONS_SUBSCRIBE: &str = "sessions.messages.subscribe";
    /// Stop receiving a session's events.
    pub const SESSIONS_UNSUBSCRIBE: &str = "sessions.messages.unsubscribe";
    /// Start an agent run (two `res`: ACK, final).
    pub const AGENT: &str = "agent";
    /// Wait for a run's terminal snapshot (after a reconnect).
    pub const AGENT_WAIT: &str = "agent.wait";
    /// Abort a run by session key and run id.
    pub const CHAT_ABORT: &str = "chat.abort";
    /// Abort the active run of a session.
    pub const SESSIONS_ABORT: &str = "sessions.abort";
    /// The transcript of a session.
    pub const CHAT_HISTORY: &str = "chat.history";
    /// Liveness probe.
    pub const HEALTH: &str = "health";
}

/// `sessions.patch` params.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SessionsPatchParams {
    /// Session key.
    pub key: String,
    /// Model override, e.g. `cogni/fake-model`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Per-session LLM headers (Cogni fork only; stock OpenClaw rejects the field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outbound_headers: Option<BTreeMap<String, String>>,
}

/// Params that name one session: `sessions.messages.subscribe`/`.unsubscribe`, `sessions.abort`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionKeyParams {
    /// Session key.
    pub key: String,
}

/// `agent` params.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AgentParams {
    /// The user's message.
    pub message: String,
    /// Agent id (`main`).
    pub agent_id: String,
    /// Session key.
    pub session_key: String,
    /// Fresh UUID per run; the gateway uses it as the run id.
    pub idempotency_key: String,
    /// Gateway-side timeout in SECONDS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u64>,
    /// Appended to the system prompt of every LLM call of the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra_system_prompt: Option<String>,
    /// A label for the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
}

/// `agent.wait` params.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AgentWaitParams {
    /// The gateway run id.
    pub run_id: String,
    /// How long the gateway may wait for the run to end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// `chat.abort` params.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ChatAbortParams {
    /// Session key.
    pub session_key: String,
    /// The run to abort.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
}

/// Terminal status of an `agent` run as the final `res` reports it. An aborted run reports
/// `timeout` (with `summary: "aborted"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinalStatus {
    /// Completed.
    Ok,
    /// Failed; `summary` says why.
    Error,
    /// Timed out or aborted.
    Timeout,
}

/// The `agent` ACK.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentAck {
    /// The gateway run id.
    pub run_id: String,
    /// Protocol 4 only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_key: Option<String>,
    /// `accepted`, or `in_flight` for a repeated idempotency key of a run still running.
    pub status: String,
    /// Gateway time in ms (unused; a bad one is absent rather than a malformed ACK).
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "crate::num::lenient_u64")]
    pub accepted_at: Option<u64>,
}

/// The `agent` final `res` (authoritative).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentFinal {
    /// The gateway run id.
    pub run_id: String,
    /// ok, error, timeout.
    pub status: FinalStatus,
    /// `completed`, `aborted`, or an error summary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    /// Payloads and meta.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<AgentResult>,
    /// `rpc` for aborts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<String>,
}

/// `result` of the final `res`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct AgentResult {
    /// Reply payloads; the run's content is their texts joined by blank lines.
    #[serde(default)]
    pub payloads: Vec<Payload>,
    /// Duration, agent meta, usage hints, `aborted` (protocol 3 timeouts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meta: Option<serde_json::Value>,
}

/// One reply payload.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Payload {
    /// Text.
    #[serde(default)]
    pub text: Option<String>,
    /// Media URL (not streamed by clawmux).
    #[serde(default)]
    pub media_url: Option<String>,
}

impl AgentFinal {
    /// The run's content: every payload's text, joined by blank lines.
    pub fn content(&self) -> String {
        let Some(result) = &self.result else { return String::new() };
        result.payloads.iter().filter_map(|p| p.text.as_deref()).filter(|t| !t.is_empty()).collect::<Vec<_>>().join("\n\n")
    }

    /// True for an abort reported as `timeout`/`aborted`.
    pub fn is_abort(&self) -> bool {
        self.status == FinalStatus::Timeout && self.summary.as_deref() == Some("aborted")
    }

    /// Protocol 3 reports a run stopped by the `agent` `timeout` as `status: "ok"` with
    /// `result.meta.aborted: true` (and a "Request timed out" payload).
    pub fn meta_aborted(&self) -> bool {
        self.result.as_ref().and_then(|r| r.meta.as_ref()).and_then(|m| m.get("aborted")).and_then(serde_json::Value::as_bool) == Some(true)
    }

    /// Token usage reported by the gateway (`result.meta.agentMeta.usage`), a hint only.
    pub fn usage_hint(&self) -> Option<(u64, u64)> {
        let usage = self.result.as_ref()?.meta.as_ref()?.get("agentMeta")?.get("usage")?;
        let input = usage.get("input").or_else(|| usage.get("inputTokens")).and_then(|v| v.as_u64()).unwrap_or(0);
        let output = usage.get("output").or_else(|| usage.get("outputTokens")).and_then(|v| v.as_u64()).unwrap_or(0);
        Some((input, output))
    }
}

/// One of the two `res` of `agent`.
#[derive(Debug, Clone, PartialEq)]
pub enum AgentReply {
    /// First `res`: the run was accepted.
    Ack(AgentAck),
    /// Second `res` (or the only one, for a repeated idempotency key): the result.
    Final(AgentFinal),
}

/// Decodes an `ok` payload of the `agent` method.
pub fn decode_agent_reply(payload: &str) -> Result<AgentReply, DecodeError> {
    #[derive(Deserialize)]
    struct Status<'a> {
        #[serde(borrow)]
        status: Option<std::borrow::Cow<'a, str>>,
    }
    let malformed = |e: serde_json::Error| DecodeError::Malformed { what: "agent res".to_owned(), reason: e.to_string() };
    let s: Status<'_> = serde_json::from_str(payload).map_err(malformed)?;
    match s.status.as_deref() {
        // `in_flight`: a repeated idempotency key of a run the gateway is still running (its final
        // goes to the first request only): the ACK of that run, not a result.
        Some("accepted" | "in_flight") => Ok(AgentReply::Ack(serde_json::from_str(payload).map_err(malformed)?)),
        Some(_) => Ok(AgentReply::Final(serde_json::from_str(payload).map_err(malformed)?)),
        None => Err(DecodeError::Malformed { what: "agent res".to_owned(), reason: "missing status".to_owned() }),
    }
}

/// `agent.wait` result: the terminal snapshot of a run, or word that it has not ended yet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentWaitResult {
    /// The gateway run id.
    #[serde(default)]
    pub run_id: Option<String>,
    /// `ok`, `error`, `timeout` (also: the wait itself timed out), `pending` (still queued).
    pub status: String,
    /// When it ended (absent while it runs). Only its presence is read (it tells a run that timed
    /// out from a wait that did), so any number counts: a fractional, negative or huge time must
    /// not turn a finished run's answer into a protocol error. Not a number at all is malformed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<f64>,
    /// Error text, when the run failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<serde_json::Value>,
    /// Why it stopped: `rpc` when it was aborted (`chat.abort`, `sessions.abort`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<String>,
    /// The final reply (`{"text"}`), when the gateway kept it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub terminal_reply: Option<serde_json::Value>,
}

/// What an `agent.wait` answer means for the run that asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitOutcome {
    /// Not ended yet: the wait timed out while the run goes on, or the run is still queued.
    NotEnded,
    /// Completed; the final reply text when the gateway reports it.
    Ok(Option<String>),
    /// Failed, with the gateway's error text.
    Error(String),
    /// Aborted on the gateway (`stopReason: "rpc"`), possibly by someone else while clawmux was
    /// disconnected. The real gateway reports this as `status: "error"`.
    Aborted,
    /// The run itself timed out on the gateway.
    TimedOut,
}

impl AgentWaitResult {
    /// Classifies the answer. `None` for a status no gateway release is known to send.
    pub fn outcome(&self) -> Option<WaitOutcome> {
        let aborted = self.stop_reason.as_deref() == Some("rpc");
        Some(match self.status.as_str() {
            "pending" => WaitOutcome::NotEnded,
            // `timeout` without `endedAt` is the wait's own timeout: the run still runs.
            "timeout" if self.ended_at.is_none() && !aborted => WaitOutcome::NotEnded,
            "timeout" if aborted => WaitOutcome::Aborted,
            "timeout" => WaitOutcome::TimedOut,
            "error" if aborted => WaitOutcome::Aborted,
            "error" => WaitOutcome::Error(self.error_text().unwrap_or_else(|| "the agent run failed".to_owned())),
            "ok" => WaitOutcome::Ok(self.terminal_reply.as_ref().and_then(|r| r.get("text")).and_then(|t| t.as_str()).map(str::to_owned)),
            _ => return None,
        })
    }

    fn error_text(&self) -> Option<String> {
        match self.error.as_ref()? {
            serde_json::Value::String(s) => Some(s.clone()),
            v => v.get("message").and_then(|m| m.as_str()).map(str::to_owned),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_params_are_closed() {
        let bad = r#"{"message":"m","agentId":"main","sessionKey":"k","idempotencyKey":"i","outboundHeaders":{}}"#;
        let err = serde_json::from_str::<AgentParams>(bad).expect_err("closed schema");
        assert!(err.to_string().contains("outboundHeaders"));
    }

    #[test]
    fn decodes_ack_then_final() {
        let ack = decode_agent_reply(r#"{"runId":"k1","sessionKey":"s","agentId":"main","status":"accepted","acceptedAt":1}"#).expect("ack");
        assert!(matches!(ack, AgentReply::Ack(ref a) if a.run_id == "k1"));
        let fin = decode_agent_reply(
            r#"{"runId":"k1","status":"ok","summary":"completed","result":{"payloads":[{"text":"a","mediaUrl":null},{"text":"b"}],"meta":{"agentMeta":{"usage":{"input":10,"output":3}}}}}"#,
        )
        .expect("final");
        let AgentReply::Final(f) = fin else { panic!("final expected") };
        assert_eq!(f.content(), "a\n\nb");
        assert_eq!(f.usage_hint(), Some((10, 3)));
    }

    #[test]
    fn a_repeated_key_of_a_running_run_is_its_ack() {
        // openclaw 2026.9.6 (agent-dedupe): the cached ACK with `status: "in_flight"`, or only the
        // run id when the admission timed out.
        for raw in [
            r#"{"runId":"k1","status":"in_flight","sessionKey":"s","agentId":"main","admissionPending":true}"#,
            r#"{"runId":"k1","status":"in_flight"}"#,
        ] {
            let reply = decode_agent_reply(raw).expect("in_flight decodes");
            assert!(matches!(reply, AgentReply::Ack(ref a) if a.run_id == "k1" && a.status == "in_flight"), "{raw}: {reply:?}");
        }
    }

    #[test]
    fn abort_is_reported_as_timeout() {
        let AgentReply::Final(f) =
            decode_agent_reply(r#"{"runId":"k6","status":"timeout","summary":"aborted","stopReason":"rpc"}"#).expect("final")
        else {
            panic!()
        };
        assert!(f.is_abort());
    }

    #[test]
    fn agent_wait_answers_are_classified_as_the_real_gateway_means_them() {
        let w = |j: &str| serde_json::from_str::<AgentWaitResult>(j).expect("decodes").outcome();
        assert_eq!(w(r#"{"runId":"r","status":"timeout"}"#), Some(WaitOutcome::NotEnded), "the wait timed out");
        assert_eq!(w(r#"{"runId":"r","status":"pending","timeoutPhase":"queue"}"#), Some(WaitOutcome::NotEnded));
        assert_eq!(w(r#"{"runId":"r","status":"timeout","endedAt":5}"#), Some(WaitOutcome::TimedOut));
        assert_eq!(w(r#"{"runId":"r","status":"error","endedAt":5,"stopReason":"rpc"}"#), Some(WaitOutcome::Aborted));
        assert_eq!(w(r#"{"runId":"r","status":"timeout","endedAt":5,"stopReason":"rpc"}"#), Some(WaitOutcome::Aborted));
        assert_eq!(w(r#"{"runId":"r","status":"error","endedAt":5,"error":"boom"}"#), Some(WaitOutcome::Error("boom".into())));
        assert_eq!(
            w(r#"{"runId":"r","status":"ok","endedAt":5,"terminalReply":{"text":"hi"}}"#),
            Some(WaitOutcome::Ok(Some("hi".into())))
        );
        assert_eq!(w(r#"{"runId":"r","status":"sideways"}"#), None);
        // `endedAt` is a hint: any number says the run ended; not a number is malformed.
        assert_eq!(w(r#"{"runId":"r","status":"ok","endedAt":1.7e12,"terminalReply":{"text":"hi"}}"#), Some(WaitOutcome::Ok(Some("hi".into()))));
        assert_eq!(w(r#"{"runId":"r","status":"timeout","endedAt":-1}"#), Some(WaitOutcome::TimedOut));
        assert_eq!(w(r#"{"runId":"r","status":"timeout","endedAt":18446744073709551616}"#), Some(WaitOutcome::TimedOut));
        assert_eq!(w(r#"{"runId":"r","status":"timeout","endedAt":null}"#), Some(WaitOutcome::NotEnded));
        assert!(serde_json::from_str::<AgentWaitResult>(r#"{"runId":"r","status":"ok","endedAt":"yesterday"}"#).is_err());
    }

    #[test]
    fn unknown_final_status_is_malformed() {
        assert!(decode_agent_reply(r#"{"runId":"k","status":"exploded"}"#).is_err());
        assert!(decode_agent_reply(r#"{"runId":"k"}"#).is_err());
    }
}
