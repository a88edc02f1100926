//! The registry rebuilt at start from the objects found in the pool's
//! records (`rebuild.rs` reads them): each key's newest version is adopted,
//! in the order of commit sequences (the eviction order), and the older
//! versions found beside it are handed back for their pages to be freed.
//!
//! Older versions are told apart by the key lookup each adoption does
//! anyway, not by a separate pass: a rebuild of a million keys has no time
//! to spare for sorting them by key (keys that share a long prefix made
//! such a sort cost as much as the rest of the rebuild).
use std::hash::BuildHasher;
use std::sync::Arc;

use super::entry::{Entry, KeyBuf};
use super::local::LocalRegistry;
use super::Location;
use crate::eviction::Obj;
use crate::ids::EntryId;

/// A committed object found in the pool.
#[derive(Debug, Clone)]
pub struct Found {
    /// Its commit sequence: pool-wide, a key's later version has the
    /// larger one.
    pub seq: u64,
    /// In an entry's form already: adopting it moves it, a key that fits
    /// an entry costs no allocation of its own.
    pub key: KeyBuf,
    /// Shared by the objects of one tenant.
    pub tenant: Arc<str>,
    pub loc: Location,
}

/// What `LocalRegistry::restore` did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Restored {
    /// Entries in the registry that the call added (one per key).
    pub added: usize,
    /// Older versions of keys the call adopted a later version of: no
    /// entry names them, so their pages are the caller's to free.
    pub superseded: Vec<Location>,
}

/// How many adoptions ahead a key's index slot is loaded.
const PROBE_AHEAD: usize = 8;

/// One bit per entry id.
struct IdBits(Vec<u64>);

impl IdBits {
    fn new(ids: usize) -> Self {
        Self(vec![0; ids.div_ceil(64)])
    }
    /// Set `id`'s bit; whether it was set before.
    fn set(&mut self, id: EntryId) -> bool {
        let i = id.index();
        if i / 64 >= self.0.len() {
            self.0.resize(i / 64 + 1, 0);
        }
        let (w, b) = (&mut self.0[i / 64], 1u64 << (i % 64));
        let was = *w & b != 0;
        *w |= b;
        was
    }
    fn get(&self, id: EntryId) -> bool {
        let i = id.index();
        self.0.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
    }
}

impl LocalRegistry {
    /// Adopt committed objects found in the pool's records after a restart,
    /// sorted by commit sequence, oldest first (that is their eviction
    /// order). A key found more than once keeps its last version in
    /// `found`; the earlier ones are returned as superseded. Keys present
    /// before the call are skipped; tenants are adopted even past the
    /// tenant limit. Each adopted key is announced as stored, once, with
    /// its sequence.
    pub fn restore(&self, found: Vec<Found>) -> Restored {
        let mut g = self.lock();
        // Ids this call gave an entry: a key found under one of them is an
        // earlier version from this same call.
        let mut mine = IdBits::new(g.slab.len() + found.len());
        // Kept only to announce (a million adoptions are 16 MiB of memory
        // the process has not touched yet).
        let announce = g.events.is_some();
        let mut adopted: Vec<(EntryId, u64)> = Vec::with_capacity(if announce { found.len() } else { 0 });
        let mut out = Restored::default();
        // Each adoption's index probe misses the cache (a million keys'
        // slots are 16 MiB): their slots are loaded a few keys ahead, so
        // the misses overlap instead of following one another.
        let hasher = g.hasher.clone();
        let hash_of = |f: &Found| hasher.hash_one(f.key.as_slice());
        let mut ahead = [0u64; PROBE_AHEAD];
        for (i, f) in found.iter().take(PROBE_AHEAD).enumerate() {
            ahead[i] = hash_of(f);
            g.index.prefetch(ahead[i]);
        }
        // Found objects come a region at a time, mostly of one tenant.
        let mut last_tenant: Option<(Arc<str>, u32)> = None;
        let mut found = found.into_iter();
        let mut i = 0;
        while let Some(Found { seq, key, tenant, loc }) = found.next() {
            let hash = ahead[i % PROBE_AHEAD];
            if let Some(f) = found.as_slice().get(PROBE_AHEAD - 1) {
                ahead[i % PROBE_AHEAD] = hash_of(f);
                g.index.prefetch(ahead[i % PROBE_AHEAD]);
            }
            i += 1;
            let present = g.find_hashed(key.as_slice(), hash);
            if present.is_some_and(|id| !mine.get(id)) {
                continue;
            }
            let t = match &last_tenant {
                Some((name, t)) if Arc::ptr_eq(name, &tenant) || *name == tenant => g.tenant_ref_again(*t),
                _ => {
                    let t = g.tenant_ref(&tenant, true).expect("forced");
                    last_tenant = Some((tenant, t));
                    t
                }
            };
            let Ok(mut e) = Entry::with_key(key, loc, t) else {
                g.tenant_unref(t);
                last_tenant = None; // the unref may have dropped the tenant
                continue;
            };
            e.committed = true;
            match present {
                Some(older) => out.superseded.push(g.remove(older)),
                None => out.added += 1,
            }
            let id = g.insert_hashed(e, hash);
            mine.set(id);
            g.keys += 1;
            g.bytes += loc.length;
            let tn = g.tenant(t);
            tn.bytes += loc.length;
            tn.keys += 1;
            g.orders.insert(loc.node, t, id, Obj { size: loc.length, hash });
            if announce {
                adopted.push((id, seq));
            }
        }
        if announce {
            // The last adoption under each id is the one that stands (an id
            // freed by a superseded version may be given again).
            let mut seen = IdBits::new(g.slab.len());
            let mut stands: Vec<(EntryId, u64)> = adopted.into_iter().rev().filter(|(id, _)| !seen.set(*id)).collect();
            stands.reverse();
            for (id, seq) in stands {
                g.announce_stored(id, seq);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{Event, EventLog, Limits};
    use crate::ids::{NodeId, RegionId};
    use crate::registry::ReserveOpts;

    fn loc(page: u64) -> Location {
        Location { node: NodeId(1), region: RegionId(0), offset: page * 4096, length: 10, generation: 1, version: 0 }
    }

    fn found(seq: u64, key: &str, tenant: &str, page: u64) -> Found {
        Found { seq, key: KeyBuf::new(key.as_bytes()), tenant: tenant.into(), loc: loc(page) }
    }

    fn stored(b: &[std::sync::Arc<crate::events::Batch>]) -> Vec<(String, u64, u64)> {
        let events = b.iter().flat_map(|b| b.events.iter());
        events
            .filter_map(|e| match e {
                Event::Stored { key, size, commit_seq, .. } => {
                    Some((String::from_utf8(key.to_vec()).unwrap(), *size, *commit_seq))
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_key_found_twice_keeps_its_newest_version_and_hands_back_the_older() {
        let r = LocalRegistry::new("lru", 16).unwrap();
        let got = r.restore(vec![
            found(1, "a", "old", 0),
            found(2, "b", "t", 1),
            found(3, "a", "t", 2),
            found(4, "c", "t", 3),
            found(5, "c", "t", 4),
        ]);
        assert_eq!(got, Restored { added: 3, superseded: vec![loc(0), loc(3)] });
        let s = r.stats();
        assert_eq!((s.keys, s.bytes_stored), (3, 30));
        // The superseded version's tenant held nothing else: forgotten.
        let tenants: Vec<(String, u64)> = s.tenants.iter().map(|t| (t.tenant.clone(), t.keys)).collect();
        assert_eq!(tenants, vec![("t".to_string(), 3)]);
        // Each key at its newest version's place, in the eviction order of
        // the newest versions' sequences: b (2), a (3), c (5).
        let order: Vec<Location> = (0..3).flat_map(|_| r.evict(NodeId(1), 1, 4096, 0)).collect();
        assert_eq!(order, vec![loc(1), loc(2), loc(4)]);
    }

    #[test]
    fn a_key_present_before_the_restore_is_skipped_not_superseded() {
        let r = LocalRegistry::new("lru", 16).unwrap();
        let res = r.reserve("t", vec![(b"a".to_vec(), loc(7))], ReserveOpts::local(1_000))[0].clone().unwrap();
        r.commit(&[res], super::super::Session::LOCAL, &mut |_, _| {}).0[0].clone().unwrap();
        let got = r.restore(vec![found(1, "a", "t", 0), found(2, "b", "t", 1), found(3, "a", "t", 2)]);
        assert_eq!(got, Restored { added: 1, superseded: vec![] });
        assert_eq!(r.lookup_and_lock(&[b"a"], 10, 0), vec![Some(loc(7))]);
    }

    #[test]
    fn each_restored_key_is_announced_once_with_its_newest_sequence() {
        let limits = Limits {
            batch_events: 64,
            batch_bytes: 1 << 20,
            batch_delay: std::time::Duration::from_millis(5),
            buffer_events: 64,
            buffer_bytes: 1 << 20,
            ring_batches: 16,
            ring_bytes: 1 << 20,
            staged_bytes: 1 << 20,
            per_model: false,
        };
        let log = EventLog::new(limits);
        let r = LocalRegistry::new("lru", 16).unwrap().with_events(log.sink());
        // "a" three times: ids freed by its older versions are given again.
        r.restore(vec![
            found(1, "a", "t", 0),
            found(2, "b", "t", 1),
            found(3, "a", "t", 2),
            found(4, "a", "t", 3),
            found(5, "c", "t", 4),
        ]);
        log.cut();
        let (batches, _) = log.read(0, usize::MAX);
        // Each adopted key once, at its newest version's sequence (a
        // superseded version is never announced).
        let want = [("b", 10, 2), ("a", 10, 4), ("c", 10, 5)].map(|(k, s, q)| (k.to_string(), s, q));
        assert_eq!(stored(&batches), want.to_vec());
    }
}
