//! The one settle point of an attempt (ARCHITECTURE §3.1): everything an attempt's end
//! means for the failure memory and the metrics is recorded here, once.
//!
//! `settle` takes an attempt's typed end — committed, refused by the upstream, failed in
//! transport, or abandoned — and records breaker / window gate / cooldown / bucket /
//! lockout (through `record` and `judge`), rate-limit and latency signals, the session
//! pin, and `attempts_total`; terminal states are made durable before it returns (SPEC
//! §7), so the response that reveals them comes after. A committed attempt is settled at
//! its commit point (a long stream must not hold a HALF_OPEN probe for minutes); what
//! later happens to its stream is settled once by `settle_stream`, never as a second
//! breaker verdict.

use super::judge::Verdict;
use super::record::{AttemptInfo, Outcome};
use super::Engine;
use crate::codes::AbortReason;
use crate::policy::classify::TransportKind;
use crate::policy::failover::Ended;
use std::time::Duration;

/// Longest a response waits for its terminal state to be committed.
const URGENT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// How an attempt ended, as the failure memory needs to know it.
pub enum AttemptOutcome<'a> {
    /// The first byte reached the client. `latency`: request write → first body byte.
    Committed {
        headers: &'a (dyn crate::policy::fields::Fields + Sync),
        latency: Duration,
    },
    /// The upstream answered ≥ 400 before commit (the bounded error body).
    Refused {
        status: u16,
        headers: &'a http::HeaderMap,
        body: &'a [u8],
    },
    /// No usable answer: connect, reset, or no first byte within the TTFT budget.
    Transport {
        kind: TransportKind,
        /// `sluice_attempts_total` outcome: refused, reset, timeout, tls, dns, connect.
        cause: &'static str,
        what: &'a str,
    },
    /// The execution deadline passed: no verdict on the upstream.
    Deadline,
    /// The client left: no verdict on the upstream.
    ClientGone,
}

/// What the attempt's end means for the rest of the request: the failover machine's
/// input, and for a failure the verdict (restated status, classification, the client's
/// `Retry-After`). `verdict` is `Some` exactly when `ended` is `Refused` or `Transport`.
pub struct Settled {
    pub ended: Ended,
    pub verdict: Option<Verdict>,
}

impl Engine {
    /// Records one attempt's end in every layer it concerns.
    pub async fn settle(&self, a: &AttemptInfo<'_>, outcome: AttemptOutcome<'_>) -> Settled {
        let pick = a.pick;
        let (label, ended, verdict) = match outcome {
            AttemptOutcome::Committed { headers, latency } => {
                let key = a.snap.conn_key(pick.provider, pick.connection);
                let now = self.now();
                self.note_rate_limit(key, headers, now);
                self.note_ttfb(key, latency, now);
                self.record_at(a, Outcome::Success, now);
                if let Some(key) = a.pin {
                    let target = &a.snap.config.models[a.model].targets[a.pick.target].model;
                    self.touch_pin(
                        key,
                        a.snap.conn_key(a.pick.provider, a.pick.connection),
                        target,
                        a.snap.config.resilience.affinity_ttl,
                    );
                }
                ("ok", Ended::Committed, None)
            }
            AttemptOutcome::Refused {
                status,
                headers,
                body,
            } => {
                let scoped = a.scoped(status);
                if !scoped {
                    let key = a.snap.conn_key(pick.provider, pick.connection);
                    self.note_rate_limit(key, headers, self.now());
                }
                let mut v = self.judge_http(a, status, headers, body);
                v.class.retryable &= !a.scoped(v.status);
                let label = if v.class.retryable && !a.last {
                    "failover"
                } else {
                    "final_error"
                };
                let ended = Ended::Refused {
                    pick,
                    retryable: v.class.retryable,
                    scope: v.class.scope,
                };
                (label, ended, Some(v))
            }
            AttemptOutcome::Transport { kind, cause, what } => {
                let v = self.judge_transport(a, kind, what);
                let ended = Ended::Transport {
                    pick,
                    timed_out: kind == TransportKind::Timeout,
                };
                (cause, ended, Some(v))
            }
            AttemptOutcome::Deadline => {
                self.record(a, Outcome::Abandoned);
                ("final_error", Ended::Deadline, None)
            }
            AttemptOutcome::ClientGone => {
                self.record(a, Outcome::Abandoned);
                ("final_error", Ended::ClientGone, None)
            }
        };
        let (p, c) = self.ids(a);
        if label == "ok" {
            let ids = (a.pick.provider, a.pick.connection);
            a.snap.hot.attempt_ok(&self.metrics, ids, [p, c]).inc();
        } else {
            self.metrics
                .attempts_total
                .with_label_values(&[p, c, label])
                .inc();
        }
        if let Some(v) = &verdict {
            self.commit_urgent(v).await;
        }
        Settled { ended, verdict }
    }

    /// Records how a committed stream was cut short (once per stream). A stall or a
    /// throughput abort is an error on the connection (it cools only with
    /// `stream_stall_cooldown`); it never counts for the breaker, whose verdict was
    /// given at the commit point, and never touches a probe slot.
    pub fn settle_stream(&self, a: &AttemptInfo<'_>, reason: AbortReason) {
        if reason.is_slow_upstream() {
            let after_commit = AttemptInfo { probe: false, ..*a };
            self.record(
                &after_commit,
                Outcome::Stall {
                    message: match reason {
                        AbortReason::Stall => "stream stalled after commit",
                        _ => "stream throughput below the watchdog minimum",
                    },
                },
            );
        }
        self.metrics
            .stream_aborts_total
            .with_label_values(&[reason.as_str()])
            .inc();
    }

    /// Terminal states are durable before the response that reveals them (SPEC §7). A
    /// failed commit never blocks the request: the change stays queued and is retried.
    async fn commit_urgent(&self, v: &Verdict) {
        if v.urgent.is_empty() {
            return;
        }
        if let Some(store) = &self.store {
            // Bounded: a store that does not answer (a blackholed Redis) must not hold the
            // response; the change stays queued and is committed when it can be.
            match tokio::time::timeout(URGENT_WAIT, store.commit_now(v.urgent.clone())).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::error!(error = %e, "could not persist a terminal state"),
                Err(_) => tracing::error!("persisting a terminal state is taking too long; answering now, the commit stays queued"),
            }
        }
    }

    fn ids<'s>(&self, a: &'s AttemptInfo<'_>) -> (&'s str, &'s str) {
        let p = &a.snap.config.providers[a.pick.provider];
        (p.id.as_str(), p.connections[a.pick.connection].id.as_str())
    }
}
