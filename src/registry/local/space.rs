//! Space: what a node's regions hold, deletes, eviction (for a node's
//! shortfall, for a tenant's quota), expiry of reservations and locks, and a
//! region's entries taken back with it (phase 3).

use super::{LocalRegistry, SERVER_WRITE_GRACE_MS};

use crate::error::{Error, ErrorKind, Result};
use crate::ids::{EntryId, NodeId, RegionId};
use crate::registry::entry::Entry;
use crate::registry::{pages_for, Freed, Location, Removal, Scope, Session};

/// Slab slots scanned per hold of the registry's lock when a region's
/// entries are looked for (`evict_region`, `reclaim_region`): ~0.3 ms each.
const SCAN_SLOTS: usize = 1 << 16;

impl LocalRegistry {
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
    pub(in crate::registry) fn region_usage_scan(&self, now: u64) -> Vec<(RegionId, u64, bool)> {
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
    /// and nothing changes). A region in use is refused from its counts,
    /// O(1); an idle one's entries are found a slice of the slab at a time,
    /// as `evict_region` finds them, and removed only if the region is
    /// still idle and the scan found each of them (else FAILED_PRECONDITION:
    /// it changed while it was looked through).
    pub fn reclaim_region(&self, region: RegionId, now: u64) -> Result<Vec<Location>> {
        self.reclaim_region_in_slices(region, now, SCAN_SLOTS, &mut || {})
    }

    /// `reclaim_region`, scanning `slots` slab slots per hold of the lock;
    /// `between` runs while the lock is let go between slices.
    pub(in crate::registry) fn reclaim_region_in_slices(
        &self,
        region: RegionId,
        now: u64,
        slots: usize,
        between: &mut dyn FnMut(),
    ) -> Result<Vec<Location>> {
        let in_use = || Error::precondition(format!("region {region} holds a lock or an open reservation"));
        if self.region_busy(region, now) {
            return Err(in_use());
        }
        let mut ids = self.find_in_slices(slots, &|e| e.region() == region, between);
        let mut g = self.lock();
        g.sweep_locks(now);
        let u = g.region_use.get(region.0 as usize).copied().unwrap_or_default();
        if u.busy > 0 {
            return Err(in_use());
        }
        ids.retain(|id| g.slab.get(id.index()).and_then(Option::as_ref).is_some_and(|e| e.region() == region));
        if ids.len() as u64 != u.committed {
            return Err(Error::precondition(format!("region {region} changed while its entries were looked for")));
        }
        Ok(ids.into_iter().map(|id| g.remove_logged(id, Removal::Reclaimed)).collect())
    }

    /// Whether `region` holds a live lock or an open reservation (expired
    /// locks swept first). O(1) from the counts kept per region.
    fn region_busy(&self, region: RegionId, now: u64) -> bool {
        let mut g = self.lock();
        g.sweep_locks(now);
        g.region_use.get(region.0 as usize).is_some_and(|u| u.busy > 0)
    }

    /// The ids of the entries `of` picks, found by a scan of the slab
    /// `slots` slots per hold of the registry's lock (a whole scan under it
    /// would stall every other call ~5 ms per million entries). Entries
    /// may come and go between slices: callers check what they found
    /// against the counts kept per region, under the lock.
    fn find_in_slices(&self, slots: usize, of: &dyn Fn(&Entry) -> bool, between: &mut dyn FnMut()) -> Vec<EntryId> {
        let mut ids = vec![];
        let mut at = 0;
        loop {
            let g = self.lock();
            let end = (at + slots.max(1)).min(g.slab.len());
            let slice = g.slab[at.min(end)..end].iter().enumerate();
            ids.extend(slice.filter(|(_, e)| e.as_ref().is_some_and(of)).map(|(i, _)| EntryId((at + i) as u32)));
            at = end;
            if at >= g.slab.len() {
                return ids;
            }
            drop(g);
            between();
        }
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

    /// Room for an object larger than half a region, which entries evicted
    /// one by one in the policy's order would not make: they are spread
    /// over every region, and one lock or reservation left in each keeps
    /// any from emptying (a single such reserve evicted every unlocked
    /// entry of the node, and was refused all the same). Instead every entry
    /// of one region among `candidates` (`node`'s) is evicted: of those
    /// with no lock and no open reservation, the one holding the fewest
    /// entries. Nothing where each is in use, where a guaranteed share
    /// spares one of its entries, or where `owner` could not reserve
    /// `bytes` more anyway.
    ///
    /// Choosing costs O(candidates), from the counts kept per region. The
    /// region's entries are then found by a scan of the slab a slice at a
    /// time, the lock let go between slices (a whole scan under it would
    /// stall every other call ~5 ms per million entries), and evicted under
    /// the lock only if the region is still idle and the scan found each of
    /// its entries (its count of committed entries says so); else nothing.
    pub fn evict_region(
        &self,
        tenant: Option<&str>,
        node: NodeId,
        candidates: &[RegionId],
        bytes: u64,
        now: u64,
        owner: Session,
    ) -> Freed {
        self.evict_region_in_slices(tenant, node, candidates, (bytes, now, owner), SCAN_SLOTS)
    }

    /// `evict_region`, scanning `slots` slab slots per hold of the lock.
    pub(in crate::registry) fn evict_region_in_slices(
        &self,
        tenant: Option<&str>,
        node: NodeId,
        candidates: &[RegionId],
        (bytes, now, owner): (u64, u64, Session),
        slots: usize,
    ) -> Freed {
        let Some(region) = self.idle_region(candidates, bytes, now, owner) else { return vec![] };
        let mut ids = self.find_in_slices(slots, &|e| e.region() == region && e.node == node, &mut || {});
        let mut g = self.lock();
        if g.pin_room(owner) < bytes {
            return vec![];
        }
        g.sweep_locks(now);
        let live = |g: &super::super::inner::Inner, id: &EntryId| {
            let e = g.slab.get(id.index()).and_then(Option::as_ref);
            e.is_some_and(|e| e.region() == region && e.node == node && e.committed)
        };
        ids.retain(|id| live(&g, id));
        let u = g.region_use.get(region.0 as usize).copied().unwrap_or_default();
        let requester = if g.guarded { tenant.and_then(|t| g.tenant_ids.get(t).copied()) } else { None };
        let spared = g.guarded && ids.iter().any(|&id| g.spares(id, requester));
        if u.busy > 0 || ids.len() as u64 != u.committed || spared {
            return vec![];
        }
        g.evictions += ids.len() as u64;
        ids.into_iter().map(|id| g.remove_logged(id, Removal::Evicted)).collect()
    }

    /// Of `candidates`, the region with no lock and no open reservation
    /// that holds the fewest committed entries (none if `owner` could not
    /// reserve `bytes` more).
    fn idle_region(&self, candidates: &[RegionId], bytes: u64, now: u64, owner: Session) -> Option<RegionId> {
        let mut g = self.lock();
        if g.pin_room(owner) < bytes {
            return None;
        }
        g.sweep_locks(now);
        let idle = |r: &RegionId| {
            let u = g.region_use.get(r.0 as usize).copied().unwrap_or_default();
            (u.busy == 0 && u.committed > 0).then_some((u.committed, *r))
        };
        candidates.iter().filter_map(idle).min().map(|(_, r)| r)
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
}

/// Why a locked key cannot go, naming the followers that hold it.
fn locked_message(l: Option<&crate::registry::entry::LockState>, n: u32) -> String {
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
