//! The key registry: key → location, write-once, two-phase store (reserve →
//! commit), refcounted TTL locks, eviction through a pluggable policy.
//! `LocalRegistry` (`local.rs`) is the registry of a single node or of the
//! cluster's primary; the boundary the handler sees, local or forwarded to
//! the primary, is `Directory` (`directory.rs`). Callers pass `now`
//! (monotonic ms) so time is explicit and testable.
pub mod admission;
#[cfg(test)]
mod admission_tests;
pub mod config;
pub mod convert;
pub mod directory;
mod entry;
mod index;
mod inner;
pub mod local;
mod local_directory;
pub mod ops;
mod orders;
pub mod quota;
#[cfg(test)]
mod quota_tests;
mod restore;
mod shadows;
#[cfg(test)]
mod tests;

pub use admission::{AdmissionConfig, AdmissionMode, AdmissionStats};
pub use directory::Directory;
pub use entry::KeyBuf;
pub use local::LocalRegistry;
pub use local_directory::LocalDirectory;
pub use ops::{Ops, Reserved};
pub use quota::QuotaConfig;
pub use restore::{Found, Restored};

use crate::error::Result;
use crate::ids::{NodeId, RegionId};

/// Where an object's bytes are. `node` owns `region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Location {
    pub node: NodeId,
    pub region: RegionId,
    pub offset: u64,
    pub length: u64,
    pub generation: u64,
    /// The pool's version word of the object's first page when the object
    /// was allocated. Freeing the pages changes the word, so a reader that
    /// finds it unchanged after copying knows the bytes were this object's.
    pub version: u32,
}

/// The client session (one gRPC connection) that made a reservation; only it
/// may commit or abort it. `Session::LOCAL` is the sidecar itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Session(pub u64);

impl Session {
    pub const LOCAL: Session = Session(0);
    /// A follower's node-held locks (`cluster::holds`): its clients' reads
    /// of a key it holds are answered on the follower, covered by this one
    /// lock at the primary. Client sessions count up from 1 and never get
    /// here.
    pub const HOLD: Session = Session((1 << Self::NODE_SHIFT) - 1);
    /// Bits of a session id left to the node that tagged the connection.
    const NODE_SHIFT: u32 = 40;
    /// A durable session (`crate::sessions`): named by its client, it
    /// outlives its connections, and the locks it takes are view locks
    /// (`LockMark`). Connection sessions count up from 1 and never get here.
    pub const DURABLE_BIT: u64 = 1 << 39;

    /// A follower's session as the primary knows it: the follower's node id
    /// in the high bits, so sessions of different nodes never collide and a
    /// dead node's sessions can be found. The primary's own sessions keep
    /// node bits 0.
    pub fn on_node(self, node: u32) -> Session {
        Session(((node as u64) << Self::NODE_SHIFT) | (self.0 & ((1 << Self::NODE_SHIFT) - 1)))
    }

    /// A follower's node-held lock (`HOLD` on some node's bits).
    pub fn is_hold(self) -> bool {
        self.0 & ((1 << Self::NODE_SHIFT) - 1) == Self::HOLD.0
    }

    /// A durable session's (on any node): its locks end by unlock or TTL
    /// only, never with a connection or a node's registration.
    pub fn is_durable(self) -> bool {
        self.0 & Self::DURABLE_BIT != 0 && !self.is_hold()
    }

    /// The node bits (0 for sessions of the node that holds the registry).
    pub fn node_bits(self) -> u32 {
        (self.0 >> Self::NODE_SHIFT) as u32
    }

    /// A sidecar acting for itself (an inline put): `LOCAL` on the node that
    /// holds the registry, and a follower's `LOCAL` as the primary knows it
    /// (its node bits, no client bits). Client sessions count up from 1
    /// (`conn.rs`): their bits below the node bits are never 0.
    pub fn is_sidecar(self) -> bool {
        self.0 & ((1 << Self::NODE_SHIFT) - 1) == 0
    }
}

/// The tenants a client may touch. Tenant-bound credentials (see
/// `crate::auth`) give `Tenants`; operators, and every client where no
/// binding is configured, get `All`. Key names are one namespace shared by
/// all tenants, so a scope check happens under the registry lock, in the
/// same step as the operation it guards: a key cannot change tenant between
/// the check and a lock or delete.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Scope {
    #[default]
    All,
    Tenants(std::sync::Arc<std::collections::BTreeSet<String>>),
}

impl Scope {
    pub fn tenants<I: IntoIterator<Item = S>, S: Into<String>>(names: I) -> Self {
        Scope::Tenants(std::sync::Arc::new(names.into_iter().map(Into::into).collect()))
    }
    pub fn allows(&self, tenant: &str) -> bool {
        match self {
            Scope::All => true,
            Scope::Tenants(t) => t.contains(tenant),
        }
    }
    /// The error for a key or tenant outside the scope.
    pub fn denied(what: impl std::fmt::Display) -> crate::error::Error {
        crate::error::Error::new(
            crate::error::ErrorKind::PermissionDenied,
            format!("{what} belongs to a tenant this credential is not bound to"),
        )
    }
}

/// How a batch of reservations is recorded.
#[derive(Debug, Clone, Copy)]
pub struct ReserveOpts {
    /// Monotonic ms after which an uncommitted reservation is reclaimed.
    pub deadline: u64,
    pub owner: Session,
    /// The sidecar writes the bytes itself (inline put): housekeeping never
    /// reclaims the reservation under the writer; the writer aborts it.
    pub server_writes: bool,
}

impl ReserveOpts {
    /// Reservations the sidecar's own session makes and the client writes.
    pub fn local(deadline: u64) -> Self {
        Self { deadline, owner: Session::LOCAL, server_writes: false }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    pub key: Vec<u8>,
    pub tenant: String,
    pub size: u64,
}

/// One page of a key listing and the cursor of the next (0: the last page).
pub type Listed = (Vec<KeyInfo>, u64);

/// A committed key that left the registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removed {
    pub seq: u64,
    pub key: Vec<u8>,
    pub tenant: String,
    pub size: u64,
    pub reason: Removal,
}

/// Why a committed key left the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    Deleted,
    /// Made room in its node's regions (phase 1).
    Evicted,
    /// Its whole region went to another node (phase 3).
    Reclaimed,
}

impl Removal {
    pub fn as_str(self) -> &'static str {
        match self {
            Removal::Deleted => "deleted",
            Removal::Evicted => "evicted",
            Removal::Reclaimed => "reclaimed",
        }
    }

    /// The wire name back (unknown names read as "deleted").
    pub fn parse(s: &str) -> Self {
        match s {
            "evicted" => Removal::Evicted,
            "reclaimed" => Removal::Reclaimed,
            _ => Removal::Deleted,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantUsage {
    pub tenant: String,
    /// Payload bytes of committed keys.
    pub bytes: u64,
    pub keys: u64,
    /// Payload bytes of open reservations.
    pub reserving_bytes: u64,
    /// 0 = none (`[quotas]`).
    pub quota_bytes: u64,
    pub guaranteed_bytes: u64,
}

#[derive(Debug, Clone, Default)]
pub struct RegistryStats {
    pub keys: u64,
    pub reserved: u64,
    pub bytes_stored: u64,
    pub locked_keys: u64,
    pub evictions: u64,
    pub reservations_expired: u64,
    pub locks_expired: u64,
    /// Entries the victim search looked at (each one is evicted: entries in
    /// use are not in the search order).
    pub eviction_visits: u64,
    /// Evictions of a tenant's own entries to keep it under its quota
    /// (also counted in `evictions`).
    pub quota_evictions: u64,
    /// Tenants with keys or open reservations.
    pub tenants: Vec<TenantUsage>,
    /// What admission decided.
    pub admission: AdmissionStats,
}

/// What admission says of a key a client wants to store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Committed or being written: a reserve would say "exists".
    Present,
    Admitted,
    /// Not worth a place now (not an error: the store is skipped).
    Refused,
}

/// Entries removed by the registry whose pages the caller must free.
pub type Freed = Vec<Location>;

/// Where a registry keeps the high-water mark of the commit sequences it
/// handed out (`LocalRegistry::with_seq_store`).
pub trait SeqStore: Send + Sync {
    /// Record that no sequence at or above `limit` has been handed out yet;
    /// called before the first sequence past the previous limit.
    fn keep_below(&self, limit: u64) -> Result<()>;
}

/// Where a registry records how long the locks of durable sessions (views
/// a client may read at any time) can last (`LocalRegistry::with_lock_mark`):
/// a sidecar that restarts on the pool removes nothing committed before
/// then, so a view taken before a crash never sees its pages reused.
pub trait LockMark: Send + Sync {
    /// Record that every durable lock granted so far lapses by `unix_ms`;
    /// called before a lock past the previous record is granted.
    fn cover(&self, unix_ms: u64) -> Result<()>;
}

pub fn pages_for(length: u64, page_size: u64) -> u64 {
    length.div_ceil(page_size).max(1)
}
