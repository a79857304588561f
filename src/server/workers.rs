//! Client workers: one thread each, running its own single-threaded tokio runtime, and
//! the client connections handed to it (issue #9, SPEC §10).
//!
//! What it protects: the request path's CPU. On a work-stealing runtime a request's
//! wake-ups cross threads — the worker parked on the I/O driver wakes another through a
//! futex to run the ready task, and tasks move between workers — which cost ~3 µs of CPU
//! per JSON request here (bench/RESULTS.md, 2026-12-04). A connection served by one
//! thread that also polls its sockets has none of that; nginx's workers are built the
//! same way.
//!
//! Invariants:
//! - a connection is served by one worker for its whole life, and everything its
//!   requests start (upstream connects and reads, timers, spawned tasks) runs there;
//! - a new connection goes to the worker with the fewest open connections, ties taken in
//!   turn, so long streams do not pile up on one thread;
//! - a worker keeps serving after the acceptor is gone (the drain) and stops only when
//!   the server shuts down; its tasks are then dropped within a second, as Pingora
//!   drops those of its own runtimes;
//! - [`current`] names the worker of the calling thread (0 off the workers), so a
//!   per-worker resource — the upstream idle pool — never hands a socket registered with
//!   one worker's driver to another.

use pingora::server::ShutdownWatch;
use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::mpsc;

/// A connection's work, made into its future on the worker that runs it (sockets are
/// registered with the runtime they are first polled on).
pub type Job = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// Jobs a worker starts back to back before it lets the tasks already ready run: a burst
/// of new connections does not hold up the streams open on it (bench/RESULTS.md,
/// 2026-12-04: 8,000 streams opening at once).
const ARRIVAL_BURST: u32 = 8;

/// How long a worker's tasks get once the server shuts down.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

thread_local! {
    static WORKER: Cell<u64> = const { Cell::new(0) };
}

/// The worker the calling thread is: 1.. on a client worker, 0 anywhere else.
pub fn current() -> u64 {
    WORKER.with(Cell::get)
}

/// A value to mix into a connection pool's key so that each worker keeps its own
/// connections (0 off the workers: the key is left as it is).
pub fn pool_salt() -> u64 {
    current().wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// A job on its way to a worker, counted there from the hand-off.
type Arrival = (Job, Open);

struct Worker {
    jobs: mpsc::UnboundedSender<Arrival>,
    open: Arc<AtomicUsize>,
}

/// Counts a connection on its worker until its job ends (or is dropped unrun).
struct Open(Arc<AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The threads of the workers, joined once the server has stopped.
#[derive(Clone, Default)]
pub struct Joins(Arc<Mutex<Vec<JoinHandle<()>>>>);

impl Joins {
    /// Waits for every worker started so far to end (each ends within
    /// [`SHUTDOWN_GRACE`] of the shutdown).
    pub fn join(&self) {
        let handles = match self.0.lock() {
            Ok(mut h) => std::mem::take(&mut *h),
            Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
        };
        for h in handles {
            let _ = h.join();
        }
    }

    fn push(&self, handle: JoinHandle<()>) {
        match self.0.lock() {
            Ok(mut h) => h.push(handle),
            Err(poisoned) => poisoned.into_inner().push(handle),
        }
    }
}

/// The client workers; held by the acceptor, which hands each connection to one.
pub struct Workers {
    workers: Vec<Worker>,
    turn: usize,
}

impl Workers {
    /// Starts `count` workers (at least one), named `{name}-{i}`, serving until
    /// `shutdown`; their threads go to `joins`.
    pub fn start(
        name: &str,
        count: usize,
        shutdown: &ShutdownWatch,
        joins: &Joins,
    ) -> std::io::Result<Self> {
        let mut workers = Vec::with_capacity(count.max(1));
        for index in 0..count.max(1) {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let (jobs, arrivals) = mpsc::unbounded_channel();
            let shutdown = shutdown.clone();
            let id = index as u64 + 1;
            let handle = std::thread::Builder::new()
                .name(format!("{name}-{index}"))
                .spawn(move || {
                    WORKER.with(|w| w.set(id));
                    rt.block_on(run(arrivals, shutdown));
                    rt.shutdown_timeout(SHUTDOWN_GRACE);
                })?;
            joins.push(handle);
            workers.push(Worker {
                jobs,
                open: Arc::new(AtomicUsize::new(0)),
            });
        }
        Ok(Workers { workers, turn: 0 })
    }

    /// Hands `job` to the worker with the fewest open connections; `false` when no
    /// worker takes jobs any more (the job is dropped unrun, closing its connection).
    /// A worker found stopped is skipped from then on and the job goes to the next.
    pub fn hand(&mut self, mut job: Job) -> bool {
        loop {
            let n = self.workers.len();
            if n == 0 {
                return false;
            }
            let load = |i: usize| self.workers[i].open.load(Ordering::Acquire);
            let start = self.turn % n;
            self.turn = self.turn.wrapping_add(1);
            let (mut best, mut least) = (start, load(start));
            for k in 1..n {
                let i = (start + k) % n;
                if load(i) < least {
                    (best, least) = (i, load(i));
                }
            }
            let w = &self.workers[best];
            w.open.fetch_add(1, Ordering::AcqRel);
            match w.jobs.send((job, Open(w.open.clone()))) {
                Ok(()) => return true,
                // It stopped (only at shutdown, or if its thread died): skipped from
                // now on; its count goes back with the guard.
                Err(mpsc::error::SendError((back, _open))) => {
                    job = back;
                    self.workers.remove(best);
                }
            }
        }
    }

    /// Open connections per worker, in worker order.
    pub fn open(&self) -> Vec<usize> {
        self.workers
            .iter()
            .map(|w| w.open.load(Ordering::Acquire))
            .collect()
    }
}

/// A worker's loop: start each arriving job, until the server shuts down.
async fn run(mut arrivals: mpsc::UnboundedReceiver<Arrival>, mut shutdown: ShutdownWatch) {
    let mut burst = 0;
    loop {
        tokio::select! {
            job = arrivals.recv() => match job {
                Some((job, open)) => {
                    let fut = job();
                    tokio::spawn(async move {
                        let _open = open;
                        fut.await;
                    });
                    burst += 1;
                    if burst == ARRIVAL_BURST {
                        burst = 0;
                        tokio::task::yield_now().await;
                    }
                }
                // The acceptor is gone (drain): the connections here still finish.
                None => break,
            },
            _ = super::frontdoor::shutting_down(&mut shutdown) => return,
        }
    }
    super::frontdoor::shutting_down(&mut shutdown).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc as std_mpsc;
    use tokio::sync::{watch, Notify};

    /// A job that reports the worker it ran on, then waits until `release` is notified.
    fn held(seen: std_mpsc::Sender<u64>, release: Arc<Notify>) -> Job {
        Box::new(move || {
            Box::pin(async move {
                let _ = seen.send(current());
                release.notified().await;
            })
        })
    }

    #[test]
    fn connections_go_to_the_least_loaded_worker_and_are_counted_until_they_end() {
        let (stop, shutdown) = watch::channel(false);
        let joins = Joins::default();
        let mut workers = Workers::start("test-worker", 2, &shutdown, &joins).unwrap();
        assert_eq!(current(), 0, "the test thread is no worker");
        let (seen_tx, seen) = std_mpsc::channel();
        let release = Arc::new(Notify::new());
        // Four long connections: two per worker, in turn.
        for _ in 0..4 {
            assert!(workers.hand(held(seen_tx.clone(), release.clone())));
        }
        let mut on: Vec<u64> = (0..4)
            .map(|_| seen.recv_timeout(Duration::from_secs(5)).unwrap())
            .collect();
        on.sort_unstable();
        assert_eq!(on, vec![1, 1, 2, 2]);
        assert_eq!(workers.open(), vec![2, 2]);
        // A short connection on worker 1 ends: the next one goes there.
        let (done_tx, done) = std_mpsc::channel();
        let short: Job = Box::new(move || {
            Box::pin(async move {
                let _ = done_tx.send(current());
            })
        });
        assert!(workers.hand(short));
        let first = done.recv_timeout(Duration::from_secs(5)).unwrap();
        for _ in 0..500 {
            if workers.open() == vec![2, 2] {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(workers.open(), vec![2, 2], "the short one was uncounted");
        assert!((1..=2).contains(&first));
        // Load one worker more than the other: the lighter one takes the next.
        assert!(workers.hand(held(seen_tx.clone(), release.clone())));
        let went = seen.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(workers.open()[went as usize - 1], 3);
        assert!(workers.hand(held(seen_tx.clone(), release.clone())));
        let next = seen.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_ne!(
            next, went,
            "the less loaded worker takes the next connection"
        );
        // Shutdown: the workers end (their held jobs dropped) and are joined.
        stop.send_replace(true);
        joins.join();
        assert!(!workers.hand(held(seen_tx, release)), "no worker is left");
    }

    #[test]
    fn a_stopped_worker_is_skipped_and_its_connections_go_to_the_others() {
        let worker = || {
            let (jobs, arrivals) = mpsc::unbounded_channel();
            let open = Arc::new(AtomicUsize::new(0));
            (
                Worker {
                    jobs,
                    open: open.clone(),
                },
                arrivals,
                open,
            )
        };
        let (first, first_rx, first_open) = worker();
        let (second, mut second_rx, second_open) = worker();
        let mut workers = Workers {
            workers: vec![first, second],
            turn: 0,
        };
        drop(first_rx);
        let noop = || -> Job { Box::new(|| Box::pin(async {})) };
        assert!(workers.hand(noop()), "the live worker takes it");
        assert!(workers.hand(noop()));
        assert_eq!(workers.open(), vec![2], "the stopped worker is gone");
        assert_eq!(first_open.load(Ordering::Acquire), 0);
        let (_job, open) = second_rx.try_recv().unwrap();
        drop(open);
        assert_eq!(second_open.load(Ordering::Acquire), 1);
        drop(second_rx);
        assert!(!workers.hand(noop()), "no worker left: the job is refused");
        assert_eq!(
            second_open.load(Ordering::Acquire),
            0,
            "queued jobs dropped, counts back"
        );
    }

    #[test]
    fn a_worker_keeps_serving_after_the_acceptor_is_gone_until_shutdown() {
        let (stop, shutdown) = watch::channel(false);
        let joins = Joins::default();
        let mut workers = Workers::start("test-worker", 1, &shutdown, &joins).unwrap();
        let (tx, rx) = std_mpsc::channel();
        let tick: Job = Box::new(move || {
            Box::pin(async move {
                for i in 0..3 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    let _ = tx.send(i);
                }
            })
        });
        assert!(workers.hand(tick));
        // The acceptor goes (a drain): the connection still runs to its end.
        drop(workers);
        let got: Vec<i32> = (0..3)
            .map(|_| rx.recv_timeout(Duration::from_secs(5)).unwrap())
            .collect();
        assert_eq!(got, vec![0, 1, 2]);
        stop.send_replace(true);
        joins.join();
    }
}
