//! The select phase's short way: the strategy's pick found by checking only the
//! candidates the strategy has to look at, so a healthy model with 1,000 connections
//! costs about what one with ten does (SPEC §10).
//!
//! The full evaluation ([`super::select::evaluate`]) checks every (target, connection)
//! and lists each exclusion; it is what an answer without a pick needs. When things go
//! well, a strategy needs much less: `priority` and `round-robin` stop at the first
//! target with a usable connection, `weighted` checks the target whose turn it is, the
//! other target-level strategies check each
//! target's connections in rotation order up to the first usable one, `p2c` draws its two views by rejection sampling, `least-used`
//! and `fill-first` read counters and check only the candidates that would win.
//! Invariant: a pick made here is one the full evaluation followed by the strategy
//! could have made from the same state (the same candidate for the deterministic
//! strategies, the same distribution for the random ones), with the same routing
//! state afterwards (but for the rotation point of a one-connection target, which
//! nothing reads: `priority` takes such a target without the model's routing lock). Whenever that cannot be shown cheaply — nothing usable among
//! what was checked, only DEGRADED providers, `reset-aware` (which ranks every view by
//! its rate-limit signals) — it returns `None` and the caller evaluates in full.

use super::select::{gate, Asker, Candidate, Check, Ctx, Gate};
use super::state::lock;
use super::{Engine, Slot, Snapshot};
use crate::config::{Family, Strategy};
use crate::policy::breaker::BreakerState;
use crate::policy::lease::LeaseTable;
use crate::policy::Millis;
use crate::routing::{ModelRouting, Offer};
use rand::Rng;
use smallvec::SmallVec;
use std::cell::OnceCell;

/// Draws per `p2c` view before giving up on sampling.
const P2C_DRAWS: usize = 8;

/// Load levels `least-used` tries, idle first, before giving up.
const LEAST_USED_LEVELS: usize = 5;

/// The pick the strategy would make, or `None` to evaluate in full. `pin` is the
/// session's pinned `provider/connection`, preferred when it is runnable.
pub(super) fn pick(
    engine: &Engine,
    snap: &Snapshot,
    model: usize,
    family: Family,
    asker: &Asker<'_>,
    pin: Option<&str>,
    now: Millis,
) -> Option<Candidate> {
    // Without any lease, an empty table answers the same as the locked one.
    let locked;
    let none = LeaseTable::default();
    let leases: &LeaseTable = if engine.leases.any() {
        locked = engine.leases.lock();
        &locked
    } else {
        &none
    };
    let ctx = Ctx {
        engine,
        snap,
        model,
        asker,
        leases,
        now,
    };
    let s = Short {
        ctx: &ctx,
        gates: (0..snap.config.models[model].targets.len())
            .map(|_| OnceCell::new())
            .collect(),
        family,
        plain: asker.lease.is_none()
            && asker.client.is_none_or(|c| c.allowed_connections.is_none()),
    };
    if let Some(key) = pin {
        if let Some(c) = s.pinned(key) {
            return Some(c);
        }
    }
    let m = &snap.config.models[model];
    // The model's routing state only for the strategies that keep one.
    let routing = || lock(&snap.routing[model]);
    match m.strategy {
        Strategy::Priority => s
            .first_single()
            .or_else(|| s.target_level(m.strategy, &mut routing())),
        Strategy::Weighted => {
            let mut r = routing();
            s.weighted_turn(&mut r)
                .or_else(|| s.target_level(m.strategy, &mut r))
        }
        Strategy::RoundRobin | Strategy::Random | Strategy::CostOptimized => {
            s.target_level(m.strategy, &mut routing())
        }
        Strategy::LeastUsed => s.least_used(&mut routing()),
        Strategy::P2c => s.p2c(m.p2c_latency_weight),
        Strategy::FillFirst => s.fill_first(),
        Strategy::ResetAware => None,
    }
}

struct Short<'a> {
    ctx: &'a Ctx<'a>,
    /// Each target's gate, read when first needed (`None`: another family).
    gates: SmallVec<[OnceCell<Option<Gate<'a>>>; 4]>,
    family: Family,
    /// The asker has no client scope and no lease: every slot is offered.
    plain: bool,
}

impl Short<'_> {
    fn targets(&self) -> usize {
        self.gates.len()
    }

    fn connections(&self, ti: usize) -> usize {
        let cfg = &self.ctx.snap.config;
        cfg.providers[cfg.models[self.ctx.model].targets[ti].provider]
            .connections
            .len()
    }

    fn gate(&self, ti: usize) -> Option<&Gate<'_>> {
        let c = self.ctx;
        self.gates[ti]
            .get_or_init(|| gate(c.engine, c.snap, c.model, ti, self.family, c.now))
            .as_ref()
    }

    /// The gate of a target every strategy but `priority` may use while any healthy
    /// view exists: right family, provider not DEGRADED.
    fn healthy_gate(&self, ti: usize) -> Option<&Gate<'_>> {
        self.gate(ti).filter(|g| g.state != BreakerState::Degraded)
    }

    fn runnable(&self, ti: usize, ci: usize, gate: &Gate<'_>) -> Option<Candidate> {
        match self.ctx.check(ti, ci, gate) {
            Check::Runnable(c) => Some(c),
            _ => None,
        }
    }

    /// The pinned connection, through the first target (in order) that offers it.
    fn pinned(&self, key: &str) -> Option<Candidate> {
        let (pi, ci) = self.ctx.snap.conn_position(key)?;
        let targets = &self.ctx.snap.config.models[self.ctx.model].targets;
        (0..self.targets())
            .filter(|&ti| targets[ti].provider == pi)
            .find_map(|ti| self.runnable(ti, ci, self.gate(ti)?))
    }

    /// The first runnable connection of `ti` in its rotation order.
    fn first_in_rotation(
        &self,
        ti: usize,
        gate: &Gate<'_>,
        routing: &ModelRouting,
    ) -> Option<Candidate> {
        let n = self.connections(ti);
        let start = routing.connection_start(ti).min(n);
        (start..n)
            .chain(0..start)
            .find_map(|ci| self.runnable(ti, ci, gate))
    }

    /// `priority` while the targets in its order have one connection each: the first
    /// runnable one, without the model's routing lock (a one-connection target's
    /// rotation has nothing to record). `None` at the first target with several
    /// connections, or when none is runnable: the locked way then decides.
    fn first_single(&self) -> Option<Candidate> {
        for ti in 0..self.targets() {
            if self.connections(ti) != 1 {
                return None;
            }
            if let Some(c) = self.gate(ti).and_then(|g| self.runnable(ti, 0, g)) {
                return Some(c);
            }
        }
        None
    }

    /// `priority`, `weighted`, `round-robin`, `random`, `cost-optimized`: the targets
    /// with a runnable connection become offers, the strategy picks one, its rotation
    /// gives the connection. `priority` and `round-robin` stop at the first offer in
    /// their order, which is the one they would pick among all offers.
    fn target_level(&self, strategy: Strategy, routing: &mut ModelRouting) -> Option<Candidate> {
        let n = self.targets();
        let start = match strategy {
            Strategy::RoundRobin => routing.round_robin_start(n),
            _ => 0,
        };
        let first_wins = matches!(strategy, Strategy::Priority | Strategy::RoundRobin);
        let mut offers: SmallVec<[Offer; 4]> = SmallVec::new();
        let mut found: SmallVec<[Candidate; 4]> = SmallVec::new();
        for ti in (start..n).chain(0..start) {
            let gate = if strategy == Strategy::Priority {
                self.gate(ti)
            } else {
                self.healthy_gate(ti)
            };
            let Some(c) = gate.and_then(|g| self.first_in_rotation(ti, g, routing)) else {
                continue;
            };
            let t = &self.ctx.snap.config.models[self.ctx.model].targets[ti];
            let offer = Offer {
                target: ti,
                weight: t.weight,
                cost: t.cost,
            };
            offers.push(offer);
            found.push(c);
            if first_wins {
                break;
            }
        }
        let target = routing.pick(strategy, &offers, rand::random())?;
        let c = found.into_iter().find(|c| c.target == target)?;
        routing.picked_connection(c.target, c.connection);
        Some(c)
    }

    /// `weighted` when the target whose turn it is can take the pick: only that target
    /// is checked. Otherwise nothing moves and the caller offers every target.
    fn weighted_turn(&self, routing: &mut ModelRouting) -> Option<Candidate> {
        let ti = routing.weighted_turn()?;
        let c = self
            .healthy_gate(ti)
            .and_then(|g| self.first_in_rotation(ti, g, routing))?;
        routing.take_weighted_turn(ti);
        routing.picked_connection(ti, c.connection);
        Some(c)
    }

    /// The model's slots, in (target, connection) order.
    fn slots(&self) -> &[Slot] {
        self.ctx
            .snap
            .slots(&self.ctx.engine.permits, self.ctx.model)
    }

    /// Two distinct healthy runnable views drawn uniformly (rejection sampling), the
    /// lower score wins.
    fn p2c(&self, latency_weight: f64) -> Option<Candidate> {
        let slots = self.slots();
        let mut rng = rand::thread_rng();
        let mut draw = |other: Option<(usize, usize)>| {
            (0..P2C_DRAWS).find_map(|_| {
                let s = slots.get(rng.gen_range(0..slots.len().max(1)))?;
                if other == Some((s.target, s.connection)) {
                    return None;
                }
                self.runnable(s.target, s.connection, self.healthy_gate(s.target)?)
            })
        };
        let a = draw(None)?;
        let b = draw(Some((a.target, a.connection)))?;
        let c = self.ctx;
        let v = super::select::views(c.engine, c.snap, c.model, &[a, b], c.now);
        Some(
            if crate::routing::p2c_second_wins(&v[0], &v[1], latency_weight) {
                b
            } else {
                a
            },
        )
    }

    /// May this asker use the slot at all (client scope, its lease)? No table is read.
    #[inline]
    fn offered(&self, s: &Slot) -> bool {
        let c = self.ctx;
        if self.plain {
            return true;
        }
        let cfg = &c.snap.config;
        let pi = cfg.models[c.model].targets[s.target].provider;
        let p = &cfg.providers[pi];
        super::client_allows(c.asker.client, &p.id, &p.connections[s.connection].id)
            && c.asker
                .lease
                .is_none_or(|(_, leased)| leased == c.snap.conn_key(pi, s.connection))
    }

    /// The fewest attempts in flight; equal load rotates after the last rotated pick.
    /// Connections that cannot run (cooling, at their cap, DEGRADED) usually carry the
    /// least load, so the levels are tried from the lowest up: the first level with a
    /// healthy runnable view holds the lowest load among them. Gives up after a few
    /// levels. Only the slots at a level are checked, so the scan reads counters only.
    /// No load is below zero, so an idle runnable view found in rotation order is the
    /// pick without the lowest level being looked for: with idle connections about,
    /// the scan stops a few slots after the rotation point however many there are.
    fn least_used(&self, routing: &mut ModelRouting) -> Option<Candidate> {
        let slots = self.slots();
        let after = routing.last_rotated().map_or(0, |k| {
            slots.partition_point(|s| (s.target, s.connection) <= k)
        });
        let order = || slots[after..].iter().chain(&slots[..after]);
        let at = |level: u32, s: &Slot| {
            if s.limits.inflight() != level || !self.offered(s) {
                return None;
            }
            self.runnable(s.target, s.connection, self.healthy_gate(s.target)?)
        };
        // The lowest offered load above `level`.
        let next = |level: u32| {
            slots
                .iter()
                .filter(|s| self.offered(s))
                .map(|s| s.limits.inflight())
                .filter(|&n| n > level)
                .min()
        };
        // Idle first, then each next level present, up to a few.
        let mut level = 0;
        for pass in 1..=LEAST_USED_LEVELS {
            if let Some(c) = order().find_map(|s| at(level, s)) {
                routing.rotated((c.target, c.connection));
                return Some(c);
            }
            if pass == LEAST_USED_LEVELS {
                break;
            }
            level = next(level)?;
        }
        None
    }

    /// The first healthy runnable view in (target, connection) order with a free slot.
    fn fill_first(&self) -> Option<Candidate> {
        self.slots()
            .iter()
            .filter(|s| s.cap.is_none_or(|cap| s.limits.inflight() < cap) && self.offered(s))
            .find_map(|s| self.runnable(s.target, s.connection, self.healthy_gate(s.target)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Client;
    use crate::engine::permits::PermitGuard;
    use crate::engine::select;
    use crate::engine::testing::{engine_with, T0};
    use crate::engine::Tried;
    use crate::policy::TerminalState;
    use proptest::prelude::{prop, prop_assert, prop_assert_eq, prop_oneof, proptest, Just};
    use proptest::strategy::Strategy as Gen;
    use proptest::test_runner::Config as ProptestConfig;
    use std::sync::Arc;

    /// One provider per target; `caps[t][c]` is the connection's `max_concurrent`.
    fn yaml(strategy: &str, caps: &[Vec<Option<u32>>]) -> String {
        let mut y = String::from("providers:\n");
        for (p, conns) in caps.iter().enumerate() {
            y.push_str(&format!(
                "  - id: p{p}\n    base_url: \"http://127.0.0.1:9\"\n    api: openai\n    class: local\n    connections:\n"
            ));
            for (c, cap) in conns.iter().enumerate() {
                match cap {
                    Some(n) => {
                        y.push_str(&format!("      - {{ id: c{c}, max_concurrent: {n} }}\n"))
                    }
                    None => y.push_str(&format!("      - {{ id: c{c} }}\n")),
                }
            }
        }
        y.push_str(&format!(
            "models:\n  - name: m\n    strategy: {strategy}\n    targets:\n"
        ));
        for p in 0..caps.len() {
            y.push_str(&format!(
                "      - {{ provider: p{p}, model: u{p}, weight: {}, cost: {} }}\n",
                p % 3 + 1,
                (p * 7) % 5
            ));
        }
        y
    }

    /// What one connection is doing when the picks are compared.
    #[derive(Clone, Copy, Debug)]
    enum Conn {
        Idle,
        Busy(u8),
        Cooling,
        Banned,
    }

    fn conn() -> impl Gen<Value = (Option<u32>, Conn)> {
        (
            prop_oneof![Just(None), (1u32..3).prop_map(Some)],
            prop_oneof![
                3 => Just(Conn::Idle),
                3 => (1u8..3).prop_map(Conn::Busy),
                1 => Just(Conn::Cooling),
                1 => Just(Conn::Banned),
            ],
        )
    }

    /// Each target's connections: (`max_concurrent`, what it is doing).
    type Targets = Vec<Vec<(Option<u32>, Conn)>>;

    /// Targets (each with its connections), which providers are DEGRADED, and which
    /// targets and connections this request already tried.
    fn world() -> impl Gen<Value = (Targets, Vec<bool>, Vec<bool>)> {
        prop::collection::vec(prop::collection::vec(conn(), 1..5), 1..5).prop_flat_map(|t| {
            let n = t.len();
            (
                Just(t),
                prop::collection::vec(prop::bool::weighted(0.3), n),
                prop::collection::vec(prop::bool::weighted(0.15), n),
            )
        })
    }

    /// Builds the world: an engine whose state matches it, and the permits held.
    fn build(
        strategy: &str,
        targets: &[Vec<(Option<u32>, Conn)>],
        degraded: &[bool],
    ) -> (Arc<Engine>, Vec<PermitGuard>) {
        let caps: Vec<Vec<Option<u32>>> = targets
            .iter()
            .map(|cs| cs.iter().map(|c| c.0).collect())
            .collect();
        let e = engine_with(&yaml(strategy, &caps), None);
        let snap = e.snapshot();
        let mut held = Vec::new();
        for (ti, conns) in targets.iter().enumerate() {
            let pid = format!("p{ti}");
            if degraded[ti] {
                let bcfg = select::breaker_config(&snap, ti);
                let entry = e.tables.provider(&pid);
                let mut b = lock(&entry);
                for _ in 0..64 {
                    if b.breaker.state(&bcfg, T0) == BreakerState::Degraded {
                        break;
                    }
                    b.breaker.record(&bcfg, true, false, T0);
                }
                assert_eq!(b.breaker.state(&bcfg, T0), BreakerState::Degraded);
            }
            for (ci, (_, state)) in conns.iter().enumerate() {
                let entry = e.tables.connection(&pid, &format!("c{ci}"));
                match state {
                    Conn::Idle => {}
                    Conn::Cooling => lock(&entry).state.cooled_until = T0 + 60_000,
                    Conn::Banned => lock(&entry).state.terminal = Some(TerminalState::Banned),
                    Conn::Busy(n) => {
                        let l = snap.limits(&e.permits, 0, ti, ci);
                        for _ in 0..*n {
                            held.push(l.try_acquire().unwrap_or_else(|| l.unlimited()));
                        }
                    }
                }
            }
        }
        (e, held)
    }

    /// The full way's pick: every candidate evaluated, then the strategy.
    fn full_pick(e: &Engine, snap: &Snapshot, asker: &Asker<'_>) -> Option<Candidate> {
        let eval = select::evaluate(e, snap, 0, Family::OpenAi, asker, T0);
        select::pick(e, snap, 0, &eval.runnable, T0)
    }

    /// The model's routing state, less the rotation points of one-connection targets
    /// (never read: `priority` skips the lock for those, the full way records them).
    fn routing_of(snap: &Snapshot) -> String {
        let mut r = lock(&snap.routing[0]).clone();
        let cfg = &snap.config;
        for (ti, t) in cfg.models[0].targets.iter().enumerate() {
            if cfg.providers[t.provider].connections.len() == 1 {
                r.reset_rotation(ti);
            }
        }
        format!("{r:?}")
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// For the deterministic strategies the short way picks exactly what the full
        /// evaluation picks, leaves the same routing state, and declines only when it
        /// must (it never declines while a healthy candidate is runnable and the model
        /// has no DEGRADED provider, for the strategies that always settle).
        #[test]
        fn the_short_way_picks_what_the_full_way_picks(
            (targets, degraded, tried_targets) in world(),
            strategy in prop::sample::select(vec!["priority", "weighted", "round-robin", "cost-optimized", "least-used", "fill-first"]),
            steps in 1usize..12,
            scope in prop::option::of(prop::collection::vec(prop::bool::ANY, 16)),
        ) {
            let (e, _held) = build(strategy, &targets, &degraded);
            let snap = e.snapshot();
            let tried = Tried {
                targets: (0..targets.len()).filter(|&t| tried_targets[t]).collect(),
                ..Tried::default()
            };
            // A client limited to some of the connections (`allowed_connections`).
            let client = scope.map(|allow| Client {
                id: "c".into(),
                key_sha256: String::new(),
                scopes: Vec::new(),
                allowed_connections: Some(
                    (0..16)
                        .filter(|&i| allow[i])
                        .map(|i| format!("p{}/c{}", i / 4, i % 4))
                        .collect(),
                ),
            });
            let asker = Asker { client: client.as_ref(), lease: None, tried: &tried };
            for _ in 0..steps {
                let before = lock(&snap.routing[0]).clone();
                let short = pick(&e, &snap, 0, Family::OpenAi, &asker, None, T0);
                let after_short = routing_of(&snap);
                *lock(&snap.routing[0]) = before;
                let full = full_pick(&e, &snap, &asker);
                if let Some(s) = short {
                    prop_assert_eq!(Some(s), full);
                    prop_assert_eq!(after_short, routing_of(&snap));
                } else if degraded.iter().all(|d| !d) && strategy != "fill-first" {
                    // (Loads here take at most 3 levels, fewer than `least-used` tries;
                    // fill-first declines when every runnable view is past its cap.)
                    prop_assert_eq!(full, None, "declined with a runnable candidate");
                }
            }
        }

        /// A pinned connection is taken when it is runnable, through the first target
        /// that offers it, whatever the strategy.
        #[test]
        fn a_runnable_pin_wins(
            (targets, degraded, _t) in world(),
            pin_t in 0usize..5,
            pin_c in 0usize..5,
        ) {
            let (e, _held) = build("weighted", &targets, &degraded);
            let snap = e.snapshot();
            let tried = Tried::default();
            let asker = Asker { client: None, lease: None, tried: &tried };
            let (pt, pc) = (pin_t % targets.len(), pin_c % targets[pin_t % targets.len()].len());
            let key = snap.conn_key(pt, pc).to_string();
            let eval = select::evaluate(&e, &snap, 0, Family::OpenAi, &asker, T0);
            let runnable = eval.runnable.iter().find(|c| (c.provider, c.connection) == (pt, pc)).copied();
            let short = pick(&e, &snap, 0, Family::OpenAi, &asker, Some(&key), T0);
            if runnable.is_some() {
                prop_assert_eq!(short, runnable);
            } else {
                prop_assert!(short.is_none_or(|s| (s.provider, s.connection) != (pt, pc)));
            }
        }
    }

    /// The random strategies draw from the same distribution both ways.
    #[test]
    fn p2c_and_random_draw_like_the_full_way() {
        use std::collections::HashMap;
        let targets = vec![
            vec![
                (None, Conn::Idle),
                (None, Conn::Busy(2)),
                (None, Conn::Cooling),
            ],
            vec![(None, Conn::Busy(1)), (None, Conn::Idle)],
            vec![
                (None, Conn::Banned),
                (None, Conn::Idle),
                (None, Conn::Busy(1)),
            ],
        ];
        for strategy in ["p2c", "random"] {
            // The second provider is DEGRADED: neither way may use it while others run.
            let (e, _held) = build(strategy, &targets, &[false, true, false]);
            let snap = e.snapshot();
            let tried = Tried::default();
            let asker = Asker {
                client: None,
                lease: None,
                tried: &tried,
            };
            let n = 6000;
            let mut short: HashMap<(usize, usize), i64> = HashMap::new();
            let mut full: HashMap<(usize, usize), i64> = HashMap::new();
            let mut settled = 0;
            for _ in 0..n {
                // Declined draws go the full way, as in `Engine::select`.
                let s = pick(&e, &snap, 0, Family::OpenAi, &asker, None, T0);
                settled += usize::from(s.is_some());
                let s = s.or_else(|| full_pick(&e, &snap, &asker)).expect("a pick");
                *short.entry((s.target, s.connection)).or_default() += 1;
                let f = full_pick(&e, &snap, &asker).expect("full pick");
                *full.entry((f.target, f.connection)).or_default() += 1;
            }
            let mut keys: Vec<_> = short.keys().chain(full.keys()).copied().collect();
            keys.sort_unstable();
            keys.dedup();
            for k in keys {
                let (a, b) = (
                    short.get(&k).copied().unwrap_or(0),
                    full.get(&k).copied().unwrap_or(0),
                );
                // 6 standard deviations of the difference of two binomial counts.
                let p = (a + b) as f64 / (2 * n) as f64;
                let sd = (2.0 * n as f64 * p * (1.0 - p)).sqrt();
                assert!(
                    ((a - b) as f64).abs() <= 6.0 * sd + 5.0,
                    "{strategy} {k:?}: short {a}, full {b}"
                );
            }
            // 4 of the 8 slots are healthy and runnable: the short way settles nearly
            // every draw itself (p2c fails a draw with odds (1/2)^8, then (5/8)^8).
            assert!(
                settled * 10 >= n * 9,
                "{strategy}: the short way settled {settled} of {n}"
            );
        }
    }
}
