//! The admit phase (SPEC §2.1): client key, body size, JSON, model, and the session
//! layers' request headers (affinity session key, lease fence).
//!
//! Everything here answers before any upstream work: a request that fails admission
//! never reaches selection. Lease owner tokens are compared by hash only and are never
//! logged.

use super::body::ParsedBody;
use crate::codes::ErrorCode;
use crate::config::{Client, Family};
use crate::engine::{Engine, Snapshot};
use crate::error::ClientError;
use crate::policy::affinity::{pin_key, session_key};
use crate::policy::lease::{Lease, LeaseError};
use bytes::{Bytes, BytesMut};
use pingora::protocols::http::ServerSession;

/// A request that passed admission.
pub struct Admitted {
    pub body: ParsedBody,
    pub model: usize,
    pub lease: Option<Lease>,
    pub pin_key: Option<String>,
}

/// The client key from `Authorization: Bearer …` or `x-api-key`.
fn presented_key(session: &ServerSession) -> Option<String> {
    let h = &session.req_header().headers;
    if let Some(v) = h.get("authorization").and_then(|v| v.to_str().ok()) {
        let v = v.trim();
        if v.len() > 7 && v[..7].eq_ignore_ascii_case("bearer ") {
            return Some(v[7..].trim().to_string());
        }
    }
    h.get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_string())
}

/// The calling client: `None` on an open listener, 401 for a missing or unknown key.
pub fn client<'s>(
    snap: &'s Snapshot,
    session: &ServerSession,
) -> Result<Option<&'s Client>, ClientError> {
    if snap.config.clients.is_none() {
        return Ok(None);
    }
    match presented_key(session).and_then(|k| snap.client_by_key(&k)) {
        Some(c) => Ok(Some(c)),
        None => Err(ClientError::new(
            ErrorCode::Unauthorized,
            "missing or unknown client key",
        )),
    }
}

/// Reads the whole request body, at most `limit` bytes (413 beyond), answering
/// `Expect: 100-continue` first.
pub async fn read_body(session: &mut ServerSession, limit: usize) -> Result<Bytes, ClientError> {
    let result = read_whole_body(session, limit).await;
    if result.is_err() {
        // The rest of the body is unread or unreadable: the connection cannot carry
        // another request.
        session.set_keepalive(None);
    }
    result
}

async fn read_whole_body(session: &mut ServerSession, limit: usize) -> Result<Bytes, ClientError> {
    let too_large = || {
        ClientError::new(
            ErrorCode::BodyTooLarge,
            format!("request body exceeds max_body_bytes ({limit} bytes)"),
        )
    };
    let declared = session
        .req_header()
        .headers
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large());
    }
    let expects_continue = session
        .req_header()
        .headers
        .get("expect")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if expects_continue {
        session.write_continue_response().await.map_err(|e| {
            ClientError::invalid_request(format!("cannot answer 100-continue: {e}"))
        })?;
    }
    // A body that arrives in one chunk (most do) is kept as Pingora handed it over: no
    // second buffer, no copy. Only a second chunk starts the joined buffer. Pingora's
    // HTTP/1 server copies each chunk out of its read buffer, so keeping one pins nothing
    // else; an HTTP/2 front door would hand over slices of h2's shared read buffer, and
    // would need the copy back.
    let mut first: Option<Bytes> = None;
    let mut buf = BytesMut::new();
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) => {
                let have = first.as_ref().map_or(buf.len(), Bytes::len);
                if have + chunk.len() > limit {
                    return Err(too_large());
                }
                if first.is_none() && buf.is_empty() {
                    first = Some(chunk);
                    continue;
                }
                if let Some(f) = first.take() {
                    buf.reserve(
                        declared
                            .unwrap_or(8 * 1024)
                            .min(limit)
                            .max(have + chunk.len()),
                    );
                    buf.extend_from_slice(&f);
                }
                buf.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(first.unwrap_or_else(|| buf.freeze())),
            Err(e) if matches!(e.etype(), pingora::ErrorType::ReadTimedout) => {
                return Err(ClientError::new(
                    ErrorCode::RequestTimeout,
                    "the request body stopped arriving (server.client_body_timeout)",
                ))
            }
            Err(e) => {
                return Err(ClientError::invalid_request(format!(
                    "cannot read request body: {}",
                    e.etype().as_str()
                )))
            }
        }
    }
}

/// Admission of an LLM request: body, JSON, model, lease fence, session key.
pub async fn admit(
    engine: &Engine,
    snap: &Snapshot,
    session: &mut ServerSession,
    family: Family,
    client: Option<&Client>,
) -> Result<Admitted, ClientError> {
    let raw = read_body(session, snap.config.server.max_body_bytes).await?;
    let body = ParsedBody::parse(raw).map_err(ClientError::invalid_request)?;
    let model = snap
        .model_index(&body.model)
        .filter(|m| snap.serves_family(*m, family))
        .ok_or_else(|| {
            ClientError::new(
                ErrorCode::ModelNotFound,
                format!(
                    "model {:?} is not configured for {} requests",
                    body.model,
                    family.as_str()
                ),
            )
        })?;
    let lease = lease_fence(engine, session, client).await?;
    let model_name = &snap.config.models[model].name;
    let pin_key = (!snap.config.resilience.affinity_ttl.is_zero())
        .then(|| session_key(&session.req_header().headers))
        .flatten()
        .map(|s| pin_key(client.map_or("-", |c| c.id.as_str()), model_name, &s));
    Ok(Admitted {
        body,
        model,
        lease,
        pin_key,
    })
}

/// The lease fence: `X-Sluice-Lease-Owner` + `X-Sluice-Lease-Generation` must match an
/// active lease of this client key (SPEC §5.6).
async fn lease_fence(
    engine: &Engine,
    session: &ServerSession,
    client: Option<&Client>,
) -> Result<Option<Lease>, ClientError> {
    let h = &session.req_header().headers;
    let Some(owner) = h.get("x-sluice-lease-owner").and_then(|v| v.to_str().ok()) else {
        return Ok(None);
    };
    let Some(client) = client else {
        return Err(ClientError::new(
            ErrorCode::Forbidden,
            "lease headers need a client key with the lease:exclusive scope",
        ));
    };
    let generation = h
        .get("x-sluice-lease-generation")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .ok_or_else(|| ClientError::invalid_request("X-Sluice-Lease-Generation must be given as a whole number with X-Sluice-Lease-Owner"))?;
    match engine
        .lease_fence(&client.id, owner.trim(), generation)
        .await
    {
        Ok(l) => Ok(Some(l)),
        Err(LeaseError::StaleGeneration { current }) => Err(ClientError::new(
            ErrorCode::LeaseGenerationStale,
            format!("lease generation {generation} is stale; the current generation is {current}"),
        )),
        Err(LeaseError::WrongClient) => Err(ClientError::new(
            ErrorCode::Forbidden,
            "this lease belongs to another client key",
        )),
        Err(_) => Err(ClientError::new(
            ErrorCode::LeaseGenerationStale,
            "the lease has expired or was released",
        )),
    }
}
