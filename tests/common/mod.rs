//! Start the real `cxlkv` binary on a temporary shm-style pool and talk to it
//! (`inproc`: handlers in the test's own process instead).
#![allow(dead_code)]
pub mod certs;
pub mod inproc;
pub mod loopback;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cxlkv::client::{connect_uds, Client};
use cxlkv::proto;

pub const MIB: u64 = 1 << 20;

/// Poll `f` until it holds, failing the test once `within` has passed;
/// returns how long it took (failover tests report it).
pub async fn eventually(what: &str, within: Duration, mut f: impl AsyncFnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !f().await {
        assert!(t.elapsed() < within, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    t.elapsed()
}

pub struct Sidecar {
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub pool: PathBuf,
    pub child: Option<Child>,
    pub log: PathBuf,
}

/// The sidecar's gRPC health check says SERVING (asked from a thread of its
/// own: callers may be inside a runtime already).
pub fn ready(socket: &Path) -> bool {
    let socket = socket.to_owned();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(cxlkv::client::is_ready_uds(socket))
    })
    .join()
    .unwrap()
}

/// A plain HTTP/1.1 GET; returns status line, headers and body.
pub fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut t = std::net::TcpStream::connect(addr).unwrap();
    write!(t, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    t.read_to_string(&mut out).unwrap();
    out
}

/// The value of one exported series (`name` or `name{labels}`, exactly as
/// exported) at the metrics listener `addr`; None if absent or unparsable.
pub fn metric<T: std::str::FromStr>(addr: &str, series: &str) -> Option<T> {
    let body = http_get(addr, "/metrics");
    body.lines().find_map(|l| {
        let (name, value) = l.rsplit_once(' ')?;
        if name == series {
            value.parse().ok()
        } else {
            None
        }
    })
}

/// The arguments of node `node` of a cluster whose primary is "a": the
/// config file `cluster.toml` in `dir` (written to hold `toml`), a pool of
/// `pool_size`, and the primary's peer address `peer` ("a" listens there,
/// the others connect to it).
pub fn cluster_args(dir: &Path, node: &str, peer: &str, toml: &str, pool_size: &str) -> Vec<String> {
    let file = dir.join("cluster.toml");
    std::fs::write(&file, toml).unwrap();
    let role = if node == "a" { "--peer-addr" } else { "--primary-addr" };
    ["--config", file.to_str().unwrap(), "--node-name", node, "--primary", "a", "--pool-size", pool_size, role, peer]
        .map(String::from)
        .into()
}

/// Borrowed views of owned arguments (what `Sidecar::start` takes).
pub fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// A loopback port for a sidecar to listen on, outside the host's ephemeral
/// range. A port found by binding port 0 comes from that range, and between
/// the pick and the sidecar's bind any outgoing connection (another test's
/// follower dialling its primary) could take it as its source port: the
/// sidecar then failed with "Address already in use". Each pick in this
/// process is a new port (a counter), from an offset of the pid so that test
/// binaries run one after another start apart; a port something still holds
/// is skipped.
pub fn free_port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let (lo, hi) = listening_ports();
    let span = hi - lo;
    let start = std::process::id().wrapping_mul(7919) % span;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let port = (lo + (start + n) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {lo}..{hi}");
}

/// Ports no outgoing connection takes: below the ephemeral range
/// (`ip_local_port_range`, 32768-60999 by default), else above it.
fn listening_ports() -> (u32, u32) {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let mut r = range.split_whitespace().filter_map(|w| w.parse::<u32>().ok());
    let (low, high) = (r.next().unwrap_or(32768), r.next().unwrap_or(60999));
    if low >= 2048 + 1024 {
        (low / 2, low)
    } else if high < 65535 - 1024 {
        (high + 1, 65536)
    } else {
        panic!("the ephemeral port range {low}-{high} leaves no ports to listen on outside it");
    }
}

/// SIGSTOP `pid` and wait until every one of its threads has stopped: kill()
/// only queues the signal, and until a thread takes it and starts the group
/// stop the others keep serving requests (milliseconds on a loaded host).
#[allow(dead_code)] // not every test binary stops a process
pub fn sigstop(pid: u32) {
    use nix::sys::signal::{kill, Signal};
    kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGSTOP).unwrap();
    let t = Instant::now();
    let stopped = || {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
        tasks.flatten().all(|t| {
            let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
            // The state follows the command name's closing parenthesis.
            matches!(stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()), Some("T" | "t"))
        })
    };
    while !stopped() {
        assert!(t.elapsed() < Duration::from_secs(5), "process {pid} did not stop");
        std::thread::sleep(Duration::from_millis(1));
    }
}

impl Sidecar {
    /// Small geometry so tests can fill it: 2 MiB regions, 64 KiB pages.
    pub fn start(dir: &Path, name: &str, extra: &[&str]) -> Self {
        let socket = dir.join(format!("{name}.sock"));
        let pool = dir.join("pool");
        let log = dir.join(format!("{name}.log"));
        let mut s = Self { dir: dir.to_owned(), socket, pool, child: None, log };
        s.spawn(extra);
        s
    }

    /// Started with a config file holding `toml` (written as `<name>.toml`
    /// in `dir`) and the usual flags.
    pub fn with_config(dir: &Path, name: &str, toml: &str, extra: &[&str]) -> Self {
        let cfg = dir.join(format!("{name}.toml"));
        std::fs::write(&cfg, toml).unwrap();
        let mut args = vec!["--config", cfg.to_str().unwrap()];
        args.extend_from_slice(extra);
        Self::start(dir, name, &args)
    }

    /// Start without waiting for readiness (for starts that must fail).
    pub fn start_unchecked(dir: &Path, name: &str, extra: &[&str]) -> Self {
        let mut s = Self {
            dir: dir.to_owned(),
            socket: dir.join(format!("{name}.sock")),
            pool: dir.join("pool"),
            child: None,
            log: dir.join(format!("{name}.log")),
        };
        s.child = Some(s.command(extra).spawn().expect("start cxlkv"));
        s
    }

    /// Wait for the process to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(st) = self.child.as_mut().expect("running").try_wait().unwrap() {
                return st;
            }
            assert!(t.elapsed() < timeout, "cxlkv did not exit: {}", self.logs());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn command(&self, extra: &[&str]) -> Command {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let mut c = Command::new(env!("CARGO_BIN_EXE_cxlkv"));
        c.args(self.args(extra)).env("RUST_LOG", "info").stdout(Stdio::null()).stderr(log);
        c
    }

    pub fn args(&self, extra: &[&str]) -> Vec<String> {
        let mut a: Vec<String> = vec![
            "serve".into(),
            "--pool-path".into(),
            self.pool.display().to_string(),
            "--pool-size".into(),
            "8MiB".into(),
            "--region-size".into(),
            "2MiB".into(),
            "--page-size".into(),
            "64KiB".into(),
            "--socket".into(),
            self.socket.display().to_string(),
            "--metrics-addr".into(),
            "".into(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    }

    pub fn spawn(&mut self, extra: &[&str]) {
        let child = self.command(extra).spawn().expect("start cxlkv");
        self.child = Some(child);
        self.wait_ready(Duration::from_secs(30));
    }

    /// Wait for readiness (every listener bound), never for one socket:
    /// panics, with the logs, if the process exits first or `within` passes.
    pub fn wait_ready(&mut self, within: Duration) {
        let t = Instant::now();
        while !ready(&self.socket) {
            if let Some(st) = self.child.as_mut().expect("started").try_wait().unwrap() {
                panic!("{} exited early ({st}): {}", self.log.display(), self.logs());
            }
            assert!(t.elapsed() < within, "{} did not come up within {within:?}: {}", self.log.display(), self.logs());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub async fn client(&self) -> Client {
        connect_uds(&self.socket).await.expect("connect")
    }

    /// SIGTERM and wait; returns the exit status and how long it took.
    pub fn stop(&mut self) -> (std::process::ExitStatus, Duration) {
        let mut c = self.child.take().expect("running");
        let t = Instant::now();
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
        (c.wait().unwrap(), t.elapsed())
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The client's own mapping of the pool (the zero-copy data path).
pub struct PoolMap {
    map: memmap2::MmapMut,
    info: proto::PoolInfoReply,
}

impl PoolMap {
    pub async fn open(c: &mut Client) -> Self {
        let info = c.pool_info(proto::PoolInfoRequest {}).await.unwrap().into_inner();
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&info.path).unwrap();
        // SAFETY (test): the file is a live pool; the test only touches
        // reserved or locked ranges.
        let map = unsafe { memmap2::MmapOptions::new().len(info.pool_size as usize).map_mut(&f).unwrap() };
        Self { map, info }
    }
    fn at(&self, l: &proto::Location) -> usize {
        (self.info.data_offset + l.region as u64 * self.info.region_size + l.offset) as usize
    }
    pub fn write(&mut self, l: &proto::Location, data: &[u8]) {
        assert_eq!(l.length as usize, data.len());
        let o = self.at(l);
        self.map[o..o + data.len()].copy_from_slice(data);
    }
    pub fn read(&self, l: &proto::Location) -> Vec<u8> {
        let o = self.at(l);
        self.map[o..o + l.length as usize].to_vec()
    }
    /// Where the object's first page's slot is, in the pool's page table.
    fn slot_at(&self, l: &proto::Location) -> usize {
        let i = &self.info;
        let page = l.region as u64 * (i.region_size / i.page_size) + l.offset / i.page_size;
        (i.page_table_offset + page * i.page_slot_bytes as u64) as usize
    }
    /// The version word of the object's first page, from the pool's page table.
    pub fn version(&self, l: &proto::Location) -> u32 {
        let o = self.slot_at(l);
        u32::from_le_bytes(self.map[o..o + 4].try_into().unwrap())
    }
    /// Move that version word, as the page's owner does when it lets the
    /// pages go (behind the registry's back, if the test does it).
    pub fn set_version(&mut self, l: &proto::Location, v: u32) {
        let o = self.slot_at(l);
        self.map[o..o + 4].copy_from_slice(&v.to_le_bytes());
    }
}

pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn key(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

pub const OK: u32 = 0;
pub const NOT_FOUND: u32 = tonic::Code::NotFound as u32;
pub const ALREADY_EXISTS: u32 = tonic::Code::AlreadyExists as u32;
pub const RESOURCE_EXHAUSTED: u32 = tonic::Code::ResourceExhausted as u32;
pub const FAILED_PRECONDITION: u32 = tonic::Code::FailedPrecondition as u32;

/// Reserve, write through the mapping, commit: the fast store path.
pub async fn store(c: &mut Client, m: &mut PoolMap, tenant: &str, items: &[(&str, Vec<u8>)]) -> Vec<u32> {
    let req = proto::ReserveRequest {
        tenant: tenant.into(),
        items: items
            .iter()
            .map(|(k, v)| proto::ReserveItem { key: key(k), size: v.len() as u64, ..Default::default() })
            .collect(),
        ..Default::default()
    };
    let rep = c.reserve(req).await.unwrap().into_inner();
    let mut ids = vec![];
    let mut codes = vec![];
    for (r, (_, v)) in rep.reservations.iter().zip(items) {
        let code = r.status.as_ref().unwrap().code;
        codes.push(code);
        if code == OK {
            m.write(r.location.as_ref().unwrap(), v);
            ids.push(r.reservation_id);
        }
    }
    let cr = c
        .commit(proto::CommitRequest { reservation_ids: ids, crc32: vec![], keys: vec![] })
        .await
        .unwrap()
        .into_inner();
    assert!(cr.statuses.iter().all(|s| s.code == OK), "commit failed: {cr:?}");
    codes
}

pub async fn lookup(c: &mut Client, keys: &[&str]) -> Vec<Option<proto::Location>> {
    let rep = c
        .lookup_and_lock(proto::LookupRequest {
            keys: keys.iter().map(|k| key(k)).collect(),
            lock_ttl_ms: 0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    rep.results.into_iter().map(|r| r.found.then(|| r.location.unwrap())).collect()
}

pub async fn unlock(c: &mut Client, keys: &[&str]) -> Vec<u32> {
    let rep =
        c.unlock(proto::UnlockRequest { keys: keys.iter().map(|k| key(k)).collect() }).await.unwrap().into_inner();
    rep.statuses.iter().map(|s| s.code).collect()
}

pub async fn exists(c: &mut Client, keys: &[&str]) -> Vec<bool> {
    c.exists(proto::ExistsRequest { keys: keys.iter().map(|k| key(k)).collect() }).await.unwrap().into_inner().exists
}

pub async fn stats(c: &mut Client) -> proto::StatsReply {
    c.stats(proto::StatsRequest {}).await.unwrap().into_inner()
}

pub async fn inline_get(c: &mut Client, k: &str) -> Option<Vec<u8>> {
    use proto::inline_get_chunk::Part;
    let mut s = c.inline_get(proto::InlineGetRequest { key: key(k) }).await.unwrap().into_inner();
    let Some(Part::Header(h)) = s.message().await.unwrap().unwrap().part else { panic!("no header") };
    if !h.found {
        return None;
    }
    let mut out = vec![];
    while let Some(m) = s.message().await.unwrap() {
        let Some(Part::Data(d)) = m.part else { panic!("unexpected part") };
        out.extend_from_slice(&d);
    }
    assert_eq!(out.len() as u64, h.size);
    Some(out)
}

pub async fn inline_put(
    c: &mut Client,
    k: &str,
    declared: u64,
    chunks: Vec<Vec<u8>>,
) -> Result<proto::InlinePutReply, tonic::Status> {
    use proto::inline_put_chunk::Part;
    let mut msgs = vec![proto::InlinePutChunk {
        part: Some(Part::Header(proto::InlinePutHeader { key: key(k), tenant: "t".into(), size: declared })),
    }];
    msgs.extend(chunks.into_iter().map(|d| proto::InlinePutChunk { part: Some(Part::Data(d.into())) }));
    c.inline_put(tokio_stream::iter(msgs)).await.map(|r| r.into_inner())
}

// ---- Setup and calls shared by the single-sidecar tests -------------------

/// Sidecar "a" started with `extra` in a fresh temporary directory, a client
/// of it and the pool mapped: how most single-node tests begin. Bind the
/// directory too (`_dir`, not `_`): it must outlive the sidecar, and names
/// bound in one pattern drop in reverse order.
pub async fn one_sidecar(extra: &[&str]) -> (tempfile::TempDir, Sidecar, Client, PoolMap) {
    let dir = tempfile::tempdir().unwrap();
    let s = Sidecar::start(dir.path(), "a", extra);
    let mut c = s.client().await;
    let m = PoolMap::open(&mut c).await;
    (dir, s, c, m)
}

pub async fn pool_info(c: &mut Client) -> proto::PoolInfoReply {
    c.pool_info(proto::PoolInfoRequest {}).await.unwrap().into_inner()
}

pub async fn delete(c: &mut Client, keys: &[&str]) -> proto::DeleteReply {
    c.delete(proto::DeleteRequest { keys: keys.iter().map(|k| key(k)).collect() }).await.unwrap().into_inner()
}

/// The `cxlkv` binary run to completion (a subcommand, or a start expected
/// to fail).
pub fn run_cxlkv<S: AsRef<std::ffi::OsStr>>(args: impl IntoIterator<Item = S>) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_cxlkv")).args(args).output().unwrap()
}

impl Sidecar {
    /// Send SIGTERM and return at once (`stop` waits for the exit).
    pub fn sigterm(&self) {
        let pid = nix::unistd::Pid::from_raw(self.child.as_ref().expect("running").id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    }
}

/// The metrics a docs/METRICS.md table lists, as (name, type): the single
/// node's tables (before `## Cluster`) or, with `cluster`, the cluster's.
pub fn documented_metrics(cluster: bool) -> std::collections::BTreeSet<(String, String)> {
    let md = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/METRICS.md")).unwrap();
    let in_cluster = |l: &&str| !l.starts_with("## Cluster");
    let lines: Vec<&str> =
        if cluster { md.lines().skip_while(in_cluster).collect() } else { md.lines().take_while(in_cluster).collect() };
    lines
        .into_iter()
        .filter(|l| l.starts_with("| `cxlkv_"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            (cells[1].trim_matches('`').to_owned(), cells[2].to_owned())
        })
        .collect()
}

/// The (name, type) of every metric family in a `/metrics` body.
pub fn exported_metrics(body: &str) -> std::collections::BTreeSet<(String, String)> {
    body.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| {
            let mut p = l.split_whitespace();
            (p.next().unwrap().to_owned(), p.next().unwrap().to_owned())
        })
        .collect()
}

// ---- Issue 33 regressions: cluster faults (tests/cluster_dead_writers.rs,
// tests/cluster_primary_restart.rs). Added in one block; nothing above it
// was changed. ---------------------------------------------------------------

impl PoolMap {
    /// The generation word of region `r` in the pool's region table.
    pub fn generation(&self, r: u32) -> u64 {
        let i = &self.info;
        let o = (i.region_table_offset + r as u64 * i.region_entry_bytes as u64 + 8) as usize;
        u64::from_le_bytes(self.map[o..o + 8].try_into().unwrap())
    }

    /// A reader's copy: the bytes, then the object's version word and its
    /// region's generation read again after the copy; None when either
    /// moved (the copy may hold another object's bytes: a miss).
    pub fn read_checked(&self, l: &proto::Location) -> Option<Vec<u8>> {
        let data = self.read(l);
        (self.version(l) == l.version && self.generation(l.region) == l.generation).then_some(data)
    }
}

/// One mapped read of a key through a node.
pub enum Mapped {
    Miss,
    /// Found, copied, and still the object it was when handed out.
    Bytes(Vec<u8>),
    /// Found, but the version word or the region's generation had moved by
    /// the end of the copy (while the lookup's lock was held).
    Moved(proto::Location),
}

/// Lookup (lock) `k` through `c`, copy it from the mapping with the version
/// re-checked after the copy, unlock.
pub async fn mapped_get(c: &mut Client, m: &PoolMap, k: &str) -> Mapped {
    let Some(l) = lookup(c, &[k]).await.remove(0) else { return Mapped::Miss };
    let out = match m.read_checked(&l) {
        Some(b) => Mapped::Bytes(b),
        None => Mapped::Moved(l),
    };
    unlock(c, &[k]).await;
    out
}

/// InlineGet of `k`: Ok(None) on a miss; the stream's error (e.g. ABORTED:
/// the object went away while it was read) as Err.
pub async fn inline_get_result(c: &mut Client, k: &str) -> Result<Option<Vec<u8>>, tonic::Status> {
    use proto::inline_get_chunk::Part;
    let mut s = c.inline_get(proto::InlineGetRequest { key: key(k) }).await?.into_inner();
    let Some(Part::Header(h)) = s.message().await?.and_then(|m| m.part) else {
        return Err(tonic::Status::internal("no header"));
    };
    if !h.found {
        return Ok(None);
    }
    let mut out = vec![];
    while let Some(m) = s.message().await? {
        let Some(Part::Data(d)) = m.part else { return Err(tonic::Status::internal("unexpected part")) };
        out.extend_from_slice(&d);
    }
    Ok(Some(out))
}

/// Whose bytes these are, for failure messages: the name of the first of
/// `known` with exactly these bytes, else how many of their 4 KiB blocks
/// are blocks of which known payload (a writer that went on writing into
/// pages that became another object's).
pub fn whose(bytes: &[u8], known: &[(String, Vec<u8>)]) -> String {
    const BLOCK: usize = 4096;
    if let Some((k, _)) = known.iter().find(|(_, v)| v[..] == *bytes) {
        return format!("the bytes of {k}");
    }
    let blocks = bytes.len() / BLOCK;
    let best = known
        .iter()
        .map(|(k, v)| {
            let theirs: std::collections::HashSet<&[u8]> = v.chunks_exact(BLOCK).collect();
            (bytes.chunks_exact(BLOCK).filter(|b| theirs.contains(b)).count(), k)
        })
        .max_by_key(|(n, _)| *n);
    match best {
        Some((n, k)) if n > 0 => format!("{n} of its {blocks} 4 KiB blocks are bytes of {k}"),
        _ => format!("{} bytes of no known key", bytes.len()),
    }
}

/// Read every key of `want` through `c` (named `node`), mapped (version
/// re-checked after the copy) and by InlineGet, and every key of `gone`
/// (lookup, Exists, InlineGet): one line per read that is not exactly the
/// key's own bytes (or, for `gone`, a miss). `known`: every payload the test
/// wrote, to name whose bytes a wrong read returned.
pub async fn misreads(
    node: &str,
    c: &mut Client,
    m: &PoolMap,
    want: &[(String, Vec<u8>)],
    gone: &[&str],
    known: &[(String, Vec<u8>)],
) -> Vec<String> {
    let mut out = vec![];
    for (k, v) in want {
        match mapped_get(c, m, k).await {
            Mapped::Bytes(b) if b == *v => {}
            Mapped::Bytes(b) => out.push(format!("{k} through {node} (mapped): {}", whose(&b, known))),
            Mapped::Miss => out.push(format!("{k} through {node} (mapped): a miss")),
            Mapped::Moved(l) => out.push(format!("{k} through {node} (mapped): its location moved under a lock {l:?}")),
        }
        match inline_get_result(c, k).await {
            Ok(Some(b)) if b == *v => {}
            Ok(Some(b)) => out.push(format!("{k} through {node} (InlineGet): {}", whose(&b, known))),
            Ok(None) => out.push(format!("{k} through {node} (InlineGet): a miss")),
            Err(s) => out.push(format!("{k} through {node} (InlineGet): {s:?}")),
        }
    }
    for k in gone {
        match mapped_get(c, m, k).await {
            Mapped::Miss => {}
            Mapped::Bytes(b) => out.push(format!("{k} through {node} (mapped): found, {}", whose(&b, known))),
            Mapped::Moved(l) => out.push(format!("{k} through {node} (mapped): found at a moved location {l:?}")),
        }
        if exists(c, &[k]).await != [false] {
            out.push(format!("{k} through {node}: Exists true"));
        }
        match inline_get_result(c, k).await {
            Ok(None) => {}
            Ok(Some(b)) => out.push(format!("{k} through {node} (InlineGet): found, {}", whose(&b, known))),
            Err(s) => out.push(format!("{k} through {node} (InlineGet): {s:?}")),
        }
    }
    out
}

impl Sidecar {
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// kill -9 and reap; `spawn` starts it again (same socket and log).
    pub fn kill9(&mut self) {
        let mut c = self.child.take().expect("running");
        c.kill().unwrap();
        c.wait().unwrap();
    }
}

/// SIGCONT a process stopped with `sigstop`.
pub fn sigcont(pid: u32) {
    use nix::sys::signal::{kill, Signal};
    kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGCONT).unwrap();
}

/// Milliseconds since the Unix epoch (as `expires_unix_ms`).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}
