//! Command line: `sluice run --config FILE`, `sluice check --config FILE` and
//! `sluice state clear-overrides --config FILE`.
//!
//! `check` prints every problem as `file: path: reason` and exits 1 when there is one;
//! `run` refuses to start on an invalid config with the same list. Startup is the only
//! place that reads the process environment (for `*_env` secrets).

use crate::admin::AdminApp;
use crate::clock::SystemClock;
use crate::engine::reload::{self, prepare, Prepared};
use crate::engine::Engine;
use crate::error::StartupError;
use crate::metrics::Metrics;
use crate::proxy::access::AccessLog;
use crate::proxy::Gateway;
use crate::server::frontdoor::{file_limit, ClientLimits, FrontDoor};
use crate::server::listener::TcpAppService;
use crate::store::{Change, RedbStore, StateStore, StoreWriter, Table};
use clap::{Parser, Subcommand};
use pingora::server::configuration::ServerConf;
use pingora::server::Server;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(
    name = "sluice",
    version,
    about = "A resilient edge gateway for LLM APIs"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve: client listener + admin listener.
    Run {
        #[arg(long, short, default_value = "conf/sluice.yaml")]
        config: PathBuf,
        /// Move an unreadable or corrupt state file aside (renamed, never deleted) and
        /// start with empty state.
        #[arg(long)]
        reset_state: bool,
    },
    /// Validate the config and print every problem with its field path.
    Check {
        #[arg(long, short, default_value = "conf/sluice.yaml")]
        config: PathBuf,
    },
    /// Offline maintenance of the state store (the gateway must be stopped: it holds
    /// the store's lock while it runs).
    State {
        #[command(subcommand)]
        action: StateAction,
    },
}

#[derive(Subcommand, Debug)]
pub enum StateAction {
    /// Remove every runtime setting override (PATCH /api/resilience) from the store.
    ClearOverrides {
        #[arg(long, short, default_value = "conf/sluice.yaml")]
        config: PathBuf,
    },
}

fn env_lookup(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// `sluice check`: validates the config and the rule files it points at; returns the
/// process exit code.
pub fn check(path: &Path, out: &mut dyn Write) -> i32 {
    match prepare(path, &env_lookup, &Default::default(), 1) {
        Ok(Prepared {
            snapshot, warnings, ..
        }) => {
            let (config, rules) = (&snapshot.config, &snapshot.rules);
            for w in &warnings {
                let _ = writeln!(out, "warning: {w}");
            }
            let connections: usize = config.providers.iter().map(|p| p.connections.len()).sum();
            let _ = writeln!(
                out,
                "{}: OK ({} providers, {} connections, {} models)",
                path.display(),
                config.providers.len(),
                connections,
                config.models.len()
            );
            let _ = writeln!(
                out,
                "{}: OK ({} restatement rules, {} classification rules)",
                config.rules_dir.display(),
                rules.restatement_count(),
                rules.classification_count()
            );
            0
        }
        Err(problems) => {
            for p in &problems {
                let _ = writeln!(out, "error: {p}");
            }
            let _ = writeln!(out, "{}: {} problem(s)", path.display(), problems.len());
            1
        }
    }
}

/// `sluice state clear-overrides`: deletes every stored runtime override; returns the
/// process exit code. The store must not be open in a running gateway.
pub fn clear_overrides(path: &Path, out: &mut dyn Write) -> i32 {
    // Only `state.path` is needed: secrets named by `*_env` keys that the environment
    // does not hold (an operator's maintenance shell) stand in as placeholders, unused.
    let config = crate::config::read_source(path).and_then(|t| {
        let secrets = secret_env_names(&t.text);
        let lookup = |name: &str| {
            env_lookup(name).or_else(|| secrets.contains(name).then(|| "unused".to_string()))
        };
        crate::config::parse_str(&t.text, &t.file, &t.dir, &lookup).map(|l| l.config)
    });
    let config = match config {
        Ok(c) => c,
        Err(problems) => {
            for p in &problems {
                let _ = writeln!(out, "error: {p}");
            }
            return 1;
        }
    };
    let state_path = &config.state_path;
    if !state_path.exists() {
        let _ = writeln!(
            out,
            "{}: no state store yet; nothing to clear",
            state_path.display()
        );
        return 0;
    }
    let result = RedbStore::open(state_path, false).and_then(|store| {
        let image = store.load()?;
        let keys: Vec<String> = image
            .get(&Table::Overrides)
            .map(|t| t.keys().cloned().collect())
            .unwrap_or_default();
        let deletes: Vec<Change> = keys
            .iter()
            .map(|k| Change::delete(Table::Overrides, k.clone()))
            .collect();
        store.apply(&deletes)?;
        Ok(keys)
    });
    match result {
        Ok(keys) if keys.is_empty() => {
            let _ = writeln!(out, "{}: no runtime overrides", state_path.display());
            0
        }
        Ok(keys) => {
            let _ = writeln!(
                out,
                "{}: cleared {} runtime override(s): {}",
                state_path.display(),
                keys.len(),
                keys.join(", ")
            );
            0
        }
        Err(e) => {
            let _ = writeln!(
                out,
                "error: {e} (stop the gateway first; on a running one use PATCH /api/resilience)"
            );
            1
        }
    }
}

/// The environment variables a config names for its secrets (the values of every
/// `*_env` key, at any depth).
fn secret_env_names(text: &str) -> std::collections::BTreeSet<String> {
    fn walk(v: &serde_yaml::Value, out: &mut std::collections::BTreeSet<String>) {
        match v {
            serde_yaml::Value::Mapping(m) => {
                for (k, v) in m {
                    match (k.as_str(), v.as_str()) {
                        (Some(k), Some(name)) if k.ends_with("_env") => {
                            out.insert(name.to_string());
                        }
                        _ => walk(v, out),
                    }
                }
            }
            serde_yaml::Value::Sequence(items) => items.iter().for_each(|i| walk(i, out)),
            _ => {}
        }
    }
    let mut out = std::collections::BTreeSet::new();
    if let Ok(root) = serde_yaml::from_str::<serde_yaml::Value>(text) {
        walk(&root, &mut out);
    }
    out
}

/// `sluice run`: binds both listeners, prints `LISTENING <name> <addr>` for each, and
/// serves until a signal stops the process.
pub fn run(
    path: &Path,
    reset_state: bool,
    logs: Option<crate::logging::Background>,
) -> Result<(), StartupError> {
    let render = |problems: Vec<crate::config::Problem>| {
        StartupError::Config(
            problems
                .iter()
                .map(|p| format!("  {p}"))
                .collect::<Vec<_>>()
                .join("\n"),
        )
    };
    // The state path comes from the config; the overrides layer comes from the state.
    let first = prepare(path, &env_lookup, &Default::default(), 1).map_err(render)?;
    for w in &first.warnings {
        tracing::warn!("{w}");
    }
    let config = &first.snapshot.config;
    let config_server = config.server.clone();
    let threads = config.server.threads;
    let listen = config.server.listen.clone();
    let admin_listen = config.server.admin_listen.clone();
    let store: Arc<dyn StateStore> = Arc::new(
        RedbStore::open(&config.state_path, reset_state)
            .map_err(|e| StartupError::Store(e.to_string()))?,
    );
    let image = store
        .load()
        .map_err(|e| StartupError::Store(e.to_string()))?;
    let mut overrides = Engine::overrides_from(&image);
    let snapshot = if overrides.is_empty() {
        first.snapshot
    } else {
        let layered = prepare(path, &env_lookup, &overrides, 1).map_err(render)?;
        // An override the config no longer accepts (e.g. a fallback model that was
        // removed) is dropped with a warning, here and in the store; it never stops a start.
        for p in &layered.dropped_overrides {
            tracing::warn!("{p}");
            overrides.remove(&p.path);
        }
        if !layered.dropped_overrides.is_empty() {
            store
                .apply(&reload::override_deletes(&layered.dropped_overrides))
                .map_err(|e| StartupError::Store(e.to_string()))?;
        }
        layered.snapshot
    };
    let metrics = Metrics::new()?;
    let writer = StoreWriter::spawn_on_thread(store, Duration::from_millis(100))
        .map_err(|e| StartupError::Store(e.to_string()))?;
    let write_errors = metrics.store_write_errors_total.clone();
    writer.on_failure(move |_| write_errors.inc());
    let engine = Engine::new(
        snapshot,
        metrics,
        Some(writer),
        Arc::new(SystemClock),
        Some(path.to_path_buf()),
    );
    *crate::engine::state::lock(&engine.overrides) = overrides;
    let restored = engine.tables.restore(&image, engine.now());
    let (pins, leases) = engine.restore_sessions(&image);
    tracing::info!(restored, pins, leases, "state loaded");
    reload::spawn_watcher(engine.clone()).map_err(|source| StartupError::Listen {
        addr: "reload watcher".into(),
        source,
    })?;

    let conf = Arc::new(server_conf(threads));
    let access = AccessLog::new(config_server.access_log, logs);
    let proxy = pingora::proxy::http_proxy(&conf, Gateway::new(engine.clone(), access));
    let srv = &config_server;
    let limits = ClientLimits {
        header_timeout: srv.client_header_timeout,
        body_timeout: srv.client_body_timeout,
        keepalive_timeout: srv.keepalive_timeout,
        max_connections: ClientLimits::connections_for(srv.max_client_connections, file_limit()),
    };
    tracing::info!(
        max_client_connections = limits.max_connections,
        "client connection limits set"
    );
    let (client_svc, client_addr) =
        FrontDoor::bind("sluice-client", &listen, proxy, limits, Some(threads)).map_err(
            |source| StartupError::Listen {
                addr: listen.clone(),
                source,
            },
        )?;
    let (admin_svc, admin_addr) = TcpAppService::bind(
        "sluice-admin",
        &admin_listen,
        AdminApp::new(engine),
        Some(1),
    )
    .map_err(|source| StartupError::Listen {
        addr: admin_listen.clone(),
        source,
    })?;
    {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "LISTENING client {client_addr}");
        let _ = writeln!(out, "LISTENING admin {admin_addr}");
        let _ = out.flush();
    }
    tracing::info!(%client_addr, %admin_addr, "sluice listening");
    let mut server = Server::new_with_opt_and_conf(None, server_conf(threads));
    server.bootstrap();
    server.add_service(client_svc);
    server.add_service(admin_svc);
    server.run_forever()
}

/// Pingora's process settings: per-process pid/upgrade paths so several gateways (tests,
/// benchmarks) can run side by side, and a short grace period on SIGTERM.
fn server_conf(threads: usize) -> ServerConf {
    let tmp = std::env::temp_dir();
    let pid = std::process::id();
    ServerConf {
        threads,
        grace_period_seconds: Some(5),
        graceful_shutdown_timeout_seconds: Some(5),
        pid_file: tmp
            .join(format!("sluice-{pid}.pid"))
            .to_string_lossy()
            .into_owned(),
        upgrade_sock: tmp
            .join(format!("sluice-{pid}.sock"))
            .to_string_lossy()
            .into_owned(),
        ..ServerConf::default()
    }
}
