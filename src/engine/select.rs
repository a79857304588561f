//! The select phase: candidates (targets × connections), each excluded one with a
//! reason and its remaining time, then the strategy's pick and the breaker permit.
//!
//! Reads are lazy (`peek`, `eligibility`, `active`): nothing here needs a timer to make
//! a provider or connection eligible again. Only the chosen provider's breaker is asked
//! for a real permit, so a HALF_OPEN provider hands out exactly one probe; if another
//! request took it meanwhile, that provider is excluded and the pick is made again.

use super::state::{lock, Tables};
use super::{Snapshot, Tried};
use crate::config::{Client, Family, Strategy};
use crate::policy::breaker::{BreakerConfig, BreakerState, Permit};
use crate::policy::cooldown::Eligibility;
use crate::policy::{retry_after_secs, Millis};
use crate::routing::Offer;
use serde_json::{json, Value};

/// Why a candidate could not be used (SPEC §4 `diagnostics.excluded[].reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExclusionReason {
    CircuitOpen,
    ProviderCooldown,
    ConnectionCooldown,
    Terminal,
    ModelLockout,
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
            ExclusionReason::AlreadyTried => "already_tried",
        }
    }

    /// Exclusions that lift by themselves when a timer runs out.
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

#[derive(Clone, Debug, PartialEq)]
pub struct Exclusion {
    pub provider: String,
    pub connection: String,
    pub model: String,
    pub reason: ExclusionReason,
    /// When the exclusion lifts by itself (timers only).
    pub until: Option<Millis>,
    /// Terminal state name, for `terminal` exclusions.
    pub detail: Option<&'static str>,
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
        })
    }
}

/// One runnable (target, connection) pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub target: usize,
    pub provider: usize,
    pub connection: usize,
    pub breaker: BreakerState,
}

/// The candidate list of one model for one request, before the strategy runs.
pub struct Evaluation {
    pub candidates: Vec<Candidate>,
    pub excluded: Vec<Exclusion>,
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
/// name (without a `:variant` suffix) and its quota family.
pub fn lock_names(snap: &Snapshot, target: usize, model: usize) -> Vec<String> {
    let c = &snap.config;
    let t = &c.models[model].targets[target];
    let mut names = vec![t.model.clone()];
    if let Some((bare, _)) = t.model.split_once(':') {
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

/// Evaluates every (target, connection) of `model` that `client` may use.
pub fn evaluate(
    tables: &Tables,
    snap: &Snapshot,
    model: usize,
    family: Family,
    client: Option<&Client>,
    tried: &Tried,
    now: Millis,
) -> Evaluation {
    let cfg = &snap.config;
    let m = &cfg.models[model];
    let mut out = Evaluation {
        candidates: Vec::new(),
        excluded: Vec::new(),
    };
    for (ti, t) in m.targets.iter().enumerate() {
        let p = &cfg.providers[t.provider];
        if p.api != family {
            continue;
        }
        let bcfg = breaker_config(snap, t.provider);
        let (permit, bstate, window_until) = match tables.provider_if_any(&p.id) {
            Some(e) => {
                let e = lock(&e);
                (
                    e.breaker.peek(&bcfg, now),
                    e.breaker.state(&bcfg, now),
                    e.window.cooling_until(now),
                )
            }
            None => (Permit::Allow, BreakerState::Closed, None),
        };
        let window_until = window_until.filter(|_| cfg.resilience.provider_cooldown_enabled);
        let names = lock_names(snap, ti, model);
        let name_refs: Vec<&str> = names.iter().map(String::as_str).collect();
        for (ci, c) in p.connections.iter().enumerate() {
            if t.connection.is_some_and(|pin| pin != ci)
                || !super::client_allows(client, &p.id, &c.id)
            {
                continue;
            }
            let excluded = |reason, until, detail| Exclusion {
                provider: p.id.clone(),
                connection: c.id.clone(),
                model: t.model.clone(),
                reason,
                until,
                detail,
            };
            if tried.providers.contains(&t.provider)
                || tried.connections.contains(&(t.provider, ci))
                || tried.targets.contains(&ti)
            {
                out.excluded
                    .push(excluded(ExclusionReason::AlreadyTried, None, None));
                continue;
            }
            if let Some(e) = tables.connection_if_any(&p.id, &c.id) {
                match lock(&e).state.eligibility(now) {
                    Eligibility::Eligible => {}
                    Eligibility::Terminal(s) => {
                        out.excluded.push(excluded(
                            ExclusionReason::Terminal,
                            None,
                            Some(s.as_str()),
                        ));
                        continue;
                    }
                    Eligibility::Cooling { until } => {
                        out.excluded.push(excluded(
                            ExclusionReason::ConnectionCooldown,
                            Some(until),
                            None,
                        ));
                        continue;
                    }
                }
            }
            if let Permit::Deny { retry_at } = permit {
                out.excluded
                    .push(excluded(ExclusionReason::CircuitOpen, Some(retry_at), None));
                continue;
            }
            if let Some(until) = window_until {
                out.excluded.push(excluded(
                    ExclusionReason::ProviderCooldown,
                    Some(until),
                    None,
                ));
                continue;
            }
            if cfg.resilience.model_lockout.enabled {
                if let Some((_, until)) = tables.active_lockout(&p.id, &c.id, &name_refs, now) {
                    out.excluded
                        .push(excluded(ExclusionReason::ModelLockout, Some(until), None));
                    continue;
                }
            }
            out.candidates.push(Candidate {
                target: ti,
                provider: t.provider,
                connection: ci,
                breaker: bstate,
            });
        }
    }
    out
}

/// Strategy pick over evaluated candidates: targets first, then a connection inside
/// the chosen target. Strategies other than `priority` prefer providers that are not
/// DEGRADED when any such candidate exists.
pub fn pick(
    snap: &Snapshot,
    model: usize,
    candidates: &[Candidate],
    random: f64,
) -> Option<Candidate> {
    let m = &snap.config.models[model];
    let healthy_exists = candidates
        .iter()
        .any(|c| c.breaker != BreakerState::Degraded);
    let usable = |c: &&Candidate| {
        m.strategy == Strategy::Priority || !healthy_exists || c.breaker != BreakerState::Degraded
    };
    let mut offers: Vec<Offer> = Vec::new();
    for c in candidates.iter().filter(usable) {
        if !offers.iter().any(|o| o.target == c.target) {
            let t = &m.targets[c.target];
            offers.push(Offer {
                target: c.target,
                weight: t.weight,
                cost: t.cost,
            });
        }
    }
    let mut routing = lock(&snap.routing[model]);
    let target = routing.pick(m.strategy, &offers, random)?;
    let conns: Vec<usize> = candidates
        .iter()
        .filter(usable)
        .filter(|c| c.target == target)
        .map(|c| c.connection)
        .collect();
    let connection = routing.pick_connection(target, &conns)?;
    candidates
        .iter()
        .copied()
        .find(|c| c.target == target && c.connection == connection)
}
