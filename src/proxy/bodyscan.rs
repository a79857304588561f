//! One pass over a request body that finds its top-level `model` string and `stream`
//! flag and checks that the whole body is well-formed JSON — the common case of
//! admission, at a fraction of what serde_json's typed parse costs (bench/RESULTS.md,
//! 2026-12-05 evening).
//!
//! It is stricter than serde_json on purpose, and answers only for bodies it fully
//! understands: valid UTF-8, a top-level object, each top-level key once and without
//! escapes, `model` a non-empty string without escapes, `stream` absent or a literal
//! (`true`, `false`, `null`), nesting no deeper than [`MAX_DEPTH`]. For anything else it
//! returns `None` and the caller parses with serde_json, so every error message, and the
//! verdict on every body it does not take, stay serde_json's. Invariant: when it answers,
//! serde_json accepts the same bytes and reads the same `model` and `stream` from them.

/// Deepest nesting the scan follows (serde_json allows 128); deeper bodies go to serde.
const MAX_DEPTH: usize = 64;

/// What the scan found at the top level.
#[derive(Debug, PartialEq, Eq)]
pub struct Top {
    /// Byte range of the `model` value, its quotes included.
    pub model: (usize, usize),
    /// `stream`, `false` when absent or `null`.
    pub stream: bool,
}

/// The top level of `raw`, or `None` when the body is not one the scan takes.
pub fn scan(raw: &[u8]) -> Option<Top> {
    std::str::from_utf8(raw).ok()?;
    let mut s = Scanner { b: raw, i: 0 };
    let mut model = None;
    let mut stream = None;
    s.ws();
    s.eat(b'{')?;
    s.ws();
    if s.peek() == Some(b'}') {
        s.i += 1;
    } else {
        loop {
            s.ws();
            let key = s.plain_string()?;
            s.ws();
            s.eat(b':')?;
            s.ws();
            match &raw[key.0 + 1..key.1 - 1] {
                b"model" if model.is_none() => model = Some(s.plain_string()?),
                b"stream" if stream.is_none() => stream = Some(s.literal()?),
                b"model" | b"stream" => return None,
                _ => s.value(1)?,
            }
            s.ws();
            match s.next()? {
                b',' => {}
                b'}' => break,
                _ => return None,
            }
        }
    }
    s.ws();
    let model = model.filter(|(a, b)| b - a > 2)?;
    (s.i == raw.len()).then_some(Top {
        model,
        stream: stream.unwrap_or(false),
    })
}

/// The bytes that end a string's run of ordinary bytes: the quote, the backslash and
/// the control bytes (which JSON does not allow in a string).
const SPECIAL: [bool; 256] = {
    let mut t = [false; 256];
    let mut c = 0;
    while c < 0x20 {
        t[c] = true;
        c += 1;
    }
    t[b'"' as usize] = true;
    t[b'\\' as usize] = true;
    t
};

/// Whether `s` can stand between a JSON string's quotes as it is (nothing to escape).
pub fn plain(s: &[u8]) -> bool {
    first_special(s).is_none()
}

/// Where the first special byte of `s` is, eight bytes at a time: most of a coding
/// agent's body is string content, which a byte-by-byte table walk crossed at ~7
/// instructions a byte (bench/RESULTS.md, 2026-12-07, twelfth session). Inlined, so a
/// string's scan keeps the word constants in registers from one stop to the next.
#[inline(always)]
fn first_special(s: &[u8]) -> Option<usize> {
    let mut at = 0;
    while let Some(w) = s.get(at..at + 8).and_then(|w| <[u8; 8]>::try_from(w).ok()) {
        let m = special_lanes(u64::from_le_bytes(w));
        if m != 0 {
            return Some(at + (m.trailing_zeros() / 8) as usize);
        }
        at += 8;
    }
    s[at..]
        .iter()
        .position(|&c| SPECIAL[c as usize])
        .map(|n| at + n)
}

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGH: u64 = 0x8080_8080_8080_8080;

/// The high bit of each byte lane of `w` (little-endian) that may be special. The lowest
/// marked lane always is: a lane is marked wrongly only by a borrow out of a lower lane
/// that is itself marked rightly, so the first special byte is the lowest mark.
fn special_lanes(w: u64) -> u64 {
    // A lane of `x` is zero: `x - 1` borrows there and its high bit was clear.
    let zero = |x: u64| x.wrapping_sub(ONES) & !x;
    let quote = zero(w ^ (ONES * b'"' as u64));
    let backslash = zero(w ^ (ONES * b'\\' as u64));
    // A lane below 0x20: subtracting 0x20 borrows there, and its high bit was clear.
    let control = w.wrapping_sub(ONES * 0x20) & !w;
    (quote | backslash | control) & HIGH
}

struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
}

impl Scanner<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.next()? == c).then_some(())
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    /// Past the string's ordinary bytes and the first special one, which it returns.
    fn special(&mut self) -> Option<u8> {
        let rest = &self.b[self.i..];
        let n = first_special(rest)?;
        self.i += n + 1;
        Some(rest[n])
    }

    /// A string without escapes; its range, quotes included.
    fn plain_string(&mut self) -> Option<(usize, usize)> {
        let start = self.i;
        self.eat(b'"')?;
        (self.special()? == b'"').then_some((start, self.i))
    }

    /// `true`, `false` or `null` (`false`).
    fn literal(&mut self) -> Option<bool> {
        let rest = &self.b[self.i..];
        let (word, value): (&[u8], bool) = match rest.first()? {
            b't' => (b"true", true),
            b'f' => (b"false", false),
            b'n' => (b"null", false),
            _ => return None,
        };
        rest.starts_with(word).then(|| {
            self.i += word.len();
            value
        })
    }

    /// Any JSON value, nested `depth` deep.
    fn value(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        match self.peek()? {
            b'"' => self.string(),
            b'{' => self.container(b'}', depth, true),
            b'[' => self.container(b']', depth, false),
            b'-' | b'0'..=b'9' => self.number(),
            _ => self.literal().map(drop),
        }
    }

    /// An object (`keyed`) or an array, up to its `close`.
    fn container(&mut self, close: u8, depth: usize, keyed: bool) -> Option<()> {
        self.i += 1;
        self.ws();
        if self.peek() == Some(close) {
            self.i += 1;
            return Some(());
        }
        loop {
            self.ws();
            if keyed {
                self.string()?;
                self.ws();
                self.eat(b':')?;
                self.ws();
            }
            self.value(depth + 1)?;
            self.ws();
            match self.next()? {
                b',' => {}
                c if c == close => return Some(()),
                _ => return None,
            }
        }
    }

    /// A string: escapes as JSON has them, no control bytes. One loop from stop to stop
    /// (a quote, a backslash or a control byte): a file quoted in a body stops at every
    /// line's `\n`, every ~11 bytes in the bench's agent body.
    fn string(&mut self) -> Option<()> {
        self.eat(b'"')?;
        let b = self.b;
        let mut i = self.i;
        loop {
            i += first_special(&b[i..])?;
            match b[i] {
                b'"' => {
                    self.i = i + 1;
                    return Some(());
                }
                b'\\' => match *b.get(i + 1)? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => i += 2,
                    b'u' => {
                        let hex = b.get(i + 2..i + 6)?;
                        if !hex.iter().all(u8::is_ascii_hexdigit) {
                            return None;
                        }
                        i += 6;
                    }
                    _ => return None,
                },
                _ => return None,
            }
        }
    }

    /// `-`? (`0` | [1-9][0-9]*) (`.` [0-9]+)? ([eE] [+-]? [0-9]+)?
    fn number(&mut self) -> Option<()> {
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        match self.next()? {
            b'0' => {}
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.i += 1;
            self.first_digit()?;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.i += 1;
            }
            self.first_digit()?;
        }
        Some(())
    }

    /// At least one digit.
    fn first_digit(&mut self) -> Option<()> {
        self.next().filter(u8::is_ascii_digit)?;
        self.digits();
        Some(())
    }

    fn digits(&mut self) {
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{scan, Top};
    use rand::{Rng, SeedableRng};
    use serde::Deserialize;

    /// serde_json's reading of the same body, as admission did it before the scan.
    #[derive(Deserialize)]
    struct Probe {
        model: Option<serde_json::Value>,
        stream: Option<serde_json::Value>,
    }

    fn serde_reads(raw: &[u8]) -> Option<(String, bool)> {
        let p: Probe = serde_json::from_slice(raw).ok()?;
        let model = p.model?.as_str()?.to_owned();
        let stream = match p.stream {
            None | Some(serde_json::Value::Null) => false,
            Some(serde_json::Value::Bool(b)) => b,
            Some(_) => return None,
        };
        Some((model, stream))
    }

    /// When the scan answers, serde_json agrees on the model and the stream flag.
    fn agrees(raw: &[u8]) -> bool {
        match scan(raw) {
            None => true,
            Some(Top { model, stream }) => {
                let ours = std::str::from_utf8(&raw[model.0 + 1..model.1 - 1]).unwrap();
                serde_reads(raw) == Some((ours.to_owned(), stream))
            }
        }
    }

    /// The special bytes as the table has them, one at a time.
    fn first_special_bytewise(s: &[u8]) -> Option<usize> {
        s.iter().position(|&c| super::SPECIAL[c as usize])
    }

    #[test]
    fn finds_the_first_special_byte_eight_at_a_time() {
        // Every byte value at every place of a word and of the tail, among neighbours of
        // each kind: a borrow out of a lane, or a high bit, must not hide or fake a mark.
        let neighbours = [
            b'a', b' ', b'!', b'#', b'[', b']', 0x7f, 0x80, 0xa2, 0xdc, 0xff,
        ];
        for n in neighbours {
            for len in [1, 7, 8, 9, 16, 23] {
                for at in 0..len {
                    for b in 0..=255u8 {
                        let mut s = vec![n; len];
                        s[at] = b;
                        assert_eq!(
                            super::first_special(&s),
                            first_special_bytewise(&s),
                            "{s:?}"
                        );
                    }
                }
            }
        }
        // Several special bytes in one word, in random places and kinds.
        let alphabet = [
            0u8, 0x01, 0x1f, 0x20, 0x21, b'"', 0x23, b'\\', 0x5d, b'a', 0x7f, 0x80, 0xa2, 0xdc,
            0xff,
        ];
        let mut rng = rand::rngs::StdRng::seed_from_u64(17);
        for _ in 0..200_000 {
            let len = rng.gen_range(0..40);
            let s: Vec<u8> = (0..len)
                .map(|_| alphabet[rng.gen_range(0..alphabet.len())])
                .collect();
            assert_eq!(
                super::first_special(&s),
                first_special_bytewise(&s),
                "{s:?}"
            );
        }
    }

    #[test]
    fn finds_the_model_span_and_the_stream_flag() {
        let raw = br#" { "messages":[{"role":"user","content":"say \"model\": x \u00e9"}], "model" : "smart","stream":true,"n":-1.5e+3,"z":{"model":"inner"}} "#;
        let top = scan(raw).unwrap();
        assert_eq!(&raw[top.model.0..top.model.1], br#""smart""#);
        assert!(top.stream);
        assert_eq!(
            scan(br#"{"model":"m","stream":null}"#),
            Some(Top {
                model: (9, 12),
                stream: false
            })
        );
    }

    #[test]
    fn leaves_to_serde_what_it_does_not_fully_understand() {
        for raw in [
            &br#"{"model":"a","model":"b"}"#[..],
            br#"{"mod\u0065l":"m"}"#,
            br#"{"model":"m\"x"}"#,
            br#"{"model":""}"#,
            br#"{"model":3}"#,
            br#"{"model":"m","stream":"yes"}"#,
            br#"{"model":"m","stream":1}"#,
            br#"{"model":"m",}"#,
            br#"{"model":"m"} x"#,
            br#"{"model":"m","x":01}"#,
            br#"{"model":"m","x":1.}"#,
            br#"{"model":"m","x":-}"#,
            br#"{"model":"m","x":"\x"}"#,
            br#"{"model":"m","x":"\u12g4"}"#,
            br#"{"model":"m","x":[1,]}"#,
            br#"{"model":"m","x":tru}"#,
            b"{\"model\":\"m\",\"x\":\"a\x01b\"}",
            b"{\"model\":\"m\",\"x\":\"\xff\"}",
            b"\xef\xbb\xbf{\"model\":\"m\"}",
            br#"["model"]"#,
            br#"{"stream":true}"#,
        ] {
            assert_eq!(scan(raw), None, "{}", String::from_utf8_lossy(raw));
        }
        let deep = format!(
            r#"{{"model":"m","x":{}1{}}}"#,
            "[".repeat(70),
            "]".repeat(70)
        );
        assert_eq!(scan(deep.as_bytes()), None);
    }

    #[test]
    fn never_takes_a_body_serde_json_would_read_differently() {
        let seeds: [&[u8]; 5] = [
            br#"{"model":"bench","stream":false,"messages":[{"role":"user","content":"Say hello in five words."}]}"#,
            br#"{"model":"m","messages":[{"role":"user","content":"use std::io;\n\n/// Reads \"it\".\npub fn read() -> io::Result<String> {\n\tlet mut s = String::new();\n\tio::stdin().read_line(&mut s)?;\n\tOk(s) // \u00e9t\u00e9 \\ \/ \b\f\r done\n}\n"}],"stream":false}"#,
            br#"{ "max_tokens": 1024, "model" : "claude-x", "stream" : true, "system": [ {"type":"text","text":"a\n\"b\"\u00e9"} ], "t": -0.5e-3, "n": null }"#,
            br#"{"model":"m","tools":[{"name":"f","input_schema":{"type":"object","properties":{"a":{"type":["string","null"]}}}}],"x":[[],{},[{}],1E9,0,true,false]}"#,
            br#"{"stream":null,"model":"m"}"#,
        ];
        let alphabet = b"{}[]\":,\\ 0123456789.-+eEtrufalsnm\x01\t\n\xc3\xa9\xff";
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let mut taken = 0;
        for seed in seeds {
            assert!(agrees(seed) && scan(seed).is_some());
            for _ in 0..20_000 {
                let mut b = seed.to_vec();
                for _ in 0..rng.gen_range(1..=3) {
                    let at = rng.gen_range(0..=b.len());
                    let c = alphabet[rng.gen_range(0..alphabet.len())];
                    match rng.gen_range(0..3) {
                        0 if at < b.len() => b[at] = c,
                        1 if at < b.len() => {
                            b.remove(at);
                        }
                        _ => b.insert(at, c),
                    }
                }
                assert!(agrees(&b), "{}", String::from_utf8_lossy(&b));
                taken += usize::from(scan(&b).is_some());
            }
        }
        // The mutations are not all rejections: the scan answered for many of them.
        assert!(taken > 1_000, "{taken}");
    }
}
