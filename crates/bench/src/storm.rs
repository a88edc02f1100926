//! `cxlkv-bench storm`: reserves that cannot be placed, over many locked
//! entries, while another client probes — the probes' p99 vs idle.
use std::path::PathBuf;
use std::time::Instant;

use bytes::Bytes;
use cxlkv::client::{connect_uds, Client};
use cxlkv::proto;

use crate::figures::{bench, pct};

/// Page-sized entries `from..to`, committed (their bytes do not matter here).
async fn fill_keys(c: &mut Client, prefix: &str, n: usize, size: u64) {
    for start in (0..n).step_by(4096) {
        let items = (start..(start + 4096).min(n))
            .map(|i| proto::ReserveItem { key: Bytes::from(format!("{prefix}{i}")), size, ..Default::default() })
            .collect();
        let rep = c.reserve(proto::ReserveRequest { items, ..Default::default() }).await.unwrap().into_inner();
        let ids = rep.reservations.iter().map(|r| r.reservation_id).collect();
        c.commit(proto::CommitRequest { reservation_ids: ids, crc32: vec![] }).await.unwrap();
    }
}

/// p99 in µs of `n` probes: Stats, then a LookupAndLock of 32 absent keys.
async fn probe(c: &mut Client, n: usize) -> f64 {
    let keys: Vec<Bytes> = (0..32).map(|i| Bytes::from(format!("absent{i}"))).collect();
    let mut us = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        c.stats(proto::StatsRequest {}).await.unwrap();
        let req = proto::LookupRequest { keys: keys.clone(), ..Default::default() };
        c.lookup_and_lock(req).await.unwrap();
        us.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
    }
    pct(&mut us, 0.99)
}

pub async fn storm(socket: PathBuf, locked: usize, free: usize, probes: usize) {
    let mut c = connect_uds(&socket).await.unwrap();
    let info = c.pool_info(proto::PoolInfoRequest {}).await.unwrap().into_inner();
    fill_keys(&mut c, "locked", locked, info.page_size).await;
    fill_keys(&mut c, "free", free, info.page_size).await;
    for start in (0..locked).step_by(4096) {
        let keys = (start..(start + 4096).min(locked)).map(|i| Bytes::from(format!("locked{i}"))).collect();
        let req = proto::LookupRequest { keys, lock_ttl_ms: 600_000, ..Default::default() };
        c.lookup_and_lock(req).await.unwrap();
    }
    let mut p = connect_uds(&socket).await.unwrap();
    let idle = probe(&mut p, probes).await;
    // The storm: batches of region-sized items that can never all be placed.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (stop2, size) = (stop.clone(), info.max_object_size);
    let storm = tokio::spawn(async move {
        let (mut n, mut ms, mut round) = (0u64, 0f64, 0usize);
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
            let items = (0..4096)
                .map(|i| proto::ReserveItem { key: Bytes::from(format!("s{round}-{i}")), size, ..Default::default() })
                .collect();
            let t = Instant::now();
            let rep = c.reserve(proto::ReserveRequest { items, ..Default::default() }).await.unwrap().into_inner();
            ms += t.elapsed().as_secs_f64() * 1e3;
            n += 1;
            round += 1;
            let ids: Vec<u64> = rep
                .reservations
                .iter()
                .filter(|r| r.status.as_ref().unwrap().code == 0)
                .map(|r| r.reservation_id)
                .collect();
            c.abort(proto::AbortRequest { reservation_ids: ids }).await.unwrap();
        }
        (n, ms / n.max(1) as f64)
    });
    let during = probe(&mut p, probes).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (reserves, reserve_ms) = storm.await.unwrap();
    let visits = p.stats(proto::StatsRequest {}).await.unwrap().into_inner();
    bench("storm_reserves", reserves as f64);
    bench("storm_reserve_ms", reserve_ms);
    bench("storm_evictions", visits.evictions as f64);
    bench("probe_p99_us_idle", idle);
    bench("probe_p99_us_storm", during);
    bench("storm_probe_p99_ratio", during / idle);
}
