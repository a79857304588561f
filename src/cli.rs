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
use crate::server::frontdoor::{file_limit, listen, ClientLimits, FrontDoor};
use crate::server::handover::{Listeners, Signals, StopSignals, Successor, CLAIMED};
use crate::server::listener::TcpAppService;
use crate::server::workers::Joins;
use crate::store::{Change, RedbStore, RedisStore, StateStore, StoreWriter, Table};
use clap::{Parser, Subcommand};
use pingora::server::configuration::ServerConf;
use pingora::server::{RunArgs, Server};
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
        /// Take the listening sockets over from the running process (which then gets
        /// `SIGQUIT`), through `server.upgrade_sock` (SPEC §8.1).
        #[arg(long)]
        upgrade: bool,
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
    if let Some(r) = &config.redis {
        let _ = writeln!(
            out,
            "error: state.backend is redis ({}): clear runtime overrides with PATCH /api/resilience on any running node (every node takes it up)",
            RedisStore::new(r.url.expose(), &r.key_prefix)
                .map(|s| s.place().to_owned())
                .unwrap_or_else(|_| "redis".into())
        );
        return 1;
    }
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

/// `sluice run`: binds both listeners (or, with `upgrade`, takes them over from the
/// running process), prints `LISTENING <name> <addr>` for each, and serves until a stop
/// signal has drained the process (SPEC §8.1).
pub fn run(
    path: &Path,
    reset_state: bool,
    upgrade: bool,
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
    let loaded = reload::LoadedStamp::take(Some(path), &first.snapshot.config.rules_dir);
    for w in &first.warnings {
        tracing::warn!("{w}");
    }
    let config = &first.snapshot.config;
    let srv = config.server.clone();
    let threads = srv.threads;
    let (mut listeners, mut predecessor) = if upgrade {
        tracing::info!(sock = %srv.upgrade_sock, "upgrade: waiting for the running process's sockets");
        Listeners::inherit(&srv.upgrade_sock).map_err(|source| StartupError::Listen {
            addr: srv.upgrade_sock.clone(),
            source,
        })?
    } else {
        (Listeners::default(), Successor::none())
    };
    let listen_err = |addr: &str| {
        let addr = addr.to_owned();
        move |source| StartupError::Listen { addr, source }
    };
    // Every listener is claimed before the store: a predecessor lets go of the store
    // only once its successor holds the sockets.
    let client_sock = listeners
        .tcp("client", &srv.listen, listen)
        .map_err(listen_err(&srv.listen))?;
    let admin_sock = listeners
        .tcp("admin", &srv.admin_listen, |a| {
            std::net::TcpListener::bind(a)
        })
        .map_err(listen_err(&srv.admin_listen))?;
    for addr in listeners.close_unclaimed() {
        tracing::warn!(%addr, "upgrade: closed an inherited listener the config no longer has");
    }
    predecessor.tell(CLAIMED);
    let state_path = config.state_path.clone();
    let shared = config.redis.clone();
    // With a shared store, the change stream is read from where it stood before the
    // image was loaded: nothing another node writes meanwhile is missed.
    let mut changes = None;
    let mut node = None;
    let store: Arc<dyn StateStore> = match &shared {
        None => Arc::new(open_store(&state_path, reset_state, upgrade)?),
        Some(r) => {
            let store = RedisStore::new(r.url.expose(), &r.key_prefix)
                .map_err(|e| StartupError::Store(e.to_string()))?;
            let reader = store.reader();
            node = Some(store.node().to_owned());
            // `None` (Redis down at start): the saved state is merged in once it answers.
            let from = reader.stream_end().ok();
            changes = Some((reader, from, r.sync_interval));
            Arc::new(store)
        }
    };
    let image = match (store.load(), &shared) {
        (Ok(image), _) => image,
        (Err(e), None) => return Err(StartupError::Store(e.to_string())),
        // Redis down at start: serve on an empty local view; the writer commits once it
        // is back (SPEC §7.1: no request fails because Redis blinked).
        (Err(e), Some(_)) => {
            tracing::warn!(error = %e, "state: the shared store is unreachable; starting from an empty state");
            crate::store::empty_image()
        }
    };
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
    let backend_errors = metrics.state_backend_errors_total.clone();
    let reachable = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let shared_up = reachable.clone();
    let is_shared = shared.is_some();
    writer.on_failure(move |_| {
        write_errors.inc();
        if is_shared {
            backend_errors.inc();
            shared_up.store(false, std::sync::atomic::Ordering::Relaxed);
        }
    });
    let engine = Engine::new(
        snapshot,
        metrics,
        Some(writer.clone()),
        Arc::new(SystemClock),
        Some(path.to_path_buf()),
    );
    *crate::engine::state::lock(&engine.overrides) = overrides;
    let restored = engine.tables.restore(&image, engine.now());
    let (pins, leases) = engine.restore_sessions(&image);
    tracing::info!(restored, pins, leases, "state loaded");
    let outbox = crate::store::handover::dir_for(&state_path);
    let handing_over = Arc::new(std::sync::atomic::AtomicBool::new(false));
    if let (Some(r), Some(node)) = (&shared, &node) {
        // Leases and caps across nodes (SPEC §7.1), before any request resolves its limits.
        let cluster = crate::cluster::Cluster::start(
            r.url.expose(),
            &r.key_prefix,
            node,
            engine.metrics.state_backend_errors_total.clone(),
            reachable.clone(),
        )
        .map_err(|e| StartupError::Store(e.to_string()))?;
        engine.join_cluster(cluster);
    }
    if is_shared {
        let _ = engine.shared_state.set(reachable);
    }
    if let Some((reader, from, every)) = changes {
        // A shared store needs no hand-over (both processes write to it); what other
        // nodes write reaches this one through the change stream.
        spawn_change_reader(engine.clone(), reader, from, every);
    } else if upgrade {
        // What the predecessor forwards while it drains.
        spawn_inbox(
            engine.clone(),
            outbox.clone(),
            srv.drain_timeout,
            handing_over.clone(),
        );
    } else {
        // Batches no process is draining for any more (an upgrade that crashed): the
        // store was loaded since, and they may be older than it.
        let stale = crate::store::handover::take_inbox(&outbox).len();
        if stale > 0 {
            tracing::warn!(stale, dir = %outbox.display(), "state handover: dropped batches left by an earlier upgrade");
        }
    }
    reload::spawn_watcher(engine.clone(), loaded).map_err(|source| StartupError::Listen {
        addr: "reload watcher".into(),
        source,
    })?;

    let access = AccessLog::new(srv.access_log, logs);
    let gateway = Gateway::new(engine.clone(), access);
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
    let client_addr = client_sock.local_addr().map_err(listen_err(&srv.listen))?;
    let workers = Joins::default();
    let client_svc = FrontDoor::new(
        "sluice-client",
        client_sock,
        gateway,
        limits,
        threads,
        workers.clone(),
        engine.lifecycle.clone(),
    );
    let (admin_svc, admin_addr) = TcpAppService::from_listener(
        "sluice-admin",
        admin_sock,
        AdminApp::new(engine.clone()),
        Some(1),
    )
    .map_err(listen_err(&srv.admin_listen))?;
    // The stop signals are handled from before the announcement on (a signal right after
    // it is never fatal); the streams are read once the server runs.
    let signal_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| StartupError::Listen {
            addr: "signal handlers".into(),
            source,
        })?;
    let signals = Signals::install(&signal_rt).map_err(|source| StartupError::Listen {
        addr: "signal handlers".into(),
        source,
    })?;
    {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "LISTENING client {client_addr}");
        let _ = writeln!(out, "LISTENING admin {admin_addr}");
        let _ = out.flush();
    }
    tracing::info!(%client_addr, %admin_addr, upgrade, "sluice listening");
    let signals = StopSignals {
        signals: std::sync::Mutex::new(Some(signals)),
        life: engine.lifecycle.clone(),
        drain_timeout: srv.drain_timeout,
        upgrade_sock: srv.upgrade_sock.clone(),
        listeners: Arc::new(std::sync::Mutex::new(listeners)),
        store: Some(writer.clone()),
        store_path: state_path.clone(),
        shared_store: shared.is_some(),
        outbox,
        predecessor: std::sync::Mutex::new(predecessor),
        handing_over,
    };
    let mut server = Server::new_with_opt_and_conf(None, server_conf(threads));
    server.bootstrap();
    server.add_service(client_svc);
    server.add_service(admin_svc);
    server.run(RunArgs {
        shutdown_signal: Box::new(signals),
    });
    // The client workers end within a second of the shutdown.
    workers.join();
    // The runtimes have stopped: nothing changes state any more. The last batch goes to
    // the store (or, after an upgrade, to the successor).
    let flushed = signal_rt.block_on(writer.flush());
    if let Err(e) = flushed {
        tracing::error!(error = %e, "state store: the last flush failed");
    }
    Ok(())
}

/// How long an upgrading process waits for its predecessor to release the store.
const STORE_WAIT: Duration = Duration::from_secs(30);

/// Opens the redb store; an upgrading process retries while the old one still holds it
/// (it releases the file right after handing over the sockets).
fn open_store(path: &Path, reset: bool, upgrade: bool) -> Result<RedbStore, StartupError> {
    let started = crate::clock::monotonic();
    loop {
        match RedbStore::open(path, reset) {
            Ok(s) => return Ok(s),
            // Held by the predecessor until it heard that the listeners are claimed.
            Err(e @ crate::store::StoreError::Open { .. })
                if upgrade && started.elapsed() < STORE_WAIT =>
            {
                tracing::debug!(error = %e, "upgrade: the state store is still held, retrying");
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(StartupError::Store(e.to_string())),
        }
    }
}

/// Reads the shared store's change stream every `every` and applies what other nodes
/// wrote. A failed read (Redis down) is counted in the log once per outage and retried;
/// the local view keeps serving meanwhile.
fn spawn_change_reader(
    engine: Arc<Engine>,
    reader: RedisStore,
    mut from: Option<String>,
    every: Duration,
) {
    let spawned = std::thread::Builder::new()
        .name("sluice-changes".into())
        .spawn(move || {
            let mut down = false;
            loop {
                let Some(after) = from.clone() else {
                    // Started while Redis was down: once it answers, take the saved state
                    // (worse news wins over what this node learnt meanwhile) and read the
                    // stream from its end, not its whole history.
                    if let (Ok(end), Ok(image)) = (reader.stream_end(), reader.load()) {
                        let (leases, changes): (Vec<Change>, Vec<Change>) = image
                            .into_iter()
                            .flat_map(|(t, rows)| rows.into_iter().map(move |(k, v)| Change::upsert(t, k, v)))
                            .partition(|c| c.table == Table::Leases);
                        // The cluster's leases as stored: routing must keep off them.
                        engine.absorb_remote(leases);
                        let n = engine.absorb_forwarded(changes);
                        tracing::info!(merged = n, "state: the shared store answers; its saved state is merged in");
                        from = Some(end);
                    } else {
                        engine.metrics.state_backend_errors_total.inc();
                    }
                    std::thread::sleep(every);
                    continue;
                };
                match reader.changes_after(&after) {
                    Ok((next, batch)) => {
                        if let Some(up) = engine.shared_state.get() {
                            up.store(true, std::sync::atomic::Ordering::Relaxed);
                        }
                        if down {
                            tracing::info!("state: the shared store is reachable again");
                            down = false;
                        }
                        from = Some(next);
                        if !batch.is_empty() {
                            let n = engine.absorb_remote(batch);
                            tracing::debug!(applied = n, "state: changes from other nodes");
                        }
                    }
                    Err(e) => {
                        engine.metrics.state_backend_errors_total.inc();
                        if let Some(up) = engine.shared_state.get() {
                            up.store(false, std::sync::atomic::Ordering::Relaxed);
                        }
                        if !down {
                            tracing::warn!(error = %e, "state: cannot read other nodes' changes; serving on the local view");
                            down = true;
                        }
                    }
                }
                std::thread::sleep(every);
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "state: cannot follow other nodes' changes");
    }
}

/// Polls the handover directory for batches the draining predecessor forwards, for as
/// long as its drain may last (plus a minute), and applies them; stops at once when this
/// process hands over in turn (the batches would then be its own).
fn spawn_inbox(
    engine: Arc<Engine>,
    dir: PathBuf,
    drain_timeout: Duration,
    handing_over: Arc<std::sync::atomic::AtomicBool>,
) {
    let until = drain_timeout + Duration::from_secs(60);
    let started = crate::clock::monotonic();
    let spawned = std::thread::Builder::new()
        .name("sluice-handover".into())
        .spawn(move || loop {
            if handing_over.load(std::sync::atomic::Ordering::Acquire) || started.elapsed() >= until
            {
                return;
            }
            for batch in crate::store::handover::take_inbox(&dir) {
                let changes = batch.len();
                let in_memory = engine.absorb_forwarded(batch);
                tracing::info!(
                    changes,
                    in_memory,
                    "state handover: applied a batch from the previous process"
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "state handover: cannot watch for forwarded changes");
    }
}

/// Pingora's process settings. The drain is Sluice's own (`StopSignals`), so Pingora's
/// grace period is zero; the pid file is per process so several gateways (tests,
/// benchmarks) can run side by side.
fn server_conf(threads: usize) -> ServerConf {
    let tmp = std::env::temp_dir();
    let pid = std::process::id();
    ServerConf {
        threads,
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(1),
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
