//! Streaming: SSE chunks pass through unbuffered, a stall after commit ends the stream
//! with an error event, and a client that disconnects ends the upstream stream.

// Integration tests: a failed unwrap is a failed test, and they time the real binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod common;

use common::gw::{server_section, Gateway};
use common::{open_stream, parse_sse, wait_until, Mock};
use std::time::{Duration, Instant};

fn config(mock: &str, resilience: &str) -> String {
    format!(
        "{}providers:
  - id: p
    base_url: \"{mock}\"
    api: openai
    connections:
      - {{ id: c, api_key_env: KEY }}
  - id: q
    base_url: \"{mock}\"
    api: anthropic
    connections:
      - {{ id: c, api_key_env: KEY }}
models:
  - name: m
    targets:
      - {{ provider: p, model: up }}
  - name: claude
    targets:
      - {{ provider: q, model: up-claude }}
{resilience}",
        server_section("")
    )
}

const KEY: &[(&str, &str)] = &[("KEY", "stream-key")];

#[test]
fn first_chunk_arrives_long_before_the_last() {
    let mock = Mock::start(&["--chunks", "5", "--chunk-interval", "250ms"]);
    let gw = Gateway::start(&config(&mock.base_url(), ""), KEY);
    let started = Instant::now();
    let mut s = open_stream(
        gw.client,
        "POST",
        "/v1/chat/completions",
        &[],
        br#"{"model":"m","stream":true,"messages":[]}"#,
    );
    assert_eq!(s.status, 200);
    assert_eq!(s.header("content-type"), Some("text/event-stream"));
    assert_eq!(s.header("x-sluice-provider"), Some("p"));
    let mut times = Vec::new();
    let mut body = Vec::new();
    while let Some(chunk) = s.next_chunk(Duration::from_secs(10)) {
        times.push(started.elapsed());
        body.extend_from_slice(&chunk);
    }
    let first = times[0];
    let last = *times.last().unwrap();
    // 5 content chunks 250 ms apart: ≥ 1 s between the first and the last byte.
    assert!(
        last - first >= Duration::from_millis(900),
        "first {first:?}, last {last:?}: buffered?"
    );
    assert!(
        times.len() >= 5,
        "only {} reads: chunks were merged",
        times.len()
    );
    let events = parse_sse(&body);
    assert_eq!(events.last().map(|e| e.data.as_str()), Some("[DONE]"));
}

#[test]
fn stall_after_commit_ends_stream_with_error_event() {
    let mock = Mock::start(&[
        "--chunks",
        "10",
        "--chunk-interval",
        "20ms",
        "--fault",
        "stall_after=2",
    ]);
    let gw = Gateway::start(
        &config(
            &mock.base_url(),
            "resilience:\n  stream: { stall_timeout: \"400ms\" }\n",
        ),
        KEY,
    );
    let mut s = open_stream(
        gw.client,
        "POST",
        "/v1/chat/completions",
        &[],
        br#"{"model":"m","stream":true}"#,
    );
    assert_eq!(s.status, 200);
    let body = s.read_to_end(Duration::from_secs(10));
    assert_eq!(
        s.end,
        Some(common::StreamEnd::Complete),
        "stream should end cleanly"
    );
    let events = parse_sse(&body);
    let last = events.last().expect("events");
    assert_eq!(
        last.json()["error"]["code"],
        "stall",
        "last event: {:?}",
        last.data
    );
    let content = events
        .iter()
        .filter(|e| e.data.contains("chat.completion.chunk"))
        .count();
    assert_eq!(content, 2);
}

#[test]
fn anthropic_stall_error_event_has_anthropic_shape() {
    let mock = Mock::start(&[
        "--chunks",
        "10",
        "--chunk-interval",
        "20ms",
        "--fault",
        "stall_after=1",
    ]);
    let gw = Gateway::start(
        &config(
            &mock.base_url(),
            "resilience:\n  stream: { stall_timeout: \"400ms\" }\n",
        ),
        KEY,
    );
    let mut s = open_stream(
        gw.client,
        "POST",
        "/v1/messages",
        &[],
        br#"{"model":"claude","stream":true,"max_tokens":5}"#,
    );
    assert_eq!(s.status, 200);
    let body = s.read_to_end(Duration::from_secs(10));
    let events = parse_sse(&body);
    let last = events.last().expect("events");
    assert_eq!(last.event.as_deref(), Some("error"));
    assert_eq!(last.json()["type"], "error");
    assert_eq!(last.json()["error"]["code"], "stall");
}

/// Opens a stream through a gateway on a mock started with `mock_args`, reads `chunks`
/// chunks, then closes the connection; the mock and the gateway stay up for the checks.
fn leave_after(mock_args: &[&str], chunks: usize) -> (Mock, Gateway) {
    let mock = Mock::start(mock_args);
    let gw = Gateway::start(&config(&mock.base_url(), ""), KEY);
    let mut s = open_stream(
        gw.client,
        "POST",
        "/v1/chat/completions",
        &[],
        br#"{"model":"m","stream":true}"#,
    );
    assert_eq!(s.status, 200);
    for _ in 0..chunks {
        assert!(s.next_chunk(Duration::from_secs(5)).is_some());
    }
    (mock, gw)
}

#[test]
fn client_disconnect_stops_the_upstream_stream() {
    let (mock, _gw) = leave_after(&["--chunks", "200", "--chunk-interval", "50ms"], 2);
    // 200 chunks at 50 ms would take 10 s; the upstream must see the cut well before.
    let aborted = || mock.stats()["streams_aborted"] == 1;
    assert!(
        wait_until(Duration::from_secs(3), aborted),
        "upstream stream not aborted: {}",
        mock.stats()
    );
    let sent = mock.stats()["chunks_sent"].as_u64().unwrap();
    assert!(sent < 60, "upstream kept streaming: {sent} chunks");
    assert_eq!(mock.stats()["streams_completed"], 0);
}

#[test]
fn a_client_that_leaves_between_chunks_is_noticed_before_the_next_chunk() {
    // The next chunk is 3 s away: a gateway that only learnt of the close by writing to
    // the client would keep the upstream stream for those 3 s. The client watch sees
    // the close while the stream waits for the upstream.
    let (mock, _gw) = leave_after(&["--chunks", "10", "--chunk-interval", "3s"], 1);
    let aborted = || mock.stats()["streams_aborted"] == 1;
    assert!(
        wait_until(Duration::from_millis(1500), aborted),
        "upstream stream not aborted before the next chunk: {}",
        mock.stats()
    );
    assert_eq!(mock.stats()["chunks_sent"], 1, "{}", mock.stats());
}

#[test]
fn throughput_watchdog_ends_a_trickling_stream() {
    // ~10 text bytes every 400 ms is far below 200 B/s: aborted after warmup + window.
    let mock = Mock::start(&["--chunks", "40", "--chunk-interval", "400ms"]);
    let gw = Gateway::start(
        &config(
            &mock.base_url(),
            "resilience:\n  watchdog: { enabled: true, warmup: \"1s\", window: \"1s\", min_bytes_per_sec: 200 }\n",
        ),
        KEY,
    );
    let started = Instant::now();
    let mut s = open_stream(
        gw.client,
        "POST",
        "/v1/chat/completions",
        &[],
        br#"{"model":"m","stream":true}"#,
    );
    assert_eq!(s.status, 200);
    let body = s.read_to_end(Duration::from_secs(20));
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(6),
        "took {took:?}"
    );
    let events = parse_sse(&body);
    let last = events.last().expect("events");
    assert_eq!(
        last.json()["error"]["code"],
        "throughput",
        "{:?}",
        last.data
    );
    assert!(wait_until(Duration::from_secs(3), || mock.stats()
        ["streams_aborted"]
        == 1));
    let m = common::request(gw.admin, "GET", "/metrics", &[], b"").text();
    assert!(
        m.contains("sluice_stream_aborts_total{reason=\"throughput\"} 1"),
        "{m}"
    );
}

#[test]
fn throughput_watchdog_leaves_a_fast_stream_alone() {
    let mock = Mock::start(&["--chunks", "60", "--chunk-interval", "50ms"]);
    let gw = Gateway::start(
        &config(
            &mock.base_url(),
            "resilience:\n  watchdog: { enabled: true, warmup: \"1s\", window: \"1s\", min_bytes_per_sec: 50 }\n",
        ),
        KEY,
    );
    let mut s = open_stream(
        gw.client,
        "POST",
        "/v1/chat/completions",
        &[],
        br#"{"model":"m","stream":true}"#,
    );
    let body = s.read_to_end(Duration::from_secs(20));
    let events = parse_sse(&body);
    assert_eq!(events.last().map(|e| e.data.as_str()), Some("[DONE]"));
    assert_eq!(mock.stats()["streams_completed"], 1);
}
