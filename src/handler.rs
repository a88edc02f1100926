//! The handler: this node's owned regions (one page allocator each), region
//! claiming and re-adoption, eviction inside reserve, and byte access for the
//! inline path. It calls the registry for metadata and the pool for memory.
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::allocator::PageAllocator;
use crate::error::{Error, ErrorKind, Result};
use crate::pool::record::{overflow_len, ObjectRecord, RecordState};
use crate::pool::{Mapping, Pool};
use crate::rebuild::{scan_region, RebuildReport};
use crate::registry::{pages_for, Freed, KeyInfo, Location, Registry, RegistryStats, ReserveOpts, Scope, Session};

/// Keys per registry call inside one request: bounds how long one request
/// holds the registry's lock (a few tens of microseconds).
const REGISTRY_CHUNK: usize = 256;

/// Per-key unlock results, lookup hits, the lock TTL applied.
pub type UnlockThenLookup = (Vec<Result<()>>, Vec<Result<Option<Location>>>, u64);

#[derive(Debug, Clone)]
pub struct Limits {
    /// 0 = as many regions as the pool has.
    pub max_regions: u32,
    pub reservation_timeout_ms: u64,
    pub default_lock_ttl_ms: u64,
    pub max_lock_ttl_ms: u64,
    pub max_key_bytes: usize,
    pub max_tenant_bytes: usize,
    pub max_batch: usize,
    pub prefault: bool,
    /// Refuse commits without a payload checksum (see `commit`).
    pub require_checksum: bool,
}

/// Longest tenant name (LMCache `cache_salt`) accepted.
pub const MAX_TENANT_BYTES: usize = 256;

impl Limits {
    /// The limits a configuration sets: the config's defaults are the only
    /// defaults (config/cxlkv.toml lists them).
    pub fn from_config(cfg: &crate::config::Config) -> Self {
        let r = &cfg.registry;
        Self {
            max_regions: r.max_regions_per_instance,
            reservation_timeout_ms: r.reservation_timeout_ms,
            default_lock_ttl_ms: r.lock_ttl_ms,
            max_lock_ttl_ms: r.max_lock_ttl_ms,
            max_key_bytes: r.max_key_bytes,
            max_tenant_bytes: MAX_TENANT_BYTES,
            max_batch: r.max_batch,
            prefault: cfg.pool.prefault,
            require_checksum: r.require_checksum,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self::from_config(&crate::config::Config::default())
    }
}

struct Owned {
    id: u32,
    generation: u64,
    alloc: PageAllocator,
}

#[derive(Default)]
struct OwnedRegions {
    list: Vec<Owned>,
    by_id: HashMap<u32, usize>,
    active: usize,
}

pub struct ReserveResult {
    pub results: Vec<Result<(u64, Location)>>,
    pub evicted: u32,
}

#[derive(Debug, Clone)]
pub struct RegionView {
    pub region: u32,
    pub owner: Option<u32>,
    pub generation: u64,
    pub pages_total: u64,
    pub pages_free: u64,
}

#[derive(Debug, Clone)]
pub struct Stats {
    pub registry: RegistryStats,
    pub pool_bytes: u64,
    pub pages_total: u64,
    pub pages_free: u64,
    pub owned_regions: u32,
    pub regions: Vec<RegionView>,
}

pub struct Handler {
    pool: Arc<Pool>,
    node: u32,
    registry: Arc<dyn Registry>,
    owned: Mutex<OwnedRegions>,
    limits: Limits,
    page_size: u64,
    pages_per_region: u32,
    epoch: Instant,
    instance_id: u64,
    /// Commit order of this node's objects, written into their records.
    next_seq: AtomicU64,
    /// Objects that were being written when the previous process died:
    /// their pages stay out of use until (monotonic ms) a writer that may
    /// still be copying under its old reservation has given up.
    quarantine: Mutex<Vec<(u64, Location)>>,
    rebuilt: RebuildReport,
}

impl Handler {
    /// Take over this node's regions (after a restart they start a new
    /// generation), rebuild the registry from their object records, and make
    /// sure at least one region is ready.
    pub fn new(pool: Arc<Pool>, node: u32, registry: Arc<dyn Registry>, limits: Limits) -> Result<Self> {
        let sb = pool.superblock();
        let page_size = sb.page_size;
        let mut h = Self {
            pages_per_region: (sb.region_size / page_size) as u32,
            pool: pool.clone(),
            node,
            registry,
            owned: Mutex::new(OwnedRegions::default()),
            limits,
            page_size,
            epoch: Instant::now(),
            instance_id: u64::from_le_bytes(uuid::Uuid::new_v4().as_bytes()[..8].try_into().expect("8 bytes")),
            next_seq: AtomicU64::new(1),
            quarantine: Mutex::new(vec![]),
            rebuilt: RebuildReport::default(),
        };
        let mut report = RebuildReport::default();
        let (mut found, mut writing) = (vec![], vec![]);
        {
            let mut o = h.owned.lock().unwrap();
            for r in pool.regions_owned_by(node) {
                let before = pool.region_state(r)?.generation;
                let generation = pool.renew_region(r, node)?;
                let scan = scan_region(&pool, node, r, before, generation, &mut report)?;
                h.adopt(&mut o, r, generation, &scan.used)?;
                tracing::info!(region = r, generation, objects = scan.committed.len(), "re-attached owned region");
                found.extend(scan.committed);
                writing.extend(scan.writing);
            }
            if o.list.is_empty() {
                h.claim(&mut o)?;
            }
        }
        found.sort_by_key(|f| f.seq);
        h.next_seq = AtomicU64::new(found.last().map_or(1, |f| f.seq + 1));
        let restored = h.registry.restore(found.into_iter().map(|f| (f.key, f.tenant, f.loc)).collect());
        let until = h.now_ms() + h.limits.reservation_timeout_ms;
        *h.quarantine.get_mut().unwrap() = writing.into_iter().map(|l| (until, l)).collect();
        if report != RebuildReport::default() {
            tracing::info!(?report, restored, "rebuilt the registry from the pool's object records");
        }
        h.rebuilt = report;
        Ok(h)
    }

    /// What the start-up rebuild found.
    pub fn rebuilt(&self) -> RebuildReport {
        self.rebuilt
    }

    fn adopt(&self, o: &mut OwnedRegions, r: u32, generation: u64, used: &[(u32, u32)]) -> Result<()> {
        let map = self.pool.map_region(r, true)?;
        if self.limits.prefault {
            map.prefault()?;
        }
        let alloc = PageAllocator::with_used(self.pages_per_region, used)?;
        o.by_id.insert(r, o.list.len());
        o.list.push(Owned { id: r, generation, alloc });
        o.active = o.list.len() - 1;
        Ok(())
    }

    /// Claim one more region if the cap and the pool allow it.
    fn claim(&self, o: &mut OwnedRegions) -> Result<bool> {
        if self.at_region_cap(o) {
            return Ok(false);
        }
        let Some(r) = self.pool.claim_region(self.node)? else { return Ok(false) };
        let generation = self.pool.region_state(r)?.generation;
        let t = Instant::now();
        self.adopt(o, r, generation, &[])?;
        tracing::info!(region = r, generation, ms = t.elapsed().as_millis() as u64, "claimed region");
        Ok(true)
    }

    /// Claim and prefault the next region before the owned ones run out, so
    /// a store rarely waits for a prefault. The slow part runs without the
    /// owned-regions lock; call it from housekeeping, off the async runtime.
    pub fn claim_ahead(&self) -> Result<bool> {
        {
            let o = self.owned.lock().unwrap();
            let free: u64 = o.list.iter().map(|r| r.alloc.free_pages() as u64).sum();
            if free * 4 >= self.pages_per_region as u64 || self.at_region_cap(&o) {
                return Ok(false);
            }
        }
        let Some(r) = self.pool.claim_region(self.node)? else { return Ok(false) };
        let generation = self.pool.region_state(r)?.generation;
        let map = self.pool.map_region(r, true)?;
        if self.limits.prefault {
            map.prefault()?;
        }
        let mut o = self.owned.lock().unwrap();
        if self.at_region_cap(&o) {
            // A reserve claimed one meanwhile: give this one back.
            drop(o);
            self.pool.release_region(r, self.node)?;
            return Ok(false);
        }
        let i = o.list.len();
        o.by_id.insert(r, i);
        o.list.push(Owned { id: r, generation, alloc: PageAllocator::new(self.pages_per_region) });
        tracing::info!(region = r, generation, "claimed region ahead of need");
        Ok(true)
    }

    fn at_region_cap(&self, o: &OwnedRegions) -> bool {
        self.limits.max_regions > 0 && o.list.len() as u32 >= self.limits.max_regions
    }

    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
    /// Random per process; clients use it to notice a restart.
    pub fn instance_id(&self) -> u64 {
        self.instance_id
    }
    pub fn node(&self) -> u32 {
        self.node
    }
    pub fn pool(&self) -> &Pool {
        &self.pool
    }
    pub fn limits(&self) -> &Limits {
        &self.limits
    }
    pub fn registry(&self) -> &dyn Registry {
        self.registry.as_ref()
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

    fn check_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<()> {
        if keys.len() > self.limits.max_batch {
            return Err(Error::invalid(format!(
                "batch of {} exceeds the limit of {}",
                keys.len(),
                self.limits.max_batch
            )));
        }
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

    fn alloc_owned(o: &mut OwnedRegions, pages: u32) -> Option<(usize, u32)> {
        let n = o.list.len();
        let start = o.active;
        for step in 0..n {
            let i = (start + step) % n;
            if let Some(p) = o.list[i].alloc.alloc(pages) {
                o.active = i;
                return Some((i, p));
            }
        }
        None
    }

    /// Free pages of locations the registry let go of.
    fn release(&self, o: &mut OwnedRegions, freed: &Freed) {
        for loc in freed {
            if loc.node != self.node {
                continue;
            }
            let Some(&i) = o.by_id.get(&loc.region) else { continue };
            let r = &mut o.list[i];
            if r.generation != loc.generation {
                continue; // from before a restart; the allocator was rebuilt
            }
            let first = (loc.offset / self.page_size) as u32;
            // The block may be longer than the payload (a long name follows it).
            let Some(pages) = r.alloc.block_len(first) else {
                tracing::error!(?loc, "registry released a location the allocator does not know");
                continue;
            };
            // Readers of this object must see it is gone, and a rebuild must
            // not bring it back, before anyone else can be given these pages.
            if let Err(e) = self.pool.retire_pages(loc.region, first as u64, pages as u64) {
                tracing::error!(error = %e, ?loc, "cannot retire pages; keeping them out of use");
                continue;
            }
            if let Err(e) = r.alloc.free(first, pages) {
                tracing::error!(error = %e, ?loc, "registry released a location the allocator does not know");
            }
        }
    }

    fn release_now(&self, freed: &Freed) {
        if !freed.is_empty() {
            let mut o = self.owned.lock().unwrap();
            self.release(&mut o, freed);
        }
    }

    /// Free pages in owned regions plus what unclaimed regions could add
    /// (the region table is only scanned when owned pages fall short).
    fn available_pages(&self, o: &OwnedRegions, need: u64) -> u64 {
        let free: u64 = o.list.iter().map(|r| r.alloc.free_pages() as u64).sum();
        if free >= need {
            return free;
        }
        let cap = if self.limits.max_regions == 0 { u32::MAX } else { self.limits.max_regions };
        let room = cap.saturating_sub(o.list.len() as u32) as u64;
        let unclaimed =
            (0..self.pool.region_count()).filter(|&r| matches!(self.pool.region_state(r), Ok(s) if s.owner.is_none()));
        free + room.min(unclaimed.count() as u64) * self.pages_per_region as u64
    }

    /// Reserve pages for each item; evicts inside the call when short.
    /// `owner` alone may commit or abort the reservations; with
    /// `server_writes` the sidecar writes the bytes itself (inline put).
    ///
    /// Stages: validate → find keys present → evict the batch's shortfall →
    /// allocate per item → record. No lock is held across stages, and the
    /// registry is asked in chunks, so one large batch never stalls other
    /// clients for longer than a chunk's work.
    pub fn reserve(
        &self,
        tenant: &str,
        items: Vec<(Vec<u8>, u64)>,
        owner: Session,
        server_writes: bool,
    ) -> Result<ReserveResult> {
        self.check_items(tenant, &items)?;
        let now = self.now_ms();
        let wanted = self.wanted(&items);
        let need: u64 =
            items.iter().zip(&wanted).filter(|(_, w)| **w).map(|((_, s), _)| pages_for(*s, self.page_size)).sum();
        let mut evicted = self.evict_shortfall(need, now);
        let mut results: Vec<Option<Result<(u64, Location)>>> = Vec::with_capacity(items.len());
        let mut placed = vec![];
        // Once no region can be claimed and nothing is left to evict, only
        // pages already free can serve the rest of the batch: later items
        // fail fast instead of asking again (nothing frees up mid-batch).
        let mut dry = false;
        let no_space = Error::new(
            ErrorKind::ResourceExhausted,
            "no space: no free region, and every entry left is in use (locked or being written)",
        );
        for (idx, ((key, size), want)) in items.into_iter().zip(wanted).enumerate() {
            if !want {
                results.push(Some(Err(Error::new(ErrorKind::AlreadyExists, "key is already stored or being written"))));
                continue;
            }
            let pages = pages_for(size + overflow_len(tenant, &key), self.page_size) as u32;
            match self.place(size, pages, now, &mut dry, &mut evicted)? {
                Some(loc) => {
                    let rec = ObjectRecord {
                        state: RecordState::Writing,
                        tenant: tenant.to_owned(),
                        key: key.clone(),
                        generation: loc.generation,
                        seq: 0,
                        length: size,
                        payload_crc: None,
                    };
                    self.pool.write_record(loc.region, loc.offset / self.page_size, &rec)?;
                    placed.push((idx, key, loc));
                    results.push(None);
                }
                None => results.push(Some(Err(no_space.clone()))),
            }
        }
        let opts = ReserveOpts { deadline: now + self.limits.reservation_timeout_ms, owner, server_writes };
        let mut lost = vec![];
        for chunk in placed.chunks(REGISTRY_CHUNK) {
            let out = self.registry.reserve(tenant, chunk.iter().map(|(_, k, l)| (k.clone(), *l)).collect(), opts);
            for ((slot, _, loc), r) in chunk.iter().zip(out) {
                results[*slot] = Some(r.map(|id| (id, *loc)).inspect_err(|_| lost.push(*loc)));
            }
        }
        self.release_now(&lost);
        Ok(ReserveResult { results: results.into_iter().map(|r| r.expect("every item answered")).collect(), evicted })
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

    /// Per item: not stored or being written, and not repeated earlier in the
    /// batch. A snapshot (the registry checks again when recording).
    fn wanted(&self, items: &[(Vec<u8>, u64)]) -> Vec<bool> {
        let keys: Vec<&[u8]> = items.iter().map(|i| i.0.as_slice()).collect();
        let present: Vec<bool> = keys.chunks(REGISTRY_CHUNK).flat_map(|c| self.registry.present(c)).collect();
        let mut seen = hashbrown::HashSet::with_capacity(keys.len());
        keys.iter().zip(present).map(|(k, p)| !p && seen.insert(*k)).collect()
    }

    /// Evict once for the whole batch what free and claimable pages cannot
    /// cover; returns how many entries went.
    fn evict_shortfall(&self, need: u64, now: u64) -> u32 {
        let avail = self.available_pages(&self.owned.lock().unwrap(), need);
        if need <= avail {
            return 0;
        }
        let freed = self.registry.evict(self.node, need - avail, self.page_size, now);
        self.release_now(&freed);
        freed.len() as u32
    }

    /// Pages for one object: owned free pages, a newly claimed region, or
    /// pages freed by evicting for this object alone (fragmentation).
    fn place(&self, size: u64, pages: u32, now: u64, dry: &mut bool, evicted: &mut u32) -> Result<Option<Location>> {
        let mut o = self.owned.lock().unwrap();
        let (i, page) = loop {
            if let Some(x) = Self::alloc_owned(&mut o, pages) {
                break x;
            }
            if *dry {
                return Ok(None);
            }
            if self.claim(&mut o)? {
                continue;
            }
            let freed = self.registry.evict(self.node, pages as u64, self.page_size, now);
            if freed.is_empty() {
                *dry = true;
                return Ok(None);
            }
            *evicted += freed.len() as u32;
            self.release(&mut o, &freed);
        };
        let r = &o.list[i];
        Ok(Some(Location {
            node: self.node,
            region: r.id,
            offset: page as u64 * self.page_size,
            length: size,
            generation: r.generation,
            version: self.pool.page_version(r.id, page as u64)?,
        }))
    }

    /// Per-id outcome plus the removal-log position at commit time.
    /// `crc32`: empty, or the payload's crc32 (IEEE) per id, recorded in the
    /// pool so inline reads (and mapped readers that ask) can verify bytes.
    pub fn commit(&self, ids: &[u64], crc32: &[u32], owner: Session) -> Result<(Vec<Result<Location>>, u64)> {
        self.check_batch(ids.len())?;
        if !crc32.is_empty() && crc32.len() != ids.len() {
            return Err(Error::invalid(format!("{} checksums for {} reservations", crc32.len(), ids.len())));
        }
        if crc32.is_empty() && self.limits.require_checksum && !ids.is_empty() {
            return Err(Error::invalid("this sidecar requires a payload checksum with every commit"));
        }
        let (page_size, pool, seq) = (self.page_size, &self.pool, &self.next_seq);
        // The record says "committed" before the key becomes visible; the
        // reservation still holds the pages while this runs.
        let mut publish = |i: usize, loc: &Location| {
            let s = seq.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = pool.commit_record(loc.region, loc.offset / page_size, s, crc32.get(i).copied()) {
                tracing::error!(error = %e, ?loc, "cannot write the object's record");
            }
        };
        Ok(self.registry.commit(ids, owner, &mut publish))
    }

    pub fn abort(&self, ids: &[u64], owner: Session) -> Result<Vec<Result<Location>>> {
        self.check_batch(ids.len())?;
        let out = self.registry.abort(ids, owner);
        self.release_now(&out.iter().filter_map(|r| r.as_ref().ok().copied()).collect());
        Ok(out)
    }

    fn check_batch(&self, n: usize) -> Result<()> {
        if n > self.limits.max_batch {
            return Err(Error::invalid(format!("batch of {n} exceeds the limit of {}", self.limits.max_batch)));
        }
        Ok(())
    }

    /// Returns per-key hits (locked for `owner`) and the lock TTL used.
    pub fn lookup_and_lock<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        ttl_ms: u64,
        owner: Session,
    ) -> Result<(Vec<Option<Location>>, u64)> {
        let (_, hits, ttl) = self.unlock_then_lookup(&[], keys, ttl_ms, owner, &Scope::All)?;
        Ok((hits.into_iter().map(|h| h.ok().flatten()).collect(), ttl))
    }

    /// Release `unlock` (as `unlock`), then look up and lock `keys`, all for
    /// `owner`; keys of tenants outside `scope` are PermissionDenied per key.
    /// Both batches are validated first, so on an error nothing was applied.
    pub fn unlock_then_lookup<K: AsRef<[u8]>>(
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
        let unlocked = self.chunked(&unlock, |c| self.registry.unlock_as(c, self.now_ms(), owner));
        let hits = self.chunked(&keys, |c| self.registry.lookup_and_lock_in(c, ttl, self.now_ms(), owner, scope));
        Ok((unlocked, hits, ttl))
    }

    /// One registry call per `REGISTRY_CHUNK` keys (each key stands alone).
    fn chunked<T>(&self, keys: &[&[u8]], f: impl Fn(&[&[u8]]) -> Vec<T>) -> Vec<T> {
        keys.chunks(REGISTRY_CHUNK).flat_map(f).collect()
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
    pub fn unlock<K: AsRef<[u8]>>(&self, keys: &[K], owner: Session) -> Result<Vec<Result<()>>> {
        self.check_keys(keys)?;
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_ref()).collect();
        Ok(self.chunked(&keys, |c| self.registry.unlock_as(c, self.now_ms(), owner)))
    }

    /// A client connection closed: the locks it held are released.
    pub fn session_closed(&self, owner: Session) -> u64 {
        self.registry.release_session(owner)
    }

    pub fn delete<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Result<Location>>> {
        self.delete_in(keys, &Scope::All)
    }

    /// Delete keys of `scope`'s tenants (others: PermissionDenied per key).
    pub fn delete_in<K: AsRef<[u8]>>(&self, keys: &[K], scope: &Scope) -> Result<Vec<Result<Location>>> {
        self.check_keys(keys)?;
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_ref()).collect();
        let out = self.chunked(&keys, |c| self.registry.delete_in(c, self.now_ms(), scope));
        self.release_now(&out.iter().filter_map(|r| r.as_ref().ok().copied()).collect());
        Ok(out)
    }

    /// Committed keys of `scope`'s tenants (another tenant's key is false).
    pub fn exists<K: AsRef<[u8]>>(&self, keys: &[K], scope: &Scope) -> Result<Vec<bool>> {
        self.check_keys(keys)?;
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_ref()).collect();
        Ok(self.chunked(&keys, |c| self.registry.exists_in(c, scope)))
    }

    /// Keys of `tenant` (or of every tenant) that `scope` shows.
    pub fn list(&self, cursor: u64, limit: u32, tenant: Option<&str>, scope: &Scope) -> Result<(Vec<KeyInfo>, u64)> {
        let limit = if limit == 0 { 500 } else { limit };
        if limit > 10_000 {
            return Err(Error::invalid(format!("page size {limit} exceeds 10000")));
        }
        if let Some(t) = tenant.filter(|t| !scope.allows(t)) {
            return Err(Scope::denied(format_args!("tenant {t:?}")));
        }
        Ok(self.registry.list_in(cursor, limit as usize, tenant, scope))
    }

    pub fn removed_since(&self, since: u64, max: u32) -> Result<(Vec<crate::registry::Removed>, u64, bool)> {
        let max = if max == 0 { 1000 } else { max };
        if max > 10_000 {
            return Err(Error::invalid(format!("max {max} exceeds 10000")));
        }
        Ok(self.registry.removed_since(since, max as usize))
    }

    /// The payload checksum recorded for `loc` at commit, if any, while the
    /// object is still there (None also when its pages were freed).
    pub fn payload_crc(&self, loc: &Location) -> Result<Option<u32>> {
        self.pool.page_crc(loc.region, loc.offset / self.page_size)
    }

    /// Whether `loc` still names the object it named when handed out.
    pub fn still_there(&self, loc: &Location) -> Result<bool> {
        let first = loc.offset / self.page_size;
        Ok(self.pool.region_state(loc.region)?.generation == loc.generation
            && self.pool.page_version(loc.region, first)? == loc.version)
    }

    /// Periodic housekeeping: reclaim expired reservations and locks, and
    /// quarantined pages whose writers have surely given up.
    pub fn reap(&self) -> usize {
        let now = self.now_ms();
        let mut freed = self.registry.expire(now);
        let mut q = self.quarantine.lock().unwrap();
        if !q.is_empty() {
            freed.extend(q.iter().filter(|(t, _)| *t <= now).map(|(_, l)| *l));
            q.retain(|(t, _)| *t > now);
        }
        drop(q);
        self.release_now(&freed);
        freed.len()
    }

    pub fn stats(&self) -> Stats {
        let registry = self.registry.stats();
        let o = self.owned.lock().unwrap();
        let mut regions = vec![];
        for r in 0..self.pool.region_count() {
            let st = self.pool.region_state(r).expect("region in range");
            let (total, free) = match o.by_id.get(&r) {
                Some(&i) => (self.pages_per_region as u64, o.list[i].alloc.free_pages() as u64),
                None => (0, 0),
            };
            regions.push(RegionView {
                region: r,
                owner: st.owner,
                generation: st.generation,
                pages_total: total,
                pages_free: free,
            });
        }
        Stats {
            registry,
            pool_bytes: self.pool.superblock().pool_size,
            pages_total: o.list.len() as u64 * self.pages_per_region as u64,
            pages_free: o.list.iter().map(|r| r.alloc.free_pages() as u64).sum(),
            owned_regions: o.list.len() as u32,
            regions,
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
