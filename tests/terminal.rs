//! Terminal connection states (SPEC §5.3, §7): `credits_exhausted` and `banned` keep a
//! connection out across a `kill -9` restart until an operator clears them with
//! `include_terminal`.

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
}

const KEYS: &[(&str, &str)] = &[("KEY1", "key-1"), ("KEY2", "key-2")];

fn calls(mock: &Mock, key: &str) -> u64 {
    mock.stats()["by_credential"][key].as_u64().unwrap_or(0)
}

fn state(gw: &Gateway, id: &str) -> String {
    gw.admin_get("/api/resilience/cooldowns").json()["connections"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["connection"] == id)
        .map(|c| c["state"].as_str().unwrap().to_string())
        .unwrap()
}

fn terminal_survives_restart(fault: &str, expected: &str) {
    let mock = Mock::start(&["--fault", fault]);
    let gw = Gateway::start(&config(&mock.base_url()), KEYS);
    let r = gw.chat(r#"{"model":"m"}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-sluice-connection"), Some("k2"));
    assert_eq!(state(&gw, "k1"), expected);

    // kill -9 right after the response: the terminal state was committed before it.
    let gw = gw.crash_and_restart();
    mock.set_fault("");
    assert_eq!(state(&gw, "k1"), expected);
    for _ in 0..6 {
        let r = gw.chat(r#"{"model":"m"}"#);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-sluice-connection"), Some("k2"));
    }
    assert_eq!(
        calls(&mock, "key-1"),
        1,
        "a terminal connection was used again"
    );

    // A plain clear leaves terminal states alone; include_terminal clears them.
    let r = gw.admin_post("/api/resilience/cooldowns", r#"{"connections": ["p/k1"]}"#);
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["skipped_terminal"], 1);
    assert_eq!(state(&gw, "k1"), expected);
    let r = gw.admin_post(
        "/api/resilience/cooldowns",
        r#"{"connections": ["p/k1"], "include_terminal": true}"#,
    );
    assert_eq!(r.json()["cleared"], 1);
    assert_eq!(state(&gw, "k1"), "ok");
    let used: Vec<String> = (0..4)
        .map(|_| {
            gw.chat(r#"{"model":"m"}"#)
                .header("x-sluice-connection")
                .unwrap()
                .to_string()
        })
        .collect();
    assert!(used.iter().any(|c| c == "k1"), "{used:?}");

    // And the clear itself is durable.
    let gw = gw.crash_and_restart();
    assert_eq!(state(&gw, "k1"), "ok");
}

#[test]
fn credits_exhausted_survives_a_crash() {
    terminal_survives_restart(
        r#"status=402;credential=key-1;body={"error":{"message":"Your credit balance is too low"}}"#,
        "credits_exhausted",
    );
}

#[test]
fn banned_survives_a_crash() {
    terminal_survives_restart(
        r#"status=403;credential=key-1;body={"error":{"message":"This account has been banned for abuse"}}"#,
        "banned",
    );
}

#[test]
fn all_terminal_gives_404_no_executable_targets() {
    let mock = Mock::start(&["--fault", "status=402"]);
    let gw = Gateway::start(&config(&mock.base_url()), KEYS);
    let r = gw.chat(r#"{"model":"m"}"#);
    assert_eq!(r.status, 402, "the last upstream error is passed through");
    let r = gw.chat(r#"{"model":"m"}"#);
    assert_eq!(r.status, 404, "{}", r.text());
    let j = r.json();
    assert_eq!(j["error"]["code"], "no_executable_targets");
    let ex = j["error"]["diagnostics"]["excluded"].as_array().unwrap();
    assert_eq!(ex.len(), 2);
    assert!(ex
        .iter()
        .all(|e| e["reason"] == "terminal" && e["state"] == "credits_exhausted"));
    assert!(r.header("retry-after").is_none());
}

#[test]
fn corrupt_state_file_is_refused_unless_reset() {
    let dir = common::gw::TempDir::new("sluice-corrupt");
    let state = dir.0.join("state.redb");
    std::fs::write(&state, b"this is not a redb file at all").unwrap();
    let yaml = config("http://127.0.0.1:9").replace("@DIR@", dir.0.to_str().unwrap());
    let cfg = dir.0.join("sluice.yaml");
    std::fs::write(&cfg, yaml).unwrap();
    std::fs::create_dir_all(dir.0.join("rules")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["run", "--config", cfg.to_str().unwrap()])
        .env("SLUICE_ADMIN_TOKEN", "t")
        .env("KEY1", "a")
        .env("KEY2", "b")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("state.redb") && err.contains("--reset-state"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&state).unwrap(),
        b"this is not a redb file at all",
        "the file was touched"
    );

    let mut p = common::Proc::spawn(
        env!("CARGO_BIN_EXE_sluice"),
        &["run", "--config", cfg.to_str().unwrap(), "--reset-state"],
        &[
            ("SLUICE_ADMIN_TOKEN", "t"),
            ("KEY1", "a"),
            ("KEY2", "b"),
            ("SLUICE_LOG", "error"),
        ],
        &["client", "admin"],
    );
    let moved: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".corrupt-"))
        .collect();
    assert_eq!(moved.len(), 1, "the corrupt file must be kept aside");
    assert_eq!(
        std::fs::read(moved[0].path()).unwrap(),
        b"this is not a redb file at all"
    );
    let ready = common::request(p.addr("admin"), "GET", "/ready", &[], b"");
    assert_eq!(ready.status, 200);
    p.kill();
}
