//! `[registry]`: the registry's and the handler's limits and timings, the
//! eviction policy with its settings, and admission.
use serde::{Deserialize, Serialize};

use crate::eviction::PolicyKind;
use crate::units::de_size;

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RegistryConfig {
    pub eviction_policy: PolicyKind,
    /// `[registry.eviction.<policy>]`: the settings of the policies that have any.
    pub eviction: crate::eviction::PolicySettings,
    /// Which stores are worth a place: `adaptive`, `second_touch` or `off`
    /// (`admission.rs`).
    pub admission: super::AdmissionMode,
    /// Slots of admission's history per live entry (2 B each; at least
    /// 128 KiB, at most 16 MiB).
    pub admission_history: f64,
    pub max_regions_per_instance: u32,
    pub reservation_timeout_ms: u64,
    pub lock_ttl_ms: u64,
    pub max_lock_ttl_ms: u64,
    pub max_key_bytes: usize,
    pub max_batch: usize,
    pub reap_interval_ms: u64,
    /// Most tenants with keys or reservations at once.
    pub max_tenants: usize,
    /// Refuse commits without a payload checksum.
    pub require_checksum: bool,
    /// Bytes one client connection may hold locked plus reserved at once
    /// (0: half of the pool's region space); past it a lookup or reserve
    /// gets RESOURCE_EXHAUSTED for that key.
    #[serde(deserialize_with = "de_size")]
    pub max_client_pinned_bytes: u64,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            eviction_policy: PolicyKind::DEFAULT,
            eviction: Default::default(),
            admission: Default::default(),
            admission_history: super::AdmissionConfig::default().history,
            max_regions_per_instance: 0,
            reservation_timeout_ms: 10_000,
            lock_ttl_ms: 60_000,
            max_lock_ttl_ms: 600_000,
            max_key_bytes: 1024,
            max_batch: 4096,
            reap_interval_ms: 200,
            max_tenants: 1024,
            require_checksum: false,
            max_client_pinned_bytes: 0,
        }
    }
}

impl RegistryConfig {
    /// Checks parsing cannot make.
    pub fn validate(&self) -> crate::error::Result<()> {
        let h = self.admission_history;
        if !(h.is_finite() && (1.0..=64.0).contains(&h)) {
            return Err(crate::error::Error::invalid(format!(
                "registry.admission_history is {h}; it must be 1..=64 slots per entry"
            )));
        }
        Ok(())
    }

    /// The admission these settings ask for.
    pub fn admission(&self) -> super::AdmissionConfig {
        super::AdmissionConfig { mode: self.admission, history: self.admission_history }
    }
}
