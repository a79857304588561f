//! Server-sent-event parsing for the stream guards (SPEC §5.9): pure byte-level state
//! machines with no I/O, shared by the Pingora glue (`proxy::stream`) and the tests of
//! the watchdog policy; nothing here knows a socket or a clock.
//!
//! `SseProgress` tracks progress for the stall guard. Upstream chunk boundaries are not
//! event boundaries, so it keeps a little state across chunks: whether the event being
//! assembled carries data, and whether it is a heartbeat (`event: ping`). Comments (`:`
//! lines), pings and events whose `data:` is empty never count as progress; any other
//! event with data does (reasoning/thinking deltas included). Only the start of an
//! unfinished line is kept (bounded), never the stream itself.
//!
//! `SseAssembler` goes one step further for the throughput watchdog: it rebuilds whole
//! events (`event:` name and joined `data:` lines) from arbitrary chunk boundaries, with
//! LF, CRLF or CR line ends. It is a small streaming state machine: bytes are consumed
//! as they arrive, only the data of the event being assembled is kept, and an event
//! whose data would exceed its limit is dropped on the spot rather than buffered.

/// Longest line prefix kept across chunks: enough to read a field name and `ping`.
const KEEP: usize = 32;

#[derive(Debug, Default)]
pub struct SseProgress {
    partial: Vec<u8>,
    has_data: bool,
    is_ping: bool,
    /// The last chunk ended in CR: a LF starting the next one ends the same line.
    after_cr: bool,
    /// The kept start of the current line is not all of it.
    cut: bool,
}

impl SseProgress {
    /// Feeds one upstream chunk; returns true when at least one content event completed.
    /// Lines end in LF, CRLF or a bare CR (all three are valid SSE).
    pub fn feed(&mut self, chunk: &[u8]) -> bool {
        let mut progress = false;
        let mut rest = chunk;
        if self.after_cr && !rest.is_empty() {
            rest = rest.strip_prefix(b"\n").unwrap_or(rest);
            self.after_cr = false;
        }
        while let Some(end) = memchr::memchr2(b'\n', b'\r', rest) {
            let (line, tail) = rest.split_at(end);
            rest = &tail[1..];
            if tail[0] == b'\r' {
                match rest.strip_prefix(b"\n") {
                    Some(r) => rest = r,
                    None => self.after_cr = rest.is_empty(),
                }
            }
            let complete: &[u8] = if self.partial.is_empty() {
                line
            } else {
                self.keep(line);
                &self.partial
            };
            if complete.is_empty() {
                if self.has_data && !self.is_ping {
                    progress = true;
                }
                self.has_data = false;
                self.is_ping = false;
            } else if let Some(value) = complete.strip_prefix(b"data:") {
                // An empty `data:` line is a keep-alive, not content.
                self.has_data |= !value.trim_ascii().is_empty();
            } else if complete.starts_with(b"event:") {
                let name = complete[6..].trim_ascii();
                self.is_ping = name == b"ping" && !self.cut;
            }
            self.partial.clear();
            self.cut = false;
        }
        if !rest.is_empty() {
            self.keep(rest);
        }
        progress
    }

    /// Keeps the start of a line that spans chunks, as its judgement needs it: the field
    /// name, the colon, and the value from its first non-blank byte (padding after the
    /// colon is dropped, so a padded line is judged as it would be whole), at most
    /// [`KEEP`] bytes; `cut` notes that more followed.
    fn keep(&mut self, mut bytes: &[u8]) {
        let colon = self.partial.iter().position(|&b| b == b':');
        match colon {
            Some(c) if self.partial[c + 1..].iter().all(u8::is_ascii_whitespace) => {
                self.partial.truncate(c + 1);
                bytes = bytes.trim_ascii_start();
            }
            Some(_) => {}
            None => {
                if let Some(c) = bytes.iter().position(|&b| b == b':') {
                    let (name, value) = bytes.split_at(c + 1);
                    self.push(name);
                    bytes = value.trim_ascii_start();
                }
            }
        }
        self.push(bytes);
    }

    fn push(&mut self, bytes: &[u8]) {
        let room = KEEP.saturating_sub(self.partial.len());
        self.cut |= bytes.len() > room;
        self.partial
            .extend_from_slice(&bytes[..bytes.len().min(room)]);
    }
}

/// Longest field name read (`event` behind a UTF-8 BOM); longer names are unknown fields.
const NAME_MAX: usize = 8;
/// Longest `event:` name kept; an event with a longer name is dropped.
const EVENT_NAME_MAX: usize = 256;
/// The UTF-8 byte order mark a stream may start with (ignored).
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// One complete SSE event: its `event:` name (if any) and its `data:` lines joined with '\n'.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SseEvent {
    pub event: Option<String>,
    pub data: String,
}

/// Where the assembler is within the current line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Line {
    /// Nothing of the line read yet: a line end here is a blank line (dispatch).
    Start,
    /// Reading the field name (before the first `:`).
    Name,
    /// Reading a `data:` value into the event's data.
    Data,
    /// Reading an `event:` value into the event's name.
    Event,
    /// Comment, unknown field or dropped value: ignored up to the line end.
    Skip,
}

/// Assembles complete events from arbitrary chunk boundaries (split or merged events,
/// CRLF or LF). Bounded: an event whose data exceeds `max_event_bytes` is dropped (not
/// returned) and its bytes are not kept; memory never exceeds ~max_event_bytes + one
/// line (a line is never buffered: only a field name of at most a few bytes is).
///
/// Comments (`:`) and fields other than `event`/`data` (`id`, `retry`) are ignored;
/// `data:` loses an optional single leading space; an event without any `data:` line is
/// not returned (as in the WHATWG event-stream rules); non-UTF-8 data is replaced
/// lossily. An unfinished event at the end of the stream is never returned.
#[derive(Debug)]
pub struct SseAssembler {
    max_event_bytes: usize,
    line: Line,
    /// Field name bytes of the current line (at most `NAME_MAX`).
    name: Vec<u8>,
    /// The next value byte is the optional leading space to strip.
    strip_space: bool,
    /// The previous line ended with CR: a LF right after it belongs to the same line end.
    after_cr: bool,
    /// Still on the stream's first line (where a BOM may precede the field name).
    first_line: bool,
    /// Joined data of the event being assembled (at most `max_event_bytes`).
    data: Vec<u8>,
    /// The event has at least one `data:` line.
    has_data: bool,
    /// Name of the event being assembled (at most `EVENT_NAME_MAX`).
    event: Vec<u8>,
    /// The event exceeded a limit: the rest of it is ignored and it is not returned.
    dropped: bool,
}

impl SseAssembler {
    pub fn new(max_event_bytes: usize) -> Self {
        SseAssembler {
            max_event_bytes,
            line: Line::Start,
            name: Vec::with_capacity(NAME_MAX),
            strip_space: false,
            after_cr: false,
            first_line: true,
            data: Vec::new(),
            has_data: false,
            event: Vec::new(),
            dropped: false,
        }
    }

    /// Feeds one upstream chunk; appends every event it completes to `out`, in order.
    pub fn feed(&mut self, chunk: &[u8], out: &mut Vec<SseEvent>) {
        let mut rest = chunk;
        while !rest.is_empty() {
            if self.after_cr {
                self.after_cr = false;
                if let Some((b'\n', tail)) = rest.split_first() {
                    rest = tail;
                    continue;
                }
            }
            match rest.iter().position(|&b| b == b'\n' || b == b'\r') {
                Some(i) => {
                    self.take(&rest[..i]);
                    self.after_cr = rest[i] == b'\r';
                    self.end_line(out);
                    rest = &rest[i + 1..];
                }
                None => {
                    self.take(rest);
                    rest = &[];
                }
            }
        }
    }

    /// Consumes a piece of the current line (no line end inside).
    fn take(&mut self, mut part: &[u8]) {
        while let Some((&first, _)) = part.split_first() {
            match self.line {
                Line::Start => {
                    if first == b':' {
                        self.line = Line::Skip;
                        return;
                    }
                    self.name.clear();
                    self.line = Line::Name;
                }
                Line::Name => {
                    let colon = part.iter().position(|&b| b == b':');
                    let (name, tail) = match colon {
                        Some(i) => (&part[..i], Some(&part[i + 1..])),
                        None => (part, None),
                    };
                    if self.name.len() + name.len() > NAME_MAX {
                        self.line = Line::Skip;
                        return;
                    }
                    self.name.extend_from_slice(name);
                    match tail {
                        Some(tail) => {
                            self.begin_value();
                            part = tail;
                        }
                        None => return,
                    }
                }
                Line::Data => {
                    self.push_data(part);
                    return;
                }
                Line::Event => {
                    self.push_event(part);
                    return;
                }
                Line::Skip => return,
            }
        }
    }

    /// The field name is complete (a `:` or the line end): starts reading its value.
    fn begin_value(&mut self) {
        let mut name: &[u8] = &self.name;
        if self.first_line {
            name = name.strip_prefix(BOM).unwrap_or(name);
        }
        self.strip_space = true;
        self.line = if self.dropped {
            Line::Skip
        } else if name == b"data" {
            if self.has_data {
                // Lines of one event are joined with '\n'.
                self.append_data(b"\n");
            }
            self.has_data = true;
            if self.dropped {
                Line::Skip
            } else {
                Line::Data
            }
        } else if name == b"event" {
            self.event.clear();
            Line::Event
        } else {
            Line::Skip
        };
    }

    /// Returns `bytes` without the optional single leading space of a field value.
    fn strip<'b>(&mut self, bytes: &'b [u8]) -> &'b [u8] {
        if !self.strip_space || bytes.is_empty() {
            return bytes;
        }
        self.strip_space = false;
        bytes.strip_prefix(b" ").unwrap_or(bytes)
    }

    fn push_data(&mut self, bytes: &[u8]) {
        let bytes = self.strip(bytes);
        self.append_data(bytes);
    }

    fn append_data(&mut self, bytes: &[u8]) {
        let len = self.data.len() + bytes.len();
        if len > self.max_event_bytes {
            self.drop_event();
            return;
        }
        if len > self.data.capacity() {
            // Grow geometrically, but never past the limit.
            let target = len.max(self.data.capacity() * 2).min(self.max_event_bytes);
            self.data.reserve_exact(target - self.data.len());
        }
        self.data.extend_from_slice(bytes);
    }

    fn push_event(&mut self, bytes: &[u8]) {
        let bytes = self.strip(bytes);
        if self.event.len() + bytes.len() > EVENT_NAME_MAX {
            self.drop_event();
            return;
        }
        self.event.extend_from_slice(bytes);
    }

    /// Over a limit: frees what the event holds and ignores the rest of it.
    fn drop_event(&mut self) {
        self.dropped = true;
        self.data = Vec::new();
        self.event = Vec::new();
        self.line = Line::Skip;
    }

    fn end_line(&mut self, out: &mut Vec<SseEvent>) {
        match self.line {
            Line::Start => self.dispatch(out),
            // A field name without a colon: that field with an empty value.
            Line::Name => self.begin_value(),
            Line::Data | Line::Event | Line::Skip => {}
        }
        self.line = Line::Start;
        self.strip_space = false;
        self.first_line = false;
    }

    /// A blank line: returns the assembled event (if it has data and was not dropped).
    fn dispatch(&mut self, out: &mut Vec<SseEvent>) {
        if self.has_data && !self.dropped {
            let data = String::from_utf8(std::mem::take(&mut self.data))
                .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
            let event =
                (!self.event.is_empty()).then(|| String::from_utf8_lossy(&self.event).into_owned());
            out.push(SseEvent { event, data });
        }
        self.data.clear();
        self.event.clear();
        self.has_data = false;
        self.dropped = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_events_count_heartbeats_do_not() {
        let mut p = SseProgress::default();
        assert!(!p.feed(b": keep-alive\n\n"));
        assert!(!p.feed(b"event: ping\ndata: {\"type\":\"ping\"}\n\n"));
        assert!(p.feed(b"data: {\"choices\":[]}\n\n"));
        assert!(p.feed(b"event: content_block_delta\r\ndata: {}\r\n\r\n"));
        assert!(!p.feed(b"data: \n\n"));
        assert!(!p.feed(b"data:\r\n\r\n"));
        assert!(p.feed(b"data:\ndata: x\n\n"));
    }

    #[test]
    fn events_split_across_chunks() {
        let mut p = SseProgress::default();
        assert!(!p.feed(b"da"));
        assert!(!p.feed(b"ta: {\"x\":"));
        assert!(!p.feed(b"1}\n"));
        assert!(p.feed(b"\n"));
        assert!(!p.feed(b"eve"));
        assert!(!p.feed(b"nt: pi"));
        assert!(!p.feed(b"ng\ndata: {}\n\n"));
    }

    #[test]
    fn bare_cr_and_crlf_split_across_chunks_end_lines_once() {
        let mut p = SseProgress::default();
        assert!(p.feed(b"data: {\"a\":1}\r\r"));
        assert!(!p.feed(b": comment\r\r"));
        assert!(!p.feed(b"event: ping\rdata: {}\r\r"));
        // A CRLF split after its CR: the LF is the same line end, not a blank line.
        assert!(!p.feed(b"data: x\r"));
        assert!(!p.feed(b"\n"));
        assert!(p.feed(b"\r\n"));
        assert!(!p.feed(b"data: y\r"));
        assert!(!p.feed(b""));
        assert!(p.feed(b"\n\n"));
    }

    #[test]
    fn long_lines_stay_bounded() {
        let mut p = SseProgress::default();
        let big = vec![b'x'; 100_000];
        assert!(!p.feed(b"data: "));
        assert!(!p.feed(&big));
        assert!(p.partial.len() <= KEEP);
        assert!(p.feed(b"\n\n"));
    }
}

#[cfg(test)]
mod assembler_tests {
    use super::*;
    use proptest::prelude::*;

    fn ev(event: Option<&str>, data: &str) -> SseEvent {
        SseEvent {
            event: event.map(str::to_owned),
            data: data.to_owned(),
        }
    }

    /// Feeds `chunks` to a fresh assembler and returns every event it produced.
    fn run(max: usize, chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut a = SseAssembler::new(max);
        let mut out = Vec::new();
        for c in chunks {
            a.feed(c, &mut out);
        }
        out
    }

    /// A realistic Anthropic Messages stream with a comment and a ping.
    const MESSAGES: &str = concat!(
        ": upstream keep-alive\n",
        "event: message_start\n",
        "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"role\":\"assistant\"}}\n",
        "\n",
        "event: content_block_start\n",
        "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n",
        "\n",
        "event: ping\n",
        "data: {\"type\": \"ping\"}\n",
        "\n",
        "event: content_block_delta\n",
        "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Grüße 🌍\"}}\n",
        "\n",
        "event: content_block_stop\n",
        "data: {\"type\":\"content_block_stop\",\"index\":0}\n",
        "\n",
        "data: line one\n",
        ": a comment inside an event\n",
        "data:line two\n",
        "id: 7\n",
        "retry: 1000\n",
        "\n",
    );

    fn messages_events() -> Vec<SseEvent> {
        vec![
            ev(
                Some("message_start"),
                "{\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"role\":\"assistant\"}}",
            ),
            ev(
                Some("content_block_start"),
                "{\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}",
            ),
            ev(Some("ping"), "{\"type\": \"ping\"}"),
            ev(
                Some("content_block_delta"),
                "{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Grüße 🌍\"}}",
            ),
            ev(
                Some("content_block_stop"),
                "{\"type\":\"content_block_stop\",\"index\":0}",
            ),
            ev(None, "line one\nline two"),
        ]
    }

    #[test]
    fn whole_stream_in_one_chunk() {
        assert_eq!(run(1 << 20, &[MESSAGES.as_bytes()]), messages_events());
    }

    #[test]
    fn split_at_every_byte_position() {
        let crlf = MESSAGES.replace('\n', "\r\n");
        let cr = MESSAGES.replace('\n', "\r");
        for stream in [MESSAGES, crlf.as_str(), cr.as_str()] {
            let bytes = stream.as_bytes();
            for i in 0..=bytes.len() {
                let (a, b) = bytes.split_at(i);
                assert_eq!(run(1 << 20, &[a, b]), messages_events(), "split at {i}");
            }
            let singles: Vec<&[u8]> = bytes.chunks(1).collect();
            assert_eq!(run(1 << 20, &singles), messages_events(), "byte by byte");
        }
    }

    #[test]
    fn merged_events_and_chat_completions_done() {
        let chunk = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[]}\n\ndata: [DONE]\n\n";
        assert_eq!(
            run(1024, &[chunk]),
            vec![
                ev(None, "{\"choices\":[{\"delta\":{\"content\":\"a\"}}]}"),
                ev(None, "{\"choices\":[]}"),
                ev(None, "[DONE]"),
            ]
        );
    }

    #[test]
    fn mixed_line_ends() {
        let out = run(
            1024,
            &[b"event: a\r\ndata: 1\r\rdata: 2\n\r\nevent: b\rdata: 3\r\n\n"],
        );
        assert_eq!(
            out,
            vec![ev(Some("a"), "1"), ev(None, "2"), ev(Some("b"), "3")]
        );
    }

    #[test]
    fn comments_and_heartbeats_alone_produce_nothing() {
        assert!(run(1024, &[b": keep-alive\n\n:\n\n: ping\r\n\r\n"]).is_empty());
    }

    #[test]
    fn field_rules() {
        // One leading space stripped, not two; a bare `data` is an empty data line;
        // an event without data is not returned and its name does not leak onward.
        let out = run(
            1024,
            &[b"data:  two\ndata\ndata:\n\nevent: lonely\n\ndata: x\n\nevent:\ndata: y\n\n"],
        );
        assert_eq!(
            out,
            vec![ev(None, " two\n\n"), ev(None, "x"), ev(None, "y")]
        );
        // Unknown and over-long field names are ignored, values may contain colons.
        let out = run(
            1024,
            &[b"id: 1\nretry: 5\nsomething_long_and_unknown: z\nDATA: no\ndata: a:b: c\n\n"],
        );
        assert_eq!(out, vec![ev(None, "a:b: c")]);
    }

    #[test]
    fn byte_order_mark_is_ignored_at_the_start_only() {
        let out = run(64, &[b"\xEF\xBB", b"\xBFevent: e\ndata: 1\n\n"]);
        assert_eq!(out, vec![ev(Some("e"), "1")]);
        let out = run(64, &[b"data: 1\n\n\xEF\xBB\xBFdata: 2\n\n"]);
        assert_eq!(out, vec![ev(None, "1")]);
    }

    #[test]
    fn invalid_utf8_is_replaced_lossily() {
        let out = run(64, &[b"event: \xFFe\ndata: a\xC3\x28b\n\n"]);
        assert_eq!(out, vec![ev(Some("\u{FFFD}e"), "a\u{FFFD}(b")]);
    }

    #[test]
    fn size_limit_is_exact() {
        // Joined data of exactly the limit (3 + '\n' + 4 = 8) passes, one more byte does not.
        assert_eq!(run(8, &[b"data: abc\ndata: defg\n\n"]).len(), 1);
        assert!(run(8, &[b"data: abc\ndata: defgh\n\n"]).is_empty());
        assert!(run(8, &[b"data: abcdefghi\n\n"]).is_empty());
        assert!(run(0, &[b"data: a\n\n"]).is_empty());
        assert_eq!(run(0, &[b"data:\n\n"]), vec![ev(None, "")]);
    }

    #[test]
    fn oversized_events_are_dropped_with_bounded_memory() {
        let max = 1024;
        let mut a = SseAssembler::new(max);
        let mut out = Vec::new();
        a.feed(b"event: big\ndata: ", &mut out);
        let block = vec![b'x'; 4096];
        for _ in 0..256 {
            a.feed(&block, &mut out);
            assert!(a.data.capacity() <= max, "capacity {}", a.data.capacity());
            assert!(a.event.capacity() <= EVENT_NAME_MAX);
        }
        // Further lines of the dropped event are ignored as well.
        a.feed(b"\ndata: more\n", &mut out);
        assert!(a.data.is_empty());
        a.feed(b"\nevent: small\ndata: ok\n\n", &mut out);
        assert_eq!(out, vec![ev(Some("small"), "ok")]);
        // Many lines that are each small but too big together.
        out.clear();
        for _ in 0..1000 {
            a.feed(b"data: 0123456789\n", &mut out);
            assert!(a.data.capacity() <= max);
        }
        a.feed(b"\ndata: after\n\n", &mut out);
        assert_eq!(out, vec![ev(None, "after")]);
    }

    #[test]
    fn over_long_event_names_drop_the_event() {
        let mut stream = b"event: ".to_vec();
        stream.extend(std::iter::repeat_n(b'n', EVENT_NAME_MAX + 1));
        stream.extend_from_slice(b"\ndata: x\n\nevent: ok\ndata: y\n\n");
        assert_eq!(run(1024, &[&stream]), vec![ev(Some("ok"), "y")]);
    }

    /// Cuts `bytes` at the given positions (taken modulo the length).
    fn cut<'a>(bytes: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
        let mut at: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        at.sort_unstable();
        let mut chunks = Vec::new();
        let mut from = 0;
        for a in at {
            chunks.push(&bytes[from..a]);
            from = a;
        }
        chunks.push(&bytes[from..]);
        chunks
    }

    /// Pieces that make arbitrary byte soup look like (broken) event streams.
    fn soup() -> impl Strategy<Value = Vec<u8>> {
        let piece = prop_oneof![
            Just(b"data:".to_vec()),
            Just(b"data: ".to_vec()),
            Just(b"event: ".to_vec()),
            Just(b"data".to_vec()),
            Just(b":".to_vec()),
            Just(b"\n".to_vec()),
            Just(b"\r".to_vec()),
            Just(b"\r\n".to_vec()),
            Just(b"\n\n".to_vec()),
            Just(b"\xEF\xBB\xBF".to_vec()),
            proptest::collection::vec(any::<u8>(), 0..12),
        ];
        proptest::collection::vec(piece, 0..80).prop_map(|v| v.concat())
    }

    #[derive(Clone, Debug)]
    struct Spec {
        event: Option<String>,
        lines: Vec<String>,
        space: bool,
    }

    fn spec() -> impl Strategy<Value = Spec> {
        (
            proptest::option::of("[a-z_.]{1,16}"),
            proptest::collection::vec("[^\r\n]{0,24}", 1..4),
            any::<bool>(),
        )
            .prop_map(|(event, lines, space)| Spec {
                event,
                lines,
                space,
            })
    }

    proptest! {
        #[test]
        fn never_panics_and_chunking_does_not_matter(
            bytes in soup(),
            cuts in proptest::collection::vec(any::<usize>(), 0..12),
            max in 0usize..64,
        ) {
            let whole = run(max, &[&bytes]);
            let chunked = run(max, &cut(&bytes, &cuts));
            prop_assert_eq!(&chunked, &whole);
            for e in &whole {
                prop_assert!(e.data.len() <= max || e.data.contains(char::REPLACEMENT_CHARACTER));
            }
        }

        #[test]
        fn reassembles_the_same_events_whatever_the_chunking(
            specs in proptest::collection::vec(spec(), 0..8),
            eol in prop_oneof![Just("\n"), Just("\r\n"), Just("\r")],
            comments in any::<bool>(),
            cuts in proptest::collection::vec(any::<usize>(), 0..16),
            max in 16usize..96,
        ) {
            let mut stream = String::new();
            let mut expected = Vec::new();
            for s in &specs {
                if comments {
                    stream.push_str(": keep-alive");
                    stream.push_str(eol);
                }
                if let Some(name) = &s.event {
                    stream.push_str("event: ");
                    stream.push_str(name);
                    stream.push_str(eol);
                }
                for line in &s.lines {
                    stream.push_str("data:");
                    if s.space || line.starts_with(' ') {
                        stream.push(' ');
                    }
                    stream.push_str(line);
                    stream.push_str(eol);
                }
                stream.push_str(eol);
                let data = s.lines.join("\n");
                if data.len() <= max {
                    expected.push(SseEvent { event: s.event.clone(), data });
                }
            }
            let bytes = stream.as_bytes();
            prop_assert_eq!(run(max, &cut(bytes, &cuts)), expected);
        }
    }
}

#[cfg(test)]
mod memory_bound_tests {
    //! Issue #8: the buffers of both trackers stay within their documented bounds on
    //! endless input (a line that never ends, or lines of an event that never ends),
    //! whatever the chunk sizes.
    use super::*;
    use proptest::prelude::*;

    /// How a line may start: data, an event name, a comment, an unknown or over-long
    /// field name, a byte order mark.
    fn start() -> impl Strategy<Value = &'static [u8]> {
        prop_oneof![
            Just(&b"data: "[..]),
            Just(&b"event: "[..]),
            Just(&b":"[..]),
            Just(&b"id: "[..]),
            Just(&b"data"[..]),
            Just(&b"\xEF\xBB\xBFdata:"[..]),
            Just(&b"something_long_and_unknown"[..]),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn buffers_stay_within_their_bounds_on_endless_input(
            start in start(),
            sizes in proptest::collection::vec(prop_oneof![4 => 1usize..64, 1 => 1usize..20_000], 1..60),
            fill in any::<u8>().prop_filter("no line end", |b| *b != b'\n' && *b != b'\r'),
            many_lines in any::<bool>(),
            max in prop_oneof![0usize..256, 0usize..4096],
        ) {
            let mut a = SseAssembler::new(max);
            let mut p = SseProgress::default();
            let mut out = Vec::new();
            a.feed(start, &mut out);
            p.feed(start);
            for (i, &n) in sizes.iter().enumerate() {
                let mut chunk = vec![fill; n];
                if many_lines && i % 2 == 1 {
                    // End the line and start another of the same event (never a blank
                    // line: each line has at least `start`).
                    chunk[n / 2] = b'\n';
                    chunk.extend_from_slice(start);
                }
                a.feed(&chunk, &mut out);
                prop_assert!(!p.feed(&chunk));
                prop_assert!(a.data.capacity() <= max, "data {} > {max}", a.data.capacity());
                // The name's length is capped; its capacity grows by doubling up to that.
                prop_assert!(a.event.len() <= EVENT_NAME_MAX);
                prop_assert!(a.event.capacity() <= 2 * EVENT_NAME_MAX, "event {}", a.event.capacity());
                prop_assert!(a.name.capacity() <= NAME_MAX, "name {}", a.name.capacity());
                prop_assert!(p.partial.len() <= KEEP);
                prop_assert!(p.partial.capacity() <= 2 * KEEP, "partial {}", p.partial.capacity());
            }
            prop_assert!(out.is_empty());
        }
    }
}
