//! The async registry boundary the handler sees. Every registry operation
//! of a client is one `Op` of `proto/peer.proto`, defined there once:
//! `LocalDirectory` (`local_directory.rs`) answers it with the registry in
//! this process (a single node, or the cluster's primary, for its own
//! clients and for every follower's), `cluster::Forwarded` sends it as it
//! is to the primary. Every call returns a batch-level `Result` (a follower
//! may not reach the primary); per-key outcomes are inside. No lock is held
//! across an `.await`.
use std::sync::atomic::{AtomicU64, Ordering};

use std::time::Instant;

use bytes::Bytes;

use super::convert::{
    error_of, from_peer, ids_to_peer, key_info_from_proto, loc_results, removed_from_proto, reserve_result_of,
    result_of, stats_from_peer, to_peer,
};
use super::{Admit, Freed, Listed, Location, RegistryStats, Removed, Scope, Session};
use crate::error::{Error, ErrorKind, Result};
use crate::ids::{NodeId, ReservationId};
use crate::peer_proto::{self as pp, op::Op as O, op_result::Result as R};

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
    /// Per item (or none): token ids for its commit's event.
    pub hints: Vec<pp::TokenHint>,
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
    /// Every registry operation of a client, as `proto/peer.proto`'s `Op`
    /// (its session, tenant scope and arguments): the one definition of
    /// each operation, answered by the registry in this process
    /// (`LocalDirectory`) or forwarded as it is to the cluster's primary
    /// (`cluster::Forwarded`), which answers it with its `LocalDirectory`.
    /// A whole-call failure is the `Err`; per-key outcomes are inside.
    async fn call(&self, op: pp::Op) -> Result<R>;
    /// Committed or being written (a snapshot; reserve checks again).
    async fn present(&self, keys: &[&[u8]]) -> Result<Vec<bool>>;
    /// Per item to store (key, size): present, or admission's verdict, a
    /// touch it remembers (once per store). Asked only where the registry
    /// is in this process; elsewhere the reserve judges (`ReserveCall::judge`).
    async fn admit(&self, items: &[(&[u8], u64)]) -> Result<Vec<Admit>>;
    /// Evict among `node`'s entries until `pages` pages are free.
    async fn evict(&self, node: NodeId, pages: u64, page_size: u64) -> Result<Freed>;
    /// Reclaim expired reservations and locks (the registry's own clock).
    async fn expire(&self) -> Result<Freed>;

    // The operations as the handler calls them: each builds its `Op`,
    // `call`s it and reads the result. Both directories use these as they
    // are; what a follower adds (its holds, its answer while cut off from
    // the primary) it adds in its `call`, on the `Op`.

    async fn reserve(&self, c: ReserveCall<'_>) -> Result<Reserved> {
        self.reserve_judging(c, false).await
    }

    /// As `reserve`; with `judge`, admission judges the items first (see
    /// `peer.proto`'s `Reserve.judge`: a follower's reserve, which the
    /// primary decides for the pool).
    async fn reserve_judging(&self, c: ReserveCall<'_>, judge: bool) -> Result<Reserved> {
        let n = c.items.len();
        let op = O::Reserve(pp::Reserve {
            tenant: c.tenant.to_owned(),
            keys: c.items.iter().map(|(k, _)| Bytes::copy_from_slice(k)).collect(),
            locations: c.items.iter().map(|(_, l)| to_peer(l)).collect(),
            timeout_ms: c.timeout_ms,
            server_writes: c.server_writes,
            shortfall_pages: c.shortfall_pages,
            page_size: c.page_size,
            node: c.node.0,
            hints: c.hints,
            judge,
        });
        let R::Reserve(r) = self.call(envelope(c.owner, None, op)).await? else { return Err(unexpected()) };
        if r.statuses.len() != n || r.ids.len() != n || r.seqs.len() != n {
            return Err(unexpected());
        }
        let ids =
            r.statuses.iter().zip(&r.ids).map(|(s, id)| reserve_result_of(s).map(|_| ReservationId(*id))).collect();
        Ok(Reserved { ids, seqs: r.seqs, freed: r.freed.iter().map(from_peer).collect() })
    }

    /// Publish `owner`'s reservations; also the removal log's next seq.
    async fn commit(&self, ids: &[ReservationId], owner: Session) -> Result<(Vec<Result<Location>>, u64)> {
        let R::Commit(r) = self.call(envelope(owner, None, O::Commit(ids_to_peer(ids)))).await? else {
            return Err(unexpected());
        };
        let l = r.results.unwrap_or_default();
        Ok((loc_results(&l.statuses, &l.locations)?, r.removed_seq))
    }

    async fn abort(&self, ids: &[ReservationId], owner: Session) -> Result<Vec<Result<Location>>> {
        let R::Abort(l) = self.call(envelope(owner, None, O::Abort(ids_to_peer(ids)))).await? else {
            return Err(unexpected());
        };
        loc_results(&l.statuses, &l.locations)
    }

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
    ) -> Result<Looked> {
        let op = O::Lookup(pp::Lookup { unlock_first: bytes_of(unlock), keys: bytes_of(keys), ttl_ms, hold: false });
        let R::Lookup(r) = self.call(envelope(owner, Some(scope), op)).await? else { return Err(unexpected()) };
        Ok(looked(keys.len(), unlock.len(), &r)?.0)
    }

    async fn unlock(&self, keys: &[&[u8]], owner: Session) -> Result<Vec<Result<()>>> {
        let R::Unlock(r) = self.call(envelope(owner, None, O::Unlock(pp::Keys { keys: bytes_of(keys) }))).await? else {
            return Err(unexpected());
        };
        Ok(r.statuses.iter().map(result_of).collect())
    }

    /// `owner` is gone: release every lock it holds; how many.
    async fn release_session(&self, owner: Session) -> Result<u64> {
        let R::Released(n) = self.call(envelope(owner, None, O::ReleaseSession(true))).await? else {
            return Err(unexpected());
        };
        Ok(n)
    }

    async fn delete(&self, keys: &[&[u8]], scope: &Scope) -> Result<Vec<Result<Location>>> {
        let op = O::Delete(pp::Keys { keys: bytes_of(keys) });
        let R::Delete(l) = self.call(envelope(Session::LOCAL, Some(scope), op)).await? else {
            return Err(unexpected());
        };
        loc_results(&l.statuses, &l.locations)
    }

    async fn exists(&self, keys: &[&[u8]], scope: &Scope) -> Result<Vec<bool>> {
        let op = O::Exists(pp::Keys { keys: bytes_of(keys) });
        let R::Exists(b) = self.call(envelope(Session::LOCAL, Some(scope), op)).await? else {
            return Err(unexpected());
        };
        Ok(b.values)
    }

    /// One page of the keys of `tenant` (None: every tenant) within `scope`.
    async fn list(&self, cursor: u64, limit: usize, tenant: Option<&str>, scope: &Scope) -> Result<Listed> {
        let op = O::List(pp::ListKeys {
            cursor,
            limit: limit as u32,
            tenant: tenant.unwrap_or_default().to_owned(),
            all_tenants: tenant.is_none(),
        });
        let R::List(r) = self.call(envelope(Session::LOCAL, Some(scope), op)).await? else {
            return Err(unexpected());
        };
        Ok((r.keys.into_iter().map(key_info_from_proto).collect(), r.next_cursor))
    }

    async fn stats(&self) -> Result<RegistryStats> {
        let R::Stats(r) = self.call(envelope(Session::LOCAL, None, O::Stats(pp::StatsRequest {}))).await? else {
            return Err(unexpected());
        };
        Ok(stats_from_peer(r))
    }

    /// Up to `max` removals from `since` on; the next seq to ask from, and
    /// whether some were lost (the log is bounded).
    async fn removed_since(&self, since: u64, max: usize) -> Result<(Vec<Removed>, u64, bool)> {
        let op = O::Removed(pp::RemovedRequest { since, max: max as u32 });
        let R::Removed(r) = self.call(envelope(Session::LOCAL, None, op)).await? else {
            return Err(unexpected());
        };
        Ok((r.keys.into_iter().map(removed_from_proto).collect(), r.next, r.truncated))
    }
}

/// An operation of `owner` (`Session`), within `scope` where it names keys.
pub fn envelope(owner: Session, scope: Option<&Scope>, op: O) -> pp::Op {
    let (scoped, scope_tenants) = match scope {
        Some(Scope::Tenants(t)) => (true, t.iter().cloned().collect()),
        _ => (false, vec![]),
    };
    pp::Op { owner: owner.0, op: Some(op), scoped, scope_tenants, instance: 0 }
}

/// Keys as the operations carry them.
pub fn bytes_of(keys: &[&[u8]]) -> Vec<Bytes> {
    keys.iter().map(|k| Bytes::copy_from_slice(k)).collect()
}

/// A lookup's answer: per-key unlock results and hits, and each hit's
/// tenant where the lookup asked to hold its keys.
pub fn looked(keys: usize, unlocks: usize, r: &pp::LookupResult) -> Result<(Looked, &[String])> {
    if r.found.len() != keys
        || r.locations.len() != keys
        || r.unlock_statuses.len() != unlocks
        || (!r.tenants.is_empty() && r.tenants.len() != keys)
    {
        return Err(unexpected());
    }
    let hits = (0..keys)
        .map(|i| match r.statuses.get(i).and_then(error_of) {
            Some(e) => Err(e),
            None => Ok(r.found[i].then(|| from_peer(&r.locations[i]))),
        })
        .collect();
    Ok(((r.unlock_statuses.iter().map(result_of).collect(), hits), &r.tenants))
}

/// An answer of another operation than the one asked.
pub fn unexpected() -> Error {
    Error::new(ErrorKind::Internal, "the registry answered another operation")
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

/// Where regions may be taken back in this process (a cluster's primary):
/// a reserve's locations are admitted each on its own, and the returned
/// guard is held across the registry call, so a region is either chosen as
/// a victim with no reservation in it, or its reserves are refused.
#[tonic::async_trait]
pub trait ReserveGate: Send + Sync {
    /// Per location: None (admitted) or why not (RESOURCE_EXHAUSTED: the
    /// region is, or is being, taken back); a location of another node than
    /// `node` refuses the whole call.
    async fn admit(
        &self,
        node: NodeId,
        locs: &[Location],
    ) -> Result<(Box<dyn std::any::Any + Send>, Vec<Option<Error>>)>;
}

/// Erases a deleted object's record in the pool (a cluster's primary, for
/// any node's object): called under the registry's lock, so the delete is
/// in the pool before it is acknowledged and before the pages can be reused.
pub trait Eraser: Send + Sync {
    fn erase(&self, loc: &Location);
}
