//! The mock's HTTP application: routing, fault application and response writing.
//!
//! Life of an API request: header read → counted (route, credential) → `100 Continue`
//! if asked → whole body read → remembered as "last request" → in flight (guard) → fault
//! resolved (the request's `x-mock-fault` header when its conditions match, else the
//! process fault; see [`fault::resolve`]) → delays → error or success, whole or
//! streamed. Control routes (`/__stats`, `/__fault`, `/__reset`, `/__subscription`) skip
//! all counting and faults so tests can always observe and steer the mock; an armed
//! subscription account answers `/v1/messages` before any fault (`subscription.rs`).
//!
//! Invariants: a connection is handed back for keep-alive only after a response was
//! written completely; every deliberate truncation (reset, stall) and every failed write
//! drops the connection instead. A stream that loses its client mid-way (write failure,
//! or the client closing while the mock waits between chunks or stalls) counts once in
//! `streams_aborted`; one that writes its terminator counts once in `streams_completed`.
//! Every wait the mock does on a client's behalf (`latency`, `first_byte_delay`,
//! `chunk_interval`, a stall) ends as soon as that client closes: a request abandoned
//! before its header was written counts once in `requests_abandoned`, and nothing keeps
//! sleeping for a caller that is gone.
//! Because "the client closed" is detected by reading, a client that half-closes its
//! sending side after the request is treated as gone; HTTP clients in practice do not.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderValue};
use http::Method;
use pingora::apps::{HttpPersistentSettings, HttpServerApp, ReusedHttpStream};
use pingora::http::ResponseHeader;
use pingora::protocols::http::ServerSession;
use pingora::server::ShutdownWatch;
use serde::Deserialize;

use super::fault::{self, Fault, FaultSlot};
use super::render::{self, Answer};
use super::route::Route;
use super::stats::Stats;
use super::subscription::Subscription;

/// Largest request body the mock accepts (413 above it); far beyond any test's needs.
const MAX_BODY: usize = 256 * 1024 * 1024;
/// Largest `/__fault` body.
const MAX_CONTROL_BODY: usize = 1024 * 1024;
/// How long a stalled stream holds its connection if the client never leaves.
const STALL_LIMIT: Duration = Duration::from_secs(600);

const JSON: &str = "application/json";
const TEXT: &str = "text/plain; charset=utf-8";
const SSE: &str = "text/event-stream";

/// Static settings of one mock process.
pub struct MockSettings {
    pub name: String,
    pub chunks: u32,
    pub chunk_interval: Duration,
    /// Each streamed content chunk starts with `: t=<unix µs>\n` (an SSE comment).
    pub stamp_chunks: bool,
}

/// The mock upstream application.
pub struct MockApp {
    name: String,
    name_header: HeaderValue,
    /// `name` JSON-escaped without quotes, computed once for the render functions.
    name_escaped: String,
    chunks: u32,
    chunk_interval: Duration,
    stamp_chunks: bool,
    stats: Stats,
    fault: FaultSlot,
    next_id: AtomicU64,
    subscription: Subscription,
}

/// What to do with the connection once the handler returns.
enum End {
    Reuse,
    Close,
}

/// The parts of a request body the mock reads; everything else is validated and skipped.
#[derive(Deserialize, Default)]
struct ApiRequest<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    input: Option<serde_json::Value>,
}

enum BodyError {
    TooLarge,
    Io,
}

/// What a request line asks for.
enum Target {
    Api(Route),
    Stats,
    Fault,
    Reset,
    Subscription,
    OAuth,
    NotFound(String),
}

/// How a non-streamed answer is cut short by a fault.
#[derive(Clone, Copy)]
enum Cut {
    Stall,
    Reset,
}

impl MockApp {
    /// Fails only when the name cannot be sent as a header value.
    pub fn new(settings: MockSettings) -> Result<Self, String> {
        let name_header = HeaderValue::from_str(&settings.name)
            .map_err(|_| format!("mock name `{}` is not a valid header value", settings.name))?;
        let quoted = serde_json::to_string(&settings.name).map_err(|e| e.to_string())?;
        let name_escaped = quoted[1..quoted.len() - 1].to_string();
        Ok(Self {
            name: settings.name,
            name_header,
            name_escaped,
            chunks: settings.chunks,
            chunk_interval: settings.chunk_interval,
            stamp_chunks: settings.stamp_chunks,
            stats: Stats::default(),
            fault: FaultSlot::default(),
            next_id: AtomicU64::new(1),
            subscription: Subscription::default(),
        })
    }

    /// Sets the process fault (the `--fault` flag).
    pub fn set_fault(&self, fault: Fault) {
        self.fault.set(fault);
    }

    async fn serve(&self, session: &mut ServerSession) -> End {
        let req = session.req_header();
        let path = req.uri.path();
        let target = if let Some(route) = Route::from_request(&req.method, path) {
            Target::Api(route)
        } else if req.method == Method::GET && path == "/__stats" {
            Target::Stats
        } else if req.method == Method::POST && path == "/__fault" {
            Target::Fault
        } else if req.method == Method::POST && path == "/__reset" {
            Target::Reset
        } else if req.method == Method::POST && path == "/__subscription" {
            Target::Subscription
        } else if path.starts_with("/api/") {
            Target::OAuth
        } else {
            Target::NotFound(format!("no route for {} {}", req.method, path))
        };
        match target {
            Target::Api(route) => self.serve_api(session, route).await,
            Target::Stats => {
                let mut doc = self.stats.to_json(&self.name, self.fault.describe());
                doc["subscription"] = self.subscription.to_json();
                let body = serde_json::to_vec(&doc).unwrap_or_default();
                self.write_whole(session, 200, JSON, Bytes::from(body), None)
                    .await
            }
            Target::Fault => {
                let body = match read_body(session, MAX_CONTROL_BODY).await {
                    Ok(b) => b,
                    Err(e) => return self.body_error(session, false, e).await,
                };
                let parsed = std::str::from_utf8(&body)
                    .map_err(|_| "fault spec is not UTF-8".to_string())
                    .and_then(Fault::parse);
                match parsed {
                    Ok(f) => {
                        self.fault.set(f);
                        self.ok(session).await
                    }
                    Err(msg) => self.error(session, false, 400, &msg, None).await,
                }
            }
            Target::Reset => {
                self.stats.reset();
                self.ok(session).await
            }
            Target::Subscription => {
                let body = match read_body(session, MAX_CONTROL_BODY).await {
                    Ok(b) => b,
                    Err(e) => return self.body_error(session, false, e).await,
                };
                match self.subscription.set(&body) {
                    Ok(()) => self.ok(session).await,
                    Err(msg) => self.error(session, false, 400, &msg, None).await,
                }
            }
            Target::OAuth => {
                let body = match read_body(session, MAX_CONTROL_BODY).await {
                    Ok(b) => b,
                    Err(e) => return self.body_error(session, true, e).await,
                };
                let req = session.req_header();
                let answer = self.subscription.on_oauth(
                    &req.method,
                    req.uri.path(),
                    req.uri.query(),
                    &req.headers,
                    &body,
                );
                match answer {
                    Some(a) => {
                        self.write_whole(session, a.status, JSON, Bytes::from(a.body), None)
                            .await
                    }
                    None => {
                        let msg = format!("no route for {}", session.req_header().uri.path());
                        self.error(session, true, 404, &msg, None).await
                    }
                }
            }
            Target::NotFound(msg) => self.error(session, false, 404, &msg, None).await,
        }
    }

    async fn ok(&self, session: &mut ServerSession) -> End {
        let body = Bytes::from_static(br#"{"ok":true}"#);
        self.write_whole(session, 200, JSON, body, None).await
    }

    async fn serve_api(&self, session: &mut ServerSession, route: Route) -> End {
        self.stats.count_request(
            route,
            fault::request_credential(&session.req_header().headers),
            session.is_http2(),
        );
        let body = match read_body(session, MAX_BODY).await {
            Ok(b) => b,
            Err(e) => return self.body_error(session, route.is_anthropic(), e).await,
        };
        self.stats
            .record_last(body.clone(), session.req_header().headers.clone());
        let _inflight = self.stats.enter();

        let resolved = fault::resolve(
            session.get_header("x-mock-fault"),
            &self.fault,
            fault::request_credential(&session.req_header().headers),
            &body,
        );
        let fault = match resolved {
            Ok(f) => f,
            Err(msg) => {
                return self
                    .error(session, route.is_anthropic(), 400, &msg, None)
                    .await
            }
        };
        // An armed subscription account answers its messages as the plan says.
        let account = match route {
            Route::Messages => self.subscription.on_message(&session.req_header().headers),
            _ => None,
        };
        let fault = account.as_ref().or(fault.as_deref());

        if fault.and_then(|f| f.reset_after) == Some(0) {
            return End::Close;
        }
        // Both delays give up as soon as the client leaves: nobody is left to answer.
        for d in [
            fault.and_then(|f| f.latency),
            fault.and_then(|f| f.first_byte_delay),
        ]
        .into_iter()
        .flatten()
        {
            if !pause(session, d).await {
                self.stats.request_abandoned();
                return End::Close;
            }
        }
        if let Some(f) = fault {
            if let Some(status) = f.status {
                let (ctype, body) = match &f.body {
                    Some(b) => {
                        let is_json = serde_json::from_str::<serde::de::IgnoredAny>(b).is_ok();
                        (if is_json { JSON } else { TEXT }, Bytes::from(b.clone()))
                    }
                    None => {
                        let msg = format!("mock {}: injected fault, status {status}", self.name);
                        (JSON, render::error_body(route.is_anthropic(), status, &msg))
                    }
                };
                return self.write_whole(session, status, ctype, body, fault).await;
            }
        }

        let request = if route.has_body() {
            match serde_json::from_slice::<ApiRequest<'_>>(&body) {
                Ok(r) => r,
                Err(e) => {
                    let msg = format!("request body is not valid JSON: {e}");
                    return self
                        .error(session, route.is_anthropic(), 400, &msg, fault)
                        .await;
                }
            }
        } else {
            ApiRequest::default()
        };
        let input_count = match &request.input {
            Some(serde_json::Value::Array(items)) => {
                let nested = items
                    .iter()
                    .filter(|v| v.is_string() || v.is_array())
                    .count();
                if nested == 0 {
                    1
                } else {
                    nested
                }
            }
            _ => 1,
        };
        let answer = Answer {
            name: &self.name_escaped,
            model: request.model.as_deref().unwrap_or("mock-model"),
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            created: crate::clock::unix_ms() / 1000,
            chunks: fault.and_then(|f| f.chunks).unwrap_or(self.chunks),
            prompt_tokens: (body.len() as u64 / 4).max(1),
        };
        if route.can_stream() && request.stream == Some(true) {
            let interval = fault
                .and_then(|f| f.chunk_interval)
                .unwrap_or(self.chunk_interval);
            self.stream(session, route, &answer, interval, fault).await
        } else {
            let out = render::full_body(route, &answer, &body, input_count);
            self.write_whole(session, 200, JSON, out, fault).await
        }
    }

    /// A response header with the headers every answer carries plus the fault's extras.
    fn header(&self, status: u16, ctype: &str, fault: Option<&Fault>) -> Option<ResponseHeader> {
        let extra = fault.map_or(0, |f| f.headers.len() + 1);
        let mut h = ResponseHeader::build(status, Some(4 + extra)).ok()?;
        h.insert_header(header::CONTENT_TYPE, ctype).ok()?;
        h.insert_header("x-mock-name", self.name_header.clone())
            .ok()?;
        if let Some(f) = fault {
            if let Some(r) = &f.retry_after {
                h.insert_header(header::RETRY_AFTER, r.clone()).ok()?;
            }
            for (n, v) in &f.headers {
                h.append_header(n.clone(), v.clone()).ok()?;
            }
        }
        Some(h)
    }

    async fn error(
        &self,
        session: &mut ServerSession,
        anthropic: bool,
        status: u16,
        msg: &str,
        fault: Option<&Fault>,
    ) -> End {
        let body = render::error_body(anthropic, status, msg);
        self.write_whole(session, status, JSON, body, fault).await
    }

    async fn body_error(&self, session: &mut ServerSession, anthropic: bool, e: BodyError) -> End {
        match e {
            BodyError::Io => End::Close,
            BodyError::TooLarge => {
                // The rest of the body is unread, so the connection cannot be reused.
                session.set_keepalive(None);
                let _ = self
                    .error(session, anthropic, 413, "request body too large", None)
                    .await;
                End::Close
            }
        }
    }

    /// Writes a complete (non-streamed) answer, or its first half when a stall/reset
    /// fault asks for a truncated one.
    async fn write_whole(
        &self,
        session: &mut ServerSession,
        status: u16,
        ctype: &str,
        body: Bytes,
        fault: Option<&Fault>,
    ) -> End {
        let cut = fault.and_then(|f| {
            f.stall_after
                .map(|n| (Cut::Stall, n))
                .or(f.reset_after.map(|n| (Cut::Reset, n)))
        });
        let Some(mut h) = self.header(status, ctype, fault) else {
            return End::Close;
        };
        if session.is_http2() && h.insert_header("x-mock-http", "2").is_err() {
            return End::Close;
        }
        let framing = match cut {
            // Chunked so the partial body is flushed to the client right away.
            Some(_) => h.insert_header(header::TRANSFER_ENCODING, "chunked"),
            None => h.insert_header(header::CONTENT_LENGTH, body.len()),
        };
        if framing.is_err() || session.write_response_header(Box::new(h)).await.is_err() {
            return End::Close;
        }
        match cut {
            None => match session.write_response_body(body, true).await {
                Ok(()) => End::Reuse,
                Err(_) => End::Close,
            },
            Some((kind, n)) => {
                if n > 0 {
                    let half = body.slice(..body.len() / 2);
                    if session.write_response_body(half, false).await.is_err() {
                        return End::Close;
                    }
                }
                match kind {
                    Cut::Stall => self.stall(session).await,
                    Cut::Reset => End::Close,
                }
            }
        }
    }

    async fn stream(
        &self,
        session: &mut ServerSession,
        route: Route,
        a: &Answer<'_>,
        interval: Duration,
        fault: Option<&Fault>,
    ) -> End {
        let Some(mut h) = self.header(200, SSE, fault) else {
            return End::Close;
        };
        if session.is_http2() && h.insert_header("x-mock-http", "2").is_err() {
            return End::Close;
        }
        let framed = h.insert_header(header::CACHE_CONTROL, "no-cache").is_ok()
            && h.insert_header(header::TRANSFER_ENCODING, "chunked")
                .is_ok();
        if !framed {
            return End::Close;
        }
        if session.write_response_header(Box::new(h)).await.is_err() {
            return self.aborted();
        }
        for ev in render::stream_open(route, a) {
            if session.write_response_body(ev, false).await.is_err() {
                return self.aborted();
            }
        }
        let stall_after = fault.and_then(|f| f.stall_after);
        let reset_after = fault.and_then(|f| f.reset_after);
        for i in 0..=a.chunks {
            if stall_after == Some(i) {
                return self.stall(session).await;
            }
            if reset_after == Some(i) {
                return End::Close;
            }
            if i == a.chunks {
                break;
            }
            if i > 0 && !interval.is_zero() && !pause(session, interval).await {
                return self.aborted();
            }
            let mut ev = render::stream_chunk(route, a, i);
            if self.stamp_chunks {
                ev = render::stamped(&ev, crate::clock::unix_us());
            }
            if session.write_response_body(ev, false).await.is_err() {
                return self.aborted();
            }
            self.stats.chunk_sent();
        }
        for ev in render::stream_close(route, a) {
            if session.write_response_body(ev, false).await.is_err() {
                return self.aborted();
            }
        }
        if session
            .write_response_body(Bytes::new(), true)
            .await
            .is_err()
        {
            return self.aborted();
        }
        self.stats.stream_completed();
        End::Reuse
    }

    fn aborted(&self) -> End {
        self.stats.stream_aborted();
        End::Close
    }

    /// Holds the connection without writing until the client leaves (counted as an
    /// aborted stream) or the stall limit passes.
    async fn stall(&self, session: &mut ServerSession) -> End {
        tokio::select! {
            _ = tokio::time::sleep(STALL_LIMIT) => {}
            _ = session.read_body_or_idle(true) => self.stats.stream_aborted(),
        }
        End::Close
    }
}

/// Sleeps `d` unless the client goes away first; false means it went away.
async fn pause(session: &mut ServerSession, d: Duration) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        // With the body fully read, this only returns when the client closes (or sends
        // bytes it should not), both of which end this exchange.
        _ = session.read_body_or_idle(true) => false,
    }
}

/// Reads the whole request body, answering `Expect: 100-continue` first. A body that
/// arrives in one piece is returned without copying.
async fn read_body(session: &mut ServerSession, limit: usize) -> Result<Bytes, BodyError> {
    let expects_continue = session
        .get_header(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if expects_continue && session.write_continue_response().await.is_err() {
        return Err(BodyError::Io);
    }
    let mut first: Option<Bytes> = None;
    let mut joined: Option<BytesMut> = None;
    let mut len = 0usize;
    loop {
        let chunk = match session.read_request_body().await {
            Ok(Some(c)) => c,
            Ok(None) => break,
            Err(_) => return Err(BodyError::Io),
        };
        len += chunk.len();
        if len > limit {
            return Err(BodyError::TooLarge);
        }
        match (&mut first, &mut joined) {
            (None, None) => first = Some(chunk),
            (Some(f), None) => {
                let mut buf = BytesMut::with_capacity((f.len() + chunk.len()) * 2);
                buf.extend_from_slice(f);
                buf.extend_from_slice(&chunk);
                first = None;
                joined = Some(buf);
            }
            (_, Some(buf)) => buf.extend_from_slice(&chunk),
        }
    }
    Ok(match (first, joined) {
        (_, Some(buf)) => buf.freeze(),
        (Some(f), None) => f,
        (None, None) => Bytes::new(),
    })
}

#[async_trait]
impl HttpServerApp for MockApp {
    async fn process_new_http(
        self: &Arc<Self>,
        mut session: ServerSession,
        shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        match session.read_request().await {
            Ok(true) => {}
            _ => return None,
        }
        session.set_keepalive(if *shutdown.borrow() { None } else { Some(60) });
        match self.serve(&mut session).await {
            End::Close => None,
            End::Reuse => {
                let settings = HttpPersistentSettings::for_session(&session);
                match session.finish().await {
                    Ok(Some(s)) => Some(ReusedHttpStream::from_reusable_stream(s, settings)),
                    _ => None,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The request path over real loopback sockets: the app is driven exactly as Pingora
    //! drives it (one `process_new_http` per connection), the client is raw HTTP/1.1.

    use super::*;
    use pingora::protocols::l4::stream::Stream;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    const IO_LIMIT: Duration = Duration::from_secs(10);

    fn app() -> Arc<MockApp> {
        Arc::new(
            MockApp::new(MockSettings {
                name: "unit".into(),
                chunks: 3,
                chunk_interval: Duration::from_millis(1),
                stamp_chunks: false,
            })
            .unwrap(),
        )
    }

    /// Serves `app` on an OS-chosen port of 127.0.0.1, one exchange per connection.
    async fn serve(app: Arc<MockApp>) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (_keep, shutdown) = tokio::sync::watch::channel(false);
            while let Ok((sock, _)) = listener.accept().await {
                let app = app.clone();
                let shutdown = shutdown.clone();
                tokio::spawn(async move {
                    let session = ServerSession::new_http1(Box::new(Stream::from(sock)));
                    let _ = app.process_new_http(session, &shutdown).await;
                });
            }
        });
        addr
    }

    /// Writes one request (`Connection: close`) and returns the open socket.
    async fn send(
        addr: std::net::SocketAddr,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> TcpStream {
        let mut sock = TcpStream::connect(addr).await.unwrap();
        let mut head = format!(
            "POST {path} HTTP/1.1\r\nHost: unit\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        sock.write_all(head.as_bytes()).await.unwrap();
        sock.write_all(body.as_bytes()).await.unwrap();
        sock
    }

    /// The status of a whole exchange (the mock closes after a `Connection: close`).
    async fn status(
        addr: std::net::SocketAddr,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> u16 {
        let mut sock = send(addr, path, headers, body).await;
        let mut out = Vec::new();
        tokio::time::timeout(IO_LIMIT, sock.read_to_end(&mut out))
            .await
            .expect("the mock answered in time")
            .unwrap();
        let text = String::from_utf8_lossy(&out);
        text.split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("no status line in {text:?}"))
    }

    /// Polls `cond` every 10 ms, at most `tries` times.
    async fn eventually(tries: u32, mut cond: impl FnMut() -> bool) -> bool {
        for _ in 0..tries {
            if cond() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        cond()
    }

    fn stat(app: &MockApp, key: &str) -> u64 {
        app.stats.to_json("unit", None)[key].as_u64().unwrap()
    }

    const CHAT: &str = "/v1/chat/completions";
    const MESSAGES: &str = "/v1/messages";

    #[tokio::test]
    async fn stamped_chunks_carry_their_write_time_in_a_comment_line() {
        let app = Arc::new(
            MockApp::new(MockSettings {
                name: "unit".into(),
                chunks: 3,
                chunk_interval: Duration::from_millis(1),
                stamp_chunks: true,
            })
            .unwrap(),
        );
        let addr = serve(app).await;
        let before = crate::clock::unix_us();
        let mut sock = send(addr, CHAT, &[], r#"{"model":"m","stream":true}"#).await;
        let mut out = Vec::new();
        tokio::time::timeout(IO_LIMIT, sock.read_to_end(&mut out))
            .await
            .expect("the mock answered in time")
            .unwrap();
        let after = crate::clock::unix_us();
        let text = String::from_utf8(out).unwrap();
        let stamps: Vec<u64> = text
            .split(": t=")
            .skip(1)
            .map(|rest| {
                let (digits, next) = rest.split_once('\n').expect("a stamp line ends");
                assert!(
                    next.starts_with("data: {"),
                    "a content event follows: {next:?}"
                );
                digits.parse().expect("a stamp is a number")
            })
            .collect();
        assert_eq!(stamps.len(), 3, "one stamp per content chunk: {text}");
        assert!(stamps.windows(2).all(|w| w[0] <= w[1]), "{stamps:?}");
        assert!(
            stamps.iter().all(|t| (before..=after).contains(t)),
            "{stamps:?}"
        );
        assert!(text.contains("data: [DONE]"), "{text}");
    }

    #[tokio::test]
    async fn header_fault_conditions_pick_the_request() {
        let addr = serve(app()).await;
        let by_key = [("x-mock-fault", "status=503;credential=key-1")];
        let body = r#"{"model":"m"}"#;
        let bearer = |k: &'static str| ("authorization", k);
        assert_eq!(
            status(addr, CHAT, &[by_key[0], bearer("Bearer key-1")], body).await,
            503
        );
        assert_eq!(
            status(addr, CHAT, &[by_key[0], bearer("Bearer key-2")], body).await,
            200,
            "a header fault for key-1 must not hit key-2"
        );
        assert_eq!(status(addr, CHAT, &by_key, body).await, 200);
        assert_eq!(
            status(addr, MESSAGES, &[by_key[0], ("x-api-key", "key-1")], body).await,
            503
        );
        assert_eq!(
            status(addr, MESSAGES, &[by_key[0], ("x-api-key", "key-2")], body).await,
            200
        );

        let by_model = [("x-mock-fault", "status=429;model=alpha")];
        assert_eq!(
            status(addr, CHAT, &by_model, r#"{"model":"alpha","stream":false}"#).await,
            429
        );
        assert_eq!(
            status(
                addr,
                CHAT,
                &by_model,
                r#"{"messages":[{"model":"alpha"}],"model":"beta"}"#
            )
            .await,
            200,
            "only the top-level model counts"
        );
    }

    #[tokio::test]
    async fn unmatched_header_fault_falls_back_to_the_process_fault() {
        let app = app();
        app.set_fault(Fault::parse("status=500").unwrap());
        let addr = serve(app.clone()).await;
        let other = [
            ("x-mock-fault", "status=429;credential=someone-else"),
            ("authorization", "Bearer key-1"),
        ];
        assert_eq!(status(addr, CHAT, &other, r#"{"model":"m"}"#).await, 500);
        // A matching header still overrides the process fault, even an empty one.
        let own = [
            ("x-mock-fault", "latency=1ms;credential=key-1"),
            ("authorization", "Bearer key-1"),
        ];
        assert_eq!(status(addr, CHAT, &own, r#"{"model":"m"}"#).await, 200);
    }

    #[tokio::test]
    async fn process_fault_conditions_see_both_families() {
        let app = app();
        app.set_fault(Fault::parse("status=500;credential=key-1").unwrap());
        let addr = serve(app.clone()).await;
        let body = r#"{"model":"m","max_tokens":1}"#;
        // Anthropic family: x-api-key, whatever else sits in Authorization.
        for auth in ["", "Basic cHJveHk6cGFzcw==", "Bearer"] {
            assert_eq!(
                status(
                    addr,
                    MESSAGES,
                    &[("authorization", auth), ("x-api-key", "key-1")],
                    body
                )
                .await,
                500,
                "x-api-key key-1 beside Authorization {auth:?}"
            );
        }
        assert_eq!(
            status(addr, MESSAGES, &[("x-api-key", "key-2")], body).await,
            200
        );
        // OpenAI family: the Bearer token, any case, any blank after the scheme.
        for auth in ["Bearer key-1", "bearer\tkey-1", "BEARER   key-1 "] {
            assert_eq!(
                status(addr, CHAT, &[("authorization", auth)], body).await,
                500,
                "{auth:?}"
            );
        }
        let counted = app.stats.to_json("unit", None)["by_credential"]["key-1"].clone();
        assert_eq!(counted, 6);

        app.set_fault(Fault::parse("status=404;model=up-alpha").unwrap());
        for (body, want) in [
            (r#"{"model":"up-alpha"}"#, 404),
            (r#"{"model":"up\u002dalpha","stream":false}"#, 404),
            (r#"{"model":"other","model":"up-alpha"}"#, 404),
            (r#"{"model":"up-beta"}"#, 200),
            (r#"{"model":"up-alpha-2"}"#, 200),
        ] {
            assert_eq!(status(addr, CHAT, &[], body).await, want, "{body}");
        }
    }

    /// A delay fault whose client leaves 200 ms in is dropped at once, not slept out.
    async fn delay_is_abandoned_when_the_client_leaves(spec: &'static str) {
        let app = app();
        let addr = serve(app.clone()).await;
        let sock = send(addr, CHAT, &[("x-mock-fault", spec)], r#"{"model":"m"}"#).await;
        assert!(eventually(500, || stat(&app, "inflight") == 1).await);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(stat(&app, "requests_abandoned"), 0);
        drop(sock);
        assert!(
            eventually(100, || stat(&app, "requests_abandoned") == 1
                && stat(&app, "inflight") == 0)
            .await,
            "{spec}: still waiting 1 s after the client left: {}",
            app.stats.to_json("unit", None)
        );
        assert_eq!(stat(&app, "streams_aborted"), 0);
    }

    #[tokio::test]
    async fn latency_gives_up_when_the_client_leaves() {
        delay_is_abandoned_when_the_client_leaves("latency=30s").await;
    }

    #[tokio::test]
    async fn first_byte_delay_gives_up_when_the_client_leaves() {
        delay_is_abandoned_when_the_client_leaves("first_byte_delay=30s;status=500").await;
    }

    #[tokio::test]
    async fn stall_and_chunk_interval_give_up_when_the_client_leaves() {
        let app = app();
        let addr = serve(app.clone()).await;
        let body = r#"{"model":"m","stream":true}"#;
        for (n, spec) in ["chunks=5;chunk_interval=30s", "stall_after=1"]
            .into_iter()
            .enumerate()
        {
            let mut sock = send(addr, CHAT, &[("x-mock-fault", spec)], body).await;
            let mut first = [0u8; 64];
            let got = tokio::time::timeout(IO_LIMIT, sock.read(&mut first))
                .await
                .unwrap()
                .unwrap();
            assert!(got > 0, "{spec}: the stream started");
            drop(sock);
            assert!(
                eventually(100, || stat(&app, "streams_aborted") == n as u64 + 1
                    && stat(&app, "inflight") == 0)
                .await,
                "{spec}: {}",
                app.stats.to_json("unit", None)
            );
        }
        assert_eq!(stat(&app, "requests_abandoned"), 0);
    }

    #[tokio::test]
    async fn a_delay_the_client_waits_out_still_answers() {
        let app = app();
        let addr = serve(app.clone()).await;
        let spec = [("x-mock-fault", "latency=50ms;first_byte_delay=50ms")];
        assert_eq!(status(addr, CHAT, &spec, r#"{"model":"m"}"#).await, 200);
        assert_eq!(stat(&app, "requests_abandoned"), 0);
    }
}
