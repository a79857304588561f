//! Target and connection choice for one attempt (SPEC §5.12), as pure functions.
//!
//! The caller passes the eligible targets (already filtered by family, client scope and
//! what this request has tried) and the model's mutable routing state; the functions
//! never pick an index that was not offered and never block. Rotation state is per
//! model (strategy) and per target (connection rotation), so one model's traffic does
//! not skew another's.

use crate::config::Strategy;

/// One eligible target as the strategy sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Offer {
    /// Index into the model's target list.
    pub target: usize,
    pub weight: u32,
    pub cost: Option<f64>,
}

/// Mutable routing state of one model.
#[derive(Debug, Default, Clone)]
pub struct ModelRouting {
    /// Smooth weighted round-robin "current weight" per target index.
    current: Vec<i64>,
    /// Next start position for round-robin over target indices.
    rr_next: usize,
    /// Next connection position per target index.
    conn_next: Vec<usize>,
}

impl ModelRouting {
    pub fn new(targets: usize) -> Self {
        Self {
            current: vec![0; targets],
            rr_next: 0,
            conn_next: vec![0; targets],
        }
    }

    /// Picks one offered target; `None` only when `offers` is empty. `random` is a value
    /// in `[0, 1)` supplied by the caller, used by the `random` strategy.
    pub fn pick(&mut self, strategy: Strategy, offers: &[Offer], random: f64) -> Option<usize> {
        if offers.is_empty() {
            return None;
        }
        let chosen = match strategy {
            Strategy::Priority => offers[0].target,
            Strategy::Weighted => self.smooth_weighted(offers),
            Strategy::RoundRobin => {
                // The first offered target at or after the rotation point, wrapping.
                let n = self.current.len().max(1);
                let start = self.rr_next % n;
                let best = offers
                    .iter()
                    .min_by_key(|o| (o.target + n - start) % n)
                    .map(|o| o.target)
                    .unwrap_or(offers[0].target);
                self.rr_next = best + 1;
                best
            }
            Strategy::Random => {
                let i = ((random.clamp(0.0, 0.999_999) * offers.len() as f64) as usize)
                    .min(offers.len() - 1);
                offers[i].target
            }
            Strategy::CostOptimized => offers
                .iter()
                .enumerate()
                .min_by(|(ia, a), (ib, b)| {
                    let ca = a.cost.unwrap_or(f64::INFINITY);
                    let cb = b.cost.unwrap_or(f64::INFINITY);
                    ca.total_cmp(&cb).then(ia.cmp(ib))
                })
                .map(|(_, o)| o.target)
                .unwrap_or(offers[0].target),
        };
        Some(chosen)
    }

    /// nginx-style smooth weighted round-robin over the offered subset: every offered
    /// target gains its weight, the largest wins and pays back the offered total. Over
    /// any window of `sum(weights)` picks each target is chosen `weight` times.
    fn smooth_weighted(&mut self, offers: &[Offer]) -> usize {
        let total: i64 = offers.iter().map(|o| o.weight as i64).sum();
        let mut best = offers[0].target;
        let mut best_w = i64::MIN;
        for o in offers {
            if o.target >= self.current.len() {
                self.current.resize(o.target + 1, 0);
            }
            self.current[o.target] += o.weight as i64;
            if self.current[o.target] > best_w {
                best_w = self.current[o.target];
                best = o.target;
            }
        }
        self.current[best] -= total;
        best
    }

    /// Rotates through the offered connection indices of `target`, round-robin.
    pub fn pick_connection(&mut self, target: usize, offered: &[usize]) -> Option<usize> {
        if offered.is_empty() {
            return None;
        }
        if target >= self.conn_next.len() {
            self.conn_next.resize(target + 1, 0);
        }
        let start = self.conn_next[target];
        // Connection indices are small; pick the first offered one at or after `start`.
        let span = offered.iter().max().copied().unwrap_or(0) + 1;
        let best = offered
            .iter()
            .copied()
            .min_by_key(|c| (c + span - (start % span)) % span)
            .unwrap_or(offered[0]);
        self.conn_next[target] = best + 1;
        Some(best)
    }
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
        let mut r = ModelRouting::new(3);
        let o = &offers(&[1, 1, 1])[1..];
        assert_eq!(r.pick(Strategy::Priority, o, 0.0), Some(1));
        assert_eq!(r.pick(Strategy::Priority, &[], 0.0), None);
    }

    #[test]
    fn weighted_matches_weights_exactly_per_cycle() {
        let mut r = ModelRouting::new(3);
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
    fn round_robin_rotates_and_skips_missing() {
        let mut r = ModelRouting::new(3);
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
        let mut r = ModelRouting::new(3);
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
        let mut r = ModelRouting::new(2);
        let o = offers(&[1, 1]);
        assert_eq!(r.pick(Strategy::Random, &o, 0.0), Some(0));
        assert_eq!(r.pick(Strategy::Random, &o, 0.99), Some(1));
        assert_eq!(r.pick(Strategy::Random, &o, 1.0), Some(1));
    }

    #[test]
    fn connections_rotate_over_offered() {
        let mut r = ModelRouting::new(1);
        let picks: Vec<_> = (0..4)
            .map(|_| r.pick_connection(0, &[0, 1, 2]).unwrap())
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0]);
        assert_eq!(r.pick_connection(0, &[0, 2]), Some(2));
        assert_eq!(r.pick_connection(0, &[0, 2]), Some(0));
        assert_eq!(r.pick_connection(0, &[]), None);
    }
}
