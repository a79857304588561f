//! Session affinity pins (SPEC §5.5): a soft preference that keeps one client session on
//! the connection that served it, so upstream prompt caches and per-account context stay
//! warm. Unlike a lease (§5.6) a pin excludes nobody: it is used only while its connection
//! is eligible, and otherwise selection proceeds normally and the pin moves.
//!
//! Invariants: raw session ids are never stored (a pin is keyed by [`pin_key`], a SHA-256
//! of client id, model and session); a pin is live while `expires_at > now` and expiry is
//! lazy (readers compare with `now`; [`PinTable::prune`] only reclaims memory and tells the
//! store which rows to delete); each use refreshes the TTL; a TTL of zero disables the
//! layer (nothing is created or refreshed). Which connection is eligible is not decided
//! here.

use super::fields::Fields;
use super::{ms, Millis};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::time::Duration;

/// Session headers, in precedence order (first valid one wins).
pub const SESSION_HEADERS: [&str; 3] = ["x-session-id", "x-codex-session-id", "x-sluice-session"];
/// Longest accepted session id, in bytes (after trimming).
pub const MAX_SESSION_BYTES: usize = 256;

/// Session key from the request headers: the first of `x-session-id`,
/// `x-codex-session-id`, `x-sluice-session` whose value is UTF-8, non-empty after trimming
/// and at most [`MAX_SESSION_BYTES`] bytes. An invalid value (empty, oversized, not UTF-8)
/// is ignored as if absent, and the next header is tried.
pub fn session_key(headers: &(impl Fields + ?Sized)) -> Option<String> {
    SESSION_HEADERS.iter().find_map(|name| {
        let value = headers.field_str(name)?;
        let value = value.trim();
        (!value.is_empty() && value.len() <= MAX_SESSION_BYTES).then(|| value.to_string())
    })
}

/// Stable pin key: hex SHA-256 of (client id, `\0`, model name, `\0`, session) — raw
/// session ids are never stored.
pub fn pin_key(client: &str, model: &str, session: &str) -> String {
    let mut h = Sha256::new();
    h.update(client.as_bytes());
    h.update([0u8]);
    h.update(model.as_bytes());
    h.update([0u8]);
    h.update(session.as_bytes());
    hex::encode(h.finalize())
}

/// Where one session is pinned.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pin {
    /// `provider/connection`.
    pub connection: String,
    /// The upstream model it served, if known.
    pub target: Option<String>,
    pub expires_at: Millis,
}

impl Pin {
    /// Live while its expiry lies in the future.
    pub fn is_active(&self, now: Millis) -> bool {
        self.expires_at > now
    }
}

/// All pins, keyed by [`pin_key`]. Expired pins linger until [`PinTable::prune`] and are
/// ignored by every reader.
#[derive(Clone, Debug, Default)]
pub struct PinTable {
    pins: HashMap<String, Pin>,
}

impl PinTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// The pin if it exists and has not expired.
    pub fn get(&self, key: &str, now: Millis) -> Option<&Pin> {
        self.pins.get(key).filter(|p| p.is_active(now))
    }

    /// Create or move the pin and refresh its TTL (`expires_at = now + ttl`). A TTL of zero
    /// (below one millisecond) disables affinity: no-op, returns false. Returns whether the
    /// stored pin changed (new connection, target or expiry).
    pub fn touch(
        &mut self,
        key: &str,
        connection: &str,
        target: Option<&str>,
        ttl: Duration,
        now: Millis,
    ) -> bool {
        let ttl = ms(ttl);
        if ttl == 0 {
            return false;
        }
        let pin = Pin {
            connection: connection.to_string(),
            target: target.map(str::to_string),
            expires_at: now.saturating_add(ttl),
        };
        if self.pins.get(key) == Some(&pin) {
            return false;
        }
        self.pins.insert(key.to_string(), pin);
        true
    }

    /// Forget a pin; returns whether one was stored (live or expired).
    pub fn remove(&mut self, key: &str) -> bool {
        self.pins.remove(key).is_some()
    }

    pub fn active_count(&self, now: Millis) -> usize {
        self.pins.values().filter(|p| p.is_active(now)).count()
    }

    /// Live pins, sorted by key (for persistence snapshots and admin views).
    pub fn active(&self, now: Millis) -> Vec<(&str, &Pin)> {
        let mut v: Vec<(&str, &Pin)> = self
            .pins
            .iter()
            .filter(|(_, p)| p.is_active(now))
            .map(|(k, p)| (k.as_str(), p))
            .collect();
        v.sort_by(|a, b| a.0.cmp(b.0));
        v
    }

    /// Drops expired pins; returns the removed keys, sorted (for persistence deletes).
    pub fn prune(&mut self, now: Millis) -> Vec<String> {
        let mut removed: Vec<String> = self
            .pins
            .iter()
            .filter(|(_, p)| !p.is_active(now))
            .map(|(k, _)| k.clone())
            .collect();
        for k in &removed {
            self.pins.remove(k);
        }
        removed.sort();
        removed
    }

    /// Restore a persisted pin; an expired one is ignored (returns false).
    pub fn insert_restored(&mut self, key: String, pin: Pin, now: Millis) -> bool {
        if !pin.is_active(now) {
            return false;
        }
        self.pins.insert(key, pin);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderMap, HeaderValue};

    const T0: Millis = 1_700_000_000_000;
    const TTL: Duration = Duration::from_secs(30 * 60);

    type Headers<'a> = Vec<(&'static str, &'a str)>;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn header_precedence_and_validation() {
        let long = "x".repeat(MAX_SESSION_BYTES);
        let too_long = "x".repeat(MAX_SESSION_BYTES + 1);
        let padded = format!("  {long}  ");
        let cases: Vec<(Headers, Option<&str>)> = vec![
            (vec![], None),
            (vec![("x-session-id", "s1")], Some("s1")),
            (vec![("X-Session-Id", "  s1 \t")], Some("s1")),
            (vec![("x-codex-session-id", "c1")], Some("c1")),
            (vec![("x-sluice-session", "l1")], Some("l1")),
            (
                vec![
                    ("x-sluice-session", "l1"),
                    ("x-codex-session-id", "c1"),
                    ("x-session-id", "s1"),
                ],
                Some("s1"),
            ),
            (
                vec![("x-sluice-session", "l1"), ("x-codex-session-id", "c1")],
                Some("c1"),
            ),
            // Invalid values are ignored and the next header is tried.
            (
                vec![("x-session-id", "   "), ("x-sluice-session", "l1")],
                Some("l1"),
            ),
            (
                vec![("x-session-id", &too_long), ("x-codex-session-id", "c1")],
                Some("c1"),
            ),
            (vec![("x-session-id", &too_long)], None),
            (vec![("x-session-id", "")], None),
            (vec![("x-session-id", &long)], Some(&long)),
            // Oversized before trimming but not after.
            (vec![("x-session-id", &padded)], Some(&long)),
            // Unrelated headers do not count.
            (vec![("x-session", "nope"), ("session-id", "nope")], None),
        ];
        for (i, (pairs, want)) in cases.iter().enumerate() {
            assert_eq!(
                session_key(&headers(pairs)).as_deref(),
                *want,
                "case {i}: {pairs:?}"
            );
        }
        // Non-UTF-8 value is ignored.
        let mut h = HeaderMap::new();
        h.insert(
            "x-session-id",
            HeaderValue::from_bytes(&[0xff, 0xfe]).unwrap(),
        );
        h.insert("x-sluice-session", HeaderValue::from_static("l1"));
        assert_eq!(session_key(&h).as_deref(), Some("l1"));
        // UTF-8 beyond ASCII is accepted.
        let mut h = HeaderMap::new();
        h.insert(
            "x-session-id",
            HeaderValue::from_bytes("sé".as_bytes()).unwrap(),
        );
        assert_eq!(session_key(&h).as_deref(), Some("sé"));
    }

    #[test]
    fn pin_key_is_hashed_and_separated() {
        let k = pin_key("client", "smart", "sess-123");
        assert_eq!(k.len(), 64);
        assert!(k
            .bytes()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert!(!k.contains("sess-123"));
        assert_eq!(k, pin_key("client", "smart", "sess-123"));
        assert_ne!(k, pin_key("client2", "smart", "sess-123"));
        assert_ne!(k, pin_key("client", "fast", "sess-123"));
        assert_ne!(k, pin_key("client", "smart", "sess-124"));
        // The separator keeps field boundaries apart.
        assert_ne!(pin_key("ab", "c", "s"), pin_key("a", "bc", "s"));
        assert_ne!(pin_key("a", "b", "cs"), pin_key("a", "bc", "s"));
    }

    #[test]
    fn touch_creates_and_refreshes_ttl() {
        let mut t = PinTable::new();
        let k = pin_key("c", "m", "s");
        assert_eq!(t.get(&k, T0), None);
        assert!(t.touch(&k, "p/a", Some("gpt-4o"), TTL, T0));
        let p = t.get(&k, T0).unwrap();
        assert_eq!(p.connection, "p/a");
        assert_eq!(p.target.as_deref(), Some("gpt-4o"));
        assert_eq!(p.expires_at, T0 + 1_800_000);
        // Same instant, same everything: no change.
        assert!(!t.touch(&k, "p/a", Some("gpt-4o"), TTL, T0));
        // Each use refreshes the TTL.
        let later = T0 + 29 * 60_000;
        assert!(t.touch(&k, "p/a", Some("gpt-4o"), TTL, later));
        assert_eq!(t.get(&k, later).unwrap().expires_at, later + 1_800_000);
        assert!(
            t.get(&k, T0 + 31 * 60_000).is_some(),
            "alive past the first expiry"
        );
        assert_eq!(t.active_count(later), 1);
    }

    #[test]
    fn touch_moves_the_pin() {
        let mut t = PinTable::new();
        let k = pin_key("c", "m", "s");
        t.touch(&k, "p/a", Some("m1"), TTL, T0);
        assert!(t.touch(&k, "q/b", Some("m2"), TTL, T0));
        let p = t.get(&k, T0).unwrap();
        assert_eq!(
            (p.connection.as_str(), p.target.as_deref()),
            ("q/b", Some("m2"))
        );
        // A target change alone is a change.
        assert!(t.touch(&k, "q/b", None, TTL, T0));
        assert_eq!(t.get(&k, T0).unwrap().target, None);
        assert_eq!(t.active_count(T0), 1);
    }

    #[test]
    fn expiry_is_lazy() {
        let mut t = PinTable::new();
        let k = pin_key("c", "m", "s");
        t.touch(&k, "p/a", None, Duration::from_secs(60), T0);
        assert!(t.get(&k, T0 + 59_999).is_some());
        assert_eq!(t.get(&k, T0 + 60_000), None);
        assert_eq!(t.active_count(T0 + 60_000), 0);
        assert!(t.active(T0 + 60_000).is_empty());
        // An expired pin is revived by a touch (a change).
        assert!(t.touch(&k, "p/a", None, Duration::from_secs(60), T0 + 70_000));
        assert_eq!(t.get(&k, T0 + 70_000).unwrap().expires_at, T0 + 130_000);
    }

    #[test]
    fn zero_ttl_disables() {
        let mut t = PinTable::new();
        let k = pin_key("c", "m", "s");
        assert!(!t.touch(&k, "p/a", None, Duration::ZERO, T0));
        assert!(!t.touch(&k, "p/a", None, Duration::from_micros(999), T0));
        assert_eq!(t.get(&k, T0), None);
        assert_eq!(t.active_count(T0), 0);
        // Nor does it refresh or move an existing pin.
        t.touch(&k, "p/a", None, TTL, T0);
        assert!(!t.touch(&k, "q/b", None, Duration::ZERO, T0 + 1));
        assert_eq!(t.get(&k, T0 + 1).unwrap().connection, "p/a");
    }

    #[test]
    fn remove_prune_and_restore() {
        let mut t = PinTable::new();
        let (a, b, c) = (
            pin_key("c", "m", "a"),
            pin_key("c", "m", "b"),
            pin_key("c", "m", "c"),
        );
        t.touch(&a, "p/a", None, Duration::from_secs(10), T0);
        t.touch(&b, "p/b", None, Duration::from_secs(20), T0);
        t.touch(&c, "p/c", None, Duration::from_secs(10), T0);
        assert!(t.remove(&c));
        assert!(!t.remove(&c));
        assert!(t.prune(T0 + 9_999).is_empty());
        assert_eq!(t.prune(T0 + 10_000), vec![a.clone()]);
        assert_eq!(
            t.active(T0 + 10_000),
            vec![(b.as_str(), t.get(&b, T0).unwrap())]
        );
        assert_eq!(t.prune(T0 + 20_000), vec![b.clone()]);
        assert_eq!(t.active_count(T0), 0, "pruned pins are gone");

        let pin = |exp: Millis| Pin {
            connection: "p/a".into(),
            target: Some("m".into()),
            expires_at: exp,
        };
        let mut r = PinTable::new();
        assert!(!r.insert_restored(a.clone(), pin(T0), T0));
        assert!(!r.insert_restored(a.clone(), pin(T0 - 1), T0));
        assert!(r.insert_restored(b.clone(), pin(T0 + 1), T0));
        assert_eq!(r.get(&a, T0), None);
        assert_eq!(r.get(&b, T0), Some(&pin(T0 + 1)));
        // Pins serialise for the store.
        let json = serde_json::to_string(&pin(T0)).unwrap();
        assert_eq!(serde_json::from_str::<Pin>(&json).unwrap(), pin(T0));
    }
}
