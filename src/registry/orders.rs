//! The registry's victim orders: one policy instance ordering each node's
//! entries (eviction for space on a node) and, only where quotas are
//! configured, a second instance of the same policy ordering each tenant's
//! entries (eviction for a tenant at its quota). Every entry is in both, so
//! each transition goes to both; an entry evicted through one order leaves
//! the other as a removal (a ghost history records it in the order that
//! chose it).
use crate::eviction::{EntryId, EvictionPolicy, Obj, PolicyConfig};
use crate::ids::NodeId;

pub(super) struct Orders {
    by_node: Box<dyn EvictionPolicy>,
    /// Keyed by tenant id where the policy takes a node id.
    by_tenant: Option<Box<dyn EvictionPolicy>>,
}

impl Orders {
    pub fn new(policy: &PolicyConfig, per_tenant: bool) -> Self {
        Self { by_node: policy.build(), by_tenant: per_tenant.then(|| policy.build()) }
    }

    pub fn name(&self) -> &'static str {
        self.by_node.name()
    }

    pub fn insert(&mut self, node: NodeId, tenant: u32, id: EntryId, obj: Obj) {
        self.by_node.insert(node.0, id, obj);
        if let Some(t) = &mut self.by_tenant {
            t.insert(tenant, id, obj);
        }
    }

    pub fn touch(&mut self, node: NodeId, tenant: u32, id: EntryId) {
        self.by_node.touch(node.0, id);
        if let Some(t) = &mut self.by_tenant {
            t.touch(tenant, id);
        }
    }

    pub fn hold(&mut self, node: NodeId, tenant: u32, id: EntryId) {
        self.by_node.hold(node.0, id);
        if let Some(t) = &mut self.by_tenant {
            t.hold(tenant, id);
        }
    }

    pub fn release(&mut self, node: NodeId, tenant: u32, id: EntryId) {
        self.by_node.release(node.0, id);
        if let Some(t) = &mut self.by_tenant {
            t.release(tenant, id);
        }
    }

    pub fn remove(&mut self, node: NodeId, tenant: u32, id: EntryId, hash: u64) {
        self.by_node.remove(node.0, id, hash);
        if let Some(t) = &mut self.by_tenant {
            t.remove(tenant, id, hash);
        }
    }

    /// The next victim among `node`'s entries.
    pub fn pop_node(&mut self, NodeId(node): NodeId) -> Option<EntryId> {
        self.by_node.pop_victim(node)
    }

    /// The next victim among `tenant`'s entries (None without quotas).
    pub fn pop_tenant(&mut self, tenant: u32) -> Option<EntryId> {
        self.by_tenant.as_mut()?.pop_victim(tenant)
    }

    /// Put a victim `pop_node` returned back among the candidates (the
    /// policy's contract: hold, then release).
    pub fn put_back(&mut self, NodeId(node): NodeId, id: EntryId) {
        self.by_node.hold(node, id);
        self.by_node.release(node, id);
    }

    pub fn prefetch(&self, id: EntryId) {
        self.by_node.prefetch(id);
    }

    pub fn prefetch_neighbours(&self, id: EntryId) {
        self.by_node.prefetch_neighbours(id);
    }
}
