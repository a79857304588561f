//! Target and connection choice for one attempt (SPEC §5.12), as pure functions.
//!
//! The caller passes the runnable candidates (already filtered by family, client scope,
//! exclusions and what this request has tried) and the model's mutable routing state;
//! nothing here blocks or does I/O, and a pick is always one of the offered indices.
//! [`ModelRouting::pick_view`] is the entry point for every strategy. The target-level
//! strategies (`priority`, `weighted`, `round-robin`, `random`, `cost-optimized`) choose
//! a target and then rotate over its offered connections; the load-aware ones
//! (`least-used`, `p2c`, `fill-first`, `reset-aware`, in `load`) rank (target,
//! connection) views directly. Every strategy but `priority` avoids views of DEGRADED
//! providers while any other view exists. Rotation state is per model (strategy) and
//! per target (connection rotation), so one model's traffic does not skew another's.
//! The inputs of the load-aware strategies come from [`LatencyWindow`] (p2c) and
//! [`parse_rate_limit`] (reset-aware).

mod latency;
mod load;
mod rate_limit;
#[cfg(test)]
mod view_tests;

pub use latency::{LatencyWindow, LATENCY_MAX_AGE_MS, LATENCY_MIN_SAMPLES, LATENCY_SAMPLES};
pub use rate_limit::{parse_rate_limit, RateLimitInfo};

use crate::config::Strategy;
use crate::policy::Millis;
use std::collections::BTreeMap;

/// One eligible target as a target-level strategy sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Offer {
    /// Index into the model's target list.
    pub target: usize,
    pub weight: u32,
    pub cost: Option<f64>,
}

/// One runnable (target, connection) pair as a strategy sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct View {
    /// Index in the model's targets (target order = priority order).
    pub target: usize,
    /// Index in the provider's connections.
    pub connection: usize,
    pub weight: u32,
    pub cost: Option<f64>,
    /// Attempts in flight on this connection now.
    pub inflight: u32,
    /// `max_concurrent` of the connection (`None` = unlimited).
    pub cap: Option<u32>,
    /// Mean TTFB over the last samples, only with ≥ 3 samples ([`LatencyWindow::mean`]).
    pub latency_ms: Option<f64>,
    /// Upstream-reported remaining requests (rate-limit headers), if known.
    pub remaining: Option<u64>,
    /// When the upstream quota window resets, if known.
    pub reset_at: Option<Millis>,
    /// The provider's breaker is DEGRADED.
    pub degraded: bool,
}

/// Mutable routing state of one model.
#[derive(Debug, Default, Clone)]
pub struct ModelRouting {
    /// Each target's configured weight, by target index.
    weights: Vec<u32>,
    /// Smooth weighted round-robin "current weight" per target, over all the model's
    /// targets: it says whose turn it is ([`ModelRouting::weighted_turn`]).
    current: Vec<i64>,
    /// The same over the offered targets only, used while the target whose turn it is
    /// cannot take the pick.
    spare: Vec<i64>,
    /// Next start position for round-robin over target indices.
    rr_next: usize,
    /// Next connection position per target index.
    conn_next: Vec<usize>,
    /// (target, connection) of the last view picked by a load-aware tie rotation.
    view_last: Option<(usize, usize)>,
}

impl ModelRouting {
    /// The routing state of a model whose targets have these weights (in target order).
    pub fn new(weights: &[u32]) -> Self {
        let targets = weights.len();
        Self {
            weights: weights.to_vec(),
            current: vec![0; targets],
            spare: vec![0; targets],
            rr_next: 0,
            conn_next: vec![0; targets],
            view_last: None,
        }
    }

    /// Picks one view; `None` only when `views` is empty. Never returns an index outside
    /// `views`. `random` holds two values in `[0, 1)` from the caller: `random.0` drives
    /// `random` and the first `p2c` draw, `random.1` the second `p2c` draw.
    /// `p2c_latency_weight` is the model's weight of the p2c latency term (0 = off).
    pub fn pick_view(
        &mut self,
        strategy: Strategy,
        views: &[View],
        random: (f64, f64),
        p2c_latency_weight: f64,
    ) -> Option<usize> {
        let healthy = views.iter().any(|v| !v.degraded);
        let pool: Vec<usize> = (0..views.len())
            .filter(|&i| strategy == Strategy::Priority || !healthy || !views[i].degraded)
            .collect();
        let chosen = match strategy {
            Strategy::Priority
            | Strategy::Weighted
            | Strategy::RoundRobin
            | Strategy::Random
            | Strategy::CostOptimized => {
                self.target_then_connection(strategy, views, &pool, random.0)
            }
            Strategy::LeastUsed => load::least_used(views, &pool, &mut self.view_last),
            Strategy::P2c => load::p2c(views, &pool, random, p2c_latency_weight),
            Strategy::FillFirst => load::fill_first(views, &pool),
            Strategy::ResetAware => load::reset_aware(views, &pool, &mut self.view_last),
        };
        // Every strategy returns a member of `pool`; the fallback only guards the contract.
        chosen
            .filter(|&i| i < views.len())
            .or_else(|| pool.first().copied())
    }

    /// Target-level strategies over views: the targets present in `pool` become offers
    /// (in target order), the strategy picks one, then its connections rotate.
    fn target_then_connection(
        &mut self,
        strategy: Strategy,
        views: &[View],
        pool: &[usize],
        random: f64,
    ) -> Option<usize> {
        let mut by_target: BTreeMap<usize, Offer> = BTreeMap::new();
        for v in pool.iter().map(|&i| &views[i]) {
            by_target.entry(v.target).or_insert(Offer {
                target: v.target,
                weight: v.weight,
                cost: v.cost,
            });
        }
        let offers: Vec<Offer> = by_target.into_values().collect();
        let target = self.pick(strategy, &offers, random)?;
        let in_target = || pool.iter().copied().filter(|&i| views[i].target == target);
        let connections: Vec<usize> = in_target().map(|i| views[i].connection).collect();
        let connection = self.pick_connection(target, &connections)?;
        in_target().find(|&i| views[i].connection == connection)
    }

    /// Picks one offered target; `None` only when `offers` is empty. `random` is a value
    /// in `[0, 1)` supplied by the caller, used by the `random` strategy. This level has no
    /// load data, so the load-aware strategies fall back here: `least-used` rotates like
    /// `round-robin`, `p2c` draws like `random`, `fill-first` and `reset-aware` take the
    /// first offer like `priority`; [`ModelRouting::pick_view`] gives their real behaviour.
    pub fn pick(&mut self, strategy: Strategy, offers: &[Offer], random: f64) -> Option<usize> {
        let first = offers.first()?;
        let chosen = match strategy {
            Strategy::Priority | Strategy::FillFirst | Strategy::ResetAware => first.target,
            Strategy::Weighted => self.smooth_weighted(offers),
            Strategy::RoundRobin | Strategy::LeastUsed => self.round_robin(offers),
            Strategy::Random | Strategy::P2c => {
                offers
                    .get(index(random, offers.len()))
                    .unwrap_or(first)
                    .target
            }
            Strategy::CostOptimized => offers
                .iter()
                .enumerate()
                .min_by(|(ia, a), (ib, b)| {
                    let ca = a.cost.unwrap_or(f64::INFINITY);
                    let cb = b.cost.unwrap_or(f64::INFINITY);
                    ca.total_cmp(&cb).then(ia.cmp(ib))
                })
                .map_or(first.target, |(_, o)| o.target),
        };
        Some(chosen)
    }

    /// The first offered target at or after the rotation point, wrapping.
    fn round_robin(&mut self, offers: &[Offer]) -> usize {
        let highest = offers.iter().map(|o| o.target).max().unwrap_or(0);
        let n = self.weights.len().max(highest + 1);
        let start = self.rr_next % n;
        let best = offers
            .iter()
            .min_by_key(|o| (o.target + n - start) % n)
            .map_or(0, |o| o.target);
        self.rr_next = best + 1;
        best
    }

    /// `weighted`: nginx-style smooth weighted round-robin. The turn goes round all the
    /// model's targets (every target gains its weight, the largest wins and pays back
    /// the total), so over any `sum(weights)` turns each target has `weight` of them.
    /// When the target whose turn it is is not offered, the turn waits for it (nothing
    /// moves) and the pick is made by a second smooth weighted round-robin over the
    /// offered targets only: while a target is out, the others share its picks in
    /// proportion to their weights, and it gets no backlog when it returns. A caller
    /// that checks only the turn's target ([`ModelRouting::weighted_turn`]) and finds
    /// it usable makes the pick this makes from any offer that includes it.
    fn smooth_weighted(&mut self, offers: &[Offer]) -> usize {
        if let Some(turn) = self
            .weighted_turn()
            .filter(|&t| offers.iter().any(|o| o.target == t))
        {
            self.take_weighted_turn(turn);
            return turn;
        }
        let members = offers.iter().map(|o| (o.target, o.weight));
        let best = leader(&self.spare, members.clone()).unwrap_or(offers[0].target);
        advance(&mut self.spare, members, best);
        best
    }

    /// Whose turn it is in the smooth weighted round-robin over all the model's
    /// targets. Reading it changes nothing; `None` for a model without targets.
    pub fn weighted_turn(&self) -> Option<usize> {
        leader(&self.current, self.weights.iter().copied().enumerate())
    }

    /// Gives the turn to `turn` (the value of [`ModelRouting::weighted_turn`]).
    pub fn take_weighted_turn(&mut self, turn: usize) {
        advance(
            &mut self.current,
            self.weights.iter().copied().enumerate(),
            turn,
        );
    }

    /// Rotates through the offered connection indices of `target`, round-robin: the
    /// first offered one at or after the rotation point, wrapping to the smallest.
    pub fn pick_connection(&mut self, target: usize, offered: &[usize]) -> Option<usize> {
        let start = self.connection_start(target);
        let best = offered.iter().copied().min_by_key(|&c| (c < start, c))?;
        self.picked_connection(target, best);
        Some(best)
    }

    /// Where the connection rotation of `target` starts: a caller that checks the
    /// target's connections one by one from here, wrapping, and takes the first usable
    /// one gets what [`ModelRouting::pick_connection`] would pick among all usable ones.
    pub fn connection_start(&self, target: usize) -> usize {
        self.conn_next.get(target).copied().unwrap_or(0)
    }

    /// Records `connection` as the pick of `target`'s rotation.
    pub fn picked_connection(&mut self, target: usize, connection: usize) {
        if target >= self.conn_next.len() {
            self.conn_next.resize(target + 1, 0);
        }
        self.conn_next[target] = connection + 1;
    }

    /// Forgets where `target`'s connection rotation stands (tests: the rotation point of
    /// a one-connection target is never read, so it is left out of comparisons).
    #[cfg(test)]
    pub fn reset_rotation(&mut self, target: usize) {
        if let Some(n) = self.conn_next.get_mut(target) {
            *n = 0;
        }
    }

    /// Where round-robin over `targets` targets starts (the first target to offer).
    pub fn round_robin_start(&self, targets: usize) -> usize {
        self.rr_next % self.weights.len().max(targets).max(1)
    }

    /// (target, connection) of the last pick of a load-aware tie rotation.
    pub fn last_rotated(&self) -> Option<(usize, usize)> {
        self.view_last
    }

    /// Records a pick of a load-aware tie rotation.
    pub fn rotated(&mut self, key: (usize, usize)) {
        self.view_last = Some(key);
    }
}

/// One step of smooth weighted round-robin over `members` (target, weight) whose current
/// weights are in `current` (a missing entry is 0): the member whose current weight plus
/// its weight is largest, the first on a tie. Changes nothing.
fn leader(current: &[i64], members: impl Iterator<Item = (usize, u32)>) -> Option<usize> {
    let mut best = None;
    let mut best_w = i64::MIN;
    for (t, w) in members {
        let v = current.get(t).copied().unwrap_or(0) + i64::from(w);
        if v > best_w {
            best_w = v;
            best = Some(t);
        }
    }
    best
}

/// The step [`leader`] chose: every member gains its weight, `winner` pays back their
/// total.
fn advance(current: &mut Vec<i64>, members: impl Iterator<Item = (usize, u32)>, winner: usize) {
    let mut total = 0;
    for (t, w) in members {
        if t >= current.len() {
            current.resize(t + 1, 0);
        }
        current[t] += i64::from(w);
        total += i64::from(w);
    }
    if let Some(c) = current.get_mut(winner) {
        *c -= total;
    }
}

/// `p2c` between two drawn views: true when the second (`b`) wins, i.e. scores lower
/// (the first drawn wins a tie).
pub fn p2c_second_wins(a: &View, b: &View, latency_weight: f64) -> bool {
    let (sa, sb) = load::p2c_scores(a, b, latency_weight);
    sb < sa
}

/// A uniform draw `random ∈ [0, 1)` as an index below `n` (`n ≥ 1`); out-of-range or
/// NaN draws are clamped, so the result is always `< n`.
fn index(random: f64, n: usize) -> usize {
    if random.is_nan() || random <= 0.0 {
        return 0;
    }
    ((random * n as f64) as usize).min(n.saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offers(ws: &[u32]) -> Vec<Offer> {
        ws.iter()
            .enumerate()
            .map(|(i, w)| Offer {
                target: i,
                weight: *w,
                cost: None,
            })
            .collect()
    }

    #[test]
    fn priority_takes_first_offered() {
        let mut r = ModelRouting::new(&[1; 3]);
        let o = &offers(&[1, 1, 1])[1..];
        assert_eq!(r.pick(Strategy::Priority, o, 0.0), Some(1));
        assert_eq!(r.pick(Strategy::Priority, &[], 0.0), None);
    }

    #[test]
    fn weighted_matches_weights_exactly_per_cycle() {
        let mut r = ModelRouting::new(&[5, 1, 1]);
        let o = offers(&[5, 1, 1]);
        let mut counts = [0; 3];
        let mut seq = Vec::new();
        for _ in 0..70 {
            let t = r.pick(Strategy::Weighted, &o, 0.0).unwrap();
            counts[t] += 1;
            seq.push(t);
        }
        assert_eq!(counts, [50, 10, 10]);
        // Smooth: the heavy target never runs more than 5 in a row.
        assert_eq!(&seq[..7], &[0, 0, 1, 0, 2, 0, 0]);
    }

    #[test]
    fn weighted_shares_an_absent_target_by_weight_and_owes_it_nothing() {
        let mut r = ModelRouting::new(&[2, 3, 5]);
        let all = offers(&[2, 3, 5]);
        let without_2 = &all[..2];
        let mut counts = [0u32; 3];
        for _ in 0..1000 {
            counts[r.pick(Strategy::Weighted, without_2, 0.0).unwrap()] += 1;
        }
        // 2 : 3 between the two left (a few picks by turn before target 2's came).
        assert!(counts[2] == 0 && counts[0].abs_diff(400) <= 3, "{counts:?}");
        // Back: the cycle goes on where it stopped, no catching up on missed turns.
        let mut back = [0; 3];
        for _ in 0..10 {
            back[r.pick(Strategy::Weighted, &all, 0.0).unwrap()] += 1;
        }
        assert_eq!(back, [2, 3, 5]);
    }

    #[test]
    fn the_weighted_turn_is_the_pick_of_any_offer_holding_it() {
        let all = offers(&[4, 1, 2, 3]);
        let mut r = ModelRouting::new(&[4, 1, 2, 3]);
        for i in 0..50 {
            let turn = r.weighted_turn().unwrap();
            // An offer with the turn's target and some others, varying.
            let some: Vec<Offer> = all
                .iter()
                .copied()
                .filter(|o| o.target == turn || (o.target + i) % 3 == 0)
                .collect();
            let mut by_turn = r.clone();
            by_turn.take_weighted_turn(turn);
            assert_eq!(r.pick(Strategy::Weighted, &some, 0.0), Some(turn));
            assert_eq!(format!("{r:?}"), format!("{by_turn:?}"));
        }
    }

    #[test]
    fn round_robin_rotates_and_skips_missing() {
        let mut r = ModelRouting::new(&[1; 3]);
        let all = offers(&[1, 1, 1]);
        let picks: Vec<_> = (0..6)
            .map(|_| r.pick(Strategy::RoundRobin, &all, 0.0).unwrap())
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        let without_1 = vec![all[0], all[2]];
        assert_eq!(r.pick(Strategy::RoundRobin, &without_1, 0.0), Some(0));
        assert_eq!(r.pick(Strategy::RoundRobin, &without_1, 0.0), Some(2));
    }

    #[test]
    fn cost_optimized_prefers_cheapest_then_order() {
        let mut r = ModelRouting::new(&[1; 3]);
        let o = vec![
            Offer {
                target: 0,
                weight: 1,
                cost: None,
            },
            Offer {
                target: 1,
                weight: 1,
                cost: Some(2.0),
            },
            Offer {
                target: 2,
                weight: 1,
                cost: Some(0.5),
            },
        ];
        assert_eq!(r.pick(Strategy::CostOptimized, &o, 0.0), Some(2));
        assert_eq!(r.pick(Strategy::CostOptimized, &o[..2], 0.0), Some(1));
    }

    #[test]
    fn random_stays_in_range() {
        let mut r = ModelRouting::new(&[1; 2]);
        let o = offers(&[1, 1]);
        assert_eq!(r.pick(Strategy::Random, &o, 0.0), Some(0));
        assert_eq!(r.pick(Strategy::Random, &o, 0.99), Some(1));
        assert_eq!(r.pick(Strategy::Random, &o, 1.0), Some(1));
    }

    #[test]
    fn connections_rotate_over_offered() {
        let mut r = ModelRouting::new(&[1; 1]);
        let picks: Vec<_> = (0..4)
            .map(|_| r.pick_connection(0, &[0, 1, 2]).unwrap())
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0]);
        assert_eq!(r.pick_connection(0, &[0, 2]), Some(2));
        assert_eq!(r.pick_connection(0, &[0, 2]), Some(0));
        assert_eq!(r.pick_connection(0, &[]), None);
    }
}
