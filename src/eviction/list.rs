//! Intrusive circular doubly linked lists over entry ids, with one sentinel
//! per list. Every policy's queues are lists of this kind: a node's queues
//! are sentinels, an entry's links live in one per-id array shared by all
//! nodes, and unlinking needs no list handle (so moving an entry never looks
//! up its node). 8 B per entry id.
//!
//! An id that is in no list carries a state mark in its `prev` word instead
//! of a link: `OUT` (not a candidate), `HELD` (in use) or `POPPED` (returned
//! as a victim, removal pending). The marks sit above every valid link, so
//! the state costs no memory of its own.

/// Sentinel ids have this bit set; entry ids must stay below it.
const SENTINEL: u32 = 1 << 31;
/// Not a candidate (never inserted, or removed).
pub const OUT: u32 = u32::MAX;
/// In use: out of every queue until `release`.
pub const HELD: u32 = u32::MAX - 1;
/// Handed out by `pop_victim`; the registry removes it next.
pub const POPPED: u32 = u32::MAX - 2;

/// A list handle (its sentinel's id).
pub type List = u32;

#[derive(Default)]
pub struct Lists {
    /// `[prev, next]` per entry id; `prev` holds a state mark when unlinked.
    links: Vec<[u32; 2]>,
    /// `[prev, next]` per sentinel: `next` is the front (newest), `prev` the
    /// back (the end victims are taken from).
    sentinels: Vec<[u32; 2]>,
}

impl Lists {
    pub fn new_list(&mut self) -> List {
        let s = SENTINEL | self.sentinels.len() as u32;
        self.sentinels.push([s, s]);
        s
    }

    /// Make room for `id` (ids are dense: growth writes one element at a
    /// time, amortised, never a power-of-two span of untouched memory).
    pub fn grow(&mut self, id: u32) {
        assert!(id < SENTINEL, "entry id {id} out of range");
        if id as usize >= self.links.len() {
            self.links.resize(id as usize + 1, [OUT, OUT]);
        }
    }

    /// Entry ids the array covers (for per-id side arrays of the same length).
    pub fn len(&self) -> usize {
        self.links.len()
    }

    fn at(&mut self, x: u32) -> &mut [u32; 2] {
        if x & SENTINEL != 0 {
            &mut self.sentinels[(x & !SENTINEL) as usize]
        } else {
            &mut self.links[x as usize]
        }
    }

    fn get(&self, x: u32) -> [u32; 2] {
        if x & SENTINEL != 0 {
            self.sentinels[(x & !SENTINEL) as usize]
        } else {
            self.links[x as usize]
        }
    }

    /// The state mark of an unlinked id, or `None` while it is in a list.
    pub fn mark(&self, id: u32) -> Option<u32> {
        match self.links.get(id as usize) {
            None => Some(OUT),
            Some(&[p, _]) if p >= POPPED => Some(p),
            Some(_) => None,
        }
    }

    pub fn linked(&self, id: u32) -> bool {
        self.mark(id).is_none()
    }

    /// Set the mark of an id that is in no list.
    pub fn set_mark(&mut self, id: u32, mark: u32) {
        debug_assert!(self.mark(id).is_some(), "set_mark on a linked id");
        self.links[id as usize] = [mark, mark];
    }

    fn link_between(&mut self, id: u32, prev: u32, next: u32) {
        debug_assert!(self.mark(id).is_some(), "id {id} linked twice");
        self.links[id as usize] = [prev, next];
        self.at(prev)[1] = id;
        self.at(next)[0] = id;
    }

    /// Add `id` at the front (newest end) of `list`.
    pub fn push_front(&mut self, list: List, id: u32) {
        let next = self.get(list)[1];
        self.link_between(id, list, next);
    }

    /// Add `id` at the back (the end victims are taken from).
    pub fn push_back(&mut self, list: List, id: u32) {
        let prev = self.get(list)[0];
        self.link_between(id, prev, list);
    }

    /// Take `id` out of its list and give it `mark`.
    pub fn unlink(&mut self, id: u32, mark: u32) {
        let [p, n] = self.links[id as usize];
        debug_assert!(p < POPPED, "unlink of an unlinked id");
        self.at(p)[1] = n;
        self.at(n)[0] = p;
        self.links[id as usize] = [mark, mark];
    }

    pub fn back(&self, list: List) -> Option<u32> {
        let b = self.get(list)[0];
        (b != list).then_some(b)
    }

    /// The neighbour of a linked `id` towards the front, or `None` at the front.
    pub fn toward_front(&self, id: u32) -> Option<u32> {
        let p = self.links[id as usize][0];
        (p & SENTINEL == 0).then_some(p)
    }

    pub fn is_empty(&self, list: List) -> bool {
        self.get(list)[1] == list
    }

    /// Move every entry of `src` behind the back of `dst` (in order), O(1).
    pub fn append_back(&mut self, dst: List, src: List) {
        if self.is_empty(src) {
            return;
        }
        let [src_back, src_front] = self.get(src);
        let dst_back = self.get(dst)[0];
        self.at(dst_back)[1] = src_front;
        self.at(src_front)[0] = dst_back;
        self.at(src_back)[1] = dst;
        self.at(dst)[0] = src_back;
        *self.at(src) = [src, src];
    }

    pub fn prefetch(&self, id: u32) {
        if let Some(l) = self.links.get(id as usize) {
            crate::platform::prefetch(l);
        }
    }

    /// Load both neighbours of `id` (what unlinking it writes).
    pub fn prefetch_neighbours(&self, id: u32) {
        if let Some(&[p, n]) = self.links.get(id as usize) {
            for x in [p, n] {
                if let Some(l) = self.links.get(x as usize) {
                    crate::platform::prefetch(l);
                }
            }
        }
    }
}
