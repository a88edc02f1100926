//! Eviction policies: one trait, chosen by name in the config. A policy only
//! orders entries; the registry decides what is evictable (committed, not
//! locked) and removes victims. Every operation is O(1).
use hashbrown::HashMap;

use crate::error::{Error, Result};

pub type EntryId = u32;

/// One instance orders the candidates of every node: each node has its own
/// order (eviction is per node) while ids are global, so per-id state lives in
/// one array however many nodes share the pool.
pub trait EvictionPolicy: Send {
    fn name(&self) -> &'static str;
    /// A committed entry of `node` became a candidate.
    fn insert(&mut self, node: u32, id: EntryId);
    /// The entry was read (lookup).
    fn touch(&mut self, node: u32, id: EntryId);
    /// The entry is gone (deleted, evicted).
    fn remove(&mut self, node: u32, id: EntryId);
    /// The entry is in use (locked by a reader): it must not be offered as a
    /// victim until `release`. Eviction never walks over held entries, so the
    /// cost of a victim search is bounded by the victims it finds.
    fn hold(&mut self, node: u32, id: EntryId) {
        self.remove(node, id);
    }
    /// The entry's last lock went: it is a candidate again, as just used.
    fn release(&mut self, node: u32, id: EntryId) {
        self.insert(node, id);
    }
    /// `node`'s candidates from most to least evictable: `None` starts,
    /// `Some(id)` continues after `id` (which must still be a candidate).
    fn next_victim(&self, node: u32, after: Option<EntryId>) -> Option<EntryId>;
    /// Load `id`'s state now, ahead of a batch's touches (a hint; the
    /// registry issues these for a whole batch so the misses overlap).
    fn prefetch(&self, _id: EntryId) {}
    /// Load what touching `id` also changes, once `id`'s own state is in
    /// cache (a hint).
    fn prefetch_neighbours(&self, _id: EntryId) {}
}

pub const POLICIES: &[&str] = &["lru", "fifo"];

pub fn by_name(name: &str) -> Result<Box<dyn EvictionPolicy>> {
    match name.to_ascii_lowercase().as_str() {
        "lru" => Ok(Box::new(Lru::new(true))),
        "fifo" => Ok(Box::new(Lru::new(false))),
        other => Err(Error::invalid(format!("unknown eviction policy {other:?}; known: {}", POLICIES.join(", ")))),
    }
}

const NIL: u32 = u32::MAX;
/// `links[id].0` of an id that is in no list.
const OUT: u32 = u32::MAX - 1;

/// Intrusive doubly linked lists over entry ids, one per node: head = most
/// recent, tail = next victim. With `touch_moves == false` it is FIFO
/// (insertion order).
pub struct Lru {
    /// (prev, next) per entry id; prev == OUT when in no list.
    links: Vec<(u32, u32)>,
    /// (head, tail) per node.
    ends: HashMap<u32, (u32, u32)>,
    touch_moves: bool,
}

impl Lru {
    pub fn new(touch_moves: bool) -> Self {
        Self { links: vec![], ends: HashMap::new(), touch_moves }
    }
    fn grow(&mut self, id: EntryId) {
        assert!(id < OUT, "entry id {id} out of range");
        if id as usize >= self.links.len() {
            // Ids are dense, so this writes one element at a time (amortised
            // growth), never a power-of-two span of untouched memory.
            self.links.resize(id as usize + 1, (OUT, OUT));
        }
    }
    fn member(&self, id: EntryId) -> bool {
        self.links.get(id as usize).is_some_and(|l| l.0 != OUT)
    }
}

/// (head, tail) of one node's list.
type Ends = (u32, u32);

fn unlink(links: &mut [(u32, u32)], ends: &mut Ends, id: EntryId) {
    let (p, n) = links[id as usize];
    if p != NIL {
        links[p as usize].1 = n
    } else {
        ends.0 = n
    }
    if n != NIL {
        links[n as usize].0 = p
    } else {
        ends.1 = p
    }
    links[id as usize] = (OUT, OUT);
}

fn push_front(links: &mut [(u32, u32)], ends: &mut Ends, id: EntryId) {
    let head = ends.0;
    ends.0 = id;
    if head == NIL {
        ends.1 = id
    }
    links[id as usize] = (NIL, head);
    if head != NIL {
        links[head as usize].0 = id
    }
}

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        if self.touch_moves {
            "lru"
        } else {
            "fifo"
        }
    }
    fn insert(&mut self, node: u32, id: EntryId) {
        self.grow(id);
        let member = self.member(id);
        let ends = self.ends.entry(node).or_insert((NIL, NIL));
        if member {
            unlink(&mut self.links, ends, id);
        }
        push_front(&mut self.links, ends, id);
    }
    fn touch(&mut self, node: u32, id: EntryId) {
        if self.touch_moves && self.member(id) {
            let ends = self.ends.get_mut(&node).expect("a member's node has a list");
            unlink(&mut self.links, ends, id);
            push_front(&mut self.links, ends, id);
        }
    }
    fn remove(&mut self, node: u32, id: EntryId) {
        if self.member(id) {
            let ends = self.ends.get_mut(&node).expect("a member's node has a list");
            unlink(&mut self.links, ends, id);
        }
    }
    fn next_victim(&self, node: u32, after: Option<EntryId>) -> Option<EntryId> {
        let v = match after {
            None => self.ends.get(&node).map_or(NIL, |e| e.1),
            Some(id) => self.links.get(id as usize).map_or(NIL, |l| l.0),
        };
        (v != NIL && v != OUT).then_some(v)
    }
    fn prefetch(&self, id: EntryId) {
        if let Some(l) = self.links.get(id as usize) {
            crate::pool::prefetch(l);
        }
    }
    fn prefetch_neighbours(&self, id: EntryId) {
        if let Some(&(p, n)) = self.links.get(id as usize) {
            for x in [p, n] {
                if let Some(l) = self.links.get(x as usize) {
                    crate::pool::prefetch(l);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(p: &dyn EvictionPolicy, node: u32) -> Vec<EntryId> {
        let mut v = vec![];
        let mut c = p.next_victim(node, None);
        while let Some(id) = c {
            v.push(id);
            c = p.next_victim(node, Some(id));
        }
        v
    }

    #[test]
    fn lru_orders_by_last_use_and_fifo_by_insert() {
        let mut lru = by_name("LRU").unwrap();
        let mut fifo = by_name("fifo").unwrap();
        for p in [&mut lru, &mut fifo] {
            for id in [3, 1, 7, 2] {
                p.insert(1, id);
            }
            p.touch(1, 3);
            p.remove(1, 7);
            p.touch(1, 7); // touching a removed id is a no-op
        }
        assert_eq!(order(lru.as_ref(), 1), vec![1, 2, 3]);
        assert_eq!(order(fifo.as_ref(), 1), vec![3, 1, 2]);
        assert!(by_name("random").is_err());
    }

    #[test]
    fn each_node_has_its_own_order() {
        let mut p = by_name("lru").unwrap();
        for (node, id) in [(1, 0), (2, 1), (1, 2), (2, 3), (1, 4)] {
            p.insert(node, id);
        }
        for (node, id) in [(1, 0), (2, 1), (1, 2)] {
            p.touch(node, id);
        }
        assert_eq!(order(p.as_ref(), 1), vec![4, 0, 2]);
        assert_eq!(order(p.as_ref(), 2), vec![3, 1]);
        p.remove(2, 3);
        p.remove(2, 1);
        assert!(order(p.as_ref(), 2).is_empty(), "an emptied node");
        assert!(order(p.as_ref(), 9).is_empty(), "a node never seen");
        p.insert(2, 3);
        assert_eq!(order(p.as_ref(), 2), vec![3]);
        assert_eq!(order(p.as_ref(), 1), vec![4, 0, 2], "node 1 untouched by node 2's changes");
    }
}
