//! Pingora glue for the client listener: the `ProxyHttp` implementation.
//!
//! `request_filter` is the admit phase (auth, size, JSON, model) and then hands the
//! request to `pipeline`, which runs the attempts and writes a complete response — or
//! asks for the client connection to be cut when a committed body failed, which
//! `fail_to_proxy` then does without writing a byte — so `upstream_peer` is never
//! reached. `logging` is the finish phase: it runs exactly once per request and records
//! metrics and the access log line. Hooks stay thin; the decisions live in
//! `policy::failover`, `engine` and `routing`.

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
use access::AccessLog;
use async_trait::async_trait;
use ctx::Request;
pub use ctx::RequestCtx;
use pingora::prelude::HttpPeer;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use routes::Route;
use serde_json::json;
use std::sync::Arc;

/// The client-facing gateway service.
pub struct Gateway {
    pub engine: Arc<Engine>,
    access: AccessLog,
}

impl Gateway {
    pub fn new(engine: Arc<Engine>, access: AccessLog) -> Self {
        Self { engine, access }
    }

    async fn reject(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        family: Family,
        e: ClientError,
    ) -> pingora::Result<bool> {
        ctx.status = e.status();
        ctx.note = Some(e.code.as_str());
        respond::write_error(session, family, &e, Vec::new()).await?;
        Ok(true)
    }

    /// 405 (with `Allow`) for a route's path under another method, else 404.
    async fn no_route(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        method: &str,
        path: &str,
    ) -> pingora::Result<bool> {
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
        respond::write_error(session, route.family(), &e, allow).await?;
        Ok(true)
    }

    async fn models(&self, session: &mut Session, ctx: &mut RequestCtx) -> pingora::Result<bool> {
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
        respond::write_local(session, 200, "application/json", &[], body).await?;
        Ok(true)
    }
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = RequestCtx;

    fn new_ctx(&self) -> RequestCtx {
        let mut ctx = RequestCtx::new(monotonic());
        ctx.active = Some(self.engine.lifecycle.enter());
        ctx
    }

    /// The header is in: the connection's header guard stands down for this request.
    async fn early_request_filter(
        &self,
        session: &mut Session,
        _ctx: &mut RequestCtx,
    ) -> pingora::Result<()> {
        crate::server::frontdoor::header_done(&session.downstream_session);
        Ok(())
    }

    async fn request_filter(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> pingora::Result<bool> {
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
        ctx.model_label = snap.config.models[a.model].name.clone();

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
        pipeline::run(session, request, ctx).await?;
        Ok(true)
    }

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        _ctx: &mut RequestCtx,
    ) -> pingora::Result<Box<HttpPeer>> {
        // Every route is answered in request_filter; reaching here is a bug.
        pingora::Error::e_explain(
            pingora::ErrorType::InternalError,
            "sluice dispatches in request_filter",
        )
    }

    /// A response already (partly) written is never followed by an error page: a cut
    /// connection is dropped as it is, without a terminating chunk (SPEC §2 stream).
    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &pingora::Error,
        ctx: &mut RequestCtx,
    ) -> FailToProxy {
        if ctx.cut || session.response_written().is_some() {
            return FailToProxy {
                error_code: 0,
                can_reuse_downstream: false,
            };
        }
        let code = match e.etype() {
            pingora::ErrorType::HTTPStatus(code) => *code,
            _ if e.esource() == &pingora::ErrorSource::Downstream => 400,
            _ => 500,
        };
        let _ = session.respond_error(code).await;
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    /// A deliberate cut is recorded in the access line, not logged as a proxy error.
    fn suppress_error_log(
        &self,
        _session: &Session,
        ctx: &RequestCtx,
        _e: &pingora::Error,
    ) -> bool {
        ctx.cut
    }

    async fn logging(
        &self,
        session: &mut Session,
        e: Option<&pingora::Error>,
        ctx: &mut RequestCtx,
    ) {
        finish::record(&self.engine, &self.access, session, e, ctx);
    }
}
