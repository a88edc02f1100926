//! Warm restart: what a node's regions hold, read back from the object
//! records in the pool. Committed records with a valid checksum and the
//! region's generation become registry entries again; records of objects
//! being written when the old process died are quarantined (a client may
//! still be copying into them under its old reservation); damaged or stale
//! records are turned into tombstones with a log line and a count.
use std::sync::Arc;

use crate::error::Result;
use crate::pool::record::{overflow_len, RecordRef, RecordState, Restamp, SLOT};
use crate::pool::{NodeId, Pool, RegionId, Renewal};
pub use crate::registry::Found;
use crate::registry::{pages_for, KeyBuf, Location};

/// Offset of the state byte in a slot (see `pool/record.rs`).
const STATE: usize = 12;

/// Counts of one rebuild, for logs and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RebuildReport {
    pub restored: u64,
    pub quarantined: u64,
    /// Records whose checksum, state or name did not hold up.
    pub damaged: u64,
    /// Records of another generation of the region (reclaimed or reused).
    pub stale: u64,
}

/// One owned region's contents after a restart.
#[derive(Debug, Default)]
pub struct RegionScan {
    /// (first page, pages) of every object kept: committed or quarantined.
    pub used: Vec<(u32, u32)>,
    pub writing: Vec<Location>,
}

/// Visit every slot of region `r` that holds a record; free slots and
/// tombstones are skipped without decoding (the common case). `visit` gets
/// the page, the raw slot (its version word included) and the decoded
/// record or why it could not be decoded, and answers how many pages the
/// walk moves on: the object's span when it is kept, 1 otherwise. One walk
/// serves a restart, the primary's read of other nodes' regions and a
/// rejoin; only what each keeps differs.
fn walk(
    pool: &Pool,
    r: RegionId,
    mut visit: impl FnMut(u64, &[u8; SLOT], Result<RecordRef<'_>>) -> Result<u64>,
) -> Result<()> {
    let pages = pool.geometry().pages_per_region();
    let mut page = 0u64;
    while page < pages {
        let slot = pool.read_slot(r, page)?;
        if slot[STATE] == 0 {
            page += 1;
            continue;
        }
        let visited = pool.decode_slot_with(r, page, &slot, |rec| visit(page, &slot, Ok(rec)));
        page += match visited {
            Ok(None) => 1,
            Ok(Some(step)) => step?,
            Err(e) => visit(page, &slot, Err(e))?,
        };
    }
    Ok(())
}

/// A region's tenant names, each allocated once: its objects mostly share
/// one, and a rebuild finds a million of them.
#[derive(Default)]
struct Tenants {
    last: Option<Arc<str>>,
    seen: std::collections::HashSet<Arc<str>>,
}

impl Tenants {
    fn get(&mut self, name: &str) -> Arc<str> {
        if let Some(t) = self.last.as_ref().filter(|t| &***t == name) {
            return t.clone();
        }
        let t = self.seen.get(name).cloned().unwrap_or_else(|| name.into());
        self.seen.insert(t.clone());
        self.last = Some(t.clone());
        t
    }
}

/// Pages the object at `page` spans (its long name included), or `None`
/// when it would run past the region's end (a damaged length).
fn span_in_region(pool: &Pool, page: u64, rec: &RecordRef<'_>) -> Option<u64> {
    let g = pool.geometry();
    let span = pages_for(rec.length + overflow_len(rec.tenant, rec.key), g.page_size);
    (page + span <= g.pages_per_region()).then_some(span)
}

/// Where the object at `page` of `r` is, as the registry records it.
fn location(
    pool: &Pool,
    node: NodeId,
    r: RegionId,
    page: u64,
    length: u64,
    generation: u64,
    slot: &[u8; SLOT],
) -> Location {
    let version = u32::from_le_bytes(slot[..4].try_into().expect("4 bytes"));
    Location { node, region: r, offset: page * pool.geometry().page_size, length, generation, version }
}

/// Read region `r`'s records; its committed objects are added to `found`
/// (one list for every region: a million objects are not copied from one
/// list to another). Records of the generations `renewal` keeps (the life
/// before, and those of a renewal a crash interrupted) are restamped with
/// its new one (so they survive the next restart too).
pub fn scan_region(
    pool: &Pool,
    (node, r): (NodeId, RegionId),
    renewal: Renewal,
    found: &mut Vec<Found>,
    report: &mut RebuildReport,
) -> Result<RegionScan> {
    let generation = renewal.generation;
    // The records were written by a process that is gone, maybe on another host.
    pool.refresh_records(r)?;
    let mut out = RegionScan::default();
    let restamp = Restamp::new(generation.wrapping_sub(1), generation);
    let mut tenants = Tenants::default();
    walk(pool, r, |page, slot, rec| {
        let rec = match rec {
            Ok(rec) => rec,
            Err(e) => {
                tracing::warn!(region = r.0, page, error = %e, "discarding a damaged object record");
                report.damaged += 1;
                pool.retire_pages(r, page, 1)?;
                return Ok(1);
            }
        };
        let span = match span_in_region(pool, page, &rec) {
            Some(span) if renewal.keeps(rec.generation) => span,
            _ => {
                tracing::warn!(region = r.0, page, generation = rec.generation, "discarding a stale object record");
                report.stale += 1;
                pool.retire_pages(r, page, 1)?;
                return Ok(1);
            }
        };
        let loc = location(pool, node, r, page, rec.length, generation, slot);
        let mut slot = *slot;
        restamp.apply(&mut slot);
        pool.restamp_slot(r, page, &slot)?;
        out.used.push((page as u32, span as u32));
        match rec.state {
            RecordState::Committed => {
                report.restored += 1;
                found.push(Found { seq: rec.seq, key: KeyBuf::new(rec.key), tenant: tenants.get(rec.tenant), loc });
            }
            RecordState::Writing => {
                report.quarantined += 1;
                out.writing.push(loc);
            }
        }
        Ok(span)
    })?;
    Ok(out)
}

/// Another node's region, read by the cluster's primary when it starts:
/// the committed records of the region's current generation (the owner
/// keeps its generation across a primary restart), added to `found`.
/// Nothing is written: the owner alone writes its page table. True when
/// some object was being written (its writer may still be copying).
pub fn scan_foreign(
    pool: &Pool,
    (owner, r): (NodeId, RegionId),
    found: &mut Vec<Found>,
    report: &mut RebuildReport,
) -> Result<bool> {
    pool.refresh_records(r)?;
    // Its owner's current generation, and those of a renewal of its that
    // a crash interrupted.
    let last = pool.last_renewal(r)?;
    let generation = last.generation;
    let mut writing = false;
    let mut tenants = Tenants::default();
    walk(pool, r, |page, slot, rec| {
        let Ok(rec) = rec else { return Ok(1) };
        let span = match span_in_region(pool, page, &rec) {
            Some(span) if last.owns(rec.generation) => span,
            _ => return Ok(1),
        };
        if rec.state != RecordState::Committed {
            writing = true;
            return Ok(span);
        }
        let loc = location(pool, owner, r, page, rec.length, generation, slot);
        report.restored += 1;
        found.push(Found { seq: rec.seq, key: KeyBuf::new(rec.key), tenant: tenants.get(rec.tenant), loc });
        Ok(span)
    })?;
    Ok(writing)
}

/// A follower's own region when it (re)joins: the primary says which
/// objects are live (`live`: first pages). Live committed records keep
/// their pages; other committed records are turned into tombstones (their
/// keys left the registry while this node could not hear of it); records
/// being written are quarantined as after a restart. Records of a renewal
/// this node's crash interrupted (it died renewing its regions as the
/// primary, at a restart or a promotion, and another node's primary read
/// them) are its own too, kept on the same terms.
///
/// A live record's slot is never written here: the primary may erase it
/// (a delete) at any moment, and a restamp written back from a copy read
/// before, or a cache line's stale copy under software coherence, would
/// undo the erase and bring the deleted object back. So the records of an
/// interrupted renewal keep their generation, and the region its mark,
/// until the node's next renewal (a restart or a promotion) restamps them.
pub fn reconcile_region(
    pool: &Pool,
    node: NodeId,
    r: RegionId,
    generation: u64,
    live: &std::collections::HashSet<u64>,
    report: &mut RebuildReport,
) -> Result<RegionScan> {
    // Only while the region is still at the generation the primary names:
    // a mark is about the generations before the current one.
    let last =
        Some(pool.last_renewal(r)?).filter(|l| l.generation == generation).unwrap_or(Renewal::settled(generation));
    // Written by the node's previous life, maybe erased by a primary since.
    pool.refresh_records(r)?;
    let mut out = RegionScan::default();
    walk(pool, r, |page, slot, rec| {
        let Ok(rec) = rec else {
            report.damaged += 1;
            pool.retire_pages(r, page, 1)?;
            return Ok(1);
        };
        let writing = rec.state == RecordState::Writing;
        let ours = last.owns(rec.generation);
        let span = match span_in_region(pool, page, &rec) {
            Some(span) if ours && (writing || live.contains(&page)) => span,
            _ => {
                report.stale += 1;
                pool.retire_pages(r, page, 1)?;
                return Ok(1);
            }
        };
        out.used.push((page as u32, span as u32));
        if writing {
            report.quarantined += 1;
            out.writing.push(location(pool, node, r, page, rec.length, generation, slot));
        } else {
            report.restored += 1;
        }
        Ok(span)
    })?;
    Ok(out)
}
