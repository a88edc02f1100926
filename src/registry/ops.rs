//! Each registry operation of a client, in one place: how it is asked (its
//! `Op` built from the handler's arguments, its result read back: `Ops`,
//! the same for every `Directory`) and how the registry in this process
//! answers it (`answer`, for `LocalDirectory`). What a follower adds to an
//! operation (its holds, its answer while cut off from the primary) is its
//! own, in `cluster::Forwarded::call`; a reserve is answered through the
//! cluster's gate in `local_directory.rs`. A new operation: its arms in
//! `proto/peer.proto`'s `Op` and `OpResult`, its call and its answer here,
//! its step on the registry (`local/`).
use bytes::Bytes;

use super::convert::{
    error_of, from_peer, ids_from_peer, ids_to_peer, key_info_from_proto, key_info_to_proto, loc_results,
    loc_results_to_peer, lookup_result, removed_from_proto, removed_to_proto, reserve_result_of, result_of,
    stats_from_peer, stats_to_peer, status_of, to_peer,
};
use super::directory::{Directory, REGISTRY_CHUNK};
use super::{Freed, Listed, LocalRegistry, Location, RegistryStats, Removed, Scope, Session};
use crate::error::{Error, ErrorKind, Result};
use crate::ids::{NodeId, RegionId, ReservationId};
use crate::peer_proto::{self as pp, op::Op as O, op_result::Result as R};

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

#[cfg(test)]
impl<'a> ReserveCall<'a> {
    /// A local client's reserve on `node` (tests): 1 s to write, no hints.
    pub(crate) fn local(
        node: NodeId,
        tenant: &'a str,
        items: Vec<(Vec<u8>, Location)>,
        shortfall_pages: u64,
        page_size: u64,
    ) -> Self {
        let (owner, server_writes, timeout_ms, hints) = (Session::LOCAL, false, 1_000, vec![]);
        Self { node, tenant, items, owner, server_writes, timeout_ms, shortfall_pages, page_size, hints }
    }
}

/// Per-key unlock results and lookup hits (PermissionDenied for a key of a
/// tenant outside the caller's scope).
pub type Looked = (Vec<Result<()>>, Vec<Result<Option<Location>>>);

/// The operations as the handler calls them, on any `Directory`: each
/// builds its `Op`, `call`s it and reads the result.
#[tonic::async_trait]
pub trait Ops: Directory {
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

    /// Empty one of `node`'s `regions` for an object larger than half a
    /// region (`LocalRegistry::evict_region`): what was evicted (the
    /// caller's pages), nothing where each holds a lock or a reservation.
    async fn evict_region(
        &self,
        owner: Session,
        tenant: &str,
        node: NodeId,
        regions: &[RegionId],
        bytes: u64,
    ) -> Result<Freed> {
        let regions = regions.iter().map(|r| r.0).collect();
        let op = O::EvictRegion(pp::EvictRegion { tenant: tenant.into(), node: node.0, regions, bytes });
        let R::Evicted(r) = self.call(envelope(owner, None, op)).await? else {
            return Err(unexpected());
        };
        Ok(r.locations.iter().map(from_peer).collect())
    }
}

impl<D: Directory + ?Sized> Ops for D {}

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

/// What the registry in this process (`LocalDirectory`) lends the answers:
/// the registry, its clock, and the cluster's hooks on what leaves it.
pub(super) trait Answerer {
    fn reg(&self) -> &LocalRegistry;
    fn now_ms(&self) -> u64;
    /// Locations let go of: their owners are told (a cluster's notices).
    fn freed(&self, out: &[Result<Location>]);
    /// Deletes, through a new primary's grace and the pool's eraser.
    fn delete(&self, keys: &[&[u8]], scope: &Scope) -> Result<Vec<Result<Location>>>;
    /// A region emptied for a large object, through a new primary's grace.
    fn evict_region(&self, owner: Session, e: &pp::EvictRegion) -> Freed;
}

/// One registry call per `REGISTRY_CHUNK` keys (each key stands alone).
pub(super) fn chunked<T>(keys: &[&[u8]], f: impl Fn(&[&[u8]]) -> Vec<T>) -> Vec<T> {
    keys.chunks(REGISTRY_CHUNK).flat_map(f).collect()
}

/// Answered even by a primary whose election lease lapsed (which refuses
/// everything else): a session closing releases its locks, and the figures
/// and the removal log are read.
pub(super) fn outlives_the_lease(op: &O) -> bool {
    matches!(op, O::ReleaseSession(_) | O::Stats(_) | O::Removed(_))
}

/// Every operation but a reserve, answered on the registry at once.
pub(super) fn answer(a: &impl Answerer, op: O, owner: Session, scope: &Scope) -> Result<R> {
    let reg = a.reg();
    Ok(match op {
        O::Reserve(_) => return Err(Error::invalid("a reserve goes through the gate")),
        O::Commit(ids) => {
            let (out, removed_seq) = reg.commit(&ids_from_peer(&ids), owner, &mut |_, _| {});
            R::Commit(pp::CommitResult { results: Some(loc_results_to_peer(&out)), removed_seq })
        }
        O::Abort(ids) => {
            let out = reg.abort(&ids_from_peer(&ids), owner);
            a.freed(&out);
            R::Abort(loc_results_to_peer(&out))
        }
        O::Lookup(l) => R::Lookup(lookup(a, &l, owner, scope)),
        O::Unlock(k) => unlocked(a, &slices(&k.keys), owner),
        // A follower gives holds back: the reads it answered count first.
        O::Release(r) => {
            let keys = slices(&r.keys);
            reg.touch(&keys, &r.uses);
            unlocked(a, &keys, owner)
        }
        O::ReleaseSession(_) => R::Released(reg.release_session(owner)),
        O::Delete(k) => R::Delete(loc_results_to_peer(&a.delete(&slices(&k.keys), scope)?)),
        O::Exists(k) => R::Exists(pp::Bools { values: chunked(&slices(&k.keys), |c| reg.exists_in(c, scope)) }),
        O::List(l) => {
            let tenant = (!l.all_tenants).then_some(l.tenant.as_str());
            let (keys, next_cursor) = reg.list_in(l.cursor, l.limit as usize, tenant, scope);
            R::List(pp::ListReply { keys: keys.into_iter().map(key_info_to_proto).collect(), next_cursor })
        }
        O::Stats(_) => R::Stats(stats_to_peer(&reg.stats())),
        O::Removed(r) => {
            let (removed, next, truncated) = reg.removed_since(r.since, r.max as usize);
            R::Removed(pp::RemovedReply { keys: removed.into_iter().map(removed_to_proto).collect(), next, truncated })
        }
        O::EvictRegion(e) => {
            R::Evicted(pp::Locations { locations: a.evict_region(owner, &e).iter().map(to_peer).collect() })
        }
    })
}

fn lookup(a: &impl Answerer, l: &pp::Lookup, owner: Session, scope: &Scope) -> pp::LookupResult {
    let (reg, (unlock, keys)) = (a.reg(), (slices(&l.unlock_first), slices(&l.keys)));
    let unlocked = chunked(&unlock, |c| reg.unlock_as(c, a.now_ms(), owner));
    let hits = chunked(&keys, |c| reg.lookup_and_lock_in(c, l.ttl_ms, a.now_ms(), owner, scope));
    // A follower's hold names each hit's tenant, read after the lock: a
    // locked key cannot change tenant.
    let tenants = if l.hold { reg.tenants_of(&keys) } else { vec![] };
    lookup_result(&unlocked, &hits, tenants.into_iter().map(Option::unwrap_or_default).collect())
}

fn unlocked(a: &impl Answerer, keys: &[&[u8]], owner: Session) -> R {
    let out = chunked(keys, |c| a.reg().unlock_as(c, a.now_ms(), owner));
    R::Unlock(pp::Statuses { statuses: out.iter().map(status_of).collect() })
}

fn slices(keys: &[Bytes]) -> Vec<&[u8]> {
    keys.iter().map(|k| &k[..]).collect()
}
