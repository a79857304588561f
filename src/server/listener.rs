//! A Pingora listening service whose socket is bound before the server starts.
//!
//! Pingora's stock `Service` binds inside `start_service` and never tells anyone which
//! port it got, so a listener on port 0 (tests, benchmarks) would be unreachable and a
//! bad address would only fail once the server runs. This wrapper binds eagerly (a bad
//! address fails at startup with a clear message), reports the bound address, and at
//! start hands the socket to Pingora through the server's listen-fd table under the
//! bound address. Pingora's own service then adopts that fd instead of binding, so the
//! accept path is entirely Pingora's: per-connection buffers, handshake timeout,
//! keep-alive reuse, and the fd table that graceful upgrades pass on.

use std::net::SocketAddr;
use std::os::fd::IntoRawFd;

use async_trait::async_trait;
use pingora::apps::ServerApp;
use pingora::server::{ListenFds, ShutdownWatch};
use pingora::services::listening::Service as ListeningService;
use pingora::services::Service;

/// A listening service around one `ServerApp`, bound at construction.
pub struct TcpAppService<A> {
    inner: ListeningService<A>,
    listener: Option<std::net::TcpListener>,
    key: String,
}

impl<A: ServerApp + Send + Sync + 'static> TcpAppService<A> {
    /// Binds `addr` now (blocking, at startup only) and returns the service and the
    /// address it actually bound, which differs from `addr` when the port is 0.
    pub fn bind(
        name: &str,
        addr: &str,
        app: A,
        threads: Option<usize>,
    ) -> std::io::Result<(Self, SocketAddr)> {
        Self::from_listener(name, std::net::TcpListener::bind(addr)?, app, threads)
    }

    /// Serves a socket already bound (or inherited from an upgrade).
    pub fn from_listener(
        name: &str,
        listener: std::net::TcpListener,
        app: A,
        threads: Option<usize>,
    ) -> std::io::Result<(Self, SocketAddr)> {
        Self::with_tls(name, listener, app, threads, None)
    }

    /// [`TcpAppService::from_listener`], speaking TLS with `tls` when given.
    pub fn with_tls(
        name: &str,
        listener: std::net::TcpListener,
        app: A,
        threads: Option<usize>,
        tls: Option<pingora::listeners::tls::TlsSettings>,
    ) -> std::io::Result<(Self, SocketAddr)> {
        listener.set_nonblocking(true)?;
        let local = listener.local_addr()?;
        let key = local.to_string();
        let mut inner = ListeningService::new(name.to_string(), app);
        match tls {
            Some(settings) => inner.add_tls_with_settings(&key, None, settings),
            None => inner.add_tcp(&key),
        }
        inner.threads = threads;
        Ok((
            Self {
                inner,
                listener: Some(listener),
                key,
            },
            local,
        ))
    }
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> Service for TcpAppService<A> {
    async fn start_service(
        &mut self,
        fds: Option<ListenFds>,
        shutdown: ShutdownWatch,
        listeners_per_fd: usize,
    ) {
        match (&fds, self.listener.take()) {
            // The normal case: Pingora adopts our socket from its fd table.
            (Some(table), Some(listener)) => {
                table.lock().add(self.key.clone(), listener.into_raw_fd());
            }
            // No fd table (not expected on unix): release the socket and let Pingora
            // bind the same address itself.
            (None, Some(listener)) => drop(listener),
            (_, None) => {}
        }
        self.inner
            .start_service(fds, shutdown, listeners_per_fd)
            .await
    }

    fn name(&self) -> &str {
        self.inner.name()
    }

    fn threads(&self) -> Option<usize> {
        self.inner.threads
    }
}
