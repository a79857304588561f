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
use super::RequestCtx;
use crate::config::{Client, Family};
use crate::engine::judge::Verdict;
use crate::engine::record::{AttemptInfo, Outcome};
use crate::engine::select::Exclusion;
use crate::engine::{Engine, Pick, Selection, Snapshot, Tried};
use crate::error::ClientError;
use crate::policy::classify::TransportKind;
use crate::policy::{retry_after_secs, Scope};
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
pub struct Request<'a> {
    pub engine: &'a Engine,
    pub snap: &'a Snapshot,
    pub model: usize,
    pub family: Family,
    pub client: Option<&'a Client>,
    pub body: &'a ParsedBody,
    pub header: &'a RequestHeader,
    pub deadline: Instant,
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

enum Wait<T> {
    Ready(T),
    TimedOut,
    ClientGone,
}

/// Runs `fut` for at most `limit`, watching the client connection meanwhile.
async fn race<F: Future>(
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
    for attempt_no in 1..=max {
        let random: f64 = rand::random();
        let (pick, probe) = match r
            .engine
            .select(r.snap, r.model, r.family, r.client, &tried, random)
        {
            Selection::Picked { pick, probe } => (pick, probe),
            Selection::Empty(ex) => {
                excluded = ex;
                break;
            }
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
        let outcome = attempt(session, r, &info, ctx).await;
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
                return Ok(());
            }
            Attempt::ClientGone => {
                metric("final_error");
                r.engine.record(&info, Outcome::Abandoned);
                ctx.status = 499;
                ctx.note = Some("client_gone");
                return Ok(());
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
    nothing_runnable(session, r, &excluded, ctx).await
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

/// No candidate could run at all: 503 when only timers stand in the way, else 404.
async fn nothing_runnable(
    session: &mut Session,
    r: &Request<'_>,
    excluded: &[Exclusion],
    ctx: &mut RequestCtx,
) -> pingora::Result<()> {
    let now = r.engine.now();
    let model = &r.snap.config.models[r.model].name;
    for e in excluded {
        tracing::warn!(
            model = %model,
            provider = %e.provider,
            connection = %e.connection,
            upstream_model = %e.model,
            reason = e.reason.as_str(),
            remaining_s = e.until.map(|u| retry_after_secs(u, now)).unwrap_or(0),
            "target excluded"
        );
    }
    let list: Vec<_> = excluded.iter().map(|e| e.json(now)).collect();
    let err = match Engine::soonest(excluded, now) {
        Some(secs) => {
            let mut e = ClientError::new(
                503,
                "all_targets_cooling_down",
                format!("every target of model {model:?} is cooling down; retry in {secs}s"),
            )
            .with_extra("diagnostics", json!({ "excluded": list }));
            e.retry_after = Some(secs);
            e
        }
        None => ClientError::new(
            404,
            "no_executable_targets",
            format!("model {model:?} has no target that can run"),
        )
        .with_extra("diagnostics", json!({ "excluded": list })),
    };
    finish_error(session, r.family, err, ctx).await
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

async fn finish_error(
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
