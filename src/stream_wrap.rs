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
