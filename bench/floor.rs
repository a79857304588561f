//! The bench floor (SPEC §10, issue #9): a bare pass-through on the same I/O path
//! Sluice uses — Pingora's server and transport connector, Sluice's front door and
//! client workers (`src/server/`), its HTTP/1 codec on both sides and its upstream pool
//! (`src/proxy/h1.rs`, `pool.rs`) — with no layers, no logging and one fixed upstream,
//! so `bench/run.sh` can show how much of a request's cost is the I/O path and how much
//! is Sluice's layers. Chunks already in hand leave together, as Sluice sends them.
//! Built for the bench only (`cargo build --release --example floor`).
//!
//!   floor --upstream 127.0.0.1:PORT [--listen 127.0.0.1:0] [--threads 2]
//!
//! Prints `LISTENING client <addr>` like the other binaries, then serves until killed.

use pingora::connectors::ConnectorOptions;
use pingora::prelude::HttpPeer;
use pingora::server::configuration::ServerConf;
use pingora::server::Server;
use sluice::config::types;
use sluice::proxy::body::Outgoing;
use sluice::proxy::pool::{Dest, Upstreams};
use sluice::proxy::upstream::{body_size, response_head, write_request_head, OutHead};
use sluice::server::conn::{ClientConn, Incoming};
use sluice::server::frontdoor::{file_limit, listen, ClientLimits, ConnApp, FrontDoor};
use sluice::server::lifecycle::{Active, Lifecycle};
use sluice::server::workers::{self, Joins};
use std::borrow::Cow;
use std::hash::BuildHasher;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// The gateway's allocator (src/main.rs), so the floor measures the same build.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

const IDLE: Duration = Duration::from_secs(90);
const MAX_BODY: usize = 16 << 20;
const MAX_HEAD: usize = 64 * 1024;

/// The one upstream every request goes to, through Sluice's pool (idle connections kept
/// per client worker).
struct Floor {
    upstream: SocketAddr,
    authority: String,
    pool: Upstreams,
}

impl Floor {
    /// One request passed through; false when the connection must close.
    async fn pass(&self, conn: &mut ClientConn, head: &sluice::http1::RequestHead) -> bool {
        let Ok(body) = conn.read_body(MAX_BODY).await else {
            return false;
        };
        let to = Fixed {
            addr: self.upstream,
            salt: workers::pool_salt(),
        };
        let Ok((mut up, _)) = self.pool.session(&to).await else {
            return false;
        };
        let out = OutHead {
            method: head.method(),
            prefix: "",
            path: head.path(),
            query: head.query(),
            authority: &self.authority,
            body_len: body.len(),
        };
        let mut wire = Vec::with_capacity(head.wire_len() + 64);
        write_request_head(&mut wire, &out, head.fields(), &[], &[]);
        if up.send(wire, &Outgoing::whole(&body)).await.is_err() {
            return false;
        }
        let Ok(answer) = up.read_head(MAX_HEAD).await else {
            return false;
        };
        let mut h = conn.head(answer.status());
        response_head(&mut h, &answer);
        h.end(body_size(&answer));
        let mut batch = Vec::new();
        loop {
            let last = match up.read_body().await {
                Ok(Some(first)) => {
                    batch.extend_from_slice(&first);
                    loop {
                        match up.body_ready() {
                            Some(Ok(Some(more))) => batch.extend_from_slice(&more),
                            Some(Ok(None)) => break true,
                            Some(Err(_)) => return false,
                            None => break false,
                        }
                    }
                }
                Ok(None) => true,
                Err(_) => return false,
            };
            if conn.write_body(&batch, last).await.is_err() {
                return false;
            }
            batch.clear();
            if last {
                break;
            }
        }
        self.pool.release(up, &to, IDLE).await;
        true
    }
}

/// The one upstream as the pool sees it from a client worker: its idle list keyed by
/// the address and the worker, its peer made only for a new connection (as Sluice's).
struct Fixed {
    addr: SocketAddr,
    salt: u64,
}

impl Dest for Fixed {
    fn key(&self) -> u64 {
        self.salt ^ foldhash::fast::FixedState::with_seed(0).hash_one(self.addr)
    }

    fn multiplexed(&self) -> bool {
        false
    }

    fn peer(&self) -> Cow<'_, HttpPeer> {
        let mut peer = HttpPeer::new(self.addr, false, String::new());
        peer.options.idle_timeout = Some(IDLE);
        peer.group_key = self.salt;
        Cow::Owned(peer)
    }
}

impl ConnApp for Floor {
    async fn serve(self: Arc<Self>, mut conn: ClientConn, arriving: Active) {
        drop(arriving);
        while let Incoming::Request(head) = conn.next_request().await {
            if !self.pass(&mut conn, &head).await || !conn.reusable() {
                return;
            }
        }
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
        // Gone at once on SIGTERM: a floor draining for Pingora's default minute would
        // still hold its sockets (and a core's attention) in the next measurement.
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(1),
        ..ServerConf::default()
    };
    let sock = listen(&listen_at)?;
    let addr = sock.local_addr()?;
    // Sluice's defaults (SPEC §6): the floor never hits them in the bench.
    let limits = ClientLimits {
        header_timeout: Duration::from_secs(types::DEFAULT_CLIENT_HEADER_TIMEOUT_S),
        body_timeout: Duration::from_secs(types::DEFAULT_CLIENT_BODY_TIMEOUT_S),
        keepalive_timeout: Duration::from_secs(types::DEFAULT_KEEPALIVE_TIMEOUT_S),
        max_connections: ClientLimits::connections_for(0, file_limit()),
    };
    let app = Floor {
        upstream,
        authority: upstream.to_string(),
        pool: Upstreams::new(options()),
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

/// Sluice's connector settings (`Engine::new`).
fn options() -> ConnectorOptions {
    let mut opts = ConnectorOptions::new(256);
    opts.keepalive_pool_size = 1024;
    opts
}
