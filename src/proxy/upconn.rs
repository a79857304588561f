//! An attempt's upstream session: HTTP/1.1 on Sluice's codec ([`super::h1::H1`]), or
//! HTTP/2 on Pingora's multiplexed client, behind one interface.
//!
//! The request is given once in HTTP/1 wire form (built by `upstream::request_head`);
//! HTTP/2 turns it into Pingora's request header. Answers come back as Sluice's
//! [`ResponseHead`] either way, so nothing after the send knows the protocol.
//! Invariants: the same as each side's — 1xx heads are skipped, a body ends only when
//! its framing says so, and an HTTP/2 session goes back to Pingora's pool only through
//! `Upstreams::release`.

use super::body::Outgoing;
use super::h1::H1;
use crate::http1::ResponseHead;
use bytes::Bytes;
use futures::FutureExt;
use pingora::http::RequestHeader;
use pingora::protocols::http::client::HttpSession;
use pingora::{Error, ErrorType};

/// One upstream session.
pub enum UpConn {
    H1(H1),
    /// Boxed: Pingora's session is large, and most requests go over HTTP/1.1.
    H2(Box<HttpSession>),
}

impl UpConn {
    /// Writes the request: `head` in HTTP/1 wire form, then `body`.
    pub async fn send(&mut self, head: Vec<u8>, body: &Outgoing<'_>) -> pingora::Result<()> {
        match self {
            UpConn::H1(h1) => h1.send(head, body.pieces()).await,
            UpConn::H2(h2) => {
                let req = pingora_request(&head)?;
                h2.write_request_header(Box::new(req)).await?;
                if !body.is_empty() {
                    h2.write_request_body(body.to_bytes(), true).await?;
                }
                h2.finish_request_body().await
            }
        }
    }

    /// Reads the answer's head, skipping 1xx; at most `limit` bytes of it on HTTP/1.1.
    pub async fn read_head(&mut self, limit: usize) -> pingora::Result<ResponseHead> {
        match self {
            UpConn::H1(h1) => h1.read_head(limit).await,
            UpConn::H2(h2) => loop {
                h2.read_response_header().await?;
                let Some(h) = h2.response_header() else {
                    return Error::e_explain(ErrorType::InvalidHTTPHeader, "no response header");
                };
                if h.status.is_informational() {
                    continue;
                }
                let fields = h
                    .headers
                    .iter()
                    .map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes()));
                let head = ResponseHead::from_fields(h.status.as_u16(), fields).map_err(|e| {
                    Error::explain(
                        ErrorType::InvalidHTTPHeader,
                        format!("invalid upstream response head: {e}"),
                    )
                })?;
                if head.wire_len() > limit {
                    return Error::e_explain(
                        ErrorType::InvalidHTTPHeader,
                        "upstream response header too large",
                    );
                }
                return Ok(head);
            },
        }
    }

    /// The next piece of the body; `None` once it is complete.
    pub async fn read_body(&mut self) -> pingora::Result<Option<Bytes>> {
        match self {
            UpConn::H1(h1) => h1.read_body().await,
            UpConn::H2(h2) => h2.read_response_body().await,
        }
    }

    /// The next piece of the body if it is already in hand, without waiting.
    pub fn body_ready(&mut self) -> Option<pingora::Result<Option<Bytes>>> {
        match self {
            UpConn::H1(h1) => h1.body_ready(),
            // HTTP/2 data polling is cancel-safe: a read dropped unfinished loses nothing.
            UpConn::H2(h2) => h2.read_response_body().now_or_never(),
        }
    }

    /// The answer has been read to its end.
    pub fn is_done(&mut self) -> bool {
        match self {
            UpConn::H1(h1) => h1.is_done(),
            UpConn::H2(h2) => h2.response_done(),
        }
    }

    /// Closes the session (an exchange that did not end cleanly).
    pub async fn shutdown(&mut self) {
        match self {
            UpConn::H1(h1) => h1.shutdown().await,
            UpConn::H2(h2) => h2.shutdown().await,
        }
    }
}

/// Pingora's request header for an HTTP/1 wire head (the HTTP/2 path).
fn pingora_request(wire: &[u8]) -> pingora::Result<RequestHeader> {
    let bad = |why: &str| {
        Error::explain(
            ErrorType::InvalidHTTPHeader,
            format!("upstream request: {why}"),
        )
    };
    let Ok(Some((head, _))) = crate::http1::head::parse_request(wire, wire.len()) else {
        return Err(bad("not a request head"));
    };
    let target = match head.query() {
        Some(q) => format!("{}?{q}", head.path()),
        None => head.path().to_string(),
    };
    let mut req = RequestHeader::build(head.method(), target.as_bytes(), Some(head.field_count()))?;
    for (name, value) in head.fields() {
        let name = http::HeaderName::from_bytes(name).map_err(|_| bad("field name"))?;
        let value = http::HeaderValue::from_bytes(value).map_err(|_| bad("field value"))?;
        req.append_header(name, value)?;
    }
    Ok(req)
}

#[cfg(test)]
mod tests {
    use super::pingora_request;

    #[test]
    fn an_http2_request_carries_the_wire_heads_target_and_fields() {
        let wire = b"POST /api/v1/messages?beta=true HTTP/1.1\r\nHost: u:443\r\n\
                     x-api-key: k\r\nContent-Length: 2\r\n\r\n";
        let r = pingora_request(wire).unwrap();
        assert_eq!(r.method, http::Method::POST);
        assert_eq!(r.uri.to_string(), "/api/v1/messages?beta=true");
        assert_eq!(r.headers["host"], "u:443");
        assert_eq!(r.headers["x-api-key"], "k");
        assert!(pingora_request(b"junk").is_err());
    }
}
