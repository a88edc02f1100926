//! How a handler starts: on a single node or as the cluster's primary, it
//! takes over its regions (a new generation each) and rebuilds the
//! registry from their object records (the primary also reads the other
//! nodes' regions); as a follower, it takes the regions and live objects
//! the primary reports and reconciles its page tables with them.
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::{Claimer, Handler, Limits, LocalClaimer};
use crate::error::Result;
use crate::pool::{NodeId, Pool, RegionId};
use crate::rebuild::{reconcile_region, scan_foreign, scan_region, RebuildReport};
use crate::regions::Regions;
use crate::registry::{Directory, LocalDirectory, LocalRegistry, Location};

/// What a follower learns from the primary when it joins.
#[derive(Debug, Clone)]
pub struct Joined {
    pub node: NodeId,
    /// Owned regions and their generations.
    pub regions: Vec<(RegionId, u64)>,
    /// Committed objects in those regions.
    pub live: Vec<Location>,
}

impl Handler {
    fn bare(pool: Arc<Pool>, node: NodeId, dir: Arc<dyn Directory>, claimer: Arc<dyn Claimer>, limits: Limits) -> Self {
        Self {
            regions: Regions::new(pool.clone(), node, limits.max_regions, limits.prefault),
            page_size: pool.superblock().page_size,
            pool,
            node,
            dir,
            claimer,
            claiming: tokio::sync::Mutex::new(()),
            limits,
            epoch: Instant::now(),
            instance_id: std::sync::atomic::AtomicU64::new(u64::from_le_bytes(
                uuid::Uuid::new_v4().as_bytes()[..8].try_into().expect("8 bytes"),
            )),
            pending: Mutex::new(HashMap::new()),
            quarantine: Mutex::new(vec![]),
            rebuilt: Mutex::new(RebuildReport::default()),
            being_written: Mutex::new(vec![]),
        }
    }

    /// A single node: the registry lives in this process.
    pub fn new(pool: Arc<Pool>, node: NodeId, registry: Arc<LocalRegistry>, limits: Limits) -> Result<Self> {
        Self::with_directory(pool, node, Arc::new(LocalDirectory::new(registry)), limits, false)
    }

    /// The registry lives in this process (`dir`); with `whole_pool` (the
    /// cluster's primary) the committed objects of every other node's
    /// regions are adopted too.
    pub fn with_directory(
        pool: Arc<Pool>,
        me: NodeId,
        dir: Arc<LocalDirectory>,
        limits: Limits,
        whole_pool: bool,
    ) -> Result<Self> {
        let claimer = Arc::new(LocalClaimer(pool.clone()));
        Self::with_claimer(pool, me, dir, claimer, limits, whole_pool)
    }

    /// As `with_directory`, with regions taken through `claimer` (the
    /// cluster's primary: phase 3 for its own reserves too).
    pub fn with_claimer(
        pool: Arc<Pool>,
        me: NodeId,
        dir: Arc<LocalDirectory>,
        claimer: Arc<dyn Claimer>,
        limits: Limits,
        whole_pool: bool,
    ) -> Result<Self> {
        let h = Self::bare(pool.clone(), me, dir.clone(), claimer, limits);
        let mut report = RebuildReport::default();
        let (mut found, mut writing, mut being_written) = (vec![], vec![], vec![]);
        for r in pool.regions_owned_by(me) {
            let renewal = pool.renew_region(r, me)?;
            let generation = renewal.generation;
            let had = found.len();
            let scan = scan_region(&pool, (me, r), renewal, &mut found, &mut report)?;
            // Every record kept carries the new generation now.
            pool.renewed(r, me)?;
            h.regions.adopt(r, generation, &scan.used)?;
            tracing::info!(region = r.0, generation, objects = found.len() - had, "re-attached owned region");
            if !scan.writing.is_empty() {
                being_written.push(r);
            }
            writing.extend(scan.writing);
        }
        if whole_pool {
            for r in pool.region_ids() {
                let Some(owner) = pool.region_state(r)?.owner.filter(|&o| o != me) else { continue };
                if scan_foreign(&pool, (owner, r), &mut found, &mut report)? {
                    being_written.push(r);
                }
            }
        }
        if h.regions.count() == 0 {
            if let Some(r) = pool.claim_region(me)? {
                h.regions.adopt(r, pool.region_state(r)?.generation, &[])?;
            }
        }
        found.sort_by_key(|f| f.seq);
        dir.registry().raise_seq(found.last().map_or(0, |f| f.seq));
        let restored = dir.registry().restore(found);
        h.free_superseded(&restored.superseded);
        h.quarantine_until_writers_gave_up(writing);
        *h.being_written.lock().unwrap() = being_written;
        if report != RebuildReport::default() {
            tracing::info!(?report, restored = restored.added, "rebuilt the registry from the pool's object records");
        }
        *h.rebuilt.lock().unwrap() = report;
        Ok(h)
    }

    /// A follower: regions and registry calls go through the primary.
    pub fn follower(
        pool: Arc<Pool>,
        joined: &Joined,
        dir: Arc<dyn Directory>,
        claimer: Arc<dyn Claimer>,
        limits: Limits,
    ) -> Result<Self> {
        let h = Self::bare(pool, joined.node, dir, claimer, limits);
        h.rejoined(joined)?;
        Ok(h)
    }

    /// Take the regions and live objects the primary reports (at start, or
    /// after the primary restarted or declared this node dead): pages of
    /// objects the registry no longer has are freed, objects being written
    /// are quarantined, open reservations are forgotten (the primary
    /// dropped them).
    pub fn rejoined(&self, joined: &Joined) -> Result<()> {
        let mut live: HashMap<RegionId, HashSet<u64>> = HashMap::new();
        for l in joined.live.iter().filter(|l| l.node == joined.node) {
            live.entry(l.region).or_default().insert(l.offset / self.page_size);
        }
        let mut report = RebuildReport::default();
        let mut writing = vec![];
        self.regions.clear();
        self.pending.lock().unwrap().clear();
        let none = HashSet::new();
        for &(r, generation) in &joined.regions {
            let keep = live.get(&r).unwrap_or(&none);
            let scan = reconcile_region(&self.pool, self.node, r, generation, keep, &mut report)?;
            if let Err(e) = self.regions.adopt(r, generation, &scan.used) {
                tracing::warn!(region = r.0, generation, error = %e, "region not adopted on joining");
                continue;
            }
            writing.extend(scan.writing);
        }
        self.quarantine_until_writers_gave_up(writing);
        tracing::info!(node = self.node.0, regions = joined.regions.len(), ?report, "joined the cluster");
        *self.rebuilt.lock().unwrap() = report;
        Ok(())
    }

    /// Older versions of keys found twice in the pool (the registry kept
    /// the one with the largest commit sequence): leftovers of removals
    /// whose free notice had not reached the owner yet. Their records are
    /// erased: this node's own pages are freed with them; other nodes free
    /// theirs when they join.
    fn free_superseded(&self, superseded: &[Location]) {
        for loc in superseded {
            tracing::warn!(?loc, "discarding an older version of a key found twice in the pool");
            if loc.node == self.node {
                self.regions.release(std::slice::from_ref(loc));
            } else if let Err(e) =
                self.pool.erase_record(loc.region, loc.offset / self.page_size, loc.version, loc.generation)
            {
                tracing::warn!(error = %e, ?loc, "cannot erase an older version's record");
            }
        }
    }

    fn quarantine_until_writers_gave_up(&self, writing: Vec<Location>) {
        let until = self.now_ms() + self.limits.reservation_timeout_ms;
        self.quarantine.lock().unwrap().extend(writing.into_iter().map(|l| (until, l)));
    }
}
