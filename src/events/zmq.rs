//! The ZMQ transport: the stream in vLLM's KV-events format (`vllm.rs`) on
//! a PUB socket — bound (`zmq_publish`), and dialed to routers that bind
//! their SUB socket (`zmq_connect`, llm-d's shared-socket mode) — and a
//! ROUTER socket that replays what the PUB sent (`zmq_replay`).
//!
//! Each message is `[topic, seq, payload]`, `seq` 8 bytes big-endian,
//! numbered from 0 for each source (a restart, a new primary: "all
//! cleared" at 0 again), consecutive over the socket; a message lost
//! before it was numbered (the log's buffer overflowed, the publisher fell
//! behind the ring) skips one number, so subscribers see the gap. The
//! publisher keeps what it sent in a replay ring bounded in bytes
//! (`zmq_replay_bytes`). A replay request (a DEALER's `["", seq]`, a REQ's
//! `[seq]`) is answered on the asking connection at its pace with every
//! message held from `seq` to the one next when it asked:
//! - vLLM 0.26's form (`format = "vllm"`): `["", topic, seq, payload]`
//!   each, then `["", "", -1, ""]` (vllm-project/vllm#45177). A `seq` no
//!   longer held (or never sent) gets the end marker alone: the range is
//!   gone, and llm-d's subscriber (which requires a replay to start at the
//!   sequence it asked for) resets the source and follows the live stream.
//! - The older form (`format = "vllm-array"`): `["", seq, payload]`, then
//!   `["", -1, ""]`; a `seq` no longer held replays from the oldest held
//!   (the jump shows), as vLLM's publisher before 0.26 did.
//!
//! The sockets speak ZMTP 3.0 themselves (`zmtp.rs`), in Rust: nothing to
//! link or ship besides the binary (the `zeromq` crate, tried first, queued
//! 100,000 messages per subscriber, not configurable). What peers can make
//! the sidecar hold is bounded per peer and per socket (`peers.rs`).
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio_util::sync::CancellationToken;

pub use super::config::Endpoints;
use super::config::EventsConfig;
use super::peers::{self, Admission, Msg, Subscribers, Ticket};
use super::vllm::{self, Form, Format};
use super::zmtp::{self, Reader, Writer};
use super::EventLog;
use crate::error::{Error, Result};

/// The ZMQ transport (`transport.rs`).
pub struct Zmq;

#[tonic::async_trait]
impl super::transport::Transport for Zmq {
    fn name(&self) -> &'static str {
        "zmq"
    }

    async fn start(&self, log: Arc<EventLog>, cfg: &EventsConfig, shutdown: CancellationToken) -> Result<Vec<String>> {
        let Some(at) = cfg.endpoints() else { return Ok(vec![]) };
        serve(log, at.clone(), cfg, shutdown).await?;
        let mut on = vec![];
        on.extend((!at.publish.is_empty()).then(|| format!("PUB {}", at.publish)));
        on.extend(at.connect.iter().map(|c| format!("PUB to {c}")));
        on.extend((!at.replay.is_empty()).then(|| format!("replay {}", at.replay)));
        Ok(on)
    }
}

/// Messages the publisher takes from the log at once, in bytes.
const READ_BYTES: usize = 64 << 10;
/// Messages a replay takes from the ring at once, in bytes.
const REPLAY_READ_BYTES: usize = 256 << 10;
/// End of a replay (vLLM's `END_SEQ`).
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// What the PUB socket sent, for replays: bounded in bytes.
#[derive(Default)]
pub struct Sent {
    ring: Mutex<(VecDeque<Arc<Msg>>, usize)>,
    next: Mutex<u64>,
}

impl Sent {
    fn push(&self, m: Arc<Msg>, max_bytes: usize) {
        let mut r = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        r.1 += m.bytes();
        r.0.push_back(m);
        while r.0.len() > 1 && r.1 > max_bytes {
            let old = r.0.pop_front().expect("more than one");
            r.1 -= old.bytes();
        }
    }

    /// Held messages from `since`, at most `max_bytes` of them (at least
    /// one), and the oldest sequence held.
    fn read(&self, since: u64, max_bytes: usize) -> (Vec<Arc<Msg>>, Option<u64>) {
        let r = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let oldest = r.0.front().map(|m| m.seq);
        let (mut out, mut bytes) = (vec![], 0);
        for m in r.0.iter().skip_while(|m| m.seq < since) {
            if !out.is_empty() && bytes + m.bytes() > max_bytes {
                break;
            }
            bytes += m.bytes();
            out.push(m.clone());
        }
        (out, oldest)
    }

    fn next(&self) -> u64 {
        *self.next.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Publish `log` on `at` until `shutdown`; bound first (an error if an
/// endpoint cannot be bound).
pub async fn serve(log: Arc<EventLog>, at: Endpoints, cfg: &EventsConfig, shutdown: CancellationToken) -> Result<()> {
    let f = Arc::new(cfg.format());
    let subs = Subscribers::new(cfg.zmq_queue_bytes as usize);
    let sent = Arc::new(Sent::default());
    if !at.publish.is_empty() {
        let l = bind_tcp(&at.publish).await?;
        let (adm, subs) = (Admission::new(cfg.zmq_max_peers), subs.clone());
        tokio::spawn(peers::accept(l, adm.clone(), shutdown.clone(), "subscriber", move |s, t| {
            subscriber(s, t, adm.clone(), subs.clone())
        }));
    }
    for to in at.connect.clone() {
        tokio::spawn(dial(to, subs.clone(), shutdown.clone()));
    }
    if !at.replay.is_empty() {
        let l = bind_tcp(&at.replay).await?;
        let (adm, sent, form) = (Admission::new(cfg.zmq_max_peers), sent.clone(), f.form);
        tokio::spawn(peers::accept(l, adm.clone(), shutdown.clone(), "replay peer", move |s, t| {
            replayer(s, t, adm.clone(), sent.clone(), form)
        }));
    }
    tracing::info!(publish = %at.publish, connect = ?at.connect, replay = %at.replay, "KV events published (vLLM's ZMQ format)");
    let ring_bytes = cfg.zmq_replay_bytes as usize;
    tokio::spawn(publish(log, f, subs, sent, ring_bytes, shutdown));
    Ok(())
}

/// Number, keep and send the log's batches as vLLM messages.
async fn publish(
    log: Arc<EventLog>,
    f: Arc<Format>,
    subs: Arc<Subscribers>,
    sent: Arc<Sent>,
    ring_bytes: usize,
    shutdown: CancellationToken,
) {
    // From the oldest batch held: a new source's "all cleared" is message 0.
    let mut sub = log.subscribe(0, "zmq");
    let (mut epoch, mut expect) = (sub.epoch(), None);
    loop {
        let batches = tokio::select! {
            _ = shutdown.cancelled() => return,
            b = sub.next(READ_BYTES) => match b { Some(b) => b, None => return },
        };
        for b in batches {
            let mut seq = sent.next();
            if b.epoch != epoch {
                // A new source (a relay's primary changed): numbered from 0.
                (epoch, seq) = (b.epoch, 0);
                *sent.ring.lock().unwrap_or_else(|p| p.into_inner()) = Default::default();
            } else if expect.is_some_and(|e| e != b.seq) {
                seq += 1; // batches lost before this publisher: a gap
            }
            expect = Some(b.seq + 1);
            for (topic, payload) in vllm::encode(&b, &f) {
                let m = Arc::new(Msg { topic, seq, payload });
                sent.push(m.clone(), ring_bytes);
                subs.publish(&m);
                seq += 1;
            }
            *sent.next.lock().unwrap_or_else(|p| p.into_inner()) = seq;
            // Let the subscribers' writers run between batches: a burst
            // published in one go would fill their queues before they drain.
            tokio::task::yield_now().await;
        }
    }
}

async fn subscriber(s: TcpStream, t: Arc<Ticket>, adm: Arc<Admission>, subs: Arc<Subscribers>) -> std::io::Result<()> {
    let (rd, wr) = zmtp::handshake(s, b"PUB", &[b"SUB", b"XSUB"], &t.state.greeted).await?;
    if !adm.establish(&t) {
        return Err(zmtp::bad("every subscriber place is busy"));
    }
    subs.serve(rd, wr, |busy| {
        peers::set_busy(&t.state, busy);
        adm.useful(&t.state);
    })
    .await
}

/// Keep a connection to a router's bound SUB socket, as its PUB, until
/// `shutdown`: reconnect after a pause that grows to 5 s while it fails.
async fn dial(to: String, subs: Arc<Subscribers>, shutdown: CancellationToken) {
    let addr = to.strip_prefix("tcp://").unwrap_or(&to).to_string();
    let mut pause = Duration::from_millis(100);
    loop {
        let session = async {
            let s = tokio::time::timeout(zmtp::HANDSHAKE, TcpStream::connect(&addr))
                .await
                .map_err(|_| zmtp::bad("connect timed out"))??;
            let (rd, wr) = zmtp::handshake(s, b"PUB", &[b"SUB", b"XSUB"], &Default::default()).await?;
            pause = Duration::from_millis(100);
            subs.serve(rd, wr, |_| {}).await
        };
        let r = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = session => r,
        };
        if let Err(e) = r {
            tracing::debug!(to = %to, error = %e, "KV events: the connection to a router's SUB ended; dialing again");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

/// A replay peer's requests (its last frame the 8-byte start sequence; a
/// request without one is ignored), each answered (see the module's doc).
async fn replayer(
    s: TcpStream,
    t: Arc<Ticket>,
    adm: Arc<Admission>,
    sent: Arc<Sent>,
    form: Form,
) -> std::io::Result<()> {
    let (mut rd, mut wr): (Reader, Writer) =
        zmtp::handshake(s, b"ROUTER", &[b"DEALER", b"REQ"], &t.state.greeted).await?;
    if !adm.establish(&t) {
        return Err(zmtp::bad("every replay place is busy"));
    }
    loop {
        let req = rd.message().await?;
        let Some(Ok(start)) = req.last().map(|s| <[u8; 8]>::try_from(&s[..])) else { continue };
        peers::set_busy(&t.state, true);
        replay(&mut wr, &sent, u64::from_be_bytes(start), form).await?;
        peers::set_busy(&t.state, false);
        adm.useful(&t.state);
    }
}

async fn replay(wr: &mut Writer, sent: &Sent, start: u64, form: Form) -> std::io::Result<()> {
    let end = sent.next();
    let (_, oldest) = sent.read(u64::MAX, 0);
    let gone = start >= end || oldest.is_none_or(|o| start < o);
    let mut since = if form == Form::Map && gone { end } else { start };
    while since < end {
        let (msgs, _) = sent.read(since, REPLAY_READ_BYTES);
        let Some(last) = msgs.last() else { break };
        since = last.seq + 1;
        for m in msgs.iter().filter(|m| m.seq < end) {
            let seq = m.seq.to_be_bytes();
            match form {
                Form::Map => zmtp::write(wr, &[b"", &m.topic, &seq, &m.payload]).await?,
                Form::Array => zmtp::write(wr, &[b"", &seq, &m.payload]).await?,
            }
        }
    }
    match form {
        Form::Map => zmtp::write(wr, &[b"", b"", &END_SEQ, b""]).await?,
        Form::Array => zmtp::write(wr, &[b"", &END_SEQ, b""]).await?,
    }
    tokio::io::AsyncWriteExt::flush(wr).await
}

/// What the kernel buffers of one peer's input. Peers send subscriptions
/// and replay requests (frames of 4 KiB at most, read at 64 KiB/s), so a
/// small receive buffer bounds the kernel memory (charged to the pod) each
/// connection can hold — served, in its handshake or queued to be accepted
/// — and what closing a junk-sending peer frees. The kernel doubles it.
const PEER_RCVBUF: u32 = 32 << 10;
/// Connections the kernel queues before they are accepted (those past
/// it are refused by the kernel until one is accepted).
const BACKLOG: u32 = 256;

fn listen(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let s = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    s.set_reuseaddr(true)?;
    s.set_recv_buffer_size(PEER_RCVBUF)?;
    s.bind(addr)?;
    s.listen(BACKLOG)
}

/// Bind an endpoint's TCP listener (`tcp://*:port`: every interface),
/// waiting up to 2 s for the last term's socket on the same address.
async fn bind_tcp(at: &str) -> Result<TcpListener> {
    let addr = super::config::bind_addr(at)?;
    let mut tries = 0;
    loop {
        match listen(addr) {
            Ok(l) => return Ok(l),
            Err(_) if tries < 20 => tries += 1,
            Err(e) => return Err(Error::invalid(format!("cannot bind the KV events endpoint {at}: {e}"))),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
