//! Upstream rate-limit state from response headers: the input of `reset-aware` (SPEC §5.12).
//!
//! Two header families are read. OpenAI sends `x-ratelimit-remaining-requests` (a count)
//! and `x-ratelimit-reset-requests` (a Go-style duration from now: `1s`, `6m0s`, `20ms`,
//! `1h2m3.5s`); Anthropic sends `anthropic-ratelimit-requests-remaining` and
//! `anthropic-ratelimit-requests-reset` (an RFC 3339 timestamp). Both are turned into
//! one `RateLimitInfo` with an absolute reset time. Parsing is hand-written, strict and
//! panic-free: a malformed value is simply unknown.

use crate::policy::Millis;
use http::HeaderMap;

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
pub fn parse_rate_limit(headers: &HeaderMap, now: Millis) -> Option<RateLimitInfo> {
    let remaining = header(headers, OPENAI_REMAINING)
        .and_then(count)
        .or_else(|| header(headers, ANTHROPIC_REMAINING).and_then(count));
    let reset_at = header(headers, OPENAI_RESET)
        .and_then(duration_ms)
        .map(|ms| now.saturating_add(ms))
        .or_else(|| header(headers, ANTHROPIC_RESET).and_then(rfc3339_ms));
    (remaining.is_some() || reset_at.is_some()).then_some(RateLimitInfo {
        remaining,
        reset_at,
    })
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name)?.to_str().ok().map(str::trim)
}

/// A plain non-negative integer.
fn count(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// Digits with at most one decimal point and at least one digit.
fn decimal(s: &str) -> Option<f64> {
    let digits = s.bytes().filter(u8::is_ascii_digit).count();
    let points = s.bytes().filter(|b| *b == b'.').count();
    if digits == 0 || points > 1 || digits + points != s.len() {
        return None;
    }
    s.parse().ok()
}

/// A Go-style duration (`6m0s`, `1h2m3.5s`, `20ms`, `150us`) or bare seconds (`0.5`),
/// rounded up to whole milliseconds.
fn duration_ms(s: &str) -> Option<Millis> {
    if s.is_empty() {
        return None;
    }
    if let Some(secs) = decimal(s) {
        return whole_ms(secs * 1_000.0);
    }
    let mut rest = s;
    let mut total = 0.0;
    while !rest.is_empty() {
        let split = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, tail) = rest.split_at(split);
        let value = decimal(number)?;
        let split = tail
            .find(|c: char| !(c.is_ascii_alphabetic() || c == 'µ' || c == 'μ'))
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(split);
        let factor = match unit {
            "h" => 3_600_000.0,
            "m" => 60_000.0,
            "s" => 1_000.0,
            "ms" => 1.0,
            "us" | "µs" | "μs" => 1e-3,
            "ns" => 1e-6,
            _ => return None,
        };
        total += value * factor;
        rest = tail;
    }
    whole_ms(total)
}

fn whole_ms(v: f64) -> Option<Millis> {
    (v.is_finite() && v >= 0.0).then(|| v.ceil().min(Millis::MAX as f64) as Millis)
}

/// An RFC 3339 timestamp (`2024-05-01T12:00:30Z`, `…T12:00:30.250+02:00`) as unix ms.
/// Dates before 1970 are `None`; a leap second (`:60`) is read as `:59`.
fn rfc3339_ms(s: &str) -> Option<Millis> {
    let [y0, y1, y2, y3, b'-', mo0, mo1, b'-', d0, d1, sep, h0, h1, b':', mi0, mi1, b':', s0, s1, rest @ ..] =
        s.as_bytes()
    else {
        return None;
    };
    if !matches!(sep, b'T' | b't' | b' ') {
        return None;
    }
    let year = number(&[*y0, *y1, *y2, *y3])?;
    let month = number(&[*mo0, *mo1])?;
    let day = number(&[*d0, *d1])?;
    let hour = number(&[*h0, *h1])?;
    let minute = number(&[*mi0, *mi1])?;
    let second = number(&[*s0, *s1])?;
    if !(1..=12).contains(&month)
        || day < 1
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    let (millis, rest) = match rest {
        [b'.', frac @ ..] => {
            let n = frac.iter().take_while(|b| b.is_ascii_digit()).count();
            if n == 0 {
                return None;
            }
            let mut ms = 0;
            for i in 0..3 {
                ms = ms * 10
                    + frac
                        .get(i)
                        .filter(|_| i < n)
                        .map_or(0, |b| i64::from(b - b'0'));
            }
            (ms, &frac[n..])
        }
        _ => (0, rest),
    };
    let offset = match rest {
        [b'Z' | b'z'] => 0,
        [sign @ (b'+' | b'-'), oh0, oh1, b':', om0, om1] => {
            let (oh, om) = (number(&[*oh0, *oh1])?, number(&[*om0, *om1])?);
            if oh > 23 || om > 59 {
                return None;
            }
            let secs = oh * 3_600 + om * 60;
            if *sign == b'+' {
                secs
            } else {
                -secs
            }
        }
        _ => return None,
    };
    let secs =
        days_from_civil(year, month, day) * 86_400 + hour * 3_600 + minute * 60 + second.min(59)
            - offset;
    u64::try_from(secs * 1_000 + millis).ok()
}

/// A run of ASCII digits as a number.
fn number(digits: &[u8]) -> Option<i64> {
    digits.iter().try_fold(0i64, |n, b| {
        b.is_ascii_digit().then(|| n * 10 + i64::from(b - b'0'))
    })
}

fn days_in_month(year: i64, month: i64) -> i64 {
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    match month {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days from 1970-01-01 to a valid proleptic Gregorian date (negative before 1970).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let year_of_era = y - era * 400;
    let month_from_march = (month + 9) % 12;
    let day_of_year = (153 * month_from_march + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderName, HeaderValue};

    const T0: Millis = 1_700_000_000_000;
    /// 2024-01-01T00:00:00Z.
    const NEW_YEAR_2024: Millis = 1_704_067_200_000;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

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
    fn epoch_and_known_dates() {
        assert_eq!(rfc3339_ms("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(rfc3339_ms("2000-03-01T00:00:00Z"), Some(951_868_800_000));
        assert_eq!(rfc3339_ms("2016-12-31T23:59:60Z"), Some(1_483_228_799_000));
        assert_eq!(rfc3339_ms("2023-11-14T22:13:20Z"), Some(T0));
    }

    #[test]
    fn absent_or_unrelated_headers_are_none() {
        assert_eq!(parse_rate_limit(&HeaderMap::new(), T0), None);
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
