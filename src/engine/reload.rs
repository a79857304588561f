//! Hot reload of the routing config and the rule files (SPEC §6).
//!
//! A reload parses and validates everything off the request path, then swaps the
//! snapshot in one step; a reload that fails changes nothing and the previous config
//! keeps serving, with the error kept for `GET /api/config` and counted in
//! `sluice_config_reloads_total{result}`. Requests in flight keep the snapshot they
//! started with. Listener and state-path changes are reported as needing a restart.
//! Triggers: file change (polled; acted on once the file stopped changing), `SIGHUP`,
//! `POST /api/config/reload`. A reload that would open the client listener or drop the
//! admin token is refused like an invalid one (`weakens_access`).

use super::state::lock;
use super::{fingerprint, BaseConfig, Engine, Snapshot};
use crate::config::settings;
use crate::config::{self, Problem};
use crate::error::AdminError;
use crate::policy::cooldown::Cleared;
use crate::policy::Millis;
use crate::rules::RuleSet;
use crate::store::Table;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

/// What `GET /api/config` shows as `last_reload`.
#[derive(Clone, Debug, Serialize)]
pub struct ReloadStatus {
    pub ok: bool,
    pub error: Option<String>,
    pub at: Millis,
    pub trigger: String,
    pub generation: u64,
    pub warnings: Vec<String>,
}

pub struct ReloadState {
    pub path: Option<PathBuf>,
    status: Mutex<ReloadStatus>,
    /// Serialises reloads (watcher, SIGHUP and the admin call may race).
    running: Mutex<()>,
}

impl ReloadState {
    pub fn new(path: Option<PathBuf>, now: Millis) -> Self {
        Self {
            path,
            status: Mutex::new(ReloadStatus {
                ok: true,
                error: None,
                at: now,
                trigger: "startup".into(),
                generation: 1,
                warnings: Vec::new(),
            }),
            running: Mutex::new(()),
        }
    }

    pub fn status(&self) -> ReloadStatus {
        lock(&self.status).clone()
    }
}

fn env_lookup(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// A validated generation, ready to be swapped in.
pub struct Prepared {
    pub snapshot: Snapshot,
    pub warnings: Vec<Problem>,
    /// Stored overrides that no longer apply to this config (left out of it), one
    /// problem each with the key as its path; the caller warns, and removes them from
    /// the engine and the store.
    pub dropped_overrides: Vec<Problem>,
}

/// Reads the config file and its rules, validates both, and applies the env and
/// runtime-override layers (SPEC §5.7) — everything off the request path.
pub fn prepare(
    path: &Path,
    env: config::EnvLookup<'_>,
    overrides: &BTreeMap<String, serde_json::Value>,
    generation: u64,
) -> Result<Prepared, Vec<Problem>> {
    let config::ConfigText { text, file, dir } = config::read_source(path)?;
    let loaded = config::parse_str(&text, &file, &dir, env)?;
    let rules = RuleSet::load_dir(&loaded.config.rules_dir)?;
    let base = Arc::new(BaseConfig {
        config: loaded.config.clone(),
        text,
    });
    let mut cfg = loaded.config;
    let (kept, dropped_overrides) = settings::split_overrides(&cfg, overrides);
    let sources = settings::resolve(&mut cfg, &base.text, env, &kept)?;
    Ok(Prepared {
        snapshot: Snapshot::layered(cfg, Arc::new(rules), generation, sources, Some(base)),
        warnings: loaded.warnings,
        dropped_overrides,
    })
}

impl Engine {
    /// Forgets overrides a new config no longer accepts, in memory and in the store.
    fn drop_overrides(&self, dropped: &[Problem]) {
        if dropped.is_empty() {
            return;
        }
        let mut overrides = lock(&self.overrides);
        for p in dropped {
            overrides.remove(&p.path);
            tracing::warn!("{p}");
        }
        drop(overrides);
        if let Some(store) = &self.store {
            store.submit(override_deletes(dropped));
        }
    }
}

/// The store changes that delete these dropped overrides.
pub fn override_deletes(dropped: &[Problem]) -> Vec<crate::store::Change> {
    dropped
        .iter()
        .map(|p| crate::store::Change::delete(Table::Overrides, p.path.clone()))
        .collect()
}

fn render(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

/// Why a reload may not take effect on its own even though the file is valid: it
/// would open the client listener or lock the operator out (SPEC §6 reload safety).
/// Both take a restart, which warns at startup.
pub fn weakens_access(old: &config::Config, new: &config::Config) -> Option<String> {
    if old.clients.is_some() && new.clients.is_none() {
        return Some(
            "clients: the reload removes the clients section, which would open the client \
             listener to every caller; that takes a restart"
                .into(),
        );
    }
    if old.admin.token.is_some() && new.admin.token.is_none() {
        return Some(
            "admin: the reload leaves no admin token (section removed or its env var/file \
             unset), which would lock the admin API; that takes a restart"
                .into(),
        );
    }
    None
}

impl Engine {
    /// Records a refused reload: the previous config keeps serving.
    fn refuse(&self, trigger: &str, now: Millis, error: String) -> String {
        tracing::error!(
            trigger,
            "config reload rejected; the previous config keeps serving:\n{error}"
        );
        self.metrics
            .config_reloads_total
            .with_label_values(&["error"])
            .inc();
        let mut st = lock(&self.reload.status);
        st.ok = false;
        st.error = Some(error.clone());
        st.at = now;
        st.trigger = trigger.to_string();
        error
    }

    /// Re-reads config and rules; swaps them in if valid. Returns the new generation.
    pub fn reload_now(&self, trigger: &str) -> Result<u64, String> {
        let _one_at_a_time = lock(&self.reload.running);
        let Some(path) = self.reload.path.clone() else {
            return Err("this engine was not started from a config file".into());
        };
        let now = self.now();
        let overrides = lock(&self.overrides).clone();
        let generation = self.snapshot().generation + 1;
        let prepared = match prepare(&path, &env_lookup, &overrides, generation) {
            Ok(x) => x,
            Err(problems) => return Err(self.refuse(trigger, now, render(&problems))),
        };
        let old = self.snapshot();
        if let Some(reason) = weakens_access(&old.config, &prepared.snapshot.config) {
            return Err(self.refuse(trigger, now, reason));
        }
        let mut warnings: Vec<String> = prepared
            .warnings
            .iter()
            .chain(&prepared.dropped_overrides)
            .map(ToString::to_string)
            .collect();
        let (o, n) = (&old.config, &prepared.snapshot.config);
        if o.server.listen != n.server.listen
            || o.server.admin_listen != n.server.admin_listen
            || o.server.threads != n.server.threads
        {
            warnings.push(
                "server.listen/admin_listen/threads changed: takes effect after a restart".into(),
            );
        }
        if o.state_path != n.state_path {
            warnings.push("state.path changed: takes effect after a restart".into());
        }
        let redis_of = |c: &crate::config::Config| {
            c.redis
                .as_ref()
                .map(|r| (r.url.expose().to_owned(), r.key_prefix.clone()))
        };
        if redis_of(o) != redis_of(n) {
            warnings.push("state.backend/state.redis changed: takes effect after a restart".into());
        }
        self.clear_terminal_on_new_credentials(&prepared.snapshot.config);
        self.drop_overrides(&prepared.dropped_overrides);
        self.swap(prepared.snapshot);
        self.metrics
            .config_reloads_total
            .with_label_values(&["ok"])
            .inc();
        tracing::info!(trigger, generation, "config reloaded");
        for w in &warnings {
            tracing::warn!("{w}");
        }
        *lock(&self.reload.status) = ReloadStatus {
            ok: true,
            error: None,
            at: now,
            trigger: trigger.to_string(),
            generation,
            warnings,
        };
        Ok(generation)
    }

    /// Replaces the runtime overrides (PATCH /api/resilience): validated against the
    /// current base config, swapped in, then persisted before the caller answers.
    pub async fn set_overrides(
        &self,
        changes: BTreeMap<String, Option<serde_json::Value>>,
    ) -> Result<u64, AdminError> {
        let (snapshot, persisted) = self.layer_overrides(&changes)?;
        if let Some(store) = &self.store {
            store.commit_now(persisted).await.map_err(|e| {
                AdminError::NotPersisted(format!(
                    "override applied but not persisted ({}): it is retried in the \
                         background and lost if the process stops first",
                    e.label()
                ))
            })?;
        }
        Ok(snapshot)
    }

    /// Overrides another node set (SPEC §7.1, through the shared store's change stream):
    /// layered here the same way, not written again. One this node's config does not
    /// accept is left out with a warning; this node keeps its settings.
    pub fn take_remote_overrides(&self, changes: BTreeMap<String, Option<serde_json::Value>>) {
        match self.layer_overrides(&changes) {
            Ok((generation, _)) => {
                tracing::info!(
                    generation,
                    settings = changes.len(),
                    "runtime overrides from another node applied"
                )
            }
            Err(e) => {
                tracing::warn!(error = %e, "runtime overrides from another node do not fit this node's config; keeping its settings")
            }
        }
    }

    /// Validates `changes` against the base config and swaps the layered snapshot in;
    /// returns its generation and the store changes that persist them.
    fn layer_overrides(
        &self,
        changes: &BTreeMap<String, Option<serde_json::Value>>,
    ) -> Result<(u64, Vec<crate::store::Change>), AdminError> {
        {
            let _one_at_a_time = lock(&self.reload.running);
            let old = self.snapshot();
            let Some(base) = old.base.clone() else {
                return Err(AdminError::Rejected(
                    "this engine has no base config to layer overrides on".into(),
                ));
            };
            let mut next = lock(&self.overrides).clone();
            for (k, v) in changes {
                match v {
                    Some(v) => next.insert(k.clone(), v.clone()),
                    None => next.remove(k),
                };
            }
            let mut cfg = base.config.clone();
            let sources = settings::resolve(&mut cfg, &base.text, &env_lookup, &next)
                .map_err(|p| AdminError::BadRequest(render(&p)))?;
            let generation = old.generation + 1;
            self.swap(Snapshot::layered(
                cfg,
                old.rules.clone(),
                generation,
                sources,
                Some(base),
            ));
            *lock(&self.overrides) = next.clone();
            let persisted: Vec<crate::store::Change> = changes
                .keys()
                .map(|k| crate::store::Change {
                    table: Table::Overrides,
                    key: k.clone(),
                    value: next.get(k).cloned(),
                })
                .collect();
            Ok((generation, persisted))
        }
    }

    /// A terminal state is cleared when the connection's credential changed (SPEC §5.3).
    fn clear_terminal_on_new_credentials(&self, cfg: &config::Config) {
        let mut changes = Vec::new();
        for p in &cfg.providers {
            for c in &p.connections {
                let Some(entry) = self.tables.connection_if_any(&p.id, &c.id) else {
                    continue;
                };
                let mut e = lock(&entry);
                let new_fp = c.key.as_ref().map(|k| fingerprint(k.expose()));
                if e.state.terminal.is_some() && e.credential.is_some() && e.credential != new_fp {
                    if e.state.clear(true) == Cleared::Cleared {
                        tracing::info!(provider = %p.id, connection = %c.id, "credential changed: terminal state cleared");
                    }
                    e.credential = new_fp;
                    changes.push(super::state::cleared_row(&format!("{}/{}", p.id, c.id), &e));
                }
            }
        }
        if let Some(store) = &self.store {
            store.submit(changes);
        }
    }
}

/// Modification stamp of the watched files (config + both rule files).
fn stamp(paths: &[PathBuf]) -> Vec<Option<(SystemTime, u64)>> {
    paths
        .iter()
        .map(|p| {
            std::fs::metadata(p)
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.len())))
        })
        .collect()
}

fn watched(engine: &Engine) -> Vec<PathBuf> {
    watched_paths(
        engine.reload.path.as_deref(),
        &engine.snapshot().config.rules_dir,
    )
}

/// The config file (if any) and the two rule files of `rules_dir`.
fn watched_paths(config: Option<&std::path::Path>, rules_dir: &std::path::Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = config.iter().map(|p| p.to_path_buf()).collect();
    v.push(rules_dir.join("restatement.yaml"));
    v.push(rules_dir.join("classification.yaml"));
    v
}

/// The stamp of the watched files as the startup load read them, for [`spawn_watcher`]:
/// taken right after that load, so a file saved later during startup is a change.
pub struct LoadedStamp(Vec<Option<(SystemTime, u64)>>);

impl LoadedStamp {
    pub fn take(config: Option<&std::path::Path>, rules_dir: &std::path::Path) -> Self {
        LoadedStamp(stamp(&watched_paths(config, rules_dir)))
    }
}

/// How often the watched files' stamps are read. A change is acted on only once two
/// polls in a row agree (the file stopped changing), so a reload is at most two polls
/// behind a save: within SPEC §6's 2 s.
const POLL: Duration = Duration::from_millis(500);

/// What the poller does with a fresh stamp: nothing while the files are as last loaded,
/// wait while they are still changing, reload once they held still for one poll.
#[derive(Debug, PartialEq)]
enum Watch {
    Unchanged,
    Settling,
    Stable,
}

fn watch_step<T: PartialEq + Clone>(loaded: &T, pending: &mut Option<T>, now: T) -> Watch {
    if &now == loaded {
        *pending = None;
        return Watch::Unchanged;
    }
    if pending.as_ref() == Some(&now) {
        *pending = None;
        return Watch::Stable;
    }
    *pending = Some(now);
    Watch::Settling
}

/// Starts the reload triggers on a dedicated thread: a poll of the watched files'
/// stamps (size and modification time; a file still being written is waited for, never
/// read mid-write), and `SIGHUP`.
/// `loaded`: the files' stamp at the startup load, not when the thread first runs (it
/// may start late on a busy machine, after a save that would then pass for the loaded
/// file and never be applied). `SIGHUP` is taken over before this returns, so one sent
/// once the gateway has announced itself never meets its default action (exit).
pub fn spawn_watcher(
    engine: Arc<Engine>,
    loaded: LoadedStamp,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut last = loaded.0;
    let mut hup = {
        let _in_rt = rt.enter();
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGHUP; file watching still works");
                None
            }
        }
    };
    std::thread::Builder::new().name("sluice-reload".into()).spawn(move || {
        rt.block_on(async move {
            let mut tick = tokio::time::interval(POLL);
            let mut pending = None;
            loop {
                // The stamp of what this reload reads is taken before it reads: a change
                // landing during the reload is seen by the next poll, never absorbed.
                let (trigger, seen) = tokio::select! {
                    _ = tick.tick() => {
                        let now = stamp(&watched(&engine));
                        if watch_step(&last, &mut pending, now.clone()) != Watch::Stable { continue; }
                        ("file_change", now)
                    }
                    Some(_) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => ("sighup", stamp(&watched(&engine))),
                };
                let _ = engine.reload_now(trigger);
                last = seen;
                pending = None;
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::{watch_step, Watch};

    #[test]
    fn a_change_is_acted_on_only_once_it_held_still_for_one_poll() {
        let loaded = (1, 10);
        let mut pending = None;
        assert_eq!(watch_step(&loaded, &mut pending, (1, 10)), Watch::Unchanged);
        // mid-write: the size moves between polls
        assert_eq!(watch_step(&loaded, &mut pending, (2, 0)), Watch::Settling);
        assert_eq!(watch_step(&loaded, &mut pending, (3, 5)), Watch::Settling);
        assert_eq!(watch_step(&loaded, &mut pending, (3, 5)), Watch::Stable);
        // a file put back as it was loaded is no change at all
        assert_eq!(watch_step(&loaded, &mut pending, (4, 7)), Watch::Settling);
        assert_eq!(watch_step(&loaded, &mut pending, (1, 10)), Watch::Unchanged);
        assert_eq!(pending, None);
    }
}
