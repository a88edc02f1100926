//! This node's owned regions: one page allocator each, adoption (mapping
//! and prefaulting), allocation, and freeing what the registry let go of.
//! Every change to the pages of a region (allocation, retirement, a record
//! written for a reservation) happens under one lock, so a page freed here
//! can never be written by a late caller that still holds its old location.
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;

use crate::allocator::PageAllocator;
use crate::error::Result;
use crate::pool::{NodeId, Pool, RegionId};
use crate::registry::Location;

struct Owned {
    id: RegionId,
    generation: u64,
    alloc: PageAllocator,
}

#[derive(Default)]
struct Inner {
    list: Vec<Owned>,
    by_id: HashMap<RegionId, usize>,
    active: usize,
    /// Regions given up (phase 3) and the generation the region table had
    /// then: a claim of the same or an older generation answered late is
    /// never adopted (the region may be another node's by now).
    gone: HashMap<RegionId, u64>,
    /// Bumped whenever room is added (pages freed, a region adopted): a
    /// placement that found none may trust that across a relock only if
    /// this did not move.
    room_added: u64,
}

/// Pages of one owned region, for stats.
#[derive(Debug, Clone, Copy)]
pub struct OwnedView {
    pub region: RegionId,
    pub pages_total: u64,
    pub pages_free: u64,
}

pub struct Regions {
    pool: Arc<Pool>,
    node: NodeId,
    page_size: u64,
    pages_per_region: u32,
    /// 0 = as many as the pool has.
    max_regions: u32,
    prefault: bool,
    inner: Mutex<Inner>,
    /// Reserves whose placements are in flight (`placing`), and their end.
    placing: AtomicUsize,
    /// Reserves' placements started so far (never decreases): with
    /// `placing`, whether another reserve placed anything during one's own.
    placings: AtomicU64,
    settled: Notify,
    /// Allocator probes made (one per region tried for an object): a
    /// placement's cost, counted so tests can hold it to its bound. Only
    /// written under the regions' lock.
    probes: AtomicU64,
    /// Holds of the lock taken through `hold` and `relock` (placements and
    /// frees): how a batch's placement is sliced, counted so tests can
    /// hold it to its bound. Only written under the regions' lock.
    holds: AtomicU64,
}

/// A reserve's placements in flight: pages allocated, not yet reserved by
/// the registry or given back (see [`Regions::placing`]).
pub struct Placing<'a>(&'a Regions);

impl Drop for Placing<'_> {
    fn drop(&mut self) {
        self.0.placing.fetch_sub(1, Ordering::SeqCst);
        self.0.settled.notify_waiters();
    }
}

impl Regions {
    pub fn new(pool: Arc<Pool>, node: NodeId, max_regions: u32, prefault: bool) -> Self {
        let sb = pool.superblock();
        Self {
            page_size: sb.page_size,
            pages_per_region: (sb.region_size / sb.page_size) as u32,
            pool,
            node,
            max_regions,
            prefault,
            inner: Mutex::new(Inner::default()),
            placing: AtomicUsize::new(0),
            placings: AtomicU64::new(0),
            settled: Notify::new(),
            probes: AtomicU64::new(0),
            holds: AtomicU64::new(0),
        }
    }

    /// Count a reserve's placements as in flight until the guard drops
    /// (they are reserved or given back by then): a reserve that found no
    /// room may wait for them ([`Regions::settled`]).
    pub fn placing(&self) -> Placing<'_> {
        self.placing.fetch_add(1, Ordering::SeqCst);
        self.placings.fetch_add(1, Ordering::SeqCst);
        Placing(self)
    }

    /// Reserves placing now, and placements started so far: taken before
    /// a reserve's own placement (which starts one), it tells afterwards
    /// whether another reserve placed anything meanwhile
    /// ([`PlacingMark::others_since`]).
    pub fn placing_mark(&self) -> PlacingMark {
        PlacingMark { in_flight: self.placing.load(Ordering::SeqCst), started: self.placings.load(Ordering::SeqCst) }
    }

    /// Allocator probes made so far (see the field).
    pub fn probes(&self) -> u64 {
        self.probes.load(Ordering::Relaxed)
    }

    /// Holds of the lock through `hold` and `relock` so far (see the field).
    pub fn holds(&self) -> u64 {
        self.holds.load(Ordering::Relaxed)
    }

    fn placing_lock(&self) -> MutexGuard<'_, Inner> {
        let g = self.lock();
        self.holds.store(self.holds.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        g
    }

    /// Wait up to `max` for a reserve in flight to end; false at once when
    /// none is.
    pub async fn settled(&self, max: Duration) -> bool {
        let ended = self.settled.notified();
        tokio::pin!(ended);
        ended.as_mut().enable();
        if self.placing.load(Ordering::SeqCst) == 0 {
            return false;
        }
        let _ = tokio::time::timeout(max, ended).await;
        true
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap()
    }

    pub fn pages_per_region(&self) -> u32 {
        self.pages_per_region
    }

    /// Map (and prefault) region `r`, then start allocating in it with
    /// `used` (first page, pages) taken. The slow part runs without the lock.
    ///
    /// Fenced by generation: adopted only if the region table still names
    /// this node with `generation` and the region was not given up at that
    /// generation meanwhile (a reclaim can take a region back before its
    /// new owner adopts it); else FAILED_PRECONDITION and nothing changes.
    pub fn adopt(&self, r: RegionId, generation: u64, used: &[(u32, u32)]) -> Result<()> {
        let map = self.pool.map_region(r, true)?;
        if self.prefault {
            map.prefault()?;
        }
        let alloc = PageAllocator::with_used(self.pages_per_region, used)?;
        let mut g = self.lock();
        let table = self.pool.region_state(r)?;
        let given_up = g.gone.get(&r).is_some_and(|&at| at >= generation);
        if table.owner != Some(self.node) || table.generation != generation || given_up {
            return Err(crate::error::Error::precondition(format!(
                "region {r} (generation {generation}) was taken back before this node adopted it"
            )));
        }
        g.gone.remove(&r);
        g.room_added += 1;
        if let Some(&i) = g.by_id.get(&r) {
            g.list[i] = Owned { id: r, generation, alloc };
        } else {
            let i = g.list.len();
            g.by_id.insert(r, i);
            g.list.push(Owned { id: r, generation, alloc });
            g.active = i;
        }
        Ok(())
    }

    /// Stop using region `r` (the primary takes it back, phase 3): under the
    /// lock every allocation and record write takes, so once this returns
    /// nothing of this node writes into `r` again. False if not owned.
    pub fn surrender(&self, r: RegionId) -> bool {
        let mut g = self.lock();
        // Remembered even when not adopted yet: its claim may still be on
        // its way, and must not be adopted when it arrives.
        if let Ok(t) = self.pool.region_state(r) {
            let at = g.gone.entry(r).or_default();
            *at = (*at).max(t.generation);
        }
        Self::drop_region(&mut g, r)
    }

    /// Give up every owned region the region table no longer names this
    /// node for, at the generation this node uses (taken back while the
    /// node did not hear of it, or a damaged table): this node must not
    /// write there. Returns the regions dropped.
    pub fn verify(&self) -> Vec<RegionId> {
        let mut g = self.lock();
        let lost: Vec<RegionId> = g
            .list
            .iter()
            .filter(|o| {
                self.pool.region_state(o.id).is_ok_and(|t| t.owner != Some(self.node) || t.generation != o.generation)
            })
            .map(|o| o.id)
            .collect();
        for &r in &lost {
            Self::drop_region(&mut g, r);
        }
        lost
    }

    fn drop_region(g: &mut Inner, r: RegionId) -> bool {
        let Some(i) = g.by_id.remove(&r) else { return false };
        g.list.swap_remove(i);
        if let Some(moved) = g.list.get(i).map(|o| o.id) {
            g.by_id.insert(moved, i);
        }
        if g.active >= g.list.len() {
            g.active = 0;
        }
        true
    }

    /// Forget every region (a follower joining again rebuilds them).
    pub fn clear(&self) {
        let mut g = self.lock();
        let gone = std::mem::take(&mut g.gone);
        *g = Inner { gone, ..Inner::default() };
    }

    pub fn count(&self) -> u32 {
        self.lock().list.len() as u32
    }

    pub fn at_cap(&self) -> bool {
        self.max_regions > 0 && self.count() >= self.max_regions
    }

    /// Regions this node may still take.
    pub fn room(&self) -> u32 {
        let cap = if self.max_regions == 0 { u32::MAX } else { self.max_regions };
        cap.saturating_sub(self.count())
    }

    pub fn free_pages(&self) -> u64 {
        self.lock().list.iter().map(|r| r.alloc.free_pages() as u64).sum()
    }

    pub fn pages_total(&self) -> u64 {
        self.count() as u64 * self.pages_per_region as u64
    }

    pub fn views(&self) -> Vec<OwnedView> {
        self.lock()
            .list
            .iter()
            .map(|r| OwnedView {
                region: r.id,
                pages_total: self.pages_per_region as u64,
                pages_free: r.alloc.free_pages() as u64,
            })
            .collect()
    }

    /// The lock every allocation and record write takes, held for a run of
    /// them. A batch takes it once, not once per object: with software
    /// coherence each record is written back as it is made, and the locked
    /// instruction of every lock and unlock waits for those write-backs to
    /// reach memory, a fence per object.
    pub fn hold(&self) -> Held<'_> {
        Held { regions: self, g: self.placing_lock(), no_room: u32::MAX }
    }

    /// Free the pages of locations the registry let go of. Idempotent: a
    /// location whose first page's version changed was freed already (a
    /// free notice may arrive twice), and locations of other nodes, other
    /// generations or unknown blocks are skipped.
    pub fn release(&self, freed: &[Location]) {
        if freed.iter().all(|l| l.node != self.node) {
            return;
        }
        self.hold().release(freed);
    }
}

/// See [`Regions::placing_mark`].
#[derive(Debug, Clone, Copy)]
pub struct PlacingMark {
    in_flight: usize,
    started: u64,
}

impl PlacingMark {
    /// Whether a reserve other than the caller's (which started one
    /// placement since the mark) was placing at the mark or started since:
    /// its pages may come back, so no room now does not mean a full pool.
    pub fn others_since(&self, regions: &Regions) -> bool {
        self.in_flight > 0 || regions.placings.load(Ordering::SeqCst) > self.started + 1
    }
}

/// The regions' lock, held (see [`Regions::hold`]).
pub struct Held<'a> {
    regions: &'a Regions,
    g: MutexGuard<'a, Inner>,
    /// The fewest pages no owned region had room for while this lock was
    /// held and nothing was freed: a larger or equal object fails at once
    /// (a batch of thousands that cannot be placed costs one scan of the
    /// regions, not one per object).
    no_room: u32,
}

impl<'a> Held<'a> {
    /// Let go of the lock and take it again, so that a batch of thousands
    /// holds it a slice at a time and every other reserve, free and Stats
    /// waits for one slice, not the batch. What had no room still has none
    /// unless room was added meanwhile.
    pub fn relock(self) -> Held<'a> {
        let Held { regions, g, no_room } = self;
        let seen = g.room_added;
        drop(g);
        let g = regions.placing_lock();
        let no_room = if g.room_added == seen { no_room } else { u32::MAX };
        Held { regions, g, no_room }
    }

    /// [`Regions::release`] under this lock: pages a caller freed (its own
    /// evictions) can be placed by that caller before anyone else is given
    /// them.
    pub fn release(&mut self, freed: &[Location]) {
        let me = self.regions;
        if freed.iter().any(|l| l.node == me.node) {
            self.no_room = u32::MAX;
            self.g.room_added += 1;
        }
        // One fence for every retired object, before the lock lets anyone
        // allocate their pages again (dropped at the end, under the lock).
        let records = me.pool.record_batch();
        for loc in freed {
            if loc.node != me.node {
                continue;
            }
            // From before a restart, or freed already (or its version unreadable).
            let Some(i) = self.current(loc).ok().flatten() else { continue };
            let r = &mut self.g.list[i];
            let first = (loc.offset / me.page_size) as u32;
            // The block may be longer than the payload (a long name follows it).
            let Some(pages) = r.alloc.block_len(first) else {
                tracing::error!(?loc, "registry released a location the allocator does not know");
                continue;
            };
            // Readers of this object must see it is gone, and a rebuild must
            // not bring it back, before anyone else can be given these pages.
            if let Err(e) = records.retire(loc.region, first as u64, pages as u64) {
                tracing::error!(error = %e, ?loc, "cannot retire pages; keeping them out of use");
                continue;
            }
            if let Err(e) = r.alloc.free(first, pages) {
                tracing::error!(error = %e, ?loc, "registry released a location the allocator does not know");
            }
        }
    }

    /// `pages` contiguous pages in some owned region; `size` is the object's
    /// length. `record` runs under the lock with the new location (it writes
    /// the object's "writing" record before anyone else can see the pages).
    pub fn alloc(
        &mut self,
        size: u64,
        pages: u32,
        record: impl FnOnce(&Location) -> Result<()>,
    ) -> Result<Option<Location>> {
        let me = self.regions;
        if pages >= self.no_room {
            return Ok(None);
        }
        let g = &mut self.g;
        let n = g.list.len();
        let start = g.active;
        for step in 0..n {
            let i = (start + step) % n;
            // A load and a store, under the lock: a locked add would wait for
            // this core's record write-backs before it (software coherence),
            // once per object.
            me.probes.store(me.probes.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
            if let Some(page) = g.list[i].alloc.alloc(pages) {
                g.active = i;
                let r = &g.list[i];
                let loc = Location {
                    node: me.node,
                    region: r.id,
                    offset: page as u64 * me.page_size,
                    length: size,
                    generation: r.generation,
                    version: me.pool.page_version(r.id, page as u64)?,
                };
                if let Err(e) = record(&loc) {
                    let _ = g.list[i].alloc.free(page, pages);
                    return Err(e);
                }
                return Ok(Some(loc));
            }
        }
        self.no_room = self.no_room.min(pages);
        Ok(None)
    }

    /// Run `f` if `loc` still names the object it was allocated for (its
    /// pages were not freed since): freeing takes this lock too.
    pub fn if_current(&self, loc: &Location, f: impl FnOnce() -> Result<()>) -> Result<bool> {
        if self.current(loc)?.is_none() {
            return Ok(false);
        }
        f()?;
        Ok(true)
    }

    /// The index of `loc`'s region if `loc` still names the object it was
    /// allocated for: the region's generation, and its first page's version
    /// (bumped when the pages are freed).
    fn current(&self, loc: &Location) -> Result<Option<usize>> {
        let me = self.regions;
        let Some(&i) = self.g.by_id.get(&loc.region) else { return Ok(None) };
        let same = self.g.list[i].generation == loc.generation
            && me.pool.page_version(loc.region, loc.offset / me.page_size)? == loc.version;
        Ok(same.then_some(i))
    }
}
