//! The bench floor (SPEC §10, issue #9): a bare Pingora pass-through on the same
//! connector and front door Sluice uses (its client workers, `src/server/workers.rs`) —
//! pingora-proxy's `ProxyHttp` session, no layers, no logging, one fixed upstream — so
//! `bench/run.sh` can show how much of a request's cost is Pingora's and how much is
//! Sluice's. Built for the bench only (`cargo build --release --example floor`).
//!
//!   floor --upstream 127.0.0.1:PORT [--listen 127.0.0.1:0] [--threads 2]
//!
//! Prints `LISTENING client <addr>` like the other binaries, then serves until killed.

use async_trait::async_trait;
use pingora::prelude::HttpPeer;
use pingora::proxy::{ProxyHttp, Session};
use pingora::server::configuration::ServerConf;
use pingora::server::Server;
use sluice::config::types;
use sluice::server::frontdoor::{file_limit, header_done, listen, ClientLimits, FrontDoor};
use sluice::server::lifecycle::Lifecycle;
use sluice::server::workers::{self, Joins};
use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// The gateway's allocator (src/main.rs), so the floor measures Pingora in the same build.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The one upstream every request goes to, with Sluice's pool settings; idle upstream
/// connections are kept per client worker, as Sluice's own pool does (a socket belongs
/// to the worker runtime it was registered with).
struct Floor {
    upstream: SocketAddr,
}

#[async_trait]
impl ProxyHttp for Floor {
    type CTX = ();

    fn new_ctx(&self) {}

    /// Ends the front door's header phase, as the gateway does once it has read a
    /// header: from here on the response is Pingora's, not a header-error page.
    async fn early_request_filter(
        &self,
        session: &mut Session,
        _ctx: &mut (),
    ) -> pingora::Result<()> {
        header_done(session);
        Ok(())
    }

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        _ctx: &mut (),
    ) -> pingora::Result<Box<HttpPeer>> {
        let mut peer = HttpPeer::new(self.upstream, false, String::new());
        peer.options.idle_timeout = Some(Duration::from_secs(90));
        peer.group_key = workers::pool_salt();
        Ok(Box::new(peer))
    }
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let upstream: SocketAddr = arg(&args, "--upstream")
        .ok_or("--upstream HOST:PORT is required")?
        .parse()?;
    let listen_at = arg(&args, "--listen").unwrap_or_else(|| "127.0.0.1:0".into());
    let threads: usize = arg(&args, "--threads").map_or(Ok(2), |t| t.parse())?;
    let pid = std::process::id();
    let tmp = std::env::temp_dir();
    let conf = || ServerConf {
        threads,
        pid_file: tmp.join(format!("floor-{pid}.pid")).display().to_string(),
        upgrade_sock: tmp.join(format!("floor-{pid}.sock")).display().to_string(),
        ..ServerConf::default()
    };
    let app = pingora::proxy::http_proxy(&Arc::new(conf()), Floor { upstream });
    let sock = listen(&listen_at)?;
    let addr = sock.local_addr()?;
    // Sluice's defaults (SPEC §6): the floor never hits them in the bench.
    let limits = ClientLimits {
        header_timeout: Duration::from_secs(types::DEFAULT_CLIENT_HEADER_TIMEOUT_S),
        body_timeout: Duration::from_secs(types::DEFAULT_CLIENT_BODY_TIMEOUT_S),
        keepalive_timeout: Duration::from_secs(types::DEFAULT_KEEPALIVE_TIMEOUT_S),
        max_connections: ClientLimits::connections_for(0, file_limit()),
    };
    let joins = Joins::default();
    let service = FrontDoor::new("floor", sock, app, limits, threads, joins, Lifecycle::new());
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "LISTENING client {addr}")?;
        out.flush()?;
    }
    let mut server = Server::new_with_opt_and_conf(None, conf());
    server.bootstrap();
    server.add_service(service);
    server.run_forever()
}
