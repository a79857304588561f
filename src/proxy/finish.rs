//! The finish phase (SPEC §2 step 6): exactly once per request, the request counters
//! and latency histograms, then the access line.
//!
//! It only reads what the request left in its `RequestCtx` and the session; it never
//! changes routing state (the pipeline records outcomes as attempts end), so a request
//! that dies anywhere — rejected at admission, cut mid-stream, dropped by the client —
//! is counted and logged the same way.

use super::access::{AccessLog, Entry};
use super::routes::Route;
use super::RequestCtx;
use super::Stop;
use crate::engine::Engine;
use crate::http1::RequestHead;

/// Records `ctx`'s request in the metrics and writes its access line.
pub fn record(
    engine: &Engine,
    log: &AccessLog,
    head: &RequestHead,
    bytes_out: u64,
    e: Option<&Stop>,
    ctx: &RequestCtx<'_>,
) {
    let m = &engine.metrics;
    let route = ctx.route.map(Route::label).unwrap_or("unmatched");
    // Nothing was answered and the request failed: the client went away (nginx's 499).
    let status = if ctx.status == 0 && e.is_some() {
        499
    } else {
        ctx.status
    };
    let hot = match (&ctx.snap, ctx.model, ctx.route) {
        (Some(snap), Some(model), Some(r)) => Some((&snap.hot, model, r)),
        _ => None,
    };
    let kept = hot.filter(|_| status == 200).and_then(|(hot, model, r)| {
        hot.requests_ok(m, model, (r as usize, r.label()), ctx.model_label())
    });
    match kept {
        Some(counter) => counter.inc(),
        None => {
            let mut code = [0u8; 3];
            m.requests_total
                .with_label_values(&[route, ctx.model_label(), status_label(status, &mut code)])
                .inc();
        }
    }
    let finished = crate::clock::monotonic();
    let elapsed = finished.saturating_duration_since(ctx.started);
    if let Some((hot, model, _)) = hot.filter(|(_, _, r)| *r != Route::Models) {
        hot.duration(m, model, ctx.model_label())
            .observe(elapsed.as_secs_f64());
        if let Some(t) = ctx.ttfb {
            hot.ttfb(m, model, ctx.model_label())
                .observe(t.as_secs_f64());
        }
    }
    if !log.enabled() {
        return;
    }
    let (provider, connection, upstream_model) = ctx.names().unwrap_or(("", "", ""));
    log.write(&Entry {
        at: ctx.wall_at(finished).unwrap_or_else(|| engine.now()),
        method: head.method(),
        path: head.path(),
        route,
        client: ctx.client_id.as_deref(),
        model: ctx.model_label(),
        status,
        attempts: ctx.attempts,
        provider,
        connection,
        upstream_model,
        failed: &ctx.records,
        note: ctx.note,
        ttfb_ms: ctx.ttfb.map(|t| t.as_millis() as u64),
        duration_ms: elapsed.as_millis() as u64,
        bytes_out: bytes_out as usize,
        error: e.map(Stop::label),
    });
}

/// A status code's three digits without allocating (statuses are 100–999; anything
/// else, which Sluice never sets, is labelled by its own digits through a fallback).
fn status_label(status: u16, buf: &mut [u8; 3]) -> &str {
    if !(100..=999).contains(&status) {
        return if status == 0 { "0" } else { "other" };
    }
    buf[0] = b'0' + (status / 100) as u8;
    buf[1] = b'0' + (status / 10 % 10) as u8;
    buf[2] = b'0' + (status % 10) as u8;
    std::str::from_utf8(buf).unwrap_or("other")
}

#[cfg(test)]
mod tests {
    use super::status_label;

    #[test]
    fn status_labels_are_the_codes_digits() {
        let mut b = [0; 3];
        assert_eq!(status_label(200, &mut b), "200");
        assert_eq!(status_label(499, &mut b), "499");
        assert_eq!(status_label(503, &mut b), "503");
        assert_eq!(status_label(0, &mut b), "0");
        assert_eq!(status_label(1000, &mut b), "other");
    }
}
