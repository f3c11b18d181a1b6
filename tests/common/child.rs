//! clawmux as a child process (the restart tests kill it with `kill -9` or stop it with SIGTERM
//! and start it again on the same store), and what a client sees of a run across re-attachments.
#![allow(dead_code)]

use crate::common::{parse_sse, temp_dir, SseEvent};
use futures_util::StreamExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

pub use crate::common::free_port;

/// clawmux as a child process, on a fixed port and store: every start uses the same ones.
pub struct Clawmux {
    child: Option<Child>,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// Its store, HOME (device key) and logs (one per start).
    pub dir: PathBuf,
    env: Vec<(String, String)>,
    starts: usize,
}

impl Clawmux {
    /// Against `gateway_url`, with a SQLite store in a fresh directory; `extra` adds or overrides
    /// environment variables.
    pub fn new(gateway_url: &str, token: &str, extra: &[(&str, &str)]) -> Self {
        let dir = temp_dir("restart");
        let port = free_port();
        let mut env: Vec<(String, String)> = vec![
            ("CLAWMUX_GATEWAY_URL".into(), gateway_url.into()),
            ("CLAWMUX_GATEWAY_TOKEN".into(), token.into()),
            ("CLAWMUX_LISTEN".into(), format!("127.0.0.1:{port}")),
            ("CLAWMUX_STORE_URL".into(), format!("sqlite://{}", dir.join("runs.db").display())),
            ("HOME".into(), dir.display().to_string()),
            ("CLAWMUX_LOG".into(), "info".into()),
        ];
        for (k, v) in extra {
            env.retain(|(name, _)| name != k);
            env.push(((*k).to_owned(), (*v).to_owned()));
        }
        Self { child: None, base: format!("http://127.0.0.1:{port}"), dir, env, starts: 0 }
    }

    /// Starts the process and waits (bounded) until `/readyz` is 200.
    pub async fn start(&mut self, http: &reqwest::Client) {
        self.spawn();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(r) = http.get(format!("{}/readyz", self.base)).send().await {
                if r.status() == 200 {
                    return;
                }
            }
            assert!(self.running(), "clawmux exited at start; log: {}", self.log());
            assert!(Instant::now() < deadline, "clawmux did not become ready; log: {}", self.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts the process without waiting for it.
    pub fn spawn(&mut self) {
        self.starts += 1;
        let log = std::fs::File::create(self.dir.join(format!("clawmux-{}.log", self.starts))).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_clawmux"))
            .arg("serve")
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("clawmux starts");
        self.child = Some(child);
    }

    /// True while the process of the last start has not exited.
    pub fn running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The log of the last start.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join(format!("clawmux-{}.log", self.starts))).unwrap_or_default()
    }

    /// `kill -9`, and waits for the process to be gone.
    pub fn kill_9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends SIGTERM; the process is still ours to wait for ([`Self::wait_exit`]).
    pub fn send_sigterm(&mut self) {
        let c = self.child.as_ref().expect("running");
        let st = Command::new("kill").args(["-TERM", &c.id().to_string()]).status().expect("kill runs");
        assert!(st.success());
    }

    /// Waits (bounded) for the process to exit after SIGTERM; it must exit with success.
    pub fn wait_exit(&mut self, within: Duration) {
        let mut c = self.child.take().expect("running");
        let deadline = std::time::Instant::now() + within;
        loop {
            if let Some(status) = c.try_wait().expect("try_wait") {
                assert!(status.success(), "clawmux exited with {status} after SIGTERM; log: {}", self.log());
                return;
            }
            if std::time::Instant::now() >= deadline {
                let _ = c.kill();
                let _ = c.wait();
                panic!("clawmux did not exit after SIGTERM within {within:?}; log: {}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM; returns the time the process took to exit.
    pub fn sigterm(&mut self) -> Duration {
        let t0 = std::time::Instant::now();
        self.send_sigterm();
        self.wait_exit(Duration::from_secs(60));
        t0.elapsed()
    }
}

impl Drop for Clawmux {
    fn drop(&mut self) {
        self.kill_9();
    }
}

/// What a client saw of one run, across any number of (re-)attachments.
#[derive(Default)]
pub struct Seen {
    /// Every event received, in order.
    pub events: Vec<SseEvent>,
    /// Streams that ended without a terminal event (a dropped connection, a handoff).
    pub cut: usize,
}

impl Seen {
    /// The id to re-attach after (`Last-Event-ID`).
    pub fn last_id(&self) -> u64 {
        self.events.last().map_or(0, |e| e.id)
    }
    /// The concatenated `text_delta`s.
    pub fn text(&self) -> String {
        self.events.iter().filter(|e| e.event == "text_delta").filter_map(|e| e.data["text"].as_str()).collect()
    }
    /// The first terminal event.
    pub fn terminal(&self) -> Option<&SseEvent> {
        self.events.iter().find(|e| e.event == "final" || e.event == "error")
    }

    /// What is wrong with the stream as a whole: event ids 1..=n without gap or repeat, `accepted`
    /// first, exactly one terminal event and it is `final`, the deltas add up to its content.
    pub fn problems(&self) -> Option<String> {
        let got: Vec<u64> = self.events.iter().map(|e| e.id).collect();
        if got != (1..=got.len() as u64).collect::<Vec<_>>() {
            return Some(format!("event ids {got:?}"));
        }
        if self.events.first().map(|e| e.event.as_str()) != Some("accepted") {
            return Some(format!("first event {:?}", self.events.first()));
        }
        let terminals = self.events.iter().filter(|e| e.event == "final" || e.event == "error").count();
        if terminals != 1 {
            return Some(format!("{terminals} terminal events"));
        }
        let t = self.terminal()?;
        if t.event != "final" {
            return Some(format!("ended {t:?}"));
        }
        let content = t.data["content"].as_str().unwrap_or_default();
        if self.text() != content {
            return Some(format!("deltas {:?} != content {:?}", self.text(), content));
        }
        None
    }
}

/// Reads one SSE stream into `seen` until it ends (terminal, closed or cut), bounded.
pub async fn read_stream(resp: reqwest::Response, seen: Arc<Mutex<Seen>>, within: Duration) {
    let mut stream = resp.bytes_stream();
    let mut buf = String::new();
    let deadline = Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(Some(Ok(chunk))) => {
                buf.push_str(&String::from_utf8_lossy(&chunk));
                while let Some(pos) = buf.find("\n\n") {
                    let block: String = buf.drain(..pos + 2).collect();
                    for ev in parse_sse(&block) {
                        let terminal = ev.event == "final" || ev.event == "error";
                        seen.lock().expect("seen").events.push(ev);
                        if terminal {
                            return;
                        }
                    }
                }
            }
            _ => {
                seen.lock().expect("seen").cut += 1;
                return;
            }
        }
    }
}

/// `GET /v1/runs/{id}/events` with `Last-Event-ID: after` (none for 0); must be 200.
pub async fn attach(http: &reqwest::Client, base: &str, run_id: &str, after: u64) -> reqwest::Response {
    let mut r = http.get(format!("{base}/v1/runs/{run_id}/events")).header("accept", "text/event-stream");
    if after > 0 {
        r = r.header("last-event-id", after.to_string());
    }
    let resp = r.send().await.expect("attach");
    assert_eq!(resp.status(), 200, "attach {run_id}");
    resp
}
