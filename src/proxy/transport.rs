//! The upstream transport of one provider (SPEC §6 `http2`, `tls`) and how its failures
//! are named (SPEC §2 finish: refused, reset, timeout, TLS and why).
//!
//! Invariants: a peer is configured from its provider alone, the same way for every
//! attempt, so pooled connections are reused only by peers that would have made them
//! (an [`Upstream`]'s key covers the provider's pool key, the address and the worker;
//! Pingora's reuse hash, for HTTP/2, the TLS settings and the ALPN); HTTP/2 is multiplexed
//! up to [`H2_STREAMS`] requests per connection; a transport failure's cause is one of a
//! few stable words (metric labels, `diagnostics.attempts[].reason`), and its detail is
//! Pingora's error text, bounded and never holding request bytes.

use super::pool::Dest;
use crate::config::{Http2, Provider};
use pingora::upstreams::peer::HttpPeer;
use pingora::ErrorType;
use std::borrow::Cow;
use std::hash::BuildHasher;
use std::net::SocketAddr;
use std::time::Duration;

/// How often an HTTP/2 connection is pinged (a dead one is closed, not waited on).
pub const H2_PING: std::time::Duration = std::time::Duration::from_secs(30);

/// Concurrent requests on one HTTP/2 connection (Pingora's default is 1: no multiplexing).
pub const H2_STREAMS: usize = 100;

/// The pool group of a peer of `p` built on this thread; part of Pingora's reuse hash,
/// so it sorts every pool (Sluice's HTTP/1.1 one and Pingora's HTTP/2 one).
/// - Pingora's reuse hash leaves out the CA a connection was verified against: each
///   provider's connections are kept to itself, and to the TLS files they were made
///   under, so none is reused under another trust (another provider's, or before a
///   reload).
/// - Each client worker keeps its own: a pooled socket belongs to the driver of the
///   worker that opened it, and an HTTP/2 connection is driven by a task there, so a
///   shared one would carry every worker's upstream I/O across threads. A peer is
///   built, used and released by one request, on one worker.
pub fn group_key(p: &Provider) -> u64 {
    p.pool_key ^ crate::server::workers::pool_salt()
}

/// Whether peers of `p` may speak HTTP/2 (what [`multiplexed`] says of such a peer).
pub fn multiplexing(p: &Provider) -> bool {
    http_versions(p).0 == 2
}

/// The (highest, lowest) HTTP versions a peer of `p` speaks.
fn http_versions(p: &Provider) -> (u8, u8) {
    match (p.http2, p.base_url.tls) {
        (Http2::Off, _) | (Http2::Auto, false) => (1, 1),
        (Http2::Auto, true) => (2, 1),
        // Over TLS by ALPN, in clear with prior knowledge (h2c).
        (Http2::On, _) => (2, 2),
    }
}

/// Applies the provider's TLS and HTTP version settings to `peer`.
pub fn configure(peer: &mut HttpPeer, p: &Provider) {
    peer.group_key = group_key(p);
    let o = &mut peer.options;
    let (max, min) = http_versions(p);
    o.set_http_version(max, min);
    if o.alpn.get_max_http_version() == 2 {
        o.max_h2_streams = H2_STREAMS;
        // A multiplexed connection that died silently would fail every stream on it by
        // the first-byte timeout; pings find it first.
        o.h2_ping_interval = Some(H2_PING);
    }
    if p.base_url.tls {
        o.ca = p.tls.ca.clone();
        o.verify_cert = p.tls.verify;
        o.verify_hostname = p.tls.verify;
        peer.client_cert_key = p.tls.client.clone();
    }
}

/// Whether `peer` may speak HTTP/2 (its connections go through Pingora's HTTP/2-aware
/// connector rather than Sluice's HTTP/1.1 pool).
pub fn multiplexed(peer: &HttpPeer) -> bool {
    peer.options.alpn.get_max_http_version() == 2
}

/// One provider's upstream at one resolved address, as an attempt keeps it: the key of
/// its idle connections is computed once, and the Pingora peer (~670 bytes, a few
/// hundred instructions to make and drop) is built only when a connection is opened.
#[derive(Clone, Copy, Debug)]
pub struct Upstream {
    /// Index into `Config::providers`.
    pub provider: usize,
    pub addr: SocketAddr,
    key: u64,
}

impl Upstream {
    /// `p` (at index `provider`) at `addr`, for the calling client worker. The key
    /// mixes the provider's pool key — its id, TLS files and settings, host and HTTP
    /// versions: everything else its peers are made of — with the address and the
    /// worker's salt, so two upstreams share a list only when their peers would match.
    pub fn new(provider: usize, p: &Provider, addr: SocketAddr) -> Upstream {
        let key = foldhash::fast::FixedState::with_seed(0).hash_one((
            p.pool_key,
            addr,
            crate::server::workers::pool_salt(),
        ));
        Upstream {
            provider,
            addr,
            key,
        }
    }

    /// As the pool sees it; `p` is the provider it was made for.
    pub fn of<'a>(&'a self, p: &'a Provider) -> UpstreamOf<'a> {
        UpstreamOf { up: self, p }
    }
}

/// An [`Upstream`] with its provider: a [`Dest`] of the pool.
pub struct UpstreamOf<'a> {
    up: &'a Upstream,
    p: &'a Provider,
}

impl Dest for UpstreamOf<'_> {
    fn key(&self) -> u64 {
        self.up.key
    }

    fn multiplexed(&self) -> bool {
        multiplexing(self.p)
    }

    fn peer(&self) -> Cow<'_, HttpPeer> {
        Cow::Owned(peer(self.p, self.up.addr))
    }
}

/// How long an idle upstream connection is kept.
pub const POOL_IDLE: Duration = Duration::from_secs(90);

/// A peer of `p` at `addr`: its connect timeouts, idle timeout, TLS and HTTP versions.
pub fn peer(p: &Provider, addr: SocketAddr) -> HttpPeer {
    let mut peer = HttpPeer::new(addr, p.base_url.tls, p.base_url.host.clone());
    peer.options.connection_timeout = Some(p.connect_timeout);
    peer.options.total_connection_timeout = Some(p.connect_timeout * 2);
    peer.options.idle_timeout = Some(POOL_IDLE);
    configure(&mut peer, p);
    peer
}

/// What kind of transport failure ended an attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// The name did not resolve.
    Dns,
    /// Nothing listens there (connection refused).
    Refused,
    /// No connection within the connect timeout, or no answer within the first-byte budget.
    Timeout,
    /// The TLS handshake failed (untrusted or invalid certificate, protocol mismatch).
    Tls,
    /// The connection broke or was closed while the request or answer was in transit.
    Reset,
    /// Any other failure to connect (no route, no local port).
    Connect,
}

impl Cause {
    pub const ALL: [Cause; 6] = [
        Cause::Dns,
        Cause::Refused,
        Cause::Timeout,
        Cause::Tls,
        Cause::Reset,
        Cause::Connect,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Dns => "dns",
            Cause::Refused => "refused",
            Cause::Timeout => "timeout",
            Cause::Tls => "tls",
            Cause::Reset => "reset",
            Cause::Connect => "connect",
        }
    }
}

/// Longest failure detail kept.
const MAX_DETAIL: usize = 200;

/// The cause of a connect failure and Pingora's words for it.
pub fn connect_failure(e: &pingora::Error) -> (Cause, String) {
    let cause = match e.etype() {
        ErrorType::ConnectRefused => Cause::Refused,
        ErrorType::ConnectTimedout | ErrorType::TLSHandshakeTimedout => Cause::Timeout,
        ErrorType::TLSWantX509Lookup
        | ErrorType::TLSHandshakeFailure
        | ErrorType::InvalidCert
        | ErrorType::HandshakeError => Cause::Tls,
        ErrorType::ConnectionClosed | ErrorType::ReadError | ErrorType::WriteError => Cause::Reset,
        ErrorType::ReadTimedout | ErrorType::WriteTimedout => Cause::Timeout,
        _ => Cause::Connect,
    };
    (cause, detail(e))
}

/// The cause of a failure while the request was written or the answer read: a TLS
/// alert in the error's chain (a TLS 1.3 server refusing the client certificate says so
/// only after the handshake) is `tls`, a timed-out read or write `timeout`, the rest
/// `reset`; with Pingora's words for it.
pub fn exchange_failure(e: &pingora::Error) -> (Cause, String) {
    let what = detail(e);
    let lower = what.to_ascii_lowercase();
    let cause = if lower.contains("alert") || lower.contains("certificate") {
        Cause::Tls
    } else if matches!(
        e.etype(),
        ErrorType::ReadTimedout | ErrorType::WriteTimedout
    ) {
        Cause::Timeout
    } else {
        Cause::Reset
    };
    (cause, what)
}

/// `<error type>: <context>: <cause>: <its source>…`, one line, at most [`MAX_DETAIL`]
/// bytes. Pingora wraps a TLS failure's cause in a note of the local address, which says
/// nothing about why; it is left out, and what it wraps is kept.
pub fn detail(e: &pingora::Error) -> String {
    let mut parts: Vec<String> = vec![e.etype().as_str().to_owned()];
    if let Some(ctx) = &e.context {
        parts.push(ctx.as_str().to_owned());
    }
    let mut next: Option<&(dyn std::error::Error + 'static)> = e
        .cause
        .as_deref()
        .map(|c| c as &(dyn std::error::Error + 'static));
    while let Some(c) = next {
        let text = c.to_string();
        if !text.starts_with("local address") && !text.is_empty() {
            parts.push(text.trim().to_owned());
        }
        next = c.source();
    }
    parts.dedup();
    let out: String = parts
        .join(": ")
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    clip(out)
}

fn clip(mut out: String) -> String {
    if out.len() > MAX_DETAIL {
        let mut end = MAX_DETAIL;
        while !out.is_char_boundary(end) {
            end -= 1;
        }
        out.truncate(end);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use pingora::Error;

    #[test]
    fn connect_errors_are_named_by_cause() {
        let cases = [
            (ErrorType::ConnectRefused, Cause::Refused),
            (ErrorType::ConnectTimedout, Cause::Timeout),
            (ErrorType::TLSHandshakeFailure, Cause::Tls),
            (ErrorType::InvalidCert, Cause::Tls),
            (ErrorType::ConnectionClosed, Cause::Reset),
            (ErrorType::ConnectNoRoute, Cause::Connect),
        ];
        for (etype, cause) in cases {
            let name = etype.as_str();
            let e = Error::explain(etype, "context here");
            assert_eq!(connect_failure(&e).0, cause, "{name}");
        }
    }

    #[test]
    fn the_detail_says_why_in_one_bounded_line() {
        let e = Error::because(
            ErrorType::TLSHandshakeFailure,
            "handshake",
            std::io::Error::other("invalid peer certificate: UnknownIssuer\nsecond line"),
        );
        let d = detail(&e);
        assert_eq!(
            d,
            "TLSHandshakeFailure: handshake: invalid peer certificate: UnknownIssuer second line"
        );
        let long = Error::explain(ErrorType::ConnectError, "x".repeat(500));
        assert!(detail(&long).len() <= MAX_DETAIL);
        assert_eq!(
            detail(&Error::new(ErrorType::ConnectRefused)),
            "ConnectRefused"
        );
    }
}
