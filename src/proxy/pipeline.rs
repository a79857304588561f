//! The attempt loop's driver (ARCHITECTURE §3, §3.1): Sluice, not Pingora, owns the
//! upstream attempts, and the failover machine (`policy::failover`) owns every decision
//! in them.
//!
//! The driver only runs what the machine says — select, attempt, queue wait, lease
//! relocation, combo wait, fallback hop, answer — and reports back how each step ended.
//! Each attempt is settled once (`Engine::settle`), and a committed one streams to its
//! end here. Invariants: the request's execution deadline is fixed when dispatch
//! starts and bounds every step; nothing reaches the client before the commit point,
//! after it nothing fails over; a breaker probe or permit taken for an attempt that
//! never ran is given back; a body that fails after commit is cut, never completed
//! (`Stop::Cut`: the gateway then drops the connection).

use super::attempt::{attempt, AttemptEnd, Call, HeldError, Inflight};
use super::ctx::{AttemptRecord, Request, RequestCtx};
use super::queue::{wait_for_permit, Permitted};
use super::rare;
use super::respond;
use super::stream::{stream, StreamEnd};
use super::subscription::{self, Rounds, Then};
use super::watch::ClientWatch;
use crate::clock::monotonic;
use crate::codes::ErrorCode;
use crate::engine::judge::Verdict;
use crate::engine::permits::PermitGuard;
use crate::engine::record::{AttemptInfo, Outcome};
use crate::engine::select::{Asker, Candidate};
use crate::engine::settle::AttemptOutcome;
use crate::engine::{Pick, Selection};
use crate::policy::breaker::Permit;
use crate::policy::failover::{Answer, Failover, Limits, Next, Offer, Queued, Refusal};
use crate::policy::{ms, retry_after_secs, Millis};
use crate::server::conn::ClientConn;
use std::time::{Duration, Instant};

/// Runs the request's attempts until one commits or the machine answers; leaves a
/// complete response on `session`, or returns `Err` when the client connection must be
/// cut (a committed body that failed).
///
/// The caller owns the driver ([`Driver::new`]) and lends it: an async fn keeps a
/// by-value argument in its state beside the local it is moved to, so a request passed
/// in would sit in the connection's task three times (~500 bytes more, and copies).
pub async fn run(
    conn: &mut ClientConn,
    d: &mut Driver<'_>,
    ctx: &mut RequestCtx<'_>,
) -> super::Answered {
    let now = d.start;
    let exec = d.req.snap.config.resilience.queue.execution_timeout;
    let mut fsm = Failover::new(limits(&d.req, now, exec));
    // The clock read when the driver was made serves the first selection.
    let mut next = d.select(&mut fsm, now).await;
    loop {
        next = match next {
            Next::Select => {
                let now = d.req.engine.now();
                d.select(&mut fsm, now).await
            }
            Next::Attempt(pick) => match d.attempt(conn, &mut fsm, pick, ctx).await {
                Step::Next(n) => n,
                Step::Done(result) => return result,
            },
            Next::Queue { until, fail_open } => {
                rare(d.queue(conn, &mut fsm, until, fail_open)).await
            }
            Next::RelocateLease => {
                rare(d.relocate_lease()).await;
                fsm.on_lease_relocated()
            }
            Next::Wait { until } => rare(d.combo_wait(conn, until)).await,
            Next::Fallback { model } => d.fall_back(model),
            // A refusal or a gone client: a committed attempt ends the loop itself.
            Next::Answer(a) => return rare(d.answer(conn, a, ctx)).await,
        };
    }
}

/// The failover machine's limits for this request, fixed at dispatch start.
fn limits(req: &Request<'_>, now: Millis, exec: Duration) -> Limits {
    let cfg = &req.snap.config;
    let res = &cfg.resilience;
    Limits {
        max_attempts: cfg.server.max_attempts,
        combo: res.combo_wait.clone(),
        model_cooldown_wait: cfg.models[req.model].cooldown_wait,
        queue_wait: res.queue.wait,
        fail_open: res.queue.fail_open,
        deadline: now.saturating_add(ms(exec)),
        reserve: Limits::reserve_for(exec),
        has_lease: req.lease.is_some(),
        fallback: emergency_fallback(req),
    }
}

/// The `emergency_fallback` model, when it applies to this request (SPEC §5.12): not
/// for a leased session, not the model itself, and only one that serves the family.
fn emergency_fallback(req: &Request<'_>) -> Option<usize> {
    if req.lease.is_some() {
        return None;
    }
    req.snap
        .config
        .emergency_fallback
        .as_deref()
        .and_then(|name| req.snap.model_index(name))
        .filter(|m| *m != req.model && req.snap.serves_family(*m, req.family))
}

/// The permits of the pick the machine is about to run.
struct Slot {
    pick: Pick,
    probe: bool,
    /// When the pick was made: its attempt's start, unless a lane wait comes first.
    at: Millis,
    /// Held for the attempt's whole life (its stream included); released on drop.
    _permit: PermitGuard,
}

enum Step {
    Next(Next),
    Done(super::Answered),
}

/// One request's attempts: what [`run`] drives them with.
pub struct Driver<'a> {
    /// The request being served (its model switches on the fallback hop).
    req: Request<'a>,
    /// The wall-clock time the attempts began at (the first selection's).
    start: Millis,
    deadline: Instant,
    watch: ClientWatch,
    slot: Option<Slot>,
    /// The candidates a queue wait is for.
    full: Vec<Candidate>,
    /// The last upstream error, held for pass-through.
    held: Option<(HeldError, Verdict)>,
}

impl<'a> Driver<'a> {
    /// The driver of `req`'s attempts, which begin now: the execution deadline is fixed
    /// here (SPEC §5.7), and `ctx` keeps the wall-clock reading for the access line.
    pub fn new(req: Request<'a>, ctx: &mut RequestCtx<'_>) -> Self {
        let start = req.engine.now();
        let began = monotonic();
        ctx.wall = Some((start, began));
        let exec = req.snap.config.resilience.queue.execution_timeout;
        Driver {
            deadline: began + exec,
            start,
            req,
            watch: ClientWatch::default(),
            slot: None,
            full: Vec::new(),
            held: None,
        }
    }

    /// Selects at `now`, a clock reading taken just before.
    async fn select(&mut self, fsm: &mut Failover, now: Millis) -> Next {
        let r = &self.req;
        let pin = r.pin_key.as_deref().and_then(|k| r.engine.pinned(k));
        let selection = {
            let asker = asker(r, fsm.tried());
            r.engine
                .select(r.snap, r.model, r.family, &asker, pin.as_deref(), now)
        };
        match selection {
            Selection::Picked {
                pick,
                candidate,
                probe,
                permit,
            } => {
                let limits = crate::engine::select::limits(r.engine, r.snap, r.model, &candidate);
                let (permit, admitted, now) = if limits.is_shared() {
                    // The cluster's answer took a round trip: the clock moved.
                    let (p, admitted) = match limits.admit(permit).await {
                        Ok(p) => (p, true),
                        Err(p) => (p, false),
                    };
                    (p, admitted, self.req.engine.now())
                } else {
                    (permit, true, now)
                };
                self.slot = Some(Slot {
                    pick,
                    probe,
                    at: now,
                    _permit: permit,
                });
                if admitted {
                    return fsm.on_offer(Offer::Picked(pick), now);
                }
                // The cluster is at the cap (SPEC §7.1): wait for it like a local cap,
                // giving back the probe and the local permits meanwhile.
                self.release_slot();
                self.full = vec![candidate];
                fsm.on_offer(Offer::Full, now)
            }
            Selection::Full { full, .. } => {
                self.full = full;
                fsm.on_offer(Offer::Full, now)
            }
            Selection::Empty(excluded) => fsm.on_offer(Offer::Empty(&excluded), now),
        }
    }

    async fn attempt(
        &mut self,
        conn: &mut ClientConn,
        fsm: &mut Failover,
        pick: Pick,
        ctx: &mut RequestCtx<'_>,
    ) -> Step {
        let Some(slot) = self.slot.take().filter(|s| s.pick == pick) else {
            // A pick always comes with its permits; without them, select again.
            return Step::Next(Next::Select);
        };
        ctx.attempts = fsm.attempts() as u32;
        ctx.pick = Some((self.req.model, pick));
        let engine = self.req.engine;
        let inflight = Inflight::start(&self.req, pick);
        let mut probe = slot.probe;
        let (end, started) = self
            .attempt_rounds(conn, pick, slot.at, &mut probe, ctx)
            .await;
        if matches!(end, AttemptEnd::Committed(_)) {
            // No attempt follows a commit: the client's body need not outlive its stream.
            self.req.body.release();
        }
        let info = info(&self.req, pick, started, probe, fsm.is_last_attempt());
        let settled = engine.settle(&info, outcome_of(&end)).await;
        if let Some(v) = &settled.verdict {
            let mut r = record(&self.req, pick, v);
            if let AttemptEnd::Transport(b) = &end {
                // The cause names the failure; the words say what happened (why TLS failed).
                r.reason = b.cause.as_str();
                r.detail = Some(b.what.to_string());
            }
            ctx.records.push(r);
        }
        match end {
            AttemptEnd::Committed(c) => {
                let end = stream(conn, &mut self.watch, &self.req, self.deadline, c).await;
                drop((inflight, slot));
                return Step::Done(stream_ended(engine, &info, end, ctx));
            }
            AttemptEnd::Refused(err) => self.held = settled.verdict.map(|v| (*err, v)),
            AttemptEnd::Transport(..) | AttemptEnd::Deadline | AttemptEnd::ClientGone => {}
        }
        drop((inflight, slot));
        Step::Next(fsm.on_ended(settled.ended, engine.now()))
    }

    /// One attempt, sent again on the same pick while the subscription lane asks for it
    /// (SPEC §5.13): a usage wall it takes, a claimed limit reset, a busy slow slot.
    /// Returns the end to settle and when its round started (anti-herd). A HALF_OPEN
    /// probe is given back before a lane wait (`probe` turns false): the wall showed
    /// the provider answers, and a wait of minutes must not hold its only probe. After
    /// a wait, a connection that stopped being runnable meanwhile (cooled or terminal
    /// by another request) is not sent to again: the busy answer is settled instead.
    async fn attempt_rounds(
        &mut self,
        conn: &mut ClientConn,
        pick: Pick,
        picked_at: Millis,
        probe: &mut bool,
        ctx: &mut RequestCtx<'_>,
    ) -> (AttemptEnd, Millis) {
        let engine = self.req.engine;
        let mut rounds = Rounds::default();
        // The first round starts as the pick is made; a round after a wait, now.
        let mut first = Some(picked_at);
        loop {
            let started = first.take().unwrap_or_else(|| engine.now());
            let call = Call {
                req: &self.req,
                pick,
                deadline: self.deadline,
                slow: engine.lane_active(self.req.snap, pick),
            };
            let end = attempt(conn, &mut self.watch, &call, ctx).await;
            let wait =
                match subscription::after(conn, &mut self.watch, &call, &end, &mut rounds).await {
                    Then::Settle => return (end, started),
                    Then::Gone => return (AttemptEnd::ClientGone, started),
                    Then::Again(wait) => wait,
                };
            if wait.is_zero() {
                continue;
            }
            if std::mem::take(probe) {
                let a = info(&self.req, pick, started, true, false);
                engine.record(&a, Outcome::Abandoned);
            }
            if !rare(self.watch.sleep(conn, wait)).await {
                return (AttemptEnd::ClientGone, started);
            }
            if !self.runnable(pick) {
                return (end, started);
            }
        }
    }

    /// Whether `pick` may still run for this request (not cooling, terminal or leased).
    fn runnable(&self, pick: Pick) -> bool {
        let r = &self.req;
        // Not the request's tried set: it holds this very pick.
        let none_tried = crate::policy::failover::Tried::default();
        let asker = asker(r, &none_tried);
        let c = Candidate {
            target: pick.target,
            provider: pick.provider,
            connection: pick.connection,
            breaker: crate::policy::breaker::BreakerState::Closed,
        };
        r.engine
            .still_runnable(r.snap, r.model, r.family, &asker, &c)
    }

    async fn queue(
        &mut self,
        conn: &mut ClientConn,
        fsm: &mut Failover,
        until: Millis,
        fail_open: bool,
    ) -> Next {
        let engine = self.req.engine;
        let limit = Duration::from_millis(until.saturating_sub(engine.now()));
        let full = std::mem::take(&mut self.full);
        let queued = match wait_for_permit(
            conn,
            &mut self.watch,
            &self.req,
            &full,
            limit,
            fail_open,
        )
        .await
        {
            Permitted::Got(c, permit) => self.recheck(fsm, c, permit),
            Permitted::Full => Queued::Full,
            Permitted::TimedOut => Queued::TimedOut,
            Permitted::ClientGone => return Next::Answer(Answer::ClientGone),
        };
        fsm.on_queued(queued, engine.now())
    }

    /// After a wait of possibly seconds, the connection may have started cooling, gone
    /// terminal or been leased meanwhile, and its breaker must still give a permit.
    fn recheck(&mut self, fsm: &Failover, c: Candidate, permit: PermitGuard) -> Queued {
        let r = &self.req;
        let asker = asker(r, fsm.tried());
        if !r
            .engine
            .still_runnable(r.snap, r.model, r.family, &asker, &c)
        {
            return Queued::NotRunnable;
        }
        let now = r.engine.now();
        let probe = match r.engine.breaker_permit(r.snap, c.provider, now) {
            Permit::Allow => false,
            Permit::Probe => true,
            Permit::Deny { .. } => {
                return Queued::BreakerDenied {
                    provider: c.provider,
                }
            }
        };
        let pick = Pick::from(c);
        self.slot = Some(Slot {
            pick,
            probe,
            at: now,
            _permit: permit,
        });
        Queued::Got(pick)
    }

    /// Moves a lease whose connection became ineligible (same generation), durably.
    async fn relocate_lease(&mut self) {
        let r = &self.req;
        let (Some(lease), Some(client)) = (&r.lease, r.client) else {
            return;
        };
        if let Some(moved) = r.engine.lease_relocate(r.snap, client, lease).await {
            if moved.connection != lease.connection {
                self.req.lease = Some(moved);
            }
        }
    }

    async fn combo_wait(&mut self, conn: &mut ClientConn, until: Millis) -> Next {
        let r = &self.req;
        let wait = Duration::from_millis(until.saturating_sub(r.engine.now()));
        tracing::info!(model = %r.snap.config.models[r.model].name, wait_ms = wait.as_millis() as u64, "combo wait");
        if self.watch.sleep(conn, wait).await {
            Next::Select
        } else {
            Next::Answer(Answer::ClientGone)
        }
    }

    fn fall_back(&mut self, model: usize) -> Next {
        let cfg = &self.req.snap.config;
        tracing::warn!(model = %cfg.models[self.req.model].name, fallback = %cfg.models[model].name, "no runnable target: trying the emergency fallback model");
        self.req.model = model;
        self.req.pin_key = None;
        Next::Select
    }

    async fn answer(
        &mut self,
        conn: &mut ClientConn,
        answer: Answer,
        ctx: &mut RequestCtx<'_>,
    ) -> super::Answered {
        self.release_slot();
        match answer {
            Answer::Committed => Ok(()),
            Answer::ClientGone => {
                ctx.status = 499;
                ctx.note = Some("client_gone");
                Ok(())
            }
            Answer::PassThrough => match self.held.take() {
                Some((err, v)) => {
                    ctx.pick = Some((self.req.model, err.pick));
                    respond::pass_through(conn, err, &v, ctx).await
                }
                None => {
                    let r = Refusal {
                        code: ErrorCode::UpstreamUnavailable,
                        retry_after: None,
                        reset_at: None,
                        excluded: Vec::new(),
                        with_attempts: true,
                    };
                    self.refuse(conn, &r, ctx).await
                }
            },
            Answer::Refuse(r) => self.refuse(conn, &r, ctx).await,
        }
    }

    async fn refuse(
        &self,
        conn: &mut ClientConn,
        r: &Refusal,
        ctx: &mut RequestCtx<'_>,
    ) -> super::Answered {
        let engine = self.req.engine;
        let now = engine.now();
        let model = &self.req.snap.config.models[self.req.model].name;
        for e in &r.excluded {
            tracing::warn!(
                model = %model,
                provider = %e.provider,
                connection = %e.connection,
                upstream_model = %e.model,
                reason = e.reason.as_str(),
                remaining_s = e.until.map(|u| retry_after_secs(u, now)).unwrap_or(0),
                "target excluded"
            );
        }
        let queue_label = match r.code {
            ErrorCode::QueueFull => Some(crate::metrics::QUEUE_REJECTIONS[0]),
            ErrorCode::QueueTimeout => Some(crate::metrics::QUEUE_REJECTIONS[1]),
            _ => None,
        };
        if let Some(label) = queue_label {
            engine
                .metrics
                .queue_rejections_total
                .with_label_values(&[label])
                .inc();
        }
        let e = respond::refusal_error(&self.req, r, ctx, now);
        respond::finish_error(conn, self.req.family, e, ctx).await
    }

    /// A probe taken for an attempt that will not run goes back to the breaker (the
    /// permit is released when the slot drops).
    fn release_slot(&mut self) {
        if let Some(slot) = self.slot.take() {
            if slot.probe {
                let now = self.req.engine.now();
                let info = info(&self.req, slot.pick, now, true, false);
                self.req.engine.record(&info, Outcome::Abandoned);
            }
        }
    }
}

/// Who asks for candidates: the request's client and lease, and what it already tried.
fn asker<'r>(req: &'r Request<'_>, tried: &'r crate::policy::failover::Tried) -> Asker<'r> {
    Asker {
        client: req.client,
        lease: req
            .lease
            .as_ref()
            .map(|l| (l.owner_hash.as_str(), l.connection.as_str())),
        tried,
    }
}

/// One attempt as the failure memory records it.
/// `started` is when the attempt began: failures of attempts that started before the
/// current cooldown was set do not extend it (anti-thundering-herd, SPEC §5.3).
fn info<'r>(
    req: &'r Request<'_>,
    pick: Pick,
    started: Millis,
    probe: bool,
    last: bool,
) -> AttemptInfo<'r> {
    AttemptInfo {
        snap: req.snap,
        model: req.model,
        pick,
        started,
        probe,
        last,
        pin: req.pin_key.as_deref(),
        request_scoped_4xx: req.route.final_4xx(),
    }
}

/// The failure memory's view of an attempt's end.
fn outcome_of(end: &AttemptEnd) -> AttemptOutcome<'_> {
    match end {
        AttemptEnd::Committed(c) => AttemptOutcome::Committed {
            headers: &*c.head,
            latency: c.latency,
        },
        AttemptEnd::Refused(e) => AttemptOutcome::Refused {
            status: e.status,
            headers: &e.headers,
            body: &e.body,
        },
        AttemptEnd::Transport(b) => AttemptOutcome::Transport {
            kind: b.kind,
            cause: b.cause.as_str(),
            what: &b.what,
        },
        AttemptEnd::Deadline => AttemptOutcome::Deadline,
        AttemptEnd::ClientGone => AttemptOutcome::ClientGone,
    }
}

/// How a committed stream's end is settled and reported to the gateway.
fn stream_ended(
    engine: &crate::engine::Engine,
    info: &AttemptInfo<'_>,
    end: StreamEnd,
    ctx: &mut RequestCtx<'_>,
) -> super::Answered {
    let StreamEnd::Aborted { reason, cut } = end else {
        return Ok(());
    };
    engine.settle_stream(info, reason);
    ctx.note = Some(reason.as_str());
    if cut {
        return Err(super::Stop::Cut);
    }
    Ok(())
}

/// (provider, connection, upstream model) of a pick.
fn names(req: &Request<'_>, pick: Pick) -> (String, String, String) {
    let cfg = &req.snap.config;
    let p = &cfg.providers[pick.provider];
    (
        p.id.clone(),
        p.connections[pick.connection].id.clone(),
        req.snap
            .upstream_model(req.model, pick.target, &req.body.model)
            .to_owned(),
    )
}

/// `diagnostics.attempts[]` entry of a failed attempt.
fn record(req: &Request<'_>, pick: Pick, v: &Verdict) -> AttemptRecord {
    let (provider, connection, model) = names(req, pick);
    AttemptRecord {
        provider,
        connection,
        model,
        status: (v.status != 0).then_some(v.status),
        reason: v.class.reason.as_str(),
        detail: None,
    }
}
