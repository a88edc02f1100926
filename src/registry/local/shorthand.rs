//! Shorthand calls for the sidecar's own session over every tenant: the
//! registry embedded in a benchmark or the trace replayer (`crates/`), and
//! the registry's unit tests.
use super::LocalRegistry;
use crate::error::Result;
use crate::ids::{NodeId, ReservationId};
use crate::registry::{Freed, Location, ReserveOpts, Scope, Session};

impl LocalRegistry {
    /// Record reservations; per item an unguessable reservation id, or
    /// AlreadyExists, or ResourceExhausted when the tenant limit is reached.
    pub fn reserve(
        &self,
        tenant: &str,
        items: Vec<(Vec<u8>, Location)>,
        opts: ReserveOpts,
    ) -> Vec<Result<ReservationId>> {
        self.reserve_seq(tenant, items, opts).into_iter().map(|r| r.map(|(id, _)| id)).collect()
    }

    /// Lock each committed key for `ttl_ms` for the sidecar's own session
    /// (refcounted); `None` = miss.
    pub fn lookup_and_lock(&self, keys: &[&[u8]], ttl_ms: u64, now: u64) -> Vec<Option<Location>> {
        let out = self.lookup_and_lock_in(keys, ttl_ms, now, Session::LOCAL, &Scope::All);
        out.into_iter().map(|r| r.ok().flatten()).collect()
    }

    /// As `unlock_as`, for the sidecar's own session.
    pub fn unlock(&self, keys: &[&[u8]], now: u64) -> Vec<Result<()>> {
        self.unlock_as(keys, now, Session::LOCAL)
    }

    /// Delete unlocked committed keys.
    pub fn delete(&self, keys: &[&[u8]], now: u64) -> Vec<Result<Location>> {
        self.delete_with(keys, now, &Scope::All, &mut |_| {})
    }

    /// Remove least-valuable unlocked committed entries of `node` until at
    /// least `pages` pages (of `page_size`) are freed or none are left.
    pub fn evict(&self, node: NodeId, pages: u64, page_size: u64, now: u64) -> Freed {
        self.evict_for(None, node, pages, page_size, now)
    }
}

#[cfg(test)]
impl LocalRegistry {
    /// Committed keys only.
    pub fn exists(&self, keys: &[&[u8]]) -> Vec<bool> {
        self.exists_in(keys, &Scope::All)
    }

    /// Committed keys from `cursor` on; returns the next cursor (0 = done).
    pub fn list(&self, cursor: u64, limit: usize, tenant: Option<&str>) -> (Vec<crate::registry::KeyInfo>, u64) {
        self.list_in(cursor, limit, tenant, &Scope::All)
    }
}
