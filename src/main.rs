//! `sluice` binary: set up logging, parse the command line, then hand over to
//! `sluice::cli`.

use clap::Parser;
use sluice::cli::{Cli, Command, StateAction};
use std::io::IsTerminal;

/// mimalloc instead of glibc's malloc: less CPU per request and a resident size that
/// settles under stream churn where glibc's keeps growing; built without transparent
/// huge pages, which would make every open stream's buffers resident in 2 MiB units
/// (measured in bench/RESULTS.md, the choice in docs/decisions.md).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Logs go through a background writer (see `sluice::logging`); the returned handle
/// flushes it before the process exits.
fn init_logging() -> Option<sluice::logging::Background> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = tracing_subscriber::EnvFilter::try_from_env("SLUICE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Pingora logs raw request bytes and headers (client keys, upstream keys, lease
    // owner tokens) at debug and trace: a separate filter, which no SLUICE_LOG
    // directive can override, keeps those targets at info (SPEC §3).
    let cap = tracing_subscriber::filter::filter_fn(|meta| {
        sluice::logging::allowed(meta.target(), *meta.level())
    });
    let ansi = std::io::stderr().is_terminal();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi);
    let bg = sluice::logging::background();
    match bg.clone() {
        Some(writer) => builder.with_writer(writer).finish().with(cap).init(),
        None => builder
            .with_writer(std::io::stderr)
            .finish()
            .with(cap)
            .init(),
    }
    bg
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Check { config } => sluice::cli::check(&config, &mut std::io::stdout()),
        Command::State {
            action: StateAction::ClearOverrides { config },
        } => sluice::cli::clear_overrides(&config, &mut std::io::stdout()),
        Command::Run {
            config,
            reset_state,
            upgrade,
        } => {
            let logs = init_logging();
            let code = match sluice::cli::run(&config, reset_state, upgrade, logs.clone()) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("sluice: {e}");
                    1
                }
            };
            if let Some(l) = logs {
                l.flush(std::time::Duration::from_secs(1));
            }
            code
        }
    };
    std::process::exit(code);
}
