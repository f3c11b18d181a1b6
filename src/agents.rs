//! The agent registry behind `GET /v1/agents`.

use serde::Serialize;

/// One agent clawmux can run.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Agent {
    /// Gateway agent id.
    pub agent_id: String,
    /// Graph id (billing metadata).
    pub graph_id: String,
    /// Display name.
    pub name: String,
    /// What it does.
    pub description: String,
}

/// The registry.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentRegistry {
    /// Agents.
    pub agents: Vec<Agent>,
    /// The agent used when a request names none.
    pub default_agent_id: String,
}

impl AgentRegistry {
    /// The built-in registry: the OpenClaw gateway's `main` agent as `sandbox:openclaw`.
    pub fn builtin() -> Self {
        Self {
            agents: vec![Agent {
                agent_id: "main".to_owned(),
                graph_id: "sandbox:openclaw".to_owned(),
                name: "OpenClaw".to_owned(),
                description: "A coding agent running on the shared OpenClaw gateway".to_owned(),
            }],
            default_agent_id: "main".to_owned(),
        }
    }

    /// The agent with this id.
    pub fn get(&self, agent_id: &str) -> Option<&Agent> {
        self.agents.iter().find(|a| a.agent_id == agent_id)
    }
}
