//! The async registry boundary the handler sees. `LocalDirectory` is the
//! registry in this process (single node, or the cluster's primary);
//! `cluster::Forwarded` sends the same calls to the primary. Every call
//! returns a batch-level `Result` (a follower may not reach the primary);
//! per-key outcomes are inside. No lock is held across an `.await`.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::{Freed, KeyInfo, Location, Registry, RegistryStats, Removed, ReserveOpts, Scope, Session};
use crate::error::Result;
use crate::ids::{NodeId, ReservationId};

/// Keys per registry call: bounds how long one request holds the
/// registry's lock (a few tens of microseconds).
pub const REGISTRY_CHUNK: usize = 256;

/// What a reserve returns: per item an unguessable reservation id or an
/// error, and entries of the caller's node evicted for its shortfall (their
/// pages are the caller's to free).
#[derive(Debug, Default)]
pub struct Reserved {
    pub ids: Vec<Result<ReservationId>>,
    /// Each reservation's commit sequence (0 where it failed): the writer
    /// puts it into the object's record at commit.
    pub seqs: Vec<u64>,
    pub freed: Freed,
}

/// A reserve call: `items` are already placed in `node`'s pages; the
/// registry evicts `shortfall_pages` (of `page_size`) among `node`'s
/// entries for items that could not be placed.
pub struct ReserveCall<'a> {
    pub node: NodeId,
    pub tenant: &'a str,
    pub items: Vec<(Vec<u8>, Location)>,
    pub owner: Session,
    pub server_writes: bool,
    pub timeout_ms: u64,
    pub shortfall_pages: u64,
    pub page_size: u64,
}

/// Per-key unlock results and lookup hits (PermissionDenied for a key of a
/// tenant outside the caller's scope).
pub type Looked = (Vec<Result<()>>, Vec<Result<Option<Location>>>);

#[tonic::async_trait]
pub trait Directory: Send + Sync {
    /// The eviction policy of the registry behind this directory.
    fn policy_name(&self) -> String;
    /// Whether calls are answered in this process (cheap enough to ask
    /// which keys are present before allocating for them).
    fn is_local(&self) -> bool;
    /// This node may still write records into its own regions. A follower
    /// cut off from the primary for a lease must not: once declared dead its
    /// regions may be handed to another node (phase 3 reclaim).
    fn may_write(&self) -> bool {
        true
    }
    /// Committed or being written (a snapshot; reserve checks again).
    async fn present(&self, keys: &[&[u8]]) -> Result<Vec<bool>>;
    async fn reserve(&self, call: ReserveCall<'_>) -> Result<Reserved>;
    /// Publish `owner`'s reservations; also the removal log's next seq.
    async fn commit(&self, ids: &[ReservationId], owner: Session) -> Result<(Vec<Result<Location>>, u64)>;
    async fn abort(&self, ids: &[ReservationId], owner: Session) -> Result<Vec<Result<Location>>>;
    /// Release one of `owner`'s locks per `unlock` key, then look up and
    /// lock `keys` of `scope`'s tenants for `ttl_ms` (one call: unlocks
    /// ride on lookups).
    async fn lookup(
        &self,
        unlock: &[&[u8]],
        keys: &[&[u8]],
        ttl_ms: u64,
        owner: Session,
        scope: &Scope,
    ) -> Result<Looked>;
    async fn unlock(&self, keys: &[&[u8]], owner: Session) -> Result<Vec<Result<()>>>;
    async fn release_session(&self, owner: Session) -> Result<u64>;
    async fn delete(&self, keys: &[&[u8]], scope: &Scope) -> Result<Vec<Result<Location>>>;
    async fn exists(&self, keys: &[&[u8]], scope: &Scope) -> Result<Vec<bool>>;
    /// Evict among `node`'s entries until `pages` pages are free.
    async fn evict(&self, node: NodeId, pages: u64, page_size: u64) -> Result<Freed>;
    /// Reclaim expired reservations and locks (the registry's own clock).
    async fn expire(&self) -> Result<Freed>;
    async fn list(&self, cursor: u64, limit: usize, tenant: Option<&str>, scope: &Scope)
        -> Result<(Vec<KeyInfo>, u64)>;
    async fn stats(&self) -> Result<RegistryStats>;
    async fn removed_since(&self, since: u64, max: usize) -> Result<(Vec<Removed>, u64, bool)>;
}

/// Where freed locations of other nodes go (the cluster's free notices).
pub trait FreedSink: Send + Sync {
    fn freed(&self, locs: &[Location]);
}

/// A time-bound right to act (an elected primary's election lease).
pub trait Lease: Send + Sync {
    fn held(&self) -> bool;
}

/// A lease kept on this process's monotonic clock: a follower's (writes
/// stop when the primary has not answered a heartbeat for `lease_ms`) and an
/// elected primary's (renewed by each confirmation of its election).
pub struct Fence {
    epoch: Instant,
    renewed_ms: AtomicU64,
    lease_ms: u64,
}

impl Fence {
    pub fn new(lease_ms: u64) -> Self {
        Self { epoch: Instant::now(), renewed_ms: AtomicU64::new(0), lease_ms }
    }
    pub fn renew(&self) {
        self.renew_at(Instant::now());
    }
    /// Renew as of `t` (e.g. when the request that was confirmed left).
    pub fn renew_at(&self, t: Instant) {
        let ms = t.saturating_duration_since(self.epoch).as_millis() as u64 + 1;
        self.renewed_ms.fetch_max(ms, Ordering::AcqRel);
    }
    /// Give the lease up now.
    pub fn expire(&self) {
        self.renewed_ms.store(0, Ordering::Release);
    }
    pub fn held(&self) -> bool {
        let r = self.renewed_ms.load(Ordering::Acquire);
        r != 0 && (self.epoch.elapsed().as_millis() as u64) < r + self.lease_ms
    }
}

impl Lease for Fence {
    fn held(&self) -> bool {
        Fence::held(self)
    }
}

/// Erases a deleted object's record in the pool (a cluster's primary, for
/// any node's object): called under the registry's lock, so the delete is
/// in the pool before it is acknowledged and before the pages can be reused.
pub trait Eraser: Send + Sync {
    fn erase(&self, loc: &Location);
}

/// The registry in this process, with its monotonic clock.
pub struct LocalDirectory {
    reg: Arc<dyn Registry>,
    /// An elected primary's lease: once it lapses every call is refused, so
    /// a primary that was paused or cut off never answers from a registry a
    /// newer primary has replaced.
    lease: Option<Arc<dyn Lease>>,
    epoch: Instant,
    /// In a cluster: every location the registry lets go of is also sent
    /// here, so its owner frees it even when the call came from elsewhere.
    sink: Option<Arc<dyn FreedSink>>,
    /// In a cluster: erases deleted objects' records in the pool at once.
    eraser: Option<Arc<dyn Eraser>>,
    /// A new primary's first `lease_ms` (registry ms): followers may still
    /// answer lookups from holds the previous primary granted, so nothing
    /// committed is removed (deleted, evicted, taken back) before then.
    grace_until: std::sync::atomic::AtomicU64,
}

impl LocalDirectory {
    pub fn new(reg: Arc<dyn Registry>) -> Self {
        Self { reg, lease: None, epoch: Instant::now(), sink: None, eraser: None, grace_until: Default::default() }
    }

    pub fn with_sink(reg: Arc<dyn Registry>, sink: Arc<dyn FreedSink>) -> Self {
        Self { sink: Some(sink), ..Self::new(reg) }
    }

    pub fn with_eraser(mut self, eraser: Arc<dyn Eraser>) -> Self {
        self.eraser = Some(eraser);
        self
    }

    /// Remove nothing committed for `ms` from now (see `grace_until`).
    pub fn with_grace(self, ms: u64) -> Self {
        self.grace_until.store(self.now_ms() + ms, std::sync::atomic::Ordering::Relaxed);
        self
    }

    /// End the grace period now (the rebuild found nothing committed: no
    /// follower can hold anything of it).
    pub fn end_grace(&self) {
        self.grace_until.store(0, std::sync::atomic::Ordering::Relaxed);
    }

    /// Still within a new primary's grace period: nothing committed may go.
    pub fn in_grace(&self) -> bool {
        self.now_ms() < self.grace_until.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn grace_refusal(&self) -> crate::error::Error {
        crate::error::Error::new(
            crate::error::ErrorKind::Unavailable,
            format!(
                "this primary took over moments ago: nothing is deleted for another {} ms, until holds \
                 granted by the previous primary have lapsed; retry",
                self.grace_until.load(std::sync::atomic::Ordering::Relaxed).saturating_sub(self.now_ms())
            ),
        )
    }

    pub fn with_lease(mut self, lease: Arc<dyn Lease>) -> Self {
        self.lease = Some(lease);
        self
    }

    fn gate(&self) -> Result<()> {
        match &self.lease {
            Some(l) if !l.held() => Err(crate::error::Error::new(
                crate::error::ErrorKind::Unavailable,
                "this primary's election lease lapsed: it stands down",
            )),
            _ => Ok(()),
        }
    }

    pub fn registry(&self) -> &dyn Registry {
        self.reg.as_ref()
    }

    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn notify(&self, locs: &[Location]) {
        if let (Some(s), false) = (&self.sink, locs.is_empty()) {
            s.freed(locs);
        }
    }

    fn notify_ok(&self, out: &[Result<Location>]) {
        self.notify(&out.iter().filter_map(|r| r.as_ref().ok().copied()).collect::<Vec<_>>());
    }

    /// One registry call per `REGISTRY_CHUNK` keys (each key stands alone).
    fn chunked<T>(keys: &[&[u8]], f: impl Fn(&[&[u8]]) -> Vec<T>) -> Vec<T> {
        keys.chunks(REGISTRY_CHUNK).flat_map(f).collect()
    }

    /// The registry's dead-node cleanup, with notices for the freed pages.
    /// Returns the locks released and, for each reservation dropped, its
    /// location and deadline (registry ms): its writer may still copy into
    /// it until then.
    pub fn release_node(&self, node_bits: u32) -> (u64, Vec<(Location, u64)>) {
        let (locks, dropped) = self.reg.release_node(node_bits);
        self.notify(&dropped.iter().map(|d| d.0).collect::<Vec<_>>());
        (locks, dropped)
    }
}

#[tonic::async_trait]
impl Directory for LocalDirectory {
    fn policy_name(&self) -> String {
        self.reg.policy_name().into()
    }

    fn is_local(&self) -> bool {
        true
    }

    fn may_write(&self) -> bool {
        self.gate().is_ok()
    }

    async fn present(&self, keys: &[&[u8]]) -> Result<Vec<bool>> {
        self.gate()?;
        Ok(Self::chunked(keys, |c| self.reg.present(c)))
    }

    async fn reserve(&self, call: ReserveCall<'_>) -> Result<Reserved> {
        self.gate()?;
        let now = self.now_ms();
        let opts =
            ReserveOpts { deadline: now + call.timeout_ms, owner: call.owner, server_writes: call.server_writes };
        // A tenant at its quota makes room among its own entries first
        // (nothing committed goes during a new primary's grace period).
        let bytes = call.items.iter().map(|i| i.1.length).sum();
        let grace = self.in_grace();
        let mut freed = if grace { vec![] } else { self.reg.make_room(call.tenant, bytes, now) };
        let (mut ids, mut seqs) = (Vec::with_capacity(call.items.len()), Vec::with_capacity(call.items.len()));
        let mut items = call.items.into_iter().peekable();
        while items.peek().is_some() {
            let chunk: Vec<_> = items.by_ref().take(REGISTRY_CHUNK).collect();
            for r in self.reg.reserve_seq(call.tenant, chunk, opts) {
                seqs.push(r.as_ref().map_or(0, |x| x.1));
                ids.push(r.map(|x| x.0));
            }
        }
        if call.shortfall_pages > 0 && !grace {
            freed.extend(self.reg.evict_for(Some(call.tenant), call.node, call.shortfall_pages, call.page_size, now));
        }
        self.notify(&freed);
        Ok(Reserved { ids, seqs, freed })
    }

    async fn commit(&self, ids: &[ReservationId], owner: Session) -> Result<(Vec<Result<Location>>, u64)> {
        self.gate()?;
        Ok(self.reg.commit(ids, owner, &mut |_, _| {}))
    }

    async fn abort(&self, ids: &[ReservationId], owner: Session) -> Result<Vec<Result<Location>>> {
        self.gate()?;
        let out = self.reg.abort(ids, owner);
        self.notify_ok(&out);
        Ok(out)
    }

    async fn lookup(
        &self,
        unlock: &[&[u8]],
        keys: &[&[u8]],
        ttl_ms: u64,
        owner: Session,
        scope: &Scope,
    ) -> Result<Looked> {
        self.gate()?;
        let unlocked = Self::chunked(unlock, |c| self.reg.unlock_as(c, self.now_ms(), owner));
        let hits = Self::chunked(keys, |c| self.reg.lookup_and_lock_in(c, ttl_ms, self.now_ms(), owner, scope));
        Ok((unlocked, hits))
    }

    async fn unlock(&self, keys: &[&[u8]], owner: Session) -> Result<Vec<Result<()>>> {
        self.gate()?;
        Ok(Self::chunked(keys, |c| self.reg.unlock_as(c, self.now_ms(), owner)))
    }

    async fn release_session(&self, owner: Session) -> Result<u64> {
        Ok(self.reg.release_session(owner))
    }

    async fn delete(&self, keys: &[&[u8]], scope: &Scope) -> Result<Vec<Result<Location>>> {
        self.gate()?;
        if self.in_grace() {
            return Err(self.grace_refusal());
        }
        let erase = |l: &Location| {
            if let Some(e) = &self.eraser {
                e.erase(l);
            }
        };
        let out = Self::chunked(keys, |c| self.reg.delete_with(c, self.now_ms(), scope, &mut { erase }));
        self.notify_ok(&out);
        Ok(out)
    }

    async fn exists(&self, keys: &[&[u8]], scope: &Scope) -> Result<Vec<bool>> {
        self.gate()?;
        Ok(Self::chunked(keys, |c| self.reg.exists_in(c, scope)))
    }

    async fn evict(&self, node: NodeId, pages: u64, page_size: u64) -> Result<Freed> {
        self.gate()?;
        if self.in_grace() {
            return Ok(vec![]);
        }
        let freed = self.reg.evict(node, pages, page_size, self.now_ms());
        self.notify(&freed);
        Ok(freed)
    }

    async fn expire(&self) -> Result<Freed> {
        let freed = self.reg.expire(self.now_ms());
        self.notify(&freed);
        Ok(freed)
    }

    async fn list(
        &self,
        cursor: u64,
        limit: usize,
        tenant: Option<&str>,
        scope: &Scope,
    ) -> Result<(Vec<KeyInfo>, u64)> {
        self.gate()?;
        Ok(self.reg.list_in(cursor, limit, tenant, scope))
    }

    async fn stats(&self) -> Result<RegistryStats> {
        Ok(self.reg.stats())
    }

    async fn removed_since(&self, since: u64, max: usize) -> Result<(Vec<Removed>, u64, bool)> {
        Ok(self.reg.removed_since(since, max))
    }
}
