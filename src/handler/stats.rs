//! What this node's store holds, for `Stats`: the registry's figures (from
//! wherever the registry lives) beside this node's regions and pages.
use std::collections::HashMap;

use super::Handler;
use crate::error::Result;
use crate::ids::{NodeId, RegionId};
use crate::registry::Ops;
use crate::registry::RegistryStats;

#[derive(Debug, Clone)]
pub struct RegionView {
    pub region: RegionId,
    pub owner: Option<NodeId>,
    pub generation: u64,
    pub pages_total: u64,
    pub pages_free: u64,
}

#[derive(Debug, Clone)]
pub struct Stats {
    pub registry: RegistryStats,
    pub pool_bytes: u64,
    /// Bytes of the pool file its filesystem has no room for (0: it fits).
    pub pool_room_short_bytes: u64,
    pub pages_total: u64,
    pub pages_free: u64,
    pub owned_regions: u32,
    pub regions: Vec<RegionView>,
}

impl Handler {
    pub async fn stats(&self) -> Result<Stats> {
        let registry = self.dir.stats().await?;
        Ok(self.stats_with(registry))
    }

    pub fn stats_with(&self, registry: RegistryStats) -> Stats {
        let owned: HashMap<RegionId, (u64, u64)> =
            self.regions.views().into_iter().map(|v| (v.region, (v.pages_total, v.pages_free))).collect();
        let mut regions = vec![];
        for r in self.pool.region_ids() {
            let st = self.pool.region_state(r).expect("region in range");
            let (pages_total, pages_free) = owned.get(&r).copied().unwrap_or((0, 0));
            regions.push(RegionView { region: r, owner: st.owner, generation: st.generation, pages_total, pages_free });
        }
        Stats {
            registry,
            pool_bytes: self.pool.superblock().pool_size,
            pool_room_short_bytes: self
                .pool
                .space_shortfall()
                .ok()
                .flatten()
                .map_or(0, |(unbacked, free)| unbacked - free),
            pages_total: self.regions.pages_total(),
            pages_free: self.regions.free_pages(),
            owned_regions: self.regions.count(),
            regions,
        }
    }
}
