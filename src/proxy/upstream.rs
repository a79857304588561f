//! Header rewriting at the upstream boundary (SPEC §2).
//!
//! Upstream requests carry the client's headers minus its credentials, the session and
//! lease headers, hop-by-hop headers and anything that describes the original framing;
//! the connection's credential is set in the family's style. Responses going back to the
//! client lose hop-by-hop headers and their framing fields (the client connection frames
//! the body itself) and gain the `x-sluice-*` headers.
//!
//! Both directions copy the fields as received — name case, order and repeats kept —
//! straight into the outgoing bytes; nothing is parsed into a map on the way.

use crate::config::{Connection, Family, Provider, ProviderClass};
use crate::http1::names::{eq_ignore_case, NameSet};
use crate::http1::{wire, BodyLen, RequestHead, ResponseHead};
use crate::policy::subscription;
use crate::server::conn::{BodySize, HeadOut};

/// Request headers never forwarded upstream.
const STRIP_REQUEST: NameSet<19> = NameSet::new([
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
]);

/// Response headers never forwarded to the client: hop-by-hop ones, and the framing,
/// which the client connection sets for itself.
const STRIP_RESPONSE: NameSet<9> = NameSet::new([
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "transfer-encoding",
    "content-length",
    "te",
    "trailer",
    "upgrade",
]);

pub const ANTHROPIC_VERSION: &str = "2023-06-01";

fn named(name: &[u8], list: &[&str]) -> bool {
    list.iter().any(|s| eq_ignore_case(name, s.as_bytes()))
}

/// The parts of an upstream request head.
pub struct OutHead<'a> {
    pub method: &'a str,
    /// Path prefix of the upstream, then the route's canonical path.
    pub prefix: &'a str,
    pub path: &'a str,
    pub query: Option<&'a str>,
    /// The `Host` value.
    pub authority: &'a str,
    pub body_len: usize,
}

/// Appends an HTTP/1.1 request head to `out`: request line, `Host`, the client's
/// fields except those [`STRIP_REQUEST`] and `replaced` name, `Content-Length`, then
/// `extra` (the fields Sluice sets), then the blank line.
pub fn write_request_head<'f>(
    out: &mut Vec<u8>,
    h: &OutHead<'_>,
    client: impl Iterator<Item = (&'f [u8], &'f [u8])>,
    replaced: &[&str],
    extra: &[(&[u8], &[u8])],
) {
    out.extend_from_slice(h.method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(h.prefix.as_bytes());
    out.extend_from_slice(h.path.as_bytes());
    if let Some(q) = h.query {
        out.push(b'?');
        out.extend_from_slice(q.as_bytes());
    }
    out.extend_from_slice(b" HTTP/1.1\r\n");
    wire::field(out, b"Host", h.authority.as_bytes());
    for (name, value) in client {
        if !STRIP_REQUEST.contains(name) && !named(name, replaced) {
            wire::field(out, name, value);
        }
    }
    wire::field_number(out, b"Content-Length", h.body_len as u64);
    for (name, value) in extra {
        wire::field(out, name, value);
    }
    out.extend_from_slice(b"\r\n");
}

/// The upstream request head of one attempt, in HTTP/1 wire form: the route's canonical
/// `path` under the provider's prefix, plus the client's query string (SPEC §3).
/// `slow`: the connection's subscription lane is on (SPEC §5.13).
pub fn request_head(
    client: &RequestHead,
    path: &str,
    provider: &Provider,
    connection: &Connection,
    body_len: usize,
    slow: bool,
) -> Vec<u8> {
    let credential;
    let beta;
    let mut replaced: Vec<&str> = Vec::new();
    let mut extra: smallvec::SmallVec<[(&[u8], &[u8]); 4]> = smallvec::SmallVec::new();
    if let Some(key) = &connection.key {
        match (provider.api, provider.class) {
            (Family::OpenAi, _) | (Family::Anthropic, ProviderClass::OAuth) => {
                let key = key.expose();
                let mut v = String::with_capacity(7 + key.len());
                v.push_str("Bearer ");
                v.push_str(key);
                credential = v;
                extra.push((b"Authorization", credential.as_bytes()));
            }
            (Family::Anthropic, _) => extra.push((b"x-api-key", key.expose().as_bytes())),
        }
        if (provider.api, provider.class) == (Family::Anthropic, ProviderClass::OAuth) {
            // Every `anthropic-beta` line of the client, joined (one line goes up).
            let theirs: Vec<&str> = client
                .get_all("anthropic-beta")
                .filter_map(|v| std::str::from_utf8(v).ok())
                .collect();
            beta = subscription::merged_beta(Some(&theirs.join(",")));
            extra.push((b"anthropic-beta", beta.as_bytes()));
            replaced.push("anthropic-beta");
        }
    }
    if slow {
        extra.push((
            subscription::SLOW_HEADER.as_bytes(),
            subscription::SLOW_VALUE.as_bytes(),
        ));
        replaced.push(subscription::SLOW_HEADER);
    }
    if provider.api == Family::Anthropic && client.get("anthropic-version").is_none() {
        extra.push((b"anthropic-version", ANTHROPIC_VERSION.as_bytes()));
    }
    let h = OutHead {
        method: client.method(),
        prefix: &provider.base_url.path_prefix,
        path,
        query: client.query(),
        authority: provider.base_url.authority(),
        body_len,
    };
    let mut out = Vec::with_capacity(client.wire_len() + 256);
    write_request_head(&mut out, &h, client.fields(), &replaced, &extra);
    out
}

/// Adds `fields` to a client response head, except hop-by-hop and framing fields and
/// those `strip` names.
pub fn forward_fields<'f>(
    h: &mut HeadOut<'_>,
    fields: impl Iterator<Item = (&'f [u8], &'f [u8])>,
    strip: &[&str],
) {
    for (name, value) in fields {
        if !STRIP_RESPONSE.contains(name) && !named(name, strip) {
            h.field(name, value);
        }
    }
}

/// How the client's copy of an upstream answer is framed: its length when the upstream
/// gave one, none for 204 and 304, else unknown (chunked, or to the close for HTTP/1.0).
pub fn body_size(up: &ResponseHead) -> BodySize {
    match up.body() {
        BodyLen::Length(n) => BodySize::Exactly(n),
        BodyLen::Empty if matches!(up.status(), 204 | 304) => BodySize::None,
        BodyLen::Empty => BodySize::Exactly(0),
        BodyLen::Chunked | BodyLen::UntilClose => BodySize::Unknown,
    }
}

/// Writes the fields of an upstream answer to the client's head, less hop-by-hop and
/// framing ones.
pub fn response_head(h: &mut HeadOut<'_>, up: &ResponseHead) {
    forward_fields(h, up.fields(), &[]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{BaseUrl, Secret};
    use std::time::Duration;

    fn provider(api: Family) -> Provider {
        Provider {
            id: "p".into(),
            base_url: BaseUrl::new(false, "127.0.0.1".into(), 9100, "/api".into()),
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

    /// A client head from its fields (a POST to `target`).
    fn client(target: &str, fields: &[(&str, &str)]) -> RequestHead {
        let mut wire = format!("POST {target} HTTP/1.1\r\n");
        for (k, v) in fields {
            wire.push_str(&format!("{k}: {v}\r\n"));
        }
        wire.push_str("\r\n");
        crate::http1::head::parse_request(wire.as_bytes(), wire.len())
            .unwrap()
            .unwrap()
            .0
    }

    /// The upstream head as the upstream would parse it.
    fn sent(wire: Vec<u8>) -> RequestHead {
        crate::http1::head::parse_request(&wire, wire.len())
            .unwrap()
            .unwrap()
            .0
    }

    #[test]
    fn strips_client_secrets_and_sets_upstream_auth() {
        let c = client(
            "//v1/chat/completions/?x=1",
            &[
                ("authorization", "Bearer client"),
                ("x-api-key", "client"),
                ("x-session-id", "s"),
                ("x-sluice-lease-owner", "o"),
                ("connection", "keep-alive"),
                ("expect", "100-continue"),
                ("X-Custom", "kept"),
                ("Content-Length", "99"),
            ],
        );
        let wire = request_head(
            &c,
            "/v1/chat/completions",
            &provider(Family::OpenAi),
            &conn(),
            12,
            false,
        );
        let text = String::from_utf8(wire.clone()).unwrap();
        assert!(
            text.starts_with("POST /api/v1/chat/completions?x=1 HTTP/1.1\r\nHost: 127.0.0.1:9100\r\nX-Custom: kept\r\n"),
            "{text}"
        );
        let r = sent(wire);
        assert_eq!(r.get_str("authorization"), Some("Bearer upstream-key"));
        assert_eq!(r.get_str("content-length"), Some("12"));
        assert_eq!(r.get_all("content-length").count(), 1);
        for gone in [
            "x-api-key",
            "x-session-id",
            "x-sluice-lease-owner",
            "connection",
            "expect",
        ] {
            assert!(r.get(gone).is_none(), "{gone} leaked");
        }
        let a = sent(request_head(
            &c,
            "/v1/messages",
            &provider(Family::Anthropic),
            &conn(),
            0,
            false,
        ));
        assert_eq!(a.get_str("x-api-key"), Some("upstream-key"));
        assert_eq!(a.get_str("anthropic-version"), Some(ANTHROPIC_VERSION));
        assert!(a.get("authorization").is_none());
        assert!(a.get("anthropic-beta").is_none());
        assert!(a.get("anthropic-usage-limit").is_none());
    }

    #[test]
    fn oauth_connections_send_a_bearer_token_the_oauth_beta_and_the_slow_header_on_the_lane() {
        let mut oauth = provider(Family::Anthropic);
        oauth.class = ProviderClass::OAuth;
        let c = client("/v1/messages", &[("x-api-key", "client")]);
        let r = sent(request_head(&c, "/v1/messages", &oauth, &conn(), 0, false));
        assert_eq!(r.get_str("authorization"), Some("Bearer upstream-key"));
        assert!(r.get("x-api-key").is_none());
        assert_eq!(r.get_str("anthropic-beta"), Some("oauth-2025-04-20"));
        assert!(r.get("anthropic-usage-limit").is_none());
        // The client's own betas are kept, the OAuth one added once; the slow header
        // replaces the client's own.
        let c = client(
            "/v1/messages",
            &[
                ("anthropic-beta", "interleaved-thinking-2025-05-14"),
                ("anthropic-usage-limit", "fast"),
            ],
        );
        let r = sent(request_head(&c, "/v1/messages", &oauth, &conn(), 0, true));
        assert_eq!(
            r.get_str("anthropic-beta"),
            Some("interleaved-thinking-2025-05-14,oauth-2025-04-20")
        );
        assert_eq!(r.get_all("anthropic-beta").count(), 1);
        assert_eq!(r.get_str("anthropic-usage-limit"), Some("slow"));
        assert_eq!(r.get_all("anthropic-usage-limit").count(), 1);
        let c = client(
            "/v1/messages",
            &[
                ("anthropic-beta", "interleaved-thinking-2025-05-14"),
                ("Anthropic-Beta", "files-api-2025-04-14"),
            ],
        );
        let r = sent(request_head(&c, "/v1/messages", &oauth, &conn(), 0, false));
        assert_eq!(
            r.get_str("anthropic-beta"),
            Some("interleaved-thinking-2025-05-14,files-api-2025-04-14,oauth-2025-04-20")
        );
    }

    #[test]
    fn answers_are_framed_by_their_length_or_not_at_all() {
        let head = |t: &str| {
            crate::http1::head::parse_response(t.as_bytes(), t.len())
                .unwrap()
                .unwrap()
        };
        let cases = [
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n",
                BodySize::Exactly(2),
            ),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                BodySize::Unknown,
            ),
            ("HTTP/1.1 200 OK\r\n\r\n", BodySize::Unknown),
            ("HTTP/1.1 204 No Content\r\n\r\n", BodySize::None),
        ];
        for (t, want) in cases {
            assert_eq!(body_size(&head(t)), want, "{t}");
        }
    }
}
