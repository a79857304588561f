//! The state store as an operator sees it: what survives a restart or a crash, what a
//! corrupt file does to start-up, and what the batched writer promises request paths.

// Integration tests: a failed unwrap is a failed test, and they time the real binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sluice::store::{
    Change, Image, MemoryStore, RedbStore, StateStore, StoreError, StoreWriter, Table,
};

/// A unique directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "sluice-store-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn file(&self) -> PathBuf {
        self.0.join("state.redb")
    }

    fn corrupt_copies(&self) -> Vec<PathBuf> {
        std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().contains("state.redb.corrupt-"))
            .collect()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn value(image: &Image, table: Table, key: &str) -> Option<Value> {
    image.get(&table).and_then(|t| t.get(key)).cloned()
}

fn assert_empty(image: &Image) {
    assert_eq!(image.len(), Table::ALL.len(), "every table is present");
    assert!(image.values().all(|t| t.is_empty()), "{image:?}");
}

/// Waits (bounded) until `cond` holds.
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Records every batch it is asked to apply.
#[derive(Default)]
struct Recording {
    inner: MemoryStore,
    batches: Mutex<Vec<Vec<Change>>>,
}

impl StateStore for Recording {
    fn load(&self) -> Result<Image, StoreError> {
        self.inner.load()
    }
    fn apply(&self, changes: &[Change]) -> Result<(), StoreError> {
        self.batches.lock().unwrap().push(changes.to_vec());
        self.inner.apply(changes)
    }
}

// ---------------------------------------------------------------- stores

fn round_trip(store: &dyn StateStore) {
    let upserts: Vec<Change> = Table::ALL
        .iter()
        .flat_map(|t| {
            [
                Change::upsert(*t, "a", json!({ "table": t.as_str(), "n": 1 })),
                Change::upsert(*t, "b", json!([1, "two", null])),
            ]
        })
        .collect();
    store.apply(&upserts).unwrap();
    let image = store.load().unwrap();
    for t in Table::ALL {
        assert_eq!(
            value(&image, t, "a"),
            Some(json!({ "table": t.as_str(), "n": 1 }))
        );
        assert_eq!(value(&image, t, "b"), Some(json!([1, "two", null])));
    }
    let deletes: Vec<Change> = Table::ALL
        .iter()
        .flat_map(|t| [Change::delete(*t, "a"), Change::delete(*t, "missing")])
        .collect();
    store.apply(&deletes).unwrap();
    let image = store.load().unwrap();
    for t in Table::ALL {
        assert_eq!(value(&image, t, "a"), None);
        assert_eq!(image[&t].len(), 1, "only `b` is left in {t}");
    }
}

#[test]
fn memory_store_round_trips_every_table() {
    round_trip(&MemoryStore::new());
}

#[test]
fn redb_store_round_trips_every_table_and_survives_reopen() {
    let dir = TempDir::new();
    let store = RedbStore::open(&dir.file(), false).unwrap();
    assert_eq!(store.path(), dir.file());
    assert_empty(&store.load().unwrap());
    round_trip(&store);
    let before = store.load().unwrap();
    drop(store);

    let reopened = RedbStore::open(&dir.file(), false).unwrap();
    assert_eq!(reopened.load().unwrap(), before);
    assert!(reopened.moved_aside().is_none());
    // Last change to a key within one batch wins, also on disk.
    reopened
        .apply(&[
            Change::upsert(Table::Pins, "s", json!(1)),
            Change::delete(Table::Pins, "s"),
            Change::upsert(Table::Pins, "s", json!(3)),
        ])
        .unwrap();
    drop(reopened);
    let again = RedbStore::open(&dir.file(), false).unwrap();
    assert_eq!(
        value(&again.load().unwrap(), Table::Pins, "s"),
        Some(json!(3))
    );
}

/// A concurrent reader sees each batch entirely or not at all.
fn batches_are_atomic(store: Arc<dyn StateStore>) {
    const KEYS: usize = 8;
    const ROUNDS: u64 = 150;
    let writer = {
        let store = Arc::clone(&store);
        std::thread::spawn(move || {
            for round in 1..=ROUNDS {
                let batch: Vec<Change> = (0..KEYS)
                    .map(|k| {
                        let table = Table::ALL[k % Table::ALL.len()];
                        Change::upsert(table, format!("k{k}"), json!(round))
                    })
                    .collect();
                store.apply(&batch).unwrap();
            }
        })
    };
    loop {
        let finished = writer.is_finished();
        let image = store.load().unwrap();
        let rounds: Vec<Option<Value>> = (0..KEYS)
            .map(|k| value(&image, Table::ALL[k % Table::ALL.len()], &format!("k{k}")))
            .collect();
        assert!(
            rounds.windows(2).all(|w| w[0] == w[1]),
            "a load saw a half-applied batch: {rounds:?}"
        );
        if finished {
            assert_eq!(rounds[0], Some(json!(ROUNDS)));
            break;
        }
    }
    writer.join().unwrap();
}

#[test]
fn memory_store_batches_are_atomic() {
    batches_are_atomic(Arc::new(MemoryStore::new()));
}

#[test]
fn redb_store_batches_are_atomic() {
    let dir = TempDir::new();
    batches_are_atomic(Arc::new(RedbStore::open(&dir.file(), false).unwrap()));
}

#[test]
fn a_healthy_store_is_kept_even_with_reset() {
    let dir = TempDir::new();
    let store = RedbStore::open(&dir.file(), false).unwrap();
    store
        .apply(&[Change::upsert(Table::Overrides, "x", json!(true))])
        .unwrap();
    drop(store);
    let store = RedbStore::open(&dir.file(), true).unwrap();
    assert!(store.moved_aside().is_none());
    assert!(dir.corrupt_copies().is_empty());
    assert_eq!(
        value(&store.load().unwrap(), Table::Overrides, "x"),
        Some(json!(true))
    );
}

// ---------------------------------------------------------------- corruption

fn assert_refused(path: &Path, err: &StoreError) {
    let msg = err.to_string();
    assert_eq!(err.label(), "corrupt", "{msg}");
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("--reset-state"), "{msg}");
}

/// With `reset`, the bad file is renamed aside byte for byte and a fresh store opens.
fn assert_reset_moves_aside(dir: &TempDir, original: &[u8]) {
    let path = dir.file();
    let store = RedbStore::open(&path, true).unwrap();
    assert_empty(&store.load().unwrap());
    let aside = store.moved_aside().unwrap().to_path_buf();
    assert_eq!(dir.corrupt_copies(), vec![aside.clone()]);
    assert!(
        std::fs::read(&aside).unwrap() == original,
        "kept byte for byte"
    );
    // The fresh store is usable and durable.
    store
        .apply(&[Change::upsert(Table::Leases, "l", json!(1))])
        .unwrap();
    drop(store);
    let store = RedbStore::open(&path, false).unwrap();
    assert_eq!(
        value(&store.load().unwrap(), Table::Leases, "l"),
        Some(json!(1))
    );
}

#[test]
fn a_garbage_file_is_refused_then_moved_aside_with_reset() {
    let dir = TempDir::new();
    let garbage: Vec<u8> = (0..10_000u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 7) as u8)
        .collect();
    std::fs::write(dir.file(), &garbage).unwrap();

    let err = RedbStore::open(&dir.file(), false).unwrap_err();
    assert_refused(&dir.file(), &err);
    assert_eq!(
        std::fs::read(dir.file()).unwrap(),
        garbage,
        "left untouched"
    );
    assert!(dir.corrupt_copies().is_empty());

    assert_reset_moves_aside(&dir, &garbage);
}

#[test]
fn a_text_file_is_refused() {
    let dir = TempDir::new();
    std::fs::write(dir.file(), b"breakers:\n  openai: open\n").unwrap();
    assert_refused(
        &dir.file(),
        &RedbStore::open(&dir.file(), false).unwrap_err(),
    );
}

#[test]
fn a_truncated_store_is_refused() {
    let dir = TempDir::new();
    let store = RedbStore::open(&dir.file(), false).unwrap();
    let big: Vec<Change> = (0..2000)
        .map(|i| Change::upsert(Table::Connections, format!("c{i}"), json!({ "level": i })))
        .collect();
    store.apply(&big).unwrap();
    drop(store);
    let bytes = std::fs::read(dir.file()).unwrap();
    let truncated = &bytes[..bytes.len() / 3];
    std::fs::write(dir.file(), truncated).unwrap();

    match RedbStore::open(&dir.file(), false) {
        Err(err) => {
            assert_refused(&dir.file(), &err);
            assert_reset_moves_aside(&dir, truncated);
        }
        // redb may repair a torn tail on its own; then every value must still be sound.
        Ok(store) => {
            let image = store.load().unwrap();
            assert!(image[&Table::Connections].len() <= 2000);
        }
    }
}

#[test]
fn a_value_that_is_not_json_is_detected_at_open() {
    let dir = TempDir::new();
    let store = RedbStore::open(&dir.file(), false).unwrap();
    store
        .apply(&[Change::upsert(Table::Pins, "good", json!("fine"))])
        .unwrap();
    drop(store);
    {
        // Write a bad value behind the store's back, as a bug or a bit flip would.
        let db = redb::Database::create(dir.file()).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let def: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("pins");
            let mut table = txn.open_table(def).unwrap();
            table.insert("bad", b"{\"half\": ".as_slice()).unwrap();
        }
        txn.commit().unwrap();
    }
    let original = std::fs::read(dir.file()).unwrap();
    let err = RedbStore::open(&dir.file(), false).unwrap_err();
    assert_refused(&dir.file(), &err);
    let msg = err.to_string();
    assert!(
        msg.contains("pins") && msg.contains("not valid JSON"),
        "{msg}"
    );
    assert!(!msg.contains("bad"), "keys stay out of messages: {msg}");

    assert_reset_moves_aside(&dir, &original);
}

#[test]
fn a_table_of_another_type_is_refused() {
    let dir = TempDir::new();
    {
        let db = redb::Database::create(dir.file()).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let def: redb::TableDefinition<u64, u64> = redb::TableDefinition::new("leases");
            txn.open_table(def).unwrap().insert(1, 2).unwrap();
        }
        txn.commit().unwrap();
    }
    assert_refused(
        &dir.file(),
        &RedbStore::open(&dir.file(), false).unwrap_err(),
    );
}

#[test]
fn an_unreadable_file_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new();
    drop(RedbStore::open(&dir.file(), false).unwrap());
    std::fs::set_permissions(dir.file(), std::fs::Permissions::from_mode(0o000)).unwrap();
    if std::fs::File::open(dir.file()).is_ok() {
        // Running as root: permissions do not stop us, nothing to observe.
        return;
    }
    assert_refused(
        &dir.file(),
        &RedbStore::open(&dir.file(), false).unwrap_err(),
    );
}

#[test]
fn flipped_bytes_never_panic_the_caller() {
    let dir = TempDir::new();
    let store = RedbStore::open(&dir.file(), false).unwrap();
    let rows: Vec<Change> = (0..300)
        .map(|i| Change::upsert(Table::Breakers, format!("p{i}"), json!({ "state": "open" })))
        .collect();
    store.apply(&rows).unwrap();
    drop(store);
    let pristine = std::fs::read(dir.file()).unwrap();
    // Flip bytes inside every 4 KiB page that holds something: headers, tree pages, data.
    let used_pages = (0..pristine.len()).step_by(4096).filter(|start| {
        let page = &pristine[*start..(*start + 4096).min(pristine.len())];
        page.iter().any(|b| *b != 0 && *b != 0xFF)
    });
    let mut refused = 0;
    for (n, offset) in used_pages.map(|p| p + 1000).enumerate() {
        let mut bytes = pristine.clone();
        for b in bytes.iter_mut().skip(offset).take(64) {
            *b ^= 0xA5;
        }
        std::fs::write(dir.file(), &bytes).unwrap();
        // Either a clean refusal or a store whose every value is sound: never a panic.
        match RedbStore::open(&dir.file(), false) {
            Err(err) => {
                assert_refused(&dir.file(), &err);
                refused += 1;
            }
            Ok(store) => {
                store
                    .load()
                    .unwrap_or_else(|e| panic!("flip #{n} at {offset}: {e}"));
            }
        }
    }
    assert!(refused > 0, "flipping the data pages was never noticed");
}

// ---------------------------------------------------------------- writer

#[tokio::test]
async fn the_writer_coalesces_a_burst_into_one_change() {
    let store = Arc::new(Recording::default());
    let writer = StoreWriter::spawn(store.clone(), Duration::from_secs(3600));
    for i in 0..1000 {
        writer.submit(vec![Change::upsert(Table::Connections, "c1", json!(i))]);
    }
    writer.flush().await.unwrap();
    let batches = store.batches.lock().unwrap().clone();
    assert_eq!(
        batches,
        vec![vec![Change::upsert(Table::Connections, "c1", json!(999))]]
    );
}

#[tokio::test]
async fn a_delete_after_an_upsert_wins() {
    let store = Arc::new(Recording::default());
    store
        .apply(&[Change::upsert(Table::Lockouts, "m", json!(1))])
        .unwrap();
    let writer = StoreWriter::spawn(store.clone(), Duration::from_secs(3600));
    writer.submit(vec![Change::upsert(Table::Lockouts, "m", json!(2))]);
    writer.submit(vec![Change::delete(Table::Lockouts, "m")]);
    writer.flush().await.unwrap();
    assert_eq!(value(&store.load().unwrap(), Table::Lockouts, "m"), None);
}

#[test]
fn submitted_changes_land_on_the_next_tick_without_being_asked() {
    let dir = TempDir::new();
    let store = Arc::new(RedbStore::open(&dir.file(), false).unwrap());
    let writer = StoreWriter::spawn_on_thread(store.clone(), Duration::from_millis(20)).unwrap();
    // From a plain thread with no runtime at all: submit must not need one.
    std::thread::scope(|s| {
        s.spawn(|| writer.submit(vec![Change::upsert(Table::Breakers, "p", json!("open"))]));
    });
    wait_for("the tick to commit", || {
        value(&store.load().unwrap(), Table::Breakers, "p") == Some(json!("open"))
    });
}

#[test]
fn commit_now_includes_everything_queued_before_it_from_any_runtime() {
    let store = Arc::new(Recording::default());
    let writer = StoreWriter::spawn_on_thread(store.clone(), Duration::from_secs(3600)).unwrap();
    writer.submit(vec![Change::upsert(Table::Pins, "earlier", json!(1))]);
    // Two independent runtimes, as Pingora services have.
    for (flavour, key) in [("current", "lease-a"), ("multi", "lease-b")] {
        let rt = match flavour {
            "current" => tokio::runtime::Builder::new_current_thread().build(),
            _ => tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .build(),
        }
        .unwrap();
        rt.block_on(writer.commit_now(vec![Change::upsert(Table::Leases, key, json!(key))]))
            .unwrap();
        let image = store.load().unwrap();
        assert_eq!(value(&image, Table::Pins, "earlier"), Some(json!(1)));
        assert_eq!(value(&image, Table::Leases, key), Some(json!(key)));
    }
    assert_eq!(
        store.batches.lock().unwrap().len(),
        2,
        "one commit each, no tick"
    );
}

#[tokio::test]
async fn concurrent_commit_nows_all_return_committed() {
    let store = Arc::new(Recording::default());
    let writer = StoreWriter::spawn(store.clone(), Duration::from_secs(3600));
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let writer = writer.clone();
            tokio::spawn(async move {
                writer
                    .commit_now(vec![Change::upsert(
                        Table::Leases,
                        format!("l{i}"),
                        json!(i),
                    )])
                    .await
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(store.load().unwrap()[&Table::Leases].len(), 50);
    assert!(store.batches.lock().unwrap().len() <= 50);
}

#[tokio::test]
async fn after_flush_the_file_can_be_reopened_with_everything_in_it() {
    let dir = TempDir::new();
    let store = Arc::new(RedbStore::open(&dir.file(), false).unwrap());
    let writer = StoreWriter::spawn(store.clone(), Duration::from_secs(3600));
    writer
        .commit_now(vec![Change::upsert(Table::Leases, "l", json!("owner-1"))])
        .await
        .unwrap();
    writer.submit(vec![Change::upsert(
        Table::Connections,
        "c",
        json!({ "cooldown": 5 }),
    )]);
    writer.flush().await.unwrap();
    assert!(writer.is_closed());
    assert_eq!(writer.flush().await.unwrap_err().label(), "closed");
    drop(store);

    let reopened = RedbStore::open(&dir.file(), false).unwrap();
    let image = reopened.load().unwrap();
    assert_eq!(value(&image, Table::Leases, "l"), Some(json!("owner-1")));
    assert_eq!(
        value(&image, Table::Connections, "c"),
        Some(json!({ "cooldown": 5 }))
    );
}

// ---------------------------------------------------------------- crash

const CHILD_ENV: &str = "SLUICE_STORE_CRASH_CHILD";

/// Runs only when re-executed by `commit_now_survives_a_crash`: commits, then dies
/// without any clean-up, as `kill -9` would.
#[test]
fn crash_child() {
    let Some(path) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let store = Arc::new(RedbStore::open(Path::new(&path), false).unwrap());
    let writer = StoreWriter::spawn_on_thread(store, Duration::from_secs(3600)).unwrap();
    writer.submit(vec![Change::upsert(Table::Connections, "before", json!(1))]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(writer.commit_now(vec![Change::upsert(Table::Leases, "lease", json!("mine"))]))
        .unwrap();
    // Queued but never flushed: the window a crash is allowed to lose.
    writer.submit(vec![Change::upsert(Table::Connections, "after", json!(2))]);
    std::process::abort();
}

#[test]
fn commit_now_survives_a_crash() {
    let dir = TempDir::new();
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, dir.file())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success(), "the child must die abruptly");

    let store = RedbStore::open(&dir.file(), false).unwrap();
    let image = store.load().unwrap();
    assert_eq!(value(&image, Table::Leases, "lease"), Some(json!("mine")));
    assert_eq!(value(&image, Table::Connections, "before"), Some(json!(1)));
    assert_eq!(value(&image, Table::Connections, "after"), None);
}
