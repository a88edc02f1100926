//! LFU with dynamic aging (LFU-DA, Arlitt et al.): an entry's priority is
//! its read count plus the node's age `L`, and `L` becomes the priority of
//! each victim. Entries popular long ago sink below newer ones as `L`
//! rises, so old counts cannot pin the cache. One binary min-heap per node
//! with each entry's heap position: insert, touch, hold, release, remove
//! and pop_victim are O(log n). 14 B per entry id (priority, count,
//! position, heap slot).
use super::list::{HELD, OUT, POPPED};
use super::{EntryId, EvictionPolicy, Obj, PerNode, Policy};

/// No settings (and no config section).
#[derive(Debug, Clone, PartialEq, Default, serde::Deserialize, serde::Serialize)]
pub struct LfuConfig {}

#[derive(Default)]
struct Heap {
    ids: Vec<EntryId>,
    age: u32,
}

pub struct Lfu {
    /// Heap position, or a state mark (OUT, HELD, POPPED) when in no heap.
    pos: Vec<u32>,
    prio: Vec<u32>,
    count: Vec<u16>,
    nodes: PerNode<Heap>,
}

impl Lfu {
    fn state(&self, id: EntryId) -> Option<u32> {
        match self.pos.get(id.index()) {
            None => Some(OUT),
            Some(&p) if p >= POPPED => Some(p),
            Some(_) => None,
        }
    }
}

fn less(prio: &[u32], a: EntryId, b: EntryId) -> bool {
    prio[a.index()] < prio[b.index()]
}

fn sift_up(h: &mut [EntryId], pos: &mut [u32], prio: &[u32], mut i: usize) {
    while i > 0 {
        let p = (i - 1) / 2;
        if !less(prio, h[i], h[p]) {
            break;
        }
        h.swap(i, p);
        pos[h[i].index()] = i as u32;
        pos[h[p].index()] = p as u32;
        i = p;
    }
}

fn sift_down(h: &mut [EntryId], pos: &mut [u32], prio: &[u32], mut i: usize) {
    loop {
        let (l, r) = (2 * i + 1, 2 * i + 2);
        let mut m = i;
        if l < h.len() && less(prio, h[l], h[m]) {
            m = l;
        }
        if r < h.len() && less(prio, h[r], h[m]) {
            m = r;
        }
        if m == i {
            break;
        }
        h.swap(i, m);
        pos[h[i].index()] = i as u32;
        pos[h[m].index()] = m as u32;
        i = m;
    }
}

impl Lfu {
    fn push(&mut self, node: u32, id: EntryId) {
        let h = self.nodes.get(node, Heap::default);
        self.prio[id.index()] = h.age.saturating_add(self.count[id.index()] as u32);
        h.ids.push(id);
        let i = h.ids.len() - 1;
        self.pos[id.index()] = i as u32;
        sift_up(&mut h.ids, &mut self.pos, &self.prio, i);
    }

    /// Take a heaped entry out and give it `mark`.
    fn take(&mut self, node: u32, id: EntryId, mark: u32) {
        let i = self.pos[id.index()] as usize;
        let h = self.nodes.get(node, Heap::default);
        let last = h.ids.pop().expect("a heaped id's heap is not empty");
        if i < h.ids.len() {
            h.ids[i] = last;
            self.pos[last.index()] = i as u32;
            sift_up(&mut h.ids, &mut self.pos, &self.prio, i);
            let j = self.pos[last.index()] as usize;
            sift_down(&mut h.ids, &mut self.pos, &self.prio, j);
        }
        self.pos[id.index()] = mark;
    }
}

#[cfg(test)]
impl Lfu {
    pub fn priority(&self, id: EntryId) -> u32 {
        self.prio[id.index()]
    }
}

impl Policy for Lfu {
    const NAME: &'static str = "lfu";
    type Config = LfuConfig;

    fn new(_c: LfuConfig) -> Self {
        Self { pos: vec![], prio: vec![], count: vec![], nodes: PerNode::default() }
    }
}

impl EvictionPolicy for Lfu {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn insert(&mut self, node: u32, id: EntryId, _obj: Obj) {
        let i = id.index();
        if i >= self.pos.len() {
            self.pos.resize(i + 1, OUT);
            self.prio.resize(i + 1, 0);
            self.count.resize(i + 1, 0);
        }
        if self.state(id).is_none() {
            self.take(node, id, OUT);
        }
        self.count[i] = 1;
        self.push(node, id);
    }

    fn touch(&mut self, node: u32, id: EntryId) {
        let s = self.state(id);
        if !matches!(s, None | Some(HELD)) {
            return;
        }
        let c = &mut self.count[id.index()];
        *c = c.saturating_add(1);
        if s.is_none() {
            // Its priority only rises: it moves towards the leaves.
            let h = self.nodes.get(node, Heap::default);
            self.prio[id.index()] = h.age.saturating_add(self.count[id.index()] as u32);
            let i = self.pos[id.index()] as usize;
            sift_down(&mut h.ids, &mut self.pos, &self.prio, i);
        }
    }

    fn hold(&mut self, node: u32, id: EntryId) {
        match self.state(id) {
            None => self.take(node, id, HELD),
            Some(POPPED) => self.pos[id.index()] = HELD,
            _ => {}
        }
    }

    fn release(&mut self, node: u32, id: EntryId) {
        if self.state(id) == Some(HELD) {
            self.push(node, id);
        }
    }

    fn pop_victim(&mut self, node: u32) -> Option<EntryId> {
        let h = self.nodes.find(node)?;
        let &v = h.ids.first()?;
        h.age = h.age.max(self.prio[v.index()]);
        self.take(node, v, POPPED);
        Some(v)
    }

    fn remove(&mut self, node: u32, id: EntryId, _hash: u64) {
        match self.state(id) {
            None => self.take(node, id, OUT),
            Some(OUT) => {}
            Some(_) => self.pos[id.index()] = OUT,
        }
    }

    fn prefetch(&self, id: EntryId) {
        if let Some(p) = self.pos.get(id.index()) {
            crate::platform::prefetch(p);
        }
    }
}
