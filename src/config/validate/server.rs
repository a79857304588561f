//! Validation of the `server:` section (SPEC §6): listeners, sizes, attempts and the
//! client-connection limits that keep slow or idle clients from holding the gateway.

use super::Validator;
use crate::config::raw::RawServer;
use crate::config::types::{
    AccessFormat, ServerConfig, DEFAULT_CLIENT_BODY_TIMEOUT_S, DEFAULT_CLIENT_HEADER_TIMEOUT_S,
    DEFAULT_KEEPALIVE_TIMEOUT_S,
};
use crate::config::units::parse_size;
use serde_yaml::{Mapping, Value};
use std::time::Duration;

impl Validator<'_> {
    pub(super) fn server(&mut self, root: &Mapping) -> ServerConfig {
        let raw: RawServer = self.section(root, "server");
        // 0 (the default) = one worker thread per core the process may run on.
        let threads = match raw.threads.unwrap_or(0) {
            0 => std::thread::available_parallelism().map_or(2, |n| n.get().min(256)),
            n => n,
        };
        if !(1..=256).contains(&threads) {
            self.err("server.threads", "must be between 0 (one per core) and 256");
        }
        let max_attempts = raw.max_attempts.unwrap_or(3);
        if !(1..=20).contains(&max_attempts) {
            self.err("server.max_attempts", "must be between 1 and 20");
        }
        let max_body_bytes = match raw.max_body_bytes {
            None => 16 << 20,
            Some(Value::Number(n)) => n.as_u64().unwrap_or(0),
            Some(Value::String(s)) => match parse_size(&s) {
                Ok(n) => n,
                Err(e) => {
                    self.err("server.max_body_bytes", e);
                    16 << 20
                }
            },
            Some(_) => {
                self.err("server.max_body_bytes", "must be a size such as \"16MiB\"");
                16 << 20
            }
        };
        if !(1024..=(1u64 << 30)).contains(&max_body_bytes) {
            self.err("server.max_body_bytes", "must be between 1KiB and 1GiB");
        }
        let listen = raw.listen.unwrap_or_else(|| "0.0.0.0:8080".into());
        let admin_listen = raw.admin_listen.unwrap_or_else(|| "127.0.0.1:9090".into());
        for (path, addr) in [
            ("server.listen", &listen),
            ("server.admin_listen", &admin_listen),
        ] {
            if addr.parse::<std::net::SocketAddr>().is_err() {
                self.err(path, format!("{addr:?} is not an ip:port address"));
            }
        }
        let mut timeout = |field: &str, text: Option<&String>, default: u64| {
            let path = format!("server.{field}");
            let d = self.duration(&path, text, Duration::from_secs(default));
            if !(Duration::from_secs(1)..=Duration::from_secs(3600)).contains(&d) {
                self.err(&path, "must be between 1s and 1h");
            }
            d
        };
        let client_header_timeout = timeout(
            "client_header_timeout",
            raw.client_header_timeout.as_ref(),
            DEFAULT_CLIENT_HEADER_TIMEOUT_S,
        );
        let client_body_timeout = timeout(
            "client_body_timeout",
            raw.client_body_timeout.as_ref(),
            DEFAULT_CLIENT_BODY_TIMEOUT_S,
        );
        let keepalive_timeout = timeout(
            "keepalive_timeout",
            raw.keepalive_timeout.as_ref(),
            DEFAULT_KEEPALIVE_TIMEOUT_S,
        );
        let max_client_connections = raw.max_client_connections.unwrap_or(0);
        if max_client_connections > 1_000_000 {
            self.err(
                "server.max_client_connections",
                "must be at most 1000000 (0 = derived from the file limit)",
            );
        }
        let access_log = match raw.access_log.and_then(|a| a.format) {
            None => AccessFormat::Text,
            Some(f) => AccessFormat::parse(&f).unwrap_or_else(|| {
                self.err(
                    "server.access_log.format",
                    format!("{f:?} is not one of text, json, off"),
                );
                AccessFormat::Text
            }),
        };
        let drain_timeout = self.duration(
            "server.drain_timeout",
            raw.drain_timeout.as_ref(),
            Duration::from_secs(600),
        );
        if drain_timeout > Duration::from_secs(24 * 3600) {
            self.err("server.drain_timeout", "must be at most 24h");
        }
        let upgrade_sock = raw
            .upgrade_sock
            .unwrap_or_else(|| "/run/sluice/upgrade.sock".into());
        if upgrade_sock.is_empty() || upgrade_sock.len() > 100 {
            self.err(
                "server.upgrade_sock",
                "must be a unix socket path of 1 to 100 bytes",
            );
        }
        ServerConfig {
            listen,
            admin_listen,
            threads,
            max_body_bytes: max_body_bytes as usize,
            max_attempts,
            client_header_timeout,
            client_body_timeout,
            keepalive_timeout,
            max_client_connections,
            access_log,
            drain_timeout,
            upgrade_sock,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::parse_str;
    use crate::config::AccessFormat;
    use std::path::Path;

    fn threads(server: &str) -> usize {
        let yaml = format!("{server}providers:\n  - id: p\n    base_url: \"http://127.0.0.1:9\"\n    api: openai\n    connections: [ {{ id: c }} ]\nmodels:\n  - name: m\n    targets: [ {{ provider: p, model: u }} ]\n");
        parse_str(&yaml, "t.yaml", Path::new("."), &|_| None)
            .expect("valid config")
            .config
            .server
            .threads
    }

    #[test]
    fn threads_default_to_one_per_core() {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        assert_eq!(threads(""), cores);
        assert_eq!(threads("server:\n  threads: 0\n"), cores);
        assert_eq!(threads("server:\n  threads: 3\n"), 3);
    }

    #[test]
    fn access_log_format_is_checked_with_its_path() {
        let base = "providers:\n  - id: p\n    base_url: \"http://127.0.0.1:9\"\n    api: openai\n    connections: [ { id: c } ]\nmodels:\n  - name: m\n    targets: [ { provider: p, model: u } ]\n";
        let parse = |server: &str| {
            parse_str(
                &format!("{server}{base}"),
                "t.yaml",
                Path::new("."),
                &|_| None,
            )
        };
        let format = |server: &str| parse(server).expect("valid").config.server.access_log;
        assert_eq!(format(""), AccessFormat::Text);
        assert_eq!(
            format("server:\n  access_log: { format: json }\n"),
            AccessFormat::Json
        );
        assert_eq!(
            format("server:\n  access_log: { format: off }\n"),
            AccessFormat::Off
        );
        let problems = match parse("server:\n  access_log: { format: xml }\n") {
            Err(p) => p,
            Ok(_) => panic!("xml accepted"),
        };
        let text: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
        assert!(
            text.iter().any(|p| p.contains("server.access_log.format")
                && p.contains("\"xml\" is not one of text, json, off")),
            "{text:?}"
        );
    }
}
