//! Cluster-wide concurrency permits (SPEC §5.7, §7.1): a cap of N holds across every
//! node, not N per node.
//!
//! Each limited scope (a connection's `max_concurrent`, a connection + model's
//! `model_concurrency`) is a sorted set of permits scored by their expiry; this node's
//! part of it is a [`Pool`] (taken from Redis a few at a time on busy scopes, lent to
//! attempts without a round-trip). Invariants: an attempt gets a permit in every scope
//! or in none; a [`Ticket`] returns its permits to their pools when dropped, whatever
//! happened to the attempt (and when the wait that asked for them was abandoned
//! half-way: the asking runs to its end on the cluster's runtime and its ticket is
//! dropped there); the heartbeat renews every permit the node holds, so only a node that
//! stopped renewing (killed, cut off) loses them, and then they come back to the others
//! [`super::PERMIT_TTL`] after its last renewal. An attempt admitted on the node's share
//! while Redis is down holds a ticket as well, written to Redis by the first heartbeat
//! Redis answers: reconciling is counting it there.

use super::pool::{reserve, Pool};
use super::{Cluster, ClusterError, CALL_TIMEOUT, PERMIT_TTL};
use crate::policy::Millis;
use std::sync::Arc;

/// Most give-backs kept for the heartbeat while Redis does not answer.
pub(super) const MAX_OWED: usize = 10_000;

/// One attempt's permits, one per limited scope (sorted set, member); returned to their
/// pools on drop.
pub struct Ticket {
    cluster: Arc<Cluster>,
    parts: Vec<(String, String)>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let back = self.cluster.put_back(std::mem::take(&mut self.parts));
        self.cluster.give_back(back);
    }
}

impl Cluster {
    /// The sorted set of one limited scope (`provider/connection` or
    /// `provider/connection/model`).
    pub fn permit_key(&self, scope: &str) -> String {
        self.key(&format!("permits:{scope}"))
    }

    fn member(&self) -> String {
        let id = self
            .tickets
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("{}:{id}", self.node)
    }

    /// A permit for an attempt admitted on this node's share while Redis does not
    /// answer: the heartbeat writes it to Redis once Redis does, so the attempt counts
    /// against the cap there for as long as it lasts.
    pub fn share_ticket(self: &Arc<Self>, scopes: &[(String, u32)]) -> Ticket {
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        let parts = scopes
            .iter()
            .map(|(key, cap)| {
                let m = self.member();
                let pool = pools.entry(key.clone()).or_default();
                pool.cap = *cap;
                pool.lend_unasked(m.clone());
                (key.clone(), m)
            })
            .collect();
        Ticket {
            cluster: self.clone(),
            parts,
        }
    }

    /// Takes a permit in every `(key, cap)` scope at once: `Some` when taken, `None`
    /// when one of them is at its cap. Idle permits of this node's pools first; the
    /// scopes without one ask Redis (one script) for one plus the pool's slack.
    pub async fn permit(
        self: &Arc<Self>,
        scopes: &[(String, u32)],
    ) -> Result<Option<Ticket>, ClusterError> {
        if self.down() {
            return Err(ClusterError(format!("{}: not answering", self.place)));
        }
        if let Some(t) = self.lend_idle(scopes) {
            return Ok(Some(t));
        }
        let me = self.clone();
        let scopes = scopes.to_vec();
        let task = self.rt.spawn(async move { me.ask(&scopes).await });
        // Bounded here too: a cluster thread that does not get to the call must not hold
        // a request. Dropped unanswered, the task's ticket is dropped when it ends.
        match tokio::time::timeout(CALL_TIMEOUT * 2, task).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(ClusterError("the cluster call was cancelled".into())),
            Err(_) => Err(self.failed("the cluster thread did not answer in time")),
        }
    }

    /// A ticket from idle permits alone, when every scope has one.
    fn lend_idle(self: &Arc<Self>, scopes: &[(String, u32)]) -> Option<Ticket> {
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        // Idle permits taken under another cap (before a reload) are not lent: the
        // asking path gives them back and asks Redis under the new one.
        if !scopes
            .iter()
            .all(|(k, cap)| pools.get(k).is_some_and(|p| p.cap == *cap && p.has_idle()))
        {
            return None;
        }
        let parts = scopes
            .iter()
            .filter_map(|(k, _)| Some((k.clone(), pools.get_mut(k)?.take()?)))
            .collect();
        Some(Ticket {
            cluster: self.clone(),
            parts,
        })
    }

    /// On the cluster's runtime: idle permits where there are, Redis for the others.
    async fn ask(
        self: &Arc<Self>,
        scopes: &[(String, u32)],
    ) -> Result<Option<Ticket>, ClusterError> {
        let live = self.live_nodes();
        let mut ticket = Ticket {
            cluster: self.clone(),
            parts: Vec::with_capacity(scopes.len()),
        };
        // (key, cap, names offered) of the scopes Redis is asked for.
        let mut wanted: Vec<(String, u32, Vec<String>)> = Vec::new();
        let mut stale = Vec::new();
        {
            let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
            for (key, cap) in scopes {
                let pool = pools.get_mut(key);
                let pool = match pool {
                    Some(p) if p.cap != *cap => {
                        stale.extend(p.drain_idle().into_iter().map(|m| (key.clone(), m)));
                        p.cap = *cap;
                        None
                    }
                    other => other,
                };
                match pool.and_then(Pool::take) {
                    Some(m) => ticket.parts.push((key.clone(), m)),
                    None => {
                        let n = 1 + reserve(*cap, live).slack;
                        wanted.push((key.clone(), *cap, (0..n).map(|_| self.member()).collect()));
                    }
                }
            }
        }
        self.give_back(stale);
        if wanted.is_empty() {
            return Ok(Some(ticket));
        }
        // Expiries are compared across nodes: unix time, not a request's clock.
        let now = crate::clock::unix_ms();
        let expires = now.saturating_add(PERMIT_TTL.as_millis() as Millis);
        let me = self.clone();
        let asked = wanted.clone();
        let granted: Result<Vec<usize>, ClusterError> = self
            .run(move |mut c| async move {
                let mut inv = me.scripts.permit.prepare_invoke();
                for (k, _, _) in &asked {
                    inv.key(k);
                }
                inv.arg(now).arg(expires);
                for (_, cap, names) in &asked {
                    inv.arg(*cap).arg(names.len());
                    for n in names {
                        inv.arg(n);
                    }
                }
                inv.invoke_async::<Vec<usize>>(&mut c).await
            })
            .await;
        match granted {
            Ok(counts) if counts.len() == wanted.len() => {
                {
                    let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
                    for ((key, cap, mut names), n) in wanted.into_iter().zip(counts) {
                        names.truncate(n);
                        let pool = pools.entry(key.clone()).or_default();
                        pool.cap = cap;
                        if let Some(m) = pool.granted(names) {
                            ticket.parts.push((key, m));
                        }
                    }
                }
                // Unlocked: a ticket short of a scope is dropped here, back to the pools.
                Ok((ticket.parts.len() == scopes.len()).then_some(ticket))
            }
            // A scope at its cap: nothing was taken; the idle permits lent go back.
            Ok(_) => Ok(None),
            Err(e) => {
                // The script may have run before the answer was lost.
                let offered = wanted
                    .into_iter()
                    .flat_map(|(k, _, names)| names.into_iter().map(move |n| (k.clone(), n)))
                    .collect();
                self.give_back(offered);
                Err(e)
            }
        }
    }

    /// Returns an attempt's permits to their pools: the permits to give back to Redis.
    fn put_back(&self, parts: Vec<(String, String)>) -> Vec<(String, String)> {
        if parts.is_empty() {
            return Vec::new();
        }
        let live = self.live_nodes();
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        let mut back = Vec::new();
        for (key, member) in parts {
            let Some(pool) = pools.get_mut(&key) else {
                continue;
            };
            let cap = pool.cap;
            back.extend(
                pool.put(member, reserve(cap, live))
                    .into_iter()
                    .map(|m| (key.clone(), m)),
            );
            if pool.is_empty() {
                pools.remove(&key);
            }
        }
        back
    }

    /// Gives permits back to Redis (one pipeline), or, while Redis does not answer,
    /// leaves them to the next heartbeat (bounded: past that, permits are left to their
    /// expiry, since nobody renews them).
    pub(super) fn give_back(self: &Arc<Self>, back: Vec<(String, String)>) {
        if back.is_empty() {
            return;
        }
        if self.down() {
            self.owe(back);
            return;
        }
        let me = self.clone();
        self.rt.spawn(async move {
            let again = back.clone();
            let sent = me
                .run(move |mut c| async move {
                    let mut pipe = redis::pipe();
                    for (k, m) in &back {
                        pipe.cmd("ZREM").arg(k).arg(m).ignore();
                    }
                    pipe.query_async::<()>(&mut c).await
                })
                .await;
            if sent.is_err() {
                me.owe(again);
            }
        });
    }

    /// Leaves permits for the next heartbeat to give back.
    pub(super) fn owe(&self, back: Vec<(String, String)>) {
        let mut owed = self.owed.lock().unwrap_or_else(|p| p.into_inner());
        let room = MAX_OWED.saturating_sub(owed.len());
        owed.extend(back.into_iter().take(room));
    }
}
