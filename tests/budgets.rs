//! The request's budget (SPEC §5.8): when nothing can run, the client is answered at
//! once with `Retry-After`, never held for a timer it cannot outlast and then given a 504.

// Integration tests: a failed unwrap is a failed test, and they time the real binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod common;

use common::gw::{server_section, Gateway};
use common::Mock;
use std::time::{Duration, Instant};

fn config(a: &str, b: &str, class: &str, resilience: &str) -> String {
    format!(
        "{}providers:
  - id: a
    base_url: \"{a}\"
    api: openai
    class: {class}
    connections: [ {{ id: ka, api_key_env: KEY }} ]
  - id: b
    base_url: \"{b}\"
    api: openai
    class: {class}
    connections: [ {{ id: kb, api_key_env: KEY }} ]
models:
  - name: m
    strategy: priority
    targets:
      - {{ provider: a, model: up-a }}
      - {{ provider: b, model: up-b }}
{resilience}",
        server_section("")
    )
}

const KEY: &[(&str, &str)] = &[("KEY", "k")];

#[test]
fn both_breakers_open_answers_503_at_once_with_the_half_open_time() {
    // class local: a breaker opens after 2 failures and half-opens 15 s later.
    let a = Mock::start_named("a", &["--fault", "status=500"]);
    let b = Mock::start_named("b", &["--fault", "status=500"]);
    let gw = Gateway::start(&config(&a.base_url(), &b.base_url(), "local", ""), KEY);
    for _ in 0..2 {
        // Both targets fail: the last upstream error is passed through.
        assert_eq!(gw.chat(r#"{"model":"m"}"#).status, 500);
    }
    let calls = a.route_count("/v1/chat/completions") + b.route_count("/v1/chat/completions");
    assert_eq!(calls, 4);

    // Both breakers are open now, with the default 10 min execution timeout and the
    // combo wait on: the answer must not wait for a breaker.
    for _ in 0..3 {
        let t = Instant::now();
        let r = gw.chat(r#"{"model":"m"}"#);
        let took = t.elapsed();
        assert_eq!(r.status, 503, "{}", r.text());
        assert!(took < Duration::from_secs(1), "held for {took:?}");
        let j = r.json();
        assert_eq!(j["error"]["code"], "all_targets_cooling_down");
        let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
        assert!((1..=15).contains(&retry), "Retry-After {retry}");
        let excluded = j["error"]["diagnostics"]["excluded"].as_array().unwrap();
        assert_eq!(excluded.len(), 2, "{j}");
        for e in excluded {
            assert_eq!(e["reason"], "circuit_open");
            assert!(e["retry_after_s"].as_u64().unwrap() <= 15);
        }
    }
    let after = a.route_count("/v1/chat/completions") + b.route_count("/v1/chat/completions");
    assert_eq!(after, calls, "an open breaker was called");
}

#[test]
fn a_rate_limit_longer_than_the_budget_is_answered_at_once() {
    // 30 s rate limits on both targets, an 8 s execution budget: waiting cannot help.
    let a = Mock::start_named("a", &["--fault", "status=429;retry_after=30"]);
    let b = Mock::start_named("b", &["--fault", "status=429;retry_after=30"]);
    let gw = Gateway::start(
        &config(
            &a.base_url(),
            &b.base_url(),
            "apikey",
            "resilience:\n  queue: { execution_timeout: \"8s\" }\n",
        ),
        KEY,
    );
    let t = Instant::now();
    let r = gw.chat(r#"{"model":"m"}"#);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "held {:?}",
        t.elapsed()
    );
    // Both tried: the last upstream 429 is passed through with its Retry-After.
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("30"));
    assert_eq!(r.header("x-sluice-attempts"), Some("2"));

    // Nothing is tried now: Sluice answers the rate limit itself, at once.
    let t = Instant::now();
    let r = gw.chat(r#"{"model":"m"}"#);
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "held {:?}",
        t.elapsed()
    );
    assert_eq!(r.status, 429, "{}", r.text());
    let j = r.json();
    assert_eq!(j["error"]["code"], "rate_limit_error");
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((25..=30).contains(&retry), "Retry-After {retry}");
    assert_eq!(j["error"]["retry_after_s"].as_u64(), Some(retry));
    assert!(j["error"]["reset_at"].as_str().is_some());
    assert_eq!(
        a.route_count("/v1/chat/completions") + b.route_count("/v1/chat/completions"),
        2
    );
}

#[test]
fn a_short_rate_limit_within_the_budget_is_still_waited_for() {
    let a = Mock::start_named("a", &["--fault", "status=429;retry_after=1;times=1"]);
    let b = Mock::start_named("b", &["--fault", "status=429;retry_after=1;times=1"]);
    let gw = Gateway::start(
        &config(
            &a.base_url(),
            &b.base_url(),
            "apikey",
            "resilience:\n  queue: { execution_timeout: \"8s\" }\n",
        ),
        KEY,
    );
    let t = Instant::now();
    let r = gw.chat(r#"{"model":"m"}"#);
    let took = t.elapsed();
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        took >= Duration::from_millis(800) && took < Duration::from_secs(4),
        "took {took:?}"
    );
}
