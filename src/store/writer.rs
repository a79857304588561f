//! The batched background writer: the only way request paths reach the [`StateStore`].
//!
//! It protects request latency from disk commits (SPEC §7, ARCHITECTURE §4). Invariants:
//! `submit` never blocks and never awaits, from any thread or runtime; pending changes are
//! coalesced by (table, key), last write wins, so memory is bounded by the number of
//! distinct keys even while the store is failing; queued changes commit at most one
//! `interval` late, in queue order, one `apply` per batch; `commit_now` returns only after
//! a commit that includes its changes and everything queued before them; a failed batch
//! is kept and retried on the next tick, never dropped. The blocking `apply` runs on the
//! writer's own thread (or a blocking-pool thread), never on a request runtime. It does
//! not decide what is worth persisting, nor read anything back: loading happens once, at
//! start, straight from the store.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::{Change, StateStore, StoreError, Table};

/// Most messages absorbed in one go before committing, so a flood of submits cannot hold
/// back an urgent commit or a tick for long.
const MAX_DRAIN: usize = 1024;

/// Consecutive failures between two repeated error logs (about 5 s at 100 ms ticks).
const LOG_EVERY: u32 = 50;

type Reply = oneshot::Sender<Result<(), StoreError>>;

enum Msg {
    Submit(Vec<Change>),
    Commit(Vec<Change>, Reply),
    Flush(Reply),
    /// Commit what is pending into the current store, then write to this one instead.
    Swap(Arc<dyn StateStore>, Reply),
}

/// A commit queued by [`StoreWriter::queue_commit`], to await outside any lock.
#[must_use = "await `wait` to learn whether the changes were committed"]
pub struct CommitWait {
    done: oneshot::Receiver<Result<(), StoreError>>,
    sent: bool,
}

impl CommitWait {
    /// Until the commit that includes the queued changes; same outcome as `commit_now`.
    pub async fn wait(self) -> Result<(), StoreError> {
        if !self.sent {
            return Err(StoreError::Closed);
        }
        self.done.await.map_err(|_| StoreError::Closed)?
    }
}

/// A callback told of every failed commit (the gateway counts them in a metric).
type FailureHook = Box<dyn Fn(&StoreError) + Send + Sync>;

/// How the writer's commits are going, shared between the loop and every handle.
#[derive(Default)]
struct Health {
    failed_commits: AtomicU64,
    consecutive_failures: AtomicU32,
    on_failure: OnceLock<FailureHook>,
}

/// What [`StoreWriter::health`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriterHealth {
    /// Failed commits since start (each retry of a failing batch counts).
    pub failed_commits: u64,
    /// Failed commits since the last one that succeeded (0 = healthy).
    pub consecutive_failures: u32,
    /// The writer has stopped: nothing more will be committed.
    pub closed: bool,
}

/// A handle to the background writer. Cheap to clone; the writer stops once `flush`
/// is called or every handle is dropped (after a last commit of what is pending).
#[derive(Clone)]
pub struct StoreWriter {
    tx: mpsc::UnboundedSender<Msg>,
    health: Arc<Health>,
}

impl std::fmt::Debug for StoreWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreWriter")
            .field("health", &self.health())
            .finish()
    }
}

impl StoreWriter {
    /// Spawns the flush loop on the current tokio runtime; each `apply` runs on the
    /// runtime's blocking pool. Changes are coalesced by (table, key) and committed in
    /// one `apply` at most every `interval`.
    ///
    /// # Panics
    /// When called outside a tokio runtime.
    pub fn spawn(store: Arc<dyn StateStore>, interval: Duration) -> StoreWriter {
        let (tx, rx) = mpsc::unbounded_channel();
        let health = Arc::new(Health::default());
        tokio::spawn(run(store, interval, rx, Apply::Offload, health.clone()));
        StoreWriter { tx, health }
    }

    /// Starts the flush loop on a dedicated thread with its own current-thread runtime,
    /// so it outlives any one Pingora service runtime. `apply` runs directly on it.
    pub fn spawn_on_thread(
        store: Arc<dyn StateStore>,
        interval: Duration,
    ) -> Result<StoreWriter, StoreError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .map_err(|e| StoreError::Io(format!("cannot start the state writer runtime: {e}")))?;
        let (tx, rx) = mpsc::unbounded_channel();
        let health = Arc::new(Health::default());
        let shared = health.clone();
        std::thread::Builder::new()
            .name("sluice-store".to_owned())
            .spawn(move || runtime.block_on(run(store, interval, rx, Apply::Inline, shared)))
            .map_err(|e| StoreError::Io(format!("cannot start the state writer thread: {e}")))?;
        Ok(StoreWriter { tx, health })
    }

    /// Sets the callback told of every failed commit (once; later calls are ignored).
    pub fn on_failure(&self, hook: impl Fn(&StoreError) + Send + Sync + 'static) {
        let _ = self.health.on_failure.set(Box::new(hook));
    }

    /// How commits are going.
    pub fn health(&self) -> WriterHealth {
        WriterHealth {
            failed_commits: self.health.failed_commits.load(Ordering::Relaxed),
            consecutive_failures: self.health.consecutive_failures.load(Ordering::Relaxed),
            closed: self.tx.is_closed(),
        }
    }

    /// Queues changes; never blocks, never awaits (called on request paths).
    pub fn submit(&self, changes: Vec<Change>) {
        if changes.is_empty() {
            return;
        }
        if self.tx.send(Msg::Submit(changes)).is_err() {
            tracing::warn!("state writer has stopped; a state change was not persisted");
        }
    }

    /// Queues changes and waits until they, and everything queued before them, are
    /// committed (leases and terminal states are durable before the response).
    ///
    /// On `Err` the changes stay queued and are retried on the next tick, so they may
    /// still land later: a caller that gives up should submit the undoing change.
    pub async fn commit_now(&self, changes: Vec<Change>) -> Result<(), StoreError> {
        self.queue_commit(changes).wait().await
    }

    /// The first half of `commit_now`: queues the changes now (never blocks, so it may be
    /// called under a lock, which orders them with other changes made under that lock)
    /// and returns what to await for their commit.
    pub fn queue_commit(&self, changes: Vec<Change>) -> CommitWait {
        let (reply, done) = oneshot::channel();
        let sent = self.tx.send(Msg::Commit(changes, reply)).is_ok();
        CommitWait { done, sent }
    }

    /// Commits everything queued so far and stops the writer (for shutdown and tests).
    /// When it returns, whatever the outcome, the writer no longer holds the store, so
    /// the file can be reopened; later calls on any handle fail with `Closed`.
    pub async fn flush(&self) -> Result<(), StoreError> {
        let (reply, done) = oneshot::channel();
        self.tx
            .send(Msg::Flush(reply))
            .map_err(|_| StoreError::Closed)?;
        done.await.map_err(|_| StoreError::Closed)?
    }

    /// Commits everything queued so far into the current store, then lets go of it and
    /// writes every later batch to `next` (the upgrade's handover, SPEC §8.1): when it
    /// returns, the writer no longer holds the old store, whatever the outcome.
    pub async fn swap_store(&self, next: Arc<dyn StateStore>) -> Result<(), StoreError> {
        let (reply, done) = oneshot::channel();
        self.tx
            .send(Msg::Swap(next, reply))
            .map_err(|_| StoreError::Closed)?;
        done.await.map_err(|_| StoreError::Closed)?
    }

    /// True once the writer has stopped.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

#[derive(Clone, Copy)]
enum Apply {
    /// On this thread: the loop owns a dedicated thread.
    Inline,
    /// On the runtime's blocking pool: the loop shares a runtime with other work.
    Offload,
}

/// Coalesced pending changes: at most one entry per (table, key).
type Pending = BTreeMap<(Table, String), Option<serde_json::Value>>;

struct Loop {
    store: Arc<dyn StateStore>,
    mode: Apply,
    pending: Pending,
    /// `commit_now` callers waiting for the next commit.
    waiters: Vec<Reply>,
    /// `flush` callers: when non-empty, the loop stops after the next commit.
    flushers: Vec<Reply>,
    /// `swap_store` callers: after the next commit, the store is replaced.
    swaps: Vec<(Arc<dyn StateStore>, Reply)>,
    failures: u32,
    health: Arc<Health>,
}

async fn run(
    store: Arc<dyn StateStore>,
    interval: Duration,
    mut rx: mpsc::UnboundedReceiver<Msg>,
    mode: Apply,
    health: Arc<Health>,
) {
    let mut state = Loop {
        store,
        mode,
        pending: Pending::new(),
        waiters: Vec::new(),
        flushers: Vec::new(),
        swaps: Vec::new(),
        failures: 0,
        health,
    };
    // The first tick comes one interval in (not at once), so a commit never races an
    // immediate tick retrying the same batch.
    let period = interval.max(Duration::from_millis(1));
    let start = tokio::time::Instant::from_std(crate::clock::monotonic()) + period;
    let mut ticker = tokio::time::interval_at(start, period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            msg = rx.recv() => {
                let Some(msg) = msg else {
                    // Every handle is gone: a last attempt, then stop.
                    let result = state.commit().await;
                    state.log_stop(&result);
                    return;
                };
                state.absorb(msg);
                // Take what is already queued, so concurrent `commit_now`s share one fsync.
                for _ in 0..MAX_DRAIN {
                    match rx.try_recv() {
                        Ok(msg) => state.absorb(msg),
                        Err(_) => break,
                    }
                }
                if !state.flushers.is_empty() {
                    // Refuse new work, take everything already sent, commit, stop.
                    rx.close();
                    while let Ok(msg) = rx.try_recv() {
                        state.absorb(msg);
                    }
                    let result = state.commit().await;
                    state.reply_waiters(&result);
                    state.log_stop(&result);
                    let flushers = std::mem::take(&mut state.flushers);
                    drop(state);
                    for f in flushers {
                        let _ = f.send(result.clone());
                    }
                    return;
                }
                if !state.waiters.is_empty() || !state.swaps.is_empty() {
                    let result = state.commit().await;
                    state.reply_waiters(&result);
                    state.swap(&result);
                }
            }
            _ = ticker.tick() => {
                let _ = state.commit().await;
            }
        }
    }
}

impl Loop {
    fn absorb(&mut self, msg: Msg) {
        match msg {
            Msg::Submit(changes) => self.queue(changes),
            Msg::Commit(changes, reply) => {
                self.queue(changes);
                self.waiters.push(reply);
            }
            Msg::Flush(reply) => self.flushers.push(reply),
            Msg::Swap(next, reply) => self.swaps.push((next, reply)),
        }
    }

    fn queue(&mut self, changes: Vec<Change>) {
        for c in changes {
            self.pending.insert((c.table, c.key), c.value);
        }
    }

    fn reply_waiters(&mut self, result: &Result<(), StoreError>) {
        for w in self.waiters.drain(..) {
            // The caller may have given up waiting; the commit stands either way.
            let _ = w.send(result.clone());
        }
    }

    /// Replaces the store with the last one asked for; a batch the old store refused
    /// stays pending and goes to the new one.
    fn swap(&mut self, result: &Result<(), StoreError>) {
        let Some((next, _)) = self.swaps.last() else {
            return;
        };
        self.store = Arc::clone(next);
        for (_, reply) in self.swaps.drain(..) {
            let _ = reply.send(result.clone());
        }
    }

    fn log_stop(&self, result: &Result<(), StoreError>) {
        if let Err(e) = result {
            tracing::error!(
                error = %e,
                lost = self.pending.len(),
                "state writer stopped with uncommitted changes"
            );
        }
    }

    /// Commits everything pending in one `apply`; on failure keeps it for the next try.
    async fn commit(&mut self) -> Result<(), StoreError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let batch: Arc<[Change]> = std::mem::take(&mut self.pending)
            .into_iter()
            .map(|((table, key), value)| Change { table, key, value })
            .collect();
        let result = match self.mode {
            Apply::Inline => apply_caught(self.store.as_ref(), &batch),
            Apply::Offload => {
                let store = Arc::clone(&self.store);
                let shared = Arc::clone(&batch);
                tokio::task::spawn_blocking(move || apply_caught(store.as_ref(), &shared))
                    .await
                    .unwrap_or(Err(StoreError::Closed))
            }
        };
        match &result {
            Ok(()) => {
                if self.failures > 0 {
                    tracing::info!(failures = self.failures, "state store commits recovered");
                }
                self.failures = 0;
                self.health.consecutive_failures.store(0, Ordering::Relaxed);
            }
            Err(e) => {
                // Nothing newer can have arrived during the apply: put the batch back as is.
                for c in batch.iter() {
                    self.pending
                        .insert((c.table, c.key.clone()), c.value.clone());
                }
                if self.failures % LOG_EVERY == 0 {
                    tracing::error!(
                        error = %e,
                        label = e.label(),
                        pending = self.pending.len(),
                        consecutive_failures = self.failures + 1,
                        "state store commit failed; keeping the changes and retrying"
                    );
                }
                self.failures = self.failures.saturating_add(1);
                self.health.failed_commits.fetch_add(1, Ordering::Relaxed);
                self.health
                    .consecutive_failures
                    .store(self.failures, Ordering::Relaxed);
                if let Some(hook) = self.health.on_failure.get() {
                    hook(e);
                }
            }
        }
        result
    }
}

/// A panicking store must not take the writer down with it: report it as an error.
fn apply_caught(store: &dyn StateStore, batch: &[Change]) -> Result<(), StoreError> {
    catch_unwind(AssertUnwindSafe(|| store.apply(batch))).unwrap_or_else(|_| {
        Err(StoreError::Io(
            "the state store panicked while committing".into(),
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;
    use serde_json::json;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// Counts applies and fails them while `failing` is set.
    struct Flaky {
        inner: MemoryStore,
        failing: AtomicBool,
        applies: AtomicUsize,
    }

    impl StateStore for Flaky {
        fn load(&self) -> Result<crate::store::Image, StoreError> {
            self.inner.load()
        }
        fn apply(&self, changes: &[Change]) -> Result<(), StoreError> {
            self.applies.fetch_add(1, Ordering::SeqCst);
            if self.failing.load(Ordering::SeqCst) {
                return Err(StoreError::Io("disk on fire".into()));
            }
            self.inner.apply(changes)
        }
    }

    fn flaky(failing: bool) -> Arc<Flaky> {
        Arc::new(Flaky {
            inner: MemoryStore::new(),
            failing: AtomicBool::new(failing),
            applies: AtomicUsize::new(0),
        })
    }

    #[tokio::test]
    async fn a_failed_batch_is_kept_and_retried() {
        let store = flaky(true);
        let writer = StoreWriter::spawn(store.clone(), Duration::from_millis(5));
        let err = writer
            .commit_now(vec![Change::upsert(Table::Leases, "l", json!(1))])
            .await
            .unwrap_err();
        assert_eq!(err.label(), "io");
        writer.submit(vec![Change::upsert(Table::Leases, "l", json!(2))]);
        // Let a few ticks fail, then heal the store.
        for _ in 0..200 {
            if store.applies.load(Ordering::SeqCst) >= 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        store.failing.store(false, Ordering::SeqCst);
        writer.commit_now(Vec::new()).await.unwrap();
        assert_eq!(store.load().unwrap()[&Table::Leases]["l"], json!(2));
        writer.flush().await.unwrap();
    }

    #[tokio::test]
    async fn health_counts_failed_commits_and_tells_the_hook() {
        let store = flaky(true);
        let writer = StoreWriter::spawn(store.clone(), Duration::from_secs(3600));
        let told = Arc::new(AtomicUsize::new(0));
        let seen = told.clone();
        writer.on_failure(move |e| {
            assert_eq!(e.label(), "io");
            seen.fetch_add(1, Ordering::SeqCst);
        });
        for _ in 0..2 {
            let change = vec![Change::upsert(Table::Leases, "l", json!(1))];
            assert!(writer.commit_now(change).await.is_err());
        }
        // The writer's first tick may retry the kept batch once more.
        let h = writer.health();
        assert!(h.failed_commits >= 2 && !h.closed, "{h:?}");
        assert_eq!(u64::from(h.consecutive_failures), h.failed_commits);
        assert_eq!(told.load(Ordering::SeqCst) as u64, h.failed_commits);
        store.failing.store(false, Ordering::SeqCst);
        writer.commit_now(Vec::new()).await.unwrap();
        let healed = writer.health();
        assert_eq!(healed.consecutive_failures, 0);
        assert_eq!(healed.failed_commits, told.load(Ordering::SeqCst) as u64);
        writer.flush().await.unwrap();
        assert!(writer.health().closed);
    }

    #[tokio::test]
    async fn swap_commits_into_the_old_store_then_writes_to_the_new() {
        let old = flaky(false);
        let next = flaky(false);
        let writer = StoreWriter::spawn(old.clone(), Duration::from_secs(3600));
        writer.submit(vec![Change::upsert(Table::Pins, "before", json!(1))]);
        writer.swap_store(next.clone()).await.unwrap();
        assert_eq!(old.load().unwrap()[&Table::Pins]["before"], json!(1));
        // The writer let go of the old store: ours is the only reference left.
        assert_eq!(Arc::strong_count(&old), 1);
        writer
            .commit_now(vec![Change::upsert(Table::Pins, "after", json!(2))])
            .await
            .unwrap();
        assert!(!old.load().unwrap()[&Table::Pins].contains_key("after"));
        assert_eq!(next.load().unwrap()[&Table::Pins]["after"], json!(2));
        assert!(!next.load().unwrap()[&Table::Pins].contains_key("before"));
    }

    #[tokio::test]
    async fn flush_stops_the_writer() {
        let store = flaky(false);
        let writer = StoreWriter::spawn(store.clone(), Duration::from_secs(3600));
        writer.submit(vec![Change::upsert(Table::Pins, "p", json!("a"))]);
        writer.flush().await.unwrap();
        assert_eq!(store.load().unwrap()[&Table::Pins]["p"], json!("a"));
        assert!(writer.is_closed());
        assert_eq!(writer.flush().await.unwrap_err().label(), "closed");
        assert_eq!(
            writer.commit_now(Vec::new()).await.unwrap_err().label(),
            "closed"
        );
        // Only the writer's reference is gone: ours remains.
        assert_eq!(Arc::strong_count(&store), 1);
    }

    #[tokio::test]
    async fn a_panicking_store_does_not_kill_the_writer() {
        struct Boom;
        impl StateStore for Boom {
            fn load(&self) -> Result<crate::store::Image, StoreError> {
                Ok(crate::store::empty_image())
            }
            fn apply(&self, _: &[Change]) -> Result<(), StoreError> {
                panic!("boom")
            }
        }
        let writer = StoreWriter::spawn(Arc::new(Boom), Duration::from_secs(3600));
        let change = || vec![Change::delete(Table::Pins, "p")];
        assert_eq!(writer.commit_now(change()).await.unwrap_err().label(), "io");
        assert_eq!(writer.commit_now(change()).await.unwrap_err().label(), "io");
        assert!(!writer.is_closed());
    }
}
