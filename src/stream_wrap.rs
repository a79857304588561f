//! The Pingora stream traits a wrapper around a [`pingora::protocols::Stream`] passes to
//! the stream it wraps: its identity (the fd), timing, proxy and socket digests, and
//! peeking. Reads, writes, shutdown and TLS info are each wrapper's own business.

/// Implements `UniqueID`, `GetTimingDigest`, `GetProxyDigest`, `GetSocketDigest` and
/// `Peek` for `$t` by forwarding to its field `inner` (a `Stream`).
macro_rules! forward_stream_traits {
    ($t:ty) => {
        impl pingora::protocols::UniqueID for $t {
            fn id(&self) -> pingora::protocols::UniqueIDType {
                self.inner.id()
            }
        }

        impl pingora::protocols::GetTimingDigest for $t {
            fn get_timing_digest(&self) -> Vec<Option<pingora::protocols::TimingDigest>> {
                self.inner.get_timing_digest()
            }
            fn get_read_pending_time(&self) -> std::time::Duration {
                self.inner.get_read_pending_time()
            }
            fn get_write_pending_time(&self) -> std::time::Duration {
                self.inner.get_write_pending_time()
            }
        }

        impl pingora::protocols::GetProxyDigest for $t {
            fn get_proxy_digest(
                &self,
            ) -> Option<std::sync::Arc<pingora::protocols::raw_connect::ProxyDigest>> {
                self.inner.get_proxy_digest()
            }
            fn set_proxy_digest(&mut self, d: pingora::protocols::raw_connect::ProxyDigest) {
                self.inner.set_proxy_digest(d)
            }
        }

        impl pingora::protocols::GetSocketDigest for $t {
            fn get_socket_digest(
                &self,
            ) -> Option<std::sync::Arc<pingora::protocols::SocketDigest>> {
                self.inner.get_socket_digest()
            }
            fn set_socket_digest(&mut self, d: pingora::protocols::SocketDigest) {
                self.inner.set_socket_digest(d)
            }
        }

        #[async_trait::async_trait]
        impl pingora::protocols::Peek for $t {
            async fn try_peek(&mut self, buf: &mut [u8]) -> std::io::Result<bool> {
                self.inner.try_peek(buf).await
            }
        }
    };
}

pub(crate) use forward_stream_traits;

/// Test helpers shared by the stream wrappers' tests.
#[cfg(test)]
pub(crate) mod testing {
    use std::time::Duration;
    use tokio::io::AsyncReadExt;
    use tokio::net::{TcpListener, TcpStream};

    /// A connected loopback pair: (the connecting side, the accepted side).
    pub async fn loopback() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (s, _) = l.accept().await.unwrap();
        (c, s)
    }

    /// True when nothing arrives on `s` for 50 ms: a send that should not have happened.
    pub async fn nothing_to_read(s: &mut TcpStream) -> bool {
        let mut b = [0u8; 64];
        tokio::time::timeout(Duration::from_millis(50), s.read(&mut b))
            .await
            .is_err()
    }
}
