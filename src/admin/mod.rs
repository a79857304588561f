//! The admin listener (SPEC §8): health, readiness, metrics and the `/api/*` routes.
//!
//! `/health`, `/ready` and `/metrics` need no token (unless `admin.protect_metrics`);
//! every `/api/*` call needs `Authorization: Bearer <admin token>`, compared through
//! SHA-256 digests so the comparison time does not depend on where the strings differ.
//! With no token configured every `/api/*` call answers 401. Responses never contain
//! credentials: connections are listed by id only.

pub mod resilience;

use crate::engine::Engine;
use crate::error::AdminError;
use async_trait::async_trait;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::sync::Arc;

/// Admin request bodies are small JSON documents.
const MAX_ADMIN_BODY: usize = 64 * 1024;

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
            "generation": snap.generation,
            "last_reload": self.engine.reload.status(),
            "rules": {
                "dir": c.rules_dir.display().to_string(),
                "restatement": snap.rules.restatement_count(),
                "classification": snap.rules.classification_count(),
            },
            "providers": c.providers.iter().map(|p| json!({
                "id": p.id,
                "api": p.api.as_str(),
                "class": p.class.as_str(),
                "base_url": format!("{}://{}{}", if p.base_url.tls { "https" } else { "http" }, p.base_url.authority(), p.base_url.path_prefix),
                "connections": p.connections.iter().map(|c| json!({
                    "id": c.id,
                    "credential": if c.key.is_some() { "set" } else { "none" },
                    "bucket": c.bucket,
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

    async fn api(&self, method: &str, path: &str, query: &str, body: &[u8]) -> Response<Vec<u8>> {
        use resilience as r;
        let e = &self.engine;
        let result: Result<Value, AdminError> = match (method, path) {
            ("GET", "/api/config") => Ok(self.config_status()),
            ("POST", "/api/config/reload") => match e.reload_now("admin") {
                Ok(generation) => Ok(
                    json!({"ok": true, "generation": generation, "last_reload": e.reload.status()}),
                ),
                Err(error) => Err(AdminError::Rejected(error)),
            },
            ("GET", "/api/monitoring/health") => Ok(r::health(e)),
            ("GET", "/api/resilience") => Ok(r::settings(e)),
            ("PATCH", "/api/resilience") => r::patch_settings(e, body).await,
            ("POST", "/api/resilience/reset") => r::reset(e, body).await,
            ("GET", "/api/resilience/cooldowns") => {
                Ok(r::cooldowns(e, query_param(query, "provider").as_deref()))
            }
            ("POST", "/api/resilience/cooldowns") => r::clear_cooldowns(e, body).await,
            ("GET", "/api/resilience/model-cooldowns") => Ok(r::model_cooldowns(e)),
            ("DELETE", "/api/resilience/model-cooldowns") => {
                r::delete_model_cooldown(e, body).await
            }
            ("GET", "/api/routes/explain") => match query_param(query, "model") {
                None => Err(AdminError::BadRequest("give ?model=NAME".into())),
                Some(m) => e
                    .explain(&m)
                    .ok_or_else(|| AdminError::NotFound(format!("unknown model {m:?}"))),
            },
            _ => Err(AdminError::NotFound(format!(
                "no admin route {method} {path}"
            ))),
        };
        match result {
            Ok(v) => json_response(200, v),
            Err(err) => {
                let mut resp = error(err.status(), err.code(), &err.to_string());
                if matches!(err, AdminError::NotPersisted(_)) {
                    resp.headers_mut()
                        .insert("retry-after", http::HeaderValue::from_static("1"));
                }
                resp
            }
        }
    }
}

/// `GET /ready` (SPEC §8): ready while the state store is open. An engine always serves
/// a validated config generation (it cannot be built without one, and a failed reload
/// keeps the last good one, shown as `last_reload_ok: false`). A store whose commits
/// fail still serves from memory, so it is reported (`store: "failing"`) without taking
/// the node out of rotation; a stopped writer is not ready. `reasons` names what is wrong.
fn readiness(engine: &Engine) -> (bool, Value) {
    let snap = engine.snapshot();
    let last = engine.reload.status();
    let mut reasons: Vec<String> = Vec::new();
    if engine.lifecycle.is_draining() {
        reasons.push("draining: the process is shutting down or handing over".into());
    }
    let store = match &engine.store {
        None => json!({"state": "memory"}),
        Some(w) => {
            let h = w.health();
            let state = if h.closed {
                reasons.push("the state store writer has stopped".into());
                "closed"
            } else if h.consecutive_failures > 0 {
                "failing"
            } else {
                "open"
            };
            json!({
                "state": state,
                "consecutive_failures": h.consecutive_failures,
                "failed_commits": h.failed_commits,
            })
        }
    };
    let ready = reasons.is_empty();
    let details = json!({
        "ready": ready,
        "draining": engine.lifecycle.is_draining(),
        "reasons": reasons,
        "config": {
            "generation": snap.generation,
            "last_reload_ok": last.ok,
        },
        "store": store,
        // A shared backend that does not answer does not take the node out of rotation:
        // it serves on its local view (SPEC §7.1).
        "state_backend": state_backend(engine),
    });
    (ready, details)
}

/// `{"kind": "redb"}` or `{"kind": "redis", "reachable": bool, ...}` with the live node
/// count and how cluster-wide caps are kept (`cluster`, `share`, `recovering`).
pub fn state_backend(engine: &Engine) -> Value {
    match engine.shared_state.get() {
        None => json!({"kind": "redb"}),
        Some(up) => {
            let cluster = engine.cluster.get();
            json!({
                "kind": "redis",
                "reachable": up.load(std::sync::atomic::Ordering::Relaxed),
                "errors": engine.metrics.state_backend_errors_total.get(),
                "live_nodes": cluster.map(|c| c.live_nodes()),
                "caps": cluster.map(|c| c.caps_mode()),
            })
        }
    }
}

/// One query parameter, percent-decoded.
fn query_param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == name).then(|| percent_decode(v))
    })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16)
                {
                    Ok(v) => {
                        out.push(v);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
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

async fn read_body(session: &mut ServerSession) -> Result<Vec<u8>, String> {
    let mut buf = Vec::new();
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) => {
                if buf.len() + chunk.len() > MAX_ADMIN_BODY {
                    return Err(format!(
                        "admin request bodies are limited to {MAX_ADMIN_BODY} bytes"
                    ));
                }
                buf.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(buf),
            Err(e) => return Err(format!("cannot read the request body: {e}")),
        }
    }
}

#[async_trait]
impl ServeHttp for AdminApp {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let method = session.req_header().method.as_str().to_string();
        let path = session.req_header().uri.path().to_string();
        let query = session.req_header().uri.query().unwrap_or("").to_string();
        let body = match read_body(session).await {
            Ok(b) => b,
            Err(m) => return error(413, "body_too_large", &m),
        };
        match (method.as_str(), path.as_str()) {
            ("GET", "/health") => json_response(200, json!({"status": "ok"})),
            ("GET", "/ready") => {
                let (ready, details) = readiness(&self.engine);
                json_response(if ready { 200 } else { 503 }, details)
            }
            ("GET", "/metrics") => {
                let protect = self.engine.snapshot().config.admin.protect_metrics;
                if protect && !self.authorized(session) {
                    return error(401, "unauthorized", "admin token required");
                }
                self.engine.refresh_gauges();
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
                self.api(&method, &path, &query, &body).await
            }
            _ => error(404, "not_found", &format!("no admin route {method} {path}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::testing::{engine_with, FailingStore};
    use crate::store::StoreWriter;
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    const YAML: &str = "providers:\n  - id: p\n    base_url: \"http://127.0.0.1:9\"\n    api: openai\n    class: local\n    connections: [ { id: c } ]\nmodels:\n  - name: m\n    targets: [ { provider: p, model: u } ]\n";

    #[tokio::test]
    async fn an_admin_write_the_store_refuses_answers_503_never_200() {
        let store = FailingStore::new(true);
        let writer = StoreWriter::spawn(store.clone(), Duration::from_secs(3600));
        let app = AdminApp::new(engine_with(YAML, Some(writer.clone())));
        let r = app.api("POST", "/api/resilience/reset", "", b"{}").await;
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers()["retry-after"], "1");
        let body: Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(body["error"]["code"], "state_store_unavailable");
        assert!(body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not persisted"));
        assert!(writer.health().failed_commits >= 1);

        let r = app
            .api("PATCH", "/api/resilience", "", br#"{"queue.max_depth": 3}"#)
            .await;
        assert_eq!(r.status(), 503);

        // Once the store commits again, the same call is a plain 200.
        store.failing.store(false, Ordering::SeqCst);
        let r = app.api("POST", "/api/resilience/reset", "", b"{}").await;
        assert_eq!(r.status(), 200);
        // A bad request stays a 400, not a store error.
        let r = app
            .api("POST", "/api/resilience/reset", "", br#"{"provider":"zz"}"#)
            .await;
        assert_eq!(r.status(), 400);
    }

    #[tokio::test]
    async fn ready_follows_the_store_writer() {
        let store = FailingStore::new(false);
        let writer = StoreWriter::spawn(store.clone(), Duration::from_secs(3600));
        let engine = engine_with(YAML, Some(writer.clone()));
        let (ready, details) = readiness(&engine);
        assert!(ready, "{details}");
        assert_eq!(details["store"]["state"], "open");

        // Failing commits are reported but keep the node in rotation.
        store.failing.store(true, Ordering::SeqCst);
        assert!(writer
            .commit_now(vec![crate::store::Change::delete(
                crate::store::Table::Pins,
                "x"
            )])
            .await
            .is_err());
        let (ready, details) = readiness(&engine);
        assert!(ready);
        assert_eq!(details["store"]["state"], "failing");
        assert!(details["store"]["consecutive_failures"].as_u64() >= Some(1));

        // A stopped writer is not ready, and says why.
        let _ = writer.flush().await;
        let (ready, details) = readiness(&engine);
        assert!(!ready);
        assert_eq!(details["store"]["state"], "closed");
        assert!(details["reasons"][0].as_str().unwrap().contains("stopped"));
    }

    #[test]
    fn query_params_decode() {
        assert_eq!(
            query_param("model=gpt%2D4o&x=1", "model").as_deref(),
            Some("gpt-4o")
        );
        assert_eq!(query_param("a=b+c", "a").as_deref(), Some("b c"));
        assert_eq!(query_param("a=%zz", "a").as_deref(), Some("%zz"));
        assert_eq!(query_param("a=%4", "a").as_deref(), Some("%4"));
        assert_eq!(query_param("", "a"), None);
    }
}
