//! Concurrency permits per connection and per connection + model (SPEC §5.7).
//!
//! Each limited scope has a fair (FIFO) tokio semaphore sized by its configured cap.
//! A permit is an RAII guard: it is returned exactly once, when the attempt that holds
//! it is dropped, whatever happened to the request. Waiting requests are counted per
//! connection (`queue_depth`) so admission can reject at `queue.max_depth` before
//! waiting at all. A reload that changes a cap starts a semaphore for the new cap;
//! requests still on the old config finish on the old one.

use super::state::lock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// One connection's counters: attempts in flight and requests waiting for a permit.
#[derive(Default)]
pub struct Counters {
    pub inflight: AtomicU32,
    pub waiting: AtomicU32,
}

#[derive(Default)]
pub struct Permits {
    slots: Mutex<HashMap<String, Arc<Semaphore>>>,
    counters: Mutex<HashMap<String, Arc<Counters>>>,
}

/// Held permits of one attempt (connection and, if limited, connection + model) plus
/// the in-flight count; all released on drop.
pub struct PermitGuard {
    _permits: Vec<OwnedSemaphorePermit>,
    counters: Arc<Counters>,
}

impl Drop for PermitGuard {
    fn drop(&mut self) {
        self.counters.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Counts a request as waiting on a connection while it exists.
pub struct WaitGuard(Arc<Counters>);

impl Drop for WaitGuard {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The limits that apply to one (connection, model) attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// `provider/connection`.
    pub conn_key: String,
    pub conn_limit: Option<u32>,
    /// `provider/connection/model` and its cap, when `model_concurrency` names the model.
    pub model: Option<(String, u32)>,
}

impl Permits {
    /// The semaphore of `key` at cap `limit`. Keyed by both, so requests pinned to an
    /// older config (another cap) keep using their own semaphore instead of resetting
    /// the current one; during a reload the two caps may briefly add up.
    fn semaphore(&self, key: &str, limit: u32) -> Arc<Semaphore> {
        lock(&self.slots)
            .entry(format!("{key}@{limit}"))
            .or_insert_with(|| Arc::new(Semaphore::new(limit as usize)))
            .clone()
    }

    pub fn counters(&self, conn_key: &str) -> Arc<Counters> {
        lock(&self.counters)
            .entry(conn_key.to_string())
            .or_default()
            .clone()
    }

    /// Attempts in flight on a connection.
    pub fn inflight(&self, conn_key: &str) -> u32 {
        lock(&self.counters)
            .get(conn_key)
            .map_or(0, |c| c.inflight.load(Ordering::Acquire))
    }

    /// Requests waiting for a permit on a connection.
    pub fn waiting(&self, conn_key: &str) -> u32 {
        lock(&self.counters)
            .get(conn_key)
            .map_or(0, |c| c.waiting.load(Ordering::Acquire))
    }

    /// True when a permit could be taken right now (nothing is reserved).
    pub fn has_free(&self, l: &Limits) -> bool {
        let free = |key: &str, limit: u32| self.semaphore(key, limit).available_permits() > 0;
        l.conn_limit.is_none_or(|n| free(&l.conn_key, n))
            && l.model.as_ref().is_none_or(|(k, n)| free(k, *n))
    }

    /// Takes the permits now, or `None` when a cap is full.
    pub fn try_acquire(&self, l: &Limits) -> Option<PermitGuard> {
        let mut held = Vec::with_capacity(2);
        if let Some(n) = l.conn_limit {
            held.push(self.semaphore(&l.conn_key, n).try_acquire_owned().ok()?);
        }
        if let Some((k, n)) = &l.model {
            held.push(self.semaphore(k, *n).try_acquire_owned().ok()?);
        }
        Some(self.guard(l, held))
    }

    /// Waits (FIFO per semaphore) for the permits of `l`; cancel-safe: dropping the
    /// future leaves the queue without taking anything. The narrower model permit is
    /// taken first: a request waiting for its model's cap must not sit on a connection
    /// permit meanwhile, or it would starve every other model of that connection.
    pub async fn acquire(&self, l: &Limits) -> Option<PermitGuard> {
        let mut held = Vec::with_capacity(2);
        if let Some((k, n)) = &l.model {
            held.push(self.semaphore(k, *n).acquire_owned().await.ok()?);
        }
        if let Some(n) = l.conn_limit {
            held.push(self.semaphore(&l.conn_key, n).acquire_owned().await.ok()?);
        }
        Some(self.guard(l, held))
    }

    /// An attempt that runs without a permit (no cap, or fail-open after a wait) still
    /// counts as in flight.
    pub fn unlimited(&self, l: &Limits) -> PermitGuard {
        self.guard(l, Vec::new())
    }

    fn guard(&self, l: &Limits, held: Vec<OwnedSemaphorePermit>) -> PermitGuard {
        let counters = self.counters(&l.conn_key);
        counters.inflight.fetch_add(1, Ordering::AcqRel);
        PermitGuard {
            _permits: held,
            counters,
        }
    }

    /// Marks one request as waiting on `conn_key` until the guard drops.
    pub fn wait_on(&self, conn_key: &str) -> WaitGuard {
        let c = self.counters(conn_key);
        c.waiting.fetch_add(1, Ordering::AcqRel);
        WaitGuard(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(conn: Option<u32>, model: Option<u32>) -> Limits {
        Limits {
            conn_key: "p/c".into(),
            conn_limit: conn,
            model: model.map(|n| ("p/c/m".to_string(), n)),
        }
    }

    #[test]
    fn permits_are_released_exactly_once_on_drop() {
        let p = Permits::default();
        let l = limits(Some(2), None);
        let a = p.try_acquire(&l).unwrap();
        let b = p.try_acquire(&l).unwrap();
        assert!(p.try_acquire(&l).is_none());
        assert_eq!(p.inflight("p/c"), 2);
        drop(a);
        assert_eq!(p.inflight("p/c"), 1);
        let c = p.try_acquire(&l).unwrap();
        drop((b, c));
        assert_eq!(p.inflight("p/c"), 0);
        assert!(p.has_free(&l));
    }

    #[test]
    fn model_cap_applies_inside_the_connection_cap() {
        let p = Permits::default();
        let l = limits(Some(4), Some(1));
        let _a = p.try_acquire(&l).unwrap();
        assert!(p.try_acquire(&l).is_none(), "model cap 1");
        let other = Limits {
            model: None,
            ..l.clone()
        };
        assert!(
            p.try_acquire(&other).is_some(),
            "other models still fit the connection cap"
        );
    }

    #[tokio::test]
    async fn a_model_waiter_holds_no_connection_permit() {
        let p = Arc::new(Permits::default());
        let l = limits(Some(2), Some(1));
        let running = p.try_acquire(&l).unwrap();
        let (pt, lw) = (p.clone(), l.clone());
        let waiter = tokio::spawn(async move { pt.acquire(&lw).await.map(drop) });
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        // The connection's second slot is still free for another model.
        let other = Limits {
            model: None,
            ..l.clone()
        };
        let o = p.try_acquire(&other);
        assert!(
            o.is_some(),
            "the model waiter took the connection's last permit"
        );
        drop((o, running));
        waiter.await.unwrap().unwrap();
    }

    #[test]
    fn unlimited_counts_inflight_without_permits() {
        let p = Permits::default();
        let l = limits(None, None);
        let g = p.try_acquire(&l).unwrap();
        let u = p.unlimited(&l);
        assert_eq!(p.inflight("p/c"), 2);
        drop((g, u));
        assert_eq!(p.inflight("p/c"), 0);
    }

    #[tokio::test]
    async fn waiters_are_served_in_order() {
        let p = Arc::new(Permits::default());
        let l = limits(Some(1), None);
        let first = p.try_acquire(&l).unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..3 {
            let (pt, l, order) = (p.clone(), l.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let _w = pt.wait_on("p/c");
                let g = pt.acquire(&l).await.unwrap();
                order.lock().unwrap().push(i);
                drop(g);
            }));
            // Let each task enqueue before the next one.
            while p.waiting("p/c") < i + 1 {
                tokio::task::yield_now().await;
            }
        }
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2]);
        assert_eq!(p.waiting("p/c"), 0);
        assert_eq!(p.inflight("p/c"), 0);
    }
}
