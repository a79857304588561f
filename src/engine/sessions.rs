//! Session layers and per-connection signals on the engine: exclusive leases (SPEC
//! §5.6), affinity pins (§5.5), and the latency / rate-limit signals the load-aware
//! strategies read (§5.12).
//!
//! Lease changes are committed to the store before the caller answers (durable first);
//! pin changes go through the batched writer. Only owner-token hashes and hashed
//! session keys are ever stored.

use super::select::breaker_config;
use super::state::{change, conn_key, lock};
use super::{Engine, Snapshot};
use crate::config::Client;
use crate::policy::affinity::Pin;
use crate::policy::breaker::Permit;
use crate::policy::cooldown::Eligibility;
use crate::policy::lease::{Lease, LeaseError};
use crate::policy::Millis;
use crate::routing::parse_rate_limit;
use crate::store::{Change, Image, Table};
use std::time::Duration;

/// Why none of a client's connections can be leased right now.
pub enum LeaseRefusal {
    Lease(LeaseError),
    /// Nothing eligible: the soonest any allowed connection comes back, if a timer holds it.
    NoneEligible {
        retry_at: Option<Millis>,
    },
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

    fn lease_changes(&self, removed: &[String]) -> Vec<Change> {
        let table = lock(&self.leases);
        let mut out: Vec<Change> = table
            .rows()
            .into_iter()
            .map(|(k, v)| Change {
                table: Table::Leases,
                key: k,
                value: Some(v),
            })
            .collect();
        out.extend(removed.iter().map(|k| Change {
            table: Table::Leases,
            key: k.clone(),
            value: None,
        }));
        out
    }

    async fn commit_leases(&self, removed: &[String]) {
        let changes = self.lease_changes(removed);
        if let Some(store) = &self.store {
            if let Err(e) = store.commit_now(changes).await {
                tracing::error!(error = %e, "lease change not persisted");
            }
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
        let random: [u8; 32] = rand::random();
        let result = {
            let mut table = lock(&self.leases);
            let pruned = table.prune(now);
            table
                .acquire(&client.id, &eligible, ttl, random, now)
                .map(|ok| (ok, pruned))
        };
        match result {
            Ok((granted, pruned)) => {
                self.commit_leases(&pruned).await;
                Ok(granted)
            }
            Err(LeaseError::NoneEligible) => Err(LeaseRefusal::NoneEligible { retry_at: soonest }),
            Err(e) => Err(LeaseRefusal::Lease(e)),
        }
    }

    pub async fn lease_renew(
        &self,
        client: &Client,
        owner: &str,
        ttl: Option<Duration>,
    ) -> Result<Lease, LeaseError> {
        let now = self.now();
        let lease = lock(&self.leases).renew(&client.id, owner, ttl, now)?;
        self.commit_leases(&[]).await;
        Ok(lease)
    }

    pub async fn lease_release(&self, client: &Client, owner: &str) -> Result<Lease, LeaseError> {
        let now = self.now();
        let lease = lock(&self.leases).release(&client.id, owner, now)?;
        self.commit_leases(std::slice::from_ref(&lease.owner_hash))
            .await;
        Ok(lease)
    }

    /// The dispatch fence (owner hash + generation + client).
    pub fn lease_check(
        &self,
        client: &str,
        owner: &str,
        generation: u64,
    ) -> Result<Lease, LeaseError> {
        lock(&self.leases)
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
        let moved = lock(&self.leases).relocate(&lease.owner_hash, &eligible, now)?;
        if moved.connection != lease.connection {
            tracing::info!(client = %client.id, from = %lease.connection, to = %moved.connection, "lease moved");
            self.commit_leases(&[]).await;
        }
        Some(moved)
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

    /// Records upstream rate-limit headers of any response on a connection.
    pub fn note_rate_limit(&self, provider: &str, connection: &str, headers: &http::HeaderMap) {
        if let Some(info) = parse_rate_limit(headers, self.now()) {
            lock(&self.signals)
                .entry(conn_key(provider, connection))
                .or_default()
                .rate = Some(info);
        }
    }

    /// Records a time-to-first-byte sample of a connection.
    pub fn note_ttfb(&self, provider: &str, connection: &str, ttfb: Duration) {
        let now = self.now();
        lock(&self.signals)
            .entry(conn_key(provider, connection))
            .or_default()
            .latency
            .record(ttfb.as_secs_f64() * 1000.0, now);
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
                *lock(&self.leases) = table;
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
