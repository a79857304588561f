//! Drain (SPEC §8.1): what a process does between its stop signal and its exit.
//!
//! What it protects: requests and streams in flight when a deploy stops or replaces the
//! process. Invariants: once draining, `/ready` answers 503 and the client listener
//! accepts nothing more (an upgrade's successor takes the socket first); a request that
//! started is counted until its finish phase ran; the process exits as soon as none is
//! left, or at `server.drain_timeout`, when every stream still open is ended with the
//! SSE error event (reason `shutdown`) and gets a moment to write it; a second stop
//! signal during the drain exits at once.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
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
}
