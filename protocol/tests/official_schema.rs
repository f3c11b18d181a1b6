//! Every frame this crate encodes, as clawmux sends it, checked against OpenClaw's own
//! `protocol.schema.json` (`@openclaw/gateway-protocol`, validated by the package's validator
//! engine; see `schema_check`). Needs the package and Node 24 (`tests/run.sh` installs and exports
//! them and sets `CLAWMUX_REQUIRE_GATEWAY_PROTOCOL=1`, so that these fail rather than skip there).

mod schema_check;

use clawmux_protocol::frame::{encode_event, encode_request, encode_response};
use clawmux_protocol::handshake::{ConnectParams, CAP_TOOL_EVENTS};
use clawmux_protocol::methods::{name, AgentParams, AgentWaitParams, ChatAbortParams, SessionKeyParams, SessionsPatchParams};
use clawmux_protocol::ErrorShape;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;

fn checker() -> Option<schema_check::Checker> {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    schema_check::Checker::from_env(repo)
}

fn frame<P: serde::Serialize>(method: &str, params: &P, traceparent: Option<&str>) -> Value {
    let text = encode_request("cm-1", method, params, traceparent).expect("encodes");
    serde_json::from_str(&text).expect("JSON")
}

/// The errors of each frame, with the frame for the failure message.
fn errors(outcomes: &[Value]) -> Vec<String> {
    outcomes.iter().flat_map(|o| o["errors"].as_array().cloned().unwrap_or_default()).map(|e| e.to_string()).collect()
}

#[test]
fn every_request_clawmux_sends_is_valid() {
    let Some(c) = checker() else { return };
    let mut connect = ConnectParams::multiplexer("0.1.0", Some("token".into()));
    connect.caps.push(CAP_TOOL_EVENTS.to_owned());
    // What the device identity adds (actors/src/device.rs signs it).
    let mut with_device = connect.clone();
    with_device.device = Some(json!({"id": "ab".repeat(32), "publicKey": "pk", "signature": "sig", "signedAt": 1_795_000_000_000u64, "nonce": "n"}));
    let key = "agent:main:acct1:run1".to_owned();
    let frames = vec![
        frame(name::CONNECT, &connect, None),
        frame(name::CONNECT, &with_device, None),
        frame(name::SESSIONS_PATCH, &SessionsPatchParams { key: key.clone(), model: Some("cogni/fake-model".into()), outbound_headers: None }, None),
        frame(name::SESSIONS_PATCH, &SessionsPatchParams { key: key.clone(), model: None, outbound_headers: None }, None),
        frame(name::SESSIONS_SUBSCRIBE, &SessionKeyParams { key: key.clone() }, None),
        frame(name::SESSIONS_UNSUBSCRIBE, &SessionKeyParams { key: key.clone() }, None),
        frame(name::SESSIONS_ABORT, &SessionKeyParams { key: key.clone() }, None),
        frame(
            name::AGENT,
            &AgentParams {
                message: "hello".into(),
                agent_id: "main".into(),
                session_key: key.clone(),
                idempotency_key: "0f4c0c8e-2f0a-4d1e-9d43-6f5f4d3c2b1a".into(),
                timeout: Some(600),
                extra_system_prompt: Some("[clawmux-attribution:t]".into()),
                label: Some("run".into()),
            },
            Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        ),
        frame(name::AGENT_WAIT, &AgentWaitParams { run_id: "r".into(), timeout_ms: Some(i32::MAX as u64) }, None),
        frame(name::CHAT_ABORT, &ChatAbortParams { session_key: key.clone(), run_id: Some("r".into()) }, None),
        frame(name::CHAT_ABORT, &ChatAbortParams { session_key: key, run_id: None }, None),
        frame(name::HEALTH, &json!({}), None),
    ];
    let outcomes = c.check_client(&frames);
    assert!(errors(&outcomes).is_empty(), "invalid frames: {:#?}", errors(&outcomes));
    // Each was checked against the frame schema and, but for `health` (no params schema), its
    // method's params schema.
    for (f, o) in frames.iter().zip(&outcomes) {
        let checked: Vec<&str> = o["checked"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        assert!(checked.contains(&"RequestFrame"), "{f}: {o}");
        if f["method"] != name::HEALTH {
            assert_eq!(checked.len(), 2, "{f}: {o}");
        }
    }
}

/// The Cogni fork's `outboundHeaders` is not in the official schema: a gateway that does not say
/// it accepts them must never get them (clawmux's `auto` mode waits for the gateway to say so).
#[test]
fn outbound_headers_are_outside_the_official_schema() {
    let Some(c) = checker() else { return };
    let headers = BTreeMap::from([("x-cogni-run-id".to_owned(), "r".to_owned())]);
    let patch = SessionsPatchParams { key: "agent:main:a".into(), model: None, outbound_headers: Some(headers) };
    let outcomes = c.check_client(&[frame(name::SESSIONS_PATCH, &patch, None)]);
    let errs = errors(&outcomes);
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(errs[0].contains("\"additionalProperties\":[\"outboundHeaders\"]"), "{errs:?}");
}

/// Offering protocol 3 is outside what the official client docs allow a general client (exactly
/// 4), but still schema-valid: the fallback connect after a `PROTOCOL_MISMATCH` is a valid frame.
#[test]
fn the_protocol_3_fallback_connect_is_valid() {
    let Some(c) = checker() else { return };
    let mut v3 = ConnectParams::multiplexer("0.1.0", Some("token".into()));
    v3.min_protocol = 3;
    v3.max_protocol = 3;
    let outcomes = c.check_client(&[frame(name::CONNECT, &v3, None)]);
    assert!(errors(&outcomes).is_empty(), "{:#?}", errors(&outcomes));
}

/// The server-side encoders (the replay gateway's): a `res` with a result and with an error, and
/// events, as the schema wants them; a bad frame from a broken encoder would be caught.
#[test]
fn server_encoders_write_valid_frames() {
    let Some(c) = checker() else { return };
    let parse = |t: String| serde_json::from_str::<Value>(&t).expect("JSON");
    let mut error = ErrorShape::new("UNAVAILABLE", "gateway starting; retry shortly");
    error.retryable = Some(true);
    error.retry_after_ms = Some(500);
    error.details = Some(json!({"reason": "startup-sidecars"}));
    let frames = vec![
        (parse(encode_response("cm-1", Ok(&json!({"ok": true}))).expect("encodes")), None),
        (parse(encode_response("cm-2", Err(&error)).expect("encodes")), None),
        (parse(encode_event("tick", &json!({"ts": 1}), Some(3)).expect("encodes")), None),
        (parse(encode_event("shutdown", &json!({"reason": "gateway stopping"}), Some(4)).expect("encodes")), None),
        (
            parse(
                encode_event(
                    "chat",
                    &json!({"runId": "r", "sessionKey": "agent:main:a", "seq": 1, "state": "delta", "deltaText": "Hi",
                            "message": {"role": "assistant", "content": [{"type": "text", "text": "Hi"}]}}),
                    Some(5),
                )
                .expect("encodes"),
            ),
            None,
        ),
    ];
    let outcomes = c.check_server(&frames);
    assert!(errors(&outcomes).is_empty(), "{:#?}", errors(&outcomes));
    // And the check is real: a shutdown with `restartExpectedMs: null` is refused.
    let bad = parse(encode_event("shutdown", &json!({"reason": "x", "restartExpectedMs": null}), None).expect("encodes"));
    assert_eq!(errors(&c.check_server(&[(bad, None)])).len(), 1);
}
