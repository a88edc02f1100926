//! Lookups as the control-path and cluster figures make them: keys stored
//! once, batches picked from them, LookupAndLock timed one call at a time
//! or counted in a loop until a deadline.
use std::time::Instant;

use bytes::Bytes;
use cxlkv::client::Client;
use cxlkv::proto;

/// `n` distinct keys in the plugin's text form.
pub fn keys(n: usize) -> Vec<Bytes> {
    (0..n).map(|i| Bytes::from(format!("meta-llama/Llama-3.1-8B@00010000@0@{i:064x}"))).collect()
}

/// Store every key of `ks` (one page each, committed; their bytes do not matter).
pub async fn populate(c: &mut Client, ks: &[Bytes]) {
    for chunk in ks.chunks(1024) {
        let items =
            chunk.iter().map(|k| proto::ReserveItem { key: k.clone(), size: 4096, ..Default::default() }).collect();
        let r = c
            .reserve(proto::ReserveRequest { tenant: "bench".into(), items, ..Default::default() })
            .await
            .unwrap()
            .into_inner();
        let ids = r.reservations.iter().filter(|x| x.status.as_ref().unwrap().code == 0).map(|x| x.reservation_id);
        c.commit(proto::CommitRequest { reservation_ids: ids.collect(), crc32: vec![], keys: vec![] }).await.unwrap();
    }
}

/// The `i`-th batch of `batch` keys from `ks`, spread over all of them.
pub fn pick(ks: &[Bytes], batch: usize, i: usize) -> Vec<Bytes> {
    (0..batch).map(|j| ks[(i * 7919 + j * 104_729) % ks.len()].clone()).collect()
}

/// One LookupAndLock of `keys` (all stored): its latency in µs.
pub async fn timed(c: &mut Client, keys: Vec<Bytes>) -> f64 {
    let req = proto::LookupRequest { keys, lock_ttl_ms: 2000, ..Default::default() };
    let t = Instant::now();
    let r = c.lookup_and_lock(req).await.unwrap().into_inner();
    let us = t.elapsed().as_secs_f64() * 1e6;
    assert!(r.results.iter().all(|x| x.found), "every key is a hit");
    us
}

/// LookupAndLock of `batch` keys picked from `ks` (from pick `i`) until
/// `deadline`: the keys looked up.
pub async fn until(c: &mut Client, ks: &[Bytes], batch: usize, mut i: usize, deadline: Instant) -> u64 {
    let mut done = 0u64;
    while Instant::now() < deadline {
        let req = proto::LookupRequest { keys: pick(ks, batch, i), lock_ttl_ms: 2000, ..Default::default() };
        c.lookup_and_lock(req).await.unwrap();
        done += batch as u64;
        i += 1;
    }
    done
}
