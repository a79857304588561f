//! The attempt loop (ARCHITECTURE §3): Sluice, not Pingora, owns upstream attempts.
//!
//! The body was read once at admission; every attempt replays it (with `model`
//! rewritten) through Pingora's client `Connector`, so failover works for bodies of any
//! size. Phases keep Pingora's hook names: select (`upstream_peer`), connect
//! (`fail_to_connect`), response header (`upstream_response_filter`), stream
//! (`response_body_filter`). Invariants:
//! - nothing reaches the client before the commit point (first response byte); until
//!   then every failure may fail over, after it none may;
//! - an upstream 2xx is committed only once its first body chunk arrived, so a silent
//!   upstream (time-to-first-token timeout) is still a failover, not a broken stream;
//! - every wait is bounded (TTFT, stall, execution deadline) and races the client: a
//!   client that goes away ends the upstream attempt at once;
//! - an upstream connection goes back to the pool only after its response was read whole.

use super::body::ParsedBody;
use super::respond;
use super::sse::SseProgress;
use super::upstream;
use super::waits::{self, QueueOutcome};
use super::RequestCtx;
use crate::config::{Client, Family};
use crate::engine::judge::Verdict;
use crate::engine::record::{AttemptInfo, Outcome};
use crate::engine::select::{Asker, Exclusion};
use crate::engine::{state, Engine, Pick, Selection, Snapshot, Tried};
use crate::error::ClientError;
use crate::policy::breaker::Permit;
use crate::policy::classify::TransportKind;
use crate::policy::combo::Decision;
use crate::policy::lease::Lease;
use crate::policy::Scope;
use bytes::{Bytes, BytesMut};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::HttpPeer;
use pingora::proxy::Session;
use serde_json::json;
use std::future::Future;
use std::time::{Duration, Instant};

/// Upstream error bodies are read up to this size (SPEC §2, phase 4).
const ERROR_BODY_LIMIT: usize = 64 * 1024;
const POOL_IDLE: Duration = Duration::from_secs(90);
const WRITE_TIMEOUT: Duration = Duration::from_secs(60);

/// Everything one request's dispatch needs, pinned at admission.
#[derive(Clone)]
pub struct Request<'a> {
    pub engine: &'a Engine,
    pub snap: &'a Snapshot,
    pub model: usize,
    pub family: Family,
    pub client: Option<&'a Client>,
    pub body: &'a ParsedBody,
    pub header: &'a RequestHeader,
    /// Set when the first attempt is dispatched (`queue.execution_timeout` from then).
    pub deadline: Instant,
    /// The exclusive lease the request presented (already checked by the fence).
    pub lease: Option<Lease>,
    /// Session affinity pin key, when the request carries a session header.
    pub pin_key: Option<String>,
    /// This run is already the `emergency_fallback` model's (no second hop).
    pub is_fallback: bool,
}

/// One failed attempt, for diagnostics and logs.
#[derive(Debug, Clone)]
pub struct AttemptRecord {
    pub provider: String,
    pub connection: String,
    pub model: String,
    pub status: Option<u16>,
    pub reason: &'static str,
}

impl AttemptRecord {
    fn json(&self) -> serde_json::Value {
        json!({
            "provider": self.provider,
            "connection": self.connection,
            "model": self.model,
            "status": self.status,
            "reason": self.reason,
        })
    }
}

/// An upstream error response held back (≤ 64 KiB) while failover is still possible.
struct HeldError {
    header: ResponseHeader,
    body: Bytes,
    pick: Pick,
}

enum Attempt {
    /// The response was committed and has ended (well or not); nothing more to do.
    Done,
    /// Upstream answered ≥ 400 before anything was committed.
    Http(Box<HeldError>),
    /// Connect / write / read failure or TTFT timeout before commit.
    Transport(TransportKind, &'static str),
    ClientGone,
    Deadline,
}

pub(super) enum Wait<T> {
    Ready(T),
    TimedOut,
    ClientGone,
}

/// Runs `fut` for at most `limit`, watching the client connection meanwhile.
pub(super) async fn race<F: Future>(
    session: &mut Session,
    watching: &mut bool,
    limit: Duration,
    fut: F,
) -> Wait<F::Output> {
    tokio::pin!(fut);
    let sleep = tokio::time::sleep(limit);
    tokio::pin!(sleep);
    loop {
        tokio::select! {
            biased;
            out = &mut fut => return Wait::Ready(out),
            _ = &mut sleep => return Wait::TimedOut,
            r = session.downstream_session.read_body_or_idle(true), if *watching => match r {
                Err(_) => return Wait::ClientGone,
                // Unexpected bytes (e.g. a pipelined request): stop probing, keep going.
                Ok(_) => *watching = false,
            },
        }
    }
}

/// Runs attempts until one commits, a non-retryable answer arrives, or none are left;
/// always leaves a complete response on `session`.
pub async fn run(
    session: &mut Session,
    r: &Request<'_>,
    ctx: &mut RequestCtx,
) -> pingora::Result<()> {
    let cfg = &r.snap.config;
    let max = cfg.server.max_attempts;
    let mut tried = Tried::default();
    let mut held: Option<(HeldError, Verdict)> = None;
    let mut excluded: Vec<Exclusion> = Vec::new();
    let mut rate_limited_until = None;
    let mut lease = r.lease.clone();
    let mut relocated = false;
    let mut watching = true;
    let (mut waits, mut waited) = (0u32, Duration::ZERO);
    let mut deadline: Option<Instant> = None;
    let mut attempt_no = 0usize;
    while attempt_no < max {
        let pin = r.pin_key.as_deref().and_then(|k| r.engine.pinned(k));
        let asker = Asker {
            client: r.client,
            lease: lease
                .as_ref()
                .map(|l| (l.owner_hash.as_str(), l.connection.as_str())),
            tried: &tried,
        };
        let (pick, probe, permit) = match r.engine.select(
            r.snap,
            r.model,
            r.family,
            &asker,
            pin.as_deref(),
        ) {
            Selection::Picked {
                pick,
                probe,
                permit,
            } => (pick, probe, permit),
            Selection::Full { full, .. } => {
                match waits::wait_for_permit(session, r, &full, &mut watching).await {
                    QueueOutcome::Got(c, permit) | QueueOutcome::FailOpen(c, permit) => {
                        match r.engine.breaker_permit(r.snap, c.provider, r.engine.now()) {
                            Permit::Allow => (c.into(), false, permit),
                            Permit::Probe => (c.into(), true, permit),
                            Permit::Deny { .. } => {
                                tried.providers.push(c.provider);
                                continue;
                            }
                        }
                    }
                    QueueOutcome::Full => {
                        return waits::queue_rejected(session, r, ctx, true).await
                    }
                    QueueOutcome::TimedOut => {
                        return waits::queue_rejected(session, r, ctx, false).await
                    }
                    QueueOutcome::ClientGone => return client_gone(ctx),
                }
            }
            Selection::Empty(ex) => {
                // A lease whose connection became ineligible moves (same generation).
                if let (Some(l), Some(client), false) = (&lease, r.client, relocated) {
                    relocated = true;
                    if let Some(moved) = r.engine.lease_relocate(r.snap, client, l).await {
                        if moved.connection != l.connection {
                            lease = Some(moved);
                            continue;
                        }
                    }
                }
                if held.is_none() && lease.is_none() {
                    if let Some(e) = waits::lease_contention(&ex, r.engine.now()) {
                        return finish_error(session, r.family, e, ctx).await;
                    }
                }
                match waits::combo_decision(r, &ex, waits, waited) {
                    Decision::Wait(d) => {
                        tracing::info!(model = %cfg.models[r.model].name, wait_ms = d.as_millis() as u64, "combo wait");
                        if !waits::combo_sleep(session, &mut watching, d).await {
                            return client_gone(ctx);
                        }
                        waits += 1;
                        waited += d;
                        // What held these back was a timer that has now run out.
                        tried.connections.clear();
                        tried.targets.clear();
                        continue;
                    }
                    Decision::Decline {
                        rate_limited_until: until,
                    } => {
                        excluded = ex;
                        rate_limited_until = until;
                        break;
                    }
                }
            }
        };
        attempt_no += 1;
        let deadline = *deadline
            .get_or_insert_with(|| Instant::now() + cfg.resilience.queue.execution_timeout);
        let ra = Request {
            deadline,
            lease: lease.clone(),
            ..r.clone()
        };
        ctx.attempts = attempt_no as u32;
        ctx.pick = Some(names(r, pick));
        let info = AttemptInfo {
            snap: r.snap,
            model: r.model,
            pick,
            started: r.engine.now(),
            probe,
        };
        let outcome = attempt(session, &ra, &info, ctx).await;
        drop(permit);
        let (pname, cname, mname) = names(r, pick);
        let metric = |outcome: &str| {
            r.engine
                .metrics
                .attempts_total
                .with_label_values(&[pname.as_str(), cname.as_str(), outcome])
                .inc();
        };
        let verdict = match outcome {
            Attempt::Done => {
                metric("ok");
                if let Some(key) = &r.pin_key {
                    r.engine.touch_pin(
                        key,
                        &state::conn_key(&pname, &cname),
                        &mname,
                        cfg.resilience.affinity_ttl,
                    );
                }
                return Ok(());
            }
            Attempt::ClientGone => {
                metric("final_error");
                r.engine.record(&info, Outcome::Abandoned);
                return client_gone(ctx);
            }
            Attempt::Deadline => {
                metric("final_error");
                r.engine.record(&info, Outcome::Abandoned);
                return deadline_error(session, r, ctx).await;
            }
            Attempt::Transport(kind, what) => {
                metric("transport");
                let v = r.engine.judge_transport(&info, kind, what);
                ctx.records.push(AttemptRecord {
                    provider: pname,
                    connection: cname,
                    model: mname,
                    status: None,
                    reason: v.class.reason.as_str(),
                });
                tried.providers.push(pick.provider);
                v
            }
            Attempt::Http(err) => {
                let v = r.engine.judge_http(
                    &info,
                    err.header.status.as_u16(),
                    &err.header.headers,
                    &err.body,
                );
                let again = v.class.retryable && attempt_no < max;
                metric(if again { "failover" } else { "final_error" });
                ctx.records.push(AttemptRecord {
                    provider: pname,
                    connection: cname,
                    model: mname,
                    status: Some(v.status),
                    reason: v.class.reason.as_str(),
                });
                commit_urgent(r, &v).await;
                if !v.class.retryable {
                    return pass_through(session, r, *err, &v, ctx).await;
                }
                match v.class.scope {
                    Scope::Provider => tried.providers.push(pick.provider),
                    Scope::Model => tried.targets.push(pick.target),
                    Scope::Connection | Scope::Request => {
                        tried.connections.push((pick.provider, pick.connection))
                    }
                }
                held = Some((*err, v));
                continue;
            }
        };
        commit_urgent(r, &verdict).await;
    }
    if let Some((err, v)) = held {
        return pass_through(session, r, err, &v, ctx).await;
    }
    if !ctx.records.is_empty() {
        let attempts: Vec<_> = ctx.records.iter().map(AttemptRecord::json).collect();
        let e = ClientError::new(
            502,
            "upstream_unavailable",
            "every upstream attempt failed on transport errors",
        )
        .with_extra("diagnostics", json!({ "attempts": attempts }));
        return finish_error(session, r.family, e, ctx).await;
    }
    if let Some(fb) = emergency_fallback(r) {
        tracing::warn!(model = %cfg.models[r.model].name, fallback = %cfg.models[fb].name, "no runnable target: trying the emergency fallback model");
        let rf = Request {
            model: fb,
            is_fallback: true,
            pin_key: None,
            ..r.clone()
        };
        return Box::pin(run(session, &rf, ctx)).await;
    }
    waits::nothing_runnable(session, r, &excluded, rate_limited_until, ctx).await
}

/// The `emergency_fallback` model, when it applies to this request (SPEC §5.12).
fn emergency_fallback(r: &Request<'_>) -> Option<usize> {
    if r.is_fallback || r.lease.is_some() {
        return None;
    }
    let cfg = &r.snap.config;
    cfg.emergency_fallback
        .as_deref()
        .and_then(|name| r.snap.model_index(name))
        .filter(|m| *m != r.model && r.snap.serves_family(*m, r.family))
}

fn client_gone(ctx: &mut RequestCtx) -> pingora::Result<()> {
    ctx.status = 499;
    ctx.note = Some("client_gone");
    Ok(())
}

/// Terminal states are durable before the response that reveals them (SPEC §7).
async fn commit_urgent(r: &Request<'_>, v: &Verdict) {
    if v.urgent.is_empty() {
        return;
    }
    if let Some(store) = &r.engine.store {
        if let Err(e) = store.commit_now(v.urgent.clone()).await {
            tracing::error!(error = %e, "could not persist a terminal state");
        }
    }
}

fn names(r: &Request<'_>, pick: Pick) -> (String, String, String) {
    let cfg = &r.snap.config;
    let p = &cfg.providers[pick.provider];
    (
        p.id.clone(),
        p.connections[pick.connection].id.clone(),
        cfg.models[r.model].targets[pick.target].model.clone(),
    )
}

fn sluice_headers(ctx: &RequestCtx) -> Vec<(&'static str, String)> {
    let mut h = Vec::with_capacity(4);
    if let Some((p, c, m)) = &ctx.pick {
        h.push(("x-sluice-provider", p.clone()));
        h.push(("x-sluice-connection", c.clone()));
        h.push(("x-sluice-model", m.clone()));
    }
    h.push(("x-sluice-attempts", ctx.attempts.to_string()));
    h
}

pub(super) async fn finish_error(
    session: &mut Session,
    family: Family,
    e: ClientError,
    ctx: &mut RequestCtx,
) -> pingora::Result<()> {
    ctx.status = e.status;
    ctx.note = Some(e.code);
    respond::write_error(session, family, &e, sluice_headers(ctx)).await
}

async fn deadline_error(
    session: &mut Session,
    r: &Request<'_>,
    ctx: &mut RequestCtx,
) -> pingora::Result<()> {
    let attempts: Vec<_> = ctx.records.iter().map(AttemptRecord::json).collect();
    let e = ClientError::new(
        504,
        "RATE_LIMIT_EXECUTION_TIMEOUT",
        "the execution deadline passed before the upstream answered",
    )
    .with_extra("diagnostics", json!({ "attempts": attempts }));
    finish_error(session, r.family, e, ctx).await
}

/// Passes a held upstream error to the client: its headers and body, the restated
/// status if a rule applied, and a normalised `Retry-After`.
async fn pass_through(
    session: &mut Session,
    r: &Request<'_>,
    err: HeldError,
    v: &Verdict,
    ctx: &mut RequestCtx,
) -> pingora::Result<()> {
    ctx.pick = Some(names(r, err.pick));
    ctx.status = v.status;
    let h2 = session.downstream_session.is_http2();
    let mut h = upstream::response_header(&err.header, h2, &sluice_headers(ctx))?;
    if v.status != err.header.status.as_u16() {
        h.set_status(v.status)?;
    }
    h.remove_header("transfer-encoding");
    h.remove_header("content-encoding");
    h.insert_header("content-length", err.body.len())?;
    if let Some(secs) = v.retry_after {
        h.insert_header("retry-after", secs.to_string())?;
    }
    session.write_response_header(Box::new(h), false).await?;
    session.write_response_body(Some(err.body), true).await?;
    Ok(())
}

fn build_peer(r: &Request<'_>, pick: Pick, addr: std::net::SocketAddr) -> HttpPeer {
    let p = &r.snap.config.providers[pick.provider];
    let mut peer = HttpPeer::new(addr, p.base_url.tls, p.base_url.host.clone());
    peer.options.connection_timeout = Some(p.connect_timeout);
    peer.options.total_connection_timeout = Some(p.connect_timeout * 2);
    peer.options.idle_timeout = Some(POOL_IDLE);
    peer.options.write_timeout = Some(WRITE_TIMEOUT);
    peer
}

/// Decrements the in-flight gauge when the attempt ends, however it ends.
struct Inflight(prometheus::IntGauge);
impl Drop for Inflight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

async fn attempt(
    session: &mut Session,
    r: &Request<'_>,
    info: &AttemptInfo<'_>,
    ctx: &mut RequestCtx,
) -> Attempt {
    let pick = info.pick;
    let cfg = &r.snap.config;
    let provider = &cfg.providers[pick.provider];
    let conn = &provider.connections[pick.connection];
    let target = &cfg.models[r.model].targets[pick.target];
    let guards = &cfg.resilience.stream;
    let gauge = r
        .engine
        .metrics
        .inflight
        .with_label_values(&[provider.id.as_str(), conn.id.as_str()]);
    gauge.inc();
    let _inflight = Inflight(gauge);
    let mut watching = true;
    let left = |now: Instant| r.deadline.saturating_duration_since(now);

    // select → connect
    let now = Instant::now();
    if left(now).is_zero() {
        return Attempt::Deadline;
    }
    let addr = match r
        .engine
        .resolver
        .resolve(&provider.base_url.host, provider.base_url.port, now)
        .await
    {
        Ok(a) => a,
        Err(_) => return Attempt::Transport(TransportKind::Connect, "dns lookup failed"),
    };
    let peer = build_peer(r, pick, addr);
    let mut up = match race(
        session,
        &mut watching,
        left(Instant::now()),
        r.engine.connector.get_http_session(&peer),
    )
    .await
    {
        Wait::Ready(Ok((s, _reused))) => s,
        Wait::Ready(Err(_)) => return Attempt::Transport(TransportKind::Connect, "connect failed"),
        Wait::TimedOut => return Attempt::Deadline,
        Wait::ClientGone => return Attempt::ClientGone,
    };

    // write the request
    let body = r.body.with_model(&target.model);
    let Ok(req) = upstream::request_header(r.header, provider, conn, body.len()) else {
        return Attempt::Transport(TransportKind::Reset, "cannot build the upstream request");
    };
    let send = async {
        up.write_request_header(Box::new(req)).await?;
        if !body.is_empty() {
            up.write_request_body(body, true).await?;
        }
        up.finish_request_body().await?;
        // Skip 1xx: reading a body right after a 100 header panics in pingora 0.9.1.
        loop {
            up.read_response_header().await?;
            if !up
                .response_header()
                .is_some_and(|h| h.status.is_informational())
            {
                return Ok::<(), Box<pingora::Error>>(());
            }
        }
    };
    let sent_at = Instant::now();
    let ttft_end = sent_at + guards.ttft_timeout;
    // Streams must show a first byte within the TTFT budget; other answers only
    // within the execution deadline (a non-streamed completion may take minutes).
    let first_byte_limit = |now: Instant| {
        if r.body.stream {
            left(now).min(ttft_end.saturating_duration_since(now))
        } else {
            left(now)
        }
    };
    match race(session, &mut watching, first_byte_limit(sent_at), send).await {
        Wait::Ready(Ok(())) => {}
        Wait::Ready(Err(_)) => {
            return Attempt::Transport(TransportKind::Reset, "upstream connection failed")
        }
        Wait::TimedOut => return timed_out(r),
        Wait::ClientGone => return Attempt::ClientGone,
    }
    let Some(up_header) = up.response_header().cloned() else {
        return Attempt::Transport(TransportKind::Reset, "upstream connection failed");
    };
    let status = up_header.status.as_u16();
    r.engine
        .note_rate_limit(&provider.id, &conn.id, &up_header.headers);

    // response header phase: errors are read (bounded) and held, never committed here
    if status >= 400 {
        let mut buf = BytesMut::new();
        let mut complete = false;
        let limit = left(Instant::now()).min(guards.stall_timeout);
        let read = async {
            while buf.len() < ERROR_BODY_LIMIT {
                match up.read_response_body().await {
                    Ok(Some(c)) => buf.extend_from_slice(&c),
                    Ok(None) => {
                        complete = true;
                        break;
                    }
                    Err(_) => break,
                }
            }
        };
        match race(session, &mut watching, limit, read).await {
            Wait::ClientGone => return Attempt::ClientGone,
            Wait::Ready(()) | Wait::TimedOut => {}
        }
        buf.truncate(ERROR_BODY_LIMIT);
        if complete {
            r.engine
                .connector
                .release_http_session(up, &peer, Some(POOL_IDLE))
                .await;
        }
        return Attempt::Http(Box::new(HeldError {
            header: up_header,
            body: buf.freeze(),
            pick,
        }));
    }

    // first chunk before commit, so a silent upstream is still a failover
    let first = if up.response_done() {
        None
    } else {
        match race(
            session,
            &mut watching,
            first_byte_limit(Instant::now()),
            up.read_response_body(),
        )
        .await
        {
            Wait::Ready(Ok(c)) => c,
            Wait::Ready(Err(_)) => {
                return Attempt::Transport(TransportKind::Reset, "upstream connection failed")
            }
            Wait::TimedOut => return timed_out(r),
            Wait::ClientGone => return Attempt::ClientGone,
        }
    };

    // commit point
    ctx.status = status;
    let h2 = session.downstream_session.is_http2();
    let Ok(resp) = upstream::response_header(&up_header, h2, &sluice_headers(ctx)) else {
        return Attempt::Transport(TransportKind::Reset, "invalid upstream response header");
    };
    let is_sse = up_header
        .headers
        .get("content-type")
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let end_now = first.is_none();
    if session
        .write_response_header(Box::new(resp), end_now)
        .await
        .is_err()
    {
        return Attempt::ClientGone;
    }
    ctx.ttfb = Some(ctx.started.elapsed());
    r.engine.record(info, Outcome::Success);
    r.engine
        .note_ttfb(&provider.id, &conn.id, sent_at.elapsed());
    let Some(first) = first else {
        r.engine
            .connector
            .release_http_session(up, &peer, Some(POOL_IDLE))
            .await;
        return Attempt::Done;
    };
    let end = stream_body(session, r, &mut up, first, is_sse, &mut watching).await;
    match end {
        StreamEnd::Complete => {
            r.engine
                .connector
                .release_http_session(up, &peer, Some(POOL_IDLE))
                .await;
        }
        StreamEnd::Aborted(reason) => {
            if reason == "stall" {
                r.engine.record(
                    info,
                    Outcome::Stall {
                        message: "stream stalled after commit",
                    },
                );
            }
            r.engine
                .metrics
                .stream_aborts_total
                .with_label_values(&[reason])
                .inc();
            ctx.note = Some(reason);
            up.shutdown().await;
        }
    }
    Attempt::Done
}

fn timed_out(r: &Request<'_>) -> Attempt {
    if Instant::now() >= r.deadline {
        Attempt::Deadline
    } else {
        Attempt::Transport(TransportKind::Timeout, "no first byte within ttft_timeout")
    }
}

enum StreamEnd {
    Complete,
    Aborted(&'static str),
}

/// Streams the committed body chunk by chunk (stream phase). Never fails over.
async fn stream_body(
    session: &mut Session,
    r: &Request<'_>,
    up: &mut pingora::protocols::http::client::HttpSession,
    first: Bytes,
    is_sse: bool,
    watching: &mut bool,
) -> StreamEnd {
    let stall = r.snap.config.resilience.stream.stall_timeout;
    let mut progress = SseProgress::default();
    let mut last_progress = Instant::now();
    let mut next = Some(first);
    loop {
        if let Some(chunk) = next.take() {
            if !is_sse || progress.feed(&chunk) {
                last_progress = Instant::now();
            }
            if session
                .write_response_body(Some(chunk), false)
                .await
                .is_err()
            {
                return StreamEnd::Aborted("client_gone");
            }
        }
        let now = Instant::now();
        let stall_left = (last_progress + stall).saturating_duration_since(now);
        let deadline_left = r.deadline.saturating_duration_since(now);
        match race(
            session,
            watching,
            stall_left.min(deadline_left),
            up.read_response_body(),
        )
        .await
        {
            Wait::Ready(Ok(Some(c))) => next = Some(c),
            Wait::Ready(Ok(None)) => {
                return match session.write_response_body(None, true).await {
                    Ok(()) => StreamEnd::Complete,
                    Err(_) => StreamEnd::Aborted("client_gone"),
                };
            }
            Wait::Ready(Err(_)) => {
                return end_with_error(
                    session,
                    r,
                    is_sse,
                    "upstream_error",
                    "the upstream connection failed mid-stream",
                )
                .await
            }
            Wait::TimedOut => {
                return if Instant::now() >= r.deadline {
                    end_with_error(
                        session,
                        r,
                        is_sse,
                        "execution_timeout",
                        "the execution deadline passed mid-stream",
                    )
                    .await
                } else {
                    end_with_error(session, r, is_sse, "stall", "the upstream stream stalled").await
                };
            }
            Wait::ClientGone => return StreamEnd::Aborted("client_gone"),
        }
    }
}

/// After commit there is no failover: an SSE stream gets an error event and a clean
/// end; any other body is cut (the client sees a truncated transfer).
async fn end_with_error(
    session: &mut Session,
    r: &Request<'_>,
    is_sse: bool,
    reason: &'static str,
    message: &str,
) -> StreamEnd {
    if is_sse {
        let event = respond::sse_error_event(r.family, reason, message);
        if session
            .write_response_body(Some(event), false)
            .await
            .is_ok()
        {
            let _ = session.write_response_body(None, true).await;
        }
    } else {
        session.downstream_session.set_keepalive(None);
    }
    StreamEnd::Aborted(reason)
}
