//! Combo cooldown-aware wait (SPEC §5.8): when both targets of a model answer 429 with
//! `Retry-After: 2`, the client gets a 200 after about 2 s instead of a 429; with an
//! exhausted quota it gets the 429 at once.

// Integration tests: a failed unwrap is a failed test, and they time the real binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod common;

use common::gw::{server_section, Gateway};
use common::Mock;
use std::time::{Duration, Instant};

fn config(a: &str, b: &str, model_extra: &str) -> String {
    format!(
        "{}providers:
  - id: a
    base_url: \"{a}\"
    api: openai
    connections: [ {{ id: ka, api_key_env: KEY }} ]
  - id: b
    base_url: \"{b}\"
    api: openai
    connections: [ {{ id: kb, api_key_env: KEY }} ]
models:
  - name: m
    {model_extra}
    targets:
      - {{ provider: a, model: up-a }}
      - {{ provider: b, model: up-b }}
",
        server_section("")
    )
}

#[test]
fn both_targets_rate_limited_waits_and_answers_200() {
    let a = Mock::start_named("a", &["--fault", "status=429;retry_after=2;times=1"]);
    let b = Mock::start_named("b", &["--fault", "status=429;retry_after=2;times=1"]);
    let gw = Gateway::start(
        &config(&a.base_url(), &b.base_url(), "strategy: priority"),
        &[("KEY", "k")],
    );
    let t = Instant::now();
    let r = gw.chat(r#"{"model":"m"}"#);
    let took = t.elapsed();
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        took >= Duration::from_millis(1800) && took < Duration::from_secs(5),
        "took {took:?}"
    );
    assert_eq!(r.header("x-sluice-attempts"), Some("3"));
    assert_eq!(
        a.route_count("/v1/chat/completions") + b.route_count("/v1/chat/completions"),
        3
    );
}

#[test]
fn quota_exhausted_gets_the_429_at_once() {
    let body = r#"{"error":{"message":"You exceeded your current quota (quota exceeded)"}}"#;
    let fault = format!("status=429;retry_after=2;body={}", body.replace(';', "\\;"));
    let a = Mock::start_named("a", &["--fault", &fault]);
    let b = Mock::start_named("b", &["--fault", &fault]);
    let gw = Gateway::start(
        &config(&a.base_url(), &b.base_url(), "strategy: priority"),
        &[("KEY", "k")],
    );
    let t = Instant::now();
    let r = gw.chat(r#"{"model":"m"}"#);
    assert_eq!(r.status, 429, "{}", r.text());
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "no wait on an exhausted quota: {:?}",
        t.elapsed()
    );
    assert_eq!(r.header("retry-after"), Some("2"));
}

#[test]
fn opted_out_model_answers_rate_limit_error_at_once() {
    let a = Mock::start_named("a", &["--fault", "status=429;retry_after=2"]);
    let b = Mock::start_named("b", &["--fault", "status=429;retry_after=2"]);
    let gw = Gateway::start(
        &config(&a.base_url(), &b.base_url(), "cooldown_wait: false"),
        &[("KEY", "k")],
    );
    assert_eq!(gw.chat(r#"{"model":"m"}"#).status, 429);
    // Both connections are now cooling with a known reset: a fresh request gets
    // 429 rate_limit_error with retry_after_s and reset_at, without waiting.
    let t = Instant::now();
    let r = gw.chat(r#"{"model":"m"}"#);
    assert_eq!(r.status, 429);
    assert!(t.elapsed() < Duration::from_millis(1000));
    let e = &r.json()["error"];
    assert_eq!(e["code"], "rate_limit_error");
    assert!(e["retry_after_s"].as_u64().unwrap() <= 2);
    assert!(e["reset_at"].is_string());
}
