//! Load-aware strategies (SPEC §5.12): `least-used`, `p2c`, `fill-first`, `reset-aware`.
//!
//! Unlike the target-level strategies they rank individual (target, connection) views.
//! Each function takes the views and a pool of indices into them (the candidates left
//! after the DEGRADED filter) and returns one member of the pool, `None` only for an
//! empty pool. Ties the definition leaves open are broken by rotation (`rotate`) where
//! equal candidates should share the load, and by (target, connection) order where the
//! strategy is about order (`fill-first`).

use super::{index, View};
use crate::policy::Millis;
use std::cmp::Reverse;

/// (target, connection): the identity and the priority order of a view.
type Key = (usize, usize);

fn key(v: &View) -> Key {
    (v.target, v.connection)
}

/// Round-robin among `tied`: the first one (by key) after the last rotated pick,
/// wrapping to the smallest key. Independent of the order in which views are offered.
fn rotate(views: &[View], tied: &[usize], last: &mut Option<Key>) -> Option<usize> {
    let prev = *last;
    let by_key = |i: &usize| key(&views[*i]);
    let chosen = tied
        .iter()
        .copied()
        .filter(|i| prev.is_some_and(|p| key(&views[*i]) > p))
        .min_by_key(by_key)
        .or_else(|| tied.iter().copied().min_by_key(by_key))?;
    *last = Some(key(&views[chosen]));
    Some(chosen)
}

/// `least-used`: the fewest attempts in flight; equal load rotates.
pub(super) fn least_used(views: &[View], pool: &[usize], last: &mut Option<Key>) -> Option<usize> {
    let min = pool.iter().map(|&i| views[i].inflight).min()?;
    let tied: Vec<usize> = pool
        .iter()
        .copied()
        .filter(|&i| views[i].inflight == min)
        .collect();
    rotate(views, &tied, last)
}

/// `p2c`: two distinct views drawn uniformly (`random.0` for the first, `random.1` for
/// the second among the rest), the lower score wins, the first drawn on a tie.
pub(super) fn p2c(
    views: &[View],
    pool: &[usize],
    random: (f64, f64),
    latency_weight: f64,
) -> Option<usize> {
    let first = index(random.0, pool.len());
    let a = *pool.get(first)?;
    if pool.len() == 1 {
        return Some(a);
    }
    let mut second = index(random.1, pool.len() - 1);
    if second >= first {
        second += 1;
    }
    let Some(&b) = pool.get(second) else {
        return Some(a);
    };
    let (score_a, score_b) = p2c_scores(&views[a], &views[b], latency_weight);
    Some(if score_b < score_a { b } else { a })
}

/// In-flight count, plus `weight × latency / mean latency of the pair` when the weight
/// is positive and both views have a latency (which they only have from 3 samples on).
pub(super) fn p2c_scores(a: &View, b: &View, weight: f64) -> (f64, f64) {
    let (mut sa, mut sb) = (f64::from(a.inflight), f64::from(b.inflight));
    if weight > 0.0 {
        if let (Some(la), Some(lb)) = (a.latency_ms, b.latency_ms) {
            let mean = (la + lb) / 2.0;
            if mean.is_finite() && mean > 0.0 {
                sa += weight * la / mean;
                sb += weight * lb / mean;
            }
        }
    }
    (sa, sb)
}

/// `fill-first`: the first view in (target, connection) order with a free slot (no cap
/// = always free); when all are full, the lowest `inflight / cap`, earliest on a tie.
pub(super) fn fill_first(views: &[View], pool: &[usize]) -> Option<usize> {
    let mut ordered = pool.to_vec();
    ordered.sort_by_key(|&i| key(&views[i]));
    let free = ordered.iter().copied().find(|&i| {
        let v = &views[i];
        v.cap.is_none_or(|cap| v.inflight < cap)
    });
    free.or_else(|| {
        ordered
            .iter()
            .copied()
            .min_by(|&a, &b| fill_ratio(&views[a]).total_cmp(&fill_ratio(&views[b])))
    })
}

fn fill_ratio(v: &View) -> f64 {
    match v.cap {
        None => 0.0,
        Some(0) => f64::INFINITY,
        Some(cap) => f64::from(v.inflight) / f64::from(cap),
    }
}

/// `reset-aware`: known remaining capacity first (most remaining, then earliest reset),
/// then unknown capacity (earliest known reset first), then exhausted ones (earliest
/// reset first). Views that rank exactly equal rotate.
pub(super) fn reset_aware(views: &[View], pool: &[usize], last: &mut Option<Key>) -> Option<usize> {
    let best = pool.iter().map(|&i| reset_rank(&views[i])).min()?;
    let tied: Vec<usize> = pool
        .iter()
        .copied()
        .filter(|&i| reset_rank(&views[i]) == best)
        .collect();
    rotate(views, &tied, last)
}

/// Smaller ranks first: (class, most remaining, earliest reset; unknown reset last).
fn reset_rank(v: &View) -> (u8, Reverse<u64>, Millis) {
    let reset = v.reset_at.unwrap_or(Millis::MAX);
    match v.remaining {
        Some(left) if left > 0 => (0, Reverse(left), reset),
        None => (1, Reverse(0), reset),
        Some(_) => (2, Reverse(0), reset),
    }
}
