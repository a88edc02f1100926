//! SIEVE (Zhang et al., NSDI'24): one FIFO queue per node and a hand that
//! walks from the old end towards the new; a read only sets the entry's
//! visited bit. The hand clears visited bits as it passes and evicts the
//! first unvisited entry, leaving survivors where they are. Insert, touch,
//! hold, release and remove are O(1); a victim search is amortised O(1)
//! (each step clears a bit some read set). 9 B per entry id.
use super::list::{List, Lists, HELD, OUT, POPPED};
use super::{EntryId, EvictionPolicy, Obj, PerNode, Policy};

/// No settings (and no config section).
#[derive(Debug, Clone, PartialEq, Default, serde::Deserialize, serde::Serialize)]
pub struct SieveConfig {}

struct Node {
    list: List,
    /// The next entry the hand looks at; `None` = start at the old end.
    hand: Option<EntryId>,
}

pub struct Sieve {
    lists: Lists,
    visited: Vec<bool>,
    nodes: PerNode<Node>,
}

impl Sieve {
    fn node(&mut self, node: u32) -> &mut Node {
        let lists = &mut self.lists;
        self.nodes.get(node, || Node { list: lists.new_list(), hand: None })
    }

    /// Take a linked entry out, moving the hand off it first.
    fn unlink(&mut self, node: u32, id: EntryId, mark: u32) {
        let next = self.lists.toward_front(id);
        let n = self.node(node);
        if n.hand == Some(id) {
            n.hand = next;
        }
        self.lists.unlink(id, mark);
    }
}

impl Policy for Sieve {
    const NAME: &'static str = "sieve";
    type Config = SieveConfig;

    fn new(_c: SieveConfig) -> Self {
        Self { lists: Lists::default(), visited: vec![], nodes: PerNode::default() }
    }
}

impl EvictionPolicy for Sieve {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn insert(&mut self, node: u32, id: EntryId, _obj: Obj) {
        if self.lists.admit(id, &mut self.visited) {
            self.remove(node, id, 0);
        }
        self.visited[id.index()] = false;
        let l = self.node(node).list;
        self.lists.push_front(l, id);
    }

    fn touch(&mut self, _node: u32, id: EntryId) {
        if self.lists.touchable(id).is_some() {
            self.visited[id.index()] = true;
        }
    }

    fn hold(&mut self, node: u32, id: EntryId) {
        if self.lists.holding(id) {
            self.unlink(node, id, HELD);
        }
    }

    fn release(&mut self, node: u32, id: EntryId) {
        // Back at the new end: it was just used, and SIEVE keeps no other
        // position for an entry that left the queue.
        if self.lists.release(id) {
            let l = self.node(node).list;
            self.lists.push_front(l, id);
        }
    }

    fn pop_victim(&mut self, node: u32) -> Option<EntryId> {
        let n = self.nodes.find(node)?;
        let list = n.list;
        let mut hand = n.hand.or_else(|| self.lists.back(list))?;
        while self.visited[hand.index()] {
            self.visited[hand.index()] = false;
            hand = self.lists.toward_front(hand).or_else(|| self.lists.back(list))?;
        }
        let n = self.nodes.find(node)?;
        n.hand = self.lists.toward_front(hand);
        self.lists.unlink(hand, POPPED);
        Some(hand)
    }

    fn remove(&mut self, node: u32, id: EntryId, _hash: u64) {
        if self.lists.leaving(id) == Some(true) {
            self.unlink(node, id, OUT);
        }
    }

    fn prefetch(&self, id: EntryId) {
        self.lists.prefetch(id);
    }
}
