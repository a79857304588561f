//! `sluice` binary: parse the command line, then hand over to `sluice::cli`.

use clap::Parser;
use sluice::cli::{Cli, Command};

fn main() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SLUICE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Check { config } => sluice::cli::check(&config, &mut std::io::stdout()),
        Command::Run {
            config,
            reset_state,
        } => match sluice::cli::run(&config, reset_state) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("sluice: {e}");
                1
            }
        },
    };
    std::process::exit(code);
}
