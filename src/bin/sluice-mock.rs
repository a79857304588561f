//! `sluice-mock` entry point: parses the command line and hands over to `sluice::mock`.
//! Exit codes: 2 for usage errors (bad flags or fault spec), 1 when the listener cannot
//! be bound.

use clap::Parser;

fn main() {
    let cli = sluice::mock::Cli::parse();
    // `run` only returns on a startup failure.
    let Err(e) = sluice::mock::run(cli);
    eprintln!("sluice-mock: {e}");
    std::process::exit(e.code);
}
