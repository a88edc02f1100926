//! `cxlkv-bench flush`: what software coherence costs a store. Two nodes in
//! this process share one shm pool file: one with hardware coherence (today's
//! store path: nothing flushed), one with software coherence (every record
//! and region-table entry flushed by the node). Each stores batches (reserve,
//! copy, commit) in rotating rounds, so drift and the memory's state hit
//! every variant alike; both use the same memory, and no process or RPC
//! stands between them (two sidecar processes with the same settings
//! differed by more than the effects measured: docs/benchmark-findings.md,
//! "Software coherence"). With no RPCs in the time, the ratio is a lower
//! bound for a client's.
//!
//! The software node stores three times per round: with streaming stores
//! (only partial head and tail lines written back, one fence per batch: what
//! the plugin does; `store_flush_ratio_*`), with plain
//! stores and no write-back (the node's own record flushes alone:
//! `store_record_flush_ratio_*`), and with plain stores then a write-back of
//! every line (`write` + `flush`, the writers' path before streaming:
//! `store_writeback_flush_ratio_*`). A third node, with hardware
//! coherence, stores with its pages pushed out of the caches after each
//! batch, as pool pages mostly are (`store_flush_ratio_cold_*`: streaming ÷
//! that): a small batch otherwise lands on the lines the previous one left
//! in the cache, which only a coherent pool may keep. Each size runs with a
//! small batch (`batch` objects, which fits in the last-level cache) and a
//! large one (`big` bytes, several times it, as a GPU host's offload
//! batches are); every object has its own source bytes.
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use cxlkv::handler::{Handler, Limits};
use cxlkv::pool::{backend::DAX_ALIGN, Coherence, Geometry, Pool, PoolOptions, ShmBackend};
use cxlkv::registry::{LocalRegistry, Session};

const REGION: u64 = 64 << 20;
/// Regions a node may hold: a large batch of one node fits in them.
const MAX_REGIONS: u32 = 4;
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
    let g = Geometry::for_capacity(4 * MAX_REGIONS as u64 * REGION, REGION, PAGE, DAX_ALIGN).unwrap();
    let backend = ShmBackend::open(path, g.pool_size, false).unwrap().with_coherence(coherence);
    let (pool, _) =
        Pool::open(Box::new(backend), &PoolOptions { region_size: REGION, page_size: PAGE, format: false }).unwrap();
    assert_eq!(pool.coherence(), coherence);
    let id = pool.lock_node(Some(id)).unwrap();
    let limits = Limits { max_regions: MAX_REGIONS, ..Default::default() };
    Handler::new(Arc::new(pool), cxlkv::ids::NodeId(id), Arc::new(LocalRegistry::new("lru", 1024).unwrap()), limits)
        .unwrap()
}

#[derive(Clone, Copy)]
enum How {
    /// Plain stores, nothing written back (hardware coherence).
    Plain,
    /// Plain stores, then every line written back and fenced.
    WriteBack,
    /// Streaming stores (`Mapping::write_streaming`), one fence per batch.
    Through,
}

/// Reserve, copy object `j` from `src[j * size..]`, commit one batch of
/// `n`; seconds taken. The keys are deleted afterwards, untimed, so the pool
/// never fills. With `evict`, a node whose mappings are not coherent then
/// pushes the batch's lines out of every cache, untimed: the next batch
/// reuses these pages and finds them cold, as pool pages mostly are (a
/// pool is many times the last-level cache).
fn batch(h: &Handler, seq: &mut u64, src: &[u8], size: usize, n: usize, how: How, evict: Option<&Handler>) -> f64 {
    let keys: Vec<Vec<u8>> = (0..n).map(|j| format!("flush-{}", *seq + j as u64).into_bytes()).collect();
    *seq += n as u64;
    let t = Instant::now();
    let items = keys.iter().map(|k| (k.clone(), size as u64)).collect();
    let rr = block_on(h.reserve("b", items, Session::LOCAL, false)).unwrap();
    let (ids, locs): (Vec<_>, Vec<_>) = rr.results.into_iter().map(|r| r.unwrap()).unzip();
    // The mappings first, then the copies, as the plugin does (its regions
    // stay mapped; one call copies the batch): a locked instruction (an
    // `Arc`'s count) between two objects would wait for the streaming
    // stores before it, a fence per object.
    let maps: Vec<_> = locs.iter().map(|l| h.mapping_for(l).unwrap()).collect();
    for (j, (loc, m)) in locs.iter().zip(&maps).enumerate() {
        let obj = &src[j * size..(j + 1) * size];
        match how {
            How::Plain => m.write(loc.offset, obj).unwrap(),
            How::WriteBack => {
                m.write(loc.offset, obj).unwrap();
                m.flush(loc.offset, size).unwrap();
            }
            How::Through => m.write_streaming(loc.offset, obj).unwrap(),
        }
    }
    if let (How::Through, Some(m)) = (how, maps.first()) {
        // One fence for the batch's streamed payloads, before any record
        // commits them (as the plugin's copy routine does).
        m.fence();
    }
    drop(maps);
    let (out, _) = block_on(h.commit(&ids, &[], Session::LOCAL)).unwrap();
    assert!(out.iter().all(|r| r.is_ok()));
    let s = t.elapsed().as_secs_f64();
    block_on(h.delete(&keys)).unwrap();
    if let Some(e) = evict {
        for loc in &locs {
            e.mapping_for(loc).unwrap().invalidate(loc.offset, size).unwrap();
        }
    }
    s
}

pub fn run(pool: &Path, sizes: &[usize], n: usize, big: usize, rounds: usize) {
    let _ = std::fs::remove_file(pool);
    let (hw, sw) = (node(pool, Coherence::Hardware, 1), node(pool, Coherence::Software, 2));
    // Its own node, so its evicted pages are never the hot variant's.
    let cold = node(pool, Coherence::Hardware, 3);
    let mut seq = 0;
    for &size in sizes {
        // Objects under a page take a page each: large batches of them
        // would need more pool than the batch's bytes.
        let big = (size as u64 >= PAGE).then(|| ((big / size).max(n), format!("_big{}", crate::figures::label(big))));
        for (count, tag) in [Some((n, String::new())), big].into_iter().flatten() {
            let src = crate::data::touched(size * count, 3);
            // Hardware; software as writers store now (streaming); software
            // with nothing written back (the node's share: records); software
            // with plain stores + write-backs (the writers' path before).
            // Last, hardware coherence again, with its pages pushed out of
            // the caches after each batch (the software node's mapping
            // evicts them).
            let variants = [
                (&hw, How::Plain, None),
                (&sw, How::Through, None),
                (&sw, How::Plain, None),
                (&sw, How::WriteBack, None),
                (&cold, How::Plain, Some(&sw)),
            ];
            for (h, how, evict) in variants {
                batch(h, &mut seq, &src, size, count, how, evict); // warm-up
            }
            let mut t: [Vec<f64>; 5] = Default::default();
            for i in 0..rounds {
                for k in 0..5 {
                    let (h, how, evict) = variants[(i + k) % 5];
                    t[(i + k) % 5].push(batch(h, &mut seq, &src, size, count, how, evict));
                }
            }
            let bytes = (size * count) as f64;
            let [h, s, r, w, c] = t.map(|mut v| bytes / crate::figures::pct(&mut v, 0.5));
            let lab = format!("{}{tag}", crate::figures::label(size));
            crate::figures::bench(&format!("store_hw_gbps_{lab}"), h / 1e9);
            crate::figures::bench(&format!("store_flush_ratio_{lab}"), s / h);
            crate::figures::bench(&format!("store_record_flush_ratio_{lab}"), r / h);
            crate::figures::bench(&format!("store_writeback_flush_ratio_{lab}"), w / h);
            crate::figures::bench(&format!("store_stream_vs_writeback_{lab}"), s / w);
            crate::figures::bench(&format!("store_flush_ratio_cold_{lab}"), s / c);
        }
    }
    drop((hw, sw, cold));
    let _ = std::fs::remove_file(pool);
}
