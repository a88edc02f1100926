//! In-process primary registry: a slab of compact entries, an index of
//! entry ids keyed by the key bytes' hash (keys are stored once, inline when short),
//! one eviction policy (an order per node), a deadline queue for reservations and a side
//! table of locked entries.
use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex};

// foldhash with a random per-instance seed: several times faster than SipHash
// on these short keys, still not predictable by clients.
use hashbrown::{DefaultHashBuilder, HashMap};

use super::entry::{Entry, LockState};
use super::index::Index;
use super::orders::Orders;
use super::quota::{Limit, QuotaConfig};
use super::{
    pages_for, Freed, KeyInfo, Location, Registry, RegistryStats, Removal, Removed, ReserveOpts, Scope, Session,
    TenantUsage,
};
use crate::error::{Error, ErrorKind, Result};
use crate::eviction::{Obj, PolicyConfig};
use crate::ids::{EntryId, NodeId, RegionId, ReservationId};

/// How many removals the log keeps for clients catching up.
pub const REMOVED_LOG: usize = 65_536;

/// (seq, key, tenant, size, reason)
type RemovedLogEntry = (u64, Box<[u8]>, Arc<str>, u64, Removal);

struct Tenant {
    name: Arc<str>,
    bytes: u64,
    keys: u64,
    /// Payload bytes of open reservations (they count against the quota).
    reserving: u64,
    limit: Limit,
    /// Keys plus open reservations: at 0 the tenant is forgotten, so a
    /// stream of one-off tenant names cannot grow the registry.
    refs: u64,
}

/// An open (uncommitted) reservation.
struct Open {
    id: EntryId,
    owner: Session,
    server_writes: bool,
}

struct Inner {
    hasher: DefaultHashBuilder,
    slab: Vec<Option<Entry>>,
    free_ids: Vec<EntryId>,
    index: Index,
    reserved: u64,
    deadlines: VecDeque<(u64, ReservationId)>,
    /// Reservation id (64 random bits) → its entry and owner.
    open: HashMap<ReservationId, Open>,
    /// Lock state of locked entries only (swept for expiry).
    locks: HashMap<EntryId, LockState>,
    /// No lock expires before this (a lower bound): a sweep before it would
    /// find nothing, so reserve-time eviction skips it.
    lock_bound: u64,
    /// One policy; an order per node (and per tenant with quotas). Locked
    /// entries are held out of them.
    orders: Orders,
    quotas: QuotaConfig,
    /// Some tenant has a guaranteed share: node eviction checks victims.
    guarded: bool,
    tenants: Vec<Option<Tenant>>,
    free_tenants: Vec<u32>,
    tenant_ids: HashMap<Arc<str>, u32>,
    max_tenants: usize,
    removed: VecDeque<RemovedLogEntry>,
    removed_next: u64,
    keys: u64,
    bytes: u64,
    evictions: u64,
    reservations_expired: u64,
    locks_expired: u64,
    eviction_visits: u64,
    quota_evictions: u64,
}

pub struct LocalRegistry {
    policy_name: &'static str,
    policy: PolicyConfig,
    /// Some tenant has a quota: without one, `make_room` (called on every
    /// reserve) returns before taking the lock.
    quotas_on: bool,
    inner: Mutex<Inner>,
}

impl LocalRegistry {
    /// `max_tenants`: most tenants with keys or reservations at once.
    pub fn new(policy: &str, max_tenants: usize) -> Result<Self> {
        Ok(Self::with_policy(PolicyConfig::by_name(policy)?, max_tenants))
    }

    /// `new` with the policy's settings given (`[registry.eviction]`).
    pub fn with_policy(policy: PolicyConfig, max_tenants: usize) -> Self {
        let orders = Orders::new(&policy, false);
        Self {
            policy_name: orders.name(),
            policy,
            quotas_on: false,
            inner: Mutex::new(Inner {
                hasher: DefaultHashBuilder::default(),
                slab: vec![],
                free_ids: vec![],
                index: Index::default(),
                reserved: 0,
                deadlines: VecDeque::new(),
                open: HashMap::new(),
                locks: HashMap::new(),
                lock_bound: u64::MAX,
                orders,
                quotas: QuotaConfig::default(),
                guarded: false,
                tenants: vec![],
                free_tenants: vec![],
                tenant_ids: HashMap::new(),
                max_tenants,
                removed: VecDeque::new(),
                removed_next: 1,
                keys: 0,
                bytes: 0,
                evictions: 0,
                reservations_expired: 0,
                locks_expired: 0,
                eviction_visits: 0,
                quota_evictions: 0,
            }),
        }
    }

    /// Enforce `quotas` (see `quota.rs`); call before the first entry.
    pub fn with_quotas(mut self, quotas: QuotaConfig) -> Self {
        self.quotas_on = quotas.has_quotas();
        {
            let mut g = self.lock();
            assert!(g.slab.is_empty(), "quotas are set on an empty registry");
            g.orders = Orders::new(&self.policy, quotas.has_quotas());
            g.guarded = quotas.has_guarantees();
            g.quotas = quotas;
        }
        self
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
                    crate::platform::prefetch(&self.slab[id.index()]);
                    if for_touch {
                        self.orders.prefetch(id);
                    }
                }
                c
            })
            .collect();
        for ((o, k), &h) in out.iter_mut().zip(keys).zip(&hashes) {
            if !o.is_some_and(|id| self.slab[id.index()].as_ref().is_some_and(|e| e.key.as_slice() == *k)) {
                *o = self.find_hashed(k, h);
            }
        }
        out
    }

    fn find_hashed(&self, key: &[u8], h: u64) -> Option<EntryId> {
        self.index.find(h, |id| self.slab[id.index()].as_ref().is_some_and(|e| e.key.as_slice() == key))
    }

    fn entry(&mut self, id: EntryId) -> &mut Entry {
        self.slab[id.index()].as_mut().expect("live entry id")
    }

    /// The open reservation `res` of `owner`: NotFound when there is none
    /// (unknown, aborted, expired or already committed), PermissionDenied
    /// when another session made it, FailedPrecondition while the sidecar
    /// itself is writing it.
    fn open_of(&self, res: ReservationId, owner: Session) -> Result<EntryId> {
        let o = self.open.get(&res).ok_or_else(|| {
            Error::new(
                ErrorKind::NotFound,
                format!("no open reservation {res} (unknown, aborted, expired or already committed)"),
            )
        })?;
        if o.owner != owner {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                format!("reservation {res} belongs to another client"),
            ));
        }
        if o.server_writes && !owner.is_sidecar() {
            return Err(Error::precondition(format!("reservation {res} is being written by the sidecar")));
        }
        Ok(o.id)
    }

    fn new_reservation_id(&self) -> ReservationId {
        loop {
            let id = ReservationId(rand::random());
            if id.0 != 0 && !self.open.contains_key(&id) {
                return id;
            }
        }
    }

    /// The tenant's id with one more reference, or None at the tenant limit
    /// (unless `force`).
    fn tenant_ref(&mut self, name: &str, force: bool) -> Option<u32> {
        if let Some(&t) = self.tenant_ids.get(name) {
            self.tenants[t as usize].as_mut().expect("live tenant").refs += 1;
            return Some(t);
        }
        if self.tenant_ids.len() >= self.max_tenants && !force {
            return None;
        }
        let limit = self.quotas.limit(name);
        let name: Arc<str> = name.into();
        let tenant = Tenant { name: name.clone(), bytes: 0, keys: 0, reserving: 0, limit, refs: 1 };
        let t = match self.free_tenants.pop() {
            Some(t) => {
                self.tenants[t as usize] = Some(tenant);
                t
            }
            None => {
                self.tenants.push(Some(tenant));
                (self.tenants.len() - 1) as u32
            }
        };
        self.tenant_ids.insert(name, t);
        Some(t)
    }

    fn tenant_unref(&mut self, t: u32) {
        let tn = self.tenants[t as usize].as_mut().expect("live tenant");
        tn.refs -= 1;
        if tn.refs == 0 {
            let name = tn.name.clone();
            self.tenant_ids.remove(&name);
            self.tenants[t as usize] = None;
            self.free_tenants.push(t);
        }
    }

    fn tenant(&mut self, t: u32) -> &mut Tenant {
        self.tenants[t as usize].as_mut().expect("live tenant")
    }

    fn tenant_name(&self, t: u32) -> Arc<str> {
        self.tenants[t as usize].as_ref().expect("live tenant").name.clone()
    }

    fn insert(&mut self, e: Entry) -> EntryId {
        let h = self.hasher.hash_one(e.key.as_slice());
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.slab[id.index()] = Some(e);
                id
            }
            None => {
                self.slab.push(Some(e));
                EntryId((self.slab.len() - 1) as u32)
            }
        };
        self.index.insert(h, id);
        id
    }

    /// Unlink an entry everywhere and return its location.
    fn remove(&mut self, id: EntryId) -> Location {
        let e = self.slab[id.index()].take().expect("live entry id");
        let h = self.hasher.hash_one(e.key.as_slice());
        self.index.remove(h, id);
        self.free_ids.push(id);
        if e.committed {
            self.orders.remove(e.node, e.tenant, id, h);
            self.keys -= 1;
            self.bytes -= e.length();
            let t = self.tenant(e.tenant);
            t.bytes -= e.length();
            t.keys -= 1;
        } else {
            self.reserved -= 1;
            self.tenant(e.tenant).reserving -= e.length();
        }
        if e.locked {
            self.locks.remove(&id);
        }
        self.tenant_unref(e.tenant);
        e.loc()
    }

    /// Live lock count of `id` (0 when unlocked or expired).
    fn lock_count(&self, id: EntryId, now: u64) -> u32 {
        match self.slab[id.index()].as_ref() {
            Some(e) if e.locked => self.locks.get(&id).filter(|l| l.expiry > now).map_or(0, |l| l.count),
            _ => 0,
        }
    }

    /// Remove a committed entry and log it for `removed_since`.
    fn remove_logged(&mut self, id: EntryId, reason: Removal) -> Location {
        let e = self.slab[id.index()].as_ref().expect("live entry id");
        let (key, tenant): (Box<[u8]>, Arc<str>) = (e.key.as_slice().into(), self.tenant_name(e.tenant));
        let loc = self.remove(id);
        if self.removed.len() == REMOVED_LOG {
            self.removed.pop_front();
        }
        self.removed.push_back((self.removed_next, key, tenant, loc.length, reason));
        self.removed_next += 1;
        loc
    }

    /// Drop an expired lock so the entry is unprotected again.
    fn clear_expired_lock(&mut self, id: EntryId, now: u64) {
        if !self.entry(id).locked {
            return;
        }
        if self.locks.get(&id).is_none_or(|l| l.expiry <= now) {
            self.locks_expired += 1;
            self.drop_lock(id);
        }
    }

    /// The entry's last lock is gone: it is a victim candidate again.
    fn drop_lock(&mut self, id: EntryId) {
        self.locks.remove(&id);
        let e = self.entry(id);
        e.locked = false;
        let (node, tenant) = (e.node, e.tenant);
        self.orders.release(node, tenant, id);
    }

    /// Release every lock held by a session `whose` picks; entries left
    /// with none become victim candidates again. Returns the locks released.
    fn release_locks(&mut self, whose: impl Fn(Session) -> bool) -> u64 {
        let mut released = 0u64;
        let mut emptied = vec![];
        for (&id, l) in self.locks.iter_mut() {
            let gone: u32 = l.holders.iter().filter(|h| whose(h.0)).map(|h| h.1).sum();
            if gone == 0 {
                continue;
            }
            l.holders.retain(|h| !whose(h.0));
            l.count -= gone;
            released += gone as u64;
            if l.count == 0 {
                emptied.push(id);
            }
        }
        for id in emptied {
            self.drop_lock(id);
        }
        released
    }

    /// Take one more lock on a committed entry. The first one takes the entry
    /// out of the victim order, so eviction never walks over entries in use.
    fn add_lock(&mut self, id: EntryId, expiry: u64, owner: Session) {
        let e = self.entry(id);
        let first = !e.locked;
        e.locked = true;
        let (node, tenant) = (e.node, e.tenant);
        let l = self.locks.entry(id).or_insert(LockState { count: 0, expiry: 0, holders: vec![] });
        l.count += 1;
        l.expiry = l.expiry.max(expiry);
        match l.holders.iter_mut().find(|h| h.0 == owner) {
            Some(h) => h.1 += 1,
            None => l.holders.push((owner, 1)),
        }
        if first {
            self.orders.hold(node, tenant, id);
            self.lock_bound = self.lock_bound.min(expiry);
        }
    }

    /// Release every lock past its TTL (ordered by expiry, then key, so the
    /// order they re-enter eviction in is deterministic). Runs only when some
    /// lock may have expired: O(locked entries) at most once per expiry.
    fn sweep_locks(&mut self, now: u64) {
        if now < self.lock_bound {
            return;
        }
        let mut stale: Vec<(u64, EntryId)> =
            self.locks.iter().filter(|(_, l)| l.expiry <= now).map(|(&id, l)| (l.expiry, id)).collect();
        stale.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| self.key_of(a.1).cmp(self.key_of(b.1))));
        for (_, id) in stale {
            self.clear_expired_lock(id, now);
        }
        self.lock_bound = self.locks.values().map(|l| l.expiry).min().unwrap_or(u64::MAX);
    }

    /// Tenant ids `scope` allows (`None`: every tenant). Tenants that hold
    /// nothing have no id, and nothing of theirs can be found anyway.
    fn scope_ids(&self, scope: &Scope) -> Option<Vec<u32>> {
        match scope {
            Scope::All => None,
            Scope::Tenants(names) => {
                Some(names.iter().filter_map(|n| self.tenant_ids.get(n.as_str()).copied()).collect())
            }
        }
    }

    /// PermissionDenied when entry `id` belongs to a tenant outside `allowed`.
    fn check_scope(&self, id: EntryId, allowed: &Option<Vec<u32>>) -> Result<()> {
        let t = self.slab[id.index()].as_ref().expect("live entry id").tenant;
        match allowed {
            Some(ids) if !ids.contains(&t) => Err(Scope::denied("the key")),
            _ => Ok(()),
        }
    }

    /// Whether evicting committed entry `id` for `requester`'s store would
    /// leave another tenant below its guaranteed share.
    fn spares(&self, id: EntryId, requester: Option<u32>) -> bool {
        let e = self.slab[id.index()].as_ref().expect("live entry id");
        if Some(e.tenant) == requester {
            return false;
        }
        let t = self.tenants[e.tenant as usize].as_ref().expect("live tenant");
        t.limit.spares(t.bytes + t.reserving, e.length())
    }

    fn key_of(&self, id: EntryId) -> &[u8] {
        self.slab[id.index()].as_ref().expect("live entry id").key.as_slice()
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

    fn exists_in(&self, keys: &[&[u8]], scope: &Scope) -> Vec<bool> {
        let g = self.lock();
        let allowed = g.scope_ids(scope);
        keys.iter()
            .map(|k| {
                g.find(k).is_some_and(|id| {
                    g.slab[id.index()].as_ref().unwrap().committed && g.check_scope(id, &allowed).is_ok()
                })
            })
            .collect()
    }

    fn reserve(&self, tenant: &str, items: Vec<(Vec<u8>, Location)>, opts: ReserveOpts) -> Vec<Result<ReservationId>> {
        let mut g = self.lock();
        items
            .into_iter()
            .map(|(key, loc)| {
                if let Some(id) = g.find(&key) {
                    let what = if g.entry(id).committed { "is already stored" } else { "is being written" };
                    return Err(Error::new(ErrorKind::AlreadyExists, format!("key {what}")));
                }
                let Some(t) = g.tenant_ref(tenant, false) else {
                    return Err(Error::new(
                        ErrorKind::ResourceExhausted,
                        format!("tenant limit reached: {} tenants hold keys or reservations", g.max_tenants),
                    ));
                };
                let tn = g.tenant(t);
                if !tn.limit.admits(tn.bytes + tn.reserving, loc.length) {
                    let (used, quota) = (tn.bytes + tn.reserving, tn.limit.quota);
                    g.tenant_unref(t);
                    return Err(Error::new(
                        ErrorKind::ResourceExhausted,
                        format!(
                            "tenant {tenant:?} is at its quota: {used} of {quota} bytes in use and nothing more \
                             of its own can be evicted now; this object needs {}",
                            loc.length
                        ),
                    ));
                }
                tn.reserving += loc.length;
                let entry = Entry::new(&key, loc, t).inspect_err(|_| {
                    g.tenant(t).reserving -= loc.length;
                    g.tenant_unref(t);
                })?;
                let id = g.insert(entry);
                let res = g.new_reservation_id();
                g.open.insert(res, Open { id, owner: opts.owner, server_writes: opts.server_writes });
                g.reserved += 1;
                g.deadlines.push_back((opts.deadline, res));
                Ok(res)
            })
            .collect()
    }

    fn commit(
        &self,
        ids: &[ReservationId],
        owner: Session,
        publish: &mut dyn FnMut(usize, &Location),
    ) -> (Vec<Result<Location>>, u64) {
        let mut g = self.lock();
        let out = ids
            .iter()
            .enumerate()
            .map(|(i, res)| {
                let id = g.open_of(*res, owner)?;
                g.open.remove(res);
                g.reserved -= 1;
                let e = g.entry(id);
                let (loc, t) = (e.loc(), e.tenant);
                publish(i, &loc);
                g.entry(id).committed = true;
                g.keys += 1;
                g.bytes += loc.length;
                let tn = g.tenant(t);
                tn.reserving -= loc.length;
                tn.bytes += loc.length;
                tn.keys += 1;
                let hash = g.hasher.hash_one(g.slab[id.index()].as_ref().expect("live entry id").key.as_slice());
                g.orders.insert(loc.node, t, id, Obj { size: loc.length, hash });
                Ok(loc)
            })
            .collect();
        (out, g.removed_next)
    }

    fn restore(&self, items: Vec<(Vec<u8>, String, Location)>) -> usize {
        let mut g = self.lock();
        let mut added = 0;
        for (key, tenant, loc) in items {
            if g.find(&key).is_some() {
                continue;
            }
            let t = g.tenant_ref(&tenant, true).expect("forced");
            let Ok(mut e) = Entry::new(&key, loc, t) else {
                g.tenant_unref(t);
                continue;
            };
            e.committed = true;
            let id = g.insert(e);
            g.keys += 1;
            g.bytes += loc.length;
            let tn = g.tenant(t);
            tn.bytes += loc.length;
            tn.keys += 1;
            let hash = g.hasher.hash_one(key.as_slice());
            g.orders.insert(loc.node, t, id, Obj { size: loc.length, hash });
            added += 1;
        }
        added
    }

    fn abort(&self, ids: &[ReservationId], owner: Session) -> Vec<Result<Location>> {
        let mut g = self.lock();
        ids.iter()
            .map(|res| {
                let id = g.open_of(*res, owner)?;
                g.open.remove(res);
                Ok(g.remove(id))
            })
            .collect()
    }

    fn lookup_and_lock_in(
        &self,
        keys: &[&[u8]],
        ttl_ms: u64,
        now: u64,
        owner: Session,
        scope: &Scope,
    ) -> Vec<Result<Option<Location>>> {
        let mut g = self.lock();
        let allowed = g.scope_ids(scope);
        let expiry = now + ttl_ms;
        let ids = g.find_many(keys, true);
        // The LRU neighbours' loads overlap the lock bookkeeping below.
        for id in ids.iter().flatten() {
            g.orders.prefetch_neighbours(*id);
        }
        ids.into_iter()
            .map(|id| {
                let Some(id) = id else { return Ok(None) };
                if !g.entry(id).committed {
                    return Ok(None);
                }
                g.check_scope(id, &allowed)?;
                g.clear_expired_lock(id, now);
                let e = g.entry(id);
                let (loc, node, tenant) = (e.loc(), e.node, e.tenant);
                // Every read counts (frequency-based policies); the first lock
                // then takes the entry out of the victim order.
                g.orders.touch(node, tenant, id);
                g.add_lock(id, expiry, owner);
                Ok(Some(loc))
            })
            .collect()
    }

    fn unlock_as(&self, keys: &[&[u8]], now: u64, owner: Session) -> Vec<Result<()>> {
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
                let Some(h) = l.holders.iter().position(|h| h.0 == owner) else {
                    return Err(Error::new(ErrorKind::PermissionDenied, "the key's locks belong to other clients"));
                };
                l.holders[h].1 -= 1;
                if l.holders[h].1 == 0 {
                    l.holders.swap_remove(h);
                }
                l.count -= 1;
                if l.count == 0 {
                    g.drop_lock(id);
                }
                Ok(())
            })
            .collect()
    }

    fn release_session(&self, owner: Session) -> u64 {
        self.lock().release_locks(|s| s == owner)
    }

    fn release_node(&self, node_bits: u32) -> (u64, Freed) {
        let mut g = self.lock();
        let released = g.release_locks(|s| s.node_bits() == node_bits);
        let dead: Vec<ReservationId> =
            g.open.iter().filter(|(_, o)| o.owner.node_bits() == node_bits).map(|(r, _)| *r).collect();
        let mut freed = vec![];
        for res in dead {
            let o = g.open.remove(&res).expect("listed above");
            freed.push(g.remove(o.id));
        }
        (released, freed)
    }

    fn live_of(&self, node: NodeId) -> Vec<Location> {
        let g = self.lock();
        g.slab.iter().flatten().filter(|e| e.committed && e.node == node).map(|e| e.loc()).collect()
    }

    fn region_usage(&self, now: u64) -> Vec<(RegionId, u64, bool)> {
        let g = self.lock();
        let mut by: HashMap<RegionId, (u64, bool)> = HashMap::new();
        for (id, e) in g.slab.iter().enumerate() {
            let Some(e) = e else { continue };
            let u = by.entry(e.loc().region).or_default();
            let busy = !e.committed || g.lock_count(EntryId(id as u32), now) > 0;
            u.0 += e.committed as u64;
            u.1 |= busy;
        }
        let mut v: Vec<_> = by.into_iter().map(|(r, (n, busy))| (r, n, busy)).collect();
        v.sort_unstable();
        v
    }

    fn reclaim_region(&self, region: RegionId, now: u64) -> Result<Vec<Location>> {
        let mut g = self.lock();
        let ids: Vec<EntryId> = g
            .slab
            .iter()
            .enumerate()
            .filter(|(_, e)| e.as_ref().is_some_and(|e| e.loc().region == region))
            .map(|(i, _)| EntryId(i as u32))
            .collect();
        for &id in &ids {
            g.clear_expired_lock(id, now);
            if !g.entry(id).committed || g.lock_count(id, now) > 0 {
                return Err(Error::precondition(format!("region {region} holds a lock or an open reservation")));
            }
        }
        Ok(ids.into_iter().map(|id| g.remove_logged(id, Removal::Reclaimed)).collect())
    }

    fn delete_in(&self, keys: &[&[u8]], now: u64, scope: &Scope) -> Vec<Result<Location>> {
        let mut g = self.lock();
        let allowed = g.scope_ids(scope);
        keys.iter()
            .map(|k| {
                let id = g.find(k).ok_or_else(|| Error::new(ErrorKind::NotFound, "unknown key"))?;
                g.check_scope(id, &allowed)?;
                g.clear_expired_lock(id, now);
                let e = g.entry(id);
                if !e.committed {
                    return Err(Error::precondition("key is being written (reserved, not committed)"));
                }
                let n = g.lock_count(id, now);
                if n > 0 {
                    return Err(Error::precondition(format!("key is locked by {n} reader(s)")));
                }
                Ok(g.remove_logged(id, Removal::Deleted))
            })
            .collect()
    }

    fn evict_for(&self, tenant: Option<&str>, node: NodeId, pages: u64, page_size: u64, now: u64) -> Freed {
        let mut g = self.lock();
        g.sweep_locks(now);
        let requester = if g.guarded { tenant.and_then(|t| g.tenant_ids.get(t).copied()) } else { None };
        let mut freed = vec![];
        let mut spared = vec![];
        let mut got = 0;
        while got < pages {
            // Locked and reserved entries are held out of the order: every
            // entry taken here is evicted, unless a guaranteed share spares it.
            let Some(id) = g.orders.pop_node(node) else { break };
            g.eviction_visits += 1;
            debug_assert!(!g.entry(id).locked && g.entry(id).committed);
            if g.guarded && g.spares(id, requester) {
                spared.push(id);
                continue;
            }
            let loc = g.remove_logged(id, Removal::Evicted);
            got += pages_for(loc.length, page_size);
            g.evictions += 1;
            freed.push(loc);
        }
        for id in spared {
            g.orders.put_back(node, id);
        }
        freed
    }

    fn make_room(&self, tenant: &str, bytes: u64, now: u64) -> Freed {
        if !self.quotas_on {
            return vec![];
        }
        let mut g = self.lock();
        let Some(&t) = g.tenant_ids.get(tenant) else { return vec![] };
        let tn = g.tenant(t);
        let (limit, used) = (tn.limit, tn.bytes + tn.reserving);
        // Nothing to do under the quota; nothing helps what exceeds it whole.
        if limit.admits(used, bytes) || !limit.admits(0, bytes) {
            return vec![];
        }
        let mut need = used + bytes - limit.quota;
        g.sweep_locks(now);
        let mut freed = vec![];
        // Its own victims only: the tenant's order holds nothing else. (The
        // tenant is forgotten with its last entry: read nothing of it here.)
        while need > 0 {
            let Some(id) = g.orders.pop_tenant(t) else { break };
            g.eviction_visits += 1;
            let loc = g.remove_logged(id, Removal::Evicted);
            need = need.saturating_sub(loc.length);
            g.evictions += 1;
            g.quota_evictions += 1;
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
            match g.open.get(&res) {
                // The sidecar's own writer aborts it when its stream times out
                // at the same deadline; freeing the pages under it could let
                // another key's bytes be overwritten.
                Some(o) if o.server_writes => {}
                Some(o) => {
                    let id = o.id;
                    g.open.remove(&res);
                    freed.push(g.remove(id));
                    g.reservations_expired += 1;
                }
                None => {}
            }
        }
        g.sweep_locks(now);
        freed
    }

    fn list_in(&self, cursor: u64, limit: usize, tenant: Option<&str>, scope: &Scope) -> (Vec<KeyInfo>, u64) {
        let g = self.lock();
        let allowed = g.scope_ids(scope);
        let want = tenant.map(|t| g.tenant_ids.get(t).copied());
        if want == Some(None) {
            return (vec![], 0); // no such tenant: nothing to page through
        }
        let mut out = vec![];
        let mut i = cursor as usize;
        while i < g.slab.len() && out.len() < limit {
            if let Some(e) = &g.slab[i] {
                let visible = allowed.as_ref().is_none_or(|a| a.contains(&e.tenant));
                if e.committed && visible && want.is_none_or(|w| w == Some(e.tenant)) {
                    out.push(KeyInfo {
                        key: e.key.as_slice().to_vec(),
                        tenant: g.tenant_name(e.tenant).to_string(),
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
            .map(|(seq, key, t, size, reason)| Removed {
                seq: *seq,
                key: key.to_vec(),
                tenant: t.to_string(),
                size: *size,
                reason: *reason,
            })
            .collect();
        let next = out.last().map(|r| r.seq + 1).unwrap_or(since.max(oldest));
        (out, next, truncated)
    }

    fn stats(&self) -> RegistryStats {
        let g = self.lock();
        RegistryStats {
            keys: g.keys,
            reserved: g.reserved,
            bytes_stored: g.bytes,
            locked_keys: g.locks.len() as u64,
            evictions: g.evictions,
            reservations_expired: g.reservations_expired,
            locks_expired: g.locks_expired,
            eviction_visits: g.eviction_visits,
            quota_evictions: g.quota_evictions,
            tenants: g
                .tenants
                .iter()
                .flatten()
                .map(|t| TenantUsage {
                    tenant: t.name.to_string(),
                    bytes: t.bytes,
                    keys: t.keys,
                    reserving_bytes: t.reserving,
                    quota_bytes: t.limit.quota,
                    guaranteed_bytes: t.limit.guaranteed,
                })
                .collect(),
        }
    }
}
