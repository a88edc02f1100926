//! `cxlkv-bench storm`: reserves that cannot be placed, over many locked
//! entries, while another client probes — the probes' p99 vs idle; and, with
//! a control sidecar the storm never calls, the same probe there, so that
//! what the storm's CPU does to any process on the host is told apart from
//! what the stormed sidecar adds.
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
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
        c.commit(proto::CommitRequest { reservation_ids: ids, crc32: vec![], keys: vec![] }).await.unwrap();
    }
}

/// One probe in µs: Stats, then a LookupAndLock of 32 absent keys (the mean
/// of the two calls).
async fn probe_once(c: &mut Client, keys: &[Bytes]) -> f64 {
    let t = Instant::now();
    c.stats(proto::StatsRequest {}).await.unwrap();
    let req = proto::LookupRequest { keys: keys.to_vec(), ..Default::default() };
    c.lookup_and_lock(req).await.unwrap();
    t.elapsed().as_secs_f64() * 1e6 / 2.0
}

/// p99 in µs of `n` probes of each client, taken in turn (both see the
/// same moments of the storm).
async fn probe(clients: &mut [Client], n: usize) -> Vec<f64> {
    let keys: Vec<Bytes> = (0..32).map(|i| Bytes::from(format!("absent{i}"))).collect();
    let mut us = vec![Vec::with_capacity(n); clients.len()];
    for _ in 0..n {
        for (c, u) in clients.iter_mut().zip(&mut us) {
            u.push(probe_once(c, &keys).await);
        }
    }
    us.iter_mut().map(|u| pct(u, 0.99)).collect()
}

/// The probing client: its own thread and runtime, as another process's
/// would be (a task on the storm's runtime would also wait behind the storm
/// client's own encoding). Probes idle, signals `idle_done`, waits for `go`,
/// probes during the storm.
fn prober(
    sockets: Vec<PathBuf>,
    probes: usize,
    idle_done: tokio::sync::oneshot::Sender<()>,
    go: std::sync::mpsc::Receiver<()>,
) -> std::thread::JoinHandle<(Vec<f64>, Vec<f64>, u64)> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let mut clients = vec![];
            for s in &sockets {
                clients.push(connect_uds(s).await.unwrap());
            }
            let idle = probe(&mut clients, probes).await;
            idle_done.send(()).unwrap();
            go.recv().unwrap();
            let during = probe(&mut clients, probes).await;
            let evictions = clients[0].stats(proto::StatsRequest {}).await.unwrap().into_inner().evictions;
            (idle, during, evictions)
        })
    })
}

/// One storm Reserve of `keys`: packed (the keys in one buffer), or one
/// ReserveItem message each.
fn storm_request(keys: Vec<Bytes>, size: u64, packed: bool) -> proto::ReserveRequest {
    if !packed {
        let items = keys.into_iter().map(|key| proto::ReserveItem { key, size, ..Default::default() }).collect();
        return proto::ReserveRequest { items, runs: true, ..Default::default() };
    }
    let (mut buf, mut lengths) = (Vec::new(), Vec::with_capacity(keys.len()));
    for k in keys {
        buf.extend_from_slice(&k);
        lengths.push(k.len() as u32);
    }
    let (packed_keys, sizes) = (Bytes::from(buf), vec![size]);
    proto::ReserveRequest { packed_keys, key_lengths: lengths, sizes, runs: true, ..Default::default() }
}

/// Batches of 4096 region-sized items that can never be placed, until
/// `stop`; (reserves, mean ms each: from the keys to the reply, the
/// request's making and encoding included). Refusals come back as runs.
/// One placed means the pool had room (a region without a lock): the
/// figures would be of another workload, so the run stops there.
async fn storm_loop(mut c: Client, size: u64, packed: bool, stop: Arc<AtomicBool>) -> (u64, f64) {
    let (mut n, mut ms, mut round) = (0u64, 0f64, 0usize);
    while !stop.load(Ordering::Relaxed) {
        let keys = (0..4096).map(|i| Bytes::from(format!("s{round}-{i}"))).collect();
        let t = Instant::now();
        let req = storm_request(keys, size, packed);
        let rep = c.reserve(req).await.unwrap().into_inner();
        ms += t.elapsed().as_secs_f64() * 1e3;
        n += 1;
        round += 1;
        let ids: Vec<u64> = rep
            .reservations
            .iter()
            .filter(|r| r.status.as_ref().unwrap().code == 0)
            .map(|r| r.reservation_id)
            .collect();
        assert!(ids.is_empty(), "a storm reserve was placed: some region of the pool keeps no lock");
    }
    (n, ms / n.max(1) as f64)
}

/// Where the storm runs: the stormed sidecar, a control sidecar it never
/// calls, another node of the same pool whose region is made to keep a lock.
pub struct Sockets {
    pub socket: PathBuf,
    pub control: Option<PathBuf>,
    pub hold: Option<PathBuf>,
}

/// What the storm is: entries locked and free, probes per phase, packed
/// keys or ReserveItems, and the suffix of its figures' names.
pub struct Storm {
    pub locked: usize,
    pub free: usize,
    pub probes: usize,
    pub packed: bool,
    pub suffix: String,
}

/// One entry stored and locked through `socket` (kept while the client is).
async fn hold_one(socket: &Path) -> Client {
    let mut c = connect_uds(socket).await.unwrap();
    let page = c.pool_info(proto::PoolInfoRequest {}).await.unwrap().into_inner().page_size;
    fill_keys(&mut c, "held", 1, page).await;
    let req = proto::LookupRequest { keys: vec![Bytes::from("held0")], lock_ttl_ms: 600_000, ..Default::default() };
    let hit = c.lookup_and_lock(req).await.unwrap().into_inner();
    assert!(hit.results[0].found, "the held entry is locked");
    c
}

pub async fn storm(at: Sockets, s: Storm) {
    let Storm { locked, free, probes, packed, suffix } = s;
    let _held = match &at.hold {
        Some(h) => Some(hold_one(h).await),
        None => None,
    };
    let mut c = connect_uds(&at.socket).await.unwrap();
    let info = c.pool_info(proto::PoolInfoRequest {}).await.unwrap().into_inner();
    fill_keys(&mut c, "locked", locked, info.page_size).await;
    fill_keys(&mut c, "free", free, info.page_size).await;
    // Locked by another client (engines holding their hits), kept open
    // to the end: the storming one has all its pin room, so whatever its
    // reserves may evict, they evict (`storm_evictions`).
    let mut locker = connect_uds(&at.socket).await.unwrap();
    for start in (0..locked).step_by(4096) {
        let keys = (start..(start + 4096).min(locked)).map(|i| Bytes::from(format!("locked{i}"))).collect();
        let req = proto::LookupRequest { keys, lock_ttl_ms: 600_000, ..Default::default() };
        locker.lookup_and_lock(req).await.unwrap();
    }
    let (idle_tx, idle_rx) = tokio::sync::oneshot::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel();
    let probed = [Some(at.socket), at.control.clone()].into_iter().flatten().collect();
    let probing = prober(probed, probes, idle_tx, go_rx);
    idle_rx.await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let storm = tokio::spawn(storm_loop(c, info.max_object_size, packed, stop.clone()));
    go_tx.send(()).unwrap();
    let (idle, during, evictions) = tokio::task::spawn_blocking(move || probing.join().unwrap()).await.unwrap();
    stop.store(true, Ordering::Relaxed);
    let (reserves, reserve_ms) = storm.await.unwrap();
    let b = |name: &str, v: f64| bench(&format!("{name}{suffix}"), v);
    b("storm_reserves", reserves as f64);
    b("storm_reserve_ms", reserve_ms);
    b("storm_evictions", evictions as f64);
    drop(locker);
    b("probe_p99_us_idle", idle[0]);
    b("probe_p99_us_storm", during[0]);
    b("storm_probe_p99_ratio", during[0] / idle[0]);
    if at.control.is_some() {
        b("probe_p99_us_idle_control", idle[1]);
        b("probe_p99_us_storm_control", during[1]);
        b("storm_probe_p99_ratio_control", during[1] / idle[1]);
        b("storm_probe_p99_vs_control", during[0] / during[1]);
    }
}
