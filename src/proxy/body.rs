//! The client's JSON body: validated once, then rewritten per attempt by splicing.
//!
//! The body is read once (to validate it and read `model` / `stream`): by
//! `proxy::bodyscan` when it can, else by serde, with the byte span of the top-level
//! `model` string located by a small scanner. Each
//! attempt's body is the original bytes with only that span replaced, so everything else
//! (key order, whitespace, numbers, unicode escapes) reaches the upstream byte for byte:
//! upstream prompt caches and signatures see exactly what the client sent. The splice is
//! kept as pieces ([`Outgoing`]) that the send writes where they lie: an attempt does not
//! copy the client's body, however large, into one of its own.

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use std::borrow::Cow;

/// What admission needs from the body.
#[derive(Debug, Clone)]
pub struct ParsedBody {
    pub raw: Bytes,
    pub model: String,
    pub stream: bool,
    /// Byte range of the `model` value (including its quotes) in `raw`.
    model_span: (usize, usize),
}

#[derive(Deserialize)]
struct Probe {
    model: Option<serde_json::Value>,
    stream: Option<serde_json::Value>,
}

impl ParsedBody {
    /// Validates `raw` as a JSON object with a string `model`. The error text is meant
    /// for the client (400 `invalid_request`).
    pub fn parse(raw: Bytes) -> Result<Self, String> {
        if raw.is_empty() {
            return Err("request body is empty; expected a JSON object".into());
        }
        // The common body in one pass; anything it does not take, serde_json reads.
        if let Some(top) = super::bodyscan::scan(&raw) {
            let (a, b) = top.model;
            let model = String::from_utf8_lossy(&raw[a + 1..b - 1]).into_owned();
            return Ok(Self {
                raw,
                model,
                stream: top.stream,
                model_span: top.model,
            });
        }
        // serde would also accept a top-level array as a struct; requests are objects.
        let first = raw.iter().find(|b| !b.is_ascii_whitespace());
        if first.is_some_and(|b| matches!(b, b'[' | b'"' | b'0'..=b'9' | b'-' | b't' | b'f' | b'n'))
            && serde_json::from_slice::<serde::de::IgnoredAny>(&raw).is_ok()
        {
            return Err("request body must be a JSON object".into());
        }
        let probe: Probe = serde_json::from_slice(&raw).map_err(|e| {
            if e.is_data() && e.to_string().starts_with("invalid type") {
                "request body must be a JSON object".to_string()
            } else {
                format!("request body is not valid JSON: {e}")
            }
        })?;

        let model = match probe.model {
            Some(serde_json::Value::String(m)) if !m.is_empty() => m,
            Some(serde_json::Value::String(_)) => return Err("`model` must not be empty".into()),
            Some(_) => return Err("`model` must be a string".into()),
            None => return Err("`model` is required".into()),
        };
        let stream = match probe.stream {
            None | Some(serde_json::Value::Null) => false,
            Some(serde_json::Value::Bool(b)) => b,
            Some(_) => return Err("`stream` must be a boolean".into()),
        };
        let model_span = find_top_level_string(&raw, "model")
            .ok_or_else(|| "`model` must be a string".to_string())?;
        Ok(Self {
            raw,
            model,
            stream,
            model_span,
        })
    }

    /// Drops the body bytes (after commit: nothing sends them again). `model` and
    /// `stream` stay.
    pub fn release(&mut self) {
        self.raw = Bytes::new();
        self.model_span = (0, 0);
    }

    /// The body with `model` replaced by `upstream_model` (JSON-escaped), in pieces:
    /// the client's bytes are not copied until the send does.
    pub fn with_model<'a>(&'a self, upstream_model: &'a str) -> Outgoing<'a> {
        debug_assert!(!self.raw.is_empty(), "a released body is never sent again");
        // A released body has no span left to replace: it goes as it is (empty).
        if upstream_model == self.model || self.raw.is_empty() {
            return Outgoing::whole(&self.raw);
        }
        // A name with nothing to escape (the usual one) goes as it is.
        let value = if super::bodyscan::plain(upstream_model.as_bytes()) {
            Cow::Borrowed(upstream_model.as_bytes())
        } else {
            let quoted = serde_json::to_string(upstream_model).unwrap_or_else(|_| "\"\"".into());
            Cow::Owned(quoted.as_bytes()[1..quoted.len() - 1].to_vec())
        };
        // The value between the quotes the client's body already has.
        let (a, b) = self.model_span;
        Outgoing {
            raw: &self.raw,
            span: (a + 1, b - 1),
            value: Some(value),
        }
    }
}

/// A request body as it goes upstream: `raw` with the bytes in `span` replaced by
/// `value` (`None`: `raw` as it is). An HTTP/1.1 send writes its three pieces behind
/// the head (copied into the head's buffer when small, else one vectored write), so an
/// attempt never copies the client's body into a body of its own; HTTP/2 takes it as
/// one buffer ([`Outgoing::to_bytes`]).
pub struct Outgoing<'a> {
    raw: &'a Bytes,
    span: (usize, usize),
    value: Option<Cow<'a, [u8]>>,
}

impl<'a> Outgoing<'a> {
    /// `raw` unchanged.
    pub fn whole(raw: &'a Bytes) -> Self {
        Outgoing {
            raw,
            span: (raw.len(), raw.len()),
            value: None,
        }
    }

    /// Length on the wire.
    pub fn len(&self) -> usize {
        let value = self.value.as_ref().map_or(0, |v| v.len());
        self.raw.len() - (self.span.1 - self.span.0) + value
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes before the replaced span, the new value, and the bytes after it.
    pub fn pieces(&self) -> [&[u8]; 3] {
        let (a, b) = self.span;
        let value = self.value.as_deref().unwrap_or_default();
        [&self.raw[..a], value, &self.raw[b..]]
    }

    /// The body as one buffer: the client's own when nothing is replaced.
    pub fn to_bytes(&self) -> Bytes {
        if self.value.is_none() {
            return self.raw.clone();
        }
        let mut out = BytesMut::with_capacity(self.len());
        for piece in self.pieces() {
            out.extend_from_slice(piece);
        }
        out.freeze()
    }
}

/// Finds the span of the string value of `key` in a top-level JSON object. Assumes the
/// input already parsed as JSON; returns `None` on anything unexpected.
fn find_top_level_string(s: &[u8], key: &str) -> Option<(usize, usize)> {
    let mut i = skip_ws(s, 0);
    if s.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    loop {
        i = skip_ws(s, i);
        match s.get(i)? {
            b'}' => return None,
            b',' => {
                i += 1;
                continue;
            }
            b'"' => {}
            _ => return None,
        }
        let key_end = string_end(s, i)?;
        let key_raw = &s[i..key_end];
        let is_key = if key_raw.contains(&b'\\') {
            serde_json::from_slice::<String>(key_raw).ok().as_deref() == Some(key)
        } else {
            &key_raw[1..key_raw.len() - 1] == key.as_bytes()
        };
        i = skip_ws(s, key_end);
        if s.get(i) != Some(&b':') {
            return None;
        }
        i = skip_ws(s, i + 1);
        let value_end = value_end(s, i)?;
        if is_key {
            return (s.get(i) == Some(&b'"')).then_some((i, value_end));
        }
        i = value_end;
    }
}

fn skip_ws(s: &[u8], mut i: usize) -> usize {
    while matches!(s.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// `s[i]` is an opening quote; returns the index just past the closing quote.
fn string_end(s: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    while j < s.len() {
        match s[j] {
            b'\\' => j += 2,
            b'"' => return Some(j + 1),
            _ => j += 1,
        }
    }
    None
}

/// Returns the index just past the JSON value starting at `i`.
fn value_end(s: &[u8], i: usize) -> Option<usize> {
    match s.get(i)? {
        b'"' => string_end(s, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            while j < s.len() {
                match s[j] {
                    b'"' => {
                        j = string_end(s, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            None
        }
        _ => {
            let mut j = i;
            while j < s.len() && !matches!(s[j], b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
            {
                j += 1;
            }
            Some(j)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<ParsedBody, String> {
        ParsedBody::parse(Bytes::from(s.to_string()))
    }

    #[test]
    fn a_released_body_keeps_its_model_and_stream_flag_but_not_its_bytes() {
        let mut b = parse(r#"{"model":"m","stream":true,"pad":"xxxxxxxx"}"#).unwrap();
        let shared = b.raw.clone();
        b.release();
        assert!(b.raw.is_empty());
        assert_eq!((b.model.as_str(), b.stream), ("m", true));
        // Only the caller's clone is left holding the bytes.
        assert!(shared.is_unique());
    }

    #[test]
    fn rewrites_only_the_model_value() {
        let src = r#"{ "messages":[{"role":"user","content":"say \"model\": x"}], "model" : "smart","z":{"model":"inner"}}"#;
        let b = parse(src).unwrap();
        assert_eq!(b.model, "smart");
        assert!(!b.stream);
        let out = b.with_model("gpt-4o").to_bytes();
        assert_eq!(b.with_model("gpt-4o").len(), out.len());
        assert_eq!(b.with_model("smart").to_bytes(), b.raw);
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            src.replace(r#""model" : "smart""#, r#""model" : "gpt-4o""#)
        );
        let esc = b.with_model("a\"b").to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&esc).unwrap();
        assert_eq!(v["model"], "a\"b");
        assert_eq!(v["z"]["model"], "inner");
    }

    #[test]
    fn escaped_key_is_found() {
        let b = parse(r#"{"stream":true,"mod\u0065l":"m"}"#).unwrap();
        assert!(b.stream);
        let v: serde_json::Value = serde_json::from_slice(&b.with_model("u").to_bytes()).unwrap();
        assert_eq!(v["model"], "u");
    }

    #[test]
    fn clear_errors() {
        assert!(parse("").unwrap_err().contains("empty"));
        assert!(parse("{").unwrap_err().contains("not valid JSON"));
        assert!(parse("[1]").unwrap_err().contains("JSON object"));
        assert_eq!(parse(r#"{"x":1}"#).unwrap_err(), "`model` is required");
        assert_eq!(
            parse(r#"{"model":3}"#).unwrap_err(),
            "`model` must be a string"
        );
        assert_eq!(
            parse(r#"{"model":"m","stream":"yes"}"#).unwrap_err(),
            "`stream` must be a boolean"
        );
        assert!(parse(r#"{"model":"a","model":"b"}"#)
            .unwrap_err()
            .contains("duplicate"));
    }
}
