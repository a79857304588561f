//! Raw serde shapes of the YAML config (SPEC §6).
//!
//! These types only describe the *shape* of the file: every struct rejects unknown keys,
//! durations and sizes stay strings, and list items are kept as YAML values so that
//! `validate` can parse each one on its own and report every broken item with its path,
//! instead of stopping at the first serde error. Nothing here is trusted by the gateway;
//! only the validated `Config` is.

use serde::Deserialize;
use serde_yaml::Value;
use std::collections::BTreeMap;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub listen: Option<String>,
    pub admin_listen: Option<String>,
    pub threads: Option<usize>,
    pub max_body_bytes: Option<Value>,
    pub max_attempts: Option<usize>,
    pub client_header_timeout: Option<String>,
    pub client_body_timeout: Option<String>,
    pub keepalive_timeout: Option<String>,
    pub max_client_connections: Option<usize>,
    pub access_log: Option<RawAccessLog>,
    pub drain_timeout: Option<String>,
    pub upgrade_sock: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAccessLog {
    pub format: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawState {
    pub backend: Option<String>,
    pub path: Option<String>,
    pub redis: Option<RawRedis>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRedis {
    pub url_env: Option<String>,
    pub url_file: Option<String>,
    pub key_prefix: Option<String>,
    pub sync_interval: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAdmin {
    pub token_env: Option<String>,
    pub token_file: Option<String>,
    #[serde(default)]
    pub protect_metrics: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawClient {
    pub id: String,
    pub key_env: Option<String>,
    pub key_file: Option<String>,
    pub key_sha256: Option<String>,
    #[serde(default)]
    pub scopes: Vec<String>,
    pub allowed_connections: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawProvider {
    pub id: String,
    pub base_url: String,
    pub api: String,
    pub class: Option<String>,
    pub retry_delay: Option<String>,
    pub connect_timeout: Option<String>,
    pub quota_family: Option<String>,
    pub http2: Option<String>,
    pub tls: Option<RawTls>,
    #[serde(default)]
    pub connections: Vec<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    pub ca_file: Option<String>,
    pub client_cert_file: Option<String>,
    pub client_key_file: Option<String>,
    pub verify: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConnection {
    pub id: String,
    pub api_key_env: Option<String>,
    pub api_key_file: Option<String>,
    pub max_concurrent: Option<u32>,
    #[serde(default)]
    pub model_concurrency: BTreeMap<String, u32>,
    pub bucket: Option<String>,
    pub retry_delay: Option<String>,
    #[serde(default)]
    pub disable_cooling: bool,
    /// Read as [`RawSubscription`] with its own field path.
    pub subscription: Option<Value>,
}

/// `providers[].connections[].subscription` (SPEC §5.13).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSubscription {
    #[serde(default)]
    pub low_priority: bool,
    #[serde(default)]
    pub limit_reset: bool,
    pub organization_uuid: Option<String>,
    pub oauth_base: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawModel {
    pub name: String,
    pub strategy: Option<String>,
    pub cooldown_wait: Option<bool>,
    pub p2c_latency_weight: Option<f64>,
    #[serde(default)]
    pub targets: Vec<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTarget {
    pub provider: String,
    pub model: Option<String>,
    pub connection: Option<String>,
    pub weight: Option<u32>,
    pub cost: Option<f64>,
    pub quota_family: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBreakerClass {
    pub degrade_at: Option<u32>,
    pub open_at: Option<u32>,
    pub reset: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBreaker {
    pub apikey: Option<RawBreakerClass>,
    pub oauth: Option<RawBreakerClass>,
    pub local: Option<RawBreakerClass>,
    pub max_backoff_multiplier: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawWindowClass {
    pub threshold: Option<u32>,
    pub window: Option<String>,
    pub cooldown: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawProviderCooldown {
    pub enabled: Option<bool>,
    pub apikey: Option<RawWindowClass>,
    pub oauth: Option<RawWindowClass>,
    pub local: Option<RawWindowClass>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConnectionCooldown {
    pub max_cooldown: Option<String>,
    pub max_hint: Option<String>,
    pub lock_threshold: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawModelLockout {
    pub enabled: Option<bool>,
    pub error_codes: Option<Vec<u16>>,
    pub base_cooldown: Option<String>,
    pub max_cooldown: Option<String>,
    pub max_backoff_steps: Option<u32>,
    pub exponential: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAffinity {
    pub ttl: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawQueue {
    pub max_depth: Option<u32>,
    pub wait: Option<String>,
    pub execution_timeout: Option<String>,
    pub fail_open: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawComboWait {
    pub enabled: Option<bool>,
    pub max_wait: Option<String>,
    pub max_attempts: Option<u32>,
    pub budget: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStream {
    pub ttft_timeout: Option<String>,
    pub stall_timeout: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawWatchdog {
    pub enabled: Option<bool>,
    pub warmup: Option<String>,
    pub window: Option<String>,
    pub min_bytes_per_sec: Option<u32>,
}

/// Top-level keys this version knows. Each section is parsed separately so one broken
/// section does not hide the problems of another.
pub const TOP_LEVEL_KEYS: &[&str] = &[
    "server",
    "state",
    "rules_dir",
    "admin",
    "clients",
    "providers",
    "models",
    "resilience",
    "emergency_fallback",
];

pub const RESILIENCE_KEYS: &[&str] = &[
    "breaker",
    "provider_cooldown",
    "connection_cooldown",
    "model_lockout",
    "session_affinity",
    "queue",
    "combo_wait",
    "stream",
    "watchdog",
    "stream_stall_cooldown",
];
