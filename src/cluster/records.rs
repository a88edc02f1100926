//! The pool's records as the primary's registry keeps them.
use std::sync::Arc;

use crate::error::Result;
use crate::pool::Pool;
use crate::registry::Location;

/// The pool, as the primary's registry writes it: deleted objects' records
/// erased at once (`Eraser`), and the commit sequences' high-water mark
/// (`SeqStore`).
pub struct PoolRecords(pub Arc<Pool>);

impl crate::registry::directory::Eraser for PoolRecords {
    fn erase(&self, loc: &Location) {
        let page = loc.offset / self.0.superblock().page_size;
        if let Err(e) = self.0.erase_record(loc.region, page, loc.version, loc.generation) {
            // The owner still tombstones it when the free notice arrives.
            tracing::warn!(error = %e, ?loc, "cannot erase a deleted object's record");
        }
    }
}

impl crate::registry::SeqStore for PoolRecords {
    fn keep_below(&self, limit: u64) -> Result<()> {
        self.0.set_seq_mark(limit)
    }
}
