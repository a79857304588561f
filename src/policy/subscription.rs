//! The Claude subscription lane (SPEC §5.13): what a `class: oauth` Anthropic connection
//! does when its account hits the 5-hour usage wall, instead of cooling down.
//!
//! It protects a subscription account from being treated as a failing key: a wall (429
//! with `anthropic-ratelimit-unified-status: rejected`) is answered first by a limit
//! reset, when one is available and not remembered as used, then by the low-priority
//! lane — the same connection again, every request carrying `anthropic-usage-limit:
//! slow` until the window's reset + 60 s. Everything here is pure: the state of one
//! connection, the headers of one answer, and `now` passed in (jitter too), so every
//! branch is tested with a hand clock.
//!
//! Invariants: a wall the lane or a reset takes is never a failure (the caller records
//! no cooldown, rotation or breaker count for it); a lane answer that ends the lane
//! (`weekly_limit`, `budget_exhausted`, `off`, `ineligible`, overage in use, a window
//! rollover, waits past their cap) goes the normal way; the total wait of one request
//! never exceeds the slow max-wait nor its remaining budget minus 5 s; every memory
//! (lane, cool-off, `budget_exhausted`, the reset's next availability, a failed reset)
//! ends at a fixed instant, so an old state file can only hold an expired one.

use super::fields::Fields;
use super::timefmt::rfc3339_ms;
use super::{ms, Millis};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The request header of the low-priority lane.
pub const SLOW_HEADER: &str = "anthropic-usage-limit";
pub const SLOW_VALUE: &str = "slow";
/// The `anthropic-beta` value OAuth requests carry.
pub const OAUTH_BETA: &str = "oauth-2025-04-20";
/// The limit-reset program Claude Code claims.
pub const RESET_PROGRAM: &str = "juniper_tide";

const H_STATUS: &str = "anthropic-ratelimit-unified-status";
const H_OFFER: &str = "anthropic-ratelimit-unified-slow-offer";
const H_RESET: &str = "anthropic-ratelimit-unified-reset";
const H_SLOW_STATUS: &str = "anthropic-ratelimit-unified-slow-status";
const H_SLOW_RETRY: &str = "anthropic-ratelimit-unified-slow-retry-after";
const H_SLOW_MAX_WAIT: &str = "anthropic-ratelimit-unified-slow-max-wait";
const H_OVERAGE: &str = "anthropic-ratelimit-unified-overage-in-use";

/// The lane outlives the window's announced reset by this much.
pub const LANE_GRACE: Duration = Duration::from_secs(60);
/// Lane lifetime when the wall announced no reset: one usage window.
pub const WINDOW: Duration = Duration::from_secs(5 * 3600);
/// A reset announced later than the lane's by more than this is a new window.
pub const ROLLOVER_SLACK: Duration = Duration::from_secs(60);
/// After the waits of a request passed their cap, the offer is refused this long.
pub const COOL_OFF: Duration = Duration::from_secs(600);
/// A failed usage check or claim is not tried again for this long.
pub const RESET_RETRY: Duration = Duration::from_secs(900);
/// `already_used` / `not_offered` without a `next_available_at`: one week.
pub const RESET_UNAVAILABLE: Duration = Duration::from_secs(7 * 86_400);
/// The longest `budget_exhausted` is remembered.
pub const BUDGET_MEMORY_MAX: Duration = Duration::from_secs(8 * 86_400);
/// The part of a request's budget a lane wait leaves for the answer itself.
pub const BUDGET_MARGIN: Duration = Duration::from_secs(5);
const RETRY_DEFAULT: Duration = Duration::from_secs(20);
const RETRY_MIN: Duration = Duration::from_secs(5);
const RETRY_MAX: Duration = Duration::from_secs(600);
const MAX_WAIT_DEFAULT: Duration = Duration::from_secs(20 * 60);
const MAX_WAIT_MIN: Duration = Duration::from_secs(60);
const MAX_WAIT_MAX: Duration = Duration::from_secs(6 * 3600);
/// Lane waits are spread by ±30 %.
const JITTER: f64 = 0.3;

/// `subscription:` of one connection, as the policy needs it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    pub low_priority: bool,
    pub limit_reset: bool,
}

/// `anthropic-ratelimit-unified-slow-status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlowStatus {
    Active,
    NotNeeded,
    SlotBusy,
    WeeklyLimit,
    BudgetExhausted,
    Off,
    Ineligible,
    /// A value this version does not know: it ends the lane (the safe reading).
    Other,
}

impl SlowStatus {
    fn parse(s: &str) -> SlowStatus {
        match s.trim().to_ascii_lowercase().as_str() {
            "active" => SlowStatus::Active,
            "not_needed" => SlowStatus::NotNeeded,
            "slot_busy" => SlowStatus::SlotBusy,
            "weekly_limit" => SlowStatus::WeeklyLimit,
            "budget_exhausted" => SlowStatus::BudgetExhausted,
            "off" => SlowStatus::Off,
            "ineligible" => SlowStatus::Ineligible,
            _ => SlowStatus::Other,
        }
    }
}

/// What one upstream answer says about the subscription, read from its headers.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Signal {
    pub status: u16,
    /// A 429 with `…-unified-status: rejected`: the usage wall.
    pub wall: bool,
    /// `…-slow-offer: treatment`: the account may take the low-priority lane.
    pub offer: bool,
    /// `…-unified-reset`: when the usage window resets (unix seconds or RFC 3339).
    pub window_reset: Option<Millis>,
    pub slow_status: Option<SlowStatus>,
    pub slow_retry_after: Option<Duration>,
    pub slow_max_wait: Option<Duration>,
    /// `…-overage-in-use: true`.
    pub overage: bool,
}

fn header<'h>(h: &'h (impl Fields + ?Sized), name: &str) -> Option<&'h str> {
    h.field_str(name).map(str::trim)
}

/// Seconds (possibly fractional), not negative and finite (0 is clamped by the caller).
fn seconds(s: &str) -> Option<Duration> {
    let v: f64 = s.parse().ok()?;
    (v.is_finite() && (0.0..1e9).contains(&v)).then(|| Duration::from_secs_f64(v))
}

/// A reset instant: unix seconds, or an RFC 3339 timestamp.
fn instant(s: &str) -> Option<Millis> {
    match s.parse::<u64>() {
        Ok(secs) => secs.checked_mul(1000),
        Err(_) => rfc3339_ms(s),
    }
}

impl Signal {
    /// Reads the subscription headers of an answer; total (bad values read as absent).
    pub fn read(status: u16, h: &(impl Fields + ?Sized)) -> Signal {
        let wall = status == 429
            && header(h, H_STATUS).is_some_and(|v| v.eq_ignore_ascii_case("rejected"));
        Signal {
            status,
            wall,
            offer: header(h, H_OFFER).is_some_and(|v| v.eq_ignore_ascii_case("treatment")),
            window_reset: header(h, H_RESET).and_then(instant),
            slow_status: header(h, H_SLOW_STATUS).map(SlowStatus::parse),
            slow_retry_after: header(h, H_SLOW_RETRY).and_then(seconds),
            slow_max_wait: header(h, H_SLOW_MAX_WAIT).and_then(seconds),
            overage: header(h, H_OVERAGE).is_some_and(|v| v.eq_ignore_ascii_case("true")),
        }
    }
}

/// The low-priority lane of one connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lane {
    pub since: Millis,
    /// Every request carries the slow header until then (the window's reset + 60 s).
    pub until: Millis,
    /// The window reset the wall announced (0 when it announced none): a later one on
    /// an answer is a new window, which ends the lane.
    #[serde(default)]
    pub window_reset: Millis,
}

/// One connection's subscription memory; persisted with its cooldown row.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubState {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lane: Option<Lane>,
    /// The offer is not taken before then (the waits of a request passed their cap).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cool_off_until: Millis,
    /// `budget_exhausted`: the lane is not entered before the announced reset.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub budget_exhausted_until: Millis,
    /// `already_used` / `not_offered`: no limit reset is tried before then.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub reset_available_at: Millis,
    /// A usage check or claim failed: not tried again before then.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub reset_retry_at: Millis,
    /// When a limit reset was last claimed (shown to operators).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub reset_claimed_at: Millis,
    /// When the lane last ended: an older lane another process still holds must not
    /// come back through a merge.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lane_ended_at: Millis,
}

fn is_zero(v: &Millis) -> bool {
    *v == 0
}

/// What to do about a wall.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnWall {
    /// Check the usage and claim a limit reset, then decide again with its result.
    TryReset,
    /// Enter the lane and resend at once with the slow header.
    EnterLane,
    /// Neither applies: the 429 goes the normal way (§5.3).
    Normal,
}

/// What the usage check found in its `juniper_tide` block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Usage {
    /// `arm: "reset"`, `available: true`: claim it.
    Claimable,
    /// Anything else: not available until then (when the block says).
    Unavailable { next: Option<Millis> },
}

/// The claim's `result`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// `reset` or `not_limited`: the account is at full speed again.
    FullSpeed,
    /// `already_used` or `not_offered`.
    Unavailable { next: Option<Millis> },
}

/// What to do with an answer sent on the lane.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OnLane {
    /// The lane goes on; the answer is the request's (success or a normal error).
    Keep,
    /// Wait this long and resend on the same connection, slow.
    Wait(Duration),
    /// The lane ended; the answer goes the normal way.
    Ended(LaneEnd),
}

/// Why a lane ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaneEnd {
    /// The request's waits would pass their cap: cool-off before the offer is taken again.
    MaxWait,
    /// The slow status said the lane cannot go on.
    Status(SlowStatus),
    Overage,
    /// The usage window rolled over: full speed again.
    Rollover,
    /// A wall without a slow status: the lane is not being honoured.
    Refused,
}

impl LaneEnd {
    /// The bounded label of `sluice_subscription_events_total{event}`.
    pub fn event(self) -> &'static str {
        match self {
            LaneEnd::MaxWait => "lane_max_wait",
            _ => "lane_ended",
        }
    }
}

/// One request's lane waits so far.
#[derive(Clone, Copy, Debug, Default)]
pub struct Waits {
    pub total: Duration,
}

fn clamp(d: Option<Duration>, default: Duration, lo: Duration, hi: Duration) -> Duration {
    d.unwrap_or(default).clamp(lo, hi)
}

impl SubState {
    /// Whether requests to the connection carry the slow header now.
    pub fn lane_active(&self, now: Millis) -> bool {
        self.lane.is_some_and(|l| now < l.until)
    }

    /// Whether nothing was ever recorded (the row of another connection carries none).
    pub fn is_empty(&self) -> bool {
        *self == SubState::default()
    }

    /// Takes what another process learnt later (an upgrade's predecessor, during its
    /// drain): each memory the later of the two, the lane entered last. True when
    /// anything changed.
    pub fn merge_later(&mut self, theirs: &SubState) -> bool {
        let before = *self;
        // The lane of the later decision: entered, or ended.
        let last = |s: &SubState| s.lane.map_or(0, |l| l.since).max(s.lane_ended_at);
        if last(theirs) > last(self) {
            self.lane = theirs.lane;
        }
        for (ours, t) in [
            (&mut self.cool_off_until, theirs.cool_off_until),
            (
                &mut self.budget_exhausted_until,
                theirs.budget_exhausted_until,
            ),
            (&mut self.reset_available_at, theirs.reset_available_at),
            (&mut self.reset_retry_at, theirs.reset_retry_at),
            (&mut self.reset_claimed_at, theirs.reset_claimed_at),
            (&mut self.lane_ended_at, theirs.lane_ended_at),
        ] {
            *ours = (*ours).max(t);
        }
        *self != before
    }

    /// The decision on a wall. `reset_tried`: this request already tried a reset (a
    /// request claims at most one).
    pub fn on_wall(&self, s: Settings, sig: &Signal, reset_tried: bool, now: Millis) -> OnWall {
        if !sig.wall {
            return OnWall::Normal;
        }
        if s.limit_reset
            && !reset_tried
            && now >= self.reset_available_at
            && now >= self.reset_retry_at
        {
            return OnWall::TryReset;
        }
        if s.low_priority
            && sig.offer
            && !sig.overage
            && now >= self.cool_off_until
            && now >= self.budget_exhausted_until
        {
            return OnWall::EnterLane;
        }
        OnWall::Normal
    }

    /// Enters the lane on a wall: until the announced reset + 60 s (one window + 60 s
    /// when none was announced, or it is already past).
    pub fn enter_lane(&mut self, sig: &Signal, now: Millis) {
        let reset = sig.window_reset.filter(|r| *r > now);
        let until = reset.unwrap_or(now.saturating_add(ms(WINDOW)));
        self.lane = Some(Lane {
            since: now,
            until: until.saturating_add(ms(LANE_GRACE)),
            window_reset: reset.unwrap_or(0),
        });
    }

    /// The usage check's result: whether to claim.
    pub fn on_usage(&mut self, usage: Usage, now: Millis) -> bool {
        match usage {
            Usage::Claimable => true,
            Usage::Unavailable { next } => {
                self.reset_available_at = unavailable_until(next, now);
                false
            }
        }
    }

    /// The claim's result: whether the request goes again at full speed.
    pub fn on_claim(&mut self, claim: Claim, now: Millis) -> bool {
        match claim {
            Claim::FullSpeed => {
                self.reset_claimed_at = now;
                // A claimed reset is a new window: the lane (if any) has no reason left.
                self.lane = None;
                self.lane_ended_at = now;
                true
            }
            Claim::Unavailable { next } => {
                self.reset_available_at = unavailable_until(next, now);
                false
            }
        }
    }

    /// A usage check or claim that failed (transport, status, body).
    pub fn on_reset_failure(&mut self, now: Millis) {
        self.reset_retry_at = now.saturating_add(ms(RESET_RETRY));
    }

    /// The decision on an answer to a request sent on the lane. `budget_left`: the
    /// request's remaining execution budget; `jitter` in [-1, 1] spreads the wait.
    pub fn on_lane_answer(
        &mut self,
        sig: &Signal,
        waits: &Waits,
        budget_left: Duration,
        jitter: f64,
        now: Millis,
    ) -> OnLane {
        if sig.overage {
            return self.end(LaneEnd::Overage, now);
        }
        // A new window announces a reset hours later; a few seconds' difference is
        // the same window (rounding, another edge's clock).
        let rolled = match (self.lane, sig.window_reset) {
            (Some(l), Some(r)) => {
                l.window_reset != 0 && r > l.window_reset.saturating_add(ms(ROLLOVER_SLACK))
            }
            _ => false,
        };
        match sig.slow_status {
            Some(SlowStatus::SlotBusy) => {}
            // A 529 (overloaded) waits like a busy slot unless its status ends the lane.
            None | Some(SlowStatus::Active | SlowStatus::NotNeeded) if sig.status == 529 => {}
            Some(SlowStatus::Active | SlowStatus::NotNeeded) | None if rolled => {
                return self.end(LaneEnd::Rollover, now);
            }
            Some(SlowStatus::Active | SlowStatus::NotNeeded) => return OnLane::Keep,
            None if sig.wall => return self.end(LaneEnd::Refused, now),
            None => return OnLane::Keep,
            Some(SlowStatus::BudgetExhausted) => {
                let cap = now.saturating_add(ms(BUDGET_MEMORY_MAX));
                let until = sig
                    .window_reset
                    .filter(|r| *r > now)
                    .unwrap_or(now.saturating_add(ms(WINDOW)));
                self.budget_exhausted_until = until.min(cap);
                return self.end(LaneEnd::Status(SlowStatus::BudgetExhausted), now);
            }
            Some(other) => return self.end(LaneEnd::Status(other), now),
        }
        // slot_busy, or a 529: wait and resend, within the request's caps.
        let base = clamp(sig.slow_retry_after, RETRY_DEFAULT, RETRY_MIN, RETRY_MAX);
        let spread = 1.0 + JITTER * jitter.clamp(-1.0, 1.0);
        let wait = base.mul_f64(spread);
        let max_wait = clamp(
            sig.slow_max_wait,
            MAX_WAIT_DEFAULT,
            MAX_WAIT_MIN,
            MAX_WAIT_MAX,
        );
        // The request's waits in all stay within the max-wait; the next one must leave
        // 5 s of the request's budget for the answer itself.
        if waits.total + wait > max_wait || wait > budget_left.saturating_sub(BUDGET_MARGIN) {
            self.cool_off_until = now.saturating_add(ms(COOL_OFF));
            return self.end(LaneEnd::MaxWait, now);
        }
        OnLane::Wait(wait)
    }

    fn end(&mut self, why: LaneEnd, now: Millis) -> OnLane {
        self.lane = None;
        self.lane_ended_at = now;
        OnLane::Ended(why)
    }
}

fn unavailable_until(next: Option<Millis>, now: Millis) -> Millis {
    next.filter(|n| *n > now)
        .unwrap_or(now.saturating_add(ms(RESET_UNAVAILABLE)))
}

/// Reads the usage check's body: its `juniper_tide` block. `None`: not the expected
/// shape (a failure).
pub fn parse_usage(body: &[u8]) -> Option<Usage> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let block = v.get(RESET_PROGRAM)?;
    if !block.is_object() {
        return None;
    }
    let arm = block.get("arm").and_then(|a| a.as_str());
    let available = block.get("available").and_then(|a| a.as_bool());
    if arm == Some("reset") && available == Some(true) {
        return Some(Usage::Claimable);
    }
    Some(Usage::Unavailable {
        next: block.get("next_available_at").and_then(when),
    })
}

/// Reads the claim's body. `None`: an unknown result (a failure).
pub fn parse_claim(body: &[u8]) -> Option<Claim> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    match v.get("result")?.as_str()? {
        "reset" | "not_limited" => Some(Claim::FullSpeed),
        "already_used" | "not_offered" => Some(Claim::Unavailable {
            next: v.get("next_available_at").and_then(when),
        }),
        _ => None,
    }
}

/// A JSON instant: unix seconds, or an RFC 3339 string.
fn when(v: &serde_json::Value) -> Option<Millis> {
    match v {
        serde_json::Value::Number(n) => n.as_u64().and_then(|s| s.checked_mul(1000)),
        serde_json::Value::String(s) => instant(s),
        _ => None,
    }
}

/// The claim's request body.
pub fn claim_body() -> String {
    format!(r#"{{"program":"{RESET_PROGRAM}"}}"#)
}

/// A client's `anthropic-beta` values with the OAuth one added when missing (the
/// client's own values are kept, in their order).
pub fn merged_beta(client: Option<&str>) -> String {
    match client.map(str::trim).filter(|c| !c.is_empty()) {
        None => OAUTH_BETA.to_string(),
        Some(c) if c.split(',').any(|v| v.trim() == OAUTH_BETA) => c.to_string(),
        Some(c) => format!("{c},{OAUTH_BETA}"),
    }
}

#[cfg(test)]
mod tests;
