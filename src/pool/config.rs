//! `[pool]`: which pool this node maps and how (every knob documented in
//! config/cxlkv.toml).
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{BackendKind, Coherence};
use crate::units::de_size;

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolConfig {
    pub backend: BackendKind,
    pub path: PathBuf,
    #[serde(deserialize_with = "de_size")]
    pub size: u64,
    #[serde(deserialize_with = "de_size")]
    pub region_size: u64,
    #[serde(deserialize_with = "de_size")]
    pub page_size: u64,
    pub prefault: bool,
    pub format: bool,
    /// Flush and invalidate cache lines (software) or not (hardware).
    pub coherence: Coherence,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            backend: BackendKind::Shm,
            path: "/dev/shm/cxlkv-pool".into(),
            size: 1 << 30,
            region_size: 256 << 20,
            page_size: 64 << 10,
            prefault: true,
            format: false,
            coherence: Coherence::Auto,
        }
    }
}
