//! The failover state machine of one request (SPEC §2, §4, §5.6–§5.8; ARCHITECTURE
//! §3.1): every decision of the attempt loop, as a pure function of what selection
//! offered, how each attempt ended, and `now`.
//!
//! It owns what the loop would otherwise keep in mutable locals: what this request has
//! tried (and at which scope), how many attempts are left, the execution budget, the
//! combo waits spent, the one lease relocation and the one emergency-fallback hop, the
//! upstream error held for pass-through, and finally which answer the client gets. The
//! glue around it only runs what it is told ([`Next`]) and reports back.
//!
//! Invariants:
//! - no wait ends past the budget: a combo wait or a queue wait must leave the attempt it
//!   waits for at least `reserve` of the execution budget, else the request is answered
//!   at once (SPEC §5.8: a request is never held and then answered 504 for a wait
//!   Sluice chose);
//! - open breakers and window gates are never waited on (see `combo::decide`);
//! - at most `max_attempts` attempts; after a committed attempt nothing more happens;
//! - when nothing can run, the answer is, in order: the held upstream error; 504
//!   `upstream_timeout` when every attempt hung, 502 `upstream_unavailable` for other
//!   transport failures; the emergency fallback model (once); 429 `rate_limit_error`
//!   when every timer is a rate limit with a known reset; 503
//!   `all_targets_cooling_down` with the soonest timer (a breaker's half-open time
//!   included); 404 `no_executable_targets` when no timer will lift anything.
//!
//! Time is the engine clock's unix milliseconds; the machine never reads a clock.

use super::combo::{self, Blocker, Decision, Hold};
use super::exclusion::{soonest_timer, Exclusion, ExclusionReason};
use super::{ms, retry_after_secs, Millis, Scope};
use crate::codes::ErrorCode;
use crate::config::ComboWait;
use std::time::Duration;

/// The chosen target and connection of one attempt (indices into the pinned config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    /// Index into the model's targets.
    pub target: usize,
    pub provider: usize,
    /// Index into the provider's connections.
    pub connection: usize,
}

/// What one request has already tried, so later attempts go elsewhere.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tried {
    /// (provider, connection) pairs that failed at connection (or request) scope.
    pub connections: Vec<(usize, usize)>,
    /// Providers that failed at provider scope (transport, 408, 5xx) or whose breaker
    /// refused a permit.
    pub providers: Vec<usize>,
    /// Targets that failed at model scope (e.g. 404).
    pub targets: Vec<usize>,
}

/// The request's limits, fixed when dispatch starts.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_attempts: usize,
    pub combo: ComboWait,
    /// The model's `cooldown_wait`.
    pub model_cooldown_wait: bool,
    pub queue_wait: Duration,
    pub fail_open: bool,
    /// Dispatch start + `queue.execution_timeout`.
    pub deadline: Millis,
    /// Budget a wait must leave for the attempt it waits for.
    pub reserve: Duration,
    /// The request presented an exclusive lease.
    pub has_lease: bool,
    /// The `emergency_fallback` model, when it applies to this request.
    pub fallback: Option<usize>,
}

impl Limits {
    /// The reserve for an execution timeout: 1 s, or a quarter of a shorter timeout.
    pub fn reserve_for(execution_timeout: Duration) -> Duration {
        (execution_timeout / 4).min(Duration::from_secs(1))
    }
}

/// What the select phase found.
#[derive(Debug, Clone, Copy)]
pub enum Offer<'a> {
    /// A candidate, its concurrency permit and breaker permit taken.
    Picked(Pick),
    /// Runnable candidates exist, all at their concurrency cap.
    Full,
    /// Nothing runnable: every candidate considered, with its reason.
    Empty(&'a [Exclusion]),
}

/// How the wait for a concurrency permit ended (the glue re-checked the candidate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queued {
    /// A permit (or, failing open, none) and a breaker permit: go.
    Got(Pick),
    /// The candidate stopped being runnable during the wait.
    NotRunnable,
    /// Its provider's breaker refused after the wait.
    BreakerDenied { provider: usize },
    /// `queue.max_depth` requests already wait on every candidate.
    Full,
    /// The wait ended without a permit and without failing open.
    TimedOut,
}

/// How one attempt ended, as far as the loop's decisions go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The first byte reached the client: no more failover.
    Committed,
    /// The upstream answered ≥ 400 before commit; the glue holds its error.
    Refused {
        pick: Pick,
        retryable: bool,
        scope: Scope,
    },
    /// No usable answer: connect/TLS/reset, or no first byte within the TTFT budget.
    Transport {
        pick: Pick,
        timed_out: bool,
    },
    /// The execution deadline passed during the attempt.
    Deadline,
    ClientGone,
}

/// What the glue does next.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Run one attempt on this pick.
    Attempt(Pick),
    /// Run the select phase again now.
    Select,
    /// Wait (FIFO) for a concurrency permit until `until`; on timeout go without a
    /// permit when `fail_open`, else report [`Queued::TimedOut`].
    Queue {
        until: Millis,
        fail_open: bool,
    },
    /// Try once to move the presented lease to another connection, then select again.
    RelocateLease,
    /// Sleep until `until` (the soonest timer), then select again.
    Wait {
        until: Millis,
    },
    /// Run the emergency fallback model's targets (same budget, nothing tried yet).
    Fallback {
        model: usize,
    },
    Answer(Answer),
}

/// How the request ends.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// An attempt committed; its stream phase is all that is left.
    Committed,
    /// Pass the held upstream error through (restated, `Retry-After` normalised).
    PassThrough,
    /// An error Sluice answers itself.
    Refuse(Refusal),
    /// The client went away: nothing to write.
    ClientGone,
}

/// A synthesised error: its code and what goes into its body and headers.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    pub code: ErrorCode,
    /// `Retry-After` in whole seconds (≥ 1).
    pub retry_after: Option<u64>,
    /// For 429 `rate_limit_error`: when the soonest rate limit resets.
    pub reset_at: Option<Millis>,
    /// `diagnostics.excluded[]`.
    pub excluded: Vec<Exclusion>,
    /// Whether `diagnostics.attempts[]` belongs in the body.
    pub with_attempts: bool,
}

impl Refusal {
    fn new(code: ErrorCode) -> Self {
        Refusal {
            code,
            retry_after: None,
            reset_at: None,
            excluded: Vec::new(),
            with_attempts: false,
        }
    }

    fn retry_in(mut self, secs: u64) -> Self {
        self.retry_after = Some(super::client_retry_after(secs));
        self
    }
}

/// Times a request may go back to selection because the connection it waited for
/// stopped being runnable during the wait.
pub const MAX_REQUEUES: usize = 3;

/// One request's failover state.
#[derive(Debug, Clone)]
pub struct Failover {
    limits: Limits,
    tried: Tried,
    attempts: usize,
    combo_waits: u32,
    combo_waited: Duration,
    requeues: usize,
    relocated: bool,
    on_fallback: bool,
    /// An upstream error is held for pass-through.
    held: bool,
    /// Transport failures so far, and how many of them were first-byte timeouts.
    transport: usize,
    timeouts: usize,
}

impl Failover {
    pub fn new(limits: Limits) -> Self {
        Failover {
            limits,
            tried: Tried::default(),
            attempts: 0,
            combo_waits: 0,
            combo_waited: Duration::ZERO,
            requeues: 0,
            relocated: false,
            on_fallback: false,
            held: false,
            transport: 0,
            timeouts: 0,
        }
    }

    pub fn tried(&self) -> &Tried {
        &self.tried
    }

    /// Attempts started so far.
    pub fn attempts(&self) -> usize {
        self.attempts
    }

    /// No attempt is left after the current one (a failure now is final).
    pub fn is_last_attempt(&self) -> bool {
        self.attempts >= self.limits.max_attempts
    }

    /// Execution budget left at `now`.
    pub fn remaining(&self, now: Millis) -> Duration {
        Duration::from_millis(self.limits.deadline.saturating_sub(now))
    }

    /// The latest moment a wait may end: the attempt after it keeps `reserve`.
    fn latest_wait_end(&self) -> Millis {
        self.limits.deadline.saturating_sub(ms(self.limits.reserve))
    }

    /// The select phase's result.
    pub fn on_offer(&mut self, offer: Offer<'_>, now: Millis) -> Next {
        if self.attempts >= self.limits.max_attempts {
            return self.give_up(&[], None, now);
        }
        match offer {
            Offer::Picked(pick) => self.start(pick, now),
            Offer::Full => {
                let latest = self.latest_wait_end();
                let by_queue = now.saturating_add(ms(self.limits.queue_wait));
                if latest <= now {
                    return self.queue_refusal(ErrorCode::QueueTimeout, now);
                }
                // When the budget is shorter than `queue.wait`, the wait takes at most
                // half of what the attempt could use, so failing open (or refusing) still
                // leaves the attempt a real share of the budget: a fail-open gateway is
                // never turned into a fail-closed one by a short execution timeout, nor
                // into one that runs attempts bound to hit the deadline.
                let until = if by_queue <= latest {
                    by_queue
                } else {
                    now + (latest - now) / 2
                };
                Next::Queue {
                    until,
                    fail_open: self.limits.fail_open,
                }
            }
            Offer::Empty(excluded) => self.nothing_runnable(excluded, now),
        }
    }

    /// The wait for a concurrency permit ended.
    pub fn on_queued(&mut self, q: Queued, now: Millis) -> Next {
        match q {
            Queued::Got(pick) => self.start(pick, now),
            Queued::NotRunnable => {
                self.requeues += 1;
                if self.requeues > MAX_REQUEUES {
                    self.queue_refusal(ErrorCode::QueueTimeout, now)
                } else {
                    Next::Select
                }
            }
            Queued::BreakerDenied { provider } => {
                self.tried.providers.push(provider);
                Next::Select
            }
            Queued::Full => self.queue_refusal(ErrorCode::QueueFull, now),
            Queued::TimedOut => self.queue_refusal(ErrorCode::QueueTimeout, now),
        }
    }

    /// One attempt ended.
    pub fn on_ended(&mut self, end: Ended, now: Millis) -> Next {
        match end {
            Ended::Committed => Next::Answer(Answer::Committed),
            Ended::ClientGone => Next::Answer(Answer::ClientGone),
            Ended::Deadline => Next::Answer(Answer::Refuse(Refusal {
                with_attempts: true,
                ..Refusal::new(ErrorCode::ExecutionTimeout)
            })),
            Ended::Transport { pick, timed_out } => {
                self.transport += 1;
                self.timeouts += usize::from(timed_out);
                self.tried.providers.push(pick.provider);
                self.after_failure(now)
            }
            Ended::Refused {
                pick,
                retryable,
                scope,
            } => {
                self.held = true;
                if !retryable {
                    return Next::Answer(Answer::PassThrough);
                }
                match scope {
                    Scope::Provider => self.tried.providers.push(pick.provider),
                    Scope::Model => self.tried.targets.push(pick.target),
                    Scope::Connection | Scope::Request => self
                        .tried
                        .connections
                        .push((pick.provider, pick.connection)),
                }
                self.after_failure(now)
            }
        }
    }

    /// The lease relocation the machine asked for has run.
    pub fn on_lease_relocated(&mut self) -> Next {
        Next::Select
    }

    fn start(&mut self, pick: Pick, now: Millis) -> Next {
        if now >= self.limits.deadline {
            return self.out_of_budget(now);
        }
        self.attempts += 1;
        Next::Attempt(pick)
    }

    fn after_failure(&mut self, now: Millis) -> Next {
        if self.attempts >= self.limits.max_attempts {
            self.give_up(&[], None, now)
        } else {
            Next::Select
        }
    }

    /// The budget ran out between attempts (a slow failure used it up): whatever the
    /// attempts so far earned, or 504 when they earned nothing to show.
    fn out_of_budget(&mut self, now: Millis) -> Next {
        if self.held || self.transport > 0 {
            return self.give_up(&[], None, now);
        }
        Next::Answer(Answer::Refuse(Refusal {
            with_attempts: true,
            ..Refusal::new(ErrorCode::ExecutionTimeout)
        }))
    }

    /// The queue refused: a queue error, unless earlier attempts earned a better answer
    /// (an upstream error to pass through, or the transport failures they met).
    fn queue_refusal(&mut self, code: ErrorCode, now: Millis) -> Next {
        if self.held || self.transport > 0 {
            return self.give_up(&[], None, now);
        }
        Next::Answer(Answer::Refuse(Refusal::new(code).retry_in(1)))
    }

    fn nothing_runnable(&mut self, excluded: &[Exclusion], now: Millis) -> Next {
        // A lease whose connection became ineligible may move (once, same generation).
        if self.limits.has_lease && !self.relocated {
            self.relocated = true;
            return Next::RelocateLease;
        }
        if !self.held && !self.limits.has_lease {
            let leased = excluded
                .iter()
                .filter(|e| e.reason == ExclusionReason::LeaseHeld)
                .filter_map(|e| e.until)
                .min();
            if let Some(until) = leased {
                let r = Refusal::new(ErrorCode::LeaseCapacityUnavailable)
                    .retry_in(retry_after_secs(until, now));
                return Next::Answer(Answer::Refuse(r));
            }
        }
        let decision = combo::decide(
            &self.limits.combo,
            self.limits.model_cooldown_wait,
            &blockers(excluded),
            (self.combo_waits, self.combo_waited),
            self.latest_wait_end(),
            now,
        );
        match decision {
            Decision::Wait(d) => {
                self.combo_waits += 1;
                self.combo_waited += d;
                // What held these back was a timer that has now run out (a target that
                // answered "not found" stays excluded).
                self.tried.connections.clear();
                Next::Wait {
                    until: now.saturating_add(ms(d)),
                }
            }
            Decision::Decline { rate_limited_until } => {
                self.give_up(excluded, rate_limited_until, now)
            }
        }
    }

    /// Nothing more will be tried: the final answer (or the fallback hop).
    fn give_up(
        &mut self,
        excluded: &[Exclusion],
        rate_limited_until: Option<Millis>,
        now: Millis,
    ) -> Next {
        if self.held {
            return Next::Answer(Answer::PassThrough);
        }
        if self.transport > 0 {
            let code = if self.timeouts == self.transport {
                ErrorCode::UpstreamTimeout
            } else {
                ErrorCode::UpstreamUnavailable
            };
            return Next::Answer(Answer::Refuse(Refusal {
                with_attempts: true,
                ..Refusal::new(code)
            }));
        }
        if let (Some(model), false) = (self.limits.fallback, self.on_fallback) {
            self.on_fallback = true;
            self.tried = Tried::default();
            self.relocated = false;
            return Next::Fallback { model };
        }
        let refusal = if let Some(until) = rate_limited_until {
            Refusal {
                reset_at: Some(until),
                ..Refusal::new(ErrorCode::RateLimited).retry_in(retry_after_secs(until, now))
            }
        } else if let Some(until) = soonest_timer(excluded) {
            Refusal::new(ErrorCode::AllTargetsCoolingDown).retry_in(retry_after_secs(until, now))
        } else {
            Refusal::new(ErrorCode::NoExecutableTargets)
        };
        Next::Answer(Answer::Refuse(Refusal {
            excluded: excluded.to_vec(),
            ..refusal
        }))
    }
}

/// What holds each candidate back, as the combo wait sees it.
fn blockers(excluded: &[Exclusion]) -> Vec<Blocker> {
    excluded
        .iter()
        .map(|e| Blocker {
            hold: match e.reason {
                ExclusionReason::ConnectionCooldown => Hold::Cooldown,
                ExclusionReason::ModelLockout => Hold::Lockout,
                ExclusionReason::CircuitOpen | ExclusionReason::ProviderCooldown => {
                    Hold::ProviderGate
                }
                ExclusionReason::AlreadyTried => Hold::Tried,
                ExclusionReason::Terminal
                | ExclusionReason::LeaseHeld
                | ExclusionReason::ConcurrencyFull => Hold::Other,
            },
            cause: e.cause,
            until: e.until,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Reason;

    const T0: Millis = 1_700_000_000_000;
    const SEC: Millis = 1_000;

    fn limits() -> Limits {
        Limits {
            max_attempts: 3,
            combo: ComboWait {
                enabled: true,
                max_wait: Duration::from_secs(60),
                max_attempts: 2,
                budget: Duration::from_secs(90),
            },
            model_cooldown_wait: true,
            queue_wait: Duration::from_secs(30),
            fail_open: true,
            deadline: T0 + 600 * SEC,
            reserve: Duration::from_secs(1),
            has_lease: false,
            fallback: None,
        }
    }

    fn with(f: impl FnOnce(&mut Limits)) -> Failover {
        let mut l = limits();
        f(&mut l);
        Failover::new(l)
    }

    fn pick(provider: usize, connection: usize) -> Pick {
        Pick {
            target: provider,
            provider,
            connection,
        }
    }

    fn ex(reason: ExclusionReason, cause: Option<Reason>, in_ms: Option<u64>) -> Exclusion {
        Exclusion {
            provider: "p".into(),
            connection: "c".into(),
            model: "m".into(),
            reason,
            until: in_ms.map(|m| T0 + m),
            detail: None,
            cause,
        }
    }

    fn cooling(cause: Reason, in_ms: u64) -> Exclusion {
        ex(
            ExclusionReason::ConnectionCooldown,
            Some(cause),
            Some(in_ms),
        )
    }

    fn refusal(next: Next) -> Refusal {
        match next {
            Next::Answer(Answer::Refuse(r)) => r,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    fn attempt(f: &mut Failover, p: Pick) {
        assert_eq!(f.on_offer(Offer::Picked(p), T0), Next::Attempt(p));
    }

    #[test]
    fn attempts_fail_over_by_scope_until_max_attempts() {
        let mut f = Failover::new(limits());
        attempt(&mut f, pick(0, 0));
        let refused = |p, scope| Ended::Refused {
            pick: p,
            retryable: true,
            scope,
        };
        assert_eq!(
            f.on_ended(refused(pick(0, 0), Scope::Connection), T0),
            Next::Select
        );
        attempt(&mut f, pick(1, 0));
        assert_eq!(
            f.on_ended(refused(pick(1, 0), Scope::Provider), T0),
            Next::Select
        );
        attempt(&mut f, pick(2, 1));
        assert!(f.is_last_attempt());
        assert_eq!(
            f.tried(),
            &Tried {
                connections: vec![(0, 0)],
                providers: vec![1],
                targets: vec![],
            }
        );
        // The third failure is the last: the held upstream error goes to the client.
        assert_eq!(
            f.on_ended(refused(pick(2, 1), Scope::Model), T0),
            Next::Answer(Answer::PassThrough)
        );
        assert_eq!(f.tried().targets, vec![2]);
        assert_eq!(f.attempts(), 3);
    }

    #[test]
    fn a_non_retryable_error_is_passed_through_at_once() {
        let mut f = Failover::new(limits());
        attempt(&mut f, pick(0, 0));
        let end = Ended::Refused {
            pick: pick(0, 0),
            retryable: false,
            scope: Scope::Request,
        };
        assert_eq!(f.on_ended(end, T0), Next::Answer(Answer::PassThrough));
    }

    #[test]
    fn hung_attempts_give_504_and_other_transport_failures_502() {
        let run = |timeouts: [bool; 2]| {
            let mut f = with(|l| l.max_attempts = 2);
            for (i, timed_out) in timeouts.into_iter().enumerate() {
                attempt(&mut f, pick(i, 0));
                let next = f.on_ended(
                    Ended::Transport {
                        pick: pick(i, 0),
                        timed_out,
                    },
                    T0,
                );
                if i == 0 {
                    assert_eq!(next, Next::Select);
                    assert_eq!(f.tried().providers, vec![0]);
                } else {
                    return refusal(next);
                }
            }
            unreachable!()
        };
        let r = run([true, true]);
        assert_eq!(r.code, ErrorCode::UpstreamTimeout);
        assert!(r.with_attempts);
        assert_eq!(run([true, false]).code, ErrorCode::UpstreamUnavailable);
        assert_eq!(run([false, false]).code, ErrorCode::UpstreamUnavailable);
    }

    #[test]
    fn an_upstream_error_wins_over_later_transport_failures() {
        let mut f = Failover::new(limits());
        attempt(&mut f, pick(0, 0));
        let refused = Ended::Refused {
            pick: pick(0, 0),
            retryable: true,
            scope: Scope::Connection,
        };
        assert_eq!(f.on_ended(refused, T0), Next::Select);
        attempt(&mut f, pick(1, 0));
        let hung = Ended::Transport {
            pick: pick(1, 0),
            timed_out: true,
        };
        assert_eq!(f.on_ended(hung, T0), Next::Select);
        let tried = [ex(ExclusionReason::AlreadyTried, None, None)];
        assert_eq!(
            f.on_offer(Offer::Empty(&tried), T0),
            Next::Answer(Answer::PassThrough)
        );
    }

    /// §5.8 budget: a timer ending past the execution budget is never waited on.
    #[test]
    fn budget_a_timer_past_the_deadline_is_answered_at_once() {
        // 8 s budget, a 30 s rate limit on every target → 429 at once.
        let mut f = with(|l| l.deadline = T0 + 8 * SEC);
        let list = [
            cooling(Reason::RateLimitExceeded, 30 * SEC),
            cooling(Reason::RateLimitExceeded, 31 * SEC),
        ];
        let r = refusal(f.on_offer(Offer::Empty(&list), T0));
        assert_eq!(r.code, ErrorCode::RateLimited);
        assert_eq!(r.retry_after, Some(30));
        assert_eq!(r.reset_at, Some(T0 + 30 * SEC));
        assert_eq!(r.excluded.len(), 2);
        // A timer that leaves the attempt its reserve is waited for.
        let mut f = with(|l| l.deadline = T0 + 8 * SEC);
        let list = [cooling(Reason::RateLimitExceeded, 7 * SEC)];
        assert_eq!(
            f.on_offer(Offer::Empty(&list), T0),
            Next::Wait {
                until: T0 + 7 * SEC
            }
        );
        // One that eats into the reserve is not.
        let mut f = with(|l| l.deadline = T0 + 8 * SEC);
        let list = [cooling(Reason::RateLimitExceeded, 7 * SEC + 1)];
        assert_eq!(
            refusal(f.on_offer(Offer::Empty(&list), T0)).code,
            ErrorCode::RateLimited
        );
    }

    /// §5.8 breaker: open breakers and window gates are never waited on; the 503 carries
    /// the soonest half-open time.
    #[test]
    fn breaker_open_providers_get_503_with_the_half_open_time() {
        let mut f = Failover::new(limits());
        let list = [
            ex(
                ExclusionReason::CircuitOpen,
                Some(Reason::ServerError),
                Some(15 * SEC),
            ),
            ex(
                ExclusionReason::CircuitOpen,
                Some(Reason::ServerError),
                Some(4_200),
            ),
            ex(
                ExclusionReason::ProviderCooldown,
                Some(Reason::ServerError),
                Some(60 * SEC),
            ),
        ];
        let r = refusal(f.on_offer(Offer::Empty(&list), T0));
        assert_eq!(r.code, ErrorCode::AllTargetsCoolingDown);
        assert_eq!(r.retry_after, Some(5));
        assert_eq!(r.excluded, list.to_vec());
        // Not even when a rate limit elsewhere would lift sooner.
        let mut f = Failover::new(limits());
        let mixed = [
            ex(
                ExclusionReason::CircuitOpen,
                Some(Reason::ServerError),
                Some(2 * SEC),
            ),
            cooling(Reason::RateLimitExceeded, SEC),
        ];
        let r = refusal(f.on_offer(Offer::Empty(&mixed), T0));
        assert_eq!(r.code, ErrorCode::AllTargetsCoolingDown);
        assert_eq!(r.retry_after, Some(1));
    }

    /// §5.8 quota: an exhausted quota is never waited on (answered as a rate limit).
    #[test]
    fn quota_exhausted_is_never_waited_on() {
        let mut f = Failover::new(limits());
        let list = [cooling(Reason::QuotaExhausted, 2 * SEC)];
        let r = refusal(f.on_offer(Offer::Empty(&list), T0));
        assert_eq!(r.code, ErrorCode::RateLimited);
        assert_eq!(r.retry_after, Some(2));
    }

    /// §5.8 terminal: no timer lifts a terminal state; with nothing else, 404.
    #[test]
    fn terminal_connections_are_not_waited_on() {
        let mut f = Failover::new(limits());
        let all_terminal = [
            ex(ExclusionReason::Terminal, Some(Reason::Banned), None),
            ex(
                ExclusionReason::Terminal,
                Some(Reason::CreditsExhausted),
                None,
            ),
        ];
        let r = refusal(f.on_offer(Offer::Empty(&all_terminal), T0));
        assert_eq!(r.code, ErrorCode::NoExecutableTargets);
        assert_eq!(r.retry_after, None);
        // A terminal target next to a short cooldown: no wait, 503 with the cooldown.
        let mut f = Failover::new(limits());
        let mixed = [
            ex(ExclusionReason::Terminal, Some(Reason::Banned), None),
            cooling(Reason::RateLimitExceeded, 3 * SEC),
        ];
        let r = refusal(f.on_offer(Offer::Empty(&mixed), T0));
        assert_eq!(r.code, ErrorCode::RateLimited);
        assert_eq!(r.retry_after, Some(3));
    }

    /// §5.8 not found, auth: never waited on.
    #[test]
    fn not_found_and_auth_reasons_are_not_waited_on() {
        for (reason, cause) in [
            (ExclusionReason::ModelLockout, Reason::NotFound),
            (ExclusionReason::ConnectionCooldown, Reason::AuthError),
        ] {
            let mut f = Failover::new(limits());
            let list = [ex(reason, Some(cause), Some(2 * SEC))];
            let r = refusal(f.on_offer(Offer::Empty(&list), T0));
            assert_eq!(r.code, ErrorCode::AllTargetsCoolingDown, "{cause:?}");
            assert_eq!(r.retry_after, Some(2));
        }
    }

    /// §5.8 max_attempts (of waits) and the total budget of waits.
    #[test]
    fn combo_waits_are_bounded_in_number_and_in_total() {
        let mut f = Failover::new(limits());
        let short = [cooling(Reason::RateLimitExceeded, 2 * SEC)];
        let t1 = T0;
        assert!(matches!(
            f.on_offer(Offer::Empty(&short), t1),
            Next::Wait { .. }
        ));
        let t2 = t1 + 2 * SEC;
        let again = [ex(
            ExclusionReason::ConnectionCooldown,
            Some(Reason::RateLimitExceeded),
            Some(4 * SEC),
        )];
        assert!(matches!(
            f.on_offer(Offer::Empty(&again), t2),
            Next::Wait { .. }
        ));
        // The third wait is one too many (`combo_wait.max_attempts: 2`).
        let r = refusal(f.on_offer(Offer::Empty(&again), t2 + 2 * SEC));
        assert_eq!(r.code, ErrorCode::RateLimited);

        // 50 s + 50 s exceeds the 90 s total budget.
        let mut f = Failover::new(limits());
        let long = [cooling(Reason::RateLimitExceeded, 50 * SEC)];
        assert_eq!(
            f.on_offer(Offer::Empty(&long), T0),
            Next::Wait {
                until: T0 + 50 * SEC
            }
        );
        let t = T0 + 50 * SEC;
        let long2 = [ex(
            ExclusionReason::ConnectionCooldown,
            Some(Reason::RateLimitExceeded),
            Some(100 * SEC),
        )];
        assert_eq!(
            refusal(f.on_offer(Offer::Empty(&long2), t)).code,
            ErrorCode::RateLimited
        );
    }

    #[test]
    fn a_combo_wait_forgets_connections_that_were_only_cooling() {
        let mut f = Failover::new(limits());
        attempt(&mut f, pick(0, 0));
        let end = Ended::Refused {
            pick: pick(0, 0),
            retryable: true,
            scope: Scope::Connection,
        };
        assert_eq!(f.on_ended(end, T0), Next::Select);
        let short = [cooling(Reason::RateLimitExceeded, 2 * SEC)];
        assert!(matches!(
            f.on_offer(Offer::Empty(&short), T0),
            Next::Wait { .. }
        ));
        assert!(f.tried().connections.is_empty());
    }

    #[test]
    fn queue_waits_are_bounded_by_queue_wait_and_by_the_budget() {
        let mut f = Failover::new(limits());
        assert_eq!(
            f.on_offer(Offer::Full, T0),
            Next::Queue {
                until: T0 + 30 * SEC,
                fail_open: true
            }
        );
        // The budget binds first: wait at most half of what is left before the
        // reserve, then still fail open (the attempt keeps the other half).
        let mut f = with(|l| l.deadline = T0 + 10 * SEC);
        assert_eq!(
            f.on_offer(Offer::Full, T0),
            Next::Queue {
                until: T0 + 4_500,
                fail_open: true
            }
        );
        // No budget left for a wait: 503 at once.
        let mut f = with(|l| l.deadline = T0 + 500);
        let r = refusal(f.on_offer(Offer::Full, T0));
        assert_eq!(r.code, ErrorCode::QueueTimeout);
        assert_eq!(r.retry_after, Some(1));
        let mut f = with(|l| l.fail_open = false);
        assert_eq!(
            f.on_offer(Offer::Full, T0),
            Next::Queue {
                until: T0 + 30 * SEC,
                fail_open: false
            }
        );
    }

    #[test]
    fn queue_outcomes() {
        let mut f = Failover::new(limits());
        assert_eq!(
            f.on_queued(Queued::Got(pick(0, 0)), T0),
            Next::Attempt(pick(0, 0))
        );
        assert_eq!(f.attempts(), 1);
        assert_eq!(
            f.on_queued(Queued::BreakerDenied { provider: 4 }, T0),
            Next::Select
        );
        assert_eq!(f.tried().providers, vec![4]);
        for _ in 0..MAX_REQUEUES {
            assert_eq!(f.on_queued(Queued::NotRunnable, T0), Next::Select);
        }
        let r = refusal(f.on_queued(Queued::NotRunnable, T0));
        assert_eq!(r.code, ErrorCode::QueueTimeout);
        let r = refusal(f.on_queued(Queued::Full, T0));
        assert_eq!((r.code, r.retry_after), (ErrorCode::QueueFull, Some(1)));
        let r = refusal(f.on_queued(Queued::TimedOut, T0));
        assert_eq!(r.code, ErrorCode::QueueTimeout);
    }

    #[test]
    fn a_month_long_timer_is_told_as_a_day() {
        // A classification rule may cool a connection for 30 days; the client hears 24 h.
        let mut f = Failover::new(limits());
        let month = 30 * 86_400 * SEC;
        let r = refusal(f.on_offer(Offer::Empty(&[cooling(Reason::AuthError, month)]), T0));
        assert_eq!(r.code, ErrorCode::AllTargetsCoolingDown);
        assert_eq!(r.retry_after, Some(86_400));
    }

    #[test]
    fn a_queue_refusal_never_hides_what_earlier_attempts_earned() {
        // An upstream error held from attempt 1 is passed through, not a queue error.
        let mut f = Failover::new(limits());
        attempt(&mut f, pick(0, 0));
        let refused = Ended::Refused {
            pick: pick(0, 0),
            retryable: true,
            scope: Scope::Provider,
        };
        assert_eq!(f.on_ended(refused, T0), Next::Select);
        assert_eq!(
            f.on_queued(Queued::TimedOut, T0),
            Next::Answer(Answer::PassThrough)
        );
        // A hung attempt 1 then a full queue: 504 upstream_timeout with the attempts.
        let mut f = Failover::new(limits());
        attempt(&mut f, pick(0, 0));
        let hung = Ended::Transport {
            pick: pick(0, 0),
            timed_out: true,
        };
        assert_eq!(f.on_ended(hung, T0), Next::Select);
        let r = refusal(f.on_queued(Queued::Full, T0));
        assert_eq!(r.code, ErrorCode::UpstreamTimeout);
        assert!(r.with_attempts);
    }

    #[test]
    fn leases_relocate_once_and_contention_is_429() {
        let mut f = with(|l| l.has_lease = true);
        let cool = [cooling(Reason::AuthError, 5 * SEC)];
        assert_eq!(f.on_offer(Offer::Empty(&cool), T0), Next::RelocateLease);
        assert_eq!(f.on_lease_relocated(), Next::Select);
        let r = refusal(f.on_offer(Offer::Empty(&cool), T0));
        assert_eq!(r.code, ErrorCode::AllTargetsCoolingDown);

        // Eligible connections exist but every free one is leased by someone else.
        let mut f = Failover::new(limits());
        let leased = [
            ex(ExclusionReason::LeaseHeld, None, Some(40 * SEC)),
            ex(ExclusionReason::LeaseHeld, None, Some(20 * SEC)),
            cooling(Reason::RateLimitExceeded, SEC),
        ];
        let r = refusal(f.on_offer(Offer::Empty(&leased), T0));
        assert_eq!(r.code, ErrorCode::LeaseCapacityUnavailable);
        assert_eq!(r.retry_after, Some(20));
    }

    #[test]
    fn the_emergency_fallback_is_tried_once_when_nothing_ran() {
        let mut f = with(|l| l.fallback = Some(7));
        let terminal = [ex(ExclusionReason::Terminal, Some(Reason::Banned), None)];
        assert_eq!(
            f.on_offer(Offer::Empty(&terminal), T0),
            Next::Fallback { model: 7 }
        );
        let r = refusal(f.on_offer(Offer::Empty(&terminal), T0));
        assert_eq!(r.code, ErrorCode::NoExecutableTargets);
        // Not after an attempt has failed: its error is the answer.
        let mut f = with(|l| l.fallback = Some(7));
        attempt(&mut f, pick(0, 0));
        let end = Ended::Refused {
            pick: pick(0, 0),
            retryable: true,
            scope: Scope::Connection,
        };
        assert_eq!(f.on_ended(end, T0), Next::Select);
        assert_eq!(
            f.on_offer(Offer::Empty(&terminal), T0),
            Next::Answer(Answer::PassThrough)
        );
    }

    #[test]
    fn the_deadline_ends_attempts_with_504_and_commits_end_the_loop() {
        let mut f = Failover::new(limits());
        attempt(&mut f, pick(0, 0));
        let r = refusal(f.on_ended(Ended::Deadline, T0));
        assert_eq!(r.code, ErrorCode::ExecutionTimeout);
        assert!(r.with_attempts);
        // No new attempt starts once the budget is spent.
        let mut f = with(|l| l.deadline = T0);
        let r = refusal(f.on_offer(Offer::Picked(pick(0, 0)), T0));
        assert_eq!(r.code, ErrorCode::ExecutionTimeout);
        assert_eq!(f.attempts(), 0);
        let mut f = Failover::new(limits());
        attempt(&mut f, pick(0, 0));
        assert_eq!(
            f.on_ended(Ended::Committed, T0),
            Next::Answer(Answer::Committed)
        );
        assert_eq!(
            f.on_ended(Ended::ClientGone, T0),
            Next::Answer(Answer::ClientGone)
        );
        assert_eq!(f.remaining(T0 + 100 * SEC), Duration::from_secs(500));
        assert_eq!(f.remaining(T0 + 700 * SEC), Duration::ZERO);
    }

    #[test]
    fn the_reserve_is_a_second_or_a_quarter_of_a_short_budget() {
        assert_eq!(
            Limits::reserve_for(Duration::from_secs(600)),
            Duration::from_secs(1)
        );
        assert_eq!(
            Limits::reserve_for(Duration::from_millis(300)),
            Duration::from_millis(75)
        );
    }
}
