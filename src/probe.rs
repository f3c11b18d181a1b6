//! HTTP probes of the command line: `clawmux healthcheck` (the container image's `HEALTHCHECK`:
//! the image ships no curl, no shell tools, so the binary probes itself) and `doctor`'s check of
//! the LLM upstream.

use crate::config::Secret;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

/// The `/healthz` URL of a service listening on `listen`. A wildcard address is probed on
/// loopback: the probe runs next to the service (same network namespace), and a wildcard is not
/// an address one can connect to.
pub fn healthz_url(listen: SocketAddr) -> String {
    let ip = match listen.ip() {
        IpAddr::V4(v4) if v4.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(v6) if v6.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}/healthz", SocketAddr::new(ip, listen.port()))
}

/// `GET url`: `Ok` on a 2xx answer within `timeout`, else one line saying what happened.
pub async fn healthz(url: &str, timeout: Duration) -> Result<(), String> {
    let client = client(timeout)?;
    let resp = client.get(url).send().await.map_err(|e| format!("{url}: {}", reqwest_reason(e)))?;
    let status = resp.status();
    if status.is_success() {
        Ok(())
    } else {
        Err(format!("{url}: HTTP {status}"))
    }
}

/// What `doctor` learned from the LLM upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamCheck {
    /// It answered the model list with the configured key: the ids it serves.
    Ok(Vec<String>),
    /// It answered, but refused the key (401/403): the proxy's calls would all be refused.
    KeyRefused(u16),
    /// Anything else: unreachable, an error status, an answer that is not a model list.
    Failed(String),
}

/// `GET <upstream>/v1/models` with the upstream key, as the proxy would send it (LiteLLM and
/// OpenAI-compatible servers list their models there; nothing is billed).
pub async fn llm_upstream(upstream: &str, key: Option<&Secret>, timeout: Duration) -> UpstreamCheck {
    let url = crate::proxy::upstream_url(upstream, "/v1/models");
    let client = match client(timeout) {
        Ok(c) => c,
        Err(e) => return UpstreamCheck::Failed(e),
    };
    let mut req = client.get(&url);
    if let Some(k) = key {
        req = req.bearer_auth(k.expose());
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => return UpstreamCheck::Failed(reqwest_reason(e)),
    };
    let status = resp.status().as_u16();
    if status == 401 || status == 403 {
        return UpstreamCheck::KeyRefused(status);
    }
    if !resp.status().is_success() {
        let reason = read_limited(resp, 64 << 10).await.map(|b| error_message(&b)).unwrap_or_default();
        return UpstreamCheck::Failed(if reason.is_empty() { format!("HTTP {status}") } else { format!("HTTP {status}: {reason}") });
    }
    // bounded: a model list is small; anything larger is not one
    match read_limited(resp, 1 << 20).await {
        Ok(body) => match model_ids(&body) {
            Some(ids) => UpstreamCheck::Ok(ids),
            None => UpstreamCheck::Failed("the answer is not an OpenAI model list".to_owned()),
        },
        Err(e) => UpstreamCheck::Failed(e),
    }
}

/// The ids of an OpenAI model list (`{"data":[{"id":...},...]}`), `None` for anything else.
pub fn model_ids(body: &[u8]) -> Option<Vec<String>> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let data = v.get("data")?.as_array()?;
    Some(data.iter().filter_map(|m| m.get("id").and_then(|id| id.as_str()).map(str::to_owned)).collect())
}

/// What an error answer says, for a person: OpenAI's `{"error":{"message":...}}` (LiteLLM's too),
/// else the text; printable characters only, at most 300 (it comes from outside).
pub fn error_message(body: &[u8]) -> String {
    let text = match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(v) => match v.pointer("/error/message").or_else(|| v.get("error")).or_else(|| v.get("detail")) {
            Some(serde_json::Value::String(m)) => m.clone(),
            Some(other) => other.to_string(),
            None => v.to_string(),
        },
        Err(_) => String::from_utf8_lossy(body).into_owned(),
    };
    let clean: String = text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    let clean = clean.trim();
    match clean.char_indices().nth(300) {
        Some((i, _)) => format!("{}…", &clean[..i]),
        None => clean.to_owned(),
    }
}

/// `doctor`'s line for the upstream check, and whether it is green.
pub fn upstream_report(upstream: &str, check: &UpstreamCheck) -> (String, bool) {
    match check {
        UpstreamCheck::Ok(ids) => {
            let mut shown: Vec<&str> = ids.iter().take(10).map(String::as_str).collect();
            if ids.len() > shown.len() {
                shown.push("…");
            }
            (format!("llm upstream ({upstream}): OK, key accepted, {} model(s): {}\n", ids.len(), shown.join(", ")), true)
        }
        UpstreamCheck::KeyRefused(status) => (
            format!("llm upstream ({upstream}): KEY REFUSED (HTTP {status})\n  Fix: set CLAWMUX_LLM_UPSTREAM_KEY to a key the upstream accepts (LiteLLM: its master key or a virtual key)\n"),
            false,
        ),
        UpstreamCheck::Failed(reason) => (
            format!("llm upstream ({upstream}): FAILED: {reason}\n  Fix: point CLAWMUX_LLM_UPSTREAM_URL at the upstream's root (LiteLLM: http://HOST:4000) and check that it runs\n"),
            false,
        ),
    }
}

fn client(timeout: Duration) -> Result<reqwest::Client, String> {
    // never follow a redirect: a probe answers for the address it was given
    reqwest::Client::builder().timeout(timeout).redirect(reqwest::redirect::Policy::none()).build().map_err(|e| format!("cannot build an HTTP client: {e}"))
}

/// The reason of a failed request, without the URL reqwest puts in its message (an upstream URL
/// may carry credentials in its userinfo; the caller names the URL it chose to show).
fn reqwest_reason(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut reason = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        reason = format!("{reason}: {s}");
        source = s.source();
    }
    reason
}

async fn read_limited(mut resp: reqwest::Response, limit: usize) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| format!("reading the answer failed: {}", reqwest_reason(e)))? {
        if body.len() + chunk.len() > limit {
            return Err(format!("the answer exceeds {limit} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcard_listen_addresses_are_probed_on_loopback() {
        assert_eq!(healthz_url("0.0.0.0:8787".parse().expect("addr")), "http://127.0.0.1:8787/healthz");
        assert_eq!(healthz_url("[::]:8787".parse().expect("addr")), "http://[::1]:8787/healthz");
        assert_eq!(healthz_url("10.1.2.3:9".parse().expect("addr")), "http://10.1.2.3:9/healthz");
        assert_eq!(healthz_url("127.0.0.1:1".parse().expect("addr")), "http://127.0.0.1:1/healthz");
    }

    #[test]
    fn model_lists_are_read_and_anything_else_is_not() {
        assert_eq!(model_ids(br#"{"object":"list","data":[{"id":"a"},{"id":"b"},{"x":1}]}"#), Some(vec!["a".to_owned(), "b".to_owned()]));
        assert_eq!(model_ids(br#"{"data":[]}"#), Some(vec![]));
        assert_eq!(model_ids(br#"{"error":"nope"}"#), None);
        assert_eq!(model_ids(b"<html>"), None);
    }

    #[test]
    fn only_an_accepted_key_and_a_model_list_are_green() {
        let (line, ok) = upstream_report("http://litellm:4000", &UpstreamCheck::Ok(vec!["default".into()]));
        assert!(ok && line.contains("OK, key accepted, 1 model(s): default"), "{line}");
        let (line, ok) = upstream_report("http://litellm:4000", &UpstreamCheck::KeyRefused(401));
        assert!(!ok && line.contains("KEY REFUSED (HTTP 401)") && line.contains("CLAWMUX_LLM_UPSTREAM_KEY"), "{line}");
        let (line, ok) = upstream_report("http://litellm:4000", &UpstreamCheck::Failed("connection refused".into()));
        assert!(!ok && line.contains("FAILED: connection refused"), "{line}");
    }

    /// A tiny one-shot HTTP server on 127.0.0.1 answering every request with `status` + `body`,
    /// recording the request heads it got.
    fn serve(status: &'static str, body: &'static str) -> (String, std::sync::mpsc::Receiver<String>) {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for stream in listener.incoming().take(4) {
                let Ok(mut s) = stream else { continue };
                let mut buf = [0u8; 4096];
                let n = s.read(&mut buf).unwrap_or(0);
                let _ = tx.send(String::from_utf8_lossy(&buf[..n]).into_owned());
                let _ = write!(s, "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len());
            }
        });
        (format!("http://{addr}"), rx)
    }

    #[tokio::test]
    async fn healthz_is_green_only_on_a_2xx_answer() {
        let (base, rx) = serve("200 OK", r#"{"status":"ok"}"#);
        healthz(&format!("{base}/healthz"), Duration::from_secs(5)).await.expect("200 is healthy");
        assert!(rx.recv().expect("request").starts_with("GET /healthz HTTP/1.1"));
        let (base, _rx) = serve("503 Service Unavailable", "{}");
        let err = healthz(&format!("{base}/healthz"), Duration::from_secs(5)).await.expect_err("503 is not healthy");
        assert!(err.contains("503"), "{err}");
        // nothing listens there any more
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
        assert!(healthz(&format!("http://{closed}/healthz"), Duration::from_secs(5)).await.is_err());
    }

    #[tokio::test]
    async fn the_upstream_check_sends_the_key_and_reads_the_model_list() {
        let (base, rx) = serve("200 OK", r#"{"object":"list","data":[{"id":"default"}]}"#);
        let check = llm_upstream(&format!("{base}/"), Some(&Secret::new("sk-probe")), Duration::from_secs(5)).await;
        assert_eq!(check, UpstreamCheck::Ok(vec!["default".to_owned()]));
        let head = rx.recv().expect("request").to_ascii_lowercase();
        assert!(head.starts_with("get /v1/models http/1.1"), "{head}");
        assert!(head.contains("authorization: bearer sk-probe"), "{head}");
        let (base, _rx) = serve("401 Unauthorized", r#"{"error":"bad key"}"#);
        assert_eq!(llm_upstream(&base, None, Duration::from_secs(5)).await, UpstreamCheck::KeyRefused(401));
        let (base, _rx) = serve("200 OK", "<html>");
        assert!(matches!(llm_upstream(&base, None, Duration::from_secs(5)).await, UpstreamCheck::Failed(_)));
        // LiteLLM without a database answers an unknown key with 400 and says why
        let (base, _rx) = serve("400 Bad Request", r#"{"error":{"message":"No connected db.","type":"no_db_connection","code":"400"}}"#);
        assert_eq!(llm_upstream(&base, None, Duration::from_secs(5)).await, UpstreamCheck::Failed("HTTP 400: No connected db.".to_owned()));
    }

    #[test]
    fn error_messages_are_read_and_bounded() {
        assert_eq!(error_message(br#"{"error":{"message":"bad\nkey"}}"#), "bad key");
        assert_eq!(error_message(br#"{"detail":"nope"}"#), "nope");
        assert_eq!(error_message(b"Internal Server Error"), "Internal Server Error");
        let long = "x".repeat(1000);
        assert_eq!(error_message(long.as_bytes()).chars().count(), 301);
    }
}
