//! The event stream in vLLM's KV-events wire format, which KV-aware
//! routers and indexers consume as they are (vLLM's own subscriber,
//! Dynamo's router through its ZMQ relay, llm-d's indexer): a ZMQ PUB
//! socket sends each batch as three frames — topic, the batch's sequence as
//! 8 big-endian bytes, the msgpack `KVEventBatch` `[ts, events, 0]` — and a
//! ROUTER socket replays the batches still held from a sequence a
//! subscriber asks for (8 big-endian bytes), ending with sequence -1 and an
//! empty payload. Events (msgspec's tagged arrays):
//! `["BlockStored", [hash], null, [], block_size, null, medium, null]`,
//! `["BlockRemoved", [hash], medium]`, `["AllBlocksCleared"]`. BlockStored
//! ends with `lora_name` (null): vLLM's array-like `BlockStored` made it a
//! field without a default when it added it, so there a 7-element array
//! fails to decode ("Expected `array` of at least length 8"), while the
//! releases before it skip the extra trailing field. (vLLM later dropped
//! `array_like` from its events, vllm-project/vllm#42892: those releases
//! publish events as maps; consumers such as llm-d's accept both.)
//!
//! A key's block hash (`block_hash`) is the LMCache chunk hash its key
//! names: the plugin's binary keys (a multiprocess server's `0x01 …`, the
//! in-process engine's `0x02 …`) carry it — a hash LMCache made from a
//! Python int is that int again, one made of bytes is its first 8 bytes,
//! big-endian, signed — and any other key is its 64-bit FNV-1a. The
//! sidecar knows no tokens: `token_ids` is empty, `parent_block_hash`,
//! `lora_id` and `lora_name` are null, `block_size` is `[events]
//! block_size` (LMCache's chunk size), `medium` is `[events] medium`
//! ("cxl").
//!
//! The sockets speak ZMTP 3.0 themselves (`zmtp`), in Rust, nothing to
//! link or ship besides the binary: the PUB side keeps a queue per
//! subscriber bounded in batches and bytes and drops a batch that does not
//! fit for that subscriber alone, counted (as libzmq's high-water mark
//! drops, which it does not count); the replay side answers each peer on
//! its own connection at the pace it reads. (The `zeromq` crate's sockets,
//! used first, queue 100,000 messages per peer, not configurable: a
//! stalled subscriber held everything published meanwhile, and a replay
//! peer that did not read blocked every replay.)
use std::sync::Arc;

use bytes::Bytes;
use rmp::encode as mp;
use tokio_util::sync::CancellationToken;

use super::{Batch, Event, EventLog};
use crate::error::{Error, Result};

/// What the vLLM-format events say besides the keys (`[events]`).
#[derive(Debug, Clone)]
pub struct Format {
    pub topic: String,
    pub medium: String,
    pub block_size: u32,
}

/// The ZMQ PUB endpoint and the replay ROUTER endpoint (`tcp://host:port`).
#[derive(Debug, Clone)]
pub struct Endpoints {
    pub publish: String,
    pub replay: String,
}

/// End of a replay (vLLM's `END_SEQ`).
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// Batches a publisher or a replay takes from the log at once.
const READ_BATCHES: usize = 64;

/// Publish `log` on `at` until `shutdown`; bound first (an error if either
/// endpoint cannot be bound).
pub async fn serve(log: Arc<EventLog>, at: Endpoints, f: Format, shutdown: CancellationToken) -> Result<()> {
    let publish = bind_tcp(&at.publish).await?;
    let replay = bind_tcp(&at.replay).await?;
    tracing::info!(publish = %at.publish, replay = %at.replay, "KV events published (vLLM's ZMQ format)");
    let f = Arc::new(f);
    let peers = Arc::new(zmtp::Peers::default());
    tokio::spawn(zmtp::accept_subscribers(publish, peers.clone(), shutdown.clone()));
    tokio::spawn(zmtp::accept_replays(replay, log.clone(), f.clone(), shutdown.clone()));
    tokio::spawn(async move {
        let mut sub = log.subscribe(log.next_seq(), "zmq");
        let topic = Bytes::from(f.topic.clone());
        loop {
            let batches = tokio::select! {
                _ = shutdown.cancelled() => return,
                b = sub.next(READ_BATCHES) => match b { Some(b) => b, None => return },
            };
            for b in batches {
                let frames = [topic.clone(), Bytes::copy_from_slice(&b.seq.to_be_bytes()), payload(&b, &f)];
                peers.publish(Arc::new(frames));
            }
        }
    });
    Ok(())
}

/// Bind an endpoint's TCP listener, waiting up to 2 s for the last term's
/// socket on the same address to close.
async fn bind_tcp(at: &str) -> Result<tokio::net::TcpListener> {
    let addr: std::net::SocketAddr = at
        .strip_prefix("tcp://")
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| Error::invalid(format!("events endpoint {at:?} is not tcp://ip:port")))?;
    let mut tries = 0;
    loop {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => return Ok(l),
            Err(_) if tries < 20 => tries += 1,
            Err(e) => return Err(zmq_error(at, e)),
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// ZMTP 3.0 (NULL security; rfc.zeromq.org/spec/23), as much as the two
/// sockets need: the greeting and READY handshake (libzmq's and pyzmq's
/// sockets, any ZMTP 3 peer), frames, and two servers.
///
/// PUB: the subscriptions each subscriber sends (ZMTP 3.0 messages, or
/// 3.1's SUBSCRIBE and CANCEL commands), and each batch written as three
/// frames to those whose subscriptions match its topic. Every subscriber
/// has a queue bounded by `QUEUE_BATCHES` and `QUEUE_BYTES`: a batch that
/// does not fit is dropped for it alone (counted in
/// `cxlkv_events_dropped_total{reason="lagging"}`), so a subscriber that
/// stops reading holds at most that much of the sidecar's memory and never
/// slows the publisher or the others; it sees the jump in sequence and can
/// ask the replay socket. (The zeromq crate's PUB socket queues 100,000
/// messages per subscriber, not configurable: a stalled subscriber held
/// every batch published meanwhile.)
///
/// ROUTER (replay): each DEALER or REQ peer's requests are answered on its
/// own connection by its own task, a few batches read from the ring at a
/// time and written as the peer reads them, so a peer that asks and does
/// not read holds a few batches and waits alone. (Through the zeromq
/// crate's ROUTER one such peer blocked every replay and held up to
/// 100,000 batches.)
mod zmtp {
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    use bytes::Bytes;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};
    use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
    use tokio::net::{TcpListener, TcpStream};
    use tokio_util::sync::CancellationToken;

    use super::{payload, EventLog, Format, END_SEQ, READ_BATCHES};
    use crate::metric_names as names;

    /// A subscriber's queue bounds.
    pub const QUEUE_BATCHES: usize = 1024;
    pub const QUEUE_BYTES: usize = 4 << 20;
    /// The largest frame a peer may send (a subscription, a request), and
    /// the most frames in one of its messages.
    const MAX_FRAME: u64 = 64 << 10;
    const MAX_FRAMES: usize = 16;

    type Writer = BufWriter<OwnedWriteHalf>;
    pub type Msg = Arc<[Bytes; 3]>;

    fn bad(what: &str) -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string())
    }

    /// Accept connections on `listener` until `shutdown`, each served by
    /// `serve` (every connection closes at `shutdown`).
    async fn accept<F, Fut>(listener: TcpListener, shutdown: CancellationToken, what: &'static str, serve: F)
    where
        F: Fn(TcpStream) -> Fut,
        Fut: std::future::Future<Output = std::io::Result<()>> + Send + 'static,
    {
        loop {
            let conn = tokio::select! {
                _ = shutdown.cancelled() => return,
                c = listener.accept() => c,
            };
            match conn {
                Ok((s, from)) => {
                    let _ = s.set_nodelay(true);
                    let (task, shutdown) = (serve(s), shutdown.clone());
                    tokio::spawn(async move {
                        let r = tokio::select! {
                            _ = shutdown.cancelled() => Ok(()),
                            r = task => r,
                        };
                        if let Err(e) = r {
                            tracing::debug!(%from, error = %e, "KV events: a ZMQ {what} left");
                        }
                    });
                }
                Err(e) => {
                    tracing::debug!(error = %e, "KV events: accepting a ZMQ {what} failed");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            }
        }
    }

    /// Greetings and READY both ways: ours says ZMTP 3.0 (a 3.1 peer then
    /// sends subscriptions as messages, which both understand), NULL, and
    /// `mine` as Socket-Type; the peer's must be one of `theirs`.
    async fn handshake(s: TcpStream, mine: &[u8], theirs: &[&[u8]]) -> std::io::Result<(OwnedReadHalf, Writer)> {
        let (mut rd, wr) = s.into_split();
        let mut wr = BufWriter::with_capacity(64 << 10, wr);
        let shake = async {
            let mut g = [0u8; 64];
            g[0] = 0xff;
            g[9] = 0x7f;
            g[10] = 3;
            g[12..16].copy_from_slice(b"NULL");
            wr.write_all(&g).await?;
            let mut ready = b"\x05READY\x0bSocket-Type".to_vec();
            ready.extend_from_slice(&(mine.len() as u32).to_be_bytes());
            ready.extend_from_slice(mine);
            wr.write_all(&[0x04, ready.len() as u8]).await?;
            wr.write_all(&ready).await?;
            wr.flush().await?;
            rd.read_exact(&mut g).await?;
            if g[0] != 0xff || g[9] & 1 != 1 || g[10] < 3 || &g[12..16] != b"NULL" {
                return Err(bad("not a ZMTP 3 peer with the NULL mechanism"));
            }
            let (flags, body) = frame(&mut rd).await?;
            if flags & 0x04 == 0 || !body.starts_with(b"\x05READY") {
                return Err(bad("no READY command"));
            }
            let ty = property(&body[6..], b"Socket-Type").unwrap_or_default();
            if !theirs.contains(&ty) {
                return Err(bad("the peer's socket type does not go with this one"));
            }
            Ok(())
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), shake)
            .await
            .map_err(|_| bad("handshake timed out"))??;
        Ok((rd, wr))
    }

    /// One frame: its flags and body (a body over `MAX_FRAME` is an error).
    async fn frame(rd: &mut OwnedReadHalf) -> std::io::Result<(u8, Vec<u8>)> {
        let flags = rd.read_u8().await?;
        let len = if flags & 0x02 != 0 { rd.read_u64().await? } else { u64::from(rd.read_u8().await?) };
        if len > MAX_FRAME {
            return Err(bad("a frame from a peer over 64 KiB"));
        }
        let mut body = vec![0u8; len as usize];
        rd.read_exact(&mut body).await?;
        Ok((flags, body))
    }

    /// A message's frames (commands, between messages, are skipped).
    async fn message(rd: &mut OwnedReadHalf) -> std::io::Result<Vec<Vec<u8>>> {
        let mut frames = vec![];
        loop {
            let (flags, body) = frame(rd).await?;
            if flags & 0x04 != 0 {
                continue;
            }
            if frames.len() == MAX_FRAMES {
                return Err(bad("a message from a peer of over 16 frames"));
            }
            frames.push(body);
            if flags & 0x01 == 0 {
                return Ok(frames);
            }
        }
    }

    /// Write a message's frames (buffered: flush to send).
    async fn write(wr: &mut Writer, frames: &[&[u8]]) -> std::io::Result<()> {
        for (i, f) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { 0x01 } else { 0 };
            if f.len() > 255 {
                wr.write_all(&[more | 0x02]).await?;
                wr.write_all(&(f.len() as u64).to_be_bytes()).await?;
            } else {
                wr.write_all(&[more, f.len() as u8]).await?;
            }
            wr.write_all(f).await?;
        }
        Ok(())
    }

    /// A ZMTP metadata property's value.
    fn property<'a>(mut props: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
        while let Some((&n, rest)) = props.split_first() {
            let (key, rest) = rest.split_at_checked(n as usize)?;
            let (len, rest) = rest.split_at_checked(4)?;
            let len = u32::from_be_bytes(len.try_into().ok()?) as usize;
            let (value, rest) = rest.split_at_checked(len)?;
            if key.eq_ignore_ascii_case(name) {
                return Some(value);
            }
            props = rest;
        }
        None
    }

    // ---------------------------------------------------------------- PUB

    #[derive(Default)]
    pub struct Peers {
        peers: Mutex<Vec<Arc<Peer>>>,
    }

    #[derive(Default)]
    struct Peer {
        subscriptions: Mutex<Vec<Bytes>>,
        /// Messages queued and their bytes.
        queue: Mutex<(VecDeque<Msg>, usize)>,
        wake: tokio::sync::Notify,
    }

    impl Peers {
        /// Queue `m` for every subscriber whose subscriptions match its
        /// topic; never waits.
        pub fn publish(&self, m: Msg) {
            let size: usize = m.iter().map(Bytes::len).sum();
            let peers = self.peers.lock().unwrap_or_else(|p| p.into_inner()).clone();
            for p in peers {
                if !p.subscriptions.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|s| m[0].starts_with(s)) {
                    continue;
                }
                let mut q = p.queue.lock().unwrap_or_else(|e| e.into_inner());
                if q.0.len() >= QUEUE_BATCHES || q.1 + size > QUEUE_BYTES {
                    drop(q);
                    metrics::counter!(names::EVENTS_DROPPED, "reason" => "lagging").increment(1);
                    continue;
                }
                q.0.push_back(m.clone());
                q.1 += size;
                drop(q);
                p.wake.notify_one();
            }
        }

        fn remove(&self, p: &Arc<Peer>) {
            self.peers.lock().unwrap_or_else(|e| e.into_inner()).retain(|x| !Arc::ptr_eq(x, p));
        }
    }

    /// Serve subscribers on `listener` until `shutdown`.
    pub async fn accept_subscribers(listener: TcpListener, peers: Arc<Peers>, shutdown: CancellationToken) {
        accept(listener, shutdown, "subscriber", move |s| subscriber(s, peers.clone())).await
    }

    async fn subscriber(s: TcpStream, peers: Arc<Peers>) -> std::io::Result<()> {
        let (mut rd, mut wr) = handshake(s, b"PUB", &[b"SUB", b"XSUB"]).await?;
        let peer = Arc::new(Peer::default());
        peers.peers.lock().unwrap_or_else(|e| e.into_inner()).push(peer.clone());
        let reader = async {
            loop {
                let (flags, body) = frame(&mut rd).await?;
                let (on, topic) = if flags & 0x04 != 0 {
                    match (body.strip_prefix(b"\x09SUBSCRIBE"), body.strip_prefix(b"\x06CANCEL")) {
                        (Some(t), _) => (true, t),
                        (_, Some(t)) => (false, t),
                        _ => continue,
                    }
                } else {
                    match body.split_first() {
                        Some((1, t)) => (true, t),
                        Some((0, t)) => (false, t),
                        _ => continue,
                    }
                };
                let mut subs = peer.subscriptions.lock().unwrap_or_else(|e| e.into_inner());
                if on {
                    subs.push(Bytes::copy_from_slice(topic));
                } else if let Some(i) = subs.iter().position(|x| x[..] == *topic) {
                    subs.remove(i);
                }
            }
        };
        let writer = async {
            loop {
                let next = {
                    let mut q = peer.queue.lock().unwrap_or_else(|e| e.into_inner());
                    let m = q.0.pop_front();
                    if let Some(m) = &m {
                        q.1 -= m.iter().map(Bytes::len).sum::<usize>();
                    }
                    m
                };
                match next {
                    Some(m) => write(&mut wr, &[&m[0], &m[1], &m[2]]).await?,
                    None => {
                        wr.flush().await?;
                        peer.wake.notified().await;
                    }
                }
            }
        };
        let r: std::io::Result<()> = tokio::select! {
            r = reader => r,
            r = writer => r,
        };
        peers.remove(&peer);
        r
    }

    // ------------------------------------------------------------- ROUTER

    /// Answer replay requests on `listener` until `shutdown`.
    pub async fn accept_replays(
        listener: TcpListener,
        log: Arc<EventLog>,
        f: Arc<Format>,
        shutdown: CancellationToken,
    ) {
        accept(listener, shutdown, "replay peer", move |s| replayer(s, log.clone(), f.clone())).await
    }

    /// A peer's requests (its last frame the 8-byte start sequence; a
    /// request without one is ignored), each answered with every batch
    /// held from that sequence as (empty delimiter, seq, payload) and the
    /// end marker (seq -1, empty payload): vLLM's replay protocol.
    async fn replayer(s: TcpStream, log: Arc<EventLog>, f: Arc<Format>) -> std::io::Result<()> {
        let (mut rd, mut wr) = handshake(s, b"ROUTER", &[b"DEALER", b"REQ"]).await?;
        loop {
            let req = message(&mut rd).await?;
            let Some(Ok(start)) = req.last().map(|s| <[u8; 8]>::try_from(&s[..])) else { continue };
            let mut since = u64::from_be_bytes(start);
            loop {
                let (batches, _) = log.read(since, READ_BATCHES);
                let Some(last) = batches.last() else { break };
                since = last.seq + 1;
                for b in &batches {
                    write(&mut wr, &[b"", &b.seq.to_be_bytes(), &payload(b, &f)]).await?;
                }
            }
            write(&mut wr, &[b"", &END_SEQ, b""]).await?;
            wr.flush().await?;
        }
    }
}

fn zmq_error(at: &str, e: impl std::fmt::Display) -> Error {
    Error::invalid(format!("cannot bind the KV events endpoint {at}: {e}"))
}

/// The batch as vLLM's msgpack `KVEventBatch`, encoded once.
fn payload(b: &Batch, f: &Format) -> Bytes {
    b.vllm.get_or_init(|| encode(b, f)).clone()
}

/// `[ts, [events...], data_parallel_rank]` (msgspec's array-like structs).
pub fn encode(b: &Batch, f: &Format) -> Bytes {
    let mut w = Vec::with_capacity(32 + b.events.len() * 24);
    mp::write_array_len(&mut w, 3).expect("vec");
    mp::write_f64(&mut w, b.ts_unix_ms as f64 / 1e3).expect("vec");
    mp::write_array_len(&mut w, b.events.len() as u32).expect("vec");
    for e in &b.events {
        match e {
            Event::Stored { key, .. } => {
                mp::write_array_len(&mut w, 8).expect("vec");
                mp::write_str(&mut w, "BlockStored").expect("vec");
                mp::write_array_len(&mut w, 1).expect("vec");
                mp::write_sint(&mut w, block_hash(key)).expect("vec");
                mp::write_nil(&mut w).expect("vec");
                mp::write_array_len(&mut w, 0).expect("vec");
                mp::write_uint(&mut w, u64::from(f.block_size)).expect("vec");
                mp::write_nil(&mut w).expect("vec");
                mp::write_str(&mut w, &f.medium).expect("vec");
                mp::write_nil(&mut w).expect("vec"); // lora_name
            }
            Event::Removed { key, .. } => {
                mp::write_array_len(&mut w, 3).expect("vec");
                mp::write_str(&mut w, "BlockRemoved").expect("vec");
                mp::write_array_len(&mut w, 1).expect("vec");
                mp::write_sint(&mut w, block_hash(key)).expect("vec");
                mp::write_str(&mut w, &f.medium).expect("vec");
            }
            Event::AllCleared => {
                mp::write_array_len(&mut w, 1).expect("vec");
                mp::write_str(&mut w, "AllBlocksCleared").expect("vec");
            }
        }
    }
    mp::write_uint(&mut w, 0).expect("vec");
    Bytes::from(w)
}

/// The block hash of a key (see the module's doc).
pub fn block_hash(key: &[u8]) -> i64 {
    chunk_hash(key).map_or_else(|| fnv1a(key) as i64, |(h, int)| hash_value(h, int))
}

/// The chunk hash a plugin key carries, and whether LMCache made it from
/// a Python int (an in-process key whose flags say so).
fn chunk_hash(k: &[u8]) -> Option<(&[u8], bool)> {
    let at = |i: usize| k.get(i).copied().map(usize::from);
    let hash = |o: usize| {
        let n = at(o)?;
        k.get(o + 1..o + 1 + n)
    };
    match *k.first()? {
        // 0x01 | len(model) | model | i32 kv_rank | u32 group | len(hash) | hash | salt
        0x01 => Some((hash(2 + at(1)? + 8)?, false)),
        // 0x02 | flags | len(model) | model | u32 world | u32 worker | dtype
        //      | [u32 layer] | len(hash) | hash | tags
        0x02 => {
            let flags = at(1)?;
            let o = 3 + at(2)? + 9 + if flags & 1 != 0 { 4 } else { 0 };
            Some((hash(o)?, flags & 2 == 0))
        }
        _ => None,
    }
}

/// An int's big-endian signed bytes back to the int (LMCache's own hash
/// when it fits 64 bits); bytes: their first 8, big-endian.
fn hash_value(h: &[u8], int: bool) -> i64 {
    if int && h.len() <= 8 {
        let fill = if h.first().is_some_and(|b| b & 0x80 != 0) { 0xff } else { 0 };
        let mut b = [fill; 8];
        b[8 - h.len()..].copy_from_slice(h);
        return i64::from_be_bytes(b);
    }
    let mut b = [0u8; 8];
    if h.len() >= 8 {
        b.copy_from_slice(&h[..8]);
    } else {
        b[8 - h.len()..].copy_from_slice(h);
    }
    i64::from_be_bytes(b)
}

fn fnv1a(k: &[u8]) -> u64 {
    k.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_vllms_tagged_arrays_block_stored_with_lora_name() {
        let f = Format { topic: String::new(), medium: "cxl".into(), block_size: 256 };
        let stored = Event::Stored {
            key: b"k".to_vec().into(),
            tenant: "t".into(),
            size: 1,
            node: crate::ids::NodeId(1),
            commit_seq: 1,
        };
        let removed = Event::Removed {
            key: b"k".to_vec().into(),
            tenant: "t".into(),
            size: 1,
            reason: super::super::Reason::Deleted,
        };
        let events = vec![Event::AllCleared, stored, removed];
        let b = Batch { epoch: 1, seq: 7, ts_unix_ms: 1500, events, vllm: Default::default() };
        let h = block_hash(b"k");
        let mut want = vec![0x93, 0xcb];
        want.extend_from_slice(&1.5f64.to_be_bytes());
        want.push(0x93);
        want.extend_from_slice(b"\x91\xb0AllBlocksCleared");
        // BlockStored: 8 elements, lora_name (nil) last.
        want.extend_from_slice(b"\x98\xabBlockStored\x91\xd3");
        want.extend_from_slice(&h.to_be_bytes());
        want.extend_from_slice(b"\xc0\x90\xcd\x01\x00\xc0\xa3cxl\xc0");
        want.extend_from_slice(b"\x93\xacBlockRemoved\x91\xd3");
        want.extend_from_slice(&h.to_be_bytes());
        want.extend_from_slice(b"\xa3cxl\x00");
        assert_eq!(&encode(&b, &f)[..], &want[..]);
    }

    #[test]
    fn block_hashes_are_the_chunk_hashes_plugin_keys_carry() {
        // A multiprocess key: model "m", rank 0, group 0, hash 01..08, salt.
        let mut k = vec![0x01, 1, b'm', 0, 0, 0, 0, 0, 0, 0, 0, 8];
        k.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        k.extend_from_slice(b"salt");
        assert_eq!(block_hash(&k), 0x0102_0304_0506_0708);
        // An in-process key whose hash LMCache made from the int -5.
        let mut k = vec![0x02, 0, 1, b'm', 0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0xfb];
        k.extend_from_slice(b"\x0acache_salt\x00\x01x");
        assert_eq!(block_hash(&k), -5);
        // The same, a layer key (a u32 layer id before the hash).
        let k = vec![0x02, 1, 1, b'm', 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 7, 2, 0x01, 0x00];
        assert_eq!(block_hash(&k), 256);
        // Anything else: FNV-1a.
        assert_eq!(block_hash(b"plain"), fnv1a(b"plain") as i64);
        // A key that claims a plugin form but is cut short: FNV-1a too.
        assert_eq!(block_hash(&[0x01, 200]), fnv1a(&[0x01, 200]) as i64);
    }
}
