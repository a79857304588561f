//! `state.backend: redis` (SPEC §7.1), the durable half: nodes on one real
//! `redis-server` keep one image of the failure memory, so a node that starts (or
//! restarts) knows what another learnt; a node whose Redis is down still serves; the
//! backend settings are checked by `sluice check` without ever showing the URL.

// Integration tests: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::gw::{server_section, Gateway};
use common::redis::Redis;
use common::{wait_until, Mock};
use std::time::Duration;

fn config(mock: &str) -> String {
    format!(
        "{}providers:
  - id: p
    base_url: \"{mock}\"
    api: openai
    connections:
      - {{ id: k1, api_key_env: KEY1 }}
      - {{ id: k2, api_key_env: KEY2 }}
models:
  - name: m
    strategy: round-robin
    targets:
      - {{ provider: p, model: up }}
",
        server_section("")
    )
    .replace(
        "state:\n",
        "state:\n  backend: redis\n  redis: { url_env: SLUICE_REDIS_URL, key_prefix: \"test:\" }\n",
    )
}

fn k1_state(gw: &Gateway) -> serde_json::Value {
    let r = gw.admin_get("/api/resilience/cooldowns?provider=p");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["connections"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["connection"] == "k1")
        .map(|c| c["state"].clone())
        .unwrap_or_default()
}

#[test]
fn a_cooldown_one_node_learnt_is_known_to_a_node_that_starts_later() {
    let redis = Redis::start();
    let url = redis.url();
    let mock = Mock::start(&["--fault", "status=429;retry_after=120;credential=key-1"]);
    let env = [
        ("KEY1", "key-1"),
        ("KEY2", "key-2"),
        ("SLUICE_REDIS_URL", url.as_str()),
    ];
    let a = Gateway::start(&config(&mock.base_url()), &env);
    let r = a.chat(r#"{"model":"m","messages":[]}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(k1_state(&a), "cooling");
    // Written to the shared store within the writer's batch window.
    assert!(
        wait_until(Duration::from_secs(3), || redis
            .command(&["HKEYS", "test:connections"])
            .contains("p/k1")),
        "{}",
        redis.command(&["HKEYS", "test:connections"])
    );
    let before = mock.stats()["by_credential"]["key-1"].as_u64().unwrap();
    mock.set_fault("");
    let b = Gateway::start(&config(&mock.base_url()), &env);
    assert_eq!(k1_state(&b), "cooling", "node b loaded node a's cooldown");
    for _ in 0..4 {
        let r = b.chat(r#"{"model":"m","messages":[]}"#);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-sluice-connection"), Some("k2"));
    }
    assert_eq!(
        mock.stats()["by_credential"]["key-1"].as_u64().unwrap(),
        before
    );
}

#[test]
fn a_node_whose_redis_is_down_still_serves_and_writes_once_it_is_back() {
    let port = common::gw::closed_port();
    let url = format!("redis://127.0.0.1:{port}/");
    let mock = Mock::start(&["--fault", "status=429;retry_after=120;credential=key-1"]);
    let env = [
        ("KEY1", "key-1"),
        ("KEY2", "key-2"),
        ("SLUICE_REDIS_URL", url.as_str()),
    ];
    let gw = Gateway::start(&config(&mock.base_url()), &env);
    for _ in 0..3 {
        let r = gw.chat(r#"{"model":"m","messages":[]}"#);
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(k1_state(&gw), "cooling", "the local view still works");
    // Said on /ready (still 200: the node serves) and in the health view and metrics.
    let ready = gw.admin_get("/ready");
    assert_eq!(ready.status, 200, "{}", ready.text());
    let backend = &ready.json()["state_backend"];
    assert_eq!(backend["kind"], "redis");
    assert!(
        wait_until(Duration::from_secs(3), || gw.admin_get("/ready").json()
            ["state_backend"]["reachable"]
            == false),
        "{backend}"
    );
    assert_eq!(
        gw.admin_get("/api/monitoring/health").json()["state_backend"]["reachable"],
        false
    );
    assert!(
        gw.metric("sluice_state_backend_errors_total")
            .unwrap_or(0.0)
            >= 1.0
    );
    // The batch the store refused is kept and retried: it lands once Redis is up.
    let redis = Redis::start_on(port);
    assert!(
        wait_until(Duration::from_secs(10), || redis
            .command(&["HKEYS", "test:connections"])
            .contains("p/k1")),
        "the refused batch never reached redis"
    );
    assert_eq!(gw.chat(r#"{"model":"m","messages":[]}"#).status, 200);
    assert!(
        wait_until(Duration::from_secs(3), || gw.admin_get("/ready").json()
            ["state_backend"]["reachable"]
            == true),
        "reachable again"
    );
}

#[test]
fn backend_settings_are_checked_and_the_url_never_shown() {
    let dir = common::gw::TempDir::new("sluice-redis-check");
    let run = |state: &str, env: &[(&str, &str)]| {
        let yaml = format!(
            "state:\n{state}providers:\n  - id: p\n    base_url: \"http://127.0.0.1:9\"\n    api: openai\n    connections: [ {{ id: c }} ]\nmodels:\n  - name: m\n    targets: [ {{ provider: p, model: u }} ]\n"
        );
        let file = dir.0.join("c.yaml");
        std::fs::write(&file, yaml).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["check", "--config", file.to_str().unwrap()])
            .envs(env.iter().copied())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (code, text) = run("  backend: redis\n", &[]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("state.redis"), "{text}");
    let (code, text) = run("  backend: memcached\n", &[]);
    assert_eq!(code, Some(1));
    assert!(text.contains("state.backend"), "{text}");
    let secret = "http://user:s3cret-pass@redis.internal:6379";
    let (code, text) = run(
        "  backend: redis\n  redis: { url_env: URL }\n",
        &[("URL", secret)],
    );
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("not a redis:// or rediss:// URL"), "{text}");
    assert!(!text.contains("s3cret-pass"), "the URL leaked: {text}");
    let (code, text) = run(
        "  backend: redis\n  redis: { url_env: URL, sync_interval: \"5ms\" }\n",
        &[("URL", "redis://:s3cret-pass@127.0.0.1:6379/0")],
    );
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("state.redis.sync_interval"), "{text}");
    assert!(!text.contains("s3cret-pass"), "{text}");
    let (code, text) = run(
        "  backend: redis\n  redis: { url_env: URL }\n",
        &[("URL", "redis://:s3cret-pass@127.0.0.1:6379/0")],
    );
    assert_eq!(code, Some(0), "{text}");
    assert!(!text.contains("s3cret-pass"), "{text}");
}

#[test]
fn running_nodes_see_each_others_cooldowns_and_clears_live() {
    let redis = Redis::start();
    let url = redis.url();
    let mock = Mock::start(&[]);
    let env = [
        ("KEY1", "key-1"),
        ("KEY2", "key-2"),
        ("SLUICE_REDIS_URL", url.as_str()),
    ];
    let (a, b, c) = (
        Gateway::start(&config(&mock.base_url()), &env),
        Gateway::start(&config(&mock.base_url()), &env),
        Gateway::start(&config(&mock.base_url()), &env),
    );
    // Node a learns that key-1 is rate limited for 120 s.
    mock.set_fault("status=429;retry_after=120;credential=key-1");
    let r = a.chat(r#"{"model":"m","messages":[]}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(k1_state(&a), "cooling");
    mock.set_fault("");
    // b and c, already running, take it up within the sync interval and skip key-1.
    for node in [&b, &c] {
        assert!(
            wait_until(Duration::from_secs(3), || k1_state(node) == "cooling"),
            "a running node did not learn the cooldown"
        );
    }
    let before = mock.stats()["by_credential"]["key-1"].as_u64().unwrap_or(0);
    for node in [&b, &c] {
        for _ in 0..3 {
            let r = node.chat(r#"{"model":"m","messages":[]}"#);
            assert_eq!(r.status, 200);
            assert_eq!(r.header("x-sluice-connection"), Some("k2"));
        }
    }
    assert_eq!(
        mock.stats()["by_credential"]["key-1"].as_u64().unwrap_or(0),
        before
    );
    // An operator clears it on node c: a and b follow.
    let r = c.admin_post("/api/resilience/cooldowns", r#"{"all": true}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    for node in [&a, &b] {
        assert!(
            wait_until(Duration::from_secs(3), || k1_state(node) != "cooling"),
            "a running node did not learn the clear"
        );
    }
}
