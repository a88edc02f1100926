//! Object records: the page table's slots, one per page of every region,
//! each written by the region's owner alone (docs/ARCHITECTURE.md, "Object
//! records"). Record writes come in batches so that a store of many small
//! objects pays one fence, not one per record: each write is written back as
//! it is made, and the batch fences them all before the node goes on (the
//! key's publication, a page's reuse).
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU32, Ordering};

use super::{layout, record, Pool, RegionId};
use crate::error::{Error, ErrorKind, Result};

impl Pool {
    fn slot_word(&self, r: u32, page: u64, word: u64) -> Result<&AtomicU32> {
        let g = self.geometry();
        if r >= self.sb.region_count || page >= g.pages_per_region() {
            return Err(Error::invalid(format!("no page {page} in region {r}")));
        }
        self.meta.atomic_u32(g.page_slot_offset(r, page) + word * 4)
    }

    /// Version of the object that starts at `page` of region `r`. It changes
    /// whenever the page is freed, so a reader that sees the same version
    /// after its copy as in its location copied that object and no other.
    pub fn page_version(&self, RegionId(r): RegionId, page: u64) -> Result<u32> {
        Ok(self.slot_word(r, page, 0)?.load(Ordering::Acquire))
    }

    /// Write slots `first..first + n` back, unfenced (a `RecordBatch`
    /// fences them).
    fn write_back_slots(&self, r: u32, first: u64, n: u64) -> Result<()> {
        let at = self.geometry().page_slot_offset(r, first);
        self.meta.write_back(at, (n * layout::PAGE_SLOT_BYTES) as usize)
    }

    /// A batch of record writes: see [`RecordBatch`].
    pub fn record_batch(&self) -> RecordBatch<'_> {
        RecordBatch { pool: self, _thread: PhantomData }
    }

    /// Retire pages, fenced at once (one object; see [`RecordBatch::retire`]).
    pub fn retire_pages(&self, r: RegionId, first: u64, n: u64) -> Result<()> {
        self.record_batch().retire(r, first, n)
    }

    /// Drop cached copies of the slots of region `r`: its records were
    /// written by another process that may have run on another host (the
    /// node's previous life, or another node whose regions this one takes).
    pub fn refresh_records(&self, RegionId(r): RegionId) -> Result<()> {
        self.slot_word(r, 0, 0)?; // bounds
        let at = self.geometry().page_slot_offset(r, 0);
        self.meta.invalidate(at, (self.geometry().pages_per_region() * layout::PAGE_SLOT_BYTES) as usize)
    }

    /// Drop the cached copy of one slot of a region another node owns, so
    /// its version and checksum words are read as its owner last flushed them.
    pub fn refresh_slot(&self, RegionId(r): RegionId, page: u64) -> Result<()> {
        self.slot_word(r, page, 0)?; // bounds
        self.meta.invalidate(self.geometry().page_slot_offset(r, page), layout::PAGE_SLOT_BYTES as usize)
    }

    /// The raw slot of `page` in region `r` (its version word included).
    pub fn read_slot(&self, RegionId(r): RegionId, page: u64) -> Result<[u8; record::SLOT]> {
        self.slot_word(r, page, 0)?; // bounds
        let mut b = [0u8; record::SLOT];
        self.meta.read(self.geometry().page_slot_offset(r, page), &mut b)?;
        Ok(b)
    }

    /// Write a restamped copy of a slot back (`record::Restamp`,
    /// `record::set_generation`): its generation and checksum words, nothing
    /// else. The copy was read before, and the state byte is the one another
    /// node writes (a primary's erase of a deleted object's record): written
    /// back from the copy it would bring the deleted object back at the
    /// next rebuild. An erased record stays free whatever its checksum (the
    /// state is read first). Under software coherence the slot's cache
    /// lines go back whole, so no write of this node's can be safe against
    /// an erase made after its copy of the lines: a restamp runs only where
    /// no other node erases (a renewal, while this node is the primary), and
    /// a follower's rejoin writes no live record at all.
    pub fn restamp_slot(&self, RegionId(r): RegionId, page: u64, b: &[u8; record::SLOT]) -> Result<()> {
        self.slot_word(r, page, 0)?; // bounds
        let at = self.geometry().page_slot_offset(r, page);
        for field in [record::GENERATION, record::CHECKSUM] {
            self.meta.write(at + field.start as u64, &b[field])?;
        }
        self.meta.flush(at, layout::PAGE_SLOT_BYTES as usize)
    }

    /// The record at `page` of region `r`: `Ok(None)` for a free slot.
    pub fn read_record(&self, RegionId(r): RegionId, page: u64) -> Result<Option<record::ObjectRecord>> {
        self.decode_slot(RegionId(r), page, &self.read_slot(RegionId(r), page)?)
    }

    /// Decode a slot read with `read_slot` (reading a long name from the
    /// object's pages).
    pub fn decode_slot(
        &self,
        RegionId(r): RegionId,
        page: u64,
        b: &[u8; record::SLOT],
    ) -> Result<Option<record::ObjectRecord>> {
        self.decode_slot_with(RegionId(r), page, b, |rec| rec.to_owned())
    }

    /// `decode_slot`, the record handed to `f` borrowed.
    pub fn decode_slot_with<T>(
        &self,
        RegionId(r): RegionId,
        page: u64,
        b: &[u8; record::SLOT],
        f: impl FnOnce(record::RecordRef<'_>) -> T,
    ) -> Result<Option<T>> {
        record::ObjectRecord::decode_ref(
            b,
            |len, n| {
                let off = page * self.sb.page_size + len;
                let mut name = vec![0u8; n];
                let m = self.map_region(RegionId(r), false)?;
                m.invalidate(off, n)?; // written (and flushed) with the record, maybe elsewhere
                m.read(off, &mut name)?;
                Ok(name)
            },
            f,
        )
    }

    /// Erase the committed record of the object at `page` of region `r`
    /// (any node's): its state byte becomes a tombstone, written back and
    /// fenced, if the slot still holds that object (`version`, `generation`,
    /// committed). A cluster's primary does this for a delete under the
    /// registry's lock, so the delete outlives a crash of the primary before
    /// the owner hears of it; the owner frees the pages later as for any
    /// removal (it alone bumps the version). Only the state byte is written:
    /// nothing else of the slot changes, so no write of the owner's is lost.
    /// False when the slot holds something else (nothing written). A record
    /// its owner had not restamped yet when a crash interrupted its renewal
    /// (the generations the region's mark keeps) is the same object.
    pub fn erase_record(&self, RegionId(r): RegionId, page: u64, version: u32, generation: u64) -> Result<bool> {
        let at = self.geometry().page_slot_offset(r, page);
        self.slot_word(r, page, 0)?; // bounds
        self.meta.invalidate(at, layout::PAGE_SLOT_BYTES as usize)?;
        let b = self.read_slot(RegionId(r), page)?;
        let same = u32::from_le_bytes(b[..4].try_into().expect("4 bytes")) == version
            && b[12] == record::RecordState::Committed as u8;
        let of = u64::from_le_bytes(b[record::GENERATION].try_into().expect("8 bytes"));
        if !same || (of != generation && !self.kept_by_renewal(RegionId(r), generation, of)?) {
            return Ok(false);
        }
        self.meta.write(at + 12, &[0])?;
        self.meta.flush(at, layout::PAGE_SLOT_BYTES as usize)?;
        Ok(true)
    }

    pub fn page_crc(&self, RegionId(r): RegionId, page: u64) -> Result<Option<u32>> {
        let has = self.slot_word(r, page, 1)?.load(Ordering::Acquire) & layout::SLOT_HAS_CRC != 0;
        Ok(if has { Some(self.slot_word(r, page, 2)?.load(Ordering::Relaxed)) } else { None })
    }
}

/// Record writes whose write-backs one fence, when the batch is dropped,
/// orders before every later store of this thread: the registry's
/// publication of the committed keys, the answer to a Reserve, or the reuse
/// of retired pages. A fence orders only its own thread's write-backs, so a
/// batch cannot leave its thread (it is neither `Send` nor `Sync`; an async
/// caller cannot hold one across an `.await`).
pub struct RecordBatch<'a> {
    pool: &'a Pool,
    _thread: PhantomData<*const ()>,
}

impl RecordBatch<'_> {
    /// Write the record of the object at `page` (all but its version word);
    /// a name too long for the slot goes after the payload, written back too.
    pub fn write<'r>(&self, RegionId(r): RegionId, page: u64, rec: impl Into<record::RecordRef<'r>>) -> Result<()> {
        let p = self.pool;
        let rec = rec.into();
        let (b, overflow) = rec.encode();
        if let Some(name) = overflow {
            let off = page * p.sb.page_size + rec.length;
            let m = p.map_region(RegionId(r), true)?;
            m.write(off, &name)?;
            m.write_back(off, name.len())?;
        }
        let at = p.geometry().page_slot_offset(r, page);
        p.slot_word(r, page, 0)?; // bounds
        p.meta.write(at + 4, &b[4..])?;
        p.write_back_slots(r, page, 1)
    }

    /// Mark the record at `page` committed: its commit sequence and payload
    /// checksum. Only a record being written can be committed. The caller
    /// publishes the key only after the batch is dropped.
    pub fn commit(&self, RegionId(r): RegionId, page: u64, seq: u64, payload_crc: Option<u32>) -> Result<()> {
        let p = self.pool;
        let at = p.geometry().page_slot_offset(r, page);
        p.slot_word(r, page, 0)?; // bounds
        let mut b = [0u8; record::SLOT];
        p.meta.read(at, &mut b)?;
        if b[12] != record::RecordState::Writing as u8 {
            return Err(Error::new(ErrorKind::Internal, format!("no record being written at region {r} page {page}")));
        }
        record::commit_in_place(&mut b, seq, payload_crc);
        p.meta.write(at + 4, &b[4..])?;
        p.write_back_slots(r, page, 1)
    }

    /// Pages `first..first + n` of region `r` were freed: their records
    /// become tombstones (so a rebuild never brings the object back) and their
    /// versions change (so readers of the object notice), both before the
    /// pages can be handed out again (the batch's fence comes first). Called
    /// by the region's owner.
    pub fn retire(&self, RegionId(r): RegionId, first: u64, n: u64) -> Result<()> {
        let p = self.pool;
        let g = p.geometry();
        for page in first..first + n {
            p.slot_word(r, page, 1)?.store(0, Ordering::Relaxed);
            p.meta.write(g.page_slot_offset(r, page) + 12, &[0])?;
            // The owner is the version's only writer, one thread at a time
            // (under the regions' lock, or at start-up before serving), so a
            // plain load and store bump it: a locked add would wait for
            // every write-back before it, a fence per page.
            let version = p.slot_word(r, page, 0)?;
            version.store(version.load(Ordering::Relaxed).wrapping_add(1), Ordering::Release);
        }
        p.write_back_slots(r, first, n)
    }
}

impl Drop for RecordBatch<'_> {
    fn drop(&mut self) {
        self.pool.meta.fence();
    }
}
