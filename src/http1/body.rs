//! Body framing on the way in: a [`BodyReader`] takes a message's body out of a
//! connection's read buffer piece by piece, whatever the framing.
//!
//! Data is split off the buffer without a copy; framing bytes (chunk sizes, extensions,
//! trailers) are consumed and dropped. Invariants: a body is complete only when its
//! framing says so — the last chunk and the blank line after the trailers, or the
//! declared length — and a connection that closes earlier is [`BodyError::Truncated`];
//! a chunk-size line and the trailers are bounded, so a peer cannot make the reader
//! hold an unbounded line; bytes after the body stay in the buffer (the next message).

use super::head::BodyLen;
use bytes::{Buf, Bytes, BytesMut};

/// Longest chunk-size line (size, extensions, line end).
const MAX_SIZE_LINE: usize = 4096;
/// Most trailer bytes after the last chunk.
const MAX_TRAILERS: usize = 64 * 1024;

/// What the buffer gave.
#[derive(Debug, PartialEq, Eq)]
pub enum Piece {
    /// Body bytes.
    Data(Bytes),
    /// Nothing more until more bytes are read.
    More,
    /// The body is complete.
    End,
}

/// Why a body cannot be read to its end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyError {
    /// The chunked framing is broken (the reason).
    Chunked(&'static str),
    /// The connection closed before the body's framing ended.
    Truncated,
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::Chunked(why) => write!(f, "invalid chunked body: {why}"),
            BodyError::Truncated => f.write_str("the connection closed inside the body"),
        }
    }
}

/// The chunked decoder's place in the framing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Chunk {
    /// In a chunk-size line: the size so far, whether any digit was seen, `ws` after
    /// whitespace behind the digits (only `;` or the CR may follow), `ext` inside the
    /// extensions (skipped up to the CR; no control bytes).
    Size {
        size: u64,
        digits: bool,
        ws: bool,
        ext: bool,
    },
    /// After the size line's CR.
    SizeLf { size: u64 },
    /// Data bytes left in this chunk.
    Data(u64),
    /// The CRLF after a chunk's data: `cr` once the CR was seen.
    DataEnd { cr: bool },
    /// Trailer lines after the last chunk: `fresh` at the start of a line, `cr` after
    /// a CR at the start of a line.
    Trailers { fresh: bool, cr: bool },
}

/// One body's reader.
#[derive(Clone, Debug)]
pub struct BodyReader {
    state: State,
    /// Bytes of the current size line, or of the trailers so far.
    seen: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Length(u64),
    Chunked(Chunk),
    UntilClose,
    Done,
}

impl BodyReader {
    pub fn new(len: BodyLen) -> BodyReader {
        let state = match len {
            BodyLen::Empty | BodyLen::Length(0) => State::Done,
            BodyLen::Length(n) => State::Length(n),
            BodyLen::Chunked => State::Chunked(Chunk::Size {
                size: 0,
                digits: false,
                ws: false,
                ext: false,
            }),
            BodyLen::UntilClose => State::UntilClose,
        };
        BodyReader { state, seen: 0 }
    }

    /// The body has been read to its end.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Body bytes still expected, when the framing says how many.
    pub fn remaining(&self) -> Option<u64> {
        match self.state {
            State::Length(n) => Some(n),
            State::Done => Some(0),
            _ => None,
        }
    }

    /// Takes the next piece of the body from the front of `buf`.
    pub fn next(&mut self, buf: &mut BytesMut) -> Result<Piece, BodyError> {
        match self.state {
            State::Done => Ok(Piece::End),
            State::Length(left) => {
                if buf.is_empty() {
                    return Ok(Piece::More);
                }
                let n = (buf.len() as u64).min(left);
                self.state = if n == left {
                    State::Done
                } else {
                    State::Length(left - n)
                };
                Ok(Piece::Data(buf.split_to(n as usize).freeze()))
            }
            State::UntilClose => {
                if buf.is_empty() {
                    return Ok(Piece::More);
                }
                Ok(Piece::Data(buf.split().freeze()))
            }
            State::Chunked(_) => self.chunked(buf),
        }
    }

    /// The connection closed: the end of a body read until then, else truncation.
    pub fn closed(&mut self) -> Result<Piece, BodyError> {
        match self.state {
            State::UntilClose | State::Done => {
                self.state = State::Done;
                Ok(Piece::End)
            }
            _ => Err(BodyError::Truncated),
        }
    }

    fn chunked(&mut self, buf: &mut BytesMut) -> Result<Piece, BodyError> {
        let State::Chunked(mut at) = self.state else {
            return Ok(Piece::More);
        };
        // Framing bytes consumed so far (dropped from `buf` before returning).
        let mut used = 0;
        let piece = loop {
            if let Chunk::Data(left) = at {
                buf.advance(used);
                used = 0;
                if buf.is_empty() {
                    break Piece::More;
                }
                let n = (buf.len() as u64).min(left);
                at = if n == left {
                    Chunk::DataEnd { cr: false }
                } else {
                    Chunk::Data(left - n)
                };
                self.state = State::Chunked(at);
                return Ok(Piece::Data(buf.split_to(n as usize).freeze()));
            }
            let Some(&b) = buf.get(used) else {
                break Piece::More;
            };
            used += 1;
            at = match at {
                Chunk::Size {
                    size,
                    digits,
                    ws,
                    ext,
                } => {
                    self.seen += 1;
                    if self.seen > MAX_SIZE_LINE {
                        return Err(BodyError::Chunked("chunk-size line too long"));
                    }
                    match b {
                        b'\r' if digits => Chunk::SizeLf { size },
                        b'\n' => {
                            return Err(BodyError::Chunked("chunk-size line not ended by CRLF"))
                        }
                        _ if ext && (b == 0x7f || (b < 0x20 && b != b'\t')) => {
                            return Err(BodyError::Chunked("control byte in a chunk extension"))
                        }
                        _ if ext => at,
                        b';' if digits => Chunk::Size {
                            size,
                            digits,
                            ws: false,
                            ext: true,
                        },
                        b' ' | b'\t' if digits => Chunk::Size {
                            size,
                            digits,
                            ws: true,
                            ext: false,
                        },
                        _ if ws => {
                            return Err(BodyError::Chunked("only `;` may follow a chunk size"))
                        }
                        _ => {
                            let d = (b as char)
                                .to_digit(16)
                                .ok_or(BodyError::Chunked("invalid chunk size"))?;
                            if size > u64::MAX >> 4 {
                                return Err(BodyError::Chunked("chunk size too large"));
                            }
                            Chunk::Size {
                                size: size << 4 | u64::from(d),
                                digits: true,
                                ws: false,
                                ext: false,
                            }
                        }
                    }
                }
                Chunk::SizeLf { size } => match b {
                    b'\n' => self.size_done(size),
                    _ => return Err(BodyError::Chunked("CR without LF after a chunk size")),
                },
                // Taken before any byte is read, above.
                Chunk::Data(left) => Chunk::Data(left),
                Chunk::DataEnd { cr } => match (cr, b) {
                    (false, b'\r') => Chunk::DataEnd { cr: true },
                    (true, b'\n') => {
                        self.seen = 0;
                        Chunk::Size {
                            size: 0,
                            digits: false,
                            ws: false,
                            ext: false,
                        }
                    }
                    _ => return Err(BodyError::Chunked("chunk data not followed by CRLF")),
                },
                Chunk::Trailers { fresh, cr } => {
                    self.seen += 1;
                    if self.seen > MAX_TRAILERS {
                        return Err(BodyError::Chunked("trailers too long"));
                    }
                    // Every line ends with CRLF; an empty one ends the trailers.
                    match (cr, b) {
                        (true, b'\n') if fresh => {
                            buf.advance(used);
                            self.state = State::Done;
                            return Ok(Piece::End);
                        }
                        (true, b'\n') => Chunk::Trailers {
                            fresh: true,
                            cr: false,
                        },
                        (true, _) => {
                            return Err(BodyError::Chunked("CR without LF in the trailers"))
                        }
                        (false, b'\r') => Chunk::Trailers { fresh, cr: true },
                        (false, b'\n') => {
                            return Err(BodyError::Chunked("trailer line not ended by CRLF"))
                        }
                        (false, _) => Chunk::Trailers {
                            fresh: false,
                            cr: false,
                        },
                    }
                }
            };
        };
        buf.advance(used);
        self.state = State::Chunked(at);
        Ok(piece)
    }

    /// The size line ended: data follows, or the trailers after the last chunk.
    fn size_done(&mut self, size: u64) -> Chunk {
        self.seen = 0;
        if size == 0 {
            Chunk::Trailers {
                fresh: true,
                cr: false,
            }
        } else {
            Chunk::Data(size)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Feeds `wire` to a reader in the given pieces; the body and whether it ended.
    fn read(len: BodyLen, pieces: &[&[u8]]) -> Result<(Vec<u8>, bool, Vec<u8>), BodyError> {
        let mut r = BodyReader::new(len);
        let mut buf = BytesMut::new();
        let mut body = Vec::new();
        for p in pieces {
            buf.extend_from_slice(p);
            loop {
                match r.next(&mut buf)? {
                    Piece::Data(d) => body.extend_from_slice(&d),
                    Piece::More => break,
                    Piece::End => return Ok((body, true, buf.to_vec())),
                }
            }
        }
        Ok((body, false, buf.to_vec()))
    }

    #[test]
    fn chunked_bodies_with_extensions_trailers_and_what_follows() {
        let wire = b"5;name=val\r\nhello\r\n1 \r\n \r\n0\r\nX-Trailer: t\r\n\r\nNEXT";
        let (body, ended, rest) = read(BodyLen::Chunked, &[wire]).unwrap();
        assert_eq!(
            (body.as_slice(), ended, rest.as_slice()),
            (&b"hello "[..], true, &b"NEXT"[..])
        );
        let (body, ended, _) =
            read(BodyLen::Chunked, &[b"3 ;a=\"b c\"\t\r\nabc\r\n0\r\n\r\n"]).unwrap();
        assert_eq!((body.as_slice(), ended), (&b"abc"[..], true));
        let (body, ended, _) = read(BodyLen::Chunked, &[b"A\r\n0123456789\r\n0\r\n\r\n"]).unwrap();
        assert_eq!((body.len(), ended), (10, true));
    }

    #[test]
    fn broken_chunked_framing_is_an_error() {
        for bad in [
            &b"x\r\n"[..],
            b"\r\n",
            b"5\r\nhelloXX",
            b"5\rX",
            b"11111111111111111\r\n",
            b"0\r\n\rX",
            // Bare LF anywhere in the framing: a front end that wants CRLF would find
            // other message boundaries (request smuggling).
            b"3\nabc\r\n0\r\n\r\n",
            b"3\r\nabc\n0\r\n\r\n",
            b"3\r\nabc\r\n0\r\n\n",
            b"3;x\nabc\r\n",
            b"0\r\nX-T: t\n\r\n",
            // Anything but `;` after the size's whitespace, and control bytes in an
            // extension.
            b"d 0\r\n",
            b"3;a\x00b\r\nabc\r\n",
        ] {
            assert!(
                matches!(read(BodyLen::Chunked, &[bad]), Err(BodyError::Chunked(_))),
                "{bad:?}"
            );
        }
        let long = vec![b'1'; 1]
            .into_iter()
            .chain(vec![b' '; MAX_SIZE_LINE])
            .collect::<Vec<_>>();
        assert!(read(BodyLen::Chunked, &[&long]).is_err());
        let mut trailers = b"0\r\n".to_vec();
        trailers.extend(std::iter::repeat_n(b'a', MAX_TRAILERS + 1));
        assert!(read(BodyLen::Chunked, &[&trailers]).is_err());
    }

    #[test]
    fn lengths_stop_at_their_end_and_a_close_is_truncation_unless_it_frames() {
        let (body, ended, rest) = read(BodyLen::Length(3), &[b"ab", b"cde"]).unwrap();
        assert_eq!(
            (body.as_slice(), ended, rest.as_slice()),
            (&b"abc"[..], true, &b"de"[..])
        );
        let mut r = BodyReader::new(BodyLen::Length(3));
        assert_eq!(r.remaining(), Some(3));
        assert_eq!(r.closed(), Err(BodyError::Truncated));
        let mut r = BodyReader::new(BodyLen::UntilClose);
        let mut buf = BytesMut::from(&b"abc"[..]);
        assert_eq!(
            r.next(&mut buf),
            Ok(Piece::Data(Bytes::from_static(b"abc")))
        );
        assert_eq!(r.next(&mut buf), Ok(Piece::More));
        assert_eq!(r.closed(), Ok(Piece::End));
        assert!(r.is_done());
        let mut r = BodyReader::new(BodyLen::Chunked);
        assert_eq!(r.closed(), Err(BodyError::Truncated));
        assert!(BodyReader::new(BodyLen::Empty).is_done());
        assert!(BodyReader::new(BodyLen::Length(0)).is_done());
    }

    /// `body` chunked in pieces of the given sizes, with the last chunk and a trailer.
    fn encode(body: &[u8], sizes: &[usize]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut at = 0;
        for &s in sizes.iter().chain(std::iter::once(&usize::MAX)) {
            let n = s.max(1).min(body.len() - at);
            if n == 0 {
                break;
            }
            out.extend_from_slice(format!("{n:x}\r\n").as_bytes());
            out.extend_from_slice(&body[at..at + n]);
            out.extend_from_slice(b"\r\n");
            at += n;
        }
        out.extend_from_slice(b"0\r\nx: y\r\n\r\n");
        out
    }

    proptest! {
        #[test]
        fn any_chunking_cut_anywhere_gives_the_body_back(
            body in proptest::collection::vec(any::<u8>(), 0..600),
            sizes in proptest::collection::vec(1usize..90, 0..12),
            cuts in proptest::collection::vec(0usize..2000, 0..12),
        ) {
            let wire = encode(&body, &sizes);
            let mut at: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
            at.sort_unstable();
            let mut pieces = Vec::new();
            let mut prev = 0;
            for c in at.into_iter().chain(std::iter::once(wire.len())) {
                pieces.push(&wire[prev..c]);
                prev = c;
            }
            let (got, ended, rest) = read(BodyLen::Chunked, &pieces).unwrap();
            prop_assert!(ended);
            prop_assert_eq!(got, body);
            prop_assert!(rest.is_empty());
        }

        #[test]
        fn arbitrary_bytes_never_panic_and_truncation_is_never_an_end(
            wire in proptest::collection::vec(any::<u8>(), 0..400),
        ) {
            let mut r = BodyReader::new(BodyLen::Chunked);
            let mut buf = BytesMut::from(&wire[..]);
            let mut ended = false;
            while let Ok(p) = r.next(&mut buf) {
                match p {
                    Piece::Data(_) => {}
                    Piece::More => break,
                    Piece::End => { ended = true; break; }
                }
            }
            if !ended {
                prop_assert!(r.closed().is_err());
            }
        }
    }
}
