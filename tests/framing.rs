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

#[test]
fn a_chunked_body_without_its_last_chunk_is_never_completed() {
    let up = RawUpstream::start(vec![
        Step::Write(head(
            200,
            &[
                "Content-Type: application/json",
                "Transfer-Encoding: chunked",
            ],
        )),
        Step::Write(chunk(br#"{"id":"chatcmpl-1","choices":["#)),
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
