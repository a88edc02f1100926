//! A ghost history: which keys a policy evicted lately, by key hash, without
//! the keys. Direct-mapped 2-byte slots (a 15-bit fingerprint and one bit
//! the policy chooses): a newer eviction overwrites an older one in the same
//! slot, so the table keeps roughly the most recent evictions at a fixed
//! cost and a lookup is one cache miss. A false match (1 in 32 768 per
//! lookup of an absent key) only misranks one entry.
//!
//! Size: a power of two of at most `fraction` slots per live entry (2 B per
//! slot), allocated at the first eviction and doubled as entries grow (a
//! resize forgets what it held: it cannot re-place fingerprints).

pub struct Ghost {
    slots: Vec<u16>,
    fraction: f64,
}

const MIN_SLOTS: usize = 1024;

impl Ghost {
    pub fn new(fraction: f64) -> Self {
        Self { slots: vec![], fraction }
    }

    fn want(&self, live: usize) -> usize {
        let w = (live as f64 * self.fraction) as usize;
        // Round down to a power of two so the table stays within the bound.
        if w < MIN_SLOTS {
            MIN_SLOTS
        } else {
            1 << (usize::BITS - 1 - w.leading_zeros())
        }
    }

    /// Fingerprint in the upper 15 bits, never all zero (an empty slot).
    fn fingerprint(hash: u64) -> u16 {
        ((hash >> 48) as u16 | 2) & !1
    }

    /// Remember an evicted key with one bit of what the policy knew of it.
    pub fn remember(&mut self, hash: u64, bit: bool, live: usize) {
        if self.fraction <= 0.0 {
            return;
        }
        let want = self.want(live);
        if self.slots.len() < want {
            self.slots = vec![0; want];
        }
        let i = hash as usize & (self.slots.len() - 1);
        self.slots[i] = Self::fingerprint(hash) | bit as u16;
    }

    /// Whether `hash` was evicted lately, and its bit; forgets it.
    pub fn take(&mut self, hash: u64) -> Option<bool> {
        if self.slots.is_empty() {
            return None;
        }
        let i = hash as usize & (self.slots.len() - 1);
        let w = self.slots[i];
        if w != 0 && w & !1 == Self::fingerprint(hash) {
            self.slots[i] = 0;
            Some(w & 1 == 1)
        } else {
            None
        }
    }
}
