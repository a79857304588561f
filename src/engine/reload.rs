//! Hot reload of the routing config and the rule files (SPEC §6).
//!
//! A reload parses and validates everything off the request path, then swaps the
//! snapshot in one step; a reload that fails changes nothing and the previous config
//! keeps serving, with the error kept for `GET /api/config` and counted in
//! `sluice_config_reloads_total{result}`. Requests in flight keep the snapshot they
//! started with. Listener and state-path changes are reported as needing a restart.
//! Triggers: file change (polled every second), `SIGHUP`, `POST /api/config/reload`.

use super::state::{change, lock};
use super::{fingerprint, Engine, Snapshot};
use crate::config::{self, Loaded, Problem};
use crate::policy::cooldown::Cleared;
use crate::policy::Millis;
use crate::rules::RuleSet;
use crate::store::Table;
use serde::Serialize;
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

/// Loads and validates the config file and the rule files it points at.
pub fn load_all(
    path: &Path,
    env: config::EnvLookup<'_>,
) -> Result<(Loaded, RuleSet), Vec<Problem>> {
    let loaded = config::load_file(path, env)?;
    let rules = RuleSet::load_dir(&loaded.config.rules_dir)?;
    Ok((loaded, rules))
}

fn render(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

impl Engine {
    /// Re-reads config and rules; swaps them in if valid. Returns the new generation.
    pub fn reload_now(&self, trigger: &str) -> Result<u64, String> {
        let _one_at_a_time = lock(&self.reload.running);
        let Some(path) = self.reload.path.clone() else {
            return Err("this engine was not started from a config file".into());
        };
        let now = self.now();
        let (loaded, rules) = match load_all(&path, &env_lookup) {
            Ok(x) => x,
            Err(problems) => {
                let error = render(&problems);
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
                return Err(error);
            }
        };
        let old = self.snapshot();
        let mut warnings: Vec<String> = loaded.warnings.iter().map(ToString::to_string).collect();
        let (o, n) = (&old.config, &loaded.config);
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
        let generation = old.generation + 1;
        self.clear_terminal_on_new_credentials(&loaded.config);
        self.swap(Snapshot::new(loaded.config, Arc::new(rules), generation));
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
                    changes.push(change(
                        Table::Connections,
                        &format!("{}/{}", p.id, c.id),
                        Some(&*e),
                    ));
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
    let snap = engine.snapshot();
    let dir = &snap.config.rules_dir;
    let mut v: Vec<PathBuf> = engine.reload.path.iter().cloned().collect();
    v.push(dir.join("restatement.yaml"));
    v.push(dir.join("classification.yaml"));
    v
}

/// Starts the reload triggers on a dedicated thread: a 1 s poll of the watched files'
/// modification stamps, and `SIGHUP`.
pub fn spawn_watcher(engine: Arc<Engine>) -> std::io::Result<std::thread::JoinHandle<()>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new().name("sluice-reload".into()).spawn(move || {
        rt.block_on(async move {
            let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for SIGHUP; file watching still works");
                    None
                }
            };
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            let mut last = stamp(&watched(&engine));
            loop {
                let trigger = tokio::select! {
                    _ = tick.tick() => {
                        if stamp(&watched(&engine)) == last { continue; }
                        "file_change"
                    }
                    Some(_) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => "sighup",
                };
                let _ = engine.reload_now(trigger);
                last = stamp(&watched(&engine));
            }
        })
    })
}
