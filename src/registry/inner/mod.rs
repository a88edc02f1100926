//! The registry's state behind its one lock: the slab of entries and their
//! index, open reservations and their deadlines, the lock table, the victim
//! orders, tenants and their quotas, the removal log and the counters; and
//! the steps every call is made of (find, insert, remove and log, lock and
//! release, scope checks; the lock table's and pins' in `lock_table.rs`).
//! `local/` composes them into the registry's calls, each under the lock.

use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::sync::Arc;

// foldhash with a random per-instance seed: several times faster than SipHash
// on these short keys, still not predictable by clients. (hashbrown's default
// builder, in the form that also takes a fixed seed, for replays.)
use foldhash::fast::SeedableRandomState;
use hashbrown::HashMap;

mod lock_table;

use super::admission::Admission;
use super::entry::{Entry, LockState};
use super::index::Index;
use super::orders::Orders;
use super::quota::{Limit, QuotaConfig};
use super::{Location, Removal, Scope, Session};
use crate::error::{Error, ErrorKind, Result};
use crate::ids::{EntryId, ReservationId};

/// How many removals the log keeps for clients catching up.
pub const REMOVED_LOG: usize = 65_536;

/// (seq, key, tenant, size, reason)
pub(super) type RemovedLogEntry = (u64, Arc<[u8]>, Arc<str>, u64, Removal);

pub(super) struct Tenant {
    pub(super) name: Arc<str>,
    pub(super) bytes: u64,
    pub(super) keys: u64,
    /// Payload bytes of open reservations (they count against the quota).
    pub(super) reserving: u64,
    pub(super) limit: Limit,
    /// Keys plus open reservations: at 0 the tenant is forgotten, so a
    /// stream of one-off tenant names cannot grow the registry.
    pub(super) refs: u64,
}

/// One region's entries, kept as they change: what phase 3 asks of every
/// region costs O(regions), not a scan of every entry under the lock.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct RegionUse {
    pub(super) committed: u64,
    /// Entries in use: being written (open reservations) or locked.
    pub(super) busy: u64,
}

/// An open (uncommitted) reservation.
pub(super) struct Open {
    pub(super) id: EntryId,
    pub(super) owner: Session,
    pub(super) server_writes: bool,
    /// Until when (registry ms) its writer may still copy into its pages.
    pub(super) deadline: u64,
    /// Its commit sequence.
    pub(super) seq: u64,
}

pub(super) struct Inner {
    pub(super) hasher: SeedableRandomState,
    pub(super) slab: Vec<Option<Entry>>,
    pub(super) free_ids: Vec<EntryId>,
    pub(super) index: Index,
    pub(super) reserved: u64,
    pub(super) deadlines: VecDeque<(u64, ReservationId)>,
    /// Reservations the sidecar writes itself, past their deadline: freed
    /// at the time given (`SERVER_WRITE_GRACE_MS` later).
    pub(super) late: VecDeque<(u64, ReservationId)>,
    /// Reservation id (64 random bits) → its entry and owner.
    pub(super) open: HashMap<ReservationId, Open>,
    /// Lock state of locked entries only (swept for expiry).
    pub(super) locks: HashMap<EntryId, LockState>,
    /// No lock expires before this (a lower bound): a sweep before it would
    /// find nothing, so reserve-time eviction skips it.
    pub(super) lock_bound: u64,
    /// One policy; an order per node (and per tenant with quotas). Locked
    /// entries are held out of them.
    pub(super) orders: Orders,
    /// Which stores are worth a place (off unless configured).
    pub(super) admission: Admission,
    pub(super) quotas: QuotaConfig,
    /// Some tenant has a guaranteed share: node eviction checks victims.
    pub(super) guarded: bool,
    pub(super) tenants: Vec<Option<Tenant>>,
    pub(super) free_tenants: Vec<u32>,
    pub(super) tenant_ids: HashMap<Arc<str>, u32>,
    pub(super) max_tenants: usize,
    /// Bytes each client session holds locked (once per entry it locks)
    /// plus reserved; sessions holding nothing are absent.
    pub(super) pinned: HashMap<Session, u64>,
    /// The most a client session may hold (`[registry]
    /// max_client_pinned_bytes`); the sidecar's own and a follower's hold
    /// sessions are not counted.
    pub(super) pin_limit: u64,
    pub(super) removed: VecDeque<RemovedLogEntry>,
    /// The removal log's first seq: 1, or a random one (a cluster's
    /// primary), so that a cursor of another instance's log is told apart.
    pub(super) removed_base: u64,
    pub(super) removed_next: u64,
    /// The next commit sequence a reservation is given (pool-wide order of
    /// a key's versions), and the first one not yet covered by the
    /// high-water mark kept in the pool (`LocalRegistry::with_seq_store`).
    pub(super) seq_next: u64,
    pub(super) seq_limit: u64,
    /// Registry ms up to which the pool's view-lock mark covers durable
    /// sessions' locks (`LocalRegistry::with_lock_mark`).
    pub(super) marked_until: u64,
    /// Where every key that becomes visible or leaves is announced (the
    /// pool's event stream), if anywhere.
    pub(super) events: Option<std::sync::Arc<crate::events::EventSink>>,
    pub(super) keys: u64,
    pub(super) bytes: u64,
    pub(super) evictions: u64,
    pub(super) reservations_expired: u64,
    pub(super) locks_expired: u64,
    pub(super) eviction_visits: u64,
    pub(super) quota_evictions: u64,
    /// Per region id.
    pub(super) region_use: Vec<RegionUse>,
}

impl Inner {
    pub(super) fn new(orders: Orders, max_tenants: usize) -> Self {
        Self {
            hasher: SeedableRandomState::random(),
            slab: vec![],
            free_ids: vec![],
            index: Index::default(),
            reserved: 0,
            deadlines: VecDeque::new(),
            late: VecDeque::new(),
            open: HashMap::new(),
            locks: HashMap::new(),
            lock_bound: u64::MAX,
            orders,
            admission: Admission::off(),
            quotas: QuotaConfig::default(),
            guarded: false,
            tenants: vec![],
            free_tenants: vec![],
            tenant_ids: HashMap::new(),
            max_tenants,
            pinned: HashMap::new(),
            pin_limit: u64::MAX,
            removed: VecDeque::new(),
            removed_base: 1,
            removed_next: 1,
            seq_next: 1,
            seq_limit: u64::MAX,
            marked_until: 0,
            events: None,
            keys: 0,
            bytes: 0,
            evictions: 0,
            reservations_expired: 0,
            locks_expired: 0,
            eviction_visits: 0,
            quota_evictions: 0,
            region_use: vec![],
        }
    }

    pub(super) fn find(&self, key: &[u8]) -> Option<EntryId> {
        self.find_hashed(key, self.hasher.hash_one(key))
    }

    /// `find` for a batch. Each key's slot and entry loads are independent of
    /// the others', so loading every slot first, then every entry, lets the
    /// CPU keep a batch's cache misses in flight together instead of taking
    /// them one after another (a 10 M-entry registry misses on every level of
    /// cache).
    /// With `for_touch`, the eviction policy's state of each candidate is
    /// loaded in the same round.
    pub(super) fn find_many(&self, keys: &[&[u8]], for_touch: bool) -> Vec<Option<EntryId>> {
        self.find_many_hashed(keys, for_touch).0
    }

    /// `find_many`, with each key's hash (admission learns of lookups by it).
    pub(super) fn find_many_hashed(&self, keys: &[&[u8]], for_touch: bool) -> (Vec<Option<EntryId>>, Vec<u64>) {
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
        // No id with the tag: absent, no second probe. Another key's id
        // first: look further.
        for ((o, k), &h) in out.iter_mut().zip(keys).zip(&hashes) {
            if o.is_some_and(|id| self.slab[id.index()].as_ref().is_none_or(|e| e.key.as_slice() != *k)) {
                *o = self.find_hashed(k, h);
            }
        }
        (out, hashes)
    }

    pub(super) fn find_hashed(&self, key: &[u8], h: u64) -> Option<EntryId> {
        self.index.find(h, |id| self.slab[id.index()].as_ref().is_some_and(|e| e.key.as_slice() == key))
    }

    pub(super) fn entry(&mut self, id: EntryId) -> &mut Entry {
        self.slab[id.index()].as_mut().expect("live entry id")
    }

    /// The open reservation `res` of `owner`: NotFound when there is none
    /// (unknown, aborted, expired or already committed), PermissionDenied
    /// when another session made it, FailedPrecondition while the sidecar
    /// itself is writing it.
    pub(super) fn open_of(&self, res: ReservationId, owner: Session) -> Result<EntryId> {
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

    pub(super) fn new_reservation_id(&self) -> ReservationId {
        loop {
            let id = ReservationId(rand::random());
            if id.0 != 0 && !self.open.contains_key(&id) {
                return id;
            }
        }
    }

    /// The tenant's id with one more reference, or None at the tenant limit
    /// (unless `force`).
    pub(super) fn tenant_ref(&mut self, name: &str, force: bool) -> Option<u32> {
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

    /// One more reference to tenant `t`, already referenced (a caller
    /// that just had its id from `tenant_ref`).
    pub(super) fn tenant_ref_again(&mut self, t: u32) -> u32 {
        self.tenants[t as usize].as_mut().expect("live tenant").refs += 1;
        t
    }

    pub(super) fn tenant_unref(&mut self, t: u32) {
        let tn = self.tenants[t as usize].as_mut().expect("live tenant");
        tn.refs -= 1;
        if tn.refs == 0 {
            let name = tn.name.clone();
            self.tenant_ids.remove(&name);
            self.tenants[t as usize] = None;
            self.free_tenants.push(t);
        }
    }

    pub(super) fn tenant(&mut self, t: u32) -> &mut Tenant {
        self.tenants[t as usize].as_mut().expect("live tenant")
    }

    pub(super) fn tenant_name(&self, t: u32) -> Arc<str> {
        self.tenants[t as usize].as_ref().expect("live tenant").name.clone()
    }

    pub(super) fn insert(&mut self, e: Entry) -> EntryId {
        let h = self.hasher.hash_one(e.key.as_slice());
        self.insert_hashed(e, h)
    }

    /// The usage counts of region `r`.
    pub(super) fn region_use(&mut self, r: crate::ids::RegionId) -> &mut RegionUse {
        let i = r.0 as usize;
        if i >= self.region_use.len() {
            self.region_use.resize(i + 1, RegionUse::default());
        }
        &mut self.region_use[i]
    }

    /// A reserved entry is committed.
    pub(super) fn mark_committed(&mut self, id: EntryId) {
        let e = self.entry(id);
        e.committed = true;
        let region = e.region();
        let u = self.region_use(region);
        u.busy -= 1;
        u.committed += 1;
    }

    /// `insert`, with the key's hash (`h`) already taken.
    pub(super) fn insert_hashed(&mut self, e: Entry, h: u64) -> EntryId {
        let u = self.region_use(e.region());
        if e.committed {
            u.committed += 1;
        } else {
            u.busy += 1;
        }
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
    pub(super) fn remove(&mut self, id: EntryId) -> Location {
        let e = self.slab[id.index()].take().expect("live entry id");
        let h = self.hasher.hash_one(e.key.as_slice());
        self.index.remove(h, id);
        self.free_ids.push(id);
        let u = self.region_use(e.region());
        if e.committed {
            u.committed -= 1;
        } else {
            u.busy -= 1;
        }
        u.busy -= e.locked as u64;
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
            if let Some(l) = self.locks.remove(&id) {
                for h in &l.holders {
                    self.unpin(h.0, e.length());
                }
            }
        }
        self.tenant_unref(e.tenant);
        e.loc()
    }

    /// Announce that entry `id` became visible: committed, or restored by
    /// a rebuild (what a new source's subscribers start from).
    pub(super) fn announce_stored(&self, id: EntryId, commit_seq: u64) {
        if let Some(sink) = &self.events {
            let e = self.slab[id.index()].as_ref().expect("live entry id");
            sink.push(crate::events::Event::Stored {
                key: e.key.shared(),
                tenant: self.tenant_name(e.tenant),
                size: e.length(),
                node: e.node,
                commit_seq,
                hash: crate::events::hash::BlockHash::NonNegative(0), // the sink's to set
                announce: None,
                tokens: None,
            });
        }
    }

    /// Drop open reservation `res` (past its deadline): its location.
    pub(super) fn expire_reservation(&mut self, res: ReservationId) -> Location {
        let o = self.close_reservation(res).expect("an open reservation");
        self.reservations_expired += 1;
        self.remove(o.id)
    }

    /// Take `res` out of the open reservations (its bytes no longer count
    /// against its client's pinned bytes); the entry stays.
    pub(super) fn close_reservation(&mut self, res: ReservationId) -> Option<Open> {
        let o = self.open.remove(&res)?;
        let len = self.slab[o.id.index()].as_ref().expect("live entry id").length();
        self.unpin(o.owner, len);
        Some(o)
    }

    /// Remove a committed entry and log it for `removed_since`.
    pub(super) fn remove_logged(&mut self, id: EntryId, reason: Removal) -> Location {
        let event = match reason {
            Removal::Deleted => crate::events::Reason::Deleted,
            Removal::Evicted => crate::events::Reason::Evicted,
            Removal::Reclaimed => crate::events::Reason::Reclaimed,
        };
        self.remove_announced(id, reason, event)
    }

    /// `remove_logged`, announced with `event` as the reason (a quota's
    /// eviction is logged as an eviction and announced as `quota`).
    pub(super) fn remove_announced(&mut self, id: EntryId, reason: Removal, event: crate::events::Reason) -> Location {
        let e = self.slab[id.index()].as_ref().expect("live entry id");
        if reason == Removal::Evicted && self.admission.is_on() {
            // A later store of it is its second touch.
            let h = self.hasher.hash_one(e.key.as_slice());
            self.admission.evicted(h);
        }
        let e = self.slab[id.index()].as_ref().expect("live entry id");
        let (key, tenant) = (e.key.shared(), self.tenant_name(e.tenant));
        if let Some(sink) = &self.events {
            let size = e.length();
            let (key, tenant) = (key.clone(), tenant.clone());
            let hash = crate::events::hash::BlockHash::NonNegative(0); // the sink's to set
            sink.push(crate::events::Event::Removed { key, tenant, size, reason: event, hash, announce: None });
        }
        let loc = self.remove(id);
        if self.removed.len() == REMOVED_LOG {
            self.removed.pop_front();
        }
        self.removed.push_back((self.removed_next, key, tenant, loc.length, reason));
        self.removed_next += 1;
        loc
    }

    /// Tenant ids `scope` allows (`None`: every tenant). Tenants that hold
    /// nothing have no id, and nothing of theirs can be found anyway.
    pub(super) fn scope_ids(&self, scope: &Scope) -> Option<Vec<u32>> {
        match scope {
            Scope::All => None,
            Scope::Tenants(names) => {
                Some(names.iter().filter_map(|n| self.tenant_ids.get(n.as_str()).copied()).collect())
            }
        }
    }

    /// PermissionDenied when entry `id` belongs to a tenant outside `allowed`.
    pub(super) fn check_scope(&self, id: EntryId, allowed: &Option<Vec<u32>>) -> Result<()> {
        let t = self.slab[id.index()].as_ref().expect("live entry id").tenant;
        match allowed {
            Some(ids) if !ids.contains(&t) => Err(Scope::denied("the key")),
            _ => Ok(()),
        }
    }

    /// Whether evicting committed entry `id` for `requester`'s store would
    /// leave another tenant below its guaranteed share.
    pub(super) fn spares(&self, id: EntryId, requester: Option<u32>) -> bool {
        let e = self.slab[id.index()].as_ref().expect("live entry id");
        if Some(e.tenant) == requester {
            return false;
        }
        let t = self.tenants[e.tenant as usize].as_ref().expect("live tenant");
        t.limit.spares(t.bytes + t.reserving, e.length())
    }

    /// A lookup (or a follower's read) of the key of hash `h` found
    /// committed entry `found`, or missed: admission's simulations and
    /// history learn it.
    pub(super) fn admission_saw(&mut self, h: u64, found: Option<EntryId>) {
        match found {
            Some(id) if self.admission.reads(h) => {
                let size = self.slab[id.index()].as_ref().expect("live entry id").length();
                let live = self.keys as usize;
                self.admission.read(h, size, live);
            }
            Some(_) => {}
            None => self.admission.missed(h),
        }
    }

    pub(super) fn key_of(&self, id: EntryId) -> &[u8] {
        self.slab[id.index()].as_ref().expect("live entry id").key.as_slice()
    }
}
