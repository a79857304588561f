//! Where a forwarded SSE byte stream stands relative to event boundaries, so that an
//! error event appended after a failure starts on a boundary (SPEC §2 stream).
//!
//! The tracker sees every byte sent to the client and keeps four bits: inside a line,
//! whether that line is a comment, inside an event (a non-comment line since the last
//! blank line), and whether the last byte was a CR (whose LF, if it came next, would
//! belong to the same line end); a chunk that ends in a blank line leaves all four
//! clear, so it is not read byte by byte. From
//! those it knows the bytes that end a partial event — so the error event is never glued
//! onto a half line, and parses on its own — and whether the upstream stopped mid-event.
//! It keeps no bytes of the stream.

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventBoundary {
    mid_line: bool,
    /// The current line started with `:` (a comment opens no event).
    comment: bool,
    event_open: bool,
    after_cr: bool,
}

impl EventBoundary {
    /// Follows the bytes that were sent to the client. It jumps from line end to line
    /// end: a run of other bytes only matters by its first byte.
    pub fn feed(&mut self, chunk: &[u8]) {
        // Upstreams mostly send whole events. A chunk ending in a blank line (LF LF, or
        // CR LF CR LF) leaves no line, event or CR open whatever came before it, so it
        // needs no scan: the second-to-last line end closed any line, the last one is a
        // blank line, and no CR is left waiting for its LF.
        if chunk.ends_with(b"\n\n") || chunk.ends_with(b"\r\n\r\n") {
            *self = EventBoundary::default();
            return;
        }
        let mut rest = chunk;
        while let Some(&first) = rest.first() {
            let end = memchr::memchr2(b'\n', b'\r', rest);
            if first != b'\n' && first != b'\r' {
                self.after_cr = false;
                if !self.mid_line {
                    self.mid_line = true;
                    self.comment = first == b':';
                }
            }
            let Some(i) = end else { return };
            match rest[i] {
                b'\n' if self.after_cr => self.after_cr = false,
                b => {
                    self.after_cr = b == b'\r';
                    self.line_end();
                }
            }
            rest = &rest[i + 1..];
        }
    }

    fn line_end(&mut self) {
        if self.mid_line {
            self.event_open |= !self.comment;
            self.mid_line = false;
            // Only a line in progress has a kind.
            self.comment = false;
        } else {
            // A blank line dispatches (or discards) the event.
            self.event_open = false;
        }
    }

    /// True when the stream stopped inside an event (or a line).
    pub fn is_mid_event(&self) -> bool {
        self.mid_line || self.event_open
    }

    /// The bytes that end the partial event, so the next byte starts a new one.
    pub fn terminator(&self) -> &'static [u8] {
        match (self.mid_line, self.event_open, self.after_cr) {
            // End the line, then the event.
            (true, _, _) => b"\n\n",
            // A LF right after a CR would only finish that CR's line end.
            (false, true, true) => b"\n\n",
            (false, true, false) => b"\n",
            // A bare comment line ends with a blank line too; otherwise nothing is open.
            (false, false, _) => b"",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn after(chunks: &[&[u8]]) -> EventBoundary {
        let mut b = EventBoundary::default();
        for c in chunks {
            b.feed(c);
        }
        b
    }

    /// Chunks fed, the terminator expected, and whether that is mid-event.
    type Row = (&'static [&'static [u8]], &'static [u8], bool);

    /// The byte-at-a-time reading `feed` must agree with.
    fn feed_bytewise(t: &mut EventBoundary, chunk: &[u8]) {
        for &b in chunk {
            match b {
                b'\n' if t.after_cr => t.after_cr = false,
                b'\n' | b'\r' => {
                    t.after_cr = b == b'\r';
                    t.line_end();
                }
                _ => {
                    t.after_cr = false;
                    if !t.mid_line {
                        t.mid_line = true;
                        t.comment = b == b':';
                    }
                }
            }
        }
    }

    #[test]
    fn line_end_jumps_agree_with_a_byte_at_a_time_reading() {
        // Streams over an alphabet of line ends, colons and text, split at every point.
        let alphabet = b"\n\r:ad ";
        let mut seed = 0x9e37_79b9_u32;
        for _ in 0..400 {
            let len = (seed % 24) as usize;
            let stream: Vec<u8> = (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 17;
                    seed ^= seed << 5;
                    alphabet[(seed % alphabet.len() as u32) as usize]
                })
                .collect();
            for cut in 0..=stream.len() {
                let (a, b) = stream.split_at(cut);
                let mut fast = EventBoundary::default();
                let mut slow = EventBoundary::default();
                fast.feed(a);
                fast.feed(b);
                feed_bytewise(&mut slow, a);
                feed_bytewise(&mut slow, b);
                assert_eq!(fast, slow, "{stream:?} cut at {cut}");
            }
            seed = seed.wrapping_mul(747_796_405).wrapping_add(1);
        }
    }

    #[test]
    fn terminators_by_position() {
        let rows: [Row; 13] = [
            (&[], b"", false),
            (&[b"data: {}\n\n"], b"", false),
            (&[b"data: {\"a\":"], b"\n\n", true),
            (&[b"event: x\ndata: {}\n"], b"\n", true),
            (&[b"event: x\r\ndata: {}\r\n"], b"\n", true),
            (&[b"event: x\r\ndata: {}\r"], b"\n\n", true),
            (&[b"event: x\r\ndata: {}\r\n\r\n"], b"", false),
            (&[b"data: a\r", b"\n"], b"\n", true),
            (&[b"data: a\r\r"], b"", false),
            (&[b": keep-alive\n"], b"", false),
            // Chunks that end in a blank line, after a line left open or a CR.
            (&[b"data: a\r", b"\n\n"], b"", false),
            (&[b"data: {\"a\":", b"1}\r\n\r\n"], b"", false),
            (&[b"data: x\n\n", b"data: y\n"], b"\n", true),
        ];
        for (chunks, term, mid) in rows {
            let b = after(chunks);
            assert_eq!(b.terminator(), term, "{chunks:?}");
            assert_eq!(b.is_mid_event(), mid, "{chunks:?}");
        }
    }

    #[test]
    fn a_terminated_partial_event_leaves_a_boundary() {
        for chunks in [
            &[&b"data: {\"a\""[..]][..],
            &[b"event: e\r\ndata: x\r\n"],
            &[b"data: x\n", b"data: y"],
            &[b"data: x\r"],
        ] {
            let mut b = after(chunks);
            b.feed(b.terminator());
            assert!(!b.is_mid_event(), "{chunks:?}");
            assert_eq!(b.terminator(), b"", "{chunks:?}");
        }
    }

    #[test]
    fn split_anywhere_gives_the_same_answer() {
        let stream = b"event: a\r\ndata: {\"x\":1}\r\n\r\n: c\ndata: half";
        let whole = after(&[stream]);
        for i in 0..stream.len() {
            let (x, y) = stream.split_at(i);
            assert_eq!(after(&[x, y]), whole, "split at {i}");
        }
        assert_eq!(whole.terminator(), b"\n\n");
    }
}
