//! Cluster-wide concurrency permits (SPEC §5.7, §7.1): a cap of N holds across every
//! node, not N per node.
//!
//! Each limited scope (a connection's `max_concurrent`, a connection + model's
//! `model_concurrency`) is a sorted set of permits scored by their expiry. Invariants: a
//! permit is taken in every scope of an attempt or in none (one script); a [`Ticket`]
//! gives its permit back when dropped, whatever happened to the attempt (and when the
//! call that took it was abandoned half-way); the heartbeat renews the expiry of held
//! permits, so only a node that stopped renewing (killed, cut off) loses them, and then
//! they come back to the others [`super::PERMIT_TTL`] after its last renewal. An attempt
//! admitted on the node's share while Redis is down holds a ticket as well, written to
//! Redis by the first heartbeat Redis answers: reconciling is counting it there.

use super::{Cluster, ClusterError, PERMIT_TTL};
use crate::policy::Millis;
use std::sync::Arc;

/// Most give-backs kept for the heartbeat while Redis does not answer.
pub(super) const MAX_OWED: usize = 10_000;

/// One attempt's place in its scopes' cluster-wide counts; given back on drop.
pub struct Ticket {
    cluster: Arc<Cluster>,
    id: u64,
    keys: Vec<String>,
    member: String,
    /// Whether Redis may hold the permit (taken, or the call's end is unknown).
    give_back: bool,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.give_back {
            return;
        }
        self.cluster
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
        let cluster = self.cluster.clone();
        let keys = std::mem::take(&mut self.keys);
        let member = std::mem::take(&mut self.member);
        // A release that fails leaves the permit to its expiry (it is no longer renewed).
        if cluster.down() {
            // Redis is not answering: the heartbeat gives it back once it does (bounded:
            // past that, permits are left to their expiry).
            let mut owed = cluster.give_back.lock().unwrap_or_else(|p| p.into_inner());
            if owed.len() < MAX_OWED {
                owed.push((keys, member));
            }
            return;
        }
        self.cluster.rt.spawn(async move {
            let _ = cluster
                .run(move |mut c| async move {
                    let mut pipe = redis::pipe();
                    for k in &keys {
                        pipe.cmd("ZREM").arg(k).arg(&member).ignore();
                    }
                    pipe.query_async::<()>(&mut c).await
                })
                .await;
        });
    }
}

impl Cluster {
    /// The sorted set of one limited scope (`provider/connection` or
    /// `provider/connection/model`).
    pub fn permit_key(&self, scope: &str) -> String {
        self.key(&format!("permits:{scope}"))
    }

    fn ticket(self: &Arc<Self>, scopes: &[(String, u32)]) -> Ticket {
        let id = self
            .tickets
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ticket {
            cluster: self.clone(),
            id,
            keys: scopes.iter().map(|(k, _)| k.clone()).collect(),
            member: format!("{}:{id}", self.node),
            give_back: true,
        }
    }

    fn hold(&self, ticket: &Ticket) {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(ticket.id, (ticket.keys.clone(), ticket.member.clone()));
    }

    /// A permit for an attempt admitted on this node's share while Redis does not
    /// answer: the heartbeat writes it to Redis once Redis does, so the attempt counts
    /// against the cap there for as long as it lasts.
    pub fn share_ticket(self: &Arc<Self>, scopes: &[(String, u32)]) -> Ticket {
        let ticket = self.ticket(scopes);
        self.hold(&ticket);
        ticket
    }

    /// Takes a permit in every `(key, cap)` scope at once: `Some` when taken, `None`
    /// when one of them is at its cap.
    pub async fn permit(
        self: &Arc<Self>,
        scopes: &[(String, u32)],
    ) -> Result<Option<Ticket>, ClusterError> {
        // Expiries are compared across nodes: unix time, not a request's clock.
        let now = crate::clock::unix_ms();
        let mut ticket = self.ticket(scopes);
        let keys = ticket.keys.clone();
        let member = ticket.member.clone();
        let caps: Vec<u32> = scopes.iter().map(|(_, n)| *n).collect();
        let expires = now.saturating_add(PERMIT_TTL.as_millis() as Millis);
        let me = self.clone();
        let taken: Result<i64, ClusterError> = self
            .call(move |mut c| async move {
                let mut inv = me.scripts.permit.prepare_invoke();
                for k in &keys {
                    inv.key(k);
                }
                inv.arg(now).arg(expires).arg(&member);
                for n in &caps {
                    inv.arg(*n);
                }
                inv.invoke_async::<i64>(&mut c).await
            })
            .await;
        match taken {
            Ok(1) => {
                self.hold(&ticket);
                Ok(Some(ticket))
            }
            Ok(_) => {
                ticket.give_back = false;
                Ok(None)
            }
            // The script may have run before the answer was lost: the ticket gives back.
            Err(e) => Err(e),
        }
    }
}
