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
//!
//! The link words are plain `u32`s because a link names either an entry or a
//! sentinel; the API speaks in `EntryId` and converts at this boundary.
use super::EntryId;

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

/// The victim a policy handed out last, and whether its ghost is to
/// remember it once it is removed.
#[derive(Default)]
pub struct Popped(Option<(EntryId, bool)>);

impl Popped {
    /// `v` is the victim handed out; `remember` it once it is removed.
    pub fn set(&mut self, v: EntryId, remember: bool) {
        self.0 = Some((v, remember));
    }

    /// `id` left: whether it is the victim handed out last and to be
    /// remembered (the victim is forgotten then, whichever entry it was).
    pub fn remembers(&mut self, id: EntryId) -> bool {
        matches!(self.0.take(), Some((v, true)) if v == id)
    }

    /// Take `id` out (`Lists::take_out`): None if it was out already, else
    /// `remembers(id)`.
    pub fn take_out(&mut self, lists: &mut Lists, id: EntryId) -> Option<bool> {
        lists.take_out(id).then(|| self.remembers(id))
    }
}

/// The per-id arrays a policy keeps beside its links (`Lists::admit`
/// grows them with the links): a `&mut Vec`, a pair of them, or `()`.
pub trait Side {
    fn fit(self, len: usize);
}

impl<T: Clone + Default> Side for &mut Vec<T> {
    fn fit(self, len: usize) {
        if self.len() < len {
            self.resize(len, T::default());
        }
    }
}

impl Side for () {
    fn fit(self, _len: usize) {}
}

impl<A: Side, B: Side> Side for (A, B) {
    fn fit(self, len: usize) {
        self.0.fit(len);
        self.1.fit(len);
    }
}

impl Lists {
    pub fn new_list(&mut self) -> List {
        let s = SENTINEL | self.sentinels.len() as u32;
        self.sentinels.push([s, s]);
        s
    }

    /// Make room for `id` (ids are dense: growth writes one element at a
    /// time, amortised, never a power-of-two span of untouched memory).
    pub fn grow(&mut self, id: EntryId) {
        assert!(id.0 < SENTINEL, "entry id {id} out of range");
        if id.index() >= self.links.len() {
            self.links.resize(id.index() + 1, [OUT, OUT]);
        }
    }

    /// Where every policy's `insert` starts: make room for `id`, in the
    /// links and in the policy's per-id `side` arrays (new slots take their
    /// type's default), and tell whether the policy still knows `id` (any
    /// state but out), in which case the insert removes it first: the new
    /// entry replaces it.
    pub fn admit(&mut self, id: EntryId, side: impl Side) -> bool {
        self.grow(id);
        side.fit(self.links.len());
        self.mark(id) != Some(OUT)
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
    pub fn mark(&self, id: EntryId) -> Option<u32> {
        match self.links.get(id.index()) {
            None => Some(OUT),
            Some(&[p, _]) if p >= POPPED => Some(p),
            Some(_) => None,
        }
    }

    pub fn linked(&self, id: EntryId) -> bool {
        self.mark(id).is_none()
    }

    /// Set the mark of an id that is in no list.
    pub fn set_mark(&mut self, id: EntryId, mark: u32) {
        debug_assert!(self.mark(id).is_some(), "set_mark on a linked id");
        self.links[id.index()] = [mark, mark];
    }

    fn link_between(&mut self, id: EntryId, prev: u32, next: u32) {
        debug_assert!(self.mark(id).is_some(), "id {id} linked twice");
        self.links[id.index()] = [prev, next];
        self.at(prev)[1] = id.0;
        self.at(next)[0] = id.0;
    }

    /// Add `id` at the front (newest end) of `list`.
    pub fn push_front(&mut self, list: List, id: EntryId) {
        let next = self.get(list)[1];
        self.link_between(id, list, next);
    }

    /// Add `id` at the back (the end victims are taken from).
    pub fn push_back(&mut self, list: List, id: EntryId) {
        let prev = self.get(list)[0];
        self.link_between(id, prev, list);
    }

    /// Add `id` right behind the linked `anchor` (towards the back), so it
    /// leaves before `anchor`.
    pub fn push_behind(&mut self, anchor: EntryId, id: EntryId) {
        let next = self.links[anchor.index()][1];
        self.link_between(id, anchor.0, next);
    }

    /// Take `id` out of its list and give it `mark`.
    pub fn unlink(&mut self, id: EntryId, mark: u32) {
        let [p, n] = self.links[id.index()];
        debug_assert!(p < POPPED, "unlink of an unlinked id");
        self.at(p)[1] = n;
        self.at(n)[0] = p;
        self.links[id.index()] = [mark, mark];
    }

    /// The policy's `hold` for entries kept only in lists: a candidate
    /// leaves its list (state held), a popped entry becomes held in place;
    /// held and out entries stay as they are.
    pub fn hold(&mut self, id: EntryId) {
        if self.holding(id) {
            self.unlink(id, HELD);
        }
    }

    /// A `hold` for policies that keep more than the lists: a popped
    /// entry becomes held here; true when `id` is a candidate, which the
    /// policy takes out of its queue itself (marking it `HELD`).
    pub fn holding(&mut self, id: EntryId) -> bool {
        match self.mark(id) {
            None => return true,
            Some(POPPED) => self.set_mark(id, HELD),
            _ => {}
        }
        false
    }

    /// The start of a policy's `release`: a held entry becomes out of
    /// every list, for the policy to place it again; false (and nothing
    /// changes) unless it was held.
    pub fn release(&mut self, id: EntryId) -> bool {
        let held = self.mark(id) == Some(HELD);
        if held {
            self.set_mark(id, OUT);
        }
        held
    }

    /// Whether a `touch` applies to `id` (a candidate or a held entry),
    /// and if so whether it is linked (a candidate) or held.
    pub fn touchable(&self, id: EntryId) -> Option<bool> {
        match self.mark(id) {
            None => Some(true),
            Some(HELD) => Some(false),
            _ => None,
        }
    }

    /// The policy's `remove` for entries kept only in lists: whatever its
    /// state, the entry ends out. Returns whether it was in (not out).
    pub fn take_out(&mut self, id: EntryId) -> bool {
        let Some(linked) = self.leaving(id) else { return false };
        if linked {
            self.unlink(id, OUT);
        }
        true
    }

    /// A `remove` for policies that keep more than the lists: None when
    /// `id` is out already; else a held or popped entry is out here and
    /// `Some(true)` says it is a candidate, which the policy takes out of
    /// its queue itself (marking it `OUT`).
    pub fn leaving(&mut self, id: EntryId) -> Option<bool> {
        match self.mark(id) {
            Some(OUT) => None,
            None => Some(true),
            Some(_) => {
                self.set_mark(id, OUT);
                Some(false)
            }
        }
    }

    /// A bucketed policy's victim: the back of `partials` if it has one
    /// (not to be remembered), else the back of the first non-empty bucket of
    /// `ring` from `*cursor` on (to be remembered), `*cursor` moved by `step`
    /// past the empty ones, at most one turn of the ring. The victim is
    /// marked popped and kept in `popped`.
    #[inline]
    pub fn pop_bucketed(
        &mut self,
        partials: List,
        ring: &[List],
        cursor: &mut u16,
        step: impl Fn(u16) -> u16,
        popped: &mut Popped,
    ) -> Option<EntryId> {
        let (v, remember) = if let Some(v) = self.back(partials) {
            (v, false)
        } else {
            let mut found = None;
            for _ in 0..ring.len() {
                if let Some(v) = self.back(ring[*cursor as usize % ring.len()]) {
                    found = Some(v);
                    break;
                }
                *cursor = step(*cursor);
            }
            (found?, true)
        };
        self.unlink(v, POPPED);
        popped.set(v, remember);
        Some(v)
    }

    pub fn back(&self, list: List) -> Option<EntryId> {
        let b = self.get(list)[0];
        (b != list).then_some(EntryId(b))
    }

    /// The neighbour of a linked `id` towards the front, or `None` at the front.
    pub fn toward_front(&self, id: EntryId) -> Option<EntryId> {
        let p = self.links[id.index()][0];
        (p & SENTINEL == 0).then_some(EntryId(p))
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

    pub fn prefetch(&self, id: EntryId) {
        if let Some(l) = self.links.get(id.index()) {
            crate::platform::prefetch(l);
        }
    }

    /// Load both neighbours of `id` (what unlinking it writes).
    pub fn prefetch_neighbours(&self, id: EntryId) {
        if let Some(&[p, n]) = self.links.get(id.index()) {
            for x in [p, n] {
                if let Some(l) = self.links.get(x as usize) {
                    crate::platform::prefetch(l);
                }
            }
        }
    }
}
