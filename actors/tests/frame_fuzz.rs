//! Frame fuzzer: arbitrary gateway frames through the decoder and the fail-closed router.
//!
//! Properties, over generated frames that mix well-formed frames of registered runs with foreign,
//! near-miss (upper-cased, prefixed, truncated), mistyped and missing keys, random JSON and random
//! text:
//! - decoding never panics, and a frame over the size limit is refused before it is parsed;
//! - a frame is delivered only to the run whose session key AND run id it carries, byte for byte;
//! - a frame that is not delivered is dropped with a reason, never routed elsewhere.
//!
//! The whole path through the real supervisor (socket, decode, route, session actor, SSE) is fuzzed
//! in `tests/chaos.rs` with a hostile replay gateway.

use clawmux_actors::routes::RouteTable;
use clawmux_protocol::{decode_frame, DecodeError, Frame, GatewayEvent};
use proptest::prelude::*;
use serde_json::{json, Value};

/// The runs registered in the router: (session key, run id).
const RUNS: [(&str, &str); 3] = [
    ("agent:main:clawmux:acct-a.r.run-1", "g-1"),
    ("agent:main:clawmux:acct-a.s.chat", "g-2"),
    ("agent:main:clawmux:acct-b.r.run-1", "g-3"),
];

fn key_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => (0..RUNS.len()).prop_map(|i| json!(RUNS[i].0)),
        1 => (0..RUNS.len()).prop_map(|i| json!(RUNS[i].0.to_uppercase())),
        1 => (0..RUNS.len()).prop_map(|i| json!(format!("{} ", RUNS[i].0))),
        1 => (0..RUNS.len()).prop_map(|i| json!(&RUNS[i].0[..RUNS[i].0.len() - 1])),
        1 => "[a-z:.]{0,20}".prop_map(Value::from),
        1 => Just(Value::Null),
        1 => any::<i64>().prop_map(Value::from),
        1 => Just(json!(["agent:main:clawmux:acct-a.r.run-1"])),
    ]
}

fn run_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => (0..RUNS.len()).prop_map(|i| json!(RUNS[i].1)),
        1 => (0..RUNS.len()).prop_map(|i| json!(RUNS[i].1.to_uppercase())),
        1 => "[a-z0-9-]{0,8}".prop_map(Value::from),
        1 => Just(Value::Null),
        1 => any::<u64>().prop_map(Value::from),
    ]
}

fn small_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-zA-Z]{1,8}", inner, 0..4).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A run-scoped event with generated addressing (fields sometimes missing).
fn run_event() -> impl Strategy<Value = Value> {
    (
        prop_oneof![Just("chat"), Just("agent")],
        prop::option::of(key_value()),
        prop::option::of(run_value()),
        prop_oneof![Just("delta"), Just("final"), Just("aborted"), Just("error"), Just("sideways")],
        ".{0,16}",
        any::<u64>(),
        small_json(),
    )
        .prop_map(|(event, key, run, state, text, seq, extra)| {
            let mut payload = serde_json::Map::new();
            if let Some(k) = key {
                payload.insert("sessionKey".into(), k);
            }
            if let Some(r) = run {
                payload.insert("runId".into(), r);
            }
            payload.insert("seq".into(), json!(seq));
            if event == "chat" {
                payload.insert("state".into(), json!(state));
                payload.insert("message".into(), json!({"role": "assistant", "content": [{"type": "text", "text": text}]}));
            } else {
                payload.insert("stream".into(), json!("assistant"));
                payload.insert("data".into(), json!({"text": text}));
            }
            payload.insert("extra".into(), extra);
            json!({"type": "event", "event": event, "payload": Value::Object(payload), "seq": seq})
        })
}

fn any_frame() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => run_event().prop_map(|v| v.to_string()),
        1 => (prop_oneof![Just("tick"), Just("shutdown"), Just("health"), Just("connect.challenge"), Just("x.y")], small_json())
            .prop_map(|(e, p)| json!({"type": "event", "event": e, "payload": p}).to_string()),
        1 => (".{0,10}", any::<bool>(), small_json())
            .prop_map(|(id, ok, p)| json!({"type": "res", "id": id, "ok": ok, "payload": p, "error": p}).to_string()),
        1 => small_json().prop_map(|v| v.to_string()),
        1 => ".{0,64}",
    ]
}

fn router() -> RouteTable<usize> {
    let mut t = RouteTable::new();
    for (i, (k, r)) in RUNS.iter().enumerate() {
        t.insert(k, r, i);
    }
    t
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    #[test]
    fn a_frame_reaches_only_the_run_it_addresses(text in any_frame()) {
        let table = router();
        let Ok(Frame::Event(ev)) = decode_frame(&text, 1 << 20) else { return Ok(()) };
        let Some((key, run)) = ev.event.route_key() else { return Ok(()) };
        if let Ok(&i) = table.route(key, run) {
            // Delivered: the frame's own fields, as sent, name exactly this run.
            let raw: Value = serde_json::from_str(&text).expect("decoded frames are JSON");
            prop_assert_eq!(raw["payload"]["sessionKey"].as_str(), Some(RUNS[i].0));
            prop_assert_eq!(raw["payload"]["runId"].as_str(), Some(RUNS[i].1));
            prop_assert!(matches!(ev.event, GatewayEvent::Chat(_) | GatewayEvent::Agent(_)));
        }
    }

    #[test]
    fn oversize_frames_are_refused_before_parsing(text in any_frame(), max in 0usize..64) {
        match decode_frame(&text, max) {
            Err(DecodeError::TooLarge { size, max: m }) => prop_assert!(size > m && m == max),
            _ => prop_assert!(text.len() <= max, "a {}-byte frame passed a {max}-byte limit", text.len()),
        }
    }
}

/// Regression: not JSON at all, or JSON of the wrong shape, is an error, never a panic.
#[test]
fn garbage_is_an_error() {
    for text in ["", "{", "null", "[]", "{\"type\":5}", "{\"type\":\"event\"}", "\u{0}", "{\"type\":\"res\",\"id\":\"x\"}"] {
        assert!(decode_frame(text, 1024).is_err(), "{text:?}");
    }
}
