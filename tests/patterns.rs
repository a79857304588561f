//! Model name patterns (SPEC §6): `claude-*` and `openai/*` entries serve the model ids
//! coding agents send on their own, passing the client's id (or the part after a
//! `prefix/`) upstream; exact names win, then the longest pattern; `/v1/models` lists
//! exact names only; a target may leave out `model` only under a pattern.

// Integration tests: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::gw::{server_section, Gateway};
use common::Mock;

fn config(openai: &str, anthropic: &str) -> String {
    format!(
        "{}providers:
  - id: p
    base_url: \"{openai}\"
    api: openai
    connections:
      - {{ id: c, api_key_env: KEY }}
  - id: q
    base_url: \"{anthropic}\"
    api: anthropic
    connections:
      - {{ id: a, api_key_env: KEY }}
models:
  - name: \"claude-*\"
    targets:
      - {{ provider: q }}
  - name: \"claude-3-*\"
    targets:
      - {{ provider: q, model: claude-legacy }}
  - name: claude-special
    targets:
      - {{ provider: q, model: claude-pinned }}
  - name: \"openai/*\"
    targets:
      - {{ provider: p }}
  - name: \"anthropic/claude-*\"
    targets:
      - {{ provider: q }}
  - name: plain
    targets:
      - {{ provider: p, model: gpt-plain }}
",
        server_section("")
    )
}

const KEY: &[(&str, &str)] = &[("KEY", "pattern-key")];

/// (status, the model the upstream saw, x-sluice-model) of one Messages request.
fn messages(gw: &Gateway, model: &str) -> (u16, String, Option<String>) {
    let body = format!(
        r#"{{"model":"{model}","max_tokens":5,"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    let r = common::request(
        gw.client,
        "POST",
        "/v1/messages",
        &[("content-type", "application/json")],
        body.as_bytes(),
    );
    let seen = if r.status == 200 {
        r.json()["model"].as_str().unwrap_or("").to_owned()
    } else {
        String::new()
    };
    (
        r.status,
        seen,
        r.header("x-sluice-model").map(str::to_owned),
    )
}

fn chat(gw: &Gateway, model: &str) -> (u16, String, Option<String>) {
    let r = gw.chat(&format!(r#"{{"model":"{model}","messages":[]}}"#));
    let seen = if r.status == 200 {
        r.json()["model"].as_str().unwrap_or("").to_owned()
    } else {
        String::new()
    };
    (
        r.status,
        seen,
        r.header("x-sluice-model").map(str::to_owned),
    )
}

#[test]
fn a_pattern_passes_the_clients_own_model_id_upstream() {
    let (p, q) = (Mock::start_named("p", &[]), Mock::start_named("q", &[]));
    let gw = Gateway::start(&config(&p.base_url(), &q.base_url()), KEY);
    let (status, seen, header) = messages(&gw, "claude-sonnet-4-5-20250929");
    assert_eq!(status, 200);
    assert_eq!(
        seen, "claude-sonnet-4-5-20250929",
        "the client's id goes upstream unchanged"
    );
    assert_eq!(header.as_deref(), Some("claude-sonnet-4-5-20250929"));
    // `openai/*`: the part after the prefix.
    let (status, seen, header) = chat(&gw, "openai/gpt-4o");
    assert_eq!(status, 200);
    assert_eq!(seen, "gpt-4o");
    assert_eq!(header.as_deref(), Some("gpt-4o"));
    // `anthropic/claude-*`: what follows the prefix's last `/`.
    assert_eq!(messages(&gw, "anthropic/claude-opus-4").1, "claude-opus-4");
    assert_eq!(q.route_count("/v1/messages"), 2);
    assert_eq!(p.route_count("/v1/chat/completions"), 1);
}

#[test]
fn exact_names_win_then_the_longest_pattern() {
    let (p, q) = (Mock::start_named("p", &[]), Mock::start_named("q", &[]));
    let gw = Gateway::start(&config(&p.base_url(), &q.base_url()), KEY);
    assert_eq!(messages(&gw, "claude-special").1, "claude-pinned");
    assert_eq!(messages(&gw, "claude-3-opus").1, "claude-legacy");
    assert_eq!(messages(&gw, "claude-opus-4").1, "claude-opus-4");
    assert_eq!(chat(&gw, "plain").1, "gpt-plain");
    // A pattern needs something after its prefix; unknown ids stay 404.
    assert_eq!(messages(&gw, "claude-").0, 404);
    assert_eq!(chat(&gw, "gpt-4o").0, 404);
    assert_eq!(chat(&gw, "openai/").0, 404);
    // An id a pattern would pass on upstream (and into `x-sluice-model`) is plain and
    // bounded: control characters, spaces or 201+ bytes are no model.
    assert_eq!(messages(&gw, "claude-x\\u0001").0, 404);
    assert_eq!(messages(&gw, "claude-x y").0, 404);
    assert_eq!(messages(&gw, &format!("claude-{}", "x".repeat(200))).0, 404);
    assert_eq!(messages(&gw, &format!("claude-{}", "x".repeat(150))).0, 200);
}

#[test]
fn the_model_list_names_exact_models_only() {
    let (p, q) = (Mock::start_named("p", &[]), Mock::start_named("q", &[]));
    let gw = Gateway::start(&config(&p.base_url(), &q.base_url()), KEY);
    let r = common::request(gw.client, "GET", "/v1/models", &[], b"");
    assert_eq!(r.status, 200);
    let ids: Vec<String> = r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, ["claude-special", "plain"]);
}

#[test]
fn only_a_patterns_targets_may_leave_out_the_model() {
    let dir = common::gw::TempDir::new("sluice-patterns");
    let check = |models: &str| {
        let yaml = format!(
            "providers:\n  - id: p\n    base_url: \"http://127.0.0.1:9\"\n    api: openai\n    connections: [ {{ id: c }} ]\nmodels:\n{models}"
        );
        let file = dir.0.join("c.yaml");
        std::fs::write(&file, yaml).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["check", "--config", file.to_str().unwrap()])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (code, text) = check("  - name: exact\n    targets: [ { provider: p } ]\n");
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("models[0].targets[0].model"), "{text}");
    let (code, text) = check("  - name: \"cl*ude\"\n    targets: [ { provider: p, model: x } ]\n");
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("models[0].name"), "{text}");
    let (code, text) = check("  - name: \"claude-*\"\n    targets: [ { provider: p } ]\n");
    assert_eq!(code, Some(0), "{text}");
    // A fallback keeps the client's id: a pattern would send it to the wrong provider.
    let (code, text) = check(
        "  - name: \"claude-*\"\n    targets: [ { provider: p } ]\nemergency_fallback: \"claude-*\"\n",
    );
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("emergency_fallback") && text.contains("pattern"),
        "{text}"
    );
}
