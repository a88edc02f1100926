use super::*;
use crate::error::ErrorKind;
use proptest::prelude::*;
use std::collections::HashMap;

const PAGE: u64 = 4096;

fn loc(node: u32, i: u64, len: u64) -> Location {
    Location { node, region: 0, offset: i * PAGE * 16, length: len, generation: 1 }
}

fn reg() -> LocalRegistry {
    LocalRegistry::new("lru").unwrap()
}

fn put(r: &LocalRegistry, key: &[u8], len: u64) -> u64 {
    let id = r.reserve("t", vec![(key.to_vec(), loc(1, 0, len))], 1_000)[0].clone().unwrap();
    r.commit(&[id], 0).0[0].clone().unwrap();
    id
}

#[test]
fn two_phase_write_once() {
    let r = reg();
    let ids = r.reserve("a", vec![(b"k".to_vec(), loc(1, 0, 10)), (b"k".to_vec(), loc(1, 1, 10))], 100);
    let id = ids[0].clone().unwrap();
    assert_eq!(ids[1].as_ref().unwrap_err().kind(), ErrorKind::AlreadyExists, "same key twice in one batch");
    assert_eq!(r.exists(&[b"k"]), vec![false], "reserved keys are invisible");
    assert_eq!(r.lookup_and_lock(&[b"k"], 10, 0), vec![None]);
    assert_eq!(r.present(&[b"k"]), vec![true]);
    r.commit(&[id], 0).0[0].clone().unwrap();
    assert_eq!(r.commit(&[id], 0).0[0].as_ref().unwrap_err().kind(), ErrorKind::FailedPrecondition);
    assert_eq!(r.abort(&[id])[0].as_ref().unwrap_err().kind(), ErrorKind::FailedPrecondition);
    assert_eq!(r.commit(&[id ^ (1 << 40)], 0).0[0].as_ref().unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(r.exists(&[b"k"]), vec![true]);
    let again = r.reserve("a", vec![(b"k".to_vec(), loc(1, 2, 99))], 100);
    assert_eq!(again[0].as_ref().unwrap_err().kind(), ErrorKind::AlreadyExists);
    assert_eq!(r.stats(0).bytes_stored, 10, "a refused re-store changes nothing");
}

#[test]
fn expired_lock_no_longer_protects() {
    let r = reg();
    put(&r, b"k", 100);
    assert!(r.lookup_and_lock(&[b"k"], 50, 0)[0].is_some());
    assert!(r.lookup_and_lock(&[b"k"], 50, 10)[0].is_some());
    assert_eq!(r.stats(10).locked_keys, 1);
    assert_eq!(r.delete(&[b"k"], 20)[0].as_ref().unwrap_err().kind(), ErrorKind::FailedPrecondition);
    assert!(r.evict(1, 10, PAGE, 20).is_empty(), "locked keys are never evicted");
    r.unlock(&[b"k"], 30)[0].clone().unwrap();
    assert_eq!(r.delete(&[b"k"], 30)[0].as_ref().unwrap_err().kind(), ErrorKind::FailedPrecondition, "one lock left");
    // Past the TTL the remaining lock is gone.
    assert_eq!(r.unlock(&[b"k"], 70)[0].as_ref().unwrap_err().kind(), ErrorKind::FailedPrecondition);
    assert_eq!(r.stats(70).locks_expired, 1);
    assert_eq!(r.delete(&[b"k"], 70)[0].clone().unwrap().length, 100);
    assert_eq!(r.lookup_and_lock(&[b"k"], 50, 70), vec![None]);
}

#[test]
fn expire_reclaims_reservations_and_sweeps_locks() {
    let r = reg();
    let ids = r.reserve("t", vec![(b"a".to_vec(), loc(1, 0, 5)), (b"b".to_vec(), loc(1, 1, 5))], 100);
    r.commit(&[ids[1].clone().unwrap()], 0).0[0].clone().unwrap();
    r.lookup_and_lock(&[b"b"], 10, 0);
    assert!(r.expire(99).is_empty());
    assert_eq!(r.stats(99).locked_keys, 0, "the housekeeping sweep drops expired locks");
    let freed = r.expire(100);
    assert_eq!(freed, vec![loc(1, 0, 5)]);
    assert_eq!(r.commit(&[ids[0].clone().unwrap()], 101).0[0].as_ref().unwrap_err().kind(), ErrorKind::NotFound);
    let s = r.stats(101);
    assert_eq!((s.reserved, s.reservations_expired, s.keys), (0, 1, 1));
    assert!(r.present(&[b"a"]) == vec![false], "an expired reservation frees the key");
}

#[test]
fn tenants_and_listing() {
    let r = reg();
    for i in 0..25u8 {
        let tenant = if i % 5 == 0 { "x" } else { "y" };
        let id = r.reserve(tenant, vec![(vec![i], loc(1, i as u64, 10 + i as u64))], 100)[0].clone().unwrap();
        r.commit(&[id], 0);
    }
    r.delete(&[&[0u8]], 0)[0].clone().unwrap();
    let s = r.stats(0);
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
    let a = r.reserve("t", vec![(b"n1".to_vec(), loc(1, 0, PAGE)), (b"n2".to_vec(), loc(2, 0, PAGE))], 9);
    r.commit(&[a[0].clone().unwrap(), a[1].clone().unwrap()], 0);
    let v = r.evict(2, 5, PAGE, 0);
    assert_eq!(v.len(), 1);
    assert_eq!(v[0].node, 2);
    assert_eq!(r.exists(&[b"n1", b"n2"]), vec![true, false]);
}

#[test]
fn batched_lookups_resolve_every_key_of_a_large_registry() {
    // Enough keys that 7-bit hash tags collide within probe groups, so the
    // batched probe's first candidate is often another key's entry.
    let r = reg();
    let n = 20_000u64;
    let key = |i: u64| format!("key-{i}").into_bytes();
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let items = chunk.iter().map(|&i| (key(i), loc(1 + (i % 2) as u32, i, PAGE))).collect();
        let ids: Vec<u64> = r.reserve("t", items, 9).into_iter().map(|x| x.unwrap()).collect();
        r.commit(&ids, 0);
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
    assert_eq!(r.stats(1).locked_keys, 0);
}

#[test]
fn a_batch_touches_each_nodes_entries_in_key_order() {
    let r = reg();
    let names: [&[u8]; 6] = [b"a1", b"b2", b"c1", b"d2", b"e1", b"f2"];
    for (i, k) in names.iter().enumerate() {
        let node = (k[1] - b'0') as u32;
        let id = r.reserve("t", vec![(k.to_vec(), loc(node, i as u64, PAGE))], 9)[0].clone().unwrap();
        r.commit(&[id], 0);
    }
    // Touch in a mixed order, with a key twice and a miss.
    let batch: [&[u8]; 6] = [b"c1", b"f2", b"a1", b"zz", b"b2", b"c1"];
    r.lookup_and_lock(&batch, 1_000, 1);
    r.unlock(&[b"c1", b"f2", b"a1", b"b2", b"c1"], 1);
    // Victims in LRU order; index i of `names` is at loc(node, i).
    let order = |node| r.evict(node, 100, PAGE, 2).into_iter().map(|l| l.offset / (PAGE * 16)).collect::<Vec<_>>();
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
    let (_, seq_before) = r.commit(&[], 0);
    assert_eq!(seq_before, 1);
    r.delete(&[b"b"], 0)[0].clone().unwrap();
    assert_eq!(r.evict(1, 1, PAGE, 0).len(), 1); // "a" is least recently used
    let (ev, next, truncated) = r.removed_since(0, 10);
    assert!(!truncated);
    let got: Vec<(&[u8], bool, u64)> = ev.iter().map(|e| (e.key.as_slice(), e.evicted, e.size)).collect();
    assert_eq!(got, vec![(&b"b"[..], false, PAGE), (&b"a"[..], true, PAGE)]);
    assert_eq!(next, 3);
    assert_eq!(r.commit(&[], 0).1, 3, "commit reports the log position");
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

// ---- model-based property test ------------------------------------------

#[derive(Debug, Clone)]
enum Op {
    Reserve(u8, u8),
    Commit(u8),
    Abort(u8),
    Lookup(u8),
    /// A batch of two, applied in order (may repeat a key).
    Lookup2(u8, u8),
    Unlock(u8),
    Delete(u8),
    /// (node, pages)
    Evict(u32, u8),
    Advance(u8),
}

fn op() -> impl Strategy<Value = Op> {
    let k = 0u8..12;
    prop_oneof![
        (k.clone(), 1u8..4).prop_map(|(k, p)| Op::Reserve(k, p)),
        k.clone().prop_map(Op::Commit),
        k.clone().prop_map(Op::Abort),
        k.clone().prop_map(Op::Lookup),
        (k.clone(), k.clone()).prop_map(|(a, b)| Op::Lookup2(a, b)),
        k.clone().prop_map(Op::Unlock),
        k.clone().prop_map(Op::Delete),
        (1u32..3, 1u8..6).prop_map(|(n, p)| Op::Evict(n, p)),
        (1u8..40).prop_map(Op::Advance),
    ]
}

#[derive(Debug, Clone)]
struct M {
    res: u64,
    committed: bool,
    pages: u64,
    locks: u32,
    expiry: u64,
}

const TTL: u64 = 30;

fn node(k: u8) -> u32 {
    1 + (k % 2) as u32
}

/// The model's side of one key of a lookup-and-lock batch.
/// Keys whose locks were dropped together (expired locks swept in one
/// pass) re-enter the order at once, in no defined order among themselves:
/// key -> the sweep that released it.
type Ties = HashMap<u8, u64>;

/// Move `k` to the most recent end on its own.
fn to_mru(lru: &mut Vec<u8>, ties: &mut Ties, k: u8) {
    lru.retain(|&x| x != k);
    lru.push(k);
    ties.remove(&k);
}

/// Drop every expired lock at once, as one sweep.
fn sweep(m: &mut HashMap<u8, M>, lru: &mut Vec<u8>, ties: &mut Ties, now: u64, sweep_no: &mut u64) {
    let mut stale: Vec<u8> = m.iter().filter(|(_, e)| e.locks > 0 && e.expiry <= now).map(|(k, _)| *k).collect();
    stale.sort();
    *sweep_no += 1;
    for k in stale {
        m.get_mut(&k).unwrap().locks = 0;
        to_mru(lru, ties, k);
        ties.insert(k, *sweep_no);
    }
}

fn model_lookup(
    m: &mut HashMap<u8, M>,
    lru: &mut Vec<u8>,
    ties: &mut Ties,
    k: u8,
    found: bool,
    now: u64,
) -> Result<(), TestCaseError> {
    match m.get_mut(&k) {
        Some(e) if e.committed => {
            prop_assert!(found);
            if e.expiry <= now {
                e.locks = 0;
            }
            e.locks += 1;
            e.expiry = e.expiry.max(now + TTL);
            to_mru(lru, ties, k);
        }
        _ => prop_assert!(!found, "missing or reserved key {} was returned", k),
    }
    Ok(())
}
const RES_TIMEOUT: u64 = 50;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn registry_matches_model(ops in proptest::collection::vec(op(), 1..150)) {
        let r = reg();
        let mut m: HashMap<u8, M> = HashMap::new();
        let mut deadline: HashMap<u8, u64> = HashMap::new();
        let mut lru: Vec<u8> = vec![]; // front = least recent
        // Locked keys are out of the order; unlocking puts them back as most recent.
        let mut ties = Ties::new();
        let mut sweeps = 0u64;
        let mut now = 0u64;
        for o in ops {
            let key = |k: u8| vec![k];
            match o {
                Op::Reserve(k, p) => {
                    // Odd keys live on node 2, even ones on node 1.
                    let out = r.reserve("t", vec![(key(k), loc(node(k), k as u64, p as u64 * PAGE))], now + RES_TIMEOUT);
                    if let std::collections::hash_map::Entry::Vacant(e) = m.entry(k) {
                        let res = out[0].clone().unwrap();
                        e.insert(M { res, committed: false, pages: p as u64, locks: 0, expiry: 0 });
                        deadline.insert(k, now + RES_TIMEOUT);
                    } else {
                        prop_assert_eq!(out[0].as_ref().unwrap_err().kind(), ErrorKind::AlreadyExists);
                    }
                }
                Op::Commit(k) => {
                    let res = m.get(&k).map(|e| e.res).unwrap_or(1);
                    let out = r.commit(&[res], now).0;
                    match m.get_mut(&k) {
                        Some(e) if !e.committed => { prop_assert!(out[0].is_ok()); e.committed = true; to_mru(&mut lru, &mut ties, k); }
                        Some(_) => prop_assert_eq!(out[0].as_ref().unwrap_err().kind(), ErrorKind::FailedPrecondition),
                        None => prop_assert!(out[0].is_err()),
                    }
                }
                Op::Abort(k) => {
                    let res = m.get(&k).map(|e| e.res).unwrap_or(1);
                    let out = r.abort(&[res]);
                    if m.get(&k).is_some_and(|e| !e.committed) {
                        prop_assert!(out[0].is_ok());
                        m.remove(&k);
                    } else {
                        prop_assert!(out[0].is_err());
                    }
                }
                Op::Lookup(k) => {
                    let out = r.lookup_and_lock(&[&key(k)], TTL, now);
                    model_lookup(&mut m, &mut lru, &mut ties, k, out[0].is_some(), now)?;
                }
                Op::Lookup2(a, b) => {
                    let out = r.lookup_and_lock(&[&key(a), &key(b)], TTL, now);
                    model_lookup(&mut m, &mut lru, &mut ties, a, out[0].is_some(), now)?;
                    model_lookup(&mut m, &mut lru, &mut ties, b, out[1].is_some(), now)?;
                }
                Op::Unlock(k) => {
                    let out = r.unlock(&[&key(k)], now);
                    match m.get_mut(&k) {
                        Some(e) if e.locks > 0 && e.expiry > now => {
                            prop_assert!(out[0].is_ok());
                            e.locks -= 1;
                            if e.locks == 0 { to_mru(&mut lru, &mut ties, k); }
                        }
                        Some(e) => {
                            if e.locks > 0 { to_mru(&mut lru, &mut ties, k); }
                            e.locks = 0;
                            prop_assert_eq!(out[0].as_ref().unwrap_err().kind(), ErrorKind::FailedPrecondition); }
                        None => prop_assert_eq!(out[0].as_ref().unwrap_err().kind(), ErrorKind::NotFound),
                    }
                }
                Op::Delete(k) => {
                    let out = r.delete(&[&key(k)], now);
                    match m.get(&k) {
                        Some(e) if e.committed && !(e.locks > 0 && e.expiry > now) => {
                            prop_assert!(out[0].is_ok());
                            m.remove(&k);
                            lru.retain(|&x| x != k);
                            ties.remove(&k);
                        }
                        Some(_) => prop_assert_eq!(out[0].as_ref().unwrap_err().kind(), ErrorKind::FailedPrecondition),
                        None => prop_assert_eq!(out[0].as_ref().unwrap_err().kind(), ErrorKind::NotFound),
                    }
                }
                Op::Evict(n, p) => {
                    let freed = r.evict(n, p as u64, PAGE, now);
                    // Victims in LRU order over unlocked keys (keys released by
                    // one sweep in any order among themselves); expired locks
                    // are swept once the node has no other candidate.
                    let mut got = 0;
                    let mut swept = false;
                    let mut freed_keys: Vec<u8> = freed.iter().map(|l| (l.offset / (PAGE * 16)) as u8).collect();
                    for &f in &freed_keys {
                        prop_assert!(got < p as u64, "evicted past the target");
                        let mut front: Vec<u8> = lru.iter().copied().filter(|&k| node(k) == n && m[&k].locks == 0).collect();
                        if front.is_empty() && !swept {
                            sweep(&mut m, &mut lru, &mut ties, now, &mut sweeps);
                            swept = true;
                            front = lru.iter().copied().filter(|&k| node(k) == n && m[&k].locks == 0).collect();
                        }
                        let first = *front.first().ok_or_else(|| TestCaseError::fail(format!("victim {f} but no candidate")))?;
                        let ok = f == first || (ties.contains_key(&first) && ties.get(&f) == ties.get(&first));
                        prop_assert!(ok, "victim {} is not next in LRU order (next {}; order {:?})", f, first, lru);
                        got += m[&f].pages;
                        m.remove(&f);
                        lru.retain(|&x| x != f);
                        ties.remove(&f);
                    }
                    if got < p as u64 {
                        if !swept { sweep(&mut m, &mut lru, &mut ties, now, &mut sweeps); }
                        prop_assert!(!lru.iter().any(|&k| node(k) == n && m[&k].locks == 0), "stopped with candidates left");
                    }
                    freed_keys.sort();
                    for k in freed_keys {
                        prop_assert_eq!(r.lookup_and_lock(&[&key(k)], TTL, now), vec![None]);
                    }
                }
                Op::Advance(d) => {
                    now += d as u64;
                    let freed = r.expire(now);
                    let mut want: Vec<u8> = m.iter()
                        .filter(|(k, e)| !e.committed && deadline[*k] <= now)
                        .map(|(k, _)| *k).collect();
                    want.sort();
                    let mut got: Vec<u8> = freed.iter().map(|l| (l.offset / (PAGE * 16)) as u8).collect();
                    got.sort();
                    prop_assert_eq!(&got, &want);
                    for k in want { m.remove(&k); }
                    sweep(&mut m, &mut lru, &mut ties, now, &mut sweeps);
                }
            }
            let s = r.stats(now);
            let committed: Vec<&M> = m.values().filter(|e| e.committed).collect();
            prop_assert_eq!(s.keys, committed.len() as u64);
            prop_assert_eq!(s.reserved, (m.len() - committed.len()) as u64);
            prop_assert_eq!(s.bytes_stored, committed.iter().map(|e| e.pages * PAGE).sum::<u64>());
            prop_assert_eq!(s.locked_keys, m.values().filter(|e| e.locks > 0).count() as u64, "locked count");
            for k in 0..12u8 {
                let want = m.get(&k).is_some_and(|e| e.committed);
                prop_assert_eq!(r.exists(&[&[k]])[0], want, "exists({}) disagrees", k);
            }
        }
    }
}
