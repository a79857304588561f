//! Spawning the gateway binary on OS-chosen ports with a config written to a temp dir.

use super::Proc;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A private temp directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> TempDir {
        let n = SEQ.fetch_add(1, Ordering::SeqCst);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let p = std::env::temp_dir().join(format!("{prefix}-{}-{n}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running `sluice run` with its listeners' addresses.
pub struct Gateway {
    pub proc: Proc,
    pub client: SocketAddr,
    pub admin: SocketAddr,
    pub dir: TempDir,
}

/// The admin token every test gateway is started with.
pub const ADMIN_TOKEN: &str = "test-admin-token";

impl Gateway {
    /// Writes `yaml` (which should listen on 127.0.0.1:0) and starts the gateway on it.
    pub fn start(yaml: &str, env: &[(&str, &str)]) -> Gateway {
        let dir = TempDir::new("sluice-gw");
        let path = dir.0.join("sluice.yaml");
        std::fs::write(&path, yaml).expect("write config");
        let mut all_env = vec![("SLUICE_ADMIN_TOKEN", ADMIN_TOKEN), ("SLUICE_LOG", "error")];
        all_env.extend_from_slice(env);
        let proc = Proc::spawn(
            env!("CARGO_BIN_EXE_sluice"),
            &["run", "--config", path.to_str().expect("utf-8 path")],
            &all_env,
            &["client", "admin"],
        );
        let client = proc.addr("client");
        let admin = proc.addr("admin");
        Gateway {
            proc,
            client,
            admin,
            dir,
        }
    }
}

/// `server:` and `admin:` sections for a test config on OS-chosen ports.
pub fn server_section(extra: &str) -> String {
    format!(
        "server:\n  listen: \"127.0.0.1:0\"\n  admin_listen: \"127.0.0.1:0\"\n  threads: 1\n{extra}\nadmin:\n  token_env: SLUICE_ADMIN_TOKEN\n"
    )
}

/// A port on 127.0.0.1 that nothing listens on (bound, then released).
pub fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    drop(l);
    port
}
