//! The lock table's steps and the pin budget: what each client session
//! holds locked or reserved against `max_client_pinned_bytes`, locks taken,
//! dropped, released per session and swept at their expiry.
use super::Inner;
use crate::error::{Error, ErrorKind, Result};
use crate::ids::EntryId;
use crate::registry::entry::LockState;
use crate::registry::Session;

impl Inner {
    /// Sessions whose locks and reservations are not counted: the sidecar
    /// itself (its inline streams are bounded on their own) and a
    /// follower's holds (its clients' reads, bounded there).
    fn unbounded(owner: Session) -> bool {
        owner.is_sidecar() || owner.is_hold()
    }

    /// Whether `owner` may hold `more` bytes besides what it holds:
    /// RESOURCE_EXHAUSTED when not.
    pub(in crate::registry) fn check_pin(&self, owner: Session, more: u64) -> Result<()> {
        let held = self.pinned.get(&owner).copied().unwrap_or(0);
        if Self::unbounded(owner) || held + more <= self.pin_limit {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::ResourceExhausted,
            format!(
                "this client holds {held} bytes locked or reserved; {more} more would pass the limit of {} \
                 (registry.max_client_pinned_bytes): unlock, commit or abort first",
                self.pin_limit
            ),
        ))
    }

    /// Bytes `owner` may still hold locked or reserved (unbounded: all).
    pub(in crate::registry) fn pin_room(&self, owner: Session) -> u64 {
        if Self::unbounded(owner) {
            return u64::MAX;
        }
        self.pin_limit.saturating_sub(self.pinned.get(&owner).copied().unwrap_or(0))
    }

    pub(in crate::registry) fn pin(&mut self, owner: Session, bytes: u64) {
        if !Self::unbounded(owner) {
            *self.pinned.entry(owner).or_default() += bytes;
        }
    }

    pub(in crate::registry) fn unpin(&mut self, owner: Session, bytes: u64) {
        if let Some(n) = self.pinned.get_mut(&owner) {
            *n = n.saturating_sub(bytes);
            if *n == 0 {
                self.pinned.remove(&owner);
            }
        }
    }

    /// `holders` no longer lock entry `id`: their bytes stop counting.
    fn unpin_holders(&mut self, id: EntryId, holders: &[(Session, u32)]) {
        let len = self.slab[id.index()].as_ref().expect("live entry id").length();
        for h in holders {
            self.unpin(h.0, len);
        }
    }

    /// Live lock count of `id` (0 when unlocked or expired).
    pub(in crate::registry) fn lock_count(&self, id: EntryId, now: u64) -> u32 {
        match self.slab[id.index()].as_ref() {
            Some(e) if e.locked => self.locks.get(&id).filter(|l| l.expiry > now).map_or(0, |l| l.count),
            _ => 0,
        }
    }

    /// Drop an expired lock so the entry is unprotected again.
    pub(in crate::registry) fn clear_expired_lock(&mut self, id: EntryId, now: u64) {
        if !self.entry(id).locked {
            return;
        }
        if self.locks.get(&id).is_none_or(|l| l.expiry <= now) {
            self.locks_expired += 1;
            self.drop_lock(id);
        }
    }

    /// The entry's last lock is gone: it is a victim candidate again.
    pub(in crate::registry) fn drop_lock(&mut self, id: EntryId) {
        if let Some(l) = self.locks.remove(&id) {
            self.unpin_holders(id, &l.holders);
        }
        let e = self.entry(id);
        let was = std::mem::replace(&mut e.locked, false);
        let (node, tenant, region) = (e.node, e.tenant, e.region());
        self.region_use(region).busy -= was as u64;
        self.orders.release(node, tenant, id);
    }

    /// Release every lock held by a session `whose` picks; entries left
    /// with none become victim candidates again. Returns the locks released.
    pub(in crate::registry) fn release_locks(&mut self, whose: impl Fn(Session) -> bool) -> u64 {
        let mut released = 0u64;
        let mut emptied = vec![];
        let mut unpinned = vec![];
        for (&id, l) in self.locks.iter_mut() {
            let gone: u32 = l.holders.iter().filter(|h| whose(h.0)).map(|h| h.1).sum();
            if gone == 0 {
                continue;
            }
            unpinned.extend(l.holders.iter().filter(|h| whose(h.0)).map(|h| (id, *h)));
            l.holders.retain(|h| !whose(h.0));
            l.count -= gone;
            released += gone as u64;
            if l.count == 0 {
                emptied.push(id);
            }
        }
        for (id, h) in unpinned {
            self.unpin_holders(id, &[h]);
        }
        for id in emptied {
            self.drop_lock(id);
        }
        released
    }

    /// Take one more lock on a committed entry. The first one takes the entry
    /// out of the victim order, so eviction never walks over entries in use.
    pub(in crate::registry) fn add_lock(&mut self, id: EntryId, expiry: u64, owner: Session) {
        let e = self.entry(id);
        let first = !e.locked;
        e.locked = true;
        let (node, tenant) = (e.node, e.tenant);
        let l = self.locks.entry(id).or_insert(LockState { count: 0, expiry: 0, holders: vec![] });
        l.count += 1;
        l.expiry = l.expiry.max(expiry);
        let new_holder = match l.holders.iter_mut().find(|h| h.0 == owner) {
            Some(h) => {
                h.1 += 1;
                false
            }
            None => {
                l.holders.push((owner, 1));
                true
            }
        };
        if new_holder {
            let len = self.slab[id.index()].as_ref().expect("live entry id").length();
            self.pin(owner, len);
        }
        if first {
            let region = self.slab[id.index()].as_ref().expect("live entry id").region();
            self.region_use(region).busy += 1;
            self.orders.hold(node, tenant, id);
            self.lock_bound = self.lock_bound.min(expiry);
        }
    }

    /// Release every lock past its TTL (ordered by expiry, then key, so the
    /// order they re-enter eviction in is deterministic). Runs only when some
    /// lock may have expired: O(locked entries) at most once per expiry.
    pub(in crate::registry) fn sweep_locks(&mut self, now: u64) {
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
}
