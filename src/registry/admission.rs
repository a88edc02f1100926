//! Admission: whether a store of a key the pool does not hold is worth a
//! place, decided by the registry (pool-wide: the primary's, in a cluster)
//! before any page is placed or byte copied. Most KV chunks are never read
//! again, and each one stored costs its copy (the CXL link's write
//! bandwidth) and evicts something that might have been read.
//!
//! The gate is "second touch": a key is admitted when the history has seen
//! it before, refused (and remembered) otherwise; within one store's batch
//! (a request's chunks, in prefix order) a chunk after a refused one is
//! refused too (it keeps its place in the history), since a reader that
//! loads a prefix up to its first miss could not use it: on Mooncake's
//! traces that kept prefix hits level with block hits (without it they fell
//! up to 1.8 pp below `gd`'s) and wrote less. The history is of keys
//! the registry does not hold: stores it refused and entries it evicted;
//! a lookup that misses a key it remembers makes it the newest again. A
//! lookup and the store that follows its miss are one touch, so a lookup
//! adds nothing new: a client that looks a key up twice per request would
//! otherwise pass every gate. It is `gd`'s ghost table (`eviction/ghost.rs`:
//! 2-byte fingerprints in buckets of a cache line, newest first), of
//! `admission_history` slots per entry (8: a second touch counts if it
//! comes within about eight turnovers of the cache; a key back later than
//! that is refused again, and a longer memory admitted more chunks that
//! were not read again, with fewer hits: docs/BENCHMARKS.md, "Admission"),
//! at most 16 MiB.
//!
//! Modes (`[registry] admission`): `off` admits everything; `second_touch`
//! gates whenever the cache is full (a cache with room gains no hit from
//! refusing anything); `adaptive` (the default) gates while the cache is
//! full, once it has judged `EVIDENCE` stores so (a short burst is no
//! evidence), and while two miniature simulations of the registry's policy
//! (`shadows.rs`), one admitting everything and one gated, say the gate is
//! not losing hits in a cache that is read. A store that is not admitted is
//! not an error: the client skips it (docs/ARCHITECTURE.md, "Admission").
use serde::{Deserialize, Serialize};

use super::shadows::Shadows;
use crate::eviction::ghost::Ghost;
use crate::eviction::PolicyConfig;

/// Stores the adaptive mode judges after the registry's first eviction
/// before it may gate: with less evidence than that (a test, a short burst)
/// it admits everything, as `off` would.
pub const EVIDENCE: u64 = 4096;

/// The most bytes the history holds (16 MiB).
pub const HISTORY_MAX_BYTES: usize = Ghost::MAX_BYTES;

/// `[registry] admission`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AdmissionMode {
    /// Admit every store.
    Off,
    /// Admit a key only when the history has seen it, while the cache is
    /// full.
    SecondTouch,
    /// Gate while the gate does not lose hits (the default).
    #[default]
    Adaptive,
}

impl AdmissionMode {
    pub const fn as_str(self) -> &'static str {
        match self {
            AdmissionMode::Off => "off",
            AdmissionMode::SecondTouch => "second_touch",
            AdmissionMode::Adaptive => "adaptive",
        }
    }
}

impl std::str::FromStr for AdmissionMode {
    type Err = crate::error::Error;
    fn from_str(s: &str) -> crate::error::Result<Self> {
        [AdmissionMode::Off, AdmissionMode::SecondTouch, AdmissionMode::Adaptive]
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| {
                crate::error::Error::invalid(format!(
                    "unknown admission mode {s:?}; known: off, second_touch, adaptive"
                ))
            })
    }
}

/// The admission settings of a registry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdmissionConfig {
    pub mode: AdmissionMode,
    /// History slots per live entry (2 B each).
    pub history: f64,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self { mode: AdmissionMode::default(), history: 8.0 }
    }
}

impl AdmissionConfig {
    pub fn off() -> Self {
        Self { mode: AdmissionMode::Off, ..Self::default() }
    }
}

/// What admission has decided, for Stats, `cxlkv status` and metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AdmissionStats {
    /// The configured mode.
    pub mode: AdmissionMode,
    /// Whether stores are gated now.
    pub gating: bool,
    pub admitted: u64,
    pub refused: u64,
    /// Bytes of the history and of the simulations now.
    pub history_bytes: u64,
    pub shadow_bytes: u64,
}

/// One store's batch as admission judges it, chunk after chunk.
#[derive(Debug, Clone, Copy, Default)]
pub struct Run {
    /// The gate refused a chunk of it: it refuses the rest.
    cut: bool,
}

pub struct Admission {
    mode: AdmissionMode,
    history: Ghost,
    shadows: Option<Box<Shadows>>,
    /// The most entries the registry has held: the cache's size, for the
    /// history and the simulations (a full cache stays about as full).
    entries: usize,
    /// Stores admitted since the registry last evicted (None: it never
    /// did): a cache with room is under no pressure, whatever its size.
    since_eviction: Option<usize>,
    /// Stores judged since the registry first evicted.
    judged_full: u64,
    admitted: u64,
    refused: u64,
}

impl Admission {
    /// Admission of a registry whose eviction policy is `policy`.
    pub fn new(c: AdmissionConfig, policy: &PolicyConfig) -> Self {
        let shadows = (c.mode == AdmissionMode::Adaptive).then(|| Box::new(Shadows::new(&policy.simulation())));
        Self {
            mode: c.mode,
            history: Ghost::new(c.history),
            shadows,
            entries: 0,
            since_eviction: None,
            judged_full: 0,
            admitted: 0,
            refused: 0,
        }
    }

    pub fn off() -> Self {
        Self::new(AdmissionConfig::off(), &PolicyConfig::of(crate::eviction::PolicyKind::Lru))
    }

    pub fn is_on(&self) -> bool {
        self.mode != AdmissionMode::Off
    }

    /// A store of `hash` (not held), `size` bytes, with `live` entries
    /// held: admitted or not. One that is not is remembered. `run` is the
    /// store's batch so far (a request's chunks, in prefix order): once the
    /// gate refused one of its chunks it refuses the rest, which a reader
    /// that loads a prefix up to its first miss could not use.
    pub fn judge(&mut self, hash: u64, size: u64, live: usize, run: &mut Run) -> bool {
        if !self.is_on() {
            self.admitted += 1;
            return true;
        }
        self.entries = self.entries.max(live);
        self.judged_full += self.since_eviction.is_some() as u64;
        let seen = self.history.contains(hash);
        let passes = seen && !run.cut;
        run.cut |= !passes;
        // The simulations judge keys one at a time: they see sampled keys,
        // seldom a whole run.
        if let Some(s) = &mut self.shadows {
            s.stored(hash, size, seen, self.entries);
        }
        if self.gating() && !passes {
            // A first touch is remembered; a chunk refused for its run
            // keeps the place it had.
            if !seen {
                self.history.remember(hash, 0, self.entries);
            }
            self.refused += 1;
            return false;
        }
        self.admitted += 1;
        if let Some(n) = &mut self.since_eviction {
            *n += 1;
        }
        true
    }

    /// Whether stores of keys not seen before are refused now: while the
    /// cache is full (it evicted within the last cache's worth of admitted
    /// stores: one with room gains no hit from refusing anything, and its
    /// history, sized by the entries it holds, would stay too short for it
    /// ever to fill); with `adaptive`, also once it has judged `EVIDENCE`
    /// stores full and while the simulations say the gate is not losing
    /// hits.
    fn gating(&self) -> bool {
        let full = self.is_on() && self.since_eviction.is_some_and(|n| n <= self.entries);
        match &self.shadows {
            None => full,
            Some(s) => full && self.judged_full >= EVIDENCE && s.gating(),
        }
    }

    /// A lookup found `hash` (or a follower answered a read of it).
    pub fn read(&mut self, hash: u64, size: u64, live: usize) {
        if let Some(s) = &mut self.shadows {
            self.entries = self.entries.max(live);
            s.read(hash, size, self.entries);
        }
    }

    /// Whether a read of `hash` is news to admission (its simulations
    /// sample the key): the registry skips the others at once.
    pub fn reads(&self, hash: u64) -> bool {
        self.shadows.as_ref().is_some_and(|s| s.samples(hash))
    }

    /// A lookup missed `hash`: a key it remembers is the newest again.
    pub fn missed(&mut self, hash: u64) {
        if self.is_on() && self.history.take(hash).is_some() {
            self.history.remember(hash, 0, self.entries);
        }
    }

    /// `hash` was evicted: a later store of it is its second touch.
    pub fn evicted(&mut self, hash: u64) {
        if self.is_on() {
            self.since_eviction = Some(0);
            self.history.take(hash);
            self.history.remember(hash, 0, self.entries);
        }
    }

    pub fn stats(&self) -> AdmissionStats {
        AdmissionStats {
            mode: self.mode,
            gating: self.gating(),
            admitted: self.admitted,
            refused: self.refused,
            history_bytes: self.history.bytes() as u64,
            shadow_bytes: self.shadows.as_ref().map_or(0, |s| s.bytes() as u64),
        }
    }
}
