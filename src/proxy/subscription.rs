//! The Claude subscription lane in the attempt loop (SPEC §5.13): what happens between
//! an attempt's answer on a `subscription:` connection and its settling.
//!
//! A usage wall (or a lane answer asking to wait) is not settled: the same pick goes
//! again — at full speed after a claimed limit reset, with the slow header on the lane,
//! after the wait the upstream asked for. Everything else, and every answer the policy
//! hands back to the normal path, is settled as usual by the driver. The decisions are
//! `policy::subscription`'s; this module runs them: the usage check and the claim (two
//! HTTP calls to `oauth_base` with the connection's token), the waits, the events.
//!
//! Invariants: a request resends at most [`MAX_ROUNDS`] times; every wait races the
//! client and stays within the request's budget minus 5 s; a committed answer is only
//! read (it reached the client), never resent; the OAuth calls are bounded by
//! [`OAUTH_CALL_LIMIT`] and the request's deadline, and their token never leaves the
//! request header.

use super::attempt::{AttemptEnd, Call};
use super::transport::{multiplexing, Upstream, POOL_IDLE};
use super::watch::{ClientWatch, Wait};
use crate::clock::monotonic;
use crate::config::{BaseUrl, Connection, Provider, Subscription};
use crate::policy::subscription::{
    claim_body, merged_beta, parse_claim, parse_usage, OnLane, OnWall, Signal, SlowStatus, Waits,
};
use crate::server::conn::ClientConn;
use bytes::{Bytes, BytesMut};
use pingora::prelude::HttpPeer;
use std::pin::pin;
use std::time::Duration;

/// Resends of one request on its pick (walls, claims, lane waits) before its answer goes
/// the normal way whatever it is.
pub(super) const MAX_ROUNDS: u32 = 32;
/// One usage check or claim.
const OAUTH_CALL_LIMIT: Duration = Duration::from_secs(10);
/// The usage check's and the claim's answers are read up to this size.
const OAUTH_BODY_LIMIT: usize = 64 * 1024;

/// One request's rounds on its subscription pick.
#[derive(Default)]
pub(super) struct Rounds {
    waits: Waits,
    reset_tried: bool,
    n: u32,
}

/// What the driver does with an attempt's end.
pub(super) enum Then {
    /// Settle it the normal way.
    Settle,
    /// Send the request again on the same pick, after this wait.
    Again(Duration),
    /// The client left.
    Gone,
}

/// The lane's reading of an attempt's end. `slow`: the attempt carried the slow header.
pub(super) async fn after(
    client: &mut ClientConn,
    watch: &mut ClientWatch,
    call: &Call<'_, '_>,
    end: &AttemptEnd,
    rounds: &mut Rounds,
) -> Then {
    let p = &call.req.snap.config.providers[call.pick.provider];
    let conn = &p.connections[call.pick.connection];
    let Some(sub) = &conn.subscription else {
        return Then::Settle;
    };
    let (sig, committed) = match end {
        AttemptEnd::Refused(e) => (Signal::read(e.status, &e.headers), false),
        AttemptEnd::Committed(c) => (Signal::read(c.head.status(), &*c.head), true),
        _ => return Then::Settle,
    };
    let engine = call.req.engine;
    let snap = call.req.snap;
    // The cap on resends: past it, the policy still reads the answer (an ending status
    // is remembered), but nothing is sent again.
    let capped = rounds.n >= MAX_ROUNDS;
    if call.slow {
        // A committed answer reached the client: only what it says of the lane counts.
        if committed && sig.slow_status == Some(SlowStatus::SlotBusy) {
            return Then::Settle;
        }
        let left = call.deadline.saturating_duration_since(monotonic());
        let jitter = rand::random::<f64>() * 2.0 - 1.0;
        let now = engine.now();
        let step = engine.with_subscription(snap, call.pick, |s| {
            s.on_lane_answer(&sig, &rounds.waits, left, jitter, now)
        });
        return match step {
            OnLane::Keep => Then::Settle,
            OnLane::Wait(_) if committed || capped => Then::Settle,
            OnLane::Wait(d) => {
                engine.subscription_event("lane_wait");
                rounds.waits.total += d;
                rounds.n += 1;
                tracing::info!(provider = %p.id, connection = %conn.id, wait_ms = d.as_millis() as u64,
                    "subscription lane busy: waiting to resend");
                Then::Again(d)
            }
            OnLane::Ended(why) => {
                engine.subscription_event(why.event());
                tracing::warn!(provider = %p.id, connection = %conn.id, why = ?why,
                    "subscription lane ended: the answer goes the normal way");
                Then::Settle
            }
        };
    }
    if committed || !sig.wall || capped {
        return Then::Settle;
    }
    engine.subscription_event("wall");
    rounds.n += 1;
    let walled_at = engine.now();
    loop {
        let now = engine.now();
        let plan = engine.with_subscription(snap, call.pick, |s| {
            if s.reset_claimed_at >= walled_at {
                // A reset was claimed since this wall (here or by another request).
                return Some(Plan::FullSpeed);
            }
            if sub.low_priority && s.lane_active(now) {
                // Another request entered the lane meanwhile: go on it.
                return Some(Plan::Slow);
            }
            match s.on_wall(sub.settings(), &sig, rounds.reset_tried, now) {
                OnWall::Normal => None,
                OnWall::TryReset => Some(Plan::TryReset),
                OnWall::EnterLane => {
                    // Decided and entered under one lock: two walls enter it once.
                    s.enter_lane(&sig, now);
                    Some(Plan::Entered)
                }
            }
        });
        match plan {
            None => return Then::Settle,
            Some(Plan::FullSpeed | Plan::Slow) => return Then::Again(Duration::ZERO),
            Some(Plan::Entered) => {
                engine.subscription_event("lane_entered");
                tracing::warn!(provider = %p.id, connection = %conn.id,
                    "subscription usage wall: the connection goes on the low-priority lane");
                return Then::Again(Duration::ZERO);
            }
            Some(Plan::TryReset) => {
                rounds.reset_tried = true;
                // Boxed: the probe is a whole upstream exchange of its own, rare, and
                // inline it would enlarge every request's future by ~11 KB.
                match Box::pin(limit_reset(client, watch, call, p, conn, sub)).await {
                    Reset::FullSpeed => return Then::Again(Duration::ZERO),
                    Reset::Gone => return Then::Gone,
                    Reset::No => {}
                }
            }
        }
    }
}

/// What a wall leads to.
enum Plan {
    FullSpeed,
    Slow,
    Entered,
    TryReset,
}

/// How a limit reset ended.
enum Reset {
    FullSpeed,
    No,
    /// The client left while it ran.
    Gone,
}

/// The usage check and, when it offers one, the claim.
async fn limit_reset(
    client: &mut ClientConn,
    watch: &mut ClientWatch,
    call: &Call<'_, '_>,
    p: &Provider,
    conn: &Connection,
    sub: &Subscription,
) -> Reset {
    let engine = call.req.engine;
    let snap = call.req.snap;
    let oauth = OAuth {
        call,
        p,
        conn,
        base: sub.oauth_base.as_ref().unwrap_or(&p.base_url),
    };
    let usage_path = format!(
        "{}/api/oauth/usage?at_wall=1&skip_spend=1",
        oauth.base.path_prefix
    );
    let usage = match oauth
        .ask(client, watch, "GET", &usage_path, None, parse_usage)
        .await
    {
        Ok(u) => u,
        Err(stop) => return oauth.stopped(stop, "usage check"),
    };
    let now = engine.now();
    if !engine.with_subscription(snap, call.pick, |s| s.on_usage(usage, now)) {
        engine.subscription_event("limit_reset_unavailable");
        tracing::info!(provider = %p.id, connection = %conn.id, "subscription limit reset not available");
        return Reset::No;
    }
    // `sluice check` requires the organization with limit_reset.
    let Some(org) = &sub.organization_uuid else {
        return oauth.stopped(Stop::Failed("no organization_uuid".into()), "claim");
    };
    let claim_path = format!(
        "{}/api/organizations/{org}/reset_rate_limits",
        oauth.base.path_prefix
    );
    let body = Some(Bytes::from(claim_body()));
    let claim = match oauth
        .ask(client, watch, "POST", &claim_path, body, parse_claim)
        .await
    {
        Ok(c) => c,
        Err(stop) => return oauth.stopped(stop, "claim"),
    };
    let now = engine.now();
    if engine.with_subscription(snap, call.pick, |s| s.on_claim(claim, now)) {
        engine.subscription_event("limit_reset_claimed");
        tracing::warn!(provider = %p.id, connection = %conn.id, "subscription limit reset claimed: full speed again");
        Reset::FullSpeed
    } else {
        engine.subscription_event("limit_reset_unavailable");
        tracing::info!(provider = %p.id, connection = %conn.id, "subscription limit reset already used or not offered");
        Reset::No
    }
}

/// Why an OAuth call gave no usable answer.
enum Stop {
    /// The upstream's failure (transport, timeout, status, body): the reset is not
    /// tried for 15 min.
    Failed(String),
    /// The client left: nothing is learnt about the upstream.
    ClientGone,
    /// The request's deadline came first: nothing is learnt either.
    OutOfTime,
}

/// The fixed parts of the OAuth calls of one wall: the request, its connection (whose
/// token they carry) and where they go.
struct OAuth<'c, 'r, 'a> {
    call: &'c Call<'r, 'a>,
    p: &'c Provider,
    conn: &'c Connection,
    base: &'c BaseUrl,
}

impl OAuth<'_, '_, '_> {
    /// What a call that gave no usable answer means for the reset.
    fn stopped(&self, stop: Stop, step: &str) -> Reset {
        let detail = match stop {
            Stop::ClientGone => return Reset::Gone,
            Stop::OutOfTime => return Reset::No,
            Stop::Failed(detail) => detail,
        };
        let engine = self.call.req.engine;
        let now = engine.now();
        engine.with_subscription(self.call.req.snap, self.call.pick, |s| {
            s.on_reset_failure(now)
        });
        engine.subscription_event("limit_reset_failed");
        tracing::warn!(provider = %self.p.id, connection = %self.conn.id, step, detail = %detail,
            "subscription limit reset failed: not tried again for 15 minutes");
        Reset::No
    }

    /// One call whose 2xx body `parse` reads.
    async fn ask<T>(
        &self,
        client: &mut ClientConn,
        watch: &mut ClientWatch,
        method: &str,
        path: &str,
        body: Option<Bytes>,
        parse: fn(&[u8]) -> Option<T>,
    ) -> Result<T, Stop> {
        let (status, answer) = self.send(client, watch, method, path, body).await?;
        if !(200..300).contains(&status) {
            return Err(Stop::Failed(format!("status {status}")));
        }
        parse(&answer).ok_or_else(|| Stop::Failed("unexpected answer".into()))
    }

    /// One HTTP/1.1 call with the connection's token: (status, body).
    async fn send(
        &self,
        client: &mut ClientConn,
        watch: &mut ClientWatch,
        method: &str,
        path: &str,
        body: Option<Bytes>,
    ) -> Result<(u16, Bytes), Stop> {
        let (engine, base, p, conn) = (self.call.req.engine, self.base, self.p, self.conn);
        let left = self.call.deadline.saturating_duration_since(monotonic());
        let limit = OAUTH_CALL_LIMIT.min(left);
        let exchange = async {
            let addr = engine
                .resolver
                .resolve(&base.host, base.port, monotonic())
                .await
                .map_err(|_| "dns lookup failed".to_string())?;
            // The provider's own upstream when the OAuth base is its base and it speaks
            // HTTP/1.1 only: the connection then joins the main lane's idle list.
            // Elsewhere nothing would take it (these calls open their own), so it is
            // closed after the call.
            let shared = (base == &p.base_url && !multiplexing(p))
                .then(|| Upstream::new(self.call.pick.provider, p, addr));
            let peer = match shared {
                Some(_) => super::transport::peer(p, addr),
                None => oauth_peer(addr, base, p),
            };
            let (path, query) = match path.split_once('?') {
                Some((p, q)) => (p, Some(q)),
                None => (path, None),
            };
            let authority = base.authority();
            let out = super::upstream::OutHead {
                method,
                prefix: "",
                path,
                query,
                authority,
                body_len: body.as_ref().map_or(0, Bytes::len),
            };
            let bearer = conn.key.as_ref().map(|k| format!("Bearer {}", k.expose()));
            let beta = merged_beta(None);
            let mut extra: Vec<(&[u8], &[u8])> = Vec::with_capacity(4);
            if let Some(b) = &bearer {
                extra.push((b"Authorization", b.as_bytes()));
            }
            extra.push((b"anthropic-beta", beta.as_bytes()));
            extra.push((b"accept", b"application/json"));
            if body.is_some() {
                extra.push((b"content-type", b"application/json"));
            }
            let mut head = Vec::with_capacity(512);
            super::upstream::write_request_head(&mut head, &out, std::iter::empty(), &[], &extra);
            // A new connection: a pooled one the upstream closed would fail the call, and
            // the call is rare (one per wall).
            let mut up = engine
                .upstreams
                .fresh(std::borrow::Cow::Borrowed(&peer))
                .await
                .map_err(|e| e.to_string())?;
            let body = body.unwrap_or_default();
            up.send(head, &super::body::Outgoing::whole(&body))
                .await
                .map_err(|e| e.to_string())?;
            let status = up
                .read_head(OAUTH_BODY_LIMIT)
                .await
                .map_err(|e| e.to_string())?
                .status();
            let mut buf = BytesMut::new();
            let complete = super::attempt::read_bounded(&mut up, &mut buf, OAUTH_BODY_LIMIT)
                .await
                .map_err(|e| e.to_string())?;
            if let Some(u) = shared.filter(|_| complete) {
                engine.upstreams.release(up, &u.of(p), POOL_IDLE).await;
            }
            Ok((status, buf.freeze()))
        };
        let exchange = pin!(exchange);
        match watch.race(client, limit, exchange).await {
            Wait::Ready(r) => r.map_err(Stop::Failed),
            // Out of the request's own budget: nothing learnt about the upstream.
            Wait::TimedOut if left < OAUTH_CALL_LIMIT => Err(Stop::OutOfTime),
            Wait::TimedOut => Err(Stop::Failed("timed out".into())),
            Wait::ClientGone => Err(Stop::ClientGone),
        }
    }
}

/// The peer of an OAuth base that is not the provider's own: the base with the
/// provider's TLS trust, on HTTP/1.1.
fn oauth_peer(addr: std::net::SocketAddr, base: &BaseUrl, p: &Provider) -> HttpPeer {
    let mut peer = HttpPeer::new(addr, base.tls, base.host.clone());
    peer.options.connection_timeout = Some(p.connect_timeout);
    peer.options.total_connection_timeout = Some(p.connect_timeout * 2);
    peer.options.idle_timeout = Some(POOL_IDLE);
    peer.group_key = super::transport::group_key(p);
    peer.options.set_http_version(1, 1);
    if base.tls {
        peer.options.ca = p.tls.ca.clone();
        peer.options.verify_cert = p.tls.verify;
        peer.options.verify_hostname = p.tls.verify;
        peer.client_cert_key = p.tls.client.clone();
    }
    peer
}
