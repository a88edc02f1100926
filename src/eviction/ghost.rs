//! A ghost history: what a policy remembers about keys it evicted, by key
//! hash, without the keys. Direct-mapped slots of one word (32-bit
//! fingerprint, 32-bit value): a newer eviction overwrites an older one in
//! the same slot, so the table keeps roughly the most recent evictions at
//! a fixed cost and a lookup is one cache miss.
//!
//! Size: a power of two of at most a quarter of the live entries (<= 2 B
//! per entry), allocated at the first eviction and doubled as entries grow
//! (a resize forgets what it held: it cannot re-place fingerprints).

pub struct Ghost {
    slots: Vec<u64>,
    /// Slots per live entry, as a fraction (0 = no ghost).
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

    fn fingerprint(hash: u64) -> u64 {
        // Never 0, so an empty slot never matches.
        ((hash >> 32) | 1) << 32
    }

    /// Remember `value` for an evicted key.
    pub fn remember(&mut self, hash: u64, value: u32, live: usize) {
        if self.fraction <= 0.0 {
            return;
        }
        let want = self.want(live);
        if self.slots.len() < want {
            self.slots = vec![0; want];
        }
        let i = hash as usize & (self.slots.len() - 1);
        self.slots[i] = Self::fingerprint(hash) | value as u64;
    }

    /// What was remembered about `hash`, forgetting it.
    pub fn take(&mut self, hash: u64) -> Option<u32> {
        if self.slots.is_empty() {
            return None;
        }
        let i = hash as usize & (self.slots.len() - 1);
        let w = self.slots[i];
        if w != 0 && w & !0xFFFF_FFFF == Self::fingerprint(hash) {
            self.slots[i] = 0;
            Some(w as u32)
        } else {
            None
        }
    }
}
