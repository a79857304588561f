//! Watching the client while Sluice waits on something else (SPEC §5.9: a client that
//! disconnects ends the upstream attempt at once, no wasted tokens).
//!
//! Every wait of the request path — DNS, connect, the upstream's first byte, a body
//! chunk, a queue or combo wait — runs through [`ClientWatch::race`]: the future, a time
//! limit and the client socket race, and whichever finishes first wins. Invariants: a
//! wait never outlives its limit; a closed client ends it with `ClientGone`; bytes the
//! client sends meanwhile (a pipelined request) stop the watching rather than being
//! taken for a disconnect, and are kept for the connection's next request.

use crate::server::conn::{ClientConn, Watched};
use std::future::Future;
use std::pin::{pin, Pin};
use std::task::Poll;
use std::time::{Duration, Instant};

/// A wait's time limit: a span from when it starts waiting, or a point in time (whose
/// wait reads no clock when the future is ready at once).
pub enum Limit {
    For(Duration),
    Until(Instant),
}

impl From<Duration> for Limit {
    fn from(d: Duration) -> Limit {
        Limit::For(d)
    }
}

impl From<Instant> for Limit {
    fn from(t: Instant) -> Limit {
        Limit::Until(t)
    }
}

/// How a raced wait ended.
pub enum Wait<T> {
    Ready(T),
    TimedOut,
    ClientGone,
}

/// Whether the client socket is still being watched for a disconnect.
pub struct ClientWatch {
    watching: bool,
}

impl Default for ClientWatch {
    fn default() -> Self {
        ClientWatch { watching: true }
    }
}

impl ClientWatch {
    /// Runs `fut` within `limit` (a span or a deadline), watching the client connection
    /// meanwhile. The future is pinned where the caller made it (`pin!(…)`): moved into
    /// the race by value, its state (up to ~1 KB for an upstream exchange) was copied
    /// once more per wait.
    pub async fn race<F: Future>(
        &mut self,
        conn: &mut ClientConn,
        limit: impl Into<Limit>,
        mut fut: Pin<&mut F>,
    ) -> Wait<F::Output> {
        let limit = limit.into();
        // Most waits of a request are ready at once (a cached address, a pooled
        // connection, a body already read): no timer and no client watch for those.
        let first = std::future::poll_fn(|cx| match fut.as_mut().poll(cx) {
            Poll::Ready(out) => Poll::Ready(Some(out)),
            Poll::Pending => Poll::Ready(None),
        });
        if let Some(out) = first.await {
            return Wait::Ready(out);
        }
        let deadline = match limit {
            Limit::For(d) => crate::clock::monotonic() + d,
            Limit::Until(t) => t,
        };
        loop {
            tokio::select! {
                biased;
                out = fut.as_mut() => return Wait::Ready(out),
                w = conn.watch(deadline, self.watching) => match w {
                    Watched::Deadline => return Wait::TimedOut,
                    Watched::Closed => return Wait::ClientGone,
                    // Bytes (e.g. a pipelined request): stop probing, keep going.
                    Watched::Data => self.watching = false,
                },
            }
        }
    }

    /// Sleeps `d` unless the client leaves first; false if it left.
    pub async fn sleep(&mut self, conn: &mut ClientConn, d: Duration) -> bool {
        !matches!(
            self.race(conn, d, pin!(std::future::pending::<()>())).await,
            Wait::ClientGone
        )
    }
}
