//! The methods a multiplexer calls, answered like the real gateway answers them.
//!
//! Order of checks, as on the gateway: unknown method, then scope, then the closed params schema,
//! then the method's own rules. Every answer is queued on the caller's connection; methods that
//! wait (`agent.wait`) run in their own task so the socket keeps reading.

use super::cassette::{recorded_request_epoch_ms, track_index_for_message, RunContext};
use super::config::ReplayConfig;
use super::run::{self, answer_abort, RunPlan};
use super::schema::{self, Field};
use super::state::{now_ms, wait_true, AbortKind, AbortRequest, ConnKey, RunEntry, RunRecord, RunStatus, Shared};
use clawmux_protocol::frame::{encode_response, RequestFrame};
use clawmux_protocol::methods::{name, AgentWaitParams, SessionKeyParams, SessionsPatchParams};
use clawmux_protocol::{ErrorShape, SessionKey};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// Every method this gateway implements (`hello-ok.features.methods`).
pub(crate) const METHODS: [&str; 9] = [
    name::HEALTH,
    name::SESSIONS_PATCH,
    name::SESSIONS_SUBSCRIBE,
    name::SESSIONS_UNSUBSCRIBE,
    name::AGENT,
    name::AGENT_WAIT,
    name::CHAT_ABORT,
    name::SESSIONS_ABORT,
    name::CHAT_HISTORY,
];

/// Whether this gateway offers `method`: every one of [`METHODS`], except the subscription methods
/// when it imitates a gateway without session-scoped events.
pub(crate) fn offers(cfg: &ReplayConfig, method: &str) -> bool {
    METHODS.contains(&method) && (cfg.session_scoped_events || !matches!(method, name::SESSIONS_SUBSCRIBE | name::SESSIONS_UNSUBSCRIBE))
}

/// `hello-ok.features.methods`.
pub(crate) fn offered_methods(cfg: &ReplayConfig) -> Vec<&'static str> {
    METHODS.into_iter().filter(|m| offers(cfg, m)).collect()
}

/// Default `agent.wait` timeout of the gateway.
const AGENT_WAIT_DEFAULT_MS: u64 = 30_000;

/// Queues a `res` for a connection.
pub(crate) fn respond(shared: &Shared, conn: ConnKey, id: &str, result: Result<Value, ErrorShape>) {
    let text = match &result {
        Ok(v) => encode_response(id, Ok(v)),
        Err(e) => encode_response(id, Err(e)),
    };
    if let Ok(text) = text {
        shared.lock().send_to(conn, text);
    }
}

/// `INVALID_REQUEST` with a message.
pub(crate) fn invalid(message: impl Into<String>) -> ErrorShape {
    ErrorShape::new("INVALID_REQUEST", message)
}

/// The scope a method needs on this protocol (`None`: no check, like `health`).
fn required_scope(method: &str, protocol: u32) -> Option<&'static str> {
    match method {
        name::HEALTH => None,
        name::SESSIONS_PATCH if protocol == 3 => Some("operator.admin"),
        name::SESSIONS_PATCH | name::AGENT | name::AGENT_WAIT | name::CHAT_ABORT | name::SESSIONS_ABORT => Some("operator.write"),
        _ => Some("operator.read"),
    }
}

/// The missing-scope error: protocol 4 `FORBIDDEN` with details, protocol 3 plain `INVALID_REQUEST`.
fn missing_scope(scope: &str, protocol: u32) -> ErrorShape {
    let message = format!("missing scope: {scope}");
    if protocol == 3 {
        return invalid(message);
    }
    let mut e = ErrorShape::new("FORBIDDEN", message);
    e.details = Some(json!({"code": "MISSING_SCOPE", "missingScope": scope, "requiredScopes": [scope]}));
    e
}

/// Schema check (gateway wording), then decoding with the protocol crate's closed type from the
/// properties it knows (the official schema allows more, which the replay does not act on).
fn params<T: DeserializeOwned + Known>(method: &str, raw: &Value, fields: &[Field], extra: Option<&Field>, protocol: u32) -> Result<T, ErrorShape> {
    checked(method, raw, fields, extra, protocol)?;
    let known: serde_json::Map<String, Value> = raw
        .as_object()
        .map(|o| o.iter().filter(|(k, _)| T::KNOWN.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    serde_json::from_value(Value::Object(known)).map_err(|e| invalid(format!("invalid {method} params: {e}")))
}

/// The schema check alone: `invalid <method> params: <the gateway's wording>`.
fn checked(method: &str, raw: &Value, fields: &[Field], extra: Option<&Field>, protocol: u32) -> Result<(), ErrorShape> {
    let wording = schema::for_protocol(protocol).wording;
    schema::check_with(raw, fields, extra, wording).map_err(|e| invalid(format!("invalid {method} params: {e}")))
}

/// The property names a protocol param type decodes (its struct is closed: `deny_unknown_fields`).
trait Known {
    /// Wire names of the type's fields.
    const KNOWN: &'static [&'static str];
}
impl Known for SessionsPatchParams {
    const KNOWN: &'static [&'static str] = &["key", "model", "outboundHeaders"];
}
impl Known for SessionKeyParams {
    const KNOWN: &'static [&'static str] = &["key"];
}
impl Known for AgentWaitParams {
    const KNOWN: &'static [&'static str] = &["runId", "timeoutMs"];
}

/// A string property of already checked params.
fn str_param<'a>(raw: &'a Value, name: &str) -> Option<&'a str> {
    raw.get(name).and_then(Value::as_str)
}

/// Handles one request of a handshaken connection.
pub(crate) fn dispatch(shared: &Arc<Shared>, conn: ConnKey, req: RequestFrame, raw_params: Value) {
    let protocol = shared.protocol();
    shared.lock().count_request(&req.method);
    if req.method == name::AGENT {
        let message = raw_params.get("message").and_then(Value::as_str).unwrap_or_default();
        if shared.lock().lose_agent_request(message) {
            tracing::info!("replay gateway: losing an agent request, as asked");
            return;
        }
    }
    // 2026.4.x checks scopes first: a method it does not list (`connect` included) needs admin.
    if protocol == 3 && !offers(&shared.cfg, &req.method) {
        let admin = shared.lock().conns.get(&conn).is_some_and(|c| c.scopes.admin);
        if !admin {
            return respond(shared, conn, &req.id, Err(missing_scope("operator.admin", protocol)));
        }
    }
    if req.method == name::CONNECT {
        return respond(shared, conn, &req.id, Err(invalid("connect is only valid as the first request")));
    }
    if !offers(&shared.cfg, &req.method) {
        return respond(shared, conn, &req.id, Err(invalid(format!("unknown method: {}", req.method))));
    }
    if let Some(scope) = required_scope(&req.method, protocol) {
        let allowed = shared.lock().conns.get(&conn).is_some_and(|c| c.scopes.allows(scope));
        if !allowed {
            return respond(shared, conn, &req.id, Err(missing_scope(scope, protocol)));
        }
    }
    let result = match req.method.as_str() {
        name::HEALTH => Ok(health(shared)),
        name::SESSIONS_PATCH => sessions_patch(shared, &raw_params),
        name::SESSIONS_SUBSCRIBE | name::SESSIONS_UNSUBSCRIBE => subscribe(shared, conn, &req.method, &raw_params),
        name::CHAT_HISTORY => chat_history(shared, &raw_params),
        name::AGENT => return agent(shared, conn, &req, &raw_params),
        name::AGENT_WAIT => return agent_wait(shared, conn, req.id, &raw_params),
        name::CHAT_ABORT | name::SESSIONS_ABORT => return abort(shared, conn, &req, &raw_params),
        _ => Err(invalid(format!("unknown method: {}", req.method))),
    };
    respond(shared, conn, &req.id, result);
}

/// Resolves a model name against the allowed list: `provider/model` exactly, or a bare model id
/// that names exactly one allowed model (protocol 3, which refuses any other).
fn resolve_model(models: &[String], wanted: &str) -> Option<String> {
    if models.iter().any(|m| m == wanted) {
        return Some(wanted.to_owned());
    }
    let mut by_id = models.iter().filter(|m| m.split_once('/').is_some_and(|(_, id)| id == wanted));
    match (by_id.next(), by_id.next()) {
        (Some(m), None) => Some(m.clone()),
        _ => None,
    }
}

/// Protocol 4 resolves a model like 2026.9.6: `provider/model` of a configured provider (any model
/// id: the provider's catalogue is not consulted), or a bare id, taken as the provider of the
/// configured model with that id, else of the default model. An unknown provider is refused.
fn resolve_model_v4(models: &[String], wanted: &str) -> Result<String, ErrorShape> {
    let providers: Vec<&str> = models.iter().filter_map(|m| m.split_once('/').map(|(p, _)| p)).collect();
    match wanted.split_once('/') {
        Some((provider, _)) if providers.contains(&provider) => Ok(wanted.to_owned()),
        Some((provider, _)) => Err(invalid(format!("Unknown provider \"{provider}\". Use /models to list providers."))),
        None => {
            let provider = models
                .iter()
                .find(|m| m.split_once('/').is_some_and(|(_, id)| id == wanted))
                .or(models.first())
                .and_then(|m| m.split_once('/'))
                .map_or("", |(p, _)| p);
            Ok(format!("{provider}/{wanted}"))
        }
    }
}

fn split_model(model: &str) -> (&str, &str) {
    model.split_once('/').unwrap_or(("", model))
}

/// `health`: the top-level keys of the release (their contents describe the gateway host:
/// plugins, channels, agents, event loop; the replay's are minimal).
fn health(shared: &Shared) -> Value {
    let now = now_ms();
    let sessions = {
        let st = shared.lock();
        json!({"path": "replay://sessions", "count": st.sessions.len(), "recent": []})
    };
    if shared.protocol() == 3 {
        return json!({
            "ok": true, "ts": now, "durationMs": 0, "channels": {}, "channelOrder": [], "channelLabels": {}, "heartbeatSeconds": 0,
            "defaultAgentId": "main", "agents": [{"agentId": "main", "isDefault": true, "sessions": sessions}], "sessions": sessions,
        });
    }
    json!({
        "ok": true, "ts": now, "durationMs": 0,
        "plugins": {"loaded": [], "errors": [], "unavailable": []},
        "configReload": {"hotReloadStatus": "active"},
        "channels": {}, "channelOrder": [], "channelLabels": {}, "heartbeatSeconds": 0, "defaultAgentId": "main",
        "agents": [{"agentId": "main", "isDefault": true, "heartbeat": {"enabled": false, "every": "disabled", "everyMs": null}, "sessions": sessions}],
        "sessions": sessions,
        "modelRuntime": {"degraded": false, "pendingAgents": []},
        "eventLoop": {"degraded": false, "degradedSinceMs": null, "reasons": [], "intervalMs": 1000, "delayP99Ms": 0, "delayMaxMs": 0, "utilization": 0, "cpuCoreRatio": 0},
    })
}

/// Thinking levels 2026.9.6 offers for a model: `off` for a configured (non-reasoning) one, the
/// full ladder for a model it does not know.
fn thinking_levels(known: bool) -> Value {
    let ids: &[&str] = if known { &["off"] } else { &["off", "minimal", "low", "medium", "high"] };
    Value::Array(ids.iter().map(|id| json!({"id": id, "label": id})).collect())
}

fn sessions_patch(shared: &Shared, raw: &Value) -> Result<Value, ErrorShape> {
    let protocol = shared.protocol();
    let schemas = schema::for_protocol(protocol);
    let fork = shared.cfg.accept_outbound_headers.then_some(&schema::OUTBOUND_HEADERS);
    let p: SessionsPatchParams = params(name::SESSIONS_PATCH, raw, schemas.sessions_patch, fork, protocol)?;
    let key = SessionKey::canonicalize(&p.key).as_str().to_owned();
    // `null` clears a setting; absence leaves it (the protocol type cannot tell them apart).
    let model_change = match raw.get("model") {
        None => None,
        Some(Value::Null) => Some(None),
        Some(_) => {
            let wanted = p.model.unwrap_or_default();
            // 2026.4.12 takes any `provider/model` (a bare id: of the default provider).
            let resolved = if protocol >= 4 {
                resolve_model_v4(&shared.cfg.models, &wanted)?
            } else {
                resolve_model(&shared.cfg.models, &wanted).unwrap_or_else(|| {
                    if wanted.contains('/') {
                        wanted.clone()
                    } else {
                        format!("{}/{wanted}", split_model(shared.cfg.models.first().map_or("", String::as_str)).0)
                    }
                })
            };
            Some(Some(resolved))
        }
    };
    let default_model = shared.cfg.models.first().cloned().unwrap_or_default();
    let mut st = shared.lock();
    let existed = st.sessions.contains_key(&key);
    let session = st.session_made_by(&key, "operator");
    if let Some(change) = &model_change {
        // 2026.9.6 flags a switch of an existing session's model until the override is cleared;
        // 2026.4.12 any model patch, for good.
        if change.is_some() && (existed || protocol == 3) {
            session.live_switch_pending = true;
            session.delivery_none = protocol >= 4;
        }
        if change.is_none() && protocol >= 4 {
            session.live_switch_pending = false;
        }
        session.override_source = match (change.is_some(), protocol >= 4) {
            (true, _) => Some("user"),
            (false, true) => Some("default"),
            (false, false) => None,
        };
        session.model_override = change.clone();
    }
    match raw.get("label") {
        Some(Value::Null) => session.label = None,
        Some(Value::String(l)) => session.label = Some(l.clone()),
        _ => {}
    }
    match raw.get("outboundHeaders") {
        Some(Value::Null) => session.outbound_headers.clear(),
        Some(_) => session.outbound_headers = p.outbound_headers.unwrap_or_default(),
        None => {}
    }
    session.updated_at = now_ms();
    let effective = session.model_override.clone().unwrap_or_else(|| default_model.clone());
    let (provider, model) = split_model(&effective);
    let mut entry = json!({"sessionId": session.session_id, "updatedAt": session.updated_at});
    if protocol >= 4 {
        entry["lifecycleRevision"] = json!(session.lifecycle_revision);
        entry["createdAt"] = json!(session.created_at);
        entry["createdVia"] = json!(session.created_via);
    }
    if let Some(source) = session.override_source.filter(|_| protocol >= 4 || session.model_override.is_some()) {
        entry["modelOverrideSource"] = json!(source);
    }
    if session.delivery_none {
        entry["delivery"] = json!({"kind": "none"});
    }
    if session.live_switch_pending {
        entry["liveModelSwitchPending"] = json!(true);
    }
    if let Some(label) = &session.label {
        entry["label"] = json!(label);
    }
    // 2026.9.x reports any override; 2026.4.x only one that differs from the default model.
    if let Some(ov) = &session.model_override {
        if protocol >= 4 || *ov != default_model {
            let (op, om) = split_model(ov);
            entry["providerOverride"] = json!(op);
            entry["modelOverride"] = json!(om);
            if protocol >= 4 {
                entry["modelOverrideRouteResolution"] = json!("resolved");
            }
        }
    }
    if shared.cfg.accept_outbound_headers && !session.outbound_headers.is_empty() {
        entry["outboundHeaders"] = json!(session.outbound_headers);
    }
    let mut resolved = json!({"modelProvider": provider, "model": model});
    if protocol >= 4 {
        resolved["agentRuntime"] = json!({"id": "openclaw", "source": "implicit"});
        resolved["runtimeSelectionLocked"] = json!(false);
        // Levels for the model the patch named (not for a patch that left the model alone).
        if let Some(Some(m)) = &model_change {
            resolved["thinkingLevel"] = json!("off");
            resolved["thinkingLevels"] = thinking_levels(shared.cfg.models.contains(m));
        }
    }
    Ok(json!({
        "ok": true,
        "path": "replay://sessions",
        "key": key,
        "entry": entry,
        "resolved": resolved,
    }))
}

fn subscribe(shared: &Shared, conn: ConnKey, method: &str, raw: &Value) -> Result<Value, ErrorShape> {
    let protocol = shared.protocol();
    let schemas = schema::for_protocol(protocol);
    let subscribing = method == name::SESSIONS_SUBSCRIBE;
    let fields = if subscribing { schemas.subscribe } else { schemas.unsubscribe };
    let p: SessionKeyParams = params(method, raw, fields, None, protocol)?;
    let key = SessionKey::canonicalize(&p.key).as_str().to_owned();
    let mut st = shared.lock();
    if let Some(c) = st.conns.get_mut(&conn) {
        if subscribing {
            c.subscriptions.insert(key.clone());
        } else {
            c.subscriptions.remove(&key);
        }
    }
    let mut out = json!({"subscribed": subscribing, "key": key});
    // No approvals are ever pending here: the replay runs no tools that ask.
    if subscribing && raw.get("includeApprovals") == Some(&Value::Bool(true)) {
        out["approvalReplay"] = json!({"sessionKey": key, "updatedAtMs": now_ms(), "approvals": [], "truncated": false});
    }
    Ok(out)
}

fn chat_history(shared: &Shared, raw: &Value) -> Result<Value, ErrorShape> {
    let protocol = shared.protocol();
    checked(name::CHAT_HISTORY, raw, schema::for_protocol(protocol).chat_history, None, protocol)?;
    let key = SessionKey::canonicalize(raw.get("sessionKey").and_then(Value::as_str).unwrap_or_default()).as_str().to_owned();
    let limit = raw.get("limit").and_then(Value::as_u64).unwrap_or(200).min(1000) as usize;
    let st = shared.lock();
    let session = st.sessions.get(&key);
    let mut out = match session {
        None => json!({"sessionKey": key, "messages": []}),
        Some(session) => {
            let skip = session.transcript.len().saturating_sub(limit);
            json!({"sessionKey": key, "sessionId": session.session_id, "messages": session.transcript[skip..]})
        }
    };
    if protocol == 3 {
        out["thinkingLevel"] = json!("off");
    } else {
        let total = session.map_or(0, |s| s.transcript.len());
        let default_model = shared.cfg.models.first().cloned().unwrap_or_default();
        let effective = session.and_then(|s| s.model_override.clone()).unwrap_or(default_model);
        let (provider, model) = split_model(&effective);
        out["pendingInputs"] = json!({"items": [], "total": 0});
        out["hasMore"] = json!(false);
        out["totalMessages"] = json!(total);
        out["defaults"] = json!({"modelProvider": provider, "model": model, "modelSelectionTarget": "session"});
        out["sessionInfo"] = json!({"key": key, "kind": "direct", "agentId": "main", "isMain": false,
            "modelProvider": provider, "model": model, "hasActiveRun": st.active_run_of(&key).is_some()});
        if let Some(s) = session {
            // An opaque cursor for "what changed since": the replay's is the transcript length.
            out["deltaCursor"] = json!(format!("replay:{}:{}", s.session_id, s.transcript.len()));
        }
    }
    Ok(out)
}

/// The `agent` params the replay acts on (the schema allows many more).
struct AgentRequest {
    message: String,
    agent_id: String,
    session_key: String,
    idempotency_key: String,
    timeout: Option<u64>,
    extra_system_prompt: Option<String>,
}

/// Checks and reads `agent` params. Protocol 4 defaults `agentId` to `main` and the session to the
/// agent's main session, and refuses an agent id that is not the session key's agent.
fn agent_request(raw: &Value, protocol: u32) -> Result<AgentRequest, ErrorShape> {
    checked(name::AGENT, raw, schema::for_protocol(protocol).agent, None, protocol)?;
    let agent_id = str_param(raw, "agentId").unwrap_or("main").to_owned();
    let key = match str_param(raw, "sessionKey") {
        Some(k) if !k.is_empty() => SessionKey::canonicalize(k).as_str().to_owned(),
        _ => format!("agent:{agent_id}:main"),
    };
    if protocol == 3 && agent_id != "main" {
        return Err(invalid(format!("invalid agent params: unknown agent id \"{agent_id}\"")));
    }
    if protocol >= 4 {
        if let Some(owner) = key.strip_prefix("agent:").and_then(|rest| rest.split(':').next()) {
            if owner != agent_id {
                return Err(invalid(format!(
                    "Multiple agents are configured, but session agent resolution has no explicit owner. The agent-scoped session key belongs to \"{owner}\", not \"{agent_id}\"."
                )));
            }
        }
    }
    Ok(AgentRequest {
        message: str_param(raw, "message").unwrap_or_default().to_owned(),
        agent_id,
        session_key: key,
        idempotency_key: str_param(raw, "idempotencyKey").unwrap_or_default().to_owned(),
        timeout: raw.get("timeout").and_then(Value::as_u64),
        extra_system_prompt: str_param(raw, "extraSystemPrompt").map(str::to_owned),
    })
}

fn agent(shared: &Arc<Shared>, conn: ConnKey, req: &RequestFrame, raw: &Value) {
    let protocol = shared.protocol();
    let p = match agent_request(raw, protocol) {
        Ok(p) => p,
        Err(e) => return respond(shared, conn, &req.id, Err(e)),
    };
    let session_key = p.session_key.clone();
    let run_id = p.idempotency_key.clone();
    let requested_at = tokio::time::Instant::now();

    let (plan_parts, abort_rx) = {
        let mut st = shared.lock();
        // Dedupe: a repeated idempotency key gets ONE res: the cached final, or while the run is
        // in flight the ACK with `status: "in_flight"` (as openclaw 2026.9.6 answers: the final
        // goes to the first request only). No events are replayed again.
        if let Some(existing) = st.runs.get(&run_id) {
            // 2026.4.12 answers the cached ACK itself.
            let cached = existing.final_payload.clone().unwrap_or_else(|| {
                let mut ack = existing.ack.clone();
                if let Some(o) = ack.as_object_mut().filter(|_| protocol >= 4) {
                    o.insert("status".to_owned(), json!("in_flight"));
                    // 2026.9.6 answers the run's identity, not when it was accepted.
                    o.remove("acceptedAt");
                }
                ack
            });
            drop(st);
            return respond(shared, conn, &req.id, Ok(cached));
        }
        let track_idx = match track_index_for_message(&shared.tracks, &p.message) {
            Some(i) => i,
            None => {
                let i = st.round_robin % shared.tracks.len().max(1);
                st.round_robin = st.round_robin.wrapping_add(1);
                i
            }
        };
        let Some(track) = shared.tracks.get(track_idx) else {
            drop(st);
            return respond(shared, conn, &req.id, Err(ErrorShape::new("UNAVAILABLE", "replay gateway has no tracks")));
        };
        let default_model = shared.cfg.models.first().cloned().unwrap_or_default();
        let conn_id = st.conns.get(&conn).map(|c| c.conn_id.clone()).unwrap_or_default();
        let script = st.script_for(&p.message);
        let session = st.session_mut(&session_key);
        let model_override = session.model_override.clone();
        let model = model_override.clone().unwrap_or(default_model);
        let session_id = session.session_id.clone();
        let outbound_headers = session.outbound_headers.clone();
        session.transcript.push(json!({
            "role": "user", "content": p.message, "timestamp": now_ms(),
            "idempotencyKey": format!("{run_id}:user"),
        }));
        let rendered = track.render(&RunContext {
            session_key: &session_key,
            run_id: &run_id,
            session_id: &session_id,
            message: &p.message,
            model: &model,
        });
        let mut ack = rendered.ack.clone();
        if let Some(obj) = ack.as_object_mut() {
            if obj.contains_key("agentId") {
                obj.insert("agentId".to_owned(), json!(p.agent_id));
            }
            if obj.contains_key("acceptedAt") {
                obj.insert("acceptedAt".to_owned(), json!(now_ms()));
            }
        }
        if let Some(patch) = script.as_ref().and_then(|s| s.ack_patch.as_ref()) {
            super::script::merge(&mut ack, patch);
        }
        let wait_reply = script.as_ref().and_then(|s| s.wait_reply.clone());
        let (done_tx, done_rx) = watch::channel(false);
        let prev = session.tail.replace(done_rx);
        let (abort_tx, abort_rx) = if protocol >= 4 {
            let (tx, rx) = mpsc::unbounded_channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        st.records.push(RunRecord {
            run_id: run_id.clone(),
            session_key: session_key.clone(),
            message: p.message.clone(),
            model,
            model_override,
            outbound_headers,
            traceparent: req.traceparent.clone(),
            extra_system_prompt: p.extra_system_prompt.clone(),
            timeout_s: p.timeout,
            track: track.name.clone(),
            conn_id,
            status: RunStatus::Queued,
            aborted: false,
            accepted_at: std::time::Instant::now(),
            finished_at: None,
            abort_requests: 0,
        });
        let record = st.records.len() - 1;
        st.runs.insert(
            run_id.clone(),
            RunEntry {
                record,
                session_key: session_key.clone(),
                ack: ack.clone(),
                final_payload: None,
                abort_tx,
                playing: false,
                wait_extras: serde_json::Map::new(),
                ended_at: None,
                started_at: None,
                task: None,
                wait_reply,
            },
        );
        let mut rendered = rendered;
        rendered.ack = ack;
        ((rendered, session_id, prev, done_tx, recorded_request_epoch_ms(track), script), abort_rx)
    };
    let (rendered, session_id, prev, done, recorded_epoch_ms, script) = plan_parts;
    let plan = RunPlan {
        run_id: run_id.clone(),
        session_key,
        session_id,
        agent_id: p.agent_id,
        requester: conn,
        request_id: req.id.clone(),
        rendered,
        recorded_epoch_ms,
        requested_at,
        prev,
        done,
        aborts: abort_rx,
        script: script.unwrap_or_default(),
    };
    let task = tokio::spawn(run::play(Arc::clone(shared), plan));
    if let Some(run) = shared.lock().runs.get_mut(&run_id) {
        run.task = Some(task.abort_handle());
    }
}

fn agent_wait(shared: &Arc<Shared>, conn: ConnKey, id: String, raw: &Value) {
    let protocol = shared.protocol();
    let p: AgentWaitParams = match params(name::AGENT_WAIT, raw, schema::for_protocol(protocol).agent_wait, None, protocol) {
        Ok(p) => p,
        Err(e) => return respond(shared, conn, &id, Err(e)),
    };
    let scripted = shared.lock().runs.get(&p.run_id).and_then(|r| r.wait_reply.clone());
    if let Some(reply) = scripted {
        return respond(shared, conn, &id, Ok(reply));
    }
    let shared = Arc::clone(shared);
    tokio::spawn(async move {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(p.timeout_ms.unwrap_or(AGENT_WAIT_DEFAULT_MS));
        let mut changed = shared.runs_changed.subscribe();
        let mut stopping = shared.stopping.subscribe();
        loop {
            let terminal = {
                let st = shared.lock();
                st.runs.get(&p.run_id).and_then(|r| {
                    let fin = r.final_payload.as_ref()?;
                    let mut out = serde_json::Map::new();
                    out.insert("runId".to_owned(), json!(p.run_id));
                    out.insert("status".to_owned(), fin.get("status").cloned().unwrap_or(json!("ok")));
                    if let Some(e) = r.ended_at {
                        out.insert("endedAt".to_owned(), json!(e));
                    }
                    for (k, v) in &r.wait_extras {
                        out.insert(k.clone(), v.clone());
                    }
                    Some(Value::Object(out))
                })
            };
            if let Some(t) = terminal {
                return respond(&shared, conn, &id, Ok(t));
            }
            // Still running, or unknown (e.g. forgotten by a restart): wait, then `timeout`.
            tokio::select! {
                r = changed.changed() => if r.is_err() { return; },
                _ = tokio::time::sleep_until(deadline) => {
                    return respond(&shared, conn, &id, Ok(json!({"runId": p.run_id, "status": "timeout"})));
                }
                _ = wait_true(&mut stopping) => return,
            }
        }
    });
}

fn abort(shared: &Arc<Shared>, conn: ConnKey, req: &RequestFrame, raw: &Value) {
    let protocol = shared.protocol();
    let schemas = schema::for_protocol(protocol);
    let (kind, fields) = if req.method == name::CHAT_ABORT {
        (AbortKind::Chat, schemas.chat_abort)
    } else {
        (AbortKind::Session, schemas.sessions_abort)
    };
    if let Err(e) = checked(&req.method, raw, fields, None, protocol) {
        return respond(shared, conn, &req.id, Err(e));
    }
    let session_key = str_param(raw, if kind == AbortKind::Chat { "sessionKey" } else { "key" }).unwrap_or_default().to_owned();
    // sessions.abort takes a run id since protocol 4; `chat.abort` of 2026.4.x an empty one as none.
    let run_id = (kind == AbortKind::Chat || protocol >= 4).then(|| str_param(raw, "runId")).flatten().filter(|r| !r.is_empty()).map(str::to_owned);
    if kind == AbortKind::Session && session_key.is_empty() && run_id.is_none() {
        return respond(shared, conn, &req.id, Err(invalid("key required")));
    }
    let request = AbortRequest { conn, request_id: req.id.clone(), kind };
    let key = SessionKey::canonicalize(&session_key).as_str().to_owned();
    let mut st = shared.lock();
    if let Some(idx) = run_id.as_ref().and_then(|id| st.runs.get(id)).map(|r| r.record) {
        if let Some(rec) = st.records.get_mut(idx) {
            rec.abort_requests += 1;
        }
    }
    // Protocol 3 cannot abort `agent` runs (only `chat.send` ones, which this gateway lacks).
    if protocol == 3 {
        drop(st);
        return answer_abort(shared, &request, kind.nothing());
    }
    // A named run is aborted whatever session key came with it (2026.9.6 does not check it).
    let target = match &run_id {
        Some(id) => st.runs.get(id).filter(|r| r.abort_tx.is_some()).map(|_| id.clone()),
        None => st.active_run_of(&key),
    };
    let sender = target.and_then(|id| st.runs.get(&id)).and_then(|r| r.abort_tx.clone());
    drop(st);
    match sender {
        // The run task answers, between its lifecycle `end` and `error` events.
        Some(tx) => {
            if let Err(mpsc::error::SendError(request)) = tx.send(request) {
                answer_abort(shared, &request, kind.nothing());
            }
        }
        None => answer_abort(shared, &request, kind.nothing()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_resolve_by_full_name_or_unique_id() {
        let models = vec!["cogni/fake-model".to_owned(), "cogni/fake-model-b".to_owned(), "other/fake-model-b".to_owned()];
        assert_eq!(resolve_model(&models, "cogni/fake-model").as_deref(), Some("cogni/fake-model"));
        assert_eq!(resolve_model(&models, "fake-model").as_deref(), Some("cogni/fake-model"));
        assert_eq!(resolve_model(&models, "fake-model-b"), None);
        assert_eq!(resolve_model(&models, "gpt-9"), None);
    }

    #[test]
    fn subscription_methods_are_offered_only_with_session_scoped_events() {
        let scoped = ReplayConfig::default();
        assert!(scoped.session_scoped_events, "2026.9.x offers them by default");
        assert_eq!(offered_methods(&scoped), METHODS.to_vec());
        let broadcast = ReplayConfig::default().session_scoped_events(false);
        let offered = offered_methods(&broadcast);
        assert_eq!(offered.len(), METHODS.len() - 2);
        for m in [name::SESSIONS_SUBSCRIBE, name::SESSIONS_UNSUBSCRIBE] {
            assert!(!offered.contains(&m) && !offers(&broadcast, m), "{m}");
        }
        assert!(offers(&broadcast, name::AGENT) && !offers(&broadcast, "sessions.list"));
    }

    #[test]
    fn scopes_per_protocol() {
        assert_eq!(required_scope(name::SESSIONS_PATCH, 4), Some("operator.write"));
        assert_eq!(required_scope(name::SESSIONS_PATCH, 3), Some("operator.admin"));
        assert_eq!(required_scope(name::HEALTH, 4), None);
        assert_eq!(required_scope(name::CHAT_HISTORY, 4), Some("operator.read"));
        let e = missing_scope("operator.write", 4);
        assert_eq!((e.code.as_str(), e.detail_code()), ("FORBIDDEN", Some("MISSING_SCOPE")));
        let e = missing_scope("operator.admin", 3);
        assert_eq!((e.code.as_str(), e.message.as_str(), e.details.is_none()), ("INVALID_REQUEST", "missing scope: operator.admin", true));
    }
}
