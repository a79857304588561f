//! Keyed resilience state: one entry per provider, per connection, per lockout key.
//!
//! Entries are keyed by configured ids (not config indices), so they survive a reload.
//! Each entry sits behind its own small mutex, taken only in synchronous code and never
//! across an `.await`; the maps themselves are behind `RwLock`s that are written only
//! when an entry is first seen, cleared by an operator, or restored at start. Every
//! mutation returns the store `Change` that persists it; callers hand those to the
//! batched writer (or commit them at once for terminal states). An entry, once in a
//! map, is never replaced or removed (a restore writes into it), so a config
//! generation may keep its handle (`Snapshot::provider_entry`, `Snapshot::conn_entry`).

use crate::policy::breaker::Breaker;
use crate::policy::cooldown::ConnState;
use crate::policy::lockout::Lockout;
use crate::policy::subscription::SubState;
use crate::policy::window_gate::WindowGate;
use crate::policy::{Millis, Reason};
use crate::store::{Change, Image, Table};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

/// Breaker and window gate of one provider.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProviderEntry {
    pub breaker: Breaker,
    pub window: WindowGate,
}

/// Cooldown state of one connection plus the fingerprint of the credential it was
/// recorded against (a changed credential on reload clears terminal states).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ConnEntry {
    pub state: ConnState,
    #[serde(default)]
    pub credential: Option<String>,
    /// The Claude subscription lane's memory (SPEC §5.13); empty for other connections.
    #[serde(default, skip_serializing_if = "SubState::is_empty")]
    pub subscription: SubState,
}

/// Lockout of one (provider, connection, model key).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LockEntry {
    pub provider: String,
    pub connection: String,
    pub model: String,
    pub lock: Lockout,
}

pub type Shared<T> = Arc<Mutex<T>>;

/// Locks a mutex, recovering the data if a panicking thread poisoned it: the state is
/// plain data and every writer leaves it consistent between statements.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Default)]
pub struct Tables {
    providers: RwLock<HashMap<String, Shared<ProviderEntry>>>,
    connections: RwLock<HashMap<String, Shared<ConnEntry>>>,
    lockouts: Mutex<HashMap<String, LockEntry>>,
}

/// Decodes one table of the image into a keyed map of shared entries; returns how
/// many were restored.
fn restore_into<T: DeserializeOwned>(
    image: &Image,
    table: Table,
    map: &RwLock<HashMap<String, Shared<T>>>,
) -> usize {
    let Some(rows) = image.get(&table) else {
        return 0;
    };
    let mut map = map.write().unwrap_or_else(|p| p.into_inner());
    let mut n = 0;
    for (k, v) in rows {
        match serde_json::from_value::<T>(v.clone()) {
            Ok(e) => {
                // In place when the entry exists: a snapshot may hold its handle.
                match map.get(k) {
                    Some(entry) => *lock(entry) = e,
                    None => {
                        map.insert(k.clone(), Arc::new(Mutex::new(e)));
                    }
                }
                n += 1;
            }
            Err(e) => {
                tracing::warn!(table = table.as_str(), key = %k, error = %e, "state: skipping undecodable entry")
            }
        }
    }
    n
}

/// `provider/connection`.
pub fn conn_key(provider: &str, connection: &str) -> String {
    format!("{provider}/{connection}")
}

/// `provider/connection/model`.
pub fn lock_key(provider: &str, connection: &str, model: &str) -> String {
    format!("{provider}/{connection}/{model}")
}

fn get_or_insert<T: Default>(map: &RwLock<HashMap<String, Shared<T>>>, key: &str) -> Shared<T> {
    if let Some(e) = map.read().unwrap_or_else(|p| p.into_inner()).get(key) {
        return e.clone();
    }
    map.write()
        .unwrap_or_else(|p| p.into_inner())
        .entry(key.to_string())
        .or_default()
        .clone()
}

pub fn change<T: Serialize>(table: Table, key: &str, value: Option<&T>) -> Change {
    Change {
        table,
        key: key.to_string(),
        value: value.and_then(|v| serde_json::to_value(v).ok()),
    }
}

/// A connection row that lifts a terminal state on purpose (an operator's clear, a new
/// credential): marked `"cleared": true`, which a shared store requires before it lets a
/// row that is not terminal replace a terminal one (SPEC §7.1).
pub fn cleared_row(key: &str, entry: &ConnEntry) -> Change {
    let mut row = change(Table::Connections, key, Some(entry));
    if let Some(serde_json::Value::Object(m)) = &mut row.value {
        m.insert("cleared".into(), serde_json::Value::Bool(true));
    }
    row
}

impl Tables {
    pub fn provider(&self, id: &str) -> Shared<ProviderEntry> {
        get_or_insert(&self.providers, id)
    }

    pub fn connection(&self, provider: &str, connection: &str) -> Shared<ConnEntry> {
        get_or_insert(&self.connections, &conn_key(provider, connection))
    }

    /// The connection entry if one exists, without creating it (the select phase does
    /// create entries, through `Snapshot::conn_entry`: a default entry reads as none).
    pub fn connection_if_any(&self, provider: &str, connection: &str) -> Option<Shared<ConnEntry>> {
        self.connections
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&conn_key(provider, connection))
            .cloned()
    }

    pub fn provider_if_any(&self, id: &str) -> Option<Shared<ProviderEntry>> {
        self.providers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }

    /// Snapshot of all provider entries, by id.
    pub fn providers_snapshot(&self) -> Vec<(String, ProviderEntry)> {
        let map = self.providers.read().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<_> = map
            .iter()
            .map(|(k, v)| (k.clone(), lock(v).clone()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Snapshot of all connection entries, by `provider/connection`.
    pub fn connections_snapshot(&self) -> Vec<(String, ConnEntry)> {
        let map = self.connections.read().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<_> = map
            .iter()
            .map(|(k, v)| (k.clone(), lock(v).clone()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// The active lockout (if any) among `models` on one connection.
    pub fn active_lockout(
        &self,
        provider: &str,
        connection: &str,
        models: &[String],
        now: Millis,
    ) -> Option<(Millis, Option<Reason>)> {
        let map = lock(&self.lockouts);
        // The common case on the select path: no lockout anywhere, nothing to format.
        if map.is_empty() {
            return None;
        }
        let mut key = String::with_capacity(provider.len() + connection.len() + 48);
        models.iter().find_map(|m| {
            key.clear();
            for part in [provider, "/", connection, "/", m] {
                key.push_str(part);
            }
            map.get(&key)
                .filter(|e| e.lock.active(now))
                .map(|e| (e.lock.until, e.lock.reason))
        })
    }

    /// Applies `f` to the lockout entry of a key (creating it), returning the change.
    pub fn with_lockout<R>(
        &self,
        provider: &str,
        connection: &str,
        model: &str,
        f: impl FnOnce(&mut LockEntry) -> R,
    ) -> (R, Change) {
        let key = lock_key(provider, connection, model);
        let mut map = lock(&self.lockouts);
        let entry = map.entry(key.clone()).or_insert_with(|| LockEntry {
            provider: provider.to_string(),
            connection: connection.to_string(),
            model: model.to_string(),
            lock: Lockout::default(),
        });
        let r = f(entry);
        let c = change(Table::Lockouts, &key, Some(&*entry));
        (r, c)
    }

    /// Success decay on a lockout entry, if one exists; deletes it when it reaches 0.
    pub fn decay_lockout(&self, provider: &str, connection: &str, model: &str) -> Option<Change> {
        let mut map = lock(&self.lockouts);
        if map.is_empty() {
            // The usual case on a success: no key to build.
            return None;
        }
        let key = lock_key(provider, connection, model);
        let entry = map.get_mut(&key)?;
        if entry.lock.record_success() {
            map.remove(&key);
            Some(change::<LockEntry>(Table::Lockouts, &key, None))
        } else {
            let c = change(Table::Lockouts, &key, Some(&*entry));
            Some(c)
        }
    }

    pub fn remove_lockout(&self, provider: &str, connection: &str, model: &str) -> Option<Change> {
        let key = lock_key(provider, connection, model);
        lock(&self.lockouts)
            .remove(&key)
            .map(|_| change::<LockEntry>(Table::Lockouts, &key, None))
    }

    /// Removes every lockout of one connection; returns the changes.
    pub fn remove_lockouts_of(&self, provider: &str, connection: &str) -> Vec<Change> {
        let prefix = format!("{}/", conn_key(provider, connection));
        let mut map = lock(&self.lockouts);
        let keys: Vec<String> = map
            .keys()
            .filter(|k| k.starts_with(&prefix))
            .cloned()
            .collect();
        keys.into_iter()
            .map(|k| {
                map.remove(&k);
                change::<LockEntry>(Table::Lockouts, &k, None)
            })
            .collect()
    }

    /// Active lockouts, sorted.
    pub fn lockouts_active(&self, now: Millis) -> Vec<LockEntry> {
        let mut out = self.lockouts_all();
        out.retain(|e| e.lock.active(now));
        out
    }

    /// Every lockout entry (active, or expired but still carrying a failure count that
    /// successes have not decayed to zero), sorted.
    pub fn lockouts_all(&self) -> Vec<LockEntry> {
        let mut out: Vec<_> = lock(&self.lockouts).values().cloned().collect();
        out.sort_by(|a, b| {
            (&a.provider, &a.connection, &a.model).cmp(&(&b.provider, &b.connection, &b.model))
        });
        out
    }

    /// Restores persisted state; entries that no longer decode are skipped (logged), and
    /// lockouts that have expired are dropped.
    pub fn restore(&self, image: &Image, now: Millis) -> usize {
        let mut n = restore_into(image, Table::Breakers, &self.providers);
        n += restore_into(image, Table::Connections, &self.connections);
        if let Some(rows) = image.get(&Table::Lockouts) {
            let mut map = lock(&self.lockouts);
            for (k, v) in rows {
                match serde_json::from_value::<LockEntry>(v.clone()) {
                    Ok(e) if e.lock.active(now) || e.lock.failures > 0 => {
                        map.insert(k.clone(), e);
                        n += 1;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(key = %k, error = %e, "state: skipping undecodable lockout entry")
                    }
                }
            }
        }
        n
    }
}
