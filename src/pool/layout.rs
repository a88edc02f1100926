//! On-pool metadata: a versioned, checksummed superblock at offset 0 and a
//! region table after it. Everything is little-endian offsets and counts, never
//! pointers, so any process on any node can read it.
use crate::error::{Error, Result};

pub const MAGIC: [u8; 8] = *b"CXLKVPL\0";
/// 2: a page table (one slot per page of every region) follows the region table.
/// 3: each slot of an object's first page is its record (see `record.rs`).
pub const LAYOUT_VERSION: u32 = 3;
pub const SUPERBLOCK_BYTES: u64 = 4096;
/// A region's entry: owner word (below), generation, when it was claimed
/// (Unix ms), and an interrupted renewal's mark (`renewal.rs`).
pub const REGION_ENTRY_BYTES: u64 = 32;
/// One page-table slot: `[version u32][flags u32][payload crc32 u32]` and the
/// rest of the object record (`record.rs`). Only the slot of an object's first
/// page is meaningful; its owner node is the only writer.
pub const PAGE_SLOT_BYTES: u64 = super::record::SLOT as u64;
/// Page-slot flag: the crc32 word holds the committed payload's checksum.
pub const SLOT_HAS_CRC: u32 = 1;
/// Encoded superblock fields; the crc32 of these bytes follows them.
const SB_FIELDS: usize = 124;

/// Region-table owner word: 0 = free, else `STATE_OWNED << 32 | node_id`.
pub const STATE_OWNED: u64 = 1;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub layout_version: u32,
    pub page_table_offset: u64,
    pub pool_uuid: [u8; 16],
    pub pool_size: u64,
    pub region_size: u64,
    pub region_count: u32,
    pub data_offset: u64,
    pub page_size: u64,
    pub created_unix_s: u64,
}

/// Where regions go inside a pool of `pool_size` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub pool_size: u64,
    pub region_size: u64,
    pub region_count: u32,
    pub data_offset: u64,
    pub page_size: u64,
    /// Start of the page table (after the region table, 4 KiB aligned).
    pub page_table_offset: u64,
}

pub fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

impl Geometry {
    fn page_table_offset(count: u64) -> u64 {
        align_up(SUPERBLOCK_BYTES + count * REGION_ENTRY_BYTES, 4096)
    }
    fn meta_bytes(count: u64, region_size: u64, page_size: u64, align: u64) -> u64 {
        let slots = count * (region_size / page_size);
        align_up(Self::page_table_offset(count) + slots * PAGE_SLOT_BYTES, align)
    }
    fn with(pool_size: u64, region_size: u64, count: u64, page_size: u64, align: u64) -> Self {
        Self {
            pool_size,
            region_size,
            region_count: count as u32,
            data_offset: Self::meta_bytes(count, region_size, page_size, align),
            page_size,
            page_table_offset: Self::page_table_offset(count),
        }
    }
    /// The geometry that fits in a device of `size` bytes.
    pub fn for_device(size: u64, region_size: u64, page_size: u64, align: u64) -> Result<Self> {
        check_sizes(region_size, page_size, align)?;
        let mut count = size / region_size;
        while count > 0 && Self::meta_bytes(count, region_size, page_size, align) + count * region_size > size {
            count -= 1;
        }
        if count == 0 || count > u32::MAX as u64 {
            return Err(Error::invalid(format!(
                "pool of {size} bytes cannot hold a region of {region_size} bytes plus metadata"
            )));
        }
        Ok(Self::with(size, region_size, count, page_size, align))
    }
    /// The file size needed for `capacity` bytes of regions (shm backend).
    pub fn for_capacity(capacity: u64, region_size: u64, page_size: u64, align: u64) -> Result<Self> {
        check_sizes(region_size, page_size, align)?;
        let count = capacity / region_size;
        if count == 0 || count > u32::MAX as u64 {
            return Err(Error::invalid(format!(
                "pool size {capacity} must be at least one region ({region_size} bytes)"
            )));
        }
        let mut g = Self::with(0, region_size, count, page_size, align);
        g.pool_size = g.data_offset + count * region_size;
        Ok(g)
    }
    pub fn region_offset(&self, r: u32) -> u64 {
        self.data_offset + r as u64 * self.region_size
    }
    pub fn pages_per_region(&self) -> u64 {
        self.region_size / self.page_size
    }
    /// Pool offset of the page-table slot of `page` in region `r`.
    pub fn page_slot_offset(&self, r: u32, page: u64) -> u64 {
        self.page_table_offset + (r as u64 * self.pages_per_region() + page) * PAGE_SLOT_BYTES
    }
}

fn check_sizes(region_size: u64, page_size: u64, align: u64) -> Result<()> {
    if region_size == 0 || !region_size.is_multiple_of(align) {
        return Err(Error::invalid(format!("region size {region_size} must be a positive multiple of {align}")));
    }
    if page_size < 4096 || !page_size.is_power_of_two() || !region_size.is_multiple_of(page_size) {
        return Err(Error::invalid(format!(
            "page size {page_size} must be a power of two >= 4096 that divides the region size {region_size}"
        )));
    }
    Ok(())
}

impl Superblock {
    pub fn geometry(&self) -> Geometry {
        Geometry {
            pool_size: self.pool_size,
            region_size: self.region_size,
            region_count: self.region_count,
            data_offset: self.data_offset,
            page_size: self.page_size,
            page_table_offset: self.page_table_offset,
        }
    }

    pub fn uuid_string(&self) -> String {
        uuid::Uuid::from_bytes(self.pool_uuid).hyphenated().to_string()
    }

    pub fn encode(&self) -> [u8; 128] {
        let mut b = [0u8; 128];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&self.layout_version.to_le_bytes());
        b[12..16].copy_from_slice(&(SUPERBLOCK_BYTES as u32).to_le_bytes());
        b[16..32].copy_from_slice(&self.pool_uuid);
        b[32..40].copy_from_slice(&self.pool_size.to_le_bytes());
        b[40..48].copy_from_slice(&self.region_size.to_le_bytes());
        b[48..52].copy_from_slice(&self.region_count.to_le_bytes());
        b[56..64].copy_from_slice(&self.data_offset.to_le_bytes());
        b[64..72].copy_from_slice(&self.page_size.to_le_bytes());
        b[72..80].copy_from_slice(&SUPERBLOCK_BYTES.to_le_bytes());
        b[80..88].copy_from_slice(&self.created_unix_s.to_le_bytes());
        b[88..96].copy_from_slice(&self.page_table_offset.to_le_bytes());
        let crc = crc32fast::hash(&b[..SB_FIELDS]);
        b[SB_FIELDS..128].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// `Ok(None)` for an all-zero (never formatted) header.
    pub fn decode(b: &[u8; 128]) -> Result<Option<Self>> {
        if b.iter().all(|&x| x == 0) {
            return Ok(None);
        }
        if b[0..8] != MAGIC {
            return Err(Error::corrupt("not a cxlkv pool (bad magic)"));
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let version = u32_at(8);
        if version != LAYOUT_VERSION {
            let why = if version < LAYOUT_VERSION {
                "an older layout without object records (and, before version 2, without per-page versions); \
                 its objects cannot be recovered or checked by readers, so it must be reformatted with --format \
                 (the cache starts empty)"
            } else {
                "written by a newer cxlkv"
            };
            return Err(Error::corrupt(format!(
                "pool layout version {version} is not supported (this build reads version {LAYOUT_VERSION}): {why}"
            )));
        }
        let crc = u32_at(SB_FIELDS);
        if crc != crc32fast::hash(&b[..SB_FIELDS]) {
            return Err(Error::corrupt("pool superblock checksum mismatch"));
        }
        let sb = Self {
            layout_version: version,
            pool_uuid: b[16..32].try_into().unwrap(),
            pool_size: u64_at(32),
            region_size: u64_at(40),
            region_count: u32_at(48),
            data_offset: u64_at(56),
            page_size: u64_at(64),
            created_unix_s: u64_at(80),
            page_table_offset: u64_at(88),
        };
        // The fields are untrusted: checked arithmetic, so an overflowing
        // sum or product is a bad header, not a panic (or a wrapped bound).
        let fits = |sb: &Self| {
            let n = sb.region_count as u64;
            let regions_end = n.checked_mul(sb.region_size)?.checked_add(sb.data_offset)?;
            let slots = n.checked_mul(sb.region_size / sb.page_size)?;
            let table_end = slots.checked_mul(PAGE_SLOT_BYTES)?.checked_add(sb.page_table_offset)?;
            Some(regions_end <= sb.pool_size && table_end <= sb.data_offset)
        };
        if check_sizes(sb.region_size, sb.page_size, 4096).is_err() || fits(&sb) != Some(true) {
            return Err(Error::corrupt("pool superblock geometry is inconsistent"));
        }
        Ok(Some(sb))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sb() -> Superblock {
        let g = Geometry::for_capacity(1 << 30, 256 << 20, 64 << 10, 2 << 20).unwrap();
        Superblock {
            layout_version: LAYOUT_VERSION,
            page_table_offset: g.page_table_offset,
            pool_uuid: [7; 16],
            pool_size: g.pool_size,
            region_size: g.region_size,
            region_count: g.region_count,
            data_offset: g.data_offset,
            page_size: 64 << 10,
            created_unix_s: 1,
        }
    }

    #[test]
    fn roundtrip_and_every_flipped_byte_is_caught() {
        let s = sb();
        let enc = s.encode();
        assert_eq!(Superblock::decode(&enc).unwrap(), Some(s));
        for i in 0..128 {
            let mut bad = enc;
            bad[i] ^= 0x40;
            assert!(Superblock::decode(&bad).is_err(), "flip at byte {i} not detected");
        }
    }

    #[test]
    fn overflowing_geometry_is_refused_not_a_panic() {
        // Found by the `superblock` and `pool` fuzz targets: sums and products
        // of header fields overflowed u64 (a panic with overflow checks).
        let huge_regions = Superblock { region_size: 1 << 63, ..sb() };
        let huge_offsets = Superblock { data_offset: u64::MAX - 4095, page_table_offset: u64::MAX, ..sb() };
        let many_pages = Superblock { region_count: u32::MAX, region_size: 1 << 52, page_size: 4096, ..sb() };
        for bad in [huge_regions, huge_offsets, many_pages] {
            let e = Superblock::decode(&bad.encode()).unwrap_err();
            assert_eq!(e.kind(), crate::error::ErrorKind::Corrupt, "{bad:?}");
        }
    }

    #[test]
    fn geometry_fits() {
        let g = Geometry::for_capacity(1 << 30, 256 << 20, 64 << 10, 2 << 20).unwrap();
        assert_eq!(g.region_count, 4);
        // 2 MiB of records (4 x 4096 pages x 128 B) after the region table.
        assert_eq!(g.data_offset, 4 << 20);
        assert_eq!(g.page_table_offset, 8192, "after the superblock and the region table");
        // The page table ends before the first region.
        assert!(g.page_slot_offset(g.region_count, 0) <= g.data_offset);
        let d = Geometry::for_device(1 << 30, 256 << 20, 64 << 10, 2 << 20).unwrap();
        assert_eq!(d.region_count, 3);
        assert!(d.region_offset(d.region_count) <= 1 << 30);
        // 4 KiB pages need a larger table: 4 regions x 65536 slots x 128 B = 32 MiB.
        let small = Geometry::for_capacity(1 << 30, 256 << 20, 4 << 10, 2 << 20).unwrap();
        assert_eq!(small.data_offset, 34 << 20);
        // The tests' small pools keep one 2 MiB unit of metadata.
        assert_eq!(Geometry::for_capacity(8 << 20, 2 << 20, 64 << 10, 2 << 20).unwrap().data_offset, 2 << 20);
        assert!(Geometry::for_capacity(1 << 20, 256 << 20, 64 << 10, 2 << 20).is_err());
        assert!(Geometry::for_capacity(1 << 30, 3 << 19, 64 << 10, 2 << 20).is_err());
        assert!(Geometry::for_capacity(1 << 30, 256 << 20, 0, 2 << 20).is_err(), "page size 0");
        assert!(Geometry::for_capacity(1 << 30, 256 << 20, 3 << 12, 2 << 20).is_err(), "not a power of two");
    }
}
