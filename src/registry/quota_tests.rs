//! Quotas and guaranteed shares through the registry and the local
//! directory (the path every reserve takes on a node or the primary).
use std::sync::Arc;

use super::ops::ReserveCall;
use super::*;
use crate::error::ErrorKind;

const PAGE: u64 = 4096;
const NODE: NodeId = NodeId(1);

fn loc(i: u64, len: u64) -> Location {
    Location { node: NODE, region: RegionId(0), offset: i * PAGE, length: len, generation: 1, version: 0 }
}

fn quotas(text: &str) -> Arc<LocalRegistry> {
    let cfg = crate::config::Config::parse(text).unwrap();
    cfg.validate().unwrap();
    Arc::new(LocalRegistry::new("lru", 1024).unwrap().with_quotas(cfg.quotas))
}

/// Keys are "<tenant><n>" at page n.
fn key(tenant: &str, n: u64) -> Vec<u8> {
    format!("{tenant}{n}").into_bytes()
}

/// Reserve (with `shortfall` pages to evict) and commit one 10-byte object
/// per `n` through the directory; the keys freed on the way.
async fn store(d: &LocalDirectory, tenant: &str, ns: &[u64], shortfall: u64) -> (Vec<Result<Location>>, Vec<u64>) {
    let call =
        ReserveCall::local(NODE, tenant, ns.iter().map(|&n| (key(tenant, n), loc(n, 10))).collect(), shortfall, PAGE);
    let r = d.reserve(call).await.unwrap();
    let mut out = vec![];
    for id in r.ids {
        out.push(match id {
            Ok(id) => d.commit(&[id], Session::LOCAL).await.unwrap().0.remove(0),
            Err(e) => Err(e),
        });
    }
    (out, r.freed.iter().map(|l| l.offset / PAGE).collect())
}

fn present(r: &LocalRegistry, tenant: &str, ns: &[u64]) -> Vec<bool> {
    let keys: Vec<Vec<u8>> = ns.iter().map(|&n| key(tenant, n)).collect();
    r.exists(&keys.iter().map(|k| k.as_slice()).collect::<Vec<_>>())
}

#[tokio::test]
async fn a_tenant_at_its_quota_evicts_its_own_keys_never_another_s() {
    let r = quotas("[quotas.tenants.a]\nbytes = 30\n");
    let d = LocalDirectory::new(r.clone());
    // b's keys are the oldest of all: plain LRU over the node would take them.
    assert!(store(&d, "b", &[0, 1], 0).await.0.iter().all(|x| x.is_ok()));
    assert!(store(&d, "a", &[2, 3, 4], 0).await.0.iter().all(|x| x.is_ok()));
    let (out, freed) = store(&d, "a", &[5, 6], 0).await;
    assert!(out.iter().all(|x| x.is_ok()), "{out:?}");
    assert_eq!(freed, vec![2, 3], "a's two oldest keys make room, in LRU order");
    assert_eq!(present(&r, "b", &[0, 1]), vec![true, true], "b's keys are untouched");
    assert_eq!(present(&r, "a", &[2, 3, 4, 5, 6]), vec![false, false, true, true, true]);
    let s = r.stats();
    assert_eq!((s.evictions, s.quota_evictions), (2, 2));
    let a = s.tenants.iter().find(|t| t.tenant == "a").unwrap();
    assert_eq!((a.bytes, a.keys, a.quota_bytes, a.guaranteed_bytes), (30, 3, 30, 0));
    let b = s.tenants.iter().find(|t| t.tenant == "b").unwrap();
    assert_eq!((b.bytes, b.quota_bytes), (20, 0), "b has no quota");
    let (log, _, _) = r.removed_since(0, 10);
    assert!(log.iter().all(|x| x.tenant == "a" && x.reason == Removal::Evicted), "{log:?}");
}

#[tokio::test]
async fn what_the_quota_cannot_make_room_for_is_refused_and_evicts_nothing_else() {
    let r = quotas("[quotas]\ndefault_bytes = 30\n");
    let d = LocalDirectory::new(r.clone());
    assert!(store(&d, "a", &[0, 1], 0).await.0.iter().all(|x| x.is_ok()));
    assert!(store(&d, "b", &[2], 0).await.0.iter().all(|x| x.is_ok()));
    // a's keys are in use: nothing of a's own can go, and b's is not a's to take.
    let keys = [key("a", 0), key("a", 1)];
    r.lookup_and_lock(&[&keys[0], &keys[1]], 60_000, 0);
    let (out, freed) = store(&d, "a", &[3, 4], 0).await;
    assert!(out[0].is_ok(), "10 more bytes fit: {out:?}");
    let e = out[1].as_ref().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ResourceExhausted);
    assert!(e.message().contains("tenant \"a\" is at its quota: 30 of 30 bytes"), "{}", e.message());
    assert!(freed.is_empty());
    assert_eq!(present(&r, "b", &[2]), vec![true]);
    assert_eq!(present(&r, "a", &[0, 1, 3, 4]), vec![true, true, true, false]);
    // An object larger than the whole quota can never fit.
    let big = ReserveOpts::local(1_000);
    let e = r.reserve("b", vec![(b"huge".to_vec(), loc(9, 31))], big).remove(0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ResourceExhausted);
    assert_eq!(r.stats().tenants.iter().find(|t| t.tenant == "b").unwrap().reserving_bytes, 0);
}

#[tokio::test]
async fn open_reservations_count_against_the_quota_until_they_end() {
    let r = quotas("[quotas.tenants.a]\nbytes = 25\n");
    let first = r.reserve("a", vec![(key("a", 0), loc(0, 20))], ReserveOpts::local(1_000)).remove(0).unwrap();
    let second = r.reserve("a", vec![(key("a", 1), loc(1, 10))], ReserveOpts::local(1_000)).remove(0);
    assert_eq!(second.unwrap_err().kind(), ErrorKind::ResourceExhausted, "20 being written + 10 > 25");
    r.abort(&[first], Session::LOCAL).remove(0).unwrap();
    // An expired one neither.
    let short = r.reserve("a", vec![(key("a", 2), loc(2, 25))], ReserveOpts::local(5)).remove(0);
    assert!(short.is_ok(), "the aborted reservation no longer counts");
    r.expire(1_000);
    let again = r.reserve("a", vec![(key("a", 1), loc(1, 10))], ReserveOpts::local(2_000)).remove(0);
    assert!(again.is_ok(), "the expired reservation no longer counts");
    assert_eq!(r.stats().tenants[0].reserving_bytes, 10, "only the open reservation of a1 counts");
}

#[tokio::test]
async fn a_guaranteed_share_is_never_evicted_for_another_tenant() {
    let r = quotas("[quotas.tenants.b]\nguaranteed_bytes = 20\n");
    let d = LocalDirectory::new(r.clone());
    assert!(store(&d, "b", &[0, 1, 2], 0).await.0.iter().all(|x| x.is_ok()));
    assert!(store(&d, "a", &[3], 0).await.0.iter().all(|x| x.is_ok()));
    // a's store needs 3 pages: b may lose 10 of its 30 bytes, then a's own.
    let (out, freed) = store(&d, "a", &[4], 3).await;
    assert!(out[0].is_ok());
    assert_eq!(freed, vec![0, 3], "b0 (above b's share), then a3; b1 and b2 are b's guaranteed 20 bytes");
    assert_eq!(present(&r, "b", &[1, 2]), vec![true, true]);
    // Nothing else can go for a but its new key.
    assert_eq!(r.evict_for(Some("a"), NODE, 5, PAGE, 0).iter().map(|l| l.offset / PAGE).collect::<Vec<_>>(), [4]);
    // b's own stores may evict its own keys, still in LRU order.
    let (_, freed) = store(&d, "b", &[5], 1).await;
    assert_eq!(freed, vec![1]);
    // With no tenant named (eviction ahead of need) every share is kept.
    assert!(r.evict(NODE, 5, PAGE, 0).is_empty());
}

#[tokio::test]
async fn a_tenant_may_evict_every_key_of_its_own_but_not_for_what_can_never_fit() {
    let r = quotas("[quotas]\ndefault_bytes = 30\n");
    let d = LocalDirectory::new(r.clone());
    assert!(store(&d, "a", &[0, 1, 2], 0).await.0.iter().all(|x| x.is_ok()));
    // An object above the whole quota: refused, a's keys stay.
    let call = ReserveCall {
        node: NODE,
        tenant: "a",
        items: vec![(b"huge".to_vec(), loc(9, 31))],
        owner: Session::LOCAL,
        server_writes: false,
        timeout_ms: 1_000,
        shortfall_pages: 0,
        page_size: PAGE,
        hints: vec![],
    };
    let out = d.reserve(call).await.unwrap();
    assert_eq!(out.ids[0].as_ref().unwrap_err().kind(), ErrorKind::ResourceExhausted);
    assert!(out.freed.is_empty(), "nothing is evicted for an object that can never fit");
    assert_eq!(present(&r, "a", &[0, 1, 2]), vec![true; 3]);
    // One that needs the whole quota takes all three (the tenant is
    // forgotten on the way and comes back with the new key).
    let (out, freed) = store(&d, "a", &[3, 4, 5], 0).await;
    assert!(out.iter().all(|x| x.is_ok()), "{out:?}");
    assert_eq!(freed, vec![0, 1, 2]);
    assert_eq!(r.stats().tenants[0].bytes, 30);
}

#[test]
fn without_quotas_the_per_tenant_order_is_not_kept() {
    let r = LocalRegistry::new("lru", 1024).unwrap();
    assert!(r.make_room("a", u64::MAX, 0).is_empty());
    let id = r.reserve("a", vec![(key("a", 0), loc(0, 10))], ReserveOpts::local(1_000)).remove(0).unwrap();
    r.commit(&[id], Session::LOCAL, &mut |_, _| {}).0[0].as_ref().unwrap();
    assert!(r.make_room("a", u64::MAX, 0).is_empty(), "no quota: nothing is evicted however much is asked");
    let t = &r.stats().tenants[0];
    assert_eq!((t.quota_bytes, t.guaranteed_bytes), (0, 0));
}

#[derive(Debug, Clone)]
enum Op {
    Store { tenant: usize, len: u64, commit: bool },
    Lock(usize),
    UnlockAll,
    Evict { tenant: usize, pages: u64 },
    Expire,
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (0..3usize, 1..40u64, proptest::bool::weighted(0.8)).prop_map(|(tenant, len, commit)| Op::Store { tenant, len, commit }),
        1 => (0..64usize).prop_map(Op::Lock),
        1 => Just(Op::UnlockAll),
        2 => (0..3usize, 1..6u64).prop_map(|(tenant, pages)| Op::Evict { tenant, pages }),
        1 => Just(Op::Expire),
    ]
}

const TENANTS: [&str; 3] = ["a", "b", "c"];

proptest::proptest! {
    /// Under any mix of stores, locks, evictions and expiries: no tenant is
    /// ever past its quota, node eviction for one tenant never leaves
    /// another below its guaranteed share, and the accounting adds up.
    #[test]
    fn quotas_and_shares_hold_under_any_sequence(ops in proptest::collection::vec(op(), 1..120)) {
        let r = quotas("[quotas]\ndefault_bytes = 60\n[quotas.tenants.b]\nbytes = 100\nguaranteed_bytes = 40\n\
                        [quotas.tenants.c]\nbytes = 0\nguaranteed_bytes = 30\n");
        let d = LocalDirectory::new(r.clone());
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let mut next = 0u64;
        let mut stored: Vec<Vec<u8>> = vec![];
        for op in ops {
            let before = r.stats();
            let logged = r.removed_since(0, usize::MAX).0.len();
            match op {
                Op::Store { tenant, len, commit } => {
                    next += 1;
                    let k = key(TENANTS[tenant], next);
                    let call = ReserveCall {
                        node: NODE, tenant: TENANTS[tenant], items: vec![(k.clone(), loc(next, len))],
                        owner: Session::LOCAL, server_writes: false, timeout_ms: 50, shortfall_pages: 0,
                        page_size: PAGE,
                        hints: vec![],
                    };
                    let out = rt.block_on(d.reserve(call)).unwrap();
                    if let (Ok(id), true) = (&out.ids[0], commit) {
                        rt.block_on(d.commit(&[*id], Session::LOCAL)).unwrap().0[0].as_ref().unwrap();
                        stored.push(k);
                    }
                    // Only the storing tenant's keys made room.
                    let log = r.removed_since(0, usize::MAX).0;
                    proptest::prop_assert_eq!(log.len() - logged, out.freed.len());
                    proptest::prop_assert!(log[logged..].iter().all(|x| x.tenant == TENANTS[tenant]), "{:?}", log);
                }
                Op::Lock(i) => {
                    if let Some(k) = stored.get(i) {
                        r.lookup_and_lock(&[k.as_slice()], 1_000_000, 0);
                    }
                }
                Op::UnlockAll => {
                    r.release_session(Session::LOCAL);
                }
                Op::Evict { tenant, pages } => {
                    let freed = r.evict_for(Some(TENANTS[tenant]), NODE, pages, PAGE, 0);
                    let after = r.stats();
                    for t in after.tenants.iter().filter(|t| t.tenant != TENANTS[tenant]) {
                        let was = before.tenants.iter().find(|b| b.tenant == t.tenant).unwrap();
                        if t.bytes < was.bytes {
                            proptest::prop_assert!(t.bytes + t.reserving_bytes >= t.guaranteed_bytes,
                                "{} went below its share: {:?} (freed {:?})", t.tenant, t, freed);
                        }
                    }
                }
                Op::Expire => {
                    r.expire(u64::MAX / 2);
                }
            }
            let s = r.stats();
            proptest::prop_assert_eq!(s.tenants.iter().map(|t| t.bytes).sum::<u64>(), s.bytes_stored);
            proptest::prop_assert_eq!(s.tenants.iter().map(|t| t.keys).sum::<u64>(), s.keys);
            for t in &s.tenants {
                proptest::prop_assert!(t.quota_bytes == 0 || t.bytes + t.reserving_bytes <= t.quota_bytes, "{:?}", t);
            }
        }
    }
}
