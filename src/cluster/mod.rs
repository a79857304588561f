//! The strongly consistent half of sharing state between nodes (SPEC §7.1): leases by
//! compare-and-set with the generation fence, and cluster-wide concurrency permits that
//! expire when their node stops renewing them. The eventually consistent half (breakers,
//! cooldowns, lockouts, pins) is the store's change stream (`store::redis`).
//!
//! What it protects: a connection leased to two owners at once across the cluster, and
//! a `max_concurrent: N` that becomes N per node. Invariants: every Redis call runs on
//! this module's own single-threaded runtime with a time limit, so a Redis that hangs
//! costs a request at most [`CALL_TIMEOUT`]; after a failed call, requests' calls fail at
//! once (an outage costs them nothing but their fallback) until the heartbeat, the only
//! caller that keeps trying, finds Redis answering (admissions keep to the node's share
//! for [`RECOVERY`] more); every failure
//! is counted in `sluice_state_backend_errors_total` and turns the node's `reachable`
//! flag off; the URL is never logged (errors name host and port only). This node is
//! listed in `<key_prefix>nodes` with an expiry it renews, so every node knows how many
//! are alive (the cap ÷ live nodes fallback), and each heartbeat writes every permit the
//! node holds — the ones admitted on its share while Redis was down too, so Redis knows
//! the attempts in flight before any node takes permits from it again.

mod leases;
mod permits;
mod pool;
mod scripts;

pub use leases::Acquired;
pub use permits::Ticket;

use crate::policy::Millis;
use redis::aio::MultiplexedConnection;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Longest a strongly consistent call may take before it counts as failed.
pub const CALL_TIMEOUT: Duration = Duration::from_millis(500);
/// How often this node renews its own listing and its permits.
pub const HEARTBEAT: Duration = Duration::from_secs(1);
/// After an outage, how long a node keeps to its share once its heartbeat finds Redis
/// answering: two heartbeats and their calls, so every live node has written the
/// permits it admitted on its share before any node counts on Redis's numbers again.
pub const RECOVERY: Duration = Duration::from_secs(3);
/// A node not heard from for this long no longer counts as alive.
pub const NODE_TTL: Duration = Duration::from_secs(5);
/// A permit's expiry, renewed every [`HEARTBEAT`] while its attempt lasts: a node killed
/// without a goodbye gives its permits back this long after its last renewal.
pub const PERMIT_TTL: Duration = Duration::from_secs(10);

/// Why a cluster call did not give an answer (Redis unreachable, slow or refusing).
#[derive(Clone, Debug, thiserror::Error)]
#[error("shared state unavailable: {0}")]
pub struct ClusterError(pub String);

pub struct Cluster {
    client: redis::Client,
    prefix: String,
    /// The node id of this process's change-stream entries (the store's), so the
    /// change reader skips what the scripts announced for this node.
    node: String,
    place: String,
    rt: tokio::runtime::Handle,
    conn: Mutex<Option<MultiplexedConnection>>,
    /// Held while connecting: one connect at a time, the others wait for its outcome.
    connecting: tokio::sync::Mutex<()>,
    /// Connects tried so far (a waiter whose connect was tried by another takes its
    /// outcome rather than trying again).
    connects: AtomicU64,
    /// `u64::MAX` from a failed call until a heartbeat finds Redis answering (requests'
    /// calls fail at once meanwhile); then the unix ms at which the node's recovery
    /// ends, [`RECOVERY`] after that heartbeat.
    usable_from: AtomicU64,
    /// Nodes alive at the last heartbeat (at least 1: this one).
    live: AtomicU32,
    /// The permits this node holds, by scope key (its sorted set).
    pools: Mutex<HashMap<String, pool::Pool>>,
    /// Numbers the permits' member names.
    tickets: AtomicU64,
    /// The mark Redis held at the last heartbeat (`<prefix>epoch`).
    epoch: Mutex<Option<String>>,
    /// Permits (scope key, member) to give back that could not be while Redis was not
    /// answering (a call that timed out may have taken some): the next heartbeat sends
    /// them.
    owed: Mutex<Vec<(String, String)>>,
    errors: prometheus::IntCounter,
    up: Arc<AtomicBool>,
    scripts: scripts::Scripts,
}

impl Cluster {
    /// Connects lazily to `url` (the first call connects); starts the thread that runs
    /// every Redis call and the heartbeat. `node` is the store's node id.
    pub fn start(
        url: &str,
        prefix: &str,
        node: &str,
        errors: prometheus::IntCounter,
        up: Arc<AtomicBool>,
    ) -> Result<Arc<Cluster>, ClusterError> {
        let client = redis::Client::open(url)
            .map_err(|_| ClusterError("the state.redis URL is not a valid redis:// URL".into()))?;
        let place = crate::store::place_of(&client);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| ClusterError(format!("cannot start the cluster runtime: {e}")))?;
        let cluster = Arc::new(Cluster {
            client,
            prefix: prefix.to_owned(),
            node: node.to_owned(),
            place,
            rt: rt.handle().clone(),
            conn: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            connects: AtomicU64::new(0),
            usable_from: AtomicU64::new(0),
            live: AtomicU32::new(1),
            pools: Mutex::new(HashMap::new()),
            tickets: AtomicU64::new(0),
            epoch: Mutex::new(None),
            owed: Mutex::new(Vec::new()),
            errors,
            up,
            scripts: scripts::Scripts::new(),
        });
        let beat = cluster.clone();
        std::thread::Builder::new()
            .name("sluice-cluster".into())
            .spawn(move || rt.block_on(beat.heartbeat_loop()))
            .map_err(|e| ClusterError(format!("cannot start the cluster thread: {e}")))?;
        Ok(cluster)
    }

    /// Nodes alive at the last heartbeat (this one included; 1 when Redis is down and
    /// nothing was ever seen).
    pub fn live_nodes(&self) -> u32 {
        self.live.load(Ordering::Relaxed).max(1)
    }

    /// Sets the live count a heartbeat would have seen (tests of the outage share).
    #[cfg(test)]
    pub(crate) fn assume_live(&self, n: u32) {
        self.live.store(n, Ordering::Relaxed);
    }

    /// How cluster-wide caps are kept right now, for `/ready` and the health page:
    /// `"cluster"` (permits from Redis), `"share"` (Redis down: cap ÷ live nodes per
    /// node) or `"recovering"` (both, until every node has written its permits).
    pub fn caps_mode(&self) -> &'static str {
        if self.down() {
            "share"
        } else if self.recovering() {
            "recovering"
        } else {
            "cluster"
        }
    }

    /// Whether requests' calls fail at once: a call failed and no heartbeat has found
    /// Redis answering since.
    pub fn down(&self) -> bool {
        self.usable_from.load(Ordering::Acquire) == u64::MAX
    }

    /// Whether Redis answers again after an outage but not every node may have written
    /// the permits it admitted on its share yet ([`RECOVERY`]): admissions then need a
    /// permit from Redis and a place in the share both.
    pub fn recovering(&self) -> bool {
        let from = self.usable_from.load(Ordering::Acquire);
        from != u64::MAX && crate::clock::unix_ms() < from
    }

    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// Runs `f` on a connection, on this module's runtime, within [`CALL_TIMEOUT`].
    async fn call<T, F, Fut>(self: &Arc<Self>, f: F) -> Result<T, ClusterError>
    where
        T: Send + 'static,
        F: FnOnce(MultiplexedConnection) -> Fut + Send + 'static,
        Fut: Future<Output = redis::RedisResult<T>> + Send,
    {
        if self.down() {
            return Err(ClusterError(format!("{}: not answering", self.place)));
        }
        let me = self.clone();
        let task = self.rt.spawn(async move { me.run(f).await });
        // Bounded here too: a cluster thread that does not get to the call must not hold
        // a request (the call's own limit runs on that thread).
        match tokio::time::timeout(CALL_TIMEOUT * 2, task).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(ClusterError("the cluster call was cancelled".into())),
            Err(_) => Err(self.failed("the cluster thread did not answer in time")),
        }
    }

    /// [`Cluster::call`]'s body, for a task already on this module's runtime.
    async fn run<T, F, Fut>(&self, f: F) -> Result<T, ClusterError>
    where
        F: FnOnce(MultiplexedConnection) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        let conn = self.connection().await?;
        match tokio::time::timeout(CALL_TIMEOUT, f(conn)).await {
            Ok(Ok(v)) => {
                self.up.store(true, Ordering::Relaxed);
                Ok(v)
            }
            Ok(Err(e)) => {
                Err(self.failed(&format!("{:?}: {}", e.kind(), e.detail().unwrap_or(""))))
            }
            Err(_) => Err(self.failed("no answer in time")),
        }
    }

    /// The open connection, or a new one (one connect at a time: a call that finds one
    /// under way waits for it, and fails with it).
    async fn connection(&self) -> Result<MultiplexedConnection, ClusterError> {
        let open = || self.conn.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(c) = open() {
            return Ok(c);
        }
        let tried = self.connects.load(Ordering::Acquire);
        let _one = self.connecting.lock().await;
        if let Some(c) = open() {
            return Ok(c);
        }
        if self.connects.load(Ordering::Acquire) != tried {
            return Err(ClusterError(format!("{}: not answering", self.place)));
        }
        self.connects.fetch_add(1, Ordering::AcqRel);
        let made = self
            .client
            .get_multiplexed_async_connection_with_config(
                &redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(CALL_TIMEOUT)
                    .set_response_timeout(CALL_TIMEOUT),
            )
            .await;
        match made {
            Ok(c) => {
                *self.conn.lock().unwrap_or_else(|p| p.into_inner()) = Some(c.clone());
                Ok(c)
            }
            Err(e) => Err(self.failed(&format!("{:?}: {}", e.kind(), e.detail().unwrap_or("")))),
        }
    }

    fn failed(&self, what: &str) -> ClusterError {
        self.errors.inc();
        if self.up.swap(false, Ordering::Relaxed) {
            tracing::warn!(backend = %self.place, error = %what, "cluster: the shared state does not answer; leases refuse, caps fall back to their share per node");
        }
        *self.conn.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.usable_from.store(u64::MAX, Ordering::Release);
        ClusterError(format!("{}: {what}", self.place))
    }

    /// Every [`HEARTBEAT`]: list this node, count the live ones, write held permits.
    async fn heartbeat_loop(self: Arc<Self>) {
        let mut tick = tokio::time::interval(HEARTBEAT);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            // A failed heartbeat is counted like any call; the next one retries. Right
            // after an outage, once more at once: the share permits admitted while the
            // first was on its way are written too before the recovery counts on them.
            if let Ok(true) = self.heartbeat().await {
                let _ = self.heartbeat().await;
            }
        }
    }

    /// Runs on this module's runtime, and tries Redis even while requests do not.
    /// `Ok(true)` when it ended an outage.
    async fn heartbeat(self: &Arc<Self>) -> Result<bool, ClusterError> {
        let now = crate::clock::unix_ms();
        let nodes = self.key("nodes");
        let epoch_key = self.key("epoch");
        // A mark Redis keeps while it keeps its data: a new one means it lost them.
        let mark = format!("{}:{now}", self.node);
        let node = self.node.clone();
        let permit_until = now.saturating_add(PERMIT_TTL.as_millis() as Millis);
        // Every permit held, and the ones idle for a whole beat to give back.
        let (held, idle) = {
            let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
            let mut held = Vec::new();
            let mut idle = Vec::new();
            for (key, pool) in pools.iter_mut() {
                idle.extend(pool.beat().into_iter().map(|m| (key.clone(), m)));
                held.extend(pool.members().map(|m| (key.clone(), m.clone())));
            }
            pools.retain(|_, p| !p.is_empty());
            (held, idle)
        };
        let mut owed = std::mem::take(&mut *self.owed.lock().unwrap_or_else(|p| p.into_inner()));
        owed.extend(idle);
        let unsent = owed.clone();
        let written = held.clone();
        let answer: Result<(u32, String), ClusterError> = self
            .run(move |mut c| async move {
                let mut pipe = redis::pipe();
                pipe.cmd("ZADD")
                    .arg(&nodes)
                    .arg(now.saturating_add(NODE_TTL.as_millis() as Millis))
                    .arg(&node)
                    .ignore();
                pipe.cmd("ZREMRANGEBYSCORE")
                    .arg(&nodes)
                    .arg("-inf")
                    .arg(now)
                    .ignore();
                pipe.cmd("ZCARD").arg(&nodes);
                pipe.cmd("SET")
                    .arg(&epoch_key)
                    .arg(&mark)
                    .arg("NX")
                    .ignore();
                pipe.cmd("GET").arg(&epoch_key);
                // Written, not only renewed: a permit Redis lost (restarted empty) or
                // never saw (admitted on the share) is counted again.
                for (key, member) in &written {
                    pipe.cmd("ZADD")
                        .arg(key)
                        .arg(permit_until)
                        .arg(member)
                        .ignore();
                }
                for (key, member) in &owed {
                    pipe.cmd("ZREM").arg(key).arg(member).ignore();
                }
                pipe.query_async::<(u32, String)>(&mut c).await
            })
            .await;
        // A permit given back while this heartbeat was on its way may have been written
        // again after its removal: the next heartbeat removes it once more (whether this
        // one was answered or not: Redis may have run it).
        let gone: Vec<_> = {
            let pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
            held.into_iter()
                .filter(|(k, m)| !pools.get(k).is_some_and(|p| p.holds(m)))
                .collect()
        };
        self.owe(gone);
        let (live, epoch) = match answer {
            Ok(a) => a,
            Err(e) => {
                self.owe(unsent);
                return Err(e);
            }
        };
        // Redis restarted without its data while this node went on lending permits it
        // held (no call failed): the same recovery as after an outage, this beat having
        // written them back.
        let lost = {
            let mut seen = self.epoch.lock().unwrap_or_else(|p| p.into_inner());
            let lost = seen.as_ref().is_some_and(|e| *e != epoch);
            *seen = Some(epoch);
            lost
        };
        if lost && !self.down() {
            tracing::warn!(backend = %self.place, "cluster: the shared state restarted without its data; caps keep to their share per node until every node has written its permits");
            let until = crate::clock::unix_ms().saturating_add(RECOVERY.as_millis() as Millis);
            self.usable_from.store(until, Ordering::Release);
        }
        // Back from an outage, the nodes list again one heartbeat after another (all of
        // them, if Redis restarted empty): the count the shares were cut by holds until
        // the recovery ends, or the first node back would take every node's share.
        if self.down() || self.recovering() {
            self.live.fetch_max(live.max(1), Ordering::Relaxed);
        } else {
            self.live.store(live.max(1), Ordering::Relaxed);
        }
        // Back after an outage: requests count on Redis again once every node has had a
        // heartbeat to write its permits (unless a call failed meanwhile).
        let recovered = crate::clock::unix_ms().saturating_add(RECOVERY.as_millis() as Millis);
        Ok(self
            .usable_from
            .compare_exchange(u64::MAX, recovered, Ordering::AcqRel, Ordering::Acquire)
            .is_ok())
    }
}
