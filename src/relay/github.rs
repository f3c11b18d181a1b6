//! The GitHub REST calls of the relay: find the open pull request of a branch, create one, or
//! update its title and body. The base URL is configurable (GitHub Enterprise, a test server); the
//! token goes in the `Authorization` header of these requests only.

use crate::config::Secret;
use reqwest::StatusCode;
use serde::Deserialize;
use std::time::Duration;

/// A pull request as the relay reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullRequest {
    /// Its number.
    pub number: u64,
    /// `html_url`.
    pub url: String,
}

/// A failed call: `retryable` for transport errors, 5xx and 429; not for other 4xx.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// Worth another try.
    pub retryable: bool,
    /// What failed (method, path, status, GitHub's message); never the token.
    pub message: String,
}

#[derive(Deserialize)]
struct PrJson {
    number: u64,
    html_url: String,
}

/// The client.
pub struct Github {
    /// HTTP client (timeouts set).
    http: reqwest::Client,
    /// API base without a trailing slash, e.g. `https://api.github.com`.
    api: String,
    /// Bearer token; `None` sends no `Authorization`.
    token: Option<Secret>,
}

impl Github {
    /// A client for `api` (no trailing slash needed).
    pub fn new(api: &str, token: Option<Secret>, timeout: Duration) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(10)))
            .user_agent(concat!("clawmux/", env!("CARGO_PKG_VERSION")))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("HTTP client: {e}"))?;
        Ok(Self { http, api: api.trim_end_matches('/').to_owned(), token })
    }

    fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let mut r = self.http.request(method, format!("{}{path}", self.api)).header("Accept", "application/vnd.github+json").header("X-GitHub-Api-Version", "2022-11-28");
        if let Some(t) = &self.token {
            r = r.bearer_auth(t.expose());
        }
        r
    }

    async fn send<T: for<'de> Deserialize<'de>>(&self, what: &str, rb: reqwest::RequestBuilder) -> Result<T, ApiError> {
        let resp = rb.send().await.map_err(|e| ApiError { retryable: true, message: format!("{what}: {}", without_url(&e)) })?;
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(|e| ApiError { retryable: true, message: format!("{what}: reading the answer: {}", without_url(&e)) })?;
        if !status.is_success() {
            let msg = serde_json::from_slice::<serde_json::Value>(&bytes)
                .ok()
                .and_then(|v| v.get("message").and_then(|m| m.as_str()).map(str::to_owned))
                .unwrap_or_else(|| String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned());
            let retryable = status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS;
            return Err(ApiError { retryable, message: format!("{what}: HTTP {}: {}", status.as_u16(), super::host::truncate(&msg, 300)) });
        }
        serde_json::from_slice(&bytes).map_err(|e| ApiError { retryable: false, message: format!("{what}: unexpected answer: {e}") })
    }

    /// `GET /repos/{o}/{r}/pulls?head={o}:{branch}&state=open`: the first open PR of the branch.
    pub async fn find_open(&self, owner: &str, repo: &str, branch: &str) -> Result<Option<PullRequest>, ApiError> {
        let head = format!("{owner}:{branch}");
        let rb = self.req(reqwest::Method::GET, &format!("/repos/{owner}/{repo}/pulls")).query(&[("head", head.as_str()), ("state", "open"), ("per_page", "10")]);
        let v: Vec<PrJson> = self.send("list pull requests", rb).await?;
        Ok(v.into_iter().next().map(|p| PullRequest { number: p.number, url: p.html_url }))
    }

    /// `POST /repos/{o}/{r}/pulls`.
    pub async fn create(&self, owner: &str, repo: &str, branch: &str, base: &str, title: &str, body: &str) -> Result<PullRequest, ApiError> {
        let rb = self.req(reqwest::Method::POST, &format!("/repos/{owner}/{repo}/pulls")).json(&serde_json::json!({"title": title, "head": branch, "base": base, "body": body}));
        let p: PrJson = self.send("create pull request", rb).await?;
        Ok(PullRequest { number: p.number, url: p.html_url })
    }

    /// `PATCH /repos/{o}/{r}/pulls/{n}` with the given fields.
    pub async fn update(&self, owner: &str, repo: &str, number: u64, title: Option<&str>, body: Option<&str>) -> Result<PullRequest, ApiError> {
        let mut m = serde_json::Map::new();
        if let Some(t) = title {
            m.insert("title".into(), t.into());
        }
        if let Some(b) = body {
            m.insert("body".into(), b.into());
        }
        let rb = self.req(reqwest::Method::PATCH, &format!("/repos/{owner}/{repo}/pulls/{number}")).json(&m);
        let p: PrJson = self.send("update pull request", rb).await?;
        Ok(PullRequest { number: p.number, url: p.html_url })
    }
}

/// A reqwest error's text without its URL (the URL has no secret, but keep messages short).
fn without_url(e: &reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "cannot connect"
    } else {
        "request failed"
    };
    let mut src: Option<&dyn std::error::Error> = std::error::Error::source(e);
    let mut detail = String::new();
    while let Some(s) = src {
        detail = s.to_string();
        src = s.source();
    }
    if detail.is_empty() {
        kind.to_owned()
    } else {
        format!("{kind}: {detail}")
    }
}
