//! `kv`: a policy for KV-cache chunks, built on what prefix-block traces
//! show (docs/BENCHMARKS.md, "Eviction quality"):
//!
//! - most stored chunks are never read again, and a request's last, partial
//!   chunk almost never is: a chunk smaller than the largest one the node
//!   has seen goes to a queue that is evicted before anything else;
//! - reuse is skewed (shared system prompts, the early turns of a long
//!   conversation) and decays: an entry's value is an exponentially decayed
//!   count of its reads, `sum 2^((t_i - now) / decay)`, so a chunk read many
//!   times recently outranks one read once, and old popularity fades;
//! - a chunk that comes back after it was evicted is being reused: a ghost
//!   history (by key hash) restores its decayed count on re-insert, and a
//!   chunk with no history enters below the chunks just read.
//!
//! Scores are kept as log2 of the decayed count scaled to the current time
//! (`log2 sum 2^(t_i / decay)`), which does not change between reads, so
//! entries never need re-scoring as time passes. They are quantised to
//! buckets of 1/4 of a doubling, and each node keeps a window of 128
//! buckets, each an LRU list: a read moves an entry to its new bucket, a
//! victim is the least recent entry of the lowest non-empty bucket. The
//! window slides with time by merging its lowest bucket into the next
//! (O(1) splice), so every operation is O(1) (a victim search scans at most
//! the window's empty buckets, amortised O(1)). Time is the node's insert
//! count, and `decay` is a fraction of the node's entries, so the policy
//! scales with the cache it orders.
//!
//! Memory: 8 B of links and a 4 B score per entry id, plus the ghost table
//! (<= 2 B per entry); per node 130 sentinels (1 KiB).
use super::ghost::Ghost;
use super::list::{List, Lists, HELD, OUT, POPPED};
use super::{EntryId, EvictionPolicy, Obj, PerNode};

#[derive(Debug, Clone, PartialEq)]
pub struct KvConfig {
    /// Inserts (as a fraction of the node's entries) over which a read's
    /// weight halves. Small: close to LRU; large: close to LFU.
    pub decay: f64,
    /// How far below a read "now" an entry with no history enters, in
    /// quarter doublings (4 = it ranks like a read one half-life ago).
    pub fresh_penalty: u32,
    /// Evict chunks smaller than the node's largest first.
    pub partial_first: bool,
    /// Ghost slots per live entry (0 = no ghost history).
    pub ghost: f64,
}

impl Default for KvConfig {
    fn default() -> Self {
        Self { decay: 0.5, fresh_penalty: 4, partial_first: true, ghost: 0.25 }
    }
}

/// Buckets per doubling of the decayed count.
const Q: u32 = 4;
/// Buckets in a node's window.
const B: u32 = 128;
/// Room kept above "now" for read bonuses (scores above it share the top bucket).
const HEADROOM: u32 = B / 2;
/// Fewest inserts per time step, so a tiny node still ages slowly enough.
const MIN_STEP: f64 = 16.0;

/// `LSE[d]` = Q * log2(1 + 2^(-d/Q)), rounded: what adding a weight `d`
/// buckets below the larger one adds to it.
const LSE: [u32; 40] = {
    // Precomputed: round(4 * log2(1 + 2^(-d/4))) for d = 0..40.
    [
        4, 4, 3, 3, 3, 3, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0,
    ]
};

/// log2(2^a + 2^b) in bucket units.
fn lse(a: u32, b: u32) -> u32 {
    let (hi, lo) = if a >= b { (a, b) } else { (b, a) };
    hi + LSE.get((hi - lo) as usize).copied().unwrap_or(0)
}

struct Node {
    /// Ring of bucket lists: absolute bucket `b` lives at `b % B`.
    buckets: [List; B as usize],
    partials: List,
    /// Lowest absolute bucket of the window.
    lo: u32,
    /// "Now", in buckets (advances Q per `decay` of the node's inserts).
    now: u32,
    /// Inserts since `now` last advanced, times Q.
    acc: f64,
    /// Entries of the node the policy knows (candidates and held).
    live: u64,
    largest: u64,
}

impl Node {
    fn new(lists: &mut Lists) -> Self {
        Self {
            buckets: std::array::from_fn(|_| lists.new_list()),
            partials: lists.new_list(),
            lo: 0,
            now: B - HEADROOM,
            acc: 0.0,
            live: 0,
            largest: 0,
        }
    }

    fn slot(&self, b: u32) -> List {
        self.buckets[(b % B) as usize]
    }

    /// A score relative to the window: scores far below it (or so old that
    /// they wrapped) count as its lowest bucket.
    fn clamp(&self, score: u32) -> u32 {
        let rel = score.wrapping_sub(self.lo) as i32;
        self.lo + rel.clamp(0, B as i32 - 1) as u32
    }
}

pub struct Kv {
    lists: Lists,
    scores: Vec<u32>,
    nodes: PerNode<Node>,
    ghost: Ghost,
    live: usize,
    /// The last victim handed out and its score, so `remove` can remember it.
    popped: Option<(EntryId, u32, bool)>,
    c: KvConfig,
}

impl Kv {
    pub fn new(c: KvConfig) -> Self {
        Self {
            lists: Lists::default(),
            scores: vec![],
            nodes: PerNode::default(),
            ghost: Ghost::new(c.ghost),
            live: 0,
            popped: None,
            c,
        }
    }

    fn node(&mut self, node: u32) -> &mut Node {
        let lists = &mut self.lists;
        self.nodes.get(node, || Node::new(lists))
    }

    /// Link a candidate into the bucket of its score (front: most recent).
    fn place(&mut self, node: u32, id: EntryId) {
        let s = self.scores[id as usize];
        let n = self.node(node);
        let list = n.slot(n.clamp(s));
        self.lists.push_front(list, id);
    }

    /// The node's time after one more insert; slides the window.
    fn tick(&mut self, node: u32) {
        let decay = self.c.decay;
        let lists = &mut self.lists;
        let n = self.nodes.get(node, || unreachable!("node exists"));
        n.acc += Q as f64;
        let step = (n.live as f64 * decay).max(MIN_STEP);
        while n.acc >= step {
            n.acc -= step;
            n.now = n.now.wrapping_add(1);
        }
        // Keep HEADROOM buckets above now inside the window: the lowest
        // bucket's entries go behind the next one's (they stay first out).
        while n.now.wrapping_add(HEADROOM).wrapping_sub(n.lo) as i32 >= B as i32 {
            let (from, to) = (n.slot(n.lo), n.slot(n.lo.wrapping_add(1)));
            lists.append_back(to, from);
            n.lo = n.lo.wrapping_add(1);
        }
    }

}

/// An entry's score after a read at `now`: log2(2^score + 2^now). Scores
/// more than the headroom above now can only have wrapped around (ancient).
fn read_score(now: u32, score: u32) -> u32 {
    let base = now.wrapping_sub(B);
    let rel = score.wrapping_sub(base);
    let rel = if rel > B + HEADROOM { 0 } else { rel };
    base.wrapping_add(lse(rel, B))
}

#[cfg(test)]
impl Kv {
    /// The window-relative bucket of a candidate's score (what victim
    /// order follows after the partial queue).
    pub fn rank(&mut self, node: u32, id: EntryId) -> u32 {
        let s = self.scores[id as usize];
        let n = self.node(node);
        n.clamp(s).wrapping_sub(n.lo)
    }
}

impl EvictionPolicy for Kv {
    fn name(&self) -> &'static str {
        "kv"
    }

    fn insert(&mut self, node: u32, id: EntryId, obj: Obj) {
        self.lists.grow(id);
        if self.scores.len() < self.lists.len() {
            self.scores.resize(self.lists.len(), 0);
        }
        if self.lists.mark(id) != Some(OUT) {
            self.remove(node, id, 0);
        }
        self.live += 1;
        let partial_first = self.c.partial_first;
        let penalty = self.c.fresh_penalty;
        let n = self.node(node);
        n.live += 1;
        let partial = partial_first && obj.size < n.largest;
        n.largest = n.largest.max(obj.size);
        let now = n.now;
        self.tick(node);
        let score = match self.ghost.take(obj.hash) {
            // Back after an eviction: its decayed history plus this use.
            Some(old) => read_score(now, old),
            None => now.wrapping_sub(penalty),
        };
        self.scores[id as usize] = score;
        if partial {
            let l = self.node(node).partials;
            self.lists.push_front(l, id);
        } else {
            self.place(node, id);
        }
    }

    fn touch(&mut self, node: u32, id: EntryId) {
        let linked = match self.lists.mark(id) {
            None => true,
            Some(HELD) => false,
            _ => return,
        };
        let now = self.node(node).now;
        let s = read_score(now, self.scores[id as usize]);
        self.scores[id as usize] = s;
        if linked {
            self.lists.unlink(id, OUT);
            self.place(node, id);
        }
    }

    fn hold(&mut self, _node: u32, id: EntryId) {
        match self.lists.mark(id) {
            None => self.lists.unlink(id, HELD),
            Some(POPPED) => self.lists.set_mark(id, HELD),
            _ => {}
        }
    }

    fn release(&mut self, node: u32, id: EntryId) {
        if self.lists.mark(id) == Some(HELD) {
            self.lists.set_mark(id, OUT);
            self.place(node, id);
        }
    }

    fn pop_victim(&mut self, node: u32) -> Option<EntryId> {
        let lists = &mut self.lists;
        let n = self.nodes.find(node)?;
        let (v, remember) = if let Some(v) = lists.back(n.partials) {
            (v, false)
        } else {
            // Lowest non-empty bucket; empty ones at the bottom are skipped
            // for good (the window's low end moves up). Every candidate is
            // inside the window, so B steps find one if there is one.
            let mut found = None;
            for _ in 0..B {
                if let Some(v) = lists.back(n.slot(n.lo)) {
                    found = Some(v);
                    break;
                }
                n.lo = n.lo.wrapping_add(1);
            }
            let v = found?;
            (v, true)
        };
        lists.unlink(v, POPPED);
        self.popped = Some((v, self.scores[v as usize], remember));
        Some(v)
    }

    fn remove(&mut self, node: u32, id: EntryId, hash: u64) {
        match self.lists.mark(id) {
            Some(OUT) => return,
            None => self.lists.unlink(id, OUT),
            Some(_) => self.lists.set_mark(id, OUT),
        }
        if let Some((v, score, remember)) = self.popped.take() {
            if v == id && remember {
                self.ghost.remember(hash, score, self.live);
            }
        }
        self.live -= 1;
        if let Some(n) = self.nodes.find(node) {
            n.live -= 1;
        }
    }

    fn prefetch(&self, id: EntryId) {
        self.lists.prefetch(id);
        if let Some(s) = self.scores.get(id as usize) {
            crate::pool::prefetch(s);
        }
    }

    fn prefetch_neighbours(&self, id: EntryId) {
        self.lists.prefetch_neighbours(id);
    }
}
