//! Asynchronous, cached host resolution for upstream peers.
//!
//! Pingora's `HttpPeer::new` with a hostname resolves with blocking std DNS and panics on
//! failure, which would stall a runtime thread or crash the gateway. Peers are built from
//! `SocketAddr`s resolved here with tokio, cached for `TTL`; a failed lookup is a
//! transport failure of that attempt, never a panic. The cache is bounded by the number
//! of configured providers (keys come from config, not from clients).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const TTL: Duration = Duration::from_secs(60);

/// (host, port) → (addresses, when they were resolved).
type Cache = HashMap<(String, u16), (Vec<SocketAddr>, Instant)>;

#[derive(Default)]
pub struct Resolver {
    cache: Mutex<Cache>,
}

impl Resolver {
    /// Resolves `host:port`, rotating through the answers on successive calls.
    pub async fn resolve(
        &self,
        host: &str,
        port: u16,
        now: Instant,
    ) -> std::io::Result<SocketAddr> {
        if let Ok(ip) = host.parse::<IpAddr>() {
            return Ok(SocketAddr::new(ip, port));
        }
        let key = (host.to_string(), port);
        if let Ok(mut cache) = self.cache.lock() {
            if let Some((addrs, at)) = cache.get_mut(&key) {
                if now.duration_since(*at) < TTL && !addrs.is_empty() {
                    addrs.rotate_left(1);
                    return Ok(addrs[0]);
                }
            }
        }
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port)).await?.collect();
        let first = *addrs.first().ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("no address for {host}"),
            )
        })?;
        if let Ok(mut cache) = self.cache.lock() {
            cache.insert(key, (addrs, now));
        }
        Ok(first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::monotonic;

    #[tokio::test]
    async fn literals_and_localhost() {
        let r = Resolver::default();
        let a = r.resolve("127.0.0.1", 80, monotonic()).await.unwrap();
        assert_eq!(a, "127.0.0.1:80".parse().unwrap());
        let l = r.resolve("localhost", 81, monotonic()).await.unwrap();
        assert!(l.ip().is_loopback());
        assert_eq!(l.port(), 81);
        assert!(r
            .resolve("no-such-host.invalid", 80, monotonic())
            .await
            .is_err());
    }
}
