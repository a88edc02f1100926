//! The pool's event stream (seed 003's event plane): every key that becomes
//! visible (a commit) or leaves the registry (delete, eviction, quota,
//! reclaim), and "all cleared" when a source starts, so a router or an
//! indexer can follow what the pool holds without touching the data path.
//!
//! The registry pushes each event into an `EventSink` under its own lock:
//! an append to a bounded buffer, nothing more (when the buffer is full the
//! event is dropped and the next batch's sequence jumps, so subscribers see
//! the gap). One task (`EventLog::run`) turns the buffer into batches, by
//! count and by a short time bound, numbered consecutively within the
//! source's epoch, into a bounded ring of recent batches. Subscribers (the
//! gRPC `WatchEvents` stream, the ZMQ publisher of `zmq.rs`) read the ring
//! at their own pace: one that falls behind the ring's oldest batch skips
//! ahead to it (a jump in sequence, counted), so a stalled subscriber holds
//! no memory and slows no one.
//!
//! A source's sequences start at its start time in milliseconds times 2^10
//! (`first_seq`), so a later source (a restarted node, a new primary)
//! numbers after an earlier one: a subscriber that only knows sequences
//! (vLLM's) sees a forward jump, asks for the batches it missed, and gets
//! the new source's from its first — "all cleared", then every key the
//! source holds. A follower relays its primary's batches as they are
//! (`EventLog::relay`, `accept`), so any node's stream is the pool's.
pub mod config;
pub mod watch;
pub mod zmq;
mod zmtp;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch as notify;
use tokio_util::sync::CancellationToken;

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

/// One change of what the pool holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Stored { key: Box<[u8]>, tenant: Arc<str>, size: u64, node: NodeId, commit_seq: u64 },
    Removed { key: Box<[u8]>, tenant: Arc<str>, size: u64, reason: Reason },
    AllCleared,
}

impl Event {
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Event::Stored { tenant, .. } | Event::Removed { tenant, .. } => Some(tenant),
            Event::AllCleared => None,
        }
    }
}

/// A batch of events, as every subscriber gets it.
#[derive(Debug)]
pub struct Batch {
    pub epoch: u64,
    pub seq: u64,
    pub ts_unix_ms: u64,
    pub events: Vec<Event>,
    /// The batch in vLLM's wire format, encoded once for every ZMQ
    /// subscriber and replay (`zmq::encode`).
    vllm: std::sync::OnceLock<bytes::Bytes>,
}

/// How a source batches and how much it keeps (`[events]`).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Events per batch at most.
    pub batch_events: usize,
    /// The longest an event waits for its batch.
    pub batch_delay: Duration,
    /// Events the registry may have pushed and the batcher not taken yet.
    pub buffer_events: usize,
    /// Batches kept for replay.
    pub ring_batches: usize,
}

/// Where the registry pushes its events: a bounded buffer behind one short
/// lock, never waited on.
pub struct EventSink {
    buf: Mutex<Vec<Event>>,
    cap: usize,
    batch: usize,
    /// Events dropped because the buffer was full, since the last batch.
    dropped: AtomicU64,
    wake: tokio::sync::Notify,
}

impl EventSink {
    /// Append one event (called under the registry's lock: O(1), no wait).
    pub fn push(&self, e: Event) {
        let mut b = self.buf.lock().unwrap_or_else(|p| p.into_inner());
        if b.len() >= self.cap {
            drop(b);
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        b.push(e);
        let full = b.len() >= self.batch;
        drop(b);
        if full {
            self.wake.notify_one();
        }
    }

    /// Append one event whatever the buffer holds (a rebuild's keys, once
    /// per source).
    pub fn push_always(&self, e: Event) {
        self.buf.lock().unwrap_or_else(|p| p.into_inner()).push(e);
        self.wake.notify_one();
    }
}

/// A source's batches: the ring subscribers read, and the sink that fills it.
pub struct EventLog {
    /// The source's epoch (a relay's changes with its source).
    epoch: AtomicU64,
    sink: Arc<EventSink>,
    limits: Limits,
    ring: Mutex<VecDeque<Arc<Batch>>>,
    /// The next batch's sequence; subscribers wait on it.
    next: notify::Sender<u64>,
    subscribers: AtomicUsize,
    /// Cancelled when the source stops: every subscription ends.
    closed: CancellationToken,
}

impl EventLog {
    /// A new source: a random epoch, and "all cleared" as its first event
    /// (what it held before, if anything, is unknown to its subscribers).
    /// That event is its first batch at once, in the ring before the node
    /// serves: a subscriber's replay from 0 always begins with it, however
    /// the first batching and the publishers' start are scheduled.
    pub fn new(limits: Limits) -> Arc<Self> {
        let epoch = rand::random::<u64>() >> 1 | 1;
        let log = Self::with(limits, epoch, first_seq(crate::platform::now_unix_ms()), vec![Event::AllCleared]);
        log.cut();
        log
    }

    /// A follower's copy of its primary's log: no events of its own, the
    /// batches its primary's stream brings (`accept`).
    pub fn relay(limits: Limits) -> Arc<Self> {
        Self::with(limits, 0, 0, vec![])
    }

    fn with(limits: Limits, epoch: u64, first: u64, events: Vec<Event>) -> Arc<Self> {
        let sink = Arc::new(EventSink {
            buf: Mutex::new(events),
            cap: limits.buffer_events.max(1),
            batch: limits.batch_events.max(1),
            dropped: AtomicU64::new(0),
            wake: tokio::sync::Notify::new(),
        });
        for n in [names::EVENTS_PUBLISHED, names::EVENT_BATCHES] {
            metrics::counter!(n).increment(0);
        }
        for reason in ["overflow", "lagging"] {
            metrics::counter!(names::EVENTS_DROPPED, "reason" => reason).increment(0);
        }
        for transport in ["grpc", "zmq", "relay"] {
            metrics::gauge!(names::EVENT_SUBSCRIBERS, "transport" => transport).increment(0.0);
        }
        metrics::gauge!(names::EVENTS_OLDEST_SEQ).set(first as f64);
        Arc::new(Self {
            epoch: AtomicU64::new(epoch),
            sink,
            limits,
            ring: Mutex::new(VecDeque::new()),
            next: notify::channel(first).0,
            subscribers: AtomicUsize::new(0),
            closed: CancellationToken::new(),
        })
    }

    pub fn sink(&self) -> Arc<EventSink> {
        self.sink.clone()
    }

    /// Batch what the sink holds until `shutdown`, then end every
    /// subscription.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return self.close(),
                _ = self.sink.wake.notified() => {}
                _ = tokio::time::sleep(self.limits.batch_delay) => {}
            }
            self.cut();
        }
    }

    /// Turn what the sink holds into batches (also called by tests).
    pub fn cut(&self) {
        let events = std::mem::take(&mut *self.sink.buf.lock().unwrap_or_else(|p| p.into_inner()));
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
            let events: Vec<Event> = rest.by_ref().take(self.limits.batch_events.max(1)).collect();
            metrics::counter!(names::EVENTS_PUBLISHED).increment(events.len() as u64);
            metrics::counter!(names::EVENT_BATCHES).increment(1);
            let vllm = std::sync::OnceLock::new();
            ring.push_back(Arc::new(Batch { epoch: self.epoch(), seq, ts_unix_ms: ts, events, vllm }));
            seq += 1;
            self.trim(&mut ring);
        }
        self.published(ring, seq);
    }

    /// A relay: add its source's batch (as the source numbered it). A batch
    /// of another epoch starts the log again: its source changed.
    pub fn accept(&self, epoch: u64, seq: u64, ts_unix_ms: u64, events: Vec<Event>) {
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        if epoch != self.epoch() {
            ring.clear();
            self.epoch.store(epoch, Ordering::Release);
        } else if ring.back().is_some_and(|b| b.seq >= seq) {
            return; // already held (a relay's stream resumed)
        }
        metrics::counter!(names::EVENTS_PUBLISHED).increment(events.len() as u64);
        metrics::counter!(names::EVENT_BATCHES).increment(1);
        let vllm = std::sync::OnceLock::new();
        ring.push_back(Arc::new(Batch { epoch, seq, ts_unix_ms, events, vllm }));
        self.trim(&mut ring);
        self.published(ring, seq + 1);
    }

    fn trim(&self, ring: &mut VecDeque<Arc<Batch>>) {
        while ring.len() > self.limits.ring_batches.max(1) {
            ring.pop_front();
        }
    }

    /// Tell subscribers: batches up to `next` are there to read.
    fn published(&self, ring: std::sync::MutexGuard<'_, VecDeque<Arc<Batch>>>, next: u64) {
        let oldest = ring.front().map_or(next, |b| b.seq);
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

    /// The batches held from `since` on (at most `max`), and the oldest
    /// sequence held (a `since` below it was dropped).
    pub fn read(&self, since: u64, max: usize) -> (Vec<Arc<Batch>>, u64) {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let oldest = ring.front().map_or(*self.next.borrow(), |b| b.seq);
        let skip = ring.iter().take_while(|b| b.seq < since).count();
        (ring.iter().skip(skip).take(max).cloned().collect(), oldest)
    }

    /// The sequence the next batch will have.
    pub fn next_seq(&self) -> u64 {
        *self.next.borrow()
    }

    /// The oldest sequence held for replay.
    pub fn oldest_seq(&self) -> u64 {
        self.read(0, 0).1
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

/// The first sequence of a source started at `unix_ms` (see the module's
/// doc): later than any an earlier source can have reached unless it
/// published over 1024 batches a millisecond on average, or the clocks
/// disagree. Below 2^53 until the year 2248, so a Prometheus sample (a
/// float64) holds a sequence exactly.
pub fn first_seq(unix_ms: u64) -> u64 {
    unix_ms << 10
}

/// A node's event stream as its servers offer it.
#[derive(Clone)]
pub struct Feed {
    pub log: Arc<EventLog>,
    /// A follower's copy of its primary's stream.
    pub relay: bool,
    /// The ZMQ endpoints it is published on, if any.
    pub zmq: Option<zmq::Endpoints>,
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
    /// The next batches (waiting for one if there is none yet), up to `max`.
    /// A subscriber that fell behind the ring skips to its oldest batch:
    /// the batch's sequence shows the jump, and the batches skipped are
    /// counted. None once the source stopped (`close`).
    pub async fn next(&mut self, max: usize) -> Option<Vec<Arc<Batch>>> {
        loop {
            if self.log.closed.is_cancelled() {
                return None;
            }
            let epoch = self.log.epoch();
            if epoch != self.epoch {
                // A relay whose source changed: the new source's from its first.
                (self.epoch, self.next) = (epoch, 0);
            }
            let (batches, oldest) = self.log.read(self.next, max);
            if let Some(last) = batches.last() {
                if self.next != 0 && self.next < oldest {
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
