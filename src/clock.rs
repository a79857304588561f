//! Time sources. Policies take `now` as an argument; only the edges read a clock.
//!
//! `SystemClock` gives unix milliseconds (persistable, comparable with HTTP-dates);
//! `ManualClock` is advanced by hand in tests. [`monotonic`] is the one reading of the
//! monotonic clock, for the glue's timers (deadlines, TTFT, stall): nothing else calls
//! `Instant::now` or `SystemTime::now` (clippy's `disallowed_methods` enforces it).

use crate::policy::Millis;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Now, on the monotonic clock (for timers of the Pingora glue, never persisted).
#[allow(clippy::disallowed_methods)]
pub fn monotonic() -> Instant {
    Instant::now()
}

/// Now, in unix milliseconds, for code that has no [`Clock`] at hand (file names, the
/// mock's `created` field).
pub fn unix_ms() -> Millis {
    SystemClock.now_ms()
}

/// Now, in unix microseconds: the mock's chunk stamps, which the bench's stream client
/// (another process on the same machine) subtracts from its own reading.
#[allow(clippy::disallowed_methods)]
pub fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

pub trait Clock: Send + Sync {
    fn now_ms(&self) -> Millis;
}

#[derive(Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> Millis {
        unix_us() / 1000
    }
}

/// A clock that only moves when told to.
#[derive(Debug)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    pub fn new(start: Millis) -> Self {
        Self(AtomicU64::new(start))
    }
    pub fn advance(&self, by_ms: u64) {
        self.0.fetch_add(by_ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> Millis {
        self.0.load(Ordering::SeqCst)
    }
}
