//! `sluice` binary: set up logging, parse the command line, then hand over to
//! `sluice::cli`.

use clap::Parser;
use sluice::cli::{Cli, Command, StateAction};
use std::io::IsTerminal;

/// Logs go through a background writer (see `sluice::logging`); the returned handle
/// flushes it before the process exits.
fn init_logging() -> Option<sluice::logging::Background> {
    let mut filter = tracing_subscriber::EnvFilter::try_from_env("SLUICE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Pingora logs raw request bytes and headers (client keys, lease owner tokens) at
    // debug and trace: its targets stay at info whatever SLUICE_LOG asks (SPEC §3).
    for target in sluice::logging::CAPPED_TARGETS {
        if let Ok(d) = format!("{target}=info").parse() {
            filter = filter.add_directive(d);
        }
    }
    let ansi = std::io::stderr().is_terminal();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi);
    let bg = sluice::logging::background();
    match bg.clone() {
        Some(writer) => builder.with_writer(writer).init(),
        None => builder.with_writer(std::io::stderr).init(),
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
        } => {
            let logs = init_logging();
            let code = match sluice::cli::run(&config, reset_state) {
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
