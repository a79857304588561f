//! Session affinity (SPEC §5.5): a session header keeps the same connection across
//! requests, moves when that connection is cooled, survives a restart, and never
//! reaches the upstream.

// Integration tests: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::gw::{server_section, Gateway};
use common::{request, Mock};

fn config(mock: &str) -> String {
    format!(
        "{}providers:
  - id: p
    base_url: \"{mock}\"
    api: openai
    connections:
      - {{ id: k1, api_key_env: KEY1 }}
      - {{ id: k2, api_key_env: KEY2 }}
      - {{ id: k3, api_key_env: KEY3 }}
models:
  - name: m
    strategy: round-robin
    targets: [ {{ provider: p, model: up }} ]
",
        server_section("")
    )
}

const KEYS: &[(&str, &str)] = &[("KEY1", "key-1"), ("KEY2", "key-2"), ("KEY3", "key-3")];

fn chat(gw: &Gateway, session: Option<(&str, &str)>) -> common::Response {
    let headers: Vec<(&str, &str)> = session.into_iter().collect();
    request(
        gw.client,
        "POST",
        "/v1/chat/completions",
        &headers,
        br#"{"model":"m"}"#,
    )
}

fn conn(r: &common::Response) -> String {
    r.header("x-sluice-connection").unwrap().to_string()
}

#[test]
fn session_sticks_moves_when_cooled_and_survives_restart() {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(&config(&mock.base_url()), KEYS);
    // Without a session, round-robin rotates.
    let free: Vec<String> = (0..3).map(|_| conn(&chat(&gw, None))).collect();
    assert_eq!(free.len(), 3);
    assert_ne!(free[0], free[1]);

    let first = chat(&gw, Some(("x-session-id", "agent-42")));
    let pinned = conn(&first);
    for _ in 0..6 {
        assert_eq!(conn(&chat(&gw, Some(("x-session-id", "agent-42")))), pinned);
    }
    // Another header name carries another session, pinned on its own.
    let other = conn(&chat(&gw, Some(("x-codex-session-id", "codex-1"))));
    assert_eq!(
        conn(&chat(&gw, Some(("x-codex-session-id", "codex-1")))),
        other
    );
    let h = &mock.stats()["last_headers"];
    for gone in ["x-session-id", "x-codex-session-id", "x-sluice-session"] {
        assert!(h.get(gone).is_none(), "{gone} reached the upstream: {h}");
    }

    // Cool the pinned connection: the session moves, then sticks to its new home.
    let key = format!("key-{}", &pinned[1..]);
    mock.set_fault(&format!("status=429;retry_after=30;credential={key}"));
    let moved = conn(&chat(&gw, Some(("x-session-id", "agent-42"))));
    assert_ne!(moved, pinned);
    mock.set_fault("");
    for _ in 0..4 {
        assert_eq!(conn(&chat(&gw, Some(("x-session-id", "agent-42")))), moved);
    }
    let m = request(gw.admin, "GET", "/metrics", &[], b"").text();
    assert!(m.contains("sluice_affinity_pins_active 2"), "{m}");

    // Pins are persisted: after kill -9 the session still lands on its connection.
    // SPEC §7: pins may lag the store by one flush window (≤ 200 ms); wait that out.
    std::thread::sleep(std::time::Duration::from_millis(400));
    let gw = gw.crash_and_restart();
    for _ in 0..3 {
        assert_eq!(conn(&chat(&gw, Some(("x-session-id", "agent-42")))), moved);
    }
}
