//! The record side of an attempt: its outcome goes to the breaker and window gate
//! (provider scope), the connection cooldown (connection scope), shared quota buckets
//! and model lockouts — each only for the failures that belong to its scope.
//!
//! Everything here is synchronous: state is updated in memory under short locks, and the
//! changes are handed to the batched store writer. Changes that create a terminal state
//! come back in `Recorded::urgent` so the caller commits them before answering.

use super::select::breaker_config;
use super::state::{change, conn_key, lock};
use super::{Engine, Pick, Snapshot};
use crate::config::{Config, Connection, Provider};
use crate::policy::breaker::Transition;
use crate::policy::classify::counts_for_breaker;
use crate::policy::cooldown::{base_for, ConnState, CooldownConfig, Effect, Failure};
use crate::policy::lockout::{lock_key_with_scope, LockoutConfig};
use crate::policy::{Classification, Millis, Reason, Scope};
use crate::store::{Change, Table};
use std::time::Duration;

/// One attempt, as the record side needs it.
#[derive(Clone, Copy)]
pub struct AttemptInfo<'a> {
    pub snap: &'a Snapshot,
    pub model: usize,
    pub pick: Pick,
    /// When the attempt started (anti-thundering-herd).
    pub started: Millis,
    /// Whether the attempt held the HALF_OPEN probe.
    pub probe: bool,
    /// No attempt of this request is left after this one (metrics: final vs failover).
    pub last: bool,
    /// The session-affinity pin key of the request, refreshed on success.
    pub pin: Option<&'a str>,
    /// A 4xx answer is about this request alone (`count_tokens`): it is final and
    /// leaves no trace on the provider, the connection or the model.
    pub request_scoped_4xx: bool,
}

impl AttemptInfo<'_> {
    /// Whether `status` is a 4xx of a request-scoped route.
    pub fn scoped(&self, status: u16) -> bool {
        self.request_scoped_4xx && (400..500).contains(&status)
    }
}

pub enum Outcome<'a> {
    /// The attempt committed a response (breaker success, errors cleared, lockouts decay).
    Success,
    /// Upstream answered ≥ 400 (status after restatement).
    Http {
        status: u16,
        class: &'a Classification,
        hint: Option<Duration>,
        message: &'a str,
    },
    /// No HTTP answer: connect error, reset, TTFT timeout.
    Transport {
        class: &'a Classification,
        message: &'a str,
    },
    /// A committed stream stalled (records the error; cools only if configured).
    Stall { message: &'a str },
    /// The client went away mid-attempt: no verdict on the upstream.
    Abandoned,
}

#[derive(Debug, Default)]
pub struct Recorded {
    /// Cooldown the connection got from this outcome, if any.
    pub cooled_until: Option<Millis>,
    /// Changes to commit before the response (terminal states).
    pub urgent: Vec<Change>,
}

impl Engine {
    pub fn cooldown_config(&self, snap: &Snapshot, pick: Pick) -> CooldownConfig {
        let c = &snap.config;
        let p = &c.providers[pick.provider];
        let conn = &p.connections[pick.connection];
        CooldownConfig {
            base: base_for(p.class),
            max_cooldown: c.resilience.max_cooldown,
            max_hint: c.resilience.max_hint,
            connection_retry_delay: conn.retry_delay,
            provider_retry_delay: p.retry_delay,
            env_reset: c.resilience.env_rate_limit_reset,
            disable_cooling: conn.disable_cooling,
        }
    }

    /// Records one attempt's outcome in every layer it concerns.
    pub fn record(&self, a: &AttemptInfo<'_>, outcome: Outcome<'_>) -> Recorded {
        self.record_at(a, outcome, self.now())
    }

    /// [`Engine::record`] at `now`, for a caller that has just read the clock.
    pub fn record_at(&self, a: &AttemptInfo<'_>, outcome: Outcome<'_>, now: Millis) -> Recorded {
        let mut rec = Recorded::default();
        let mut changes = Vec::new();
        self.record_provider(a, &outcome, now, &mut changes);
        self.record_connection(a, &outcome, now, &mut changes, &mut rec);
        self.record_lockout(a, &outcome, now, &mut changes);
        if let Some(store) = &self.store {
            store.submit(changes);
        }
        rec
    }

    fn record_provider(
        &self,
        a: &AttemptInfo<'_>,
        outcome: &Outcome<'_>,
        now: Millis,
        changes: &mut Vec<Change>,
    ) {
        let cfg = &a.snap.config;
        let p = &cfg.providers[a.pick.provider];
        let bcfg = breaker_config(a.snap, a.pick.provider);
        // The snapshot's handle on the table entry: no lookup by id.
        let entry = a.snap.provider_entry(&self.tables, a.pick.provider);
        let mut e = lock(entry);
        let before = e.clone();
        let mut transition: Option<Transition> = None;
        match outcome {
            Outcome::Success => {
                transition = e.breaker.record(&bcfg, false, a.probe, now);
                e.window.record_success();
            }
            Outcome::Http { status, class, .. } if counts_for_breaker(class, Some(*status)) => {
                transition = e.breaker.record(&bcfg, true, a.probe, now);
                if cfg.resilience.provider_cooldown_enabled {
                    e.window
                        .record_failure(cfg.resilience.provider_cooldown.get(p.class), now);
                }
            }
            Outcome::Transport { class, .. } if counts_for_breaker(class, None) => {
                transition = e.breaker.record(&bcfg, true, a.probe, now);
                if cfg.resilience.provider_cooldown_enabled {
                    e.window
                        .record_failure(cfg.resilience.provider_cooldown.get(p.class), now);
                }
            }
            _ => {
                if a.probe {
                    e.breaker.release_probe();
                }
            }
        }
        if let Some(t) = transition {
            self.note_transition(&p.id, t);
        }
        if *e != before {
            changes.push(change(Table::Breakers, &p.id, Some(&*e)));
        }
    }

    pub(crate) fn note_transition(&self, provider: &str, t: Transition) {
        self.metrics
            .breaker_transitions_total
            .with_label_values(&[provider, t.to.as_str()])
            .inc();
        tracing::info!(
            provider,
            from = t.from.as_str(),
            to = t.to.as_str(),
            "breaker transition"
        );
    }

    fn record_connection(
        &self,
        a: &AttemptInfo<'_>,
        outcome: &Outcome<'_>,
        now: Millis,
        changes: &mut Vec<Change>,
        rec: &mut Recorded,
    ) {
        let cfg = &a.snap.config;
        let p = &cfg.providers[a.pick.provider];
        let conn = &p.connections[a.pick.connection];
        // An attempt made with a credential that a reload has since replaced says
        // nothing about the new one (it must not re-mark a rotated key terminal).
        let used = a.snap.fingerprint(a.pick.provider, a.pick.connection);
        let current = self.current();
        // Unchanged when the attempt's snapshot is still the current one.
        if !std::ptr::eq(&**current, a.snap) && current.fingerprint_of(&p.id, &conn.id) != used {
            return;
        }
        drop(current);
        let ccfg = self.cooldown_config(a.snap, a.pick);
        let key = || conn_key(&p.id, &conn.id);
        // The snapshot's handle on the table entry: no lookup by id.
        let entry = a
            .snap
            .conn_entry(&self.tables, a.pick.provider, a.pick.connection);
        let mut e = lock(entry);
        // Only the state and the credential change here (the lane's memory does not):
        // the credential is compared, not copied.
        let before: ConnState = e.state.clone();
        let mut bucket_until: Option<(Millis, Reason)> = None;
        let effect: Option<Effect> = match outcome {
            Outcome::Success => {
                e.state.record_success();
                None
            }
            Outcome::Http {
                status,
                class,
                hint,
                message,
            } => {
                // With model lockouts on, a rate-limit or quota signal on a status the
                // lockout layer handles locks the model (or its quota family) on this
                // connection instead of cooling the whole connection; so does a hint
                // longer than `lock_threshold` (SPEC §5.3/§5.4).
                let lockout = &cfg.resilience.model_lockout;
                let long_hint = hint.is_some_and(|h| h > cfg.resilience.lock_threshold);
                let to_lockout = lockout.enabled
                    && lockout.error_codes.contains(status)
                    && class.terminal.is_none()
                    && (long_hint
                        || matches!(
                            class.reason,
                            Reason::RateLimitExceeded | Reason::QuotaExhausted
                        ));
                let connection_layer = class.terminal.is_some() || class.scope == Scope::Connection;
                if connection_layer && !to_lockout {
                    let f = Failure {
                        attempt_started: a.started,
                        reason: class.reason,
                        status: Some(*status),
                        hint: *hint,
                        rule_cooldown: class.cooldown,
                        terminal: class.terminal,
                        message,
                    };
                    let eff = e.state.record_failure(&f, &ccfg, now);
                    if matches!(
                        class.reason,
                        Reason::QuotaExhausted | Reason::RateLimitExceeded
                    ) {
                        if let Some(until) = eff.cooled_until {
                            bucket_until = Some((until, class.reason));
                        }
                    }
                    Some(eff)
                } else {
                    None
                }
            }
            Outcome::Stall { message } => Some(e.state.record_stall(
                message,
                cfg.resilience.stream_stall_cooldown,
                &ccfg,
                now,
            )),
            Outcome::Transport { .. } | Outcome::Abandoned => None,
        };
        let new_credential = e.credential.as_deref() != used;
        if new_credential {
            e.credential = used.map(str::to_string);
        }
        if let Some(eff) = &effect {
            rec.cooled_until = eff.cooled_until;
            if let Some(t) = eff.became_terminal {
                let key = key();
                tracing::warn!(connection = %key, state = t.as_str(), "connection entered a terminal state");
                rec.urgent.push(change(Table::Connections, &key, Some(&*e)));
            }
        }
        if (new_credential || e.state != before) && rec.urgent.is_empty() {
            changes.push(change(Table::Connections, &key(), Some(&*e)));
        }
        drop(e);
        if let Some((until, reason)) = bucket_until {
            for (other_p, other) in bucket_siblings(cfg, a.pick) {
                let oe = self.tables.connection(&other_p.id, &other.id);
                let mut oe = lock(&oe);
                if oe.state.apply_shared(until, reason, now) {
                    changes.push(change(
                        Table::Connections,
                        &conn_key(&other_p.id, &other.id),
                        Some(&*oe),
                    ));
                }
            }
        }
    }

    fn record_lockout(
        &self,
        a: &AttemptInfo<'_>,
        outcome: &Outcome<'_>,
        now: Millis,
        changes: &mut Vec<Change>,
    ) {
        let cfg = &a.snap.config;
        if !cfg.resilience.model_lockout.enabled {
            return;
        }
        let p = &cfg.providers[a.pick.provider];
        let conn = &p.connections[a.pick.connection];
        let t = &cfg.models[a.model].targets[a.pick.target];
        match outcome {
            Outcome::Success => {
                for name in a.snap.lock_names(a.model, a.pick.target) {
                    if let Some(c) = self.tables.decay_lockout(&p.id, &conn.id, name) {
                        changes.push(c);
                    }
                }
            }
            Outcome::Http {
                status,
                class,
                hint,
                ..
            } => {
                let lcfg = LockoutConfig::from_config(&cfg.resilience.model_lockout);
                // A concurrency limit is a 1 s connection matter (SPEC §5.3), never a lock.
                // A pattern's target without `model:` serves every id its clients send; one
                // client's bad id must not lock the connection for all of them.
                if !lcfg.error_codes.contains(status)
                    || t.model.is_empty()
                    || class.terminal.is_some()
                    || class.scope == Scope::Request
                    || class.reason == Reason::ConcurrencyLimited
                {
                    return;
                }
                let family = t.quota_family.as_deref().or(p.quota_family.as_deref());
                let rule_scope = class.rule.is_some().then_some(class.scope);
                let (_, model_key) = lock_key_with_scope(*status, &t.model, family, rule_scope);
                let hint = hint.map(|h| h.min(cfg.resilience.max_hint));
                let (until, c) = self.tables.with_lockout(&p.id, &conn.id, &model_key, |e| {
                    e.lock
                        .record_failure(&lcfg, *status, class.reason, hint, now)
                });
                if let Some(until) = until {
                    tracing::info!(provider = %p.id, connection = %conn.id, model = %model_key, status, "model lockout");
                    changes.push(c);
                    if matches!(
                        class.reason,
                        Reason::RateLimitExceeded | Reason::QuotaExhausted
                    ) {
                        self.lock_bucket(a, &model_key, until, class.reason, *status, changes);
                    }
                }
            }
            _ => {}
        }
    }

    /// A rate limit or quota that became a model lock on a connection of a quota bucket
    /// locks the same model on the bucket's other connections too, exactly as a cooldown
    /// would have cooled them (SPEC §5.3): whichever layer takes the signal, a bucket
    /// never spends a call on an account that just said it is out of quota.
    fn lock_bucket(
        &self,
        a: &AttemptInfo<'_>,
        model_key: &str,
        until: Millis,
        reason: Reason,
        status: u16,
        changes: &mut Vec<Change>,
    ) {
        for (p, c) in bucket_siblings(&a.snap.config, a.pick) {
            let (changed, change) = self.tables.with_lockout(&p.id, &c.id, model_key, |e| {
                e.lock.apply_shared(until, reason, status)
            });
            if changed {
                changes.push(change);
            }
        }
    }
}

/// The other connections of the picked connection's quota bucket that take a shared
/// timer: not the picked one, not those with `disable_cooling`. Empty without a bucket.
fn bucket_siblings(cfg: &Config, pick: Pick) -> Vec<(&Provider, &Connection)> {
    let Some(bucket) = cfg.providers[pick.provider].connections[pick.connection]
        .bucket
        .as_ref()
    else {
        return Vec::new();
    };
    cfg.providers
        .iter()
        .enumerate()
        .flat_map(|(pi, p)| {
            p.connections
                .iter()
                .enumerate()
                .map(move |(ci, c)| ((pi, ci), p, c))
        })
        .filter(|&((pi, ci), _, c)| {
            c.bucket.as_ref() == Some(bucket)
                && (pi, ci) != (pick.provider, pick.connection)
                && !c.disable_cooling
        })
        .map(|(_, p, c)| (p, c))
        .collect()
}
