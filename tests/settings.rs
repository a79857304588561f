//! Settings precedence (SPEC §5.7): default < env < file < runtime override < per
//! connection, shown by `GET /api/resilience`; `PATCH` overrides are validated, take
//! effect at once, and survive a restart.

// Integration tests: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::gw::{server_section, Gateway};
use common::Mock;

fn config(mock: &str) -> String {
    format!(
        "{}providers:
  - id: p
    base_url: \"{mock}\"
    api: openai
    retry_delay: \"9s\"
    connections:
      - {{ id: k1, api_key_env: KEY, max_concurrent: 3, retry_delay: \"4s\" }}
      - {{ id: k2, api_key_env: KEY }}
  - id: q
    base_url: \"{mock}\"
    api: openai
    connections:
      - {{ id: kq, api_key_env: KEY }}
models:
  - name: m
    targets: [ {{ provider: p, model: up }} ]
  - name: backup
    targets: [ {{ provider: q, model: up-backup }} ]
resilience:
  queue: {{ wait: \"5s\" }}
",
        server_section("")
    )
}

fn setting(gw: &Gateway, key: &str) -> (serde_json::Value, String) {
    let j = gw.admin_get("/api/resilience").json();
    let s = &j["settings"][key];
    (
        s["value"].clone(),
        s["source"].as_str().unwrap().to_string(),
    )
}

#[test]
fn layers_are_shown_and_overrides_persist() {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(
        &config(&mock.base_url()),
        &[
            ("KEY", "k"),
            ("SLUICE_QUEUE_MAX_DEPTH", "7"),
            ("SLUICE_QUEUE_WAIT", "11s"),
        ],
    );
    assert_eq!(
        setting(&gw, "queue.wait"),
        (serde_json::json!("5s"), "file".into()),
        "the file beats env"
    );
    assert_eq!(
        setting(&gw, "queue.max_depth"),
        (serde_json::json!(7), "env".into())
    );
    assert_eq!(
        setting(&gw, "combo_wait.max_wait"),
        (serde_json::json!("1m"), "default".into())
    );
    let j = gw.admin_get("/api/resilience").json();
    let k1 = j["connections"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["connection"] == "k1")
        .unwrap()
        .clone();
    assert_eq!(k1["max_concurrent"], 3);
    assert_eq!(k1["retry_delay"], "4s");
    assert_eq!(k1["retry_delay_source"], "connection");
    let k2 = j["connections"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["connection"] == "k2")
        .unwrap()
        .clone();
    assert_eq!(k2["retry_delay_source"], "provider");

    // Bad overrides are refused and change nothing.
    assert_eq!(
        gw.admin("PATCH", "/api/resilience", r#"{"queue.wait": "soon"}"#)
            .status,
        400
    );
    assert_eq!(
        gw.admin("PATCH", "/api/resilience", r#"{"no.such": 1}"#)
            .status,
        400
    );
    assert_eq!(
        gw.admin(
            "PATCH",
            "/api/resilience",
            r#"{"emergency_fallback": "ghost"}"#
        )
        .status,
        400
    );
    assert_eq!(setting(&gw, "queue.wait").1, "file");

    let r = gw.admin(
        "PATCH",
        "/api/resilience",
        r#"{"queue.wait": "2s", "emergency_fallback": "backup"}"#,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        setting(&gw, "queue.wait"),
        (serde_json::json!("2s"), "override".into())
    );
    assert_eq!(
        setting(&gw, "emergency_fallback"),
        (serde_json::json!("backup"), "override".into())
    );

    // The override is persisted before the answer: it survives kill -9.
    let gw = gw.crash_and_restart();
    assert_eq!(
        setting(&gw, "queue.wait"),
        (serde_json::json!("2s"), "override".into())
    );
    // Removing an override falls back to the file value.
    let r = gw.admin("PATCH", "/api/resilience", r#"{"queue.wait": null}"#);
    assert_eq!(r.status, 200);
    assert_eq!(
        setting(&gw, "queue.wait"),
        (serde_json::json!("5s"), "file".into())
    );
    // Unauthenticated PATCH is refused.
    assert_eq!(
        common::request(
            gw.admin,
            "PATCH",
            "/api/resilience",
            &[],
            br#"{"queue.wait":"1s"}"#
        )
        .status,
        401
    );
}

#[test]
fn emergency_fallback_serves_when_the_model_cannot_run() {
    let mock = Mock::start(&["--fault", "status=402;model=up"]);
    let gw = Gateway::start(&config(&mock.base_url()), &[("KEY", "k")]);
    // Both connections become terminal for `m` (402 → credits_exhausted)...
    assert_eq!(gw.chat(r#"{"model":"m"}"#).status, 402);
    assert_eq!(gw.chat(r#"{"model":"m"}"#).status, 404);
    // ...and with a fallback toggled on at runtime, `backup`'s targets are tried.
    let r = gw.admin(
        "PATCH",
        "/api/resilience",
        r#"{"emergency_fallback": "backup"}"#,
    );
    assert_eq!(r.status, 200);
    let r = gw.chat(r#"{"model":"m"}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-sluice-provider"), Some("q"));
    assert_eq!(r.header("x-sluice-model"), Some("up-backup"));
    assert_eq!(
        mock.stats()["last_body_sha256"],
        common::sha256_hex(br#"{"model":"up-backup"}"#)
    );
}

/// The test config without the `backup` model.
fn config_without_backup(mock: &str) -> String {
    config(mock).replace(
        "  - name: backup\n    targets: [ { provider: q, model: up-backup } ]\n",
        "",
    )
}

fn overrides(gw: &Gateway) -> serde_json::Value {
    gw.admin_get("/api/resilience").json()["overrides"].clone()
}

#[test]
fn an_override_naming_a_removed_model_is_dropped_at_start_not_fatal() {
    let mock = Mock::start(&[]);
    let yaml = config(&mock.base_url());
    assert!(config_without_backup(&mock.base_url()) != yaml);
    let gw = Gateway::start(&yaml, &[("KEY", "k")]);
    let r = gw.admin(
        "PATCH",
        "/api/resilience",
        r#"{"emergency_fallback": "backup", "queue.max_depth": 4}"#,
    );
    assert_eq!(r.status, 200, "{}", r.text());

    // Stopped, the model removed, started again: it starts, keeps the override that
    // still applies, and forgets the stale one (in the store too).
    let gw = gw.restart_with(&config_without_backup(&mock.base_url()));
    assert_eq!(overrides(&gw), serde_json::json!({"queue.max_depth": 4}));
    assert_eq!(setting(&gw, "emergency_fallback").1, "default");
    assert_eq!(gw.chat(r#"{"model":"m"}"#).status, 200);
    let gw = gw.restart_with(&yaml);
    assert_eq!(overrides(&gw), serde_json::json!({"queue.max_depth": 4}));
    assert_eq!(
        setting(&gw, "emergency_fallback").0,
        serde_json::Value::Null
    );
}

#[test]
fn a_reload_that_removes_the_fallback_model_drops_the_override() {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(&config(&mock.base_url()), &[("KEY", "k")]);
    let r = gw.admin(
        "PATCH",
        "/api/resilience",
        r#"{"emergency_fallback": "backup"}"#,
    );
    assert_eq!(r.status, 200);
    gw.rewrite_config(&config_without_backup(&mock.base_url()));
    let r = gw.admin_post("/api/config/reload", "");
    assert_eq!(r.status, 200, "the reload itself is valid: {}", r.text());
    let warnings = r.json()["last_reload"]["warnings"].to_string();
    assert!(
        warnings.contains("emergency_fallback") && warnings.contains("dropped"),
        "{warnings}"
    );
    assert_eq!(overrides(&gw), serde_json::json!({}));
    assert_eq!(
        gw.admin_get("/api/config").json()["models"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    // Gone from the store too: a restart on the original config has no fallback. (The
    // drop goes through the batched writer; an admin write commits everything queued
    // before it, so the kill below cannot race the flush.)
    assert_eq!(gw.admin_post("/api/resilience/reset", "{}").status, 200);
    let gw = gw.restart_with(&config(&mock.base_url()));
    assert_eq!(overrides(&gw), serde_json::json!({}));
}

#[test]
fn state_clear_overrides_empties_the_stored_overrides() {
    let mock = Mock::start(&[]);
    let mut gw = Gateway::start(&config(&mock.base_url()), &[("KEY", "k")]);
    let r = gw.admin(
        "PATCH",
        "/api/resilience",
        r#"{"queue.max_depth": 9, "combo_wait.enabled": false}"#,
    );
    assert_eq!(r.status, 200);
    let (code, out) = gw.stop_and_run(&["state", "clear-overrides"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("cleared 2 runtime override(s): combo_wait.enabled, queue.max_depth"),
        "{out}"
    );
    let (code, out) = gw.stop_and_run(&["state", "clear-overrides"]);
    assert_eq!(
        (code, out.contains("no runtime overrides")),
        (0, true),
        "{out}"
    );
    let gw = gw.restart_with(&config(&mock.base_url()));
    assert_eq!(overrides(&gw), serde_json::json!({}));
    assert_eq!(setting(&gw, "queue.max_depth").1, "default");
}
