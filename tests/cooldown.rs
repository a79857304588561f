//! Connection cooldowns end to end (SPEC §5.3): an upstream `Retry-After` cools one
//! connection while its sibling serves; concurrent 429s raise the backoff level once;
//! a concurrency-limit 429 does not raise it and does not touch the breaker; a shared
//! quota bucket cools its siblings.

// Integration tests: a failed unwrap is a failed test, and they time the real binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod common;

use common::gw::{server_section, Gateway};
use common::{wait_until, Mock};
use std::time::{Duration, Instant};

fn config(mock: &str, target_extra: &str, conn_extra: &str, server_extra: &str) -> String {
    format!(
        "{}providers:
  - id: p
    base_url: \"{mock}\"
    api: openai
    connections:
      - {{ id: k1, api_key_env: KEY1 {conn_extra} }}
      - {{ id: k2, api_key_env: KEY2 {conn_extra} }}
models:
  - name: m
    strategy: round-robin
    targets:
      - {{ provider: p, model: up {target_extra} }}
",
        server_section(server_extra)
    )
}

const KEYS: &[(&str, &str)] = &[("KEY1", "key-1"), ("KEY2", "key-2")];

fn conn_row(gw: &Gateway, id: &str) -> serde_json::Value {
    gw.cooldown_row("p", id)
}

fn calls(mock: &Mock, key: &str) -> u64 {
    mock.stats()["by_credential"][key].as_u64().unwrap_or(0)
}

#[test]
fn retry_after_cools_one_connection_while_the_sibling_serves() {
    let mock = Mock::start(&["--fault", "status=429;retry_after=2;credential=key-1"]);
    let gw = Gateway::start(&config(&mock.base_url(), "", "", ""), KEYS);
    let cooled_at = Instant::now();
    let r = gw.chat(r#"{"model":"m"}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-sluice-connection"), Some("k2"));
    assert_eq!(calls(&mock, "key-1"), 1);
    let row = conn_row(&gw, "k1");
    assert_eq!(row["state"], "cooling");
    assert_eq!(row["last_status"], 429);
    assert_eq!(row["last_error_reason"], "rate_limit_exceeded");
    assert_eq!(
        row["backoff_level"], 0,
        "an explicit Retry-After resets the level"
    );
    let remaining = row["remaining_s"].as_u64().unwrap();
    assert!((1..=2).contains(&remaining), "remaining {remaining}");

    mock.set_fault("");
    // While cooling, every request goes to k2 and k1's count does not move.
    while cooled_at.elapsed() < Duration::from_millis(1500) {
        let r = gw.chat(r#"{"model":"m"}"#);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-sluice-connection"), Some("k2"));
    }
    assert_eq!(calls(&mock, "key-1"), 1);
    // Once the 2 s are over, k1 is used again.
    assert!(wait_until(Duration::from_secs(3), || {
        gw.chat(r#"{"model":"m"}"#).header("x-sluice-connection") == Some("k1")
    }));
    assert!(
        cooled_at.elapsed() >= Duration::from_secs(2),
        "k1 came back before Retry-After"
    );
    assert_eq!(conn_row(&gw, "k1")["state"], "ok");
}

#[test]
fn concurrent_429s_raise_the_backoff_level_once() {
    // Every request is pinned to k1 and fails slowly, so all 20 start before the first
    // failure sets the cooldown.
    let mock = Mock::start(&["--fault", "status=429;latency=400ms;credential=key-1"]);
    let gw = Gateway::start(
        &config(
            &mock.base_url(),
            ", connection: k1",
            "",
            "  max_attempts: 1",
        ),
        KEYS,
    );
    let statuses: Vec<u16> = gw
        .parallel_chat(20, r#"{"model":"m"}"#)
        .into_iter()
        .map(|(r, _)| r.status)
        .collect();
    assert!(statuses.iter().all(|s| *s == 429), "{statuses:?}");
    assert_eq!(calls(&mock, "key-1"), 20);
    let row = conn_row(&gw, "k1");
    assert_eq!(row["state"], "cooling");
    assert_eq!(
        row["backoff_level"], 1,
        "20 concurrent failures must raise the level once: {row}"
    );
}

#[test]
fn concurrency_limit_429_keeps_the_level_and_the_breaker() {
    let body = r#"{"error":{"message":"too many concurrent requests for this key"}}"#;
    let mock = Mock::start(&[
        "--fault",
        &format!("status=429;credential=key-1;body={body}"),
    ]);
    let gw = Gateway::start(&config(&mock.base_url(), "", "", ""), KEYS);
    let r = gw.chat(r#"{"model":"m"}"#);
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-sluice-connection"),
        Some("k2"),
        "concurrency limit fails over at once"
    );
    let row = conn_row(&gw, "k1");
    assert_eq!(row["last_error_reason"], "concurrency_limited");
    assert_eq!(row["backoff_level"], 0);
    assert!(
        row["remaining_s"].as_u64().unwrap() <= 1,
        "fixed 1 s cooldown: {row}"
    );
    let h = gw.admin_get("/api/monitoring/health").json();
    assert_eq!(h["providers"][0]["state"], "CLOSED");
    assert_eq!(h["providers"][0]["failures"], 0);
}

#[test]
fn quota_exhaustion_cools_the_whole_bucket() {
    let body = r#"{"error":{"message":"You exceeded your current quota, quota exceeded"}}"#;
    let mock = Mock::start(&[
        "--fault",
        &format!("status=429;retry_after=30;credential=key-1;body={body}"),
    ]);
    let gw = Gateway::start(&config(&mock.base_url(), "", ", bucket: org-1", ""), KEYS);
    let r = gw.chat(r#"{"model":"m"}"#);
    // k1 hit the quota; k2 shares the bucket and is cooled too: nothing left to try.
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(calls(&mock, "key-2"), 0);
    assert_eq!(conn_row(&gw, "k1")["last_error_reason"], "quota_exhausted");
    assert_eq!(conn_row(&gw, "k2")["state"], "cooling");
    // Every target is rate-limited with a known reset and the combo wait never waits
    // on an exhausted quota: 429 rate_limit_error with the reset, at once.
    let r = gw.chat(r#"{"model":"m"}"#);
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "rate_limit_error");
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((25..=30).contains(&retry), "retry-after {retry}");
    assert_eq!(r.json()["error"]["retry_after_s"], retry);
    assert!(r.json()["error"]["reset_at"]
        .as_str()
        .unwrap()
        .ends_with('Z'));
    let excluded = r.json()["error"]["diagnostics"]["excluded"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(excluded.len(), 2);
    assert!(excluded
        .iter()
        .all(|e| e["reason"] == "connection_cooldown"));
    assert_eq!(calls(&mock, "key-2"), 0);

    // The operator clears the cooldowns; both keys serve again.
    mock.set_fault("");
    let r = gw.admin_post(
        "/api/resilience/cooldowns",
        r#"{"all": true, "provider": "p"}"#,
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["cleared"], 2);
    assert_eq!(gw.chat(r#"{"model":"m"}"#).status, 200);
}
