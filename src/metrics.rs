//! Prometheus metrics (SPEC §9), owned by one registry that this module creates.
//!
//! Label values are bounded by construction: routes come from a fixed table, models,
//! providers and connections from the config (an unknown client model is recorded as
//! `unknown`), outcomes and reasons from enums. Client input never becomes a label.

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Typed handles to every metric the gateway exports.
pub struct Metrics {
    registry: Registry,
    pub requests_total: IntCounterVec,
    pub attempts_total: IntCounterVec,
    pub request_duration_seconds: HistogramVec,
    pub ttfb_seconds: HistogramVec,
    pub inflight: IntGaugeVec,
    pub stream_aborts_total: IntCounterVec,
    pub config_reloads_total: IntCounterVec,
    pub breaker_state: IntGaugeVec,
    pub breaker_transitions_total: IntCounterVec,
    pub connection_cooling: IntGaugeVec,
    pub connection_terminal: IntGaugeVec,
    pub model_lockouts_active: prometheus::IntGauge,
    pub restatements_total: IntCounterVec,
    pub classifications_total: IntCounterVec,
    pub queue_depth: IntGaugeVec,
    pub queue_rejections_total: IntCounterVec,
    pub affinity_pins_active: prometheus::IntGauge,
    pub leases_active: prometheus::IntGauge,
    pub store_write_errors_total: prometheus::IntCounter,
    /// Failed calls to the shared state backend (Redis): commits and change reads.
    pub state_backend_errors_total: prometheus::IntCounter,
    /// 1 while a connection's Claude subscription lane is on (SPEC §5.13).
    pub subscription_lane_active: IntGaugeVec,
    pub subscription_events_total: IntCounterVec,
}

/// `sluice_subscription_events_total{event}` values (SPEC §5.13).
pub const SUBSCRIPTION_EVENTS: [&str; 8] = [
    "wall",
    "limit_reset_claimed",
    "limit_reset_unavailable",
    "limit_reset_failed",
    "lane_entered",
    "lane_wait",
    "lane_ended",
    "lane_max_wait",
];

/// `sluice_queue_rejections_total{reason}` values.
pub const QUEUE_REJECTIONS: [&str; 2] = ["queue_full", "queue_timeout"];

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    600.0,
];

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let requests_total = IntCounterVec::new(
            Opts::new(
                "sluice_requests_total",
                "Client requests by route, model and status",
            ),
            &["route", "model", "status"],
        )?;
        let attempts_total = IntCounterVec::new(
            Opts::new(
                "sluice_attempts_total",
                "Upstream attempts by provider, connection and outcome (ok, failover, final_error, transport)",
            ),
            &["provider", "connection", "outcome"],
        )?;
        let request_duration_seconds = HistogramVec::new(
            HistogramOpts::new(
                "sluice_request_duration_seconds",
                "Time from request admission to the end of the response",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["model"],
        )?;
        let ttfb_seconds = HistogramVec::new(
            HistogramOpts::new(
                "sluice_ttfb_seconds",
                "Time from admission to the first response byte sent to the client",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["model"],
        )?;
        let inflight = IntGaugeVec::new(
            Opts::new("sluice_inflight", "Upstream attempts in flight"),
            &["provider", "connection"],
        )?;
        let stream_aborts_total = IntCounterVec::new(
            Opts::new(
                "sluice_stream_aborts_total",
                "Streams aborted by a guard or a client",
            ),
            &["reason"],
        )?;
        let config_reloads_total = IntCounterVec::new(
            Opts::new(
                "sluice_config_reloads_total",
                "Config reloads (file change, SIGHUP, admin) by result; startup is not counted",
            ),
            &["result"],
        )?;
        let breaker_state = IntGaugeVec::new(
            Opts::new(
                "sluice_breaker_state",
                "Provider breaker: 0 closed, 1 degraded, 2 half_open, 3 open",
            ),
            &["provider"],
        )?;
        let breaker_transitions_total = IntCounterVec::new(
            Opts::new(
                "sluice_breaker_transitions_total",
                "Breaker state changes by target state",
            ),
            &["provider", "to"],
        )?;
        let connection_cooling = IntGaugeVec::new(
            Opts::new(
                "sluice_connection_cooling",
                "1 while a connection is cooling down",
            ),
            &["provider", "connection"],
        )?;
        let connection_terminal = IntGaugeVec::new(
            Opts::new(
                "sluice_connection_terminal",
                "1 while a connection is in a terminal state",
            ),
            &["provider", "connection", "state"],
        )?;
        let model_lockouts_active = prometheus::IntGauge::new(
            "sluice_model_lockouts_active",
            "Model lockouts currently in force",
        )?;
        let restatements_total = IntCounterVec::new(
            Opts::new(
                "sluice_restatements_total",
                "Upstream statuses restated, by rule id",
            ),
            &["rule"],
        )?;
        let classifications_total = IntCounterVec::new(
            Opts::new(
                "sluice_classifications_total",
                "Failed attempts by classified reason and scope",
            ),
            &["reason", "scope"],
        )?;
        let queue_depth = IntGaugeVec::new(
            Opts::new(
                "sluice_queue_depth",
                "Requests waiting for a concurrency permit",
            ),
            &["provider", "connection"],
        )?;
        let queue_rejections_total = IntCounterVec::new(
            Opts::new(
                "sluice_queue_rejections_total",
                "Requests refused by queue admission",
            ),
            &["reason"],
        )?;
        let affinity_pins_active = prometheus::IntGauge::new(
            "sluice_affinity_pins_active",
            "Session affinity pins currently in force",
        )?;
        let leases_active = prometheus::IntGauge::new(
            "sluice_leases_active",
            "Exclusive session leases currently held",
        )?;
        let store_write_errors_total = prometheus::IntCounter::new(
            "sluice_store_write_errors_total",
            "State store commits that failed (each retry of a failing batch counts)",
        )?;
        let state_backend_errors_total = prometheus::IntCounter::new(
            "sluice_state_backend_errors_total",
            "Failed calls to the shared state backend (Redis): commits and reads of other nodes' changes",
        )?;
        // Both reload results are exported from the start (at 0), so a rate() over them
        // works before the first reload; startup itself is not a reload.
        for result in ["ok", "error"] {
            config_reloads_total.with_label_values(&[result]);
        }
        // Likewise every stream abort reason and queue rejection: alert rules on their
        // rates see a zero instead of no series at all.
        for reason in crate::codes::AbortReason::ALL {
            stream_aborts_total.with_label_values(&[reason.as_str()]);
        }
        for reason in QUEUE_REJECTIONS {
            queue_rejections_total.with_label_values(&[reason]);
        }
        let subscription_lane_active = IntGaugeVec::new(
            Opts::new(
                "sluice_subscription_lane_active",
                "1 while a Claude subscription connection sends on the low-priority lane",
            ),
            &["provider", "connection"],
        )?;
        let subscription_events_total = IntCounterVec::new(
            Opts::new(
                "sluice_subscription_events_total",
                "Claude subscription lane events: usage walls, limit resets, lane entries, waits and ends",
            ),
            &["event"],
        )?;
        for event in SUBSCRIPTION_EVENTS {
            subscription_events_total.with_label_values(&[event]);
        }
        for c in [
            Box::new(requests_total.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(attempts_total.clone()),
            Box::new(request_duration_seconds.clone()),
            Box::new(ttfb_seconds.clone()),
            Box::new(inflight.clone()),
            Box::new(stream_aborts_total.clone()),
            Box::new(config_reloads_total.clone()),
            Box::new(breaker_state.clone()),
            Box::new(breaker_transitions_total.clone()),
            Box::new(connection_cooling.clone()),
            Box::new(connection_terminal.clone()),
            Box::new(model_lockouts_active.clone()),
            Box::new(restatements_total.clone()),
            Box::new(classifications_total.clone()),
            Box::new(queue_depth.clone()),
            Box::new(queue_rejections_total.clone()),
            Box::new(affinity_pins_active.clone()),
            Box::new(leases_active.clone()),
            Box::new(store_write_errors_total.clone()),
            Box::new(state_backend_errors_total.clone()),
            Box::new(subscription_lane_active.clone()),
            Box::new(subscription_events_total.clone()),
        ] {
            registry.register(c)?;
        }
        Ok(Self {
            registry,
            requests_total,
            attempts_total,
            request_duration_seconds,
            ttfb_seconds,
            inflight,
            stream_aborts_total,
            config_reloads_total,
            breaker_state,
            breaker_transitions_total,
            connection_cooling,
            connection_terminal,
            model_lockouts_active,
            restatements_total,
            classifications_total,
            queue_depth,
            queue_rejections_total,
            affinity_pins_active,
            leases_active,
            store_write_errors_total,
            state_backend_errors_total,
            subscription_lane_active,
            subscription_events_total,
        })
    }

    /// The text exposition format of every registered metric.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 * 1024);
        // Encoding into a Vec cannot fail for well-formed metric families.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_registered_families() {
        let m = Metrics::new().unwrap();
        m.requests_total
            .with_label_values(&["chat", "smart", "200"])
            .inc();
        m.inflight.with_label_values(&["p", "c"]).set(1);
        let text = String::from_utf8(m.render()).unwrap();
        assert!(
            text.contains("sluice_requests_total{model=\"smart\",route=\"chat\",status=\"200\"} 1")
        );
        assert!(text.contains("sluice_inflight{connection=\"c\",provider=\"p\"} 1"));
    }
}
