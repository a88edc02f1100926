//! `cxlkv-bench evict`: store throughput into an empty pool and into a
//! full one (every reserve evicts), through the mapped data path.
use std::path::PathBuf;
use std::time::Instant;

use bytes::Bytes;
use cxlkv::client::{connect_uds, Client};
use cxlkv::proto;

use crate::data::{map_pool, touched};
use crate::figures::bench;

struct Filler {
    c: Client,
    map: memmap2::MmapMut,
    info: proto::PoolInfoReply,
    src: Vec<u8>,
    object: usize,
    batch: usize,
    seq: usize,
}

impl Filler {
    /// Store `n` batches; returns (bytes/s including the copies, evictions).
    async fn run(&mut self, n: usize) -> (f64, u32) {
        let t = Instant::now();
        let mut evicted = 0;
        for _ in 0..n {
            let items = (0..self.batch)
                .map(|j| proto::ReserveItem {
                    key: Bytes::from(format!("bench-{}", self.seq + j)),
                    size: self.object as u64,
                    ..Default::default()
                })
                .collect();
            self.seq += self.batch;
            let r = self
                .c
                .reserve(proto::ReserveRequest { tenant: "b".into(), items, ..Default::default() })
                .await
                .unwrap()
                .into_inner();
            evicted += r.evicted;
            let mut ids = vec![];
            for x in &r.reservations {
                assert_eq!(x.status.as_ref().unwrap().code, 0, "reserve failed: {x:?}");
                let l = x.location.as_ref().unwrap();
                let at = (self.info.data_offset + l.region as u64 * self.info.region_size + l.offset) as usize;
                self.map[at..at + self.object].copy_from_slice(&self.src);
                ids.push(x.reservation_id);
            }
            self.c.commit(proto::CommitRequest { reservation_ids: ids, crc32: vec![] }).await.unwrap();
        }
        ((n * self.object * self.batch) as f64 / t.elapsed().as_secs_f64(), evicted)
    }
}

pub async fn evict(socket: PathBuf, object: usize, batch: usize) {
    let mut c = connect_uds(&socket).await.unwrap();
    let info = c.pool_info(proto::PoolInfoRequest {}).await.unwrap().into_inner();
    let map = map_pool(&info);
    let capacity = info.capacity_bytes as usize;
    let per_batch = object * batch;
    let src = touched(object, 7);
    let mut fl = Filler { c, map, info, src: src.clone(), object, batch, seq: 0 };
    let half = (capacity / 2 / per_batch).max(1);
    // Claim (and prefault) every region once, then empty the pool, so both
    // phases below store into owned regions and differ only by eviction.
    let start = fl.seq;
    fl.run(capacity / per_batch).await;
    let keys: Vec<Bytes> = (start..fl.seq).map(|i| Bytes::from(format!("bench-{i}"))).collect();
    for chunk in keys.chunks(4096) {
        fl.c.delete(proto::DeleteRequest { keys: chunk.to_vec() }).await.unwrap();
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
