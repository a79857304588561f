//! Every client-visible error of SPEC §4 that exists in this version, in both families'
//! shapes, with the upstream call counts that prove nothing was forwarded.

// Integration tests: a failed unwrap is a failed test, and they time the real binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod common;

use common::gw::{closed_port, server_section, Gateway};
use common::{request, Mock};

fn config(mock: &str, extra_server: &str, clients: &str, resilience: &str) -> String {
    let dead = format!("http://127.0.0.1:{}", closed_port());
    format!(
        "{}{clients}providers:
  - id: p
    base_url: \"{mock}\"
    api: openai
    connections:
      - {{ id: c1, api_key_env: KEY }}
      - {{ id: c2, api_key_env: KEY }}
  - id: q
    base_url: \"{mock}\"
    api: anthropic
    connections:
      - {{ id: c, api_key_env: KEY }}
  - id: dead
    base_url: \"{dead}\"
    api: openai
    connections:
      - {{ id: d, api_key_env: KEY }}
models:
  - name: m
    targets:
      - {{ provider: p, model: up }}
  - name: claude
    targets:
      - {{ provider: q, model: up-claude }}
  - name: nowhere
    targets:
      - {{ provider: dead, model: x }}
{resilience}",
        server_section(extra_server)
    )
}

const KEY: &[(&str, &str)] = &[
    ("KEY", "k"),
    ("CLIENT_A", "client-a-key"),
    ("CLIENT_B", "client-b-key"),
];

fn chat(gw: &Gateway, headers: &[(&str, &str)], body: &[u8]) -> common::Response {
    request(gw.client, "POST", "/v1/chat/completions", headers, body)
}

#[test]
fn bad_bodies_get_400_with_the_reason() {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(&config(&mock.base_url(), "", "", ""), KEY);
    for (body, needle) in [
        (&b"{not json"[..], "not valid JSON"),
        (b"", "empty"),
        (b"[1,2]", "JSON object"),
        (br#"{"messages":[]}"#, "`model` is required"),
        (br#"{"model":42}"#, "`model` must be a string"),
        (
            br#"{"model":"m","stream":"yes"}"#,
            "`stream` must be a boolean",
        ),
    ] {
        let r = chat(&gw, &[], body);
        assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(body));
        let j = r.json();
        assert_eq!(j["error"]["code"], "invalid_request");
        assert_eq!(j["error"]["type"], "invalid_request_error");
        let msg = j["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
    }
    // Anthropic family shape for the same error.
    let r = request(gw.client, "POST", "/v1/messages", &[], b"{oops");
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["type"], "error");
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    assert_eq!(r.json()["error"]["code"], "invalid_request");
    assert_eq!(mock.stats()["total"], 0);
}

#[test]
fn unknown_model_and_wrong_family_get_404_model_not_found() {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(&config(&mock.base_url(), "", "", ""), KEY);
    let r = chat(&gw, &[], br#"{"model":"nope"}"#);
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    // `m` has only openai targets: not reachable through the Anthropic route.
    let r = request(
        gw.client,
        "POST",
        "/v1/messages",
        &[],
        br#"{"model":"m","max_tokens":1}"#,
    );
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    assert_eq!(r.json()["error"]["type"], "not_found_error");
    let r = request(gw.client, "POST", "/v2/whatever", &[], b"{}");
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "route_not_found");
    assert_eq!(mock.stats()["total"], 0);
}

#[test]
fn oversized_body_gets_413() {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(
        &config(&mock.base_url(), "  max_body_bytes: \"2KiB\"", "", ""),
        KEY,
    );
    let big = format!("{{\"model\":\"m\",\"pad\":\"{}\"}}", "y".repeat(4096));
    let r = chat(&gw, &[], big.as_bytes());
    assert_eq!(r.status, 413);
    assert_eq!(r.json()["error"]["code"], "body_too_large");
    // Chunked upload with no Content-Length: the limit still holds while reading.
    let mut chunked = Vec::new();
    for part in big.as_bytes().chunks(1000) {
        chunked.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        chunked.extend_from_slice(part);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let r = request(
        gw.client,
        "POST",
        "/v1/chat/completions",
        &[("transfer-encoding", "chunked")],
        &chunked,
    );
    assert_eq!(r.status, 413);
    let small = chat(&gw, &[], br#"{"model":"m"}"#);
    assert_eq!(small.status, 200);
    assert_eq!(mock.stats()["total"], 1);
}

/// Chunked encoding of `body` in `size`-byte chunks, with its last chunk.
fn chunked(body: &[u8], size: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for part in body.chunks(size) {
        out.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        out.extend_from_slice(part);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

/// A body read in one piece is forwarded as it came; one read in several (chunked
/// uploads, bodies past one 64 KiB read) is joined in order. The mock's digest of what
/// it received is the same either way.
#[test]
fn bodies_in_one_piece_or_many_reach_the_upstream_whole() {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(&config(&mock.base_url(), "", "", ""), KEY);
    let last = || {
        let s = mock.stats();
        (
            s["last_body_len"].as_u64().unwrap(),
            s["last_body_sha256"].as_str().unwrap().to_string(),
        )
    };
    let body = format!("{{\"model\":\"m\",\"pad\":\"{}\"}}", "ab".repeat(1500));
    assert_eq!(chat(&gw, &[], body.as_bytes()).status, 200);
    let whole = last();
    // The upstream model's name replaces the client's: a fixed difference in length.
    let grew = whole.0 as i64 - body.len() as i64;
    let r = request(
        gw.client,
        "POST",
        "/v1/chat/completions",
        &[("transfer-encoding", "chunked")],
        &chunked(body.as_bytes(), 700),
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        last(),
        whole,
        "a chunked upload reaches the upstream joined in order"
    );
    let big = format!("{{\"model\":\"m\",\"pad\":\"{}\"}}", "cd".repeat(60 * 1024));
    assert_eq!(chat(&gw, &[], big.as_bytes()).status, 200);
    assert_eq!(
        last().0 as i64,
        big.len() as i64 + grew,
        "a body past one read is whole"
    );
    assert_eq!(mock.stats()["total"], 3);
}

#[test]
fn client_keys_are_enforced() {
    let mock = Mock::start(&[]);
    let clients = "clients:\n  - { id: team-a, key_env: CLIENT_A }\n  - { id: team-b, key_env: CLIENT_B, allowed_connections: [\"q/c\"] }\n";
    let gw = Gateway::start(&config(&mock.base_url(), "", clients, ""), KEY);
    let r = chat(&gw, &[], br#"{"model":"m"}"#);
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["code"], "unauthorized");
    let r = chat(
        &gw,
        &[("authorization", "Bearer wrong")],
        br#"{"model":"m"}"#,
    );
    assert_eq!(r.status, 401);
    let r = request(
        gw.client,
        "POST",
        "/v1/messages",
        &[("x-api-key", "wrong")],
        br#"{"model":"claude"}"#,
    );
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["type"], "authentication_error");
    assert_eq!(mock.stats()["total"], 0);

    let r = chat(
        &gw,
        &[("authorization", "Bearer client-a-key")],
        br#"{"model":"m"}"#,
    );
    assert_eq!(r.status, 200);
    // The client's key never reaches the upstream; the connection's does.
    let st = mock.stats();
    assert_eq!(st["last_headers"]["authorization"], "Bearer k");
    let r = request(
        gw.client,
        "POST",
        "/v1/messages",
        &[("x-api-key", "client-a-key")],
        br#"{"model":"claude","max_tokens":1}"#,
    );
    assert_eq!(r.status, 200);
    assert_eq!(mock.stats()["last_headers"]["x-api-key"], "k");

    // team-b may only use q/c: model m (p/*) has nothing it may run.
    let r = chat(
        &gw,
        &[("authorization", "Bearer client-b-key")],
        br#"{"model":"m"}"#,
    );
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "no_executable_targets");
    let r = request(
        gw.client,
        "POST",
        "/v1/messages",
        &[("x-api-key", "client-b-key")],
        br#"{"model":"claude","max_tokens":1}"#,
    );
    assert_eq!(r.status, 200);
    assert_eq!(mock.stats()["total"], 3);
}

#[test]
fn all_transport_failures_give_502_with_attempts() {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(&config(&mock.base_url(), "", "", ""), KEY);
    let r = chat(&gw, &[], br#"{"model":"nowhere"}"#);
    assert_eq!(r.status, 502);
    let j = r.json();
    assert_eq!(j["error"]["code"], "upstream_unavailable");
    let attempts = j["error"]["diagnostics"]["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0]["provider"], "dead");
    assert_eq!(attempts[0]["reason"], "refused");
    assert!(
        attempts[0]["detail"]
            .as_str()
            .is_some_and(|d| d.starts_with("ConnectRefused")),
        "{}",
        r.text()
    );
    assert_eq!(r.header("x-sluice-attempts"), Some("1"));
}

#[test]
fn execution_deadline_before_commit_gives_504() {
    let mock = Mock::start(&["--fault", "latency=3s"]);
    let gw = Gateway::start(
        &config(
            &mock.base_url(),
            "",
            "",
            "resilience:\n  queue: { execution_timeout: \"300ms\" }\n",
        ),
        KEY,
    );
    let started = std::time::Instant::now();
    let r = chat(&gw, &[], br#"{"model":"m"}"#);
    assert_eq!(r.status, 504);
    assert_eq!(r.json()["error"]["code"], "RATE_LIMIT_EXECUTION_TIMEOUT");
    assert!(started.elapsed() < std::time::Duration::from_secs(2));
}

#[test]
fn session_and_lease_headers_never_reach_the_upstream() {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(&config(&mock.base_url(), "", "", ""), KEY);
    let r = chat(
        &gw,
        &[
            ("x-session-id", "s1"),
            ("x-codex-session-id", "s2"),
            ("x-sluice-session", "s3"),
            ("x-trace", "kept"),
        ],
        br#"{"model":"m"}"#,
    );
    assert_eq!(r.status, 200);
    let h = &mock.stats()["last_headers"];
    for gone in [
        "x-session-id",
        "x-codex-session-id",
        "x-sluice-session",
        "x-sluice-lease-owner",
        "x-sluice-lease-generation",
    ] {
        assert!(h.get(gone).is_none(), "{gone} was forwarded: {h}");
    }
    assert_eq!(h["x-trace"], "kept");
}

#[test]
fn models_endpoint_lists_configured_names() {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(&config(&mock.base_url(), "", "", ""), KEY);
    let r = request(gw.client, "GET", "/v1/models", &[], b"");
    assert_eq!(r.status, 200);
    let j = r.json();
    assert_eq!(j["object"], "list");
    let ids: Vec<_> = j["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, vec!["m", "claude", "nowhere"]);
}

#[test]
fn passed_through_retry_after_is_whole_seconds_within_a_day() {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(&config(&mock.base_url(), "  max_attempts: 1", "", ""), KEY);
    let retry = |r: &common::Response| -> u64 {
        r.header("retry-after")
            .unwrap_or_else(|| panic!("no Retry-After: {}", r.text()))
            .parse()
            .unwrap()
    };
    // An absurd hint is clamped to a day.
    mock.set_fault("status=429;retry_after=343611483;times=1");
    let r = chat(&gw, &[], br#"{"model":"m"}"#);
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(retry(&r), 86_400);

    // A 503 saying "0" (or a fraction) is told at least one whole second.
    gw.admin_post("/api/resilience/cooldowns", r#"{"all": true}"#);
    mock.set_fault("status=503;retry_after=0;times=1");
    let r = chat(&gw, &[], br#"{"model":"m"}"#);
    assert_eq!(r.status, 503);
    assert_eq!(retry(&r), 1);
    // A fraction is not passed on: `retry` parses the header as whole seconds.
    mock.set_fault("status=503;retry_after=1.5;times=1");
    let r = chat(&gw, &[], br#"{"model":"m"}"#);
    assert_eq!(r.status, 503);
    assert!((1..=3).contains(&retry(&r)));

    // A 429 without any hint still says when to come back (the cooldown it caused, or
    // the one already running on the connection).
    gw.admin_post("/api/resilience/cooldowns", r#"{"all": true}"#);
    mock.set_fault("status=429;times=2");
    let r = chat(&gw, &[], br#"{"model":"m"}"#);
    assert_eq!(r.status, 429);
    // It is the connection's cooldown as the admin API shows it (whole seconds, rounded
    // up, so the two readings may differ by one).
    let cooling = gw.admin_get("/api/resilience/cooldowns").json()["connections"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["remaining_s"].as_u64())
        .max()
        .unwrap();
    assert!(cooling >= 1, "no connection is cooling");
    let told = retry(&r);
    assert!(
        told >= cooling && told <= cooling + 1,
        "Retry-After {told}, connection cooling {cooling} s"
    );
    assert_eq!(mock.route_count("/v1/chat/completions"), 4);
}
