//! Phase 3 (seed 002): when a node can place nothing in its own regions,
//! evicting its own entries was not enough and no region is free, the
//! primary takes a whole region back from another node and hands it over.
//!
//! Order, so that no reader and no writer ever sees another node's bytes:
//! 1. under the gate (exclusive; every reserve into a region that may be
//!    taken back holds it shared: forwarded ones, and the primary's own),
//!    pick the victim and remove its entries from the registry atomically
//!    with the check that none is locked or reserved (reason `reclaimed`):
//!    from then on no lookup can hand out a location in it;
//! 2. refuse every later reserve into it (the owner may have allocated
//!    there locally; its reserve fails and it frees the pages);
//! 3. ask the owner (heartbeat reply); it stops allocating there under the
//!    lock every allocation and record write takes, and acknowledges in its
//!    next heartbeat; or the owner is dead (declared by the sweep); the
//!    primary, when the region is its own, does the same in place;
//! 4. bump the region's generation while handing it to the requester in the
//!    pool's region table (every old location and record becomes stale).
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{watch, OwnedRwLockReadGuard, RwLock};

use crate::error::{Error, ErrorKind, Result};
use crate::pool::{NodeId, Pool, RegionId};
use crate::registry::directory::ReserveGate;
use crate::registry::{LocalDirectory, Location};

/// A region being taken back.
struct Pending {
    owner: NodeId,
    /// Who gets it; None once the requester stopped waiting (the region is
    /// then freed for whoever claims next).
    to: Option<NodeId>,
    done: watch::Sender<Option<(RegionId, u64)>>,
}

/// Margin added to a writer's deadline before its region may change hands
/// (the primary's clock against the clients' hosts' clocks).
pub const FENCE_MARGIN_MS: u64 = 1_000;

pub struct Reclaims {
    pending: Mutex<HashMap<RegionId, Pending>>,
    /// Regions that are not taken back before the time given (registry
    /// ms): a dead node's regions while a reservation dropped with it may
    /// still be written by its clients, who do not know the node died; and,
    /// after the primary started, regions whose records said "being
    /// written" (a client of the old instance may still copy there).
    fenced: Mutex<HashMap<RegionId, u64>>,
    /// When each region was last handed over: a region its new owner has
    /// not used yet holds no entries, so it would be every next reclaim's
    /// cheapest victim; it is left alone until its owner's first reserve
    /// there, for at most `cooldown` (how long a requester waits).
    handed: Mutex<HashMap<RegionId, std::time::Instant>>,
    cooldown: Duration,
    gate: Arc<RwLock<()>>,
    /// How long a requester waits for the owner's acknowledgement.
    wait: Duration,
}

/// The order victims are tried in: regions owned by a node other than the
/// requester (the primary's too: its own reserves pass the gate as well),
/// not being taken back already, with no live lock and no open
/// reservation; fewest committed entries first (what the reclaim destroys:
/// the score), then the lowest region id. `owned`: (region, owner);
/// `usage`: the registry's (region, committed entries, busy).
pub fn victims(
    owned: &[(RegionId, NodeId)],
    usage: &[(RegionId, u64, bool)],
    requester: NodeId,
    pending: &HashSet<RegionId>,
) -> Vec<(RegionId, NodeId)> {
    let used: HashMap<RegionId, (u64, bool)> = usage.iter().map(|&(r, n, busy)| (r, (n, busy))).collect();
    let mut v: Vec<(u64, RegionId, NodeId)> = owned
        .iter()
        .filter(|(r, owner)| *owner != requester && !pending.contains(r))
        .filter_map(|&(r, owner)| {
            let (entries, busy) = used.get(&r).copied().unwrap_or((0, false));
            (!busy).then_some((entries, r, owner))
        })
        .collect();
    v.sort_unstable();
    v.into_iter().map(|(_, r, owner)| (r, owner)).collect()
}

impl Reclaims {
    pub fn new(wait: Duration) -> Self {
        Self {
            pending: Mutex::new(HashMap::new()),
            fenced: Mutex::default(),
            handed: Mutex::default(),
            cooldown: wait,
            gate: Arc::new(RwLock::new(())),
            wait,
        }
    }

    /// Keep region `r` out of phase 3 until `until` (registry ms).
    pub fn fence(&self, r: RegionId, until: u64) {
        let mut f = self.fenced.lock().unwrap();
        let t = f.entry(r).or_default();
        *t = (*t).max(until);
    }

    /// Regions fenced at `now` (fences that ended are forgotten), and
    /// those handed over within the cooldown.
    fn fenced_at(&self, now: u64) -> HashSet<RegionId> {
        let mut f = self.fenced.lock().unwrap();
        f.retain(|_, until| *until > now);
        let mut out: HashSet<RegionId> = f.keys().copied().collect();
        let mut h = self.handed.lock().unwrap();
        h.retain(|_, at| at.elapsed() < self.cooldown);
        out.extend(h.keys().copied());
        out
    }

    /// Held by every reserve of `node` (forwarded, or the primary's own)
    /// across its registry call, once its locations are admitted: each in a
    /// region `node` owns, of the region's current generation, and not being
    /// taken back. Shared with a victim choice, so a region is either chosen
    /// with no reservation in it, or the reserve is refused here (its pages
    /// are then freed by the caller). Never held while waiting for a reclaim.
    /// Per location: None (admitted) or why not (RESOURCE_EXHAUSTED: the
    /// region is, or is being, taken back; the caller's other items go on).
    /// A location that claims another node is refused as a whole call.
    pub async fn admit<'a>(
        &self,
        pool: &Pool,
        node: NodeId,
        locs: impl IntoIterator<Item = &'a Location>,
    ) -> Result<(OwnedRwLockReadGuard<()>, Vec<Option<Error>>)> {
        let gate = self.gate.clone().read_owned().await;
        let mut verdicts = vec![];
        for l in locs {
            if l.node != node {
                return Err(Error::new(ErrorKind::PermissionDenied, "reserve: a location of another node"));
            }
            // Placed before the region was taken back: it is another node's
            // now, or came back with a new generation, or is being taken.
            // The table is read under the lock `finish` hands over with:
            // read before it, a region no longer pending could show its old
            // owner and be admitted after it moved.
            let pending = self.pending.lock().unwrap();
            let state = pool.region_state(l.region)?;
            let gone = state.owner != Some(node) || state.generation != l.generation || pending.contains_key(&l.region);
            drop(pending);
            if !gone {
                self.handed.lock().unwrap().remove(&l.region);
            }
            verdicts.push(gone.then(|| {
                Error::new(
                    ErrorKind::ResourceExhausted,
                    format!("region {} is (being) taken back by the primary; retry", l.region),
                )
            }));
        }
        Ok((gate, verdicts))
    }

    /// Region `r` is being taken back: no reservation may start in it.
    pub fn refuses(&self, r: RegionId) -> bool {
        self.pending.lock().unwrap().contains_key(&r)
    }

    /// Regions being taken back from `node` (it is told in each heartbeat).
    pub fn asked_of(&self, node: NodeId) -> Vec<RegionId> {
        self.pending.lock().unwrap().iter().filter(|(_, p)| p.owner == node).map(|(r, _)| *r).collect()
    }

    /// Steps 1–2: choose a victim for `requester`, empty it in the registry
    /// and refuse reserves into it. None when no region qualifies. `keep`:
    /// a node whose regions are never taken (a primary with no handler of
    /// its own to give them up).
    pub async fn start(
        &self,
        pool: &Pool,
        dir: &LocalDirectory,
        requester: NodeId,
        keep: Option<NodeId>,
    ) -> Result<Option<(RegionId, NodeId, watch::Receiver<Option<(RegionId, u64)>>)>> {
        let _exclusive = self.gate.write().await;
        if dir.in_grace() {
            // A new primary: followers may still answer from holds the old
            // one granted on these entries.
            return Ok(None);
        }
        let owned: Vec<(RegionId, NodeId)> = pool
            .region_ids()
            .filter_map(|r| pool.region_state(r).ok().and_then(|s| s.owner).map(|o| (r, o)))
            .filter(|(_, o)| Some(*o) != keep)
            .collect();
        let now = dir.now_ms();
        let usage = dir.registry().region_usage(now);
        let mut busy = self.fenced_at(now);
        busy.extend(self.pending.lock().unwrap().keys().copied());
        for (region, owner) in victims(&owned, &usage, requester, &busy) {
            // Atomic with the lock/reservation check: a lookup racing with us
            // either locked an entry first (the region is skipped) or misses.
            let Ok(gone) = dir.registry().reclaim_region(region, now) else { continue };
            metrics::counter!(crate::metric_names::CLUSTER_RECLAIMED_ENTRIES).increment(gone.len() as u64);
            let (done, rx) = watch::channel(None);
            self.pending.lock().unwrap().insert(region, Pending { owner, to: Some(requester), done });
            tracing::warn!(
                region = region.0,
                owner = owner.0,
                requester = requester.0,
                entries = gone.len(),
                "taking a region back (phase 3)"
            );
            return Ok(Some((region, owner, rx)));
        }
        metrics::counter!(crate::metric_names::CLUSTER_REGION_RECLAIMS, "result" => "no_victim").increment(1);
        Ok(None)
    }

    /// Step 3 from the requester's side: wait for the handover within the
    /// wait bound. On time-out the region still goes free once its owner
    /// answers, for whoever claims next.
    pub async fn wait(
        &self,
        region: RegionId,
        mut rx: watch::Receiver<Option<(RegionId, u64)>>,
    ) -> Option<(RegionId, u64)> {
        let got = tokio::time::timeout(self.wait, rx.wait_for(|v| v.is_some()))
            .await
            .ok()
            .and_then(|r| r.ok().and_then(|v| *v));
        if got.is_some() {
            return got;
        }
        // Under the lock `finish` hands over with: either it already did, or
        // it will free the region instead of handing it to nobody.
        let mut p = self.pending.lock().unwrap();
        if let Some(v) = *rx.borrow() {
            return Some(v);
        }
        if let Some(e) = p.get_mut(&region) {
            e.to = None;
        }
        metrics::counter!(crate::metric_names::CLUSTER_REGION_RECLAIMS, "result" => "gave_up").increment(1);
        None
    }

    /// Step 4: the owner acknowledged (`owner` = Some(node): only its own
    /// acknowledgement counts) or is dead. Hands the region over.
    pub fn finish(&self, pool: &Pool, region: RegionId, owner: Option<NodeId>, result: &'static str) {
        let mut p = self.pending.lock().unwrap();
        match p.get(&region) {
            Some(e) if owner.is_none_or(|o| o == e.owner) => {}
            _ => return,
        }
        let e = p.remove(&region).expect("checked above");
        if e.to.is_some() {
            self.handed.lock().unwrap().insert(region, std::time::Instant::now());
        }
        let handed = match e.to {
            Some(to) => pool.reassign_region(region, e.owner, to).map(|g| (to.0, g)),
            None => pool.release_region(region, e.owner).map(|()| (u32::MAX, 0)),
        };
        match handed {
            Ok((to, generation)) => {
                tracing::warn!(region = region.0, from = e.owner.0, to, generation, result, "region taken back");
                metrics::counter!(crate::metric_names::CLUSTER_REGION_RECLAIMS, "result" => result).increment(1);
                let _ = e.done.send(Some((region, generation)));
            }
            Err(err) => tracing::error!(region = region.0, error = %err, "cannot hand a reclaimed region over"),
        }
    }

    /// `node` was declared dead: finish what was asked of it.
    pub fn owner_gone(&self, pool: &Pool, node: NodeId) {
        for r in self.asked_of(node) {
            self.finish(pool, r, Some(node), "owner_dead");
        }
    }
}

/// The gate of `Reclaims::admit` on every reserve the primary's registry
/// records (a follower's forwarded one, and its own clients').
pub struct Gate {
    pub reclaims: Arc<Reclaims>,
    pub pool: Arc<Pool>,
}

#[tonic::async_trait]
impl ReserveGate for Gate {
    async fn admit(
        &self,
        node: NodeId,
        locs: &[Location],
    ) -> Result<(Box<dyn std::any::Any + Send>, Vec<Option<Error>>)> {
        let (guard, verdicts) = self.reclaims.admit(&self.pool, node, locs).await?;
        Ok((Box::new(guard), verdicts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::ops::ReserveCall;
    use crate::registry::{Ops, Session};

    fn ids(pairs: &[(u32, u32)]) -> Vec<(RegionId, NodeId)> {
        pairs.iter().map(|&(r, n)| (RegionId(r), NodeId(n))).collect()
    }

    #[test]
    fn victims_are_other_nodes_idle_regions_fewest_entries_first() {
        // region → owner: 0 primary(1), 1 requester(2), 2..=6 node 3, 7 node 4.
        let owned = ids(&[(0, 1), (1, 2), (2, 3), (3, 3), (4, 3), (5, 3), (6, 3), (7, 4)]);
        // (region, committed entries, busy)
        let usage = [(0, 3, false), (1, 0, false), (2, 5, false), (3, 1, true), (4, 2, false), (6, 9, false)]
            .map(|(r, n, busy)| (RegionId(r), n, busy));
        let pending = HashSet::from([RegionId(7)]);
        let v = victims(&owned, &usage, NodeId(2), &pending);
        // 5 is empty (score 0), then 4 (2 entries), then the primary's 0 (3),
        // then 2 (5), then 6 (9); 3 holds a lock or a reservation, 7 is being
        // taken back already, 1 is the requester's own.
        assert_eq!(v, ids(&[(5, 3), (4, 3), (0, 1), (2, 3), (6, 3)]));
    }

    #[test]
    fn the_primary_asking_for_itself_never_gets_its_own_regions() {
        let owned = ids(&[(0, 1), (1, 1), (2, 3)]);
        let usage = [(RegionId(2), 4, false)];
        assert_eq!(victims(&owned, &usage, NodeId(1), &HashSet::new()), ids(&[(2, 3)]));
    }

    /// A pool of three regions: region a of node 1, region b of node 2.
    fn pool(dir: &std::path::Path) -> (Pool, RegionId, RegionId) {
        use crate::pool::{Geometry, PoolOptions, ShmBackend};
        let (region, page) = (2 << 20, 64 << 10);
        let g = Geometry::for_capacity(3 * region, region, page, region).unwrap();
        let backend = Box::new(ShmBackend::open(&dir.join("pool"), g.pool_size, false).unwrap());
        let p = Pool::open(backend, &PoolOptions { region_size: region, page_size: page, format: false }).unwrap().0;
        let a = p.claim_region(NodeId(1)).unwrap().unwrap();
        let b = p.claim_region(NodeId(2)).unwrap().unwrap();
        (p, a, b)
    }

    fn at(p: &Pool, node: u32, region: RegionId) -> Location {
        let generation = p.region_state(region).unwrap().generation;
        Location { node: NodeId(node), region, offset: 0, length: 1, generation, version: 0 }
    }

    fn local_dir() -> LocalDirectory {
        LocalDirectory::new(Arc::new(crate::registry::LocalRegistry::new("lru", 64).unwrap()))
    }

    #[tokio::test]
    async fn a_reserve_is_admitted_only_into_its_own_current_regions_not_being_taken_back() {
        let tmp = tempfile::tempdir().unwrap();
        let (p, a, b) = pool(tmp.path());
        let rc = Reclaims::new(Duration::from_millis(50));
        // The whole call's refusal, else the one location's.
        let kind = |r: Result<(OwnedRwLockReadGuard<()>, Vec<Option<Error>>)>| match r {
            Err(e) => Some(e.kind()),
            Ok((_, v)) => v[0].as_ref().map(|e| e.kind()),
        };
        assert_eq!(kind(rc.admit(&p, NodeId(1), [&at(&p, 1, a)]).await), None);
        // A location claiming to be another node's; one in a region that is
        // not (any more) this node's.
        assert_eq!(kind(rc.admit(&p, NodeId(1), [&at(&p, 2, b)]).await), Some(ErrorKind::PermissionDenied));
        assert_eq!(kind(rc.admit(&p, NodeId(1), [&at(&p, 1, b)]).await), Some(ErrorKind::ResourceExhausted));
        // Placed before the region moved away and came back.
        let stale = Location { generation: at(&p, 1, a).generation - 1, ..at(&p, 1, a) };
        assert_eq!(kind(rc.admit(&p, NodeId(1), [&stale]).await), Some(ErrorKind::ResourceExhausted));
        // Being taken back (for node 2; its owner has not answered yet).
        let (victim, owner, _rx) = rc.start(&p, &local_dir(), NodeId(2), None).await.unwrap().unwrap();
        assert_eq!((victim, owner), (a, NodeId(1)));
        assert_eq!(kind(rc.admit(&p, NodeId(1), [&at(&p, 1, a)]).await), Some(ErrorKind::ResourceExhausted));
    }

    #[tokio::test]
    async fn a_victim_is_chosen_only_after_admitted_reserves_are_through() {
        let tmp = tempfile::tempdir().unwrap();
        let (p, a, _) = pool(tmp.path());
        let (rc, dir) = (Reclaims::new(Duration::from_millis(50)), local_dir());
        let loc = at(&p, 1, a);
        let admitted = rc.admit(&p, NodeId(1), [&loc]).await.unwrap();
        let choice = rc.start(&p, &dir, NodeId(2), None);
        tokio::pin!(choice);
        // Region a holds no reservation yet, but the admitted reserve has
        // not reached the registry: the choice must wait for it.
        assert!(tokio::time::timeout(Duration::from_millis(100), &mut choice).await.is_err());
        let call = ReserveCall {
            node: NodeId(1),
            tenant: "t",
            items: vec![(b"k".to_vec(), loc)],
            owner: Session(1),
            server_writes: false,
            timeout_ms: 60_000,
            shortfall_pages: 0,
            page_size: 64 << 10,
            hints: vec![],
        };
        assert!(dir.reserve(call).await.unwrap().ids[0].is_ok());
        drop(admitted);
        // Now a holds an open reservation: it is not taken.
        assert!(choice.await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_node_kept_out_is_never_a_victim() {
        let tmp = tempfile::tempdir().unwrap();
        let (p, _, _) = pool(tmp.path());
        let rc = Reclaims::new(Duration::from_millis(50));
        assert!(rc.start(&p, &local_dir(), NodeId(2), Some(NodeId(1))).await.unwrap().is_none());
    }

    #[test]
    fn nothing_qualifies_when_every_other_region_is_busy() {
        let owned = ids(&[(0, 1), (1, 2), (2, 3)]);
        let usage = [(RegionId(0), 1, true), (RegionId(2), 4, true)];
        assert!(victims(&owned, &usage, NodeId(2), &HashSet::new()).is_empty());
    }
}
