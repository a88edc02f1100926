//! Per-tenant byte quotas and guaranteed shares (`[quotas]`).
//!
//! A tenant's *use* is the payload bytes of its committed keys plus those of
//! its open reservations, pool-wide (the primary's registry sees every node).
//! - **Quota**: a reserve that would take a tenant past its quota first evicts
//!   that tenant's own entries, in the configured policy's order over the
//!   tenant's entries alone; what still does not fit is refused with
//!   RESOURCE_EXHAUSTED. Other tenants' entries are never evicted for it.
//! - **Guaranteed share**: eviction for another tenant's store (a node out of
//!   pages) never takes an entry that would leave its tenant below its
//!   guaranteed bytes; a tenant's own stores may still evict its own entries.
//!
//! Limits are taken when a tenant first appears in the registry (a tenant
//! holding nothing is forgotten, so a changed config applies from then on, or
//! after a restart).
use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};

use crate::error::{Error, Result};
use crate::units::de_size;

/// `[quotas]`: defaults for every tenant plus overrides by tenant name.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct QuotaConfig {
    /// Bytes a tenant may use (committed or being written); 0 = no quota.
    #[serde(deserialize_with = "de_size")]
    pub default_bytes: u64,
    /// Bytes of a tenant that other tenants' stores never evict; 0 = none.
    #[serde(deserialize_with = "de_size")]
    pub default_guaranteed_bytes: u64,
    /// Overrides by tenant name (LMCache's `cache_salt`; "" is the tenant of
    /// requests that name none).
    pub tenants: BTreeMap<String, TenantQuota>,
}

/// One tenant's override; a field left out takes the default.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TenantQuota {
    #[serde(deserialize_with = "de_opt_size", skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    #[serde(deserialize_with = "de_opt_size", skip_serializing_if = "Option::is_none")]
    pub guaranteed_bytes: Option<u64>,
}

/// A tenant's limits; 0 = none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limit {
    pub quota: u64,
    pub guaranteed: u64,
}

impl Limit {
    /// Whether `used + more` bytes fit under the quota.
    pub fn admits(self, used: u64, more: u64) -> bool {
        self.quota == 0 || used.saturating_add(more) <= self.quota
    }

    /// Whether taking `size` bytes from a tenant using `used` keeps it at
    /// or above its guaranteed share.
    pub fn spares(self, used: u64, size: u64) -> bool {
        self.guaranteed > 0 && used.saturating_sub(size) < self.guaranteed
    }
}

impl QuotaConfig {
    pub fn limit(&self, tenant: &str) -> Limit {
        let o = self.tenants.get(tenant);
        Limit {
            quota: o.and_then(|o| o.bytes).unwrap_or(self.default_bytes),
            guaranteed: o.and_then(|o| o.guaranteed_bytes).unwrap_or(self.default_guaranteed_bytes),
        }
    }

    /// Some tenant may have a quota: the registry then keeps an eviction
    /// order per tenant besides the one per node.
    pub fn has_quotas(&self) -> bool {
        self.default_bytes > 0 || self.tenants.values().any(|t| t.bytes.is_some_and(|b| b > 0))
    }

    /// Some tenant may have a guaranteed share: node eviction checks each
    /// victim's tenant.
    pub fn has_guarantees(&self) -> bool {
        self.default_guaranteed_bytes > 0 || self.tenants.values().any(|t| t.guaranteed_bytes.is_some_and(|b| b > 0))
    }

    /// A guaranteed share above the tenant's own quota could never be used.
    pub fn validate(&self) -> Result<()> {
        let check = |who: &str, l: Limit| {
            if l.quota > 0 && l.guaranteed > l.quota {
                return Err(Error::invalid(format!(
                    "quotas: {who} guarantees {} bytes but its quota is {} bytes",
                    l.guaranteed, l.quota
                )));
            }
            Ok(())
        };
        check("the default", Limit { quota: self.default_bytes, guaranteed: self.default_guaranteed_bytes })?;
        for name in self.tenants.keys() {
            check(&format!("tenant {name:?}"), self.limit(name))?;
        }
        Ok(())
    }
}

fn de_opt_size<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<u64>, D::Error> {
    de_size(d).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<crate::config::Config> {
        crate::config::Config::parse(text)
    }

    #[test]
    fn overrides_take_the_defaults_for_what_they_leave_out() {
        let c = parse(
            "[quotas]\ndefault_bytes = \"1MiB\"\ndefault_guaranteed_bytes = 4096\n\
             [quotas.tenants.a]\nbytes = \"2MiB\"\n[quotas.tenants.b]\nguaranteed_bytes = \"64k\"\n",
        )
        .unwrap();
        let q = &c.quotas;
        assert_eq!(q.limit("a"), Limit { quota: 2 << 20, guaranteed: 4096 });
        assert_eq!(q.limit("b"), Limit { quota: 1 << 20, guaranteed: 64 << 10 });
        assert_eq!(q.limit("other"), Limit { quota: 1 << 20, guaranteed: 4096 });
        assert!(q.has_quotas() && q.has_guarantees());
        assert!(!QuotaConfig::default().has_quotas() && !QuotaConfig::default().has_guarantees());
    }

    #[test]
    fn bad_quota_settings_are_refused_with_the_reason() {
        let e = parse("[quotas.tenants.a]\nbites = 1\n").unwrap_err();
        assert!(e.message().contains("bites"), "{}", e.message());
        let c = parse("[quotas.tenants.a]\nbytes = 100\nguaranteed_bytes = 200\n").unwrap();
        let e = c.validate().unwrap_err();
        assert!(e.message().contains("tenant \"a\" guarantees 200 bytes but its quota is 100"), "{}", e.message());
        let e = parse("[quotas]\ndefault_bytes = \"12 parsecs\"\n").unwrap_err();
        assert!(e.message().contains("unknown unit"), "{}", e.message());
    }

    #[test]
    fn limits_admit_and_spare() {
        let l = Limit { quota: 100, guaranteed: 40 };
        assert!(l.admits(60, 40) && !l.admits(61, 40));
        assert!(Limit::default().admits(u64::MAX, 1), "no quota admits anything");
        assert!(l.spares(50, 20), "taking 20 of 50 leaves 30 < 40");
        assert!(!l.spares(60, 20), "taking 20 of 60 leaves 40");
        assert!(!Limit::default().spares(1, 1), "no guarantee spares nothing");
    }
}
