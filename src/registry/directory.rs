//! The async registry boundary the handler sees. Every registry operation
//! of a client is one `Op` of `proto/peer.proto`, asked and answered in
//! `ops.rs`: `LocalDirectory` (`local_directory.rs`) answers it with the
//! registry in this process (a single node, or the cluster's primary, for
//! its own clients and for every follower's), `cluster::Forwarded` sends it
//! as it is to the primary. Every call returns a batch-level `Result` (a follower
//! may not reach the primary); per-key outcomes are inside. No lock is held
//! across an `.await`.
use std::sync::atomic::{AtomicU64, Ordering};

use std::time::Instant;

use super::{Admit, Freed, Location};
use crate::error::{Error, Result};
use crate::ids::NodeId;
use crate::peer_proto::{self as pp, op_result::Result as R};

/// Keys per registry call: bounds how long one request holds the
/// registry's lock (a few tens of microseconds).
pub const REGISTRY_CHUNK: usize = 256;

#[tonic::async_trait]
pub trait Directory: Send + Sync {
    /// The eviction policy of the registry behind this directory.
    fn policy_name(&self) -> String;
    /// Whether calls are answered in this process (cheap enough to ask
    /// which keys are present before allocating for them).
    fn is_local(&self) -> bool;
    /// Whether a reservation may be re-keyed by the handler (abort it, then
    /// reserve another key at the same pages: `handler/rebind.rs`): only
    /// where what an abort lets go of is freed by the caller alone. A
    /// cluster's primary also sends the owner a free notice, which would
    /// free the pages under the re-keyed object.
    fn rebinds(&self) -> bool {
        false
    }
    /// This node may still write records into its own regions. A follower
    /// cut off from the primary for a lease must not: once declared dead its
    /// regions may be handed to another node (phase 3 reclaim).
    fn may_write(&self) -> bool {
        true
    }
    /// Every registry operation of a client, as `proto/peer.proto`'s `Op`
    /// (its session, tenant scope and arguments), asked through `Ops`
    /// (`ops.rs`, the one home of each operation) and answered by the
    /// registry in this process (`LocalDirectory`) or forwarded as it is to
    /// the cluster's primary (`cluster::Forwarded`), which answers it with
    /// its `LocalDirectory`. A whole-call failure is the `Err`; per-key
    /// outcomes are inside.
    async fn call(&self, op: pp::Op) -> Result<R>;
    /// Committed or being written (a snapshot; reserve checks again).
    async fn present(&self, keys: &[&[u8]]) -> Result<Vec<bool>>;
    /// Per item to store (key, size): present, or admission's verdict, a
    /// touch it remembers (once per store). Asked only where the registry
    /// is in this process; elsewhere the reserve judges (`ReserveCall::judge`).
    async fn admit(&self, items: &[(&[u8], u64)]) -> Result<Vec<Admit>>;
    /// Evict among `node`'s entries until `pages` pages are free.
    async fn evict(&self, node: NodeId, pages: u64, page_size: u64) -> Result<Freed>;
    /// Reclaim expired reservations and locks (the registry's own clock).
    async fn expire(&self) -> Result<Freed>;
}

/// Where freed locations of other nodes go (the cluster's free notices).
pub trait FreedSink: Send + Sync {
    fn freed(&self, locs: &[Location]);
}

/// A time-bound right to act (an elected primary's election lease).
pub trait Lease: Send + Sync {
    fn held(&self) -> bool;
}

/// A lease kept on this process's monotonic clock: a follower's (writes
/// stop when the primary has not answered a heartbeat for `lease_ms`) and an
/// elected primary's (renewed by each confirmation of its election).
pub struct Fence {
    epoch: Instant,
    renewed_ms: AtomicU64,
    lease_ms: u64,
}

impl Fence {
    pub fn new(lease_ms: u64) -> Self {
        Self { epoch: Instant::now(), renewed_ms: AtomicU64::new(0), lease_ms }
    }
    pub fn renew(&self) {
        self.renew_at(Instant::now());
    }
    /// Renew as of `t` (e.g. when the request that was confirmed left).
    pub fn renew_at(&self, t: Instant) {
        let ms = t.saturating_duration_since(self.epoch).as_millis() as u64 + 1;
        self.renewed_ms.fetch_max(ms, Ordering::AcqRel);
    }
    /// Give the lease up now.
    pub fn expire(&self) {
        self.renewed_ms.store(0, Ordering::Release);
    }
    pub fn held(&self) -> bool {
        let r = self.renewed_ms.load(Ordering::Acquire);
        r != 0 && (self.epoch.elapsed().as_millis() as u64) < r + self.lease_ms
    }
}

impl Lease for Fence {
    fn held(&self) -> bool {
        Fence::held(self)
    }
}

/// Where regions may be taken back in this process (a cluster's primary):
/// a reserve's locations are admitted each on its own, and the returned
/// guard is held across the registry call, so a region is either chosen as
/// a victim with no reservation in it, or its reserves are refused.
#[tonic::async_trait]
pub trait ReserveGate: Send + Sync {
    /// Per location: None (admitted) or why not (RESOURCE_EXHAUSTED: the
    /// region is, or is being, taken back); a location of another node than
    /// `node` refuses the whole call.
    async fn admit(
        &self,
        node: NodeId,
        locs: &[Location],
    ) -> Result<(Box<dyn std::any::Any + Send>, Vec<Option<Error>>)>;
}

/// Erases a deleted object's record in the pool (a cluster's primary, for
/// any node's object): called under the registry's lock, so the delete is
/// in the pool before it is acknowledged and before the pages can be reused.
pub trait Eraser: Send + Sync {
    fn erase(&self, loc: &Location);
}
