//! A client connection's byte stream with the request-header guard (SPEC §6).
//!
//! Pingora reads a request header with a per-read timeout only, so a client sending one
//! byte a second holds a connection forever, and its own HTTP-layer errors go out with
//! empty bodies. [`ClientStream`] wraps the accepted socket and, while a request header
//! is being read (the *header phase*), enforces:
//! - a total deadline: `client_header_timeout` from the accept, or from the first byte
//!   of a later request on a kept-alive connection (the idle wait before that byte is
//!   Pingora's keep-alive timeout). Past it, reads fail and the connection closes;
//! - a size limit ([`MAX_HEADER_BYTES`]): past it the client gets a 431 with the JSON
//!   error body and the connection closes;
//! - JSON error bodies: anything written during the header phase can only be Pingora's
//!   own error page, which the gateway writes for a header it refuses (a malformed
//!   header, a CONNECT) before it has seen a request; it is replaced by the same status with a JSON error body and
//!   `Connection: close`.
//!
//! Outside the header phase it coalesces small writes (up to [`WRITE_BUFFER`] bytes,
//! sent on flush or when full), as Pingora's own socket buffer does, so a response's
//! header and a short body leave in one send. Pingora flushes wherever a response must
//! go out. A write that does not fit goes out in one vectored send with what was held.
//!
//! The gateway may skip one flush it knows another follows at once
//! ([`ClientStream::hold_next_flush`]): Pingora flushes a chunked response's header and
//! every chunk, so an SSE answer whose header, body and last chunk are all in hand would
//! otherwise leave as three sends. Invariant: a skipped flush is never the last one
//! Pingora makes for a response (every response ends with a real flush), so what it
//! held goes out with that flush; a read of the connection starts sending it too, and
//! shutdown or drop send it. Bytes leave in the order they were written, ours included.
//!
//! The phase ends when the gateway, having read the header, calls
//! [`ClientStream::header_done`]: the
//! header parsed and the request is the gateway's from then on (the blank line alone
//! does not end it, because Pingora may still answer a header it cannot parse). The
//! connection loop re-arms it before every request. Outside the header phase the
//! wrapper only forwards.

use crate::clock::monotonic;
use crate::codes::ErrorCode;
use crate::config::Family;
use crate::error::ClientError;
use async_trait::async_trait;
use pingora::protocols::{Shutdown, Ssl, Stream};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

const BODY: u8 = 0;
const HEADER: u8 = 1;
/// A header phase was asked for and not yet started (see `next_request`).
const NEXT: u8 = 2;

/// Small writes are held up to this size (one TCP segment) until a flush.
pub const WRITE_BUFFER: usize = 1460;

/// While a flush is skipped, writes are held up to this size, so an answer whose
/// header, body and end are all in hand leaves in one send.
const HELD_MAX: usize = 16 * 1024;

/// Slices per vectored send: what is held, then the caller's (Pingora passes three).
const VECTOR: usize = 8;

/// Largest request header accepted (request line and fields, blank line included).
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

/// The accepted socket plus the header-phase guard.
#[derive(Debug)]
pub struct ClientStream {
    inner: Stream,
    header_timeout: Duration,
    /// [`BODY`], [`HEADER`] or [`NEXT`]; shared with the gateway, which only holds `&`.
    phase: AtomicU8,
    /// The header phase's deadline, once it started.
    deadline: Option<Instant>,
    timer: Option<Pin<Box<Sleep>>>,
    /// Header bytes seen so far this request (for the size limit), and whether its
    /// blank line was among them (then nothing more is counted).
    seen: usize,
    complete: bool,
    tail: [u8; 3],
    /// The request line named an Anthropic route (errors then use its shape).
    anthropic: bool,
    /// A response of ours still to be written, and whether the read side then fails.
    pending: Option<Pending>,
    /// Coalesced writes not yet sent.
    wbuf: Vec<u8>,
    /// The next flush is to be skipped (set and cleared by the gateway, which holds `&`).
    hold: AtomicBool,
    /// A flush was skipped and none has happened since.
    owed: bool,
}

#[derive(Debug)]
struct Pending {
    bytes: Vec<u8>,
    at: usize,
    /// After writing: fail reads (our own rejection) rather than report the write done.
    fail_reads: bool,
}

impl ClientStream {
    /// Wraps a freshly accepted socket; its first header phase starts now.
    pub fn new(inner: Stream, header_timeout: Duration) -> Self {
        ClientStream {
            inner,
            header_timeout,
            phase: AtomicU8::new(HEADER),
            deadline: Some(monotonic() + header_timeout),
            timer: None,
            seen: 0,
            complete: false,
            tail: [0; 3],
            anthropic: false,
            pending: None,
            wbuf: Vec::new(),
            hold: AtomicBool::new(false),
            owed: false,
        }
    }

    /// Skips the next flush: for one write call of the gateway's that Pingora flushes
    /// partway and again at its end (a chunked header followed by its first chunk, a
    /// last body chunk followed by the terminating one). Undone by [`Self::release_flush`]
    /// when the call returns, whether or not a flush came.
    pub fn hold_next_flush(&self) {
        self.hold.store(true, Ordering::Relaxed);
    }

    /// Ends [`Self::hold_next_flush`]: later flushes go out.
    pub fn release_flush(&self) {
        self.hold.store(false, Ordering::Relaxed);
    }

    /// How much may be held: more while a flush is skipped (the buffer shrinks back
    /// once sent).
    fn cap(&self) -> usize {
        if self.owed || self.hold.load(Ordering::Relaxed) {
            HELD_MAX
        } else {
            WRITE_BUFFER
        }
    }

    /// Appends to what is held (the caller checked it fits under [`Self::cap`]); the
    /// buffer is sized once: a segment, or [`HELD_MAX`] while a flush is skipped.
    fn keep<B: std::ops::Deref<Target = [u8]>>(&mut self, bufs: &[B]) {
        let need = self.wbuf.len() + bufs.iter().map(|b| b.len()).sum::<usize>();
        if need > self.wbuf.capacity() {
            let size = if need <= WRITE_BUFFER {
                WRITE_BUFFER
            } else {
                HELD_MAX
            };
            self.wbuf.reserve_exact(size - self.wbuf.len());
        }
        for b in bufs {
            self.wbuf.extend_from_slice(b);
        }
    }

    /// A write outside the header phase: held while it fits under [`Self::cap`], else
    /// sent after what is held in one vectored send.
    fn poll_write_body(
        &mut self,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if self.wbuf.len() + total <= self.cap() {
            self.keep(bufs);
            return Poll::Ready(Ok(total));
        }
        while !self.wbuf.is_empty() {
            let mut slices = [io::IoSlice::new(&[]); VECTOR];
            slices[0] = io::IoSlice::new(&self.wbuf);
            let n_bufs = bufs.len().min(VECTOR - 1);
            slices[1..=n_bufs].copy_from_slice(&bufs[..n_bufs]);
            let held = self.wbuf.len();
            let n = ready!(Pin::new(&mut self.inner).poll_write_vectored(cx, &slices[..=n_bufs]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            if n > held {
                self.wbuf.clear();
                return Poll::Ready(Ok(n - held));
            }
            self.wbuf.drain(..n);
        }
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    /// Sends what a skipped flush held back (a no-op unless one was skipped). Pending
    /// while the socket takes no more, with the waker registered.
    fn poll_owed(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.owed {
            if let Ok(()) = ready!(self.drain_wbuf(cx)) {
                let _ = ready!(Pin::new(&mut self.inner).poll_flush(cx));
            }
            self.flushed();
        }
        Poll::Ready(())
    }

    /// A real flush is done: nothing is owed, and a buffer grown for a skipped flush
    /// goes back to a segment.
    fn flushed(&mut self) {
        self.owed = false;
        if self.wbuf.capacity() > WRITE_BUFFER {
            self.wbuf.shrink_to(WRITE_BUFFER);
        }
    }

    /// Starts the header phase of the next request on a kept-alive connection: its
    /// clock starts with that request's first byte. (The state is reset at the next
    /// read, where the wrapper is held mutably.)
    pub fn next_request(&self) {
        self.phase.store(NEXT, Ordering::Relaxed);
    }

    fn reset(&mut self) {
        self.phase.store(HEADER, Ordering::Relaxed);
        self.deadline = None;
        self.timer = None;
        self.seen = 0;
        self.complete = false;
        self.tail = [0; 3];
        self.anthropic = false;
    }

    /// The gateway saw the whole header: the guard stands down for this request.
    pub fn header_done(&self) {
        self.phase.store(BODY, Ordering::Relaxed);
    }

    fn in_header(&self) -> bool {
        self.phase.load(Ordering::Relaxed) != BODY
    }

    /// Scans bytes just read in the header phase up to the blank line, queueing a 431
    /// once the header outgrows the limit.
    fn scan(&mut self, new: &[u8]) {
        if self.complete || new.is_empty() {
            return;
        }
        if self.seen == 0 {
            self.anthropic = first_line(new).windows(13).any(|w| w == b" /v1/messages");
        }
        // The byte `back` places before `new[i]`, reaching into the previous read.
        let tail = self.tail;
        let before = |i: usize, back: usize| -> u8 {
            if i >= back {
                new[i - back]
            } else {
                tail[3 - (back - i)]
            }
        };
        let end = memchr::memchr_iter(b'\n', new).find(|&i| {
            let p = before(i, 1);
            p == b'\n' || (p == b'\r' && before(i, 2) == b'\n')
        });
        let header_len = self.seen + end.map_or(new.len(), |i| i + 1);
        if header_len > MAX_HEADER_BYTES {
            let e = ClientError::new(
                ErrorCode::HeaderTooLarge,
                format!("request header exceeds {MAX_HEADER_BYTES} bytes"),
            );
            self.reject(e, true);
            return;
        }
        if end.is_some() {
            self.complete = true;
            return;
        }
        self.seen = header_len;
        for &b in &new[new.len().saturating_sub(3)..] {
            self.tail = [self.tail[1], self.tail[2], b];
        }
    }

    fn family(&self) -> Family {
        if self.anthropic {
            Family::Anthropic
        } else {
            Family::OpenAi
        }
    }

    fn reject(&mut self, e: ClientError, fail_reads: bool) {
        self.header_done();
        self.pending = Some(Pending {
            bytes: error_response(&e, self.family()),
            at: 0,
            fail_reads,
        });
    }

    /// Writes what is pending; `Ready` once it is all out (or the socket broke).
    fn drive_pending(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        // Anything still held goes first (a broken socket fails the response anyway).
        let _ = ready!(self.drain_wbuf(cx));
        while let Some(p) = self.pending.as_mut().filter(|p| p.at < p.bytes.len()) {
            match Pin::new(&mut self.inner).poll_write(cx, &p.bytes[p.at..]) {
                Poll::Ready(Ok(n)) if n > 0 => p.at += n,
                Poll::Ready(_) => p.at = p.bytes.len(),
                Poll::Pending => return Poll::Pending,
            }
        }
        let _ = ready!(Pin::new(&mut self.inner).poll_flush(cx));
        Poll::Ready(())
    }

    /// Sends the coalesced writes; `Ready(Ok)` once none is left.
    fn drain_wbuf(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.wbuf.is_empty() {
            match ready!(Pin::new(&mut self.inner).poll_write(cx, &self.wbuf)) {
                Ok(0) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Ok(n) => {
                    self.wbuf.drain(..n);
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        Poll::Ready(Ok(()))
    }

    /// `Ready(Err)` once the header deadline has passed.
    fn poll_deadline(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let Some(at) = self.deadline.filter(|_| self.in_header()) else {
            self.timer = None;
            return Poll::Pending;
        };
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at.into())));
        ready!(timer.as_mut().poll(cx));
        Poll::Ready(io::Error::new(
            io::ErrorKind::TimedOut,
            "client_header_timeout: the request header did not arrive in time",
        ))
    }
}

/// The request line (up to the first `\n`) of a buffer.
fn first_line(b: &[u8]) -> &[u8] {
    let end = b.iter().position(|&c| c == b'\n').unwrap_or(b.len());
    &b[..end]
}

/// A complete `Connection: close` response carrying `e` as the family's JSON error.
pub fn error_response(e: &ClientError, family: Family) -> Vec<u8> {
    let body = crate::proxy::respond::error_body(family, e);
    let status = e.status();
    let reason = http::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Error");
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

/// The client error a Pingora-written status stands for.
fn pingora_error(status: u16) -> ClientError {
    match status {
        405 => ClientError::new(ErrorCode::MethodNotAllowed, "method not allowed"),
        431 => ClientError::new(ErrorCode::HeaderTooLarge, "request header too large"),
        _ => ClientError::invalid_request("malformed HTTP request"),
    }
}

/// `NNN` of a buffer starting with `HTTP/1.x NNN`.
fn status_of(b: &[u8]) -> Option<u16> {
    let code = b.get(9..12)?;
    if !b.starts_with(b"HTTP/1.") {
        return None;
    }
    std::str::from_utf8(code).ok()?.parse().ok()
}

impl AsyncRead for ClientStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        // A write still owed does not hold the read up (a FIN, the header deadline):
        // when it is pending its waker is registered, and the next write or flush
        // finishes it anyway.
        let _ = this.poll_owed(cx);
        if let Some(fail) = this.pending.as_ref().map(|p| p.fail_reads) {
            ready!(this.drive_pending(cx));
            if fail {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "request rejected by the header guard",
                )));
            }
        }
        match this.phase.load(Ordering::Relaxed) {
            BODY => return Pin::new(&mut this.inner).poll_read(cx, buf),
            NEXT => this.reset(),
            _ => {}
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let new = &buf.filled()[before..];
                if !new.is_empty() {
                    if this.deadline.is_none() {
                        this.deadline = Some(monotonic() + this.header_timeout);
                    }
                    this.scan(new);
                    if this.pending.is_some() {
                        buf.set_filled(before);
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => match this.poll_deadline(cx) {
                Poll::Ready(e) => Poll::Ready(Err(e)),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl AsyncWrite for ClientStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.phase.load(Ordering::Relaxed) == NEXT {
            // A pipelined header Pingora had already buffered: nothing of the last
            // request's header state applies to it.
            this.reset();
        }
        if this.in_header() && this.pending.is_none() {
            // Only Pingora's own error response can be written before the gateway saw
            // the request: send the JSON version instead.
            let e = pingora_error(status_of(buf).unwrap_or(400));
            this.reject(e, false);
        }
        if this.pending.is_some() {
            ready!(this.drive_pending(cx));
            // Whatever Pingora writes after (its empty body) is swallowed.
            return Poll::Ready(Ok(buf.len()));
        }
        this.poll_write_body(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.pending.is_some() {
            ready!(this.drive_pending(cx));
        }
        if this.hold.swap(false, Ordering::Relaxed) {
            this.owed = true;
            return Poll::Ready(Ok(()));
        }
        ready!(this.drain_wbuf(cx))?;
        let flushed = ready!(Pin::new(&mut this.inner).poll_flush(cx));
        this.flushed();
        Poll::Ready(flushed)
    }

    /// Pingora writes a chunk as its size line, data and CRLF in one vectored call.
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let Some(first) = bufs.iter().find(|b| !b.is_empty()) else {
            return Poll::Ready(Ok(0));
        };
        if this.in_header() || this.pending.is_some() {
            // Nothing of ours is written in the header phase: one slice at a time.
            return Pin::new(this).poll_write(cx, first);
        }
        this.poll_write_body(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.pending.is_some() {
            ready!(this.drive_pending(cx));
        }
        let _ = ready!(this.drain_wbuf(cx));
        this.owed = false;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

/// A connection dropped without a flush (a stream cut on purpose, so the client sees a
/// broken body rather than a complete one) still sends what it had coalesced, when the
/// socket takes it at once: the header and bytes before the cut are not held back.
impl Drop for ClientStream {
    fn drop(&mut self) {
        if self.wbuf.is_empty() {
            return;
        }
        let mut cx = Context::from_waker(std::task::Waker::noop());
        if let Poll::Ready(Ok(())) = self.drain_wbuf(&mut cx) {
            let _ = Pin::new(&mut self.inner).poll_flush(&mut cx);
        }
    }
}

#[async_trait]
impl Shutdown for ClientStream {
    async fn shutdown(&mut self) {
        if self.pending.is_some() {
            std::future::poll_fn(|cx| self.drive_pending(cx)).await;
        }
        let _ = std::future::poll_fn(|cx| self.drain_wbuf(cx)).await;
        self.owed = false;
        self.inner.shutdown().await
    }
}

impl Ssl for ClientStream {}

crate::stream_wrap::forward_stream_traits!(ClientStream);

#[cfg(test)]
mod tests {
    use super::*;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use crate::stream_wrap::testing::{loopback, nothing_to_read};

    /// A connected loopback pair: (our wrapper of the accepted side, in its body
    /// phase; the client side).
    async fn pair() -> (ClientStream, TcpStream) {
        let (c, s) = loopback().await;
        (wrap(s), c)
    }

    fn wrap(s: TcpStream) -> ClientStream {
        let s: pingora::protocols::l4::stream::Stream = s.into();
        let cs = ClientStream::new(Box::new(s), Duration::from_secs(5));
        cs.header_done();
        cs
    }

    async fn read_n(s: &mut TcpStream, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut b))
            .await
            .expect("bytes never came")
            .unwrap();
        b
    }

    #[tokio::test]
    async fn a_held_flush_sends_nothing_and_the_next_flush_sends_both() {
        let (mut cs, mut client) = pair().await;
        cs.hold_next_flush();
        cs.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        cs.flush().await.unwrap();
        cs.release_flush();
        assert!(nothing_to_read(&mut client).await, "the held flush sent");
        cs.write_all(b"data").await.unwrap();
        cs.flush().await.unwrap();
        assert_eq!(
            read_n(&mut client, 23).await,
            b"HTTP/1.1 200 OK\r\n\r\ndata"
        );
        // Released: the next flush goes out again.
        cs.write_all(b"more").await.unwrap();
        cs.flush().await.unwrap();
        assert_eq!(read_n(&mut client, 4).await, b"more");
    }

    #[tokio::test]
    async fn a_release_without_a_flush_leaves_later_flushes_alone() {
        let (mut cs, mut client) = pair().await;
        cs.hold_next_flush();
        cs.release_flush();
        cs.write_all(b"header").await.unwrap();
        cs.flush().await.unwrap();
        assert_eq!(read_n(&mut client, 6).await, b"header");
    }

    #[tokio::test]
    async fn what_a_skipped_flush_held_goes_out_at_the_next_read() {
        let (mut cs, mut client) = pair().await;
        cs.hold_next_flush();
        cs.write_all(b"last").await.unwrap();
        cs.flush().await.unwrap();
        cs.release_flush();
        // The connection waits for the client's next request: the held bytes go first.
        let reader = tokio::spawn(async move {
            let mut b = [0u8; 8];
            let n = cs.read(&mut b).await.unwrap();
            b[..n].to_vec()
        });
        assert_eq!(read_n(&mut client, 4).await, b"last");
        client.write_all(b"next").await.unwrap();
        assert_eq!(reader.await.unwrap(), b"next");
    }

    #[tokio::test]
    async fn held_writes_grow_past_a_segment_and_vectored_writes_keep_order() {
        let (mut cs, mut client) = pair().await;
        let big = vec![b'x'; 3 * WRITE_BUFFER];
        // Slices that fit are held, all of them.
        let small = [
            io::IoSlice::new(b"3\r\n"),
            io::IoSlice::new(b"abc"),
            io::IoSlice::new(b"\r\n"),
        ];
        assert_eq!(cs.write_vectored(&small).await.unwrap(), 8);
        assert!(nothing_to_read(&mut client).await, "a small write was sent");
        // Past the segment size: what was held and every slice leave in one send
        // (loopback takes it all at once), in order.
        let bufs = [
            io::IoSlice::new(b"5\r\n"),
            io::IoSlice::new(&big),
            io::IoSlice::new(b"\r\n"),
        ];
        assert_eq!(cs.write_vectored(&bufs).await.unwrap(), 3 + big.len() + 2);
        cs.flush().await.unwrap();
        let mut want = b"3\r\nabc\r\n5\r\n".to_vec();
        want.extend_from_slice(&big);
        want.extend_from_slice(b"\r\n");
        assert_eq!(read_n(&mut client, want.len()).await, want);
        // While a flush is skipped, a body bigger than a segment is held with its end.
        cs.hold_next_flush();
        cs.write_all(&big).await.unwrap();
        cs.flush().await.unwrap();
        cs.write_all(b"0\r\n\r\n").await.unwrap();
        cs.release_flush();
        assert!(nothing_to_read(&mut client).await, "held bytes sent early");
        cs.flush().await.unwrap();
        let mut want = big.clone();
        want.extend_from_slice(b"0\r\n\r\n");
        assert_eq!(read_n(&mut client, want.len()).await, want);
    }

    #[tokio::test]
    async fn a_slow_reader_gets_every_byte_in_order_through_partial_vectored_sends() {
        use bytes::Buf;
        let (mut client, s) = loopback().await;
        // Small socket buffers: the sends below are taken a few KiB at a time.
        socket2::SockRef::from(&s)
            .set_send_buffer_size(4096)
            .unwrap();
        s.set_nodelay(true).unwrap();
        socket2::SockRef::from(&client)
            .set_recv_buffer_size(4096)
            .unwrap();
        let mut cs = wrap(s);
        let big: Vec<u8> = (0..50_000u32).map(|i| (i % 251) as u8).collect();
        let size_line = format!("{:X}\r\n", big.len());
        let mut want = b"HTTP/1.1 200 OK\r\n\r\n".to_vec();
        want.extend_from_slice(size_line.as_bytes());
        want.extend_from_slice(&big);
        want.extend_from_slice(b"\r\n0\r\n\r\n");
        let writer = tokio::spawn(async move {
            cs.hold_next_flush();
            cs.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
            cs.flush().await.unwrap();
            cs.release_flush();
            let mut chunk = bytes::Bytes::from(size_line)
                .chain(bytes::Bytes::from(big))
                .chain(bytes::Bytes::from_static(b"\r\n"));
            cs.write_all_buf(&mut chunk).await.unwrap();
            cs.write_all(b"0\r\n\r\n").await.unwrap();
            cs.flush().await.unwrap();
            cs
        });
        assert_eq!(read_n(&mut client, want.len()).await, want);
        tokio::time::timeout(Duration::from_secs(10), writer)
            .await
            .expect("the writer never finished")
            .unwrap();
    }

    #[tokio::test]
    async fn an_empty_vectored_write_in_the_header_phase_is_not_an_error_response() {
        let (mut client, s) = loopback().await;
        let s: pingora::protocols::l4::stream::Stream = s.into();
        let mut cs = ClientStream::new(Box::new(s), Duration::from_secs(5));
        let empty = [io::IoSlice::new(&[]), io::IoSlice::new(&[])];
        assert_eq!(cs.write_vectored(&empty).await.unwrap(), 0);
        cs.flush().await.unwrap();
        assert!(
            nothing_to_read(&mut client).await,
            "an error response was sent"
        );
    }

    #[test]
    fn statuses_of_pingora_responses() {
        assert_eq!(status_of(b"HTTP/1.1 400 Bad Request\r\n"), Some(400));
        assert_eq!(status_of(b"HTTP/1.0 405 x"), Some(405));
        assert_eq!(status_of(b"garbage"), None);
        assert_eq!(status_of(b"HTTP/1.1 4"), None);
    }

    #[test]
    fn error_responses_are_complete_json_with_close() {
        let r = error_response(&pingora_error(405), Family::Anthropic);
        let text = String::from_utf8(r).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(
            head.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"),
            "{head}"
        );
        assert!(head.contains("connection: close"));
        assert!(head.contains(&format!("content-length: {}", body.len())));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["code"], "method_not_allowed");
    }
}
