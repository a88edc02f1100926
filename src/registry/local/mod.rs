//! In-process primary registry: a slab of compact entries, an index of
//! entry ids keyed by the key bytes' hash (keys are stored once, inline when short),
//! one eviction policy (an order per node), a deadline queue for reservations and a side
//! table of locked entries. That state and the steps on it are `inner.rs`;
//! the registry's calls, each one pass under the one lock, are in this
//! folder by job: `store.rs` (two-phase store), `locks.rs`, `space.rs`
//! (deletes, eviction, expiry, regions taken back), `queries.rs` (listing,
//! removal log, figures), `shorthand.rs` (the sidecar's own calls). Here:
//! the registry itself, how it is built, and its sequences.
use std::sync::Mutex;

mod locks;
mod queries;
mod shorthand;
mod space;
mod store;

use super::admission::{Admission, AdmissionConfig};
use super::inner::Inner;
use super::orders::Orders;
use super::quota::QuotaConfig;
use crate::error::{Error, ErrorKind, Result};
use crate::eviction::PolicyConfig;

pub use super::inner::REMOVED_LOG;

/// How many commit sequences one write of the high-water mark covers.
const SEQ_BLOCK: u64 = 1 << 20;

/// How long past its deadline a reservation the sidecar writes itself
/// (inline put) is kept: its writer stops at the deadline, and a writer
/// whose abort never arrived (its node lost the primary) must not leave the
/// key "being written" for ever.
pub const SERVER_WRITE_GRACE_MS: u64 = 5_000;

/// How far past a durable lock's expiry the pool's view-lock mark is set:
/// renewals within it write nothing.
pub const LOCK_MARK_STEP_MS: u64 = 1_000;

pub struct LocalRegistry {
    policy_name: &'static str,
    policy: PolicyConfig,
    /// Some tenant has a quota: without one, `make_room` (called on every
    /// reserve) returns before taking the lock.
    quotas_on: bool,
    /// Where the commit sequences' high-water mark is kept (a cluster's
    /// primary: in the pool, so a later primary never hands out one of
    /// them again). None: sequences need only be unique in this process's
    /// life and above those found at start.
    seq_store: Option<std::sync::Arc<dyn super::SeqStore>>,
    /// Where the view-lock mark is kept (in the pool), if anywhere.
    lock_mark: Option<std::sync::Arc<dyn super::LockMark>>,
    inner: Mutex<Inner>,
}

impl LocalRegistry {
    /// `max_tenants`: most tenants with keys or reservations at once.
    pub fn new(policy: &str, max_tenants: usize) -> Result<Self> {
        Ok(Self::with_policy(PolicyConfig::by_name(policy)?, max_tenants))
    }

    /// `new` with the policy's settings given (`[registry.eviction]`).
    pub fn with_policy(policy: PolicyConfig, max_tenants: usize) -> Self {
        let orders = Orders::new(&policy, false);
        Self {
            policy_name: orders.name(),
            policy,
            quotas_on: false,
            seq_store: None,
            lock_mark: None,
            inner: Mutex::new(Inner::new(orders, max_tenants)),
        }
    }

    /// Enforce `quotas` (see `quota.rs`); call before the first entry.
    pub fn with_quotas(mut self, quotas: QuotaConfig) -> Self {
        self.quotas_on = quotas.has_quotas();
        {
            let mut g = self.lock();
            assert!(g.slab.is_empty(), "quotas are set on an empty registry");
            g.orders = Orders::new(&self.policy, quotas.has_quotas());
            g.guarded = quotas.has_guarantees();
            g.quotas = quotas;
        }
        self
    }

    /// Judge stores by `admission` (see `admission.rs`; off unless set).
    /// Call before the first entry.
    pub fn with_admission(self, admission: AdmissionConfig) -> Self {
        {
            let mut g = self.lock();
            assert!(g.slab.is_empty(), "admission is set on an empty registry");
            g.admission = Admission::new(admission, &self.policy);
        }
        self
    }

    /// Hash keys with a fixed seed instead of a random one, so the same
    /// calls make the same choices run after run (ghost histories and the
    /// index follow the hash): for replays of traces, never for a server,
    /// whose clients could then aim keys at one slot. Call before the
    /// first entry.
    pub fn with_fixed_hashing(self) -> Self {
        {
            let mut g = self.lock();
            assert!(g.slab.is_empty(), "hashing is fixed on an empty registry");
            g.hasher = foldhash::fast::SeedableRandomState::fixed();
        }
        self
    }

    /// Keep the commit sequences' high-water mark in `store`, starting
    /// above `floor` (the highest sequence found in the pool, and the mark
    /// a previous primary left), and number the removal log from a random
    /// base, so a consumer's cursor from another instance's log is noticed.
    /// Call before the first entry.
    pub fn with_seq_store(mut self, store: std::sync::Arc<dyn super::SeqStore>, floor: u64) -> Self {
        {
            let mut g = self.lock();
            assert!(g.slab.is_empty(), "the sequence store is set on an empty registry");
            g.seq_next = floor + 1;
            g.seq_limit = floor + 1;
            g.removed_base = rand::random::<u64>() >> 2 | 1;
            g.removed_next = g.removed_base;
        }
        self.seq_store = Some(store);
        self
    }

    /// The next commit sequence, extending the high-water mark in the pool
    /// first when it runs out (once per `SEQ_BLOCK`).
    fn next_seq(&self, g: &mut Inner) -> Result<u64> {
        if g.seq_next >= g.seq_limit {
            if let Some(store) = &self.seq_store {
                let limit = g.seq_next + SEQ_BLOCK;
                store.keep_below(limit)?;
                g.seq_limit = limit;
            } else {
                g.seq_limit = u64::MAX;
            }
        }
        g.seq_next += 1;
        Ok(g.seq_next - 1)
    }

    /// Keep the view-lock mark in `mark`: before a durable session's lock
    /// would outlast what it records, it is raised (by `LOCK_MARK_STEP_MS`
    /// beyond the lock, so one write covers a while of renewals).
    pub fn with_lock_mark(mut self, mark: std::sync::Arc<dyn super::LockMark>) -> Self {
        self.lock_mark = Some(mark);
        self
    }

    /// Make sure the pool's mark covers a durable lock until `expiry`
    /// (registry ms; `now` likewise); an error refuses the lock.
    fn cover(&self, g: &mut Inner, expiry: u64, now: u64) -> Result<()> {
        let Some(mark) = &self.lock_mark else { return Ok(()) };
        if expiry <= g.marked_until {
            return Ok(());
        }
        let until = expiry + LOCK_MARK_STEP_MS;
        mark.cover(crate::platform::now_unix_ms() + (until - now)).map_err(|e| {
            Error::new(
                ErrorKind::Unavailable,
                format!("cannot record the view lock in the pool, so none is taken: {e}"),
            )
        })?;
        g.marked_until = until;
        Ok(())
    }

    /// Announce every key that becomes visible or leaves to `sink` (the
    /// pool's event stream). Call before the first entry.
    pub fn with_events(self, sink: std::sync::Arc<crate::events::EventSink>) -> Self {
        self.lock().events = Some(sink);
        self
    }

    /// The event sink commits and removals are announced to, if any.
    pub fn events(&self) -> Option<std::sync::Arc<crate::events::EventSink>> {
        self.lock().events.clone()
    }

    /// Bytes one client session may hold locked plus reserved (see
    /// `[registry] max_client_pinned_bytes`); unbounded unless set.
    pub fn with_pin_limit(self, bytes: u64) -> Self {
        self.lock().pin_limit = bytes;
        self
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl LocalRegistry {
    pub fn policy_name(&self) -> &'static str {
        self.policy_name
    }
}
