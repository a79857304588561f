//! Upstream HTTP/1.1 connections: Pingora's transport connector connects (TCP, TLS,
//! connect timeouts); Sluice keeps the idle ones and writes each request in one send.
//!
//! Pingora's own `Connector` costs two things per request that this module avoids
//! (measured in `bench/RESULTS.md`): its HTTP/1 session flushes the request header
//! before the body is written, so a small request leaves as two sends; and its pool
//! parks a watcher task on every idle connection, so taking one is a hand-off from that
//! task (a wake-up and a lock passed between tasks). Here [`OneSend`] holds written
//! bytes until the first read — an HTTP/1 client reads only after its request is
//! written — and an idle connection is a plain value in a per-peer list, newest last.
//!
//! Invariants: a connection is either in the list or in use, never both; one taken from
//! the list is checked without blocking first (closed by the upstream, or holding bytes
//! nobody asked for: dropped), is younger than its idle timeout, and is reported as
//! reused, so the attempt's stale-connection retry covers it; at most
//! [`IDLE_PER_PEER`] idle connections per peer, the oldest dropped first. Expired ones
//! are dropped whenever their peer's list is touched, and a sweeper task (started by the
//! first release) closes expired and upstream-closed ones everywhere every 10 s.

use crate::engine::state::lock;
use async_trait::async_trait;
use pingora::connectors::{ConnectorOptions, TransportConnector};
use pingora::protocols::http::client::HttpSession;
use pingora::protocols::http::v1::client::HttpSession as H1Session;
use pingora::protocols::tls::{SslDigest, TlsRef};
use pingora::protocols::{Shutdown, Ssl, Stream, ALPN};
use pingora::upstreams::peer::{HttpPeer, Peer};
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Idle connections kept per peer.
pub const IDLE_PER_PEER: usize = 128;

/// Every list is swept this often (expired and closed connections dropped, emptied peers
/// forgotten), so a peer that went quiet — no more traffic, a provider removed by a
/// reload, an address DNS no longer gives — keeps no socket past its idle timeout.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

struct Idle {
    stream: Stream,
    since: Instant,
    timeout: Duration,
}

impl Idle {
    fn expired(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.since) >= self.timeout
    }
}

/// The idle connections, by `HttpPeer::reuse_hash`, each list oldest first.
struct IdleSet {
    by_peer: HashMap<u64, Vec<Idle>>,
    total: usize,
    /// At most this many over all peers (the connector's `keepalive_pool_size`).
    cap: usize,
}

impl IdleSet {
    /// Moves the expired connections of `key` to `out`, to be closed once the lock is
    /// released.
    fn expire(&mut self, key: u64, now: Instant, out: &mut Vec<Idle>) {
        if let Some(list) = self.by_peer.get_mut(&key) {
            let before = out.len();
            take_out(list, out, |i| i.expired(now));
            self.total -= out.len() - before;
        }
    }

    /// Moves every expired or closed connection to `out` and forgets emptied peers.
    fn sweep(&mut self, now: Instant, out: &mut Vec<Idle>) {
        let before = out.len();
        self.by_peer.retain(|_, list| {
            take_out(list, out, |i| i.expired(now) || !still_open(&mut i.stream));
            !list.is_empty()
        });
        self.total -= out.len() - before;
    }
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
fn spawn_sweeper(idle: &Arc<Mutex<IdleSet>>) -> bool {
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
            let mut closed = Vec::new();
            lock(&idle).sweep(crate::clock::monotonic(), &mut closed);
            drop(closed);
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
    idle: Arc<Mutex<IdleSet>>,
    /// The sweeper task runs (started with the first release, on its runtime).
    sweeping: AtomicBool,
}

impl Upstreams {
    pub fn new(options: ConnectorOptions) -> Self {
        let cap = options.keepalive_pool_size;
        Self {
            multiplexing: pingora::connectors::http::Connector::new(Some(options.clone())),
            transport: TransportConnector::new(Some(options)),
            idle: Arc::new(Mutex::new(IdleSet {
                by_peer: HashMap::new(),
                total: 0,
                cap,
            })),
            sweeping: AtomicBool::new(false),
        }
    }

    /// An HTTP/1.1 session to `peer`: an idle connection if one is still good (`true`),
    /// else a new one.
    pub async fn session(&self, peer: &HttpPeer) -> pingora::Result<(HttpSession, bool)> {
        if super::transport::multiplexed(peer) {
            return Box::pin(self.multiplexing.get_http_session(peer)).await;
        }
        if let Some(stream) = self.take(pool_key(peer), crate::clock::monotonic()) {
            return Ok((session(stream, peer), true));
        }
        Ok((self.fresh(peer).await?, false))
    }

    /// A session on a new connection (the retry after a pooled one turned out closed:
    /// the upstream may have closed all its idle connections at once).
    ///
    /// Pingora's connect futures (TCP, TLS handshake, HTTP/2 setup) are boxed: inline,
    /// they made every request's future ~19 KB larger, held for a stream's whole life,
    /// although most requests take a pooled connection and never run them.
    pub async fn fresh(&self, peer: &HttpPeer) -> pingora::Result<HttpSession> {
        if super::transport::multiplexed(peer) {
            return Ok(Box::pin(self.multiplexing.get_http_session(peer)).await?.0);
        }
        let stream = Box::pin(self.transport.new_stream(peer)).await?;
        Ok(session(Box::new(OneSend::new(stream)), peer))
    }

    fn take(&self, key: u64, now: Instant) -> Option<Stream> {
        let mut closed = Vec::new();
        let found = loop {
            let mut idle = {
                let mut set = lock(&self.idle);
                set.expire(key, now, &mut closed);
                let Some(i) = set.by_peer.get_mut(&key).and_then(Vec::pop) else {
                    break None;
                };
                set.total -= 1;
                i
            };
            if still_open(&mut idle.stream) {
                break Some(idle.stream);
            }
            closed.push(idle);
        };
        // Closed outside the lock.
        drop(closed);
        found
    }

    /// Returns a session whose exchange ended: kept when the response was read to its
    /// end and both sides allow keep-alive, closed otherwise.
    pub async fn release(&self, session: HttpSession, peer: &HttpPeer, idle_timeout: Duration) {
        if super::transport::multiplexed(peer) {
            self.multiplexing
                .release_http_session(session, peer, Some(idle_timeout))
                .await;
            return;
        }
        let HttpSession::H1(mut h1) = session else {
            return;
        };
        h1.respect_keepalive();
        let Some(stream) = h1.reuse().await else {
            return;
        };
        if !self.sweeping.swap(true, Ordering::AcqRel) && !spawn_sweeper(&self.idle) {
            self.sweeping.store(false, Ordering::Release);
        }
        let now = crate::clock::monotonic();
        let key = pool_key(peer);
        let mut closed = Vec::new();
        {
            let mut set = lock(&self.idle);
            set.expire(key, now, &mut closed);
            let idle = Idle {
                stream,
                since: now,
                timeout: idle_timeout,
            };
            let full = set.total >= set.cap;
            let list = set.by_peer.entry(key).or_default();
            if full && list.is_empty() {
                closed.push(idle);
            } else {
                list.push(idle);
                // Over a cap: this peer's oldest goes.
                if full || list.len() > IDLE_PER_PEER {
                    closed.push(list.remove(0));
                } else {
                    set.total += 1;
                }
            }
        }
        drop(closed);
    }

    /// Idle connections kept now, over all peers.
    pub fn idle_count(&self) -> usize {
        lock(&self.idle).total
    }
}

/// The idle list of `peer`: Pingora's reuse hash, which covers the peer's group key and
/// with it the client worker (`proxy::transport::group_key`).
fn pool_key(peer: &HttpPeer) -> u64 {
    peer.reuse_hash()
}

fn session(stream: Stream, peer: &HttpPeer) -> HttpSession {
    HttpSession::H1(H1Session::new_with_options(stream, peer))
}

/// True when an idle connection has neither been closed nor sent anything: a read that
/// would block. (A byte read here is one nobody asked for: the connection is dropped.)
fn still_open(stream: &mut Stream) -> bool {
    let mut byte = [0u8; 1];
    let mut buf = ReadBuf::new(&mut byte);
    let mut cx = Context::from_waker(Waker::noop());
    // Outside the task's cooperative budget: a spent budget would read as "would block".
    let read = std::future::poll_fn(|cx| Pin::new(&mut *stream).poll_read(cx, &mut buf));
    let mut read = std::pin::pin!(tokio::task::unconstrained(read));
    matches!(read.as_mut().poll(&mut cx), Poll::Pending)
}

/// Bytes a [`OneSend`] holds before it writes them through.
const HOLD: usize = 16 * 1024;

/// A stream that holds what is written until the next read (or shutdown, or more than
/// [`HOLD`] bytes): the request header, which Pingora writes and flushes on its own,
/// leaves with the body in one send. Pingora's upstream TCP stream has no write buffer
/// of its own, so every write would otherwise be a send.
#[derive(Debug)]
pub struct OneSend {
    inner: Stream,
    /// Written by the caller, not yet to the stream below.
    held: Vec<u8>,
    /// Written to the stream below and not flushed since: a TLS layer takes bytes
    /// before they reach the socket, and only a flush pushes them out.
    unflushed: bool,
}

impl OneSend {
    pub fn new(inner: Stream) -> Self {
        Self {
            inner,
            held: Vec::new(),
            unflushed: false,
        }
    }

    /// Writes out what is held, then flushes the stream below until it is done.
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.held.is_empty() {
            match std::task::ready!(Pin::new(&mut self.inner).poll_write(cx, &self.held)) {
                Ok(0) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Ok(n) => {
                    self.held.drain(..n);
                    self.unflushed = true;
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        // An idle connection keeps little: a request's worth of capacity at most.
        if self.held.capacity() > 4096 {
            self.held = Vec::new();
        }
        if self.unflushed {
            std::task::ready!(Pin::new(&mut self.inner).poll_flush(cx))?;
            self.unflushed = false;
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for OneSend {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.drain(cx))?;
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for OneSend {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.held.len() + buf.len() > HOLD {
            std::task::ready!(this.drain(cx))?;
            if buf.len() > HOLD {
                let r = Pin::new(&mut this.inner).poll_write(cx, buf);
                if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
                    this.unflushed = true;
                }
                return r;
            }
        }
        this.held.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    /// Deferred: the bytes go with the next read, or at shutdown.
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.drain(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[async_trait]
impl Shutdown for OneSend {
    async fn shutdown(&mut self) {
        let _ = std::future::poll_fn(|cx| self.drain(cx)).await;
        self.inner.shutdown().await
    }
}

impl Ssl for OneSend {
    fn get_ssl(&self) -> Option<&TlsRef> {
        self.inner.get_ssl()
    }
    fn get_ssl_digest(&self) -> Option<Arc<SslDigest>> {
        self.inner.get_ssl_digest()
    }
    fn selected_alpn_proto(&self) -> Option<ALPN> {
        self.inner.selected_alpn_proto()
    }
}

crate::stream_wrap::forward_stream_traits!(OneSend);

#[cfg(test)]
mod tests {
    use super::*;
    use pingora::protocols::raw_connect::ProxyDigest;
    use pingora::protocols::{
        GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, SocketDigest, TimingDigest,
        UniqueID, UniqueIDType,
    };
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use crate::stream_wrap::testing::{loopback, nothing_to_read};

    /// A connected loopback pair: (Pingora stream of the client side, server side).
    async fn pair() -> (Stream, TcpStream) {
        let (c, s) = loopback().await;
        let c: pingora::protocols::l4::stream::Stream = c.into();
        (Box::new(c), s)
    }

    #[tokio::test]
    async fn writes_are_held_until_the_first_read_then_leave_together() {
        let (c, mut server) = pair().await;
        let mut c = OneSend::new(c);
        c.write_all(b"POST / HTTP/1.1\r\ncontent-length: 4\r\n\r\n")
            .await
            .unwrap();
        c.flush().await.unwrap();
        c.write_all(b"body").await.unwrap();
        c.flush().await.unwrap();
        assert!(nothing_to_read(&mut server).await, "sent before the read");
        // The client starts reading its answer: the request goes first, in one piece.
        let reader = tokio::spawn(async move {
            let mut b = [0u8; 8];
            let n = c.read(&mut b).await.unwrap();
            b[..n].to_vec()
        });
        let mut got = vec![0u8; 256];
        let n = server.read(&mut got).await.unwrap();
        assert_eq!(
            &got[..n],
            b"POST / HTTP/1.1\r\ncontent-length: 4\r\n\r\nbody"
        );
        server.write_all(b"ok").await.unwrap();
        assert_eq!(reader.await.unwrap(), b"ok");
    }

    #[tokio::test]
    async fn a_large_write_goes_through_without_waiting_for_a_read() {
        let (c, mut server) = pair().await;
        let mut c = OneSend::new(c);
        let big = vec![b'x'; HOLD + 1];
        c.write_all(b"head").await.unwrap();
        c.write_all(&big).await.unwrap();
        let mut got = vec![0u8; 4 + big.len()];
        tokio::time::timeout(Duration::from_secs(10), server.read_exact(&mut got))
            .await
            .expect("the large write did not go through")
            .unwrap();
        assert_eq!(&got[..4], b"head");
        assert!(got[4..].iter().all(|&b| b == b'x'));
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
            stream,
            since: now,
            timeout,
        };
        {
            let mut set = lock(&pool.idle);
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
        got.write_all(b"hi").await.unwrap();
        got.flush().await.unwrap();
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
            stream,
            since: now,
            timeout,
        };
        let long = Duration::from_secs(60);
        let mut set = lock(&pool.idle);
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

    #[test]
    fn a_read_flushes_the_stream_below_whatever_the_write_size() {
        for size in [10, HOLD + 1] {
            let sealed = Sealed::default();
            let sent = sealed.sent.clone();
            let mut s = OneSend::new(Box::new(sealed));
            let body = vec![b'b'; size];
            let mut cx = Context::from_waker(Waker::noop());
            for part in [&b"head"[..], &body] {
                let mut done = 0;
                while done < part.len() {
                    match Pin::new(&mut s).poll_write(&mut cx, &part[done..]) {
                        Poll::Ready(Ok(n)) => done += n,
                        other => panic!("write: {other:?}"),
                    }
                }
                assert!(Pin::new(&mut s).poll_flush(&mut cx).is_ready());
            }
            let mut b = [0u8; 1];
            let mut buf = ReadBuf::new(&mut b);
            assert!(Pin::new(&mut s).poll_read(&mut cx, &mut buf).is_pending());
            let sent = lock(&sent).clone();
            assert_eq!(sent.len(), 4 + size, "{size}: bytes left below the wrapper");
            assert_eq!(&sent[..4], b"head");
        }
    }
}
