//! Header rewriting at the upstream boundary (SPEC §2).
//!
//! Upstream requests carry the client's headers minus its credentials, the session and
//! lease headers, hop-by-hop headers and anything that describes the original framing;
//! the connection's credential is set in the family's style. Responses going back to the
//! client lose hop-by-hop headers and gain the `x-sluice-*` headers.

use crate::config::{BaseUrl, Connection, Family, Provider, ProviderClass};
use crate::policy::subscription;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::OrErr;

/// Request headers never forwarded upstream (lower-case).
const STRIP_REQUEST: &[&str] = &[
    "authorization",
    "x-api-key",
    "host",
    "content-length",
    "transfer-encoding",
    "expect",
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
    "te",
    "trailer",
    "upgrade",
    "accept-encoding",
    "x-session-id",
    "x-codex-session-id",
    "x-sluice-session",
    "x-sluice-lease-owner",
    "x-sluice-lease-generation",
];

/// Response headers never forwarded to the client (lower-case).
const STRIP_RESPONSE: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
];

pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// Builds the upstream request header for one attempt: the route's canonical `path`
/// under the provider's prefix, plus the client's query string (SPEC §3). `slow`: the
/// connection's subscription lane is on (SPEC §5.13).
pub fn request_header(
    client: &RequestHeader,
    path: &str,
    provider: &Provider,
    connection: &Connection,
    body_len: usize,
    slow: bool,
) -> pingora::Result<RequestHeader> {
    let path = match client.uri.query() {
        Some(q) => format!("{}{path}?{q}", provider.base_url.path_prefix),
        None => format!("{}{path}", provider.base_url.path_prefix),
    };
    let mut parts = http::Request::new(()).into_parts().0;
    parts.method = client.method.clone();
    parts.headers = forwarded(&client.headers, STRIP_REQUEST, 4)?;
    let mut req = RequestHeader::from(parts);
    req.set_raw_path(path.as_bytes())?;
    req.insert_header("host", host_header(&provider.base_url))?;
    req.insert_header("content-length", body_len)?;
    if let Some(key) = &connection.key {
        match (provider.api, provider.class) {
            (Family::OpenAi, _) => {
                req.insert_header("authorization", format!("Bearer {}", key.expose()))?;
            }
            (Family::Anthropic, ProviderClass::OAuth) => {
                req.insert_header("authorization", format!("Bearer {}", key.expose()))?;
                // Every `anthropic-beta` line of the client, joined (one line goes up).
                let theirs: Vec<&str> = client
                    .headers
                    .get_all("anthropic-beta")
                    .iter()
                    .filter_map(|v| v.to_str().ok())
                    .collect();
                let theirs = theirs.join(",");
                let beta = subscription::merged_beta(Some(&theirs));
                req.insert_header("anthropic-beta", beta)?;
            }
            (Family::Anthropic, _) => {
                req.insert_header("x-api-key", key.expose())?;
            }
        }
    }
    if slow {
        req.insert_header(subscription::SLOW_HEADER, subscription::SLOW_VALUE)?;
    }
    if provider.api == Family::Anthropic && req.headers.get("anthropic-version").is_none() {
        req.insert_header("anthropic-version", ANTHROPIC_VERSION)?;
    }
    Ok(req)
}

/// The headers of `from` not named in `strip`, with room for `extra` more. Names are
/// copied as parsed, without Pingora's per-header case map: on the wire they read as
/// Pingora writes a map's names (its title case for common names, else lower case),
/// which is what the case map held for names taken from a parsed header. Names Sluice
/// sets itself follow the same rule (`Host`, `Content-Length`, `Transfer-Encoding`).
fn forwarded(
    from: &http::HeaderMap,
    strip: &[&str],
    extra: usize,
) -> pingora::Result<http::HeaderMap> {
    let mut to = http::HeaderMap::new();
    to.try_reserve(from.len() + extra)
        .or_err(pingora::ErrorType::InvalidHTTPHeader, "too many headers")?;
    for (name, value) in from.iter() {
        if strip.contains(&name.as_str()) {
            continue;
        }
        to.try_append(name.clone(), value.clone())
            .or_err(pingora::ErrorType::InvalidHTTPHeader, "too many headers")?;
    }
    Ok(to)
}

fn host_header(url: &BaseUrl) -> String {
    url.authority()
}

/// Whether the client's connection frames a body of unknown length as chunks.
pub fn client_takes_chunked(session: &pingora::protocols::http::ServerSession) -> bool {
    !session.is_http2() && session.req_header().version == http::Version::HTTP_11
}

/// The client-facing copy of an upstream response header. `chunked`: the client speaks
/// HTTP/1.1, so a body of unknown length is sent chunked; otherwise (HTTP/2, HTTP/1.0)
/// it is left unframed here — HTTP/2 frames it, and an HTTP/1.0 client reads it to the
/// close of the connection.
pub fn response_header(
    upstream: &ResponseHeader,
    chunked: bool,
    sluice: Vec<(&'static str, String)>,
) -> pingora::Result<ResponseHeader> {
    let mut parts = http::Response::new(()).into_parts().0;
    parts.status = upstream.status;
    parts.headers = forwarded(&upstream.headers, STRIP_RESPONSE, sluice.len() + 1)?;
    let mut resp = ResponseHeader::from(parts);
    if chunked
        && resp.headers.get("content-length").is_none()
        && !matches!(upstream.status.as_u16(), 204 | 304)
    {
        resp.insert_header("transfer-encoding", "chunked")?;
    }
    // Each value's own string becomes the header value, without a copy.
    for (k, v) in sluice {
        resp.insert_header(k, v)?;
    }
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ProviderClass, Secret};
    use std::time::Duration;

    fn provider(api: Family) -> Provider {
        Provider {
            id: "p".into(),
            base_url: BaseUrl {
                tls: false,
                host: "127.0.0.1".into(),
                port: 9100,
                path_prefix: "/api".into(),
            },
            api,
            class: ProviderClass::ApiKey,
            retry_delay: None,
            connect_timeout: Duration::from_secs(1),
            quota_family: None,
            http2: Default::default(),
            tls: Default::default(),
            pool_key: 0,
            connections: vec![],
        }
    }

    fn conn() -> Connection {
        Connection {
            id: "c".into(),
            key: Some(Secret::new("upstream-key".into())),
            max_concurrent: None,
            model_concurrency: Default::default(),
            bucket: None,
            retry_delay: None,
            disable_cooling: false,
            subscription: None,
        }
    }

    #[test]
    fn strips_client_secrets_and_sets_upstream_auth() {
        let mut c = RequestHeader::build("POST", b"//v1/chat/completions/?x=1", None).unwrap();
        for (k, v) in [
            ("authorization", "Bearer client"),
            ("x-api-key", "client"),
            ("x-session-id", "s"),
            ("x-sluice-lease-owner", "o"),
            ("connection", "keep-alive"),
            ("expect", "100-continue"),
            ("x-custom", "kept"),
        ] {
            c.insert_header(k, v).unwrap();
        }
        let r = request_header(
            &c,
            "/v1/chat/completions",
            &provider(Family::OpenAi),
            &conn(),
            12,
            false,
        )
        .unwrap();
        assert_eq!(r.uri.to_string(), "/api/v1/chat/completions?x=1");
        assert_eq!(r.headers["authorization"], "Bearer upstream-key");
        assert_eq!(r.headers["host"], "127.0.0.1:9100");
        assert_eq!(r.headers["content-length"], "12");
        assert_eq!(r.headers["x-custom"], "kept");
        for gone in [
            "x-api-key",
            "x-session-id",
            "x-sluice-lease-owner",
            "connection",
            "expect",
        ] {
            assert!(r.headers.get(gone).is_none(), "{gone} leaked");
        }
        let a = request_header(
            &c,
            "/v1/messages",
            &provider(Family::Anthropic),
            &conn(),
            0,
            false,
        )
        .unwrap();
        assert_eq!(a.headers["x-api-key"], "upstream-key");
        assert_eq!(a.headers["anthropic-version"], ANTHROPIC_VERSION);
        assert!(a.headers.get("authorization").is_none());
        assert!(a.headers.get("anthropic-beta").is_none());
        assert!(a.headers.get("anthropic-usage-limit").is_none());
    }

    #[test]
    fn oauth_connections_send_a_bearer_token_the_oauth_beta_and_the_slow_header_on_the_lane() {
        let mut oauth = provider(Family::Anthropic);
        oauth.class = ProviderClass::OAuth;
        let mut c = RequestHeader::build("POST", b"/v1/messages", None).unwrap();
        c.insert_header("x-api-key", "client").unwrap();
        let r = request_header(&c, "/v1/messages", &oauth, &conn(), 0, false).unwrap();
        assert_eq!(r.headers["authorization"], "Bearer upstream-key");
        assert!(r.headers.get("x-api-key").is_none());
        assert_eq!(r.headers["anthropic-beta"], "oauth-2025-04-20");
        assert!(r.headers.get("anthropic-usage-limit").is_none());
        // The client's own betas are kept, the OAuth one added once.
        c.insert_header("anthropic-beta", "interleaved-thinking-2025-05-14")
            .unwrap();
        let r = request_header(&c, "/v1/messages", &oauth, &conn(), 0, true).unwrap();
        assert_eq!(
            r.headers["anthropic-beta"],
            "interleaved-thinking-2025-05-14,oauth-2025-04-20"
        );
        assert_eq!(r.headers.get_all("anthropic-beta").iter().count(), 1);
        assert_eq!(r.headers["anthropic-usage-limit"], "slow");
        c.append_header("anthropic-beta", "files-api-2025-04-14")
            .unwrap();
        let r = request_header(&c, "/v1/messages", &oauth, &conn(), 0, false).unwrap();
        assert_eq!(
            r.headers["anthropic-beta"],
            "interleaved-thinking-2025-05-14,files-api-2025-04-14,oauth-2025-04-20"
        );
    }
    fn wire(h: &ResponseHeader) -> String {
        let mut out = Vec::new();
        h.header_to_h1_wire(&mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn a_response_header_keeps_order_and_repeats_and_loses_hop_by_hop_headers() {
        let mut up = ResponseHeader::build(201, None).unwrap();
        for (k, v) in [
            ("Content-Type", "application/json"),
            ("Set-Cookie", "a=1"),
            ("Connection", "keep-alive"),
            ("X-Request-Id", "r1"),
            ("Set-Cookie", "b=2"),
            ("Transfer-Encoding", "chunked"),
        ] {
            up.append_header(k, v).unwrap();
        }
        let sluice = [("x-sluice-attempts", "1".to_string())];
        let r = response_header(&up, true, sluice.to_vec()).unwrap();
        assert_eq!(r.status.as_u16(), 201);
        assert_eq!(
            wire(&r),
            "Content-Type: application/json\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\n\
             x-request-id: r1\r\nTransfer-Encoding: chunked\r\nx-sluice-attempts: 1\r\n"
        );
        // A framed body keeps its length, and an HTTP/1.0 client gets no chunking.
        let mut up = ResponseHeader::build(200, None).unwrap();
        up.append_header("Content-Length", "2").unwrap();
        let r = response_header(&up, true, Vec::new()).unwrap();
        assert_eq!(wire(&r), "Content-Length: 2\r\n");
        let r = response_header(
            &ResponseHeader::build(200, None).unwrap(),
            false,
            Vec::new(),
        )
        .unwrap();
        assert_eq!(wire(&r), "");
    }
}
