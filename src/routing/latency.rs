//! Time-to-first-byte window of one connection: the latency input of `p2c` (SPEC §5.12).
//!
//! A window keeps the last 20 samples; a sample older than 15 minutes no longer counts,
//! and a mean is reported only from 3 live samples on, so one cold start or a connection
//! that has been idle for a while does not steer traffic. Time is passed in (`now`), so
//! the window is a plain value that tests drive with a hand-held clock.

use crate::policy::Millis;
use std::collections::VecDeque;

/// Samples kept per connection.
pub const LATENCY_SAMPLES: usize = 20;
/// Age after which a sample no longer counts (15 minutes).
pub const LATENCY_MAX_AGE_MS: Millis = 15 * 60 * 1_000;
/// Live samples needed before a mean is reported.
pub const LATENCY_MIN_SAMPLES: usize = 3;

/// Last 20 TTFB samples of one connection within 15 minutes.
#[derive(Clone, Debug, Default)]
pub struct LatencyWindow {
    /// `(recorded at, ttfb in ms)`, oldest first.
    samples: VecDeque<(Millis, f64)>,
}

impl LatencyWindow {
    /// Adds one sample taken at `now`. Negative or non-finite values are ignored; expired
    /// samples are dropped, and the oldest one goes when the window is full.
    pub fn record(&mut self, ttfb_ms: f64, now: Millis) {
        if !ttfb_ms.is_finite() || ttfb_ms < 0.0 {
            return;
        }
        // Oldest first: the expired ones are at the front (after a clock step back, one
        // may stay behind a newer sample until the window is full; `mean` and `count`
        // skip it meanwhile).
        while self.samples.front().is_some_and(|(at, _)| !live(*at, now)) {
            self.samples.pop_front();
        }
        while self.samples.len() >= LATENCY_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back((now, ttfb_ms));
    }

    /// Mean TTFB of the live samples; `None` with fewer than 3 of them.
    pub fn mean(&self, now: Millis) -> Option<f64> {
        let (n, sum) = self
            .samples
            .iter()
            .filter(|(at, _)| live(*at, now))
            .fold((0usize, 0.0f64), |(n, sum), (_, v)| (n + 1, sum + v));
        (n >= LATENCY_MIN_SAMPLES).then(|| sum / n as f64)
    }

    /// Number of live samples at `now`.
    pub fn count(&self, now: Millis) -> usize {
        self.samples.iter().filter(|(at, _)| live(*at, now)).count()
    }
}

/// A sample still counts up to and including 15 minutes after it was taken.
fn live(at: Millis, now: Millis) -> bool {
    now.saturating_sub(at) <= LATENCY_MAX_AGE_MS
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Millis = 1_700_000_000_000;

    #[test]
    fn needs_three_samples() {
        let mut w = LatencyWindow::default();
        assert_eq!(w.mean(T0), None);
        w.record(100.0, T0);
        w.record(200.0, T0 + 1);
        assert_eq!(w.mean(T0 + 2), None);
        w.record(300.0, T0 + 2);
        assert_eq!(w.mean(T0 + 3), Some(200.0));
        assert_eq!(w.count(T0 + 3), 3);
    }

    #[test]
    fn samples_expire_after_fifteen_minutes() {
        let mut w = LatencyWindow::default();
        w.record(100.0, T0);
        w.record(100.0, T0 + 60_000);
        w.record(400.0, T0 + 120_000);
        // Exactly 15 minutes after the first sample it still counts.
        assert_eq!(w.mean(T0 + LATENCY_MAX_AGE_MS), Some(200.0));
        // One millisecond later it has expired: two live samples are not enough.
        assert_eq!(w.mean(T0 + LATENCY_MAX_AGE_MS + 1), None);
        assert_eq!(w.count(T0 + LATENCY_MAX_AGE_MS + 1), 2);
        // A fresh sample brings the window back to three live ones.
        w.record(700.0, T0 + LATENCY_MAX_AGE_MS + 1);
        assert_eq!(w.mean(T0 + LATENCY_MAX_AGE_MS + 1), Some(400.0));
        // Much later everything is gone.
        assert_eq!(w.mean(T0 + 10 * LATENCY_MAX_AGE_MS), None);
        assert_eq!(w.count(T0 + 10 * LATENCY_MAX_AGE_MS), 0);
    }

    #[test]
    fn keeps_only_the_last_twenty() {
        let mut w = LatencyWindow::default();
        for i in 0..LATENCY_SAMPLES {
            w.record(1_000.0, T0 + i as Millis);
        }
        assert_eq!(w.mean(T0 + 100), Some(1_000.0));
        // Twenty newer samples push out every old one.
        for i in 0..LATENCY_SAMPLES {
            w.record(10.0, T0 + 100 + i as Millis);
        }
        assert_eq!(w.count(T0 + 200), LATENCY_SAMPLES);
        assert_eq!(w.mean(T0 + 200), Some(10.0));
        // One more replaces exactly one of them.
        w.record(210.0, T0 + 300);
        assert_eq!(w.count(T0 + 300), LATENCY_SAMPLES);
        assert_eq!(w.mean(T0 + 300), Some(20.0));
    }

    #[test]
    fn ignores_nonsense_samples() {
        let mut w = LatencyWindow::default();
        for v in [f64::NAN, f64::INFINITY, -1.0] {
            w.record(v, T0);
        }
        assert_eq!(w.count(T0), 0);
        for v in [0.0, 30.0, 60.0] {
            w.record(v, T0);
        }
        assert_eq!(w.mean(T0), Some(30.0));
    }
}
