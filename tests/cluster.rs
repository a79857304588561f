//! Several nodes on one real `redis-server` (SPEC §7.1), the strongly consistent half
//! and the outage behaviour: a lease on one node is exclusive on every node and its
//! generation fence holds everywhere; `max_concurrent` holds across the nodes; 20
//! concurrent 429s across three nodes raise a key's backoff level once; a terminal state
//! is never overwritten by a cooldown; Redis killed mid-traffic loses no request and
//! sharing resumes when it is back; a node killed with `kill -9` gives its permits back
//! after their expiry.

// Integration tests: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::gw::{server_section, Gateway};
use common::redis::Redis;
use common::{request, wait_until, Mock, Response};
use sluice::store::{Change, RedisStore, StateStore, Table};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A config on `mock` whose state is shared through `SLUICE_REDIS_URL`; `k1` carries
/// `k1_extra` (e.g. `max_concurrent: 2`).
fn config(mock: &str, k1_extra: &str, resilience: &str) -> String {
    format!(
        "{}clients:
  - {{ id: agent-a, key_env: CA, scopes: [\"lease:exclusive\"], allowed_connections: [\"p/k1\"] }}
  - {{ id: agent-b, key_env: CB, scopes: [\"lease:exclusive\"], allowed_connections: [\"p/k1\"] }}
  - {{ id: plain, key_env: CP }}
providers:
  - id: p
    base_url: \"{mock}\"
    api: openai
    connections:
      - {{ id: k1, api_key_env: K1{k1_extra} }}
      - {{ id: k2, api_key_env: K2 }}
models:
  - name: m
    strategy: priority
    targets: [ {{ provider: p, model: up }} ]
  - name: only-k1
    targets: [ {{ provider: p, model: up, connection: k1 }} ]
{resilience}",
        server_section("  max_attempts: 1")
    )
    .replace(
        "state:\n",
        "state:\n  backend: redis\n  redis: { url_env: SLUICE_REDIS_URL, key_prefix: \"c:\", sync_interval: 100ms }\n",
    )
}

/// The headers of a client key without leases.
const PLAIN: &[(&str, &str)] = &[("authorization", "Bearer client-p")];

fn env(url: &str) -> Vec<(&'static str, String)> {
    vec![
        ("CA", "client-a".into()),
        ("CB", "client-b".into()),
        ("CP", "client-p".into()),
        ("K1", "key-1".into()),
        ("K2", "key-2".into()),
        ("SLUICE_REDIS_URL", url.into()),
    ]
}

fn nodes(yaml: &str, url: &str, n: usize) -> Vec<Gateway> {
    let env = env(url);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    (0..n).map(|_| Gateway::start(yaml, &env)).collect()
}

/// `n` requests for `only-k1` at once, spread over the nodes in turn.
fn spread(g: &[Gateway], n: usize) -> Vec<Response> {
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let addr = g[i % g.len()].client;
            std::thread::spawn(move || {
                request(
                    addr,
                    "POST",
                    "/v1/chat/completions",
                    PLAIN,
                    br#"{"model":"only-k1"}"#,
                )
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn call(gw: &Gateway, path: &str, headers: &[(&str, &str)], body: &str) -> Response {
    request(gw.client, "POST", path, headers, body.as_bytes())
}

fn lease(gw: &Gateway, key: &str, body: &str) -> Response {
    let auth = format!("Bearer {key}");
    call(
        gw,
        "/api/v1/session-leases",
        &[("authorization", &auth)],
        body,
    )
}

fn chat_leased(gw: &Gateway, owner: &str, generation: &str) -> Response {
    call(
        gw,
        "/v1/chat/completions",
        &[
            ("authorization", "Bearer client-a"),
            ("x-sluice-lease-owner", owner),
            ("x-sluice-lease-generation", generation),
        ],
        r#"{"model":"m"}"#,
    )
}

/// `field` of `connection`'s entry in a node's `/api/resilience/cooldowns`.
fn conn_field(gw: &Gateway, connection: &str, field: &str) -> serde_json::Value {
    let r = gw.admin_get("/api/resilience/cooldowns?provider=p");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["connections"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["connection"] == connection)
        .map(|c| c[field].clone())
        .unwrap_or_default()
}

#[test]
fn a_lease_on_one_node_is_exclusive_and_fenced_on_every_node() {
    let redis = Redis::start();
    let mock = Mock::start(&[]);
    let yaml = config(&mock.base_url(), "", "");
    let g = nodes(&yaml, &redis.url(), 3);

    let a = lease(&g[0], "client-a", r#"{"action":"acquire","ttl_s":300}"#);
    assert_eq!(a.status, 200, "{}", a.text());
    let a = a.json();
    assert_eq!(a["connection"], "p/k1");
    let owner = a["owner"].as_str().unwrap().to_string();
    let generation = a["generation"].as_u64().unwrap();

    // The only connection agent-b may use is leased: 429 on the other nodes at once
    // (compare-and-set, not the eventual stream).
    for node in &g[1..] {
        let r = lease(node, "client-b", r#"{"action":"acquire"}"#);
        assert_eq!(r.status, 429, "{}", r.text());
        assert_eq!(r.json()["error"]["code"], "lease_capacity_unavailable");
        let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
        assert!((250..=300).contains(&retry), "{retry}");
    }
    // The owner's requests go through any node, to the leased connection; a stale
    // generation is 409 on every node.
    for node in &g {
        let r = chat_leased(node, &owner, &generation.to_string());
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-sluice-connection"), Some("k1"));
        let stale = chat_leased(node, &owner, &(generation + 7).to_string());
        assert_eq!(stale.status, 409, "{}", stale.text());
        assert_eq!(stale.json()["error"]["code"], "lease_generation_stale");
    }
    // Other nodes' ordinary routing learns the lease and keeps off k1.
    assert!(wait_until(Duration::from_secs(3), || {
        let r = call(
            &g[2],
            "/v1/chat/completions",
            &[("authorization", "Bearer client-p")],
            r#"{"model":"m"}"#,
        );
        r.status == 200 && r.header("x-sluice-connection") == Some("k2")
    }));
    // Renewed on b, released on c: b's acquire succeeds at once with a newer generation,
    // and the old owner is fenced off everywhere.
    let renew = format!(r#"{{"action":"renew","owner":"{owner}","ttl_s":60}}"#);
    let r = lease(&g[1], "client-a", &renew);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["generation"].as_u64(), Some(generation));
    let release = format!(r#"{{"action":"release","owner":"{owner}"}}"#);
    let r = lease(&g[2], "client-a", &release);
    assert_eq!(r.status, 200, "{}", r.text());
    let b = lease(&g[1], "client-b", r#"{"action":"acquire"}"#);
    assert_eq!(b.status, 200, "{}", b.text());
    assert!(b.json()["generation"].as_u64().unwrap() > generation);
    for node in &g {
        assert_eq!(
            chat_leased(node, &owner, &generation.to_string()).status,
            409
        );
    }
}

#[test]
fn max_concurrent_holds_across_three_nodes() {
    let redis = Redis::start();
    let mock = Mock::start(&["--fault", "latency=150ms"]);
    let yaml = config(
        &mock.base_url(),
        ", max_concurrent: 2",
        "resilience:\n  queue: { wait: \"30s\" }\n",
    );
    let g = nodes(&yaml, &redis.url(), 3);
    mock.reset();
    for r in spread(&g, 15) {
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let st = mock.stats();
    assert_eq!(st["total"], 15, "{st}");
    assert_eq!(st["max_inflight"], 2, "a cap of 2 across the cluster: {st}");
}

#[test]
fn a_busy_capped_connection_takes_permits_in_blocks_and_returns_them_when_idle() {
    let redis = Redis::start();
    let mock = Mock::start(&["--fault", "latency=40ms"]);
    // A cap of 48 over three nodes: each may keep 48 ÷ (8 × 3) = 2 permits idle.
    let yaml = config(
        &mock.base_url(),
        ", max_concurrent: 48",
        "resilience:\n  queue: { wait: \"30s\" }\n",
    );
    let g = nodes(&yaml, &redis.url(), 3);
    // One after another on one node: the first asks Redis for three, the rest reuse them.
    let seen = redis.monitor();
    for _ in 0..30 {
        let r = call(
            &g[0],
            "/v1/chat/completions",
            PLAIN,
            r#"{"model":"only-k1"}"#,
        );
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // The permit script's own calls (not the commands it runs, shown as "lua"): one ask
    // shows twice (the first EVALSHA answers NOSCRIPT and is sent again); asking per
    // attempt would show 30 or more.
    let asked = seen.count(&["\"EVALSHA\"", "c:permits:p/k1"])
        + seen.count(&["\"EVAL\"", "c:permits:p/k1"]);
    assert!(
        (1..=4).contains(&asked),
        "30 attempts asked Redis {asked} times"
    );
    drop(seen);
    // 150 at once over three nodes: every one answered, the cap held.
    mock.reset();
    for r in spread(&g, 150) {
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let st = mock.stats();
    assert_eq!(st["total"], 150, "{st}");
    let peak = st["max_inflight"].as_u64().unwrap();
    assert!(
        (2..=48).contains(&peak),
        "a cap of 48 across the cluster: {st}"
    );
    // Quiet again, every node gives its reserve back within two heartbeats.
    let held = || {
        let r = redis.command(&["ZCARD", "c:permits:p/k1"]);
        r.trim().trim_start_matches(':').parse::<u64>().unwrap()
    };
    assert!(held() > 0, "the nodes keep a reserve while busy");
    assert!(
        wait_until(Duration::from_secs(5), || held() == 0),
        "an idle node returned its permits"
    );
    // Redis emptied without any call failing: every node notices at its next heartbeat
    // and keeps to its share until all have written their permits back.
    assert!(redis.command(&["FLUSHALL"]).contains("OK"));
    for node in &g {
        assert!(
            wait_until(Duration::from_secs(5), || node.admin_get("/ready").json()
                ["state_backend"]["caps"]
                == "recovering"),
            "a node did not notice Redis lost its data"
        );
    }
    for node in &g {
        assert!(wait_until(Duration::from_secs(10), || node
            .admin_get("/ready")
            .json()["state_backend"]["caps"]
            == "cluster"));
    }
}

#[test]
fn concurrent_429s_across_three_nodes_raise_the_backoff_level_once() {
    let redis = Redis::start();
    let mock = Mock::start(&[]);
    let yaml = config(&mock.base_url(), "", "");
    let g = nodes(&yaml, &redis.url(), 3);
    mock.set_fault("status=429;latency=200ms;credential=key-1");
    let statuses: Vec<u16> = spread(&g, 21).iter().map(|r| r.status).collect();
    assert!(statuses.iter().all(|s| *s == 429), "{statuses:?}");
    assert!(mock.stats()["total"].as_u64().unwrap() >= 20);
    // Every node ends at level 1: 21 failures of one episode, one raise.
    for node in &g {
        assert!(
            wait_until(Duration::from_secs(3), || conn_field(node, "k1", "state")
                == "cooling"),
            "k1 not cooling on every node"
        );
        assert_eq!(conn_field(node, "k1", "backoff_level"), 1);
    }
}

#[test]
fn a_terminal_state_is_never_overwritten_by_a_cooldown() {
    let redis = Redis::start();
    let mock = Mock::start(&[]);
    let yaml = config(&mock.base_url(), "", "");
    let g = nodes(&yaml, &redis.url(), 2);
    // Node a learns k1's credit is exhausted (terminal); b takes it up.
    mock.set_fault("status=402;credential=key-1");
    let r = call(
        &g[0],
        "/v1/chat/completions",
        PLAIN,
        r#"{"model":"only-k1"}"#,
    );
    assert_eq!(r.status, 402, "{}", r.text());
    assert_eq!(conn_field(&g[0], "k1", "state"), "credits_exhausted");
    assert!(wait_until(Duration::from_secs(3), || conn_field(
        &g[1], "k1", "state"
    )
        == "credits_exhausted"));
    // A cooldown row from a node that had not learnt it yet, written the way every node
    // writes, is refused by the shared store: b keeps the terminal state and a node
    // that starts now loads it.
    let late = RedisStore::new(&redis.url(), "c:").unwrap();
    let cooling = serde_json::json!({
        "state": {"cooled_until": 99_999_999_999_999u64, "backoff_level": 1, "last_status": 429},
        "credential": null
    });
    late.apply(&[Change::upsert(Table::Connections, "p/k1", cooling)])
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(conn_field(&g[1], "k1", "state"), "credits_exhausted");
    let c = nodes(&yaml, &redis.url(), 1).pop().unwrap();
    assert_eq!(conn_field(&c, "k1", "state"), "credits_exhausted");
    // An operator's clear on b does lift it, on every node.
    let r = g[1].admin_post(
        "/api/resilience/cooldowns",
        r#"{"connections":["p/k1"],"include_terminal":true}"#,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    for node in [&g[0], &c] {
        assert!(
            wait_until(Duration::from_secs(3), || conn_field(node, "k1", "state")
                != "credits_exhausted"),
            "the clear did not reach every node"
        );
    }
}

#[test]
fn redis_killed_mid_traffic_loses_no_request_and_sharing_resumes() {
    let redis = Redis::start();
    let port = redis.addr.port();
    let url = redis.url();
    let mock = Mock::start(&["--fault", "latency=20ms"]);
    let yaml = config(
        &mock.base_url(),
        ", max_concurrent: 4",
        "resilience:\n  queue: { wait: \"10s\", fail_open: false }\n",
    );
    let g = nodes(&yaml, &url, 3);
    let stop = Arc::new(AtomicBool::new(false));
    let (sent, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let traffic: Vec<_> = g
        .iter()
        // Three clients per node on a cap of 4: with Redis down each node's share is 1,
        // and its waiters (holding the local permits) must not count against it.
        .flat_map(|node| [node.client; 3])
        .map(|addr| {
            let (stop, sent, failed) = (stop.clone(), sent.clone(), failed.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let r = request(
                        addr,
                        "POST",
                        "/v1/chat/completions",
                        PLAIN,
                        br#"{"model":"only-k1"}"#,
                    );
                    sent.fetch_add(1, Ordering::Relaxed);
                    if r.status != 200 {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    // The upstream's most attempts in flight at once since the last call.
    let peak = || {
        let st = mock.stats();
        mock.reset();
        st["max_inflight"].as_u64().unwrap()
    };
    // Every node has counted the others (the share of a node that has not is the cap).
    for node in &g {
        assert!(wait_until(Duration::from_secs(5), || {
            node.admin_get("/ready").json()["state_backend"]["live_nodes"] == 3
        }));
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        (2..=4).contains(&peak()),
        "up: a cap of 4 across the cluster"
    );
    redis.stop();
    // Down: every node keeps serving and says so.
    for node in &g {
        assert!(wait_until(Duration::from_secs(5), || {
            let r = node.admin_get("/ready");
            let b = &r.json()["state_backend"];
            r.status == 200 && b["reachable"] == false && b["caps"] == "share"
        }));
    }
    // The attempts admitted before the outage are over by now.
    std::thread::sleep(Duration::from_millis(200));
    peak();
    let during = sent.load(Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        sent.load(Ordering::Relaxed) > during + 20,
        "traffic went on while Redis was down"
    );
    assert!(peak() <= 3, "down: a share of 4 ÷ 3 = 1 per node");
    // Back, empty (no persistence): the nodes write the attempts they admitted on their
    // shares before any of them takes permits from Redis again.
    let redis = Redis::start_on(port);
    for node in &g {
        assert!(wait_until(Duration::from_secs(10), || {
            node.admin_get("/ready").json()["state_backend"]["reachable"] == true
        }));
    }
    for node in &g {
        assert!(wait_until(Duration::from_secs(10), || {
            node.admin_get("/ready").json()["state_backend"]["caps"] == "cluster"
        }));
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(peak() <= 4, "back: the cap of 4 holds through the recovery");
    stop.store(true, Ordering::Relaxed);
    for t in traffic {
        t.join().unwrap();
    }
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "every request answered 200"
    );
    assert!(g[0].metric("sluice_state_backend_errors_total").unwrap() > 0.0);
    // Sharing resumes: a cooldown learnt on a reaches b and c.
    mock.set_fault("status=429;retry_after=120;credential=key-1");
    let r = call(
        &g[0],
        "/v1/chat/completions",
        PLAIN,
        r#"{"model":"only-k1"}"#,
    );
    assert_eq!(r.status, 429, "{}", r.text());
    mock.set_fault("");
    for node in &g[1..] {
        assert!(
            wait_until(Duration::from_secs(5), || conn_field(node, "k1", "state")
                == "cooling"),
            "sharing did not resume"
        );
    }
    drop(redis);
}

#[test]
fn a_killed_nodes_permits_come_back_after_their_expiry() {
    let redis = Redis::start();
    let mock = Mock::start(&[]);
    // No fail-open: only the dead node's permit expiring can serve b's request.
    let yaml = config(
        &mock.base_url(),
        ", max_concurrent: 1",
        "resilience:\n  queue: { wait: \"30s\", fail_open: false }\n",
    );
    let mut g = nodes(&yaml, &redis.url(), 2);
    // Node a holds k1's only cluster-wide permit with a request that hangs upstream.
    let a = g[0].client;
    // (Raw bytes: the connection dies with the node, which is the point.)
    let mut hung = std::net::TcpStream::connect(a).unwrap();
    let body = r#"{"model":"only-k1"}"#;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer client-p\r\n\
         x-mock-fault: latency=120s\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    std::io::Write::write_all(&mut hung, head.as_bytes()).unwrap();
    assert!(wait_until(Duration::from_secs(5), || mock.stats()
        ["inflight"]
        == 1));
    // b's request waits for that permit while a is alive...
    let b = g[1].client;
    let short = std::thread::spawn(move || {
        let t = sluice::clock::monotonic();
        let r = request(
            b,
            "POST",
            "/v1/chat/completions",
            PLAIN,
            br#"{"model":"only-k1"}"#,
        );
        (r, t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(mock.stats()["total"], 1, "b must wait for a's permit");
    // ...and a leased connection is a's as well.
    let l = lease(&g[0], "client-a", r#"{"action":"acquire","ttl_s":3}"#);
    assert_eq!(l.status, 200, "{}", l.text());
    // kill -9 a: nothing gives the permit back but its expiry.
    g[0].proc.kill();
    let (r, took) = short.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        took >= Duration::from_secs(5) && took < Duration::from_secs(25),
        "served only after the dead node's permit expired (10 s after its last renewal): {took:?}"
    );
    // The dead node's lease ends with its TTL: b can lease k1.
    let got = lease(&g[1], "client-b", r#"{"action":"acquire"}"#);
    assert_eq!(got.status, 200, "{}", got.text());
    assert_eq!(got.json()["connection"], "p/k1");
    g.truncate(1);
}

#[test]
fn a_runtime_override_on_one_node_reaches_the_others() {
    let redis = Redis::start();
    let mock = Mock::start(&[]);
    let yaml = config(&mock.base_url(), "", "");
    let g = nodes(&yaml, &redis.url(), 2);
    let queue_wait = |gw: &Gateway| {
        let j = gw.admin_get("/api/resilience").json();
        let s = &j["settings"]["queue.wait"];
        (
            s["value"].clone(),
            s["source"].as_str().unwrap_or("").to_string(),
        )
    };
    let r = g[0].admin("PATCH", "/api/resilience", r#"{"queue.wait": "7s"}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        wait_until(Duration::from_secs(3), || queue_wait(&g[1])
            == (serde_json::json!("7s"), "override".into())),
        "b did not take up a's override: {:?}",
        queue_wait(&g[1])
    );
    // Removing it on b puts a back on its file value.
    let r = g[1].admin("PATCH", "/api/resilience", r#"{"queue.wait": null}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(wait_until(Duration::from_secs(3), || queue_wait(&g[0]).1 != "override"));
}
