//! Test support: engines built from YAML on a hand clock, with or without a store
//! writer, and a store whose commits can be made to fail. Compiled only for tests.

use super::{BaseConfig, Engine, Snapshot};
use crate::clock::ManualClock;
use crate::config::parse_str;
use crate::config::settings::resolve;
use crate::metrics::Metrics;
use crate::rules::RuleSet;
use crate::store::{Change, Image, MemoryStore, StateStore, StoreError, StoreWriter};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Unix ms the hand clock starts at.
pub const T0: u64 = 1_700_000_000_000;

/// An engine on `yaml` with a hand clock at [`T0`] and the given writer.
pub fn engine_with(yaml: &str, store: Option<StoreWriter>) -> Arc<Engine> {
    let loaded = parse_str(yaml, "t.yaml", Path::new("."), &|_| None).expect("test config");
    // Layered like a loaded file, so runtime overrides can be set on it.
    let base = Arc::new(BaseConfig {
        config: loaded.config.clone(),
        text: yaml.to_string(),
    });
    let mut cfg = loaded.config;
    let sources = resolve(&mut cfg, yaml, &|_| None, &BTreeMap::new()).expect("settings");
    let snap = Snapshot::layered(cfg, Arc::new(RuleSet::empty()), 1, sources, Some(base));
    Engine::new(
        snap,
        Metrics::new().expect("metrics"),
        store,
        Arc::new(ManualClock::new(T0)),
        None,
    )
}

/// A memory store whose commits fail while `failing` is set.
#[derive(Default)]
pub struct FailingStore {
    pub inner: MemoryStore,
    pub failing: AtomicBool,
}

impl FailingStore {
    pub fn new(failing: bool) -> Arc<Self> {
        Arc::new(Self {
            inner: MemoryStore::new(),
            failing: AtomicBool::new(failing),
        })
    }
}

impl StateStore for FailingStore {
    fn load(&self) -> Result<Image, StoreError> {
        self.inner.load()
    }

    fn apply(&self, changes: &[Change]) -> Result<(), StoreError> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(StoreError::Io("no space left on device".into()));
        }
        self.inner.apply(changes)
    }
}
