//! Shared machinery of the standing reliability runs (`make chaos`, `make soak`): a
//! deadline-bounded HTTP client, the judge of what a client saw, a tally with its
//! report table, a gateway wrapper that keeps the gateway's stderr (to find panics) and
//! survives `kill -9` restarts, and `/proc` readings of a process.
//!
//! Nothing here is a test on its own; `tests/chaos.rs` and `tests/soak.rs` drive it.
//! Every wait is bounded: a request has one client-side deadline for everything
//! (connect, header, body), and a request that reaches it is counted as a hang.

#![allow(dead_code)]

pub mod client;
pub mod gateway;
pub mod procfs;
pub mod tally;
pub mod verdict;

use rand::Rng;

/// The two upstream mocks of a run, `a` and `b`: `MOCK_CHUNKS` chunks 25 ms apart, one
/// thread each.
pub fn start_mocks() -> (crate::common::Mock, crate::common::Mock) {
    let chunks = verdict::MOCK_CHUNKS.to_string();
    let args = [
        "--chunks",
        chunks.as_str(),
        "--chunk-interval",
        "25ms",
        "--threads",
        "1",
    ];
    (
        crate::common::Mock::start_named("a", &args),
        crate::common::Mock::start_named("b", &args),
    )
}

/// The two API families the runs exercise, one route each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Api {
    /// `POST /v1/chat/completions` (OpenAI family).
    Chat,
    /// `POST /v1/messages` (Anthropic family).
    Messages,
}

impl Api {
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Messages => "/v1/messages",
        }
    }
}

/// What one client request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Shape {
    pub api: Api,
    pub stream: bool,
}

impl Shape {
    /// Uniformly one of the four shapes.
    pub fn random(rng: &mut impl Rng) -> Shape {
        Shape {
            api: if rng.gen_bool(0.5) {
                Api::Chat
            } else {
                Api::Messages
            },
            stream: rng.gen_bool(0.5),
        }
    }

    pub fn label(self) -> &'static str {
        match (self.api, self.stream) {
            (Api::Chat, false) => "chat",
            (Api::Chat, true) => "chat+stream",
            (Api::Messages, false) => "messages",
            (Api::Messages, true) => "messages+stream",
        }
    }

    /// A request body for public model `model`, padded with a few hundred bytes of
    /// varying prompt so bodies are not all alike.
    pub fn body(self, model: &str, rng: &mut impl Rng) -> Vec<u8> {
        let words = rng.gen_range(1..40);
        let prompt: String = (0..words).map(|i| format!("word{i} ")).collect();
        let v = match self.api {
            Api::Chat => serde_json::json!({
                "model": model,
                "stream": self.stream,
                "messages": [{"role": "user", "content": prompt}],
            }),
            Api::Messages => serde_json::json!({
                "model": model,
                "stream": self.stream,
                "max_tokens": 64,
                "messages": [{"role": "user", "content": prompt}],
            }),
        };
        serde_json::to_vec(&v).expect("serialisable body")
    }
}

/// Percentile `p` (0–100) of an ascending-sorted slice; 0 when empty.
/// The two-mock topology both runs use: OpenAI providers `pa` (keys `a1`, `a2`, plus
/// `extra_pa` connection lines) on mock `a` and `pb` (`b1`, `b2`) on `b`, Anthropic
/// providers `qa` on `a` and `qb` on `b`; models `chat` (pa, pb) and `claude` (qa, qb),
/// round-robin; `resilience` is the body of the `resilience:` section.
pub fn topology(
    a: std::net::SocketAddr,
    b: std::net::SocketAddr,
    extra_pa: &str,
    resilience: &str,
) -> String {
    format!(
        r#"server:
  listen: "127.0.0.1:0"
  admin_listen: "127.0.0.1:0"
  threads: 2
  max_attempts: 3
admin:
  token_env: SLUICE_ADMIN_TOKEN
state:
  path: "@DIR@/state.redb"
rules_dir: "@DIR@/rules"
providers:
  - id: pa
    base_url: "http://{a}"
    api: openai
    class: local
    connections:
      - {{ id: a1, api_key_env: KEY_A1 }}
      - {{ id: a2, api_key_env: KEY_A2 }}
{extra_pa}  - id: pb
    base_url: "http://{b}"
    api: openai
    class: local
    connections:
      - {{ id: b1, api_key_env: KEY_B1 }}
      - {{ id: b2, api_key_env: KEY_B2 }}
  - id: qa
    base_url: "http://{a}"
    api: anthropic
    class: local
    connections:
      - {{ id: q1, api_key_env: KEY_QA }}
  - id: qb
    base_url: "http://{b}"
    api: anthropic
    class: local
    connections:
      - {{ id: q1, api_key_env: KEY_QB }}
models:
  - name: chat
    strategy: round-robin
    targets:
      - {{ provider: pa, model: up-a }}
      - {{ provider: pb, model: up-b }}
  - name: claude
    strategy: round-robin
    targets:
      - {{ provider: qa, model: up-qa }}
      - {{ provider: qb, model: up-qb }}
resilience:
{resilience}"#
    )
}

pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// Least-squares slope of `(x, y)` points (y per unit of x); 0 with fewer than 2.
pub fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if points.len() < 2 {
        return 0.0;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx == 0.0 {
        0.0
    } else {
        sxy / sxx
    }
}

/// Seconds from env var `name`, else `default`.
pub fn env_secs(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a whole number of seconds")),
        Err(_) => default,
    }
}

/// The wall-clock date and time, as `date` prints it, for reports.
pub fn now_text() -> String {
    std::process::Command::new("date")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// Writes `text` under the cargo target's tmp dir as `name` and returns the path.
pub fn write_report(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("reliability");
    std::fs::create_dir_all(&dir).expect("report dir");
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write report");
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_and_percentiles() {
        let pts: Vec<(f64, f64)> = (0..10).map(|i| (i as f64, 3.0 * i as f64 + 1.0)).collect();
        assert!((slope(&pts) - 3.0).abs() < 1e-9);
        assert_eq!(slope(&pts[..1]), 0.0);
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), 51);
        assert_eq!(percentile(&v, 99.0), 99);
        assert_eq!(percentile(&[], 50.0), 0);
    }
}
