//! The inline byte path, for clients that cannot map the pool: an inline
//! put streams an object's bytes into pages the sidecar reserved and writes
//! itself; an inline get streams a locked object out, checked against its
//! checksum first and against its version after every chunk. The unary
//! calls stay in `rpc`.
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

use super::Op;
use super::{check_tenant, key_status, to_proto, Service, INLINE_CHUNK};
use crate::error::{Error, ErrorKind, Result};
use crate::handler::Handler;
use crate::ids::ReservationId;
use crate::metrics::{KeyResult, Metrics};
use crate::proto;
use crate::registry::{Location, Scope, Session};

type GetSender = mpsc::Sender<std::result::Result<proto::InlineGetChunk, Status>>;

/// How long an InlineGet waits for its reader to take the next chunk before
/// it gives up (the stream ends short; the reader sees fewer bytes than the
/// header said, and the object's lock goes back).
const STALLED_READER: Duration = Duration::from_secs(30);

/// An InlineGet stream's place under `[server] max_inline_streams` (the
/// permit) and its connection's `max_inline_streams_per_connection`; both
/// are given back when the stream's task ends.
pub(super) struct StreamSlot {
    pub(super) _permit: tokio::sync::OwnedSemaphorePermit,
    pub(super) conn: Option<Arc<crate::conn::ConnState>>,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        if let Some(c) = &self.conn {
            c.inline_streams.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// An InlineGet reply stream: its slot is held for as long as the stream
/// lives (the reader may not have read what the sender already queued).
pub struct GetStream {
    rx: tokio_stream::wrappers::ReceiverStream<std::result::Result<proto::InlineGetChunk, Status>>,
    _slot: StreamSlot,
}

impl GetStream {
    pub(super) fn new(
        rx: mpsc::Receiver<std::result::Result<proto::InlineGetChunk, Status>>,
        slot: StreamSlot,
    ) -> Self {
        Self { rx: tokio_stream::wrappers::ReceiverStream::new(rx), _slot: slot }
    }
}

impl tokio_stream::Stream for GetStream {
    type Item = std::result::Result<proto::InlineGetChunk, Status>;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::pin::Pin::new(&mut self.rx).poll_next(cx)
    }
}

/// Send one message, waiting at most `STALLED_READER` for room.
async fn send(tx: &GetSender, m: std::result::Result<proto::InlineGetChunk, Status>) -> Result<()> {
    match tokio::time::timeout(STALLED_READER, tx.send(m)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err(Error::new(ErrorKind::Cancelled, "client went away")),
        Err(_) => Err(Error::new(ErrorKind::DeadlineExceeded, "the reader took no chunk for 30 s")),
    }
}

/// Send `key`'s object (locked by the caller's lookup, `hit`) and unlock
/// it; a miss, or an object that cannot be vouched for, is a header with
/// `found: false`. Runs as its own task: the stream is the reply.
pub(super) async fn serve_get(
    handler: Arc<Handler>,
    metrics: Arc<Metrics>,
    tx: GetSender,
    key: bytes::Bytes,
    hit: Option<Location>,
    t: Instant,
) {
    let result = match hit {
        Some(loc) => send_object(&handler, &metrics, &tx, loc).await,
        None => Ok(false),
    };
    if hit.is_some() {
        let _ = handler.unlock(&[&key], Session::LOCAL).await;
    }
    let hit = match &result {
        Ok(false) => {
            let header = proto::InlineGetHeader { found: false, ..Default::default() };
            let part = Some(proto::inline_get_chunk::Part::Header(header));
            let _ = send(&tx, Ok(proto::InlineGetChunk { part })).await;
            false
        }
        Ok(true) => true,
        Err(e) => {
            let _ = send(&tx, Err(Status::from(e.clone()))).await;
            false
        }
    };
    metrics.key(Op::InlineGet, if hit { KeyResult::Hit } else { KeyResult::Miss }, 1);
    metrics.request(Op::InlineGet, result.as_ref().map(|_| ()), t.elapsed().as_secs_f64());
}

/// Stream a locked object: `Ok(false)` (nothing sent) when it cannot be
/// vouched for (bad or missing checksum), `Ok(true)` when every byte went
/// out, checked against the object's version after each chunk was read.
async fn send_object(handler: &Handler, metrics: &Metrics, tx: &GetSender, loc: Location) -> Result<bool> {
    use proto::inline_get_chunk::Part;
    let map = handler.mapping_for(&loc)?;
    let moved = || Error::new(ErrorKind::Aborted, "the object was removed while it was read; discard the bytes");
    // Whoever wrote the bytes (a client, this sidecar, a node on another
    // host), without hardware coherence this process may hold stale lines.
    map.invalidate(loc.offset, loc.length as usize)?;
    // Pages whose owner already let them go (an entry the registry should
    // not have kept) are a miss before anything is promised.
    if !handler.still_there(&loc)? || !payload_ok(handler, metrics, &map, &loc)? {
        return Ok(false);
    }
    let header = proto::InlineGetHeader { found: true, size: loc.length, tenant: String::new() };
    send(tx, Ok(proto::InlineGetChunk { part: Some(Part::Header(header)) })).await?;
    let mut off = 0u64;
    while off < loc.length {
        let n = (loc.length - off).min(INLINE_CHUNK as u64) as usize;
        let mut buf = BytesMut::zeroed(n);
        map.read(loc.offset + off, &mut buf)?;
        // A reader that stalls past its lock may find the pages reused.
        if !handler.still_there(&loc)? {
            return Err(moved());
        }
        off += n as u64;
        metrics.inline_out.increment(n as u64);
        metrics.bytes_loaded.increment(n as u64);
        send(tx, Ok(proto::InlineGetChunk { part: Some(Part::Data(buf.freeze())) })).await?;
    }
    Ok(true)
}

/// Check the payload against the checksum its writer gave (a first pass over
/// the bytes, so nothing is sent that turns out to be wrong). Without a
/// checksum the object passes unless the sidecar requires checksums.
fn payload_ok(handler: &Handler, metrics: &Metrics, map: &crate::pool::Mapping, loc: &Location) -> Result<bool> {
    let Some(want) = handler.payload_crc(loc)? else { return Ok(!handler.limits().require_checksum) };
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; INLINE_CHUNK.min(loc.length as usize)];
    let mut off = 0u64;
    while off < loc.length {
        let n = (loc.length - off).min(INLINE_CHUNK as u64) as usize;
        map.read(loc.offset + off, &mut buf[..n])?;
        h.update(&buf[..n]);
        off += n as u64;
    }
    let ok = h.finalize() == want && handler.still_there(loc)?;
    if !ok {
        metrics.payload_mismatch.increment(1);
        tracing::warn!(?loc, "payload checksum mismatch: serving a miss");
    }
    Ok(ok)
}

impl Service {
    pub(super) async fn inline_put_inner(
        &self,
        s: Streaming<proto::InlinePutChunk>,
        scope: &Scope,
    ) -> Result<proto::InlinePutReply> {
        let mut s = s;
        let first = next_chunk(&mut s, None).await?;
        let Some(proto::InlinePutChunk { part: Some(Part::Header(h)) }) = first else {
            return Err(Error::invalid("the first InlinePut message must be a header"));
        };
        check_tenant(scope, &h.tenant)?;
        // The sidecar writes these pages itself, so it owns the reservation:
        // housekeeping never frees it under the writer, and the writer gives
        // up (aborting it) when the reservation's time is over.
        // Taken before the reserve: the writer stops no later than the
        // registry's deadline, which starts after this.
        let until = tokio::time::Instant::now() + Duration::from_millis(self.handler.limits().reservation_timeout_ms);
        let rr = self.handler.reserve(&h.tenant, vec![(h.key.clone(), h.size)], Session::LOCAL, true).await?;
        let (id, loc) = match rr.results.into_iter().next().expect("one item") {
            Ok(x) => x,
            Err(e) => {
                self.metrics.key(Op::InlinePut, KeyResult::of_error(&e), 1);
                return Ok(proto::InlinePutReply { status: Some(key_status(&e)), ..Default::default() });
            }
        };
        let mut guard = AbortGuard { handler: self.handler.clone(), id: Some(id) };
        // A broken stream gives the reservation back before its error is
        // answered: the client sees nothing of it left (the guard covers a
        // caller that goes away mid-stream).
        let crc = match self.write_inline(&mut s, &h, &loc, until).await {
            Ok(crc) => crc,
            Err(e) => {
                guard.abort_now().await;
                return Err(e);
            }
        };
        let (r, removed_seq) = self.handler.commit(&[id], &[crc], Session::LOCAL).await?;
        let r = r.into_iter().next().expect("one item");
        guard.id = None;
        let loc = r?;
        self.metrics.bytes_committed.increment(loc.length);
        self.metrics.key(Op::InlinePut, KeyResult::Ok, 1);
        Ok(proto::InlinePutReply {
            status: Some(proto::KeyStatus::default()),
            location: Some(to_proto(&loc)),
            removed_seq,
        })
    }

    /// The data messages of an inline put into its reserved pages, to the
    /// declared size exactly; their checksum.
    async fn write_inline(
        &self,
        s: &mut Streaming<proto::InlinePutChunk>,
        h: &proto::InlinePutHeader,
        loc: &crate::registry::Location,
        until: tokio::time::Instant,
    ) -> Result<u32> {
        let map = self.handler.mapping_for(loc)?;
        let mut written = 0u64;
        let mut crc = crc32fast::Hasher::new();
        while let Some(msg) = next_chunk(s, Some(until)).await? {
            let Some(Part::Data(d)) = msg.part else {
                return Err(Error::invalid("only data may follow the InlinePut header"));
            };
            if written + d.len() as u64 > h.size {
                return Err(Error::invalid(format!("more bytes than the declared size {}", h.size)));
            }
            // Checked before every chunk: past the deadline, or on a node
            // that lost its primary for a lease (stopped, partitioned), the
            // region may be another node's by now.
            if tokio::time::Instant::now() >= until {
                return Err(Error::new(ErrorKind::DeadlineExceeded, "inline put ran past its reservation's deadline"));
            }
            if !self.handler.may_write() {
                return Err(Error::new(ErrorKind::Unavailable, "cut off from the cluster's primary: not writing"));
            }
            // In memory (software coherence) and fenced chunk by chunk: the
            // task may resume on another thread, whose fence would not order
            // this one's streaming stores.
            map.write_through(loc.offset + written, &d)?;
            crc.update(&d);
            written += d.len() as u64;
            self.metrics.inline_in.increment(d.len() as u64);
        }
        if written != h.size {
            // Never commit unwritten pages: they hold a previous object's bytes.
            return Err(Error::invalid(format!("stream ended after {written} of {} declared bytes", h.size)));
        }
        Ok(crc.finalize())
    }
}

use proto::inline_put_chunk::Part;

/// The next message of an inline put, waiting at most until `until`. A
/// broken stream is the client's doing: INVALID_ARGUMENT for a message that
/// does not decode, CANCELLED otherwise (never UNAVAILABLE, which clients
/// retry against a healthy sidecar).
async fn next_chunk(
    s: &mut Streaming<proto::InlinePutChunk>,
    until: Option<tokio::time::Instant>,
) -> Result<Option<proto::InlinePutChunk>> {
    let msg = match until {
        Some(t) => tokio::time::timeout_at(t, s.message()).await.map_err(|_| {
            Error::new(ErrorKind::DeadlineExceeded, "inline put did not finish within reservation_timeout_ms")
        })?,
        None => s.message().await,
    };
    msg.map_err(|e| {
        let kind =
            if e.code() == tonic::Code::InvalidArgument { ErrorKind::InvalidArgument } else { ErrorKind::Cancelled };
        Error::new(kind, format!("inline put stream broke: {}", e.message()))
    })
}

/// Aborts the sidecar's own inline-put reservation unless it was committed
/// (the client may vanish, the stream may time out).
struct AbortGuard {
    handler: Arc<Handler>,
    id: Option<ReservationId>,
}

impl AbortGuard {
    async fn abort_now(&mut self) {
        if let Some(id) = self.id.take() {
            let _ = self.handler.abort(&[id], Session::LOCAL).await;
        }
    }
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            let h = self.handler.clone();
            tokio::spawn(async move {
                let _ = h.abort(&[id], Session::LOCAL).await;
            });
        }
    }
}
