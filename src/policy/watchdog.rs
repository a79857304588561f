//! Throughput watchdog for streamed responses (SPEC §5.9, off by default): aborts an
//! attempt whose *useful* output is too slow, even though events keep arriving.
//!
//! Invariants:
//! - Only UTF-8 bytes of text deltas count (Chat Completions, Responses, Messages);
//!   usage-only, empty, ping and metadata events are ignored (`Progress::Idle`).
//! - No verdict before `warmup` + one full `window` since the start: the first window
//!   judged lies wholly after the warmup.
//! - Judgement is suspended while a tool-call or reasoning/thinking block is in flight
//!   (`Busy` until the next text delta or end-of-block). When such a block ends, a fresh
//!   full `window` must pass before the next verdict, so the silent block itself never
//!   counts against the stream. A block that never ends is the stall guard's business.
//! - The rate is text bytes inside the last `window` divided by its length; abort when it
//!   is below `min_bytes_per_sec`. Bytes are coalesced into `BUCKETS` buckets per window
//!   and a bucket straddling the window's start is counted whole, so the estimate errs
//!   towards *not* aborting, by at most one bucket (window / 16).
//! - Memory is bounded: at most about `BUCKETS` + 2 buckets, whatever the stream length
//!   or the clock does (a clock stepping back adds to the newest bucket).
//!
//! Like every policy it is pure: `now` is passed in, nothing is spawned or timed.

use super::{ms, Millis};
use serde_json::Value;
use std::collections::VecDeque;
use std::time::Duration;

/// Buckets per window.
const BUCKETS: u64 = 16;

/// The watchdog's settings (`resilience.watchdog`, minus `enabled`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WatchdogConfig {
    pub warmup: Duration,
    pub window: Duration,
    pub min_bytes_per_sec: u32,
}

impl From<&crate::config::Watchdog> for WatchdogConfig {
    fn from(w: &crate::config::Watchdog) -> Self {
        WatchdogConfig {
            warmup: w.warmup,
            window: w.window,
            min_bytes_per_sec: w.min_bytes_per_sec,
        }
    }
}

/// What one SSE event contributes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// UTF-8 bytes of text delta.
    Text(usize),
    /// A tool-call or reasoning/thinking event is in flight.
    Busy,
    /// Usage-only, empty, pings, metadata: ignored.
    Idle,
    /// End of that busy block (e.g. `content_block_stop`).
    Done,
}

/// Classifies one event of any of the three APIs by its JSON:
/// - Chat Completions chunk: `choices[].delta.content` string → Text(len);
///   `delta.tool_calls` or `delta.reasoning_content`/`delta.reasoning` (also
///   `reasoning_details`) → Busy; otherwise Idle. `[DONE]` → Idle. Null or empty busy
///   fields are absent ones (providers send `"reasoning_content": null` beside text); a
///   chunk carrying both text and a busy field is Busy; text of several choices adds up.
/// - Responses API: `type` = `response.output_text.delta` → Text(len of `delta`);
///   `response.function_call_arguments.delta`, `response.custom_tool_call_input.delta`,
///   `response.reasoning*`, and `response.output_item.added` of a `reasoning` or `*_call`
///   item → Busy; `response.output_item.done`/`response.content_part.done` → Done;
///   else Idle.
/// - Anthropic Messages: `content_block_delta` with `delta.type` `text_delta` → Text(len
///   of `delta.text`); `input_json_delta`/`thinking_delta`/`signature_delta` → Busy;
///   `content_block_start` whose block type is `tool_use` (also `server_tool_use`,
///   `mcp_tool_use`)/`thinking`/`redacted_thinking` → Busy; `content_block_stop` → Done;
///   else Idle.
///
/// The JSON `type` wins over the SSE `event:` name, which is used when `type` is absent.
/// Unparseable JSON → Idle. Empty text deltas → Idle.
pub fn classify_event(event: Option<&str>, data: &str) -> Progress {
    let data = data.trim();
    if data.is_empty() || data == "[DONE]" {
        return Progress::Idle;
    }
    let Ok(v) = serde_json::from_str::<Value>(data) else {
        return Progress::Idle;
    };
    if let Some(choices) = v.get("choices") {
        return chat_chunk(choices);
    }
    match v.get("type").and_then(Value::as_str).or(event) {
        Some(kind) if kind.starts_with("response.") => responses_event(kind, &v),
        Some(kind) => messages_event(kind, &v),
        None => Progress::Idle,
    }
}

/// Text(len) for a non-empty string, else Idle.
fn text(v: Option<&Value>) -> Progress {
    match v.and_then(Value::as_str) {
        Some(s) if !s.is_empty() => Progress::Text(s.len()),
        _ => Progress::Idle,
    }
}

/// Present with content: a non-empty string, array or object.
fn filled(v: Option<&Value>) -> bool {
    match v {
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        _ => false,
    }
}

fn chat_chunk(choices: &Value) -> Progress {
    let Some(choices) = choices.as_array() else {
        return Progress::Idle;
    };
    let mut bytes = 0usize;
    let mut busy = false;
    for delta in choices.iter().filter_map(|c| c.get("delta")) {
        busy |= [
            "tool_calls",
            "reasoning_content",
            "reasoning",
            "reasoning_details",
        ]
        .iter()
        .any(|k| filled(delta.get(*k)));
        if let Progress::Text(n) = text(delta.get("content")) {
            bytes = bytes.saturating_add(n);
        }
    }
    if busy {
        Progress::Busy
    } else if bytes > 0 {
        Progress::Text(bytes)
    } else {
        Progress::Idle
    }
}

fn responses_event(kind: &str, v: &Value) -> Progress {
    match kind {
        "response.output_text.delta" => text(v.get("delta")),
        "response.function_call_arguments.delta" | "response.custom_tool_call_input.delta" => {
            Progress::Busy
        }
        "response.output_item.added" => {
            let item = v
                .get("item")
                .and_then(|i| i.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("");
            if item == "reasoning" || item.ends_with("_call") {
                Progress::Busy
            } else {
                Progress::Idle
            }
        }
        "response.output_item.done" | "response.content_part.done" => Progress::Done,
        k if k.starts_with("response.reasoning") => Progress::Busy,
        _ => Progress::Idle,
    }
}

fn messages_event(kind: &str, v: &Value) -> Progress {
    match kind {
        "content_block_delta" => {
            let delta = v.get("delta");
            match delta.and_then(|d| d.get("type")).and_then(Value::as_str) {
                Some("text_delta") => text(delta.and_then(|d| d.get("text"))),
                Some("input_json_delta" | "thinking_delta" | "signature_delta") => Progress::Busy,
                _ => Progress::Idle,
            }
        }
        "content_block_start" => {
            let block = v
                .get("content_block")
                .and_then(|b| b.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("");
            if block.ends_with("tool_use") || block == "thinking" || block == "redacted_thinking" {
                Progress::Busy
            } else {
                Progress::Idle
            }
        }
        "content_block_stop" => Progress::Done,
        _ => Progress::Idle,
    }
}

/// The throughput watchdog of one attempt: a plain value, fed every event's `Progress`.
#[derive(Clone, Debug)]
pub struct ThroughputWatchdog {
    /// Window length (ms).
    window: Millis,
    min_bytes_per_sec: u64,
    /// Bucket width (ms, ≥ 1).
    width: Millis,
    /// Most buckets ever kept.
    max_buckets: usize,
    /// No verdict before this instant (start + warmup + window, or end of busy + window).
    judge_from: Millis,
    /// A tool-call or reasoning block is in flight.
    busy: bool,
    /// (bucket index = time / width, text bytes), ascending index.
    buckets: VecDeque<(u64, u64)>,
}

impl ThroughputWatchdog {
    pub fn new(cfg: WatchdogConfig, started: Millis) -> Self {
        let window = ms(cfg.window);
        let width = (window / BUCKETS).max(1);
        let max_buckets = usize::try_from(window.div_ceil(width) + 2).unwrap_or(usize::MAX);
        ThroughputWatchdog {
            window,
            min_bytes_per_sec: u64::from(cfg.min_bytes_per_sec),
            width,
            max_buckets,
            judge_from: started
                .saturating_add(ms(cfg.warmup))
                .saturating_add(window),
            busy: false,
            buckets: VecDeque::new(),
        }
    }

    /// Records what one event contributed at `now`.
    pub fn observe(&mut self, p: Progress, now: Millis) {
        match p {
            Progress::Text(n) => {
                self.end_busy(now);
                self.record(n, now);
            }
            Progress::Busy => self.busy = true,
            Progress::Done => self.end_busy(now),
            Progress::Idle => {}
        }
    }

    /// True when the stream should be aborted: only after `warmup` and one full `window`
    /// since start, never while a Busy block is in flight (Busy until the next Text or
    /// Done), and only when the text bytes within the last `window` / window seconds <
    /// min_bytes_per_sec.
    pub fn should_abort(&self, now: Millis) -> bool {
        if self.min_bytes_per_sec == 0 || self.window == 0 || self.busy || now < self.judge_from {
            return false;
        }
        let bytes = u128::from(self.window_bytes(now));
        bytes * 1000 < u128::from(self.min_bytes_per_sec) * u128::from(self.window)
    }

    /// Text bytes seen within the last `window` before `now` (for logs and error text).
    pub fn window_bytes(&self, now: Millis) -> u64 {
        let horizon = now.saturating_sub(self.window);
        self.buckets
            .iter()
            .filter(|(i, _)| self.bucket_end(*i) > horizon)
            .fold(0u64, |sum, (_, b)| sum.saturating_add(*b))
    }

    /// A tool-call or reasoning block is in flight (judgement suspended).
    pub fn is_busy(&self) -> bool {
        self.busy
    }

    fn end_busy(&mut self, now: Millis) {
        if self.busy {
            self.busy = false;
            self.judge_from = self.judge_from.max(now.saturating_add(self.window));
        }
    }

    /// Last millisecond covered by bucket `i`.
    fn bucket_end(&self, i: u64) -> Millis {
        i.saturating_add(1)
            .saturating_mul(self.width)
            .saturating_sub(1)
    }

    fn record(&mut self, n: usize, now: Millis) {
        if n == 0 {
            return;
        }
        let n = u64::try_from(n).unwrap_or(u64::MAX);
        let index = now / self.width;
        match self.buckets.back_mut() {
            // Same bucket, or the clock stepped back: coalesce into the newest.
            Some((last, bytes)) if *last >= index => *bytes = bytes.saturating_add(n),
            _ => self.buckets.push_back((index, n)),
        }
        let horizon = now.saturating_sub(self.window);
        while let Some(&(i, _)) = self.buckets.front() {
            if self.bucket_end(i) > horizon && self.buckets.len() <= self.max_buckets {
                break;
            }
            self.buckets.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sse::SseAssembler;
    use proptest::prelude::*;

    const T0: Millis = 1_700_000_000_000;

    fn cfg(warmup_s: u64, window_s: u64, min: u32) -> WatchdogConfig {
        WatchdogConfig {
            warmup: Duration::from_secs(warmup_s),
            window: Duration::from_secs(window_s),
            min_bytes_per_sec: min,
        }
    }

    /// The defaults: warmup 15 s, window 15 s, 8 B/s.
    fn dog() -> ThroughputWatchdog {
        ThroughputWatchdog::new(cfg(15, 15, 8), T0)
    }

    /// Feeds `bytes` of text every `every_ms` from `from` to `to` (exclusive), asking for
    /// a verdict after each event; returns the first instant it said abort.
    fn drive(
        w: &mut ThroughputWatchdog,
        bytes: usize,
        every_ms: u64,
        from: u64,
        to: u64,
    ) -> Option<Millis> {
        let mut t = from;
        while t < to {
            w.observe(Progress::Text(bytes), T0 + t);
            if w.should_abort(T0 + t) {
                return Some(t);
            }
            t += every_ms;
        }
        None
    }

    #[test]
    fn config_comes_from_the_validated_section() {
        let w = crate::config::Watchdog {
            enabled: true,
            warmup: Duration::from_secs(3),
            window: Duration::from_secs(4),
            min_bytes_per_sec: 5,
        };
        assert_eq!(WatchdogConfig::from(&w), cfg(3, 4, 5));
    }

    #[test]
    fn fast_stream_never_aborts() {
        let mut w = dog();
        // 20 bytes every 250 ms = 80 B/s for ten minutes.
        assert_eq!(drive(&mut w, 20, 250, 0, 600_000), None);
        // Bursty but fast enough: 400 bytes every 5 s.
        let mut w = dog();
        assert_eq!(drive(&mut w, 400, 5_000, 0, 600_000), None);
        for t in (0..600_000).step_by(100) {
            assert!(!w.should_abort(T0 + t));
        }
    }

    #[test]
    fn rate_threshold_table() {
        // (bytes per second, aborts?) with min 8 B/s, sent once a second.
        for (rate, aborts) in [
            (0, true),
            (1, true),
            (4, true),
            (7, true),
            (9, false),
            (50, false),
        ] {
            let mut w = dog();
            let first = drive(&mut w, rate, 1_000, 0, 120_000);
            assert_eq!(first.is_some(), aborts, "rate {rate}: {first:?}");
            if let Some(t) = first {
                assert_eq!(t, 30_000, "rate {rate}");
            }
        }
    }

    #[test]
    fn slow_stream_aborts_only_after_warmup_and_window() {
        let mut w = dog();
        for t in (0..30_000).step_by(100) {
            if t % 1_000 == 0 {
                w.observe(Progress::Text(1), T0 + t);
            }
            assert!(!w.should_abort(T0 + t), "at {t}");
        }
        assert!(w.should_abort(T0 + 30_000));
        assert!(w.should_abort(T0 + 45_000));
        // Warmup 0: one window is still required.
        let w = ThroughputWatchdog::new(cfg(0, 10, 8), T0);
        assert!(!w.should_abort(T0 + 9_999));
        assert!(w.should_abort(T0 + 10_000));
    }

    #[test]
    fn a_stream_that_slows_down_is_caught_within_a_window() {
        let mut w = dog();
        assert_eq!(drive(&mut w, 100, 500, 0, 60_000), None);
        // Text stops at 60 s: the last window still holds enough until ~one window later.
        assert!(!w.should_abort(T0 + 60_000 + 14_000));
        assert!(w.should_abort(T0 + 60_000 + 16_000));
        assert_eq!(w.window_bytes(T0 + 60_000 + 16_000), 0);
    }

    #[test]
    fn tool_call_block_suspends_judgement_then_it_resumes() {
        let mut w = dog();
        assert_eq!(drive(&mut w, 100, 500, 0, 20_000), None);
        // A tool call streams its arguments for two minutes: no text at all.
        for t in (20_000..140_000).step_by(1_000) {
            w.observe(Progress::Busy, T0 + t);
            w.observe(Progress::Idle, T0 + t + 500);
            assert!(w.is_busy());
            assert!(!w.should_abort(T0 + t + 500), "busy at {t}");
        }
        w.observe(Progress::Done, T0 + 140_000);
        assert!(!w.is_busy());
        // A fresh full window is needed before the next verdict…
        for t in (140_000..155_000).step_by(250) {
            assert!(!w.should_abort(T0 + t), "fresh window at {t}");
        }
        // …and then silence after the block is judged.
        assert!(w.should_abort(T0 + 155_000));
    }

    #[test]
    fn judgement_resumes_normally_after_a_thinking_block() {
        let mut w = dog();
        // Thinking from the start for a minute; the first text delta ends the block.
        for t in (0..60_000).step_by(1_000) {
            w.observe(Progress::Busy, T0 + t);
            assert!(!w.should_abort(T0 + t));
        }
        // Fast text afterwards never aborts.
        assert_eq!(drive(&mut w, 30, 250, 60_000, 300_000), None);
        // Slow text afterwards aborts one window after the block ended, not before.
        let mut w = dog();
        w.observe(Progress::Busy, T0 + 1_000);
        assert!(!w.should_abort(T0 + 59_000));
        assert_eq!(drive(&mut w, 2, 1_000, 60_000, 300_000), Some(75_000));
    }

    #[test]
    fn idle_events_and_text_block_ends_change_nothing() {
        // Usage-only, empty and ping events neither count nor end a busy block.
        let mut w = dog();
        for t in (0..60_000).step_by(100) {
            w.observe(Progress::Idle, T0 + t);
        }
        assert!(w.should_abort(T0 + 30_000));
        w.observe(Progress::Busy, T0 + 31_000);
        w.observe(Progress::Idle, T0 + 32_000);
        assert!(!w.should_abort(T0 + 40_000));
        // `Done` outside a busy block (a text block's stop) does not restart the window.
        let mut w = dog();
        w.observe(Progress::Done, T0 + 29_000);
        assert!(w.should_abort(T0 + 30_000));
    }

    #[test]
    fn zero_minimum_never_aborts() {
        let w = ThroughputWatchdog::new(cfg(15, 15, 0), T0);
        assert!(!w.should_abort(T0 + 3_600_000));
    }

    #[test]
    fn memory_stays_bounded() {
        let mut w = dog();
        for t in (0..3_600_000).step_by(7) {
            w.observe(Progress::Text(1), T0 + t);
            assert!(w.buckets.len() <= w.max_buckets);
        }
        assert!(w.buckets.len() <= (BUCKETS + 2) as usize);
        // A clock stepping back coalesces instead of growing.
        for back in 0..1_000 {
            w.observe(Progress::Text(1), T0 + 1_000_000 - back * 997);
            assert!(w.buckets.len() <= w.max_buckets);
        }
    }

    #[test]
    fn counts_utf8_bytes_of_decoded_text() {
        let data = r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"h\u00e9\n🌍"}}"#;
        assert_eq!(
            classify_event(Some("content_block_delta"), data),
            Progress::Text(8)
        );
    }

    #[test]
    fn classifies_chat_completions_chunks() {
        let cases: &[(&str, Progress)] = &[
            (
                r#"{"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
                Progress::Idle,
            ),
            (
                r#"{"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null}]}"#,
                Progress::Text(5),
            ),
            (
                r#"{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"ab"}},{"index":1,"delta":{"content":"cde"}}]}"#,
                Progress::Text(5),
            ),
            (
                r#"{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":null,"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"get_weather","arguments":""}}]},"finish_reason":null}]}"#,
                Progress::Busy,
            ),
            (
                r#"{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":"}}]},"finish_reason":null}]}"#,
                Progress::Busy,
            ),
            (
                r#"{"id":"c1","object":"chat.completion.chunk","model":"deepseek-reasoner","choices":[{"index":0,"delta":{"content":null,"reasoning_content":"Let me think"},"finish_reason":null}]}"#,
                Progress::Busy,
            ),
            (
                r#"{"id":"c1","object":"chat.completion.chunk","model":"deepseek-reasoner","choices":[{"index":0,"delta":{"content":"Answer","reasoning_content":null},"finish_reason":null}]}"#,
                Progress::Text(6),
            ),
            (
                r#"{"id":"gen-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":"","reasoning":"step 1"}}]}"#,
                Progress::Busy,
            ),
            (
                r#"{"id":"gen-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"x","reasoning":""}}]}"#,
                Progress::Text(1),
            ),
            (
                r#"{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
                Progress::Idle,
            ),
            (
                r#"{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
                Progress::Idle,
            ),
            (
                r#"{"id":"c1","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":12,"total_tokens":21}}"#,
                Progress::Idle,
            ),
            ("[DONE]", Progress::Idle),
            (" [DONE] ", Progress::Idle),
            ("", Progress::Idle),
            (r#"{"choices":"nope"}"#, Progress::Idle),
            (
                r#"{"error":{"message":"overloaded","type":"server_error"}}"#,
                Progress::Idle,
            ),
        ];
        for (data, want) in cases {
            assert_eq!(classify_event(None, data), *want, "{data}");
        }
    }

    #[test]
    fn classifies_responses_api_events() {
        let cases: &[(&str, Progress)] = &[
            (
                r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_1","status":"in_progress","output":[]}}"#,
                Progress::Idle,
            ),
            (
                r#"{"type":"response.in_progress","sequence_number":1,"response":{"id":"resp_1","status":"in_progress"}}"#,
                Progress::Idle,
            ),
            (
                r#"{"type":"response.output_item.added","sequence_number":2,"output_index":0,"item":{"id":"rs_1","type":"reasoning","summary":[]}}"#,
                Progress::Busy,
            ),
            (
                r#"{"type":"response.reasoning_summary_part.added","sequence_number":3,"item_id":"rs_1","output_index":0,"summary_index":0,"part":{"type":"summary_text","text":""}}"#,
                Progress::Busy,
            ),
            (
                r#"{"type":"response.reasoning_summary_text.delta","sequence_number":4,"item_id":"rs_1","output_index":0,"summary_index":0,"delta":"**Planning**"}"#,
                Progress::Busy,
            ),
            (
                r#"{"type":"response.reasoning_text.delta","sequence_number":5,"item_id":"rs_1","output_index":0,"content_index":0,"delta":"hmm"}"#,
                Progress::Busy,
            ),
            (
                r#"{"type":"response.output_item.done","sequence_number":6,"output_index":0,"item":{"id":"rs_1","type":"reasoning","summary":[]}}"#,
                Progress::Done,
            ),
            (
                r#"{"type":"response.output_item.added","sequence_number":7,"output_index":1,"item":{"id":"msg_1","type":"message","status":"in_progress","role":"assistant","content":[]}}"#,
                Progress::Idle,
            ),
            (
                r#"{"type":"response.content_part.added","sequence_number":8,"item_id":"msg_1","output_index":1,"content_index":0,"part":{"type":"output_text","annotations":[],"text":""}}"#,
                Progress::Idle,
            ),
            (
                r#"{"type":"response.output_text.delta","sequence_number":9,"item_id":"msg_1","output_index":1,"content_index":0,"delta":"Hi there","logprobs":[]}"#,
                Progress::Text(8),
            ),
            (
                r#"{"type":"response.output_text.delta","sequence_number":10,"item_id":"msg_1","output_index":1,"content_index":0,"delta":""}"#,
                Progress::Idle,
            ),
            (
                r#"{"type":"response.output_text.done","sequence_number":11,"item_id":"msg_1","output_index":1,"content_index":0,"text":"Hi there"}"#,
                Progress::Idle,
            ),
            (
                r#"{"type":"response.content_part.done","sequence_number":12,"item_id":"msg_1","output_index":1,"content_index":0,"part":{"type":"output_text","text":"Hi there"}}"#,
                Progress::Done,
            ),
            (
                r#"{"type":"response.output_item.added","sequence_number":13,"output_index":2,"item":{"id":"fc_1","type":"function_call","call_id":"call_1","name":"get_weather","arguments":""}}"#,
                Progress::Busy,
            ),
            (
                r#"{"type":"response.function_call_arguments.delta","sequence_number":14,"item_id":"fc_1","output_index":2,"delta":"{\"city\":"}"#,
                Progress::Busy,
            ),
            (
                r#"{"type":"response.function_call_arguments.done","sequence_number":15,"item_id":"fc_1","output_index":2,"arguments":"{\"city\":\"Paris\"}"}"#,
                Progress::Idle,
            ),
            (
                r#"{"type":"response.custom_tool_call_input.delta","sequence_number":16,"item_id":"ct_1","output_index":3,"delta":"print(1)"}"#,
                Progress::Busy,
            ),
            (
                r#"{"type":"response.output_item.added","sequence_number":17,"output_index":4,"item":{"id":"ws_1","type":"web_search_call","status":"in_progress"}}"#,
                Progress::Busy,
            ),
            (
                r#"{"type":"response.web_search_call.searching","sequence_number":18,"output_index":4,"item_id":"ws_1"}"#,
                Progress::Idle,
            ),
            (
                r#"{"type":"response.completed","sequence_number":19,"response":{"id":"resp_1","status":"completed","usage":{"input_tokens":5,"output_tokens":7,"total_tokens":12}}}"#,
                Progress::Idle,
            ),
            (
                r#"{"type":"error","code":"server_error","message":"boom","sequence_number":20}"#,
                Progress::Idle,
            ),
        ];
        for (data, want) in cases {
            let kind = serde_json::from_str::<Value>(data)
                .ok()
                .and_then(|v| v.get("type").and_then(Value::as_str).map(str::to_owned));
            assert_eq!(classify_event(kind.as_deref(), data), *want, "{data}");
            assert_eq!(classify_event(None, data), *want, "no event name: {data}");
        }
    }

    #[test]
    fn classifies_anthropic_messages_events() {
        let cases: &[(&str, &str, Progress)] = &[
            (
                "message_start",
                r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"claude-sonnet-4-5","stop_reason":null,"usage":{"input_tokens":25,"output_tokens":1}}}"#,
                Progress::Idle,
            ),
            ("ping", r#"{"type": "ping"}"#, Progress::Idle),
            (
                "content_block_start",
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":""}}"#,
                Progress::Busy,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"Let me work it out"}}"#,
                Progress::Busy,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"EqQBCgIYAhIM"}}"#,
                Progress::Busy,
            ),
            (
                "content_block_stop",
                r#"{"type":"content_block_stop","index":0}"#,
                Progress::Done,
            ),
            (
                "content_block_start",
                r#"{"type":"content_block_start","index":1,"content_block":{"type":"redacted_thinking","data":"EmwKAhgB"}}"#,
                Progress::Busy,
            ),
            (
                "content_block_start",
                r#"{"type":"content_block_start","index":2,"content_block":{"type":"text","text":""}}"#,
                Progress::Idle,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":2,"delta":{"type":"text_delta","text":"Hello"}}"#,
                Progress::Text(5),
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":2,"delta":{"type":"text_delta","text":""}}"#,
                Progress::Idle,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":2,"delta":{"type":"citations_delta","citation":{"type":"char_location","cited_text":"x"}}}"#,
                Progress::Idle,
            ),
            (
                "content_block_start",
                r#"{"type":"content_block_start","index":3,"content_block":{"type":"tool_use","id":"toolu_1","name":"get_weather","input":{}}}"#,
                Progress::Busy,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":3,"delta":{"type":"input_json_delta","partial_json":"{\"location\": \"San Fra"}}"#,
                Progress::Busy,
            ),
            (
                "content_block_start",
                r#"{"type":"content_block_start","index":4,"content_block":{"type":"server_tool_use","id":"srvtoolu_1","name":"web_search","input":{}}}"#,
                Progress::Busy,
            ),
            (
                "message_delta",
                r#"{"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":89}}"#,
                Progress::Idle,
            ),
            ("message_stop", r#"{"type":"message_stop"}"#, Progress::Idle),
            (
                "error",
                r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
                Progress::Idle,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","delta":{"type":"text_delta","text":"trunc"#,
                Progress::Idle,
            ),
            ("content_block_stop", r#"{"index":0}"#, Progress::Done),
            ("content_block_delta", "not json at all", Progress::Idle),
        ];
        for (event, data, want) in cases {
            assert_eq!(classify_event(Some(event), data), *want, "{data}");
        }
        assert_eq!(classify_event(None, r#"{"index":0}"#), Progress::Idle);
    }

    fn progress() -> impl Strategy<Value = Progress> {
        prop_oneof![
            4 => (0usize..40).prop_map(Progress::Text),
            1 => Just(Progress::Busy),
            1 => Just(Progress::Idle),
            1 => Just(Progress::Done),
        ]
    }

    proptest! {
        /// Against a naive model keeping every event: no verdict before warmup + window,
        /// none while busy or within a window after a busy block, and never an abort of a
        /// stream whose exact text bytes in the last window meet the minimum.
        #[test]
        fn never_aborts_wrongly(
            steps in proptest::collection::vec((progress(), 0u64..3_000), 0..200),
            warmup_s in 0u64..20,
            window_s in 1u64..20,
            min in 0u32..40,
        ) {
            let c = cfg(warmup_s, window_s, min);
            let window = window_s * 1_000;
            let mut w = ThroughputWatchdog::new(c, T0);
            let mut log: Vec<(Millis, usize)> = Vec::new();
            let mut busy = false;
            let mut judge_from = T0 + warmup_s * 1_000 + window;
            let mut now = T0;
            for (p, gap) in steps {
                now += gap;
                w.observe(p, now);
                match p {
                    Progress::Text(n) => {
                        if busy {
                            judge_from = judge_from.max(now + window);
                        }
                        busy = false;
                        log.push((now, n));
                    }
                    Progress::Done => {
                        if busy {
                            judge_from = judge_from.max(now + window);
                        }
                        busy = false;
                    }
                    Progress::Busy => busy = true,
                    Progress::Idle => {}
                }
                prop_assert!(w.buckets.len() <= w.max_buckets);
                for probe in [now, now + 500, now + 1_500] {
                    let exact: usize = log
                        .iter()
                        .filter(|(t, _)| *t + window > probe && *t <= probe)
                        .map(|(_, n)| n)
                        .sum();
                    let aborts = w.should_abort(probe);
                    if busy || probe < judge_from || min == 0 {
                        prop_assert!(!aborts, "judged at {} (busy {busy})", probe - T0);
                    }
                    if exact as u64 * 1_000 >= u64::from(min) * window {
                        prop_assert!(!aborts, "{exact} bytes in window at {}", probe - T0);
                    }
                    prop_assert!(w.window_bytes(probe) >= exact as u64);
                }
            }
        }
    }

    #[test]
    fn assembled_stream_end_to_end() {
        // A thinking block, a slow trickle of text, then silence, through the assembler.
        let mut sse = SseAssembler::new(64 * 1024);
        let mut w = dog();
        let mut events = Vec::new();
        let mut feed = |w: &mut ThroughputWatchdog, chunk: &str, t: u64| {
            sse.feed(chunk.as_bytes(), &mut events);
            for e in events.drain(..) {
                w.observe(classify_event(e.event.as_deref(), &e.data), T0 + t);
            }
        };
        feed(&mut w, "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{}}\n\nevent: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"thinking\",\"thinking\":\"\"}}\n\n", 0);
        for t in (1_000..40_000).step_by(1_000) {
            feed(&mut w, "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\"hm\"}}\n\n", t);
            assert!(!w.should_abort(T0 + t));
        }
        feed(&mut w, "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\nevent: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n", 40_000);
        for t in (41_000..55_000).step_by(1_000) {
            feed(&mut w, "event: ping\ndata: {\"type\": \"ping\"}\n\nevent: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"text_delta\",\"text\":\"ab\"}}\n\n", t);
            assert!(!w.should_abort(T0 + t));
        }
        assert!(!w.should_abort(T0 + 54_999));
        assert!(w.should_abort(T0 + 55_000));
    }
}
