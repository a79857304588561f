//! Combo cooldown-aware wait (SPEC §5.8): when every target of a model is held back only
//! by short, transient timers, wait for the soonest one instead of answering 429/503.
//!
//! Invariants: never waits on a quota-exhausted, auth, terminal or not-found reason;
//! never waits on an open breaker or window gate (a failing provider is not a timer a
//! client should sit out); never waits past `latest_end` (the request's execution
//! budget, less what its attempt needs); never exceeds `max_wait`, `max_attempts` waits
//! or the total `budget`; never waits when nothing would lift. A decline says whether
//! the blockers are rate limits with a known reset, which decides between 429
//! `rate_limit_error` and 503 `all_targets_cooling_down`.

use super::{Millis, Reason};
use crate::config::ComboWait;
use std::time::Duration;

/// What holds one candidate back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    /// The connection is cooling down (the cause is its last error).
    Cooldown,
    /// A model lockout.
    Lockout,
    /// The provider's breaker (or window gate): never waited on.
    ProviderGate,
    /// Already tried by this request (does not block waiting; stays excluded).
    Tried,
    /// Terminal, lease, capacity, anything a timer does not lift.
    Other,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Blocker {
    pub hold: Hold,
    pub cause: Option<Reason>,
    pub until: Option<Millis>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Wait(Duration),
    /// Not waiting. `rate_limited_until` is the soonest reset when every timer blocker
    /// is a rate limit (→ 429 `rate_limit_error`), else `None` (→ 503 / 404).
    Decline {
        rate_limited_until: Option<Millis>,
    },
}

fn never_wait(cause: Option<Reason>) -> bool {
    matches!(
        cause,
        Some(
            Reason::QuotaExhausted
                | Reason::AuthError
                | Reason::CreditsExhausted
                | Reason::Banned
                | Reason::NotFound
        )
    )
}

fn rate_limit(cause: Option<Reason>) -> bool {
    matches!(
        cause,
        Some(Reason::RateLimitExceeded | Reason::QuotaExhausted | Reason::ConcurrencyLimited)
    )
}

/// Decides one wait. `waits` / `waited` are what this request already spent;
/// `model_opt_in` is the model's `cooldown_wait`; a wait must end by `latest_end`.
pub fn decide(
    cfg: &ComboWait,
    model_opt_in: bool,
    blockers: &[Blocker],
    spent: (u32, Duration),
    latest_end: Millis,
    now: Millis,
) -> Decision {
    let (waits, waited) = spent;
    let timers: Vec<&Blocker> = blockers
        .iter()
        .filter(|b| !matches!(b.hold, Hold::Tried | Hold::Other))
        .collect();
    let all_rate_limited = !timers.is_empty()
        && timers
            .iter()
            .all(|b| rate_limit(b.cause) && b.until.is_some());
    let soonest = timers.iter().filter_map(|b| b.until).min();
    let decline = Decision::Decline {
        rate_limited_until: if all_rate_limited { soonest } else { None },
    };
    if !cfg.enabled || !model_opt_in || waits >= cfg.max_attempts || timers.is_empty() {
        return decline;
    }
    if blockers
        .iter()
        .any(|b| matches!(b.hold, Hold::Other | Hold::ProviderGate))
    {
        return decline;
    }
    if timers
        .iter()
        .any(|b| b.until.is_none() || never_wait(b.cause))
    {
        return decline;
    }
    let Some(soonest) = soonest else {
        return decline;
    };
    let wait = Duration::from_millis(soonest.saturating_sub(now));
    if wait > cfg.max_wait || waited + wait > cfg.budget || soonest > latest_end {
        return decline;
    }
    Decision::Wait(wait)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Millis = 1_700_000_000_000;
    /// A budget that never binds.
    const LATE: Millis = T0 + 3_600_000;

    fn cfg() -> ComboWait {
        ComboWait {
            enabled: true,
            max_wait: Duration::from_secs(60),
            max_attempts: 2,
            budget: Duration::from_secs(90),
        }
    }

    fn b(hold: Hold, cause: Option<Reason>, in_ms: Option<u64>) -> Blocker {
        Blocker {
            hold,
            cause,
            until: in_ms.map(|m| T0 + m),
        }
    }

    #[test]
    fn waits_for_the_soonest_rate_limit() {
        let bl = [
            b(Hold::Cooldown, Some(Reason::RateLimitExceeded), Some(2_000)),
            b(Hold::Cooldown, Some(Reason::RateLimitExceeded), Some(5_000)),
            b(Hold::Tried, None, None),
        ];
        assert_eq!(
            decide(&cfg(), true, &bl, (0, Duration::ZERO), LATE, T0),
            Decision::Wait(Duration::from_secs(2))
        );
    }

    #[test]
    fn never_waits_on_quota_auth_terminal_or_not_found() {
        for cause in [
            Reason::QuotaExhausted,
            Reason::AuthError,
            Reason::NotFound,
            Reason::CreditsExhausted,
        ] {
            let bl = [b(Hold::Cooldown, Some(cause), Some(2_000))];
            assert!(
                matches!(
                    decide(&cfg(), true, &bl, (0, Duration::ZERO), LATE, T0),
                    Decision::Decline { .. }
                ),
                "{cause:?}"
            );
        }
        let quota = [b(Hold::Cooldown, Some(Reason::QuotaExhausted), Some(2_000))];
        assert_eq!(
            decide(&cfg(), true, &quota, (0, Duration::ZERO), LATE, T0),
            Decision::Decline {
                rate_limited_until: Some(T0 + 2_000)
            }
        );
        let terminal = [
            b(Hold::Other, None, None),
            b(Hold::Cooldown, Some(Reason::RateLimitExceeded), Some(1_000)),
        ];
        assert!(matches!(
            decide(&cfg(), true, &terminal, (0, Duration::ZERO), LATE, T0),
            Decision::Decline { .. }
        ));
    }

    #[test]
    fn bounds_max_wait_attempts_budget_and_opt_out() {
        let long = [b(
            Hold::Cooldown,
            Some(Reason::RateLimitExceeded),
            Some(61_000),
        )];
        assert_eq!(
            decide(&cfg(), true, &long, (0, Duration::ZERO), LATE, T0),
            Decision::Decline {
                rate_limited_until: Some(T0 + 61_000)
            }
        );
        let short = [b(
            Hold::Cooldown,
            Some(Reason::RateLimitExceeded),
            Some(30_000),
        )];
        assert!(matches!(
            decide(&cfg(), true, &short, (2, Duration::ZERO), LATE, T0),
            Decision::Decline { .. }
        ));
        assert!(matches!(
            decide(&cfg(), true, &short, (1, Duration::from_secs(70)), LATE, T0),
            Decision::Decline { .. }
        ));
        assert!(matches!(
            decide(&cfg(), false, &short, (0, Duration::ZERO), LATE, T0),
            Decision::Decline { .. }
        ));
        let off = ComboWait {
            enabled: false,
            ..cfg()
        };
        assert!(matches!(
            decide(&off, true, &short, (0, Duration::ZERO), LATE, T0),
            Decision::Decline { .. }
        ));
    }

    #[test]
    fn never_waits_on_an_open_breaker_or_window_gate() {
        for gate_in in [2_000, 10_000, 120_000] {
            let open = [b(
                Hold::ProviderGate,
                Some(Reason::ServerError),
                Some(gate_in),
            )];
            assert_eq!(
                decide(&cfg(), true, &open, (0, Duration::ZERO), LATE, T0),
                Decision::Decline {
                    rate_limited_until: None
                },
                "gate lifting in {gate_in} ms"
            );
        }
        // A short rate limit does not make a failing provider worth sitting out.
        let mixed = [
            b(Hold::ProviderGate, Some(Reason::ServerError), Some(5_000)),
            b(Hold::Cooldown, Some(Reason::RateLimitExceeded), Some(1_000)),
        ];
        assert!(matches!(
            decide(&cfg(), true, &mixed, (0, Duration::ZERO), LATE, T0),
            Decision::Decline { .. }
        ));
        let nothing = [b(Hold::Tried, None, None)];
        assert_eq!(
            decide(&cfg(), true, &nothing, (0, Duration::ZERO), LATE, T0),
            Decision::Decline {
                rate_limited_until: None
            }
        );
    }

    #[test]
    fn never_waits_for_a_timer_ending_past_the_budget() {
        let rl = [b(
            Hold::Cooldown,
            Some(Reason::RateLimitExceeded),
            Some(30_000),
        )];
        // The budget ends before the timer: decline at once, still a rate-limit answer.
        assert_eq!(
            decide(&cfg(), true, &rl, (0, Duration::ZERO), T0 + 29_999, T0),
            Decision::Decline {
                rate_limited_until: Some(T0 + 30_000)
            }
        );
        assert_eq!(
            decide(&cfg(), true, &rl, (0, Duration::ZERO), T0 + 30_000, T0),
            Decision::Wait(Duration::from_secs(30))
        );
    }
}
