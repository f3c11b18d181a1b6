//! A PostgreSQL of a test's own, for the fault tests (tests/support/postgres.sh start DIR): stopped
//! and started again on the same data, port and password; stopped on drop.
#![allow(dead_code)] // each test file uses a part

use std::path::{Path, PathBuf};

/// The test server's URL (`CLAWMUX_TEST_PG_URL`), or `None`: the test is skipped, unless
/// `CLAWMUX_REQUIRE_PG=1`, which fails it instead.
pub fn server_url(test: &str) -> Option<String> {
    match std::env::var("CLAWMUX_TEST_PG_URL").ok().filter(|u| !u.is_empty()) {
        Some(u) => Some(u),
        None => {
            assert!(
                !std::env::var("CLAWMUX_REQUIRE_PG").is_ok_and(|v| v == "1"),
                "{test}: CLAWMUX_REQUIRE_PG=1 but CLAWMUX_TEST_PG_URL is not set (tests/support/postgres.sh start DIR)"
            );
            eprintln!("SKIP {test}: no CLAWMUX_TEST_PG_URL");
            None
        }
    }
}

/// A PostgreSQL of the test's own (tests/support/postgres.sh start DIR), stopped on drop.
pub struct OwnPostgres {
    dir: PathBuf,
    /// Its URL (as `CLAWMUX_TEST_PG_URL`).
    pub url: String,
}

fn script(args: &[&str]) -> String {
    let out = std::process::Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/postgres.sh")).args(args).output().unwrap();
    assert!(out.status.success(), "postgres.sh {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `postgres.sh start DIR`: the URL it prints.
fn start_in(dir: &Path) -> String {
    let out = script(&["start", dir.to_str().unwrap()]);
    out.lines().find_map(|l| l.strip_prefix("CLAWMUX_TEST_PG_URL=")).expect("the URL line").to_owned()
}

impl OwnPostgres {
    pub fn start(dir: &Path) -> Self {
        Self { dir: dir.to_owned(), url: start_in(dir) }
    }
    /// Stops it by its PID (fast shutdown: connections are cut).
    pub fn stop(&self) {
        script(&["stop", self.dir.to_str().unwrap()]);
    }
    /// Starts it again: same data, port and password.
    pub fn restart(&self) {
        assert_eq!(start_in(&self.dir), self.url);
    }
}

impl Drop for OwnPostgres {
    fn drop(&mut self) {
        let _ = std::process::Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/postgres.sh")).args(["stop", self.dir.to_str().unwrap()]).output();
    }
}

