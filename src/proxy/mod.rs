//! Pingora glue for the client listener: the `ProxyHttp` implementation.
//!
//! `request_filter` is the admit phase (auth, size, JSON, model) and then hands the
//! request to `dispatch`, which runs the attempts and always writes a complete response,
//! so `upstream_peer` is never reached. `logging` is the finish phase: it runs exactly
//! once per request and records metrics and the access log line. Hooks stay thin; the
//! decisions live in `engine`, `routing` and `dispatch`.

pub mod admit;
pub mod attempt;
pub mod body;
pub mod dispatch;
pub mod leases;
pub mod resolve;
pub mod respond;
pub mod routes;
pub mod sse;
pub mod upstream;
pub mod waits;

use crate::codes::ErrorCode;
use crate::config::Family;
use crate::engine::Engine;
use crate::error::ClientError;
use async_trait::async_trait;
use pingora::prelude::HttpPeer;
use pingora::proxy::{ProxyHttp, Session};
use routes::Route;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Per-request state, created by `new_ctx` and finished by `logging`.
pub struct RequestCtx {
    pub started: Instant,
    pub route: Option<Route>,
    /// Configured model name, or `unknown` (bounded label).
    pub model_label: String,
    pub client_id: Option<String>,
    pub status: u16,
    pub attempts: u32,
    /// (provider, connection, upstream model) of the last attempt.
    pub pick: Option<(String, String, String)>,
    pub ttfb: Option<Duration>,
    pub records: Vec<dispatch::AttemptRecord>,
    /// Error code or abort reason worth logging.
    pub note: Option<&'static str>,
}

/// The client-facing gateway service.
pub struct Gateway {
    pub engine: Arc<Engine>,
}

impl Gateway {
    pub fn new(engine: Arc<Engine>) -> Self {
        Self { engine }
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

    async fn models(&self, session: &mut Session, ctx: &mut RequestCtx) -> pingora::Result<bool> {
        let snap = self.engine.snapshot();
        let data: Vec<_> = snap
            .config
            .models
            .iter()
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
        RequestCtx {
            started: Instant::now(),
            route: None,
            model_label: "unknown".into(),
            client_id: None,
            status: 0,
            attempts: 0,
            pick: None,
            ttfb: None,
            records: Vec::new(),
            note: None,
        }
    }

    async fn request_filter(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> pingora::Result<bool> {
        let (method, path) = {
            let h = session.req_header();
            (h.method.as_str().to_string(), h.uri.path().to_string())
        };
        let Some(route) = Route::from_request(&method, &path) else {
            let e = ClientError::new(
                ErrorCode::RouteNotFound,
                format!("no route for {method} {path}"),
            );
            return self.reject(session, ctx, Family::OpenAi, e).await;
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
            Err(e) => {
                if e.code == ErrorCode::BodyTooLarge {
                    // The rest of an oversized body is not read: do not reuse the connection.
                    session.downstream_session.set_keepalive(None);
                }
                return self.reject(session, ctx, family, e).await;
            }
        };
        ctx.model_label = snap.config.models[a.model].name.clone();

        // select → connect → response → stream, per attempt
        let header = session.req_header().clone();
        let request = dispatch::Request {
            engine: &self.engine,
            snap: &snap,
            model: a.model,
            family,
            client,
            body: &a.body,
            header: &header,
            deadline: Instant::now() + snap.config.resilience.queue.execution_timeout,
            lease: a.lease,
            pin_key: a.pin_key,
            is_fallback: false,
        };
        dispatch::run(session, &request, ctx).await?;
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

    async fn logging(
        &self,
        _session: &mut Session,
        e: Option<&pingora::Error>,
        ctx: &mut RequestCtx,
    ) {
        let m = &self.engine.metrics;
        let route = ctx.route.map(Route::label).unwrap_or("unmatched");
        let status = if ctx.status == 0 && e.is_some() {
            499
        } else {
            ctx.status
        };
        m.requests_total
            .with_label_values(&[route, ctx.model_label.as_str(), &status.to_string()])
            .inc();
        let elapsed = ctx.started.elapsed();
        if ctx.route.is_some_and(|r| r != Route::Models) && ctx.model_label != "unknown" {
            m.request_duration_seconds
                .with_label_values(&[ctx.model_label.as_str()])
                .observe(elapsed.as_secs_f64());
            if let Some(t) = ctx.ttfb {
                m.ttfb_seconds
                    .with_label_values(&[ctx.model_label.as_str()])
                    .observe(t.as_secs_f64());
            }
        }
        let (provider, connection, upstream_model) = ctx.pick.clone().unwrap_or_default();
        let failed: Vec<String> = ctx
            .records
            .iter()
            .map(|a| {
                format!(
                    "{}/{}:{}",
                    a.provider,
                    a.connection,
                    a.status.map_or(a.reason.to_string(), |s| s.to_string())
                )
            })
            .collect();
        tracing::info!(
            target: "sluice::access",
            route,
            model = %ctx.model_label,
            client = ctx.client_id.as_deref().unwrap_or("-"),
            status,
            attempts = ctx.attempts,
            provider = %provider,
            connection = %connection,
            upstream_model = %upstream_model,
            failed = %failed.join(","),
            note = ctx.note.unwrap_or(""),
            ttfb_ms = ctx.ttfb.map(|t| t.as_millis() as u64).unwrap_or(0),
            duration_ms = elapsed.as_millis() as u64,
            error = e.map(|e| e.etype().as_str()).unwrap_or(""),
            "request"
        );
    }
}
