//! The validated configuration: what the gateway actually runs on.
//!
//! Invariants established by `validate` (so no other module re-checks them): ids are
//! unique and non-empty; every target names an existing provider (and connection, when
//! pinned); every provider has at least one connection; durations and sizes are within
//! their documented ranges; secrets are loaded and never printed (`Secret`'s `Debug`
//! masks them).

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// A credential loaded from an env var or a file. `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: String) -> Self {
        Self(value)
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// The API family a provider speaks and a client route belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    OpenAi,
    Anthropic,
}

impl Family {
    pub fn as_str(self) -> &'static str {
        match self {
            Family::OpenAi => "openai",
            Family::Anthropic => "anthropic",
        }
    }
}

/// Provider class: picks the default thresholds of the resilience layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProviderClass {
    ApiKey,
    OAuth,
    Local,
}

impl ProviderClass {
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderClass::ApiKey => "apikey",
            ProviderClass::OAuth => "oauth",
            ProviderClass::Local => "local",
        }
    }
}

/// Target choice within a model (SPEC §5.12).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    Priority,
    Weighted,
    RoundRobin,
    Random,
    LeastUsed,
    P2c,
    FillFirst,
    CostOptimized,
    ResetAware,
}

impl Strategy {
    /// Every strategy, in the order the documentation lists them.
    pub const ALL: [Strategy; 9] = [
        Strategy::Priority,
        Strategy::Weighted,
        Strategy::RoundRobin,
        Strategy::Random,
        Strategy::LeastUsed,
        Strategy::P2c,
        Strategy::FillFirst,
        Strategy::CostOptimized,
        Strategy::ResetAware,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Priority => "priority",
            Strategy::Weighted => "weighted",
            Strategy::RoundRobin => "round-robin",
            Strategy::Random => "random",
            Strategy::LeastUsed => "least-used",
            Strategy::P2c => "p2c",
            Strategy::FillFirst => "fill-first",
            Strategy::CostOptimized => "cost-optimized",
            Strategy::ResetAware => "reset-aware",
        }
    }

    /// The strategy spelled `name` in the configuration, if any.
    pub fn from_name(name: &str) -> Option<Strategy> {
        Strategy::ALL.into_iter().find(|s| s.as_str() == name)
    }
}

/// A parsed upstream base URL.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BaseUrl {
    pub tls: bool,
    pub host: String,
    pub port: u16,
    /// Path prefix without a trailing slash ("" for none); the client route is appended.
    pub path_prefix: String,
    /// The `Host` value, made once (every request sends it).
    authority: String,
    /// `host` when it is an address literal (it then needs no lookup), parsed once.
    ip: Option<std::net::IpAddr>,
}

impl BaseUrl {
    pub fn new(tls: bool, host: String, port: u16, path_prefix: String) -> BaseUrl {
        let default = if tls { 443 } else { 80 };
        let bracketed = if host.contains(':') {
            format!("[{host}]")
        } else {
            host.clone()
        };
        let authority = if port == default {
            bracketed
        } else {
            format!("{bracketed}:{port}")
        };
        BaseUrl {
            tls,
            ip: host.parse().ok(),
            host,
            port,
            path_prefix,
            authority,
        }
    }

    /// The host as an address, when it is one.
    pub fn ip(&self) -> Option<std::net::IpAddr> {
        self.ip
    }

    /// `host` or `host:port` when the port is not the scheme's default (for `Host`).
    pub fn authority(&self) -> &str {
        &self.authority
    }
}

/// `server.access_log.format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AccessFormat {
    #[default]
    Text,
    Json,
    Off,
}

impl AccessFormat {
    pub fn parse(s: &str) -> Option<AccessFormat> {
        match s {
            "text" => Some(AccessFormat::Text),
            "json" => Some(AccessFormat::Json),
            "off" => Some(AccessFormat::Off),
            _ => None,
        }
    }
}

/// `state.redis`, validated. The URL may hold a password: it is a [`Secret`].
#[derive(Clone, Debug)]
pub struct RedisConfig {
    pub url: Secret,
    pub key_prefix: String,
    pub sync_interval: Duration,
}

/// Default of `server.client_header_timeout`, in seconds (SPEC §6).
pub const DEFAULT_CLIENT_HEADER_TIMEOUT_S: u64 = 30;
/// Default of `server.client_body_timeout`, in seconds (SPEC §6).
pub const DEFAULT_CLIENT_BODY_TIMEOUT_S: u64 = 60;
/// Default of `server.keepalive_timeout`, in seconds (SPEC §6).
pub const DEFAULT_KEEPALIVE_TIMEOUT_S: u64 = 75;

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub listen: String,
    pub admin_listen: String,
    pub threads: usize,
    pub max_body_bytes: usize,
    pub max_attempts: usize,
    /// The whole request header must arrive within this (from the accept, or from the
    /// first byte of a request on a kept-alive connection).
    pub client_header_timeout: Duration,
    /// Longest gap between two reads of a request body.
    pub client_body_timeout: Duration,
    /// An idle kept-alive client connection is closed after this.
    pub keepalive_timeout: Duration,
    /// Client connections served at once; 0 = derived from the file limit at startup.
    pub max_client_connections: usize,
    pub access_log: AccessFormat,
    /// How long requests in flight may finish after a stop or upgrade signal.
    pub drain_timeout: Duration,
    /// The unix socket an upgrading process receives the listeners on (SPEC §8.1).
    pub upgrade_sock: String,
}

#[derive(Clone, Debug)]
pub struct AdminConfig {
    pub token: Option<Secret>,
    pub protect_metrics: bool,
}

#[derive(Clone, Debug)]
pub struct Client {
    pub id: String,
    /// SHA-256 (lower-case hex) of the client key; the key itself is not kept.
    pub key_sha256: String,
    pub scopes: Vec<String>,
    /// `provider/connection` ids; `None` = every connection.
    pub allowed_connections: Option<Vec<String>>,
}

#[derive(Clone, Debug)]
pub struct Connection {
    pub id: String,
    pub key: Option<Secret>,
    pub max_concurrent: Option<u32>,
    pub model_concurrency: BTreeMap<String, u32>,
    pub bucket: Option<String>,
    pub retry_delay: Option<Duration>,
    pub disable_cooling: bool,
    /// The Claude subscription lane (SPEC §5.13); only on `class: oauth` Anthropic
    /// providers.
    pub subscription: Option<Subscription>,
}

/// `connections[].subscription`, validated: at least one of the two mechanisms is on
/// (a block with both off is dropped), and `limit_reset` has its organization.
#[derive(Clone, Debug, PartialEq)]
pub struct Subscription {
    pub low_priority: bool,
    pub limit_reset: bool,
    pub organization_uuid: Option<String>,
    /// Where the usage check and the claim go (default: the provider's base URL).
    pub oauth_base: Option<BaseUrl>,
}

impl Subscription {
    pub fn settings(&self) -> crate::policy::subscription::Settings {
        crate::policy::subscription::Settings {
            low_priority: self.low_priority,
            limit_reset: self.limit_reset,
        }
    }
}

/// `providers[].http2`: HTTP/2 to the upstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Http2 {
    /// Offered by ALPN on TLS (HTTP/1.1 if the upstream declines); HTTP/1.1 in clear.
    #[default]
    Auto,
    /// HTTP/2 only: by ALPN on TLS, with prior knowledge (h2c) in clear.
    On,
    Off,
}

/// `providers[].tls`, loaded: the CA the upstream's certificate must chain to (instead
/// of the system store), the client certificate for mutual TLS, and whether to verify.
#[derive(Clone)]
pub struct UpstreamTls {
    pub ca: Option<std::sync::Arc<pingora::protocols::tls::CaType>>,
    pub client: Option<std::sync::Arc<pingora::utils::tls::CertKey>>,
    pub verify: bool,
    /// A hash of the certificates, key and `verify` as loaded: connections made under
    /// other TLS settings (before a reload changed them) are never reused.
    pub fingerprint: u64,
}

impl Default for UpstreamTls {
    fn default() -> Self {
        UpstreamTls {
            ca: None,
            client: None,
            verify: true,
            fingerprint: 0,
        }
    }
}

impl std::fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("UpstreamTls")
            .field("ca", &self.ca.as_ref().map(|c| c.len()))
            .field("client_cert", &self.client.is_some())
            .field("verify", &self.verify)
            .finish()
    }
}

#[derive(Clone, Debug)]
pub struct Provider {
    pub id: String,
    pub base_url: BaseUrl,
    pub api: Family,
    pub class: ProviderClass,
    pub retry_delay: Option<Duration>,
    pub connect_timeout: Duration,
    pub quota_family: Option<String>,
    pub http2: Http2,
    pub tls: UpstreamTls,
    /// The upstream pool's group for this provider: its id, TLS files' fingerprint (with
    /// `verify`), base URL and HTTP/2 setting — what its peers are made of but the
    /// address — hashed once at load (see `proxy::transport`).
    pub pool_key: u64,
    pub connections: Vec<Connection>,
}

#[derive(Clone, Debug)]
pub struct Target {
    /// Index into `Config::providers`.
    pub provider: usize,
    pub model: String,
    /// Index into that provider's connections when pinned.
    pub connection: Option<usize>,
    pub weight: u32,
    pub cost: Option<f64>,
    pub quota_family: Option<String>,
}

#[derive(Clone, Debug)]
pub struct Model {
    pub name: String,
    pub strategy: Strategy,
    /// Weight of the latency term of `p2c` (0–20; 0 = in-flight count only).
    pub p2c_latency_weight: f64,
    pub cooldown_wait: bool,
    pub targets: Vec<Target>,
}

impl Model {
    /// A name with a trailing `*` (`claude-*`) matches every client model id that extends
    /// its prefix; its targets may leave `model` empty to pass the client's id on.
    pub fn is_pattern(&self) -> bool {
        self.name.ends_with('*')
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct BreakerClass {
    pub degrade_at: u32,
    pub open_at: u32,
    pub reset: Duration,
}

#[derive(Clone, Debug, PartialEq)]
pub struct WindowClass {
    pub threshold: u32,
    pub window: Duration,
    pub cooldown: Duration,
}

/// A value per provider class.
#[derive(Clone, Debug, PartialEq)]
pub struct PerClass<T> {
    pub apikey: T,
    pub oauth: T,
    pub local: T,
}

impl<T> PerClass<T> {
    pub fn get(&self, class: ProviderClass) -> &T {
        match class {
            ProviderClass::ApiKey => &self.apikey,
            ProviderClass::OAuth => &self.oauth,
            ProviderClass::Local => &self.local,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Resilience {
    pub breaker: PerClass<BreakerClass>,
    pub max_backoff_multiplier: u32,
    pub provider_cooldown_enabled: bool,
    pub provider_cooldown: PerClass<WindowClass>,
    pub max_cooldown: Duration,
    pub max_hint: Duration,
    pub lock_threshold: Duration,
    pub model_lockout: ModelLockout,
    pub affinity_ttl: Duration,
    pub queue: Queue,
    pub combo_wait: ComboWait,
    pub stream: StreamGuards,
    pub watchdog: Watchdog,
    pub stream_stall_cooldown: bool,
    /// `SLUICE_RATE_LIMIT_RESET_SECONDS`: fallback cooldown for rate limits without hints.
    pub env_rate_limit_reset: Option<Duration>,
}

#[derive(Clone, Debug)]
pub struct ModelLockout {
    pub enabled: bool,
    pub error_codes: Vec<u16>,
    pub base_cooldown: Duration,
    pub max_cooldown: Duration,
    pub max_backoff_steps: u32,
    pub exponential: bool,
}

#[derive(Clone, Debug)]
pub struct Queue {
    pub max_depth: u32,
    pub wait: Duration,
    pub execution_timeout: Duration,
    pub fail_open: bool,
}

#[derive(Clone, Debug)]
pub struct ComboWait {
    pub enabled: bool,
    pub max_wait: Duration,
    pub max_attempts: u32,
    pub budget: Duration,
}

#[derive(Clone, Debug)]
pub struct StreamGuards {
    pub ttft_timeout: Duration,
    pub stall_timeout: Duration,
}

#[derive(Clone, Debug)]
pub struct Watchdog {
    pub enabled: bool,
    pub warmup: Duration,
    pub window: Duration,
    pub min_bytes_per_sec: u32,
}

/// The whole validated configuration.
#[derive(Clone, Debug)]
pub struct Config {
    pub source: PathBuf,
    pub server: ServerConfig,
    pub state_path: PathBuf,
    /// `state.backend: redis`: the shared store (SPEC §7.1); `None` = the embedded redb.
    pub redis: Option<RedisConfig>,
    pub rules_dir: PathBuf,
    pub admin: AdminConfig,
    /// `None` = open listener (development default, warned at startup).
    pub clients: Option<Vec<Client>>,
    pub providers: Vec<Provider>,
    pub models: Vec<Model>,
    pub resilience: Resilience,
    pub emergency_fallback: Option<String>,
}

impl Config {
    pub fn model(&self, name: &str) -> Option<&Model> {
        self.models.iter().find(|m| m.name == name)
    }
}
