//! In-memory [`StateStore`]: for tests and for running without persistence.
//!
//! It protects the same contract as the on-disk store, minus durability: a batch applies
//! atomically (under one lock, so a concurrent `load` sees all of it or none of it), the
//! last change to a key wins, and `load` returns every table. Nothing survives the
//! process, by design.

use std::sync::{Mutex, MutexGuard, PoisonError};

use super::{empty_image, Change, Image, StateStore, StoreError};

/// A [`StateStore`] that keeps everything in a mutex-guarded [`Image`].
#[derive(Debug)]
pub struct MemoryStore {
    image: Mutex<Image>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::with_image(Image::new())
    }

    /// A store pre-filled with `image` (tables it lacks start empty).
    pub fn with_image(image: Image) -> Self {
        let mut full = empty_image();
        for (table, entries) in image {
            full.insert(table, entries);
        }
        Self {
            image: Mutex::new(full),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Image> {
        // Map inserts and removes cannot stop halfway, so a lock poisoned by a panic
        // elsewhere still guards a coherent image: keep serving it.
        self.image.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl StateStore for MemoryStore {
    fn load(&self) -> Result<Image, StoreError> {
        Ok(self.lock().clone())
    }

    fn apply(&self, changes: &[Change]) -> Result<(), StoreError> {
        let mut image = self.lock();
        for change in changes {
            let table = image.entry(change.table).or_default();
            match &change.value {
                Some(value) => {
                    table.insert(change.key.clone(), value.clone());
                }
                None => {
                    table.remove(&change.key);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Table;
    use serde_json::json;

    #[test]
    fn upsert_then_delete_round_trips_in_every_table() {
        let store = MemoryStore::new();
        let ups: Vec<Change> = Table::ALL
            .iter()
            .map(|t| Change::upsert(*t, "k", json!({ "t": t.as_str() })))
            .collect();
        store.apply(&ups).unwrap();
        let img = store.load().unwrap();
        for t in Table::ALL {
            assert_eq!(img[&t]["k"], json!({ "t": t.as_str() }));
        }
        let dels: Vec<Change> = Table::ALL.iter().map(|t| Change::delete(*t, "k")).collect();
        store.apply(&dels).unwrap();
        let img = store.load().unwrap();
        assert_eq!(img.len(), Table::ALL.len());
        assert!(img.values().all(|m| m.is_empty()));
    }

    #[test]
    fn last_change_to_a_key_wins_within_a_batch() {
        let store = MemoryStore::new();
        store
            .apply(&[
                Change::upsert(Table::Pins, "s", json!(1)),
                Change::delete(Table::Pins, "s"),
                Change::upsert(Table::Pins, "s", json!(3)),
            ])
            .unwrap();
        assert_eq!(store.load().unwrap()[&Table::Pins]["s"], json!(3));
    }
}
