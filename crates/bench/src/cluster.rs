//! `cxlkv-bench cluster`: what a cluster costs and gives, against sidecars
//! that scripts/bench.py starts on one pool file (a primary and two
//! followers). Each figure is a ratio of two things measured in the same
//! run, interleaved, so the VM's drift hits both sides alike:
//!
//! 1. LookupAndLock of 32 keys (all hits): p50 through a follower / p50 at
//!    the primary. The keys repeat (4 096 of them), so the follower holds
//!    them (`cluster.hold_idle_ms`) and answers itself; for reference, the
//!    same ratio for keys read through the follower for the first time,
//!    which it forwards to the primary over the peer service.
//! 2. Loading a hit: the copy out of the client's own mapping of the pool
//!    after the lookup, for objects another node stored (cross-node) vs
//!    objects the client's node stored (same-node). Both clients sit on
//!    followers, so their lookups take the same path; only where the bytes
//!    were written differs.
//! 3. Aggregate key-lookups/s with clients spread over the three nodes vs
//!    the same clients all on the primary. On one host the sidecars share
//!    its cores; with their process ids, also the same comparison per CPU
//!    second of the busiest sidecar: what the rates would be if each node
//!    had cores of its own and the busiest one were the limit. And how busy
//!    the clients and the busiest node kept the CPUs each may run on, with
//!    a verdict: were the clients the limit (then the rate is a floor of
//!    what the nodes serve, not a measure of it)?
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cxlkv::client::{connect_tcp, connect_uds, Client};
use cxlkv::proto;

use crate::data::{map_pool, touched, BATCH};
use crate::figures::{bench, label, pct};
use crate::lookups::{self, keys, pick, populate};

pub struct Args {
    pub primary: PathBuf,
    pub primary_tcp: Option<String>,
    pub followers: Vec<PathBuf>,
    pub iters: usize,
    pub object: usize,
    pub objects: usize,
    pub rounds: usize,
    pub clients: usize,
    pub seconds: f64,
    pub pids: Vec<u32>,
}

pub fn run(a: Args) {
    assert_eq!(a.followers.len(), 2, "two followers: one stores, the other loads across nodes");
    // Latency and loads from a current-thread client (as `control` measures
    // latency: no cross-thread hop per call); throughput from many client
    // tasks on a multi-thread runtime.
    let ct = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let ks = keys(4096);
    ct.block_on(async {
        let mut p = connect_uds(&a.primary).await.unwrap();
        populate(&mut p, &ks).await;
        lookup_latency(&mut p, a.primary_tcp.as_deref(), &a.followers[0], &ks, a.iters).await;
        first_lookups(&mut p, &a.followers[0], (a.iters / 10).clamp(20, 300)).await;
        loads(&mut p, &a.followers[0], &a.followers[1], a.object, a.objects, a.rounds).await;
    });
    let mt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    let all: Vec<PathBuf> = std::iter::once(a.primary.clone()).chain(a.followers.iter().cloned()).collect();
    mt.block_on(spread(&a.primary, &all, &ks, a.clients, a.seconds, a.rounds.min(3), &a.pids));
}

async fn lookup32(c: &mut Client, ks: &[Bytes], i: usize) -> f64 {
    lookups::timed(c, pick(ks, BATCH, i)).await
}

/// (1): the same calls, in turn at the primary and through a follower (and,
/// for reference, at the primary over TCP loopback: about what the hop a
/// follower adds costs, since it forwards over TCP).
async fn lookup_latency(p: &mut Client, tcp: Option<&str>, follower: &Path, ks: &[Bytes], iters: usize) {
    let mut f = connect_uds(follower).await.unwrap();
    let mut t = match tcp {
        Some(addr) => Some(connect_tcp(addr).await.unwrap()),
        None => None,
    };
    let mut us: [Vec<f64>; 3] = Default::default(); // primary, follower, primary over TCP
    for i in 0..iters + iters / 10 {
        // Rotate which goes first, so none always follows another.
        for k in 0..3 {
            let v = (i + k) % 3;
            let dt = match (v, t.as_mut()) {
                (0, _) => lookup32(p, ks, i).await,
                (1, _) => lookup32(&mut f, ks, i).await,
                (_, Some(t)) => lookup32(t, ks, i).await,
                (_, None) => continue,
            };
            if i >= iters / 10 {
                us[v].push(dt); // the first 10% warm up
            }
        }
    }
    let [mut at_p, mut at_f, mut at_t] = us;
    let (p50, f50) = (pct(&mut at_p, 0.5), pct(&mut at_f, 0.5));
    bench("cluster_lookup32_p50_us_primary", p50);
    bench("cluster_lookup32_p50_us_follower", f50);
    bench("cluster_lookup32_p99_us_primary", pct(&mut at_p, 0.99));
    bench("cluster_lookup32_p99_us_follower", pct(&mut at_f, 0.99));
    if !at_t.is_empty() {
        bench("cluster_lookup32_p50_us_primary_tcp", pct(&mut at_t, 0.5));
    }
    bench("cluster_follower_lookup_p50_ratio", f50 / p50);
}

/// (1), for keys no client read through the follower before: `calls`
/// lookups of 32 fresh keys each, at the primary and through the follower
/// in turn (each key read once, so the follower forwards every one).
async fn first_lookups(p: &mut Client, follower: &Path, calls: usize) {
    let fresh = |tag: &str| -> Vec<Bytes> {
        (0..calls * BATCH).map(|i| Bytes::from(format!("first-{tag}@{i:058x}"))).collect()
    };
    let (at_p, at_f) = (fresh("p"), fresh("f"));
    populate(p, &at_p).await;
    populate(p, &at_f).await;
    let mut f = connect_uds(follower).await.unwrap();
    let (mut us_p, mut us_f) = (vec![], vec![]);
    for i in 0..calls {
        let span = i * BATCH..(i + 1) * BATCH;
        us_p.push(lookup32(p, &at_p[span.clone()], 0).await);
        us_f.push(lookup32(&mut f, &at_f[span], 0).await);
    }
    let (p50, f50) = (pct(&mut us_p, 0.5), pct(&mut us_f, 0.5));
    bench("cluster_lookup32_p50_us_follower_first", f50);
    bench("cluster_follower_first_lookup_p50_ratio", f50 / p50);
}

/// One node's client: its connection, its own mapping of the pool.
struct Reader {
    c: Client,
    map: memmap2::MmapMut,
    info: proto::PoolInfoReply,
}

impl Reader {
    async fn open(socket: &Path) -> Self {
        let mut c = connect_uds(socket).await.unwrap();
        let info = c.pool_info(proto::PoolInfoRequest {}).await.unwrap().into_inner();
        let map = map_pool(&info);
        Self { c, map, info }
    }

    fn at(&self, l: &proto::Location) -> usize {
        (self.info.data_offset + l.region as u64 * self.info.region_size + l.offset) as usize
    }

    /// Store `names` through this node (reserve, copy into the mapping,
    /// commit); object `i`'s bytes are `touched(size, i)`.
    async fn store(&mut self, names: &[Bytes], size: usize) {
        for (n, chunk) in names.chunks(BATCH).enumerate() {
            let items = chunk
                .iter()
                .map(|k| proto::ReserveItem { key: k.clone(), size: size as u64, ..Default::default() })
                .collect();
            let req = proto::ReserveRequest { tenant: "bench".into(), items, ..Default::default() };
            let r = self.c.reserve(req).await.unwrap().into_inner();
            let mut ids = vec![];
            for (j, x) in r.reservations.iter().enumerate() {
                assert_eq!(x.status.as_ref().unwrap().code, 0, "reserve failed: {x:?}");
                let at = self.at(x.location.as_ref().unwrap());
                self.map[at..at + size].copy_from_slice(&touched(size, (n * BATCH + j) as u8));
                ids.push(x.reservation_id);
            }
            self.c.commit(proto::CommitRequest { reservation_ids: ids, crc32: vec![], keys: vec![] }).await.unwrap();
        }
    }

    /// Look up a batch, copy every object out of the mapping into `dst`,
    /// unlock. Returns (seconds copying, seconds from lookup to last byte)
    /// and the regions the objects were in.
    async fn load(&mut self, names: &[Bytes], dst: &mut [Vec<u8>]) -> (f64, f64, Vec<u32>) {
        let t = Instant::now();
        let req = proto::LookupRequest { keys: names.to_vec(), lock_ttl_ms: 10_000, ..Default::default() };
        let r = self.c.lookup_and_lock(req).await.unwrap().into_inner();
        let tc = Instant::now();
        let mut regions = Vec::with_capacity(names.len());
        for (x, d) in r.results.iter().zip(dst.iter_mut()) {
            assert!(x.found, "every object is a hit");
            let l = x.location.as_ref().unwrap();
            let (at, n) = (self.at(l), d.len());
            d.copy_from_slice(&self.map[at..at + n]);
            regions.push(l.region);
        }
        let (copy, total) = (tc.elapsed().as_secs_f64(), t.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
        self.c.unlock(proto::UnlockRequest { keys: names.to_vec() }).await.unwrap();
        (copy, total, regions)
    }
}

/// (2): objects stored through follower `b`, loaded by a client of `b`
/// (same-node) and a client of `c` (cross-node), batch by batch in turn.
async fn loads(p: &mut Client, b: &Path, c: &Path, object: usize, objects: usize, rounds: usize) {
    let (mut rb, mut rc) = (Reader::open(b).await, Reader::open(c).await);
    assert_eq!(rb.info.path, rc.info.path, "one pool");
    assert_ne!(rb.info.node_id, rc.info.node_id, "two nodes");
    let names: Vec<Bytes> = (0..objects).map(|i| Bytes::from(format!("cluster-load-{i}"))).collect();
    rb.store(&names, object).await;
    let batches: Vec<&[Bytes]> = names.chunks(BATCH).collect();
    let mut dst: Vec<Vec<u8>> = (0..BATCH).map(|_| touched(object, 0)).collect();
    // Every object is in b's regions, and c reads b's bytes.
    let owners: std::collections::HashMap<u32, u32> = p
        .stats(proto::StatsRequest {})
        .await
        .unwrap()
        .into_inner()
        .regions
        .into_iter()
        .map(|r| (r.region, r.owner_node))
        .collect();
    for (k, batch) in batches.iter().enumerate() {
        // Untimed: both mappings fault their pages in once.
        rb.load(batch, &mut dst).await;
        let (_, _, regions) = rc.load(batch, &mut dst).await;
        assert!(regions.iter().all(|r| owners[r] == rb.info.node_id), "the objects are in b's regions");
        for (j, d) in dst.iter().enumerate().take(batch.len()) {
            assert!(*d == touched(object, (k * BATCH + j) as u8), "c read the bytes b stored");
        }
    }
    // Each round loads two batches, one per client, alternating who goes
    // first; with more batches than the last-level cache holds, a batch is
    // read again only after the others have pushed it out, so both clients
    // copy from memory, not from a cache the other warmed.
    let (mut same, mut cross, mut same_e2e, mut cross_e2e) = (vec![], vec![], vec![], vec![]);
    let n = batches.len();
    for r in 0..rounds {
        let (x, y) = (batches[(2 * r) % n], batches[(2 * r + 1) % n]);
        let ((sc, st, _), (cc, ctot, _)) = if r % 2 == 0 {
            let s = rb.load(x, &mut dst).await;
            (s, rc.load(y, &mut dst).await)
        } else {
            let c = rc.load(x, &mut dst).await;
            (rb.load(y, &mut dst).await, c)
        };
        let bytes = (BATCH * object) as f64;
        same.push(bytes / sc);
        cross.push(bytes / cc);
        same_e2e.push(bytes / st);
        cross_e2e.push(bytes / ctot);
    }
    let lab = label(object);
    let (s, c) = (pct(&mut same, 0.5), pct(&mut cross, 0.5));
    let (se, ce) = (pct(&mut same_e2e, 0.5), pct(&mut cross_e2e, 0.5));
    bench(&format!("cluster_load_same_node_gbps_{lab}"), s / 1e9);
    bench(&format!("cluster_load_cross_node_gbps_{lab}"), c / 1e9);
    bench(&format!("cluster_load_cross_vs_same_{lab}"), c / s);
    bench(&format!("cluster_load_e2e_cross_vs_same_{lab}"), ce / se);
}

/// Key-lookups/s of `clients` tasks, one connection each, assigned to the
/// sockets in turn, for `secs`.
async fn rate(sockets: &[PathBuf], ks: &[Bytes], clients: usize, secs: f64) -> f64 {
    let mut conns = vec![];
    for w in 0..clients {
        conns.push(connect_uds(&sockets[w % sockets.len()]).await.unwrap());
    }
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let t = Instant::now();
    let tasks: Vec<_> = conns
        .into_iter()
        .enumerate()
        .map(|(w, mut c)| {
            let ks = ks.to_vec();
            tokio::spawn(async move { lookups::until(&mut c, &ks, BATCH, w * 1000, deadline).await })
        })
        .collect();
    let mut total = 0;
    for task in tasks {
        total += task.await.unwrap();
    }
    total as f64 / t.elapsed().as_secs_f64()
}

/// One layout's measurement: lookups/s, lookups per CPU second of the
/// busiest sidecar, the primary's share of the sidecars' CPU, how busy the
/// clients kept their CPUs and how busy the busiest sidecar kept its own
/// (CPU seconds over the window's seconds times the CPUs each may run on).
type Measured = [f64; 5];

/// (3): the same clients all on the primary, then spread over every node,
/// in alternating rounds; medians. With `pids`, also key-lookups per CPU
/// second of the busiest sidecar in each layout, and whether the clients
/// or the nodes were the limit: a rate the clients could not send more of
/// says nothing of what the nodes could serve.
#[allow(clippy::too_many_arguments)]
async fn spread(primary: &Path, all: &[PathBuf], ks: &[Bytes], clients: usize, secs: f64, rounds: usize, pids: &[u32]) {
    let one = [primary.to_owned()];
    let node_sets: Vec<Vec<usize>> = pids.iter().map(|&p| allowed(&p.to_string())).collect();
    let client_set = allowed("self");
    let node_cpus: Vec<f64> = node_sets.iter().map(|s| s.len().max(1) as f64).collect();
    let client_cpus = client_set.len().max(1) as f64;
    // Clients and nodes on the same CPUs: neither can be told to be the limit.
    let shared = node_sets.iter().any(|s| s.iter().any(|c| client_set.contains(c)));
    let measure = |at: &'static str| {
        let sockets: Vec<PathBuf> = if at == "one" { one.to_vec() } else { all.to_vec() };
        let node_cpus = &node_cpus;
        async move {
            let (before, own) = (cpu_seconds(pids), own_cpu_seconds());
            let t = Instant::now();
            let r = rate(&sockets, ks, clients, secs).await;
            let (wall, own) = (t.elapsed().as_secs_f64(), own_cpu_seconds() - own);
            let d: Vec<f64> = cpu_seconds(pids).iter().zip(&before).map(|(a, b)| a - b).collect();
            let busiest = d.iter().copied().fold(0.0, f64::max);
            let node_busy = d.iter().zip(node_cpus).map(|(s, n)| s / (wall * n)).fold(0.0, f64::max);
            let share = d.first().copied().unwrap_or(0.0) / d.iter().sum::<f64>();
            [r, r * secs / busiest, share, own / (wall * client_cpus), node_busy] as Measured
        }
    };
    let (mut on_one, mut on_all) = (vec![], vec![]);
    for r in 0..rounds.max(1) {
        if r % 2 == 0 {
            on_one.push(measure("one").await);
            on_all.push(measure("all").await);
        } else {
            on_all.push(measure("all").await);
            on_one.push(measure("one").await);
        }
    }
    let med = |v: &[Measured], i: usize| pct(&mut v.iter().map(|x| x[i]).collect::<Vec<_>>(), 0.5);
    let (o, a) = (med(&on_one, 0), med(&on_all, 0));
    bench("cluster_key_lookups_per_s_one_node", o);
    bench(&format!("cluster_key_lookups_per_s_{}_nodes", all.len()), a);
    bench("cluster_spread_lookup_rate_ratio", a / o);
    bench("cluster_spread_clients", clients as f64);
    bench("cluster_spread_client_cpus", client_cpus);
    if pids.len() == all.len() {
        let (o, a) = (med(&on_one, 1), med(&on_all, 1));
        bench("cluster_key_lookups_per_busiest_cpu_s_one_node", o);
        bench("cluster_spread_busiest_cpu_ratio", a / o);
        bench("cluster_spread_primary_cpu_share", med(&on_all, 2));
        let (clients_one, clients_all) = (med(&on_one, 3), med(&on_all, 3));
        let (node_one, node_all) = (med(&on_one, 4), med(&on_all, 4));
        bench("cluster_client_cpu_busy_one_node", clients_one);
        bench(&format!("cluster_client_cpu_busy_{}_nodes", all.len()), clients_all);
        bench("cluster_node_cpu_busy_one_node", node_one);
        bench(&format!("cluster_busiest_node_cpu_busy_{}_nodes", all.len()), node_all);
        // The spread's rate measures the nodes only when its clients had
        // CPU to spare; 1 = the clients were the limit (their CPUs busy
        // while the busiest node's were not), and the ratio a floor. Not
        // told when clients and nodes share CPUs (scripts/bench.sh).
        bench("cluster_spread_shared_cpus", shared as u8 as f64);
        if !shared {
            let clients_bound = clients_all >= CPU_BOUND && node_all < CPU_BOUND;
            bench("cluster_spread_client_bound", clients_bound as u8 as f64);
        }
    }
}

/// A CPU budget this busy is taken to be the limit.
const CPU_BOUND: f64 = 0.85;

/// CPUs process `pid` ("self" for this one) may run on: its
/// `Cpus_allowed_list` (empty when unreadable).
fn allowed(pid: &str) -> Vec<usize> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    cpu_list(status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap_or(""))
}

/// The CPUs of a list such as `0-3,8,10-11`.
fn cpu_list(list: &str) -> Vec<usize> {
    let range = |r: &str| -> std::ops::RangeInclusive<usize> {
        let (a, b) = r.split_once('-').unwrap_or((r, r));
        a.parse().unwrap_or(1)..=b.parse().unwrap_or(0)
    };
    list.trim().split(',').flat_map(range).collect()
}

/// CPU seconds this process (every thread of the bench's clients) has used.
fn own_cpu_seconds() -> f64 {
    cpu_seconds_of("self")
}

/// CPU seconds (user + system) each process has used so far.
fn cpu_seconds(pids: &[u32]) -> Vec<f64> {
    pids.iter().map(|p| cpu_seconds_of(&p.to_string())).collect()
}

fn cpu_seconds_of(pid: &str) -> f64 {
    // /proc reports clock ticks of USER_HZ, which the kernel's ABI fixes at 100.
    const TICKS: f64 = 100.0;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces): utime and stime
    // are the 12th and 13th.
    let rest = stat.rsplit_once(") ").map_or("", |x| x.1);
    let f: Vec<f64> = rest.split(' ').skip(11).take(2).filter_map(|x| x.parse().ok()).collect();
    f.iter().sum::<f64>() / TICKS
}

#[cfg(test)]
mod tests {
    #[test]
    fn cpu_lists_are_read_as_the_kernel_writes_them() {
        assert_eq!(super::cpu_list("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(super::cpu_list("5"), vec![5]);
        assert!(super::cpu_list("").is_empty());
        assert!(!super::allowed("self").is_empty(), "this process may run somewhere");
    }
}
