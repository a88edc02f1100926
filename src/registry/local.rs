//! In-process primary registry: a slab of compact entries, an index of
//! entry ids keyed by the key bytes' hash (keys are stored once, inline when short),
//! one eviction policy (an order per node), a deadline queue for reservations and a side
//! table of locked entries.
use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::sync::Mutex;

// foldhash with a random per-instance seed: several times faster than SipHash
// on these short keys, still not predictable by clients.
use hashbrown::{DefaultHashBuilder, HashMap};

use super::entry::{Entry, LockState};
use super::index::Index;
use super::{pages_for, Freed, KeyInfo, Location, Registry, RegistryStats, Removed, TenantUsage};
use crate::error::{Error, ErrorKind, Result};
use crate::eviction::{self, EntryId, EvictionPolicy, Obj};

/// How many removals the log keeps for clients catching up.
pub const REMOVED_LOG: usize = 65_536;

/// (seq, key, tenant, size, evicted)
type RemovedLogEntry = (u64, Box<[u8]>, u32, u64, bool);

struct Tenant {
    name: String,
    bytes: u64,
    keys: u64,
}

struct Inner {
    hasher: DefaultHashBuilder,
    slab: Vec<Option<Entry>>,
    free_ids: Vec<EntryId>,
    index: Index,
    reserved: u64,
    deadlines: VecDeque<(u64, u64)>,
    /// Lock state of locked entries only (swept for expiry).
    locks: HashMap<EntryId, LockState>,
    /// One policy; an order per node.
    policy: Box<dyn EvictionPolicy>,
    tenants: Vec<Tenant>,
    tenant_ids: HashMap<String, u32>,
    next_seq: u32,
    removed: VecDeque<RemovedLogEntry>,
    removed_next: u64,
    keys: u64,
    bytes: u64,
    evictions: u64,
    reservations_expired: u64,
    locks_expired: u64,
}

pub struct LocalRegistry {
    policy_name: &'static str,
    inner: Mutex<Inner>,
}

impl LocalRegistry {
    pub fn new(policy: &str) -> Result<Self> {
        let policy = eviction::by_name(policy)?;
        let policy_name = policy.name();
        // Reservation ids are `seq << 32 | slot`; seeding seq from the clock keeps
        // ids from a previous run from matching this run's reservations.
        let seed = (crate::pool::now_unix_ms() as u32).max(1);
        Ok(Self {
            policy_name,
            inner: Mutex::new(Inner {
                hasher: DefaultHashBuilder::default(),
                slab: vec![],
                free_ids: vec![],
                index: Index::default(),
                reserved: 0,
                deadlines: VecDeque::new(),
                locks: HashMap::new(),
                policy,
                tenants: vec![],
                tenant_ids: HashMap::new(),
                next_seq: seed,
                removed: VecDeque::new(),
                removed_next: 1,
                keys: 0,
                bytes: 0,
                evictions: 0,
                reservations_expired: 0,
                locks_expired: 0,
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Inner {
    fn find(&self, key: &[u8]) -> Option<EntryId> {
        self.find_hashed(key, self.hasher.hash_one(key))
    }

    /// `find` for a batch. Each key's slot and entry loads are independent of
    /// the others', so loading every slot first, then every entry, lets the
    /// CPU keep a batch's cache misses in flight together instead of taking
    /// them one after another (a 10 M-entry registry misses on every level of
    /// cache).
    /// With `for_touch`, the eviction policy's state of each candidate is
    /// loaded in the same round.
    fn find_many(&self, keys: &[&[u8]], for_touch: bool) -> Vec<Option<EntryId>> {
        let hashes: Vec<u64> = keys.iter().map(|k| self.hasher.hash_one(k)).collect();
        for &h in &hashes {
            self.index.prefetch(h);
        }
        // The first id with the key's 32-bit tag (almost always the key's
        // own); its entry spans two or three cache lines.
        let mut out: Vec<Option<EntryId>> = hashes
            .iter()
            .map(|&h| {
                let c = self.index.first_candidate(h);
                if let Some(id) = c {
                    crate::pool::prefetch(&self.slab[id as usize]);
                    if for_touch {
                        self.policy.prefetch(id);
                    }
                }
                c
            })
            .collect();
        for ((o, k), &h) in out.iter_mut().zip(keys).zip(&hashes) {
            if !o.is_some_and(|id| self.slab[id as usize].as_ref().is_some_and(|e| e.key.as_slice() == *k)) {
                *o = self.find_hashed(k, h);
            }
        }
        out
    }

    fn find_hashed(&self, key: &[u8], h: u64) -> Option<EntryId> {
        self.index.find(h, |id| self.slab[id as usize].as_ref().is_some_and(|e| e.key.as_slice() == key))
    }

    fn entry(&mut self, id: EntryId) -> &mut Entry {
        self.slab[id as usize].as_mut().expect("live entry id")
    }

    /// The entry of reservation `res` and whether it is already committed.
    fn reservation(&self, res: u64) -> Option<(EntryId, bool)> {
        let id = res as u32;
        match self.slab.get(id as usize) {
            Some(Some(e)) if e.res_id(id) == res => Some((id, e.committed)),
            _ => None,
        }
    }

    fn tenant_id(&mut self, name: &str) -> u32 {
        if let Some(&t) = self.tenant_ids.get(name) {
            return t;
        }
        let t = self.tenants.len() as u32;
        self.tenants.push(Tenant { name: name.to_owned(), bytes: 0, keys: 0 });
        self.tenant_ids.insert(name.to_owned(), t);
        t
    }

    fn insert(&mut self, e: Entry) -> EntryId {
        let h = self.hasher.hash_one(e.key.as_slice());
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.slab[id as usize] = Some(e);
                id
            }
            None => {
                self.slab.push(Some(e));
                (self.slab.len() - 1) as EntryId
            }
        };
        self.index.insert(h, id);
        id
    }

    /// Unlink an entry everywhere and return its location.
    fn remove(&mut self, id: EntryId) -> Location {
        let e = self.slab[id as usize].take().expect("live entry id");
        let h = self.hasher.hash_one(e.key.as_slice());
        self.index.remove(h, id);
        self.free_ids.push(id);
        if e.committed {
            self.policy.remove(e.node, id, h);
            self.keys -= 1;
            self.bytes -= e.length();
            let t = &mut self.tenants[e.tenant as usize];
            t.bytes -= e.length();
            t.keys -= 1;
        } else {
            self.reserved -= 1;
        }
        if e.locked {
            self.locks.remove(&id);
        }
        e.loc()
    }

    /// Live lock count of `id` (0 when unlocked or expired).
    fn lock_count(&self, id: EntryId, now: u64) -> u32 {
        match self.slab[id as usize].as_ref() {
            Some(e) if e.locked => self.locks.get(&id).filter(|l| l.expiry > now).map_or(0, |l| l.count),
            _ => 0,
        }
    }

    /// Remove a committed entry and log it for `removed_since`.
    fn remove_logged(&mut self, id: EntryId, evicted: bool) -> Location {
        let e = self.slab[id as usize].as_ref().expect("live entry id");
        let (key, tenant): (Box<[u8]>, u32) = (e.key.as_slice().into(), e.tenant);
        let loc = self.remove(id);
        if self.removed.len() == REMOVED_LOG {
            self.removed.pop_front();
        }
        self.removed.push_back((self.removed_next, key, tenant, loc.length, evicted));
        self.removed_next += 1;
        loc
    }

    /// Drop an expired lock so the entry is unprotected again.
    fn clear_expired_lock(&mut self, id: EntryId, now: u64) {
        if !self.entry(id).locked {
            return;
        }
        if self.locks.get(&id).is_none_or(|l| l.expiry <= now) {
            self.locks.remove(&id);
            self.entry(id).locked = false;
            self.locks_expired += 1;
            let node = self.entry(id).node;
            self.policy.release(node, id);
        }
    }
}

impl Registry for LocalRegistry {
    fn policy_name(&self) -> &'static str {
        self.policy_name
    }

    fn present(&self, keys: &[&[u8]]) -> Vec<bool> {
        let g = self.lock();
        keys.iter().map(|k| g.find(k).is_some()).collect()
    }

    fn exists(&self, keys: &[&[u8]]) -> Vec<bool> {
        let g = self.lock();
        keys.iter().map(|k| g.find(k).is_some_and(|id| g.slab[id as usize].as_ref().unwrap().committed)).collect()
    }

    fn reserve(&self, tenant: &str, items: Vec<(Vec<u8>, Location)>, deadline: u64) -> Vec<Result<u64>> {
        let mut g = self.lock();
        let t = g.tenant_id(tenant);
        items
            .into_iter()
            .map(|(key, loc)| {
                if let Some(id) = g.find(&key) {
                    let what = if g.entry(id).committed { "is already stored" } else { "is being written" };
                    return Err(Error::new(ErrorKind::AlreadyExists, format!("key {what}")));
                }
                let seq = g.next_seq;
                g.next_seq = g.next_seq.wrapping_add(1).max(1);
                let id = g.insert(Entry::new(&key, loc, t, seq)?);
                let res_id = g.entry(id).res_id(id);
                g.reserved += 1;
                g.deadlines.push_back((deadline, res_id));
                Ok(res_id)
            })
            .collect()
    }

    fn commit(&self, ids: &[u64], _now: u64) -> (Vec<Result<Location>>, u64) {
        let mut g = self.lock();
        let out = ids
            .iter()
            .map(|res| {
                let id = match g.reservation(*res) {
                    Some((id, false)) => id,
                    Some((_, true)) => {
                        return Err(Error::precondition(format!("reservation {res} is already committed")))
                    }
                    None => {
                        return Err(Error::new(
                            ErrorKind::NotFound,
                            format!("no reservation {res} (unknown, aborted or expired)"),
                        ))
                    }
                };
                g.reserved -= 1;
                let e = g.entry(id);
                e.committed = true;
                let (loc, t) = (e.loc(), e.tenant);
                g.keys += 1;
                g.bytes += loc.length;
                let tn = &mut g.tenants[t as usize];
                tn.bytes += loc.length;
                tn.keys += 1;
                let hash = g.hasher.hash_one(g.slab[id as usize].as_ref().expect("live entry id").key.as_slice());
                g.policy.insert(loc.node, id, Obj { size: loc.length, hash });
                Ok(loc)
            })
            .collect();
        (out, g.removed_next)
    }

    fn abort(&self, ids: &[u64]) -> Vec<Result<Location>> {
        let mut g = self.lock();
        ids.iter()
            .map(|res| match g.reservation(*res) {
                Some((id, false)) => Ok(g.remove(id)),
                Some((_, true)) => Err(Error::precondition(format!("reservation {res} is already committed"))),
                None => Err(Error::new(ErrorKind::NotFound, format!("no open reservation {res}"))),
            })
            .collect()
    }

    fn lookup_and_lock(&self, keys: &[&[u8]], ttl_ms: u64, now: u64) -> Vec<Option<Location>> {
        let mut g = self.lock();
        let expiry = now + ttl_ms;
        let ids = g.find_many(keys, true);
        // The LRU neighbours' loads overlap the lock bookkeeping below.
        for id in ids.iter().flatten() {
            g.policy.prefetch_neighbours(*id);
        }
        ids.into_iter()
            .map(|id| {
                let id = id?;
                if !g.entry(id).committed {
                    return None;
                }
                g.clear_expired_lock(id, now);
                let e = g.entry(id);
                e.locked = true;
                let (loc, node) = (e.loc(), e.node);
                let l = g.locks.entry(id).or_insert(LockState { count: 0, expiry: 0 });
                l.count += 1;
                l.expiry = l.expiry.max(expiry);
                let first = l.count == 1;
                g.policy.touch(node, id);
                if first {
                    g.policy.hold(node, id);
                }
                Some(loc)
            })
            .collect()
    }

    fn unlock(&self, keys: &[&[u8]], now: u64) -> Vec<Result<()>> {
        let mut g = self.lock();
        let ids = g.find_many(keys, false);
        ids.into_iter()
            .map(|id| {
                let id = id.ok_or_else(|| Error::new(ErrorKind::NotFound, "unknown key"))?;
                g.clear_expired_lock(id, now);
                if !g.entry(id).locked {
                    return Err(Error::precondition("key is not locked"));
                }
                let l = g.locks.get_mut(&id).expect("locked entries have a lock row");
                l.count -= 1;
                if l.count == 0 {
                    g.locks.remove(&id);
                    g.entry(id).locked = false;
                    let node = g.entry(id).node;
                    g.policy.release(node, id);
                }
                Ok(())
            })
            .collect()
    }

    fn delete(&self, keys: &[&[u8]], now: u64) -> Vec<Result<Location>> {
        let mut g = self.lock();
        keys.iter()
            .map(|k| {
                let id = g.find(k).ok_or_else(|| Error::new(ErrorKind::NotFound, "unknown key"))?;
                g.clear_expired_lock(id, now);
                let e = g.entry(id);
                if !e.committed {
                    return Err(Error::precondition("key is being written (reserved, not committed)"));
                }
                let n = g.lock_count(id, now);
                if n > 0 {
                    return Err(Error::precondition(format!("key is locked by {n} reader(s)")));
                }
                Ok(g.remove_logged(id, false))
            })
            .collect()
    }

    fn evict(&self, node: u32, pages: u64, page_size: u64, now: u64) -> Freed {
        let mut g = self.lock();
        let mut freed = vec![];
        let mut got = 0;
        let mut swept = false;
        while got < pages {
            // Locked entries are held out of the policy's order; once it
            // has no candidate left, entries whose locks expired rejoin it.
            let Some(id) = g.policy.pop_victim(node).or_else(|| {
                let stale: Vec<EntryId> = g.locks.iter().filter(|(_, l)| l.expiry <= now).map(|(&id, _)| id).collect();
                stale.into_iter().for_each(|id| g.clear_expired_lock(id, now));
                (!std::mem::replace(&mut swept, true)).then(|| g.policy.pop_victim(node)).flatten()
            }) else {
                break;
            };
            if g.entry(id).locked {
                // A lock the policy was not told about: hold it until released.
                g.policy.hold(node, id);
                continue;
            }
            let loc = g.remove_logged(id, true);
            got += pages_for(loc.length, page_size);
            g.evictions += 1;
            freed.push(loc);
        }
        freed
    }

    fn expire(&self, now: u64) -> Freed {
        let mut g = self.lock();
        let mut freed = vec![];
        while let Some(&(deadline, res)) = g.deadlines.front() {
            if deadline > now {
                break;
            }
            g.deadlines.pop_front();
            if let Some((id, false)) = g.reservation(res) {
                freed.push(g.remove(id));
                g.reservations_expired += 1;
            }
        }
        let stale: Vec<EntryId> = g.locks.iter().filter(|(_, l)| l.expiry <= now).map(|(&id, _)| id).collect();
        for id in stale {
            g.clear_expired_lock(id, now);
        }
        freed
    }

    fn list(&self, cursor: u64, limit: usize, tenant: Option<&str>) -> (Vec<KeyInfo>, u64) {
        let g = self.lock();
        let want = tenant.map(|t| g.tenant_ids.get(t).copied());
        let mut out = vec![];
        let mut i = cursor as usize;
        while i < g.slab.len() && out.len() < limit {
            if let Some(e) = &g.slab[i] {
                if e.committed && want.is_none_or(|w| w == Some(e.tenant)) {
                    out.push(KeyInfo {
                        key: e.key.as_slice().to_vec(),
                        tenant: g.tenants[e.tenant as usize].name.clone(),
                        size: e.length(),
                    });
                }
            }
            i += 1;
        }
        (out, if i < g.slab.len() { i as u64 } else { 0 })
    }

    fn removed_since(&self, since: u64, max: usize) -> (Vec<Removed>, u64, bool) {
        let g = self.lock();
        let oldest = g.removed.front().map(|r| r.0).unwrap_or(g.removed_next);
        let since = since.max(1);
        let truncated = since < oldest;
        let skip = since.saturating_sub(oldest) as usize;
        let out: Vec<Removed> = g
            .removed
            .iter()
            .skip(skip)
            .take(max)
            .map(|(seq, key, t, size, evicted)| Removed {
                seq: *seq,
                key: key.to_vec(),
                tenant: g.tenants[*t as usize].name.clone(),
                size: *size,
                evicted: *evicted,
            })
            .collect();
        let next = out.last().map(|r| r.seq + 1).unwrap_or(since.max(oldest));
        (out, next, truncated)
    }

    fn stats(&self, _now: u64) -> RegistryStats {
        let g = self.lock();
        RegistryStats {
            keys: g.keys,
            reserved: g.reserved,
            bytes_stored: g.bytes,
            locked_keys: g.locks.len() as u64,
            evictions: g.evictions,
            reservations_expired: g.reservations_expired,
            locks_expired: g.locks_expired,
            // Every tenant seen, also empty ones, so per-tenant gauges drop to 0.
            tenants: g
                .tenants
                .iter()
                .map(|t| TenantUsage { tenant: t.name.clone(), bytes: t.bytes, keys: t.keys })
                .collect(),
        }
    }
}
