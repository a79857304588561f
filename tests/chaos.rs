//! `make chaos`: a standing reliability run, never part of `make test` (the run is
//! `#[ignore]`d; `cargo test --release --test chaos -- --ignored --nocapture` starts it).
//!
//! Several client threads send a steady mix of streaming and non-streaming requests on
//! the OpenAI (`/v1/chat/completions`) and Anthropic (`/v1/messages`) routes to one
//! gateway in front of two mock upstreams (each serving an OpenAI and an Anthropic
//! provider; the OpenAI ones with several connections). Meanwhile a chaos thread,
//! driven by a printed seed, sets process faults on the mocks at random: connection
//! resets before the header and mid-stream, garbage bodies, 5xx storms, 429s with and
//! without `Retry-After`, stalls before and inside streams, slow headers beyond the
//! TTFT timeout, slow chunks, truncated bodies; one client request in ten also carries
//! its own `x-mock-fault` aimed at one credential. Halfway, one connection is put into
//! a long cooldown and another into a terminal state, the gateway is `kill -9`ed and
//! restarted on the same state file, and SPEC §7 is checked: both are still excluded.
//!
//! Every request has a client deadline derived from the config (execution timeout +
//! margin) and is judged by `reliability::verdict`: a correct answer, an upstream's
//! body passed through whole, a well-formed error, or an honest end of a committed
//! stream are fine; a hang, a truncation framed as success, a malformed error or a
//! connection error while the gateway is up fail the run. The summary is printed as
//! Markdown (for docs/RELIABILITY.md) and written under `target/tmp/reliability/`.
//!
//! Knobs: `CHAOS_SECS` (default 240), `CHAOS_SEED`, `CHAOS_CLIENTS` (default 6).

// A reliability run: a failed unwrap is a failed run, and it times the real binaries.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod common;
mod reliability;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use common::{wait_until, Mock};
use reliability::client;
use reliability::gateway::Gw;
use reliability::tally::Tally;
use reliability::verdict::{self, Verdict, MOCK_CHUNKS};
use reliability::{env_secs, now_text, write_report, Api, Shape};

const TTFT: Duration = Duration::from_secs(1);
const STALL: Duration = Duration::from_secs(1);
const EXECUTION: Duration = Duration::from_secs(10);
/// Every client request's deadline: the execution timeout bounds the whole request
/// (SPEC §2), plus a margin for a loaded 2-core machine.
const DEADLINE: Duration = Duration::from_secs(13);

/// Bodies the chaos injects verbatim (the judge recognises them when passed through).
const GARBAGE: &[&str] = &[
    "<html><body><h1>502 Bad Gateway</h1>chaos</body></html>",
    r#"{"id":"chatcmpl-chaos","object":"chat.completion","choices":[{"index":0,"#,
    "chaos: this is not JSON at all",
];

/// Provider → name of the mock behind it.
const UPSTREAMS: &[(&str, &str)] = &[("pa", "a"), ("pb", "b"), ("qa", "a"), ("qb", "b")];

/// Credentials (env var, value); placeholders, the mock accepts any key.
const KEYS: &[(&str, &str)] = &[
    ("KEY_A1", "chaos-a1"),
    ("KEY_A2", "chaos-a2"),
    ("KEY_ACOOL", "chaos-acool"),
    ("KEY_ATERM", "chaos-aterm"),
    ("KEY_B1", "chaos-b1"),
    ("KEY_B2", "chaos-b2"),
    ("KEY_QA", "chaos-qa"),
    ("KEY_QB", "chaos-qb"),
];

/// Credentials a client's own header fault may aim at (never the two held for §7).
const TARGETABLE: &[&str] = &[
    "chaos-a1", "chaos-a2", "chaos-b1", "chaos-b2", "chaos-qa", "chaos-qb",
];

fn config(a: SocketAddr, b: SocketAddr) -> String {
    let resilience = format!(
        r#"  breaker: {{ local: {{ degrade_at: 5, open_at: 10, reset: "2s" }} }}
  connection_cooldown: {{ max_cooldown: "20s" }}
  queue: {{ execution_timeout: "{exec}s" }}
  combo_wait: {{ enabled: true, max_wait: "2s", max_attempts: 1, budget: "3s" }}
  stream: {{ ttft_timeout: "{ttft}ms", stall_timeout: "{stall}ms" }}
"#,
        exec = EXECUTION.as_secs(),
        ttft = TTFT.as_millis(),
        stall = STALL.as_millis(),
    );
    let extra = "      - { id: acool, api_key_env: KEY_ACOOL }\n      - { id: aterm, api_key_env: KEY_ATERM }\n";
    reliability::topology(a, b, extra, &resilience)
}

/// What the run shares between the client threads, the chaos thread and the main thread.
struct Shared {
    addr: RwLock<SocketAddr>,
    /// Set while the gateway is being killed and restarted; clients wait.
    down: AtomicBool,
    /// Bumped when the kill starts and when the restart is done: a request that saw it
    /// change was in flight across the crash.
    epoch: AtomicU64,
    stop: AtomicBool,
    pause_chaos: AtomicBool,
    chaos_idle: AtomicBool,
    /// Process fault currently set on mock a and b, for the description of bad outcomes.
    faults: Mutex<[String; 2]>,
    tally: Mutex<Tally>,
    /// Set once the restarted gateway serves.
    after_restart: AtomicBool,
    /// Correct answers after the restart that name a connection §7 keeps excluded.
    excluded_hits: Mutex<Vec<String>>,
}

fn header_fault(rng: &mut StdRng) -> String {
    let key = TARGETABLE[rng.gen_range(0..TARGETABLE.len())];
    let effect = match rng.gen_range(0..7) {
        0 => "reset_after=0".to_string(),
        1 => "status=500".to_string(),
        2 => "status=429".to_string(),
        3 => format!("first_byte_delay={}ms", TTFT.as_millis() + 500),
        4 => "reset_after=3".to_string(),
        5 => "stall_after=2".to_string(),
        _ => format!(
            "status=200;body={}",
            GARBAGE[rng.gen_range(0..GARBAGE.len())]
        ),
    };
    format!("{effect};credential={key}")
}

fn client_loop(id: u64, seed: u64, shared: Arc<Shared>) {
    let mut rng = StdRng::seed_from_u64(seed ^ (id + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut local = Tally::default();
    // Odd threads keep their connection alive between requests, even ones do not.
    let mut session = (id % 2 == 1).then(client::Session::new);
    while !shared.stop.load(Ordering::Relaxed) {
        let e0 = shared.epoch.load(Ordering::SeqCst);
        if shared.down.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        let addr = *shared.addr.read().unwrap();
        let restarted = shared.after_restart.load(Ordering::SeqCst);
        let shape = Shape::random(&mut rng);
        let model = match shape.api {
            Api::Chat => "chat",
            Api::Messages => "claude",
        };
        let body = shape.body(model, &mut rng);
        let hf = rng.gen_bool(0.1).then(|| header_fault(&mut rng));
        let mut headers: Vec<(&str, &str)> = Vec::new();
        if let Some(h) = &hf {
            headers.push(("x-mock-fault", h.as_str()));
        }
        if shape.api == Api::Messages {
            headers.push(("anthropic-version", "2023-06-01"));
        }
        let faults_before = shared.faults.lock().unwrap().clone();
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
        let crashed =
            shared.epoch.load(Ordering::SeqCst) != e0 || shared.down.load(Ordering::SeqCst);
        let v = verdict::judge(shape, &res, GARBAGE, crashed, reused, UPSTREAMS);
        let ttfb = res.as_ref().ok().map(|x| x.ttfb);
        let served_by = res.as_ref().ok().and_then(client::Exchange::served_by);
        if restarted && matches!(v, Verdict::Ok { .. }) {
            if let Some(s) = &served_by {
                if s == "pa/acool" || s == "pa/aterm" {
                    shared.excluded_hits.lock().unwrap().push(s.clone());
                }
            }
        }
        let describe = || {
            let faults_after = shared.faults.lock().unwrap().clone();
            let mut d = format!(
                "{v:?}\n    request: {} model={model} header-fault={hf:?} reused={reused} after {elapsed:?}\n    \
                 process faults at start a={:?} b={:?}, at end a={:?} b={:?}\n",
                shape.label(),
                faults_before[0],
                faults_before[1],
                faults_after[0],
                faults_after[1],
            );
            d.push_str(&client::describe(&res));
            d
        };
        if v.is_bad() {
            eprintln!("BAD OUTCOME {}", describe());
        }
        let ok = matches!(v, Verdict::Ok { .. });
        local.record(shape, &v, elapsed, ttfb, served_by, describe);
        if local.requests % 50 == 0 {
            shared.tally.lock().unwrap().merge(&local);
            local = Tally::default();
        }
        // Think time; after anything but an answer, back off like a polite client so
        // fast refusals do not crowd the mix out.
        let pause = if ok { 0..15 } else { 100..300 };
        std::thread::sleep(Duration::from_millis(rng.gen_range(pause)));
    }
    shared.tally.lock().unwrap().merge(&local);
}

/// Sleeps `d` in small steps; false when the chaos must pause or stop.
fn hold(shared: &Shared, d: Duration) -> bool {
    let until = Instant::now() + d;
    while Instant::now() < until {
        if shared.stop.load(Ordering::Relaxed) || shared.pause_chaos.load(Ordering::SeqCst) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    true
}

fn set_fault(mocks: &[&Mock; 2], shared: &Shared, which: usize, spec: &str) {
    mocks[which].set_fault(spec);
    shared.faults.lock().unwrap()[which] = spec.to_string();
}

fn chaos_loop(seed: u64, shared: Arc<Shared>, a: &Mock, b: &Mock) -> BTreeMap<&'static str, u64> {
    let mocks = [a, b];
    let mut rng = StdRng::seed_from_u64(seed);
    let mut injected: BTreeMap<&'static str, u64> = BTreeMap::new();
    let clear = |shared: &Shared| {
        for i in 0..2 {
            set_fault(&mocks, shared, i, "");
        }
    };
    while !shared.stop.load(Ordering::Relaxed) {
        if shared.pause_chaos.load(Ordering::SeqCst) {
            clear(&shared);
            shared.chaos_idle.store(true, Ordering::SeqCst);
            while shared.pause_chaos.load(Ordering::SeqCst) && !shared.stop.load(Ordering::Relaxed)
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            shared.chaos_idle.store(false, Ordering::SeqCst);
            continue;
        }
        let which = rng.gen_range(0..2);
        let g = GARBAGE[rng.gen_range(0..GARBAGE.len())];
        let (kind, spec, secs): (&'static str, String, f64) = match rng.gen_range(0..15) {
            0 => ("reset before the header", "reset_after=0".into(), 1.0),
            1 => ("reset mid-stream / mid-body", "reset_after=2".into(), 2.0),
            2 => ("garbage 200 body", format!("status=200;body={g}"), 1.5),
            3 => ("garbage 502 body", format!("status=502;body={g}"), 1.5),
            4 => {
                let s = [500, 502, 503][rng.gen_range(0..3)];
                ("5xx storm", format!("status={s}"), rng.gen_range(2.0..5.0))
            }
            5 => (
                "429 with Retry-After",
                format!("status=429;retry_after={}", rng.gen_range(1..3)),
                1.5,
            ),
            6 => ("429 without Retry-After", "status=429".into(), 1.5),
            7 => ("stall mid-stream / mid-body", "stall_after=2".into(), 2.0),
            8 => (
                "stall before the first content",
                "stall_after=0".into(),
                1.5,
            ),
            9 => (
                "slow header beyond ttft",
                format!("first_byte_delay={}ms", TTFT.as_millis() + 500),
                2.0,
            ),
            10 => ("latency 300 ms", "latency=300ms".into(), 2.0),
            11 => (
                "slow chunks below stall",
                "chunk_interval=400ms".into(),
                3.0,
            ),
            12 => {
                let key = ["chaos-a1", "chaos-b1", "chaos-qa", "chaos-qb"][rng.gen_range(0..4)];
                (
                    "429 on one key",
                    format!("status=429;retry_after=3;credential={key}"),
                    2.0,
                )
            }
            13 => ("burst of 5 × 503", "status=503;times=5".into(), 2.0),
            _ => (
                "503 on both upstreams",
                "status=503".into(),
                rng.gen_range(1.0..2.0),
            ),
        };
        *injected.entry(kind).or_default() += 1;
        if kind == "503 on both upstreams" {
            set_fault(&mocks, &shared, 0, &spec);
            set_fault(&mocks, &shared, 1, &spec);
        } else {
            set_fault(&mocks, &shared, which, &spec);
        }
        let held = hold(&shared, Duration::from_secs_f64(secs));
        clear(&shared);
        if held {
            hold(&shared, Duration::from_millis(rng.gen_range(300..2500)));
        }
    }
    clear(&shared);
    injected
}

fn calls(mock: &Mock, key: &str) -> u64 {
    mock.stats()["by_credential"][key].as_u64().unwrap_or(0)
}

/// One request with a header fault for §7 state setup; its outcome does not matter.
fn poke(gw: &Gw, fault: &str) {
    let _ = client::post(
        gw.client,
        "/v1/chat/completions",
        &[("x-mock-fault", fault)],
        br#"{"model":"chat","messages":[]}"#,
        Instant::now() + DEADLINE,
    );
}

#[test]
#[ignore = "standing reliability run (minutes): make chaos"]
fn chaos_run() {
    let secs = env_secs("CHAOS_SECS", 240);
    let clients = env_secs("CHAOS_CLIENTS", 6);
    let seed = match std::env::var("CHAOS_SEED") {
        Ok(s) => s.trim().parse().expect("CHAOS_SEED is a u64"),
        Err(_) => {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                % 1_000_000_007
        }
    };
    println!(
        "CHAOS seed={seed} secs={secs} clients={clients} (rerun: CHAOS_SEED={seed} make chaos)"
    );
    let started_at = now_text();

    let (mock_a, mock_b) = reliability::start_mocks();
    let mut gw = Gw::start(&config(mock_a.addr, mock_b.addr), KEYS, "warn");

    let shared = Arc::new(Shared {
        addr: RwLock::new(gw.client),
        down: AtomicBool::new(false),
        epoch: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        pause_chaos: AtomicBool::new(false),
        chaos_idle: AtomicBool::new(false),
        faults: Mutex::new([String::new(), String::new()]),
        tally: Mutex::new(Tally::default()),
        after_restart: AtomicBool::new(false),
        excluded_hits: Mutex::new(Vec::new()),
    });
    let run_start = Instant::now();
    let mut checks: Vec<(String, bool, String)> = Vec::new();
    let mut restart_took = Duration::ZERO;

    let injected = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..clients)
            .map(|i| {
                let shared = shared.clone();
                scope.spawn(move || client_loop(i, seed, shared))
            })
            .collect();
        let chaos = {
            let shared = shared.clone();
            let (a, b) = (&mock_a, &mock_b);
            scope.spawn(move || chaos_loop(seed, shared, a, b))
        };

        // Halfway-ish: state SPEC §7 promises to keep, then kill -9.
        std::thread::sleep(Duration::from_secs(secs * 45 / 100));
        shared.pause_chaos.store(true, Ordering::SeqCst);
        assert!(
            wait_until(Duration::from_secs(15), || shared
                .chaos_idle
                .load(Ordering::SeqCst)),
            "chaos thread did not pause"
        );
        let _ = gw.admin("POST", "/api/resilience/reset", r#"{"provider":"pa"}"#);
        let cool = "status=429;retry_after=400;credential=chaos-acool";
        let cooled = wait_until(Duration::from_secs(30), || {
            poke(&gw, cool);
            let row = gw.connection_row("pa", "acool");
            row["state"] == "cooling" && row["remaining_s"].as_u64().unwrap_or(0) > 300
        });
        let term = r#"status=402;credential=chaos-aterm;body={"error":{"message":"Your credit balance is too low"}}"#;
        let terminal = wait_until(Duration::from_secs(30), || {
            poke(&gw, term);
            gw.connection_row("pa", "aterm")["state"] == "credits_exhausted"
        });
        let cool_left_before = gw.connection_row("pa", "acool")["remaining_s"]
            .as_u64()
            .unwrap_or(0);
        let state_set = Instant::now();
        shared.pause_chaos.store(false, Ordering::SeqCst);
        checks.push((
            "before the kill: pa/acool cooling > 300 s, pa/aterm credits_exhausted".into(),
            cooled && terminal,
            format!("cooling {cooled} ({cool_left_before} s left), terminal {terminal}"),
        ));
        // Far beyond the ≤ 200 ms flush window.
        std::thread::sleep(Duration::from_millis(1500));
        let used_before = (calls(&mock_a, "chaos-acool"), calls(&mock_a, "chaos-aterm"));

        shared.down.store(true, Ordering::SeqCst);
        shared.epoch.fetch_add(1, Ordering::SeqCst);
        let kill_at = Instant::now();
        gw.crash_and_restart();
        restart_took = kill_at.elapsed();
        *shared.addr.write().unwrap() = gw.client;
        shared.epoch.fetch_add(1, Ordering::SeqCst);
        shared.after_restart.store(true, Ordering::SeqCst);
        shared.down.store(false, Ordering::SeqCst);

        let row = gw.connection_row("pa", "acool");
        let left = row["remaining_s"].as_u64().unwrap_or(0);
        let elapsed = state_set.elapsed().as_secs();
        checks.push((
            "after kill -9: pa/acool still cooling with its time (±2 s)".into(),
            row["state"] == "cooling" && left + elapsed + 2 >= cool_left_before,
            format!(
                "state {}, {left} s left, {elapsed} s after it was set",
                row["state"]
            ),
        ));
        let row = gw.connection_row("pa", "aterm");
        checks.push((
            "after kill -9: pa/aterm still credits_exhausted".into(),
            row["state"] == "credits_exhausted",
            format!("state {}", row["state"]),
        ));

        let rest = Duration::from_secs(secs).saturating_sub(run_start.elapsed());
        std::thread::sleep(rest);
        shared.stop.store(true, Ordering::SeqCst);
        for w in workers {
            w.join().expect("client thread");
        }
        let injected = chaos.join().expect("chaos thread");

        let used_after = (calls(&mock_a, "chaos-acool"), calls(&mock_a, "chaos-aterm"));
        checks.push((
            "after the restart: no attempt on pa/acool or pa/aterm (mock a's counts)".into(),
            used_after == used_before,
            format!("before the kill {used_before:?}, at the end {used_after:?}"),
        ));
        let hits = shared.excluded_hits.lock().unwrap().clone();
        checks.push((
            "after the restart: no answer names pa/acool or pa/aterm".into(),
            hits.is_empty(),
            format!("{} answers", hits.len()),
        ));
        injected
    });

    // Faults cleared, breakers heal: the gateway answers again on both routes.
    let healthy = wait_until(Duration::from_secs(20), || {
        [Api::Chat, Api::Messages].iter().all(|&api| {
            let shape = Shape { api, stream: true };
            let model = if api == Api::Chat { "chat" } else { "claude" };
            let body = shape.body(model, &mut StdRng::seed_from_u64(1));
            let res = client::post(gw.client, api.path(), &[], &body, Instant::now() + DEADLINE);
            matches!(
                verdict::judge(shape, &res, &[], false, false, UPSTREAMS),
                Verdict::Ok { .. }
            )
        })
    });
    checks.push((
        "after the run: both routes answer correctly again".into(),
        healthy,
        String::new(),
    ));
    // Every upstream attempt the gateway gave up on (TTFT, stall, client gone) was
    // ended: nothing is left waiting at the mocks (a stalled answer would hold its
    // connection for 10 minutes if the gateway did not drop it).
    let idle_upstreams = wait_until(Duration::from_secs(15), || {
        mock_a.stats()["inflight"] == 0 && mock_b.stats()["inflight"] == 0
    });
    let (sa, sb) = (mock_a.stats(), mock_b.stats());
    let counter = |k: &str| sa[k].as_u64().unwrap_or(0) + sb[k].as_u64().unwrap_or(0);
    checks.push((
        "after the run: no upstream request left in flight at the mocks".into(),
        idle_upstreams,
        format!(
            "inflight a={} b={}; upstream requests {}, abandoned during a delay {}, \
             streams aborted {}, streams completed {}",
            sa["inflight"],
            sb["inflight"],
            counter("total"),
            counter("requests_abandoned"),
            counter("streams_aborted"),
            counter("streams_completed")
        ),
    ));
    let panics = gw.panics();
    checks.push((
        "no panic in the gateway's stderr".into(),
        panics.is_empty(),
        panics.first().cloned().unwrap_or_default(),
    ));
    let tally = shared.tally.lock().unwrap().clone();

    let mut report = String::new();
    let _ = writeln!(
        report,
        "### Chaos run, seed {seed}\n\n- started: {started_at}\n- command: `CHAOS_SEED={seed} CHAOS_SECS={secs} CHAOS_CLIENTS={clients} make chaos`\n\
         - load: {clients} client threads (half on kept-alive connections), chat / messages × stream / whole, 1 in 10 with its own `x-mock-fault` on one key\n\
         - gateway: 2 threads, max_attempts 3, ttft {} ms, stall {} ms, execution {} s; client deadline {} s\n\
         - upstreams: 2 mocks ({MOCK_CHUNKS} chunks, 25 ms apart), providers pa (4 keys) + pb (2) openai, qa + qb anthropic\n\
         - kill -9 + restart at {} s; restart to LISTENING took {} ms; gateway lives: {}\n",
        TTFT.as_millis(),
        STALL.as_millis(),
        EXECUTION.as_secs(),
        DEADLINE.as_secs(),
        secs * 45 / 100,
        restart_took.as_millis(),
        gw.lives,
    );
    report.push_str(&tally.table());
    let _ = writeln!(
        report,
        "\n| fault injected (process slot) | times |\n|---|---:|"
    );
    for (k, v) in &injected {
        let _ = writeln!(report, "| {k} | {v} |");
    }
    let _ = writeln!(report, "\n| check | result | detail |\n|---|---|---|");
    for (name, ok, detail) in &checks {
        let _ = writeln!(
            report,
            "| {name} | {} | {detail} |",
            if *ok { "pass" } else { "FAIL" }
        );
    }
    if !tally.examples.is_empty() {
        let _ = writeln!(report, "\nBad outcomes (first {}):\n", tally.examples.len());
        for e in &tally.examples {
            let _ = writeln!(report, "```\n{e}\n```");
        }
    }
    println!("\n{report}");
    let path = write_report(&format!("chaos-{seed}.md"), &report);
    println!("report written to {}", path.display());

    assert!(
        tally.requests >= 100,
        "too few requests: {}",
        tally.requests
    );
    assert!(tally.ok() > 0, "no correct answer at all");
    assert_eq!(tally.hangs, 0, "requests hung past the client deadline");
    assert_eq!(
        tally.framed_truncations, 0,
        "truncations were framed as success"
    );
    assert_eq!(tally.bad, 0, "bad outcomes: see the report");
    for (name, ok, detail) in &checks {
        assert!(ok, "{name}: {detail}");
    }
}

/// The client and the judge on real sockets, against a bare mock (no gateway), so a
/// run that reports zero bad outcomes is known to be able to report some: the mock
/// is made to do what a broken gateway might.
#[test]
fn the_judge_flags_what_a_broken_gateway_would_do() {
    let chunks = MOCK_CHUNKS.to_string();
    let mock = Mock::start_named(
        "a",
        &["--chunks", chunks.as_str(), "--chunk-interval", "1ms"],
    );
    let labels = "header=x-sluice-provider:pa;header=x-sluice-connection:a1";
    let see = |shape: Shape, fault: &str, deadline: Duration| {
        let model = if shape.api == Api::Chat {
            "chat"
        } else {
            "claude"
        };
        let body = shape.body(model, &mut StdRng::seed_from_u64(3));
        let spec = format!("{labels};{fault}");
        let res = client::post(
            mock.addr,
            shape.api.path(),
            &[("x-mock-fault", spec.as_str())],
            &body,
            Instant::now() + deadline,
        );
        verdict::judge(shape, &res, GARBAGE, false, false, UPSTREAMS)
    };
    let second = Duration::from_secs(1);
    for api in [Api::Chat, Api::Messages] {
        for stream in [false, true] {
            let shape = Shape { api, stream };
            assert_eq!(
                see(shape, "latency=1ms", DEADLINE),
                Verdict::Ok { from: "a".into() },
                "{shape:?}"
            );
            // A stream cut without its terminating chunk is an honest end...
            assert_eq!(see(shape, "reset_after=2", DEADLINE), Verdict::Cut);
            // ...one that never ends is a hang at the deadline...
            assert!(matches!(
                see(shape, "stall_after=2", second),
                Verdict::Hang { .. }
            ));
            // ...and an answer from the other upstream is caught by its label.
            let other = format!("{labels};latency=1ms")
                .replace("x-sluice-provider:pa", "x-sluice-provider:pb");
            let v = {
                let model = if api == Api::Chat { "chat" } else { "claude" };
                let body = shape.body(model, &mut StdRng::seed_from_u64(3));
                let res = client::post(
                    mock.addr,
                    api.path(),
                    &[("x-mock-fault", other.as_str())],
                    &body,
                    Instant::now() + DEADLINE,
                );
                verdict::judge(shape, &res, GARBAGE, false, false, UPSTREAMS)
            };
            assert!(matches!(v, Verdict::Mislabelled { .. }), "{v:?}");
        }
        let whole = Shape { api, stream: false };
        // A 503 without Retry-After, and a short body framed as complete.
        assert!(matches!(
            see(whole, "status=503", DEADLINE),
            Verdict::BadError { status: 503, .. }
        ));
        assert!(!see(whole, "status=503;retry_after=1", DEADLINE).is_bad());
        assert!(matches!(
            see(
                whole,
                r#"status=200;body={"id":"x","choices":[]}"#,
                DEADLINE
            ),
            Verdict::FramedTruncation { .. }
        ));
        assert_eq!(
            see(whole, &format!("status=200;body={}", GARBAGE[2]), DEADLINE),
            Verdict::Passthrough { status: 200 }
        );
    }
}
