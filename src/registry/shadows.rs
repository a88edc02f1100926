//! What adaptive admission follows: two miniature simulations (Waldspurger
//! et al., "Cache Modeling and Optimization using Miniature Simulations",
//! USENIX ATC '17, as `gd`'s tuner uses them) of the registry's own
//! eviction policy over sampled keys, one admitting every store and one
//! admitting only a key the history has seen before (`admission.rs`). They
//! see the same accesses in the real order: each store the registry judges
//! and each read it answers (a lookup hit, or a follower's read of a key it
//! holds). A simulation that holds the key hits; one that lacks it misses
//! and stores it, if it admits it: the admit-all one always, the gated one
//! when the history knew the key or the access is a read (a read key was
//! stored before: this is at least its second touch).
//!
//! Which one is winning: of the accesses where exactly one of the two hit,
//! the gated one's lead (its hits there minus the other's) is compared with
//! a fair coin's spread (McNemar's test for paired outcomes, as the tuner
//! does). The registry follows the gate while the cache is under pressure
//! (the admit-all simulation evicted a cache's worth within the window) and
//! the gate is not clearly behind: a tie costs no hits and saves the
//! writes, so it goes to the gate; but only where the cache is read (the
//! two hit `MIN_HITS` times in the window): with no reads there is no
//! evidence of which chunks are worth keeping, and a cache filled ahead of
//! its readers keeps what it is given. Counts halve every `WINDOW` simulated
//! turnovers, so the choice follows the workload.
//!
//! Sampling: a key takes part when the low `shift` bits of its mixed hash
//! are 0 (every access of a sampled key is seen, so reuse is measured
//! whole); each simulation holds the registry's largest entry count scaled
//! by the rate, at most `MAX_SAMPLED` entries, so the two cost under 1 MiB
//! however large the registry (their policy state, key maps and a ghost
//! each: about 120 B per simulated entry).

use crate::eviction::{ByKeyHash, EntryId, EvictionPolicy, Obj, PolicyConfig};

/// Most entries one simulation holds.
pub const MAX_SAMPLED: usize = 4096;
/// Counts halve every `WINDOW` simulated turnovers.
const WINDOW: usize = 32;
/// Standard deviations of a fair coin by which the gated simulation must
/// trail the admit-all one before the registry stops gating.
const Z: f64 = 2.0;
/// Hits (both simulations', in the window) below which nothing is gated: a
/// cache nobody reads gives no evidence of which chunks are worth keeping
/// (it may be filled ahead of its readers).
const MIN_HITS: f64 = 64.0;

/// One simulated cache of sampled keys.
struct Shadow {
    policy: Box<dyn EvictionPolicy>,
    ids: ByKeyHash,
    /// The key hash of each simulated entry id.
    hashes: Vec<u64>,
    free: Vec<EntryId>,
    hits: f64,
    evicted: f64,
}

impl Shadow {
    fn new(policy: &PolicyConfig) -> Self {
        Self {
            policy: policy.build(),
            ids: ByKeyHash::default(),
            hashes: vec![],
            free: vec![],
            hits: 0.0,
            evicted: 0.0,
        }
    }

    /// An access: a hit if held (read: held while read, then released, as
    /// a lookup does), else stored when `admit`, within `cap` entries.
    fn access(&mut self, hash: u64, size: u64, admit: bool, cap: usize) -> bool {
        if let Some(&id) = self.ids.get(&hash) {
            self.hits += 1.0;
            self.policy.hold(0, id);
            self.policy.touch(0, id);
            self.policy.release(0, id);
            return true;
        }
        if admit {
            while self.ids.len() >= cap.max(1) {
                let Some(v) = self.policy.pop_victim(0) else { break };
                self.drop_entry(v);
                self.evicted += 1.0;
            }
            let id = self.free.pop().unwrap_or_else(|| {
                self.hashes.push(0);
                EntryId(self.hashes.len() as u32 - 1)
            });
            self.hashes[id.index()] = hash;
            self.ids.insert(hash, id);
            self.policy.insert(0, id, Obj { size, hash });
        }
        false
    }

    /// Out of the simulation: evicted (just popped) or no longer sampled.
    fn drop_entry(&mut self, id: EntryId) {
        let hash = self.hashes[id.index()];
        self.policy.remove(0, id, hash);
        self.ids.remove(&hash);
        self.free.push(id);
    }

    fn halve(&mut self) {
        self.hits /= 2.0;
        self.evicted /= 2.0;
    }

    /// Bytes of its key map and ids (the policy's own state is about as
    /// much again, see the module doc).
    fn bytes(&self) -> usize {
        self.ids.capacity() * 24 + self.hashes.capacity() * 8 + self.free.capacity() * 4
    }
}

/// The two simulations and which one the registry follows.
pub struct Shadows {
    all: Shadow,
    gated: Shadow,
    shift: u32,
    accesses: usize,
    /// Accesses where exactly one of the two hit, and how many more of
    /// those the gated one hit.
    split: f64,
    lead: f64,
    gating: bool,
}

/// Whether `hash` is sampled at a rate of one in `1 << shift` (bits spread
/// first, so sampling follows neither the index's nor a ghost's bits).
fn sampled_at(shift: u32, hash: u64) -> bool {
    hash.wrapping_mul(0xD6E8_FEB8_6659_FD93).rotate_left(23) & ((1 << shift) - 1) == 0
}

impl Shadows {
    /// Simulations of `policy` (a simulation of its own: `gd` without its
    /// tuner).
    pub fn new(policy: &PolicyConfig) -> Self {
        Self {
            all: Shadow::new(policy),
            gated: Shadow::new(policy),
            shift: 0,
            accesses: 0,
            split: 0.0,
            lead: 0.0,
            gating: false,
        }
    }

    /// Whether the registry should gate its stores now.
    pub fn gating(&self) -> bool {
        self.gating
    }

    fn cap(&self, entries: usize) -> usize {
        entries >> self.shift
    }

    /// A store the registry judges: `seen`, the history knew the key;
    /// `entries`, the most the registry has held.
    pub fn stored(&mut self, hash: u64, size: u64, seen: bool, entries: usize) {
        self.access(hash, size, seen, entries);
    }

    /// A read the registry answered (the key was stored before).
    pub fn read(&mut self, hash: u64, size: u64, entries: usize) {
        self.access(hash, size, true, entries);
    }

    /// Whether `hash` takes part (most keys do not, in a large cache: the
    /// registry skips them before anything else).
    pub fn samples(&self, hash: u64) -> bool {
        sampled_at(self.shift, hash)
    }

    fn access(&mut self, hash: u64, size: u64, gate_admits: bool, entries: usize) {
        // A key not sampled now is not sampled at any lower rate either.
        if !self.samples(hash) {
            return;
        }
        self.resample(entries);
        if !self.samples(hash) {
            return;
        }
        let cap = self.cap(entries);
        let all = self.all.access(hash, size, true, cap);
        let gated = self.gated.access(hash, size, gate_admits, cap);
        if all != gated {
            self.split += 1.0;
            self.lead += if gated { 1.0 } else { -1.0 };
        }
        self.accesses += 1;
        if self.accesses >= WINDOW * cap.max(64) {
            self.accesses = 0;
            self.all.halve();
            self.gated.halve();
            (self.split, self.lead) = (self.split / 2.0, self.lead / 2.0);
        }
        let pressure = self.all.evicted >= cap.max(1) as f64;
        let read = self.all.hits + self.gated.hits >= MIN_HITS;
        self.gating = pressure && read && self.lead >= -Z * self.split.sqrt();
    }

    /// Halve the rate while a simulation would outgrow `MAX_SAMPLED`: keys
    /// no longer sampled leave both.
    fn resample(&mut self, entries: usize) {
        if self.cap(entries) <= MAX_SAMPLED {
            return;
        }
        while self.cap(entries) > MAX_SAMPLED {
            self.shift += 1;
        }
        let shift = self.shift;
        for s in [&mut self.all, &mut self.gated] {
            let gone: Vec<EntryId> = s.ids.iter().filter(|(h, _)| !sampled_at(shift, **h)).map(|(_, &id)| id).collect();
            gone.into_iter().for_each(|id| s.drop_entry(id));
        }
    }

    /// Bytes the two hold, roughly (their maps and ids twice over, for the
    /// policies' state).
    pub fn bytes(&self) -> usize {
        2 * (self.all.bytes() + self.gated.bytes())
    }

    /// (admit-all hits, gated hits, the gated one's lead on split
    /// accesses, split accesses) in the current window.
    #[cfg(test)]
    pub fn figures(&self) -> (f64, f64, f64, f64) {
        (self.all.hits, self.gated.hits, self.lead, self.split)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eviction::PolicyKind;

    fn lru() -> PolicyConfig {
        PolicyConfig::of(PolicyKind::Lru)
    }

    #[test]
    fn a_gate_is_followed_only_under_pressure_and_when_not_behind() {
        // Keys read twice each, at once: the gate loses the first read of
        // every key, the admit-all cache makes it.
        let mut s = Shadows::new(&lru());
        for k in 0..2000u64 {
            s.stored(k, 1, false, 100);
            s.read(k, 1, 100);
        }
        let (all, gated, lead, _) = s.figures();
        assert!(all > gated && lead < 0.0, "{all} {gated} {lead}");
        assert!(!s.gating(), "the gate loses hits here");
        // One-hit keys between a hot set that is re-stored: the gate keeps
        // the hot keys, admitting everything washes them out.
        let mut s = Shadows::new(&lru());
        for round in 0..200u64 {
            for hot in 0..50 {
                s.stored(hot, 1, true, 100);
            }
            for one in 0..100 {
                s.stored(1_000_000 + round * 100 + one, 1, false, 100);
            }
        }
        assert!(s.gating(), "{:?}", s.figures());
        // Without pressure (everything fits) there is nothing to gate for.
        let mut s = Shadows::new(&lru());
        for k in 0..50u64 {
            s.stored(k, 1, false, 100);
        }
        assert!(!s.gating());
    }

    #[test]
    fn the_simulations_stay_within_their_bound() {
        let mut s = Shadows::new(&lru());
        let n = 100_000usize;
        for i in 0..n as u64 {
            let h = i.wrapping_mul(0xA24B_AED4_963E_E407);
            s.stored(h, 1, i % 2 == 0, i as usize + 1);
        }
        assert_eq!(s.shift, 5, "100 000 entries >> 5 = 3 125 <= 4 096");
        for sh in [&s.all, &s.gated] {
            assert!(sh.ids.len() <= MAX_SAMPLED && sh.ids.keys().all(|&h| sampled_at(5, h)));
        }
        assert!(s.bytes() < 1 << 20, "{}", s.bytes());
    }
}
