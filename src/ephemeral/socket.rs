//! An ephemeral run's LLM path: a unix socket served by clawmux's attribution proxy for that run
//! alone. The container reaches it through its bridge (`localhost:8080` → the socket), the only
//! way out of a `network=none` container. Every call on the socket is the run's (the socket is
//! the attribution: no trace id, no token); the proxy's rules hold as for gateway runs: billing
//! headers overwritten, the upstream key added on the host, one audit record per call, usage
//! summed into the run, streams cut when the run ends. The listener stops with the run.

use crate::attribution::RunBilling;
use crate::proxy::{ProxyState, RunScope};
use actix_web::{web, App, HttpServer};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Connections served at once on one run's socket; more wait in the socket's backlog (of
/// [`BACKLOG`]; beyond it, connecting fails). The proxy reads a call's whole body (up to its
/// 32 MiB bound) before forwarding it, into clawmux's memory, which the container's memory
/// limit does not cover: without a bound, one container opening thousands of connections, each
/// sending a body just under the bound, had clawmux buffer tens of GiB (every tenant's runs lost
/// to the OOM killer), and each call past its budget check at once. An agent's parallel calls
/// (subagents, tools) stay well within this.
pub const MAX_CONNECTIONS: usize = 8;

/// Connections waiting for one of the [`MAX_CONNECTIONS`] (the kernel holds them, not clawmux).
const BACKLOG: u32 = 64;

/// A run's socket listener; stop it with [`RunSocket::stop`] when the run ends.
pub struct RunSocket {
    handle: actix_web::dev::ServerHandle,
}

impl RunSocket {
    /// Serves `path` (created here, world-writable so the container's non-root user can connect:
    /// its directory is mounted into that run's container only).
    pub fn start(path: &Path, proxy: web::Data<ProxyState>, billing: Arc<RunBilling>) -> std::io::Result<Self> {
        let _ = std::fs::remove_file(path);
        let scope = web::Data::new(RunScope(billing));
        let server = HttpServer::new(move || App::new().app_data(proxy.clone()).app_data(scope.clone()).configure(crate::proxy::routes))
            .workers(1)
            .max_connections(MAX_CONNECTIONS)
            .backlog(BACKLOG)
            .disable_signals()
            .shutdown_timeout(1)
            .client_request_timeout(Duration::from_secs(60))
            .bind_uds(path)?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
        }
        let server = server.run();
        let handle = server.handle();
        actix_web::rt::spawn(server);
        Ok(Self { handle })
    }

    /// Stops the listener (its in-flight calls are cut: the run has ended).
    pub async fn stop(self) {
        self.handle.stop(false).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attribution::Attributions;
    use crate::proxy::{AuditSink, ProxyMetrics, ProxyState};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::AsyncWriteExt;

    /// A container opening many connections to its socket at once, each with a call: the upstream
    /// sees at most [`MAX_CONNECTIONS`] of them at a time (and so clawmux reads at most that many
    /// bodies); the others wait, none is lost. Before, all 32 were taken and forwarded at once.
    #[actix_rt::test]
    async fn a_run_socket_serves_a_bounded_number_of_connections_at_once() {
        // An upstream that holds each call it gets, counting those it holds.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("the upstream binds");
        let upstream = format!("http://{}", listener.local_addr().expect("addr"));
        let (held, peak) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let conns = Arc::new(tokio::sync::Mutex::new(Vec::new()));
        let (h, p, c) = (held.clone(), peak.clone(), conns.clone());
        actix_web::rt::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                if crate::test_http::request_line(&mut conn).await.is_some() {
                    let now = h.fetch_add(1, Ordering::SeqCst) + 1;
                    p.fetch_max(now, Ordering::SeqCst);
                }
                c.lock().await.push(conn);
            }
        });
        let proxy = web::Data::new(ProxyState {
            attributions: Arc::new(Attributions::new()),
            upstream,
            key: None,
            client: reqwest::Client::new(),
            audit: AuditSink::disabled(),
            metrics: ProxyMetrics::new(&prometheus::Registry::new()).expect("metrics"),
            budgets: None,
            remote: None,
            shared_audit: None,
        });
        let dir = std::env::temp_dir().join(format!("clawmux-sock-{}-{}", std::process::id(), uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("llm.sock");
        let billing = Arc::new(RunBilling::new("run-1", "acct-1", "g", "s", "0af7651916cd43dd8448eb211c80319c"));
        let socket = RunSocket::start(&path, proxy, billing).expect("the run's socket");
        let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        let mut clients = Vec::new();
        for _ in 0..32 {
            let mut c = tokio::net::UnixStream::connect(&path).await.expect("connects (served or waiting)");
            let call = format!("POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len());
            c.write_all(call.as_bytes()).await.expect("sends its call");
            clients.push(c);
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while held.load(Ordering::SeqCst) < MAX_CONNECTIONS {
            assert!(tokio::time::Instant::now() < deadline, "the upstream got {} calls", held.load(Ordering::SeqCst));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Time for more to get through, were they let.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(peak.load(Ordering::SeqCst), MAX_CONNECTIONS, "calls forwarded at once");
        // A served connection that ends frees its place for a waiting one: one call is answered,
        // then its caller hangs up.
        let mut answered = conns.lock().await.remove(0);
        answered.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}").await.expect("answers");
        drop(answered);
        let mut first = clients.remove(0);
        let mut answer = [0u8; 12];
        tokio::time::timeout(Duration::from_secs(20), tokio::io::AsyncReadExt::read_exact(&mut first, &mut answer)).await.expect("in time").expect("an answer");
        assert_eq!(&answer, b"HTTP/1.1 200", "the answered call");
        drop(first);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while held.load(Ordering::SeqCst) < MAX_CONNECTIONS + 1 {
            assert!(tokio::time::Instant::now() < deadline, "no waiting call went on after one ended");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        socket.stop().await;
        let _ = std::fs::remove_dir_all(&dir);
    }
}
