//! Closed-schema checks worded like the real gateway's (AJV) errors.
//!
//! The protocol crate's param types are `deny_unknown_fields`, so serde already refuses what the
//! gateway refuses; but serde's wording (`unknown field ...`) is not the gateway's (`at root:
//! unexpected property '...'`), and clients pass the gateway's message on to their callers. So
//! the shape is checked here first, in AJV's order (required, then additional properties, then
//! each property), and only then decoded with the protocol type. The field lists mirror the
//! protocol structs; a unit test decodes a maximal object per list so that drift is caught.

use clawmux_protocol::handshake::{KNOWN_CLIENT_IDS, KNOWN_CLIENT_MODES};
use serde_json::Value;

/// A property's type, as far as the replay gateway checks it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Ty {
    /// Any string.
    Str,
    /// A string of at least one character.
    NonEmptyStr,
    /// A string or `null` (`null` clears a session setting).
    NullableStr,
    /// A non-negative integer.
    UInt,
    /// An array of strings.
    StrArray,
    /// An object of string values, or `null`.
    NullableStrMap,
    /// Any object.
    AnyObject,
    /// One of a fixed list of strings (`client.id`, `client.mode`).
    Enum(&'static [&'static str]),
    /// A nested closed object.
    Object(&'static [Field]),
}

/// One property of a closed object.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Field {
    /// Property name.
    pub name: &'static str,
    /// Its type.
    pub ty: Ty,
    /// Whether it must be present.
    pub required: bool,
}

const fn req(name: &'static str, ty: Ty) -> Field {
    Field { name, ty, required: true }
}
const fn opt(name: &'static str, ty: Ty) -> Field {
    Field { name, ty, required: false }
}

/// `connect.client`.
pub(crate) const CLIENT: &[Field] = &[
    req("id", Ty::Enum(&KNOWN_CLIENT_IDS)),
    req("version", Ty::NonEmptyStr),
    req("platform", Ty::NonEmptyStr),
    req("mode", Ty::Enum(&KNOWN_CLIENT_MODES)),
    opt("displayName", Ty::Str),
    opt("deviceFamily", Ty::Str),
];
/// `connect.auth`.
pub(crate) const AUTH: &[Field] = &[opt("token", Ty::Str)];
/// `connect` params (`ConnectParams`).
pub(crate) const CONNECT: &[Field] = &[
    req("minProtocol", Ty::UInt),
    req("maxProtocol", Ty::UInt),
    req("client", Ty::Object(CLIENT)),
    opt("role", Ty::Str),
    opt("scopes", Ty::StrArray),
    opt("caps", Ty::StrArray),
    opt("auth", Ty::Object(AUTH)),
    opt("device", Ty::AnyObject),
    opt("locale", Ty::Str),
    opt("userAgent", Ty::Str),
];
/// `sessions.patch` on stock OpenClaw (`SessionsPatchParams` without `outboundHeaders`).
pub(crate) const SESSIONS_PATCH: &[Field] = &[req("key", Ty::NonEmptyStr), opt("model", Ty::NullableStr)];
/// `sessions.patch` on the Cogni fork.
pub(crate) const SESSIONS_PATCH_FORK: &[Field] =
    &[req("key", Ty::NonEmptyStr), opt("model", Ty::NullableStr), opt("outboundHeaders", Ty::NullableStrMap)];
/// `SessionKeyParams`: subscribe, unsubscribe, `sessions.abort`.
pub(crate) const SESSION_KEY: &[Field] = &[req("key", Ty::NonEmptyStr)];
/// `AgentParams`.
pub(crate) const AGENT: &[Field] = &[
    req("message", Ty::NonEmptyStr),
    req("agentId", Ty::NonEmptyStr),
    req("sessionKey", Ty::NonEmptyStr),
    req("idempotencyKey", Ty::NonEmptyStr),
    opt("timeout", Ty::UInt),
    opt("extraSystemPrompt", Ty::Str),
    opt("label", Ty::Str),
];
/// `AgentWaitParams`.
pub(crate) const AGENT_WAIT: &[Field] = &[req("runId", Ty::NonEmptyStr), opt("timeoutMs", Ty::UInt)];
/// `ChatAbortParams`.
pub(crate) const CHAT_ABORT: &[Field] = &[req("sessionKey", Ty::NonEmptyStr), opt("runId", Ty::Str)];
/// `chat.history` (no protocol type; the gateway's schema).
pub(crate) const CHAT_HISTORY: &[Field] = &[req("sessionKey", Ty::NonEmptyStr), opt("limit", Ty::UInt), opt("maxChars", Ty::UInt)];

/// How enum failures are worded: protocol 4 (`must be equal to one of the allowed values`) or
/// protocol 3 (`must be equal to constant; ... must match a schema in anyOf`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wording {
    /// 2026.9.x.
    V4,
    /// 2026.4.x.
    V3,
}

fn at(path: &str) -> String {
    if path.is_empty() {
        "at root".to_owned()
    } else {
        format!("at {path}")
    }
}

/// Checks `v` against a closed object schema; the error is the text after `invalid X params: `.
pub(crate) fn check(v: &Value, fields: &[Field], wording: Wording) -> Result<(), String> {
    check_at(v, fields, "", wording)
}

fn check_at(v: &Value, fields: &[Field], path: &str, wording: Wording) -> Result<(), String> {
    let Some(obj) = v.as_object() else { return Err(format!("{}: must be object", at(path))) };
    for f in fields.iter().filter(|f| f.required) {
        if !obj.contains_key(f.name) {
            return Err(format!("{}: must have required property '{}'", at(path), f.name));
        }
    }
    for k in obj.keys() {
        if !fields.iter().any(|f| f.name == k) {
            return Err(format!("{}: unexpected property '{k}'", at(path)));
        }
    }
    for f in fields {
        let Some(value) = obj.get(f.name) else { continue };
        let here = format!("{path}/{}", f.name);
        let fail = |what: &str| Err(format!("at {here}: {what}"));
        match f.ty {
            Ty::Str if !value.is_string() => return fail("must be string"),
            Ty::NonEmptyStr => match value.as_str() {
                None => return fail("must be string"),
                Some("") => return fail("must NOT have fewer than 1 characters"),
                Some(_) => {}
            },
            Ty::NullableStr if !(value.is_string() || value.is_null()) => return fail("must be string,null"),
            Ty::UInt if value.as_u64().is_none() => {
                return if value.as_i64().is_some() { fail("must be >= 0") } else { fail("must be integer") };
            }
            Ty::StrArray => match value.as_array() {
                None => return fail("must be array"),
                Some(items) => {
                    if let Some(i) = items.iter().position(|i| !i.is_string()) {
                        return Err(format!("at {here}/{i}: must be string"));
                    }
                }
            },
            Ty::NullableStrMap => match value {
                Value::Null => {}
                Value::Object(m) => {
                    if let Some((k, _)) = m.iter().find(|(_, v)| !v.is_string()) {
                        return Err(format!("at {here}/{k}: must be string"));
                    }
                }
                _ => return fail("must be object,null"),
            },
            Ty::AnyObject if !value.is_object() => return fail("must be object"),
            Ty::Enum(allowed) if !value.as_str().is_some_and(|s| allowed.contains(&s)) => {
                return match wording {
                    Wording::V4 => fail("must be equal to one of the allowed values"),
                    Wording::V3 => Err(format!("at {here}: must be equal to constant; at {here}: must match a schema in anyOf")),
                };
            }
            Ty::Object(inner) => check_at(value, inner, &here, wording)?,
            _ => {}
        }
    }
    Ok(())
}

/// Checks the top level of a request frame: `{type, id, method, params}` plus `traceparent` on
/// protocol 4 (protocol 3 rejects it: `invalid request frame: at root: unexpected property 'traceparent'`).
pub(crate) fn check_request_frame(frame: &Value, protocol: u32) -> Result<(), String> {
    let Some(obj) = frame.as_object() else { return Err("at root: must be object".to_owned()) };
    for k in obj.keys() {
        let known = matches!(k.as_str(), "type" | "id" | "method" | "params") || (k == "traceparent" && protocol >= 4);
        if !known {
            return Err(format!("at root: unexpected property '{k}'"));
        }
    }
    for required in ["id", "method", "params"] {
        if !obj.contains_key(required) {
            return Err(format!("at root: must have required property '{required}'"));
        }
    }
    if !obj.get("id").is_some_and(Value::is_string) {
        return Err("at /id: must be string".to_owned());
    }
    if !obj.get("method").is_some_and(Value::is_string) {
        return Err("at /method: must be string".to_owned());
    }
    if obj.get("traceparent").is_some_and(|t| !t.is_string()) {
        return Err("at /traceparent: must be string".to_owned());
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use clawmux_protocol::handshake::ConnectParams;
    use clawmux_protocol::methods::{AgentParams, AgentWaitParams, ChatAbortParams, SessionKeyParams, SessionsPatchParams};
    use serde_json::json;

    fn v4(v: Value, f: &[Field]) -> Result<(), String> {
        check(&v, f, Wording::V4)
    }

    #[test]
    fn words_errors_like_the_gateway() {
        let agent = json!({"message":"m","agentId":"main","sessionKey":"k","idempotencyKey":"i","outboundHeaders":{}});
        assert_eq!(v4(agent, AGENT).unwrap_err(), "at root: unexpected property 'outboundHeaders'");
        let patch = json!({"key":"k","model":"m","outboundHeaders":{"x":"y"}});
        assert_eq!(v4(patch.clone(), SESSIONS_PATCH).unwrap_err(), "at root: unexpected property 'outboundHeaders'");
        assert!(v4(patch, SESSIONS_PATCH_FORK).is_ok());
        let bad_id =
            json!({"minProtocol":4,"maxProtocol":4,"client":{"id":"cogni-rust","version":"1","platform":"linux","mode":"backend"}});
        assert_eq!(v4(bad_id.clone(), CONNECT).unwrap_err(), "at /client/id: must be equal to one of the allowed values");
        assert_eq!(
            check(&bad_id, CONNECT, Wording::V3).unwrap_err(),
            "at /client/id: must be equal to constant; at /client/id: must match a schema in anyOf"
        );
        assert_eq!(v4(json!({"key":""}), SESSION_KEY).unwrap_err(), "at /key: must NOT have fewer than 1 characters");
        assert_eq!(v4(json!({}), SESSION_KEY).unwrap_err(), "at root: must have required property 'key'");
        assert_eq!(v4(json!({"runId":"r","timeoutMs":-1}), AGENT_WAIT).unwrap_err(), "at /timeoutMs: must be >= 0");
        assert_eq!(v4(json!([]), AGENT_WAIT).unwrap_err(), "at root: must be object");
    }

    #[test]
    fn frames_are_closed_and_traceparent_is_v4_only() {
        let f = json!({"type":"req","id":"1","method":"health","params":{},"traceparent":"00-a-b-01"});
        assert!(check_request_frame(&f, 4).is_ok());
        assert_eq!(check_request_frame(&f, 3).unwrap_err(), "at root: unexpected property 'traceparent'");
        assert_eq!(
            check_request_frame(&json!({"type":"req","id":"1","method":"m"}), 4).unwrap_err(),
            "at root: must have required property 'params'"
        );
    }

    /// The field lists and the protocol types must accept the same maximal objects.
    #[test]
    fn lists_match_the_protocol_types() {
        let connect = json!({"minProtocol":3,"maxProtocol":4,"client":{"id":"gateway-client","version":"1","platform":"linux","mode":"backend","displayName":"d","deviceFamily":"f"},
            "role":"operator","scopes":["operator.read"],"caps":["session-scoped-events"],"auth":{"token":"t"},"device":{"id":"x"},"locale":"en","userAgent":"ua"});
        v4(connect.clone(), CONNECT).unwrap();
        serde_json::from_value::<ConnectParams>(connect).unwrap();
        let patch = json!({"key":"k","model":"cogni/fake-model","outboundHeaders":{"a":"b"}});
        v4(patch.clone(), SESSIONS_PATCH_FORK).unwrap();
        serde_json::from_value::<SessionsPatchParams>(patch).unwrap();
        serde_json::from_value::<SessionKeyParams>(json!({"key":"k"})).unwrap();
        let agent =
            json!({"message":"m","agentId":"main","sessionKey":"k","idempotencyKey":"i","timeout":3,"extraSystemPrompt":"x","label":"l"});
        v4(agent.clone(), AGENT).unwrap();
        serde_json::from_value::<AgentParams>(agent).unwrap();
        let wait = json!({"runId":"r","timeoutMs":5});
        v4(wait.clone(), AGENT_WAIT).unwrap();
        serde_json::from_value::<AgentWaitParams>(wait).unwrap();
        let abort = json!({"sessionKey":"k","runId":"r"});
        v4(abort.clone(), CHAT_ABORT).unwrap();
        serde_json::from_value::<ChatAbortParams>(abort).unwrap();
    }
}
