//! The exclusive-lease table as the select phase reads it (SPEC §5.6).
//!
//! Every selection asks whether another client's lease holds a connection. Taking the
//! table's lock for that wrote a line both client workers share on every request, though
//! most deployments hold no lease at all. The table therefore says, without its lock,
//! whether it holds any lease (live or not yet dropped): each change is made through
//! [`Leases::lock`], whose guard updates the flag before the lock is released.
//! Invariant: when [`Leases::any`] is false the table is empty, as of the last change;
//! a reader that sees `false` and skips the table could equally have taken the lock just
//! before the lease that follows was granted.

use super::state::lock;
use crate::policy::lease::LeaseTable;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

#[derive(Default)]
pub struct Leases {
    table: Mutex<LeaseTable>,
    any: AtomicBool,
}

impl Leases {
    /// The table, locked; the flag follows the table when the guard drops.
    pub fn lock(&self) -> LeasesGuard<'_> {
        LeasesGuard {
            table: lock(&self.table),
            any: &self.any,
        }
    }

    /// Whether the table holds any lease (read without the lock).
    pub fn any(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }
}

pub struct LeasesGuard<'a> {
    table: MutexGuard<'a, LeaseTable>,
    any: &'a AtomicBool,
}

impl Deref for LeasesGuard<'_> {
    type Target = LeaseTable;
    fn deref(&self) -> &LeaseTable {
        &self.table
    }
}

impl DerefMut for LeasesGuard<'_> {
    fn deref_mut(&mut self) -> &mut LeaseTable {
        &mut self.table
    }
}

impl Drop for LeasesGuard<'_> {
    fn drop(&mut self) {
        let any = !self.table.is_empty();
        // Written only when it changes: readers keep the line shared.
        if self.any.load(Ordering::Relaxed) != any {
            self.any.store(any, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Leases;
    use crate::policy::lease::{Lease, LeaseTable};

    #[test]
    fn the_flag_follows_every_change_made_through_the_lock() {
        let leases = Leases::default();
        assert!(!leases.any());
        let mut restored = LeaseTable::new();
        let lease = Lease {
            owner_hash: "o".into(),
            client: "c".into(),
            connection: "p/c".into(),
            generation: 1,
            expires_at: 10,
            created_at: 0,
        };
        restored.mirror(lease, 0);
        *leases.lock() = restored;
        assert!(leases.any());
        assert!(leases.lock().forget("o"));
        assert!(!leases.any());
    }
}
