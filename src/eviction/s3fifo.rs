//! S3-FIFO (Yang et al., SOSP'23): a small FIFO queue (10 % of the node's
//! entries) that new entries enter, a main FIFO queue, and a ghost history
//! of keys evicted from the small queue. An entry read while in the small
//! queue moves to main when it reaches the end; main re-queues entries that
//! were read (up to 3 times, one read credit per pass). A key found in the
//! ghost enters main directly. Insert, touch, hold, release and remove are
//! O(1); a victim search is amortised O(1) (each move spends a read
//! credit or leaves the small queue). 9 B per entry id plus the ghost.
use super::ghost::Ghost;
use super::list::{List, Lists, Popped, HELD, OUT, POPPED};
use super::{check_ghost, refuse, EntryId, EvictionPolicy, Obj, PerNode, Policy};
use crate::error::Result;

#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct S3FifoConfig {
    /// Share of a node's queued entries the small queue may hold.
    pub small: f64,
    /// Ghost slots per live entry.
    pub ghost: f64,
}

impl Default for S3FifoConfig {
    fn default() -> Self {
        Self { small: 0.1, ghost: 1.0 }
    }
}

/// `flags`: read credits in the low bits, queue in the top bit.
const MAIN: u8 = 0x80;
const CREDITS: u8 = 0x03;

struct Node {
    small: List,
    main: List,
    small_len: u64,
    main_len: u64,
}

pub struct S3Fifo {
    lists: Lists,
    flags: Vec<u8>,
    nodes: PerNode<Node>,
    ghost: Ghost,
    live: usize,
    /// The last victim and whether to remember it (it left from the
    /// small queue).
    popped: Popped,
    small: f64,
}

impl S3Fifo {
    fn node(&mut self, node: u32) -> &mut Node {
        let lists = &mut self.lists;
        self.nodes.get(node, || Node { small: lists.new_list(), main: lists.new_list(), small_len: 0, main_len: 0 })
    }

    /// Queue a candidate at the new end of the queue its flags name.
    fn enqueue(&mut self, node: u32, id: EntryId) {
        let main = self.flags[id.index()] & MAIN != 0;
        let n = self.node(node);
        let l = if main {
            n.main_len += 1;
            n.main
        } else {
            n.small_len += 1;
            n.small
        };
        self.lists.push_front(l, id);
    }

    fn dequeue(&mut self, node: u32, id: EntryId, mark: u32) {
        let main = self.flags[id.index()] & MAIN != 0;
        let n = self.node(node);
        if main {
            n.main_len -= 1;
        } else {
            n.small_len -= 1;
        }
        self.lists.unlink(id, mark);
    }
}

impl Policy for S3Fifo {
    const NAME: &'static str = "s3fifo";
    type Config = S3FifoConfig;

    fn new(c: S3FifoConfig) -> Self {
        Self {
            lists: Lists::default(),
            flags: vec![],
            nodes: PerNode::default(),
            ghost: Ghost::new(c.ghost),
            live: 0,
            popped: Popped::default(),
            small: c.small,
        }
    }

    fn validate(c: &S3FifoConfig) -> Result<()> {
        if !(c.small.is_finite() && c.small > 0.0 && c.small < 1.0) {
            return Err(refuse(Self::NAME, "small", "must be a share between 0 and 1 (exclusive)"));
        }
        check_ghost(Self::NAME, c.ghost)
    }
}

impl EvictionPolicy for S3Fifo {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn insert(&mut self, node: u32, id: EntryId, obj: Obj) {
        if self.lists.admit(id, &mut self.flags) {
            self.remove(node, id, 0);
        }
        self.live += 1;
        self.flags[id.index()] = if self.ghost.take(obj.hash).is_some() { MAIN } else { 0 };
        self.enqueue(node, id);
    }

    fn touch(&mut self, _node: u32, id: EntryId) {
        if self.lists.touchable(id).is_some() {
            let f = &mut self.flags[id.index()];
            if *f & CREDITS < CREDITS {
                *f += 1;
            }
        }
    }

    fn hold(&mut self, node: u32, id: EntryId) {
        if self.lists.holding(id) {
            self.dequeue(node, id, HELD);
        }
    }

    fn release(&mut self, node: u32, id: EntryId) {
        if self.lists.release(id) {
            self.enqueue(node, id);
        }
    }

    fn pop_victim(&mut self, node: u32) -> Option<EntryId> {
        let small_share = self.small;
        loop {
            let n = self.nodes.find(node)?;
            let (small, main) = (n.small, n.main);
            let total = n.small_len + n.main_len;
            if total == 0 {
                return None;
            }
            let from_small = n.main_len == 0 || n.small_len as f64 > small_share * total as f64;
            let id = if from_small { self.lists.back(small)? } else { self.lists.back(main)? };
            let f = self.flags[id.index()];
            if f & CREDITS == 0 {
                self.dequeue(node, id, POPPED);
                self.popped.set(id, from_small);
                return Some(id);
            }
            // Read while queued: it stays, in main, with one credit spent
            // (small-queue readers keep none).
            self.dequeue(node, id, OUT);
            self.flags[id.index()] = MAIN | if from_small { 0 } else { (f & CREDITS) - 1 };
            self.enqueue(node, id);
        }
    }

    fn remove(&mut self, node: u32, id: EntryId, hash: u64) {
        let Some(linked) = self.lists.leaving(id) else { return };
        if linked {
            self.dequeue(node, id, OUT);
        }
        if self.popped.remembers(id) {
            self.ghost.remember(hash, 1, self.live);
        }
        self.live -= 1;
    }

    fn prefetch(&self, id: EntryId) {
        self.lists.prefetch(id);
    }

    fn prefetch_neighbours(&self, id: EntryId) {
        self.lists.prefetch_neighbours(id);
    }
}
