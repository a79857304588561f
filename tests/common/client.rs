//! A minimal blocking HTTP/1.1 client for integration tests.
//!
//! It speaks just enough HTTP to test a gateway honestly: it writes exactly the request
//! it is given (plus `Content-Length`, and `Connection: close` unless the caller set a
//! `connection` header), skips interim 1xx responses, and decodes Content-Length, chunked
//! and close-delimited bodies. The streaming variant hands out chunk payloads as they
//! arrive so tests can timestamp them, and dropping it closes the socket, which is how a
//! test simulates a client going away. Nothing here retries or follows redirects.

#![allow(dead_code)]

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Read timeout of the non-streaming client.
pub const READ_TIMEOUT: Duration = Duration::from_secs(60);

/// A complete response.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    /// Header names lowercased, in arrival order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    /// The first value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        find_header(&self.headers, name)
    }

    /// The body parsed as JSON; panics with the body text when it is not JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "response body is not JSON ({e}); status {}, body: {}",
                self.status,
                self.text()
            )
        })
    }

    /// The body as (lossy) UTF-8.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

fn find_header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// Sends one request and reads the whole response; panics on any I/O error.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    try_request(addr, method, path, headers, body)
        .unwrap_or_else(|e| panic!("{method} {path} to {addr} failed: {e}"))
}

/// Like [`request`], but returns connection errors (refused, reset, closed early).
pub fn try_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<Response> {
    let mut s = try_open_stream(addr, method, path, headers, body)?;
    s.set_timeout(READ_TIMEOUT)?;
    let mut out = Vec::new();
    while let Some(c) = s.read_chunk()? {
        out.extend_from_slice(&c);
    }
    Ok(Response {
        status: s.status,
        headers: std::mem::take(&mut s.headers),
        body: out,
    })
}

/// POST a JSON value with `content-type: application/json` plus `headers`.
pub fn post_json(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
) -> Response {
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    let bytes = serde_json::to_vec(body).expect("serializable JSON");
    request(addr, "POST", path, &all, &bytes)
}

/// How a response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Length(u64),
    Chunked,
    UntilClose,
}

/// How a [`StreamResponse`] ended, once `next_chunk` returned `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEnd {
    /// The body ended as framed (terminating chunk, full length, or close-delimited EOF).
    Complete,
    /// No bytes arrived within the timeout given to `next_chunk`.
    Timeout,
    /// The connection broke mid-body (e.g. closed before the terminating chunk).
    Broken(String),
}

/// A response whose header has been read and whose body is consumed chunk by chunk.
pub struct StreamResponse {
    pub status: u16,
    /// Header names lowercased, in arrival order.
    pub headers: Vec<(String, String)>,
    /// Set when the body has ended; `None` while more may come.
    pub end: Option<StreamEnd>,
    reader: BufReader<TcpStream>,
    framing: Framing,
}

/// Sends a request and returns once the final response header is read; panics on error.
pub fn open_stream(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> StreamResponse {
    try_open_stream(addr, method, path, headers, body)
        .unwrap_or_else(|e| panic!("{method} {path} to {addr} failed: {e}"))
}

/// Like [`open_stream`], but returns connection errors.
pub fn try_open_stream(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<StreamResponse> {
    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(10))?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(READ_TIMEOUT))?;
    let mut head = format!("{method} {path} HTTP/1.1\r\n");
    let has = |n: &str| headers.iter().any(|(k, _)| k.eq_ignore_ascii_case(n));
    if !has("host") {
        head.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if !has("connection") {
        head.push_str("Connection: close\r\n");
    }
    if !has("content-length") && !has("transfer-encoding") {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    let mut w = &stream;
    w.write_all(head.as_bytes())?;
    // A server may answer (and close) before reading a large body; keep what it said.
    if let Err(e) = w.write_all(body) {
        if e.kind() != io::ErrorKind::BrokenPipe && e.kind() != io::ErrorKind::ConnectionReset {
            return Err(e);
        }
    }
    w.flush()?;

    let mut reader = BufReader::with_capacity(64 * 1024, stream);
    let is_head = method.eq_ignore_ascii_case("HEAD");
    loop {
        let (status, headers) = read_head(&mut reader)?;
        if (100..200).contains(&status) && status != 101 {
            continue;
        }
        let te_chunked = find_header(&headers, "transfer-encoding")
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
        let framing = if is_head || status == 204 || status == 304 {
            Framing::Length(0)
        } else if te_chunked {
            Framing::Chunked
        } else if let Some(cl) = find_header(&headers, "content-length") {
            Framing::Length(cl.trim().parse().map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("bad content-length {cl}"),
                )
            })?)
        } else {
            Framing::UntilClose
        };
        return Ok(StreamResponse {
            status,
            headers,
            end: None,
            reader,
            framing,
        });
    }
}

/// The size on a chunked body's size line (extensions after `;` ignored).
pub fn chunk_size(line: &str) -> io::Result<usize> {
    let size_text = line.split(';').next().unwrap_or("").trim();
    usize::from_str_radix(size_text, 16).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad chunk size line {line:?}"),
        )
    })
}

fn read_line(r: &mut impl BufRead) -> io::Result<String> {
    let mut line = String::new();
    let n = r.read_line(&mut line)?;
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed while reading a line",
        ));
    }
    while line.ends_with('\n') || line.ends_with('\r') {
        line.pop();
    }
    Ok(line)
}

fn read_head(r: &mut impl BufRead) -> io::Result<(u16, Vec<(String, String)>)> {
    let status_line = read_line(r)?;
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or("");
    let code = parts.next().unwrap_or("");
    if !version.starts_with("HTTP/1.") {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad status line {status_line:?}"),
        ));
    }
    let status: u16 = code.parse().map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad status line {status_line:?}"),
        )
    })?;
    let mut headers = Vec::new();
    loop {
        let line = read_line(r)?;
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    Ok((status, headers))
}

impl StreamResponse {
    /// The first value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        find_header(&self.headers, name)
    }

    fn set_timeout(&mut self, t: Duration) -> io::Result<()> {
        self.reader.get_ref().set_read_timeout(Some(t))
    }

    /// The next piece of body as it arrives (one decoded chunk for chunked bodies),
    /// or `None` once the body ended, the timeout passed or the connection broke; see
    /// [`Self::end`] for which. After `None`, every later call returns `None`.
    pub fn next_chunk(&mut self, timeout: Duration) -> Option<Vec<u8>> {
        if self.end.is_some() {
            return None;
        }
        let result = self
            .set_timeout(timeout.max(Duration::from_millis(1)))
            .and_then(|_| self.read_chunk());
        match result {
            Ok(Some(c)) => Some(c),
            Ok(None) => None,
            Err(e) => {
                self.end = Some(
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) {
                        StreamEnd::Timeout
                    } else {
                        StreamEnd::Broken(e.to_string())
                    },
                );
                None
            }
        }
    }

    /// Reads the rest of the body (each wait bounded by `timeout`) and concatenates it.
    pub fn read_to_end(&mut self, timeout: Duration) -> Vec<u8> {
        let mut out = Vec::new();
        while let Some(c) = self.next_chunk(timeout) {
            out.extend_from_slice(&c);
        }
        out
    }

    /// One framed piece; `Ok(None)` (and `end = Complete`) at the end of the body.
    fn read_chunk(&mut self) -> io::Result<Option<Vec<u8>>> {
        if self.end.is_some() {
            return Ok(None);
        }
        match self.framing {
            Framing::Length(0) => {
                self.end = Some(StreamEnd::Complete);
                Ok(None)
            }
            Framing::Length(left) => {
                let want = left.min(64 * 1024) as usize;
                let mut buf = vec![0u8; want];
                let n = self.reader.read(&mut buf)?;
                if n == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("connection closed with {left} body bytes missing"),
                    ));
                }
                buf.truncate(n);
                self.framing = Framing::Length(left - n as u64);
                Ok(Some(buf))
            }
            Framing::UntilClose => {
                let mut buf = vec![0u8; 64 * 1024];
                let n = self.reader.read(&mut buf)?;
                if n == 0 {
                    self.end = Some(StreamEnd::Complete);
                    return Ok(None);
                }
                buf.truncate(n);
                Ok(Some(buf))
            }
            Framing::Chunked => {
                let size = chunk_size(&read_line(&mut self.reader)?)?;
                if size == 0 {
                    // Trailers, then the blank line.
                    while !read_line(&mut self.reader)?.is_empty() {}
                    self.end = Some(StreamEnd::Complete);
                    return Ok(None);
                }
                let mut buf = vec![0u8; size];
                self.reader.read_exact(&mut buf)?;
                let crlf = read_line(&mut self.reader)?;
                if !crlf.is_empty() {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "chunk not followed by CRLF",
                    ));
                }
                Ok(Some(buf))
            }
        }
    }
}

/// One server-sent event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field, if any.
    pub event: Option<String>,
    /// The `data:` lines joined with `\n`.
    pub data: String,
}

impl SseEvent {
    /// The data parsed as JSON (panics if it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.data)
            .unwrap_or_else(|e| panic!("SSE data is not JSON ({e}): {}", self.data))
    }
}

/// Splits an SSE body into events (comments and unknown fields ignored).
pub fn parse_sse(body: &[u8]) -> Vec<SseEvent> {
    let text = String::from_utf8_lossy(body).replace("\r\n", "\n");
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        let mut event = None;
        let mut data: Vec<&str> = Vec::new();
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("event:") {
                event = Some(v.trim_start().to_string());
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push(v.strip_prefix(' ').unwrap_or(v));
            }
        }
        if event.is_some() || !data.is_empty() {
            out.push(SseEvent {
                event,
                data: data.join("\n"),
            });
        }
    }
    out
}
