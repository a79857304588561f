//! Drain and zero-downtime upgrade (SPEC §8.1): a stream in flight survives SIGTERM,
//! `/ready` turns 503 while draining, streams still open at `drain_timeout` end with
//! the `shutdown` error event, an idle gateway exits at once, and `run --upgrade` +
//! SIGQUIT hands the sockets over under a steady request loop without a failed request.

// Integration tests: a failed unwrap is a failed test, and they time the real binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod common;

use common::gw::{server_section, Gateway, ADMIN_TOKEN};
use common::{open_stream, parse_sse, try_request, wait_until, Mock, Proc};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn config(mock: &str, server_extra: &str) -> String {
    with_slow(mock, server_extra, "http://127.0.0.1:9")
}

/// Model `m` on `mock`; model `slow` on `slow`, a provider `q` with one connection.
fn with_slow(mock: &str, server_extra: &str, slow: &str) -> String {
    format!(
        "{}providers:
  - id: p
    base_url: \"{mock}\"
    api: openai
    connections:
      - {{ id: c, api_key_env: KEY }}
  - id: q
    base_url: \"{slow}\"
    api: openai
    connections:
      - {{ id: k, api_key_env: KEY }}
models:
  - name: m
    targets:
      - {{ provider: p, model: up }}
  - name: slow
    cooldown_wait: false
    targets:
      - {{ provider: q, model: up }}
",
        server_section(&format!(
            "  upgrade_sock: \"@DIR@/upgrade.sock\"\n{server_extra}"
        ))
    )
}

const ENV: &[(&str, &str)] = &[("KEY", "lifecycle-key")];
const STREAM: &[u8] = br#"{"model":"m","stream":true,"messages":[]}"#;
const CHAT: &[u8] = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;

/// The events of a stream that ended as the upstream framed it: `[DONE]` last, no error.
fn completed(body: &[u8]) -> Vec<common::SseEvent> {
    let events = parse_sse(body);
    let text = String::from_utf8_lossy(body);
    assert_eq!(
        events.last().map(|e| e.data.as_str()),
        Some("[DONE]"),
        "{text}"
    );
    assert!(
        !events.iter().any(|e| e.data.contains("\"error\"")),
        "{text}"
    );
    events
}

fn ready_status(admin: SocketAddr) -> Option<u16> {
    try_request(admin, "GET", "/ready", &[], b"")
        .ok()
        .map(|r| r.status)
}

#[test]
fn a_stream_in_flight_survives_sigterm_and_completes() {
    // 20 chunks 500 ms apart: a 10 s stream.
    let mock = Mock::start(&["--chunks", "20", "--chunk-interval", "500ms"]);
    let mut gw = Gateway::start(&config(&mock.base_url(), ""), ENV);
    let mut s = open_stream(gw.client, "POST", "/v1/chat/completions", &[], STREAM);
    assert_eq!(s.status, 200);
    let mut body = s.next_chunk(Duration::from_secs(5)).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    gw.proc.terminate();
    assert!(
        wait_until(Duration::from_secs(3), || ready_status(gw.admin)
            == Some(503)),
        "/ready did not turn 503 while draining"
    );
    let r = try_request(gw.admin, "GET", "/ready", &[], b"").unwrap();
    assert_eq!(r.json()["draining"], true, "{}", r.text());
    // The client listener takes no new requests.
    let late = try_request(gw.client, "POST", "/v1/chat/completions", &[], CHAT);
    assert!(
        late.is_err(),
        "a new request was served while draining: {late:?}"
    );
    body.extend(s.read_to_end(Duration::from_secs(5)));
    let events = completed(&body);
    let chunks = events.iter().filter(|e| e.data != "[DONE]").count();
    assert!(chunks >= 20, "{chunks} chunks: not every one arrived");
    let status = gw
        .proc
        .wait_exit(Duration::from_secs(5))
        .expect("exits once drained");
    assert!(status.success(), "{status:?}");
}

#[test]
fn streams_open_at_the_drain_timeout_end_with_the_shutdown_event() {
    let mock = Mock::start(&["--chunks", "40", "--chunk-interval", "500ms"]);
    let mut gw = Gateway::start(&config(&mock.base_url(), "  drain_timeout: \"1s\"\n"), ENV);
    let mut s = open_stream(gw.client, "POST", "/v1/chat/completions", &[], STREAM);
    assert_eq!(s.status, 200);
    let mut body = s.next_chunk(Duration::from_secs(5)).unwrap();
    let stopped = Instant::now();
    gw.proc.terminate();
    body.extend(s.read_to_end(Duration::from_secs(10)));
    let took = stopped.elapsed();
    assert!(
        took < Duration::from_secs(6),
        "the stream ran {took:?} past SIGTERM"
    );
    let events = parse_sse(&body);
    let last = events.last().expect("events");
    let err: serde_json::Value = serde_json::from_str(&last.data).expect("error event JSON");
    assert_eq!(err["error"]["code"], "shutdown", "{}", last.data);
    assert!(
        events.len() < 30,
        "{} events: the stream was not cut at the drain timeout",
        events.len()
    );
    let status = gw
        .proc
        .wait_exit(Duration::from_secs(8))
        .expect("exits after the drain timeout");
    assert!(status.success(), "{status:?}");
}

#[test]
fn an_idle_gateway_exits_at_once_on_sigterm() {
    let mock = Mock::start(&[]);
    let mut gw = Gateway::start(&config(&mock.base_url(), ""), ENV);
    assert_eq!(gw.chat(std::str::from_utf8(CHAT).unwrap()).status, 200);
    let took = terminate_and_wait(&mut gw);
    assert!(took < Duration::from_secs(3), "took {took:?}");
}

/// SIGTERM, then the gateway's clean exit (within 10 s): how long it took.
fn terminate_and_wait(gw: &mut Gateway) -> Duration {
    let stopped = Instant::now();
    gw.proc.terminate();
    let status = gw
        .proc
        .wait_exit(Duration::from_secs(10))
        .expect("the gateway exits");
    assert!(status.success(), "{status:?}");
    stopped.elapsed()
}

#[test]
fn a_connection_that_sent_nothing_does_not_hold_up_the_drain() {
    use std::io::Read;
    let mock = Mock::start(&[]);
    let mut gw = Gateway::start(&config(&mock.base_url(), ""), ENV);
    // Accepted, no byte sent: it would wait out `client_header_timeout` (30 s).
    let mut silent = std::net::TcpStream::connect(gw.client).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let took = terminate_and_wait(&mut gw);
    assert!(
        took < Duration::from_secs(3),
        "the silent connection held the drain for {took:?}"
    );
    let mut rest = Vec::new();
    assert!(
        silent.read_to_end(&mut rest).is_ok() && rest.is_empty(),
        "the silent connection was closed without an answer: {rest:?}"
    );
}

#[test]
fn upgrade_hands_over_under_load_without_a_failed_request() {
    let mock = Mock::start(&["--chunks", "10", "--chunk-interval", "300ms"]);
    // Answers 429 (retry in 120 s) after 6 s: a cooldown the old process records
    // during its drain, after it handed the store over.
    let slow = Mock::start_named(
        "slow",
        &["--fault", "status=429;retry_after=120;latency=6s"],
    );
    let mut old = Gateway::start(&with_slow(&mock.base_url(), "", &slow.base_url()), ENV);
    let client = old.client;

    // A steady loop of requests, each on a new connection, for the whole handover.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let looper = {
        let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
        std::thread::spawn(move || {
            let mut errors = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                match try_request(
                    client,
                    "POST",
                    "/v1/chat/completions",
                    &[("content-type", "application/json")],
                    CHAT,
                ) {
                    Ok(r) if r.status == 200 => {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    other => {
                        failed.fetch_add(1, Ordering::Relaxed);
                        errors.push(format!("{other:?}"));
                    }
                }
            }
            errors
        })
    };
    // A stream (3 s) open across the handover.
    let mut s = open_stream(client, "POST", "/v1/chat/completions", &[], STREAM);
    assert_eq!(s.status, 200);
    let mut body = s.next_chunk(Duration::from_secs(5)).unwrap();
    assert!(wait_until(Duration::from_secs(5), || ok
        .load(Ordering::Relaxed)
        >= 20));

    let limited = std::thread::spawn(move || {
        try_request(
            client,
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            br#"{"model":"slow","messages":[]}"#,
        )
    });
    assert!(wait_until(Duration::from_secs(5), || slow
        .route_count("/v1/chat/completions")
        == 1));

    // The new process waits for the sockets; the old one is told to hand them over.
    let old_pid = old.proc.pid();
    let quit = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        let _ = std::process::Command::new("kill")
            .args(["-QUIT", &old_pid.to_string()])
            .status();
    });
    let path = old.dir.0.join("sluice.yaml");
    let mut env: Vec<(&str, &str)> = vec![
        ("SLUICE_ADMIN_TOKEN", ADMIN_TOKEN),
        ("SLUICE_LOG", "info,sluice::access=warn"),
    ];
    env.extend_from_slice(ENV);
    let new_log = old.dir.0.join("new.log");
    let new = Proc::spawn_with_stderr(
        env!("CARGO_BIN_EXE_sluice"),
        &["run", "--upgrade", "--config", path.to_str().unwrap()],
        &env,
        &["client", "admin"],
        std::fs::File::create(&new_log).unwrap().into(),
    );
    quit.join().unwrap();
    assert_eq!(
        new.addr("client"),
        client,
        "the new process serves the same socket"
    );

    // The stream started on the old process completes there.
    body.extend(s.read_to_end(Duration::from_secs(10)));
    completed(&body);
    let status = old
        .proc
        .wait_exit(Duration::from_secs(20))
        .expect("the old process exits once drained");
    assert!(status.success(), "{status:?}");
    assert_eq!(limited.join().unwrap().map(|r| r.status).ok(), Some(429));
    // The old process's cooldown reached the new one through the handover.
    let admin = new.addr("admin");
    let cooling = || {
        let r = common::gw::admin_request(admin, "GET", "/api/resilience/cooldowns?provider=q", "");
        r.json()["connections"][0]["state"] == "cooling"
    };
    assert!(
        wait_until(Duration::from_secs(3), cooling),
        "the drain's cooldown was lost"
    );
    // …and it came through the handover, not through the store before the swap.
    let applied = || {
        std::fs::read_to_string(&new_log)
            .unwrap_or_default()
            .contains("applied a batch from the previous process")
    };
    assert!(
        wait_until(Duration::from_secs(5), applied),
        "{}",
        std::fs::read_to_string(&new_log).unwrap_or_default()
    );

    // Requests keep succeeding, now on the new process alone.
    let before = ok.load(Ordering::Relaxed);
    assert!(wait_until(Duration::from_secs(5), || ok
        .load(Ordering::Relaxed)
        >= before + 20));
    stop.store(true, Ordering::Relaxed);
    let errors = looper.join().unwrap();
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "failed requests: {errors:?}"
    );
    assert_eq!(ready_status(new.addr("admin")), Some(200));
    assert!(mock.route_count("/v1/chat/completions") as u32 >= ok.load(Ordering::Relaxed));
}

#[test]
fn sigquit_without_a_successor_keeps_serving() {
    let mock = Mock::start(&[]);
    let mut gw = Gateway::start_logged(
        &config(&mock.base_url(), ""),
        &[("KEY", "k"), ("SLUICE_LOG", "info")],
    );
    gw.proc.signal("QUIT");
    // The old process retries the handover for 10 s, serving all along, then gives up.
    assert!(
        wait_until(Duration::from_secs(15), || gw
            .log()
            .contains("upgrade failed: still serving")),
        "{}",
        gw.log()
    );
    assert_eq!(gw.chat(std::str::from_utf8(CHAT).unwrap()).status, 200);
    assert_eq!(ready_status(gw.admin), Some(200));
    assert!(gw.proc.wait_exit(Duration::from_millis(100)).is_none());
    // And it still drains on SIGTERM.
    gw.proc.terminate();
    assert!(gw
        .proc
        .wait_exit(Duration::from_secs(5))
        .is_some_and(|s| s.success()));
}

#[test]
fn a_successor_that_fails_to_start_leaves_the_old_process_serving() {
    let mock = Mock::start(&[]);
    let mut old = Gateway::start_logged(
        &config(&mock.base_url(), ""),
        &[("KEY", "k"), ("SLUICE_LOG", "info")],
    );
    // The successor's config points at a state file that is not a store: it claims the
    // sockets, then cannot open its store and exits.
    let broken = old.dir.0.join("broken.redb");
    std::fs::write(&broken, b"not a redb file").unwrap();
    let text = std::fs::read_to_string(old.dir.0.join("sluice.yaml"))
        .unwrap()
        .replace("state.redb", "broken.redb");
    let path = old.dir.0.join("successor.yaml");
    std::fs::write(&path, text).unwrap();
    let mut successor = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["run", "--upgrade", "--config", path.to_str().unwrap()])
        .env("SLUICE_ADMIN_TOKEN", ADMIN_TOKEN)
        .env("KEY", "k")
        .env("SLUICE_LOG", "error")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    old.proc.signal("QUIT");
    let exited = successor.wait().unwrap();
    assert_eq!(
        exited.code(),
        Some(1),
        "the successor should fail on its store"
    );
    assert!(
        wait_until(Duration::from_secs(15), || old
            .log()
            .contains("the new process did not start")),
        "{}",
        old.log()
    );
    assert!(
        wait_until(Duration::from_secs(12), || old
            .log()
            .contains("state store taken back")),
        "{}",
        old.log()
    );
    // Still serving, store taken back, not draining.
    assert_eq!(old.chat(std::str::from_utf8(CHAT).unwrap()).status, 200);
    let ready = try_request(old.admin, "GET", "/ready", &[], b"").unwrap();
    assert_eq!(ready.status, 200, "{}", ready.text());
    assert_eq!(ready.json()["store"]["state"], "open");
    assert!(old.proc.wait_exit(Duration::from_millis(100)).is_none());
}
