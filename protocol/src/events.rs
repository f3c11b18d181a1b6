//! Events a multiplexer routes (`chat`, `agent`) or acts on (`connect.challenge`, `tick`,
//! `shutdown`). Every other event name decodes to [`GatewayEvent::Other`] and is ignored.

use crate::error::DecodeError;
use crate::handshake::ConnectChallenge;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// A decoded event payload.
#[derive(Debug)]
pub enum GatewayEvent {
    /// First frame of every connection; its nonce is signed by device identities.
    ConnectChallenge(ConnectChallenge),
    /// Chat stream of a run: cumulative text, then a terminal state.
    Chat(ChatEvent),
    /// Agent stream of a run: lifecycle, assistant, tool, usage, ...
    Agent(AgentEvent),
    /// Keep-alive, every `policy.tickIntervalMs`.
    Tick(Tick),
    /// The gateway is going away; reconnect after `restartExpectedMs`.
    Shutdown(Shutdown),
    /// Any other event (`presence`, `health`, `task`, ...): ignored by a multiplexer.
    Other {
        /// The event name.
        name: String,
    },
}

fn parse<'a, T: Deserialize<'a>>(event: &str, payload: Option<&'a str>) -> Result<T, DecodeError> {
    let raw = payload.ok_or_else(|| DecodeError::Malformed {
        what: format!("event {event}"),
        reason: "missing payload".to_owned(),
    })?;
    serde_json::from_str(raw).map_err(|e| DecodeError::Malformed { what: format!("event {event}"), reason: e.to_string() })
}

impl GatewayEvent {
    /// Decodes the payload of the event called `name`.
    pub fn decode(name: &str, payload: Option<&str>) -> Result<Self, DecodeError> {
        Ok(match name {
            "chat" => GatewayEvent::Chat(parse(name, payload)?),
            "agent" => GatewayEvent::Agent(parse(name, payload)?),
            "tick" => GatewayEvent::Tick(match payload {
                Some(_) => parse(name, payload)?,
                None => Tick { ts: None },
            }),
            "shutdown" => GatewayEvent::Shutdown(match payload {
                Some(_) => parse(name, payload)?,
                None => Shutdown { reason: None, restart_expected_ms: None },
            }),
            "connect.challenge" => GatewayEvent::ConnectChallenge(parse(name, payload)?),
            other => GatewayEvent::Other { name: other.to_owned() },
        })
    }

    /// `(sessionKey, runId)` of a run-scoped event, as the frame carries them.
    pub fn route_key(&self) -> Option<(Option<&str>, Option<&str>)> {
        match self {
            GatewayEvent::Chat(c) => Some((c.session_key.as_deref(), c.run_id.as_deref())),
            GatewayEvent::Agent(a) => Some((a.session_key.as_deref(), a.run_id.as_deref())),
            _ => None,
        }
    }
}

/// State of a `chat` event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChatState {
    /// Cumulative text so far (coalesced, not one per LLM chunk).
    Delta,
    /// The run's chat finished; a signal only (the `agent` final `res` is authoritative).
    Final,
    /// The run was aborted; `message` holds the partial text.
    Aborted,
    /// The run failed; `errorMessage` says why.
    Error,
}

/// A `chat` event payload. Session key and run id are optional in decoding so that a frame lacking
/// them can be counted and dropped by the router rather than rejected as malformed.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChatEvent {
    /// Gateway run id (= the `agent` idempotency key).
    #[serde(default)]
    pub run_id: Option<String>,
    /// Canonical session key.
    #[serde(default)]
    pub session_key: Option<String>,
    /// Per-run sequence number (shared with `agent` events; resets to 1 after an abort). Unused
    /// by clawmux; a bad one is absent rather than costing the run its text.
    #[serde(default, deserialize_with = "crate::num::lenient_u64")]
    pub seq: Option<u64>,
    /// Delta, final, aborted or error.
    pub state: ChatState,
    /// The assistant message; its text is CUMULATIVE.
    #[serde(default)]
    pub message: Option<ChatMessage>,
    /// Protocol 4: the increment of this delta (absent on protocol 3). Informational only:
    /// clawmux diffs cumulative text by prefix because coalescing can merge increments.
    #[serde(default)]
    pub delta_text: Option<String>,
    /// Why the chat stopped (`stop`, `rpc` for aborts).
    #[serde(default)]
    pub stop_reason: Option<String>,
    /// Error text of an `error` state.
    #[serde(default)]
    pub error_message: Option<String>,
}

impl ChatEvent {
    /// The cumulative text of the message: all text blocks concatenated (not only the first).
    pub fn text(&self) -> Option<String> {
        self.message.as_ref().map(ChatMessage::text)
    }
}

/// A chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    /// `assistant` for run output.
    #[serde(default)]
    pub role: Option<String>,
    /// Content blocks (text, and others a multiplexer does not stream).
    #[serde(default)]
    pub content: MessageContent,
}

/// Message content: a list of blocks, or (older shapes) a plain string.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// `[{"type":"text","text":"..."}, ...]`
    Blocks(Vec<ContentBlock>),
    /// A plain string.
    Text(String),
}

impl Default for MessageContent {
    fn default() -> Self {
        MessageContent::Blocks(Vec::new())
    }
}

/// One content block.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentBlock {
    /// Block type; only `text` blocks are streamed.
    #[serde(rename = "type")]
    pub kind: String,
    /// Text of a `text` block.
    #[serde(default)]
    pub text: Option<String>,
}

impl ChatMessage {
    /// Concatenated text of all `text` blocks.
    pub fn text(&self) -> String {
        match &self.content {
            MessageContent::Text(s) => s.clone(),
            MessageContent::Blocks(blocks) => {
                let mut out = String::new();
                for b in blocks.iter().filter(|b| b.kind == "text") {
                    if let Some(t) = &b.text {
                        out.push_str(t);
                    }
                }
                out
            }
        }
    }
}

/// An `agent` event payload.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentEvent {
    /// Gateway run id.
    #[serde(default)]
    pub run_id: Option<String>,
    /// Canonical session key.
    #[serde(default)]
    pub session_key: Option<String>,
    /// Per-run sequence number (unused by clawmux; a bad one is absent).
    #[serde(default, deserialize_with = "crate::num::lenient_u64")]
    pub seq: Option<u64>,
    /// `lifecycle`, `assistant`, `tool`, `usage`, `item`, `command_output`, `compaction`, ...
    pub stream: String,
    /// Stream-specific data, decoded only by whoever needs it.
    #[serde(default)]
    pub data: Option<Box<RawValue>>,
}

/// What a status-relevant `agent` event says, without tool arguments or results.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentSignal {
    /// Lifecycle phase (`start`, `model`, `finishing`, `end`, `error`).
    Lifecycle(String),
    /// A tool started (name only).
    ToolStart(String),
    /// A tool ended.
    ToolEnd,
    /// Context compaction started.
    CompactionStart,
    /// Context compaction ended.
    CompactionEnd,
    /// Output tokens reported by the usage stream (protocol 4).
    Usage { output_tokens: Option<u64>, input_tokens: Option<u64> },
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SignalData {
    #[serde(default)]
    phase: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default, deserialize_with = "crate::num::lenient_u64")]
    output_tokens: Option<u64>,
    #[serde(default, deserialize_with = "crate::num::lenient_u64")]
    input_tokens: Option<u64>,
}

impl AgentEvent {
    /// Decodes the parts of `data` that drive `status` events. Returns `None` for streams that
    /// carry nothing a caller may see (assistant text comes from `chat`; tool args never leave).
    pub fn signal(&self) -> Option<AgentSignal> {
        let data: SignalData = serde_json::from_str(self.data.as_ref()?.get()).ok()?;
        match self.stream.as_str() {
            "lifecycle" => data.phase.map(AgentSignal::Lifecycle),
            "tool" | "item" => match data.phase.as_deref() {
                Some("start") => Some(AgentSignal::ToolStart(data.name.unwrap_or_else(|| "tool".to_owned()))),
                Some("end") | Some("result") => Some(AgentSignal::ToolEnd),
                _ => None,
            },
            "compaction" => match data.phase.as_deref() {
                Some("start") => Some(AgentSignal::CompactionStart),
                Some("end") => Some(AgentSignal::CompactionEnd),
                _ => None,
            },
            "usage" => Some(AgentSignal::Usage { output_tokens: data.output_tokens, input_tokens: data.input_tokens }),
            _ => None,
        }
    }
}

/// `tick` payload.
#[derive(Debug, Clone, Deserialize)]
pub struct Tick {
    /// Gateway time in ms (unused; a bad one is absent, and the tick still counts).
    #[serde(default, deserialize_with = "crate::num::lenient_u64")]
    pub ts: Option<u64>,
}

/// `shutdown` payload.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Shutdown {
    /// Why the gateway is going away.
    #[serde(default)]
    pub reason: Option<String>,
    /// When it expects to be back: a hint, clamped to clawmux's backoff range where it is used; a
    /// bad one is absent (the shutdown is still one).
    #[serde(default, deserialize_with = "crate::num::lenient_u64")]
    pub restart_expected_ms: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_joins_all_text_blocks() {
        let c: ChatEvent = serde_json::from_str(
            r#"{"runId":"r","sessionKey":"s","state":"delta","message":{"role":"assistant","content":[{"type":"text","text":"a"},{"type":"thinking"},{"type":"text","text":"b"}]}}"#,
        )
        .expect("decodes");
        assert_eq!(c.text().as_deref(), Some("ab"));
    }

    #[test]
    fn tool_signal_never_carries_arguments() {
        let a: AgentEvent = serde_json::from_str(
            r#"{"runId":"r","sessionKey":"s","stream":"tool","data":{"phase":"start","name":"exec","args":{"command":"cat /secret"}}}"#,
        )
        .expect("decodes");
        assert_eq!(a.signal(), Some(AgentSignal::ToolStart("exec".into())));
    }

    #[test]
    fn lifecycle_signal() {
        let a: AgentEvent =
            serde_json::from_str(r#"{"runId":"r","sessionKey":"s","stream":"lifecycle","data":{"phase":"start"}}"#).expect("decodes");
        assert_eq!(a.signal(), Some(AgentSignal::Lifecycle("start".into())));
    }
}
