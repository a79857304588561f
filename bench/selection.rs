//! Selection micro-benchmark (SPEC §10): the cost of one select phase (evaluate every
//! candidate, strategy pick, concurrency and breaker permits) as targets × connections
//! grow. Run with `cargo bench --bench selection` (release build); prints ns per
//! selection (median of 7 batches of at least 50 ms each) for 10, 100 and 1,000 connections and each of a few strategies.

// A benchmark measures wall time and gives up on a broken setup.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::disallowed_methods)]

use sluice::clock::SystemClock;
use sluice::config::{parse_str, Family};
use sluice::engine::select::Asker;
use sluice::engine::{Engine, Selection, Snapshot, Tried};
use sluice::metrics::Metrics;
use sluice::rules::RuleSet;
use std::hint::black_box;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// `providers` providers × `per` connections, one model with one target per provider.
fn config(providers: usize, per: usize, strategy: &str) -> String {
    let mut y = String::from("providers:\n");
    for p in 0..providers {
        y.push_str(&format!("  - id: p{p}\n    base_url: \"http://127.0.0.1:9\"\n    api: openai\n    class: local\n    connections:\n"));
        for c in 0..per {
            y.push_str(&format!("      - {{ id: c{c} }}\n"));
        }
    }
    y.push_str(&format!(
        "models:\n  - name: m\n    strategy: {strategy}\n    targets:\n"
    ));
    for p in 0..providers {
        y.push_str(&format!("      - {{ provider: p{p}, model: up{p} }}\n"));
    }
    y
}

fn engine(providers: usize, per: usize, strategy: &str) -> Arc<Engine> {
    let loaded = parse_str(
        &config(providers, per, strategy),
        "bench.yaml",
        Path::new("."),
        &|_| None,
    )
    .unwrap_or_else(|p| panic!("bench config: {p:?}"));
    let snap = Snapshot::new(loaded.config, Arc::new(RuleSet::empty()), 1);
    Engine::new(
        snap,
        Metrics::new().expect("metrics"),
        None,
        Arc::new(SystemClock),
        None,
    )
}

fn main() {
    // `cargo test --all-targets` runs harness-less benches too; only measure under
    // `cargo bench`, which passes `--bench`.
    if !std::env::args().any(|a| a == "--bench") {
        println!("selection benchmark: run it with `cargo bench --bench selection`");
        return;
    }
    println!(
        "{:<16} {:>12} {:>14}",
        "strategy", "connections", "ns/selection"
    );
    for strategy in ["priority", "weighted", "round-robin", "least-used", "p2c"] {
        for (providers, per) in [(2, 5), (10, 10), (20, 50)] {
            let e = engine(providers, per, strategy);
            let snap = e.snapshot();
            let tried = Tried::default();
            let asker = Asker {
                client: None,
                lease: None,
                tried: &tried,
            };
            let run = |n: usize| {
                for _ in 0..n {
                    match e.select(&snap, 0, Family::OpenAi, &asker, None, e.now()) {
                        Selection::Picked { permit, .. } => drop(black_box(permit)),
                        _ => panic!("selection found nothing"),
                    }
                }
            };
            run(200);
            // Batches of at least 50 ms; the median of 7 batches is reported.
            let mut n = 64;
            loop {
                let t = Instant::now();
                run(n);
                if t.elapsed().as_millis() >= 50 {
                    break;
                }
                n *= 2;
            }
            let mut batches: Vec<u128> = (0..7)
                .map(|_| {
                    let t = Instant::now();
                    run(n);
                    t.elapsed().as_nanos() / n as u128
                })
                .collect();
            batches.sort_unstable();
            let per_sel = batches[3];
            println!("{strategy:<16} {:>12} {per_sel:>14}", providers * per);
        }
    }
}
