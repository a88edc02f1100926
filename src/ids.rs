//! Ids that cannot be swapped. Node ids, region ids, entry ids and
//! reservation ids are all small or plain integers that travel side by side
//! (the region table's calls name a region and its owner; a claim answers
//! with a region for a node), so each has a type of its own and one cannot
//! be passed for another. This is a leaf module: it imports nothing from the
//! crate, so every layer may use it without a dependency pointing upward.
//! The wire (proto messages) and the on-pool words keep plain integers:
//! conversions happen at those edges (`rpc`, `cluster::convert`, the pool's
//! layout code), and the registry's `Location` carries the types.
use std::fmt;

/// A node's id in the pool's node table (1..).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

/// A region's index in the pool's region table (0..region_count).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u32);

// Plain numbers in messages and logs, as before these were types.
impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for RegionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The registry's dense id of an entry: the index into its slab and into
/// every eviction policy's per-id arrays. `repr(transparent)` and `Copy`, so
/// it costs what the bare `u32` did; its derived `Hash` hashes that `u32`.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct EntryId(pub u32);

impl EntryId {
    /// The index into a per-id array (a widening, never a truncation).
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for EntryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A reservation's id: 64 random bits (never 0), so a client cannot guess
/// another's. Plain `u64` on the wire only; inside, it cannot be mistaken
/// for a timestamp, a size or a sequence number travelling beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReservationId(pub u64);

impl fmt::Display for ReservationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
