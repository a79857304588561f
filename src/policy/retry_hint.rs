//! Upstream retry hints (SPEC §5.3): how long the upstream itself asks us to wait.
//!
//! This protects the cooldown layer from guessing when the upstream already said when
//! it will accept traffic again. Sources are read in a fixed order and the first one
//! that yields a positive duration wins: `Retry-After` (delta-seconds or IMF-fixdate),
//! `retry-after-ms`, OpenAI's `x-ratelimit-reset-*`, Anthropic's
//! `anthropic-ratelimit-*-reset`, then phrases and Gemini's `retryDelay` in the error
//! body. Invariants: every function here is total — no input (headers, bytes, absurd
//! numbers) panics; zero, negative, past and unparseable hints are `None`, never a
//! zero-length cooldown. It deliberately does not cap hints: `max_hint` belongs to the
//! cooldown policy, which knows the configuration.

use super::timefmt::{http_date_ms, openai_duration, rfc3339_ms, scan_duration};
use super::Millis;
use http::HeaderMap;
use std::time::Duration;

/// Only this much of an error body is scanned: hints sit near the start, and a bounded
/// scan keeps a hostile body from costing more than a fixed amount of CPU.
const MAX_BODY_SCAN: usize = 64 * 1024;

const OPENAI_RESET: [&str; 2] = ["x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"];

const ANTHROPIC_RESET: [&str; 4] = [
    "anthropic-ratelimit-requests-reset",
    "anthropic-ratelimit-tokens-reset",
    "anthropic-ratelimit-input-tokens-reset",
    "anthropic-ratelimit-output-tokens-reset",
];

/// Lower-case phrases after which an error body states a wait ("try again in 20s").
const BODY_PHRASES: [&str; 9] = [
    "try again in",
    "try again after",
    "retry in",
    "retry after",
    "reset after",
    "resets after",
    "reset in",
    "resets in",
    "please wait",
];

/// The upstream's own hint of when to retry, as a duration from `now`.
///
/// Sources, first that yields a positive duration: `Retry-After` (delta-seconds,
/// possibly fractional, or an IMF-fixdate relative to `now`), `retry-after-ms`, the
/// longer of `x-ratelimit-reset-requests` / `-tokens` (OpenAI durations such as `6m0s`
/// or plain seconds), the latest of the `anthropic-ratelimit-*-reset` RFC 3339
/// timestamps, then the longest wait stated in the error body ("try again in 1m30s",
/// "retry after 3 seconds", `"retryDelay": "30s"`). Zero, negative, past or
/// unparseable values are `None`.
pub fn parse_hint(headers: &HeaderMap, body: &[u8], now: Millis) -> Option<Duration> {
    retry_after(headers, now)
        .or_else(|| retry_after_ms(headers))
        .or_else(|| openai_reset(headers))
        .or_else(|| anthropic_reset(headers, now))
        .or_else(|| body_hint(body))
}

/// Parses an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`, RFC 9110 §5.6.7) into unix
/// milliseconds. The obsolete RFC 850 and asctime forms are not accepted; neither are
/// dates before 1970. The day name is checked for spelling, not against the date.
/// Same as [`super::timefmt::http_date_ms`].
pub fn parse_http_date(s: &str) -> Option<Millis> {
    http_date_ms(s)
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name)?.to_str().ok().map(str::trim)
}

/// A positive, finite number of seconds as a `Duration`; everything else is `None`.
fn seconds(v: f64) -> Option<Duration> {
    if !v.is_finite() || v <= 0.0 {
        return None;
    }
    Duration::try_from_secs_f64(v).ok().filter(|d| !d.is_zero())
}

/// A deadline in the future as the wait from `now`.
fn until(deadline: Millis, now: Millis) -> Option<Duration> {
    (deadline > now).then(|| Duration::from_millis(deadline - now))
}

fn retry_after(headers: &HeaderMap, now: Millis) -> Option<Duration> {
    let v = header_str(headers, "retry-after")?;
    match whole_number(v) {
        Some(secs) => seconds(secs),
        None => until(parse_http_date(v)?, now),
    }
}

fn retry_after_ms(headers: &HeaderMap) -> Option<Duration> {
    let v = header_str(headers, "retry-after-ms")?;
    seconds(whole_number(v)? / 1_000.0)
}

fn openai_reset(headers: &HeaderMap) -> Option<Duration> {
    OPENAI_RESET
        .iter()
        .filter_map(|name| openai_duration(header_str(headers, name)?))
        .filter(|d| !d.is_zero())
        .max()
}

fn anthropic_reset(headers: &HeaderMap, now: Millis) -> Option<Duration> {
    ANTHROPIC_RESET
        .iter()
        .filter_map(|name| rfc3339_ms(header_str(headers, name)?))
        .max()
        .and_then(|deadline| until(deadline, now))
}

/// The longest wait any phrase or `retryDelay` field of the body states: several hints
/// in one body (Gemini sends both) must all be honoured, so the longest wins.
fn body_hint(body: &[u8]) -> Option<Duration> {
    let body = &body[..body.len().min(MAX_BODY_SCAN)];
    let text = String::from_utf8_lossy(body).to_ascii_lowercase();
    let bytes = text.as_bytes();
    let mut best: Option<Duration> = None;
    let mut offer = |found: Option<(Duration, usize)>| {
        if let Some((d, _)) = found.filter(|(d, _)| !d.is_zero()) {
            best = Some(best.map_or(d, |b| b.max(d)));
        }
    };
    for phrase in BODY_PHRASES {
        for (at, _) in text.match_indices(phrase) {
            let rest = skip_spaces(&bytes[at + phrase.len()..]);
            offer(scan_duration(rest, false));
        }
    }
    for (at, key) in text.match_indices("\"retrydelay\"") {
        let rest = skip_spaces(&bytes[at + key.len()..]);
        let Some(rest) = rest.strip_prefix(b":") else {
            continue;
        };
        let rest = skip_spaces(rest);
        let rest = rest.strip_prefix(b"\"").unwrap_or(rest);
        offer(scan_duration(rest, true));
    }
    best
}

fn skip_spaces(b: &[u8]) -> &[u8] {
    let n = b.iter().take_while(|c| c.is_ascii_whitespace()).count();
    &b[n..]
}

/// A string that is exactly one unsigned decimal number ("3", "2.5"; not "3." or ".5").
fn whole_number(s: &str) -> Option<f64> {
    let (int, frac) = s.split_once('.').unwrap_or((s, "0"));
    let all_digits = |t: &str| !t.is_empty() && t.bytes().all(|c| c.is_ascii_digit());
    if !all_digits(int) || !all_digits(frac) {
        return None;
    }
    s.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T0: Millis = 1_700_000_000_000;

    use crate::policy::header_map as headers;
    use http::HeaderValue;

    fn secs(s: f64) -> Option<Duration> {
        Some(Duration::from_secs_f64(s))
    }

    #[test]
    fn http_dates() {
        let cases: &[(&str, Option<Millis>)] = &[
            ("Sun, 06 Nov 1994 08:49:37 GMT", Some(784_111_777_000)),
            ("Thu, 01 Jan 1970 00:00:00 GMT", Some(0)),
            ("Tue, 14 Nov 2023 22:13:20 GMT", Some(T0)),
            ("Thu, 29 Feb 2024 12:00:00 GMT", Some(1_709_208_000_000)),
            ("Fri, 31 Dec 1999 23:59:60 GMT", Some(946_684_799_000)),
            ("Thu, 29 Feb 2023 12:00:00 GMT", None),
            ("Sun, 06 Nov 1994 08:49:37 UTC", None),
            ("Sun 06 Nov 1994 08:49:37 GMT", None),
            ("Sunday, 06-Nov-94 08:49:37 GMT", None),
            ("Sun Nov  6 08:49:37 1994", None),
            ("Wed, 31 Dec 1969 23:59:59 GMT", None),
            ("Sun, 06 Foo 1994 08:49:37 GMT", None),
            ("Sun, 06 Nov 1994 24:00:00 GMT", None),
            ("Sun, 06 Nov 1994 08:49:37 GMT extra", None),
            ("", None),
        ];
        for (s, want) in cases {
            assert_eq!(parse_http_date(s), *want, "{s}");
        }
    }

    /// Header pairs and the hint they should yield.
    type HeaderCase<'a> = (&'a [(&'a str, &'a str)], Option<Duration>);

    #[test]
    fn header_hints() {
        let cases: &[HeaderCase] = &[
            (&[("retry-after", "20")], secs(20.0)),
            (&[("retry-after", " 2.5 ")], secs(2.5)),
            // HTTP-date, 31 s after T0 (T0 = Tue, 14 Nov 2023 22:13:20 GMT).
            (
                &[("retry-after", "Tue, 14 Nov 2023 22:13:51 GMT")],
                secs(31.0),
            ),
            (&[("retry-after", "Tue, 14 Nov 2023 22:13:00 GMT")], None),
            (&[("retry-after", "0")], None),
            (&[("retry-after", "-5")], None),
            (&[("retry-after", "soon")], None),
            (&[("retry-after-ms", "1500")], secs(1.5)),
            (
                &[("retry-after", "0"), ("retry-after-ms", "250")],
                secs(0.25),
            ),
            (
                &[("retry-after", "7"), ("retry-after-ms", "250")],
                secs(7.0),
            ),
            (&[("x-ratelimit-reset-requests", "6m0s")], secs(360.0)),
            (&[("x-ratelimit-reset-tokens", "20ms")], secs(0.02)),
            (&[("x-ratelimit-reset-tokens", "1h2m3.5s")], secs(3723.5)),
            (&[("x-ratelimit-reset-requests", "12")], secs(12.0)),
            (
                &[
                    ("x-ratelimit-reset-requests", "1s"),
                    ("x-ratelimit-reset-tokens", "6m0s"),
                ],
                secs(360.0),
            ),
            (
                &[
                    ("x-ratelimit-reset-requests", "bogus"),
                    ("x-ratelimit-reset-tokens", "3s"),
                ],
                secs(3.0),
            ),
            (&[("x-ratelimit-reset-requests", "6m0sx")], None),
            (&[("x-ratelimit-reset-requests", "0s")], None),
            (
                &[("anthropic-ratelimit-requests-reset", "2023-11-14T22:14:20Z")],
                secs(60.0),
            ),
            (
                &[
                    ("anthropic-ratelimit-requests-reset", "2023-11-14T22:13:30Z"),
                    ("anthropic-ratelimit-tokens-reset", "2023-11-14T22:13:50.5Z"),
                    (
                        "anthropic-ratelimit-input-tokens-reset",
                        "2023-11-14T22:13:25Z",
                    ),
                ],
                secs(30.5),
            ),
            (
                &[(
                    "anthropic-ratelimit-output-tokens-reset",
                    "2023-11-14T23:13:40+01:00",
                )],
                secs(20.0),
            ),
            (
                &[(
                    "anthropic-ratelimit-output-tokens-reset",
                    "2023-11-14T22:13:40+00:00",
                )],
                secs(20.0),
            ),
            (
                &[("anthropic-ratelimit-requests-reset", "2023-11-14T22:00:00Z")],
                None,
            ),
            // Precedence: Retry-After beats the reset headers.
            (
                &[
                    ("retry-after", "4"),
                    ("x-ratelimit-reset-tokens", "6m0s"),
                    ("anthropic-ratelimit-requests-reset", "2023-11-14T22:14:20Z"),
                ],
                secs(4.0),
            ),
            (
                &[
                    ("x-ratelimit-reset-tokens", "9s"),
                    ("anthropic-ratelimit-requests-reset", "2023-11-14T22:14:20Z"),
                ],
                secs(9.0),
            ),
        ];
        for (pairs, want) in cases {
            assert_eq!(parse_hint(&headers(pairs), b"", T0), *want, "{pairs:?}");
        }
    }

    #[test]
    fn body_hints() {
        let cases: &[(&str, Option<Duration>)] = &[
            ("Rate limit reached. Please try again in 20s.", secs(20.0)),
            ("Please try again in 1m30s. Visit ...", secs(90.0)),
            ("Too many requests, retry after 3 seconds", secs(3.0)),
            ("Quota exceeded. Please retry in 2.5 seconds.", secs(2.5)),
            ("limit will reset after 12s", secs(12.0)),
            ("Try Again In 5 Minutes", secs(300.0)),
            ("try again in 500ms", secs(0.5)),
            (
                r#"{"error":{"details":[{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay": "30s"}]}}"#,
                secs(30.0),
            ),
            (
                r#"{"message":"Please retry in 31.2s.","details":[{"retryDelay":"31s"}]}"#,
                secs(31.2),
            ),
            ("retry after 3 attempts", None),
            ("try again in a moment", None),
            ("try again in -5s", None),
            ("try again in 0s", None),
            ("retry later", None),
            ("", None),
        ];
        for (body, want) in cases {
            assert_eq!(
                parse_hint(&HeaderMap::new(), body.as_bytes(), T0),
                *want,
                "{body}"
            );
        }
    }

    #[test]
    fn headers_win_over_body() {
        let h = headers(&[("retry-after", "2")]);
        assert_eq!(parse_hint(&h, b"try again in 60s", T0), secs(2.0));
    }

    #[test]
    fn absurd_numbers_are_rejected_not_panics() {
        let huge = "9".repeat(400);
        for v in [huge.as_str(), "1e9999", "inf", "NaN", "+3"] {
            let h = headers(&[("retry-after", v), ("x-ratelimit-reset-tokens", v)]);
            assert_eq!(parse_hint(&h, b"", T0), None, "{v}");
        }
        let body = format!("try again in {huge}s");
        assert_eq!(parse_hint(&HeaderMap::new(), body.as_bytes(), T0), None);
    }

    proptest! {
        #[test]
        fn parse_hint_never_panics(
            v in any::<String>(),
            raw in proptest::collection::vec(any::<u8>(), 0..64),
            body in proptest::collection::vec(any::<u8>(), 0..256),
            now in any::<u64>(),
        ) {
            let mut h = HeaderMap::new();
            let names = ["retry-after", "retry-after-ms", "x-ratelimit-reset-requests",
                "x-ratelimit-reset-tokens", "anthropic-ratelimit-requests-reset",
                "anthropic-ratelimit-output-tokens-reset"];
            for (i, name) in names.iter().enumerate() {
                let value = if i % 2 == 0 {
                    HeaderValue::from_str(&v).ok()
                } else {
                    HeaderValue::from_bytes(&raw).ok()
                };
                if let Some(value) = value {
                    h.insert(*name, value);
                }
            }
            let _ = parse_hint(&h, &body, now);
            let _ = parse_hint(&HeaderMap::new(), v.as_bytes(), now);
            let _ = parse_http_date(&v);
        }

        #[test]
        fn phrase_with_any_text_never_panics(prefix in ".{0,20}", tail in ".{0,40}") {
            for phrase in BODY_PHRASES {
                let body = format!("{prefix}{phrase} {tail}");
                let _ = parse_hint(&HeaderMap::new(), body.as_bytes(), T0);
            }
            let body = format!("{prefix}\"retryDelay\": \"{tail}");
            let _ = parse_hint(&HeaderMap::new(), body.as_bytes(), T0);
        }

        #[test]
        fn delta_seconds_round_trip(n in 1u32..10_000_000) {
            let h = headers(&[("retry-after", &n.to_string())]);
            prop_assert_eq!(parse_hint(&h, b"", T0), Some(Duration::from_secs(u64::from(n))));
        }
    }
}
