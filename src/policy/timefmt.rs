//! Parsers for the time formats upstreams put in response headers and error bodies.
//!
//! Three wire formats are read: RFC 3339 timestamps (`2024-05-01T12:00:30.250+02:00`,
//! Anthropic's reset headers), IMF-fixdate HTTP dates (`Sun, 06 Nov 1994 08:49:37 GMT`,
//! RFC 9110 §5.6.7, as in `Retry-After`) and the Go-style durations OpenAI sends (`6m0s`,
//! `20ms`, `1h2m3.5s`, `3 seconds`, or bare seconds such as `0.25`). Timestamps come back
//! as unix milliseconds (`Millis`), durations as `Duration`. Every function is total: no
//! input panics, and anything malformed, out of range, before 1970 or too large for the
//! result is `None`. Parsing is hand-written and strict; callers trim header values and
//! decide for themselves whether a zero duration or a past timestamp means anything.

use super::Millis;
use std::time::Duration;

const DAY_NAMES: [&str; 7] = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"];

const MONTH_NAMES: [&str; 12] = [
    "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
];

/// An RFC 3339 timestamp as unix milliseconds: `YYYY-MM-DD`, `T`, `t` or a space,
/// `hh:mm:ss`, an optional fraction of at least one digit (truncated to milliseconds),
/// then `Z`, `z` or `±hh:mm`. A zone is required. A leap second (`:60`) is read as `:59`;
/// instants before 1970 are `None`.
/// Unix milliseconds as an RFC 3339 UTC timestamp with whole seconds
/// (`2026-11-29T15:00:00Z`), the form every `reset_at` / `expires_at` field uses.
pub fn format_rfc3339(ms: Millis) -> String {
    let at = std::time::UNIX_EPOCH + Duration::from_millis(ms);
    humantime::format_rfc3339_seconds(at).to_string()
}

pub fn rfc3339_ms(s: &str) -> Option<Millis> {
    let [y0, y1, y2, y3, b'-', mo0, mo1, b'-', d0, d1, sep, h0, h1, b':', mi0, mi1, b':', s0, s1, rest @ ..] =
        s.as_bytes()
    else {
        return None;
    };
    if !matches!(sep, b'T' | b't' | b' ') {
        return None;
    }
    let (millis, zone) = match rest {
        [b'.', frac @ ..] => {
            let n = frac.iter().take_while(|b| b.is_ascii_digit()).count();
            if n == 0 {
                return None;
            }
            // The first three digits, padded with zeros: `.25` is 250 ms, `.123456` 123 ms.
            let padded = frac[..n].iter().chain(b"000").take(3);
            let ms = padded.fold(0, |ms, b| ms * 10 + i64::from(b - b'0'));
            (ms, &frac[n..])
        }
        _ => (0, rest),
    };
    let offset = match zone {
        [b'Z' | b'z'] => 0,
        [sign @ (b'+' | b'-'), oh0, oh1, b':', om0, om1] => {
            let (oh, om) = (digits(&[*oh0, *oh1])?, digits(&[*om0, *om1])?);
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
    let local = civil_seconds(
        digits(&[*y0, *y1, *y2, *y3])?,
        digits(&[*mo0, *mo1])?,
        digits(&[*d0, *d1])?,
        digits(&[*h0, *h1])?,
        digits(&[*mi0, *mi1])?,
        digits(&[*s0, *s1])?,
    )?;
    u64::try_from((local - offset) * 1_000 + millis).ok()
}

/// An IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`, RFC 9110 §5.6.7) as unix
/// milliseconds. Day and month names are matched without regard to case; the day name
/// is checked for spelling, not against the date. The obsolete RFC 850 and asctime
/// forms are not accepted; neither are dates before 1970. A leap second is read as `:59`.
pub fn http_date_ms(s: &str) -> Option<Millis> {
    let mut parts = s.split_ascii_whitespace();
    let day_name = parts.next()?.strip_suffix(',')?;
    if !DAY_NAMES.iter().any(|d| d.eq_ignore_ascii_case(day_name)) {
        return None;
    }
    let day = small_number(parts.next()?, 1, 2)?;
    let month_name = parts.next()?;
    let month = MONTH_NAMES
        .iter()
        .position(|m| m.eq_ignore_ascii_case(month_name))?;
    let year = small_number(parts.next()?, 4, 4)?;
    let mut clock = parts.next()?.split(':');
    let hour = small_number(clock.next()?, 2, 2)?;
    let minute = small_number(clock.next()?, 2, 2)?;
    let second = small_number(clock.next()?, 2, 2)?;
    if clock.next().is_some() || parts.next()? != "GMT" || parts.next().is_some() {
        return None;
    }
    let month = i64::try_from(month).ok()? + 1;
    let secs = civil_seconds(year, month, day, hour, minute, second)?;
    u64::try_from(secs * 1_000).ok()
}

/// A whole string that is one OpenAI-style duration: either a bare decimal number of
/// seconds (`12`, `0.25`, `.5`, `3.`) or one or more `<number><unit>` components, spaces
/// allowed before a unit and between components (`6m0s`, `1h2m3.5s`, `20ms`, `3 seconds`).
/// Units are case-sensitive: `ns`, `us`/`µs`/`μs`, `ms`, `s`, `m`, `h`, `d` and their
/// spelled-out forms (`sec`, `minutes`, `hours`, …). Zero (`0s`) is `Some(ZERO)`.
pub fn openai_duration(s: &str) -> Option<Duration> {
    let (d, used) = scan_duration(s.as_bytes(), true)?;
    (used == s.len()).then_some(d)
}

/// The duration at the start of `b` (same grammar as [`openai_duration`]) and the bytes
/// it spans, for reading waits out of free text. With `bare_seconds`, a lone number
/// without a unit means seconds; without it a unit is required, so that "retry after 3
/// attempts" is not read as a wait. Scanning stops at the first byte that does not
/// continue the duration; a number without a unit after a good component is left over.
pub fn scan_duration(b: &[u8], bare_seconds: bool) -> Option<(Duration, usize)> {
    let mut total = 0.0_f64;
    let mut end = 0;
    let mut components = 0;
    loop {
        let start = if components == 0 {
            0
        } else {
            end + spaces(&b[end..])
        };
        let Some((value, number_len)) = scan_number(&b[start..]) else {
            break;
        };
        let after_number = start + number_len;
        let unit_at = after_number + spaces(&b[after_number..]);
        let unit_len = b[unit_at..]
            .iter()
            .take_while(|c| is_unit_byte(**c))
            .count();
        let Some(factor) = unit_seconds(&b[unit_at..unit_at + unit_len]) else {
            if components == 0 && unit_len == 0 && bare_seconds {
                let d = Duration::try_from_secs_f64(value).ok()?;
                return Some((d, after_number));
            }
            break;
        };
        total += value * factor;
        end = unit_at + unit_len;
        components += 1;
    }
    if components == 0 {
        return None;
    }
    Some((Duration::try_from_secs_f64(total).ok()?, end))
}

/// An unsigned decimal number at the start of `b`: digits with at most one `.` and at
/// least one digit (`3`, `2.5`, `.5`, `3.`). No sign, exponent, `inf` or `nan`.
fn scan_number(b: &[u8]) -> Option<(f64, usize)> {
    let count_digits = |b: &[u8]| b.iter().take_while(|c| c.is_ascii_digit()).count();
    let int = count_digits(b);
    let mut len = int;
    if b.get(int) == Some(&b'.') {
        let frac = count_digits(&b[int + 1..]);
        if int + frac > 0 {
            len = int + 1 + frac;
        }
    }
    if len == 0 {
        return None;
    }
    let text = std::str::from_utf8(&b[..len]).ok()?;
    text.parse().ok().map(|v| (v, len))
}

/// Bytes a unit word is made of: ASCII letters and those of `µ` (U+00B5) and `μ` (U+03BC).
fn is_unit_byte(c: u8) -> bool {
    c.is_ascii_alphabetic() || matches!(c, 0xc2 | 0xb5 | 0xce | 0xbc)
}

/// Seconds per unit word.
fn unit_seconds(unit: &[u8]) -> Option<f64> {
    let secs = match unit {
        b"ns" | b"nanosecond" | b"nanoseconds" => 1e-9,
        // `µs` (micro sign) and `μs` (Greek mu) in UTF-8.
        b"us" | b"\xc2\xb5s" | b"\xce\xbcs" | b"microsecond" | b"microseconds" => 1e-6,
        b"ms" | b"msec" | b"msecs" | b"millisecond" | b"milliseconds" => 1e-3,
        b"s" | b"sec" | b"secs" | b"second" | b"seconds" => 1.0,
        b"m" | b"min" | b"mins" | b"minute" | b"minutes" => 60.0,
        b"h" | b"hr" | b"hrs" | b"hour" | b"hours" => 3_600.0,
        b"d" | b"day" | b"days" => 86_400.0,
        _ => return None,
    };
    Some(secs)
}

/// How many ASCII spaces `b` starts with.
fn spaces(b: &[u8]) -> usize {
    b.iter().take_while(|c| **c == b' ').count()
}

/// ASCII digits as a number (callers pass at most four).
fn digits(b: &[u8]) -> Option<i64> {
    b.iter().try_fold(0_i64, |n, c| {
        c.is_ascii_digit().then(|| n * 10 + i64::from(c - b'0'))
    })
}

/// A string of `min..=max` ASCII digits as a number.
fn small_number(s: &str, min: usize, max: usize) -> Option<i64> {
    if s.len() < min || s.len() > max {
        return None;
    }
    digits(s.as_bytes())
}

/// Seconds from the epoch to a UTC wall-clock time (negative before 1970), or `None`
/// when a field is out of range. A leap second (`:60`) is read as `:59`.
fn civil_seconds(
    year: i64,
    month: i64,
    day: i64,
    hour: i64,
    minute: i64,
    second: i64,
) -> Option<i64> {
    let valid = (1..=12).contains(&month)
        && (1..=days_in_month(year, month)).contains(&day)
        && hour <= 23
        && minute <= 59
        && second <= 60;
    valid.then(|| {
        days_from_civil(year, month, day) * 86_400 + hour * 3_600 + minute * 60 + second.min(59)
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
    use proptest::prelude::*;
    use std::time::UNIX_EPOCH;

    const T0: Millis = 1_700_000_000_000;

    #[test]
    fn epoch_and_known_dates() {
        assert_eq!(rfc3339_ms("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(rfc3339_ms("2000-03-01T00:00:00Z"), Some(951_868_800_000));
        assert_eq!(rfc3339_ms("2016-12-31T23:59:60Z"), Some(1_483_228_799_000));
        assert_eq!(rfc3339_ms("2023-11-14T22:13:20Z"), Some(T0));
    }

    #[test]
    fn rfc3339_requires_a_zone_and_a_well_formed_tail() {
        let cases: &[(&str, Option<Millis>)] = &[
            ("2023-11-14 22:13:20z", Some(T0)),
            ("2023-11-14T23:13:20.5+01:00", Some(T0 + 500)),
            ("2023-11-14T22:13:20-00:00", Some(T0)),
            // A pre-1970 wall clock is fine when the instant itself is not.
            ("1969-12-31T23:30:00-01:00", Some(1_800_000)),
            ("1970-01-01T00:30:00+01:00", None),
            ("2023-11-14T22:13:20", None),
            ("2023-11-14T22:13:20.", None),
            ("2023-11-14T22:13:20Zjunk", None),
            ("2023-11-14T22:13:20+00:00+01:00", None),
            ("2023-11-14T22:13:20+24:00", None),
            ("2023-11-14T22:13:20+0100", None),
            ("2023-13-14T22:13:20Z", None),
            ("2023-11-00T22:13:20Z", None),
            ("2023-11-14T22:60:20Z", None),
            ("2023-11-14T22:13:61Z", None),
            ("2023-11-14X22:13:20Z", None),
            ("", None),
        ];
        for (s, want) in cases {
            assert_eq!(rfc3339_ms(s), *want, "{s}");
        }
    }

    #[test]
    fn openai_durations_of_either_dialect() {
        let ms = |n: u64| Some(Duration::from_millis(n));
        let cases: &[(&str, Option<Duration>)] = &[
            ("6m0s", ms(360_000)),
            ("1h2m3.5s", ms(3_723_500)),
            ("20ms", ms(20)),
            ("150us", Some(Duration::from_micros(150))),
            ("150µs", Some(Duration::from_micros(150))),
            ("150μs", Some(Duration::from_micros(150))),
            ("7ns", Some(Duration::from_nanos(7))),
            ("12", ms(12_000)),
            ("0.25", ms(250)),
            (".5", ms(500)),
            ("3.", ms(3_000)),
            ("1m.5s", ms(60_500)),
            ("3 seconds", ms(3_000)),
            ("1m 30s", ms(90_000)),
            ("1d", ms(86_400_000)),
            ("0s", Some(Duration::ZERO)),
            ("", None),
            (".", None),
            ("s", None),
            ("1x", None),
            ("1.2.3s", None),
            ("1m30", None),
            ("6m0sx", None),
            ("6M0S", None),
            ("-1s", None),
            ("+3", None),
            ("1e3", None),
            (" 1s", None),
            ("1s ", None),
        ];
        for (s, want) in cases {
            assert_eq!(openai_duration(s), *want, "{s:?}");
        }
    }

    #[test]
    fn scanning_stops_where_the_duration_does() {
        let scan = |s: &str, bare| scan_duration(s.as_bytes(), bare);
        let secs = |n: u64| Duration::from_secs(n);
        assert_eq!(scan("1m30s. next", false), Some((secs(90), 5)));
        assert_eq!(scan("3 seconds, then", false), Some((secs(3), 9)));
        assert_eq!(scan("2s 5 more", false), Some((secs(2), 2)));
        assert_eq!(scan("30\",", true), Some((secs(30), 2)));
        assert_eq!(scan("30\",", false), None);
        assert_eq!(scan("3 attempts", true), None);
        assert_eq!(scan("a moment", true), None);
    }

    #[test]
    fn calendar_counts_every_day() {
        let mut expected = 0;
        for year in 1970..2400 {
            for month in 1..=12 {
                for day in 1..=days_in_month(year, month) {
                    assert_eq!(days_from_civil(year, month, day), expected);
                    expected += 1;
                }
            }
        }
        // 430 years hold 104 leap days (2100, 2200 and 2300 are not leap years).
        assert_eq!(expected, 430 * 365 + 104);
        assert_eq!(days_from_civil(1969, 12, 31), -1);
    }

    proptest! {
        #[test]
        fn parsers_never_panic(
            s in any::<String>(),
            raw in proptest::collection::vec(any::<u8>(), 0..64),
            bare in any::<bool>(),
        ) {
            let _ = rfc3339_ms(&s);
            let _ = http_date_ms(&s);
            let _ = openai_duration(&s);
            let _ = scan_duration(s.as_bytes(), bare);
            let _ = scan_duration(&raw, bare);
        }

        #[test]
        fn rfc3339_agrees_with_humantime(at in 0u64..253_402_300_800_000) {
            let t = UNIX_EPOCH + Duration::from_millis(at);
            let text = humantime::format_rfc3339_millis(t).to_string();
            prop_assert_eq!(rfc3339_ms(&text), Some(at));
        }
    }
}
