//! The pool's event stream (seed 003's event plane): every key that becomes
//! visible (a commit) or leaves the registry (delete, eviction, quota,
//! reclaim), and "all cleared" when a source starts, so a router or an
//! indexer can follow what the pool holds without touching the data path.
//!
//! The registry pushes each event into an `EventSink` (`sink.rs`) under its
//! own lock: an append to a buffer bounded in events and bytes, nothing
//! more (when it is full the event is dropped and the next batch's
//! sequence jumps, so subscribers see the gap). One thread (`EventLog::start`)
//! turns the buffer into batches, by count, by bytes and by a short time
//! bound, numbered consecutively from 0 within the source's epoch, into a
//! ring of recent batches bounded in batches and bytes. Transports
//! (`transport.rs`: gRPC's `WatchEvents`, ZMQ in vLLM's format) read the
//! ring at their own pace: one that falls behind the ring's oldest batch
//! skips ahead to it (a jump in sequence, counted), so a stalled subscriber
//! slows no one and holds only what its own bounds allow.
//!
//! A source's epoch is random and its sequences start at 0, as vLLM
//! numbers a publisher's: a restarted node or a new primary starts again
//! from 0 with "all cleared", then every key it holds. A follower relays
//! its primary's batches as they are (`EventLog::relay`, `accept`), so any
//! node's stream is the pool's.
pub mod config;
pub mod hash;
mod peers;
pub mod sink;
pub mod transport;
pub mod vllm;
pub mod watch;
pub mod zmq;
mod zmtp;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch as notify;
use tokio_util::sync::CancellationToken;

pub use sink::EventSink;

/// The batcher's nice value: on a CPU it shares with one busy request
/// thread it gets about a quarter of it (Linux's weights: 335 against 1024),
/// against the ~6% of a CPU it used at the highest rate measured here
/// (110,000 4 KiB stores a second under 1000-byte keys). Nice 10 (a tenth)
/// gained a little more store rate but dropped 0.3–2% of events when other
/// processes kept every CPU busy; nice 5 dropped none there
/// (docs/EVENTS.md, "Memory and CPU").
const BATCHER_NICE: i32 = 5;

/// Every transport a node starts (`transport.rs`): a new one is a file
/// implementing `transport::Transport` and a line here.
pub const TRANSPORTS: &[&dyn transport::Transport] = &[&watch::Grpc, &zmq::Zmq];

use crate::ids::NodeId;
use crate::metric_names as names;

/// Why a key left the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Deleted,
    Evicted,
    /// Evicted to keep its tenant under its quota.
    Quota,
    /// Its whole region went to another node (phase 3).
    Reclaimed,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Deleted => "deleted",
            Reason::Evicted => "evicted",
            Reason::Quota => "quota",
            Reason::Reclaimed => "reclaimed",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Reason::Deleted, Reason::Evicted, Reason::Quota, Reason::Reclaimed].into_iter().find(|r| r.as_str() == s)
    }
}

/// The token ids a chunk covers, as a client handed them with its store,
/// and the block hash of the chunk before it in its sequence (none for a
/// sequence's first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokens {
    pub ids: Box<[u32]>,
    pub parent: Option<hash::BlockHash>,
}

/// One change of what the pool holds. `hash` is the key's block hash,
/// computed once (by the sink, for a source). `announce` says whether it changes
/// the set of block hashes (`sink.rs`): `Some(n)` for the first key of its
/// hash stored (`n` tokens announced) or the last removed (`n` as it was
/// announced with), `None` for a key whose hash another live key carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Stored {
        /// Shared with the registry's entry (no copy per event).
        key: Arc<[u8]>,
        tenant: Arc<str>,
        size: u64,
        node: NodeId,
        commit_seq: u64,
        /// The key's block hash (`hash.rs`), set by the sink.
        hash: hash::BlockHash,
        announce: Option<u32>,
        tokens: Option<Arc<Tokens>>,
    },
    Removed {
        key: Arc<[u8]>,
        tenant: Arc<str>,
        size: u64,
        reason: Reason,
        hash: hash::BlockHash,
        announce: Option<u32>,
    },
    AllCleared,
}

impl Event {
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Event::Stored { tenant, .. } | Event::Removed { tenant, .. } => Some(tenant),
            Event::AllCleared => None,
        }
    }

    pub fn key(&self) -> Option<&[u8]> {
        match self {
            Event::Stored { key, .. } | Event::Removed { key, .. } => Some(key),
            Event::AllCleared => None,
        }
    }

    /// The memory it holds (what the buffer's and the ring's byte bounds
    /// count; the tenant's name is shared with the registry).
    pub fn bytes(&self) -> usize {
        let tokens = match self {
            Event::Stored { tokens: Some(t), .. } => 48 + t.ids.len() * 4,
            _ => 0,
        };
        std::mem::size_of::<Event>() + self.key().map_or(0, <[u8]>::len) + tokens
    }
}

/// A batch of events, as every subscriber gets it.
#[derive(Debug)]
pub struct Batch {
    pub epoch: u64,
    pub seq: u64,
    pub ts_unix_ms: u64,
    pub events: Vec<Event>,
    /// What its events hold (`Event::bytes`).
    pub bytes: usize,
}

impl Batch {
    pub fn new(epoch: u64, seq: u64, ts_unix_ms: u64, events: Vec<Event>) -> Self {
        let bytes = std::mem::size_of::<Self>() + events.iter().map(Event::bytes).sum::<usize>();
        Self { epoch, seq, ts_unix_ms, events, bytes }
    }
}

/// How a source batches and how much it keeps (`[events]`).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Events and bytes per batch at most.
    pub batch_events: usize,
    pub batch_bytes: usize,
    /// The longest an event waits for its batch.
    pub batch_delay: Duration,
    /// Events (and bytes) the registry may have pushed and the batcher not
    /// taken yet.
    pub buffer_events: usize,
    pub buffer_bytes: usize,
    /// Batches (and bytes) kept for replay.
    pub ring_batches: usize,
    pub ring_bytes: usize,
    /// Token ids held from reservations to their commits, in bytes.
    pub staged_bytes: usize,
    /// Block hashes counted per model (topics name models).
    pub per_model: bool,
}

impl Limits {
    fn sink(&self) -> sink::SinkLimits {
        sink::SinkLimits {
            events: self.buffer_events.max(1),
            bytes: self.buffer_bytes.max(1),
            batch: self.batch_events.max(1),
            staged_bytes: self.staged_bytes,
            per_model: self.per_model,
        }
    }
}

/// The ring of recent batches and the bytes they hold.
#[derive(Default)]
struct Ring {
    batches: VecDeque<Arc<Batch>>,
    bytes: usize,
}

/// A source's batches: the ring subscribers read, and the sink that fills it.
pub struct EventLog {
    /// The source's epoch (a relay's changes with its source).
    epoch: AtomicU64,
    sink: Arc<EventSink>,
    limits: Limits,
    ring: Mutex<Ring>,
    /// The next batch's sequence; subscribers wait on it.
    next: notify::Sender<u64>,
    subscribers: AtomicUsize,
    /// Cancelled when the source stops: every subscription ends.
    closed: CancellationToken,
}

impl EventLog {
    /// A new source: a random epoch, and "all cleared" as its first event
    /// (what it held before, if anything, is unknown to its subscribers).
    /// That event is its first batch (sequence 0) at once, in the ring
    /// before the node serves: a subscriber's replay from 0 always begins
    /// with it, however the first batching and the publishers' start are
    /// scheduled.
    pub fn new(limits: Limits) -> Arc<Self> {
        let epoch = rand::random::<u64>() >> 1 | 1;
        let log = Self::with(limits, epoch, vec![Event::AllCleared]);
        log.cut();
        log
    }

    /// A follower's copy of its primary's log: no events of its own, the
    /// batches its primary's stream brings (`accept`).
    pub fn relay(limits: Limits) -> Arc<Self> {
        Self::with(limits, 0, vec![])
    }

    fn with(limits: Limits, epoch: u64, events: Vec<Event>) -> Arc<Self> {
        for n in [names::EVENTS_PUBLISHED, names::EVENT_BATCHES] {
            metrics::counter!(n).increment(0);
        }
        for reason in ["overflow", "lagging", "tokens", "evicted_peer"] {
            metrics::counter!(names::EVENTS_DROPPED, "reason" => reason).increment(0);
        }
        for transport in ["grpc", "zmq", "relay"] {
            metrics::gauge!(names::EVENT_SUBSCRIBERS, "transport" => transport).increment(0.0);
        }
        metrics::gauge!(names::EVENTS_OLDEST_SEQ).set(0.0);
        Arc::new(Self {
            epoch: AtomicU64::new(epoch),
            sink: Arc::new(EventSink::new(limits.sink(), events)),
            limits,
            ring: Mutex::new(Ring::default()),
            next: notify::channel(0).0,
            subscribers: AtomicUsize::new(0),
            closed: CancellationToken::new(),
        })
    }

    pub fn sink(&self) -> Arc<EventSink> {
        self.sink.clone()
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Start the batcher: batch what the sink holds until `shutdown`, then
    /// end every subscription. It is an OS thread of its own, below the
    /// request path's priority (`BATCHER_NICE`): a batch's hash-set work and
    /// bookkeeping take a CPU for a while, which on a tokio worker would
    /// hold up requests queued behind it, and with CPUs to share it yields
    /// to stores (when it falls far behind, the buffer's bound drops events,
    /// counted, and the sequence shows the gap).
    pub fn start(self: &Arc<Self>, shutdown: CancellationToken) {
        let (sink, stop) = (self.sink.clone(), shutdown.clone());
        tokio::spawn(async move {
            stop.cancelled().await;
            sink.wake.notify();
        });
        let log = self.clone();
        let batcher = move || {
            if let Err(e) = crate::platform::lower_thread_priority(BATCHER_NICE) {
                tracing::debug!(error = %e, "the event batcher runs at the request path's priority");
            }
            loop {
                log.sink.wake.wait(log.limits.batch_delay);
                // Also once nothing else holds the log (a node dropped
                // without its shutdown, as tests do).
                if shutdown.is_cancelled() || Arc::strong_count(&log) == 1 {
                    return log.close();
                }
                log.cut();
            }
        };
        std::thread::Builder::new().name("cxlkv-events".into()).spawn(batcher).expect("start the event batcher");
    }

    /// Turn what the sink holds into batches (also called by tests).
    pub fn cut(&self) {
        let events = self.sink.take();
        let dropped = self.sink.dropped.swap(0, Ordering::Relaxed);
        if events.is_empty() && dropped == 0 {
            return;
        }
        let mut seq = *self.next.borrow();
        if dropped > 0 {
            // The events lost would have been (at least) one batch: the
            // sequence skips one, so every subscriber sees the gap.
            seq += 1;
            metrics::counter!(names::EVENTS_DROPPED, "reason" => "overflow").increment(dropped);
        }
        let ts = crate::platform::now_unix_ms();
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let mut rest = events.into_iter().peekable();
        while rest.peek().is_some() {
            let events = self.next_batch(&mut rest);
            metrics::counter!(names::EVENTS_PUBLISHED).increment(events.len() as u64);
            metrics::counter!(names::EVENT_BATCHES).increment(1);
            self.push(&mut ring, Batch::new(self.epoch(), seq, ts, events));
            seq += 1;
        }
        self.published(ring, seq);
    }

    /// The next batch's events: up to `batch_events`, and up to
    /// `batch_bytes` (at least one).
    fn next_batch(&self, rest: &mut std::iter::Peekable<impl Iterator<Item = Event>>) -> Vec<Event> {
        let (mut events, mut bytes) = (vec![], 0);
        while let Some(e) = rest.peek() {
            let size = e.bytes();
            if !events.is_empty()
                && (events.len() >= self.limits.batch_events || bytes + size > self.limits.batch_bytes)
            {
                break;
            }
            bytes += size;
            events.extend(rest.next());
        }
        events
    }

    /// A relay: add its source's batch (as the source numbered it). A batch
    /// of another epoch starts the log again: its source changed.
    pub fn accept(&self, epoch: u64, seq: u64, ts_unix_ms: u64, events: Vec<Event>) {
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        if epoch != self.epoch() {
            *ring = Ring::default();
            self.epoch.store(epoch, Ordering::Release);
        } else if ring.batches.back().is_some_and(|b| b.seq >= seq) {
            return; // already held (a relay's stream resumed)
        }
        metrics::counter!(names::EVENTS_PUBLISHED).increment(events.len() as u64);
        metrics::counter!(names::EVENT_BATCHES).increment(1);
        self.push(&mut ring, Batch::new(epoch, seq, ts_unix_ms, events));
        self.published(ring, seq + 1);
    }

    /// Add a batch to the ring, dropping the oldest past its bounds.
    fn push(&self, ring: &mut Ring, b: Batch) {
        ring.bytes += b.bytes;
        ring.batches.push_back(Arc::new(b));
        while ring.batches.len() > 1
            && (ring.batches.len() > self.limits.ring_batches.max(1) || ring.bytes > self.limits.ring_bytes)
        {
            let old = ring.batches.pop_front().expect("more than one");
            ring.bytes -= old.bytes;
        }
    }

    /// Tell subscribers: batches up to `next` are there to read.
    fn published(&self, ring: std::sync::MutexGuard<'_, Ring>, next: u64) {
        let oldest = ring.batches.front().map_or(next, |b| b.seq);
        drop(ring);
        metrics::gauge!(names::EVENTS_OLDEST_SEQ).set(oldest as f64);
        self.next.send_replace(next);
    }

    /// The source stopped: subscriptions end.
    pub fn close(&self) {
        self.closed.cancel();
    }

    /// The source's epoch (0: a relay that has had no batch yet).
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// The batches held from `since` on, at most `max_bytes` of them (at
    /// least one), and the oldest sequence held (a `since` below it was
    /// dropped).
    pub fn read(&self, since: u64, max_bytes: usize) -> (Vec<Arc<Batch>>, u64) {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let oldest = ring.batches.front().map_or(*self.next.borrow(), |b| b.seq);
        let skip = ring.batches.iter().take_while(|b| b.seq < since).count();
        let (mut out, mut bytes) = (vec![], 0);
        for b in ring.batches.iter().skip(skip) {
            if !out.is_empty() && bytes + b.bytes > max_bytes {
                break;
            }
            bytes += b.bytes;
            out.push(b.clone());
        }
        (out, oldest)
    }

    /// The sequence the next batch will have.
    pub fn next_seq(&self) -> u64 {
        *self.next.borrow()
    }

    /// The oldest sequence held for replay.
    pub fn oldest_seq(&self) -> u64 {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        ring.batches.front().map_or(*self.next.borrow(), |b| b.seq)
    }

    /// The ring's batches and bytes.
    pub fn held(&self) -> (usize, usize) {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        (ring.batches.len(), ring.bytes)
    }

    pub fn subscribers(&self) -> usize {
        self.subscribers.load(Ordering::Relaxed)
    }

    /// A reader of this log from `since` (a subscriber; 0: from the oldest
    /// batch held).
    pub fn subscribe(self: &Arc<Self>, since: u64, transport: &'static str) -> Subscription {
        self.subscribers.fetch_add(1, Ordering::Relaxed);
        metrics::gauge!(names::EVENT_SUBSCRIBERS, "transport" => transport).increment(1.0);
        Subscription { log: self.clone(), epoch: self.epoch(), next: since, rx: self.next.subscribe(), transport }
    }
}

/// A node's event stream as its servers offer it.
#[derive(Clone)]
pub struct Feed {
    pub log: Arc<EventLog>,
    /// A follower's copy of its primary's stream.
    pub relay: bool,
    /// The ZMQ endpoints it is published on, if any.
    pub zmq: Option<zmq::Endpoints>,
    /// The gRPC streams and their bounds.
    pub grpc: Arc<watch::Streams>,
}

/// One subscriber's place in a log.
pub struct Subscription {
    log: Arc<EventLog>,
    /// The epoch `next` belongs to.
    epoch: u64,
    next: u64,
    rx: notify::Receiver<u64>,
    transport: &'static str,
}

impl Subscription {
    /// The next batches (waiting for one if there is none yet), at most
    /// `max_bytes` of them (at least one). A subscriber that fell behind
    /// the ring skips to its oldest batch: the batch's sequence shows the
    /// jump, and the batches skipped are counted. None once the source
    /// stopped (`close`).
    pub async fn next(&mut self, max_bytes: usize) -> Option<Vec<Arc<Batch>>> {
        loop {
            if self.log.closed.is_cancelled() {
                return None;
            }
            let epoch = self.log.epoch();
            if epoch != self.epoch {
                // A relay whose source changed: the new source's from its first.
                (self.epoch, self.next) = (epoch, 0);
            }
            let (batches, oldest) = self.log.read(self.next, max_bytes);
            if let Some(last) = batches.last() {
                if self.next < oldest && self.next != 0 {
                    let lost = oldest - self.next;
                    metrics::counter!(names::EVENTS_DROPPED, "reason" => "lagging").increment(lost);
                }
                self.next = last.seq + 1;
                return Some(batches);
            }
            tokio::select! {
                r = self.rx.changed() => r.ok()?,
                _ = self.log.closed.cancelled() => return None,
            }
        }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.log.subscribers.fetch_sub(1, Ordering::Relaxed);
        metrics::gauge!(names::EVENT_SUBSCRIBERS, "transport" => self.transport).decrement(1.0);
    }
}

#[cfg(test)]
mod tests;
