//! The handler: this node's store. It validates batches, places objects in
//! the node's own regions (`regions.rs`), writes their records, and asks the
//! registry (through the async `Directory`: in this process, or forwarded to
//! the cluster's primary) for metadata. Here: the handler's state and batch
//! validation; each job in its file: `reserve.rs` (reserve rounds),
//! `commit.rs` (commits and aborts), `keys.rs` (lookups and the other key
//! operations), `pages.rs` (byte access for the inline path, frees, reaping).
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::error::{Error, Result};
use crate::ids::ReservationId;
use crate::peer_proto::TokenHint;
use crate::pool::{NodeId, Pool};
use crate::rebuild::RebuildReport;
use crate::regions::Regions;
use crate::registry::{Directory, Location, Session};

/// An item of a Reserve still to be placed: its index in the request, its
/// key and its size.
type Todo = (usize, Bytes, u64);
/// An item placed: its index, its key and where it went.
type Placed = (usize, Bytes, Location);
/// Per item of a Reserve, its outcome once known.
type Outcome = Option<Result<(ReservationId, Location)>>;

mod claim;
mod commit;
mod keys;
mod limits;
mod pages;
mod piggyback;
mod place;
mod rebind;
mod reserve;
mod start;
mod stats;

pub use claim::{claim_off_runtime, Claimer, LocalClaimer};
pub use limits::{Limits, MAX_TENANT_BYTES};
pub use piggyback::CommitThenReserve;
pub use start::Joined;
pub use stats::{RegionView, Stats};

/// Per-key unlock results, lookup hits, the lock TTL applied.
pub type UnlockThenLookup = (Vec<Result<()>>, Vec<Result<Option<Location>>>, u64);

/// Rounds of "evict the shortfall, place what now fits" in one reserve.
const EVICT_ROUNDS: usize = 3;
/// Times a reserve that found no room waits for other reserves' pages in
/// flight, and how long each time at most.
const SETTLES: usize = 3;
const SETTLE_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// Who a reserve writes for, through its rounds: its tenant, the token ids
/// its items came with, its session, whether the sidecar writes the bytes
/// itself, and whether the registry's reserve judges the items (it is
/// remote: the primary decides admission).
#[derive(Clone, Copy)]
pub(crate) struct Writer<'a> {
    pub tenant: &'a str,
    pub hints: &'a [TokenHint],
    pub owner: Session,
    pub server_writes: bool,
    pub judge: bool,
    pub evict: bool,
}

/// How a reserve treats its items: `judged`, admission decides first which
/// are worth a place; `evict`, room may be made by evicting (else only free
/// pages and claimable regions are used: a client reserving ahead of need,
/// `leases`, takes no one's cached entries for it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct How {
    pub judged: bool,
    pub evict: bool,
}

impl How {
    /// A store's: judged, evicting.
    pub const STORE: How = How { judged: true, evict: true };
}

pub struct ReserveResult {
    pub results: Vec<Result<(ReservationId, Location)>>,
    pub evicted: u32,
}

/// A reservation made through this node: only its owner may commit it, and
/// its record is written here (the node owns the region's page table).
#[derive(Clone, Copy)]
struct Pending {
    loc: Location,
    owner: Session,
    since_ms: u64,
    /// The commit sequence the registry gave the reservation.
    seq: u64,
}

pub struct Handler {
    pool: Arc<Pool>,
    node: NodeId,
    dir: Arc<dyn Directory>,
    regions: Regions,
    claimer: Arc<dyn Claimer>,
    /// One region claim at a time (a claim may be a call to the primary).
    claiming: tokio::sync::Mutex<()>,
    limits: Limits,
    page_size: u64,
    epoch: Instant,
    /// What clients know this node's registry by (see `instance_id`).
    instance_id: std::sync::atomic::AtomicU64,
    pending: Mutex<HashMap<ReservationId, Pending>>,
    /// Objects that were being written when the previous process died:
    /// their pages stay out of use until (monotonic ms) a writer that may
    /// still be copying under its old reservation has given up.
    quarantine: Mutex<Vec<(u64, Location)>>,
    rebuilt: Mutex<RebuildReport>,
    /// Regions whose records said "being written" when this handler started
    /// (its own and, on a cluster's primary, every node's).
    being_written: Mutex<Vec<crate::pool::RegionId>>,
}

impl Handler {
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
    /// Random per process, and new whenever the registry that holds this
    /// node's clients' locks is another one (a follower whose primary
    /// restarted or was replaced): clients use it to notice that their locks
    /// and locations are gone.
    pub fn instance_id(&self) -> u64 {
        self.instance_id.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The registry behind this node changed (`instance_id`).
    pub fn new_instance(&self) {
        self.instance_id.store(rand::random::<u64>() | 1, std::sync::atomic::Ordering::Release);
    }
    pub fn node(&self) -> NodeId {
        self.node
    }
    pub fn pool(&self) -> &Pool {
        &self.pool
    }
    pub fn pool_arc(&self) -> Arc<Pool> {
        self.pool.clone()
    }
    pub fn limits(&self) -> &Limits {
        &self.limits
    }
    /// This node may write into its regions now (a follower: its lease
    /// from the primary holds).
    pub fn may_write(&self) -> bool {
        self.dir.may_write()
    }
    pub fn directory(&self) -> &dyn Directory {
        self.dir.as_ref()
    }
    pub fn policy_name(&self) -> String {
        self.dir.policy_name()
    }
    /// Regions that held objects being written when this handler started:
    /// clients of the previous instance may still copy into them.
    pub fn regions_being_written(&self) -> Vec<crate::pool::RegionId> {
        self.being_written.lock().unwrap().clone()
    }
    /// What the start-up rebuild found.
    pub fn rebuilt(&self) -> RebuildReport {
        *self.rebuilt.lock().unwrap()
    }
    /// Largest object: a region, and below 4 GiB (registry entries are packed).
    pub fn max_object_size(&self) -> u64 {
        self.pool.superblock().region_size.min(u32::MAX as u64)
    }
    /// Region space this node may own.
    pub fn capacity_bytes(&self) -> u64 {
        let n = self.pool.region_count();
        let n = if self.limits.max_regions == 0 { n } else { n.min(self.limits.max_regions) };
        n as u64 * self.pool.superblock().region_size
    }
    pub fn regions(&self) -> &Regions {
        &self.regions
    }

    fn check_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<()> {
        self.check_batch(keys.len())?;
        for (i, k) in keys.iter().enumerate() {
            let n = k.as_ref().len();
            if n == 0 || n > self.limits.max_key_bytes {
                return Err(Error::invalid(format!(
                    "key #{i} is {n} bytes; keys must be 1..={} bytes",
                    self.limits.max_key_bytes
                )));
            }
        }
        Ok(())
    }

    pub fn check_batch(&self, n: usize) -> Result<()> {
        if n > self.limits.max_batch {
            return Err(Error::invalid(format!("batch of {n} exceeds the limit of {}", self.limits.max_batch)));
        }
        Ok(())
    }

    fn check_items(&self, tenant: &str, items: &[(Bytes, u64)]) -> Result<()> {
        self.check_keys(&items.iter().map(|i| &i.0).collect::<Vec<_>>())?;
        if tenant.len() > self.limits.max_tenant_bytes {
            return Err(Error::invalid(format!("tenant is longer than {} bytes", self.limits.max_tenant_bytes)));
        }
        let max = self.max_object_size();
        for (i, (_, size)) in items.iter().enumerate() {
            if *size == 0 || *size > max {
                return Err(Error::invalid(format!("item #{i} has size {size}; sizes must be 1..={max} bytes")));
            }
        }
        Ok(())
    }
}
