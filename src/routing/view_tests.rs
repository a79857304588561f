//! Table tests of `ModelRouting::pick_view`: for each strategy, the distribution over
//! many picks matches its definition; plus DEGRADED avoidance and a property test that a
//! pick is always one of the offered views.

use super::*;
use crate::config::Strategy;
use proptest::prelude::*;
use proptest::strategy::Strategy as _;

fn view(target: usize, connection: usize) -> View {
    View {
        target,
        connection,
        weight: 1,
        cost: None,
        inflight: 0,
        cap: None,
        latency_ms: None,
        remaining: None,
        reset_at: None,
        degraded: false,
    }
}

/// One view per target, with the given weights.
fn weighted(ws: &[u32]) -> Vec<View> {
    ws.iter()
        .enumerate()
        .map(|(t, w)| View {
            weight: *w,
            ..view(t, 0)
        })
        .collect()
}

fn pick(r: &mut ModelRouting, s: Strategy, views: &[View]) -> usize {
    r.pick_view(s, views, (0.0, 0.0), 0.0).unwrap()
}

fn keys(views: &[View], picks: &[usize]) -> Vec<(usize, usize)> {
    picks
        .iter()
        .map(|&i| (views[i].target, views[i].connection))
        .collect()
}

#[test]
fn empty_views_give_none_for_every_strategy() {
    for s in Strategy::ALL {
        let mut r = ModelRouting::new(&[1; 2]);
        assert_eq!(r.pick_view(s, &[], (0.5, 0.5), 1.0), None, "{s:?}");
    }
}

#[test]
fn priority_takes_the_first_target_and_rotates_its_connections() {
    let mut r = ModelRouting::new(&[1; 3]);
    // Offered out of order: target order rules, not slice order.
    let views = vec![view(2, 0), view(1, 1), view(1, 0)];
    let picks: Vec<_> = (0..4)
        .map(|_| pick(&mut r, Strategy::Priority, &views))
        .collect();
    assert_eq!(keys(&views, &picks), vec![(1, 0), (1, 1), (1, 0), (1, 1)]);
}

#[test]
fn weighted_matches_weights_exactly_per_cycle() {
    let mut r = ModelRouting::new(&[5, 1, 1]);
    let mut views = weighted(&[5, 1, 1]);
    views.push(View {
        weight: 5,
        ..view(0, 1)
    });
    let mut per_target = [0; 3];
    let mut per_view = [0; 4];
    for _ in 0..70 {
        let i = pick(&mut r, Strategy::Weighted, &views);
        per_target[views[i].target] += 1;
        per_view[i] += 1;
    }
    assert_eq!(per_target, [50, 10, 10]);
    // Target 0's two connections share its picks evenly.
    assert_eq!(per_view, [25, 10, 10, 25]);
}

#[test]
fn weighted_cycle_is_exact_for_several_weight_sets() {
    for ws in [&[1u32, 1][..], &[3, 1], &[2, 3, 5], &[10, 1, 1, 1]] {
        let mut r = ModelRouting::new(ws);
        let views = weighted(ws);
        let total: u32 = ws.iter().sum();
        let mut counts = vec![0u32; ws.len()];
        for _ in 0..total * 4 {
            counts[pick(&mut r, Strategy::Weighted, &views)] += 1;
        }
        let want: Vec<u32> = ws.iter().map(|w| w * 4).collect();
        assert_eq!(counts, want, "{ws:?}");
    }
}

#[test]
fn round_robin_rotates_targets_then_connections() {
    let mut r = ModelRouting::new(&[1; 3]);
    let views = vec![view(0, 0), view(0, 1), view(1, 0), view(2, 0)];
    let picks: Vec<_> = (0..6)
        .map(|_| pick(&mut r, Strategy::RoundRobin, &views))
        .collect();
    assert_eq!(
        keys(&views, &picks),
        vec![(0, 0), (1, 0), (2, 0), (0, 1), (1, 0), (2, 0)]
    );
    // A target missing from the offer is skipped without breaking the rotation.
    let without_1 = vec![views[0], views[1], views[3]];
    let picks: Vec<_> = (0..3)
        .map(|_| pick(&mut r, Strategy::RoundRobin, &without_1))
        .collect();
    assert_eq!(keys(&without_1, &picks), vec![(0, 0), (2, 0), (0, 1)]);
}

#[test]
fn random_is_uniform_over_targets() {
    let mut r = ModelRouting::new(&[1; 4]);
    // Target 0 has three connections: still one quarter of the picks.
    let views = vec![
        view(0, 0),
        view(0, 1),
        view(0, 2),
        view(1, 0),
        view(2, 0),
        view(3, 0),
    ];
    let mut per_target = [0; 4];
    for k in 0..400 {
        let draw = k as f64 / 400.0;
        let i = r
            .pick_view(Strategy::Random, &views, (draw, 0.0), 0.0)
            .unwrap();
        per_target[views[i].target] += 1;
    }
    assert_eq!(per_target, [100, 100, 100, 100]);
    assert_eq!(
        r.pick_view(Strategy::Random, &views, (1.0, 0.0), 0.0),
        Some(5)
    );
    assert_eq!(
        r.pick_view(Strategy::Random, &views, (f64::NAN, 0.0), 0.0)
            .map(|i| views[i].target),
        Some(0)
    );
}

#[test]
fn cost_optimized_takes_cheapest_then_order_and_unknown_last() {
    let mut r = ModelRouting::new(&[1; 4]);
    let priced = |t, cost| View { cost, ..view(t, 0) };
    type Priced = (usize, Option<f64>);
    let cases: &[(&[Priced], usize)] = &[
        (&[(0, None), (1, Some(2.0)), (2, Some(0.5))], 2),
        (&[(0, None), (1, Some(2.0))], 1),
        (&[(0, Some(1.0)), (1, Some(1.0)), (2, Some(3.0))], 0),
        (&[(3, Some(1.0)), (1, Some(1.0))], 1),
        (&[(0, None), (1, None)], 0),
        (&[(0, Some(0.0)), (1, Some(5.0))], 0),
    ];
    for (offer, want) in cases {
        let views: Vec<View> = offer.iter().map(|(t, c)| priced(*t, *c)).collect();
        let i = pick(&mut r, Strategy::CostOptimized, &views);
        assert_eq!(views[i].target, *want, "{offer:?}");
    }
}

#[test]
fn least_used_picks_the_minimum() {
    let mut r = ModelRouting::new(&[1; 3]);
    let loaded = |t, c, n| View {
        inflight: n,
        ..view(t, c)
    };
    let cases: &[(&[u32], usize)] = &[
        (&[3, 1, 2], 1),
        (&[0, 5, 5], 0),
        (&[4, 4, 2, 9], 2),
        (&[7], 0),
    ];
    for (load, want) in cases {
        let views: Vec<View> = load
            .iter()
            .enumerate()
            .map(|(i, n)| loaded(i, 0, *n))
            .collect();
        assert_eq!(pick(&mut r, Strategy::LeastUsed, &views), *want, "{load:?}");
    }
}

#[test]
fn least_used_spreads_ties_and_equal_load() {
    let mut r = ModelRouting::new(&[1; 2]);
    let views = vec![
        View {
            inflight: 2,
            ..view(0, 0)
        },
        view(0, 1),
        view(1, 0),
        View {
            inflight: 1,
            ..view(1, 1)
        },
    ];
    let picks: Vec<_> = (0..4)
        .map(|_| pick(&mut r, Strategy::LeastUsed, &views))
        .collect();
    assert_eq!(picks, vec![1, 2, 1, 2]);

    // Simulated load that never finishes: every view ends with the same count and the
    // spread never exceeds one.
    let mut r = ModelRouting::new(&[1; 2]);
    let mut views = vec![view(0, 0), view(0, 1), view(1, 0), view(1, 1)];
    for _ in 0..12 {
        let i = pick(&mut r, Strategy::LeastUsed, &views);
        views[i].inflight += 1;
        let (lo, hi) = views.iter().fold((u32::MAX, 0), |(lo, hi), v| {
            (lo.min(v.inflight), hi.max(v.inflight))
        });
        assert!(hi - lo <= 1);
    }
    assert!(views.iter().all(|v| v.inflight == 3));
}

#[test]
fn p2c_never_picks_the_strictly_worse_of_two() {
    let mut r = ModelRouting::new(&[1; 2]);
    let views = vec![
        View {
            inflight: 3,
            ..view(0, 0)
        },
        View {
            inflight: 1,
            ..view(1, 0)
        },
    ];
    for a in 0..10 {
        for b in 0..10 {
            let draw = (a as f64 / 10.0, b as f64 / 10.0);
            assert_eq!(r.pick_view(Strategy::P2c, &views, draw, 0.0), Some(1));
            assert_eq!(r.pick_view(Strategy::P2c, &views, draw, 5.0), Some(1));
        }
    }
    assert_eq!(
        r.pick_view(Strategy::P2c, &views[..1], (0.9, 0.9), 0.0),
        Some(0)
    );
}

#[test]
fn p2c_latency_weight_flips_the_choice() {
    let mut r = ModelRouting::new(&[1; 2]);
    // Idle but slow vs. one in flight but fast.
    let views = vec![
        View {
            inflight: 0,
            latency_ms: Some(900.0),
            ..view(0, 0)
        },
        View {
            inflight: 1,
            latency_ms: Some(100.0),
            ..view(1, 0)
        },
    ];
    let cases: &[(f64, usize)] = &[(0.0, 0), (0.5, 0), (2.0, 1), (20.0, 1)];
    for (weight, want) in cases {
        for draw in [(0.0, 0.0), (0.9, 0.0)] {
            assert_eq!(
                r.pick_view(Strategy::P2c, &views, draw, *weight),
                Some(*want),
                "weight {weight}"
            );
        }
    }
    // The latency term needs a latency on both candidates.
    let mut one_sided = views.clone();
    one_sided[0].latency_ms = None;
    assert_eq!(
        r.pick_view(Strategy::P2c, &one_sided, (0.9, 0.0), 20.0),
        Some(0)
    );
}

#[test]
fn p2c_draws_two_distinct_views_uniformly() {
    let mut r = ModelRouting::new(&[1; 3]);
    // Equal scores: the first draw wins, so the first draw's distribution shows.
    let views = vec![view(0, 0), view(1, 0), view(2, 0)];
    let mut counts = [0; 3];
    for a in 0..30 {
        for b in 0..30 {
            let draw = ((a as f64 + 0.5) / 30.0, (b as f64 + 0.5) / 30.0);
            counts[r.pick_view(Strategy::P2c, &views, draw, 0.0).unwrap()] += 1;
        }
    }
    assert_eq!(counts, [300, 300, 300]);
    // The busiest of three is never picked: whichever it is paired with is better.
    let views = vec![
        View {
            inflight: 9,
            ..view(0, 0)
        },
        View {
            inflight: 1,
            ..view(1, 0)
        },
        View {
            inflight: 2,
            ..view(2, 0)
        },
    ];
    let mut counts = [0; 3];
    for a in 0..30 {
        for b in 0..30 {
            let draw = ((a as f64 + 0.5) / 30.0, (b as f64 + 0.5) / 30.0);
            counts[r.pick_view(Strategy::P2c, &views, draw, 0.0).unwrap()] += 1;
        }
    }
    assert_eq!(counts[0], 0);
    // Pairs (1,2) and (2,1) go to 1; pairs with 0 go to the partner.
    assert_eq!(counts, [0, 600, 300]);
}

#[test]
fn fill_first_fills_to_cap_then_spills() {
    let mut r = ModelRouting::new(&[1; 2]);
    // Offered out of order on purpose.
    let mut views = vec![
        view(1, 0),
        View {
            cap: Some(3),
            ..view(0, 1)
        },
        View {
            cap: Some(2),
            ..view(0, 0)
        },
    ];
    let mut order = Vec::new();
    for _ in 0..8 {
        let i = pick(&mut r, Strategy::FillFirst, &views);
        views[i].inflight += 1;
        order.push((views[i].target, views[i].connection));
    }
    assert_eq!(
        order,
        vec![
            (0, 0),
            (0, 0),
            (0, 1),
            (0, 1),
            (0, 1),
            (1, 0),
            (1, 0),
            (1, 0)
        ]
    );
    // A finished attempt frees the first connection: it is filled again first.
    views[2].inflight -= 1;
    assert_eq!(pick(&mut r, Strategy::FillFirst, &views), 2);
}

#[test]
fn fill_first_when_all_full_takes_lowest_ratio() {
    let mut r = ModelRouting::new(&[1; 3]);
    let full = |t, inflight, cap| View {
        inflight,
        cap: Some(cap),
        ..view(t, 0)
    };
    let cases: &[(&[(u32, u32)], usize)] = &[
        (&[(4, 2), (3, 2), (10, 4)], 1),
        (&[(2, 2), (4, 4), (9, 3)], 0),
        (&[(5, 0), (6, 3)], 1),
    ];
    for (load, want) in cases {
        let views: Vec<View> = load
            .iter()
            .enumerate()
            .map(|(t, (n, c))| full(t, *n, *c))
            .collect();
        assert_eq!(pick(&mut r, Strategy::FillFirst, &views), *want, "{load:?}");
    }
}

#[test]
fn reset_aware_orders_known_then_unknown_then_exhausted() {
    let rl = |t, remaining, reset_at| View {
        remaining,
        reset_at,
        ..view(t, 0)
    };
    let views = vec![
        rl(0, Some(0), Some(5_000)),
        rl(1, None, None),
        rl(2, Some(10), Some(9_000)),
        rl(3, Some(50), Some(60_000)),
        rl(4, Some(0), Some(1_000)),
        rl(5, Some(10), Some(2_000)),
        rl(6, None, Some(3_000)),
        rl(7, Some(10), None),
    ];
    // Repeatedly pick and remove: the removal order is the ranking.
    let mut left = views.clone();
    let mut order = Vec::new();
    let mut r = ModelRouting::new(&[1; 8]);
    while !left.is_empty() {
        let i = pick(&mut r, Strategy::ResetAware, &left);
        order.push(left.remove(i).target);
    }
    assert_eq!(order, vec![3, 5, 2, 7, 6, 1, 4, 0]);
}

#[test]
fn reset_aware_rotates_exact_ties() {
    let mut r = ModelRouting::new(&[1; 3]);
    let views = vec![view(0, 0), view(1, 0), view(2, 0)];
    let picks: Vec<_> = (0..6)
        .map(|_| pick(&mut r, Strategy::ResetAware, &views))
        .collect();
    assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
}

#[test]
fn degraded_views_are_avoided_while_others_exist() {
    // The degraded view is the most attractive by every strategy's own measure.
    let star = View {
        weight: 100,
        cost: Some(0.0),
        remaining: Some(1_000),
        degraded: true,
        ..view(0, 0)
    };
    let others = vec![
        star,
        View {
            inflight: 5,
            cap: Some(1),
            cost: Some(9.0),
            remaining: Some(1),
            ..view(1, 0)
        },
        View {
            inflight: 5,
            cap: Some(1),
            cost: Some(9.0),
            remaining: Some(1),
            ..view(2, 0)
        },
    ];
    for s in Strategy::ALL {
        if s == Strategy::Priority {
            continue;
        }
        let mut r = ModelRouting::new(&[1; 3]);
        for k in 0..50 {
            let draw = (k as f64 / 50.0, (49 - k) as f64 / 50.0);
            let i = r.pick_view(s, &others, draw, 1.0).unwrap();
            assert_ne!(i, 0, "{s:?} picked the degraded view");
        }
        // With only degraded views there is still an answer.
        let all_degraded: Vec<View> = others
            .iter()
            .map(|v| View {
                degraded: true,
                ..*v
            })
            .collect();
        assert!(r.pick_view(s, &all_degraded, (0.3, 0.7), 1.0).is_some());
    }
    // Priority keeps order even when the first target is degraded.
    let mut r = ModelRouting::new(&[1; 3]);
    assert_eq!(
        r.pick_view(Strategy::Priority, &others, (0.0, 0.0), 0.0),
        Some(0)
    );
}

#[test]
fn old_target_api_still_works_for_new_strategies() {
    let offers: Vec<Offer> = (0..3)
        .map(|t| Offer {
            target: t,
            weight: 1,
            cost: None,
        })
        .collect();
    let mut r = ModelRouting::new(&[1; 3]);
    assert_eq!(r.pick(Strategy::FillFirst, &offers, 0.9), Some(0));
    assert_eq!(r.pick(Strategy::ResetAware, &offers, 0.9), Some(0));
    assert_eq!(r.pick(Strategy::P2c, &offers, 0.9), Some(2));
    let rr: Vec<_> = (0..4)
        .map(|_| r.pick(Strategy::LeastUsed, &offers, 0.0).unwrap())
        .collect();
    assert_eq!(rr, vec![0, 1, 2, 0]);
}

fn arb_view() -> impl proptest::strategy::Strategy<Value = View> {
    (
        (
            0usize..6,
            0usize..4,
            1u32..20,
            proptest::option::of(0.0f64..10.0),
        ),
        (
            0u32..10,
            proptest::option::of(0u32..5),
            proptest::option::of(0.0f64..2_000.0),
        ),
        (
            proptest::option::of(0u64..5),
            proptest::option::of(0u64..10_000),
            any::<bool>(),
        ),
    )
        .prop_map(
            |(
                (target, connection, weight, cost),
                (inflight, cap, latency_ms),
                (remaining, reset_at, degraded),
            )| View {
                target,
                connection,
                weight,
                cost,
                inflight,
                cap,
                latency_ms,
                remaining,
                reset_at,
                degraded,
            },
        )
}

proptest! {
    #[test]
    fn pick_view_always_returns_an_offered_index(
        rounds in proptest::collection::vec(
            (
                proptest::collection::vec(arb_view(), 0..8),
                0usize..9,
                (any::<f64>(), any::<f64>()),
                0.0f64..=20.0,
            ),
            1..12,
        ),
        weights in proptest::collection::vec(1u32..5, 0..4),
    ) {
        // One routing state across rounds with changing offers, as in the engine.
        let mut r = ModelRouting::new(&weights);
        for (views, s, draw, weight) in rounds {
            let strategy = Strategy::ALL[s];
            let got = r.pick_view(strategy, &views, draw, weight);
            if views.is_empty() {
                prop_assert_eq!(got, None);
            } else {
                let i = got.unwrap();
                prop_assert!(i < views.len());
                if strategy != Strategy::Priority && views.iter().any(|v| !v.degraded) {
                    prop_assert!(!views[i].degraded);
                }
            }
        }
    }
}
