//! What the Dynamo decoder test needs around Dynamo's code: a cxlkv
//! sidecar process, a blocking ZMQ SUB client (ZMTP 3.0, NULL mechanism:
//! enough to subscribe and read messages) and the LMCache engine process
//! (`python -m cxlkv_testkit.engine_cli`) that stores token sequences.
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The repository root (this crate is `crates/dynamo-check`).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repo root")
}

/// One `cxlkv serve` on a pool under `dir`, ZMQ PUB on `pub_port`.
pub struct Sidecar {
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub pub_port: u16,
    child: Option<Child>,
}

impl Sidecar {
    pub fn start(dir: &Path, pub_port: u16, pool_size: &str) -> Self {
        let mut s = Self { dir: dir.into(), socket: dir.join("cxlkv.sock"), pub_port, child: None };
        s.spawn(pool_size);
        s
    }

    pub fn spawn(&mut self, pool_size: &str) {
        let bin = std::env::var("CXLKV_BIN").map(PathBuf::from).unwrap_or_else(|_| root().join("target/debug/cxlkv"));
        let cfg = self.dir.join("events.toml");
        std::fs::write(
            &cfg,
            format!(
                "[registry]\neviction_policy = \"fifo\"\n[events]\nzmq_publish = \"tcp://127.0.0.1:{}\"\n\
                 zmq_replay = \"tcp://127.0.0.1:{}\"\nblock_size = 16\n",
                self.pub_port,
                self.pub_port + 1
            ),
        )
        .unwrap();
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("cxlkv.log")).unwrap();
        let _ = std::fs::remove_file(&self.socket);
        let child = Command::new(&bin)
            .args(["serve", "--pool-path"])
            .arg(self.dir.join("pool"))
            .args(["--pool-size", pool_size, "--region-size", "2MiB", "--page-size", "4KiB", "--socket"])
            .arg(&self.socket)
            .args(["--metrics-addr", "", "--config"])
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e} (build it first: cargo build --bin cxlkv)", bin.display()));
        self.child = Some(child);
        let until = Instant::now() + Duration::from_secs(30);
        while !self.socket.exists() || TcpStream::connect(("127.0.0.1", self.pub_port)).is_err() {
            assert!(Instant::now() < until, "cxlkv did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// kill -9: its pool stays, as after a crash.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Run the LMCache engine process: `action` on each token sequence; its
/// line of output that starts with the action's word.
pub fn engine(socket: &Path, action: &str, seqs: &[&[u32]]) -> String {
    let py = std::env::var("CXLKV_PYTHON").map(PathBuf::from).unwrap_or_else(|_| root().join(".venv/bin/python"));
    let out = Command::new(py)
        .env("PYTHONHASHSEED", "0")
        .args(["-m", "cxlkv_testkit.engine_cli"])
        .arg(socket)
        .arg(action)
        .args(seqs.iter().map(|s| s.iter().map(u32::to_string).collect::<Vec<_>>().join(",")))
        .output()
        .expect("run the engine process");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "engine {action}: {}", String::from_utf8_lossy(&out.stderr));
    let word = match action {
        "store" => "STORED",
        "delete" => "DELETED",
        _ => "PRESENT",
    };
    stdout.lines().rev().find(|l| l.starts_with(word)).unwrap_or_default().to_string()
}

/// A ZMQ SUB socket connected to a PUB, reading whole messages.
pub struct Sub {
    s: TcpStream,
}

/// A ZMTP 3.0 connection as `ty`, after both greetings and READYs.
fn zmtp(port: u16, ty: &[u8]) -> std::io::Result<Sub> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_nodelay(true)?;
    let mut g = [0u8; 64];
    (g[0], g[9], g[10]) = (0xff, 0x7f, 3);
    g[12..16].copy_from_slice(b"NULL");
    s.write_all(&g)?;
    let mut ready = b"\x05READY\x0bSocket-Type".to_vec();
    ready.extend_from_slice(&(ty.len() as u32).to_be_bytes());
    ready.extend_from_slice(ty);
    s.write_all(&[0x04, ready.len() as u8])?;
    s.write_all(&ready)?;
    s.read_exact(&mut g)?;
    let mut c = Sub { s };
    let (flags, body) = c.frame()?;
    assert!(flags & 0x04 != 0 && body.starts_with(b"\x05READY"), "the peer's READY");
    Ok(c)
}

/// vLLM 0.26's replay: a DEALER asks for every message from `since`; the
/// messages (`[topic, seq, payload]`) up to the end marker.
pub fn replay(port: u16, since: u64) -> Vec<Vec<Vec<u8>>> {
    let mut d = zmtp(port, b"DEALER").expect("replay socket");
    let mut req = vec![0x01, 0, 0x00, 8];
    req.extend_from_slice(&since.to_be_bytes());
    d.s.write_all(&req).unwrap();
    let mut out = vec![];
    loop {
        let mut m = d.recv(Duration::from_secs(10)).expect("a replay answer");
        assert_eq!(m.remove(0), b"", "the DEALER's empty delimiter");
        if m[1] == (-1i64).to_be_bytes() {
            assert_eq!((m.len(), m[0].as_slice(), m[2].as_slice()), (3, &b""[..], &b""[..]), "vLLM's end marker");
            return out;
        }
        out.push(m);
    }
}

impl Sub {
    pub fn connect(port: u16, topic: &[u8]) -> std::io::Result<Self> {
        let mut sub = zmtp(port, b"SUB")?;
        let mut m = vec![0u8, (topic.len() + 1) as u8, 1];
        m.extend_from_slice(topic);
        sub.s.write_all(&m)?;
        Ok(sub)
    }

    fn frame(&mut self) -> std::io::Result<(u8, Vec<u8>)> {
        let mut b = [0u8; 1];
        self.s.read_exact(&mut b)?;
        let len = if b[0] & 0x02 != 0 {
            let mut l = [0u8; 8];
            self.s.read_exact(&mut l)?;
            u64::from_be_bytes(l) as usize
        } else {
            let mut l = [0u8; 1];
            self.s.read_exact(&mut l)?;
            l[0] as usize
        };
        let mut body = vec![0u8; len];
        self.s.read_exact(&mut body)?;
        Ok((b[0], body))
    }

    /// The next message, or None after `wait` without one.
    pub fn recv(&mut self, wait: Duration) -> Option<Vec<Vec<u8>>> {
        self.s.set_read_timeout(Some(wait)).ok()?;
        let mut frames = vec![];
        loop {
            let (flags, body) = match self.frame() {
                Ok(f) => f,
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    return None
                }
                Err(e) => panic!("the PUB connection broke: {e}"),
            };
            if flags & 0x04 != 0 {
                continue;
            }
            frames.push(body);
            if flags & 0x01 == 0 {
                return Some(frames);
            }
        }
    }
}
