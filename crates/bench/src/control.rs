//! `cxlkv-bench control`: the control path from Rust — PoolInfo and
//! batched LookupAndLock latency over UDS (and TCP), and key-lookups/s from
//! many clients.
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cxlkv::client::{connect_tcp, connect_uds, Client};
use cxlkv::proto;

use crate::figures::{bench, pct};
use crate::lookups::{self, keys, pick, populate};

async fn latency(c: &mut Client, ks: &[Bytes], batch: usize, iters: usize) -> (f64, f64) {
    let mut us = Vec::with_capacity(iters);
    for i in 0..iters + iters / 10 {
        let dt = lookups::timed(c, pick(ks, batch, i)).await;
        if i >= iters / 10 {
            us.push(dt); // the first 10% warm up
        }
    }
    (pct(&mut us, 0.5), pct(&mut us, 0.99))
}

pub async fn control_latency(socket: &Path, tcp: Option<&str>, batch: usize, iters: usize) {
    let mut c = connect_uds(socket).await.unwrap();
    let ks = keys(4096);
    populate(&mut c, &ks).await;
    let mut us = vec![];
    for _ in 0..iters.min(5000) {
        let t = Instant::now();
        c.pool_info(proto::PoolInfoRequest {}).await.unwrap();
        us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    bench("pool_info_p50_us_rust_uds", pct(&mut us, 0.5));
    bench("pool_info_p99_us_rust_uds", pct(&mut us, 0.99));
    let (p50, p99) = latency(&mut c, &ks, batch, iters).await;
    bench(&format!("lookup{batch}_p50_us_rust_uds"), p50);
    bench(&format!("lookup{batch}_p99_us_rust_uds"), p99);
    if let Some(addr) = tcp {
        let mut t = connect_tcp(addr).await.unwrap();
        let (p50, p99) = latency(&mut t, &ks, batch, iters).await;
        bench(&format!("lookup{batch}_p50_us_rust_tcp"), p50);
        bench(&format!("lookup{batch}_p99_us_rust_tcp"), p99);
    }
}

pub async fn control_throughput(socket: PathBuf, batch: usize, clients: Vec<usize>, secs: f64) {
    let ks = keys(4096);
    let mut best: f64 = 0.0;
    for n in clients {
        let deadline = Instant::now() + Duration::from_secs_f64(secs);
        let mut tasks = vec![];
        for w in 0..n {
            let (socket, ks) = (socket.clone(), ks.clone());
            tasks.push(tokio::spawn(async move {
                let mut c = connect_uds(&socket).await.unwrap();
                lookups::until(&mut c, &ks, batch, w * 1000, deadline).await
            }));
        }
        let t = Instant::now();
        let mut total = 0;
        for task in tasks {
            total += task.await.unwrap();
        }
        let rate = total as f64 / t.elapsed().as_secs_f64();
        best = best.max(rate);
        bench(&format!("key_lookups_per_s_c{n}"), rate);
    }
    bench("key_lookups_per_s", best);
}
