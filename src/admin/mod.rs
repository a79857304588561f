//! The admin listener (SPEC §8): health, readiness, metrics and the `/api/*` routes.
//!
//! `/health`, `/ready` and `/metrics` need no token (unless `admin.protect_metrics`);
//! every `/api/*` call needs `Authorization: Bearer <admin token>`, compared through
//! SHA-256 digests so the comparison time does not depend on where the strings differ.
//! With no token configured every `/api/*` call answers 401. Responses never contain
//! credentials: connections are listed by id only.

use crate::engine::Engine;
use async_trait::async_trait;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::sync::Arc;

pub struct AdminApp {
    engine: Arc<Engine>,
}

impl AdminApp {
    pub fn new(engine: Arc<Engine>) -> Self {
        Self { engine }
    }

    fn authorized(&self, session: &ServerSession) -> bool {
        let snap = self.engine.snapshot();
        let Some(token) = &snap.config.admin.token else {
            return false;
        };
        let presented = session
            .req_header()
            .headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        Sha256::digest(presented.as_bytes()) == Sha256::digest(token.expose().as_bytes())
    }

    fn config_status(&self) -> Value {
        let snap = self.engine.snapshot();
        let c = &snap.config;
        json!({
            "source": c.source.display().to_string(),
            "providers": c.providers.iter().map(|p| json!({
                "id": p.id,
                "api": p.api.as_str(),
                "class": p.class.as_str(),
                "base_url": format!("{}://{}{}", if p.base_url.tls { "https" } else { "http" }, p.base_url.authority(), p.base_url.path_prefix),
                "connections": p.connections.iter().map(|c| json!({
                    "id": c.id,
                    "credential": if c.key.is_some() { "set" } else { "none" },
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "models": c.models.iter().map(|m| json!({
                "name": m.name,
                "strategy": m.strategy.as_str(),
                "targets": m.targets.iter().map(|t| json!({
                    "provider": c.providers[t.provider].id,
                    "model": t.model,
                    "connection": t.connection.map(|ci| c.providers[t.provider].connections[ci].id.clone()),
                    "weight": t.weight,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "clients": c.clients.as_ref().map(|cl| cl.iter().map(|x| x.id.clone()).collect::<Vec<_>>()),
            "max_attempts": c.server.max_attempts,
            "max_body_bytes": c.server.max_body_bytes,
        })
    }
}

fn respond(status: u16, content_type: &str, body: Vec<u8>) -> Response<Vec<u8>> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .header("content-length", body.len())
        .body(body)
        .unwrap_or_else(|_| Response::new(Vec::new()))
}

fn json_response(status: u16, v: Value) -> Response<Vec<u8>> {
    respond(
        status,
        "application/json",
        serde_json::to_vec(&v).unwrap_or_default(),
    )
}

fn error(status: u16, code: &str, message: &str) -> Response<Vec<u8>> {
    json_response(status, json!({"error": {"code": code, "message": message}}))
}

#[async_trait]
impl ServeHttp for AdminApp {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        // Admin bodies are small JSON documents; drain whatever was sent.
        let _ = session.drain_request_body().await;
        let method = session.req_header().method.as_str().to_string();
        let path = session.req_header().uri.path().to_string();
        match (method.as_str(), path.as_str()) {
            ("GET", "/health") => json_response(200, json!({"status": "ok"})),
            ("GET", "/ready") => json_response(200, json!({"ready": true, "config": "loaded"})),
            ("GET", "/metrics") => {
                let protect = self.engine.snapshot().config.admin.protect_metrics;
                if protect && !self.authorized(session) {
                    return error(401, "unauthorized", "admin token required");
                }
                respond(
                    200,
                    "text/plain; version=0.0.4",
                    self.engine.metrics.render(),
                )
            }
            (_, p) if p.starts_with("/api/") => {
                if !self.authorized(session) {
                    return error(401, "unauthorized", "missing or wrong admin token");
                }
                match (method.as_str(), p) {
                    ("GET", "/api/config") => json_response(200, self.config_status()),
                    _ => error(404, "not_found", &format!("no admin route {method} {p}")),
                }
            }
            _ => error(404, "not_found", &format!("no admin route {method} {path}")),
        }
    }
}
