//! Leases across the cluster (SPEC §5.6, §7.1): acquire, renew, release and relocate are
//! one Lua script each on the shared lease hash, so two nodes can never hand one
//! connection to two owners; the dispatch fence reads the owner's row.
//!
//! Invariants: a script's answer is the lease as stored (the caller mirrors exactly that
//! into its local table, which ordinary routing reads); the same refusals as the local
//! table (`policy::lease::LeaseError`) come back for the same situations, so clients see
//! one contract whatever the backend.

use super::{Cluster, ClusterError};
use crate::policy::lease::{owner_hash, Lease, LeaseError};
use crate::policy::Millis;
use std::sync::Arc;

use crate::store::redis::STREAM_KEEP;

/// What a cluster acquire came back with.
pub enum Acquired {
    Granted(Lease),
    Refused(LeaseError),
    /// The owner hash is taken by an active lease (the caller draws new random bytes).
    OwnerTaken,
}

/// A script's reply: a status word and, for some, a value.
type Reply = Vec<String>;

fn lease_of(reply: &Reply) -> Result<Lease, ClusterError> {
    let text = reply
        .get(1)
        .ok_or_else(|| ClusterError("a lease script answered without its lease".into()))?;
    serde_json::from_str(text)
        .map_err(|e| ClusterError(format!("a lease script answered an unreadable lease: {e}")))
}

fn refusal(status: &str) -> Result<LeaseError, ClusterError> {
    match status {
        "unknown" => Ok(LeaseError::UnknownOwner),
        "wrong_client" => Ok(LeaseError::WrongClient),
        other => Err(ClusterError(format!(
            "a lease script answered an unknown status {other:?}"
        ))),
    }
}

impl Cluster {
    fn lease_keys(&self) -> (String, String) {
        (self.key("leases"), self.key("changes"))
    }

    /// Runs one lease script with the common arguments (node, stream length, now) first.
    async fn lease_script(
        self: &Arc<Self>,
        pick: fn(&super::scripts::Scripts) -> &redis::Script,
        now: Millis,
        args: Vec<String>,
    ) -> Result<Reply, ClusterError> {
        let (hash, stream) = self.lease_keys();
        let node = self.node.clone();
        let me = self.clone();
        self.call(move |mut c| async move {
            let script = pick(&me.scripts);
            let mut inv = script.key(&hash);
            inv.key(&stream).arg(&node).arg(STREAM_KEEP).arg(now);
            for a in &args {
                inv.arg(a);
            }
            inv.invoke_async::<Reply>(&mut c).await
        })
        .await
    }

    /// Acquire for `client`: the first of `eligible` (in order) no active lease holds.
    pub async fn lease_acquire(
        self: &Arc<Self>,
        client: &str,
        token: &str,
        eligible: &[String],
        ttl: Millis,
        now: Millis,
    ) -> Result<Acquired, ClusterError> {
        if eligible.is_empty() {
            return Ok(Acquired::Refused(LeaseError::NoneEligible));
        }
        let mut args = vec![ttl.to_string(), client.to_owned(), owner_hash(token)];
        args.extend(eligible.iter().cloned());
        let reply = self.lease_script(|s| &s.acquire, now, args).await?;
        match reply.first().map(String::as_str) {
            Some("ok") => Ok(Acquired::Granted(lease_of(&reply)?)),
            Some("exists") => Ok(Acquired::OwnerTaken),
            Some("none") => Ok(Acquired::Refused(LeaseError::NoneEligible)),
            Some("busy") => {
                let retry_at = reply.get(1).and_then(|s| s.parse().ok()).unwrap_or(now);
                Ok(Acquired::Refused(LeaseError::CapacityUnavailable {
                    retry_at,
                }))
            }
            other => Err(ClusterError(format!(
                "the lease acquire script answered {other:?}"
            ))),
        }
    }

    /// An acquire whose answer was lost (timed out after the script ran) may have stored
    /// a lease nobody holds the token of: it is released once Redis answers (five tries,
    /// 1.5 s apart), so the connection is not held for the lease's whole TTL.
    pub fn release_later(self: &Arc<Self>, client: String, token: String) {
        let me = self.clone();
        self.rt.spawn(async move {
            for _ in 0..5 {
                tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
                // Released, or unknown because it was never stored: done either way.
                if me
                    .lease_release(&client, &token, crate::clock::unix_ms())
                    .await
                    .is_ok()
                {
                    return;
                }
            }
        });
    }

    /// Renew: same generation, expiry `now + ttl`.
    pub async fn lease_renew(
        self: &Arc<Self>,
        client: &str,
        token: &str,
        ttl: Millis,
        now: Millis,
    ) -> Result<Result<Lease, LeaseError>, ClusterError> {
        let args = vec![ttl.to_string(), client.to_owned(), owner_hash(token)];
        let reply = self.lease_script(|s| &s.renew, now, args).await?;
        match reply.first().map(String::as_str) {
            Some("ok") => Ok(Ok(lease_of(&reply)?)),
            Some(status) => Ok(Err(refusal(status)?)),
            None => Err(ClusterError(
                "the lease renew script answered nothing".into(),
            )),
        }
    }

    /// Release: the connection is free for anyone at once.
    pub async fn lease_release(
        self: &Arc<Self>,
        client: &str,
        token: &str,
        now: Millis,
    ) -> Result<Result<Lease, LeaseError>, ClusterError> {
        let args = vec![client.to_owned(), owner_hash(token)];
        let reply = self.lease_script(|s| &s.release, now, args).await?;
        match reply.first().map(String::as_str) {
            Some("ok") => Ok(Ok(lease_of(&reply)?)),
            Some(status) => Ok(Err(refusal(status)?)),
            None => Err(ClusterError(
                "the lease release script answered nothing".into(),
            )),
        }
    }

    /// Moves a lease (same generation and expiry) to the first of `eligible` no other
    /// active lease holds; `None` when nothing is free or the lease is gone.
    pub async fn lease_relocate(
        self: &Arc<Self>,
        owner: &str,
        eligible: &[String],
        now: Millis,
    ) -> Result<Option<Lease>, ClusterError> {
        let mut args = vec![owner.to_owned()];
        args.extend(eligible.iter().cloned());
        let reply = self.lease_script(|s| &s.relocate, now, args).await?;
        match reply.first().map(String::as_str) {
            Some("ok") => Ok(Some(lease_of(&reply)?)),
            _ => Ok(None),
        }
    }

    /// The stored lease of an owner token (the dispatch fence reads it), active or not.
    pub async fn lease_get(self: &Arc<Self>, token: &str) -> Result<Option<Lease>, ClusterError> {
        let hash = self.key("leases");
        let owner = owner_hash(token);
        let row: Option<String> = self
            .call(move |mut c| async move {
                redis::cmd("HGET")
                    .arg(&hash)
                    .arg(&owner)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        // An unreadable row is no lease.
        Ok(row.and_then(|r| serde_json::from_str(&r).ok()))
    }
}
