//! Listening sockets across processes and the stop signals (SPEC §8.1).
//!
//! What it protects: connection attempts during a zero-downtime upgrade. The new
//! process (`sluice run --upgrade`) receives the running process's listening sockets
//! over `server.upgrade_sock` (Pingora's message format: addresses, then the sockets as `SCM_RIGHTS`) before it binds anything, so both
//! serve one kernel queue: no attempt is refused while one process stops accepting and
//! the other starts. Invariants: a listener is taken from the inherited table when its
//! configured address is there, otherwise bound fresh; an inherited socket no listener
//! claims is closed; every listener of this process is in the table it will hand on.
//!
//! [`StopSignals`] replaces Pingora's signal handling: `SIGTERM`/`SIGINT` drain, `SIGQUIT`
//! hands the sockets to the successor, then — once it says it claimed them — the state
//! store, then drains once it says it serves (and told systemd it is the main process).
//! When the successor does not get that far, this process keeps or takes back what it
//! had and keeps serving. Pingora only learns of the stop once the drain is over, so its
//! own grace period is zero.

use super::lifecycle::Lifecycle;
use crate::store::handover::Outbox;
use crate::store::{RedbStore, StoreWriter};
use async_trait::async_trait;
use pingora::server::{ShutdownSignal, ShutdownSignalWatch};
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::net::TcpListener;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::signal::unix::{signal, SignalKind};

/// The listening sockets this process got from its predecessor and the ones it holds.
#[derive(Default)]
pub struct Listeners {
    inherited: HashMap<String, OwnedFd>,
    held: Vec<(String, TcpListener)>,
}

/// Most sockets one handover carries.
const MAX_FDS: usize = 32;
/// How long `--upgrade` waits for the running process to send its sockets.
const INHERIT_WAIT: Duration = Duration::from_secs(10);

impl Listeners {
    /// Receives the predecessor's sockets over `sock`: listens there and waits (at
    /// most [`INHERIT_WAIT`]) for the old process, told by `SIGQUIT`, to connect and
    /// send them. The message is Pingora's: the addresses separated by spaces, the
    /// sockets as `SCM_RIGHTS` in the same order.
    pub fn inherit(sock: &str) -> std::io::Result<(Listeners, Successor)> {
        let _ = std::fs::remove_file(sock);
        let server = UnixListener::bind(sock).map_err(|e| {
            std::io::Error::other(format!("cannot listen on the upgrade socket {sock}: {e}"))
        })?;
        server.set_nonblocking(true)?;
        let waited = crate::clock::monotonic();
        let conn = loop {
            match server.accept() {
                Ok((conn, _)) => break conn,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if waited.elapsed() >= INHERIT_WAIT {
                        let _ = std::fs::remove_file(sock);
                        return Err(std::io::Error::other(format!(
                            "no listening sockets arrived on {sock} within {}s: send SIGQUIT to the running process after starting this one",
                            INHERIT_WAIT.as_secs()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(e),
            }
        };
        let _ = std::fs::remove_file(sock);
        conn.set_nonblocking(false)?;
        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut names = [0u8; 2048];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = recvmsg(
            &conn,
            &mut [IoSliceMut::new(&mut names)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )?;
        let mut fds = Vec::new();
        for msg in control.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = msg {
                fds.extend(rights);
            }
        }
        let names = std::str::from_utf8(&names[..got.bytes])
            .map_err(|_| std::io::Error::other("the upgrade message is not UTF-8"))?;
        let names: Vec<&str> = names.split_ascii_whitespace().collect();
        if names.len() != fds.len() {
            return Err(std::io::Error::other(format!(
                "the upgrade message names {} sockets but carries {}",
                names.len(),
                fds.len()
            )));
        }
        let listeners = Listeners {
            inherited: names.into_iter().map(str::to_owned).zip(fds).collect(),
            held: Vec::new(),
        };
        Ok((listeners, Successor(Some(conn))))
    }

    /// The `role` listener (`client`, `admin`) for `addr` as configured: the inherited
    /// one when the predecessor had the same role on the same configured address, else
    /// `bind(addr)`. Either way it is kept for the next handover.
    pub fn tcp(
        &mut self,
        role: &str,
        addr: &str,
        bind: impl FnOnce(&str) -> std::io::Result<TcpListener>,
    ) -> std::io::Result<TcpListener> {
        // Two listeners may both be configured as `127.0.0.1:0`: the role tells them apart.
        let key = format!("{role}@{addr}");
        let listener = match self.inherited.remove(&key) {
            Some(fd) => TcpListener::from(fd),
            None => bind(addr)?,
        };
        listener.set_nonblocking(true)?;
        self.held.push((key, listener.try_clone()?));
        Ok(listener)
    }

    /// Closes inherited sockets no listener claimed (a listener removed from the
    /// config); returns their addresses.
    pub fn close_unclaimed(&mut self) -> Vec<String> {
        self.inherited.drain().map(|(addr, _)| addr).collect()
    }

    /// Closes this process's copies of its listeners: once the listeners' own copies
    /// are gone too, a stopped gateway refuses connections instead of leaving them in a
    /// backlog nobody accepts from (after an upgrade, the successor's copies remain).
    fn release(&mut self) {
        self.held.clear();
    }

    /// Hands every held socket to the process waiting on `sock` (retrying for a few
    /// seconds while it is not listening yet).
    fn send(&self, sock: &str, wait: Duration) -> std::io::Result<UnixStream> {
        let waited = crate::clock::monotonic();
        let conn = loop {
            match UnixStream::connect(sock) {
                Ok(c) => break c,
                Err(e) if waited.elapsed() < wait => {
                    tracing::warn!(sock, error = %e, "upgrade: successor not listening yet, retrying");
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => {
                    return Err(std::io::Error::other(format!(
                        "no successor is listening on {sock}: {e}"
                    )))
                }
            }
        };
        let names: Vec<&str> = self.held.iter().map(|(a, _)| a.as_str()).collect();
        let names = names.join(" ");
        let fds: Vec<BorrowedFd<'_>> = self.held.iter().map(|(_, l)| l.as_fd()).collect();
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if fds.len() > MAX_FDS || !control.push(SendAncillaryMessage::ScmRights(&fds)) {
            return Err(std::io::Error::other(
                "too many listening sockets to hand over",
            ));
        }
        sendmsg(
            &conn,
            &[IoSlice::new(names.as_bytes())],
            &mut control,
            SendFlags::empty(),
        )?;
        Ok(conn)
    }
}

/// The successor's side of the upgrade connection: it tells the old process how far it
/// got, so the old one gives nothing up before the new one can take it.
pub struct Successor(Option<UnixStream>);

/// The successor claimed every listener: the old process may release the store.
pub const CLAIMED: u8 = 1;
/// The successor opened the store, serves and told systemd it is the main process: the
/// old process may drain.
pub const SERVING: u8 = 2;

impl Successor {
    /// Not an upgrade: nothing to tell.
    pub fn none() -> Self {
        Successor(None)
    }

    /// Tells the predecessor `stage` ([`CLAIMED`], then [`SERVING`]).
    pub fn tell(&mut self, stage: u8) {
        use std::io::Write;
        if let Some(conn) = &mut self.0 {
            if let Err(e) = conn.write_all(&[stage]) {
                tracing::warn!(error = %e, stage, "upgrade: cannot tell the previous process");
            }
        }
        if stage == SERVING {
            self.0 = None;
        }
    }
}

/// Waits up to `limit` for the successor to say `stage`.
fn heard(conn: &mut UnixStream, stage: u8, limit: Duration) -> bool {
    use std::io::Read;
    let mut b = [0u8; 1];
    conn.set_read_timeout(Some(limit)).is_ok() && conn.read_exact(&mut b).is_ok() && b[0] == stage
}

/// The stop signals' streams, installed before the process announces itself: from
/// then on `SIGTERM`/`SIGINT`/`SIGQUIT` are never the default (fatal) action, and one
/// that arrives before the server runs is still seen once it does.
pub struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    quit: tokio::signal::unix::Signal,
}

impl Signals {
    /// Installs the handlers within `rt` (any runtime with I/O enabled; the streams are
    /// read later on Pingora's).
    pub fn install(rt: &tokio::runtime::Runtime) -> std::io::Result<Signals> {
        let _guard = rt.enter();
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            quit: signal(SignalKind::quit())?,
        })
    }
}

/// What the stop signals act on.
pub struct StopSignals {
    pub signals: Mutex<Option<Signals>>,
    pub life: Arc<Lifecycle>,
    pub drain_timeout: Duration,
    pub upgrade_sock: String,
    pub listeners: Arc<Mutex<Listeners>>,
    pub store: Option<StoreWriter>,
    /// The state store's file, to take back when a successor fails to start.
    pub store_path: PathBuf,
    /// The store is shared (Redis): both processes keep writing to it, nothing is handed over.
    pub shared_store: bool,
    /// Where the store's changes go once it was handed to a successor.
    pub outbox: PathBuf,
    /// This process's predecessor, told [`SERVING`] once the signal handlers are in place.
    pub predecessor: Mutex<Successor>,
    /// Set at the hand-over: this process stops taking in a predecessor's batches (they
    /// would be its own).
    pub handing_over: Arc<std::sync::atomic::AtomicBool>,
}

/// How long the old process waits for its successor to open the store and serve (the
/// successor waits up to 30 s for the store itself).
const SUCCESSOR_START: Duration = Duration::from_secs(45);

/// How long streams get to write their `shutdown` event after the drain deadline.
const LAST_WORDS: Duration = Duration::from_secs(3);

impl StopSignals {
    /// `SIGQUIT`: sockets first (the successor is waiting on them), then — once it says
    /// it claimed them — the store, then the drain once it says it serves. False when
    /// the successor did not get that far: then this process keeps (or takes back) what
    /// it had and keeps serving.
    async fn hand_over(&self) -> bool {
        let listeners = Arc::clone(&self.listeners);
        let sock = self.upgrade_sock.clone();
        let sent = tokio::task::spawn_blocking(move || {
            let mut conn = listeners
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .send(&sock, INHERIT_WAIT)?;
            let claimed = heard(&mut conn, CLAIMED, INHERIT_WAIT);
            Ok::<_, std::io::Error>((conn, claimed))
        })
        .await;
        let mut conn = match sent {
            Ok(Ok((conn, true))) => conn,
            Ok(Ok((_, false))) => {
                tracing::error!(
                    "upgrade failed: the new process did not claim the listeners; still serving"
                );
                return false;
            }
            Ok(Err(e)) => {
                tracing::error!(error = %e, "upgrade failed: still serving (start `sluice run --upgrade` first, then send SIGQUIT)");
                return false;
            }
            Err(e) => {
                tracing::error!(error = %e, "upgrade failed: still serving");
                return false;
            }
        };
        tracing::info!(sock = %self.upgrade_sock, "upgrade: listening sockets handed over");
        self.handing_over
            .store(true, std::sync::atomic::Ordering::Release);
        if let (Some(w), false) = (&self.store, self.shared_store) {
            let outbox = Arc::new(Outbox::new(self.outbox.clone()));
            match w.swap_store(outbox).await {
                Ok(()) => tracing::info!(
                    outbox = %self.outbox.display(),
                    "upgrade: state store flushed and released; later changes go to the successor"
                ),
                Err(e) => tracing::error!(error = %e, "upgrade: the state store handover failed"),
            }
        }
        let serving =
            tokio::task::spawn_blocking(move || heard(&mut conn, SERVING, SUCCESSOR_START))
                .await
                .unwrap_or(false);
        if !serving {
            tracing::error!("upgrade failed: the new process did not start; taking the state store back, still serving");
            if !self.shared_store {
                self.take_store_back().await;
            }
            self.handing_over
                .store(false, std::sync::atomic::Ordering::Release);
            return false;
        }
        true
    }

    /// After a failed upgrade: reopens the store file and writes to it again, with the
    /// batches that went to the outbox meanwhile.
    async fn take_store_back(&self) {
        let Some(w) = &self.store else { return };
        let path = self.store_path.clone();
        let reopened = tokio::task::spawn_blocking(move || {
            let started = crate::clock::monotonic();
            loop {
                match RedbStore::open(&path, false) {
                    Ok(s) => return Ok(s),
                    Err(e) if started.elapsed() < Duration::from_secs(10) => {
                        tracing::debug!(error = %e, "taking the state store back: retrying");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    Err(e) => return Err(e),
                }
            }
        })
        .await;
        match reopened {
            Ok(Ok(store)) => {
                match w.swap_store(Arc::new(store)).await {
                    Ok(()) => tracing::info!("upgrade: state store taken back"),
                    Err(e) => {
                        tracing::error!(error = %e, "the state store could not be taken back")
                    }
                }
                for batch in crate::store::handover::take_inbox(&self.outbox) {
                    w.submit(batch);
                }
            }
            Ok(Err(e)) => {
                tracing::error!(error = %e, "the state store could not be reopened; state stays in memory")
            }
            Err(e) => tracing::error!(error = %e, "the state store could not be reopened"),
        }
    }

    /// Drains; false when a second signal cut it short.
    async fn drain(&self, again: impl std::future::Future<Output = ()>) -> bool {
        self.life.start_drain();
        self.listeners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .release();
        tracing::info!(
            in_flight = self.life.active(),
            timeout_s = self.drain_timeout.as_secs(),
            "draining: not accepting; waiting for requests in flight"
        );
        tokio::pin!(again);
        let finished = tokio::select! {
            done = self.life.settle(self.drain_timeout) => done,
            _ = &mut again => return false,
        };
        if !finished {
            tracing::warn!(
                in_flight = self.life.active(),
                "drain timeout: ending the streams still open"
            );
            self.life.stop_streams();
            tokio::select! {
                _ = self.life.settle(LAST_WORDS) => {}
                _ = &mut again => return false,
            }
        }
        tracing::info!("drained; exiting");
        true
    }
}

#[async_trait]
impl ShutdownSignalWatch for StopSignals {
    async fn recv(&self) -> ShutdownSignal {
        let taken = self
            .signals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let Some(Signals {
            mut term,
            mut int,
            mut quit,
        }) = taken
        else {
            tracing::error!("the stop signal handlers are gone");
            return std::future::pending().await;
        };
        // Serving, and a stop signal is handled from here on: tell systemd, and an
        // upgrade's predecessor, which may now drain.
        super::notify::ready();
        self.predecessor
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .tell(SERVING);
        loop {
            let upgrade = tokio::select! {
                _ = term.recv() => false,
                _ = int.recv() => false,
                _ = quit.recv() => true,
            };
            if !upgrade {
                // Only a real stop: after an upgrade the successor is the unit's main
                // process, and this one's exit is no stop of the service.
                super::notify::notify("STOPPING=1");
                break;
            }
            if self.hand_over().await {
                break;
            }
        }
        // While draining only a second SIGINT (Ctrl-C) cuts the drain short: `systemctl
        // stop` during an upgrade's drain sends SIGTERM to both processes, and the old
        // one must go on finishing its streams.
        let again = async {
            loop {
                tokio::select! {
                    _ = int.recv() => return,
                    _ = term.recv() => tracing::info!("SIGTERM while draining: already draining"),
                    _ = quit.recv() => tracing::info!("SIGQUIT while draining: already draining"),
                }
            }
        };
        if self.drain(again).await {
            ShutdownSignal::GracefulTerminate
        } else {
            tracing::warn!("second SIGINT: exiting now");
            ShutdownSignal::FastShutdown
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_cross_to_the_successor_by_role_and_address() {
        let sock =
            std::env::temp_dir().join(format!("sluice-handover-test-{}.sock", std::process::id()));
        let sock = sock.to_str().unwrap().to_owned();
        let mut old = Listeners::default();
        let client = old
            .tcp("client", "127.0.0.1:0", |a| TcpListener::bind(a))
            .unwrap();
        let admin = old
            .tcp("admin", "127.0.0.1:0", |a| TcpListener::bind(a))
            .unwrap();
        let (client_addr, admin_addr) = (client.local_addr().unwrap(), admin.local_addr().unwrap());
        let receiver = {
            let sock = sock.clone();
            std::thread::spawn(move || Listeners::inherit(&sock))
        };
        old.send(&sock, INHERIT_WAIT).unwrap();
        let (mut new, _successor) = receiver.join().unwrap().unwrap();
        let got_admin = new
            .tcp("admin", "127.0.0.1:0", |_| {
                panic!("admin must be inherited")
            })
            .unwrap();
        let got_client = new
            .tcp("client", "127.0.0.1:0", |_| {
                panic!("client must be inherited")
            })
            .unwrap();
        assert_eq!(got_client.local_addr().unwrap(), client_addr);
        assert_eq!(got_admin.local_addr().unwrap(), admin_addr);
        assert!(new.close_unclaimed().is_empty());
        // The successor accepts what arrives on the shared socket.
        drop(client);
        old.release();
        let _c = std::net::TcpStream::connect(client_addr).unwrap();
        got_client.set_nonblocking(false).unwrap();
        assert!(got_client.accept().is_ok());
        assert!(
            !std::path::Path::new(&sock).exists(),
            "the upgrade socket is removed"
        );
    }

    #[test]
    fn a_missing_successor_is_an_error_naming_the_socket() {
        let old = Listeners::default();
        let sock = "/nonexistent-dir/sluice.sock";
        let started = crate::clock::monotonic();
        let err = old
            .send(sock, Duration::from_millis(300))
            .unwrap_err()
            .to_string();
        assert!(err.contains(sock), "{err}");
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "it retried"
        );
    }
}
