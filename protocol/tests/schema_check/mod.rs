//! Frames checked against OpenClaw's own `protocol.schema.json` by the package's validator
//! (`tests/support/protocol-check.mjs` under Node 24). Shared by the protocol crate's tests and the
//! root crate's (replay gateway, conformance suite), which include this file by path.
//!
//! Needs `CLAWMUX_GATEWAY_PROTOCOL_DIR` and `CLAWMUX_NODE_BIN` (`eval "$(tests/support/install-gateway-protocol.sh)"`;
//! `tests/run.sh` exports both). Without them [`Checker::from_env`] says so and returns `None`,
//! unless `CLAWMUX_REQUIRE_GATEWAY_PROTOCOL=1`, when it fails.
#![allow(dead_code)]

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// The validator harness and what it needs.
pub struct Checker {
    /// Node 24.
    pub node: PathBuf,
    /// The install prefix of `@openclaw/gateway-protocol`.
    pub protocol_dir: PathBuf,
    /// The repository root (the harness and the departures list live under `tests/support/`).
    pub repo: PathBuf,
}

/// One frame's result: `{"ok","checked","unchecked","errors":[{"def","instancePath","keyword","message","params","departure"?}]}`.
pub type Outcome = Value;

impl Checker {
    /// From the environment (see the module docs); `repo` is the repository root.
    pub fn from_env(repo: PathBuf) -> Option<Self> {
        let dir = std::env::var("CLAWMUX_GATEWAY_PROTOCOL_DIR").ok().filter(|d| !d.is_empty());
        let node = std::env::var("CLAWMUX_NODE_BIN").ok().filter(|d| !d.is_empty());
        let (Some(dir), Some(node)) = (dir, node) else {
            assert!(
                std::env::var("CLAWMUX_REQUIRE_GATEWAY_PROTOCOL").as_deref() != Ok("1"),
                "CLAWMUX_REQUIRE_GATEWAY_PROTOCOL=1 but CLAWMUX_GATEWAY_PROTOCOL_DIR / CLAWMUX_NODE_BIN are not set: \
                 eval \"$(tests/support/install-gateway-protocol.sh)\""
            );
            eprintln!("@openclaw/gateway-protocol not installed (tests/support/install-gateway-protocol.sh); skipping");
            return None;
        };
        Some(Self { node: node.into(), protocol_dir: dir.into(), repo })
    }

    /// Checks frames given as `{"dir","frame","answers"?}` entries (JSON lines, as
    /// `tests/support/conformance.mjs --frames` writes them). One outcome per entry, in order.
    pub fn check_lines(&self, lines: &str) -> Vec<Outcome> {
        let mut child = Command::new(&self.node)
            .arg(self.repo.join("tests/support/protocol-check.mjs"))
            .env("CLAWMUX_GATEWAY_PROTOCOL_DIR", &self.protocol_dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.node.display()));
        // Written from another thread: the harness answers line by line, so a full stdout pipe
        // would block it while we still write.
        let mut stdin = child.stdin.take().expect("stdin");
        let input = lines.to_owned();
        let writer = std::thread::spawn(move || {
            let _ = stdin.write_all(input.as_bytes());
        });
        let out = child.wait_with_output().expect("protocol-check.mjs runs");
        let _ = writer.join();
        assert!(out.status.success(), "protocol-check.mjs failed: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8(out.stdout).expect("UTF-8");
        let results: Vec<Outcome> = text.lines().map(|l| serde_json::from_str(l).expect("a JSON result line")).collect();
        assert_eq!(results.len(), lines.lines().filter(|l| !l.trim().is_empty()).count(), "one result per frame");
        results
    }

    /// Checks frames a client sends (`req`: the frame and its method's params).
    pub fn check_client(&self, frames: &[Value]) -> Vec<Outcome> {
        self.check(frames.iter().map(|f| json!({"dir": "client", "frame": f})).collect())
    }

    /// Checks frames a server sends; `answers` names the method a `res` answers (`connect` for
    /// hello-ok).
    pub fn check_server(&self, frames: &[(Value, Option<&str>)]) -> Vec<Outcome> {
        self.check(
            frames
                .iter()
                .map(|(f, answers)| match answers {
                    Some(m) => json!({"dir": "server", "frame": f, "answers": m}),
                    None => json!({"dir": "server", "frame": f}),
                })
                .collect(),
        )
    }

    fn check(&self, entries: Vec<Value>) -> Vec<Outcome> {
        let lines: String = entries.iter().map(|e| format!("{e}\n")).collect();
        self.check_lines(&lines)
    }

    /// The listed departures (`tests/support/schema-departures.json`): id -> reason.
    pub fn departures(&self) -> BTreeMap<String, String> {
        let path = self.repo.join("tests/support/schema-departures.json");
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("departures file")).expect("departures JSON");
        doc["departures"]
            .as_array()
            .expect("departures list")
            .iter()
            .map(|d| (d["id"].as_str().expect("id").to_owned(), d["reason"].as_str().expect("reason").to_owned()))
            .collect()
    }

    /// The listed departures the real gateway shows only now and then (`"occurs": "sometimes"`):
    /// a run of the suite without them says nothing about their being gone.
    pub fn intermittent_departures(&self) -> std::collections::BTreeSet<String> {
        let path = self.repo.join("tests/support/schema-departures.json");
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("departures file")).expect("departures JSON");
        doc["departures"]
            .as_array()
            .expect("departures list")
            .iter()
            .filter(|d| d["occurs"] == "sometimes")
            .map(|d| d["id"].as_str().expect("id").to_owned())
            .collect()
    }
}

/// What a batch of outcomes says: how often each listed departure occurred, and every error that
/// is not a listed departure (as `def instancePath: message (params)` with the frame's index).
pub fn summarize(outcomes: &[Outcome]) -> (BTreeMap<String, usize>, Vec<String>) {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut unlisted = Vec::new();
    for (i, o) in outcomes.iter().enumerate() {
        for e in o["errors"].as_array().into_iter().flatten() {
            match e["departure"].as_str() {
                Some(id) => *seen.entry(id.to_owned()).or_default() += 1,
                None => unlisted.push(format!(
                    "frame {i}: {} {}: {} ({})",
                    e["def"].as_str().unwrap_or("?"),
                    e["instancePath"].as_str().unwrap_or(""),
                    e["message"].as_str().unwrap_or("?"),
                    e["params"]
                )),
            }
        }
    }
    (seen, unlisted)
}
