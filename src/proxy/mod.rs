//! Pingora glue for the client listener: the gateway is Pingora's `HttpServerApp`.
//!
//! Each request of a client connection is one `process_new_http` call: the header is
//! read (or the connection ends at shutdown), `answer` runs the admit phase (auth,
//! size, JSON, model) and hands the request to `pipeline`, which runs the attempts and
//! writes a complete response — or asks for the client connection to be cut when a
//! committed body failed, which `failed` then does without writing a byte. The finish
//! phase (`finish::record`) runs exactly once per request, whatever happened, and the
//! connection is offered back for its next request only after a clean answer. A
//! connection waiting for its next request ends when the server shuts down.
//!
//! The gateway answers every route itself, so it skips pingora-proxy's per-request
//! session (cache, modules, the upstream proxy state machine) and its cost. The glue
//! stays thin; the decisions live in `policy::failover`, `engine` and `routing`.

pub mod access;
pub mod admit;
pub mod attempt;
pub mod body;
pub mod ctx;
pub mod finish;
pub mod framing;
pub mod leases;
pub mod pipeline;
pub mod pool;
pub mod queue;
pub mod resolve;
pub mod respond;
pub mod routes;
pub mod stream;
pub mod subscription;
pub mod transport;
pub mod upstream;
pub mod watch;

use crate::clock::monotonic;
use crate::codes::ErrorCode;
use crate::config::Family;
use crate::engine::Engine;
use crate::error::ClientError;
use crate::server::frontdoor;
use access::AccessLog;
use async_trait::async_trait;
use ctx::Request;
pub use ctx::RequestCtx;
use pingora::apps::{HttpPersistentSettings, HttpServerApp, ReusedHttpStream};
use pingora::protocols::http::ServerSession;
use pingora::server::ShutdownWatch;
use routes::Route;
use serde_json::json;
use std::borrow::Cow;
use std::sync::Arc;

/// The client-facing gateway service.
pub struct Gateway {
    pub engine: Arc<Engine>,
    access: AccessLog,
}

/// Resolves once the server shuts down (never, if its watch is gone). The watch's
/// waiters are sharded by tokio, so connections waiting on it do not share one lock.
async fn until_shutdown(shutdown: &ShutdownWatch) {
    let mut stopping = shutdown.clone();
    if stopping.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}

impl Gateway {
    pub fn new(engine: Arc<Engine>, access: AccessLog) -> Self {
        Self { engine, access }
    }

    /// Reads the next request's header: false when there is none to answer (the client
    /// closed, the server is shutting down, or the header was refused and answered).
    async fn read_request(&self, session: &mut ServerSession, shutdown: &ShutdownWatch) -> bool {
        let read = tokio::select! {
            // A request already buffered is answered, not dropped.
            biased;
            r = session.read_request() => r,
            _ = until_shutdown(shutdown) => return false,
        };
        let refused = match read {
            Ok(true) if session.req_header().method != http::Method::CONNECT => return true,
            Ok(true) => 405,
            Ok(false) => return false,
            Err(e) if matches!(e.etype(), pingora::ErrorType::InvalidHTTPHeader) => 400,
            Err(e) => {
                // A cut by the connection's header guard, or a broken connection.
                tracing::error!(error = %e, "client request not read; connection closed");
                session.shutdown().await;
                return false;
            }
        };
        // Written before the gateway saw a request: the connection's wrapper turns it
        // into the JSON error. CONNECT would change the message framing: not served.
        let _ = session.respond_error(refused).await;
        session.shutdown().await;
        false
    }

    /// Answers one request completely: a response written, or an error when the client
    /// went away or the connection must be cut.
    async fn answer(
        &self,
        session: &mut ServerSession,
        ctx: &mut RequestCtx,
    ) -> pingora::Result<()> {
        let found = {
            let h = session.req_header();
            Route::from_request(h.method.as_str(), h.uri.path())
        };
        let Some(route) = found else {
            // Owned copies only on this path: the session is lent to the answer.
            let h = session.req_header();
            let (method, path) = (h.method.as_str().to_string(), h.uri.path().to_string());
            return self.no_route(session, ctx, &method, &path).await;
        };
        ctx.route = Some(route);
        let family = route.family();
        let snap = self.engine.snapshot();
        let client = match admit::client(&snap, session) {
            Ok(c) => c,
            Err(e) => return self.reject(session, ctx, family, e).await,
        };
        ctx.client_id = client.map(|c| c.id.clone());
        match route {
            Route::Models => return self.models(session, ctx).await,
            Route::SessionLeases => {
                return leases::handle(&self.engine, &snap, session, client, ctx).await
            }
            _ => {}
        }
        let a = match admit::admit(&self.engine, &snap, session, family, client).await {
            Ok(a) => a,
            Err(e) => return self.reject(session, ctx, family, e).await,
        };
        ctx.model_label = Cow::Owned(snap.config.models[a.model].name.clone());

        // select → connect → response → stream, per attempt
        let header = session.req_header().clone();
        let request = Request {
            engine: &self.engine,
            snap: &snap,
            model: a.model,
            route,
            family,
            client,
            body: a.body,
            header: &header,
            lease: a.lease,
            pin_key: a.pin_key,
        };
        pipeline::run(session, request, ctx).await
    }

    /// A request that ended in an error. A response already (partly) written is never
    /// followed by an error page: a cut connection is dropped as it is, without a
    /// terminating chunk (SPEC §2 stream). Otherwise Pingora's error page answers.
    async fn failed(&self, session: &mut ServerSession, e: &pingora::Error, ctx: &RequestCtx) {
        if ctx.cut {
            // Deliberate: the access line records it.
            return;
        }
        let code = if session.response_written().is_some() {
            0
        } else {
            let code = match e.etype() {
                pingora::ErrorType::HTTPStatus(code) => *code,
                _ if e.esource() == &pingora::ErrorSource::Downstream => 400,
                _ => 500,
            };
            let _ = session.respond_error(code).await;
            code
        };
        tracing::error!(error = %e, status = code, request = %session.request_summary(), "request failed");
    }

    async fn reject(
        &self,
        session: &mut ServerSession,
        ctx: &mut RequestCtx,
        family: Family,
        e: ClientError,
    ) -> pingora::Result<()> {
        ctx.status = e.status();
        ctx.note = Some(e.code.as_str());
        respond::write_error(session, family, &e, Vec::new()).await
    }

    /// 405 (with `Allow`) for a route's path under another method, else 404.
    async fn no_route(
        &self,
        session: &mut ServerSession,
        ctx: &mut RequestCtx,
        method: &str,
        path: &str,
    ) -> pingora::Result<()> {
        let path = routes::normalize(path);
        let Some(route) = Route::by_path(&path) else {
            let e = ClientError::new(
                ErrorCode::RouteNotFound,
                format!("no route for {method} {path}"),
            );
            return self.reject(session, ctx, Family::OpenAi, e).await;
        };
        let e = ClientError::new(
            ErrorCode::MethodNotAllowed,
            format!("{path} takes {}, not {method}", route.method()),
        );
        ctx.status = e.status();
        ctx.note = Some(e.code.as_str());
        let allow = vec![("allow", route.method().to_string())];
        respond::write_error(session, route.family(), &e, allow).await
    }

    async fn models(
        &self,
        session: &mut ServerSession,
        ctx: &mut RequestCtx,
    ) -> pingora::Result<()> {
        let snap = self.engine.snapshot();
        let data: Vec<_> = snap
            .config
            .models
            .iter()
            // Patterns are not model ids a client could list and pick.
            .filter(|m| !m.is_pattern())
            .map(|m| json!({"id": m.name, "object": "model", "created": 0, "owned_by": "sluice"}))
            .collect();
        let body = serde_json::to_vec(&json!({"object": "list", "data": data})).unwrap_or_default();
        ctx.status = 200;
        respond::write_local(session, 200, "application/json", &[], body).await
    }
}

#[async_trait]
impl HttpServerApp for Gateway {
    async fn process_new_http(
        self: &Arc<Self>,
        mut session: ServerSession,
        shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        if !self.read_request(&mut session, shutdown).await {
            return None;
        }
        if *shutdown.borrow() {
            session.set_keepalive(None);
        }
        let mut ctx = RequestCtx::new(monotonic());
        ctx.active = Some(self.engine.lifecycle.enter());
        // The header is in: the connection's header guard stands down for this request.
        frontdoor::header_done(&session);
        let error = self.answer(&mut session, &mut ctx).await.err();
        if let Some(e) = &error {
            self.failed(&mut session, e, &ctx).await;
        }
        finish::record(&self.engine, &self.access, &session, error.as_deref(), &ctx);
        if error.is_some() {
            // The connection closes before the request stops counting as in flight.
            drop(session);
            drop(ctx);
            return None;
        }
        let settings = HttpPersistentSettings::for_session(&session);
        let reusable = session.finish().await.ok().flatten()?;
        Some(ReusedHttpStream::from_reusable_stream(reusable, settings))
    }
}
