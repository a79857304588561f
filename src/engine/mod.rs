//! The engine: one shared object holding the config snapshot, the keyed resilience
//! state, metrics, the store writer, the upstream connector and the resolver.
//!
//! Config and rules live in an `ArcSwap<Snapshot>`; a request pins one snapshot at
//! admission and keeps it to the end, so a reload never changes a request half-way.
//! Resilience state lives in `Tables`, keyed by configured ids so it survives reloads.
//! Locks are small and synchronous, never held across an `.await`; no request waits on
//! the store except for the terminal states SPEC §7 requires to be durable first.

pub mod handover;
pub mod hot_metrics;
pub mod judge;
pub mod leases;
pub mod permits;
pub mod record;
pub mod reload;
pub mod select;
pub mod sessions;
pub mod settle;
mod shortcut;
pub mod state;
mod subscription;
#[cfg(test)]
pub mod testing;

use crate::clock::Clock;
use crate::config::settings::Sources;
use crate::config::{Client, Config, Family};
use crate::metrics::Metrics;
use crate::policy::affinity::PinTable;
use crate::policy::breaker::Permit;
use crate::policy::cooldown::Eligibility;
use crate::policy::Millis;
use crate::proxy::resolve::Resolver;
use crate::routing::ModelRouting;
use crate::routing::{LatencyWindow, RateLimitInfo};
use crate::rules::RuleSet;
use crate::store::StoreWriter;
use arc_swap::ArcSwap;
use foldhash::HashMap;
use permits::{Limits, PermitGuard, Permits};
use pingora::connectors::ConnectorOptions;
use select::{breaker_config, Exclusion};
use select::{Asker, Candidate};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use state::{lock, Shared, Tables};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

/// The config as validated from the file, before the env and override layers, with the
/// file text (to tell which settings the file sets). Kept so a runtime override can be
/// re-applied without re-reading the file.
pub struct BaseConfig {
    pub config: Config,
    pub text: String,
}

/// Bound on re-evaluations when other requests win races for the same permits.
const MAX_SELECT_ROUNDS: usize = 4;

/// Longest client model id a pattern accepts.
const MAX_PATTERN_ID: usize = 200;

/// One immutable generation of config and rules, plus the routing state that belongs to it.
pub struct Snapshot {
    pub config: Config,
    pub rules: Arc<RuleSet>,
    pub generation: u64,
    /// Which layer supplied each tunable setting.
    pub sources: Sources,
    pub base: Option<Arc<BaseConfig>>,
    models: HashMap<String, usize>,
    /// Pattern models (`claude-*`): (prefix before the `*`, index), longest prefix first.
    patterns: Vec<(String, usize)>,
    clients: HashMap<String, usize>,
    routing: Vec<Mutex<ModelRouting>>,
    /// Credential fingerprint per [provider][connection].
    fingerprints: Vec<Vec<Option<String>>>,
    /// `provider/connection` per [provider][connection], built once per generation so
    /// the select phase does not format keys per candidate.
    conn_keys: Vec<Vec<String>>,
    /// Names a lockout may be recorded under, per [model][target].
    lock_names: Vec<Vec<Vec<String>>>,
    /// [provider][connection] of each `provider/connection` key.
    conn_index: HashMap<String, (usize, usize)>,
    /// Concurrency limits per [model][target][connection], resolved on first use.
    limits: Vec<Vec<Vec<OnceLock<Limits>>>>,
    /// State entry handles per [provider] and [provider][connection], taken on first use.
    provider_entries: Vec<OnceLock<Shared<state::ProviderEntry>>>,
    conn_entries: Vec<Vec<OnceLock<Shared<state::ConnEntry>>>>,
    /// Every (target, connection) of each model in that order, built on first use.
    slots: Vec<OnceLock<Vec<Slot>>>,
    /// Masks this generation's credential values in upstream text (SPEC §3).
    pub redactor: crate::policy::redact::Redactor,
    /// The metric series of the hot path, looked up once.
    pub hot: hot_metrics::HotMetrics,
}

impl Snapshot {
    pub fn new(config: Config, rules: Arc<RuleSet>, generation: u64) -> Self {
        Self::layered(config, rules, generation, Sources::new(), None)
    }

    pub fn layered(
        config: Config,
        rules: Arc<RuleSet>,
        generation: u64,
        sources: Sources,
        base: Option<Arc<BaseConfig>>,
    ) -> Self {
        let models = config
            .models
            .iter()
            .enumerate()
            .filter(|(_, m)| !m.is_pattern())
            .map(|(i, m)| (m.name.clone(), i))
            .collect();
        let mut patterns: Vec<(String, usize)> = config
            .models
            .iter()
            .enumerate()
            .filter(|(_, m)| m.is_pattern())
            .map(|(i, m)| (m.name.trim_end_matches('*').to_owned(), i))
            .collect();
        patterns.sort_by_key(|p| std::cmp::Reverse(p.0.len()));
        let clients = config
            .clients
            .iter()
            .flatten()
            .enumerate()
            .map(|(i, c)| (c.key_sha256.clone(), i))
            .collect();
        let routing = config
            .models
            .iter()
            .map(|m| {
                let weights: Vec<u32> = m.targets.iter().map(|t| t.weight).collect();
                Mutex::new(ModelRouting::new(&weights))
            })
            .collect();
        let fingerprints = config
            .providers
            .iter()
            .map(|p| {
                p.connections
                    .iter()
                    .map(|c| c.key.as_ref().map(|k| fingerprint(k.expose())))
                    .collect()
            })
            .collect();
        let conn_keys = config
            .providers
            .iter()
            .map(|p| {
                p.connections
                    .iter()
                    .map(|c| state::conn_key(&p.id, &c.id))
                    .collect()
            })
            .collect();
        let lock_names = config
            .models
            .iter()
            .map(|m| {
                (0..m.targets.len())
                    .map(|t| select::lock_names_of(&config, m, t))
                    .collect()
            })
            .collect();
        let conn_index = config
            .providers
            .iter()
            .enumerate()
            .flat_map(|(pi, p)| {
                p.connections
                    .iter()
                    .enumerate()
                    .map(move |(ci, c)| (state::conn_key(&p.id, &c.id), (pi, ci)))
            })
            .collect();
        let limits: Vec<Vec<Vec<OnceLock<Limits>>>> = config
            .models
            .iter()
            .map(|m| {
                m.targets
                    .iter()
                    .map(|t| {
                        (0..config.providers[t.provider].connections.len())
                            .map(|_| OnceLock::new())
                            .collect()
                    })
                    .collect()
            })
            .collect();
        let provider_entries = (0..config.providers.len())
            .map(|_| OnceLock::new())
            .collect();
        let conn_entries = config
            .providers
            .iter()
            .map(|p| (0..p.connections.len()).map(|_| OnceLock::new()).collect())
            .collect();
        let redactor = crate::policy::redact::Redactor::new(
            config
                .providers
                .iter()
                .flat_map(|p| &p.connections)
                .filter_map(|c| c.key.as_ref().map(|k| k.expose())),
        );
        let hot = hot_metrics::HotMetrics::new(
            config.models.len(),
            config.providers.iter().map(|p| p.connections.len()),
        );
        Self {
            config,
            rules,
            generation,
            sources,
            base,
            hot,
            models,
            patterns,
            clients,
            routing,
            fingerprints,
            conn_keys,
            lock_names,
            conn_index,
            slots: (0..limits.len()).map(|_| OnceLock::new()).collect(),
            provider_entries,
            conn_entries,
            limits,
            redactor,
        }
    }

    /// [provider][connection] of a `provider/connection` key in this snapshot.
    pub fn conn_position(&self, key: &str) -> Option<(usize, usize)> {
        self.conn_index.get(key).copied()
    }

    /// The state entry of provider `pi` (created if it is new): read without a map lookup.
    pub fn provider_entry(&self, tables: &Tables, pi: usize) -> &Shared<state::ProviderEntry> {
        self.provider_entries[pi].get_or_init(|| tables.provider(&self.config.providers[pi].id))
    }

    /// The state entry of a connection (created if it is new).
    pub fn conn_entry(&self, tables: &Tables, pi: usize, ci: usize) -> &Shared<state::ConnEntry> {
        self.conn_entries[pi][ci].get_or_init(|| {
            let p = &self.config.providers[pi];
            tables.connection(&p.id, &p.connections[ci].id)
        })
    }

    /// Every (target, connection) of `model` (only the pinned connection of a pinned
    /// target), in (target, connection) order, with its
    /// limits: what the load-aware strategies scan without touching the tables.
    pub fn slots(&self, permits: &Permits, model: usize) -> &[Slot] {
        self.slots[model].get_or_init(|| {
            let m = &self.config.models[model];
            let mut out = Vec::new();
            for (ti, t) in m.targets.iter().enumerate() {
                let conns = self.config.providers[t.provider]
                    .connections
                    .iter()
                    .enumerate();
                // A target pinned to one connection offers only that one.
                for (ci, c) in conns.filter(|(ci, _)| t.connection.is_none_or(|pin| pin == *ci)) {
                    out.push(Slot {
                        target: ti,
                        connection: ci,
                        cap: c.max_concurrent,
                        limits: self.limits(permits, model, ti, ci).clone(),
                    });
                }
            }
            out
        })
    }

    /// The concurrency limits of one (model, target, connection), resolved against
    /// `permits` the first time they are asked for in this generation.
    pub fn limits(
        &self,
        permits: &Permits,
        model: usize,
        target: usize,
        connection: usize,
    ) -> &Limits {
        self.limits[model][target][connection].get_or_init(|| {
            let t = &self.config.models[model].targets[target];
            let conn = &self.config.providers[t.provider].connections[connection];
            let key = self.conn_key(t.provider, connection);
            let model_key = conn
                .model_concurrency
                .get(&t.model)
                .map(|n| (format!("{key}/{}", t.model), *n));
            permits.resolve(
                key,
                conn.max_concurrent,
                model_key.as_ref().map(|(k, n)| (k.as_str(), *n)),
            )
        })
    }

    /// `provider/connection` of a connection in this snapshot.
    pub fn conn_key(&self, provider: usize, connection: usize) -> &str {
        &self.conn_keys[provider][connection]
    }

    /// Model names a lockout of this target may be recorded under.
    pub fn lock_names(&self, model: usize, target: usize) -> &[String] {
        &self.lock_names[model][target]
    }

    /// The credential fingerprint of a connection in this snapshot.
    pub fn fingerprint(&self, provider: usize, connection: usize) -> Option<&str> {
        self.fingerprints.get(provider)?.get(connection)?.as_deref()
    }

    /// The credential fingerprint of a connection, by ids.
    pub fn fingerprint_of(&self, provider: &str, connection: &str) -> Option<&str> {
        let pi = self
            .config
            .providers
            .iter()
            .position(|p| p.id == provider)?;
        let ci = self.config.providers[pi]
            .connections
            .iter()
            .position(|c| c.id == connection)?;
        self.fingerprint(pi, ci)
    }

    /// The model a client's name resolves to: the exact name, else the longest pattern
    /// whose prefix it extends (SPEC §6).
    pub fn model_index(&self, name: &str) -> Option<usize> {
        if let Some(i) = self.models.get(name) {
            return Some(*i);
        }
        // A pattern passes the client's id on (upstream, and in `x-sluice-model`): only
        // plain, bounded ids qualify.
        if name.len() > MAX_PATTERN_ID || !name.bytes().all(|b| b.is_ascii_graphic()) {
            return None;
        }
        self.patterns
            .iter()
            .find(|(prefix, _)| name.len() > prefix.len() && name.starts_with(prefix.as_str()))
            .map(|(_, i)| *i)
    }

    /// The upstream model of `target` of `model` for a client that asked for `asked`: the
    /// target's own, or — a pattern's target without one — the client's id, after the
    /// pattern's prefix when that ends in `/` (`openai/*` sends `gpt-4o` for `openai/gpt-4o`).
    pub fn upstream_model<'a>(&'a self, model: usize, target: usize, asked: &'a str) -> &'a str {
        let m = &self.config.models[model];
        let t = &m.targets[target].model;
        if !t.is_empty() {
            return t;
        }
        // `openai/*` and `anthropic/claude-*` send what follows the prefix's last `/`.
        let prefix = m.name.trim_end_matches('*');
        match prefix.rfind('/') {
            Some(slash) => asked.get(slash + 1..).unwrap_or(asked),
            None => asked,
        }
    }

    /// The client owning `key`, looked up by the key's SHA-256.
    pub fn client_by_key(&self, key: &str) -> Option<&Client> {
        let h = hex::encode(Sha256::digest(key.as_bytes()));
        let i = *self.clients.get(&h)?;
        self.config.clients.as_ref()?.get(i)
    }

    /// True when the model has at least one target whose provider speaks `family`.
    pub fn serves_family(&self, model: usize, family: Family) -> bool {
        self.config.models[model]
            .targets
            .iter()
            .any(|t| self.config.providers[t.provider].api == family)
    }
}

pub use crate::policy::failover::{Pick, Tried};

/// The outcome of the select phase.
pub enum Selection {
    /// Go: the attempt holds its concurrency permit (and possibly the breaker's probe).
    Picked {
        pick: Pick,
        /// The candidate picked (a cluster at its cap waits on it, SPEC §7.1).
        candidate: Candidate,
        probe: bool,
        permit: PermitGuard,
    },
    /// Runnable candidates exist but all are at their concurrency cap.
    Full {
        full: Vec<Candidate>,
        excluded: Vec<Exclusion>,
    },
    /// Nothing runnable; every candidate that was considered, with its reason.
    Empty(Vec<Exclusion>),
}

/// One (target, connection) of a model, as the load-aware strategies scan it.
pub struct Slot {
    pub target: usize,
    pub connection: usize,
    /// `max_concurrent` of the connection.
    pub cap: Option<u32>,
    pub limits: Limits,
}

/// Why a picked candidate could not be taken: another request won the race.
enum Lost {
    /// Its last concurrency permit.
    Permit,
    /// The breaker's probe (or the breaker opened).
    Probe,
}

/// What the load-aware strategies know of one connection.
#[derive(Debug, Default)]
pub struct Signals {
    pub latency: LatencyWindow,
    pub rate: Option<RateLimitInfo>,
}

/// SHA-256 prefix of a credential: lets a reload notice a changed key without storing it.
pub fn fingerprint(secret: &str) -> String {
    hex::encode(&Sha256::digest(secret.as_bytes())[..8])
}

pub struct Engine {
    snapshot: ArcSwap<Snapshot>,
    pub tables: Tables,
    pub metrics: Metrics,
    pub resolver: Resolver,
    pub upstreams: crate::proxy::pool::Upstreams,
    pub store: Option<StoreWriter>,
    clock: Arc<dyn Clock>,
    pub reload: reload::ReloadState,
    pub permits: Permits,
    pub leases: leases::Leases,
    pub pins: Mutex<PinTable>,
    pub signals: Mutex<HashMap<String, Signals>>,
    /// Runtime setting overrides (PATCH /api/resilience), persisted.
    pub overrides: Mutex<std::collections::BTreeMap<String, Value>>,
    /// Drain state and the requests in flight (SPEC §8.1).
    pub lifecycle: Arc<crate::server::lifecycle::Lifecycle>,
    /// Whether the shared state backend answered its last call (`None`: no shared backend).
    pub shared_state: std::sync::OnceLock<Arc<std::sync::atomic::AtomicBool>>,
    /// Leases and caps shared with other nodes (SPEC §7.1); set once, before traffic.
    pub cluster: std::sync::OnceLock<Arc<crate::cluster::Cluster>>,
}

impl Engine {
    /// Shares leases and caps through `cluster` from now on (call before traffic: limits
    /// resolved earlier stay per node).
    pub fn join_cluster(&self, cluster: Arc<crate::cluster::Cluster>) {
        let _ = self.permits.cluster.set(cluster.clone());
        let _ = self.cluster.set(cluster);
    }

    pub fn new(
        snapshot: Snapshot,
        metrics: Metrics,
        store: Option<StoreWriter>,
        clock: Arc<dyn Clock>,
        config_path: Option<PathBuf>,
    ) -> Arc<Self> {
        let mut opts = ConnectorOptions::new(256);
        opts.keepalive_pool_size = 1024;
        let now = clock.now_ms();
        Arc::new(Self {
            snapshot: ArcSwap::from_pointee(snapshot),
            tables: Tables::default(),
            metrics,
            resolver: Resolver::default(),
            upstreams: crate::proxy::pool::Upstreams::new(opts),
            store,
            clock,
            reload: reload::ReloadState::new(config_path, now),
            permits: Permits::default(),
            leases: leases::Leases::default(),
            pins: Mutex::new(PinTable::default()),
            signals: Mutex::new(Default::default()),
            lifecycle: crate::server::lifecycle::Lifecycle::new(),
            shared_state: std::sync::OnceLock::new(),
            cluster: std::sync::OnceLock::new(),
            overrides: Mutex::new(Default::default()),
        })
    }

    pub fn now(&self) -> Millis {
        self.clock.now_ms()
    }

    /// The current snapshot; a request keeps the `Arc` it got here until it ends.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot.load_full()
    }

    /// The current snapshot for a short look (no reference count taken: nothing shared
    /// is written); not to be held across an `.await`.
    pub fn current(&self) -> arc_swap::Guard<Arc<Snapshot>> {
        self.snapshot.load()
    }

    fn swap(&self, snap: Snapshot) {
        self.snapshot.store(Arc::new(snap));
    }

    /// Select phase for one attempt: evaluate, prefer the session's pinned connection,
    /// else let the strategy pick; then take the concurrency permit and the breaker
    /// permit, all at `now` (a clock reading the caller has just taken). Races (a permit or
    /// the probe taken meanwhile) re-run the pick.
    pub fn select(
        &self,
        snap: &Snapshot,
        model: usize,
        family: Family,
        asker: &Asker<'_>,
        pin: Option<&str>,
        now: Millis,
    ) -> Selection {
        // The short way first: on a healthy model it checks only what the strategy looks
        // at. Anything it cannot settle (nothing usable, a lost race for the permit or
        // the probe) goes the full way, which also lists every exclusion.
        if let Some(c) = shortcut::pick(self, snap, model, family, asker, pin, now) {
            if let Ok(picked) = self.take(snap, model, c, now) {
                return picked;
            }
        }
        // Races with other requests (a permit or the probe taken between evaluate and
        // now) re-run the evaluation, which then sees the new state: a full connection
        // becomes `concurrency_full` (queue), a taken probe `circuit_open`.
        let mut last = Selection::Empty(Vec::new());
        for _ in 0..MAX_SELECT_ROUNDS {
            let eval = select::evaluate(self, snap, model, family, asker, now);
            let pinned = pin.and_then(|key| {
                eval.runnable
                    .iter()
                    .copied()
                    .find(|c| snap.conn_key(c.provider, c.connection) == key)
            });
            let Some(c) = pinned.or_else(|| select::pick(self, snap, model, &eval.runnable, now))
            else {
                if eval.full.is_empty() {
                    return Selection::Empty(eval.excluded);
                }
                return Selection::Full {
                    full: eval.full,
                    excluded: eval.excluded,
                };
            };
            last = match self.take(snap, model, c, now) {
                Ok(picked) => return picked,
                Err(Lost::Permit) => {
                    let mut full = eval.full;
                    full.push(c);
                    Selection::Full {
                        full,
                        excluded: eval.excluded,
                    }
                }
                Err(Lost::Probe) => Selection::Empty(eval.excluded),
            };
        }
        last
    }

    /// Takes the concurrency permit, then the breaker's, for a picked candidate.
    fn take(
        &self,
        snap: &Snapshot,
        model: usize,
        c: Candidate,
        now: Millis,
    ) -> Result<Selection, Lost> {
        let permit = select::limits(self, snap, model, &c)
            .try_acquire()
            .ok_or(Lost::Permit)?;
        let probe = match self.breaker_permit(snap, c.provider, now) {
            Permit::Allow => false,
            Permit::Probe => true,
            Permit::Deny { .. } => return Err(Lost::Probe),
        };
        Ok(Selection::Picked {
            pick: c.into(),
            candidate: c,
            probe,
            permit,
        })
    }

    /// Is `c` still a candidate (runnable or merely at capacity) for this asker now?
    pub fn still_runnable(
        &self,
        snap: &Snapshot,
        model: usize,
        family: Family,
        asker: &Asker<'_>,
        c: &Candidate,
    ) -> bool {
        let eval = select::evaluate(self, snap, model, family, asker, self.now());
        eval.runnable
            .iter()
            .chain(eval.full.iter())
            .any(|x| x.target == c.target && x.connection == c.connection)
    }

    /// Takes the breaker's permit for one attempt on `provider`.
    pub fn breaker_permit(&self, snap: &Snapshot, provider: usize, now: Millis) -> Permit {
        let bcfg = breaker_config(snap, provider);
        let id = &snap.config.providers[provider].id;
        // The snapshot's handle on the entry (the one recording uses): no lookup by
        // name, and no write to the table's lock or the entry's count that the other
        // workers' requests would then have to fetch back.
        let entry = snap.provider_entry(&self.tables, provider);
        let (permit, transition) = lock(entry).breaker.permit(&bcfg, now);
        if let Some(t) = transition {
            self.note_transition(id, t);
        }
        permit
    }

    /// Dry run of selection for `GET /api/routes/explain`: candidates in the order the
    /// strategy would try them, then the excluded ones with their reasons.
    pub fn explain(&self, model_name: &str) -> Option<Value> {
        let snap = self.snapshot();
        let model = snap.model_index(model_name)?;
        let now = self.now();
        let m = &snap.config.models[model];
        let mut families = Vec::new();
        for family in [Family::OpenAi, Family::Anthropic] {
            if !snap.serves_family(model, family) {
                continue;
            }
            let tried = Tried::default();
            let asker = Asker {
                client: None,
                lease: None,
                tried: &tried,
            };
            let eval = select::evaluate(self, &snap, model, family, &asker, now);
            // Runnable ones in strategy order, then those a request would queue for.
            let order = select::ranked(self, &snap, model, &eval.runnable, now);
            let candidates: Vec<Value> = order
                .iter()
                .map(|c| (c, false))
                .chain(eval.full.iter().map(|c| (c, true)))
                .map(|(c, at_cap)| {
                    let t = &m.targets[c.target];
                    let p = &snap.config.providers[c.provider];
                    json!({
                        "provider": p.id,
                        "connection": p.connections[c.connection].id,
                        "model": t.model,
                        "weight": t.weight,
                        "cost": t.cost,
                        "breaker": c.breaker.as_str(),
                        "inflight": self.permits.inflight(&state::conn_key(&p.id, &p.connections[c.connection].id)),
                        "at_capacity": at_cap,
                    })
                })
                .collect();
            let excluded: Vec<Value> = eval.excluded.iter().map(|e| e.json(now)).collect();
            families.push(
                json!({"family": family.as_str(), "candidates": candidates, "excluded": excluded}),
            );
        }
        Some(json!({"model": m.name, "strategy": m.strategy.as_str(), "families": families}))
    }

    /// Derives the state gauges from the tables at scrape time (lazy expiry included).
    pub fn refresh_gauges(&self) {
        let now = self.now();
        let snap = self.snapshot();
        let m = &self.metrics;
        for p in &snap.config.providers {
            let bcfg = breaker_config(
                &snap,
                snap.config
                    .providers
                    .iter()
                    .position(|x| x.id == p.id)
                    .unwrap_or(0),
            );
            let state = self
                .tables
                .provider_if_any(&p.id)
                .map(|e| lock(&e).breaker.state(&bcfg, now))
                .unwrap_or(crate::policy::breaker::BreakerState::Closed);
            m.breaker_state
                .with_label_values(&[p.id.as_str()])
                .set(state.gauge());
            for c in &p.connections {
                let (cooling, terminal) = match self.tables.connection_if_any(&p.id, &c.id) {
                    Some(e) => match lock(&e).state.eligibility(now) {
                        Eligibility::Eligible => (0, None),
                        Eligibility::Cooling { .. } => (1, None),
                        Eligibility::Terminal(t) => (0, Some(t)),
                    },
                    None => (0, None),
                };
                m.connection_cooling
                    .with_label_values(&[p.id.as_str(), c.id.as_str()])
                    .set(cooling);
                if let Some(sub) = &c.subscription {
                    let lane = sub.low_priority
                        && self
                            .tables
                            .connection_if_any(&p.id, &c.id)
                            .is_some_and(|e| lock(&e).subscription.lane_active(now));
                    m.subscription_lane_active
                        .with_label_values(&[p.id.as_str(), c.id.as_str()])
                        .set(i64::from(lane));
                }
                for t in [
                    crate::policy::TerminalState::Banned,
                    crate::policy::TerminalState::Expired,
                    crate::policy::TerminalState::CreditsExhausted,
                ] {
                    m.connection_terminal
                        .with_label_values(&[p.id.as_str(), c.id.as_str(), t.as_str()])
                        .set(i64::from(terminal == Some(t)));
                }
            }
        }
        m.model_lockouts_active
            .set(self.tables.lockouts_active(now).len() as i64);
        for p in &snap.config.providers {
            for c in &p.connections {
                let key = state::conn_key(&p.id, &c.id);
                m.queue_depth
                    .with_label_values(&[p.id.as_str(), c.id.as_str()])
                    .set(i64::from(self.permits.waiting(&key)));
            }
        }
        m.affinity_pins_active
            .set(lock(&self.pins).active_count(now) as i64);
        m.leases_active
            .set(self.leases.lock().active_count(now) as i64);
    }
}

impl From<Candidate> for Pick {
    fn from(c: Candidate) -> Self {
        Pick {
            target: c.target,
            provider: c.provider,
            connection: c.connection,
        }
    }
}

/// A client's `allowed_connections`, when present, limits it to those connections.
pub fn client_allows(client: Option<&Client>, provider: &str, connection: &str) -> bool {
    match client.and_then(|c| c.allowed_connections.as_ref()) {
        None => true,
        Some(list) => list.iter().any(|id| {
            id.split_once('/')
                .is_some_and(|(p, c)| p == provider && c == connection)
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(yaml: &str) -> Arc<Engine> {
        testing::engine_with(yaml, None)
    }

    const CAP_ONE: &str = "providers:\n  - id: p\n    base_url: \"http://127.0.0.1:9\"\n    api: openai\n    class: local\n    connections:\n      - { id: c, max_concurrent: 1 }\nmodels:\n  - name: m\n    targets: [ { provider: p, model: u } ]\n";

    #[test]
    fn a_lost_permit_race_queues_instead_of_failing() {
        let e = engine(CAP_ONE);
        let snap = e.snapshot();
        let tried = Tried::default();
        let asker = Asker {
            client: None,
            lease: None,
            tried: &tried,
        };
        for _ in 0..500 {
            let (a, b) = std::thread::scope(|s| {
                let a = s.spawn(|| e.select(&snap, 0, Family::OpenAi, &asker, None, e.now()));
                let b = s.spawn(|| e.select(&snap, 0, Family::OpenAi, &asker, None, e.now()));
                (a.join().unwrap(), b.join().unwrap())
            });
            let picked = [&a, &b]
                .iter()
                .filter(|s| matches!(s, Selection::Picked { .. }))
                .count();
            let full = [&a, &b]
                .iter()
                .filter(|s| matches!(s, Selection::Full { .. }))
                .count();
            // One gets the only permit, the other must be told to queue, never "nothing runs".
            assert_eq!((picked, full), (1, 1));
        }
    }

    #[test]
    fn an_open_breaker_is_reported_even_when_the_connection_also_cools() {
        let e = engine(CAP_ONE);
        let snap = e.snapshot();
        let now = e.now();
        let bcfg = breaker_config(&snap, 0);
        {
            let entry = e.tables.provider("p");
            let mut p = lock(&entry);
            // class local: OPEN after 2 failures, half-open 15 s later.
            p.breaker.record(&bcfg, true, false, now);
            p.breaker.record(&bcfg, true, false, now);
        }
        {
            let pick = Pick {
                target: 0,
                provider: 0,
                connection: 0,
            };
            let ccfg = e.cooldown_config(&snap, pick);
            let entry = e.tables.connection("p", "c");
            let failure = crate::policy::cooldown::Failure {
                attempt_started: now,
                reason: crate::policy::Reason::RateLimitExceeded,
                status: Some(429),
                hint: Some(std::time::Duration::from_secs(2)),
                rule_cooldown: None,
                terminal: None,
                message: "slow down",
            };
            lock(&entry).state.record_failure(&failure, &ccfg, now);
        }
        let tried = Tried::default();
        let asker = Asker {
            client: None,
            lease: None,
            tried: &tried,
        };
        let eval = select::evaluate(&e, &snap, 0, Family::OpenAi, &asker, now);
        assert!(eval.runnable.is_empty());
        assert_eq!(eval.excluded.len(), 1);
        let x = &eval.excluded[0];
        assert_eq!(x.reason, select::ExclusionReason::CircuitOpen);
        assert_eq!(x.until, Some(now + 15_000));

        // A connection cooldown that ends after the half-open time is what the
        // candidate waits for: reported as the breaker, at the later time.
        let entry = e.tables.connection("p", "c");
        let pick = Pick {
            target: 0,
            provider: 0,
            connection: 0,
        };
        let ccfg = e.cooldown_config(&snap, pick);
        let failure = crate::policy::cooldown::Failure {
            attempt_started: now + 1,
            reason: crate::policy::Reason::RateLimitExceeded,
            status: Some(429),
            hint: Some(std::time::Duration::from_secs(60)),
            rule_cooldown: None,
            terminal: None,
            message: "slow down",
        };
        lock(&entry).state.record_failure(&failure, &ccfg, now + 1);
        let eval = select::evaluate(&e, &snap, 0, Family::OpenAi, &asker, now + 1);
        let x = &eval.excluded[0];
        assert_eq!(x.reason, select::ExclusionReason::CircuitOpen);
        assert_eq!(x.until, Some(now + 1 + 60_000));
    }

    #[test]
    fn a_held_permit_makes_the_next_selection_queue() {
        let e = engine(CAP_ONE);
        let snap = e.snapshot();
        let tried = Tried::default();
        let asker = Asker {
            client: None,
            lease: None,
            tried: &tried,
        };
        let first = e.select(&snap, 0, Family::OpenAi, &asker, None, e.now());
        assert!(matches!(first, Selection::Picked { .. }));
        match e.select(&snap, 0, Family::OpenAi, &asker, None, e.now()) {
            Selection::Full { full, excluded } => {
                assert_eq!(full.len(), 1);
                assert_eq!(excluded[0].reason, select::ExclusionReason::ConcurrencyFull);
            }
            _ => panic!("expected Full"),
        }
        drop(first);
        assert!(matches!(
            e.select(&snap, 0, Family::OpenAi, &asker, None, e.now()),
            Selection::Picked { .. }
        ));
    }
}
