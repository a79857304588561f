//! Validation of the `resilience:` section: every layer's numbers, with defaults from
//! SPEC §5 and the same field-path error reporting as the rest of the config.

use super::{join, Validator};
use crate::config::raw::*;
use crate::config::types::*;
use serde_yaml::{Mapping, Value};
use std::time::Duration;

impl Validator<'_> {
    pub(super) fn resilience(&mut self, root: &Mapping) -> Resilience {
        let map = match root.get("resilience") {
            None | Some(Value::Null) => Mapping::new(),
            Some(Value::Mapping(m)) => m.clone(),
            Some(_) => {
                self.err("resilience", "must be a mapping");
                Mapping::new()
            }
        };
        for key in map.keys() {
            let k = key.as_str().unwrap_or("?");
            if !RESILIENCE_KEYS.contains(&k) {
                self.err(
                    &format!("resilience.{k}"),
                    format!(
                        "unknown key; expected one of {}",
                        RESILIENCE_KEYS.join(", ")
                    ),
                );
            }
        }
        let bm = sub_mapping(&map, "breaker");
        let b: RawBreaker = self.section_at(&bm, "breaker", "resilience.breaker");
        let breaker = PerClass {
            apikey: self.breaker_class("resilience.breaker.apikey", b.apikey, (7, 12, 30)),
            oauth: self.breaker_class("resilience.breaker.oauth", b.oauth, (5, 8, 60)),
            local: self.breaker_class("resilience.breaker.local", b.local, (1, 2, 15)),
        };
        let max_backoff_multiplier = b.max_backoff_multiplier.unwrap_or(16);
        if !(1..=1024).contains(&max_backoff_multiplier) {
            self.err(
                "resilience.breaker.max_backoff_multiplier",
                "must be between 1 and 1024",
            );
        }
        let pm = sub_mapping(&map, "provider_cooldown");
        let pc: RawProviderCooldown =
            self.section_at(&pm, "provider_cooldown", "resilience.provider_cooldown");
        let env_pc = (self.env)("SLUICE_PROVIDER_COOLDOWN_ENABLED")
            .map(|v| v == "1" || v.eq_ignore_ascii_case("true"));
        let provider_cooldown = PerClass {
            apikey: self.window_class(
                "resilience.provider_cooldown.apikey",
                pc.apikey,
                (15, 1800, 600),
            ),
            oauth: self.window_class(
                "resilience.provider_cooldown.oauth",
                pc.oauth,
                (10, 900, 300),
            ),
            local: self.window_class("resilience.provider_cooldown.local", pc.local, (2, 300, 60)),
        };
        let cm = sub_mapping(&map, "connection_cooldown");
        let cc: RawConnectionCooldown =
            self.section_at(&cm, "connection_cooldown", "resilience.connection_cooldown");
        let day = Duration::from_secs(86_400);
        let max_cooldown = self.bounded_duration(
            "resilience.connection_cooldown.max_cooldown",
            cc.max_cooldown.as_ref(),
            Duration::from_secs(300),
            Duration::from_secs(1),
            day,
        );
        let max_hint = self.bounded_duration(
            "resilience.connection_cooldown.max_hint",
            cc.max_hint.as_ref(),
            day,
            Duration::from_secs(1),
            day * 30,
        );
        let lock_threshold = self.bounded_duration(
            "resilience.connection_cooldown.lock_threshold",
            cc.lock_threshold.as_ref(),
            Duration::from_secs(600),
            Duration::from_secs(1),
            day,
        );
        let mm = sub_mapping(&map, "model_lockout");
        let ml: RawModelLockout = self.section_at(&mm, "model_lockout", "resilience.model_lockout");
        let base_cooldown = self.bounded_duration(
            "resilience.model_lockout.base_cooldown",
            ml.base_cooldown.as_ref(),
            Duration::from_secs(120),
            Duration::from_secs(1),
            day,
        );
        let ml_max = self.bounded_duration(
            "resilience.model_lockout.max_cooldown",
            ml.max_cooldown.as_ref(),
            Duration::from_secs(1800),
            Duration::from_secs(1),
            day * 30,
        );
        if ml_max < base_cooldown {
            self.err(
                "resilience.model_lockout.max_cooldown",
                "must be at least base_cooldown",
            );
        }
        let am = sub_mapping(&map, "session_affinity");
        let aff: RawAffinity =
            self.section_at(&am, "session_affinity", "resilience.session_affinity");
        let affinity_ttl = self.duration(
            "resilience.session_affinity.ttl",
            aff.ttl.as_ref(),
            Duration::from_secs(1800),
        );
        let qm = sub_mapping(&map, "queue");
        let q: RawQueue = self.section_at(&qm, "queue", "resilience.queue");
        let max_depth = q.max_depth.unwrap_or(0);
        if max_depth > 100_000 {
            self.err("resilience.queue.max_depth", "must be between 0 and 100000");
        }
        let queue = Queue {
            max_depth,
            wait: self.bounded_duration(
                "resilience.queue.wait",
                q.wait.as_ref(),
                Duration::from_secs(30),
                Duration::ZERO,
                day,
            ),
            execution_timeout: self.bounded_duration(
                "resilience.queue.execution_timeout",
                q.execution_timeout.as_ref(),
                Duration::from_secs(600),
                Duration::from_millis(1),
                day,
            ),
            fail_open: q.fail_open.unwrap_or(true),
        };
        let wm = sub_mapping(&map, "combo_wait");
        let cw: RawComboWait = self.section_at(&wm, "combo_wait", "resilience.combo_wait");
        let combo_wait = ComboWait {
            enabled: cw.enabled.unwrap_or(true),
            max_wait: self.bounded_duration(
                "resilience.combo_wait.max_wait",
                cw.max_wait.as_ref(),
                Duration::from_secs(60),
                Duration::ZERO,
                day,
            ),
            max_attempts: cw.max_attempts.unwrap_or(2),
            budget: self.bounded_duration(
                "resilience.combo_wait.budget",
                cw.budget.as_ref(),
                Duration::from_secs(90),
                Duration::ZERO,
                day,
            ),
        };
        let sm = sub_mapping(&map, "stream");
        let s: RawStream = self.section_at(&sm, "stream", "resilience.stream");
        let stream = StreamGuards {
            ttft_timeout: self.bounded_duration(
                "resilience.stream.ttft_timeout",
                s.ttft_timeout.as_ref(),
                Duration::from_secs(60),
                Duration::from_millis(1),
                day,
            ),
            stall_timeout: self.bounded_duration(
                "resilience.stream.stall_timeout",
                s.stall_timeout.as_ref(),
                Duration::from_secs(120),
                Duration::from_millis(1),
                day,
            ),
        };
        let dm = sub_mapping(&map, "watchdog");
        let w: RawWatchdog = self.section_at(&dm, "watchdog", "resilience.watchdog");
        let env_wd = (self.env)("SLUICE_STREAM_THROUGHPUT_WATCHDOG")
            .map(|v| v == "1" || v.eq_ignore_ascii_case("true"));
        let watchdog = Watchdog {
            enabled: w.enabled.or(env_wd).unwrap_or(false),
            warmup: self.duration(
                "resilience.watchdog.warmup",
                w.warmup.as_ref(),
                Duration::from_secs(15),
            ),
            window: self.bounded_duration(
                "resilience.watchdog.window",
                w.window.as_ref(),
                Duration::from_secs(15),
                Duration::from_secs(1),
                day,
            ),
            min_bytes_per_sec: w.min_bytes_per_sec.unwrap_or(8),
        };
        let env_rate_limit_reset = match (self.env)("SLUICE_RATE_LIMIT_RESET_SECONDS") {
            None => None,
            Some(v) => match v.trim().parse::<u64>() {
                Ok(n) if n > 0 => Some(Duration::from_secs(n)),
                _ => {
                    self.err(
                        "env SLUICE_RATE_LIMIT_RESET_SECONDS",
                        format!("{v:?} is not a positive number of seconds"),
                    );
                    None
                }
            },
        };
        let stream_stall_cooldown = match map.get("stream_stall_cooldown") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                self.err("resilience.stream_stall_cooldown", "must be true or false");
                false
            }
        };
        Resilience {
            breaker,
            max_backoff_multiplier,
            provider_cooldown_enabled: pc.enabled.or(env_pc).unwrap_or(false),
            provider_cooldown,
            max_cooldown,
            max_hint,
            lock_threshold,
            model_lockout: ModelLockout {
                enabled: ml.enabled.unwrap_or(false),
                error_codes: ml
                    .error_codes
                    .unwrap_or_else(|| vec![403, 404, 429, 502, 503, 504]),
                base_cooldown,
                max_cooldown: ml_max,
                max_backoff_steps: ml.max_backoff_steps.unwrap_or(10),
                exponential: ml.exponential.unwrap_or(true),
            },
            affinity_ttl,
            queue,
            combo_wait,
            stream,
            watchdog,
            stream_stall_cooldown,
            env_rate_limit_reset,
        }
    }

    fn breaker_class(
        &mut self,
        path: &str,
        raw: Option<RawBreakerClass>,
        d: (u32, u32, u64),
    ) -> BreakerClass {
        let raw = raw.unwrap_or_default();
        let degrade_at = raw.degrade_at.unwrap_or(d.0);
        let open_at = raw.open_at.unwrap_or(d.1);
        if degrade_at == 0 {
            self.err(&join(path, "degrade_at"), "must be at least 1");
        }
        if open_at < degrade_at {
            self.err(&join(path, "open_at"), "must be at least degrade_at");
        }
        let reset = self.bounded_duration(
            &join(path, "reset"),
            raw.reset.as_ref(),
            Duration::from_secs(d.2),
            Duration::from_secs(1),
            Duration::from_secs(86_400),
        );
        BreakerClass {
            degrade_at,
            open_at,
            reset,
        }
    }

    fn window_class(
        &mut self,
        path: &str,
        raw: Option<RawWindowClass>,
        d: (u32, u64, u64),
    ) -> WindowClass {
        let raw = raw.unwrap_or_default();
        let threshold = raw.threshold.unwrap_or(d.0);
        if threshold == 0 {
            self.err(&join(path, "threshold"), "must be at least 1");
        }
        WindowClass {
            threshold,
            window: self.duration(
                &join(path, "window"),
                raw.window.as_ref(),
                Duration::from_secs(d.1),
            ),
            cooldown: self.duration(
                &join(path, "cooldown"),
                raw.cooldown.as_ref(),
                Duration::from_secs(d.2),
            ),
        }
    }
}

/// A one-key mapping holding `map[key]`, so a resilience subsection can go through the
/// same `section` parser (and error path) as a top-level one.
fn sub_mapping(map: &Mapping, key: &str) -> Mapping {
    let mut m = Mapping::new();
    if let Some(val) = map.get(key) {
        m.insert(Value::from(key), val.clone());
    }
    m
}
