//! Two nodes' handlers on one pool: each owns its own regions; a location in
//! another node's region is mapped read-only on demand and shows its bytes.
use std::sync::Arc;

use common::inproc::{handler, handler_on, pool, PAGE};
use cxlkv::error::ErrorKind;
use cxlkv::handler::{Handler, Limits};
use cxlkv::pool::record::RecordState;
use cxlkv::pool::NodeId;
use cxlkv::registry::{LocalRegistry, Session};

mod common;

/// A handler whose node may own at most `max_regions` regions.
fn handler_with(path: &std::path::Path, node: u32, max_regions: u32) -> Handler {
    handler_on(pool(path), node, Limits { max_regions, ..Limits::default() })
}

#[tokio::test]
async fn foreign_regions_are_mapped_read_only_on_demand() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool");
    let a = handler(&path, 1);
    let b = handler(&path, 2);
    let ra =
        a.reserve("t", vec![(b"k".to_vec(), 5000)], Session::LOCAL, false).await.unwrap().results.remove(0).unwrap();
    let rb =
        b.reserve("t", vec![(b"k".to_vec(), 5000)], Session::LOCAL, false).await.unwrap().results.remove(0).unwrap();
    assert_ne!(ra.1.region, rb.1.region, "each node allocates in its own regions");
    let own = a.mapping_for(&ra.1).unwrap();
    assert!(own.writable());
    own.write(ra.1.offset, &[0xAB; 5000]).unwrap();
    a.commit(&[ra.0], &[], Session::LOCAL).await.unwrap();

    // Node 2 is handed node 1's location (as a primary registry would).
    assert!(b.pool().mapped_region(ra.1.region).is_none(), "not mapped before it is needed");
    let foreign = b.mapping_for(&ra.1).unwrap();
    assert!(!foreign.writable(), "another node's region must be read-only");
    let mut buf = vec![0u8; 5000];
    foreign.read(ra.1.offset, &mut buf).unwrap();
    assert!(buf.iter().all(|&x| x == 0xAB));
    assert_eq!(foreign.write(ra.1.offset, b"x").unwrap_err().kind(), ErrorKind::FailedPrecondition);
    assert!(b.pool().mapped_region(ra.1.region).is_some(), "kept mapped for the next read");
}

#[tokio::test]
async fn the_next_region_is_claimed_before_the_owned_ones_run_out() {
    let dir = tempfile::tempdir().unwrap();
    let h = handler(&dir.path().join("pool"), 1);
    assert_eq!(h.stats().await.unwrap().owned_regions, 1);
    assert!(!h.claim_ahead().await.unwrap(), "plenty of room: nothing to claim");
    // Fill 28 of the region's 32 pages: less than a quarter region is left.
    let r = h.reserve("t", (0..28).map(|i| (vec![i as u8], 64 << 10)).collect(), Session::LOCAL, false).await.unwrap();
    assert!(r.results.iter().all(|x| x.is_ok()));
    assert_eq!(h.stats().await.unwrap().owned_regions, 1);
    assert!(h.claim_ahead().await.unwrap());
    assert_eq!(h.stats().await.unwrap().owned_regions, 2, "claimed without any store asking");
    assert!(!h.claim_ahead().await.unwrap(), "enough room again");

    let dir = tempfile::tempdir().unwrap();
    let capped = handler_with(&dir.path().join("pool"), 1, 1);
    capped.reserve("t", (0..30).map(|i| (vec![i as u8], 64 << 10)).collect(), Session::LOCAL, false).await.unwrap();
    assert!(!capped.claim_ahead().await.unwrap(), "max_regions is respected");
    assert_eq!(capped.stats().await.unwrap().owned_regions, 1);
}

/// A batch several regions large on a fresh node (a GPU host's 1 GiB
/// offload) is placed whole: each object that does not fit claims the next
/// region, up to the node's cap; past the cap the rest is refused, not lost.
#[tokio::test]
async fn a_batch_larger_than_a_region_claims_the_regions_it_needs() {
    let dir = tempfile::tempdir().unwrap();
    let h = handler(&dir.path().join("pool"), 1);
    assert_eq!(h.stats().await.unwrap().owned_regions, 1);
    // 3 regions' worth: 48 objects of two 64 KiB pages (a region holds 32 pages).
    let items: Vec<_> = (0..48).map(|i| (format!("big{i}").into_bytes(), 128 << 10)).collect();
    let r = h.reserve("t", items, Session::LOCAL, false).await.unwrap();
    assert!(r.results.iter().all(|x| x.is_ok()), "every object placed in one reserve");
    assert_eq!(h.stats().await.unwrap().owned_regions, 3);

    let dir = tempfile::tempdir().unwrap();
    let capped = handler_with(&dir.path().join("pool"), 1, 2);
    let items: Vec<_> = (0..48).map(|i| (format!("big{i}").into_bytes(), 128 << 10)).collect();
    let r = capped.reserve("t", items, Session::LOCAL, false).await.unwrap();
    let placed = r.results.iter().filter(|x| x.is_ok()).count();
    assert_eq!(placed, 32, "two regions' worth placed, the rest refused");
    assert_eq!(capped.stats().await.unwrap().owned_regions, 2, "max_regions is respected");
    let refused = r.results.iter().find(|x| x.is_err()).unwrap().as_ref().unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::ResourceExhausted, "{refused}");
}

/// An object that no region can hold (region-sized, plus a key too long to
/// sit in its record, which then follows the payload) is refused without
/// claiming regions it could never use.
#[tokio::test]
async fn an_object_no_region_holds_claims_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let h = handler(&dir.path().join("pool"), 1);
    let long = |i: u8| [vec![i; 1], vec![b'k'; 200]].concat();
    let items: Vec<_> = (0..3).map(|i| (long(i), h.max_object_size())).collect();
    let r = h.reserve("t", items, Session::LOCAL, false).await.unwrap();
    assert!(r.results.iter().all(|x| x.as_ref().is_err_and(|e| e.kind() == ErrorKind::ResourceExhausted)));
    assert_eq!(h.stats().await.unwrap().owned_regions, 1, "no region claimed for objects none can hold");
}

/// One Commit batch takes its locks once for all its reservations (so that
/// with software coherence its records' write-backs wait once, not once per
/// record); each reservation still gets its own answer: its own session's
/// live one is published, one whose pages were reclaimed and handed to
/// another key is NOT_FOUND and leaves that key's record alone, an unknown
/// id is NOT_FOUND, and another session's is refused and stays committable
/// by its owner.
#[tokio::test]
async fn a_commit_batch_answers_each_reservation_on_its_own() {
    let dir = tempfile::tempdir().unwrap();
    // Long enough that the live reservations never expire on a busy machine.
    let limits = Limits { reservation_timeout_ms: 1000, ..Limits::default() };
    let h = handler_on(pool(&dir.path().join("pool")), 1, limits);
    let (a, b) = (Session(1), Session(2));
    let one = |k: &str| vec![(k.as_bytes().to_vec(), 1000u64)];
    let reserve = |k: &'static str, s: Session| {
        let h = &h;
        async move { h.reserve("t", one(k), s, false).await.unwrap().results.remove(0).unwrap() }
    };

    // A reservation left to expire; its pages are reclaimed, then taken by
    // the next reservation (first fit).
    let (stale, stale_loc) = reserve("stale", a).await;
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    assert!(h.reap().await.unwrap() >= 1, "the expired reservation's pages were freed");
    let (other, other_loc) = reserve("other", b).await;
    assert_eq!((other_loc.region, other_loc.offset), (stale_loc.region, stale_loc.offset), "pages reused");
    let (mine, _) = reserve("mine", a).await;
    let (theirs, theirs_loc) = reserve("theirs", b).await;

    let ids = [mine, stale, cxlkv::ids::ReservationId(u64::MAX), theirs];
    let (out, _) = h.commit(&ids, &[], a).await.unwrap();
    let kinds: Vec<_> = out.iter().map(|r| r.as_ref().err().map(|e| e.kind())).collect();
    assert_eq!(kinds, [None, Some(ErrorKind::NotFound), Some(ErrorKind::NotFound), Some(ErrorKind::PermissionDenied)]);
    let state =
        |loc: &cxlkv::registry::Location| h.pool().read_record(loc.region, loc.offset / PAGE).unwrap().map(|r| r.state);
    assert_eq!(state(&other_loc), Some(RecordState::Writing), "the stale commit left the new key's record alone");
    assert_eq!(state(&theirs_loc), Some(RecordState::Writing), "another session's record untouched");

    let (out, _) = h.commit(&[other, theirs], &[], b).await.unwrap();
    assert!(out.iter().all(|r| r.is_ok()), "{out:?}");
    assert_eq!(state(&theirs_loc), Some(RecordState::Committed));
    let keys: [&[u8]; 4] = [b"mine", b"stale", b"other", b"theirs"];
    let found = h.exists(&keys, &cxlkv::registry::Scope::All).await.unwrap();
    assert_eq!(found, [true, false, true, true]);
}

/// Allocator probes (regions tried) of one reserve of `items` region-sized
/// objects into a pool whose every region holds a locked entry among
/// `locked` locked ones (the rest evictable): after a first such reserve
/// has evicted all it could, none of them can be placed. With the regions
/// owned and the holds of their lock the reserve took.
async fn probes_of_a_reserve_that_cannot_be_placed(locked: usize, items: usize) -> (u64, u32, u64) {
    let dir = tempfile::tempdir().unwrap();
    let h = handler(&dir.path().join("pool"), 1);
    let page = h.pool().superblock().page_size;
    let pages = (h.capacity_bytes() / page) as usize;
    let keys: Vec<Vec<u8>> = (0..pages).map(|i| format!("k{i}").into_bytes()).collect();
    let all: Vec<_> = keys.iter().map(|k| (k.clone(), page)).collect();
    let r = h.reserve("t", all, Session::LOCAL, false).await.unwrap();
    let ids: Vec<_> = r.results.into_iter().map(|x| x.unwrap().0).collect();
    h.commit(&ids, &[], Session::LOCAL).await.unwrap();
    // Spread so that every region keeps one: none can ever be emptied.
    let lock: Vec<&[u8]> = keys.iter().step_by(pages / locked).take(locked).map(|k| k.as_slice()).collect();
    let (hits, _) = h.lookup_and_lock(&lock, 600_000, Session(5)).await.unwrap();
    assert!(hits.iter().all(|x| x.is_some()));
    let storm = |round: usize| {
        let h = &h;
        async move {
            let items = (0..items).map(|i| (format!("s{round}-{i}").into_bytes(), h.max_object_size())).collect();
            let r = h.reserve("t", items, Session(7), false).await.unwrap();
            assert!(r.results.iter().all(|x| x.as_ref().is_err_and(|e| e.kind() == ErrorKind::ResourceExhausted)));
        }
    };
    storm(0).await;
    let (before, holds) = (h.regions().probes(), h.regions().holds());
    storm(1).await;
    let holds = h.regions().holds() - holds;
    assert_eq!(h.stats().await.unwrap().registry.evictions, 0, "evicting could make no room: nothing is");
    (h.regions().probes() - before, h.stats().await.unwrap().owned_regions, holds)
}

/// A reserve that cannot be placed tries each owned region once per batch
/// (an object that found no room makes every object as large fail at
/// once), in one pass when no other reserve was placing (trying again
/// would fail the same way): its cost does not grow with the batch, nor
/// with how many entries are locked.
#[tokio::test]
async fn a_reserve_that_cannot_be_placed_costs_one_scan_of_the_regions() {
    let (few, regions, _) = probes_of_a_reserve_that_cannot_be_placed(4, 16).await;
    let (many, _, _) = probes_of_a_reserve_that_cannot_be_placed(100, 16).await;
    let (big, _, _) = probes_of_a_reserve_that_cannot_be_placed(100, 1000).await;
    // The first object tries each region, a claim fails, then once more.
    let bound = 2 * regions as u64;
    assert!(few <= bound && many <= bound && big <= bound, "probes {few} {many} {big}, bound {bound}");
    assert_eq!((few, many), (many, big), "the same whatever is locked and however many objects");
}

/// A batch of a thousand that cannot be placed lets go of the regions'
/// lock every slice of objects (Stats, frees and other reserves wait for a
/// slice, not the batch), and a relock keeps what had no room: still one
/// scan of the regions (the test above, at 1000 objects).
#[tokio::test]
async fn a_batch_that_cannot_be_placed_holds_the_regions_lock_a_slice_at_a_time() {
    let (_, _, small) = probes_of_a_reserve_that_cannot_be_placed(100, 16).await;
    let (_, _, big) = probes_of_a_reserve_that_cannot_be_placed(100, 1000).await;
    // 16 objects: a hold, and another after the failed claim.
    assert!(small <= 2, "{small} holds for 16 objects");
    assert!(big >= 1000 / 64, "{big} holds for 1000 objects: the lock was held across the batch");
}

/// The pool full of one-page entries: their keys and locations.
async fn filled(h: &Handler) -> Vec<(Vec<u8>, cxlkv::registry::Location)> {
    let page = h.pool().superblock().page_size;
    let pages = (h.capacity_bytes() / page) as usize;
    let keys: Vec<Vec<u8>> = (0..pages).map(|i| format!("k{i}").into_bytes()).collect();
    let r = h.reserve("t", keys.iter().map(|k| (k.clone(), page)).collect(), Session::LOCAL, false).await.unwrap();
    let placed: Vec<_> = r.results.into_iter().map(|x| x.unwrap()).collect();
    h.commit(&placed.iter().map(|p| p.0).collect::<Vec<_>>(), &[], Session::LOCAL).await.unwrap();
    keys.into_iter().zip(placed.into_iter().map(|p| p.1)).collect()
}

/// Another client's lock on one entry of each region `keep` names.
async fn lock_one_in(h: &Handler, entries: &[(Vec<u8>, cxlkv::registry::Location)], keep: impl Fn(u32) -> bool) {
    let mut seen = std::collections::HashSet::new();
    let lock: Vec<&[u8]> =
        entries.iter().filter(|(_, l)| keep(l.region.0) && seen.insert(l.region)).map(|(k, _)| k.as_slice()).collect();
    let (hits, _) = h.lookup_and_lock(&lock, 600_000, Session(5)).await.unwrap();
    assert!(hits.iter().all(|x| x.is_some()));
}

/// One lock in every region: a region-sized object cannot be placed
/// whatever is evicted, so nothing is (the node's whole cache went, and
/// the object was refused all the same).
#[tokio::test]
async fn a_large_object_no_region_can_hold_evicts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let h = handler(&dir.path().join("pool"), 1);
    let entries = filled(&h).await;
    lock_one_in(&h, &entries, |_| true).await;
    let r = h.reserve("t", vec![(b"big".to_vec(), h.max_object_size())], Session(7), false).await.unwrap();
    assert_eq!(r.results[0].as_ref().unwrap_err().kind(), ErrorKind::ResourceExhausted);
    assert_eq!(r.evicted, 0);
    let keys: Vec<&[u8]> = entries.iter().map(|e| e.0.as_slice()).collect();
    let there = h.exists(&keys, &cxlkv::registry::Scope::All).await.unwrap();
    assert!(there.iter().all(|&x| x), "every entry is still stored");
}

/// Regions in use but one: a region-sized object empties that one, and
/// only that one, and is placed there; a smaller object still evicts in
/// the policy's order as before.
#[tokio::test]
async fn a_large_object_empties_the_one_region_not_in_use_and_no_more() {
    let dir = tempfile::tempdir().unwrap();
    let h = handler(&dir.path().join("pool"), 1);
    let entries = filled(&h).await;
    let free = entries.last().unwrap().1.region.0;
    lock_one_in(&h, &entries, |r| r != free).await;
    let r = h.reserve("t", vec![(b"big".to_vec(), h.max_object_size())], Session(7), false).await.unwrap();
    let (_, at) = r.results[0].as_ref().expect("placed in the emptied region");
    assert_eq!(at.region.0, free);
    let in_free = entries.iter().filter(|e| e.1.region.0 == free).count();
    assert_eq!(r.evicted as usize, in_free, "that region's entries, and no others");
    let keys: Vec<&[u8]> = entries.iter().map(|e| e.0.as_slice()).collect();
    let there = h.exists(&keys, &cxlkv::registry::Scope::All).await.unwrap();
    for (e, there) in entries.iter().zip(there) {
        assert_eq!(there, e.1.region.0 != free, "{:?} in region {}", String::from_utf8_lossy(&e.0), e.1.region.0);
    }
    // One page: the least recently used entry goes, wherever it is.
    let page = h.pool().superblock().page_size;
    let r = h.reserve("t", vec![(b"small".to_vec(), page)], Session(7), false).await.unwrap();
    assert!(r.results[0].is_ok());
    assert_eq!(r.evicted, 1);
}

/// A claimer that counts what it is asked, then claims on the pool.
struct CountingClaimer(cxlkv::handler::LocalClaimer, std::sync::atomic::AtomicUsize);

#[tonic::async_trait]
impl cxlkv::handler::Claimer for CountingClaimer {
    async fn claim(&self, node: NodeId) -> cxlkv::error::Result<Option<(cxlkv::pool::RegionId, u64)>> {
        self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.0.claim(node).await
    }
}

/// A reserve that finds no room on a pool whose every region is owned asks
/// no claimer for one: each would cost a trip off the runtime (or, on a
/// follower, to the primary) for a region that is not there, and a storm
/// of such reserves made one each.
#[tokio::test]
async fn a_reserve_on_a_pool_with_no_region_left_asks_no_claimer() {
    let dir = tempfile::tempdir().unwrap();
    let pool = pool(&dir.path().join("pool"));
    let node = NodeId(pool.lock_node(Some(1)).unwrap());
    let claimer = Arc::new(CountingClaimer(cxlkv::handler::LocalClaimer(pool.clone()), 0.into()));
    let reg = Arc::new(cxlkv::registry::LocalDirectory::new(Arc::new(LocalRegistry::new("lru", 1024).unwrap())));
    let limits = Limits { prefault: false, ..Limits::default() };
    let h = Handler::with_claimer(pool.clone(), node, reg, claimer.clone(), limits, false).unwrap();
    let asked = || claimer.1.load(std::sync::atomic::Ordering::Relaxed);
    filled(&h).await;
    assert!(!pool.has_unowned_region().unwrap());
    let claims_filling = asked();
    assert!(claims_filling > 0, "filling the pool claimed regions through the claimer");
    // Not evicting: nothing can make room.
    let how = cxlkv::handler::How { judged: true, evict: false };
    let items = (0..64).map(|i| (bytes::Bytes::from(format!("new{i}")), 64 << 10)).collect();
    let r = h.reserve_with("t", items, &[], Session(7), false, how).await.unwrap();
    assert!(r.results.iter().all(|x| x.as_ref().is_err_and(|e| e.kind() == ErrorKind::ResourceExhausted)));
    assert_eq!(asked(), claims_filling, "no claimer was asked for a region the table shows is not there");
}
