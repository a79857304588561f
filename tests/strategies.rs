//! Each strategy's distribution over many requests matches its definition (SPEC §5.12),
//! counted by the mock upstream per credential.

// Integration tests: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::gw::{server_section, Gateway};
use common::Mock;

/// One provider per target (each with its own key), so the mock's per-credential
/// counts are per-target counts.
fn config(mock: &str, strategy: &str, targets: &[&str], conn_extra: &str) -> String {
    let mut providers = String::new();
    let mut ts = String::new();
    for (i, extra) in targets.iter().enumerate() {
        providers.push_str(&format!(
            "  - id: p{i}\n    base_url: \"{mock}\"\n    api: openai\n    connections:\n      - {{ id: c, api_key_env: KEY{i} {conn_extra} }}\n"
        ));
        ts.push_str(&format!(
            "      - {{ provider: p{i}, model: up-{i} {extra} }}\n"
        ));
    }
    format!("{}providers:\n{providers}models:\n  - name: m\n    strategy: {strategy}\n    targets:\n{ts}", server_section(""))
}

const ENV: &[(&str, &str)] = &[("KEY0", "t0"), ("KEY1", "t1"), ("KEY2", "t2")];

fn run(strategy: &str, targets: &[&str], n: usize) -> (Vec<u64>, Vec<String>) {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(&config(&mock.base_url(), strategy, targets, ""), ENV);
    let order: Vec<String> = (0..n)
        .map(|_| {
            let r = gw.chat(r#"{"model":"m"}"#);
            assert_eq!(r.status, 200, "{}", r.text());
            r.header("x-sluice-provider").unwrap().to_string()
        })
        .collect();
    let by = mock.stats()["by_credential"].clone();
    let counts = (0..targets.len())
        .map(|i| by[format!("t{i}")].as_u64().unwrap_or(0))
        .collect();
    (counts, order)
}

#[test]
fn weighted_follows_the_weights_exactly() {
    let (counts, _) = run("weighted", &[", weight: 3", ", weight: 1", ""], 50);
    assert_eq!(counts, vec![30, 10, 10]);
}

#[test]
fn round_robin_rotates_in_order() {
    let (counts, order) = run("round-robin", &["", "", ""], 9);
    assert_eq!(counts, vec![3, 3, 3]);
    assert_eq!(&order[..6], &["p0", "p1", "p2", "p0", "p1", "p2"]);
}

#[test]
fn priority_and_fill_first_stay_on_the_first_target() {
    assert_eq!(run("priority", &["", "", ""], 10).0, vec![10, 0, 0]);
    // Sequential requests never fill the first connection: it takes them all.
    assert_eq!(run("fill-first", &["", "", ""], 10).0, vec![10, 0, 0]);
}

#[test]
fn cost_optimized_takes_the_cheapest() {
    assert_eq!(
        run(
            "cost-optimized",
            &[", cost: 3.0", ", cost: 0.5", ", cost: 1.0"],
            10
        )
        .0,
        vec![0, 10, 0]
    );
}

#[test]
fn least_used_spreads_sequential_load() {
    let (counts, _) = run("least-used", &["", "", ""], 30);
    assert_eq!(counts, vec![10, 10, 10]);
}

#[test]
fn random_and_p2c_use_every_target() {
    for s in ["random", "p2c"] {
        let (counts, _) = run(s, &["", "", ""], 90);
        assert_eq!(counts.iter().sum::<u64>(), 90);
        assert!(counts.iter().all(|c| *c >= 10), "{s}: {counts:?}");
    }
}

#[test]
fn fill_first_spills_when_the_first_connection_is_full() {
    let mock = Mock::start(&["--fault", "latency=500ms"]);
    let gw = Gateway::start(
        &config(
            &mock.base_url(),
            "fill-first",
            &["", "", ""],
            ", max_concurrent: 2",
        ),
        ENV,
    );
    assert!(gw
        .parallel_chat(5, r#"{"model":"m"}"#)
        .iter()
        .all(|(r, _)| r.status == 200));
    let by = mock.stats()["by_credential"].clone();
    assert_eq!(by["t0"], 2, "{by}");
    assert_eq!(by["t1"], 2, "{by}");
    assert_eq!(by["t2"], 1, "{by}");
}
