//! `clawmux record`: captures real gateway runs into a cassette (`docs/cassette.md`).
//!
//! It connects the way clawmux does (protocol 4, operator scopes, `session-scoped-events`, one
//! subscription per session), so a cassette holds exactly the frames a multiplexer receives for a
//! run: the `agent` ACK, every `chat`/`agent` event of the run with its time after the request,
//! and the final `res`, plus events that arrive shortly after the final (the gateway can send a
//! last `chat` delta or a `chat` `error` after it).
//!
//! Secrets never reach the file: the gateway token and the challenge nonce are checked against
//! the written text, and the cassette parser refuses keys like `token` or `nonce` anywhere.

use crate::load::ws::{GatewayConn, WsError};
use crate::replay::{Cassette, CassetteError, Step, StepKind, Track};
use clawmux_protocol::frame::Frame;
use clawmux_protocol::methods::{name, AgentParams, SessionKeyParams, SessionsPatchParams};
use clawmux_protocol::ConnectParams;
use serde_json::Value;
use std::path::Path;
use std::time::Duration;
use tokio::time::Instant;

/// What to record.
#[derive(Debug, Clone)]
pub struct RecordConfig {
    /// `ws://` URL of the gateway.
    pub gateway: String,
    /// The gateway's shared token.
    pub token: Option<String>,
    /// One run per message, in order; each becomes a track.
    pub messages: Vec<String>,
    /// Track names (same count as `messages`), default `run1`, `run2`, ...
    pub names: Vec<String>,
    /// Model to patch onto each run's session first.
    pub model: Option<String>,
    /// Per-run timeout.
    pub timeout: Duration,
    /// How long to keep listening after the final `res` for late events of the run.
    pub linger: Duration,
    /// Free text for the header's `note`.
    pub note: Option<String>,
}

impl RecordConfig {
    /// Defaults: 300 s per run, 1.5 s linger.
    pub fn new(gateway: impl Into<String>, messages: Vec<String>) -> Self {
        Self {
            gateway: gateway.into(),
            token: None,
            messages,
            names: Vec::new(),
            model: None,
            timeout: Duration::from_secs(300),
            linger: Duration::from_millis(1500),
            note: None,
        }
    }
}

/// Why recording failed.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// Bad arguments.
    #[error("{0}")]
    Config(String),
    /// The gateway conversation failed.
    #[error(transparent)]
    Gateway(#[from] WsError),
    /// The gateway speaks another protocol than 4.
    #[error("the gateway speaks protocol {0}; recording needs protocol 4 (session-scoped events)")]
    Protocol(u32),
    /// The gateway refused a request.
    #[error("the gateway refused {method}: {message}")]
    Refused {
        /// The method.
        method: &'static str,
        /// Its error.
        message: String,
    },
    /// The recording is not a valid cassette (a bug, or a gateway sending something new).
    #[error("the recording is not a valid cassette: {0}")]
    Invalid(#[from] CassetteError),
    /// The output would contain a secret; nothing was written.
    #[error("refusing to write the cassette: it would contain the {0}")]
    Secret(&'static str),
    /// Writing the file failed.
    #[error("cannot write {path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

/// A recorded cassette and its text, already checked for secrets.
#[derive(Debug, Clone)]
pub struct Recording {
    /// The parsed cassette (what a replay gateway would load).
    pub cassette: Cassette,
    /// The JSON-lines text to write.
    pub text: String,
}

impl Recording {
    /// Writes the text to `path`.
    pub fn write(&self, path: &Path) -> Result<(), RecordError> {
        std::fs::write(path, &self.text).map_err(|source| RecordError::Io { path: path.display().to_string(), source })
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

/// Records every message as a run, one after the other, on one connection.
pub async fn record(cfg: &RecordConfig) -> Result<Recording, RecordError> {
    if cfg.messages.is_empty() {
        return Err(RecordError::Config("give at least one --message".to_owned()));
    }
    if !cfg.names.is_empty() && cfg.names.len() != cfg.messages.len() {
        return Err(RecordError::Config(format!("{} --name for {} --message: give one name per message or none", cfg.names.len(), cfg.messages.len())));
    }
    let names: Vec<String> =
        if cfg.names.is_empty() { (1..=cfg.messages.len()).map(|i| format!("run{i}")).collect() } else { cfg.names.clone() };
    if let Some(bad) = names.iter().find(|n| !valid_name(n)) {
        return Err(RecordError::Config(format!("track name {bad:?} must be 1-64 of [A-Za-z0-9_.-]")));
    }
    let mut params = ConnectParams::multiplexer(env!("CARGO_PKG_VERSION"), cfg.token.clone());
    // Everything the gateway can send about a run, tool arguments and results included: the
    // replay gateway gives `tool` stream events only to connections that ask for them too.
    params.caps.push(clawmux_protocol::handshake::CAP_TOOL_EVENTS.to_owned());
    let mut conn = GatewayConn::open(&cfg.gateway, &params).await?;
    if conn.hello.protocol != 4 {
        return Err(RecordError::Protocol(conn.hello.protocol));
    }
    let mut tracks = Vec::with_capacity(cfg.messages.len());
    for (name, message) in names.iter().zip(&cfg.messages) {
        tracks.push(record_one(&mut conn, cfg, name, message).await?);
    }
    let version = conn.hello.server.version.clone();
    let source = if version.contains('@') { version } else { format!("openclaw@{version}") };
    let cassette = Cassette {
        source,
        protocol: conn.hello.protocol,
        recorded_at: now_rfc3339(),
        note: Some(cfg.note.clone().unwrap_or_else(|| "recorded by clawmux record".to_owned())),
        tracks,
    };
    let text = cassette.to_jsonl();
    if let Some(t) = cfg.token.as_deref().filter(|t| !t.is_empty()) {
        if text.contains(t) {
            return Err(RecordError::Secret("gateway token"));
        }
    }
    if conn.leaks_nonce(&text) {
        return Err(RecordError::Secret("challenge nonce"));
    }
    conn.close().await;
    // The parser is the reference for validity (and refuses secret-named keys).
    let cassette = Cassette::parse(&text)?;
    Ok(Recording { cassette, text })
}

fn now_rfc3339() -> String {
    time::OffsetDateTime::now_utc().format(&time::format_description::well_known::Rfc3339).unwrap_or_else(|_| "1970-01-01T00:00:00Z".to_owned())
}

fn ms(t0: Instant) -> u64 {
    u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX)
}

async fn call(conn: &mut GatewayConn, method: &'static str, params: &impl serde::Serialize, deadline: Instant) -> Result<(), RecordError> {
    let id = conn.send(method, params).await?;
    let res = conn.response(&id, deadline, |_| {}).await?;
    if res.ok {
        Ok(())
    } else {
        Err(RecordError::Refused { method, message: res.error.map(|e| format!("{}: {}", e.code, e.message)).unwrap_or_default() })
    }
}

/// One run: patch → subscribe → agent → ACK, events, final (+ linger) → unsubscribe.
async fn record_one(conn: &mut GatewayConn, cfg: &RecordConfig, name: &str, message: &str) -> Result<Track, RecordError> {
    let session_key = format!("agent:main:record:{}", uuid::Uuid::new_v4());
    let run_id = uuid::Uuid::new_v4().to_string();
    let deadline = Instant::now() + cfg.timeout;
    if let Some(model) = &cfg.model {
        let p = SessionsPatchParams { key: session_key.clone(), model: Some(model.clone()), outbound_headers: None };
        call(conn, name::SESSIONS_PATCH, &p, deadline).await?;
    }
    call(conn, name::SESSIONS_SUBSCRIBE, &SessionKeyParams { key: session_key.clone() }, deadline).await?;

    let agent = AgentParams {
        message: message.to_owned(),
        agent_id: "main".to_owned(),
        session_key: session_key.clone(),
        idempotency_key: run_id.clone(),
        timeout: Some(cfg.timeout.as_secs().max(1)),
        extra_system_prompt: None,
        label: None,
    };
    let t0 = Instant::now();
    let id = conn.send(name::AGENT, &agent).await?;
    let mut ack: Option<(u64, Value)> = None;
    let mut final_step: Option<Step> = None;
    let mut steps: Vec<Step> = Vec::new();
    let mut until = deadline;
    loop {
        let r = match conn.next_until(until, "agent run").await {
            Ok(r) => r,
            // The linger after the final ran out: the run is complete.
            Err(WsError::Timeout(_)) if final_step.is_some() => break,
            Err(e) => return Err(e.into()),
        };
        let t = ms(t0);
        match r.frame {
            Ok(Frame::Res(res)) if res.id == id => {
                if !res.ok {
                    return Err(RecordError::Refused { method: name::AGENT, message: res.error.map(|e| e.message).unwrap_or_default() });
                }
                let payload: Value = res.payload.and_then(|p| serde_json::from_str(p.get()).ok()).unwrap_or(Value::Null);
                let accepted = payload.get("status").and_then(Value::as_str) == Some("accepted");
                if accepted && ack.is_none() {
                    ack = Some((t, payload));
                } else if final_step.is_none() {
                    final_step = Some(Step { t_ms: t, kind: StepKind::Final { payload } });
                    steps.push(Step { t_ms: t, kind: StepKind::Final { payload: Value::Null } });
                    until = Instant::now() + cfg.linger;
                }
            }
            Ok(Frame::Event(_)) => {
                let Ok(v) = serde_json::from_str::<Value>(&r.text) else { continue };
                let event = v.get("event").and_then(Value::as_str).unwrap_or_default();
                if event != "chat" && event != "agent" {
                    continue;
                }
                let Some(payload) = v.get("payload") else { continue };
                let ours = payload.get("runId").and_then(Value::as_str) == Some(run_id.as_str())
                    && payload.get("sessionKey").and_then(Value::as_str).is_none_or(|k| k == session_key);
                if ours {
                    steps.push(Step { t_ms: t, kind: StepKind::Event { name: event.to_owned(), payload: payload.clone() } });
                }
            }
            _ => {}
        }
    }
    call(conn, name::SESSIONS_UNSUBSCRIBE, &SessionKeyParams { key: session_key.clone() }, Instant::now() + Duration::from_secs(10)).await?;

    let (ack_t_ms, ack) = ack.ok_or_else(|| RecordError::Refused { method: name::AGENT, message: "no ACK before the final res".to_owned() })?;
    let Some(final_step) = final_step else {
        return Err(RecordError::Refused { method: name::AGENT, message: "no final res".to_owned() });
    };
    // The final goes where it arrived among the events (its placeholder); nothing goes before the
    // ACK in a cassette, so an event that raced ahead of the ACK is moved to the ACK's time.
    let steps: Vec<Step> = steps
        .into_iter()
        .map(|s| match s.kind {
            StepKind::Final { .. } => final_step.clone(),
            kind => Step { t_ms: s.t_ms.max(ack_t_ms), kind },
        })
        .collect();
    let model = cfg.model.clone().unwrap_or_else(|| model_of(&steps));
    let session_id = steps.iter().find_map(|s| match &s.kind {
        StepKind::Event { payload, .. } => payload.get("sessionId").and_then(Value::as_str).map(str::to_owned),
        StepKind::Final { .. } => None,
    });
    Ok(Track {
        name: name.to_owned(),
        message: message.to_owned(),
        model,
        session_key,
        run_id,
        session_id,
        ack_t_ms,
        ack,
        steps,
    })
}

/// `provider/model` from the lifecycle `model` event, when the gateway named one.
fn model_of(steps: &[Step]) -> String {
    steps
        .iter()
        .find_map(|s| match &s.kind {
            StepKind::Event { name, payload } if name == "agent" => {
                let d = payload.get("data")?;
                if d.get("phase").and_then(Value::as_str) != Some("model") {
                    return None;
                }
                Some(format!("{}/{}", d.get("provider")?.as_str()?, d.get("model")?.as_str()?))
            }
            _ => None,
        })
        .unwrap_or_else(|| "unknown/unknown".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn model_comes_from_the_lifecycle_model_event() {
        let ev = |data: Value| Step { t_ms: 1, kind: StepKind::Event { name: "agent".into(), payload: json!({"stream":"lifecycle","data":data}) } };
        let steps = [ev(json!({"phase":"start"})), ev(json!({"phase":"model","provider":"cogni","model":"fake-model"}))];
        assert_eq!(model_of(&steps), "cogni/fake-model");
        assert_eq!(model_of(&[ev(json!({"phase":"model","provider":null,"model":null}))]), "unknown/unknown");
    }

    #[tokio::test]
    async fn bad_arguments_are_refused_before_connecting() {
        let mut c = RecordConfig::new("ws://127.0.0.1:1", vec![]);
        assert!(matches!(record(&c).await, Err(RecordError::Config(_))));
        c.messages = vec!["a".into()];
        c.names = vec!["x".into(), "y".into()];
        assert!(matches!(record(&c).await, Err(RecordError::Config(_))));
        c.names = vec!["bad name".into()];
        assert!(matches!(record(&c).await, Err(RecordError::Config(_))));
    }
}
