//! Test helpers for plain HTTP servers made of a socket (an upstream, a webhook receiver).

use tokio::io::AsyncReadExt;

/// Reads a request's head from `conn` and returns its first line (`POST /path HTTP/1.1`); `None`
/// when the peer closed or failed before the head ended.
pub async fn request_line(conn: &mut tokio::net::TcpStream) -> Option<String> {
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match conn.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    Some(String::from_utf8_lossy(&head).lines().next().unwrap_or_default().to_owned())
}
