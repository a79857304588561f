//! Error classification (SPEC §5.11): one failed attempt → reason, scope, retryable,
//! optional cooldown and terminal state.
//!
//! Protects every other layer from acting at the wrong scope: a 400 must never trip a
//! provider breaker, a ban must never become a short cooldown, a concurrency 429 must
//! never count as a provider failure. Operator classification rules are checked first
//! (file order, first match wins, every HTTP status including 400); the built-in table
//! below applies otherwise. Transport failures (no status) never reach operator rules:
//! they carry no status, headers or body to match. Invariants of the built-in table:
//! request scope is never retryable; a terminal state only ever comes with connection
//! scope; the status given is the one *after* restatement (§5.10). Body markers are
//! lower-case byte substrings matched ASCII case-insensitively over at most the first
//! 64 KiB (see `rules::text`). Pure: no I/O, no clock, no state.

use super::{Classification, Reason, Scope, TerminalState};
use crate::rules::{Haystack, RuleSet};
use http::HeaderMap;

/// How an attempt failed when there is no HTTP status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    Connect,
    Timeout,
    Reset,
}

/// One failed attempt, as the classifier sees it.
#[derive(Clone, Copy, Debug)]
pub struct ErrorInput<'a> {
    pub provider: &'a str,
    /// HTTP status after restatement; `None` = transport failure.
    pub status: Option<u16>,
    pub transport: Option<TransportKind>,
    pub headers: Option<&'a HeaderMap>,
    /// The bounded error body (any bytes).
    pub body: &'a [u8],
}

/// Account bans: checked on every 4xx, before anything else.
const BAN_MARKERS: &[&str] = &[
    "account has been banned",
    "account is banned",
    "account has been suspended",
    "account suspended",
    "account has been deactivated",
    "account has been disabled",
    "organization has been disabled",
    "organization has been suspended",
    "账号已被封禁",
    "账户已被封禁",
];

/// Broader ban wording, trusted only on 401/403 (on a 400 or 404 "has been disabled"
/// may well be about a model, not the account).
const AUTH_BAN_MARKERS: &[&str] = &[
    "banned",
    "has been disabled",
    "suspended",
    "deactivated",
    "封禁",
];

/// Paid credit gone: a terminal state, checked on every 4xx (OpenAI sends
/// `insufficient_quota` with 429, Anthropic "credit balance is too low" with 400).
const CREDIT_MARKERS: &[&str] = &[
    "insufficient_quota",
    "credit balance is too low",
    "credits exhausted",
    "credits_exhausted",
    "insufficient credits",
    "insufficient_credits",
    "insufficient balance",
    "insufficient_balance",
    "billing hard limit",
    "billing_hard_limit_reached",
    "out of credits",
    "余额不足",
];

/// A 429 about a quota window (longer than a rate limit, but not terminal).
const QUOTA_MARKERS: &[&str] = &[
    "quota exceeded",
    "quota_exceeded",
    "exceeded your current quota",
    "exceeded quota",
    "quota_exhausted",
    "quota exhausted",
    "resource_exhausted",
    "daily limit",
    "monthly limit",
    "额度",
    "配额",
];

/// A 429 about too many requests in flight (SPEC §5.3): fail over at once.
const CONCURRENCY_MARKERS: &[&str] = &[
    "too many concurrent requests",
    "concurrency limit",
    "concurrent request limit",
    "parallel request limit",
    "并发数过高",
];

/// A 400 because the prompt does not fit the model.
const CONTEXT_MARKERS: &[&str] = &[
    "context_length_exceeded",
    "maximum context length",
    "context length exceeded",
    "prompt is too long",
    "too many tokens",
    "input is too long",
];

/// Statuses that count toward the provider breaker (SPEC §5.1).
const BREAKER_STATUSES: [u16; 5] = [408, 500, 502, 503, 504];

/// Operator rules first (first match wins, every status including 400), then the
/// built-in table.
pub fn classify(rules: &RuleSet, input: &ErrorInput) -> Classification {
    let hay = Haystack::new(input.body);
    if let Some(status) = input.status {
        if let Some(rule) = rules.classification_rule(input.provider, status, input.headers, &hay) {
            return rule.classification();
        }
    }
    builtin(input, &hay)
}

/// True for failures that count toward the provider breaker: transport and
/// 408/500/502/503/504 — never 401/403/429/404, never concurrency-limited. A rule that
/// moves one of those statuses off provider scope (or to another reason) takes it out
/// of the breaker too. An operator rule may also make another status count (e.g. a 400
/// whose body says the model is overloaded, classified `server_error` at provider
/// scope), but never one of the statuses that belong to the connection and model
/// layers (401/403/429/404).
pub fn counts_for_breaker(c: &Classification, status: Option<u16>) -> bool {
    let provider_failure = c.scope == Scope::Provider
        && matches!(
            c.reason,
            Reason::Transport | Reason::Timeout | Reason::ServerError
        );
    let allowed = |s: u16| {
        BREAKER_STATUSES.contains(&s) || (c.rule.is_some() && !matches!(s, 401 | 403 | 404 | 429))
    };
    provider_failure && status.is_none_or(allowed)
}

fn verdict(reason: Reason, scope: Scope, retryable: bool) -> Classification {
    Classification {
        reason,
        scope,
        retryable,
        cooldown: None,
        terminal: None,
        rule: None,
    }
}

fn terminal(reason: Reason, state: TerminalState) -> Classification {
    Classification {
        terminal: Some(state),
        // Another connection of the same provider may still be good.
        ..verdict(reason, Scope::Connection, true)
    }
}

fn builtin(input: &ErrorInput, body: &Haystack<'_>) -> Classification {
    let Some(status) = input.status else {
        return match input.transport {
            Some(TransportKind::Timeout) => verdict(Reason::Timeout, Scope::Provider, true),
            Some(TransportKind::Connect | TransportKind::Reset) | None => {
                verdict(Reason::Transport, Scope::Provider, true)
            }
        };
    };
    if status == 408 {
        return verdict(Reason::Timeout, Scope::Provider, true);
    }
    if !(400..=499).contains(&status) {
        // 5xx, and anything that is not an error status at all: the provider misbehaved.
        return verdict(Reason::ServerError, Scope::Provider, true);
    }
    if body.contains_any_str(BAN_MARKERS)
        || (matches!(status, 401 | 403) && body.contains_any_str(AUTH_BAN_MARKERS))
    {
        return terminal(Reason::Banned, TerminalState::Banned);
    }
    if status == 402 || body.contains_any_str(CREDIT_MARKERS) {
        return terminal(Reason::CreditsExhausted, TerminalState::CreditsExhausted);
    }
    match status {
        401 | 403 => verdict(Reason::AuthError, Scope::Connection, true),
        404 => verdict(Reason::NotFound, Scope::Model, true),
        429 if body.contains_any_str(QUOTA_MARKERS) => {
            verdict(Reason::QuotaExhausted, Scope::Connection, true)
        }
        429 if body.contains_any_str(CONCURRENCY_MARKERS) => {
            verdict(Reason::ConcurrencyLimited, Scope::Connection, true)
        }
        429 => verdict(Reason::RateLimitExceeded, Scope::Connection, true),
        400 if body.contains_any_str(CONTEXT_MARKERS) => {
            verdict(Reason::ContextOverflow, Scope::Request, false)
        }
        _ => verdict(Reason::BadRequest, Scope::Request, false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    fn http(status: u16, body: &str) -> Classification {
        classify(
            &RuleSet::empty(),
            &ErrorInput {
                provider: "p",
                status: Some(status),
                transport: None,
                headers: None,
                body: body.as_bytes(),
            },
        )
    }

    fn transport(kind: TransportKind) -> Classification {
        classify(
            &RuleSet::empty(),
            &ErrorInput {
                provider: "p",
                status: None,
                transport: Some(kind),
                headers: None,
                body: b"",
            },
        )
    }

    type Row = (Reason, Scope, bool, Option<TerminalState>);

    fn row(c: &Classification) -> Row {
        (c.reason, c.scope, c.retryable, c.terminal)
    }

    use Reason as R;
    use Scope as S;

    #[test]
    fn built_in_table() {
        let cred = Some(TerminalState::CreditsExhausted);
        let ban = Some(TerminalState::Banned);
        let cases: &[(u16, &str, Row)] = &[
            (408, "", (R::Timeout, S::Provider, true, None)),
            (500, "boom", (R::ServerError, S::Provider, true, None)),
            (502, "", (R::ServerError, S::Provider, true, None)),
            (503, "", (R::ServerError, S::Provider, true, None)),
            (504, "", (R::ServerError, S::Provider, true, None)),
            (529, "overloaded", (R::ServerError, S::Provider, true, None)),
            (501, "", (R::ServerError, S::Provider, true, None)),
            (
                429,
                "slow down",
                (R::RateLimitExceeded, S::Connection, true, None),
            ),
            (
                429,
                "Quota exceeded for metric",
                (R::QuotaExhausted, S::Connection, true, None),
            ),
            (
                429,
                "RESOURCE_EXHAUSTED",
                (R::QuotaExhausted, S::Connection, true, None),
            ),
            (
                429,
                "用户额度不足",
                (R::QuotaExhausted, S::Connection, true, None),
            ),
            (
                429,
                "Daily limit reached",
                (R::QuotaExhausted, S::Connection, true, None),
            ),
            (
                429,
                "Too many concurrent requests",
                (R::ConcurrencyLimited, S::Connection, true, None),
            ),
            (
                429,
                "parallel request limit hit",
                (R::ConcurrencyLimited, S::Connection, true, None),
            ),
            (
                429,
                "并发数过高",
                (R::ConcurrencyLimited, S::Connection, true, None),
            ),
            (
                429,
                r#"{"error":{"code":"insufficient_quota","message":"You exceeded your current quota"}}"#,
                (R::CreditsExhausted, S::Connection, true, cred),
            ),
            (
                401,
                "invalid api key",
                (R::AuthError, S::Connection, true, None),
            ),
            (
                401,
                "this account has been deactivated",
                (R::Banned, S::Connection, true, ban),
            ),
            (402, "", (R::CreditsExhausted, S::Connection, true, cred)),
            (
                400,
                "Your credit balance is too low",
                (R::CreditsExhausted, S::Connection, true, cred),
            ),
            (403, "forbidden", (R::AuthError, S::Connection, true, None)),
            (
                403,
                "Your account has been BANNED",
                (R::Banned, S::Connection, true, ban),
            ),
            (403, "key suspended", (R::Banned, S::Connection, true, ban)),
            (
                400,
                "This organization has been disabled.",
                (R::Banned, S::Connection, true, ban),
            ),
            (
                404,
                "the model has been disabled",
                (R::NotFound, S::Model, true, None),
            ),
            (404, "no such model", (R::NotFound, S::Model, true, None)),
            (400, "bad json", (R::BadRequest, S::Request, false, None)),
            (
                400,
                "This model's maximum context length is 8192 tokens",
                (R::ContextOverflow, S::Request, false, None),
            ),
            (
                400,
                r#"{"code":"context_length_exceeded"}"#,
                (R::ContextOverflow, S::Request, false, None),
            ),
            (
                400,
                "prompt is too long: 300000 tokens",
                (R::ContextOverflow, S::Request, false, None),
            ),
            (
                413,
                "too many tokens",
                (R::BadRequest, S::Request, false, None),
            ),
            (422, "", (R::BadRequest, S::Request, false, None)),
        ];
        for (status, body, want) in cases {
            let got = http(*status, body);
            assert_eq!(row(&got), *want, "status {status} body {body:?}");
            assert_eq!(got.rule, None);
            assert_eq!(got.cooldown, None);
        }
    }

    #[test]
    fn transport_rows() {
        assert_eq!(
            row(&transport(TransportKind::Connect)),
            (R::Transport, S::Provider, true, None)
        );
        assert_eq!(
            row(&transport(TransportKind::Reset)),
            (R::Transport, S::Provider, true, None)
        );
        assert_eq!(
            row(&transport(TransportKind::Timeout)),
            (R::Timeout, S::Provider, true, None)
        );
    }

    #[test]
    fn quota_body_wins_over_concurrency_body() {
        let c = http(429, "too many concurrent requests; monthly limit reached");
        assert_eq!(c.reason, R::QuotaExhausted);
        let c = http(429, "并发数过高, 额度不足");
        assert_eq!(c.reason, R::QuotaExhausted);
    }

    #[test]
    fn breaker_counts_only_provider_failures() {
        for s in [408, 500, 502, 503, 504] {
            assert!(counts_for_breaker(&http(s, ""), Some(s)), "{s}");
        }
        for s in [400, 401, 402, 403, 404, 429, 501, 529] {
            assert!(!counts_for_breaker(&http(s, ""), Some(s)), "{s}");
        }
        let conc = http(429, "concurrency limit");
        assert!(!counts_for_breaker(&conc, Some(429)));
        for k in [
            TransportKind::Connect,
            TransportKind::Reset,
            TransportKind::Timeout,
        ] {
            assert!(counts_for_breaker(&transport(k), None));
        }
    }

    const RULES: &str = r#"
rules:
  - id: overloaded-400
    provider: "*"
    status: [400]
    match: ["model is overloaded"]
    reason: server_error
    scope: provider
  - id: overloaded-any
    provider: "*"
    match: ["overloaded"]
    reason: rate_limit_exceeded
    scope: connection
    cooldown_s: 30
  - id: ban-header
    provider: acme
    header: "X-Error-Type=Ban"
    reason: banned
    scope: connection
    terminal: banned
  - id: calm-503
    provider: acme
    status: [503]
    reason: bad_request
    scope: request
"#;

    fn with_rules(
        provider: &str,
        status: u16,
        headers: Option<&HeaderMap>,
        body: &str,
    ) -> Classification {
        let rules = RuleSet::from_texts(None, Some(("classification.yaml", RULES))).unwrap();
        classify(
            &rules,
            &ErrorInput {
                provider,
                status: Some(status),
                transport: None,
                headers,
                body: body.as_bytes(),
            },
        )
    }

    #[test]
    fn rules_apply_to_400_and_first_match_wins() {
        let c = with_rules("p", 400, None, "The model is overloaded");
        assert_eq!(c.rule.as_deref(), Some("overloaded-400"));
        assert_eq!(row(&c), (R::ServerError, S::Provider, true, None));
        // The operator's rule makes this 400 a provider failure the breaker counts...
        assert!(counts_for_breaker(&c, Some(400)));
        // ...but no rule makes a connection- or model-layer status trip it.
        for s in [401, 403, 404, 429] {
            assert!(!counts_for_breaker(&c, Some(s)), "{s}");
        }

        let c = with_rules("p", 500, None, "model is overloaded");
        assert_eq!(c.rule.as_deref(), Some("overloaded-any"));
        assert_eq!(c.cooldown, Some(Duration::from_secs(30)));
        assert_eq!(row(&c), (R::RateLimitExceeded, S::Connection, true, None));
    }

    #[test]
    fn rule_fields_override_and_defaults_apply() {
        let mut h = HeaderMap::new();
        h.insert("x-error-type", "ban".parse().unwrap());
        let c = with_rules("acme", 403, Some(&h), "");
        assert_eq!(c.rule.as_deref(), Some("ban-header"));
        // terminal set → retryable defaults to false
        assert_eq!(
            row(&c),
            (R::Banned, S::Connection, false, Some(TerminalState::Banned))
        );
        // Another provider: the built-in table answers.
        let c = with_rules("other", 403, Some(&h), "");
        assert_eq!((c.reason, c.rule), (R::AuthError, None));

        let c = with_rules("acme", 503, None, "");
        assert_eq!(c.rule.as_deref(), Some("calm-503"));
        assert_eq!(row(&c), (R::BadRequest, S::Request, false, None));
        assert!(!counts_for_breaker(&c, Some(503)));
    }

    #[test]
    fn rules_never_see_transport_failures() {
        let rules = RuleSet::from_texts(None, Some(("c.yaml", RULES))).unwrap();
        let c = classify(
            &rules,
            &ErrorInput {
                provider: "acme",
                status: None,
                transport: Some(TransportKind::Reset),
                headers: None,
                body: b"overloaded",
            },
        );
        assert_eq!((c.reason, c.rule), (R::Transport, None));
    }

    #[test]
    fn built_in_markers_are_lower_case() {
        for list in [
            BAN_MARKERS,
            AUTH_BAN_MARKERS,
            CREDIT_MARKERS,
            QUOTA_MARKERS,
            CONCURRENCY_MARKERS,
            CONTEXT_MARKERS,
        ] {
            for m in list {
                assert!(!m.is_empty());
                assert_eq!(*m, m.to_ascii_lowercase(), "{m}");
            }
        }
    }

    proptest! {
        #[test]
        fn classify_never_panics(
            status in proptest::option::of(any::<u16>()),
            kind in proptest::option::of(prop_oneof![
                Just(TransportKind::Connect),
                Just(TransportKind::Timeout),
                Just(TransportKind::Reset),
            ]),
            body in proptest::collection::vec(any::<u8>(), 0..2048),
            provider in "[a-z*]{0,6}",
        ) {
            let rules = RuleSet::from_texts(None, Some(("c.yaml", RULES))).unwrap();
            let mut h = HeaderMap::new();
            h.insert("x-error-type", "BAN".parse().unwrap());
            for set in [&rules, &RuleSet::empty()] {
                let c = classify(set, &ErrorInput {
                    provider: &provider,
                    status,
                    transport: kind,
                    headers: Some(&h),
                    body: &body,
                });
                if c.rule.is_none() {
                    // Built-in invariants.
                    prop_assert!(!(c.scope == S::Request && c.retryable));
                    prop_assert!(c.terminal.is_none() || c.scope == S::Connection);
                }
                let _ = counts_for_breaker(&c, status);
            }
        }
    }
}
