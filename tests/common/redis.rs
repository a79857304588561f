//! A private `redis-server` for the shared-state tests: its own port (chosen by binding
//! and releasing it), no persistence, killed when dropped.

use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Redis {
    child: Child,
    pub addr: SocketAddr,
}

impl Redis {
    /// Starts `redis-server` on a free port of 127.0.0.1 and waits until it answers.
    pub fn start() -> Redis {
        let port = super::gw::closed_port();
        Self::start_on(port)
    }

    /// Starts it on `port` (e.g. again, after [`Redis::stop`]).
    pub fn start_on(port: u16) -> Redis {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server (Debian package redis-server) must be installed");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "redis-server did not start on {addr}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Redis { child, addr }
    }

    pub fn url(&self) -> String {
        format!("redis://{}/", self.addr)
    }

    /// `redis-cli` style command over a raw connection (RESP inline), returning the reply.
    pub fn command(&self, args: &[&str]) -> String {
        use std::io::{Read, Write};
        let mut s = TcpStream::connect(self.addr).unwrap();
        let mut req = format!("*{}\r\n", args.len());
        for a in args {
            req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        s.write_all(req.as_bytes()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut buf = vec![0u8; 64 * 1024];
        let n = s.read(&mut buf).unwrap_or(0);
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    /// Every command Redis runs from now on (`MONITOR`), collected in the background.
    pub fn monitor(&self) -> Monitor {
        use std::io::{BufRead, BufReader, Write};
        let mut s = TcpStream::connect(self.addr).unwrap();
        s.write_all(b"MONITOR\r\n").unwrap();
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (reader, sink) = (s.try_clone().unwrap(), lines.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(reader).lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap().push(line);
            }
        });
        // The reply to MONITOR itself comes first.
        let deadline = Instant::now() + Duration::from_secs(5);
        while lines.lock().unwrap().is_empty() {
            assert!(Instant::now() < deadline, "MONITOR did not answer");
            std::thread::sleep(Duration::from_millis(5));
        }
        Monitor { stream: s, lines }
    }

    pub fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What [`Redis::monitor`] has seen so far; stops watching when dropped.
pub struct Monitor {
    stream: TcpStream,
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Monitor {
    /// Commands seen whose line contains every one of `parts`.
    pub fn count(&self, parts: &[&str]) -> usize {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| parts.iter().all(|p| l.contains(p)))
            .count()
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}
