//! The full, owned decoding of `chat` and `agent` frames as it was before the borrowed one (issue
//! 12), kept only to check that the borrowed decoder ([`crate::decode_frame`]) agrees with it: same
//! frames refused, same route key, state, text, error text and signal for the rest, on every
//! recorded frame of `tests/cassettes/*.jsonl` and on mutations of them.

use crate::error::{DecodeError, ErrorShape};
use crate::events::{AgentSignal, ChatState, GatewayEvent};
use crate::frame::{decode_frame, Frame};
use serde::Deserialize;
use serde_json::value::RawValue;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireFrame<'a> {
    #[serde(rename = "type")]
    kind: std::borrow::Cow<'a, str>,
    id: Option<String>,
    #[allow(dead_code)]
    method: Option<String>,
    ok: Option<bool>,
    #[serde(borrow)]
    #[allow(dead_code)]
    params: Option<&'a RawValue>,
    #[serde(borrow)]
    payload: Option<&'a RawValue>,
    error: Option<ErrorShape>,
    event: Option<String>,
    #[serde(default, deserialize_with = "crate::num::lenient_u64")]
    seq: Option<u64>,
    #[allow(dead_code)]
    traceparent: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ChatEvent {
    #[serde(default)]
    run_id: Option<String>,
    #[serde(default)]
    session_key: Option<String>,
    #[serde(default, deserialize_with = "crate::num::lenient_u64")]
    seq: Option<u64>,
    state: ChatState,
    #[serde(default)]
    message: Option<ChatMessage>,
    #[serde(default)]
    #[allow(dead_code)]
    delta_text: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    stop_reason: Option<String>,
    #[serde(default)]
    error_message: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
struct ChatMessage {
    #[serde(default)]
    #[allow(dead_code)]
    role: Option<String>,
    #[serde(default)]
    content: MessageContent,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum MessageContent {
    Blocks(Vec<ContentBlock>),
    Text(String),
}

impl Default for MessageContent {
    fn default() -> Self {
        MessageContent::Blocks(Vec::new())
    }
}

#[derive(Debug, Clone, Deserialize)]
struct ContentBlock {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

impl ChatMessage {
    fn text(&self) -> String {
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

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
struct AgentEvent {
    #[serde(default)]
    run_id: Option<String>,
    #[serde(default)]
    session_key: Option<String>,
    #[serde(default, deserialize_with = "crate::num::lenient_u64")]
    seq: Option<u64>,
    stream: String,
    #[serde(default)]
    data: Option<Box<RawValue>>,
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
    fn signal(&self) -> Option<AgentSignal> {
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

/// What a multiplexer takes from a frame: what the two decoders must agree on.
#[derive(Debug, PartialEq, Eq)]
pub enum Seen {
    /// Refused.
    Refused,
    /// A `res` (decoded by shared code; its id and ok flag).
    Res(String, bool),
    /// A `req` (decoded by shared code).
    Req,
    /// A `chat` event.
    Chat {
        frame_seq: Option<u64>,
        run_id: Option<String>,
        session_key: Option<String>,
        seq: Option<u64>,
        state: ChatState,
        text: Option<String>,
        error_message: Option<String>,
    },
    /// An `agent` event.
    Agent {
        frame_seq: Option<u64>,
        run_id: Option<String>,
        session_key: Option<String>,
        seq: Option<u64>,
        stream: String,
        signal: Option<AgentSignal>,
    },
    /// Any other event (decoded by shared code): its frame seq.
    OtherEvent(Option<u64>),
}

fn parse<'a, T: Deserialize<'a>>(payload: Option<&'a str>) -> Result<T, DecodeError> {
    let raw = payload.ok_or(DecodeError::UnknownType(String::new()))?;
    serde_json::from_str(raw).map_err(|e| DecodeError::UnknownType(e.to_string()))
}

/// The frame as the old decoder saw it.
pub fn old(text: &str, max_payload: usize) -> Seen {
    if text.len() > max_payload {
        return Seen::Refused;
    }
    let Ok(wire) = serde_json::from_str::<WireFrame<'_>>(text) else { return Seen::Refused };
    match (wire.kind.as_ref(), wire.event.as_deref()) {
        ("event", Some("chat")) => match parse::<ChatEvent>(wire.payload.map(RawValue::get)) {
            Ok(c) => Seen::Chat {
                frame_seq: wire.seq,
                text: c.message.as_ref().map(ChatMessage::text),
                run_id: c.run_id,
                session_key: c.session_key,
                seq: c.seq,
                state: c.state,
                error_message: c.error_message,
            },
            Err(_) => Seen::Refused,
        },
        ("event", Some("agent")) => match parse::<AgentEvent>(wire.payload.map(RawValue::get)) {
            Ok(a) => Seen::Agent {
                frame_seq: wire.seq,
                signal: a.signal(),
                run_id: a.run_id,
                session_key: a.session_key,
                seq: a.seq,
                stream: a.stream,
            },
            Err(_) => Seen::Refused,
        },
        ("res", _) => match (wire.id, wire.ok) {
            (Some(id), Some(ok)) if ok || wire.error.is_some() => Seen::Res(id, ok),
            _ => Seen::Refused,
        },
        // Shared code in both: compared through `new` only.
        _ => new(text, max_payload),
    }
}

/// The frame as [`decode_frame`] sees it.
pub fn new(text: &str, max_payload: usize) -> Seen {
    match decode_frame(text, max_payload) {
        Err(_) => Seen::Refused,
        Ok(Frame::Res(r)) => Seen::Res(r.id, r.ok),
        Ok(Frame::Req(_)) => Seen::Req,
        Ok(Frame::Event(ev)) => match ev.event {
            GatewayEvent::Chat(c) => Seen::Chat {
                frame_seq: ev.seq,
                run_id: c.run_id,
                session_key: c.session_key,
                seq: c.seq,
                state: c.state,
                text: c.text,
                error_message: c.error_message,
            },
            GatewayEvent::Agent(a) => Seen::Agent {
                frame_seq: ev.seq,
                run_id: a.run_id,
                session_key: a.session_key,
                seq: a.seq,
                stream: a.stream,
                signal: a.signal,
            },
            _ => Seen::OtherEvent(ev.seq),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{json, Value};

    const MAX: usize = 1 << 20;

    /// A frame's text with its top-level keys in the gateway's order (`type`, `event`, `payload`,
    /// `seq`, then the rest): the order the one-pass decoding takes (`Value` sorts keys, which
    /// puts `type` last and leaves the frame to the general decoding).
    fn gateway_order(v: &Value) -> String {
        let Value::Object(m) = v else { return v.to_string() };
        let first = ["type", "event", "payload", "seq"];
        let mut parts: Vec<String> = first.iter().filter_map(|k| m.get(*k).map(|x| format!("{}:{x}", Value::from(*k)))).collect();
        parts.extend(m.iter().filter(|(k, _)| !first.contains(&k.as_str())).map(|(k, x)| format!("{}:{x}", Value::from(k.as_str()))));
        format!("{{{}}}", parts.join(","))
    }

    /// Every recorded gateway frame of the bundled cassettes: events as sent (with a top-level
    /// `seq`), ACKs and final answers as `res` frames.
    fn recorded() -> Vec<String> {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/cassettes");
        let mut paths: Vec<_> = std::fs::read_dir(dir).expect("cassettes").filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        let mut frames = Vec::new();
        for path in paths.iter().filter(|p| p.extension().is_some_and(|e| e == "jsonl")) {
            let text = std::fs::read_to_string(path).expect("cassette");
            for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
                let v: Value = serde_json::from_str(line).expect("cassette line");
                let payload = v.get("payload").cloned().unwrap_or(Value::Null);
                let frame = match v["kind"].as_str() {
                    Some("event") => json!({"type": "event", "event": v["event"], "payload": payload, "seq": i}),
                    Some("ack" | "final") => json!({"type": "res", "id": format!("cm-{i}"), "ok": true, "payload": payload}),
                    _ => continue,
                };
                frames.push(gateway_order(&frame));
            }
        }
        assert!(frames.len() > 300, "the cassettes hold a few hundred frames, found {}", frames.len());
        frames
    }

    #[test]
    fn agrees_on_every_recorded_frame() {
        let frames = recorded();
        let mut kinds = (0, 0);
        for f in &frames {
            let seen = new(f, MAX);
            assert_eq!(old(f, MAX), seen, "{f}");
            // The same frame with its keys sorted (`type` last) takes the general decoding.
            let sorted = serde_json::from_str::<Value>(f).expect("JSON").to_string();
            assert_eq!(old(&sorted, MAX), seen, "{sorted}");
            match seen {
                Seen::Chat { text: Some(_), .. } => kinds.0 += 1,
                Seen::Agent { signal: Some(_), .. } => kinds.1 += 1,
                _ => {}
            }
        }
        // The comparison covered texts and signals, not only refusals.
        assert!(kinds.0 > 50 && kinds.1 > 20, "{kinds:?}");
    }

    /// Values a mutation puts in place of a field: right and wrong types, escapes, the shapes a
    /// message's content may take.
    fn any_value() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            Just(json!(1.5)),
            Just(json!(u64::MAX)),
            "[a-z\"\\\\é\n ]{0,6}".prop_map(Value::from),
            Just(json!([])),
            Just(json!({})),
            Just(json!([{"type": "text", "text": "x\"y"}, {"type": "image"}])),
            Just(json!([{"text": "no type"}])),
            Just(json!([{"type": "text", "text": 3}])),
            Just(json!([["text", "as a list"]])),
            Just(json!({"phase": "start", "name": "exec"})),
            Just(json!({"phase": 1})),
            Just(json!(["delta"])),
        ]
    }

    /// Every (object key or array index) path of a value.
    fn paths(v: &Value, at: &mut Vec<Value>, out: &mut Vec<Vec<Value>>) {
        out.push(at.clone());
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    at.push(Value::from(k.as_str()));
                    paths(x, at, out);
                    at.pop();
                }
            }
            Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    at.push(Value::from(i));
                    paths(x, at, out);
                    at.pop();
                }
            }
            _ => {}
        }
    }

    fn at_mut<'v>(v: &'v mut Value, path: &[Value]) -> Option<&'v mut Value> {
        path.iter().try_fold(v, |v, step| match step {
            Value::String(k) => v.get_mut(k.as_str()),
            Value::Number(n) => v.get_mut(usize::try_from(n.as_u64()?).ok()?),
            _ => None,
        })
    }

    /// A recorded frame with one field replaced, removed or added somewhere.
    fn mutated(frames: Vec<String>) -> impl Strategy<Value = String> {
        (0..frames.len(), any::<prop::sample::Index>(), 0..4u8, any_value(), prop_oneof![
            prop::sample::select(vec!["type", "id", "method", "ok", "params", "payload", "error", "event", "seq", "traceparent", "runId", "state", "message", "content", "text", "stream", "data"]).prop_map(str::to_owned),
            "[a-zA-Z]{1,12}",
        ]).prop_map(move |(i, at, how, value, key)| {
            let mut v: Value = serde_json::from_str(&frames[i]).expect("recorded frames are JSON");
            let mut all = Vec::new();
            paths(&v, &mut Vec::new(), &mut all);
            let path = all[at.index(all.len())].clone();
            match how {
                0 => {
                    if let Some(x) = at_mut(&mut v, &path) {
                        *x = value;
                    }
                }
                1 => {
                    if let (Some((Value::String(k), parent)), true) = (path.split_last(), true) {
                        if let Some(Value::Object(m)) = at_mut(&mut v, parent) {
                            m.remove(k.as_str());
                        }
                    }
                }
                2 => {
                    if let Some(Value::Object(m)) = at_mut(&mut v, &path) {
                        m.insert(key, value);
                    }
                }
                _ => {
                    // An object turned into the array of its values (structs decode from both).
                    if let Some(x) = at_mut(&mut v, &path) {
                        if let Value::Object(m) = x {
                            *x = Value::Array(m.values().cloned().collect());
                        }
                    }
                }
            }
            if at.index(2) == 0 {
                v.to_string()
            } else {
                gateway_order(&v)
            }
        })
    }

    /// Byte-level damage: a recorded frame cut short, or with one byte replaced.
    fn damaged(frames: Vec<String>) -> impl Strategy<Value = String> {
        (0..frames.len(), any::<prop::sample::Index>(), prop::sample::select(&b"\"{}[],:0n\\ x"[..]), any::<bool>()).prop_map(
            move |(i, at, byte, cut)| {
                let mut b = frames[i].clone().into_bytes();
                let k = at.index(b.len());
                if cut {
                    b.truncate(k);
                } else {
                    b[k] = byte;
                }
                String::from_utf8_lossy(&b).into_owned()
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        #[test]
        fn agrees_on_mutated_frames(frame in mutated(recorded())) {
            prop_assert_eq!(old(&frame, MAX), new(&frame, MAX), "{}", frame);
        }

        #[test]
        fn agrees_on_damaged_frames(frame in damaged(recorded())) {
            prop_assert_eq!(old(&frame, MAX), new(&frame, MAX), "{}", frame);
        }
    }

    /// Every field of every frame of two recorded runs (one with a tool call), replaced by each
    /// of a set of right and wrong values, and removed; every frame field added at the top with
    /// each value: exhaustive where the random mutations only sample.
    #[test]
    fn agrees_with_every_field_replaced_or_removed() {
        let values = [
            Value::Null,
            json!(true),
            json!(-1),
            json!(7),
            json!(1.5),
            json!(u64::MAX),
            json!(""),
            json!("delta"),
            json!("x\"y\u{e9}"),
            json!([]),
            json!({}),
            json!([{"type": "text", "text": "x\"y"}, {"type": "image"}]),
            json!([{"text": "no type"}]),
            json!([["text", "as a list"]]),
            json!({"phase": "start", "name": "exec"}),
        ];
        // One frame of each shape (kind, event, state or stream, phase): the others differ only
        // in their text and ids.
        let mut shapes = std::collections::HashSet::new();
        let frames: Vec<String> = recorded()
            .into_iter()
            .filter(|f| {
                let v: Value = serde_json::from_str(f).expect("JSON");
                let p = &v["payload"];
                shapes.insert([&v["type"], &v["event"], &p["state"], &p["stream"], &p["data"]["phase"]].map(Value::to_string))
            })
            .collect();
        assert!(frames.len() > 10, "{}", frames.len());
        let mut compared = 0;
        for f in &frames {
            let v: Value = serde_json::from_str(f).expect("JSON");
            let mut all = Vec::new();
            paths(&v, &mut Vec::new(), &mut all);
            for path in all.iter().filter(|p| !p.is_empty()) {
                let mut candidates: Vec<Value> = values
                    .iter()
                    .map(|x| {
                        let mut m = v.clone();
                        if let Some(slot) = at_mut(&mut m, path) {
                            *slot = x.clone();
                        }
                        m
                    })
                    .collect();
                if path.len() == 1 {
                    // And every frame field added (or replaced) at the top, with every value.
                    for field in ["type", "id", "method", "ok", "params", "payload", "error", "event", "seq", "traceparent"] {
                        for x in &values {
                            let mut m = v.clone();
                            if let Value::Object(o) = &mut m {
                                o.insert(field.to_owned(), x.clone());
                            }
                            candidates.push(m);
                        }
                    }
                }
                if let Some((Value::String(k), parent)) = path.split_last() {
                    let mut m = v.clone();
                    if let Some(Value::Object(o)) = at_mut(&mut m, parent) {
                        o.remove(k.as_str());
                    }
                    candidates.push(m);
                }
                // In the gateway's key order, so the one-pass decoding is the one compared (the
                // random mutations above also try the sorted order, the general decoding's).
                for m in candidates {
                    let text = gateway_order(&m);
                    assert_eq!(old(&text, MAX), new(&text, MAX), "{text}");
                    compared += 1;
                }
            }
        }
        assert!(compared > 20_000, "{compared}");
    }

    #[test]
    fn agrees_on_edge_cases() {
        for f in [
            r#"{"type":"event","event":"chat","payload":{"runId":"r","sessionKey":"s","state":"delta","message":{"content":null}}}"#,
            r#"{"type":"event","event":"chat","payload":{"runId":"r","sessionKey":"s","state":"delta","message":{}}}"#,
            r#"{"type":"event","event":"chat","payload":{"runId":"r","sessionKey":"s","state":"delta","message":null}}"#,
            r#"{"type":"event","event":"chat","payload":["r","s",1,"delta",["assistant","plain"]]}"#,
            r#"{"type":"event","event":"chat","payload":{"runId":"r\u0041","sessionKey":"s\n","state":"delta","message":{"content":"t\"x"}}}"#,
            r#"{"type":"event","event":"chat","payload":{"runId":"r","runId":"q","state":"delta"}}"#,
            r#"{"type":"event","event":"agent","payload":{"runId":"r","stream":"usage","data":null}}"#,
            r#"{"type":"event","event":"agent","payload":{"runId":"r","stream":"lifecycle","data":"start"}}"#,
            r#"{"type":"event","event":"agent","payload":{"runId":"r","stream":"assistant","data":{"phase":"start"}}}"#,
            r#"{"type":"event","event":"agent","payload":{"runId":"r","stream":"tool","data":{"phase":"start"}}}"#,
            r#"{"type":"even\u0074","event":"ch\u0061t","payload":{"runId":"r","sessionKey":"s","state":"final"}}"#,
            r#"{"type":"event","event":"chat","payload":{"runId":"r","sessionKey":"s","state":"final"},"payload":{"runId":"r","sessionKey":"s","state":"final"}}"#,
            r#"{"type":"event","event":"chat","type":"event","payload":{"runId":"r","sessionKey":"s","state":"final"}}"#,
            r#"{"type":"event","event":"chat","payload":{"runId":"r","sessionKey":"s","state":"final"},"seq":1,"seq":2}"#,
            r#"{"type":"event","event":"chat","payload":{"runId":"r","sessionKey":"s","state":"final"},"id":7}"#,
            r#"{"type":"event","event":"chat","payload":{"runId":"r","sessionKey":"s","state":"final"},"error":{}}"#,
            r#"{"type":"event","event":"chat","payload":{"runId":"r","sessionKey":"s","state":"final"},"ok":"yes"}"#,
            r#"{"type":"event","event":"chat","payload":{"runId":"r","sessionKey":"s","state":"final"},"params":[1,2]}"#,
            r#"{"type":"event","event":"chat","payload":{"runId":"r","sessionKey":"s","state":"final"},"traceparent":null,"x":[{}]}"#,
            r#"{"type":"event","event":"agent","payload":{"runId":"r","stream":"lifecycle","data":{"phase":"end"}},"seq":-3}"#,
            r#"{"type":"res","event":"chat","payload":{"runId":"r","sessionKey":"s","state":"sideways"},"id":"1","ok":true}"#,
            r#"{"type":"event","event":"chat","payload":{"runId":"r","sessionKey":"s","state":"final"}} x"#,
            r#" {"type":"event","event":"chat","payload":{"runId":"r","sessionKey":"s","state":"final"}} "#,
        ] {
            assert_eq!(old(f, MAX), new(f, MAX), "{f}");
        }
    }
}
