//! Closed-schema checks worded like the real gateway's validation errors.
//!
//! The gateway validates params against its protocol schemas (`protocol.schema.json` of
//! `@openclaw/gateway-protocol`) and words the failures with its `formatValidationErrors`:
//! `at root: unexpected property 'x'`, `must have required property 'x'` (no location at the
//! root), `at /path: must be string`, several joined by `; `. Clients pass that text on to their
//! callers, so the replay gateway words it the same. The two releases differ in their validator:
//! - protocol 4 (2026.9.x, TypeBox): per object the FIRST missing required property, the FIRST
//!   unexpected one, then each property in schema order; `must not have fewer than N characters`;
//!   an enum is `must be equal to one of the allowed values`;
//! - protocol 3 (2026.4.x, AJV with allErrors): EVERY missing and every unexpected property;
//!   `must NOT have fewer than N characters`; an enum is `must be equal to constant; ... must
//!   match a schema in anyOf`.
//!
//! The field lists mirror the official schemas property for property (protocol 4; checked against
//! `protocol.schema.json` by `lists_match_the_official_schema` when the package is installed), so
//! that the replay gateway accepts what the real one accepts: a field the replay does not act on is
//! still allowed, typed as far as a test observes it. Protocol 3 keeps the narrower lists observed
//! on 2026.4.12.

use clawmux_protocol::handshake::{KNOWN_CLIENT_IDS, KNOWN_CLIENT_MODES};
use serde_json::Value;

/// A property's type, as far as the replay gateway checks it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Ty {
    /// Any string.
    Str,
    /// A string of `min..=max` characters (`max` 0: unbounded).
    StrLen(usize, usize),
    /// `anyOf: [type, null]`.
    Nullable(&'static Ty),
    /// An integer `>= min` (`<= max` when `max` is not 0).
    Int(i64, i64),
    /// A boolean.
    Bool,
    /// `const: true`.
    True,
    /// `const: "<value>"` (a string).
    Const(&'static str),
    /// An array of strings of at least `min` characters each.
    StrArray(usize),
    /// An object of string values (the Cogni fork's `outboundHeaders`).
    StrMap,
    /// Any object.
    AnyObject,
    /// Any array.
    AnyArray,
    /// Anything (a field the replay does not act on, left to the real gateway's finer schema).
    Any,
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

/// `string`, `minLength: 1`.
const NON_EMPTY: Ty = Ty::StrLen(1, 0);
/// `integer`, `minimum: 0`.
const UINT: Ty = Ty::Int(0, 0);

/// `connect.client` (protocol 4).
pub(crate) const CLIENT: &[Field] = &[
    req("id", Ty::Enum(&KNOWN_CLIENT_IDS)),
    opt("displayName", NON_EMPTY),
    req("version", NON_EMPTY),
    opt("buildId", Ty::StrLen(1, 96)),
    req("platform", NON_EMPTY),
    opt("deviceFamily", NON_EMPTY),
    opt("modelIdentifier", NON_EMPTY),
    opt("timeZone", Ty::StrLen(1, 64)),
    req("mode", Ty::Enum(&KNOWN_CLIENT_MODES)),
    opt("instanceId", NON_EMPTY),
];
/// `connect.device`: a signed device identity.
pub(crate) const DEVICE: &[Field] = &[
    req("id", NON_EMPTY),
    req("publicKey", NON_EMPTY),
    req("signature", NON_EMPTY),
    req("signedAt", UINT),
    req("nonce", NON_EMPTY),
];
/// `connect.auth` (protocol 4).
pub(crate) const AUTH: &[Field] = &[
    opt("token", Ty::Str),
    opt("bootstrapToken", Ty::Str),
    opt("deviceToken", Ty::Str),
    opt("password", Ty::Str),
    opt("approvalRuntimeToken", Ty::Str),
    opt("agentRuntimeIdentityToken", Ty::Str),
];
/// `connect` params (`ConnectParams`, protocol 4).
pub(crate) const CONNECT: &[Field] = &[
    req("minProtocol", Ty::Int(1, 0)),
    req("maxProtocol", Ty::Int(1, 0)),
    req("client", Ty::Object(CLIENT)),
    opt("caps", Ty::StrArray(1)),
    opt("commands", Ty::StrArray(1)),
    opt("computerUse", Ty::Any),
    opt("workerRuns", Ty::AnyObject),
    opt("permissions", Ty::AnyObject),
    opt("pathEnv", Ty::Str),
    opt("role", NON_EMPTY),
    opt("scopes", Ty::StrArray(1)),
    opt("device", Ty::Object(DEVICE)),
    opt("auth", Ty::Object(AUTH)),
    opt("locale", Ty::Str),
    opt("userAgent", Ty::Str),
];
/// `connect.client` of 2026.4.12 (no `buildId` yet).
const CLIENT_V3: &[Field] = &[
    req("id", Ty::Enum(&KNOWN_CLIENT_IDS)),
    req("version", NON_EMPTY),
    req("platform", NON_EMPTY),
    req("mode", Ty::Enum(&KNOWN_CLIENT_MODES)),
    opt("displayName", Ty::Str),
    opt("deviceFamily", Ty::Str),
    opt("instanceId", NON_EMPTY),
];
/// `connect` params of 2026.4.12.
const CONNECT_V3: &[Field] = &[
    req("minProtocol", UINT),
    req("maxProtocol", UINT),
    req("client", Ty::Object(CLIENT_V3)),
    opt("role", Ty::Str),
    opt("scopes", Ty::StrArray(0)),
    opt("caps", Ty::StrArray(0)),
    opt("auth", Ty::Object(&[opt("token", Ty::Str)])),
    opt("device", Ty::AnyObject),
    opt("pathEnv", Ty::Str),
    opt("locale", Ty::Str),
    opt("userAgent", Ty::Str),
];

/// A `sessions.patch` enum of strings or `null`, not acted on.
const NULLABLE_ANY: Ty = Ty::Any;
/// `SessionsPatchParams` (protocol 4); the Cogni fork adds `outboundHeaders`.
pub(crate) const SESSIONS_PATCH: &[Field] = &[
    req("key", NON_EMPTY),
    opt("agentId", NON_EMPTY),
    opt("expectedSessionId", NON_EMPTY),
    opt("expectedLifecycleRevision", NON_EMPTY),
    opt("expectedPermissionMode", NULLABLE_ANY),
    opt("expectedToolOverrides", NULLABLE_ANY),
    opt("expectedMarkedUnreadAt", NULLABLE_ANY),
    opt("label", Ty::Nullable(&Ty::StrLen(1, 512))),
    opt("icon", Ty::Nullable(&Ty::Str)),
    opt("color", Ty::Nullable(&Ty::Str)),
    opt("category", Ty::Nullable(&Ty::StrLen(1, 512))),
    opt("boardFace", NULLABLE_ANY),
    opt("statusNote", Ty::Nullable(&Ty::StrLen(0, 120))),
    opt("attention", NULLABLE_ANY),
    opt("ttlMinutes", Ty::Int(1, 120)),
    opt("archived", Ty::Bool),
    opt("pinned", Ty::Bool),
    opt("unread", Ty::Bool),
    opt("contextWindow", Ty::Nullable(&NON_EMPTY)),
    opt("thinkingLevel", Ty::Nullable(&NON_EMPTY)),
    opt("fastMode", NULLABLE_ANY),
    opt("toolOverrides", NULLABLE_ANY),
    opt("verboseLevel", Ty::Nullable(&NON_EMPTY)),
    opt("traceLevel", Ty::Nullable(&NON_EMPTY)),
    opt("reasoningLevel", Ty::Nullable(&NON_EMPTY)),
    opt("responseUsage", NULLABLE_ANY),
    opt("elevatedLevel", Ty::Nullable(&NON_EMPTY)),
    opt("execHost", Ty::Nullable(&NON_EMPTY)),
    opt("execSecurity", Ty::Nullable(&NON_EMPTY)),
    opt("execAsk", Ty::Nullable(&NON_EMPTY)),
    opt("execNode", Ty::Nullable(&NON_EMPTY)),
    opt("permissionMode", NULLABLE_ANY),
    opt("model", Ty::Nullable(&NON_EMPTY)),
    opt("completionOwnerSessionKey", Ty::Nullable(&NON_EMPTY)),
    opt("inheritedToolPolicyVersion", NULLABLE_ANY),
    opt("inheritedToolAllow", NULLABLE_ANY),
    opt("inheritedToolDeny", NULLABLE_ANY),
    opt("sendPolicy", NULLABLE_ANY),
    opt("groupActivation", NULLABLE_ANY),
];
/// The field the Cogni fork adds to `sessions.patch`.
pub(crate) const OUTBOUND_HEADERS: Field = opt("outboundHeaders", Ty::Nullable(&Ty::StrMap));
/// `sessions.patch` of 2026.4.12 (an older, shorter list).
const SESSIONS_PATCH_V3: &[Field] = &[
    req("key", NON_EMPTY),
    opt("label", Ty::Nullable(&Ty::StrLen(1, 512))),
    opt("thinkingLevel", Ty::Nullable(&NON_EMPTY)),
    opt("fastMode", NULLABLE_ANY),
    opt("verboseLevel", Ty::Nullable(&NON_EMPTY)),
    opt("traceLevel", Ty::Nullable(&NON_EMPTY)),
    opt("reasoningLevel", Ty::Nullable(&NON_EMPTY)),
    opt("responseUsage", NULLABLE_ANY),
    opt("elevatedLevel", Ty::Nullable(&NON_EMPTY)),
    opt("execHost", Ty::Nullable(&NON_EMPTY)),
    opt("execSecurity", Ty::Nullable(&NON_EMPTY)),
    opt("execAsk", Ty::Nullable(&NON_EMPTY)),
    opt("execNode", Ty::Nullable(&NON_EMPTY)),
    opt("model", Ty::Nullable(&NON_EMPTY)),
    opt("sendPolicy", NULLABLE_ANY),
    opt("groupActivation", NULLABLE_ANY),
];
/// `SessionsMessagesSubscribeParams`.
pub(crate) const SUBSCRIBE: &[Field] = &[req("key", NON_EMPTY), opt("agentId", NON_EMPTY), opt("includeApprovals", Ty::True)];
/// `SessionsMessagesUnsubscribeParams`.
pub(crate) const UNSUBSCRIBE: &[Field] = &[req("key", NON_EMPTY), opt("agentId", NON_EMPTY)];
/// `SessionsAbortParams`: nothing required (the handler wants a key or a run id).
pub(crate) const SESSIONS_ABORT: &[Field] =
    &[opt("key", NON_EMPTY), opt("runId", NON_EMPTY), opt("agentId", NON_EMPTY), opt("clearQueued", Ty::Bool)];
/// Subscribe and unsubscribe of 2026.4.12.
const SESSION_KEY_V3: &[Field] = &[req("key", NON_EMPTY)];
/// `sessions.abort` of 2026.4.12.
const SESSIONS_ABORT_V3: &[Field] = &[req("key", NON_EMPTY), opt("runId", NON_EMPTY)];
/// `AgentParams` (protocol 4).
pub(crate) const AGENT: &[Field] = &[
    req("message", NON_EMPTY),
    opt("agentId", NON_EMPTY),
    opt("provider", Ty::Str),
    opt("model", Ty::Str),
    opt("to", Ty::Str),
    opt("replyTo", Ty::Str),
    opt("sessionId", Ty::Str),
    opt("sessionKey", Ty::Str),
    opt("expectedExistingSessionId", NON_EMPTY),
    opt("thinking", Ty::Str),
    opt("deliver", Ty::Bool),
    opt("attachments", Ty::AnyArray),
    opt("channel", Ty::Str),
    opt("replyChannel", Ty::Str),
    opt("accountId", Ty::Str),
    opt("replyAccountId", Ty::Str),
    opt("threadId", Ty::Str),
    opt("groupId", Ty::Str),
    opt("groupChannel", Ty::Str),
    opt("groupSpace", Ty::Str),
    opt("timeout", UINT),
    opt("bestEffortDeliver", Ty::Bool),
    opt("lane", Ty::Str),
    opt("cwd", NON_EMPTY),
    opt("cleanupBundleMcpOnRunEnd", Ty::Bool),
    opt("modelRun", Ty::Bool),
    opt("promptMode", Ty::Any),
    opt("extraSystemPrompt", Ty::Str),
    opt("bootstrapContextMode", Ty::Any),
    opt("bootstrapContextRunKind", Ty::Any),
    opt("acpTurnSource", Ty::Const("manual_spawn")),
    opt("internalRuntimeHandoffId", NON_EMPTY),
    opt("internalExecutionIdentityRetry", Ty::Bool),
    opt("internalExecutionIdentityRecoveryAttempt", Ty::Int(1, 0)),
    opt("execApprovalFollowupExpectedSessionId", NON_EMPTY),
    opt("internalEvents", Ty::AnyArray),
    opt("inputProvenance", Ty::AnyObject),
    opt("suppressPromptPersistence", Ty::Bool),
    opt("sessionEffects", Ty::Any),
    opt("sourceReplyDeliveryMode", Ty::Any),
    opt("disableMessageTool", Ty::Bool),
    opt("swarmCollector", Ty::Bool),
    opt("swarmOutputSchema", Ty::AnyObject),
    opt("forceRestartSafeTools", Ty::Bool),
    opt("forceCodeModeTools", Ty::Bool),
    opt("voiceWakeTrigger", Ty::Str),
    req("idempotencyKey", NON_EMPTY),
    opt("label", Ty::StrLen(1, 512)),
];
/// `agent` of 2026.4.12 (without the 2026.5+ additions: cwd, promptMode, the internal and swarm
/// fields, ...).
const AGENT_V3: &[Field] = &[
    req("message", NON_EMPTY),
    opt("agentId", NON_EMPTY),
    opt("provider", Ty::Str),
    opt("model", Ty::Str),
    opt("to", Ty::Str),
    opt("replyTo", Ty::Str),
    opt("sessionId", Ty::Str),
    opt("sessionKey", Ty::Str),
    opt("thinking", Ty::Str),
    opt("deliver", Ty::Bool),
    opt("attachments", Ty::AnyArray),
    opt("channel", Ty::Str),
    opt("replyChannel", Ty::Str),
    opt("accountId", Ty::Str),
    opt("replyAccountId", Ty::Str),
    opt("threadId", Ty::Str),
    opt("groupId", Ty::Str),
    opt("groupChannel", Ty::Str),
    opt("groupSpace", Ty::Str),
    opt("timeout", UINT),
    opt("bestEffortDeliver", Ty::Bool),
    opt("lane", Ty::Str),
    opt("extraSystemPrompt", Ty::Str),
    opt("bootstrapContextMode", Ty::Any),
    opt("bootstrapContextRunKind", Ty::Any),
    opt("internalEvents", Ty::AnyArray),
    opt("inputProvenance", Ty::AnyObject),
    req("idempotencyKey", NON_EMPTY),
    opt("label", Ty::Str),
];
/// `AgentWaitParams`.
pub(crate) const AGENT_WAIT: &[Field] = &[req("runId", NON_EMPTY), opt("timeoutMs", UINT)];
/// `ChatAbortParams` (protocol 4).
pub(crate) const CHAT_ABORT: &[Field] =
    &[req("sessionKey", NON_EMPTY), opt("agentId", NON_EMPTY), opt("runId", NON_EMPTY), opt("preserveSideRuns", Ty::Bool)];
/// `chat.abort` of 2026.4.12.
const CHAT_ABORT_V3: &[Field] = &[req("sessionKey", NON_EMPTY), opt("runId", Ty::Str)];
/// `ChatHistoryParams` (protocol 4).
pub(crate) const CHAT_HISTORY: &[Field] = &[
    req("sessionKey", NON_EMPTY),
    opt("agentId", NON_EMPTY),
    opt("cursor", Ty::Str),
    opt("limit", Ty::Int(1, 1000)),
    opt("offset", UINT),
    opt("pendingBefore", Ty::Int(1, 0)),
    opt("inputRunIds", Ty::AnyArray),
    opt("messageId", NON_EMPTY),
    opt("sessionId", NON_EMPTY),
    opt("maxChars", Ty::Int(1, 500_000)),
];
/// `chat.history` of 2026.4.12.
const CHAT_HISTORY_V3: &[Field] = &[req("sessionKey", NON_EMPTY), opt("limit", UINT), opt("maxChars", UINT)];
/// `RequestFrame` (protocol 4: with `traceparent`).
pub(crate) const REQUEST_FRAME: &[Field] = &[
    req("type", Ty::Const("req")),
    req("id", NON_EMPTY),
    req("method", NON_EMPTY),
    opt("params", Ty::Any),
    opt("traceparent", Ty::StrLen(0, 128)),
];
/// `RequestFrame` of 2026.4.12 (no `traceparent`).
const REQUEST_FRAME_V3: &[Field] = &[req("type", Ty::Const("req")), req("id", NON_EMPTY), req("method", NON_EMPTY), opt("params", Ty::Any)];

/// The field lists of one protocol version.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Schemas {
    /// How failures are worded.
    pub wording: Wording,
    /// `RequestFrame`.
    pub frame: &'static [Field],
    /// `connect`.
    pub connect: &'static [Field],
    /// `sessions.patch` (stock).
    pub sessions_patch: &'static [Field],
    /// `sessions.messages.subscribe`.
    pub subscribe: &'static [Field],
    /// `sessions.messages.unsubscribe`.
    pub unsubscribe: &'static [Field],
    /// `sessions.abort`.
    pub sessions_abort: &'static [Field],
    /// `agent`.
    pub agent: &'static [Field],
    /// `agent.wait`.
    pub agent_wait: &'static [Field],
    /// `chat.abort`.
    pub chat_abort: &'static [Field],
    /// `chat.history`.
    pub chat_history: &'static [Field],
}

/// The schemas of a protocol version.
pub(crate) fn for_protocol(protocol: u32) -> Schemas {
    if protocol == 3 {
        Schemas {
            wording: Wording::V3,
            frame: REQUEST_FRAME_V3,
            connect: CONNECT_V3,
            sessions_patch: SESSIONS_PATCH_V3,
            subscribe: SESSION_KEY_V3,
            unsubscribe: SESSION_KEY_V3,
            sessions_abort: SESSIONS_ABORT_V3,
            agent: AGENT_V3,
            agent_wait: AGENT_WAIT,
            chat_abort: CHAT_ABORT_V3,
            chat_history: CHAT_HISTORY_V3,
        }
    } else {
        Schemas {
            wording: Wording::V4,
            frame: REQUEST_FRAME,
            connect: CONNECT,
            sessions_patch: SESSIONS_PATCH,
            subscribe: SUBSCRIBE,
            unsubscribe: UNSUBSCRIBE,
            sessions_abort: SESSIONS_ABORT,
            agent: AGENT,
            agent_wait: AGENT_WAIT,
            chat_abort: CHAT_ABORT,
            chat_history: CHAT_HISTORY,
        }
    }
}

/// Which validator's wording (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wording {
    /// 2026.9.x (TypeBox).
    V4,
    /// 2026.4.x (AJV).
    V3,
}

/// Checks `v` against a closed object schema; the error is the text after `invalid X params: `.
pub(crate) fn check(v: &Value, fields: &[Field], wording: Wording) -> Result<(), String> {
    check_with(v, fields, None, wording)
}

/// Like [`check`], with one more allowed property (the Cogni fork's `outboundHeaders`).
pub(crate) fn check_with(v: &Value, fields: &[Field], extra: Option<&Field>, wording: Wording) -> Result<(), String> {
    let mut errors = Vec::new();
    check_object(v, fields, extra, "", wording, &mut errors);
    join(errors)
}

/// Checks a request frame (`invalid request frame: ...`).
pub(crate) fn check_request_frame(frame: &Value, schemas: &Schemas) -> Result<(), String> {
    check(frame, schemas.frame, schemas.wording)
}

/// The gateway's `formatValidationErrors`: unique parts, in order, joined by `; `.
fn join(errors: Vec<String>) -> Result<(), String> {
    if errors.is_empty() {
        return Ok(());
    }
    let mut unique: Vec<String> = Vec::with_capacity(errors.len());
    for e in errors {
        if !unique.contains(&e) {
            unique.push(e);
        }
    }
    Err(unique.join("; "))
}

/// `at /path: ` or nothing at the root (how the gateway places most messages).
fn prefix(path: &str) -> String {
    if path.is_empty() {
        String::new()
    } else {
        format!("at {path}: ")
    }
}

fn check_object(v: &Value, fields: &[Field], extra: Option<&Field>, path: &str, wording: Wording, out: &mut Vec<String>) {
    let Some(obj) = v.as_object() else {
        out.push(format!("{}must be object", prefix(path)));
        return;
    };
    let all = || fields.iter().chain(extra);
    let missing = all().filter(|f| f.required && !obj.contains_key(f.name));
    for (i, f) in missing.enumerate() {
        if wording == Wording::V4 && i > 0 {
            break;
        }
        out.push(format!("{}must have required property '{}'", prefix(path), f.name));
    }
    let unexpected = obj.keys().filter(|k| !all().any(|f| f.name == k.as_str()));
    for (i, k) in unexpected.enumerate() {
        if wording == Wording::V4 && i > 0 {
            break;
        }
        let at = if path.is_empty() { "at root".to_owned() } else { format!("at {path}") };
        out.push(format!("{at}: unexpected property '{k}'"));
    }
    for f in all() {
        if let Some(value) = obj.get(f.name) {
            check_value(value, &f.ty, &format!("{path}/{}", f.name), wording, out);
        }
    }
}

fn check_value(value: &Value, ty: &Ty, path: &str, wording: Wording, out: &mut Vec<String>) {
    let at = prefix(path);
    let not = if wording == Wording::V4 { "not" } else { "NOT" };
    match *ty {
        Ty::Str => {
            if !value.is_string() {
                out.push(format!("{at}must be string"));
            }
        }
        Ty::StrLen(min, max) => match value.as_str() {
            None => out.push(format!("{at}must be string")),
            Some(s) => {
                let n = s.chars().count();
                if n < min {
                    out.push(format!("{at}must {not} have fewer than {min} characters"));
                }
                if max > 0 && n > max {
                    out.push(format!("{at}must {not} have more than {max} characters"));
                }
            }
        },
        Ty::Nullable(inner) => {
            if value.is_null() {
                return;
            }
            let mut inner_errors = Vec::new();
            check_value(value, inner, path, wording, &mut inner_errors);
            if !inner_errors.is_empty() {
                out.extend(inner_errors);
                out.push(format!("{at}must be null"));
                out.push(format!("{at}must match a schema in anyOf"));
            }
        }
        Ty::Int(min, max) => match value.as_i64().or_else(|| value.as_u64().map(|_| i64::MAX)) {
            None => out.push(format!("{at}must be integer")),
            Some(n) => {
                if n < min {
                    out.push(format!("{at}must be >= {min}"));
                }
                if max != 0 && n > max {
                    out.push(format!("{at}must be <= {max}"));
                }
            }
        },
        Ty::Bool => {
            if !value.is_boolean() {
                out.push(format!("{at}must be boolean"));
            }
        }
        Ty::True => {
            if value != &Value::Bool(true) {
                out.push(format!("{at}must be equal to constant"));
            }
        }
        Ty::Const(want) => {
            if value.as_str() != Some(want) {
                out.push(format!("{at}must be equal to constant"));
            }
        }
        Ty::StrArray(min) => match value.as_array() {
            None => out.push(format!("{at}must be array")),
            Some(items) => {
                for (i, item) in items.iter().enumerate() {
                    check_value(item, &Ty::StrLen(min, 0), &format!("{path}/{i}"), wording, out);
                }
            }
        },
        Ty::StrMap => match value.as_object() {
            None => out.push(format!("{at}must be object")),
            Some(m) => {
                for (k, v) in m {
                    if !v.is_string() {
                        out.push(format!("at {path}/{k}: must be string"));
                    }
                }
            }
        },
        Ty::AnyObject => {
            if !value.is_object() {
                out.push(format!("{at}must be object"));
            }
        }
        Ty::AnyArray => {
            if !value.is_array() {
                out.push(format!("{at}must be array"));
            }
        }
        Ty::Any => {}
        Ty::Enum(allowed) => {
            if !value.as_str().is_some_and(|s| allowed.contains(&s)) {
                match wording {
                    Wording::V4 => out.push(format!("{at}must be equal to one of the allowed values")),
                    Wording::V3 => {
                        out.push(format!("{at}must be equal to constant"));
                        out.push(format!("{at}must match a schema in anyOf"));
                    }
                }
            }
        }
        Ty::Object(inner) => check_object(value, inner, None, path, wording, out),
    }
}

/// The names of a list's fields (for the drift test against the official schema).
#[cfg(test)]
pub(crate) fn names(fields: &[Field]) -> (Vec<&'static str>, Vec<&'static str>) {
    let mut all: Vec<&str> = fields.iter().map(|f| f.name).collect();
    let mut required: Vec<&str> = fields.iter().filter(|f| f.required).map(|f| f.name).collect();
    all.sort_unstable();
    required.sort_unstable();
    (all, required)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    fn v4(v: Value, f: &[Field]) -> Result<(), String> {
        check(&v, f, Wording::V4)
    }

    /// Texts as openclaw 2026.9.6 words them (seen by tests/support/conformance.mjs).
    #[test]
    fn words_errors_like_the_gateway() {
        let agent = json!({"message":"m","agentId":"main","sessionKey":"k","idempotencyKey":"i","outboundHeaders":{}});
        assert_eq!(v4(agent, AGENT).unwrap_err(), "at root: unexpected property 'outboundHeaders'");
        let patch = json!({"key":"k","model":"m","outboundHeaders":{"x":"y"}});
        assert_eq!(v4(patch.clone(), SESSIONS_PATCH).unwrap_err(), "at root: unexpected property 'outboundHeaders'");
        assert!(check_with(&patch, SESSIONS_PATCH, Some(&OUTBOUND_HEADERS), Wording::V4).is_ok());
        let bad_id =
            json!({"minProtocol":4,"maxProtocol":4,"client":{"id":"cogni-rust","version":"1","platform":"linux","mode":"backend"}});
        assert_eq!(v4(bad_id.clone(), CONNECT).unwrap_err(), "at /client/id: must be equal to one of the allowed values");
        assert_eq!(
            check(&bad_id, CONNECT_V3, Wording::V3).unwrap_err(),
            "at /client/id: must be equal to constant; at /client/id: must match a schema in anyOf"
        );
        assert_eq!(v4(json!({"key":""}), SUBSCRIBE).unwrap_err(), "at /key: must not have fewer than 1 characters");
        assert_eq!(check(&json!({"key":""}), SESSION_KEY_V3, Wording::V3).unwrap_err(), "at /key: must NOT have fewer than 1 characters");
        assert_eq!(v4(json!({}), SUBSCRIBE).unwrap_err(), "must have required property 'key'");
        assert_eq!(v4(json!({"runId":"r","timeoutMs":-1}), AGENT_WAIT).unwrap_err(), "at /timeoutMs: must be >= 0");
        assert_eq!(v4(json!([]), AGENT_WAIT).unwrap_err(), "must be object");
        assert_eq!(
            v4(json!({"key":"k","model":""}), SESSIONS_PATCH).unwrap_err(),
            "at /model: must not have fewer than 1 characters; at /model: must be null; at /model: must match a schema in anyOf"
        );
        assert_eq!(v4(json!({"sessionKey":"k","limit":0}), CHAT_HISTORY).unwrap_err(), "at /limit: must be >= 1");
        assert_eq!(v4(json!({"message":5,"idempotencyKey":"i","timeout":"x"}), AGENT).unwrap_err(), "at /message: must be string; at /timeout: must be integer");
    }

    /// Protocol 4 names only the first missing and the first unexpected property; protocol 3 all.
    #[test]
    fn how_many_errors_each_release_reports() {
        let res = json!({"type":"res","id":"x4","ok":true,"payload":{}});
        assert_eq!(
            check_request_frame(&res, &for_protocol(4)).unwrap_err(),
            "must have required property 'method'; at root: unexpected property 'ok'; at /type: must be equal to constant"
        );
        assert_eq!(
            check_request_frame(&res, &for_protocol(3)).unwrap_err(),
            "must have required property 'method'; at root: unexpected property 'ok'; at root: unexpected property 'payload'; at /type: must be equal to constant"
        );
        let event = json!({"type":"event","event":"tick","payload":{"ts":1}});
        assert_eq!(
            check_request_frame(&event, &for_protocol(4)).unwrap_err(),
            "must have required property 'id'; at root: unexpected property 'event'; at /type: must be equal to constant"
        );
        assert_eq!(
            check_request_frame(&event, &for_protocol(3)).unwrap_err(),
            "must have required property 'id'; must have required property 'method'; at root: unexpected property 'event'; at root: unexpected property 'payload'; at /type: must be equal to constant"
        );
    }

    #[test]
    fn frames_are_closed_and_traceparent_is_v4_only() {
        let f = json!({"type":"req","id":"1","method":"health","params":{},"traceparent":"00-a-b-01"});
        assert!(check_request_frame(&f, &for_protocol(4)).is_ok());
        assert_eq!(check_request_frame(&f, &for_protocol(3)).unwrap_err(), "at root: unexpected property 'traceparent'");
        // params are optional (the method's own schema decides about them).
        assert!(check_request_frame(&json!({"type":"req","id":"1","method":"m"}), &for_protocol(4)).is_ok());
        let long = json!({"type":"req","id":"1","method":"m","traceparent":"x".repeat(129)});
        assert_eq!(check_request_frame(&long, &for_protocol(4)).unwrap_err(), "at /traceparent: must not have more than 128 characters");
    }

    /// The protocol-4 lists name exactly the properties (and required ones) of the official
    /// schemas, so that the replay gateway accepts what the real one accepts. Needs the package
    /// (tests/support/install-gateway-protocol.sh; `tests/run.sh` sets the variables): without it
    /// the test says so and passes, unless `CLAWMUX_REQUIRE_GATEWAY_PROTOCOL=1`.
    #[test]
    fn lists_match_the_official_schema() {
        let Ok(dir) = std::env::var("CLAWMUX_GATEWAY_PROTOCOL_DIR") else {
            assert!(
                std::env::var("CLAWMUX_REQUIRE_GATEWAY_PROTOCOL").as_deref() != Ok("1"),
                "CLAWMUX_REQUIRE_GATEWAY_PROTOCOL=1 but CLAWMUX_GATEWAY_PROTOCOL_DIR is not set (tests/support/install-gateway-protocol.sh)"
            );
            eprintln!("@openclaw/gateway-protocol not installed (tests/support/install-gateway-protocol.sh); skipping");
            return;
        };
        let path = std::path::Path::new(&dir).join("node_modules/@openclaw/gateway-protocol/protocol.schema.json");
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let def = |pointer: &str| doc.pointer(pointer).unwrap_or_else(|| panic!("{pointer} not in {}", path.display())).clone();
        let official = |d: &Value| {
            let mut all: Vec<String> = d["properties"].as_object().unwrap().keys().cloned().collect();
            let mut required: Vec<String> = d["required"].as_array().map(|r| r.iter().map(|x| x.as_str().unwrap().to_owned()).collect()).unwrap_or_default();
            all.sort_unstable();
            required.sort_unstable();
            (all, required)
        };
        let cases: [(&str, &[Field]); 13] = [
            ("/definitions/ConnectParams", CONNECT),
            ("/definitions/ConnectParams/properties/client", CLIENT),
            ("/definitions/ConnectParams/properties/auth", AUTH),
            ("/definitions/ConnectParams/properties/device", DEVICE),
            ("/definitions/SessionsPatchParams", SESSIONS_PATCH),
            ("/definitions/SessionsMessagesSubscribeParams", SUBSCRIBE),
            ("/definitions/SessionsMessagesUnsubscribeParams", UNSUBSCRIBE),
            ("/definitions/SessionsAbortParams", SESSIONS_ABORT),
            ("/definitions/AgentParams", AGENT),
            ("/definitions/AgentWaitParams", AGENT_WAIT),
            ("/definitions/ChatAbortParams", CHAT_ABORT),
            ("/definitions/ChatHistoryParams", CHAT_HISTORY),
            ("/definitions/RequestFrame", REQUEST_FRAME),
        ];
        for (pointer, fields) in cases {
            let (all, required) = names(fields);
            let (want_all, want_required) = official(&def(pointer));
            assert_eq!(all, want_all, "properties of {pointer}");
            assert_eq!(required, want_required, "required properties of {pointer}");
        }
    }

    /// The official client's optional connect fields pass on protocol 4.
    #[test]
    fn connect_accepts_what_the_schema_allows() {
        let connect = json!({"minProtocol":4,"maxProtocol":4,
            "client":{"id":"gateway-client","version":"1","platform":"linux","mode":"backend","displayName":"d","deviceFamily":"f",
                      "buildId":"b","instanceId":"i","modelIdentifier":"m","timeZone":"UTC"},
            "role":"operator","scopes":["operator.read"],"caps":["session-scoped-events"],"commands":[],"permissions":{},"pathEnv":"/bin",
            "auth":{"token":"t","password":"p"},"device":{"id":"x","publicKey":"k","signature":"s","signedAt":1,"nonce":"n"},"locale":"en","userAgent":"ua"});
        v4(connect, CONNECT).unwrap();
        let bad_device = json!({"minProtocol":4,"maxProtocol":4,"client":{"id":"gateway-client","version":"1","platform":"l","mode":"backend"},"device":{"id":"x"}});
        assert_eq!(v4(bad_device, CONNECT).unwrap_err(), "at /device: must have required property 'publicKey'");
    }
}
