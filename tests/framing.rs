//! Honest framing after the commit point (SPEC §2 stream): a failure after the first
//! byte is never framed as a complete answer. A non-SSE body is cut (no terminating
//! chunk, no completed `Content-Length`); an SSE stream gets its partial event
//! terminated and then the route family's error event, which parses on its own.

// Integration tests: a failed unwrap is a failed test, and they time the real binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod common;

use common::gw::{server_section, Gateway};
use common::raw::{chunk, head, RawUpstream, Step};
use common::{open_stream, parse_sse, StreamEnd};
use std::time::Duration;

fn config(openai: &str, anthropic: &str, resilience: &str) -> String {
    format!(
        "{}providers:
  - id: o
    base_url: \"{openai}\"
    api: openai
    connections: [ {{ id: c, api_key_env: KEY }} ]
  - id: an
    base_url: \"{anthropic}\"
    api: anthropic
    connections: [ {{ id: c, api_key_env: KEY }} ]
models:
  - name: m
    targets: [ {{ provider: o, model: up }} ]
  - name: claude
    targets: [ {{ provider: an, model: up-claude }} ]
{resilience}",
        server_section("")
    )
}

const KEY: &[(&str, &str)] = &[("KEY", "k")];

fn gateway(openai: &RawUpstream, resilience: &str) -> Gateway {
    Gateway::start(
        &config(&openai.base_url(), &openai.base_url(), resilience),
        KEY,
    )
}

#[test]
fn a_body_short_of_its_content_length_is_never_completed() {
    let partial = br#"{"id":"chatcmpl-1","object":"chat.completion","choices":[{"#;
    let up = RawUpstream::start(vec![
        Step::Write(head(
            200,
            &["Content-Type: application/json", "Content-Length: 400"],
        )),
        Step::Write(partial.to_vec()),
    ]);
    let gw = gateway(&up, "");
    let mut s = open_stream(
        gw.client,
        "POST",
        "/v1/chat/completions",
        &[],
        br#"{"model":"m"}"#,
    );
    assert_eq!(s.status, 200);
    let body = s.read_to_end(Duration::from_secs(10));
    assert!(
        matches!(s.end, Some(StreamEnd::Broken(_))),
        "the client must see a framing error, got {:?} with {} bytes",
        s.end,
        body.len()
    );
    assert!(body.len() < 400);
    assert_eq!(up.calls(), 1);
}

/// A chunked JSON answer whose upstream dies before its last chunk.
fn cut_json() -> RawUpstream {
    RawUpstream::start(vec![
        Step::Write(head(
            200,
            &[
                "Content-Type: application/json",
                "Transfer-Encoding: chunked",
            ],
        )),
        Step::Write(chunk(br#"{"id":"chatcmpl-1","choices":["#)),
    ])
}

#[test]
fn a_chunked_body_without_its_last_chunk_is_never_completed() {
    let up = cut_json();
    let gw = gateway(&up, "");
    let mut s = open_stream(
        gw.client,
        "POST",
        "/v1/chat/completions",
        &[],
        br#"{"model":"m"}"#,
    );
    assert_eq!(s.status, 200);
    let body = s.read_to_end(Duration::from_secs(10));
    assert!(
        matches!(s.end, Some(StreamEnd::Broken(_))),
        "the client must see a framing error, got {:?} after {:?}",
        s.end,
        String::from_utf8_lossy(&body)
    );
}

/// An SSE upstream that sends one whole event and then dies inside the next one.
fn cut_stream(first: &str, partial: &str) -> RawUpstream {
    RawUpstream::start(vec![
        Step::Write(head(
            200,
            &[
                "Content-Type: text/event-stream",
                "Transfer-Encoding: chunked",
            ],
        )),
        Step::Write(chunk(first.as_bytes())),
        Step::Sleep(Duration::from_millis(50)),
        Step::Write(chunk(partial.as_bytes())),
    ])
}

fn stream(gw: &Gateway, path: &str, model: &str) -> (Vec<u8>, Option<StreamEnd>) {
    let body = format!("{{\"model\":\"{model}\",\"stream\":true}}");
    let mut s = open_stream(gw.client, "POST", path, &[], body.as_bytes());
    assert_eq!(s.status, 200);
    let bytes = s.read_to_end(Duration::from_secs(10));
    (bytes, s.end)
}

#[test]
fn chat_stream_cut_mid_event_ends_with_a_parseable_error_event() {
    let up = cut_stream(
        "data: {\"id\":\"1\",\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n",
        "data: {\"id\":\"2\",\"choi",
    );
    let gw = gateway(&up, "");
    let (body, end) = stream(&gw, "/v1/chat/completions", "m");
    assert_eq!(end, Some(StreamEnd::Complete));
    let events = parse_sse(&body);
    assert_eq!(events.len(), 3, "{}", String::from_utf8_lossy(&body));
    assert_eq!(events[0].json()["id"], "1");
    let last = events.last().unwrap();
    assert_eq!(last.event, None);
    let j = last.json();
    assert_eq!(j["error"]["code"], "upstream_error", "{j}");
    assert!(j["error"]["message"].as_str().is_some());
}

#[test]
fn responses_stream_cut_mid_event_ends_with_a_responses_error_event() {
    let up = cut_stream(
        "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hel\"}\n\n",
        "event: response.output_text.delta\ndata: {\"type\":\"respo",
    );
    let gw = gateway(&up, "");
    let (body, end) = stream(&gw, "/v1/responses", "m");
    assert_eq!(end, Some(StreamEnd::Complete));
    let events = parse_sse(&body);
    let last = events.last().unwrap();
    assert_eq!(
        last.event.as_deref(),
        Some("error"),
        "{}",
        String::from_utf8_lossy(&body)
    );
    let j = last.json();
    assert_eq!(j["type"], "error", "{j}");
    assert_eq!(j["code"], "upstream_error");
    assert!(j["message"].as_str().is_some());
}

#[test]
fn messages_stream_cut_mid_line_ends_with_a_messages_error_event() {
    // Cut inside the `data:` line of a content_block_delta event.
    let up = cut_stream(
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\"}}\n\n",
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"te",
    );
    let gw = gateway(&up, "");
    let (body, end) = stream(&gw, "/v1/messages", "claude");
    assert_eq!(end, Some(StreamEnd::Complete));
    let events = parse_sse(&body);
    let last = events.last().unwrap();
    assert_eq!(
        last.event.as_deref(),
        Some("error"),
        "{}",
        String::from_utf8_lossy(&body)
    );
    let j = last.json();
    assert_eq!(j["type"], "error", "{j}");
    assert_eq!(j["error"]["type"], "api_error");
    assert!(j["error"]["message"].as_str().is_some());
    // The partial event was terminated on its own, before the error event.
    assert_eq!(events[0].event.as_deref(), Some("message_start"));
    assert_eq!(events.len(), 3);
}

#[test]
fn heartbeats_and_empty_events_do_not_hold_off_the_stall_guard() {
    let mut script = vec![
        Step::Write(head(
            200,
            &[
                "Content-Type: text/event-stream",
                "Transfer-Encoding: chunked",
            ],
        )),
        Step::Write(chunk(
            b"data: {\"id\":\"1\",\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n",
        )),
    ];
    for i in 0..30 {
        script.push(Step::Sleep(Duration::from_millis(100)));
        let beat: &[u8] = match i % 3 {
            0 => b": keep-alive\n\n",
            1 => b"data: \n\n",
            _ => b"event: ping\ndata: {\"type\":\"ping\"}\n\n",
        };
        script.push(Step::Write(chunk(beat)));
    }
    let up = RawUpstream::start(script);
    let gw = gateway(&up, "resilience:\n  stream: { stall_timeout: \"700ms\" }\n");
    let started = std::time::Instant::now();
    let (body, end) = stream(&gw, "/v1/chat/completions", "m");
    let took = started.elapsed();
    assert_eq!(end, Some(StreamEnd::Complete));
    let events = parse_sse(&body);
    let last = events.last().unwrap();
    assert_eq!(last.json()["error"]["code"], "stall", "{last:?}");
    assert!(
        took < Duration::from_millis(2500),
        "heartbeats kept the stream alive for {took:?}"
    );
}

/// Sends `bytes` on a new connection to the gateway and reads until the gateway closes
/// it: what arrived, and how the read ended (`Err` for a reset).
fn raw_exchange(gw: &Gateway, bytes: &[u8]) -> (Vec<u8>, std::io::Result<()>) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(gw.client).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(bytes).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let end = loop {
        match s.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => break Err(e),
        }
    };
    (got, end)
}

/// Splits one response off the front of `wire`: its head (lower-cased) and the bytes
/// after the head's blank line.
fn split_head(wire: &[u8]) -> (String, &[u8]) {
    let end = wire
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a complete head");
    (
        String::from_utf8_lossy(&wire[..end]).to_ascii_lowercase(),
        &wire[end + 4..],
    )
}

/// Decodes a chunked body at the front of `wire`: the body and what follows it.
fn dechunk(mut wire: &[u8]) -> (Vec<u8>, &[u8]) {
    let mut body = Vec::new();
    loop {
        let line = wire
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("a size line");
        let size = usize::from_str_radix(std::str::from_utf8(&wire[..line]).unwrap(), 16)
            .expect("a hex chunk size");
        wire = &wire[line + 2..];
        if size == 0 {
            assert_eq!(&wire[..2], b"\r\n", "no trailers, then the end");
            return (body, &wire[2..]);
        }
        body.extend_from_slice(&wire[..size]);
        assert_eq!(&wire[size..size + 2], b"\r\n");
        wire = &wire[size + 2..];
    }
}

fn post(path: &str, body: &str, version: &str) -> Vec<u8> {
    format!(
        "POST {path} {version}\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

const MODELS_CLOSE: &[u8] = b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n";

#[test]
fn an_event_stream_with_a_content_length_is_chunked_so_its_error_event_fits() {
    let up = RawUpstream::start(vec![
        Step::Write(head(
            200,
            &["Content-Type: text/event-stream", "Content-Length: 400"],
        )),
        Step::Write(b"data: {\"id\":\"1\",\"choices\":[]}\n\n".to_vec()),
        Step::Sleep(Duration::from_millis(50)),
        Step::Write(b"data: {\"id\":\"2\",\"ch".to_vec()),
    ]);
    let gw = gateway(&up, "");
    // A second request pipelined behind the stream: its answer must start right after
    // the stream's last chunk, or the connection is out of step.
    let mut wire = post(
        "/v1/chat/completions",
        r#"{"model":"m","stream":true}"#,
        "HTTP/1.1",
    );
    wire.extend_from_slice(MODELS_CLOSE);
    let (got, _) = raw_exchange(&gw, &wire);
    let (h, rest) = split_head(&got);
    assert!(h.starts_with("http/1.1 200"), "{h}");
    assert!(h.contains("transfer-encoding: chunked"), "{h}");
    assert!(!h.contains("content-length"), "{h}");
    let (body, after) = dechunk(rest);
    let events = parse_sse(&body);
    assert_eq!(events[0].json()["id"], "1");
    let last = events.last().unwrap();
    assert_eq!(last.json()["error"]["code"], "upstream_error", "{last:?}");
    let (next, _) = split_head(after);
    assert!(next.starts_with("http/1.1 200"), "the next answer: {next}");
    assert!(next.contains("content-type: application/json"), "{next}");
}

#[test]
fn a_head_request_gets_fields_but_no_body() {
    let up = RawUpstream::start(vec![]);
    let gw = gateway(&up, "");
    let mut wire = b"HEAD /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n".to_vec();
    wire.extend_from_slice(MODELS_CLOSE);
    let (got, _) = raw_exchange(&gw, &wire);
    let (h, rest) = split_head(&got);
    assert!(h.contains("content-length: "), "{h}");
    // The GET's answer follows the HEAD's blank line at once.
    let (next, body) = split_head(rest);
    assert!(next.starts_with("http/1.1 200"), "{next}");
    let j: serde_json::Value = serde_json::from_slice(body).unwrap();
    assert_eq!(j["object"], "list");
    assert_eq!(up.calls(), 0);
}

#[test]
fn a_cut_answer_to_an_http10_client_ends_in_a_reset_not_a_close() {
    // An HTTP/1.0 client has no chunks: its body ends with the connection, so only a
    // reset tells it the body was cut.
    let up = cut_json();
    let gw = gateway(&up, "");
    let (got, end) = raw_exchange(
        &gw,
        &post("/v1/chat/completions", r#"{"model":"m"}"#, "HTTP/1.0"),
    );
    let (h, _) = split_head(&got);
    assert!(h.starts_with("http/1.1 200"), "{h}");
    assert!(
        !h.contains("content-length") && !h.contains("transfer-encoding"),
        "{h}"
    );
    let e = end.expect_err("a clean close would frame the cut body as complete");
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
}

#[test]
fn a_bare_lf_in_a_chunked_request_body_is_refused() {
    let up = RawUpstream::start(vec![]);
    let gw = gateway(&up, "");
    // `d 0\n`: size 0xd to a lenient reader, a last chunk to another.
    let wire = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nd 0\n{\"model\":\"m\"}\r\n0\r\n\r\n";
    let (got, _) = raw_exchange(&gw, wire);
    let (h, _) = split_head(&got);
    assert!(h.starts_with("http/1.1 400"), "{h}");
    assert_eq!(up.calls(), 0);
}
