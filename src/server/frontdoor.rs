//! The client listener: accept loop and hand-off of each connection (SPEC §6 server).
//!
//! What it protects: the gateway's file descriptors and memory from numerous clients.
//! Invariants:
//! - at most `max_client_connections` client connections are served at once; beyond
//!   that the accept loop stops accepting, so new connections wait in the kernel backlog
//!   instead of holding a descriptor and buffers each;
//! - each accepted connection is served by one client worker, as a [`ClientConn`] that
//!   keeps the per-connection limits (header, body, keep-alive and send timeouts; see
//!   `server::conn`), by the front door's [`ConnApp`];
//! - the listening socket is bound with Pingora's backlog (65,535) and listed in the
//!   server's fd table; the service is a Pingora `Service`, so upgrades hand it over.

use super::conn::ClientConn;
use super::lifecycle::{until_set, Active, Lifecycle};
use super::workers::{Joins, Workers};
use async_trait::async_trait;
use pingora::server::{ListenFds, ShutdownWatch};
use pingora::services::Service;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// The client-connection limits of `server:` (resolved: no zero left).
#[derive(Clone, Copy, Debug)]
pub struct ClientLimits {
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    pub keepalive_timeout: Duration,
    pub max_connections: usize,
}

/// Descriptors kept free of client connections: upstream sockets beyond the pairs,
/// the store, the admin listener, logs.
const RESERVED_FDS: u64 = 256;

impl ClientLimits {
    /// `max_client_connections: 0` → (soft file limit − 256) ÷ 2: a proxied request
    /// holds two sockets.
    pub fn connections_for(configured: usize, file_limit: Option<u64>) -> usize {
        if configured > 0 {
            return configured;
        }
        let limit = file_limit.unwrap_or(1024);
        (limit.saturating_sub(RESERVED_FDS) / 2).max(16) as usize
    }
}

/// The soft `RLIMIT_NOFILE` of this process, from `/proc/self/limits` (Linux).
pub fn file_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    let soft = line.split_whitespace().nth(3)?;
    match soft {
        "unlimited" => Some(1 << 20),
        n => n.parse().ok(),
    }
}

/// What serves the client connections a [`FrontDoor`] accepts: the gateway, or the
/// bench floor.
pub trait ConnApp: Send + Sync + 'static {
    /// Serves one connection to its end. `arriving` counts it as in flight for the
    /// drain until its first request is being handled (the request then counts itself).
    fn serve(
        self: Arc<Self>,
        conn: ClientConn,
        arriving: Active,
    ) -> impl Future<Output = ()> + Send + 'static;
}

/// A Pingora service that accepts client connections itself and hands each one to a
/// client worker, where the app serves it.
pub struct FrontDoor<A> {
    name: String,
    app: Arc<A>,
    listener: Option<std::net::TcpListener>,
    limits: ClientLimits,
    workers: usize,
    joins: Joins,
    life: Arc<Lifecycle>,
}

impl<A: ConnApp> FrontDoor<A> {
    /// Serves `listener` (bound by [`listen`] or inherited from an upgrade) on
    /// `workers` client workers until the server shuts down or `life` starts draining.
    /// The workers' threads go to `joins`, to be joined after the server has stopped.
    pub fn new(
        name: &str,
        listener: std::net::TcpListener,
        app: A,
        limits: ClientLimits,
        workers: usize,
        joins: Joins,
        life: Arc<Lifecycle>,
    ) -> Self {
        FrontDoor {
            name: name.to_string(),
            app: Arc::new(app),
            listener: Some(listener),
            limits,
            workers,
            joins,
            life,
        }
    }
}

/// Pingora's listen backlog (the kernel caps it at `net.core.somaxconn`): connections
/// beyond `max_client_connections` wait here.
const BACKLOG: i32 = 65_535;

/// A non-blocking listening socket on `addr` with Pingora's backlog and `SO_REUSEADDR`.
pub fn listen(addr: &str) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let addr: SocketAddr = addr
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

/// Accept errors that mean "out of descriptors or memory": wait before the next accept
/// (the connection stays in the backlog). Others (a connection aborted before it was
/// accepted) are retried at once.
fn is_resource_exhaustion(e: &std::io::Error) -> bool {
    // EMFILE, ENFILE, ENOBUFS, ENOMEM
    matches!(e.raw_os_error(), Some(24 | 23 | 105 | 12))
}

/// Resolves once the server is shutting down.
pub(super) async fn shutting_down(watch: &mut ShutdownWatch) {
    while !*watch.borrow() {
        if watch.changed().await.is_err() {
            return;
        }
    }
}

#[async_trait]
impl<A: ConnApp> Service for FrontDoor<A> {
    async fn start_service(
        &mut self,
        _fds: Option<ListenFds>,
        mut shutdown: ShutdownWatch,
        _listeners_per_fd: usize,
    ) {
        let Some(std_listener) = self.listener.take() else {
            return;
        };
        let mut drain = self.life.draining();
        // The loop itself counts as in flight: a connection it accepted is counted (by
        // `arriving`) before the drain can find nothing left.
        let looping = self.life.enter();
        let listener = match tokio::net::TcpListener::from_std(std_listener) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "cannot start the client listener: not ready");
                self.life.start_drain();
                return;
            }
        };
        let mut workers = match Workers::start(&self.name, self.workers, &shutdown, &self.joins) {
            Ok(w) => w,
            Err(e) => {
                tracing::error!(error = %e, "cannot start the client workers: not ready");
                self.life.start_drain();
                return;
            }
        };
        let slots = Arc::new(Semaphore::new(self.limits.max_connections));
        loop {
            let permit = tokio::select! {
                biased;
                _ = shutting_down(&mut shutdown) => break,
                _ = until_set(&mut drain) => break,
                p = slots.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break,
                },
            };
            // A drain or shutdown wins over a connection that is ready at the same time
            // (an unbiased pick accepted one after `/ready` turned 503 half the time):
            // one still queued then belongs to the listener's other holder, a successor.
            let accepted = tokio::select! {
                biased;
                _ = shutting_down(&mut shutdown) => break,
                _ = until_set(&mut drain) => break,
                a = listener.accept() => a,
            };
            let (stream, _peer) = match accepted {
                Ok(s) => s,
                Err(e) if is_resource_exhaustion(&e) => {
                    tracing::warn!(error = %e, "accept failed: out of resources, retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_millis(50)) => continue,
                        _ = shutting_down(&mut shutdown) => break,
                    }
                }
                Err(_) => {
                    // ECONNABORTED and the like: the next connection is ready now; the
                    // millisecond keeps a persistent error from spinning.
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            // The socket leaves this runtime's driver: the worker registers it with its own.
            let Ok(stream) = stream.into_std() else {
                continue;
            };
            let accepted_at = crate::clock::monotonic();
            let (app, limits, shutdown) = (self.app.clone(), self.limits, shutdown.clone());
            let draining = self.life.draining();
            // A connection counts as in flight from its accept until its first request
            // is being handled (the request then counts itself): a drain never ends
            // between a client's connect and its request.
            let arriving = self.life.enter();
            let handed = workers.hand(Box::new(move || {
                Box::pin(async move {
                    match tokio::net::TcpStream::from_std(stream) {
                        Ok(io) => {
                            let conn = ClientConn::new(io, limits, accepted_at, shutdown, draining);
                            app.serve(conn, arriving).await;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "an accepted connection could not be registered")
                        }
                    }
                    drop(permit);
                })
            }));
            if !handed {
                // Only at shutdown in practice (a task's panic does not end a worker);
                // otherwise /ready turns 503 so the load balancer stops sending here.
                tracing::error!("no client worker is running: the listener stops, not ready");
                self.life.start_drain();
                break;
            }
        }
        // Accept nothing more: an upgrade's successor holds its own copy of the socket.
        drop(listener);
        drop(looping);
        // Sessions idling between requests end only once the server itself shuts down
        // (after the drain), as they wait on the shutdown watch: ending them at the
        // drain would also drop a connection whose request header is still arriving.
        // Until then an idle kept-alive connection may bring one more request, answered
        // with `Connection: close`.
        shutting_down(&mut shutdown).await;
    }

    fn name(&self) -> &str {
        &self.name
    }

    /// The acceptor's own runtime: one thread (the connections run on the workers).
    fn threads(&self) -> Option<usize> {
        Some(1)
    }
}

#[cfg(test)]
mod tests {
    use super::ClientLimits;

    #[test]
    fn connection_cap_comes_from_the_file_limit_when_unset() {
        assert_eq!(ClientLimits::connections_for(0, Some(20_000)), 9_872);
        assert_eq!(ClientLimits::connections_for(0, Some(1024)), 384);
        assert_eq!(ClientLimits::connections_for(0, Some(100)), 16);
        assert_eq!(ClientLimits::connections_for(0, None), 384);
        assert_eq!(ClientLimits::connections_for(500, Some(20_000)), 500);
    }
}
