//! One upstream HTTP/1.1 connection speaking Sluice's codec (`crate::http1`).
//!
//! What it protects: the upstream half of a request's CPU and sends. A request leaves
//! in one send (its head and, up to [`COPY_BODY`], its body in one buffer; a larger body
//! right behind it in one vectored write); the answer is read into one buffer, its head
//! parsed where it lies and its body split off without copies.
//!
//! Invariants:
//! - 1xx heads are skipped; a head larger than the caller's limit is an error, never
//!   passed on;
//! - a body is complete only as its framing says ([`crate::http1::BodyReader`]); a close
//!   before that is an error, never an end;
//! - a connection the upstream closed before one byte of the answer came is marked
//!   `RetryType::ReusedOnly` (a stale pooled connection, for the attempt to resend on a
//!   fresh one); later failures are not;
//! - [`H1::into_idle`] gives the connection back only when the answer was read to its
//!   end, both sides keep it alive and nothing unasked-for is left in the buffer.

use crate::http1::head::parse_response_len;
use crate::http1::{BodyLen, BodyReader, Piece, ResponseHead};
use bytes::{Buf, Bytes, BytesMut};
use pingora::protocols::Stream;
use pingora::{Error, ErrorType, RetryType};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, ReadBuf};

/// A request body up to this size is copied behind its head (one buffer, one send).
const COPY_BODY: usize = 16 * 1024;
/// Room made in the read buffer before each read.
const READ_ROOM: usize = 8 * 1024;
/// An idle connection keeps a read buffer up to this size.
const IDLE_BUFFER: usize = 64 * 1024;

/// An upstream HTTP/1.1 connection and the state of its current exchange.
pub struct H1 {
    io: Stream,
    buf: BytesMut,
    body: BodyReader,
    /// The answer's head allows another request on the connection.
    keep_alive: bool,
    /// Bytes of the current answer read so far (0: a close now means a stale connection).
    answered: usize,
}

impl H1 {
    pub fn new(io: Stream) -> H1 {
        H1 {
            io,
            buf: BytesMut::new(),
            body: BodyReader::new(BodyLen::Empty),
            keep_alive: false,
            answered: 0,
        }
    }

    /// Writes one request: `head` (its wire form, blank line included) and its body,
    /// given as the pieces it is made of (`proxy::body::Outgoing::pieces`).
    pub async fn send(&mut self, mut head: Vec<u8>, body: [&[u8]; 3]) -> pingora::Result<()> {
        self.answered = 0;
        self.keep_alive = false;
        self.body = BodyReader::new(BodyLen::Empty);
        let written = if body.iter().map(|p| p.len()).sum::<usize>() <= COPY_BODY {
            for piece in body {
                head.extend_from_slice(piece);
            }
            self.io.write_all(&head).await
        } else {
            let [a, b, c] = body;
            let mut all = Buf::chain(&head[..], a).chain(b).chain(c);
            self.io.write_all_buf(&mut all).await
        };
        let flushed = match written {
            Ok(()) => self.io.flush().await,
            Err(e) => Err(e),
        };
        flushed.map_err(|e| {
            let mut err = Error::because(ErrorType::WriteError, "while writing the request", e);
            // Nothing was answered: the upstream had closed the connection (a pooled one).
            err.retry = RetryType::ReusedOnly;
            err
        })
    }

    /// Reads the answer's head (skipping 1xx), looking at most at `limit` bytes of it.
    pub async fn read_head(&mut self, limit: usize) -> pingora::Result<ResponseHead> {
        loop {
            if !self.buf.is_empty() {
                let parsed = parse_response_len(&self.buf, limit).map_err(|e| {
                    Error::explain(
                        ErrorType::InvalidHTTPHeader,
                        format!("invalid upstream response head: {e}"),
                    )
                })?;
                match parsed {
                    Some((head, n)) => {
                        self.buf.advance(n);
                        if (100..200).contains(&head.status()) {
                            continue;
                        }
                        self.body = BodyReader::new(head.body());
                        self.keep_alive = head.keep_alive();
                        return Ok(head);
                    }
                    None if self.buf.len() >= limit => {
                        return Err(Error::explain(
                            ErrorType::InvalidHTTPHeader,
                            "upstream response header too large",
                        ));
                    }
                    None => {}
                }
            }
            if self.fill().await? == 0 {
                let mut e = Error::explain(
                    ErrorType::ConnectionClosed,
                    "while reading the response head",
                );
                if self.answered == 0 {
                    e.retry = RetryType::ReusedOnly;
                }
                return Err(e);
            }
        }
    }

    /// The next piece of the body; `None` once it is complete.
    pub async fn read_body(&mut self) -> pingora::Result<Option<Bytes>> {
        loop {
            if let Some(piece) = self.body_ready() {
                return piece;
            }
            if self.fill().await? == 0 {
                return match self.body.closed() {
                    Ok(_) => Ok(None),
                    Err(e) => Err(Error::explain(ErrorType::ConnectionClosed, e.to_string())),
                };
            }
        }
    }

    /// The next piece of the body if the buffer already holds it (no I/O): `None`
    /// when a read is needed first.
    pub fn body_ready(&mut self) -> Option<pingora::Result<Option<Bytes>>> {
        match self.body.next(&mut self.buf) {
            Ok(Piece::Data(d)) => Some(Ok(Some(d))),
            Ok(Piece::End) => Some(Ok(None)),
            Ok(Piece::More) => None,
            Err(e) => Some(Err(Error::explain(
                ErrorType::InvalidHTTPHeader,
                e.to_string(),
            ))),
        }
    }

    /// The answer's body has been read to its end.
    pub fn is_done(&self) -> bool {
        self.body.is_done()
    }

    /// The connection, for the idle pool, when it may carry another request (its read
    /// buffer kept for the next answer, unless a large body grew it).
    pub fn into_idle(mut self) -> Option<H1> {
        if !(self.body.is_done() && self.keep_alive && self.buf.is_empty()) {
            return None;
        }
        if self.buf.capacity() > IDLE_BUFFER {
            self.buf = BytesMut::new();
        }
        Some(self)
    }

    /// Whether an idle connection has neither been closed nor sent anything: a read
    /// that would block. (A byte read here is one nobody asked for: the connection is
    /// not to be used.)
    pub fn still_open(&mut self) -> bool {
        let mut byte = [0u8; 1];
        let mut buf = ReadBuf::new(&mut byte);
        let mut cx = Context::from_waker(Waker::noop());
        // Outside the task's cooperative budget: a spent budget would read as "would block".
        let io = &mut self.io;
        let read = std::future::poll_fn(|cx| Pin::new(&mut *io).poll_read(cx, &mut buf));
        let mut read = std::pin::pin!(tokio::task::unconstrained(read));
        matches!(read.as_mut().poll(&mut cx), Poll::Pending)
    }

    /// Closes the connection (an exchange that did not end cleanly).
    pub async fn shutdown(&mut self) {
        let _ = AsyncWriteExt::shutdown(&mut self.io).await;
    }

    /// Reads more of the answer into the buffer: the byte count, 0 at the upstream's close.
    async fn fill(&mut self) -> pingora::Result<usize> {
        if self.buf.capacity() - self.buf.len() < READ_ROOM / 2 {
            self.buf.reserve(READ_ROOM);
        }
        match self.io.read_buf(&mut self.buf).await {
            Ok(n) => {
                self.answered += n;
                Ok(n)
            }
            Err(e) => {
                // An OS error before one byte of the answer: a stale pooled connection
                // (a TLS failure is not, as Pingora's client treats it).
                let stale = self.answered == 0 && e.raw_os_error().is_some();
                let mut err = Error::because(ErrorType::ReadError, "while reading the response", e);
                if stale {
                    err.retry = RetryType::ReusedOnly;
                }
                Err(err)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_net::loopback;

    async fn pair() -> (H1, tokio::net::TcpStream) {
        let (c, s) = loopback().await;
        let c: pingora::protocols::l4::stream::Stream = c.into();
        (H1::new(Box::new(c)), s)
    }

    /// A connection on which a bodiless `POST /` was sent and read by the upstream.
    async fn sent() -> (H1, tokio::net::TcpStream) {
        let (mut up, mut server) = pair().await;
        up.send(b"POST / HTTP/1.1\r\n\r\n".to_vec(), [b"", b"", b""])
            .await
            .unwrap();
        read_all_available(&mut server, 19).await;
        (up, server)
    }

    async fn read_all_available(s: &mut tokio::net::TcpStream, n: usize) -> Vec<u8> {
        let mut got = vec![0u8; n];
        tokio::time::timeout(std::time::Duration::from_secs(10), s.read_exact(&mut got))
            .await
            .expect("the request never came")
            .unwrap();
        got
    }

    #[tokio::test]
    async fn an_exchange_skips_1xx_reads_a_chunked_body_and_keeps_the_connection() {
        let (mut up, mut server) = pair().await;
        let head = b"POST /v1/x HTTP/1.1\r\nHost: u\r\nContent-Length: 4\r\n\r\n".to_vec();
        up.send(head.clone(), [b"bo", b"", b"dy"]).await.unwrap();
        let got = read_all_available(&mut server, head.len() + 4).await;
        assert_eq!(&got[head.len()..], b"body");
        server
            .write_all(
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
                  3\r\nabc\r\n",
            )
            .await
            .unwrap();
        let h = up.read_head(64 * 1024).await.unwrap();
        assert_eq!(h.status(), 200);
        assert_eq!(up.read_body().await.unwrap().as_deref(), Some(&b"abc"[..]));
        assert!(up.body_ready().is_none(), "nothing more in hand");
        server.write_all(b"2\r\nde\r\n0\r\n\r\n").await.unwrap();
        assert_eq!(up.read_body().await.unwrap().as_deref(), Some(&b"de"[..]));
        assert_eq!(up.read_body().await.unwrap(), None);
        assert!(up.is_done());
        assert!(
            up.into_idle().is_some(),
            "a clean keep-alive exchange is pooled"
        );
    }

    #[tokio::test]
    async fn a_close_before_any_answer_is_stale_and_a_cut_body_is_an_error() {
        let (mut up, server) = sent().await;
        drop(server);
        let e = up.read_head(1024).await.unwrap_err();
        assert!(matches!(e.retry, RetryType::ReusedOnly), "{e}");

        let (mut up, mut server) = sent().await;
        server
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
            .await
            .unwrap();
        drop(server);
        up.read_head(1024).await.unwrap();
        assert_eq!(up.read_body().await.unwrap().as_deref(), Some(&b"abc"[..]));
        let e = up.read_body().await.unwrap_err();
        assert!(!matches!(e.retry, RetryType::ReusedOnly));
        assert!(!up.is_done());
        assert!(up.into_idle().is_none());
    }

    #[tokio::test]
    async fn oversized_heads_close_delimited_bodies_and_extra_bytes_are_not_pooled() {
        let (mut up, mut server) = sent().await;
        server
            .write_all(format!("HTTP/1.1 200 OK\r\nX: {}\r\n\r\n", "x".repeat(2000)).as_bytes())
            .await
            .unwrap();
        let e = up.read_head(1024).await.unwrap_err();
        assert!(e.to_string().contains("too large"), "{e}");

        let (mut up, mut server) = sent().await;
        server
            .write_all(b"HTTP/1.1 200 OK\r\n\r\nall of it")
            .await
            .unwrap();
        drop(server);
        up.read_head(1024).await.unwrap();
        let mut body = Vec::new();
        while let Some(b) = up.read_body().await.unwrap() {
            body.extend_from_slice(&b);
        }
        assert_eq!(body, b"all of it");
        assert!(up.into_idle().is_none(), "read to the close: not reusable");

        let (mut up, mut server) = sent().await;
        server
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA")
            .await
            .unwrap();
        up.read_head(1024).await.unwrap();
        assert_eq!(up.read_body().await.unwrap().as_deref(), Some(&b"ok"[..]));
        assert_eq!(up.read_body().await.unwrap(), None);
        assert!(up.into_idle().is_none(), "bytes nobody asked for");
    }

    #[tokio::test]
    async fn a_body_in_pieces_follows_its_head_in_order_whatever_its_size() {
        // Below and above COPY_BODY: copied behind the head, or one vectored write.
        for size in [1_000, 100_000u32] {
            let (mut up, mut server) = pair().await;
            let body: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
            let third = body.len() / 3;
            let pieces = [&body[..third], &b"\"upstream-model\""[..], &body[third..]];
            let whole = pieces.concat();
            let head =
                format!("POST / HTTP/1.1\r\nContent-Length: {}\r\n\r\n", whole.len()).into_bytes();
            let n = head.len() + whole.len();
            let (sent, got) = tokio::join!(
                up.send(head.clone(), pieces),
                read_all_available(&mut server, n)
            );
            sent.unwrap();
            assert_eq!(&got[..head.len()], &head[..], "{size}");
            assert_eq!(&got[head.len()..], &whole[..], "{size}");
        }
    }
}
