//! The permits one node holds in one limited scope's cluster-wide count, and when it takes
//! more from Redis or gives some back (SPEC §7.1). Pure: no Redis, no clock.
//!
//! A node takes permits from Redis a few at a time and lends them to its own attempts, so
//! a busy connection does not cost a Redis round-trip per attempt. What it protects: the
//! cap, and the other nodes' part of it. Invariants: every permit lent or idle here is a
//! member of the scope's sorted set in Redis (or will be, written by the next heartbeat,
//! when it was admitted on the share while Redis was down), so the attempts in flight
//! across the cluster never exceed the cap; a node keeps idle permits only up to its fair
//! part (cap ÷ live nodes) and gives back every permit returned beyond it, so no node
//! sits on more than its part while others wait, and a node whose part is free gets it
//! at once; the heartbeat gives back the permits idle for a whole beat, so a node that
//! went quiet returns its reserve within two beats. `slack` (how many more to take per
//! ask) is 0 for caps under 8 per live node: then every attempt takes its permit from
//! Redis and gives it back when it ends.

use std::collections::HashSet;

/// What a node may keep without lending it, in a scope capped at `cap` with `live` nodes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Reserve {
    /// Permits taken from Redis on top of each one asked for: an eighth of the node's
    /// part, 0 under 8 per node (then no permit is kept idle).
    pub slack: usize,
    /// The node's part of the cap, cap ÷ live nodes: what it may keep held while idle.
    pub fair: usize,
}

pub fn reserve(cap: u32, live: u32) -> Reserve {
    let live = live.max(1);
    Reserve {
        slack: (cap / live.saturating_mul(8)) as usize,
        fair: (cap / live) as usize,
    }
}

#[derive(Default)]
pub struct Pool {
    /// The scope's cap, as of the last attempt that asked for a permit in it.
    pub cap: u32,
    /// Every permit this node holds in the scope, lent or idle.
    members: HashSet<String>,
    /// Permits held and lent to no attempt.
    idle: Vec<String>,
    /// Fewest idle permits since the last heartbeat.
    low: usize,
}

impl Pool {
    /// An idle permit for an attempt, if the node holds one.
    pub fn take(&mut self) -> Option<String> {
        let m = self.idle.pop()?;
        self.low = self.low.min(self.idle.len());
        Some(m)
    }

    /// Permits Redis granted: the first is lent at once, the others idle.
    pub fn granted(&mut self, mut members: Vec<String>) -> Option<String> {
        let first = (!members.is_empty()).then(|| members.remove(0))?;
        self.members.insert(first.clone());
        for m in members {
            self.members.insert(m.clone());
            self.idle.push(m);
        }
        Some(first)
    }

    /// A permit lent without asking Redis (admitted on the node's share).
    pub fn lend_unasked(&mut self, member: String) {
        self.members.insert(member);
    }

    /// An attempt's permit back; returns those to give back to Redis: with a slack,
    /// the idle ones beyond the fair part (a node lending more than its part gives each
    /// permit back as it returns, for the other nodes to compete for); without, all.
    pub fn put(&mut self, member: String, r: Reserve) -> Vec<String> {
        if !self.members.contains(&member) {
            return Vec::new();
        }
        self.idle.push(member);
        let lent = self.members.len() - self.idle.len();
        let keep = if r.slack == 0 { lent } else { r.fair.max(lent) };
        let over = self.members.len().saturating_sub(keep);
        self.release(over.min(self.idle.len()))
    }

    /// Gives back every idle permit (the scope's cap changed: what is held was sized
    /// for the old one).
    pub fn drain_idle(&mut self) -> Vec<String> {
        self.release(self.idle.len())
    }

    /// At a heartbeat: gives back the permits that stayed idle the whole beat.
    pub fn beat(&mut self) -> Vec<String> {
        let n = self.low.min(self.idle.len());
        let out = self.release(n);
        self.low = self.idle.len();
        out
    }

    /// Every permit held (the heartbeat renews them all).
    pub fn members(&self) -> impl Iterator<Item = &String> {
        self.members.iter()
    }

    pub fn has_idle(&self) -> bool {
        !self.idle.is_empty()
    }

    pub fn holds(&self, member: &str) -> bool {
        self.members.contains(member)
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    fn release(&mut self, n: usize) -> Vec<String> {
        let out: Vec<String> = self.idle.drain(self.idle.len() - n..).collect();
        for m in &out {
            self.members.remove(m);
        }
        self.low = self.low.min(self.idle.len());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize, from: usize) -> Vec<String> {
        (from..from + n).map(|i| format!("n:{i}")).collect()
    }

    const NO_SLACK: Reserve = Reserve { slack: 0, fair: 1 };

    #[test]
    fn slack_is_an_eighth_of_a_nodes_part_and_zero_for_small_caps() {
        assert_eq!(reserve(64, 1), Reserve { slack: 8, fair: 64 });
        assert_eq!(reserve(64, 3), Reserve { slack: 2, fair: 21 });
        assert_eq!(reserve(4, 1).slack, 0);
        assert_eq!(reserve(23, 3).slack, 0);
        assert_eq!(
            reserve(10, 0),
            Reserve { slack: 1, fair: 10 },
            "no count yet"
        );
    }

    #[test]
    fn without_slack_every_permit_goes_back_at_once() {
        let mut p = Pool::default();
        let m = p.granted(names(1, 0)).unwrap();
        assert!(p.take().is_none());
        assert_eq!(p.put(m, NO_SLACK), vec!["n:0".to_string()]);
        assert!(p.is_empty());
    }

    #[test]
    fn a_node_keeps_its_fair_part_and_gives_back_what_it_lends_beyond() {
        let r = Reserve { slack: 2, fair: 6 };
        let mut p = Pool::default();
        // Granted 1 + slack, three times: nine held, all lent.
        let mut lent = Vec::new();
        for i in 0..3 {
            lent.push(p.granted(names(3, 3 * i)).unwrap());
            lent.push(p.take().unwrap());
            lent.push(p.take().unwrap());
        }
        assert!(p.take().is_none());
        // Beyond the fair part, each permit returned goes back to Redis.
        for held in [8, 7, 6] {
            let back = p.put(lent.pop().unwrap(), r);
            assert_eq!(back.len(), 1);
            assert!(back.iter().all(|m| !p.holds(m)));
            assert_eq!(p.members().count(), held);
        }
        // Within it, they are kept for the next attempts.
        while let Some(m) = lent.pop() {
            assert!(p.put(m, r).is_empty());
        }
        assert_eq!(p.members().count(), 6);
        assert!(p.take().is_some());
    }

    #[test]
    fn the_heartbeat_returns_what_idled_a_whole_beat() {
        let mut p = Pool::default();
        let first = p.granted(names(3, 0)).unwrap();
        p.beat();
        // Two idle all beat long, then one more comes back.
        assert!(p.put(first, Reserve { slack: 2, fair: 3 }).is_empty());
        let back = p.beat();
        assert_eq!(back.len(), 2, "the two idle since the last beat");
        assert_eq!(p.members().count(), 1);
        // The one left was idle this whole beat too.
        assert_eq!(p.beat().len(), 1);
        assert!(p.is_empty());
    }

    #[test]
    fn an_unasked_permit_is_held_and_given_back_like_the_others() {
        let mut p = Pool::default();
        p.lend_unasked("n:share".into());
        assert!(p.holds("n:share"));
        assert_eq!(
            p.put("n:share".into(), NO_SLACK),
            vec!["n:share".to_string()]
        );
        assert!(
            p.put("n:share".into(), NO_SLACK).is_empty(),
            "not held twice"
        );
    }
}
