//! `make soak`: ten minutes (`SOAK_SECS`, default 600) of mixed streaming and
//! non-streaming traffic on both API families against one gateway (access log on, as
//! in production) in front of two mock upstreams, with mild faults: one request in
//! twenty carries an `x-mock-fault` aimed at one credential (a 503, a 429 with a short
//! `Retry-After`, a reset before the header, a little latency, now and then a stream
//! cut mid-way). Never part of `make test`: the run is `#[ignore]`d and started by
//! `cargo test --release --test soak -- --ignored --nocapture`.
//!
//! Half the client threads keep their connections alive between requests.
//!
//! Every 10 s the gateway's RSS (`VmRSS` of `/proc/<pid>/status`) and open file
//! descriptors (`/proc/<pid>/fd`) are sampled. Pass criteria, printed with every sample:
//! - memory levels off: the least-squares RSS slope over the second half of the load
//!   is below 1 MiB/min (a leak of one small allocation per request at this rate is
//!   far above that; allocator warm-up and pool growth happen in the first half);
//! - descriptors come back: after the load stops, the fd count returns to at most the
//!   idle baseline + 4 within 120 s (idle upstream keep-alive connections are closed by
//!   the mock after its 60 s keep-alive, and the gateway's pool drops them);
//! - and, as in the chaos run, no request ends badly (hang, framed truncation, malformed
//!   error, connection error).
//!
//! Knobs: `SOAK_SECS` (default 600), `SOAK_CLIENTS` (default 8), `SOAK_SEED`.

// A reliability run: a failed unwrap is a failed run, and it times the real binaries.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod common;
mod reliability;

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use reliability::gateway::Gw;
use reliability::procfs::{cpu_ticks, fd_count, rss_kib, ticks_per_sec};
use reliability::tally::Tally;
use reliability::verdict::{self, Verdict};
use reliability::{client, env_secs, now_text, slope, write_report, Api, Shape};

const SAMPLE_EVERY: Duration = Duration::from_secs(10);
/// Limit on the second-half RSS slope.
const MAX_SLOPE_KIB_PER_MIN: f64 = 1024.0;
/// How far above the idle baseline the fd count may stay once the load is over.
const FD_SLACK: usize = 4;
const FD_SETTLE: Duration = Duration::from_secs(120);
/// Execution timeout of the soak config + margin.
const DEADLINE: Duration = Duration::from_secs(33);

const UPSTREAMS: &[(&str, &str)] = &[("pa", "a"), ("pb", "b"), ("qa", "a"), ("qb", "b")];
const KEYS: &[(&str, &str)] = &[
    ("KEY_A1", "soak-a1"),
    ("KEY_A2", "soak-a2"),
    ("KEY_B1", "soak-b1"),
    ("KEY_B2", "soak-b2"),
    ("KEY_QA", "soak-qa"),
    ("KEY_QB", "soak-qb"),
];

fn config(a: SocketAddr, b: SocketAddr) -> String {
    let resilience = r#"  connection_cooldown: { max_cooldown: "5s" }
  queue: { execution_timeout: "30s" }
  stream: { ttft_timeout: "5s", stall_timeout: "5s" }
"#;
    reliability::topology(a, b, "", resilience)
}

fn mild_fault(rng: &mut StdRng) -> String {
    let key = KEYS[rng.gen_range(0..KEYS.len())].1;
    let effect = match rng.gen_range(0..10) {
        0..=2 => "status=503",
        3..=4 => "status=429;retry_after=1",
        5..=6 => "reset_after=0",
        7..=8 => "latency=100ms",
        _ => "reset_after=3",
    };
    format!("{effect};credential={key}")
}

fn client_loop(id: u64, seed: u64, stop: Arc<AtomicBool>, addr: SocketAddr) -> Tally {
    let mut rng = StdRng::seed_from_u64(seed ^ (id + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut tally = Tally::default();
    // Odd threads keep their connection alive between requests, even ones do not.
    let mut session = (id % 2 == 1).then(client::Session::new);
    while !stop.load(Ordering::Relaxed) {
        let shape = Shape::random(&mut rng);
        let model = match shape.api {
            Api::Chat => "chat",
            Api::Messages => "claude",
        };
        let body = shape.body(model, &mut rng);
        let fault = rng.gen_bool(0.05).then(|| mild_fault(&mut rng));
        let mut headers: Vec<(&str, &str)> = Vec::new();
        if let Some(f) = &fault {
            headers.push(("x-mock-fault", f.as_str()));
        }
        let started = Instant::now();
        let deadline = started + DEADLINE;
        let (res, reused) = match session.as_mut() {
            Some(s) => s.post(addr, shape.api.path(), &headers, &body, deadline),
            None => (
                client::post(addr, shape.api.path(), &headers, &body, deadline),
                false,
            ),
        };
        let elapsed = started.elapsed();
        let v = verdict::judge(shape, &res, &[], false, reused, UPSTREAMS);
        let ttfb = res.as_ref().ok().map(|x| x.ttfb);
        let served_by = res.as_ref().ok().and_then(client::Exchange::served_by);
        let describe = || {
            let mut d = format!(
                "{v:?}\n    request: {} fault={fault:?} after {elapsed:?}\n",
                shape.label()
            );
            d.push_str(&client::describe(&res));
            d
        };
        if v.is_bad() {
            eprintln!("BAD OUTCOME {}", describe());
        }
        let ok = matches!(v, Verdict::Ok { .. });
        tally.record(shape, &v, elapsed, ttfb, served_by, describe);
        let pause = if ok { 0..10 } else { 50..200 };
        std::thread::sleep(Duration::from_millis(rng.gen_range(pause)));
    }
    tally
}

#[derive(Clone, Copy)]
struct Sample {
    t: Duration,
    rss_kib: u64,
    fds: usize,
    requests: u64,
    cpu_ticks: u64,
}

fn sample(pid: u32, t0: Instant, requests: u64) -> Sample {
    Sample {
        t: t0.elapsed(),
        rss_kib: rss_kib(pid).expect("gateway VmRSS"),
        fds: fd_count(pid).expect("gateway fds"),
        requests,
        cpu_ticks: cpu_ticks(pid).unwrap_or(0),
    }
}

/// The idle gateway once it is fully up: the LISTENING lines come before Pingora starts
/// its service runtimes (each with its epoll and eventfd descriptors), so this waits
/// for `/health` and one routed request that touches no upstream (`GET /v1/models`),
/// then for three equal fd readings in a row.
fn idle_baseline(gw: &Gw, t0: Instant) -> Sample {
    let up = common::wait_until(Duration::from_secs(10), || {
        common::try_request(gw.admin, "GET", "/health", &[], b"").is_ok_and(|r| r.status == 200)
            && common::try_request(gw.client, "GET", "/v1/models", &[], b"")
                .is_ok_and(|r| r.status == 200)
    });
    assert!(up, "gateway not serving /health and /v1/models");
    let mut last = sample(gw.pid(), t0, 0);
    let mut same = 0;
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(200));
        let s = sample(gw.pid(), t0, 0);
        same = if s.fds == last.fds { same + 1 } else { 0 };
        last = s;
        if same >= 2 {
            break;
        }
    }
    last
}

#[test]
#[ignore = "standing reliability run (10 minutes by default): make soak"]
fn soak_run() {
    let secs = env_secs("SOAK_SECS", 600);
    let clients = env_secs("SOAK_CLIENTS", 8);
    let seed = env_secs("SOAK_SEED", 7);
    println!("SOAK secs={secs} clients={clients} seed={seed}");
    let started_at = now_text();

    let (mock_a, mock_b) = reliability::start_mocks();
    let gw = Gw::start(&config(mock_a.addr, mock_b.addr), KEYS, "info");
    let pid = gw.pid();
    let t0 = Instant::now();
    let baseline = idle_baseline(&gw, t0);
    println!(
        "idle baseline: rss {} KiB, fds {}",
        baseline.rss_kib, baseline.fds
    );

    let stop = Arc::new(AtomicBool::new(false));
    let tallies = Arc::new(Mutex::new(Tally::default()));
    let workers: Vec<_> = (0..clients)
        .map(|i| {
            let stop = stop.clone();
            let tallies = tallies.clone();
            let addr = gw.client;
            std::thread::spawn(move || {
                let t = client_loop(i, seed, stop, addr);
                tallies.lock().unwrap().merge(&t);
            })
        })
        .collect();

    // The mock's request counters tell progress while the clients keep their tallies.
    let served = || {
        mock_a.stats()["total"].as_u64().unwrap_or(0)
            + mock_b.stats()["total"].as_u64().unwrap_or(0)
    };
    let load_start = Instant::now();
    let mut samples = vec![sample(pid, t0, served())];
    println!(
        "{:>6} {:>10} {:>5} {:>10}",
        "t(s)", "rss(KiB)", "fds", "upstream"
    );
    let print = |s: &Sample| {
        println!(
            "{:>6} {:>10} {:>5} {:>10}",
            s.t.as_secs(),
            s.rss_kib,
            s.fds,
            s.requests
        )
    };
    print(&samples[0]);
    let load = Duration::from_secs(secs);
    while load_start.elapsed() < load {
        let next = SAMPLE_EVERY * samples.len() as u32;
        let wait = next.saturating_sub(load_start.elapsed());
        std::thread::sleep(wait.min(load.saturating_sub(load_start.elapsed())));
        let s = sample(pid, t0, served());
        print(&s);
        samples.push(s);
    }
    stop.store(true, Ordering::SeqCst);
    for w in workers {
        w.join().expect("client thread");
    }
    let load_end = sample(pid, t0, served());
    let load_secs = load_start.elapsed().as_secs_f64();

    // After the load: descriptors return to the idle baseline.
    let mut after = vec![load_end];
    let settle_start = Instant::now();
    while after.last().unwrap().fds > baseline.fds + FD_SLACK && settle_start.elapsed() < FD_SETTLE
    {
        std::thread::sleep(Duration::from_secs(5));
        after.push(sample(pid, t0, served()));
    }
    let settled = after.last().copied().unwrap();
    let settle_took = settle_start.elapsed();

    // RSS slope, KiB per minute, over each half of the load.
    let half = load_start.elapsed().min(load).as_secs_f64() / 2.0;
    let load_t0 = samples[0].t.as_secs_f64();
    let pts = |lo: f64, hi: f64| -> Vec<(f64, f64)> {
        samples
            .iter()
            .map(|s| (s.t.as_secs_f64() - load_t0, s.rss_kib as f64))
            .filter(|(t, _)| *t >= lo && *t <= hi)
            .map(|(t, r)| (t / 60.0, r))
            .collect()
    };
    let first = slope(&pts(0.0, half));
    let second = slope(&pts(half, f64::MAX));
    let tally = tallies.lock().unwrap().clone();
    let peak_fds = samples.iter().map(|s| s.fds).max().unwrap_or(0);
    let peak_rss = samples.iter().map(|s| s.rss_kib).max().unwrap_or(0);
    let cpu_s =
        (load_end.cpu_ticks.saturating_sub(samples[0].cpu_ticks)) as f64 / ticks_per_sec() as f64;
    let panics = gw.panics();
    let idle_upstreams = common::wait_until(Duration::from_secs(15), || {
        mock_a.stats()["inflight"] == 0 && mock_b.stats()["inflight"] == 0
    });

    let mut report = String::new();
    let _ = writeln!(
        report,
        "### Soak run\n\n- started: {started_at}\n- command: `SOAK_SECS={secs} SOAK_CLIENTS={clients} SOAK_SEED={seed} make soak`\n\
         - load: {clients} client threads (half on kept-alive connections) for {load_secs:.0} s, chat / messages × stream / whole, 1 in 20 with a mild `x-mock-fault` on one key\n\
         - gateway: 2 threads, access log on (`SLUICE_LOG=info`, {} KiB of stderr written), ttft / stall 5 s, execution 30 s\n\
         - client requests: {} ({:.0}/s); gateway CPU {cpu_s:.0} s ({:.0} µs per request)\n",
        gw.log_bytes() / 1024,
        tally.requests,
        tally.requests as f64 / load_secs,
        cpu_s * 1e6 / tally.requests.max(1) as f64,
    );
    let _ = writeln!(
        report,
        "| measure | value |\n|---|---:|\n\
         | RSS idle baseline (KiB) | {} |\n\
         | RSS at load start / end / peak (KiB) | {} / {} / {} |\n\
         | RSS slope, first half of the load (KiB/min) | {first:.1} |\n\
         | RSS slope, second half of the load (KiB/min) | {second:.1} (limit {MAX_SLOPE_KIB_PER_MIN:.0}) |\n\
         | fds idle baseline / peak under load / at load end | {} / {peak_fds} / {} |\n\
         | fds after the load ({} s later) | {} (limit {}) |\n",
        baseline.rss_kib,
        samples[0].rss_kib,
        load_end.rss_kib,
        peak_rss,
        baseline.fds,
        load_end.fds,
        settle_took.as_secs(),
        settled.fds,
        baseline.fds + FD_SLACK,
    );
    report.push_str(&tally.table());
    let _ = writeln!(
        report,
        "\nAfter the load, upstream requests still in flight at the mocks: {}.",
        if idle_upstreams {
            "none"
        } else {
            "SOME (see the assertion)"
        }
    );
    let _ = writeln!(
        report,
        "\n| t (s) | RSS (KiB) | fds | upstream requests |\n|---:|---:|---:|---:|"
    );
    for s in samples.iter().chain(after.iter().skip(1)) {
        let _ = writeln!(
            report,
            "| {} | {} | {} | {} |",
            s.t.as_secs(),
            s.rss_kib,
            s.fds,
            s.requests
        );
    }
    if !panics.is_empty() {
        let _ = writeln!(report, "\nPanics:\n```\n{}\n```", panics.join("\n"));
    }
    if !tally.examples.is_empty() {
        let _ = writeln!(report, "\nBad outcomes (first {}):\n", tally.examples.len());
        for e in &tally.examples {
            let _ = writeln!(report, "```\n{e}\n```");
        }
    }
    println!("\n{report}");
    let path = write_report(&format!("soak-{secs}s.md"), &report);
    println!("report written to {}", path.display());

    assert!(tally.ok() > 0, "no correct answer at all");
    assert!(
        samples.len() >= 4,
        "too short to judge memory: {} samples",
        samples.len()
    );
    assert!(
        second < MAX_SLOPE_KIB_PER_MIN,
        "RSS still grows {second:.1} KiB/min over the second half"
    );
    assert!(
        settled.fds <= baseline.fds + FD_SLACK,
        "fds did not return near the baseline: {} vs {}",
        settled.fds,
        baseline.fds
    );
    assert_eq!(tally.bad, 0, "bad outcomes: see the report");
    assert!(panics.is_empty(), "the gateway panicked: {panics:?}");
    assert!(
        idle_upstreams,
        "upstream requests left in flight at the mocks after the load"
    );
}
