//! Registry entries the in-process benchmarks store: the location of the
//! i-th one. Shared with the criterion benches (benches/hot_paths.rs
//! includes this file), so both place entries the same way.
use cxlkv::ids::{NodeId, RegionId};
use cxlkv::registry::Location;

/// The i-th entry's location on node 1: 2 MiB long, spread over `regions`
/// regions and `slots` 64 KiB offsets in each.
pub fn location(i: usize, regions: usize, slots: usize) -> Location {
    Location {
        node: NodeId(1),
        region: RegionId((i % regions) as u32),
        offset: (i % slots) as u64 * 65536,
        length: 2 << 20,
        generation: 1,
        version: 0,
    }
}
