use super::*;
use crate::error::ErrorKind;
use crate::ids::ReservationId;

const PAGE: u64 = 4096;

fn loc(node: u32, i: u64, len: u64) -> Location {
    Location { node: NodeId(node), region: RegionId(0), offset: i * PAGE * 16, length: len, generation: 1, version: 0 }
}

fn reg() -> LocalRegistry {
    LocalRegistry::new("lru", 1024).unwrap()
}

/// The registry calls of the sidecar's own session, as the tests mostly make them.
trait Local {
    fn res(&self, tenant: &str, items: Vec<(Vec<u8>, Location)>, deadline: u64) -> Vec<Result<ReservationId>>;
    fn com(&self, ids: &[ReservationId]) -> (Vec<Result<Location>>, u64);
    fn ab(&self, ids: &[ReservationId]) -> Vec<Result<Location>>;
}

impl Local for LocalRegistry {
    fn res(&self, tenant: &str, items: Vec<(Vec<u8>, Location)>, deadline: u64) -> Vec<Result<ReservationId>> {
        self.reserve(tenant, items, ReserveOpts::local(deadline))
    }
    fn com(&self, ids: &[ReservationId]) -> (Vec<Result<Location>>, u64) {
        self.commit(ids, Session::LOCAL, &mut |_, _| {})
    }
    fn ab(&self, ids: &[ReservationId]) -> Vec<Result<Location>> {
        self.abort(ids, Session::LOCAL)
    }
}

fn put(r: &LocalRegistry, key: &[u8], len: u64) -> ReservationId {
    let id = r.res("t", vec![(key.to_vec(), loc(1, 0, len))], 1_000)[0].clone().unwrap();
    r.com(&[id]).0[0].clone().unwrap();
    id
}

#[test]
fn a_scope_hides_and_protects_other_tenants_keys() {
    let r = reg();
    for (t, k, i) in [("alice", b"a", 0), ("bob", b"b", 1)] {
        let id = r.res(t, vec![(k.to_vec(), loc(1, i, 10))], 100)[0].clone().unwrap();
        r.com(&[id]).0[0].clone().unwrap();
    }
    let alice = Scope::tenants(["alice", "carol"]);
    let hits = r.lookup_and_lock_in(&[b"a", b"b", b"c"], 10, 0, Session(7), &alice);
    assert!(matches!(hits[0], Ok(Some(_))) && matches!(hits[2], Ok(None)));
    assert_eq!(hits[1].as_ref().unwrap_err().kind(), ErrorKind::PermissionDenied);
    assert_eq!(r.stats().locked_keys, 1, "bob's key was not locked");
    assert_eq!(r.exists_in(&[b"a", b"b"], &alice), vec![true, false]);
    assert_eq!(
        r.delete_with(&[b"b"], 0, &alice, &mut |_| {})[0].as_ref().unwrap_err().kind(),
        ErrorKind::PermissionDenied
    );
    let keys: Vec<Vec<u8>> = r.list_in(0, 10, None, &alice).0.into_iter().map(|k| k.key).collect();
    assert_eq!(keys, vec![b"a".to_vec()]);
    assert!(r.list_in(0, 10, Some("bob"), &alice).0.is_empty());
    assert_eq!(r.exists(&[b"b"]), vec![true], "bob's key is still there");
    assert_eq!(r.list(0, 10, None).0.len(), 2, "the unscoped view sees both");
}

#[test]
fn two_phase_write_once() {
    let r = reg();
    let ids = r.res("a", vec![(b"k".to_vec(), loc(1, 0, 10)), (b"k".to_vec(), loc(1, 1, 10))], 100);
    let id = ids[0].clone().unwrap();
    assert_eq!(ids[1].as_ref().unwrap_err().kind(), ErrorKind::AlreadyExists, "same key twice in one batch");
    assert_eq!(r.exists(&[b"k"]), vec![false], "reserved keys are invisible");
    assert_eq!(r.lookup_and_lock(&[b"k"], 10, 0), vec![None]);
    assert_eq!(r.present(&[b"k"]), vec![true]);
    r.com(&[id]).0[0].clone().unwrap();
    // A committed reservation is no longer open: its id is unknown from now on.
    assert_eq!(r.com(&[id]).0[0].as_ref().unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(r.ab(&[id])[0].as_ref().unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(r.com(&[ReservationId(id.0 ^ (1 << 40))]).0[0].as_ref().unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(r.exists(&[b"k"]), vec![true]);
    let again = r.res("a", vec![(b"k".to_vec(), loc(1, 2, 99))], 100);
    assert_eq!(again[0].as_ref().unwrap_err().kind(), ErrorKind::AlreadyExists);
    assert_eq!(r.stats().bytes_stored, 10, "a refused re-store changes nothing");
}

#[test]
fn expired_lock_no_longer_protects() {
    let r = reg();
    put(&r, b"k", 100);
    assert!(r.lookup_and_lock(&[b"k"], 50, 0)[0].is_some());
    assert!(r.lookup_and_lock(&[b"k"], 50, 10)[0].is_some());
    assert_eq!(r.stats().locked_keys, 1);
    assert_eq!(r.delete(&[b"k"], 20)[0].as_ref().unwrap_err().kind(), ErrorKind::FailedPrecondition);
    assert!(r.evict(NodeId(1), 10, PAGE, 20).is_empty(), "locked keys are never evicted");
    r.unlock(&[b"k"], 30)[0].clone().unwrap();
    assert_eq!(r.delete(&[b"k"], 30)[0].as_ref().unwrap_err().kind(), ErrorKind::FailedPrecondition, "one lock left");
    // Past the TTL the remaining lock is gone.
    assert_eq!(r.unlock(&[b"k"], 70)[0].as_ref().unwrap_err().kind(), ErrorKind::FailedPrecondition);
    assert_eq!(r.stats().locks_expired, 1);
    assert_eq!(r.delete(&[b"k"], 70)[0].clone().unwrap().length, 100);
    assert_eq!(r.lookup_and_lock(&[b"k"], 50, 70), vec![None]);
}

#[test]
fn expire_reclaims_reservations_and_sweeps_locks() {
    let r = reg();
    let ids = r.res("t", vec![(b"a".to_vec(), loc(1, 0, 5)), (b"b".to_vec(), loc(1, 1, 5))], 100);
    r.com(&[ids[1].clone().unwrap()]).0[0].clone().unwrap();
    r.lookup_and_lock(&[b"b"], 10, 0);
    assert!(r.expire(99).is_empty());
    assert_eq!(r.stats().locked_keys, 0, "the housekeeping sweep drops expired locks");
    let freed = r.expire(100);
    assert_eq!(freed, vec![loc(1, 0, 5)]);
    assert_eq!(r.com(&[ids[0].clone().unwrap()]).0[0].as_ref().unwrap_err().kind(), ErrorKind::NotFound);
    let s = r.stats();
    assert_eq!((s.reserved, s.reservations_expired, s.keys), (0, 1, 1));
    assert!(r.present(&[b"a"]) == vec![false], "an expired reservation frees the key");
}

#[test]
fn tenants_and_listing() {
    let r = reg();
    for i in 0..25u8 {
        let tenant = if i % 5 == 0 { "x" } else { "y" };
        let id = r.res(tenant, vec![(vec![i], loc(1, i as u64, 10 + i as u64))], 100)[0].clone().unwrap();
        r.com(&[id]);
    }
    r.delete(&[&[0u8]], 0)[0].clone().unwrap();
    let s = r.stats();
    let x = s.tenants.iter().find(|t| t.tenant == "x").unwrap();
    assert_eq!((x.keys, x.bytes), (4, 15 + 20 + 25 + 30));
    let (mut all, mut cursor) = (vec![], 0);
    loop {
        let (page, next) = r.list(cursor, 7, None);
        assert!(page.len() <= 7);
        all.extend(page);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    assert_eq!(all.len(), 24);
    let (xs, _) = r.list(0, 100, Some("x"));
    assert_eq!(xs.len(), 4);
    assert!(r.list(0, 100, Some("nobody")).0.is_empty());
}

#[test]
fn eviction_is_per_node() {
    let r = reg();
    let a = r.res("t", vec![(b"n1".to_vec(), loc(1, 0, PAGE)), (b"n2".to_vec(), loc(2, 0, PAGE))], 9);
    r.com(&[a[0].clone().unwrap(), a[1].clone().unwrap()]);
    let v = r.evict(NodeId(2), 5, PAGE, 0);
    assert_eq!(v.len(), 1);
    assert_eq!(v[0].node, NodeId(2));
    assert_eq!(r.exists(&[b"n1", b"n2"]), vec![true, false]);
}

#[test]
fn batched_lookups_resolve_every_key_of_a_large_registry() {
    // Enough keys that the index grows several times over, looked up in
    // batches of 32 (the batched path: every home slot loaded before any is
    // compared); the last batches run past the stored keys, mixing in misses.
    let r = reg();
    let n = 20_000u64;
    let key = |i: u64| format!("key-{i}").into_bytes();
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let items = chunk.iter().map(|&i| (key(i), loc(1 + (i % 2) as u32, i, PAGE))).collect();
        let ids: Vec<_> = r.res("t", items, 9).into_iter().map(|x| x.unwrap()).collect();
        r.com(&ids);
    }
    for start in (0..n + 64).step_by(32) {
        let want: Vec<u64> = (start..start + 32).collect(); // the last batches run past n: misses
        let keys: Vec<Vec<u8>> = want.iter().map(|&i| key(i)).collect();
        let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
        let got = r.lookup_and_lock(&refs, 1_000, 1);
        for (&i, g) in want.iter().zip(&got) {
            if i < n {
                assert_eq!(*g, Some(loc(1 + (i % 2) as u32, i, PAGE)), "key {i}");
            } else {
                assert_eq!(*g, None, "key {i} was never stored");
            }
        }
        let unlocked = r.unlock(&refs, 1);
        assert_eq!(unlocked.iter().filter(|u| u.is_ok()).count() as u64, n.saturating_sub(start).min(32));
    }
    assert_eq!(r.stats().locked_keys, 0);
}

#[test]
fn a_batch_touches_each_nodes_entries_in_key_order() {
    let r = reg();
    let names: [&[u8]; 6] = [b"a1", b"b2", b"c1", b"d2", b"e1", b"f2"];
    for (i, k) in names.iter().enumerate() {
        let node = (k[1] - b'0') as u32;
        let id = r.res("t", vec![(k.to_vec(), loc(node, i as u64, PAGE))], 9)[0].clone().unwrap();
        r.com(&[id]);
    }
    // Touch in a mixed order, with a key twice and a miss.
    let batch: [&[u8]; 6] = [b"c1", b"f2", b"a1", b"zz", b"b2", b"c1"];
    r.lookup_and_lock(&batch, 1_000, 1);
    r.unlock(&[b"c1", b"f2", b"a1", b"b2", b"c1"], 1);
    // Victims in LRU order; index i of `names` is at loc(node, i).
    let order =
        |node| r.evict(NodeId(node), 100, PAGE, 2).into_iter().map(|l| l.offset / (PAGE * 16)).collect::<Vec<_>>();
    assert_eq!(order(1), vec![4, 0, 2], "e1 (untouched), a1, c1 (touched last)");
    assert_eq!(order(2), vec![3, 5, 1], "d2 (untouched), f2, b2");
}

#[test]
fn removal_log_reports_evictions_and_deletes_in_order() {
    let r = reg();
    for k in [b"a", b"b", b"c"] {
        put(&r, k, PAGE);
    }
    assert_eq!(r.removed_since(0, 10), (vec![], 1, false));
    let (_, seq_before) = r.com(&[]);
    assert_eq!(seq_before, 1);
    r.delete(&[b"b"], 0)[0].clone().unwrap();
    assert_eq!(r.evict(NodeId(1), 1, PAGE, 0).len(), 1); // "a" is least recently used
    let (ev, next, truncated) = r.removed_since(0, 10);
    assert!(!truncated);
    let got: Vec<(&[u8], bool, u64)> =
        ev.iter().map(|e| (e.key.as_slice(), e.reason == Removal::Evicted, e.size)).collect();
    assert_eq!(got, vec![(&b"b"[..], false, PAGE), (&b"a"[..], true, PAGE)]);
    assert_eq!(next, 3);
    assert_eq!(r.com(&[]).1, 3, "commit reports the log position");
    assert_eq!(r.removed_since(next, 10).0, vec![]);
    let (one, n2, _) = r.removed_since(1, 1);
    assert_eq!((one.len(), n2), (1, 2), "paging by max");
}

#[test]
fn removal_log_says_when_it_dropped_events() {
    let r = reg();
    for i in 0..(local::REMOVED_LOG + 5) {
        let k = (i as u32).to_le_bytes();
        put(&r, &k, 1);
        r.delete(&[&k], 0)[0].clone().unwrap();
    }
    let (ev, _, truncated) = r.removed_since(1, 10);
    assert!(truncated, "the oldest 5 removals are gone");
    assert_eq!(ev[0].seq, 6);
    assert!(!r.removed_since(6, 10).2);
}

#[test]
fn reservations_belong_to_their_session_and_ids_are_not_guessable() {
    let r = reg();
    let (alice, mallory) = (Session(7), Session(8));
    let opts = |owner| ReserveOpts { deadline: 100, owner, server_writes: false };
    let ids: Vec<ReservationId> = (0..64u64)
        .map(|i| r.reserve("t", vec![(vec![i as u8], loc(1, i, 10))], opts(alice))[0].clone().unwrap())
        .collect();
    // 64 random bits: no structure a guesser could follow (no counter, no slot).
    let distinct: std::collections::HashSet<u64> = ids.iter().map(|id| id.0 >> 32).collect();
    assert_eq!(distinct.len(), ids.len(), "high halves repeat: {ids:x?}");
    assert!(ids.iter().any(|id| id.0 >> 63 == 1) && ids.iter().any(|id| id.0 & 0xffff_ffff > 1 << 20));
    // Another session can neither commit nor abort them, and that changes nothing.
    let denied = r.commit(&ids[..2], mallory, &mut |_, _| panic!("published a foreign reservation"));
    assert!(denied.0.iter().all(|x| x.as_ref().unwrap_err().kind() == ErrorKind::PermissionDenied));
    assert_eq!(r.abort(&ids[2..3], mallory)[0].as_ref().unwrap_err().kind(), ErrorKind::PermissionDenied);
    assert_eq!(r.stats().reserved, 64);
    assert!(r.commit(&ids[..3], alice, &mut |_, _| {}).0.iter().all(|x| x.is_ok()));
    assert_eq!(r.exists(&[&[0u8], &[2u8]]), vec![true, true]);
}

#[test]
fn locks_belong_to_the_session_that_took_them() {
    let r = reg();
    put(&r, b"k", 100);
    let (a, b) = (Session(5), Session(6));
    assert!(matches!(r.lookup_and_lock_in(&[b"k"], 1_000, 0, a, &Scope::All)[0], Ok(Some(_))));
    assert!(matches!(r.lookup_and_lock_in(&[b"k"], 1_000, 0, a, &Scope::All)[0], Ok(Some(_))));
    // Another client's unlock is refused and releases nothing.
    assert_eq!(r.unlock_as(&[b"k"], 1, b)[0].as_ref().unwrap_err().kind(), ErrorKind::PermissionDenied);
    assert_eq!(r.delete(&[b"k"], 1)[0].as_ref().unwrap_err().kind(), ErrorKind::FailedPrecondition);
    r.unlock_as(&[b"k"], 1, a)[0].clone().unwrap();
    // b takes a lock too; a's connection closes: only a's lock goes.
    assert!(matches!(r.lookup_and_lock_in(&[b"k"], 1_000, 1, b, &Scope::All)[0], Ok(Some(_))));
    assert_eq!(r.release_session(a), 1);
    assert_eq!(r.stats().locked_keys, 1, "b's lock stays");
    assert_eq!(r.release_session(b), 1);
    assert_eq!(r.stats().locked_keys, 0);
    assert_eq!(r.evict(NodeId(1), 1, PAGE, 2).len(), 1, "released entries are evictable again");
}

#[test]
fn reservations_the_sidecar_writes_are_never_reclaimed_under_it() {
    let r = reg();
    let opts = ReserveOpts { deadline: 10, owner: Session::LOCAL, server_writes: true };
    let id = r.reserve("t", vec![(b"inline".to_vec(), loc(1, 0, 10))], opts)[0].clone().unwrap();
    let client = r.res("t", vec![(b"mapped".to_vec(), loc(1, 1, 10))], 10)[0].clone().unwrap();
    let freed = r.expire(1_000);
    assert_eq!(freed, vec![loc(1, 1, 10)], "only the client's reservation is reclaimed");
    assert_eq!(r.com(&[client]).0[0].as_ref().unwrap_err().kind(), ErrorKind::NotFound);
    // The writer itself ends it: here by aborting, which frees the pages.
    assert_eq!(r.ab(&[id])[0].clone().unwrap(), loc(1, 0, 10));
    // A client cannot commit what the sidecar is writing.
    let id = r.reserve("t", vec![(b"inline".to_vec(), loc(1, 0, 10))], opts)[0].clone().unwrap();
    assert_eq!(
        r.commit(&[id], Session(3), &mut |_, _| {}).0[0].as_ref().unwrap_err().kind(),
        ErrorKind::PermissionDenied
    );
    // A follower's inline put, as the primary's registry sees it: the
    // follower's own session (its node bits, no client bits) writes and
    // commits; its clients cannot.
    let follower = Session::LOCAL.on_node(2);
    assert!(follower.is_sidecar() && !Session(3).on_node(2).is_sidecar());
    let opts = ReserveOpts { deadline: 10, owner: follower, server_writes: true };
    let id = r.reserve("t", vec![(b"remote".to_vec(), loc(2, 0, 10))], opts)[0].clone().unwrap();
    assert_eq!(
        r.commit(&[id], Session(3).on_node(2), &mut |_, _| {}).0[0].as_ref().unwrap_err().kind(),
        ErrorKind::PermissionDenied
    );
    assert_eq!(r.commit(&[id], follower, &mut |_, _| {}).0[0].clone().unwrap(), loc(2, 0, 10));
}

#[test]
fn eviction_never_walks_over_locked_entries() {
    // Many locked entries at the cold end of the order, a few evictable ones
    // behind them: every reserve-time eviction visits only its victims.
    let r = reg();
    let n = 20_000u64;
    for i in 0..n + 100 {
        put(&r, format!("k{i}").as_bytes(), PAGE);
    }
    let locked: Vec<Vec<u8>> = (0..n).map(|i| format!("k{i}").into_bytes()).collect();
    let refs: Vec<&[u8]> = locked.iter().map(|k| k.as_slice()).collect();
    assert!(r.lookup_and_lock(&refs, 1_000_000, 1).iter().all(|l| l.is_some()));
    let mut evicted = 0;
    for _ in 0..500 {
        evicted += r.evict(NodeId(1), 1, PAGE, 2).len() as u64; // 100 succeed, 400 find nothing
    }
    assert_eq!(evicted, 100);
    let s = r.stats();
    assert_eq!(s.eviction_visits, 100, "visited {} entries for 100 evictions", s.eviction_visits);
    assert_eq!(s.keys, n);
    // Unlocked entries come back, as most recently used.
    r.unlock(&refs[..10], 3);
    assert_eq!(r.evict(NodeId(1), 10, PAGE, 4).len(), 10);
    assert_eq!(r.stats().eviction_visits, 110);
}

#[test]
fn tenants_are_bounded_and_forgotten_when_empty() {
    let r = LocalRegistry::new("lru", 2).unwrap();
    let a = r.res("a", vec![(b"ka".to_vec(), loc(1, 0, 10))], 100)[0].clone().unwrap();
    let b = r.res("b", vec![(b"kb".to_vec(), loc(1, 1, 10))], 100)[0].clone().unwrap();
    let c = r.res("c", vec![(b"kc".to_vec(), loc(1, 2, 10))], 100);
    assert_eq!(c[0].as_ref().unwrap_err().kind(), ErrorKind::ResourceExhausted, "third tenant over the limit");
    assert_eq!(r.stats().reserved, 2, "the refused item took nothing");
    // A refused reserve of an existing key does not keep a new tenant alive.
    assert_eq!(
        r.res("a", vec![(b"ka".to_vec(), loc(1, 3, 10))], 100)[0].as_ref().unwrap_err().kind(),
        ErrorKind::AlreadyExists
    );
    r.com(&[a]);
    r.ab(&[b]);
    let names = |r: &LocalRegistry| r.stats().tenants.iter().map(|t| t.tenant.clone()).collect::<Vec<_>>();
    assert_eq!(names(&r), vec!["a".to_string()], "b had nothing left");
    assert!(r.res("c", vec![(b"kc".to_vec(), loc(1, 2, 10))], 100)[0].is_ok(), "b's place is free again");
    r.delete(&[b"ka"], 0)[0].clone().unwrap();
    let (ev, _, _) = r.removed_since(0, 10);
    assert_eq!(ev[0].tenant, "a", "the removal log keeps the name of a forgotten tenant");
    assert_eq!(names(&r), vec!["c".to_string()]);
    // Thousands of one-off tenants leave nothing behind.
    let r = reg();
    for i in 0..5_000u32 {
        let ids = r.res(&format!("t{i}"), vec![(i.to_le_bytes().to_vec(), loc(1, 0, 10))], 100);
        r.ab(&[ids[0].clone().unwrap()]);
    }
    assert!(r.stats().tenants.is_empty());
}

#[test]
fn a_region_is_reclaimed_whole_or_not_at_all() {
    let r = reg();
    let at = |region: u32, i: u64| Location { region: RegionId(region), ..loc(2, i, 10) };
    let mut ids = vec![];
    for (k, l) in [(b"x0", at(4, 0)), (b"x1", at(4, 1)), (b"y0", at(5, 0))] {
        ids.push(r.res("t", vec![(k.to_vec(), l)], 1_000)[0].clone().unwrap());
    }
    r.com(&ids[..2]);
    // Region 5 holds an open reservation: busy, and left alone.
    assert_eq!(r.region_usage(0), vec![(RegionId(4), 2, false), (RegionId(5), 0, true)]);
    assert_eq!(r.reclaim_region(RegionId(5), 0).unwrap_err().kind(), ErrorKind::FailedPrecondition);
    // A lock on one entry protects the whole region until it expires.
    assert!(matches!(r.lookup_and_lock_in(&[b"x1"], 10, 0, Session(7), &Scope::All)[0], Ok(Some(_))));
    assert_eq!(r.region_usage(0)[0], (RegionId(4), 2, true));
    assert_eq!(r.reclaim_region(RegionId(4), 0).unwrap_err().kind(), ErrorKind::FailedPrecondition);
    assert_eq!(r.exists(&[b"x0", b"x1"]), vec![true, true], "a refused reclaim changes nothing");
    // Past the lock's TTL the region goes, every entry logged `reclaimed`.
    let gone = r.reclaim_region(RegionId(4), 20).unwrap();
    assert_eq!(gone.len(), 2);
    assert_eq!(r.exists(&[b"x0", b"x1"]), vec![false, false]);
    let (log, _, _) = r.removed_since(0, 10);
    assert_eq!(log.iter().map(|e| e.reason).collect::<Vec<_>>(), vec![Removal::Reclaimed; 2]);
    assert_eq!(r.stats().keys, 0);
    assert!(r.present(&[b"y0"])[0], "the other region's reservation stays");
}

#[test]
fn a_region_is_reclaimed_from_a_scan_a_slice_at_a_time_or_not_while_it_changes() {
    let at = |region: u32, i: u64| Location { region: RegionId(region), ..loc(2, i, 10) };
    let store = |r: &LocalRegistry, k: &[u8], l: Location| {
        let id = r.res("t", vec![(k.to_vec(), l)], 1_000)[0].clone().unwrap();
        r.com(&[id]).0[0].clone().unwrap();
    };
    for slots in [1, 2, 3, 1 << 16] {
        let r = reg();
        for i in 0..7u64 {
            store(&r, format!("k{i}").as_bytes(), at(if i % 3 == 2 { 4 } else { 5 }, i));
        }
        // Slot 0 is free: the next entry stored takes it, behind the scan.
        r.delete(&[b"k0"], 0);
        let mut stored = false;
        let mut store_behind = || {
            if !std::mem::replace(&mut stored, true) {
                store(&r, b"late", at(4, 9));
            }
        };
        let refused = r.reclaim_region_in_slices(RegionId(4), 0, slots, &mut store_behind);
        if slots < 7 {
            // An entry came into the region where the scan had been: nothing goes.
            assert_eq!(refused.unwrap_err().kind(), ErrorKind::FailedPrecondition, "{slots} slots at a time");
            assert_eq!(r.exists(&[b"k2", b"k5", b"late"]), vec![true; 3]);
            // Unchanged while scanned: every entry of the region, none of another's.
            let gone = r.reclaim_region_in_slices(RegionId(4), 0, slots, &mut || {}).unwrap();
            let mut offsets: Vec<u64> = gone.iter().map(|l| l.offset / (PAGE * 16)).collect();
            offsets.sort();
            assert_eq!(offsets, vec![2, 5, 9], "{slots} slots at a time");
        } else {
            // One slice: the lock was never let go, the region went whole.
            assert_eq!(refused.unwrap().len(), 2);
        }
        assert_eq!(r.exists(&[b"k2", b"k5", b"late"]), vec![false; 3]);
        assert_eq!(r.region_usage(0), vec![(RegionId(5), 4, false)]);
    }
}

#[test]
fn a_region_is_emptied_for_a_large_object_only_where_none_of_it_is_in_use() {
    let r = reg();
    let at = |region: u32, i: u64| Location { region: RegionId(region), ..loc(2, i, 10) };
    for (k, l) in [(b"a0", at(4, 0)), (b"a1", at(4, 1)), (b"b0", at(5, 0)), (b"c0", at(6, 0)), (b"c1", at(6, 1))] {
        let id = r.res("t", vec![(k.to_vec(), l)], 1_000)[0].clone().unwrap();
        r.com(&[id]);
    }
    // Another node's entry, in a region not among the candidates: stays.
    let other = r.res("t", vec![(b"z".to_vec(), Location { node: NodeId(3), ..at(7, 0) })], 1_000)[0].clone().unwrap();
    r.com(&[other]);
    let regions = [RegionId(4), RegionId(5), RegionId(6)];
    let (node, now) = (NodeId(2), 0);
    // Region 5 holds the fewest entries, but one is locked: region 4 or 6
    // (two entries each) goes, the first of the fewest.
    assert!(matches!(r.lookup_and_lock_in(&[b"b0"], 10, now, Session(7), &Scope::All)[0], Ok(Some(_))));
    let gone = r.evict_region(Some("t"), node, &regions, 10, now, Session(8));
    assert_eq!(gone.iter().map(|l| l.region).collect::<Vec<_>>(), vec![RegionId(4); 2]);
    assert_eq!(r.exists(&[b"a0", b"a1", b"b0", b"c0", b"c1", b"z"]), vec![false, false, true, true, true, true]);
    assert_eq!(r.stats().evictions, 2);
    let (log, _, _) = r.removed_since(0, 10);
    assert_eq!(log.iter().map(|e| e.reason).collect::<Vec<_>>(), vec![Removal::Evicted; 2]);
    // An open reservation keeps region 6 too; then nothing is idle.
    let open = r.res("t", vec![(b"c2".to_vec(), at(6, 2))], 1_000)[0].clone().unwrap();
    assert!(r.evict_region(Some("t"), node, &regions, 10, now, Session(8)).is_empty());
    assert_eq!(r.exists(&[b"b0", b"c0", b"c1"]), vec![true, true, true], "nothing evicted for nothing");
    r.ab(&[open]);
    assert_eq!(r.evict_region(Some("t"), node, &regions, 10, now, Session(8)).len(), 2, "region 6, once idle");

    // A client that could not reserve the object anyway empties nothing.
    let r = reg().with_pin_limit(15);
    for (k, l) in [(b"a0", at(4, 0)), (b"b0", at(5, 0))] {
        let id = r.res("t", vec![(k.to_vec(), l)], 1_000)[0].clone().unwrap();
        r.com(&[id]);
    }
    assert!(matches!(r.lookup_and_lock_in(&[b"b0"], 10_000, now, Session(9), &Scope::All)[0], Ok(Some(_))));
    assert!(r.evict_region(Some("t"), node, &regions, 10, now, Session(9)).is_empty(), "5 bytes of room, not 10");
    assert_eq!(r.exists(&[b"a0"]), vec![true]);
    assert_eq!(r.evict_region(Some("t"), node, &regions, 10, now, Session(8)).len(), 1);

    // Found a slice of the slab at a time (the lock let go in between): the
    // same entries, wherever the slices cut, and a freed slot reused.
    for slots in [1, 2, 3, 1 << 16] {
        let r = reg();
        let keys: Vec<Vec<u8>> = (0..7u64).map(|i| format!("k{i}").into_bytes()).collect();
        for (i, k) in keys.iter().enumerate() {
            let region = if i % 3 == 0 { 4 } else { 5 };
            let id = r.res("t", vec![(k.clone(), at(region, i as u64))], 1_000)[0].clone().unwrap();
            r.com(&[id]);
        }
        r.delete_with(&[b"k1"], now, &Scope::All, &mut |_| {});
        let id = r.res("t", vec![(b"k7".to_vec(), at(4, 7))], 1_000)[0].clone().unwrap();
        r.com(&[id]);
        let gone = r.evict_region_in_slices(Some("t"), node, &[RegionId(4)], (10, now, Session(8)), slots);
        let mut offsets: Vec<u64> = gone.iter().map(|l| l.offset / (PAGE * 16)).collect();
        offsets.sort();
        assert_eq!(offsets, vec![0, 3, 6, 7], "{slots} slots at a time");
        assert_eq!(r.region_usage(now), vec![(RegionId(5), 3, false)]);
    }
}

proptest::proptest! {
    /// The per-region counts `region_usage` keeps as entries are reserved,
    /// committed, locked, unlocked, expired, evicted, deleted, reclaimed
    /// and dropped agree with a scan of every entry.
    #[test]
    fn region_usage_kept_as_entries_change_matches_a_scan(
        ops in proptest::collection::vec((0u8..10, 0u8..8, 0u8..6), 1..150)
    ) {
        let r = reg();
        let mut now = 0;
        let at = |k: u8| Location { region: RegionId((k % 3) as u32), ..loc(1 + (k % 2) as u32, k as u64, PAGE) };
        let mut open = std::collections::HashMap::new();
        for (what, k, n) in ops {
            let (key, who) = ([k], Session(1 + (n % 2) as u64));
            match what {
                0 => {
                    let opts = ReserveOpts { deadline: now + 40, owner: who, server_writes: false };
                    if let Ok(id) = r.reserve("t", vec![(key.to_vec(), at(k))], opts)[0].clone() {
                        open.insert(k, (id, who));
                    }
                }
                1 => if let Some((id, who)) = open.remove(&k) {
                    let _ = r.commit(&[id], who, &mut |_, _| {});
                },
                2 => if let Some((id, who)) = open.remove(&k) {
                    let _ = r.abort(&[id], who);
                },
                3 => { let _ = r.lookup_and_lock_in(&[&key], 5 + n as u64 * 5, now, who, &Scope::All); }
                4 => { let _ = r.unlock_as(&[&key], now, who); }
                5 => { let _ = r.delete(&[&key], now); }
                6 => { let _ = r.evict(NodeId(1 + (n % 2) as u32), n as u64, PAGE, now); }
                7 => { let _ = r.reclaim_region(RegionId((k % 3) as u32), now); }
                8 => { let _ = r.release_session(who); }
                _ => {
                    now += n as u64 * 7;
                    let _ = r.expire(now);
                }
            }
            let want = r.region_usage_scan(now);
            proptest::prop_assert_eq!(r.region_usage(now), want);
        }
    }
}

// The model-based property test.
mod model;

#[test]
fn reads_counted_elsewhere_move_an_entry_in_the_eviction_order_and_name_its_tenant() {
    let r = reg();
    for (i, k) in [b"a", b"b", b"c"].iter().enumerate() {
        let id = r.res("t", vec![(k.to_vec(), loc(1, i as u64, 10))], 1_000)[0].clone().unwrap();
        r.com(&[id]).0[0].clone().unwrap();
    }
    // A follower read "a" twice and "zz" (unknown) once from its holds.
    r.touch(&[b"a", b"zz"], &[2, 1]);
    let victims: Vec<u64> = r.evict(NodeId(1), 2, PAGE, 0).iter().map(|l| l.offset).collect();
    assert_eq!(victims, vec![loc(1, 1, 10).offset, loc(1, 2, 10).offset], "a was read last");
    assert_eq!(r.tenants_of(&[b"a", b"b"]), vec![Some("t".to_owned()), None]);
}
