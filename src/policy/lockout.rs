//! Model lockout (SPEC §5.4): takes one model off one connection of one provider while
//! the rest of that connection, and that model elsewhere, keep serving.
//!
//! Invariants: only statuses in `error_codes` lock, and only when the layer is enabled;
//! a lockout never lasts longer than `max_cooldown` unless the upstream's own (already
//! capped) hint asks for longer; the exponential growth stops after `max_backoff_steps`
//! doublings; a failure never shortens a running lockout. Failures that arrive while the
//! lockout is active come from attempts dispatched before it (no new ones are sent to a
//! locked model), so they do not escalate it again — the same anti-thundering-herd rule
//! as connection cooldowns. Successes decay the failure count; expiry re-enables the
//! model lazily. This module does not key the table (the engine does, with
//! [`lock_key`]) and does not decide whether a failure is model-scoped.

use super::{ms, Millis, Reason, Scope};
use crate::config::ModelLockout;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The effective model-lockout settings.
#[derive(Clone, Debug, PartialEq)]
pub struct LockoutConfig {
    pub enabled: bool,
    pub error_codes: Vec<u16>,
    pub base_cooldown: Duration,
    pub max_cooldown: Duration,
    pub max_backoff_steps: u32,
    pub exponential: bool,
}

impl Default for LockoutConfig {
    /// SPEC §5.4 defaults: off; 403/404/429/502/503/504; 120 s base; 30 min cap;
    /// 10 steps; exponential.
    fn default() -> Self {
        Self {
            enabled: false,
            error_codes: vec![403, 404, 429, 502, 503, 504],
            base_cooldown: Duration::from_secs(120),
            max_cooldown: Duration::from_secs(30 * 60),
            max_backoff_steps: 10,
            exponential: true,
        }
    }
}

impl LockoutConfig {
    pub fn from_config(c: &ModelLockout) -> Self {
        Self {
            enabled: c.enabled,
            error_codes: c.error_codes.clone(),
            base_cooldown: c.base_cooldown,
            max_cooldown: c.max_cooldown,
            max_backoff_steps: c.max_backoff_steps,
            exponential: c.exponential,
        }
    }

    /// Lockout length after `failures` failures (≥ 1), before any upstream hint.
    pub fn cooldown(&self, failures: u32) -> Duration {
        let steps = if self.exponential {
            failures.saturating_sub(1).min(self.max_backoff_steps)
        } else {
            0
        };
        let factor = 1u64.checked_shl(steps.min(63)).unwrap_or(u64::MAX);
        let scaled = ms(self.base_cooldown).saturating_mul(factor);
        Duration::from_millis(scaled.min(ms(self.max_cooldown)))
    }
}

/// Which model key a failure locks, on one provider/connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LockKind {
    /// Every model sharing the quota (429/403/402).
    QuotaFamily,
    /// The model without its variant suffix (404).
    BareModel,
    /// Exactly this provider/connection/model.
    Exact,
}

/// Picks the lock key for a status: 429/403/402 → the quota family (`quota_family` if
/// set, else the model); 404 → the bare model ([`bare_model`]); anything else → the
/// exact model.
pub fn lock_key(status: u16, model: &str, quota_family: Option<&str>) -> (LockKind, String) {
    match status {
        402 | 403 | 429 => (
            LockKind::QuotaFamily,
            quota_family.unwrap_or(model).to_owned(),
        ),
        404 => (LockKind::BareModel, bare_model(model).to_owned()),
        _ => (LockKind::Exact, model.to_owned()),
    }
}

/// [`lock_key`] honouring a classification rule's explicit scope: a rule that says
/// `scope: model` locks exactly the model, whatever the status.
pub fn lock_key_with_scope(
    status: u16,
    model: &str,
    quota_family: Option<&str>,
    rule_scope: Option<Scope>,
) -> (LockKind, String) {
    match rule_scope {
        Some(Scope::Model) => (LockKind::Exact, model.to_owned()),
        _ => lock_key(status, model, quota_family),
    }
}

/// The model name without a variant suffix: everything from the first `:`
/// (`llama-3:free`, `claude-sonnet-4:thinking`) and a trailing `[...]` or `(...)` tag
/// (`claude-sonnet-4[1m]`, `gpt-5 (high)`) are removed, because a 404 means the base
/// model is missing whatever variant was asked for. A vendor prefix (`meta/llama`) is
/// kept: different vendors' models are different models. Never returns an empty name.
pub fn bare_model(model: &str) -> &str {
    let mut bare = model.split(':').next().unwrap_or(model).trim_end();
    loop {
        let stripped = [('[', ']'), ('(', ')')].iter().find_map(|(open, close)| {
            let inner = bare.strip_suffix(*close)?;
            let at = inner.rfind(*open)?;
            Some(inner[..at].trim_end())
        });
        match stripped {
            Some(s) if !s.is_empty() => bare = s,
            _ => break,
        }
    }
    if bare.is_empty() {
        model
    } else {
        bare
    }
}

/// One provider/connection/model lockout, persisted as it is.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Lockout {
    pub failures: u32,
    /// End of the lockout (unix ms); read through `active`.
    pub until: Millis,
    pub reason: Option<Reason>,
    pub status: Option<u16>,
}

impl Lockout {
    /// Applies one failure with `status` when the layer is enabled and the status is in
    /// `error_codes` (returns `None` otherwise), and returns the lockout's end.
    ///
    /// A fresh failure (the lockout is not active) raises `failures` and locks for
    /// `base × 2^(failures-1)` (steps capped at `max_backoff_steps`; constant when not
    /// exponential), capped at `max_cooldown`. A longer upstream `hint` (the caller
    /// passes it already capped at `max_hint`) wins. A failure during an active lockout
    /// (an attempt already in flight) does not escalate; it can only lengthen the lock
    /// through its hint.
    pub fn record_failure(
        &mut self,
        cfg: &LockoutConfig,
        status: u16,
        reason: Reason,
        hint: Option<Duration>,
        now: Millis,
    ) -> Option<Millis> {
        if !cfg.enabled || !cfg.error_codes.contains(&status) {
            return None;
        }
        let length = if self.active(now) {
            hint.unwrap_or(Duration::ZERO)
        } else {
            self.failures = self.failures.saturating_add(1);
            let scaled = cfg.cooldown(self.failures);
            hint.map_or(scaled, |h| h.max(scaled))
        };
        self.until = self.until.max(now.saturating_add(ms(length)));
        self.reason = Some(reason);
        self.status = Some(status);
        Some(self.until)
    }

    /// A lock that reaches this tuple from a quota-bucket sibling (SPEC §5.3 buckets):
    /// lasts at least until `until`, never shortens a longer one, and does not raise
    /// `failures` (this tuple did not fail). Returns true when anything changed.
    pub fn apply_shared(&mut self, until: Millis, reason: Reason, status: u16) -> bool {
        if until <= self.until {
            return false;
        }
        self.until = until;
        self.reason = Some(reason);
        self.status = Some(status);
        true
    }

    /// Success decay: halves `failures` (floor). Returns true when it reached 0: the
    /// caller deletes the entry, which also ends a running lockout early.
    pub fn record_success(&mut self) -> bool {
        self.failures /= 2;
        self.failures == 0
    }

    /// Is the model locked at `now`? Expiry re-enables it lazily.
    pub fn active(&self, now: Millis) -> bool {
        self.until > now
    }

    /// Whole milliseconds left (0 when not active).
    pub fn remaining_ms(&self, now: Millis) -> u64 {
        self.until.saturating_sub(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T0: Millis = 1_700_000_000_000;

    fn on() -> LockoutConfig {
        LockoutConfig {
            enabled: true,
            ..LockoutConfig::default()
        }
    }

    #[test]
    fn from_config_copies_every_field() {
        let c = ModelLockout {
            enabled: true,
            error_codes: vec![429],
            base_cooldown: Duration::from_secs(5),
            max_cooldown: Duration::from_secs(50),
            max_backoff_steps: 2,
            exponential: false,
        };
        let l = LockoutConfig::from_config(&c);
        assert!(l.enabled && !l.exponential);
        assert_eq!(l.error_codes, vec![429]);
        assert_eq!(l.base_cooldown, Duration::from_secs(5));
        assert_eq!(l.max_cooldown, Duration::from_secs(50));
        assert_eq!(l.max_backoff_steps, 2);
    }

    #[test]
    fn lock_keys() {
        let fam = Some("gpt-4o-family");
        let cases: &[(u16, &str, Option<&str>, LockKind, &str)] = &[
            (429, "gpt-4o", fam, LockKind::QuotaFamily, "gpt-4o-family"),
            (403, "gpt-4o", fam, LockKind::QuotaFamily, "gpt-4o-family"),
            (402, "gpt-4o", fam, LockKind::QuotaFamily, "gpt-4o-family"),
            (429, "gpt-4o", None, LockKind::QuotaFamily, "gpt-4o"),
            (404, "llama-3:free", fam, LockKind::BareModel, "llama-3"),
            (
                404,
                "claude-sonnet-4[1m]",
                None,
                LockKind::BareModel,
                "claude-sonnet-4",
            ),
            (404, "gpt-5 (high)", None, LockKind::BareModel, "gpt-5"),
            (
                404,
                "meta/llama-3",
                None,
                LockKind::BareModel,
                "meta/llama-3",
            ),
            (404, ":odd", None, LockKind::BareModel, ":odd"),
            (404, "[x]", None, LockKind::BareModel, "[x]"),
            (502, "gpt-4o:beta", fam, LockKind::Exact, "gpt-4o:beta"),
            (503, "gpt-4o", fam, LockKind::Exact, "gpt-4o"),
        ];
        for (status, model, family, kind, key) in cases {
            assert_eq!(
                lock_key(*status, model, *family),
                (*kind, key.to_string()),
                "{status} {model}"
            );
        }
        assert_eq!(
            lock_key_with_scope(429, "gpt-4o", fam, Some(Scope::Model)),
            (LockKind::Exact, "gpt-4o".to_string())
        );
        assert_eq!(
            lock_key_with_scope(429, "gpt-4o", fam, Some(Scope::Connection)),
            (LockKind::QuotaFamily, "gpt-4o-family".to_string())
        );
    }

    #[test]
    fn off_or_unlisted_status_does_nothing() {
        let mut l = Lockout::default();
        let off = LockoutConfig::default();
        assert_eq!(
            l.record_failure(&off, 429, Reason::RateLimitExceeded, None, T0),
            None
        );
        assert_eq!(
            l.record_failure(&on(), 500, Reason::ServerError, None, T0),
            None
        );
        assert_eq!(l, Lockout::default());
    }

    #[test]
    fn exponential_growth_and_cap() {
        let cfg = on();
        let mut l = Lockout::default();
        let mut now = T0;
        // 120 s doubling: 120, 240, 480, 960, then the 30 min cap.
        for (i, secs) in [120, 240, 480, 960, 1_800, 1_800].iter().enumerate() {
            let until = l.record_failure(&cfg, 429, Reason::QuotaExhausted, None, now);
            assert_eq!(until, Some(now + secs * 1000), "failure {}", i + 1);
            assert!(l.active(now) && l.active(until.unwrap() - 1));
            assert!(!l.active(until.unwrap()));
            now = until.unwrap();
        }
        assert_eq!(l.failures, 6);
        assert_eq!(l.reason, Some(Reason::QuotaExhausted));
        assert_eq!(l.status, Some(429));
    }

    #[test]
    fn steps_cap_and_linear_mode() {
        let mut cfg = on();
        cfg.max_backoff_steps = 2;
        cfg.max_cooldown = Duration::from_secs(10_000);
        assert_eq!(cfg.cooldown(1), Duration::from_secs(120));
        assert_eq!(cfg.cooldown(3), Duration::from_secs(480));
        assert_eq!(cfg.cooldown(50), Duration::from_secs(480));
        cfg.exponential = false;
        assert_eq!(cfg.cooldown(50), Duration::from_secs(120));
    }

    #[test]
    fn longer_hint_wins_shorter_does_not() {
        let cfg = on();
        let mut l = Lockout::default();
        let until = l.record_failure(
            &cfg,
            429,
            Reason::RateLimitExceeded,
            Some(Duration::from_secs(3_600)),
            T0,
        );
        assert_eq!(until, Some(T0 + 3_600_000));
        let mut l = Lockout::default();
        let until = l.record_failure(
            &cfg,
            429,
            Reason::RateLimitExceeded,
            Some(Duration::from_secs(5)),
            T0,
        );
        assert_eq!(until, Some(T0 + 120_000));
    }

    #[test]
    fn in_flight_failures_do_not_escalate() {
        let cfg = on();
        let mut l = Lockout::default();
        for i in 0..20 {
            l.record_failure(&cfg, 404, Reason::NotFound, None, T0 + i);
        }
        assert_eq!(l.failures, 1);
        assert_eq!(l.until, T0 + 120_000);
        let until = l.record_failure(
            &cfg,
            404,
            Reason::NotFound,
            Some(Duration::from_secs(600)),
            T0 + 50,
        );
        assert_eq!(until, Some(T0 + 50 + 600_000));
        assert_eq!(l.failures, 1);
    }

    #[test]
    fn success_decays_to_deletion() {
        let cfg = on();
        let mut l = Lockout::default();
        let mut now = T0;
        for _ in 0..5 {
            now = l
                .record_failure(&cfg, 503, Reason::ServerError, None, now)
                .unwrap();
        }
        assert_eq!(l.failures, 5);
        assert!(!l.record_success());
        assert_eq!(l.failures, 2);
        assert!(!l.record_success());
        assert_eq!(l.failures, 1);
        assert!(l.record_success());
        assert_eq!(l.failures, 0);
    }

    #[test]
    fn round_trips_as_json() {
        let mut l = Lockout::default();
        l.record_failure(&on(), 429, Reason::QuotaExhausted, None, T0);
        let json = serde_json::to_string(&l).unwrap();
        assert_eq!(serde_json::from_str::<Lockout>(&json).unwrap(), l);
    }

    proptest! {
        #[test]
        fn never_longer_than_cap_without_hint(
            gaps in proptest::collection::vec(0u64..4_000_000, 1..40),
            base in 1u64..1_000,
            max in 1u64..10_000,
            steps in 0u32..100,
            exponential in any::<bool>(),
        ) {
            let cfg = LockoutConfig {
                enabled: true,
                error_codes: vec![429],
                base_cooldown: Duration::from_secs(base),
                max_cooldown: Duration::from_secs(max.max(base)),
                max_backoff_steps: steps,
                exponential,
            };
            let mut l = Lockout::default();
            let mut now = T0;
            for gap in gaps {
                now += gap;
                if let Some(until) = l.record_failure(&cfg, 429, Reason::QuotaExhausted, None, now) {
                    prop_assert!(until - now <= max.max(base) * 1000);
                    prop_assert!(until > now);
                }
            }
        }

        #[test]
        fn bare_model_never_panics_or_empties(model in ".{0,30}") {
            let bare = bare_model(&model);
            prop_assert!(model.is_empty() || !bare.is_empty());
        }
    }

    #[test]
    fn a_shared_lock_extends_but_never_shortens_or_escalates() {
        let mut l = Lockout::default();
        assert!(l.apply_shared(5_000, Reason::RateLimitExceeded, 429));
        assert_eq!((l.until, l.failures), (5_000, 0));
        assert!(l.active(4_999) && !l.active(5_000));
        assert!(!l.apply_shared(3_000, Reason::QuotaExhausted, 429));
        assert_eq!(l.until, 5_000);
        assert!(l.apply_shared(9_000, Reason::QuotaExhausted, 429));
        assert_eq!(
            (l.until, l.failures, l.reason),
            (9_000, 0, Some(Reason::QuotaExhausted))
        );
    }
}
