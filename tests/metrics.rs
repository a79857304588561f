//! The state gauges of SPEC §9 that are derived at scrape time: cooling connections,
//! terminal connections and active model lockouts (with a quota bucket that spreads a
//! lock to its sibling, so no call is spent on an account that is out of quota).

// Integration tests: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::gw::{server_section, Gateway};
use common::Mock;

const KEYS: &[(&str, &str)] = &[("K1", "key-one"), ("K2", "key-two"), ("K3", "key-three")];

fn config(mock: &str, resilience: &str) -> String {
    format!(
        "{}providers:
  - id: p
    base_url: \"{mock}\"
    api: openai
    connections:
      - {{ id: c1, api_key_env: K1, bucket: org }}
      - {{ id: c2, api_key_env: K2, bucket: org }}
      - {{ id: c3, api_key_env: K3 }}
models:
  - name: m
    targets: [ {{ provider: p, model: up }} ]
{resilience}",
        server_section("")
    )
}

fn gauge(gw: &Gateway, series: &str) -> f64 {
    gw.metric(series)
        .unwrap_or_else(|| panic!("{series} is not exported"))
}

fn cooling(c: &str) -> String {
    format!("sluice_connection_cooling{{connection=\"{c}\",provider=\"p\"}}")
}

fn terminal(c: &str, state: &str) -> String {
    format!("sluice_connection_terminal{{connection=\"{c}\",provider=\"p\",state=\"{state}\"}}")
}

#[test]
fn cooling_and_terminal_connections_show_in_their_gauges() {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(&config(&mock.base_url(), ""), KEYS);
    for c in ["c1", "c2", "c3"] {
        assert_eq!(gauge(&gw, &cooling(c)), 0.0);
        assert_eq!(gauge(&gw, &terminal(c, "credits_exhausted")), 0.0);
    }
    // c3 (outside the bucket) runs out of credits: terminal, not cooling. Connections
    // rotate, so three requests reach every connection once.
    mock.set_fault("status=402;credential=key-three");
    for _ in 0..3 {
        assert_eq!(gw.chat(r#"{"model":"m"}"#).status, 200);
    }
    assert_eq!(mock.stats()["by_credential"]["key-three"], 1);
    // c1 is rate-limited for 30 s, which cools its bucket sibling c2 too.
    mock.set_fault("status=429;retry_after=30;credential=key-one");
    // The request that reaches c1 gets its 429 (c2 cools with it, c3 is terminal).
    let before = mock.stats()["by_credential"]["key-one"]
        .as_u64()
        .unwrap_or(0);
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(gw.chat(r#"{"model":"m"}"#).status);
        if mock.stats()["by_credential"]["key-one"]
            .as_u64()
            .unwrap_or(0)
            > before
        {
            break;
        }
    }
    assert_eq!(statuses.last(), Some(&429), "{statuses:?}");
    assert_eq!(gauge(&gw, &terminal("c3", "credits_exhausted")), 1.0);
    assert_eq!(gauge(&gw, &terminal("c3", "banned")), 0.0);
    assert_eq!(gauge(&gw, &cooling("c3")), 0.0);
    assert_eq!(gauge(&gw, &cooling("c1")), 1.0);
    assert_eq!(gauge(&gw, &cooling("c2")), 1.0);
    // The operator clears the cooldowns: the gauges follow at once.
    gw.admin_post("/api/resilience/cooldowns", r#"{"all": true}"#);
    assert_eq!(gauge(&gw, &cooling("c1")), 0.0);
    assert_eq!(gauge(&gw, &cooling("c2")), 0.0);
    assert_eq!(gauge(&gw, &terminal("c3", "credits_exhausted")), 1.0);
}

#[test]
fn a_rate_limit_lock_reaches_the_bucket_sibling_and_counts_as_active() {
    let mock = Mock::start(&["--fault", "status=429;retry_after=30;credential=key-one"]);
    let gw = Gateway::start(
        &config(
            &mock.base_url(),
            "resilience:\n  model_lockout: { enabled: true }\n",
        ),
        KEYS,
    );
    assert_eq!(gauge(&gw, "sluice_model_lockouts_active"), 0.0);
    // The first request starts on c1 (rotation starts at the first connection): its
    // 429 locks `up` on c1 and on its bucket sibling c2, so the failover goes to c3.
    let r = gw.chat(r#"{"model":"m"}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-sluice-connection"), Some("c3"));
    assert_eq!(r.header("x-sluice-attempts"), Some("2"));
    for _ in 0..3 {
        let r = gw.chat(r#"{"model":"m"}"#);
        assert_eq!(r.header("x-sluice-connection"), Some("c3"));
    }
    let by = &mock.stats()["by_credential"];
    assert_eq!(by["key-one"], 1, "{by}");
    assert!(
        by["key-two"].is_null() || by["key-two"] == 0,
        "the sibling was called: {by}"
    );
    assert_eq!(by["key-three"], 4, "{by}");
    // A lock, not a cooldown (lockouts take rate limits when enabled).
    assert_eq!(gauge(&gw, &cooling("c1")), 0.0);
    assert_eq!(gauge(&gw, "sluice_model_lockouts_active"), 2.0);
    let locks = gw.admin_get("/api/resilience/model-cooldowns").json()["lockouts"].clone();
    let held: Vec<(&str, &str)> = locks
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            (
                l["connection"].as_str().unwrap(),
                l["model"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(held, vec![("c1", "up"), ("c2", "up")]);
    assert!(locks[1]["remaining_s"].as_u64().unwrap() >= 25, "{locks}");
}
