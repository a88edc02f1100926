//! One conformance suite for the registry boundary (`Directory`), run on
//! the registry in process and on a follower's forwarded registry talking
//! to a real primary's peer service over loopback TCP: both must answer
//! every call the same way.
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use cxlkv::cluster::follower::{self, ForwardClaimer};
use cxlkv::cluster::forward::{Fence, Forwarded, Ident};
use cxlkv::config::ClusterConfig;
use cxlkv::error::ErrorKind;
use cxlkv::handler::Claimer;
use cxlkv::pool::{NodeId, RegionId};
use cxlkv::registry::ops::ReserveCall;
use cxlkv::registry::{Directory, LocalDirectory, LocalRegistry, Location, Ops, Scope, Session};

mod common;
use common::loopback::{self, PAGE};

/// A directory under test, the node it stores for, and a region of that
/// node to place objects in.
struct Subject {
    dir: Arc<dyn Directory>,
    node: NodeId,
    region: RegionId,
    generation: u64,
    _keep: Vec<Box<dyn std::any::Any + Send + Sync>>,
    _tmp: tempfile::TempDir,
}

fn local() -> Subject {
    let tmp = tempfile::tempdir().unwrap();
    let p = loopback::pool(tmp.path());
    let region = p.claim_region(NodeId(1)).unwrap().unwrap();
    let generation = p.region_state(region).unwrap().generation;
    let dir = Arc::new(LocalDirectory::new(Arc::new(LocalRegistry::new("lru", 64).unwrap())));
    Subject { dir, node: NodeId(1), region, generation, _keep: vec![Box::new(p)], _tmp: tmp }
}

/// A primary serving its peer service on loopback, and a follower's
/// forwarded registry joined to it; with `hold_idle_ms` > 0 the follower
/// answers lookups of keys it holds itself (`cluster::holds`).
async fn forwarded_with(hold_idle_ms: u64) -> Subject {
    let cfg = ClusterConfig { node_name: "f".into(), primary: "p".into(), ..ClusterConfig::default() };
    let loopback::Loopback { pool: p, handler: h, ldir, mut client, tmp, .. } = loopback::primary(&cfg).await;
    let (joined, _) = follower::join(&mut client, &cfg, &p.superblock().uuid_string(), 99, 10_000).await.unwrap();
    let ident = Arc::new(Ident::default());
    ident.node.store(joined.node.0 as u64, Ordering::Release);
    ident.instance.store(99, Ordering::Release);
    let fence = Arc::new(Fence::new(60_000));
    fence.renew();
    let timeout = Duration::from_secs(2);
    let claimer = ForwardClaimer { client: client.clone(), ident: ident.clone(), timeout };
    let (region, generation) = claimer.claim(joined.node).await.unwrap().unwrap();
    let mut fw = Forwarded::new(client, ident, fence, timeout);
    if hold_idle_ms > 0 {
        fw = fw.with_holds(hold_idle_ms, u64::MAX);
    }
    let fw = Arc::new(fw);
    let keep: Vec<Box<dyn std::any::Any + Send + Sync>> =
        vec![Box::new(p), Box::new(h), Box::new(fw.clone()), Box::new(ldir)];
    Subject { dir: fw, node: joined.node, region, generation, _keep: keep, _tmp: tmp }
}

async fn forwarded() -> Subject {
    forwarded_with(0).await
}

async fn held() -> Subject {
    forwarded_with(200).await
}

impl Subject {
    fn loc(&self, i: u64, length: u64) -> Location {
        Location {
            node: self.node,
            region: self.region,
            offset: i * PAGE,
            length,
            generation: self.generation,
            version: 0,
        }
    }

    async fn reserve(&self, owner: Session, items: &[(&str, u64)], shortfall: u64) -> cxlkv::registry::Reserved {
        let call = ReserveCall {
            node: self.node,
            tenant: "t",
            items: items.iter().map(|(k, i)| (k.as_bytes().to_vec(), self.loc(*i, 1000))).collect(),
            owner,
            server_writes: false,
            timeout_ms: 10_000,
            shortfall_pages: shortfall,
            page_size: PAGE,
            hints: vec![],
        };
        self.dir.reserve(call).await.unwrap()
    }

    async fn put(&self, owner: Session, key: &str, i: u64) -> Location {
        let r = self.reserve(owner, &[(key, i)], 0).await;
        let id = *r.ids[0].as_ref().unwrap();
        self.dir.commit(&[id], owner).await.unwrap().0.remove(0).unwrap()
    }
}

const S1: Session = Session(1);
const S2: Session = Session(2);

async fn stores_are_write_once_and_visible(s: Subject) {
    let r = s.reserve(S1, &[("a", 0), ("b", 1)], 0).await;
    assert!(r.ids.iter().all(|x| x.is_ok()));
    assert_eq!(s.dir.exists(&[b"a"], &Scope::All).await.unwrap(), vec![false], "not visible before commit");
    let again = s.reserve(S2, &[("a", 2)], 0).await;
    assert_eq!(again.ids[0].as_ref().unwrap_err().kind(), ErrorKind::AlreadyExists, "being written");
    let ids: Vec<_> = r.ids.iter().map(|x| *x.as_ref().unwrap()).collect();
    let (out, _) = s.dir.commit(&ids, S1).await.unwrap();
    assert_eq!(out[0].as_ref().unwrap(), &s.loc(0, 1000));
    assert_eq!(s.dir.exists(&[b"a", b"b", b"c"], &Scope::All).await.unwrap(), vec![true, true, false]);
    let again = s.reserve(S2, &[("a", 3)], 0).await;
    assert_eq!(again.ids[0].as_ref().unwrap_err().kind(), ErrorKind::AlreadyExists, "committed");
    let (_, hits) = s.dir.lookup(&[], &[b"a", b"zz"], 1000, S2, &Scope::All).await.unwrap();
    assert_eq!(hits[0].as_ref().unwrap(), &Some(s.loc(0, 1000)));
    assert_eq!(hits[1].as_ref().unwrap(), &None);
}

async fn reservations_belong_to_their_session(s: Subject) {
    let r = s.reserve(S1, &[("k", 0)], 0).await;
    let id = *r.ids[0].as_ref().unwrap();
    let (out, _) = s.dir.commit(&[id], S2).await.unwrap();
    assert_eq!(out[0].as_ref().unwrap_err().kind(), ErrorKind::PermissionDenied);
    assert_eq!(s.dir.abort(&[id], S2).await.unwrap()[0].as_ref().unwrap_err().kind(), ErrorKind::PermissionDenied);
    assert_eq!(s.dir.abort(&[id], S1).await.unwrap()[0].as_ref().unwrap(), &s.loc(0, 1000));
    let (out, _) = s.dir.commit(&[id], S1).await.unwrap();
    assert_eq!(out[0].as_ref().unwrap_err().kind(), ErrorKind::NotFound, "aborted");
}

async fn locks_protect_and_go_with_their_session(s: Subject) {
    s.put(S1, "k", 0).await;
    s.dir.lookup(&[], &[b"k"], 60_000, S1, &Scope::All).await.unwrap();
    let d = s.dir.delete(&[b"k"], &Scope::All).await.unwrap();
    assert_eq!(d[0].as_ref().unwrap_err().kind(), ErrorKind::FailedPrecondition, "locked");
    let u = s.dir.unlock(&[b"k"], S2).await.unwrap();
    assert_eq!(u[0].as_ref().unwrap_err().kind(), ErrorKind::PermissionDenied, "another session's lock");
    assert_eq!(s.dir.stats().await.unwrap().locked_keys, 1);
    assert_eq!(s.dir.release_session(S1).await.unwrap(), 1);
    assert_eq!(s.dir.stats().await.unwrap().locked_keys, 0);
    let d = s.dir.delete(&[b"k"], &Scope::All).await.unwrap();
    assert_eq!(d[0].as_ref().unwrap(), &s.loc(0, 1000));
    let (removed, _, _) = s.dir.removed_since(0, 10).await.unwrap();
    assert_eq!(removed.iter().map(|r| r.key.as_slice()).collect::<Vec<_>>(), vec![b"k".as_slice()]);
}

async fn a_shortfall_evicts_the_nodes_oldest_entries_in_the_same_call(s: Subject) {
    for i in 0..4 {
        s.put(S1, &format!("old{i}"), i).await;
    }
    s.dir.lookup(&[], &[b"old0"], 60_000, S1, &Scope::All).await.unwrap(); // locked: never a victim
    let r = s.reserve(S1, &[("new", 10)], 2).await;
    assert!(r.ids[0].is_ok());
    let victims: Vec<u64> = r.freed.iter().map(|l| l.offset / PAGE).collect();
    assert_eq!(victims, vec![1, 2], "the least recently used unlocked entries, enough for the shortfall");
    assert_eq!(s.dir.exists(&[b"old0", b"old1", b"old3"], &Scope::All).await.unwrap(), vec![true, false, true]);
    assert_eq!(s.dir.stats().await.unwrap().evictions, 2);
}

async fn a_region_is_emptied_for_a_large_object_only_where_none_of_it_is_in_use(s: Subject) {
    for i in 0..3 {
        s.put(S1, &format!("e{i}"), i).await;
    }
    let open = s.reserve(S1, &[("open", 5)], 0).await;
    let none = s.dir.evict_region(S2, "t", s.node, &[s.region], 1000).await.unwrap();
    assert!(none.is_empty(), "an open reservation keeps the region");
    s.dir.abort(&[*open.ids[0].as_ref().unwrap()], S1).await.unwrap();
    let other = NodeId(s.node.0 + 1);
    assert!(s.dir.evict_region(S2, "t", other, &[s.region], 1000).await.unwrap().is_empty(), "another node's");
    let freed = s.dir.evict_region(S2, "t", s.node, &[s.region], 1000).await.unwrap();
    let mut pages: Vec<u64> = freed.iter().map(|l| l.offset / PAGE).collect();
    pages.sort();
    assert_eq!(pages, vec![0, 1, 2], "every entry of the region, the caller's pages to free");
    assert_eq!(s.dir.exists(&[b"e0", b"e1", b"e2"], &Scope::All).await.unwrap(), vec![false; 3]);
    assert_eq!(s.dir.stats().await.unwrap().evictions, 3);
}

async fn listing_and_scopes(s: Subject) {
    s.put(S1, "k1", 0).await;
    let (keys, next) = s.dir.list(0, 10, None, &Scope::All).await.unwrap();
    assert_eq!((keys.len(), next), (1, 0));
    assert_eq!(keys[0].key, b"k1");
    let other = Scope::tenants(["nobody"]);
    assert_eq!(s.dir.exists(&[b"k1"], &other).await.unwrap(), vec![false]);
    let (_, hits) = s.dir.lookup(&[], &[b"k1"], 1000, S1, &other).await.unwrap();
    assert_eq!(hits[0].as_ref().unwrap_err().kind(), ErrorKind::PermissionDenied);
    assert_eq!(
        s.dir.delete(&[b"k1"], &other).await.unwrap()[0].as_ref().unwrap_err().kind(),
        ErrorKind::PermissionDenied
    );
    assert_eq!(s.dir.stats().await.unwrap().keys, 1);
}

/// Poll every future in order, each pass: on the first pass all of them
/// start before any can finish, so their calls are truly concurrent.
async fn join_all<F: std::future::Future>(fs: Vec<F>) -> Vec<F::Output> {
    use std::task::Poll;
    let mut fs: Vec<_> = fs.into_iter().map(|f| Some(Box::pin(f))).collect();
    let mut out: Vec<Option<F::Output>> = fs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in fs.iter_mut().zip(out.iter_mut()) {
            let Some(fut) = f else { continue };
            match fut.as_mut().poll(cx) {
                Poll::Ready(v) => (*o, *f) = (Some(v), None),
                Poll::Pending => pending = true,
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(Option::unwrap).collect()
}

const CONCURRENT: usize = 200;

/// Many concurrent lookups of different keys: each caller gets the answer
/// for its own keys (a forwarded registry answers them from shared batches).
async fn concurrent_calls_each_get_their_own_answer(s: Subject) {
    let locs: Vec<Location> = put_many(&s, 8).await;
    let names: Vec<String> = (0..CONCURRENT).map(|i| format!("k{}", i % 8)).collect();
    let calls = names.iter().enumerate().map(|(i, k)| {
        let dir = s.dir.clone();
        async move {
            let owner = Session(100 + i as u64);
            dir.lookup(&[], &[k.as_bytes(), b"missing"], 60_000, owner, &Scope::All).await.unwrap().1
        }
    });
    for (i, hits) in join_all(calls.collect()).await.into_iter().enumerate() {
        assert_eq!(hits[0].as_ref().unwrap(), &Some(locs[i % 8]), "call {i}");
        assert_eq!(hits[1].as_ref().unwrap(), &None, "call {i}");
    }
    assert_eq!(s.dir.stats().await.unwrap().locked_keys, 8);
}

async fn put_many(s: &Subject, n: u64) -> Vec<Location> {
    let mut v = vec![];
    for i in 0..n {
        v.push(s.put(S1, &format!("k{i}"), i).await);
    }
    v
}

/// Callers that give up mid-call (their client's deadline) leave nothing
/// stuck behind them: the next call is answered.
async fn callers_that_give_up_block_no_one(s: Subject) {
    s.put(S1, "k", 0).await;
    for _ in 0..20 {
        let gone = tokio::time::timeout(Duration::from_micros(1), s.dir.exists(&[b"k"], &Scope::All)).await;
        assert!(gone.is_err() || gone.unwrap().unwrap() == vec![true]);
    }
    let after = tokio::time::timeout(Duration::from_secs(2), s.dir.exists(&[b"k"], &Scope::All)).await;
    assert_eq!(after.expect("answered after 20 abandoned calls").unwrap(), vec![true]);
}

/// A follower sends concurrent calls in few batches: the first callers
/// each send their own while the rest queue, and the queue goes as one.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_forwarded_calls_are_coalesced() {
    let s = forwarded().await;
    s.put(S1, "k", 0).await;
    let fw = s._keep.iter().find_map(|k| k.downcast_ref::<Arc<Forwarded>>()).unwrap().clone();
    let (calls0, ops0) = fw.sent();
    let calls = (0..CONCURRENT).map(|_| s.dir.exists(&[b"k"], &Scope::All));
    // Every call is made before any answer is taken: the test's one task
    // polls all 200 in one pass (tokio's cooperative budget would make some
    // of them wait for a later pass, behind the first answers, on a loaded
    // machine: then they make batches of their own).
    let all = tokio::task::unconstrained(join_all(calls.collect())).await;
    assert!(all.into_iter().all(|r| r.unwrap() == vec![true]));
    let (calls, ops) = fw.sent();
    assert_eq!(ops - ops0, CONCURRENT as u64, "one forwarded op per call");
    assert!(calls - calls0 <= 4, "{CONCURRENT} concurrent calls took {} forwarded batches", calls - calls0);
}

impl Subject {
    fn kept<T: Clone + 'static>(&self) -> T {
        self._keep.iter().find_map(|k| k.downcast_ref::<T>()).unwrap().clone()
    }
}

/// A key a follower holds is looked up and locked there, without a
/// forwarded call, by any of its clients; the hold goes back once idle.
#[tokio::test(flavor = "multi_thread")]
async fn a_held_key_is_looked_up_without_a_hop_until_it_goes_idle() {
    let s = held().await;
    let fw: Arc<Forwarded> = s.kept();
    let loc = s.put(S1, "k", 0).await;
    let (_, hits) = s.dir.lookup(&[], &[b"k"], 60_000, S1, &Scope::All).await.unwrap();
    assert_eq!(hits[0].as_ref().unwrap(), &Some(loc));
    let sent = fw.sent();
    for owner in [S1, S2, Session(3)] {
        let (unlocked, hits) = s.dir.lookup(&[b"k"], &[b"k"], 60_000, owner, &Scope::All).await.unwrap();
        assert_eq!(hits[0].as_ref().unwrap(), &Some(loc), "{owner:?}");
        assert_eq!(unlocked[0].is_ok(), owner == S1, "{owner:?} unlocks its own lock only");
    }
    assert_eq!(fw.sent(), sent, "answered on the follower");
    let other = Scope::tenants(["nobody"]);
    let (_, hits) = s.dir.lookup(&[], &[b"k"], 60_000, Session(4), &other).await.unwrap();
    assert_eq!(hits[0].as_ref().unwrap_err().kind(), ErrorKind::PermissionDenied, "the key's tenant is checked");
    assert_eq!(fw.sent(), sent);
    // Every reader lets go; the node's lock stays at the primary until the
    // hold has been idle for hold_idle_ms (200 ms here).
    assert!(s.dir.unlock(&[b"k"], S1).await.unwrap()[0].is_ok());
    assert!(s.dir.unlock(&[b"k"], S2).await.unwrap()[0].is_ok());
    assert!(s.dir.unlock(&[b"k"], Session(3)).await.unwrap()[0].is_ok());
    let u = s.dir.unlock(&[b"k"], S1).await.unwrap();
    assert_eq!(u[0].as_ref().unwrap_err().kind(), ErrorKind::FailedPrecondition, "not locked any more");
    fw.sweep_holds().await.unwrap();
    assert_eq!(s.dir.stats().await.unwrap().locked_keys, 1, "held while recently read");
    tokio::time::sleep(Duration::from_millis(300)).await;
    fw.sweep_holds().await.unwrap();
    assert_eq!(s.dir.stats().await.unwrap().locked_keys, 0, "given back once idle");
    assert_eq!(fw.holds().unwrap().len(), 0);
}

/// To the primary a held key is locked: another node cannot delete it and
/// no shortfall evicts it until the follower gives it back.
#[tokio::test(flavor = "multi_thread")]
async fn a_held_key_is_locked_at_the_primary_until_given_back() {
    let s = held().await;
    let fw: Arc<Forwarded> = s.kept();
    let primary: Arc<LocalDirectory> = s.kept();
    for i in 0..3 {
        s.put(S1, &format!("old{i}"), i).await;
    }
    s.dir.lookup(&[], &[b"old0"], 60_000, S1, &Scope::All).await.unwrap();
    assert!(s.dir.unlock(&[b"old0"], S1).await.unwrap()[0].is_ok());
    let d = primary.delete(&[b"old0"], &Scope::All).await.unwrap();
    let e = d[0].as_ref().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::FailedPrecondition, "held by the follower");
    assert!(e.to_string().contains(&format!("held by node(s) {}", s.node.0)), "{e}");
    let r = s.reserve(S1, &[("new", 10)], 1).await;
    assert_eq!(r.freed.iter().map(|l| l.offset / PAGE).collect::<Vec<_>>(), vec![1], "old0 is no victim");
    tokio::time::sleep(Duration::from_millis(300)).await;
    fw.sweep_holds().await.unwrap();
    assert!(primary.delete(&[b"old0"], &Scope::All).await.unwrap()[0].is_ok(), "given back: deletable");
}

/// A key in use for longer than its hold lasts is renewed without the
/// node's locks on it piling up at the primary.
#[tokio::test(flavor = "multi_thread")]
async fn a_hold_in_steady_use_is_renewed_without_piling_up_locks() {
    let s = held().await;
    let primary: Arc<LocalDirectory> = s.kept();
    s.put(S1, "k", 0).await;
    // Holds last the client's TTL + 8 × 200 ms: ~3 renewals in 5 s.
    let t = std::time::Instant::now();
    while t.elapsed() < Duration::from_secs(5) {
        let (_, hits) = s.dir.lookup(&[b"k"], &[b"k"], 50, S1, &Scope::All).await.unwrap();
        assert!(hits[0].as_ref().unwrap().is_some());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let node_locks = primary.unlock(&[b"k".as_slice(); 8], Session::HOLD.on_node(s.node.0)).await.unwrap();
    let n = node_locks.iter().filter(|r| r.is_ok()).count();
    assert!((1..=2).contains(&n), "the node holds {n} locks on the key at the primary");
}

/// A follower's own client deletes a key the follower holds for no reader.
#[tokio::test(flavor = "multi_thread")]
async fn a_follower_lets_go_of_its_hold_for_its_own_delete() {
    let s = held().await;
    s.put(S1, "k", 0).await;
    s.dir.lookup(&[], &[b"k"], 60_000, S1, &Scope::All).await.unwrap();
    let d = s.dir.delete(&[b"k"], &Scope::All).await.unwrap();
    assert_eq!(d[0].as_ref().unwrap_err().kind(), ErrorKind::FailedPrecondition, "a reader still holds it");
    assert!(s.dir.unlock(&[b"k"], S1).await.unwrap()[0].is_ok());
    assert!(s.dir.delete(&[b"k"], &Scope::All).await.unwrap()[0].is_ok());
    let (_, hits) = s.dir.lookup(&[], &[b"k"], 60_000, S1, &Scope::All).await.unwrap();
    assert_eq!(hits[0].as_ref().unwrap(), &None, "deleted, not answered from a stale hold");
}

macro_rules! suite {
    ($($t:ident),*) => {
        mod on_local { $( #[tokio::test(flavor = "multi_thread")] async fn $t() { super::$t(super::local()).await } )* }
        mod on_forwarded { $( #[tokio::test(flavor = "multi_thread")] async fn $t() { super::$t(super::forwarded().await).await } )* }
        mod on_held { $( #[tokio::test(flavor = "multi_thread")] async fn $t() { super::$t(super::held().await).await } )* }
    };
}

suite!(
    stores_are_write_once_and_visible,
    reservations_belong_to_their_session,
    locks_protect_and_go_with_their_session,
    a_shortfall_evicts_the_nodes_oldest_entries_in_the_same_call,
    a_region_is_emptied_for_a_large_object_only_where_none_of_it_is_in_use,
    listing_and_scopes,
    concurrent_calls_each_get_their_own_answer,
    callers_that_give_up_block_no_one
);
