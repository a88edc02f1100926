//! Sizes as people write them in configs and flags ("64KiB", "1GiB",
//! "4096"): a leaf every layer may use.
use serde::{Deserialize, Deserializer};

use crate::error::{Error, Result};

pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 =
        num.parse().map_err(|_| Error::invalid(format!("size {s:?}: expected a number with an optional unit")))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(Error::invalid(format!("size {s:?}: unknown unit {other:?}"))),
    };
    n.checked_mul(mult).ok_or_else(|| Error::invalid(format!("size {s:?} overflows")))
}

/// Serde: a size given as a number of bytes or as a string with a unit.
pub fn de_size<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum S {
        N(u64),
        S(String),
    }
    match S::deserialize(d)? {
        S::N(n) => Ok(n),
        S::S(s) => parse_size(&s).map_err(|e| serde::de::Error::custom(e.message().to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("64k").unwrap(), 64 << 10);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size(" 2 MiB ").unwrap(), 2 << 20);
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("99999999999T").is_err());
    }
}
