//! The key operations a client asks and the registry answers: lookups
//! with their locks and TTLs, unlocks, a closed session's locks, deletes,
//! exists, the key listing and the removal log, each checked here first.

use super::{Handler, UnlockThenLookup};
use crate::error::{Error, Result};
use crate::registry::ops::Looked;
use crate::registry::Ops;
use crate::registry::{Listed, Location, Removed, Scope, Session};

impl Handler {
    /// Returns per-key hits (locked for `owner`) and the lock TTL used.
    pub async fn lookup_and_lock<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        ttl_ms: u64,
        owner: Session,
    ) -> Result<(Vec<Option<Location>>, u64)> {
        let none: [&[u8]; 0] = [];
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_ref()).collect();
        let (_, hits, ttl) = self.unlock_then_lookup(&none, &keys, ttl_ms, owner, &Scope::All).await?;
        Ok((hits.into_iter().map(|h| h.ok().flatten()).collect(), ttl))
    }

    /// Release `unlock` (as `unlock`), then look up and lock `keys`, all for
    /// `owner`; keys of tenants outside `scope` are PermissionDenied per key.
    /// Both batches are validated first, so on an error nothing was applied.
    pub async fn unlock_then_lookup<K: AsRef<[u8]>>(
        &self,
        unlock: &[K],
        keys: &[K],
        ttl_ms: u64,
        owner: Session,
        scope: &Scope,
    ) -> Result<UnlockThenLookup> {
        self.check_keys(unlock)?;
        self.check_keys(keys)?;
        let ttl = self.lock_ttl(ttl_ms)?;
        let (unlock, keys): (Vec<&[u8]>, Vec<&[u8]>) =
            (unlock.iter().map(|k| k.as_ref()).collect(), keys.iter().map(|k| k.as_ref()).collect());
        let (unlocked, hits): Looked = self.dir.lookup(&unlock, &keys, ttl, owner, scope).await?;
        Ok((unlocked, hits, ttl))
    }

    pub(super) fn lock_ttl(&self, ttl_ms: u64) -> Result<u64> {
        let ttl = if ttl_ms == 0 { self.limits.default_lock_ttl_ms } else { ttl_ms };
        if ttl > self.limits.max_lock_ttl_ms {
            return Err(Error::invalid(format!(
                "lock TTL {ttl} ms exceeds the limit of {} ms",
                self.limits.max_lock_ttl_ms
            )));
        }
        Ok(ttl)
    }

    /// Release one of `owner`'s locks per key.
    pub async fn unlock<K: AsRef<[u8]>>(&self, keys: &[K], owner: Session) -> Result<Vec<Result<()>>> {
        self.check_keys(keys)?;
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_ref()).collect();
        self.dir.unlock(&keys, owner).await
    }

    /// A client connection closed: the locks it held are released.
    pub async fn session_closed(&self, owner: Session) -> Result<u64> {
        self.dir.release_session(owner).await
    }

    pub async fn delete<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Result<Location>>> {
        self.delete_in(keys, &Scope::All).await
    }

    /// Delete keys of `scope`'s tenants (others: PermissionDenied per key).
    pub async fn delete_in<K: AsRef<[u8]>>(&self, keys: &[K], scope: &Scope) -> Result<Vec<Result<Location>>> {
        self.check_keys(keys)?;
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_ref()).collect();
        let out = self.dir.delete(&keys, scope).await?;
        // Locations in other nodes' regions: their owners get a free notice.
        self.regions.release(&out.iter().filter_map(|r| r.as_ref().ok().copied()).collect::<Vec<_>>());
        Ok(out)
    }

    /// Committed keys of `scope`'s tenants (another tenant's key is false).
    pub async fn exists<K: AsRef<[u8]>>(&self, keys: &[K], scope: &Scope) -> Result<Vec<bool>> {
        self.check_keys(keys)?;
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_ref()).collect();
        self.dir.exists(&keys, scope).await
    }

    /// Keys of `tenant` (or of every tenant) that `scope` shows.
    pub async fn list(&self, cursor: u64, limit: u32, tenant: Option<&str>, scope: &Scope) -> Result<Listed> {
        let limit = if limit == 0 { 500 } else { limit };
        if limit > 10_000 {
            return Err(Error::invalid(format!("page size {limit} exceeds 10000")));
        }
        if let Some(t) = tenant.filter(|t| !scope.allows(t)) {
            return Err(Scope::denied(format_args!("tenant {t:?}")));
        }
        self.dir.list(cursor, limit as usize, tenant, scope).await
    }

    pub async fn removed_since(&self, since: u64, max: u32) -> Result<(Vec<Removed>, u64, bool)> {
        let max = if max == 0 { 1000 } else { max };
        if max > 10_000 {
            return Err(Error::invalid(format!("max {max} exceeds 10000")));
        }
        self.dir.removed_since(since, max as usize).await
    }
}
