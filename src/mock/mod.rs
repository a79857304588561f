//! `sluice-mock`: a deterministic OpenAI/Anthropic-shaped upstream with fault injection,
//! used as the upstream in integration tests and benchmarks.
//!
//! One listener serves the API routes (`/v1/...`), streaming and not, plus control routes
//! (`/__stats`, `/__fault`, `/__reset`, `/__subscription`: a Claude subscription account
//! at its usage wall, with the OAuth usage and reset routes under `/api/`). Answers are pure functions of the request and the
//! mock's settings, so tests can assert exact shapes; faults (status, delays, slow, stalled
//! or cut streams) come from `--fault`, `POST /__fault` or a per-request `x-mock-fault`
//! header, all in the grammar of [`fault::Fault::parse`].
//!
//! Startup contract: the listener is bound before anything else runs, then exactly one
//! line `LISTENING mock <ip:port>` is printed to stdout and flushed; test harnesses read
//! it to learn the port. The mock must never be the bottleneck of a benchmark, so the
//! request path avoids per-request locks beyond two brief counters and builds bodies
//! without intermediate JSON trees. With `--tls-cert`/`--tls-key` it speaks TLS (and
//! HTTP/2 when `--h2` offers it by ALPN; `--tls-client-ca` requires a client
//! certificate signed by that CA), so tests can stand up a private-CA upstream.

mod app;
pub mod fault;
mod render;
mod route;
mod stats;
mod subscription;

use std::io::Write;
use std::time::Duration;

use clap::Parser;
use pingora::server::configuration::ServerConf;
use pingora::server::Server;

use crate::server::listener::TcpAppService;
pub use app::{MockApp, MockSettings};
pub use fault::Fault;

/// Command line of `sluice-mock`.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "sluice-mock",
    about = "Mock OpenAI/Anthropic upstream with fault injection"
)]
pub struct Cli {
    /// Address to listen on (port 0 picks a free port; see the LISTENING line).
    #[arg(long, default_value = "127.0.0.1:9100")]
    pub listen: String,
    /// Name reported in `x-mock-name`, in answer texts and in `/__stats`.
    #[arg(long, default_value = "mock")]
    pub name: String,
    /// Worker threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Content chunks per streamed answer (also the number of text pieces).
    #[arg(long, default_value_t = 8)]
    pub chunks: u32,
    /// Pause between streamed content chunks (humantime, e.g. 20ms).
    #[arg(long, default_value = "20ms", value_parser = humantime::parse_duration)]
    pub chunk_interval: Duration,
    /// Start every streamed content chunk with an SSE comment line `: t=<unix µs>`, the
    /// time it was written (the streams bench measures each chunk's delivery with it).
    #[arg(long)]
    pub stamp_chunks: bool,
    /// Process fault, e.g. `status=503;times=2` (see the module docs for keys).
    #[arg(long, value_name = "SPEC", value_parser = Fault::parse)]
    pub fault: Option<Fault>,
    /// Serve TLS with this certificate chain (PEM); needs `--tls-key`.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<String>,
    /// The private key (PEM) of `--tls-cert`.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<String>,
    /// Offer HTTP/2 by ALPN (TLS only; HTTP/1.1 stays available).
    #[arg(long, requires = "tls_cert")]
    pub h2: bool,
    /// Require a client certificate signed by this CA (PEM): mutual TLS.
    #[arg(long, requires = "tls_cert")]
    pub tls_client_ca: Option<String>,
}

/// The TLS settings the command line asks for, checked before anything listens.
fn tls_settings(cli: &Cli) -> Result<Option<pingora::listeners::tls::TlsSettings>, String> {
    let (Some(cert), Some(key)) = (&cli.tls_cert, &cli.tls_key) else {
        return Ok(None);
    };
    match pingora::tls::load_certs_and_key_files(cert, key) {
        Ok(Some(_)) => {}
        _ => {
            return Err(format!(
                "cannot load the TLS certificate {cert} and key {key}"
            ))
        }
    }
    let mut settings = pingora::listeners::tls::TlsSettings::intermediate(cert, key)
        .map_err(|e| format!("TLS settings: {e}"))?;
    if cli.h2 {
        settings.enable_h2();
    }
    if let Some(ca) = &cli.tls_client_ca {
        pingora::tls::install_default_crypto_provider();
        let mut roots = pingora::tls::RootCertStore::empty();
        pingora::tls::load_ca_file_into_store(ca, &mut roots)
            .map_err(|e| format!("cannot load the client CA {ca}: {e}"))?;
        let verifier = pingora::tls::WebPkiClientVerifier::builder(std::sync::Arc::new(roots))
            .build()
            .map_err(|e| format!("client CA {ca}: {e}"))?;
        settings.set_client_cert_verifier(verifier);
    }
    Ok(Some(settings))
}

/// Why the mock could not start, with the exit code to use.
#[derive(Debug)]
pub struct StartError {
    pub code: i32,
    pub message: String,
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Binds, announces and serves until the process is signalled; returns only on a
/// startup failure.
pub fn run(cli: Cli) -> Result<std::convert::Infallible, StartError> {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .try_init();

    let threads = cli.threads.max(1);
    let app = MockApp::new(MockSettings {
        name: cli.name.clone(),
        chunks: cli.chunks,
        chunk_interval: cli.chunk_interval,
        stamp_chunks: cli.stamp_chunks,
    })
    .map_err(|message| StartError { code: 2, message })?;
    if let Some(f) = cli.fault.clone() {
        app.set_fault(f);
    }
    let tls = tls_settings(&cli).map_err(|message| StartError { code: 2, message })?;
    let listener = std::net::TcpListener::bind(&cli.listen).map_err(|e| StartError {
        code: 1,
        message: format!("cannot listen on {}: {e}", cli.listen),
    })?;
    let (service, addr) = TcpAppService::with_tls("sluice-mock", listener, app, Some(threads), tls)
        .map_err(|e| StartError {
            code: 1,
            message: format!("cannot listen on {}: {e}", cli.listen),
        })?;

    {
        let mut out = std::io::stdout().lock();
        let announced = writeln!(out, "LISTENING mock {addr}").and_then(|_| out.flush());
        if let Err(e) = announced {
            return Err(StartError {
                code: 1,
                message: format!("cannot write the LISTENING line: {e}"),
            });
        }
    }

    // Per-process paths so parallel mocks never contend for pingora's files.
    let tmp = std::env::temp_dir();
    let pid = std::process::id();
    let conf = ServerConf {
        threads,
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(0),
        pid_file: tmp
            .join(format!("sluice-mock-{pid}.pid"))
            .to_string_lossy()
            .into_owned(),
        upgrade_sock: tmp
            .join(format!("sluice-mock-{pid}.sock"))
            .to_string_lossy()
            .into_owned(),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    server.add_service(service);
    server.run_forever()
}
