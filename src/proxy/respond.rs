//! Rendering responses Sluice writes itself: errors in each API family's shape (SPEC §4)
//! and small local JSON answers. The only place a `ClientError` becomes bytes.

use crate::config::Family;
use crate::error::ClientError;
use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::proxy::Session;
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
    session: &mut Session,
    status: u16,
    content_type: &str,
    extra_headers: &[(&'static str, String)],
    body: Vec<u8>,
) -> pingora::Result<()> {
    let mut h = ResponseHeader::build(status, Some(4 + extra_headers.len()))?;
    h.insert_header("content-type", content_type)?;
    h.insert_header("content-length", body.len())?;
    for (k, v) in extra_headers {
        h.insert_header(*k, v.as_str())?;
    }
    session.write_response_header(Box::new(h), false).await?;
    session
        .write_response_body(Some(Bytes::from(body)), true)
        .await?;
    Ok(())
}

/// Writes `err` as a complete response in `family`'s shape.
pub async fn write_error(
    session: &mut Session,
    family: Family,
    err: &ClientError,
    mut extra_headers: Vec<(&'static str, String)>,
) -> pingora::Result<()> {
    if let Some(s) = err.retry_after {
        extra_headers.push(("retry-after", s.max(1).to_string()));
    }
    let body = error_body(family, err);
    write_local(
        session,
        err.status(),
        "application/json",
        &extra_headers,
        body,
    )
    .await
}

/// An SSE error event to end a committed stream (SPEC §5.9).
pub fn sse_error_event(family: Family, code: &str, message: &str) -> Bytes {
    let text = match family {
        Family::OpenAi => format!(
            "data: {}\n\n",
            json!({"error": {"type": "server_error", "code": code, "message": message}})
        ),
        Family::Anthropic => format!(
            "event: error\ndata: {}\n\n",
            json!({"type": "error", "error": {"type": "api_error", "code": code, "message": message}})
        ),
    };
    Bytes::from(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codes::ErrorCode;

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
