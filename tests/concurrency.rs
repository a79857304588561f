//! Concurrency caps and queue admission (SPEC §5.7): a cap of 1 never lets the upstream
//! see two requests at once and still answers everyone; `queue.max_depth` rejects the
//! excess at once; a timed-out wait fails open by default and answers 503 when not.

// Integration tests: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::gw::{server_section, Gateway};
use common::Mock;
use std::time::Duration;

fn config(mock: &str, queue: &str) -> String {
    format!(
        "{}providers:
  - id: p
    base_url: \"{mock}\"
    api: openai
    connections:
      - {{ id: k1, api_key_env: KEY, max_concurrent: 1 }}
models:
  - name: m
    targets: [ {{ provider: p, model: up }} ]
resilience:
  queue: {{ {queue} }}
",
        server_section("  max_attempts: 1")
    )
}

fn parallel(gw: &Gateway, n: usize) -> Vec<(u16, Duration, String)> {
    gw.parallel_chat(n, r#"{"model":"m"}"#)
        .into_iter()
        .map(|(r, t)| {
            let code = r.json()["error"]["code"].as_str().unwrap_or("").to_string();
            (r.status, t, code)
        })
        .collect()
}

#[test]
fn cap_of_one_serialises_upstream_calls_and_answers_everyone() {
    let mock = Mock::start(&["--fault", "latency=100ms"]);
    let gw = Gateway::start(&config(&mock.base_url(), "wait: \"30s\""), &[("KEY", "k")]);
    let results = parallel(&gw, 10);
    assert!(results.iter().all(|(s, _, _)| *s == 200), "{results:?}");
    let st = mock.stats();
    assert_eq!(
        st["max_inflight"], 1,
        "the mock saw more than one request at once"
    );
    assert_eq!(st["total"], 10);
    let m = common::request(gw.admin, "GET", "/metrics", &[], b"").text();
    assert!(
        m.contains("sluice_queue_depth{connection=\"k1\",provider=\"p\"} 0"),
        "{m}"
    );
    assert!(
        m.contains("sluice_inflight{connection=\"k1\",provider=\"p\"} 0"),
        "{m}"
    );
}

#[test]
fn queue_max_depth_rejects_the_excess_at_once() {
    let mock = Mock::start(&["--fault", "latency=1500ms"]);
    let gw = Gateway::start(
        &config(&mock.base_url(), "max_depth: 2, wait: \"30s\""),
        &[("KEY", "k")],
    );
    let results = parallel(&gw, 10);
    let ok = results.iter().filter(|(s, _, _)| *s == 200).count();
    let full: Vec<_> = results
        .iter()
        .filter(|(s, _, c)| *s == 429 && c == "RATE_LIMIT_QUEUE_FULL")
        .collect();
    assert_eq!(ok + full.len(), 10, "{results:?}");
    assert!(
        full.len() >= 6,
        "one in flight + two waiting; the rest must be refused: {results:?}"
    );
    assert!(
        full.iter()
            .all(|(_, t, _)| *t < Duration::from_millis(1000)),
        "rejections must be immediate: {results:?}"
    );
    assert_eq!(mock.stats()["max_inflight"], 1);
    let m = common::request(gw.admin, "GET", "/metrics", &[], b"").text();
    assert!(
        m.contains(&format!(
            "sluice_queue_rejections_total{{reason=\"queue_full\"}} {}",
            full.len()
        )),
        "{m}"
    );
}

#[test]
fn a_timed_out_wait_fails_open_by_default() {
    let mock = Mock::start(&["--fault", "latency=1s"]);
    let gw = Gateway::start(
        &config(&mock.base_url(), "wait: \"200ms\""),
        &[("KEY", "k")],
    );
    let results = parallel(&gw, 2);
    assert!(results.iter().all(|(s, _, _)| *s == 200), "{results:?}");
    assert_eq!(
        mock.stats()["max_inflight"],
        2,
        "fail-open proceeds without a permit"
    );
}

#[test]
fn a_timed_out_wait_answers_503_when_not_failing_open() {
    let mock = Mock::start(&["--fault", "latency=1s"]);
    let gw = Gateway::start(
        &config(&mock.base_url(), "wait: \"200ms\", fail_open: false"),
        &[("KEY", "k")],
    );
    let mut results = parallel(&gw, 2);
    results.sort_by_key(|r| r.0);
    assert_eq!(results[0].0, 200);
    assert_eq!(results[1].0, 503);
    assert_eq!(results[1].2, "RATE_LIMIT_QUEUE_TIMEOUT");
    assert_eq!(mock.stats()["max_inflight"], 1);
}
