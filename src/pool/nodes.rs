//! The node table (cluster mode): node name → node id, kept in the unused
//! tail of the superblock's 4 KiB so ids survive a primary restart. Only
//! the primary writes it. A zeroed table is empty, so pools formatted
//! before it existed need no migration.
//!
//! Entry (64 bytes): id u32 (0 = unused) | name length u32 | name (56 bytes).
use super::{NodeId, Pool};
use crate::error::{Error, ErrorKind, Result};

const TABLE_AT: u64 = 1024;
const ENTRY: u64 = 64;
/// Longest node name the table holds.
pub const MAX_NAME: usize = 56;
/// Nodes one pool can know.
pub const MAX_NODES: u32 = ((4096 - TABLE_AT) / ENTRY) as u32;

/// (node id, name) of every node, and the offsets of repeated entries.
type Table = (Vec<(u32, String)>, Vec<u64>);

impl Pool {
    /// Every (node id, name) recorded. A table only the primary wrote has
    /// unique ids and names; one that does not (damage, or a writer that is
    /// not cxlkv) is refused as `Corrupt`, never read as two nodes sharing
    /// an id, which would let both write the same regions. An entry equal to
    /// an earlier one (same id, same name: what two racing joins of one
    /// name wrote before updates were serialised) is one node, read once.
    pub fn nodes(&self) -> Result<Vec<(u32, String)>> {
        Ok(self.read_table()?.0)
    }

    /// The table's nodes, and the offsets of entries repeating an earlier one.
    fn read_table(&self) -> Result<Table> {
        let mut raw = vec![0u8; (MAX_NODES as u64 * ENTRY) as usize];
        self.meta.invalidate(TABLE_AT, raw.len())?;
        self.meta.read(TABLE_AT, &mut raw)?;
        let (mut out, mut repeats): (Vec<(u32, String)>, Vec<u64>) = (vec![], vec![]);
        for (slot, e) in raw.chunks(ENTRY as usize).enumerate() {
            let id = u32::from_le_bytes(e[..4].try_into().expect("4 bytes"));
            if id == 0 {
                continue;
            }
            let bad =
                |why: &str| Error::corrupt(format!("node table entry {slot}: {why}; reformat the pool (--format)"));
            let len = u32::from_le_bytes(e[4..8].try_into().expect("4 bytes")) as usize;
            if id > MAX_NODES || len == 0 || len > MAX_NAME {
                return Err(bad(&format!("id {id} or name length {len} out of range")));
            }
            let name = std::str::from_utf8(&e[8..8 + len]).map_err(|_| bad("the name is not UTF-8"))?;
            match out.iter().find(|(i, n)| *i == id || n == name) {
                Some((other, n)) if *other == id && n == name => repeats.push(TABLE_AT + slot as u64 * ENTRY),
                Some((other, _)) => return Err(bad(&format!("{name:?} (id {id}) clashes with node {other}"))),
                None => out.push((id, name.to_owned())),
            }
        }
        Ok((out, repeats))
    }

    /// The id of `name`, recording it with the lowest unused id if new.
    pub fn node_id_for(&self, name: &str) -> Result<u32> {
        self.node_id_reusing(name, |_| false)
    }

    /// As `node_id_for`; when the table is full, the entry of a node that
    /// owns no region and that `reusable` says is not alive is given to
    /// `name` (with its id): names that never served, or that left, must not
    /// keep real nodes out for ever.
    pub fn node_id_reusing(&self, name: &str, reusable: impl Fn(u32) -> bool) -> Result<u32> {
        if name.is_empty() || name.len() > MAX_NAME {
            return Err(Error::invalid(format!("node name {name:?} must be 1..={MAX_NAME} bytes")));
        }
        let _one_writer = self.names.lock().unwrap_or_else(|e| e.into_inner());
        let (known, repeats) = self.read_table()?;
        for at in repeats {
            self.check_epoch()?;
            tracing::warn!(offset = at, "the node table repeats an entry: clearing the repeat");
            self.meta.write(at, &0u32.to_le_bytes())?;
            self.meta.flush(at, 4)?;
        }
        if let Some((id, _)) = known.iter().find(|(_, n)| n == name) {
            return Ok(*id);
        }
        let unused = (1..=MAX_NODES).find(|i| !known.iter().any(|(k, _)| k == i));
        let idle =
            || known.iter().map(|(k, _)| *k).find(|&k| reusable(k) && self.regions_owned_by(NodeId(k)).is_empty());
        let id = unused.or_else(idle).ok_or_else(|| {
            Error::new(
                ErrorKind::ResourceExhausted,
                format!("the pool's node table is full ({MAX_NODES} nodes, each alive or owning regions)"),
            )
        })?;
        let slots = (1..=MAX_NODES).map(|s| TABLE_AT + (s as u64 - 1) * ENTRY);
        let mut at_slot = None;
        for at in slots {
            let mut b = [0u8; 4];
            self.meta.read(at, &mut b)?;
            let v = u32::from_le_bytes(b);
            if (unused.is_some() && v == 0) || (unused.is_none() && v == id) {
                at_slot = Some(at);
                break;
            }
        }
        self.check_epoch()?;
        let at = at_slot.expect("a free id means a free slot; a reused id has its slot");
        if unused.is_none() {
            tracing::warn!(id, name, "the node table is full: reusing the entry of a node that owns nothing");
            // Unused first, so no crash leaves a half-renamed entry in use.
            self.meta.write(at, &0u32.to_le_bytes())?;
            self.meta.flush(at, 4)?;
        }
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
