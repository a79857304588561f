//! The attempt loop (ARCHITECTURE §3): Sluice, not Pingora, owns upstream attempts.
//!
//! The body was read once at admission; every attempt replays it (with `model`
//! rewritten) through Pingora's client `Connector`, so failover works for bodies of any
//! size. Phases keep Pingora's hook names: select (`upstream_peer`), connect
//! (`fail_to_connect`), response header (`upstream_response_filter`), stream
//! (`response_body_filter`). Invariants:
//! - nothing reaches the client before the commit point (first response byte); until
//!   then every failure may fail over, after it none may;
//! - an upstream 2xx is committed only once its first body chunk arrived, so a silent
//!   upstream (time-to-first-token timeout) is still a failover, not a broken stream;
//! - every wait is bounded (TTFT, stall, execution deadline) and races the client: a
//!   client that goes away ends the upstream attempt at once;
//! - an upstream connection goes back to the pool only after its response was read whole.

use super::attempt::{attempt, Attempt, HeldError};
use super::body::ParsedBody;
use super::respond;
use super::upstream;
use super::waits::{self, QueueOutcome};
use super::RequestCtx;
use crate::codes::ErrorCode;
use crate::config::{Client, Family};
use crate::engine::judge::Verdict;
use crate::engine::record::{AttemptInfo, Outcome};
use crate::engine::select::{Asker, Exclusion};
use crate::engine::{state, Engine, Pick, Selection, Snapshot, Tried};
use crate::error::ClientError;
use crate::policy::breaker::Permit;
use crate::policy::combo::Decision;
use crate::policy::lease::Lease;
use crate::policy::Scope;
use pingora::http::RequestHeader;
use pingora::proxy::Session;
use serde_json::json;
use std::time::{Duration, Instant};

/// Everything one request's dispatch needs, pinned at admission.
#[derive(Clone)]
pub struct Request<'a> {
    pub engine: &'a Engine,
    pub snap: &'a Snapshot,
    pub model: usize,
    pub family: Family,
    pub client: Option<&'a Client>,
    pub body: &'a ParsedBody,
    pub header: &'a RequestHeader,
    /// Set when the first attempt is dispatched (`queue.execution_timeout` from then).
    pub deadline: Instant,
    /// The exclusive lease the request presented (already checked by the fence).
    pub lease: Option<Lease>,
    /// Session affinity pin key, when the request carries a session header.
    pub pin_key: Option<String>,
    /// This run is already the `emergency_fallback` model's (no second hop).
    pub is_fallback: bool,
}

/// One failed attempt, for diagnostics and logs.
#[derive(Debug, Clone)]
pub struct AttemptRecord {
    pub provider: String,
    pub connection: String,
    pub model: String,
    pub status: Option<u16>,
    pub reason: &'static str,
}

impl AttemptRecord {
    fn json(&self) -> serde_json::Value {
        json!({
            "provider": self.provider,
            "connection": self.connection,
            "model": self.model,
            "status": self.status,
            "reason": self.reason,
        })
    }
}

/// Times a request may go back to selection because the connection it waited for
/// stopped being runnable during the wait.
const MAX_REQUEUES: usize = 3;

/// Runs attempts until one commits, a non-retryable answer arrives, or none are left;
/// always leaves a complete response on `session`.
pub async fn run(
    session: &mut Session,
    r: &Request<'_>,
    ctx: &mut RequestCtx,
) -> pingora::Result<()> {
    let cfg = &r.snap.config;
    let max = cfg.server.max_attempts;
    let mut tried = Tried::default();
    let mut held: Option<(HeldError, Verdict)> = None;
    let mut excluded: Vec<Exclusion> = Vec::new();
    let mut rate_limited_until = None;
    let mut lease = r.lease.clone();
    let mut relocated = false;
    let mut watching = true;
    let (mut waits, mut waited) = (0u32, Duration::ZERO);
    let mut deadline: Option<Instant> = None;
    let mut attempt_no = 0usize;
    let mut requeued = 0usize;
    while attempt_no < max {
        let pin = r.pin_key.as_deref().and_then(|k| r.engine.pinned(k));
        let asker = Asker {
            client: r.client,
            lease: lease
                .as_ref()
                .map(|l| (l.owner_hash.as_str(), l.connection.as_str())),
            tried: &tried,
        };
        let (pick, probe, permit) = match r.engine.select(
            r.snap,
            r.model,
            r.family,
            &asker,
            pin.as_deref(),
        ) {
            Selection::Picked {
                pick,
                probe,
                permit,
            } => (pick, probe, permit),
            Selection::Full { full, .. } => {
                match waits::wait_for_permit(session, r, &full, &mut watching).await {
                    QueueOutcome::Got(c, permit) | QueueOutcome::FailOpen(c, permit) => {
                        // The wait may have lasted seconds: the connection may have
                        // started cooling, gone terminal or been leased meanwhile.
                        if !r
                            .engine
                            .still_runnable(r.snap, r.model, r.family, &asker, &c)
                        {
                            requeued += 1;
                            if requeued > MAX_REQUEUES {
                                return waits::queue_rejected(session, r, ctx, false).await;
                            }
                            continue;
                        }
                        match r.engine.breaker_permit(r.snap, c.provider, r.engine.now()) {
                            Permit::Allow => (c.into(), false, permit),
                            Permit::Probe => (c.into(), true, permit),
                            Permit::Deny { .. } => {
                                tried.providers.push(c.provider);
                                continue;
                            }
                        }
                    }
                    QueueOutcome::Full => {
                        return waits::queue_rejected(session, r, ctx, true).await
                    }
                    QueueOutcome::TimedOut => {
                        return waits::queue_rejected(session, r, ctx, false).await
                    }
                    QueueOutcome::ClientGone => return client_gone(ctx),
                }
            }
            Selection::Empty(ex) => {
                // A lease whose connection became ineligible moves (same generation).
                if let (Some(l), Some(client), false) = (&lease, r.client, relocated) {
                    relocated = true;
                    if let Some(moved) = r.engine.lease_relocate(r.snap, client, l).await {
                        if moved.connection != l.connection {
                            lease = Some(moved);
                            continue;
                        }
                    }
                }
                if held.is_none() && lease.is_none() {
                    if let Some(e) = waits::lease_contention(&ex, r.engine.now()) {
                        return finish_error(session, r.family, e, ctx).await;
                    }
                }
                match waits::combo_decision(r, &ex, waits, waited) {
                    Decision::Wait(d) => {
                        tracing::info!(model = %cfg.models[r.model].name, wait_ms = d.as_millis() as u64, "combo wait");
                        if !waits::combo_sleep(session, &mut watching, d).await {
                            return client_gone(ctx);
                        }
                        waits += 1;
                        waited += d;
                        // What held these back was a timer that has now run out (a
                        // target that answered "not found" stays excluded).
                        tried.connections.clear();
                        continue;
                    }
                    Decision::Decline {
                        rate_limited_until: until,
                    } => {
                        excluded = ex;
                        rate_limited_until = until;
                        break;
                    }
                }
            }
        };
        attempt_no += 1;
        let deadline = *deadline
            .get_or_insert_with(|| Instant::now() + cfg.resilience.queue.execution_timeout);
        let ra = Request {
            deadline,
            lease: lease.clone(),
            ..r.clone()
        };
        ctx.attempts = attempt_no as u32;
        ctx.pick = Some(names(r, pick));
        let info = AttemptInfo {
            snap: r.snap,
            model: r.model,
            pick,
            started: r.engine.now(),
            probe,
        };
        let outcome = attempt(session, &ra, &info, ctx).await;
        drop(permit);
        let (pname, cname, mname) = names(r, pick);
        let metric = |outcome: &str| {
            r.engine
                .metrics
                .attempts_total
                .with_label_values(&[pname.as_str(), cname.as_str(), outcome])
                .inc();
        };
        let verdict = match outcome {
            Attempt::Done => {
                metric("ok");
                if let Some(key) = &r.pin_key {
                    r.engine.touch_pin(
                        key,
                        &state::conn_key(&pname, &cname),
                        &mname,
                        cfg.resilience.affinity_ttl,
                    );
                }
                return Ok(());
            }
            Attempt::ClientGone => {
                metric("final_error");
                r.engine.record(&info, Outcome::Abandoned);
                return client_gone(ctx);
            }
            Attempt::Deadline => {
                metric("final_error");
                r.engine.record(&info, Outcome::Abandoned);
                return deadline_error(session, r, ctx).await;
            }
            Attempt::Transport(kind, what) => {
                metric("transport");
                let v = r.engine.judge_transport(&info, kind, what);
                ctx.records.push(AttemptRecord {
                    provider: pname,
                    connection: cname,
                    model: mname,
                    status: None,
                    reason: v.class.reason.as_str(),
                });
                tried.providers.push(pick.provider);
                v
            }
            Attempt::Http(err) => {
                let v = r.engine.judge_http(
                    &info,
                    err.header.status.as_u16(),
                    &err.header.headers,
                    &err.body,
                );
                let again = v.class.retryable && attempt_no < max;
                metric(if again { "failover" } else { "final_error" });
                ctx.records.push(AttemptRecord {
                    provider: pname,
                    connection: cname,
                    model: mname,
                    status: Some(v.status),
                    reason: v.class.reason.as_str(),
                });
                commit_urgent(r, &v).await;
                if !v.class.retryable {
                    return pass_through(session, r, *err, &v, ctx).await;
                }
                match v.class.scope {
                    Scope::Provider => tried.providers.push(pick.provider),
                    Scope::Model => tried.targets.push(pick.target),
                    Scope::Connection | Scope::Request => {
                        tried.connections.push((pick.provider, pick.connection))
                    }
                }
                held = Some((*err, v));
                continue;
            }
        };
        commit_urgent(r, &verdict).await;
    }
    if let Some((err, v)) = held {
        return pass_through(session, r, err, &v, ctx).await;
    }
    if !ctx.records.is_empty() {
        let attempts: Vec<_> = ctx.records.iter().map(AttemptRecord::json).collect();
        let e = ClientError::new(
            ErrorCode::UpstreamUnavailable,
            "every upstream attempt failed on transport errors",
        )
        .with_extra("diagnostics", json!({ "attempts": attempts }));
        return finish_error(session, r.family, e, ctx).await;
    }
    if let Some(fb) = emergency_fallback(r) {
        tracing::warn!(model = %cfg.models[r.model].name, fallback = %cfg.models[fb].name, "no runnable target: trying the emergency fallback model");
        let rf = Request {
            model: fb,
            is_fallback: true,
            pin_key: None,
            ..r.clone()
        };
        return Box::pin(run(session, &rf, ctx)).await;
    }
    waits::nothing_runnable(session, r, &excluded, rate_limited_until, ctx).await
}

/// The `emergency_fallback` model, when it applies to this request (SPEC §5.12).
fn emergency_fallback(r: &Request<'_>) -> Option<usize> {
    if r.is_fallback || r.lease.is_some() {
        return None;
    }
    let cfg = &r.snap.config;
    cfg.emergency_fallback
        .as_deref()
        .and_then(|name| r.snap.model_index(name))
        .filter(|m| *m != r.model && r.snap.serves_family(*m, r.family))
}

fn client_gone(ctx: &mut RequestCtx) -> pingora::Result<()> {
    ctx.status = 499;
    ctx.note = Some("client_gone");
    Ok(())
}

/// Terminal states are durable before the response that reveals them (SPEC §7).
async fn commit_urgent(r: &Request<'_>, v: &Verdict) {
    if v.urgent.is_empty() {
        return;
    }
    if let Some(store) = &r.engine.store {
        if let Err(e) = store.commit_now(v.urgent.clone()).await {
            tracing::error!(error = %e, "could not persist a terminal state");
        }
    }
}

fn names(r: &Request<'_>, pick: Pick) -> (String, String, String) {
    let cfg = &r.snap.config;
    let p = &cfg.providers[pick.provider];
    (
        p.id.clone(),
        p.connections[pick.connection].id.clone(),
        cfg.models[r.model].targets[pick.target].model.clone(),
    )
}

pub(super) fn sluice_headers(ctx: &RequestCtx) -> Vec<(&'static str, String)> {
    let mut h = Vec::with_capacity(4);
    if let Some((p, c, m)) = &ctx.pick {
        h.push(("x-sluice-provider", p.clone()));
        h.push(("x-sluice-connection", c.clone()));
        h.push(("x-sluice-model", m.clone()));
    }
    h.push(("x-sluice-attempts", ctx.attempts.to_string()));
    h
}

pub(super) async fn finish_error(
    session: &mut Session,
    family: Family,
    e: ClientError,
    ctx: &mut RequestCtx,
) -> pingora::Result<()> {
    ctx.status = e.status();
    ctx.note = Some(e.code.as_str());
    respond::write_error(session, family, &e, sluice_headers(ctx)).await
}

async fn deadline_error(
    session: &mut Session,
    r: &Request<'_>,
    ctx: &mut RequestCtx,
) -> pingora::Result<()> {
    let attempts: Vec<_> = ctx.records.iter().map(AttemptRecord::json).collect();
    let e = ClientError::new(
        ErrorCode::ExecutionTimeout,
        "the execution deadline passed before the upstream answered",
    )
    .with_extra("diagnostics", json!({ "attempts": attempts }));
    finish_error(session, r.family, e, ctx).await
}

/// Passes a held upstream error to the client: its headers and body, the restated
/// status if a rule applied, and a normalised `Retry-After`.
async fn pass_through(
    session: &mut Session,
    r: &Request<'_>,
    err: HeldError,
    v: &Verdict,
    ctx: &mut RequestCtx,
) -> pingora::Result<()> {
    ctx.pick = Some(names(r, err.pick));
    ctx.status = v.status;
    let h2 = session.downstream_session.is_http2();
    let mut h = upstream::response_header(&err.header, h2, &sluice_headers(ctx))?;
    if v.status != err.header.status.as_u16() {
        h.set_status(v.status)?;
    }
    h.remove_header("transfer-encoding");
    h.remove_header("content-encoding");
    h.insert_header("content-length", err.body.len())?;
    if let Some(secs) = v.retry_after {
        h.insert_header("retry-after", secs.to_string())?;
    }
    session.write_response_header(Box::new(h), false).await?;
    session.write_response_body(Some(err.body), true).await?;
    Ok(())
}
