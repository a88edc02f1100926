//! Start the real `cxlkv` binary on a temporary shm-style pool and talk to it
//! (`inproc`: handlers in the test's own process instead).
#![allow(dead_code)]
pub mod certs;
pub mod inproc;
pub mod loopback;
mod reads;
mod sidecar;

pub use reads::*;
pub use sidecar::*;

use std::time::{Duration, Instant};

use bytes::Bytes;
use cxlkv::client::Client;
use cxlkv::proto;

pub const MIB: u64 = 1 << 20;

/// Poll `f` until it holds, failing the test once `within` has passed;
/// returns how long it took (failover tests report it).
pub async fn eventually(what: &str, within: Duration, mut f: impl AsyncFnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !f().await {
        assert!(t.elapsed() < within, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    t.elapsed()
}

/// A plain HTTP/1.1 GET; returns status line, headers and body.
pub fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut t = std::net::TcpStream::connect(addr).unwrap();
    write!(t, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    t.read_to_string(&mut out).unwrap();
    out
}

/// The value of one exported series (`name` or `name{labels}`, exactly as
/// exported) at the metrics listener `addr`; None if absent or unparsable.
pub fn metric<T: std::str::FromStr>(addr: &str, series: &str) -> Option<T> {
    let body = http_get(addr, "/metrics");
    body.lines().find_map(|l| {
        let (name, value) = l.rsplit_once(' ')?;
        if name == series {
            value.parse().ok()
        } else {
            None
        }
    })
}

pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn key(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

pub const OK: u32 = 0;
pub const NOT_FOUND: u32 = tonic::Code::NotFound as u32;
pub const ALREADY_EXISTS: u32 = tonic::Code::AlreadyExists as u32;
pub const RESOURCE_EXHAUSTED: u32 = tonic::Code::ResourceExhausted as u32;
pub const FAILED_PRECONDITION: u32 = tonic::Code::FailedPrecondition as u32;

/// Reserve, write through the mapping, commit: the fast store path.
pub async fn store(c: &mut Client, m: &mut PoolMap, tenant: &str, items: &[(&str, Vec<u8>)]) -> Vec<u32> {
    let req = proto::ReserveRequest {
        tenant: tenant.into(),
        items: items
            .iter()
            .map(|(k, v)| proto::ReserveItem { key: key(k), size: v.len() as u64, ..Default::default() })
            .collect(),
        ..Default::default()
    };
    let rep = c.reserve(req).await.unwrap().into_inner();
    let mut ids = vec![];
    let mut codes = vec![];
    for (r, (_, v)) in rep.reservations.iter().zip(items) {
        let code = r.status.as_ref().unwrap().code;
        codes.push(code);
        if code == OK {
            m.write(r.location.as_ref().unwrap(), v);
            ids.push(r.reservation_id);
        }
    }
    let cr = c
        .commit(proto::CommitRequest { reservation_ids: ids, crc32: vec![], keys: vec![] })
        .await
        .unwrap()
        .into_inner();
    assert!(cr.statuses.iter().all(|s| s.code == OK), "commit failed: {cr:?}");
    codes
}

pub async fn lookup(c: &mut Client, keys: &[&str]) -> Vec<Option<proto::Location>> {
    let rep = c
        .lookup_and_lock(proto::LookupRequest {
            keys: keys.iter().map(|k| key(k)).collect(),
            lock_ttl_ms: 0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    rep.results.into_iter().map(|r| r.found.then(|| r.location.unwrap())).collect()
}

pub async fn unlock(c: &mut Client, keys: &[&str]) -> Vec<u32> {
    let rep =
        c.unlock(proto::UnlockRequest { keys: keys.iter().map(|k| key(k)).collect() }).await.unwrap().into_inner();
    rep.statuses.iter().map(|s| s.code).collect()
}

pub async fn exists(c: &mut Client, keys: &[&str]) -> Vec<bool> {
    c.exists(proto::ExistsRequest { keys: keys.iter().map(|k| key(k)).collect() }).await.unwrap().into_inner().exists
}

pub async fn stats(c: &mut Client) -> proto::StatsReply {
    c.stats(proto::StatsRequest {}).await.unwrap().into_inner()
}

pub async fn inline_get(c: &mut Client, k: &str) -> Option<Vec<u8>> {
    use proto::inline_get_chunk::Part;
    let mut s = c.inline_get(proto::InlineGetRequest { key: key(k) }).await.unwrap().into_inner();
    let Some(Part::Header(h)) = s.message().await.unwrap().unwrap().part else { panic!("no header") };
    if !h.found {
        return None;
    }
    let mut out = vec![];
    while let Some(m) = s.message().await.unwrap() {
        let Some(Part::Data(d)) = m.part else { panic!("unexpected part") };
        out.extend_from_slice(&d);
    }
    assert_eq!(out.len() as u64, h.size);
    Some(out)
}

pub async fn inline_put(
    c: &mut Client,
    k: &str,
    declared: u64,
    chunks: Vec<Vec<u8>>,
) -> Result<proto::InlinePutReply, tonic::Status> {
    use proto::inline_put_chunk::Part;
    let mut msgs = vec![proto::InlinePutChunk {
        part: Some(Part::Header(proto::InlinePutHeader { key: key(k), tenant: "t".into(), size: declared })),
    }];
    msgs.extend(chunks.into_iter().map(|d| proto::InlinePutChunk { part: Some(Part::Data(d.into())) }));
    c.inline_put(tokio_stream::iter(msgs)).await.map(|r| r.into_inner())
}

// ---- Setup and calls shared by the single-sidecar tests -------------------

/// Sidecar "a" started with `extra` in a fresh temporary directory, a client
/// of it and the pool mapped: how most single-node tests begin. Bind the
/// directory too (`_dir`, not `_`): it must outlive the sidecar, and names
/// bound in one pattern drop in reverse order.
pub async fn one_sidecar(extra: &[&str]) -> (tempfile::TempDir, Sidecar, Client, PoolMap) {
    let dir = tempfile::tempdir().unwrap();
    let s = Sidecar::start(dir.path(), "a", extra);
    let mut c = s.client().await;
    let m = PoolMap::open(&mut c).await;
    (dir, s, c, m)
}

pub async fn pool_info(c: &mut Client) -> proto::PoolInfoReply {
    c.pool_info(proto::PoolInfoRequest {}).await.unwrap().into_inner()
}

pub async fn delete(c: &mut Client, keys: &[&str]) -> proto::DeleteReply {
    c.delete(proto::DeleteRequest { keys: keys.iter().map(|k| key(k)).collect() }).await.unwrap().into_inner()
}

/// The metrics a docs/METRICS.md table lists, as (name, type): the single
/// node's tables (before `## Cluster`) or, with `cluster`, the cluster's.
pub fn documented_metrics(cluster: bool) -> std::collections::BTreeSet<(String, String)> {
    let md = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/METRICS.md")).unwrap();
    let in_cluster = |l: &&str| !l.starts_with("## Cluster");
    let lines: Vec<&str> =
        if cluster { md.lines().skip_while(in_cluster).collect() } else { md.lines().take_while(in_cluster).collect() };
    lines
        .into_iter()
        .filter(|l| l.starts_with("| `cxlkv_"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            (cells[1].trim_matches('`').to_owned(), cells[2].to_owned())
        })
        .collect()
}

/// The (name, type) of every metric family in a `/metrics` body.
pub fn exported_metrics(body: &str) -> std::collections::BTreeSet<(String, String)> {
    body.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| {
            let mut p = l.split_whitespace();
            (p.next().unwrap().to_owned(), p.next().unwrap().to_owned())
        })
        .collect()
}

/// Milliseconds since the Unix epoch (as `expires_unix_ms`).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}
