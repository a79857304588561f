//! The client API surface (SPEC §3): which method + path is which route and family.

use crate::config::Family;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    ChatCompletions,
    Completions,
    Embeddings,
    Responses,
    Messages,
    Models,
    SessionLeases,
}

impl Route {
    /// Matches a request line; the query string is ignored.
    pub fn from_request(method: &str, path: &str) -> Option<Route> {
        let path = path.split('?').next().unwrap_or(path);
        let path = path.strip_suffix('/').unwrap_or(path);
        match (method, path) {
            ("POST", "/v1/chat/completions") => Some(Route::ChatCompletions),
            ("POST", "/v1/completions") => Some(Route::Completions),
            ("POST", "/v1/embeddings") => Some(Route::Embeddings),
            ("POST", "/v1/responses") => Some(Route::Responses),
            ("POST", "/v1/messages") => Some(Route::Messages),
            ("GET", "/v1/models") => Some(Route::Models),
            ("POST", "/api/v1/session-leases") => Some(Route::SessionLeases),
            _ => None,
        }
    }

    pub fn family(self) -> Family {
        match self {
            Route::Messages => Family::Anthropic,
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
            Route::Models => "models",
            Route::SessionLeases => "session_leases",
        }
    }
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
    }
}
