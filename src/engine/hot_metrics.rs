//! The metric series every request touches, looked up once per generation (issue #9).
//!
//! A `with_label_values` call hashes each label value and takes the vector's lock; the
//! request path made five per request. Here each series of the hot path is looked up on
//! first use and kept, per [model] and per [provider][connection] of one snapshot, so a
//! request only bumps handles. Series are still created on first use, as before (a
//! connection that never served shows no `ok` series); other outcomes and statuses go
//! through the vectors as they always did.

use crate::metrics::Metrics;
use prometheus::{Histogram, IntCounter, IntGauge};
use std::sync::OnceLock;

/// Routes whose `requests_total{status="200"}` series is kept per model.
pub const ROUTE_SLOTS: usize = 8;

#[derive(Default)]
struct ConnSeries {
    inflight: OnceLock<IntGauge>,
    ok: OnceLock<IntCounter>,
}

#[derive(Default)]
struct ModelSeries {
    duration: OnceLock<Histogram>,
    ttfb: OnceLock<Histogram>,
    ok: [OnceLock<IntCounter>; ROUTE_SLOTS],
}

/// The hot series of one snapshot.
pub struct HotMetrics {
    conns: Vec<Vec<ConnSeries>>,
    models: Vec<ModelSeries>,
}

impl HotMetrics {
    /// Room for `models` models and `conns[p]` connections of each provider `p`.
    pub fn new(models: usize, conns: impl Iterator<Item = usize>) -> HotMetrics {
        HotMetrics {
            conns: conns
                .map(|n| (0..n).map(|_| ConnSeries::default()).collect())
                .collect(),
            models: (0..models).map(|_| ModelSeries::default()).collect(),
        }
    }

    /// `sluice_inflight{provider, connection}`.
    pub fn inflight(&self, m: &Metrics, ids: (usize, usize), names: [&str; 2]) -> &IntGauge {
        self.conns[ids.0][ids.1]
            .inflight
            .get_or_init(|| m.inflight.with_label_values(&names))
    }

    /// `sluice_attempts_total{provider, connection, outcome="ok"}`.
    pub fn attempt_ok(&self, m: &Metrics, ids: (usize, usize), names: [&str; 2]) -> &IntCounter {
        self.conns[ids.0][ids.1].ok.get_or_init(|| {
            m.attempts_total
                .with_label_values(&[names[0], names[1], "ok"])
        })
    }

    /// `sluice_request_duration_seconds{model}`.
    pub fn duration(&self, m: &Metrics, model: usize, name: &str) -> &Histogram {
        self.models[model]
            .duration
            .get_or_init(|| m.request_duration_seconds.with_label_values(&[name]))
    }

    /// `sluice_ttfb_seconds{model}`.
    pub fn ttfb(&self, m: &Metrics, model: usize, name: &str) -> &Histogram {
        self.models[model]
            .ttfb
            .get_or_init(|| m.ttfb_seconds.with_label_values(&[name]))
    }

    /// `sluice_requests_total{route, model, status="200"}` for a route slot below
    /// [`ROUTE_SLOTS`] (`None` beyond).
    pub fn requests_ok(
        &self,
        m: &Metrics,
        model: usize,
        route: (usize, &str),
        name: &str,
    ) -> Option<&IntCounter> {
        let slot = self.models[model].ok.get(route.0)?;
        Some(slot.get_or_init(|| m.requests_total.with_label_values(&[route.1, name, "200"])))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_series_is_the_vectors_own_and_is_made_on_first_use() {
        let m = Metrics::new().unwrap();
        let hot = HotMetrics::new(1, [2].into_iter());
        let text = || String::from_utf8(m.render()).unwrap();
        assert!(!text().contains("outcome=\"ok\""));
        hot.attempt_ok(&m, (0, 1), ["p", "c2"]).inc();
        hot.attempt_ok(&m, (0, 1), ["p", "c2"]).inc();
        assert_eq!(
            m.attempts_total.with_label_values(&["p", "c2", "ok"]).get(),
            2
        );
        hot.inflight(&m, (0, 0), ["p", "c1"]).inc();
        assert_eq!(m.inflight.with_label_values(&["p", "c1"]).get(), 1);
        hot.requests_ok(&m, 0, (3, "responses"), "smart")
            .unwrap()
            .inc();
        assert_eq!(
            m.requests_total
                .with_label_values(&["responses", "smart", "200"])
                .get(),
            1
        );
        assert!(hot
            .requests_ok(&m, 0, (ROUTE_SLOTS, "x"), "smart")
            .is_none());
        hot.duration(&m, 0, "smart").observe(0.5);
        hot.ttfb(&m, 0, "smart").observe(0.1);
        assert_eq!(
            m.request_duration_seconds
                .with_label_values(&["smart"])
                .get_sample_count(),
            1
        );
        assert_eq!(
            m.ttfb_seconds
                .with_label_values(&["smart"])
                .get_sample_count(),
            1
        );
    }
}
