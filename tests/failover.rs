//! Primary failover through a real etcd (Debian's `etcd-server`, started
//! here on loopback ports): three sidecars on one pool campaign; the
//! primary is killed (-9), then the next one is stopped (SIGSTOP); each time
//! another node takes over within the lease + 2 s, rebuilds the registry
//! from the pool, and every chunk committed before is readable with the
//! same bytes; the stopped one, resumed, is refused by epoch and follows.
mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use cxlkv::client::{connect_uds, Client};
use cxlkv::proto;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

const ETCD: &str = "/usr/bin/etcd";
/// etcd's lease: 2 s (its floor); the local lease lapses after 2/3 of it.
const LEASE: Duration = Duration::from_secs(2);

struct Etcd(Child);

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn etcd(dir: &Path) -> (Etcd, String) {
    assert!(Path::new(ETCD).exists(), "{ETCD} is missing: install Debian's etcd-server (see the README's setup)");
    let (client, peer) = (free_port(), free_port());
    let url = |p: u16| format!("http://127.0.0.1:{p}");
    let log = std::fs::File::create(dir.join("etcd.log")).unwrap();
    let child = Command::new(ETCD)
        .args(["--name", "t", "--data-dir", dir.join("etcd").to_str().unwrap()])
        .args(["--listen-client-urls", &url(client), "--advertise-client-urls", &url(client)])
        .args(["--listen-peer-urls", &url(peer), "--initial-advertise-peer-urls", &url(peer)])
        .args(["--initial-cluster", &format!("t={}", url(peer)), "--log-level", "warn"])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let e = Etcd(child);
    let t = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", client)).is_err() {
        assert!(t.elapsed() < Duration::from_secs(20), "etcd did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    (e, format!("127.0.0.1:{client}"))
}

fn node(dir: &Path, name: &str, endpoint: &str) -> Sidecar {
    let cfg = dir.join(format!("{name}.toml"));
    let peer = format!("127.0.0.1:{}", free_port());
    std::fs::write(dir.join(format!("{name}.peer")), &peer).unwrap();
    std::fs::write(
        &cfg,
        format!(
            "[cluster]\nelection = \"etcd\"\netcd_endpoints = [\"{endpoint}\"]\nheartbeat_ms = 100\n\
             lease_ms = 2000\ndead_after_ms = 3000\nforward_timeout_ms = 1000\n"
        ),
    )
    .unwrap();
    let args = ["--config", cfg.to_str().unwrap(), "--node-name", name, "--peer-addr", &peer, "--pool-size", "16MiB"];
    Sidecar::start(dir, name, &args)
}

/// A peer call to `name`'s peer service stamped with `epoch`, as a
/// follower of that epoch makes it.
async fn peer_stats(dir: &Path, name: &str, epoch: u64) -> Result<(), tonic::Status> {
    use cxlkv::peer_proto::{peer_client::PeerClient, NodesRequest};
    let addr = std::fs::read_to_string(dir.join(format!("{name}.peer"))).unwrap();
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    let stamp = cxlkv::cluster::epoch::Stamp::new(cxlkv::auth::BearerToken::default(), epoch);
    PeerClient::with_interceptor(ch, stamp).nodes(NodesRequest::default()).await.map(|_| ())
}

fn pid(s: &Sidecar) -> Pid {
    Pid::from_raw(s.child.as_ref().unwrap().id() as i32)
}

/// A fresh client (a node's socket is bound anew every term), if it answers.
async fn try_client(s: &Sidecar) -> Option<Client> {
    tokio::time::timeout(Duration::from_millis(500), connect_uds(&s.socket)).await.ok()?.ok()
}

async fn role(s: &Sidecar) -> Option<(String, u64)> {
    let mut c = try_client(s).await?;
    let st = tokio::time::timeout(Duration::from_millis(500), c.stats(proto::StatsRequest {})).await.ok()?.ok()?;
    let st = st.into_inner();
    Some((st.cluster_role, st.epoch))
}

/// Every key found through `s` with its own bytes (None: not yet).
async fn all_readable(s: &Sidecar, keys: &[(String, Vec<u8>)], m: &PoolMap) -> Option<()> {
    let mut c = try_client(s).await?;
    let names: Vec<&str> = keys.iter().map(|(k, _)| k.as_str()).collect();
    let req = proto::LookupRequest { keys: names.iter().map(|k| key(k)).collect(), ..Default::default() };
    let rep = tokio::time::timeout(Duration::from_secs(2), c.lookup_and_lock(req)).await.ok()?.ok()?.into_inner();
    for (r, (k, v)) in rep.results.iter().zip(keys) {
        let l = r.location.as_ref().filter(|_| r.found)?;
        assert_eq!(&m.read(l), v, "{k}: wrong bytes after failover");
    }
    unlock(&mut c, &names).await;
    Some(())
}

#[tokio::test(flavor = "multi_thread")]
async fn another_node_takes_over_a_killed_or_stopped_primary_and_every_committed_chunk_stays_readable() {
    let dir = tempfile::tempdir().unwrap();
    let (_etcd, endpoint) = etcd(dir.path());
    // The first node formats the pool and wins the first election.
    let nodes = [node(dir.path(), "a", &endpoint), node(dir.path(), "b", &endpoint), node(dir.path(), "c", &endpoint)];
    let primary =
        |roles: &[Option<(String, u64)>]| roles.iter().position(|r| r.as_ref().is_some_and(|r| r.0 == "primary"));
    let mut roles = vec![];
    eventually("one primary, two followers", Duration::from_secs(20), async || {
        roles = vec![role(&nodes[0]).await, role(&nodes[1]).await, role(&nodes[2]).await];
        roles.iter().filter(|r| r.as_ref().is_some_and(|r| r.0 == "follower")).count() == 2 && primary(&roles).is_some()
    })
    .await;
    let first = primary(&roles).unwrap();
    let epoch1 = roles[first].as_ref().unwrap().1;
    assert!(epoch1 > 0, "an etcd epoch is a revision: {roles:?}");

    // Chunks stored through both followers (the primary's own regions too).
    // The pool's geometry never changes: one mapping serves every check.
    let pool = PoolMap::open(&mut nodes[0].client().await).await;
    let mut stored: Vec<(String, Vec<u8>)> = vec![];
    for (i, n) in nodes.iter().enumerate() {
        let mut c = n.client().await;
        let mut m = PoolMap::open(&mut c).await;
        for j in 0..6u64 {
            let k = format!("k{i}-{j}");
            let v = pattern(i as u64 * 100 + j, 100_000);
            assert_eq!(store(&mut c, &mut m, "t", &[(&k, v.clone())]).await, [OK], "{k}");
            stored.push((k, v));
        }
    }

    // kill -9 of the primary: a survivor leads within lease + 2 s.
    let mut nodes = nodes.map(Some);
    let dead = nodes[first].as_mut().unwrap();
    kill(pid(dead), Signal::SIGKILL).unwrap();
    let t = Instant::now();
    let survivors: Vec<usize> = (0..3).filter(|&i| i != first).collect();
    let probe = survivors[0];
    // Meanwhile a client of a survivor never waits past its deadline.
    let mut c = nodes[probe].as_ref().unwrap().client().await;
    let t0 = Instant::now();
    let _ =
        tokio::time::timeout(Duration::from_secs(5), c.exists(proto::ExistsRequest { keys: vec![key("k0-0")] })).await;
    assert!(t0.elapsed() < Duration::from_millis(1500), "a call during the outage took {:?}", t0.elapsed());
    let took = eventually("a survivor serves every chunk", LEASE + Duration::from_secs(2), async || {
        all_readable(nodes[probe].as_ref().unwrap(), &stored, &pool).await.is_some()
    })
    .await;
    let t_total = t.elapsed();
    eprintln!("FAILOVER kill -9: first full read through a survivor {took:?} after the kill ({t_total:?})");
    let mut roles2 = vec![];
    eventually("a new primary of a later epoch", Duration::from_secs(10), async || {
        roles2 = vec![];
        for &i in &survivors {
            roles2.push(role(nodes[i].as_ref().unwrap()).await);
        }
        primary(&roles2).is_some_and(|p| roles2[p].as_ref().unwrap().1 > epoch1)
    })
    .await;
    let second = survivors[primary(&roles2).unwrap()];
    let other = survivors.iter().copied().find(|&i| i != second).unwrap();
    eventually("the other survivor follows the new primary", Duration::from_secs(10), async || {
        all_readable(nodes[other].as_ref().unwrap(), &stored, &pool).await.is_some()
    })
    .await;

    // SIGSTOP of the new primary: the last node takes over.
    let stopped = pid(nodes[second].as_ref().unwrap());
    sigstop(stopped.as_raw() as u32);
    let took = eventually("the last node serves every chunk as primary", LEASE + Duration::from_secs(2), async || {
        role(nodes[other].as_ref().unwrap()).await.is_some_and(|r| r.0 == "primary")
            && all_readable(nodes[other].as_ref().unwrap(), &stored, &pool).await.is_some()
    })
    .await;
    eprintln!("FAILOVER SIGSTOP: the next primary served every chunk {took:?} after the stop");
    let epoch3 = role(nodes[other].as_ref().unwrap()).await.unwrap().1;

    // Resumed, the old primary finds its lease gone and a later epoch in
    // the pool: it stands down and follows; the pool keeps the latest epoch.
    kill(stopped, Signal::SIGCONT).unwrap();
    eventually("the resumed node follows", Duration::from_secs(10), async || {
        role(nodes[second].as_ref().unwrap()).await.is_some_and(|r| r.0 == "follower" && r.1 == epoch3)
    })
    .await;
    eventually("the resumed node serves every chunk", Duration::from_secs(10), async || {
        all_readable(nodes[second].as_ref().unwrap(), &stored, &pool).await.is_some()
    })
    .await;
    let log = nodes[second].as_ref().unwrap().logs();
    assert!(log.contains("standing down") || log.contains("stands down"), "{log}");

    // The epoch travels on peer calls: the primary serves its own epoch
    // and refuses a caller that still follows an earlier one.
    let last = ["a", "b", "c"][other];
    peer_stats(dir.path(), last, epoch3).await.expect("a call of the primary's own epoch is served");
    let stale = peer_stats(dir.path(), last, epoch1).await.unwrap_err();
    assert_eq!(stale.code(), tonic::Code::FailedPrecondition, "{stale:?}");
    assert!(stale.message().contains(&format!("leads epoch {epoch3}")), "{stale:?}");
    drop(nodes[first].take());
}
