//! Counting outcomes and latencies, and rendering them as a Markdown table that can be
//! pasted into docs/RELIABILITY.md.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use super::verdict::Verdict;
use super::{percentile, Shape};

/// How many bad outcomes are kept with their full description.
const EXAMPLES: usize = 40;

/// Counts and latencies of one request shape.
#[derive(Default, Clone, Debug, PartialEq, Eq)]
pub struct ShapeStats {
    pub requests: u64,
    pub ok: u64,
    /// Microseconds to the end of the body, correct answers only.
    pub ok_us: Vec<u64>,
    /// Microseconds to the status line, correct answers only.
    pub ok_ttfb_us: Vec<u64>,
}

#[derive(Default, Clone)]
pub struct Tally {
    pub requests: u64,
    /// Outcome row → count.
    pub rows: BTreeMap<String, u64>,
    /// Per request shape.
    pub shapes: BTreeMap<&'static str, ShapeStats>,
    /// Correct answers per `provider/connection`.
    pub served_by: BTreeMap<String, u64>,
    /// Microseconds, every request.
    pub latency_us: Vec<u64>,
    /// Microseconds, correct answers only.
    pub ok_latency_us: Vec<u64>,
    pub bad: u64,
    pub hangs: u64,
    pub framed_truncations: u64,
    pub stream_aborts: u64,
    /// The first bad outcomes, each with what was asked and what came back.
    pub examples: Vec<String>,
}

impl Tally {
    pub fn record(
        &mut self,
        shape: Shape,
        verdict: &Verdict,
        elapsed: Duration,
        ttfb: Option<Duration>,
        served_by: Option<String>,
        describe: impl FnOnce() -> String,
    ) {
        self.requests += 1;
        // Ends after the commit point are told apart by shape: an SSE stream should
        // mostly end with its error event, a whole body can only be cut.
        let row = match verdict {
            Verdict::Cut | Verdict::StreamError { .. } | Verdict::CrashCut => {
                format!("{} [{}]", verdict.key(), shape.label())
            }
            _ => verdict.key(),
        };
        *self.rows.entry(row).or_default() += 1;
        let s = self.shapes.entry(shape.label()).or_default();
        s.requests += 1;
        let us = elapsed.as_micros() as u64;
        self.latency_us.push(us);
        match verdict {
            Verdict::Ok { .. } => {
                s.ok += 1;
                s.ok_us.push(us);
                if let Some(t) = ttfb {
                    s.ok_ttfb_us.push(t.as_micros() as u64);
                }
                self.ok_latency_us.push(us);
                if let Some(c) = served_by {
                    *self.served_by.entry(c).or_default() += 1;
                }
            }
            Verdict::StreamError { .. } | Verdict::Cut => self.stream_aborts += 1,
            Verdict::Hang { .. } => self.hangs += 1,
            Verdict::FramedTruncation { .. } => self.framed_truncations += 1,
            _ => {}
        }
        if verdict.is_bad() {
            self.bad += 1;
            if self.examples.len() < EXAMPLES {
                self.examples.push(describe());
            }
        }
    }

    pub fn merge(&mut self, other: &Tally) {
        self.requests += other.requests;
        for (k, v) in &other.rows {
            *self.rows.entry(k.clone()).or_default() += v;
        }
        for (k, o) in &other.shapes {
            let e = self.shapes.entry(k).or_default();
            e.requests += o.requests;
            e.ok += o.ok;
            e.ok_us.extend_from_slice(&o.ok_us);
            e.ok_ttfb_us.extend_from_slice(&o.ok_ttfb_us);
        }
        for (k, v) in &other.served_by {
            *self.served_by.entry(k.clone()).or_default() += v;
        }
        self.latency_us.extend_from_slice(&other.latency_us);
        self.ok_latency_us.extend_from_slice(&other.ok_latency_us);
        self.bad += other.bad;
        self.hangs += other.hangs;
        self.framed_truncations += other.framed_truncations;
        self.stream_aborts += other.stream_aborts;
        for e in &other.examples {
            if self.examples.len() < EXAMPLES {
                self.examples.push(e.clone());
            }
        }
    }

    pub fn ok(&self) -> u64 {
        self.rows.get("ok").copied().unwrap_or(0)
    }

    /// The summary as Markdown tables.
    pub fn table(&self) -> String {
        let mut all = self.latency_us.clone();
        all.sort_unstable();
        let mut ok = self.ok_latency_us.clone();
        ok.sort_unstable();
        let ms = |v: &[u64], p: f64| format!("{:.1}", percentile(v, p) as f64 / 1000.0);
        let mut t = String::new();
        let _ = writeln!(t, "| measure | value |\n|---|---:|");
        let _ = writeln!(t, "| requests | {} |", self.requests);
        let _ = writeln!(t, "| correct answers (200, complete) | {} |", self.ok());
        let _ = writeln!(
            t,
            "| stream aborts after commit (error event or cut) | {} |",
            self.stream_aborts
        );
        let _ = writeln!(t, "| hangs past the client deadline | {} |", self.hangs);
        let _ = writeln!(
            t,
            "| truncations framed as success | {} |",
            self.framed_truncations
        );
        let _ = writeln!(t, "| bad outcomes in all | {} |", self.bad);
        let _ = writeln!(
            t,
            "| latency p50 / p99 / max, all requests (ms) | {} / {} / {} |",
            ms(&all, 50.0),
            ms(&all, 99.0),
            ms(&all, 100.0)
        );
        let _ = writeln!(
            t,
            "| latency p50 / p99, correct answers (ms) | {} / {} |",
            ms(&ok, 50.0),
            ms(&ok, 99.0)
        );
        let _ = writeln!(t, "\n| outcome | count |\n|---|---:|");
        for (k, v) in &self.rows {
            let _ = writeln!(t, "| {k} | {v} |");
        }
        let _ = writeln!(
            t,
            "\n| shape | correct / requests | ttfb p50 / p99 (ms) | total p50 / p99 (ms) |\n\
             |---|---:|---:|---:|"
        );
        for (k, s) in &self.shapes {
            let mut total = s.ok_us.clone();
            total.sort_unstable();
            let mut tt = s.ok_ttfb_us.clone();
            tt.sort_unstable();
            let _ = writeln!(
                t,
                "| {k} | {} / {} | {} / {} | {} / {} |",
                s.ok,
                s.requests,
                ms(&tt, 50.0),
                ms(&tt, 99.0),
                ms(&total, 50.0),
                ms(&total, 99.0)
            );
        }
        let _ = writeln!(
            t,
            "\n(latencies per shape: correct answers only; the all-requests figures above \
             mix fast refusals, whole answers and streams, so their p50 falls between modes)"
        );
        let _ = writeln!(t, "\n| served by (correct answers) | count |\n|---|---:|");
        for (k, v) in &self.served_by {
            let _ = writeln!(t, "| {k} | {v} |");
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reliability::Api;

    #[test]
    fn counts_and_merges() {
        let shape = Shape {
            api: Api::Chat,
            stream: true,
        };
        let mut a = Tally::default();
        a.record(
            shape,
            &Verdict::Ok { from: "a".into() },
            Duration::from_millis(5),
            Some(Duration::from_millis(2)),
            Some("pa/a1".into()),
            String::new,
        );
        a.record(
            shape,
            &Verdict::Hang { phase: "body" },
            Duration::from_millis(9),
            None,
            None,
            || "hung".into(),
        );
        let mut b = Tally::default();
        b.record(
            shape,
            &Verdict::Cut,
            Duration::from_millis(7),
            None,
            None,
            String::new,
        );
        b.merge(&a);
        assert_eq!(b.requests, 3);
        assert_eq!(b.ok(), 1);
        assert_eq!(b.hangs, 1);
        assert_eq!(b.bad, 1);
        assert_eq!(b.stream_aborts, 1);
        assert_eq!(b.examples, vec!["hung".to_string()]);
        let st = &b.shapes["chat+stream"];
        assert_eq!((st.ok, st.requests), (1, 3));
        assert_eq!(
            (st.ok_us.clone(), st.ok_ttfb_us.clone()),
            (vec![5000], vec![2000])
        );
        assert!(b
            .table()
            .contains("| chat+stream | 1 / 3 | 2.0 / 2.0 | 5.0 / 5.0 |"));
        assert!(b.table().contains("| HANG (body) | 1 |"));
    }
}
