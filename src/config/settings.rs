//! Settings precedence (SPEC §5.7): built-in default < environment variable < config
//! file < runtime override (PATCH, persisted) < per-connection value.
//!
//! The validator produces a `Config` from defaults and the file; `resolve` then applies
//! the environment to every setting the file did not set, and the runtime overrides on
//! top, and reports which layer supplied each effective value. Per-connection values
//! (caps, retry delays) are not global settings: they always win for their connection
//! and are reported separately. Every override is validated with the same rules as the
//! file before it is accepted; a bad override or env value is an error, never ignored.

use super::types::Config;
use super::units::parse_duration;
use super::validate::{EnvLookup, Problem};
use serde::Serialize;
use serde_json::{json, Value};
use serde_yaml::Value as Yaml;
use std::collections::BTreeMap;
use std::time::Duration;

/// Which layer supplied an effective value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    Default,
    Env,
    File,
    Override,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Bool,
    Count { min: u64, max: u64 },
    Duration { min: Duration, max: Duration },
    ModelOrNull,
}

/// One runtime-tunable setting.
struct Setting {
    key: &'static str,
    env: &'static str,
    kind: Kind,
    get: fn(&Config) -> Value,
    set: fn(&mut Config, &Value),
}

const DAY: Duration = Duration::from_secs(86_400);

fn dur(v: &Value) -> Duration {
    v.as_str()
        .and_then(|s| parse_duration(s).ok())
        .unwrap_or_default()
}

fn show(d: Duration) -> Value {
    Value::from(humantime::format_duration(d).to_string())
}

macro_rules! setting {
    ($key:expr, $env:expr, $kind:expr, |$c:ident| $get:expr, |$m:ident, $v:ident| $set:expr) => {
        Setting {
            key: $key,
            env: $env,
            kind: $kind,
            get: |$c: &Config| $get,
            set: |$m: &mut Config, $v: &Value| $set,
        }
    };
}

fn registry() -> Vec<Setting> {
    let d = |min: Duration, max: Duration| Kind::Duration { min, max };
    vec![
        setting!(
            "queue.max_depth",
            "SLUICE_QUEUE_MAX_DEPTH",
            Kind::Count {
                min: 0,
                max: 100_000
            },
            |c| Value::from(c.resilience.queue.max_depth),
            |c, v| c.resilience.queue.max_depth = v.as_u64().unwrap_or(0) as u32
        ),
        setting!(
            "queue.wait",
            "SLUICE_QUEUE_WAIT",
            d(Duration::ZERO, DAY),
            |c| show(c.resilience.queue.wait),
            |c, v| c.resilience.queue.wait = dur(v)
        ),
        setting!(
            "queue.execution_timeout",
            "SLUICE_EXECUTION_TIMEOUT",
            d(Duration::from_millis(1), DAY),
            |c| show(c.resilience.queue.execution_timeout),
            |c, v| c.resilience.queue.execution_timeout = dur(v)
        ),
        setting!(
            "queue.fail_open",
            "SLUICE_QUEUE_FAIL_OPEN",
            Kind::Bool,
            |c| Value::from(c.resilience.queue.fail_open),
            |c, v| c.resilience.queue.fail_open = v.as_bool().unwrap_or(true)
        ),
        setting!(
            "combo_wait.enabled",
            "SLUICE_COMBO_WAIT_ENABLED",
            Kind::Bool,
            |c| Value::from(c.resilience.combo_wait.enabled),
            |c, v| c.resilience.combo_wait.enabled = v.as_bool().unwrap_or(true)
        ),
        setting!(
            "combo_wait.max_wait",
            "SLUICE_COMBO_WAIT_MAX_WAIT",
            d(Duration::ZERO, DAY),
            |c| show(c.resilience.combo_wait.max_wait),
            |c, v| c.resilience.combo_wait.max_wait = dur(v)
        ),
        setting!(
            "combo_wait.max_attempts",
            "SLUICE_COMBO_WAIT_MAX_ATTEMPTS",
            Kind::Count { min: 0, max: 100 },
            |c| Value::from(c.resilience.combo_wait.max_attempts),
            |c, v| c.resilience.combo_wait.max_attempts = v.as_u64().unwrap_or(0) as u32
        ),
        setting!(
            "combo_wait.budget",
            "SLUICE_COMBO_WAIT_BUDGET",
            d(Duration::ZERO, DAY),
            |c| show(c.resilience.combo_wait.budget),
            |c, v| c.resilience.combo_wait.budget = dur(v)
        ),
        setting!(
            "session_affinity.ttl",
            "SLUICE_SESSION_AFFINITY_TTL",
            d(Duration::ZERO, DAY * 30),
            |c| show(c.resilience.affinity_ttl),
            |c, v| c.resilience.affinity_ttl = dur(v)
        ),
        setting!(
            "stream.ttft_timeout",
            "SLUICE_STREAM_TTFT_TIMEOUT",
            d(Duration::from_millis(1), DAY),
            |c| show(c.resilience.stream.ttft_timeout),
            |c, v| c.resilience.stream.ttft_timeout = dur(v)
        ),
        setting!(
            "stream.stall_timeout",
            "SLUICE_STREAM_STALL_TIMEOUT",
            d(Duration::from_millis(1), DAY),
            |c| show(c.resilience.stream.stall_timeout),
            |c, v| c.resilience.stream.stall_timeout = dur(v)
        ),
        setting!(
            "connection_cooldown.max_cooldown",
            "SLUICE_MAX_COOLDOWN",
            d(Duration::from_secs(1), DAY),
            |c| show(c.resilience.max_cooldown),
            |c, v| c.resilience.max_cooldown = dur(v)
        ),
        setting!(
            "provider_cooldown.enabled",
            "SLUICE_PROVIDER_COOLDOWN_ENABLED",
            Kind::Bool,
            |c| Value::from(c.resilience.provider_cooldown_enabled),
            |c, v| c.resilience.provider_cooldown_enabled = v.as_bool().unwrap_or(false)
        ),
        setting!(
            "model_lockout.enabled",
            "SLUICE_MODEL_LOCKOUT_ENABLED",
            Kind::Bool,
            |c| Value::from(c.resilience.model_lockout.enabled),
            |c, v| c.resilience.model_lockout.enabled = v.as_bool().unwrap_or(false)
        ),
        setting!(
            "watchdog.enabled",
            "SLUICE_STREAM_THROUGHPUT_WATCHDOG",
            Kind::Bool,
            |c| Value::from(c.resilience.watchdog.enabled),
            |c, v| c.resilience.watchdog.enabled = v.as_bool().unwrap_or(false)
        ),
        setting!(
            "stream_stall_cooldown",
            "SLUICE_STREAM_STALL_COOLDOWN",
            Kind::Bool,
            |c| Value::from(c.resilience.stream_stall_cooldown),
            |c, v| c.resilience.stream_stall_cooldown = v.as_bool().unwrap_or(false)
        ),
        setting!(
            "emergency_fallback",
            "SLUICE_EMERGENCY_FALLBACK",
            Kind::ModelOrNull,
            |c| c
                .emergency_fallback
                .clone()
                .map_or(Value::Null, Value::from),
            |c, v| c.emergency_fallback = v.as_str().map(str::to_string)
        ),
    ]
}

/// The names of every runtime-tunable setting.
pub fn keys() -> Vec<&'static str> {
    registry().iter().map(|s| s.key).collect()
}

/// Where a setting sits in the config file: `resilience.<key>` except the top-level
/// `emergency_fallback`.
fn file_path(key: &str) -> Vec<&str> {
    match key {
        "emergency_fallback" => vec!["emergency_fallback"],
        k => std::iter::once("resilience").chain(k.split('.')).collect(),
    }
}

fn in_file(root: &Yaml, key: &str) -> bool {
    let mut cur = root;
    for part in file_path(key) {
        match cur.get(part) {
            Some(v) => cur = v,
            None => return false,
        }
    }
    !cur.is_null()
}

/// Checks and normalises one value for `s` (text from env, or JSON from PATCH).
fn check(s: &Setting, v: &Value, cfg: &Config) -> Result<Value, String> {
    match s.kind {
        Kind::Bool => match v {
            Value::Bool(b) => Ok(Value::Bool(*b)),
            Value::String(t) if matches!(t.as_str(), "true" | "1") => Ok(Value::Bool(true)),
            Value::String(t) if matches!(t.as_str(), "false" | "0") => Ok(Value::Bool(false)),
            _ => Err("must be true or false".into()),
        },
        Kind::Count { min, max } => {
            let n = match v {
                Value::Number(n) => n.as_u64(),
                Value::String(t) => t.trim().parse().ok(),
                _ => None,
            };
            match n {
                Some(n) if (min..=max).contains(&n) => Ok(Value::from(n)),
                _ => Err(format!("must be a whole number between {min} and {max}")),
            }
        }
        Kind::Duration { min, max } => {
            let Value::String(t) = v else {
                return Err("must be a duration string such as \"30s\"".into());
            };
            let d = parse_duration(t)?;
            if d < min || d > max {
                return Err(format!(
                    "must be between {} and {}",
                    humantime::format_duration(min),
                    humantime::format_duration(max)
                ));
            }
            Ok(show(d))
        }
        Kind::ModelOrNull => match v {
            Value::Null => Ok(Value::Null),
            Value::String(m) if m.is_empty() || m == "null" => Ok(Value::Null),
            Value::String(m) if m.ends_with('*') => Err(format!(
                "{m:?} is a pattern; the fallback must be an exact model name"
            )),
            Value::String(m) if cfg.model(m).is_some() => Ok(Value::from(m.clone())),
            Value::String(m) => Err(format!("unknown model {m:?}")),
            _ => Err("must be a model name or null".into()),
        },
    }
}

/// Splits stored runtime overrides into those that still apply to `cfg` and those that
/// no longer do (an unknown setting, or a value the config now rejects, such as an
/// `emergency_fallback` naming a model that was removed). The second list comes back as
/// warnings naming each dropped key: a stale override must never stop a start or a
/// reload, and must not linger either.
pub fn split_overrides(
    cfg: &Config,
    overrides: &BTreeMap<String, Value>,
) -> (BTreeMap<String, Value>, Vec<Problem>) {
    let reg = registry();
    let mut kept = BTreeMap::new();
    let mut dropped = Vec::new();
    for (k, v) in overrides {
        let verdict = match reg.iter().find(|s| s.key == k) {
            None => Err("unknown setting".to_string()),
            Some(s) => check(s, v, cfg).map(|_| ()),
        };
        match verdict {
            Ok(()) => {
                kept.insert(k.clone(), v.clone());
            }
            Err(e) => dropped.push(Problem {
                file: "runtime overrides".into(),
                path: k.clone(),
                reason: format!(
                    "{v}: {e}; the override no longer applies and was dropped \
                     (PATCH /api/resilience sets it again)"
                ),
            }),
        }
    }
    (kept, dropped)
}

/// Effective settings with their sources, after `resolve`.
pub type Sources = BTreeMap<&'static str, (Value, Source)>;

/// Applies the env layer (to settings the file leaves unset) and the runtime overrides
/// to `cfg`. `file_text` is the config file's YAML, used only to see which settings it
/// sets. Overrides for unknown keys or with invalid values are reported as problems.
pub fn resolve(
    cfg: &mut Config,
    file_text: &str,
    env: EnvLookup<'_>,
    overrides: &BTreeMap<String, Value>,
) -> Result<Sources, Vec<Problem>> {
    let root: Yaml = serde_yaml::from_str(file_text).unwrap_or(Yaml::Null);
    let file = cfg.source.display().to_string();
    let mut problems = Vec::new();
    let mut out = Sources::new();
    let reg = registry();
    for k in overrides.keys() {
        if !reg.iter().any(|s| s.key == k) {
            problems.push(Problem {
                file: "runtime overrides".into(),
                path: k.clone(),
                reason: "unknown setting".into(),
            });
        }
    }
    for s in &reg {
        let mut source = if in_file(&root, s.key) {
            Source::File
        } else {
            Source::Default
        };
        if source == Source::Default {
            if let Some(text) = env(s.env) {
                match check(s, &Value::from(text.clone()), cfg) {
                    Ok(v) => {
                        (s.set)(cfg, &v);
                        source = Source::Env;
                    }
                    Err(e) => problems.push(Problem {
                        file: file.clone(),
                        path: format!("env {}", s.env),
                        reason: format!("{text:?}: {e}"),
                    }),
                }
            }
        }
        if let Some(v) = overrides.get(s.key) {
            match check(s, v, cfg) {
                Ok(v) => {
                    (s.set)(cfg, &v);
                    source = Source::Override;
                }
                Err(e) => problems.push(Problem {
                    file: "runtime overrides".into(),
                    path: s.key.into(),
                    reason: e,
                }),
            }
        }
        out.insert(s.key, ((s.get)(cfg), source));
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(problems)
    }
}

/// Validates a PATCH body `{key: value|null}` against `cfg`: returns the normalised
/// overrides to set (`Some`) or remove (`None`, for a JSON null on a non-nullable key).
pub fn validate_patch(
    cfg: &Config,
    body: &Value,
) -> Result<BTreeMap<String, Option<Value>>, String> {
    let Value::Object(map) = body else {
        return Err("body must be a JSON object of setting: value".into());
    };
    if map.is_empty() {
        return Err(format!("no settings given; known: {}", keys().join(", ")));
    }
    let reg = registry();
    let mut out = BTreeMap::new();
    for (k, v) in map {
        let Some(s) = reg.iter().find(|s| s.key == k) else {
            return Err(format!(
                "unknown setting {k:?}; known: {}",
                keys().join(", ")
            ));
        };
        if v.is_null() && s.kind != Kind::ModelOrNull {
            out.insert(k.clone(), None);
            continue;
        }
        let v = check(s, v, cfg).map_err(|e| format!("{k}: {e}"))?;
        out.insert(k.clone(), Some(v));
    }
    Ok(out)
}

/// The per-connection layer, for display: values that win for their connection.
pub fn per_connection(cfg: &Config) -> Value {
    let rows: Vec<Value> = cfg
        .providers
        .iter()
        .flat_map(|p| {
            p.connections.iter().map(move |c| {
                let (retry_delay, source) = match (
                    c.retry_delay,
                    p.retry_delay,
                    cfg.resilience.env_rate_limit_reset,
                ) {
                    (Some(d), _, _) => (Some(d), "connection"),
                    (None, Some(d), _) => (Some(d), "provider"),
                    (None, None, Some(d)) => (Some(d), "env"),
                    _ => (None, "default"),
                };
                json!({
                    "provider": p.id,
                    "connection": c.id,
                    "max_concurrent": c.max_concurrent,
                    "model_concurrency": c.model_concurrency,
                    "retry_delay": retry_delay.map(show),
                    "retry_delay_source": source,
                    "disable_cooling": c.disable_cooling,
                    "bucket": c.bucket,
                })
            })
        })
        .collect();
    Value::from(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_str;
    use std::path::Path;

    const BASE: &str = "providers:\n  - id: p\n    base_url: \"http://127.0.0.1:1\"\n    api: openai\n    connections:\n      - { id: c, retry_delay: \"7s\" }\nmodels:\n  - name: m\n    targets: [ { provider: p, model: u } ]\n";

    fn load(extra: &str) -> (Config, String) {
        let text = format!("{BASE}{extra}");
        let loaded = parse_str(&text, "t.yaml", Path::new("."), &|_| None).unwrap();
        (loaded.config, text)
    }

    #[test]
    fn layers_apply_in_order() {
        let (mut cfg, text) = load("resilience:\n  queue: { wait: \"5s\" }\n");
        let env = |k: &str| match k {
            "SLUICE_QUEUE_WAIT" => Some("9s".to_string()),
            "SLUICE_QUEUE_MAX_DEPTH" => Some("7".to_string()),
            "SLUICE_COMBO_WAIT_BUDGET" => Some("20s".to_string()),
            _ => None,
        };
        let mut ov = BTreeMap::new();
        ov.insert("combo_wait.budget".to_string(), Value::from("45s"));
        let src = resolve(&mut cfg, &text, &env, &ov).unwrap();
        // The file wins over env; env over default; an override over env.
        assert_eq!(src["queue.wait"], (Value::from("5s"), Source::File));
        assert_eq!(src["queue.max_depth"], (Value::from(7), Source::Env));
        assert_eq!(
            src["combo_wait.budget"],
            (Value::from("45s"), Source::Override)
        );
        assert_eq!(src["queue.fail_open"], (Value::from(true), Source::Default));
        assert_eq!(cfg.resilience.queue.wait, Duration::from_secs(5));
        assert_eq!(cfg.resilience.queue.max_depth, 7);
        assert_eq!(cfg.resilience.combo_wait.budget, Duration::from_secs(45));
        // Per-connection retry_delay wins for its connection.
        let pc = per_connection(&cfg);
        assert_eq!(pc[0]["retry_delay"], "7s");
        assert_eq!(pc[0]["retry_delay_source"], "connection");
    }

    #[test]
    fn bad_values_are_errors_not_ignored() {
        let (mut cfg, text) = load("");
        let env = |k: &str| (k == "SLUICE_QUEUE_FAIL_OPEN").then(|| "maybe".to_string());
        let err = resolve(&mut cfg, &text, &env, &BTreeMap::new()).unwrap_err();
        assert!(
            err[0].to_string().contains("SLUICE_QUEUE_FAIL_OPEN"),
            "{err:?}"
        );
        let (cfg, _) = load("");
        assert!(validate_patch(&cfg, &json!({"queue.max_depth": 100001})).is_err());
        assert!(validate_patch(&cfg, &json!({"queue.wait": "soon"})).is_err());
        assert!(validate_patch(&cfg, &json!({"nope": 1})).is_err());
        assert!(validate_patch(&cfg, &json!({"emergency_fallback": "ghost"})).is_err());
        let ok = validate_patch(
            &cfg,
            &json!({"emergency_fallback": "m", "queue.wait": null, "queue.max_depth": 2}),
        )
        .unwrap();
        assert_eq!(ok["emergency_fallback"], Some(Value::from("m")));
        assert_eq!(ok["queue.wait"], None);
        assert_eq!(ok["queue.max_depth"], Some(Value::from(2)));
    }

    #[test]
    fn stale_overrides_are_split_off_with_their_reason() {
        let (cfg, _) = load("");
        let mut stored = BTreeMap::new();
        stored.insert("emergency_fallback".to_string(), json!("removed-model"));
        stored.insert("queue.max_depth".to_string(), json!(5));
        stored.insert("no.such.setting".to_string(), json!(1));
        let (kept, dropped) = split_overrides(&cfg, &stored);
        assert_eq!(kept.len(), 1);
        assert_eq!(kept["queue.max_depth"], json!(5));
        let paths: Vec<&str> = dropped.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, vec!["emergency_fallback", "no.such.setting"]);
        assert!(
            dropped[0].reason.contains("unknown model"),
            "{}",
            dropped[0]
        );
        assert!(dropped[0].reason.contains("dropped"));
    }
}
