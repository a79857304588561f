//! The response-header phase's verdict on a failed attempt: status restatement, then
//! classification, then recording in every layer (SPEC §2 phase 4, §5.10, §5.11).
//!
//! Restatement runs first so every consumer — classification, cooldowns, the client —
//! sees the true, retryable nature of a misstated error. The client-facing
//! `Retry-After` is normalised to whole seconds: the restatement rule's value, else the
//! upstream's own hint, else (for 429/503) the cooldown the connection just got.

use super::record::{AttemptInfo, Outcome};
use super::Engine;
use crate::policy::classify::{classify, ErrorInput, TransportKind};
use crate::policy::retry_hint::parse_hint;
use crate::policy::{retry_after_secs, Classification};
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
        let rec = self.record(
            a,
            Outcome::Http {
                status,
                class: &class,
                hint,
                message: &message,
            },
        );
        let retry_after = match (&restated, hint) {
            (Some(r), _) => Some(r.retry_after_s.max(1)),
            (None, Some(h)) => Some(h.as_secs_f64().ceil().max(1.0) as u64),
            (None, None) if matches!(status, 429 | 503) => {
                rec.cooled_until.map(|u| retry_after_secs(u, now))
            }
            _ => None,
        };
        Verdict {
            status,
            class,
            retry_after,
            urgent: rec.urgent,
        }
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
