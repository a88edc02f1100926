//! `cxlkv-bench storm-handler`: the storm's Reserve given to a handler in
//! this process (the sidecar's own work on it: no transport, no other
//! client, no lane below the probes' priority), the same pool and entries
//! as `storm`'s sidecar. Beside `storm_reserve_ms` it tells what the
//! sidecar's code costs from what the host's CPUs and wake-ups add.
use std::path::Path;
use std::time::Instant;

use bytes::Bytes;
use cxlkv::handler::{Handler, How};
use cxlkv::registry::Session;

use crate::figures::{bench, pct};

/// As `storm`'s sidecar (64 MiB regions, 4 KiB pages, admission off), with
/// as many regions as `entries` one-page entries fill: every region then
/// keeps a locked entry and no region-sized object can ever be placed (at
/// the bench's 60,000 entries, its 256 MiB).
fn open_handler(path: &Path, entries: usize) -> Handler {
    crate::node::open(path, crate::node::regions_for(entries))
}

/// The keys as the server gets a packed request's: slices of one buffer.
fn packed(keys: impl Iterator<Item = String>) -> Vec<Bytes> {
    let (mut buf, mut ends) = (Vec::new(), vec![]);
    for k in keys {
        buf.extend_from_slice(k.as_bytes());
        ends.push(buf.len());
    }
    let buf = Bytes::from(buf);
    let starts = std::iter::once(0).chain(ends.iter().copied());
    starts.zip(&ends).map(|(s, &e)| buf.slice(s..e)).collect()
}

async fn fill(h: &Handler, prefix: &str, n: usize, page: u64) {
    for start in (0..n).step_by(4096) {
        let keys = packed((start..(start + 4096).min(n)).map(|i| format!("{prefix}{i}")));
        let r = h.reserve("", keys.into_iter().map(|k| (k, page)).collect(), Session::LOCAL, false).await.unwrap();
        let ids: Vec<_> = r.results.into_iter().map(|x| x.unwrap().0).collect();
        h.commit(&ids, &[], Session::LOCAL).await.unwrap();
    }
}

pub async fn run(path: &Path, locked: usize, free: usize, rounds: usize) {
    let _ = std::fs::remove_file(path);
    let h = open_handler(path, locked + free);
    let page = h.pool().superblock().page_size;
    fill(&h, "locked", locked, page).await;
    fill(&h, "free", free, page).await;
    for start in (0..locked).step_by(4096) {
        let keys: Vec<Vec<u8>> =
            (start..(start + 4096).min(locked)).map(|i| format!("locked{i}").into_bytes()).collect();
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
        h.lookup_and_lock(&keys, 600_000, Session(5)).await.unwrap();
    }
    let mut ms = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let keys = packed((0..4096).map(|i| format!("s{round}-{i}")));
        let items = keys.into_iter().map(|k| (k, h.max_object_size())).collect();
        let t = Instant::now();
        let r = h.reserve_with("", items, &[], Session(7), false, How::STORE).await.unwrap();
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        assert!(r.results.iter().all(|x| x.is_err()), "a storm Reserve placed something");
        assert_eq!(r.evicted, 0, "a storm Reserve evicted");
    }
    bench("storm_handler_ms", ms.iter().sum::<f64>() / rounds as f64);
    bench("storm_handler_ms_p50", pct(&mut ms, 0.5));
    drop(h);
    let _ = std::fs::remove_file(path);
}
