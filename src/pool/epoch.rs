//! The election epoch in the pool (cluster mode with an elected primary):
//! one word in the superblock's unused tail, just before the node table.
//! A primary writes its epoch when it takes over and checks the word
//! before every later write of pool-wide metadata (region table, node
//! table): a deposed primary that wakes up finds a later epoch and is
//! refused. A zeroed word is epoch 0 (static election, old pools).
//! Beside it: the commit sequences' high-water mark, and the view-lock mark
//! (until when locks of durable sessions may still protect views: a sidecar
//! that restarts, or a new primary, removes nothing committed before then).
use std::sync::atomic::Ordering;

use super::Pool;
use crate::error::{Error, ErrorKind, Result};

const EPOCH_AT: u64 = 1016;
/// The commit sequences' high-water mark (a cluster's primary): no
/// sequence at or above it was handed out. Just before the epoch word.
const SEQ_MARK_AT: u64 = 1008;
/// The view-lock mark (unix ms; 0 in a pool that has none). Before the
/// sequence mark.
const LOCK_MARK_AT: u64 = 1000;

impl Pool {
    /// The epoch of the last primary that took over.
    pub fn epoch(&self) -> Result<u64> {
        self.word(EPOCH_AT)
    }

    /// Take over as the primary of `epoch`; refused if a later one did.
    pub fn take_epoch(&self, epoch: u64) -> Result<()> {
        let cur = self.epoch()?;
        if cur > epoch {
            return Err(stale(cur, epoch));
        }
        self.meta.write(EPOCH_AT, &epoch.to_le_bytes())?;
        self.meta.flush(EPOCH_AT, 8)?;
        self.own_epoch.store(epoch, Ordering::Release);
        Ok(())
    }

    /// The commit sequences' high-water mark (0 in a pool that has none).
    pub fn seq_mark(&self) -> Result<u64> {
        self.word(SEQ_MARK_AT)
    }

    /// Raise the high-water mark to `limit` before handing out sequences
    /// below it (a primary of a later epoch refuses this one's write).
    pub fn set_seq_mark(&self, limit: u64) -> Result<()> {
        self.raise_word(SEQ_MARK_AT, limit)
    }

    /// Until when (unix ms) locks of durable sessions granted on this pool
    /// may last (0: none was ever recorded).
    pub fn lock_mark(&self) -> Result<u64> {
        self.word(LOCK_MARK_AT)
    }

    /// Raise the view-lock mark to `unix_ms` (never lowers it) before a
    /// lock that lasts until then is granted (a primary of a later epoch
    /// refuses this one's write).
    pub fn set_lock_mark(&self, unix_ms: u64) -> Result<()> {
        self.raise_word(LOCK_MARK_AT, unix_ms)
    }

    fn word(&self, at: u64) -> Result<u64> {
        let mut b = [0u8; 8];
        self.meta.invalidate(at, 8)?;
        self.meta.read(at, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// Write `value` at `at` unless the word already holds as much.
    fn raise_word(&self, at: u64, value: u64) -> Result<()> {
        self.check_epoch()?;
        if self.word(at)? >= value {
            return Ok(());
        }
        self.meta.write(at, &value.to_le_bytes())?;
        self.meta.flush(at, 8)
    }

    /// Before writing pool-wide metadata: is this process still the latest
    /// primary it took over as? (No-op unless `take_epoch` was called.)
    pub(crate) fn check_epoch(&self) -> Result<()> {
        let own = self.own_epoch.load(Ordering::Acquire);
        if own == 0 {
            return Ok(());
        }
        match self.epoch()? {
            cur if cur > own => Err(stale(cur, own)),
            _ => Ok(()),
        }
    }
}

fn stale(cur: u64, own: u64) -> Error {
    Error::new(
        ErrorKind::FailedPrecondition,
        format!("a newer primary (epoch {cur}) has taken over the pool; this one (epoch {own}) stands down"),
    )
}
