//! The key registry: key → location, write-once, two-phase store (reserve →
//! commit), refcounted TTL locks, eviction through a pluggable policy.
//! `Registry` is the boundary a remote primary will sit behind; `LocalRegistry`
//! is the in-process primary. Callers pass `now` (monotonic ms) so time is
//! explicit and testable.
pub mod config;
pub mod directory;
mod entry;
mod index;
mod inner;
pub mod local;
mod orders;
pub mod quota;
#[cfg(test)]
mod quota_tests;
#[cfg(test)]
mod tests;

pub use directory::{Directory, LocalDirectory, Reserved};
pub use local::LocalRegistry;
pub use quota::QuotaConfig;

use crate::error::Result;
use crate::ids::{NodeId, RegionId, ReservationId};

/// Where an object's bytes are. `node` owns `region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Location {
    pub node: NodeId,
    pub region: RegionId,
    pub offset: u64,
    pub length: u64,
    pub generation: u64,
    /// The pool's version word of the object's first page when the object
    /// was allocated. Freeing the pages changes the word, so a reader that
    /// finds it unchanged after copying knows the bytes were this object's.
    pub version: u32,
}

/// The client session (one gRPC connection) that made a reservation; only it
/// may commit or abort it. `Session::LOCAL` is the sidecar itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Session(pub u64);

impl Session {
    pub const LOCAL: Session = Session(0);
    /// A follower's node-held locks (`cluster::holds`): its clients' reads
    /// of a key it holds are answered on the follower, covered by this one
    /// lock at the primary. Client sessions count up from 1 and never get
    /// here.
    pub const HOLD: Session = Session((1 << Self::NODE_SHIFT) - 1);
    /// Bits of a session id left to the node that tagged the connection.
    const NODE_SHIFT: u32 = 40;

    /// A follower's session as the primary knows it: the follower's node id
    /// in the high bits, so sessions of different nodes never collide and a
    /// dead node's sessions can be found. The primary's own sessions keep
    /// node bits 0.
    pub fn on_node(self, node: u32) -> Session {
        Session(((node as u64) << Self::NODE_SHIFT) | (self.0 & ((1 << Self::NODE_SHIFT) - 1)))
    }

    /// A follower's node-held lock (`HOLD` on some node's bits).
    pub fn is_hold(self) -> bool {
        self.0 & ((1 << Self::NODE_SHIFT) - 1) == Self::HOLD.0
    }

    /// The node bits (0 for sessions of the node that holds the registry).
    pub fn node_bits(self) -> u32 {
        (self.0 >> Self::NODE_SHIFT) as u32
    }

    /// A sidecar acting for itself (an inline put): `LOCAL` on the node that
    /// holds the registry, and a follower's `LOCAL` as the primary knows it
    /// (its node bits, no client bits). Client sessions count up from 1
    /// (`conn.rs`): their bits below the node bits are never 0.
    pub fn is_sidecar(self) -> bool {
        self.0 & ((1 << Self::NODE_SHIFT) - 1) == 0
    }
}

/// The tenants a client may touch. Tenant-bound credentials (see
/// `crate::auth`) give `Tenants`; operators, and every client where no
/// binding is configured, get `All`. Key names are one namespace shared by
/// all tenants, so a scope check happens under the registry lock, in the
/// same step as the operation it guards: a key cannot change tenant between
/// the check and a lock or delete.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Scope {
    #[default]
    All,
    Tenants(std::sync::Arc<std::collections::BTreeSet<String>>),
}

impl Scope {
    pub fn tenants<I: IntoIterator<Item = S>, S: Into<String>>(names: I) -> Self {
        Scope::Tenants(std::sync::Arc::new(names.into_iter().map(Into::into).collect()))
    }
    pub fn allows(&self, tenant: &str) -> bool {
        match self {
            Scope::All => true,
            Scope::Tenants(t) => t.contains(tenant),
        }
    }
    /// The error for a key or tenant outside the scope.
    pub fn denied(what: impl std::fmt::Display) -> crate::error::Error {
        crate::error::Error::new(
            crate::error::ErrorKind::PermissionDenied,
            format!("{what} belongs to a tenant this credential is not bound to"),
        )
    }
}

/// How a batch of reservations is recorded.
#[derive(Debug, Clone, Copy)]
pub struct ReserveOpts {
    /// Monotonic ms after which an uncommitted reservation is reclaimed.
    pub deadline: u64,
    pub owner: Session,
    /// The sidecar writes the bytes itself (inline put): housekeeping never
    /// reclaims the reservation under the writer; the writer aborts it.
    pub server_writes: bool,
}

impl ReserveOpts {
    /// Reservations the sidecar's own session makes and the client writes.
    pub fn local(deadline: u64) -> Self {
        Self { deadline, owner: Session::LOCAL, server_writes: false }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    pub key: Vec<u8>,
    pub tenant: String,
    pub size: u64,
}

/// A committed key that left the registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removed {
    pub seq: u64,
    pub key: Vec<u8>,
    pub tenant: String,
    pub size: u64,
    pub reason: Removal,
}

/// Why a committed key left the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    Deleted,
    /// Made room in its node's regions (phase 1).
    Evicted,
    /// Its whole region went to another node (phase 3).
    Reclaimed,
}

impl Removal {
    pub fn as_str(self) -> &'static str {
        match self {
            Removal::Deleted => "deleted",
            Removal::Evicted => "evicted",
            Removal::Reclaimed => "reclaimed",
        }
    }

    /// The wire name back (unknown names read as "deleted").
    pub fn parse(s: &str) -> Self {
        match s {
            "evicted" => Removal::Evicted,
            "reclaimed" => Removal::Reclaimed,
            _ => Removal::Deleted,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantUsage {
    pub tenant: String,
    /// Payload bytes of committed keys.
    pub bytes: u64,
    pub keys: u64,
    /// Payload bytes of open reservations.
    pub reserving_bytes: u64,
    /// 0 = none (`[quotas]`).
    pub quota_bytes: u64,
    pub guaranteed_bytes: u64,
}

#[derive(Debug, Clone, Default)]
pub struct RegistryStats {
    pub keys: u64,
    pub reserved: u64,
    pub bytes_stored: u64,
    pub locked_keys: u64,
    pub evictions: u64,
    pub reservations_expired: u64,
    pub locks_expired: u64,
    /// Entries the victim search looked at (each one is evicted: entries in
    /// use are not in the search order).
    pub eviction_visits: u64,
    /// Evictions of a tenant's own entries to keep it under its quota
    /// (also counted in `evictions`).
    pub quota_evictions: u64,
    /// Tenants with keys or open reservations.
    pub tenants: Vec<TenantUsage>,
}

/// Entries removed by the registry whose pages the caller must free.
pub type Freed = Vec<Location>;

pub trait Registry: Send + Sync {
    fn policy_name(&self) -> &'static str;
    /// Committed or being written (a reserve of these would report "exists").
    fn present(&self, keys: &[&[u8]]) -> Vec<bool>;
    /// Committed keys only.
    fn exists(&self, keys: &[&[u8]]) -> Vec<bool> {
        self.exists_in(keys, &Scope::All)
    }
    /// Committed keys of `scope`'s tenants (another tenant's key is false).
    fn exists_in(&self, keys: &[&[u8]], scope: &Scope) -> Vec<bool>;
    /// Record reservations; per item an unguessable reservation id, or
    /// AlreadyExists, or ResourceExhausted when the tenant limit is reached.
    fn reserve(&self, tenant: &str, items: Vec<(Vec<u8>, Location)>, opts: ReserveOpts) -> Vec<Result<ReservationId>> {
        self.reserve_seq(tenant, items, opts).into_iter().map(|r| r.map(|(id, _)| id)).collect()
    }
    /// As `reserve`, with each reservation's commit sequence: the order of
    /// a key's versions pool-wide (a key is reserved again only after its
    /// previous version left the registry, so a later version always has a
    /// larger sequence). The writer records it in the object's record; a
    /// rebuild that finds two committed records of one key keeps the larger.
    fn reserve_seq(
        &self,
        tenant: &str,
        items: Vec<(Vec<u8>, Location)>,
        opts: ReserveOpts,
    ) -> Vec<Result<(ReservationId, u64)>>;
    /// Publish reservations of `owner` (PermissionDenied for another
    /// session's). `publish` runs for each one just before it becomes
    /// visible, under the registry's lock, while its pages are still the
    /// reservation's: it must be short. Also returns the removal log's next
    /// seq, read atomically with the commits.
    fn commit(
        &self,
        ids: &[ReservationId],
        owner: Session,
        publish: &mut dyn FnMut(usize, &Location),
    ) -> (Vec<Result<Location>>, u64);
    /// Adopt committed objects found in the pool's records after a restart,
    /// oldest first (that is their eviction order). Keys already present are
    /// skipped; tenants are adopted even past the tenant limit. Returns how
    /// many entries were added.
    fn restore(&self, items: Vec<(Vec<u8>, String, Location)>) -> usize;
    /// Hand out commit sequences above `floor` only (the largest a rebuild
    /// found in the pool).
    fn raise_seq(&self, _floor: u64) {}
    /// Drop reservations of `owner`; the freed locations are returned per id.
    fn abort(&self, ids: &[ReservationId], owner: Session) -> Vec<Result<Location>>;
    /// As `lookup_and_lock_as`, for the sidecar's own session.
    fn lookup_and_lock(&self, keys: &[&[u8]], ttl_ms: u64, now: u64) -> Vec<Option<Location>> {
        self.lookup_and_lock_as(keys, ttl_ms, now, Session::LOCAL)
    }
    /// Lock each committed key for `ttl_ms` on behalf of `owner`
    /// (refcounted); `None` = miss.
    fn lookup_and_lock_as(&self, keys: &[&[u8]], ttl_ms: u64, now: u64, owner: Session) -> Vec<Option<Location>> {
        let out = self.lookup_and_lock_in(keys, ttl_ms, now, owner, &Scope::All);
        out.into_iter().map(|r| r.ok().flatten()).collect()
    }
    /// As `lookup_and_lock_as`, for keys of `scope`'s tenants: another
    /// tenant's key gets PermissionDenied and is neither locked nor touched.
    fn lookup_and_lock_in(
        &self,
        keys: &[&[u8]],
        ttl_ms: u64,
        now: u64,
        owner: Session,
        scope: &Scope,
    ) -> Vec<Result<Option<Location>>>;
    /// The tenant of each committed key (None: unknown or being written).
    fn tenants_of(&self, keys: &[&[u8]]) -> Vec<Option<String>>;
    /// Count `uses[i]` reads of committed `keys[i]` that were answered
    /// elsewhere (a follower's node-held keys) in the eviction order, as
    /// that many lookups would have; unknown keys are skipped. O(Σ uses).
    fn touch(&self, keys: &[&[u8]], uses: &[u32]);
    /// As `unlock_as`, for the sidecar's own session.
    fn unlock(&self, keys: &[&[u8]], now: u64) -> Vec<Result<()>> {
        self.unlock_as(keys, now, Session::LOCAL)
    }
    /// Release one of `owner`'s locks per key: PermissionDenied (and nothing
    /// released) when only other sessions hold the key's locks.
    fn unlock_as(&self, keys: &[&[u8]], now: u64, owner: Session) -> Vec<Result<()>>;
    /// `owner` is gone (its connection closed): release every lock it holds.
    /// Its readers may still be copying; the version check makes any copy
    /// the eviction then spoils a miss. Returns the locks released.
    fn release_session(&self, owner: Session) -> u64;
    /// Node `node_bits` is dead (cluster): release every lock its sessions
    /// hold and drop their open reservations (returned with their
    /// deadlines: their pages belong to that node, which frees them when it
    /// joins again, and their writers, still alive, may copy into them
    /// until the deadline).
    fn release_node(&self, node_bits: u32) -> (u64, Vec<(Location, u64)>);
    /// Committed entries whose bytes are in `node`'s regions.
    fn live_of(&self, node: NodeId) -> Vec<Location>;
    /// Usage of every region that holds an entry: (region, committed
    /// entries, busy = a live lock or an open reservation). O(entries).
    fn region_usage(&self, now: u64) -> Vec<(RegionId, u64, bool)>;
    /// Remove every entry in `region` (reason `reclaimed`), atomically with
    /// the check that none is locked or reserved (else FAILED_PRECONDITION
    /// and nothing changes). O(entries).
    fn reclaim_region(&self, region: RegionId, now: u64) -> Result<Vec<Location>>;
    fn delete(&self, keys: &[&[u8]], now: u64) -> Vec<Result<Location>> {
        self.delete_in(keys, now, &Scope::All)
    }
    /// Delete unlocked committed keys of `scope`'s tenants; another
    /// tenant's key gets PermissionDenied and stays.
    fn delete_in(&self, keys: &[&[u8]], now: u64, scope: &Scope) -> Vec<Result<Location>> {
        self.delete_with(keys, now, scope, &mut |_| {})
    }
    /// As `delete_in`; `erase` runs for each deleted location under the
    /// registry's lock, before any other call can reuse its pages (a
    /// cluster's primary erases the object's record there, so the delete
    /// survives a crash of the primary before the owner hears of it).
    fn delete_with(
        &self,
        keys: &[&[u8]],
        now: u64,
        scope: &Scope,
        erase: &mut dyn FnMut(&Location),
    ) -> Vec<Result<Location>>;
    /// Remove least-valuable unlocked committed entries of `node` until at
    /// least `pages` pages (of `page_size`) are freed or none are left.
    fn evict(&self, node: NodeId, pages: u64, page_size: u64, now: u64) -> Freed {
        self.evict_for(None, node, pages, page_size, now)
    }
    /// `evict` for a store of `tenant`: entries whose eviction would leave
    /// another tenant below its guaranteed share are skipped (with no
    /// tenant named, every tenant's share is kept).
    fn evict_for(&self, tenant: Option<&str>, node: NodeId, pages: u64, page_size: u64, now: u64) -> Freed;
    /// Evict `tenant`'s own entries until `bytes` more fit under its quota
    /// (as far as unlocked entries allow); nothing without a quota.
    fn make_room(&self, tenant: &str, bytes: u64, now: u64) -> Freed;
    /// Reclaim reservations past their deadline and drop expired locks.
    fn expire(&self, now: u64) -> Freed;
    /// Committed keys from `cursor` on; returns the next cursor (0 = done).
    fn list(&self, cursor: u64, limit: usize, tenant: Option<&str>) -> (Vec<KeyInfo>, u64) {
        self.list_in(cursor, limit, tenant, &Scope::All)
    }
    /// As `list`, showing only keys of `scope`'s tenants.
    fn list_in(&self, cursor: u64, limit: usize, tenant: Option<&str>, scope: &Scope) -> (Vec<KeyInfo>, u64);
    fn stats(&self) -> RegistryStats;
    /// Removals with seq >= `since` (at most `max`), the next seq, and whether
    /// some removals after `since` were already dropped from the log.
    fn removed_since(&self, since: u64, max: usize) -> (Vec<Removed>, u64, bool);
}

/// Where a registry keeps the high-water mark of the commit sequences it
/// handed out (`LocalRegistry::with_seq_store`).
pub trait SeqStore: Send + Sync {
    /// Record that no sequence at or above `limit` has been handed out yet;
    /// called before the first sequence past the previous limit.
    fn keep_below(&self, limit: u64) -> Result<()>;
}

pub fn pages_for(length: u64, page_size: u64) -> u64 {
    length.div_ceil(page_size).max(1)
}
