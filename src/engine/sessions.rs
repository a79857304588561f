//! Session layers and per-connection signals on the engine: exclusive leases (SPEC
//! §5.6), affinity pins (§5.5), and the latency / rate-limit signals the load-aware
//! strategies read (§5.12).
//!
//! With a shared backend (SPEC §7.1) every lease change is the cluster's compare-and-set
//! and the local table only mirrors what the cluster stored (routing reads it); other
//! nodes' changes reach the mirror through the change stream.
//!
//! Lease changes are committed to the store before the caller answers (durable first):
//! an acquire whose commit fails is taken back, and a renew or release whose commit fails
//! is reported as a failure (the change stays queued), so a client is never told "done"
//! about a lease change a restart would forget. Pin changes go through the batched writer. Only owner-token hashes and hashed
//! session keys are ever stored.

use super::select::breaker_config;
use super::state::{change, lock};
use super::{Engine, Signals, Snapshot};
use crate::cluster::{Acquired, Cluster, ClusterError};
use crate::config::Client;
use crate::policy::affinity::Pin;
use crate::policy::breaker::Permit;
use crate::policy::cooldown::Eligibility;
use crate::policy::lease::{effective_ttl, owner_hash, owner_token, Lease, LeaseError, LeaseTable};
use crate::policy::Millis;
use crate::routing::parse_rate_limit;
use crate::store::{Change, CommitWait, Image, StoreError, Table};
use foldhash::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Why none of a client's connections can be leased right now.
pub enum LeaseRefusal {
    Lease(LeaseError),
    /// Nothing eligible: the soonest any allowed connection comes back, if a timer holds it.
    NoneEligible {
        retry_at: Option<Millis>,
    },
    /// The lease could not be made durable; it was taken back (SPEC §5.6: durable first).
    Store(StoreError),
}

/// Why a renew or release did not succeed.
pub enum LeaseFailure {
    Lease(LeaseError),
    /// Done in memory but not durable: the client must not be told it succeeded. The
    /// change stays queued and is retried.
    Store(StoreError),
}

impl Engine {
    /// The client's allowed connections that ordinary routing considers eligible now, in
    /// the order the client listed them, plus the soonest timer among the others.
    pub fn lease_candidates(
        &self,
        snap: &Snapshot,
        client: &Client,
        now: Millis,
    ) -> (Vec<String>, Option<Millis>) {
        let cfg = &snap.config;
        let mut eligible = Vec::new();
        let mut soonest: Option<Millis> = None;
        for id in client.allowed_connections.iter().flatten() {
            let Some((pid, cid)) = id.split_once('/') else {
                continue;
            };
            let Some(pi) = cfg.providers.iter().position(|p| p.id == pid) else {
                continue;
            };
            if !cfg.providers[pi].connections.iter().any(|c| c.id == cid) {
                continue;
            }
            let mut until: Option<Millis> = None;
            if let Some(e) = self.tables.connection_if_any(pid, cid) {
                match lock(&e).state.eligibility(now) {
                    Eligibility::Eligible => {}
                    Eligibility::Cooling { until: u } => until = Some(u),
                    Eligibility::Terminal(_) => continue,
                }
            }
            if until.is_none() {
                if let Some(e) = self.tables.provider_if_any(pid) {
                    if let Permit::Deny { retry_at } =
                        lock(&e).breaker.peek(&breaker_config(snap, pi), now)
                    {
                        until = Some(retry_at);
                    }
                }
            }
            match until {
                None => eligible.push(id.clone()),
                Some(u) => soonest = Some(soonest.map_or(u, |s| s.min(u))),
            }
        }
        (eligible, soonest)
    }

    /// Applies `f` to the lease table and, when it says so (`Some(removed)`), queues the
    /// table's rows plus deletes of `removed` for commit, all under the table's lock: the
    /// writer keeps the last value per key, so snapshots must reach it in the order the
    /// changes were made, or an older one could bring back a released lease.
    fn change_leases<R>(
        &self,
        f: impl FnOnce(&mut LeaseTable) -> (R, Option<Vec<String>>),
    ) -> (R, Option<CommitWait>) {
        let mut table = self.leases.lock();
        let (r, removed) = f(&mut table);
        let wait = match (removed, &self.store) {
            (Some(removed), Some(store)) => {
                let mut changes: Vec<Change> = table
                    .rows()
                    .into_iter()
                    .map(|(k, v)| Change::upsert(Table::Leases, k, v))
                    .collect();
                changes.extend(
                    removed
                        .into_iter()
                        .map(|k| Change::delete(Table::Leases, k)),
                );
                Some(store.queue_commit(changes))
            }
            _ => None,
        };
        (r, wait)
    }

    async fn committed(wait: Option<CommitWait>) -> Result<(), StoreError> {
        match wait {
            Some(w) => w.wait().await.inspect_err(|e| {
                tracing::error!(error = %e, "lease change not persisted");
            }),
            None => Ok(()),
        }
    }

    pub async fn lease_acquire(
        &self,
        snap: &Snapshot,
        client: &Client,
        ttl: Option<Duration>,
    ) -> Result<(String, Lease), LeaseRefusal> {
        let now = self.now();
        let (eligible, soonest) = self.lease_candidates(snap, client, now);
        if let Some(cluster) = self.cluster.get() {
            let ttl = effective_ttl(ttl).map_err(LeaseRefusal::Lease)?;
            return self
                .lease_acquire_shared(cluster, &client.id, &eligible, soonest, ttl, now)
                .await;
        }
        let random: [u8; 32] = rand::random();
        let (result, wait) = self.change_leases(|table| {
            let pruned = table.prune(now);
            let r = table.acquire(&client.id, &eligible, ttl, random, now);
            let persist = r.is_ok().then_some(pruned);
            (r, persist)
        });
        match result {
            Ok((token, lease)) => match Self::committed(wait).await {
                Ok(()) => Ok((token, lease)),
                Err(e) => {
                    // Not durable, so not granted: take it back and queue the undo (the
                    // failed commit stays queued and could otherwise land later).
                    let hash = lease.owner_hash.clone();
                    let ((), _undo) = self.change_leases(|table| {
                        let _ = table.release(&client.id, &token, now);
                        ((), Some(vec![hash]))
                    });
                    Err(LeaseRefusal::Store(e))
                }
            },
            Err(LeaseError::NoneEligible) => Err(LeaseRefusal::NoneEligible { retry_at: soonest }),
            Err(e) => Err(LeaseRefusal::Lease(e)),
        }
    }

    pub async fn lease_renew(
        &self,
        client: &Client,
        owner: &str,
        ttl: Option<Duration>,
    ) -> Result<Lease, LeaseFailure> {
        let now = self.now();
        if let Some(cluster) = self.cluster.get() {
            let ttl = effective_ttl(ttl).map_err(LeaseFailure::Lease)?;
            let r = cluster.lease_renew(&client.id, owner, ttl, now).await;
            return self.mirrored(owner, r, false);
        }
        let (renewed, wait) = self.change_leases(|table| {
            let r = table.renew(&client.id, owner, ttl, now);
            let persist = r.is_ok().then(Vec::new);
            (r, persist)
        });
        let lease = renewed.map_err(LeaseFailure::Lease)?;
        Self::committed(wait).await.map_err(LeaseFailure::Store)?;
        Ok(lease)
    }

    /// A release whose commit fails puts the lease back (the client is told it failed,
    /// so a retried release must find it, and memory must not say "free" while the
    /// store still says "held").
    pub async fn lease_release(&self, client: &Client, owner: &str) -> Result<Lease, LeaseFailure> {
        let now = self.now();
        if let Some(cluster) = self.cluster.get() {
            let r = cluster.lease_release(&client.id, owner, now).await;
            return self.mirrored(owner, r, true);
        }
        let (released, wait) = self.change_leases(|table| {
            let r = table.release(&client.id, owner, now);
            let persist = r.as_ref().ok().map(|l| vec![l.owner_hash.clone()]);
            (r, persist)
        });
        let lease = released.map_err(LeaseFailure::Lease)?;
        if let Err(e) = Self::committed(wait).await {
            let back = lease.clone();
            let ((), _redo) = self.change_leases(|table| {
                table.restore(back, now);
                ((), Some(Vec::new()))
            });
            return Err(LeaseFailure::Store(e));
        }
        Ok(lease)
    }

    /// The dispatch fence (owner hash + generation + client). With a shared backend the
    /// owner's row is read from it first (strong: a lease released or taken over on
    /// another node fails here at once); when it does not answer, the local view
    /// decides, so requests of a leased session keep being served through an outage.
    pub async fn lease_fence(
        &self,
        client: &str,
        owner: &str,
        generation: u64,
    ) -> Result<Lease, LeaseError> {
        if let Some(cluster) = self.cluster.get() {
            if let Ok(row) = cluster.lease_get(owner).await {
                let now = self.now();
                let mut table = self.leases.lock();
                match row {
                    Some(lease) => table.mirror(lease, now),
                    None => {
                        table.forget(&owner_hash(owner));
                    }
                }
            }
        }
        self.lease_check(client, owner, generation)
    }

    /// The dispatch fence on the local view only.
    pub fn lease_check(
        &self,
        client: &str,
        owner: &str,
        generation: u64,
    ) -> Result<Lease, LeaseError> {
        self.leases
            .lock()
            .check(client, owner, generation, self.now())
            .cloned()
    }

    /// Moves a lease whose connection became ineligible to a free eligible one (same
    /// generation), durably. `None` when nothing is free.
    pub async fn lease_relocate(
        &self,
        snap: &Snapshot,
        client: &Client,
        lease: &Lease,
    ) -> Option<Lease> {
        let now = self.now();
        let (eligible, _) = self.lease_candidates(snap, client, now);
        if let Some(cluster) = self.cluster.get() {
            // A backend that does not answer moves nothing: the request goes on as if
            // nothing were free.
            let moved = cluster
                .lease_relocate(&lease.owner_hash, &eligible, now)
                .await
                .ok()
                .flatten()?;
            self.leases.lock().mirror(moved.clone(), now);
            if moved.connection != lease.connection {
                tracing::info!(client = %client.id, from = %lease.connection, to = %moved.connection, "lease moved");
            }
            return Some(moved);
        }
        let (moved, wait) = self.change_leases(|table| {
            let moved = table.relocate(&lease.owner_hash, &eligible, now);
            let persist = moved
                .as_ref()
                .filter(|m| m.connection != lease.connection)
                .map(|_| Vec::new());
            (moved, persist)
        });
        let moved = moved?;
        if moved.connection != lease.connection {
            tracing::info!(client = %client.id, from = %lease.connection, to = %moved.connection, "lease moved");
            // The request goes on either way; a failed commit stays queued and is retried.
            let _ = Self::committed(wait).await;
        }
        Some(moved)
    }

    /// Acquire through the cluster's compare-and-set (SPEC §7.1): no two nodes can lease
    /// one connection. A backend that does not answer refuses the lease (503, retry):
    /// granting it from the local view could give the connection to two owners.
    async fn lease_acquire_shared(
        &self,
        cluster: &Arc<Cluster>,
        client: &str,
        eligible: &[String],
        soonest: Option<Millis>,
        ttl: Millis,
        now: Millis,
    ) -> Result<(String, Lease), LeaseRefusal> {
        // Fresh random bytes per try; a taken owner hash (never in practice) draws again.
        for _ in 0..4 {
            let token = owner_token(rand::random());
            match cluster
                .lease_acquire(client, &token, eligible, ttl, now)
                .await
            {
                Ok(Acquired::Granted(lease)) => {
                    self.leases.lock().mirror(lease.clone(), now);
                    return Ok((token, lease));
                }
                Ok(Acquired::OwnerTaken) => continue,
                Ok(Acquired::Refused(LeaseError::NoneEligible)) => {
                    return Err(LeaseRefusal::NoneEligible { retry_at: soonest })
                }
                Ok(Acquired::Refused(e)) => return Err(LeaseRefusal::Lease(e)),
                Err(e) => {
                    // The script may have run: never leave a lease no client can use.
                    cluster.release_later(client.to_owned(), token);
                    return Err(LeaseRefusal::Store(StoreError::Io(e.0)));
                }
            }
        }
        Err(LeaseRefusal::Store(StoreError::Io(
            "no fresh lease owner could be drawn".into(),
        )))
    }

    /// A renew's or release's cluster answer, mirrored into the local view.
    fn mirrored(
        &self,
        owner: &str,
        r: Result<Result<Lease, LeaseError>, ClusterError>,
        released: bool,
    ) -> Result<Lease, LeaseFailure> {
        let now = self.now();
        match r {
            Ok(Ok(lease)) => {
                let mut table = self.leases.lock();
                if released {
                    table.forget(&lease.owner_hash);
                } else {
                    table.mirror(lease.clone(), now);
                }
                Ok(lease)
            }
            Ok(Err(e)) => {
                if e == LeaseError::UnknownOwner {
                    self.leases.lock().forget(&owner_hash(owner));
                }
                Err(LeaseFailure::Lease(e))
            }
            Err(e) => Err(LeaseFailure::Store(StoreError::Io(e.0))),
        }
    }

    /// Refreshes (or moves) a session pin after a success.
    pub fn touch_pin(&self, key: &str, connection: &str, target: &str, ttl: Duration) {
        let now = self.now();
        let (changed, pruned, pin) = {
            let mut pins = lock(&self.pins);
            let changed = pins.touch(key, connection, Some(target), ttl, now);
            let pruned = pins.prune(now);
            (changed, pruned, pins.get(key, now).cloned())
        };
        let mut changes: Vec<Change> = pruned
            .iter()
            .map(|k| change::<Pin>(Table::Pins, k, None))
            .collect();
        if changed {
            changes.push(change(Table::Pins, key, pin.as_ref()));
        }
        if let Some(store) = &self.store {
            store.submit(changes);
        }
    }

    /// The pinned connection (`provider/connection`) of a session, if the pin is active.
    pub fn pinned(&self, key: &str) -> Option<String> {
        lock(&self.pins)
            .get(key, self.now())
            .map(|p| p.connection.clone())
    }

    /// Records upstream rate-limit headers of any response on a connection
    /// (`provider/connection`).
    pub fn note_rate_limit(
        &self,
        conn_key: &str,
        headers: &(impl crate::policy::fields::Fields + ?Sized),
        now: Millis,
    ) {
        if let Some(info) = parse_rate_limit(headers, now) {
            with_signals(&mut lock(&self.signals), conn_key, |s| s.rate = Some(info));
        }
    }

    /// Records a time-to-first-byte sample of a connection (`provider/connection`).
    pub fn note_ttfb(&self, conn_key: &str, ttfb: Duration, now: Millis) {
        with_signals(&mut lock(&self.signals), conn_key, |s| {
            s.latency.record(ttfb.as_secs_f64() * 1000.0, now)
        });
    }

    /// Restores pins and leases from the store image (expired ones are dropped).
    pub fn restore_sessions(&self, image: &Image) -> (usize, usize) {
        let now = self.now();
        let mut pins = 0;
        if let Some(rows) = image.get(&Table::Pins) {
            let mut table = lock(&self.pins);
            for (k, v) in rows {
                if let Ok(pin) = serde_json::from_value::<Pin>(v.clone()) {
                    if table.insert_restored(k.clone(), pin, now) {
                        pins += 1;
                    }
                }
            }
        }
        let leases = match image.get(&Table::Leases) {
            Some(rows) => {
                let table = crate::policy::lease::LeaseTable::from_rows(rows.clone(), now);
                let n = table.active_count(now);
                *self.leases.lock() = table;
                n
            }
            None => 0,
        };
        (pins, leases)
    }

    /// Runtime overrides persisted in the store.
    pub fn overrides_from(image: &Image) -> std::collections::BTreeMap<String, serde_json::Value> {
        image.get(&Table::Overrides).cloned().unwrap_or_default()
    }
}

/// Changes the signals of a connection, made on its first sample (the key is copied
/// only then).
fn with_signals(map: &mut HashMap<String, Signals>, conn_key: &str, f: impl FnOnce(&mut Signals)) {
    if let Some(s) = map.get_mut(conn_key) {
        return f(s);
    }
    let mut s = Signals::default();
    f(&mut s);
    map.insert(conn_key.to_string(), s);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::testing::{engine_with, FailingStore};
    use crate::store::{StateStore, StoreWriter};
    use std::sync::atomic::Ordering;

    const YAML: &str = "clients:\n  - id: team\n    key_sha256: \"0000000000000000000000000000000000000000000000000000000000000000\"\n    scopes: [\"lease:exclusive\"]\n    allowed_connections: [\"p/c\"]\nproviders:\n  - id: p\n    base_url: \"http://127.0.0.1:9\"\n    api: openai\n    class: local\n    connections: [ { id: c } ]\nmodels:\n  - name: m\n    targets: [ { provider: p, model: u } ]\n";

    #[tokio::test]
    async fn a_lease_the_store_refuses_is_not_granted() {
        let store = FailingStore::new(true);
        let writer = StoreWriter::spawn(store.clone(), std::time::Duration::from_secs(3600));
        let engine = engine_with(YAML, Some(writer.clone()));
        let snap = engine.snapshot();
        let client = snap.config.clients.as_ref().unwrap()[0].clone();
        match engine.lease_acquire(&snap, &client, None).await {
            Err(LeaseRefusal::Store(e)) => assert_eq!(e.label(), "io"),
            _ => panic!("a lease that is not durable must not be granted"),
        }
        // Taken back: the connection is free, nothing is held in memory.
        assert_eq!(engine.leases.lock().active_count(engine.now()), 0);

        // The store heals: the queued undo wins over the failed grant, and a new
        // acquire is durable.
        store.failing.store(false, Ordering::SeqCst);
        let (token, lease) = match engine.lease_acquire(&snap, &client, None).await {
            Ok(x) => x,
            Err(_) => panic!("acquire after the store healed"),
        };
        let stored = store.load().unwrap()[&Table::Leases].clone();
        assert!(stored.contains_key(&lease.owner_hash));
        assert_eq!(
            stored.keys().filter(|k| k.len() == 64).count(),
            1,
            "only the granted lease is stored: {stored:?}"
        );

        // Renew and release whose commit fails are failures, never a silent success.
        store.failing.store(true, Ordering::SeqCst);
        assert!(matches!(
            engine.lease_renew(&client, &token, None).await,
            Err(LeaseFailure::Store(_))
        ));
        assert!(matches!(
            engine.lease_release(&client, &token).await,
            Err(LeaseFailure::Store(_))
        ));
        // The failed release put the lease back: memory agrees with the store, and the
        // client's retry finds it.
        assert!(engine.lease_check("team", &token, lease.generation).is_ok());
        assert!(writer.health().failed_commits >= 3);
        store.failing.store(false, Ordering::SeqCst);
        assert!(engine.lease_release(&client, &token).await.is_ok());
        assert_eq!(engine.leases.lock().active_count(engine.now()), 0);
        let stored = store.load().unwrap()[&Table::Leases].clone();
        assert!(!stored.contains_key(&lease.owner_hash), "{stored:?}");
    }
}
