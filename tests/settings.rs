//! Settings precedence (SPEC §5.7): default < env < file < runtime override < per
//! connection, shown by `GET /api/resilience`; `PATCH` overrides are validated, take
//! effect at once, and survive a restart.

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
