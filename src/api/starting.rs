//! The API port while clawmux starts: it listens from the first step (so a port in use stops
//! start-up at once, and a second clawmux with the same settings cannot bind it meanwhile), and
//! until the API serves, every request on it is answered `503` with `Retry-After`, in the API's
//! error shape. Before, the kernel accepted those connections and their requests hung through
//! start-up (the engine, the relay, restart recovery): a caller or a load balancer could not tell
//! a starting instance from a stuck one.

use super::{ErrorBody, ErrorDetail};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Most of a request read before it is answered (its head; a body is not waited for).
const MAX_READ: usize = 16 * 1024;

/// How long one connection is given, all in all: a client that sends nothing is closed then.
const PER_CONNECTION: Duration = Duration::from_secs(2);

/// Connections answered at once at most; one beyond is closed without an answer (a flood while
/// clawmux starts costs at most this many small buffers, and sockets well under a default limit
/// of 1,024 open files, which start-up itself needs some of).
const MAX_ANSWERING: usize = 256;

/// After a failed accept (out of file descriptors, say) before the next: never a busy loop.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The answering thread; [`Self::listener`] hands the listener on.
pub struct Starting {
    stop: tokio::sync::oneshot::Sender<()>,
    handed: tokio::sync::oneshot::Receiver<std::io::Result<std::net::TcpListener>>,
}

impl Starting {
    /// Answers every connection on `listener` `503` until [`Self::listener`].
    ///
    /// On a thread of its own, with its own small runtime: start-up's steps include long
    /// synchronous ones (SQLite's restart recovery reads every unfinished run), and answers made on
    /// start-up's own thread waited for each of them, the very hang this is here to end.
    pub fn answer(listener: std::net::TcpListener) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        let runtime = tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build()?;
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let (hand, handed) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("clawmux-starting".to_owned())
            .spawn(move || runtime.block_on(answer_until_stopped(listener, stopped, hand)))?;
        Ok(Self { stop, handed })
    }

    /// Stops answering and gives the listener back, for the API to serve on.
    pub async fn listener(self) -> std::io::Result<std::net::TcpListener> {
        let _ = self.stop.send(());
        self.handed.await.map_err(|_| std::io::Error::other("the starting port's thread ended without handing its listener on"))?
    }
}

async fn answer_until_stopped(
    listener: std::net::TcpListener,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
    hand: tokio::sync::oneshot::Sender<std::io::Result<std::net::TcpListener>>,
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            let _ = hand.send(Err(e));
            return;
        }
    };
    let answering = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_ANSWERING));
    loop {
        tokio::select! {
            biased;
            _ = &mut stopped => break,
            accepted = listener.accept() => match accepted {
                Ok((conn, _)) => {
                    if let Ok(permit) = answering.clone().try_acquire_owned() {
                        tokio::spawn(async move {
                            answer_one(conn).await;
                            drop(permit);
                        });
                    }
                }
                Err(_) => tokio::time::sleep(ACCEPT_BACKOFF).await,
            },
        }
    }
    // Connections that arrive from here on wait in the backlog for the API itself.
    let _ = hand.send(listener.into_std());
    // The answers under way are finished (each is bounded) rather than cut off with this runtime:
    // a reset instead of the `503` would look like the hang again.
    let _ = answering.acquire_many(MAX_ANSWERING as u32).await;
}

/// The answer every request gets meanwhile.
fn response() -> Vec<u8> {
    let body = serde_json::to_vec(&ErrorBody {
        error: ErrorDetail { code: "gateway_unavailable", message: "clawmux is starting; retry in a moment".to_owned() },
    })
    .unwrap_or_default();
    let mut out = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

/// Reads the request's head (bounded), answers, and closes; the rest of what the client sends
/// meanwhile is read and dropped, so that closing does not reset the connection before the client
/// has read the answer.
async fn answer_one(mut conn: tokio::net::TcpStream) {
    let _ = tokio::time::timeout(PER_CONNECTION, async {
        let mut buf = vec![0u8; 4096];
        let mut seen = Vec::new();
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") && seen.len() < MAX_READ {
            match conn.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
        if conn.write_all(&response()).await.is_err() || conn.shutdown().await.is_err() {
            return;
        }
        while let Ok(n) = conn.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Answered `503` in the error shape while it runs; the listener handed on still listens.
    #[actix_rt::test]
    async fn requests_are_answered_503_until_the_listener_is_handed_on() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let starting = Starting::answer(listener).expect("answer");
        let client = reqwest::Client::new();
        let r = client.post(format!("http://{addr}/v1/runs")).body(vec![b'x'; 100_000]).send().await.expect("answered");
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
        let body: serde_json::Value = r.json().await.expect("json");
        assert_eq!(body["error"]["code"], "gateway_unavailable");
        let listener = starting.listener().await.expect("handed on");
        assert_eq!(listener.local_addr().expect("addr"), addr);
        // A client that sends nothing is closed, not held.
        let mut silent = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let starting = Starting::answer(listener).expect("answer again");
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(10), silent.read(&mut byte)).await;
        assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "a silent client was held: {read:?}");
        // Kept (not dropped) to the end: the socket still listens, a connection now waits for
        // whoever serves it next.
        let _listener = starting.listener().await.expect("handed on");
        let conn = tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr)).await;
        assert!(matches!(conn, Ok(Ok(_))), "{conn:?}");
    }

    /// Answered while start-up's own thread is held by a synchronous step: the request here is
    /// made with blocking I/O on the very thread that started the answering (a runtime of one
    /// thread), which then runs nothing else until the answer came.
    #[actix_rt::test]
    async fn requests_are_answered_while_the_starting_thread_is_blocked() {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let starting = Starting::answer(listener).expect("answer");
        let mut conn = std::net::TcpStream::connect(addr).expect("connect");
        conn.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        conn.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").expect("request");
        let mut answer = Vec::new();
        let read = conn.read_to_end(&mut answer);
        let head = String::from_utf8_lossy(&answer);
        assert!(read.is_ok() && head.starts_with("HTTP/1.1 503 "), "{read:?}: {head}");
        assert!(head.contains("retry-after: 1"), "{head}");
        starting.listener().await.expect("handed on");
    }
}
