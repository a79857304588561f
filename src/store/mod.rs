//! The state store: a generic, table-grouped key → JSON persistence seam (SPEC §7).
//!
//! It protects the resilience state that must survive a restart (breakers, cooldowns,
//! lockouts, pins, leases, overrides) without knowing what any of it means: the engine
//! decides what to store, this module only keeps it. Invariants: every backend applies a
//! batch of changes atomically and durably before `apply` returns, `load` returns an entry
//! for every [`Table`] (possibly empty) and only values that are valid JSON, and nothing
//! here ever deletes a store file. Request paths never call a [`StateStore`] directly: they
//! go through [`StoreWriter`], which batches commits on its own thread. This module does
//! not expire entries; dropping expired state on load is the engine's job.

pub mod handover;
mod memory;
mod redb;
pub(crate) mod redis;
mod writer;

use std::collections::BTreeMap;
use std::path::PathBuf;

pub use self::memory::MemoryStore;
pub use self::redb::RedbStore;
pub use self::redis::{place_of, RedisStore};
pub use self::writer::{CommitWait, StoreWriter};

/// The tables Sluice persists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Table {
    Breakers,
    Connections,
    Lockouts,
    Pins,
    Leases,
    Overrides,
}

impl Table {
    /// Every table, in a stable order.
    pub const ALL: [Table; 6] = [
        Table::Breakers,
        Table::Connections,
        Table::Lockouts,
        Table::Pins,
        Table::Leases,
        Table::Overrides,
    ];

    /// The table's stable name, as stored on disk: renaming one orphans its data.
    pub fn as_str(self) -> &'static str {
        match self {
            Table::Breakers => "breakers",
            Table::Connections => "connections",
            Table::Lockouts => "lockouts",
            Table::Pins => "pins",
            Table::Leases => "leases",
            Table::Overrides => "overrides",
        }
    }
}

impl std::fmt::Display for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One change: upsert (`Some`) or delete (`None`).
#[derive(Clone, Debug, PartialEq)]
pub struct Change {
    pub table: Table,
    pub key: String,
    pub value: Option<serde_json::Value>,
}

impl Change {
    /// Insert or replace `key` in `table`.
    pub fn upsert(table: Table, key: impl Into<String>, value: serde_json::Value) -> Self {
        Self {
            table,
            key: key.into(),
            value: Some(value),
        }
    }

    /// Remove `key` from `table` (a no-op when it is absent).
    pub fn delete(table: Table, key: impl Into<String>) -> Self {
        Self {
            table,
            key: key.into(),
            value: None,
        }
    }
}

/// Everything in the store, for start-up loading.
pub type Image = BTreeMap<Table, BTreeMap<String, serde_json::Value>>;

/// An image with an empty map for every table.
pub fn empty_image() -> Image {
    Table::ALL.iter().map(|t| (*t, BTreeMap::new())).collect()
}

/// Why the store could not be opened, read or written.
///
/// Messages are meant for an operator: they name the file and say what to do. They never
/// contain stored keys or values (a key may identify a client session).
#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    /// The store could not be opened for a reason that moving the file aside would not
    /// fix (its directory cannot be created, another process holds it open).
    #[error("cannot open state store {}: {message}", path.display())]
    Open { path: PathBuf, message: String },
    /// The file is not a readable Sluice store; `--reset-state` moves it aside.
    #[error(
        "state store {} is corrupt or unreadable: {detail}. Sluice will not start on it; \
         fix it, or start with --reset-state to move it aside (renamed to \
         <path>.corrupt-<unix-seconds>, never deleted) and begin with empty state",
        path.display()
    )]
    Corrupt { path: PathBuf, detail: String },
    /// Reading or committing failed after the store was opened.
    #[error("state store I/O failed: {0}")]
    Io(String),
    /// A value could not be encoded for storage.
    #[error("state value cannot be encoded: {0}")]
    Encode(String),
    /// The writer has stopped; nothing more will be committed through it.
    #[error("state writer has stopped")]
    Closed,
}

impl StoreError {
    /// Short, bounded label for logs and metrics.
    pub fn label(&self) -> &'static str {
        match self {
            StoreError::Open { .. } => "open",
            StoreError::Corrupt { .. } => "corrupt",
            StoreError::Io(_) => "io",
            StoreError::Encode(_) => "encode",
            StoreError::Closed => "closed",
        }
    }
}

/// The one seam behind which redb sits, so a shared backend (Redis) can replace it
/// without touching the layers.
pub trait StateStore: Send + Sync + 'static {
    /// Everything stored, with an entry for every [`Table`]. Every value is validated.
    fn load(&self) -> Result<Image, StoreError>;
    /// Applies all changes in one transaction (atomically) and makes them durable.
    /// Changes to the same key apply in order, so the last one wins.
    fn apply(&self, changes: &[Change]) -> Result<(), StoreError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_distinct_and_stable() {
        let names: std::collections::BTreeSet<&str> =
            Table::ALL.iter().map(|t| t.as_str()).collect();
        assert_eq!(names.len(), Table::ALL.len());
        assert_eq!(Table::Breakers.as_str(), "breakers");
        assert_eq!(Table::Overrides.to_string(), "overrides");
    }

    #[test]
    fn corrupt_error_names_path_and_reset_flag() {
        let e = StoreError::Corrupt {
            path: PathBuf::from("/var/lib/sluice/state.redb"),
            detail: "not a redb file".into(),
        };
        let msg = e.to_string();
        assert!(msg.contains("/var/lib/sluice/state.redb"), "{msg}");
        assert!(msg.contains("--reset-state"), "{msg}");
        assert_eq!(e.label(), "corrupt");
    }

    #[test]
    fn empty_image_has_every_table() {
        let img = empty_image();
        assert_eq!(img.len(), Table::ALL.len());
        assert!(img.values().all(|m| m.is_empty()));
    }
}
