//! Locks on committed keys: lookups that lock (refcounted, with a TTL, per
//! session), unlocks, the reads a follower answered, and the locks of a
//! closed session or a dead node released.
use std::hash::BuildHasher;

use super::LocalRegistry;
use crate::error::{Error, ErrorKind, Result};
use crate::ids::ReservationId;
use crate::registry::{Location, Scope, Session};

impl LocalRegistry {
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
}
