//! Placing a Reserve's objects in the node's own pages: allocate, write
//! each object's "writing" record (fenced once per run of placements), and
//! claim another region when the owned ones are full.
use std::collections::VecDeque;

use super::Handler;
use crate::error::Result;
use crate::pool::record::{overflow_len, RecordRef, RecordState};
use crate::pool::RecordBatch;
use crate::regions::Held;
use crate::registry::{pages_for, Location};

impl Handler {
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
        todo: Vec<(usize, Vec<u8>, u64)>,
        may_claim: bool,
        mut freed: Vec<Location>,
    ) -> Result<(Vec<(usize, Vec<u8>, Location)>, Vec<(usize, Vec<u8>, u64)>)> {
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
        todo: &mut VecDeque<(usize, Vec<u8>, u64)>,
        may_claim: bool,
        freed: Vec<Location>,
        placed: &mut Vec<(usize, Vec<u8>, Location)>,
        rest: &mut Vec<(usize, Vec<u8>, u64)>,
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
