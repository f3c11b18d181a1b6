//! A TCP relay for fault tests: sits between clawmux and the gateway on 127.0.0.1 and, on
//! command, cuts every connection abruptly, stalls them (no bytes forwarded either way while the
//! sockets stay open), or resets new connections right after accepting them ("refuse").
//!
//! It is byte-transparent (it knows nothing about WebSocket or the gateway protocol), so what
//! clawmux sees is exactly what a network fault would show it:
//! - `cut_all`: every live connection gets a TCP RST on both sides at once (SO_LINGER 0), with no
//!   WebSocket close frame: a crashed middlebox or a dropped NAT entry;
//! - `stall`/`resume`: a partition that keeps the sockets open; the relay stops reading, so the
//!   kernel buffers fill and both peers see backpressure, then everything arrives, in order;
//! - `refuse`: new connections are accepted and reset at once: the gateway "is not there";
//! - `mute_after`: once a client sends the given bytes (say a database's `COMMIT`), they reach
//!   the upstream but nothing the upstream sends back reaches any client until `unmute`: with a
//!   `cut_all` after it, a request that was carried out but never answered.
//!
//! Usage: `let relay = ChaosRelay::start(gateway_addr).await?;` then point clawmux at
//! `relay.url()`. Dropping the relay stops it and resets every connection it carries.
#![allow(dead_code)]

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Counters and switches shared by the accept loop and the connection tasks.
struct Shared {
    upstream: SocketAddr,
    refusing: AtomicBool,
    accepted: AtomicU64,
    refused: AtomicU64,
    cut: AtomicU64,
    live: AtomicUsize,
    /// Bytes forwarded towards the upstream (gateway) and back towards the client.
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
    /// Bytes that, sent by a client, mute the relay (see `mute_after`); taken when seen.
    mute_on: Mutex<Option<Vec<u8>>>,
    /// Nothing from the upstream is forwarded while set.
    muted: AtomicBool,
}

/// The relay. See the module docs.
pub struct ChaosRelay {
    /// Where clients connect (127.0.0.1, a port the kernel chose).
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    /// `true` while stalled. Connection tasks watch it; dropping the sender ends them.
    stall_tx: watch::Sender<bool>,
    /// Bumped by `cut_all`; every connection alive at that moment is reset. Dropping the sender
    /// (the relay is dropped) resets every connection too.
    cut_tx: watch::Sender<u64>,
    accept_task: tokio::task::JoinHandle<()>,
}

impl ChaosRelay {
    /// Listens on 127.0.0.1:0 and forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            refusing: AtomicBool::new(false),
            accepted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            cut: AtomicU64::new(0),
            live: AtomicUsize::new(0),
            bytes_up: AtomicU64::new(0),
            bytes_down: AtomicU64::new(0),
            mute_on: Mutex::new(None),
            muted: AtomicBool::new(false),
        });
        let (stall_tx, stall_rx) = watch::channel(false);
        let (cut_tx, cut_rx) = watch::channel(0u64);
        let accept_task = tokio::spawn(accept_loop(listener, shared.clone(), stall_rx, cut_rx));
        Ok(Self { addr, shared, stall_tx, cut_tx, accept_task })
    }

    /// `ws://` URL of the relay, for clawmux's `gateway_url`.
    pub fn url(&self) -> String {
        format!("ws://{}", self.addr)
    }

    /// Resets every connection alive now (RST to both peers, queued bytes discarded). Returns how
    /// many connections that was. Connections made afterwards are not affected.
    pub fn cut_all(&self) -> usize {
        let n = self.shared.live.load(Ordering::SeqCst);
        self.cut_tx.send_modify(|g| *g += 1);
        self.shared.cut.fetch_add(n as u64, Ordering::SeqCst);
        n
    }

    /// Stops forwarding in both directions on every connection (current and new) while keeping
    /// the sockets open. Bytes already read are held and delivered, in order, on `resume`.
    pub fn stall(&self) {
        self.stall_tx.send_replace(true);
    }

    /// Ends a `stall`.
    pub fn resume(&self) {
        self.stall_tx.send_replace(false);
    }

    /// While `on`, new connections are accepted and reset at once (existing ones are untouched;
    /// combine with `cut_all` for an outage).
    pub fn refuse(&self, on: bool) {
        self.shared.refusing.store(on, Ordering::SeqCst);
    }

    /// The next time a client sends bytes containing `pattern`, they are forwarded, and from
    /// then on nothing the upstream sends reaches any client (it is read and dropped) until
    /// [`Self::unmute`]. See [`Self::muted`].
    pub fn mute_after(&self, pattern: &[u8]) {
        *self.shared.mute_on.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(pattern.to_vec());
    }

    /// True once `mute_after`'s bytes went by (and until `unmute`).
    pub fn muted(&self) -> bool {
        self.shared.muted.load(Ordering::SeqCst)
    }

    /// Forwards the upstream's bytes again (to connections made from now on, after a `cut_all`).
    pub fn unmute(&self) {
        self.shared.muted.store(false, Ordering::SeqCst);
    }

    /// Connections accepted and forwarded so far.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Connections reset because the relay was refusing (or the upstream was unreachable).
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::SeqCst)
    }

    /// Connections reset by `cut_all`.
    pub fn cut_count(&self) -> u64 {
        self.shared.cut.load(Ordering::SeqCst)
    }

    /// Connections being forwarded now.
    pub fn live(&self) -> usize {
        self.shared.live.load(Ordering::SeqCst)
    }

    /// Bytes forwarded (client → upstream, upstream → client).
    pub fn bytes(&self) -> (u64, u64) {
        (self.shared.bytes_up.load(Ordering::SeqCst), self.shared.bytes_down.load(Ordering::SeqCst))
    }
}

impl Drop for ChaosRelay {
    fn drop(&mut self) {
        // The senders drop right after this: every connection task sees its watch closed and
        // resets its sockets, so nothing the relay carried outlives it.
        self.accept_task.abort();
    }
}

/// SO_LINGER 0: closing the socket sends RST at once instead of FIN (an abrupt cut). The zero
/// timeout never blocks the thread, which is what tokio's deprecation of `set_linger` is about.
#[allow(deprecated)]
fn reset_on_close(s: &TcpStream) {
    let _ = s.set_linger(Some(Duration::ZERO));
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, stall_rx: watch::Receiver<bool>, cut_rx: watch::Receiver<u64>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            // Transient accept errors (e.g. EMFILE): do not spin.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = client.set_nodelay(true);
        reset_on_close(&client);
        if shared.refusing.load(Ordering::SeqCst) {
            shared.refused.fetch_add(1, Ordering::SeqCst);
            drop(client);
            continue;
        }
        let shared = shared.clone();
        let stall_rx = stall_rx.clone();
        let mut cut_rx = cut_rx.clone();
        // Only cuts from now on concern this connection.
        cut_rx.mark_unchanged();
        tokio::spawn(async move {
            let upstream = match tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(shared.upstream)).await {
                Ok(Ok(u)) => u,
                // The gateway is down: the client sees the same as a refused connection.
                _ => {
                    shared.refused.fetch_add(1, Ordering::SeqCst);
                    return;
                }
            };
            let _ = upstream.set_nodelay(true);
            reset_on_close(&upstream);
            shared.accepted.fetch_add(1, Ordering::SeqCst);
            shared.live.fetch_add(1, Ordering::SeqCst);
            let (cr, cw) = client.into_split();
            let (ur, uw) = upstream.into_split();
            tokio::join!(
                pump(cr, uw, &shared, Way::Up, stall_rx.clone(), cut_rx.clone()),
                pump(ur, cw, &shared, Way::Down, stall_rx, cut_rx),
            );
            shared.live.fetch_sub(1, Ordering::SeqCst);
            // Both halves of both sockets drop here: RST if the pumps ended by a cut.
        });
    }
}

/// Waits until the relay is not stalled. `false`: the connection is being cut (or the relay is
/// gone) and the pump must stop.
async fn wait_unstalled(stall_rx: &mut watch::Receiver<bool>, cut_rx: &mut watch::Receiver<u64>) -> bool {
    loop {
        if !*stall_rx.borrow_and_update() {
            return true;
        }
        tokio::select! {
            r = stall_rx.changed() => if r.is_err() { return false },
            _ = cut_rx.changed() => return false,
        }
    }
}

/// Which way a pump copies.
#[derive(Clone, Copy, PartialEq)]
enum Way {
    /// Client → upstream.
    Up,
    /// Upstream → client.
    Down,
}

/// Copies `from` → `to` until EOF (then half-closes `to`, as TCP would), an error, or a cut (then
/// resets: the socket closes with SO_LINGER 0 once the other direction lets go of it too).
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: &Shared,
    way: Way,
    stall_rx: watch::Receiver<bool>,
    cut_rx: watch::Receiver<u64>,
) {
    if copy(&mut from, &mut to, shared, way, stall_rx, cut_rx).await {
        let _ = to.shutdown().await;
    } else {
        // Dropping a write half would send FIN first (tokio shuts it down on drop), and the peer
        // would see an orderly close instead of the reset.
        to.forget();
    }
}

/// The copy loop of `pump`: `true` at EOF, `false` on an error or a cut.
async fn copy(
    from: &mut OwnedReadHalf,
    to: &mut OwnedWriteHalf,
    shared: &Shared,
    way: Way,
    mut stall_rx: watch::Receiver<bool>,
    mut cut_rx: watch::Receiver<u64>,
) -> bool {
    let counter = if way == Way::Up { &shared.bytes_up } else { &shared.bytes_down };
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // Stalled: read nothing, so the peers see backpressure rather than a sink.
        if !wait_unstalled(&mut stall_rx, &mut cut_rx).await {
            return false;
        }
        let n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) => return true,
                Ok(n) => n,
                Err(_) => return false,
            },
            _ = cut_rx.changed() => return false,
            // A stall began while waiting for bytes: `read` is cancel-safe, nothing is lost.
            r = stall_rx.changed() => {
                if r.is_err() {
                    return false;
                }
                continue;
            }
        };
        // A stall that began while these bytes were read holds them until `resume`.
        if !wait_unstalled(&mut stall_rx, &mut cut_rx).await {
            return false;
        }
        match way {
            // Muted before these bytes leave: the upstream's answer to them is never forwarded.
            Way::Up => {
                let mut mute_on = shared.mute_on.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if mute_on.as_ref().is_some_and(|p| !p.is_empty() && buf[..n].windows(p.len()).any(|w| w == p.as_slice())) {
                    *mute_on = None;
                    shared.muted.store(true, Ordering::SeqCst);
                }
            }
            Way::Down if shared.muted.load(Ordering::SeqCst) => continue,
            Way::Down => {}
        }
        tokio::select! {
            r = to.write_all(&buf[..n]) => if r.is_err() { return false },
            _ = cut_rx.changed() => return false,
        }
        counter.fetch_add(n as u64, Ordering::SeqCst);
    }
}

/// A relay in front of the PostgreSQL server `url` names, and the same URL through the relay (the
/// database of a replica the test will cut off).
pub async fn in_front_of_database(url: &str) -> (ChaosRelay, String) {
    let mut u = reqwest::Url::parse(url).expect("a database URL");
    let db: SocketAddr = format!("{}:{}", u.host_str().expect("a host"), u.port().expect("a port")).parse().expect("an address");
    let relay = ChaosRelay::start(db).await.expect("the relay starts");
    u.set_port(Some(relay.addr.port())).expect("a port");
    (relay, u.to_string())
}
