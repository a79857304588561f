//! Status restatement and classification rules from `rules/`, and their hot reload: a
//! broken rule file leaves the previous rules serving and shows the error.

// Integration tests: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::gw::{server_section, Gateway};
use common::{wait_until, Mock};
use std::time::Duration;

const RESTATE: &str = r#"rules:
  - id: misstated-quota
    provider: "*"
    from_statuses: [403]
    to_status: 429
    text_markers: ["用户额度不足", "额度不足"]
    exclude_markers: ["无权访问模型"]
    retry_after_s: 45
"#;

fn config(mock: &str) -> String {
    format!(
        "{}providers:
  - id: glm
    base_url: \"{mock}\"
    api: openai
    connections:
      - {{ id: k1, api_key_env: KEY }}
models:
  - name: m
    targets: [ {{ provider: glm, model: glm-4 }} ]
",
        server_section("  max_attempts: 1")
    )
}

fn last_reload(gw: &Gateway) -> serde_json::Value {
    gw.admin_get("/api/config").json()["last_reload"].clone()
}

#[test]
fn misstated_quota_403_is_restated_unless_excluded() {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(&config(&mock.base_url()), &[("KEY", "k")]);
    gw.write_rules("restatement.yaml", RESTATE);
    let r = gw.admin_post("/api/config/reload", "");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        gw.admin_get("/api/config").json()["rules"]["restatement"],
        1
    );

    mock.set_fault(r#"status=403;body={"error":{"message":"用户额度不足，请充值"}}"#);
    let r = gw.chat(r#"{"model":"m"}"#);
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("45"));
    assert!(
        r.text().contains("用户额度不足"),
        "the upstream body is kept"
    );
    let row = gw.admin_get("/api/resilience/cooldowns").json()["connections"][0].clone();
    assert_eq!(row["last_status"], 429);
    assert_eq!(row["state"], "cooling");

    gw.admin_post("/api/resilience/cooldowns", r#"{"all": true}"#);
    mock.set_fault(r#"status=403;body={"error":{"message":"额度不足: 无权访问模型 glm-4"}}"#);
    let r = gw.chat(r#"{"model":"m"}"#);
    assert_eq!(
        r.status,
        403,
        "an excluded marker must never be restated: {}",
        r.text()
    );
    let metrics = common::request(gw.admin, "GET", "/metrics", &[], b"").text();
    assert!(
        metrics.contains("sluice_restatements_total{rule=\"misstated-quota\"} 1"),
        "{metrics}"
    );
}

#[test]
fn escaped_markers_restate_like_the_text_they_stand_for() {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(&config(&mock.base_url()), &[("KEY", "k")]);
    gw.write_rules("restatement.yaml", RESTATE);
    assert_eq!(gw.admin_post("/api/config/reload", "").status, 200);

    // `用户额度不足` as an ASCII-only JSON encoder writes it (`\\` is one backslash in
    // the mock's fault grammar).
    mock.set_fault(
        r#"status=403;body={"error":{"message":"\\u7528\\u6237\\u989D\\u5ea6\\u4e0d\\u8db3"}}"#,
    );
    let r = gw.chat(r#"{"model":"m"}"#);
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("45"));
    assert!(
        r.text().contains(r"\u7528"),
        "the upstream body is kept: {}",
        r.text()
    );

    // An escaped exclude marker (`无权访问模型`) still keeps the 403 as it is.
    gw.admin_post("/api/resilience/cooldowns", r#"{"all": true}"#);
    mock.set_fault(
        r#"status=403;body={"error":{"message":"\\u989d\\u5ea6\\u4e0d\\u8db3: \\u65e0\\u6743\\u8bbf\\u95ee\\u6a21\\u578b"}}"#,
    );
    let r = gw.chat(r#"{"model":"m"}"#);
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(mock.route_count("/v1/chat/completions"), 2);
}

#[test]
fn classification_rule_applies_to_400() {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(&config(&mock.base_url()), &[("KEY", "k")]);
    gw.write_rules(
        "classification.yaml",
        "rules:\n  - { id: overloaded-400, provider: glm, status: [400], match: [\"model is overloaded\"], reason: server_error, scope: provider }\n",
    );
    assert_eq!(gw.admin_post("/api/config/reload", "").status, 200);
    mock.set_fault(r#"status=400;body={"error":{"message":"the model is overloaded, try later"}}"#);
    let r = gw.chat(r#"{"model":"m"}"#);
    assert_eq!(r.status, 400);
    let h = gw.admin_get("/api/monitoring/health").json();
    assert_eq!(
        h["providers"][0]["failures"], 1,
        "the rule made a 400 count for the breaker"
    );
    let metrics = common::request(gw.admin, "GET", "/metrics", &[], b"").text();
    assert!(
        metrics
            .contains("sluice_classifications_total{reason=\"server_error\",scope=\"provider\"} 1"),
        "{metrics}"
    );
}

#[test]
fn broken_rule_file_keeps_previous_rules_serving() {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(&config(&mock.base_url()), &[("KEY", "k")]);
    gw.write_rules("restatement.yaml", RESTATE);
    // Picked up by the file watcher (polls every second), no explicit reload.
    assert!(wait_until(Duration::from_secs(5), || gw
        .admin_get("/api/config")
        .json()["rules"]["restatement"]
        == 1));

    gw.write_rules("restatement.yaml", "rules:\n  - id: x\n    provider: \"*\"\n    from_statuses: [403]\n    to_status: 999\n    text_markers: []\n");
    assert!(wait_until(Duration::from_secs(5), || last_reload(&gw)
        ["ok"]
        == false));
    let lr = last_reload(&gw);
    let error = lr["error"].as_str().unwrap();
    assert!(
        error.contains("restatement.yaml") && error.contains("rules[0]"),
        "{error}"
    );
    let r = gw.admin_post("/api/config/reload", "");
    assert_eq!(r.status, 422);
    // The previous rule still restates.
    mock.set_fault(r#"status=403;body={"error":{"message":"额度不足"}}"#);
    let r = gw.chat(r#"{"model":"m"}"#);
    assert_eq!(r.status, 429);
    // The watcher's failed reload and the admin's.
    let failed = gw.metric("sluice_config_reloads_total{result=\"error\"}");
    assert!(failed.is_some_and(|n| n >= 2.0), "{failed:?}");

    // Fixing the file recovers.
    gw.write_rules("restatement.yaml", RESTATE);
    assert!(wait_until(Duration::from_secs(5), || last_reload(&gw)
        ["ok"]
        == true));
}

#[test]
fn config_reload_swaps_routing_and_rejects_a_broken_config() {
    let a = Mock::start_named("a", &[]);
    let b = Mock::start_named("b", &[]);
    let gw = Gateway::start(&config(&a.base_url()), &[("KEY", "k")]);
    assert_eq!(gw.chat(r#"{"model":"m"}"#).header("x-mock-name"), Some("a"));
    gw.rewrite_config(&config(&b.base_url()));
    assert!(wait_until(Duration::from_secs(5), || gw
        .chat(r#"{"model":"m"}"#)
        .header("x-mock-name")
        == Some("b")));
    gw.rewrite_config("providers: [ { id: broken } ]\n");
    assert!(wait_until(Duration::from_secs(5), || last_reload(&gw)
        ["ok"]
        == false));
    assert_eq!(gw.chat(r#"{"model":"m"}"#).header("x-mock-name"), Some("b"));
}
