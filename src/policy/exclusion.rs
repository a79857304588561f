//! Why a candidate (target × connection) could not be used for an attempt, as data: the
//! select phase produces these, the failover machine decides on them, and clients read
//! them in `diagnostics.excluded[]` (SPEC §4).
//!
//! Invariant: `until` is set exactly for the exclusions that lift by themselves (timers
//! and leases); a reason that no timer lifts (terminal, capacity, already tried) never
//! carries one, so it can never become a `Retry-After`.

use super::{retry_after_secs, Millis, Reason};
use serde_json::{json, Value};

/// SPEC §4 `diagnostics.excluded[].reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExclusionReason {
    CircuitOpen,
    ProviderCooldown,
    ConnectionCooldown,
    Terminal,
    ModelLockout,
    LeaseHeld,
    ConcurrencyFull,
    AlreadyTried,
}

impl ExclusionReason {
    pub fn as_str(self) -> &'static str {
        match self {
            ExclusionReason::CircuitOpen => "circuit_open",
            ExclusionReason::ProviderCooldown => "provider_cooldown",
            ExclusionReason::ConnectionCooldown => "connection_cooldown",
            ExclusionReason::Terminal => "terminal",
            ExclusionReason::ModelLockout => "model_lockout",
            ExclusionReason::LeaseHeld => "lease_held",
            ExclusionReason::ConcurrencyFull => "concurrency_full",
            ExclusionReason::AlreadyTried => "already_tried",
        }
    }

    /// Exclusions that lift by themselves when a resilience timer runs out (the breaker's
    /// half-open time included): these make a 503 `all_targets_cooling_down`.
    pub fn is_timer(self) -> bool {
        matches!(
            self,
            ExclusionReason::CircuitOpen
                | ExclusionReason::ProviderCooldown
                | ExclusionReason::ConnectionCooldown
                | ExclusionReason::ModelLockout
        )
    }
}

/// One candidate that was not used, with its reason.
#[derive(Clone, Debug, PartialEq)]
pub struct Exclusion {
    pub provider: String,
    pub connection: String,
    pub model: String,
    pub reason: ExclusionReason,
    /// When the exclusion lifts by itself (timers and leases).
    pub until: Option<Millis>,
    /// Terminal state name, for `terminal` exclusions.
    pub detail: Option<&'static str>,
    /// The failure behind a cooldown or lockout (decides whether a combo wait is worth it).
    pub cause: Option<Reason>,
}

impl Exclusion {
    pub fn json(&self, now: Millis) -> Value {
        json!({
            "provider": self.provider,
            "connection": self.connection,
            "model": self.model,
            "reason": self.reason.as_str(),
            "retry_after_s": self.until.map(|u| retry_after_secs(u, now)),
            "state": self.detail,
            "cause": self.cause.map(|c| c.as_str()),
        })
    }
}

/// The soonest moment a timer exclusion lifts, if any timer is among them.
pub fn soonest_timer(excluded: &[Exclusion]) -> Option<Millis> {
    excluded
        .iter()
        .filter(|e| e.reason.is_timer())
        .filter_map(|e| e.until)
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(reason: ExclusionReason, until: Option<Millis>) -> Exclusion {
        Exclusion {
            provider: "p".into(),
            connection: "c".into(),
            model: "m".into(),
            reason,
            until,
            detail: None,
            cause: None,
        }
    }

    #[test]
    fn only_timers_count_for_the_soonest() {
        let list = [
            ex(ExclusionReason::LeaseHeld, Some(1_000)),
            ex(ExclusionReason::CircuitOpen, Some(9_000)),
            ex(ExclusionReason::ConnectionCooldown, Some(5_000)),
            ex(ExclusionReason::Terminal, None),
        ];
        assert_eq!(soonest_timer(&list), Some(5_000));
        assert_eq!(soonest_timer(&list[..1]), None);
        let j = list[1].json(4_000);
        assert_eq!(j["reason"], "circuit_open");
        assert_eq!(j["retry_after_s"], 5);
    }
}
