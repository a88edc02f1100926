//! In-process primary registry: a slab of compact entries, an index of
//! entry ids keyed by the key bytes' hash (keys are stored once, inline when short),
//! one eviction policy (an order per node), a deadline queue for reservations and a side
//! table of locked entries. That state and the steps on it are `inner.rs`;
//! this file is the registry's calls, each one pass under the one lock.
use std::hash::BuildHasher;
use std::sync::Mutex;

use super::admission::{Admission, AdmissionConfig, Run};
use super::entry::Entry;
use super::inner::{Inner, Open};
use super::orders::Orders;
use super::quota::QuotaConfig;
use super::{
    pages_for, Admit, Freed, KeyInfo, Location, RegistryStats, Removal, Removed, ReserveOpts, Scope, Session,
    TenantUsage,
};
use crate::error::{Error, ErrorKind, Result};
use crate::eviction::{Obj, PolicyConfig};
use crate::ids::{EntryId, NodeId, RegionId, ReservationId};

pub use super::inner::REMOVED_LOG;

/// How many commit sequences one write of the high-water mark covers.
const SEQ_BLOCK: u64 = 1 << 20;

/// How long past its deadline a reservation the sidecar writes itself
/// (inline put) is kept: its writer stops at the deadline, and a writer
/// whose abort never arrived (its node lost the primary) must not leave the
/// key "being written" for ever.
pub const SERVER_WRITE_GRACE_MS: u64 = 5_000;

/// How far past a durable lock's expiry the pool's view-lock mark is set:
/// renewals within it write nothing.
pub const LOCK_MARK_STEP_MS: u64 = 1_000;

pub struct LocalRegistry {
    policy_name: &'static str,
    policy: PolicyConfig,
    /// Some tenant has a quota: without one, `make_room` (called on every
    /// reserve) returns before taking the lock.
    quotas_on: bool,
    /// Where the commit sequences' high-water mark is kept (a cluster's
    /// primary: in the pool, so a later primary never hands out one of
    /// them again). None: sequences need only be unique in this process's
    /// life and above those found at start.
    seq_store: Option<std::sync::Arc<dyn super::SeqStore>>,
    /// Where the view-lock mark is kept (in the pool), if anywhere.
    lock_mark: Option<std::sync::Arc<dyn super::LockMark>>,
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
            seq_store: None,
            lock_mark: None,
            inner: Mutex::new(Inner::new(orders, max_tenants)),
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

    /// Judge stores by `admission` (see `admission.rs`; off unless set).
    /// Call before the first entry.
    pub fn with_admission(self, admission: AdmissionConfig) -> Self {
        {
            let mut g = self.lock();
            assert!(g.slab.is_empty(), "admission is set on an empty registry");
            g.admission = Admission::new(admission, &self.policy);
        }
        self
    }

    /// Hash keys with a fixed seed instead of a random one, so the same
    /// calls make the same choices run after run (ghost histories and the
    /// index follow the hash): for replays of traces, never for a server,
    /// whose clients could then aim keys at one slot. Call before the
    /// first entry.
    pub fn with_fixed_hashing(self) -> Self {
        {
            let mut g = self.lock();
            assert!(g.slab.is_empty(), "hashing is fixed on an empty registry");
            g.hasher = foldhash::fast::SeedableRandomState::fixed();
        }
        self
    }

    /// Keep the commit sequences' high-water mark in `store`, starting
    /// above `floor` (the highest sequence found in the pool, and the mark
    /// a previous primary left), and number the removal log from a random
    /// base, so a consumer's cursor from another instance's log is noticed.
    /// Call before the first entry.
    pub fn with_seq_store(mut self, store: std::sync::Arc<dyn super::SeqStore>, floor: u64) -> Self {
        {
            let mut g = self.lock();
            assert!(g.slab.is_empty(), "the sequence store is set on an empty registry");
            g.seq_next = floor + 1;
            g.seq_limit = floor + 1;
            g.removed_base = rand::random::<u64>() >> 2 | 1;
            g.removed_next = g.removed_base;
        }
        self.seq_store = Some(store);
        self
    }

    /// The next commit sequence, extending the high-water mark in the pool
    /// first when it runs out (once per `SEQ_BLOCK`).
    fn next_seq(&self, g: &mut Inner) -> Result<u64> {
        if g.seq_next >= g.seq_limit {
            if let Some(store) = &self.seq_store {
                let limit = g.seq_next + SEQ_BLOCK;
                store.keep_below(limit)?;
                g.seq_limit = limit;
            } else {
                g.seq_limit = u64::MAX;
            }
        }
        g.seq_next += 1;
        Ok(g.seq_next - 1)
    }

    /// Keep the view-lock mark in `mark`: before a durable session's lock
    /// would outlast what it records, it is raised (by `LOCK_MARK_STEP_MS`
    /// beyond the lock, so one write covers a while of renewals).
    pub fn with_lock_mark(mut self, mark: std::sync::Arc<dyn super::LockMark>) -> Self {
        self.lock_mark = Some(mark);
        self
    }

    /// Make sure the pool's mark covers a durable lock until `expiry`
    /// (registry ms; `now` likewise); an error refuses the lock.
    fn cover(&self, g: &mut Inner, expiry: u64, now: u64) -> Result<()> {
        let Some(mark) = &self.lock_mark else { return Ok(()) };
        if expiry <= g.marked_until {
            return Ok(());
        }
        let until = expiry + LOCK_MARK_STEP_MS;
        mark.cover(crate::platform::now_unix_ms() + (until - now)).map_err(|e| {
            Error::new(
                ErrorKind::Unavailable,
                format!("cannot record the view lock in the pool, so none is taken: {e}"),
            )
        })?;
        g.marked_until = until;
        Ok(())
    }

    /// Announce every key that becomes visible or leaves to `sink` (the
    /// pool's event stream). Call before the first entry.
    pub fn with_events(self, sink: std::sync::Arc<crate::events::EventSink>) -> Self {
        self.lock().events = Some(sink);
        self
    }

    /// The event sink commits and removals are announced to, if any.
    pub fn events(&self) -> Option<std::sync::Arc<crate::events::EventSink>> {
        self.lock().events.clone()
    }

    /// Bytes one client session may hold locked plus reserved (see
    /// `[registry] max_client_pinned_bytes`); unbounded unless set.
    pub fn with_pin_limit(self, bytes: u64) -> Self {
        self.lock().pin_limit = bytes;
        self
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl LocalRegistry {
    pub fn policy_name(&self) -> &'static str {
        self.policy_name
    }

    /// Committed or being written (a reserve of these would report "exists").
    pub fn present(&self, keys: &[&[u8]]) -> Vec<bool> {
        let g = self.lock();
        keys.iter().map(|k| g.find(k).is_some()).collect()
    }

    /// Per key to store (with its size), one store's batch in its order:
    /// present (committed or being written), or admitted or refused by
    /// admission. Each judgement is a touch the admission remembers: ask
    /// once per store.
    pub fn admit(&self, items: &[(&[u8], u64)]) -> Vec<Admit> {
        self.admit_run(items, &mut Run::default())
    }

    /// `admit` for a part of a batch (`run`: what the parts before it left).
    pub fn admit_run(&self, items: &[(&[u8], u64)], run: &mut Run) -> Vec<Admit> {
        let mut g = self.lock();
        let live = g.keys as usize;
        items
            .iter()
            .map(|&(k, size)| {
                let h = g.hasher.hash_one(k);
                if g.find_hashed(k, h).is_some() {
                    Admit::Present
                } else if g.admission.judge(h, size, live, run) {
                    Admit::Admitted
                } else {
                    Admit::Refused
                }
            })
            .collect()
    }

    /// Committed keys of `scope`'s tenants (another tenant's key is false).
    pub fn exists_in(&self, keys: &[&[u8]], scope: &Scope) -> Vec<bool> {
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

    /// As `reserve`, with each reservation's commit sequence: the order of
    /// a key's versions pool-wide (a key is reserved again only after its
    /// previous version left the registry, so a later version always has a
    /// larger sequence). The writer records it in the object's record; a
    /// rebuild that finds two committed records of one key keeps the larger.
    pub fn reserve_seq(
        &self,
        tenant: &str,
        items: Vec<(Vec<u8>, Location)>,
        opts: ReserveOpts,
    ) -> Vec<Result<(ReservationId, u64)>> {
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
                if let Err(e) = g.check_pin(opts.owner, loc.length) {
                    g.tenant_unref(t);
                    return Err(e);
                }
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
                let seq = self.next_seq(&mut g).inspect_err(|_| {
                    g.tenant(t).reserving -= loc.length;
                    g.tenant_unref(t);
                })?;
                let id = g.insert(entry);
                let res = g.new_reservation_id();
                let open =
                    Open { id, owner: opts.owner, server_writes: opts.server_writes, deadline: opts.deadline, seq };
                g.open.insert(res, open);
                g.pin(opts.owner, loc.length);
                g.reserved += 1;
                g.deadlines.push_back((opts.deadline, res));
                Ok((res, seq))
            })
            .collect()
    }

    /// Publish reservations of `owner` (PermissionDenied for another
    /// session's). `publish` runs for each one just before it becomes
    /// visible, under the registry's lock, while its pages are still the
    /// reservation's: it must be short. Also returns the removal log's next
    /// seq, read atomically with the commits.
    pub fn commit(
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
                let seq = g.close_reservation(*res).map_or(0, |o| o.seq);
                g.reserved -= 1;
                let e = g.entry(id);
                let (loc, t) = (e.loc(), e.tenant);
                publish(i, &loc);
                g.mark_committed(id);
                g.keys += 1;
                g.bytes += loc.length;
                let tn = g.tenant(t);
                tn.reserving -= loc.length;
                tn.bytes += loc.length;
                tn.keys += 1;
                let hash = g.hasher.hash_one(g.slab[id.index()].as_ref().expect("live entry id").key.as_slice());
                g.orders.insert(loc.node, t, id, Obj { size: loc.length, hash });
                g.announce_stored(id, seq);
                Ok(loc)
            })
            .collect();
        (out, g.removed_next)
    }

    /// Hand out commit sequences above `floor` only (the largest a rebuild
    /// found in the pool).
    pub fn raise_seq(&self, floor: u64) {
        let mut g = self.lock();
        g.seq_next = g.seq_next.max(floor + 1);
    }

    /// Drop reservations of `owner`; the freed locations are returned per id.
    pub fn abort(&self, ids: &[ReservationId], owner: Session) -> Vec<Result<Location>> {
        let mut g = self.lock();
        ids.iter()
            .map(|res| {
                let id = g.open_of(*res, owner)?;
                g.close_reservation(*res);
                Ok(g.remove(id))
            })
            .collect()
    }

    /// As `lookup_and_lock_as`, for keys of `scope`'s tenants: another
    /// tenant's key gets PermissionDenied and is neither locked nor touched.
    pub fn lookup_and_lock_in(
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
        let (ids, hashes) = g.find_many_hashed(keys, true);
        // The LRU neighbours' loads overlap the lock bookkeeping below.
        for id in ids.iter().flatten() {
            g.orders.prefetch_neighbours(*id);
        }
        let judged = g.admission.is_on();
        ids.into_iter()
            .zip(hashes)
            .map(|(id, h)| {
                let Some(id) = id.filter(|&id| g.entry(id).committed) else {
                    if judged {
                        g.admission_saw(h, None);
                    }
                    return Ok(None);
                };
                g.check_scope(id, &allowed)?;
                g.clear_expired_lock(id, now);
                let e = g.entry(id);
                let (loc, node, tenant) = (e.loc(), e.node, e.tenant);
                // A client's first lock on the key counts its bytes.
                let holds = g.locks.get(&id).is_some_and(|l| l.holders.iter().any(|h| h.0 == owner));
                if !holds {
                    g.check_pin(owner, loc.length)?;
                }
                // Every read counts (frequency-based policies); the first lock
                // then takes the entry out of the victim order.
                if owner.is_durable() {
                    self.cover(&mut g, expiry, now)?;
                }
                g.orders.touch(node, tenant, id);
                if judged {
                    g.admission_saw(h, Some(id));
                }
                g.add_lock(id, expiry, owner);
                Ok(Some(loc))
            })
            .collect()
    }

    /// The tenant of each committed key (None: unknown or being written).
    pub fn tenants_of(&self, keys: &[&[u8]]) -> Vec<Option<String>> {
        let g = self.lock();
        keys.iter()
            .map(|k| {
                let id = g.find(k)?;
                let e = g.slab[id.index()].as_ref()?;
                e.committed.then(|| g.tenant_name(e.tenant).to_string())
            })
            .collect()
    }

    /// Count `uses[i]` reads of committed `keys[i]` that were answered
    /// elsewhere (a follower's node-held keys) in the eviction order, as
    /// that many lookups would have; unknown keys are skipped. O(Σ uses).
    pub fn touch(&self, keys: &[&[u8]], uses: &[u32]) {
        let mut g = self.lock();
        for (k, &n) in keys.iter().zip(uses) {
            let Some(id) = g.find(k) else { continue };
            let e = g.entry(id);
            if !e.committed {
                continue;
            }
            let (node, tenant) = (e.node, e.tenant);
            // Frequency policies saturate long before this; it bounds the
            // cost of one release.
            for _ in 0..n.min(16) {
                g.orders.touch(node, tenant, id);
                if g.admission.is_on() {
                    let h = g.hasher.hash_one(k);
                    g.admission_saw(h, Some(id));
                }
            }
        }
    }

    /// Release one of `owner`'s locks per key: PermissionDenied (and nothing
    /// released) when only other sessions hold the key's locks.
    pub fn unlock_as(&self, keys: &[&[u8]], now: u64, owner: Session) -> Vec<Result<()>> {
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
                let last_of_owner = l.holders[h].1 == 0;
                if last_of_owner {
                    l.holders.swap_remove(h);
                }
                l.count -= 1;
                let none_left = l.count == 0;
                if last_of_owner {
                    let len = g.entry(id).length();
                    g.unpin(owner, len);
                }
                if none_left {
                    g.drop_lock(id);
                }
                Ok(())
            })
            .collect()
    }

    /// `owner` is gone (its connection closed): release every lock it holds.
    /// Its readers may still be copying; the version check makes any copy
    /// the eviction then spoils a miss. Returns the locks released.
    pub fn release_session(&self, owner: Session) -> u64 {
        self.lock().release_locks(|s| s == owner)
    }

    /// Node `node_bits` is dead (cluster): release every lock its sessions
    /// hold and drop their open reservations (returned with their
    /// deadlines: their pages belong to that node, which frees them when it
    /// joins again, and their writers, still alive, may copy into them
    /// until the deadline).
    pub fn release_node(&self, node_bits: u32) -> (u64, Vec<(Location, u64)>) {
        let mut g = self.lock();
        // Durable sessions' locks stay: a client of the node may still read
        // views of them until they lapse (their TTL bounds them).
        let released = g.release_locks(|s| s.node_bits() == node_bits && !s.is_durable());
        let dead: Vec<ReservationId> =
            g.open.iter().filter(|(_, o)| o.owner.node_bits() == node_bits).map(|(r, _)| *r).collect();
        let mut freed = vec![];
        for res in dead {
            let o = g.close_reservation(res).expect("listed above");
            freed.push((g.remove(o.id), o.deadline));
        }
        (released, freed)
    }

    /// Committed entries whose bytes are in `node`'s regions.
    pub fn live_of(&self, node: NodeId) -> Vec<Location> {
        let g = self.lock();
        g.slab.iter().flatten().filter(|e| e.committed && e.node == node).map(|e| e.loc()).collect()
    }

    /// Usage of every region that holds an entry: (region, committed
    /// entries, busy = a live lock or an open reservation). O(regions):
    /// the counts are kept as entries change (expired locks are swept
    /// first, as for an eviction).
    pub fn region_usage(&self, now: u64) -> Vec<(RegionId, u64, bool)> {
        let mut g = self.lock();
        g.sweep_locks(now);
        let used = g.region_use.iter().enumerate().filter(|(_, u)| u.committed + u.busy > 0);
        used.map(|(r, u)| (RegionId(r as u32), u.committed, u.busy > 0)).collect()
    }

    /// `region_usage` by a scan of every entry, the counts' reference in tests.
    #[cfg(test)]
    pub(super) fn region_usage_scan(&self, now: u64) -> Vec<(RegionId, u64, bool)> {
        let g = self.lock();
        let mut by: hashbrown::HashMap<RegionId, (u64, bool)> = hashbrown::HashMap::new();
        for (id, e) in g.slab.iter().enumerate() {
            let Some(e) = e else { continue };
            let u = by.entry(e.region()).or_default();
            let busy = !e.committed || g.lock_count(EntryId(id as u32), now) > 0;
            u.0 += e.committed as u64;
            u.1 |= busy;
        }
        let mut v: Vec<_> = by.into_iter().map(|(r, (n, busy))| (r, n, busy)).collect();
        v.sort_unstable();
        v
    }

    /// Remove every entry in `region` (reason `reclaimed`), atomically with
    /// the check that none is locked or reserved (else FAILED_PRECONDITION
    /// and nothing changes). O(entries).
    pub fn reclaim_region(&self, region: RegionId, now: u64) -> Result<Vec<Location>> {
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

    /// As `delete_in`; `erase` runs for each deleted location under the
    /// registry's lock, before any other call can reuse its pages (a
    /// cluster's primary erases the object's record there, so the delete
    /// survives a crash of the primary before the owner hears of it).
    pub fn delete_with(
        &self,
        keys: &[&[u8]],
        now: u64,
        scope: &Scope,
        erase: &mut dyn FnMut(&Location),
    ) -> Vec<Result<Location>> {
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
                    return Err(Error::precondition(locked_message(g.locks.get(&id), n)));
                }
                let loc = g.remove_logged(id, Removal::Deleted);
                // Under the lock: no other call can hand the pages on first.
                erase(&loc);
                Ok(loc)
            })
            .collect()
    }

    /// `evict` for a store of `tenant`: entries whose eviction would leave
    /// another tenant below its guaranteed share are skipped (with no
    /// tenant named, every tenant's share is kept).
    pub fn evict_for(&self, tenant: Option<&str>, node: NodeId, pages: u64, page_size: u64, now: u64) -> Freed {
        self.evict_for_owner(tenant, node, pages, page_size, now, None)
    }

    /// As `evict_for`, for what `owner` could still reserve: past its pin
    /// limit its reserve is refused, so evicting for it would empty the
    /// cache for nothing (a client re-reserving everything would evict
    /// every other client's entries, round after round).
    pub fn evict_for_owner(
        &self,
        tenant: Option<&str>,
        node: NodeId,
        pages: u64,
        page_size: u64,
        now: u64,
        owner: Option<Session>,
    ) -> Freed {
        let mut g = self.lock();
        let pages = match owner {
            Some(o) => pages.min(g.pin_room(o) / page_size.max(1)),
            None => pages,
        };
        if pages == 0 {
            return vec![];
        }
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

    /// Evict `tenant`'s own entries until `bytes` more fit under its quota
    /// (as far as unlocked entries allow); nothing without a quota.
    pub fn make_room(&self, tenant: &str, bytes: u64, now: u64) -> Freed {
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
            let loc = g.remove_announced(id, Removal::Evicted, crate::events::Reason::Quota);
            need = need.saturating_sub(loc.length);
            g.evictions += 1;
            g.quota_evictions += 1;
            freed.push(loc);
        }
        freed
    }

    /// Reclaim reservations past their deadline and drop expired locks.
    pub fn expire(&self, now: u64) -> Freed {
        let mut g = self.lock();
        let mut freed = vec![];
        while let Some(&(deadline, res)) = g.deadlines.front() {
            if deadline > now {
                break;
            }
            g.deadlines.pop_front();
            match g.open.get(&res) {
                // The sidecar's own writer stops at the deadline and aborts;
                // its pages are freed only a grace period later, in case
                // that abort never arrives (a follower cut off from its
                // primary), so never under a write still in progress.
                Some(o) if o.server_writes => g.late.push_back((deadline + SERVER_WRITE_GRACE_MS, res)),
                Some(_) => freed.push(g.expire_reservation(res)),
                None => {}
            }
        }
        while let Some(&(deadline, res)) = g.late.front() {
            if deadline > now {
                break;
            }
            g.late.pop_front();
            if g.open.contains_key(&res) {
                freed.push(g.expire_reservation(res));
            }
        }
        g.sweep_locks(now);
        freed
    }

    /// As `list`, showing only keys of `scope`'s tenants.
    pub fn list_in(&self, cursor: u64, limit: usize, tenant: Option<&str>, scope: &Scope) -> (Vec<KeyInfo>, u64) {
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

    /// Removals with seq >= `since` (at most `max`), the next seq, and whether
    /// some removals after `since` were already dropped from the log.
    pub fn removed_since(&self, since: u64, max: usize) -> (Vec<Removed>, u64, bool) {
        let g = self.lock();
        let oldest = g.removed.front().map(|r| r.0).unwrap_or(g.removed_next);
        // A cursor this log never handed out (another instance's log, such
        // as a primary's before it restarted) means nothing here: the
        // consumer is told, as for removals the log dropped.
        let foreign = since != 0 && (since < g.removed_base || since > g.removed_next);
        let since = if since == 0 || foreign { g.removed_base } else { since };
        let truncated = foreign || since < oldest;
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

    pub fn stats(&self) -> RegistryStats {
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
            admission: g.admission.stats(),
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

    /// Committed keys only.
    pub fn exists(&self, keys: &[&[u8]]) -> Vec<bool> {
        self.exists_in(keys, &Scope::All)
    }

    /// Record reservations; per item an unguessable reservation id, or
    /// AlreadyExists, or ResourceExhausted when the tenant limit is reached.
    pub fn reserve(
        &self,
        tenant: &str,
        items: Vec<(Vec<u8>, Location)>,
        opts: ReserveOpts,
    ) -> Vec<Result<ReservationId>> {
        self.reserve_seq(tenant, items, opts).into_iter().map(|r| r.map(|(id, _)| id)).collect()
    }

    /// As `lookup_and_lock_as`, for the sidecar's own session.
    pub fn lookup_and_lock(&self, keys: &[&[u8]], ttl_ms: u64, now: u64) -> Vec<Option<Location>> {
        self.lookup_and_lock_as(keys, ttl_ms, now, Session::LOCAL)
    }

    /// Lock each committed key for `ttl_ms` on behalf of `owner`
    /// (refcounted); `None` = miss.
    pub fn lookup_and_lock_as(&self, keys: &[&[u8]], ttl_ms: u64, now: u64, owner: Session) -> Vec<Option<Location>> {
        let out = self.lookup_and_lock_in(keys, ttl_ms, now, owner, &Scope::All);
        out.into_iter().map(|r| r.ok().flatten()).collect()
    }

    /// As `unlock_as`, for the sidecar's own session.
    pub fn unlock(&self, keys: &[&[u8]], now: u64) -> Vec<Result<()>> {
        self.unlock_as(keys, now, Session::LOCAL)
    }

    pub fn delete(&self, keys: &[&[u8]], now: u64) -> Vec<Result<Location>> {
        self.delete_in(keys, now, &Scope::All)
    }

    /// Delete unlocked committed keys of `scope`'s tenants; another
    /// tenant's key gets PermissionDenied and stays.
    pub fn delete_in(&self, keys: &[&[u8]], now: u64, scope: &Scope) -> Vec<Result<Location>> {
        self.delete_with(keys, now, scope, &mut |_| {})
    }

    /// Remove least-valuable unlocked committed entries of `node` until at
    /// least `pages` pages (of `page_size`) are freed or none are left.
    pub fn evict(&self, node: NodeId, pages: u64, page_size: u64, now: u64) -> Freed {
        self.evict_for(None, node, pages, page_size, now)
    }

    /// Committed keys from `cursor` on; returns the next cursor (0 = done).
    pub fn list(&self, cursor: u64, limit: usize, tenant: Option<&str>) -> (Vec<KeyInfo>, u64) {
        self.list_in(cursor, limit, tenant, &Scope::All)
    }
}

/// Why a locked key cannot go, naming the followers that hold it.
fn locked_message(l: Option<&super::entry::LockState>, n: u32) -> String {
    let nodes: Vec<String> =
        l.map_or(vec![], |l| l.holders.iter().filter(|h| h.0.is_hold()).map(|h| h.0.node_bits().to_string()).collect());
    if nodes.is_empty() {
        return format!("key is locked by {n} reader(s)");
    }
    format!(
        "key is locked by {n} reader(s), held by node(s) {} whose clients read it recently \
         (a follower lets go hold_idle_ms after its last read)",
        nodes.join(", ")
    )
}
