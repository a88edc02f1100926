//! How the primary's own node claims regions.
use std::sync::{Arc, OnceLock};

use super::primary::Primary;
use crate::error::Result;
use crate::handler::{claim_off_runtime, Claimer};
use crate::pool::{NodeId, Pool, RegionId};

/// The primary's own claims: on the pool's region table in this process,
/// and phase 3 through the same path as a follower's request, with the same
/// gate around its reserves (set once the primary exists; before that no
/// peer service runs, so nothing can be taken back).
pub struct PrimaryClaimer {
    pub pool: Arc<Pool>,
    pub primary: OnceLock<Arc<Primary>>,
}

#[tonic::async_trait]
impl Claimer for PrimaryClaimer {
    async fn claim(&self, node: NodeId) -> Result<Option<(RegionId, u64)>> {
        claim_off_runtime(&self.pool, node).await
    }

    async fn reclaim(&self, node: NodeId) -> Result<Option<(RegionId, u64)>> {
        // As for a follower's request: a region freed meanwhile first.
        if let Some(got) = self.claim(node).await? {
            return Ok(Some(got));
        }
        match self.primary.get() {
            Some(p) => p.reclaim(node).await,
            None => Ok(None),
        }
    }
}
