//! `[registry.eviction.<policy>]`: what the policies' settings share. Each
//! policy keeps its settings type and their checks in its own file
//! (`Policy::Config`, `Policy::validate`); `PolicySettings` (`table.rs`)
//! holds one of each, read from the config and used when that policy is
//! the one named by `registry.eviction_policy` (the others' sections are
//! checked, not used).
use crate::error::{Error, Result};

/// A setting of `policy` it cannot work with, named with its section:
/// "registry.eviction.<policy>.<what> <why>".
pub fn refuse(policy: &str, what: &str, why: impl std::fmt::Display) -> Error {
    Error::invalid(format!("registry.eviction.{policy}.{what} {why}"))
}

/// Ghost slots per live entry beyond this buy nothing but memory.
const MAX_GHOST: f64 = 8.0;

/// Check a policy's `ghost` setting: slots of the ghost history per live
/// entry (`ghost.rs`), between 0 and `MAX_GHOST`.
pub fn check_ghost(policy: &str, ghost: f64) -> Result<()> {
    if ghost.is_finite() && (0.0..=MAX_GHOST).contains(&ghost) {
        return Ok(());
    }
    Err(refuse(policy, "ghost", format!("must be between 0 and {MAX_GHOST}")))
}

#[cfg(test)]
mod tests {
    use crate::config::Config;
    use crate::eviction::{GdConfig, KvConfig, PolicyConfig, PolicyKind, PolicySettings, POLICIES};

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

    /// Every row of the table is a policy the sidecar can run: its name
    /// parses (in any case) from the config and builds that policy, its
    /// default settings pass their checks, and it has a config section
    /// exactly when it has settings. A new row is checked with no edit here.
    #[test]
    fn every_row_of_the_table_is_a_whole_policy() {
        assert_eq!(PolicyKind::ALL.len(), POLICIES.len());
        for &kind in PolicyKind::ALL {
            let name = kind.as_str();
            assert_eq!(name.parse::<PolicyKind>().unwrap(), kind);
            assert_eq!(name.to_ascii_uppercase().parse::<PolicyKind>().unwrap(), kind);
            let c = Config::parse(&format!("[registry]\neviction_policy = \"{name}\"\n")).unwrap();
            c.validate().unwrap();
            let config = c.registry.eviction.config(c.registry.eviction_policy);
            assert_eq!(config, PolicyConfig::of(kind), "{name}: the settings of its own row");
            assert_eq!(config.kind(), kind);
            assert_eq!(config.build().name(), name);
            assert_eq!(config.simulation().build().name(), name);
            let section = Config::parse(&format!("[registry.eviction.{name}]\n"));
            if PolicySettings::SECTIONS.contains(&name) {
                let c = section.unwrap();
                c.validate().unwrap();
                assert_eq!(c.registry.eviction, PolicySettings::default(), "{name}: an empty section is the defaults");
            } else {
                assert!(section.unwrap_err().message().contains(name), "{name} has no settings, so no section");
            }
        }
        // The printed settings are every section, in order of name, and
        // read back as they were.
        let text = toml::to_string(&PolicySettings::default()).unwrap();
        let printed: Vec<&str> = text.lines().filter(|l| l.starts_with('[')).collect();
        let want: Vec<String> = PolicySettings::SECTIONS.iter().map(|s| format!("[{s}]")).collect();
        assert_eq!(printed, want);
        assert!(want.windows(2).all(|w| w[0] < w[1]), "{want:?}");
        assert_eq!(toml::from_str::<PolicySettings>(&text).unwrap(), PolicySettings::default());
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
