//! Upstream rate-limit state from response headers: the input of `reset-aware` (SPEC §5.12).
//!
//! Two header families are read. OpenAI sends `x-ratelimit-remaining-requests` (a count)
//! and `x-ratelimit-reset-requests` (a Go-style duration from now: `1s`, `6m0s`, `20ms`,
//! `1h2m3.5s`); Anthropic sends `anthropic-ratelimit-requests-remaining` and
//! `anthropic-ratelimit-requests-reset` (an RFC 3339 timestamp). Both are turned into
//! one `RateLimitInfo` with an absolute reset time. The values are read by the strict,
//! panic-free parsers of `policy::timefmt`: a malformed value is simply unknown.

use crate::policy::fields::Fields;
use crate::policy::timefmt::{openai_duration, rfc3339_ms};
use crate::policy::Millis;
use std::time::Duration;

const OPENAI_REMAINING: &str = "x-ratelimit-remaining-requests";
const OPENAI_RESET: &str = "x-ratelimit-reset-requests";
const ANTHROPIC_REMAINING: &str = "anthropic-ratelimit-requests-remaining";
const ANTHROPIC_RESET: &str = "anthropic-ratelimit-requests-reset";

/// Rate-limit state reported by an upstream response.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RateLimitInfo {
    /// Requests left in the current window.
    pub remaining: Option<u64>,
    /// When the current window resets (unix ms).
    pub reset_at: Option<Millis>,
}

impl RateLimitInfo {
    /// The state as it stands at `now`: once `reset_at` has passed the window has renewed,
    /// so nothing is known any more (the old count must not keep a connection last).
    pub fn current(self, now: Millis) -> RateLimitInfo {
        match self.reset_at {
            Some(at) if at <= now => RateLimitInfo::default(),
            _ => self,
        }
    }
}

/// Reads the request-limit headers of either family (OpenAI first when both are sent).
/// `None` when no such header is present or none of them holds a readable value.
pub fn parse_rate_limit(headers: &(impl Fields + ?Sized), now: Millis) -> Option<RateLimitInfo> {
    let remaining = header(headers, OPENAI_REMAINING)
        .and_then(count)
        .or_else(|| header(headers, ANTHROPIC_REMAINING).and_then(count));
    let reset_at = header(headers, OPENAI_RESET)
        .and_then(openai_duration)
        .map(|d| now.saturating_add(ceil_ms(d)))
        .or_else(|| header(headers, ANTHROPIC_RESET).and_then(rfc3339_ms));
    (remaining.is_some() || reset_at.is_some()).then_some(RateLimitInfo {
        remaining,
        reset_at,
    })
}

fn header<'a>(headers: &'a (impl Fields + ?Sized), name: &str) -> Option<&'a str> {
    headers.field_str(name).map(str::trim)
}

/// A plain non-negative integer.
fn count(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// `d` in whole milliseconds, rounded up (150 µs is 1 ms) and saturating.
fn ceil_ms(d: Duration) -> Millis {
    Millis::try_from(d.as_nanos().div_ceil(1_000_000)).unwrap_or(Millis::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Millis = 1_700_000_000_000;
    /// 2024-01-01T00:00:00Z.
    const NEW_YEAR_2024: Millis = 1_704_067_200_000;

    use crate::policy::header_map as headers;

    #[test]
    fn openai_headers() {
        let cases: &[(&str, &str, Option<u64>, Option<Millis>)] = &[
            ("59", "1s", Some(59), Some(T0 + 1_000)),
            ("0", "6m0s", Some(0), Some(T0 + 360_000)),
            ("12", "20ms", Some(12), Some(T0 + 20)),
            ("3", "1h2m3.5s", Some(3), Some(T0 + 3_723_500)),
            ("3", "0.25", Some(3), Some(T0 + 250)),
            ("3", "150us", Some(3), Some(T0 + 1)),
            ("3", "0s", Some(3), Some(T0)),
            ("many", "1s", None, Some(T0 + 1_000)),
            ("7", "soon", Some(7), None),
            ("7", "1x", Some(7), None),
            ("7", "1.2.3s", Some(7), None),
            ("7", "s", Some(7), None),
            ("-1", "-1s", None, None),
        ];
        for (rem, reset, want_rem, want_reset) in cases {
            let h = headers(&[
                ("x-ratelimit-remaining-requests", rem),
                ("x-ratelimit-reset-requests", reset),
            ]);
            let got = parse_rate_limit(&h, T0);
            let want = (want_rem.is_some() || want_reset.is_some()).then_some(RateLimitInfo {
                remaining: *want_rem,
                reset_at: *want_reset,
            });
            assert_eq!(got, want, "{rem:?} / {reset:?}");
        }
    }

    #[test]
    fn anthropic_headers() {
        let cases: &[(&str, &str, Option<u64>, Option<Millis>)] = &[
            ("40", "2024-01-01T00:00:00Z", Some(40), Some(NEW_YEAR_2024)),
            (
                "0",
                "2024-01-01T00:00:30Z",
                Some(0),
                Some(NEW_YEAR_2024 + 30_000),
            ),
            (
                "1",
                "2024-01-01T01:00:00+01:00",
                Some(1),
                Some(NEW_YEAR_2024),
            ),
            (
                "1",
                "2023-12-31T22:30:00-01:30",
                Some(1),
                Some(NEW_YEAR_2024),
            ),
            (
                "1",
                "2024-01-01t00:00:00.25z",
                Some(1),
                Some(NEW_YEAR_2024 + 250),
            ),
            (
                "1",
                "2024-01-01T00:00:00.123456Z",
                Some(1),
                Some(NEW_YEAR_2024 + 123),
            ),
            (
                "1",
                "2024-02-29T00:00:00Z",
                Some(1),
                Some(NEW_YEAR_2024 + 59 * 86_400_000),
            ),
            ("1", "2023-02-29T00:00:00Z", Some(1), None),
            ("1", "2024-01-01T00:00:00", Some(1), None),
            ("1", "2024-01-01T24:00:00Z", Some(1), None),
            ("1", "1969-12-31T23:59:59Z", Some(1), None),
            ("1", "2024-01-01T00:00:00.Z", Some(1), None),
            ("1", "not a date", Some(1), None),
        ];
        for (rem, reset, want_rem, want_reset) in cases {
            let h = headers(&[
                ("anthropic-ratelimit-requests-remaining", rem),
                ("anthropic-ratelimit-requests-reset", reset),
            ]);
            let want = RateLimitInfo {
                remaining: *want_rem,
                reset_at: *want_reset,
            };
            assert_eq!(parse_rate_limit(&h, T0), Some(want), "{reset:?}");
        }
    }

    #[test]
    fn absent_or_unrelated_headers_are_none() {
        assert_eq!(parse_rate_limit(&http::HeaderMap::new(), T0), None);
        let h = headers(&[
            ("retry-after", "5"),
            ("x-ratelimit-remaining-tokens", "100"),
        ]);
        assert_eq!(parse_rate_limit(&h, T0), None);
        let h = headers(&[("x-ratelimit-remaining-requests", "oops")]);
        assert_eq!(parse_rate_limit(&h, T0), None);
    }

    #[test]
    fn one_header_alone_is_enough_and_openai_wins() {
        let h = headers(&[("x-ratelimit-remaining-requests", "5")]);
        let info = parse_rate_limit(&h, T0).unwrap();
        assert_eq!((info.remaining, info.reset_at), (Some(5), None));
        let h = headers(&[
            ("x-ratelimit-remaining-requests", "5"),
            ("anthropic-ratelimit-requests-remaining", "9"),
            ("anthropic-ratelimit-requests-reset", "2024-01-01T00:00:00Z"),
        ]);
        let info = parse_rate_limit(&h, T0).unwrap();
        assert_eq!(
            (info.remaining, info.reset_at),
            (Some(5), Some(NEW_YEAR_2024))
        );
    }

    #[test]
    fn info_is_forgotten_once_the_window_resets() {
        let info = RateLimitInfo {
            remaining: Some(0),
            reset_at: Some(T0 + 1_000),
        };
        assert_eq!(info.current(T0 + 999), info);
        assert_eq!(info.current(T0 + 1_000), RateLimitInfo::default());
        let unknown_reset = RateLimitInfo {
            remaining: Some(3),
            reset_at: None,
        };
        assert_eq!(unknown_reset.current(T0), unknown_reset);
    }
}
