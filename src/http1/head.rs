//! Message heads: the request or status line and the header fields, as received.
//!
//! A [`Head`] owns a copy of the header block (a few hundred bytes: copying it keeps the
//! connection's read buffer free for the body and the next request) and the spans of its
//! fields. Lookups compare names case-insensitively; nothing is re-cased. A head also
//! keeps a 64-bit summary of its names (one bit per length and last letter), so a
//! lookup of a name it does not hold — most of them: rate-limit and session fields a
//! client or upstream did not send — answers without a scan.
//! Request and response heads also carry what the framing fields mean for the body and
//! for the connection, decided once at parse time.

use bytes::Bytes;
use std::mem::MaybeUninit;

/// Header fields at most per message (more is a malformed message).
pub const MAX_FIELDS: usize = 256;

/// A byte range of a head.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Span {
    start: u32,
    end: u32,
}

impl Span {
    /// The span of `part`, a slice of `whole`.
    fn of(whole: &[u8], part: &[u8]) -> Span {
        let start = part.as_ptr() as usize - whole.as_ptr() as usize;
        Span {
            start: start as u32,
            end: (start + part.len()) as u32,
        }
    }

    fn range(self) -> std::ops::Range<usize> {
        self.start as usize..self.end as usize
    }

    fn len(self) -> usize {
        (self.end - self.start) as usize
    }
}

/// The bit of a field name in a head's name summary: from its length and last byte, in
/// any case. Equal names (ignoring case) always have the same bit.
fn name_bit(name: &[u8]) -> u64 {
    let last = name.last().map_or(0, |b| b.to_ascii_lowercase());
    1 << ((name.len() as u32)
        .wrapping_mul(7)
        .wrapping_add(u32::from(last))
        & 63)
}

/// Why a head could not be taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadError {
    /// Not an HTTP/1 message head (the parser's reason).
    Malformed(&'static str),
    /// Its framing fields contradict each other or cannot be read.
    Framing(&'static str),
}

impl HeadError {
    pub fn reason(self) -> &'static str {
        match self {
            HeadError::Malformed(r) | HeadError::Framing(r) => r,
        }
    }
}

impl std::fmt::Display for HeadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.reason())
    }
}

/// How a message's body is delimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyLen {
    /// No body at all.
    Empty,
    /// Exactly this many bytes.
    Length(u64),
    /// Chunked transfer coding.
    Chunked,
    /// Everything until the connection closes (responses only).
    UntilClose,
}

/// A header block as received, with the spans of its fields.
#[derive(Clone, Debug)]
pub struct Head {
    bytes: Bytes,
    fields: Vec<(Span, Span)>,
    /// The union of the names' [`name_bit`]s.
    names: u64,
}

impl Head {
    /// Every field in order: (name as received, value without surrounding whitespace).
    pub fn fields(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        self.fields
            .iter()
            .map(|(n, v)| (&self.bytes[n.range()], &self.bytes[v.range()]))
    }

    /// The first value of the field `name` (any case; `name` given in lower case).
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        let name = name.as_bytes();
        let held = |(n, _): &&(Span, Span)| self.is(*n, name);
        self.candidates(name)
            .iter()
            .find(held)
            .map(|(_, v)| self.span(*v))
    }

    /// The first value of `name` as text (`None` also when it is not UTF-8).
    pub fn get_str(&self, name: &str) -> Option<&str> {
        std::str::from_utf8(self.get(name)?).ok()
    }

    /// Every value of the field `name`, in order.
    pub fn get_all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        let name = name.as_bytes();
        self.candidates(name)
            .iter()
            .filter(move |(n, _)| self.is(*n, name))
            .map(|(_, v)| self.span(*v))
    }

    /// Whether any value of `name` lists `token` (comma-separated, any case).
    pub fn has_token(&self, name: &str, token: &str) -> bool {
        self.get_all(name).any(|v| {
            v.split(|&b| b == b',')
                .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
        })
    }

    /// The header block's size on the wire (start line and blank line included).
    pub fn wire_len(&self) -> usize {
        self.bytes.len()
    }

    /// The number of fields.
    pub fn field_count(&self) -> usize {
        self.fields.len()
    }

    /// The fields as an `http` map (for the paths that still need one: error bodies
    /// judged by rules, HTTP/2). Fields whose value `http` refuses are left out.
    pub fn to_header_map(&self) -> http::HeaderMap {
        let mut map = http::HeaderMap::with_capacity(self.fields.len());
        for (n, v) in self.fields() {
            if let (Ok(n), Ok(v)) = (
                http::HeaderName::from_bytes(n),
                http::HeaderValue::from_bytes(v),
            ) {
                map.append(n, v);
            }
        }
        map
    }

    fn new(bytes: Bytes, fields: Vec<(Span, Span)>) -> Head {
        let names = fields
            .iter()
            .fold(0, |m, (n, _)| m | name_bit(&bytes[n.range()]));
        Head {
            bytes,
            fields,
            names,
        }
    }

    fn span(&self, s: Span) -> &[u8] {
        &self.bytes[s.range()]
    }

    /// The fields a lookup of `name` must look at: none when the name summary shows
    /// the head does not hold it.
    fn candidates(&self, name: &[u8]) -> &[(Span, Span)] {
        if self.names & name_bit(name) == 0 {
            return &[];
        }
        &self.fields
    }

    /// Whether the name at `n` is `name` (any case), lengths compared first.
    fn is(&self, n: Span, name: &[u8]) -> bool {
        n.len() == name.len() && super::names::eq_ignore_case(self.span(n), name)
    }
}

/// A parsed request head.
#[derive(Clone, Debug)]
pub struct RequestHead {
    head: Head,
    method: Span,
    /// The path of the target (after an absolute form's scheme and authority).
    path: Span,
    query: Option<Span>,
    http11: bool,
    body: BodyLen,
    keep_alive: bool,
}

impl std::ops::Deref for RequestHead {
    type Target = Head;
    fn deref(&self) -> &Head {
        &self.head
    }
}

/// Texts the parser already checked to be ASCII.
fn ascii(b: &[u8]) -> &str {
    std::str::from_utf8(b).unwrap_or("")
}

impl RequestHead {
    pub fn method(&self) -> &str {
        ascii(self.head.span(self.method))
    }

    /// The target's path (`/v1/chat/completions`), without the query.
    pub fn path(&self) -> &str {
        ascii(self.head.span(self.path))
    }

    /// The target's query string, without the `?`.
    pub fn query(&self) -> Option<&str> {
        self.query.map(|q| ascii(self.head.span(q)))
    }

    pub fn is_http11(&self) -> bool {
        self.http11
    }

    /// How the request's body is delimited (never `UntilClose`).
    pub fn body(&self) -> BodyLen {
        self.body
    }

    /// Whether the client lets the connection carry another request after this one.
    pub fn keep_alive(&self) -> bool {
        self.keep_alive
    }

    /// `Expect: 100-continue`.
    pub fn expects_continue(&self) -> bool {
        self.http11
            && self
                .get("expect")
                .is_some_and(|v| v.eq_ignore_ascii_case(b"100-continue"))
    }
}

/// A parsed response head.
#[derive(Clone, Debug)]
pub struct ResponseHead {
    head: Head,
    status: u16,
    body: BodyLen,
    keep_alive: bool,
}

impl std::ops::Deref for ResponseHead {
    type Target = Head;
    fn deref(&self) -> &Head {
        &self.head
    }
}

impl ResponseHead {
    pub fn status(&self) -> u16 {
        self.status
    }

    /// How the body is delimited (a response to a POST: Sluice sends no HEAD).
    pub fn body(&self) -> BodyLen {
        self.body
    }

    /// Whether the upstream lets the connection carry another request once the body
    /// has been read to its end.
    pub fn keep_alive(&self) -> bool {
        self.keep_alive
    }

    /// A response head from a status and fields received some other way (HTTP/2): the
    /// same checks as a parsed one. Its body framing is the other protocol's business.
    pub fn from_fields<'a>(
        status: u16,
        fields: impl Iterator<Item = (&'a [u8], &'a [u8])>,
    ) -> Result<ResponseHead, HeadError> {
        let mut wire = Vec::with_capacity(256);
        super::wire::status_line(&mut wire, status);
        for (n, v) in fields {
            super::wire::field(&mut wire, n, v);
        }
        wire.extend_from_slice(b"\r\n");
        let len = wire.len();
        match parse_response(&wire, len)? {
            Some(head) => Ok(head),
            None => Err(HeadError::Malformed("incomplete response head")),
        }
    }
}

/// The spans of httparse's fields in `buf`.
fn spans(buf: &[u8], fields: &[httparse::Header<'_>]) -> Vec<(Span, Span)> {
    fields
        .iter()
        .map(|h| (Span::of(buf, h.name.as_bytes()), Span::of(buf, h.value)))
        .collect()
}

fn malformed(e: httparse::Error) -> HeadError {
    HeadError::Malformed(match e {
        httparse::Error::HeaderName => "invalid header field name",
        httparse::Error::HeaderValue => "invalid header field value",
        httparse::Error::NewLine => "invalid line ending",
        httparse::Error::Status => "invalid status line",
        httparse::Error::Token => "invalid token in the request line",
        httparse::Error::TooManyHeaders => "too many header fields",
        httparse::Error::Version => "not HTTP/1.0 or HTTP/1.1",
    })
}

/// Parses a request head at the start of `buf`, looking at most at its first `limit`
/// bytes. `Ok(None)`: the head is not complete within them.
pub fn parse_request(buf: &[u8], limit: usize) -> Result<Option<(RequestHead, usize)>, HeadError> {
    let buf = &buf[..buf.len().min(limit)];
    let mut storage = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_FIELDS];
    let mut req = httparse::Request::new(&mut []);
    let n = match req.parse_with_uninit_headers(buf, &mut storage) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(malformed(e)),
    };
    let (Some(method), Some(target)) = (req.method, req.path) else {
        return Err(HeadError::Malformed("incomplete request line"));
    };
    let target = target.as_bytes();
    if !target.is_ascii() {
        return Err(HeadError::Malformed("request target is not ASCII"));
    }
    let http11 = req.version == Some(1);
    let fields = spans(buf, req.headers);
    let method = Span::of(buf, method.as_bytes());
    let (path, query) = split_target(buf, target);
    let head = Head::new(Bytes::copy_from_slice(&buf[..n]), fields);
    let (body, both) = request_body(&head, http11)?;
    if head.get_all("host").nth(1).is_some() {
        return Err(HeadError::Framing("more than one Host field"));
    }
    let keep_alive = !both && connection_keeps(&head, http11);
    Ok(Some((
        RequestHead {
            head,
            method,
            path,
            query,
            http11,
            body,
            keep_alive,
        },
        n,
    )))
}

/// The path and query spans of a request target: origin form (`/p?q`), or absolute
/// form (`http://host/p?q`), whose scheme and authority are skipped.
fn split_target(buf: &[u8], target: &[u8]) -> (Span, Option<Span>) {
    let mut path = target;
    if let Some(at) = target.windows(3).position(|w| w == b"://") {
        if target[..at].iter().all(|b| b.is_ascii_alphabetic()) {
            let rest = &target[at + 3..];
            let slash = rest.iter().position(|&b| b == b'/' || b == b'?');
            path = slash.map_or(&rest[rest.len()..], |i| &rest[i..]);
        }
    }
    match memchr::memchr(b'?', path) {
        Some(q) => (
            Span::of(buf, &path[..q]),
            Some(Span::of(buf, &path[q + 1..])),
        ),
        None => (Span::of(buf, path), None),
    }
}

/// A request's body framing, and whether both framing fields were sent (the connection
/// then closes after the response, RFC 9112 §6.1).
fn request_body(head: &Head, http11: bool) -> Result<(BodyLen, bool), HeadError> {
    let te = last_coding(head);
    let length = content_length(head)?;
    let Some(last) = te else {
        return Ok((length.map_or(BodyLen::Empty, BodyLen::Length), false));
    };
    if !http11 {
        return Err(HeadError::Framing(
            "Transfer-Encoding in an HTTP/1.0 request",
        ));
    }
    if !last.eq_ignore_ascii_case(b"chunked") {
        return Err(HeadError::Framing(
            "the last transfer coding of a request is not chunked",
        ));
    }
    Ok((BodyLen::Chunked, length.is_some()))
}

/// The last transfer coding named by `Transfer-Encoding`, if the field is present.
fn last_coding(head: &Head) -> Option<&[u8]> {
    let mut last = None;
    for v in head.get_all("transfer-encoding") {
        for t in v.split(|&b| b == b',') {
            let t = t.trim_ascii();
            if !t.is_empty() {
                last = Some(t);
            }
        }
        // A field present but empty still counts as present (and not chunked).
        last.get_or_insert(&[][..]);
    }
    last
}

/// The `Content-Length`, when given: every value (repeated fields, comma lists) must be
/// the same whole number (RFC 9110 §8.6).
fn content_length(head: &Head) -> Result<Option<u64>, HeadError> {
    let mut found: Option<u64> = None;
    for v in head.get_all("content-length") {
        for part in v.split(|&b| b == b',') {
            let part = part.trim_ascii();
            if part.is_empty() || part.len() > 19 || !part.iter().all(u8::is_ascii_digit) {
                return Err(HeadError::Framing("invalid Content-Length"));
            }
            let n = part.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
            if found.is_some_and(|f| f != n) {
                return Err(HeadError::Framing("conflicting Content-Length values"));
            }
            found = Some(n);
        }
    }
    Ok(found)
}

/// Whether `Connection` (and the version's default) keeps the connection open.
fn connection_keeps(head: &Head, http11: bool) -> bool {
    if head.has_token("connection", "close") {
        return false;
    }
    http11 || head.has_token("connection", "keep-alive")
}

/// Parses a response head at the start of `buf`, looking at most at its first `limit`
/// bytes. `Ok(None)`: the head is not complete within them.
pub fn parse_response(buf: &[u8], limit: usize) -> Result<Option<ResponseHead>, HeadError> {
    Ok(parse_response_len(buf, limit)?.map(|(h, _)| h))
}

/// [`parse_response`], with the head's length in `buf`.
pub fn parse_response_len(
    buf: &[u8],
    limit: usize,
) -> Result<Option<(ResponseHead, usize)>, HeadError> {
    let buf = &buf[..buf.len().min(limit)];
    let mut storage = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_FIELDS];
    let mut config = httparse::ParserConfig::default();
    // Lenient where Pingora's client is, but no folded lines: a value is passed on as
    // it came, so it must not hold a line break.
    config.allow_spaces_after_header_name_in_responses(true);
    let mut resp = httparse::Response::new(&mut []);
    let n = match config.parse_response_with_uninit_headers(&mut resp, buf, &mut storage) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(malformed(e)),
    };
    let Some(status) = resp.code else {
        return Err(HeadError::Malformed("incomplete status line"));
    };
    let http11 = resp.version == Some(1);
    let fields = spans(buf, resp.headers);
    let head = Head::new(Bytes::copy_from_slice(&buf[..n]), fields);
    let length = content_length(&head)?;
    let (body, reusable) = match (status, last_coding(&head), length) {
        (100..=199 | 204 | 304, _, _) => (BodyLen::Empty, true),
        (_, Some(c), _) if c.eq_ignore_ascii_case(b"chunked") => {
            (BodyLen::Chunked, length.is_none())
        }
        (_, Some(_), _) => (BodyLen::UntilClose, false),
        (_, None, Some(n)) => (BodyLen::Length(n), true),
        (_, None, None) => (BodyLen::UntilClose, false),
    };
    let keep_alive = reusable && connection_keeps(&head, http11);
    Ok(Some((
        ResponseHead {
            head,
            status,
            body,
            keep_alive,
        },
        n,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(text: &str) -> Result<Option<(RequestHead, usize)>, HeadError> {
        parse_request(text.as_bytes(), 64 * 1024)
    }

    fn ok_req(text: &str) -> RequestHead {
        req(text).unwrap().unwrap().0
    }

    #[test]
    fn lookups_find_every_name_held_in_any_case_and_no_other() {
        let names = [
            "host",
            "x-a",
            "X-B",
            "x-sluice-session",
            "authorization",
            "x-ratelimit-remaining-requests",
            "anthropic-version",
            "a",
            "zz",
        ];
        let mut text = String::from("POST / HTTP/1.1\r\n");
        for n in names {
            text.push_str(&format!("{}: v-{}\r\n", n.to_ascii_uppercase(), n));
        }
        text.push_str("x-A: second\r\ncontent-LENGTH: 0\r\n\r\n");
        let head = ok_req(&text);
        for n in names {
            let want = format!("v-{n}");
            assert_eq!(
                head.get(&n.to_ascii_lowercase()),
                Some(want.as_bytes()),
                "{n}"
            );
        }
        let all: Vec<&[u8]> = head.get_all("x-a").collect();
        assert_eq!(all, [&b"v-x-a"[..], b"second"]);
        assert_eq!(head.get("content-length"), Some(&b"0"[..]));
        // Absent names, some sharing a held name's length or last letter.
        for n in [
            "x-c",
            "hosts",
            "b",
            "x-ratelimit-remaining-tokens",
            "expect",
            "zy",
            "",
        ] {
            assert_eq!(head.get(n), None, "{n}");
        }
    }

    #[test]
    fn a_request_head_keeps_its_fields_as_received() {
        let text = "POST /v1/chat/completions?x=1&y HTTP/1.1\r\nHost: gw\r\nX-Custom:  a b \r\n\
                    content-length: 12\r\nSet-Thing: 1\r\nset-thing: 2\r\n\r\nBODY";
        let (h, n) = req(text).unwrap().unwrap();
        assert_eq!(n, text.len() - 4);
        assert_eq!(h.method(), "POST");
        assert_eq!(h.path(), "/v1/chat/completions");
        assert_eq!(h.query(), Some("x=1&y"));
        assert!(h.is_http11() && h.keep_alive());
        assert_eq!(h.body(), BodyLen::Length(12));
        assert_eq!(h.get("x-custom"), Some(&b"a b"[..]));
        assert_eq!(h.get_str("HOST"), Some("gw"));
        let all: Vec<_> = h.get_all("set-thing").collect();
        assert_eq!(all, vec![&b"1"[..], &b"2"[..]]);
        let names: Vec<_> = h.fields().map(|(n, _)| n.to_vec()).collect();
        assert_eq!(names[1], b"X-Custom");
        assert_eq!(h.field_count(), 5);
        assert_eq!(h.wire_len(), n);
    }

    #[test]
    fn an_incomplete_head_asks_for_more_and_a_limit_stops_it() {
        assert!(req("POST / HTTP/1.1\r\nHost: a\r\n").unwrap().is_none());
        let text = "GET / HTTP/1.1\r\nHost: a\r\n\r\n";
        assert!(parse_request(text.as_bytes(), text.len() - 1)
            .unwrap()
            .is_none());
        assert!(parse_request(text.as_bytes(), text.len())
            .unwrap()
            .is_some());
    }

    #[test]
    fn framing_of_requests() {
        let h = ok_req("POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n");
        assert_eq!(h.body(), BodyLen::Chunked);
        assert!(h.keep_alive());
        // Both: chunked wins and the connection is not reused.
        let h =
            ok_req("POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert_eq!(h.body(), BodyLen::Chunked);
        assert!(!h.keep_alive());
        let h = ok_req("POST / HTTP/1.1\r\nContent-Length: 7, 7\r\ncontent-length: 7\r\n\r\n");
        assert_eq!(h.body(), BodyLen::Length(7));
        assert_eq!(ok_req("GET / HTTP/1.1\r\n\r\n").body(), BodyLen::Empty);
        for bad in [
            "POST / HTTP/1.1\r\nContent-Length: 7\r\nContent-Length: 8\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: 1e3\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: \r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
            "POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
            "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        ] {
            assert!(
                matches!(req(bad), Err(HeadError::Framing(_))),
                "{bad:?}: {:?}",
                req(bad)
            );
        }
    }

    #[test]
    fn keep_alive_by_version_and_connection_field() {
        assert!(!ok_req("GET / HTTP/1.0\r\n\r\n").keep_alive());
        assert!(ok_req("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n").keep_alive());
        assert!(!ok_req("GET / HTTP/1.1\r\nConnection: te, close\r\n\r\n").keep_alive());
        assert!(ok_req("GET / HTTP/1.1\r\nConnection: keep-alive\r\n\r\n").keep_alive());
        assert!(ok_req("POST / HTTP/1.1\r\nExpect: 100-Continue\r\n\r\n").expects_continue());
        assert!(!ok_req("POST / HTTP/1.0\r\nExpect: 100-continue\r\n\r\n").expects_continue());
    }

    #[test]
    fn absolute_targets_and_malformed_request_lines() {
        let h = ok_req("POST http://gw:8080/v1/messages?beta=1 HTTP/1.1\r\n\r\n");
        assert_eq!((h.path(), h.query()), ("/v1/messages", Some("beta=1")));
        assert_eq!(ok_req("GET http://gw HTTP/1.1\r\n\r\n").path(), "");
        for bad in [
            "POST /a b HTTP/1.1\r\n\r\n",
            "PRI * HTTP/2.0\r\n\r\n",
            "POST / HTTP/1.1\r\nBad Name: x\r\n\r\n",
            "POST /\u{e9} HTTP/1.1\r\n\r\n",
        ] {
            assert!(
                matches!(req(bad), Err(HeadError::Malformed(_))),
                "{bad:?}: {:?}",
                req(bad)
            );
        }
        let many = format!(
            "GET / HTTP/1.1\r\n{}\r\n",
            "a: b\r\n".repeat(MAX_FIELDS + 1)
        );
        assert_eq!(req(&many).unwrap_err().reason(), "too many header fields");
        // Empty lines before a request line are skipped (RFC 9112 §2.2).
        assert!(req("\r\n\r\n").unwrap().is_none());
        assert_eq!(ok_req("\r\nGET /x HTTP/1.1\r\n\r\n").path(), "/x");
    }

    fn resp(text: &str) -> ResponseHead {
        parse_response(text.as_bytes(), 64 * 1024).unwrap().unwrap()
    }

    #[test]
    fn framing_and_reuse_of_responses() {
        let r = resp("HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc");
        assert_eq!(
            (r.status(), r.body(), r.keep_alive()),
            (200, BodyLen::Length(3), true)
        );
        let r = resp("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert_eq!((r.body(), r.keep_alive()), (BodyLen::Chunked, true));
        let r = resp("HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert_eq!((r.body(), r.keep_alive()), (BodyLen::Chunked, false));
        let r = resp("HTTP/1.1 200 OK\r\n\r\n");
        assert_eq!((r.body(), r.keep_alive()), (BodyLen::UntilClose, false));
        let r = resp("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n");
        assert_eq!(r.body(), BodyLen::UntilClose);
        let r = resp("HTTP/1.1 204 No Content\r\n\r\n");
        assert_eq!((r.body(), r.keep_alive()), (BodyLen::Empty, true));
        let r = resp("HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        assert!(!r.keep_alive());
        let r = resp("HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n");
        assert!(!r.keep_alive());
        let r = resp("HTTP/1.1 100 Continue\r\n\r\n");
        assert_eq!(r.body(), BodyLen::Empty);
        // Lenient where Pingora's client is: a space before the colon.
        let r = resp("HTTP/1.1 429 Too Many\r\nRetry-After : 3\r\nContent-Length: 0\r\n\r\n");
        assert_eq!(r.get_str("retry-after"), Some("3"));
        assert!(parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", 1024).is_err());
        assert!(parse_response(b"HTTP/1.1 2000 OK\r\n\r\n", 1024).is_err());
    }

    #[test]
    fn a_head_from_fields_reads_like_a_parsed_one() {
        let fields = [
            (&b"content-type"[..], &b"text/event-stream"[..]),
            (&b"x-ratelimit-remaining-requests"[..], &b"7"[..]),
        ];
        let r = ResponseHead::from_fields(201, fields.into_iter()).unwrap();
        assert_eq!(r.status(), 201);
        assert_eq!(r.get_str("X-RateLimit-Remaining-Requests"), Some("7"));
        let map = r.to_header_map();
        assert_eq!(map["content-type"], "text/event-stream");
        let bad = [(&b"x"[..], &b"a\r\nb"[..])];
        assert!(ResponseHead::from_fields(200, bad.into_iter()).is_err());
    }
}
