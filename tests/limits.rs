//! What one client can do to everyone (issue 33, defect 7), against the real
//! binary: never-read InlineGet streams are bounded per connection and cost
//! the sidecar little memory; connections that never send a request, up to
//! and past `[server] max_connections` and the process's fd limit, neither
//! make the accept loop spin nor lock real clients (or a joining follower)
//! out for longer than `handshake_timeout_ms` and a few seconds; and one
//! client's locks or reservations never take the whole pool from another.
//!
//! The tests that need no new setting use the built-in defaults (8 InlineGet
//! streams per connection, a handshake timeout of 10 s, half the pool's region
//! space pinned per connection); the others pass the new `[server]` keys in a
//! `--config` file.
mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use cxlkv::client::{connect_uds, Client};
use cxlkv::proto;
use cxlkv::proto::cxlkv_client::CxlkvClient;

/// One page of the test geometry (64 KiB): every object of the pinning tests
/// is exactly one page, so bytes and pages count the same.
const PAGE: usize = 64 << 10;
/// Pages in the default test pool (8 MiB of region space).
const POOL_PAGES: usize = 128;
/// `[server] handshake_timeout_ms` when it is left at its default.
const DEFAULT_HANDSHAKE: Duration = Duration::from_secs(10);
/// "A few seconds" past the handshake timeout for a real client to get in
/// (or a follower, started after the flood, to join and serve).
const SLACK: Duration = Duration::from_secs(4);
/// Most CPU time a sidecar holding idle connections may use in 5 s: an idle
/// primary with a follower uses ~0.1 s (debug build); the accept loop
/// spinning on EMFILE used ~4.7 s on an idle host, ~1.9 s on two busy cores.
const MAX_IDLE_CPU: Duration = Duration::from_millis(500);

fn pid(s: &Sidecar) -> u32 {
    s.child.as_ref().expect("running").id()
}

/// Resident memory of `pid` in bytes (/proc/PID/status VmRSS).
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS");
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// User plus system CPU time of `pid`, all threads (/proc/PID/stat fields 14
/// and 15, in USER_HZ ticks: 100 per second on Linux).
fn cpu(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command name's closing parenthesis start at field 3.
    let rest: Vec<u64> =
        stat.rsplit_once(')').unwrap().1.split_whitespace().skip(1).map(|f| f.parse().unwrap_or(0)).collect();
    Duration::from_millis((rest[10] + rest[11]) * 10)
}

/// File descriptors `pid` has open.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count()
}

/// Lower `pid`'s RLIMIT_NOFILE so that it can open `more` descriptors beyond
/// those it has now (the limit is on descriptor numbers, the lowest free one
/// is always taken).
fn limit_fds(pid: u32, more: usize) -> usize {
    let n = open_fds(pid) + more;
    let out = std::process::Command::new("prlimit")
        .args(["--pid", &pid.to_string(), &format!("--nofile={n}:{n}")])
        .output()
        .expect("run prlimit");
    assert!(out.status.success(), "prlimit: {}", String::from_utf8_lossy(&out.stderr));
    n
}

/// CPU time `pid` uses over the next 5 s (a task of its own, so the test
/// can try its real client meanwhile).
fn cpu_over_5s(pid: u32) -> tokio::task::JoinHandle<Duration> {
    tokio::spawn(async move {
        let before = cpu(pid);
        tokio::time::sleep(Duration::from_secs(5)).await;
        cpu(pid) - before
    })
}

/// A client on its own connection whose HTTP/2 windows (stream and
/// connection) are 64 KiB: while it reads nothing, the server can hand it at
/// most 64 KiB in all, so no stream of a large object can end on its own.
async fn non_reading_client(socket: &Path) -> Client {
    use hyper_util::rt::TokioIo;
    use tonic::transport::{Endpoint, Uri};
    let path = socket.to_owned();
    let ch = Endpoint::from_static("http://localhost")
        .initial_stream_window_size(65_535)
        .initial_connection_window_size(65_535)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
        }))
        .await
        .unwrap();
    CxlkvClient::new(ch).max_decoding_message_size(64 << 20)
}

/// Try a real client of `socket` (a fresh connection each try, each try
/// bounded) until `key` is found through it with `want`'s bytes (inline);
/// how long that took, or None if not within `within`. A refused or stalled
/// connection is legitimately tried again: the contract is a bound on when
/// a client gets in, not that its first connection does.
async fn client_served(socket: &Path, key: &str, want: &[u8], within: Duration) -> Option<Duration> {
    let t = Instant::now();
    while t.elapsed() < within {
        let attempt = tokio::time::timeout(Duration::from_secs(1), async {
            let mut c = connect_uds(socket).await.ok()?;
            let r = c.exists(proto::ExistsRequest { keys: vec![common::key(key)] }).await.ok()?;
            Some(r.into_inner().exists == vec![true])
        })
        .await;
        if let Ok(Some(found)) = attempt {
            assert!(found, "the key stored before the flood is gone");
            // Served: the bytes come back whole (bounded, not retried).
            let mut c = connect_uds(socket).await.unwrap();
            let got = tokio::time::timeout(Duration::from_secs(5), inline_get(&mut c, key)).await;
            assert_eq!(got.expect("inline get stalled").as_deref(), Some(want), "{key}: other bytes");
            return Some(t.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// `n` raw connections to the Unix socket that never send a byte.
fn flood_uds(socket: &Path, n: usize) -> Vec<std::os::unix::net::UnixStream> {
    (0..n).map(|_| std::os::unix::net::UnixStream::connect(socket).expect("raw connect")).collect()
}

/// `n` raw TCP connections to `addr` that never send a byte.
fn flood_tcp(addr: &str, n: usize) -> Vec<std::net::TcpStream> {
    (0..n).map(|_| std::net::TcpStream::connect(addr).expect("raw connect")).collect()
}

// ---- (a) InlineGet streams -------------------------------------------------

/// 150 InlineGet streams of a 2 MiB object opened on one connection and
/// never read: past the per-connection default of 8 each is refused as a
/// whole call with RESOURCE_EXHAUSTED, the sidecar's RSS grows by less than
/// 128 MiB (each unbounded stream buffered its whole object: ~300 MiB), and
/// another client is served normally meanwhile.
#[tokio::test(flavor = "multi_thread")]
async fn never_read_inline_get_streams_are_refused_past_the_per_connection_limit() {
    let (_dir, s, mut c, mut m) = one_sidecar(&[]).await;
    let big = pattern(1, 2 * MIB as usize);
    assert_eq!(store(&mut c, &mut m, "t", &[("big", big.clone())]).await, vec![OK]);
    // Warm up the inline path once (and check its bytes) before the baseline.
    assert_eq!(inline_get(&mut c, "big").await.as_deref(), Some(&big[..]));
    let pid = pid(&s);
    let before = rss(pid);

    let mut hog = non_reading_client(&s.socket).await;
    let (mut open, mut refused, mut other) = (vec![], 0usize, vec![]);
    for i in 0..150 {
        let call = hog.inline_get(proto::InlineGetRequest { key: key("big") });
        match tokio::time::timeout(Duration::from_secs(5), call).await {
            Err(_) => panic!("InlineGet {i} on the hog's connection got no answer within 5 s"),
            Ok(Ok(stream)) => open.push(stream),
            Ok(Err(e)) if e.code() == tonic::Code::ResourceExhausted => refused += 1,
            Ok(Err(e)) => other.push((i, e)),
        }
    }
    // Let the sidecar buffer whatever it will for the streams it took.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let grown = rss(pid).saturating_sub(before);
    let summary = format!(
        "{} streams open, {refused} refused, other errors {other:?}; sidecar RSS grew {} MiB",
        open.len(),
        grown >> 20
    );
    assert!(other.is_empty(), "{summary}");
    assert_eq!((open.len(), refused), (8, 142), "the per-connection limit (8) does not hold: {summary}");
    assert!(grown < 128 * MIB, "never-read streams cost too much memory: {summary}");

    // Another client, while the hog's streams are still open.
    let mut b = s.client().await;
    let served = tokio::time::timeout(Duration::from_secs(5), async {
        let got = inline_get(&mut b, "big").await;
        assert_eq!(got.as_deref(), Some(&big[..]), "another client's inline get: other bytes");
        let mut mb = PoolMap::open(&mut b).await;
        let small = pattern(2, 5000);
        assert_eq!(store(&mut b, &mut mb, "t", &[("small", small.clone())]).await, vec![OK]);
        let loc = lookup(&mut b, &["small"]).await.remove(0).expect("a hit");
        assert_eq!(mb.read(&loc), small);
    })
    .await;
    assert!(served.is_ok(), "another client was not served within 5 s: {summary}");
    drop(open);
}

// ---- (b) Connections that never send a request -----------------------------

/// With the defaults (max_connections 1024, handshake_timeout_ms 10000) and
/// an fd limit 48 descriptors above what the sidecar holds, 60 raw
/// connections on the Unix socket that never send a byte: the sidecar uses
/// little CPU over 5 s (no accept loop spinning on EMFILE), and a real client
/// is served within the handshake timeout and a few seconds.
#[tokio::test(flavor = "multi_thread")]
async fn idle_connections_past_the_fd_limit_neither_spin_nor_lock_clients_out_by_default() {
    let (_dir, s, mut c, mut m) = one_sidecar(&[]).await;
    let data = pattern(3, 100_000);
    assert_eq!(store(&mut c, &mut m, "t", &[("k", data.clone())]).await, vec![OK]);
    drop(c);
    let pid = pid(&s);
    let limit = limit_fds(pid, 48);

    let raw = flood_uds(&s.socket, 60);
    let spent = cpu_over_5s(pid);
    let served = client_served(&s.socket, "k", &data, DEFAULT_HANDSHAKE + SLACK).await;
    let spent = spent.await.unwrap();
    let what =
        format!("fd limit {limit}, {} raw connections: {spent:?} of CPU in 5 s, client served {served:?}", raw.len());
    assert!(spent < MAX_IDLE_CPU, "the sidecar spins: {what}");
    assert!(served.is_some(), "a real client was locked out: {what}");
    drop(raw);
}

/// `[server] max_connections = 32`, `handshake_timeout_ms = 1000`, and an fd
/// limit 64 descriptors above what the sidecar holds; 300 raw connections on
/// the Unix socket that never send a byte: those past 32 are refused (and
/// counted in cxlkv_connections_refused_total), the sidecar uses little CPU
/// over 5 s, and a real client is served within 1 s and a few seconds.
#[tokio::test(flavor = "multi_thread")]
async fn idle_connections_past_max_connections_are_shed_and_clients_served() {
    let dir = tempfile::tempdir().unwrap();
    let maddr = format!("127.0.0.1:{}", free_port());
    let toml = "[server]\nmax_connections = 32\nhandshake_timeout_ms = 1000\n";
    let s = Sidecar::with_config(dir.path(), "a", toml, &["--metrics-addr", &maddr]);
    let mut c = s.client().await;
    let mut m = PoolMap::open(&mut c).await;
    let data = pattern(4, 100_000);
    assert_eq!(store(&mut c, &mut m, "t", &[("k", data.clone())]).await, vec![OK]);
    drop(c);
    let pid = pid(&s);
    let limit = limit_fds(pid, 64);

    let raw = flood_uds(&s.socket, 300);
    let spent = cpu_over_5s(pid);
    let served = client_served(&s.socket, "k", &data, Duration::from_secs(1) + SLACK).await;
    let spent = spent.await.unwrap();
    let what =
        format!("fd limit {limit}, {} raw connections: {spent:?} of CPU in 5 s, client served {served:?}", raw.len());
    assert!(spent < MAX_IDLE_CPU, "the sidecar spins: {what}");
    assert!(served.is_some(), "a real client was locked out: {what}");
    let body = http_get(&maddr, "/metrics");
    let refused: f64 = body
        .lines()
        .filter(|l| l.starts_with("cxlkv_connections_refused_total{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum();
    assert!(refused >= 1.0, "no refused connection counted: {what}\n{body}");
    drop(raw);
}

/// Cluster timings as tests/cluster.rs uses them.
const TIMINGS: &str = "[cluster]\nheartbeat_ms = 100\nlease_ms = 600\ndead_after_ms = 1000\nforward_timeout_ms = 500\n";

/// Primary "a" of a new cluster on `peer`, with `server` (TOML of a `[server]`
/// table, or empty) added to the cluster timings.
fn primary(dir: &Path, peer: &str, server: &str) -> Sidecar {
    let toml = format!("{TIMINGS}{server}");
    Sidecar::with_config(
        dir,
        "a",
        &toml,
        &["--node-name", "a", "--primary", "a", "--pool-size", "16MiB", "--peer-addr", peer],
    )
}

/// Start follower "b" of the primary at `peer` and wait (bounded) until it
/// serves: how long that took, or None if not within `within`.
async fn follower_ready(dir: &Path, peer: &str, within: Duration) -> (Sidecar, Option<Duration>) {
    let cfg: PathBuf = dir.join("b.toml");
    std::fs::write(&cfg, TIMINGS).unwrap();
    let args = ["--config", cfg.to_str().unwrap(), "--node-name", "b", "--primary", "a", "--pool-size", "16MiB"];
    let mut b = Sidecar::start_unchecked(dir, "b", &[&args[..], &["--primary-addr", peer]].concat());
    let t = Instant::now();
    while t.elapsed() < within {
        if let Some(st) = b.child.as_mut().unwrap().try_wait().unwrap() {
            panic!("follower exited ({st}): {}", b.logs());
        }
        let socket = b.socket.clone();
        if tokio::task::spawn_blocking(move || ready(&socket)).await.unwrap() {
            return (b, Some(t.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (b, None)
}

/// The peer port of a primary with the defaults and an fd limit 48
/// descriptors above what it holds; 60 raw TCP connections that never send
/// a byte: the primary uses little CPU over 5 s, a follower started after
/// the flood joins and serves, and a client of the primary's socket is
/// served, each within the handshake timeout and a few seconds.
#[tokio::test(flavor = "multi_thread")]
async fn idle_peer_connections_past_the_fd_limit_neither_spin_nor_keep_a_follower_out_by_default() {
    peer_flood("", 5, 48, 60, DEFAULT_HANDSHAKE).await;
}

/// The peer port of a primary with `max_connections = 32`,
/// `handshake_timeout_ms = 1000` and an fd limit 64 descriptors above what it
/// holds; 300 raw TCP connections that never send a byte: the primary uses
/// little CPU over 5 s and a follower started after the flood joins and
/// serves within 1 s and a few seconds.
#[tokio::test(flavor = "multi_thread")]
async fn idle_peer_connections_past_max_connections_are_shed_and_a_follower_joins() {
    let toml = "[server]\nmax_connections = 32\nhandshake_timeout_ms = 1000\n";
    peer_flood(toml, 6, 64, 300, Duration::from_secs(1)).await;
}

/// A primary configured with `toml` holding one object (bytes `pattern(seed)`)
/// and an fd limit `headroom` descriptors above what it holds; `conns` raw
/// TCP connections to its peer port that never send a byte: the primary uses
/// little CPU over 5 s, a follower started after the flood joins and serves
/// the object, and a client of the primary's socket is served, each within
/// `handshake` and a few seconds.
async fn peer_flood(toml: &str, seed: u64, headroom: usize, conns: usize, handshake: Duration) {
    let dir = tempfile::tempdir().unwrap();
    let peer = format!("127.0.0.1:{}", free_port());
    let a = primary(dir.path(), &peer, toml);
    let mut c = a.client().await;
    let mut m = PoolMap::open(&mut c).await;
    let data = pattern(seed, 100_000);
    assert_eq!(store(&mut c, &mut m, "t", &[("k", data.clone())]).await, vec![OK]);
    drop(c);
    let pid = pid(&a);
    let limit = limit_fds(pid, headroom);

    let raw = flood_tcp(&peer, conns);
    let spent = cpu_over_5s(pid);
    let within = handshake + SLACK;
    let t = Instant::now();
    let (b, joined) = follower_ready(dir.path(), &peer, within).await;
    let served = client_served(&a.socket, "k", &data, within.saturating_sub(t.elapsed())).await;
    let spent = spent.await.unwrap();
    let what = format!(
        "fd limit {limit}, {} raw peer connections: {spent:?} of CPU in 5 s, follower ready after {joined:?}, \
         client of the primary served {served:?}",
        raw.len()
    );
    assert!(spent < MAX_IDLE_CPU, "the primary spins: {what}");
    assert!(joined.is_some(), "a follower could not join: {what}\n{}", b.logs());
    assert!(served.is_some(), "a client of the primary was locked out: {what}");
    // The follower serves the primary's key with its bytes.
    let mut cb = b.client().await;
    assert_eq!(inline_get(&mut cb, "k").await.as_deref(), Some(&data[..]));
    drop(raw);
}

// ---- (c) Pinning the pool -------------------------------------------------

/// Fill the pool with one-page objects "f0".."f127" (through a connection of
/// its own, then closed) and return their names and bytes.
async fn fill_pool(s: &Sidecar) -> Vec<(String, Vec<u8>)> {
    let mut f = s.client().await;
    let mut m = PoolMap::open(&mut f).await;
    let items: Vec<(String, Vec<u8>)> =
        (0..POOL_PAGES).map(|i| (format!("f{i}"), pattern(100 + i as u64, PAGE))).collect();
    let refs: Vec<(&str, Vec<u8>)> = items.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    // Two batches: one client may hold at most half the pool reserved.
    for half in refs.chunks(POOL_PAGES / 2) {
        assert_eq!(store(&mut f, &mut m, "f", half).await, vec![OK; half.len()]);
    }
    let st = stats(&mut f).await;
    assert_eq!((st.keys, st.pages_free), (POOL_PAGES as u64, 0), "the pool is full of one-page objects");
    items
}

/// Store `n` one-page objects through `b`, one call each, and read each back
/// through the mapping right away (a hit must have its own bytes; it may
/// already have been evicted); the per-item codes.
async fn store_each(b: &mut Client, mb: &mut PoolMap, prefix: &str, n: usize, pause: Duration) -> Vec<u32> {
    let mut codes = vec![];
    for i in 0..n {
        let k = format!("{prefix}{i}");
        let v = pattern(10_000 + i as u64, PAGE);
        let code = store(b, mb, "b", &[(&k, v.clone())]).await[0];
        codes.push(code);
        if code == OK {
            if let Some(loc) = lookup(b, &[&k]).await.remove(0) {
                assert_eq!(mb.read(&loc), v, "{k}: other bytes");
                assert_eq!(unlock(b, &[&k]).await, vec![OK]);
            }
        }
        tokio::time::sleep(pause).await;
    }
    codes
}

/// Look up every one of `items` (key, bytes) through `c` with the largest
/// lock TTL allowed (600 s): a key found has its bytes, one not found is
/// refused as over the client's limit (RESOURCE_EXHAUSTED). How many were
/// locked.
async fn lock_all_for_600s(c: &mut Client, m: &PoolMap, items: &[(String, Vec<u8>)]) -> usize {
    let rep = c
        .lookup_and_lock(proto::LookupRequest {
            keys: items.iter().map(|(k, _)| key(k)).collect(),
            lock_ttl_ms: 600_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut locked = 0;
    for ((k, v), r) in items.iter().zip(&rep.results) {
        if r.found {
            assert_eq!(m.read(r.location.as_ref().unwrap()), *v, "{k}: other bytes");
            locked += 1;
        } else {
            let code = r.status.as_ref().map(|s| s.code);
            assert_eq!(
                code,
                Some(RESOURCE_EXHAUSTED),
                "{k}: a present key neither locked nor refused as over the limit"
            );
        }
    }
    locked
}

/// Client A looks up every key of a full pool with the largest lock TTL
/// allowed (600 s) and stays connected: it gets at most half the pool's
/// region space locked (the default `max_client_pinned_bytes`), the keys
/// past that a per-key RESOURCE_EXHAUSTED (found = false), and client B's
/// 20 stores all succeed.
#[tokio::test(flavor = "multi_thread")]
async fn max_ttl_locks_on_every_key_leave_room_for_another_clients_stores() {
    let (_dir, s, mut a, ma) = one_sidecar(&[]).await;
    let items = fill_pool(&s).await;
    let locked = lock_all_for_600s(&mut a, &ma, &items).await;

    let mut b = s.client().await;
    let mut mb = PoolMap::open(&mut b).await;
    let codes = store_each(&mut b, &mut mb, "b", 20, Duration::ZERO).await;
    let failed = codes.iter().filter(|c| **c != OK).count();
    assert_eq!(
        failed, 0,
        "{failed} of 20 of B's stores failed while A holds {locked} of {POOL_PAGES} keys locked: {codes:?}"
    );
    assert!(
        locked > 0 && locked <= POOL_PAGES / 2,
        "A has {locked} one-page keys of {POOL_PAGES} locked: not within half the pool"
    );
    // A is still connected (its locks would end with its connection).
    assert!(stats(&mut a).await.locked_keys >= locked as u64);
}

/// Client A reserves all the pool's space and never commits; with a 500 ms
/// reservation timeout it keeps re-reserving everything every 50 ms for the
/// whole test, as its reservations expire. Client B's 80 one-page stores
/// (more than half the pool, so B also evicts its own) all succeed; A's
/// reserves get only per-item statuses (OK or RESOURCE_EXHAUSTED).
#[tokio::test(flavor = "multi_thread")]
async fn re_reserving_all_free_space_leaves_room_for_another_clients_stores() {
    let (_dir, s, mut a, _ma) = one_sidecar(&["--reservation-timeout-ms", "500"]).await;
    let reserve_all = |round: usize| proto::ReserveRequest {
        tenant: "a".into(),
        items: (0..POOL_PAGES)
            .map(|i| proto::ReserveItem { key: key(&format!("a{round}-{i}")), size: PAGE as u64, ..Default::default() })
            .collect(),
        ..Default::default()
    };
    let check = |round: usize, r: &proto::ReserveReply| -> usize {
        let codes: Vec<u32> = r.reservations.iter().map(|x| x.status.as_ref().unwrap().code).collect();
        assert!(codes.iter().all(|c| [OK, RESOURCE_EXHAUSTED].contains(c)), "A's round {round}: {codes:?}");
        codes.iter().filter(|c| **c == OK).count()
    };
    let first = a.reserve(reserve_all(0)).await.unwrap().into_inner();
    let first_ok = check(0, &first);

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hog = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut round = 1;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let r = a.reserve(reserve_all(round)).await.expect("a whole-call failure").into_inner();
                check(round, &r);
                round += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            round
        })
    };
    let mut b = s.client().await;
    let mut mb = PoolMap::open(&mut b).await;
    let codes = store_each(&mut b, &mut mb, "b", 80, Duration::from_millis(25)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let rounds = hog.await.unwrap();
    let failed = codes.iter().filter(|c| **c != OK).count();
    assert_eq!(
        failed, 0,
        "{failed} of 80 of B's stores failed while A re-reserved everything ({rounds} rounds; its first got \
         {first_ok} of {POOL_PAGES} pages): {codes:?}"
    );
    assert!(
        first_ok > 0 && first_ok <= POOL_PAGES / 2,
        "A's first reserve got {first_ok} of {POOL_PAGES} pages: not within half the pool"
    );
    // A's reserves past its bound evicted nothing for the items refused:
    // B keeps what A's half leaves it (its own stores evicted the rest).
    let kept = stats(&mut b).await.keys as usize;
    assert!(kept >= POOL_PAGES / 2 - 8, "B keeps {kept} of its 80 keys: A's refused reserves evicted them");
}

/// The same bound through a follower, whose clients' reads the primary
/// sees only as the follower's hold: client A of follower b stores 40
/// objects of 256 KiB (10 MiB of a 16 MiB pool) and locks all of them with
/// the largest TTL; at most half the pool (8 MiB) is locked for it, the rest
/// refused per key, and client B of the same follower then stores 28
/// objects (7 MiB) one by one, every one of them (without the bound A would
/// hold all 10 MiB and B would find room for 24 at most).
#[tokio::test(flavor = "multi_thread")]
async fn a_followers_client_cannot_pin_the_pool_through_its_holds() {
    const OBJ: usize = 256 << 10;
    let dir = tempfile::tempdir().unwrap();
    let peer = format!("127.0.0.1:{}", free_port());
    let _a = primary(dir.path(), &peer, "");
    let (b, up) = follower_ready(dir.path(), &peer, Duration::from_secs(10)).await;
    assert!(up.is_some(), "follower b did not come up: {}", b.logs());
    let (mut ca, mut cb) = (b.client().await, b.client().await);
    let (mut ma, mut mb) = (PoolMap::open(&mut ca).await, PoolMap::open(&mut cb).await);
    let items: Vec<(String, Vec<u8>)> = (0..40).map(|i| (format!("a{i}"), pattern(500 + i, OBJ))).collect();
    for half in items.chunks(20) {
        let refs: Vec<(&str, Vec<u8>)> = half.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        assert_eq!(store(&mut ca, &mut ma, "t", &refs).await, vec![OK; 20]);
    }
    let locked = lock_all_for_600s(&mut ca, &ma, &items).await;
    assert!(locked > 0 && locked <= 32, "A has {locked} of 40 objects of 256 KiB locked: not within half the pool");
    let mut failed = vec![];
    for i in 0..28u64 {
        let (k, v) = (format!("b{i}"), pattern(900 + i, OBJ));
        let code = store(&mut cb, &mut mb, "t", &[(&k, v.clone())]).await[0];
        if code != OK {
            failed.push((k, code));
        } else if let Some(loc) = lookup(&mut cb, &[&k]).await.remove(0) {
            assert_eq!(mb.read(&loc), v, "{k}: other bytes");
            unlock(&mut cb, &[&k]).await;
        }
    }
    assert!(failed.is_empty(), "B's stores failed while A holds {locked} objects locked: {failed:?}");
}
