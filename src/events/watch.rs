//! The event stream as gRPC messages (`WatchEvents` on the client API, and
//! on the peer port where followers relay it): where a subscriber may start,
//! and the stream itself — a task per subscriber that reads the log's ring
//! at the subscriber's pace and ends with the source.
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use super::{Batch, Event, EventLog, Reason};
use crate::error::{Error, ErrorKind, Result};
use crate::ids::NodeId;
use crate::proto::{self, event::Kind};

/// Batches a subscriber's task takes from the ring at once, and batches
/// waiting for a subscriber that does not read (then its task waits; what
/// it holds is bounded by the two).
const READ_BATCHES: usize = 64;
const QUEUED_BATCHES: usize = 16;

pub type EventStream = ReceiverStream<std::result::Result<proto::EventBatch, Status>>;

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

/// The stream of `log` from `since` (see `start`), each batch's events
/// kept where `keep` says (a tenant's scope; the batch itself is always
/// sent, so sequences stay consecutive). It ends when the source does.
pub fn stream(
    log: &Arc<EventLog>,
    since: u64,
    keep: impl Fn(&Event) -> bool + Send + 'static,
    transport: &'static str,
) -> EventStream {
    let (tx, rx) = mpsc::channel(QUEUED_BATCHES);
    let mut sub = log.subscribe(since, transport);
    tokio::spawn(async move {
        loop {
            let batches = tokio::select! {
                _ = tx.closed() => return,
                b = sub.next(READ_BATCHES) => b,
            };
            let Some(batches) = batches else {
                let _ = tx
                    .send(Err(Status::unavailable("the event source stopped (this node's term ended): resubscribe")))
                    .await;
                return;
            };
            for b in batches {
                if tx.send(Ok(to_proto(&b, &keep))).await.is_err() {
                    return;
                }
            }
        }
    });
    ReceiverStream::new(rx)
}

pub fn to_proto(b: &Batch, keep: &impl Fn(&Event) -> bool) -> proto::EventBatch {
    let events = b.events.iter().filter(|e| keep(e)).map(event_to_proto).collect();
    proto::EventBatch { epoch: b.epoch, seq: b.seq, ts_unix_ms: b.ts_unix_ms, events }
}

fn event_to_proto(e: &Event) -> proto::Event {
    match e {
        Event::Stored { key, tenant, size, node, commit_seq } => proto::Event {
            kind: Kind::Stored as i32,
            key: bytes::Bytes::copy_from_slice(key),
            tenant: tenant.to_string(),
            size: *size,
            node: node.0,
            commit_seq: *commit_seq,
            reason: String::new(),
        },
        Event::Removed { key, tenant, size, reason } => proto::Event {
            kind: Kind::Removed as i32,
            key: bytes::Bytes::copy_from_slice(key),
            tenant: tenant.to_string(),
            size: *size,
            reason: reason.as_str().into(),
            ..Default::default()
        },
        Event::AllCleared => proto::Event { kind: Kind::AllCleared as i32, ..Default::default() },
    }
}

/// A relayed event back (a follower's copy of its primary's stream); an
/// event this build does not know is an error (the relay resubscribes).
pub fn event_from_proto(e: proto::Event) -> Result<Event> {
    let bad = |what: &str| Error::invalid(format!("relayed event: {what}"));
    Ok(match Kind::try_from(e.kind).map_err(|_| bad("unknown kind"))? {
        Kind::Stored => Event::Stored {
            key: e.key.to_vec().into(),
            tenant: e.tenant.into(),
            size: e.size,
            node: NodeId(e.node),
            commit_seq: e.commit_seq,
        },
        Kind::Removed => Event::Removed {
            key: e.key.to_vec().into(),
            tenant: e.tenant.into(),
            size: e.size,
            reason: Reason::parse(&e.reason).ok_or_else(|| bad("unknown reason"))?,
        },
        Kind::AllCleared => Event::AllCleared,
    })
}
