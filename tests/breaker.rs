//! Provider circuit breaker end to end (SPEC §5.1): a 503 provider opens after its
//! threshold and stops being called, HALF_OPEN lets exactly one probe through, recovery
//! closes it, and `GET /api/monitoring/health` shows each state.

// Integration tests: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::gw::{server_section, Gateway};
use common::{wait_until, Mock};
use std::time::Duration;

fn config(a: &str, b: &str) -> String {
    format!(
        "{}providers:
  - id: a
    base_url: \"{a}\"
    api: openai
    connections:
      - {{ id: ka, api_key_env: KEY }}
  - id: b
    base_url: \"{b}\"
    api: openai
    connections:
      - {{ id: kb, api_key_env: KEY }}
models:
  - name: m
    strategy: priority
    targets:
      - {{ provider: a, model: up-a }}
      - {{ provider: b, model: up-b }}
resilience:
  breaker:
    apikey: {{ degrade_at: 2, open_at: 3, reset: \"1s\" }}
",
        server_section("")
    )
}

fn state_of(gw: &Gateway, provider: &str) -> String {
    let h = gw.admin_get("/api/monitoring/health");
    assert_eq!(h.status, 200);
    h.json()["providers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["provider"] == provider)
        .map(|p| p["state"].as_str().unwrap().to_string())
        .unwrap()
}

#[test]
fn breaker_opens_probes_once_and_recovers() {
    let a = Mock::start_named("a", &["--fault", "status=503"]);
    let b = Mock::start_named("b", &[]);
    let gw = Gateway::start(&config(&a.base_url(), &b.base_url()), &[("KEY", "k")]);
    let chat = |n: usize| {
        for _ in 0..n {
            let r = gw.chat(r#"{"model":"m"}"#);
            assert_eq!(r.status, 200, "{}", r.text());
            assert_eq!(r.header("x-sluice-provider"), Some("b"));
        }
    };
    assert_eq!(state_of(&gw, "a"), "CLOSED");
    chat(2);
    assert_eq!(state_of(&gw, "a"), "DEGRADED");
    chat(1);
    assert_eq!(state_of(&gw, "a"), "OPEN");
    assert_eq!(a.route_count("/v1/chat/completions"), 3);

    // OPEN: the gateway stops calling a while b serves.
    chat(5);
    assert_eq!(
        a.route_count("/v1/chat/completions"),
        3,
        "an OPEN provider was called"
    );
    let h = gw.admin_get("/api/monitoring/health").json();
    let pa = h["providers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["provider"] == "a")
        .unwrap()
        .clone();
    assert_eq!(pa["failures"], 3);
    assert!(pa["retry_after_s"].as_u64().unwrap() >= 1);

    // After the reset timeout it reads HALF_OPEN; exactly one probe goes through even
    // when several requests arrive while the (slow, failing) probe is in flight.
    assert!(wait_until(Duration::from_secs(3), || state_of(&gw, "a") == "HALF_OPEN"));
    a.set_fault("status=503;latency=800ms");
    for (r, _) in gw.parallel_chat(5, r#"{"model":"m"}"#) {
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-sluice-provider"), Some("b"));
    }
    assert_eq!(
        a.route_count("/v1/chat/completions"),
        4,
        "HALF_OPEN admitted more than one probe"
    );
    assert_eq!(state_of(&gw, "a"), "OPEN");

    // Recovery: the next probe succeeds and closes the breaker; a serves again.
    a.set_fault("");
    assert!(wait_until(Duration::from_secs(3), || state_of(&gw, "a") == "HALF_OPEN"));
    let r = gw.chat(r#"{"model":"m"}"#);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-sluice-provider"), Some("a"));
    assert_eq!(state_of(&gw, "a"), "CLOSED");
    let r = gw.chat(r#"{"model":"m"}"#);
    assert_eq!(r.header("x-sluice-provider"), Some("a"));

    let metrics = common::request(gw.admin, "GET", "/metrics", &[], b"").text();
    assert!(
        metrics.contains("sluice_breaker_state{provider=\"a\"} 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("sluice_breaker_transitions_total{provider=\"a\",to=\"OPEN\"} 2"),
        "{metrics}"
    );
}

#[test]
fn reset_endpoint_closes_an_open_breaker() {
    let a = Mock::start_named("a", &["--fault", "status=502"]);
    let b = Mock::start_named("b", &[]);
    let gw = Gateway::start(&config(&a.base_url(), &b.base_url()), &[("KEY", "k")]);
    for _ in 0..3 {
        assert_eq!(gw.chat(r#"{"model":"m"}"#).status, 200);
    }
    assert_eq!(state_of(&gw, "a"), "OPEN");
    let r = gw.admin_post("/api/resilience/reset", r#"{"provider":"a"}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(state_of(&gw, "a"), "CLOSED");
    let r = gw.admin_post("/api/resilience/reset", r#"{"provider":"nope"}"#);
    assert_eq!(r.status, 400);
    // Unauthenticated mutation is refused.
    let r = common::request(gw.admin, "POST", "/api/resilience/reset", &[], b"{}");
    assert_eq!(r.status, 401);
}
