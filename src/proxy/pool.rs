//! Upstream HTTP/1.1 connections: Pingora's transport connector connects (TCP, TLS,
//! connect timeouts); Sluice keeps the idle ones, and speaks HTTP/1.1 on them with its
//! own codec (`proxy::h1`), which writes each request in one send.
//!
//! Pingora's own `Connector` parks a watcher task on every idle connection, so taking
//! one is a hand-off from that task (a wake-up and a lock passed between tasks). Here an
//! idle connection is a plain value in a per-peer list, newest last.
//!
//! Invariants: a connection is either in the list or in use, never both; one taken from
//! the list is checked without blocking first (closed by the upstream, or holding bytes
//! nobody asked for: dropped), is younger than its idle timeout, and is reported as
//! reused, so the attempt's stale-connection retry covers it; at most
//! [`IDLE_PER_PEER`] idle connections per peer, the oldest dropped first. The oldest
//! expired ones are dropped whenever their peer's list is touched, and a sweeper task
//! (started by the first release) closes expired and upstream-closed ones everywhere
//! every 10 s.
//!
//! An upstream is named to the pool by a [`Dest`]: the key of its idle list and how to
//! make the Pingora peer a new connection needs. Sluice's (`proxy::transport::Upstream`)
//! computes the key from what the peer would be made of and builds the peer only when a
//! connection is opened, so a request on a pooled connection builds none.
//!
//! A client worker only ever uses the connections it opened (`proxy::transport`), so
//! the idle lists are kept per worker, each behind its own lock on its own cache line:
//! the workers never write a line they share to take or return a connection. The
//! `keepalive_pool_size` cap holds per worker.

use super::h1::H1;
use super::upconn::UpConn;
use crate::engine::state::lock;
use foldhash::HashMap;
use futures::future::BoxFuture;
use pingora::connectors::{ConnectorOptions, TransportConnector};
use pingora::upstreams::peer::HttpPeer;
use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Shards of the idle lists: client workers beyond this share shards (by index).
const SHARDS: usize = 16;

/// One worker's idle lists, alone on its cache lines.
#[repr(align(128))]
struct Shard(Mutex<IdleSet>);

/// Idle connections kept per peer.
pub const IDLE_PER_PEER: usize = 128;

/// Every list is swept this often (expired and closed connections dropped, emptied peers
/// forgotten), so a peer that went quiet — no more traffic, a provider removed by a
/// reload, an address DNS no longer gives — keeps no socket past its idle timeout.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

struct Idle {
    conn: H1,
    since: Instant,
    timeout: Duration,
}

impl Idle {
    fn expired(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.since) >= self.timeout
    }
}

/// An upstream as the pool sees it.
///
/// Two destinations may share a key only when their peers would be the same (address,
/// TLS settings and files, SNI, HTTP versions) and they belong to the same client worker:
/// a connection taken from a list is used as if it had been made for the asker.
pub trait Dest {
    /// The key of this upstream's idle HTTP/1.1 connections.
    fn key(&self) -> u64;
    /// Whether it may speak HTTP/2 (Pingora's connector then keeps its connections).
    fn multiplexed(&self) -> bool;
    /// The peer a new connection, or an HTTP/2 session, is made to.
    fn peer(&self) -> Cow<'_, HttpPeer>;
}

/// The idle connections, by [`Dest::key`], each list oldest first.
struct IdleSet {
    by_peer: HashMap<u64, Vec<Idle>>,
    total: usize,
    /// At most this many over all peers (the connector's `keepalive_pool_size`).
    cap: usize,
}

impl IdleSet {
    /// The newest idle connection of `key`, after the expired ones at the front of its
    /// list (the oldest) went to `out`, to be closed once the lock is released.
    fn take(&mut self, key: u64, now: Instant, out: &mut Vec<Idle>) -> Option<Idle> {
        let list = self.by_peer.get_mut(&key)?;
        self.total -= expire(list, now, out);
        let idle = list.pop()?;
        self.total -= 1;
        Some(idle)
    }

    /// Keeps `idle` as `key`'s newest, within the caps; what goes (expired, over a cap,
    /// or `idle` itself when the pool is full) is moved to `out`.
    fn put(&mut self, key: u64, idle: Idle, out: &mut Vec<Idle>) {
        let list = self.by_peer.entry(key).or_default();
        let expired = expire(list, idle.since, out);
        self.total -= expired;
        let full = self.total >= self.cap;
        if full && list.is_empty() {
            out.push(idle);
            return;
        }
        list.push(idle);
        // Over a cap: this peer's oldest goes.
        if full || list.len() > IDLE_PER_PEER {
            out.push(list.remove(0));
        } else {
            self.total += 1;
        }
    }

    /// Moves every expired or closed connection to `out` and forgets emptied peers.
    fn sweep(&mut self, now: Instant, out: &mut Vec<Idle>) {
        let before = out.len();
        self.by_peer.retain(|_, list| {
            take_out(list, out, |i| i.expired(now) || !i.conn.still_open());
            !list.is_empty()
        });
        self.total -= out.len() - before;
    }
}

/// Moves the expired connections at the front of `list` (the oldest) to `out`; returns
/// how many. Only the oldest are looked at, so a busy peer's long list is not walked per
/// request; one that expired behind a younger one (a shorter idle timeout) is dropped
/// when taken or by the sweeper.
fn expire(list: &mut Vec<Idle>, now: Instant, out: &mut Vec<Idle>) -> usize {
    let n = list.iter().take_while(|i| i.expired(now)).count();
    if n > 0 {
        out.extend(list.drain(..n));
    }
    n
}

/// Moves the entries of `list` that `gone` picks to `out`, keeping the order of the rest
/// (in place: no allocation on the request path).
fn take_out(list: &mut Vec<Idle>, out: &mut Vec<Idle>, mut gone: impl FnMut(&mut Idle) -> bool) {
    let mut i = 0;
    while i < list.len() {
        if gone(&mut list[i]) {
            out.push(list.remove(i));
        } else {
            i += 1;
        }
    }
}

/// Every `SWEEP_EVERY`, until the pool is dropped: closes what expired or what the
/// upstream closed, on every peer, so a peer that went quiet keeps no socket.
fn spawn_sweeper(idle: &Arc<[Shard]>) -> bool {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return false;
    };
    let idle = Arc::downgrade(idle);
    rt.spawn(async move {
        loop {
            tokio::time::sleep(SWEEP_EVERY).await;
            let Some(idle) = idle.upgrade() else {
                return;
            };
            for shard in idle.iter() {
                let mut closed = Vec::new();
                lock(&shard.0).sweep(crate::clock::monotonic(), &mut closed);
                drop(closed);
            }
        }
    });
    true
}

/// Connects to upstreams and keeps their idle HTTP/1.1 connections. Peers that may
/// speak HTTP/2 go through Pingora's HTTP connector instead, which negotiates by ALPN
/// and multiplexes its HTTP/2 connections (`proxy::transport`).
pub struct Upstreams {
    transport: TransportConnector,
    multiplexing: pingora::connectors::http::Connector,
    /// The idle lists, one shard per client worker (by `server::workers::current`).
    idle: Arc<[Shard]>,
    /// The sweeper task runs (started with the first release, on its runtime).
    sweeping: AtomicBool,
}

impl Upstreams {
    pub fn new(options: ConnectorOptions) -> Self {
        let cap = options.keepalive_pool_size;
        Self {
            multiplexing: pingora::connectors::http::Connector::new(Some(options.clone())),
            transport: TransportConnector::new(Some(options)),
            idle: (0..SHARDS)
                .map(|_| {
                    Shard(Mutex::new(IdleSet {
                        by_peer: HashMap::default(),
                        total: 0,
                        cap,
                    }))
                })
                .collect(),
            sweeping: AtomicBool::new(false),
        }
    }

    /// An HTTP/1.1 session to `to`: an idle connection if one is still good (`true`),
    /// else a new one.
    pub async fn session(&self, to: &impl Dest) -> pingora::Result<(UpConn, bool)> {
        // The paths that need a peer (~670 bytes) are boxed with it (a new connection in
        // `fresh`), so the pooled path's state, held in every connection's task, stays
        // small.
        if to.multiplexed() {
            return Box::pin(async move {
                let peer = to.peer();
                let (s, reused) = self.multiplexing.get_http_session(&*peer).await?;
                Ok((UpConn::H2(Box::new(s)), reused))
            })
            .await;
        }
        if let Some(conn) = self.take(to.key(), crate::clock::monotonic()) {
            return Ok((UpConn::H1(conn), true));
        }
        Ok((self.fresh(to.peer()).await?, false))
    }

    /// A session on a new connection (the retry after a pooled one turned out closed:
    /// the upstream may have closed all its idle connections at once).
    ///
    /// Boxed once, with the peer it connects to: Pingora's connect futures (TCP, TLS
    /// handshake, HTTP/2 setup) and a peer (~670 bytes) would otherwise sit in every
    /// connection's task (they made it ~19 KB larger, held for a stream's whole life),
    /// although most requests take a pooled connection and never run them. The same
    /// holds for everything else that is rare and large in a connection's task (an
    /// HTTP/2 release, an error response held for pass-through): a task's state that
    /// no request writes still spreads the parts that every request does write over
    /// more cache lines, and a larger task costs more to copy in.
    pub fn fresh<'a>(&'a self, peer: Cow<'a, HttpPeer>) -> BoxFuture<'a, pingora::Result<UpConn>> {
        Box::pin(async move {
            if super::transport::multiplexed(&peer) {
                let (s, _) = self.multiplexing.get_http_session(&*peer).await?;
                return Ok(UpConn::H2(Box::new(s)));
            }
            let stream = self.transport.new_stream(&*peer).await?;
            Ok(UpConn::H1(H1::new(stream)))
        })
    }

    fn take(&self, key: u64, now: Instant) -> Option<H1> {
        let mut closed = Vec::new();
        let found = loop {
            let Some(mut idle) = lock(self.shard()).take(key, now, &mut closed) else {
                break None;
            };
            if !idle.expired(now) && idle.conn.still_open() {
                break Some(idle.conn);
            }
            closed.push(idle);
        };
        // Closed outside the lock.
        drop(closed);
        found
    }

    /// Returns a session whose exchange ended: kept when the response was read to its
    /// end and both sides allow keep-alive, closed otherwise.
    pub async fn release(&self, session: UpConn, to: &impl Dest, idle_timeout: Duration) {
        let h1 = match session {
            UpConn::H2(h2) => {
                // Boxed with the peer it needs: Pingora's release future and an
                // HttpPeer (~3.6 KB) would otherwise sit in every connection's task.
                Box::pin(async move {
                    let peer = to.peer();
                    let h2 = *h2;
                    self.multiplexing
                        .release_http_session(h2, &*peer, Some(idle_timeout))
                        .await;
                })
                .await;
                return;
            }
            UpConn::H1(h1) => h1,
        };
        let Some(conn) = h1.into_idle() else {
            return;
        };
        // Read first: a swap per release would write a line every worker shares.
        if !self.sweeping.load(Ordering::Acquire)
            && !self.sweeping.swap(true, Ordering::AcqRel)
            && !spawn_sweeper(&self.idle)
        {
            self.sweeping.store(false, Ordering::Release);
        }
        let now = crate::clock::monotonic();
        let key = to.key();
        let mut closed = Vec::new();
        let idle = Idle {
            conn,
            since: now,
            timeout: idle_timeout,
        };
        lock(self.shard()).put(key, idle, &mut closed);
        drop(closed);
    }

    /// The calling worker's idle lists (shard 0 off the client workers).
    fn shard(&self) -> &Mutex<IdleSet> {
        let i = crate::server::workers::current() as usize % SHARDS;
        &self.idle[i].0
    }

    /// Idle connections kept now, over all peers.
    pub fn idle_count(&self) -> usize {
        self.idle.iter().map(|s| lock(&s.0).total).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_trait::async_trait;
    use pingora::protocols::raw_connect::ProxyDigest;
    use pingora::protocols::Stream;
    use pingora::protocols::{
        GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl,
        TimingDigest, UniqueID, UniqueIDType,
    };
    use std::io;
    use std::pin::Pin;
    use std::task::{Context, Poll};
    use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
    use tokio::net::TcpStream;

    use crate::test_net::loopback;

    /// A connected loopback pair: (Pingora stream of the client side, server side).
    async fn pair() -> (Stream, TcpStream) {
        let (c, s) = loopback().await;
        let c: pingora::protocols::l4::stream::Stream = c.into();
        (Box::new(c), s)
    }

    #[tokio::test]
    async fn taking_skips_closed_and_expired_connections() {
        let pool = Upstreams::new(ConnectorOptions::new(8));
        let now = crate::clock::monotonic();
        let (expired, _s1) = pair().await;
        let (closed, s2) = pair().await;
        let (good, mut s3) = pair().await;
        drop(s2);
        // Let the FIN arrive.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let idle = |stream, timeout| Idle {
            conn: H1::new(stream),
            since: now,
            timeout,
        };
        {
            let mut set = lock(pool.shard());
            set.by_peer.insert(
                7,
                vec![
                    idle(good, Duration::from_secs(60)),
                    idle(closed, Duration::from_secs(60)),
                    idle(expired, Duration::ZERO),
                ],
            );
            set.total = 3;
        }
        let mut got = pool.take(7, now).expect("the good connection");
        assert_eq!(
            pool.idle_count(),
            0,
            "the closed and the expired one are gone"
        );
        assert!(pool.take(7, now).is_none());
        // It is the open one: bytes written on it arrive.
        got.send(b"hi".to_vec(), [b"", b"", b""]).await.unwrap();
        let mut b = [0u8; 2];
        s3.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"hi");
    }

    #[tokio::test]
    async fn a_sweep_closes_expired_and_closed_connections_of_every_peer() {
        let pool = Upstreams::new(ConnectorOptions::new(8));
        let now = crate::clock::monotonic();
        let (expired, _s1) = pair().await;
        let (closed, s2) = pair().await;
        let (good, _s3) = pair().await;
        drop(s2);
        tokio::time::sleep(Duration::from_millis(20)).await;
        let idle = |stream, timeout| Idle {
            conn: H1::new(stream),
            since: now,
            timeout,
        };
        let long = Duration::from_secs(60);
        let mut set = lock(pool.shard());
        set.by_peer.insert(1, vec![idle(expired, Duration::ZERO)]);
        set.by_peer
            .insert(2, vec![idle(closed, long), idle(good, long)]);
        set.total = 3;
        let mut out = Vec::new();
        set.sweep(now, &mut out);
        assert_eq!(out.len(), 2, "the expired and the closed one");
        assert_eq!(set.total, 1);
        assert!(
            !set.by_peer.contains_key(&1),
            "an emptied peer is forgotten"
        );
        assert_eq!(set.by_peer[&2].len(), 1);
    }

    /// A stream below that keeps written bytes until it is flushed, as TLS does.
    #[derive(Debug, Default)]
    struct Sealed {
        written: Vec<u8>,
        sent: Arc<Mutex<Vec<u8>>>,
    }

    impl AsyncRead for Sealed {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Poll::Pending
        }
    }

    impl AsyncWrite for Sealed {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.get_mut().written.extend_from_slice(buf);
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            let this = self.get_mut();
            lock(&this.sent).append(&mut this.written);
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[async_trait]
    impl Shutdown for Sealed {
        async fn shutdown(&mut self) {}
    }
    impl UniqueID for Sealed {
        fn id(&self) -> UniqueIDType {
            0
        }
    }
    impl Ssl for Sealed {}
    impl GetTimingDigest for Sealed {
        fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
            Vec::new()
        }
    }
    impl GetProxyDigest for Sealed {
        fn get_proxy_digest(&self) -> Option<Arc<ProxyDigest>> {
            None
        }
    }
    impl GetSocketDigest for Sealed {
        fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
            None
        }
    }
    impl Peek for Sealed {}

    #[tokio::test]
    async fn a_request_reaches_a_stream_that_holds_bytes_until_flushed_whatever_its_size() {
        for size in [10, 100_000] {
            let sealed = Sealed::default();
            let sent = sealed.sent.clone();
            let mut up = H1::new(Box::new(sealed));
            let body = vec![b'b'; size];
            up.send(b"head".to_vec(), [&body[..1], b"", &body[1..]])
                .await
                .unwrap();
            let sent = lock(&sent).clone();
            assert_eq!(
                sent.len(),
                4 + size,
                "{size}: bytes left below the connection"
            );
            assert_eq!(&sent[..4], b"head");
        }
    }
}
