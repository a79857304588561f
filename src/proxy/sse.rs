//! Server-sent-event progress tracking for the stall guard (SPEC §5.9).
//!
//! Upstream chunk boundaries are not event boundaries, so this keeps a little state
//! across chunks: whether the event being assembled carries data, and whether it is a
//! heartbeat (`event: ping`). Comments (`:` lines) and pings never count as progress;
//! any other event with a `data:` line does (reasoning/thinking deltas included). Only
//! the start of an unfinished line is kept (bounded), never the stream itself.

/// Longest line prefix kept across chunks: enough to read a field name and `ping`.
const KEEP: usize = 32;

#[derive(Debug, Default)]
pub struct SseProgress {
    partial: Vec<u8>,
    has_data: bool,
    is_ping: bool,
}

impl SseProgress {
    /// Feeds one upstream chunk; returns true when at least one content event completed.
    pub fn feed(&mut self, chunk: &[u8]) -> bool {
        let mut progress = false;
        let mut rest = chunk;
        while let Some(nl) = rest.iter().position(|b| *b == b'\n') {
            let (line, tail) = rest.split_at(nl);
            rest = &tail[1..];
            let complete: &[u8] = if self.partial.is_empty() {
                line
            } else {
                let room = KEEP.saturating_sub(self.partial.len());
                self.partial
                    .extend_from_slice(&line[..line.len().min(room)]);
                &self.partial
            };
            let complete = complete.strip_suffix(b"\r").unwrap_or(complete);
            if complete.is_empty() {
                if self.has_data && !self.is_ping {
                    progress = true;
                }
                self.has_data = false;
                self.is_ping = false;
            } else if complete.starts_with(b"data:") {
                self.has_data = true;
            } else if complete.starts_with(b"event:") {
                let name = complete[6..].trim_ascii();
                self.is_ping = name == b"ping";
            }
            self.partial.clear();
        }
        if !rest.is_empty() {
            let room = KEEP.saturating_sub(self.partial.len());
            self.partial
                .extend_from_slice(&rest[..rest.len().min(room)]);
        }
        progress
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
    fn long_lines_stay_bounded() {
        let mut p = SseProgress::default();
        let big = vec![b'x'; 100_000];
        assert!(!p.feed(b"data: "));
        assert!(!p.feed(&big));
        assert!(p.partial.len() <= KEEP);
        assert!(p.feed(b"\n\n"));
    }
}
