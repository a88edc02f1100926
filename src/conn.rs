//! Accepted gRPC connections, each tagged with a session id and, on the Unix
//! socket, the peer's credentials. A reservation belongs to the connection
//! that made it, so another client (or a client that reconnected) can
//! neither commit a dead writer's half-written object nor abort someone
//! else's store.
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc::UnboundedSender;
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::Connected;

use crate::auth::PeerCred;
use crate::registry::Session;

/// Put into every request's extensions by tonic.
#[derive(Debug, Clone, Copy)]
pub struct ConnInfo {
    pub session: Session,
    /// The connecting process (Unix socket only: SO_PEERCRED).
    pub peer: Option<PeerCred>,
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

/// A connection with its session. Sessions start at 1; `Session::LOCAL` (0)
/// is the sidecar itself. When the connection goes away its session is sent
/// to `closed` (the locks it held are released then).
pub struct Conn<S> {
    io: S,
    info: ConnInfo,
    closed: UnboundedSender<Session>,
}

static NEXT_SESSION: AtomicU64 = AtomicU64::new(1);

/// Tag each accepted connection with a fresh session id.
pub fn sessions<S, I>(incoming: S, closed: UnboundedSender<Session>) -> impl Stream<Item = io::Result<Conn<I>>>
where
    S: Stream<Item = io::Result<I>>,
    I: PeerOf,
{
    incoming.map(move |r| {
        r.map(|io| {
            let info = ConnInfo { session: Session(NEXT_SESSION.fetch_add(1, Ordering::Relaxed)), peer: io.peer() };
            Conn { io, info, closed: closed.clone() }
        })
    })
}

impl<S> Drop for Conn<S> {
    fn drop(&mut self) {
        let _ = self.closed.send(self.info.session);
    }
}

impl<S> Connected for Conn<S> {
    type ConnectInfo = ConnInfo;
    fn connect_info(&self) -> ConnInfo {
        self.info
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Conn<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
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

/// The session of a request (tonic puts the connection's `ConnInfo` into
/// every request, over TLS too); requests that did not come through
/// `sessions` (there are none in the server) share one anonymous session.
pub fn session_of<T>(req: &tonic::Request<T>) -> Session {
    req.extensions().get::<ConnInfo>().map_or(Session(u64::MAX), |c| c.session)
}
