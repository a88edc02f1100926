//! The handler: this node's store. It validates batches, places objects in
//! the node's own regions (`regions.rs`), writes their records, and asks the
//! registry (through the async `Directory`: in this process, or forwarded to
//! the cluster's primary) for metadata. Byte access for the inline path.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::error::{Error, ErrorKind, Result};
use crate::ids::ReservationId;
use crate::peer_proto::TokenHint;
use crate::pool::{Mapping, NodeId, Pool, RecordBatch};
use crate::rebuild::RebuildReport;
use crate::regions::{Held, Regions};
use crate::registry::directory::{Looked, ReserveCall};
use crate::registry::{Admit, Directory, Listed, Location, Removed, Scope, Session};

mod claim;
mod limits;
mod piggyback;
mod place;
mod start;
mod stats;

pub use claim::{claim_off_runtime, Claimer, LocalClaimer};
pub use limits::{Limits, MAX_TENANT_BYTES};
pub use piggyback::CommitThenReserve;
pub use start::Joined;
pub use stats::{RegionView, Stats};

/// Per-key unlock results, lookup hits, the lock TTL applied.
pub type UnlockThenLookup = (Vec<Result<()>>, Vec<Result<Option<Location>>>, u64);

/// Rounds of "evict the shortfall, place what now fits" in one reserve.
const EVICT_ROUNDS: usize = 3;
/// Times a reserve that found no room waits for other reserves' pages in
/// flight, and how long each time at most.
const SETTLES: usize = 3;
const SETTLE_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// Who a reserve writes for, through its rounds: its tenant, the token ids
/// its items came with, its session, whether the sidecar writes the bytes
/// itself, and whether the registry's reserve judges the items (it is
/// remote: the primary decides admission).
#[derive(Clone, Copy)]
pub(crate) struct Writer<'a> {
    pub tenant: &'a str,
    pub hints: &'a [TokenHint],
    pub owner: Session,
    pub server_writes: bool,
    pub judge: bool,
}

pub struct ReserveResult {
    pub results: Vec<Result<(ReservationId, Location)>>,
    pub evicted: u32,
}

/// A reservation made through this node: only its owner may commit it, and
/// its record is written here (the node owns the region's page table).
#[derive(Clone, Copy)]
struct Pending {
    loc: Location,
    owner: Session,
    since_ms: u64,
    /// The commit sequence the registry gave the reservation.
    seq: u64,
}

pub struct Handler {
    pool: Arc<Pool>,
    node: NodeId,
    dir: Arc<dyn Directory>,
    regions: Regions,
    claimer: Arc<dyn Claimer>,
    /// One region claim at a time (a claim may be a call to the primary).
    claiming: tokio::sync::Mutex<()>,
    limits: Limits,
    page_size: u64,
    epoch: Instant,
    /// What clients know this node's registry by (see `instance_id`).
    instance_id: std::sync::atomic::AtomicU64,
    pending: Mutex<HashMap<ReservationId, Pending>>,
    /// Objects that were being written when the previous process died:
    /// their pages stay out of use until (monotonic ms) a writer that may
    /// still be copying under its old reservation has given up.
    quarantine: Mutex<Vec<(u64, Location)>>,
    rebuilt: Mutex<RebuildReport>,
    /// Regions whose records said "being written" when this handler started
    /// (its own and, on a cluster's primary, every node's).
    being_written: Mutex<Vec<crate::pool::RegionId>>,
}

impl Handler {
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
    /// Random per process, and new whenever the registry that holds this
    /// node's clients' locks is another one (a follower whose primary
    /// restarted or was replaced): clients use it to notice that their locks
    /// and locations are gone.
    pub fn instance_id(&self) -> u64 {
        self.instance_id.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The registry behind this node changed (`instance_id`).
    pub fn new_instance(&self) {
        self.instance_id.store(rand::random::<u64>() | 1, std::sync::atomic::Ordering::Release);
    }
    pub fn node(&self) -> NodeId {
        self.node
    }
    pub fn pool(&self) -> &Pool {
        &self.pool
    }
    pub fn pool_arc(&self) -> Arc<Pool> {
        self.pool.clone()
    }
    pub fn limits(&self) -> &Limits {
        &self.limits
    }
    /// This node may write into its regions now (a follower: its lease
    /// from the primary holds).
    pub fn may_write(&self) -> bool {
        self.dir.may_write()
    }
    pub fn directory(&self) -> &dyn Directory {
        self.dir.as_ref()
    }
    pub fn policy_name(&self) -> String {
        self.dir.policy_name()
    }
    /// Regions that held objects being written when this handler started:
    /// clients of the previous instance may still copy into them.
    pub fn regions_being_written(&self) -> Vec<crate::pool::RegionId> {
        self.being_written.lock().unwrap().clone()
    }
    /// What the start-up rebuild found.
    pub fn rebuilt(&self) -> RebuildReport {
        *self.rebuilt.lock().unwrap()
    }
    /// Largest object: a region, and below 4 GiB (registry entries are packed).
    pub fn max_object_size(&self) -> u64 {
        self.pool.superblock().region_size.min(u32::MAX as u64)
    }
    /// Region space this node may own.
    pub fn capacity_bytes(&self) -> u64 {
        let n = self.pool.region_count();
        let n = if self.limits.max_regions == 0 { n } else { n.min(self.limits.max_regions) };
        n as u64 * self.pool.superblock().region_size
    }
    pub fn regions(&self) -> &Regions {
        &self.regions
    }

    fn check_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<()> {
        self.check_batch(keys.len())?;
        for (i, k) in keys.iter().enumerate() {
            let n = k.as_ref().len();
            if n == 0 || n > self.limits.max_key_bytes {
                return Err(Error::invalid(format!(
                    "key #{i} is {n} bytes; keys must be 1..={} bytes",
                    self.limits.max_key_bytes
                )));
            }
        }
        Ok(())
    }

    fn check_batch(&self, n: usize) -> Result<()> {
        if n > self.limits.max_batch {
            return Err(Error::invalid(format!("batch of {n} exceeds the limit of {}", self.limits.max_batch)));
        }
        Ok(())
    }

    fn check_items(&self, tenant: &str, items: &[(Vec<u8>, u64)]) -> Result<()> {
        self.check_keys(&items.iter().map(|i| &i.0).collect::<Vec<_>>())?;
        if tenant.len() > self.limits.max_tenant_bytes {
            return Err(Error::invalid(format!("tenant is longer than {} bytes", self.limits.max_tenant_bytes)));
        }
        let max = self.max_object_size();
        for (i, (_, size)) in items.iter().enumerate() {
            if *size == 0 || *size > max {
                return Err(Error::invalid(format!("item #{i} has size {size}; sizes must be 1..={max} bytes")));
            }
        }
        Ok(())
    }

    /// Reserve pages for each item; evicts inside the call when short.
    /// `owner` alone may commit or abort the reservations; with
    /// `server_writes` the sidecar writes the bytes itself (inline put).
    ///
    /// Stages: validate → find keys present → place what fits (claiming a
    /// region when the owned ones are full) → record, asking the registry
    /// to evict the shortfall among this node's entries in the same call →
    /// place what now fits, and so on while evictions free pages. No lock
    /// is held across stages; one registry call per round.
    pub async fn reserve(
        &self,
        tenant: &str,
        items: Vec<(Vec<u8>, u64)>,
        owner: Session,
        server_writes: bool,
    ) -> Result<ReserveResult> {
        self.reserve_with(tenant, items, &[], owner, server_writes, true).await
    }

    /// `reserve`, with the token ids a client handed for some items
    /// (`hints`, one per item or none), carried with each reservation to
    /// the registry for its commit's event; and with `judged`, admission
    /// decides first which items are worth a place (those it declines are
    /// NotAdmitted: nothing placed, reserved or evicted for them), else every
    /// item is stored (a client's buffers that no reader will ask for).
    pub async fn reserve_with(
        &self,
        tenant: &str,
        items: Vec<(Vec<u8>, u64)>,
        hints: &[TokenHint],
        owner: Session,
        server_writes: bool,
        judged: bool,
    ) -> Result<ReserveResult> {
        self.check_items(tenant, &items)?;
        if !self.dir.may_write() {
            // Its lease is shorter than the time after which the primary
            // declares it dead and may hand its regions to another node.
            return Err(Error::new(ErrorKind::Unavailable, "cut off from the cluster's primary: not writing"));
        }
        let wanted = self.wanted(&items, judged).await?;
        let mut results: Vec<Option<Result<(ReservationId, Location)>>> = (0..items.len()).map(|_| None).collect();
        let mut todo = vec![];
        for (idx, ((key, size), want)) in items.into_iter().zip(wanted).enumerate() {
            match want {
                Admit::Admitted => todo.push((idx, key, size)),
                Admit::Present => {
                    results[idx] =
                        Some(Err(Error::new(ErrorKind::AlreadyExists, "key is already stored or being written")))
                }
                Admit::Refused => results[idx] = Some(Err(Error::not_admitted())),
            }
        }
        // Where the registry is remote, its reserve judges (the primary
        // decides for the pool).
        let who = Writer { tenant, hints, owner, server_writes, judge: judged && !self.dir.is_local() };
        let mut evicted = 0u32;
        for settle in 0..=SETTLES {
            let (mark, evicted_before) = (self.regions.placing_mark(), evicted);
            todo = self.place_and_reserve(&who, todo, &mut results, &mut evicted).await?;
            // Pages another reserve placed and has not yet reserved or given
            // back (a client past its pin limit places all it asks for
            // before the registry refuses the rest) come back in a moment:
            // when another reserve was placing during this one, wait for it
            // and try again, a few times, before calling the pool full; and
            // go on while evicting still frees pages. Otherwise the room
            // there is was all there is: trying again would repeat the same
            // failures (a storm of reserves that cannot be placed would
            // cost each one that many times over).
            let progress = evicted > evicted_before;
            if todo.is_empty() || settle == SETTLES || !(progress || mark.others_since(&self.regions)) {
                break;
            }
            self.regions.settled(SETTLE_WAIT).await;
        }
        for (idx, _, _) in todo {
            results[idx] = Some(Err(Error::new(
                ErrorKind::ResourceExhausted,
                "no space: no free region, and every entry left is in use (locked or being written)",
            )));
        }
        Ok(ReserveResult { results: results.into_iter().map(|r| r.expect("every item answered")).collect(), evicted })
    }

    /// Reserve what was placed (evicting `shortfall` pages of this node's
    /// entries on the way); returns what was evicted, for the caller to
    /// release (or place into).
    #[allow(clippy::type_complexity)]
    async fn reserve_placed(
        &self,
        who: &Writer<'_>,
        placed: Vec<(usize, Vec<u8>, Location)>,
        shortfall: u64,
        results: &mut [Option<Result<(ReservationId, Location)>>],
    ) -> Result<Vec<Location>> {
        let Writer { tenant, hints, owner, server_writes, judge } = *who;
        let call = ReserveCall {
            node: self.node,
            tenant,
            items: placed.iter().map(|(_, k, l)| (k.clone(), *l)).collect(),
            owner,
            server_writes,
            timeout_ms: self.limits.reservation_timeout_ms,
            shortfall_pages: shortfall,
            page_size: self.page_size,
            hints: if hints.is_empty() {
                vec![]
            } else {
                placed.iter().map(|(i, _, _)| hints.get(*i).cloned().unwrap_or_default()).collect()
            },
        };
        // On the cluster's primary the registry passes it through the gate
        // a phase 3 victim choice shares (a region being taken back refuses
        // its items).
        let out = self.dir.reserve_judging(call, judge).await;
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                self.regions.release(&placed.iter().map(|p| p.2).collect::<Vec<_>>());
                return Err(e);
            }
        };
        if out.ids.iter().any(|r| r.as_ref().is_err_and(|e| e.kind() == ErrorKind::ResourceExhausted)) {
            self.drop_lost_regions();
        }
        self.record_reserved(placed, out.ids, out.seqs, owner, results);
        Ok(out.freed)
    }

    /// Pages to evict ahead of need where the registry is remote and no
    /// region can be claimed: keeping a low-water mark of free pages (an
    /// eighth of a region) lets the next reserve place everything at once,
    /// so a store stays one forwarded call even on a full node.
    fn evict_ahead(&self) -> u64 {
        if self.dir.is_local() {
            return 0;
        }
        let claimable = !self.regions.at_cap()
            && self.pool.region_ids().any(|r| matches!(self.pool.region_state(r), Ok(s) if s.owner.is_none()));
        if claimable {
            return 0;
        }
        (self.regions.pages_per_region() as u64 / 8).saturating_sub(self.regions.free_pages())
    }

    /// Per item: present (stored or being written, or repeated earlier in
    /// the batch), declined by admission (when `judged`), or to store.
    /// Asked only where the registry is in this process (each key once:
    /// a judgement is a touch admission remembers); a primary answers it
    /// in the reserve itself.
    async fn wanted(&self, items: &[(Vec<u8>, u64)], judged: bool) -> Result<Vec<Admit>> {
        let mut seen = hashbrown::HashSet::with_capacity(items.len());
        let first: Vec<bool> = items.iter().map(|i| seen.insert(i.0.as_slice())).collect();
        if !self.dir.is_local() {
            return Ok(first.iter().map(|&f| if f { Admit::Admitted } else { Admit::Present }).collect());
        }
        let asked: Vec<(&[u8], u64)> =
            items.iter().zip(&first).filter(|(_, &f)| f).map(|(i, _)| (&i.0[..], i.1)).collect();
        let mut answers = if judged {
            self.dir.admit(&asked).await?
        } else {
            let keys: Vec<&[u8]> = asked.iter().map(|a| a.0).collect();
            self.dir
                .present(&keys)
                .await?
                .into_iter()
                .map(|p| if p { Admit::Present } else { Admit::Admitted })
                .collect()
        }
        .into_iter();
        Ok(first.iter().map(|&f| if f { answers.next().unwrap_or(Admit::Present) } else { Admit::Present }).collect())
    }

    #[allow(clippy::type_complexity)]
    fn record_reserved(
        &self,
        placed: Vec<(usize, Vec<u8>, Location)>,
        ids: Vec<Result<ReservationId>>,
        seqs: Vec<u64>,
        owner: Session,
        results: &mut [Option<Result<(ReservationId, Location)>>],
    ) {
        let now = self.now_ms();
        let mut lost = vec![];
        let mut pending = self.pending.lock().unwrap();
        for (((idx, _, loc), r), seq) in placed.into_iter().zip(ids).zip(seqs) {
            match r {
                Ok(id) => {
                    pending.insert(id, Pending { loc, owner, since_ms: now, seq });
                    results[idx] = Some(Ok((id, loc)));
                }
                Err(e) => {
                    lost.push(loc);
                    results[idx] = Some(Err(e));
                }
            }
        }
        drop(pending);
        self.regions.release(&lost);
    }

    /// Per-id outcome plus the removal-log position at commit time.
    /// `crc32`: empty, or the payload's crc32 (IEEE) per id, recorded in the
    /// pool so inline reads (and mapped readers that ask) can verify bytes.
    ///
    /// The record says "committed" before the key becomes visible (a
    /// restart keeps exactly what was published, and nothing half written);
    /// it is written only while the reservation's pages are still its own.
    pub async fn commit(
        &self,
        ids: &[ReservationId],
        crc32: &[u32],
        owner: Session,
    ) -> Result<(Vec<Result<Location>>, u64)> {
        self.check_commit(ids, crc32)?;
        let (send, early) = self.publish_records(ids, crc32, owner);
        let (out, removed_seq) = self.dir.commit(&send.iter().map(|s| s.0).collect::<Vec<_>>(), owner).await?;
        // The registry refused these (their reservation expired, or the
        // primary restarted and never knew them): their records must not
        // say "committed", or a rebuild would bring back a version no client
        // was told was stored. Their pages are freed with them.
        let refused: Vec<Location> = send.iter().zip(&out).filter(|(_, r)| r.is_err()).map(|(s, _)| s.1).collect();
        self.regions.release(&refused);
        let mut out = out.into_iter();
        let merged = early.into_iter().map(|e| match e {
            Some(e) => Err(e),
            None => out.next().expect("one result per id sent"),
        });
        Ok((merged.collect(), removed_seq))
    }

    /// Write the batch's records as committed, fenced once before this
    /// returns (so before any key is published): the ids to send to the
    /// registry, and the errors of the others by position. The locks are
    /// taken once for the batch (see `Regions::hold`).
    fn publish_records(
        &self,
        ids: &[ReservationId],
        crc32: &[u32],
        owner: Session,
    ) -> (Vec<(ReservationId, Location)>, Vec<Option<Error>>) {
        let mut early: Vec<Option<Error>> = vec![None; ids.len()];
        let mut send = vec![];
        let records = self.pool.record_batch();
        let mut pending = self.pending.lock().unwrap();
        let held = self.regions.hold();
        for (i, id) in ids.iter().enumerate() {
            let crc = crc32.get(i).copied();
            match self.publish_record(&records, &mut pending, &held, *id, owner, crc) {
                Ok(loc) => send.push((*id, loc)),
                Err(e) => early[i] = Some(e),
            }
        }
        (send, early)
    }

    /// A commit batch is well formed (checked before anything is applied).
    fn check_commit(&self, ids: &[ReservationId], crc32: &[u32]) -> Result<()> {
        self.check_batch(ids.len())?;
        if !crc32.is_empty() && crc32.len() != ids.len() {
            return Err(Error::invalid(format!("{} checksums for {} reservations", crc32.len(), ids.len())));
        }
        if crc32.is_empty() && self.limits.require_checksum && !ids.is_empty() {
            return Err(Error::invalid("this sidecar requires a payload checksum with every commit"));
        }
        Ok(())
    }

    /// Write reservation `id`'s record as committed. Only reservations made
    /// through this node can be committed here; another session's is
    /// refused before its record could be touched.
    fn publish_record(
        &self,
        records: &RecordBatch<'_>,
        pending: &mut HashMap<ReservationId, Pending>,
        held: &Held<'_>,
        id: ReservationId,
        owner: Session,
        crc: Option<u32>,
    ) -> Result<Location> {
        let p = *Self::own_reservation(pending.get(&id), owner)?;
        pending.remove(&id);
        let page = p.loc.offset / self.page_size;
        // Pages freed meanwhile (the reservation expired): leave their
        // record alone; the registry answers NOT_FOUND.
        held.if_current(&p.loc, || records.commit(p.loc.region, page, p.seq, crc))?;
        Ok(p.loc)
    }

    /// Abort reservations made through this node by `owner`; as for a
    /// commit, an id this node did not hand out is NOT_FOUND (another
    /// node's reservation included) and another session's PERMISSION_DENIED,
    /// before anything is asked of the registry.
    pub async fn abort(&self, ids: &[ReservationId], owner: Session) -> Result<Vec<Result<Location>>> {
        self.check_batch(ids.len())?;
        let early: Vec<Option<Error>> = {
            let pending = self.pending.lock().unwrap();
            ids.iter().map(|id| Self::own_reservation(pending.get(id), owner).err()).collect()
        };
        let send: Vec<ReservationId> = ids.iter().zip(&early).filter(|(_, e)| e.is_none()).map(|(id, _)| *id).collect();
        let out = if send.is_empty() { vec![] } else { self.dir.abort(&send, owner).await? };
        {
            let mut pending = self.pending.lock().unwrap();
            for (id, r) in send.iter().zip(&out) {
                if r.is_ok() {
                    pending.remove(id);
                }
            }
        }
        self.regions.release(&out.iter().filter_map(|r| r.as_ref().ok().copied()).collect::<Vec<_>>());
        let mut out = out.into_iter();
        Ok(early.into_iter().map(|e| e.map_or_else(|| out.next().expect("one result per id sent"), Err)).collect())
    }

    /// A reservation made through this node, by `owner`.
    fn own_reservation(p: Option<&Pending>, owner: Session) -> Result<&Pending> {
        let p = p.ok_or_else(|| {
            Error::new(ErrorKind::NotFound, "no open reservation with this id (expired or never made)")
        })?;
        if p.owner != owner {
            return Err(Error::new(ErrorKind::PermissionDenied, "reservation belongs to another session"));
        }
        Ok(p)
    }

    /// Returns per-key hits (locked for `owner`) and the lock TTL used.
    pub async fn lookup_and_lock<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        ttl_ms: u64,
        owner: Session,
    ) -> Result<(Vec<Option<Location>>, u64)> {
        let none: [&[u8]; 0] = [];
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_ref()).collect();
        let (_, hits, ttl) = self.unlock_then_lookup(&none, &keys, ttl_ms, owner, &Scope::All).await?;
        Ok((hits.into_iter().map(|h| h.ok().flatten()).collect(), ttl))
    }

    /// Release `unlock` (as `unlock`), then look up and lock `keys`, all for
    /// `owner`; keys of tenants outside `scope` are PermissionDenied per key.
    /// Both batches are validated first, so on an error nothing was applied.
    pub async fn unlock_then_lookup<K: AsRef<[u8]>>(
        &self,
        unlock: &[K],
        keys: &[K],
        ttl_ms: u64,
        owner: Session,
        scope: &Scope,
    ) -> Result<UnlockThenLookup> {
        self.check_keys(unlock)?;
        self.check_keys(keys)?;
        let ttl = self.lock_ttl(ttl_ms)?;
        let (unlock, keys): (Vec<&[u8]>, Vec<&[u8]>) =
            (unlock.iter().map(|k| k.as_ref()).collect(), keys.iter().map(|k| k.as_ref()).collect());
        let (unlocked, hits): Looked = self.dir.lookup(&unlock, &keys, ttl, owner, scope).await?;
        Ok((unlocked, hits, ttl))
    }

    fn lock_ttl(&self, ttl_ms: u64) -> Result<u64> {
        let ttl = if ttl_ms == 0 { self.limits.default_lock_ttl_ms } else { ttl_ms };
        if ttl > self.limits.max_lock_ttl_ms {
            return Err(Error::invalid(format!(
                "lock TTL {ttl} ms exceeds the limit of {} ms",
                self.limits.max_lock_ttl_ms
            )));
        }
        Ok(ttl)
    }

    /// Release one of `owner`'s locks per key.
    pub async fn unlock<K: AsRef<[u8]>>(&self, keys: &[K], owner: Session) -> Result<Vec<Result<()>>> {
        self.check_keys(keys)?;
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_ref()).collect();
        self.dir.unlock(&keys, owner).await
    }

    /// A client connection closed: the locks it held are released.
    pub async fn session_closed(&self, owner: Session) -> Result<u64> {
        self.dir.release_session(owner).await
    }

    pub async fn delete<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Result<Location>>> {
        self.delete_in(keys, &Scope::All).await
    }

    /// Delete keys of `scope`'s tenants (others: PermissionDenied per key).
    pub async fn delete_in<K: AsRef<[u8]>>(&self, keys: &[K], scope: &Scope) -> Result<Vec<Result<Location>>> {
        self.check_keys(keys)?;
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_ref()).collect();
        let out = self.dir.delete(&keys, scope).await?;
        // Locations in other nodes' regions: their owners get a free notice.
        self.regions.release(&out.iter().filter_map(|r| r.as_ref().ok().copied()).collect::<Vec<_>>());
        Ok(out)
    }

    /// Committed keys of `scope`'s tenants (another tenant's key is false).
    pub async fn exists<K: AsRef<[u8]>>(&self, keys: &[K], scope: &Scope) -> Result<Vec<bool>> {
        self.check_keys(keys)?;
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_ref()).collect();
        self.dir.exists(&keys, scope).await
    }

    /// Keys of `tenant` (or of every tenant) that `scope` shows.
    pub async fn list(&self, cursor: u64, limit: u32, tenant: Option<&str>, scope: &Scope) -> Result<Listed> {
        let limit = if limit == 0 { 500 } else { limit };
        if limit > 10_000 {
            return Err(Error::invalid(format!("page size {limit} exceeds 10000")));
        }
        if let Some(t) = tenant.filter(|t| !scope.allows(t)) {
            return Err(Scope::denied(format_args!("tenant {t:?}")));
        }
        self.dir.list(cursor, limit as usize, tenant, scope).await
    }

    pub async fn removed_since(&self, since: u64, max: u32) -> Result<(Vec<Removed>, u64, bool)> {
        let max = if max == 0 { 1000 } else { max };
        if max > 10_000 {
            return Err(Error::invalid(format!("max {max} exceeds 10000")));
        }
        self.dir.removed_since(since, max as usize).await
    }

    /// The payload checksum recorded for `loc` at commit, if any, while the
    /// object is still there (None also when its pages were freed).
    pub fn payload_crc(&self, loc: &Location) -> Result<Option<u32>> {
        self.refresh_foreign(loc)?;
        self.pool.page_crc(loc.region, loc.offset / self.page_size)
    }

    /// Another node's object: its slot is read as its owner last flushed it.
    fn refresh_foreign(&self, loc: &Location) -> Result<()> {
        if loc.node == self.node {
            return Ok(()); // this node wrote the slot: never invalidate own lines
        }
        self.pool.refresh_slot(loc.region, loc.offset / self.page_size)
    }

    /// Whether `loc` still names the object it named when handed out.
    pub fn still_there(&self, loc: &Location) -> Result<bool> {
        let first = loc.offset / self.page_size;
        self.refresh_foreign(loc)?;
        Ok(self.pool.region_state(loc.region)?.generation == loc.generation
            && self.pool.page_version(loc.region, first)? == loc.version)
    }

    /// Free pages of locations that were let go of elsewhere (free notices).
    pub fn release(&self, freed: &[Location]) {
        self.regions.release(freed);
    }

    /// Periodic housekeeping: reclaim expired reservations and locks (where
    /// the registry lives), quarantined pages whose writers have surely
    /// given up, and forget reservations nobody will commit any more.
    pub async fn reap(&self) -> Result<usize> {
        let now = self.now_ms();
        let mut freed = self.dir.expire().await?;
        {
            let mut q = self.quarantine.lock().unwrap();
            freed.extend(q.iter().filter(|(t, _)| *t <= now).map(|(_, l)| *l));
            q.retain(|(t, _)| *t > now);
        }
        let stale = now.saturating_sub(2 * self.limits.reservation_timeout_ms);
        self.pending.lock().unwrap().retain(|_, p| p.since_ms >= stale);
        self.regions.release(&freed);
        self.drop_lost_regions();
        Ok(freed.iter().filter(|l| l.node == self.node).count())
    }

    /// Stop writing into regions the region table no longer gives this
    /// node (taken back while it did not hear of it, or a damaged entry the
    /// primary repairs): checked by housekeeping, and after a reserve whose
    /// items the primary refused for their region.
    fn drop_lost_regions(&self) {
        for r in self.regions.verify() {
            tracing::warn!(region = r.0, "the region table no longer gives this node a region it used: dropped");
        }
    }

    /// Mapping that holds `loc` (owned: read-write; other nodes': read-only).
    pub fn mapping_for(&self, loc: &Location) -> Result<Arc<Mapping>> {
        let writable = loc.node == self.node;
        let m = self.pool.map_region(loc.region, writable)?;
        if loc.offset + loc.length > m.len() as u64 {
            return Err(Error::new(ErrorKind::Internal, format!("location {loc:?} outside its region")));
        }
        Ok(m)
    }
}
