//! Every branch of SPEC §5.13 with a hand clock.

use super::*;
use crate::policy::header_map;

const NOW: Millis = 1_800_000_000_000;
const BOTH: Settings = Settings {
    low_priority: true,
    limit_reset: true,
};
const LANE_ONLY: Settings = Settings {
    low_priority: true,
    limit_reset: false,
};
const HOUR: Duration = Duration::from_secs(3600);

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn wall(extra: &[(&str, &str)]) -> Signal {
    let mut pairs = vec![
        ("anthropic-ratelimit-unified-status", "rejected"),
        ("anthropic-ratelimit-unified-slow-offer", "treatment"),
    ];
    pairs.extend_from_slice(extra);
    Signal::read(429, &header_map(&pairs))
}

fn answer(status: u16, pairs: &[(&str, &str)]) -> Signal {
    Signal::read(status, &header_map(pairs))
}

fn reset_in(d: Duration) -> String {
    ((NOW + ms(d)) / 1000).to_string()
}

fn in_lane(window: Duration) -> SubState {
    let mut s = SubState::default();
    let r = reset_in(window);
    s.enter_lane(&wall(&[("anthropic-ratelimit-unified-reset", &r)]), NOW);
    s
}

#[test]
fn the_wall_is_a_429_with_the_unified_status_rejected() {
    let w = wall(&[]);
    assert!(w.wall && w.offer);
    // A 429 without the unified headers is an ordinary rate limit.
    let plain = answer(429, &[("retry-after", "30")]);
    assert!(!plain.wall);
    assert_eq!(
        SubState::default().on_wall(BOTH, &plain, false, NOW),
        OnWall::Normal
    );
    // The header on another status is no wall either.
    assert!(!answer(200, &[("anthropic-ratelimit-unified-status", "rejected")]).wall);
    // Allowed (not rejected) is no wall.
    assert!(!answer(429, &[("anthropic-ratelimit-unified-status", "allowed")]).wall);
}

#[test]
fn the_reset_time_reads_unix_seconds_and_rfc3339() {
    let r = reset_in(HOUR);
    let a = answer(429, &[("anthropic-ratelimit-unified-reset", &r)]);
    assert_eq!(a.window_reset, Some(NOW + 3_600_000));
    let b = answer(
        429,
        &[("anthropic-ratelimit-unified-reset", "2027-01-15T08:00:00Z")],
    );
    assert_eq!(
        b.window_reset,
        crate::policy::timefmt::rfc3339_ms("2027-01-15T08:00:00Z")
    );
    assert!(b.window_reset.is_some());
    assert_eq!(
        answer(429, &[("anthropic-ratelimit-unified-reset", "soon")]).window_reset,
        None
    );
}

#[test]
fn limit_reset_is_tried_first_when_both_are_on() {
    let s = SubState::default();
    assert_eq!(s.on_wall(BOTH, &wall(&[]), false, NOW), OnWall::TryReset);
    // Once per request: after a reset that did not help, the lane.
    assert_eq!(s.on_wall(BOTH, &wall(&[]), true, NOW), OnWall::EnterLane);
    // Reset alone, no lane: after the reset, the normal path.
    let reset_only = Settings {
        low_priority: false,
        limit_reset: true,
    };
    assert_eq!(
        s.on_wall(reset_only, &wall(&[]), false, NOW),
        OnWall::TryReset
    );
    assert_eq!(s.on_wall(reset_only, &wall(&[]), true, NOW), OnWall::Normal);
    // Both off (the default): nothing special.
    assert_eq!(
        s.on_wall(Settings::default(), &wall(&[]), false, NOW),
        OnWall::Normal
    );
}

#[test]
fn a_claimable_reset_is_claimed_and_a_reset_result_goes_at_full_speed() {
    let body = br#"{"juniper_tide":{"arm":"reset","available":true},"five_hour":{}}"#;
    assert_eq!(parse_usage(body), Some(Usage::Claimable));
    let mut s = in_lane(HOUR);
    assert!(s.on_usage(Usage::Claimable, NOW));
    for result in [
        &br#"{"result":"reset"}"#[..],
        br#"{"result":"not_limited"}"#,
    ] {
        let claim = parse_claim(result).unwrap();
        assert_eq!(claim, Claim::FullSpeed);
        assert!(s.clone().on_claim(claim, NOW));
    }
    assert!(s.on_claim(Claim::FullSpeed, NOW));
    assert_eq!(s.reset_claimed_at, NOW);
    assert!(!s.lane_active(NOW), "a claimed reset ends the lane");
    assert_eq!(claim_body(), r#"{"program":"juniper_tide"}"#);
}

#[test]
fn already_used_and_not_offered_are_remembered_until_next_available_at() {
    for result in ["already_used", "not_offered"] {
        let mut s = SubState::default();
        let next = (NOW / 1000 + 3 * 86_400).to_string();
        let body = format!(r#"{{"result":"{result}","next_available_at":{next}}}"#);
        let claim = parse_claim(body.as_bytes()).unwrap();
        assert!(!s.on_claim(claim, NOW));
        assert_eq!(s.reset_available_at, NOW + 3 * 86_400_000);
        // Until then a wall goes straight to the lane.
        assert_eq!(
            s.on_wall(BOTH, &wall(&[]), false, NOW + 1000),
            OnWall::EnterLane
        );
        assert_eq!(
            s.on_wall(BOTH, &wall(&[]), false, NOW + 3 * 86_400_000),
            OnWall::TryReset
        );
    }
    // Without next_available_at: one week.
    let mut s = SubState::default();
    assert!(!s.on_claim(parse_claim(br#"{"result":"already_used"}"#).unwrap(), NOW));
    assert_eq!(s.reset_available_at, NOW + 7 * 86_400_000);
    // RFC 3339 works too.
    let c = parse_claim(br#"{"result":"not_offered","next_available_at":"2027-01-15T08:00:00Z"}"#);
    assert_eq!(
        c,
        Some(Claim::Unavailable {
            next: crate::policy::timefmt::rfc3339_ms("2027-01-15T08:00:00Z")
        })
    );
}

#[test]
fn a_usage_check_without_a_claimable_reset_is_remembered() {
    let mut s = SubState::default();
    let body = br#"{"juniper_tide":{"arm":"none","available":false}}"#;
    let u = parse_usage(body).unwrap();
    assert!(!s.on_usage(u, NOW));
    assert_eq!(s.reset_available_at, NOW + 7 * 86_400_000);
    let body =
        br#"{"juniper_tide":{"arm":"reset","available":false,"next_available_at":1800003600}}"#;
    let mut s = SubState::default();
    assert!(!s.on_usage(parse_usage(body).unwrap(), NOW));
    assert_eq!(s.reset_available_at, 1_800_003_600_000);
}

#[test]
fn any_reset_failure_waits_fifteen_minutes() {
    // Bodies that are not the contract are failures.
    assert_eq!(parse_usage(b"not json"), None);
    assert_eq!(parse_usage(br#"{"other":{}}"#), None);
    assert_eq!(parse_usage(br#"{"juniper_tide":7}"#), None);
    assert_eq!(parse_claim(br#"{"result":"maybe"}"#), None);
    assert_eq!(parse_claim(br#"{}"#), None);
    let mut s = SubState::default();
    s.on_reset_failure(NOW);
    assert_eq!(
        s.on_wall(BOTH, &wall(&[]), false, NOW + 899_999),
        OnWall::EnterLane
    );
    assert_eq!(
        s.on_wall(BOTH, &wall(&[]), false, NOW + 900_000),
        OnWall::TryReset
    );
}

#[test]
fn the_lane_needs_the_offer_and_lasts_until_the_reset_plus_a_minute() {
    let s = SubState::default();
    let no_offer = answer(429, &[("anthropic-ratelimit-unified-status", "rejected")]);
    assert_eq!(s.on_wall(LANE_ONLY, &no_offer, false, NOW), OnWall::Normal);
    let r = reset_in(2 * HOUR);
    let w = wall(&[("anthropic-ratelimit-unified-reset", &r)]);
    assert_eq!(s.on_wall(LANE_ONLY, &w, false, NOW), OnWall::EnterLane);
    let mut s = s;
    s.enter_lane(&w, NOW);
    let end = NOW + 2 * 3_600_000 + 60_000;
    assert_eq!(s.lane.unwrap().until, end);
    assert!(s.lane_active(NOW) && s.lane_active(end - 1));
    assert!(!s.lane_active(end));
    // No reset announced (or one in the past): one window.
    let mut t = SubState::default();
    t.enter_lane(&wall(&[("anthropic-ratelimit-unified-reset", "1")]), NOW);
    assert_eq!(t.lane.unwrap().until, NOW + 5 * 3_600_000 + 60_000);
    assert_eq!(t.lane.unwrap().window_reset, 0);
}

#[test]
fn overage_in_use_on_the_wall_refuses_the_lane() {
    let w = wall(&[("anthropic-ratelimit-unified-overage-in-use", "true")]);
    assert_eq!(
        SubState::default().on_wall(LANE_ONLY, &w, false, NOW),
        OnWall::Normal
    );
}

#[test]
fn active_and_not_needed_keep_the_lane() {
    for status in ["active", "not_needed"] {
        let mut s = in_lane(HOUR);
        let a = answer(200, &[("anthropic-ratelimit-unified-slow-status", status)]);
        assert_eq!(
            s.on_lane_answer(&a, &Waits::default(), HOUR, 0.0, NOW),
            OnLane::Keep
        );
        assert!(s.lane_active(NOW));
    }
    // An ordinary answer without the header keeps it too.
    let mut s = in_lane(HOUR);
    assert_eq!(
        s.on_lane_answer(&answer(200, &[]), &Waits::default(), HOUR, 0.0, NOW),
        OnLane::Keep
    );
}

#[test]
fn slot_busy_and_529_wait_the_slow_retry_after_clamped_and_jittered() {
    let mut s = in_lane(HOUR);
    let busy = |v: &str| {
        answer(
            429,
            &[
                ("anthropic-ratelimit-unified-slow-status", "slot_busy"),
                ("anthropic-ratelimit-unified-slow-retry-after", v),
            ],
        )
    };
    let w = Waits::default();
    assert_eq!(
        s.on_lane_answer(&busy("30"), &w, HOUR, 0.0, NOW),
        OnLane::Wait(secs(30))
    );
    // ±30 %.
    assert_eq!(
        s.on_lane_answer(&busy("30"), &w, HOUR, 1.0, NOW),
        OnLane::Wait(secs(39))
    );
    assert_eq!(
        s.on_lane_answer(&busy("30"), &w, HOUR, -1.0, NOW),
        OnLane::Wait(secs(21))
    );
    // Clamped to 5–600 s.
    assert_eq!(
        s.on_lane_answer(&busy("1"), &w, HOUR, 0.0, NOW),
        OnLane::Wait(secs(5))
    );
    assert_eq!(
        s.on_lane_answer(&busy("9000"), &w, HOUR, 0.0, NOW),
        OnLane::Wait(secs(600))
    );
    // Default 20 s.
    let bare = answer(
        429,
        &[("anthropic-ratelimit-unified-slow-status", "slot_busy")],
    );
    assert_eq!(
        s.on_lane_answer(&bare, &w, HOUR, 0.0, NOW),
        OnLane::Wait(secs(20))
    );
    // A 529 waits the same way.
    assert_eq!(
        s.on_lane_answer(&answer(529, &[]), &w, HOUR, 0.0, NOW),
        OnLane::Wait(secs(20))
    );
    assert!(s.lane_active(NOW));
}

#[test]
fn waits_are_capped_by_the_max_wait_and_the_budget_minus_five_seconds() {
    let busy = |max: &str| {
        answer(
            429,
            &[
                ("anthropic-ratelimit-unified-slow-status", "slot_busy"),
                ("anthropic-ratelimit-unified-slow-retry-after", "20"),
                ("anthropic-ratelimit-unified-slow-max-wait", max),
            ],
        )
    };
    // Max-wait 120 s: 100 s waited + 20 s fits, 101 s + 20 s does not.
    let mut s = in_lane(HOUR);
    let w = Waits { total: secs(100) };
    assert_eq!(
        s.on_lane_answer(&busy("120"), &w, HOUR, 0.0, NOW),
        OnLane::Wait(secs(20))
    );
    let w = Waits { total: secs(101) };
    assert_eq!(
        s.on_lane_answer(&busy("120"), &w, HOUR, 0.0, NOW),
        OnLane::Ended(LaneEnd::MaxWait)
    );
    assert!(!s.lane_active(NOW));
    // …then a 10-minute cool-off before the offer is taken again.
    assert_eq!(s.cool_off_until, NOW + 600_000);
    assert_eq!(
        s.on_wall(LANE_ONLY, &wall(&[]), false, NOW + 599_999),
        OnWall::Normal
    );
    assert_eq!(
        s.on_wall(LANE_ONLY, &wall(&[]), false, NOW + 600_000),
        OnWall::EnterLane
    );
    // The max-wait is clamped to 1 min – 6 h (default 20 min).
    let mut s = in_lane(HOUR);
    let w = Waits { total: secs(41) };
    assert_eq!(
        s.on_lane_answer(&busy("10"), &w, HOUR, 0.0, NOW),
        OnLane::Ended(LaneEnd::MaxWait),
        "a 10 s max-wait is 60 s"
    );
    let mut s = in_lane(HOUR);
    let w = Waits { total: secs(1180) };
    let bare = answer(
        429,
        &[("anthropic-ratelimit-unified-slow-status", "slot_busy")],
    );
    assert_eq!(
        s.on_lane_answer(&bare, &w, 10 * HOUR, 0.0, NOW),
        OnLane::Wait(secs(20))
    );
    let w = Waits { total: secs(1181) };
    assert_eq!(
        s.on_lane_answer(&bare, &w, 10 * HOUR, 0.0, NOW),
        OnLane::Ended(LaneEnd::MaxWait)
    );
    // The request's budget: the next wait must leave 5 s of it (20 s fits in 25 s
    // left, not in 24 s), whatever was waited before.
    let mut s = in_lane(HOUR);
    let w = Waits { total: secs(100) };
    assert_eq!(
        s.on_lane_answer(&busy("3600"), &w, secs(25), 0.0, NOW),
        OnLane::Wait(secs(20))
    );
    assert_eq!(
        s.on_lane_answer(&busy("3600"), &w, secs(24), 0.0, NOW),
        OnLane::Ended(LaneEnd::MaxWait)
    );
    // Less than 5 s left: no wait at all.
    let mut s = in_lane(HOUR);
    assert_eq!(
        s.on_lane_answer(&busy("3600"), &Waits::default(), secs(4), 0.0, NOW),
        OnLane::Ended(LaneEnd::MaxWait)
    );
}

#[test]
fn end_statuses_end_the_lane_for_the_normal_path() {
    for (status, end) in [
        ("weekly_limit", SlowStatus::WeeklyLimit),
        ("off", SlowStatus::Off),
        ("ineligible", SlowStatus::Ineligible),
        ("something_new", SlowStatus::Other),
    ] {
        let mut s = in_lane(HOUR);
        let a = answer(429, &[("anthropic-ratelimit-unified-slow-status", status)]);
        assert_eq!(
            s.on_lane_answer(&a, &Waits::default(), HOUR, 0.0, NOW),
            OnLane::Ended(LaneEnd::Status(end))
        );
        assert!(!s.lane_active(NOW));
        // No cool-off for these: a later wall with the offer may take the lane again.
        assert_eq!(s.cool_off_until, 0);
    }
}

#[test]
fn budget_exhausted_is_remembered_until_the_reset_at_most_eight_days() {
    let mut s = in_lane(HOUR);
    let r = reset_in(secs(2 * 86_400));
    let a = answer(
        429,
        &[
            (
                "anthropic-ratelimit-unified-slow-status",
                "budget_exhausted",
            ),
            ("anthropic-ratelimit-unified-reset", &r),
        ],
    );
    assert_eq!(
        s.on_lane_answer(&a, &Waits::default(), HOUR, 0.0, NOW),
        OnLane::Ended(LaneEnd::Status(SlowStatus::BudgetExhausted))
    );
    assert_eq!(s.budget_exhausted_until, NOW + 2 * 86_400_000);
    assert_eq!(
        s.on_wall(LANE_ONLY, &wall(&[]), false, NOW + 1000),
        OnWall::Normal
    );
    assert_eq!(
        s.on_wall(LANE_ONLY, &wall(&[]), false, NOW + 2 * 86_400_000),
        OnWall::EnterLane
    );
    // A reset 30 days out is remembered for 8 days.
    let mut s = in_lane(HOUR);
    let r = reset_in(secs(30 * 86_400));
    let a = answer(
        429,
        &[
            (
                "anthropic-ratelimit-unified-slow-status",
                "budget_exhausted",
            ),
            ("anthropic-ratelimit-unified-reset", &r),
        ],
    );
    s.on_lane_answer(&a, &Waits::default(), HOUR, 0.0, NOW);
    assert_eq!(s.budget_exhausted_until, NOW + 8 * 86_400_000);
}

#[test]
fn overage_in_use_ends_the_lane_on_any_status() {
    for status in [200, 429, 529] {
        let mut s = in_lane(HOUR);
        let a = answer(
            status,
            &[
                ("anthropic-ratelimit-unified-slow-status", "active"),
                ("anthropic-ratelimit-unified-overage-in-use", "true"),
            ],
        );
        assert_eq!(
            s.on_lane_answer(&a, &Waits::default(), HOUR, 0.0, NOW),
            OnLane::Ended(LaneEnd::Overage)
        );
        assert!(!s.lane_active(NOW));
    }
}

#[test]
fn a_window_rollover_ends_the_lane() {
    let mut s = in_lane(HOUR);
    let same = reset_in(HOUR);
    let a = answer(
        200,
        &[
            ("anthropic-ratelimit-unified-slow-status", "active"),
            ("anthropic-ratelimit-unified-reset", &same),
        ],
    );
    assert_eq!(
        s.on_lane_answer(&a, &Waits::default(), HOUR, 0.0, NOW),
        OnLane::Keep
    );
    // A minute later is the same window (clocks, rounding).
    let close = reset_in(HOUR + secs(60));
    let a = answer(200, &[("anthropic-ratelimit-unified-reset", &close)]);
    assert_eq!(
        s.on_lane_answer(&a, &Waits::default(), HOUR, 0.0, NOW),
        OnLane::Keep
    );
    let next = reset_in(6 * HOUR);
    let a = answer(200, &[("anthropic-ratelimit-unified-reset", &next)]);
    assert_eq!(
        s.on_lane_answer(&a, &Waits::default(), HOUR, 0.0, NOW),
        OnLane::Ended(LaneEnd::Rollover)
    );
}

#[test]
fn a_wall_without_a_slow_status_on_the_lane_ends_it() {
    let mut s = in_lane(HOUR);
    let a = answer(429, &[("anthropic-ratelimit-unified-status", "rejected")]);
    assert_eq!(
        s.on_lane_answer(&a, &Waits::default(), HOUR, 0.0, NOW),
        OnLane::Ended(LaneEnd::Refused)
    );
}

#[test]
fn the_state_round_trips_and_an_empty_one_serialises_to_nothing() {
    assert_eq!(serde_json::to_string(&SubState::default()).unwrap(), "{}");
    let mut s = in_lane(HOUR);
    s.on_reset_failure(NOW);
    let back: SubState = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
    assert_eq!(back, s);
    assert!(s.lane_active(NOW) && s.reset_retry_at > NOW);
}

#[test]
fn the_oauth_beta_is_merged_with_the_clients_values() {
    assert_eq!(merged_beta(None), "oauth-2025-04-20");
    assert_eq!(merged_beta(Some(" ")), "oauth-2025-04-20");
    assert_eq!(
        merged_beta(Some("prompt-caching-2024-07-31")),
        "prompt-caching-2024-07-31,oauth-2025-04-20"
    );
    assert_eq!(
        merged_beta(Some("a, oauth-2025-04-20")),
        "a, oauth-2025-04-20"
    );
}

#[test]
fn a_predecessors_later_memory_is_merged_in() {
    let mut ours = SubState::default();
    ours.on_reset_failure(NOW);
    let mut theirs = in_lane(HOUR);
    theirs.cool_off_until = NOW + 5;
    assert!(ours.merge_later(&theirs));
    assert!(ours.lane_active(NOW));
    assert_eq!(ours.reset_retry_at, NOW + 900_000);
    assert_eq!(ours.cool_off_until, NOW + 5);
    // Nothing later: nothing changes.
    assert!(!ours.merge_later(&SubState::default()));
    let older = SubState {
        lane: Some(Lane {
            since: NOW - 1,
            until: NOW + 10,
            window_reset: 0,
        }),
        ..SubState::default()
    };
    assert!(!ours.merge_later(&older));
}

#[test]
fn a_529_on_the_lane_waits_unless_its_status_ends_it() {
    let mut s = in_lane(HOUR);
    let w = Waits::default();
    for status in ["active", "not_needed"] {
        let a = answer(529, &[("anthropic-ratelimit-unified-slow-status", status)]);
        assert_eq!(
            s.on_lane_answer(&a, &w, HOUR, 0.0, NOW),
            OnLane::Wait(secs(20))
        );
    }
    let a = answer(
        529,
        &[("anthropic-ratelimit-unified-slow-status", "weekly_limit")],
    );
    assert_eq!(
        s.on_lane_answer(&a, &w, HOUR, 0.0, NOW),
        OnLane::Ended(LaneEnd::Status(SlowStatus::WeeklyLimit))
    );
    // A retry-after of 0 is clamped to 5 s, not read as absent.
    let mut s = in_lane(HOUR);
    let a = answer(
        429,
        &[
            ("anthropic-ratelimit-unified-slow-status", "slot_busy"),
            ("anthropic-ratelimit-unified-slow-retry-after", "0"),
        ],
    );
    assert_eq!(
        s.on_lane_answer(&a, &w, HOUR, 0.0, NOW),
        OnLane::Wait(secs(5))
    );
}

#[test]
fn an_ended_lane_does_not_come_back_through_a_merge() {
    let holder = in_lane(HOUR);
    let mut ended = holder;
    let a = answer(429, &[("anthropic-ratelimit-unified-slow-status", "off")]);
    ended.on_lane_answer(&a, &Waits::default(), HOUR, 0.0, NOW + 1000);
    assert!(!ended.lane_active(NOW + 1000));
    // The other side still holds the older lane: the later decision (the end) wins.
    assert!(!ended.merge_later(&holder));
    assert!(!ended.lane_active(NOW + 1000));
    let mut old = holder;
    assert!(old.merge_later(&ended));
    assert!(!old.lane_active(NOW + 1000));
    // A lane entered after the end wins over it.
    let mut again = SubState::default();
    again.enter_lane(&wall(&[]), NOW + 2000);
    assert!(ended.merge_later(&again));
    assert!(ended.lane_active(NOW + 2000));
}
