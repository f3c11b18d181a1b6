//! The container of one ephemeral run (pure): the Docker create body, its command and labels.
//!
//! Hardening, every item on purpose: no network at all (`NetworkMode: none`: the only way out is
//! the run's LLM socket), every capability dropped, `no-new-privileges`, a read-only root
//! filesystem with tmpfs `/tmp` and `/run`, the run's workspace a tmpfs of the variant's size (the
//! agent cannot write to the host's disk: its inputs and its LLM socket are read-only binds),
//! memory (no swap) and process limits, a non-root user, no Docker socket, and an environment of
//! exactly the four variables OpenClaw needs: no key, no token, nothing of clawmux's own.

use crate::agents::EphemeralSpec;
use bollard::models::{ContainerCreateBody, HostConfig};
use std::collections::HashMap;

/// Label on every ephemeral container, valued with its owner ([`owner_of`]): what a restarted
/// clawmux with the same directory reaps (another clawmux on the engine keeps its own).
pub const LABEL_OWNER: &str = "io.clawmux.ephemeral";
/// Label with the run id (for operators and the reaper's log).
pub const LABEL_RUN: &str = "io.clawmux.run-id";
/// The run's workspace (also `HOME`): a tmpfs of the variant's `workspace_mb`, so whatever the
/// agent writes is bounded, counted against its memory limit, and gone with the container. A bind
/// of a host directory was the host's disk: one run could fill it for every tenant.
pub const WORKSPACE: &str = "/workspace";
/// Where the run's inputs (prompt and config) are mounted, read-only.
pub const INPUT_DIR: &str = "/clawmux-in";
/// Where the run's LLM socket directory is mounted, read-only (a socket on a read-only mount is
/// still connected to; nothing can be created beside it).
pub const SOCKET_DIR: &str = "/llm-sock";
/// The prompt file (the message never goes through argv or a shell).
pub const PROMPT_FILE: &str = "/clawmux-in/prompt.txt";
/// The generated config.
pub const CONFIG_FILE: &str = "/clawmux-in/openclaw.json";
/// OpenClaw's state (sessions): in the workspace, since the root filesystem is read-only.
pub const STATE_DIR: &str = "/workspace/.openclaw-state";

/// What differs between runs.
#[derive(Debug, Clone)]
pub struct Plan<'a> {
    /// The API run id (`--session-id`: one run, one session).
    pub run_id: &'a str,
    /// OpenClaw agent id (`--agent`).
    pub agent_id: &'a str,
    /// The variant's image and limits.
    pub spec: &'a EphemeralSpec,
    /// The run's inputs (prompt and config) on the host.
    pub input_host: &'a str,
    /// The directory of the run's LLM socket on the host.
    pub socket_dir_host: &'a str,
    /// `(uid, gid)` the agent runs as (never root); it owns the workspace.
    pub user: (u32, u32),
    /// The owner label's value ([`owner_of`]).
    pub owner: &'a str,
    /// OpenClaw's own timeout (seconds): below the hard limit so it can exit cleanly.
    pub agent_timeout_sec: u64,
    /// CPU limit (Docker's `NanoCpus`; `None`: none): the variant's, at most the engine's cores.
    pub nano_cpus: Option<i64>,
}

/// The environment: exactly these four variables (the image's own `ENV` holds no secret).
pub fn env() -> Vec<String> {
    vec![
        format!("HOME={WORKSPACE}"),
        format!("OPENCLAW_CONFIG_PATH={CONFIG_FILE}"),
        format!("OPENCLAW_STATE_DIR={STATE_DIR}"),
        "OPENCLAW_LOAD_SHELL_ENV=0".to_owned(),
    ]
}

/// The command (run by the image's entrypoint after it starts the socket bridge). Ids are passed
/// as `--flag=value`, so an id starting with `-` cannot become an option; the message is a file.
pub fn command(agent_id: &str, run_id: &str, agent_timeout_sec: u64) -> Vec<String> {
    vec![
        "openclaw".to_owned(),
        "agent".to_owned(),
        "--local".to_owned(),
        format!("--agent={agent_id}"),
        format!("--session-id={run_id}"),
        format!("--message-file={PROMPT_FILE}"),
        "--json".to_owned(),
        format!("--timeout={agent_timeout_sec}"),
    ]
}

/// OpenClaw's own timeout: the hard limit minus a grace for a clean exit (at least 1 s).
pub fn agent_timeout_sec(hard_limit_sec: u64) -> u64 {
    let grace = (hard_limit_sec / 10).clamp(5, 60);
    hard_limit_sec.saturating_sub(grace).max(1)
}

/// The labels of a run's container.
pub fn labels(run_id: &str, owner: &str) -> HashMap<String, String> {
    HashMap::from([(LABEL_OWNER.to_owned(), owner.to_owned()), (LABEL_RUN.to_owned(), run_id.to_owned())])
}

/// The owner label's value: the runs' directory, hashed (one clawmux per directory).
pub fn owner_of(root: &std::path::Path) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(root.as_os_str().as_encoded_bytes());
    hex::encode(&digest[..8])
}

/// A container name for the run: unique, recognisable, valid for Docker (`[a-zA-Z0-9_.-]`).
pub fn name(run_id: &str, nonce: &str) -> String {
    let id: String = run_id.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' || c == '-' { c } else { '_' }).take(64).collect();
    format!("clawmux-eph-{id}-{nonce}")
}

/// The create body.
pub fn body(p: &Plan<'_>) -> ContainerCreateBody {
    let (uid, gid) = p.user;
    let tmpfs = HashMap::from([
        ("/tmp".to_owned(), "rw,nosuid,nodev,size=256m".to_owned()),
        ("/run".to_owned(), "rw,nosuid,nodev,noexec,size=16m".to_owned()),
        // `exec`: Docker mounts a tmpfs `noexec` unless told otherwise, and an agent runs what it
        // writes in its workspace (scripts, `node_modules/.bin`, git hooks), as it could on the
        // bind this replaced. `nosuid`, `no-new-privileges` and the dropped capabilities still hold.
        (WORKSPACE.to_owned(), format!("rw,exec,nosuid,nodev,size={},uid={uid},gid={gid},mode=0700", p.spec.workspace_bytes)),
    ]);
    ContainerCreateBody {
        image: Some(p.spec.image.clone()),
        cmd: Some(command(p.agent_id, p.run_id, p.agent_timeout_sec)),
        env: Some(env()),
        user: Some(format!("{uid}:{gid}")),
        working_dir: Some(WORKSPACE.to_owned()),
        labels: Some(labels(p.run_id, p.owner)),
        network_disabled: Some(true),
        attach_stdin: Some(false),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        tty: Some(false),
        open_stdin: Some(false),
        host_config: Some(HostConfig {
            network_mode: Some("none".to_owned()),
            cap_drop: Some(vec!["ALL".to_owned()]),
            security_opt: Some(vec!["no-new-privileges:true".to_owned()]),
            readonly_rootfs: Some(true),
            privileged: Some(false),
            tmpfs: Some(tmpfs),
            binds: Some(vec![format!("{}:{INPUT_DIR}:ro", p.input_host), format!("{}:{SOCKET_DIR}:ro", p.socket_dir_host)]),
            memory: Some(p.spec.memory_bytes),
            memory_swap: Some(p.spec.memory_bytes),
            pids_limit: Some(p.spec.pids),
            nano_cpus: p.nano_cpus,
            // A PID 1 that reaps the agent's zombies and passes signals on.
            init: Some(true),
            auto_remove: Some(false),
            ipc_mode: Some("private".to_owned()),
            log_config: Some(log_config(p.spec.output_bytes)),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The engine's log of the container, which is how clawmux reads its output: `json-file`,
/// bounded. Without a bound an agent writing to stderr for its whole timeout fills the engine's
/// disk (the daemon's default keeps everything); clawmux keeps only a tail of stderr anyway. Each
/// file holds the whole allowed stdout twice over (plus room for stderr), and a rotated file is
/// kept, so a run within its limits loses nothing while clawmux follows the log.
pub fn log_config(output_bytes: usize) -> bollard::models::HostConfigLogConfig {
    let file = output_bytes.saturating_mul(2).max(16 << 20);
    bollard::models::HostConfigLogConfig {
        typ: Some("json-file".to_owned()),
        config: Some(HashMap::from([("max-size".to_owned(), file.to_string()), ("max-file".to_owned(), "2".to_owned())])),
    }
}

/// The user the agent runs as: never root. clawmux running as root uses the image's `1000:1000`
/// (and gives it the workspace); otherwise its own ids, which own the workspace already.
pub fn user_for(uid: u32, gid: u32) -> (u32, u32) {
    if uid == 0 {
        (1000, 1000)
    } else {
        (uid, gid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> EphemeralSpec {
        EphemeralSpec::defaults("clawmux-ephemeral:test")
    }

    #[test]
    fn the_container_is_hardened() {
        let spec = spec();
        let p = Plan { run_id: "r1", agent_id: "main", spec: &spec, input_host: "/var/eph/r1/in", socket_dir_host: "/var/eph/r1/sock", user: (1000, 1000), owner: "o1", agent_timeout_sec: 540, nano_cpus: spec.nano_cpus };
        let b = body(&p);
        let h = b.host_config.clone().expect("host config");
        assert_eq!(h.network_mode.as_deref(), Some("none"));
        assert_eq!(b.network_disabled, Some(true));
        assert_eq!(h.cap_drop, Some(vec!["ALL".to_owned()]));
        assert!(h.cap_add.is_none());
        assert_eq!(h.security_opt, Some(vec!["no-new-privileges:true".to_owned()]));
        assert_eq!(h.readonly_rootfs, Some(true));
        assert_eq!(h.privileged, Some(false));
        let tmpfs = h.tmpfs.expect("tmpfs");
        assert!(tmpfs.contains_key("/tmp") && tmpfs.contains_key("/run"));
        // Nothing the agent writes reaches the host's disk: the workspace is a tmpfs of the
        // variant's size (512 MiB by default), owned by the agent's user; the binds are read-only.
        assert_eq!(tmpfs.get("/workspace").map(String::as_str), Some("rw,exec,nosuid,nodev,size=536870912,uid=1000,gid=1000,mode=0700"));
        assert_eq!(h.binds, Some(vec!["/var/eph/r1/in:/clawmux-in:ro".to_owned(), "/var/eph/r1/sock:/llm-sock:ro".to_owned()]));
        assert!(!format!("{b:?}").contains("docker.sock"));
        assert_eq!(h.memory, Some(1024 * 1024 * 1024));
        assert_eq!(h.memory_swap, h.memory, "no swap beyond the limit");
        assert_eq!(h.pids_limit, Some(256));
        assert_eq!(h.nano_cpus, None, "no CPU limit unless the variant sets one");
        assert_eq!(b.user.as_deref(), Some("1000:1000"));
        assert!(h.port_bindings.is_none() && h.mounts.is_none() && h.devices.is_none());
        let env = b.env.clone().expect("env");
        let names: Vec<&str> = env.iter().filter_map(|e| e.split('=').next()).collect();
        assert_eq!(names, ["HOME", "OPENCLAW_CONFIG_PATH", "OPENCLAW_STATE_DIR", "OPENCLAW_LOAD_SHELL_ENV"]);
        assert!(env.contains(&"OPENCLAW_LOAD_SHELL_ENV=0".to_owned()));
        assert_eq!(b.labels.as_ref().and_then(|l| l.get(LABEL_OWNER)).map(String::as_str), Some("o1"));
        assert_eq!(b.labels.as_ref().and_then(|l| l.get(LABEL_RUN)).map(String::as_str), Some("r1"));
        // The engine's log of it is bounded (an agent writing stderr for its whole timeout would
        // fill the engine's disk): two files of twice the allowed stdout (4 MiB here), 16 MiB at least.
        let log = h.log_config.expect("a log config");
        assert_eq!(log.typ.as_deref(), Some("json-file"));
        let config = log.config.expect("its options");
        assert_eq!((config.get("max-size").map(String::as_str), config.get("max-file").map(String::as_str)), (Some("16777216"), Some("2")));
        assert_eq!(log_config(64 << 20).config.expect("options").get("max-size").map(String::as_str), Some("134217728"));
    }

    #[test]
    fn the_command_takes_the_message_from_a_file_and_ids_as_values() {
        let c = command("main", "-rf", 540);
        assert_eq!(
            c,
            ["openclaw", "agent", "--local", "--agent=main", "--session-id=-rf", "--message-file=/clawmux-in/prompt.txt", "--json", "--timeout=540"]
        );
    }

    #[test]
    fn limits_and_names() {
        assert_eq!(agent_timeout_sec(600), 540);
        assert_eq!(agent_timeout_sec(10), 5);
        assert_eq!(agent_timeout_sec(3), 1);
        assert_eq!(agent_timeout_sec(6000), 5940);
        assert_eq!(name("a:b/c", "x1"), "clawmux-eph-a_b_c-x1");
        assert_eq!(user_for(0, 0), (1000, 1000));
        assert_ne!(owner_of(std::path::Path::new("/a")), owner_of(std::path::Path::new("/b")));
        assert_eq!(owner_of(std::path::Path::new("/a")).len(), 16);
        assert_eq!(user_for(1234, 99), (1234, 99));
    }
}
