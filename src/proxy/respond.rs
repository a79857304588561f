//! Rendering what Sluice writes itself: errors in each API family's shape (SPEC §4),
//! the failover machine's refusals with their diagnostics, a held upstream error passed
//! through, the SSE error event that ends a failed stream (SPEC §2), and small local
//! JSON answers. The only place a `ClientError` becomes bytes.

use super::attempt::HeldError;
use super::ctx::{Request, RequestCtx};
use super::routes::Route;
use super::upstream;
use crate::codes::{AbortReason, ErrorCode};
use crate::config::Family;
use crate::engine::judge::Verdict;
use crate::error::ClientError;
use crate::policy::failover::Refusal;
use crate::policy::timefmt::format_rfc3339;
use crate::policy::{client_retry_after, retry_after_secs};
use crate::server::conn::{BodySize, ClientConn};
use bytes::Bytes;
use serde_json::{json, Map, Value};

/// The JSON body of `err` in `family`'s error shape.
pub fn error_body(family: Family, err: &ClientError) -> Vec<u8> {
    let mut inner = Map::new();
    let ty = match family {
        Family::OpenAi => err.code.openai_type(),
        Family::Anthropic => err.code.anthropic_type(),
    };
    inner.insert("type".into(), Value::from(ty));
    inner.insert("message".into(), Value::from(err.message.clone()));
    inner.insert("code".into(), Value::from(err.code.as_str()));
    if family == Family::OpenAi {
        inner.insert("param".into(), Value::Null);
    }
    if let Some(extra) = &err.extra {
        for (k, v) in extra {
            inner.insert(k.clone(), v.clone());
        }
    }
    let body = match family {
        Family::OpenAi => json!({ "error": Value::Object(inner) }),
        Family::Anthropic => json!({ "type": "error", "error": Value::Object(inner) }),
    };
    serde_json::to_vec(&body).unwrap_or_default()
}

/// Writes a complete local response. `extra_headers` are added as given.
pub async fn write_local(
    conn: &mut ClientConn,
    status: u16,
    content_type: &str,
    extra_headers: &[(&'static str, String)],
    body: &[u8],
) -> super::Answered {
    let mut h = conn.head(status);
    h.field(b"Content-Type", content_type.as_bytes());
    for (k, v) in extra_headers {
        h.field(k.as_bytes(), v.as_bytes());
    }
    h.end(BodySize::Exactly(body.len() as u64));
    conn.write_body(body, true).await?;
    Ok(())
}

/// Writes `err` as a complete response in `family`'s shape.
pub async fn write_error(
    conn: &mut ClientConn,
    family: Family,
    err: &ClientError,
    mut extra_headers: Vec<(&'static str, String)>,
) -> super::Answered {
    if let Some(s) = err.retry_after {
        extra_headers.push(("retry-after", client_retry_after(s).to_string()));
    }
    let body = error_body(family, err);
    write_local(
        conn,
        err.status(),
        "application/json",
        &extra_headers,
        &body,
    )
    .await
}

/// The SSE error event that ends a committed stream, in the route family's shape
/// (SPEC §2): Chat/Completions `data: {"error": …}`, Responses `event: error` with a
/// `{"type": "error", …}` payload, Messages `event: error` with `{"type": "error",
/// "error": …}`. It always ends with a blank line (a complete event).
pub fn sse_error_event(route: Route, reason: AbortReason) -> Bytes {
    let (code, message) = (reason.as_str(), reason.message());
    let text = match route {
        Route::Responses => format!(
            "event: error\ndata: {}\n\n",
            json!({"type": "error", "code": code, "message": message, "param": null})
        ),
        Route::Messages => format!(
            "event: error\ndata: {}\n\n",
            json!({"type": "error", "error": {"type": "api_error", "code": code, "message": message}})
        ),
        _ => format!(
            "data: {}\n\n",
            json!({"error": {"type": "server_error", "code": code, "message": message, "param": null}})
        ),
    };
    Bytes::from(text)
}

/// Writes `e` with the `x-sluice-*` headers, and notes it for the access log.
pub async fn finish_error(
    conn: &mut ClientConn,
    family: Family,
    e: ClientError,
    ctx: &mut RequestCtx<'_>,
) -> super::Answered {
    ctx.status = e.status();
    ctx.note = Some(e.code.as_str());
    write_error(conn, family, &e, ctx.sluice_headers()).await
}

/// The client-facing error for a refusal of the failover machine.
pub fn refusal_error(
    req: &Request<'_>,
    r: &Refusal,
    ctx: &RequestCtx<'_>,
    now: crate::policy::Millis,
) -> ClientError {
    let model = &req.snap.config.models[req.model].name;
    let message = match r.code {
        ErrorCode::RateLimited => format!(
            "every target of model {model:?} is rate-limited; retry in {}s",
            r.retry_after.unwrap_or(1)
        ),
        ErrorCode::AllTargetsCoolingDown => format!(
            "every target of model {model:?} is cooling down; retry in {}s",
            r.retry_after.unwrap_or(1)
        ),
        ErrorCode::NoExecutableTargets => {
            format!("model {model:?} has no target that can run")
        }
        ErrorCode::LeaseCapacityUnavailable => {
            "every eligible connection is held by another session's exclusive lease".into()
        }
        ErrorCode::QueueFull => {
            "too many requests are already waiting for this model's connections".into()
        }
        ErrorCode::QueueTimeout => "no concurrency permit became free within the queue wait".into(),
        ErrorCode::ExecutionTimeout => {
            "the execution deadline passed before the upstream answered".into()
        }
        ErrorCode::UpstreamTimeout => format!(
            "no upstream sent a first byte within ttft_timeout ({} attempts)",
            ctx.records.len()
        ),
        ErrorCode::UpstreamUnavailable => {
            "every upstream attempt failed on transport errors".into()
        }
        other => other.as_str().replace('_', " "),
    };
    let mut e = ClientError::new(r.code, message);
    if let Some(secs) = r.retry_after {
        e = e.with_retry_after(secs);
    }
    if let Some(reset) = r.reset_at {
        e = e
            .with_extra(
                "retry_after_s",
                json!(client_retry_after(retry_after_secs(reset, now))),
            )
            .with_extra("reset_at", json!(format_rfc3339(reset)));
    }
    let mut diagnostics = Map::new();
    let about_targets = matches!(
        r.code,
        ErrorCode::RateLimited | ErrorCode::AllTargetsCoolingDown | ErrorCode::NoExecutableTargets
    );
    if about_targets || !r.excluded.is_empty() {
        let list: Vec<Value> = r.excluded.iter().map(|x| x.json(now)).collect();
        diagnostics.insert("excluded".into(), Value::Array(list));
    }
    if r.with_attempts {
        diagnostics.insert("attempts".into(), Value::Array(ctx.attempts_json()));
    }
    if !diagnostics.is_empty() {
        e = e.with_extra("diagnostics", Value::Object(diagnostics));
    }
    e
}

/// Passes a held upstream error to the client: its headers and body, the restated
/// status if a rule applied, and a normalised `Retry-After`.
pub(super) async fn pass_through(
    conn: &mut ClientConn,
    err: HeldError,
    v: &Verdict,
    ctx: &mut RequestCtx<'_>,
) -> super::Answered {
    ctx.status = v.status;
    let mut h = conn.head(v.status);
    let fields = err
        .headers
        .iter()
        .map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes()));
    // The upstream's own `Retry-After` may be a date, a fraction, 0 or a year: only the
    // normalised one is passed on; the body goes as it was read, unencoded.
    upstream::forward_fields(&mut h, fields, &["content-encoding", "retry-after"]);
    for (k, v) in ctx.sluice_headers() {
        h.field(k.as_bytes(), v.as_bytes());
    }
    if let Some(secs) = v.retry_after {
        h.number(b"retry-after", secs);
    }
    h.end(BodySize::Exactly(err.body.len() as u64));
    conn.write_body(&err.body, true).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codes::ErrorCode;

    #[test]
    fn stream_error_events_have_each_family_shape() {
        let text =
            |route| String::from_utf8(sse_error_event(route, AbortReason::Stall).to_vec()).unwrap();
        let data = |t: &str| -> Value {
            let line = t.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
            serde_json::from_str(line).unwrap()
        };
        let chat = text(Route::ChatCompletions);
        assert!(chat.starts_with("data: ") && chat.ends_with("\n\n"));
        assert_eq!(data(&chat)["error"]["code"], "stall");
        let responses = text(Route::Responses);
        assert!(responses.starts_with("event: error\n") && responses.ends_with("\n\n"));
        let r = data(&responses);
        assert_eq!(
            (r["type"].as_str(), r["code"].as_str()),
            (Some("error"), Some("stall"))
        );
        let messages = text(Route::Messages);
        assert!(messages.starts_with("event: error\n"));
        let m = data(&messages);
        assert_eq!(m["type"], "error");
        assert_eq!(m["error"]["type"], "api_error");
        assert_eq!(m["error"]["code"], "stall");
    }

    #[test]
    fn both_shapes() {
        let e = ClientError::new(ErrorCode::ModelNotFound, "no model x")
            .with_extra("diagnostics", json!({"excluded": []}));
        let o: Value = serde_json::from_slice(&error_body(Family::OpenAi, &e)).unwrap();
        assert_eq!(o["error"]["code"], "model_not_found");
        assert_eq!(o["error"]["type"], "not_found_error");
        assert!(o["error"]["param"].is_null());
        assert!(o["error"]["diagnostics"]["excluded"].is_array());
        let a: Value = serde_json::from_slice(&error_body(Family::Anthropic, &e)).unwrap();
        assert_eq!(a["type"], "error");
        assert_eq!(a["error"]["type"], "not_found_error");
        assert_eq!(a["error"]["code"], "model_not_found");
        assert_eq!(a["error"]["message"], "no model x");
    }
}
