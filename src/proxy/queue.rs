//! The queue wait of the select phase (SPEC §5.7): when every runnable candidate is at
//! its concurrency cap, wait FIFO for the first free permit among them.
//!
//! The failover machine decides how long (`queue.wait`, bounded by the request's
//! execution budget) and whether a timeout goes ahead without a permit; this module
//! only waits. Invariants: a request rejected at `queue.max_depth` never waits at all;
//! the wait is counted in `queue_depth` while it lasts; a client that leaves ends it;
//! dropping the wait leaves the semaphore queues without taking anything.

use super::ctx::Request;
use super::watch::{ClientWatch, Wait};
use crate::engine::permits::PermitGuard;
use crate::engine::select::{self, Candidate};
use crate::server::conn::ClientConn;
use futures::future::select_all;
use std::pin::pin;
use std::time::Duration;

pub(super) enum Permitted {
    /// A permit — or, failing open after the wait, an uncounted one.
    Got(Candidate, PermitGuard),
    /// Every candidate already has `queue.max_depth` waiters.
    Full,
    /// The wait ended without a permit (and without failing open).
    TimedOut,
    ClientGone,
}

/// Waits up to `limit` for the first free permit among `full`.
pub(super) async fn wait_for_permit(
    conn: &mut ClientConn,
    watch: &mut ClientWatch,
    req: &Request<'_>,
    full: &[Candidate],
    limit: Duration,
    fail_open: bool,
) -> Permitted {
    let q = &req.snap.config.resilience.queue;
    let limits: Vec<_> = full
        .iter()
        .map(|c| select::limits(req.engine, req.snap, req.model, c))
        .collect();
    if limits.is_empty() {
        return Permitted::TimedOut;
    }
    if q.max_depth > 0 && limits.iter().all(|l| l.waiting() >= q.max_depth) {
        return Permitted::Full;
    }
    // Counted once per connection, however many of its models are waited for.
    let mut per_conn: Vec<_> = limits.clone();
    per_conn.sort_unstable_by(|a, b| a.conn_key.cmp(&b.conn_key));
    per_conn.dedup_by(|a, b| a.conn_key == b.conn_key);
    let _waiting: Vec<_> = per_conn.iter().map(|l| l.wait_on()).collect();
    let waits = limits.iter().enumerate().map(|(i, l)| {
        Box::pin(async move {
            let got = match l.acquire().await {
                // With shared caps, the cluster-wide permit too (SPEC §7.1).
                Some(g) => Some(l.admit_wait(g).await),
                None => None,
            };
            (i, got)
        })
    });
    // The other waits are dropped here, before `limits`, which they borrow.
    let won = match watch.race(conn, limit, pin!(select_all(waits))).await {
        Wait::Ready(((i, got), _, _)) => Wait::Ready((i, got)),
        Wait::TimedOut => Wait::TimedOut,
        Wait::ClientGone => Wait::ClientGone,
    };
    match won {
        Wait::Ready((i, Some(guard))) => Permitted::Got(full[i], guard),
        // The semaphore was closed under us: go on uncounted rather than fail.
        Wait::Ready((i, None)) => Permitted::Got(full[i], limits[i].unlimited()),
        Wait::ClientGone => Permitted::ClientGone,
        Wait::TimedOut if fail_open => {
            let now = req.engine.now();
            let c = select::pick(req.engine, req.snap, req.model, full, now).unwrap_or(full[0]);
            let guard = select::limits(req.engine, req.snap, req.model, &c).unlimited();
            Permitted::Got(c, guard)
        }
        Wait::TimedOut => Permitted::TimedOut,
    }
}
