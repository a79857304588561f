//! The stream-holding client of `bench/streams.sh` (SPEC §10: RSS per open SSE stream,
//! added inter-chunk delay). It opens N concurrent streaming chat requests on loopback,
//! holds them until the server ends each answer, samples the server's RSS from `/proc`,
//! and times every SSE event as it arrives. Built for the bench only
//! (`cargo build --release --example streams`).
//!
//!   streams HOST:PORT PID[,PID...] N   (RSS summed over the PIDs; BENCH_BODY_KIB=K pads
//!                                       each request to about K KiB; BENCH_STREAM_SPREAD_MS=S
//!                                       opens stream i at i·S/N ms instead of all at once)
//!
//! A gap is the time between the ends of two consecutive events (`\n\n`) of one stream,
//! taken when the read that holds the second one returns; the first event of a stream has
//! no gap. The client is on tokio with two workers and does no work per event beyond
//! finding its end, so at 8,000 streams its own delay stays small next to the 500 ms the
//! mock waits between chunks (the Python client it replaces measured 660 ms p99 directly
//! against the mock, which hid any delay the gateway adds). Gaps are reported over the
//! whole run and over the steady state (gaps that began once every stream was open,
//! so no connects were in flight). When the mock stamps its chunks (`--stamp-chunks`:
//! an SSE comment line `: t=<unix µs>` written with each), every stamp read is also a
//! delivery time: the client's unix clock minus the stamp. Unlike a gap, it leaves out
//! how late the mock's own timer fired, so a proxy's added delay shows through less
//! noise. The last line is `RESULT n completed idle_mb peak_mb kib_per_stream p50 p99
//! p99.9 max steady_p99 steady_p99.9 delivery_p99 delivery_p99.9 steady_delivery_p99
//! steady_delivery_p99.9` (ms; the delivery figures `NaN` without stamps).

use std::io::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

/// How many connects may be in flight at once: the listener's backlog is not flooded.
const CONNECTS_IN_FLIGHT: usize = 256;
/// Every stream must end within this (the mock's answer takes ~10 s).
const DEADLINE: Duration = Duration::from_secs(120);

type Failure = Box<dyn std::error::Error + Send + Sync>;

struct Counts {
    opened: AtomicUsize,
    done: AtomicUsize,
    failed: AtomicUsize,
    /// When the last stream got its response header (ms since the run started).
    all_open_ms: AtomicU64,
}

/// The summed RSS of the server's processes (nginx: its master and workers), in MB.
fn rss_mb(pids: &[u32]) -> f64 {
    pids.iter()
        .map(|pid| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|kb| kb.parse::<f64>().ok())
                .map_or(f64::NAN, |kb| kb / 1024.0)
        })
        .sum()
}

fn request(body_kib: usize) -> Vec<u8> {
    let pad = "x".repeat(body_kib * 1024);
    let body = format!(
        r#"{{"model":"bench","stream":true,"messages":[{{"role":"user","content":"hi{pad}"}}]}}"#
    );
    let mut r = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body.as_bytes());
    r
}

/// One gap: when it ended (ms since the run started) and how long it was (µs).
type Gap = (u32, u32);

/// One stamped chunk: when it arrived (ms since the run started) and how long after
/// the mock wrote it (µs).
type Delivery = (u32, u32);

/// What the streams measured: every gap and every stamped delivery.
#[derive(Default)]
struct Samples {
    gaps: Vec<Gap>,
    deliveries: Vec<Delivery>,
}

impl Samples {
    fn append(&mut self, other: Samples) {
        self.gaps.extend_from_slice(&other.gaps);
        self.deliveries.extend_from_slice(&other.deliveries);
    }
}

/// The durations (µs) of `samples`, sorted: all of them, and those `steady` keeps.
fn sorted(samples: &[(u32, u32)], steady: impl Fn(&(u32, u32)) -> bool) -> (Vec<u32>, Vec<u32>) {
    let mut all: Vec<u32> = samples.iter().map(|s| s.1).collect();
    let mut kept: Vec<u32> = samples.iter().filter(|s| steady(s)).map(|s| s.1).collect();
    all.sort_unstable();
    kept.sort_unstable();
    (all, kept)
}

/// The deliveries of the stamps (`: t=<unix µs>\n`) whole in `bytes`, arrived at `at_ms`.
fn stamps(bytes: &[u8], at_ms: u32, out: &mut Vec<Delivery>) {
    let mut from = 0;
    while let Some(i) = memchr::memmem::find(&bytes[from..], b": t=") {
        let digits = from + i + 4;
        from = digits;
        let Some(len) = memchr::memchr(b'\n', &bytes[digits..]) else {
            break;
        };
        let sent = std::str::from_utf8(&bytes[digits..digits + len])
            .ok()
            .and_then(|d| d.parse::<u64>().ok());
        if let Some(sent) = sent {
            let us = sluice::clock::unix_us().saturating_sub(sent);
            out.push((at_ms, u32::try_from(us).unwrap_or(u32::MAX)));
        }
    }
}

/// One stream: its event gaps and stamped deliveries, or why it failed.
async fn stream(
    start: std::time::Instant,
    n: usize,
    addr: String,
    req: Arc<Vec<u8>>,
    gate: Arc<Semaphore>,
    counts: Arc<Counts>,
) -> Result<Samples, Failure> {
    let mut conn = {
        let _permit = gate.acquire().await?;
        TcpStream::connect(&addr).await?
    };
    conn.set_nodelay(true)?;
    conn.write_all(&req).await?;
    let mut buf = vec![0u8; 16 * 1024];
    let mut head = Vec::new();
    // The response header, and whatever of the body came with it.
    let rest = loop {
        let n = conn.read(&mut buf).await?;
        if n == 0 {
            return Err("closed before the response header".into());
        }
        head.extend_from_slice(&buf[..n]);
        if let Some(end) = memchr::memmem::find(&head, b"\r\n\r\n") {
            break head.split_off(end + 4);
        }
    };
    if !head.starts_with(b"HTTP/1.1 200") {
        let line = String::from_utf8_lossy(&head[..head.len().min(80)]).into_owned();
        return Err(format!("answered {line:?}").into());
    }
    if counts.opened.fetch_add(1, Ordering::Relaxed) + 1 == n {
        let at = sluice::clock::monotonic().duration_since(start).as_millis();
        counts.all_open_ms.store(at as u64, Ordering::Relaxed);
    }
    let mut gaps = Vec::with_capacity(32);
    let mut deliveries = Vec::with_capacity(32);
    let mut last: Option<std::time::Instant> = None;
    // `\n` ending the previous read: an event end split across two reads still counts.
    let mut tail_newline = false;
    let mut take = |bytes: &[u8], tail_newline: &mut bool| {
        let ends = (*tail_newline && bytes.first() == Some(&b'\n'))
            || memchr::memmem::find(bytes, b"\n\n").is_some();
        *tail_newline = bytes.last() == Some(&b'\n');
        let now = sluice::clock::monotonic();
        let at_ms = u32::try_from(now.duration_since(start).as_millis()).unwrap_or(u32::MAX);
        stamps(bytes, at_ms, &mut deliveries);
        if ends {
            if let Some(prev) = last {
                let us = now.duration_since(prev).as_micros();
                gaps.push((at_ms, u32::try_from(us).unwrap_or(u32::MAX)));
            }
            last = Some(now);
        }
    };
    if !rest.is_empty() {
        take(&rest, &mut tail_newline);
    }
    loop {
        let n = conn.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        take(&buf[..n], &mut tail_newline);
    }
    counts.done.fetch_add(1, Ordering::Relaxed);
    Ok(Samples { gaps, deliveries })
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    f64::from(sorted[i]) / 1000.0
}

async fn run(
    addr: String,
    pids: Vec<u32>,
    n: usize,
    body_kib: usize,
    spread: Duration,
) -> Result<(), Failure> {
    let start = sluice::clock::monotonic();
    let req = Arc::new(request(body_kib));
    let gate = Arc::new(Semaphore::new(CONNECTS_IN_FLIGHT));
    let counts = Arc::new(Counts {
        opened: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        failed: AtomicUsize::new(0),
        all_open_ms: AtomicU64::new(u64::MAX),
    });
    let base = rss_mb(&pids);
    let all = Arc::new(Mutex::new(Samples {
        gaps: Vec::with_capacity(n * 24),
        deliveries: Vec::with_capacity(n * 24),
    }));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let (addr, req, gate, counts) = (addr.clone(), req.clone(), gate.clone(), counts.clone());
        let all = all.clone();
        let opens_at = spread.mul_f64(i as f64 / n as f64);
        tasks.spawn(async move {
            // The deadline runs from the stream's own opening. Not spread: no timer at all
            // (tokio's rounds up to the next millisecond).
            if !opens_at.is_zero() {
                tokio::time::sleep_until((start + opens_at).into()).await;
            }
            let one = stream(start, n, addr, req, gate, counts.clone());
            match tokio::time::timeout(DEADLINE, one).await {
                Ok(Ok(samples)) => {
                    if let Ok(mut all) = all.lock() {
                        all.append(samples);
                    }
                }
                Ok(Err(e)) => {
                    if counts.failed.fetch_add(1, Ordering::Relaxed) < 3 {
                        eprintln!("stream failed: {e}");
                    }
                }
                Err(_) => {
                    counts.failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }
    let mut peak = base;
    let mut reported = false;
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            joined = tasks.join_next() => if joined.is_none() { break },
            _ = tick.tick() => {
                peak = peak.max(rss_mb(&pids));
                if !reported && counts.all_open_ms.load(Ordering::Relaxed) != u64::MAX {
                    reported = true;
                    println!("all {n} streams open: RSS {:.1} MB", rss_mb(&pids));
                }
            }
        }
    }
    let samples = std::mem::take(&mut *all.lock().map_err(|_| "sample lists poisoned")?);
    let all_open = counts.all_open_ms.load(Ordering::Relaxed);
    // Steady state: gaps that began, and chunks that arrived, once every stream was open
    // (no connects in flight).
    let (every, steady) = sorted(&samples.gaps, |(end, us)| {
        u64::from(*end).saturating_sub(u64::from(*us / 1000)) >= all_open
    });
    let (delivered, delivered_steady) =
        sorted(&samples.deliveries, |(at, _)| u64::from(*at) >= all_open);
    let done = counts.done.load(Ordering::Relaxed);
    let per = (peak - base) * 1024.0 / n as f64;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "streams: {n} opened {} completed {done} failed {}; all open after {} ms",
        counts.opened.load(Ordering::Relaxed),
        counts.failed.load(Ordering::Relaxed),
        if all_open == u64::MAX {
            -1
        } else {
            all_open as i64
        },
    )?;
    writeln!(out, "RSS of {pids:?}: idle {base:.1} MB, peak {peak:.1} MB")?;
    let summary = |g: &[u32]| {
        let max = g.last().map_or(f64::NAN, |m| f64::from(*m) / 1000.0);
        (
            percentile(g, 0.5),
            percentile(g, 0.99),
            percentile(g, 0.999),
            max,
        )
    };
    let (p50, p99, p999, max) = summary(&every);
    let (s50, s99, s999, smax) = summary(&steady);
    writeln!(
        out,
        "event gaps, all ({}): p50 {p50:.1} ms, p99 {p99:.1} ms, p99.9 {p999:.1} ms, max {max:.1} ms",
        every.len()
    )?;
    writeln!(
        out,
        "event gaps, once all were open ({}): p50 {s50:.1} ms, p99 {s99:.1} ms, p99.9 {s999:.1} ms, max {smax:.1} ms",
        steady.len()
    )?;
    let (d50, d99, d999, dmax) = summary(&delivered);
    let (_, ds99, ds999, _) = summary(&delivered_steady);
    if !delivered.is_empty() {
        writeln!(
            out,
            "chunk delivery, all ({}): p50 {d50:.2} ms, p99 {d99:.2} ms, p99.9 {d999:.2} ms, max {dmax:.2} ms; once all were open ({}): p99 {ds99:.2} ms, p99.9 {ds999:.2} ms",
            delivered.len(),
            delivered_steady.len()
        )?;
    }
    writeln!(
        out,
        "RESULT {n} {done} {base:.1} {peak:.1} {per:.1} {p50:.1} {p99:.1} {p999:.1} {max:.1} {s99:.1} {s999:.1} {d99:.2} {d999:.2} {ds99:.2} {ds999:.2}"
    )?;
    Ok(())
}

fn main() -> Result<(), Failure> {
    let args: Vec<String> = std::env::args().collect();
    let [_, addr, pids, n] = args.as_slice() else {
        return Err("usage: streams HOST:PORT PID[,PID...] N".into());
    };
    let pids = pids
        .split(',')
        .map(str::parse)
        .collect::<Result<Vec<u32>, _>>()?;
    let body_kib = std::env::var("BENCH_BODY_KIB")
        .ok()
        .map_or(Ok(0), |k| k.parse::<usize>())?;
    let spread = std::env::var("BENCH_STREAM_SPREAD_MS")
        .ok()
        .map_or(Ok(0), |ms| ms.parse::<u64>())?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run(
            addr.clone(),
            pids,
            n.parse()?,
            body_kib,
            Duration::from_millis(spread),
        ))
}
