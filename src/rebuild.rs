//! Warm restart: what a node's regions hold, read back from the object
//! records in the pool. Committed records with a valid checksum and the
//! region's generation become registry entries again; records of objects
//! being written when the old process died are quarantined (a client may
//! still be copying into them under its old reservation); damaged or stale
//! records are turned into tombstones with a log line and a count.
use crate::error::Result;
use crate::pool::record::{overflow_len, set_generation, RecordState};
use crate::pool::{NodeId, Pool, RegionId};
use crate::registry::{pages_for, Location};

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

/// A committed object found in the pool.
#[derive(Debug, Clone)]
pub struct Found {
    pub seq: u64,
    pub key: Vec<u8>,
    pub tenant: String,
    pub loc: Location,
}

/// One owned region's contents after a restart.
#[derive(Debug, Default)]
pub struct RegionScan {
    /// (first page, pages) of every object kept: committed or quarantined.
    pub used: Vec<(u32, u32)>,
    pub committed: Vec<Found>,
    pub writing: Vec<Location>,
}

/// Read region `r`'s records. `before` is the region's generation in the
/// previous life, `generation` the renewed one that kept records are
/// restamped with (so they survive the next restart too).
pub fn scan_region(
    pool: &Pool,
    NodeId(node): NodeId,
    RegionId(r): RegionId,
    before: u64,
    generation: u64,
    report: &mut RebuildReport,
) -> Result<RegionScan> {
    let g = pool.geometry();
    let pages = g.pages_per_region();
    // The records were written by a process that is gone, maybe on another host.
    pool.refresh_records(r)?;
    let mut out = RegionScan::default();
    let mut page = 0u64;
    while page < pages {
        let mut slot = pool.read_slot(r, page)?;
        if slot[STATE] == 0 {
            page += 1; // free or tombstone: the common case, skipped without decoding
            continue;
        }
        let rec = match pool.decode_slot(r, page, &slot) {
            Ok(None) => {
                page += 1;
                continue;
            }
            Ok(Some(rec)) => rec,
            Err(e) => {
                tracing::warn!(region = r, page, error = %e, "discarding a damaged object record");
                report.damaged += 1;
                pool.retire_pages(r, page, 1)?;
                page += 1;
                continue;
            }
        };
        let span = pages_for(rec.length + overflow_len(&rec.tenant, &rec.key), g.page_size);
        if rec.generation != before || page + span > pages {
            tracing::warn!(region = r, page, generation = rec.generation, "discarding a stale object record");
            report.stale += 1;
            pool.retire_pages(r, page, 1)?;
            page += 1;
            continue;
        }
        let loc = Location {
            node,
            region: r,
            offset: page * g.page_size,
            length: rec.length,
            generation,
            version: u32::from_le_bytes(slot[..4].try_into().expect("4 bytes")),
        };
        set_generation(&mut slot, generation);
        pool.write_slot(r, page, &slot)?;
        out.used.push((page as u32, span as u32));
        match rec.state {
            RecordState::Committed => {
                report.restored += 1;
                out.committed.push(Found { seq: rec.seq, key: rec.key, tenant: rec.tenant, loc });
            }
            RecordState::Writing => {
                report.quarantined += 1;
                out.writing.push(loc);
            }
        }
        page += span;
    }
    Ok(out)
}

/// Another node's region, read by the cluster's primary when it starts:
/// the committed records of the region's current generation (the owner
/// keeps its generation across a primary restart). Nothing is written: the
/// owner alone writes its page table.
pub fn scan_foreign(
    pool: &Pool,
    NodeId(owner): NodeId,
    RegionId(r): RegionId,
    report: &mut RebuildReport,
) -> Result<Vec<Found>> {
    let g = pool.geometry();
    let pages = g.pages_per_region();
    let generation = pool.region_state(RegionId(r))?.generation;
    let mut out = vec![];
    let mut page = 0u64;
    while page < pages {
        let slot = pool.read_slot(r, page)?;
        if slot[STATE] == 0 {
            page += 1;
            continue;
        }
        let rec = match pool.decode_slot(r, page, &slot) {
            Ok(Some(rec)) => rec,
            _ => {
                page += 1;
                continue;
            }
        };
        let span = pages_for(rec.length + overflow_len(&rec.tenant, &rec.key), g.page_size);
        if rec.generation != generation || page + span > pages || rec.state != RecordState::Committed {
            page += 1;
            continue;
        }
        let version = u32::from_le_bytes(slot[..4].try_into().expect("4 bytes"));
        let loc =
            Location { node: owner, region: r, offset: page * g.page_size, length: rec.length, generation, version };
        report.restored += 1;
        out.push(Found { seq: rec.seq, key: rec.key, tenant: rec.tenant, loc });
        page += span;
    }
    Ok(out)
}

/// A follower's own region when it (re)joins: the primary says which
/// objects are live (`live`: first pages). Live committed records keep
/// their pages; other committed records are turned into tombstones (their
/// keys left the registry while this node could not hear of it); records
/// being written are quarantined as after a restart.
pub fn reconcile_region(
    pool: &Pool,
    NodeId(node): NodeId,
    RegionId(r): RegionId,
    generation: u64,
    live: &std::collections::HashSet<u64>,
    report: &mut RebuildReport,
) -> Result<RegionScan> {
    let g = pool.geometry();
    let pages = g.pages_per_region();
    let mut out = RegionScan::default();
    let mut page = 0u64;
    while page < pages {
        let slot = pool.read_slot(r, page)?;
        if slot[STATE] == 0 {
            page += 1;
            continue;
        }
        let rec = match pool.decode_slot(r, page, &slot) {
            Ok(Some(rec)) => rec,
            Ok(None) => {
                page += 1;
                continue;
            }
            Err(_) => {
                report.damaged += 1;
                pool.retire_pages(r, page, 1)?;
                page += 1;
                continue;
            }
        };
        let span = pages_for(rec.length + overflow_len(&rec.tenant, &rec.key), g.page_size);
        let keep = rec.generation == generation
            && page + span <= pages
            && (rec.state == RecordState::Writing || live.contains(&page));
        if !keep {
            report.stale += 1;
            pool.retire_pages(r, page, 1)?;
            page += 1;
            continue;
        }
        out.used.push((page as u32, span as u32));
        if rec.state == RecordState::Writing {
            report.quarantined += 1;
            let version = u32::from_le_bytes(slot[..4].try_into().expect("4 bytes"));
            out.writing.push(Location {
                node,
                region: r,
                offset: page * g.page_size,
                length: rec.length,
                generation,
                version,
            });
        } else {
            report.restored += 1;
        }
        page += span;
    }
    Ok(out)
}
