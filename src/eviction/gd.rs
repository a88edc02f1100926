//! `gd`: GreedyDual for KV-cache chunks, the default policy (chosen by
//! trace replay: see `PolicyKind::DEFAULT`). Each node keeps a clock `L`;
//! an entry's priority is `L + value` at its last placement (insert, read
//! or release), the victim is the candidate of lowest priority, and `L`
//! rises to the victim's priority. An entry of value `v` thus outlives one
//! of value 0 by `v` rises of the clock: value is linear in the cache's own
//! turnovers, where `kv`'s log-scale scores give a 2x reuse rate about one
//! turnover of life.
//!
//! Values: a chunk smaller than the largest the node has seen (a request's
//! partial last chunk, almost never read again) goes to a queue evicted
//! before anything else; a new chunk enters at the fresh value, one whose
//! key the ghost history remembers (evicted lately, now stored again) at
//! `ghost_value`, and a read sets `read`. A read is worth more than a
//! second store: a read chunk was found where it was kept, a stored-again
//! one is a conversation that came back after losing its chunks, and fewer
//! of those come back again soon. A chunk stored again whose evicted copy
//! had been read (or was itself stored again) is worth most,
//! `ghost_read_value`: its conversation has come back at least twice and
//! keeps coming back.
//!
//! The fresh value adapts, as ARC's split does: a key evicted new that comes
//! back within about one turnover of the cache says new chunks should stay
//! longer; one evicted after a read says reads should. Each return moves the
//! value (between 0 and `read`) by `adapt * read / live`, weighted by how
//! rare evictions of its kind are. On Mooncake's conversation trace new
//! chunks come back, if at all, many turnovers later, so at small capacities
//! the value sinks to 0 and the cache keeps what was read or stored twice;
//! on RAG-like traces popular documents return within a turnover and the
//! value rises. A fixed value cannot do both: one low enough for the
//! conversation trace loses to LRU on RAG, one high enough for RAG gives
//! back the conversation trace's gains. A large cache moves slowly (the
//! step shrinks with `live`), so it runs near the start value for long:
//! the start (half of `read`) is chosen for large caches. Read counts were
//! tried (GDSF): they pin finished agent sessions and open holes in
//! prefixes, so a read is a read.
//!
//! The tuner (`tuner.rs`, on by default): that rule follows the marginal
//! gain, and where conversations return after the cache's lifetime of new
//! chunks the gain is not concave in the value, so it settles low. Small
//! simulations of sampled keys, one with the adapted values and one per
//! fixed candidate, count the hits each would make; a fixed candidate whose
//! lead in hits is beyond chance replaces the adapted values while it is.
//!
//! Continuations: a store run right after a lookup that found at least
//! `continuation_hits` chunks (more than a system prompt every request
//! shares), or one that stored a chunk back from the ghost, extends a
//! conversation that came back. Its new chunks get a fresh value of their
//! own, adapted on their own returns (the ghost keeps which kind of new
//! chunk each eviction was). On Mooncake's conversation trace, and more on
//! generated chat traces, new chunks of a conversation that came back are
//! stored again sooner than a first turn's, so the two values part.
//!
//! Prefixes: LMCache loads a request's chunks only up to the first miss, so
//! a chunk should not outlive the one before it in its request. The policy
//! never sees chains, but a request's chunks are placed in prefix order in
//! one run of calls (a store batch's inserts, a lookup's releases). Within
//! such a run (same kind of call, nothing else in between on the node) a
//! chunk's value is capped by the previous chunk's, and a chunk placed at
//! the same priority as the previous one goes right behind it, so the run's
//! tail leaves first. Without the cap, ghost hits in the middle of a
//! prefix keep chunks whose predecessors are gone, which LMCache cannot
//! load.
//!
//! The measurements behind each of these rules and values (and the
//! variants tried and dropped) are in docs/benchmark-findings.md, "Eviction
//! quality": the `gd` section, and its table "The figures behind the
//! eviction code".
//!
//! Priorities are bucketed: each node keeps a ring of `B` LRU lists, list
//! `p % B` for priority `p`; every candidate's priority lies in
//! `[L, L + B)` (values are below `B` and `L` never passes a candidate),
//! so the victim is the back of the first non-empty list from `L` up:
//! O(1) amortised (lists passed empty are passed for good, as `L` only
//! rises). Insert, touch, hold, release and remove are O(1).
//!
//! Memory: 8 B of links, a 2 B priority and a 1 B class (fresh,
//! continuing, read, back from the ghost with or without a read before)
//! per entry id, plus the ghost table (<= `ghost` slots of 2 B per entry,
//! at most 16 MiB: `ghost::MAX_SLOTS`); per node `B + 1` sentinels (2 KiB)
//! and the chain; the tuner's bit per entry id and its simulations (under
//! 4 MiB whatever the size).
use super::ghost::{Ghost, WAYS};
use super::list::{List, Lists, Popped, OUT};
use super::tuner::{Simulated, Tuner};
use super::{check_ghost, refuse, EntryId, EvictionPolicy, Obj, PerNode, Policy};
use crate::error::Result;

#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct GdConfig {
    /// Value of a new chunk at the start, in clock steps (below `read`:
    /// most new chunks are never read); adapted when `adapt` > 0.
    pub fresh: u16,
    /// Value of a chunk stored again soon after it was evicted.
    pub ghost_value: u16,
    /// Value of a chunk stored again soon after it was evicted having been
    /// read (or stored again) before: a conversation that keeps returning.
    pub ghost_read_value: u16,
    /// Value of a chunk after a read.
    pub read: u16,
    /// Evict chunks smaller than the node's largest first (see `kv`).
    pub partial_first: bool,
    /// Ghost slots per live entry (0 = no ghost history). Conversations
    /// come back many turnovers later: 8 finds the second store of a
    /// chunk where 1 had forgotten it.
    pub ghost: f64,
    /// How fast the fresh value follows the keys that come back (0 = it
    /// stays at `fresh`): a return moves it by `adapt * read / live`.
    pub adapt: f64,
    /// Chunks a lookup must find for the store run after it to continue a
    /// conversation, whose new chunks then have a fresh value of their own
    /// (0 = one fresh value for every new chunk). 2: more than a shared
    /// system prompt.
    pub continuation_hits: u32,
    /// Let miniature simulations of sampled keys replace the adapted fresh
    /// values with fixed ones that make clearly more hits (`tuner`).
    pub tune: bool,
}

impl Default for GdConfig {
    /// Chosen by trace replay (`cxlkv-trace replay`): tuned on some traces
    /// and key salts, checked on others, `fresh` at half of `read`. Which
    /// traces, the values tried and what each gave: docs/benchmark-findings.md,
    /// "Eviction quality", `gd` section.
    fn default() -> Self {
        Self {
            fresh: 10,
            ghost_value: 14,
            ghost_read_value: 26,
            read: 20,
            partial_first: true,
            ghost: 8.0,
            adapt: 2.0,
            continuation_hits: 2,
            tune: true,
        }
    }
}

/// The fresh values, of new chunks (`[0]`) and of new chunks that continue
/// a conversation (`[1]`), and what they adapt on.
struct Fresh {
    value: [f64; 2],
    /// Evictions of chunks never read (per kind) and of the others, halved
    /// every two turnovers so the weights follow the workload.
    new: [f64; 2],
    other: f64,
}

impl Fresh {
    /// `kind`: which fresh value the evicted chunk had, if it was never read.
    fn evicted(&mut self, kind: Option<usize>, live: usize) {
        *match kind {
            Some(k) => &mut self.new[k],
            None => &mut self.other,
        } += 1.0;
        if self.new[0] + self.new[1] + self.other > 2.0 * live as f64 + 64.0 {
            self.new.iter_mut().for_each(|n| *n /= 2.0);
            self.other /= 2.0;
        }
    }

    /// A key evicted within about one turnover is stored again, of `kind`
    /// as in `evicted`. Weighted as ARC weighs its ghost lists: a return of
    /// the rarer kind of eviction counts for more. A return of a read
    /// chunk lowers both values.
    fn returned(&mut self, kind: Option<usize>, step: f64, max: f64) {
        match kind {
            Some(k) => self.value[k] += step * (self.other / self.new[k]).max(1.0),
            None => (0..2).for_each(|k| self.value[k] -= step * (self.new[k] / self.other).max(1.0)),
        }
        self.value.iter_mut().for_each(|v| *v = v.clamp(0.0, max));
    }
}

/// Lists in a node's ring: every value must stay below this.
pub const B: u16 = 256;
const FRESH: u8 = 0;
const READ: u8 = 1;
const GHOST: u8 = 2;
/// A new chunk of a store run that continues a conversation.
const CONT: u8 = 3;
/// Back from the ghost, evicted after a read or an earlier return.
const GHOST_READ: u8 = 4;
/// A return is recent (its eviction about a turnover ago at most) while
/// fewer evictions came to its ghost bucket after it: with the default 8
/// ghost slots per entry a bucket gets `WAYS / 8` evictions a turnover.
const RECENT: usize = WAYS / 8;

/// The fresh value (`Fresh::value`) of a class, if it has one.
fn fresh_kind(class: u8) -> Option<usize> {
    match class {
        FRESH => Some(0),
        CONT => Some(1),
        _ => None,
    }
}

struct Node {
    ring: Vec<List>,
    partials: List,
    /// The clock: no candidate's priority is below it.
    l: u16,
    largest: u64,
    /// The entry placed last, if it is still where it was placed.
    last: Option<EntryId>,
    /// Kind (insert or release) and value of the previous placement while
    /// placements of that kind come in a row.
    run: Option<(bool, u16)>,
    /// What a store run would continue: the entry inserted or released
    /// last, while it is a candidate and no read came in between, with
    /// the releases in a row up to it (0: it was inserted) and, if it was
    /// inserted, whether its run continues a conversation (`CONT`).
    chain: Option<(EntryId, u32, bool)>,
}

impl Node {
    fn new(lists: &mut Lists) -> Self {
        Self {
            ring: (0..B).map(|_| lists.new_list()).collect(),
            partials: lists.new_list(),
            l: 0,
            largest: 0,
            last: None,
            run: None,
            chain: None,
        }
    }
    fn slot(&self, p: u16) -> List {
        self.ring[(p % B) as usize]
    }
}

pub struct Gd {
    lists: Lists,
    prio: Vec<u16>,
    /// FRESH, READ, GHOST, CONT or GHOST_READ per entry id.
    class: Vec<u8>,
    nodes: PerNode<Node>,
    ghost: Ghost,
    live: usize,
    /// The last victim handed out and whether to remember it.
    popped: Popped,
    fresh: Fresh,
    tuner: Option<Box<Tuner<Gd>>>,
    /// A tuner's simulation: it evicts before each store, so an eviction
    /// does not end a run; the tuner ends runs (`break_run`).
    simulation: bool,
    c: GdConfig,
}

impl Gd {
    fn node(&mut self, node: u32) -> &mut Node {
        let lists = &mut self.lists;
        self.nodes.get(node, || Node::new(lists))
    }

    fn value(&self, id: EntryId) -> u16 {
        let class = self.class[id.index()];
        let v = match fresh_kind(class) {
            Some(k) => match self.tuner.as_ref().and_then(|t| t.choice()) {
                Some(values) => values[k],
                None => self.fresh.value[k].round() as u16,
            },
            None if class == GHOST => self.c.ghost_value,
            None if class == GHOST_READ => self.c.ghost_read_value,
            None => self.c.read,
        };
        v.min(B - 1)
    }

    /// Whether a chunk stored now continues a conversation: right after a
    /// lookup's releases of at least `continuation_hits` chunks, or after a
    /// chunk of a store run that did.
    fn continues(&mut self, node: u32) -> bool {
        let hits = self.c.continuation_hits;
        hits > 0
            && match self.node(node).chain {
                Some((_, 0, cont)) => cont,
                Some((_, released, _)) => released >= hits,
                None => false,
            }
    }

    /// Whether a placement of this kind continues the node's run.
    fn in_run(&mut self, node: u32, insert: bool) -> bool {
        matches!(self.node(node).run, Some((k, _)) if k == insert)
    }

    /// Link a candidate at `L + value` (front: most recent).
    fn place(&mut self, node: u32, id: EntryId, kind: Option<bool>) {
        let mut v = self.value(id);
        let n = self.node(node);
        match (kind, n.run) {
            (Some(k), Some((rk, r))) if rk == k => v = v.min(r),
            _ => {}
        }
        n.run = kind.map(|k| (k, v));
        n.chain = match (kind, n.chain) {
            (Some(false), Some((_, r, _))) if r > 0 => Some((id, r + 1, false)),
            (Some(false), _) => Some((id, 1, false)),
            // An insert sets its own link (`insert`); a read breaks the chain.
            _ => None,
        };
        let p = n.l.wrapping_add(v);
        let list = n.slot(p);
        let last = n.last.replace(id);
        match last {
            Some(a) if self.lists.linked(a) && self.prio[a.index()] == p => self.lists.push_behind(a, id),
            _ => self.lists.push_front(list, id),
        }
        self.prio[id.index()] = p;
    }
}

#[cfg(test)]
impl Gd {
    /// A candidate's priority above the node's clock.
    pub fn rank(&mut self, node: u32, id: EntryId) -> u16 {
        let p = self.prio[id.index()];
        p.wrapping_sub(self.node(node).l)
    }
}

impl Simulated for Gd {
    type Config = GdConfig;

    /// A tuner's simulation: fresh values set from outside (`set_fresh`),
    /// no tuner of its own.
    fn simulation(c: &Self::Config, values: [f64; 2]) -> Self {
        let mut gd = Self::new(GdConfig { adapt: 0.0, continuation_hits: 0, tune: false, ..c.clone() });
        gd.set_fresh(values);
        gd.simulation = true;
        gd
    }

    fn set_fresh(&mut self, values: [f64; 2]) {
        self.fresh.value = values;
    }

    /// A simulation's next call starts a run of its own.
    fn break_run(&mut self, node: u32) {
        let n = self.node(node);
        (n.run, n.last) = (None, None);
    }

    /// `insert`, with whether the chunk continues a conversation decided
    /// by the caller (a simulation is told).
    fn insert_as(&mut self, node: u32, id: EntryId, obj: Obj, cont: bool) {
        if self.lists.admit(id, (&mut self.prio, &mut self.class)) {
            self.remove(node, id, 0);
        }
        self.live += 1;
        let partial_first = self.c.partial_first;
        let n = self.node(node);
        let partial = partial_first && obj.size < n.largest;
        n.largest = n.largest.max(obj.size);
        let back = self.ghost.take_at(obj.hash);
        if let Some((tag, _)) = back.filter(|&(_, pos)| pos < RECENT) {
            // Evicted within about one turnover.
            let step = self.c.adapt * f64::from(self.c.read) / self.live as f64;
            let kind = tag.checked_sub(1).map(usize::from);
            self.fresh.returned(kind, step, f64::from(self.c.read));
        }
        let class = match (back, cont) {
            // Tag 0: evicted after a read or a return (`remove`).
            (Some((0, _)), _) => GHOST_READ,
            (Some(_), _) => GHOST,
            (None, true) => CONT,
            (None, false) => FRESH,
        };
        self.class[id.index()] = class;
        let in_run = self.tuner.is_some() && !partial && self.in_run(node, true);
        if let Some(t) = &mut self.tuner {
            t.stored(id, obj, cont, self.live, self.fresh.value, in_run);
        }
        if partial {
            self.node(node).run = None;
            let l = self.node(node).partials;
            self.lists.push_front(l, id);
        } else {
            self.place(node, id, Some(true));
            self.node(node).chain = Some((id, 0, cont || back.is_some()));
        }
    }

    fn start_fresh(c: &GdConfig) -> f64 {
        f64::from(c.fresh)
    }
}

impl Policy for Gd {
    const NAME: &'static str = "gd";
    type Config = GdConfig;

    fn new(c: GdConfig) -> Self {
        Self {
            lists: Lists::default(),
            prio: vec![],
            class: vec![],
            nodes: PerNode::default(),
            ghost: Ghost::new(c.ghost),
            live: 0,
            popped: Popped::default(),
            fresh: Fresh { value: [f64::from(c.fresh); 2], new: [1.0; 2], other: 1.0 },
            tuner: c.tune.then(|| Box::new(Tuner::new(&c))),
            simulation: false,
            c,
        }
    }

    fn validate(c: &GdConfig) -> Result<()> {
        if c.read.max(c.ghost_value).max(c.ghost_read_value) >= B {
            return Err(refuse(
                Self::NAME,
                "read, gd.ghost_value and gd.ghost_read_value",
                format!("must be below {B}"),
            ));
        }
        if c.fresh > c.read {
            return Err(refuse(Self::NAME, "fresh", "must be at most gd.read"));
        }
        if !(c.adapt.is_finite() && c.adapt >= 0.0) {
            return Err(refuse(Self::NAME, "adapt", "must be a number of at least 0"));
        }
        check_ghost(Self::NAME, c.ghost)
    }

    /// Without the tuner: its own simulations inside each one would cost
    /// 13 times as much and change nothing the comparison needs.
    fn simulation(c: &GdConfig) -> GdConfig {
        GdConfig { tune: false, ..c.clone() }
    }
}

impl EvictionPolicy for Gd {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn insert(&mut self, node: u32, id: EntryId, obj: Obj) {
        let cont = self.continues(node);
        self.insert_as(node, id, obj, cont);
    }

    fn touch(&mut self, node: u32, id: EntryId) {
        let Some(linked) = self.lists.touchable(id) else { return };
        self.class[id.index()] = READ;
        if let Some(t) = &mut self.tuner {
            t.touched(id, !linked, self.live, self.fresh.value);
        }
        if linked {
            self.lists.unlink(id, OUT);
            self.place(node, id, None);
        }
    }

    fn hold(&mut self, _node: u32, id: EntryId) {
        self.lists.hold(id);
    }

    fn release(&mut self, node: u32, id: EntryId) {
        if self.lists.release(id) {
            let in_run = self.tuner.is_some() && self.in_run(node, false);
            if let Some(t) = &mut self.tuner {
                t.released(id, self.live, self.fresh.value, in_run);
            }
            self.place(node, id, Some(false));
        }
    }

    fn pop_victim(&mut self, node: u32) -> Option<EntryId> {
        let lists = &mut self.lists;
        let n = self.nodes.find(node)?;
        // A simulation evicts before each store: the run goes on.
        if !self.simulation {
            n.run = None;
        }
        lists.pop_bucketed(n.partials, &n.ring, &mut n.l, |l| l.wrapping_add(1), &mut self.popped)
    }

    fn remove(&mut self, node: u32, id: EntryId, hash: u64) {
        let Some(remember) = self.popped.take_out(&mut self.lists, id) else { return };
        if remember {
            // Ghost tag: 0 after a read (or a return), else 1 + the fresh kind.
            let kind = fresh_kind(self.class[id.index()]);
            self.fresh.evicted(kind, self.live);
            self.ghost.remember(hash, kind.map_or(0, |k| k as u8 + 1), self.live);
        }
        self.live -= 1;
        if let Some(t) = &mut self.tuner {
            t.removed(id);
        }
        if let Some(n) = self.nodes.find(node) {
            if n.last == Some(id) {
                n.last = None;
            }
            if n.chain.is_some_and(|c| c.0 == id) {
                n.chain = None;
            }
        }
    }

    fn prefetch(&self, id: EntryId) {
        self.lists.prefetch(id);
        // A read sets the class and a placement writes the priority: two
        // more lines per entry than LRU's links.
        if let (Some(c), Some(p)) = (self.class.get(id.index()), self.prio.get(id.index())) {
            crate::platform::prefetch(c);
            crate::platform::prefetch(p);
        }
    }

    fn prefetch_neighbours(&self, id: EntryId) {
        self.lists.prefetch_neighbours(id);
    }
}
