//! TTL: an age bound, then LRU. Entries older than `max_age_ms` (since
//! commit) go first, oldest first; below the bound victims are in LRU order.
//! Two lists per node (by age, by use) over two link arrays and a commit
//! stamp: every operation O(1); 20 B per entry id.
//!
//! An entry that was in use re-enters the age list at the young end with
//! its old stamp (a list cannot re-insert in the middle in O(1)), so it
//! expires at most one lock period late.
use std::sync::Arc;
use std::time::Instant;

use super::list::{List, Lists, HELD, OUT, POPPED};
use super::{refuse, EntryId, EvictionPolicy, Obj, PerNode, Policy};
use crate::error::Result;

#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TtlConfig {
    pub max_age_ms: u64,
}

impl Default for TtlConfig {
    fn default() -> Self {
        Self { max_age_ms: 3_600_000 }
    }
}

/// Milliseconds on a monotonic clock.
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

pub struct Ttl {
    by_age: Lists,
    by_use: Lists,
    stamps: Vec<u32>,
    /// (age list, use list) per node.
    nodes: PerNode<(List, List)>,
    clock: Clock,
    max_age_ms: u64,
}

impl Ttl {
    pub fn with_clock(c: TtlConfig, clock: Clock) -> Self {
        Self {
            by_age: Lists::default(),
            by_use: Lists::default(),
            stamps: vec![],
            nodes: PerNode::default(),
            clock,
            max_age_ms: c.max_age_ms,
        }
    }

    fn lists(&mut self, node: u32) -> (List, List) {
        let (a, u) = (&mut self.by_age, &mut self.by_use);
        *self.nodes.get(node, || (a.new_list(), u.new_list()))
    }

    fn enqueue(&mut self, node: u32, id: EntryId) {
        let (a, u) = self.lists(node);
        self.by_age.push_front(a, id);
        self.by_use.push_front(u, id);
    }

    fn set_mark(&mut self, id: EntryId, mark: u32) {
        if self.by_use.linked(id) {
            self.by_age.unlink(id, mark);
            self.by_use.unlink(id, mark);
        } else {
            self.by_age.set_mark(id, mark);
            self.by_use.set_mark(id, mark);
        }
    }
}

impl Policy for Ttl {
    const NAME: &'static str = "ttl";
    type Config = TtlConfig;

    fn new(c: TtlConfig) -> Self {
        let start = Instant::now();
        Self::with_clock(c, Arc::new(move || start.elapsed().as_millis() as u64))
    }

    fn validate(c: &TtlConfig) -> Result<()> {
        if c.max_age_ms == 0 || c.max_age_ms > u64::from(u32::MAX) {
            return Err(refuse(Self::NAME, "max_age_ms", format!("must be between 1 and {}", u32::MAX)));
        }
        Ok(())
    }
}

impl EvictionPolicy for Ttl {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn insert(&mut self, node: u32, id: EntryId, _obj: Obj) {
        self.by_age.grow(id);
        if self.by_use.admit(id, &mut self.stamps) {
            self.remove(node, id, 0);
        }
        self.stamps[id.index()] = (self.clock)().min(u32::MAX as u64) as u32;
        self.enqueue(node, id);
    }

    fn touch(&mut self, node: u32, id: EntryId) {
        if self.by_use.linked(id) {
            let (_, u) = self.lists(node);
            self.by_use.unlink(id, OUT);
            self.by_use.push_front(u, id);
        }
    }

    fn hold(&mut self, _node: u32, id: EntryId) {
        if matches!(self.by_use.mark(id), None | Some(POPPED)) {
            self.set_mark(id, HELD);
        }
    }

    fn release(&mut self, node: u32, id: EntryId) {
        if self.by_use.mark(id) == Some(HELD) {
            self.set_mark(id, OUT);
            self.enqueue(node, id);
        }
    }

    fn pop_victim(&mut self, node: u32) -> Option<EntryId> {
        let &mut (a, u) = self.nodes.find(node)?;
        let oldest = self.by_age.back(a)?;
        let age = (self.clock)().saturating_sub(self.stamps[oldest.index()] as u64);
        let v = if age > self.max_age_ms { oldest } else { self.by_use.back(u)? };
        self.set_mark(v, POPPED);
        Some(v)
    }

    fn remove(&mut self, _node: u32, id: EntryId, _hash: u64) {
        if self.by_use.mark(id) != Some(OUT) {
            self.set_mark(id, OUT);
        }
    }

    fn prefetch(&self, id: EntryId) {
        self.by_use.prefetch(id);
    }

    fn prefetch_neighbours(&self, id: EntryId) {
        self.by_use.prefetch_neighbours(id);
    }
}
