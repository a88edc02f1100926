//! `[registry.eviction.<policy>]`: the settings of the policies that have
//! any, read from the config and used when that policy is the one named by
//! `registry.eviction_policy` (the others' sections are checked, not used).
use serde::{Deserialize, Serialize};

use super::gd::B as GD_MAX_VALUE;
use super::{GdConfig, KvConfig, PolicyConfig, PolicyKind, S3FifoConfig, TtlConfig};
use crate::error::{Error, Result};

#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicySettings {
    pub gd: GdConfig,
    pub kv: KvConfig,
    pub s3fifo: S3FifoConfig,
    pub ttl: TtlConfig,
}

/// Room a `kv` score has above "now" (its window's headroom): a penalty or
/// bonus of more quarter doublings would wrap.
const KV_MAX_QUARTERS: u32 = 64;
/// Ghost slots per live entry beyond this buy nothing but memory.
const MAX_GHOST: f64 = 8.0;

impl PolicySettings {
    /// The policy `kind` with these settings.
    pub fn config(&self, kind: PolicyKind) -> PolicyConfig {
        match kind {
            PolicyKind::Gd => PolicyConfig::Gd(self.gd.clone()),
            PolicyKind::Kv => PolicyConfig::Kv(self.kv.clone()),
            PolicyKind::S3Fifo => PolicyConfig::S3Fifo(self.s3fifo.clone()),
            PolicyKind::Ttl => PolicyConfig::Ttl(self.ttl.clone()),
            other => PolicyConfig::of(other),
        }
    }

    /// Values a policy cannot work with, named with their section.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str, why: &str| Err(Error::invalid(format!("registry.eviction.{what} {why}")));
        let (gd, kv, s3, ttl) = (&self.gd, &self.kv, &self.s3fifo, &self.ttl);
        if gd.read.max(gd.ghost_value).max(gd.ghost_read_value) >= GD_MAX_VALUE {
            return bad("gd.read, gd.ghost_value and gd.ghost_read_value", &format!("must be below {GD_MAX_VALUE}"));
        }
        if gd.fresh > gd.read {
            return bad("gd.fresh", "must be at most gd.read");
        }
        if !(gd.adapt.is_finite() && gd.adapt >= 0.0) {
            return bad("gd.adapt", "must be a number of at least 0");
        }
        if !(kv.decay.is_finite() && kv.decay > 0.0) {
            return bad("kv.decay", "must be a number above 0");
        }
        if !(kv.adapt_step.is_finite() && kv.adapt_step >= 0.0) {
            return bad("kv.adapt_step", "must be a number of at least 0");
        }
        if kv.fresh_penalty > KV_MAX_QUARTERS || u32::from(kv.max_bonus) > KV_MAX_QUARTERS {
            return bad("kv.fresh_penalty and kv.max_bonus", &format!("must be at most {KV_MAX_QUARTERS}"));
        }
        for (what, g) in [("gd.ghost", gd.ghost), ("kv.ghost", kv.ghost), ("s3fifo.ghost", s3.ghost)] {
            if !(g.is_finite() && (0.0..=MAX_GHOST).contains(&g)) {
                return bad(what, &format!("must be between 0 and {MAX_GHOST}"));
            }
        }
        if !(s3.small.is_finite() && s3.small > 0.0 && s3.small < 1.0) {
            return bad("s3fifo.small", "must be a share between 0 and 1 (exclusive)");
        }
        if ttl.max_age_ms == 0 || ttl.max_age_ms > u64::from(u32::MAX) {
            return bad("ttl.max_age_ms", &format!("must be between 1 and {}", u32::MAX));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;
    use crate::eviction::{GdConfig, KvConfig, PolicyConfig, PolicyKind};

    #[test]
    fn the_named_policy_takes_its_section() {
        let c = Config::parse(
            "[registry]\neviction_policy = \"kv\"\n[registry.eviction.kv]\ndecay = 2.0\npartial_first = false\n\
             [registry.eviction.ttl]\nmax_age_ms = 5000\n",
        )
        .unwrap();
        c.validate().unwrap();
        let r = &c.registry;
        let want = KvConfig { decay: 2.0, partial_first: false, ..KvConfig::default() };
        assert_eq!(r.eviction.config(r.eviction_policy), PolicyConfig::Kv(want));
        match r.eviction.config(PolicyKind::Ttl) {
            PolicyConfig::Ttl(t) => assert_eq!(t.max_age_ms, 5000),
            other => panic!("{other:?}"),
        }
        assert_eq!(r.eviction.config(PolicyKind::Lru), PolicyConfig::of(PolicyKind::Lru));
        // The default policy's section, e.g. a fixed fresh value and a smaller ghost.
        let c = Config::parse("[registry.eviction.gd]\nadapt = 0.0\nghost = 1.0\n").unwrap();
        c.validate().unwrap();
        let want = GdConfig { adapt: 0.0, ghost: 1.0, ..GdConfig::default() };
        assert_eq!(c.registry.eviction.config(PolicyKind::Gd), PolicyConfig::Gd(want));
    }

    #[test]
    fn settings_a_policy_cannot_use_are_refused_with_their_name() {
        for (toml, want) in [
            ("[registry.eviction.kv]\ndecay = 0.0\n", "registry.eviction.kv.decay must be a number above 0"),
            (
                "[registry.eviction.gd]\nread = 256\n",
                "registry.eviction.gd.read, gd.ghost_value and gd.ghost_read_value must be below 256",
            ),
            (
                "[registry.eviction.gd]\nghost_read_value = 300\n",
                "registry.eviction.gd.read, gd.ghost_value and gd.ghost_read_value must be below 256",
            ),
            ("[registry.eviction.gd]\nread = 10\nfresh = 11\n", "registry.eviction.gd.fresh must be at most gd.read"),
            ("[registry.eviction.gd]\nadapt = -1.0\n", "registry.eviction.gd.adapt must be a number of at least 0"),
            ("[registry.eviction.gd]\nghost = 9.0\n", "registry.eviction.gd.ghost must be between 0 and 8"),
            ("[registry.eviction.kv]\nmax_bonus = 65\n", "must be at most 64"),
            ("[registry.eviction.s3fifo]\nsmall = 1.0\n", "registry.eviction.s3fifo.small must be a share"),
            ("[registry.eviction.s3fifo]\nghost = -1.0\n", "registry.eviction.s3fifo.ghost must be between 0 and 8"),
            ("[registry.eviction.ttl]\nmax_age_ms = 0\n", "registry.eviction.ttl.max_age_ms must be between 1"),
        ] {
            let e = Config::parse(toml).unwrap().validate().unwrap_err();
            assert!(e.message().contains(want), "{toml}: {}", e.message());
        }
        let e = Config::parse("[registry.eviction.kv]\ndeacy = 1.0\n").unwrap_err();
        assert!(e.message().contains("deacy"), "unknown settings fail at parse time: {}", e.message());
        let e = Config::parse("[registry.eviction.lru]\nx = 1\n").unwrap_err();
        assert!(e.message().contains("lru"), "a policy without settings has no section: {}", e.message());
    }
}
