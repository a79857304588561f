//! The Claude subscription lane end to end (SPEC §5.13), against the mock's subscription
//! account: a wall taken by the lane on the same connection (no cooldown, no failover),
//! later requests slow from the start, the lane across a restart; a busy slot waited
//! out; waits past their cap ending the lane with a cool-off and the normal cooldown; a
//! limit reset claimed, one already used remembered, a failed one retried after 15 min;
//! an ordinary 429 cooling as usual; the lane shared by two nodes through Redis;
//! `sluice check` on the block.

// Integration tests: a failed unwrap is a failed test, and they time the real binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod common;

use common::gw::{server_section, Gateway, TempDir};
use common::{request, Mock, Response};
use serde_json::Value;
use std::time::{Duration, Instant};

/// Provider `claude` (oauth) with `sub` (the subscription account) first and `spare`
/// (a second account without the lane) behind it.
fn config(mock: &str, sub: &str, server_extra: &str) -> String {
    format!(
        "{}providers:
  - id: claude
    base_url: \"{mock}\"
    api: anthropic
    class: oauth
    connections:
      - id: sub
        api_key_env: SUB_TOKEN
        subscription: {sub}
      - {{ id: spare, api_key_env: SPARE_TOKEN }}
models:
  - name: claude-sonnet
    strategy: priority
    targets:
      - {{ provider: claude, model: claude-sonnet-4, connection: sub }}
      - {{ provider: claude, model: claude-sonnet-4, connection: spare }}
",
        server_section(server_extra)
    )
}

const TOKENS: &[(&str, &str)] = &[("SUB_TOKEN", "oat-sub"), ("SPARE_TOKEN", "oat-spare")];
const LANE: &str = "{ low_priority: true }";
const BOTH: &str = "{ low_priority: true, limit_reset: true, organization_uuid: \"org-1234\" }";
const RESET_ONLY: &str = "{ limit_reset: true, organization_uuid: \"org-1234\" }";

/// Arms the mock's account for `sub`'s token (`spare` is an ordinary account).
fn arm(mock: &Mock, plan: &str) {
    let plan = plan.replacen('{', r#"{"credential": "oat-sub", "#, 1);
    let r = request(mock.addr, "POST", "/__subscription", &[], plan.as_bytes());
    assert_eq!(r.status, 200, "arming the account: {}", r.text());
}

fn messages(gw: &Gateway) -> Response {
    request(
        gw.client,
        "POST",
        "/v1/messages",
        &[
            ("content-type", "application/json"),
            ("anthropic-beta", "interleaved-thinking-2025-05-14"),
        ],
        br#"{"model":"claude-sonnet","max_tokens":16,"messages":[{"role":"user","content":"hi"}]}"#,
    )
}

fn account(mock: &Mock) -> Value {
    mock.stats()["subscription"].clone()
}

/// Some counters of the account's stats, in order (absent ones read as `u64::MAX`).
fn tally(a: &Value, keys: &[&str]) -> Vec<u64> {
    keys.iter()
        .map(|k| a[*k].as_u64().unwrap_or(u64::MAX))
        .collect()
}

fn calls(mock: &Mock, token: &str) -> u64 {
    mock.stats()["by_credential"][token].as_u64().unwrap_or(0)
}

fn row(gw: &Gateway, id: &str) -> Value {
    gw.cooldown_row("claude", id)
}

fn event(gw: &Gateway, name: &str) -> f64 {
    gw.metric(&format!(
        "sluice_subscription_events_total{{event=\"{name}\"}}"
    ))
    .unwrap_or(-1.0)
}

fn lane_gauge(gw: &Gateway) -> Option<f64> {
    gw.metric("sluice_subscription_lane_active{connection=\"sub\",provider=\"claude\"}")
}

#[test]
fn a_wall_takes_the_lane_on_the_same_connection_and_later_requests_start_slow() {
    let mock = Mock::start(&[]);
    arm(&mock, r#"{"reset_in": 7200, "slow": ["active"]}"#);
    let gw = Gateway::start(&config(&mock.base_url(), LANE, ""), TOKENS);

    let r = messages(&gw);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-sluice-connection"), Some("sub"));
    let a = account(&mock);
    assert_eq!(a["walls"], 1, "{a}");
    assert_eq!(a["fast_requests"], 1, "{a}");
    assert_eq!(
        a["slow_requests"], 1,
        "one retry, with the slow header: {a}"
    );
    assert_eq!(calls(&mock, "oat-spare"), 0, "no rotation");
    // The retry carried the OAuth credential, the client's beta plus the OAuth one.
    let last = &mock.stats()["last_headers"];
    assert_eq!(last["anthropic-usage-limit"], "slow");
    assert_eq!(last["authorization"], "Bearer oat-sub");
    assert!(last.get("x-api-key").is_none(), "{last}");
    assert_eq!(
        last["anthropic-beta"],
        "interleaved-thinking-2025-05-14,oauth-2025-04-20"
    );
    // No cooldown, no breaker count: the wall was not a failure.
    let sub = row(&gw, "sub");
    assert_eq!(sub["state"], "ok", "{sub}");
    assert_eq!(sub["backoff_level"], 0, "{sub}");
    assert!(sub["last_status"].is_null(), "{sub}");
    assert_eq!(sub["subscription"]["lane"], "active", "{sub}");
    let left = sub["subscription"]["lane_remaining_s"].as_u64().unwrap();
    assert!((7200..=7261).contains(&left), "the reset + 60 s: {left}");
    let health = gw.admin_get("/api/monitoring/health").json();
    assert_eq!(health["providers"][0]["state"], "CLOSED", "{health}");
    assert_eq!(lane_gauge(&gw), Some(1.0));
    assert_eq!(event(&gw, "wall"), 1.0);
    assert_eq!(event(&gw, "lane_entered"), 1.0);

    // Later requests carry the header from the start: no second wall.
    for _ in 0..3 {
        let r = messages(&gw);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-sluice-connection"), Some("sub"));
    }
    let a = account(&mock);
    assert_eq!(tally(&a, &["walls", "slow_requests"]), [1, 4], "{a}");

    // The lane survives a restart (kill -9 after the batched write had time to land).
    std::thread::sleep(Duration::from_millis(600));
    let gw = gw.crash_and_restart();
    let r = messages(&gw);
    assert_eq!(r.status, 200, "{}", r.text());
    let a = account(&mock);
    assert_eq!(tally(&a, &["walls", "slow_requests"]), [1, 5], "{a}");
    assert_eq!(row(&gw, "sub")["subscription"]["lane"], "active");
}

#[test]
fn a_lane_kept_after_low_priority_is_switched_off_is_not_used() {
    let mock = Mock::start(&[]);
    arm(
        &mock,
        r#"{"slow": ["active"], "usage": "reset", "claim": "reset"}"#,
    );
    let gw = Gateway::start(&config(&mock.base_url(), LANE, ""), TOKENS);
    assert_eq!(messages(&gw).status, 200);
    assert_eq!(row(&gw, "sub")["subscription"]["lane"], "active");
    // The operator turns the lane off and the limit reset on; the lane's memory stays.
    gw.rewrite_config(&config(&mock.base_url(), RESET_ONLY, ""));
    let r = gw.admin_post("/api/config/reload", "");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(row(&gw, "sub")["subscription"]["lane"], "off");
    assert_eq!(lane_gauge(&gw), Some(0.0));
    // The next wall goes to the limit reset, once, not around a lane it cannot use.
    let r = messages(&gw);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-sluice-connection"), Some("sub"));
    let a = account(&mock);
    assert_eq!(a["walls"], 2, "{a}");
    assert_eq!(tally(&a, &["usage_calls", "claim_calls"]), [1, 1], "{a}");
    assert_eq!(a["slow_requests"], 1, "{a}");
}

#[test]
fn a_busy_slot_is_waited_out_for_its_retry_after() {
    let mock = Mock::start(&[]);
    arm(
        &mock,
        r#"{"slow": ["slot_busy", "active"], "slow_retry_after": 5}"#,
    );
    let gw = Gateway::start(&config(&mock.base_url(), LANE, ""), TOKENS);
    let started = Instant::now();
    let r = messages(&gw);
    let took = started.elapsed();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-sluice-connection"), Some("sub"));
    // 5 s ± 30 %, plus the request itself.
    assert!(
        took >= Duration::from_millis(3500) && took <= Duration::from_millis(7500),
        "served after {took:?}"
    );
    let a = account(&mock);
    assert_eq!(tally(&a, &["walls", "slow_requests"]), [1, 2], "{a}");
    assert_eq!(calls(&mock, "oat-spare"), 0);
    assert_eq!(event(&gw, "lane_wait"), 1.0);
    assert_eq!(row(&gw, "sub")["state"], "ok");
}

#[test]
fn waits_past_their_cap_end_the_lane_with_a_cool_off_and_the_normal_cooldown() {
    let mock = Mock::start(&[]);
    arm(&mock, r#"{"slow": ["slot_busy"], "slow_retry_after": 5}"#);
    // A 12 s budget: one wait of 3.5–6.5 s leaves 5 s, a second one cannot.
    let server = "resilience:\n  queue: { execution_timeout: \"12s\" }\n";
    let yaml = config(&mock.base_url(), LANE, "").replace("models:", &format!("{server}models:"));
    let gw = Gateway::start(&yaml, TOKENS);
    let started = Instant::now();
    let r = messages(&gw);
    let took = started.elapsed();
    // The lane gave up; the busy answer went the normal way: cooled, failed over.
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-sluice-connection"), Some("spare"));
    assert!(took < Duration::from_secs(12), "took {took:?}");
    let a = account(&mock);
    assert_eq!(tally(&a, &["walls", "slow_requests"]), [1, 2], "{a}");
    assert_eq!(event(&gw, "lane_wait"), 1.0);
    assert_eq!(event(&gw, "lane_max_wait"), 1.0);
    let sub = row(&gw, "sub");
    assert_eq!(sub["state"], "cooling", "{sub}");
    assert_eq!(sub["last_status"], 429, "{sub}");
    assert_eq!(sub["subscription"]["lane"], "off", "{sub}");
    let cool_off = sub["subscription"]["cool_off_remaining_s"]
        .as_u64()
        .unwrap();
    assert!((590..=600).contains(&cool_off), "cool-off {cool_off}");
    assert_eq!(lane_gauge(&gw), Some(0.0));

    // During the cool-off a wall is an ordinary 429: no lane, the connection cools.
    let clear = gw.admin_post(
        "/api/resilience/cooldowns",
        r#"{"connections": ["claude/sub"]}"#,
    );
    assert_eq!(clear.status, 200, "{}", clear.text());
    let r = messages(&gw);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-sluice-connection"), Some("spare"));
    let a = account(&mock);
    assert_eq!(tally(&a, &["walls", "slow_requests"]), [2, 2], "{a}");
    assert_eq!(row(&gw, "sub")["state"], "cooling");
}

#[test]
fn a_claimed_limit_reset_goes_on_at_full_speed() {
    let mock = Mock::start(&[]);
    arm(&mock, r#"{"usage": "reset", "claim": "reset"}"#);
    let gw = Gateway::start(&config(&mock.base_url(), BOTH, ""), TOKENS);
    let r = messages(&gw);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-sluice-connection"), Some("sub"));
    let a = account(&mock);
    assert_eq!(a["usage_calls"], 1, "{a}");
    assert_eq!(a["last_usage_query"], "at_wall=1&skip_spend=1", "{a}");
    assert_eq!(a["claim_calls"], 1, "{a}");
    assert_eq!(a["last_claim_org"], "org-1234", "{a}");
    assert_eq!(a["last_claim_body"], r#"{"program":"juniper_tide"}"#, "{a}");
    assert_eq!(a["last_oauth_bearer"], true, "{a}");
    assert_eq!(a["last_oauth_beta"], "oauth-2025-04-20", "{a}");
    // The retry went at full speed, not on the lane.
    assert_eq!(tally(&a, &["walls", "fast_requests"]), [1, 2], "{a}");
    assert_eq!(a["slow_requests"], 0, "{a}");
    assert!(mock.stats()["last_headers"]
        .get("anthropic-usage-limit")
        .is_none());
    let sub = row(&gw, "sub");
    assert_eq!(sub["state"], "ok", "{sub}");
    assert_eq!(sub["subscription"]["lane"], "off", "{sub}");
    assert!(
        sub["subscription"]["limit_reset_claimed_at"].is_string(),
        "{sub}"
    );
    assert_eq!(event(&gw, "limit_reset_claimed"), 1.0);
    // And on: the wall is gone.
    let r = messages(&gw);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-sluice-connection"), Some("sub"), "{}", r.text());
    let a = account(&mock);
    assert_eq!(tally(&a, &["walls", "fast_requests"]), [1, 3], "{a}");
}

#[test]
fn a_limit_reset_already_used_is_remembered() {
    let mock = Mock::start(&[]);
    arm(
        &mock,
        r#"{"offer": false, "usage": "reset", "claim": "already_used", "next_available_in": 86400}"#,
    );
    let gw = Gateway::start(&config(&mock.base_url(), RESET_ONLY, ""), TOKENS);
    // No reset and no lane: the wall goes the normal way (cooled, failed over).
    let r = messages(&gw);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-sluice-connection"), Some("spare"));
    let a = account(&mock);
    assert_eq!(tally(&a, &["usage_calls", "claim_calls"]), [1, 1], "{a}");
    let sub = row(&gw, "sub");
    assert_eq!(sub["state"], "cooling", "{sub}");
    let next = sub["subscription"]["limit_reset_available_in_s"]
        .as_u64()
        .unwrap();
    assert!(
        (86_390..=86_400).contains(&next),
        "next available in {next}"
    );
    assert_eq!(event(&gw, "limit_reset_unavailable"), 1.0);
    // The next wall does not ask again.
    let clear = gw.admin_post(
        "/api/resilience/cooldowns",
        r#"{"connections": ["claude/sub"]}"#,
    );
    assert_eq!(clear.status, 200, "{}", clear.text());
    let r = messages(&gw);
    assert_eq!(r.header("x-sluice-connection"), Some("spare"));
    let a = account(&mock);
    assert_eq!(a["walls"], 2, "{a}");
    assert_eq!(tally(&a, &["usage_calls", "claim_calls"]), [1, 1], "{a}");
}

#[test]
fn a_failed_usage_check_falls_back_to_the_lane_and_is_not_retried_for_15_minutes() {
    let mock = Mock::start(&[]);
    arm(&mock, r#"{"usage": "fail"}"#);
    let gw = Gateway::start(&config(&mock.base_url(), BOTH, ""), TOKENS);
    let r = messages(&gw);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-sluice-connection"), Some("sub"));
    let a = account(&mock);
    assert_eq!(tally(&a, &["usage_calls", "claim_calls"]), [1, 0], "{a}");
    assert_eq!(a["slow_requests"], 1, "{a}");
    let sub = row(&gw, "sub");
    let retry = sub["subscription"]["limit_reset_retry_in_s"]
        .as_u64()
        .unwrap();
    assert!((890..=900).contains(&retry), "retry in {retry}");
    assert_eq!(event(&gw, "limit_reset_failed"), 1.0);
}

#[test]
fn an_ordinary_429_on_a_subscription_connection_cools_it_as_usual() {
    let mock = Mock::start(&["--fault", "status=429;retry_after=30;credential=oat-sub"]);
    let gw = Gateway::start(&config(&mock.base_url(), BOTH, ""), TOKENS);
    let r = messages(&gw);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-sluice-connection"), Some("spare"));
    assert_eq!(account(&mock)["usage_calls"], 0);
    assert_eq!(row(&gw, "sub")["state"], "cooling");
    assert_eq!(event(&gw, "wall"), 0.0);
}

#[test]
fn a_lane_entered_on_one_node_is_taken_by_another_through_redis() {
    let redis = common::redis::Redis::start();
    let mock = Mock::start(&[]);
    arm(&mock, r#"{"slow": ["active"]}"#);
    let yaml = config(&mock.base_url(), LANE, "").replace(
        "state:\n",
        "state:\n  backend: redis\n  redis: { url_env: SLUICE_REDIS_URL, key_prefix: \"s:\", sync_interval: 100ms }\n",
    );
    let url = redis.url();
    let mut env: Vec<(&str, &str)> = TOKENS.to_vec();
    env.push(("SLUICE_REDIS_URL", &url));
    let a = Gateway::start(&yaml, &env);
    let b = Gateway::start(&yaml, &env);
    let r = messages(&a);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(account(&mock)["walls"], 1);
    // Node b learns the lane from the shared rows and sends slow from the start.
    assert!(common::wait_until(Duration::from_secs(5), || {
        row(&b, "sub")["subscription"]["lane"] == "active"
    }));
    let r = messages(&b);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-sluice-connection"), Some("sub"));
    let acc = account(&mock);
    assert_eq!(tally(&acc, &["walls", "slow_requests"]), [1, 2], "{acc}");
}

fn check(yaml: &str) -> (i32, String) {
    let dir = TempDir::new("sluice-sub-check");
    let path = dir.0.join("sluice.yaml");
    std::fs::write(&path, yaml).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["check", "--config", path.to_str().unwrap()])
        .envs(TOKENS.iter().copied())
        .env("SLUICE_ADMIN_TOKEN", "t")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn sluice_check_validates_the_subscription_block() {
    let ok = config("http://127.0.0.1:9", BOTH, "");
    let (code, text) = check(&ok);
    assert_eq!(code, 0, "{text}");
    let path = "providers[0].connections[0].subscription";
    for (sub, field, words) in [
        (
            "{ limit_reset: true }",
            "organization_uuid",
            "required when limit_reset is on",
        ),
        (
            "{ limit_reset: true, organization_uuid: \"../../x\" }",
            "organization_uuid",
            "is not an organization id",
        ),
        (
            "{ low_priority: true, slow: true }",
            "",
            "unknown field `slow`",
        ),
        (
            "{ low_priority: true, oauth_base: \"ftp://x\" }",
            "oauth_base",
            "must start with http:// or https://",
        ),
    ] {
        let (code, text) = check(&config("http://127.0.0.1:9", sub, ""));
        assert_eq!(code, 1, "{sub}: {text}");
        let at = if field.is_empty() {
            path.to_string()
        } else {
            format!("{path}.{field}")
        };
        assert!(text.contains(&at) && text.contains(words), "{sub}: {text}");
    }
    // Only on class: oauth Anthropic providers.
    let apikey = ok.replace("class: oauth", "class: apikey");
    let (code, text) = check(&apikey);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains(path) && text.contains("class: oauth and api: anthropic"),
        "{text}"
    );
}
