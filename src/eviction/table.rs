//! The table of policies made into types. `policies!` takes `mod.rs`'s one
//! row per policy (`module::{Policy, Config}`) and derives from the rows
//! everything that lists the policies: the modules and their exports,
//! `PolicyKind` (a name per row, `ALL`), `PolicyConfig` (a variant per row:
//! `build`, `of`, `simulation`) and `PolicySettings` (a field per row: the
//! `[registry.eviction.<name>]` sections, their validation). What a row's
//! policy contributes comes from its `Policy` impl, in its own file.
//!
//! The parts that need no list of policies (parsing a name, `POLICIES`)
//! follow the macro.
use super::{PolicyKind, POLICIES};
use crate::error::{Error, Result};

macro_rules! policies {
    ($($module:ident :: { $policy:ident, $config:ident }),+ $(,)?) => {
        $(
            mod $module;
            pub use $module::{$policy, $config};
            const _: () = assert!(
                $crate::eviction::table::same(<$policy as $crate::eviction::Policy>::NAME, stringify!($module)),
                "a policy's name is its module's"
            );
        )+

        /// A policy by name, as the config and the command line give it
        /// (one variant per row of the table). Names are matched without
        /// regard to case and `default` names `PolicyKind::DEFAULT`, as they
        /// always were, so the config parses it by hand rather than with
        /// serde's exact variant names; an unknown name fails at parse time
        /// with the list of known ones.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum PolicyKind {
            $($policy,)+
        }

        impl PolicyKind {
            /// Every policy, in the table's order.
            pub const ALL: &'static [PolicyKind] = &[$(PolicyKind::$policy,)+];

            /// The name in configs, metrics and `EvictionPolicy::name`.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(PolicyKind::$policy => <$policy as $crate::eviction::Policy>::NAME,)+
                }
            }
        }

        /// Every policy and its settings.
        #[derive(Debug, Clone, PartialEq)]
        pub enum PolicyConfig {
            $($policy($config),)+
        }

        impl PolicyConfig {
            pub fn build(&self) -> Box<dyn $crate::eviction::EvictionPolicy> {
                match self {
                    $(PolicyConfig::$policy(c) => Box::new(<$policy as $crate::eviction::Policy>::new(c.clone())),)+
                }
            }

            /// The policy as a miniature simulation runs it
            /// (`registry::shadows`; `Policy::simulation`).
            pub fn simulation(&self) -> Self {
                match self {
                    $(PolicyConfig::$policy(c) => {
                        PolicyConfig::$policy(<$policy as $crate::eviction::Policy>::simulation(c))
                    })+
                }
            }

            /// The policy `kind` with its default settings.
            pub fn of(kind: PolicyKind) -> Self {
                match kind {
                    $(PolicyKind::$policy => PolicyConfig::$policy($config::default()),)+
                }
            }

            pub fn kind(&self) -> PolicyKind {
                match self {
                    $(PolicyConfig::$policy(_) => PolicyKind::$policy,)+
                }
            }
        }

        /// `[registry.eviction.<policy>]`: the settings of every policy, one
        /// field per row (named for its module, which is named for the
        /// policy). Read from the config and used when that policy is the
        /// one named by `registry.eviction_policy` (the others' sections are
        /// checked, not used). Only policies with settings have a section.
        #[derive(Debug, Clone, Default, PartialEq)]
        pub struct PolicySettings {
            $(pub $module: $config,)+
        }

        impl PolicySettings {
            /// The policy `kind` with these settings.
            pub fn config(&self, kind: PolicyKind) -> PolicyConfig {
                match kind {
                    $(PolicyKind::$policy => PolicyConfig::$policy(self.$module.clone()),)+
                }
            }

            /// Values a policy cannot work with, named with their section.
            pub fn validate(&self) -> $crate::error::Result<()> {
                $(<$policy as $crate::eviction::Policy>::validate(&self.$module)?;)+
                Ok(())
            }

            /// The names of the policies with a section, in order of name (the
            /// order of the sections in a printed config).
            pub const SECTIONS: &'static [&'static str] = &{
                const N: usize = 0 $(+ <$policy as $crate::eviction::Policy>::SECTION as usize)+;
                let mut names = [""; N];
                let mut i = 0;
                $(if <$policy as $crate::eviction::Policy>::SECTION {
                    names[i] = <$policy as $crate::eviction::Policy>::NAME;
                    i += 1;
                })+
                $crate::eviction::table::sort(&mut names);
                let _ = i;
                names
            };

            /// Read the section `name` (one of `SECTIONS`) into its field.
            fn read_section<'de, A: serde::de::MapAccess<'de>>(
                &mut self,
                name: &str,
                map: &mut A,
            ) -> std::result::Result<(), A::Error> {
                $(if name == <$policy as $crate::eviction::Policy>::NAME {
                    self.$module = map.next_value()?;
                })+
                Ok(())
            }

            /// Write the section `name` (one of `SECTIONS`).
            fn write_section<M: serde::ser::SerializeMap>(&self, name: &str, map: &mut M) -> std::result::Result<(), M::Error> {
                $(if name == <$policy as $crate::eviction::Policy>::NAME {
                    return map.serialize_entry(name, &self.$module);
                })+
                Ok(())
            }
        }

        impl<'de> serde::Deserialize<'de> for PolicySettings {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                d.deserialize_map($crate::eviction::table::SettingsVisitor)
            }
        }

        impl serde::Serialize for PolicySettings {
            fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                use serde::ser::SerializeMap;
                let mut map = s.serialize_map(Some(Self::SECTIONS.len()))?;
                for name in Self::SECTIONS {
                    self.write_section(name, &mut map)?;
                }
                map.end()
            }
        }
    };
}
pub(super) use policies;

/// Sort names bytewise, at compile time (`PolicySettings::SECTIONS`).
pub(super) const fn sort(names: &mut [&str]) {
    let mut i = 1;
    while i < names.len() {
        let mut j = i;
        while j > 0 && before(names[j], names[j - 1]) {
            let t = names[j];
            names[j] = names[j - 1];
            names[j - 1] = t;
            j -= 1;
        }
        i += 1;
    }
}

/// `a == b`, at compile time.
pub(super) const fn same(a: &str, b: &str) -> bool {
    !before(a, b) && !before(b, a)
}

const fn before(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut i = 0;
    while i < a.len() && i < b.len() {
        if a[i] != b[i] {
            return a[i] < b[i];
        }
        i += 1;
    }
    a.len() < b.len()
}

/// `[registry.eviction]`: a table of sections, each a policy's name; a
/// missing section keeps that policy's defaults, an unknown name (or a
/// policy without settings) fails at parse time.
pub(super) struct SettingsVisitor;

impl<'de> serde::de::Visitor<'de> for SettingsVisitor {
    type Value = super::PolicySettings;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a table of eviction policy sections")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> std::result::Result<Self::Value, A::Error> {
        let mut settings = super::PolicySettings::default();
        while let Some(Section(name)) = map.next_key()? {
            settings.read_section(name, &mut map)?;
        }
        Ok(settings)
    }
}

/// A section's name, checked as it is read (so a parse error points at
/// the name, as it does for a struct's unknown field).
struct Section(&'static str);

impl<'de> serde::Deserialize<'de> for Section {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let name = std::borrow::Cow::<str>::deserialize(d)?;
        let known = super::PolicySettings::SECTIONS;
        match known.iter().find(|&&s| s == name) {
            Some(s) => Ok(Section(s)),
            None => Err(serde::de::Error::unknown_field(&name, known)),
        }
    }
}

impl Default for PolicyKind {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = Error;
    fn from_str(name: &str) -> Result<Self> {
        let lower = name.to_ascii_lowercase();
        if lower == "default" {
            return Ok(Self::DEFAULT);
        }
        Self::ALL.iter().copied().find(|k| k.as_str() == lower).ok_or_else(|| {
            Error::invalid(format!("unknown eviction policy {lower:?}; known: default, {}", POLICIES.join(", ")))
        })
    }
}

impl<'de> serde::Deserialize<'de> for PolicyKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let name = std::borrow::Cow::<str>::deserialize(d)?;
        name.parse().map_err(|e: Error| serde::de::Error::custom(e.message()))
    }
}

impl serde::Serialize for PolicyKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}
