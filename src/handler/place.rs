//! Placing a Reserve's objects in the node's own pages: allocate, write
//! each object's "writing" record (fenced once per run of placements),
//! claim another region when the owned ones are full, and the rounds of
//! "reserve what was placed, evict the shortfall, place again".
use bytes::Bytes;
use std::collections::VecDeque;

use super::{Handler, EVICT_ROUNDS};
use crate::error::Result;
use crate::ids::ReservationId;
use crate::pool::record::{overflow_len, RecordRef, RecordState};
use crate::pool::RecordBatch;
use crate::regions::Held;
use crate::registry::{pages_for, Location};

impl Handler {
    /// Place what fits and reserve it, evicting this node's entries for
    /// the rest (`EVICT_ROUNDS` rounds), then a region taken back from
    /// another node (phase 3); returns the items still without room. Its
    /// placements count as in flight (`Regions::placing`) until reserved
    /// or given back.
    #[allow(clippy::type_complexity)]
    pub(super) async fn place_and_reserve(
        &self,
        who: &super::Writer<'_>,
        mut todo: Vec<(usize, Bytes, u64)>,
        results: &mut [Option<Result<(ReservationId, Location)>>],
        evicted: &mut u32,
    ) -> Result<Vec<(usize, Bytes, u64)>> {
        let tenant = who.tenant;
        let _placing = self.regions.placing();
        let mut freed = vec![];
        for round in 0..EVICT_ROUNDS {
            // What this call evicted is placed by it first, under the same
            // lock: a concurrent reserve cannot take it in between.
            let (placed, rest) = self.place_all(tenant, todo, round == 0, std::mem::take(&mut freed)).await?;
            let shortfall: u64 = if round + 1 < EVICT_ROUNDS {
                rest.iter().map(|(_, k, s)| pages_for(*s + overflow_len(tenant, k), self.page_size)).sum::<u64>()
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

    /// Place what fits, writing each object's "writing" record; when
    /// `may_claim`, claim another region each time the owned ones cannot
    /// hold the next object (unless it is larger than a region: a
    /// region-sized object with a long key), until a claim fails or the node
    /// is at its region cap. A batch larger than a region (LMCache
    /// offloads of 1 GiB) is placed whole on a fresh node, not half refused.
    #[allow(clippy::type_complexity)]
    pub(super) async fn place_all(
        &self,
        tenant: &str,
        todo: Vec<(usize, Bytes, u64)>,
        may_claim: bool,
        mut freed: Vec<Location>,
    ) -> Result<(Vec<(usize, Bytes, Location)>, Vec<(usize, Bytes, u64)>)> {
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
    #[allow(clippy::type_complexity)]
    fn place_run(
        &self,
        tenant: &str,
        todo: &mut VecDeque<(usize, Bytes, u64)>,
        may_claim: bool,
        freed: Vec<Location>,
        placed: &mut Vec<(usize, Bytes, Location)>,
        rest: &mut Vec<(usize, Bytes, u64)>,
    ) -> Result<bool> {
        let records = self.pool.record_batch();
        // Dropped before `records`: the batch's fence comes after the unlock.
        let mut held = self.regions.hold();
        held.release(&freed);
        while let Some((idx, key, size)) = todo.pop_front() {
            let pages = pages_for(size + overflow_len(tenant, &key), self.page_size) as u32;
            match self.place_one(&mut held, &records, tenant, &key, size, pages)? {
                Some(l) => placed.push((idx, key, l)),
                // One that not even an empty region holds claims nothing.
                None if may_claim && pages <= self.regions.pages_per_region() => {
                    todo.push_front((idx, key, size));
                    return Ok(true);
                }
                None => rest.push((idx, key, size)),
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
