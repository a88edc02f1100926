//! Target `pool`: a `Pool` opened over a pool file someone else wrote, then a
//! `Handler` on it and a sequence of calls, while "another process" keeps
//! writing into the region table and page table.
//!
//! Input: `[sel][image length u16][image][ops]`. `sel` bit 0 picks one of two
//! geometries (2 MiB regions with 64 KiB or 4 KiB pages), bits 1-2 how the
//! image becomes the file's metadata area (0: the raw bytes from offset 0;
//! 1: a valid superblock, then the image as region table and page table;
//! 2: superblock fields from the image with a matching crc32, then the
//! tables; 3: as 1), bit 3 the node id (1 or 2), bit 7 `format`.
//! Checks: opening refuses or attaches without panicking; an attached pool
//! has the configured geometry and answers for every region; a handler on
//! it refuses or works, and no later call (reserve, commit, abort, lookup,
//! unlock, delete, reads of a location, stats, region and page-table reads,
//! claim-ahead, reaping) panics, whatever the tables hold or come to hold.
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use cxlkv::error::{Error, ErrorKind};
use cxlkv::handler::{Handler, Limits};
use cxlkv::pool::layout::{LAYOUT_VERSION, MAGIC, PAGE_SLOT_BYTES, REGION_ENTRY_BYTES, SUPERBLOCK_BYTES};
use cxlkv::pool::{Geometry, NodeId, OpenOutcome, Pool, PoolOptions, RegionId, ShmBackend};
use cxlkv::registry::{LocalRegistry, Location, Session};

use crate::driver::{norm, Cursor, Target, INTERESTING};

struct Geo {
    path: PathBuf,
    g: Geometry,
    /// The superblock a fresh format of this geometry writes.
    valid_sb: [u8; 128],
    /// Superblock, region table and page table: the bytes anyone reads.
    meta: Vec<u8>,
}

pub struct PoolTarget {
    _dir: tempfile::TempDir,
    dir_text: String,
    geos: [Geo; 2],
}

fn kind_bit(k: ErrorKind) -> u16 {
    1 << (k as u16)
}

impl PoolTarget {
    pub fn new() -> Self {
        let dir = crate::scratch_dir();
        let dir_text = dir.path().display().to_string();
        let geo = |name: &str, page_size: u64| {
            let g = Geometry::for_capacity(8 << 20, 2 << 20, page_size, 2 << 20).unwrap();
            let path = dir.path().join(name);
            let backend = ShmBackend::open(&path, g.pool_size, false).unwrap();
            let opts = PoolOptions { region_size: g.region_size, page_size, format: true };
            let (pool, _) = Pool::open(Box::new(backend), &opts).unwrap();
            assert_eq!(pool.geometry(), g);
            drop(pool);
            let mut valid_sb = [0u8; 128];
            std::fs::File::open(&path).unwrap().read_exact_at(&mut valid_sb, 0).unwrap();
            let meta = vec![0u8; g.page_slot_offset(g.region_count, 0) as usize];
            Geo { path, g, valid_sb, meta }
        };
        let geos = [geo("pool-64k", 64 << 10), geo("pool-4k", 4 << 10)];
        Self { _dir: dir, dir_text, geos }
    }

    fn label(&self, stage: &str, e: &Error) -> String {
        format!("{stage}: {:?} {}", e.kind(), norm(&e.message().replace(&self.dir_text, "<dir>")))
    }
}

/// Region table, then page table, from `img` (the gap between them stays 0).
fn fill_tables(meta: &mut [u8], g: &Geometry, img: &[u8]) {
    let rt = (g.region_count as u64 * REGION_ENTRY_BYTES) as usize;
    let n = img.len().min(rt);
    let at = SUPERBLOCK_BYTES as usize;
    meta[at..at + n].copy_from_slice(&img[..n]);
    let pt = &img[n..];
    let at = g.page_table_offset as usize;
    let n = pt.len().min(meta.len() - at);
    meta[at..at + n].copy_from_slice(&pt[..n]);
}

impl Target for PoolTarget {
    fn name(&self) -> &'static str {
        "pool"
    }
    fn max_len(&self) -> usize {
        4096
    }
    fn seeds(&self) -> Vec<Vec<u8>> {
        let ops: &[u8] = &[
            0, 2, 0, 0, 1, 1, 1, 0, 1, 7, 3, 2, 0, 1, 2, 6, 0, 4, 1, 1, 5, 1, 2, 8, 9, 1, 0, 0, 0, 3, 0, 0, 0, 10, 11,
            0, 0, 3, 0, 6, 7, 0, 4, 0, 0, 0, 0, 0, 0, 2, 1, 0, 2, 0, 0, 3, 1, 12, 2, 1,
        ];
        let mut seeds = vec![];
        for geo in 0..2u8 {
            // A restart: region 0 owned by node 1 (generation 5), region 2 by node 2.
            let mut rt = vec![0u8; 128];
            rt[0..8].copy_from_slice(&((1u64 << 32) | 1).to_le_bytes());
            rt[8..16].copy_from_slice(&5u64.to_le_bytes());
            rt[64..72].copy_from_slice(&((1u64 << 32) | 2).to_le_bytes());
            rt[72..80].copy_from_slice(&9u64.to_le_bytes());
            let mut pt = vec![0u8; 64];
            for (i, w) in [7u32, 1, 0xdead_beef, 0, 3, 0, 0, 0].iter().enumerate() {
                pt[i * 4..i * 4 + 4].copy_from_slice(&w.to_le_bytes());
            }
            let tables: Vec<u8> = [rt.clone(), pt.clone()].concat();
            for (sel, image) in [
                (geo | 1 << 1, tables.clone()),
                (geo | 1 << 1 | 1 << 3, tables.clone()),
                (geo | 2 << 1, [self.geos[geo as usize].valid_sb.to_vec(), tables.clone()].concat()),
                (geo, self.geos[geo as usize].valid_sb.to_vec()),
                (geo, vec![]),
                (geo | 0x80, b"not a pool".to_vec()),
            ] {
                let mut s = vec![sel];
                s.extend_from_slice(&(image.len() as u16).to_le_bytes());
                s.extend_from_slice(&image);
                s.extend_from_slice(ops);
                seeds.push(s);
            }
        }
        seeds
    }

    fn run(&mut self, data: &[u8]) -> String {
        let mut c = Cursor::new(data);
        let sel = c.u8();
        let img_len = c.u16() as usize;
        let img = c.bytes(img_len);
        let ops = c.rest();
        let geo = &mut self.geos[(sel & 1) as usize];
        let g = geo.g;
        geo.meta.fill(0);
        match (sel >> 1) & 3 {
            0 => {
                let n = img.len().min(geo.meta.len());
                geo.meta[..n].copy_from_slice(&img[..n]);
            }
            2 => {
                let mut sb = [0u8; 128];
                let n = img.len().min(128);
                sb[..n].copy_from_slice(&img[..n]);
                sb[0..8].copy_from_slice(&MAGIC);
                if sel & 0x40 == 0 {
                    sb[8..12].copy_from_slice(&LAYOUT_VERSION.to_le_bytes());
                }
                let crc = crc32fast::hash(&sb[..124]);
                sb[124..].copy_from_slice(&crc.to_le_bytes());
                geo.meta[..128].copy_from_slice(&sb);
                fill_tables(&mut geo.meta, &g, &img[n..]);
            }
            _ => {
                geo.meta[..128].copy_from_slice(&geo.valid_sb);
                fill_tables(&mut geo.meta, &g, img);
            }
        }
        let file = std::fs::OpenOptions::new().write(true).open(&geo.path).unwrap();
        file.write_all_at(&geo.meta, 0).unwrap();
        let path = geo.path.clone();

        let backend = ShmBackend::open(&path, g.pool_size, false).expect("the harness's own pool file");
        let opts = PoolOptions { region_size: g.region_size, page_size: g.page_size, format: sel & 0x80 != 0 };
        let (pool, outcome) = match Pool::open(Box::new(backend), &opts) {
            Ok(x) => x,
            Err(e) => return self.label("open", &e),
        };
        // Whatever was in the file, an open pool has the configured geometry.
        assert_eq!(pool.geometry(), g);
        for r in pool.region_ids() {
            pool.region_state(r).expect("every region of an open pool answers");
        }
        let open = if outcome == OpenOutcome::Attached { "attached" } else { "formatted" };
        let node = 1 + ((sel >> 3) & 1) as u32;
        let node = match pool.lock_node(Some(node)) {
            Ok(n) => n,
            Err(e) => return self.label(open, &e),
        };
        let limits = Limits {
            prefault: false,
            reservation_timeout_ms: 50,
            default_lock_ttl_ms: 1,
            max_batch: 8,
            ..Limits::default()
        };
        let registry = Arc::new(LocalRegistry::new("lru", 16).unwrap());
        let h = match Handler::new(Arc::new(pool), NodeId(node), registry, limits) {
            Ok(h) => h,
            Err(e) => return self.label(&format!("{open}, handler"), &e),
        };
        let adopted = block_on(h.stats()).unwrap().owned_regions;
        let (errors, served) = exercise(&h, &file, &g, ops);
        let s = block_on(h.stats()).unwrap();
        assert!(s.pages_free <= s.pages_total, "free pages beyond the owned ones");
        format!("{open}, handler up, {adopted} regions, error kinds {errors:#06x}, ops served {served:#06x}")
    }
}

thread_local! {
    /// The handler's calls are async; the harness drives them one by one.
    static RT: tokio::runtime::Runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    RT.with(|rt| rt.block_on(f))
}

fn size(c: &mut Cursor) -> u64 {
    match c.u8() % 8 {
        0 => 1,
        1 => 4096,
        2 => 64 << 10,
        3 => (64 << 10) + 1,
        4 => 2 << 20,
        5 => (2 << 20) + 1,
        6 => 0,
        _ => c.u32() as u64,
    }
}

fn key(c: &mut Cursor) -> Vec<u8> {
    vec![b'k', c.u8() % 8]
}

fn keys(c: &mut Cursor) -> Vec<Vec<u8>> {
    (0..1 + c.u8() % 4).map(|_| key(c)).collect()
}

/// Run the op sequence; returns the error kinds seen and the ops that
/// succeeded at least once, one bit each.
fn exercise(h: &Handler, file: &std::fs::File, g: &Geometry, ops: &[u8]) -> (u16, u16) {
    let mut c = Cursor::new(ops);
    let (mut seen, mut served) = (0u16, 0u16);
    let mut note = |op: u8, r: Result<(), Error>| match r {
        Ok(()) => served |= 1 << op,
        Err(e) => seen |= kind_bit(e.kind()),
    };
    let mut ids = vec![];
    let mut locs: Vec<Location> = vec![];
    for _ in 0..32 {
        if c.is_empty() {
            break;
        }
        let op = c.u8() % 13;
        match op {
            0 => {
                let items: Vec<(Vec<u8>, u64)> = (0..1 + c.u8() % 4).map(|_| (key(&mut c), size(&mut c))).collect();
                note(
                    op,
                    block_on(h.reserve("t", items, Session::LOCAL, false)).map(|rr| {
                        for (id, loc) in rr.results.into_iter().flatten() {
                            ids.push(id);
                            locs.push(loc);
                        }
                    }),
                );
            }
            1 | 2 => {
                let n = (c.u8() % 4) as usize;
                let take: Vec<_> = ids.drain(ids.len().saturating_sub(n)..).collect();
                let r = if c.bool() {
                    let crc: Vec<u32> = if c.bool() { take.iter().map(|_| c.u32()).collect() } else { vec![] };
                    block_on(h.commit(&take, &crc, Session::LOCAL))
                        .map(|(out, _)| locs.extend(out.into_iter().flatten()))
                } else {
                    block_on(h.abort(&take, Session::LOCAL)).map(|_| ())
                };
                note(op, r);
            }
            3 => {
                let ttl = [0, 1, 1000, 3_600_001][(c.u8() % 4) as usize];
                note(
                    op,
                    block_on(h.lookup_and_lock(&keys(&mut c), ttl, Session::LOCAL))
                        .map(|(hits, _)| locs.extend(hits.into_iter().flatten())),
                );
            }
            4 => note(op, block_on(h.unlock(&keys(&mut c), Session::LOCAL)).map(|_| ())),
            5 => note(op, block_on(h.delete(&keys(&mut c))).map(|_| ())),
            6 => {
                for loc in locs.iter().rev().take(4) {
                    note(op, h.still_there(loc).map(|_| ()));
                    note(op, h.payload_crc(loc).map(|_| ()));
                    note(
                        op,
                        h.mapping_for(loc).and_then(|m| {
                            let mut buf = vec![0u8; loc.length.min(64) as usize];
                            m.read(loc.offset, &mut buf)
                        }),
                    );
                }
            }
            7 => {
                let _ = block_on(h.reap());
            }
            8 => {
                let _ = block_on(cxlkv::rpc::stats_reply(h, &Default::default()));
                let _ = cxlkv::rpc::pool_info(h);
            }
            9 => {
                let p = h.pool();
                let r = if c.bool() { c.u32() } else { (c.u8() % 6) as u32 };
                let page = if c.bool() { c.u64() } else { (c.u8() % 40) as u64 };
                note(op, p.region_state(RegionId(r)).map(|_| ()));
                note(op, p.page_version(RegionId(r), page).map(|_| ()));
                note(op, p.page_crc(RegionId(r), page).map(|_| ()));
                note(op, p.map_region(RegionId(r), c.bool()).map(|_| ()));
                let _ = p.regions_owned_by(NodeId(c.u8() as u32 % 4));
            }
            10 => note(op, block_on(h.claim_ahead()).map(|_| ())),
            11 => {
                // Another process writes a region-table word.
                let r = c.u8() as u64 % g.region_count as u64;
                let at = SUPERBLOCK_BYTES + r * REGION_ENTRY_BYTES + (c.u8() as u64 % 4) * 8;
                let v = if c.bool() { INTERESTING[c.u8() as usize % INTERESTING.len()] } else { c.u64() };
                file.write_all_at(&v.to_le_bytes(), at).unwrap();
            }
            _ => {
                // Another process writes a page-table word.
                let slots = g.region_count as u64 * g.pages_per_region();
                let slot = c.u16() as u64 % slots;
                let at = g.page_table_offset + slot * PAGE_SLOT_BYTES + (c.u8() as u64 % 4) * 4;
                let v = if c.bool() { INTERESTING[c.u8() as usize % INTERESTING.len()] as u32 } else { c.u32() };
                file.write_all_at(&v.to_le_bytes(), at).unwrap();
            }
        }
    }
    (seen, served)
}
