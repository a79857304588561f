//! A plain-TCP listening service for Pingora apps that binds its own socket.
//!
//! Pingora's stock `Service` binds inside `start_service` and never tells anyone which
//! port it got, so a listener on port 0 (what tests and benchmarks use) would be
//! unreachable. This service binds eagerly (before the server starts, so a bad address
//! fails at startup with a clear message), reports the bound address, and then runs the
//! usual accept loop, handing every connection to the app and looping while the app
//! returns the connection for keep-alive reuse.
//!
//! It does not take part in Pingora's fd-passing graceful upgrade: a restart rebinds.

use std::net::SocketAddr;
use std::sync::Arc;

use async_trait::async_trait;
use pingora::apps::ServerApp;
use pingora::protocols::l4::stream::Stream as L4Stream;
use pingora::server::{ListenFds, ShutdownWatch};
use pingora::services::Service;

/// A listening service around one `ServerApp`.
pub struct TcpAppService<A> {
    name: String,
    listener: Option<std::net::TcpListener>,
    app: Arc<A>,
    threads: Option<usize>,
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
        let listener = std::net::TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let local = listener.local_addr()?;
        Ok((
            Self {
                name: name.to_string(),
                listener: Some(listener),
                app: Arc::new(app),
                threads,
            },
            local,
        ))
    }
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> Service for TcpAppService<A> {
    async fn start_service(
        &mut self,
        _fds: Option<ListenFds>,
        mut shutdown: ShutdownWatch,
        _listeners_per_fd: usize,
    ) {
        let Some(std_listener) = self.listener.take() else {
            return;
        };
        let listener = match tokio::net::TcpListener::from_std(std_listener) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(service = %self.name, error = %e, "cannot register listener");
                return;
            }
        };
        loop {
            let accepted = tokio::select! {
                r = listener.accept() => r,
                changed = shutdown.changed() => {
                    if changed.is_err() || *shutdown.borrow() { break; }
                    continue;
                }
            };
            match accepted {
                Ok((tcp, _peer)) => {
                    let _ = tcp.set_nodelay(true);
                    let app = self.app.clone();
                    let shutdown = shutdown.clone();
                    tokio::spawn(async move {
                        let stream: pingora::protocols::Stream = Box::new(L4Stream::from(tcp));
                        let mut next = app.process_new(stream, &shutdown).await;
                        while let Some(reused) = next {
                            next = app.process_new(reused, &shutdown).await;
                        }
                    });
                }
                Err(e) => {
                    // EMFILE and friends: back off briefly instead of spinning.
                    tracing::warn!(service = %self.name, error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn threads(&self) -> Option<usize> {
        self.threads
    }
}
