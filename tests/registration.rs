//! A follower's registry ops apply at the primary only under the
//! registration (join instance) they were made under, checked under the
//! registry's lock: an op the primary admitted just before it declared the
//! node dead takes no lock after the burial (nothing would ever give it
//! back: the follower's hold table was emptied when it joined again), and a
//! release made before the node joined again never gives back a lock of its
//! new registration (the follower would go on answering reads from a hold
//! the primary no longer keeps). The primary's batch loop applies each op
//! after one check of the batch, so these are the ops it applies between a
//! burial or a rejoin and the end of a batch; the last test sends them over
//! the peer service as a follower does.
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use cxlkv::cluster::follower::{self, ForwardClaimer};
use cxlkv::cluster::forward::{Fence, Forwarded, Ident};
use cxlkv::cluster::primary::Primary;
use cxlkv::config::ClusterConfig;
use cxlkv::error::ErrorKind;
use cxlkv::handler::{Claimer, Handler};
use cxlkv::peer_proto::{self as pp, op::Op as O, op_result::Result as R};
use cxlkv::pool::Pool;
use cxlkv::registry::ops::{envelope, ReserveCall};
use cxlkv::registry::Ops;
use cxlkv::registry::{Directory, LocalDirectory, Location, Session};

mod common;
use common::loopback::{self, PAGE};

const FIRST: u64 = 99;
const SECOND: u64 = 101;

struct Cluster {
    primary: Arc<Primary>,
    ldir: Arc<LocalDirectory>,
    client: cxlkv::cluster::epoch::Client,
    cfg: ClusterConfig,
    uuid: String,
    node: u32,
    _keep: (Arc<Pool>, Arc<Handler>, tempfile::TempDir),
}

/// A primary on loopback with follower "f" joined as `FIRST`, which has
/// stored key "k" (committed, unlocked).
async fn cluster() -> Cluster {
    let cfg =
        ClusterConfig { node_name: "f".into(), primary: "p".into(), dead_after_ms: 50, ..ClusterConfig::default() };
    let loopback::Loopback { pool: p, handler: h, primary, ldir, mut client, tmp } = loopback::primary(&cfg).await;
    let uuid = p.superblock().uuid_string();
    let (joined, _) = follower::join(&mut client, &cfg, &uuid, FIRST, 10_000).await.unwrap();
    let ident = Arc::new(Ident::default());
    ident.node.store(joined.node.0 as u64, Ordering::Release);
    ident.instance.store(FIRST, Ordering::Release);
    let fence = Arc::new(Fence::new(60_000));
    fence.renew();
    let timeout = Duration::from_secs(2);
    let claimer = ForwardClaimer { client: client.clone(), ident: ident.clone(), timeout };
    let (region, generation) = claimer.claim(joined.node).await.unwrap().unwrap();
    let fw = Forwarded::new(client.clone(), ident, fence, timeout);
    let loc = Location { node: joined.node, region, offset: 0, length: 1000, generation, version: 0 };
    let owner = Session(1);
    let call = ReserveCall {
        node: joined.node,
        tenant: "t",
        items: vec![(b"k".to_vec(), loc)],
        owner,
        server_writes: false,
        timeout_ms: 10_000,
        shortfall_pages: 0,
        page_size: PAGE,
        hints: vec![],
    };
    let id = *fw.reserve(call).await.unwrap().ids[0].as_ref().unwrap();
    fw.commit(&[id], owner).await.unwrap().0.remove(0).unwrap();
    let node = joined.node.0;
    Cluster { primary, ldir, client, cfg, uuid, node, _keep: (p, h, tmp) }
}

impl Cluster {
    /// The follower's node-held lock op on "k", made under `instance`.
    fn op(&self, op: O, instance: u64) -> pp::Op {
        let mut op = envelope(Session::HOLD.on_node(self.node), None, op);
        op.instance = instance;
        op
    }

    fn hold(&self, instance: u64) -> pp::Op {
        let l = pp::Lookup { unlock_first: vec![], keys: vec![b"k".as_slice().into()], ttl_ms: 60_000, hold: true };
        self.op(O::Lookup(l), instance)
    }

    fn release(&self, instance: u64) -> pp::Op {
        self.op(O::Release(pp::Release { keys: vec![b"k".as_slice().into()], uses: vec![0] }), instance)
    }

    async fn locked(&self) -> u64 {
        self.ldir.stats().await.unwrap().locked_keys
    }

    /// The primary declares "f" dead (silent past `dead_after_ms`).
    async fn bury(&self) {
        tokio::time::sleep(Duration::from_millis(120)).await;
        assert_eq!(self.primary.sweep(), vec![self.node]);
    }

    async fn rejoin(&mut self, instance: u64) {
        follower::join(&mut self.client, &self.cfg, &self.uuid, instance, 10_000).await.unwrap();
    }
}

fn found(r: &R) -> bool {
    matches!(r, R::Lookup(l) if l.found == [true])
}

#[tokio::test]
async fn a_lookup_admitted_before_the_node_was_declared_dead_takes_no_lock_after() {
    let c = cluster().await;
    assert!(found(&c.ldir.call(c.hold(FIRST)).await.unwrap()));
    assert_eq!(c.locked().await, 1);
    c.bury().await;
    assert_eq!(c.locked().await, 0, "a dead node's locks go with it");
    let late = c.ldir.call(c.hold(FIRST)).await.unwrap_err();
    assert_eq!(late.kind(), ErrorKind::Unavailable);
    assert_eq!(c.locked().await, 0, "no lock that nobody would give back");
}

#[tokio::test]
async fn a_release_made_before_the_node_joined_again_leaves_the_new_registrations_lock() {
    let mut c = cluster().await;
    assert!(found(&c.ldir.call(c.hold(FIRST)).await.unwrap()));
    c.bury().await;
    c.rejoin(SECOND).await;
    assert!(found(&c.ldir.call(c.hold(SECOND)).await.unwrap()));
    assert_eq!(c.locked().await, 1);
    let stale = c.ldir.call(c.release(FIRST)).await.unwrap_err();
    assert_eq!(stale.kind(), ErrorKind::Unavailable);
    assert_eq!(c.locked().await, 1, "the new registration's hold is still locked at the primary");
    assert!(matches!(c.ldir.call(c.release(SECOND)).await.unwrap(), R::Unlock(_)));
    assert_eq!(c.locked().await, 0);
}

#[tokio::test]
async fn the_peer_service_applies_each_op_under_the_registration_it_names() {
    let mut c = cluster().await;
    c.bury().await;
    c.rejoin(SECOND).await;
    let batch = |ops| pp::BatchRequest { node: c.node, instance: SECOND, ops, ..Default::default() };
    // An op naming no registration is the batch's: applied.
    let rep = c.client.clone().batch(batch(vec![c.hold(0), c.hold(FIRST)])).await.unwrap().into_inner();
    assert!(found(rep.results[0].result.as_ref().unwrap()));
    let refused = rep.results[1].result.as_ref().unwrap();
    assert!(matches!(refused, R::Error(s) if s.code == tonic::Code::Unavailable as u32), "{refused:?}");
    assert_eq!(c.locked().await, 1);
    // A batch of the old registration is refused whole.
    let old = pp::BatchRequest { node: c.node, instance: FIRST, ops: vec![c.release(0)], ..Default::default() };
    assert_eq!(c.client.clone().batch(old).await.unwrap_err().code(), tonic::Code::FailedPrecondition);
    assert_eq!(c.locked().await, 1);
}

/// A join of the registration that stands (a copy of the node's join that
/// arrived after the node had joined and taken locks, as joins queued
/// behind a flooded peer port do, or a retry whose first answer was lost):
/// nothing is buried or reset. The node's lock stays at the primary and its
/// ops under that instance still apply; a node that joins again always does
/// so as a new instance.
#[tokio::test]
async fn a_late_copy_of_the_standing_join_buries_nothing() {
    let mut c = cluster().await;
    assert!(found(&c.ldir.call(c.hold(FIRST)).await.unwrap()));
    assert_eq!(c.locked().await, 1);
    c.rejoin(FIRST).await;
    assert_eq!(c.locked().await, 1, "a late copy of the join released the node's lock");
    assert!(matches!(c.ldir.call(c.release(FIRST)).await.unwrap(), R::Unlock(_)));
    assert_eq!(c.locked().await, 0);
}
