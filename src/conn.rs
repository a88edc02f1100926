//! Accepted gRPC connections, each tagged with a session id and, on the Unix
//! socket, the peer's credentials. A reservation belongs to the connection
//! that made it, so another client (or a client that reconnected) can
//! neither commit a dead writer's half-written object nor abort someone
//! else's store.
//!
//! Every listener (Unix socket, TCP, the peer port) bounds its connections:
//! at most `max` at once (one more is accepted and closed at once, so the
//! kernel's backlog never fills with clients nobody serves); a connection
//! that has not made a request that passed the credential check within
//! `handshake` is closed, and so is one that sent nothing for `idle`; an
//! accept that fails (no file descriptor left) waits a moment before the
//! next instead of spinning.
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tokio_stream::Stream;
use tonic::transport::server::Connected;

use crate::registry::Session;

/// Durable sessions (`crate::sessions`) one connection may name: two LMCache
/// engines in one process may share a connection; more is a client gone astray.
pub const DURABLE_PER_CONNECTION: usize = 8;

/// How long a listener waits after a failed accept (EMFILE, ENFILE, ...).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The bounds a listener applies to its connections (`[server]`).
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub max: usize,
    pub handshake: Duration,
    pub idle: Duration,
}

/// What a connection did so far, shared with the requests it carries.
#[derive(Debug)]
pub struct ConnState {
    opened: Instant,
    /// Milliseconds after `opened` of the last byte received.
    last_read_ms: AtomicU64,
    /// A request of it passed the credential check.
    admitted: AtomicBool,
    /// InlineGet streams it has open (`rpc`'s per-connection bound).
    pub inline_streams: AtomicUsize,
    /// Durable sessions it named (`crate::sessions`): name, session.
    durable: std::sync::Mutex<Vec<(u128, Session)>>,
    /// WatchEvents streams it has open (`events/watch.rs`'s bound).
    pub event_streams: Arc<AtomicUsize>,
}

impl ConnState {
    fn new() -> Self {
        Self {
            opened: Instant::now(),
            last_read_ms: AtomicU64::new(0),
            admitted: AtomicBool::new(false),
            inline_streams: AtomicUsize::new(0),
            durable: std::sync::Mutex::new(vec![]),
            event_streams: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// The durable session this connection already named `name` for.
    pub fn durable_session(&self, name: u128) -> Option<Session> {
        self.durable.lock().unwrap().iter().find(|d| d.0 == name).map(|d| d.1)
    }

    /// Record that it names `name` (false: it names too many already).
    pub fn add_durable(&self, name: u128, session: Session) -> bool {
        let mut d = self.durable.lock().unwrap();
        if d.iter().any(|x| x.0 == name) {
            return true;
        }
        if d.len() >= DURABLE_PER_CONNECTION {
            return false;
        }
        d.push((name, session));
        true
    }

    /// The names it took, to give back when it closes.
    pub fn durable_names(&self) -> Vec<u128> {
        self.durable.lock().unwrap().iter().map(|d| d.0).collect()
    }

    /// A request of this connection passed the credential check.
    pub fn admit(&self) {
        self.admitted.store(true, Ordering::Relaxed);
    }

    fn touch(&self) {
        self.last_read_ms.store(self.opened.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// When the connection is over its time, given what it did so far.
    fn deadline(&self, limits: &ConnLimits) -> Instant {
        if !self.admitted.load(Ordering::Relaxed) {
            return self.opened + limits.handshake;
        }
        self.opened + Duration::from_millis(self.last_read_ms.load(Ordering::Relaxed)) + limits.idle
    }
}

/// The kernel's word on the process that connected (at connect time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    pub uid: u32,
    pub gid: u32,
    pub pid: Option<i32>,
}

impl PeerCred {
    pub fn of(s: &tokio::net::UnixStream) -> Option<Self> {
        s.peer_cred().ok().map(|c| Self { uid: c.uid(), gid: c.gid(), pid: c.pid() })
    }
}

/// Put into every request's extensions by tonic.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    pub session: Session,
    /// The connecting process (Unix socket only: SO_PEERCRED).
    pub peer: Option<PeerCred>,
    pub state: Arc<ConnState>,
}

impl ConnInfo {
    /// A connection just opened (the server makes these as it accepts).
    pub fn new(session: Session, peer: Option<PeerCred>) -> Self {
        Self { session, peer, state: Arc::new(ConnState::new()) }
    }
}

/// Transports whose peer the kernel can name.
pub trait PeerOf {
    fn peer(&self) -> Option<PeerCred> {
        None
    }
}

impl PeerOf for tokio::net::UnixStream {
    fn peer(&self) -> Option<PeerCred> {
        PeerCred::of(self)
    }
}

impl PeerOf for tokio::net::TcpStream {}

/// What a connection left behind when it closed: its own session (whose
/// locks are released then) and the durable sessions it named (which stay).
#[derive(Debug)]
pub struct Closed {
    pub session: Session,
    pub durable: Vec<u128>,
}

/// A connection with its session. Sessions start at 1; `Session::LOCAL` (0)
/// is the sidecar itself. When the connection goes away a `Closed` is sent
/// to `closed` and its place under the listener's bound is free again.
pub struct Conn<S> {
    io: S,
    info: ConnInfo,
    closed: UnboundedSender<Closed>,
    limits: ConnLimits,
    listener: &'static str,
    timer: Pin<Box<Sleep>>,
    _place: OwnedSemaphorePermit,
}

static NEXT_SESSION: AtomicU64 = AtomicU64::new(1);

/// A listener's accepted connections, bounded and tagged (see the module's
/// doc): what tonic serves.
pub struct Sessions<S> {
    incoming: S,
    closed: UnboundedSender<Closed>,
    limits: ConnLimits,
    places: Arc<Semaphore>,
    listener: &'static str,
    backoff: Option<Pin<Box<Sleep>>>,
}

/// Tag each accepted connection with a fresh session id, within `limits`;
/// `listener` names the listener in metrics and logs.
pub fn sessions<S>(
    incoming: S,
    closed: UnboundedSender<Closed>,
    limits: ConnLimits,
    listener: &'static str,
) -> Sessions<S> {
    for reason in ["handshake", "idle"] {
        metrics::counter!(crate::metric_names::CONNECTIONS_CLOSED, "listener" => listener, "reason" => reason)
            .increment(0);
    }
    metrics::counter!(crate::metric_names::CONNECTIONS_REFUSED, "listener" => listener).increment(0);
    metrics::counter!(crate::metric_names::ACCEPT_ERRORS, "listener" => listener).increment(0);
    let places = Arc::new(Semaphore::new(limits.max.max(1)));
    Sessions { incoming, closed, limits, places, listener, backoff: None }
}

impl<S, I> Stream for Sessions<S>
where
    S: Stream<Item = io::Result<I>> + Unpin,
    I: PeerOf,
{
    type Item = io::Result<Conn<I>>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let me = self.get_mut();
        loop {
            if let Some(b) = me.backoff.as_mut() {
                ready!(b.as_mut().poll(cx));
                me.backoff = None;
            }
            let io = match ready!(Pin::new(&mut me.incoming).poll_next(cx)) {
                None => return Poll::Ready(None),
                Some(Ok(io)) => io,
                Some(Err(e)) => {
                    // Out of file descriptors, most likely: retrying at once
                    // would spin; the connections that end meanwhile make room.
                    metrics::counter!(crate::metric_names::ACCEPT_ERRORS, "listener" => me.listener).increment(1);
                    tracing::debug!(listener = me.listener, error = %e, "accept failed; backing off");
                    me.backoff = Some(Box::pin(tokio::time::sleep(ACCEPT_BACKOFF)));
                    continue;
                }
            };
            let Ok(place) = me.places.clone().try_acquire_owned() else {
                // Accepted and closed at once: the client learns now, and the
                // backlog does not fill with connections nobody serves.
                metrics::counter!(crate::metric_names::CONNECTIONS_REFUSED, "listener" => me.listener).increment(1);
                continue;
            };
            let info = ConnInfo::new(Session(NEXT_SESSION.fetch_add(1, Ordering::Relaxed)), io.peer());
            let timer = Box::pin(tokio::time::sleep_until(info.state.deadline(&me.limits).into()));
            let closed = me.closed.clone();
            let (limits, listener) = (me.limits, me.listener);
            return Poll::Ready(Some(Ok(Conn { io, info, closed, limits, listener, timer, _place: place })));
        }
    }
}

impl<S> Conn<S> {
    /// Nothing to read right now: close the connection (a read error) once
    /// it is over its time; else wake up at its next deadline.
    fn check_time(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            ready!(self.timer.as_mut().poll(cx));
            let due = self.info.state.deadline(&self.limits);
            if Instant::now() < due {
                self.timer.as_mut().reset(due.into());
                continue;
            }
            let why = if self.info.state.admitted.load(Ordering::Relaxed) { "idle" } else { "handshake" };
            metrics::counter!(crate::metric_names::CONNECTIONS_CLOSED, "listener" => self.listener, "reason" => why)
                .increment(1);
            tracing::debug!(
                listener = self.listener,
                session = self.info.session.0,
                why,
                "closing a connection over its time"
            );
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, format!("connection closed: {why}"))));
        }
    }
}

impl<S> Drop for Conn<S> {
    fn drop(&mut self) {
        let durable = self.info.state.durable_names();
        let _ = self.closed.send(Closed { session: self.info.session, durable });
    }
}

impl<S> Connected for Conn<S> {
    type ConnectInfo = ConnInfo;
    fn connect_info(&self) -> ConnInfo {
        self.info.clone()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Conn<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut me.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    me.info.state.touch();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => me.check_time(cx),
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Conn<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// Small RPCs must not wait for Nagle + delayed ACK (~40 ms); tonic's own
/// `tcp_nodelay` only applies to listeners it binds itself.
pub fn nodelay(
    s: tokio_stream::wrappers::TcpListenerStream,
) -> impl Stream<Item = io::Result<tokio::net::TcpStream>> + Unpin {
    use tokio_stream::StreamExt;
    s.map(|r| {
        r.inspect(|t| {
            let _ = t.set_nodelay(true);
        })
    })
}

/// The connection a request came on (tonic puts the connection's
/// `ConnInfo` into every request; over TLS it wraps it).
pub fn conn_of<T>(req: &tonic::Request<T>) -> Option<&ConnInfo> {
    type Tls = tonic::transport::server::TlsConnectInfo<ConnInfo>;
    req.extensions().get::<ConnInfo>().or_else(|| req.extensions().get::<Tls>().map(|t| t.get_ref()))
}

/// The session of a request; requests that did not come through `sessions`
/// (there are none in the server) share one anonymous session.
pub fn session_of<T>(req: &tonic::Request<T>) -> Session {
    conn_of(req).map_or(Session(u64::MAX), |c| c.session)
}
