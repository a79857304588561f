//! `sluice check`: every problem listed with file, field path and reason; exit 1.

// Integration tests: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::gw::TempDir;
use std::process::Command;

fn check(yaml: &str, env: &[(&str, &str)]) -> (i32, String) {
    let dir = TempDir::new("sluice-check");
    let path = dir.0.join("broken.yaml");
    std::fs::write(&path, yaml).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    cmd.args(["check", "--config", path.to_str().unwrap()]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn lists_every_problem_with_its_path() {
    let yaml = r#"
server:
  listen: "nowhere"
  threads: 300
  max_attempts: 0
  max_body_bytes: "16 parsecs"
providers:
  - id: openai
    base_url: "ftp://api.example.com"
    api: openai
    connections:
      - id: key-1
        api_key_env: SLUICE_TEST_SURELY_UNSET_VAR
  - id: anthropic
    base_url: "https://api.anthropic.com"
    api: anthropic
    colour: blue
    connections: []
  - id: good
    base_url: "http://127.0.0.1:9"
    api: openai
    connections:
      - { id: key-1, api_key_env: SLUICE_TEST_KEY }
models:
  - name: smart
    strategy: priority
    targets:
      - { provider: openai, model: gpt-4o }
  - name: broken
    strategy: zigzag
    targets:
      - { provider: nope, model: x }
      - { provider: good, model: y, connection: key-9 }
      - { provider: openai, model: z }
resilience:
  stream: { ttft_timeout: "soon" }
  bogus: true
frobnicate: 1
"#;
    let (code, out) = check(yaml, &[("SLUICE_TEST_KEY", "k")]);
    assert_eq!(code, 1, "{out}");
    // A provider that failed validation is not reported again by every reference to it.
    assert!(!out.contains("unknown provider \"openai\""), "{out}");
    assert_eq!(out.matches("error:").count(), 13, "{out}");
    for needle in [
        "broken.yaml: server.listen: \"nowhere\" is not an ip:port address",
        "server.threads: must be between 0 (one per core) and 256",
        "server.max_attempts: must be between 1 and 20",
        "server.max_body_bytes: invalid size",
        "providers[0].base_url: \"ftp://api.example.com\" must start with http:// or https://",
        "providers[1]: unknown field `colour`",
        "models[1].strategy: unknown strategy \"zigzag\"",
        "models[1].targets[0].provider: unknown provider \"nope\"",
        "models[1].targets[1].connection: provider \"good\" has no connection \"key-9\"",
        "resilience.stream.ttft_timeout: invalid duration \"soon\"",
        "resilience.bogus: unknown key",
        "frobnicate: unknown key",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
    // The provider whose base_url is broken is not validated further, but the env var of
    // a valid provider's connection would be: check that one separately.
    let (code, out) = check(
        "providers:\n  - id: p\n    base_url: \"http://127.0.0.1:1\"\n    api: openai\n    connections:\n      - { id: c, api_key_env: SLUICE_TEST_SURELY_UNSET_VAR }\nmodels: []\n",
        &[],
    );
    assert_eq!(code, 1);
    assert!(
        out.contains("providers[0].connections[0].api_key_env: environment variable SLUICE_TEST_SURELY_UNSET_VAR is not set"),
        "{out}"
    );
    assert!(!out.contains("SLUICE_TEST_SECRET_VALUE"));
}

#[test]
fn valid_config_passes_and_never_prints_secrets() {
    let yaml = "providers:\n  - id: p\n    base_url: \"http://127.0.0.1:1\"\n    api: openai\n    connections:\n      - { id: c, api_key_env: SLUICE_TEST_KEY }\nmodels:\n  - name: m\n    targets:\n      - { provider: p, model: u }\n";
    let (code, out) = check(yaml, &[("SLUICE_TEST_KEY", "super-secret-value-123")]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("OK (1 providers, 1 connections, 1 models)"),
        "{out}"
    );
    assert!(
        out.contains("warning:"),
        "open-listener warning expected: {out}"
    );
    assert!(!out.contains("super-secret-value-123"));
}

#[test]
fn shipped_configs_are_valid() {
    let root = env!("CARGO_MANIFEST_DIR");
    let demo = format!("{root}/conf/demo.yaml");
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["check", "--config", &demo])
        .env("SLUICE_ADMIN_TOKEN", "t")
        .env("DEMO_MOCK_KEY_1", "a")
        .env("DEMO_MOCK_KEY_2", "b")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let example = format!("{root}/conf/sluice.yaml");
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["check", "--config", &example])
        .env("SLUICE_ADMIN_TOKEN", "t")
        .env("SLUICE_KEY_TEAM_A", "a")
        .env("OPENAI_KEY_1", "b")
        .env("OPENAI_KEY_2", "c")
        .env("ANTHROPIC_KEY", "d")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    ); // The several-nodes example: its Redis URL (with a password) is never printed.
    let cluster = format!("{root}/conf/cluster.yaml");
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["check", "--config", &cluster])
        .env(
            "SLUICE_REDIS_URL",
            "redis://:cluster-s3cret@127.0.0.1:6379/0",
        )
        .env("SLUICE_ADMIN_TOKEN", "t")
        .env("SLUICE_KEY_AGENTS", "a")
        .env("SLUICE_KEY_APPS", "b")
        .env("OPENAI_KEY_1", "c")
        .env("OPENAI_KEY_2", "d")
        .env("ANTHROPIC_KEY_MAIN", "e")
        .env("ANTHROPIC_KEY_BACKUP", "f")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(!text.contains("cluster-s3cret"), "{text}");
}

#[test]
fn an_empty_or_serving_nothing_config_fails() {
    for (yaml, expect) in [
        ("", "the file is empty"),
        ("# only a comment\n", "the file is empty"),
        (
            "server:\n  threads: 1\n",
            "providers: at least one entry is required",
        ),
    ] {
        let (code, out) = check(yaml, &[]);
        assert_eq!(code, 1, "{yaml:?} passed: {out}");
        assert!(out.contains(expect), "{yaml:?}: {out}");
    }
}
