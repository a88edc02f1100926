//! Placing a Reserve's objects in the node's own pages: allocate, write
//! each object's "writing" record (fenced once per run of placements),
//! claim another region when the owned ones are full, and the rounds of
//! "reserve what was placed, evict the shortfall, place again".
use std::collections::VecDeque;

use super::{Handler, Outcome, Placed, Todo, EVICT_ROUNDS};
use crate::error::Result;
use crate::pool::record::{overflow_len, RecordRef, RecordState};
use crate::pool::RecordBatch;
use crate::regions::Held;
use crate::registry::{pages_for, Location, Ops};

/// Objects placed (or found without room) per hold of the regions' lock:
/// a reserve of thousands that cannot be placed held it for all of them,
/// and Stats, frees and every other reserve waited behind it (figures in
/// docs/BENCHMARKS.md, "Reserve storms over locked entries").
pub(super) const PLACE_SLICE: usize = 64;

impl Handler {
    /// Place what fits and reserve it, evicting this node's entries for
    /// the rest (`EVICT_ROUNDS` rounds), then a region taken back from
    /// another node (phase 3); returns the items still without room. Its
    /// placements count as in flight (`Regions::placing`) until reserved
    /// or given back.
    pub(super) async fn place_and_reserve(
        &self,
        who: &super::Writer<'_>,
        mut todo: Vec<Todo>,
        results: &mut [Outcome],
        evicted: &mut u32,
    ) -> Result<Vec<Todo>> {
        let tenant = who.tenant;
        let _placing = self.regions.placing();
        if !who.evict {
            // Free pages and claimable regions only: nothing evicted.
            let (placed, rest) = self.place_all(tenant, todo, true, vec![]).await?;
            let freed = self.reserve_placed(who, placed, 0, results).await?;
            self.regions.release(&freed);
            return Ok(rest);
        }
        let mut freed = vec![];
        for round in 0..EVICT_ROUNDS {
            // What this call evicted is placed by it first, under the same
            // lock: a concurrent reserve cannot take it in between.
            let (placed, rest) = self.place_all(tenant, todo, round == 0, std::mem::take(&mut freed)).await?;
            // Objects larger than half a region are left out: see
            // `place_in_an_emptied_region`.
            let half = self.regions.pages_per_region() as u64 / 2;
            let shortfall: u64 = if round + 1 < EVICT_ROUNDS {
                rest.iter().map(|(_, k, s)| self.pages_of(tenant, k, *s)).filter(|&p| p <= half).sum::<u64>()
                    + if round == 0 { self.evict_ahead() } else { 0 }
            } else {
                0
            };
            freed = self.reserve_placed(who, placed, shortfall, results).await?;
            *evicted += freed.len() as u32;
            todo = rest;
            if todo.is_empty() || freed.is_empty() {
                break;
            }
        }
        self.regions.release(&freed);
        todo = self.place_in_an_emptied_region(who, todo, results, evicted).await?;
        // Phase 3, only now that evicting this node's own entries was not
        // enough: a region taken back from another node.
        if !todo.is_empty() && self.reclaim_region().await? {
            let (placed, rest) = self.place_all(tenant, todo, false, vec![]).await?;
            let freed = self.reserve_placed(who, placed, 0, results).await?;
            self.regions.release(&freed);
            todo = rest;
        }
        Ok(todo)
    }

    /// Objects larger than half a region that found no room: entries
    /// evicted in the policy's order, spread over every region, would
    /// rarely open a run that long, and where each region keeps one lock
    /// or reservation, never (evicting for them emptied the node's cache
    /// and placed nothing). So each such object empties one region of this
    /// node's that holds no lock or reservation, if one does, and is placed
    /// there; else it is refused, and nothing is evicted for it.
    async fn place_in_an_emptied_region(
        &self,
        who: &super::Writer<'_>,
        mut todo: Vec<Todo>,
        results: &mut [Outcome],
        evicted: &mut u32,
    ) -> Result<Vec<Todo>> {
        let tenant = who.tenant;
        let large = |todo: &[Todo]| {
            let sizes = todo.iter().map(|(_, k, s)| (self.pages_of(tenant, k, *s), *s));
            sizes.filter(|p| self.large(p.0)).map(|p| p.1).collect::<Vec<_>>()
        };
        let mut left = large(&todo);
        if left.is_empty() {
            return Ok(todo); // every store that placed all it asked for
        }
        let regions: Vec<_> = self.regions.views().iter().map(|v| v.region).collect();
        loop {
            let Some(&bytes) = left.iter().min() else { return Ok(todo) };
            let freed = match self.dir.evict_region(who.owner, tenant, self.node, &regions, bytes).await {
                Ok(f) if !f.is_empty() => f,
                Ok(_) => return Ok(todo),
                Err(e) => {
                    // Not answered (a follower whose primary is lost or cut
                    // off): each item left gets that error, and none is
                    // left for phase 3, which would wait as long again.
                    // What this call reserved stays.
                    tracing::debug!(error = %e, "no region emptied for a large object");
                    todo.drain(..).for_each(|(idx, _, _)| results[idx] = Some(Err(e.clone())));
                    return Ok(todo);
                }
            };
            *evicted += freed.len() as u32;
            let (placed, rest) = self.place_all(tenant, todo, false, freed).await?;
            let more = self.reserve_placed(who, placed, 0, results).await?;
            self.regions.release(&more);
            todo = rest;
            // None placed (another reserve took the room first): one region
            // per call is all this gives up for nothing.
            let after = large(&todo);
            if after.len() == left.len() {
                return Ok(todo);
            }
            left = after;
        }
    }

    fn pages_of(&self, tenant: &str, key: &[u8], size: u64) -> u64 {
        pages_for(size + overflow_len(tenant, key), self.page_size)
    }

    /// More than half a region (no two fit in one), and not more than one.
    fn large(&self, pages: u64) -> bool {
        let per = self.regions.pages_per_region() as u64;
        pages > per / 2 && pages <= per
    }

    /// Place what fits, writing each object's "writing" record; when
    /// `may_claim`, claim another region each time the owned ones cannot
    /// hold the next object (unless it is larger than a region: a
    /// region-sized object with a long key), until a claim fails or the node
    /// is at its region cap. A batch larger than a region (LMCache
    /// offloads of 1 GiB) is placed whole on a fresh node, not half refused.
    pub(super) async fn place_all(
        &self,
        tenant: &str,
        todo: Vec<Todo>,
        may_claim: bool,
        mut freed: Vec<Location>,
    ) -> Result<(Vec<Placed>, Vec<Todo>)> {
        let (mut placed, mut rest) = (vec![], vec![]);
        let (mut todo, mut may_claim) = (VecDeque::from(todo), may_claim);
        while self.place_run(tenant, &mut todo, may_claim, std::mem::take(&mut freed), &mut placed, &mut rest)? {
            // Pages that came while this waited for a claim under way
            // (housekeeping claims ahead) are tried before claiming another.
            let free = self.regions.free_pages();
            may_claim = self.claim_region_unless(|| self.regions.free_pages() > free).await?;
        }
        Ok((placed, rest))
    }

    /// Place items from the front of `todo` until one needs a new region
    /// (`true`: it is left at the front) or none is left. Their "writing"
    /// records are fenced once, when the run ends, before the caller can
    /// answer or await (a fence covers only this thread's write-backs).
    fn place_run(
        &self,
        tenant: &str,
        todo: &mut VecDeque<Todo>,
        may_claim: bool,
        freed: Vec<Location>,
        placed: &mut Vec<Placed>,
        rest: &mut Vec<Todo>,
    ) -> Result<bool> {
        let records = self.pool.record_batch();
        // Dropped before `records`: the batch's fence comes after the unlock.
        let mut held = self.regions.hold();
        // What this call evicted is placed by it first, under one hold: a
        // concurrent reserve cannot take it in between. Otherwise the lock
        // is let go every `PLACE_SLICE` objects.
        let sliced = freed.is_empty();
        held.release(&freed);
        let mut n = 0;
        while let Some((idx, key, size)) = todo.pop_front() {
            n += 1;
            if sliced && n % PLACE_SLICE == 0 {
                held = held.relock();
            }
            let pages = self.pages_of(tenant, &key, size) as u32;
            match self.place_one(&mut held, &records, tenant, &key, size, pages)? {
                Some(l) => placed.push((idx, key, l)),
                // One that not even an empty region holds claims nothing.
                None if may_claim && pages <= self.regions.pages_per_region() => {
                    todo.push_front((idx, key, size));
                    return Ok(true);
                }
                None => {
                    // Sized once: a batch that finds no room leaves all of it.
                    if rest.is_empty() {
                        rest.reserve(todo.len() + 1);
                    }
                    rest.push((idx, key, size))
                }
            }
        }
        Ok(false)
    }

    fn place_one(
        &self,
        held: &mut Held<'_>,
        records: &RecordBatch<'_>,
        tenant: &str,
        key: &[u8],
        size: u64,
        pages: u32,
    ) -> Result<Option<Location>> {
        held.alloc(size, pages, |loc| {
            let rec = RecordRef {
                state: RecordState::Writing,
                tenant,
                key,
                generation: loc.generation,
                seq: 0,
                length: size,
                payload_crc: None,
            };
            records.write(loc.region, loc.offset / self.page_size, rec)
        })
    }
}
