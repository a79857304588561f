//! Provider cooldown window gate (SPEC §5.2, opt-in): protects a provider that fails
//! in bursts by cooling it for `cooldown` once it collects `threshold` failures within
//! a sliding `window`.
//!
//! Invariants:
//! - Below the threshold it never cools: a cooldown starts only on the failure that
//!   makes `threshold` failures younger than `window` (a failure exactly `window` old
//!   has left the window).
//! - Memory is bounded: at most `threshold` failure timestamps are kept.
//! - A success clears the window but never an active cooldown; starting a cooldown also
//!   clears the window, so after it ends a fresh burst is needed to cool again.
//! - Failures reported during an active cooldown (attempts that started before it) are
//!   ignored: they neither extend it nor count towards the next one.
//! - Recovery is lazy: `cooling_until` compares the stored deadline with `now`.

use super::{ms, Millis};
use crate::config::WindowClass;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// One provider's window gate: a plain value, persisted as JSON as it is.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct WindowGate {
    /// Failure timestamps still inside the window, oldest first (≤ threshold entries).
    failures: VecDeque<Millis>,
    cooled_until: Option<Millis>,
}

impl WindowGate {
    /// Records a failure; `Some(until)` when this failure starts a cooldown.
    pub fn record_failure(&mut self, cfg: &WindowClass, now: Millis) -> Option<Millis> {
        if self.cooling_until(now).is_some() {
            return None;
        }
        let threshold = cfg.threshold.max(1) as usize;
        let window = ms(cfg.window);
        self.failures.retain(|&t| t > now || now - t < window);
        self.failures.push_back(now);
        while self.failures.len() > threshold {
            self.failures.pop_front();
        }
        if self.failures.len() < threshold {
            return None;
        }
        self.failures.clear();
        let until = now.saturating_add(ms(cfg.cooldown));
        self.cooled_until = Some(until);
        Some(until)
    }

    /// A success clears the window (not an active cooldown).
    pub fn record_success(&mut self) {
        self.failures.clear();
    }

    /// Lazy: `Some(until)` while cooling.
    pub fn cooling_until(&self, now: Millis) -> Option<Millis> {
        self.cooled_until.filter(|&until| now < until)
    }

    /// Operator reset: no window, no cooldown.
    pub fn reset(&mut self) {
        *self = WindowGate::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    const T0: Millis = 1_700_000_000_000;

    /// (class, threshold, window s, cooldown s) — the SPEC §5.2 defaults.
    const CLASSES: [(&str, u32, u64, u64); 3] = [
        ("oauth", 10, 900, 300),
        ("apikey", 15, 1_800, 600),
        ("local", 2, 300, 60),
    ];

    fn class(threshold: u32, window_s: u64, cooldown_s: u64) -> WindowClass {
        WindowClass {
            threshold,
            window: Duration::from_secs(window_s),
            cooldown: Duration::from_secs(cooldown_s),
        }
    }

    #[test]
    fn threshold_failures_within_window_cool() {
        for (name, threshold, window, cooldown) in CLASSES {
            let c = class(threshold, window, cooldown);
            let mut g = WindowGate::default();
            // Spread evenly so the first and last are just inside the window.
            let step = (window * 1_000 - 1) / u64::from(threshold - 1);
            for i in 0..threshold - 1 {
                let now = T0 + u64::from(i) * step;
                assert_eq!(g.record_failure(&c, now), None, "{name} failure {i}");
                assert_eq!(g.cooling_until(now), None);
            }
            let now = T0 + u64::from(threshold - 1) * step;
            let until = now + cooldown * 1_000;
            assert_eq!(g.record_failure(&c, now), Some(until), "{name}");
            assert_eq!(g.cooling_until(now), Some(until));
            assert_eq!(g.cooling_until(until - 1), Some(until));
            assert_eq!(g.cooling_until(until), None, "{name}: lazy expiry");
        }
    }

    #[test]
    fn failures_spread_beyond_window_never_cool() {
        for (name, threshold, window, cooldown) in CLASSES {
            let c = class(threshold, window, cooldown);
            let mut g = WindowGate::default();
            // Exactly `threshold` failures, first and last exactly `window` apart.
            let step = (window * 1_000).div_ceil(u64::from(threshold - 1));
            for i in 0..u64::from(threshold) * 5 {
                let now = T0 + i * step;
                assert_eq!(g.record_failure(&c, now), None, "{name} failure {i}");
            }
        }
    }

    #[test]
    fn success_clears_the_window() {
        for (name, threshold, window, cooldown) in CLASSES {
            let c = class(threshold, window, cooldown);
            let mut g = WindowGate::default();
            let mut now = T0;
            for _ in 0..3 {
                for _ in 0..threshold - 1 {
                    assert_eq!(g.record_failure(&c, now), None, "{name}");
                    now += 1_000;
                }
                g.record_success();
            }
            assert_eq!(g.record_failure(&c, now), None, "{name}");
        }
    }

    #[test]
    fn success_does_not_clear_an_active_cooldown() {
        let c = class(2, 300, 60);
        let mut g = WindowGate::default();
        g.record_failure(&c, T0);
        assert_eq!(g.record_failure(&c, T0 + 1), Some(T0 + 60_001));
        g.record_success();
        assert_eq!(g.cooling_until(T0 + 2), Some(T0 + 60_001));
    }

    #[test]
    fn failures_during_cooldown_are_ignored_and_window_restarts_after() {
        let c = class(2, 300, 60);
        let mut g = WindowGate::default();
        g.record_failure(&c, T0);
        let until = g.record_failure(&c, T0 + 1).unwrap();
        for i in 0..10 {
            assert_eq!(g.record_failure(&c, T0 + 2 + i), None);
        }
        assert_eq!(g.cooling_until(until - 1), Some(until));
        assert_eq!(g.record_failure(&c, until), None, "needs a fresh burst");
        assert_eq!(g.record_failure(&c, until + 1), Some(until + 1 + 60_000));
    }

    #[test]
    fn reset_clears_everything() {
        let c = class(2, 300, 60);
        let mut g = WindowGate::default();
        g.record_failure(&c, T0);
        g.record_failure(&c, T0 + 1);
        g.reset();
        assert_eq!(g, WindowGate::default());
        assert_eq!(g.cooling_until(T0 + 2), None);
        assert_eq!(g.record_failure(&c, T0 + 2), None);
    }

    #[test]
    fn threshold_one_and_zero_cool_on_first_failure() {
        for threshold in [0, 1] {
            let c = class(threshold, 60, 10);
            let mut g = WindowGate::default();
            assert_eq!(g.record_failure(&c, T0), Some(T0 + 10_000));
        }
    }

    #[test]
    fn serde_round_trip() {
        let c = class(3, 60, 10);
        let mut g = WindowGate::default();
        g.record_failure(&c, T0);
        let json = serde_json::to_string(&g).unwrap();
        let mut back: WindowGate = serde_json::from_str(&json).unwrap();
        assert_eq!(back, g);
        g.record_failure(&c, T0 + 1);
        back.record_failure(&c, T0 + 1);
        assert_eq!(
            back.record_failure(&c, T0 + 2),
            g.record_failure(&c, T0 + 2)
        );
        let empty: WindowGate = serde_json::from_str("{}").unwrap();
        assert_eq!(empty, WindowGate::default());
    }

    proptest! {
        #[test]
        fn bounded_and_never_cools_below_threshold(
            threshold in 1u32..20,
            window_s in 1u64..600,
            cooldown_s in 0u64..600,
            ops in prop::collection::vec((any::<bool>(), 0u64..120_000), 0..400),
        ) {
            let c = class(threshold, window_s, cooldown_s);
            let mut g = WindowGate::default();
            let mut now = T0;
            // Failures since the last success or cooldown start, for a reference check.
            let mut recent: Vec<Millis> = Vec::new();
            for (failure, dt) in ops {
                now += dt;
                if failure {
                    let cooling = g.cooling_until(now).is_some();
                    let started = g.record_failure(&c, now);
                    if cooling {
                        prop_assert_eq!(started, None);
                        continue;
                    }
                    recent.push(now);
                    let in_window = recent
                        .iter()
                        .filter(|&&t| now - t < window_s * 1_000)
                        .count();
                    if in_window >= threshold as usize {
                        prop_assert_eq!(started, Some(now + cooldown_s * 1_000));
                        recent.clear();
                    } else {
                        prop_assert_eq!(started, None);
                    }
                } else {
                    g.record_success();
                    recent.clear();
                }
                prop_assert!(g.failures.len() <= threshold as usize);
                let round: WindowGate =
                    serde_json::from_str(&serde_json::to_string(&g).unwrap()).unwrap();
                prop_assert_eq!(&round, &g);
            }
        }
    }
}
