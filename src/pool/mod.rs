//! The CXL pool: a backend (DAX device or shm file), the on-pool superblock and
//! region table, and per-region mappings (owned regions read-write, other
//! nodes' regions read-only, mapped on demand).
//!
//! With software coherence (`Coherence`) every write here that another host
//! may read is flushed before this returns, and every read of what another
//! host may have written is preceded by an invalidation (docs/ARCHITECTURE.md,
//! "Coherence"). A node's own page-table slots are never invalidated: it is
//! their only writer, and an invalidation must not race its own writes.
pub mod backend;
pub mod config;
mod epoch;
pub mod layout;
#[allow(unsafe_code)]
mod mapping;
mod nodes;
pub use nodes::{MAX_NAME as MAX_NODE_NAME, MAX_NODES};
pub mod record;
mod renewal;
pub use renewal::Renewal;
mod slots;
pub use slots::RecordBatch;
mod space;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

pub use crate::platform::now_unix_ms;
pub use backend::{BackendKind, Coherence, DaxBackend, NoncoherentTestBackend, PoolBackend, ShmBackend};
// Re-exported: the region table speaks in these.
pub use crate::ids::{NodeId, RegionId};
pub use layout::{Geometry, Superblock};
pub use mapping::{CacheMode, Mapping};

use crate::error::{Error, ErrorKind, Result};
use layout::{REGION_ENTRY_BYTES, STATE_OWNED, SUPERBLOCK_BYTES};

/// Node-id locks live at this byte offset (+ node id) of the pool file.
const NODE_LOCK_BASE: u64 = 1 << 48;
/// Every client that maps the pool (the LMCache plugin) holds a shared lock
/// on this byte while it does (`CLIENT_LOCK` in the plugin's client.py).
const CLIENT_LOCK: u64 = NODE_LOCK_BASE - 1;

/// Reformatting or resizing a pool another process uses would pull its
/// pages (and its clients' mappings) from under it — SIGBUS in the LLM
/// server, or pages of the new layout read through locations of the old:
/// refused while another process holds a node id on the pool or a client
/// maps it (on this host; other hosts' processes are the operator's to stop).
pub(crate) fn refuse_if_in_use(file: &std::fs::File, path: &std::path::Path, what: &str) -> Result<()> {
    let who = if mapping::locked_elsewhere(file, NODE_LOCK_BASE, 1 << 32)? {
        "another cxlkv sidecar is using it; stop every sidecar on this pool first"
    } else if mapping::locked_elsewhere(file, CLIENT_LOCK, 1)? {
        "a client (an LMCache server with the cxlkv plugin) maps it; stop those first"
    } else {
        return Ok(());
    };
    Err(Error::precondition(format!("will not {what} pool {}: {who}", path.display())))
}

/// Highest node id tried when the configuration leaves it to us.
pub const MAX_AUTO_NODE: u32 = 4096;

#[derive(Debug, Clone)]
pub struct PoolOptions {
    pub region_size: u64,
    pub page_size: u64,
    /// Format even if the pool holds a foreign, damaged or mismatched layout.
    pub format: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenOutcome {
    Formatted,
    Attached,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionState {
    pub owner: Option<NodeId>,
    pub generation: u64,
}

pub struct Pool {
    backend: Box<dyn PoolBackend>,
    mode: CacheMode,
    meta: Mapping,
    sb: Superblock,
    regions: RwLock<Vec<Option<Arc<Mapping>>>>,
    /// Not coherent: this process's region-table updates (invalidate,
    /// update, flush) and re-reads (invalidate, read) go one at a time. Two
    /// entries share a cache line, and a re-read of one must not drop an
    /// update of the other that is not flushed yet.
    table: Mutex<()>,
    /// One node-table update at a time in this process (the primary): two
    /// joins of one name that both read the table before either wrote
    /// would record the name twice.
    names: Mutex<()>,
    /// The election epoch this process took over as primary in (0: none).
    own_epoch: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("backend", &self.backend).field("sb", &self.sb).finish()
    }
}

impl Pool {
    pub fn open(backend: Box<dyn PoolBackend>, opts: &PoolOptions) -> Result<(Self, OpenOutcome)> {
        let align = backend.map_alignment();
        let geo =
            Geometry::for_device(backend.size(), opts.region_size, opts.page_size, align.max(backend::DAX_ALIGN))?;
        let mode = match (backend.coherence().resolve(backend.kind()), backend.kind()) {
            (Coherence::Software, BackendKind::NoncoherentTest) => CacheMode::Private,
            (Coherence::Software, _) => CacheMode::Lines,
            _ => CacheMode::Coherent,
        };
        if !backend.back(0, geo.data_offset)? {
            return Err(Error::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "no room for the pool's {} bytes of metadata on the filesystem of {}; free space there \
                     (in a container: the size of /dev/shm) or use a smaller --pool-size",
                    geo.data_offset,
                    backend.path().display()
                ),
            ));
        }
        let meta = Mapping::map(backend.file(), 0, geo.data_offset as usize, true, mode)?;
        let mut raw = [0u8; 128];
        // Another host may have formatted the pool.
        meta.invalidate(0, raw.len())?;
        meta.read(0, &mut raw)?;
        let existing = Superblock::decode(&raw);
        let hint = "pass --format to erase and reformat it";
        let (sb, outcome) = match existing {
            Ok(Some(sb)) => {
                let same = sb.geometry() == geo;
                if same {
                    (sb, OpenOutcome::Attached)
                } else if opts.format {
                    refuse_if_in_use(backend.file(), backend.path(), "reformat")?;
                    (format(&meta, geo)?, OpenOutcome::Formatted)
                } else {
                    return Err(Error::precondition(format!(
                        "pool {} was formatted with region size {}, page size {}, {} regions; \
                         the configuration asks for region size {}, page size {}, {} regions; {hint}",
                        backend.path().display(),
                        sb.region_size,
                        sb.page_size,
                        sb.region_count,
                        geo.region_size,
                        opts.page_size,
                        geo.region_count
                    )));
                }
            }
            Ok(None) => (format(&meta, geo)?, OpenOutcome::Formatted),
            Err(e) if opts.format => {
                refuse_if_in_use(backend.file(), backend.path(), "reformat")?;
                tracing::warn!(error = %e, "reformatting pool as requested");
                (format(&meta, geo)?, OpenOutcome::Formatted)
            }
            Err(e) => {
                return Err(Error::new(e.kind(), format!("{}: {}; {hint}", backend.path().display(), e.message())))
            }
        };
        let regions = RwLock::new(vec![None; sb.region_count as usize]);
        Ok((
            Self {
                backend,
                mode,
                meta,
                sb,
                regions,
                table: Mutex::new(()),
                names: Mutex::new(()),
                own_epoch: Default::default(),
            },
            outcome,
        ))
    }

    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }
    pub fn geometry(&self) -> Geometry {
        self.sb.geometry()
    }
    pub fn backend(&self) -> &dyn PoolBackend {
        self.backend.as_ref()
    }
    pub fn region_count(&self) -> u32 {
        self.sb.region_count
    }
    /// How this pool's mappings keep caches and memory in agreement.
    pub fn cache_mode(&self) -> CacheMode {
        self.mode
    }
    /// Resolved coherence (`Hardware` or `Software`).
    pub fn coherence(&self) -> Coherence {
        if self.mode == CacheMode::Coherent {
            Coherence::Hardware
        } else {
            Coherence::Software
        }
    }

    /// Claim a node id on this pool (lowest free one when `want` is None).
    /// The claim lasts while this `Pool` is open or the process lives.
    pub fn lock_node(&self, want: Option<u32>) -> Result<u32> {
        let file = self.backend.file();
        match want {
            Some(0) => Err(Error::invalid("node id 0 is reserved")),
            Some(n) => {
                if mapping::try_lock_slot(file, NODE_LOCK_BASE + n as u64)? {
                    Ok(n)
                } else {
                    Err(Error::new(
                        ErrorKind::FailedPrecondition,
                        format!("node id {n} is in use by another cxlkv process on this pool"),
                    ))
                }
            }
            None => (1..=MAX_AUTO_NODE)
                .find_map(|n| match mapping::try_lock_slot(file, NODE_LOCK_BASE + n as u64) {
                    Ok(true) => Some(Ok(n)),
                    Ok(false) => None,
                    Err(e) => Some(Err(e)),
                })
                .unwrap_or_else(|| Err(Error::new(ErrorKind::ResourceExhausted, "no free node id on this pool"))),
        }
    }

    fn entry(&self, r: u32, word: u64) -> Result<&AtomicU64> {
        if r >= self.sb.region_count {
            return Err(Error::invalid(format!("unknown region {r} (pool has {})", self.sb.region_count)));
        }
        self.meta.atomic_u64(SUPERBLOCK_BYTES + r as u64 * REGION_ENTRY_BYTES + word * 8)
    }

    /// Serialises this process's region-table access when not coherent.
    fn table(&self) -> Option<MutexGuard<'_, ()>> {
        (self.mode != CacheMode::Coherent).then(|| self.table.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Drop cached copies of entries `first..first + n`: other nodes claim
    /// and release regions.
    fn refresh_entries(&self, first: u32, n: u32) -> Result<()> {
        self.meta
            .invalidate(SUPERBLOCK_BYTES + first as u64 * REGION_ENTRY_BYTES, (n as u64 * REGION_ENTRY_BYTES) as usize)
    }

    /// Make an update of entry `r` visible to other nodes.
    fn flush_entry(&self, r: u32) -> Result<()> {
        self.meta.flush(SUPERBLOCK_BYTES + r as u64 * REGION_ENTRY_BYTES, REGION_ENTRY_BYTES as usize)
    }

    pub fn region_state(&self, RegionId(r): RegionId) -> Result<RegionState> {
        self.entry(r, 0)?; // bounds
        let _t = self.table();
        self.refresh_entries(r, 1)?;
        self.state_of(r)
    }

    fn state_of(&self, r: u32) -> Result<RegionState> {
        let w = self.entry(r, 0)?.load(Ordering::Acquire);
        let owner = (w >> 32 == STATE_OWNED).then_some(NodeId(w as u32));
        Ok(RegionState { owner, generation: self.entry(r, 1)?.load(Ordering::Acquire) })
    }

    /// Whether some region has no owner: what `claim_region` looks for,
    /// read in one pass, on any node. A claim still decides under the
    /// table's compare-and-swap; this spares one that cannot succeed its
    /// trip off the runtime or to the primary.
    pub fn has_unowned_region(&self) -> Result<bool> {
        let _t = self.table();
        self.refresh_entries(0, self.sb.region_count)?;
        for r in 0..self.sb.region_count {
            if self.state_of(r)?.owner.is_none() {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Every region of the pool, in table order.
    pub fn region_ids(&self) -> impl Iterator<Item = RegionId> {
        (0..self.sb.region_count).map(RegionId)
    }

    pub fn regions_owned_by(&self, node: NodeId) -> Vec<RegionId> {
        self.region_ids().filter(|&r| self.region_state(r).map(|s| s.owner == Some(node)).unwrap_or(false)).collect()
    }

    /// Atomically take a free region for `node`; bumps its generation.
    /// Without hardware coherence the compare-and-swap is atomic only among
    /// this host's processes: nodes on different hosts must not claim at
    /// the same time (see docs/ARCHITECTURE.md, "Coherence").
    ///
    /// A free region's pages get their storage first (`space::back`), so
    /// nothing handed out in it can fault for lack of room; when the pool
    /// file's filesystem has none, no region is claimed (None, as for a full
    /// table: the node evicts its own entries instead). Blocks for as long
    /// as that allocation takes (about what a prefault costs).
    pub fn claim_region(&self, NodeId(node): NodeId) -> Result<Option<RegionId>> {
        self.check_epoch()?;
        let owned = (STATE_OWNED << 32) | node as u64;
        let g = self.geometry();
        for r in 0..self.sb.region_count {
            if self.region_state(RegionId(r))?.owner.is_some() {
                continue;
            }
            // Outside the table lock: allocating a region takes a while, and
            // storage given to a region another node claims meanwhile is
            // storage it needs anyway.
            if !self.back_region(RegionId(r))? {
                space_warning(self.backend.path(), g.region_size);
                return Ok(None);
            }
            let _t = self.table();
            self.refresh_entries(r, 1)?;
            let w = self.entry(r, 0)?;
            if w.load(Ordering::Acquire) != 0 {
                continue;
            }
            self.clear_mark(r)?;
            if w.compare_exchange(0, owned, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                self.entry(r, 1)?.fetch_add(1, Ordering::AcqRel);
                self.entry(r, 2)?.store(now_unix_ms(), Ordering::Release);
                self.flush_entry(r)?;
                return Ok(Some(RegionId(r)));
            }
        }
        Ok(None)
    }

    /// Give region `r`'s pages their storage (`space::back`): false when
    /// the pool file's filesystem has no room for them.
    pub fn back_region(&self, r: RegionId) -> Result<bool> {
        let g = self.geometry();
        self.backend.back(g.region_offset(r.0), g.region_size)
    }

    /// Bytes of the pool with no storage yet against what its filesystem has
    /// free, when it cannot hold them all (see `space::shortfall`).
    pub fn space_shortfall(&self) -> Result<Option<(u64, u64)>> {
        space::shortfall(self.backend.file())
    }

    /// Hand region `r` from node `from` to node `to` (the cluster's primary
    /// taking it back, phase 3); bumps its generation so every location
    /// and record of `from`'s life there is stale. Returns the generation.
    pub fn reassign_region(&self, RegionId(r): RegionId, NodeId(from): NodeId, NodeId(to): NodeId) -> Result<u64> {
        self.check_epoch()?;
        let (old, new) = ((STATE_OWNED << 32) | from as u64, (STATE_OWNED << 32) | to as u64);
        let w = self.entry(r, 0)?;
        let _t = self.table();
        self.refresh_entries(r, 1)?;
        let not_owned = || Error::precondition(format!("region {r} is not owned by node {from}"));
        if w.load(Ordering::Acquire) != old {
            return Err(not_owned());
        }
        self.clear_mark(r)?;
        w.compare_exchange(old, new, Ordering::AcqRel, Ordering::Acquire).map_err(|_| not_owned())?;
        let generation = self.entry(r, 1)?.fetch_add(1, Ordering::AcqRel).wrapping_add(1);
        self.entry(r, 2)?.store(now_unix_ms(), Ordering::Release);
        self.flush_entry(r)?;
        Ok(generation)
    }

    /// Give an owned region back to the pool.
    pub fn release_region(&self, RegionId(r): RegionId, NodeId(node): NodeId) -> Result<()> {
        self.check_epoch()?;
        let owned = (STATE_OWNED << 32) | node as u64;
        let w = self.entry(r, 0)?;
        {
            let _t = self.table();
            self.refresh_entries(r, 1)?;
            w.compare_exchange(owned, 0, Ordering::AcqRel, Ordering::Acquire)
                .map_err(|_| Error::precondition(format!("region {r} is not owned by node {node}")))?;
            self.flush_entry(r)?;
        }
        self.regions.write().unwrap()[r as usize] = None;
        Ok(())
    }

    /// Region `r`'s raw owner word: 0 (free) or `STATE_OWNED << 32 | node`;
    /// anything else is a damaged entry.
    pub fn region_owner_word(&self, RegionId(r): RegionId) -> Result<u64> {
        let w = self.entry(r, 0)?;
        let _t = self.table();
        self.refresh_entries(r, 1)?;
        Ok(w.load(Ordering::Acquire))
    }

    /// Free region `r` whose owner word still reads `bad` (a damaged entry
    /// that names no node: a cluster's primary repairs it). Its generation
    /// moves on at the next claim, so nothing of its past is read again.
    /// False when the word changed meanwhile.
    pub fn clear_region_owner(&self, RegionId(r): RegionId, bad: u64) -> Result<bool> {
        self.check_epoch()?;
        let w = self.entry(r, 0)?;
        {
            let _t = self.table();
            self.refresh_entries(r, 1)?;
            if w.compare_exchange(bad, 0, Ordering::AcqRel, Ordering::Acquire).is_err() {
                return Ok(false);
            }
            self.flush_entry(r)?;
        }
        self.regions.write().unwrap()[r as usize] = None;
        Ok(true)
    }

    /// Map region `r` (cached). Writable mappings are for owned regions only.
    pub fn map_region(&self, RegionId(r): RegionId, writable: bool) -> Result<Arc<Mapping>> {
        if r >= self.sb.region_count {
            return Err(Error::invalid(format!("unknown region {r} (pool has {})", self.sb.region_count)));
        }
        if let Some(m) = &self.regions.read().unwrap()[r as usize] {
            if m.writable() || !writable {
                return Ok(m.clone());
            }
        }
        let mut slots = self.regions.write().unwrap();
        if let Some(m) = &slots[r as usize] {
            if m.writable() || !writable {
                return Ok(m.clone());
            }
        }
        let g = self.geometry();
        let m = Arc::new(Mapping::map(
            self.backend.file(),
            g.region_offset(r),
            g.region_size as usize,
            writable,
            self.mode,
        )?);
        slots[r as usize] = Some(m.clone());
        Ok(m)
    }

    pub fn mapped_region(&self, RegionId(r): RegionId) -> Option<Arc<Mapping>> {
        self.regions.read().unwrap().get(r as usize).cloned().flatten()
    }
}

fn format(meta: &Mapping, geo: Geometry) -> Result<Superblock> {
    // Clear the superblock first and write it last, so a crash mid-format
    // never leaves a valid header over a half-written table (each step
    // flushed before the next, for hosts that are not coherent).
    meta.write(0, &[0u8; 128])?;
    meta.flush(0, 128)?;
    let table = vec![0u8; (geo.region_count as u64 * REGION_ENTRY_BYTES) as usize];
    meta.write(SUPERBLOCK_BYTES, &table)?;
    meta.flush(SUPERBLOCK_BYTES, table.len())?;
    let slots = geo.page_slot_offset(geo.region_count, 0) - geo.page_table_offset;
    meta.write(geo.page_table_offset, &vec![0u8; slots as usize])?;
    meta.flush(geo.page_table_offset, slots as usize)?;
    let sb = Superblock {
        layout_version: layout::LAYOUT_VERSION,
        page_table_offset: geo.page_table_offset,
        pool_uuid: *uuid::Uuid::new_v4().as_bytes(),
        pool_size: geo.pool_size,
        region_size: geo.region_size,
        region_count: geo.region_count,
        data_offset: geo.data_offset,
        page_size: geo.page_size,
        created_unix_s: now_unix_ms() / 1000,
    };
    meta.write(0, &sb.encode())?;
    meta.flush(0, 128)?;
    Ok(sb)
}

/// At most one warning a minute: a full node asks for a region on every
/// reserve that does not fit.
fn space_warning(path: &std::path::Path, region_size: u64) {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = now_unix_ms();
    let last = LAST.load(Ordering::Relaxed);
    if now.saturating_sub(last) >= 60_000
        && LAST.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
    {
        tracing::warn!(
            pool = %path.display(),
            region_size,
            "no room for another region on the pool file's filesystem: this node keeps to the regions it has \
             and evicts; free space there (in a container: the size of /dev/shm) or use a smaller --pool-size"
        );
    }
}

#[cfg(test)]
mod coherence_tests;
#[cfg(test)]
mod tests;
