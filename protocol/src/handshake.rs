//! The handshake: `connect.challenge` → `connect` → `hello-ok`.

use serde::{Deserialize, Serialize};

/// The protocols clawmux speaks; it branches on `hello-ok.protocol`.
pub const MIN_PROTOCOL: u32 = 3;
/// See [`MIN_PROTOCOL`].
pub const MAX_PROTOCOL: u32 = 4;
/// What clawmux offers first: exactly 4, as the official client package says general clients
/// must (`minProtocol: 4, maxProtocol: 4`; only node clients and probes may offer 3).
pub const PREFERRED_PROTOCOL: u32 = 4;
/// Offered, exactly, only after a gateway refused [`PREFERRED_PROTOCOL`] with a protocol mismatch
/// (2026.2.x-2026.4.x speak 3).
pub const FALLBACK_PROTOCOL: u32 = 3;
/// `client.id`: must be one of the gateway's fixed list.
pub const CLIENT_ID: &str = "gateway-client";
/// `client.mode`: must be one of the gateway's fixed list.
pub const CLIENT_MODE: &str = "backend";
/// Scopes must be asked for explicitly: without them a connection gets no events and no writes.
pub const OPERATOR_SCOPES: [&str; 3] = ["operator.read", "operator.write", "operator.admin"];
/// Capability asking for events of subscribed sessions only (protocol 4; a no-op on 3).
pub const CAP_SESSION_SCOPED_EVENTS: &str = "session-scoped-events";
/// Capability a gateway lists in `hello-ok.features.capabilities` when its `sessions.patch` takes
/// per-session `outboundHeaders` (the Cogni fork; stock OpenClaw's schema refuses the field).
/// clawmux's `auto` mode sends them only to a gateway that lists it.
pub const CAP_OUTBOUND_HEADERS: &str = "session-outbound-headers";
/// Capability asking for `agent` events of the `tool` stream: each tool call's arguments, partial
/// and final results (protocol 4). Without it the gateway still sends the `item` stream (a tool's
/// name, title and status per phase), which is all a `status` event needs.
pub const CAP_TOOL_EVENTS: &str = "tool-events";
/// Every client id the real gateway accepts (2026.9.x).
pub const KNOWN_CLIENT_IDS: [&str; 17] = [
    "webchat-ui",
    "openclaw-control-ui",
    "openclaw-browser-copilot",
    "openclaw-tui",
    "webchat",
    "cli",
    "gateway-client",
    "openclaw-macos",
    "openclaw-linux",
    "openclaw-ios",
    "openclaw-watchos",
    "openclaw-android",
    "node-host",
    "openclaw-worker",
    "test",
    "fingerprint",
    "openclaw-probe",
];
/// Every client mode the real gateway accepts.
pub const KNOWN_CLIENT_MODES: [&str; 8] = ["webchat", "cli", "ui", "backend", "node", "worker", "probe", "test"];

/// `connect.challenge` payload.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConnectChallenge {
    /// Random nonce, signed by device identities. Never logged or recorded.
    pub nonce: String,
    /// Gateway time in ms (signed by device identities; a bad value is absent, and clawmux's own
    /// clock is signed instead).
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "crate::num::lenient_u64")]
    pub ts: Option<u64>,
}

/// `client` of `connect`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientInfo {
    /// One of [`KNOWN_CLIENT_IDS`].
    pub id: String,
    /// Client version.
    pub version: String,
    /// OS, e.g. `linux`.
    pub platform: String,
    /// One of [`KNOWN_CLIENT_MODES`].
    pub mode: String,
    /// Optional display name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    /// Optional device family (part of the protocol-3 device signature).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_family: Option<String>,
}

/// `auth` of `connect`.
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectAuth {
    /// The gateway's shared token. Never logged (see the `Debug` impl).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

impl std::fmt::Debug for ConnectAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectAuth").field("token", &self.token.as_ref().map(|_| "<redacted>")).finish()
    }
}

/// `connect` params (closed schema, like the real gateway's).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConnectParams {
    /// Lowest protocol the client speaks.
    pub min_protocol: u32,
    /// Highest protocol the client speaks.
    pub max_protocol: u32,
    /// Who is connecting.
    pub client: ClientInfo,
    /// `operator` for a multiplexer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// Requested scopes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scopes: Vec<String>,
    /// Requested capabilities, e.g. [`CAP_SESSION_SCOPED_EVENTS`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub caps: Vec<String>,
    /// Shared-token auth.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<ConnectAuth>,
    /// Signed device identity (`{id, publicKey, signature, signedAt, nonce}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<serde_json::Value>,
    /// Locale (accepted by the gateway, unused here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub locale: Option<String>,
    /// User agent (accepted by the gateway, unused here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_agent: Option<String>,
}

impl ConnectParams {
    /// The params clawmux sends: exactly protocol [`PREFERRED_PROTOCOL`] (see
    /// [`ConnectParams::offering`] for the fallback), `gateway-client`/`backend`, operator scopes,
    /// session-scoped events.
    pub fn multiplexer(version: &str, token: Option<String>) -> Self {
        Self {
            min_protocol: PREFERRED_PROTOCOL,
            max_protocol: PREFERRED_PROTOCOL,
            client: ClientInfo {
                id: CLIENT_ID.to_owned(),
                version: version.to_owned(),
                platform: "linux".to_owned(),
                mode: CLIENT_MODE.to_owned(),
                display_name: None,
                device_family: None,
            },
            role: Some("operator".to_owned()),
            scopes: OPERATOR_SCOPES.iter().map(|s| (*s).to_owned()).collect(),
            caps: vec![CAP_SESSION_SCOPED_EVENTS.to_owned()],
            auth: Some(ConnectAuth { token }),
            device: None,
            locale: None,
            user_agent: None,
        }
    }

    /// The same params offering exactly `protocol`.
    pub fn offering(mut self, protocol: u32) -> Self {
        self.min_protocol = protocol;
        self.max_protocol = protocol;
        self
    }
}

/// `hello-ok`: the `connect` result.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HelloOk {
    /// Always `hello-ok`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The negotiated protocol (3 or 4).
    pub protocol: u32,
    /// Server identity.
    #[serde(default)]
    pub server: ServerInfo,
    /// Methods and events this gateway offers.
    #[serde(default)]
    pub features: Features,
    /// Granted scopes (protocol 4 only; protocol 3 has no `auth` here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<HelloAuth>,
    /// Limits and keep-alive interval.
    pub policy: Policy,
    /// The gateway's state at connect time; clawmux reads only its uptime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<Snapshot>,
}

/// `hello-ok.snapshot`: only the part clawmux uses.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    /// How long the gateway process has been up. Protocol 3 has no `server.bootId`, so this is how
    /// clawmux tells a restarted gateway process from the same one after a reconnect.
    /// A value that is not a whole number of ms is ignored, not a failed handshake.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "crate::num::lenient_u64")]
    pub uptime_ms: Option<u64>,
}

/// `hello-ok.server`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServerInfo {
    /// Gateway release, e.g. `2026.9.6`.
    #[serde(default)]
    pub version: String,
    /// This connection's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conn_id: Option<String>,
    /// Changes on every gateway process start (protocol 4): after a reconnect, a different boot id
    /// means runs in flight were lost with the old process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
}

/// `hello-ok.features`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Features {
    /// Method names.
    #[serde(default)]
    pub methods: Vec<String>,
    /// Event names.
    #[serde(default)]
    pub events: Vec<String>,
    /// What the gateway supports beyond methods and events (protocol 4), e.g.
    /// [`CAP_OUTBOUND_HEADERS`] on a gateway that takes per-session `outboundHeaders`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub capabilities: Vec<String>,
}

impl Features {
    /// True when the gateway offers `method`.
    pub fn has_method(&self, method: &str) -> bool {
        self.methods.iter().any(|m| m == method)
    }

    /// True when the gateway lists `capability` in `features.capabilities`.
    pub fn has_capability(&self, capability: &str) -> bool {
        self.capabilities.iter().any(|c| c == capability)
    }
}

/// `hello-ok.auth`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct HelloAuth {
    /// Granted scopes.
    #[serde(default)]
    pub scopes: Vec<String>,
    /// Granted role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
}

/// `hello-ok.policy`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Policy {
    /// Largest frame the gateway accepts and sends.
    pub max_payload: u64,
    /// Largest send buffer before the gateway drops a slow client.
    #[serde(default)]
    pub max_buffered_bytes: u64,
    /// Interval of `tick` events.
    pub tick_interval_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_params_serialize_as_the_gateway_expects() {
        let v = serde_json::to_value(ConnectParams::multiplexer("0.1.0", Some("t".into()))).expect("serializes");
        assert_eq!((v["minProtocol"].as_u64(), v["maxProtocol"].as_u64()), (Some(4), Some(4)), "exactly 4 first");
        let v3 = serde_json::to_value(ConnectParams::multiplexer("0.1.0", None).offering(FALLBACK_PROTOCOL)).expect("serializes");
        assert_eq!((v3["minProtocol"].as_u64(), v3["maxProtocol"].as_u64()), (Some(3), Some(3)));
        assert_eq!(v["client"]["id"], "gateway-client");
        assert_eq!(v["client"]["mode"], "backend");
        assert_eq!(v["caps"][0], "session-scoped-events");
        assert_eq!(v["scopes"].as_array().map(Vec::len), Some(3));
        assert!(!format!("{:?}", ConnectParams::multiplexer("0.1.0", Some("secret".into()))).contains("secret"));
    }

    #[test]
    fn hello_ok_v3_has_no_auth() {
        let h: HelloOk = serde_json::from_str(
            r#"{"type":"hello-ok","protocol":3,"server":{"version":"2026.4.12","connId":"c"},"features":{"methods":["agent"],"events":[]},"snapshot":{},"canvasHostUrl":"x","policy":{"maxPayload":26214400,"maxBufferedBytes":52428800,"tickIntervalMs":30000}}"#,
        )
        .expect("decodes");
        assert_eq!(h.protocol, 3);
        assert!(h.auth.is_none());
        assert!(h.features.has_method("agent"));
        assert!(!h.features.has_method("sessions.messages.subscribe"));
        assert_eq!(h.snapshot.and_then(|s| s.uptime_ms), None);
    }

    #[test]
    fn hello_ok_uptime_is_read_and_a_bad_one_ignored() {
        let base = r#"{"type":"hello-ok","protocol":3,"server":{"version":"2026.4.12"},"policy":{"maxPayload":1,"tickIntervalMs":1},"snapshot":{"presence":[],"uptimeMs":UP}}"#;
        let up = |v: &str| serde_json::from_str::<HelloOk>(&base.replace("UP", v)).expect("decodes").snapshot.and_then(|s| s.uptime_ms);
        assert_eq!(up("11893"), Some(11893));
        assert_eq!(up("-5"), None);
        assert_eq!(up("1.5"), None);
        assert_eq!(up("\"x\""), None);
        assert_eq!(up("null"), None);
    }
}
