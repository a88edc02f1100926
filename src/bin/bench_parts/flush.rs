//! `cxlkv-bench flush`: what software coherence costs a store. Two nodes in
//! this process share one shm pool file: one with hardware coherence (today's
//! store path: nothing flushed), one with software coherence (every record
//! and region-table entry flushed by the node, every payload line written
//! back by the writer). Each stores batches (reserve, copy, commit) in
//! rotating rounds, so drift and the memory's state hit every variant alike;
//! both use the same memory, and no process or RPC stands between them (two
//! sidecar processes differed by 10-15 % with the same settings here). With
//! no RPCs in the time, the ratio is a lower bound for a client's.
//!
//! The software node stores twice per round: with the writer's write-backs
//! (the whole cost) and without (the node's share: record flushes). The
//! writer copies with plain stores; the plugin uses streaming stores for
//! objects of 512 KiB and more, which need no write-back, so its cost there
//! is close to the node's share.
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use cxlkv::handler::{Handler, Limits};
use cxlkv::pool::{backend::DAX_ALIGN, Coherence, Geometry, Pool, PoolOptions, ShmBackend};
use cxlkv::registry::{LocalRegistry, Session};

const REGION: u64 = 64 << 20;
const PAGE: u64 = 64 << 10;

thread_local! {
    /// The handler's calls are async; the same runtime drives both nodes.
    static RT: tokio::runtime::Runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    RT.with(|rt| rt.block_on(f))
}

fn node(path: &Path, coherence: Coherence, id: u32) -> Handler {
    let g = Geometry::for_capacity(8 * REGION, REGION, PAGE, DAX_ALIGN).unwrap();
    let backend = ShmBackend::open(path, g.pool_size, false).unwrap().with_coherence(coherence);
    let (pool, _) =
        Pool::open(Box::new(backend), &PoolOptions { region_size: REGION, page_size: PAGE, format: false }).unwrap();
    assert_eq!(pool.coherence(), coherence);
    let id = pool.lock_node(Some(id)).unwrap();
    let limits = Limits { max_regions: 3, ..Default::default() };
    Handler::new(Arc::new(pool), cxlkv::ids::NodeId(id), Arc::new(LocalRegistry::new("lru", 1024).unwrap()), limits)
        .unwrap()
}

/// Reserve, copy (and write back when `wb`), commit one batch; seconds
/// taken. The keys are deleted afterwards, untimed, so the pool never fills.
fn batch(h: &Handler, seq: &mut u64, src: &[u8], n: usize, wb: bool) -> f64 {
    let keys: Vec<Vec<u8>> = (0..n).map(|j| format!("flush-{}", *seq + j as u64).into_bytes()).collect();
    *seq += n as u64;
    let t = Instant::now();
    let items = keys.iter().map(|k| (k.clone(), src.len() as u64)).collect();
    let rr = block_on(h.reserve("b", items, Session::LOCAL, false)).unwrap();
    let mut ids = vec![];
    for r in rr.results {
        let (id, loc) = r.unwrap();
        let m = h.mapping_for(&loc).unwrap();
        m.write(loc.offset, src).unwrap();
        if wb {
            m.flush(loc.offset, src.len()).unwrap();
        }
        ids.push(id);
    }
    let (out, _) = block_on(h.commit(&ids, &[], Session::LOCAL)).unwrap();
    assert!(out.iter().all(|r| r.is_ok()));
    let s = t.elapsed().as_secs_f64();
    block_on(h.delete(&keys)).unwrap();
    s
}

pub fn run(pool: &Path, sizes: &[usize], n: usize, rounds: usize) {
    let _ = std::fs::remove_file(pool);
    let (hw, sw) = (node(pool, Coherence::Hardware, 1), node(pool, Coherence::Software, 2));
    let mut seq = 0;
    for &size in sizes {
        let src = super::touched(size, 3);
        batch(&hw, &mut seq, &src, n, false); // warm-up
        batch(&sw, &mut seq, &src, n, true);
        let mut t: [Vec<f64>; 3] = Default::default(); // hardware, software, software without write-backs
        for i in 0..rounds {
            for k in 0..3 {
                let v = (i + k) % 3;
                let s = match v {
                    0 => batch(&hw, &mut seq, &src, n, false),
                    1 => batch(&sw, &mut seq, &src, n, true),
                    _ => batch(&sw, &mut seq, &src, n, false),
                };
                t[v].push(s);
            }
        }
        let bytes = (size * n) as f64;
        let [h, s, r] = t.map(|mut v| bytes / super::pct(&mut v, 0.5));
        let lab = super::label(size);
        super::bench(&format!("store_hw_gbps_{lab}"), h / 1e9);
        super::bench(&format!("store_sw_gbps_{lab}"), s / 1e9);
        super::bench(&format!("store_flush_ratio_{lab}"), s / h);
        super::bench(&format!("store_record_flush_ratio_{lab}"), r / h);
    }
    drop((hw, sw));
    let _ = std::fs::remove_file(pool);
}
