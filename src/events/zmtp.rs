//! ZMTP 3.0 (NULL security; rfc.zeromq.org/spec/23), as much as the event
//! sockets need: the greeting and READY handshake (libzmq's, pyzmq's,
//! go-zeromq's sockets, any ZMTP 3 peer), frames both ways, and a reader
//! that bounds what a peer costs: frames of at most `MAX_FRAME` bytes, at
//! most `MAX_FRAMES` to a message, and bytes read at most at `RATE` a
//! second after a `BURST` (a peer that sends faster waits in its own TCP
//! window: junk costs the sidecar bounded CPU whatever the peer sends).
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// The largest frame a peer may send (a subscription, a replay request,
/// its READY), and the most frames in one of its messages: what a SUB, a
/// DEALER or a REQ sends is a few dozen bytes.
pub const MAX_FRAME: u64 = 4 << 10;
const MAX_FRAMES: usize = 8;
/// Bytes a second a peer's input is read at, after a burst.
const RATE: f64 = 64.0 * 1024.0;
const BURST: f64 = 64.0 * 1024.0;
/// A handshake not done in this long is dropped.
pub const HANDSHAKE: Duration = Duration::from_secs(3);
/// The write buffer of a connection (a larger message is written through).
const WRITE_BUFFER: usize = 16 << 10;

pub type Writer = BufWriter<OwnedWriteHalf>;

pub fn bad(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string())
}

/// A peer's input, read at a bounded rate.
pub struct Reader {
    rd: OwnedReadHalf,
    tokens: f64,
    at: Instant,
}

impl Reader {
    fn new(rd: OwnedReadHalf) -> Self {
        Self { rd, tokens: BURST, at: Instant::now() }
    }

    /// Wait until `n` more bytes may be read.
    async fn pace(&mut self, n: usize) {
        let now = Instant::now();
        self.tokens = (self.tokens + now.duration_since(self.at).as_secs_f64() * RATE).min(BURST);
        self.at = now;
        self.tokens -= n as f64;
        if self.tokens < 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(-self.tokens / RATE)).await;
        }
    }

    /// One frame: its flags and body (a body over `MAX_FRAME` is an error).
    pub async fn frame(&mut self) -> std::io::Result<(u8, Vec<u8>)> {
        self.pace(9).await;
        let flags = self.rd.read_u8().await?;
        let len = if flags & 0x02 != 0 { self.rd.read_u64().await? } else { u64::from(self.rd.read_u8().await?) };
        if len > MAX_FRAME {
            return Err(bad("a frame from a peer over 4 KiB"));
        }
        self.pace(len as usize).await;
        let mut body = vec![0u8; len as usize];
        self.rd.read_exact(&mut body).await?;
        Ok((flags, body))
    }

    /// A message's frames (commands between messages are skipped).
    pub async fn message(&mut self) -> std::io::Result<Vec<Vec<u8>>> {
        let mut frames = vec![];
        loop {
            let (flags, body) = self.frame().await?;
            if flags & 0x04 != 0 {
                continue;
            }
            if frames.len() == MAX_FRAMES {
                return Err(bad("a message from a peer of over 8 frames"));
            }
            frames.push(body);
            if flags & 0x01 == 0 {
                return Ok(frames);
            }
        }
    }
}

/// Greetings and READY both ways: ours says ZMTP 3.0 (a 3.1 peer then
/// sends subscriptions as messages, which both understand), NULL, and
/// `mine` as Socket-Type; the peer's must be one of `theirs`. Bounded by
/// `HANDSHAKE`; `greeted` is set once the peer's greeting came.
pub async fn handshake(
    s: TcpStream,
    mine: &[u8],
    theirs: &[&[u8]],
    greeted: &std::sync::atomic::AtomicBool,
) -> std::io::Result<(Reader, Writer)> {
    let _ = s.set_nodelay(true);
    let (rd, wr) = s.into_split();
    let (mut rd, mut wr) = (Reader::new(rd), BufWriter::with_capacity(WRITE_BUFFER, wr));
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
        rd.rd.read_exact(&mut g).await?;
        greeted.store(true, std::sync::atomic::Ordering::Relaxed);
        if g[0] != 0xff || g[9] & 1 != 1 || g[10] < 3 || &g[12..16] != b"NULL" {
            return Err(bad("not a ZMTP 3 peer with the NULL mechanism"));
        }
        let (flags, body) = rd.frame().await?;
        if flags & 0x04 == 0 || !body.starts_with(b"\x05READY") {
            return Err(bad("no READY command"));
        }
        let ty = property(&body[6..], b"Socket-Type").unwrap_or_default();
        if !theirs.contains(&ty) {
            return Err(bad("the peer's socket type does not go with this one"));
        }
        Ok(())
    };
    tokio::time::timeout(HANDSHAKE, shake).await.map_err(|_| bad("handshake timed out"))??;
    Ok((rd, wr))
}

/// Write a message's frames (buffered: flush to send).
pub async fn write(wr: &mut Writer, frames: &[&[u8]]) -> std::io::Result<()> {
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

#[cfg(test)]
pub mod testing {
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpStream;

    /// A peer's greeting and READY as `ty` (what libzmq sends, at once).
    pub fn hello(ty: &[u8]) -> Vec<u8> {
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
    pub async fn closed(s: &mut TcpStream) -> bool {
        let mut buf = [0u8; 256];
        let until = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            match tokio::time::timeout_at(until, s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => {}
                Err(_) => return false,
            }
        }
    }
}
