//! Free notices per node: the pages of its regions whose entries the
//! primary's registry let go of (deleted, evicted or expired elsewhere),
//! numbered, delivered on its heartbeats until it acknowledges them.
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use crate::pool::NodeId;
use crate::registry::directory::FreedSink;
use crate::registry::Location;

/// Free notices per node: every location the registry lets go of goes to
/// its owner, numbered; a node acknowledges what it applied. Frees are
/// idempotent at the owner, so a notice delivered twice is harmless.
#[derive(Default)]
pub struct Notices {
    q: Mutex<HashMap<NodeId, Queue>>,
}

/// The last seq handed out, and the notices not yet acknowledged.
type Queue = (u64, VecDeque<(u64, Location)>);

impl FreedSink for Notices {
    fn freed(&self, locs: &[Location]) {
        let mut q = self.q.lock().unwrap();
        for l in locs {
            let (next, list) = q.entry(l.node).or_default();
            *next += 1;
            list.push_back((*next, *l));
        }
    }
}

impl Notices {
    /// Drop what `node` acknowledged; return up to `max` of the rest.
    pub fn pending(&self, node: NodeId, acked: u64, max: usize) -> (Vec<Location>, u64) {
        let mut q = self.q.lock().unwrap();
        let (next, list) = q.entry(node).or_default();
        while list.front().is_some_and(|(s, _)| *s <= acked) {
            list.pop_front();
        }
        let out: Vec<_> = list.iter().take(max).collect();
        let last = out.last().map_or(acked.max(*next - list.len() as u64), |(s, _)| *s);
        (out.into_iter().map(|(_, l)| *l).collect(), last)
    }

    /// The seq of the last notice handed out for `node`.
    pub fn last(&self, node: NodeId) -> u64 {
        self.q.lock().unwrap().get(&node).map_or(0, |(next, _)| *next)
    }

    /// Forget `node`'s queue (it joins again: its live set replaces it).
    /// Returns the seq the next notice will follow.
    pub fn reset(&self, node: NodeId) -> u64 {
        let mut q = self.q.lock().unwrap();
        let (next, list) = q.entry(node).or_default();
        list.clear();
        *next
    }
}
