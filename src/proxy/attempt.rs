//! One upstream attempt (ARCHITECTURE §3): connect, write the request, read the
//! response header, and either hold back an error (≤ 64 KiB) for the attempt loop or
//! commit and stream the body.
//!
//! Invariants: nothing reaches the client before the commit point; an upstream 2xx is
//! committed only once its first body chunk arrived (so a silent upstream is still a
//! failover); every wait is bounded and races the client; an upstream connection goes
//! back to the pool only after its response was read whole.

use super::dispatch::{sluice_headers, Request};
use super::respond;
use super::sse::{SseAssembler, SseEvent, SseProgress};
use super::upstream;
use super::RequestCtx;
use crate::engine::record::{AttemptInfo, Outcome};
use crate::engine::Pick;
use crate::policy::classify::TransportKind;
use crate::policy::watchdog::{classify_event, ThroughputWatchdog, WatchdogConfig};
use bytes::{Bytes, BytesMut};
use pingora::http::ResponseHeader;
use pingora::prelude::HttpPeer;
use pingora::proxy::Session;
use std::future::Future;
use std::time::{Duration, Instant};

/// Upstream error bodies are read up to this size (SPEC §2, phase 4).
const ERROR_BODY_LIMIT: usize = 64 * 1024;
const POOL_IDLE: Duration = Duration::from_secs(90);
const WRITE_TIMEOUT: Duration = Duration::from_secs(60);

/// An upstream error response held back (≤ 64 KiB) while failover is still possible.
pub(super) struct HeldError {
    pub header: ResponseHeader,
    pub body: Bytes,
    pub pick: Pick,
}

pub(super) enum Attempt {
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

pub(super) async fn attempt(
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
    let lookup = r
        .engine
        .resolver
        .resolve(&provider.base_url.host, provider.base_url.port, now);
    let addr = match race(session, &mut watching, left(now), lookup).await {
        Wait::Ready(Ok(a)) => a,
        Wait::Ready(Err(_)) => {
            return Attempt::Transport(TransportKind::Connect, "dns lookup failed")
        }
        Wait::TimedOut => return Attempt::Deadline,
        Wait::ClientGone => return Attempt::ClientGone,
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
            if reason == "stall" || reason == "throughput" {
                // The probe's verdict was given at the commit point; a later stall must
                // not free a probe slot another request may hold by now.
                let after_commit = AttemptInfo {
                    probe: false,
                    ..*info
                };
                r.engine.record(
                    &after_commit,
                    Outcome::Stall {
                        message: if reason == "stall" {
                            "stream stalled after commit"
                        } else {
                            "stream throughput below the watchdog minimum"
                        },
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
    let mut watchdog = Watch::new(r, is_sse);
    let mut next = Some(first);
    loop {
        if let Some(chunk) = next.take() {
            if !is_sse || progress.feed(&chunk) {
                last_progress = Instant::now();
            }
            let too_slow = watchdog
                .as_mut()
                .is_some_and(|w| w.too_slow(&chunk, r.engine.now()));
            if too_slow {
                // The chunk that tipped the verdict is not delivered (SPEC §5.9).
                return end_with_error(
                    session,
                    r,
                    is_sse,
                    "throughput",
                    "the upstream stream is below the throughput minimum",
                )
                .await;
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

/// The throughput watchdog of one streamed response (SPEC §5.9), when enabled: SSE
/// events are assembled from the chunks and only text deltas count as useful output.
struct Watch {
    events: SseAssembler,
    dog: ThroughputWatchdog,
    scratch: Vec<SseEvent>,
}

impl Watch {
    fn new(r: &Request<'_>, is_sse: bool) -> Option<Self> {
        let cfg = &r.snap.config.resilience.watchdog;
        (cfg.enabled && is_sse).then(|| Watch {
            events: SseAssembler::new(64 * 1024),
            dog: ThroughputWatchdog::new(WatchdogConfig::from(cfg), r.engine.now()),
            scratch: Vec::new(),
        })
    }

    /// Feeds one chunk; true when the stream should be aborted.
    fn too_slow(&mut self, chunk: &[u8], now: crate::policy::Millis) -> bool {
        self.events.feed(chunk, &mut self.scratch);
        for e in self.scratch.drain(..) {
            self.dog
                .observe(classify_event(e.event.as_deref(), &e.data), now);
        }
        self.dog.should_abort(now)
    }
}
