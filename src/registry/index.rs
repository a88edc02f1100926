//! Key index: 64-bit key hash → entry id. Open addressing with linear probing
//! over 8-byte slots `tag << 32 | (id + 1)` (0 = empty), where `tag` is the
//! hash's high 32 bits and a key's home slot is the tag's top bits.
//!
//! Why not hashbrown: a key's home slot follows from its hash alone, so a
//! batch can load every key's slot before comparing any and the CPU overlaps
//! those cache misses; a 10 M-entry registry misses on every one. Deletion
//! shifts the cluster back (no tombstones), and growth needs no key rehash,
//! since the tag holds the position bits.
use crate::ids::EntryId;

const EMPTY: u64 = 0;
const MIN_BITS: u32 = 4;

pub struct Index {
    slots: Vec<u64>,
    /// log2 of the slot count.
    bits: u32,
    len: usize,
}

fn tag(h: u64) -> u32 {
    (h >> 32) as u32
}

fn slot(t: u32, id: EntryId) -> u64 {
    ((t as u64) << 32) | (id.0 as u64 + 1)
}

fn slot_id(s: u64) -> EntryId {
    EntryId((s as u32).wrapping_sub(1))
}

impl Default for Index {
    fn default() -> Self {
        Self { slots: vec![EMPTY; 1 << MIN_BITS], bits: MIN_BITS, len: 0 }
    }
}

impl Index {
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    fn home(&self, t: u32) -> usize {
        (t >> (32 - self.bits)) as usize
    }

    /// Start loading `h`'s home slot so a later probe finds it in cache.
    pub fn prefetch(&self, h: u64) {
        crate::platform::prefetch(&self.slots[self.home(tag(h))]);
    }

    /// The first id whose tag matches `h`'s (usually the key's own entry;
    /// the caller verifies it and falls back to `find`).
    pub fn first_candidate(&self, h: u64) -> Option<EntryId> {
        self.find(h, |_| true)
    }

    pub fn find(&self, h: u64, eq: impl FnMut(EntryId) -> bool) -> Option<EntryId> {
        self.position(h, eq).map(|i| slot_id(self.slots[i]))
    }

    /// The slot holding the first id with `h`'s tag for which `eq` holds.
    fn position(&self, h: u64, mut eq: impl FnMut(EntryId) -> bool) -> Option<usize> {
        let t = tag(h);
        let mut i = self.home(t);
        loop {
            let s = self.slots[i];
            if s == EMPTY {
                return None;
            }
            if (s >> 32) as u32 == t && eq(slot_id(s)) {
                return Some(i);
            }
            i = (i + 1) & self.mask();
        }
    }

    /// Insert an id whose key is not in the index.
    pub fn insert(&mut self, h: u64, id: EntryId) {
        assert!(id.0 < u32::MAX, "entry id {id} out of range");
        // Grow at 80 % load: probe clusters stay short.
        if (self.len + 1) * 5 > self.slots.len() * 4 {
            self.grow();
        }
        self.place(slot(tag(h), id));
        self.len += 1;
    }

    fn place(&mut self, s: u64) {
        let mut i = self.home((s >> 32) as u32);
        while self.slots[i] != EMPTY {
            i = (i + 1) & self.mask();
        }
        self.slots[i] = s;
    }

    fn grow(&mut self) {
        assert!(self.bits < 32, "index full");
        let old = std::mem::replace(&mut self.slots, vec![EMPTY; 1 << (self.bits + 1)]);
        self.bits += 1;
        for s in old.into_iter().filter(|&s| s != EMPTY) {
            self.place(s);
        }
    }

    /// Remove `id` (indexed under `h`); false if it is not there.
    pub fn remove(&mut self, h: u64, id: EntryId) -> bool {
        let Some(mut i) = self.position(h, |x| x == id) else { return false };
        let mask = self.mask();
        // Backward shift: pull later members of the cluster into the hole
        // when that keeps them at or after their home slot.
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let s = self.slots[j];
            if s == EMPTY {
                break;
            }
            let home = self.home((s >> 32) as u32);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(i) & mask) {
                self.slots[i] = s;
                i = j;
            }
        }
        self.slots[i] = EMPTY;
        self.len -= 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u16),
        Remove(u16),
    }

    proptest! {
        /// Against a HashMap, with a hash that crowds few home slots (only 8
        /// distinct high bytes) so clusters wrap around and shift on removal.
        #[test]
        fn index_matches_a_map(ops in proptest::collection::vec(
            prop_oneof![(0u16..300).prop_map(Op::Insert), (0u16..300).prop_map(Op::Remove)], 1..400)) {
            let hash = |k: u16| ((k as u64 % 8) << 61) | ((k as u64) << 32) | 0xdead;
            let mut ix = Index::default();
            let mut model: HashMap<u16, EntryId> = HashMap::new();
            let mut next = EntryId(0);
            for op in ops {
                match op {
                    Op::Insert(k) => if let std::collections::hash_map::Entry::Vacant(v) = model.entry(k) {
                        ix.insert(hash(k), next);
                        v.insert(next);
                        next.0 += 1;
                    },
                    Op::Remove(k) => {
                        let want = model.remove(&k);
                        prop_assert_eq!(ix.remove(hash(k), want.unwrap_or(EntryId(u32::MAX - 1))), want.is_some());
                    }
                }
                prop_assert_eq!(ix.len, model.len());
                let by_id: HashMap<EntryId, u16> = model.iter().map(|(&k, &id)| (id, k)).collect();
                for k in 0..300u16 {
                    let found = ix.find(hash(k), |id| by_id.get(&id) == Some(&k));
                    prop_assert_eq!(found, model.get(&k).copied(), "key {}", k);
                }
            }
        }
    }

    #[test]
    fn grows_and_keeps_every_id() {
        let mut ix = Index::default();
        let h = |i: u32| (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for i in 0..100_000 {
            ix.insert(h(i), EntryId(i));
        }
        assert!(ix.slots.len() >= 100_000 * 5 / 4);
        for i in (0..100_000).step_by(7) {
            assert_eq!(ix.find(h(i), |id| id == EntryId(i)), Some(EntryId(i)));
            assert_eq!(ix.first_candidate(h(i)).map(|c| ix.find(h(i), |id| id == c).is_some()), Some(true));
        }
        for i in 0..50_000 {
            assert!(ix.remove(h(i), EntryId(i)));
        }
        assert!(!ix.remove(h(3), EntryId(3)), "already removed");
        assert_eq!(ix.find(h(3), |id| id == EntryId(3)), None);
        assert_eq!(ix.find(h(60_000), |id| id == EntryId(60_000)), Some(EntryId(60_000)));
    }
}
