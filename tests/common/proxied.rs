//! What the tests of runs billed through clawmux's LLM proxy on the REAL gateway share
//! (`real_restart.rs`, `real_replicas.rs`): the env file of the gateway `tests/run.sh` started for
//! them, the fake LLM's log, the answer a run must end with, a bounded wait over every run.
#![allow(dead_code)]

use crate::child::Seen;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// The `KEY=value` lines of the env file `var` names (`tests/support/gateway.sh` writes it), and
/// a getter that fails naming the key. `None` when the variable is unset and `require` (the
/// variable tests/run.sh sets) is not `1`: the test then says so and returns.
pub fn env_file(var: &str, require: &str, what: &str) -> Option<HashMap<String, String>> {
    let Ok(path) = std::env::var(var) else {
        assert!(std::env::var(require).as_deref() != Ok("1"), "{require}=1 but {var} is not set: run tests/run.sh");
        eprintln!("{what} not started (run tests/run.sh); skipping");
        return None;
    };
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    Some(text.lines().filter_map(|l| l.split_once('=')).filter(|(_, v)| !v.is_empty()).map(|(k, v)| (k.to_owned(), v.to_owned())).collect())
}

/// `env[key]`, or a failure naming it.
pub fn get(env: &HashMap<String, String>, key: &str) -> String {
    env.get(key).cloned().unwrap_or_else(|| panic!("the gateway's env file lacks {key}"))
}

/// The fake LLM's log: only complete lines (one being written is left for the next read).
pub fn llm_log(path: &str) -> Vec<Value> {
    let bytes = std::fs::read(path).unwrap_or_default();
    let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    bytes[..complete].split(|&b| b == b'\n').filter_map(|l| serde_json::from_slice(l).ok()).collect()
}

/// The fake LLM's answer after the tool round trip (its text is deterministic): the whole
/// content of a run of `message` whose tool printed `marker`, once.
pub fn expected_content(message: &str, marker: &str, words: usize) -> String {
    let words: Vec<String> = (1..=words).map(|i| format!("w{i}")).collect();
    format!("Reply to: {message} | model=fake-model | after-tool: tool-ran-{marker} | {}", words.join(" "))
}

/// Waits (bounded) until `pred` holds for every run's stream.
pub async fn until_all(seen: &HashMap<String, Arc<Mutex<Seen>>>, within: Duration, what: &str, pred: impl Fn(&Seen) -> bool) {
    let deadline = Instant::now() + within;
    loop {
        let done = seen.values().filter(|s| pred(&s.lock().expect("seen"))).count();
        if done == seen.len() {
            return;
        }
        assert!(Instant::now() < deadline, "only {done} of {} runs {what}", seen.len());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
