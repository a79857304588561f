//! Concurrency permits per connection and per connection + model (SPEC §5.7).
//!
//! Each limited scope has a fair (FIFO) tokio semaphore sized by its configured cap.
//! A permit is an RAII guard: it is returned exactly once, when the attempt that holds
//! it is dropped, whatever happened to the request. Waiting requests are counted per
//! connection (`queue_depth`) so admission can reject at `queue.max_depth` before
//! waiting at all. A reload that changes a cap starts a semaphore for the new cap;
//! requests still on the old config finish on the old one.
//!
//! A config generation resolves each (model, target, connection) to its [`Limits`] once
//! (`Snapshot::limits`): the semaphores and counters are then reached through `Arc`s,
//! with no key formatting or map lookup on the request path.
//!
//! With several nodes sharing state (SPEC §7.1), a capped attempt also holds a
//! cluster-wide permit (`cluster::Ticket`), taken after the local ones
//! ([`Limits::admit`]): the local semaphore keeps this node's requests in order, the
//! cluster's count keeps the cap across nodes.

use super::state::lock;
use crate::cluster::{Cluster, Ticket};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// One connection's counters: attempts in flight and requests waiting for a permit.
#[derive(Default)]
pub struct Counters {
    pub inflight: AtomicU32,
    pub waiting: AtomicU32,
    /// Attempts admitted cluster-wide (a permit from Redis, or a place in this node's
    /// share while Redis does not answer); requests that hold the local permits while
    /// they wait for the cluster's are not among them.
    pub admitted: AtomicU32,
}

#[derive(Default)]
pub struct Permits {
    slots: Mutex<HashMap<String, Arc<Semaphore>>>,
    counters: Mutex<HashMap<String, Arc<Counters>>>,
    /// Set once at start when caps are shared with other nodes (before any request).
    pub cluster: OnceLock<Arc<Cluster>>,
}

/// The cluster-wide side of one attempt's limits.
#[derive(Clone)]
struct Shared {
    cluster: Arc<Cluster>,
    /// (sorted set, cap) per limited scope.
    scopes: Vec<(String, u32)>,
    /// Per limited scope, the attempts this node admitted in it and the cap shared out
    /// when Redis does not answer (the connection's counters; the model scope's own).
    counted: Vec<(Arc<Counters>, u32)>,
}

/// Pause between two tries of a request waiting for a cluster-wide permit (plus up to as
/// much again at random, so waiting nodes do not poll in step).
const CLUSTER_POLL: Duration = Duration::from_millis(25);

/// Held permits of one attempt (connection and, if limited, connection + model) plus
/// the in-flight count; all released on drop.
pub struct PermitGuard {
    _permits: Vec<OwnedSemaphorePermit>,
    /// The cluster-wide permit, when the node shares its caps (SPEC §7.1).
    _ticket: Option<Ticket>,
    /// The scopes' counters the attempt counts in as admitted (empty: not admitted).
    admitted: Vec<Arc<Counters>>,
    counters: Arc<Counters>,
}

impl PermitGuard {
    /// Counts the attempt as admitted in every scope of `counted` if each has a place:
    /// fewer admitted than its cap ÷ `live` nodes (at least 1), or any number without
    /// `live`. True when counted (now or before).
    fn count_within(&mut self, counted: &[(Arc<Counters>, u32)], live: Option<u32>) -> bool {
        if !self.admitted.is_empty() || counted.is_empty() {
            return true;
        }
        for (i, (c, cap)) in counted.iter().enumerate() {
            let share = live.map_or(u32::MAX, |n| (cap / n.max(1)).max(1));
            let placed = c
                .admitted
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < share).then_some(n + 1)
                })
                .is_ok();
            if !placed {
                for (c, _) in &counted[..i] {
                    c.admitted.fetch_sub(1, Ordering::AcqRel);
                }
                return false;
            }
        }
        self.admitted = counted.iter().map(|(c, _)| c.clone()).collect();
        true
    }

    fn uncount(&mut self) {
        for c in self.admitted.drain(..) {
            c.admitted.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// The attempt admitted cluster-wide with `ticket`.
    fn admit(mut self, counted: &[(Arc<Counters>, u32)], ticket: Ticket) -> PermitGuard {
        self.count_within(counted, None);
        self._ticket = Some(ticket);
        self
    }
}

impl Drop for PermitGuard {
    fn drop(&mut self) {
        self.counters.inflight.fetch_sub(1, Ordering::AcqRel);
        self.uncount();
    }
}

/// Counts a request as waiting on a connection while it exists.
pub struct WaitGuard(Arc<Counters>);

impl Drop for WaitGuard {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The limits that apply to one (connection, model) attempt, resolved to the semaphores
/// and counters they use.
#[derive(Clone)]
pub struct Limits {
    /// `provider/connection`.
    pub conn_key: String,
    counters: Arc<Counters>,
    /// The connection's semaphore, when `max_concurrent` is set.
    conn: Option<Arc<Semaphore>>,
    /// The connection + model semaphore, when `model_concurrency` names the model.
    model: Option<Arc<Semaphore>>,
    /// The cluster-wide permits, when the node shares caps and one applies.
    shared: Option<Shared>,
}

impl Limits {
    /// Attempts in flight on the connection.
    pub fn inflight(&self) -> u32 {
        self.counters.inflight.load(Ordering::Acquire)
    }

    /// Requests waiting for a permit on the connection.
    pub fn waiting(&self) -> u32 {
        self.counters.waiting.load(Ordering::Acquire)
    }

    /// True when a permit could be taken right now (nothing is reserved).
    pub fn has_free(&self) -> bool {
        let free =
            |s: &Option<Arc<Semaphore>>| s.as_ref().is_none_or(|s| s.available_permits() > 0);
        free(&self.conn) && free(&self.model)
    }

    /// Takes the permits now, or `None` when a cap is full.
    pub fn try_acquire(&self) -> Option<PermitGuard> {
        // No allocation for a slot without caps.
        let caps = usize::from(self.conn.is_some()) + usize::from(self.model.is_some());
        let mut held = Vec::with_capacity(caps);
        if let Some(s) = &self.conn {
            held.push(s.clone().try_acquire_owned().ok()?);
        }
        if let Some(s) = &self.model {
            held.push(s.clone().try_acquire_owned().ok()?);
        }
        Some(self.guard(held))
    }

    /// Waits (FIFO per semaphore) for the permits; cancel-safe: dropping the future
    /// leaves the queue without taking anything. The narrower model permit is taken
    /// first: a request waiting for its model's cap must not sit on a connection permit
    /// meanwhile, or it would starve every other model of that connection.
    pub async fn acquire(&self) -> Option<PermitGuard> {
        let mut held = Vec::with_capacity(2);
        if let Some(s) = &self.model {
            held.push(s.clone().acquire_owned().await.ok()?);
        }
        if let Some(s) = &self.conn {
            held.push(s.clone().acquire_owned().await.ok()?);
        }
        Some(self.guard(held))
    }

    /// After the local permits, the cluster-wide one (SPEC §7.1), when caps are shared:
    /// `Err` gives the local permits back to the caller when the cluster is at its cap.
    /// When Redis does not answer, this node keeps to its share of the connection's
    /// caps, `cap ÷ live nodes` (at least 1) for `max_concurrent` and for the model's
    /// `model_concurrency` alike, counting the attempts already admitted (with a permit
    /// from before the outage or on the share), not the ones waiting. While the cluster
    /// recovers from an outage, an attempt needs a place in the share and a permit from
    /// Redis both.
    pub async fn admit(&self, mut guard: PermitGuard) -> Result<PermitGuard, PermitGuard> {
        let Some(s) = &self.shared else {
            return Ok(guard);
        };
        let live = Some(s.cluster.live_nodes());
        // Counted before the call, so a wait dropped during it gives the place back.
        if s.cluster.recovering() && !guard.count_within(&s.counted, live) {
            return Err(guard);
        }
        match s.cluster.permit(&s.scopes).await {
            Ok(Some(ticket)) => Ok(guard.admit(&s.counted, ticket)),
            Ok(None) => {
                guard.uncount();
                Err(guard)
            }
            // Only an outage puts the node on its share; a call that failed otherwise
            // (the node's first connect under way) is a cluster that is full for now.
            Err(_) if s.cluster.down() && guard.count_within(&s.counted, live) => {
                Ok(guard.admit(&s.counted, s.cluster.share_ticket(&s.scopes)))
            }
            Err(_) => {
                guard.uncount();
                Err(guard)
            }
        }
    }

    /// [`Limits::admit`] until it succeeds, holding the local permits meanwhile (FIFO
    /// among this node's requests; across nodes, whoever asks first after a permit is
    /// given back). Cancel-safe: a dropped wait gives back whatever it took.
    pub async fn admit_wait(&self, mut guard: PermitGuard) -> PermitGuard {
        loop {
            match self.admit(guard).await {
                Ok(g) => return g,
                Err(g) => guard = g,
            }
            let jitter = rand::random::<u64>() % (CLUSTER_POLL.as_millis() as u64 + 1);
            tokio::time::sleep(CLUSTER_POLL + Duration::from_millis(jitter)).await;
        }
    }

    /// Whether a cluster-wide permit is needed on top of the local ones.
    pub fn is_shared(&self) -> bool {
        self.shared.is_some()
    }

    /// An attempt that runs without a permit (no cap, or fail-open after a wait) still
    /// counts as in flight.
    pub fn unlimited(&self) -> PermitGuard {
        self.guard(Vec::new())
    }

    fn guard(&self, held: Vec<OwnedSemaphorePermit>) -> PermitGuard {
        self.counters.inflight.fetch_add(1, Ordering::AcqRel);
        PermitGuard {
            _permits: held,
            _ticket: None,
            admitted: Vec::new(),
            counters: self.counters.clone(),
        }
    }

    /// Marks one request as waiting on the connection until the guard drops.
    pub fn wait_on(&self) -> WaitGuard {
        self.counters.waiting.fetch_add(1, Ordering::AcqRel);
        WaitGuard(self.counters.clone())
    }
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

    /// Resolves the limits of one (connection, model): `conn_limit` is the connection's
    /// `max_concurrent`, `model` its `model_concurrency` entry for the model, if any.
    pub fn resolve(
        &self,
        conn_key: &str,
        conn_limit: Option<u32>,
        model: Option<(&str, u32)>,
    ) -> Limits {
        let shared = self.cluster.get().and_then(|cluster| {
            let mut scopes = Vec::with_capacity(2);
            let mut counted = Vec::with_capacity(2);
            if let Some(n) = conn_limit {
                scopes.push((cluster.permit_key(conn_key), n));
                counted.push((self.counters(conn_key), n));
            }
            if let Some((k, n)) = model {
                scopes.push((cluster.permit_key(k), n));
                counted.push((self.counters(k), n));
            }
            (!scopes.is_empty()).then(|| Shared {
                cluster: cluster.clone(),
                scopes,
                counted,
            })
        });
        Limits {
            conn_key: conn_key.to_string(),
            counters: self.counters(conn_key),
            conn: conn_limit.map(|n| self.semaphore(conn_key, n)),
            model: model.map(|(k, n)| self.semaphore(k, n)),
            shared,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(p: &Permits, conn: Option<u32>, model: Option<u32>) -> Limits {
        p.resolve("p/c", conn, model.map(|n| ("p/c/m", n)))
    }

    #[test]
    fn permits_are_released_exactly_once_on_drop() {
        let p = Permits::default();
        let l = limits(&p, Some(2), None);
        let a = l.try_acquire().unwrap();
        let b = l.try_acquire().unwrap();
        assert!(l.try_acquire().is_none());
        assert_eq!(p.inflight("p/c"), 2);
        drop(a);
        assert_eq!(p.inflight("p/c"), 1);
        let c = l.try_acquire().unwrap();
        drop((b, c));
        assert_eq!(p.inflight("p/c"), 0);
        assert!(l.has_free());
    }

    #[test]
    fn model_cap_applies_inside_the_connection_cap() {
        let p = Permits::default();
        let l = limits(&p, Some(4), Some(1));
        let _a = l.try_acquire().unwrap();
        assert!(l.try_acquire().is_none(), "model cap 1");
        let other = limits(&p, Some(4), None);
        assert!(
            other.try_acquire().is_some(),
            "other models still fit the connection cap"
        );
    }

    #[tokio::test]
    async fn a_model_waiter_holds_no_connection_permit() {
        let p = Arc::new(Permits::default());
        let l = limits(&p, Some(2), Some(1));
        let running = l.try_acquire().unwrap();
        let lw = l.clone();
        let waiter = tokio::spawn(async move { lw.acquire().await.map(drop) });
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        // The connection's second slot is still free for another model.
        let other = limits(&p, Some(2), None);
        let o = other.try_acquire();
        assert!(
            o.is_some(),
            "the model waiter took the connection's last permit"
        );
        drop((o, running));
        waiter.await.unwrap().unwrap();
    }

    /// With Redis down a node keeps to its share of the cap; requests that hold the
    /// local permits while they wait for the share do not count against it, or two
    /// waiters on a share of 1 would refuse each other forever.
    #[tokio::test]
    async fn an_outage_share_counts_admitted_attempts_not_waiters() {
        let p = Permits::default();
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("redis://{}/", closed.local_addr().unwrap());
        drop(closed);
        let errors = prometheus::IntCounter::new("e", "e").unwrap();
        let up = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let cluster = Cluster::start(&url, "t:", "n1", errors.clone(), up).unwrap();
        // Cap 4 over three live nodes: a share of 1.
        cluster.assume_live(3);
        p.cluster.set(cluster).ok().unwrap();
        let l = limits(&p, Some(4), None);
        let first = l.admit(l.try_acquire().unwrap()).await.ok().unwrap();
        let second = l.admit(l.try_acquire().unwrap()).await.err().unwrap();
        let third = l.admit(l.try_acquire().unwrap()).await.err().unwrap();
        assert_eq!(l.inflight(), 3, "the waiters hold their local permits");
        drop(first);
        let second = l.admit(second).await.ok().expect("the share is free again");
        let third = l.admit(third).await.err().expect("one at a time");
        drop(second);
        let third = l.admit(third).await.ok().unwrap();
        drop(third);
        assert_eq!(l.counters.admitted.load(Ordering::Acquire), 0);
        // A model cap is shared out too: 3 over three nodes, one per node.
        let m = limits(&p, None, Some(3));
        let a = m.admit(m.try_acquire().unwrap()).await.ok().unwrap();
        let b = m.admit(m.try_acquire().unwrap()).await.err().unwrap();
        drop(a);
        drop(
            m.admit(b)
                .await
                .ok()
                .expect("the model share is free again"),
        );
        assert_eq!(l.inflight(), 0);
        assert!(errors.get() > 0, "the failed calls are counted");
    }

    #[test]
    fn unlimited_counts_inflight_without_permits() {
        let p = Permits::default();
        let l = limits(&p, None, None);
        let g = l.try_acquire().unwrap();
        let u = l.unlimited();
        assert_eq!(p.inflight("p/c"), 2);
        drop((g, u));
        assert_eq!(p.inflight("p/c"), 0);
    }

    #[tokio::test]
    async fn waiters_are_served_in_order() {
        let p = Arc::new(Permits::default());
        let l = limits(&p, Some(1), None);
        let first = l.try_acquire().unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..3 {
            let (l, order) = (l.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let _w = l.wait_on();
                let g = l.acquire().await.unwrap();
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
