//! The mock's API routes and which wire family (OpenAI or Anthropic) each one speaks.
//!
//! A route is identified by method and path only (query strings ignored); a path with the
//! wrong method is not a route. The index is stable so counters can live in a fixed array.

use http::Method;

/// One API route of the mock upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Chat,
    Completions,
    Embeddings,
    Responses,
    Messages,
    Models,
}

impl Route {
    pub const COUNT: usize = 6;
    pub const ALL: [Route; Route::COUNT] = [
        Route::Chat,
        Route::Completions,
        Route::Embeddings,
        Route::Responses,
        Route::Messages,
        Route::Models,
    ];

    /// Matches a request line against the API routes.
    pub fn from_request(method: &Method, path: &str) -> Option<Route> {
        let route = match path {
            "/v1/chat/completions" => Route::Chat,
            "/v1/completions" => Route::Completions,
            "/v1/embeddings" => Route::Embeddings,
            "/v1/responses" => Route::Responses,
            "/v1/messages" => Route::Messages,
            "/v1/models" => Route::Models,
            _ => return None,
        };
        let expected = if route == Route::Models {
            Method::GET
        } else {
            Method::POST
        };
        (*method == expected).then_some(route)
    }

    pub fn path(self) -> &'static str {
        match self {
            Route::Chat => "/v1/chat/completions",
            Route::Completions => "/v1/completions",
            Route::Embeddings => "/v1/embeddings",
            Route::Responses => "/v1/responses",
            Route::Messages => "/v1/messages",
            Route::Models => "/v1/models",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }

    /// Anthropic-shaped bodies and errors; everything else is OpenAI-shaped.
    pub fn is_anthropic(self) -> bool {
        self == Route::Messages
    }

    /// Whether `"stream": true` turns the answer into server-sent events.
    pub fn can_stream(self) -> bool {
        matches!(
            self,
            Route::Chat | Route::Completions | Route::Responses | Route::Messages
        )
    }

    /// Whether the route takes a JSON request body.
    pub fn has_body(self) -> bool {
        self != Route::Models
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_matches_all_order_and_methods_matter() {
        for (i, r) in Route::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
            let m = if *r == Route::Models {
                Method::GET
            } else {
                Method::POST
            };
            assert_eq!(Route::from_request(&m, r.path()), Some(*r));
        }
        assert_eq!(
            Route::from_request(&Method::GET, "/v1/chat/completions"),
            None
        );
        assert_eq!(Route::from_request(&Method::POST, "/v1/other"), None);
    }
}
