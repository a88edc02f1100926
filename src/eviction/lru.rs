//! LRU. One list per node over the shared link array: front = most
//! recently used (or inserted, or released), back = next victim. Every
//! operation O(1); 8 B per entry id.
use super::list::{List, Lists, OUT, POPPED};
use super::{EntryId, EvictionPolicy, Obj, PerNode, Policy};

/// No settings (and no config section).
#[derive(Debug, Clone, PartialEq, Default, serde::Deserialize, serde::Serialize)]
pub struct LruConfig {}

pub struct Lru {
    lists: Lists,
    nodes: PerNode<List>,
}

impl Lru {
    fn list(&mut self, node: u32) -> List {
        let lists = &mut self.lists;
        *self.nodes.get(node, || lists.new_list())
    }
}

impl Policy for Lru {
    const NAME: &'static str = "lru";
    type Config = LruConfig;

    fn new(_c: LruConfig) -> Self {
        Self { lists: Lists::default(), nodes: PerNode::default() }
    }
}

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn insert(&mut self, node: u32, id: EntryId, _obj: Obj) {
        if self.lists.admit(id, ()) {
            self.remove(node, id, 0);
        }
        let l = self.list(node);
        self.lists.push_front(l, id);
    }

    fn touch(&mut self, node: u32, id: EntryId) {
        if self.lists.linked(id) {
            let l = self.list(node);
            self.lists.unlink(id, OUT);
            self.lists.push_front(l, id);
        }
    }

    fn hold(&mut self, _node: u32, id: EntryId) {
        self.lists.hold(id);
    }

    fn release(&mut self, node: u32, id: EntryId) {
        if self.lists.release(id) {
            let l = self.list(node);
            self.lists.push_front(l, id);
        }
    }

    fn pop_victim(&mut self, node: u32) -> Option<EntryId> {
        let l = *self.nodes.find(node)?;
        let v = self.lists.back(l)?;
        self.lists.unlink(v, POPPED);
        Some(v)
    }

    fn remove(&mut self, _node: u32, id: EntryId, _hash: u64) {
        self.lists.take_out(id);
    }

    fn prefetch(&self, id: EntryId) {
        self.lists.prefetch(id);
    }

    fn prefetch_neighbours(&self, id: EntryId) {
        self.lists.prefetch_neighbours(id);
    }
}
