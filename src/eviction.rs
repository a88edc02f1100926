//! Eviction policies: one trait, chosen by name in the config. A policy only
//! orders entries; the registry decides what is evictable (committed, not
//! locked) and removes victims. Every operation is O(1).
use crate::error::{Error, Result};

pub type EntryId = u32;

pub trait EvictionPolicy: Send {
    fn name(&self) -> &'static str;
    /// A committed entry became a candidate.
    fn insert(&mut self, id: EntryId);
    /// The entry was read (lookup).
    fn touch(&mut self, id: EntryId);
    /// `touch` for a batch, in order; policies may overlap the batch's memory
    /// accesses.
    fn touch_many(&mut self, ids: &[EntryId]) {
        for &id in ids {
            self.touch(id)
        }
    }
    /// The entry is gone (deleted, evicted).
    fn remove(&mut self, id: EntryId);
    /// Candidates from most to least evictable: `None` starts, `Some(id)`
    /// continues after `id` (which must still be a candidate).
    fn next_victim(&self, after: Option<EntryId>) -> Option<EntryId>;
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
/// `links[id].0` of an id that is not in the list.
const OUT: u32 = u32::MAX - 1;

/// Intrusive doubly linked list over entry ids: head = most recent, tail =
/// next victim. With `touch_moves == false` it is FIFO (insertion order).
pub struct Lru {
    /// (prev, next) per entry id; prev == OUT when not a member.
    links: Vec<(u32, u32)>,
    head: u32,
    tail: u32,
    touch_moves: bool,
}

impl Lru {
    pub fn new(touch_moves: bool) -> Self {
        Self { links: vec![], head: NIL, tail: NIL, touch_moves }
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
    fn unlink(&mut self, id: EntryId) {
        let (p, n) = self.links[id as usize];
        if p != NIL {
            self.links[p as usize].1 = n
        } else {
            self.head = n
        }
        if n != NIL {
            self.links[n as usize].0 = p
        } else {
            self.tail = p
        }
        self.links[id as usize] = (OUT, OUT);
    }
    fn push_front(&mut self, id: EntryId) {
        self.links[id as usize] = (NIL, self.head);
        if self.head != NIL {
            self.links[self.head as usize].0 = id
        } else {
            self.tail = id
        }
        self.head = id;
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
    fn insert(&mut self, id: EntryId) {
        self.grow(id);
        if self.member(id) {
            self.unlink(id);
        }
        self.push_front(id);
    }
    fn touch(&mut self, id: EntryId) {
        if self.touch_moves && self.member(id) {
            self.unlink(id);
            self.push_front(id);
        }
    }
    fn touch_many(&mut self, ids: &[EntryId]) {
        if !self.touch_moves {
            return;
        }
        // Load every entry's links, then its neighbours', before moving any:
        // the loads are independent, so their cache misses overlap.
        for &id in ids {
            std::hint::black_box(self.links.get(id as usize).copied());
        }
        for &id in ids {
            if let Some(&(p, n)) = self.links.get(id as usize) {
                std::hint::black_box((self.links.get(p as usize).copied(), self.links.get(n as usize).copied()));
            }
        }
        for &id in ids {
            self.touch(id)
        }
    }
    fn remove(&mut self, id: EntryId) {
        if self.member(id) {
            self.unlink(id);
        }
    }
    fn next_victim(&self, after: Option<EntryId>) -> Option<EntryId> {
        let v = match after {
            None => self.tail,
            Some(id) => self.links.get(id as usize).map(|l| l.0).unwrap_or(NIL),
        };
        (v != NIL).then_some(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(p: &dyn EvictionPolicy) -> Vec<EntryId> {
        let mut v = vec![];
        let mut c = p.next_victim(None);
        while let Some(id) = c {
            v.push(id);
            c = p.next_victim(Some(id));
        }
        v
    }

    #[test]
    fn lru_orders_by_last_use_and_fifo_by_insert() {
        let mut lru = by_name("LRU").unwrap();
        let mut fifo = by_name("fifo").unwrap();
        for p in [&mut lru, &mut fifo] {
            for id in [3, 1, 7, 2] {
                p.insert(id);
            }
            p.touch(3);
            p.remove(7);
            p.touch(7); // touching a removed id is a no-op
        }
        assert_eq!(order(lru.as_ref()), vec![1, 2, 3]);
        assert_eq!(order(fifo.as_ref()), vec![3, 1, 2]);
        assert!(by_name("random").is_err());
    }
}
