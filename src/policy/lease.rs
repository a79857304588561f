//! Exclusive session leases (SPEC §5.6): a hard fence that gives one client key's session
//! sole use of one connection, unlike the soft affinity pin of §5.5.
//!
//! What it protects: a connection (an account whose upstream state must not be shared,
//! e.g. a coding-agent session) from being used by anyone but the lease owner, and the
//! owner from dispatching with a lease it has lost (the generation fence).
//!
//! Invariants: at most one *active* lease per connection and per owner; a lease is
//! active while `expires_at > now` and expiry is lazy (readers compare with `now`, nothing
//! needs a timer); generations are handed out strictly increasing and the counter survives
//! release, pruning and a restart (`from_rows` restores it to at least the largest stored
//! generation + 1), so a stale holder can never present a generation that matches a newer
//! lease; renewing or relocating a lease keeps its generation. Only the SHA-256 of an
//! owner token is ever kept, so the table (and the store rows made from it) cannot be used
//! to impersonate an owner. Randomness is passed in as bytes, so this module stays pure.
//! It does not decide which connections are eligible or allowed: callers pass them in, in
//! preference order.

use super::{ms, Millis};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// Lease TTL when the client does not ask for one.
pub const DEFAULT_TTL: Duration = Duration::from_secs(10 * 60);
/// Longest TTL a client may ask for.
pub const MAX_TTL: Duration = Duration::from_secs(24 * 60 * 60);
/// Shortest TTL a client may ask for.
pub const MIN_TTL: Duration = Duration::from_secs(1);
/// Prefix of every owner token.
pub const TOKEN_PREFIX: &str = "slo_";
/// Row key of the generation counter in [`LeaseTable::rows`] (owner hashes are 64 hex
/// characters, so it cannot collide with a lease row).
pub const NEXT_GENERATION_ROW: &str = "next_generation";

const B64URL: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/// Base64url without padding (RFC 4648 §5).
fn base64url_nopad(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b0 = chunk[0];
        let b1 = chunk.get(1).copied().unwrap_or(0);
        let b2 = chunk.get(2).copied().unwrap_or(0);
        let n = (u32::from(b0) << 16) | (u32::from(b1) << 8) | u32::from(b2);
        let sextets = [(n >> 18) & 63, (n >> 12) & 63, (n >> 6) & 63, n & 63];
        // 1 byte → 2 characters, 2 bytes → 3, 3 bytes → 4.
        for &s in &sextets[..chunk.len() + 1] {
            out.push(char::from(B64URL[s as usize]));
        }
    }
    out
}

/// `slo_` + 43 base64url chars (32 random bytes, no padding).
pub fn owner_token(random: [u8; 32]) -> String {
    format!("{TOKEN_PREFIX}{}", base64url_nopad(&random))
}

/// Lower-case hex SHA-256 of an owner token (only this is ever stored).
pub fn owner_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// One exclusive lease of one connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// SHA-256 (hex) of the owner token.
    pub owner_hash: String,
    /// Id of the client key that holds it.
    pub client: String,
    /// The leased connection, `provider/connection`.
    pub connection: String,
    pub generation: u64,
    pub expires_at: Millis,
    pub created_at: Millis,
}

impl Lease {
    /// Active while its expiry lies in the future.
    pub fn is_active(&self, now: Millis) -> bool {
        self.expires_at > now
    }
}

/// Why a lease operation was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseError {
    /// No free allowed+eligible connection, but some eligible ones are leased by others:
    /// 429 `lease_capacity_unavailable` with `Retry-After` from the earliest relevant expiry.
    CapacityUnavailable { retry_at: Millis },
    /// Nothing eligible at all (not lease contention): the caller answers its normal error.
    NoneEligible,
    /// Unknown / expired owner (renew, release, dispatch).
    UnknownOwner,
    /// Owner known but the presented generation differs: 409 `lease_generation_stale`.
    StaleGeneration { current: u64 },
    /// The owner belongs to another client key.
    WrongClient,
    /// The requested TTL is outside `MIN_TTL..=MAX_TTL`.
    InvalidTtl(String),
}

impl fmt::Display for LeaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LeaseError::CapacityUnavailable { retry_at } => write!(
                f,
                "every eligible connection is leased by another session (earliest expiry at {retry_at} ms)"
            ),
            LeaseError::NoneEligible => f.write_str("no eligible connection to lease"),
            LeaseError::UnknownOwner => f.write_str("unknown or expired lease owner"),
            LeaseError::StaleGeneration { current } => {
                write!(f, "lease generation is stale (current generation {current})")
            }
            LeaseError::WrongClient => f.write_str("lease belongs to another client key"),
            LeaseError::InvalidTtl(msg) => f.write_str(msg),
        }
    }
}

impl std::error::Error for LeaseError {}

/// Requested TTL → effective TTL in milliseconds.
pub fn effective_ttl(ttl: Option<Duration>) -> Result<Millis, LeaseError> {
    let ttl = ttl.unwrap_or(DEFAULT_TTL);
    if ttl < MIN_TTL || ttl > MAX_TTL {
        return Err(LeaseError::InvalidTtl(format!(
            "lease ttl must be between {} and {} seconds, got {:.3}",
            MIN_TTL.as_secs(),
            MAX_TTL.as_secs(),
            ttl.as_secs_f64()
        )));
    }
    Ok(ms(ttl))
}

/// All leases, keyed by owner hash, plus the generation counter.
///
/// Expired leases may linger until [`LeaseTable::prune`] (or an `acquire`, which prunes)
/// drops them; every reader ignores them. The table is small (at most one active lease per
/// connection), so lookups by connection are linear scans.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LeaseTable {
    #[serde(default)]
    leases: BTreeMap<String, Lease>,
    /// The generation the next acquire hands out (monotonic, survives release).
    #[serde(default)]
    next_generation: u64,
}

impl LeaseTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// The generation the next acquire will hand out (generations start at 1).
    pub fn next_generation(&self) -> u64 {
        self.next_generation.max(1)
    }

    /// Acquire for `client`: `eligible` = the client's allowed connections that ordinary
    /// routing considers eligible right now, in preference order. Picks the first one not
    /// held by an active lease of anyone. The new lease gets the next generation and
    /// `expires_at = now + ttl` (default [`DEFAULT_TTL`], must be 1 s..=[`MAX_TTL`]).
    /// Expired leases are pruned first (they are ignored in any case; callers that delete
    /// store rows call [`LeaseTable::prune`] before this to learn which).
    pub fn acquire(
        &mut self,
        client: &str,
        eligible: &[String],
        ttl: Option<Duration>,
        random: [u8; 32],
        now: Millis,
    ) -> Result<(String, Lease), LeaseError> {
        let ttl = effective_ttl(ttl)?;
        if eligible.is_empty() {
            return Err(LeaseError::NoneEligible);
        }
        self.prune(now);
        let mut earliest: Option<Millis> = None;
        let mut free = None;
        for conn in eligible {
            match self.held_by_other(conn, None, now) {
                Some(until) => earliest = Some(earliest.map_or(until, |e| e.min(until))),
                None => {
                    free = Some(conn);
                    break;
                }
            }
        }
        let Some(connection) = free else {
            // `eligible` is non-empty and every entry is held, so `earliest` is set.
            return Err(match earliest {
                Some(retry_at) => LeaseError::CapacityUnavailable { retry_at },
                None => LeaseError::NoneEligible,
            });
        };
        // One active lease per owner: if the caller reused random bytes (its bug; they
        // must be fresh), re-derive them instead of handing one owner a second lease. After
        // the prune above every stored lease is active, and iterated SHA-256 does not
        // cycle within a table this small, so this ends after a step or two.
        let mut seed = random;
        let mut token = owner_token(seed);
        let mut hash = owner_hash(&token);
        while self.leases.contains_key(&hash) {
            seed = Sha256::digest(seed).into();
            token = owner_token(seed);
            hash = owner_hash(&token);
        }
        let generation = self.next_generation();
        self.next_generation = generation.saturating_add(1);
        let lease = Lease {
            owner_hash: hash.clone(),
            client: client.to_string(),
            connection: connection.clone(),
            generation,
            expires_at: now.saturating_add(ttl),
            created_at: now,
        };
        self.leases.insert(hash, lease.clone());
        Ok((token, lease))
    }

    /// The active lease of `owner_token`, checked against `client`.
    fn owned_mut(
        &mut self,
        client: &str,
        owner_token: &str,
        now: Millis,
    ) -> Result<&mut Lease, LeaseError> {
        let lease = self
            .leases
            .get_mut(&owner_hash(owner_token))
            .filter(|l| l.is_active(now))
            .ok_or(LeaseError::UnknownOwner)?;
        if lease.client != client {
            return Err(LeaseError::WrongClient);
        }
        Ok(lease)
    }

    /// Renew: same generation, new expiry `now + ttl`. `UnknownOwner` if absent/expired,
    /// `WrongClient` if another client's.
    pub fn renew(
        &mut self,
        client: &str,
        owner_token: &str,
        ttl: Option<Duration>,
        now: Millis,
    ) -> Result<Lease, LeaseError> {
        let ttl = effective_ttl(ttl)?;
        let lease = self.owned_mut(client, owner_token, now)?;
        lease.expires_at = now.saturating_add(ttl);
        Ok(lease.clone())
    }

    /// Release: removes the lease and frees its connection. Same errors as `renew`.
    pub fn release(
        &mut self,
        client: &str,
        owner_token: &str,
        now: Millis,
    ) -> Result<Lease, LeaseError> {
        let hash = self.owned_mut(client, owner_token, now)?.owner_hash.clone();
        self.leases.remove(&hash).ok_or(LeaseError::UnknownOwner)
    }

    /// The dispatch fence: checks owner hash + client + generation; returns the lease
    /// (whose `connection` the caller must dispatch to).
    pub fn check(
        &self,
        client: &str,
        owner_token: &str,
        generation: u64,
        now: Millis,
    ) -> Result<&Lease, LeaseError> {
        let lease = self
            .leases
            .get(&owner_hash(owner_token))
            .filter(|l| l.is_active(now))
            .ok_or(LeaseError::UnknownOwner)?;
        if lease.client != client {
            return Err(LeaseError::WrongClient);
        }
        if lease.generation != generation {
            return Err(LeaseError::StaleGeneration {
                current: lease.generation,
            });
        }
        Ok(lease)
    }

    /// Puts back a lease that was just released (its release could not be made
    /// durable), unless it expired or its owner or connection was taken meanwhile.
    /// Returns whether it is back.
    pub fn restore(&mut self, lease: Lease, now: Millis) -> bool {
        if !lease.is_active(now)
            || self.leases.contains_key(&lease.owner_hash)
            || self.held_by_other(&lease.connection, None, now).is_some()
        {
            return false;
        }
        self.leases.insert(lease.owner_hash.clone(), lease);
        true
    }

    /// Shared backend (SPEC §7.1): takes `lease` as the cluster stored it, replacing the
    /// owner's row and any other lease of its connection (the cluster never holds two
    /// active ones; a row of ours saying otherwise is older news). An expired one is
    /// dropped instead.
    pub fn mirror(&mut self, lease: Lease, now: Millis) {
        self.prune(now);
        if !lease.is_active(now) {
            self.leases.remove(&lease.owner_hash);
            return;
        }
        self.leases
            .retain(|h, l| *h == lease.owner_hash || l.connection != lease.connection);
        self.next_generation = self
            .next_generation()
            .max(lease.generation.saturating_add(1));
        self.leases.insert(lease.owner_hash.clone(), lease);
    }

    /// Shared backend: the cluster no longer holds this owner's lease.
    /// Whether the table holds no lease at all (expired ones not yet pruned count).
    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    pub fn forget(&mut self, owner_hash: &str) -> bool {
        self.leases.remove(owner_hash).is_some()
    }

    /// The lease's connection became ineligible: move it (same generation, same expiry) to
    /// the first connection of `eligible` not held by another active lease. Returns the
    /// updated lease, or `None` if the lease is unknown/expired or nothing is free (the
    /// lease then stays where it is).
    pub fn relocate(
        &mut self,
        owner_hash: &str,
        eligible: &[String],
        now: Millis,
    ) -> Option<Lease> {
        if !self.leases.get(owner_hash)?.is_active(now) {
            return None;
        }
        let target = eligible
            .iter()
            .find(|c| self.held_by_other(c, Some(owner_hash), now).is_none())?
            .clone();
        let lease = self.leases.get_mut(owner_hash)?;
        lease.connection = target;
        Some(lease.clone())
    }

    /// Is `connection` held by an active lease whose owner is not `owner_hash`? Returns
    /// that lease's expiry if so.
    pub fn held_by_other(
        &self,
        connection: &str,
        owner_hash: Option<&str>,
        now: Millis,
    ) -> Option<Millis> {
        self.leases
            .values()
            .find(|l| {
                l.connection == connection
                    && l.is_active(now)
                    && owner_hash != Some(l.owner_hash.as_str())
            })
            .map(|l| l.expires_at)
    }

    /// The active lease of an owner hash, if any.
    pub fn get(&self, owner_hash: &str, now: Millis) -> Option<&Lease> {
        self.leases.get(owner_hash).filter(|l| l.is_active(now))
    }

    /// Active leases, sorted by connection.
    pub fn active(&self, now: Millis) -> Vec<&Lease> {
        let mut v: Vec<&Lease> = self.leases.values().filter(|l| l.is_active(now)).collect();
        v.sort_by(|a, b| a.connection.cmp(&b.connection));
        v
    }

    pub fn active_count(&self, now: Millis) -> usize {
        self.leases.values().filter(|l| l.is_active(now)).count()
    }

    /// Drops expired leases; returns their owner hashes (for persistence deletes).
    pub fn prune(&mut self, now: Millis) -> Vec<String> {
        let expired: Vec<String> = self
            .leases
            .values()
            .filter(|l| !l.is_active(now))
            .map(|l| l.owner_hash.clone())
            .collect();
        for h in &expired {
            self.leases.remove(h);
        }
        expired
    }

    /// Persistence: one row per lease keyed by owner hash, plus the generation counter
    /// under [`NEXT_GENERATION_ROW`].
    pub fn rows(&self) -> Vec<(String, serde_json::Value)> {
        let mut rows: Vec<(String, serde_json::Value)> = self
            .leases
            .iter()
            .filter_map(|(k, l)| serde_json::to_value(l).ok().map(|v| (k.clone(), v)))
            .collect();
        rows.push((
            NEXT_GENERATION_ROW.to_string(),
            serde_json::Value::from(self.next_generation()),
        ));
        rows
    }

    /// Rebuild from [`LeaseTable::rows`]. Drops expired and malformed rows and rows whose
    /// key is not the lease's owner hash; if two active rows claim one connection, the
    /// higher generation (the newer lease) wins. `next_generation` is restored to at least
    /// the largest stored generation + 1, so it never goes backwards.
    pub fn from_rows(
        rows: impl IntoIterator<Item = (String, serde_json::Value)>,
        now: Millis,
    ) -> Self {
        let mut table = LeaseTable::default();
        let mut max_generation = 0u64;
        let mut by_connection: BTreeMap<String, Lease> = BTreeMap::new();
        for (key, value) in rows {
            if key == NEXT_GENERATION_ROW {
                if let Some(n) = value.as_u64() {
                    table.next_generation = table.next_generation.max(n);
                }
                continue;
            }
            let Ok(lease) = serde_json::from_value::<Lease>(value) else {
                continue;
            };
            // Even a dropped lease's generation was handed out: never reuse it.
            max_generation = max_generation.max(lease.generation);
            if lease.owner_hash != key || !lease.is_active(now) {
                continue;
            }
            match by_connection.get(&lease.connection) {
                Some(held) if held.generation >= lease.generation => {}
                _ => {
                    by_connection.insert(lease.connection.clone(), lease);
                }
            }
        }
        for lease in by_connection.into_values() {
            // One active lease per owner too: a duplicate owner keeps the newer lease.
            match table.leases.get(&lease.owner_hash) {
                Some(held) if held.generation >= lease.generation => {}
                _ => {
                    table.leases.insert(lease.owner_hash.clone(), lease);
                }
            }
        }
        table.next_generation = table
            .next_generation
            .max(max_generation.saturating_add(1))
            .max(1);
        table
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T0: Millis = 1_700_000_000_000;
    const MIN: Millis = 60_000;

    fn conns(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    fn rnd(n: u8) -> [u8; 32] {
        let mut b = [0u8; 32];
        b[0] = n;
        b[31] = n.wrapping_mul(7);
        b
    }

    /// Test-only base64url (no padding) decoder.
    fn decode_b64url(s: &str) -> Option<Vec<u8>> {
        let mut bits = 0u32;
        let mut nbits = 0u32;
        let mut out = Vec::new();
        for c in s.bytes() {
            let v = B64URL.iter().position(|&x| x == c)? as u32;
            bits = (bits << 6) | v;
            nbits += 6;
            if nbits >= 8 {
                nbits -= 8;
                out.push((bits >> nbits) as u8);
                bits &= (1 << nbits) - 1;
            }
        }
        (bits == 0).then_some(out)
    }

    #[test]
    fn base64url_matches_rfc4648_vectors() {
        for (input, want) in [
            ("", ""),
            ("f", "Zg"),
            ("fo", "Zm8"),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg"),
            ("fooba", "Zm9vYmE"),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64url_nopad(input.as_bytes()), want, "{input:?}");
        }
        assert_eq!(base64url_nopad(&[0xfb, 0xff]), "-_8");
    }

    #[test]
    fn token_format() {
        for seed in [[0u8; 32], [0xff; 32], rnd(1), rnd(200)] {
            let t = owner_token(seed);
            let body = t.strip_prefix("slo_").unwrap();
            assert_eq!(body.len(), 43, "{t}");
            assert!(body
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_'));
            assert_eq!(decode_b64url(body).unwrap(), seed.to_vec());
        }
        assert_ne!(owner_token(rnd(1)), owner_token(rnd(2)));
    }

    #[test]
    fn owner_hash_is_lower_hex_sha256() {
        let h = owner_hash("slo_abc");
        assert_eq!(h.len(), 64);
        assert!(h
            .bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)));
        assert_eq!(
            owner_hash(""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn only_the_hash_is_stored() {
        let mut t = LeaseTable::new();
        let (token, lease) = t.acquire("c1", &conns(&["p/a"]), None, rnd(1), T0).unwrap();
        assert_eq!(lease.owner_hash, owner_hash(&token));
        let json = serde_json::to_string(&t).unwrap();
        let rows = serde_json::to_string(&t.rows()).unwrap();
        let body = token.strip_prefix("slo_").unwrap();
        for s in [&json, &rows] {
            assert!(!s.contains(&token));
            assert!(!s.contains(body));
            assert!(s.contains(&lease.owner_hash));
        }
    }

    #[test]
    fn acquire_defaults_and_ttl_bounds() {
        let mut t = LeaseTable::new();
        let (_, l) = t.acquire("c1", &conns(&["p/a"]), None, rnd(1), T0).unwrap();
        assert_eq!(l.expires_at, T0 + 10 * MIN);
        assert_eq!(l.created_at, T0);
        assert_eq!(l.client, "c1");
        assert_eq!(l.connection, "p/a");
        assert_eq!(l.generation, 1);

        let cases: [(Duration, bool); 6] = [
            (Duration::ZERO, false),
            (Duration::from_millis(999), false),
            (Duration::from_secs(1), true),
            (MAX_TTL, true),
            (MAX_TTL + Duration::from_millis(1), false),
            (Duration::from_secs(3600), true),
        ];
        for (i, (ttl, ok)) in cases.into_iter().enumerate() {
            let mut t = LeaseTable::new();
            let r = t.acquire("c1", &conns(&["p/a"]), Some(ttl), rnd(i as u8), T0);
            match r {
                Ok((_, l)) => {
                    assert!(ok, "{ttl:?}");
                    assert_eq!(l.expires_at, T0 + ms(ttl));
                }
                Err(e) => {
                    assert!(!ok, "{ttl:?}");
                    assert!(matches!(e, LeaseError::InvalidTtl(_)));
                    assert_eq!(t.active_count(T0), 0);
                }
            }
        }
        // Renew validates too.
        let mut t = LeaseTable::new();
        let (tok, _) = t.acquire("c1", &conns(&["p/a"]), None, rnd(1), T0).unwrap();
        assert!(matches!(
            t.renew("c1", &tok, Some(Duration::ZERO), T0),
            Err(LeaseError::InvalidTtl(_))
        ));
    }

    #[test]
    fn one_lease_per_connection_in_preference_order() {
        let mut t = LeaseTable::new();
        let el = conns(&["p/a", "p/b", "q/c"]);
        let (_, a) = t.acquire("c1", &el, None, rnd(1), T0).unwrap();
        let (_, b) = t.acquire("c1", &el, None, rnd(2), T0 + 1).unwrap();
        let (_, c) = t.acquire("c2", &el, None, rnd(3), T0 + 2).unwrap();
        assert_eq!(
            [a.connection, b.connection, c.connection],
            ["p/a", "p/b", "q/c"]
        );
        assert_eq!(t.active_count(T0 + 2), 3);
        let listed: Vec<_> = t
            .active(T0 + 2)
            .iter()
            .map(|l| l.connection.clone())
            .collect();
        assert_eq!(listed, ["p/a", "p/b", "q/c"]);
        // Each token is its own owner: distinct hashes.
        let hashes: std::collections::BTreeSet<_> = t
            .active(T0 + 2)
            .iter()
            .map(|l| l.owner_hash.clone())
            .collect();
        assert_eq!(hashes.len(), 3);
    }

    #[test]
    fn reused_random_bytes_never_give_one_owner_two_leases() {
        let mut t = LeaseTable::new();
        let el = conns(&["p/a", "p/b"]);
        let (tok1, l1) = t.acquire("c1", &el, None, rnd(1), T0).unwrap();
        let (tok2, l2) = t.acquire("c1", &el, None, rnd(1), T0).unwrap();
        assert_ne!(tok1, tok2);
        assert_ne!(l1.owner_hash, l2.owner_hash);
        assert!(tok2.starts_with("slo_") && tok2.len() == 47);
        assert_eq!(t.active_count(T0), 2);
        assert_eq!(t.check("c1", &tok1, l1.generation, T0), Ok(&l1));
        assert_eq!(t.check("c1", &tok2, l2.generation, T0), Ok(&l2));
    }

    #[test]
    fn capacity_unavailable_vs_none_eligible() {
        let mut t = LeaseTable::new();
        assert_eq!(
            t.acquire("c1", &[], None, rnd(1), T0),
            Err(LeaseError::NoneEligible)
        );
        let s = Duration::from_secs;
        t.acquire("c1", &conns(&["p/a"]), Some(s(300)), rnd(1), T0)
            .unwrap();
        t.acquire("c2", &conns(&["p/b"]), Some(s(120)), rnd(2), T0)
            .unwrap();
        t.acquire("c2", &conns(&["p/z"]), Some(s(30)), rnd(3), T0)
            .unwrap();
        let now = T0 + 10_000;
        // retry_at = earliest expiry among the leases holding *eligible* connections
        // (p/z expires sooner but is not relevant).
        assert_eq!(
            t.acquire("c3", &conns(&["p/a", "p/b"]), None, rnd(4), now),
            Err(LeaseError::CapacityUnavailable {
                retry_at: T0 + 120_000
            })
        );
        assert_eq!(
            t.acquire("c3", &conns(&["p/a"]), None, rnd(4), now),
            Err(LeaseError::CapacityUnavailable {
                retry_at: T0 + 300_000
            })
        );
        assert_eq!(super::super::retry_after_secs(T0 + 120_000, now), 110);
        // Same client holding the only connection still blocks a second session.
        assert!(matches!(
            t.acquire("c1", &conns(&["p/a"]), None, rnd(5), now),
            Err(LeaseError::CapacityUnavailable { .. })
        ));
        // Empty eligibility is not contention, even while leases exist.
        assert_eq!(
            t.acquire("c3", &[], None, rnd(4), now),
            Err(LeaseError::NoneEligible)
        );
        // A free one among held ones is taken.
        let (_, l) = t
            .acquire("c3", &conns(&["p/a", "p/b", "p/c"]), None, rnd(4), now)
            .unwrap();
        assert_eq!(l.connection, "p/c");
        // Failed acquires did not consume generations.
        assert_eq!(l.generation, 4);
    }

    #[test]
    fn renew_keeps_generation_and_extends() {
        let mut t = LeaseTable::new();
        let (tok, l) = t
            .acquire(
                "c1",
                &conns(&["p/a"]),
                Some(Duration::from_secs(60)),
                rnd(1),
                T0,
            )
            .unwrap();
        let now = T0 + 50_000;
        let r = t
            .renew("c1", &tok, Some(Duration::from_secs(120)), now)
            .unwrap();
        assert_eq!(r.generation, l.generation);
        assert_eq!(r.connection, l.connection);
        assert_eq!(r.created_at, T0);
        assert_eq!(r.expires_at, now + 120_000);
        // Alive past the original expiry.
        assert!(t.check("c1", &tok, l.generation, T0 + 61_000).is_ok());
        // Default TTL on renew.
        let r = t.renew("c1", &tok, None, now).unwrap();
        assert_eq!(r.expires_at, now + 10 * MIN);
        // Errors.
        assert_eq!(t.renew("c2", &tok, None, now), Err(LeaseError::WrongClient));
        assert_eq!(
            t.renew("c1", "slo_nope", None, now),
            Err(LeaseError::UnknownOwner)
        );
        assert_eq!(
            t.renew("c1", &tok, None, now + 10 * MIN),
            Err(LeaseError::UnknownOwner),
            "expired at exactly expires_at"
        );
    }

    #[test]
    fn release_frees_the_connection() {
        let mut t = LeaseTable::new();
        let el = conns(&["p/a"]);
        let (tok, l) = t.acquire("c1", &el, None, rnd(1), T0).unwrap();
        assert_eq!(t.release("c2", &tok, T0 + 1), Err(LeaseError::WrongClient));
        assert!(t.held_by_other("p/a", None, T0 + 1).is_some());
        assert_eq!(t.release("c1", &tok, T0 + 1), Ok(l.clone()));
        assert_eq!(t.held_by_other("p/a", None, T0 + 1), None);
        assert_eq!(t.active_count(T0 + 1), 0);
        assert_eq!(t.release("c1", &tok, T0 + 2), Err(LeaseError::UnknownOwner));
        assert_eq!(
            t.check("c1", &tok, l.generation, T0 + 2),
            Err(LeaseError::UnknownOwner)
        );
        let (_, l2) = t.acquire("c2", &el, None, rnd(2), T0 + 3).unwrap();
        assert_eq!(l2.connection, "p/a");
        assert!(l2.generation > l.generation, "counter survives release");
    }

    /// (client, token, generation, now, expected)
    type FenceCase<'a> = (&'a str, &'a str, u64, Millis, Result<(), LeaseError>);

    #[test]
    fn dispatch_fence() {
        let mut t = LeaseTable::new();
        let (tok, l) = t.acquire("c1", &conns(&["p/a"]), None, rnd(1), T0).unwrap();
        let g = l.generation;
        let cases: [FenceCase; 7] = [
            ("c1", &tok, g, T0, Ok(())),
            ("c1", &tok, g, T0 + 10 * MIN - 1, Ok(())),
            (
                "c1",
                &tok,
                g + 1,
                T0,
                Err(LeaseError::StaleGeneration { current: g }),
            ),
            (
                "c1",
                &tok,
                0,
                T0,
                Err(LeaseError::StaleGeneration { current: g }),
            ),
            ("c2", &tok, g, T0, Err(LeaseError::WrongClient)),
            ("c1", "slo_other", g, T0, Err(LeaseError::UnknownOwner)),
            ("c1", &tok, g, T0 + 10 * MIN, Err(LeaseError::UnknownOwner)),
        ];
        for (i, (client, token, gen, now, want)) in cases.into_iter().enumerate() {
            let got = t.check(client, token, gen, now).map(|l| {
                assert_eq!(l.connection, "p/a");
            });
            assert_eq!(got, want, "case {i}");
        }
        // The hash alone is not a token.
        assert_eq!(
            t.check("c1", &l.owner_hash, g, T0),
            Err(LeaseError::UnknownOwner)
        );
    }

    #[test]
    fn expiry_frees_lazily() {
        let mut t = LeaseTable::new();
        let el = conns(&["p/a"]);
        let (tok, l) = t
            .acquire("c1", &el, Some(Duration::from_secs(30)), rnd(1), T0)
            .unwrap();
        assert_eq!(
            t.held_by_other("p/a", None, T0 + 29_999),
            Some(l.expires_at)
        );
        assert_eq!(t.held_by_other("p/a", Some(&l.owner_hash), T0), None);
        assert_eq!(t.held_by_other("p/a", None, T0 + 30_000), None);
        assert_eq!(t.active_count(T0 + 30_000), 0);
        assert!(t.active(T0 + 30_000).is_empty());
        // Expired leases linger until pruned but count for nothing.
        let (_, l2) = t.acquire("c2", &el, None, rnd(2), T0 + 30_000).unwrap();
        assert_eq!(l2.connection, "p/a");
        assert_eq!(
            t.check("c1", &tok, l.generation, T0 + 30_000),
            Err(LeaseError::UnknownOwner)
        );
        assert_eq!(t.active_count(T0 + 30_000), 1);
    }

    #[test]
    fn prune_returns_expired_hashes() {
        let mut t = LeaseTable::new();
        let (_, a) = t
            .acquire(
                "c1",
                &conns(&["p/a"]),
                Some(Duration::from_secs(10)),
                rnd(1),
                T0,
            )
            .unwrap();
        let (_, b) = t
            .acquire(
                "c1",
                &conns(&["p/b"]),
                Some(Duration::from_secs(20)),
                rnd(2),
                T0,
            )
            .unwrap();
        assert!(t.prune(T0 + 9_999).is_empty());
        assert_eq!(t.prune(T0 + 10_000), vec![a.owner_hash]);
        assert_eq!(t.get(&b.owner_hash, T0 + 10_000), Some(&b));
        assert_eq!(t.prune(T0 + 20_000), vec![b.owner_hash]);
        assert_eq!(t.rows().len(), 1, "only the counter row remains");
    }

    #[test]
    fn relocate_keeps_generation() {
        let mut t = LeaseTable::new();
        let (tok, l) = t
            .acquire("c1", &conns(&["p/a", "p/b", "p/c"]), None, rnd(1), T0)
            .unwrap();
        let (_, other) = t.acquire("c2", &conns(&["p/b"]), None, rnd(2), T0).unwrap();
        assert_eq!(l.connection, "p/a");
        // p/a became ineligible; p/b is held by another lease → p/c.
        let moved = t
            .relocate(&l.owner_hash, &conns(&["p/b", "p/c"]), T0 + 5)
            .unwrap();
        assert_eq!(moved.connection, "p/c");
        assert_eq!(moved.generation, l.generation);
        assert_eq!(moved.expires_at, l.expires_at);
        assert!(t.check("c1", &tok, l.generation, T0 + 5).is_ok());
        assert_eq!(t.held_by_other("p/a", None, T0 + 5), None);
        assert!(t
            .held_by_other("p/c", Some(&other.owner_hash), T0 + 5)
            .is_some());
        // Nothing free → None, the lease stays.
        assert_eq!(t.relocate(&l.owner_hash, &conns(&["p/b"]), T0 + 6), None);
        assert_eq!(t.get(&l.owner_hash, T0 + 6).unwrap().connection, "p/c");
        assert_eq!(t.relocate(&l.owner_hash, &[], T0 + 6), None);
        // Unknown or expired owner → None.
        assert_eq!(t.relocate("deadbeef", &conns(&["p/z"]), T0 + 6), None);
        assert_eq!(
            t.relocate(&l.owner_hash, &conns(&["p/z"]), l.expires_at),
            None
        );
        // An expired foreign lease does not block relocation.
        let mut t = LeaseTable::new();
        let (_, a) = t
            .acquire(
                "c1",
                &conns(&["p/a"]),
                Some(Duration::from_secs(60)),
                rnd(1),
                T0,
            )
            .unwrap();
        let (_, b) = t
            .acquire(
                "c2",
                &conns(&["p/b"]),
                Some(Duration::from_secs(10)),
                rnd(2),
                T0,
            )
            .unwrap();
        let moved = t
            .relocate(&a.owner_hash, &conns(&["p/b"]), b.expires_at)
            .unwrap();
        assert_eq!(moved.connection, "p/b");
    }

    #[test]
    fn persistence_round_trip_keeps_generation_monotonic() {
        let mut t = LeaseTable::new();
        let (tok_a, a) = t
            .acquire(
                "c1",
                &conns(&["p/a"]),
                Some(Duration::from_secs(600)),
                rnd(1),
                T0,
            )
            .unwrap();
        let (tok_b, _) = t
            .acquire(
                "c1",
                &conns(&["p/b"]),
                Some(Duration::from_secs(10)),
                rnd(2),
                T0,
            )
            .unwrap();
        let (tok_c, c) = t.acquire("c1", &conns(&["p/c"]), None, rnd(3), T0).unwrap();
        t.release("c1", &tok_c, T0).unwrap();
        let rows = t.rows();
        assert_eq!(rows.len(), 3);

        let now = T0 + 20_000; // b expired meanwhile
        let mut r = LeaseTable::from_rows(rows.clone(), now);
        assert_eq!(r.active_count(now), 1);
        assert_eq!(r.check("c1", &tok_a, a.generation, now), Ok(&a));
        assert_eq!(r.check("c1", &tok_b, 2, now), Err(LeaseError::UnknownOwner));
        assert_eq!(r.next_generation(), c.generation + 1);
        let (_, d) = r
            .acquire("c1", &conns(&["p/a", "p/c"]), None, rnd(4), now)
            .unwrap();
        assert_eq!(d.connection, "p/c");
        assert!(d.generation > c.generation);

        // Without the counter row, the largest stored generation (even of an expired
        // lease) bounds it from below.
        let no_counter: Vec<_> = rows
            .iter()
            .filter(|(k, _)| k != NEXT_GENERATION_ROW)
            .cloned()
            .collect();
        let r = LeaseTable::from_rows(no_counter, now);
        assert_eq!(r.next_generation(), 3);
        // A stale counter below the stored generations is raised.
        let mut low = rows.clone();
        low.retain(|(k, _)| k != NEXT_GENERATION_ROW);
        low.push((NEXT_GENERATION_ROW.to_string(), serde_json::json!(1)));
        assert_eq!(LeaseTable::from_rows(low, now).next_generation(), 3);
        // Empty store.
        assert_eq!(LeaseTable::from_rows(Vec::new(), now).next_generation(), 1);
        // Serde round trip of the whole table.
        let json = serde_json::to_string(&t).unwrap();
        let back: LeaseTable = serde_json::from_str(&json).unwrap();
        assert_eq!(back.next_generation(), t.next_generation());
        assert_eq!(back.active(T0), t.active(T0));
    }

    #[test]
    fn from_rows_drops_malformed_and_conflicting_rows() {
        let lease = |hash: &str, conn: &str, generation: u64| Lease {
            owner_hash: hash.to_string(),
            client: "c1".into(),
            connection: conn.to_string(),
            generation,
            expires_at: T0 + MIN,
            created_at: T0,
        };
        let h1 = owner_hash("slo_1");
        let h2 = owner_hash("slo_2");
        let h3 = owner_hash("slo_3");
        let rows = vec![
            (
                h1.clone(),
                serde_json::to_value(lease(&h1, "p/a", 5)).unwrap(),
            ),
            (
                h2.clone(),
                serde_json::to_value(lease(&h2, "p/a", 7)).unwrap(),
            ),
            (
                "wrong-key".into(),
                serde_json::to_value(lease(&h3, "p/b", 9)).unwrap(),
            ),
            ("garbage".into(), serde_json::json!({"nope": true})),
        ];
        let t = LeaseTable::from_rows(rows, T0);
        let active = t.active(T0);
        assert_eq!(active.len(), 1);
        assert_eq!(
            active[0].owner_hash, h2,
            "newer generation wins the connection"
        );
        assert_eq!(t.next_generation(), 10);
    }

    #[test]
    fn errors_display() {
        assert!(LeaseError::StaleGeneration { current: 3 }
            .to_string()
            .contains('3'));
        assert!(!LeaseError::NoneEligible.to_string().is_empty());
    }

    #[derive(Clone, Debug)]
    enum Op {
        Acquire {
            client: u8,
            pick: Vec<u8>,
            ttl_s: u64,
        },
        Renew {
            which: u8,
            ttl_s: u64,
        },
        Release {
            which: u8,
        },
        Relocate {
            which: u8,
            pick: Vec<u8>,
        },
        Advance {
            ms: u64,
        },
        Restore,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..3, proptest::collection::vec(0u8..5, 0..5), 1u64..120).prop_map(
                |(client, pick, ttl_s)| Op::Acquire {
                    client,
                    pick,
                    ttl_s
                }
            ),
            (any::<u8>(), 1u64..120).prop_map(|(which, ttl_s)| Op::Renew { which, ttl_s }),
            any::<u8>().prop_map(|which| Op::Release { which }),
            (any::<u8>(), proptest::collection::vec(0u8..5, 0..5))
                .prop_map(|(which, pick)| Op::Relocate { which, pick }),
            (0u64..90_000).prop_map(|ms| Op::Advance { ms }),
            Just(Op::Restore),
        ]
    }

    proptest! {
        #[test]
        fn token_decodes_to_its_random_bytes(random in any::<[u8; 32]>()) {
            let t = owner_token(random);
            prop_assert_eq!(t.len(), 47);
            let body = &t[TOKEN_PREFIX.len()..];
            prop_assert_eq!(decode_b64url(body), Some(random.to_vec()));
        }

        #[test]
        fn generations_strictly_increase_across_release_and_restore(
            steps in proptest::collection::vec((0u8..4, 0u64..20_000), 1..60)
        ) {
            let el = conns(&["p/a", "p/b"]);
            let mut t = LeaseTable::new();
            let mut now = T0;
            let mut last = 0u64;
            let mut held: Vec<String> = Vec::new();
            for (i, (kind, dt)) in steps.into_iter().enumerate() {
                now += dt;
                match kind {
                    0 | 1 => {
                        let mut random = [0u8; 32];
                        random[..8].copy_from_slice(&(i as u64).to_be_bytes());
                        if let Ok((tok, l)) =
                            t.acquire("c1", &el, Some(Duration::from_secs(10)), random, now)
                        {
                            prop_assert!(l.generation > last);
                            last = l.generation;
                            held.push(tok);
                        }
                    }
                    2 => {
                        if let Some(tok) = held.pop() {
                            let _ = t.release("c1", &tok, now);
                        }
                    }
                    _ => t = LeaseTable::from_rows(t.rows(), now),
                }
                prop_assert!(t.next_generation() > last);
            }
        }
    }

    proptest! {
        #[test]
        fn no_two_active_leases_share_a_connection(
            ops in proptest::collection::vec(op(), 1..80)
        ) {
            let mut t = LeaseTable::new();
            let mut now = T0;
            let mut tokens: Vec<(String, String)> = Vec::new(); // (client, token)
            let mut last_generation = 0u64;
            let mut seed = 0u32;
            for op in ops {
                match op {
                    Op::Acquire { client, pick, ttl_s } => {
                        seed += 1;
                        let mut random = [0u8; 32];
                        random[..4].copy_from_slice(&seed.to_be_bytes());
                        let el: Vec<String> = pick.iter().map(|i| format!("p/{i}")).collect();
                        let client = format!("c{client}");
                        match t.acquire(&client, &el, Some(Duration::from_secs(ttl_s)), random, now) {
                            Ok((tok, l)) => {
                                prop_assert!(l.generation > last_generation);
                                last_generation = l.generation;
                                prop_assert!(el.contains(&l.connection));
                                tokens.push((client, tok));
                            }
                            Err(LeaseError::NoneEligible) => prop_assert!(el.is_empty()),
                            Err(LeaseError::CapacityUnavailable { retry_at }) => {
                                prop_assert!(retry_at > now);
                                for c in &el {
                                    prop_assert!(t.held_by_other(c, None, now).is_some());
                                }
                            }
                            Err(e) => prop_assert!(false, "unexpected {e:?}"),
                        }
                    }
                    Op::Renew { which, ttl_s } => {
                        if let Some((c, tok)) = tokens.get(which as usize % tokens.len().max(1)) {
                            if let Ok(l) = t.renew(c, tok, Some(Duration::from_secs(ttl_s)), now) {
                                prop_assert!(l.generation <= last_generation);
                            }
                        }
                    }
                    Op::Release { which } => {
                        if let Some((c, tok)) = tokens.get(which as usize % tokens.len().max(1)) {
                            let _ = t.release(c, tok, now);
                        }
                    }
                    Op::Relocate { which, pick } => {
                        if let Some((_, tok)) = tokens.get(which as usize % tokens.len().max(1)) {
                            let el: Vec<String> = pick.iter().map(|i| format!("p/{i}")).collect();
                            let before = t.get(&owner_hash(tok), now).cloned();
                            if let Some(l) = t.relocate(&owner_hash(tok), &el, now) {
                                let before = before.unwrap();
                                prop_assert_eq!(l.generation, before.generation);
                                prop_assert!(el.contains(&l.connection));
                            }
                        }
                    }
                    Op::Advance { ms } => now += ms,
                    Op::Restore => {
                        let before = t.next_generation();
                        t = LeaseTable::from_rows(t.rows(), now);
                        prop_assert!(t.next_generation() >= before);
                    }
                }
                let active = t.active(now);
                let mut seen = std::collections::BTreeSet::new();
                for l in &active {
                    prop_assert!(seen.insert(l.connection.clone()), "two leases on {}", l.connection);
                    prop_assert!(l.generation < t.next_generation());
                }
            }
        }
    }

    #[test]
    fn a_released_lease_can_be_put_back_unless_its_place_was_taken() {
        let mut t = LeaseTable::new();
        let (tok, lease) = t.acquire("a", &conns(&["p/c"]), None, rnd(1), 0).unwrap();
        let released = t.release("a", &tok, 1).unwrap();
        assert!(t.restore(released.clone(), 2));
        assert_eq!(
            t.check("a", &tok, lease.generation, 3).unwrap().connection,
            "p/c"
        );
        // Not twice, not once expired, not over someone else's lease.
        assert!(!t.restore(released.clone(), 4));
        let released = t.release("a", &tok, 5).unwrap();
        let (_, _other) = t.acquire("b", &conns(&["p/c"]), None, rnd(2), 6).unwrap();
        assert!(!t.restore(released.clone(), 7));
        assert!(!t.restore(released, lease.expires_at + 1));
    }
}
