//! Read-only views: the key listing, the removal log, the figures.

use super::LocalRegistry;
use crate::registry::{KeyInfo, RegistryStats, Removed, Scope, TenantUsage};

impl LocalRegistry {
    /// As `list`, showing only keys of `scope`'s tenants.
    pub fn list_in(&self, cursor: u64, limit: usize, tenant: Option<&str>, scope: &Scope) -> (Vec<KeyInfo>, u64) {
        let g = self.lock();
        let allowed = g.scope_ids(scope);
        let want = tenant.map(|t| g.tenant_ids.get(t).copied());
        if want == Some(None) {
            return (vec![], 0); // no such tenant: nothing to page through
        }
        let mut out = vec![];
        let mut i = cursor as usize;
        while i < g.slab.len() && out.len() < limit {
            if let Some(e) = &g.slab[i] {
                let visible = allowed.as_ref().is_none_or(|a| a.contains(&e.tenant));
                if e.committed && visible && want.is_none_or(|w| w == Some(e.tenant)) {
                    out.push(KeyInfo {
                        key: e.key.as_slice().to_vec(),
                        tenant: g.tenant_name(e.tenant).to_string(),
                        size: e.length(),
                    });
                }
            }
            i += 1;
        }
        (out, if i < g.slab.len() { i as u64 } else { 0 })
    }

    /// Removals with seq >= `since` (at most `max`), the next seq, and whether
    /// some removals after `since` were already dropped from the log.
    pub fn removed_since(&self, since: u64, max: usize) -> (Vec<Removed>, u64, bool) {
        let g = self.lock();
        let oldest = g.removed.front().map(|r| r.0).unwrap_or(g.removed_next);
        // A cursor this log never handed out (another instance's log, such
        // as a primary's before it restarted) means nothing here: the
        // consumer is told, as for removals the log dropped.
        let foreign = since != 0 && (since < g.removed_base || since > g.removed_next);
        let since = if since == 0 || foreign { g.removed_base } else { since };
        let truncated = foreign || since < oldest;
        let skip = since.saturating_sub(oldest) as usize;
        let out: Vec<Removed> = g
            .removed
            .iter()
            .skip(skip)
            .take(max)
            .map(|(seq, key, t, size, reason)| Removed {
                seq: *seq,
                key: key.to_vec(),
                tenant: t.to_string(),
                size: *size,
                reason: *reason,
            })
            .collect();
        let next = out.last().map(|r| r.seq + 1).unwrap_or(since.max(oldest));
        (out, next, truncated)
    }

    pub fn stats(&self) -> RegistryStats {
        let g = self.lock();
        RegistryStats {
            keys: g.keys,
            reserved: g.reserved,
            bytes_stored: g.bytes,
            locked_keys: g.locks.len() as u64,
            evictions: g.evictions,
            reservations_expired: g.reservations_expired,
            locks_expired: g.locks_expired,
            eviction_visits: g.eviction_visits,
            quota_evictions: g.quota_evictions,
            admission: g.admission.stats(),
            tenants: g
                .tenants
                .iter()
                .flatten()
                .map(|t| TenantUsage {
                    tenant: t.name.to_string(),
                    bytes: t.bytes,
                    keys: t.keys,
                    reserving_bytes: t.reserving,
                    quota_bytes: t.limit.quota,
                    guaranteed_bytes: t.limit.guaranteed,
                })
                .collect(),
        }
    }
}
