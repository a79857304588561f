//! Response bodies of the mock upstream, in each API's wire shape.
//!
//! Everything here is a pure function of its inputs (mock name, request model, request
//! id, chunk count, request body), so answers are deterministic and a streamed answer
//! spells exactly the same text as the non-streamed one with the same chunk count: content
//! chunk `i` is [`piece`] `i`, and the full text is the concatenation of pieces `0..n`.
//!
//! JSON is written by hand into a pre-sized buffer rather than through a `Value` tree:
//! the mock sits on the benchmark's hot path. Every string that did not originate here
//! (model, mock name) goes through `serde_json`'s escaper, so output is always valid JSON.

use std::io::Write;

use bytes::Bytes;
use sha2::{Digest, Sha256};

use super::route::Route;

/// Inputs shared by every body of one answer.
pub struct Answer<'a> {
    /// The mock's name, already JSON-escaped, without surrounding quotes.
    pub name: &'a str,
    /// The request's model, raw (escaped when written).
    pub model: &'a str,
    /// Per-process request number, used in ids.
    pub id: u64,
    /// Unix seconds.
    pub created: u64,
    /// Number of content chunks (and pieces of text).
    pub chunks: u32,
    /// Rough token estimate of the request, reported in usage.
    pub prompt_tokens: u64,
}

/// Number of floats in every mock embedding.
pub const EMBEDDING_DIMS: usize = 8;

/// Writes `s` as a quoted JSON string.
fn push_json_str(buf: &mut Vec<u8>, s: &str) {
    // Serialising a str into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *buf, s);
}

/// Writes text piece `i` (JSON-escaped, unquoted): the unit of one content chunk.
pub fn piece(buf: &mut Vec<u8>, name: &str, i: u32) {
    if i == 0 {
        buf.extend_from_slice(b"Hello from ");
        buf.extend_from_slice(name.as_bytes());
        buf.push(b'.');
    } else {
        let _ = write!(buf, " Chunk {i}.");
    }
}

/// `event` after an SSE comment line holding `unix_us` (`: t=1796592687123456`).
pub fn stamped(event: &[u8], unix_us: u64) -> Bytes {
    let mut b = Vec::with_capacity(event.len() + 24);
    let _ = writeln!(b, ": t={unix_us}");
    b.extend_from_slice(event);
    Bytes::from(b)
}

/// Writes the whole answer text as a quoted JSON string.
fn push_text(buf: &mut Vec<u8>, a: &Answer<'_>) {
    buf.push(b'"');
    for i in 0..a.chunks {
        piece(buf, a.name, i);
    }
    buf.push(b'"');
}

fn push_piece_str(buf: &mut Vec<u8>, a: &Answer<'_>, i: u32) {
    buf.push(b'"');
    piece(buf, a.name, i);
    buf.push(b'"');
}

fn completion_tokens(a: &Answer<'_>) -> u64 {
    u64::from(a.chunks)
}

/// The full (non-streamed) success body of `route`. `input_count` is the number of
/// embedding inputs; `body` seeds the embedding values.
pub fn full_body(route: Route, a: &Answer<'_>, body: &[u8], input_count: usize) -> Bytes {
    let mut b = Vec::with_capacity(384 + a.model.len() + 16 * a.chunks as usize);
    let p = a.prompt_tokens;
    let c = completion_tokens(a);
    match route {
        Route::Chat => {
            let _ = write!(
                b,
                r#"{{"id":"chatcmpl-mock-{}","object":"chat.completion","created":{},"model":"#,
                a.id, a.created
            );
            push_json_str(&mut b, a.model);
            b.extend_from_slice(
                br#","choices":[{"index":0,"message":{"role":"assistant","content":"#,
            );
            push_text(&mut b, a);
            let _ = write!(
                b,
                r#"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":{p},"completion_tokens":{c},"total_tokens":{}}}}}"#,
                p + c
            );
        }
        Route::Completions => {
            let _ = write!(
                b,
                r#"{{"id":"cmpl-mock-{}","object":"text_completion","created":{},"model":"#,
                a.id, a.created
            );
            push_json_str(&mut b, a.model);
            b.extend_from_slice(br#","choices":[{"index":0,"text":"#);
            push_text(&mut b, a);
            let _ = write!(
                b,
                r#","logprobs":null,"finish_reason":"stop"}}],"usage":{{"prompt_tokens":{p},"completion_tokens":{c},"total_tokens":{}}}}}"#,
                p + c
            );
        }
        Route::Embeddings => {
            b.extend_from_slice(br#"{"object":"list","data":["#);
            for i in 0..input_count.max(1) {
                if i > 0 {
                    b.push(b',');
                }
                let _ = write!(b, r#"{{"object":"embedding","index":{i},"embedding":["#);
                let mut h = Sha256::new();
                h.update(body);
                h.update((i as u64).to_le_bytes());
                let digest = h.finalize();
                for (k, byte) in digest.iter().take(EMBEDDING_DIMS).enumerate() {
                    if k > 0 {
                        b.push(b',');
                    }
                    let v = (f64::from(*byte) - 127.5) / 127.5;
                    let _ = write!(b, "{v:.4}");
                }
                b.extend_from_slice(b"]}");
            }
            b.extend_from_slice(br#"],"model":"#);
            push_json_str(&mut b, a.model);
            let _ = write!(
                b,
                r#","usage":{{"prompt_tokens":{p},"total_tokens":{p}}}}}"#
            );
        }
        Route::Responses => push_response_object(&mut b, a, "completed", true),
        Route::Messages => {
            let _ = write!(
                b,
                r#"{{"id":"msg_mock_{}","type":"message","role":"assistant","model":"#,
                a.id
            );
            push_json_str(&mut b, a.model);
            b.extend_from_slice(br#","content":[{"type":"text","text":"#);
            push_text(&mut b, a);
            let _ = write!(
                b,
                r#"}}],"stop_reason":"end_turn","stop_sequence":null,"usage":{{"input_tokens":{p},"output_tokens":{c}}}}}"#
            );
        }
        Route::Models => {
            b.extend_from_slice(br#"{"object":"list","data":["#);
            for (i, id) in ["mock-gpt", "mock-claude", "mock-embed"].iter().enumerate() {
                if i > 0 {
                    b.push(b',');
                }
                let _ = write!(
                    b,
                    r#"{{"id":"{id}","object":"model","created":0,"owned_by":"{}"}}"#,
                    a.name
                );
            }
            b.extend_from_slice(b"]}");
        }
    }
    Bytes::from(b)
}

/// A Responses-API `response` object; `with_output` false gives the empty in-progress one.
fn push_response_object(b: &mut Vec<u8>, a: &Answer<'_>, status: &str, with_output: bool) {
    let _ = write!(
        b,
        r#"{{"id":"resp_mock_{}","object":"response","created_at":{},"status":"{status}","model":"#,
        a.id, a.created
    );
    push_json_str(b, a.model);
    b.extend_from_slice(br#","output":["#);
    if with_output {
        let _ = write!(
            b,
            r#"{{"type":"message","id":"msg_mock_{}","status":"completed","role":"assistant","content":[{{"type":"output_text","text":"#,
            a.id
        );
        push_text(b, a);
        b.extend_from_slice(br#","annotations":[]}]}"#);
    }
    b.push(b']');
    if with_output {
        let p = a.prompt_tokens;
        let c = completion_tokens(a);
        let _ = write!(
            b,
            r#","usage":{{"input_tokens":{p},"output_tokens":{c},"total_tokens":{}}}"#,
            p + c
        );
    }
    b.push(b'}');
}

/// Starts an SSE event: `event:` line for named-event APIs, then `data: `.
fn event_start(b: &mut Vec<u8>, event: Option<&str>) {
    if let Some(e) = event {
        b.extend_from_slice(b"event: ");
        b.extend_from_slice(e.as_bytes());
        b.push(b'\n');
    }
    b.extend_from_slice(b"data: ");
}

fn event_end(b: Vec<u8>) -> Bytes {
    let mut b = b;
    b.extend_from_slice(b"\n\n");
    Bytes::from(b)
}

/// Events written after the response header and before the first content chunk.
pub fn stream_open(route: Route, a: &Answer<'_>) -> Vec<Bytes> {
    match route {
        Route::Responses => {
            let mut b = Vec::with_capacity(256);
            event_start(&mut b, Some("response.created"));
            b.extend_from_slice(br#"{"type":"response.created","response":"#);
            push_response_object(&mut b, a, "in_progress", false);
            b.push(b'}');
            vec![event_end(b)]
        }
        Route::Messages => {
            let mut b = Vec::with_capacity(320);
            event_start(&mut b, Some("message_start"));
            let _ = write!(
                b,
                r#"{{"type":"message_start","message":{{"id":"msg_mock_{}","type":"message","role":"assistant","model":"#,
                a.id
            );
            push_json_str(&mut b, a.model);
            let _ = write!(
                b,
                r#","content":[],"stop_reason":null,"stop_sequence":null,"usage":{{"input_tokens":{},"output_tokens":0}}}}}}"#,
                a.prompt_tokens
            );
            let start = event_end(b);
            let mut b = Vec::with_capacity(128);
            event_start(&mut b, Some("content_block_start"));
            b.extend_from_slice(
                br#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            );
            vec![start, event_end(b)]
        }
        _ => Vec::new(),
    }
}

/// Content chunk `i` as one SSE event.
pub fn stream_chunk(route: Route, a: &Answer<'_>, i: u32) -> Bytes {
    let mut b = Vec::with_capacity(224 + a.model.len() + a.name.len());
    match route {
        Route::Chat => {
            event_start(&mut b, None);
            let _ = write!(
                b,
                r#"{{"id":"chatcmpl-mock-{}","object":"chat.completion.chunk","created":{},"model":"#,
                a.id, a.created
            );
            push_json_str(&mut b, a.model);
            b.extend_from_slice(br#","choices":[{"index":0,"delta":{"#);
            if i == 0 {
                b.extend_from_slice(br#""role":"assistant","#);
            }
            b.extend_from_slice(br#""content":"#);
            push_piece_str(&mut b, a, i);
            b.extend_from_slice(br#"},"finish_reason":null}]}"#);
        }
        Route::Completions => {
            event_start(&mut b, None);
            let _ = write!(
                b,
                r#"{{"id":"cmpl-mock-{}","object":"text_completion","created":{},"model":"#,
                a.id, a.created
            );
            push_json_str(&mut b, a.model);
            b.extend_from_slice(br#","choices":[{"index":0,"text":"#);
            push_piece_str(&mut b, a, i);
            b.extend_from_slice(br#","logprobs":null,"finish_reason":null}]}"#);
        }
        Route::Responses => {
            event_start(&mut b, Some("response.output_text.delta"));
            let _ = write!(
                b,
                r#"{{"type":"response.output_text.delta","item_id":"msg_mock_{}","output_index":0,"content_index":0,"delta":"#,
                a.id
            );
            push_piece_str(&mut b, a, i);
            b.push(b'}');
        }
        Route::Messages => {
            event_start(&mut b, Some("content_block_delta"));
            b.extend_from_slice(
                br#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"#,
            );
            push_piece_str(&mut b, a, i);
            b.extend_from_slice(b"}}");
        }
        // Not streamable; callers never ask.
        Route::Embeddings | Route::Models => {}
    }
    event_end(b)
}

/// Events written after the last content chunk, before the terminating empty chunk.
pub fn stream_close(route: Route, a: &Answer<'_>) -> Vec<Bytes> {
    let p = a.prompt_tokens;
    let c = completion_tokens(a);
    match route {
        Route::Chat | Route::Completions => {
            let mut b = Vec::with_capacity(256);
            event_start(&mut b, None);
            if route == Route::Chat {
                let _ = write!(
                    b,
                    r#"{{"id":"chatcmpl-mock-{}","object":"chat.completion.chunk","created":{},"model":"#,
                    a.id, a.created
                );
                push_json_str(&mut b, a.model);
                b.extend_from_slice(
                    br#","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]"#,
                );
            } else {
                let _ = write!(
                    b,
                    r#"{{"id":"cmpl-mock-{}","object":"text_completion","created":{},"model":"#,
                    a.id, a.created
                );
                push_json_str(&mut b, a.model);
                b.extend_from_slice(
                    br#","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"stop"}]"#,
                );
            }
            let _ = write!(
                b,
                r#","usage":{{"prompt_tokens":{p},"completion_tokens":{c},"total_tokens":{}}}}}"#,
                p + c
            );
            vec![event_end(b), Bytes::from_static(b"data: [DONE]\n\n")]
        }
        Route::Responses => {
            let mut b = Vec::with_capacity(384 + 16 * a.chunks as usize);
            event_start(&mut b, Some("response.completed"));
            b.extend_from_slice(br#"{"type":"response.completed","response":"#);
            push_response_object(&mut b, a, "completed", true);
            b.push(b'}');
            vec![event_end(b)]
        }
        Route::Messages => {
            let stop = Bytes::from_static(
                b"event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
            );
            let mut b = Vec::with_capacity(160);
            event_start(&mut b, Some("message_delta"));
            let _ = write!(
                b,
                r#"{{"type":"message_delta","delta":{{"stop_reason":"end_turn","stop_sequence":null}},"usage":{{"output_tokens":{c}}}}}"#
            );
            let done =
                Bytes::from_static(b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
            vec![stop, event_end(b), done]
        }
        Route::Embeddings | Route::Models => Vec::new(),
    }
}

/// The family-shaped error body for `status`.
pub fn error_body(anthropic: bool, status: u16, message: &str) -> Bytes {
    let mut b = Vec::with_capacity(128 + message.len());
    if anthropic {
        let kind = match status {
            400 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            _ if status >= 500 => "api_error",
            _ => "invalid_request_error",
        };
        let _ = write!(
            b,
            r#"{{"type":"error","error":{{"type":"{kind}","message":"#
        );
        push_json_str(&mut b, message);
        b.extend_from_slice(b"}}");
    } else {
        let (kind, code) = match status {
            401 => ("authentication_error", "invalid_api_key"),
            403 => ("permission_error", "permission_denied"),
            404 => ("invalid_request_error", "not_found"),
            429 => ("rate_limit_error", "rate_limit_exceeded"),
            _ if status >= 500 => ("server_error", "server_error"),
            _ => ("invalid_request_error", "invalid_request"),
        };
        b.extend_from_slice(br#"{"error":{"message":"#);
        push_json_str(&mut b, message);
        let _ = write!(b, r#","type":"{kind}","code":"{code}"}}}}"#);
    }
    Bytes::from(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn answer(chunks: u32) -> Answer<'static> {
        Answer {
            name: "m\\\"1",
            model: "gpt \"x\"",
            id: 7,
            created: 1,
            chunks,
            prompt_tokens: 3,
        }
    }

    fn json(b: &[u8]) -> Value {
        serde_json::from_slice(b).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(b)))
    }

    fn sse_data(ev: &Bytes) -> Value {
        let s = std::str::from_utf8(ev).unwrap();
        assert!(s.ends_with("\n\n"));
        let data = s.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
        json(data.as_bytes())
    }

    #[test]
    fn full_bodies_are_valid_json_with_echoed_model() {
        let a = answer(3);
        for r in Route::ALL {
            let v = json(&full_body(r, &a, b"{}", 2));
            if r != Route::Models {
                assert_eq!(v["model"], "gpt \"x\"", "{r:?}");
            }
        }
        let chat = json(&full_body(Route::Chat, &a, b"", 1));
        assert_eq!(
            chat["choices"][0]["message"]["content"],
            "Hello from m\"1. Chunk 1. Chunk 2."
        );
        let emb = json(&full_body(Route::Embeddings, &a, b"x", 2));
        assert_eq!(emb["data"].as_array().unwrap().len(), 2);
        assert_eq!(
            emb["data"][0]["embedding"].as_array().unwrap().len(),
            EMBEDDING_DIMS
        );
        assert_ne!(emb["data"][0]["embedding"], emb["data"][1]["embedding"]);
        let msg = json(&full_body(Route::Messages, &a, b"", 1));
        assert_eq!(
            msg["content"][0]["text"],
            chat["choices"][0]["message"]["content"]
        );
    }

    #[test]
    fn streamed_pieces_spell_the_full_text() {
        let a = answer(4);
        for r in [
            Route::Chat,
            Route::Completions,
            Route::Responses,
            Route::Messages,
        ] {
            let mut events: Vec<Bytes> = stream_open(r, &a);
            events.extend((0..a.chunks).map(|i| stream_chunk(r, &a, i)));
            events.extend(stream_close(r, &a));
            let mut text = String::new();
            for ev in &events {
                if ev.as_ref() == b"data: [DONE]\n\n" {
                    continue;
                }
                let v = sse_data(ev);
                let piece = match r {
                    Route::Chat => v["choices"][0]["delta"]["content"].as_str(),
                    Route::Completions => v["choices"][0]["text"].as_str(),
                    Route::Responses => v["delta"].as_str(),
                    _ => v["delta"]["text"].as_str(),
                };
                text.push_str(piece.unwrap_or(""));
            }
            assert_eq!(text, "Hello from m\"1. Chunk 1. Chunk 2. Chunk 3.", "{r:?}");
        }
    }

    #[test]
    fn error_bodies_follow_the_family_shape() {
        let o = json(&error_body(false, 429, "slow \"down\""));
        assert_eq!(o["error"]["message"], "slow \"down\"");
        assert_eq!(o["error"]["type"], "rate_limit_error");
        let a = json(&error_body(true, 529, "busy"));
        assert_eq!(a["type"], "error");
        assert_eq!(a["error"]["type"], "overloaded_error");
    }
}
