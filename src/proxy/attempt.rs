//! One upstream attempt up to the commit point (ARCHITECTURE §3.1): one function per
//! phase — connect, send (request out, response header in), hold an error, first body
//! chunk, commit — each ending the attempt with a typed [`AttemptEnd`] or handing on.
//!
//! Invariants:
//! - nothing reaches the client before `commit`; until then every end may fail over;
//! - every attempt, streaming or not, gets its first byte (header, and the first body
//!   chunk of a 2xx) within `stream.ttft_timeout` of the request write, else it is a
//!   transport timeout of its provider (SPEC §2 connect) — never a wait for the whole
//!   execution deadline;
//! - every wait is bounded by the execution deadline too, and races the client;
//! - an upstream connection goes back to the pool only after its response was read
//!   whole; any other end drops it.

use super::ctx::{Request, RequestCtx};
use super::rare;
use super::transport::{self, Cause, Upstream, POOL_IDLE};
use super::upconn::UpConn;
use super::upstream;
use super::watch::{ClientWatch, Wait};
use crate::clock::monotonic;
use crate::config::Provider;
use crate::engine::Pick;
use crate::http1::ResponseHead;
use crate::policy::classify::TransportKind;
use crate::policy::redact::Redactor;
use crate::server::conn::{BodySize, ClientConn};
use bytes::{Bytes, BytesMut};
use pingora::RetryType;
use std::borrow::Cow;
use std::net::SocketAddr;
use std::pin::pin;
use std::time::{Duration, Instant};

/// Upstream error bodies are read up to this size (SPEC §2, phase 4).
const ERROR_BODY_LIMIT: usize = 64 * 1024;
/// An upstream response header larger than this is not passed on: the attempt is a
/// transport failure (the client would otherwise get whatever the upstream sent).
const MAX_UPSTREAM_HEADER_BYTES: usize = 64 * 1024;
/// The upstream connection broke (write or read error) before a whole response header.
const CONN_FAILED: &str = "upstream connection failed";
/// The connection was closed or reset right after the request was written, before a
/// byte of an answer: on a pooled connection, a stale one.
const STALE: &str = "upstream connection closed before answering";
/// How soon after the write such a close must come to be taken for a stale connection.
const STALE_WINDOW: Duration = Duration::from_secs(1);

/// An upstream error response held back (≤ 64 KiB) while failover is still possible:
/// its fields as a map (the rules and the classifier read them; errors are rare), every
/// credential already masked.
pub(super) struct HeldError {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
    pub pick: Pick,
}

/// A response whose header went to the client: only its body is left to stream.
pub(super) struct Committed {
    pub up: UpConn,
    pub upstream: Upstream,
    pub head: ResponseHead,
    /// The first body chunk (`None`: the body was empty and is complete).
    pub first: Option<Bytes>,
    pub is_sse: bool,
    /// Request write → first body byte.
    pub latency: Duration,
    /// When the first body byte was in hand (the stall guard's first window starts then).
    pub at: Instant,
}

/// How an attempt ended before (or at) the commit point.
pub(super) enum AttemptEnd {
    Committed(Box<Committed>),
    /// The upstream answered ≥ 400 before anything was committed.
    Refused(Box<HeldError>),
    /// Connect / write / read failure, or no first byte within the TTFT budget.
    Transport(Broken),
    /// The execution deadline passed.
    Deadline,
    ClientGone,
}

/// A transport failure: how the failure memory weighs it (`kind`), what to call it
/// (`cause`, a stable word) and what happened, in words (`what`, e.g. why TLS failed).
pub(super) struct Broken {
    pub kind: TransportKind,
    pub cause: Cause,
    pub what: Cow<'static, str>,
}

fn broken(kind: TransportKind, cause: Cause, what: impl Into<Cow<'static, str>>) -> AttemptEnd {
    AttemptEnd::Transport(Broken {
        kind,
        cause,
        what: what.into(),
    })
}

/// One attempt: the request, its pick and its clock.
pub(super) struct Call<'r, 'a> {
    pub req: &'r Request<'a>,
    pub pick: Pick,
    /// The request's execution deadline.
    pub deadline: Instant,
    /// The connection's subscription lane is on: the request carries the slow header.
    pub slow: bool,
}

impl Call<'_, '_> {
    fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(monotonic())
    }

    /// A wait that hit its limit: the deadline's, or the first-byte budget's.
    fn timed_out(&self) -> AttemptEnd {
        if monotonic() >= self.deadline {
            AttemptEnd::Deadline
        } else {
            broken(
                TransportKind::Timeout,
                Cause::Timeout,
                "no first byte within ttft_timeout",
            )
        }
    }
}

/// Counts an attempt in `sluice_inflight` from its start to the end of its stream,
/// however it ends. It borrows the snapshot's handle (a clone would add two writes to
/// a count every thread shares).
pub(super) struct Inflight<'s>(&'s prometheus::IntGauge);

impl<'s> Inflight<'s> {
    pub fn start(req: &Request<'s>, pick: Pick) -> Inflight<'s> {
        let snap: &'s crate::engine::Snapshot = req.snap;
        let p = &snap.config.providers[pick.provider];
        let names = [p.id.as_str(), p.connections[pick.connection].id.as_str()];
        let ids = (pick.provider, pick.connection);
        let gauge = snap.hot.inflight(&req.engine.metrics, ids, names);
        gauge.inc();
        Inflight(gauge)
    }
}

impl Drop for Inflight<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Runs one attempt up to its commit point.
pub(super) async fn attempt(
    conn: &mut ClientConn,
    watch: &mut ClientWatch,
    call: &Call<'_, '_>,
    ctx: &mut RequestCtx<'_>,
) -> AttemptEnd {
    match phases(conn, watch, call, ctx).await {
        Ok(end) | Err(end) => end,
    }
}

async fn phases(
    conn: &mut ClientConn,
    watch: &mut ClientWatch,
    call: &Call<'_, '_>,
    ctx: &mut RequestCtx<'_>,
) -> Result<AttemptEnd, AttemptEnd> {
    let (mut up, upstream, reused) = connect(conn, watch, call).await?;
    let sent_at = monotonic();
    let ttft = call.req.snap.config.resilience.stream.ttft_timeout;
    let first_byte_by = (sent_at + ttft).min(call.deadline);
    let head = match send(conn, watch, call, &mut up, (sent_at, first_byte_by)).await {
        // A pooled connection the upstream closed as it was taken (closed or reset at
        // once, not one byte of an answer: Pingora's "retry if reused") says nothing
        // about the provider, so the request goes once more, on a new connection (the
        // upstream may have closed every idle one at once), within the same attempt and the same first-byte budget.
        // Only once, and only right after the write: anything later may be an upstream
        // that took the request and died on it, which is the provider's failure.
        Err(AttemptEnd::Transport(b)) if reused && b.what == STALE => {
            rare(resend(
                conn,
                watch,
                call,
                &mut up,
                upstream.addr,
                first_byte_by,
            ))
            .await?
        }
        other => other?,
    };
    if head.status() >= 400 {
        // Boxed: the error path's state stays out of every connection's task.
        return Ok(Box::pin(hold_error(conn, watch, call, up, upstream, head)).await);
    }
    let first = first_chunk(conn, watch, call, &mut up, first_byte_by).await?;
    let now = monotonic();
    let committed = Committed {
        up,
        upstream,
        head,
        first,
        is_sse: false,
        latency: now.saturating_duration_since(sent_at),
        at: now,
    };
    Ok(commit(conn, ctx, committed))
}

/// The request once more, on a new connection to `addr`, after a pooled one turned out
/// closed as it was taken (see [`phases`]).
async fn resend(
    conn: &mut ClientConn,
    watch: &mut ClientWatch,
    call: &Call<'_, '_>,
    up: &mut UpConn,
    addr: SocketAddr,
    first_byte_by: Instant,
) -> Result<ResponseHead, AttemptEnd> {
    let p = &call.req.snap.config.providers[call.pick.provider];
    tracing::info!(provider = %p.id, connection = %p.connections[call.pick.connection].id,
        "pooled upstream connection was closed; request resent on another connection");
    let peer = Cow::Owned(transport::peer(p, addr));
    let fresh = call.req.engine.upstreams.fresh(peer);
    let got = async { Ok((fresh.await?, false)) };
    *up = session_of(watch.race(conn, call.deadline, pin!(got)).await)?.0;
    send(conn, watch, call, up, (monotonic(), first_byte_by)).await
}

/// select → connect: DNS (cached, async; none for an address literal) and a pooled or
/// new upstream connection (`true` when it came from the pool).
async fn connect(
    conn: &mut ClientConn,
    watch: &mut ClientWatch,
    call: &Call<'_, '_>,
) -> Result<(UpConn, Upstream, bool), AttemptEnd> {
    let engine = call.req.engine;
    let p = &call.req.snap.config.providers[call.pick.provider];
    let addr = match p.base_url.ip() {
        Some(ip) => SocketAddr::new(ip, p.base_url.port),
        None => resolve(conn, watch, call, p).await?,
    };
    let upstream = Upstream::new(call.pick.provider, p, addr);
    let to = upstream.of(p);
    let got = engine.upstreams.session(&to);
    let (up, reused) = session_of(watch.race(conn, call.deadline, pin!(got)).await)?;
    Ok((up, upstream, reused))
}

/// The address of a provider named by host name.
async fn resolve(
    conn: &mut ClientConn,
    watch: &mut ClientWatch,
    call: &Call<'_, '_>,
    p: &Provider,
) -> Result<SocketAddr, AttemptEnd> {
    let lookup = call
        .req
        .engine
        .resolver
        .resolve(&p.base_url.host, p.base_url.port, monotonic());
    match watch.race(conn, call.deadline, pin!(lookup)).await {
        Wait::Ready(Ok(a)) => Ok(a),
        Wait::Ready(Err(_)) => Err(broken(
            TransportKind::Connect,
            Cause::Dns,
            "dns lookup failed",
        )),
        Wait::TimedOut => Err(AttemptEnd::Deadline),
        Wait::ClientGone => Err(AttemptEnd::ClientGone),
    }
}

fn session_of(w: Wait<pingora::Result<(UpConn, bool)>>) -> Result<(UpConn, bool), AttemptEnd> {
    match w {
        Wait::Ready(Ok(got)) => Ok(got),
        Wait::Ready(Err(e)) => {
            // A connect timeout is a connect failure (502); only a missing first byte
            // is an upstream timeout (504). The cause still says `timeout`.
            let (cause, what) = transport::connect_failure(&e);
            Err(broken(TransportKind::Connect, cause, what))
        }
        Wait::TimedOut => Err(AttemptEnd::Deadline),
        Wait::ClientGone => Err(AttemptEnd::ClientGone),
    }
}

/// Writes the request (model rewritten, credential set) at `written_at` and reads the
/// response head, skipping 1xx, by `first_byte_by`.
async fn send(
    conn: &mut ClientConn,
    watch: &mut ClientWatch,
    call: &Call<'_, '_>,
    up: &mut UpConn,
    (written_at, first_byte_by): (Instant, Instant),
) -> Result<ResponseHead, AttemptEnd> {
    let cfg = &call.req.snap.config;
    let p = &cfg.providers[call.pick.provider];
    let connection = &p.connections[call.pick.connection];
    let upstream_model =
        call.req
            .snap
            .upstream_model(call.req.model, call.pick.target, &call.req.body.model);
    let body = call.req.body.with_model(upstream_model);
    let head = upstream::request_head(
        call.req.header,
        call.req.route.path(),
        p,
        connection,
        body.len(),
        call.slow,
    );
    let exchange = async {
        up.send(head, &body).await?;
        up.read_head(MAX_UPSTREAM_HEADER_BYTES).await
    };
    let head = match watch.race(conn, first_byte_by, pin!(exchange)).await {
        Wait::Ready(Ok(head)) => head,
        Wait::Ready(Err(e)) => {
            let at_once = written_at.elapsed() < STALE_WINDOW;
            // A pooled HTTP/1.1 connection closed as it was taken, or an HTTP/2 one the
            // upstream sent GOAWAY / REFUSED_STREAM on (Pingora marks those retryable):
            // the request never reached the provider.
            let stale = (matches!(e.retry, RetryType::ReusedOnly) && at_once)
                || matches!(e.retry, RetryType::Decided(true));
            if stale {
                return Err(broken(TransportKind::Reset, Cause::Reset, STALE));
            }
            if matches!(e.etype(), pingora::ErrorType::InvalidHTTPHeader) {
                // Too large, or not HTTP: nothing of it is passed on.
                let what = e
                    .context
                    .as_ref()
                    .map_or(CONN_FAILED.to_string(), |c| c.as_str().to_owned());
                return Err(broken(TransportKind::Reset, Cause::Reset, what));
            }
            let (cause, what) = transport::exchange_failure(&e);
            return Err(broken(TransportKind::Reset, cause, what));
        }
        Wait::TimedOut => return Err(call.timed_out()),
        Wait::ClientGone => return Err(AttemptEnd::ClientGone),
    };
    // Statuses outside 100–599 are not HTTP an upstream may answer (1xx were skipped).
    if !(100..=599).contains(&head.status()) {
        return Err(broken(
            TransportKind::Reset,
            Cause::Reset,
            "invalid upstream status",
        ));
    }
    Ok(head)
}

/// Response-header phase of an error: read (bounded) and hold it, never commit it.
async fn hold_error(
    conn: &mut ClientConn,
    watch: &mut ClientWatch,
    call: &Call<'_, '_>,
    mut up: UpConn,
    upstream: Upstream,
    head: ResponseHead,
) -> AttemptEnd {
    let mut buf = BytesMut::new();
    let mut complete = false;
    // The header came in time; its body gets a first-byte budget of its own, so an
    // upstream that stops after an error header costs `ttft_timeout`, not `stall_timeout`.
    let limit = call
        .left()
        .min(call.req.snap.config.resilience.stream.ttft_timeout);
    let read = async {
        complete = read_bounded(&mut up, &mut buf, ERROR_BODY_LIMIT)
            .await
            .unwrap_or(false);
    };
    if let Wait::ClientGone = watch.race(conn, limit, pin!(read)).await {
        return AttemptEnd::ClientGone;
    }
    let (headers, body) = redacted(&call.req.snap.redactor, head.to_header_map(), &buf);
    if complete {
        let p = &call.req.snap.config.providers[upstream.provider];
        call.req
            .engine
            .upstreams
            .release(up, &upstream.of(p), POOL_IDLE)
            .await;
    }
    AttemptEnd::Refused(Box::new(HeldError {
        status: head.status(),
        headers,
        body,
        pick: call.pick,
    }))
}

/// Reads a response body into `buf` until it ends or holds `limit` bytes; `Ok(true)`
/// when it ended whole (the connection may then go back to the pool).
pub(super) async fn read_bounded(
    up: &mut UpConn,
    buf: &mut BytesMut,
    limit: usize,
) -> pingora::Result<bool> {
    while buf.len() < limit {
        match up.read_body().await? {
            Some(c) => buf.extend_from_slice(&c),
            None => return Ok(true),
        }
    }
    Ok(false)
}

/// A held error as it may be passed on or kept: every credential value masked in its
/// body and header values (SPEC §3), before any rule, judge or client sees it.
/// The body is cut to `ERROR_BODY_LIMIT` after masking, so a credential that straddles
/// the limit leaves no prefix behind.
fn redacted(r: &Redactor, mut headers: http::HeaderMap, body: &[u8]) -> (http::HeaderMap, Bytes) {
    let body = Bytes::from(r.bytes_within(body, ERROR_BODY_LIMIT));
    let mut leaked: Vec<http::HeaderName> = headers
        .iter()
        .filter(|(_, v)| matches!(r.bytes(v.as_bytes()), std::borrow::Cow::Owned(_)))
        .map(|(k, _)| k.clone())
        .collect();
    leaked.dedup();
    for name in leaked {
        let values: Vec<Vec<u8>> = headers
            .get_all(&name)
            .iter()
            .map(|v| r.bytes(v.as_bytes()).into_owned())
            .collect();
        headers.remove(&name);
        for v in values
            .into_iter()
            .filter_map(|v| http::HeaderValue::from_bytes(&v).ok())
        {
            headers.append(name.clone(), v);
        }
    }
    (headers, body)
}

/// The first body chunk of a 2xx, before commit, so a silent upstream is still a
/// failover. `None` when the body is empty.
async fn first_chunk(
    conn: &mut ClientConn,
    watch: &mut ClientWatch,
    call: &Call<'_, '_>,
    up: &mut UpConn,
    first_byte_by: Instant,
) -> Result<Option<Bytes>, AttemptEnd> {
    if up.is_done() {
        return Ok(None);
    }
    match watch.race(conn, first_byte_by, pin!(up.read_body())).await {
        Wait::Ready(Ok(c)) => Ok(c),
        Wait::Ready(Err(_)) => Err(broken(
            TransportKind::Reset,
            Cause::Reset,
            "upstream connection failed",
        )),
        Wait::TimedOut => Err(call.timed_out()),
        Wait::ClientGone => Err(AttemptEnd::ClientGone),
    }
}

/// The commit point (at `c.at`): the response head is written for the client; it leaves
/// with the first body bytes.
fn commit(conn: &mut ClientConn, ctx: &mut RequestCtx<'_>, mut c: Committed) -> AttemptEnd {
    c.is_sse = c
        .head
        .get("content-type")
        .is_some_and(|v| v.starts_with(b"text/event-stream"));
    let mut h = conn.head(c.head.status());
    upstream::response_head(&mut h, &c.head);
    ctx.sluice_fields(|k, v| {
        h.field(k.as_bytes(), v);
    });
    // An event stream is chunked to the client whatever the upstream framed it by: a
    // stream cut after commit ends with an error event (SPEC §2), which a length could
    // not hold.
    h.end(match upstream::body_size(&c.head) {
        BodySize::Exactly(_) if c.is_sse => BodySize::Unknown,
        size => size,
    });
    ctx.status = c.head.status();
    ctx.ttfb = Some(c.at.saturating_duration_since(ctx.started));
    AttemptEnd::Committed(Box::new(c))
}
