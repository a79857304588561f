//! The access log: one line per request (SPEC §2 finish), as text or JSON.
//!
//! It protects two things. First, the request thread's time: a line is formatted by
//! hand (no `tracing` field visitors, no `Debug`, no temporary strings) straight into
//! its worker's batch buffer of `crate::logging`'s background writer, so a request pays
//! no channel message for its line, and no allocation once the buffers have grown.
//! Second, the log itself: every value that comes from a client (method, path, model,
//! client id) is escaped, so no input can start a fake line or break the JSON; the
//! query string is never logged (it may carry keys), nor are bodies, header values or
//! lease owners.
//!
//! Invariants: a rendered line is exactly one `\n`-terminated line; JSON lines are one
//! valid object each; the text format is `key=value` pairs, a value quoted (with JSON
//! escapes) only when it holds a space, quote, `=`, or a control or non-ASCII byte.

use super::ctx::AttemptRecord;
use crate::config::AccessFormat;
use crate::http1::wire;
use crate::logging::Background;
use crate::policy::Millis;
use std::io::Write;

/// Longest path written to a line; a longer one is cut and marked with `...`.
const MAX_PATH: usize = 512;

/// What one request's line says.
pub struct Entry<'a> {
    /// When the request finished, unix milliseconds.
    pub at: Millis,
    pub method: &'a str,
    pub path: &'a str,
    pub route: &'a str,
    pub client: Option<&'a str>,
    pub model: &'a str,
    pub status: u16,
    pub attempts: u32,
    pub provider: &'a str,
    pub connection: &'a str,
    pub upstream_model: &'a str,
    pub failed: &'a [AttemptRecord],
    pub note: Option<&'a str>,
    pub ttfb_ms: Option<u64>,
    pub duration_ms: u64,
    pub bytes_out: usize,
    pub error: Option<&'a str>,
}

/// Where lines go: the background writer, or stderr directly when it could not start.
#[derive(Clone)]
pub struct AccessLog {
    format: AccessFormat,
    sink: Option<Background>,
    /// [`AccessLog::enabled`], decided once: the log filter is set before the gateway
    /// starts and never changes (asking it cost ~250 instructions per request).
    enabled: bool,
}

impl AccessLog {
    /// The log filter must be installed before: it is asked once, here.
    pub fn new(format: AccessFormat, sink: Option<Background>) -> Self {
        let enabled = format != AccessFormat::Off
            && tracing::enabled!(target: "sluice::access", tracing::Level::INFO);
        Self {
            format,
            sink,
            enabled,
        }
    }

    /// Whether a line would be written: the format is not `off` and `SLUICE_LOG` lets
    /// the `sluice::access` target through at `info` (so `SLUICE_LOG=warn` silences it).
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    pub fn write(&self, e: &Entry) {
        let render = match self.format {
            AccessFormat::Text => text,
            AccessFormat::Json => json,
            AccessFormat::Off => return,
        };
        match &self.sink {
            // Into the batch of the calling worker (crate::logging).
            Some(bg) => bg.append(crate::server::workers::current() as usize, |buf| {
                render(e, buf)
            }),
            None => {
                let mut buf = Vec::with_capacity(384);
                render(e, &mut buf);
                let _ = std::io::stderr().lock().write_all(&buf);
            }
        }
    }
}

/// `2026-12-02T04:18:53.123Z INFO sluice::access: request method=POST path=/v1/… …`:
/// the prefix matches the other log lines on the same stream. An absent or empty value
/// is `-`.
pub fn text(e: &Entry, out: &mut Vec<u8>) {
    timestamp(e.at, out);
    out.extend_from_slice(b" INFO sluice::access: request");
    pair(b" method=", e.method, out);
    pair(b" path=", clip(e.path), out);
    pair(b" route=", e.route, out);
    pair(b" model=", e.model, out);
    pair(b" client=", e.client.unwrap_or(""), out);
    num(b" status=", e.status, out);
    num(b" attempts=", e.attempts, out);
    pair(b" provider=", e.provider, out);
    pair(b" connection=", e.connection, out);
    pair(b" upstream_model=", e.upstream_model, out);
    out.extend_from_slice(b" failed=");
    if e.failed.is_empty() {
        out.push(b'-');
    }
    for (i, a) in e.failed.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        text_value(&a.provider, out);
        out.push(b'/');
        text_value(&a.connection, out);
        out.push(b':');
        match a.status {
            Some(s) => num(b"", s, out),
            None => text_value(a.reason, out),
        }
        if let Some(d) = &a.detail {
            out.push(b':');
            text_value(d, out);
        }
    }
    pair(b" note=", e.note.unwrap_or(""), out);
    match e.ttfb_ms {
        Some(t) => num(b" ttfb_ms=", t, out),
        None => out.extend_from_slice(b" ttfb_ms=-"),
    }
    num(b" duration_ms=", e.duration_ms, out);
    num(b" bytes_out=", e.bytes_out as u64, out);
    pair(b" error=", e.error.unwrap_or(""), out);
    out.push(b'\n');
}

/// ` key=value` of the text format (`label` is ` key=`).
fn pair(label: &[u8], v: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(label);
    text_value(if v.is_empty() { "-" } else { v }, out);
}

/// One JSON object per line; absent values (and an empty pick) are `null`.
pub fn json(e: &Entry, out: &mut Vec<u8>) {
    out.extend_from_slice(b"{\"time\":\"");
    timestamp(e.at, out);
    out.push(b'"');
    field("method", Some(e.method), out);
    field("path", Some(clip(e.path)), out);
    field("route", Some(e.route), out);
    field("model", Some(e.model), out);
    field("client", e.client, out);
    num(b",\"status\":", e.status, out);
    num(b",\"attempts\":", e.attempts, out);
    let some = |v: &str| !v.is_empty();
    field("provider", Some(e.provider).filter(|v| some(v)), out);
    field("connection", Some(e.connection).filter(|v| some(v)), out);
    field(
        "upstream_model",
        Some(e.upstream_model).filter(|v| some(v)),
        out,
    );
    out.extend_from_slice(b",\"failed\":[");
    for (i, a) in e.failed.iter().enumerate() {
        out.extend_from_slice(if i > 0 { b",{" } else { b"{" });
        out.extend_from_slice(b"\"provider\":");
        json_str(&a.provider, out);
        field("connection", Some(a.connection.as_str()), out);
        field("model", Some(a.model.as_str()), out);
        match a.status {
            Some(s) => num(b",\"status\":", s, out),
            None => out.extend_from_slice(b",\"status\":null"),
        }
        field("reason", Some(a.reason), out);
        field("detail", a.detail.as_deref(), out);
        out.push(b'}');
    }
    out.push(b']');
    field("note", e.note, out);
    match e.ttfb_ms {
        Some(t) => num(b",\"ttfb_ms\":", t, out),
        None => out.extend_from_slice(b",\"ttfb_ms\":null"),
    }
    num(b",\"duration_ms\":", e.duration_ms, out);
    num(b",\"bytes_out\":", e.bytes_out as u64, out);
    field("error", e.error, out);
    out.extend_from_slice(b"}\n");
}

/// `,"key":"value"` (or `null`) of the JSON format.
fn field(key: &str, v: Option<&str>, out: &mut Vec<u8>) {
    out.extend_from_slice(b",\"");
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(b"\":");
    match v {
        Some(v) => json_str(v, out),
        None => out.extend_from_slice(b"null"),
    }
}

/// The path, cut at [`MAX_PATH`] bytes on a character boundary.
fn clip(path: &str) -> &str {
    if path.len() <= MAX_PATH {
        return path;
    }
    let mut end = MAX_PATH;
    while !path.is_char_boundary(end) {
        end -= 1;
    }
    &path[..end]
}

/// A bare value when every byte is plain printable ASCII other than space, `"` and
/// `=`; otherwise a quoted JSON string. An empty value is `""`.
fn text_value(v: &str, out: &mut Vec<u8>) {
    let plain = !v.is_empty() && v.bytes().all(|b| PLAIN[b as usize]);
    if plain {
        out.extend_from_slice(v.as_bytes());
    } else {
        json_str(v, out);
    }
}

/// The bytes a text value may hold unquoted: printable ASCII but space, `"`, `=`, `\\`.
const PLAIN: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0x21;
    while b < 0x7f {
        t[b] = !matches!(b as u8, b'"' | b'=' | b'\\');
        b += 1;
    }
    t
};

/// `v` as a JSON string literal: quotes, backslashes and control characters escaped;
/// other characters (valid UTF-8 already) as they are.
fn json_str(v: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    let bytes = v.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let esc: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0..=0x1f | 0x7f => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        if esc.is_empty() {
            let _ = write!(out, "\\u{:04x}", b);
        } else {
            out.extend_from_slice(esc);
        }
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

/// RFC 3339 UTC with milliseconds, from unix milliseconds.
fn timestamp(ms: Millis, out: &mut Vec<u8>) {
    let secs = ms / 1000;
    let (y, mo, d) = civil(secs / 86_400);
    let day = secs % 86_400;
    let milli = ms % 1000;
    let mut t = *b"0000-00-00T00:00:00.000Z";
    // Two digits at a time from a table: this runs once per request.
    let two = |t: &mut [u8; 24], at: usize, n: u64| {
        t[at..at + 2].copy_from_slice(&wire::two_digits(n));
    };
    two(&mut t, 0, y / 100);
    two(&mut t, 2, y);
    two(&mut t, 5, mo);
    two(&mut t, 8, d);
    two(&mut t, 11, day / 3600);
    two(&mut t, 14, day % 3600 / 60);
    two(&mut t, 17, day % 60);
    t[20] = b'0' + (milli / 100) as u8;
    two(&mut t, 21, milli);
    out.extend_from_slice(&t);
}

/// `label` then `n` in decimal (the formatter's machinery costs more than the line's
/// other fields together).
fn num(label: &[u8], n: impl Into<u64>, out: &mut Vec<u8>) {
    out.extend_from_slice(label);
    digits(n.into(), 1, out);
}

/// `n` in decimal, zero-padded to at least `width` digits (20 at most, u64::MAX's).
fn digits(n: u64, width: usize, out: &mut Vec<u8>) {
    let mut buf = [b'0'; 20];
    let len = wire::digits(n, &mut buf).len().max(width.min(buf.len()));
    out.extend_from_slice(&buf[buf.len() - len..]);
}

/// (year, month, day) of a count of days since 1970-01-01, in the proleptic Gregorian
/// calendar: counted in 400-year eras starting on 1 March, so the leap day is the last
/// day of the shifted year.
fn civil(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468; // days since 0000-03-01
    let era = z / 146_097;
    let doe = z % 146_097; // day of era, 0..=146096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // 0..=399
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of the March-based year
    let mp = (5 * doy + 2) / 153; // month, March = 0
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = era * 400 + yoe + u64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry<'a>(failed: &'a [AttemptRecord]) -> Entry<'a> {
        Entry {
            at: 1_764_649_133_123, // 2025-12-02T04:18:53.123Z
            method: "POST",
            path: "/v1/chat/completions",
            route: "chat",
            client: None,
            model: "smart",
            status: 200,
            attempts: 2,
            provider: "openai",
            connection: "key-1",
            upstream_model: "gpt-4o",
            failed,
            note: None,
            ttfb_ms: Some(12),
            duration_ms: 30,
            bytes_out: 279,
            error: None,
        }
    }

    fn failed() -> Vec<AttemptRecord> {
        vec![
            AttemptRecord {
                provider: "anthropic".into(),
                connection: "acct".into(),
                model: "claude".into(),
                status: Some(429),
                reason: "rate_limited",
                detail: None,
            },
            AttemptRecord {
                provider: "openai".into(),
                connection: "key-2".into(),
                model: "gpt-4o".into(),
                status: None,
                reason: "tls",
                detail: Some("TLSHandshakeFailure: invalid peer certificate: UnknownIssuer".into()),
            },
        ]
    }

    fn render(f: fn(&Entry, &mut Vec<u8>), e: &Entry) -> String {
        let mut out = Vec::new();
        f(e, &mut out);
        String::from_utf8(out).expect("utf-8")
    }

    #[test]
    fn text_line_has_every_field_in_order() {
        let f = failed();
        let line = render(text, &entry(&f));
        assert_eq!(
            line,
            "2025-12-02T04:18:53.123Z INFO sluice::access: request method=POST \
             path=/v1/chat/completions route=chat model=smart client=- status=200 attempts=2 \
             provider=openai connection=key-1 upstream_model=gpt-4o \
             failed=anthropic/acct:429,openai/key-2:tls:\"TLSHandshakeFailure: invalid peer certificate: UnknownIssuer\" note=- ttfb_ms=12 duration_ms=30 \
             bytes_out=279 error=-\n"
        );
    }

    #[test]
    fn json_line_is_one_object_with_the_same_facts() {
        let f = failed();
        let mut e = entry(&f);
        e.client = Some("team-a");
        e.error = Some("ConnectRefused");
        let line = render(json, &e);
        assert!(line.ends_with("}\n") && line.matches('\n').count() == 1);
        let v: serde_json::Value = serde_json::from_str(&line).expect("valid JSON");
        assert_eq!(v["time"], "2025-12-02T04:18:53.123Z");
        assert_eq!(v["method"], "POST");
        assert_eq!(v["path"], "/v1/chat/completions");
        assert_eq!(v["client"], "team-a");
        assert_eq!(v["status"], 200);
        assert_eq!(v["attempts"], 2);
        assert_eq!(v["upstream_model"], "gpt-4o");
        assert_eq!(v["failed"][0]["status"], 429);
        assert_eq!(v["failed"][1]["status"], serde_json::Value::Null);
        assert_eq!(v["failed"][1]["reason"], "tls");
        assert_eq!(
            v["failed"][1]["detail"],
            "TLSHandshakeFailure: invalid peer certificate: UnknownIssuer"
        );
        assert_eq!(v["failed"][0]["detail"], serde_json::Value::Null);
        assert_eq!(v["note"], serde_json::Value::Null);
        assert_eq!(v["ttfb_ms"], 12);
        assert_eq!(v["bytes_out"], 279);
        assert_eq!(v["error"], "ConnectRefused");
    }

    #[test]
    fn no_request_got_through_has_empty_pick() {
        let mut e = entry(&[]);
        e.provider = "";
        e.connection = "";
        e.upstream_model = "";
        e.ttfb_ms = None;
        e.status = 404;
        e.note = Some("route_not_found");
        let line = render(text, &e);
        assert!(line.contains(" provider=- connection=- upstream_model=- failed=- "));
        assert!(line.contains(" note=route_not_found ttfb_ms=- "));
        let v: serde_json::Value = serde_json::from_str(&render(json, &e)).expect("JSON");
        assert_eq!(v["provider"], serde_json::Value::Null);
        assert_eq!(v["failed"], serde_json::json!([]));
        assert_eq!(v["ttfb_ms"], serde_json::Value::Null);
    }

    #[test]
    fn hostile_values_cannot_forge_a_line_or_a_field() {
        let mut e = entry(&[]);
        e.method = "GET\nINFO sluice::access: request status=200";
        e.path = "/a b\"c=d\\\u{1b}[31m";
        e.model = "模型";
        let line = render(text, &e);
        assert_eq!(line.matches('\n').count(), 1, "{line}");
        assert!(line.contains(r#"method="GET\nINFO sluice::access: request status=200""#));
        assert!(line.contains(r#"path="/a b\"c=d\\\u001b[31m""#), "{line}");
        assert!(line.contains(r#"model="模型""#));
        let j = render(json, &e);
        assert_eq!(j.matches('\n').count(), 1);
        let v: serde_json::Value = serde_json::from_str(&j).expect("JSON");
        assert_eq!(v["method"], e.method);
        assert_eq!(v["path"], e.path);
        assert_eq!(v["model"], "模型");
    }

    #[test]
    fn long_paths_are_clipped_on_a_char_boundary() {
        let long = format!("/{}", "é".repeat(400));
        let mut e = entry(&[]);
        e.path = &long;
        let v: serde_json::Value = serde_json::from_str(&render(json, &e)).expect("JSON");
        let p = v["path"].as_str().expect("path");
        assert!(
            p.len() <= MAX_PATH && p.len() >= MAX_PATH - 1,
            "{}",
            p.len()
        );
        assert!(long.starts_with(p));
    }

    #[test]
    fn numbers_are_written_in_decimal_with_their_padding() {
        let at = |n, width| {
            let mut out = Vec::new();
            digits(n, width, &mut out);
            String::from_utf8(out).expect("utf-8")
        };
        assert_eq!(at(0, 1), "0");
        assert_eq!(at(7, 3), "007");
        assert_eq!(at(1234, 2), "1234");
        assert_eq!(at(u64::MAX, 1), u64::MAX.to_string());
        assert_eq!(at(5, 40), format!("{:020}", 5));
        for n in (0..20_000).chain((1..20).map(|k| 10u64.pow(k) - 1)) {
            assert_eq!(at(n, 1), n.to_string());
            assert_eq!(at(n, 6), format!("{n:06}"));
        }
        let mut out = Vec::new();
        num(b" bytes_out=", usize::MAX as u64, &mut out);
        assert_eq!(out, format!(" bytes_out={}", usize::MAX).into_bytes());
    }

    #[test]
    fn timestamps_match_the_calendar() {
        let at = |ms| {
            let mut out = Vec::new();
            timestamp(ms, &mut out);
            String::from_utf8(out).expect("utf-8")
        };
        assert_eq!(at(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(at(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(at(951_868_799_999), "2000-02-29T23:59:59.999Z");
        assert_eq!(at(4_107_542_400_000), "2100-03-01T00:00:00.000Z");
        // Against humantime's formatter over a spread of instants.
        for i in 0..2_000u64 {
            let ms = i * 2_147_483_647 + i * 7;
            let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
            assert_eq!(at(ms), humantime::format_rfc3339_millis(t).to_string());
        }
    }
}
