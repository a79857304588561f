//! Integration tests of `sluice-mock` itself: the upstream every other integration test
//! and benchmark relies on must answer in the right shapes, stream in real time, apply
//! faults exactly as specified and count what it saw truthfully.

// Integration tests: a failed unwrap is a failed test, and they time the real binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{
    open_stream, parse_sse, post_json, request, sha256_hex, try_request, wait_until, Mock,
    StreamEnd,
};
use serde_json::json;

const CHAT: &str = "/v1/chat/completions";

fn chat_body(stream: bool) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": "gpt-test",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
    }))
    .unwrap()
}

#[test]
fn non_streaming_chat_has_openai_shape_and_mock_name() {
    let mock = Mock::start_named("alpha", &[]);
    let r = post_json(
        mock.addr,
        CHAT,
        &[],
        &json!({"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-mock-name"), Some("alpha"));
    assert_eq!(r.header("content-type"), Some("application/json"));
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "gpt-test");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(content.starts_with("Hello from alpha."), "{content}");
    assert!(v["usage"]["total_tokens"].as_u64().unwrap() > 0);

    // Deterministic: the same request gets the same content.
    let again = post_json(
        mock.addr,
        CHAT,
        &[],
        &json!({"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(again.json()["choices"][0]["message"]["content"], content);
}

#[test]
fn every_api_route_answers_in_its_own_shape() {
    let mock = Mock::start(&[]);
    let cases = [
        (
            "/v1/completions",
            json!({"model": "m1", "prompt": "x"}),
            "text_completion",
        ),
        (
            "/v1/embeddings",
            json!({"model": "m1", "input": ["a", "b"]}),
            "list",
        ),
        (
            "/v1/responses",
            json!({"model": "m1", "input": "x"}),
            "response",
        ),
    ];
    for (path, body, object) in cases {
        let r = post_json(mock.addr, path, &[], &body);
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        let v = r.json();
        assert_eq!(v["object"], object, "{path}");
        assert_eq!(v["model"], "m1", "{path}");
    }
    let emb = post_json(
        mock.addr,
        "/v1/embeddings",
        &[],
        &json!({"model": "m", "input": ["a", "b"]}),
    );
    assert_eq!(emb.json()["data"].as_array().unwrap().len(), 2);

    let msg = post_json(
        mock.addr,
        "/v1/messages",
        &[("x-api-key", "k")],
        &json!({"model": "claude-x", "max_tokens": 5, "messages": []}),
    )
    .json();
    assert_eq!(msg["type"], "message");
    assert_eq!(msg["model"], "claude-x");
    assert_eq!(msg["content"][0]["type"], "text");
    assert!(msg["usage"]["output_tokens"].as_u64().is_some());

    let models = request(mock.addr, "GET", "/v1/models", &[], b"");
    assert_eq!(models.status, 200);
    assert_eq!(models.json()["object"], "list");

    let bad = request(mock.addr, "POST", CHAT, &[], b"not json");
    assert_eq!(bad.status, 400);
    assert!(bad.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("JSON"));

    let missing = request(mock.addr, "GET", "/nope", &[], b"");
    assert_eq!(missing.status, 404);
    assert!(missing.json()["error"].is_object());
}

#[test]
fn sse_stream_arrives_chunk_by_chunk_over_time() {
    let mock = Mock::start(&["--chunks", "5", "--chunk-interval", "100ms"]);
    let mut s = open_stream(mock.addr, "POST", CHAT, &[], &chat_body(true));
    assert_eq!(s.status, 200);
    assert_eq!(s.header("content-type"), Some("text/event-stream"));
    let mut arrivals = Vec::new();
    let mut body = Vec::new();
    while let Some(c) = s.next_chunk(Duration::from_secs(10)) {
        arrivals.push(Instant::now());
        body.extend_from_slice(&c);
    }
    assert_eq!(s.end, Some(StreamEnd::Complete));
    let events = parse_sse(&body);
    let content: Vec<String> = events
        .iter()
        .filter(|e| e.data != "[DONE]")
        .filter_map(|e| {
            e.json()["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(content.len(), 5, "{events:?}");
    assert_eq!(events.last().unwrap().data, "[DONE]");
    assert_eq!(events[0].json()["object"], "chat.completion.chunk");
    assert!(
        arrivals.len() >= 5,
        "events were not sent as separate chunks"
    );
    // Four 100 ms pauses separate the five content chunks.
    let spread = *arrivals.last().unwrap() - arrivals[0];
    assert!(spread >= Duration::from_millis(300), "spread {spread:?}");
    assert!(wait_until(Duration::from_secs(5), || mock.stats()
        ["streams_completed"]
        == 1));
    assert_eq!(mock.stats()["chunks_sent"], 5);
}

#[test]
fn anthropic_stream_events_come_in_protocol_order() {
    let mock = Mock::start(&[]);
    let body =
        serde_json::to_vec(&json!({"model": "claude-x", "stream": true, "messages": []})).unwrap();
    let mut s = open_stream(
        mock.addr,
        "POST",
        "/v1/messages",
        &[("x-mock-fault", "chunks=3;chunk_interval=1ms")],
        &body,
    );
    assert_eq!(s.status, 200);
    let events = parse_sse(&s.read_to_end(Duration::from_secs(10)));
    let names: Vec<&str> = events
        .iter()
        .map(|e| e.event.as_deref().unwrap_or(""))
        .collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    for e in &events {
        assert_eq!(e.json()["type"], e.event.as_deref().unwrap());
    }
    assert_eq!(events[0].json()["message"]["model"], "claude-x");
    assert_eq!(events[2].json()["delta"]["type"], "text_delta");
}

#[test]
fn responses_stream_starts_created_and_ends_completed() {
    let mock = Mock::start(&[]);
    let body = serde_json::to_vec(&json!({"model": "m", "stream": true, "input": "x"})).unwrap();
    let mut s = open_stream(
        mock.addr,
        "POST",
        "/v1/responses",
        &[("x-mock-fault", "chunks=2;chunk_interval=1ms")],
        &body,
    );
    let events = parse_sse(&s.read_to_end(Duration::from_secs(10)));
    let names: Vec<&str> = events
        .iter()
        .map(|e| e.event.as_deref().unwrap_or(""))
        .collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.completed",
        ]
    );
    assert_eq!(events[3].json()["response"]["status"], "completed");
}

#[test]
fn header_fault_gives_status_and_retry_after() {
    let mock = Mock::start(&[]);
    let r = request(
        mock.addr,
        "POST",
        CHAT,
        &[(
            "x-mock-fault",
            "status=429;retry_after=2;header=x-extra:yes",
        )],
        &chat_body(false),
    );
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("2"));
    assert_eq!(r.header("x-extra"), Some("yes"));
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");

    let a = request(
        mock.addr,
        "POST",
        "/v1/messages",
        &[("x-mock-fault", "status=529")],
        b"{}",
    );
    assert_eq!(a.status, 529);
    assert_eq!(a.json()["type"], "error");
    assert_eq!(a.json()["error"]["type"], "overloaded_error");

    let verbatim = request(
        mock.addr,
        "POST",
        CHAT,
        &[("x-mock-fault", "status=200;body=oops")],
        &chat_body(false),
    );
    assert_eq!(verbatim.status, 200);
    assert_eq!(verbatim.text(), "oops");
    assert!(verbatim
        .header("content-type")
        .unwrap()
        .starts_with("text/plain"));

    let bad = request(
        mock.addr,
        "POST",
        CHAT,
        &[("x-mock-fault", "status=abc")],
        &chat_body(false),
    );
    assert_eq!(bad.status, 400);
    assert!(bad.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("status"));
}

#[test]
fn reset_after_zero_is_a_connection_error() {
    let mock = Mock::start(&[]);
    let r = try_request(
        mock.addr,
        "POST",
        CHAT,
        &[("x-mock-fault", "reset_after=0")],
        &chat_body(false),
    );
    assert!(
        r.is_err(),
        "expected a connection error, got {:?}",
        r.map(|r| r.status)
    );
    // A streamed answer cut after two chunks ends without its terminator.
    let mut s = open_stream(
        mock.addr,
        "POST",
        CHAT,
        &[("x-mock-fault", "reset_after=2;chunk_interval=1ms")],
        &chat_body(true),
    );
    let body = s.read_to_end(Duration::from_secs(10));
    assert!(matches!(s.end, Some(StreamEnd::Broken(_))), "{:?}", s.end);
    assert_eq!(parse_sse(&body).len(), 2);
}

#[test]
fn process_fault_with_times_applies_exactly_that_often() {
    let mock = Mock::start(&[]);
    mock.set_fault("status=503;times=2");
    assert!(mock.stats()["fault"].is_string());
    let statuses: Vec<u16> = (0..3)
        .map(|_| request(mock.addr, "POST", CHAT, &[], &chat_body(false)).status)
        .collect();
    assert_eq!(statuses, [503, 503, 200]);
    assert!(mock.stats()["fault"].is_null());

    // Without times it stays until cleared; the header overrides it.
    mock.set_fault("status=500");
    assert_eq!(
        request(mock.addr, "POST", CHAT, &[], &chat_body(false)).status,
        500
    );
    assert_eq!(
        request(mock.addr, "POST", CHAT, &[], &chat_body(false)).status,
        500
    );
    let overridden = request(
        mock.addr,
        "POST",
        CHAT,
        &[("x-mock-fault", "latency=1ms")],
        &chat_body(false),
    );
    assert_eq!(overridden.status, 200);
    mock.set_fault("");
    assert_eq!(
        request(mock.addr, "POST", CHAT, &[], &chat_body(false)).status,
        200
    );

    let rejected = request(mock.addr, "POST", "/__fault", &[], b"bogus=1");
    assert_eq!(rejected.status, 400);
    assert!(rejected.text().contains("unknown key"));
}

#[test]
fn stats_count_routes_credentials_and_last_body() {
    let mock = Mock::start(&[]);
    request(
        mock.addr,
        "GET",
        "/v1/models",
        &[("authorization", "Bearer key-a")],
        b"",
    );
    post_json(
        mock.addr,
        "/v1/messages",
        &[("x-api-key", "key-b")],
        &json!({"model": "c"}),
    );
    let pad = "x".repeat(1024 * 1024);
    let big = serde_json::to_vec(
        &json!({"model": "gpt", "messages": [{"role": "user", "content": pad}]}),
    )
    .unwrap();
    assert!(big.len() > 1024 * 1024);
    let r = request(
        mock.addr,
        "POST",
        CHAT,
        &[("authorization", "Bearer key-a"), ("x-test", "seen")],
        &big,
    );
    assert_eq!(r.status, 200);

    let s = mock.stats();
    assert_eq!(s["name"], "mock");
    assert_eq!(s["total"], 3, "control routes must not count: {s}");
    assert_eq!(s["routes"][CHAT], 1);
    assert_eq!(s["routes"]["/v1/messages"], 1);
    assert_eq!(s["routes"]["/v1/models"], 1);
    assert_eq!(s["routes"]["/v1/embeddings"], 0);
    assert_eq!(s["by_credential"]["key-a"], 2);
    assert_eq!(s["by_credential"]["key-b"], 1);
    assert_eq!(s["last_body_len"], big.len());
    assert_eq!(s["last_body_sha256"], sha256_hex(&big));
    assert_eq!(s["last_headers"]["x-test"], "seen");
    assert_eq!(s["inflight"], 0);
    assert!(s["max_inflight"].as_u64().unwrap() >= 1);

    mock.reset();
    let s = mock.stats();
    assert_eq!(s["total"], 0);
    assert_eq!(s["routes"][CHAT], 0);
    assert!(s["by_credential"].as_object().unwrap().is_empty());
}

#[test]
fn large_body_with_expect_continue_is_read_whole() {
    let mock = Mock::start(&[]);
    let pad = "y".repeat(5 * 1024 * 1024);
    let big = serde_json::to_vec(
        &json!({"model": "gpt", "messages": [{"role": "user", "content": pad}]}),
    )
    .unwrap();
    let r = request(mock.addr, "POST", CHAT, &[("expect", "100-continue")], &big);
    assert_eq!(r.status, 200, "{}", r.text());
    let s = mock.stats();
    assert_eq!(s["last_body_len"], big.len());
    assert_eq!(s["last_body_sha256"], sha256_hex(&big));
}

#[test]
fn keep_alive_connection_serves_several_requests() {
    let mock = Mock::start(&[]);
    let mut conn = TcpStream::connect(mock.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let body = chat_body(false);
    for _ in 0..3 {
        write!(
            conn,
            "POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .unwrap();
        conn.write_all(&body).unwrap();
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        assert!(line.starts_with("HTTP/1.1 200"), "{line}");
        let mut len = 0usize;
        loop {
            let mut h = String::new();
            reader.read_line(&mut h).unwrap();
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse().unwrap();
                }
            }
        }
        let mut buf = vec![0u8; len];
        reader.read_exact(&mut buf).unwrap();
        assert!(serde_json::from_slice::<serde_json::Value>(&buf).is_ok());
    }
    assert_eq!(mock.stats()["routes"][CHAT], 3);
}

#[test]
fn client_dropping_a_slow_stream_counts_as_aborted() {
    let mock = Mock::start(&[]);
    let mut s = open_stream(
        mock.addr,
        "POST",
        CHAT,
        &[("x-mock-fault", "chunks=50;chunk_interval=100ms")],
        &chat_body(true),
    );
    assert!(s.next_chunk(Duration::from_secs(10)).is_some());
    assert!(wait_until(Duration::from_secs(5), || mock.stats()
        ["inflight"]
        == 1));
    drop(s);
    assert!(
        wait_until(Duration::from_secs(10), || {
            let st = mock.stats();
            st["streams_aborted"] == 1 && st["inflight"] == 0
        }),
        "stats: {}",
        mock.stats()
    );
    assert_eq!(mock.stats()["streams_completed"], 0);
}

#[test]
fn stalled_stream_holds_the_connection_silently() {
    let mock = Mock::start(&[]);
    let mut s = open_stream(
        mock.addr,
        "POST",
        CHAT,
        &[("x-mock-fault", "stall_after=2;chunks=5;chunk_interval=1ms")],
        &chat_body(true),
    );
    let mut got = Vec::new();
    while let Some(c) = s.next_chunk(Duration::from_millis(500)) {
        got.extend_from_slice(&c);
    }
    assert_eq!(s.end, Some(StreamEnd::Timeout));
    assert_eq!(parse_sse(&got).len(), 2);
    assert_eq!(mock.stats()["inflight"], 1);
    drop(s);
    assert!(wait_until(Duration::from_secs(10), || mock.stats()
        ["streams_aborted"]
        == 1));
}

#[test]
fn latency_fault_delays_the_answer() {
    let mock = Mock::start(&[]);
    let t = Instant::now();
    let r = request(
        mock.addr,
        "POST",
        CHAT,
        &[("x-mock-fault", "latency=150ms;first_byte_delay=100ms")],
        &chat_body(false),
    );
    assert_eq!(r.status, 200);
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t.elapsed()
    );
}

#[test]
fn malformed_fault_flag_exits_with_code_2() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice-mock"))
        .args(["--listen", "127.0.0.1:0", "--fault", "status=oops"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("status"), "{err}");
    assert!(out.stdout.is_empty());
}
