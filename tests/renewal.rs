//! A restart renews each region it owns (a new generation) and restamps the
//! records it keeps. A process that dies half-way through loses nothing
//! committed at its next start; a region handed to another node meanwhile
//! never brings back its past owner's records.
use std::sync::Arc;

use common::inproc::{handler, pool, PAGE};
use cxlkv::handler::{Handler, Joined, Limits, LocalClaimer};
use cxlkv::pool::record::set_generation;
use cxlkv::pool::{NodeId, Pool, RegionId};
use cxlkv::registry::{LocalDirectory, LocalRegistry, Location, Session};

mod common;

fn bytes_of(i: usize) -> Vec<u8> {
    (0..5000).map(|j| (i * 31 + j * 7) as u8).collect()
}

/// `n` objects committed by node 1, each with bytes of its own.
async fn store(h: &Handler, n: usize) -> Vec<(Vec<u8>, Location)> {
    let mut out = vec![];
    for i in 0..n {
        let key = format!("key-{i}").into_bytes();
        let rr = h.reserve("t", vec![(key.clone(), 5000)], Session::LOCAL, false).await.unwrap();
        let (id, loc) = rr.results.into_iter().next().unwrap().unwrap();
        h.mapping_for(&loc).unwrap().write(loc.offset, &bytes_of(i)).unwrap();
        h.commit(&[id], &[], Session::LOCAL).await.unwrap();
        out.push((key, loc));
    }
    out
}

/// Every key found, with its own bytes.
async fn check_all(h: &Handler, stored: &[(Vec<u8>, Location)]) {
    let keys: Vec<&[u8]> = stored.iter().map(|s| &s.0[..]).collect();
    let (hits, _) = h.lookup_and_lock(&keys, 10_000, Session::LOCAL).await.unwrap();
    for (i, hit) in hits.into_iter().enumerate() {
        let loc = hit.unwrap_or_else(|| panic!("key-{i} lost"));
        let mut got = vec![0u8; 5000];
        h.mapping_for(&loc).unwrap().read(loc.offset, &mut got).unwrap();
        assert_eq!(got, bytes_of(i), "key-{i}'s bytes");
    }
    h.unlock(&keys, Session::LOCAL).await.unwrap();
}

/// A restart that died after renewing `r` and restamping the records of
/// the objects `restamped` says (none, some or all of them).
fn renewal_interrupted(p: &Pool, r: RegionId, stored: &[(Vec<u8>, Location)], restamped: impl Fn(usize) -> bool) {
    let generation = p.renew_region(r, NodeId(1)).unwrap().generation;
    for (_, (_, loc)) in stored.iter().enumerate().filter(|(i, s)| s.1.region == r && restamped(*i)) {
        let mut slot = p.read_slot(r, loc.offset / PAGE).unwrap();
        set_generation(&mut slot, generation);
        p.restamp_slot(r, loc.offset / PAGE, &slot).unwrap();
    }
}

/// A crash loop: forty starts in a row die while renewing (a memory limit
/// too low for the registry, say, until an operator raises it); the start
/// after them keeps everything.
#[tokio::test]
async fn a_crash_loop_of_forty_interrupted_renewals_loses_nothing_committed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool");
    let h = handler(&path, 1);
    let stored = store(&h, 20).await;
    drop(h);
    let p = pool(&path);
    for round in 0..40 {
        for r in p.regions_owned_by(NodeId(1)) {
            // Odd objects are never restamped; even ones now and then.
            renewal_interrupted(&p, r, &stored, |i| i % 2 == 0 && (i / 2 + round) % 5 == 0);
        }
    }
    drop(p);
    let h = handler(&path, 1);
    assert_eq!((h.rebuilt().restored, h.rebuilt().stale), (20, 0), "{:?}", h.rebuilt());
    check_all(&h, &stored).await;
}

/// Ten objects node 1 stored in one region of the pool at `path`, and
/// node 1 died while renewing that region, half of the records restamped.
async fn one_region_interrupted(path: &std::path::Path) -> (Arc<Pool>, RegionId, Vec<(Vec<u8>, Location)>) {
    let h = handler(path, 1);
    let stored = store(&h, 10).await;
    drop(h);
    let p = pool(path);
    let r = stored[0].1.region;
    assert!(stored.iter().all(|s| s.1.region == r), "one region holds them all");
    renewal_interrupted(&p, r, &stored, |i| i % 2 == 0);
    (p, r, stored)
}

#[tokio::test]
async fn a_restart_that_died_while_renewing_its_regions_loses_nothing_committed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool");
    let h = handler(&path, 1);
    let stored = store(&h, 40).await;
    drop(h);
    // Three starts die in a row: once every record carried the new
    // generation, once every other one did, once before any did (the
    // records are left of two generations, neither the last).
    let p = pool(&path);
    let regions = p.regions_owned_by(NodeId(1));
    assert!(!regions.is_empty());
    for r in &regions {
        renewal_interrupted(&p, *r, &stored, |_| true);
        renewal_interrupted(&p, *r, &stored, |i| i % 2 == 0);
        renewal_interrupted(&p, *r, &stored, |_| false);
    }
    drop(p);

    let h = handler(&path, 1);
    let report = h.rebuilt();
    assert_eq!((report.restored, report.stale, report.damaged), (40, 0, 0), "{report:?}");
    check_all(&h, &stored).await;
    drop(h);
    // That start finished its renewal: the next keeps everything too.
    let h = handler(&path, 1);
    assert_eq!(h.rebuilt().restored, 40);
    check_all(&h, &stored).await;
}

#[tokio::test]
async fn a_region_handed_to_another_node_never_brings_back_its_past_owners_records() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool");
    // Node 1 died while renewing its region; the primary then handed it
    // to node 2.
    let (p, r, stored) = one_region_interrupted(&path).await;
    p.reassign_region(r, NodeId(1), NodeId(2)).unwrap();
    drop(p);

    let h2 = handler(&path, 2);
    let report = h2.rebuilt();
    assert_eq!((report.restored, report.stale), (0, 10), "node 1's records are stale to node 2: {report:?}");
    let keys: Vec<&[u8]> = stored.iter().map(|s| &s.0[..]).collect();
    let (hits, _) = h2.lookup_and_lock(&keys, 10_000, Session::LOCAL).await.unwrap();
    assert!(hits.iter().all(Option::is_none), "none of node 1's keys: {hits:?}");
}

/// The cluster's primary (node 2, started after node 1 died), with every
/// object it found; its deletes erase records in the pool, as a cluster's
/// primary's do.
fn primary_after(path: &std::path::Path) -> (Handler, Arc<LocalDirectory>) {
    let pool = pool(path);
    let node = NodeId(pool.lock_node(Some(2)).unwrap());
    let registry = Arc::new(LocalRegistry::new("lru", 1024).unwrap());
    let dir = Arc::new(LocalDirectory::new(registry).with_eraser(Arc::new(Erase(pool.clone()))));
    let claimer = Arc::new(LocalClaimer(pool.clone()));
    let limits = Limits { prefault: false, ..Limits::default() };
    (Handler::with_claimer(pool, node, dir.clone(), claimer, limits, true).unwrap(), dir)
}

/// The cluster's primary reads the other nodes' regions when it starts: a
/// region whose owner died while renewing it shows all of its owner's
/// committed objects, those restamped and those not yet.
#[tokio::test]
async fn a_primary_starting_finds_every_object_of_a_region_whose_renewal_was_interrupted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool");
    let (p, _, stored) = one_region_interrupted(&path).await;
    drop(p);
    let (primary, _) = primary_after(&path);
    assert_eq!(primary.rebuilt().restored, 10, "{:?}", primary.rebuilt());
    check_all(&primary, &stored).await;
}

/// Node 1 died while renewing its region, another node became the primary
/// (and found all of node 1's objects), then node 1 came back and joined it
/// as a follower: every object the primary calls live keeps its record and
/// pages (none retired as stale, which would leave the primary's entries
/// pointing at pages node 1 reuses), at every join. The joins write none of
/// their slots (the primary may be erasing one: a delete), so the region
/// keeps its mark until node 1's next renewal, which keeps them all too.
#[tokio::test]
async fn a_node_that_died_renewing_keeps_every_live_object_when_it_rejoins_a_new_primary() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool");
    let (p, r, stored) = one_region_interrupted(&path).await;
    drop(p);
    let (primary, primary_dir) = primary_after(&path);
    let keys: Vec<&[u8]> = stored.iter().map(|s| &s.0[..]).collect();
    let (hits, _) = primary.lookup_and_lock(&keys, 10_000, Session::LOCAL).await.unwrap();
    primary.unlock(&keys, Session::LOCAL).await.unwrap();
    let live: Vec<Location> = hits.into_iter().map(|h| h.expect("the primary found it")).collect();

    let pool = pool(&path);
    let generation = pool.region_state(r).unwrap().generation;
    let slots = |p: &Pool| live.iter().map(|l| p.read_slot(r, l.offset / PAGE).unwrap()).collect::<Vec<_>>();
    let before = slots(&pool);
    let joined = Joined { node: NodeId(1), regions: vec![(r, generation)], live: live.clone() };
    for join in ["first", "second"] {
        let limits = Limits { prefault: false, ..Limits::default() };
        let claimer = Arc::new(LocalClaimer(pool.clone()));
        let node1 = Handler::follower(pool.clone(), &joined, primary_dir.clone(), claimer, limits).unwrap();
        assert_eq!((node1.rebuilt().restored, node1.rebuilt().stale), (10, 0), "{join} join: {:?}", node1.rebuilt());
        assert!(slots(&pool) == before, "{join} join: a live object's slot was written");
    }
    check_all(&primary, &stored).await;
    drop(primary);
    drop(pool);
    let h = handler(&path, 1);
    assert_eq!((h.rebuilt().restored, h.rebuilt().stale), (10, 0), "the next renewal: {:?}", h.rebuilt());
    check_all(&h, &stored).await;
}

/// Erases a deleted object's record as the cluster's primary does
/// (`cluster/records.rs`): the delete is in the pool before it is answered.
struct Erase(Arc<Pool>);

impl cxlkv::registry::directory::Eraser for Erase {
    fn erase(&self, loc: &Location) {
        self.0.erase_record(loc.region, loc.offset / PAGE, loc.version, loc.generation).unwrap();
    }
}

/// Node 1 died while renewing its region; node 2, the primary meanwhile,
/// deleted every one of its objects and died too; node 1 then starts as the
/// primary again, without ever having followed node 2 (its free notices
/// went with it). No deleted object comes back: the primary's erase reached
/// the records not yet restamped as well.
#[tokio::test]
async fn objects_a_primary_deleted_from_a_half_renewed_region_never_come_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool");
    let (p, _, stored) = one_region_interrupted(&path).await;
    drop(p);
    let (primary, _) = primary_after(&path);
    let keys: Vec<&[u8]> = stored.iter().map(|s| &s.0[..]).collect();
    assert!(primary.delete(&keys).await.unwrap().iter().all(Result::is_ok));
    drop(primary);

    let h = handler(&path, 1);
    assert_eq!(h.rebuilt().restored, 0, "deleted objects came back: {:?}", h.rebuilt());
    let (hits, _) = h.lookup_and_lock(&keys, 10_000, Session::LOCAL).await.unwrap();
    assert!(hits.iter().all(Option::is_none), "{hits:?}");
}

/// A renewal restamps records from copies of their slots it read first; a
/// primary's erase (a delete) made in between must stand. The restamp
/// writes the generation and checksum alone, so the deleted object cannot
/// come back at a later rebuild.
#[tokio::test]
async fn a_restamp_from_a_copy_read_before_the_primarys_erase_leaves_the_record_erased() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool");
    let (p, r, stored) = one_region_interrupted(&path).await;
    let generation = p.region_state(r).unwrap().generation;
    for loc in [stored[0].1, stored[1].1] {
        // One restamped before the crash, one not.
        let page = loc.offset / PAGE;
        let mut slot = p.read_slot(r, page).unwrap();
        assert!(p.erase_record(r, page, loc.version, generation).unwrap(), "the primary's erase");
        set_generation(&mut slot, generation);
        p.restamp_slot(r, page, &slot).unwrap();
        assert_eq!(p.read_record(r, page).unwrap(), None, "the erased record at page {page}");
    }
    drop(p);
    let h = handler(&path, 1);
    assert_eq!(h.rebuilt().restored, 8, "{:?}", h.rebuilt());
}
