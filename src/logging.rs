//! Log output off the request path.
//!
//! The access log writes one line per request; writing it straight to stderr costs a
//! syscall (and a global lock) on the request's thread. Here each formatted line is
//! handed to a dedicated writer thread over a bounded channel and written in batches.
//! The request path never blocks on logging: when the channel is full the line is
//! dropped and counted, and the count is reported on the next line that gets through.
//! Secrets never reach a line: Sluice logs no header values, and the dependencies that
//! would are capped at `info` ([`CAPPED_TARGETS`]).

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::time::Duration;
use tracing_subscriber::fmt::MakeWriter;

/// Log targets never shown below `info`: dependencies that print raw request bytes or
/// headers at debug/trace level.
pub const CAPPED_TARGETS: [&str; 4] = ["pingora", "h2", "hyper", "tokio_util"];

/// Whether an event of `target` at `level` may be logged at all (before `SLUICE_LOG`
/// decides): below `info`, nothing from a [`CAPPED_TARGETS`] crate.
pub fn allowed(target: &str, level: tracing::Level) -> bool {
    level <= tracing::Level::INFO || !CAPPED_TARGETS.iter().any(|t| target.starts_with(t))
}

/// Lines that may wait for the writer before new ones are dropped.
const QUEUE: usize = 65_536;

enum Msg {
    Line(Vec<u8>),
    /// Write out everything queued before this, then acknowledge.
    Flush(std::sync::mpsc::Sender<()>),
}

#[derive(Clone)]
pub struct Background {
    tx: SyncSender<Msg>,
    dropped: Arc<AtomicU64>,
}

impl Background {
    /// Queues one complete line (ending in `\n`) without blocking: when the writer is
    /// behind, the line is dropped and counted.
    pub fn send(&self, line: Vec<u8>) {
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) =
            self.tx.try_send(Msg::Line(line))
        {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Waits (at most `limit`) until every line queued so far is written: used before
    /// the process exits, which would otherwise lose the last lines.
    pub fn flush(&self, limit: Duration) {
        let (ack, done) = std::sync::mpsc::channel();
        if self.tx.send(Msg::Flush(ack)).is_ok() {
            let _ = done.recv_timeout(limit);
        }
    }
}

/// One log event being formatted; sent to the writer thread when dropped.
pub struct Line {
    buf: Vec<u8>,
    bg: Background,
}

impl Write for Line {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        self.bg.send(std::mem::take(&mut self.buf));
    }
}

impl<'a> MakeWriter<'a> for Background {
    type Writer = Line;
    fn make_writer(&'a self) -> Line {
        Line {
            buf: Vec::with_capacity(256),
            bg: self.clone(),
        }
    }
}

/// How long the writer sleeps between batches while lines keep coming.
const TICK: Duration = Duration::from_millis(20);

/// The writer: idle, it blocks for the first line (one wake-up); busy, it sleeps a
/// [`TICK`] between batches and drains whatever queued meanwhile, so request threads
/// that send a line never have to wake it. It goes back to blocking after a tick with
/// nothing to write.
fn drain(rx: Receiver<Msg>, dropped: Arc<AtomicU64>) {
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, std::io::stderr());
    let mut acks = Vec::new();
    loop {
        let Ok(first) = rx.recv() else {
            let _ = out.flush();
            return;
        };
        let mut next = Some(first);
        loop {
            let lost = dropped.swap(0, Ordering::Relaxed);
            if lost > 0 {
                let _ = writeln!(
                    out,
                    "sluice: {lost} log line(s) dropped (log writer behind)"
                );
            }
            let mut wrote = false;
            let mut closed = false;
            loop {
                let msg = match next.take() {
                    Some(m) => m,
                    None => match rx.try_recv() {
                        Ok(m) => m,
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => {
                            closed = true;
                            break;
                        }
                    },
                };
                wrote = true;
                match msg {
                    Msg::Line(line) => {
                        let _ = out.write_all(&line);
                    }
                    Msg::Flush(ack) => acks.push(ack),
                }
            }
            let _ = out.flush();
            for ack in acks.drain(..) {
                let _ = ack.send(());
            }
            if closed {
                return;
            }
            if !wrote {
                break;
            }
            std::thread::sleep(TICK);
        }
    }
}

/// Starts the writer thread and returns the `MakeWriter` for the subscriber. Falls back
/// to `None` (the caller then writes to stderr directly) if the thread cannot start.
pub fn background() -> Option<Background> {
    let (tx, rx) = sync_channel(QUEUE);
    let dropped = Arc::new(AtomicU64::new(0));
    let d = dropped.clone();
    std::thread::Builder::new()
        .name("sluice-log".into())
        .spawn(move || drain(rx, d))
        .ok()?;
    Some(Background { tx, dropped })
}

#[cfg(test)]
mod tests {
    use super::allowed;
    use tracing::Level;

    #[test]
    fn dependencies_that_print_headers_stay_at_info() {
        assert!(allowed(
            "pingora_core::protocols::http::v1::client",
            Level::INFO
        ));
        assert!(allowed("pingora_proxy", Level::ERROR));
        assert!(!allowed(
            "pingora_core::protocols::http::v1::client",
            Level::TRACE
        ));
        assert!(!allowed("pingora_proxy", Level::DEBUG));
        assert!(!allowed("h2::codec", Level::DEBUG));
        assert!(allowed("sluice::access", Level::DEBUG));
    }
}
