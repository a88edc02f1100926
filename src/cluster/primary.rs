//! The primary's side of the peer service (`peer_service.rs` serves it):
//! the node table (ids, liveness, what each node holds), node ids and region
//! ownership (it alone writes them into the pool), region claims and phase 3
//! for every node, and the registry calls followers forward. Free notices
//! are `notices.rs`'s.
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::clock::{local_ms, PeerClock};
use super::notices::Notices;
use crate::error::{Error, ErrorKind, Result};
use crate::handler::{claim_off_runtime, Handler};
use crate::peer_proto::{self as pp, op::Op as O, op_result::Result as R};
use crate::pool::{NodeId, Pool, RegionId};
use crate::registry::convert::to_peer;
use crate::registry::{Directory, LocalDirectory, Session};

/// What the primary knows of a node.
#[derive(Debug, Clone)]
pub struct NodeState {
    pub name: String,
    pub instance: u64,
    pub peer_addr: String,
    pub last_seen: Instant,
    pub alive: bool,
    pub pages_total: u64,
    pub pages_free: u64,
    pub regions: u32,
    pub forwarded_p50_us: u64,
    pub held_keys: u64,
    /// The node's clock as its heartbeats read it (`clock.rs`).
    pub clock: PeerClock,
}

pub struct Primary {
    pool: Arc<Pool>,
    node: u32,
    dir: Arc<LocalDirectory>,
    notices: Arc<Notices>,
    nodes: Mutex<HashMap<u32, NodeState>>,
    instance: u64,
    lease_ms: u64,
    dead_after: Duration,
    /// The longest a client may write into a reservation (the primary's
    /// `registry.reservation_timeout_ms`; no follower's may be longer).
    reservation_timeout_ms: u64,
    reclaims: Arc<super::reclaim::Reclaims>,
    /// The primary's own handler, whose regions may be taken back too (weak:
    /// the handler's claimer holds this primary).
    own: OnceLock<Weak<Handler>>,
    /// One join at a time: two joins of one name that both found it free
    /// would both be let in, two sidecars sharing one id and its regions.
    joins: Mutex<()>,
}

impl Primary {
    pub fn new(
        pool: Arc<Pool>,
        node: u32,
        dir: Arc<LocalDirectory>,
        notices: Arc<Notices>,
        instance: u64,
        cfg: &super::config::ClusterConfig,
        reservation_timeout_ms: u64,
    ) -> Self {
        Self {
            pool,
            node,
            dir,
            notices,
            nodes: Mutex::new(HashMap::new()),
            instance,
            lease_ms: cfg.lease_ms,
            dead_after: Duration::from_millis(cfg.dead_after_ms),
            reservation_timeout_ms,
            // The answer must reach the requester before its own call times out.
            reclaims: Arc::new(super::reclaim::Reclaims::new(Duration::from_millis(cfg.forward_timeout_ms * 3 / 4))),
            own: OnceLock::new(),
            joins: Mutex::new(()),
        }
    }

    /// The primary's own handler: from now on its regions may be victims
    /// of phase 3 (its reserves pass the gate through `PrimaryClaimer`).
    pub fn attach(&self, own: &Arc<Handler>) {
        let _ = self.own.set(Arc::downgrade(own));
    }

    pub fn reclaims(&self) -> &Arc<super::reclaim::Reclaims> {
        &self.reclaims
    }

    pub fn notices(&self) -> &Notices {
        &self.notices
    }

    /// Known nodes (the primary itself is not in the list).
    pub fn nodes(&self) -> Vec<(u32, NodeState)> {
        let mut v: Vec<_> = self.nodes.lock().unwrap().iter().map(|(k, v)| (*k, v.clone())).collect();
        v.sort_by_key(|(k, _)| *k);
        v
    }

    /// Every node as `cxlkv status` shows it, the primary first.
    pub fn cluster_nodes(&self, own: &crate::regions::Regions, name: &str) -> Vec<crate::proto::ClusterNode> {
        let mut out = vec![crate::proto::ClusterNode {
            node: self.node,
            name: name.to_owned(),
            role: "primary".into(),
            alive: true,
            silent_ms: 0,
            regions: own.count(),
            pages_total: own.pages_total(),
            pages_free: own.free_pages(),
            forwarded_p50_us: 0,
            held_keys: 0,
        }];
        out.extend(self.nodes().into_iter().map(|(id, n)| crate::proto::ClusterNode {
            node: id,
            name: n.name,
            role: "follower".into(),
            alive: n.alive,
            silent_ms: n.last_seen.elapsed().as_millis() as u64,
            regions: n.regions,
            pages_total: n.pages_total,
            pages_free: n.pages_free,
            forwarded_p50_us: n.forwarded_p50_us,
            held_keys: n.held_keys,
        }));
        out
    }

    /// Declare nodes silent past `dead_after` dead: their clients' locks
    /// and reservations are released; their committed entries stay.
    pub fn sweep(&self) -> Vec<u32> {
        let mut dead = vec![];
        for (id, n) in self.nodes.lock().unwrap().iter_mut() {
            if n.alive && n.last_seen.elapsed() > self.dead_after {
                n.alive = false;
                dead.push(*id);
            }
        }
        for id in &dead {
            self.bury(*id);
            metrics::counter!(crate::metric_names::CLUSTER_NODES_DECLARED_DEAD).increment(1);
        }
        dead
    }

    /// Free regions whose table entry names no node of the pool (a damaged
    /// owner word): their entries leave the registry (as `reclaimed`, once
    /// none is locked or being written; until then the next sweep tries
    /// again) and the region is free for the next claim. Its real owner, if
    /// any, stops writing there as soon as it sees the table (`Regions::verify`),
    /// and its reserves there are refused meanwhile. Returns the regions freed.
    pub fn repair_region_table(&self) -> Vec<RegionId> {
        let Ok(nodes) = self.pool.nodes() else { return vec![] };
        let known = |n: u32| n == self.node || nodes.iter().any(|(id, _)| *id == n);
        let mut repaired = vec![];
        for r in self.pool.region_ids() {
            let Ok(w) = self.pool.region_owner_word(r) else { continue };
            if w == 0 || (w >> 32 == crate::pool::layout::STATE_OWNED && known(w as u32)) || self.reclaims.refuses(r) {
                continue;
            }
            let Ok(gone) = self.dir.registry().reclaim_region(r, self.dir.now_ms()) else { continue };
            match self.pool.clear_region_owner(r, w) {
                Ok(true) => {
                    tracing::warn!(
                        region = r.0,
                        word = w,
                        entries = gone.len(),
                        "region table entry named no node: freed"
                    );
                    metrics::counter!(crate::metric_names::CLUSTER_REGION_REPAIRS).increment(1);
                    repaired.push(r);
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(region = r.0, error = %e, "cannot free a damaged region table entry"),
            }
        }
        repaired
    }

    fn bury(&self, id: u32) {
        let (locks, dropped) = self.dir.release_node(id);
        // The node's clients do not know it died: each may copy into its
        // reservation until its deadline, so no other node gets the region.
        for (loc, deadline) in &dropped {
            self.reclaims.fence(loc.region, deadline + super::reclaim::FENCE_MARGIN_MS);
        }
        self.notices.reset(NodeId(id));
        self.reclaims.owner_gone(&self.pool, NodeId(id));
        tracing::warn!(node = id, locks, "node declared dead: its locks and reservations are released");
    }

    /// The caller is a live node of the cluster with this instance.
    pub(super) fn check(&self, node: u32, instance: u64) -> Result<()> {
        match self.nodes.lock().unwrap().get(&node) {
            Some(n) if n.alive && n.instance == instance => Ok(()),
            _ => Err(Error::new(ErrorKind::FailedPrecondition, "unknown or dead node instance: join again")),
        }
    }

    /// The moment (`clock::local_ms`) after which `node` no longer waits
    /// for a batch it sent at `sent_ms` (its clock) for `wait_ms`; None
    /// while its clock is not known.
    pub(super) fn gives_up_at(&self, node: u32, sent_ms: u64, wait_ms: u64) -> Option<u64> {
        self.nodes.lock().unwrap().get(&node)?.clock.gives_up_at(sent_ms, wait_ms)
    }

    pub(super) fn join(&self, r: pp::JoinRequest) -> Result<pp::JoinReply> {
        let _one_at_a_time = self.joins.lock().unwrap_or_else(|e| e.into_inner());
        if r.pool_uuid != self.pool.superblock().uuid_string() {
            return Err(Error::precondition(format!("node {:?} is on another pool ({})", r.name, r.pool_uuid)));
        }
        if r.reservation_timeout_ms > self.reservation_timeout_ms {
            return Err(Error::precondition(format!(
                "node {:?} has registry.reservation_timeout_ms = {}, more than the primary's {}: the primary keeps \
                 a dead node's regions from other nodes only for its own timeout; configure them alike",
                r.name, r.reservation_timeout_ms, self.reservation_timeout_ms
            )));
        }
        let alive = |id: u32| id == self.node || self.nodes.lock().unwrap().get(&id).is_some_and(|n| n.alive);
        let id = self.pool.node_id_reusing(&r.name, |id| !alive(id))?;
        if id == self.node {
            return Err(Error::precondition(format!("{:?} is the primary's own name", r.name)));
        }
        let before = self.nodes.lock().unwrap().get(&id).cloned();
        // A join of the registration that stands is a copy of one already
        // applied (its answer lost, or the copy delayed): answered as things
        // stand, burying nothing. A node joining again does so as a new
        // instance, and its locks may be in use.
        let standing = before.as_ref().is_some_and(|o| o.alive && o.instance == r.instance);
        if let Some(old) = before.filter(|o| o.alive && !standing) {
            // Two sidecars with one name would share an id, and with it
            // regions and page tables. The old instance is taken for gone
            // (restarted) only once it has been silent for a lease: by then
            // it has stopped writing.
            let silent = old.last_seen.elapsed();
            if old.instance != r.instance && silent < Duration::from_millis(self.lease_ms) {
                return Err(Error::new(
                    ErrorKind::AlreadyExists,
                    format!(
                        "node name {:?} is in use by a live node (heard from {} ms ago): a second sidecar with the \
                         same node name is refused; a restarted node is let in once its previous instance has been \
                         silent for lease_ms ({} ms)",
                        r.name,
                        silent.as_millis(),
                        self.lease_ms
                    ),
                ));
            }
            tracing::info!(node = id, old = old.instance, new = r.instance, "node restarted");
            self.bury(id);
        }
        let notice_seq = if standing {
            self.notices.last(NodeId(id))
        } else {
            // Ops made under an earlier registration of this node no longer apply.
            self.dir.register_node(id, r.instance);
            self.notices.reset(NodeId(id))
        };
        let live = self.dir.registry().live_of(NodeId(id));
        let regions = self.pool.regions_owned_by(NodeId(id));
        let generations =
            regions.iter().map(|&g| self.pool.region_state(g).map(|s| s.generation)).collect::<Result<Vec<_>>>()?;
        if standing {
            tracing::info!(node = id, name = %r.name, "a copy of the node's standing join: answered as things stand");
        } else {
            self.registered(id, &r, regions.len() as u32, live.len());
        }
        Ok(pp::JoinReply {
            node: id,
            regions: regions.iter().map(|r| r.0).collect(),
            generations,
            live: live.iter().map(to_peer).collect(),
            primary_instance: self.instance,
            eviction_policy: self.dir.policy_name(),
            lease_ms: self.lease_ms,
            notice_seq,
        })
    }

    /// Node `id` joined as `r` says, owning `regions` regions and `live` live entries.
    fn registered(&self, id: u32, r: &pp::JoinRequest, regions: u32, live: usize) {
        self.nodes.lock().unwrap().insert(
            id,
            NodeState {
                name: r.name.clone(),
                instance: r.instance,
                peer_addr: r.peer_addr.clone(),
                last_seen: Instant::now(),
                alive: true,
                pages_total: 0,
                pages_free: 0,
                regions,
                forwarded_p50_us: 0,
                held_keys: 0,
                clock: PeerClock::default(),
            },
        );
        tracing::info!(node = id, name = %r.name, regions, live, "node joined");
    }

    pub(super) fn heartbeat(&self, r: pp::HeartbeatRequest) -> Result<pp::HeartbeatReply> {
        // A primary whose election lease lapsed renews nobody's: a follower
        // must not answer from holds of a primary a newer one replaced.
        if !self.dir.may_write() {
            return Err(Error::new(ErrorKind::Unavailable, "this primary's election lease lapsed: it stands down"));
        }
        let known = {
            let mut nodes = self.nodes.lock().unwrap();
            match nodes.get_mut(&r.node) {
                Some(n) if n.alive && n.instance == r.instance => {
                    n.last_seen = Instant::now();
                    (n.pages_total, n.pages_free, n.regions) = (r.pages_total, r.pages_free, r.regions);
                    (n.forwarded_p50_us, n.held_keys) = (r.forwarded_p50_us, r.held_keys);
                    n.clock.heard(r.clock_ms, local_ms());
                    true
                }
                _ => false,
            }
        };
        if !known {
            return Ok(pp::HeartbeatReply { primary_instance: self.instance, rejoin: true, ..Default::default() });
        }
        for &region in &r.surrendered {
            self.reclaims.finish(&self.pool, RegionId(region), Some(NodeId(r.node)), "acked");
        }
        let (notices, last_seq) = self.notices.pending(NodeId(r.node), r.acked, 4096);
        Ok(pp::HeartbeatReply {
            primary_instance: self.instance,
            notices: notices.iter().map(to_peer).collect(),
            last_seq,
            rejoin: false,
            reclaim: self.reclaims.asked_of(NodeId(r.node)).into_iter().map(|r| r.0).collect(),
        })
    }

    pub(super) async fn claim(&self, r: pp::ClaimRegionRequest) -> Result<pp::ClaimRegionReply> {
        self.check(r.node, r.instance)?;
        let got = match claim_off_runtime(&self.pool, NodeId(r.node)).await? {
            Some(got) => Some(got),
            None if r.reclaim => self.reclaim(NodeId(r.node)).await?,
            None => None,
        };
        let Some((RegionId(region), generation)) = got else { return Ok(pp::ClaimRegionReply::default()) };
        tracing::info!(node = r.node, region, generation, "assigned a region");
        Ok(pp::ClaimRegionReply { claimed: true, region, generation })
    }

    /// Phase 3 for `node` (see `reclaim.rs`), the primary's own node included.
    /// Never called with the gate held: `start` takes it exclusive.
    pub async fn reclaim(&self, node: NodeId) -> Result<Option<(RegionId, u64)>> {
        let keep = self.own.get().is_none().then_some(NodeId(self.node));
        let Some((region, owner, rx)) = self.reclaims.start(&self.pool, &self.dir, node, keep).await? else {
            return Ok(None);
        };
        if owner == NodeId(self.node) {
            // Its own region: given up in place, under the lock every one of
            // its allocations and record writes takes; no heartbeat to wait
            // for. (No handler: shutting down; the requester gives up.)
            if let Some(own) = self.own.get().and_then(Weak::upgrade) {
                own.surrender(region);
                self.reclaims.finish(&self.pool, region, Some(owner), "acked");
            }
        } else if !self.nodes.lock().unwrap().get(&owner.0).is_some_and(|n| n.alive) {
            self.reclaims.finish(&self.pool, region, Some(owner), "owner_dead");
        }
        Ok(self.reclaims.wait(region, rx).await)
    }

    /// One operation a follower forwarded: its session must be one of that
    /// node's, and a reserve must place in that node's pages; the registry
    /// answers it as any other (`LocalDirectory::call`).
    pub(super) async fn op(&self, node: u32, op: pp::Op) -> Result<R> {
        if Session(op.owner).node_bits() != node {
            return Err(Error::new(ErrorKind::PermissionDenied, "a node may act only for its own sessions"));
        }
        if let Some(O::Reserve(r)) = &op.op {
            if r.node != node {
                return Err(Error::new(ErrorKind::PermissionDenied, "a node reserves only in its own pages"));
            }
        }
        self.dir.call(op).await
    }
}
