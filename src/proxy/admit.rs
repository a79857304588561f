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
use crate::http1::RequestHead;
use crate::policy::affinity::{pin_key, session_key};
use crate::policy::lease::{Lease, LeaseError};
use crate::server::conn::{BodyFail, ClientConn};
use bytes::Bytes;

/// A request that passed admission.
pub struct Admitted {
    pub body: ParsedBody,
    pub model: usize,
    pub lease: Option<Lease>,
    pub pin_key: Option<String>,
}

/// The client key from `Authorization: Bearer …` or `x-api-key`.
fn presented_key(head: &RequestHead) -> Option<&str> {
    if let Some(v) = head.get_str("authorization") {
        let v = v.trim();
        if v.len() > 7 && v.is_char_boundary(7) && v[..7].eq_ignore_ascii_case("bearer ") {
            return Some(v[7..].trim());
        }
    }
    head.get_str("x-api-key").map(str::trim)
}

/// The calling client: `None` on an open listener, 401 for a missing or unknown key.
pub fn client<'s>(
    snap: &'s Snapshot,
    head: &RequestHead,
) -> Result<Option<&'s Client>, ClientError> {
    if snap.config.clients.is_none() {
        return Ok(None);
    }
    match presented_key(head).and_then(|k| snap.client_by_key(k)) {
        Some(c) => Ok(Some(c)),
        None => Err(ClientError::new(
            ErrorCode::Unauthorized,
            "missing or unknown client key",
        )),
    }
}

/// Reads the whole request body, at most `limit` bytes (413 beyond), answering
/// `Expect: 100-continue` first. A body that cannot be read whole leaves the connection
/// unfit for another request.
pub async fn read_body(conn: &mut ClientConn, limit: usize) -> Result<Bytes, ClientError> {
    conn.read_body(limit).await.map_err(|e| match e {
        BodyFail::TooLarge => ClientError::new(
            ErrorCode::BodyTooLarge,
            format!("request body exceeds max_body_bytes ({limit} bytes)"),
        ),
        BodyFail::Timeout => ClientError::new(
            ErrorCode::RequestTimeout,
            "the request body stopped arriving (server.client_body_timeout)",
        ),
        BodyFail::Broken(why) => {
            ClientError::invalid_request(format!("cannot read request body: {why}"))
        }
    })
}

/// Admission of an LLM request: body, JSON, model, lease fence, session key.
pub async fn admit(
    engine: &Engine,
    snap: &Snapshot,
    conn: &mut ClientConn,
    head: &RequestHead,
    family: Family,
    client: Option<&Client>,
) -> Result<Admitted, ClientError> {
    let raw = read_body(conn, snap.config.server.max_body_bytes).await?;
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
    let lease = lease_fence(engine, head, client).await?;
    let model_name = &snap.config.models[model].name;
    let pin_key = (!snap.config.resilience.affinity_ttl.is_zero())
        .then(|| session_key(&**head))
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
    head: &RequestHead,
    client: Option<&Client>,
) -> Result<Option<Lease>, ClientError> {
    let Some(owner) = head.get_str("x-sluice-lease-owner") else {
        return Ok(None);
    };
    let Some(client) = client else {
        return Err(ClientError::new(
            ErrorCode::Forbidden,
            "lease headers need a client key with the lease:exclusive scope",
        ));
    };
    let generation = head
        .get_str("x-sluice-lease-generation")
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
