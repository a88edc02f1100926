//! Phase 3 region reclaim with three sidecar processes on one pool of three
//! regions (one each): a node (a follower, or the primary for its own
//! clients) evicts its own entries while that is enough; once everything it
//! holds is locked, the primary takes back the region of another node (the
//! primary's included) with no lock in it, its entries leave with reason
//! `reclaimed`, the old owner stops writing there, locked entries are never
//! lost and every surviving key reads back with its own bytes.
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use cxlkv::client::Client;
use cxlkv::proto;

const TIMINGS: &str =
    "[cluster]\nheartbeat_ms = 100\nlease_ms = 1500\ndead_after_ms = 3000\nforward_timeout_ms = 2000\n";
/// Four 64 KiB pages: eight fill a 2 MiB region.
const OBJ: usize = 256 << 10;

fn node(dir: &Path, name: &str, peer: &str) -> Sidecar {
    Sidecar::start(dir, name, &strs(&cluster_args(dir, name, peer, TIMINGS, "6MiB")))
}

/// region → owner node id, from the primary's view of the region table.
async fn owners(c: &mut Client) -> Vec<Option<u32>> {
    stats(c).await.regions.iter().map(|r| (r.state == "owned").then_some(r.owner_node)).collect()
}

async fn removed(c: &mut Client) -> Vec<(String, String)> {
    let rep = c.removed(proto::RemovedRequest { since: 0, max: 0 }).await.unwrap().into_inner();
    rep.keys.into_iter().map(|k| (String::from_utf8(k.key.to_vec()).unwrap(), k.reason)).collect()
}

/// How long the cluster may take to settle after each step.
const SETTLE: Duration = Duration::from_secs(20);

/// Nodes a (the primary), b and c; a client of each; the pool mapped.
async fn start(dir: &Path) -> ((Sidecar, Sidecar, Sidecar), (Client, Client, Client), PoolMap) {
    let peer = format!("127.0.0.1:{}", free_port());
    let (a, b, c) = (node(dir, "a", &peer), node(dir, "b", &peer), node(dir, "c", &peer));
    let (mut ca, cb, cc) = (a.client().await, b.client().await, c.client().await);
    let m = PoolMap::open(&mut ca).await;
    ((a, b, c), (ca, cb, cc), m)
}

/// Store `k` through `c` and keep it locked: its region is never a victim.
async fn pin(c: &mut Client, m: &mut PoolMap, k: &str) {
    assert_eq!(store(c, m, "t", &[(k, pattern(999, OBJ))]).await, [OK], "{k}");
    assert!(lookup(c, &[k]).await[0].is_some(), "{k}");
}

fn node_id(nodes: &[proto::ClusterNode], name: &str) -> u32 {
    nodes.iter().find(|n| n.name == name).unwrap().node
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_node_takes_back_an_idle_region_only_when_its_own_eviction_cannot_help() {
    let dir = tempfile::tempdir().unwrap();
    let ((a, _b, _c), (mut ca, mut cb, mut cc), mut m) = start(dir.path()).await;
    eventually("b and c joined", SETTLE, async || stats(&mut ca).await.cluster_nodes.len() == 3).await;
    let nodes = stats(&mut ca).await.cluster_nodes;
    let (nb, nc) = (node_id(&nodes, "b"), node_id(&nodes, "c"));
    // Each node claims one region ahead of need: the pool has none left.
    eventually("every region is owned", SETTLE, async || owners(&mut ca).await.iter().all(Option::is_some)).await;
    let table = owners(&mut ca).await;
    assert_eq!(table.len(), 3, "the test wants three regions: {table:?}");
    let c_region = table.iter().position(|o| *o == Some(nc)).unwrap() as u32;
    // The primary's region holds a lock: c's is the only candidate.
    pin(&mut ca, &mut m, "a0").await;

    let cs: Vec<String> = (0..3).map(|i| format!("c{i}")).collect();
    for k in &cs {
        assert_eq!(store(&mut cc, &mut m, "t", &[(k, pattern(k.len() as u64 + 7, OBJ))]).await, [OK]);
    }

    // Phase 1 suffices: b overfills its region with unlocked entries and
    // evicts its own; c's region is left alone.
    for i in 0..12 {
        let k = format!("b{i}");
        assert_eq!(store(&mut cb, &mut m, "t", &[(&k, pattern(i, OBJ))]).await, [OK], "{k}");
    }
    let refs: Vec<&str> = cs.iter().map(String::as_str).collect();
    assert_eq!(exists(&mut ca, &refs).await, [true; 3]);
    let log = removed(&mut ca).await;
    assert!(!log.is_empty() && log.iter().all(|(k, r)| k.starts_with('b') && r == "evicted"), "{log:?}");

    // Now every entry b holds is locked (by b's client); further stores
    // cannot evict anything of b's: phase 3 takes c's region (the only one
    // of another node with no lock in it).
    let mut kept: Vec<(String, u64)> = vec![];
    for i in 0..12u64 {
        let k = format!("b{i}");
        if lookup(&mut cb, &[&k]).await[0].is_some() {
            kept.push((k, i));
        }
    }
    assert!(store_until_taken(&mut cb, &mut m, "b", &refs, &mut kept, &a).await, "c's region was never taken back");

    // c's entries left with reason `reclaimed`, and only they did.
    let log = removed(&mut ca).await;
    assert_eq!(reclaimed(&log), refs, "{log:?}");
    assert!(log.iter().all(|(k, r)| r != "evicted" || k.starts_with('b')));
    // The region is b's now, with a new generation; c holds none.
    let table = owners(&mut ca).await;
    assert_eq!(table[c_region as usize], Some(nb));
    eventually("c gave the region up", SETTLE, async || stats(&mut cc).await.owned_regions == 0).await;
    // Every key is a miss on every node, never another key's bytes.
    for cl in [&mut ca, &mut cb, &mut cc] {
        assert_eq!(lookup(cl, &refs).await, [None, None, None]);
    }
    // Every locked key of b survived, with its own bytes, read through c.
    for (k, seed) in &kept {
        let l = lookup(&mut cc, &[k]).await[0].unwrap_or_else(|| panic!("{k} lost"));
        assert_eq!(m.read(&l), pattern(*seed, OBJ), "{k}");
    }

    // c now has no region; every region of another node holds locks: its
    // store fails cleanly and nothing is taken.
    let codes = store(&mut cc, &mut m, "t", &[("c9", pattern(9, OBJ))]).await;
    assert_eq!(codes, [RESOURCE_EXHAUSTED]);
    assert_eq!(removed(&mut ca).await.len(), log.len());
    assert!(exists(&mut ca, &["c9"]).await == [false]);
}

/// Fill b's only region with entries b keeps locked.
async fn fill_locked(cb: &mut Client, m: &mut PoolMap) -> Vec<(String, u64)> {
    let mut kept = vec![];
    for i in 0..8u64 {
        let k = format!("b{i}");
        assert_eq!(store(cb, m, "t", &[(&k, pattern(i, OBJ))]).await, [OK], "{k}");
        assert!(lookup(cb, &[&k]).await[0].is_some());
        kept.push((k, i));
    }
    kept
}

#[tokio::test(flavor = "multi_thread")]
async fn a_silent_owner_fails_the_request_fast_and_its_region_moves_once_it_is_declared_dead() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let dir = tempfile::tempdir().unwrap();
    let ((_a, _b, c), (mut ca, mut cb, mut cc), mut m) = start(dir.path()).await;
    eventually("every region is owned", SETTLE, async || owners(&mut ca).await.iter().all(Option::is_some)).await;
    pin(&mut ca, &mut m, "a0").await;
    assert_eq!(store(&mut cc, &mut m, "t", &[("c0", pattern(50, OBJ))]).await, [OK]);
    let kept = fill_locked(&mut cb, &mut m).await;

    // c stops answering: the reclaim of its region waits for an
    // acknowledgement that never comes, and b's store ends well within its
    // deadline (the primary waits 3/4 of forward_timeout_ms = 1.5 s).
    let pid = Pid::from_raw(c.child.as_ref().unwrap().id() as i32);
    sigstop(pid.as_raw() as u32);
    let t = Instant::now();
    let codes = store(&mut cb, &mut m, "t", &[("b100", pattern(100, OBJ))]).await;
    let took = t.elapsed();
    assert_eq!(codes, [RESOURCE_EXHAUSTED]);
    assert!(took < Duration::from_secs(5), "{took:?}");
    // Its entries are gone already: nobody can lock them any more.
    assert_eq!(lookup(&mut ca, &["c0"]).await, [None]);

    // Once c is declared dead the region is freed; b's next store takes it.
    eventually("the region moved", SETTLE, async || {
        store(&mut cb, &mut m, "t", &[("b101", pattern(101, OBJ))]).await == [OK]
    })
    .await;
    let l = lookup(&mut ca, &["b101"]).await[0].unwrap();
    assert_eq!(m.read(&l), pattern(101, OBJ));
    for (k, seed) in &kept {
        let l = lookup(&mut ca, &[k]).await[0].unwrap_or_else(|| panic!("{k} lost"));
        assert_eq!(m.read(&l), pattern(*seed, OBJ), "{k}");
    }

    // c resumes: it was buried, joins again without the region, and its
    // stores never land in b's pages.
    kill(pid, Signal::SIGCONT).unwrap();
    eventually("c joined again", SETTLE, async || {
        stats(&mut ca).await.cluster_nodes.iter().any(|n| n.name == "c" && n.alive)
    })
    .await;
    // Asked of c itself, which may still be finishing its join: a call it
    // forwards under its old registration meanwhile is refused
    // (UNAVAILABLE, "join again"), as it should be; asked again.
    eventually("c holds no region", SETTLE, async || {
        cc.stats(proto::StatsRequest {}).await.is_ok_and(|r| r.into_inner().owned_regions == 0)
    })
    .await;
    let codes = store(&mut cc, &mut m, "t", &[("c1", pattern(51, OBJ))]).await;
    assert_eq!(codes, [RESOURCE_EXHAUSTED]);
    let l = lookup(&mut ca, &["b101"]).await[0].unwrap();
    assert_eq!(m.read(&l), pattern(101, OBJ));
}

/// Store `{prefix}100..111` through `c`, each locked by a lookup and added
/// to `kept`, until none of `refs` exists any more (phase 3 took their
/// region): true then, false if it never happened.
async fn store_until_taken(
    c: &mut Client,
    m: &mut PoolMap,
    prefix: &str,
    refs: &[&str],
    kept: &mut Vec<(String, u64)>,
    primary: &Sidecar,
) -> bool {
    for i in 100..112u64 {
        let k = format!("{prefix}{i}");
        assert_eq!(store(c, m, "t", &[(&k, pattern(i, OBJ))]).await, [OK], "{k}:\n{}", primary.logs());
        assert!(lookup(c, &[&k]).await[0].is_some());
        kept.push((k, i));
        if !exists(c, refs).await.contains(&true) {
            return true;
        }
    }
    false
}

/// The keys the removal log says left with reason `reclaimed`, sorted.
fn reclaimed(log: &[(String, String)]) -> Vec<&str> {
    let mut gone: Vec<&str> = log.iter().filter(|(_, r)| r == "reclaimed").map(|(k, _)| k.as_str()).collect();
    gone.sort();
    gone
}

/// Once b and c joined and every region is owned: the region index owned
/// by `idle`, and the node ids of `idle` and of the primary a.
async fn settled(ca: &mut Client, idle: &str) -> (usize, u32, u32) {
    eventually("b and c joined", SETTLE, async || stats(ca).await.cluster_nodes.len() == 3).await;
    let nodes = stats(ca).await.cluster_nodes;
    let (na, ni) = (node_id(&nodes, "a"), node_id(&nodes, idle));
    eventually("every region is owned", SETTLE, async || owners(ca).await.iter().all(Option::is_some)).await;
    let region = owners(ca).await.iter().position(|o| *o == Some(ni)).unwrap();
    (region, ni, na)
}

/// Three unlocked keys `{prefix}0..2` stored through `c` (into its node's region).
async fn three_keys(c: &mut Client, m: &mut PoolMap, prefix: &str) -> Vec<String> {
    let keys: Vec<String> = (0..3).map(|i| format!("{prefix}{i}")).collect();
    for k in &keys {
        assert_eq!(store(c, m, "t", &[(k, pattern(k.len() as u64 + 7, OBJ))]).await, [OK]);
    }
    keys
}

#[tokio::test(flavor = "multi_thread")]
async fn the_primarys_own_store_takes_back_an_idle_region_only_when_its_own_eviction_cannot_help() {
    let dir = tempfile::tempdir().unwrap();
    let ((a, _b, _c), (mut ca, mut cb, mut cc), mut m) = start(dir.path()).await;
    let (c_region, nc, na) = settled(&mut ca, "c").await;
    // b's region holds a lock; c's is idle.
    pin(&mut cb, &mut m, "bpin").await;
    let cs = three_keys(&mut cc, &mut m, "c").await;
    let refs: Vec<&str> = cs.iter().map(String::as_str).collect();

    // Phase 1 suffices: the primary overfills its region with unlocked
    // entries of its own clients and evicts its own; c's region stays c's.
    for i in 0..12 {
        let k = format!("a{i}");
        assert_eq!(store(&mut ca, &mut m, "t", &[(&k, pattern(i, OBJ))]).await, [OK], "{k}");
    }
    assert_eq!(exists(&mut ca, &refs).await, [true; 3]);
    let log = removed(&mut ca).await;
    assert!(!log.is_empty() && log.iter().all(|(k, r)| k.starts_with('a') && r == "evicted"), "{log:?}");
    assert_eq!(owners(&mut ca).await[c_region], Some(nc));

    // Every entry of the primary's is locked now: its next stores can
    // evict nothing of its own, so phase 3 takes c's idle region.
    let mut kept: Vec<(String, u64)> = vec![];
    for i in 0..12u64 {
        let k = format!("a{i}");
        if lookup(&mut ca, &[&k]).await[0].is_some() {
            kept.push((k, i));
        }
    }
    assert!(store_until_taken(&mut ca, &mut m, "a", &refs, &mut kept, &a).await, "c's region was never taken back");

    // c's entries, and only they, left with reason `reclaimed`.
    let log = removed(&mut ca).await;
    assert_eq!(reclaimed(&log), refs, "{log:?}");
    assert_eq!(owners(&mut ca).await[c_region], Some(na));
    eventually("c gave the region up", SETTLE, async || stats(&mut cc).await.owned_regions == 0).await;
    for cl in [&mut ca, &mut cb, &mut cc] {
        assert_eq!(lookup(cl, &refs).await, [None, None, None]);
    }
    // Every locked key of the primary's reads back with its own bytes.
    for (k, seed) in &kept {
        let l = lookup(&mut cb, &[k]).await[0].unwrap_or_else(|| panic!("{k} lost"));
        assert_eq!(m.read(&l), pattern(*seed, OBJ), "{k}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_followers_store_takes_back_the_primarys_idle_region_which_it_gives_up_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let ((a, _b, _c), (mut ca, mut cb, mut cc), mut m) = start(dir.path()).await;
    let (a_region, _, _) = settled(&mut ca, "a").await;
    let nb = node_id(&stats(&mut ca).await.cluster_nodes, "b");
    // c's region holds a lock; the primary's is idle.
    pin(&mut cc, &mut m, "cpin").await;
    let us = three_keys(&mut ca, &mut m, "a").await;
    let refs: Vec<&str> = us.iter().map(String::as_str).collect();
    let mut kept = fill_locked(&mut cb, &mut m).await;

    // b can evict nothing of its own: the primary's region is the victim,
    // given up in place (no heartbeat to wait for).
    assert_eq!(store(&mut cb, &mut m, "t", &[("b100", pattern(100, OBJ))]).await, [OK], "{}", a.logs());
    assert!(lookup(&mut cb, &["b100"]).await[0].is_some());
    kept.push(("b100".into(), 100));
    let log = removed(&mut ca).await;
    assert_eq!(reclaimed(&log), refs, "{log:?}");
    assert_eq!(owners(&mut ca).await[a_region], Some(nb));
    assert_eq!(stats(&mut ca).await.owned_regions, 0);
    for cl in [&mut ca, &mut cb, &mut cc] {
        assert_eq!(lookup(cl, &refs).await, [None, None, None]);
    }

    // The primary holds no region and every other one holds locks: its
    // store fails cleanly, nothing is taken, and b's bytes are untouched.
    assert_eq!(store(&mut ca, &mut m, "t", &[("a9", pattern(9, OBJ))]).await, [RESOURCE_EXHAUSTED]);
    assert_eq!(removed(&mut ca).await.len(), log.len());
    for (k, seed) in &kept {
        let l = lookup(&mut ca, &[k]).await[0].unwrap_or_else(|| panic!("{k} lost"));
        assert_eq!(m.read(&l), pattern(*seed, OBJ), "{k}");
    }
}

/// A follower's object larger than half a region. With a lock in every
/// region nothing can make room, so nothing is evicted (evicting its
/// entries one by one emptied the node's cache, and the store was refused
/// all the same); once its own region holds no lock, the primary empties
/// that region for it (reason `evicted`) and the object goes there, not
/// into another node's region.
#[tokio::test(flavor = "multi_thread")]
async fn a_followers_large_object_empties_its_own_idle_region_or_evicts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let ((_a, _b, _c), (mut ca, mut cb, mut cc), mut m) = start(dir.path()).await;
    let (b_region, nb, _) = settled(&mut ca, "b").await;
    pin(&mut ca, &mut m, "apin").await;
    pin(&mut cc, &mut m, "cpin").await;
    let bs = three_keys(&mut cb, &mut m, "b").await;
    let refs: Vec<&str> = bs.iter().map(String::as_str).collect();
    // b's region in use too (locked through the primary: a follower's own
    // lookups leave holds that outlast its client's unlock).
    assert!(lookup(&mut ca, &["b0"]).await[0].is_some());
    let big = pool_info(&mut cb).await.max_object_size as usize;
    assert_eq!(store(&mut cb, &mut m, "t", &[("big", pattern(77, big))]).await, [RESOURCE_EXHAUSTED]);
    assert_eq!(removed(&mut ca).await, [], "nothing evicted for nothing");
    assert_eq!(exists(&mut ca, &refs).await, [true; 3]);

    assert_eq!(unlock(&mut ca, &["b0"]).await, [OK]);
    assert_eq!(store(&mut cb, &mut m, "t", &[("big", pattern(77, big))]).await, [OK]);
    let mut log = removed(&mut ca).await;
    log.sort();
    let evicted: Vec<(String, String)> = refs.iter().map(|k| (k.to_string(), "evicted".to_string())).collect();
    assert_eq!(log, evicted, "b's own entries, and no others");
    let l = lookup(&mut cb, &["big"]).await[0].expect("stored");
    assert_eq!(l.region as usize, b_region);
    assert_eq!(m.read(&l), pattern(77, big));
    assert_eq!(owners(&mut ca).await[b_region], Some(nb));
}
