//! The official-client conformance suite (`tests/support/conformance.mjs`, driving gateways with
//! OpenClaw's reference client `@openclaw/gateway-client`) run against the REAL gateway and against
//! `clawmux replay-gateway`, row by row: the replay gateway must answer, refuse, close, time out and
//! order events like the real one on every row. Every frame both gateways sent is also checked
//! against OpenClaw's own `protocol.schema.json` (protocol 4): the real gateway's departures from
//! it must be exactly the listed ones (`tests/support/schema-departures.json`, each with its
//! reason), the replay gateway may show no other. `docs/conformance.md` lists the rows.
//!
//! `tests/run.sh` runs `live_conformance_` with `CLAWMUX_CONFORMANCE_GATEWAY_ENV=<run dir>/env`
//! (a gateway of `tests/support/gateway.sh`: v4 = openclaw 2026.9.6, v3 = 2026.4.12) and the
//! protocol packages installed (`CLAWMUX_GATEWAY_PROTOCOL_DIR`, `CLAWMUX_NODE_BIN`). Without the
//! gateway the test says so and returns, unless `CLAWMUX_REQUIRE_CONFORMANCE=1`, when it fails.
//! The comparison itself is pure and tested here too (`comparison_`, phase 1).

#[path = "../protocol/tests/schema_check/mod.rs"]
mod schema_check;

use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A time the gateway decides (`...Ms`) may differ by this much, or by a quarter of the larger.
const TOLERANCE_MS: f64 = 1000.0;

/// Differences between two rows' observations (`path: real != replay`). Keys ending in `Ms` with
/// numbers on both sides are times: equal within [`TOLERANCE_MS`] or 25 %.
fn diff(real: &Value, replay: &Value, path: &str, out: &mut Vec<String>) {
    match (real, replay) {
        (Value::Object(a), Value::Object(b)) => {
            let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
            keys.sort_unstable();
            keys.dedup();
            for k in keys {
                let here = format!("{path}/{k}");
                match (a.get(k), b.get(k)) {
                    (Some(x), Some(y)) if k.ends_with("Ms") && x.is_number() && y.is_number() => {
                        let (x, y) = (x.as_f64().unwrap_or(0.0), y.as_f64().unwrap_or(0.0));
                        if (x - y).abs() > TOLERANCE_MS.max(0.25 * x.abs().max(y.abs())) {
                            out.push(format!("{here}: real {x} ms, replay {y} ms"));
                        }
                    }
                    (Some(x), Some(y)) => diff(x, y, &here, out),
                    (x, y) => out.push(format!("{here}: real {}, replay {}", show(x), show(y))),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                diff(x, y, &format!("{path}/{i}"), out);
            }
        }
        (x, y) if x != y => out.push(format!("{path}: real {x}, replay {y}")),
        _ => {}
    }
}

fn show(v: Option<&Value>) -> String {
    v.map_or_else(|| "(absent)".to_owned(), Value::to_string)
}

/// Rows of both runs compared: the same rows, in the same order, each observed alike.
fn compare(real: &[(String, Value)], replay: &[(String, Value)]) -> Vec<String> {
    let mut out = Vec::new();
    let names = |rows: &[(String, Value)]| rows.iter().map(|(r, _)| r.clone()).collect::<Vec<_>>();
    if names(real) != names(replay) {
        out.push(format!("rows differ: real {:?}, replay {:?}", names(real), names(replay)));
        return out;
    }
    for ((row, a), (_, b)) in real.iter().zip(replay) {
        if a.get("suiteError").is_some() || b.get("suiteError").is_some() {
            out.push(format!("{row}: the suite failed: real {a}, replay {b}"));
            continue;
        }
        diff(a, b, row, &mut out);
    }
    out
}

fn parse_rows(text: &str) -> Vec<(String, Value)> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("a row is not JSON ({e}): {l}"));
            (v["row"].as_str().expect("row id").to_owned(), v["observed"].clone())
        })
        .collect()
}

#[test]
fn comparison_allows_time_tolerance_and_nothing_else() {
    let v = |s: &str| serde_json::from_str::<Value>(s).unwrap_or(Value::Null);
    let mut out = Vec::new();
    diff(&v(r#"{"afterMs":15012,"close":{"code":1000}}"#), &v(r#"{"afterMs":15400,"close":{"code":1000}}"#), "r", &mut out);
    assert!(out.is_empty(), "{out:?}");
    diff(&v(r#"{"afterMs":15012}"#), &v(r#"{"afterMs":10011}"#), "r", &mut out);
    assert_eq!(out, ["r/afterMs: real 15012 ms, replay 10011 ms"]);
    out.clear();
    // Small times get the absolute tolerance, not 25 % of almost nothing.
    diff(&v(r#"{"elapsedMs":3}"#), &v(r#"{"elapsedMs":900}"#), "r", &mut out);
    assert!(out.is_empty(), "{out:?}");
    // Anything else must be equal: values, key sets, array lengths and order.
    diff(&v(r#"{"a":{"b":[1,2]},"c":"x"}"#), &v(r#"{"a":{"b":[2,1]},"d":"x"}"#), "r", &mut out);
    assert_eq!(out, ["r/a/b/0: real 1, replay 2", "r/a/b/1: real 2, replay 1", "r/c: real \"x\", replay (absent)", "r/d: real (absent), replay \"x\""]);
    out.clear();
    diff(&v(r#"{"order":["ack","final"]}"#), &v(r#"{"order":["ack","chat:final","final"]}"#), "r", &mut out);
    assert_eq!(out.len(), 1, "{out:?}");
    // A timing key with a non-number on one side is compared as a value.
    out.clear();
    diff(&v(r#"{"afterMs":"open"}"#), &v(r#"{"afterMs":10}"#), "r", &mut out);
    assert_eq!(out.len(), 1);
}

#[test]
fn comparison_needs_the_same_rows_and_no_suite_error() {
    let rows = |s: &str| parse_rows(s);
    let a = rows("{\"row\":\"x\",\"observed\":{\"ok\":true}}\n{\"row\":\"y\",\"observed\":1}\n");
    assert!(compare(&a, &a).is_empty());
    let missing = rows("{\"row\":\"x\",\"observed\":{\"ok\":true}}\n");
    assert_eq!(compare(&a, &missing).len(), 1);
    let broken = rows("{\"row\":\"x\",\"observed\":{\"suiteError\":\"TypeError\"}}\n{\"row\":\"y\",\"observed\":1}\n");
    assert!(compare(&broken, &broken)[0].contains("the suite failed"));
}

// ------------------------------------------------------------------ live

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The real gateway under test, from `RUN_DIR/env` of `tests/support/gateway.sh`.
struct Gateway {
    url: String,
    token: String,
    /// `v4` or `v3`.
    flavor: String,
}

fn gateway() -> Option<Gateway> {
    let Ok(path) = std::env::var("CLAWMUX_CONFORMANCE_GATEWAY_ENV") else {
        assert!(
            std::env::var("CLAWMUX_REQUIRE_CONFORMANCE").as_deref() != Ok("1"),
            "CLAWMUX_REQUIRE_CONFORMANCE=1 but CLAWMUX_CONFORMANCE_GATEWAY_ENV is not set: run tests/run.sh"
        );
        eprintln!("real gateway not started (run tests/run.sh); skipping");
        return None;
    };
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    let env: HashMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
    let get = |k: &str| env.get(k).unwrap_or_else(|| panic!("{path} lacks {k}")).to_string();
    Some(Gateway { url: get("GATEWAY_URL"), token: get("GATEWAY_TOKEN"), flavor: env.get("GATEWAY_FLAVOR").unwrap_or(&"v4").to_string() })
}

/// `clawmux replay-gateway` as a child process, killed when dropped.
struct Replay {
    child: Child,
    url: String,
}

impl Replay {
    fn start(token: &str, protocol: u32, cassette: &Path) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_clawmux"))
            .args(["replay-gateway", "--listen", "127.0.0.1:0", "--protocol", &protocol.to_string(), "--cassette"])
            .arg(cassette)
            .env("CLAWMUX_REPLAY_TOKEN", token)
            .env("CLAWMUX_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("clawmux replay-gateway starts");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(i) = line.find("ws://") {
                    let _ = tx.send(line[i..].trim().to_owned());
                }
            }
        });
        let url = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| {
            let _ = child.kill();
            panic!("clawmux replay-gateway did not say where it listens within 60 s")
        });
        Self { child, url }
    }
}

impl Drop for Replay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the suite against `url`; returns its rows and the frames file.
fn run_suite(checker: &schema_check::Checker, url: &str, token: &str, protocol: u32, frames: &Path) -> Vec<(String, Value)> {
    // `timeout` bounds the whole run (the suite's own waits are bounded too).
    let out = Command::new("timeout")
        .args(["--foreground", "300"])
        .arg(&checker.node)
        .arg(repo().join("tests/support/conformance.mjs"))
        .args(["--url", url, "--protocol", &protocol.to_string(), "--frames"])
        .arg(frames)
        .env("CLAWMUX_GATEWAY_PROTOCOL_DIR", &checker.protocol_dir)
        .env("CONFORMANCE_TOKEN", token)
        .output()
        .expect("node runs the suite");
    assert!(
        out.status.success(),
        "conformance.mjs against {url} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    parse_rows(&String::from_utf8(out.stdout).expect("UTF-8 rows"))
}

/// The server frames of a frames file, checked.
fn check_frames(checker: &schema_check::Checker, frames: &Path) -> Vec<schema_check::Outcome> {
    let text = std::fs::read_to_string(frames).expect("frames file");
    let server: String = text.lines().filter(|l| l.contains("\"dir\":\"server\"")).map(|l| format!("{l}\n")).collect();
    checker.check_lines(&server)
}

#[test]
fn live_conformance_official_client_real_vs_replay() {
    let Some(gw) = gateway() else { return };
    let checker = schema_check::Checker::from_env(repo()).expect("the protocol packages (CLAWMUX_GATEWAY_PROTOCOL_DIR, CLAWMUX_NODE_BIN)");
    let (protocol, cassette) = if gw.flavor == "v3" {
        (3, repo().join("tests/cassettes/openclaw-2026.4.12.jsonl"))
    } else {
        (4, repo().join("tests/cassettes/openclaw-2026.9.6-conformance.jsonl"))
    };
    let replay = Replay::start(&gw.token, protocol, &cassette);
    let dir = std::env::temp_dir().join(format!("clawmux-conformance-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    // Kept when the test fails (the frames say why), removed when it passes: ~60 MB a run.
    struct RemoveOnPass(std::path::PathBuf);
    impl Drop for RemoveOnPass {
        fn drop(&mut self) {
            if !std::thread::panicking() {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }
    let _kept_on_failure = RemoveOnPass(dir.clone());
    let (real_frames, replay_frames) = (dir.join("real-frames.jsonl"), dir.join("replay-frames.jsonl"));

    // Both at once: they share nothing, and the suite's slowest row (the pre-connect timeout)
    // then costs its 15 s once.
    let (real, replayed) = std::thread::scope(|s| {
        let real = s.spawn(|| run_suite(&checker, &gw.url, &gw.token, protocol, &real_frames));
        let replayed = s.spawn(|| run_suite(&checker, &replay.url, &gw.token, protocol, &replay_frames));
        (real.join().expect("real run"), replayed.join().expect("replay run"))
    });
    let rows_json: Vec<String> = real.iter().map(|(r, o)| format!("{{\"row\":{r:?},\"observed\":{o}}}")).collect();
    std::fs::write(dir.join("real-rows.jsonl"), rows_json.join("\n")).expect("write rows");
    eprintln!("conformance ({}): {} rows; frames and rows in {} (kept if the test fails)", gw.flavor, real.len(), dir.display());
    assert!(real.len() >= if protocol == 4 { 47 } else { 35 }, "rows: {}", real.len());
    let differences = compare(&real, &replayed);
    assert!(differences.is_empty(), "the replay gateway differs from the real one ({}):\n{}", differences.len(), differences.join("\n"));

    // The schema describes protocol 4; 2026.4.12's frames (hello-ok without auth, ...) predate it.
    if protocol != 4 {
        return;
    }
    let listed = checker.departures();
    let (real_seen, real_unlisted) = schema_check::summarize(&check_frames(&checker, &real_frames));
    assert!(real_unlisted.is_empty(), "the real gateway departs from its schema in ways not listed in schema-departures.json:\n{}", real_unlisted.join("\n"));
    let intermittent = checker.intermittent_departures();
    let stale: Vec<&String> = listed.keys().filter(|id| !real_seen.contains_key(*id) && !intermittent.contains(*id)).collect();
    assert!(stale.is_empty(), "listed departures the real gateway no longer shows (remove them): {stale:?}");
    let (replay_seen, replay_unlisted) = schema_check::summarize(&check_frames(&checker, &replay_frames));
    assert!(replay_unlisted.is_empty(), "the replay gateway sends frames its schema refuses:\n{}", replay_unlisted.join("\n"));
    let report: BTreeMap<&String, (usize, usize)> =
        listed.keys().map(|id| (id, (real_seen.get(id).copied().unwrap_or(0), replay_seen.get(id).copied().unwrap_or(0)))).collect();
    eprintln!("schema departures (frames: real, replay): {report:?}");
}
