//! `POST /api/v1/session-leases` (SPEC §5.6): acquire, renew and release an exclusive
//! session lease. Only client keys with the `lease:exclusive` scope and a non-empty
//! `allowed_connections` list may hold leases. Every change is durable before the
//! response (a change the store did not accept answers 503 `state_store_unavailable`,
//! never 200); the owner token appears once, in the acquire response, and only its hash
//! is kept.

use super::admit::read_body;
use super::{respond, RequestCtx};
use crate::codes::ErrorCode;
use crate::config::{Client, Family};
use crate::engine::sessions::{LeaseFailure, LeaseRefusal};
use crate::engine::{Engine, Snapshot};
use crate::error::ClientError;
use crate::policy::lease::{Lease, LeaseError};
use crate::policy::timefmt::format_rfc3339;
use crate::policy::{retry_after_secs, Millis};
use crate::server::conn::ClientConn;
use crate::store::StoreError;
use serde::Deserialize;
use serde_json::json;
use std::time::Duration;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LeaseRequest {
    action: String,
    ttl_s: Option<u64>,
    owner: Option<String>,
}

fn lease_json(l: &Lease, owner: Option<&str>) -> serde_json::Value {
    let mut v = json!({
        "generation": l.generation,
        "connection": l.connection,
        "expires_at": format_rfc3339(l.expires_at),
    });
    if let Some(o) = owner {
        v["owner"] = json!(o);
    }
    v
}

fn lease_error(e: LeaseError, now: u64) -> ClientError {
    match e {
        LeaseError::CapacityUnavailable { retry_at } => ClientError::new(
            ErrorCode::LeaseCapacityUnavailable,
            "every eligible allowed connection is held by another lease",
        )
        .with_retry_after(retry_after_secs(retry_at, now)),
        LeaseError::UnknownOwner => {
            ClientError::new(ErrorCode::LeaseNotFound, "no active lease for this owner")
        }
        LeaseError::WrongClient => ClientError::new(
            ErrorCode::Forbidden,
            "this lease belongs to another client key",
        ),
        LeaseError::StaleGeneration { current } => ClientError::new(
            ErrorCode::LeaseGenerationStale,
            format!("current generation is {current}"),
        ),
        LeaseError::InvalidTtl(m) => ClientError::invalid_request(m),
        LeaseError::NoneEligible => ClientError::new(
            ErrorCode::NoExecutableTargets,
            "none of this key's allowed connections can run",
        ),
    }
}

async fn answer(
    conn: &mut ClientConn,
    ctx: &mut RequestCtx<'_>,
    result: Result<serde_json::Value, ClientError>,
) -> super::Answered {
    match result {
        Ok(v) => {
            ctx.status = 200;
            let body = serde_json::to_vec(&v).unwrap_or_default();
            respond::write_local(conn, 200, "application/json", &[], &body).await?;
        }
        Err(e) => {
            ctx.status = e.status();
            ctx.note = Some(e.code.as_str());
            respond::write_error(conn, Family::OpenAi, &e, Vec::new()).await?;
        }
    }
    Ok(())
}

pub async fn handle(
    engine: &Engine,
    snap: &Snapshot,
    conn: &mut ClientConn,
    client: Option<&Client>,
    ctx: &mut RequestCtx<'_>,
) -> super::Answered {
    let result = run(engine, snap, conn, client).await;
    answer(conn, ctx, result).await
}

async fn run(
    engine: &Engine,
    snap: &Snapshot,
    conn: &mut ClientConn,
    client: Option<&Client>,
) -> Result<serde_json::Value, ClientError> {
    let client = client
        .filter(|c| {
            c.scopes.iter().any(|s| s == "lease:exclusive")
                && c.allowed_connections
                    .as_ref()
                    .is_some_and(|l| !l.is_empty())
        })
        .ok_or_else(|| {
            ClientError::new(
                ErrorCode::Forbidden,
                "this client key lacks the lease:exclusive scope or an allowed_connections list",
            )
        })?;
    let raw = read_body(conn, 64 * 1024).await?;
    let req: LeaseRequest = serde_json::from_slice(&raw)
        .map_err(|e| ClientError::invalid_request(format!("lease request: {e}")))?;
    let ttl = req.ttl_s.map(Duration::from_secs);
    let now = engine.now();
    let owner = || {
        req.owner
            .as_deref()
            .ok_or_else(|| ClientError::invalid_request(format!("{} needs \"owner\"", req.action)))
    };
    match req.action.as_str() {
        "acquire" => match engine.lease_acquire(snap, client, ttl).await {
            Ok((token, lease)) => {
                tracing::info!(client = %client.id, connection = %lease.connection, generation = lease.generation, "lease acquired");
                Ok(lease_json(&lease, Some(&token)))
            }
            Err(LeaseRefusal::Lease(e)) => Err(lease_error(e, now)),
            Err(LeaseRefusal::NoneEligible { retry_at: Some(t) }) => Err(ClientError::new(
                ErrorCode::AllTargetsCoolingDown,
                "every allowed connection is cooling down",
            )
            .with_retry_after(retry_after_secs(t, now))),
            Err(LeaseRefusal::NoneEligible { retry_at: None }) => {
                Err(lease_error(LeaseError::NoneEligible, now))
            }
            Err(LeaseRefusal::Store(e)) => Err(store_error("acquire", &e)),
        },
        "renew" => engine
            .lease_renew(client, owner()?, ttl)
            .await
            .map(|l| lease_json(&l, None))
            .map_err(|e| failure("renew", e, now)),
        "release" => engine
            .lease_release(client, owner()?)
            .await
            .map(|l| json!({"released": true, "connection": l.connection}))
            .map_err(|e| failure("release", e, now)),
        other => Err(ClientError::invalid_request(format!(
            "unknown action {other:?}; expected acquire, renew or release"
        ))),
    }
}

fn failure(action: &str, f: LeaseFailure, now: Millis) -> ClientError {
    match f {
        LeaseFailure::Lease(e) => lease_error(e, now),
        LeaseFailure::Store(e) => store_error(action, &e),
    }
}

/// A lease change the store did not accept: 503, retryable, never a 200.
fn store_error(action: &str, e: &StoreError) -> ClientError {
    ClientError::new(
        ErrorCode::StateStoreUnavailable,
        format!(
            "the lease {action} could not be made durable ({}); retry shortly",
            e.label()
        ),
    )
    .with_retry_after(1)
}
