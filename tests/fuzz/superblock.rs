//! Target `superblock`: `Superblock::decode` on arbitrary 128-byte headers.
//!
//! Input: `[flags][up to 128 header bytes]`. Flags bit 0 puts the right magic
//! in, bit 1 the supported layout version, bit 2 a matching crc32, so inputs
//! get past those checks and reach the geometry validation. Checks: decode
//! never panics; an all-zero header is "unformatted"; every other refusal is
//! `Corrupt`; an accepted superblock satisfies what the pool relies on (sizes
//! valid, region table, page table and regions inside the pool, no overflow)
//! and survives encode → decode unchanged.
use cxlkv::error::ErrorKind;
use cxlkv::pool::layout::{LAYOUT_VERSION, MAGIC, PAGE_SLOT_BYTES};
use cxlkv::pool::{Geometry, Superblock};

use crate::driver::{norm, Target};

/// Bytes covered by the superblock's crc32 (the crc follows them).
const CRC_AT: usize = 124;

pub struct SuperblockTarget;

fn seed(g: Geometry, flags: u8) -> Vec<u8> {
    let sb = Superblock {
        layout_version: LAYOUT_VERSION,
        page_table_offset: g.page_table_offset,
        pool_uuid: [0x5a; 16],
        pool_size: g.pool_size,
        region_size: g.region_size,
        region_count: g.region_count,
        data_offset: g.data_offset,
        page_size: g.page_size,
        created_unix_s: 1_700_000_000,
    };
    let mut v = vec![flags];
    v.extend_from_slice(&sb.encode());
    v
}

impl Target for SuperblockTarget {
    fn name(&self) -> &'static str {
        "superblock"
    }
    fn max_len(&self) -> usize {
        129
    }
    fn seeds(&self) -> Vec<Vec<u8>> {
        let geos = [
            Geometry::for_capacity(1 << 30, 256 << 20, 64 << 10, 2 << 20).unwrap(),
            Geometry::for_capacity(8 << 20, 2 << 20, 4 << 10, 2 << 20).unwrap(),
            Geometry::for_device(1 << 30, 256 << 20, 64 << 10, 2 << 20).unwrap(),
            Geometry::for_device(1 << 40, 1 << 30, 2 << 20, 2 << 20).unwrap(),
        ];
        let mut seeds = vec![vec![0u8; 129], vec![7u8], vec![0xff; 129]];
        for g in geos {
            seeds.push(seed(g, 0));
            seeds.push(seed(g, 7));
        }
        seeds
    }

    fn run(&mut self, data: &[u8]) -> String {
        let flags = data.first().copied().unwrap_or(0);
        let mut b = [0u8; 128];
        let src = data.get(1..).unwrap_or(&[]);
        let n = src.len().min(128);
        b[..n].copy_from_slice(&src[..n]);
        if flags & 1 != 0 {
            b[0..8].copy_from_slice(&MAGIC);
        }
        if flags & 2 != 0 {
            b[8..12].copy_from_slice(&LAYOUT_VERSION.to_le_bytes());
        }
        if flags & 4 != 0 {
            let crc = crc32fast::hash(&b[..CRC_AT]);
            b[CRC_AT..].copy_from_slice(&crc.to_le_bytes());
        }
        match Superblock::decode(&b) {
            Ok(None) => {
                assert!(b.iter().all(|&x| x == 0), "only an all-zero header is unformatted");
                "unformatted".into()
            }
            Ok(Some(sb)) => {
                check_accepted(&sb);
                "accepted".into()
            }
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
                format!("refused: {}", norm(e.message()))
            }
        }
    }
}

/// What `Pool` and its readers may assume of a decoded superblock.
fn check_accepted(sb: &Superblock) {
    assert_eq!(sb.layout_version, LAYOUT_VERSION);
    assert!(sb.page_size >= 4096 && sb.page_size.is_power_of_two(), "{sb:?}");
    assert!(
        sb.region_size > 0 && sb.region_size.is_multiple_of(4096) && sb.region_size.is_multiple_of(sb.page_size),
        "{sb:?}"
    );
    let (count, rsize) = (sb.region_count as u128, sb.region_size as u128);
    assert!(sb.data_offset as u128 + count * rsize <= sb.pool_size as u128, "regions past the pool: {sb:?}");
    let slots = count * (rsize / sb.page_size as u128);
    assert!(
        sb.page_table_offset as u128 + slots * PAGE_SLOT_BYTES as u128 <= sb.data_offset as u128,
        "page table past the data: {sb:?}"
    );
    let g = sb.geometry();
    if sb.region_count > 0 {
        let last = sb.region_count - 1;
        assert!(g.region_offset(last) + g.region_size <= sb.pool_size);
        assert!(g.page_slot_offset(last, g.pages_per_region() - 1) + PAGE_SLOT_BYTES <= sb.data_offset);
    }
    assert_eq!(Superblock::decode(&sb.encode()).unwrap().as_ref(), Some(sb), "encode/decode round trip");
}
