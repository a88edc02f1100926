//! The gRPC transport: the stream as `WatchEvents` messages on the client
//! API (and on the peer port, where followers relay it): where a
//! subscriber may start, and the stream itself — a task per subscriber
//! that reads the log's ring at the subscriber's pace and ends with the
//! source.
//!
//! What a stream holds is bounded in bytes: the batch its task has read
//! and the message made of it (at most `batch_bytes`, twice that as a
//! message), the messages queued for tonic (at most `stream_bytes`, one
//! message past it when a single batch is larger), the one tonic encodes,
//! and what HTTP/2 buffers for a stream whose reader does not read
//! (`config::H2_STREAM_BYTES`, hyper's send buffer). Streams are counted per
//! sidecar (`max_streams`) and per connection
//! (`max_streams_per_connection`; HTTP/2's own `max_concurrent_streams`,
//! `[server] http2_max_concurrent_streams`, bounds every call): one more is
//! RESOURCE_EXHAUSTED.
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use prost::Message;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tonic::Status;

use super::hash::BlockHash;
use super::{Batch, Event, EventLog, Reason, Tokens};
use crate::error::{Error, ErrorKind, Result};
use crate::ids::NodeId;
use crate::proto::{self, event::Kind};

/// The gRPC streams of a node: how many, and what each may queue.
pub struct Streams {
    all: Arc<Semaphore>,
    per_connection: usize,
    bytes: usize,
}

impl Streams {
    pub fn new(max: usize, per_connection: usize, bytes: usize) -> Arc<Self> {
        Arc::new(Self { all: Arc::new(Semaphore::new(max)), per_connection, bytes: bytes.max(1) })
    }

    /// Without bounds on count (the peer port: one stream per follower).
    pub fn unbounded(bytes: usize) -> Arc<Self> {
        Self::new(Semaphore::MAX_PERMITS, usize::MAX, bytes)
    }

    /// A place for one more stream of a connection (its count of open
    /// streams), or RESOURCE_EXHAUSTED.
    pub fn slot(&self, conn: Option<Arc<AtomicUsize>>) -> Result<Slot> {
        let busy = |what: String| Error::new(ErrorKind::ResourceExhausted, what);
        let permit = self.all.clone().try_acquire_owned().map_err(|_| {
            busy("too many WatchEvents streams open on this sidecar (events.max_streams); retry".into())
        })?;
        if let Some(c) = &conn {
            if c.fetch_add(1, Ordering::Relaxed) >= self.per_connection {
                c.fetch_sub(1, Ordering::Relaxed);
                return Err(busy(format!(
                    "this connection has {} WatchEvents streams open (events.max_streams_per_connection)",
                    self.per_connection
                )));
            }
        }
        Ok(Slot { _permit: permit, conn })
    }
}

/// A stream's place; given back when the stream ends.
pub struct Slot {
    _permit: OwnedSemaphorePermit,
    conn: Option<Arc<AtomicUsize>>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(c) = &self.conn {
            c.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

type Item = (std::result::Result<proto::EventBatch, Status>, Option<OwnedSemaphorePermit>);

/// A subscriber's stream: each message gives its queued bytes back as
/// tonic takes it.
pub struct EventStream {
    rx: mpsc::Receiver<Item>,
    _slot: Slot,
}

impl tokio_stream::Stream for EventStream {
    type Item = std::result::Result<proto::EventBatch, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx).map(|m| m.map(|(m, _bytes)| m))
    }
}

/// Where a subscriber asking for (`epoch`, `since`) starts: 0 for 0 (the
/// oldest batch held); `since` itself where it is held or next; else
/// OUT_OF_RANGE saying how to resynchronise.
pub fn start(log: &EventLog, epoch: u64, since: u64) -> Result<u64> {
    let current = log.epoch();
    if current == 0 {
        return Err(Error::new(ErrorKind::Unavailable, "this follower has no events from its primary yet; retry"));
    }
    let (oldest, next) = (log.oldest_seq(), log.next_seq());
    let resync = |why: String| {
        Error::new(
            ErrorKind::OutOfRange,
            format!(
                "{why}; this source's epoch is {current}, batches {oldest}..{next} are held: resynchronise — watch \
                 from epoch {current} since 0 (or {next}), then page ListKeys and apply the events after it"
            ),
        )
    };
    if epoch != 0 && epoch != current {
        return Err(resync(format!("epoch {epoch} is over")));
    }
    match since {
        0 => Ok(0),
        s if s < oldest => Err(resync(format!("batch {s} is no longer held"))),
        s if s > next => Err(resync(format!("batch {s} was never published by this source"))),
        s => Ok(s),
    }
}

/// The stream of `log` from `since` (see `start`) in `slot`, each batch's
/// events kept where `keep` says (a tenant's scope; the batch itself is
/// always sent, so sequences stay consecutive). It ends when the source
/// does.
pub fn stream(
    log: &Arc<EventLog>,
    streams: &Streams,
    slot: Slot,
    since: u64,
    keep: impl Fn(&Event) -> bool + Send + 'static,
    transport: &'static str,
) -> EventStream {
    let (tx, rx) = mpsc::channel(1024);
    let mut sub = log.subscribe(since, transport);
    let (bytes, cap) = (Arc::new(Semaphore::new(streams.bytes)), streams.bytes);
    tokio::spawn(async move {
        loop {
            let batches = tokio::select! {
                _ = tx.closed() => return,
                b = sub.next(1) => b, // one batch at a time
            };
            let Some(batches) = batches else {
                let end = Status::unavailable("the event source stopped (this node's term ended): resubscribe");
                let _ = tx.send((Err(end), None)).await;
                return;
            };
            for b in batches {
                let m = to_proto(&b, &keep);
                // What a queued message holds: about twice its encoding
                // (the decoded message's strings and buffers).
                let want = (2 * m.encoded_len()).clamp(1, cap) as u32;
                let permit = tokio::select! {
                    _ = tx.closed() => return,
                    p = bytes.clone().acquire_many_owned(want) => p.expect("never closed"),
                };
                if tx.send((Ok(m), Some(permit))).await.is_err() {
                    return;
                }
            }
        }
    });
    EventStream { rx, _slot: slot }
}

pub fn to_proto(b: &Batch, keep: &impl Fn(&Event) -> bool) -> proto::EventBatch {
    let events = b.events.iter().filter(|e| keep(e)).map(event_to_proto).collect();
    proto::EventBatch { epoch: b.epoch, seq: b.seq, ts_unix_ms: b.ts_unix_ms, events }
}

fn event_to_proto(e: &Event) -> proto::Event {
    let block =
        |h: &BlockHash, announce: &Option<u32>| (h.bits(), h.is_negative(), announce.is_some(), announce.unwrap_or(0));
    match e {
        Event::Stored { key, tenant, size, node, commit_seq, hash, announce, tokens } => {
            let (bits, neg, announce, n) = block(hash, announce);
            let (token_ids, parent) = tokens.as_ref().map_or((vec![], None), |t| (t.ids.to_vec(), t.parent));
            proto::Event {
                kind: Kind::Stored as i32,
                key: bytes::Bytes::copy_from_slice(key),
                tenant: tenant.to_string(),
                size: *size,
                node: node.0,
                commit_seq: *commit_seq,
                block_hash: bits,
                block_hash_negative: neg,
                announce,
                announced_tokens: n,
                token_ids,
                parent_block_hash: parent.map(BlockHash::bits),
                parent_negative: parent.is_some_and(BlockHash::is_negative),
                ..Default::default()
            }
        }
        Event::Removed { key, tenant, size, reason, hash, announce } => {
            let (bits, neg, announce, n) = block(hash, announce);
            proto::Event {
                kind: Kind::Removed as i32,
                key: bytes::Bytes::copy_from_slice(key),
                tenant: tenant.to_string(),
                size: *size,
                reason: reason.as_str().into(),
                block_hash: bits,
                block_hash_negative: neg,
                announce,
                announced_tokens: n,
                ..Default::default()
            }
        }
        Event::AllCleared => proto::Event { kind: Kind::AllCleared as i32, ..Default::default() },
    }
}

/// A relayed event back (a follower's copy of its primary's stream); an
/// event this build does not know is an error (the relay resubscribes).
pub fn event_from_proto(e: proto::Event) -> Result<Event> {
    let bad = |what: &str| Error::invalid(format!("relayed event: {what}"));
    let announce = e.announce.then_some(e.announced_tokens);
    let hash = BlockHash::from_bits(e.block_hash, e.block_hash_negative);
    Ok(match Kind::try_from(e.kind).map_err(|_| bad("unknown kind"))? {
        Kind::Stored => {
            let parent = e.parent_block_hash.map(|p| BlockHash::from_bits(p, e.parent_negative));
            let tokens =
                (!e.token_ids.is_empty()).then(|| Arc::new(Tokens { ids: e.token_ids.into_boxed_slice(), parent }));
            Event::Stored {
                key: e.key.to_vec().into(),
                tenant: e.tenant.into(),
                size: e.size,
                node: NodeId(e.node),
                commit_seq: e.commit_seq,
                hash,
                announce,
                tokens,
            }
        }
        Kind::Removed => Event::Removed {
            key: e.key.to_vec().into(),
            tenant: e.tenant.into(),
            size: e.size,
            reason: Reason::parse(&e.reason).ok_or_else(|| bad("unknown reason"))?,
            hash,
            announce,
        },
        Kind::AllCleared => Event::AllCleared,
    })
}

/// The gRPC transport (`transport.rs`): `WatchEvents` is served by the
/// client API's service; nothing to start.
pub struct Grpc;

#[tonic::async_trait]
impl super::transport::Transport for Grpc {
    fn name(&self) -> &'static str {
        "grpc"
    }

    async fn start(
        &self,
        _: Arc<EventLog>,
        _: &super::config::EventsConfig,
        _: tokio_util::sync::CancellationToken,
    ) -> Result<Vec<String>> {
        Ok(vec!["WatchEvents".into()])
    }
}
