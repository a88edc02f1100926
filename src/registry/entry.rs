//! One registry entry, laid out for memory and cache misses: keys up to
//! `INLINE_KEY` bytes live inside the entry (no allocation, no extra miss);
//! the location is packed (offsets are 4 KiB aligned, objects < 4 GiB); lock
//! state lives in a side table because few entries are locked at a time.
use super::Location;
use crate::error::{Error, Result};
use crate::ids::{NodeId, RegionId};

/// Keys up to this size are stored inline (LMCache keys in the adapter's
/// binary encoding are ~40 bytes plus the model name).
pub const INLINE_KEY: usize = 78;

/// A longer key is shared (`Arc`): the events announcing the entry and the
/// removal log hold it without a copy (a copy of a 1000-byte key for each
/// event cost a tenth of a store's time).
#[derive(Debug, Clone)]
pub enum KeyBuf {
    Inline(u8, [u8; INLINE_KEY]),
    Heap(std::sync::Arc<[u8]>),
}

impl KeyBuf {
    pub fn new(k: &[u8]) -> Self {
        if k.len() <= INLINE_KEY {
            let mut b = [0u8; INLINE_KEY];
            b[..k.len()].copy_from_slice(k);
            KeyBuf::Inline(k.len() as u8, b)
        } else {
            KeyBuf::Heap(k.into())
        }
    }
    pub fn as_slice(&self) -> &[u8] {
        match self {
            KeyBuf::Inline(n, b) => &b[..*n as usize],
            KeyBuf::Heap(b) => b,
        }
    }

    /// The key as an owned, shared value: the entry's own allocation for a
    /// longer key, a new one for an inline key.
    pub fn shared(&self) -> std::sync::Arc<[u8]> {
        match self {
            KeyBuf::Inline(n, b) => b[..*n as usize].into(),
            KeyBuf::Heap(b) => b.clone(),
        }
    }
}

pub struct Entry {
    pub key: KeyBuf,
    pub generation: u64,
    offset_4k: u32,
    length: u32,
    region: RegionId,
    pub node: NodeId,
    pub tenant: u32,
    /// Version of the object's first page when it was allocated (see
    /// `Location::version`).
    version: u32,
    pub committed: bool,
    /// Has a row in the lock table.
    pub locked: bool,
}

impl Entry {
    pub fn new(key: &[u8], loc: Location, tenant: u32) -> Result<Self> {
        Self::with_key(KeyBuf::new(key), loc, tenant)
    }

    /// `new`, the key already in an entry's form (no copy on the way).
    pub fn with_key(key: KeyBuf, loc: Location, tenant: u32) -> Result<Self> {
        if !loc.offset.is_multiple_of(4096) || loc.offset >> 12 > u32::MAX as u64 || loc.length > u32::MAX as u64 {
            return Err(Error::invalid(format!("location {loc:?} is not 4 KiB aligned or too large")));
        }
        Ok(Self {
            key,
            generation: loc.generation,
            offset_4k: (loc.offset >> 12) as u32,
            length: loc.length as u32,
            region: loc.region,
            node: loc.node,
            tenant,
            version: loc.version,
            committed: false,
            locked: false,
        })
    }

    pub fn loc(&self) -> Location {
        Location {
            node: self.node,
            region: self.region,
            offset: (self.offset_4k as u64) << 12,
            length: self.length as u64,
            generation: self.generation,
            version: self.version,
        }
    }

    pub fn length(&self) -> u64 {
        self.length as u64
    }

    pub fn region(&self) -> RegionId {
        self.region
    }
}

/// Refcounted, TTL-bounded lock of one entry, and who holds it: a lock
/// belongs to the client session that took it.
#[derive(Clone)]
pub struct LockState {
    pub count: u32,
    pub expiry: u64,
    /// (session, locks it holds); almost always one session.
    pub holders: Vec<(super::Session, u32)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_inline_or_on_the_heap_and_locations_round_trip() {
        for n in [1, INLINE_KEY, INLINE_KEY + 1, 1024] {
            let k: Vec<u8> = (0..n).map(|i| i as u8).collect();
            let loc = Location {
                node: NodeId(7),
                region: RegionId(3),
                offset: 5 << 20,
                length: (3 << 20) + 1,
                generation: u64::MAX,
                version: u32::MAX - 1,
            };
            let e = Entry::new(&k, loc, 2).unwrap();
            assert_eq!(e.key.as_slice(), &k[..]);
            assert_eq!(e.loc(), loc);
            assert_eq!(matches!(e.key, KeyBuf::Inline(..)), n <= INLINE_KEY);
        }
        let bad = Location { node: NodeId(1), region: RegionId(0), offset: 100, length: 1, generation: 1, version: 0 };
        assert!(Entry::new(b"k", bad, 0).is_err());
        assert!(std::mem::size_of::<Entry>() <= 120, "entry grew to {}", std::mem::size_of::<Entry>());
    }
}
