//! The limits a handler enforces, all taken from the configuration.

#[derive(Debug, Clone)]
pub struct Limits {
    /// 0 = as many regions as the pool has.
    pub max_regions: u32,
    pub reservation_timeout_ms: u64,
    pub default_lock_ttl_ms: u64,
    pub max_lock_ttl_ms: u64,
    pub max_key_bytes: usize,
    pub max_tenant_bytes: usize,
    pub max_batch: usize,
    pub prefault: bool,
    /// Refuse commits without a payload checksum (see `commit`).
    pub require_checksum: bool,
    /// Bytes one client may hold locked plus reserved (`pin_limit` in
    /// `node.rs` resolves the configured 0 to half the pool; told to
    /// clients in PoolInfo, so they can keep within it).
    pub max_client_pinned_bytes: u64,
}

/// Longest tenant name (LMCache `cache_salt`) accepted.
pub const MAX_TENANT_BYTES: usize = 256;

impl Limits {
    /// The limits `[registry]` sets (`prefault`: `[pool] prefault`): the
    /// config's defaults are the only defaults (config/cxlkv.toml lists them).
    pub fn new(r: &crate::registry::config::RegistryConfig, prefault: bool) -> Self {
        Self {
            max_regions: r.max_regions_per_instance,
            reservation_timeout_ms: r.reservation_timeout_ms,
            default_lock_ttl_ms: r.lock_ttl_ms,
            max_lock_ttl_ms: r.max_lock_ttl_ms,
            max_key_bytes: r.max_key_bytes,
            max_tenant_bytes: MAX_TENANT_BYTES,
            max_batch: r.max_batch,
            prefault,
            require_checksum: r.require_checksum,
            max_client_pinned_bytes: r.max_client_pinned_bytes,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self::new(&Default::default(), true)
    }
}
