//! Property tests (issue #8) for every parser fed by the network or by operators: SSE
//! assembly and progress, the stream boundary tracker, retry hints and the time formats
//! behind them, rate-limit headers, the JSON body rewrite, route normalisation, session
//! headers, error-text markers, rule files and the config file with its units.
//!
//! Each parser gets three kinds of property: it never panics on arbitrary input and on
//! structure-aware near-valid input; inputs are bounded so every case finishes (the
//! adversarial ones run under a deadline); and, where an oracle is cheap, its answer is
//! checked against a small reference model or a round trip. Properties on private state
//! (buffer capacities) live next to the code, in `src/sse.rs` and `src/rules/text.rs`.

// Integration tests: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

/// Runs `f` on its own thread and fails the test if it has not returned by `limit`: the
/// hang detector for the adversarial inputs (a stuck thread dies with the process).
fn finishes<T: Send + 'static>(
    what: &str,
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(RecvTimeoutError::Timeout) => panic!("{what}: still running after {limit:?}"),
        Err(RecvTimeoutError::Disconnected) => panic!("{what}: panicked"),
    }
}

/// Cuts `bytes` at the given positions (taken modulo the length), in order.
fn cut<'a>(bytes: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut at: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    at.sort_unstable();
    let mut chunks = Vec::with_capacity(at.len() + 1);
    let mut from = 0;
    for a in at {
        chunks.push(&bytes[from..a]);
        from = a;
    }
    chunks.push(&bytes[from..]);
    chunks
}

/// A tiny deterministic generator (xorshift64*) for choices a writer makes while
/// serialising a generated value: whitespace, escapes, letter case.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// True one time in `n`.
    fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }
}

/// `s` with each ASCII letter upper- or lower-cased at random.
fn random_case(s: &str, rng: &mut Rng) -> String {
    s.chars()
        .map(|c| {
            if rng.one_in(2) {
                c.to_ascii_uppercase()
            } else {
                c.to_ascii_lowercase()
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// SSE: `SseAssembler`, `SseProgress`, `EventBoundary` + the error event appended after it.
// ---------------------------------------------------------------------------------------
mod sse {
    use super::*;
    use sluice::codes::AbortReason;
    use sluice::proxy::framing::EventBoundary;
    use sluice::proxy::respond::sse_error_event;
    use sluice::proxy::routes::Route;
    use sluice::sse::{SseAssembler, SseEvent, SseProgress};

    const BOM: &[u8] = b"\xEF\xBB\xBF";
    /// The assembler's documented limits: field names of at most 8 bytes are read (a
    /// longer one is an unknown field), an event name over 256 bytes drops the event.
    const NAME_MAX: usize = 8;
    const EVENT_NAME_MAX: usize = 256;

    fn assemble(max: usize, chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut a = SseAssembler::new(max);
        let mut out = Vec::new();
        for c in chunks {
            a.feed(c, &mut out);
        }
        out
    }

    /// The complete lines of a stream (LF, CRLF or CR ends); an unfinished last line is
    /// left out, as it can never complete an event.
    fn lines(stream: &[u8]) -> Vec<&[u8]> {
        let mut out = Vec::new();
        let (mut start, mut i) = (0, 0);
        while i < stream.len() {
            let b = stream[i];
            if b == b'\n' || b == b'\r' {
                out.push(&stream[start..i]);
                if b == b'\r' && stream.get(i + 1) == Some(&b'\n') {
                    i += 1;
                }
                start = i + 1;
            }
            i += 1;
        }
        out
    }

    /// Reference model of the assembler, written from its documentation and the event
    /// stream rules over a whole (unchunked) stream: a line-by-line interpreter.
    fn reference(stream: &[u8], max: usize) -> Vec<SseEvent> {
        let mut out = Vec::new();
        let (mut data, mut has_data, mut event, mut dropped) =
            (Vec::new(), false, Vec::new(), false);
        for (n, line) in lines(stream).into_iter().enumerate() {
            if line.is_empty() {
                if has_data && !dropped {
                    out.push(SseEvent {
                        event: (!event.is_empty())
                            .then(|| String::from_utf8_lossy(&event).into_owned()),
                        data: String::from_utf8_lossy(&data).into_owned(),
                    });
                }
                (data, has_data, event, dropped) = (Vec::new(), false, Vec::new(), false);
                continue;
            }
            if line[0] == b':' {
                continue;
            }
            let (name, value) = match line.iter().position(|&b| b == b':') {
                Some(c) => (&line[..c], &line[c + 1..]),
                None => (line, &[][..]),
            };
            if name.len() > NAME_MAX || dropped {
                continue;
            }
            let name = if n == 0 {
                name.strip_prefix(BOM).unwrap_or(name)
            } else {
                name
            };
            let value = value.strip_prefix(b" ").unwrap_or(value);
            match name {
                b"data" => {
                    if has_data {
                        data.push(b'\n');
                    }
                    has_data = true;
                    data.extend_from_slice(value);
                    dropped = data.len() > max;
                }
                b"event" => {
                    dropped = value.len() > EVENT_NAME_MAX;
                    event = value.to_vec();
                }
                _ => {}
            }
        }
        out
    }

    /// Pieces that make random bytes look like (broken) event streams.
    fn soup() -> impl Strategy<Value = Vec<u8>> {
        let piece = prop_oneof![
            4 => prop_oneof![
                Just(b"data:".to_vec()),
                Just(b"data: ".to_vec()),
                Just(b"event: ".to_vec()),
                Just(b"event:ping".to_vec()),
                Just(b"data".to_vec()),
                Just(b"event".to_vec()),
                Just(b"id: 1".to_vec()),
                Just(b"retry: 10".to_vec()),
                Just(b":".to_vec()),
                Just(b" ".to_vec()),
                Just(b"\n".to_vec()),
                Just(b"\r".to_vec()),
                Just(b"\r\n".to_vec()),
                Just(b"\n\n".to_vec()),
                Just(BOM.to_vec()),
                Just("é😀".as_bytes().to_vec()),
                Just(b"\xFF\xC3".to_vec()),
            ],
            2 => proptest::collection::vec(any::<u8>(), 0..12),
            1 => (254usize..259).prop_map(|n| vec![b'n'; n]),
            1 => (254usize..259).prop_map(|n| format!("event: {}\ndata: x\n\n", "n".repeat(n)).into_bytes()),
        ];
        proptest::collection::vec(piece, 0..60).prop_map(|v| v.concat())
    }

    /// A well-formed event for the progress tracker: a name (maybe `ping`), data lines
    /// that may be blank, and whether a comment precedes it.
    #[derive(Clone, Debug)]
    struct Ev {
        name: Option<String>,
        lines: Vec<String>,
        comment: bool,
    }

    fn ev() -> impl Strategy<Value = Ev> {
        (
            proptest::option::of(prop_oneof![
                Just("ping".to_string()),
                Just("content_block_delta".to_string()),
                "[a-z_]{1,12}",
            ]),
            proptest::collection::vec(
                prop_oneof![Just(String::new()), Just("  ".to_string()), "[ -~]{0,20}"],
                0..3,
            ),
            any::<bool>(),
        )
            .prop_map(|(name, lines, comment)| Ev {
                name,
                lines,
                comment,
            })
    }

    /// Writes `events`; returns the stream and, per event, the offset of the byte that
    /// ends its blank line and whether the tracker must count it as progress.
    fn write_events(events: &[Ev], eol: &str) -> (Vec<u8>, Vec<(usize, bool)>) {
        let mut s = String::new();
        let mut ends = Vec::new();
        for e in events {
            if e.comment {
                s.push_str(": keep-alive");
                s.push_str(eol);
            }
            if let Some(n) = &e.name {
                s.push_str("event: ");
                s.push_str(n);
                s.push_str(eol);
            }
            for l in &e.lines {
                s.push_str("data:");
                s.push_str(l);
                s.push_str(eol);
            }
            let content = e.name.as_deref() != Some("ping")
                && e.lines.iter().any(|l| !l.trim_ascii().is_empty());
            ends.push((s.len(), content));
            s.push_str(eol);
        }
        (s.into_bytes(), ends)
    }

    fn route() -> impl Strategy<Value = Route> {
        prop_oneof![
            Just(Route::ChatCompletions),
            Just(Route::Completions),
            Just(Route::Responses),
            Just(Route::Messages),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// The assembler agrees with the line-by-line reference model on any soup, however
        /// it is chunked, at every small limit (so each event's exact size is a limit
        /// once), and never returns more data than its limit.
        #[test]
        fn assembler_matches_the_reference_model(
            bytes in soup(),
            cuts in proptest::collection::vec(any::<usize>(), 0..16),
        ) {
            let chunks = cut(&bytes, &cuts);
            for max in (0..=40).chain([1 << 16]) {
                let got = assemble(max, &chunks);
                prop_assert_eq!(&got, &reference(&bytes, max), "max {}", max);
                for e in &got {
                    let replaced = e.data.matches(char::REPLACEMENT_CHARACTER).count();
                    prop_assert!(e.data.len() <= max + 2 * replaced, "{} > {}", e.data.len(), max);
                    prop_assert!(e.event.as_ref().is_none_or(|n| n.len() <= 3 * EVENT_NAME_MAX));
                }
            }
        }

        /// Arbitrary bytes, arbitrary chunking, any limit: no panic, and byte-at-a-time
        /// feeding gives the same events as one chunk.
        #[test]
        fn assembler_survives_arbitrary_bytes(
            bytes in proptest::collection::vec(any::<u8>(), 0..1024),
            max in 0usize..2048,
        ) {
            let singles: Vec<&[u8]> = bytes.chunks(1).collect();
            prop_assert_eq!(assemble(max, &singles), assemble(max, &[&bytes]));
        }

        /// On well-formed streams the stall guard's tracker reports progress exactly in
        /// the chunks where a content event (not a ping, data not blank) completes.
        #[test]
        fn progress_is_reported_in_the_chunk_that_completes_a_content_event(
            events in proptest::collection::vec(ev(), 0..8),
            eol in prop_oneof![Just("\n"), Just("\r\n"), Just("\r")],
            cuts in proptest::collection::vec(any::<usize>(), 0..12),
        ) {
            let (stream, ends) = write_events(&events, eol);
            let mut p = SseProgress::default();
            let mut from = 0;
            for chunk in cut(&stream, &cuts) {
                let to = from + chunk.len();
                let want = ends.iter().any(|&(at, content)| content && (from..to).contains(&at));
                prop_assert_eq!(p.feed(chunk), want, "chunk {}..{}", from, to);
                from = to;
            }
        }

        /// The tracker never panics, and where progress is reported does not depend on
        /// how the stream is chunked: a chunk reports progress iff, fed byte by byte, one
        /// of its bytes would have.
        #[test]
        fn progress_does_not_depend_on_chunking(
            bytes in prop_oneof![
                soup(),
                proptest::collection::vec(any::<u8>(), 0..1024),
            ],
            cuts in proptest::collection::vec(any::<usize>(), 0..16),
        ) {
            let mut bytewise = SseProgress::default();
            let at: Vec<bool> = bytes.iter().map(|b| bytewise.feed(std::slice::from_ref(b))).collect();
            let mut p = SseProgress::default();
            let mut from = 0;
            for chunk in cut(&bytes, &cuts) {
                let to = from + chunk.len();
                prop_assert_eq!(p.feed(chunk), at[from..to].contains(&true), "chunk {}..{} of {:?}", from, to, String::from_utf8_lossy(&bytes));
                from = to;
            }
        }

        /// Whatever was forwarded before a failure (any bytes, any chunking), the
        /// boundary's terminator followed by the error event parses as exactly one more
        /// event — the error event — after the events the forwarded bytes already held.
        #[test]
        fn error_event_after_the_terminator_parses_on_its_own(
            prefix in prop_oneof![soup(), proptest::collection::vec(any::<u8>(), 0..256)],
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
            route in route(),
            reason in proptest::sample::select(AbortReason::ALL.to_vec()),
        ) {
            let mut boundary = EventBoundary::default();
            for chunk in cut(&prefix, &cuts) {
                boundary.feed(chunk);
            }
            let terminator = boundary.terminator();
            let mut closed = boundary;
            closed.feed(terminator);
            prop_assert!(!closed.is_mid_event());
            prop_assert_eq!(closed.terminator(), b"");

            let error = sse_error_event(route, reason);
            let expected = assemble(1 << 20, &[&error]);
            prop_assert_eq!(expected.len(), 1);
            let mut whole = prefix.clone();
            whole.extend_from_slice(terminator);
            let before = assemble(1 << 20, &[&whole]);
            whole.extend_from_slice(&error);
            let mut want = before;
            want.extend(expected);
            prop_assert_eq!(assemble(1 << 20, &[&whole]), want);
        }
    }

    /// The tracker keeps only the first 32 bytes of a line that spans chunks, so a line
    /// whose meaning lies beyond them is misjudged when a chunk boundary falls inside
    /// it, though it is judged right when it arrives whole. Minimal cases: `data:` + 27
    /// spaces + `x`, then a blank line, is progress in one chunk but not when split
    /// after `d` (a false stall for the stall guard); `event:` + 23 spaces + `ping`
    /// with `data: {}` is a heartbeat in one chunk but progress when split after `e`
    /// (padded pings then mask a real stall).
    #[test]
    fn progress_on_padded_values_does_not_depend_on_chunking() {
        for pad in 0..64 {
            for (field, value) in [("data:", "x"), ("event:", "ping")] {
                let line = format!("{field}{}{value}\n", " ".repeat(pad));
                let stream = if field == "data:" {
                    format!("{line}\n")
                } else {
                    format!("{line}data: {{}}\n\n")
                };
                let mut whole = SseProgress::default();
                let want = whole.feed(stream.as_bytes());
                for at in 1..line.len() {
                    let (a, b) = stream.as_bytes().split_at(at);
                    let mut p = SseProgress::default();
                    let got = p.feed(a) | p.feed(b);
                    assert_eq!(got, want, "{field} with {pad} spaces, split at {at}");
                }
            }
        }
    }

    /// Adversarial streams of a few MiB (no line end at all, a line end every byte, an
    /// endless comment, endless field names) finish in bounded time.
    #[test]
    fn adversarial_streams_finish() {
        finishes("sse adversarial", Duration::from_secs(60), || {
            let mib = 1 << 20;
            // None of these completes an event: no blank line, no data, or data over the
            // limit (the joined `x` lines pass 1 KiB).
            let streams: Vec<Vec<u8>> = vec![
                [b"data: ".as_slice(), &vec![b'x'; 2 * mib]].concat(),
                vec![b'\r'; mib],
                b"\r\n".repeat(mib / 2),
                [b":".as_slice(), &vec![b'c'; 2 * mib]].concat(),
                vec![b'n'; 2 * mib],
                b"data:x\n".repeat(mib / 8),
                [b"data:x\n".repeat(mib / 8), b"\n".to_vec()].concat(),
            ];
            for s in &streams {
                let mut a = SseAssembler::new(1024);
                let mut p = SseProgress::default();
                let mut out = Vec::new();
                for c in s.chunks(4096) {
                    a.feed(c, &mut out);
                    if s.ends_with(b"\n\n") {
                        continue;
                    }
                    assert!(!p.feed(c));
                }
                assert!(out.is_empty(), "{} events", out.len());
            }
        });
    }
}

// ---------------------------------------------------------------------------------------
// Retry hints, time formats, rate-limit headers.
// ---------------------------------------------------------------------------------------
mod hints {
    use super::*;
    use http::{HeaderMap, HeaderName, HeaderValue};
    use sluice::policy::retry_hint::{parse_hint, parse_http_date};
    use sluice::policy::timefmt::{http_date_ms, openai_duration, rfc3339_ms, scan_duration};
    use sluice::policy::Millis;
    use sluice::routing::parse_rate_limit;
    use std::time::UNIX_EPOCH;

    /// 9999-12-31T23:59:59Z: the last instant both date formats can write.
    const LAST_MS: Millis = 253_402_300_799_000;
    const DAYS: [&str; 7] = ["Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"];
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    const HINT_HEADERS: [&str; 8] = [
        "retry-after",
        "retry-after-ms",
        "x-ratelimit-reset-requests",
        "x-ratelimit-reset-tokens",
        "anthropic-ratelimit-requests-reset",
        "anthropic-ratelimit-tokens-reset",
        "anthropic-ratelimit-input-tokens-reset",
        "anthropic-ratelimit-output-tokens-reset",
    ];

    /// `ms` (whole seconds) as an IMF-fixdate, written independently of the parser:
    /// the fields come from humantime's RFC 3339 text, the weekday from the day count
    /// (1970-01-01 was a Thursday).
    fn imf_fixdate(ms: Millis, rng: &mut Rng) -> String {
        let t =
            humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(ms)).to_string();
        let (y, mo, d, clock) = (&t[0..4], &t[5..7], &t[8..10], &t[11..19]);
        let month = MONTHS[mo.parse::<usize>().unwrap() - 1];
        let day = DAYS[((ms / 86_400_000 + 4) % 7) as usize];
        format!(
            "{}, {d} {} {y} {clock} GMT",
            random_case(day, rng),
            random_case(month, rng)
        )
    }

    /// `ms` written as local time at `offset_min` minutes east of UTC, with a fraction.
    fn rfc3339_with_offset(ms: Millis, offset_min: i64) -> String {
        let local = i64::try_from(ms).unwrap() + offset_min * 60_000;
        let t = humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(local as u64))
            .to_string();
        let zone = if offset_min == 0 {
            "Z".to_string()
        } else {
            let (sign, m) = if offset_min > 0 {
                ('+', offset_min)
            } else {
                ('-', -offset_min)
            };
            format!("{sign}{:02}:{:02}", m / 60, m % 60)
        };
        format!("{}{zone}", t.trim_end_matches('Z'))
    }

    const UNITS: [(&str, f64); 14] = [
        ("ns", 1e-9),
        ("us", 1e-6),
        ("µs", 1e-6),
        ("ms", 1e-3),
        ("s", 1.0),
        ("sec", 1.0),
        ("seconds", 1.0),
        ("m", 60.0),
        ("min", 60.0),
        ("minutes", 60.0),
        ("h", 3_600.0),
        ("hours", 3_600.0),
        ("d", 86_400.0),
        ("days", 86_400.0),
    ];

    /// A Go/OpenAI-style duration: one to four `<number><unit>` components, each maybe
    /// with a fraction and spaces; returns the text and the seconds it states.
    /// With `ascii`, no `µs` (header values must be visible ASCII to be read at all).
    fn duration_text(ascii: bool) -> impl Strategy<Value = (String, f64)> {
        let units = (0..UNITS.len())
            .filter(move |i| !ascii || UNITS[*i].0.is_ascii())
            .collect::<Vec<_>>();
        proptest::collection::vec(
            (
                0u32..1000,
                proptest::option::of(0u32..1000),
                proptest::sample::select(units),
                any::<bool>(),
                any::<bool>(),
            ),
            1..5,
        )
        .prop_map(|parts| {
            let mut text = String::new();
            let mut secs = 0.0;
            for (i, (int, frac, unit, space_before_unit, space_after)) in
                parts.into_iter().enumerate()
            {
                if i > 0 && space_after {
                    text.push(' ');
                }
                let number = match frac {
                    Some(f) => format!("{int}.{f:03}"),
                    None => int.to_string(),
                };
                let (name, factor) = UNITS[unit];
                text.push_str(&number);
                if space_before_unit {
                    text.push(' ');
                }
                text.push_str(name);
                secs += number.parse::<f64>().unwrap() * factor;
            }
            (text, secs)
        })
    }

    fn close(got: Duration, secs: f64) -> bool {
        (got.as_secs_f64() - secs).abs() <= 1e-6 + secs * 1e-12
    }

    fn headers(pairs: &[(&str, String)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    /// A header value of the kind each hint header carries, or junk.
    fn hint_value() -> impl Strategy<Value = String> {
        prop_oneof![
            (0u64..100_000).prop_map(|n| n.to_string()),
            (0u64..1000, 0u32..1000).prop_map(|(a, b)| format!("{a}.{b}")),
            Just("0".to_string()),
            Just("0.0".to_string()),
            Just("-1".to_string()),
            Just("1e999".to_string()),
            Just("9".repeat(400)),
            duration_text(true).prop_map(|(t, _)| t),
            (0..LAST_MS).prop_map(|ms| rfc3339_with_offset(ms - ms % 1000, 0)),
            (0..LAST_MS, any::<u64>())
                .prop_map(|(ms, s)| imf_fixdate(ms - ms % 1000, &mut Rng::new(s))),
            "[ -~]{0,24}",
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Whatever mix of hint headers and body, a hint is never zero ("never a
        /// zero-length cooldown"), and the same input always gives the same hint.
        #[test]
        fn hints_are_positive_or_absent(
            values in proptest::collection::vec((0usize..HINT_HEADERS.len(), hint_value()), 0..6),
            body in prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..256),
                (hint_value(), "[a-z ]{0,12}").prop_map(|(v, t)| format!("{t} try again in {v}").into_bytes()),
                hint_value().prop_map(|v| format!("{{\"retryDelay\": \"{v}\"}}").into_bytes()),
            ],
            now in 0..LAST_MS,
        ) {
            let pairs: Vec<(&str, String)> = values.iter().map(|(i, v)| (HINT_HEADERS[*i], v.clone())).collect();
            let h = headers(&pairs);
            let hint = parse_hint(&h, &body, now);
            prop_assert!(hint.is_none_or(|d| !d.is_zero()), "{:?}", hint);
            prop_assert_eq!(hint, parse_hint(&h, &body, now));
            let _ = parse_rate_limit(&h, now);
        }

        /// `Retry-After` as an HTTP-date is the wait until that instant: exact when it
        /// lies ahead, absent when it does not; the date parses back to the instant with
        /// day and month names in any letter case.
        #[test]
        fn retry_after_http_date_is_the_wait_until_it(
            at_s in 0..LAST_MS / 1000,
            now in 0..LAST_MS,
            seed in any::<u64>(),
        ) {
            let at = at_s * 1000;
            let text = imf_fixdate(at, &mut Rng::new(seed));
            prop_assert_eq!(http_date_ms(&text), Some(at), "{}", text);
            prop_assert_eq!(parse_http_date(&text), Some(at));
            let want = (at > now).then(|| Duration::from_millis(at - now));
            prop_assert_eq!(parse_hint(&headers(&[("retry-after", text)]), b"", now), want);
        }

        /// Delta-seconds (whole or fractional) and `retry-after-ms` round-trip; zero is
        /// no hint at all.
        #[test]
        fn numeric_hints_round_trip(secs in 0u64..10_000_000, frac in 0u32..1000, ms in 0u64..10_000_000_000) {
            let text = format!("{secs}.{frac:03}");
            let want = secs as f64 + f64::from(frac) / 1000.0;
            let got = parse_hint(&headers(&[("retry-after", text.clone())]), b"", 0);
            match got {
                Some(d) => prop_assert!(close(d, want), "{} -> {:?}", text, d),
                None => prop_assert!(want == 0.0, "{} gave no hint", text),
            }
            let got = parse_hint(&headers(&[("retry-after-ms", ms.to_string())]), b"", 0);
            // Read through an f64 of seconds: exact to well under a microsecond.
            match got {
                Some(d) => prop_assert!(close(d, ms as f64 / 1000.0), "{} ms -> {:?}", ms, d),
                None => prop_assert_eq!(ms, 0),
            }
        }

        /// OpenAI durations parse to the sum of their components; the reset hint is the
        /// longer of the two reset headers; the rate-limit reset lies `ceil(d)` ahead.
        #[test]
        fn openai_durations_sum_their_components(
            (a, a_secs) in duration_text(true),
            (b, b_secs) in duration_text(true),
            (u, u_secs) in duration_text(false),
            now in 0..LAST_MS,
        ) {
            let got = openai_duration(&u).unwrap();
            prop_assert!(close(got, u_secs), "{:?} -> {:?}, want {}", u, got, u_secs);
            let got = openai_duration(&a).unwrap();
            prop_assert!(close(got, a_secs), "{:?} -> {:?}, want {}", a, got, a_secs);
            let h = headers(&[("x-ratelimit-reset-requests", a.clone()), ("x-ratelimit-reset-tokens", b.clone())]);
            let longest = a_secs.max(b_secs);
            match parse_hint(&h, b"", now) {
                Some(d) => prop_assert!(close(d, longest)),
                None => prop_assert!(longest < 1e-9 + 1e-12, "{:?} / {:?} gave no hint", a, b),
            }
            let info = parse_rate_limit(&h, now).unwrap();
            let reset = info.reset_at.unwrap();
            prop_assert!(reset >= now);
            prop_assert!((reset - now) as f64 >= a_secs * 1000.0 - 1e-3);
            prop_assert!(((reset - now) as f64) < a_secs * 1000.0 + 1.0 + 1e-3);
            // Scanning inside text stops where the duration does.
            let text = format!("{a}, then more");
            let (d, used) = scan_duration(text.as_bytes(), false).unwrap();
            prop_assert_eq!(used, a.len());
            prop_assert_eq!(d, got);
        }

        /// RFC 3339 timestamps at any offset name the same instant; the Anthropic reset
        /// hint is the wait until the latest of them.
        #[test]
        fn rfc3339_offsets_name_the_same_instant(
            at in 86_400_000..LAST_MS - 2 * 86_400_000,
            offsets in proptest::collection::vec(-(23 * 60 + 59)..=(23 * 60 + 59i64), 1..4),
            now in 0..LAST_MS,
        ) {
            let mut pairs = Vec::new();
            let mut latest = 0;
            for (i, off) in offsets.iter().enumerate() {
                let instant = at + i as u64 * 1_500;
                let text = rfc3339_with_offset(instant, *off);
                prop_assert_eq!(rfc3339_ms(&text), Some(instant), "{}", text);
                latest = latest.max(instant);
                pairs.push((HINT_HEADERS[4 + i], text));
            }
            let want = (latest > now).then(|| Duration::from_millis(latest - now));
            prop_assert_eq!(parse_hint(&headers(&pairs), b"", now), want);
        }

        /// A wait stated in an error body after any of the phrases, in any letter case
        /// and surrounded by text without digits, is read exactly.
        #[test]
        fn body_phrases_state_the_wait(
            phrase in proptest::sample::select(vec![
                "try again in", "try again after", "retry in", "retry after", "reset after",
                "resets after", "reset in", "resets in", "please wait",
            ]),
            (dur, secs) in duration_text(false),
            before in "[a-zA-Z ,.!:\"{}]{0,30}",
            after in "[.,!\" ][a-zA-Z ,.!]{0,20}",
            seed in any::<u64>(),
            gemini in any::<bool>(),
        ) {
            let mut rng = Rng::new(seed);
            let body = if gemini {
                format!("{before}{{\"retryDelay\": \"{dur}\"}}")
            } else {
                format!("{before}{} {dur}{after}", random_case(phrase, &mut rng))
            };
            match parse_hint(&HeaderMap::new(), body.as_bytes(), 0) {
                Some(d) => prop_assert!(close(d, secs), "{:?} -> {:?}, want {}", body, d, secs),
                None => prop_assert!(secs < 1e-9 + 1e-12, "{:?} gave no hint", body),
            }
        }

        /// The rate-limit count round-trips; junk counts are unknown, never a panic.
        #[test]
        fn rate_limit_remaining_round_trips(n in any::<u64>(), junk in "[ -~]{0,12}", now in any::<u64>()) {
            let h = headers(&[("x-ratelimit-remaining-requests", n.to_string())]);
            prop_assert_eq!(parse_rate_limit(&h, now).unwrap().remaining, Some(n));
            let h = headers(&[("anthropic-ratelimit-requests-remaining", junk.clone()),
                ("anthropic-ratelimit-requests-reset", junk.clone()),
                ("x-ratelimit-reset-requests", junk)]);
            if let Some(info) = parse_rate_limit(&h, now) {
                prop_assert!(info.remaining.is_some() || info.reset_at.is_some());
            }
        }
    }

    /// Only the first 64 KiB of a body is read for hints.
    #[test]
    fn body_scan_is_bounded() {
        let hint = b"try again in 7s";
        for (pad, want) in [
            (64 * 1024 - hint.len(), Some(Duration::from_secs(7))),
            (64 * 1024, None),
        ] {
            let body = [vec![b'x'; pad], hint.to_vec()].concat();
            assert_eq!(parse_hint(&HeaderMap::new(), &body, 0), want, "pad {pad}");
        }
    }

    /// Bodies built to make the scanner work hardest finish quickly (under a generous
    /// deadline for a debug build).
    #[test]
    fn adversarial_bodies_finish() {
        finishes("hint bodies", Duration::from_secs(30), || {
            let kib = 64 * 1024;
            let bodies: Vec<Vec<u8>> = vec![
                b"try again in ".repeat(kib / 13),
                b"retry in 1".repeat(kib / 10),
                b"\"retryDelay\":".repeat(kib / 13),
                [b"try again in ".as_slice(), &vec![b'9'; kib]].concat(),
                [b"try again in 1".as_slice(), &vec![b' '; kib]].concat(),
                b"try again in 1s ".repeat(kib / 16),
                b"1m".repeat(kib / 2),
                vec![0xFF; kib * 4],
            ];
            for b in &bodies {
                let _ = parse_hint(&HeaderMap::new(), b, 0);
                let _ = scan_duration(b, true);
            }
        });
    }
}

// ---------------------------------------------------------------------------------------
// JSON request body: validation, `model` splice.
// ---------------------------------------------------------------------------------------
mod body {
    use super::*;
    use bytes::Bytes;
    use serde_json::Value;
    use sluice::proxy::body::ParsedBody;

    #[derive(Clone, Debug)]
    enum Json {
        Null,
        Bool(bool),
        Num(String),
        Str(String),
        Arr(Vec<Json>),
        Obj(Vec<(String, Json)>),
    }

    fn chars() -> impl Strategy<Value = String> {
        proptest::collection::vec(
            prop_oneof![
                3 => proptest::char::range('a', 'z'),
                1 => any::<char>(),
                1 => proptest::sample::select(vec!['"', '\\', '/', '\n', '\t', '\u{0}', '\u{1f}', '\u{7f}', '\u{2028}', 'é', '用', '😀']),
            ],
            0..12,
        )
        .prop_map(String::from_iter)
    }

    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            proptest::sample::select(vec!["model", "stream", "messages", "content", "role", "x"])
                .prop_map(str::to_string),
            chars(),
        ]
    }

    fn number() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<i64>().prop_map(|n| n.to_string()),
            (any::<i32>(), 0u32..1000, -30i32..30).prop_map(|(i, f, e)| format!("{i}.{f}e{e}")),
            proptest::sample::select(vec![
                "0",
                "-0",
                "0.5E+3",
                "1E-2",
                "123456789012345678901234567890"
            ])
            .prop_map(str::to_string),
        ]
    }

    /// An upstream model name: never empty (the config refuses an empty one).
    fn new_model() -> impl Strategy<Value = String> {
        chars().prop_filter("model names are not empty", |m| !m.is_empty())
    }

    fn dedupe(kv: Vec<(String, Json)>) -> Vec<(String, Json)> {
        let mut seen = std::collections::HashSet::new();
        kv.into_iter()
            .filter(|(k, _)| seen.insert(k.clone()))
            .collect()
    }

    fn tree() -> impl Strategy<Value = Json> {
        let leaf = prop_oneof![
            Just(Json::Null),
            any::<bool>().prop_map(Json::Bool),
            number().prop_map(Json::Num),
            chars().prop_map(Json::Str),
        ];
        leaf.prop_recursive(5, 48, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..5).prop_map(Json::Arr),
                proptest::collection::vec((key(), inner), 0..5)
                    .prop_map(|kv| Json::Obj(dedupe(kv))),
            ]
        })
    }

    fn ws(rng: &mut Rng, out: &mut String) {
        while rng.one_in(3) {
            out.push([' ', '\t', '\n', '\r'][rng.below(4)]);
        }
    }

    /// Writes `s` as a JSON string, escaping what must be escaped and, at random, any
    /// other character (short escapes or `\uXXXX`, surrogate pairs, either hex case).
    fn write_str(s: &str, rng: &mut Rng, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            let must = c == '"' || c == '\\' || u32::from(c) < 0x20;
            if !must && !rng.one_in(4) {
                out.push(c);
                continue;
            }
            let short = match c {
                '"' => Some("\\\""),
                '\\' => Some("\\\\"),
                '/' => Some("\\/"),
                '\n' => Some("\\n"),
                '\t' => Some("\\t"),
                '\r' => Some("\\r"),
                '\u{8}' => Some("\\b"),
                '\u{c}' => Some("\\f"),
                _ => None,
            };
            match short {
                Some(e) if rng.one_in(2) => out.push_str(e),
                _ => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        let hex = format!("{u:04x}");
                        out.push_str("\\u");
                        out.push_str(&if rng.one_in(2) {
                            hex.to_ascii_uppercase()
                        } else {
                            hex
                        });
                    }
                }
            }
        }
        out.push('"');
    }

    fn write(j: &Json, rng: &mut Rng, out: &mut String) {
        match j {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Num(n) => out.push_str(n),
            Json::Str(s) => write_str(s, rng, out),
            Json::Arr(items) => {
                out.push('[');
                for (i, x) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    ws(rng, out);
                    write(x, rng, out);
                    ws(rng, out);
                }
                out.push(']');
            }
            Json::Obj(kv) => {
                out.push('{');
                for (i, (k, v)) in kv.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    ws(rng, out);
                    write_str(k, rng, out);
                    ws(rng, out);
                    out.push(':');
                    ws(rng, out);
                    write(v, rng, out);
                    ws(rng, out);
                }
                out.push('}');
            }
        }
    }

    /// A client body: other top-level fields, `model` at some position (written
    /// canonically or with random escapes), maybe `stream` (true/false/null).
    #[derive(Clone, Debug)]
    struct Spec {
        others: Vec<(String, Json)>,
        model: String,
        at: usize,
        stream: Option<Option<bool>>,
        canonical: bool,
        seed: u64,
    }

    fn spec() -> impl Strategy<Value = Spec> {
        (
            proptest::collection::vec((key(), tree()), 0..6),
            chars().prop_filter("model must not be empty", |m| !m.is_empty()),
            any::<usize>(),
            proptest::option::of(proptest::option::of(any::<bool>())),
            any::<bool>(),
            any::<u64>(),
        )
            .prop_map(|(others, model, at, stream, canonical, seed)| Spec {
                others: dedupe(others)
                    .into_iter()
                    .filter(|(k, _)| k != "model" && k != "stream")
                    .collect(),
                model,
                at,
                stream,
                canonical,
                seed,
            })
    }

    fn render(s: &Spec) -> String {
        let mut rng = Rng::new(s.seed);
        let mut entries: Vec<(String, Option<&Json>)> =
            s.others.iter().map(|(k, v)| (k.clone(), Some(v))).collect();
        entries.insert(s.at % (entries.len() + 1), ("model".to_string(), None));
        let stream_json = s.stream.map(|b| b.map_or(Json::Null, Json::Bool));
        if let Some(j) = &stream_json {
            let at = rng.below(entries.len() + 1);
            entries.insert(at, ("stream".to_string(), Some(j)));
        }
        let mut out = String::new();
        ws(&mut rng, &mut out);
        out.push('{');
        for (i, (k, v)) in entries.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            ws(&mut rng, &mut out);
            write_str(k, &mut rng, &mut out);
            ws(&mut rng, &mut out);
            out.push(':');
            ws(&mut rng, &mut out);
            match v {
                Some(j) => write(j, &mut rng, &mut out),
                None if s.canonical => out.push_str(&serde_json::to_string(&s.model).unwrap()),
                None => write_str(&s.model, &mut rng, &mut out),
            }
            ws(&mut rng, &mut out);
        }
        out.push('}');
        ws(&mut rng, &mut out);
        out
    }

    /// Checks a rewrite of an accepted body: the result is accepted again with the new
    /// model and the same `stream`; its size is bounded by the input plus the quoted
    /// new name; and, when the input is plain JSON, nothing but `model` changed.
    fn check_rewrite(parsed: &ParsedBody, new: &str) -> Result<Bytes, TestCaseError> {
        let outgoing = parsed.with_model(new);
        let out = outgoing.to_bytes();
        // The length the head announces is the body's.
        prop_assert_eq!(outgoing.len(), out.len());
        let quoted = serde_json::to_string(new).unwrap();
        prop_assert!(out.len() <= parsed.raw.len() + quoted.len());
        if new == parsed.model {
            prop_assert_eq!(&out, &parsed.raw);
        }
        let again = ParsedBody::parse(out.clone());
        prop_assert!(again.is_ok(), "rewrite rejected: {:?}", again.err());
        let again = again.unwrap();
        prop_assert_eq!(&again.model, new);
        prop_assert_eq!(again.stream, parsed.stream);
        if let Ok(mut before) = serde_json::from_slice::<Value>(&parsed.raw) {
            let mut after: Value = serde_json::from_slice(&out).unwrap();
            prop_assert_eq!(&after["model"], &Value::String(new.to_string()));
            after["model"] = Value::String(parsed.model.clone());
            before["model"] = Value::String(parsed.model.clone());
            prop_assert_eq!(after, before);
        }
        Ok(out)
    }

    /// JSON-looking pieces for near-valid soup.
    fn soup() -> impl Strategy<Value = Vec<u8>> {
        let piece = prop_oneof![
            proptest::sample::select(vec![
                "{",
                "}",
                "[",
                "]",
                ",",
                ":",
                "\"",
                "\\",
                "\"model\"",
                "\"stream\"",
                "\"m\"",
                "true",
                "null",
                "1",
                "-",
                "e",
                " ",
                "\\u00",
                "\"mod\\u0065l\"",
            ])
            .prop_map(|s| s.as_bytes().to_vec()),
            proptest::collection::vec(any::<u8>(), 0..4),
        ];
        proptest::collection::vec(piece, 0..40).prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Generated bodies (random nesting, escapes, unicode, whitespace, key order) are
        /// accepted with their model and stream; every rewrite changes only `model`.
        #[test]
        fn rewrite_changes_only_the_model(s in spec(), new in new_model()) {
            let raw = render(&s);
            prop_assert!(serde_json::from_str::<Value>(&raw).is_ok(), "writer bug: {}", raw);
            let parsed = ParsedBody::parse(Bytes::from(raw.clone()));
            prop_assert!(parsed.is_ok(), "{:?} rejected: {:?}", raw, parsed.err());
            let parsed = parsed.unwrap();
            prop_assert_eq!(&parsed.model, &s.model);
            prop_assert_eq!(parsed.stream, s.stream.flatten().unwrap_or(false));
            // The same name leaves every byte alone, even when the client escaped it.
            check_rewrite(&parsed, &s.model)?;
            let out = check_rewrite(&parsed, &new)?;
            if s.canonical && new != s.model {
                // The splice is exact: putting the old name back restores every byte.
                let quoted = |m: &str| serde_json::to_string(m).unwrap().len();
                prop_assert_eq!(out.len(), raw.len() - quoted(&s.model) + quoted(&new));
                let back = ParsedBody::parse(out).unwrap();
                let back = back.with_model(&s.model).to_bytes();
                prop_assert_eq!(back.as_ref(), raw.as_bytes());
            }
        }

        /// Random edits of valid bodies, JSON-ish soup and raw bytes: no panic, and any
        /// body that is accepted rewrites into a body that is accepted.
        #[test]
        fn near_valid_bodies_never_break_the_rewrite(
            s in spec(),
            edits in proptest::collection::vec((0u8..3, any::<usize>(), any::<u8>()), 1..4),
            soup in soup(),
            raw in proptest::collection::vec(any::<u8>(), 0..128),
            new in new_model(),
        ) {
            let mut edited = render(&s).into_bytes();
            for (kind, at, byte) in edits {
                let at = at % (edited.len() + 1);
                match kind {
                    0 => edited.insert(at, b"{}[]\":,\\ 0e-"[usize::from(byte) % 12]),
                    1 if at < edited.len() => { edited.remove(at); }
                    _ if at < edited.len() => edited[at] = byte,
                    _ => edited.push(byte),
                }
            }
            for input in [edited, soup, raw] {
                if let Ok(parsed) = ParsedBody::parse(Bytes::from(input)) {
                    prop_assert!(!parsed.model.is_empty());
                    check_rewrite(&parsed, &new)?;
                    check_rewrite(&parsed, "x")?;
                    check_rewrite(&parsed, &parsed.model.clone())?;
                }
            }
        }
    }

    /// Deeply nested fields (far past serde's recursion limit), long strings and many
    /// escapes are handled without a stack overflow and in bounded time.
    #[test]
    fn deep_and_long_bodies_finish() {
        finishes("body adversarial", Duration::from_secs(60), || {
            let depth = 200_000;
            let deep = format!(
                r#"{{"messages":{}{},"model":"m"}}"#,
                "[".repeat(depth),
                "]".repeat(depth)
            );
            let b = ParsedBody::parse(Bytes::from(deep.clone())).unwrap();
            let out = b.with_model("gpt").to_bytes();
            assert_eq!(out.len(), deep.len() + 2);
            assert!(out.ends_with(br#","model":"gpt"}"#));
            // The model itself nested deeply is refused, not a crash.
            let deep_model = format!(r#"{{"model":{}{}}}"#, "[".repeat(depth), "]".repeat(depth));
            assert!(ParsedBody::parse(Bytes::from(deep_model)).is_err());
            let unclosed = format!(r#"{{"model":"m","x":{}"#, "{\"a\":".repeat(depth));
            assert!(ParsedBody::parse(Bytes::from(unclosed)).is_err());
            let escapes = format!(r#"{{"x":"{}","model":"m"}}"#, "\\u00e9\\\"".repeat(100_000));
            let b = ParsedBody::parse(Bytes::from(escapes)).unwrap();
            assert_eq!(b.model, "m");
            let array = format!("[{}]", "1,".repeat(500_000) + "1");
            assert!(ParsedBody::parse(Bytes::from(array)).is_err());
        });
    }
}

// ---------------------------------------------------------------------------------------
// Request path normalisation and session headers.
// ---------------------------------------------------------------------------------------
mod request_line {
    use super::*;
    use http::{HeaderMap, HeaderValue};
    use sluice::policy::affinity::{session_key, MAX_SESSION_BYTES, SESSION_HEADERS};
    use sluice::proxy::routes::{normalize, Route};

    const ROUTES: [Route; 8] = Route::ALL;

    /// A canonical route path disguised the ways normalisation must see through:
    /// percent-encoded unreserved bytes, empty and `.` segments, `x/..`, a trailing
    /// slash, a query or fragment.
    fn disguise(path: &str, rng: &mut Rng) -> String {
        let mut out = String::new();
        for seg in path.split('/').filter(|s| !s.is_empty()) {
            out.push('/');
            match rng.below(6) {
                0 => out.push('/'),
                1 => out.push_str("./"),
                2 => out.push_str("junk/../"),
                _ => {}
            }
            for c in seg.chars() {
                if rng.one_in(3) {
                    let hex = format!("%{:02x}", u32::from(c));
                    out.push_str(&if rng.one_in(2) {
                        hex.to_ascii_uppercase()
                    } else {
                        hex
                    });
                } else {
                    out.push(c);
                }
            }
        }
        match rng.below(4) {
            0 => out.push('/'),
            1 => out.push_str("?model=x&a=%2F"),
            2 => out.push_str("#frag/../x"),
            _ => {}
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any target normalises to a clean absolute path: one leading `/`, no empty,
        /// `.` or `..` segment, no query or fragment.
        #[test]
        fn normalised_paths_are_clean(target in prop_oneof![
            any::<String>(),
            "[/.%?#a-zA-Z0-9~_-]{0,40}",
            proptest::collection::vec(proptest::sample::select(vec!["/", "..", ".", "%2e", "%2E%2e", "%2F", "%", "%4", "v1", "é"]), 0..16).prop_map(|v| v.concat()),
        ]) {
            let n = normalize(&target);
            prop_assert!(n.starts_with('/'), "{:?}", n);
            prop_assert!(!n.contains('?') && !n.contains('#'), "{:?}", n);
            if n != "/" {
                for seg in n[1..].split('/') {
                    prop_assert!(!matches!(seg, "" | "." | ".."), "{:?} -> {:?}", target, n);
                }
            }
            for method in ["GET", "POST", "PUT", ""] {
                if let Some(r) = Route::from_request(method, &target) {
                    prop_assert_eq!(&*n, r.path());
                    prop_assert_eq!(method, r.method());
                }
            }
            prop_assert_eq!(Route::by_path(&target).map(Route::path), ROUTES.iter().map(|r| r.path()).find(|p| *p == n));
        }

        /// A disguised route path still reaches its route; an encoded `/` (`%2F`) in
        /// place of a separator never does.
        #[test]
        fn disguised_route_paths_match_their_route(route in proptest::sample::select(ROUTES.to_vec()), seed in any::<u64>()) {
            let mut rng = Rng::new(seed);
            let target = disguise(route.path(), &mut rng);
            prop_assert_eq!(Route::from_request(route.method(), &target), Some(route), "{:?}", target);
            let slashes: Vec<usize> = route.path().match_indices('/').map(|(i, _)| i).skip(1).collect();
            let at = slashes[rng.below(slashes.len())];
            let smuggled = format!("{}%2F{}", &route.path()[..at], &route.path()[at + 1..]);
            prop_assert_eq!(Route::by_path(&smuggled), None, "{:?}", smuggled);
        }

        /// The session key is the first header value that is UTF-8, non-empty after
        /// trimming and at most 256 bytes — trimmed, never longer.
        #[test]
        fn session_key_is_the_first_valid_header(
            values in proptest::collection::vec(proptest::option::of(prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..300),
                "[ -~]{0,8}".prop_map(String::into_bytes),
                (250usize..262).prop_map(|n| vec![b'k'; n]),
                Just(b"  \t ".to_vec()),
            ]), 3),
        ) {
            let mut h = HeaderMap::new();
            let mut valid = Vec::new();
            for (name, v) in SESSION_HEADERS.iter().zip(&values) {
                let Some(hv) = v.as_ref().and_then(|v| HeaderValue::from_bytes(v).ok()) else {
                    continue;
                };
                if let Ok(s) = std::str::from_utf8(hv.as_bytes()) {
                    let t = s.trim();
                    if !t.is_empty() && t.len() <= MAX_SESSION_BYTES {
                        valid.push(t.to_string());
                    }
                }
                h.insert(*name, hv);
            }
            let key = session_key(&h);
            prop_assert_eq!(&key, &valid.first().cloned());
            prop_assert!(key.is_none_or(|k| !k.is_empty() && k.len() <= MAX_SESSION_BYTES));
        }
    }
}

// ---------------------------------------------------------------------------------------
// Error-text markers (`rules::text`).
// ---------------------------------------------------------------------------------------
mod markers {
    use super::*;
    use sluice::rules::{Haystack, Marker, MAX_SCAN_BYTES};

    fn naive(hay: &[u8], needle: &[u8]) -> bool {
        hay.windows(needle.len()).any(|w| w == needle)
    }

    /// `s` as a JSON encoder with ASCII output might write it: each character raw or
    /// `\uXXXX` (surrogate pairs above the BMP); backslashes always escaped.
    fn escaped(s: &str, rng: &mut Rng) -> String {
        let mut out = String::new();
        for c in s.chars() {
            if c != '\\' && !rng.one_in(2) {
                out.push(c);
                continue;
            }
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Without a backslash in the body, a marker matches exactly when it is an
        /// ASCII-case-insensitive byte substring of the first 64 KiB.
        #[test]
        fn plain_bodies_match_like_a_substring_search(
            body in proptest::collection::vec(prop_oneof![any::<u8>(), proptest::sample::select(b"abcABC \xE9".to_vec())], 0..200)
                .prop_map(|b| b.into_iter().filter(|c| *c != b'\\').collect::<Vec<u8>>()),
            needle in "[abcABC é]{1,4}",
            from in any::<usize>(),
            len in 1usize..6,
            seed in any::<u64>(),
        ) {
            let hay = Haystack::new(&body);
            let lower = body.to_ascii_lowercase();
            let m = Marker::new(&needle).unwrap();
            prop_assert_eq!(hay.contains(&m), naive(&lower, m.as_bytes()));
            // A slice of the body itself, re-cased, always matches.
            let text = String::from_utf8_lossy(&body);
            let chars: Vec<char> = text.chars().collect();
            if !chars.is_empty() && !text.contains(char::REPLACEMENT_CHARACTER) {
                let start = from % chars.len();
                let slice: String = chars[start..(start + len).min(chars.len())].iter().collect();
                let m = Marker::new(&random_case(&slice, &mut Rng::new(seed))).unwrap();
                prop_assert!(hay.contains(&m), "{:?} not found in {:?}", slice, text);
            }
        }

        /// A marker matches text the upstream sent JSON-escaped (`\u7528`, surrogate
        /// pairs, escaped ASCII in any case) as it matches the text itself.
        #[test]
        fn escaped_text_matches_like_the_text(
            text in "[a-zA-Z0-9 额度不足用户😀é\\\\\"]{1,24}",
            from in any::<usize>(),
            len in 1usize..8,
            seed in any::<u64>(),
        ) {
            let mut rng = Rng::new(seed);
            let body = format!("{{\"error\":{{\"message\":\"{}\"}}}}", escaped(&text, &mut rng));
            let chars: Vec<char> = text.chars().collect();
            let start = from % chars.len();
            let slice: String = chars[start..(start + len).min(chars.len())].iter().collect();
            let m = Marker::new(&random_case(&slice, &mut rng)).unwrap();
            prop_assert!(Haystack::new(body.as_bytes()).contains(&m), "{:?} not found in {:?}", slice, body);
        }

        /// Arbitrary (escape-heavy) bodies: no panic, and a marker found in the raw text
        /// is found whatever else the body holds.
        #[test]
        fn escape_soup_never_panics(
            body in proptest::collection::vec(prop_oneof![
                proptest::sample::select(vec!["\\", "\\u", "\\ud83d", "\\ude00", "\\udc00", "\\u00", "\\n", "\\\"", "u", "0", "d8", "Q"]).prop_map(|s| s.as_bytes().to_vec()),
                proptest::collection::vec(any::<u8>(), 0..4),
            ], 0..64).prop_map(|v| v.concat()),
            marker in "[a-z\\\\u0-9]{1,6}",
        ) {
            let hay = Haystack::new(&body);
            let m = Marker::new(&marker).unwrap();
            let found = hay.contains(&m);
            if naive(&body.to_ascii_lowercase(), m.as_bytes()) {
                prop_assert!(found);
            }
            let _ = hay.contains_any_str(&["", "quota", "\u{fffd}"]);
        }
    }

    /// A marker is searched for in the first 64 KiB only, wherever it sits.
    #[test]
    fn markers_beyond_the_scan_window_are_not_seen() {
        let m = Marker::new("Banned").unwrap();
        for pad in [
            0,
            1,
            MAX_SCAN_BYTES - 7,
            MAX_SCAN_BYTES - 6,
            MAX_SCAN_BYTES - 5,
            MAX_SCAN_BYTES,
        ] {
            let body = [vec![b'x'; pad], b"BANNED".to_vec()].concat();
            assert_eq!(
                Haystack::new(&body).contains(&m),
                pad + 6 <= MAX_SCAN_BYTES,
                "pad {pad}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Rule files (restatement.yaml, classification.yaml).
// ---------------------------------------------------------------------------------------
mod rules {
    use super::*;
    use http::{HeaderMap, HeaderName, HeaderValue};
    use serde_yaml::{Mapping, Value};
    use sluice::config::Problem;
    use sluice::policy::{Reason, Scope, TerminalState};
    use sluice::rules::{Haystack, RuleSet};

    const PROVIDERS: [&str; 3] = ["*", "glm", "openai"];
    const MARKERS: [&str; 6] = [
        "quota",
        "Rate Limited",
        "额度不足",
        "banned",
        "try later",
        "Ü",
    ];
    const REASONS: [&str; 4] = [
        "rate_limit_exceeded",
        "quota_exhausted",
        "banned",
        "server_error",
    ];
    const SCOPES: [&str; 4] = ["provider", "connection", "model", "request"];

    /// A mistake injected into one generated rule: such a rule must be reported (and
    /// only such rules).
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Fault {
        None,
        StatusOutOfRange,
        StatusNotANumber,
        EmptyMarker,
        UnknownKey,
        MissingId,
        DuplicateId,
        WrongType,
        OutOfRange,
        Specific,
    }

    fn fault() -> impl Strategy<Value = Fault> {
        prop_oneof![
            12 => Just(Fault::None),
            1 => proptest::sample::select(vec![
                Fault::StatusOutOfRange, Fault::StatusNotANumber, Fault::EmptyMarker,
                Fault::UnknownKey, Fault::MissingId, Fault::DuplicateId, Fault::WrongType,
                Fault::OutOfRange, Fault::Specific,
            ]),
        ]
    }

    fn s(v: &str) -> Value {
        Value::String(v.to_string())
    }

    fn statuses(list: &[u16]) -> Value {
        Value::Sequence(list.iter().map(|n| Value::Number((*n).into())).collect())
    }

    fn markers(list: &[usize]) -> Value {
        Value::Sequence(list.iter().map(|i| s(MARKERS[*i])).collect())
    }

    /// One generated rule: the YAML item and what it stands for.
    #[derive(Clone, Debug)]
    struct Restate {
        provider: usize,
        from: Vec<u16>,
        to: u16,
        text: Vec<usize>,
        exclude: Vec<usize>,
        retry: Option<u64>,
        fault: Fault,
    }

    fn restate() -> impl Strategy<Value = Restate> {
        (
            0..PROVIDERS.len(),
            proptest::collection::vec(
                proptest::sample::select(vec![400u16, 403, 429, 500, 503]),
                1..3,
            ),
            proptest::sample::select(vec![429u16, 503]),
            proptest::collection::vec(0..MARKERS.len(), 1..3),
            proptest::collection::vec(0..MARKERS.len(), 0..2),
            proptest::option::of(1u64..=86_400),
            fault(),
        )
            .prop_map(
                |(provider, from, to, text, exclude, retry, fault)| Restate {
                    provider,
                    from,
                    to,
                    text,
                    exclude,
                    retry,
                    fault,
                },
            )
    }

    fn restate_yaml(i: usize, r: &Restate) -> Value {
        let mut m = Mapping::new();
        let id = if r.fault == Fault::DuplicateId && i > 0 {
            "r0".to_string()
        } else {
            format!("r{i}")
        };
        if r.fault != Fault::MissingId {
            m.insert(s("id"), s(&id));
        }
        m.insert(s("provider"), s(PROVIDERS[r.provider]));
        let mut from = statuses(&r.from);
        match r.fault {
            Fault::StatusOutOfRange => from = statuses(&[r.from[0], 600]),
            Fault::StatusNotANumber => from = Value::Sequence(vec![s("four hundred")]),
            _ => {}
        }
        m.insert(s("from_statuses"), from);
        m.insert(
            s("to_status"),
            if r.fault == Fault::WrongType {
                s("teapot")
            } else {
                Value::Number(r.to.into())
            },
        );
        let mut text = markers(&r.text);
        if r.fault == Fault::EmptyMarker {
            text = Value::Sequence(vec![s(MARKERS[0]), s("")]);
        }
        if r.fault == Fault::Specific {
            text = Value::Sequence(Vec::new());
        }
        m.insert(s("text_markers"), text);
        if !r.exclude.is_empty() {
            m.insert(s("exclude_markers"), markers(&r.exclude));
        }
        match (r.fault, r.retry) {
            (Fault::OutOfRange, _) => {
                m.insert(s("retry_after_s"), Value::Number(86_401.into()));
            }
            (_, Some(n)) => {
                m.insert(s("retry_after_s"), Value::Number(n.into()));
            }
            _ => {}
        }
        if r.fault == Fault::UnknownKey {
            m.insert(s("colour"), s("blue"));
        }
        Value::Mapping(m)
    }

    #[derive(Clone, Debug)]
    struct Classify {
        provider: usize,
        status: Option<Vec<u16>>,
        matches: Option<Vec<usize>>,
        header: Option<(usize, Option<usize>)>,
        reason: usize,
        scope: usize,
        terminal: bool,
        cooldown: Option<u64>,
        retryable: Option<bool>,
        fault: Fault,
    }

    const HEADER_NAMES: [&str; 2] = ["x-error-type", "X-Ban"];
    const HEADER_VALUES: [&str; 2] = ["ban", "Quota"];

    fn classify() -> impl Strategy<Value = Classify> {
        (
            0..PROVIDERS.len(),
            proptest::option::of(proptest::collection::vec(
                proptest::sample::select(vec![400u16, 403, 429, 500]),
                1..3,
            )),
            proptest::option::of(proptest::collection::vec(0..MARKERS.len(), 1..3)),
            proptest::option::of((
                0..HEADER_NAMES.len(),
                proptest::option::of(0..HEADER_VALUES.len()),
            )),
            (0..REASONS.len(), 0..SCOPES.len(), any::<bool>()),
            proptest::option::of(1u64..=2_592_000),
            proptest::option::of(any::<bool>()),
            fault(),
        )
            .prop_map(
                |(
                    provider,
                    status,
                    matches,
                    header,
                    (reason, scope, terminal),
                    cooldown,
                    retryable,
                    fault,
                )| {
                    let mut c = Classify {
                        provider,
                        status,
                        matches,
                        header,
                        reason,
                        scope,
                        terminal,
                        cooldown,
                        retryable,
                        fault,
                    };
                    // A valid rule has a condition, and a terminal state only at connection scope.
                    if c.status.is_none() && c.matches.is_none() && c.header.is_none() {
                        c.status = Some(vec![429]);
                    }
                    if c.terminal {
                        c.scope = 1;
                    }
                    c
                },
            )
    }

    fn classify_yaml(i: usize, c: &Classify) -> Value {
        let mut m = Mapping::new();
        let id = if c.fault == Fault::DuplicateId && i > 0 {
            "c0".to_string()
        } else {
            format!("c{i}")
        };
        if c.fault != Fault::MissingId {
            m.insert(s("id"), s(&id));
        }
        m.insert(s("provider"), s(PROVIDERS[c.provider]));
        match (&c.status, c.fault) {
            (_, Fault::StatusOutOfRange) => {
                m.insert(s("status"), statuses(&[99]));
            }
            (_, Fault::StatusNotANumber) => {
                m.insert(s("status"), Value::Sequence(vec![Value::Bool(true)]));
            }
            (Some(list), _) => {
                m.insert(s("status"), statuses(list));
            }
            _ => {}
        }
        if let Some(list) = &c.matches {
            m.insert(s("match"), markers(list));
        }
        if c.fault == Fault::EmptyMarker {
            m.insert(s("match"), Value::Sequence(vec![s("")]));
        }
        match (c.header, c.fault) {
            (_, Fault::WrongType) => {
                m.insert(s("header"), s("bad header=x"));
            }
            (Some((n, v)), _) => {
                let text = match v {
                    Some(v) => format!(" {} = {} ", HEADER_NAMES[n], HEADER_VALUES[v]),
                    None => HEADER_NAMES[n].to_string(),
                };
                m.insert(s("header"), s(&text));
            }
            _ => {}
        }
        m.insert(s("reason"), s(REASONS[c.reason]));
        m.insert(s("scope"), s(SCOPES[c.scope]));
        if c.terminal {
            m.insert(s("terminal"), s("banned"));
        }
        if c.fault == Fault::Specific {
            // A terminal state outside connection scope.
            m.insert(s("terminal"), s("expired"));
            m.insert(s("scope"), s("model"));
        }
        match (c.fault, c.cooldown) {
            (Fault::OutOfRange, _) => {
                m.insert(s("cooldown_s"), Value::Number(0.into()));
            }
            (_, Some(n)) => {
                m.insert(s("cooldown_s"), Value::Number(n.into()));
            }
            _ => {}
        }
        if let Some(b) = c.retryable {
            m.insert(s("retryable"), Value::Bool(b));
        }
        if c.fault == Fault::UnknownKey {
            m.insert(s("matches"), markers(&[0]));
        }
        Value::Mapping(m)
    }

    fn document(items: Vec<Value>) -> String {
        let mut root = Mapping::new();
        root.insert(s("rules"), Value::Sequence(items));
        serde_yaml::to_string(&Value::Mapping(root)).unwrap()
    }

    /// The index of the rule a problem path points at (`rules[3].x` → 3).
    fn rule_index(p: &Problem) -> Option<usize> {
        let rest = p.path.strip_prefix("rules[")?;
        rest[..rest.find(']')?].parse().ok()
    }

    /// Problems name exactly the faulty rules: each faulty rule at least once, no other.
    fn check_problems(
        problems: &[Problem],
        faults: &[Fault],
        file: &str,
    ) -> Result<(), TestCaseError> {
        for p in problems {
            prop_assert_eq!(&p.file, file);
            prop_assert!(!p.reason.is_empty());
            let i = rule_index(p);
            prop_assert!(
                i.is_some_and(|i| faults.get(i).is_some_and(|f| *f != Fault::None)),
                "{}",
                p
            );
        }
        for (i, f) in faults.iter().enumerate() {
            if *f != Fault::None {
                prop_assert!(
                    problems.iter().any(|p| rule_index(p) == Some(i)),
                    "rule {} ({:?}) not reported",
                    i,
                    f
                );
            }
        }
        Ok(())
    }

    /// The effective fault of each rule. A `DuplicateId` rule reuses the first rule's
    /// id, which is only a duplicate when an earlier rule really holds that id (the
    /// first rule may itself be the one without an id).
    fn effective(faults: impl Iterator<Item = Fault>) -> Vec<Fault> {
        let mut first_id_taken = false;
        faults
            .enumerate()
            .map(|(i, f)| {
                let claims = f != Fault::MissingId && (i == 0 || f == Fault::DuplicateId);
                let duplicate = claims && first_id_taken;
                first_id_taken |= claims;
                if f == Fault::DuplicateId && !duplicate {
                    Fault::None
                } else {
                    f
                }
            })
            .collect()
    }

    fn contains(body: &str, marker: &str) -> bool {
        body.to_ascii_lowercase()
            .contains(&marker.to_ascii_lowercase())
    }

    /// A body made of markers (in any case) and filler.
    fn body() -> impl Strategy<Value = (String, u64)> {
        (
            proptest::collection::vec(
                prop_oneof![
                    (0..MARKERS.len()).prop_map(|i| MARKERS[i].to_string()),
                    "[a-z ]{0,6}",
                ],
                0..5,
            ),
            any::<u64>(),
        )
            .prop_map(|(parts, seed)| (parts.concat(), seed))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        /// Generated restatement files are accepted iff no rule is faulty, problems name
        /// exactly the faulty rules, and an accepted set restates like the model says:
        /// first rule whose provider, status and markers fire and no exclusion does.
        #[test]
        fn restatement_rules_behave_like_the_model(
            rules in proptest::collection::vec(restate(), 0..6),
            queries in proptest::collection::vec((0..PROVIDERS.len(), proptest::sample::select(vec![400u16, 403, 429, 500, 503]), body()), 1..8),
        ) {
            let text = document(rules.iter().enumerate().map(|(i, r)| restate_yaml(i, r)).collect());
            let faults = effective(rules.iter().map(|r| r.fault));
            let result = RuleSet::from_texts(Some(("r.yaml", &text)), None);
            if faults.iter().any(|f| *f != Fault::None) {
                let problems = result.err().unwrap_or_default();
                prop_assert!(!problems.is_empty(), "accepted a faulty file:\n{}", text);
                return check_problems(&problems, &faults, "r.yaml");
            }
            let set = result.map_err(|p| TestCaseError::fail(format!("{p:?}\n{text}")))?;
            prop_assert_eq!(set.restatement_count(), rules.len());
            for (p, status, (body, seed)) in queries {
                let provider = ["glm", "openai", "other"][p];
                let body = random_case(&body, &mut Rng::new(seed));
                let want = rules.iter().enumerate().find(|(_, r)| {
                    (PROVIDERS[r.provider] == "*" || PROVIDERS[r.provider] == provider)
                        && r.from.contains(&status)
                        && r.text.iter().any(|m| contains(&body, MARKERS[*m]))
                        && !r.exclude.iter().any(|m| contains(&body, MARKERS[*m]))
                });
                let got = set.restate(provider, status, body.as_bytes());
                match want {
                    None => prop_assert_eq!(got, None),
                    Some((i, r)) => {
                        let got = got.unwrap();
                        prop_assert_eq!(got.rule, format!("r{i}"));
                        prop_assert_eq!(got.to_status, r.to);
                        prop_assert_eq!(got.retry_after_s, r.retry.unwrap_or(60));
                    }
                }
            }
        }

        /// The same for classification files: acceptance, problem paths, and the first
        /// matching rule with the verdict it states (and the documented defaults).
        #[test]
        fn classification_rules_behave_like_the_model(
            rules in proptest::collection::vec(classify(), 0..6),
            queries in proptest::collection::vec((0..PROVIDERS.len(), proptest::sample::select(vec![400u16, 403, 429, 500]), body(), proptest::option::of((0..HEADER_NAMES.len(), 0..HEADER_VALUES.len()))), 1..8),
        ) {
            let text = document(rules.iter().enumerate().map(|(i, c)| classify_yaml(i, c)).collect());
            let faults = effective(rules.iter().map(|c| c.fault));
            let result = RuleSet::from_texts(None, Some(("c.yaml", &text)));
            if faults.iter().any(|f| *f != Fault::None) {
                let problems = result.err().unwrap_or_default();
                prop_assert!(!problems.is_empty(), "accepted a faulty file:\n{}", text);
                return check_problems(&problems, &faults, "c.yaml");
            }
            let set = result.map_err(|p| TestCaseError::fail(format!("{p:?}\n{text}")))?;
            prop_assert_eq!(set.classification_count(), rules.len());
            for (p, status, (body, seed), header) in queries {
                let provider = ["glm", "openai", "other"][p];
                let body = random_case(&body, &mut Rng::new(seed));
                let mut h = HeaderMap::new();
                if let Some((n, v)) = header {
                    let name = HeaderName::from_bytes(HEADER_NAMES[n].to_ascii_lowercase().as_bytes()).unwrap();
                    let value = format!(" {} ", random_case(HEADER_VALUES[v], &mut Rng::new(seed)));
                    h.insert(name, HeaderValue::from_str(&value).unwrap());
                }
                let want = rules.iter().enumerate().find(|(_, c)| {
                    (PROVIDERS[c.provider] == "*" || PROVIDERS[c.provider] == provider)
                        && c.status.as_ref().is_none_or(|s| s.contains(&status))
                        && c.matches.as_ref().is_none_or(|m| m.iter().any(|m| contains(&body, MARKERS[*m])))
                        && c.header.is_none_or(|(n, v)| header.is_some_and(|(hn, hv)| {
                            hn == n && v.is_none_or(|v| HEADER_VALUES[v].eq_ignore_ascii_case(HEADER_VALUES[hv]))
                        }))
                });
                let hay = Haystack::new(body.as_bytes());
                let got = set.classification_rule(provider, status, Some(&h), &hay);
                prop_assert_eq!(got.map(|r| r.id().to_string()), want.map(|(i, _)| format!("c{i}")));
                if let (Some(rule), Some((_, c))) = (got, want) {
                    let v = rule.classification();
                    let scope: Scope = SCOPES[c.scope].parse().unwrap();
                    prop_assert_eq!(v.reason, REASONS[c.reason].parse::<Reason>().unwrap());
                    prop_assert_eq!(v.scope, scope);
                    prop_assert_eq!(v.terminal, c.terminal.then_some(TerminalState::Banned));
                    prop_assert_eq!(v.cooldown, c.cooldown.map(Duration::from_secs));
                    prop_assert_eq!(v.retryable, c.retryable.unwrap_or(scope != Scope::Request && !c.terminal));
                }
                // No headers at all: a header condition cannot hold.
                let bare = set.classification_rule(provider, status, None, &hay);
                prop_assert!(bare.is_none_or(|r| rules[r.id()[1..].parse::<usize>().unwrap()].header.is_none()));
            }
        }

        /// Arbitrary text, and YAML documents with random keys and values, never panic
        /// either loader; every problem carries its file and a reason.
        #[test]
        fn rule_loaders_survive_any_text(
            text in prop_oneof![
                any::<String>(),
                "[a-z_:\\-\\[\\]{}, \n\"0-9*]{0,200}",
                super::config::yaml_document(),
            ],
        ) {
            for result in [
                RuleSet::from_texts(Some(("r.yaml", &text)), None),
                RuleSet::from_texts(None, Some(("c.yaml", &text))),
                RuleSet::from_texts(Some(("r.yaml", &text)), Some(("c.yaml", &text))),
            ] {
                if let Err(problems) = result {
                    prop_assert!(!problems.is_empty());
                    for p in problems {
                        prop_assert!(p.file == "r.yaml" || p.file == "c.yaml");
                        prop_assert!(!p.reason.is_empty());
                    }
                }
            }
        }
    }

    /// More than 500 rules is refused; an alias bomb and very deep nesting are refused
    /// within the deadline instead of exhausting memory or the stack.
    #[test]
    fn hostile_rule_files_are_refused_quickly() {
        finishes("rule files", Duration::from_secs(60), || {
            let many = document(
                (0..501)
                    .map(|i| {
                        restate_yaml(
                            i,
                            &Restate {
                                provider: 0,
                                from: vec![403],
                                to: 429,
                                text: vec![0],
                                exclude: vec![],
                                retry: None,
                                fault: Fault::None,
                            },
                        )
                    })
                    .collect(),
            );
            let problems = RuleSet::from_texts(Some(("r.yaml", &many)), None).unwrap_err();
            assert!(
                problems
                    .iter()
                    .any(|p| p.path == "rules" && p.reason.contains("500")),
                "{problems:?}"
            );
            for text in [alias_bomb(), deep_yaml(MODERATE_DEPTH)] {
                let problems =
                    RuleSet::from_texts(Some(("r.yaml", &text)), Some(("c.yaml", &text)))
                        .unwrap_err();
                assert!(
                    problems.iter().all(|p| p.reason.contains("not valid YAML")
                        || p.reason.contains("nested more than")),
                    "{problems:?}"
                );
            }
        });
    }

    /// Nesting that serde_yaml refuses quickly today (depth > its recursion limit of
    /// 128, but small enough that the quadratic parse below stays fast).
    pub(super) const MODERATE_DEPTH: usize = 2_000;

    /// Deep flow nesting must be refused in bounded time. It is not: the whole
    /// document is parsed into events before serde_yaml's recursion limit (128) is
    /// checked, and that parse is quadratic in the nesting depth (times on this machine,
    /// debug build: 10k `[` 0.6–1 s, 20k 1.2–3.5 s, 40k 4.5–14 s, 100k ≈ 40 s). A rule
    /// file or config of a few hundred KiB stalls the loader (`sluice check`, startup,
    /// every hot reload) for minutes.
    #[test]
    fn deeply_nested_yaml_is_refused_in_bounded_time() {
        for text in [
            deep_yaml(100_000),
            format!("rules: {}", "[".repeat(100_000)),
        ] {
            let rules = text.clone();
            finishes("deep rule file", Duration::from_secs(5), move || {
                RuleSet::from_texts(Some(("r.yaml", &rules)), None).is_err()
            });
            let config = text.replace("rules:", "models:");
            finishes("deep config", Duration::from_secs(5), move || {
                super::config::parse(&config).is_err()
            });
        }
    }

    /// Nine levels of ten aliases each: a billion nodes if expanded.
    pub(super) fn alias_bomb() -> String {
        let mut t = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..10 {
            let refs = vec![format!("*a{}", i - 1); 10].join(", ");
            t.push_str(&format!("a{i}: &a{i} [{refs}]\n"));
        }
        t.push_str("rules: *a9\n");
        t
    }

    pub(super) fn deep_yaml(depth: usize) -> String {
        format!("rules: {}{}\n", "[".repeat(depth), "]".repeat(depth))
    }
}

// ---------------------------------------------------------------------------------------
// Config file: `parse_str`, and the units and URLs inside it.
// ---------------------------------------------------------------------------------------
mod config {
    use super::*;
    use serde_yaml::{Mapping, Value};
    use sluice::config::units::{parse_duration, parse_size};
    use sluice::config::validate::parse_base_url;
    use sluice::config::{parse_str, Loaded, Problem};
    use std::path::Path;

    const SEEDS: [(&str, &str); 2] = [
        ("demo.yaml", include_str!("../conf/demo.yaml")),
        ("sluice.yaml", include_str!("../conf/sluice.yaml")),
    ];
    const TOP: [&str; 9] = [
        "server",
        "state",
        "rules_dir",
        "admin",
        "clients",
        "providers",
        "models",
        "resilience",
        "emergency_fallback",
    ];
    const KEYS: [&str; 40] = [
        "id",
        "name",
        "listen",
        "admin_listen",
        "threads",
        "max_attempts",
        "max_body_bytes",
        "base_url",
        "api",
        "class",
        "connections",
        "api_key_env",
        "max_concurrent",
        "model_concurrency",
        "bucket",
        "retry_delay",
        "targets",
        "provider",
        "model",
        "connection",
        "weight",
        "cost",
        "strategy",
        "breaker",
        "apikey",
        "degrade_at",
        "open_at",
        "reset",
        "queue",
        "wait",
        "stream",
        "ttft_timeout",
        "stall_timeout",
        "combo_wait",
        "enabled",
        "token_env",
        "key_env",
        "scopes",
        "session_affinity",
        "ttl",
    ];
    /// A directory that does not exist: relative `*_file` paths never reach a real file.
    const BASE: &str = "/nonexistent/sluice-fuzz";
    const KNOWN_KEY: &str = "placeholder-credential";

    /// Credentials are set (except `*UNSET*`); the `SLUICE_*` settings variables are not.
    fn env(name: &str) -> Option<String> {
        let setting = name.starts_with("SLUICE_")
            && name != "SLUICE_ADMIN_TOKEN"
            && !name.starts_with("SLUICE_KEY_");
        (!setting && !name.contains("UNSET")).then(|| KNOWN_KEY.to_string())
    }

    pub(super) fn parse(text: &str) -> Result<Loaded, Vec<Problem>> {
        parse_str(text, "fuzz.yaml", Path::new(BASE), &env)
    }

    fn scalar() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| Value::Number(n.into())),
            (0u64..100).prop_map(|n| Value::Number(n.into())),
            any::<f64>().prop_map(|f| Value::Number(f.into())),
            proptest::sample::select(vec![
                "30s",
                "0s",
                "500ms",
                "1h 30m",
                "16MiB",
                "0",
                "http://127.0.0.1:9",
                "https://[::1]:8443/v1/",
                "127.0.0.1:0",
                "openai",
                "anthropic",
                "priority",
                "weighted",
                "apikey",
                "local",
                "p",
                "c",
                "m",
                "p/c",
                "KEY",
                "UNSET_KEY",
                "*",
                "lease:exclusive",
            ])
            .prop_map(|t| Value::String(t.to_string())),
            "\\PC{0,12}".prop_map(Value::String),
        ]
    }

    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => proptest::sample::select(KEYS.to_vec()).prop_map(str::to_string),
            1 => proptest::sample::select(TOP.to_vec()).prop_map(str::to_string),
            1 => "[a-z_]{1,8}",
        ]
    }

    fn tree() -> impl Strategy<Value = Value> {
        scalar().prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Sequence),
                proptest::collection::vec((key(), inner), 0..6).prop_map(|kv| {
                    Value::Mapping(kv.into_iter().map(|(k, v)| (Value::String(k), v)).collect())
                }),
            ]
        })
    }

    /// A YAML document whose top-level keys are mostly real section names.
    pub(super) fn yaml_document() -> impl Strategy<Value = String> {
        proptest::collection::vec(
            (prop_oneof![4 => proptest::sample::select(TOP.to_vec()).prop_map(str::to_string), 1 => key()], tree()),
            0..8,
        )
        .prop_map(|kv| {
            let root: Mapping = kv.into_iter().map(|(k, v)| (Value::String(k), v)).collect();
            serde_yaml::to_string(&Value::Mapping(root)).unwrap()
        })
    }

    /// `text` accepted: the YAML written back by serde_yaml validates to the same config
    /// with the same warnings.
    fn revalidates_the_same(text: &str, first: &Loaded) -> Result<(), TestCaseError> {
        let value: Value = serde_yaml::from_str(text).unwrap();
        let again = serde_yaml::to_string(&value).unwrap();
        let second = parse(&again);
        prop_assert!(second.is_ok(), "{:?}\n{}", second.err(), again);
        let second = second.unwrap();
        prop_assert_eq!(
            format!("{:?}", first.config),
            format!("{:?}", second.config)
        );
        prop_assert_eq!(&first.warnings, &second.warnings);
        Ok(())
    }

    fn check_problems(problems: &[Problem]) -> Result<(), TestCaseError> {
        prop_assert!(!problems.is_empty());
        for p in problems {
            prop_assert_eq!(p.file.as_str(), "fuzz.yaml");
            prop_assert!(!p.reason.is_empty(), "{:?}", p);
            prop_assert!(
                !p.reason.contains(KNOWN_KEY),
                "a problem leaks a secret: {}",
                p
            );
        }
        Ok(())
    }

    /// Number of nodes (pre-order) in a YAML tree.
    fn nodes(v: &Value) -> usize {
        1 + match v {
            Value::Sequence(s) => s.iter().map(nodes).sum(),
            Value::Mapping(m) => m.values().map(nodes).sum(),
            Value::Tagged(t) => nodes(&t.value),
            _ => 0,
        }
    }

    /// The `n`-th node (pre-order) and whether it is a free-form map (`model_concurrency`
    /// takes any key).
    fn node_mut(v: &mut Value, n: usize) -> Option<(&mut Value, bool)> {
        fn go<'a>(v: &'a mut Value, k: &mut usize, free: bool) -> Option<(&'a mut Value, bool)> {
            if *k == 0 {
                return Some((v, free));
            }
            *k -= 1;
            match v {
                Value::Sequence(s) => s.iter_mut().find_map(|x| go(x, k, false)),
                Value::Mapping(m) => m.iter_mut().find_map(|(key, x)| {
                    let free = key.as_str() == Some("model_concurrency");
                    go(x, k, free)
                }),
                _ => None,
            }
        }
        let mut k = n;
        go(v, &mut k, false)
    }

    fn seeds() -> Vec<Value> {
        SEEDS
            .iter()
            .map(|(name, text)| {
                let loaded = parse(text);
                assert!(
                    loaded.is_ok(),
                    "conf/{name} no longer validates: {:?}",
                    loaded.err()
                );
                serde_yaml::from_str(text).unwrap()
            })
            .collect()
    }

    #[derive(Clone, Debug)]
    enum Edit {
        Replace(usize, Value),
        Remove(usize, usize),
        Duplicate(usize, usize),
    }

    fn edit() -> impl Strategy<Value = Edit> {
        prop_oneof![
            2 => (any::<usize>(), prop_oneof![3 => scalar(), 1 => tree()]).prop_map(|(n, v)| Edit::Replace(n, v)),
            1 => (any::<usize>(), any::<usize>()).prop_map(|(n, i)| Edit::Remove(n, i)),
            1 => (any::<usize>(), any::<usize>()).prop_map(|(n, i)| Edit::Duplicate(n, i)),
        ]
    }

    fn apply(doc: &mut Value, e: &Edit) {
        let count = nodes(doc);
        match e {
            Edit::Replace(n, v) => {
                if let Some((node, _)) = node_mut(doc, n % count) {
                    *node = v.clone();
                }
            }
            Edit::Remove(n, i) => match node_mut(doc, n % count) {
                Some((Value::Mapping(m), _)) if !m.is_empty() => {
                    let key = m.keys().nth(i % m.len()).cloned().unwrap();
                    m.remove(&key);
                }
                Some((Value::Sequence(s), _)) if !s.is_empty() => {
                    s.remove(i % s.len());
                }
                _ => {}
            },
            Edit::Duplicate(n, i) => {
                if let Some((Value::Sequence(s), _)) = node_mut(doc, n % count) {
                    if !s.is_empty() {
                        let item = s[i % s.len()].clone();
                        s.push(item);
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        /// Arbitrary text and random YAML documents: no panic, every problem has the file
        /// and a reason, and anything accepted re-validates the same.
        #[test]
        fn parse_str_survives_any_text(text in prop_oneof![any::<String>(), "[a-z_:\\-\\[\\]{}, \n\"0-9&*]{0,200}", yaml_document()]) {
            match parse(&text) {
                Ok(loaded) => revalidates_the_same(&text, &loaded)?,
                Err(problems) => check_problems(&problems)?,
            }
        }

        /// Random edits of the shipped example configs (values replaced by random values
        /// or trees, keys and items removed or duplicated): no panic; an edited config
        /// that still validates re-validates the same; otherwise its problems are
        /// well-formed.
        #[test]
        fn edited_example_configs_validate_or_explain(
            seed in 0..SEEDS.len(),
            edits in proptest::collection::vec(edit(), 1..4),
        ) {
            let mut doc = seeds().swap_remove(seed);
            for e in &edits {
                apply(&mut doc, e);
            }
            let text = serde_yaml::to_string(&doc).unwrap();
            match parse(&text) {
                Ok(loaded) => revalidates_the_same(&text, &loaded)?,
                Err(problems) => check_problems(&problems)?,
            }
        }

        /// An unknown key in any mapping of an example config (other than a free-form
        /// `model_concurrency` map) is an error that names the key.
        #[test]
        fn unknown_keys_are_refused_at_every_level(seed in 0..SEEDS.len(), n in any::<usize>()) {
            let mut doc = seeds().swap_remove(seed);
            let count = nodes(&doc);
            let maps: Vec<usize> = (0..count)
                .filter(|i| matches!(node_mut(&mut doc, *i), Some((Value::Mapping(_), false))))
                .collect();
            let target = maps[n % maps.len()];
            if let Some((Value::Mapping(m), _)) = node_mut(&mut doc, target) {
                m.insert(Value::String("zz_fuzz_unknown".into()), Value::Bool(true));
            }
            let text = serde_yaml::to_string(&doc).unwrap();
            let problems = parse(&text).err();
            prop_assert!(problems.is_some(), "accepted an unknown key:\n{}", text);
            let problems = problems.unwrap();
            check_problems(&problems)?;
            prop_assert!(problems.iter().any(|p| p.path.contains("zz_fuzz_unknown") || p.reason.contains("zz_fuzz_unknown")), "{:?}", problems);
        }

        /// Durations round-trip through humantime's own format; sizes through every unit;
        /// overflow and junk are errors, never panics or silent zeros.
        #[test]
        fn units_round_trip(
            ms in 0u64..10_000_000_000_000,
            n in 0u64..1_000_000,
            unit in proptest::sample::select(vec![("", 1u64), ("B", 1), ("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30), ("KB", 1_000), ("kB", 1_000), ("MB", 1_000_000), ("GB", 1_000_000_000)]),
            big in any::<u64>(),
            junk in any::<String>(),
        ) {
            let d = Duration::from_millis(ms);
            prop_assert_eq!(parse_duration(&humantime::format_duration(d).to_string()), Ok(d));
            prop_assert_eq!(parse_size(&format!("{n}{}", unit.0)), Ok(n * unit.1));
            prop_assert_eq!(parse_size(&format!(" {n} {} ", unit.0)), Ok(n * unit.1));
            prop_assert_eq!(parse_size(&format!("{big}{}", unit.0)).ok(), big.checked_mul(unit.1));
            let _ = parse_duration(&junk);
            let _ = parse_size(&junk);
            let overflow = format!("{big}0000000000GiB");
            prop_assert!(parse_size(&overflow).is_err());
        }

        /// Base URLs round-trip their parts; arbitrary text never panics.
        #[test]
        fn base_urls_round_trip(
            tls in any::<bool>(),
            host in prop_oneof!["[a-z0-9][a-z0-9.-]{0,20}", Just("[::1]".to_string()), Just("[fe80::1]".to_string())],
            port in proptest::option::of(any::<u16>()),
            path in proptest::collection::vec("[a-z0-9_]{1,6}", 0..3),
            trailing in any::<bool>(),
            junk in any::<String>(),
        ) {
            let mut text = format!("{}://{host}", if tls { "https" } else { "http" });
            if let Some(p) = port {
                text.push_str(&format!(":{p}"));
            }
            let prefix: String = path.iter().map(|s| format!("/{s}")).collect();
            text.push_str(&prefix);
            if trailing {
                text.push('/');
            }
            let url = parse_base_url(&text).unwrap();
            prop_assert_eq!(url.tls, tls);
            prop_assert_eq!(url.host, host.trim_start_matches('[').trim_end_matches(']'));
            prop_assert_eq!(url.port, port.unwrap_or(if tls { 443 } else { 80 }));
            prop_assert_eq!(url.path_prefix, prefix);
            let _ = parse_base_url(&junk);
            let _ = parse_base_url(&format!("https://{junk}"));
        }
    }

    /// An alias bomb, very deep nesting and a very long file are refused (or read)
    /// within the deadline.
    #[test]
    fn hostile_config_files_finish() {
        finishes("config files", Duration::from_secs(60), || {
            for text in [
                super::rules::alias_bomb().replace("rules:", "providers:"),
                super::rules::deep_yaml(super::rules::MODERATE_DEPTH).replace("rules:", "models:"),
                format!("server: {{ listen: \"{}\" }}\n", "x".repeat(1 << 20)),
                "providers:\n".to_string()
                    + &"  - { id: p, base_url: \"http://h\", api: openai }\n".repeat(20_000),
            ] {
                let problems = parse(&text).err().unwrap();
                assert!(!problems.is_empty());
            }
        });
    }
}
