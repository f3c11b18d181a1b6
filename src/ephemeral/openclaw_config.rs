//! The `openclaw.json` an ephemeral run's container gets (pure). It keeps the spec's invariants
//! 13–17 whatever the run asks: OpenClaw's own sandbox off (no Docker inside), cron off, elevated
//! tools off, and exactly one model provider in `replace` mode whose `baseUrl` is the in-container
//! bridge to the run's LLM socket, so no built-in provider (and no key) can be reached.

use serde_json::{json, Value};

/// Where the container's bridge listens: `localhost:8080` → the run's unix socket.
pub const PROVIDER_BASE_URL: &str = "http://127.0.0.1:8080/v1";
/// The one provider's name.
pub const PROVIDER: &str = "cogni";

/// The model id a run's `model` names inside the one provider: `cogni/x` and `x` are `x`.
pub fn model_id(requested: Option<&str>, default: &str) -> String {
    match requested {
        Some(m) => m.strip_prefix("cogni/").unwrap_or(m).to_owned(),
        None => default.to_owned(),
    }
}

/// The config for one run: `agent_id` is the one agent, `model` its model (see [`model_id`]),
/// `agent_timeout_sec` OpenClaw's own timeout (shorter than the container's hard limit, for a
/// clean exit with an envelope).
pub fn generate(agent_id: &str, model: &str, agent_timeout_sec: u64) -> Value {
    json!({
        "agents": {
            "defaults": {
                "model": { "primary": format!("{PROVIDER}/{model}") },
                "workspace": "/workspace",
                "sandbox": { "mode": "off" },
                "skipBootstrap": true,
                "timeoutSeconds": agent_timeout_sec,
                "heartbeat": { "every": "0m" }
            },
            "list": [ { "id": agent_id, "default": true, "workspace": "/workspace" } ]
        },
        "models": {
            "mode": "replace",
            "catalogRefresh": { "enabled": false },
            "providers": {
                PROVIDER: {
                    "baseUrl": PROVIDER_BASE_URL,
                    // The proxy replaces it with the host's key; this one opens nothing.
                    "apiKey": "clawmux-proxy-injects-the-key",
                    "api": "openai-completions",
                    "models": [ {
                        "id": model,
                        "name": model,
                        "reasoning": false,
                        "input": ["text"],
                        "cost": { "input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0 },
                        "contextWindow": 128000,
                        "maxTokens": 8192
                    } ]
                }
            }
        },
        "tools": {
            "elevated": { "enabled": false },
            "deny": ["browser", "cron", "gateway", "nodes", "sessions_send", "sessions_spawn", "message", "web_fetch", "web_search"]
        },
        "cron": { "enabled": false },
        "gateway": { "mode": "local", "controlUi": { "enabled": false } },
        "update": { "checkOnStart": false },
        "discovery": { "mdns": { "mode": "off" } }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_invariants_hold_for_any_model_and_agent() {
        for (agent, model) in [("main", "fake-model"), ("coder", "gpt-x"), ("a", "\"evil\": {}")] {
            let c = generate(agent, model, 540);
            assert_eq!(c["agents"]["defaults"]["sandbox"]["mode"], "off", "13: OPENCLAW_SANDBOX_OFF");
            assert_eq!(c["cron"]["enabled"], false, "14: OPENCLAW_CRON_DISABLED");
            assert!(c["tools"]["deny"].as_array().is_some_and(|d| d.contains(&json!("cron"))));
            assert_eq!(c["tools"]["elevated"]["enabled"], false, "15: OPENCLAW_ELEVATED_DISABLED");
            assert_eq!(c["models"]["mode"], "replace", "16: COGNI_IS_MODEL_ROUTER");
            let providers = c["models"]["providers"].as_object().expect("providers");
            assert_eq!(providers.len(), 1, "exactly one provider");
            assert_eq!(providers[PROVIDER]["baseUrl"], "http://127.0.0.1:8080/v1");
            assert_eq!(c["gateway"]["controlUi"]["enabled"], false, "17: NO_OPENCLAW_DASHBOARD");
            assert_eq!(c["agents"]["defaults"]["model"]["primary"], format!("cogni/{model}"));
            assert_eq!(c["agents"]["list"][0]["id"], agent);
            assert_eq!(c["agents"]["defaults"]["timeoutSeconds"], 540);
        }
    }

    #[test]
    fn requested_models_map_into_the_one_provider() {
        assert_eq!(model_id(Some("cogni/fake-model"), "d"), "fake-model");
        assert_eq!(model_id(Some("fake-model"), "d"), "fake-model");
        assert_eq!(model_id(None, "d"), "d");
    }
}
