//! Headless Chromium driven over W3C WebDriver (chromedriver), with plain HTTP calls: just what
//! the runs page's tests need (navigate, find, click, type, run a script, screenshot).
//!
//! Chromium runs with a fresh profile and everything that would reach the internet off (the test
//! machine has none): `--headless --no-sandbox --disable-gpu --no-first-run
//! --disable-background-networking --disable-component-update --disable-sync`.
//!
//! Binaries: `CLAWMUX_CHROME_BIN` (default `/usr/bin/chromium`) and `CLAWMUX_CHROMEDRIVER_BIN`
//! (default `/usr/bin/chromedriver`), Debian's `chromium` and `chromium-driver`
//! (tests/support/install-browser.sh installs them). Without them the tests skip, unless
//! `CLAWMUX_REQUIRE_BROWSER=1` (tests/run.sh), which makes a missing browser a failure.
#![allow(dead_code)]

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The W3C element reference key.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// Where the browser binaries are, or why the test cannot run (`None` with a message: skip).
pub fn binaries() -> Option<(PathBuf, PathBuf)> {
    let chrome = PathBuf::from(std::env::var("CLAWMUX_CHROME_BIN").unwrap_or_else(|_| "/usr/bin/chromium".to_owned()));
    let driver = PathBuf::from(std::env::var("CLAWMUX_CHROMEDRIVER_BIN").unwrap_or_else(|_| "/usr/bin/chromedriver".to_owned()));
    if chrome.exists() && driver.exists() {
        return Some((chrome, driver));
    }
    let msg = format!("no headless browser ({} and {}; tests/support/install-browser.sh installs them)", chrome.display(), driver.display());
    assert!(std::env::var("CLAWMUX_REQUIRE_BROWSER").as_deref() != Ok("1"), "{msg}");
    eprintln!("skipping: {msg}");
    None
}

/// Where screenshots go: `CLAWMUX_BROWSER_ARTIFACTS`, else `<tmp>/clawmux-browser-artifacts`.
pub fn artifacts_dir() -> PathBuf {
    let dir = std::env::var_os("CLAWMUX_BROWSER_ARTIFACTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("clawmux-browser-artifacts"));
    std::fs::create_dir_all(&dir).expect("artifacts dir");
    dir
}

/// A chromedriver process of the test's own; killed on drop.
pub struct Driver {
    child: Child,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    /// The browser binary sessions start.
    chrome: PathBuf,
    /// Fresh profiles live here; removed on drop.
    profiles: PathBuf,
}

impl Driver {
    /// Starts chromedriver on a free loopback port and waits (bounded) until it answers.
    pub async fn start(chrome: &Path, driver: &Path) -> Self {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("free port");
            l.local_addr().expect("addr").port()
        };
        let profiles = crate::common::temp_dir("chrome-profiles");
        let child = Command::new(driver)
            .arg(format!("--port={port}"))
            .arg("--allowed-ips=127.0.0.1")
            .arg(format!("--log-path={}", profiles.join("chromedriver.log").display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts");
        let url = format!("http://127.0.0.1:{port}");
        let me = Self { child, url, chrome: chrome.to_owned(), profiles };
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(r) = http.get(format!("{}/status", me.url)).send().await {
                if r.json::<Value>().await.is_ok_and(|v| v["value"]["ready"] == true) {
                    return me;
                }
            }
            assert!(Instant::now() < deadline, "chromedriver did not become ready within 20 s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A new headless browser with a fresh profile.
    pub async fn browser(&self) -> Browser {
        let profile = self.profiles.join(uuid::Uuid::new_v4().simple().to_string());
        std::fs::create_dir_all(&profile).expect("profile dir");
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--window-size=1400,1000",
            &format!("--user-data-dir={}", profile.display()),
        ];
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": self.chrome, "args": args},
        }}});
        let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().expect("client");
        let r: Value = http.post(format!("{}/session", self.url)).json(&caps).send().await.expect("new session").json().await.expect("json");
        let session = r["value"]["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {r}")).to_owned();
        Browser { http, base: format!("{}/session/{session}", self.url) }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // A test that failed never closed its browser: the Chromium processes chromedriver
        // started would outlive it. They are ours (descendants of our chromedriver): end them
        // first, by PID, then chromedriver.
        let browsers = descendants(self.child.id());
        if !browsers.is_empty() {
            let pids: Vec<String> = browsers.iter().map(u32::to_string).collect();
            let _ = Command::new("kill").arg("-KILL").args(&pids).stderr(Stdio::null()).status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.profiles);
    }
}

/// Every live descendant of `pid` (from `/proc/*/stat`'s parent ids).
fn descendants(pid: u32) -> Vec<u32> {
    let mut parents: Vec<(u32, u32)> = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(p) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        // `pid (comm) state ppid ...`; comm may hold spaces and parentheses, so read after the last ')'.
        let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)).and_then(|v| v.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            parents.push((p, ppid));
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![pid];
    while let Some(parent) = frontier.pop() {
        for &(p, pp) in &parents {
            if pp == parent && !out.contains(&p) {
                out.push(p);
                frontier.push(p);
            }
        }
    }
    out
}

/// One browser session.
pub struct Browser {
    http: reqwest::Client,
    /// `<driver>/session/<id>`.
    base: String,
}

impl Browser {
    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let mut req = self.http.request(method.clone(), format!("{}{path}", self.base));
        if let Some(b) = body {
            req = req.json(&b);
        }
        let r = req.send().await.unwrap_or_else(|e| panic!("webdriver {method} {path}: {e}"));
        let status = r.status();
        let v: Value = r.json().await.unwrap_or(Value::Null);
        assert!(status.is_success(), "webdriver {method} {path}: {status} {v}");
        v["value"].clone()
    }

    /// Opens `url` (returns once the page has loaded).
    pub async fn goto(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", Some(json!({"url": url}))).await;
    }

    /// The page's current URL.
    pub async fn current_url(&self) -> String {
        self.call(reqwest::Method::GET, "/url", None).await.as_str().unwrap_or_default().to_owned()
    }

    /// Runs `script` (a function body; `arguments[i]` are `args`) in the page; returns its value.
    pub async fn js(&self, script: &str, args: Value) -> Value {
        self.call(reqwest::Method::POST, "/execute/sync", Some(json!({"script": script, "args": args}))).await
    }

    /// The element `css` selects (panics when there is none).
    pub async fn find(&self, css: &str) -> String {
        let v = self.call(reqwest::Method::POST, "/element", Some(json!({"using": "css selector", "value": css}))).await;
        v[ELEMENT].as_str().unwrap_or_else(|| panic!("no element {css}: {v}")).to_owned()
    }

    /// Clicks what `css` selects, as a user would.
    pub async fn click(&self, css: &str) {
        let e = self.find(css).await;
        self.call(reqwest::Method::POST, &format!("/element/{e}/click"), Some(json!({}))).await;
    }

    /// Replaces the text of the input `css` selects by typing `text`.
    pub async fn type_into(&self, css: &str, text: &str) {
        let e = self.find(css).await;
        self.call(reqwest::Method::POST, &format!("/element/{e}/clear"), Some(json!({}))).await;
        self.call(reqwest::Method::POST, &format!("/element/{e}/value"), Some(json!({"text": text}))).await;
    }

    /// `textContent` of what `css` selects (`""` when nothing matches).
    pub async fn text(&self, css: &str) -> String {
        let v = self.js("const e = document.querySelector(arguments[0]); return e ? e.textContent : '';", json!([css])).await;
        v.as_str().unwrap_or_default().to_owned()
    }

    /// Polls `probe` (a script returning JSON) until `done` holds for its value; bounded by
    /// `within`, then panics naming `what` and the last value.
    pub async fn wait_for(&self, what: &str, within: Duration, probe: &str, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + within;
        loop {
            let v = self.js(probe, json!([])).await;
            if done(&v) {
                return v;
            }
            assert!(Instant::now() < deadline, "timed out after {within:?} waiting for {what}; last: {v}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Saves a PNG screenshot of the page to `path`.
    pub async fn screenshot(&self, path: &Path) {
        use base64::Engine;
        let v = self.call(reqwest::Method::GET, "/screenshot", None).await;
        let png = base64::engine::general_purpose::STANDARD.decode(v.as_str().unwrap_or_default()).expect("base64 PNG");
        std::fs::write(path, png).expect("write screenshot");
        eprintln!("screenshot: {}", path.display());
    }

    /// Ends the session (closes the browser).
    pub async fn quit(self) {
        let _ = self.http.delete(&self.base).send().await;
    }
}
