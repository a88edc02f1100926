//! Who the ZMQ sockets serve, and what each may hold.
//!
//! Admission (`Admission`): a socket serves at most `max` connections
//! past their handshake, and keeps `PENDING_PER_PLACE` times as many in
//! it. A new connection over the second bound closes the oldest one still
//! in its handshake (a peer that never greets holds a slot for
//! `zmtp::HANDSHAKE` at most, and never against a newcomer). A peer past
//! its handshake over the first bound takes the place of an idle one — the
//! longest served with no subscription (no replay request in progress: a
//! subscriber subscribes, a replay peer asks, right after its handshake),
//! else the one that has taken nothing longest (nothing written to it for
//! over a second: a stalled subscriber) — or is refused when every peer is
//! busy. So idle peers never keep a subscriber out. Accepts are paced
//! (`Pace`: 16 at once, then one per 5 ms), so a reconnecting flood costs
//! bounded CPU while a peer set reconnecting together after a restart gets
//! in at once; a connection that sent its greeting is closed for a
//! newcomer only after every one that sent nothing.
//!
//! Subscribers (`Subscribers`): each has a queue bounded in messages and
//! bytes; a message that does not fit is dropped for that subscriber
//! alone, counted (`cxlkv_events_dropped_total{reason="lagging"}`), and it
//! sees the jump in sequence. Its subscriptions are bounded in number and
//! bytes; a frame that is neither a subscription nor a cancel closes it.
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use super::zmtp::{self, Reader, Writer};
use crate::metric_names as names;

/// Connections in their handshake a socket keeps, per place it serves.
const PENDING_PER_PLACE: usize = 4;
/// A subscriber nothing was written to for this long may give its place.
const STALLED: Duration = Duration::from_secs(1);
/// Subscriptions of one subscriber, in number and bytes.
const MAX_SUBSCRIPTIONS: usize = 64;
const MAX_SUBSCRIPTION_BYTES: usize = 4 << 10;
/// Messages one subscriber's queue holds at most (its bytes: `queue_bytes`).
const QUEUE_MESSAGES: usize = 1024;
/// Accepts one socket takes at once, then one per `ACCEPT_EVERY`.
const ACCEPT_BURST: u32 = 16;
const ACCEPT_EVERY: Duration = Duration::from_millis(5);

/// One message as the PUB socket sends it: topic, sequence, payload.
pub struct Msg {
    pub topic: Bytes,
    pub seq: u64,
    pub payload: Bytes,
}

impl Msg {
    pub fn bytes(&self) -> usize {
        self.topic.len() + 8 + self.payload.len() + 64
    }
}

// ---------------------------------------------------------- admission

struct Slot {
    id: u64,
    opened: Instant,
    established: bool,
    kill: CancellationToken,
    state: Arc<PeerState>,
}

/// What admission needs to know of a peer.
#[derive(Default)]
pub struct PeerState {
    /// Milliseconds since the socket's start when it last took something
    /// (a message written, a subscription, a replay served).
    useful_ms: AtomicU64,
    /// It has a subscription, or a replay in progress.
    busy: AtomicBool,
    /// It sent its greeting (a connection in its handshake that did is
    /// closed for a newcomer after those that sent nothing).
    pub greeted: AtomicBool,
}

pub struct Admission {
    max: usize,
    start: Instant,
    slots: Mutex<(u64, Vec<Slot>)>,
}

/// A connection's place; gives it back when dropped.
pub struct Ticket {
    adm: Arc<Admission>,
    id: u64,
    pub kill: CancellationToken,
    pub state: Arc<PeerState>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.adm.slots.lock().unwrap_or_else(|p| p.into_inner()).1.retain(|s| s.id != self.id);
    }
}

impl Admission {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self { max: max.max(1), start: Instant::now(), slots: Mutex::new((0, vec![])) })
    }

    /// A place for a connection in its handshake (the oldest such one
    /// closed when they are `max` already).
    pub fn pending(self: &Arc<Self>) -> Ticket {
        let mut g = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let pending: Vec<usize> = (0..g.1.len()).filter(|&i| !g.1[i].established).collect();
        if pending.len() >= self.max * PENDING_PER_PLACE {
            let silent = |i: &usize| !g.1[*i].state.greeted.load(Ordering::Relaxed);
            let oldest = pending.iter().copied().filter(silent).min_by_key(|&i| g.1[i].opened);
            let oldest = oldest.or_else(|| pending.into_iter().min_by_key(|&i| g.1[i].opened)).expect("some");
            g.1[oldest].kill.cancel();
            g.1.remove(oldest);
        }
        g.0 += 1;
        let (id, kill, state) = (g.0, CancellationToken::new(), Arc::new(PeerState::default()));
        g.1.push(Slot { id, opened: Instant::now(), established: false, kill: kill.clone(), state: state.clone() });
        Ticket { adm: self.clone(), id, kill, state }
    }

    /// The connection finished its handshake: a place among the served
    /// ones (an idle or stalled peer's, when they are `max`), or false.
    pub fn establish(&self, t: &Ticket) -> bool {
        let mut g = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let served = g.1.iter().filter(|s| s.established).count();
        if served >= self.max {
            let Some(victim) = self.victim(&g.1, now) else { return false };
            g.1[victim].kill.cancel();
            g.1.remove(victim);
            metrics::counter!(names::EVENTS_DROPPED, "reason" => "evicted_peer").increment(1);
        }
        t.state.useful_ms.store(self.ms(now), Ordering::Relaxed);
        if let Some(s) = g.1.iter_mut().find(|s| s.id == t.id) {
            s.established = true;
            s.opened = now;
        }
        true
    }

    /// The served peer to close for a newcomer: an idle one (oldest
    /// first), else the one stalled longest, else none.
    fn victim(&self, slots: &[Slot], now: Instant) -> Option<usize> {
        let served = || (0..slots.len()).filter(|&i| slots[i].established);
        let idle = served().filter(|&i| !slots[i].state.busy.load(Ordering::Relaxed)).min_by_key(|&i| slots[i].opened);
        idle.or_else(|| {
            let stalled_since = self.ms(now).saturating_sub(STALLED.as_millis() as u64);
            served()
                .filter(|&i| slots[i].state.useful_ms.load(Ordering::Relaxed) < stalled_since)
                .min_by_key(|&i| slots[i].state.useful_ms.load(Ordering::Relaxed))
        })
    }

    fn ms(&self, at: Instant) -> u64 {
        at.duration_since(self.start).as_millis() as u64
    }

    /// The peer behind `state` took something now.
    pub fn useful(&self, state: &PeerState) {
        state.useful_ms.store(self.ms(Instant::now()), Ordering::Relaxed);
    }
}

pub fn set_busy(state: &PeerState, busy: bool) {
    state.busy.store(busy, Ordering::Relaxed);
}

/// Accept connections on `listener` until `shutdown`, paced, each served
/// by `serve` with its admission ticket until it ends, is evicted or the
/// socket shuts down.
pub async fn accept<F, Fut>(
    listener: TcpListener,
    adm: Arc<Admission>,
    shutdown: CancellationToken,
    what: &'static str,
    serve: F,
) where
    F: Fn(TcpStream, Arc<Ticket>) -> Fut,
    Fut: std::future::Future<Output = std::io::Result<()>> + Send + 'static,
{
    let mut pace = Pace::new(ACCEPT_BURST, ACCEPT_EVERY, Instant::now());
    loop {
        tokio::time::sleep_until(pace.ready_at().into()).await;
        let conn = tokio::select! {
            _ = shutdown.cancelled() => return,
            c = listener.accept() => c,
        };
        pace.took(Instant::now());
        match conn {
            Ok((s, from)) => {
                let ticket = Arc::new(adm.pending());
                let (task, shutdown, kill) = (serve(s, ticket.clone()), shutdown.clone(), ticket.kill.clone());
                tokio::spawn(async move {
                    let r = tokio::select! {
                        _ = shutdown.cancelled() => Ok(()),
                        _ = kill.cancelled() => Err(zmtp::bad("closed for another peer")),
                        r = task => r,
                    };
                    drop(ticket);
                    if let Err(e) = r {
                        tracing::debug!(%from, error = %e, "KV events: a ZMQ {what} left");
                    }
                });
            }
            Err(e) => {
                tracing::debug!(error = %e, "KV events: accepting a ZMQ {what} failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Accept pacing as a cell rate: `burst` accepts at once, then one per
/// `every`; idle time earns the burst back.
pub struct Pace {
    every: Duration,
    /// How far ahead of now the next accept's due time may run.
    window: Duration,
    /// When the next accept is due at the steady rate.
    due: Instant,
}

impl Pace {
    pub fn new(burst: u32, every: Duration, now: Instant) -> Self {
        Self { every, window: every * burst.saturating_sub(1), due: now }
    }

    /// The earliest time the next accept may happen.
    pub fn ready_at(&self) -> Instant {
        self.due.checked_sub(self.window).unwrap_or(self.due)
    }

    /// An accept happened at `now`.
    pub fn took(&mut self, now: Instant) {
        self.due = self.due.max(now) + self.every;
    }
}

// ---------------------------------------------------------------- PUB

/// The PUB socket's subscribers, accepted or dialed.
pub struct Subscribers {
    peers: Mutex<Vec<Arc<Peer>>>,
    queue_bytes: usize,
}

struct Peer {
    subscriptions: Mutex<Vec<Bytes>>,
    /// Messages queued and their bytes.
    queue: Mutex<(VecDeque<Arc<Msg>>, usize)>,
    wake: tokio::sync::Notify,
}

impl Subscribers {
    pub fn new(queue_bytes: usize) -> Arc<Self> {
        Arc::new(Self { peers: Mutex::new(vec![]), queue_bytes })
    }

    /// Queue `m` for every subscriber whose subscriptions match its
    /// topic; never waits.
    pub fn publish(&self, m: &Arc<Msg>) {
        let size = m.bytes();
        let peers = self.peers.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for p in peers {
            if !p.subscriptions.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|s| m.topic.starts_with(s)) {
                continue;
            }
            let mut q = p.queue.lock().unwrap_or_else(|e| e.into_inner());
            if q.0.len() >= QUEUE_MESSAGES || q.1 + size > self.queue_bytes {
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

    /// Serve one subscriber after its handshake: read its subscriptions,
    /// write what is queued for it, until either side ends.
    pub async fn serve(&self, mut rd: Reader, mut wr: Writer, on_useful: impl Fn(bool)) -> std::io::Result<()> {
        let peer = Arc::new(Peer {
            subscriptions: Mutex::new(vec![]),
            queue: Mutex::new((VecDeque::new(), 0)),
            wake: tokio::sync::Notify::new(),
        });
        self.peers.lock().unwrap_or_else(|e| e.into_inner()).push(peer.clone());
        let reader = async {
            loop {
                let (flags, body) = rd.frame().await?;
                let Some((on, topic)) = subscription(flags, &body)? else { continue };
                let mut subs = peer.subscriptions.lock().unwrap_or_else(|e| e.into_inner());
                if on {
                    let bytes: usize = subs.iter().map(Bytes::len).sum::<usize>() + topic.len();
                    if subs.len() == MAX_SUBSCRIPTIONS || bytes > MAX_SUBSCRIPTION_BYTES {
                        return Err(zmtp::bad("a subscriber over 64 subscriptions or 4 KiB of them"));
                    }
                    subs.push(Bytes::copy_from_slice(topic));
                } else if let Some(i) = subs.iter().position(|x| x[..] == *topic) {
                    subs.remove(i);
                }
                on_useful(!subs.is_empty());
            }
        };
        let writer = async {
            loop {
                let next = {
                    let mut q = peer.queue.lock().unwrap_or_else(|e| e.into_inner());
                    let m = q.0.pop_front();
                    if let Some(m) = &m {
                        q.1 -= m.bytes();
                    }
                    m
                };
                match next {
                    Some(m) => zmtp::write(&mut wr, &[&m.topic, &m.seq.to_be_bytes(), &m.payload]).await?,
                    None => {
                        tokio::io::AsyncWriteExt::flush(&mut wr).await?;
                        let subscribed = !peer.subscriptions.lock().unwrap_or_else(|e| e.into_inner()).is_empty();
                        on_useful(subscribed);
                        peer.wake.notified().await;
                    }
                }
            }
        };
        let r: std::io::Result<()> = tokio::select! {
            r = reader => r,
            r = writer => r,
        };
        self.peers.lock().unwrap_or_else(|e| e.into_inner()).retain(|x| !Arc::ptr_eq(x, &peer));
        r
    }
}

/// A subscriber's frame: (subscribe?, topic), None for a command that is
/// neither (ignored); anything else closes the connection.
fn subscription(flags: u8, body: &[u8]) -> std::io::Result<Option<(bool, &[u8])>> {
    if flags & 0x04 != 0 {
        return Ok(match (body.strip_prefix(b"\x09SUBSCRIBE"), body.strip_prefix(b"\x06CANCEL")) {
            (Some(t), _) => Some((true, t)),
            (_, Some(t)) => Some((false, t)),
            _ => None,
        });
    }
    match body.split_first() {
        Some((1, t)) => Ok(Some((true, t))),
        Some((0, t)) => Ok(Some((false, t))),
        _ => Err(zmtp::bad("a subscriber sent a message that is no subscription")),
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::events::zmtp::testing::{closed, hello};

    /// A PUB socket of `max` places on a loopback port.
    async fn publisher(max: usize) -> (std::net::SocketAddr, Arc<Subscribers>, CancellationToken) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (at, shutdown, adm, subs) =
            (l.local_addr().unwrap(), CancellationToken::new(), Admission::new(max), Subscribers::new(1 << 20));
        let s = subs.clone();
        tokio::spawn(accept(l, adm.clone(), shutdown.clone(), "subscriber", move |conn, t| {
            let (adm, subs) = (adm.clone(), s.clone());
            async move {
                let (rd, wr) = zmtp::handshake(conn, b"PUB", &[b"SUB"], &t.state.greeted).await?;
                if !adm.establish(&t) {
                    return Err(zmtp::bad("busy"));
                }
                subs.serve(rd, wr, |busy| {
                    set_busy(&t.state, busy);
                    adm.useful(&t.state);
                })
                .await
            }
        }));
        (at, subs, shutdown)
    }

    /// A subscriber that greets and subscribes to everything.
    async fn subscriber(at: std::net::SocketAddr) -> TcpStream {
        let mut s = TcpStream::connect(at).await.unwrap();
        s.write_all(&hello(b"SUB")).await.unwrap();
        s.write_all(&[0, 1, 1]).await.unwrap(); // subscribe ""
        let mut greeting = [0u8; 64];
        s.read_exact(&mut greeting).await.unwrap();
        s
    }

    /// Whether `s` receives a published message within a second.
    async fn receives(s: &mut TcpStream, subs: &Subscribers) -> bool {
        let until = tokio::time::Instant::now() + Duration::from_secs(2);
        let mut buf = [0u8; 4096];
        while tokio::time::Instant::now() < until {
            subs.publish(&Arc::new(Msg {
                topic: Bytes::from_static(b"t"),
                seq: 7,
                payload: Bytes::from_static(b"payload!"),
            }));
            if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(100), s.read(&mut buf)).await {
                if buf[..n].windows(8).any(|w| w == b"payload!") {
                    return true;
                }
            }
        }
        false
    }

    #[tokio::test]
    async fn idle_peers_past_their_handshake_give_their_places_to_subscribers() {
        let (at, subs, _stop) = publisher(4).await;
        let mut idle = vec![];
        for _ in 0..4 {
            let mut s = TcpStream::connect(at).await.unwrap();
            s.write_all(&hello(b"SUB")).await.unwrap(); // greets, never subscribes
            idle.push(s);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut real = subscriber(at).await;
        assert!(receives(&mut real, &subs).await, "a subscriber gets in while idle peers fill every place");
        assert!(closed(&mut idle[0]).await, "the oldest idle peer gave its place");
    }

    #[tokio::test]
    async fn peers_that_never_greet_cannot_keep_a_subscriber_out() {
        let (at, subs, _stop) = publisher(4).await;
        let mut silent = vec![];
        for _ in 0..4 * PENDING_PER_PLACE + 4 {
            silent.push(TcpStream::connect(at).await.unwrap()); // never greet
        }
        let mut real = subscriber(at).await;
        assert!(receives(&mut real, &subs).await);
        assert!(closed(&mut silent[0]).await, "the oldest silent one was closed for newcomers");
    }

    #[tokio::test]
    async fn busy_subscribers_keep_their_places_and_a_newcomer_is_refused() {
        let (at, subs, _stop) = publisher(2).await;
        let (mut a, mut b) = (subscriber(at).await, subscriber(at).await);
        assert!(receives(&mut a, &subs).await && receives(&mut b, &subs).await);
        let mut c = subscriber(at).await;
        assert!(closed(&mut c).await, "no idle or stalled place to take");
        assert!(receives(&mut a, &subs).await);
    }

    #[tokio::test]
    async fn subscriptions_are_bounded_in_number_and_bytes_and_junk_closes_the_peer() {
        let (at, _subs, _stop) = publisher(8).await;
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
        for _ in 0..2 {
            let mut big = vec![0x02];
            big.extend_from_slice(&3000u64.to_be_bytes());
            big.push(1);
            big.extend_from_slice(&[b'x'; 2999]);
            s.write_all(&big).await.unwrap();
        }
        assert!(closed(&mut s).await, "over 4 KiB of subscriptions closes the connection");

        for junk in [&[0x02, 0, 0, 0, 0, 0, 1, 0, 0][..], &[0, 3, 7, 7, 7][..]] {
            let mut s = TcpStream::connect(at).await.unwrap();
            s.write_all(&hello(b"SUB")).await.unwrap();
            s.write_all(junk).await.unwrap();
            assert!(closed(&mut s).await, "a frame over 4 KiB, or a message that is no subscription, closes it");
        }

        let mut s = TcpStream::connect(at).await.unwrap();
        s.write_all(&hello(b"PUSH")).await.unwrap();
        assert!(closed(&mut s).await, "a socket type that does not go with PUB is refused");
    }
}
