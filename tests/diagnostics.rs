//! Diagnostics and operator views: the dry-run explain endpoint, `circuit_open`
//! exclusions with `Retry-After`, and reload by `SIGHUP`.

// Integration tests: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::gw::{server_section, Gateway};
use common::{wait_until, Mock};
use std::time::Duration;

fn config(a: &str, b: &str, model_b: &str) -> String {
    format!(
        "{}providers:
  - id: a
    base_url: \"{a}\"
    api: openai
    class: local
    connections:
      - {{ id: ka, api_key_env: KEY }}
  - id: b
    base_url: \"{b}\"
    api: openai
    connections:
      - {{ id: kb1, api_key_env: KEY }}
      - {{ id: kb2, api_key_env: KEY }}
models:
  - name: m
    strategy: weighted
    targets:
      - {{ provider: a, model: up-a, weight: 3 }}
      - {{ provider: b, model: {model_b}, weight: 1 }}
  - name: only-a
    cooldown_wait: false
    targets:
      - {{ provider: a, model: up-a }}
",
        server_section("")
    )
}

#[test]
fn explain_lists_candidates_and_exclusions() {
    // a is class local: its breaker opens after 2 failures (reset 15 s).
    let a = Mock::start_named("a", &["--fault", "status=500"]);
    let b = Mock::start_named("b", &[]);
    let gw = Gateway::start(
        &config(&a.base_url(), &b.base_url(), "up-b"),
        &[("KEY", "k")],
    );
    let r = gw.admin_get("/api/routes/explain?model=m");
    assert_eq!(r.status, 200, "{}", r.text());
    let j = r.json();
    assert_eq!(j["strategy"], "weighted");
    let fam = &j["families"][0];
    assert_eq!(fam["family"], "openai");
    assert_eq!(fam["candidates"].as_array().unwrap().len(), 3);
    assert!(fam["excluded"].as_array().unwrap().is_empty());

    for _ in 0..2 {
        assert_eq!(gw.request_only_a().status, 500);
    }
    let j = gw.admin_get("/api/routes/explain?model=m").json();
    let fam = &j["families"][0];
    let cands: Vec<_> = fam["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["provider"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(cands, vec!["b", "b"]);
    let ex = &fam["excluded"][0];
    assert_eq!(ex["provider"], "a");
    assert_eq!(ex["reason"], "circuit_open");
    let secs = ex["retry_after_s"].as_u64().unwrap();
    assert!((1..=15).contains(&secs), "{secs}");

    // A model whose only target is behind an open breaker: 503 with Retry-After.
    let r = gw.request_only_a();
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["code"], "all_targets_cooling_down");
    assert_eq!(
        r.json()["error"]["diagnostics"]["excluded"][0]["reason"],
        "circuit_open"
    );
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=15).contains(&retry));
    assert_eq!(a.route_count("/v1/chat/completions"), 2);

    let r = gw.admin_get("/api/routes/explain?model=nope");
    assert_eq!(r.status, 404);
}

#[test]
fn sighup_reloads_the_config() {
    let a = Mock::start_named("a", &[]);
    let b = Mock::start_named("b", &[]);
    let gw = Gateway::start(
        &config(&a.base_url(), &b.base_url(), "up-b"),
        &[("KEY", "k")],
    );
    let gen = gw.admin_get("/api/config").json()["generation"]
        .as_u64()
        .unwrap();
    // Same file content, new stamp is irrelevant: SIGHUP forces the reload.
    gw.proc.signal("HUP");
    assert!(wait_until(Duration::from_secs(5), || {
        let c = gw.admin_get("/api/config").json();
        c["generation"].as_u64().unwrap() > gen && c["last_reload"]["trigger"] == "sighup"
    }));
    // Still serving after the reload.
    assert_eq!(gw.chat(r#"{"model":"m"}"#).status, 200);
}

trait OnlyA {
    fn request_only_a(&self) -> common::Response;
}

impl OnlyA for Gateway {
    fn request_only_a(&self) -> common::Response {
        self.chat(r#"{"model":"only-a"}"#)
    }
}

#[test]
fn explain_lists_candidates_in_strategy_order() {
    // The cheaper target is listed second: cost-optimized tries it first.
    let a = Mock::start_named("a", &[]);
    let b = Mock::start_named("b", &[]);
    let yaml = format!(
        "{}providers:
  - id: a
    base_url: \"{}\"
    api: openai
    connections: [ {{ id: ka, api_key_env: KEY }} ]
  - id: b
    base_url: \"{}\"
    api: openai
    connections: [ {{ id: kb, api_key_env: KEY }} ]
models:
  - name: cheap-first
    strategy: cost-optimized
    targets:
      - {{ provider: a, model: dear, cost: 5.0 }}
      - {{ provider: b, model: cheap, cost: 0.5 }}
  - name: turns
    strategy: round-robin
    targets:
      - {{ provider: a, model: first }}
      - {{ provider: b, model: second }}
",
        server_section(""),
        a.base_url(),
        b.base_url()
    );
    let gw = Gateway::start(&yaml, &[("KEY", "k")]);
    let order = |gw: &Gateway, model: &str| -> Vec<String> {
        gw.admin_get(&format!("/api/routes/explain?model={model}"))
            .json()["families"][0]["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["model"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(order(&gw, "cheap-first"), vec!["cheap", "dear"]);
    let r = gw.chat(r#"{"model":"cheap-first"}"#);
    assert_eq!(r.header("x-sluice-model"), Some("cheap"));
    assert_eq!(b.route_count("/v1/chat/completions"), 1);
    assert_eq!(a.route_count("/v1/chat/completions"), 0);

    // A rotating strategy: explain shows whose turn it is, and looking (twice) does not
    // move the rotation a real request sees.
    let turns = |gw: &Gateway| order(gw, "turns");
    assert_eq!(turns(&gw), vec!["first", "second"]);
    assert_eq!(turns(&gw), vec!["first", "second"]);
    let r = gw.chat(r#"{"model":"turns"}"#);
    assert_eq!(r.header("x-sluice-model"), Some("first"));
    assert_eq!(turns(&gw), vec!["second", "first"]);
    let r = gw.chat(r#"{"model":"turns"}"#);
    assert_eq!(r.header("x-sluice-model"), Some("second"));
}

/// One model on `a`, with `access_log` as the server's extra lines.
fn logged(a: &str, access_log: &str) -> String {
    format!(
        "{}providers:
  - id: a
    base_url: \"{a}\"
    api: openai
    class: local
    connections:
      - {{ id: ka, api_key_env: KEY }}
models:
  - name: m
    targets:
      - {{ provider: a, model: up-a }}
",
        server_section(access_log)
    )
}

fn access_lines(gw: &Gateway) -> Vec<String> {
    gw.log()
        .lines()
        .filter(|l| l.contains("sluice::access") || l.starts_with("{\"time\""))
        .map(str::to_owned)
        .collect()
}

#[test]
fn access_log_json_names_method_path_and_attempts_but_never_the_query() {
    let a = Mock::start_named("a", &[]);
    let gw = Gateway::start_logged(
        &logged(&a.base_url(), "  access_log: { format: json }"),
        &[("KEY", "k"), ("SLUICE_LOG", "info")],
    );
    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let ok = common::request(
        gw.client,
        "POST",
        "/v1/chat/completions?api_key=do-not-log",
        &[("content-type", "application/json")],
        body.as_bytes(),
    );
    assert_eq!(ok.status, 200, "{}", ok.text());
    let missing = common::request(gw.client, "GET", "/v1/nothing/here", &[], b"");
    assert_eq!(missing.status, 404);
    assert!(
        wait_until(Duration::from_secs(5), || access_lines(&gw).len() >= 2),
        "{}",
        gw.log()
    );
    let lines = access_lines(&gw);
    assert!(!gw.log().contains("do-not-log"), "{}", gw.log());
    let parsed: Vec<serde_json::Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).expect("each access line is one JSON object"))
        .collect();
    let chat = &parsed[0];
    assert_eq!(chat["method"], "POST");
    assert_eq!(chat["path"], "/v1/chat/completions");
    assert_eq!(chat["route"], "chat_completions");
    assert_eq!(chat["model"], "m");
    assert_eq!(chat["status"], 200);
    assert_eq!(chat["attempts"], 1);
    assert_eq!(chat["provider"], "a");
    assert_eq!(chat["connection"], "ka");
    assert_eq!(chat["upstream_model"], "up-a");
    assert_eq!(chat["bytes_out"].as_u64(), Some(ok.body.len() as u64));
    let nf = &parsed[1];
    assert_eq!(nf["method"], "GET");
    assert_eq!(nf["path"], "/v1/nothing/here");
    assert_eq!(nf["status"], 404);
    assert_eq!(nf["route"], "unmatched");
    assert_eq!(nf["note"], "route_not_found");
    assert_eq!(nf["provider"], serde_json::Value::Null);
}

#[test]
fn access_log_text_by_default_and_off_when_asked() {
    let a = Mock::start_named("a", &[]);
    let env = [("KEY", "k"), ("SLUICE_LOG", "info")];
    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let text = Gateway::start_logged(&logged(&a.base_url(), ""), &env);
    assert_eq!(text.chat(body).status, 200);
    assert!(
        wait_until(Duration::from_secs(5), || !access_lines(&text).is_empty()),
        "{}",
        text.log()
    );
    let line = &access_lines(&text)[0];
    assert!(
        line.contains(" INFO sluice::access: request method=POST path=/v1/chat/completions route=chat_completions model=m client=- status=200 attempts=1 provider=a connection=ka upstream_model=up-a failed=- "),
        "{line}"
    );

    let off = Gateway::start_logged(
        &logged(&a.base_url(), "  access_log: { format: off }"),
        &env,
    );
    assert_eq!(off.chat(body).status, 200);
    // The first gateway's line shows a line is written within moments; give this one
    // the same chance, with a second request as a marker that both were finished.
    assert_eq!(off.chat(body).status, 200);
    std::thread::sleep(Duration::from_millis(300));
    assert!(access_lines(&off).is_empty(), "{}", off.log());
    assert_eq!(a.route_count("/v1/chat/completions"), 3);
}
