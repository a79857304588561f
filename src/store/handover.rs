//! State changes forwarded from a draining process to its successor (SPEC §8.1 upgrade).
//!
//! What it protects: updates the old process makes after it released the store file to
//! the new one (a 429 that cools a key, a breaker failure, a pin) during its drain. The
//! old process's writer is switched to an [`Outbox`], which writes each batch as one
//! file in the handover directory next to the store; the new process reads them with
//! [`take_inbox`] and applies them to its own store and memory. Invariants: a batch file
//! appears whole or not at all (written under a temporary name, then renamed); batches
//! are read in the order they were written (names sort by time, pid, sequence); a file is
//! removed only after it was read and parsed; an unreadable one is moved aside with a
//! warning, never applied half.

use super::{empty_image, Change, Image, StateStore, StoreError, Table};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The handover directory of the store at `store_path`: `<file>.handover`.
pub fn dir_for(store_path: &Path) -> PathBuf {
    let mut name = store_path.as_os_str().to_owned();
    name.push(".handover");
    PathBuf::from(name)
}

/// A [`StateStore`] that forwards every batch to the handover directory.
pub struct Outbox {
    dir: PathBuf,
    seq: AtomicU64,
}

impl Outbox {
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            seq: AtomicU64::new(0),
        }
    }
}

impl StateStore for Outbox {
    /// The outbox holds nothing to load: its batches belong to the next process.
    fn load(&self) -> Result<Image, StoreError> {
        Ok(empty_image())
    }

    fn apply(&self, changes: &[Change]) -> Result<(), StoreError> {
        if changes.is_empty() {
            return Ok(());
        }
        let io = |e: std::io::Error| StoreError::Io(format!("{}: {e}", self.dir.display()));
        std::fs::create_dir_all(&self.dir).map_err(io)?;
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        // Names sort by time, then writer and sequence: the order batches were written,
        // also across processes (pids do not grow with time).
        let name = format!(
            "{:013}-{:010}-{n:08}.json",
            crate::clock::unix_ms(),
            std::process::id()
        );
        let rows: Vec<Value> = changes
            .iter()
            .map(|c| json!({"table": c.table.as_str(), "key": c.key, "value": c.value}))
            .collect();
        let text = serde_json::to_vec(&rows).map_err(|e| StoreError::Io(e.to_string()))?;
        let tmp = self.dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).map_err(io)?;
        std::fs::rename(&tmp, self.dir.join(name)).map_err(io)
    }
}

/// Reads, parses and removes every complete batch file in `dir`, oldest first. A file
/// that does not parse is renamed to `*.bad` and reported in the log.
pub fn take_inbox(dir: &Path) -> Vec<Vec<Change>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension().is_some_and(|x| x == "json")
                && !p
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    names.sort();
    let mut batches = Vec::new();
    for path in names {
        let parsed = std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| parse_batch(&b));
        match parsed {
            Ok(batch) => {
                let _ = std::fs::remove_file(&path);
                batches.push(batch);
            }
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "state handover: unreadable batch moved aside");
                let _ = std::fs::rename(&path, path.with_extension("bad"));
            }
        }
    }
    batches
}

fn parse_batch(bytes: &[u8]) -> Result<Vec<Change>, String> {
    let rows: Vec<Value> = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    rows.into_iter()
        .map(|r| {
            let name = r["table"].as_str().unwrap_or_default();
            let table = Table::ALL
                .into_iter()
                .find(|t| t.as_str() == name)
                .ok_or_else(|| format!("unknown table {name:?}"))?;
            let key = r["key"].as_str().ok_or("a row without a key")?.to_owned();
            let value = match &r["value"] {
                Value::Null => None,
                v => Some(v.clone()),
            };
            Ok(Change { table, key, value })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("sluice-handover-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn batches_arrive_whole_in_order_and_once() {
        let dir = temp("order");
        let out = Outbox::new(dir.clone());
        out.apply(&[Change::upsert(Table::Pins, "a", json!({"x": 1}))])
            .unwrap();
        out.apply(&[
            Change::delete(Table::Leases, "s"),
            Change::upsert(Table::Connections, "p/c", json!(2)),
        ])
        .unwrap();
        out.apply(&[]).unwrap();
        let got = take_inbox(&dir);
        assert_eq!(got.len(), 2);
        assert_eq!(
            got[0],
            vec![Change::upsert(Table::Pins, "a", json!({"x": 1}))]
        );
        assert_eq!(
            got[1],
            vec![
                Change::delete(Table::Leases, "s"),
                Change::upsert(Table::Connections, "p/c", json!(2))
            ]
        );
        assert!(take_inbox(&dir).is_empty(), "a batch is taken once");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_broken_batch_is_moved_aside_and_the_rest_still_arrive() {
        let dir = temp("broken");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("0000000001-00000000.json"),
            b"[{\"table\": \"pins\"",
        )
        .unwrap();
        std::fs::write(dir.join(".0000000001-00000001.json.tmp"), b"half").unwrap();
        Outbox::new(dir.clone())
            .apply(&[Change::upsert(Table::Breakers, "p", json!(1))])
            .unwrap();
        let got = take_inbox(&dir);
        assert_eq!(
            got,
            vec![vec![Change::upsert(Table::Breakers, "p", json!(1))]]
        );
        assert!(dir.join("0000000001-00000000.bad").exists());
        assert!(
            dir.join(".0000000001-00000001.json.tmp").exists(),
            "a file being written is left alone"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_directory_sits_next_to_the_store() {
        assert_eq!(
            dir_for(Path::new("/var/lib/sluice/state.redb")),
            PathBuf::from("/var/lib/sluice/state.redb.handover")
        );
    }
}
