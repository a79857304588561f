//! Exclusive session leases (SPEC §5.6): acquire, use with the right generation, 409
//! with a stale one, 429 with Retry-After for a second client when every allowed
//! connection is leased, release frees it, and a lease survives a restart.

// Integration tests: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::gw::{server_section, Gateway};
use common::{request, Mock, Response};

fn config(mock: &str) -> String {
    format!(
        "{}clients:
  - {{ id: agent-a, key_env: CA, scopes: [\"lease:exclusive\"], allowed_connections: [\"p/k1\", \"p/k2\"] }}
  - {{ id: agent-b, key_env: CB, scopes: [\"lease:exclusive\"], allowed_connections: [\"p/k1\", \"p/k2\"] }}
  - {{ id: plain, key_env: CP }}
providers:
  - id: p
    base_url: \"{mock}\"
    api: openai
    connections:
      - {{ id: k1, api_key_env: K1 }}
      - {{ id: k2, api_key_env: K2 }}
      - {{ id: k3, api_key_env: K3 }}
models:
  - name: m
    strategy: round-robin
    targets: [ {{ provider: p, model: up }} ]
",
        server_section("")
    )
}

const ENV: &[(&str, &str)] = &[
    ("CA", "client-a"),
    ("CB", "client-b"),
    ("CP", "client-p"),
    ("K1", "key-1"),
    ("K2", "key-2"),
    ("K3", "key-3"),
];

fn lease(gw: &Gateway, key: &str, body: &str) -> Response {
    let auth = format!("Bearer {key}");
    request(
        gw.client,
        "POST",
        "/api/v1/session-leases",
        &[("authorization", &auth)],
        body.as_bytes(),
    )
}

fn chat_with(gw: &Gateway, key: &str, owner: &str, generation: &str) -> Response {
    let auth = format!("Bearer {key}");
    request(
        gw.client,
        "POST",
        "/v1/chat/completions",
        &[
            ("authorization", &auth),
            ("x-sluice-lease-owner", owner),
            ("x-sluice-lease-generation", generation),
        ],
        br#"{"model":"m"}"#,
    )
}

fn chat(gw: &Gateway, key: &str) -> Response {
    let auth = format!("Bearer {key}");
    request(
        gw.client,
        "POST",
        "/v1/chat/completions",
        &[("authorization", &auth)],
        br#"{"model":"m"}"#,
    )
}

#[test]
fn lease_lifecycle_fence_contention_and_restart() {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(&config(&mock.base_url()), ENV);

    // Scope: a key without lease:exclusive may not lease.
    assert_eq!(
        lease(&gw, "client-p", r#"{"action":"acquire"}"#).status,
        403
    );

    let a = lease(&gw, "client-a", r#"{"action":"acquire","ttl_s":600}"#);
    assert_eq!(a.status, 200, "{}", a.text());
    let a = a.json();
    let owner = a["owner"].as_str().unwrap().to_string();
    assert!(owner.starts_with("slo_") && owner.len() == 47, "{owner}");
    let generation = a["generation"].as_u64().unwrap().to_string();
    let leased = a["connection"].as_str().unwrap().to_string();
    assert_eq!(leased, "p/k1");

    // Using it: every request goes to the leased connection; the lease headers never
    // reach the upstream.
    for _ in 0..4 {
        let r = chat_with(&gw, "client-a", &owner, &generation);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-sluice-connection"), Some("k1"));
    }
    let h = &mock.stats()["last_headers"];
    assert!(
        h.get("x-sluice-lease-owner").is_none() && h.get("x-sluice-lease-generation").is_none(),
        "{h}"
    );
    // A stale generation is fenced off.
    let stale = chat_with(&gw, "client-a", &owner, "999");
    assert_eq!(stale.status, 409);
    assert_eq!(stale.json()["error"]["code"], "lease_generation_stale");
    // Another key cannot use someone else's lease.
    assert_eq!(chat_with(&gw, "client-b", &owner, &generation).status, 403);
    // Everyone else avoids the leased connection.
    for _ in 0..4 {
        assert_ne!(
            chat(&gw, "client-p").header("x-sluice-connection"),
            Some("k1")
        );
    }

    // b takes the other allowed connection; a third lease finds nothing free: 429.
    let b = lease(&gw, "client-b", r#"{"action":"acquire","ttl_s":120}"#).json();
    assert_eq!(b["connection"], "p/k2");
    let c = lease(&gw, "client-b", r#"{"action":"acquire"}"#);
    assert_eq!(c.status, 429, "{}", c.text());
    assert_eq!(c.json()["error"]["code"], "lease_capacity_unavailable");
    let retry: u64 = c.header("retry-after").unwrap().parse().unwrap();
    assert!(
        (100..=120).contains(&retry),
        "earliest expiry is b's 120 s lease: {retry}"
    );
    // Ordinary routing for agent-b (allowed k1, k2 only) is all leased: 429 too.
    let r = chat(&gw, "client-b");
    assert_eq!(r.status, 429);
    assert_eq!(r.json()["error"]["code"], "lease_capacity_unavailable");

    // The lease is durable: kill -9, restart, same owner and generation still work.
    let gw = gw.crash_and_restart();
    let r = chat_with(&gw, "client-a", &owner, &generation);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-sluice-connection"), Some("k1"));
    let m = request(gw.admin, "GET", "/metrics", &[], b"").text();
    assert!(m.contains("sluice_leases_active 2"), "{m}");

    // Renew keeps the generation; release frees k1 for the next acquire.
    let renewed = lease(
        &gw,
        "client-a",
        &format!("{{\"action\":\"renew\",\"owner\":\"{owner}\",\"ttl_s\":900}}"),
    );
    assert_eq!(renewed.status, 200);
    assert_eq!(
        renewed.json()["generation"].as_u64().unwrap().to_string(),
        generation
    );
    let released = lease(
        &gw,
        "client-a",
        &format!("{{\"action\":\"release\",\"owner\":\"{owner}\"}}"),
    );
    assert_eq!(released.status, 200);
    assert_eq!(chat_with(&gw, "client-a", &owner, &generation).status, 409);
    let again = lease(&gw, "client-b", r#"{"action":"acquire"}"#);
    assert_eq!(again.status, 200, "{}", again.text());
    assert_eq!(again.json()["connection"], "p/k1");
    assert!(again.json()["generation"].as_u64().unwrap() > generation.parse::<u64>().unwrap());
}
