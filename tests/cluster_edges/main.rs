//! Issue 33, defects 4, 8, 9 and 11: edges of the three-node cluster (a the
//! primary, b and c followers, one pool on loopback) that a hostile or
//! unlucky operator reaches. Phase 3 handovers under reclaim churn never
//! leave a node unable to store (and a Reserve never fails as a whole call
//! with RESOURCE_EXHAUSTED); a second follower with a live node's name is
//! refused; batches the client API accepts pass through a follower; Unlock,
//! Commit and Abort answer the same codes through every node; and a flipped
//! region-table owner word naming a node that does not exist is repaired.
#[path = "../common/mod.rs"]
mod common;

mod batches;
mod codes;
mod handover;
mod names;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use cxlkv::client::Client;
use cxlkv::peer_proto as pp;
use cxlkv::proto;

/// Fast enough to notice a flapping node within a test, slow enough that a
/// loaded two-core host does not fence a healthy follower.
const TIMINGS: &str =
    "[cluster]\nheartbeat_ms = 100\nlease_ms = 1500\ndead_after_ms = 3000\nforward_timeout_ms = 2000\n";

/// A cluster node: sidecar `name` (socket, log) running as cluster node
/// `node_name`; `a` is the primary. Starts without waiting for readiness.
fn spawn_node(dir: &Path, name: &str, node_name: &str, peer: &str, pool: &str, extra: &[&str]) -> Sidecar {
    let args = cluster_args(dir, node_name, peer, TIMINGS, pool);
    Sidecar::start_unchecked(dir, name, &[&strs(&args)[..], extra].concat())
}

/// Sidecar `name` as cluster node `name`, ready.
fn node(dir: &Path, name: &str, peer: &str, pool: &str, extra: &[&str]) -> Sidecar {
    let mut s = spawn_node(dir, name, name, peer, pool, extra);
    s.wait_ready(Duration::from_secs(30));
    s
}

struct Cluster {
    peer: String,
    /// The primary's metrics listener.
    metrics: String,
    a: Sidecar,
    b: Sidecar,
    c: Sidecar,
}

fn cluster(dir: &Path, pool: &str) -> Cluster {
    let (peer, metrics) = (format!("127.0.0.1:{}", free_port()), format!("127.0.0.1:{}", free_port()));
    // The primary first: it formats the pool the followers then open.
    let a = node(dir, "a", &peer, pool, &["--metrics-addr", &metrics]);
    let b = node(dir, "b", &peer, pool, &[]);
    let c = node(dir, "c", &peer, pool, &[]);
    Cluster { peer, metrics, a, b, c }
}

/// A node's join request, as a follower sends it: with its reservation
/// timeout (the default, 10 s) as field 5 `reservation_timeout_ms` where the
/// proto has that field (decoded from the wire form: a proto without it
/// skips the field), so the request is the same before and after it exists.
fn join_req(name: &str, instance: u64, pool_uuid: &str) -> pp::JoinRequest {
    use prost::Message;
    let base = pp::JoinRequest { name: name.into(), instance, pool_uuid: pool_uuid.into(), ..Default::default() };
    let mut wire = base.encode_to_vec();
    wire.extend([5 << 3, 0x90, 0x4e]); // field 5, varint 10000
    pp::JoinRequest::decode(&wire[..]).unwrap()
}

fn status_code(s: &Option<proto::KeyStatus>) -> u32 {
    s.as_ref().map_or(OK, |s| s.code)
}

/// Look `keys` up through `c` (locking them), check every hit's bytes
/// (mapped read, version unchanged after the copy) against `expect`, unlock
/// the hits; returns the keys found.
async fn check_hits(c: &mut Client, m: &PoolMap, keys: &[(String, Vec<u8>)], via: &str) -> Vec<String> {
    let names: Vec<&str> = keys.iter().map(|(k, _)| k.as_str()).collect();
    let hits = lookup(c, &names).await;
    let mut found = vec![];
    for ((k, want), hit) in keys.iter().zip(hits) {
        let Some(l) = hit else { continue };
        let got = m.read(&l);
        assert_eq!(m.version(&l), l.version, "{k} through {via}: the object changed under its lock");
        assert!(got == *want, "{k} through {via}: another object's bytes");
        found.push(k.clone());
    }
    let refs: Vec<&str> = found.iter().map(String::as_str).collect();
    if !refs.is_empty() {
        assert!(unlock(c, &refs).await.iter().all(|s| *s == OK), "{via}: unlock of {refs:?}");
    }
    found
}
