//! Connection cooldown (SPEC §5.3): keeps traffic off one exhausted or failing
//! credential while its siblings keep serving.
//!
//! Invariants: a cooldown is never shorter than the upstream's own hint (up to
//! `max_hint`); the scaled backoff is always capped by `max_cooldown`; failures of
//! attempts that started before the current cooldown was set neither extend it nor raise
//! `backoff_level` (so a burst of concurrent failures counts once); a terminal state
//! (`banned`, `expired`, `credits_exhausted`) is never overwritten by a cooldown, a later
//! failure or a success — only `clear(include_terminal = true)` removes it. Recovery is
//! lazy: `eligibility(now)` compares the stored deadline with `now`. This module does not
//! decide *whether* a failure belongs to the connection (classification does) and does
//! not fan a shared-bucket cooldown out to siblings (the engine does, via
//! `apply_shared`).

use super::{ms, Millis, Reason, TerminalState};
use crate::config::ProviderClass;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Longest `last_error` kept, in characters: enough to diagnose, bounded in the store.
pub const MAX_ERROR_CHARS: usize = 200;

/// Consecutive 401s after which a connection is `expired`.
pub const AUTH_FAILURES_TO_EXPIRE: u32 = 3;

/// Fixed cooldown for a concurrency-limit 429 without an upstream hint.
pub const CONCURRENCY_COOLDOWN: Duration = Duration::from_secs(1);

/// Base of the scaled backoff per provider class: apikey 3 s, oauth 5 s, local 1 s.
pub fn base_for(class: ProviderClass) -> Duration {
    match class {
        ProviderClass::ApiKey => Duration::from_secs(3),
        ProviderClass::OAuth => Duration::from_secs(5),
        ProviderClass::Local => Duration::from_secs(1),
    }
}

/// The effective cooldown settings of one connection.
#[derive(Clone, Debug, PartialEq)]
pub struct CooldownConfig {
    /// Base of the scaled backoff (see [`base_for`]).
    pub base: Duration,
    /// Cap of the scaled backoff (default 5 min).
    pub max_cooldown: Duration,
    /// Cap of upstream hints (default 24 h).
    pub max_hint: Duration,
    pub connection_retry_delay: Option<Duration>,
    pub provider_retry_delay: Option<Duration>,
    /// `SLUICE_RATE_LIMIT_RESET_SECONDS`, parsed by the caller.
    pub env_reset: Option<Duration>,
    pub disable_cooling: bool,
}

impl CooldownConfig {
    /// SPEC defaults for a provider class: no retry delays, 5 min cap, 24 h hint cap.
    pub fn defaults(class: ProviderClass) -> Self {
        Self {
            base: base_for(class),
            max_cooldown: Duration::from_secs(5 * 60),
            max_hint: Duration::from_secs(24 * 3600),
            connection_retry_delay: None,
            provider_retry_delay: None,
            env_reset: None,
            disable_cooling: false,
        }
    }

    /// Scaled backoff for a level: `base × 2^level`, capped at `max_cooldown`.
    pub fn scaled(&self, level: u32) -> Duration {
        let factor = 1u64.checked_shl(level.min(63)).unwrap_or(u64::MAX);
        let scaled = ms(self.base).saturating_mul(factor);
        Duration::from_millis(scaled.min(ms(self.max_cooldown)))
    }
}

/// The cooldown state of one connection, persisted as it is.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ConnState {
    /// End of the current cooldown; 0 = not cooling. Read through `eligibility`.
    pub cooled_until: Millis,
    /// When the current cooldown was set (anti-thundering-herd reference).
    pub cooldown_set_at: Millis,
    pub backoff_level: u32,
    /// Short message of the last failure (at most [`MAX_ERROR_CHARS`] characters).
    pub last_error: Option<String>,
    pub last_error_reason: Option<Reason>,
    pub last_status: Option<u16>,
    pub terminal: Option<TerminalState>,
    /// Consecutive 401 / expired-token failures.
    pub auth_failures: u32,
}

/// May this connection take an attempt now?
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Eligibility {
    Eligible,
    Cooling { until: Millis },
    Terminal(TerminalState),
}

/// Everything known about one failed attempt on this connection.
#[derive(Clone, Copy, Debug)]
pub struct Failure<'a> {
    /// When the failed attempt was dispatched (anti-thundering-herd).
    pub attempt_started: Millis,
    pub reason: Reason,
    pub status: Option<u16>,
    /// Upstream hint from `retry_hint::parse_hint` (capped here at `max_hint`).
    pub hint: Option<Duration>,
    /// `Classification::cooldown` from an operator rule.
    pub rule_cooldown: Option<Duration>,
    /// `Classification::terminal`.
    pub terminal: Option<TerminalState>,
    pub message: &'a str,
}

/// What one recorded failure changed (for metrics, logs and shared buckets).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Effect {
    /// The new or extended end of the cooldown, if it changed.
    pub cooled_until: Option<Millis>,
    pub raised_level: bool,
    pub became_terminal: Option<TerminalState>,
    /// The attempt started before the active cooldown was set: nothing but the error
    /// fields was touched.
    pub ignored_as_stale: bool,
}

/// Result of an operator clear.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cleared {
    Cleared,
    Unchanged,
    SkippedTerminal,
}

impl ConnState {
    /// When the running cooldown ends, if the connection is cooling (not terminal) now.
    pub fn cooling_until(&self, now: Millis) -> Option<Millis> {
        match self.eligibility(now) {
            Eligibility::Cooling { until } => Some(until),
            _ => None,
        }
    }

    /// Lazy eligibility: a terminal state wins, then an unexpired cooldown.
    pub fn eligibility(&self, now: Millis) -> Eligibility {
        if let Some(t) = self.terminal {
            Eligibility::Terminal(t)
        } else if self.cooled_until > now {
            Eligibility::Cooling {
                until: self.cooled_until,
            }
        } else {
            Eligibility::Eligible
        }
    }

    /// Whole milliseconds left of the cooldown (0 when not cooling).
    pub fn remaining_ms(&self, now: Millis) -> u64 {
        self.cooled_until.saturating_sub(now)
    }

    /// Records one failed attempt and cools the connection per SPEC §5.3.
    pub fn record_failure(&mut self, f: &Failure, cfg: &CooldownConfig, now: Millis) -> Effect {
        self.note_error(f.message, f.reason, f.status);
        let mut effect = Effect::default();
        if self.terminal.is_some() {
            return effect;
        }
        // A ban or exhausted credits is a fact about the account, whenever the attempt
        // started, so it applies even to a stale failure.
        if let Some(t) = f.terminal {
            return self.become_terminal(t);
        }
        if self.cooled_until > now && f.attempt_started < self.cooldown_set_at {
            effect.ignored_as_stale = true;
            return effect;
        }
        if f.reason == Reason::AuthError && f.status == Some(401) {
            self.auth_failures = self.auth_failures.saturating_add(1);
            if self.auth_failures >= AUTH_FAILURES_TO_EXPIRE {
                return self.become_terminal(TerminalState::Expired);
            }
        }
        if cfg.disable_cooling {
            return effect;
        }
        let hint = f.hint.map(|h| h.min(cfg.max_hint));
        let (length, level) = if f.reason == Reason::ConcurrencyLimited {
            let fixed = hint.or(f.rule_cooldown).unwrap_or(CONCURRENCY_COOLDOWN);
            (fixed, self.backoff_level)
        } else if let Some(explicit) = hint
            .or(f.rule_cooldown)
            .or(cfg.connection_retry_delay)
            .or(cfg.provider_retry_delay)
            .or(cfg.env_reset)
        {
            (explicit, 0)
        } else {
            (
                cfg.scaled(self.backoff_level),
                self.backoff_level.saturating_add(1),
            )
        };
        effect.raised_level = level > self.backoff_level;
        self.backoff_level = level;
        effect.cooled_until = self.extend(now.saturating_add(ms(length)), now);
        effect
    }

    /// Records a stalled stream. It cools the connection (as a plain failure, without
    /// hint or rule) only when `cool` (`resilience.stream_stall_cooldown`).
    pub fn record_stall(
        &mut self,
        message: &str,
        cool: bool,
        cfg: &CooldownConfig,
        now: Millis,
    ) -> Effect {
        if !cool {
            self.note_error(message, Reason::Timeout, None);
            return Effect::default();
        }
        let failure = Failure {
            attempt_started: now,
            reason: Reason::Timeout,
            status: None,
            hint: None,
            rule_cooldown: None,
            terminal: None,
            message,
        };
        self.record_failure(&failure, cfg, now)
    }

    /// A successful attempt: clears the error fields, `backoff_level` and
    /// `auth_failures`. It leaves a terminal state alone, and it leaves a running
    /// cooldown to expire: a success of an attempt that was already in flight does not
    /// prove the upstream's rate-limit window has reset.
    pub fn record_success(&mut self) {
        self.last_error = None;
        self.last_error_reason = None;
        self.last_status = None;
        self.backoff_level = 0;
        self.auth_failures = 0;
    }

    /// Cooldown imposed by a sibling in the same shared quota bucket: extends the
    /// cooldown to `until` unless the connection is terminal or already cooling at
    /// least as long. Never touches `backoff_level`. Returns whether anything changed.
    /// The caller skips connections with `disable_cooling`.
    pub fn apply_shared(&mut self, until: Millis, reason: Reason, now: Millis) -> bool {
        if self.terminal.is_some() || until <= now || until <= self.cooled_until {
            return false;
        }
        self.cooled_until = until;
        self.cooldown_set_at = now;
        self.last_error = Some("cooled by a shared quota bucket".to_owned());
        self.last_error_reason = Some(reason);
        true
    }

    /// Operator reset. A terminal state is only removed with `include_terminal`;
    /// otherwise such a connection is left entirely as it is.
    pub fn clear(&mut self, include_terminal: bool) -> Cleared {
        if self.terminal.is_some() && !include_terminal {
            return Cleared::SkippedTerminal;
        }
        if *self == Self::default() {
            return Cleared::Unchanged;
        }
        *self = Self::default();
        Cleared::Cleared
    }

    fn note_error(&mut self, message: &str, reason: Reason, status: Option<u16>) {
        self.last_error = Some(truncate(message));
        self.last_error_reason = Some(reason);
        self.last_status = status;
    }

    fn become_terminal(&mut self, t: TerminalState) -> Effect {
        self.terminal = Some(t);
        Effect {
            became_terminal: Some(t),
            ..Effect::default()
        }
    }

    /// Moves the cooldown end to `until` unless it is already later (never shortens).
    fn extend(&mut self, until: Millis, now: Millis) -> Option<Millis> {
        if until <= now || until <= self.cooled_until {
            return None;
        }
        self.cooled_until = until;
        self.cooldown_set_at = now;
        Some(until)
    }
}

fn truncate(message: &str) -> String {
    match message.char_indices().nth(MAX_ERROR_CHARS) {
        Some((cut, _)) => message[..cut].to_owned(),
        None => message.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T0: Millis = 1_700_000_000_000;

    fn cfg() -> CooldownConfig {
        CooldownConfig::defaults(ProviderClass::ApiKey)
    }

    fn fail(at: Millis, reason: Reason, status: u16) -> Failure<'static> {
        Failure {
            attempt_started: at,
            reason,
            status: Some(status),
            hint: None,
            rule_cooldown: None,
            terminal: None,
            message: "boom",
        }
    }

    fn rate_limited(at: Millis) -> Failure<'static> {
        fail(at, Reason::RateLimitExceeded, 429)
    }

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn base_per_class() {
        assert_eq!(base_for(ProviderClass::ApiKey), secs(3));
        assert_eq!(base_for(ProviderClass::OAuth), secs(5));
        assert_eq!(base_for(ProviderClass::Local), secs(1));
    }

    #[test]
    fn source_precedence() {
        struct Case {
            hint: Option<u64>,
            rule: Option<u64>,
            conn: Option<u64>,
            prov: Option<u64>,
            env: Option<u64>,
            want_secs: u64,
        }
        let full = |hint, rule, conn, prov, env, want_secs| Case {
            hint,
            rule,
            conn,
            prov,
            env,
            want_secs,
        };
        let cases = [
            full(Some(40), Some(50), Some(60), Some(70), Some(80), 40),
            full(None, Some(50), Some(60), Some(70), Some(80), 50),
            full(None, None, Some(60), Some(70), Some(80), 60),
            full(None, None, None, Some(70), Some(80), 70),
            full(None, None, None, None, Some(80), 80),
            // Scaled backoff at level 2: 3 s × 4.
            full(None, None, None, None, None, 12),
            // A hint is capped at max_hint (24 h).
            full(Some(90_000), Some(50), None, None, None, 86_400),
        ];
        for (i, c) in cases.iter().enumerate() {
            let mut cfg = cfg();
            cfg.connection_retry_delay = c.conn.map(secs);
            cfg.provider_retry_delay = c.prov.map(secs);
            cfg.env_reset = c.env.map(secs);
            let mut s = ConnState {
                backoff_level: 2,
                ..ConnState::default()
            };
            let mut f = rate_limited(T0);
            f.hint = c.hint.map(secs);
            f.rule_cooldown = c.rule.map(secs);
            let e = s.record_failure(&f, &cfg, T0);
            assert_eq!(e.cooled_until, Some(T0 + c.want_secs * 1000), "case {i}");
            assert_eq!(
                s.eligibility(T0 + c.want_secs * 1000 - 1),
                Eligibility::Cooling {
                    until: T0 + c.want_secs * 1000
                }
            );
            assert_eq!(
                s.eligibility(T0 + c.want_secs * 1000),
                Eligibility::Eligible
            );
            let scaled = c.want_secs == 12;
            assert_eq!(s.backoff_level, if scaled { 3 } else { 0 }, "case {i}");
            assert_eq!(e.raised_level, scaled, "case {i}");
        }
    }

    #[test]
    fn backoff_doubles_then_caps() {
        let cfg = cfg();
        let mut s = ConnState::default();
        let mut now = T0;
        let want = [3, 6, 12, 24, 48, 96, 192, 300, 300, 300];
        for (level, secs) in want.iter().enumerate() {
            let e = s.record_failure(&rate_limited(now), &cfg, now);
            assert_eq!(e.cooled_until, Some(now + secs * 1000), "level {level}");
            assert_eq!(s.backoff_level, level as u32 + 1);
            assert_eq!(s.remaining_ms(now), secs * 1000);
            now += secs * 1000;
        }
    }

    #[test]
    fn explicit_delay_resets_level() {
        let cfg = cfg();
        let mut s = ConnState::default();
        let mut now = T0;
        for _ in 0..4 {
            s.record_failure(&rate_limited(now), &cfg, now);
            now = s.cooled_until;
        }
        assert_eq!(s.backoff_level, 4);
        let mut f = rate_limited(now);
        f.hint = Some(secs(7));
        let e = s.record_failure(&f, &cfg, now);
        assert_eq!(e.cooled_until, Some(now + 7_000));
        assert_eq!(s.backoff_level, 0);
        now += 7_000;
        let e = s.record_failure(&rate_limited(now), &cfg, now);
        assert_eq!(e.cooled_until, Some(now + 3_000));
    }

    #[test]
    fn concurrent_failures_raise_level_once() {
        let cfg = cfg();
        let mut s = ConnState::default();
        let started = T0;
        let mut effects = Vec::new();
        for i in 0..20 {
            let now = T0 + 100 + i;
            effects.push(s.record_failure(&rate_limited(started), &cfg, now));
        }
        assert_eq!(s.backoff_level, 1);
        assert_eq!(s.cooled_until, T0 + 100 + 3_000);
        assert_eq!(s.cooldown_set_at, T0 + 100);
        assert!(effects[0].raised_level && !effects[0].ignored_as_stale);
        assert!(effects[1..]
            .iter()
            .all(|e| e.ignored_as_stale && !e.raised_level && e.cooled_until.is_none()));
        // An attempt started after the cooldown was set does count again.
        let e = s.record_failure(&rate_limited(T0 + 200), &cfg, T0 + 300);
        assert!(e.raised_level);
        assert_eq!(s.backoff_level, 2);
        assert_eq!(s.cooled_until, T0 + 300 + 6_000);
    }

    #[test]
    fn stale_check_ends_with_the_cooldown() {
        let cfg = cfg();
        let mut s = ConnState::default();
        s.record_failure(&rate_limited(T0), &cfg, T0 + 10);
        // The cooldown has expired: an old attempt's failure counts normally.
        let e = s.record_failure(&rate_limited(T0), &cfg, T0 + 5_000);
        assert!(!e.ignored_as_stale && e.raised_level);
    }

    #[test]
    fn concurrency_limited_is_fixed_and_keeps_level() {
        let cfg = cfg();
        let mut s = ConnState {
            backoff_level: 3,
            ..ConnState::default()
        };
        let e = s.record_failure(&fail(T0, Reason::ConcurrencyLimited, 429), &cfg, T0);
        assert_eq!(e.cooled_until, Some(T0 + 1_000));
        assert!(!e.raised_level);
        assert_eq!(s.backoff_level, 3);
        let mut f = fail(T0 + 2_000, Reason::ConcurrencyLimited, 429);
        f.hint = Some(secs(4));
        let e = s.record_failure(&f, &cfg, T0 + 2_000);
        assert_eq!(e.cooled_until, Some(T0 + 6_000));
        assert_eq!(s.backoff_level, 3);
    }

    #[test]
    fn three_401s_expire() {
        let cfg = cfg();
        let mut s = ConnState::default();
        let mut now = T0;
        for n in 1..=2 {
            let e = s.record_failure(&fail(now, Reason::AuthError, 401), &cfg, now);
            assert_eq!(s.auth_failures, n);
            assert!(e.cooled_until.is_some() && e.became_terminal.is_none());
            now = s.cooled_until;
        }
        assert_eq!(s.backoff_level, 2);
        let e = s.record_failure(&fail(now, Reason::AuthError, 401), &cfg, now);
        assert_eq!(e.became_terminal, Some(TerminalState::Expired));
        assert_eq!(
            s.eligibility(now + 3_600_000),
            Eligibility::Terminal(TerminalState::Expired)
        );
        // A 403 auth error does not count towards expiry; a success resets the count.
        let mut s = ConnState::default();
        s.record_failure(&fail(T0, Reason::AuthError, 401), &cfg, T0);
        s.record_success();
        s.record_failure(
            &fail(T0 + 10_000, Reason::AuthError, 401),
            &cfg,
            T0 + 10_000,
        );
        s.record_failure(
            &fail(T0 + 20_000, Reason::AuthError, 403),
            &cfg,
            T0 + 20_000,
        );
        assert_eq!(s.auth_failures, 1);
        assert_eq!(s.terminal, None);
    }

    #[test]
    fn concurrent_401s_count_once() {
        let cfg = cfg();
        let mut s = ConnState::default();
        for i in 0..5 {
            s.record_failure(&fail(T0, Reason::AuthError, 401), &cfg, T0 + 10 + i);
        }
        assert_eq!(s.auth_failures, 1);
        assert_eq!(s.terminal, None);
    }

    #[test]
    fn terminal_is_sticky() {
        let cfg = cfg();
        for t in [
            TerminalState::Banned,
            TerminalState::CreditsExhausted,
            TerminalState::Expired,
        ] {
            let mut s = ConnState::default();
            let mut f = fail(T0, Reason::Banned, 403);
            f.terminal = Some(t);
            let e = s.record_failure(&f, &cfg, T0);
            assert_eq!(e.became_terminal, Some(t));
            assert_eq!(s.cooled_until, 0);
            let mut later = rate_limited(T0 + 1_000);
            later.hint = Some(secs(30));
            let e = s.record_failure(&later, &cfg, T0 + 1_000);
            assert_eq!(e, Effect::default());
            let mut other = fail(T0 + 2_000, Reason::CreditsExhausted, 402);
            other.terminal = Some(TerminalState::CreditsExhausted);
            s.record_failure(&other, &cfg, T0 + 2_000);
            assert!(!s.apply_shared(T0 + 60_000, Reason::QuotaExhausted, T0 + 3_000));
            s.record_success();
            assert_eq!(s.terminal, Some(t));
            assert_eq!(s.eligibility(T0 + 4_000), Eligibility::Terminal(t));
            assert_eq!(s.clear(false), Cleared::SkippedTerminal);
            assert_eq!(s.terminal, Some(t));
            assert_eq!(s.clear(true), Cleared::Cleared);
            assert_eq!(s, ConnState::default());
        }
    }

    #[test]
    fn success_clears_errors_but_not_a_running_cooldown() {
        let cfg = cfg();
        let mut s = ConnState::default();
        s.record_failure(&rate_limited(T0), &cfg, T0);
        s.record_failure(&rate_limited(T0 + 3_000), &cfg, T0 + 3_000);
        assert_eq!(s.last_error.as_deref(), Some("boom"));
        s.record_success();
        assert_eq!(s.last_error, None);
        assert_eq!(s.last_error_reason, None);
        assert_eq!(s.last_status, None);
        assert_eq!(s.backoff_level, 0);
        assert_eq!(s.auth_failures, 0);
        assert_eq!(s.eligibility(T0 + 9_000), Eligibility::Eligible);
        let e = s.record_failure(&rate_limited(T0 + 9_000), &cfg, T0 + 9_000);
        assert_eq!(e.cooled_until, Some(T0 + 12_000));
    }

    #[test]
    fn disable_cooling_records_but_never_cools() {
        let mut cfg = cfg();
        cfg.disable_cooling = true;
        let mut s = ConnState::default();
        let mut f = rate_limited(T0);
        f.hint = Some(secs(60));
        let e = s.record_failure(&f, &cfg, T0);
        assert_eq!(e, Effect::default());
        assert_eq!(s.eligibility(T0), Eligibility::Eligible);
        assert_eq!(s.last_status, Some(429));
        assert_eq!(s.last_error_reason, Some(Reason::RateLimitExceeded));
        assert_eq!(s.backoff_level, 0);
        let mut f = fail(T0, Reason::Banned, 403);
        f.terminal = Some(TerminalState::Banned);
        s.record_failure(&f, &cfg, T0);
        assert_eq!(
            s.eligibility(T0),
            Eligibility::Terminal(TerminalState::Banned)
        );
        let mut s = ConnState::default();
        for i in 0..3 {
            s.record_failure(&fail(T0 + i, Reason::AuthError, 401), &cfg, T0 + i);
        }
        assert_eq!(s.terminal, Some(TerminalState::Expired));
    }

    #[test]
    fn stall_cools_only_when_asked() {
        let cfg = cfg();
        let mut s = ConnState::default();
        assert_eq!(
            s.record_stall("stalled 120s", false, &cfg, T0),
            Effect::default()
        );
        assert_eq!(s.last_error.as_deref(), Some("stalled 120s"));
        assert_eq!(s.last_error_reason, Some(Reason::Timeout));
        assert_eq!(s.eligibility(T0), Eligibility::Eligible);
        let e = s.record_stall("stalled 120s", true, &cfg, T0);
        assert_eq!(e.cooled_until, Some(T0 + 3_000));
        assert_eq!(s.backoff_level, 1);
    }

    #[test]
    fn shared_bucket_extends_never_shortens() {
        let cfg = cfg();
        let mut s = ConnState::default();
        assert!(s.apply_shared(T0 + 30_000, Reason::QuotaExhausted, T0));
        assert_eq!(
            s.eligibility(T0 + 1),
            Eligibility::Cooling { until: T0 + 30_000 }
        );
        assert_eq!(s.backoff_level, 0);
        assert!(!s.apply_shared(T0 + 10_000, Reason::RateLimitExceeded, T0 + 5));
        assert!(!s.apply_shared(T0 + 30_000, Reason::RateLimitExceeded, T0 + 5));
        assert_eq!(s.cooled_until, T0 + 30_000);
        assert!(s.apply_shared(T0 + 40_000, Reason::RateLimitExceeded, T0 + 6));
        assert_eq!(s.cooled_until, T0 + 40_000);
        assert_eq!(s.backoff_level, 0);
        // In-flight attempts that started before the shared cooldown are stale.
        let e = s.record_failure(&rate_limited(T0 + 1), &cfg, T0 + 7);
        assert!(e.ignored_as_stale);
        // A deadline already in the past changes nothing.
        let mut fresh = ConnState::default();
        assert!(!fresh.apply_shared(T0, Reason::QuotaExhausted, T0));
        assert_eq!(fresh, ConnState::default());
    }

    #[test]
    fn failure_never_shortens_a_longer_cooldown() {
        let cfg = cfg();
        let mut s = ConnState::default();
        s.apply_shared(T0 + 60_000, Reason::QuotaExhausted, T0);
        let e = s.record_failure(&rate_limited(T0 + 10), &cfg, T0 + 20);
        assert_eq!(e.cooled_until, None);
        assert_eq!(s.cooled_until, T0 + 60_000);
    }

    #[test]
    fn clear_reports_what_it_did() {
        let cfg = cfg();
        let mut s = ConnState::default();
        assert_eq!(s.clear(false), Cleared::Unchanged);
        s.record_failure(&rate_limited(T0), &cfg, T0);
        assert_eq!(s.clear(false), Cleared::Cleared);
        assert_eq!(s, ConnState::default());
    }

    #[test]
    fn long_messages_are_truncated_on_a_char_boundary() {
        let cfg = cfg();
        let mut s = ConnState::default();
        let long = "é".repeat(500);
        let mut f = rate_limited(T0);
        f.message = &long;
        s.record_failure(&f, &cfg, T0);
        assert_eq!(s.last_error.as_ref().map(|m| m.chars().count()), Some(200));
    }

    #[test]
    fn state_round_trips_as_json() {
        let cfg = cfg();
        let mut s = ConnState::default();
        s.record_failure(&rate_limited(T0), &cfg, T0);
        s.terminal = Some(TerminalState::CreditsExhausted);
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<ConnState>(&json).unwrap(), s);
    }

    fn any_reason() -> impl Strategy<Value = Reason> {
        proptest::sample::select(Reason::ALL.to_vec())
    }

    fn any_terminal() -> impl Strategy<Value = Option<TerminalState>> {
        proptest::option::of(proptest::sample::select(vec![
            TerminalState::Banned,
            TerminalState::Expired,
            TerminalState::CreditsExhausted,
        ]))
    }

    /// (delay since previous event, started-before offset, reason, status, hint, rule, terminal)
    type Step = (
        u64,
        u64,
        Reason,
        u16,
        Option<u64>,
        Option<u64>,
        Option<TerminalState>,
    );

    fn any_step() -> impl Strategy<Value = Step> {
        (
            0u64..120_000,
            0u64..10_000,
            any_reason(),
            proptest::sample::select(vec![401u16, 402, 403, 429, 500, 503]),
            proptest::option::of(0u64..200_000_000),
            proptest::option::of(1u64..100_000),
            any_terminal(),
        )
    }

    proptest! {
        #[test]
        fn cooldown_never_ends_before_the_hint(
            level in 0u32..40,
            prior in 0u64..600_000,
            hint_ms in 1u64..=86_400_000,
            reason in any_reason(),
            rule in proptest::option::of(1u64..100_000),
        ) {
            let cfg = cfg();
            let mut s = ConnState { backoff_level: level, ..ConnState::default() };
            s.apply_shared(T0 + prior, Reason::QuotaExhausted, T0 - 1);
            let mut f = fail(T0, reason, 429);
            f.hint = Some(Duration::from_millis(hint_ms));
            f.rule_cooldown = rule.map(Duration::from_millis);
            s.record_failure(&f, &cfg, T0);
            match s.eligibility(T0) {
                Eligibility::Terminal(_) => {}
                _ => prop_assert!(s.cooled_until >= T0 + hint_ms),
            }
        }

        #[test]
        fn terminal_is_never_overwritten(steps in proptest::collection::vec(any_step(), 1..40)) {
            let cfg = cfg();
            let mut s = ConnState::default();
            let mut now = T0;
            let mut first: Option<TerminalState> = None;
            for (gap, back, reason, status, hint, rule, terminal) in steps {
                now += gap;
                let f = Failure {
                    attempt_started: now.saturating_sub(back),
                    reason,
                    status: Some(status),
                    hint: hint.map(Duration::from_millis),
                    rule_cooldown: rule.map(Duration::from_millis),
                    terminal,
                    message: "x",
                };
                s.record_failure(&f, &cfg, now);
                if gap % 3 == 0 { s.record_success(); }
                if gap % 5 == 0 { s.apply_shared(now + 1_000_000, reason, now); }
                if first.is_none() { first = s.terminal; }
                prop_assert_eq!(s.terminal, first);
                if let Some(t) = first {
                    prop_assert_eq!(s.eligibility(now + 1_000_000_000), Eligibility::Terminal(t));
                }
            }
        }

        #[test]
        fn backoff_never_exceeds_max_cooldown(
            gaps in proptest::collection::vec(0u64..400_000, 1..60),
            class in proptest::sample::select(vec![
                ProviderClass::ApiKey, ProviderClass::OAuth, ProviderClass::Local,
            ]),
            max_secs in 1u64..3_600,
            start_level in 0u32..u32::MAX,
        ) {
            let mut cfg = CooldownConfig::defaults(class);
            cfg.max_cooldown = Duration::from_secs(max_secs);
            let mut s = ConnState { backoff_level: start_level, ..ConnState::default() };
            let mut now = T0;
            for gap in gaps {
                now += gap;
                let e = s.record_failure(&rate_limited(now), &cfg, now);
                if let Some(until) = e.cooled_until {
                    prop_assert!(until - now <= max_secs * 1000);
                }
                prop_assert!(s.remaining_ms(now) <= max_secs * 1000);
            }
        }
    }
}
