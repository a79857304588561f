//! Pure resilience policies (SPEC §5): plain state machines with `now` passed in.
//!
//! Nothing here does I/O or knows Pingora, tokio, redb or prometheus. Time is unix
//! milliseconds (`Millis`) so a state can be persisted and restored as it is, and tests
//! advance a hand-held clock (`t0 + 31_000`). Every "no" is returned as data (a decision
//! enum), never as an error. All recovery is lazy: readers compare stored deadlines with
//! `now`; no policy needs a background timer to become eligible again.

pub mod breaker;
pub mod classify;
pub mod combo;
pub mod exclusion;
pub mod failover;
pub mod fields;
pub mod window_gate;

pub mod cooldown;
pub mod lockout;
pub mod retry_hint;
pub mod timefmt;

pub mod affinity;
pub mod lease;
pub mod redact;
pub mod subscription;
pub mod watchdog;

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// Unix time in milliseconds.
pub type Millis = u64;

/// `Duration` → whole milliseconds (saturating).
pub fn ms(d: Duration) -> Millis {
    d.as_millis().min(u64::MAX as u128) as u64
}

/// Remaining whole seconds until `until`, rounded up, at least 1 (for `Retry-After`).
pub fn retry_after_secs(until: Millis, now: Millis) -> u64 {
    until.saturating_sub(now).div_ceil(1000).max(1)
}

/// The longest `Retry-After` a client is told (SPEC §3): a day.
pub const MAX_CLIENT_RETRY_AFTER_S: u64 = 86_400;

/// A `Retry-After` for a client: whole seconds in `1..=86400`, whatever the timer behind
/// it (a rule may cool a connection for 30 days; the client still hears "a day").
pub fn client_retry_after(secs: u64) -> u64 {
    secs.clamp(1, MAX_CLIENT_RETRY_AFTER_S)
}

/// Why an attempt failed (SPEC §5.11).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    RateLimitExceeded,
    QuotaExhausted,
    ConcurrencyLimited,
    CreditsExhausted,
    AuthError,
    Banned,
    NotFound,
    ContextOverflow,
    BadRequest,
    ServerError,
    Timeout,
    Transport,
}

impl Reason {
    pub const ALL: [Reason; 12] = [
        Reason::RateLimitExceeded,
        Reason::QuotaExhausted,
        Reason::ConcurrencyLimited,
        Reason::CreditsExhausted,
        Reason::AuthError,
        Reason::Banned,
        Reason::NotFound,
        Reason::ContextOverflow,
        Reason::BadRequest,
        Reason::ServerError,
        Reason::Timeout,
        Reason::Transport,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::RateLimitExceeded => "rate_limit_exceeded",
            Reason::QuotaExhausted => "quota_exhausted",
            Reason::ConcurrencyLimited => "concurrency_limited",
            Reason::CreditsExhausted => "credits_exhausted",
            Reason::AuthError => "auth_error",
            Reason::Banned => "banned",
            Reason::NotFound => "not_found",
            Reason::ContextOverflow => "context_overflow",
            Reason::BadRequest => "bad_request",
            Reason::ServerError => "server_error",
            Reason::Timeout => "timeout",
            Reason::Transport => "transport",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Reason {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Reason::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| {
                let all: Vec<_> = Reason::ALL.iter().map(|r| r.as_str()).collect();
                format!("unknown reason {s:?}; expected one of {}", all.join(", "))
            })
    }
}

/// Which layer a failure belongs to (SPEC §5.11).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    Provider,
    Connection,
    Model,
    Request,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Provider => "provider",
            Scope::Connection => "connection",
            Scope::Model => "model",
            Scope::Request => "request",
        }
    }
}

impl FromStr for Scope {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "provider" => Ok(Scope::Provider),
            "connection" => Ok(Scope::Connection),
            "model" => Ok(Scope::Model),
            "request" => Ok(Scope::Request),
            _ => Err(format!(
                "unknown scope {s:?}; expected provider, connection, model or request"
            )),
        }
    }
}

/// Terminal connection states: not cooldowns; only an operator (or a changed
/// credential on reload) clears them (SPEC §5.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TerminalState {
    Banned,
    Expired,
    CreditsExhausted,
}

impl TerminalState {
    pub fn as_str(self) -> &'static str {
        match self {
            TerminalState::Banned => "banned",
            TerminalState::Expired => "expired",
            TerminalState::CreditsExhausted => "credits_exhausted",
        }
    }
}

impl FromStr for TerminalState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "banned" => Ok(TerminalState::Banned),
            "expired" => Ok(TerminalState::Expired),
            "credits_exhausted" => Ok(TerminalState::CreditsExhausted),
            _ => Err(format!(
                "unknown terminal state {s:?}; expected banned, expired or credits_exhausted"
            )),
        }
    }
}

/// The verdict on one failed attempt (SPEC §5.11).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Classification {
    pub reason: Reason,
    pub scope: Scope,
    /// May another target/connection be tried for this request?
    pub retryable: bool,
    /// Explicit cooldown from an operator rule (wins over computed backoff).
    pub cooldown: Option<Duration>,
    pub terminal: Option<TerminalState>,
    /// Id of the operator rule that matched, if any.
    pub rule: Option<String>,
}

/// A header map from (name, value) pairs, for the tests of the header parsers.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) fn header_map(pairs: &[(&str, &str)]) -> http::HeaderMap {
    let mut h = http::HeaderMap::new();
    for (k, v) in pairs {
        h.append(
            http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            http::HeaderValue::from_str(v).unwrap(),
        );
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for r in Reason::ALL {
            assert_eq!(r.as_str().parse::<Reason>().unwrap(), r);
        }
        assert!("nope".parse::<Reason>().is_err());
        assert_eq!("model".parse::<Scope>().unwrap(), Scope::Model);
        assert_eq!(
            "credits_exhausted".parse::<TerminalState>().unwrap(),
            TerminalState::CreditsExhausted
        );
    }

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one() {
        assert_eq!(retry_after_secs(10_000, 10_000), 1);
        assert_eq!(retry_after_secs(10_001, 10_000), 1);
        assert_eq!(retry_after_secs(12_001, 10_000), 3);
    }

    #[test]
    fn client_retry_after_is_clamped_to_a_second_and_a_day() {
        assert_eq!(client_retry_after(0), 1);
        assert_eq!(client_retry_after(30), 30);
        assert_eq!(client_retry_after(343_611_483), 86_400);
    }
}
