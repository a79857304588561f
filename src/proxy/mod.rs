//! The gateway: each client connection's requests, answered one after the other.
//!
//! Each request is read by the connection (`server::conn`), then `answer` runs the
//! admit phase (auth, size, JSON, model) and hands it to `pipeline`, which runs the
//! attempts and writes a complete response — or stops with [`Stop::Cut`] when a
//! committed body failed, and the connection is then dropped without another byte. The
//! finish phase (`finish::record`) runs exactly once per request, whatever happened,
//! and the connection carries the next request only after a clean answer.
//!
//! The glue stays thin; the decisions live in `policy::failover`, `engine` and
//! `routing`, the HTTP/1 work in `http1` and `server::conn`.

pub mod access;
pub mod admit;
pub mod attempt;
pub mod body;
pub mod bodyscan;
pub mod ctx;
pub mod finish;
pub mod framing;
pub mod h1;
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
pub mod upconn;
pub mod upstream;
pub mod watch;

use crate::clock::monotonic;
use crate::codes::ErrorCode;
use crate::config::Family;
use crate::engine::{Engine, Snapshot};
use crate::error::ClientError;
use crate::http1::RequestHead;
use crate::server::conn::{ClientConn, Incoming};
use crate::server::frontdoor::ConnApp;
use crate::server::lifecycle::Active;
use access::AccessLog;
use ctx::Request;
pub use ctx::RequestCtx;
use routes::Route;
use serde_json::json;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

/// The client-facing gateway service.
pub struct Gateway {
    pub engine: Arc<Engine>,
    access: AccessLog,
}

/// Why an answer stopped short; the client connection then closes.
#[derive(Debug)]
pub enum Stop {
    /// A committed body failed: the connection is cut on purpose, so the client cannot
    /// take what it got for a complete answer (SPEC §2 stream).
    Cut,
    /// The client connection failed while the answer was being written.
    Client(std::io::Error),
}

impl Stop {
    /// The access log's `error` word.
    pub fn label(&self) -> &'static str {
        match self {
            Stop::Cut => "sluice_cut",
            Stop::Client(_) => "WriteError",
        }
    }
}

impl From<std::io::Error> for Stop {
    fn from(e: std::io::Error) -> Stop {
        Stop::Client(e)
    }
}

/// An answer: complete, or stopped short.
pub type Answered = Result<(), Stop>;

/// A step of the request path that a proxied request seldom takes (a refusal, a queue or
/// combo wait, a local answer), run behind a pointer: its state is not part of the
/// connection task, and its code is not inlined into the hot path's state machines,
/// which then touch fewer cache lines per request (bench/RESULTS.md, 2026-12-07). The
/// box is paid only on the rare path.
pub(crate) fn rare<'a, T>(
    f: impl Future<Output = T> + Send + 'a,
) -> Pin<Box<dyn Future<Output = T> + Send + 'a>> {
    Box::pin(f)
}

impl Gateway {
    pub fn new(engine: Arc<Engine>, access: AccessLog) -> Self {
        Self { engine, access }
    }

    /// Answers one request completely: a response written, or a [`Stop`].
    async fn answer<'s>(
        &self,
        conn: &mut ClientConn,
        head: &RequestHead,
        snap: &'s Snapshot,
        ctx: &mut RequestCtx<'s>,
    ) -> Answered {
        let Some(route) = Route::from_request(head.method(), head.path()) else {
            return rare(self.no_route(conn, ctx, head.method(), head.path())).await;
        };
        ctx.route = Some(route);
        let family = route.family();
        ctx.snap = Some(snap);
        let client = match admit::client(snap, head) {
            Ok(c) => c,
            Err(e) => return rare(self.reject(conn, ctx, family, e)).await,
        };
        ctx.client_id = client.map(|c| c.id.clone());
        match route {
            Route::Models => return rare(self.models(conn, ctx)).await,
            Route::SessionLeases => {
                return rare(leases::handle(&self.engine, snap, conn, client, ctx)).await
            }
            _ => {}
        }
        let a = match admit::admit(&self.engine, snap, conn, head, family, client).await {
            Ok(a) => a,
            Err(e) => return rare(self.reject(conn, ctx, family, e)).await,
        };
        ctx.model = Some(a.model);
        if snap.config.models[a.model].is_pattern() {
            ctx.asked = Some(a.body.model.clone());
        }

        // select → connect → response → stream, per attempt
        let mut driver = pipeline::Driver::new(
            Request {
                engine: &self.engine,
                snap,
                model: a.model,
                route,
                family,
                client,
                body: a.body,
                header: head,
                lease: a.lease,
                pin_key: a.pin_key,
            },
            ctx,
        );
        pipeline::run(conn, &mut driver, ctx).await
    }

    async fn reject(
        &self,
        conn: &mut ClientConn,
        ctx: &mut RequestCtx<'_>,
        family: Family,
        e: ClientError,
    ) -> Answered {
        ctx.status = e.status();
        ctx.note = Some(e.code.as_str());
        respond::write_error(conn, family, &e, Vec::new()).await
    }

    /// 405 (with `Allow`) for a route's path under another method, else 404.
    async fn no_route(
        &self,
        conn: &mut ClientConn,
        ctx: &mut RequestCtx<'_>,
        method: &str,
        path: &str,
    ) -> Answered {
        let path = routes::normalize(path);
        let Some(route) = Route::by_path(&path) else {
            let e = ClientError::new(
                ErrorCode::RouteNotFound,
                format!("no route for {method} {path}"),
            );
            return self.reject(conn, ctx, Family::OpenAi, e).await;
        };
        let e = ClientError::new(
            ErrorCode::MethodNotAllowed,
            format!("{path} takes {}, not {method}", route.method()),
        );
        ctx.status = e.status();
        ctx.note = Some(e.code.as_str());
        let allow = vec![("allow", route.method().to_string())];
        respond::write_error(conn, route.family(), &e, allow).await
    }

    async fn models(&self, conn: &mut ClientConn, ctx: &mut RequestCtx<'_>) -> Answered {
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
        respond::write_local(conn, 200, "application/json", &[], &body).await
    }

    /// Serves one client connection's requests until it closes or may not carry more.
    async fn serve_conn(&self, mut conn: ClientConn, arriving: Active) {
        let mut arriving = Some(arriving);
        while let Incoming::Request(head) = conn.next_request().await {
            let snap = self.engine.snapshot();
            let mut ctx = RequestCtx::new(monotonic());
            ctx.active = Some(self.engine.lifecycle.enter());
            drop(arriving.take());
            let stop = self.answer(&mut conn, &head, &snap, &mut ctx).await.err();
            match &stop {
                // Deliberate: the access line records it.
                Some(Stop::Cut) | None => {}
                Some(Stop::Client(e)) => {
                    tracing::info!(error = %e, method = head.method(), path = head.path(),
                        "client connection failed while it was answered");
                }
            }
            finish::record(
                &self.engine,
                &self.access,
                &head,
                conn.body_sent(),
                stop.as_ref(),
                &ctx,
            );
            if stop.is_some() || !conn.reusable() {
                // The connection closes before the request stops counting as in flight.
                // A cut, or a client that failed while it was answered: an answer not
                // written whole is never closed as if it were complete.
                match stop {
                    None | Some(Stop::Client(_)) => conn.close().await,
                    Some(Stop::Cut) => conn.abort().await,
                }
                drop(ctx);
                return;
            }
        }
    }
}

impl ConnApp for Gateway {
    async fn serve(self: Arc<Self>, conn: ClientConn, arriving: Active) {
        self.serve_conn(conn, arriving).await
    }
}
