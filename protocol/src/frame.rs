//! The three frame kinds and their decoding.
//!
//! ```text
//! {"type":"req",   "id", "method", "params", "traceparent"?}
//! {"type":"res",   "id", "ok", "payload"?, "error"?}
//! {"type":"event", "event", "payload"?, "seq"?, "stateVersion"?}
//! ```
//! One JSON object per WebSocket text frame. A `res` payload is kept raw: only the caller knows
//! which method it answers (see [`crate::methods`]).

use crate::error::{DecodeError, ErrorShape};
use crate::events::GatewayEvent;
use crate::wire::Str;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// A decoded frame.
#[derive(Debug)]
pub enum Frame {
    /// A request (the gateway never sends one to a client; the replay gateway decodes them).
    Req(RequestFrame),
    /// A response to a request, matched by `id`.
    Res(ResponseFrame),
    /// An event, already decoded into its typed payload.
    Event(EventFrame),
}

/// A `req` frame as decoded by a server.
#[derive(Debug)]
pub struct RequestFrame {
    /// Client-chosen request id, echoed in the `res`.
    pub id: String,
    /// Method name, e.g. `agent`.
    pub method: String,
    /// Raw params; the server validates them against the method's closed schema.
    pub params: Box<RawValue>,
    /// W3C trace context (protocol 4 only; protocol 3 rejects the field).
    pub traceparent: Option<String>,
}

/// A `res` frame.
#[derive(Debug)]
pub struct ResponseFrame {
    /// The id of the request this answers. `agent` gets two responses with the same id.
    pub id: String,
    /// `true` when `payload` holds the result, `false` when `error` says why not.
    pub ok: bool,
    /// The result, raw until the caller decodes it for its method.
    pub payload: Option<Box<RawValue>>,
    /// The error when `ok` is false.
    pub error: Option<ErrorShape>,
}

/// An `event` frame.
#[derive(Debug)]
pub struct EventFrame {
    /// The typed event.
    pub event: GatewayEvent,
    /// Top-level sequence number (per connection on protocol 4, per gateway on protocol 3).
    pub seq: Option<u64>,
}

/// The union of all frame fields, borrowed where cheap. Decoded in one pass, then checked per kind.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireFrame<'a> {
    #[serde(rename = "type", borrow)]
    kind: Str<'a>,
    id: Option<String>,
    method: Option<String>,
    ok: Option<bool>,
    #[serde(borrow)]
    params: Option<&'a RawValue>,
    #[serde(borrow)]
    payload: Option<&'a RawValue>,
    error: Option<ErrorShape>,
    #[serde(borrow)]
    event: Option<Str<'a>>,
    // Unused by clawmux: a bad one must not cost the frame (a `res` carrying it would be lost).
    #[serde(default, deserialize_with = "crate::num::lenient_u64")]
    seq: Option<u64>,
    traceparent: Option<String>,
}

fn malformed(what: &str, reason: impl Into<String>) -> DecodeError {
    DecodeError::Malformed { what: what.to_owned(), reason: reason.into() }
}

/// Decodes one text frame, refusing anything larger than `max_payload` bytes before parsing.
pub fn decode_frame(text: &str, max_payload: usize) -> Result<Frame, DecodeError> {
    if text.len() > max_payload {
        return Err(DecodeError::TooLarge { size: text.len(), max: max_payload });
    }
    // Most frames: a chat or agent event, read in one pass. Anything else, and any frame it
    // refuses, is decoded below (which then refuses it with the same error as before).
    if let Some((event, seq)) = crate::one_pass::routed_event(text) {
        return Ok(Frame::Event(EventFrame { event, seq }));
    }
    let wire: WireFrame<'_> = match serde_json::from_str(text) {
        Ok(wire) => wire,
        Err(e) => {
            return Err(match response_id(text) {
                Some(id) => DecodeError::MalformedResponse { id, reason: e.to_string() },
                None => DecodeError::Json(e),
            })
        }
    };
    match wire.kind.as_str() {
        "res" => {
            let id = wire.id.ok_or_else(|| malformed("res", "missing id"))?;
            let Some(ok) = wire.ok else {
                return Err(DecodeError::MalformedResponse { id, reason: "missing ok".to_owned() });
            };
            if !ok && wire.error.is_none() {
                return Err(DecodeError::MalformedResponse { id, reason: "ok:false without error".to_owned() });
            }
            Ok(Frame::Res(ResponseFrame { id, ok, payload: wire.payload.map(RawValue::to_owned), error: wire.error }))
        }
        "event" => {
            let name = wire.event.ok_or_else(|| malformed("event", "missing event name"))?;
            let event = GatewayEvent::decode(name.as_str(), wire.payload.map(RawValue::get))?;
            Ok(Frame::Event(EventFrame { event, seq: wire.seq }))
        }
        "req" => {
            let id = wire.id.ok_or_else(|| malformed("req", "missing id"))?;
            let method = wire.method.ok_or_else(|| malformed("req", "missing method"))?;
            let params = match wire.params {
                Some(p) => p.to_owned(),
                None => return Err(malformed("req", "missing params")),
            };
            Ok(Frame::Req(RequestFrame { id, method, params, traceparent: wire.traceparent }))
        }
        other => Err(DecodeError::UnknownType(other.to_owned())),
    }
}

/// The `id` of a frame that is a `res` (read with every other field skipped), for a `res` whose
/// other fields do not decode (an `error` without a `code`, a `retryable` that is a string, ...).
fn response_id(text: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct ResId {
        #[serde(rename = "type")]
        kind: String,
        id: Option<String>,
    }
    let r: ResId = serde_json::from_str(text).ok()?;
    if r.kind == "res" {
        r.id
    } else {
        None
    }
}

/// An outbound request. `params` is always sent (the gateway wants at least `{}`).
#[derive(Serialize)]
struct OutboundRequest<'a, P: Serialize> {
    #[serde(rename = "type")]
    kind: &'static str,
    id: &'a str,
    method: &'a str,
    params: &'a P,
    #[serde(skip_serializing_if = "Option::is_none")]
    traceparent: Option<&'a str>,
}

/// Encodes a `req` frame. `traceparent` must be `None` on protocol 3 (it rejects the field).
pub fn encode_request<P: Serialize>(
    id: &str,
    method: &str,
    params: &P,
    traceparent: Option<&str>,
) -> Result<String, serde_json::Error> {
    serde_json::to_string(&OutboundRequest { kind: "req", id, method, params, traceparent })
}

/// An outbound `res` frame (servers: the replay gateway).
#[derive(Debug, Clone, Serialize)]
pub struct OutboundResponse<'a> {
    /// Always `"res"`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The request id.
    pub id: &'a str,
    /// Success flag.
    pub ok: bool,
    /// Result.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload: Option<&'a serde_json::Value>,
    /// Error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<&'a ErrorShape>,
}

/// Encodes a `res` frame.
pub fn encode_response(
    id: &str,
    payload: Result<&serde_json::Value, &ErrorShape>,
) -> Result<String, serde_json::Error> {
    let (ok, payload, error) = match payload {
        Ok(p) => (true, Some(p), None),
        Err(e) => (false, None, Some(e)),
    };
    serde_json::to_string(&OutboundResponse { kind: "res", id, ok, payload, error })
}

/// Encodes an `event` frame.
pub fn encode_event(event: &str, payload: &serde_json::Value, seq: Option<u64>) -> Result<String, serde_json::Error> {
    #[derive(Serialize)]
    struct OutboundEvent<'a> {
        #[serde(rename = "type")]
        kind: &'static str,
        event: &'a str,
        payload: &'a serde_json::Value,
        #[serde(skip_serializing_if = "Option::is_none")]
        seq: Option<u64>,
    }
    serde_json::to_string(&OutboundEvent { kind: "event", event, payload, seq })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::ChatState;

    const MAX: usize = 1 << 20;

    #[test]
    fn decodes_a_real_chat_delta() {
        let text = r#"{"type":"event","event":"chat","payload":{"runId":"k1","sessionKey":"agent:main:acct1:run1","agentId":"main","seq":3,"state":"delta","deltaText":"Hello","message":{"role":"assistant","content":[{"type":"text","text":"Hello"}],"timestamp":1795237768578}},"seq":9}"#;
        let Frame::Event(ev) = decode_frame(text, MAX).expect("decodes") else { panic!("not an event") };
        assert_eq!(ev.seq, Some(9));
        let GatewayEvent::Chat(chat) = ev.event else { panic!("not chat") };
        assert_eq!(chat.state, ChatState::Delta);
        assert_eq!(chat.run_id.as_deref(), Some("k1"));
        assert_eq!(chat.text(), Some("Hello"));
    }

    #[test]
    fn decodes_the_double_res_of_agent() {
        let ack = r#"{"type":"res","id":"A-4","ok":true,"payload":{"runId":"k1","sessionKey":"agent:main:acct1:run1","agentId":"main","status":"accepted","acceptedAt":1}}"#;
        let Frame::Res(res) = decode_frame(ack, MAX).expect("decodes") else { panic!() };
        assert!(res.ok);
        assert_eq!(res.id, "A-4");
    }

    /// A `res` whose body does not decode still names the request it answers (its caller would
    /// otherwise wait for an answer that already came); a frame that is no `res` does not.
    #[test]
    fn an_undecodable_res_still_names_its_request() {
        for text in [
            r#"{"type":"res","id":"cm-3","ok":false,"error":{"code":"UNAVAILABLE","message":"busy","retryable":"true"}}"#,
            r#"{"type":"res","id":"cm-3","ok":false,"error":{"message":"no code"}}"#,
            r#"{"type":"res","id":"cm-3","ok":true,"payload":{},"error":5}"#,
            r#"{"type":"res","id":"cm-3","ok":false}"#,
            r#"{"type":"res","id":"cm-3"}"#,
        ] {
            assert!(matches!(decode_frame(text, MAX), Err(DecodeError::MalformedResponse { ref id, .. }) if id == "cm-3"), "{text}");
        }
        for text in [r#"{"type":"req","id":"cm-3","error":5}"#, r#"{"type":"res","id":3,"ok":true}"#, r#"{"type":"res","ok":"yes"}"#, "not json"] {
            assert!(!matches!(decode_frame(text, MAX), Err(DecodeError::MalformedResponse { .. }) | Ok(_)), "{text}");
        }
    }

    #[test]
    fn refuses_oversize_before_parsing() {
        let text = "x".repeat(100);
        assert!(matches!(decode_frame(&text, 10), Err(DecodeError::TooLarge { size: 100, max: 10 })));
    }

    #[test]
    fn unknown_event_names_are_not_errors() {
        let text = r#"{"type":"event","event":"presence","payload":{"whatever":[1,2]}}"#;
        let Frame::Event(ev) = decode_frame(text, MAX).expect("decodes") else { panic!() };
        assert!(matches!(ev.event, GatewayEvent::Other { ref name } if name == "presence"));
    }

    #[test]
    fn malformed_known_events_are_errors() {
        for text in [
            r#"{"type":"event","event":"chat","payload":{"runId":"k1","sessionKey":"s","state":"sideways"}}"#,
            r#"{"type":"event","event":"chat","payload":{"runId":7,"sessionKey":"s","state":"delta"}}"#,
            r#"{"type":"event","event":"chat"}"#,
            r#"{"type":"event","event":"shutdown","payload":"soon"}"#,
            r#"{"type":"event","event":"agent","payload":{"runId":"r","sessionKey":"s"}}"#,
        ] {
            assert!(decode_frame(text, MAX).is_err(), "{text}");
        }
    }

    #[test]
    fn malformed_frames_are_errors() {
        for text in [
            "not json",
            "[]",
            r#"{"type":"res","ok":true}"#,
            r#"{"type":"res","id":"1"}"#,
            r#"{"type":"res","id":"1","ok":false}"#,
            r#"{"type":"event"}"#,
            r#"{"type":"bogus"}"#,
            r#"{"id":"1"}"#,
        ] {
            assert!(decode_frame(text, MAX).is_err(), "{text}");
        }
    }

    /// Every number clawmux only reads as a hint: a negative, fractional, too large or mistyped
    /// one is absent, and the frame around it is still understood (a refusal of a run's `agent`
    /// request lost to its `retryAfterMs` would leave the run waiting for its whole timeout).
    #[test]
    fn a_bad_hint_number_does_not_cost_the_frame() {
        for bad in ["-1", "1.5", "18446744073709551616", "1e300", "\"soon\"", "{}"] {
            let res = format!(
                r#"{{"type":"res","id":"cm-3","ok":false,"seq":{bad},"error":{{"code":"UNAVAILABLE","message":"busy","retryable":true,"retryAfterMs":{bad}}}}}"#
            );
            let Ok(Frame::Res(r)) = decode_frame(&res, MAX) else { panic!("{res}") };
            let e = r.error.expect("the refusal");
            assert_eq!((r.id.as_str(), e.code.as_str(), e.retry_after_ms), ("cm-3", "UNAVAILABLE", None), "{res}");
            let events = [
                format!(r#"{{"type":"event","event":"chat","seq":{bad},"payload":{{"runId":"r","sessionKey":"s","seq":{bad},"state":"delta","message":{{"role":"assistant","content":"Hi"}}}}}}"#),
                format!(r#"{{"type":"event","event":"agent","payload":{{"runId":"r","sessionKey":"s","seq":{bad},"stream":"usage","data":{{"outputTokens":{bad}}}}}}}"#),
                format!(r#"{{"type":"event","event":"tick","seq":{bad},"payload":{{"ts":{bad}}}}}"#),
                format!(r#"{{"type":"event","event":"shutdown","payload":{{"reason":"restart","restartExpectedMs":{bad}}}}}"#),
                format!(r#"{{"type":"event","event":"connect.challenge","payload":{{"nonce":"n","ts":{bad}}}}}"#),
            ];
            for text in &events {
                let Ok(Frame::Event(ev)) = decode_frame(text, MAX) else { panic!("{text}") };
                assert_eq!(ev.seq, None, "{text}");
                match ev.event {
                    GatewayEvent::Chat(c) => assert_eq!((c.seq, c.text()), (None, Some("Hi"))),
                    GatewayEvent::Agent(a) => {
                        assert_eq!(a.seq, None);
                        let usage = crate::events::AgentSignal::Usage { output_tokens: None, input_tokens: None };
                        assert_eq!(a.signal(), Some(usage), "{text}");
                    }
                    GatewayEvent::Tick(t) => assert_eq!(t.ts, None),
                    GatewayEvent::Shutdown(s) => assert_eq!((s.reason.as_deref(), s.restart_expected_ms), (Some("restart"), None)),
                    GatewayEvent::ConnectChallenge(c) => assert_eq!((c.nonce.as_str(), c.ts), ("n", None)),
                    GatewayEvent::Other { name } => panic!("{name}: {text}"),
                }
            }
            let ack = format!(r#"{{"runId":"k","sessionKey":"s","status":"accepted","acceptedAt":{bad}}}"#);
            let Ok(crate::methods::AgentReply::Ack(a)) = crate::methods::decode_agent_reply(&ack) else { panic!("{ack}") };
            assert_eq!((a.run_id.as_str(), a.accepted_at), ("k", None));
        }
        // In range, the values are kept as sent (bounded later, where they are used).
        let max = u64::MAX;
        let text = format!(r#"{{"type":"event","event":"shutdown","seq":{max},"payload":{{"restartExpectedMs":{max}}}}}"#);
        let Ok(Frame::Event(ev)) = decode_frame(&text, MAX) else { panic!("{text}") };
        assert_eq!(ev.seq, Some(max));
        assert!(matches!(ev.event, GatewayEvent::Shutdown(s) if s.restart_expected_ms == Some(max)));
    }

    #[test]
    fn encodes_requests_without_traceparent_when_absent() {
        let s = encode_request("1", "health", &serde_json::json!({}), None).expect("encodes");
        assert_eq!(s, r#"{"type":"req","id":"1","method":"health","params":{}}"#);
        let s = encode_request("2", "agent", &serde_json::json!({}), Some("00-a-b-01")).expect("encodes");
        assert!(s.ends_with(r#""traceparent":"00-a-b-01"}"#));
    }

    #[test]
    fn request_round_trip() {
        let s = encode_request("7", "sessions.patch", &serde_json::json!({"key":"k"}), None).expect("encodes");
        let Frame::Req(req) = decode_frame(&s, MAX).expect("decodes") else { panic!() };
        assert_eq!(req.id, "7");
        assert_eq!(req.method, "sessions.patch");
        assert_eq!(req.params.get(), r#"{"key":"k"}"#);
    }
}
