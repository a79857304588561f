//! The engine: one shared object holding the config snapshot, routing state, metrics,
//! the upstream connector and the resolver.
//!
//! Config lives in an `ArcSwap<Snapshot>`; a request pins one snapshot at admission and
//! keeps it to the end, so a later swap never changes a request half-way. Routing state
//! is keyed by model index inside the snapshot, behind small mutexes that are held only
//! for the synchronous pick, never across an `.await`.

use crate::config::{Client, Config, Family};
use crate::metrics::Metrics;
use crate::proxy::resolve::Resolver;
use crate::routing::{ModelRouting, Offer};
use arc_swap::ArcSwap;
use pingora::connectors::http::Connector;
use pingora::connectors::ConnectorOptions;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One immutable generation of config plus the routing state that belongs to it.
pub struct Snapshot {
    pub config: Config,
    models: HashMap<String, usize>,
    clients: HashMap<String, usize>,
    routing: Vec<Mutex<ModelRouting>>,
}

impl Snapshot {
    pub fn new(config: Config) -> Self {
        let models = config
            .models
            .iter()
            .enumerate()
            .map(|(i, m)| (m.name.clone(), i))
            .collect();
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
            .map(|m| Mutex::new(ModelRouting::new(m.targets.len())))
            .collect();
        Self {
            config,
            models,
            clients,
            routing,
        }
    }

    pub fn model_index(&self, name: &str) -> Option<usize> {
        self.models.get(name).copied()
    }

    /// The client owning `key`, looked up by the key's SHA-256.
    pub fn client_by_key(&self, key: &str) -> Option<&Client> {
        use sha2::{Digest, Sha256};
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

/// What one request has already tried, so later attempts go elsewhere.
#[derive(Debug, Default, Clone)]
pub struct Tried {
    /// (provider, connection) pairs that failed this request.
    pub connections: Vec<(usize, usize)>,
    /// Providers that failed at provider level (transport, 408, 5xx) this request.
    pub providers: Vec<usize>,
}

/// The outcome of selection for one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    pub target: usize,
    pub provider: usize,
    pub connection: usize,
}

pub struct Engine {
    snapshot: ArcSwap<Snapshot>,
    pub metrics: Metrics,
    pub resolver: Resolver,
    pub connector: Connector,
}

impl Engine {
    pub fn new(config: Config, metrics: Metrics) -> Arc<Self> {
        let mut opts = ConnectorOptions::new(256);
        opts.keepalive_pool_size = 1024;
        Arc::new(Self {
            snapshot: ArcSwap::from_pointee(Snapshot::new(config)),
            metrics,
            resolver: Resolver::default(),
            connector: Connector::new(Some(opts)),
        })
    }

    /// The current snapshot; a request keeps the `Arc` it got here until it ends.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot.load_full()
    }

    /// Replaces the snapshot in one step (used by reload).
    pub fn swap(&self, config: Config) {
        self.snapshot.store(Arc::new(Snapshot::new(config)));
    }

    /// Chooses the target and connection for the next attempt, or `None` when nothing
    /// eligible is left for this request.
    pub fn select(
        &self,
        snap: &Snapshot,
        model: usize,
        family: Family,
        client: Option<&Client>,
        tried: &Tried,
        random: f64,
    ) -> Option<Pick> {
        let cfg = &snap.config;
        let m = &cfg.models[model];
        let mut offers: Vec<Offer> = Vec::with_capacity(m.targets.len());
        let mut conns: Vec<Vec<usize>> = Vec::with_capacity(m.targets.len());
        for (ti, t) in m.targets.iter().enumerate() {
            let p = &cfg.providers[t.provider];
            if p.api != family || tried.providers.contains(&t.provider) {
                continue;
            }
            let offered: Vec<usize> = (0..p.connections.len())
                .filter(|ci| t.connection.is_none_or(|pin| pin == *ci))
                .filter(|ci| !tried.connections.contains(&(t.provider, *ci)))
                .filter(|ci| client_allows(client, &p.id, &p.connections[*ci].id))
                .collect();
            if offered.is_empty() {
                continue;
            }
            offers.push(Offer {
                target: ti,
                weight: t.weight,
                cost: t.cost,
            });
            conns.push(offered);
        }
        let mut routing = snap.routing[model].lock().ok()?;
        let target = routing.pick(m.strategy, &offers, random)?;
        let slot = offers.iter().position(|o| o.target == target)?;
        let connection = routing.pick_connection(target, &conns[slot])?;
        Some(Pick {
            target,
            provider: m.targets[target].provider,
            connection,
        })
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
