//! Provider circuit breaker (SPEC §5.1): protects the gateway and its clients from a
//! provider that keeps failing at the provider level, and protects that provider from
//! being hammered while it recovers.
//!
//! Invariants:
//! - The counter moves +1 per provider-level failure and −1 per success and never goes
//!   below 0; only the caller decides what a provider-level failure is (transport, 408,
//!   500, 502, 503, 504). Without a recorded failure the breaker never leaves CLOSED.
//! - Recovery is lazy: `state`/`peek` derive the effective state from stored deadlines
//!   and `now`, never mutate, and an OPEN breaker reads HALF_OPEN as soon as its reset
//!   timeout since the last failure has passed, so no timer is needed to re-admit it.
//! - HALF_OPEN admits one probe at a time. The probe slot is freed by the probe's
//!   outcome, by `release_probe`, or, as a safety net for a lost probe (for instance a
//!   state persisted mid-probe and restored after a restart), once [`PROBE_LEASE`] has
//!   passed since it was taken.
//! - An OPEN breaker never admits an attempt before its `retry_at`; a late failure only
//!   pushes `retry_at` further out.
//! - Escalation: with `n` failed probe cycles in a row, the reset timeout is the base
//!   while `n < 3` and `base × 2^(n−2)` from then on (each further cycle doubles it),
//!   capped at `base × max_backoff_multiplier`. A success clears `n`.
//! - Every change of the effective state observed by a mutating call is reported once as
//!   a [`Transition`], including lazy ones (OPEN → HALF_OPEN, DEGRADED → CLOSED).

use super::{ms, Millis};
use crate::config::BreakerClass;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// How long callers that find a probe in flight are told to wait before asking again.
pub const PROBE_BUSY_RETRY_MS: Millis = 1_000;

/// After this long a probe that reported neither an outcome nor a release is presumed
/// lost and its slot is given to the next caller (10 min, the default execution timeout).
pub const PROBE_LEASE: Millis = 600_000;

/// Failed probe cycles in a row before the reset timeout starts doubling.
const ESCALATE_AFTER: u32 = 3;

/// Thresholds and timing of one provider class.
#[derive(Clone, Debug, PartialEq)]
pub struct BreakerConfig {
    pub degrade_at: u32,
    pub open_at: u32,
    pub reset: Duration,
    pub max_backoff_multiplier: u32,
}

impl BreakerConfig {
    pub fn from_class(c: &BreakerClass, max_backoff_multiplier: u32) -> Self {
        BreakerConfig {
            degrade_at: c.degrade_at,
            open_at: c.open_at,
            reset: c.reset,
            max_backoff_multiplier,
        }
    }

    fn degrade_threshold(&self) -> u32 {
        self.degrade_at.max(1)
    }

    fn open_threshold(&self) -> u32 {
        self.open_at.max(1)
    }

    fn multiplier_cap(&self) -> u32 {
        self.max_backoff_multiplier.max(1)
    }

    /// Quiet period after which a DEGRADED breaker reads CLOSED.
    fn quiet_ms(&self) -> Millis {
        ms(self.reset).saturating_mul(u64::from(self.multiplier_cap()))
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum BreakerState {
    #[default]
    Closed,
    Degraded,
    Open,
    HalfOpen,
}

impl BreakerState {
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "CLOSED",
            BreakerState::Degraded => "DEGRADED",
            BreakerState::Open => "OPEN",
            BreakerState::HalfOpen => "HALF_OPEN",
        }
    }

    /// Value of the breaker state gauge: 0 closed, 1 degraded, 2 half-open, 3 open.
    pub fn gauge(self) -> i64 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::Degraded => 1,
            BreakerState::HalfOpen => 2,
            BreakerState::Open => 3,
        }
    }

    fn tripped(self) -> bool {
        matches!(self, BreakerState::Open | BreakerState::HalfOpen)
    }
}

/// Admission decision for one attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Permit {
    Allow,
    /// The single trial attempt of a HALF_OPEN breaker; report it with `was_probe`.
    Probe,
    Deny {
        retry_at: Millis,
    },
}

/// A change of the effective state, for `breaker_transitions_total{to}` and logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transition {
    pub from: BreakerState,
    pub to: BreakerState,
}

fn transition(from: BreakerState, to: BreakerState) -> Option<Transition> {
    (from != to).then_some(Transition { from, to })
}

/// One provider's breaker: a plain value, persisted as JSON as it is.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Breaker {
    /// Effective state as last materialised by a mutating call.
    state: BreakerState,
    /// Net failure counter (+1 failure, −1 success, floor 0).
    failures: u32,
    last_failure_at: Option<Millis>,
    /// Set while a probe is in flight: when it was handed out.
    probe_started_at: Option<Millis>,
    /// Failed probe cycles in a row (drives escalation).
    failed_probe_cycles: u32,
}

impl Breaker {
    /// Lazy read of the effective state. Never mutates.
    pub fn state(&self, cfg: &BreakerConfig, now: Millis) -> BreakerState {
        match self.state {
            BreakerState::Closed => BreakerState::Closed,
            BreakerState::Degraded => {
                if self.quiet_passed(cfg, now) {
                    BreakerState::Closed
                } else {
                    BreakerState::Degraded
                }
            }
            BreakerState::Open | BreakerState::HalfOpen => {
                if self.probe_busy(now) || now >= self.reopen_at(cfg) {
                    BreakerState::HalfOpen
                } else {
                    BreakerState::Open
                }
            }
        }
    }

    /// Admission for one attempt; applies (and reports) lazy transitions and takes the
    /// probe slot when it answers `Probe`.
    pub fn permit(&mut self, cfg: &BreakerConfig, now: Millis) -> (Permit, Option<Transition>) {
        let from = self.state;
        self.materialise(cfg, now);
        let permit = self.peek(cfg, now);
        if permit == Permit::Probe {
            self.probe_started_at = Some(now);
        }
        (permit, transition(from, self.state))
    }

    /// What `permit` would answer, without taking a probe or mutating anything.
    pub fn peek(&self, cfg: &BreakerConfig, now: Millis) -> Permit {
        match self.state(cfg, now) {
            BreakerState::Closed | BreakerState::Degraded => Permit::Allow,
            BreakerState::Open => Permit::Deny {
                retry_at: self.reopen_at(cfg),
            },
            BreakerState::HalfOpen if self.probe_busy(now) => Permit::Deny {
                retry_at: now.saturating_add(PROBE_BUSY_RETRY_MS),
            },
            BreakerState::HalfOpen => Permit::Probe,
        }
    }

    /// Outcome of an attempt that got `Allow` or `Probe`. `failure` is true only for
    /// provider-level failures; `was_probe` is true when the attempt got `Probe`.
    pub fn record(
        &mut self,
        cfg: &BreakerConfig,
        failure: bool,
        was_probe: bool,
        now: Millis,
    ) -> Option<Transition> {
        let from = self.state;
        self.materialise(cfg, now);
        let tripped = self.state.tripped();
        // A probe gives its verdict only on a HALF_OPEN breaker: a lost probe reporting
        // after a later failure re-opened the breaker is an ordinary late outcome.
        let verdict = was_probe && self.state == BreakerState::HalfOpen;
        if was_probe {
            self.probe_started_at = None;
        }
        if failure {
            self.failures = self.failures.saturating_add(1);
            self.last_failure_at = Some(now);
            if tripped {
                if verdict {
                    self.failed_probe_cycles = self.failed_probe_cycles.saturating_add(1);
                }
                // A late failure while another probe runs leaves the verdict to the probe.
                self.state = if self.probe_busy(now) {
                    BreakerState::HalfOpen
                } else {
                    BreakerState::Open
                };
            } else if self.failures >= cfg.open_threshold() {
                self.state = BreakerState::Open;
            } else if self.failures >= cfg.degrade_threshold() {
                self.state = BreakerState::Degraded;
            }
        } else if tripped {
            self.failures = self.failures.saturating_sub(1);
            // Only the probe may close a tripped breaker; a late success merely counts.
            if verdict {
                self.state = BreakerState::Closed;
                self.failures = 0;
                self.failed_probe_cycles = 0;
            }
        } else {
            self.failures = self.failures.saturating_sub(1);
            self.failed_probe_cycles = 0;
            if self.state == BreakerState::Degraded && self.failures < cfg.degrade_threshold() {
                self.state = BreakerState::Closed;
            }
        }
        transition(from, self.state)
    }

    /// The probe's attempt ended without an outcome (client left): free the probe slot.
    pub fn release_probe(&mut self) {
        self.probe_started_at = None;
    }

    /// Operator reset → CLOSED, counter 0, escalation cleared.
    pub fn reset(&mut self) -> Option<Transition> {
        let from = self.state;
        *self = Breaker::default();
        transition(from, self.state)
    }

    /// The net failure counter as last materialised.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Millis at which an OPEN breaker turns HALF_OPEN (None unless OPEN).
    pub fn retry_at(&self, cfg: &BreakerConfig, now: Millis) -> Option<Millis> {
        (self.state(cfg, now) == BreakerState::Open).then(|| self.reopen_at(cfg))
    }

    /// Current reset timeout including escalation.
    pub fn current_reset(&self, cfg: &BreakerConfig) -> Duration {
        let cap = cfg.multiplier_cap();
        let factor = match self.failed_probe_cycles.checked_sub(ESCALATE_AFTER - 1) {
            Some(steps) if steps > 0 => 1u32.checked_shl(steps).unwrap_or(u32::MAX).min(cap),
            _ => 1,
        };
        cfg.reset.saturating_mul(factor)
    }

    /// Stores the effective state; a quiet DEGRADED breaker also forgets its counter.
    fn materialise(&mut self, cfg: &BreakerConfig, now: Millis) {
        let effective = self.state(cfg, now);
        if self.state == BreakerState::Degraded && effective == BreakerState::Closed {
            self.failures = 0;
        }
        if !self.probe_busy(now) {
            self.probe_started_at = None;
        }
        self.state = effective;
    }

    fn probe_busy(&self, now: Millis) -> bool {
        self.probe_started_at
            .is_some_and(|t| now < t.saturating_add(PROBE_LEASE))
    }

    fn reopen_at(&self, cfg: &BreakerConfig) -> Millis {
        self.last_failure_at
            .unwrap_or(0)
            .saturating_add(ms(self.current_reset(cfg)))
    }

    fn quiet_passed(&self, cfg: &BreakerConfig, now: Millis) -> bool {
        now >= self
            .last_failure_at
            .unwrap_or(0)
            .saturating_add(cfg.quiet_ms())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use BreakerState::*;

    const T0: Millis = 1_700_000_000_000;

    /// (class, degrade_at, open_at, reset seconds) — the SPEC §5.1 defaults.
    const CLASSES: [(&str, u32, u32, u64); 3] = [
        ("apikey", 7, 12, 30),
        ("oauth", 5, 8, 60),
        ("local", 1, 2, 15),
    ];

    fn cfg(degrade_at: u32, open_at: u32, reset_s: u64, mult: u32) -> BreakerConfig {
        BreakerConfig::from_class(
            &BreakerClass {
                degrade_at,
                open_at,
                reset: Duration::from_secs(reset_s),
            },
            mult,
        )
    }

    fn tr(from: BreakerState, to: BreakerState) -> Option<Transition> {
        Some(Transition { from, to })
    }

    /// Records `n` failures one second apart from `t`; returns the time of the last one.
    fn fail_n(b: &mut Breaker, c: &BreakerConfig, n: u32, t: Millis) -> Millis {
        let mut at = t;
        for i in 0..n {
            at = t + u64::from(i) * 1_000;
            b.record(c, true, false, at);
        }
        at
    }

    /// Opens the breaker; returns the time of the last failure.
    fn opened(c: &BreakerConfig) -> (Breaker, Millis) {
        let mut b = Breaker::default();
        let last = fail_n(&mut b, c, c.open_at, T0);
        assert_eq!(b.state(c, last), Open);
        (b, last)
    }

    #[test]
    fn names_and_gauge() {
        let all = [(Closed, "CLOSED", 0), (Degraded, "DEGRADED", 1)];
        let more = [(HalfOpen, "HALF_OPEN", 2), (Open, "OPEN", 3)];
        for (s, name, g) in all.into_iter().chain(more) {
            assert_eq!(s.as_str(), name);
            assert_eq!(s.gauge(), g);
            let json = serde_json::to_string(&s).unwrap();
            assert_eq!(json, format!("\"{name}\""));
            assert_eq!(serde_json::from_str::<BreakerState>(&json).unwrap(), s);
        }
    }

    #[test]
    fn counter_thresholds_per_class() {
        for (class, degrade, open, reset) in CLASSES {
            let c = cfg(degrade, open, reset, 16);
            let mut b = Breaker::default();
            for i in 1..=open {
                let now = T0 + u64::from(i) * 1_000;
                let t = b.record(&c, true, false, now);
                let expected = if i >= open {
                    Open
                } else if i >= degrade {
                    Degraded
                } else {
                    Closed
                };
                assert_eq!(b.state(&c, now), expected, "{class} after {i} failures");
                assert_eq!(b.failures(), i, "{class}");
                let want = match i {
                    i if i == open && open == degrade => tr(Closed, Open),
                    i if i == open => tr(Degraded, Open),
                    i if i == degrade => tr(Closed, Degraded),
                    _ => None,
                };
                assert_eq!(t, want, "{class} transition after {i} failures");
                if expected != Open {
                    assert_eq!(b.permit(&c, now), (Permit::Allow, None), "{class}");
                }
            }
        }
    }

    #[test]
    fn open_denies_until_reset_then_half_open_admits_one_probe() {
        for (class, degrade, open, reset) in CLASSES {
            let c = cfg(degrade, open, reset, 16);
            let (mut b, last) = opened(&c);
            let half_at = last + reset * 1_000;
            assert_eq!(b.retry_at(&c, last), Some(half_at), "{class}");
            for now in [last, last + 1, half_at - 1] {
                let want = Permit::Deny { retry_at: half_at };
                assert_eq!(b.permit(&c, now), (want, None), "{class} at {now}");
                assert_eq!(b.state(&c, now), Open);
            }
            // Lazy: reads HALF_OPEN without any call in between.
            assert_eq!(b.state(&c, half_at), HalfOpen, "{class}");
            assert_eq!(b.retry_at(&c, half_at), None);
            assert_eq!(b.peek(&c, half_at), Permit::Probe);
            assert_eq!(b.peek(&c, half_at), Permit::Probe, "peek takes nothing");
            assert_eq!(
                b.permit(&c, half_at),
                (Permit::Probe, tr(Open, HalfOpen)),
                "{class}"
            );
            let busy = Permit::Deny {
                retry_at: half_at + 1 + PROBE_BUSY_RETRY_MS,
            };
            assert_eq!(b.permit(&c, half_at + 1), (busy, None), "{class}");
            assert_eq!(b.peek(&c, half_at + 1), busy);
            // Probe success closes with the counter at 0.
            let t = b.record(&c, false, true, half_at + 500);
            assert_eq!(t, tr(HalfOpen, Closed), "{class}");
            assert_eq!(b.failures(), 0);
            assert_eq!(b.state(&c, half_at + 500), Closed);
            assert_eq!(b.permit(&c, half_at + 501), (Permit::Allow, None));
        }
    }

    #[test]
    fn failed_probe_reopens() {
        for (class, degrade, open, reset) in CLASSES {
            let c = cfg(degrade, open, reset, 16);
            let (mut b, last) = opened(&c);
            let half_at = last + reset * 1_000;
            assert_eq!(b.permit(&c, half_at).0, Permit::Probe);
            let fail_at = half_at + 2_000;
            assert_eq!(b.record(&c, true, true, fail_at), tr(HalfOpen, Open));
            assert_eq!(b.state(&c, fail_at), Open, "{class}");
            assert_eq!(b.retry_at(&c, fail_at), Some(fail_at + reset * 1_000));
            assert_eq!(b.current_reset(&c), Duration::from_secs(reset), "{class}");
            let (p, t) = b.permit(&c, fail_at + reset * 1_000);
            assert_eq!((p, t), (Permit::Probe, tr(Open, HalfOpen)), "{class}");
        }
    }

    #[test]
    fn escalation_after_three_failed_probe_cycles_and_cap() {
        // (max_backoff_multiplier, reset factor after each failed probe cycle 1..=8)
        let table: [(u32, [u32; 8]); 3] = [
            (16, [1, 1, 2, 4, 8, 16, 16, 16]),
            (4, [1, 1, 2, 4, 4, 4, 4, 4]),
            (1, [1, 1, 1, 1, 1, 1, 1, 1]),
        ];
        for (class, degrade, open, reset) in CLASSES {
            for (mult, factors) in table {
                let c = cfg(degrade, open, reset, mult);
                let (mut b, last) = opened(&c);
                let mut half_at = last + reset * 1_000;
                for (cycle, factor) in factors.into_iter().enumerate() {
                    assert_eq!(
                        b.permit(&c, half_at - 1).0,
                        Permit::Deny { retry_at: half_at }
                    );
                    assert_eq!(b.permit(&c, half_at).0, Permit::Probe);
                    let fail_at = half_at + 100;
                    b.record(&c, true, true, fail_at);
                    let want = Duration::from_secs(reset) * factor;
                    assert_eq!(
                        b.current_reset(&c),
                        want,
                        "{class} ×{mult} after {} failed cycles",
                        cycle + 1
                    );
                    half_at = fail_at + ms(want);
                    assert_eq!(b.retry_at(&c, fail_at), Some(half_at));
                }
                // A successful probe clears the escalation.
                assert_eq!(b.permit(&c, half_at).0, Permit::Probe);
                assert_eq!(b.record(&c, false, true, half_at), tr(HalfOpen, Closed));
                assert_eq!(b.current_reset(&c), Duration::from_secs(reset));
            }
        }
    }

    #[test]
    fn three_failed_cycles_then_success_then_failures_start_from_base() {
        let c = cfg(7, 12, 30, 16);
        let (mut b, last) = opened(&c);
        let mut half_at = last + 30_000;
        for _ in 0..5 {
            assert_eq!(b.permit(&c, half_at).0, Permit::Probe);
            b.record(&c, true, true, half_at);
            half_at += ms(b.current_reset(&c));
        }
        assert_eq!(b.current_reset(&c), Duration::from_secs(240));
        assert_eq!(b.permit(&c, half_at).0, Permit::Probe);
        b.record(&c, false, true, half_at);
        let again = fail_n(&mut b, &c, 12, half_at + 1_000);
        assert_eq!(b.retry_at(&c, again), Some(again + 30_000));
    }

    #[test]
    fn degraded_recovers_when_successes_bring_counter_below_degrade_at() {
        for (class, degrade, open, reset) in CLASSES {
            let c = cfg(degrade, open, reset, 16);
            let mut b = Breaker::default();
            let last = fail_n(&mut b, &c, degrade, T0);
            assert_eq!(b.state(&c, last), Degraded, "{class}");
            // One success: counter degrade − 1 < degrade_at → CLOSED.
            assert_eq!(b.record(&c, false, false, last + 1), tr(Degraded, Closed));
            assert_eq!(b.failures(), degrade - 1);
            assert_eq!(b.state(&c, last + 1), Closed, "{class}");
        }
    }

    #[test]
    fn degraded_stays_while_counter_is_at_or_above_degrade_at() {
        let c = cfg(5, 8, 60, 16);
        let mut b = Breaker::default();
        let last = fail_n(&mut b, &c, 7, T0);
        assert_eq!(b.record(&c, false, false, last + 1), None);
        assert_eq!(b.record(&c, false, false, last + 2), None);
        assert_eq!(b.failures(), 5);
        assert_eq!(b.state(&c, last + 2), Degraded);
        assert_eq!(b.record(&c, false, false, last + 3), tr(Degraded, Closed));
    }

    #[test]
    fn degraded_recovers_after_quiet_period() {
        for (class, degrade, open, reset) in CLASSES {
            for mult in [16, 2] {
                let c = cfg(degrade, open, reset, mult);
                let mut b = Breaker::default();
                let last = fail_n(&mut b, &c, degrade, T0);
                let quiet_end = last + reset * 1_000 * u64::from(mult);
                assert_eq!(b.state(&c, quiet_end - 1), Degraded, "{class}");
                assert_eq!(b.permit(&c, quiet_end - 1), (Permit::Allow, None));
                assert_eq!(b.state(&c, quiet_end), Closed, "{class} ×{mult}");
                assert_eq!(
                    b.permit(&c, quiet_end),
                    (Permit::Allow, tr(Degraded, Closed))
                );
                assert_eq!(b.failures(), 0, "quiet period forgets the counter");
                // A single new failure after that does not re-degrade (unless degrade_at 1).
                let t = b.record(&c, true, false, quiet_end + 1);
                let want = (degrade == 1).then_some(Transition {
                    from: Closed,
                    to: Degraded,
                });
                assert_eq!(t, want, "{class}");
            }
        }
    }

    #[test]
    fn lazy_quiet_transition_reported_by_record() {
        let c = cfg(7, 12, 30, 16);
        let mut b = Breaker::default();
        let last = fail_n(&mut b, &c, 8, T0);
        let quiet_end = last + 30_000 * 16;
        assert_eq!(b.record(&c, false, false, quiet_end), tr(Degraded, Closed));
        assert_eq!(b.failures(), 0);
    }

    #[test]
    fn failure_resets_quiet_period() {
        let c = cfg(7, 12, 30, 16);
        let mut b = Breaker::default();
        let last = fail_n(&mut b, &c, 7, T0);
        let later = last + 400_000;
        b.record(&c, true, false, later);
        assert_eq!(b.state(&c, last + 480_000), Degraded);
        assert_eq!(b.state(&c, later + 480_000), Closed);
    }

    #[test]
    fn occasional_errors_heal_and_net_failing_provider_opens() {
        let c = cfg(7, 12, 30, 16);
        let mut b = Breaker::default();
        let mut now = T0;
        for _ in 0..100 {
            b.record(&c, true, false, now);
            b.record(&c, false, false, now + 1);
            now += 10;
        }
        assert_eq!(b.state(&c, now), Closed);
        assert_eq!(b.failures(), 0);
        // Two failures per success: net +1 per round, so the breaker opens.
        let mut rounds = 0;
        while b.state(&c, now) != Open {
            b.record(&c, true, false, now);
            b.record(&c, true, false, now + 1);
            b.record(&c, false, false, now + 2);
            now += 10;
            rounds += 1;
            assert!(rounds < 100);
        }
        assert_eq!(rounds, 11);
    }

    #[test]
    fn success_never_drives_counter_below_zero() {
        let c = cfg(1, 2, 15, 16);
        let mut b = Breaker::default();
        for i in 0..5 {
            assert_eq!(b.record(&c, false, false, T0 + i), None);
            assert_eq!(b.failures(), 0);
        }
        assert_eq!(b.record(&c, true, false, T0 + 10), tr(Closed, Degraded));
    }

    #[test]
    fn late_failure_while_open_extends_and_late_success_does_not_close() {
        let c = cfg(5, 8, 60, 16);
        let (mut b, last) = opened(&c);
        assert_eq!(b.record(&c, false, false, last + 10_000), None);
        assert_eq!(b.state(&c, last + 10_000), Open);
        assert_eq!(b.record(&c, true, false, last + 20_000), None);
        assert_eq!(b.retry_at(&c, last + 20_000), Some(last + 80_000));
        assert_eq!(b.state(&c, last + 60_000), Open);
        // A late failure on a lazily HALF_OPEN breaker opens it again.
        assert_eq!(b.state(&c, last + 80_000), HalfOpen);
        assert_eq!(b.record(&c, true, false, last + 80_000), None);
        assert_eq!(b.state(&c, last + 80_000), Open);
        assert_eq!(
            b.permit(&c, last + 140_000),
            (Permit::Probe, tr(Open, HalfOpen))
        );
    }

    #[test]
    fn late_outcomes_while_probe_in_flight_leave_verdict_to_probe() {
        let c = cfg(5, 8, 60, 16);
        let (mut b, last) = opened(&c);
        let half_at = last + 60_000;
        assert_eq!(b.permit(&c, half_at).0, Permit::Probe);
        assert_eq!(b.record(&c, true, false, half_at + 1), None);
        assert_eq!(b.record(&c, false, false, half_at + 2), None);
        assert_eq!(b.state(&c, half_at + 3), HalfOpen);
        assert!(matches!(b.permit(&c, half_at + 3).0, Permit::Deny { .. }));
        assert_eq!(b.record(&c, false, true, half_at + 4), tr(HalfOpen, Closed));
    }

    #[test]
    fn release_probe_frees_the_slot() {
        let c = cfg(7, 12, 30, 16);
        let (mut b, last) = opened(&c);
        let half_at = last + 30_000;
        assert_eq!(b.permit(&c, half_at).0, Permit::Probe);
        assert!(matches!(b.permit(&c, half_at + 1).0, Permit::Deny { .. }));
        b.release_probe();
        assert_eq!(b.state(&c, half_at + 2), HalfOpen);
        assert_eq!(b.permit(&c, half_at + 2), (Permit::Probe, None));
    }

    #[test]
    fn lost_probe_slot_expires_after_lease() {
        let c = cfg(7, 12, 30, 16);
        let (mut b, last) = opened(&c);
        let half_at = last + 30_000;
        assert_eq!(b.permit(&c, half_at).0, Permit::Probe);
        // Persisted mid-probe and restored after a restart.
        let json = serde_json::to_string(&b).unwrap();
        let mut restored: Breaker = serde_json::from_str(&json).unwrap();
        let end = half_at + PROBE_LEASE;
        assert!(matches!(
            restored.permit(&c, end - 1).0,
            Permit::Deny { .. }
        ));
        assert_eq!(restored.permit(&c, end), (Permit::Probe, None));
    }

    #[test]
    fn lost_probe_reporting_after_reopen_is_an_ordinary_outcome() {
        let c = cfg(1, 2, 15, 16);
        let (mut b, last) = opened(&c);
        let half_at = last + 15_000;
        assert_eq!(b.permit(&c, half_at).0, Permit::Probe);
        let late = half_at + PROBE_LEASE;
        assert_eq!(b.record(&c, true, false, late), tr(HalfOpen, Open));
        assert_eq!(b.record(&c, false, true, late + 1), None);
        assert_eq!(b.state(&c, late + 1), Open);
        assert_eq!(b.retry_at(&c, late + 1), Some(late + 15_000));
    }

    #[test]
    fn operator_reset() {
        let c = cfg(5, 8, 60, 16);
        let (mut b, last) = opened(&c);
        let mut half_at = last + 60_000;
        for _ in 0..6 {
            b.permit(&c, half_at);
            b.record(&c, true, true, half_at);
            half_at += ms(b.current_reset(&c));
        }
        assert!(b.current_reset(&c) > c.reset);
        assert_eq!(b.reset(), tr(Open, Closed));
        assert_eq!(b.failures(), 0);
        assert_eq!(b.current_reset(&c), c.reset);
        assert_eq!(b.state(&c, half_at), Closed);
        assert_eq!(b.reset(), None);
        // A probe outcome arriving after the reset is an ordinary outcome.
        assert_eq!(b.record(&c, true, true, half_at), None);
        assert_eq!(b.failures(), 1);
    }

    #[test]
    fn stale_probe_outcome_after_reset_does_not_close_without_trip() {
        let c = cfg(1, 2, 15, 16);
        let mut b = Breaker::default();
        b.record(&c, true, false, T0);
        assert_eq!(b.record(&c, false, true, T0 + 1), tr(Degraded, Closed));
    }

    #[test]
    fn degenerate_config_is_safe() {
        let c = cfg(0, 0, 0, 0);
        let mut b = Breaker::default();
        assert_eq!(b.permit(&c, T0), (Permit::Allow, None));
        assert_eq!(b.record(&c, true, false, T0), tr(Closed, Open));
        assert_eq!(b.permit(&c, T0), (Permit::Probe, tr(Open, HalfOpen)));
        assert_eq!(b.current_reset(&c), Duration::ZERO);
    }

    #[test]
    fn restores_from_partial_json() {
        let b: Breaker = serde_json::from_str("{}").unwrap();
        assert_eq!(b, Breaker::default());
        let b: Breaker = serde_json::from_str(r#"{"state":"OPEN","failures":3}"#).unwrap();
        assert_eq!(b.failures(), 3);
    }

    // ---- properties -------------------------------------------------------------

    #[derive(Clone, Debug)]
    enum Op {
        Permit,
        Outcome { failure: bool, probe: bool },
        Release,
        Advance(u64),
        Reset,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => Just(Op::Permit),
            4 => (any::<bool>(), any::<bool>())
                .prop_map(|(failure, probe)| Op::Outcome { failure, probe }),
            1 => Just(Op::Release),
            3 => prop_oneof![0u64..2_000, 0u64..120_000, 0u64..2_000_000].prop_map(Op::Advance),
            1 => Just(Op::Reset),
        ]
    }

    fn class_cfg() -> impl Strategy<Value = BreakerConfig> {
        (0usize..3, 1u32..=32).prop_map(|(i, mult)| {
            let (_, d, o, r) = CLASSES[i];
            cfg(d, o, r, mult)
        })
    }

    /// What the driver observed from one step (for comparing two breakers).
    #[derive(Debug, PartialEq)]
    enum Seen {
        Permit(Permit, Option<Transition>),
        Record(Option<Transition>),
        Other(Option<Transition>),
    }

    /// Drives a breaker like the engine does; checks invariants on the way.
    struct Driver {
        now: Millis,
        /// When the probe that currently holds the slot was handed out.
        probe: Option<Millis>,
        /// An OPEN breaker's announced retry_at (cleared by an operator reset).
        open_until: Option<Millis>,
        failures_seen: u32,
    }

    impl Driver {
        fn new() -> Self {
            Driver {
                now: T0,
                probe: None,
                open_until: None,
                failures_seen: 0,
            }
        }

        fn step(&mut self, b: &mut Breaker, c: &BreakerConfig, op: &Op) -> Seen {
            let now = self.now;
            let seen = match *op {
                Op::Permit => {
                    let peek = b.peek(c, now);
                    let (p, t) = b.permit(c, now);
                    assert_eq!(p, peek, "peek agrees with permit");
                    if p == Permit::Probe {
                        if let Some(at) = self.probe {
                            assert!(now >= at + PROBE_LEASE, "second probe while one in flight");
                        }
                        self.probe = Some(now);
                    }
                    if let Some(until) = self.open_until {
                        if now < until {
                            assert!(matches!(p, Permit::Deny { .. }), "OPEN admitted early");
                        }
                    }
                    if let Permit::Deny { retry_at } = p {
                        assert!(retry_at > now);
                    }
                    Seen::Permit(p, t)
                }
                Op::Outcome { failure, probe } => {
                    let was_probe = probe && self.probe.is_some();
                    if was_probe {
                        self.probe = None;
                    }
                    if failure {
                        self.failures_seen += 1;
                    }
                    Seen::Record(b.record(c, failure, was_probe, now))
                }
                Op::Release => {
                    if self.probe.take().is_some() {
                        b.release_probe();
                    }
                    Seen::Other(None)
                }
                Op::Advance(d) => {
                    self.now += d;
                    Seen::Other(None)
                }
                Op::Reset => {
                    self.probe = None;
                    self.open_until = None;
                    Seen::Other(b.reset())
                }
            };
            let now = self.now;
            if let Some(at) = b.retry_at(c, now) {
                assert_eq!(b.state(c, now), Open);
                assert!(at > now);
                if let Some(prev) = self.open_until {
                    assert!(at >= prev, "retry_at moved earlier");
                }
                self.open_until = Some(at);
            }
            assert!(
                b.failures() <= self.failures_seen,
                "counter exceeds failures"
            );
            if self.failures_seen == 0 {
                assert_eq!(b.state(c, now), Closed);
                assert_ne!(b.peek(c, now), Permit::Probe);
            }
            assert!(b.current_reset(c) <= c.reset * c.max_backoff_multiplier.max(1));
            assert!(b.current_reset(c) >= c.reset);
            seen
        }
    }

    proptest! {
        #[test]
        fn invariants_hold(c in class_cfg(), ops in prop::collection::vec(op(), 0..300)) {
            let mut b = Breaker::default();
            let mut d = Driver::new();
            for op in &ops {
                d.step(&mut b, &c, op);
            }
        }

        #[test]
        fn never_open_without_failures(
            c in class_cfg(),
            ops in prop::collection::vec(op(), 0..300),
        ) {
            let mut b = Breaker::default();
            let mut d = Driver::new();
            for op in &ops {
                let op = match op {
                    Op::Outcome { probe, .. } => Op::Outcome { failure: false, probe: *probe },
                    other => other.clone(),
                };
                d.step(&mut b, &c, &op);
                prop_assert_eq!(b.state(&c, d.now), Closed);
                prop_assert_eq!(b.failures(), 0);
            }
        }

        #[test]
        fn serde_round_trip_preserves_behaviour(
            c in class_cfg(),
            before in prop::collection::vec(op(), 0..200),
            after in prop::collection::vec(op(), 0..200),
        ) {
            let mut b = Breaker::default();
            let mut d = Driver::new();
            for op in &before {
                d.step(&mut b, &c, op);
            }
            let json = serde_json::to_string(&b).unwrap();
            let mut restored: Breaker = serde_json::from_str(&json).unwrap();
            prop_assert_eq!(&restored, &b);
            let mut d2 = Driver { now: d.now, probe: d.probe, open_until: d.open_until,
                failures_seen: d.failures_seen };
            for op in &after {
                let x = d.step(&mut b, &c, op);
                let y = d2.step(&mut restored, &c, op);
                prop_assert_eq!(x, y);
                prop_assert_eq!(&restored, &b);
                prop_assert_eq!(restored.state(&c, d.now), b.state(&c, d.now));
            }
        }
    }
}
