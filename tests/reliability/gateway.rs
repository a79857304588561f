//! The gateway under a reliability run: `sluice run` on OS-chosen ports, its stderr
//! (log and panics) appended to a file across restarts, `kill -9` and restart in place
//! on the same config and state file.
//!
//! The harness's `common::gw::Gateway` inherits stderr, which would flood a run's output
//! with the access log and hide a panic among it; here every life of the process
//! writes to one file that the run scans for panics at the end.

use std::fs::OpenOptions;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use crate::common::gw::{TempDir, ADMIN_TOKEN};
use crate::common::{Response, STARTUP_TIMEOUT};

pub struct Gw {
    child: Child,
    pub client: SocketAddr,
    pub admin: SocketAddr,
    pub dir: TempDir,
    env: Vec<(String, String)>,
    /// Every life's stderr, appended.
    pub log: PathBuf,
    /// How many times the process was started.
    pub lives: u32,
}

impl Gw {
    /// Writes `yaml` (`@DIR@` → the private temp dir) and starts the gateway with
    /// `SLUICE_LOG=log_level` plus `env`.
    pub fn start(yaml: &str, env: &[(&str, &str)], log_level: &str) -> Gw {
        let dir = TempDir::new("sluice-reliability");
        std::fs::create_dir_all(dir.0.join("rules")).expect("rules dir");
        let yaml = yaml.replace("@DIR@", dir.0.to_str().expect("utf-8 path"));
        std::fs::write(dir.0.join("sluice.yaml"), yaml).expect("write config");
        let mut env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        env.push(("SLUICE_ADMIN_TOKEN".into(), ADMIN_TOKEN.into()));
        env.push(("SLUICE_LOG".into(), log_level.into()));
        let log = dir.0.join("gateway.stderr");
        let (child, client, admin) = spawn(&dir, &env, &log);
        Gw {
            child,
            client,
            admin,
            dir,
            env,
            log,
            lives: 1,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `kill -9`, reap, and start again on the same config and state file (new ports).
    pub fn crash_and_restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let (child, client, admin) = spawn(&self.dir, &self.env, &self.log);
        self.child = child;
        self.client = client;
        self.admin = admin;
        self.lives += 1;
    }

    pub fn admin(&self, method: &str, path: &str, body: &str) -> Response {
        crate::common::gw::admin_request(self.admin, method, path, body)
    }

    /// The cooldown row of `provider/connection` from `GET /api/resilience/cooldowns`.
    pub fn connection_row(&self, provider: &str, connection: &str) -> serde_json::Value {
        let r = self.admin(
            "GET",
            &format!("/api/resilience/cooldowns?provider={provider}"),
            "",
        );
        assert_eq!(r.status, 200, "cooldowns: {}", r.text());
        r.json()["connections"]
            .as_array()
            .expect("connections array")
            .iter()
            .find(|c| c["connection"] == connection)
            .cloned()
            .unwrap_or_else(|| panic!("no row for {provider}/{connection}: {}", r.text()))
    }

    /// Lines of the gateway's stderr that report a panic (with their next line).
    pub fn panics(&self) -> Vec<String> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines
            .iter()
            .enumerate()
            .filter(|(_, l)| l.contains("panicked"))
            .map(|(i, l)| format!("{l} {}", lines.get(i + 1).unwrap_or(&"")))
            .collect()
    }

    /// Size of the stderr log in bytes.
    pub fn log_bytes(&self) -> u64 {
        std::fs::metadata(&self.log).map(|m| m.len()).unwrap_or(0)
    }
}

impl Drop for Gw {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(
    dir: &TempDir,
    env: &[(String, String)],
    log: &PathBuf,
) -> (Child, SocketAddr, SocketAddr) {
    let stderr = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("open gateway log");
    let config = dir.0.join("sluice.yaml");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    cmd.args(["run", "--config", config.to_str().expect("utf-8 path")])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(stderr));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn sluice");
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        // Drain for the child's whole life so it never blocks on stdout.
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(line);
        }
    });
    let mut client = None;
    let mut admin = None;
    let started = std::time::Instant::now();
    while client.is_none() || admin.is_none() {
        let left = STARTUP_TIMEOUT.saturating_sub(started.elapsed());
        let line = match rx.recv_timeout(left.max(Duration::from_millis(1))) {
            Ok(l) => l,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                let log_text = std::fs::read_to_string(log).unwrap_or_default();
                let tail: String = log_text
                    .lines()
                    .rev()
                    .take(20)
                    .collect::<Vec<_>>()
                    .join("\n");
                panic!("gateway did not announce its listeners ({e:?}); stderr tail:\n{tail}");
            }
        };
        let mut it = line.split_whitespace();
        if it.next() != Some("LISTENING") {
            continue;
        }
        let name = it.next().unwrap_or("");
        let addr: Option<SocketAddr> = it.next().and_then(|a| a.parse().ok());
        match name {
            "client" => client = addr,
            "admin" => admin = addr,
            _ => {}
        }
    }
    (child, client.expect("client"), admin.expect("admin"))
}
