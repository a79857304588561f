//! Per-request types shared by the request path's phases: what a request carries from
//! admission into dispatch (`Request`), what the finish phase logs (`RequestCtx`), and
//! the record of each failed attempt (`AttemptRecord`, SPEC §4 `diagnostics.attempts`).
//!
//! Plain data with no behaviour beyond formatting, so every phase module can depend on
//! it without depending on each other.

use super::body::ParsedBody;
use super::routes::Route;
use crate::config::{Client, Family};
use crate::engine::{Engine, Pick, Snapshot};
use crate::http1::RequestHead;
use crate::policy::lease::Lease;
use crate::policy::Millis;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Everything one request's dispatch needs, pinned at admission. It owns the client's
/// body, which only attempts read: a committed response drops its bytes
/// ([`ParsedBody::release`]), so a long stream does not keep an agent's context.
pub struct Request<'a> {
    pub engine: &'a Engine,
    pub snap: &'a Snapshot,
    pub model: usize,
    pub route: Route,
    pub family: Family,
    pub client: Option<&'a Client>,
    pub body: ParsedBody,
    pub header: &'a RequestHead,
    /// The exclusive lease the request presented (already checked by the fence).
    pub lease: Option<Lease>,
    /// Session affinity pin key, when the request carries a session header.
    pub pin_key: Option<String>,
}

/// Per-request state, created once the request header is read and finished by
/// `finish::record`. It borrows the request's snapshot (held by the connection's loop
/// for the request's life: one reference count taken per request, not one per phase).
pub struct RequestCtx<'s> {
    pub started: Instant,
    /// One wall-clock reading and the monotonic instant it was taken at (set when the
    /// attempts begin): later wall-clock times of the request are read off it.
    pub wall: Option<(Millis, Instant)>,
    pub route: Option<Route>,
    /// The configuration the request is served under, once it has one.
    pub snap: Option<&'s Snapshot>,
    /// The configured model the client asked for (an index into `snap`).
    pub model: Option<usize>,
    /// The client's own model id, when a pattern model passes it upstream.
    pub asked: Option<String>,
    pub client_id: Option<String>,
    pub status: u16,
    pub attempts: u32,
    /// The last attempt's pick, and the model (index) it served.
    pub pick: Option<(usize, Pick)>,
    pub ttfb: Option<Duration>,
    pub records: Vec<AttemptRecord>,
    /// Error code or abort reason worth logging.
    pub note: Option<&'static str>,
    /// Counts the request as in flight for the drain until the context is dropped.
    pub active: Option<crate::server::lifecycle::Active>,
}

impl RequestCtx<'_> {
    pub fn new(started: Instant) -> Self {
        RequestCtx {
            started,
            wall: None,
            route: None,
            snap: None,
            model: None,
            asked: None,
            client_id: None,
            status: 0,
            attempts: 0,
            pick: None,
            ttfb: None,
            records: Vec::new(),
            note: None,
            active: None,
        }
    }

    /// Unix milliseconds at the monotonic instant `at`, read off the request's wall
    /// reading (no clock read); `None` before the request has one.
    pub fn wall_at(&self, at: Instant) -> Option<Millis> {
        let (ms, then) = self.wall?;
        Some(ms + at.saturating_duration_since(then).as_millis() as Millis)
    }

    /// The configured model's name, or `unknown` (a bounded metric label).
    pub fn model_label(&self) -> &str {
        match (&self.snap, self.model) {
            (Some(s), Some(m)) => &s.config.models[m].name,
            _ => "unknown",
        }
    }

    /// (provider, connection, upstream model) of the last attempt.
    pub fn names(&self) -> Option<(&str, &str, &str)> {
        let ((model, pick), snap) = (self.pick?, self.snap?);
        let p = &snap.config.providers[pick.provider];
        let asked = self.asked.as_deref().unwrap_or(self.model_label());
        Some((
            &p.id,
            &p.connections[pick.connection].id,
            snap.upstream_model(model, pick.target, asked),
        ))
    }

    /// Each `x-sluice-*` header of the response (SPEC §2), in order.
    pub fn sluice_fields(&self, mut field: impl FnMut(&'static str, &[u8])) {
        if let Some((p, c, m)) = self.names() {
            field("x-sluice-provider", p.as_bytes());
            field("x-sluice-connection", c.as_bytes());
            field("x-sluice-model", m.as_bytes());
        }
        let mut buf = [0u8; 20];
        field(
            "x-sluice-attempts",
            crate::http1::wire::digits(u64::from(self.attempts), &mut buf),
        );
    }

    /// The `x-sluice-*` headers as owned pairs (for the error responses).
    pub fn sluice_headers(&self) -> Vec<(&'static str, String)> {
        let mut h = Vec::with_capacity(4);
        self.sluice_fields(|k, v| h.push((k, String::from_utf8_lossy(v).into_owned())));
        h
    }

    /// `diagnostics.attempts[]`.
    pub fn attempts_json(&self) -> Vec<Value> {
        self.records.iter().map(AttemptRecord::json).collect()
    }
}

/// One failed attempt, for diagnostics and logs.
#[derive(Debug, Clone)]
pub struct AttemptRecord {
    pub provider: String,
    pub connection: String,
    pub model: String,
    pub status: Option<u16>,
    pub reason: &'static str,
    /// What happened, in words, for a transport failure (e.g. why the TLS handshake failed).
    pub detail: Option<String>,
}

impl AttemptRecord {
    pub fn json(&self) -> Value {
        json!({
            "provider": self.provider,
            "connection": self.connection,
            "model": self.model,
            "status": self.status,
            "reason": self.reason,
            "detail": self.detail,
        })
    }

    /// `provider/connection:status-or-reason`, for the access log.
    pub fn summary(&self) -> String {
        match self.status {
            Some(s) => format!("{}/{}:{s}", self.provider, self.connection),
            None => format!("{}/{}:{}", self.provider, self.connection, self.reason),
        }
    }
}
