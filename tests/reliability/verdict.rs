//! The judge: what one client saw, sorted into outcomes a correct gateway may produce
//! and the ones it must never produce.
//!
//! Allowed (SPEC §2, §4):
//! - a correct answer: 200, complete as framed; a non-streamed body is the family's JSON
//!   answer; a stream ends with the family's terminal event (`data: [DONE]`,
//!   `event: message_stop`) after every content piece, none missing or repeated;
//! - an upstream's own body passed through whole (a garbage body the chaos injected,
//!   recognised verbatim), with a success or an error status;
//! - a well-formed error: status ≥ 400 with a JSON body of the route family's shape,
//!   and a `Retry-After` of whole seconds ≥ 1 on every 429/503;
//! - a committed stream ended by the family's SSE error event (then a clean end or a
//!   cut), or a committed body cut without its terminating chunk / full length;
//! - while the gateway is being killed: a broken connection or a cut.
//!
//! Never allowed: a request still unanswered at its deadline (hang), a body complete
//! as framed that is not a complete answer (truncation framed as success), an error
//! status without a well-formed body, a connection failure while the gateway was up.

use super::client::{End, Exchange, Framing, NoAnswer};
use super::{Api, Shape};

/// The content pieces of every mock answer (the mock runs with `--chunks` this).
pub const MOCK_CHUNKS: u32 = 6;

/// One outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Correct answer, from the mock named `from`.
    Ok { from: String },
    /// An injected garbage body passed through whole with `status`.
    Passthrough { status: u16 },
    /// Well-formed error.
    Error { status: u16, code: String },
    /// Committed stream ended with the family's error event carrying `code`.
    StreamError { code: String },
    /// Committed body cut (no terminating chunk, short Content-Length).
    Cut,
    /// Broken connection or cut while the gateway was being killed.
    CrashCut,
    /// Bad: unanswered at the deadline.
    Hang { phase: &'static str },
    /// Bad: complete as framed, but not a complete answer.
    FramedTruncation { detail: String },
    /// Bad: error status without a well-formed body.
    BadError { status: u16, detail: String },
    /// Bad: no status line while the gateway was up.
    ConnError { detail: String },
    /// Bad: a correct answer from another upstream than its `x-sluice-provider` names.
    Mislabelled { detail: String },
    /// Bad: a kept-alive connection, left open after a complete answer without
    /// `Connection: close`, broke before the next status line while the gateway was up.
    ReusedClosed { detail: String },
}

impl Verdict {
    pub fn is_bad(&self) -> bool {
        matches!(
            self,
            Verdict::Hang { .. }
                | Verdict::FramedTruncation { .. }
                | Verdict::BadError { .. }
                | Verdict::ConnError { .. }
                | Verdict::Mislabelled { .. }
                | Verdict::ReusedClosed { .. }
        )
    }

    /// The row of the report this outcome is counted in.
    pub fn key(&self) -> String {
        match self {
            Verdict::Ok { .. } => "ok".into(),
            Verdict::Passthrough { status } => format!("upstream body passed through ({status})"),
            Verdict::Error { status, code } => format!("error {status} {code}"),
            Verdict::StreamError { code } => format!("stream error event {code}"),
            Verdict::Cut => "cut after commit (no terminating chunk)".into(),
            Verdict::CrashCut => "cut by the gateway's kill -9".into(),
            Verdict::Hang { phase } => format!("HANG ({phase})"),
            Verdict::FramedTruncation { .. } => "TRUNCATION FRAMED AS SUCCESS".into(),
            Verdict::BadError { status, .. } => format!("MALFORMED ERROR {status}"),
            Verdict::ConnError { .. } => "CONNECTION ERROR (gateway up)".into(),
            Verdict::Mislabelled { .. } => "ANSWER FROM ANOTHER UPSTREAM".into(),
            Verdict::ReusedClosed { .. } => {
                "KEPT-ALIVE CONNECTION DROPPED BEFORE THE ANSWER".into()
            }
        }
    }
}

/// Judges one request. `garbage` lists every body the chaos may inject verbatim;
/// `crashed` says the gateway was killed while this request was in flight;
/// `upstreams` maps provider ids to the name of the mock behind them (a correct answer
/// must come from the mock its `x-sluice-provider` names; unlisted providers are not
/// checked). `reused` says the request went on a kept-alive connection.
pub fn judge(
    shape: Shape,
    result: &Result<Exchange, NoAnswer>,
    garbage: &[&str],
    crashed: bool,
    reused: bool,
    upstreams: &[(&str, &str)],
) -> Verdict {
    let x = match result {
        Err(NoAnswer::Deadline) => {
            return Verdict::Hang {
                phase: "no status line",
            }
        }
        Err(NoAnswer::Broken(e)) if reused && !crashed => {
            return Verdict::ReusedClosed { detail: e.clone() }
        }
        Err(NoAnswer::Connect(e)) | Err(NoAnswer::Broken(e)) => {
            return if crashed {
                Verdict::CrashCut
            } else {
                Verdict::ConnError { detail: e.clone() }
            }
        }
        Ok(x) => x,
    };
    match &x.end {
        End::Deadline => return Verdict::Hang { phase: "body" },
        End::Broken(e) => {
            return if crashed {
                Verdict::CrashCut
            } else if x.status >= 400 {
                Verdict::BadError {
                    status: x.status,
                    detail: format!("error body cut: {e}"),
                }
            } else if shape.stream && ends_with_error_event(shape.api, &x.body).is_some() {
                // The error event went out; only the clean end was lost.
                Verdict::StreamError {
                    code: ends_with_error_event(shape.api, &x.body).unwrap_or_default(),
                }
            } else {
                Verdict::Cut
            };
        }
        End::Complete => {}
    }
    if garbage.iter().any(|g| g.as_bytes() == x.body.as_slice()) {
        return Verdict::Passthrough { status: x.status };
    }
    if x.status >= 400 {
        return judge_error(shape.api, x);
    }
    if x.status != 200 {
        return Verdict::BadError {
            status: x.status,
            detail: "unexpected status".into(),
        };
    }
    if x.framing == Framing::UntilClose {
        // A close-delimited body cannot tell a cut from the end.
        return Verdict::FramedTruncation {
            detail: "200 body delimited by close: a cut would look complete".into(),
        };
    }
    if x.header("x-sluice-provider").is_none() || x.header("x-sluice-connection").is_none() {
        return Verdict::FramedTruncation {
            detail: "200 without x-sluice-provider / x-sluice-connection".into(),
        };
    }
    let judged = if shape.stream {
        judge_stream(shape.api, &x.body)
    } else {
        judge_whole(shape.api, &x.body)
    };
    match judged {
        Ok(Verdict::Ok { from }) => {
            let provider = x.header("x-sluice-provider").unwrap_or_default();
            match upstreams.iter().find(|(p, _)| *p == provider) {
                Some((_, mock)) if *mock != from => Verdict::Mislabelled {
                    detail: format!("x-sluice-provider {provider}, answer from mock {from}"),
                },
                _ => Verdict::Ok { from },
            }
        }
        Ok(v) => v,
        Err(detail) => Verdict::FramedTruncation { detail },
    }
}

fn judge_error(api: Api, x: &Exchange) -> Verdict {
    let bad = |detail: String| Verdict::BadError {
        status: x.status,
        detail,
    };
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&x.body) else {
        return bad(format!("body is not JSON: {}", snippet(&x.body)));
    };
    let code = match api {
        Api::Chat => {
            let e = &v["error"];
            // `type` at the top level is the Anthropic shape's marker.
            if !e["message"].is_string() || !e["type"].is_string() || !v["type"].is_null() {
                return bad(format!("not an OpenAI error body: {}", snippet(&x.body)));
            }
            e["code"]
                .as_str()
                .or(e["type"].as_str())
                .unwrap_or_default()
                .to_string()
        }
        Api::Messages => {
            let e = &v["error"];
            if v["type"] != "error" || !e["type"].is_string() || !e["message"].is_string() {
                return bad(format!("not an Anthropic error body: {}", snippet(&x.body)));
            }
            e["code"]
                .as_str()
                .or(e["type"].as_str())
                .unwrap_or_default()
                .to_string()
        }
    };
    if matches!(x.status, 429 | 503) {
        let ok = x
            .header("retry-after")
            .and_then(|r| r.trim().parse::<u64>().ok())
            .is_some_and(|s| s >= 1);
        if !ok {
            return bad(format!(
                "{} without a Retry-After of whole seconds ≥ 1 ({:?})",
                x.status,
                x.header("retry-after")
            ));
        }
    }
    Verdict::Error {
        status: x.status,
        code,
    }
}

/// Checks the text of a mock answer: `Hello from NAME.` then ` Chunk 1.` … in order,
/// `MOCK_CHUNKS` pieces in all; returns NAME.
pub fn check_text(text: &str) -> Result<String, String> {
    let rest = text
        .strip_prefix("Hello from ")
        .ok_or_else(|| format!("text does not start with the first piece: {text:?}"))?;
    let dot = rest
        .find('.')
        .ok_or_else(|| format!("first piece unterminated: {text:?}"))?;
    let name = rest[..dot].to_string();
    let mut tail = &rest[dot + 1..];
    for i in 1..MOCK_CHUNKS {
        let piece = format!(" Chunk {i}.");
        tail = tail
            .strip_prefix(piece.as_str())
            .ok_or_else(|| format!("piece {i} missing or out of order in {text:?}"))?;
    }
    if !tail.is_empty() {
        return Err(format!("extra text after the last piece: {text:?}"));
    }
    Ok(name)
}

fn judge_whole(api: Api, body: &[u8]) -> Result<Verdict, String> {
    let v: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| format!("200 body is not JSON ({e}): {}", snippet(body)))?;
    let text = match api {
        Api::Chat => {
            if v["object"] != "chat.completion" || v["choices"][0]["finish_reason"] != "stop" {
                return Err(format!("not a chat completion: {}", snippet(body)));
            }
            v["choices"][0]["message"]["content"].as_str()
        }
        Api::Messages => {
            if v["type"] != "message" || v["stop_reason"] != "end_turn" {
                return Err(format!("not a message: {}", snippet(body)));
            }
            v["content"][0]["text"].as_str()
        }
    };
    let text = text.ok_or_else(|| format!("answer without text: {}", snippet(body)))?;
    Ok(Verdict::Ok {
        from: check_text(text)?,
    })
}

/// One SSE event: its `event:` name and joined `data:` lines.
struct Event {
    name: Option<String>,
    data: String,
}

/// Splits an SSE body into events; the second value is false when the body does not
/// end on an event boundary.
fn events(body: &[u8]) -> (Vec<Event>, bool) {
    let text = String::from_utf8_lossy(body).replace("\r\n", "\n");
    let on_boundary = text.is_empty() || text.ends_with("\n\n");
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        let mut name = None;
        let mut data = Vec::new();
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("event:") {
                name = Some(v.trim().to_string());
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push(v.strip_prefix(' ').unwrap_or(v).to_string());
            }
        }
        if name.is_some() || !data.is_empty() {
            out.push(Event {
                name,
                data: data.join("\n"),
            });
        }
    }
    (out, on_boundary)
}

/// The code of the family's error event when it is the body's last event.
fn ends_with_error_event(api: Api, body: &[u8]) -> Option<String> {
    let (evs, _) = events(body);
    let last = evs.last()?;
    let v: serde_json::Value = serde_json::from_str(&last.data).ok()?;
    match api {
        Api::Chat if last.name.is_none() && v["error"].is_object() => {
            Some(v["error"]["code"].as_str().unwrap_or("error").to_string())
        }
        Api::Messages
            if last.name.as_deref() == Some("error")
                && v["type"] == "error"
                && v["error"].is_object() =>
        {
            Some(
                v["error"]["code"]
                    .as_str()
                    .or(v["error"]["type"].as_str())
                    .unwrap_or("error")
                    .to_string(),
            )
        }
        _ => None,
    }
}

fn judge_stream(api: Api, body: &[u8]) -> Result<Verdict, String> {
    let (evs, on_boundary) = events(body);
    if !on_boundary {
        return Err(format!(
            "stream complete as framed but ends inside an event: …{}",
            tail(body)
        ));
    }
    if let Some(code) = ends_with_error_event(api, body) {
        return Ok(Verdict::StreamError { code });
    }
    let mut text = String::new();
    let mut terminal = false;
    for (i, e) in evs.iter().enumerate() {
        let last = i + 1 == evs.len();
        match api {
            Api::Chat => {
                if e.data == "[DONE]" {
                    terminal = last;
                    continue;
                }
                let v: serde_json::Value = serde_json::from_str(&e.data)
                    .map_err(|err| format!("event {i} is not JSON ({err}): {}", e.data))?;
                if v["error"].is_object() {
                    return Err(format!("error event {i} not at the end: {}", e.data));
                }
                if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
                    text.push_str(t);
                }
            }
            Api::Messages => {
                let v: serde_json::Value = serde_json::from_str(&e.data)
                    .map_err(|err| format!("event {i} is not JSON ({err}): {}", e.data))?;
                match e.name.as_deref() {
                    Some("content_block_delta") => {
                        if let Some(t) = v["delta"]["text"].as_str() {
                            text.push_str(t);
                        }
                    }
                    Some("message_stop") => terminal = last,
                    Some("error") => {
                        return Err(format!("error event {i} not at the end: {}", e.data))
                    }
                    _ => {}
                }
            }
        }
    }
    if !terminal {
        return Err(format!(
            "stream complete as framed without its terminal event ({} events): …{}",
            evs.len(),
            tail(body)
        ));
    }
    Ok(Verdict::Ok {
        from: check_text(&text)?,
    })
}

pub fn snippet(body: &[u8]) -> String {
    let s = String::from_utf8_lossy(body);
    let mut out: String = s.chars().take(200).collect();
    if s.chars().count() > 200 {
        out.push('…');
    }
    out
}

fn tail(body: &[u8]) -> String {
    let s = String::from_utf8_lossy(body);
    let n = s.chars().count();
    s.chars().skip(n.saturating_sub(160)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn x(status: u16, headers: &[(&str, &str)], body: &str, end: End) -> Exchange {
        let mut h: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        h.push(("x-sluice-provider".into(), "pa".into()));
        h.push(("x-sluice-connection".into(), "a1".into()));
        Exchange {
            status,
            headers: h,
            framing: Framing::Chunked,
            body: body.as_bytes().to_vec(),
            end,
            ttfb: std::time::Duration::ZERO,
        }
    }

    const CHAT: Shape = Shape {
        api: Api::Chat,
        stream: false,
    };
    const CHAT_S: Shape = Shape {
        api: Api::Chat,
        stream: true,
    };
    const MSG_S: Shape = Shape {
        api: Api::Messages,
        stream: true,
    };

    fn text() -> String {
        let mut t = "Hello from a.".to_string();
        for i in 1..MOCK_CHUNKS {
            t.push_str(&format!(" Chunk {i}."));
        }
        t
    }

    fn chat_stream(pieces: &[String], done: bool) -> String {
        let mut s = String::new();
        for p in pieces {
            s.push_str(&format!(
                "data: {}\n\n",
                serde_json::json!({"choices":[{"delta":{"content":p}}]})
            ));
        }
        if done {
            s.push_str("data: [DONE]\n\n");
        }
        s
    }

    fn pieces() -> Vec<String> {
        let mut v = vec!["Hello from a.".to_string()];
        v.extend((1..MOCK_CHUNKS).map(|i| format!(" Chunk {i}.")));
        v
    }

    #[test]
    fn whole_answers() {
        let good = serde_json::json!({"object":"chat.completion","choices":[{"finish_reason":"stop","message":{"content":text()}}]}).to_string();
        let r = Ok(x(200, &[], &good, End::Complete));
        assert_eq!(
            judge(CHAT, &r, &[], false, false, &[]),
            Verdict::Ok { from: "a".into() }
        );
        assert!(
            judge(CHAT, &r, &[], false, false, &[("pa", "b")]).is_bad(),
            "mislabelled"
        );
        assert!(!judge(CHAT, &r, &[], false, false, &[("pa", "a")]).is_bad());
        let short = &good[..good.len() - 10];
        let r = Ok(x(200, &[], short, End::Complete));
        assert!(matches!(
            judge(CHAT, &r, &[], false, false, &[]),
            Verdict::FramedTruncation { .. }
        ));
        let r = Ok(x(200, &[], short, End::Broken("eof".into())));
        assert_eq!(judge(CHAT, &r, &[], false, false, &[]), Verdict::Cut);
        assert_eq!(judge(CHAT, &r, &[], true, false, &[]), Verdict::CrashCut);
        let r = Ok(x(200, &[], "<html>", End::Complete));
        assert_eq!(
            judge(CHAT, &r, &["<html>"], false, false, &[]),
            Verdict::Passthrough { status: 200 }
        );
        let r = Ok(x(200, &[], &good, End::Deadline));
        assert!(judge(CHAT, &r, &[], false, false, &[]).is_bad());
        assert!(judge(CHAT, &Err(NoAnswer::Deadline), &[], true, false, &[]).is_bad());
        let r = Err(NoAnswer::Broken("reset".into()));
        assert!(judge(CHAT, &r, &[], false, false, &[]).is_bad());
        assert_eq!(judge(CHAT, &r, &[], true, false, &[]), Verdict::CrashCut);
        assert!(matches!(
            judge(CHAT, &r, &[], false, true, &[]),
            Verdict::ReusedClosed { .. }
        ));
        assert_eq!(judge(CHAT, &r, &[], true, true, &[]), Verdict::CrashCut);
    }

    #[test]
    fn streams() {
        let r = Ok(x(200, &[], &chat_stream(&pieces(), true), End::Complete));
        assert_eq!(
            judge(CHAT_S, &r, &[], false, false, &[]),
            Verdict::Ok { from: "a".into() }
        );
        // Terminal event without every piece, or every piece without the terminal event.
        let mut missing = pieces();
        missing.remove(3);
        let r = Ok(x(200, &[], &chat_stream(&missing, true), End::Complete));
        assert!(judge(CHAT_S, &r, &[], false, false, &[]).is_bad());
        let r = Ok(x(200, &[], &chat_stream(&pieces(), false), End::Complete));
        assert!(judge(CHAT_S, &r, &[], false, false, &[]).is_bad());
        // Cut mid-event but framed complete.
        let mut cut = chat_stream(&pieces()[..2], false);
        cut.push_str("data: {\"choi");
        let r = Ok(x(200, &[], &cut, End::Complete));
        assert!(judge(CHAT_S, &r, &[], false, false, &[]).is_bad());
        // The family's error event at the end is an honest end.
        let mut err = chat_stream(&pieces()[..2], false);
        err.push_str("data: {\"error\":{\"code\":\"stall\",\"message\":\"m\"}}\n\n");
        let r = Ok(x(200, &[], &err, End::Complete));
        assert_eq!(
            judge(CHAT_S, &r, &[], false, false, &[]),
            Verdict::StreamError {
                code: "stall".into()
            }
        );
        let msg_err = "event: message_start\ndata: {\"type\":\"message_start\"}\n\n\
                       event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\",\"code\":\"upstream_error\",\"message\":\"m\"}}\n\n";
        let r = Ok(x(200, &[], msg_err, End::Complete));
        assert_eq!(
            judge(MSG_S, &r, &[], false, false, &[]),
            Verdict::StreamError {
                code: "upstream_error".into()
            }
        );
        // An OpenAI-shaped error event on the Anthropic route is not the family's.
        let wrong = "event: message_start\ndata: {\"type\":\"message_start\"}\n\n\
                     data: {\"error\":{\"code\":\"stall\"}}\n\n";
        let r = Ok(x(200, &[], wrong, End::Complete));
        assert!(judge(MSG_S, &r, &[], false, false, &[]).is_bad());
    }

    #[test]
    fn errors() {
        let oa = r#"{"error":{"message":"m","type":"server_error","code":"upstream_timeout"}}"#;
        let r = Ok(x(504, &[], oa, End::Complete));
        assert_eq!(
            judge(CHAT, &r, &[], false, false, &[]),
            Verdict::Error {
                status: 504,
                code: "upstream_timeout".into()
            }
        );
        let r = Ok(x(503, &[], oa, End::Complete));
        assert!(
            judge(CHAT, &r, &[], false, false, &[]).is_bad(),
            "503 needs Retry-After"
        );
        let r = Ok(x(503, &[("retry-after", "2")], oa, End::Complete));
        assert!(!judge(CHAT, &r, &[], false, false, &[]).is_bad());
        let an = r#"{"type":"error","error":{"type":"overloaded_error","message":"m"}}"#;
        let r = Ok(x(529, &[], an, End::Complete));
        let msg = Shape {
            api: Api::Messages,
            stream: false,
        };
        assert_eq!(
            judge(msg, &r, &[], false, false, &[]),
            Verdict::Error {
                status: 529,
                code: "overloaded_error".into()
            }
        );
        assert!(
            judge(CHAT, &r, &[], false, false, &[]).is_bad(),
            "wrong family shape"
        );
        let r = Ok(x(502, &[], "<html>bad gateway</html>", End::Complete));
        assert!(judge(CHAT, &r, &[], false, false, &[]).is_bad());
    }

    #[test]
    fn text_pieces_must_all_be_there() {
        assert_eq!(check_text(&text()).unwrap(), "a");
        assert!(check_text("Hello from a. Chunk 1.").is_err());
        assert!(check_text(&format!("{} Chunk 6.", text())).is_err());
    }
}
