//! A region's renewal at a restart, safe against a crash half-way.
//!
//! A restart gives each owned region a new generation (locations handed out
//! in the previous life are fenced by it) and restamps the records it keeps
//! with it, one by one. A process that dies between the two used to leave
//! committed records a generation behind the region, and the next start
//! discarded them as stale: a crash during a rebuild lost the cache.
//!
//! So the renewal first marks, in the region's entry (word 3), the oldest
//! generation whose records are still this owner's (`kept_from`); the scan
//! keeps records of any generation from there to the one before the new
//! one, and the mark is cleared once they all carry the new one. An
//! interrupted renewal leaves the mark, and the next keeps its range.
//! Every change of owner clears the mark before the owner word changes, so
//! a range never reaches into another owner's life (its records stay
//! stale); a mark further back than `MAX_INTERRUPTED` renewals is not
//! trusted (a damaged entry, not a crash loop).
use std::sync::atomic::Ordering;

use super::{Pool, RegionId};
use crate::error::{Error, Result};
use crate::ids::NodeId;

/// The word of a region's entry that holds the mark (`kept_from + 1`; 0:
/// none, so a renewal from the last generation, `u64::MAX`, goes unmarked).
pub(super) const MARK_WORD: u64 = 3;

/// How far back a mark may reach and still be trusted. A crash loop (a
/// memory limit too low for the registry, a probe too short for the
/// rebuild) renews once per start for as long as it lasts, and every
/// generation since the mark is this owner's (claims and hand-overs clear
/// it), so the bound only guards against a damaged word: a random one
/// lands this close to the current generation with odds of 2^-44.
const MAX_INTERRUPTED: u64 = 1 << 20;

/// What a renewal keeps: records of generations `kept_from..generation`
/// (wrapping), restamped with `generation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renewal {
    pub kept_from: u64,
    pub generation: u64,
}

impl Renewal {
    /// Whether a record of generation `g` is one this renewal keeps.
    pub fn keeps(&self, g: u64) -> bool {
        let span = self.generation.wrapping_sub(self.kept_from);
        g != self.generation && g.wrapping_sub(self.kept_from) < span
    }

    /// Whether a record of generation `g` is the region's owner's object
    /// now: of the current generation, or kept by a renewal a crash left
    /// unfinished (not restamped yet).
    pub fn owns(&self, g: u64) -> bool {
        g == self.generation || self.keeps(g)
    }

    /// A region's life with no renewal left unfinished: it owns its
    /// current generation's records alone.
    pub fn settled(generation: u64) -> Self {
        Renewal { kept_from: generation, generation }
    }
}

impl Pool {
    /// Start a new life for a region this node already owns (after
    /// restart): locations handed out before carry an older generation.
    /// Call `renewed` once every kept record carries the new one.
    pub fn renew_region(&self, r @ RegionId(i): RegionId, node: NodeId) -> Result<Renewal> {
        self.entry(i, 0)?; // bounds
        let _t = self.table();
        self.refresh_entries(i, 1)?;
        if self.state_of(i)?.owner != Some(node) {
            return Err(Error::precondition(format!("region {i} is not owned by node {node}")));
        }
        let current = self.entry(i, 1)?.load(Ordering::Acquire);
        let kept_from = self.mark(r)?.unwrap_or(current);
        // The mark is written back before the generation moves (one entry,
        // one flush would leave their order to the cache).
        self.entry(i, MARK_WORD)?.store(kept_from.wrapping_add(1), Ordering::Release);
        self.flush_entry(i)?;
        // The word is in the shared pool (anyone may have written it): it
        // wraps like the atomic add itself, never overflows.
        let generation = self.entry(i, 1)?.fetch_add(1, Ordering::AcqRel).wrapping_add(1);
        self.flush_entry(i)?;
        Ok(Renewal { kept_from, generation })
    }

    /// Every record `renew_region` kept carries the new generation: the
    /// next renewal keeps only that one.
    pub fn renewed(&self, RegionId(i): RegionId, node: NodeId) -> Result<()> {
        let _t = self.table();
        self.refresh_entries(i, 1)?;
        if self.state_of(i)?.owner == Some(node) {
            self.entry(i, MARK_WORD)?.store(0, Ordering::Release);
            self.flush_entry(i)?;
        }
        Ok(())
    }

    /// The renewal that gave region `r` its current generation, as far as
    /// the pool still tells: what it keeps while a crash left it
    /// unfinished, else nothing (`kept_from` is the current generation).
    /// Its owner's records are those of `generation` and those it keeps.
    pub fn last_renewal(&self, r @ RegionId(i): RegionId) -> Result<Renewal> {
        self.entry(i, 0)?; // bounds
        let _t = self.table();
        self.refresh_entries(i, 1)?;
        let generation = self.entry(i, 1)?.load(Ordering::Acquire);
        let kept_from = self.mark(r)?.unwrap_or(generation);
        Ok(Renewal { kept_from, generation })
    }

    /// Whether a record of generation `of` is region `r`'s owner's object at
    /// `generation`, the region's current one: kept by the renewal a crash
    /// interrupted and not restamped yet.
    pub(super) fn kept_by_renewal(&self, r: RegionId, generation: u64, of: u64) -> Result<bool> {
        let last = self.last_renewal(r)?;
        Ok(last.generation == generation && last.keeps(of))
    }

    /// An interrupted renewal's `kept_from`, if the mark is one to trust.
    /// The caller holds the table.
    fn mark(&self, RegionId(i): RegionId) -> Result<Option<u64>> {
        let current = self.entry(i, 1)?.load(Ordering::Acquire);
        let from = match self.entry(i, MARK_WORD)?.load(Ordering::Acquire) {
            0 => return Ok(None),
            m => m.wrapping_sub(1),
        };
        Ok((current.wrapping_sub(from) <= MAX_INTERRUPTED).then_some(from))
    }

    /// Clear region `i`'s mark before its owner word changes (the caller
    /// holds the table): the next owner's renewals never keep records of
    /// this owner's generations.
    pub(super) fn clear_mark(&self, i: u32) -> Result<()> {
        self.entry(i, MARK_WORD)?.store(0, Ordering::Release);
        self.flush_entry(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_renewal_keeps_the_generations_from_its_mark_to_the_new_one_and_no_others() {
        let r = Renewal { kept_from: 5, generation: 8 };
        assert_eq!((0..12).filter(|&g| r.keeps(g)).collect::<Vec<_>>(), vec![5, 6, 7]);
        let wrapped = Renewal { kept_from: u64::MAX - 1, generation: 1 };
        assert!(wrapped.keeps(u64::MAX - 1) && wrapped.keeps(u64::MAX) && wrapped.keeps(0));
        assert!(!wrapped.keeps(1) && !wrapped.keeps(u64::MAX - 2) && !wrapped.keeps(2));
        let plain = Renewal { kept_from: 3, generation: 4 };
        assert_eq!((0..8).filter(|&g| plain.keeps(g)).collect::<Vec<_>>(), vec![3]);
        assert_eq!((0..12).filter(|&g| r.owns(g)).collect::<Vec<_>>(), vec![5, 6, 7, 8]);
        let settled = Renewal::settled(4);
        assert_eq!((0..8).filter(|&g| settled.owns(g)).collect::<Vec<_>>(), vec![4]);
    }
}
