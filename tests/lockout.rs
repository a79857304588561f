//! Model lockouts (SPEC §5.4): a 404 locks only that model on that connection, a 429
//! locks its quota family, successes decay the count, the DELETE endpoint re-enables.

// Integration tests: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::gw::{server_section, Gateway};
use common::{wait_until, Mock};
use std::time::Duration;

fn config(mock: &str, base: &str) -> String {
    format!(
        "{}providers:
  - id: p
    base_url: \"{mock}\"
    api: openai
    connections:
      - {{ id: k1, api_key_env: KEY }}
models:
  - name: alpha
    targets: [ {{ provider: p, model: up-alpha }} ]
  - name: beta
    targets: [ {{ provider: p, model: up-beta, quota_family: fam }} ]
  - name: gamma
    targets: [ {{ provider: p, model: up-gamma, quota_family: fam }} ]
resilience:
  model_lockout: {{ enabled: true, base_cooldown: \"{base}\", max_cooldown: \"10m\" }}
",
        server_section("  max_attempts: 1")
    )
}

fn lockouts(gw: &Gateway) -> Vec<serde_json::Value> {
    let r = gw.admin_get("/api/resilience/model-cooldowns");
    assert_eq!(r.status, 200);
    r.json()["lockouts"].as_array().unwrap().clone()
}

fn chat(gw: &Gateway, model: &str) -> common::Response {
    gw.chat(&format!("{{\"model\":\"{model}\"}}"))
}

#[test]
fn not_found_locks_only_that_model_and_delete_re_enables() {
    let mock = Mock::start(&["--fault", "status=404;model=up-alpha"]);
    let gw = Gateway::start(&config(&mock.base_url(), "120s"), &[("KEY", "k")]);
    assert_eq!(chat(&gw, "alpha").status, 404);
    let l = lockouts(&gw);
    assert_eq!(l.len(), 1, "{l:?}");
    assert_eq!(l[0]["model"], "up-alpha");
    assert_eq!(l[0]["connection"], "k1");
    assert_eq!(l[0]["reason"], "not_found");
    // alpha is locked (no upstream call), beta on the same connection still works.
    let r = chat(&gw, "alpha");
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "all_targets_cooling_down");
    assert_eq!(
        r.json()["error"]["diagnostics"]["excluded"][0]["reason"],
        "model_lockout"
    );
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((110..=120).contains(&retry), "{retry}");
    assert_eq!(chat(&gw, "beta").status, 200);
    assert_eq!(mock.route_count("/v1/chat/completions"), 2);

    mock.set_fault("");
    let r = gw.admin_delete(
        "/api/resilience/model-cooldowns",
        r#"{"provider":"p","connection":"k1","model":"up-alpha"}"#,
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["removed"], true);
    assert_eq!(chat(&gw, "alpha").status, 200);
    assert!(lockouts(&gw).is_empty());
}

#[test]
fn rate_limit_locks_the_quota_family() {
    let mock = Mock::start(&["--fault", "status=429;model=up-beta"]);
    let gw = Gateway::start(&config(&mock.base_url(), "120s"), &[("KEY", "k")]);
    assert_eq!(chat(&gw, "beta").status, 429);
    let l = lockouts(&gw);
    assert_eq!(l.len(), 1, "{l:?}");
    assert_eq!(l[0]["model"], "fam");
    mock.set_fault("");
    // gamma shares the family: locked without an upstream call; alpha is not.
    let before = mock.route_count("/v1/chat/completions");
    // Locked for 120 s (longer than the combo wait's max_wait): 429 at once.
    let r = chat(&gw, "gamma");
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "rate_limit_error");
    assert!(r.json()["error"]["diagnostics"]["excluded"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["reason"] == "model_lockout"));
    assert_eq!(mock.route_count("/v1/chat/completions"), before);
    assert_eq!(chat(&gw, "alpha").status, 200);
}

#[test]
fn successes_decay_the_failure_count() {
    let mock = Mock::start(&["--fault", "status=503;model=up-alpha"]);
    let gw = Gateway::start(&config(&mock.base_url(), "1s"), &[("KEY", "k")]);
    assert_eq!(chat(&gw, "alpha").status, 503);
    // Second failure once the first lock ran out: the count goes to 2, cooldown doubles.
    assert!(wait_until(Duration::from_secs(3), || chat(&gw, "alpha")
        .header("x-sluice-attempts")
        == Some("1")));
    let l = lockouts(&gw);
    assert_eq!(l[0]["failures"], 2, "{l:?}");
    assert_eq!(l[0]["remaining_s"], 2);
    mock.set_fault("");
    // Success after expiry halves the count (2 → 1), the next one deletes the entry.
    assert!(wait_until(Duration::from_secs(4), || chat(&gw, "alpha")
        .status
        == 200));
    let l = lockouts(&gw);
    assert_eq!(l.len(), 1, "{l:?}");
    assert_eq!(l[0]["failures"], 1);
    assert_eq!(l[0]["active"], false);
    assert_eq!(chat(&gw, "alpha").status, 200);
    assert!(lockouts(&gw).is_empty());
}
