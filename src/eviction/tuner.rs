//! `gd`'s tuner: miniature simulations (Waldspurger et al., "Cache Modeling
//! and Optimization using Miniature Simulations", USENIX ATC '17) that
//! choose the fresh values of new chunks by the hits they would have made.
//!
//! Why: the hit ratio is not concave in the fresh value. Conversations come
//! back hundreds of requests later, so keeping new chunks a little longer
//! gains nothing until they live long enough to see the return, and a
//! rule that follows the marginal gain (ARC's, `gd`'s own) settles where
//! that gain is small, below the values that keep new chunks long enough
//! to see their conversation return (on Mooncake's conversation trace at
//! mid capacities: docs/benchmark-findings.md, "Eviction quality", "The
//! tuner"). Simulating candidates finds the better value whatever the
//! shape of the curve.
//!
//! How: a key is sampled when the low `shift` bits of its mixed hash are 0
//! (spatial sampling: every access of a sampled key is seen, so reuse is
//! measured whole). Each simulation is a `gd` of one node with a capacity
//! of the real entries scaled by the sampling rate; it sees the sampled
//! keys' stores and reads in the real order (a store of a key it holds, or
//! a read of one it lacks, is where it would have differed: a hit, or a
//! miss and a store). One simulation follows `gd`'s own adapted values,
//! the others fixed values (`CANDIDATES`). A fixed candidate replaces the
//! own rule while it makes clearly more hits on the same accesses: of the
//! accesses where exactly one of the two hit, the candidate's must exceed
//! the own rule's by `Z` standard deviations of a fair coin (McNemar's test
//! for paired outcomes), and among such candidates the one with the most
//! hits is taken. Counts halve every `WINDOW` simulated turnovers, so the
//! choice follows the workload. A fixed margin (2 % more hits) was too
//! strict where the sims are exact and hits many (small caches) and too
//! loose where they are few.
//!
//! What a simulation cannot see: which chunks a lookup would have reached
//! (a simulated hit after a real miss in the same prefix counts). It keeps
//! the real runs of calls (a chunk capped by the previous one of its run),
//! as far as sampled chunks show them. Several nodes share one simulation
//! of their summed capacity.
//!
//! Cost: the rate halves while a simulation would hold more than
//! `MAX_SAMPLED` entries, so memory is bounded (13 simulations of at most
//! `MAX_SAMPLED` entries and their ghosts, ~60 B an entry: under 4 MiB;
//! plus a bit per real entry id) and the share of calls that reach them
//! falls as the cache grows: all of them up to 4096 entries, one in 4096 at
//! 10 M. Each such call costs one `gd` call per simulation.
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

use super::{EntryId, EvictionPolicy, Obj};

/// What the tuner simulates: a policy (`gd`) that starts with fixed fresh
/// values or follows the ones it is given, and knows where a request's run
/// of keys ends and which new entries continue a conversation.
pub trait Simulated: EvictionPolicy + Sized {
    type Config;
    /// A simulation with these fresh values (first turn, continuation).
    fn simulation(c: &Self::Config, values: [f64; 2]) -> Self;
    /// The fresh value the configuration starts with.
    fn start_fresh(c: &Self::Config) -> f64;
    fn set_fresh(&mut self, values: [f64; 2]);
    fn break_run(&mut self, node: u32);
    fn insert_as(&mut self, node: u32, id: EntryId, obj: Obj, cont: bool);
}

/// Fixed fresh values tried: (first turn, continuation). From "new chunks
/// are never worth keeping" to "keep them half as long as a read" (with
/// the default `read` of 20; longer helped nowhere the tuner was tried).
pub const CANDIDATES: [[u16; 2]; 12] =
    [[0, 0], [0, 1], [0, 2], [1, 2], [2, 1], [2, 3], [3, 2], [4, 3], [5, 4], [6, 6], [8, 8], [10, 10]];
/// Most entries one simulation holds.
pub const MAX_SAMPLED: usize = 4096;
/// How many standard deviations of a fair coin a candidate's lead over
/// `gd`'s own rule, on the accesses where only one of them hit, must
/// reach: lower lets noise through at large capacities, higher gives back
/// part of the gain at small ones (the values tried:
/// docs/benchmark-findings.md, "Eviction quality", `tuner::Z`).
const Z: f64 = 1.75;
/// Hits and the leads over the own rule are halved every `WINDOW`
/// simulated turnovers.
const WINDOW: usize = 8;

/// Hashes the registry's key hashes to themselves: they are uniform
/// already, and each sampled call looks one up in every simulation (the
/// tuner's and admission's, `registry/shadows.rs`).
#[derive(Default)]
pub(crate) struct KeyHash(u64);

impl Hasher for KeyHash {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used; fold anything else in.
        bytes.iter().for_each(|&b| self.0 = self.0.rotate_left(8) ^ u64::from(b));
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

pub(crate) type ByKeyHash = HashMap<u64, EntryId, BuildHasherDefault<KeyHash>>;

/// One candidate's cache of sampled keys.
struct Sim<S> {
    /// Fixed fresh values, or `None`: those `gd`'s own rule sets now.
    values: Option<[u16; 2]>,
    gd: S,
    ids: ByKeyHash,
    /// The key hash of each simulated entry id.
    hashes: Vec<u64>,
    free: Vec<EntryId>,
    hits: f64,
    /// Whether the last access hit.
    hit: bool,
    /// Against `sims[0]`: accesses where only one of the two hit, and how
    /// many more of those this one hit.
    split: f64,
    lead: f64,
}

impl<S: Simulated> Sim<S> {
    fn new(c: &S::Config, values: Option<[u16; 2]>) -> Self {
        let start = values.map_or([S::start_fresh(c); 2], |v| v.map(f64::from));
        let gd = S::simulation(c, start);
        Self {
            values,
            gd,
            ids: ByKeyHash::default(),
            hashes: vec![],
            free: vec![],
            hits: 0.0,
            hit: false,
            split: 0.0,
            lead: 0.0,
        }
    }

    /// A sampled key was stored (a miss in the real cache) or read (a hit
    /// there); `in_run`: the real call continued a run of calls.
    fn access(&mut self, hash: u64, size: u64, cont: bool, cap: usize, in_run: bool) {
        if !in_run {
            self.gd.break_run(0);
        }
        if let Some(&id) = self.ids.get(&hash) {
            // A hit: found by a lookup, released in its run.
            self.hits += 1.0;
            self.hit = true;
            self.gd.hold(0, id);
            self.gd.touch(0, id);
            self.gd.release(0, id);
            return;
        }
        self.hit = false;
        self.shrink(cap.max(1) - 1);
        let id = self.free.pop().unwrap_or_else(|| {
            self.hashes.push(0);
            EntryId(self.hashes.len() as u32 - 1)
        });
        self.hashes[id.index()] = hash;
        self.ids.insert(hash, id);
        self.gd.insert_as(0, id, Obj { size, hash }, cont);
    }

    fn shrink(&mut self, cap: usize) {
        while self.ids.len() > cap {
            let Some(v) = self.gd.pop_victim(0) else { return };
            self.drop_entry(v);
        }
    }

    /// Out of the simulation: evicted (just popped, so its ghost keeps
    /// it) or no longer sampled.
    fn drop_entry(&mut self, id: EntryId) {
        let hash = self.hashes[id.index()];
        self.gd.remove(0, id, hash);
        self.ids.remove(&hash);
        self.free.push(id);
    }
}

pub struct Tuner<S> {
    /// `sims[0]` follows `gd`'s own values.
    sims: Vec<Sim<S>>,
    shift: u32,
    /// Key hash and size of each sampled entry of the real cache.
    sampled: HashMap<EntryId, (u64, u64)>,
    /// One bit per entry id: whether it is in `sampled`, so the calls for
    /// the others skip the map (0.125 B per entry id).
    marks: Vec<u64>,
    /// Sampled entries read while held: simulated at their release, in the
    /// order of the lookup's run.
    pending: HashSet<EntryId>,
    accesses: usize,
    best: usize,
}

/// Whether a lead of `lead` hits over `split` accesses where only one of
/// two caches hit is more than chance: a fair coin's lead has a standard
/// deviation of `sqrt(split)`.
fn clearly_ahead(lead: f64, split: f64) -> bool {
    lead > Z * split.sqrt()
}

/// Whether `hash` is sampled at a rate of one in `1 << shift`. The bits
/// are spread first, so sampling does not follow the bits the ghost's
/// buckets use.
fn sampled_at(shift: u32, hash: u64) -> bool {
    hash.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(29) & ((1 << shift) - 1) == 0
}

impl<S: Simulated> Tuner<S> {
    pub fn new(c: &S::Config) -> Self {
        let mut sims = vec![Sim::new(c, None)];
        sims.extend(CANDIDATES.iter().map(|&v| Sim::new(c, Some(v))));
        Self { sims, shift: 0, sampled: HashMap::new(), marks: vec![], pending: HashSet::new(), accesses: 0, best: 0 }
    }

    /// The fixed fresh values that make the most hits of those clearly
    /// ahead of `gd`'s own rule, or `None` while none is.
    pub fn choice(&self) -> Option<[u16; 2]> {
        self.sims[self.best].values
    }

    fn is_sampled(&self, hash: u64) -> bool {
        sampled_at(self.shift, hash)
    }

    fn marked(&self, id: EntryId) -> bool {
        self.marks.get(id.index() / 64).is_some_and(|w| w >> (id.index() % 64) & 1 == 1)
    }

    fn mark(&mut self, id: EntryId, on: bool) {
        let (i, bit) = (id.index() / 64, 1u64 << (id.index() % 64));
        if i >= self.marks.len() {
            self.marks.resize(i + 1, 0);
        }
        if on {
            self.marks[i] |= bit;
        } else {
            self.marks[i] &= !bit;
        }
    }

    fn cap(&self, live: usize) -> usize {
        live >> self.shift
    }

    /// The real cache stored a new entry (`live` entries now). `own`: the
    /// values `gd`'s own rule sets now; `in_run`: the store continues a
    /// run of stores.
    pub fn stored(&mut self, id: EntryId, obj: Obj, cont: bool, live: usize, own: [f64; 2], in_run: bool) {
        self.resample(live);
        if !self.is_sampled(obj.hash) {
            return;
        }
        self.sampled.insert(id, (obj.hash, obj.size));
        self.mark(id, true);
        self.access(obj.hash, obj.size, cont, live, own, in_run);
    }

    /// The real cache had `id` and it was read; `held`: by a lookup that
    /// releases it later.
    pub fn touched(&mut self, id: EntryId, held: bool, live: usize, own: [f64; 2]) {
        if !self.marked(id) {
            return;
        }
        if held {
            self.pending.insert(id);
        } else {
            self.read(id, live, own, false);
        }
    }

    /// A held entry was released.
    pub fn released(&mut self, id: EntryId, live: usize, own: [f64; 2], in_run: bool) {
        if self.marked(id) && self.pending.remove(&id) {
            self.read(id, live, own, in_run);
        }
    }

    fn read(&mut self, id: EntryId, live: usize, own: [f64; 2], in_run: bool) {
        if let Some(&(hash, size)) = self.sampled.get(&id) {
            // A simulation that lacks it would store it again after the
            // miss, as part of a conversation that came back.
            self.access(hash, size, true, live, own, in_run);
        }
    }

    /// The real cache dropped `id` (evicted or deleted).
    pub fn removed(&mut self, id: EntryId) {
        if self.marked(id) {
            self.mark(id, false);
            self.sampled.remove(&id);
            self.pending.remove(&id);
        }
    }

    fn access(&mut self, hash: u64, size: u64, cont: bool, live: usize, own: [f64; 2], in_run: bool) {
        let cap = self.cap(live);
        self.sims[0].gd.set_fresh(own);
        for s in &mut self.sims {
            s.access(hash, size, cont, cap, in_run);
        }
        let own_hit = self.sims[0].hit;
        for s in self.sims[1..].iter_mut().filter(|s| s.hit != own_hit) {
            s.split += 1.0;
            s.lead += if s.hit { 1.0 } else { -1.0 };
        }
        self.accesses += 1;
        if self.accesses >= WINDOW * cap.max(64) {
            self.accesses = 0;
            for s in &mut self.sims {
                (s.hits, s.split, s.lead) = (s.hits / 2.0, s.split / 2.0, s.lead / 2.0);
            }
        }
        self.best = (1..self.sims.len())
            .filter(|&i| clearly_ahead(self.sims[i].lead, self.sims[i].split))
            .max_by(|&a, &b| self.sims[a].hits.total_cmp(&self.sims[b].hits))
            .unwrap_or(0);
    }

    /// Halve the rate while a simulation would outgrow `MAX_SAMPLED`: keys
    /// no longer sampled leave the simulations.
    fn resample(&mut self, live: usize) {
        if self.cap(live) <= MAX_SAMPLED {
            return;
        }
        while self.cap(live) > MAX_SAMPLED {
            self.shift += 1;
        }
        let shift = self.shift;
        let keep = |h: u64| sampled_at(shift, h);
        let gone: Vec<EntryId> = self.sampled.iter().filter(|(_, (h, _))| !keep(*h)).map(|(&id, _)| id).collect();
        gone.into_iter().for_each(|id| self.removed(id));
        for s in &mut self.sims {
            let gone: Vec<EntryId> = s.ids.iter().filter(|(h, _)| !keep(**h)).map(|(_, &id)| id).collect();
            gone.into_iter().for_each(|id| s.drop_entry(id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eviction::gd::{Gd, GdConfig};

    #[test]
    fn a_lead_counts_only_beyond_chance() {
        // 10 of 10 split accesses: beyond chance (1.75 * sqrt(10) = 5.5).
        assert!(clearly_ahead(10.0, 10.0));
        // 20 more hits is 2 % of 1 000 hits, but of 400 split accesses a
        // fair coin's lead reaches 20 (one deviation) a sixth of the time.
        assert!(!clearly_ahead(20.0, 400.0));
        // The same 2 % where the two agree on all but 40 accesses: clear.
        assert!(clearly_ahead(20.0, 40.0));
        assert!(!clearly_ahead(0.0, 0.0), "no evidence, no change");
    }

    #[test]
    fn the_simulations_stay_within_their_bound_as_the_cache_grows() {
        let mut t = Tuner::<Gd>::new(&GdConfig::default());
        let n = 40_000u32;
        for i in 0..n {
            let obj = Obj { size: 10, hash: u64::from(i).wrapping_mul(0xA24B_AED4_963E_E407) };
            t.stored(EntryId(i), obj, false, i as usize + 1, [5.0; 2], false);
        }
        // 40 000 entries >> 4 = 2 500: the rate fell from 1 to 1/16.
        assert_eq!(t.shift, 4);
        let cap = t.cap(n as usize);
        assert!(t.sims.iter().all(|s| s.ids.len() <= cap && s.ids.keys().all(|&h| t.is_sampled(h))));
        assert!(t.sampled.iter().all(|(&id, &(h, _))| t.is_sampled(h) && t.marked(id)));
        let marks: u32 = t.marks.iter().map(|w| w.count_ones()).sum();
        assert_eq!(marks as usize, t.sampled.len(), "one mark per sampled entry");
        assert!(t.sampled.len() < 2 * cap, "about one key in 16: {}", t.sampled.len());
    }
}
