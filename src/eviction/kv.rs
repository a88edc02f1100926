//! `kv`: a policy for KV-cache chunks, built on what prefix-block traces
//! show (docs/BENCHMARKS.md, "Eviction quality"):
//!
//! - a request's last, partial chunk is almost never read again: a chunk
//!   smaller than the largest one the node has seen goes to a queue that is
//!   evicted before anything else;
//! - most stored chunks are never read again: a chunk with no history
//!   enters below the chunks just read (a penalty), and a ghost history of
//!   evicted keys (by hash) adapts that penalty the way ARC adapts its
//!   split: a key that comes back after being evicted unread lowers it, one
//!   that comes back after being evicted despite reads raises it;
//! - reuse decays: an entry's value is an exponentially decayed count of
//!   its reads, `sum 2^((t_i - now) / decay)`, capped at one doubling above
//!   a read now (uncapped counts let a finished burst of reads, an agent
//!   session's steps, pin dead chunks); a key back from the ghost ranks as
//!   read twice.
//!
//! Scores are log2 of the decayed count scaled to the current time
//! (`log2 sum 2^(t_i / decay)`), which does not change between reads, so
//! entries never need re-scoring as time passes. They are quantised to
//! buckets of a quarter doubling, and each node keeps a window of 128
//! buckets, each an LRU list: a read moves an entry to its new bucket, a
//! victim is the least recent entry of the lowest non-empty bucket. The
//! window slides with time by merging its lowest bucket into the next (an
//! O(1) splice), so every operation is O(1) (a victim search skips at most
//! the window's empty buckets, amortised O(1)). Time is the node's insert
//! count and `decay` a fraction of the node's entries, so the policy scales
//! with the cache it orders.
//!
//! Memory: 8 B of links and a 2 B score per entry id, plus the ghost table
//! (<= 1 slot of 2 B per entry); per node 129 sentinels (1 KiB).
use super::ghost::Ghost;
use super::list::{List, Lists, Popped, OUT};
use super::{check_ghost, refuse, EntryId, EvictionPolicy, Obj, PerNode, Policy};
use crate::error::Result;

#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvConfig {
    /// Inserts (as a fraction of the node's entries) over which a read's
    /// weight halves. Small: close to LRU; large: close to LFU.
    pub decay: f64,
    /// Most a chunk with no history may enter below a read "now", in
    /// quarter doublings; the penalty in force adapts between 0 and this.
    pub fresh_penalty: u32,
    /// Penalty change per ghost hit, in quarter doublings.
    pub adapt_step: f64,
    /// Most a read history may lift an entry above one read now, in
    /// quarter doublings (4: "read at least twice lately" is the top rank).
    /// Without a cap, a burst of reads (an agent session's steps) keeps a
    /// dead entry above fresh ones for several half-lives.
    pub max_bonus: u16,
    /// Evict chunks smaller than the node's largest first. A node whose
    /// clients store chunks of different full sizes (several models) sees
    /// the smaller models' chunks as partial: turn this off there.
    pub partial_first: bool,
    /// Ghost slots per live entry (0 = no ghost history).
    pub ghost: f64,
}

impl Default for KvConfig {
    fn default() -> Self {
        Self { decay: 0.5, fresh_penalty: 8, adapt_step: 0.25, max_bonus: 4, partial_first: true, ghost: 1.0 }
    }
}

/// Buckets per doubling of the decayed count.
const Q: u16 = 4;
/// Buckets in a node's window.
const B: u16 = 128;
/// Room kept above "now" for read bonuses (scores above it share the top bucket).
const HEADROOM: u16 = B / 2;
/// Fewest inserts per time step, so a tiny node still ages slowly enough.
const MIN_STEP: f64 = 16.0;
/// Scores are 15-bit and wrap; the top bit of an entry's word says "fresh"
/// (never read since it was stored).
const MASK: u16 = 0x7FFF;
const FRESH: u16 = 0x8000;

/// `LSE[d]` = round(Q * log2(1 + 2^(-d/Q))): what adding a weight `d`
/// buckets below the larger one adds to it.
const LSE: [u16; 21] = [4, 4, 3, 3, 3, 3, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1];

/// Distance from `a` up to `b` on the 15-bit circle, negative when `b` is below.
fn diff(a: u16, b: u16) -> i16 {
    let d = b.wrapping_sub(a) & MASK;
    if d >= 0x4000 {
        (d as i32 - 0x8000) as i16
    } else {
        d as i16
    }
}

/// An entry's score after a read at `now`: log2(2^score + 2^now), with
/// scores far below now (or wrapped around) counting as nothing, and at
/// most `max_bonus` above now.
fn read_score(now: u16, score: u16, max_bonus: u16) -> u16 {
    let d = diff(score, now);
    let (hi, gap) = if d >= 0 { (now, d as usize) } else { (score, (-d) as usize) };
    let s = hi.wrapping_add(LSE.get(gap).copied().unwrap_or(0)) & MASK;
    if diff(now, s) > max_bonus as i16 {
        now.wrapping_add(max_bonus) & MASK
    } else {
        s
    }
}

struct Node {
    /// Ring of bucket lists: absolute bucket `b` lives at `b % B`.
    buckets: [List; B as usize],
    partials: List,
    /// Lowest bucket of the window.
    lo: u16,
    /// "Now", in buckets (advances Q per `decay` of the node's inserts).
    now: u16,
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

    fn slot(&self, b: u16) -> List {
        self.buckets[(b % B) as usize]
    }

    /// The window bucket of a score: scores below the window count as its
    /// lowest bucket, above it as its highest.
    fn bucket(&self, score: u16) -> u16 {
        (self.lo + diff(self.lo, score).clamp(0, B as i16 - 1) as u16) & MASK
    }
}

pub struct Kv {
    lists: Lists,
    /// Score (15 bits) and the FRESH bit per entry id.
    scores: Vec<u16>,
    nodes: PerNode<Node>,
    ghost: Ghost,
    live: usize,
    /// Penalty in force for chunks with no history (adapted by ghost hits).
    penalty: f64,
    /// The last victim handed out and whether to remember it.
    popped: Popped,
    c: KvConfig,
}

impl Kv {
    fn node(&mut self, node: u32) -> &mut Node {
        let lists = &mut self.lists;
        self.nodes.get(node, || Node::new(lists))
    }

    /// Link a candidate into the bucket of its score (front: most recent).
    fn place(&mut self, node: u32, id: EntryId) {
        let s = self.scores[id.index()] & MASK;
        let n = self.node(node);
        let list = n.slot(n.bucket(s));
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
            n.now = n.now.wrapping_add(1) & MASK;
        }
        // Keep HEADROOM buckets above now inside the window: the lowest
        // bucket's entries go behind the next one's (they stay first out).
        while diff(n.lo, n.now) + HEADROOM as i16 >= B as i16 {
            let (from, to) = (n.slot(n.lo), n.slot(n.lo.wrapping_add(1) & MASK));
            lists.append_back(to, from);
            n.lo = n.lo.wrapping_add(1) & MASK;
        }
    }
}

#[cfg(test)]
impl Kv {
    /// The window-relative bucket of a candidate (what victim order
    /// follows after the partial queue).
    pub fn rank(&mut self, node: u32, id: EntryId) -> u16 {
        let s = self.scores[id.index()] & MASK;
        let n = self.node(node);
        diff(n.lo, n.bucket(s)) as u16
    }
}

impl Policy for Kv {
    const NAME: &'static str = "kv";
    type Config = KvConfig;

    fn new(c: KvConfig) -> Self {
        Self {
            lists: Lists::default(),
            scores: vec![],
            nodes: PerNode::default(),
            ghost: Ghost::new(c.ghost),
            live: 0,
            penalty: c.fresh_penalty as f64 / 2.0,
            popped: Popped::default(),
            c,
        }
    }

    fn validate(c: &KvConfig) -> Result<()> {
        let bad = |what: &str, why: String| Err(refuse(Self::NAME, what, why));
        if !(c.decay.is_finite() && c.decay > 0.0) {
            return bad("decay", "must be a number above 0".into());
        }
        if !(c.adapt_step.is_finite() && c.adapt_step >= 0.0) {
            return bad("adapt_step", "must be a number of at least 0".into());
        }
        // A score has HEADROOM quarter doublings above "now": a penalty or
        // bonus of more would wrap.
        if c.fresh_penalty > u32::from(HEADROOM) || c.max_bonus > HEADROOM {
            return bad("fresh_penalty and kv.max_bonus", format!("must be at most {HEADROOM}"));
        }
        check_ghost(Self::NAME, c.ghost)
    }
}

impl EvictionPolicy for Kv {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn insert(&mut self, node: u32, id: EntryId, obj: Obj) {
        if self.lists.admit(id, &mut self.scores) {
            self.remove(node, id, 0);
        }
        self.live += 1;
        let partial_first = self.c.partial_first;
        let n = self.node(node);
        n.live += 1;
        let partial = partial_first && obj.size < n.largest;
        n.largest = n.largest.max(obj.size);
        let now = n.now;
        self.tick(node);
        let score = match self.ghost.take(obj.hash) {
            // Back soon after an eviction: it is being reused, so it ranks
            // as read now and before. If it had been evicted without a
            // read, fresh chunks were ranked too low: lower the penalty;
            // if it had been read, fresh chunks displaced it: raise it.
            Some(tag) => {
                let was_fresh = tag == 1;
                let (step, max) = (self.c.adapt_step, self.c.fresh_penalty as f64);
                self.penalty = if was_fresh { (self.penalty - step).max(0.0) } else { (self.penalty + step).min(max) };
                read_score(now, now, self.c.max_bonus)
            }
            None => FRESH | (now.wrapping_sub(self.penalty.round() as u16) & MASK),
        };
        self.scores[id.index()] = score;
        if partial {
            let l = self.node(node).partials;
            self.lists.push_front(l, id);
        } else {
            self.place(node, id);
        }
    }

    fn touch(&mut self, node: u32, id: EntryId) {
        let Some(linked) = self.lists.touchable(id) else { return };
        let now = self.node(node).now;
        self.scores[id.index()] = read_score(now, self.scores[id.index()] & MASK, self.c.max_bonus);
        if linked {
            self.lists.unlink(id, OUT);
            self.place(node, id);
        }
    }

    fn hold(&mut self, _node: u32, id: EntryId) {
        self.lists.hold(id);
    }

    fn release(&mut self, node: u32, id: EntryId) {
        if self.lists.release(id) {
            self.place(node, id);
        }
    }

    fn pop_victim(&mut self, node: u32) -> Option<EntryId> {
        let lists = &mut self.lists;
        let n = self.nodes.find(node)?;
        // Else the lowest non-empty bucket; empty ones at the bottom are
        // skipped for good (the window's low end moves up). Every candidate
        // is inside the window, so B steps find one if there is one.
        lists.pop_bucketed(n.partials, &n.buckets, &mut n.lo, |lo| lo.wrapping_add(1) & MASK, &mut self.popped)
    }

    fn remove(&mut self, node: u32, id: EntryId, hash: u64) {
        let Some(remember) = self.popped.take_out(&mut self.lists, id) else { return };
        if remember {
            let fresh = self.scores[id.index()] & FRESH != 0;
            self.ghost.remember(hash, fresh as u8, self.live);
        }
        self.live -= 1;
        if let Some(n) = self.nodes.find(node) {
            n.live -= 1;
        }
    }

    fn prefetch(&self, id: EntryId) {
        self.lists.prefetch(id);
        if let Some(s) = self.scores.get(id.index()) {
            crate::platform::prefetch(s);
        }
    }

    fn prefetch_neighbours(&self, id: EntryId) {
        self.lists.prefetch_neighbours(id);
    }
}
