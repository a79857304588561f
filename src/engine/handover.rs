//! Taking in the state a draining predecessor forwarded after it released the store
//! (SPEC §8.1 upgrade; the files themselves are `store::handover`'s).
//!
//! Both processes serve during the drain, so a forwarded entry may be older than what
//! this process learned since. Invariants: a forwarded change is applied only when it
//! is worse news than what this process holds — a connection cooling longer, a terminal
//! state, a model lockout lasting longer, a subscription memory learnt later — or concerns an entry this process does not
//! have (a pin); what is applied reaches memory and this process's store alike, so the
//! two never disagree. The rest is dropped and counted: breaker transitions (the new
//! process's breaker judges from its own traffic), lease and override rows, deletes.

use super::state::{conn_key, lock, ConnEntry, LockEntry};
use super::Engine;
use crate::policy::affinity::Pin;
use crate::policy::lease::Lease;
use crate::store::{Change, Table};

impl Engine {
    /// Applies one forwarded batch; returns how many changes were taken.
    pub fn absorb_forwarded(&self, batch: Vec<Change>) -> usize {
        let now = self.now();
        let mut taken = Vec::new();
        for c in batch {
            let Some(v) = &c.value else { continue };
            let take = match c.table {
                Table::Connections => serde_json::from_value::<ConnEntry>(v.clone())
                    .is_ok_and(|e| self.take_connection(&c.key, e, now)),
                Table::Lockouts => serde_json::from_value::<LockEntry>(v.clone())
                    .is_ok_and(|e| self.take_lockout(e, now)),
                Table::Pins => serde_json::from_value::<Pin>(v.clone()).is_ok_and(|pin| {
                    let mut pins = lock(&self.pins);
                    pins.get(&c.key, now).is_none() && pins.insert_restored(c.key.clone(), pin, now)
                }),
                Table::Breakers | Table::Leases | Table::Overrides => false,
            };
            if take {
                taken.push(match c.table {
                    // What memory now holds (the subscription memory may be a merge).
                    Table::Connections => self.connection_row(&c.key).unwrap_or(c),
                    _ => c,
                });
            }
        }
        let n = taken.len();
        if let (Some(w), false) = (&self.store, taken.is_empty()) {
            w.submit(taken);
        }
        n
    }

    /// A forwarded connection state replaces ours when it cools the connection longer
    /// or makes it terminal where ours is not.
    fn take_connection(&self, key: &str, theirs: ConnEntry, now: crate::policy::Millis) -> bool {
        let Some((provider, connection)) = key.split_once('/') else {
            return false;
        };
        debug_assert_eq!(conn_key(provider, connection), key);
        let entry = self.tables.connection(provider, connection);
        let mut ours = lock(&entry);
        let worse = (theirs.state.terminal.is_some() && ours.state.terminal.is_none())
            || theirs.state.cooling_until(now) > ours.state.cooling_until(now);
        // The subscription lane's memory is merged on its own (SPEC §5.13): a lane the
        // predecessor entered during its drain must not cost this process another wall.
        let mut sub = ours.subscription;
        let sub_later = sub.merge_later(&theirs.subscription);
        if worse {
            *ours = theirs;
        }
        if sub_later || worse {
            ours.subscription = sub;
        }
        worse || sub_later
    }

    /// The store row of a connection entry as memory holds it.
    fn connection_row(&self, key: &str) -> Option<Change> {
        let (provider, connection) = key.split_once('/')?;
        let entry = self.tables.connection_if_any(provider, connection)?;
        let e = lock(&entry);
        Some(super::state::change(Table::Connections, key, Some(&*e)))
    }

    /// A forwarded model lockout replaces ours when it lasts longer.
    fn take_lockout(&self, theirs: LockEntry, now: crate::policy::Millis) -> bool {
        if !theirs.lock.active(now) {
            return false;
        }
        let (taken, _) = self.tables.with_lockout(
            &theirs.provider,
            &theirs.connection,
            &theirs.model,
            |ours| {
                let longer = theirs.lock.until > ours.lock.until;
                if longer {
                    ours.lock = theirs.lock.clone();
                }
                longer
            },
        );
        taken
    }
}

impl Engine {
    /// Applies changes another running node committed to the shared store (SPEC §7.1,
    /// eventually consistent): the latest write wins, in memory only (they are in the
    /// store already). Breakers, connection states, lockouts and pins are taken, upserts
    /// and deletes alike, the leases the cluster's scripts stored, and runtime overrides
    /// (layered on this node's config). Returns how many were applied.
    pub fn absorb_remote(&self, changes: Vec<Change>) -> usize {
        let now = self.now();
        let mut n = 0;
        let mut overrides = std::collections::BTreeMap::new();
        // In stream order, one change at a time: a clear read after a cooldown in the same
        // poll must win over it.
        for c in changes {
            match (&c.value, c.table) {
                (Some(v), Table::Connections) if self.keeps_terminal(&c.key, v) => {}
                (Some(v), Table::Breakers | Table::Connections | Table::Lockouts) => {
                    let mut image = crate::store::empty_image();
                    let table = c.table;
                    if let Some(rows) = image.get_mut(&table) {
                        rows.insert(c.key.clone(), v.clone());
                    }
                    let ours = (table == Table::Connections)
                        .then(|| self.subscription_of(&c.key))
                        .flatten();
                    n += self.tables.restore(&image, now);
                    if table == Table::Connections {
                        self.learnt_cooldown(&c.key, now);
                        if let Some(ours) = ours {
                            self.keep_subscription(&c.key, &ours);
                        }
                    }
                }
                (Some(v), Table::Pins) => {
                    if let Ok(pin) = serde_json::from_value::<Pin>(v.clone()) {
                        n += usize::from(lock(&self.pins).insert_restored(c.key, pin, now));
                    }
                }
                (None, Table::Connections) => {
                    if let Some((p, conn)) = c.key.split_once('/') {
                        *lock(&self.tables.connection(p, conn)) = ConnEntry::default();
                        n += 1;
                    }
                }
                (None, Table::Breakers) => {
                    *lock(&self.tables.provider(&c.key)) = Default::default();
                    n += 1;
                }
                (None, Table::Lockouts) => {
                    let mut parts = c.key.splitn(3, '/');
                    if let (Some(p), Some(conn), Some(m)) =
                        (parts.next(), parts.next(), parts.next())
                    {
                        n += usize::from(self.tables.remove_lockout(p, conn, m).is_some());
                    }
                }
                (None, Table::Pins) => {
                    n += usize::from(lock(&self.pins).remove(&c.key));
                }
                // The cluster's lease scripts announce what they stored (SPEC §7.1).
                (Some(v), Table::Leases) => {
                    if let Ok(lease) = serde_json::from_value::<Lease>(v.clone()) {
                        if lease.owner_hash == c.key {
                            self.leases.lock().mirror(lease, now);
                            n += 1;
                        }
                    }
                }
                (None, Table::Leases) => {
                    n += usize::from(self.leases.lock().forget(&c.key));
                }
                // Taken together after the batch: one re-layering, the last value per key.
                (v, Table::Overrides) => {
                    overrides.insert(c.key.clone(), v.clone());
                }
            }
        }
        if !overrides.is_empty() {
            n += overrides.len();
            self.take_remote_overrides(overrides);
        }
        n
    }
}

impl Engine {
    /// A connection's subscription memory, when it has any.
    fn subscription_of(&self, key: &str) -> Option<crate::policy::subscription::SubState> {
        let (p, conn) = key.split_once('/')?;
        let e = self.tables.connection_if_any(p, conn)?;
        let sub = lock(&e).subscription;
        (!sub.is_empty()).then_some(sub)
    }

    /// A remote row replaced the whole entry; its subscription memory is merged with
    /// what this node held (each memory the later one, the lane of the later decision),
    /// so a row written by a node that had not learnt them does not erase them.
    fn keep_subscription(&self, key: &str, ours: &crate::policy::subscription::SubState) {
        let Some((p, conn)) = key.split_once('/') else {
            return;
        };
        if let Some(e) = self.tables.connection_if_any(p, conn) {
            lock(&e).subscription.merge_later(ours);
        }
    }

    /// Anti-herd across nodes (SPEC §7.1): a cooldown learnt from another node counts
    /// as set here when it was learnt, so this node's attempts dispatched before it knew
    /// (in flight during the sync interval) are stale failures that neither extend it nor
    /// raise its level, as the other node's own in-flight attempts are.
    fn learnt_cooldown(&self, key: &str, now: crate::policy::Millis) {
        let Some((p, conn)) = key.split_once('/') else {
            return;
        };
        if let Some(e) = self.tables.connection_if_any(p, conn) {
            let mut e = lock(&e);
            if e.state.cooled_until > now {
                e.state.cooldown_set_at = e.state.cooldown_set_at.max(now);
            }
        }
    }

    /// A remote connection row that is not terminal does not replace a terminal state
    /// here unless it is an operator's clear: it comes from a node that had not learnt
    /// the terminal state yet (SPEC §7.1: terminal states are never overwritten by a
    /// cooldown).
    fn keeps_terminal(&self, key: &str, theirs: &serde_json::Value) -> bool {
        let Some((p, conn)) = key.split_once('/') else {
            return false;
        };
        let cleared = theirs.get("cleared") == Some(&serde_json::Value::Bool(true));
        let terminal = theirs
            .get("state")
            .and_then(|s| s.get("terminal"))
            .is_some_and(|t| !t.is_null());
        if cleared || terminal {
            return false;
        }
        self.tables
            .connection_if_any(p, conn)
            .is_some_and(|e| lock(&e).state.terminal.is_some())
    }
}

#[cfg(test)]
mod tests {
    use crate::engine::state::{conn_key, lock, ConnEntry};
    use crate::engine::testing::{engine_with, T0};
    use crate::policy::cooldown::Eligibility;
    use crate::store::{Change, MemoryStore, StateStore, StoreWriter, Table};
    use std::sync::Arc;
    use std::time::Duration;

    const YAML: &str = "providers:\n  - id: p\n    base_url: \"http://127.0.0.1:9\"\n    api: openai\n    connections: [ { id: c }, { id: d } ]\nmodels:\n  - name: m\n    targets: [ { provider: p, model: u } ]\n";

    #[test]
    fn a_remote_cooldown_is_not_raised_by_attempts_dispatched_before_it_was_learnt() {
        use crate::config::ProviderClass;
        use crate::policy::cooldown::{CooldownConfig, Failure};
        use crate::policy::Reason;
        let engine = engine_with(YAML, None);
        // Another node set it 200 ms before this node read it.
        let mut theirs = ConnEntry::default();
        theirs.state.cooled_until = T0 + 60_000;
        theirs.state.cooldown_set_at = T0 - 200;
        theirs.state.backoff_level = 1;
        let n = engine.absorb_remote(vec![Change::upsert(
            Table::Connections,
            conn_key("p", "c"),
            serde_json::to_value(&theirs).unwrap(),
        )]);
        assert_eq!(n, 1);
        let entry = engine.tables.connection_if_any("p", "c").expect("entry");
        let mut e = lock(&entry);
        // This node's attempt went out 100 ms before: after the other node's cooldown,
        // before this node knew of it. Its 429 is the same episode.
        let late = Failure {
            attempt_started: T0 - 100,
            reason: Reason::RateLimitExceeded,
            status: Some(429),
            hint: None,
            rule_cooldown: None,
            terminal: None,
            message: "rate limited",
        };
        let effect = e.state.record_failure(
            &late,
            &CooldownConfig::defaults(ProviderClass::ApiKey),
            T0 + 10,
        );
        assert!(effect.ignored_as_stale, "{effect:?}");
        assert_eq!(e.state.backoff_level, 1);
        // One dispatched after it was learnt counts again.
        let after = Failure {
            attempt_started: T0 + 5,
            ..late
        };
        let effect = e.state.record_failure(
            &after,
            &CooldownConfig::defaults(ProviderClass::ApiKey),
            T0 + 20,
        );
        assert!(
            !effect.ignored_as_stale && effect.raised_level,
            "{effect:?}"
        );
    }

    #[tokio::test]
    async fn a_forwarded_cooldown_cools_here_and_every_change_is_stored() {
        let store = Arc::new(MemoryStore::new());
        let writer = StoreWriter::spawn(store.clone(), Duration::from_secs(3600));
        let engine = engine_with(YAML, Some(writer.clone()));
        let mut cooling = ConnEntry::default();
        cooling.state.cooled_until = T0 + 60_000;
        cooling.state.last_status = Some(429);
        let batch = vec![
            Change::upsert(
                Table::Connections,
                conn_key("p", "c"),
                serde_json::to_value(&cooling).unwrap(),
            ),
            Change::delete(Table::Leases, "some-session"),
        ];
        assert_eq!(engine.absorb_forwarded(batch), 1);
        // An older, milder state from the predecessor does not undo ours.
        let mut milder = ConnEntry::default();
        milder.state.cooled_until = T0 + 1_000;
        let stale = vec![Change::upsert(
            Table::Connections,
            conn_key("p", "c"),
            serde_json::to_value(&milder).unwrap(),
        )];
        assert_eq!(engine.absorb_forwarded(stale), 0);
        let entry = engine.tables.connection_if_any("p", "c").expect("entry");
        assert_eq!(
            lock(&entry).state.eligibility(T0),
            Eligibility::Cooling { until: T0 + 60_000 }
        );
        assert!(engine
            .tables
            .connection_if_any("p", "d")
            .is_none_or(|e| { lock(&e).state.eligibility(T0) == Eligibility::Eligible }));
        writer.flush().await.unwrap();
        let image = store.load().unwrap();
        assert_eq!(
            image[&Table::Connections][&conn_key("p", "c")]["state"]["last_status"],
            429
        );
    }
}
