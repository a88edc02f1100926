//! Taking regions: by compare-and-swap on the pool's region table where
//! this process may write it (a single node, or the cluster's primary), or
//! by asking the primary (a follower).
use std::sync::Arc;

use super::Handler;
use crate::error::{Error, ErrorKind, Result};
use crate::pool::{NodeId, Pool, RegionId};

#[tonic::async_trait]
pub trait Claimer: Send + Sync {
    /// Assign one more free region to `node`: its id and new generation,
    /// or None when the pool has no free region.
    async fn claim(&self, node: NodeId) -> Result<Option<(RegionId, u64)>>;

    /// Phase 3: no free region is left and evicting `node`'s own entries
    /// could not make room: have a region of another node taken back and
    /// assigned to `node`. None when no region can be taken (every other
    /// one holds locks or reservations) or not in time. Only a cluster's
    /// primary can do this; elsewhere there is nothing to take.
    async fn reclaim(&self, _node: NodeId) -> Result<Option<(RegionId, u64)>> {
        Ok(None)
    }
}

/// Claims on the pool's region table in this process.
pub struct LocalClaimer(pub Arc<Pool>);

#[tonic::async_trait]
impl Claimer for LocalClaimer {
    async fn claim(&self, node: NodeId) -> Result<Option<(RegionId, u64)>> {
        claim_off_runtime(&self.0, node).await
    }
}

/// `Pool::claim_region` for `node`, with the region's generation, on the
/// blocking pool: a claim allocates the region's storage, which takes about
/// as long as a prefault and must not stall the runtime's other calls.
pub async fn claim_off_runtime(pool: &Arc<Pool>, node: NodeId) -> Result<Option<(RegionId, u64)>> {
    // Read first, on the runtime: a full pool's answer needs no thread (a
    // primary asked by a follower's every Reserve that found no room).
    if !pool.has_unowned_region()? {
        return Ok(None);
    }
    let pool = pool.clone();
    tokio::task::spawn_blocking(move || -> Result<Option<(RegionId, u64)>> {
        let Some(r) = pool.claim_region(node)? else { return Ok(None) };
        Ok(Some((r, pool.region_state(r)?.generation)))
    })
    .await
    .map_err(|e| Error::new(ErrorKind::Internal, format!("region claim task failed: {e}")))?
}

impl Handler {
    /// Claim one more region (if the cap and the pool allow), map and
    /// prefault it off the runtime, and start allocating in it; unless
    /// `enough()` holds once no other claim is under way (the one just
    /// finished may have made this one needless): then `true` without a
    /// claim, as there is room to try again.
    pub(super) async fn claim_region_unless(&self, enough: impl Fn() -> bool) -> Result<bool> {
        let _one = self.claiming.lock().await;
        if enough() {
            return Ok(true);
        }
        // Read here, from the pool's table, before any claimer's trip (off
        // the runtime, or to the primary): a storm of reserves on a full
        // pool made one each.
        if self.regions.at_cap() || !self.pool.has_unowned_region()? {
            return Ok(false);
        }
        let Some((r, generation)) = self.claimer.claim(self.node).await? else { return Ok(false) };
        self.take_region(r, generation).await
    }

    /// Phase 3 (see `Claimer::reclaim`): called only once a reserve could
    /// not place everything after evicting this node's own entries.
    pub(super) async fn reclaim_region(&self) -> Result<bool> {
        let _one = self.claiming.lock().await;
        if self.regions.at_cap() {
            return Ok(false);
        }
        let Some((r, generation)) = self.claimer.reclaim(self.node).await? else { return Ok(false) };
        self.take_region(r, generation).await
    }

    /// Stop writing into region `r`: the primary takes it back.
    pub fn surrender(&self, r: RegionId) -> bool {
        let gone = self.regions.surrender(r);
        if gone {
            tracing::warn!(region = r.0, "region taken back by the primary (phase 3 reclaim)");
        }
        gone
    }

    async fn take_region(&self, region: RegionId, generation: u64) -> Result<bool> {
        let r = region;
        let t = std::time::Instant::now();
        let (pool, prefault) = (self.pool.clone(), self.limits.prefault);
        tokio::task::spawn_blocking(move || -> Result<()> {
            let map = pool.map_region(r, true)?;
            if prefault {
                map.prefault()?;
            }
            Ok(())
        })
        .await
        .map_err(|e| Error::new(ErrorKind::Internal, format!("prefault task failed: {e}")))??;
        if let Err(e) = self.regions.adopt(region, generation, &[]) {
            // Taken back before it was adopted: never written, not ours.
            tracing::warn!(region = r.0, generation, error = %e, "claimed region not adopted");
            return Ok(false);
        }
        tracing::info!(region = r.0, generation, ms = t.elapsed().as_millis() as u64, "claimed region");
        Ok(true)
    }

    /// Claim and prefault the next region before the owned ones run out, so
    /// a store rarely waits for a prefault (housekeeping calls this).
    pub async fn claim_ahead(&self) -> Result<bool> {
        let per = self.regions.pages_per_region() as u64;
        let enough = || self.regions.free_pages() * 4 >= per;
        if enough() || self.regions.at_cap() {
            return Ok(false);
        }
        // Asked again under the claim lock: a store may have claimed one
        // meanwhile (the region it needed), and this one would sit idle.
        self.claim_region_unless(enough).await
    }
}
