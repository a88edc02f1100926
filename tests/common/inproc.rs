//! Handlers in the test's own process on one small shared pool (no sidecar
//! process): what the handler and renewal tests open as many nodes.
use std::path::Path;
use std::sync::Arc;

use cxlkv::handler::{Handler, Limits};
use cxlkv::pool::{Geometry, NodeId, Pool, PoolOptions, ShmBackend};
use cxlkv::registry::LocalRegistry;

/// The pool's page size.
pub const PAGE: u64 = 64 << 10;

/// 8 MiB at `path`, four 2 MiB regions of 64 KiB pages, formatted by its
/// first opener.
pub fn pool(path: &Path) -> Arc<Pool> {
    let g = Geometry::for_capacity(8 << 20, 2 << 20, PAGE, 2 << 20).unwrap();
    let backend = Box::new(ShmBackend::open(path, g.pool_size, false).unwrap());
    let (pool, _) = Pool::open(backend, &PoolOptions { region_size: 2 << 20, page_size: PAGE, format: false }).unwrap();
    Arc::new(pool)
}

/// Node `node`'s handler on `pool`, with a local registry and `limits`
/// (prefault off: the tests' pools are small and shared).
pub fn handler_on(pool: Arc<Pool>, node: u32, limits: Limits) -> Handler {
    let node = pool.lock_node(Some(node)).unwrap();
    let limits = Limits { prefault: false, ..limits };
    Handler::new(pool, NodeId(node), Arc::new(LocalRegistry::new("lru", 1024).unwrap()), limits).unwrap()
}

/// Node `node`'s handler on the pool at `path`, at the default limits.
pub fn handler(path: &Path, node: u32) -> Handler {
    handler_on(pool(path), node, Limits::default())
}
