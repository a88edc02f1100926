//! One node's handler in the bench's own process, on a tmpfs pool of 64 MiB
//! regions and 4 KiB pages (one-page entries, as the sidecars of the storm
//! and restart figures hold them), its registry LRU, nothing prefaulted.
use std::path::Path;
use std::sync::Arc;

use cxlkv::handler::{Handler, Limits};
use cxlkv::pool::{backend::DAX_ALIGN, Geometry, NodeId, Pool, PoolOptions, ShmBackend};
use cxlkv::registry::LocalRegistry;

pub const REGION: u64 = 64 << 20;
pub const PAGE: u64 = 4096;

/// Regions that `entries` one-page entries fill.
pub fn regions_for(entries: usize) -> u64 {
    (entries as u64 * PAGE).div_ceil(REGION)
}

/// Node 1 on the pool at `path` of `regions` regions (created if absent,
/// opened as it is otherwise: a restart).
pub fn open(path: &Path, regions: u64) -> Handler {
    let g = Geometry::for_capacity(regions * REGION, REGION, PAGE, DAX_ALIGN).unwrap();
    let backend = Box::new(ShmBackend::open(path, g.pool_size, false).unwrap());
    let (pool, _) = Pool::open(backend, &PoolOptions { region_size: REGION, page_size: PAGE, format: false }).unwrap();
    let node = pool.lock_node(Some(1)).unwrap();
    let limits = Limits { prefault: false, ..Default::default() };
    Handler::new(Arc::new(pool), NodeId(node), Arc::new(LocalRegistry::new("lru", 1024).unwrap()), limits).unwrap()
}
