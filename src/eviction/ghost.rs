//! A ghost history: which keys a policy evicted lately, by key hash, without
//! the keys. 2-byte slots (a 14-bit fingerprint and a 2-bit tag the policy
//! chooses: what it knew of the key) in buckets of `WAYS`, newest first: a
//! bucket forgets its oldest eviction when a new one arrives, so the table
//! keeps the most recent evictions at a fixed cost, and a lookup reads one
//! 64-byte bucket. A false match (`WAYS` in 16 384 per lookup of an absent
//! key) only misranks one entry.
//!
//! Why buckets: with one slot per hash (direct-mapped), which evictions were
//! remembered depended on which keys happened to collide, so a policy's hits
//! moved with the hash seed (a server's is random); buckets keep the most
//! recent evictions whichever keys collide.
//!
//! Why 32 ways: a bucket's evictions arrive at random, so how far back a
//! small bucket remembers varies from bucket to bucket (with buckets of 8
//! and 8 slots per live entry, a bucket gets one eviction a turnover on
//! average and keeps its last 8: some reach 12 turnovers back, some 4).
//! Wider buckets average that out (32: 6 to 10) and the table comes closer
//! to an exact queue of the last evictions, which `gd` turns into hits.
//!
//! What each bucket width gave, over hash seeds and key salts:
//! docs/benchmark-findings.md, "Eviction quality", table "The figures
//! behind the eviction code" (`ghost::WAYS`).
//!
//! Size: a power of two of at most `fraction` slots per live entry (2 B per
//! slot) and at most `MAX_SLOTS`, allocated at the first eviction and
//! doubled as entries grow (a resize forgets what it held: it cannot
//! re-place fingerprints). The cap keeps a registry of 10 M entries within
//! its 150 B per entry (1.7 B of ghost each there); below a million entries
//! a policy gets every slot it asks for.

pub struct Ghost {
    slots: Vec<u16>,
    fraction: f64,
}

const MIN_SLOTS: usize = 1024;
/// Slots per bucket: 64 bytes, a cache line. 4 left more of the seed
/// dependence than 8; 32 remembers more evenly than 8 or 16 (see above),
/// 64 was no better.
pub const WAYS: usize = 32;
// `take_at` gathers a bucket's matches in a `u32`.
const _: () = assert!(WAYS <= 32);
/// 16 MiB of slots.
pub const MAX_SLOTS: usize = 1 << 23;
/// The bits of a slot that hold the policy's tag.
const TAG: u16 = 3;

impl Ghost {
    pub fn new(fraction: f64) -> Self {
        Self { slots: vec![], fraction }
    }

    /// Bytes the table holds now (2 per slot).
    pub fn bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<u16>()
    }

    /// The most bytes it can grow to: `MAX_SLOTS` slots.
    pub const MAX_BYTES: usize = MAX_SLOTS * std::mem::size_of::<u16>();

    fn want(&self, live: usize) -> usize {
        let w = ((live as f64 * self.fraction) as usize).min(MAX_SLOTS);
        // Round down to a power of two so the table stays within the bound.
        if w < MIN_SLOTS {
            MIN_SLOTS
        } else {
            1 << (usize::BITS - 1 - w.leading_zeros())
        }
    }

    /// Fingerprint in the upper 14 bits, never all zero (an empty slot).
    fn fingerprint(hash: u64) -> u16 {
        ((hash >> 48) as u16 | 4) & !TAG
    }

    /// The first slot of `hash`'s bucket (bits the fingerprint does not use).
    fn bucket(&self, hash: u64) -> usize {
        (hash as usize & (self.slots.len() / WAYS - 1)) * WAYS
    }

    /// Remember an evicted key with a tag (0-3) of what the policy knew of it.
    pub fn remember(&mut self, hash: u64, tag: u8, live: usize) {
        debug_assert!(u16::from(tag) <= TAG);
        if self.fraction <= 0.0 {
            return;
        }
        let want = self.want(live);
        if self.slots.len() < want {
            self.slots = vec![0; want];
        }
        let b = self.bucket(hash);
        self.slots.copy_within(b..b + WAYS - 1, b + 1);
        self.slots[b] = Self::fingerprint(hash) | (u16::from(tag) & TAG);
    }

    /// Whether `hash` is remembered (it stays).
    pub fn contains(&self, hash: u64) -> bool {
        if self.slots.is_empty() {
            return false;
        }
        let (b, fp) = (self.bucket(hash), Self::fingerprint(hash));
        self.slots[b..b + WAYS].iter().any(|&w| w & !TAG == fp)
    }

    /// Whether `hash` was evicted lately, and its tag; forgets it.
    pub fn take(&mut self, hash: u64) -> Option<u8> {
        self.take_at(hash).map(|(tag, _)| tag)
    }

    /// As `take`, with the remembered eviction's place in its bucket (0 =
    /// newest of the bucket's evictions).
    pub fn take_at(&mut self, hash: u64) -> Option<(u8, usize)> {
        if self.slots.is_empty() {
            return None;
        }
        let (b, fp) = (self.bucket(hash), Self::fingerprint(hash));
        let bucket: &mut [u16; WAYS] = (&mut self.slots[b..b + WAYS]).try_into().ok()?;
        // Compare every slot, no early exit: the compiler turns this into a
        // few vector compares (an empty slot never matches: a fingerprint
        // is never zero).
        let hits = bucket.iter().enumerate().fold(0u32, |m, (j, &w)| m | u32::from(w & !TAG == fp) << j);
        let i = (hits != 0).then(|| hits.trailing_zeros() as usize)?;
        let w = std::mem::take(&mut bucket[i]);
        Some(((w & TAG) as u8, i))
    }
}

#[cfg(test)]
mod tests {
    use std::hash::BuildHasher;

    use super::*;

    /// Hashes that share a bucket (and a slot, were the table direct-mapped)
    /// but not a fingerprint (for `i` up to 8 000).
    fn colliding(i: u64) -> u64 {
        (i + 1) << 51 | 0x2a
    }

    #[test]
    fn keys_that_share_a_bucket_are_remembered_until_it_overflows() {
        // A bucket's worth of evictions whose hashes differ only in the
        // fingerprint's bits.
        let ways = WAYS as u64;
        let mut g = Ghost::new(1.0);
        for i in 0..ways {
            g.remember(colliding(i), (i % 4) as u8, 4096);
        }
        for i in (0..ways).rev() {
            assert_eq!(g.take(colliding(i)), Some((i % 4) as u8), "eviction {i}");
            assert_eq!(g.take(colliding(i)), None, "taken once");
        }
        // One more than a bucket holds: the oldest is forgotten, the rest kept.
        for i in 0..=ways {
            g.remember(colliding(i), 0, 4096);
        }
        assert_eq!(g.take(colliding(0)), None);
        assert!((1..=ways).all(|i| g.take(colliding(i)).is_some()));
    }

    #[test]
    fn the_table_keeps_nearly_all_of_its_last_evictions_as_a_queue_would() {
        // 3 072 evictions into 4 096 slots: an exact queue keeps them all.
        // Buckets get them unevenly; with buckets of 8 a bucket receives 6
        // on average and 6 % are lost to overflowing buckets, with 32 it
        // receives 24 and under 1 % are.
        let mut g = Ghost::new(1.0);
        // Key hashes as the registry makes them (its hasher, a fixed seed).
        let hasher = foldhash::fast::SeedableRandomState::fixed();
        let key = |i: u64| hasher.hash_one(&i.to_le_bytes()[..]);
        let n = 3 * 4096 / 4;
        (0..n).for_each(|i| g.remember(key(i), 1, 4096));
        let kept = (0..n).filter(|&i| g.take(key(i)).is_some()).count() as u64;
        assert!(kept * 100 >= n * 98, "kept {kept} of {n}");
    }

    #[test]
    fn an_absent_key_or_an_empty_ghost_is_no_match() {
        let mut g = Ghost::new(1.0);
        assert_eq!(g.take(colliding(0)), None);
        g.remember(colliding(0), 1, 10);
        assert_eq!(g.take(colliding(1)), None);
        let mut off = Ghost::new(0.0);
        off.remember(colliding(0), 1, 10);
        assert_eq!(off.take(colliding(0)), None);
    }

    #[test]
    fn a_return_says_how_recent_its_eviction_was_and_the_table_is_capped() {
        let mut g = Ghost::new(1.0);
        for i in 0..3 {
            g.remember(colliding(i), 0, 4096);
        }
        assert_eq!(g.take_at(colliding(2)), Some((0, 0)), "the newest of its bucket");
        assert_eq!(g.take_at(colliding(0)), Some((0, 2)));
        assert_eq!(Ghost::new(8.0).want(100 << 20), MAX_SLOTS);
        assert_eq!(Ghost::new(8.0).want(1 << 16), 1 << 19);
    }
}
