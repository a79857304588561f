//! Taking in the state a draining predecessor forwarded after it released the store
//! (SPEC §8.1 upgrade; the files themselves are `store::handover`'s).
//!
//! Invariants: every forwarded change reaches this process's store (through the
//! writer, like any other change); breaker, connection, lockout and pin upserts also
//! reach memory, entry by entry, so the cooling key the old process saw is cooling here
//! too. Deletes and lease rows only reach the store: this process has been serving
//! since the handover and its own view of those is the newer one.

use super::Engine;
use crate::store::{empty_image, Change, Table};

impl Engine {
    /// Applies one forwarded batch; returns how many entries reached memory.
    pub fn absorb_forwarded(&self, batch: Vec<Change>) -> usize {
        let now = self.now();
        let mut image = empty_image();
        for c in &batch {
            if let (Some(v), Table::Breakers | Table::Connections | Table::Lockouts | Table::Pins) =
                (&c.value, c.table)
            {
                if let Some(rows) = image.get_mut(&c.table) {
                    rows.insert(c.key.clone(), v.clone());
                }
            }
        }
        let mut n = self.tables.restore(&image, now);
        if let Some(rows) = image.get(&Table::Pins) {
            let mut pins = super::state::lock(&self.pins);
            for (k, v) in rows {
                if let Ok(pin) = serde_json::from_value(v.clone()) {
                    n += usize::from(pins.insert_restored(k.clone(), pin, now));
                }
            }
        }
        if let Some(w) = &self.store {
            w.submit(batch);
        }
        n
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
