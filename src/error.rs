//! Boundary error types. Policies answer "no" with decision data, not with these.
//!
//! `ClientError` is the one shape every locally generated client-facing error takes
//! before `proxy::respond` renders it in the route's API family (SPEC §4); its status
//! comes from its [`ErrorCode`], never from the call site. `AdminError` is the admin
//! API's: each variant fixes its status, so a write the store did not accept can never
//! be answered 200.

use crate::codes::ErrorCode;
use thiserror::Error;

/// An error Sluice itself answers to a client (not an upstream error passed through).
#[derive(Debug, Clone)]
pub struct ClientError {
    pub code: ErrorCode,
    pub message: String,
    /// Whole seconds, ≥ 1, sent as `Retry-After` and required on synthesised 429/503.
    pub retry_after: Option<u64>,
    /// Extra fields placed inside `error` (e.g. `diagnostics`).
    pub extra: Option<serde_json::Map<String, serde_json::Value>>,
}

impl ClientError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            retry_after: None,
            extra: None,
        }
    }

    pub fn status(&self) -> u16 {
        self.code.status()
    }

    pub fn with_retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(crate::policy::client_retry_after(secs));
        self
    }

    pub fn with_extra(mut self, key: &str, value: serde_json::Value) -> Self {
        self.extra
            .get_or_insert_with(serde_json::Map::new)
            .insert(key.to_string(), value);
        self
    }

    pub fn invalid_request(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidRequest, message)
    }
}

/// Errors that stop the process from starting (reported by `main`, exit 1).
#[derive(Debug, Error)]
pub enum StartupError {
    #[error("configuration is invalid:\n{0}")]
    Config(String),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
    #[error("state store: {0}")]
    Store(String),
    #[error("metrics registry: {0}")]
    Metrics(#[from] prometheus::Error),
}

impl StartupError {
    /// Short, bounded label for logs and metrics.
    pub fn label(&self) -> &'static str {
        match self {
            StartupError::Config(_) => "config",
            StartupError::Listen { .. } => "listen",
            StartupError::Store(_) => "store",
            StartupError::Metrics(_) => "metrics",
        }
    }
}

/// Why an admin call failed; rendered by `admin` as `{"error": {code, message}}`.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AdminError {
    /// The request is malformed or names something that does not exist in its body.
    #[error("{0}")]
    BadRequest(String),
    /// No such route or object.
    #[error("{0}")]
    NotFound(String),
    /// A config reload that failed validation (the previous config keeps serving).
    #[error("{0}")]
    Rejected(String),
    /// The change was made in memory but the store did not commit it (it stays queued
    /// and is retried); the caller must not read it as done.
    #[error("{0}")]
    NotPersisted(String),
}

impl AdminError {
    pub fn status(&self) -> u16 {
        match self {
            AdminError::BadRequest(_) => 400,
            AdminError::NotFound(_) => 404,
            AdminError::Rejected(_) => 422,
            AdminError::NotPersisted(_) => 503,
        }
    }

    /// The `code` field on the wire.
    pub fn code(&self) -> &'static str {
        match self {
            AdminError::BadRequest(_) => "invalid_request",
            AdminError::NotFound(_) => "not_found",
            AdminError::Rejected(_) => "config_rejected",
            AdminError::NotPersisted(_) => ErrorCode::StateStoreUnavailable.as_str(),
        }
    }
}

impl From<String> for AdminError {
    fn from(message: String) -> Self {
        AdminError::BadRequest(message)
    }
}
