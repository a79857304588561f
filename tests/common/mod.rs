//! Shared harness of the integration tests: spawn binaries on port 0, learn their ports
//! from `LISTENING <name> <addr>` lines, talk HTTP to them, and kill them on drop.
//!
//! Every test file includes this module and uses a subset of it, hence the
//! `dead_code` allowances. Nothing here sleeps for a fixed time to "let things settle":
//! waiting is always a bounded poll for an observable condition.

#![allow(dead_code)]
// A harness failure is a failed test: panicking on it is the point, and it times the
// real binary, so it reads the wall clock.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

pub mod client;
pub mod gw;
pub mod raw;
pub mod redis;

#[allow(unused_imports)]
pub use client::{
    open_stream, parse_sse, post_json, request, try_open_stream, try_request, Response, SseEvent,
    StreamEnd, StreamResponse,
};

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// How long a child may take to announce all its listeners.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

/// A child process that is killed (SIGKILL) and reaped when dropped.
pub struct Proc {
    child: Child,
    /// Listener name → bound address, from the `LISTENING` lines seen so far.
    pub addrs: HashMap<String, SocketAddr>,
    /// Every stdout line the child printed (kept up to date by a drain thread).
    pub output: Arc<Mutex<Vec<String>>>,
    bin: String,
}

impl Proc {
    /// Spawns `bin` with `args` and extra `env`, then waits until it printed
    /// `LISTENING <name> <addr>` for every name in `wait_for` (panics after
    /// [`STARTUP_TIMEOUT`], or if the child exits first, with everything it printed).
    pub fn spawn(bin: &str, args: &[&str], env: &[(&str, &str)], wait_for: &[&str]) -> Proc {
        Self::spawn_with_stderr(bin, args, env, wait_for, Stdio::inherit())
    }

    /// [`Proc::spawn`] with the child's stderr (its log) sent to `stderr`.
    pub fn spawn_with_stderr(
        bin: &str,
        args: &[&str],
        env: &[(&str, &str)],
        wait_for: &[&str],
        stderr: Stdio,
    ) -> Proc {
        let mut cmd = Command::new(bin);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot spawn {bin}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let output = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel::<String>();
        {
            let output = output.clone();
            std::thread::spawn(move || {
                // Keep draining for the child's whole life so it never blocks on stdout.
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    output.lock().unwrap().push(line.clone());
                    let _ = tx.send(line);
                }
            });
        }
        let mut proc = Proc {
            child,
            addrs: HashMap::new(),
            output,
            bin: bin.to_string(),
        };
        let mut missing: HashSet<&str> = wait_for.iter().copied().collect();
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        while !missing.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some((name, addr)) = parse_listening(&line) {
                        missing.remove(name.as_str());
                        proc.addrs.insert(name, addr);
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    proc.kill();
                    panic!(
                        "{bin} did not announce {missing:?} within {STARTUP_TIMEOUT:?}; stdout so far:\n{}",
                        proc.output_text()
                    );
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = proc.child.wait().ok();
                    panic!(
                        "{bin} exited ({status:?}) before announcing {missing:?}; stdout:\n{}",
                        proc.output_text()
                    );
                }
            }
        }
        proc
    }

    /// The address announced for listener `name` (panics if none was).
    pub fn addr(&self, name: &str) -> SocketAddr {
        *self
            .addrs
            .get(name)
            .unwrap_or_else(|| panic!("{} announced no listener {name:?}", self.bin))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything printed to stdout so far, one line per line.
    pub fn output_text(&self) -> String {
        self.output.lock().unwrap().join("\n")
    }

    /// SIGKILL and reap; idempotent.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM (graceful shutdown request) without waiting.
    pub fn terminate(&self) {
        self.signal("TERM");
    }

    /// Sends signal `name` (e.g. "HUP") to the child with `kill`.
    pub fn signal(&self, name: &str) {
        let _ = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status();
    }

    /// Waits up to `timeout` for the child to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Parses `LISTENING <name> <addr>`.
fn parse_listening(line: &str) -> Option<(String, SocketAddr)> {
    let mut it = line.split_whitespace();
    if it.next()? != "LISTENING" {
        return None;
    }
    let name = it.next()?.to_string();
    let addr = it.next()?.parse().ok()?;
    Some((name, addr))
}

/// A running `sluice-mock` on a port of the OS's choosing.
pub struct Mock {
    pub proc: Proc,
    pub addr: SocketAddr,
}

impl Mock {
    /// Starts the mock with `--listen 127.0.0.1:0` plus `extra_args`.
    pub fn start(extra_args: &[&str]) -> Mock {
        let mut args = vec!["--listen", "127.0.0.1:0"];
        args.extend_from_slice(extra_args);
        let proc = Proc::spawn(env!("CARGO_BIN_EXE_sluice-mock"), &args, &[], &["mock"]);
        let addr = proc.addr("mock");
        Mock { proc, addr }
    }

    /// Starts a mock with `--name name` plus `extra_args`.
    pub fn start_named(name: &str, extra_args: &[&str]) -> Mock {
        let mut args = vec!["--name", name];
        args.extend_from_slice(extra_args);
        Mock::start(&args)
    }

    /// `http://127.0.0.1:PORT`
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The `/__stats` document.
    pub fn stats(&self) -> serde_json::Value {
        let r = request(self.addr, "GET", "/__stats", &[], b"");
        assert_eq!(r.status, 200, "/__stats: {}", r.text());
        r.json()
    }

    /// Number of requests seen on `route` (e.g. "/v1/chat/completions").
    pub fn route_count(&self, route: &str) -> u64 {
        self.stats()["routes"][route].as_u64().unwrap_or(0)
    }

    /// Sets the process fault (empty spec clears it); panics if the mock rejects it.
    pub fn set_fault(&self, spec: &str) {
        let r = request(self.addr, "POST", "/__fault", &[], spec.as_bytes());
        assert_eq!(r.status, 200, "POST /__fault {spec:?}: {}", r.text());
    }

    /// Zeroes the mock's counters.
    pub fn reset(&self) {
        let r = request(self.addr, "POST", "/__reset", &[], b"");
        assert_eq!(r.status, 200, "POST /__reset: {}", r.text());
    }
}

/// Lowercase hex SHA-256 of `data`.
pub fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Polls `cond` every 20 ms until it holds (true) or `timeout` passes (false).
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
