//! Page allocator for one region: TLSF (two-level segregated fit) over page
//! counts. An object takes a contiguous run of whole pages, so a short last
//! chunk wastes less than one page; alloc and free are O(1) (bitmap scans over
//! fixed-width words), and free coalesces with both neighbours.
use crate::error::{Error, Result};

const SLI: u32 = 3;
const SL: usize = 1 << SLI;
const FL: usize = 31;
const NIL: u32 = u32::MAX;
/// How many entries of the exact size class are tried when the rounded-up
/// search finds nothing (keeps exact fits usable, still bounded).
const EXACT_CLASS_PROBE: usize = 16;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    Inner,
    Used,
    Free,
}

#[derive(Debug, Clone)]
pub struct PageAllocator {
    pages: u32,
    free_pages: u32,
    /// Valid at a block's first page.
    head_len: Vec<u32>,
    state: Vec<State>,
    /// Valid at a block's last page: index of its first page.
    tail_head: Vec<u32>,
    /// Free-list links, valid at free block heads.
    links: Vec<(u32, u32)>,
    fl_bitmap: u32,
    sl_bitmap: [u32; FL],
    heads: [[u32; SL]; FL],
}

/// Size class of a block of `n` pages (u64: a rounded-up request may exceed u32).
fn mapping(n: u64) -> (usize, usize) {
    if n < SL as u64 {
        (0, n as usize)
    } else {
        let l = n.ilog2();
        ((l - SLI + 1) as usize, ((n >> (l - SLI)) as usize) - SL)
    }
}

impl PageAllocator {
    pub fn new(pages: u32) -> Self {
        assert!(pages > 0 && pages < u32::MAX, "page count out of range");
        let mut a = Self {
            pages,
            free_pages: 0,
            head_len: vec![0; pages as usize],
            state: vec![State::Inner; pages as usize],
            tail_head: vec![0; pages as usize],
            links: vec![(NIL, NIL); pages as usize],
            fl_bitmap: 0,
            sl_bitmap: [0; FL],
            heads: [[NIL; SL]; FL],
        };
        a.reset();
        a
    }

    /// An allocator whose pages in `used` (first page, count) are taken, as
    /// found in the pool's records after a restart. Overlapping or
    /// out-of-range runs are refused.
    pub fn with_used(pages: u32, used: &[(u32, u32)]) -> Result<Self> {
        let mut a = Self::new(pages);
        a.state.fill(State::Inner);
        a.fl_bitmap = 0;
        a.sl_bitmap = [0; FL];
        a.heads = [[NIL; SL]; FL];
        a.free_pages = 0;
        let mut runs = used.to_vec();
        runs.sort_unstable();
        let mut next = 0u32;
        for &(first, n) in &runs {
            if n == 0 || first < next || first as u64 + n as u64 > pages as u64 {
                return Err(Error::invalid(format!("used pages {first}+{n} overlap or lie outside the region")));
            }
            if first > next {
                a.make_free(next, first - next);
            }
            a.set_block(first, n, State::Used);
            next = first + n;
        }
        if next < pages {
            a.make_free(next, pages - next);
        }
        Ok(a)
    }

    /// Pages of the allocated block that starts at `first`, if there is one.
    pub fn block_len(&self, first: u32) -> Option<u32> {
        (self.state.get(first as usize) == Some(&State::Used)).then(|| self.head_len[first as usize])
    }

    /// Forget every allocation.
    pub fn reset(&mut self) {
        self.state.fill(State::Inner);
        self.fl_bitmap = 0;
        self.sl_bitmap = [0; FL];
        self.heads = [[NIL; SL]; FL];
        self.free_pages = 0;
        self.make_free(0, self.pages);
    }

    pub fn free_pages(&self) -> u32 {
        self.free_pages
    }

    fn insert(&mut self, p: u32) {
        let (f, s) = mapping(self.head_len[p as usize] as u64);
        let old = self.heads[f][s];
        self.links[p as usize] = (NIL, old);
        if old != NIL {
            self.links[old as usize].0 = p;
        }
        self.heads[f][s] = p;
        self.sl_bitmap[f] |= 1 << s;
        self.fl_bitmap |= 1 << f;
    }

    fn remove(&mut self, p: u32) {
        let (f, s) = mapping(self.head_len[p as usize] as u64);
        let (prev, next) = self.links[p as usize];
        if prev != NIL {
            self.links[prev as usize].1 = next;
        } else {
            self.heads[f][s] = next;
        }
        if next != NIL {
            self.links[next as usize].0 = prev;
        }
        if self.heads[f][s] == NIL {
            self.sl_bitmap[f] &= !(1 << s);
            if self.sl_bitmap[f] == 0 {
                self.fl_bitmap &= !(1 << f);
            }
        }
    }

    fn set_block(&mut self, p: u32, n: u32, st: State) {
        self.head_len[p as usize] = n;
        self.state[p as usize] = st;
        self.tail_head[(p + n - 1) as usize] = p;
    }

    fn make_free(&mut self, p: u32, n: u32) {
        self.set_block(p, n, State::Free);
        self.free_pages += n;
        self.insert(p);
    }

    /// First non-empty list at or above class (f, s).
    fn find_from(&self, f: usize, s: usize) -> Option<u32> {
        if f >= FL {
            return None;
        }
        let sl = self.sl_bitmap[f] & (!0u32).checked_shl(s as u32).unwrap_or(0);
        let (f, sl) = if sl != 0 {
            (f, sl)
        } else {
            let fl = self.fl_bitmap & (!0u32).checked_shl(f as u32 + 1).unwrap_or(0);
            if fl == 0 {
                return None;
            }
            let f = fl.trailing_zeros() as usize;
            (f, self.sl_bitmap[f])
        };
        Some(self.heads[f][sl.trailing_zeros() as usize])
    }

    /// Allocate `n` contiguous pages; returns the first page index.
    pub fn alloc(&mut self, n: u32) -> Option<u32> {
        if n == 0 || n > self.free_pages {
            return None;
        }
        // Round up to the next class boundary so any block found fits.
        let rounded = if n < SL as u32 { n as u64 } else { n as u64 + (1u64 << (n.ilog2() - SLI)) - 1 };
        let (f, s) = mapping(rounded);
        let p = self.find_from(f, s).or_else(|| {
            let (f, s) = mapping(n as u64);
            let mut p = self.heads[f][s];
            for _ in 0..EXACT_CLASS_PROBE {
                if p == NIL || self.head_len[p as usize] >= n {
                    break;
                }
                p = self.links[p as usize].1;
            }
            (p != NIL && self.head_len[p as usize] >= n).then_some(p)
        })?;
        let len = self.head_len[p as usize];
        self.remove(p);
        self.free_pages -= len;
        self.set_block(p, n, State::Used);
        if len > n {
            self.make_free(p + n, len - n);
        }
        Some(p)
    }

    /// Free the block of `n` pages starting at `first` (as returned by alloc).
    pub fn free(&mut self, first: u32, n: u32) -> Result<()> {
        if first >= self.pages || self.state[first as usize] != State::Used || self.head_len[first as usize] != n {
            return Err(Error::invalid(format!("free of pages {first}+{n}: not an allocated block")));
        }
        self.state[first as usize] = State::Inner;
        let (mut p, mut n) = (first, n);
        let next = p + n;
        if next < self.pages && self.state[next as usize] == State::Free {
            let m = self.head_len[next as usize];
            self.remove(next);
            self.free_pages -= m;
            self.state[next as usize] = State::Inner;
            n += m;
        }
        if p > 0 {
            let h = self.tail_head[(p - 1) as usize];
            if self.state[h as usize] == State::Free {
                let m = self.head_len[h as usize];
                self.remove(h);
                self.free_pages -= m;
                p = h;
                n += m;
            }
        }
        self.make_free(p, n);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn mapping_classes_are_monotonic() {
        let mut last = (0, 0);
        for n in 1..100_000u64 {
            let m = mapping(n);
            assert!(m >= last, "class of {n} went down");
            last = m;
        }
    }

    #[test]
    fn an_allocator_rebuilt_from_used_runs_frees_and_coalesces_them() {
        let mut a = PageAllocator::with_used(32, &[(4, 3), (0, 2), (20, 12)]).unwrap();
        assert_eq!(a.free_pages(), 32 - 17);
        assert_eq!((a.block_len(4), a.block_len(5), a.block_len(2)), (Some(3), None, None));
        assert_eq!(a.alloc(9), Some(7), "the gap 7..20 serves a 9-page object");
        for (f, n) in [(4, 3), (0, 2), (20, 12), (7, 9)] {
            a.free(f, n).unwrap();
        }
        assert_eq!(a.alloc(32), Some(0));
        assert!(PageAllocator::with_used(32, &[(0, 4), (3, 2)]).is_err(), "overlap");
        assert!(PageAllocator::with_used(32, &[(30, 3)]).is_err(), "past the end");
    }

    #[test]
    fn exact_fit_is_found_and_everything_coalesces() {
        let mut a = PageAllocator::new(17);
        let x = a.alloc(17).unwrap();
        assert_eq!(a.alloc(1), None);
        a.free(x, 17).unwrap();
        let blocks: Vec<u32> = (0..17).map(|_| a.alloc(1).unwrap()).collect();
        assert_eq!(a.free_pages(), 0);
        for b in blocks.iter().rev().step_by(2).chain(blocks.iter().rev().skip(1).step_by(2)) {
            a.free(*b, 1).unwrap();
        }
        assert_eq!(a.alloc(17), Some(0), "free neighbours must coalesce into one block");
    }

    #[test]
    fn a_request_near_the_region_size_fits_an_empty_region() {
        for pages in 1..600u32 {
            for n in (pages.saturating_sub(9)).max(1)..=pages {
                let mut a = PageAllocator::new(pages);
                assert_eq!(a.alloc(n), Some(0), "alloc({n}) on an empty region of {pages} pages");
            }
        }
    }

    #[test]
    fn double_and_bogus_frees_are_rejected() {
        let mut a = PageAllocator::new(64);
        let x = a.alloc(4).unwrap();
        assert!(a.free(x, 3).is_err(), "wrong length");
        assert!(a.free(x + 1, 3).is_err(), "not a head");
        a.free(x, 4).unwrap();
        assert!(a.free(x, 4).is_err(), "double free");
        assert!(a.free(1000, 1).is_err(), "out of range");
        assert_eq!(a.free_pages(), 64);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u32),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![(1u32..40).prop_map(Op::Alloc), (0usize..64).prop_map(Op::Free)]
    }

    proptest! {
        /// No page is ever handed out twice; free + used = total after every op;
        /// once everything is freed the whole region is one block again.
        #[test]
        fn never_double_allocates(pages in 1u32..300, ops in proptest::collection::vec(op(), 1..200)) {
            let mut a = PageAllocator::new(pages);
            let mut owner = vec![false; pages as usize];
            let mut live: Vec<(u32, u32)> = vec![];
            for o in ops {
                match o {
                    Op::Alloc(n) => {
                        if let Some(p) = a.alloc(n) {
                            prop_assert!(p + n <= pages);
                            for q in p..p + n {
                                prop_assert!(!owner[q as usize], "page {} handed out twice", q);
                                owner[q as usize] = true;
                            }
                            live.push((p, n));
                        } else {
                            // Free runs in the model; with few of them the bounded
                            // exact-class probe sees all, so a fit must be found.
                            let mut runs = vec![];
                            let mut run = 0u32;
                            for &used in &owner {
                                if used { if run > 0 { runs.push(run); } run = 0; } else { run += 1; }
                            }
                            if run > 0 { runs.push(run); }
                            let fits = runs.iter().any(|&r| r >= n);
                            prop_assert!(!fits || runs.len() > EXACT_CLASS_PROBE, "alloc({}) failed with free runs {:?}", n, runs);
                        }
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let (p, n) = live.swap_remove(i % live.len());
                        a.free(p, n).unwrap();
                        for q in p..p + n { owner[q as usize] = false; }
                    }
                    Op::Free(_) => {}
                }
                let used: u32 = live.iter().map(|b| b.1).sum();
                prop_assert_eq!(a.free_pages() + used, pages);
            }
            for (p, n) in live.drain(..) { a.free(p, n).unwrap(); }
            prop_assert_eq!(a.alloc(pages), Some(0));
        }
    }
}
