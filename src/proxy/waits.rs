//! The waits of the select phase and the answers when nothing can run (SPEC §4, §5.6,
//! §5.7, §5.8): queue admission and the FIFO wait for a concurrency permit, the combo
//! cooldown-aware wait, lease contention, and the 429/503/404 diagnostics.
//!
//! Every wait is bounded and races the client; a client that leaves ends the wait.

use super::attempt::{race, Wait};
use super::dispatch::{finish_error, Request};
use super::RequestCtx;
use crate::codes::ErrorCode;
use crate::engine::permits::PermitGuard;
use crate::engine::select::{self, Candidate, Exclusion, ExclusionReason};
use crate::engine::Engine;
use crate::error::ClientError;
use crate::policy::combo::{self, Blocker, Decision, Hold};
use crate::policy::timefmt::format_rfc3339;
use crate::policy::{retry_after_secs, Millis};
use futures::future::select_all;
use pingora::proxy::Session;
use serde_json::json;
use std::time::Duration;

pub enum QueueOutcome {
    Got(Candidate, PermitGuard),
    /// `queue.fail_open`: the wait timed out, go without a permit.
    FailOpen(Candidate, PermitGuard),
    Full,
    TimedOut,
    ClientGone,
}

/// Waits (FIFO) for the first free permit among `full`, up to `queue.wait`; rejects at
/// once when every one of them already has `queue.max_depth` waiters.
pub async fn wait_for_permit(
    session: &mut Session,
    r: &Request<'_>,
    full: &[Candidate],
    watching: &mut bool,
) -> QueueOutcome {
    let q = &r.snap.config.resilience.queue;
    let permits = &r.engine.permits;
    let limits: Vec<_> = full
        .iter()
        .map(|c| select::limits(r.snap, r.model, c))
        .collect();
    if q.max_depth > 0
        && limits
            .iter()
            .all(|l| permits.waiting(&l.conn_key) >= q.max_depth)
    {
        return QueueOutcome::Full;
    }
    let mut keys: Vec<&str> = limits.iter().map(|l| l.conn_key.as_str()).collect();
    keys.sort_unstable();
    keys.dedup();
    let _waiting: Vec<_> = keys.iter().map(|k| permits.wait_on(k)).collect();
    let waits = limits
        .iter()
        .enumerate()
        .map(|(i, l)| Box::pin(async move { (i, permits.acquire(l).await) }));
    let outcome = match race(session, watching, q.wait, select_all(waits)).await {
        Wait::Ready(((i, got), _, _)) => Wait::Ready((i, got)),
        Wait::TimedOut => Wait::TimedOut,
        Wait::ClientGone => Wait::ClientGone,
    };
    match outcome {
        Wait::Ready((i, Some(guard))) => QueueOutcome::Got(full[i], guard),
        Wait::Ready((i, None)) => QueueOutcome::FailOpen(full[i], permits.unlimited(&limits[i])),
        Wait::ClientGone => QueueOutcome::ClientGone,
        Wait::TimedOut if q.fail_open => {
            let now = r.engine.now();
            let c = select::pick(r.engine, r.snap, r.model, full, now).unwrap_or(full[0]);
            let guard = permits.unlimited(&select::limits(r.snap, r.model, &c));
            QueueOutcome::FailOpen(c, guard)
        }
        Wait::TimedOut => QueueOutcome::TimedOut,
    }
}

pub async fn queue_rejected(
    session: &mut Session,
    r: &Request<'_>,
    ctx: &mut RequestCtx,
    full: bool,
) -> pingora::Result<()> {
    let (code, reason, msg) = if full {
        (
            ErrorCode::QueueFull,
            "queue_full",
            "too many requests are already waiting for this model's connections",
        )
    } else {
        (
            ErrorCode::QueueTimeout,
            "queue_timeout",
            "no concurrency permit became free within queue.wait",
        )
    };
    r.engine
        .metrics
        .queue_rejections_total
        .with_label_values(&[reason])
        .inc();
    let mut e = ClientError::new(code, msg);
    e.retry_after = Some(1);
    finish_error(session, r.family, e, ctx).await
}

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
                _ => Hold::Other,
            },
            cause: e.cause,
            until: e.until,
        })
        .collect()
}

/// The combo wait's verdict for this request right now.
pub fn combo_decision(
    r: &Request<'_>,
    excluded: &[Exclusion],
    waits: u32,
    waited: Duration,
) -> Decision {
    let cfg = &r.snap.config;
    combo::decide(
        &cfg.resilience.combo_wait,
        cfg.models[r.model].cooldown_wait,
        &blockers(excluded),
        waits,
        waited,
        r.engine.now(),
    )
}

/// Sleeps `d` unless the client leaves first; returns false if it left.
pub async fn combo_sleep(session: &mut Session, watching: &mut bool, d: Duration) -> bool {
    !matches!(
        race(session, watching, d, std::future::pending::<()>()).await,
        Wait::ClientGone
    )
}

/// 429 `lease_capacity_unavailable` when eligible connections exist but every free one
/// is leased by someone else.
pub fn lease_contention(excluded: &[Exclusion], now: Millis) -> Option<ClientError> {
    let until = excluded
        .iter()
        .filter(|e| e.reason == ExclusionReason::LeaseHeld)
        .filter_map(|e| e.until)
        .min()?;
    let mut e = ClientError::new(
        ErrorCode::LeaseCapacityUnavailable,
        "every eligible connection is held by another session's exclusive lease",
    );
    e.retry_after = Some(retry_after_secs(until, now));
    Some(e)
}

/// No candidate could run: 429 `rate_limit_error` when every timer is a rate limit with
/// a known reset, 503 `all_targets_cooling_down` when other timers stand in the way,
/// else 404 `no_executable_targets`.
pub async fn nothing_runnable(
    session: &mut Session,
    r: &Request<'_>,
    excluded: &[Exclusion],
    rate_limited_until: Option<Millis>,
    ctx: &mut RequestCtx,
) -> pingora::Result<()> {
    let now = r.engine.now();
    let model = &r.snap.config.models[r.model].name;
    for e in excluded {
        tracing::warn!(
            model = %model,
            provider = %e.provider,
            connection = %e.connection,
            upstream_model = %e.model,
            reason = e.reason.as_str(),
            remaining_s = e.until.map(|u| retry_after_secs(u, now)).unwrap_or(0),
            "target excluded"
        );
    }
    let list: Vec<_> = excluded.iter().map(|e| e.json(now)).collect();
    let err = if let Some(until) = rate_limited_until {
        let secs = retry_after_secs(until, now);
        let mut e = ClientError::new(
            ErrorCode::RateLimited,
            format!("every target of model {model:?} is rate-limited; retry in {secs}s"),
        )
        .with_extra("retry_after_s", json!(secs))
        .with_extra("reset_at", json!(format_rfc3339(until)))
        .with_extra("diagnostics", json!({ "excluded": list }));
        e.retry_after = Some(secs);
        e
    } else if let Some(secs) = Engine::soonest(excluded, now) {
        let mut e = ClientError::new(
            ErrorCode::AllTargetsCoolingDown,
            format!("every target of model {model:?} is cooling down; retry in {secs}s"),
        )
        .with_extra("diagnostics", json!({ "excluded": list }));
        e.retry_after = Some(secs);
        e
    } else {
        ClientError::new(
            ErrorCode::NoExecutableTargets,
            format!("model {model:?} has no target that can run"),
        )
        .with_extra("diagnostics", json!({ "excluded": list }))
    };
    finish_error(session, r.family, err, ctx).await
}
