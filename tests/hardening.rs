//! Hostile clients, unsafe reloads and leaked secrets (SPEC §3, §6; issue #8).
//!
//! Each test drives the real binary over raw sockets where the client's behaviour is
//! the point (slow headers, pipelining, HTTP/1.0, oversized headers) and checks what the
//! client, the upstream and the operator would see.

// Integration tests: a failed unwrap is a failed test, and they time the real binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod common;

use common::gw::{server_section, Gateway, ADMIN_TOKEN};
use common::raw::{head, keep_alive_ok, RawUpstream, Step};
use common::{request, wait_until, Mock};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

const CLIENT_KEY: &str = "client-key-0123456789";
const UPSTREAM_KEY: &str = "sk-upstream-SECRET-4242";
const ENV: &[(&str, &str)] = &[("UP_KEY", UPSTREAM_KEY), ("CLIENT_KEY", CLIENT_KEY)];

fn config(base_url: &str, server_extra: &str, clients: bool) -> String {
    let clients = if clients {
        "clients:\n  - { id: team, key_env: CLIENT_KEY }\n"
    } else {
        ""
    };
    format!(
        "{}{clients}providers:
  - id: p
    base_url: \"{base_url}\"
    api: openai
    connections: [ {{ id: c, api_key_env: UP_KEY }} ]
  - id: ant
    base_url: \"{base_url}\"
    api: anthropic
    connections: [ {{ id: c, api_key_env: UP_KEY }} ]
models:
  - name: m
    targets: [ {{ provider: p, model: up }} ]
  - name: claude
    targets: [ {{ provider: ant, model: up }} ]
",
        server_section(server_extra)
    )
}

/// The bundled mock and a gateway on it (`server_extra` goes under `server:`).
fn on_mock(server_extra: &str, clients: bool) -> (Mock, Gateway) {
    let mock = Mock::start(&[]);
    let gw = Gateway::start(&config(&mock.base_url(), server_extra, clients), ENV);
    (mock, gw)
}

/// A chat request without a client key.
fn anonymous_chat(gw: &Gateway) -> u16 {
    request(
        gw.client,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        br#"{"model":"m","messages":[]}"#,
    )
    .status
}

fn chat(gw: &Gateway, path: &str) -> common::Response {
    request(
        gw.client,
        "POST",
        path,
        &[
            ("content-type", "application/json"),
            ("authorization", &format!("Bearer {CLIENT_KEY}")),
        ],
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
    )
}

fn raw_exchange(addr: SocketAddr, bytes: &[u8], wait: Duration) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(wait)).unwrap();
    s.write_all(bytes).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

fn json_body(resp: &str) -> serde_json::Value {
    let (_, body) = resp.split_once("\r\n\r\n").expect("a complete response");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"))
}

/// Reads from `s` until EOF/error; how long that took.
fn time_to_close(s: &mut TcpStream, limit: Duration) -> Duration {
    let start = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut buf = [0u8; 4096];
    while start.elapsed() < limit {
        match s.read(&mut buf) {
            Ok(0) => return start.elapsed(),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return start.elapsed(),
        }
    }
    panic!("connection still open after {limit:?}");
}

#[test]
fn empty_and_half_written_reloads_leave_the_old_config_serving() {
    let (mock, gw) = on_mock("", true);
    assert_eq!(chat(&gw, "/v1/chat/completions").status, 200);
    let full = config(&mock.base_url(), "", true);
    let half = &full[..full.find("models:").unwrap()];
    for (what, text) in [("empty", ""), ("truncated", half)] {
        gw.rewrite_config(text);
        let r = gw.admin_post("/api/config/reload", "");
        assert_ne!(r.status, 200, "{what} reload accepted: {}", r.text());
        // Still served, admin token still valid, client auth still on.
        assert_eq!(chat(&gw, "/v1/chat/completions").status, 200, "{what}");
        let cfg = gw.admin_get("/api/config");
        assert_eq!(cfg.status, 200, "{what}: admin token lost");
        assert_eq!(cfg.json()["last_reload"]["ok"], false, "{what}");
        assert_eq!(anonymous_chat(&gw), 401, "{what}: client auth dropped");
    }
    let err = gw.admin_get("/api/config").json()["last_reload"]["error"].to_string();
    assert!(err.contains("models"), "{err}");
}

#[test]
fn the_watcher_never_applies_a_file_mid_write() {
    let (mock, gw) = on_mock("", true);
    let full = config(&mock.base_url(), "", true);
    // Written in pieces 200 ms apart (an editor or a slow copy); the watcher must
    // never pick up a prefix. Each prefix would fail, so a failed reload would show.
    let errors = || {
        gw.metric("sluice_config_reloads_total{result=\"error\"}")
            .unwrap_or(0.0)
    };
    let errors_before = errors();
    let path = gw.dir.0.join("sluice.yaml");
    let mut f = std::fs::File::create(&path).unwrap();
    for piece in full.as_bytes().chunks(full.len() / 4 + 1) {
        f.write_all(piece).unwrap();
        f.flush().unwrap();
        std::thread::sleep(Duration::from_millis(150));
    }
    drop(f);
    let full = full.replace("name: m\n", "name: m2\n");
    std::fs::write(&path, &full).unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || {
            gw.admin_get("/api/config").json()["last_reload"]["trigger"] == "file_change"
        }),
        "no file reload happened"
    );
    let last = gw.admin_get("/api/config").json()["last_reload"].clone();
    assert_eq!(last["ok"], true, "a partial file was read: {last}");
    assert_eq!(
        errors(),
        errors_before,
        "a prefix of the file was loaded and rejected"
    );
}

#[test]
fn a_reload_that_drops_clients_or_the_admin_token_is_refused() {
    let (mock, gw) = on_mock("", true);
    gw.rewrite_config(&config(&mock.base_url(), "", false));
    let r = gw.admin_post("/api/config/reload", "");
    assert_ne!(r.status, 200);
    assert!(r.text().contains("clients"), "{}", r.text());
    assert_eq!(anonymous_chat(&gw), 401, "the reload opened the listener");
    let no_admin =
        config(&mock.base_url(), "", true).replace("admin:\n  token_env: SLUICE_ADMIN_TOKEN\n", "");
    gw.rewrite_config(&no_admin);
    let r = gw.admin_post("/api/config/reload", "");
    assert_ne!(r.status, 200);
    assert!(r.text().contains("admin token"), "{}", r.text());
    assert_eq!(gw.admin_get("/api/config").status, 200);
}

#[test]
fn client_paths_reach_the_upstream_in_canonical_form() {
    let ok = r#"{"id":"x","object":"chat.completion","choices":[]}"#;
    let up = RawUpstream::start(vec![
        Step::Write(keep_alive_ok(ok)),
        Step::ReadNext,
        Step::Write(keep_alive_ok(ok)),
        Step::ReadNext,
        Step::Write(keep_alive_ok(ok)),
        Step::ReadNext,
        Step::Write(keep_alive_ok(ok)),
    ]);
    let gw = Gateway::start(&config(&up.base_url(), "", true), ENV);
    for path in [
        "/v1/chat/completions/",
        "//v1//chat/completions",
        "/v1/./chat/%63ompletions",
        "/v1/chat/completions/?trace=1",
    ] {
        assert_eq!(chat(&gw, path).status, 200, "{path}");
    }
    assert_eq!(
        up.request_lines(),
        vec![
            "POST /v1/chat/completions HTTP/1.1",
            "POST /v1/chat/completions HTTP/1.1",
            "POST /v1/chat/completions HTTP/1.1",
            "POST /v1/chat/completions?trace=1 HTTP/1.1",
        ]
    );
}

#[test]
fn count_tokens_is_proxied_and_its_4xx_is_final() {
    // A 429 would fail over on /v1/messages; on count_tokens it is the answer.
    let limited = r#"{"type":"error","error":{"type":"rate_limit_error","message":"slow"}}"#;
    let up = RawUpstream::start(vec![Step::Write(
        [
            head(
                429,
                &[
                    "Content-Type: application/json",
                    "Retry-After: 1",
                    &format!("Content-Length: {}", limited.len()),
                ],
            ),
            limited.as_bytes().to_vec(),
        ]
        .concat(),
    )]);
    let spare = RawUpstream::start(vec![Step::Write(keep_alive_ok(r#"{"input_tokens":3}"#))]);
    let spare_provider = format!(
        "  - id: ant2\n    base_url: \"{}\"\n    api: anthropic\n    connections: [ {{ id: c, api_key_env: UP_KEY }} ]\nmodels:\n",
        spare.base_url()
    );
    let yaml = config(&up.base_url(), "", true)
        .replace(
            "targets: [ { provider: ant, model: up } ]",
            "targets: [ { provider: ant, model: up }, { provider: ant2, model: up } ]",
        )
        .replace("models:\n", &spare_provider);
    let gw = Gateway::start(&yaml, ENV);
    let r = request(
        gw.client,
        "POST",
        "/v1/messages/count_tokens/",
        &[
            ("content-type", "application/json"),
            ("x-api-key", CLIENT_KEY),
        ],
        br#"{"model":"claude","messages":[{"role":"user","content":"hi"}]}"#,
    );
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(
        up.request_lines(),
        vec!["POST /v1/messages/count_tokens HTTP/1.1"]
    );
    assert_eq!(spare.calls(), 0, "a count_tokens 4xx was failed over");
    assert_eq!(r.header("x-sluice-attempts"), Some("1"));
    // ... and it left no trace on the connection /v1/messages uses
    let listing = gw.admin_get("/api/resilience/cooldowns").json();
    let ant = listing["connections"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["provider"] == "ant")
        .cloned()
        .unwrap();
    assert_eq!(
        ant["state"], "ok",
        "count_tokens cooled the connection: {ant}"
    );
    assert!(ant["last_status"].is_null(), "{ant}");
}

#[test]
fn two_pipelined_requests_are_both_answered_in_order() {
    let (_mock, gw) = on_mock("", false);
    let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    // A chat completion, then a model list, in one write: the list must come second.
    let both = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{}GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        body.len(),
        String::from_utf8_lossy(body)
    );
    let out = raw_exchange(gw.client, both.as_bytes(), Duration::from_secs(10));
    assert_eq!(out.matches("HTTP/1.1 200").count(), 2, "{out}");
    let chat = out.find("chat.completion").expect("the chat answer");
    let list = out.find("\"object\":\"list\"").expect("the model list");
    assert!(chat < list, "answered out of order: {out}");
}

#[test]
fn a_slow_header_is_cut_at_client_header_timeout() {
    let (_mock, gw) = on_mock("  client_header_timeout: \"2s\"\n", false);
    let mut s = TcpStream::connect(gw.client).unwrap();
    let start = Instant::now();
    let header =
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let mut cut = None;
    for b in header {
        if s.write_all(&[*b]).is_err() {
            cut = Some(start.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        let mut probe = [0u8; 1];
        s.set_nonblocking(true).unwrap();
        if let Ok(0) = s.read(&mut probe) {
            cut = Some(start.elapsed());
            break;
        }
        s.set_nonblocking(false).unwrap();
    }
    let cut =
        cut.unwrap_or_else(|| time_to_close(&mut s, Duration::from_secs(5)) + start.elapsed());
    assert!(
        cut >= Duration::from_millis(1800) && cut < Duration::from_secs(4),
        "closed after {cut:?}, expected about 2 s"
    );
}

#[test]
fn an_idle_keep_alive_connection_closes_at_keepalive_timeout() {
    let (_mock, gw) = on_mock("  keepalive_timeout: \"1s\"\n", false);
    let mut s = TcpStream::connect(gw.client).unwrap();
    let body = br#"{"model":"m","messages":[]}"#;
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    s.write_all(body).unwrap();
    let mut first = [0u8; 12];
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
    let idle = time_to_close(&mut s, Duration::from_secs(6));
    assert!(
        idle < Duration::from_secs(3),
        "idle connection held {idle:?}"
    );
}

#[test]
fn http_layer_errors_carry_the_family_json_body() {
    let (_mock, gw) = on_mock("", false);
    // wrong method on a route: 405 + Allow, family shape by route
    let r = raw_exchange(
        gw.client,
        b"GET /v1/messages HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    );
    assert!(r.starts_with("HTTP/1.1 405"), "{r}");
    assert!(r.to_ascii_lowercase().contains("allow: post"), "{r}");
    assert_eq!(json_body(&r)["type"], "error");
    assert_eq!(json_body(&r)["error"]["code"], "method_not_allowed");
    // an oversized header: 431
    let big = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(100 * 1024)
    );
    let r = raw_exchange(gw.client, big.as_bytes(), Duration::from_secs(5));
    assert!(r.starts_with("HTTP/1.1 431"), "{}", &r[..r.len().min(200)]);
    assert_eq!(json_body(&r)["error"]["code"], "request_header_too_large");
    // garbage: 400 from the HTTP layer, still JSON
    let r = raw_exchange(
        gw.client,
        b"\x01\x02 nonsense\r\n\r\n",
        Duration::from_secs(5),
    );
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    assert_eq!(json_body(&r)["error"]["code"], "invalid_request");
    // CONNECT (its framing is a tunnel's): 405 JSON, and the connection is not kept
    refused_and_closed(
        &gw,
        b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
        "405",
        "method_not_allowed",
    );
    // a broken chunked body: 400 JSON and the connection is not kept
    refused_and_closed(
        &gw,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nnope\r\n",
        "400",
        "invalid_request",
    );
}

/// Sends `request`; the answer is `status` with the JSON `code`, and the connection is
/// closed after it, not kept for another request.
fn refused_and_closed(gw: &Gateway, request: &[u8], status: &str, code: &str) {
    let started = Instant::now();
    let r = raw_exchange(gw.client, request, Duration::from_secs(8));
    assert!(r.starts_with(&format!("HTTP/1.1 {status}")), "{r}");
    assert_eq!(json_body(&r)["error"]["code"], code);
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "connection kept open after {status}"
    );
}

#[test]
fn an_http_1_0_client_gets_an_unchunked_stream() {
    let (_mock, gw) = on_mock("", false);
    let body = br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let req = format!(
        "POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{}",
        body.len(),
        String::from_utf8_lossy(body)
    );
    let r = raw_exchange(gw.client, req.as_bytes(), Duration::from_secs(10));
    let (head, rest) = r.split_once("\r\n\r\n").unwrap();
    assert!(head.contains(" 200 "), "{head}");
    assert!(
        !head.to_ascii_lowercase().contains("transfer-encoding"),
        "HTTP/1.0 client sent chunked: {head}"
    );
    assert!(rest.contains("data: [DONE]"), "{rest}");
}

#[test]
fn a_huge_upstream_header_is_not_forwarded() {
    let huge = format!("X-Junk: {}", "j".repeat(300 * 1024));
    let up = RawUpstream::start(vec![Step::Write(
        [head(200, &[&huge, "Content-Length: 2"]), b"{}".to_vec()].concat(),
    )]);
    let gw = Gateway::start(&config(&up.base_url(), "", true), ENV);
    let r = chat(&gw, "/v1/chat/completions");
    assert_eq!(r.status, 502, "{}", r.text());
    assert!(r.header("x-junk").is_none());
}

#[test]
fn an_upstream_echoing_its_key_never_shows_it() {
    let echo = format!(
        r#"{{"error":{{"message":"rate limited for key {UPSTREAM_KEY}","type":"rate_limit"}}}}"#
    );
    let up = RawUpstream::start(vec![Step::Write(
        [
            head(
                429,
                &[
                    "Content-Type: application/json",
                    "Retry-After: 3600",
                    &format!("X-Echo-Key: Bearer {UPSTREAM_KEY}"),
                    &format!("Content-Length: {}", echo.len()),
                ],
            ),
            echo.clone().into_bytes(),
        ]
        .concat(),
    )]);
    let yaml = config(&up.base_url(), "", true);
    let mut env = ENV.to_vec();
    // The most verbose setting, with a directive naming Pingora's own module.
    env.push(("SLUICE_LOG", "trace,pingora_core::protocols=trace"));
    let mut gw = Gateway::start_logged(&yaml, &env);
    let owner = "lease-owner-token-abcdef123";
    let r = request(
        gw.client,
        "POST",
        "/v1/chat/completions",
        &[
            ("content-type", "application/json"),
            ("authorization", &format!("Bearer {CLIENT_KEY}")),
        ],
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
    );
    assert_eq!(r.status, 429, "{}", r.text());
    let client_view = format!("{:?}{}", r.headers, r.text());
    assert!(
        !client_view.contains(UPSTREAM_KEY),
        "client saw the key: {client_view}"
    );
    assert!(client_view.contains("[redacted]"), "{client_view}");
    for path in [
        "/api/resilience/cooldowns",
        "/api/monitoring/health",
        "/api/config",
    ] {
        let a = gw.admin_get(path).text();
        assert!(!a.contains(UPSTREAM_KEY), "{path} shows the key: {a}");
    }
    // a malformed request at trace level must not print its headers either
    let _ = raw_exchange(
        gw.client,
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer {CLIENT_KEY}\r\nx-sluice-lease-owner: {owner}\r\nBad Header Name: x\r\n\r\n"
        )
        .as_bytes(),
        Duration::from_secs(5),
    );
    std::thread::sleep(Duration::from_millis(500));
    gw.proc.terminate();
    let _ = gw.proc.wait_exit(Duration::from_secs(10));
    let log = gw.log();
    assert!(log.contains("request"), "no log captured: {log}");
    for secret in [UPSTREAM_KEY, CLIENT_KEY, owner, ADMIN_TOKEN] {
        assert!(!log.contains(secret), "the log holds {secret}:\n{log}");
    }
}

#[test]
fn connections_beyond_the_cap_wait_until_one_closes() {
    let (_mock, gw) = on_mock("  max_client_connections: 2\n", false);
    let a = TcpStream::connect(gw.client).unwrap();
    let b = TcpStream::connect(gw.client).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let mut c = TcpStream::connect(gw.client).unwrap();
    c.write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    c.set_read_timeout(Some(Duration::from_millis(800)))
        .unwrap();
    let mut buf = [0u8; 12];
    assert!(c.read_exact(&mut buf).is_err(), "served beyond the cap");
    drop(a);
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    c.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"HTTP/1.1 200");
    drop(b);
}

#[test]
fn idle_kept_alive_connections_close_at_shutdown() {
    let (_mock, gw) = on_mock("", false);
    let mut s = TcpStream::connect(gw.client).unwrap();
    s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut first = [0u8; 12];
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
    gw.proc.terminate();
    let closed = time_to_close(&mut s, Duration::from_secs(8));
    assert!(
        closed < Duration::from_secs(3),
        "idle connection kept {closed:?} after SIGTERM"
    );
}

#[test]
fn connections_over_the_cap_queue_in_a_deep_backlog() {
    let (_mock, gw) = on_mock("  max_client_connections: 1\n", false);
    // One connection served, then 300 more: all must complete their handshake (the
    // kernel queues them) rather than have their SYNs dropped by a 128-deep backlog.
    let mut held = vec![TcpStream::connect(gw.client).unwrap()];
    std::thread::sleep(Duration::from_millis(200));
    for i in 0..300 {
        match TcpStream::connect_timeout(&gw.client, Duration::from_millis(700)) {
            Ok(s) => held.push(s),
            Err(e) => panic!("connection {i} over the cap was refused or dropped: {e}"),
        }
    }
    assert_eq!(held.len(), 301);
}
