//! A location's pages: the inline path's byte access and its checks (the
//! recorded checksum, whether the object is still there), frees, and the
//! periodic reap of expired reservations and regions this node lost.
use std::sync::Arc;

use super::Handler;
use crate::error::{Error, ErrorKind, Result};
use crate::pool::Mapping;
use crate::registry::Location;

impl Handler {
    /// The payload checksum recorded for `loc` at commit, if any, while the
    /// object is still there (None also when its pages were freed).
    pub fn payload_crc(&self, loc: &Location) -> Result<Option<u32>> {
        self.refresh_foreign(loc)?;
        self.pool.page_crc(loc.region, loc.offset / self.page_size)
    }

    /// Another node's object: its slot is read as its owner last flushed it.
    pub(super) fn refresh_foreign(&self, loc: &Location) -> Result<()> {
        if loc.node == self.node {
            return Ok(()); // this node wrote the slot: never invalidate own lines
        }
        self.pool.refresh_slot(loc.region, loc.offset / self.page_size)
    }

    /// Whether `loc` still names the object it named when handed out.
    pub fn still_there(&self, loc: &Location) -> Result<bool> {
        let first = loc.offset / self.page_size;
        self.refresh_foreign(loc)?;
        Ok(self.pool.region_state(loc.region)?.generation == loc.generation
            && self.pool.page_version(loc.region, first)? == loc.version)
    }

    /// Free pages of locations that were let go of elsewhere (free notices).
    pub fn release(&self, freed: &[Location]) {
        self.regions.release(freed);
    }

    /// Periodic housekeeping: reclaim expired reservations and locks (where
    /// the registry lives), quarantined pages whose writers have surely
    /// given up, and forget reservations nobody will commit any more.
    pub async fn reap(&self) -> Result<usize> {
        let now = self.now_ms();
        let mut freed = self.dir.expire().await?;
        {
            let mut q = self.quarantine.lock().unwrap();
            freed.extend(q.iter().filter(|(t, _)| *t <= now).map(|(_, l)| *l));
            q.retain(|(t, _)| *t > now);
        }
        let stale = now.saturating_sub(2 * self.limits.reservation_timeout_ms);
        self.pending.lock().unwrap().retain(|_, p| p.since_ms >= stale);
        self.regions.release(&freed);
        self.drop_lost_regions();
        Ok(freed.iter().filter(|l| l.node == self.node).count())
    }

    /// Stop writing into regions the region table no longer gives this
    /// node (taken back while it did not hear of it, or a damaged entry the
    /// primary repairs): checked by housekeeping, and after a reserve whose
    /// items the primary refused for their region.
    pub(super) fn drop_lost_regions(&self) {
        for r in self.regions.verify() {
            tracing::warn!(region = r.0, "the region table no longer gives this node a region it used: dropped");
        }
    }

    /// Mapping that holds `loc` (owned: read-write; other nodes': read-only).
    pub fn mapping_for(&self, loc: &Location) -> Result<Arc<Mapping>> {
        let writable = loc.node == self.node;
        let m = self.pool.map_region(loc.region, writable)?;
        if loc.offset + loc.length > m.len() as u64 {
            return Err(Error::new(ErrorKind::Internal, format!("location {loc:?} outside its region")));
        }
        Ok(m)
    }
}
