//! Admin listener: health, readiness, metrics after real traffic, token-gated `/api/*`
//! that never shows credentials.

// Integration tests: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::gw::{server_section, Gateway, ADMIN_TOKEN};
use common::{request, wait_until, Mock};
use std::time::Duration;

fn config(mock: &str) -> String {
    format!(
        "{}providers:
  - id: p
    base_url: \"{mock}\"
    api: openai
    connections:
      - {{ id: c1, api_key_env: KEY }}
      - {{ id: c2, api_key_env: KEY2 }}
models:
  - name: m
    strategy: round-robin
    targets:
      - {{ provider: p, model: up }}
",
        server_section("")
    )
}

const KEYS: &[(&str, &str)] = &[
    ("KEY", "admin-test-secret-1"),
    ("KEY2", "admin-test-secret-2"),
];

#[test]
fn health_ready_and_metrics() {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(&config(&mock.base_url()), KEYS);
    assert_eq!(request(gw.admin, "GET", "/health", &[], b"").status, 200);
    let ready = request(gw.admin, "GET", "/ready", &[], b"");
    assert_eq!(ready.status, 200);
    assert_eq!(ready.json()["ready"], true);

    for _ in 0..4 {
        let r = request(
            gw.client,
            "POST",
            "/v1/chat/completions",
            &[],
            br#"{"model":"m"}"#,
        );
        assert_eq!(r.status, 200);
    }
    let r = request(
        gw.client,
        "POST",
        "/v1/chat/completions",
        &[],
        br#"{"model":"zzz"}"#,
    );
    assert_eq!(r.status, 404);
    // Connections of a target rotate round-robin: 2 calls on each key.
    let by = &mock.stats()["by_credential"];
    assert_eq!(by["admin-test-secret-1"], 2, "{by}");
    assert_eq!(by["admin-test-secret-2"], 2, "{by}");

    // Counters of the finish phase are written just after the response: poll.
    let needles = [
        "sluice_requests_total{model=\"m\",route=\"chat_completions\",status=\"200\"} 4",
        "sluice_requests_total{model=\"unknown\",route=\"chat_completions\",status=\"404\"} 1",
        "sluice_attempts_total{connection=\"c1\",outcome=\"ok\",provider=\"p\"} 2",
        "sluice_request_duration_seconds_count{model=\"m\"} 4",
        "sluice_ttfb_seconds_count{model=\"m\"} 4",
        "sluice_inflight{connection=\"c1\",provider=\"p\"} 0",
        // Startup is not a reload.
        "sluice_config_reloads_total{result=\"ok\"} 0",
        "sluice_store_write_errors_total 0",
    ];
    let mut m = String::new();
    let all_there = wait_until(Duration::from_secs(5), || {
        m = request(gw.admin, "GET", "/metrics", &[], b"").text();
        needles.iter().all(|n| m.contains(n))
    });
    for needle in needles {
        assert!(
            all_there && m.contains(needle),
            "missing {needle:?} in metrics:\n{m}"
        );
    }
    assert!(!m.contains("zzz"), "client input became a label");
}

#[test]
fn api_needs_the_admin_token_and_hides_secrets() {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(&config(&mock.base_url()), KEYS);
    let r = request(gw.admin, "GET", "/api/config", &[], b"");
    assert_eq!(r.status, 401);
    let r = request(
        gw.admin,
        "GET",
        "/api/config",
        &[("authorization", "Bearer nope")],
        b"",
    );
    assert_eq!(r.status, 401);
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let r = request(
        gw.admin,
        "GET",
        "/api/config",
        &[("authorization", &auth)],
        b"",
    );
    assert_eq!(r.status, 200);
    let j = r.json();
    assert_eq!(j["providers"][0]["connections"][1]["id"], "c2");
    assert_eq!(j["providers"][0]["connections"][1]["credential"], "set");
    assert_eq!(j["models"][0]["strategy"], "round-robin");
    assert!(
        !r.text().contains("admin-test-secret"),
        "credential leaked: {}",
        r.text()
    );
    let r = request(
        gw.admin,
        "GET",
        "/api/nope",
        &[("authorization", &auth)],
        b"",
    );
    assert_eq!(r.status, 404);
}
