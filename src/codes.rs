//! The client-facing vocabulary: every error code Sluice answers with (SPEC §4) and
//! every reason a committed stream can be ended for (SPEC §2, §5.9).
//!
//! One table holds each code's status, wire name and error `type` per API family, so
//! a status can never drift from its code and no call site spells a code as a string.
//! Plain data with no dependencies: policies return these, `proxy::respond` renders
//! them. The rows of SPEC §4 are [`ErrorCode::SPEC_TABLE`]; the few codes beyond that
//! table (an unknown route, an unknown lease, a lease change the store did not accept,
//! and the HTTP-layer 405 / 408 / 431) are listed in `docs/decisions.md`.

/// An error Sluice itself answers with (an upstream error passed through has none).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    InvalidRequest,
    Unauthorized,
    Forbidden,
    ModelNotFound,
    NoExecutableTargets,
    LeaseGenerationStale,
    BodyTooLarge,
    QueueFull,
    LeaseCapacityUnavailable,
    RateLimited,
    AllTargetsCoolingDown,
    QueueTimeout,
    ExecutionTimeout,
    UpstreamUnavailable,
    UpstreamTimeout,
    /// Beyond §4: no client route matches the method and path.
    RouteNotFound,
    /// Beyond §4: renew/release of a lease that does not exist (or has expired).
    LeaseNotFound,
    /// Beyond §4: a lease change could not be made durable (SPEC §5.6, §7).
    StateStoreUnavailable,
    /// Beyond §4: the path is a route, the method is not its method.
    MethodNotAllowed,
    /// Beyond §4: the request body stopped arriving (`server.client_body_timeout`).
    RequestTimeout,
    /// Beyond §4: the request header outgrew the limit.
    HeaderTooLarge,
}

/// One row of the table: status, code, OpenAI `type`, Anthropic `type`.
struct Row(u16, &'static str, &'static str, &'static str);

impl ErrorCode {
    /// The rows of SPEC §4, in its order.
    pub const SPEC_TABLE: [ErrorCode; 15] = [
        ErrorCode::InvalidRequest,
        ErrorCode::Unauthorized,
        ErrorCode::Forbidden,
        ErrorCode::ModelNotFound,
        ErrorCode::NoExecutableTargets,
        ErrorCode::LeaseGenerationStale,
        ErrorCode::BodyTooLarge,
        ErrorCode::QueueFull,
        ErrorCode::LeaseCapacityUnavailable,
        ErrorCode::RateLimited,
        ErrorCode::AllTargetsCoolingDown,
        ErrorCode::QueueTimeout,
        ErrorCode::ExecutionTimeout,
        ErrorCode::UpstreamUnavailable,
        ErrorCode::UpstreamTimeout,
    ];

    fn row(self) -> Row {
        use ErrorCode as E;
        const INVALID: &str = "invalid_request_error";
        match self {
            E::InvalidRequest => Row(400, "invalid_request", INVALID, INVALID),
            E::Unauthorized => Row(
                401,
                "unauthorized",
                "authentication_error",
                "authentication_error",
            ),
            E::Forbidden => Row(403, "forbidden", "permission_error", "permission_error"),
            E::ModelNotFound => Row(404, "model_not_found", "not_found_error", "not_found_error"),
            E::NoExecutableTargets => Row(
                404,
                "no_executable_targets",
                "not_found_error",
                "not_found_error",
            ),
            E::LeaseGenerationStale => Row(409, "lease_generation_stale", INVALID, INVALID),
            E::BodyTooLarge => Row(413, "body_too_large", INVALID, "request_too_large"),
            E::QueueFull => Row(
                429,
                "RATE_LIMIT_QUEUE_FULL",
                "rate_limit_error",
                "rate_limit_error",
            ),
            E::LeaseCapacityUnavailable => Row(
                429,
                "lease_capacity_unavailable",
                "rate_limit_error",
                "rate_limit_error",
            ),
            E::RateLimited => Row(
                429,
                "rate_limit_error",
                "rate_limit_error",
                "rate_limit_error",
            ),
            E::AllTargetsCoolingDown => Row(
                503,
                "all_targets_cooling_down",
                "server_error",
                "overloaded_error",
            ),
            E::QueueTimeout => Row(
                503,
                "RATE_LIMIT_QUEUE_TIMEOUT",
                "server_error",
                "overloaded_error",
            ),
            E::ExecutionTimeout => Row(
                504,
                "RATE_LIMIT_EXECUTION_TIMEOUT",
                "server_error",
                "timeout_error",
            ),
            E::UpstreamUnavailable => Row(502, "upstream_unavailable", "server_error", "api_error"),
            E::UpstreamTimeout => Row(504, "upstream_timeout", "server_error", "timeout_error"),
            E::RouteNotFound => Row(404, "route_not_found", "not_found_error", "not_found_error"),
            E::LeaseNotFound => Row(404, "lease_not_found", "not_found_error", "not_found_error"),
            E::StateStoreUnavailable => {
                Row(503, "state_store_unavailable", "server_error", "api_error")
            }
            E::MethodNotAllowed => Row(405, "method_not_allowed", INVALID, INVALID),
            E::RequestTimeout => Row(408, "request_timeout", INVALID, INVALID),
            E::HeaderTooLarge => Row(431, "request_header_too_large", INVALID, INVALID),
        }
    }

    pub fn status(self) -> u16 {
        self.row().0
    }

    /// The `code` field on the wire (also the access log's note).
    pub fn as_str(self) -> &'static str {
        self.row().1
    }

    /// The OpenAI-family `error.type`.
    pub fn openai_type(self) -> &'static str {
        self.row().2
    }

    /// The Anthropic-family `error.type`.
    pub fn anthropic_type(self) -> &'static str {
        self.row().3
    }

    /// Synthesised 429 and 503 answers always carry `Retry-After` (SPEC §4).
    pub fn needs_retry_after(self) -> bool {
        matches!(self.status(), 429 | 503)
    }
}

/// Why a committed response was ended before the upstream finished it. After the
/// commit point there is no failover: the client gets an SSE error event (or, for any
/// other body, a cut connection) carrying this reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AbortReason {
    /// No content event for `stream.stall_timeout`.
    Stall,
    /// Useful output below the throughput watchdog's minimum.
    Throughput,
    /// `queue.execution_timeout` passed mid-stream.
    ExecutionTimeout,
    /// The upstream connection broke or the body ended early (truncated framing).
    UpstreamError,
    /// The client went away.
    ClientGone,
    /// The gateway's drain deadline passed while the stream was open (SPEC §8.1).
    Shutdown,
}

impl AbortReason {
    pub const ALL: [AbortReason; 6] = [
        AbortReason::Stall,
        AbortReason::Throughput,
        AbortReason::ExecutionTimeout,
        AbortReason::UpstreamError,
        AbortReason::ClientGone,
        AbortReason::Shutdown,
    ];

    /// Metric label (`stream_aborts_total{reason}`) and the error event's `code`.
    pub fn as_str(self) -> &'static str {
        match self {
            AbortReason::Stall => "stall",
            AbortReason::Throughput => "throughput",
            AbortReason::ExecutionTimeout => "execution_timeout",
            AbortReason::UpstreamError => "upstream_error",
            AbortReason::ClientGone => "client_gone",
            AbortReason::Shutdown => "shutdown",
        }
    }

    /// The error event's human-readable message.
    pub fn message(self) -> &'static str {
        match self {
            AbortReason::Stall => "the upstream stream stalled",
            AbortReason::Throughput => "the upstream stream is below the throughput minimum",
            AbortReason::ExecutionTimeout => "the execution deadline passed mid-stream",
            AbortReason::UpstreamError => "the upstream connection failed mid-response",
            AbortReason::ClientGone => "the client went away",
            AbortReason::Shutdown => "the gateway is shutting down",
        }
    }

    /// A guard judged the upstream too slow: recorded on the connection (SPEC §5.3).
    pub fn is_slow_upstream(self) -> bool {
        matches!(self, AbortReason::Stall | AbortReason::Throughput)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn the_spec_table_rows() {
        let rows: Vec<(u16, &str)> = ErrorCode::SPEC_TABLE
            .iter()
            .map(|c| (c.status(), c.as_str()))
            .collect();
        assert_eq!(
            rows,
            vec![
                (400, "invalid_request"),
                (401, "unauthorized"),
                (403, "forbidden"),
                (404, "model_not_found"),
                (404, "no_executable_targets"),
                (409, "lease_generation_stale"),
                (413, "body_too_large"),
                (429, "RATE_LIMIT_QUEUE_FULL"),
                (429, "lease_capacity_unavailable"),
                (429, "rate_limit_error"),
                (503, "all_targets_cooling_down"),
                (503, "RATE_LIMIT_QUEUE_TIMEOUT"),
                (504, "RATE_LIMIT_EXECUTION_TIMEOUT"),
                (502, "upstream_unavailable"),
                (504, "upstream_timeout"),
            ]
        );
    }

    #[test]
    fn codes_are_unique_and_types_follow_the_family() {
        let all = [
            ErrorCode::RouteNotFound,
            ErrorCode::LeaseNotFound,
            ErrorCode::StateStoreUnavailable,
            ErrorCode::MethodNotAllowed,
            ErrorCode::RequestTimeout,
            ErrorCode::HeaderTooLarge,
        ];
        let names: HashSet<&str> = ErrorCode::SPEC_TABLE
            .iter()
            .chain(all.iter())
            .map(|c| c.as_str())
            .collect();
        assert_eq!(names.len(), ErrorCode::SPEC_TABLE.len() + all.len());
        assert_eq!(
            ErrorCode::BodyTooLarge.anthropic_type(),
            "request_too_large"
        );
        assert_eq!(
            ErrorCode::AllTargetsCoolingDown.anthropic_type(),
            "overloaded_error"
        );
        assert_eq!(ErrorCode::UpstreamTimeout.openai_type(), "server_error");
        assert!(ErrorCode::QueueTimeout.needs_retry_after());
        assert!(!ErrorCode::UpstreamTimeout.needs_retry_after());
    }

    #[test]
    fn abort_labels_are_unique() {
        let labels: HashSet<&str> = AbortReason::ALL.iter().map(|a| a.as_str()).collect();
        assert_eq!(labels.len(), AbortReason::ALL.len());
        assert!(AbortReason::Stall.is_slow_upstream());
        assert!(!AbortReason::UpstreamError.is_slow_upstream());
    }
}
