//! The response-header phase's verdict on a failed attempt: status restatement, then
//! classification, then recording in every layer (SPEC §2 phase 4, §5.10, §5.11).
//!
//! Restatement runs first so every consumer — classification, cooldowns, the client —
//! sees the true, retryable nature of a misstated error. The client-facing
//! `Retry-After` is normalised to whole seconds in 1 s – 24 h: the restatement rule's
//! value, else the upstream's own hint, else (for 429/503, which always carry one) the
//! cooldown the connection got or already has, the provider's breaker, or 1 s. The
//! upstream's own header is never passed on as it is.

use super::record::{AttemptInfo, Outcome};
use super::Engine;
use crate::policy::classify::{classify, ErrorInput, TransportKind};
use crate::policy::retry_hint::parse_hint;
use crate::policy::{client_retry_after, retry_after_secs, Classification};
use crate::store::Change;

/// What the attempt loop needs to decide and to answer.
#[derive(Debug)]
pub struct Verdict {
    /// Status after restatement.
    pub status: u16,
    pub class: Classification,
    /// Normalised `Retry-After` for the client, in whole seconds.
    pub retry_after: Option<u64>,
    /// Terminal-state changes to commit before answering.
    pub urgent: Vec<Change>,
}

/// A short, single-line excerpt of an upstream error body for `last_error`.
fn excerpt(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(&body[..body.len().min(400)]);
    let one_line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    one_line.chars().take(200).collect()
}

impl Engine {
    pub fn judge_http(
        &self,
        a: &AttemptInfo<'_>,
        status: u16,
        headers: &http::HeaderMap,
        body: &[u8],
    ) -> Verdict {
        let now = self.now();
        let provider = &a.snap.config.providers[a.pick.provider].id;
        let restated = a.snap.rules.restate(provider, status, body);
        let status = match &restated {
            Some(r) => {
                self.metrics
                    .restatements_total
                    .with_label_values(&[r.rule.as_str()])
                    .inc();
                r.to_status
            }
            None => status,
        };
        let input = ErrorInput {
            provider,
            status: Some(status),
            transport: None,
            headers: Some(headers),
            body,
        };
        let class = classify(&a.snap.rules, &input);
        self.metrics
            .classifications_total
            .with_label_values(&[class.reason.as_str(), class.scope.as_str()])
            .inc();
        let hint = parse_hint(headers, body, now);
        let message = excerpt(body);
        // A request-scoped 4xx (count_tokens) says nothing about the connection.
        let rec = if a.scoped(status) {
            super::record::Recorded::default()
        } else {
            self.record(
                a,
                Outcome::Http {
                    status,
                    class: &class,
                    hint,
                    message: &message,
                },
            )
        };
        let retry_after = match (&restated, hint) {
            (Some(r), _) => Some(r.retry_after_s),
            (None, Some(h)) => Some(h.as_secs_f64().ceil() as u64),
            (None, None) if matches!(status, 429 | 503) => {
                // No hint: the cooldown this failure set, else the one already running
                // (a concurrent failure, a bucket mate), else the provider's gate, else 1 s
                // — a 429/503 always tells the client when to come back.
                let known = rec
                    .cooled_until
                    .or_else(|| self.cooling_until(a, now))
                    .or_else(|| self.breaker_retry_at(a, now));
                Some(known.map_or(1, |u| retry_after_secs(u, now)))
            }
            _ => None,
        }
        .map(client_retry_after);
        Verdict {
            status,
            class,
            retry_after,
            urgent: rec.urgent,
        }
    }

    /// The end of the connection's running cooldown, if it is cooling.
    fn cooling_until(&self, a: &AttemptInfo<'_>, now: crate::policy::Millis) -> Option<u64> {
        let p = &a.snap.config.providers[a.pick.provider];
        let e = self
            .tables
            .connection_if_any(&p.id, &p.connections[a.pick.connection].id)?;
        let until = super::state::lock(&e).state.cooling_until(now);
        until
    }

    /// When the provider's breaker admits traffic again, if it is open.
    fn breaker_retry_at(&self, a: &AttemptInfo<'_>, now: crate::policy::Millis) -> Option<u64> {
        let bcfg = super::select::breaker_config(a.snap, a.pick.provider);
        let e = self
            .tables
            .provider_if_any(&a.snap.config.providers[a.pick.provider].id)?;
        let retry_at = super::state::lock(&e).breaker.retry_at(&bcfg, now);
        retry_at
    }

    pub fn judge_transport(
        &self,
        a: &AttemptInfo<'_>,
        kind: TransportKind,
        message: &str,
    ) -> Verdict {
        let provider = &a.snap.config.providers[a.pick.provider].id;
        let input = ErrorInput {
            provider,
            status: None,
            transport: Some(kind),
            headers: None,
            body: message.as_bytes(),
        };
        let class = classify(&a.snap.rules, &input);
        self.metrics
            .classifications_total
            .with_label_values(&[class.reason.as_str(), class.scope.as_str()])
            .inc();
        let rec = self.record(
            a,
            Outcome::Transport {
                class: &class,
                message,
            },
        );
        Verdict {
            status: 0,
            class,
            retry_after: None,
            urgent: rec.urgent,
        }
    }
}
