//! The client API surface (SPEC §3): which method + path is which route and family.
//!
//! Invariants: a path matches after normalisation only (query dropped, percent-encoded
//! unreserved characters decoded, empty and `.` segments removed, `..` resolved without
//! climbing above the root, a trailing `/` dropped), and the upstream is only ever sent
//! the route's canonical path — never the client's raw one, so `/v1/chat/completions/`
//! cannot reach a provider as a 404 that then counts against a model.

use crate::config::Family;
use std::borrow::Cow;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    ChatCompletions,
    Completions,
    Embeddings,
    Responses,
    Messages,
    CountTokens,
    Models,
    SessionLeases,
}

impl Route {
    /// Matches a request line (the path is normalised first; the query is ignored).
    pub fn from_request(method: &str, target: &str) -> Option<Route> {
        // A client's path is nearly always a route's canonical one: matched as it is.
        let route = match Route::canonical(path_part(target)) {
            Some(r) => r,
            None => Route::canonical(&normalize(target))?,
        };
        (method == route.method()).then_some(route)
    }

    /// The route whose canonical path is `path` exactly.
    fn canonical(path: &str) -> Option<Route> {
        Some(match path {
            "/v1/chat/completions" => Route::ChatCompletions,
            "/v1/completions" => Route::Completions,
            "/v1/embeddings" => Route::Embeddings,
            "/v1/responses" => Route::Responses,
            "/v1/messages" => Route::Messages,
            "/v1/messages/count_tokens" => Route::CountTokens,
            "/v1/models" => Route::Models,
            "/api/v1/session-leases" => Route::SessionLeases,
            _ => return None,
        })
    }

    /// Matches the path only: `Some` with a wrong method is a 405, not a 404.
    pub fn by_path(path: &str) -> Option<Route> {
        Route::ALL
            .into_iter()
            .find(|r| Route::from_request(r.method(), path) == Some(*r))
    }

    /// Every route, in the order `by_path` tries them.
    pub const ALL: [Route; 8] = [
        Route::ChatCompletions,
        Route::Completions,
        Route::Embeddings,
        Route::Responses,
        Route::Messages,
        Route::CountTokens,
        Route::Models,
        Route::SessionLeases,
    ];

    pub fn method(self) -> &'static str {
        match self {
            Route::Models => "GET",
            _ => "POST",
        }
    }

    /// The canonical path, the only one an upstream is sent.
    pub fn path(self) -> &'static str {
        match self {
            Route::ChatCompletions => "/v1/chat/completions",
            Route::Completions => "/v1/completions",
            Route::Embeddings => "/v1/embeddings",
            Route::Responses => "/v1/responses",
            Route::Messages => "/v1/messages",
            Route::CountTokens => "/v1/messages/count_tokens",
            Route::Models => "/v1/models",
            Route::SessionLeases => "/api/v1/session-leases",
        }
    }

    /// A 4xx from the upstream is the answer: never failed over (token counting is a
    /// pure function of the request; another target would answer the same).
    pub fn final_4xx(self) -> bool {
        self == Route::CountTokens
    }

    pub fn family(self) -> Family {
        match self {
            Route::Messages | Route::CountTokens => Family::Anthropic,
            _ => Family::OpenAi,
        }
    }

    /// Bounded metric label.
    pub fn label(self) -> &'static str {
        match self {
            Route::ChatCompletions => "chat_completions",
            Route::Completions => "completions",
            Route::Embeddings => "embeddings",
            Route::Responses => "responses",
            Route::Messages => "messages",
            Route::CountTokens => "count_tokens",
            Route::Models => "models",
            Route::SessionLeases => "session_leases",
        }
    }
}

/// The path part of a request target, normalised for matching (see the module doc).
/// A `%XX` that is not an unreserved character (`%2F`, `%00`, bad hex) stays as written,
/// so it can never turn into a separator or a route.
pub fn normalize(target: &str) -> Cow<'_, str> {
    let path = path_part(target);
    // The common case, already canonical: no copy.
    if path.starts_with('/')
        && (path.len() == 1 || !path.ends_with('/'))
        && !path.contains("//")
        && !path.contains('%')
        && !path.split('/').any(|s| s == "." || s == "..")
    {
        return Cow::Borrowed(path);
    }
    let mut segments: Vec<String> = Vec::new();
    for raw in path.split('/') {
        let seg = decode_unreserved(raw);
        match seg.as_str() {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            _ => segments.push(seg),
        }
    }
    let mut out = String::with_capacity(path.len() + 1);
    for seg in &segments {
        out.push('/');
        out.push_str(seg);
    }
    if out.is_empty() {
        out.push('/');
    }
    Cow::Owned(out)
}

/// A request target up to its query or fragment.
fn path_part(target: &str) -> &str {
    match memchr::memchr2(b'?', b'#', target.as_bytes()) {
        Some(i) => &target[..i],
        None => target,
    }
}

fn decode_unreserved(seg: &str) -> String {
    if !seg.contains('%') {
        return seg.to_string();
    }
    let b = seg.as_bytes();
    let mut out = String::with_capacity(seg.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = |c: u8| (c as char).to_digit(16);
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                let c = (h * 16 + l) as u8;
                if c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~') {
                    out.push(c as char);
                    i += 3;
                    continue;
                }
            }
        }
        // Not a decodable unreserved escape: copy one (possibly multi-byte) char.
        let ch = seg[i..].chars().next().unwrap_or('%');
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_routes() {
        assert_eq!(
            Route::from_request("POST", "/v1/chat/completions?a=b"),
            Some(Route::ChatCompletions)
        );
        assert_eq!(
            Route::from_request("POST", "/v1/messages"),
            Some(Route::Messages)
        );
        assert_eq!(
            Route::from_request("GET", "/v1/models"),
            Some(Route::Models)
        );
        assert_eq!(Route::from_request("GET", "/v1/chat/completions"), None);
        assert_eq!(Route::from_request("POST", "/v2/x"), None);
        assert_eq!(Route::Messages.family(), Family::Anthropic);
        assert_eq!(
            Route::from_request("POST", "/v1/messages/count_tokens"),
            Some(Route::CountTokens)
        );
        assert_eq!(Route::CountTokens.family(), Family::Anthropic);
        assert_eq!(
            Route::by_path("/v1/chat/completions"),
            Some(Route::ChatCompletions)
        );
        assert_eq!(Route::by_path("/v1/nothing"), None);
    }

    #[test]
    fn paths_match_after_normalisation() {
        for p in [
            "/v1/chat/completions/",
            "//v1//chat/completions",
            "/v1/./chat/completions",
            "/v1/x/../chat/completions",
            "/v1/chat/%63ompletions",
            "/%76%31/chat/completions",
            "/v1/chat/completions?stream=true",
            "/../../v1/chat/completions",
        ] {
            assert_eq!(normalize(p), "/v1/chat/completions", "{p}");
            assert_eq!(
                Route::from_request("POST", p),
                Some(Route::ChatCompletions),
                "{p}"
            );
        }
    }

    #[test]
    fn reserved_or_broken_escapes_are_not_decoded() {
        assert_eq!(
            normalize("/v1%2Fchat/completions"),
            "/v1%2Fchat/completions"
        );
        assert_eq!(Route::from_request("POST", "/v1%2Fchat/completions"), None);
        assert_eq!(normalize("/v1/%zz/%4"), "/v1/%zz/%4");
        assert_eq!(normalize("/v1/%00"), "/v1/%00");
        assert_eq!(normalize("/é/%"), "/é/%");
        assert_eq!(normalize(""), "/");
    }
}
