//! The stream phase (SPEC §2 stream, §5.9): a committed body is passed to the client
//! chunk by chunk, unbuffered, under the stall guard, the throughput watchdog and the
//! execution deadline. There is no failover after the commit point.
//!
//! Invariant — a failure is never framed as a complete answer:
//! - an SSE stream that fails (upstream error, stall, watchdog, deadline, or an upstream
//!   that stops inside an event) gets its partial event terminated, then the route
//!   family's error event, then a clean end;
//! - any other body that fails is cut: the client connection is dropped without a
//!   terminating chunk, and a `Content-Length` body is never completed, so no client can
//!   take a truncated JSON for an answer (`StreamEnd::Aborted { cut: true }`).
//!
//! Heartbeats (comments, pings, empty `data:`) never reset the stall timer. The upstream
//! connection goes back to the pool only after its body was read whole.
//!
//! Chunks the upstream connection already holds are passed on together: a body read in
//! one receive but framed as eight chunks leaves as one send. A chunk is taken into a
//! batch only when it is ready without waiting, so nothing is held back that could have
//! been sent; every chunk still goes through the guards one by one, and a failing stream
//! delivers the batch before its error event. The response head, written at the commit
//! point, leaves with the first batch.

use super::attempt::Committed;
use super::ctx::Request;
use super::framing::EventBoundary;
use super::respond;
use super::transport::POOL_IDLE;
use super::upconn::UpConn;
use super::watch::{ClientWatch, Wait};
use crate::clock::monotonic;
use crate::codes::AbortReason;
use crate::policy::watchdog::{classify_event, ThroughputWatchdog, WatchdogConfig};
use crate::server::conn::ClientConn;
use crate::server::lifecycle::StopWait;
use crate::sse::{SseAssembler, SseEvent, SseProgress};
use bytes::{Bytes, BytesMut};
use std::pin::pin;
use std::time::Instant;

/// A batch stops taking chunks once it holds this much (so at most this plus one chunk).
const BATCH_MAX: usize = 64 * 1024;

/// How a committed response ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StreamEnd {
    /// The body ended as the upstream framed it.
    Complete,
    /// Ended early for `reason`; `cut` when the client connection must be dropped
    /// (nothing more may be written, not even a terminating chunk).
    Aborted { reason: AbortReason, cut: bool },
}

/// Streams the committed body to the client. `c` comes boxed as the attempt made it:
/// taken by value, it would sit in this future's state beside the parts it is taken
/// apart into (and be copied into it once more).
pub(super) async fn stream(
    conn: &mut ClientConn,
    watch: &mut ClientWatch,
    req: &Request<'_>,
    deadline: Instant,
    c: Box<Committed>,
) -> StreamEnd {
    let Committed {
        mut up,
        upstream,
        first,
        is_sse,
        head,
        at,
        ..
    } = *c;
    // Written already: not held for the stream's life.
    drop(head);
    let to = upstream.of(&req.snap.config.providers[upstream.provider]);
    let Some(first) = first else {
        // Empty body: the head alone is the response.
        req.engine.upstreams.release(up, &to, POOL_IDLE).await;
        return match conn.write_body(&[], true).await {
            Ok(()) => StreamEnd::Complete,
            Err(_) => cut(AbortReason::ClientGone),
        };
    };
    let mut pump = Pump::new(req, is_sse, deadline, at);
    let end = pump.run(conn, watch, &mut up, first).await;
    match end {
        StreamEnd::Complete => req.engine.upstreams.release(up, &to, POOL_IDLE).await,
        StreamEnd::Aborted { .. } => up.shutdown().await,
    }
    end
}

/// The guards and framing state of one committed body.
struct Pump<'r, 'a> {
    req: &'r Request<'a>,
    is_sse: bool,
    deadline: Instant,
    progress: SseProgress,
    boundary: EventBoundary,
    watchdog: Option<Watch>,
    last_progress: Instant,
}

impl<'r, 'a> Pump<'r, 'a> {
    /// The guards of a body committed `at`.
    fn new(req: &'r Request<'a>, is_sse: bool, deadline: Instant, at: Instant) -> Self {
        Pump {
            req,
            is_sse,
            deadline,
            progress: SseProgress::default(),
            boundary: EventBoundary::default(),
            watchdog: Watch::new(req, is_sse),
            last_progress: at,
        }
    }

    async fn run(
        &mut self,
        conn: &mut ClientConn,
        watch: &mut ClientWatch,
        up: &mut UpConn,
        first: Bytes,
    ) -> StreamEnd {
        let stall = self.req.snap.config.resilience.stream.stall_timeout;
        // One wait for the shutdown over the whole body, raced by every read: it
        // subscribes at the first read that waits (a body already in hand ends without
        // one; each subscription writes a count every thread shares) and stays
        // registered between chunks.
        let mut stop = StopWait::new(&self.req.engine.lifecycle);
        let mut next = Some(first);
        loop {
            if let Some(chunk) = next.take() {
                if let Some(end) = self.forward(conn, up, chunk).await {
                    return end;
                }
            }
            let until = (self.last_progress + stall).min(self.deadline);
            let read = async {
                tokio::select! {
                    biased;
                    r = up.read_body() => Some(r),
                    _ = &mut stop => None,
                }
            };
            let got = match watch.race(conn, until, pin!(read)).await {
                Wait::Ready(None) => return self.fail(conn, None, AbortReason::Shutdown).await,
                Wait::Ready(Some(r)) => Wait::Ready(r),
                Wait::TimedOut => Wait::TimedOut,
                Wait::ClientGone => Wait::ClientGone,
            };
            match got {
                Wait::Ready(Ok(Some(c))) => next = Some(c),
                Wait::Ready(Ok(None)) => return self.finish(conn, None).await,
                Wait::Ready(Err(_)) => {
                    return self.fail(conn, None, AbortReason::UpstreamError).await
                }
                Wait::TimedOut if monotonic() >= self.deadline => {
                    return self.fail(conn, None, AbortReason::ExecutionTimeout).await
                }
                Wait::TimedOut => return self.fail(conn, None, AbortReason::Stall).await,
                Wait::ClientGone => return cut(AbortReason::ClientGone),
            }
        }
    }

    /// Passes `chunk` on, with the chunks the upstream already holds after it, in one
    /// write; `Some` when the stream ended meanwhile (the watchdog, the client, or the
    /// upstream's end or failure).
    async fn forward(
        &mut self,
        conn: &mut ClientConn,
        up: &mut UpConn,
        chunk: Bytes,
    ) -> Option<StreamEnd> {
        let mut batch = Batch::default();
        let mut chunk = chunk;
        let mut progressed = false;
        let ended = loop {
            progressed |= !self.is_sse || self.progress.feed(&chunk);
            if !self.admit(&chunk) {
                // The chunk that tipped the verdict is not delivered (SPEC §5.9).
                return Some(self.fail(conn, batch.take(), AbortReason::Throughput).await);
            }
            batch.push(chunk);
            if batch.len >= BATCH_MAX {
                break None;
            }
            match up.body_ready() {
                Some(Ok(Some(c))) => chunk = c,
                Some(Ok(None)) => break Some(Ok(())),
                Some(Err(_)) => break Some(Err(())),
                None => break None,
            }
        };
        match ended {
            None => {
                let data = batch.take().unwrap_or_default();
                let written = conn.write_body(&data, false).await;
                // A slow client's write time does not eat into the next stall window.
                if progressed {
                    self.last_progress = monotonic();
                }
                match written {
                    Ok(()) => None,
                    Err(_) => Some(cut(AbortReason::ClientGone)),
                }
            }
            Some(Ok(())) => Some(self.finish(conn, batch.take()).await),
            Some(Err(())) => Some(
                self.fail(conn, batch.take(), AbortReason::UpstreamError)
                    .await,
            ),
        }
    }

    /// Runs the watchdog on one chunk (its progress already fed): false when the
    /// watchdog ends the stream on it.
    fn admit(&mut self, chunk: &[u8]) -> bool {
        let engine = self.req.engine;
        if self
            .watchdog
            .as_mut()
            .is_some_and(|w| w.too_slow(chunk, engine.now()))
        {
            return false;
        }
        if self.is_sse {
            self.boundary.feed(chunk);
        }
        true
    }

    /// Ends the body as the upstream ended it, `held` written first.
    async fn finish(&mut self, conn: &mut ClientConn, held: Option<Bytes>) -> StreamEnd {
        if self.is_sse && self.boundary.is_mid_event() {
            // The upstream closed inside an event: not a complete stream.
            return self.fail(conn, held, AbortReason::UpstreamError).await;
        }
        // The last data and the body's end leave together.
        let written = conn.write_body(&held.unwrap_or_default(), true).await;
        match written {
            Ok(()) => StreamEnd::Complete,
            Err(_) => cut(AbortReason::ClientGone),
        }
    }

    /// Ends a committed response that failed: an SSE stream with `held` (chunks that
    /// passed the guards), the family's error event on an event boundary and a clean
    /// end; any other body by a cut.
    async fn fail(
        &mut self,
        conn: &mut ClientConn,
        held: Option<Bytes>,
        reason: AbortReason,
    ) -> StreamEnd {
        if !self.is_sse {
            // What passed the guards is still delivered; the cut comes after it.
            if let Some(held) = held {
                let _ = conn.write_body(&held, false).await;
            }
            return cut(reason);
        }
        let mut tail = held.map(Vec::from).unwrap_or_default();
        tail.extend_from_slice(self.boundary.terminator());
        tail.extend_from_slice(&respond::sse_error_event(self.req.route, reason));
        // The error event and the body's end leave together.
        let ended = conn.write_body(&tail, true).await.is_ok();
        StreamEnd::Aborted {
            reason,
            cut: !ended,
        }
    }
}

/// Chunks gathered for one write: the first kept as it is, a copy only once a second
/// one joins it.
#[derive(Default)]
struct Batch {
    one: Option<Bytes>,
    many: BytesMut,
    len: usize,
}

impl Batch {
    fn push(&mut self, chunk: Bytes) {
        self.len += chunk.len();
        if let Some(first) = self.one.take() {
            self.many.reserve(first.len() + chunk.len());
            self.many.extend_from_slice(&first);
            self.many.extend_from_slice(&chunk);
        } else if self.many.is_empty() {
            self.one = Some(chunk);
        } else {
            self.many.extend_from_slice(&chunk);
        }
    }

    fn take(&mut self) -> Option<Bytes> {
        self.len = 0;
        match self.one.take() {
            Some(b) => Some(b),
            None if self.many.is_empty() => None,
            None => Some(self.many.split().freeze()),
        }
    }
}

fn cut(reason: AbortReason) -> StreamEnd {
    StreamEnd::Aborted { reason, cut: true }
}

/// The throughput watchdog of one streamed response (SPEC §5.9), when enabled: SSE
/// events are assembled from the chunks and only text deltas count as useful output.
struct Watch {
    events: SseAssembler,
    dog: ThroughputWatchdog,
    scratch: Vec<SseEvent>,
}

impl Watch {
    fn new(req: &Request<'_>, is_sse: bool) -> Option<Self> {
        let cfg = &req.snap.config.resilience.watchdog;
        (cfg.enabled && is_sse).then(|| Watch {
            events: SseAssembler::new(64 * 1024),
            dog: ThroughputWatchdog::new(WatchdogConfig::from(cfg), req.engine.now()),
            scratch: Vec::new(),
        })
    }

    /// Feeds one chunk; true when the stream should be aborted.
    fn too_slow(&mut self, chunk: &[u8], now: crate::policy::Millis) -> bool {
        self.events.feed(chunk, &mut self.scratch);
        for e in self.scratch.drain(..) {
            self.dog
                .observe(classify_event(e.event.as_deref(), &e.data), now);
        }
        self.dog.should_abort(now)
    }
}

#[cfg(test)]
mod tests {
    use super::Batch;
    use bytes::Bytes;

    #[test]
    fn a_batch_gives_back_its_chunks_in_order_and_starts_empty_again() {
        let mut b = Batch::default();
        assert_eq!(b.take(), None);
        b.push(Bytes::from_static(b"data: a\n\n"));
        assert_eq!(b.len, 9);
        assert_eq!(b.take().as_deref(), Some(&b"data: a\n\n"[..]));
        assert_eq!((b.len, b.take()), (0, None));
        for part in ["data: b\n", "\n", "data: c\n\n"] {
            b.push(Bytes::from(part));
        }
        assert_eq!(b.len, 18);
        assert_eq!(b.take().as_deref(), Some(&b"data: b\n\ndata: c\n\n"[..]));
        b.push(Bytes::from_static(b"x"));
        assert_eq!(b.take().as_deref(), Some(&b"x"[..]));
    }
}
