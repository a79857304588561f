//! Admin operations on the resilience layers (SPEC §5.1, §5.3, §5.4, §8): read the
//! state of breakers, cooldowns and lockouts, and the operator's resets. Output names
//! connections by id only; credentials never appear.

use crate::engine::state::{change, conn_key, lock};
use crate::engine::Engine;
use crate::error::AdminError;
use crate::policy::cooldown::{Cleared, Eligibility};
use crate::policy::retry_after_secs;
use crate::policy::timefmt::format_rfc3339;
use crate::store::{Change, Table};
use serde::Deserialize;
use serde_json::{json, Value};

/// Commits an admin change before the call answers; a commit that fails answers 503.
async fn persist(engine: &Engine, changes: Vec<Change>) -> Result<(), AdminError> {
    if changes.is_empty() {
        return Ok(());
    }
    let Some(store) = &engine.store else {
        return Ok(());
    };
    store.commit_now(changes).await.map_err(|e| {
        tracing::error!(error = %e, "admin change not persisted");
        AdminError::NotPersisted(format!(
            "applied in memory but not persisted ({}): it is retried in the background and \
             lost if the process stops first",
            e.label()
        ))
    })
}

/// `GET /api/monitoring/health`
pub fn health(engine: &Engine) -> Value {
    let snap = engine.snapshot();
    let now = engine.now();
    let providers: Vec<Value> = snap
        .config
        .providers
        .iter()
        .enumerate()
        .map(|(pi, p)| {
            let bcfg = crate::engine::select::breaker_config(&snap, pi);
            let (state, failures, retry_at, reset, window) = match engine.tables.provider_if_any(&p.id) {
                Some(e) => {
                    let e = lock(&e);
                    (
                        e.breaker.state(&bcfg, now),
                        e.breaker.failures(),
                        e.breaker.retry_at(&bcfg, now),
                        e.breaker.current_reset(&bcfg),
                        e.window.cooling_until(now).filter(|_| snap.config.resilience.provider_cooldown_enabled),
                    )
                }
                None => (crate::policy::breaker::BreakerState::Closed, 0, None, bcfg.reset, None),
            };
            let (mut eligible, mut cooling, mut terminal) = (0, 0, 0);
            for c in &p.connections {
                match engine.tables.connection_if_any(&p.id, &c.id).map(|e| lock(&e).state.eligibility(now)) {
                    None | Some(Eligibility::Eligible) => eligible += 1,
                    Some(Eligibility::Cooling { .. }) => cooling += 1,
                    Some(Eligibility::Terminal(_)) => terminal += 1,
                }
            }
            json!({
                "provider": p.id,
                "class": p.class.as_str(),
                "state": state.as_str(),
                "failures": failures,
                "degrade_at": bcfg.degrade_at,
                "open_at": bcfg.open_at,
                "reset_timeout_s": reset.as_secs(),
                "retry_after_s": retry_at.map(|t| retry_after_secs(t, now)),
                "provider_cooldown_retry_after_s": window.map(|t| retry_after_secs(t, now)),
                "connections": {"total": p.connections.len(), "eligible": eligible, "cooling": cooling, "terminal": terminal},
            })
        })
        .collect();
    json!({ "providers": providers, "state_backend": super::state_backend(engine) })
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ResetBody {
    provider: Option<String>,
}

/// `POST /api/resilience/reset` — `{}` resets every breaker, `{"provider": "x"}` one.
pub async fn reset(engine: &Engine, body: &[u8]) -> Result<Value, AdminError> {
    let req: ResetBody = parse_body(body)?;
    let snap = engine.snapshot();
    if let Some(p) = &req.provider {
        if !snap.config.providers.iter().any(|x| &x.id == p) {
            return Err(AdminError::BadRequest(format!("unknown provider {p:?}")));
        }
    }
    let mut reset = Vec::new();
    let mut changes = Vec::new();
    for p in snap
        .config
        .providers
        .iter()
        .filter(|p| req.provider.as_ref().is_none_or(|x| x == &p.id))
    {
        let entry = engine.tables.provider(&p.id);
        let mut e = lock(&entry);
        if let Some(t) = e.breaker.reset() {
            engine.note_transition(&p.id, t);
        }
        e.window.reset();
        changes.push(change(Table::Breakers, &p.id, Some(&*e)));
        reset.push(p.id.clone());
    }
    persist(engine, changes).await?;
    Ok(json!({ "reset": reset }))
}

/// `GET /api/resilience/cooldowns[?provider=]`
pub fn cooldowns(engine: &Engine, provider: Option<&str>) -> Value {
    let snap = engine.snapshot();
    let now = engine.now();
    let mut rows = Vec::new();
    for p in snap
        .config
        .providers
        .iter()
        .filter(|p| provider.is_none_or(|x| x == p.id))
    {
        for c in &p.connections {
            let (st, sub) = engine
                .tables
                .connection_if_any(&p.id, &c.id)
                .map(|e| {
                    let e = lock(&e);
                    (e.state.clone(), e.subscription)
                })
                .unwrap_or_default();
            let (state, remaining) = match st.eligibility(now) {
                Eligibility::Eligible => ("ok", 0),
                Eligibility::Cooling { until } => ("cooling", retry_after_secs(until, now)),
                Eligibility::Terminal(t) => (t.as_str(), 0),
            };
            rows.push(json!({
                "provider": p.id,
                "connection": c.id,
                "state": state,
                "remaining_s": remaining,
                "backoff_level": st.backoff_level,
                "last_error": st.last_error,
                "last_error_reason": st.last_error_reason.map(|r| r.as_str()),
                "last_status": st.last_status,
            }));
            if let (Some(cfg), Some(Value::Object(row))) = (&c.subscription, rows.last_mut()) {
                row.insert("subscription".into(), subscription_json(cfg, &sub, now));
            }
        }
    }
    json!({ "connections": rows })
}

/// A subscription connection's lane and limit-reset memory (SPEC §5.13).
fn subscription_json(
    cfg: &crate::config::Subscription,
    s: &crate::policy::subscription::SubState,
    now: crate::policy::Millis,
) -> Value {
    let left = |until: crate::policy::Millis| until.saturating_sub(now).div_ceil(1000);
    let at = |t: crate::policy::Millis| (t > 0).then(|| crate::policy::timefmt::format_rfc3339(t));
    // A lane kept in the state while low_priority is off is not used: shown as off.
    let lane = s.lane.filter(|_| cfg.low_priority && s.lane_active(now));
    json!({
        "low_priority": cfg.low_priority,
        "limit_reset": cfg.limit_reset,
        "lane": if lane.is_some() { "active" } else { "off" },
        "lane_since": lane.and_then(|l| at(l.since)),
        "lane_remaining_s": lane.map_or(0, |l| left(l.until)),
        "cool_off_remaining_s": left(s.cool_off_until),
        "budget_exhausted_remaining_s": left(s.budget_exhausted_until),
        "limit_reset_available_in_s": left(s.reset_available_at),
        "limit_reset_retry_in_s": left(s.reset_retry_at),
        "limit_reset_claimed_at": at(s.reset_claimed_at),
    })
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ClearBody {
    connections: Option<Vec<String>>,
    #[serde(default)]
    all: bool,
    provider: Option<String>,
    #[serde(default)]
    include_terminal: bool,
}

/// `POST /api/resilience/cooldowns`
pub async fn clear_cooldowns(engine: &Engine, body: &[u8]) -> Result<Value, AdminError> {
    let req: ClearBody = parse_body(body)?;
    let snap = engine.snapshot();
    let mut targets: Vec<(String, String)> = Vec::new();
    match (&req.connections, req.all) {
        (Some(list), false) => {
            for id in list {
                let Some((p, c)) = id.split_once('/') else {
                    return Err(format!("{id:?} is not provider/connection").into());
                };
                if !snap
                    .config
                    .providers
                    .iter()
                    .any(|x| x.id == p && x.connections.iter().any(|y| y.id == c))
                {
                    return Err(format!("unknown connection {id:?}").into());
                }
                targets.push((p.to_string(), c.to_string()));
            }
        }
        (None, true) => {
            for p in snap
                .config
                .providers
                .iter()
                .filter(|p| req.provider.as_ref().is_none_or(|x| x == &p.id))
            {
                targets.extend(p.connections.iter().map(|c| (p.id.clone(), c.id.clone())));
            }
        }
        _ => {
            return Err(AdminError::BadRequest(
                "give either \"connections\": [\"provider/connection\", ...] or \"all\": true"
                    .into(),
            ))
        }
    }
    let (mut cleared, mut unchanged, mut skipped, mut lockouts) = (0, 0, 0, 0);
    let mut changes = Vec::new();
    for (p, c) in &targets {
        if let Some(entry) = engine.tables.connection_if_any(p, c) {
            let mut e = lock(&entry);
            match e.state.clear(req.include_terminal) {
                Cleared::Cleared => {
                    cleared += 1;
                    // Only a clear that includes terminal states may lift one another
                    // node set (a shared store keeps them otherwise, SPEC §7.1).
                    changes.push(if req.include_terminal {
                        crate::engine::state::cleared_row(&conn_key(p, c), &e)
                    } else {
                        change(Table::Connections, &conn_key(p, c), Some(&*e))
                    });
                }
                Cleared::Unchanged => unchanged += 1,
                Cleared::SkippedTerminal => skipped += 1,
            }
        } else {
            unchanged += 1;
        }
        let removed = engine.tables.remove_lockouts_of(p, c);
        lockouts += removed.len();
        changes.extend(removed);
    }
    persist(engine, changes).await?;
    Ok(
        json!({ "cleared": cleared, "unchanged": unchanged, "skipped_terminal": skipped, "lockouts_cleared": lockouts }),
    )
}

/// `GET /api/resilience/model-cooldowns`
pub fn model_cooldowns(engine: &Engine) -> Value {
    let now = engine.now();
    let rows: Vec<Value> = engine
        .tables
        .lockouts_all()
        .iter()
        .map(|e| {
            let active = e.lock.active(now);
            json!({
                "provider": e.provider,
                "connection": e.connection,
                "model": e.model,
                "reason": e.lock.reason.map(|r| r.as_str()),
                "status": e.lock.status,
                "failures": e.lock.failures,
                "expires_at": format_rfc3339(e.lock.until),
                "active": active,
                "remaining_s": if active { retry_after_secs(e.lock.until, now) } else { 0 },
            })
        })
        .collect();
    json!({ "lockouts": rows })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LockoutBody {
    provider: String,
    connection: String,
    model: String,
}

/// `DELETE /api/resilience/model-cooldowns`
pub async fn delete_model_cooldown(engine: &Engine, body: &[u8]) -> Result<Value, AdminError> {
    let req: LockoutBody = serde_json::from_slice(body)
        .map_err(|e| format!("body must be {{provider, connection, model}}: {e}"))?;
    let removed = engine
        .tables
        .remove_lockout(&req.provider, &req.connection, &req.model);
    let found = removed.is_some();
    persist(engine, removed.into_iter().collect()).await?;
    Ok(json!({ "removed": found }))
}

fn parse_body<T: for<'de> Deserialize<'de> + Default>(body: &[u8]) -> Result<T, String> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| format!("invalid JSON body: {e}"))
}

/// `GET /api/resilience`: every tunable setting's effective value and the layer that
/// supplied it, the runtime overrides, and the per-connection layer.
pub fn settings(engine: &Engine) -> Value {
    let snap = engine.snapshot();
    let settings: serde_json::Map<String, Value> = snap
        .sources
        .iter()
        .map(|(k, (v, src))| (k.to_string(), json!({"value": v, "source": src})))
        .collect();
    json!({
        "precedence": ["default", "env", "file", "override", "connection"],
        "settings": settings,
        "overrides": *lock(&engine.overrides),
        "connections": crate::config::settings::per_connection(&snap.config),
    })
}

/// `PATCH /api/resilience`: `{setting: value}` sets runtime overrides (persisted),
/// `{setting: null}` removes one (for `emergency_fallback`, null is a value: use
/// `{"emergency_fallback": null}` to turn it off).
pub async fn patch_settings(engine: &Engine, body: &[u8]) -> Result<Value, AdminError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("invalid JSON body: {e}"))?;
    let changes = crate::config::settings::validate_patch(&engine.snapshot().config, &v)?;
    let generation = engine.set_overrides(changes).await?;
    Ok(json!({"ok": true, "generation": generation, "current": settings(engine)}))
}
