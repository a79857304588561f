//! The mock's fault-injection spec: parsing and the process-wide fault slot.
//!
//! One grammar serves the `--fault` flag, the `x-mock-fault` request header and the body
//! of `POST /__fault`: `key=value` pairs separated by `;`, every key optional. A value may
//! contain a literal `;` written as `\;` (and a literal backslash as `\\`), which is what
//! lets a JSON error body carry semicolons. Parsing is total: any unknown key, repeated
//! scalar key or malformed value is an error with a message naming the offending part,
//! never a silently ignored fault.
//!
//! `credential=` and `model=` are conditions, not effects: a fault carrying them applies
//! only to a request presenting that credential (the Bearer token or `x-api-key` value,
//! see [`request_credential`]) and whose JSON body names that top-level `model` (see
//! [`body_model`]). That holds for the per-request header as much as for the process
//! slot: a header fault whose conditions do not match is ignored, and the request falls
//! back to the process fault as if it had sent no header ([`resolve`]).
//!
//! The slot holds the process fault with its optional `times` budget. Taking a fault
//! decrements the budget under one short lock so that exactly `times` requests see it,
//! however many race for it; an atomic flag keeps the fault-free hot path lock-free.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use serde::de::{Deserializer as _, IgnoredAny, MapAccess, Visitor};

/// A parsed fault. `Default` is "no fault".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fault {
    /// Answer with this status instead of the normal success.
    pub status: Option<u16>,
    /// Verbatim error body; `None` means the route family's default error shape.
    pub body: Option<String>,
    /// Verbatim `Retry-After` value.
    pub retry_after: Option<HeaderValue>,
    /// Extra response headers, in the order given.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// Sleep after the request body was read.
    pub latency: Option<Duration>,
    /// Extra sleep right before the response header is written.
    pub first_byte_delay: Option<Duration>,
    /// Stream shape override: number of content chunks.
    pub chunks: Option<u32>,
    /// Stream shape override: pause between content chunks.
    pub chunk_interval: Option<Duration>,
    /// Stop writing (but keep the connection) after this many content chunks.
    pub stall_after: Option<u32>,
    /// Close the connection after this many content chunks; 0 = before any header.
    pub reset_after: Option<u32>,
    /// Budget for the process fault: it clears itself after this many requests.
    pub times: Option<u64>,
    /// Only requests presenting this credential are affected (others pass untouched
    /// and do not spend `times`), so one key of several can be made to fail.
    pub credential: Option<String>,
    /// Only requests whose JSON body names this `model` are affected.
    pub model: Option<String>,
}

impl Fault {
    /// Parses a spec; an empty (or all-whitespace) spec is the empty fault.
    pub fn parse(spec: &str) -> Result<Fault, String> {
        let mut fault = Fault::default();
        for part in split_unescaped(spec) {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            let Some((key, value)) = part.split_once('=') else {
                return Err(format!("fault spec: expected key=value, got `{part}`"));
            };
            fault.apply(key.trim(), value.trim())?;
        }
        Ok(fault)
    }

    /// True when the spec changes nothing about the answer.
    pub fn is_empty(&self) -> bool {
        Fault {
            times: None,
            credential: None,
            model: None,
            ..self.clone()
        } == Fault::default()
    }

    /// Whether this fault applies to a request with `credential` and body `model`.
    pub fn matches(&self, credential: Option<&str>, model: Option<&str>) -> bool {
        self.credential
            .as_deref()
            .is_none_or(|c| Some(c) == credential)
            && self.model.as_deref().is_none_or(|m| Some(m) == model)
    }

    fn apply(&mut self, key: &str, value: &str) -> Result<(), String> {
        match key {
            "status" => {
                let code: u16 = value
                    .parse()
                    .map_err(|_| format!("fault spec: status `{value}` is not a number"))?;
                if !(200..=599).contains(&code) {
                    return Err(format!("fault spec: status {code} is outside 200..=599"));
                }
                set_once(&mut self.status, key, code)
            }
            "body" => set_once(&mut self.body, key, value.to_string()),
            "retry_after" => {
                let v = HeaderValue::from_str(value)
                    .map_err(|_| format!("fault spec: retry_after `{value}` is not a valid header value"))?;
                set_once(&mut self.retry_after, key, v)
            }
            "header" => {
                let Some((name, val)) = value.split_once(':') else {
                    return Err(format!("fault spec: header `{value}` must be Name:Value"));
                };
                let name = HeaderName::from_bytes(name.trim().as_bytes())
                    .map_err(|_| format!("fault spec: `{}` is not a valid header name", name.trim()))?;
                let val = HeaderValue::from_str(val.trim())
                    .map_err(|_| format!("fault spec: `{}` is not a valid header value", val.trim()))?;
                self.headers.push((name, val));
                Ok(())
            }
            "latency" => set_once(&mut self.latency, key, duration(key, value)?),
            "first_byte_delay" => set_once(&mut self.first_byte_delay, key, duration(key, value)?),
            "chunks" => set_once(&mut self.chunks, key, number(key, value)?),
            "chunk_interval" => set_once(&mut self.chunk_interval, key, duration(key, value)?),
            "stall_after" => set_once(&mut self.stall_after, key, number(key, value)?),
            "reset_after" => set_once(&mut self.reset_after, key, number(key, value)?),
            "credential" => set_once(&mut self.credential, key, value.to_string()),
            "model" => set_once(&mut self.model, key, value.to_string()),
            "times" => {
                let n: u64 = number(key, value)?;
                if n == 0 {
                    return Err("fault spec: times must be at least 1".to_string());
                }
                set_once(&mut self.times, key, n)
            }
            other => Err(format!(
                "fault spec: unknown key `{other}` (known: status, body, retry_after, header, \
                 latency, first_byte_delay, chunks, chunk_interval, stall_after, reset_after, times, \
                 credential, model)"
            )),
        }
    }
}

/// Renders the fault back in spec form (for `/__stats`); round-trips through `parse`.
impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts: Vec<String> = Vec::new();
        if let Some(s) = self.status {
            parts.push(format!("status={s}"));
        }
        if let Some(b) = &self.body {
            parts.push(format!("body={}", escape(b)));
        }
        if let Some(r) = &self.retry_after {
            parts.push(format!(
                "retry_after={}",
                escape(&String::from_utf8_lossy(r.as_bytes()))
            ));
        }
        for (n, v) in &self.headers {
            parts.push(format!(
                "header={}:{}",
                n,
                escape(&String::from_utf8_lossy(v.as_bytes()))
            ));
        }
        let durations = [
            ("latency", self.latency),
            ("first_byte_delay", self.first_byte_delay),
            ("chunk_interval", self.chunk_interval),
        ];
        for (k, d) in durations {
            if let Some(d) = d {
                parts.push(format!("{k}={}", humantime::format_duration(d)));
            }
        }
        let counts = [
            ("chunks", self.chunks),
            ("stall_after", self.stall_after),
            ("reset_after", self.reset_after),
        ];
        for (k, n) in counts {
            if let Some(n) = n {
                parts.push(format!("{k}={n}"));
            }
        }
        if let Some(t) = self.times {
            parts.push(format!("times={t}"));
        }
        if let Some(c) = &self.credential {
            parts.push(format!("credential={}", escape(c)));
        }
        if let Some(m) = &self.model {
            parts.push(format!("model={}", escape(m)));
        }
        f.write_str(&parts.join(";"))
    }
}

/// The inverse of [`split_unescaped`]'s escapes for one value.
fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace(';', "\\;")
}

fn set_once<T>(slot: &mut Option<T>, key: &str, value: T) -> Result<(), String> {
    if slot.is_some() {
        return Err(format!("fault spec: `{key}` given twice"));
    }
    *slot = Some(value);
    Ok(())
}

fn duration(key: &str, value: &str) -> Result<Duration, String> {
    humantime::parse_duration(value).map_err(|e| {
        format!("fault spec: {key} `{value}` is not a duration ({e}); use e.g. 200ms or 2s")
    })
}

fn number<T: std::str::FromStr>(key: &str, value: &str) -> Result<T, String> {
    value
        .parse()
        .map_err(|_| format!("fault spec: {key} `{value}` is not a non-negative integer"))
}

/// Splits on `;` not preceded by a backslash, and resolves `\;` and `\\` escapes.
fn split_unescaped(spec: &str) -> Vec<String> {
    let mut parts = Vec::new();
    let mut cur = String::new();
    let mut chars = spec.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(';') => cur.push(';'),
                Some('\\') => cur.push('\\'),
                Some(other) => {
                    cur.push('\\');
                    cur.push(other);
                }
                None => cur.push('\\'),
            },
            ';' => parts.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    parts.push(cur);
    parts
}

/// The credential a request presents, as the fault condition `credential=` and the
/// `by_credential` counters see it: the token of `Authorization: Bearer <token>` (OpenAI
/// family), else `x-api-key` (Anthropic family), else any other non-empty
/// `Authorization` value. Empty values present nothing, so an empty or non-Bearer
/// `Authorization` header never hides the `x-api-key` beside it.
pub fn request_credential(headers: &HeaderMap) -> Option<&str> {
    fn text(v: &HeaderValue) -> Option<&str> {
        v.to_str().ok().map(str::trim).filter(|t| !t.is_empty())
    }
    let auth = headers.get(header::AUTHORIZATION).and_then(text);
    if let Some((scheme, token)) =
        auth.and_then(|a| a.split_once(|c: char| c.is_ascii_whitespace()))
    {
        let token = token.trim();
        if scheme.eq_ignore_ascii_case("bearer") && !token.is_empty() {
            return Some(token);
        }
    }
    headers.get("x-api-key").and_then(text).or(auth)
}

/// The top-level `model` of a JSON object body, as the condition `model=` sees it. Only
/// that key is decoded (escapes resolved); every other value is skipped unparsed, a
/// non-string `model` is no model, and of repeated keys the last wins, as in the common
/// JSON parsers. `None` when the body is not a JSON object.
pub fn body_model(body: &[u8]) -> Option<String> {
    struct TopLevelModel;
    impl<'de> Visitor<'de> for TopLevelModel {
        type Value = Option<String>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut model = None;
            while let Some(key) = map.next_key::<String>()? {
                if key == "model" {
                    model = match map.next_value::<serde_json::Value>()? {
                        serde_json::Value::String(m) => Some(m),
                        _ => None,
                    };
                } else {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            Ok(model)
        }
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let model = de.deserialize_map(TopLevelModel).ok()?;
    de.end().ok()?;
    model
}

/// The fault one API request gets. Its own `x-mock-fault` header wins when the header
/// parses and its `credential=` / `model=` conditions hold for this request (a matching
/// header overrides the process fault even when it changes nothing); a header whose
/// conditions do not hold is ignored, and the process fault is consulted as for a
/// request without the header. A header that does not parse is an error for the caller
/// to answer (400), never a silently ignored fault.
pub fn resolve(
    header: Option<&HeaderValue>,
    slot: &FaultSlot,
    credential: Option<&str>,
    body: &[u8],
) -> Result<Option<Arc<Fault>>, String> {
    if let Some(v) = header {
        let text = v
            .to_str()
            .map_err(|_| "x-mock-fault is not valid text".to_string())?;
        let fault = Fault::parse(text)?;
        let model = if fault.model.is_some() {
            body_model(body)
        } else {
            None
        };
        if fault.matches(credential, model.as_deref()) {
            return Ok(Some(Arc::new(fault)));
        }
    }
    Ok(slot.take(credential, || body_model(body)))
}

/// The process-wide fault, set by `--fault` or `POST /__fault`.
#[derive(Default)]
pub struct FaultSlot {
    armed: AtomicBool,
    slot: Mutex<Option<(Arc<Fault>, Option<u64>)>>,
}

impl FaultSlot {
    /// Replaces the process fault; an empty fault clears it.
    pub fn set(&self, fault: Fault) {
        let mut g = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        if fault.is_empty() {
            *g = None;
            self.armed.store(false, Ordering::Release);
        } else {
            let times = fault.times;
            *g = Some((Arc::new(fault), times));
            self.armed.store(true, Ordering::Release);
        }
    }

    /// Takes the fault for one request (if its conditions match), spending one unit of
    /// its `times` budget.
    pub fn take(
        &self,
        credential: Option<&str>,
        model: impl FnOnce() -> Option<String>,
    ) -> Option<Arc<Fault>> {
        if !self.armed.load(Ordering::Acquire) {
            return None;
        }
        let mut g = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        let (fault, remaining) = g.as_mut()?;
        let model = if fault.model.is_some() { model() } else { None };
        if !fault.matches(credential, model.as_deref()) {
            return None;
        }
        let fault = fault.clone();
        if let Some(n) = remaining {
            *n = n.saturating_sub(1);
            if *n == 0 {
                *g = None;
                self.armed.store(false, Ordering::Release);
            }
        }
        Some(fault)
    }

    /// The current fault in spec form with its remaining budget, for `/__stats`.
    pub fn describe(&self) -> Option<String> {
        let g = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        g.as_ref().map(|(f, remaining)| {
            let shown = Fault {
                times: *remaining,
                ..(**f).clone()
            };
            shown.to_string()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_key() {
        let f = Fault::parse(
            "status=429; retry_after=2;header=x-a:1;header=X-B: two;latency=200ms;\
             first_byte_delay=1s;chunks=3;chunk_interval=5ms;stall_after=1;reset_after=2;times=4",
        )
        .unwrap();
        assert_eq!(f.status, Some(429));
        assert_eq!(f.retry_after.as_ref().unwrap(), "2");
        assert_eq!(f.headers.len(), 2);
        assert_eq!(f.headers[1].0.as_str(), "x-b");
        assert_eq!(f.headers[1].1, "two");
        assert_eq!(f.latency, Some(Duration::from_millis(200)));
        assert_eq!(f.first_byte_delay, Some(Duration::from_secs(1)));
        assert_eq!(f.chunks, Some(3));
        assert_eq!(f.chunk_interval, Some(Duration::from_millis(5)));
        assert_eq!(f.stall_after, Some(1));
        assert_eq!(f.reset_after, Some(2));
        assert_eq!(f.times, Some(4));
    }

    #[test]
    fn body_keeps_escaped_semicolons_and_equals() {
        let f = Fault::parse(r#"status=200;body={"error":"a\;b=c"}"#).unwrap();
        assert_eq!(f.body.as_deref(), Some(r#"{"error":"a;b=c"}"#));
        let again = Fault::parse(&f.to_string()).unwrap();
        assert_eq!(again, f);
    }

    #[test]
    fn empty_spec_is_no_fault() {
        assert!(Fault::parse("").unwrap().is_empty());
        assert!(Fault::parse(" ; ").unwrap().is_empty());
        assert!(Fault::parse("times=3").unwrap().is_empty());
    }

    #[test]
    fn rejects_malformed_specs() {
        for bad in [
            "status",
            "status=abc",
            "status=99",
            "latency=fast",
            "chunks=-1",
            "nope=1",
            "status=500;status=502",
            "times=0",
            "header=novalue",
            "header=bad name:1",
        ] {
            assert!(Fault::parse(bad).is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn slot_spends_times_budget_exactly() {
        let slot = FaultSlot::default();
        slot.set(Fault::parse("status=500;times=2").unwrap());
        assert!(slot.take(None, || None).is_some());
        assert_eq!(slot.describe().as_deref(), Some("status=500;times=1"));
        assert!(slot.take(None, || None).is_some());
        assert!(slot.take(None, || None).is_none());
        assert!(slot.describe().is_none());
    }

    #[test]
    fn slot_without_times_persists_until_cleared() {
        let slot = FaultSlot::default();
        slot.set(Fault::parse("status=503").unwrap());
        for _ in 0..5 {
            assert_eq!(slot.take(None, || None).unwrap().status, Some(503));
        }
        slot.set(Fault::default());
        assert!(slot.take(None, || None).is_none());
    }

    #[test]
    fn conditional_fault_only_hits_matching_requests() {
        let slot = FaultSlot::default();
        slot.set(Fault::parse("status=429;credential=key-1;model=alpha;times=1").unwrap());
        assert!(slot.take(Some("key-2"), || Some("alpha".into())).is_none());
        assert!(slot.take(Some("key-1"), || Some("beta".into())).is_none());
        assert!(slot.take(None, || None).is_none());
        let hit = slot.take(Some("key-1"), || Some("alpha".into())).unwrap();
        assert_eq!(hit.status, Some(429));
        // The budget was spent only by the matching request.
        assert!(slot.take(Some("key-1"), || Some("alpha".into())).is_none());
        assert_eq!(
            Fault::parse("status=500;credential=k;model=m")
                .unwrap()
                .to_string(),
            "status=500;credential=k;model=m"
        );
    }

    use crate::policy::header_map as headers;

    #[test]
    fn credential_of_either_family() {
        assert_eq!(request_credential(&headers(&[])), None);
        // OpenAI family.
        for auth in ["Bearer tok", "bearer tok", "BEARER\ttok", " Bearer   tok  "] {
            assert_eq!(
                request_credential(&headers(&[("authorization", auth)])),
                Some("tok"),
                "{auth:?}"
            );
        }
        // Anthropic family, also beside an Authorization header that is empty, has no
        // token or is of another scheme (a proxy's Basic credentials, say).
        assert_eq!(
            request_credential(&headers(&[("x-api-key", " ak ")])),
            Some("ak")
        );
        for auth in ["", "   ", "Bearer", "Bearer  ", "Basic cHJveHk6cGFzcw=="] {
            let h = headers(&[("authorization", auth), ("x-api-key", "ak")]);
            assert_eq!(request_credential(&h), Some("ak"), "{auth:?}");
        }
        // A Bearer token is the credential even when an x-api-key is also sent.
        let both = headers(&[("x-api-key", "ak"), ("authorization", "Bearer tok")]);
        assert_eq!(request_credential(&both), Some("tok"));
        // Another scheme alone is presented as is; empty values present nothing.
        assert_eq!(
            request_credential(&headers(&[("authorization", "Token abc")])),
            Some("Token abc")
        );
        let empty = headers(&[("authorization", ""), ("x-api-key", "")]);
        assert_eq!(request_credential(&empty), None);
    }

    #[test]
    fn body_model_reads_only_the_top_level_string() {
        let cases: &[(&str, Option<&str>)] = &[
            (r#"{"model":"gpt-4o"}"#, Some("gpt-4o")),
            (
                r#" { "stream" : true , "model" : "a\/b\u0021" } "#,
                Some("a/b!"),
            ),
            (
                r#"{"messages":[{"model":"inner"}],"model":"outer"}"#,
                Some("outer"),
            ),
            (r#"{"messages":[{"model":"inner"}]}"#, None),
            (r#"{"model":"first","model":"last"}"#, Some("last")),
            (r#"{"model":7}"#, None),
            (r#"{"model":null}"#, None),
            (r#"["model","x"]"#, None),
            (r#"{"model":"x"} trailing"#, None),
            ("", None),
        ];
        for (body, want) in cases {
            assert_eq!(body_model(body.as_bytes()).as_deref(), *want, "{body}");
        }
    }

    fn value(s: &str) -> HeaderValue {
        HeaderValue::from_str(s).unwrap()
    }

    #[test]
    fn header_fault_applies_only_when_its_conditions_hold() {
        let slot = FaultSlot::default();
        let body = br#"{"model":"alpha"}"#;
        let h = value("status=503;credential=key-1;model=alpha");
        let hit = resolve(Some(&h), &slot, Some("key-1"), body).unwrap();
        assert_eq!(hit.unwrap().status, Some(503));
        assert!(resolve(Some(&h), &slot, Some("key-2"), body)
            .unwrap()
            .is_none());
        assert!(resolve(Some(&h), &slot, None, body).unwrap().is_none());
        let beta = br#"{"model":"beta"}"#;
        assert!(resolve(Some(&h), &slot, Some("key-1"), beta)
            .unwrap()
            .is_none());
        // No conditions: every request.
        let plain = value("status=500");
        assert!(resolve(Some(&plain), &slot, None, b"").unwrap().is_some());
        assert!(resolve(Some(&value("status=abc")), &slot, None, b"").is_err());
    }

    #[test]
    fn unmatched_header_falls_back_to_the_slot_and_a_matching_one_overrides_it() {
        let slot = FaultSlot::default();
        slot.set(Fault::parse("status=500;times=1").unwrap());
        let own = value("latency=1ms;credential=key-1");
        // A matching header wins and does not spend the slot's budget...
        let f = resolve(Some(&own), &slot, Some("key-1"), b"{}")
            .unwrap()
            .unwrap();
        assert_eq!(f.status, None);
        assert_eq!(slot.describe().as_deref(), Some("status=500;times=1"));
        // ...an unmatched one is as if the request had sent none.
        let f = resolve(Some(&own), &slot, Some("key-2"), b"{}")
            .unwrap()
            .unwrap();
        assert_eq!(f.status, Some(500));
        assert!(slot.describe().is_none());
        assert!(resolve(Some(&own), &slot, Some("key-2"), b"{}")
            .unwrap()
            .is_none());
    }

    #[test]
    fn slot_model_condition_reads_the_body_only_when_needed() {
        let slot = FaultSlot::default();
        slot.set(Fault::parse("status=404;model=up-alpha").unwrap());
        let dup = br#"{"model":"x","model":"up-alpha"}"#;
        assert!(resolve(None, &slot, None, dup).unwrap().is_some());
        assert!(resolve(None, &slot, None, br#"{"model":"up-beta"}"#)
            .unwrap()
            .is_none());
        slot.set(Fault::parse("status=404").unwrap());
        let read = std::cell::Cell::new(false);
        let taken = slot.take(None, || {
            read.set(true);
            None
        });
        assert!(taken.is_some());
        assert!(
            !read.get(),
            "a fault without model= must not parse the body"
        );
    }

    #[test]
    fn conditions_with_semicolons_round_trip() {
        let f = Fault::parse(r"status=401;credential=a\;b\\c;model=m\;1;header=x-a:1\;2").unwrap();
        assert_eq!(f.credential.as_deref(), Some(r"a;b\c"));
        assert_eq!(f.model.as_deref(), Some("m;1"));
        assert_eq!(Fault::parse(&f.to_string()).unwrap(), f);
    }
}
