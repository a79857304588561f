//! Writing HTTP/1 on the way out: status and request lines, fields, chunk framing.
//!
//! Everything appends to a caller's buffer, so a head and a small body leave in one
//! send. Numbers are written digit by digit (no formatter on the hot path).

/// The end of a chunked body (the last chunk and an empty trailer section).
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// Appends `HTTP/1.1 <status> <reason>\r\n`.
pub fn status_line(out: &mut Vec<u8>, status: u16) {
    out.extend_from_slice(b"HTTP/1.1 ");
    decimal(out, u64::from(status));
    out.push(b' ');
    let reason = http::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Unknown");
    out.extend_from_slice(reason.as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Appends `<name>: <value>\r\n`.
pub fn field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.reserve(name.len() + value.len() + 4);
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Appends `<name>: <n>\r\n`.
pub fn field_number(out: &mut Vec<u8>, name: &[u8], n: u64) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    decimal(out, n);
    out.extend_from_slice(b"\r\n");
}

/// Appends `n` in decimal.
pub fn decimal(out: &mut Vec<u8>, n: u64) {
    let mut buf = [0u8; 20];
    out.extend_from_slice(digits(n, &mut buf));
}

/// `n` in decimal, written at the end of `buf` (two digits per division); the bytes
/// before it are left as they were.
pub fn digits(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    while n >= 100 {
        at -= 2;
        buf[at..at + 2].copy_from_slice(&two_digits(n));
        n /= 100;
    }
    if n >= 10 {
        at -= 2;
        buf[at..at + 2].copy_from_slice(&two_digits(n));
    } else {
        at -= 1;
        buf[at] = b'0' + n as u8;
    }
    &buf[at..]
}

/// The last two decimal digits of `n` ("07" for 7, "42" for 1942).
pub fn two_digits(n: u64) -> [u8; 2] {
    let at = (n % 100) as usize * 2;
    [PAIRS[at], PAIRS[at + 1]]
}

/// "00" to "99", the two digits of each number below 100.
const PAIRS: [u8; 200] = {
    let mut t = [0u8; 200];
    let mut i = 0;
    while i < 100 {
        t[2 * i] = b'0' + (i / 10) as u8;
        t[2 * i + 1] = b'0' + (i % 10) as u8;
        i += 1;
    }
    t
};

/// A chunk's size line (`<hex>\r\n`), without allocating.
pub struct ChunkLine {
    bytes: [u8; 18],
    start: usize,
}

impl ChunkLine {
    pub fn new(len: usize) -> ChunkLine {
        let mut bytes = [0u8; 18];
        bytes[16] = b'\r';
        bytes[17] = b'\n';
        let mut at = 16;
        let mut n = len as u64;
        loop {
            at -= 1;
            bytes[at] = b"0123456789abcdef"[(n & 0xf) as usize];
            n >>= 4;
            if n == 0 {
                break;
            }
        }
        ChunkLine { bytes, start: at }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[self.start..]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_digits_are_the_last_two() {
        for n in (0..=1_000).chain([u64::MAX - 1, u64::MAX]) {
            let want = format!("{:02}", n % 100);
            assert_eq!(two_digits(n), want.as_bytes(), "{n}");
        }
    }

    #[test]
    fn lines_fields_and_numbers() {
        let mut out = Vec::new();
        status_line(&mut out, 200);
        status_line(&mut out, 429);
        status_line(&mut out, 599);
        field(&mut out, b"Content-Type", b"application/json");
        field_number(&mut out, b"content-length", 0);
        field_number(&mut out, b"x", u64::MAX);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "HTTP/1.1 200 OK\r\nHTTP/1.1 429 Too Many Requests\r\nHTTP/1.1 599 Unknown\r\n\
             Content-Type: application/json\r\ncontent-length: 0\r\nx: 18446744073709551615\r\n"
        );
    }

    #[test]
    fn chunk_lines_are_lower_hex() {
        for (n, want) in [
            (0, "0\r\n"),
            (10, "a\r\n"),
            (4096, "1000\r\n"),
            (usize::MAX, "ffffffffffffffff\r\n"),
        ] {
            assert_eq!(ChunkLine::new(n).as_bytes(), want.as_bytes());
        }
    }
}
