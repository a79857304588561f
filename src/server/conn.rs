//! One client connection on Sluice's HTTP/1 codec (SPEC §3, §6 server; issue #9).
//!
//! What it protects: the client half of a request's CPU, and the gateway from slow,
//! idle and malformed clients. The socket is read into one buffer that holds heads,
//! bodies and pipelined requests; a response's head is written into another and leaves
//! with the first body bytes in one send.
//!
//! Invariants:
//! - a request head arrives within `client_header_timeout` — from the accept for the
//!   first request, from its first byte for a later one — and is at most
//!   [`MAX_HEADER_BYTES`]; beyond that the client gets a 431 with the family's JSON
//!   error body; a malformed head gets a 400, a `CONNECT` a 405; each then closes the
//!   connection;
//! - an idle kept-alive connection closes after `keepalive_timeout`, and at once when
//!   the server shuts down; a request whose head is arriving is not cut by the shutdown;
//!   one that has sent nothing of its first request gets [`DRAIN_GRACE`] once a drain
//!   begins;
//! - a request body never pauses longer than `client_body_timeout` between reads, and a
//!   body declared larger than the caller's limit is refused before it is read;
//! - a response is framed by its length, by chunks (HTTP/1.1) or by the close
//!   (HTTP/1.0); the connection carries another request only after a complete response
//!   to a request whose body was read whole, when both sides keep it alive and the
//!   server is not stopping;
//! - a client that takes no response bytes for [`SEND_TIMEOUT`] is cut;
//! - pipelined requests are answered in order: bytes that arrive early stay in the
//!   buffer, including those seen while watching for a disconnect.

use super::frontdoor::ClientLimits;
use crate::codes::ErrorCode;
use crate::config::Family;
use crate::error::ClientError;
use crate::http1::head::parse_request;
use crate::http1::wire::{self, ChunkLine, LAST_CHUNK};
use crate::http1::{BodyLen, BodyReader, Piece, RequestHead};
use bytes::{Buf, Bytes, BytesMut};
use futures::FutureExt;
use pingora::server::ShutdownWatch;
use std::io;
use std::pin::Pin;
use std::task::Poll;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Sleep;

/// Largest request head accepted (request line and fields, blank line included).
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

/// A client that takes no response bytes for this long (its receive window stays shut)
/// is cut: it would hold its connection slot, an upstream socket and its permits.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(60);

/// Body bytes copied behind a response head (or a chunk's size line) so both leave in one
/// send; a larger piece follows in the same vectored write.
const COPY_BODY: usize = 16 * 1024;

/// How long a connection that has sent nothing yet may still bring its first request
/// once a drain begins.
const DRAIN_GRACE: Duration = Duration::from_secs(1);

/// Room made in the read buffer before each read.
const READ_ROOM: usize = 4 * 1024;

/// A request body is split off the read buffer without a copy, so the two share one
/// allocation; when that is larger than this, the buffer is replaced by one of its own,
/// so a long stream after a large prompt does not keep the prompt's memory.
const SHARED_BUFFER: usize = 16 * 1024;

/// The response buffer is let go when it grew past this (a large head or error body).
const KEEP_OUT: usize = 8 * 1024;

/// Closing with a request body still arriving: its bytes are read and dropped for at
/// most this long and this many bytes after the response, so the close does not reset
/// the connection (which may discard the response before the client read it).
const LINGER: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 1024 * 1024;

/// How a response body is delimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodySize {
    /// Exactly this many bytes (`Content-Length`).
    Exactly(u64),
    /// Not known: chunked to an HTTP/1.1 client, to the close for HTTP/1.0.
    Unknown,
    /// No body (204, 304).
    None,
}

/// Where the response to the current request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Out {
    /// Nothing written yet.
    Nothing,
    /// The head is written (maybe not sent yet); the body goes out as framed.
    Body(Framing),
    /// Complete.
    Done,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Framing {
    Length,
    Chunked,
    Close,
    Empty,
}

/// Why a request body could not be read.
#[derive(Debug)]
pub enum BodyFail {
    /// Larger than the caller's limit.
    TooLarge,
    /// It stopped arriving for `client_body_timeout`.
    Timeout,
    /// Its framing is broken, or the connection failed or closed inside it.
    Broken(String),
}

/// The next request on a connection, or its end.
pub enum Incoming {
    Request(RequestHead),
    /// The client closed, timed out, was refused, or the server is stopping.
    End,
}

/// One client connection.
pub struct ClientConn {
    io: TcpStream,
    buf: BytesMut,
    out: Vec<u8>,
    limits: ClientLimits,
    accepted: Instant,
    /// The idle and header waits; reset per wait, allocated once.
    timer: Pin<Box<Sleep>>,
    /// The request path's waits ([`ClientConn::watch`]): made at the first, then kept
    /// registered, so a later wait's later deadline only moves it (no timer-wheel
    /// insertion and removal per wait). Apart from `timer`, whose idle deadline would
    /// otherwise alternate with the waits' and be re-inserted each time.
    waits: Option<Pin<Box<Sleep>>>,
    shutdown: ShutdownWatch,
    draining: watch::Receiver<bool>,
    /// The server is stopping and the connection knows it: stopping when it was
    /// accepted, or a drain seen while waiting (a watch marks a value it waited for as
    /// seen, so `has_changed` no longer shows it).
    stop_seen: bool,
    served: u64,
    /// Bytes at the front of `buf` already searched for the end of a head.
    scanned: usize,
    // The current request.
    body: BodyReader,
    continue_owed: bool,
    http11: bool,
    /// A `HEAD` request: its response has fields but never a body.
    head_only: bool,
    keep_alive: bool,
    response: Out,
    sent: u64,
    /// Body bytes a `Content-Length` response still owes.
    owed: u64,
}

impl ClientConn {
    pub fn new(
        io: TcpStream,
        limits: ClientLimits,
        accepted: Instant,
        shutdown: ShutdownWatch,
        draining: watch::Receiver<bool>,
    ) -> ClientConn {
        ClientConn {
            io,
            buf: BytesMut::new(),
            out: Vec::new(),
            timer: Box::pin(tokio::time::sleep_until(
                (accepted + limits.header_timeout).into(),
            )),
            waits: None,
            limits,
            accepted,
            stop_seen: *shutdown.borrow() || *draining.borrow(),
            shutdown,
            draining,
            served: 0,
            scanned: 0,
            body: BodyReader::new(BodyLen::Empty),
            continue_owed: false,
            http11: true,
            head_only: false,
            keep_alive: false,
            response: Out::Done,
            sent: 0,
            owed: 0,
        }
    }

    /// The server is stopping (drain or shutdown): no more keep-alive. Both watches
    /// only ever turn true, and the connection marks a value seen only when it ends on
    /// it, so an unchanged version says "not stopping" without taking the watch's lock.
    fn stopping(&self) -> bool {
        let set = |w: &watch::Receiver<bool>| !matches!(w.has_changed(), Ok(false)) && *w.borrow();
        self.stop_seen || set(&self.shutdown) || set(&self.draining)
    }

    /// Reads the next request's head. Refused heads are answered here (and end the
    /// connection); so do a close, a timeout, and a shutdown while idle.
    pub async fn next_request(&mut self) -> Incoming {
        let mut deadline = (self.served == 0).then(|| self.accepted + self.limits.header_timeout);
        // Set by a drain while nothing has arrived: the end of the grace.
        let mut grace_until: Option<Instant> = None;
        if self.out.capacity() > KEEP_OUT {
            self.out = Vec::new();
        }
        loop {
            if !self.buf.is_empty() {
                match self.parse_head() {
                    Ok(Some((head, n))) => {
                        self.buf.advance(n);
                        self.scanned = 0;
                        return self.begin(head).await;
                    }
                    // The head is not all here: from its first bytes, it has the header
                    // timeout (a whole head in one read needs no clock).
                    Ok(None) if self.buf.len() < MAX_HEADER_BYTES => {
                        if deadline.is_none() {
                            deadline = Some(crate::clock::monotonic() + self.limits.header_timeout);
                        }
                    }
                    Ok(None) => {
                        let e = ClientError::new(
                            ErrorCode::HeaderTooLarge,
                            format!("request header exceeds {MAX_HEADER_BYTES} bytes"),
                        );
                        return self.refuse(e).await;
                    }
                    Err(e) => {
                        let e =
                            ClientError::invalid_request(format!("malformed HTTP request: {e}"));
                        return self.refuse(e).await;
                    }
                }
            }
            let until = match deadline {
                // Once a byte arrived, the head has its whole header timeout.
                Some(d) if self.buf.is_empty() => grace_until.map_or(d, |g| g.min(d)),
                Some(d) => d,
                // Kept alive when the last response was written (not while stopping).
                None if self.keep_alive => {
                    crate::clock::monotonic() + self.limits.keepalive_timeout
                }
                None => return Incoming::End,
            };
            self.timer.as_mut().reset(until.into());
            reserve(&mut self.buf);
            // No byte of a request yet: a shutdown ends the connection. A drain gives one
            // that has not brought its first request [`DRAIN_GRACE`] more (a client that
            // connected as the drain began is about to send; the drain would otherwise
            // wait out the header timeout for one that never does).
            let silent = self.buf.is_empty();
            let graced = silent && self.served == 0 && grace_until.is_none();
            let read = tokio::select! {
                biased;
                r = self.io.read_buf(&mut self.buf) => Some(r),
                _ = &mut self.timer => return Incoming::End,
                _ = stopped(&mut self.shutdown), if silent => return Incoming::End,
                _ = stopped(&mut self.draining), if graced => None,
            };
            let Some(read) = read else {
                self.stop_seen = true;
                grace_until = Some(crate::clock::monotonic() + DRAIN_GRACE);
                continue;
            };
            match read {
                Ok(0) | Err(_) => return Incoming::End,
                Ok(_) => {}
            }
        }
    }

    /// The head at the front of the buffer, once its end has arrived. Only bytes not
    /// searched before are searched for the blank line, so a head sent a byte at a time
    /// is not parsed again with each one; a short one is parsed at once, so a malformed
    /// request line is refused without waiting for the end of its head.
    fn parse_head(&mut self) -> Result<Option<(RequestHead, usize)>, crate::http1::HeadError> {
        const EARLY: usize = 1024;
        let from = self.scanned.saturating_sub(2);
        let ended = has_blank_line(&self.buf[from..]);
        self.scanned = self.buf.len();
        if !ended && self.buf.len() > EARLY && self.buf.len() < MAX_HEADER_BYTES {
            return Ok(None);
        }
        parse_request(&self.buf, MAX_HEADER_BYTES)
    }

    /// A head was read: the request's state starts from it.
    async fn begin(&mut self, head: RequestHead) -> Incoming {
        if head.method() == "CONNECT" {
            let e = ClientError::new(ErrorCode::MethodNotAllowed, "method not allowed");
            return self.refuse_in(e, family_of(head.path().as_bytes())).await;
        }
        self.served += 1;
        self.body = BodyReader::new(head.body());
        self.continue_owed = head.expects_continue() && !self.body.is_done();
        self.http11 = head.is_http11();
        self.head_only = head.method() == "HEAD";
        self.keep_alive = head.keep_alive() && !self.stopping();
        self.response = Out::Nothing;
        self.sent = 0;
        self.owed = 0;
        Incoming::Request(head)
    }

    /// Answers a head the gateway will not serve, and ends the connection.
    async fn refuse(&mut self, e: ClientError) -> Incoming {
        let family = family_of(first_line(&self.buf));
        self.refuse_in(e, family).await
    }

    async fn refuse_in(&mut self, e: ClientError, family: Family) -> Incoming {
        let bytes = error_response(&e, family);
        if self.send(&bytes, &[], &[]).await.is_ok() {
            // Whatever the client sends after the refused head is not read.
            let _ = self.io.shutdown().await;
            self.linger().await;
        }
        Incoming::End
    }

    /// No further request on this connection (the request's body cannot be trusted,
    /// or the server is stopping).
    pub fn no_keep_alive(&mut self) {
        self.keep_alive = false;
    }

    /// Reads the whole request body, at most `limit` bytes, answering
    /// `Expect: 100-continue` first. On failure the connection carries no other request.
    pub async fn read_body(&mut self, limit: usize) -> Result<Bytes, BodyFail> {
        let got = self.read_whole_body(limit).await;
        if got.is_err() {
            self.keep_alive = false;
        }
        got
    }

    async fn read_whole_body(&mut self, limit: usize) -> Result<Bytes, BodyFail> {
        if let Some(n) = self.body.remaining() {
            if n > limit as u64 {
                return Err(BodyFail::TooLarge);
            }
            // The whole body in the buffer first: it is then split off without a copy.
            let n = n as usize;
            if self.buf.len() < n {
                self.buf.reserve(n - self.buf.len());
            }
            while self.buf.len() < n {
                self.read_more().await?;
            }
        }
        let mut first: Option<Bytes> = None;
        let mut joined = BytesMut::new();
        loop {
            let piece = self
                .body
                .next(&mut self.buf)
                .map_err(|e| BodyFail::Broken(e.to_string()))?;
            match piece {
                Piece::Data(d) => {
                    let have = first.as_ref().map_or(joined.len(), Bytes::len);
                    if have + d.len() > limit {
                        return Err(BodyFail::TooLarge);
                    }
                    match first.take() {
                        None if joined.is_empty() => first = Some(d),
                        held => {
                            if let Some(f) = held {
                                joined.extend_from_slice(&f);
                            }
                            joined.extend_from_slice(&d);
                        }
                    }
                }
                Piece::More => self.read_more().await?,
                Piece::End => break,
            }
        }
        let body = first.unwrap_or_else(|| joined.freeze());
        if body.len() + self.buf.capacity() > SHARED_BUFFER {
            // Whatever follows (a pipelined request) moves to a buffer of its own.
            self.buf = BytesMut::from(&self.buf[..]);
        }
        Ok(body)
    }

    /// One read of the body, within `client_body_timeout`.
    async fn read_more(&mut self) -> Result<(), BodyFail> {
        if std::mem::take(&mut self.continue_owed) {
            self.send(b"HTTP/1.1 100 Continue\r\n\r\n", &[], &[])
                .await
                .map_err(|e| BodyFail::Broken(format!("cannot answer 100-continue: {e}")))?;
        }
        reserve(&mut self.buf);
        let read = tokio::time::timeout(self.limits.body_timeout, self.io.read_buf(&mut self.buf));
        match read.await {
            Err(_) => Err(BodyFail::Timeout),
            Ok(Ok(0)) => Err(BodyFail::Broken(
                "the connection closed inside the body".into(),
            )),
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(BodyFail::Broken(e.to_string())),
        }
    }

    /// Waits until `deadline`, or, with `client` set, until the client closes the
    /// connection or it fails (`Closed`) or sends bytes (`Data`: a pipelined request,
    /// kept for later), whichever is first. Bytes of the current request's body must
    /// have been read before.
    pub async fn watch(&mut self, deadline: Instant, client: bool) -> Watched {
        let timer = self
            .waits
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline.into())));
        timer.as_mut().reset(deadline.into());
        tokio::select! {
            biased;
            _ = timer.as_mut() => Watched::Deadline,
            gone = closed_or_data(&self.io, &mut self.buf), if client => match gone {
                true => Watched::Closed,
                false => Watched::Data,
            },
        }
    }

    /// Starts the response: its status line, then the fields given to the returned writer.
    pub fn head(&mut self, status: u16) -> HeadOut<'_> {
        self.out.clear();
        wire::status_line(&mut self.out, status);
        HeadOut { conn: self }
    }

    /// Whether a response (or part of one) was written.
    pub fn responded(&self) -> bool {
        self.response != Out::Nothing
    }

    /// Body bytes written for the current response (framing not counted).
    pub fn body_sent(&self) -> u64 {
        self.sent
    }

    /// Whether the client speaks HTTP/1.1 (a body of unknown length is then chunked).
    pub fn is_http11(&self) -> bool {
        self.http11
    }

    /// Writes body bytes (after the head, which leaves with the first of them), and the
    /// body's end when `last`.
    pub async fn write_body(&mut self, data: &[u8], last: bool) -> io::Result<()> {
        let Out::Body(framing) = self.response else {
            return Err(io::Error::other("no response head to write a body after"));
        };
        let data = if framing == Framing::Empty {
            &[][..]
        } else {
            data
        };
        if framing == Framing::Length {
            if data.len() as u64 > self.owed {
                self.keep_alive = false;
                return Err(io::Error::other(
                    "response body longer than its Content-Length",
                ));
            }
            self.owed -= data.len() as u64;
        }
        let mut tail: &[u8] = &[];
        if framing == Framing::Chunked {
            if !data.is_empty() {
                self.out
                    .extend_from_slice(ChunkLine::new(data.len()).as_bytes());
            }
            tail = match (data.is_empty(), last) {
                (false, true) => b"\r\n0\r\n\r\n",
                (false, false) => b"\r\n",
                (true, true) => LAST_CHUNK,
                (true, false) => b"",
            };
        }
        if last {
            if framing == Framing::Length && self.owed > 0 {
                // Ended short of its length: never complete, the connection is cut.
                self.keep_alive = false;
            } else {
                self.response = Out::Done;
            }
            if framing == Framing::Close {
                self.keep_alive = false;
            }
        }
        self.sent += data.len() as u64;
        let mut out = std::mem::take(&mut self.out);
        let sent = if data.len() <= COPY_BODY {
            out.extend_from_slice(data);
            out.extend_from_slice(tail);
            self.send(&out, &[], &[]).await
        } else {
            self.send(&out, data, tail).await
        };
        out.clear();
        self.out = out;
        if self.out.capacity() > 2 * COPY_BODY {
            self.out = Vec::new();
        }
        sent
    }

    /// Sends `a`, `b` and `c` in order (vectored writes); fails when the client takes
    /// no byte for [`SEND_TIMEOUT`] (no timer while the socket takes them at once).
    async fn send(&mut self, a: &[u8], b: &[u8], c: &[u8]) -> io::Result<()> {
        let mut all = Buf::chain(Buf::chain(a, b), c);
        while all.has_remaining() {
            // A write that is not ready at once has written nothing: it is made again
            // under the timer.
            let n = match self.io.write_buf(&mut all).now_or_never() {
                Some(r) => r?,
                None => tokio::time::timeout(SEND_TIMEOUT, self.io.write_buf(&mut all))
                    .await
                    .map_err(|_| {
                        io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the client took no response bytes for 60 s",
                        )
                    })??,
            };
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
        }
        Ok(())
    }

    /// After a request that was answered: whether the connection may carry the next one
    /// (a complete response, the request's body read whole or already here, keep-alive
    /// on both sides).
    pub fn reusable(&mut self) -> bool {
        self.skip_buffered_body() && self.response == Out::Done && self.keep_alive
    }

    /// Skips a body the answer did not need (a refusal) as far as it is here: whether
    /// the whole body has now been read.
    fn skip_buffered_body(&mut self) -> bool {
        while !self.body.is_done() {
            match self.body.next(&mut self.buf) {
                Ok(Piece::Data(_)) => {}
                Ok(Piece::End) => break,
                Ok(Piece::More) | Err(_) => return false,
            }
        }
        true
    }

    /// Closes the connection after sending what is still held. A response that is not
    /// complete is cut instead ([`ClientConn::abort`]); a request body still arriving is
    /// read and dropped for a while first, so the close does not reset the response.
    pub async fn close(mut self) {
        if matches!(self.response, Out::Body(_)) {
            return self.abort().await;
        }
        if !self.out.is_empty() {
            let out = std::mem::take(&mut self.out);
            if self.send(&out, &[], &[]).await.is_err() {
                return;
            }
        }
        let _ = self.io.shutdown().await;
        if !self.skip_buffered_body() {
            self.linger().await;
        }
    }

    /// Cuts the connection so that a response ended here is never taken for a complete
    /// one (SPEC §2). One framed by the close ends with a reset, since a close would
    /// frame it as complete; a chunked or length-framed one ends with a plain close
    /// (its missing last chunk or bytes say it was cut), so the bytes already written
    /// still arrive.
    pub async fn abort(mut self) {
        if self.response == Out::Body(Framing::Close) {
            let _ = socket2::SockRef::from(&self.io).set_linger(Some(Duration::ZERO));
            return;
        }
        let _ = self.io.shutdown().await;
    }

    /// Reads and drops what the client still sends, up to [`LINGER`] and
    /// [`LINGER_BYTES`], or until it closes.
    async fn linger(&mut self) {
        let until = tokio::time::Instant::from_std(crate::clock::monotonic() + LINGER);
        let mut dropped = 0;
        while dropped < LINGER_BYTES {
            self.buf.clear();
            reserve(&mut self.buf);
            match tokio::time::timeout_at(until, self.io.read_buf(&mut self.buf)).await {
                Ok(Ok(n)) if n > 0 => dropped += n,
                _ => return,
            }
        }
    }
}

/// Writes a response head's fields; [`HeadOut::end`] frames the body and ends the head.
pub struct HeadOut<'c> {
    conn: &'c mut ClientConn,
}

impl HeadOut<'_> {
    pub fn field(&mut self, name: &[u8], value: &[u8]) -> &mut Self {
        wire::field(&mut self.conn.out, name, value);
        self
    }

    pub fn number(&mut self, name: &[u8], n: u64) -> &mut Self {
        wire::field_number(&mut self.conn.out, name, n);
        self
    }

    /// Adds the framing and connection fields for a body of `size` and ends the head;
    /// it leaves with the first body bytes written.
    pub fn end(self, size: BodySize) {
        let c = self.conn;
        let framing = match size {
            BodySize::Exactly(n) => {
                wire::field_number(&mut c.out, b"Content-Length", n);
                c.owed = n;
                if c.head_only {
                    Framing::Empty
                } else {
                    Framing::Length
                }
            }
            BodySize::None => Framing::Empty,
            // The length a GET would have is not known: no framing field.
            BodySize::Unknown if c.head_only => Framing::Empty,
            BodySize::Unknown if c.http11 => {
                c.out.extend_from_slice(b"Transfer-Encoding: chunked\r\n");
                Framing::Chunked
            }
            BodySize::Unknown => {
                c.keep_alive = false;
                Framing::Close
            }
        };
        if c.stopping() {
            c.keep_alive = false;
        }
        match (c.keep_alive, c.http11) {
            (false, true) => c.out.extend_from_slice(b"Connection: close\r\n"),
            (true, false) => c.out.extend_from_slice(b"Connection: keep-alive\r\n"),
            _ => {}
        }
        c.out.extend_from_slice(b"\r\n");
        c.response = Out::Body(framing);
    }
}

/// Makes room for a read: an empty buffer gets [`READ_ROOM`]; a full one grows.
fn reserve(buf: &mut BytesMut) {
    if buf.capacity() - buf.len() < READ_ROOM / 4 {
        buf.reserve(READ_ROOM);
    }
}

/// Resolves once the server is shutting down.
async fn stopped(shutdown: &mut ShutdownWatch) {
    if shutdown.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The request line (up to the first `\n`) of a buffer.
fn first_line(b: &[u8]) -> &[u8] {
    let end = memchr::memchr(b'\n', b).unwrap_or(b.len());
    &b[..end]
}

/// How a [`ClientConn::watch`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Watched {
    Deadline,
    /// The client closed the connection, or it failed.
    Closed,
    /// The client sent bytes (kept for the next request).
    Data,
}

/// Resolves when the client closes the connection or it fails (`true`), or when it
/// sends bytes (`false`, kept in `buf`).
///
/// It waits through the socket's own read-readiness slot (`poll_read_ready`), free
/// while a request is answered, rather than `readable()`, whose future joins and later
/// leaves a locked waiter list on every wait: a streamed body waits once per chunk.
async fn closed_or_data(io: &TcpStream, buf: &mut BytesMut) -> bool {
    std::future::poll_fn(|cx| loop {
        match io.poll_read_ready(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Err(_)) => return Poll::Ready(true),
            Poll::Ready(Ok(())) => {}
        }
        reserve(buf);
        match io.try_read_buf(buf) {
            Ok(0) => return Poll::Ready(true),
            Ok(_) => return Poll::Ready(false),
            // Readiness cleared: the next poll registers the waker again.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(_) => return Poll::Ready(true),
        }
    })
    .await
}

/// Whether `buf` holds the end of a head: a line feed followed by an empty line (`\n\n`
/// or `\n\r\n`). A search per line feed, without building a substring searcher.
fn has_blank_line(buf: &[u8]) -> bool {
    memchr::memchr_iter(b'\n', buf).any(|i| match buf.get(i + 1) {
        Some(b'\n') => true,
        Some(b'\r') => buf.get(i + 2) == Some(&b'\n'),
        _ => false,
    })
}

/// The family whose error shape a refused request gets: Anthropic's for its route.
fn family_of(line: &[u8]) -> Family {
    if memchr::memmem::find(line, b"/v1/messages").is_some() {
        Family::Anthropic
    } else {
        Family::OpenAi
    }
}

/// A complete `Connection: close` response carrying `e` as the family's JSON error.
pub fn error_response(e: &ClientError, family: Family) -> Vec<u8> {
    let body = crate::proxy::respond::error_body(family, e);
    let mut out = Vec::with_capacity(128 + body.len());
    wire::status_line(&mut out, e.status());
    wire::field(&mut out, b"Content-Type", b"application/json");
    wire::field_number(&mut out, b"Content-Length", body.len() as u64);
    wire::field(&mut out, b"Connection", b"close");
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&body);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_net::{loopback, nothing_to_read};
    use tokio::io::AsyncReadExt;

    #[test]
    fn a_blank_line_ends_a_head_in_either_line_ending() {
        assert!(has_blank_line(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"));
        assert!(has_blank_line(b"GET / HTTP/1.1\nHost: a\n\n"));
        assert!(has_blank_line(b"\n\r\n"));
        assert!(!has_blank_line(b"GET / HTTP/1.1\r\nHost: a\r\n"));
        assert!(!has_blank_line(b"GET / HTTP/1.1\r\nHost: a\r\n\r"));
        assert!(!has_blank_line(b"a\n\rb\n"));
        assert!(!has_blank_line(b""));
    }

    fn limits() -> ClientLimits {
        ClientLimits {
            header_timeout: Duration::from_millis(300),
            body_timeout: Duration::from_millis(300),
            keepalive_timeout: Duration::from_secs(5),
            max_connections: 16,
        }
    }

    /// (our side of a fresh connection, the client's side, the shutdown switch).
    async fn pair() -> (ClientConn, TcpStream, watch::Sender<bool>) {
        let (client, server) = loopback().await;
        let (stop, shutdown) = watch::channel(false);
        let (_drain, draining) = watch::channel(false);
        let conn = ClientConn::new(
            server,
            limits(),
            crate::clock::monotonic(),
            shutdown,
            draining,
        );
        (conn, client, stop)
    }

    /// A fresh connection with a 30 s header timeout: (ours, the client's, the
    /// shutdown switch, the drain switch).
    async fn drainable() -> (
        ClientConn,
        TcpStream,
        watch::Sender<bool>,
        watch::Sender<bool>,
    ) {
        let (client, server) = loopback().await;
        let (stop, shutdown) = watch::channel(false);
        let (drain, draining) = watch::channel(false);
        let limits = ClientLimits {
            header_timeout: Duration::from_secs(30),
            ..limits()
        };
        let conn = ClientConn::new(
            server,
            limits,
            crate::clock::monotonic(),
            shutdown,
            draining,
        );
        (conn, client, stop, drain)
    }

    /// A fresh connection whose client sent `wire`, and the first request of it read.
    async fn asked(wire: &[u8]) -> (ClientConn, TcpStream, watch::Sender<bool>) {
        let (mut conn, mut client, stop) = pair().await;
        client.write_all(wire).await.unwrap();
        request(&mut conn).await;
        (conn, client, stop)
    }

    async fn request(conn: &mut ClientConn) -> RequestHead {
        match conn.next_request().await {
            Incoming::Request(h) => h,
            Incoming::End => panic!("no request"),
        }
    }

    async fn read_until_close(s: &mut TcpStream) -> String {
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got))
            .await
            .expect("never closed")
            .unwrap();
        String::from_utf8_lossy(&got).into_owned()
    }

    async fn read_n(s: &mut TcpStream, n: usize) -> String {
        let mut got = vec![0u8; n];
        tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut got))
            .await
            .expect("bytes never came")
            .unwrap();
        String::from_utf8(got).unwrap()
    }

    #[tokio::test]
    async fn pipelined_requests_with_bodies_are_read_in_order_and_answered_in_one_send() {
        let (mut conn, mut client, _stop) = pair().await;
        client
            .write_all(
                b"POST /a HTTP/1.1\r\nContent-Length: 3\r\n\r\nabcPOST /b HTTP/1.1\r\n\
                  Transfer-Encoding: chunked\r\n\r\n2\r\nxy\r\n1\r\nz\r\n0\r\n\r\n",
            )
            .await
            .unwrap();
        let h = request(&mut conn).await;
        assert_eq!(h.path(), "/a");
        assert_eq!(conn.read_body(100).await.unwrap(), &b"abc"[..]);
        let mut out = conn.head(200);
        out.field(b"X-A", b"1");
        out.end(BodySize::Exactly(2));
        assert!(
            nothing_to_read(&mut client).await,
            "the head left before its body"
        );
        conn.write_body(b"ok", true).await.unwrap();
        let want = "HTTP/1.1 200 OK\r\nX-A: 1\r\nContent-Length: 2\r\n\r\nok";
        assert_eq!(read_n(&mut client, want.len()).await, want);
        assert_eq!(conn.body_sent(), 2);
        assert!(conn.reusable());
        let h = request(&mut conn).await;
        assert_eq!(h.path(), "/b");
        assert_eq!(conn.read_body(100).await.unwrap(), &b"xyz"[..]);
    }

    #[tokio::test]
    async fn an_unknown_length_is_chunked_for_http_1_1_and_to_the_close_for_http_1_0() {
        let (mut conn, mut client, _stop) = asked(b"GET / HTTP/1.1\r\n\r\n").await;
        conn.head(200).end(BodySize::Unknown);
        conn.write_body(b"data: a\n\n", false).await.unwrap();
        conn.write_body(b"data: b\n\n", true).await.unwrap();
        let want = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: a\n\n\r\n\
                    9\r\ndata: b\n\n\r\n0\r\n\r\n";
        assert_eq!(read_n(&mut client, want.len()).await, want);
        assert!(conn.reusable());

        let (mut conn, mut client, _stop) =
            asked(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n").await;
        conn.head(200).end(BodySize::Unknown);
        conn.write_body(b"all", true).await.unwrap();
        assert!(!conn.reusable(), "a body ended by the close");
        conn.close().await;
        assert_eq!(
            read_until_close(&mut client).await,
            "HTTP/1.1 200 OK\r\n\r\nall",
            "an HTTP/1.0 answer closes by default: no keep-alive field"
        );
    }

    #[tokio::test]
    async fn a_length_response_neither_overruns_nor_ends_short_as_complete() {
        let (mut conn, _client, _stop) = asked(b"GET / HTTP/1.1\r\n\r\n").await;
        conn.head(200).end(BodySize::Exactly(5));
        assert!(conn.write_body(b"abcdef", false).await.is_err());
        assert!(!conn.reusable());

        let (mut conn, mut client, _stop) = asked(b"GET / HTTP/1.1\r\n\r\n").await;
        conn.head(200).end(BodySize::Exactly(5));
        conn.write_body(b"abc", true).await.unwrap();
        assert!(!conn.reusable(), "3 of 5 bytes is not a complete answer");
        conn.close().await;
        // Closed short of its length (what was written still arrives): the client can
        // tell. A body framed by the close is reset instead (tests/framing.rs).
        assert_eq!(
            read_until_close(&mut client).await,
            "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nabc"
        );
    }

    #[tokio::test]
    async fn a_head_answer_has_its_fields_and_no_body_and_keeps_the_connection() {
        let (mut conn, mut client, _stop) =
            asked(b"HEAD / HTTP/1.1\r\n\r\nGET /next HTTP/1.1\r\n\r\n").await;
        conn.head(200).end(BodySize::Exactly(5));
        conn.write_body(b"hello", true).await.unwrap();
        let want = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n";
        assert_eq!(read_n(&mut client, want.len()).await, want);
        assert!(conn.reusable());
        assert_eq!(request(&mut conn).await.path(), "/next");
        conn.head(204).end(BodySize::None);
        conn.write_body(b"", true).await.unwrap();
        let want = "HTTP/1.1 204 No Content\r\n\r\n";
        assert_eq!(
            read_n(&mut client, want.len()).await,
            want,
            "no body bytes came before"
        );
    }

    #[tokio::test]
    async fn a_first_request_sent_in_the_drain_grace_is_answered_with_a_close() {
        let (mut conn, mut client, _stop, drain) = drainable().await;
        let answered = tokio::spawn(async move {
            let h = request(&mut conn).await;
            conn.head(200).end(BodySize::Exactly(2));
            conn.write_body(b"ok", true).await.unwrap();
            (h.path().to_string(), conn.reusable())
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        drain.send(true).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The head starts inside the grace and ends after it: still read whole.
        client.write_all(b"GET /late HTTP/1.1\r\n").await.unwrap();
        tokio::time::sleep(DRAIN_GRACE).await;
        client.write_all(b"\r\n").await.unwrap();
        let (path, reusable) = answered.await.unwrap();
        assert_eq!(path, "/late");
        assert!(!reusable, "no keep-alive while draining");
        let got = read_until_close(&mut client).await;
        assert!(got.contains("Connection: close\r\n"), "{got}");

        // One that sends nothing ends after the grace, long before its header timeout.
        let (mut conn, _client, _stop, drain) = drainable().await;
        drain.send(true).unwrap();
        let ended = tokio::time::timeout(DRAIN_GRACE * 5, conn.next_request()).await;
        assert!(matches!(ended, Ok(Incoming::End)));
    }

    #[tokio::test]
    async fn a_head_sent_a_byte_at_a_time_is_read_and_a_bad_line_refused_at_once() {
        let (mut conn, mut client, _stop) = pair().await;
        let mut head = b"POST /v1/chat/completions HTTP/1.1\r\n".to_vec();
        for i in 0..100 {
            head.extend_from_slice(format!("X-Field-{i}: {}\r\n", "v".repeat(20)).as_bytes());
        }
        head.extend_from_slice(b"\r\n");
        let writer = tokio::spawn(async move {
            for b in head {
                client.write_all(&[b]).await.unwrap();
                tokio::task::yield_now().await;
            }
            client
        });
        let h = request(&mut conn).await;
        assert_eq!(h.path(), "/v1/chat/completions");
        assert_eq!(h.get("x-field-99"), Some("v".repeat(20).as_bytes()));
        drop(writer.await.unwrap());

        // A broken request line is answered without waiting for the end of its head.
        let (mut conn, mut client, _stop) = pair().await;
        client
            .write_all(b"GARBAGE\x01 / HTTP/1.1\r\n")
            .await
            .unwrap();
        let refused =
            tokio::spawn(async move { matches!(conn.next_request().await, Incoming::End) });
        let got = read_n(&mut client, 24).await;
        assert_eq!(got, "HTTP/1.1 400 Bad Request");
        assert!(refused.await.unwrap());
    }

    #[tokio::test]
    async fn expect_continue_is_answered_before_the_body_is_read() {
        let (mut conn, mut client, _stop) =
            asked(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n").await;
        let reader = tokio::spawn(async move {
            let body = conn.read_body(100).await.unwrap();
            (conn, body)
        });
        let want = "HTTP/1.1 100 Continue\r\n\r\n";
        assert_eq!(read_n(&mut client, want.len()).await, want);
        client.write_all(b"body").await.unwrap();
        let (_conn, body) = reader.await.unwrap();
        assert_eq!(body, &b"body"[..]);
    }

    #[tokio::test]
    async fn bodies_too_large_late_or_broken_are_refused_and_end_keep_alive() {
        let (mut conn, _client, _stop) =
            asked(b"POST / HTTP/1.1\r\nContent-Length: 1000\r\n\r\n").await;
        assert!(matches!(conn.read_body(999).await, Err(BodyFail::TooLarge)));
        conn.head(413).end(BodySize::Exactly(0));
        conn.write_body(b"", true).await.unwrap();
        assert!(!conn.reusable());

        let (mut conn, _client, _stop) =
            asked(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc").await;
        assert!(matches!(conn.read_body(100).await, Err(BodyFail::Timeout)));

        let (mut conn, _client, _stop) =
            asked(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n").await;
        assert!(matches!(
            conn.read_body(100).await,
            Err(BodyFail::Broken(_))
        ));
    }

    #[tokio::test]
    async fn refused_heads_get_a_json_error_and_a_close() {
        for (wire, status) in [
            (
                &b"POST /v1/messages HTTP/1.1\r\nBad Field\r\n\r\n"[..],
                "400",
            ),
            (b"CONNECT /v1/messages HTTP/1.1\r\n\r\n", "405"),
        ] {
            let (mut conn, mut client, _stop) = pair().await;
            client.write_all(wire).await.unwrap();
            assert!(matches!(conn.next_request().await, Incoming::End));
            let text = read_until_close(&mut client).await;
            assert!(text.starts_with(&format!("HTTP/1.1 {status} ")), "{text}");
            assert!(text.contains("Connection: close"), "{text}");
            let body: serde_json::Value =
                serde_json::from_str(text.split_once("\r\n\r\n").unwrap().1).unwrap();
            assert_eq!(body["type"], "error", "the Anthropic shape: {text}");
        }
        let (mut conn, mut client, _stop) = pair().await;
        let big = format!("GET / HTTP/1.1\r\nX: {}\r\n", "x".repeat(MAX_HEADER_BYTES));
        let writer = tokio::spawn(async move {
            let _ = client.write_all(big.as_bytes()).await;
            client
        });
        assert!(matches!(conn.next_request().await, Incoming::End));
        let mut client = writer.await.unwrap();
        let text = read_until_close(&mut client).await;
        assert!(text.starts_with("HTTP/1.1 431 "), "{text}");
    }

    #[tokio::test]
    async fn a_slow_head_is_cut_and_an_idle_connection_ends_at_shutdown() {
        let (mut conn, mut client, _stop) = pair().await;
        client.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        // Cut by the header timeout (300 ms here); without it the wait would never end.
        let ended = tokio::time::timeout(Duration::from_secs(10), conn.next_request()).await;
        assert!(matches!(ended, Ok(Incoming::End)));

        let (mut conn, mut client, stop) = pair().await;
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        request(&mut conn).await;
        conn.head(204).end(BodySize::None);
        conn.write_body(b"", true).await.unwrap();
        assert!(conn.reusable());
        let waiting =
            tokio::spawn(async move { matches!(conn.next_request().await, Incoming::End) });
        tokio::time::sleep(Duration::from_millis(20)).await;
        stop.send_replace(true);
        assert!(tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the idle connection outlived the shutdown")
            .unwrap());
    }

    #[tokio::test]
    async fn bytes_sent_while_watching_are_kept_and_a_close_is_seen() {
        let (mut conn, mut client, _stop) = asked(b"GET /a HTTP/1.1\r\n\r\n").await;
        client.write_all(b"GET /b HTTP/1.1\r\n\r\n").await.unwrap();
        let later = crate::clock::monotonic() + Duration::from_secs(5);
        assert_eq!(
            conn.watch(later, true).await,
            Watched::Data,
            "data is not a close"
        );
        conn.head(200).end(BodySize::Exactly(0));
        conn.write_body(b"", true).await.unwrap();
        assert!(conn.reusable());
        assert_eq!(request(&mut conn).await.path(), "/b");
        drop(client);
        assert_eq!(conn.watch(later, true).await, Watched::Closed);
    }

    #[tokio::test]
    async fn each_wait_ends_at_its_own_deadline_whatever_the_one_before() {
        let (mut conn, _client, _stop) = asked(b"GET /a HTTP/1.1\r\n\r\n").await;
        let now = crate::clock::monotonic;
        // A far deadline, then a sooner one: the second is not held to the first's.
        let far = now() + Duration::from_secs(30);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), conn.watch(far, true))
                .await
                .is_err()
        );
        let soon = now() + Duration::from_millis(40);
        let ended = tokio::time::timeout(Duration::from_secs(5), conn.watch(soon, true)).await;
        assert_eq!(ended.ok(), Some(Watched::Deadline));
        assert!(now() >= soon);
        // A sooner deadline, then a later one: the timer still set for the first does
        // not end the second early.
        let first = now() + Duration::from_millis(20);
        // Given up before its deadline (or not, on a stalled machine: the timer is left
        // set for `first` either way).
        let _ = tokio::time::timeout(Duration::from_millis(5), conn.watch(first, true)).await;
        let second = now() + Duration::from_millis(150);
        assert_eq!(conn.watch(second, true).await, Watched::Deadline);
        assert!(now() >= second, "ended before its deadline");
    }

    #[tokio::test]
    async fn a_client_leaving_while_watched_ends_the_wait() {
        let (mut conn, client, _stop) = asked(b"GET /a HTTP/1.1\r\n\r\n").await;
        // The wait has registered for readiness (nothing to read yet) when the client
        // goes: the close must wake it, not the 5 s deadline.
        let leaver = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            drop(client);
        });
        let until = crate::clock::monotonic() + Duration::from_secs(5);
        assert_eq!(
            watched_within(&mut conn, until).await,
            Some(Watched::Closed)
        );
        leaver.await.unwrap();
    }

    #[tokio::test]
    async fn a_watch_after_taking_bytes_still_sees_the_client_leave() {
        let (mut conn, mut client, _stop) = asked(b"GET /a HTTP/1.1\r\n\r\n").await;
        client.write_all(b"GET /b HTTP/1.1\r\n\r\n").await.unwrap();
        let until = crate::clock::monotonic() + Duration::from_secs(5);
        assert_eq!(conn.watch(until, true).await, Watched::Data);
        // The socket may still read as ready from those bytes: the next watch finds
        // nothing to read, waits again, and is woken by the close.
        let leaver = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            drop(client);
        });
        assert_eq!(
            watched_within(&mut conn, until).await,
            Some(Watched::Closed)
        );
        leaver.await.unwrap();
    }

    /// What `watch` saw, or `None` when it was not woken within 2 s (the limit polled
    /// first, so a wait that was never woken cannot pass on a late poll).
    async fn watched_within(conn: &mut ClientConn, until: Instant) -> Option<Watched> {
        tokio::select! {
            biased;
            _ = tokio::time::sleep(Duration::from_secs(2)) => None,
            w = conn.watch(until, true) => Some(w),
        }
    }
}
