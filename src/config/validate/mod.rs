//! Raw YAML → validated `Config`, collecting *every* problem with its field path.
//!
//! Each section and each list item is deserialised on its own, so a typo in
//! `providers[0]` does not hide a dangling reference in `models[3].targets[1]`. Secrets
//! are resolved here (env vars through the `env` lookup passed in, files relative to the
//! config file) and only their presence is ever reported, never their value.

mod resilience;
mod server;
mod transport;

use super::raw::*;
use super::types::*;
use super::units::parse_duration;
use serde::de::DeserializeOwned;
use serde_yaml::{Mapping, Value};
use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Largest secret file read (a key, a token).
const SECRET_FILE_MAX: usize = 64 * 1024;

/// One problem (or warning) found in a config file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub file: String,
    pub path: String,
    pub reason: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}: {}", self.file, self.reason)
        } else {
            write!(f, "{}: {}: {}", self.file, self.path, self.reason)
        }
    }
}

/// A validated config plus the warnings an operator should read.
#[derive(Debug)]
pub struct Loaded {
    pub config: Config,
    pub warnings: Vec<Problem>,
}

/// Environment lookup, passed in so tests and reloads do not depend on process state.
pub type EnvLookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// A config file as read from disk: its text, its name for messages, and the
/// directory relative `*_file` paths are resolved against.
pub struct ConfigText {
    pub text: String,
    pub file: String,
    pub dir: PathBuf,
}

/// Reads the config file at `path` (an unreadable file is a problem like any other).
pub fn read_source(path: &Path) -> Result<ConfigText, Vec<Problem>> {
    let file = path.display().to_string();
    let text = super::shape::read_file(path, super::shape::MAX_BYTES).map_err(|e| {
        vec![Problem {
            file: file.clone(),
            path: String::new(),
            reason: format!("cannot read file: {e}"),
        }]
    })?;
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    Ok(ConfigText { text, file, dir })
}

/// Reads and validates the config file at `path`.
pub fn load_file(path: &Path, env: EnvLookup<'_>) -> Result<Loaded, Vec<Problem>> {
    let src = read_source(path)?;
    parse_str(&src.text, &src.file, &src.dir, env)
}

/// Validates config text. `base_dir` anchors relative `*_file` paths.
pub fn parse_str(
    text: &str,
    file: &str,
    base_dir: &Path,
    env: EnvLookup<'_>,
) -> Result<Loaded, Vec<Problem>> {
    let mut v = Validator {
        file: file.to_string(),
        base_dir: base_dir.to_path_buf(),
        env,
        problems: Vec::new(),
        warnings: Vec::new(),
    };
    if let Err(reason) = super::shape::check(text) {
        v.err("", reason);
        return Err(v.problems);
    }
    let root: Value = match serde_yaml::from_str(text) {
        // An empty file is what a truncating write (`>`, an editor saving) leaves
        // behind for a moment: never a config (SPEC §6 reload safety).
        Ok(Value::Null) => {
            v.err("", "the file is empty (no YAML content): nothing to serve");
            return Err(v.problems);
        }
        Ok(v) => v,
        Err(e) => {
            v.err("", format!("not valid YAML: {e}"));
            return Err(v.problems);
        }
    };
    let Value::Mapping(root) = root else {
        v.err("", "the top level must be a mapping of sections");
        return Err(v.problems);
    };
    let config = v.config(&root, file);
    match config {
        Some(config) if v.problems.is_empty() => Ok(Loaded {
            config,
            warnings: v.warnings,
        }),
        _ => Err(v.problems),
    }
}

struct Validator<'a> {
    file: String,
    base_dir: PathBuf,
    env: EnvLookup<'a>,
    problems: Vec<Problem>,
    warnings: Vec<Problem>,
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// serde_yaml's messages end with a location that is relative to the item we fed it;
/// strip it so the path we print is the only location.
fn serde_reason(e: &serde_yaml::Error) -> String {
    let s = e.to_string();
    match s.find(" at line ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

impl Validator<'_> {
    fn err(&mut self, path: &str, reason: impl Into<String>) {
        self.problems.push(Problem {
            file: self.file.clone(),
            path: path.to_string(),
            reason: reason.into(),
        });
    }

    fn warn(&mut self, path: &str, reason: impl Into<String>) {
        self.warnings.push(Problem {
            file: self.file.clone(),
            path: path.to_string(),
            reason: reason.into(),
        });
    }

    fn section<T: DeserializeOwned + Default>(&mut self, root: &Mapping, key: &str) -> T {
        self.section_at(root, key, key)
    }

    fn section_at<T: DeserializeOwned + Default>(
        &mut self,
        root: &Mapping,
        key: &str,
        path: &str,
    ) -> T {
        match root.get(key) {
            None | Some(Value::Null) => T::default(),
            Some(v) => self.item(v.clone(), path).unwrap_or_default(),
        }
    }

    fn item<T: DeserializeOwned>(&mut self, value: Value, path: &str) -> Option<T> {
        match serde_yaml::from_value(value) {
            Ok(t) => Some(t),
            Err(e) => {
                self.err(path, serde_reason(&e));
                None
            }
        }
    }

    fn list(&mut self, root: &Mapping, key: &str) -> Vec<(String, Value)> {
        match root.get(key) {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Sequence(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| (format!("{key}[{i}]"), v.clone()))
                .collect(),
            Some(_) => {
                self.err(key, "must be a list");
                Vec::new()
            }
        }
    }

    fn duration(&mut self, path: &str, text: Option<&String>, default: Duration) -> Duration {
        match text {
            None => default,
            Some(t) => match parse_duration(t) {
                Ok(d) => d,
                Err(e) => {
                    self.err(path, e);
                    default
                }
            },
        }
    }

    fn bounded_duration(
        &mut self,
        path: &str,
        text: Option<&String>,
        default: Duration,
        min: Duration,
        max: Duration,
    ) -> Duration {
        let d = self.duration(path, text, default);
        if d < min || d > max {
            self.err(
                path,
                format!(
                    "must be between {} and {}",
                    humantime::format_duration(min),
                    humantime::format_duration(max)
                ),
            );
        }
        d
    }

    /// `state.backend` and `state.redis` (SPEC §6, §7.1): the URL from an env var or a
    /// file (never inline: it may carry a password), checked for a `redis://` or
    /// `rediss://` scheme without being shown.
    fn redis(&mut self, backend: Option<&str>, raw: Option<RawRedis>) -> Option<RedisConfig> {
        match backend.unwrap_or("redb") {
            "redb" => {
                if raw.is_some() {
                    self.warn("state.redis", "ignored: state.backend is redb");
                }
                return None;
            }
            "redis" => {}
            other => {
                self.err(
                    "state.backend",
                    format!("{other:?} is not one of redb, redis"),
                );
                return None;
            }
        }
        let Some(raw) = raw else {
            self.err(
                "state.redis",
                "state.backend: redis needs state.redis.url_env or url_file",
            );
            return None;
        };
        let url = self.secret_from(
            "state.redis",
            raw.url_env.as_ref(),
            raw.url_file.as_ref(),
            "url_env",
            "url_file",
        );
        let url = match url {
            Some(u) => u,
            None => {
                if raw.url_env.is_none() && raw.url_file.is_none() {
                    self.err(
                        "state.redis",
                        "needs url_env or url_file (the URL is never written in the config)",
                    );
                }
                return None;
            }
        };
        if !(url.expose().starts_with("redis://") || url.expose().starts_with("rediss://"))
            || redis::Client::open(url.expose()).is_err()
        {
            // The URL itself is never shown: it may hold a password.
            self.err("state.redis", "the URL is not a redis:// or rediss:// URL");
            return None;
        }
        let key_prefix = raw.key_prefix.unwrap_or_else(|| "sluice:".into());
        if key_prefix.is_empty()
            || key_prefix.len() > 64
            || key_prefix.contains(char::is_whitespace)
        {
            self.err(
                "state.redis.key_prefix",
                "must be 1 to 64 characters without spaces",
            );
        }
        let sync_interval = self.bounded_duration(
            "state.redis.sync_interval",
            raw.sync_interval.as_ref(),
            Duration::from_millis(250),
            Duration::from_millis(10),
            Duration::from_secs(60),
        );
        Some(RedisConfig {
            url,
            key_prefix,
            sync_interval,
        })
    }

    fn secret_from(
        &mut self,
        path: &str,
        env_key: Option<&String>,
        file_key: Option<&String>,
        env_field: &str,
        file_field: &str,
    ) -> Option<Secret> {
        match (env_key, file_key) {
            (Some(_), Some(_)) => {
                self.err(
                    path,
                    format!("set only one of {env_field} and {file_field}"),
                );
                None
            }
            (Some(var), None) => match (self.env)(var) {
                Some(v) if !v.trim().is_empty() => Some(Secret::new(v.trim().to_string())),
                Some(_) => {
                    self.err(
                        &join(path, env_field),
                        format!("environment variable {var} is empty"),
                    );
                    None
                }
                None => {
                    self.err(
                        &join(path, env_field),
                        format!("environment variable {var} is not set"),
                    );
                    None
                }
            },
            (None, Some(f)) => {
                let p = self.base_dir.join(f);
                match super::shape::read_file(&p, SECRET_FILE_MAX) {
                    Ok(v) if !v.trim().is_empty() => Some(Secret::new(v.trim().to_string())),
                    Ok(_) => {
                        self.err(
                            &join(path, file_field),
                            format!("file {} is empty", p.display()),
                        );
                        None
                    }
                    Err(e) => {
                        self.err(
                            &join(path, file_field),
                            format!("cannot read {}: {e}", p.display()),
                        );
                        None
                    }
                }
            }
            (None, None) => None,
        }
    }

    fn config(&mut self, root: &Mapping, file: &str) -> Option<Config> {
        for key in root.keys() {
            match key.as_str() {
                Some(k) if TOP_LEVEL_KEYS.contains(&k) => {}
                Some(k) => self.err(
                    k,
                    format!("unknown key; expected one of {}", TOP_LEVEL_KEYS.join(", ")),
                ),
                None => self.err("", "top-level keys must be strings"),
            }
        }
        let server = self.server(root);
        let mut state: RawState = self.section(root, "state");
        let redis = self.redis(state.backend.as_deref(), state.redis.take());
        let rules_dir = match root.get("rules_dir") {
            None | Some(Value::Null) => PathBuf::from("./rules"),
            Some(Value::String(s)) => PathBuf::from(s),
            Some(_) => {
                self.err("rules_dir", "must be a path string");
                PathBuf::from("./rules")
            }
        };
        let admin = self.admin(root);
        let providers = self.providers(root);
        let declared = declared_ids(root.get("providers"));
        let clients = self.clients(root, &providers);
        let models = self.models(root, &providers, &declared);
        let resilience = self.resilience(root);
        // A config that serves nothing is a half-written file, not an intent.
        for (section, empty) in [
            ("providers", root.get("providers").is_none_or(is_empty_list)),
            ("models", root.get("models").is_none_or(is_empty_list)),
        ] {
            if empty {
                self.err(
                    section,
                    format!("at least one entry is required (a config without {section} serves nothing)"),
                );
            }
        }
        let emergency_fallback = match root.get("emergency_fallback") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => {
                match models.iter().find(|m| &m.name == s) {
                    None => self.err("emergency_fallback", format!("unknown model {s:?}")),
                    // A fallback request keeps the client's id, which a pattern would pass on.
                    Some(m) if m.is_pattern() => self.err(
                        "emergency_fallback",
                        format!("{s:?} is a pattern; the fallback must be an exact model name"),
                    ),
                    Some(_) => {}
                }
                Some(s.clone())
            }
            Some(_) => {
                self.err("emergency_fallback", "must be a model name or null");
                None
            }
        };
        Some(Config {
            source: PathBuf::from(file),
            server,
            redis,
            state_path: PathBuf::from(state.path.unwrap_or_else(|| "./data/sluice.redb".into())),
            rules_dir,
            admin,
            clients,
            providers,
            models,
            resilience,
            emergency_fallback,
        })
    }

    fn admin(&mut self, root: &Mapping) -> AdminConfig {
        let raw: RawAdmin = self.section(root, "admin");
        let token = self.secret_from(
            "admin",
            raw.token_env.as_ref(),
            raw.token_file.as_ref(),
            "token_env",
            "token_file",
        );
        if token.is_none() && raw.token_env.is_none() && raw.token_file.is_none() {
            self.warn(
                "admin",
                "no admin token configured: every /api/* admin call answers 401",
            );
        }
        AdminConfig {
            token,
            protect_metrics: raw.protect_metrics,
        }
    }

    fn providers(&mut self, root: &Mapping) -> Vec<Provider> {
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        for (path, value) in self.list(root, "providers") {
            let Some(raw) = self.item::<RawProvider>(value, &path) else {
                continue;
            };
            self.id_check(&join(&path, "id"), &raw.id, &mut seen);
            let base_url = match parse_base_url(&raw.base_url) {
                Ok(u) => u,
                Err(e) => {
                    self.err(&join(&path, "base_url"), e);
                    continue;
                }
            };
            let api = match raw.api.as_str() {
                "openai" => Family::OpenAi,
                "anthropic" => Family::Anthropic,
                other => {
                    self.err(
                        &join(&path, "api"),
                        format!("unknown api {other:?}; expected openai or anthropic"),
                    );
                    continue;
                }
            };
            let class = match raw.class.as_deref().unwrap_or("apikey") {
                "apikey" => ProviderClass::ApiKey,
                "oauth" => ProviderClass::OAuth,
                "local" => ProviderClass::Local,
                other => {
                    self.err(
                        &join(&path, "class"),
                        format!("unknown class {other:?}; expected apikey, oauth or local"),
                    );
                    ProviderClass::ApiKey
                }
            };
            let retry_delay = raw
                .retry_delay
                .as_ref()
                .map(|t| self.duration(&join(&path, "retry_delay"), Some(t), Duration::ZERO));
            let connect_timeout = self.bounded_duration(
                &join(&path, "connect_timeout"),
                raw.connect_timeout.as_ref(),
                Duration::from_secs(10),
                Duration::from_millis(10),
                Duration::from_secs(300),
            );
            let http2 = self.http2(&path, raw.http2.as_deref());
            let tls = self.upstream_tls(&path, raw.tls, &base_url);
            let connections = self.connections(&path, raw.connections, class, api);
            if connections.is_empty() {
                self.err(
                    &join(&path, "connections"),
                    "a provider needs at least one connection",
                );
            }
            let pool_key = {
                use std::hash::{Hash, Hasher};
                let mut h = std::collections::hash_map::DefaultHasher::new();
                raw.id.hash(&mut h);
                tls.fingerprint.hash(&mut h);
                base_url.hash(&mut h);
                http2.hash(&mut h);
                h.finish()
            };
            out.push(Provider {
                id: raw.id,
                base_url,
                api,
                class,
                retry_delay,
                connect_timeout,
                quota_family: raw.quota_family,
                http2,
                pool_key,
                tls,
                connections,
            });
        }
        out
    }

    fn id_check(&mut self, path: &str, id: &str, seen: &mut HashSet<String>) {
        if id.is_empty() {
            self.err(path, "must not be empty");
        } else if id.contains('/') || id.chars().any(char::is_whitespace) {
            self.err(path, format!("{id:?} must not contain '/' or spaces"));
        } else if !seen.insert(id.to_string()) {
            self.err(path, format!("duplicate id {id:?}"));
        }
    }

    fn connections(
        &mut self,
        ppath: &str,
        items: Vec<Value>,
        class: ProviderClass,
        api: Family,
    ) -> Vec<Connection> {
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        for (i, value) in items.into_iter().enumerate() {
            let path = format!("{ppath}.connections[{i}]");
            let Some(raw) = self.item::<RawConnection>(value, &path) else {
                continue;
            };
            self.id_check(&join(&path, "id"), &raw.id, &mut seen);
            let key = self.secret_from(
                &path,
                raw.api_key_env.as_ref(),
                raw.api_key_file.as_ref(),
                "api_key_env",
                "api_key_file",
            );
            if raw.api_key_env.is_none()
                && raw.api_key_file.is_none()
                && class != ProviderClass::Local
            {
                self.warn(
                    &path,
                    "no api_key_env/api_key_file: requests go upstream without credentials",
                );
            }
            if raw.max_concurrent == Some(0) {
                self.err(&join(&path, "max_concurrent"), "must be at least 1");
            }
            for (m, n) in &raw.model_concurrency {
                if *n == 0 {
                    self.err(
                        &format!("{path}.model_concurrency.{m}"),
                        "must be at least 1",
                    );
                }
            }
            let retry_delay = raw
                .retry_delay
                .as_ref()
                .map(|t| self.duration(&join(&path, "retry_delay"), Some(t), Duration::ZERO));
            out.push(Connection {
                id: raw.id,
                key,
                max_concurrent: raw.max_concurrent,
                model_concurrency: raw.model_concurrency,
                bucket: raw.bucket,
                retry_delay,
                disable_cooling: raw.disable_cooling,
                subscription: raw.subscription.and_then(|sub| {
                    self.subscription(&join(&path, "subscription"), sub, class, api)
                }),
            });
        }
        out
    }

    /// `subscription:` of one connection (SPEC §5.13).
    fn subscription(
        &mut self,
        path: &str,
        value: Value,
        class: ProviderClass,
        api: Family,
    ) -> Option<Subscription> {
        let raw = self.item::<RawSubscription>(value, path)?;
        if class != ProviderClass::OAuth || api != Family::Anthropic {
            self.err(
                path,
                "the subscription lane is for Claude subscription accounts: it needs a provider with class: oauth and api: anthropic",
            );
            return None;
        }
        let org = raw.organization_uuid.filter(|o| {
            let ok = !o.is_empty()
                && o.len() <= 64
                && o.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
            if !ok {
                self.err(
                    &join(path, "organization_uuid"),
                    format!("{o:?} is not an organization id (letters, digits and '-')"),
                );
            }
            ok
        });
        if raw.limit_reset && org.is_none() {
            self.err(
                &join(path, "organization_uuid"),
                "required when limit_reset is on (the claim goes to /api/organizations/<uuid>/reset_rate_limits)",
            );
        }
        let oauth_base = raw.oauth_base.and_then(|u| match parse_base_url(&u) {
            Ok(b) => {
                let local = matches!(b.host.as_str(), "localhost" | "127.0.0.1" | "::1");
                if !b.tls && !local {
                    self.warn(
                        &join(path, "oauth_base"),
                        "http:// sends the account's token in clear; use https://",
                    );
                }
                Some(b)
            }
            Err(e) => {
                self.err(&join(path, "oauth_base"), e);
                None
            }
        });
        if !raw.low_priority && !raw.limit_reset {
            self.warn(
                path,
                "low_priority and limit_reset are both off: a usage wall cools the connection as usual",
            );
            return None;
        }
        Some(Subscription {
            low_priority: raw.low_priority,
            limit_reset: raw.limit_reset,
            organization_uuid: org,
            oauth_base,
        })
    }

    fn clients(&mut self, root: &Mapping, providers: &[Provider]) -> Option<Vec<Client>> {
        if matches!(root.get("clients"), None | Some(Value::Null)) {
            self.warn(
                "clients",
                "no clients section: the client listener is OPEN (any caller is served)",
            );
            return None;
        }
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        let mut hashes = HashSet::new();
        for (path, value) in self.list(root, "clients") {
            let Some(raw) = self.item::<RawClient>(value, &path) else {
                continue;
            };
            self.id_check(&join(&path, "id"), &raw.id, &mut seen);
            let sources = [
                raw.key_env.is_some(),
                raw.key_file.is_some(),
                raw.key_sha256.is_some(),
            ]
            .iter()
            .filter(|b| **b)
            .count();
            if sources != 1 {
                self.err(&path, "set exactly one of key_env, key_file and key_sha256");
                continue;
            }
            let key_sha256 = if let Some(h) = &raw.key_sha256 {
                let h = h.trim().to_ascii_lowercase();
                if h.len() != 64 || !h.chars().all(|c| c.is_ascii_hexdigit()) {
                    self.err(&join(&path, "key_sha256"), "must be 64 hex characters");
                    continue;
                }
                h
            } else {
                match self.secret_from(
                    &path,
                    raw.key_env.as_ref(),
                    raw.key_file.as_ref(),
                    "key_env",
                    "key_file",
                ) {
                    Some(s) => hex::encode(Sha256::digest(s.expose().as_bytes())),
                    None => continue,
                }
            };
            if !hashes.insert(key_sha256.clone()) {
                self.err(&path, "two clients share the same key");
            }
            for (i, scope) in raw.scopes.iter().enumerate() {
                if scope != "lease:exclusive" {
                    self.err(
                        &format!("{path}.scopes[{i}]"),
                        format!("unknown scope {scope:?}; known: lease:exclusive"),
                    );
                }
            }
            if raw.scopes.iter().any(|s| s == "lease:exclusive")
                && raw
                    .allowed_connections
                    .as_ref()
                    .is_none_or(|l| l.is_empty())
            {
                self.err(
                    &join(&path, "allowed_connections"),
                    "the lease:exclusive scope needs a non-empty allowed_connections list",
                );
            }
            if let Some(list) = &raw.allowed_connections {
                for (i, c) in list.iter().enumerate() {
                    if !connection_exists(providers, c) {
                        self.err(
                            &format!("{path}.allowed_connections[{i}]"),
                            format!("unknown connection {c:?} (write provider/connection)"),
                        );
                    }
                }
            }
            out.push(Client {
                id: raw.id,
                key_sha256,
                scopes: raw.scopes,
                allowed_connections: raw.allowed_connections,
            });
        }
        Some(out)
    }

    /// `declared` holds every provider id written in the file, valid or not, so a target
    /// of a provider that already failed validation is not reported a second time.
    fn models(
        &mut self,
        root: &Mapping,
        providers: &[Provider],
        declared: &HashSet<String>,
    ) -> Vec<Model> {
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        for (path, value) in self.list(root, "models") {
            let Some(raw) = self.item::<RawModel>(value, &path) else {
                continue;
            };
            let pattern = raw.name.ends_with('*');
            if raw.name.is_empty() || raw.name == "*" {
                self.err(&join(&path, "name"), "must not be empty (nor `*` alone)");
            } else if raw.name.trim_end_matches('*').contains('*') || raw.name.ends_with("**") {
                self.err(
                    &join(&path, "name"),
                    format!(
                        "{:?}: a pattern has one `*`, at the end (e.g. \"claude-*\")",
                        raw.name
                    ),
                );
            } else if !seen.insert(raw.name.clone()) {
                self.err(
                    &join(&path, "name"),
                    format!("duplicate model name {:?}", raw.name),
                );
            }
            let strategy = match raw.strategy.as_deref() {
                None => Strategy::Priority,
                Some(name) => Strategy::from_name(name).unwrap_or_else(|| {
                    let all: Vec<_> = Strategy::ALL.iter().map(|s| s.as_str()).collect();
                    self.err(
                        &join(&path, "strategy"),
                        format!(
                            "unknown strategy {name:?}; expected one of {}",
                            all.join(", ")
                        ),
                    );
                    Strategy::Priority
                }),
            };
            let p2c_latency_weight = match raw.p2c_latency_weight {
                None => 0.0,
                Some(w) if (0.0..=20.0).contains(&w) => w,
                Some(_) => {
                    self.err(
                        &join(&path, "p2c_latency_weight"),
                        "must be between 0 and 20",
                    );
                    0.0
                }
            };
            let mut targets = Vec::new();
            for (i, tv) in raw.targets.into_iter().enumerate() {
                let tpath = format!("{path}.targets[{i}]");
                let Some(t) = self.item::<RawTarget>(tv, &tpath) else {
                    continue;
                };
                let Some(pi) = providers.iter().position(|p| p.id == t.provider) else {
                    if !declared.contains(&t.provider) {
                        self.err(
                            &join(&tpath, "provider"),
                            format!("unknown provider {:?}", t.provider),
                        );
                    }
                    continue;
                };
                let connection = match &t.connection {
                    None => None,
                    Some(c) => match providers[pi].connections.iter().position(|x| &x.id == c) {
                        Some(ci) => Some(ci),
                        None => {
                            self.err(
                                &join(&tpath, "connection"),
                                format!("provider {:?} has no connection {c:?}", t.provider),
                            );
                            continue;
                        }
                    },
                };
                let model = match t.model {
                    Some(m) if m.is_empty() => {
                        self.err(&join(&tpath, "model"), "must not be empty");
                        m
                    }
                    Some(m) => m,
                    // The client's own id (SPEC §6 patterns).
                    None if pattern => String::new(),
                    None => {
                        self.err(
                            &join(&tpath, "model"),
                            "required (only the targets of a pattern model like \"claude-*\" may leave it out)",
                        );
                        String::new()
                    }
                };
                let weight = t.weight.unwrap_or(1);
                if !(1..=10_000).contains(&weight) {
                    self.err(&join(&tpath, "weight"), "must be between 1 and 10000");
                }
                if let Some(c) = t.cost {
                    if !(c.is_finite() && c >= 0.0) {
                        self.err(&join(&tpath, "cost"), "must be a number ≥ 0");
                    }
                }
                targets.push(Target {
                    provider: pi,
                    model,
                    connection,
                    weight,
                    cost: t.cost,
                    quota_family: t.quota_family,
                });
            }
            if targets.is_empty() && !self.problems.iter().any(|p| p.path.starts_with(&path)) {
                self.err(&join(&path, "targets"), "a model needs at least one target");
            }
            if strategy == Strategy::CostOptimized && targets.iter().any(|t| t.cost.is_none()) {
                self.warn(
                    &join(&path, "targets"),
                    "cost-optimized: targets without cost are tried last",
                );
            }
            out.push(Model {
                name: raw.name,
                strategy,
                p2c_latency_weight,
                cooldown_wait: raw.cooldown_wait.unwrap_or(true),
                targets,
            });
        }
        out
    }
}

/// The `id` of every item of a list section, whether or not the item is valid.
/// Absent, null or `[]`; anything else is validated (and reported) as the list it is.
fn is_empty_list(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Sequence(items) => items.is_empty(),
        _ => false,
    }
}

fn declared_ids(list: Option<&Value>) -> HashSet<String> {
    let Some(Value::Sequence(items)) = list else {
        return HashSet::new();
    };
    items
        .iter()
        .filter_map(|v| v.get("id").and_then(Value::as_str).map(str::to_string))
        .collect()
}

fn connection_exists(providers: &[Provider], id: &str) -> bool {
    let Some((p, c)) = id.split_once('/') else {
        return false;
    };
    providers
        .iter()
        .any(|x| x.id == p && x.connections.iter().any(|y| y.id == c))
}

/// Parses `http(s)://host[:port][/prefix]`.
pub fn parse_base_url(text: &str) -> Result<BaseUrl, String> {
    let (tls, rest) = if let Some(r) = text.strip_prefix("https://") {
        (true, r)
    } else if let Some(r) = text.strip_prefix("http://") {
        (false, r)
    } else {
        return Err(format!("{text:?} must start with http:// or https://"));
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    if path.contains('?') || path.contains('#') {
        return Err(format!("{text:?} must not carry a query or fragment"));
    }
    let default_port = if tls { 443 } else { 80 };
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let Some((h, after)) = v6.split_once(']') else {
            return Err(format!("{text:?} has an unclosed IPv6 bracket"));
        };
        let port = match after.strip_prefix(':') {
            Some(p) => p
                .parse()
                .map_err(|_| format!("{text:?} has an invalid port"))?,
            None if after.is_empty() => default_port,
            None => return Err(format!("{text:?} is not a valid URL")),
        };
        (h.to_string(), port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (
                h.to_string(),
                p.parse()
                    .map_err(|_| format!("{text:?} has an invalid port"))?,
            ),
            None => (authority.to_string(), default_port),
        }
    };
    if host.is_empty() || host.contains('@') {
        return Err(format!("{text:?} has no valid host"));
    }
    Ok(BaseUrl::new(
        tls,
        host,
        port,
        path.trim_end_matches('/').to_string(),
    ))
}
