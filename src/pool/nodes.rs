//! The node table (cluster mode): node name → node id, kept in the unused
//! tail of the superblock's 4 KiB so ids survive a primary restart. Only
//! the primary writes it. A zeroed table is empty, so pools formatted
//! before it existed need no migration.
//!
//! Entry (64 bytes): id u32 (0 = unused) | name length u32 | name (56 bytes).
use super::Pool;
use crate::error::{Error, ErrorKind, Result};

const TABLE_AT: u64 = 1024;
const ENTRY: u64 = 64;
/// Longest node name the table holds.
pub const MAX_NAME: usize = 56;
/// Nodes one pool can know.
pub const MAX_NODES: u32 = ((4096 - TABLE_AT) / ENTRY) as u32;

impl Pool {
    /// Every (node id, name) recorded.
    pub fn nodes(&self) -> Result<Vec<(u32, String)>> {
        let mut raw = vec![0u8; (MAX_NODES as u64 * ENTRY) as usize];
        self.meta.invalidate(TABLE_AT, raw.len())?;
        self.meta.read(TABLE_AT, &mut raw)?;
        let mut out = vec![];
        for e in raw.chunks(ENTRY as usize) {
            let id = u32::from_le_bytes(e[..4].try_into().expect("4 bytes"));
            let len = u32::from_le_bytes(e[4..8].try_into().expect("4 bytes")) as usize;
            if id == 0 || len > MAX_NAME {
                continue;
            }
            out.push((id, String::from_utf8_lossy(&e[8..8 + len]).into_owned()));
        }
        Ok(out)
    }

    /// The id of `name`, recording it with the lowest unused id (above every
    /// id in `taken`, e.g. ids this host's other processes hold) if new.
    pub fn node_id_for(&self, name: &str) -> Result<u32> {
        if name.is_empty() || name.len() > MAX_NAME {
            return Err(Error::invalid(format!("node name {name:?} must be 1..={MAX_NAME} bytes")));
        }
        let known = self.nodes()?;
        if let Some((id, _)) = known.iter().find(|(_, n)| n == name) {
            return Ok(*id);
        }
        let id = (1..=MAX_NODES).find(|i| !known.iter().any(|(k, _)| k == i)).ok_or_else(|| {
            Error::new(ErrorKind::ResourceExhausted, format!("the pool's node table is full ({MAX_NODES} nodes)"))
        })?;
        let slot = (1..=MAX_NODES).map(|s| TABLE_AT + (s as u64 - 1) * ENTRY);
        let mut free_at = None;
        for at in slot {
            let mut b = [0u8; 4];
            self.meta.read(at, &mut b)?;
            if u32::from_le_bytes(b) == 0 {
                free_at = Some(at);
                break;
            }
        }
        self.check_epoch()?;
        let at = free_at.expect("a free id means a free slot");
        let mut e = [0u8; ENTRY as usize];
        e[4..8].copy_from_slice(&(name.len() as u32).to_le_bytes());
        e[8..8 + name.len()].copy_from_slice(name.as_bytes());
        // The name first, the id (which makes the entry used) last.
        self.meta.write(at + 4, &e[4..])?;
        self.meta.write(at, &id.to_le_bytes())?;
        self.meta.flush(at, ENTRY as usize)?;
        Ok(id)
    }
}
