//! ZMTP 3.0 (NULL security; rfc.zeromq.org/spec/23), as much as the two
//! sockets need: the greeting and READY handshake (libzmq's and pyzmq's
//! sockets, any ZMTP 3 peer), frames, and two servers.
//!
//! PUB: the subscriptions each subscriber sends (ZMTP 3.0 messages, or
//! 3.1's SUBSCRIBE and CANCEL commands), and each batch written as three
//! frames to those whose subscriptions match its topic. Every subscriber
//! has a queue bounded by `QUEUE_BATCHES` and `QUEUE_BYTES`: a batch that
//! does not fit is dropped for it alone (counted in
//! `cxlkv_events_dropped_total{reason="lagging"}`), so a subscriber that
//! stops reading holds at most that much of the sidecar's memory and never
//! slows the publisher or the others; it sees the jump in sequence and can
//! ask the replay socket. (The zeromq crate's PUB socket queues 100,000
//! messages per subscriber, not configurable: a stalled subscriber held
//! every batch published meanwhile.)
//!
//! ROUTER (replay): each DEALER or REQ peer's requests are answered on its
//! own connection by its own task, a few batches read from the ring at a
//! time and written as the peer reads them, up to the batch that was next
//! when it asked (a replay never chases the live stream), so a peer that
//! asks and does not read holds a few batches and waits alone. (Through
//! the zeromq crate's ROUTER one such peer blocked every replay and held
//! up to 100,000 batches.)
//!
//! Each socket serves at most `MAX_PEERS` connections (more are closed at
//! once), a peer has `MAX_SUBSCRIPTIONS` at most and frames of `MAX_FRAME`
//! bytes, and a handshake not done in 10 s is dropped: what peers can make
//! the sidecar hold is bounded whatever they send.
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use super::{Batch, EventLog};
use crate::metric_names as names;

/// How a replayed batch is written (vLLM's `KVEventBatch`, encoded once).
pub type Encode = Arc<dyn Fn(&Batch) -> Bytes + Send + Sync>;

/// End of a replay (vLLM's `END_SEQ`).
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();
/// Batches a replay takes from the log at once.
const READ_BATCHES: usize = 64;

/// A subscriber's queue bounds.
pub const QUEUE_BATCHES: usize = 1024;
pub const QUEUE_BYTES: usize = 4 << 20;
/// The largest frame a peer may send (a subscription, a request), and
/// the most frames in one of its messages.
const MAX_FRAME: u64 = 64 << 10;
const MAX_FRAMES: usize = 16;
/// Connections one socket serves at once, and a subscriber's
/// subscriptions.
pub const MAX_PEERS: usize = 64;
const MAX_SUBSCRIPTIONS: usize = 64;

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
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_PEERS));
    loop {
        let conn = tokio::select! {
            _ = shutdown.cancelled() => return,
            c = listener.accept() => c,
        };
        match conn {
            Ok((s, from)) => {
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    tracing::warn!(%from, "KV events: a ZMQ {what} refused: {MAX_PEERS} connected already");
                    continue; // dropped: closed
                };
                let _ = s.set_nodelay(true);
                let (task, shutdown) = (serve(s), shutdown.clone());
                tokio::spawn(async move {
                    let r = tokio::select! {
                        _ = shutdown.cancelled() => Ok(()),
                        r = task => r,
                    };
                    drop(slot);
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
    tokio::time::timeout(std::time::Duration::from_secs(10), shake).await.map_err(|_| bad("handshake timed out"))??;
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
                if subs.len() == MAX_SUBSCRIPTIONS {
                    return Err(bad("a subscriber with over 64 subscriptions"));
                }
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
pub async fn accept_replays(listener: TcpListener, log: Arc<EventLog>, encode: Encode, shutdown: CancellationToken) {
    accept(listener, shutdown, "replay peer", move |s| replayer(s, log.clone(), encode.clone())).await
}

/// A peer's requests (its last frame the 8-byte start sequence; a
/// request without one is ignored), each answered with every batch
/// held from that sequence to the one next when it asked, as (empty
/// delimiter, seq, payload), and the end marker (seq -1, empty payload):
/// vLLM's replay protocol.
async fn replayer(s: TcpStream, log: Arc<EventLog>, encode: Encode) -> std::io::Result<()> {
    let (mut rd, mut wr) = handshake(s, b"ROUTER", &[b"DEALER", b"REQ"]).await?;
    loop {
        let req = message(&mut rd).await?;
        let Some(Ok(start)) = req.last().map(|s| <[u8; 8]>::try_from(&s[..])) else { continue };
        let (mut since, end) = (u64::from_be_bytes(start), log.next_seq());
        while since < end {
            let (batches, _) = log.read(since, READ_BATCHES);
            let Some(last) = batches.last() else { break };
            since = last.seq + 1;
            for b in batches.iter().filter(|b| b.seq < end) {
                write(&mut wr, &[b"", &b.seq.to_be_bytes(), &encode(b)]).await?;
            }
        }
        write(&mut wr, &[b"", &END_SEQ, b""]).await?;
        wr.flush().await?;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A peer's greeting and READY as `ty` (what libzmq sends, at once).
    fn hello(ty: &[u8]) -> Vec<u8> {
        let mut g = vec![0u8; 64];
        (g[0], g[9], g[10]) = (0xff, 0x7f, 3);
        g[12..16].copy_from_slice(b"NULL");
        let mut ready = b"\x05READY\x0bSocket-Type".to_vec();
        ready.extend_from_slice(&(ty.len() as u32).to_be_bytes());
        ready.extend_from_slice(ty);
        g.extend_from_slice(&[0x04, ready.len() as u8]);
        g.extend_from_slice(&ready);
        g
    }

    /// Read until the server closes the connection (true) or 5 s pass.
    async fn closed(s: &mut TcpStream) -> bool {
        let mut buf = [0u8; 256];
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            match tokio::time::timeout_at(until, s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => {}
                Err(_) => return false,
            }
        }
    }

    async fn publisher() -> (std::net::SocketAddr, CancellationToken) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (at, shutdown) = (l.local_addr().unwrap(), CancellationToken::new());
        tokio::spawn(accept_subscribers(l, Arc::new(Peers::default()), shutdown.clone()));
        (at, shutdown)
    }

    #[tokio::test]
    async fn connections_past_the_cap_are_closed_at_once_until_one_leaves() {
        let (at, _shutdown) = publisher().await;
        let mut held = vec![];
        for _ in 0..MAX_PEERS {
            let mut s = TcpStream::connect(at).await.unwrap();
            let mut greeting = [0u8; 10];
            s.read_exact(&mut greeting).await.unwrap(); // served: it greets
            held.push(s);
        }
        let mut extra = TcpStream::connect(at).await.unwrap();
        assert!(closed(&mut extra).await, "a connection past {MAX_PEERS} is closed");
        drop(held.pop());
        // Its slot comes back once its task sees it gone.
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let mut s = TcpStream::connect(at).await.unwrap();
            let mut greeting = [0u8; 10];
            if s.read_exact(&mut greeting).await.is_ok() {
                break;
            }
            assert!(tokio::time::Instant::now() < until, "no slot came back");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn a_subscriber_past_the_subscription_cap_or_frame_size_is_dropped() {
        let (at, _shutdown) = publisher().await;
        let mut s = TcpStream::connect(at).await.unwrap();
        s.write_all(&hello(b"SUB")).await.unwrap();
        for i in 0..MAX_SUBSCRIPTIONS {
            s.write_all(&[0, 2, 1, i as u8]).await.unwrap();
        }
        assert!(!closed(&mut s).await, "{MAX_SUBSCRIPTIONS} subscriptions are served");
        s.write_all(&[0, 2, 1, 0xff]).await.unwrap();
        assert!(closed(&mut s).await, "one more closes the connection");

        let mut s = TcpStream::connect(at).await.unwrap();
        s.write_all(&hello(b"SUB")).await.unwrap();
        let mut huge = vec![0x02];
        huge.extend_from_slice(&(MAX_FRAME + 1).to_be_bytes());
        s.write_all(&huge).await.unwrap();
        assert!(closed(&mut s).await, "a frame over {MAX_FRAME} bytes closes the connection");

        let mut s = TcpStream::connect(at).await.unwrap();
        s.write_all(&hello(b"PUSH")).await.unwrap();
        assert!(closed(&mut s).await, "a socket type that does not go with PUB is refused");
    }
}
