//! Events a multiplexer routes (`chat`, `agent`) or acts on (`connect.challenge`, `tick`,
//! `shutdown`). Every other event name decodes to [`GatewayEvent::Other`] and is ignored.

use crate::error::DecodeError;
use crate::handshake::ConnectChallenge;
use crate::wire::{ContentText, Str};
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
            "chat" => GatewayEvent::Chat(ChatEvent::from_wire(parse(name, payload)?)),
            "agent" => GatewayEvent::Agent(AgentEvent::from_wire(parse(name, payload)?)),
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

/// A `chat` event payload, as a multiplexer needs it: the message is reduced to its text while
/// it is decoded (one pass, nothing of it kept but the text). Session key and run id are optional
/// in decoding so that a frame lacking them can be counted and dropped by the router rather than
/// rejected as malformed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatEvent {
    /// Gateway run id (= the `agent` idempotency key).
    pub run_id: Option<String>,
    /// Canonical session key.
    pub session_key: Option<String>,
    /// Per-run sequence number (shared with `agent` events; resets to 1 after an abort). Unused
    /// by clawmux; a bad one is absent rather than costing the run its text.
    pub seq: Option<u64>,
    /// Delta, final, aborted or error.
    pub state: ChatState,
    /// The CUMULATIVE text of the assistant message: all its text blocks concatenated (not only
    /// the first); `None` when the event has no message.
    pub text: Option<String>,
    /// Error text of an `error` state.
    pub error_message: Option<String>,
}

impl ChatEvent {
    /// The cumulative text of the message, if the event has one.
    pub fn text(&self) -> Option<&str> {
        self.text.as_deref()
    }
}

/// A chat message on the wire. Fields in wire order (a struct may also come as a JSON array).
#[derive(Deserialize)]
struct MessageWire<'a> {
    /// `assistant` for run output; unused, but must be a string.
    #[serde(default, borrow)]
    #[allow(dead_code)]
    role: Option<Str<'a>>,
    /// Content blocks (text, and others a multiplexer does not stream), or a plain string.
    #[serde(default)]
    content: ContentText,
}

/// A `chat` payload on the wire, borrowed. Fields in the order of the payload's schema (a struct
/// may also come as a JSON array, which fills them in this order).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ChatWire<'a> {
    /// Routing key (with the session key); borrowed until the event leaves the decoder.
    #[serde(default, borrow)]
    run_id: Option<Str<'a>>,
    /// Routing key (with the run id).
    #[serde(default, borrow)]
    session_key: Option<Str<'a>>,
    /// Per-run sequence number (a hint; a bad one is absent).
    #[serde(default, deserialize_with = "crate::num::lenient_u64")]
    seq: Option<u64>,
    /// Delta, final, aborted or error.
    state: ChatState,
    /// The message, reduced to its text while it is decoded.
    #[serde(default, borrow)]
    message: Option<MessageWire<'a>>,
    /// Protocol 4: the increment of this delta (absent on protocol 3). Unused: clawmux diffs
    /// cumulative text by prefix because coalescing can merge increments; must be a string.
    #[serde(default, borrow)]
    #[allow(dead_code)]
    delta_text: Option<Str<'a>>,
    /// Why the chat stopped (`stop`, `rpc` for aborts). Unused; must be a string.
    #[serde(default, borrow)]
    #[allow(dead_code)]
    stop_reason: Option<Str<'a>>,
    /// Error text of an `error` state (kept: it becomes the run's error message).
    #[serde(default, borrow)]
    error_message: Option<Str<'a>>,
}

/// A `chat` payload decoded straight from its frame (see `one_pass`).
pub(crate) struct ChatPayload(pub(crate) ChatEvent);

impl<'de> Deserialize<'de> for ChatPayload {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        ChatWire::deserialize(d).map(|w| ChatPayload(ChatEvent::from_wire(w)))
    }
}

/// An `agent` payload decoded straight from its frame (see `one_pass`).
pub(crate) struct AgentPayload(pub(crate) AgentEvent);

impl<'de> Deserialize<'de> for AgentPayload {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        AgentWire::deserialize(d).map(|w| AgentPayload(AgentEvent::from_wire(w)))
    }
}

impl ChatEvent {
    fn from_wire(w: ChatWire<'_>) -> Self {
        Self {
            run_id: w.run_id.map(Str::into_owned),
            session_key: w.session_key.map(Str::into_owned),
            seq: w.seq,
            state: w.state,
            text: w.message.map(|m| m.content.0),
            error_message: w.error_message.map(Str::into_owned),
        }
    }
}

/// An `agent` event payload. Its `data` is looked at once, while the frame is decoded, and only
/// for the streams that drive `status` events; nothing of it is kept but that signal (tool
/// arguments and results never leave the decoder).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentEvent {
    /// Gateway run id.
    pub run_id: Option<String>,
    /// Canonical session key.
    pub session_key: Option<String>,
    /// Per-run sequence number (unused by clawmux; a bad one is absent).
    pub seq: Option<u64>,
    /// `lifecycle`, `assistant`, `tool`, `usage`, `item`, `command_output`, `compaction`, ...
    pub stream: String,
    /// What the event says for `status` events (see [`AgentEvent::signal`]).
    pub signal: Option<AgentSignal>,
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

/// An `agent` payload on the wire, borrowed. Fields in the order of the payload's schema.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct AgentWire<'a> {
    /// Routing key (with the session key).
    #[serde(default, borrow)]
    run_id: Option<Str<'a>>,
    /// Routing key (with the run id).
    #[serde(default, borrow)]
    session_key: Option<Str<'a>>,
    /// Per-run sequence number (a hint; a bad one is absent).
    #[serde(default, deserialize_with = "crate::num::lenient_u64")]
    seq: Option<u64>,
    /// Which stream: decides whether `data` has a signal at all.
    #[serde(borrow)]
    stream: Str<'a>,
    /// Stream-specific data: checked to be JSON, decoded only for a signal.
    #[serde(default, borrow)]
    data: Option<&'a RawValue>,
}

/// The signal of an `agent` event of `stream` with `data`. `None` for streams that carry nothing
/// a caller may see (assistant text comes from `chat`; tool args never leave), and for data that
/// does not decode (a signal is a hint; the run goes on without it).
fn signal_of(stream: &str, data: Option<&RawValue>) -> Option<AgentSignal> {
    if !matches!(stream, "lifecycle" | "tool" | "item" | "compaction" | "usage") {
        // Most agent events (the assistant stream) stop here, before their data is parsed again.
        return None;
    }
    let data: SignalData = serde_json::from_str(data?.get()).ok()?;
    match stream {
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

impl AgentEvent {
    fn from_wire(w: AgentWire<'_>) -> Self {
        let signal = signal_of(w.stream.as_str(), w.data);
        Self {
            run_id: w.run_id.map(Str::into_owned),
            session_key: w.session_key.map(Str::into_owned),
            seq: w.seq,
            stream: w.stream.into_owned(),
            signal,
        }
    }

    /// What the event says that drives `status` events, if anything (decoded with the frame).
    pub fn signal(&self) -> Option<AgentSignal> {
        self.signal.clone()
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

    fn agent(payload: &str) -> AgentEvent {
        match GatewayEvent::decode("agent", Some(payload)) {
            Ok(GatewayEvent::Agent(a)) => a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn text_joins_all_text_blocks() {
        let GatewayEvent::Chat(c) = GatewayEvent::decode(
            "chat",
            Some(r#"{"runId":"r","sessionKey":"s","state":"delta","message":{"role":"assistant","content":[{"type":"text","text":"a"},{"type":"thinking"},{"type":"text","text":"b"}]}}"#),
        )
        .expect("decodes") else {
            panic!("not chat")
        };
        assert_eq!(c.text(), Some("ab"));
    }

    #[test]
    fn tool_signal_never_carries_arguments() {
        let a = agent(r#"{"runId":"r","sessionKey":"s","stream":"tool","data":{"phase":"start","name":"exec","args":{"command":"cat /secret"}}}"#);
        assert_eq!(a.signal(), Some(AgentSignal::ToolStart("exec".into())));
    }

    #[test]
    fn lifecycle_signal() {
        let a = agent(r#"{"runId":"r","sessionKey":"s","stream":"lifecycle","data":{"phase":"start"}}"#);
        assert_eq!(a.signal(), Some(AgentSignal::Lifecycle("start".into())));
    }
}
