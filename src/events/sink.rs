//! Where the registry pushes its events, under its own lock: an append to
//! a buffer bounded in events and bytes, never waited on. Two things are
//! kept here because they must see every change in the registry's order,
//! whether the event itself fits the buffer or not:
//!
//! - the set of block hashes (`Sets`): how many live keys carry each hash
//!   (per model when topics name models), so a hash is announced once, with
//!   the first key that carries it, and removed with the last;
//! - token ids a client handed with a store (`Staged`), held from its
//!   reservation to its commit, bounded in bytes, attached to the commit's
//!   event (at the push: a later reservation of the key stages its own).
//!
//! The set is kept by the batcher (`take`), in the buffer's order, off the
//! registry's lock: a key's block hash (two CRCs of a long key) and a miss
//! in the set cost as much as the rest of a 4 KiB store's bookkeeping. An
//! event the buffer has no room for is accounted at once, after what is
//! buffered before it (and after what a batcher took, which holds the set
//! until it has accounted it): the order is the registry's either way.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::hash::{self, BlockHash};
use super::{Event, Tokens};
use crate::metric_names as names;

/// Bytes a staged entry or a set entry costs besides its contents (the
/// table's own slot and the allocation's header, rounded up).
const ENTRY_OVERHEAD: usize = 64;
const SET_ENTRY_BYTES: usize = 40;

/// The sink's bounds (`[events]`).
#[derive(Debug, Clone, Copy)]
pub struct SinkLimits {
    pub events: usize,
    pub bytes: usize,
    /// Events per batch (wake the batcher at this many).
    pub batch: usize,
    /// Bytes of staged token ids at most.
    pub staged_bytes: usize,
    /// Count block hashes per model (topics name the model).
    pub per_model: bool,
}

pub struct EventSink {
    state: Mutex<State>,
    /// Locked before `state` when both are.
    sets: Mutex<Sets>,
    limits: SinkLimits,
    /// Events dropped because the buffer was full, since the last batch.
    pub(super) dropped: AtomicU64,
    pub(super) wake: Wake,
}

/// Wakes the batcher (an OS thread of its own, `EventLog::start`): a flag
/// and a condition variable.
#[derive(Default)]
pub(super) struct Wake {
    pending: Mutex<bool>,
    cv: Condvar,
}

impl Wake {
    pub(super) fn notify(&self) {
        *self.pending.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.cv.notify_one();
    }

    /// Until notified (a notification before the call counts) or `timeout`.
    pub(super) fn wait(&self, timeout: Duration) {
        let g = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let (mut g, _) = self.cv.wait_timeout_while(g, timeout, |pending| !*pending).unwrap_or_else(|p| p.into_inner());
        *g = false;
    }
}

#[derive(Default)]
struct State {
    buf: Vec<Event>,
    bytes: usize,
    /// The buffer's first events already accounted in the set (an
    /// overflow accounts what is buffered before the event it drops).
    accounted: usize,
    staged: hashbrown::HashMap<Box<[u8]>, (Arc<Tokens>, Instant)>,
    staged_bytes: usize,
}

/// How many live keys carry each block hash (per model).
struct Sets {
    map: hashbrown::HashMap<(u64, BlockHash), SetEntry>,
    per_model: bool,
}

/// Live keys carrying one block hash, and the tokens it was announced with.
#[derive(Clone, Copy)]
struct SetEntry {
    keys: u32,
    tokens: u32,
}

impl EventSink {
    pub(super) fn new(limits: SinkLimits, first: Vec<Event>) -> Self {
        let bytes = first.iter().map(Event::bytes).sum();
        Self {
            state: Mutex::new(State { buf: first, bytes, ..Default::default() }),
            sets: Mutex::new(Sets { map: Default::default(), per_model: limits.per_model }),
            limits,
            dropped: AtomicU64::new(0),
            wake: Wake::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn sets(&self) -> std::sync::MutexGuard<'_, Sets> {
        self.sets.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Append one event (called under the registry's lock: no wait, unless
    /// the buffer is full). The hash set and the staged tokens follow it
    /// even when the buffer is full and the event is dropped (counted; the
    /// sequence shows it).
    pub fn push(&self, mut e: Event) {
        let mut s = self.lock();
        attach_tokens(&mut s, &mut e);
        if !self.fits(&s, &e) {
            drop(s);
            return self.overflow(e);
        }
        let full = self.append(&mut s, e);
        drop(s);
        if full {
            self.wake.notify();
        }
    }

    fn fits(&self, s: &State, e: &Event) -> bool {
        s.buf.len() < self.limits.events && s.bytes + e.bytes() <= self.limits.bytes
    }

    /// Buffer `e`; whether the buffer holds a batch's worth now.
    fn append(&self, s: &mut State, e: Event) -> bool {
        s.bytes += e.bytes();
        s.buf.push(e);
        s.buf.len() >= self.limits.batch
    }

    /// An event the buffer has no room for: dropped, but accounted in the
    /// set after every event pushed before it.
    #[cold]
    fn overflow(&self, mut e: Event) {
        let mut sets = self.sets();
        let mut s = self.lock();
        if self.fits(&s, &e) {
            // A batcher took the buffer meanwhile.
            self.append(&mut s, e);
            return;
        }
        let from = s.accounted;
        s.buf[from..].iter_mut().for_each(|b| sets.account(b));
        s.accounted = s.buf.len();
        sets.account(&mut e);
        drop(s);
        self.dropped.fetch_add(1, Ordering::Relaxed);
    }

    /// Hold `tokens` for `key`'s commit until `until` (its reservation's
    /// deadline). Over the bound the oldest lapsed entries go first; what
    /// still does not fit is dropped, counted: the commit then announces
    /// no tokens.
    pub fn stage(&self, key: &[u8], tokens: Arc<Tokens>, until: Instant) {
        let size = staged_size(key, &tokens);
        let mut s = self.lock();
        if let Some((old, _)) = s.staged.remove(key) {
            s.staged_bytes -= staged_size(key, &old);
        }
        if s.staged_bytes + size > self.limits.staged_bytes {
            let now = Instant::now();
            let mut freed = 0;
            s.staged.retain(|k, (t, until)| {
                let keep = *until > now;
                if !keep {
                    freed += staged_size(k, t);
                }
                keep
            });
            s.staged_bytes -= freed;
        }
        if s.staged_bytes + size > self.limits.staged_bytes {
            drop(s);
            metrics::counter!(names::EVENTS_DROPPED, "reason" => "tokens").increment(1);
            return;
        }
        s.staged_bytes += size;
        s.staged.insert(key.into(), (tokens, until));
    }

    /// Take what the buffer holds. The next buffer starts with room for a
    /// batch: growing it event by event under the registry's lock cost a
    /// reallocation (and often a trip to the system's allocator) per
    /// doubling.
    pub(super) fn take(&self) -> Vec<Event> {
        let mut sets = self.sets();
        let (mut events, accounted) = {
            let mut s = self.lock();
            if s.buf.is_empty() {
                return vec![];
            }
            s.bytes = 0;
            let room = s.buf.len().min(self.limits.batch);
            (std::mem::replace(&mut s.buf, Vec::with_capacity(room)), std::mem::take(&mut s.accounted))
        };
        events[accounted..].iter_mut().for_each(|e| sets.account(e));
        events
    }

    /// Bytes the sink holds besides its buffer: the hash set and the staged
    /// tokens (`cxlkv status`, tests).
    pub fn held_bytes(&self) -> (usize, usize) {
        let sets = self.sets().map.capacity() * SET_ENTRY_BYTES;
        (sets, self.lock().staged_bytes)
    }
}

/// A commit's staged tokens, onto its event.
fn attach_tokens(s: &mut State, e: &mut Event) {
    let Event::Stored { key, tokens, .. } = e else { return };
    if s.staged.is_empty() {
        return;
    }
    if let Some((t, _)) = s.staged.remove(&key[..]) {
        s.staged_bytes -= staged_size(key, &t);
        *tokens = Some(t);
    }
}

impl Sets {
    /// The set's change an event makes: its hash, and whether it announces
    /// it (the first key of a hash, with its tokens) or removes it (the last).
    fn account(&mut self, e: &mut Event) {
        match e {
            Event::Stored { key, hash, announce, tokens, .. } => {
                let n = tokens.as_ref().map_or(0, |t| t.ids.len() as u32);
                let k = self.key(key);
                *hash = k.1;
                let entry = self.map.entry(k).or_insert(SetEntry { keys: 0, tokens: n });
                entry.keys += 1;
                if entry.keys == 1 {
                    *announce = Some(n);
                } else {
                    // Only the first key of a hash announces it (and its tokens).
                    (*announce, *tokens) = (None, None);
                }
            }
            Event::Removed { key, hash, announce, .. } => {
                let k = self.key(key);
                *hash = k.1;
                *announce = match self.map.get_mut(&k) {
                    Some(entry) if entry.keys > 1 => {
                        entry.keys -= 1;
                        None
                    }
                    Some(_) => self.map.remove(&k).map(|entry| entry.tokens),
                    None => None,
                };
            }
            Event::AllCleared => self.map.clear(),
        }
    }

    fn key(&self, key: &[u8]) -> (u64, BlockHash) {
        let (h, model) = hash::describe(key);
        (if self.per_model { hash::fnv1a(model) } else { 0 }, h)
    }
}

fn staged_size(key: &[u8], t: &Tokens) -> usize {
    ENTRY_OVERHEAD + key.len() + t.ids.len() * 4
}
