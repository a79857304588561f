//! The embedded on-disk [`StateStore`], on redb (the only file that names redb).
//!
//! It protects the state file itself. Invariants: a batch commits in one redb write
//! transaction with immediate durability, so it is all on disk or none of it; opening
//! validates every stored value, so a corrupt file is refused at start, never discovered
//! mid-request; a corrupt or unreadable file is reported with its path and is never
//! deleted — with `reset` it is renamed to `<path>.corrupt-<unix-seconds>` and a fresh
//! store is created in its place. A file held open by another process is *not* treated
//! as corrupt (moving it aside would split the state between two gateways). Each table
//! maps a `&str` key to the JSON bytes of its value. Panics raised inside redb on
//! malformed bytes are contained and reported as corruption.

use std::ffi::OsString;
use std::io::ErrorKind;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use ::redb::{Database, ReadableTable, TableDefinition, TableError};

use super::{empty_image, Change, Image, StateStore, StoreError, Table};

type Def = TableDefinition<'static, &'static str, &'static [u8]>;

fn def(table: Table) -> Def {
    TableDefinition::new(table.as_str())
}

/// A [`StateStore`] in one redb file.
#[derive(Debug)]
pub struct RedbStore {
    db: Database,
    path: PathBuf,
    moved_aside: Option<PathBuf>,
}

impl RedbStore {
    /// Opens the store at `path`, creating its directory and the file when missing.
    ///
    /// A corrupt or unreadable file is an error naming the path, unless `reset` is true:
    /// then it is renamed aside (see [`RedbStore::moved_aside`]) and a fresh store is
    /// created. A healthy file is opened as is, whatever `reset` says.
    pub fn open(path: &Path, reset: bool) -> Result<RedbStore, StoreError> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| StoreError::Open {
                path: path.to_path_buf(),
                message: format!("cannot create directory {}: {e}", parent.display()),
            })?;
        }
        let (db, moved_aside) = match open_validated(path) {
            Ok(db) => (db, None),
            Err(err @ StoreError::Corrupt { .. }) if reset => {
                let aside = move_aside(path)?;
                tracing::warn!(
                    path = %path.display(),
                    moved_to = %aside.display(),
                    error = %err,
                    "--reset-state: moved the unusable state store aside; starting with empty state"
                );
                (open_validated(path)?, Some(aside))
            }
            Err(err) => return Err(err),
        };
        Ok(RedbStore {
            db,
            path: path.to_path_buf(),
            moved_aside,
        })
    }

    /// The store file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where `open` moved a corrupt file to, when it did.
    pub fn moved_aside(&self) -> Option<&Path> {
        self.moved_aside.as_deref()
    }

    fn io_error(&self, e: impl std::fmt::Display) -> StoreError {
        StoreError::Io(format!("{}: {e}", self.path.display()))
    }
}

impl StateStore for RedbStore {
    fn load(&self) -> Result<Image, StoreError> {
        guarded(&self.path, || read_image(&self.db, &self.path))
    }

    fn apply(&self, changes: &[Change]) -> Result<(), StoreError> {
        if changes.is_empty() {
            return Ok(());
        }
        // Encode before opening the transaction, so a bad value aborts nothing half-done.
        let mut encoded = Vec::with_capacity(changes.len());
        for change in changes {
            let bytes = match &change.value {
                Some(v) => {
                    Some(serde_json::to_vec(v).map_err(|e| StoreError::Encode(e.to_string()))?)
                }
                None => None,
            };
            encoded.push((change.table, change.key.as_str(), bytes));
        }
        guarded(&self.path, || {
            let txn = self.db.begin_write().map_err(|e| self.io_error(e))?;
            for table in Table::ALL {
                let mut batch = encoded.iter().filter(|(t, _, _)| *t == table).peekable();
                if batch.peek().is_none() {
                    continue;
                }
                let mut handle = txn.open_table(def(table)).map_err(|e| self.io_error(e))?;
                for (_, key, bytes) in batch {
                    match bytes {
                        Some(b) => {
                            handle
                                .insert(*key, b.as_slice())
                                .map_err(|e| self.io_error(e))?;
                        }
                        None => {
                            handle.remove(*key).map_err(|e| self.io_error(e))?;
                        }
                    }
                }
            }
            // Dropping `txn` on any early return above aborts it: nothing is half-applied.
            txn.commit().map_err(|e| self.io_error(e))
        })
    }
}

/// Opens (or creates) the file, makes sure every table exists, and reads every value
/// once so that corruption anywhere is found now.
fn open_validated(path: &Path) -> Result<Database, StoreError> {
    guarded(path, || {
        let db = Database::create(path).map_err(|e| classify(path, e.into()))?;
        // Validate before writing anything, so a refused file is left as we found it.
        let (_, complete) = read_tables(&db, path)?;
        if !complete {
            let txn = db.begin_write().map_err(|e| classify(path, e.into()))?;
            for table in Table::ALL {
                txn.open_table(def(table))
                    .map_err(|e| classify(path, e.into()))?;
            }
            txn.commit().map_err(|e| classify(path, e.into()))?;
        }
        Ok(db)
    })
}

fn read_image(db: &Database, path: &Path) -> Result<Image, StoreError> {
    read_tables(db, path).map(|(image, _)| image)
}

/// Reads and validates every table; also says whether they all exist already.
fn read_tables(db: &Database, path: &Path) -> Result<(Image, bool), StoreError> {
    let txn = db.begin_read().map_err(|e| classify(path, e.into()))?;
    let mut image = empty_image();
    let mut complete = true;
    for table in Table::ALL {
        let handle = match txn.open_table(def(table)) {
            Ok(handle) => handle,
            Err(TableError::TableDoesNotExist(_)) => {
                complete = false;
                continue;
            }
            Err(e) => return Err(classify(path, e.into())),
        };
        let entries = image.entry(table).or_default();
        for item in handle.iter().map_err(|e| classify(path, e.into()))? {
            let (key, value) = item.map_err(|e| classify(path, e.into()))?;
            // The key is deliberately left out of the message: it may name a session.
            let value = serde_json::from_slice(value.value()).map_err(|e| StoreError::Corrupt {
                path: path.to_path_buf(),
                detail: format!("a value in table `{table}` is not valid JSON ({e})"),
            })?;
            entries.insert(key.value().to_owned(), value);
        }
    }
    Ok((image, complete))
}

/// Sorts a redb failure into "moving the file aside would help" (corrupt or unreadable)
/// and "it would not" (the file is in use, the disk is full or read-only).
fn classify(path: &Path, err: ::redb::Error) -> StoreError {
    let environmental = match &err {
        ::redb::Error::DatabaseAlreadyOpen => true,
        ::redb::Error::Io(e) => matches!(
            e.kind(),
            ErrorKind::StorageFull
                | ErrorKind::ReadOnlyFilesystem
                | ErrorKind::OutOfMemory
                | ErrorKind::Interrupted
                | ErrorKind::WouldBlock
        ),
        _ => false,
    };
    if environmental {
        let message = match err {
            ::redb::Error::DatabaseAlreadyOpen => {
                "it is already open in another process (is another Sluice running?)".to_owned()
            }
            other => other.to_string(),
        };
        StoreError::Open {
            path: path.to_path_buf(),
            message,
        }
    } else {
        StoreError::Corrupt {
            path: path.to_path_buf(),
            detail: err.to_string(),
        }
    }
}

/// Runs `f`, turning a panic inside redb (it unwraps on some malformed bytes) into a
/// corruption report instead of taking the process down.
fn guarded<T>(path: &Path, f: impl FnOnce() -> Result<T, StoreError>) -> Result<T, StoreError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_owned());
        Err(StoreError::Corrupt {
            path: path.to_path_buf(),
            detail: format!("the storage engine failed while reading it ({what})"),
        })
    })
}

/// Renames `path` to `<path>.corrupt-<unix-seconds>` (with `-N` appended if that name is
/// taken, so an earlier casualty is never overwritten) and returns the new name.
fn move_aside(path: &Path) -> Result<PathBuf, StoreError> {
    let secs = crate::clock::unix_ms() / 1000;
    for attempt in 0..1000u32 {
        let mut name = OsString::from(path.as_os_str());
        name.push(format!(".corrupt-{secs}"));
        if attempt > 0 {
            name.push(format!("-{attempt}"));
        }
        let target = PathBuf::from(name);
        if std::fs::symlink_metadata(&target).is_ok() {
            continue;
        }
        return std::fs::rename(path, &target)
            .map(|()| target.clone())
            .map_err(|e| StoreError::Open {
                path: path.to_path_buf(),
                message: format!("cannot move it aside to {}: {e}", target.display()),
            });
    }
    Err(StoreError::Open {
        path: path.to_path_buf(),
        message: "cannot move it aside: too many earlier .corrupt-* files".to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn temp_dir() -> PathBuf {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "sluice-store-unit-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn creates_missing_directories_and_every_table() {
        let dir = temp_dir();
        let path = dir.join("a/b/state.redb");
        let store = RedbStore::open(&path, false).unwrap();
        assert!(path.exists());
        assert_eq!(store.load().unwrap(), empty_image());
        assert!(store.moved_aside().is_none());
        drop(store);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_second_handle_is_refused_but_not_treated_as_corrupt() {
        let dir = temp_dir();
        let path = dir.join("state.redb");
        let first = RedbStore::open(&path, false).unwrap();
        first
            .apply(&[Change::upsert(Table::Leases, "k", json!(1))])
            .unwrap();
        let err = RedbStore::open(&path, true).unwrap_err();
        assert_eq!(err.label(), "open", "{err}");
        // Nothing was moved aside and the data is intact.
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(names.len(), 1);
        assert_eq!(first.load().unwrap()[&Table::Leases]["k"], json!(1));
        drop(first);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn move_aside_never_overwrites_an_earlier_casualty() {
        let dir = temp_dir();
        let path = dir.join("state.redb");
        std::fs::write(&path, b"first").unwrap();
        let a = move_aside(&path).unwrap();
        std::fs::write(&path, b"second").unwrap();
        let b = move_aside(&path).unwrap();
        assert_ne!(a, b);
        assert_eq!(std::fs::read(&a).unwrap(), b"first");
        assert_eq!(std::fs::read(&b).unwrap(), b"second");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
