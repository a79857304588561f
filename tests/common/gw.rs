//! Spawning the gateway binary on OS-chosen ports with a config written to a temp dir.

use super::{request, Proc, Response};
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
    env: Vec<(String, String)>,
}

/// The admin token every test gateway is started with.
pub const ADMIN_TOKEN: &str = "test-admin-token";

impl Gateway {
    /// Writes `yaml` (which should listen on 127.0.0.1:0) and starts the gateway on it.
    /// `@DIR@` in the YAML is replaced by the gateway's private temp dir, where its
    /// state file and rules directory live (see `server_section`).
    pub fn start(yaml: &str, env: &[(&str, &str)]) -> Gateway {
        let (dir, env) = Self::prepare(yaml, env);
        Self::spawn(dir, env)
    }

    /// [`Gateway::start`] with the gateway's log (stderr) written to `log` in its dir.
    pub fn start_logged(yaml: &str, env: &[(&str, &str)]) -> Gateway {
        let (dir, env) = Self::prepare(yaml, env);
        let log = std::fs::File::create(dir.0.join("log")).expect("log file");
        Self::spawn_to(dir, env, std::process::Stdio::from(log))
    }

    /// A temp dir with `rules/` and `yaml` (with `@DIR@` filled in) as its config.
    fn prepare(yaml: &str, env: &[(&str, &str)]) -> (TempDir, Vec<(String, String)>) {
        let dir = TempDir::new("sluice-gw");
        std::fs::create_dir_all(dir.0.join("rules")).expect("rules dir");
        let yaml = yaml.replace("@DIR@", dir.0.to_str().expect("utf-8 path"));
        std::fs::write(dir.0.join("sluice.yaml"), yaml).expect("write config");
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        (dir, env)
    }

    /// What a [`Gateway::start_logged`] gateway has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("log")).unwrap_or_default()
    }

    fn spawn(dir: TempDir, env: Vec<(String, String)>) -> Gateway {
        Self::spawn_to(dir, env, std::process::Stdio::inherit())
    }

    fn spawn_to(dir: TempDir, env: Vec<(String, String)>, stderr: std::process::Stdio) -> Gateway {
        let path = dir.0.join("sluice.yaml");
        let mut all_env = vec![("SLUICE_ADMIN_TOKEN", ADMIN_TOKEN), ("SLUICE_LOG", "error")];
        all_env.extend(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let proc = Proc::spawn_with_stderr(
            env!("CARGO_BIN_EXE_sluice"),
            &["run", "--config", path.to_str().expect("utf-8 path")],
            &all_env,
            &["client", "admin"],
            stderr,
        );
        let client = proc.addr("client");
        let admin = proc.addr("admin");
        Gateway {
            proc,
            client,
            admin,
            dir,
            env,
        }
    }

    /// `kill -9` the gateway and start it again on the same config and state file.
    pub fn crash_and_restart(mut self) -> Gateway {
        self.proc.kill();
        let dir = std::mem::replace(&mut self.dir, TempDir(PathBuf::new()));
        let env = std::mem::take(&mut self.env);
        Self::spawn(dir, env)
    }

    /// `kill -9` the gateway, write `yaml` as its config, and start it again on the
    /// same state file.
    pub fn restart_with(mut self, yaml: &str) -> Gateway {
        self.proc.kill();
        self.rewrite_config(yaml);
        let dir = std::mem::replace(&mut self.dir, TempDir(PathBuf::new()));
        let env = std::mem::take(&mut self.env);
        Self::spawn(dir, env)
    }

    /// Stops the gateway (`kill -9`) and runs `sluice ARGS… --config <its config>`
    /// to completion, returning (exit code, stdout); start it again with `restart_with`.
    /// The command runs without the gateway's secrets in its environment.
    pub fn stop_and_run(&mut self, args: &[&str]) -> (i32, String) {
        self.proc.kill();
        let path = self.dir.0.join("sluice.yaml");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(args)
            .arg("--config")
            .arg(&path)
            .env_remove("SLUICE_ADMIN_TOKEN")
            .output()
            .expect("run sluice");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }

    pub fn write_rules(&self, file: &str, text: &str) {
        std::fs::write(self.dir.0.join("rules").join(file), text).expect("write rules");
    }

    pub fn rewrite_config(&self, yaml: &str) {
        let yaml = yaml.replace("@DIR@", self.dir.0.to_str().expect("utf-8 path"));
        std::fs::write(self.dir.0.join("sluice.yaml"), yaml).expect("write config");
    }

    pub fn admin(&self, method: &str, path: &str, body: &str) -> Response {
        admin_request(self.admin, method, path, body)
    }

    pub fn admin_get(&self, path: &str) -> Response {
        self.admin("GET", path, "")
    }

    pub fn admin_post(&self, path: &str, body: &str) -> Response {
        self.admin("POST", path, body)
    }

    pub fn admin_delete(&self, path: &str, body: &str) -> Response {
        self.admin("DELETE", path, body)
    }

    /// Sends `n` copies of a chat request at once (one thread each) and returns each
    /// response with how long it took, in the order they were started.
    pub fn parallel_chat(
        &self,
        n: usize,
        body: &'static str,
    ) -> Vec<(Response, std::time::Duration)> {
        let handles: Vec<_> = (0..n)
            .map(|_| {
                let client = self.client;
                std::thread::spawn(move || {
                    let t = std::time::Instant::now();
                    let r = request(client, "POST", "/v1/chat/completions", &[], body.as_bytes());
                    (r, t.elapsed())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("request thread"))
            .collect()
    }

    /// The value of one series of `/metrics`, written exactly as exported (labels in
    /// alphabetical order), e.g. `sluice_connection_cooling{connection="c",provider="p"}`;
    /// `None` when the series is absent.
    pub fn metric(&self, series: &str) -> Option<f64> {
        let text = request(self.admin, "GET", "/metrics", &[], b"").text();
        text.lines().find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
    }

    /// `connection`'s row of `GET /api/resilience/cooldowns?provider=…`.
    pub fn cooldown_row(&self, provider: &str, connection: &str) -> serde_json::Value {
        let r = self.admin_get(&format!("/api/resilience/cooldowns?provider={provider}"));
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["connections"]
            .as_array()
            .expect("connections")
            .iter()
            .find(|c| c["connection"] == connection)
            .cloned()
            .unwrap_or_else(|| panic!("no row for {provider}/{connection}"))
    }

    /// POSTs `body` to `/v1/chat/completions`.
    pub fn chat(&self, body: &str) -> Response {
        request(
            self.client,
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            body.as_bytes(),
        )
    }
}

/// `server:`, `admin:`, `state:` and `rules_dir:` sections for a test config on
/// OS-chosen ports, with state and rules in the gateway's temp dir.
/// One admin API call with the test admin token and a JSON body.
pub fn admin_request(admin: SocketAddr, method: &str, path: &str, body: &str) -> Response {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    request(
        admin,
        method,
        path,
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
        ],
        body.as_bytes(),
    )
}

pub fn server_section(extra: &str) -> String {
    format!(
        "server:\n  listen: \"127.0.0.1:0\"\n  admin_listen: \"127.0.0.1:0\"\n  threads: 1\n{extra}\nadmin:\n  token_env: SLUICE_ADMIN_TOKEN\nstate:\n  path: \"@DIR@/state.redb\"\nrules_dir: \"@DIR@/rules\"\n"
    )
}

/// A port on 127.0.0.1 that nothing listens on (bound, then released).
pub fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    drop(l);
    port
}
