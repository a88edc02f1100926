//! Three sidecar processes on one pool file, each with its own client
//! socket and peer port (loopback): node a is the primary, b and c follow.
//! Chunks stored through one node are hits through the others with the
//! same bytes, write-once holds pool-wide, pages freed elsewhere reach their
//! owner, a dead follower's locks go while its chunks stay readable, and a
//! stopped primary never hangs a follower's clients.
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use cxlkv::proto;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

const TIMINGS: &str = "[cluster]\nheartbeat_ms = 100\nlease_ms = 600\ndead_after_ms = 1000\nforward_timeout_ms = 500\n";

struct Cluster {
    peer: String,
    a: Sidecar,
    b: Sidecar,
    c: Sidecar,
}

fn node(dir: &Path, name: &str, peer: &str, primary: &str, extra: &[&str]) -> Sidecar {
    timed_node(dir, name, peer, primary, TIMINGS, extra)
}

fn timed_node(dir: &Path, name: &str, peer: &str, primary: &str, timings: &str, extra: &[&str]) -> Sidecar {
    let args = cluster_args(dir, name, if name == "a" { peer } else { primary }, timings, "16MiB");
    Sidecar::start(dir, name, &[&strs(&args)[..], extra].concat())
}

fn cluster(dir: &Path, b_extra: &[&str]) -> Cluster {
    timed_cluster(dir, TIMINGS, b_extra)
}

fn timed_cluster(dir: &Path, timings: &str, b_extra: &[&str]) -> Cluster {
    let peer = format!("127.0.0.1:{}", free_port());
    // The primary first: it formats the pool the followers then open.
    let a = timed_node(dir, "a", &peer, "", timings, &[]);
    let b = timed_node(dir, "b", "", &peer, timings, b_extra);
    let c = timed_node(dir, "c", "", &peer, timings, &[]);
    Cluster { peer, a, b, c }
}

/// `cxlkv status --json` of the node behind `socket`.
fn status_json(socket: &Path) -> serde_json::Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cxlkv"))
        .args(["status", "--json", "--socket", socket.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// name → alive, as a node's status shows the cluster.
fn alive(socket: &Path) -> Vec<(String, bool)> {
    let s = status_json(socket);
    s["cluster_nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| (n["name"].as_str().unwrap().to_owned(), n["alive"].as_bool().unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_chunk_stored_on_one_node_is_a_hit_on_every_other_with_identical_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let cl = cluster(dir.path(), &[]);
    let (mut b, mut c, mut a) = (cl.b.client().await, cl.c.client().await, cl.a.client().await);
    let (mut mb, mc) = (PoolMap::open(&mut b).await, PoolMap::open(&mut c).await);
    let data = pattern(7, 200_000);
    assert_eq!(store(&mut b, &mut mb, "t", &[("k1", data.clone())]).await, vec![OK]);

    let hit = lookup(&mut c, &["k1"]).await.remove(0).expect("a hit on another node");
    assert_eq!(mc.read(&hit), data, "bytes read on c are the bytes b stored");
    assert_eq!(inline_get(&mut c, "k1").await.as_deref(), Some(&data[..]), "inline read through a follower");
    assert_eq!(inline_get(&mut a, "k1").await.as_deref(), Some(&data[..]), "inline read through the primary");
    assert_eq!(exists(&mut a, &["k1", "nope"]).await, vec![true, false]);
    let info_b = b.pool_info(proto::PoolInfoRequest {}).await.unwrap().into_inner();
    let info_c = c.pool_info(proto::PoolInfoRequest {}).await.unwrap().into_inner();
    assert_ne!(info_b.node_id, info_c.node_id, "the primary gave each node its own id");
    let owner = stats(&mut a).await.regions.into_iter().find(|r| r.region == hit.region).unwrap().owner_node;
    assert_eq!(owner, info_b.node_id, "the bytes are in b's region");
}

/// A follower's store larger than the free room of its regions (an offload
/// batch several regions large) claims, through the primary, every region
/// it needs in that one Reserve, and another node reads all of it.
#[tokio::test(flavor = "multi_thread")]
async fn a_follower_batch_larger_than_a_region_claims_the_regions_it_needs() {
    let dir = tempfile::tempdir().unwrap();
    let cl = cluster(dir.path(), &[]);
    let (mut b, mut c) = (cl.b.client().await, cl.c.client().await);
    let (mut mb, mc) = (PoolMap::open(&mut b).await, PoolMap::open(&mut c).await);
    assert_eq!(stats(&mut b).await.owned_regions, 1);
    // 112 one-page chunks: a region holds 32 pages, so 4 regions (more than
    // the one claim and the one phase-3 take a Reserve used to be allowed).
    let items: Vec<(String, Vec<u8>)> = (0..112).map(|i| (format!("big{i}"), pattern(i, 60_000))).collect();
    let refs: Vec<(&str, Vec<u8>)> = items.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    assert_eq!(store(&mut b, &mut mb, "t", &refs).await, vec![OK; 112], "the whole batch placed");
    assert_eq!(stats(&mut b).await.owned_regions, 4);
    let names: Vec<&str> = items.iter().map(|(k, _)| k.as_str()).collect();
    for ((_, data), hit) in items.iter().zip(lookup(&mut c, &names).await) {
        assert_eq!(&mc.read(&hit.expect("a hit on c")), data);
    }
}

/// An inline put through a follower: its sidecar writes the bytes under a
/// reservation it owns (its own session, as the primary knows it) and
/// commits it; the chunk is then a hit everywhere.
#[tokio::test(flavor = "multi_thread")]
async fn an_inline_put_through_a_follower_commits_and_is_a_hit_on_the_other_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let cl = cluster(dir.path(), &[]);
    let (mut a, mut b, mut c) = (cl.a.client().await, cl.b.client().await, cl.c.client().await);
    let data = pattern(11, 150_000);
    let chunks = data.chunks(64 << 10).map(<[u8]>::to_vec).collect();
    let rep = inline_put(&mut b, "ib", data.len() as u64, chunks).await.unwrap();
    assert_eq!(rep.status.unwrap().code, OK, "the follower commits its own inline put");
    assert_eq!(inline_get(&mut c, "ib").await.as_deref(), Some(&data[..]), "through the other follower");
    assert_eq!(inline_get(&mut a, "ib").await.as_deref(), Some(&data[..]), "through the primary");
    let mc = PoolMap::open(&mut c).await;
    let hit = lookup(&mut c, &["ib"]).await.remove(0).expect("a mapped hit on c");
    assert_eq!(mc.read(&hit), data);
}

/// Forwarded calls are small request/reply pairs on one TCP connection: with
/// Nagle's algorithm on the primary's side each reply would wait for the
/// follower's delayed ACK (~40 ms on Linux). The median of a run of lookups
/// through a follower stays far below that (a few hundred µs in a release
/// build), so a generous bound is still a sharp test.
#[tokio::test(flavor = "multi_thread")]
async fn a_lookup_through_a_follower_never_waits_for_a_delayed_ack() {
    let dir = tempfile::tempdir().unwrap();
    let cl = cluster(dir.path(), &[]);
    let (mut b, mut c) = (cl.b.client().await, cl.c.client().await);
    let mut mb = PoolMap::open(&mut b).await;
    // A batch of 32 keys, as LMCache looks them up.
    let names: Vec<String> = (0..32).map(|i| format!("n{i}")).collect();
    let keys: Vec<&str> = names.iter().map(String::as_str).collect();
    let items: Vec<(&str, Vec<u8>)> = keys.iter().map(|k| (*k, pattern(12, 100))).collect();
    store(&mut b, &mut mb, "t", &items).await;
    let mut ms = vec![];
    for _ in 0..41 {
        let t = Instant::now();
        assert!(lookup(&mut c, &keys).await.iter().all(Option::is_some));
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        unlock(&mut c, &keys).await;
    }
    ms.sort_by(f64::total_cmp);
    assert!(ms[20] < 20.0, "median lookup through a follower took {:.1} ms: {ms:?}", ms[20]);
}

#[tokio::test(flavor = "multi_thread")]
async fn write_once_holds_across_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let cl = cluster(dir.path(), &[]);
    let (mut b, mut c) = (cl.b.client().await, cl.c.client().await);
    let mut mb = PoolMap::open(&mut b).await;
    store(&mut b, &mut mb, "t", &[("k", pattern(1, 5000))]).await;
    let reserve = |k: &str| proto::ReserveRequest {
        tenant: "t".into(),
        items: vec![proto::ReserveItem { key: key(k), size: 5000, ..Default::default() }],
        ..Default::default()
    };
    let r = c.reserve(reserve("k")).await.unwrap().into_inner();
    assert_eq!(r.reservations[0].status.as_ref().unwrap().code, ALREADY_EXISTS, "committed on b: c may not store it");
    // Being written on b: c may not reserve it either; b's commit wins.
    let rb = b.reserve(reserve("w")).await.unwrap().into_inner();
    assert_eq!(rb.reservations[0].status.as_ref().unwrap().code, OK);
    let rc = c.reserve(reserve("w")).await.unwrap().into_inner();
    assert_eq!(rc.reservations[0].status.as_ref().unwrap().code, ALREADY_EXISTS);
    let id = rb.reservations[0].reservation_id;
    // Another node's session cannot commit b's reservation.
    let stolen = c
        .commit(proto::CommitRequest { reservation_ids: vec![id], crc32: vec![], keys: vec![] })
        .await
        .unwrap()
        .into_inner();
    assert_ne!(stolen.statuses[0].code, OK);
    let ok = b
        .commit(proto::CommitRequest { reservation_ids: vec![id], crc32: vec![], keys: vec![] })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ok.statuses[0].code, OK);
    assert_eq!(exists(&mut c, &["w"]).await, vec![true]);
}

#[tokio::test(flavor = "multi_thread")]
async fn no_node_of_a_cluster_commits_under_another_key_and_each_refuses_one_whole() {
    let dir = tempfile::tempdir().unwrap();
    let cl = cluster(dir.path(), &[]);
    let (mut a, mut b) = (cl.a.client().await, cl.b.client().await);
    // Not the primary either: its abort of the lease would send its own node
    // a free notice, and the pages would be freed under the bound object.
    assert_eq!(pool_info(&mut a).await.commit_as_name_bytes, 0);
    assert_eq!(pool_info(&mut b).await.commit_as_name_bytes, 0);
    let req = proto::ReserveRequest {
        tenant: "t".into(),
        items: vec![proto::ReserveItem { key: key("on-a"), size: 5000, ..Default::default() }],
        ..Default::default()
    };
    let r = a.reserve(req).await.unwrap().into_inner().reservations[0].clone();
    let keyed = proto::CommitRequest { reservation_ids: vec![r.reservation_id], crc32: vec![], keys: vec![key("k-a")] };
    assert_eq!(a.commit(keyed).await.unwrap_err().code(), tonic::Code::FailedPrecondition);
    let req = proto::ReserveRequest {
        tenant: "t".into(),
        items: vec![proto::ReserveItem { key: key("lease"), size: 5000, ..Default::default() }],
        ..Default::default()
    };
    let r = b.reserve(req).await.unwrap().into_inner().reservations[0].clone();
    let keyed = proto::CommitRequest { reservation_ids: vec![r.reservation_id], crc32: vec![], keys: vec![key("k")] };
    assert_eq!(b.commit(keyed).await.unwrap_err().code(), tonic::Code::FailedPrecondition);
    // Nothing applied: the reservation commits as reserved.
    let plain = proto::CommitRequest { reservation_ids: vec![r.reservation_id], crc32: vec![], keys: vec![] };
    assert_eq!(b.commit(plain).await.unwrap().into_inner().statuses[0].code, OK);
    assert_eq!(exists(&mut a, &["lease", "k"]).await, vec![true, false]);
}

#[tokio::test(flavor = "multi_thread")]
async fn deleting_a_key_through_another_node_frees_the_owners_pages() {
    let dir = tempfile::tempdir().unwrap();
    let cl = cluster(dir.path(), &[]);
    let (mut b, mut c) = (cl.b.client().await, cl.c.client().await);
    let mut mb = PoolMap::open(&mut b).await;
    store(&mut b, &mut mb, "t", &[("warm", pattern(2, 1000))]).await; // b claims its region
    let free0 = stats(&mut b).await.pages_free;
    store(&mut b, &mut mb, "t", &[("big", pattern(3, 300_000))]).await;
    let free1 = stats(&mut b).await.pages_free;
    assert_eq!(free0 - free1, 5, "300 kB take 5 pages of 64 KiB on b");
    let d = c.delete(proto::DeleteRequest { keys: vec![key("big")] }).await.unwrap().into_inner();
    assert_eq!(d.statuses[0].code, OK);
    // The free notice reaches b with its next heartbeats.
    eventually("b gets its pages back", Duration::from_secs(10), async || stats(&mut b).await.pages_free == free0)
        .await;
    assert_eq!(lookup(&mut b, &["big"]).await, vec![None]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_follower_loses_its_locks_and_its_chunks_stay_readable() {
    let dir = tempfile::tempdir().unwrap();
    let mut cl = cluster(dir.path(), &[]);
    let (mut a, mut b, mut c) = (cl.a.client().await, cl.b.client().await, cl.c.client().await);
    let mut mb = PoolMap::open(&mut b).await;
    let data = pattern(4, 70_000);
    store(&mut b, &mut mb, "t", &[("kept", data.clone())]).await;
    assert!(lookup(&mut b, &["kept"]).await[0].is_some());
    assert_eq!(stats(&mut a).await.locked_keys, 1, "b's client holds a lock");
    cl.b.child.as_mut().unwrap().kill().unwrap(); // SIGKILL
    cl.b.child.take().unwrap().wait().unwrap();
    eventually("b's lock is released", Duration::from_secs(10), async || stats(&mut a).await.locked_keys == 0).await;
    assert!(cl.a.logs().contains("node declared dead"));
    // `cxlkv status` through the surviving follower shows the cluster.
    assert_eq!(status_json(&cl.c.socket)["cluster_role"], "follower");
    let mut nodes = alive(&cl.c.socket);
    nodes.sort();
    assert_eq!(nodes, vec![("a".into(), true), ("b".into(), false), ("c".into(), true)]);
    let mc = PoolMap::open(&mut c).await;
    let hit = lookup(&mut c, &["kept"]).await.remove(0).expect("the dead node's chunk is still a hit");
    assert_eq!(mc.read(&hit), data);
    // A Delete is no longer refused by the dead client's lock.
    unlock(&mut c, &["kept"]).await;
    let d = c.delete(proto::DeleteRequest { keys: vec![key("kept")] }).await.unwrap().into_inner();
    assert_eq!(d.statuses[0].code, OK);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_follower_keeps_its_chunks_and_frees_what_it_missed() {
    let dir = tempfile::tempdir().unwrap();
    let mut cl = cluster(dir.path(), &[]);
    let (mut b, mut c) = (cl.b.client().await, cl.c.client().await);
    let mut mb = PoolMap::open(&mut b).await;
    let data = pattern(5, 100_000);
    store(&mut b, &mut mb, "t", &[("stays", data.clone()), ("goes", pattern(6, 100_000))]).await;
    cl.b.child.as_mut().unwrap().kill().unwrap();
    cl.b.child.take().unwrap().wait().unwrap();
    // Deleted while b is down: b never hears the notice.
    let d = c.delete(proto::DeleteRequest { keys: vec![key("goes")] }).await.unwrap().into_inner();
    assert_eq!(d.statuses[0].code, OK);
    drop(b);
    // Restart b with the arguments it had.
    let cfg = dir.path().join("cluster.toml");
    let (cfg, peer) = (cfg.to_str().unwrap(), cl.peer.clone());
    cl.b.spawn(&[
        "--config",
        cfg,
        "--node-name",
        "b",
        "--primary",
        "a",
        "--pool-size",
        "16MiB",
        "--primary-addr",
        &peer,
    ]);
    let mut b = cl.b.client().await;
    let mb = PoolMap::open(&mut b).await;
    let hit = lookup(&mut b, &["stays"]).await.remove(0).expect("b's chunk survived its restart");
    assert_eq!(mb.read(&hit), data);
    let s = stats(&mut b).await;
    assert_eq!(s.pages_total - s.pages_free, 2, "only the live chunk's pages stay used on b: {s:?}");
}

/// A follower's lookup that reaches the primary only after the follower
/// stopped waiting for it (the primary was stopped while it sat in its
/// socket) is not applied: it would leave the follower's node a lock its
/// holds never learn of, in force for the whole hold (60 s and more), which
/// no delete, eviction or phase 3 could get past meanwhile.
#[tokio::test(flavor = "multi_thread")]
async fn a_lookup_the_primary_gets_after_the_follower_gave_up_locks_nothing() {
    // Stopped longer than a forwarded call waits, well short of the
    // follower's lease and of its being declared dead (which would release
    // the node's locks whatever became of the lookup).
    const SLOW: &str =
        "[cluster]\nheartbeat_ms = 100\nlease_ms = 3000\ndead_after_ms = 6000\nforward_timeout_ms = 300\n";
    let dir = tempfile::tempdir().unwrap();
    let cl = timed_cluster(dir.path(), SLOW, &[]);
    let (mut a, mut c) = (cl.a.client().await, cl.c.client().await);
    let mut mc = PoolMap::open(&mut c).await;
    assert_eq!(store(&mut c, &mut mc, "t", &[("k", pattern(9, 4096))]).await, vec![OK]);
    // A heartbeat of c's since it joined (300 ms ago at least) has told the
    // primary c's clock.
    tokio::time::sleep(Duration::from_millis(300)).await;
    eventually("a heartbeat of c's", Duration::from_secs(10), async || {
        stats(&mut a).await.cluster_nodes.iter().any(|n| n.name == "c" && n.alive && n.silent_ms < 150)
    })
    .await;
    let pid = Pid::from_raw(cl.a.child.as_ref().unwrap().id() as i32);
    sigstop(pid.as_raw() as u32);
    let req = proto::LookupRequest { keys: vec![key("k")], lock_ttl_ms: 60_000, ..Default::default() };
    match c.lookup_and_lock(req).await {
        Ok(rep) => assert!(!rep.into_inner().results[0].found, "no answer from a stopped primary"),
        Err(s) => assert_eq!(s.code(), tonic::Code::Unavailable),
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    kill(pid, Signal::SIGCONT).unwrap();
    // The primary reads the lookup now, 600 ms and more after c gave up.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!cl.a.logs().contains("node declared dead"), "c stayed alive throughout");
    assert_eq!(stats(&mut a).await.locked_keys, 0, "the lookup c gave up on locked nothing");
    assert_eq!(delete(&mut a, &["k"]).await.statuses[0].code, OK);
    assert_eq!(exists(&mut c, &["k"]).await, vec![false]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_primary_never_hangs_a_follower_and_the_follower_fences_itself() {
    let dir = tempfile::tempdir().unwrap();
    let cl = cluster(dir.path(), &[]);
    let mut c = cl.c.client().await;
    let mut mc = PoolMap::open(&mut c).await;
    store(&mut c, &mut mc, "t", &[("k", pattern(8, 4096))]).await;
    let pid = Pid::from_raw(cl.a.child.as_ref().unwrap().id() as i32);
    sigstop(pid.as_raw() as u32);
    // A lookup through c while the primary does not answer: it returns (a
    // miss or UNAVAILABLE), bounded by the forward timeout, never hangs.
    let t = Instant::now();
    let r = c.lookup_and_lock(proto::LookupRequest { keys: vec![key("k")], ..Default::default() }).await;
    let waited = t.elapsed();
    match r {
        Ok(rep) => assert!(!rep.into_inner().results[0].found),
        Err(s) => assert_eq!(s.code(), tonic::Code::Unavailable),
    }
    assert!(waited < Duration::from_secs(5), "a follower's lookup waited {waited:?} for a stopped primary");
    // Past its lease c stops writing: a reserve fails at once.
    tokio::time::sleep(Duration::from_millis(900)).await;
    let t = Instant::now();
    let r = c
        .reserve(proto::ReserveRequest {
            tenant: "t".into(),
            items: vec![proto::ReserveItem { key: key("new"), size: 10, ..Default::default() }],
            ..Default::default()
        })
        .await;
    assert_eq!(r.unwrap_err().code(), tonic::Code::Unavailable, "a fenced follower refuses writes");
    assert!(t.elapsed() < Duration::from_millis(400), "and refuses them without waiting for the primary");
    kill(pid, Signal::SIGCONT).unwrap();
    // Back: c's lease is renewed and its chunk is a hit again.
    eventually("c recovers after the primary came back", Duration::from_secs(10), async || {
        lookup(&mut c, &["k"]).await[0].is_some()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_node_evicts_its_own_entries_only() {
    let dir = tempfile::tempdir().unwrap();
    let maddr = format!("127.0.0.1:{}", free_port());
    // LRU at the primary, which picks the victims: the test names which of
    // b's entries go first.
    let peer = format!("127.0.0.1:{}", free_port());
    let a = node(dir.path(), "a", &peer, "", &["--eviction-policy", "lru"]);
    let b = node(dir.path(), "b", "", &peer, &["--max-regions", "1", "--metrics-addr", &maddr]);
    let c = node(dir.path(), "c", "", &peer, &[]);
    let cl = Cluster { peer, a, b, c };
    let (mut b, mut c) = (cl.b.client().await, cl.c.client().await);
    let (mut mb, mut mc) = (PoolMap::open(&mut b).await, PoolMap::open(&mut c).await);
    store(&mut c, &mut mc, "t", &[("c-key", pattern(9, 60_000))]).await;
    // b's one region holds 32 pages: 40 one-page chunks force evictions.
    for i in 0..40 {
        let codes = store(&mut b, &mut mb, "t", &[(&format!("b{i}"), pattern(i, 60_000))]).await;
        assert_eq!(codes, vec![OK], "store {i} on a full node evicts instead of failing");
    }
    // On the full node every store is still one forwarded op per client
    // RPC (Reserve, Commit): eviction rides on the reserve, ahead of need.
    let ops = || metric::<u64>(&maddr, "cxlkv_cluster_forwarded_ops_total").unwrap();
    let before = ops();
    for i in 40..50 {
        assert_eq!(store(&mut b, &mut mb, "t", &[(&format!("b{i}"), pattern(i, 60_000))]).await, vec![OK]);
    }
    assert_eq!(ops() - before, 20, "10 stores on a full follower: 10 reserves and 10 commits forwarded");
    let s = stats(&mut b).await;
    assert_eq!(s.owned_regions, 1);
    assert!(s.evictions >= 8, "{s:?}");
    assert_eq!(exists(&mut b, &["c-key"]).await, vec![true], "another node's entry is never a victim");
    assert_eq!(exists(&mut b, &["b0", "b49"]).await, vec![false, true], "b's oldest went first");
}

/// A Reserve a full follower cannot place asks the primary only what could
/// make room: to empty one of its regions for the object. A batch with
/// nothing placed and nothing to evict is no forwarded call (a storm of such
/// reserves made one each, a round trip to the primary per Reserve).
#[tokio::test(flavor = "multi_thread")]
async fn a_reserve_a_full_follower_cannot_place_forwards_only_what_could_make_room() {
    let dir = tempfile::tempdir().unwrap();
    let (peer, maddr) = (format!("127.0.0.1:{}", free_port()), format!("127.0.0.1:{}", free_port()));
    let _a = node(dir.path(), "a", &peer, "", &[]);
    let b = node(dir.path(), "b", "", &peer, &["--max-regions", "1", "--metrics-addr", &maddr]);
    let mut c = b.client().await;
    let mut m = PoolMap::open(&mut c).await;
    // b's one region keeps a locked chunk: no object of a region's size fits
    // there, and emptying the region for it is refused.
    assert_eq!(store(&mut c, &mut m, "t", &[("held", pattern(1, 60_000))]).await, vec![OK]);
    assert!(lookup(&mut c, &["held"]).await[0].is_some());
    let size = pool_info(&mut c).await.max_object_size;
    let ops = || metric::<u64>(&maddr, "cxlkv_cluster_forwarded_ops_total").unwrap();
    let before = ops();
    let item = proto::ReserveItem { key: key("big"), size, ..Default::default() };
    let req = proto::ReserveRequest { tenant: "t".into(), items: vec![item], ..Default::default() };
    let rep = c.reserve(req).await.unwrap().into_inner();
    let code = rep.reservations[0].status.as_ref().unwrap().code;
    assert_eq!(code, tonic::Code::ResourceExhausted as u32, "{rep:?}");
    assert_eq!(ops() - before, 1, "one forwarded op: the region emptied for the object, refused");
    assert_eq!(exists(&mut c, &["held"]).await, vec![true], "the locked chunk stays");
}

fn exported(addr: &str) -> std::collections::BTreeSet<(String, String)> {
    exported_metrics(&http_get(addr, "/metrics"))
        .into_iter()
        .filter(|(n, _)| n.starts_with("cxlkv_cluster_") && n != "cxlkv_cluster_role")
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn cluster_metrics_match_their_documentation() {
    let dir = tempfile::tempdir().unwrap();
    let peer = format!("127.0.0.1:{}", free_port());
    let (ma, mc) = (format!("127.0.0.1:{}", free_port()), format!("127.0.0.1:{}", free_port()));
    let a = node(dir.path(), "a", &peer, "", &["--metrics-addr", &ma]);
    let b = node(dir.path(), "b", "", &peer, &[]);
    let c = node(dir.path(), "c", "", &peer, &["--metrics-addr", &mc]);
    let (mut cb, mut cc) = (b.client().await, c.client().await);
    let mut mb = PoolMap::open(&mut cb).await;
    store(&mut cb, &mut mb, "t", &[("x", pattern(1, 1000))]).await;
    assert!(lookup(&mut cc, &["x"]).await[0].is_some(), "a cross-node hit on c");
    // Read again through c: answered from c's hold, not forwarded.
    let forwarded = || http_get(&mc, "/metrics").lines().any(|l| l == "cxlkv_cluster_forwarded_ops_total 1");
    assert!(forwarded(), "the first lookup was forwarded");
    assert!(lookup(&mut cc, &["x"]).await[0].is_some());
    assert!(forwarded(), "the second was not");
    assert!(http_get(&mc, "/metrics").lines().any(|l| l == "cxlkv_cluster_held_lookups_total 1"));
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(http_get(&mc, "/metrics").contains("cxlkv_cluster_role{role=\"follower\"} 1"));
    assert!(http_get(&ma, "/metrics").contains("cxlkv_cluster_role{role=\"primary\"} 1"));
    assert!(http_get(&ma, "/metrics").contains("cxlkv_cluster_peers_alive 2"));
    // The primary's status shows what each follower holds.
    let nodes = status_json(&a.socket)["cluster_nodes"].as_array().unwrap().clone();
    let held = |name: &str| nodes.iter().find(|n| n["name"] == name).unwrap()["held_keys"].as_u64().unwrap();
    assert_eq!((held("b"), held("c")), (0, 1), "{nodes:?}");
    let got: std::collections::BTreeSet<_> = exported(&ma).union(&exported(&mc)).cloned().collect();
    assert_eq!(got, documented_metrics(true), "docs/METRICS.md's cluster table and the exported metrics differ");
    drop(a);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_producer_node_that_shuts_down_leaves_its_chunks_readable_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let mut cl = cluster(dir.path(), &[]);
    let (mut b, mut c) = (cl.b.client().await, cl.c.client().await);
    let mut mb = PoolMap::open(&mut b).await;
    let items: Vec<(String, Vec<u8>)> = (0..8).map(|i| (format!("p{i}"), pattern(100 + i, 90_000))).collect();
    let refs: Vec<(&str, Vec<u8>)> = items.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    assert!(store(&mut b, &mut mb, "t", &refs).await.iter().all(|c| *c == OK));
    drop(b);
    let (status, _) = cl.b.stop(); // SIGTERM: the node drains and leaves
    assert!(status.success());
    let mc = PoolMap::open(&mut c).await;
    for (k, v) in &items {
        let hit = lookup(&mut c, &[k]).await.remove(0).unwrap_or_else(|| panic!("{k} is gone with its producer"));
        assert_eq!(&mc.read(&hit), v, "{k}: other bytes than the producer stored");
        assert_eq!(inline_get(&mut c, k).await.as_ref(), Some(v));
    }
}

/// A follower whose primary stopped answering fails a Reserve it cannot
/// place with the primary's error per item, after one forward timeout: the
/// phase-3 claim is not asked once emptying a region went unanswered (it
/// could wait a second timeout, and then failed the call whole).
#[tokio::test(flavor = "multi_thread")]
async fn a_reserve_a_follower_cannot_place_fails_within_one_forward_timeout_of_a_stopped_primary() {
    let dir = tempfile::tempdir().unwrap();
    let peer = format!("127.0.0.1:{}", free_port());
    // The lease outlasts the call: b is not yet fenced, so it asks.
    let timings = "[cluster]\nheartbeat_ms = 1000\nlease_ms = 8000\ndead_after_ms = 12000\nforward_timeout_ms = 2000\n";
    let start = |name| Sidecar::start(dir.path(), name, &strs(&cluster_args(dir.path(), name, &peer, timings, "4MiB")));
    let (a, b) = (start("a"), start("b"));
    // Two regions, one each, and a chunk locked in each: no region is free
    // and none can be emptied.
    let mut held = vec![];
    for (n, s) in [("a", &a), ("b", &b)] {
        let mut c = s.client().await;
        let mut m = PoolMap::open(&mut c).await;
        assert_eq!(store(&mut c, &mut m, "t", &[(n, pattern(1, 60_000))]).await, vec![OK]);
        assert!(lookup(&mut c, &[n]).await[0].is_some());
        held.push(c); // its locks stay
    }
    let mut c = b.client().await;
    let size = pool_info(&mut c).await.max_object_size;
    sigstop(a.pid());
    let t = Instant::now();
    let item = proto::ReserveItem { key: key("big"), size, ..Default::default() };
    let req = proto::ReserveRequest { tenant: "t".into(), items: vec![item], ..Default::default() };
    let rep = c.reserve(req).await.expect("the call answers; the item carries the primary's error").into_inner();
    let waited = t.elapsed();
    let status = rep.reservations[0].status.clone().unwrap();
    assert_eq!(status.code, tonic::Code::Unavailable as u32, "{status:?}");
    assert!(status.message.contains("did not answer"), "not a fenced node's refusal: {status:?}");
    assert!(waited < Duration::from_secs(3), "one forward timeout (2 s), not two: {waited:?}");
    kill(Pid::from_raw(a.pid() as i32), Signal::SIGCONT).unwrap();
}
