//! FIFO: victims in insertion order, reads change nothing. One queue per
//! node; an entry in use keeps its place (a flag), and one that reaches the
//! old end while in use is parked aside until released, then goes back to
//! the old end (it is still the oldest). Insert, touch, hold, release and
//! remove are O(1); a victim search is amortised O(1) (each entry is parked
//! at most once per hold). 9 B per entry id.
use super::list::{List, Lists, HELD, OUT, POPPED};
use super::{EntryId, EvictionPolicy, Obj, PerNode, Policy};

/// No settings (and no config section).
#[derive(Debug, Clone, PartialEq, Default, serde::Deserialize, serde::Serialize)]
pub struct FifoConfig {}

const IN_USE: u8 = 1;
const PARKED: u8 = 2;

pub struct Fifo {
    lists: Lists,
    flags: Vec<u8>,
    /// (queue, parked) per node.
    nodes: PerNode<(List, List)>,
}

impl Fifo {
    fn lists(&mut self, node: u32) -> (List, List) {
        let l = &mut self.lists;
        *self.nodes.get(node, || (l.new_list(), l.new_list()))
    }
}

impl Policy for Fifo {
    const NAME: &'static str = "fifo";
    type Config = FifoConfig;

    fn new(_c: FifoConfig) -> Self {
        Self { lists: Lists::default(), flags: vec![], nodes: PerNode::default() }
    }
}

impl EvictionPolicy for Fifo {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn insert(&mut self, node: u32, id: EntryId, _obj: Obj) {
        if self.lists.admit(id, &mut self.flags) {
            self.remove(node, id, 0);
        }
        self.flags[id.index()] = 0;
        let (q, _) = self.lists(node);
        self.lists.push_front(q, id);
    }

    fn touch(&mut self, _node: u32, _id: EntryId) {}

    fn hold(&mut self, _node: u32, id: EntryId) {
        // A candidate keeps its place in the queue, flagged.
        if self.lists.holding(id) {
            self.flags[id.index()] |= IN_USE;
        }
    }

    fn release(&mut self, node: u32, id: EntryId) {
        let (q, _) = self.lists(node);
        match self.lists.mark(id) {
            None if self.flags[id.index()] & PARKED != 0 => {
                self.lists.unlink(id, OUT);
                self.lists.push_back(q, id);
            }
            Some(HELD) => {
                self.lists.set_mark(id, OUT);
                self.lists.push_back(q, id);
            }
            _ => {}
        }
        if let Some(f) = self.flags.get_mut(id.index()) {
            *f = 0;
        }
    }

    fn pop_victim(&mut self, node: u32) -> Option<EntryId> {
        let &mut (q, parked) = self.nodes.find(node)?;
        loop {
            let v = self.lists.back(q)?;
            self.lists.unlink(v, OUT);
            if self.flags[v.index()] & IN_USE != 0 {
                self.flags[v.index()] |= PARKED;
                self.lists.push_front(parked, v);
                continue;
            }
            self.lists.set_mark(v, POPPED);
            return Some(v);
        }
    }

    fn remove(&mut self, _node: u32, id: EntryId, _hash: u64) {
        self.lists.take_out(id);
        if let Some(f) = self.flags.get_mut(id.index()) {
            *f = 0;
        }
    }

    fn prefetch(&self, id: EntryId) {
        self.lists.prefetch(id);
    }
}
