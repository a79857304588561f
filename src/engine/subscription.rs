//! The engine's side of the Claude subscription lane (SPEC §5.13): one connection's
//! `SubState`, read on the request path and changed under its entry's lock.
//!
//! It protects the lane's memory the way cooldowns are protected: the state sits in
//! the connection's entry, every change is handed to the batched store writer as the
//! whole connection row (so it survives a restart and, with `state.backend: redis`,
//! reaches the other nodes), and nothing here waits on the store. Connections without
//! `subscription:` never take the lock here.

use super::state::{change, conn_key, lock};
use super::{Engine, Pick, Snapshot};
use crate::policy::subscription::SubState;
use crate::store::Table;

impl Engine {
    /// Whether the attempt goes on the connection's low-priority lane (slow header).
    pub fn lane_active(&self, snap: &Snapshot, pick: Pick) -> bool {
        let conn = &snap.config.providers[pick.provider].connections[pick.connection];
        if !conn.subscription.as_ref().is_some_and(|s| s.low_priority) {
            return false;
        }
        let entry = snap.conn_entry(&self.tables, pick.provider, pick.connection);
        let active = lock(entry).subscription.lane_active(self.now());
        active
    }

    /// Applies `f` to the connection's subscription state; a change is persisted.
    pub fn with_subscription<R>(
        &self,
        snap: &Snapshot,
        pick: Pick,
        f: impl FnOnce(&mut SubState) -> R,
    ) -> R {
        let entry = snap.conn_entry(&self.tables, pick.provider, pick.connection);
        let mut e = lock(entry);
        let before = e.subscription;
        let r = f(&mut e.subscription);
        if e.subscription != before {
            let p = &snap.config.providers[pick.provider];
            let key = conn_key(&p.id, &p.connections[pick.connection].id);
            let row = change(Table::Connections, &key, Some(&*e));
            // Under the lock: a row of a concurrent `record` must not be queued after
            // this one with an older view (`submit` never blocks).
            if let Some(store) = &self.store {
                store.submit(vec![row]);
            }
            drop(e);
        }
        r
    }

    /// Counts one `sluice_subscription_events_total{event}`.
    pub fn subscription_event(&self, event: &'static str) {
        self.metrics
            .subscription_events_total
            .with_label_values(&[event])
            .inc();
    }
}
