//! Eviction policies: one trait, one file per policy, chosen by name in the
//! config. A policy only orders entries; the registry decides what exists
//! (committed entries), tells the policy which entries are in use (locked),
//! and removes the victims the policy hands out.
//!
//! One instance orders the candidates of every node: each node has its own
//! order (eviction is per node) while entry ids are global, so per-id state
//! lives in arrays indexed by id however many nodes share the pool.
//!
//! Adding a policy: its file (the policy; its settings type; `impl Policy`
//! with its name, validation and constructor) and its row in `policies!`
//! below. Its name, config section, builder, command-line help and its run
//! through the conformance suite (`tests/mod.rs`) follow from the row. In
//! the docs: its file in docs/ARCHITECTURE.md's eviction row (which
//! `tests/layering.rs` holds to the tree) and its name in the README's
//! `--eviction-policy` row.
//!
//! Each policy's file states its order, its costs and its memory per entry
//! id (docs/ARCHITECTURE.md sums them up). n there is the number of
//! candidates of the node; "amortised" victim searches pass over entries
//! whose state a read or hold set (each pass spends it). With `[quotas]`,
//! the registry keeps a second instance ordering each tenant's entries,
//! which doubles the memory. Ghost tables hold one 2 B slot per live entry
//! at most (`gd`: `ghost` slots) and are allocated at the first eviction.
//! Per node there are a few sentinels and counters (`kv`: 129 sentinels,
//! 1 KiB; `gd`: 257, 2 KiB). `gd`'s tuner passes the calls for sampled keys
//! (all of them below 4096 entries, 4096 of them at most above) to 13
//! simulations: a bit per entry id and under 4 MiB.
pub(crate) mod ghost;
mod list;
mod settings;
mod table;
#[cfg(test)]
mod tests;
mod tuner;
pub(crate) use tuner::ByKeyHash;

use settings::{check_ghost, refuse};

// One row per policy: its module (named for the policy), the policy and
// its settings type. Everything that lists the policies derives from here.
table::policies! {
    lru::{Lru, LruConfig},
    fifo::{Fifo, FifoConfig},
    lfu::{Lfu, LfuConfig},
    sieve::{Sieve, SieveConfig},
    s3fifo::{S3Fifo, S3FifoConfig},
    ttl::{Ttl, TtlConfig},
    kv::{Kv, KvConfig},
    gd::{Gd, GdConfig},
}

use crate::error::Result;

/// Re-exported: the policies' API speaks in the registry's entry ids.
pub use crate::ids::EntryId;

/// What a policy may know about an entry besides its id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Obj {
    /// Object size in bytes.
    pub size: u64,
    /// The registry's hash of the key: stable while the process runs, so a
    /// policy can recognise a key that comes back after it was evicted.
    pub hash: u64,
}

/// The contract every policy keeps. Calls for one id always name the node
/// the entry lives on. An entry is, for the policy, in one of four states:
/// out (unknown or removed), candidate, held (in use) or popped (handed out
/// as a victim, removal pending). The registry drives the transitions:
///
/// ```text
/// out --insert--> candidate --hold--> held --release--> candidate
/// candidate --pop_victim--> popped --remove--> out
/// candidate | held | popped --remove--> out
/// ```
pub trait EvictionPolicy: Send {
    fn name(&self) -> &'static str;

    /// A committed entry of `node` became a candidate (state out). `obj`
    /// is all the policy learns about the object; it may keep what it
    /// needs. A policy may admit a new entry anywhere in its order,
    /// including first in line for eviction.
    fn insert(&mut self, node: u32, id: EntryId, obj: Obj);

    /// The entry was read (a lookup hit). Valid on a candidate or a held
    /// entry (lookups lock, so a touch usually comes with a hold); a no-op
    /// on an entry that is out or popped.
    fn touch(&mut self, node: u32, id: EntryId);

    /// The entry is in use (locked by a reader): until `release` it is
    /// never returned by `pop_victim`. O(1) for every policy except `lfu`,
    /// so eviction never walks over entries in use. No-op unless the
    /// entry is a candidate (or popped: a popped entry put on hold goes
    /// back to the candidates at `release`).
    fn hold(&mut self, node: u32, id: EntryId);

    /// The entry's last lock went: it is a candidate again and keeps its
    /// history (for LRU it becomes the most recently used). No-op unless held.
    fn release(&mut self, node: u32, id: EntryId);

    /// The next victim of `node`, taken out of the candidates (state
    /// popped), or `None` when the node has no candidate. Selection may
    /// change the policy's state (a SIEVE hand, S3-FIFO's queues, decaying
    /// scores). The caller removes the victim next (`remove`), or puts it
    /// back with `hold` + `release` if it cannot evict it after all.
    fn pop_victim(&mut self, node: u32) -> Option<EntryId>;

    /// The entry left the registry, in any state: if it is the victim
    /// `pop_victim` returned, it was evicted (and a policy with a ghost
    /// history remembers `hash`); otherwise it was deleted. No-op when out.
    fn remove(&mut self, node: u32, id: EntryId, hash: u64);

    /// Load `id`'s state now, ahead of a batch's touches (a hint; the
    /// registry issues these for a whole batch so the misses overlap).
    fn prefetch(&self, _id: EntryId) {}

    /// Load what touching or holding `id` also changes, once `id`'s own
    /// state is in cache (a hint).
    fn prefetch_neighbours(&self, _id: EntryId) {}
}

/// How a policy joins the table (`policies!`): its name, its settings and
/// how it is built from them, all in its own file.
pub trait Policy: EvictionPolicy + Sized + 'static {
    /// Its name in configs, metrics and `EvictionPolicy::name`, and the
    /// name of its config section, `[registry.eviction.<NAME>]`. The same
    /// as its module's (the row names both).
    const NAME: &'static str;
    /// Whether it has a config section: not for a policy without
    /// settings (an empty `Config`), whose section is refused at parse time.
    const SECTION: bool = std::mem::size_of::<Self::Config>() > 0;
    /// Its settings, with their defaults.
    type Config: Clone + Default + std::fmt::Debug + PartialEq + serde::Serialize + serde::de::DeserializeOwned;

    fn new(c: Self::Config) -> Self;

    /// Settings it cannot work with, refused at start (`refuse` names
    /// them with their section). Every section is checked, whichever
    /// policy runs.
    fn validate(_c: &Self::Config) -> Result<()> {
        Ok(())
    }

    /// Its settings in a miniature simulation (`registry::shadows`): the
    /// same unless the policy runs simulations of its own.
    fn simulation(c: &Self::Config) -> Self::Config {
        c.clone()
    }
}

impl PolicyConfig {
    /// The named policy with its default settings; `default` names
    /// `DEFAULT_POLICY`.
    pub fn by_name(name: &str) -> Result<Self> {
        Ok(Self::of(name.parse()?))
    }
}

impl PolicyKind {
    /// The policy a registry uses when the config names none, chosen by
    /// trace replay (`cxlkv-trace replay`) over real and generated traces,
    /// capacities and key salts: `gd` gains the most block hits over LRU
    /// where there is anything to gain, is never noticeably below it, and
    /// keeps prefix hits (what LMCache loads) as high as its block hits;
    /// `kv` gains block hits too but loses prefix hits. The figures:
    /// docs/benchmark-findings.md, "Eviction quality".
    pub const DEFAULT: PolicyKind = PolicyKind::Gd;
}

pub const DEFAULT_POLICY: &str = PolicyKind::DEFAULT.as_str();

/// Every policy's name, in `PolicyKind::ALL`'s order.
pub const POLICIES: &[&str] = &{
    let mut names = [""; PolicyKind::ALL.len()];
    let mut i = 0;
    while i < names.len() {
        names[i] = PolicyKind::ALL[i].as_str();
        i += 1;
    }
    names
};

pub fn by_name(name: &str) -> Result<Box<dyn EvictionPolicy>> {
    Ok(PolicyConfig::by_name(name)?.build())
}

/// Per-node state of a policy, keyed by a node id (or, for the registry's
/// per-tenant order, a tenant id). Both are small dense integers, so ids
/// below `DENSE` index a vector directly (O(1) however many tenants); any
/// other id goes to a short list searched in order.
pub(crate) struct PerNode<T> {
    dense: Vec<Option<T>>,
    sparse: Vec<(u32, T)>,
}

/// Ids indexed directly (the registry's default tenant limit is 1024).
const DENSE: u32 = 4096;

impl<T> Default for PerNode<T> {
    fn default() -> Self {
        Self { dense: vec![], sparse: vec![] }
    }
}

impl<T> PerNode<T> {
    pub fn get(&mut self, node: u32, make: impl FnOnce() -> T) -> &mut T {
        if node < DENSE {
            let i = node as usize;
            if self.dense.len() <= i {
                self.dense.resize_with(i + 1, || None);
            }
            return self.dense[i].get_or_insert_with(make);
        }
        let i = match self.sparse.iter().position(|(n, _)| *n == node) {
            Some(i) => i,
            None => {
                self.sparse.push((node, make()));
                self.sparse.len() - 1
            }
        };
        &mut self.sparse[i].1
    }
    pub fn find(&mut self, node: u32) -> Option<&mut T> {
        if node < DENSE {
            return self.dense.get_mut(node as usize)?.as_mut();
        }
        self.sparse.iter_mut().find(|(n, _)| *n == node).map(|(_, t)| t)
    }
}
