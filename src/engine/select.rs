//! The select phase: candidates (targets × connections), each excluded one with a
//! reason and its remaining time, then the strategy's pick, the concurrency permit and
//! the breaker permit.
//!
//! Reads are lazy (`peek`, `eligibility`, `active`): nothing here needs a timer to make
//! a provider or connection eligible again. Exclusions are checked from the most
//! permanent fact to the most transient: a terminal connection, then the provider's
//! gates (breaker, window gate — reported even when the connection is also cooling, so
//! the combo wait never mistakes a failing provider for a rate limit), then the later
//! of the connection cooldown and a model lockout, then the session layers (a foreign
//! lease), then capacity (no free permit): so `lease_held` and `concurrency_full` only
//! ever mark candidates that are otherwise runnable, which is what lease contention
//! and queueing need to know. Only the chosen provider's
//! breaker is asked for a real permit, so a HALF_OPEN provider hands out one probe.

use super::permits::Limits;
use super::state::lock;
use super::{Engine, Snapshot, Tried};
use crate::config::{Client, Config, Family, Model};
use crate::policy::breaker::{BreakerConfig, BreakerState, Permit};
use crate::policy::cooldown::Eligibility;
pub use crate::policy::exclusion::{Exclusion, ExclusionReason};
use crate::policy::lease::LeaseTable;
use crate::policy::{Millis, Reason};
use crate::routing::View;

/// One (target, connection) pair that passed the resilience checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub target: usize,
    pub provider: usize,
    pub connection: usize,
    pub breaker: BreakerState,
}

/// The candidate list of one model for one request.
#[derive(Debug, Default)]
pub struct Evaluation {
    /// Runnable now (a permit is free).
    pub runnable: Vec<Candidate>,
    /// Runnable but at their concurrency cap: a request may wait for them.
    pub full: Vec<Candidate>,
    pub excluded: Vec<Exclusion>,
}

/// Who is asking: the client key, its lease (if it presented one) and what this request
/// already tried.
pub struct Asker<'a> {
    pub client: Option<&'a Client>,
    /// (owner hash, leased connection `provider/connection`).
    pub lease: Option<(&'a str, &'a str)>,
    pub tried: &'a Tried,
}

pub fn breaker_config(snap: &Snapshot, provider: usize) -> BreakerConfig {
    let c = &snap.config;
    let p = &c.providers[provider];
    BreakerConfig::from_class(
        c.resilience.breaker.get(p.class),
        c.resilience.max_backoff_multiplier,
    )
}

/// Model names a lockout may be recorded under for a target: the exact model, its bare
/// name and its quota family (computed once per snapshot: `Snapshot::lock_names`).
pub fn lock_names_of(c: &Config, m: &Model, target: usize) -> Vec<String> {
    let t = &m.targets[target];
    let mut names = vec![t.model.clone()];
    let bare = crate::policy::lockout::bare_model(&t.model);
    if bare != t.model {
        names.push(bare.to_string());
    }
    if let Some(f) = t
        .quota_family
        .as_ref()
        .or(c.providers[t.provider].quota_family.as_ref())
    {
        names.push(f.clone());
    }
    names
}

/// The concurrency limits of one candidate (resolved once per generation).
pub fn limits<'s>(engine: &Engine, snap: &'s Snapshot, model: usize, c: &Candidate) -> &'s Limits {
    snap.limits(&engine.permits, model, c.target, c.connection)
}

/// A target's provider-level facts, read once per target and evaluation.
pub(super) struct Gate<'s> {
    /// The breaker's answer without taking a permit.
    permit: Permit,
    pub(super) state: BreakerState,
    /// The provider window gate's end, when the gate is on and cooling.
    window_until: Option<Millis>,
    names: &'s [String],
}

/// The gate of `model`'s target `ti`, or `None` when its provider does not speak `family`.
pub(super) fn gate<'s>(
    engine: &Engine,
    snap: &'s Snapshot,
    model: usize,
    ti: usize,
    family: Family,
    now: Millis,
) -> Option<Gate<'s>> {
    let cfg = &snap.config;
    let t = &cfg.models[model].targets[ti];
    let p = &cfg.providers[t.provider];
    if p.api != family {
        return None;
    }
    let bcfg = breaker_config(snap, t.provider);
    let (permit, state, window_until) = {
        let e = lock(snap.provider_entry(&engine.tables, t.provider));
        (
            e.breaker.peek(&bcfg, now),
            e.breaker.state(&bcfg, now),
            e.window.cooling_until(now),
        )
    };
    Some(Gate {
        permit,
        state,
        window_until: window_until.filter(|_| cfg.resilience.provider_cooldown_enabled),
        names: snap.lock_names(model, ti),
    })
}

/// The verdict on one (target, connection) for one asker.
pub(super) enum Check {
    /// Not offered to this asker (pinned target, client scope, another lease).
    Skip,
    Runnable(Candidate),
    /// Runnable but at its concurrency cap.
    Full(Candidate),
    Excluded {
        reason: ExclusionReason,
        until: Option<Millis>,
        detail: Option<&'static str>,
        cause: Option<Reason>,
    },
}

/// What the select phase reads from the engine for every check of one evaluation.
pub(super) struct Ctx<'a> {
    pub(super) engine: &'a Engine,
    pub(super) snap: &'a Snapshot,
    pub(super) model: usize,
    pub(super) asker: &'a Asker<'a>,
    pub(super) leases: &'a LeaseTable,
    pub(super) now: Millis,
}

impl Ctx<'_> {
    /// Checks one candidate, from the most permanent fact to the most transient (see the
    /// module note). `gate` is its target's.
    pub(super) fn check(&self, ti: usize, ci: usize, gate: &Gate<'_>) -> Check {
        let (snap, now) = (self.snap, self.now);
        let cfg = &snap.config;
        let t = &cfg.models[self.model].targets[ti];
        let p = &cfg.providers[t.provider];
        let c = &p.connections[ci];
        if t.connection.is_some_and(|pin| pin != ci)
            || !super::client_allows(self.asker.client, &p.id, &c.id)
        {
            return Check::Skip;
        }
        let key = snap.conn_key(t.provider, ci);
        if self.asker.lease.is_some_and(|(_, leased)| leased != key) {
            return Check::Skip;
        }
        let excluded = |reason, until, detail, cause| Check::Excluded {
            reason,
            until,
            detail,
            cause,
        };
        let tried = self.asker.tried;
        // A provider-level failure in this request is not undone by waiting.
        if tried.providers.contains(&t.provider) {
            return excluded(ExclusionReason::AlreadyTried, None, None, None);
        }
        let tables = &self.engine.tables;
        let (eligibility, cause) = {
            let e = lock(snap.conn_entry(tables, t.provider, ci));
            (e.state.eligibility(now), e.state.last_error_reason)
        };
        let cooling = match eligibility {
            Eligibility::Terminal(s) => {
                return excluded(ExclusionReason::Terminal, None, Some(s.as_str()), cause)
            }
            Eligibility::Cooling { until } => {
                Some((ExclusionReason::ConnectionCooldown, until, cause))
            }
            Eligibility::Eligible => None,
        };
        let locked = if cfg.resilience.model_lockout.enabled {
            tables
                .active_lockout(&p.id, &c.id, gate.names, now)
                .map(|(until, cause)| (ExclusionReason::ModelLockout, until, cause))
        } else {
            None
        };
        // Both timers hold the candidate: it comes back when the later one ends.
        let timer = match (cooling, locked) {
            (Some(a), Some(b)) => Some(if b.1 > a.1 { b } else { a }),
            (a, b) => a.or(b),
        };
        // A failing provider is reported as such even when its connection is also
        // cooling: a breaker or window gate is never a timer to wait out (§5.8). Its
        // time is the later of the gate's and the connection's own timer.
        let shut = match (gate.permit, gate.window_until) {
            (Permit::Deny { retry_at }, _) => Some((ExclusionReason::CircuitOpen, retry_at)),
            (_, Some(until)) => Some((ExclusionReason::ProviderCooldown, until)),
            _ => None,
        };
        if let Some((reason, until)) = shut {
            let until = timer.map_or(until, |t| until.max(t.1));
            return excluded(reason, Some(until), None, Some(Reason::ServerError));
        }
        if let Some((reason, until, cause)) = timer {
            return excluded(reason, Some(until), None, cause);
        }
        if tried.connections.contains(&(t.provider, ci)) || tried.targets.contains(&ti) {
            return excluded(ExclusionReason::AlreadyTried, None, None, None);
        }
        let owner = self.asker.lease.map(|(h, _)| h);
        if let Some(until) = self.leases.held_by_other(key, owner, now) {
            return excluded(ExclusionReason::LeaseHeld, Some(until), None, None);
        }
        let cand = Candidate {
            target: ti,
            provider: t.provider,
            connection: ci,
            breaker: gate.state,
        };
        if snap
            .limits(&self.engine.permits, self.model, ti, ci)
            .has_free()
        {
            Check::Runnable(cand)
        } else {
            Check::Full(cand)
        }
    }
}

/// Evaluates every (target, connection) of `model` that the asker may use. A timer
/// exclusion is reported even for a candidate this request already tried: it tells the
/// combo wait when the candidate comes back.
pub fn evaluate(
    engine: &Engine,
    snap: &Snapshot,
    model: usize,
    family: Family,
    asker: &Asker<'_>,
    now: Millis,
) -> Evaluation {
    let leases = engine.leases.lock();
    let ctx = Ctx {
        engine,
        snap,
        model,
        asker,
        leases: &leases,
        now,
    };
    let cfg = &snap.config;
    let m = &cfg.models[model];
    let mut out = Evaluation::default();
    for (ti, t) in m.targets.iter().enumerate() {
        let Some(gate) = gate(engine, snap, model, ti, family, now) else {
            continue;
        };
        let p = &cfg.providers[t.provider];
        for ci in 0..p.connections.len() {
            let exclusion = |reason, until, detail, cause| Exclusion {
                provider: p.id.clone(),
                connection: p.connections[ci].id.clone(),
                model: t.model.clone(),
                reason,
                until,
                detail,
                cause,
            };
            match ctx.check(ti, ci, &gate) {
                Check::Skip => {}
                Check::Runnable(c) => out.runnable.push(c),
                Check::Full(c) => {
                    out.excluded.push(exclusion(
                        ExclusionReason::ConcurrencyFull,
                        None,
                        None,
                        None,
                    ));
                    out.full.push(c);
                }
                Check::Excluded {
                    reason,
                    until,
                    detail,
                    cause,
                } => out.excluded.push(exclusion(reason, until, detail, cause)),
            }
        }
    }
    out
}

/// What each strategy sees of a candidate.
pub fn views(
    engine: &Engine,
    snap: &Snapshot,
    model: usize,
    cands: &[Candidate],
    now: Millis,
) -> Vec<View> {
    let cfg = &snap.config;
    let signals = lock(&engine.signals);
    cands
        .iter()
        .map(|c| {
            let t = &cfg.models[model].targets[c.target];
            let p = &cfg.providers[c.provider];
            let conn = &p.connections[c.connection];
            let key = snap.conn_key(c.provider, c.connection);
            let s = signals.get(key);
            let limits = limits(engine, snap, model, c);
            View {
                target: c.target,
                connection: c.connection,
                weight: t.weight,
                cost: t.cost,
                inflight: limits.inflight(),
                cap: conn.max_concurrent,
                latency_ms: s.and_then(|s| s.latency.mean(now)),
                remaining: s
                    .and_then(|s| s.rate)
                    .and_then(|r| r.current(now).remaining),
                reset_at: s.and_then(|s| s.rate).and_then(|r| r.current(now).reset_at),
                degraded: c.breaker == BreakerState::Degraded,
            }
        })
        .collect()
}

/// The strategy's pick among `cands`.
pub fn pick(
    engine: &Engine,
    snap: &Snapshot,
    model: usize,
    cands: &[Candidate],
    now: Millis,
) -> Option<Candidate> {
    let m = &snap.config.models[model];
    let v = views(engine, snap, model, cands, now);
    let random: (f64, f64) = (rand::random(), rand::random());
    let i = lock(&snap.routing[model]).pick_view(m.strategy, &v, random, m.p2c_latency_weight)?;
    cands.get(i).copied()
}

/// `cands` in the order the strategy would try them if each attempt failed: picked one
/// after another on a copy of the model's routing state, so a dry run (the explain
/// endpoint) neither advances rotations nor counts as traffic. For `random` and `p2c`
/// this is one sample of that order.
pub fn ranked(
    engine: &Engine,
    snap: &Snapshot,
    model: usize,
    cands: &[Candidate],
    now: Millis,
) -> Vec<Candidate> {
    let m = &snap.config.models[model];
    let mut routing = lock(&snap.routing[model]).clone();
    let mut left: Vec<Candidate> = cands.to_vec();
    let mut out = Vec::with_capacity(left.len());
    while !left.is_empty() {
        let v = views(engine, snap, model, &left, now);
        let random: (f64, f64) = (rand::random(), rand::random());
        let i = routing
            .pick_view(m.strategy, &v, random, m.p2c_latency_weight)
            .unwrap_or(0)
            .min(left.len() - 1);
        out.push(left.remove(i));
    }
    out
}
