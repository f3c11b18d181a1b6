//! The agent variant registry behind `GET /v1/agents`: each variant is a `graphId` that a run
//! names, how it runs (`gateway`: on the shared OpenClaw gateway; `ephemeral`: in its own one-shot
//! container) and, for ephemeral variants, the image and the limits.
//!
//! It comes from `CLAWMUX_AGENTS_FILE` (TOML, checked strictly at start: a typo must not silently
//! run an agent without its limits) or, without one, the built-in default: `sandbox:openclaw` on
//! the gateway, plus `sandbox:openclaw-ephemeral` when `CLAWMUX_EPHEMERAL_IMAGE` names an image.

use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::time::Duration;

/// The graph id of the built-in gateway variant (and a request's default).
pub const DEFAULT_GRAPH_ID: &str = "sandbox:openclaw";
/// The graph id of the built-in ephemeral variant.
pub const EPHEMERAL_GRAPH_ID: &str = "sandbox:openclaw-ephemeral";

/// How a variant's runs execute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// On the shared, long-running OpenClaw gateway (one connection, many sessions).
    Gateway,
    /// One fresh container per run (`openclaw agent --local`), no network, destroyed after.
    Ephemeral,
}

impl Mode {
    /// The API's and the file's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Gateway => "gateway",
            Mode::Ephemeral => "ephemeral",
        }
    }
}

/// What an ephemeral variant's container gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EphemeralSpec {
    /// The image (OpenClaw CLI + the socket bridge).
    pub image: String,
    /// Hard limit of a run: the container is killed at it (queue wait counts).
    pub timeout: Duration,
    /// Memory limit: an agent that runs away is OOM-killed, not the host.
    pub memory_bytes: i64,
    /// Process limit: a fork bomb stays in its container.
    pub pids: i64,
    /// Largest stdout (the JSON envelope) read; more fails the run instead of filling memory.
    pub output_bytes: usize,
    /// Size of the workspace (a tmpfs: what the agent writes counts against `memory_bytes` too, so
    /// at most half of it).
    pub workspace_bytes: u64,
    /// CPU limit in billionths of a CPU (Docker's `NanoCpus`; `None`: none): one tenant's agent
    /// spinning on every core slows every other run on the host, other tenants' containers and
    /// clawmux. Not set by default (README: what a limit costs OpenClaw's cold start could not be
    /// told apart from the test machine's own variance).
    pub nano_cpus: Option<i64>,
}

impl EphemeralSpec {
    /// The spec's limits for an image: 600 s, 1024 MB, 256 processes, 4 MiB of output, a 512 MB
    /// workspace, no CPU limit.
    pub fn defaults(image: &str) -> Self {
        Self {
            image: image.to_owned(),
            timeout: Duration::from_secs(600),
            memory_bytes: 1024 * 1024 * 1024,
            pids: 256,
            output_bytes: 4 * 1024 * 1024,
            workspace_bytes: 512 * 1024 * 1024,
            nano_cpus: None,
        }
    }
}



/// One agent variant a run can name.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Agent {
    /// OpenClaw agent id (the gateway's agent, or `--agent` of an ephemeral run).
    pub agent_id: String,
    /// Graph id: what a run names to pick this variant (and billing metadata).
    pub graph_id: String,
    /// Display name.
    pub name: String,
    /// What it does.
    pub description: String,
    /// How its runs execute: callers choose between isolation and start-up latency.
    pub mode: Mode,
    /// Image and limits of an ephemeral variant (host-side details: not shown to callers).
    #[serde(skip)]
    #[schema(ignore)]
    pub ephemeral: Option<EphemeralSpec>,
}

/// The registry.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentRegistry {
    /// Agents.
    pub agents: Vec<Agent>,
    /// The agent used when a request names none.
    pub default_agent_id: String,
    /// The variant used when a request names no `graphId`.
    pub default_graph_id: String,
}

/// The agents file as written (TOML).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AgentsFile {
    /// The variant a request without `graphId` gets (default: the first).
    default: Option<String>,
    /// The variants.
    #[serde(default)]
    agent: Vec<AgentEntry>,
}

/// One `[[agent]]` table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AgentEntry {
    graph_id: String,
    mode: Mode,
    #[serde(default = "main")]
    agent_id: String,
    name: Option<String>,
    description: Option<String>,
    image: Option<String>,
    timeout_sec: Option<u64>,
    memory_mb: Option<u64>,
    pids: Option<u64>,
    output_bytes: Option<u64>,
    workspace_mb: Option<u64>,
    cpus: Option<f64>,
}

fn main() -> String {
    "main".to_owned()
}

fn is_valid_id(s: &str) -> bool {
    (1..=128).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b))
}

/// Docker image references: no whitespace or control characters, and bounded.
fn is_valid_image(s: &str) -> bool {
    (1..=255).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_graphic()) && !s.starts_with('-')
}

impl AgentRegistry {
    /// The built-in registry: `sandbox:openclaw` on the gateway's `main` agent.
    pub fn builtin() -> Self {
        Self::from_agents(vec![gateway_default()], None).unwrap_or_else(|_| unreachable_default())
    }

    /// The built-in registry, plus `sandbox:openclaw-ephemeral` on `ephemeral_image` if given.
    pub fn default_with(ephemeral_image: Option<&str>) -> Result<Self, String> {
        let mut agents = vec![gateway_default()];
        if let Some(image) = ephemeral_image {
            if !is_valid_image(image) {
                return Err(format!("CLAWMUX_EPHEMERAL_IMAGE: {image:?} is not an image reference"));
            }
            agents.push(Agent {
                agent_id: "main".to_owned(),
                graph_id: EPHEMERAL_GRAPH_ID.to_owned(),
                name: "OpenClaw (ephemeral)".to_owned(),
                description: "A coding agent in its own one-shot, network-less container".to_owned(),
                mode: Mode::Ephemeral,
                ephemeral: Some(EphemeralSpec::defaults(image)),
            });
        }
        Self::from_agents(agents, None)
    }

    /// The registry the environment configures: `CLAWMUX_AGENTS_FILE`, else the default.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Self, String> {
        let image = env("CLAWMUX_EPHEMERAL_IMAGE").filter(|s| !s.is_empty());
        match env("CLAWMUX_AGENTS_FILE").filter(|s| !s.is_empty()) {
            Some(path) => {
                let text = std::fs::read_to_string(&path).map_err(|e| format!("CLAWMUX_AGENTS_FILE {path}: {e}"))?;
                Self::parse(&text, image.as_deref()).map_err(|e| format!("CLAWMUX_AGENTS_FILE {path}: {e}"))
            }
            None => Self::default_with(image.as_deref()),
        }
    }

    /// Parses an agents file. An ephemeral variant without `image` takes `fallback_image`
    /// (`CLAWMUX_EPHEMERAL_IMAGE`).
    pub fn parse(text: &str, fallback_image: Option<&str>) -> Result<Self, String> {
        let file: AgentsFile = toml::from_str(text).map_err(|e| e.to_string())?;
        let mut agents = Vec::with_capacity(file.agent.len());
        for (i, e) in file.agent.into_iter().enumerate() {
            let at = format!("agent[{i}] ({:?})", e.graph_id);
            let positive = |name: &str, v: Option<u64>| -> Result<Option<u64>, String> {
                match v {
                    Some(0) => Err(format!("{at}: `{name}` must be at least 1")),
                    v => Ok(v),
                }
            };
            let (timeout, memory, pids, output) =
                (positive("timeout_sec", e.timeout_sec)?, positive("memory_mb", e.memory_mb)?, positive("pids", e.pids)?, positive("output_bytes", e.output_bytes)?);
            let workspace = positive("workspace_mb", e.workspace_mb)?;
            let ephemeral = match e.mode {
                Mode::Gateway => {
                    if e.image.is_some() || timeout.is_some() || memory.is_some() || pids.is_some() || output.is_some() || workspace.is_some() || e.cpus.is_some() {
                        return Err(format!("{at}: image and limits apply to ephemeral variants only (the gateway has its own)"));
                    }
                    None
                }
                Mode::Ephemeral => {
                    let image = e.image.as_deref().or(fallback_image).ok_or_else(|| {
                        format!("{at}: an ephemeral variant needs `image` (or CLAWMUX_EPHEMERAL_IMAGE)")
                    })?;
                    if !is_valid_image(image) {
                        return Err(format!("{at}: `image` {image:?} is not an image reference"));
                    }
                    let mut s = EphemeralSpec::defaults(image);
                    if let Some(t) = timeout {
                        if t > 86_400 {
                            return Err(format!("{at}: `timeout_sec` must be at most 86400"));
                        }
                        s.timeout = Duration::from_secs(t);
                    }
                    if let Some(m) = memory {
                        if !(64..=1024 * 1024).contains(&m) {
                            return Err(format!("{at}: `memory_mb` must be 64 to 1048576"));
                        }
                        s.memory_bytes = i64::try_from(m * 1024 * 1024).map_err(|_| format!("{at}: `memory_mb` too large"))?;
                    }
                    if let Some(c) = e.cpus {
                        // Docker's own bounds are the host's cores; 0.1 is the least that runs a
                        // Node start-up in reasonable time.
                        if !(c.is_finite() && (0.1..=1024.0).contains(&c)) {
                            return Err(format!("{at}: `cpus` must be 0.1 to 1024"));
                        }
                        s.nano_cpus = Some((c * 1e9).round() as i64);
                    }
                    if let Some(p) = pids {
                        if !(16..=65_536).contains(&p) {
                            return Err(format!("{at}: `pids` must be 16 to 65536"));
                        }
                        s.pids = p as i64;
                    }
                    if let Some(o) = output {
                        if o > 64 * 1024 * 1024 {
                            return Err(format!("{at}: `output_bytes` must be at most 67108864"));
                        }
                        s.output_bytes = o as usize;
                    }
                    // The workspace is a tmpfs: what the agent writes there is memory of its
                    // container, so at most half of `memory_mb` (the rest is the agent's and
                    // `/tmp`'s); a workspace larger than what memory has left would end a run
                    // that fills it killed for memory instead of with a full disk.
                    let half = s.memory_bytes as u64 / 2;
                    match workspace {
                        // Compared in MB: the file's number is not multiplied before it is bounded.
                        Some(w) if w < 16 || w > half / (1024 * 1024) => {
                            return Err(format!("{at}: `workspace_mb` must be 16 to half of `memory_mb` ({})", half / (1024 * 1024)));
                        }
                        Some(w) => s.workspace_bytes = w * 1024 * 1024,
                        None => s.workspace_bytes = s.workspace_bytes.min(half),
                    }
                    Some(s)
                }
            };
            agents.push(Agent {
                name: e.name.unwrap_or_else(|| e.graph_id.clone()),
                description: e.description.unwrap_or_default(),
                agent_id: e.agent_id,
                graph_id: e.graph_id,
                mode: e.mode,
                ephemeral,
            });
        }
        Self::from_agents(agents, file.default)
    }

    fn from_agents(agents: Vec<Agent>, default: Option<String>) -> Result<Self, String> {
        let first = agents.first().ok_or("no `[[agent]]`: at least one variant is needed")?;
        let mut seen = HashSet::new();
        for a in &agents {
            if !is_valid_id(&a.graph_id) {
                return Err(format!("graph id {:?} must match [A-Za-z0-9._:-]{{1,128}}", a.graph_id));
            }
            if !is_valid_id(&a.agent_id) {
                return Err(format!("agent {:?}: agent id {:?} must match [A-Za-z0-9._:-]{{1,128}}", a.graph_id, a.agent_id));
            }
            if !seen.insert(a.graph_id.as_str()) {
                return Err(format!("graph id {:?} is listed twice", a.graph_id));
            }
        }
        let default_graph_id = match default {
            Some(d) if !seen.contains(d.as_str()) => return Err(format!("`default` {d:?} is not a listed graph id")),
            Some(d) => d,
            None => first.graph_id.clone(),
        };
        let default_agent_id = agents.iter().find(|a| a.graph_id == default_graph_id).map_or_else(|| first.agent_id.clone(), |a| a.agent_id.clone());
        Ok(Self { agents, default_agent_id, default_graph_id })
    }

    /// Some variant runs on this OpenClaw agent id.
    pub fn get(&self, agent_id: &str) -> Option<&Agent> {
        self.agents.iter().find(|a| a.agent_id == agent_id)
    }

    /// The variant of this graph id.
    pub fn variant(&self, graph_id: &str) -> Option<&Agent> {
        self.agents.iter().find(|a| a.graph_id == graph_id)
    }

    /// Whether some variant runs in ephemeral containers (then Docker must be reachable).
    pub fn has_ephemeral(&self) -> bool {
        self.agents.iter().any(|a| a.mode == Mode::Ephemeral)
    }

    /// The distinct agent ids (metrics labels).
    pub fn agent_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = Vec::new();
        for a in &self.agents {
            if !ids.contains(&a.agent_id) {
                ids.push(a.agent_id.clone());
            }
        }
        ids
    }
}

fn gateway_default() -> Agent {
    Agent {
        agent_id: "main".to_owned(),
        graph_id: DEFAULT_GRAPH_ID.to_owned(),
        name: "OpenClaw".to_owned(),
        description: "A coding agent running on the shared OpenClaw gateway".to_owned(),
        mode: Mode::Gateway,
        ephemeral: None,
    }
}

// The built-in list is valid by construction; this keeps `builtin` infallible without a panic path.
fn unreachable_default() -> AgentRegistry {
    AgentRegistry { agents: vec![gateway_default()], default_agent_id: "main".to_owned(), default_graph_id: DEFAULT_GRAPH_ID.to_owned() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_has_the_ephemeral_variant_only_with_an_image() {
        let r = AgentRegistry::default_with(None).expect("default");
        assert_eq!(r.agents.len(), 1);
        assert_eq!(r.default_graph_id, DEFAULT_GRAPH_ID);
        assert!(!r.has_ephemeral());
        let r = AgentRegistry::default_with(Some("clawmux-ephemeral:1")).expect("default");
        let e = r.variant(EPHEMERAL_GRAPH_ID).expect("ephemeral variant");
        assert_eq!(e.mode, Mode::Ephemeral);
        let spec = e.ephemeral.as_ref().expect("spec");
        assert_eq!(spec.timeout, Duration::from_secs(600));
        assert_eq!(spec.memory_bytes, 1024 * 1024 * 1024);
        assert_eq!(r.default_graph_id, DEFAULT_GRAPH_ID, "a request without graphId still runs on the gateway");
        assert_eq!(r.agent_ids(), ["main"]);
    }

    #[test]
    fn a_file_sets_variants_limits_and_default() {
        let r = AgentRegistry::parse(
            r#"
default = "eph"
[[agent]]
graph_id = "gw"
mode = "gateway"
[[agent]]
graph_id = "eph"
mode = "ephemeral"
agent_id = "coder"
image = "img:1"
timeout_sec = 30
memory_mb = 256
pids = 64
output_bytes = 1000
workspace_mb = 64
cpus = 1.5
"#,
            None,
        )
        .expect("valid");
        assert_eq!(r.default_graph_id, "eph");
        assert_eq!(r.default_agent_id, "coder");
        let s = r.variant("eph").and_then(|a| a.ephemeral.clone()).expect("spec");
        assert_eq!(s, EphemeralSpec { image: "img:1".into(), timeout: Duration::from_secs(30), memory_bytes: 256 << 20, pids: 64, output_bytes: 1000, workspace_bytes: 64 << 20, nano_cpus: Some(1_500_000_000) });
        assert!(r.variant("gw").is_some_and(|a| a.ephemeral.is_none()));
    }

    #[test]
    fn the_default_workspace_is_at_most_half_the_memory() {
        let spec = |extra: &str| {
            let text = format!("[[agent]]\ngraph_id = \"e\"\nmode = \"ephemeral\"\nimage = \"img:1\"\n{extra}");
            AgentRegistry::parse(&text, None).expect("valid").variant("e").and_then(|a| a.ephemeral.clone()).expect("spec")
        };
        assert_eq!(spec("").workspace_bytes, 512 << 20);
        assert_eq!(spec("memory_mb = 256").workspace_bytes, 128 << 20);
        assert_eq!(spec("memory_mb = 4096").workspace_bytes, 512 << 20);
        assert_eq!(spec("memory_mb = 4096\nworkspace_mb = 2048").workspace_bytes, 2048 << 20);
    }

    #[test]
    fn bad_files_are_refused_with_the_reason() {
        let cases = [
            ("", "at least one variant"),
            ("[[agent]]\ngraph_id = \"a\"\nmode = \"gateway\"\ntimout_sec = 3", "unknown field"),
            ("[[agent]]\ngraph_id = \"a\"\nmode = \"docker\"", "unknown variant"),
            ("[[agent]]\ngraph_id = \"a\"\nmode = \"ephemeral\"", "needs `image`"),
            ("[[agent]]\ngraph_id = \"a\"\nmode = \"gateway\"\nimage = \"x\"", "ephemeral variants only"),
            ("[[agent]]\ngraph_id = \"a\"\nmode = \"ephemeral\"\nimage = \"x\"\ntimeout_sec = 0", "at least 1"),
            ("[[agent]]\ngraph_id = \"a\"\nmode = \"ephemeral\"\nimage = \"x\"\nmemory_mb = 1", "64 to"),
            ("[[agent]]\ngraph_id = \"a\"\nmode = \"ephemeral\"\nimage = \"x\"\nworkspace_mb = 8", "16 to"),
            ("[[agent]]\ngraph_id = \"a\"\nmode = \"ephemeral\"\nimage = \"x\"\nmemory_mb = 256\nworkspace_mb = 129", "half of `memory_mb` (128)"),
            ("[[agent]]\ngraph_id = \"a\"\nmode = \"ephemeral\"\nimage = \"x\"\nworkspace_mb = 513", "half of `memory_mb` (512)"),
            // Large enough to wrap when multiplied into bytes.
            ("[[agent]]\ngraph_id = \"a\"\nmode = \"ephemeral\"\nimage = \"x\"\nworkspace_mb = 17592186044417", "half of `memory_mb` (512)"),
            ("[[agent]]\ngraph_id = \"a\"\nmode = \"gateway\"\nworkspace_mb = 64", "ephemeral variants only"),
            ("[[agent]]\ngraph_id = \"a\"\nmode = \"gateway\"\ncpus = 2", "ephemeral variants only"),
            ("[[agent]]\ngraph_id = \"a\"\nmode = \"ephemeral\"\nimage = \"x\"\ncpus = 0", "0.1 to 1024"),
            ("[[agent]]\ngraph_id = \"a\"\nmode = \"ephemeral\"\nimage = \"x\"\ncpus = -1.0", "0.1 to 1024"),
            ("[[agent]]\ngraph_id = \"a\"\nmode = \"ephemeral\"\nimage = \"x\"\ncpus = nan", "0.1 to 1024"),
            ("[[agent]]\ngraph_id = \"a\"\nmode = \"ephemeral\"\nimage = \"x\"\ncpus = 1e300", "0.1 to 1024"),
            ("[[agent]]\ngraph_id = \"a\"\nmode = \"ephemeral\"\nimage = \"x y\"", "not an image"),
            ("[[agent]]\ngraph_id = \"a b\"\nmode = \"gateway\"", "must match"),
            ("[[agent]]\ngraph_id = \"a\"\nmode = \"gateway\"\n[[agent]]\ngraph_id = \"a\"\nmode = \"gateway\"", "twice"),
            ("default = \"b\"\n[[agent]]\ngraph_id = \"a\"\nmode = \"gateway\"", "not a listed graph id"),
        ];
        for (text, want) in cases {
            let err = AgentRegistry::parse(text, None).expect_err(text);
            assert!(err.contains(want), "{text:?}: {err}");
        }
        assert!(AgentRegistry::parse("[[agent]]\ngraph_id = \"a\"\nmode = \"ephemeral\"", Some("img")).is_ok(), "the env image fills in");
    }

    #[test]
    fn the_api_shows_mode_but_not_the_image() {
        let r = AgentRegistry::default_with(Some("registry.internal/secret-image:1")).expect("default");
        let v = serde_json::to_value(&r).expect("json");
        assert_eq!(v["agents"][1]["mode"], "ephemeral");
        assert_eq!(v["defaultGraphId"], DEFAULT_GRAPH_ID);
        assert!(!v.to_string().contains("secret-image"));
    }
}
