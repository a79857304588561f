//! Drain (SPEC §8.1): what a process does between its stop signal and its exit.
//!
//! What it protects: requests and streams in flight when a deploy stops or replaces the
//! process. Invariants: once draining, `/ready` answers 503 and the client listener
//! accepts nothing more (an upgrade's successor takes the socket first); a request that
//! started is counted until its finish phase ran; the process exits as soon as none is
//! left, or at `server.drain_timeout`, when every stream still open is ended with the
//! SSE error event (reason `shutdown`) and gets a moment to write it; a second stop
//! signal during the drain exits at once.

use futures::task::AtomicWaker;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;
use tokio::sync::{watch, Notify};

/// The process's drain state, shared by the listener, the gateway and the admin API.
pub struct Lifecycle {
    draining: watch::Sender<bool>,
    stopping: watch::Sender<bool>,
    active: AtomicUsize,
    idle: Notify,
    flagged: AtomicBool,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Lifecycle {
            draining: watch::channel(false).0,
            stopping: watch::channel(false).0,
            active: AtomicUsize::new(0),
            idle: Notify::new(),
            flagged: AtomicBool::new(false),
        }
    }
}

/// Held by a request from the moment its header is read to its finish phase.
pub struct Active(Arc<Lifecycle>);

impl Drop for Active {
    fn drop(&mut self) {
        if self.0.active.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Lifecycle {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Counts a request in flight until the guard is dropped.
    pub fn enter(self: &Arc<Self>) -> Active {
        self.active.fetch_add(1, Ordering::AcqRel);
        Active(Arc::clone(self))
    }

    pub fn active(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }

    pub fn is_draining(&self) -> bool {
        self.flagged.load(Ordering::Acquire)
    }

    /// Starts the drain: `/ready` turns 503, listeners stop accepting.
    pub fn start_drain(&self) {
        self.flagged.store(true, Ordering::Release);
        self.draining.send_replace(true);
    }

    /// Resolves once the drain has started.
    pub fn draining(&self) -> watch::Receiver<bool> {
        self.draining.subscribe()
    }

    /// The drain deadline passed: streams still open end now.
    pub fn stop_streams(&self) {
        self.stopping.send_replace(true);
    }

    /// For a stream to race its reads against [`Lifecycle::stop_streams`].
    pub fn stopping(&self) -> watch::Receiver<bool> {
        self.stopping.subscribe()
    }

    /// Waits until no request is in flight, or `limit` passed; true when none is left.
    pub async fn settle(&self, limit: Duration) -> bool {
        let wait = async {
            loop {
                let notified = self.idle.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self.active() == 0 {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(limit, wait).await.is_ok()
    }
}

/// Resolves once `rx` holds `true` (or its sender is gone).
pub async fn until_set(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|v| *v).await;
}

/// A stream's wait for [`Lifecycle::stop_streams`], raced by each of its reads (once per
/// chunk). The first poll subscribes; after that the channel's wait is polled again only
/// once the channel woke it, so a poll between chunks is a few atomic operations (the
/// task's waker registered, the flag taken), not a lock of the channel's waiter list.
/// One box and one `Arc` per body that waits at all. Resolves, like [`until_set`], when
/// streams must stop.
pub struct StopWait<'l> {
    life: &'l Lifecycle,
    wait: Option<(ChannelWait, Arc<Woken>)>,
    done: bool,
}

/// The channel's own wait ([`until_set`] on a subscription it owns).
type ChannelWait = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Set by the channel's wake-up, taken by the next poll; `task` is the stream's waker.
struct Woken {
    woken: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl<'l> StopWait<'l> {
    /// Nothing is subscribed until the first poll.
    pub fn new(life: &'l Lifecycle) -> Self {
        StopWait {
            life,
            wait: None,
            done: false,
        }
    }
}

impl Future for StopWait<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(());
        }
        let life = this.life;
        let (wait, woken) = this.wait.get_or_insert_with(|| {
            let mut rx = life.stopping();
            let wait: ChannelWait = Box::pin(async move { until_set(&mut rx).await });
            // Set, so the first poll below polls the channel (and subscribes to it).
            let woken = Woken {
                woken: AtomicBool::new(true),
                task: AtomicWaker::new(),
            };
            (wait, Arc::new(woken))
        });
        // Registered before the flag is read: a wake-up in between still wakes the task.
        woken.task.register(cx.waker());
        if !woken.woken.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        let waker = Waker::from(Arc::clone(woken));
        let out = wait.as_mut().poll(&mut Context::from_waker(&waker));
        this.done = out.is_ready();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn settles_when_the_last_request_finishes() {
        let life = Lifecycle::new();
        assert!(
            life.settle(Duration::from_millis(1)).await,
            "idle settles at once"
        );
        let a = life.enter();
        let b = life.enter();
        assert_eq!(life.active(), 2);
        assert!(!life.settle(Duration::from_millis(20)).await);
        drop(a);
        let waiter = {
            let life = life.clone();
            tokio::spawn(async move { life.settle(Duration::from_secs(5)).await })
        };
        tokio::task::yield_now().await;
        drop(b);
        assert!(waiter.await.unwrap());
        assert_eq!(life.active(), 0);
    }

    #[tokio::test]
    async fn drain_and_stop_are_seen_by_late_subscribers() {
        let life = Lifecycle::new();
        assert!(!life.is_draining());
        let mut early = life.draining();
        life.start_drain();
        until_set(&mut early).await;
        until_set(&mut life.draining()).await;
        assert!(life.is_draining());
        life.stop_streams();
        until_set(&mut life.stopping()).await;
    }

    /// Counts the wake-ups a task would get.
    struct Wakes(AtomicUsize);

    impl Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_stop_wait_wakes_its_task_and_resolves_when_streams_stop() {
        let life = Lifecycle::new();
        let wakes = Arc::new(Wakes(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&wakes));
        let mut cx = Context::from_waker(&waker);
        let mut wait = StopWait::new(&life);
        // Polled once per chunk while nothing stops: pending, and no wake-up.
        for _ in 0..3 {
            assert!(Pin::new(&mut wait).poll(&mut cx).is_pending());
        }
        assert_eq!(wakes.0.load(Ordering::SeqCst), 0);
        life.stop_streams();
        assert_eq!(
            wakes.0.load(Ordering::SeqCst),
            1,
            "the stream's task is woken"
        );
        assert!(Pin::new(&mut wait).poll(&mut cx).is_ready());
        assert!(
            Pin::new(&mut wait).poll(&mut cx).is_ready(),
            "stays resolved"
        );
    }

    #[test]
    fn a_stop_wait_begun_after_the_stop_resolves_at_once() {
        let life = Lifecycle::new();
        life.stop_streams();
        let waker = Waker::from(Arc::new(Wakes(AtomicUsize::new(0))));
        let mut wait = StopWait::new(&life);
        assert!(Pin::new(&mut wait)
            .poll(&mut Context::from_waker(&waker))
            .is_ready());
    }

    #[tokio::test]
    async fn a_stream_waiting_on_its_read_is_stopped() {
        let life = Lifecycle::new();
        let stopper = {
            let life = life.clone();
            tokio::spawn(async move {
                tokio::task::yield_now().await;
                life.stop_streams();
            })
        };
        // A read that never completes, raced as the stream phase races it. The limit
        // comes first: a wait that was never woken must not pass on a late poll.
        let mut wait = StopWait::new(&life);
        let stopped = tokio::select! {
            biased;
            _ = tokio::time::sleep(Duration::from_secs(5)) => false,
            _ = std::future::pending::<()>() => false,
            _ = &mut wait => true,
        };
        assert!(stopped, "the stream's wait was not woken by the stop");
        stopper.await.unwrap();
    }
}
