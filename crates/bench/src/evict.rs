//! `cxlkv-bench evict`: store throughput into an empty pool and into a
//! full one (every reserve evicts), through the mapped data path.
use std::path::PathBuf;
use std::time::Instant;

use bytes::Bytes;
use cxlkv::proto;

use crate::data::{touched, Writer};
use crate::figures::bench;

struct Filler {
    w: Writer,
    batch: usize,
    seq: usize,
}

impl Filler {
    /// Store `n` batches; returns (bytes/s including the copies, evictions).
    async fn run(&mut self, n: usize) -> (f64, u32) {
        let t = Instant::now();
        let mut evicted = 0;
        for _ in 0..n {
            let keys = (0..self.batch).map(|j| Bytes::from(format!("bench-{}", self.seq + j))).collect();
            self.seq += self.batch;
            let got = self.w.store(keys).await;
            assert_eq!(got.refused, 0, "the evict bench's sidecar admits every store");
            evicted += got.evicted;
        }
        ((n * self.w.object * self.batch) as f64 / t.elapsed().as_secs_f64(), evicted)
    }
}

pub async fn evict(socket: PathBuf, object: usize, batch: usize) {
    let w = Writer::open(&socket, object, 7).await;
    let capacity = w.info.capacity_bytes as usize;
    let per_batch = object * batch;
    let src = touched(object, 7);
    let mut fl = Filler { w, batch, seq: 0 };
    let half = (capacity / 2 / per_batch).max(1);
    // Claim (and prefault) every region once, then empty the pool, so both
    // phases below store into owned regions and differ only by eviction.
    let start = fl.seq;
    fl.run(capacity / per_batch).await;
    let keys: Vec<Bytes> = (start..fl.seq).map(|i| Bytes::from(format!("bench-{i}"))).collect();
    for chunk in keys.chunks(4096) {
        fl.w.c.delete(proto::DeleteRequest { keys: chunk.to_vec() }).await.unwrap();
    }
    let (empty, ev0) = fl.run(half).await;
    // Fill the rest, then measure evicting stores of the same volume.
    fl.run((capacity / per_batch).saturating_sub(half) + 1).await;
    let (full, ev1) = fl.run(half).await;
    assert_eq!(ev0, 0, "the empty phase must not evict");
    assert!(ev1 as usize >= half * batch, "the full phase must evict on every reserve ({ev1})");
    // memcpy of the same bytes to distinct destinations, same thread.
    let mut dst = touched(half * per_batch, 1);
    let t = Instant::now();
    for chunk in dst.chunks_mut(object) {
        chunk.copy_from_slice(&src);
    }
    std::hint::black_box(&dst);
    let mc = (half * per_batch) as f64 / t.elapsed().as_secs_f64();
    bench("store_empty_gbps_rust", empty / 1e9);
    bench("store_full_gbps_rust", full / 1e9);
    bench("store_empty_ratio_memcpy_rust", empty / mc);
    bench("full_vs_empty_store_ratio", full / empty);
}
