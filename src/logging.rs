//! Log output off the request path.
//!
//! The access log writes one line per request; writing it straight to stderr costs a
//! syscall (and a global lock) on the request's thread. Here lines are written by a
//! dedicated writer thread, in batches. Access lines are formatted straight into a
//! batch buffer of the request's worker ([`Background::append`]: no channel message
//! and no cross-thread free per line, no allocation once the buffers have grown to a
//! batch's size, and a lock only the writer shares while there are at most [`SLOTS`]
//! workers); the writer swaps the buffers out when it drains, and is woken only when a
//! buffer goes from empty to holding a line. Other events travel one line per
//! message over a bounded channel. The request path never blocks on logging: when the
//! channel or a batch buffer is full the line is dropped and counted, and the count is
//! reported on the next batch that gets through. Lines of one worker keep their order;
//! lines of different workers, and access lines against other events, may be written
//! up to a batch ([`TICK`]) apart from the order they were made in.
//! Secrets never reach a line: Sluice logs no header values, and the dependencies that
//! would are capped at `info` ([`CAPPED_TARGETS`]).

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Mutex};
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

/// Bytes a worker's batch buffer may hold before new access lines are dropped (about
/// the channel's worth of lines).
const BATCH_LIMIT: usize = 16 << 20;

/// Batch buffers: as many as there may be workers before two share one (they then
/// share its lock, nothing else).
const SLOTS: usize = 16;

enum Msg {
    Line(Vec<u8>),
    /// A batch buffer went from empty to holding a line.
    Wake,
    /// Write out everything queued before this, then acknowledge.
    Flush(std::sync::mpsc::Sender<()>),
}

/// One worker's batch of access lines, on cache lines of its own.
#[repr(align(128))]
#[derive(Default)]
struct Slot(Mutex<Vec<u8>>);

#[derive(Clone)]
pub struct Background {
    tx: SyncSender<Msg>,
    dropped: Arc<AtomicU64>,
    slots: Arc<[Slot; SLOTS]>,
}

impl Background {
    /// Appends one line, written by `line` (ending in `\n`), to the batch buffer of
    /// `worker` (any number: buffers are shared modulo their count) without blocking
    /// on the writer. When the buffer is full the line is dropped and counted.
    pub fn append(&self, worker: usize, line: impl FnOnce(&mut Vec<u8>)) {
        let slot = &self.slots[worker % SLOTS];
        let was_empty = {
            let mut buf = slot.0.lock().unwrap_or_else(|p| p.into_inner());
            if buf.len() >= BATCH_LIMIT {
                drop(buf);
                self.dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
            let was_empty = buf.is_empty();
            // A line cut short by a panic is taken back out, so the batch holds whole
            // lines only (and an empty one stays empty: no wake was owed).
            let mut whole = Whole {
                len: buf.len(),
                buf: &mut buf,
            };
            line(&mut *whole.buf);
            whole.len = whole.buf.len();
            was_empty
        };
        // A full channel holds messages that will wake the writer anyway.
        if was_empty {
            let _ = self.tx.try_send(Msg::Wake);
        }
    }

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

/// A batch buffer being written to: cut back to `len` when dropped.
struct Whole<'a> {
    buf: &'a mut Vec<u8>,
    len: usize,
}

impl Drop for Whole<'_> {
    fn drop(&mut self) {
        self.buf.truncate(self.len);
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

/// Channel messages the writer takes in one pass before it drains the batch buffers
/// too, so a stream of other events cannot hold the access lines back.
const PASS: usize = 4_096;

/// A drained batch buffer bigger than this (after a burst) is freed, not kept.
const KEEP: usize = 1 << 20;

/// The writer: idle, it blocks for the first message (one wake-up); busy, it sleeps a
/// [`TICK`] between batches and takes whatever came meanwhile — channel messages and
/// the batch buffers — so request threads that add to a non-empty batch, or send a
/// line while it is busy, never wake it. It goes back to blocking after a tick with
/// nothing to write. `sink` is stderr but in tests.
fn drain<W: Write>(rx: Receiver<Msg>, dropped: Arc<AtomicU64>, slots: Arc<[Slot; SLOTS]>, sink: W) {
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, sink);
    let mut acks = Vec::new();
    // Swapped with each non-empty batch buffer: the buffers go round the busy workers
    // and the writer, and keep their capacity.
    let mut spare = Vec::new();
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
            let mut more = false;
            for taken in 0.. {
                if taken == PASS {
                    more = true;
                    break;
                }
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
                match msg {
                    Msg::Line(line) => {
                        wrote = true;
                        let _ = out.write_all(&line);
                    }
                    Msg::Wake => {}
                    Msg::Flush(ack) => {
                        wrote = true;
                        acks.push(ack);
                    }
                }
            }
            for slot in slots.iter() {
                {
                    let mut batch = slot.0.lock().unwrap_or_else(|p| p.into_inner());
                    if batch.is_empty() {
                        continue;
                    }
                    std::mem::swap(&mut *batch, &mut spare);
                }
                // A batch goes out as it is, not copied through `out`'s buffer.
                wrote = true;
                let _ = out.flush();
                let _ = out.get_mut().write_all(&spare);
                spare.clear();
                if spare.capacity() > KEEP {
                    spare = Vec::new();
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
            if !more {
                std::thread::sleep(TICK);
            }
        }
    }
}

/// Starts the writer thread on `sink` and returns its sender.
fn start<W: Write + Send + 'static>(sink: W) -> Option<Background> {
    let (tx, rx) = sync_channel(QUEUE);
    let dropped = Arc::new(AtomicU64::new(0));
    let slots: Arc<[Slot; SLOTS]> = Arc::new(Default::default());
    let (d, s) = (dropped.clone(), slots.clone());
    std::thread::Builder::new()
        .name("sluice-log".into())
        .spawn(move || drain(rx, d, s, sink))
        .ok()?;
    Some(Background { tx, dropped, slots })
}

/// Starts the writer thread and returns the `MakeWriter` for the subscriber. Falls back
/// to `None` (the caller then writes to stderr directly) if the thread cannot start.
pub fn background() -> Option<Background> {
    start(std::io::stderr())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing::Level;

    /// A background sink whose writer is the test: its channel's receiver and slots.
    fn sink() -> (Background, Receiver<Msg>) {
        let (tx, rx) = sync_channel(4);
        let bg = Background {
            tx,
            dropped: Arc::new(AtomicU64::new(0)),
            slots: Arc::new(Default::default()),
        };
        (bg, rx)
    }

    fn batch(bg: &Background, worker: usize) -> Vec<u8> {
        let slot = &bg.slots[worker % SLOTS].0;
        std::mem::take(&mut *slot.lock().unwrap_or_else(|p| p.into_inner()))
    }

    #[test]
    fn a_batch_wakes_the_writer_once_and_keeps_its_lines_in_order() {
        let (bg, rx) = sink();
        bg.append(1, |b| b.extend_from_slice(b"one\n"));
        bg.append(1, |b| b.extend_from_slice(b"two\n"));
        bg.append(2, |b| b.extend_from_slice(b"other\n"));
        let wakes = rx.try_iter().filter(|m| matches!(m, Msg::Wake)).count();
        assert_eq!(wakes, 2, "one per buffer that was empty");
        assert_eq!(batch(&bg, 1), b"one\ntwo\n");
        assert_eq!(batch(&bg, 2 + SLOTS), b"other\n");
        // drained: the next line wakes the writer again
        bg.append(1, |b| b.extend_from_slice(b"three\n"));
        assert!(matches!(rx.try_recv(), Ok(Msg::Wake)));
    }

    /// Output shared with the test: the writer thread's sink.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn the_writer_writes_every_batch_and_line_before_a_flush_returns() {
        let out = Shared::default();
        let bg = start(out.clone()).unwrap();
        bg.append(3, |b| b.extend_from_slice(b"access one\n"));
        bg.send(b"event\n".to_vec());
        bg.append(3, |b| b.extend_from_slice(b"access two\n"));
        bg.append(7, |b| b.extend_from_slice(b"other worker\n"));
        bg.flush(Duration::from_secs(10));
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        let at = |l: &str| {
            text.find(l)
                .unwrap_or_else(|| panic!("{l:?} missing: {text:?}"))
        };
        assert!(at("access one\n") < at("access two\n"), "{text:?}");
        at("event\n");
        at("other worker\n");
        assert_eq!(text.lines().count(), 4, "{text:?}");
        // Idle again, the writer is woken by the next line of a batch.
        std::thread::sleep(TICK * 3);
        bg.append(3, |b| b.extend_from_slice(b"later\n"));
        let written = || out.0.lock().unwrap().ends_with(b"later\n");
        for _ in 0..500 {
            if written() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(written(), "the line's wake-up did not reach the writer");
    }

    #[test]
    fn a_line_cut_by_a_panic_leaves_the_batch_whole() {
        let (bg, _rx) = sink();
        bg.append(0, |b| b.extend_from_slice(b"whole\n"));
        let hit = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            bg.append(0, |b| {
                b.extend_from_slice(b"half a li");
                panic!("formatting failed");
            })
        }));
        assert!(hit.is_err());
        bg.append(0, |b| b.extend_from_slice(b"next\n"));
        assert_eq!(batch(&bg, 0), b"whole\nnext\n");
    }

    #[test]
    fn a_full_batch_drops_and_counts_instead_of_growing() {
        let (bg, rx) = sink();
        bg.append(0, |b| b.resize(BATCH_LIMIT, b'x'));
        bg.append(0, |b| b.extend_from_slice(b"late\n"));
        assert_eq!(bg.dropped.load(Ordering::Relaxed), 1);
        assert_eq!(batch(&bg, 0).len(), BATCH_LIMIT);
        // a full channel does not block the request thread either
        for w in 1..=8 {
            bg.append(w, |b| b.push(b'\n'));
        }
        assert_eq!(rx.try_iter().count(), 4);
    }

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
