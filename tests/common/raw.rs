//! A scripted upstream on raw TCP, for what a well-behaved mock cannot do: answer with
//! a body cut short of its `Content-Length`, a chunked body without its last chunk, an
//! SSE event cut in half, or accept a request and never answer.
//!
//! Every connection reads one request (header and `Content-Length` body), counts it, then
//! plays the same script. Responses should carry `Connection: close` so the gateway never
//! tries to reuse a socket the script closes. Dropping the upstream stops the accept loop
//! and releases any connection parked in [`Step::Hang`].

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One thing the upstream does after reading a request.
#[derive(Clone, Debug)]
pub enum Step {
    Write(Vec<u8>),
    Sleep(Duration),
    /// Keep the connection open, silent, until the upstream is dropped.
    Hang,
    /// Read (and count) the next request on the same connection; the connection ends
    /// if none comes.
    ReadNext,
}

pub struct RawUpstream {
    pub addr: SocketAddr,
    calls: Arc<AtomicUsize>,
    /// The request line of every request read, in order.
    lines: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
}

/// How long a hanging connection is held at most (tests end well before).
const HANG_LIMIT: Duration = Duration::from_secs(120);

impl RawUpstream {
    /// Listens on 127.0.0.1 (OS-chosen port) and plays `script` for every request.
    pub fn start(script: Vec<Step>) -> RawUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind raw upstream");
        listener
            .set_nonblocking(true)
            .expect("nonblocking listener");
        let addr = listener.local_addr().expect("local addr");
        let calls = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (c, s, l) = (calls.clone(), stop.clone(), lines.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let (c, s, l, script) = (c.clone(), s.clone(), l.clone(), script.clone());
                        std::thread::spawn(move || serve(stream, &script, &c, &s, &l));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        RawUpstream {
            addr,
            calls,
            lines,
            stop,
        }
    }

    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests read so far.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// The request lines read so far (`POST /path HTTP/1.1`).
    pub fn request_lines(&self) -> Vec<String> {
        self.lines.lock().map(|l| l.clone()).unwrap_or_default()
    }
}

impl Drop for RawUpstream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Reads one request (header and `Content-Length` body), noting its request line;
/// false when none came.
fn read_request(reader: &mut BufReader<TcpStream>, lines: &Mutex<Vec<String>>) -> bool {
    let mut length = 0usize;
    let mut first = true;
    loop {
        let mut line = String::new();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => return false,
            Ok(_) => {}
        }
        let line = line.trim_end();
        if first {
            if let Ok(mut l) = lines.lock() {
                l.push(line.to_string());
            }
            first = false;
        }
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            if k.trim().eq_ignore_ascii_case("content-length") {
                length = v.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body).is_ok()
}

fn serve(
    stream: TcpStream,
    script: &[Step],
    calls: &AtomicUsize,
    stop: &AtomicBool,
    lines: &Mutex<Vec<String>>,
) {
    let _ = stream.set_nodelay(true);
    let mut reader = BufReader::new(match stream.try_clone() {
        Ok(s) => s,
        Err(_) => return,
    });
    if !read_request(&mut reader, lines) {
        return;
    }
    calls.fetch_add(1, Ordering::SeqCst);
    let mut w = &stream;
    for step in script {
        match step {
            Step::ReadNext => {
                if !read_request(&mut reader, lines) {
                    return;
                }
                calls.fetch_add(1, Ordering::SeqCst);
            }
            Step::Write(bytes) => {
                if w.write_all(bytes).and_then(|_| w.flush()).is_err() {
                    return;
                }
            }
            Step::Sleep(d) => std::thread::sleep(*d),
            Step::Hang => {
                let end = Instant::now() + HANG_LIMIT;
                while !stop.load(Ordering::SeqCst) && Instant::now() < end {
                    std::thread::sleep(Duration::from_millis(20));
                }
                return;
            }
        }
    }
    // End of script: the connection closes when `stream` drops.
}

/// A response head with `Connection: close` and the given extra header lines.
pub fn head(status: u16, headers: &[&str]) -> Vec<u8> {
    let mut s = format!("HTTP/1.1 {status} X\r\nConnection: close\r\n");
    for h in headers {
        s.push_str(h);
        s.push_str("\r\n");
    }
    s.push_str("\r\n");
    s.into_bytes()
}

/// A complete keep-alive response (no `Connection: close`), so the gateway pools the
/// connection.
pub fn keep_alive_ok(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// One chunk of a chunked body.
pub fn chunk(data: &[u8]) -> Vec<u8> {
    let mut v = format!("{:x}\r\n", data.len()).into_bytes();
    v.extend_from_slice(data);
    v.extend_from_slice(b"\r\n");
    v
}
