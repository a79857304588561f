//! Counters the mock keeps about what it was asked, served by `GET /__stats`.
//!
//! Tests assert on these ("which upstream got how many calls, with which credential and
//! which exact body"), so every counter is updated at one well-defined point of a
//! request's life and control routes never touch them. The hot path only does relaxed
//! atomic adds plus two short mutex sections (credential count, last request); the
//! expensive parts (hashing the last body, rendering headers) happen lazily when stats
//! are read, so a benchmark pays nothing for them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use bytes::Bytes;
use http::HeaderMap;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use super::route::Route;

/// All counters of one mock process.
#[derive(Default)]
pub struct Stats {
    total: AtomicU64,
    routes: [AtomicU64; Route::COUNT],
    inflight: AtomicU64,
    max_inflight: AtomicU64,
    chunks_sent: AtomicU64,
    streams_completed: AtomicU64,
    streams_aborted: AtomicU64,
    requests_abandoned: AtomicU64,
    /// API requests that arrived over HTTP/2.
    http2: AtomicU64,
    by_credential: Mutex<HashMap<String, u64>>,
    last: Mutex<LastRequest>,
}

#[derive(Default)]
struct LastRequest {
    body: Bytes,
    headers: HeaderMap,
}

impl Stats {
    /// Counts one request on an API route, as soon as its header was read.
    pub fn count_request(&self, route: Route, credential: Option<&str>, http2: bool) {
        self.total.fetch_add(1, Ordering::Relaxed);
        if http2 {
            self.http2.fetch_add(1, Ordering::Relaxed);
        }
        self.routes[route.index()].fetch_add(1, Ordering::Relaxed);
        if let Some(cred) = credential {
            let mut map = self.by_credential.lock().unwrap_or_else(|e| e.into_inner());
            match map.get_mut(cred) {
                Some(n) => *n += 1,
                None => {
                    map.insert(cred.to_string(), 1);
                }
            }
        }
    }

    /// Remembers the exact body and headers of the latest API request.
    pub fn record_last(&self, body: Bytes, headers: HeaderMap) {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        // Swap so the previous values are dropped after the lock is released.
        let old = std::mem::replace(&mut *last, LastRequest { body, headers });
        drop(last);
        drop(old);
    }

    /// Marks a request as being answered until the returned guard drops.
    pub fn enter(&self) -> InflightGuard<'_> {
        let now = self.inflight.fetch_add(1, Ordering::Relaxed) + 1;
        self.max_inflight.fetch_max(now, Ordering::Relaxed);
        InflightGuard { stats: self }
    }

    pub fn chunk_sent(&self) {
        self.chunks_sent.fetch_add(1, Ordering::Relaxed);
    }

    pub fn stream_completed(&self) {
        self.streams_completed.fetch_add(1, Ordering::Relaxed);
    }

    pub fn stream_aborted(&self) {
        self.streams_aborted.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request whose client left while a delay fault (`latency`,
    /// `first_byte_delay`) held its answer back: nothing was written, the mock stopped
    /// waiting and dropped the connection. A stream that loses its client later counts
    /// in `streams_aborted` instead.
    pub fn request_abandoned(&self) {
        self.requests_abandoned.fetch_add(1, Ordering::Relaxed);
    }

    /// Zeroes every counter; `max_inflight` restarts from what is in flight right now.
    pub fn reset(&self) {
        for c in [
            &self.total,
            &self.chunks_sent,
            &self.streams_completed,
            &self.streams_aborted,
            &self.requests_abandoned,
            &self.http2,
        ] {
            c.store(0, Ordering::Relaxed);
        }
        for c in &self.routes {
            c.store(0, Ordering::Relaxed);
        }
        self.max_inflight
            .store(self.inflight.load(Ordering::Relaxed), Ordering::Relaxed);
        self.by_credential
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.record_last(Bytes::new(), HeaderMap::new());
    }

    /// The `/__stats` document.
    pub fn to_json(&self, name: &str, fault: Option<String>) -> Value {
        let routes: Map<String, Value> = Route::ALL
            .iter()
            .map(|r| {
                (
                    r.path().to_string(),
                    json!(self.routes[r.index()].load(Ordering::Relaxed)),
                )
            })
            .collect();
        let by_credential: Map<String, Value> = self
            .by_credential
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        let (body, headers) = {
            let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
            (last.body.clone(), last.headers.clone())
        };
        let mut header_map = Map::new();
        for name in headers.keys() {
            let joined = headers
                .get_all(name)
                .iter()
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .collect::<Vec<_>>()
                .join(", ");
            header_map.insert(name.as_str().to_string(), Value::String(joined));
        }
        json!({
            "name": name,
            "total": self.total.load(Ordering::Relaxed),
            "http2": self.http2.load(Ordering::Relaxed),
            "routes": routes,
            "by_credential": by_credential,
            "inflight": self.inflight.load(Ordering::Relaxed),
            "max_inflight": self.max_inflight.load(Ordering::Relaxed),
            "last_body_sha256": hex::encode(Sha256::digest(&body)),
            "last_body_len": body.len(),
            "last_headers": header_map,
            "chunks_sent": self.chunks_sent.load(Ordering::Relaxed),
            "streams_completed": self.streams_completed.load(Ordering::Relaxed),
            "streams_aborted": self.streams_aborted.load(Ordering::Relaxed),
            "requests_abandoned": self.requests_abandoned.load(Ordering::Relaxed),
            "fault": fault,
        })
    }
}

/// Decrements `inflight` however the answer ends (normal, error, disconnect, panic).
pub struct InflightGuard<'a> {
    stats: &'a Stats,
}

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        self.stats.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inflight_guard_tracks_max_and_resets() {
        let s = Stats::default();
        {
            let _a = s.enter();
            let _b = s.enter();
            assert_eq!(s.to_json("m", None)["inflight"], 2);
        }
        let v = s.to_json("m", None);
        assert_eq!(v["inflight"], 0);
        assert_eq!(v["max_inflight"], 2);
        s.request_abandoned();
        assert_eq!(s.to_json("m", None)["requests_abandoned"], 1);
        s.reset();
        let v = s.to_json("m", None);
        assert_eq!(v["max_inflight"], 0);
        assert_eq!(v["requests_abandoned"], 0);
    }

    #[test]
    fn counts_routes_credentials_and_last_body() {
        let s = Stats::default();
        s.count_request(Route::Chat, Some("k1"), false);
        s.count_request(Route::Chat, Some("k1"), false);
        s.count_request(Route::Messages, None, true);
        let mut h = HeaderMap::new();
        h.insert("x-test", "1".parse().unwrap());
        s.record_last(Bytes::from_static(b"abc"), h);
        let v = s.to_json("m", Some("status=500".into()));
        assert_eq!(v["total"], 3);
        assert_eq!(v["http2"], 1);
        assert_eq!(v["routes"]["/v1/chat/completions"], 2);
        assert_eq!(v["routes"]["/v1/messages"], 1);
        assert_eq!(v["routes"]["/v1/models"], 0);
        assert_eq!(v["by_credential"]["k1"], 2);
        assert_eq!(
            v["last_body_sha256"],
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(v["last_body_len"], 3);
        assert_eq!(v["last_headers"]["x-test"], "1");
        assert_eq!(v["fault"], "status=500");
    }
}
