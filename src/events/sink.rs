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
//!   event.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

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
    limits: SinkLimits,
    /// Events dropped because the buffer was full, since the last batch.
    pub(super) dropped: AtomicU64,
    pub(super) wake: tokio::sync::Notify,
}

#[derive(Default)]
struct State {
    buf: Vec<Event>,
    bytes: usize,
    sets: hashbrown::HashMap<(u64, BlockHash), SetEntry>,
    staged: hashbrown::HashMap<Box<[u8]>, (Arc<Tokens>, Instant)>,
    staged_bytes: usize,
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
            limits,
            dropped: AtomicU64::new(0),
            wake: tokio::sync::Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Append one event (called under the registry's lock: no wait). The
    /// hash set and the staged tokens follow it even when the buffer is
    /// full and the event is dropped (counted; the sequence shows it).
    pub fn push(&self, mut e: Event) {
        let mut s = self.lock();
        self.account(&mut s, &mut e);
        let size = e.bytes();
        if s.buf.len() >= self.limits.events || s.bytes + size > self.limits.bytes {
            drop(s);
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        s.buf.push(e);
        s.bytes += size;
        let full = s.buf.len() >= self.limits.batch;
        drop(s);
        if full {
            self.wake.notify_one();
        }
    }

    /// The set's change an event makes, and its staged tokens.
    fn account(&self, s: &mut State, e: &mut Event) {
        match e {
            Event::Stored { key, hash, announce, tokens, .. } => {
                let staged = if s.staged.is_empty() { None } else { s.staged.remove(&key[..]).map(|(t, _)| t) };
                if let Some(t) = &staged {
                    s.staged_bytes -= staged_size(key, t);
                }
                let n = staged.as_ref().map_or(0, |t| t.ids.len() as u32);
                let k = self.set_key(key);
                *hash = k.1;
                let entry = s.sets.entry(k).or_insert(SetEntry { keys: 0, tokens: n });
                entry.keys += 1;
                // Only the first key of a hash announces it (and its tokens).
                (*announce, *tokens) = if entry.keys == 1 { (Some(n), staged) } else { (None, None) };
            }
            Event::Removed { key, hash, announce, .. } => {
                let k = self.set_key(key);
                *hash = k.1;
                *announce = match s.sets.get_mut(&k) {
                    Some(entry) if entry.keys > 1 => {
                        entry.keys -= 1;
                        None
                    }
                    Some(_) => s.sets.remove(&k).map(|entry| entry.tokens),
                    None => None,
                };
            }
            Event::AllCleared => s.sets.clear(),
        }
    }

    fn set_key(&self, key: &[u8]) -> (u64, BlockHash) {
        let (h, model) = hash::describe(key);
        (if self.limits.per_model { hash::fnv1a(model) } else { 0 }, h)
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

    /// Take what the buffer holds.
    pub(super) fn take(&self) -> Vec<Event> {
        let mut s = self.lock();
        s.bytes = 0;
        std::mem::take(&mut s.buf)
    }

    /// Bytes the sink holds besides its buffer: the hash set and the staged
    /// tokens (`cxlkv status`, tests).
    pub fn held_bytes(&self) -> (usize, usize) {
        let s = self.lock();
        (s.sets.capacity() * SET_ENTRY_BYTES, s.staged_bytes)
    }
}

fn staged_size(key: &[u8], t: &Tokens) -> usize {
    ENTRY_OVERHEAD + key.len() + t.ids.len() * 4
}
