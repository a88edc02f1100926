//! Issue 33, defect 5: the primary's peer port takes node credentials only.
//! A tenant-bound token (`TOKEN alice` in the tokens file) is refused with
//! PERMISSION_DENIED on every peer RPC and changes nothing; a follower that
//! presents one is refused and logs the primary's reason; junk entries in
//! the pool's 48-entry node table (nodes that are not alive and own no
//! region) never keep a real follower out after a primary restart.
mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use cxlkv::peer_proto::{self as pp, peer_client::PeerClient};
use cxlkv::proto;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::transport::{Channel, Endpoint};
use tonic::Code;

const OPERATOR: &str = "op-0123456789abcdef";
const ALICE: &str = "alice-0123456789abcdef";

/// A peer-service caller's credentials: its bearer token and epoch 0 (a
/// static cluster), as a follower stamps every peer call.
#[derive(Clone)]
struct Creds(MetadataValue<Ascii>);

impl Interceptor for Creds {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        req.metadata_mut().insert("authorization", self.0.clone());
        req.metadata_mut().insert("x-cxlkv-epoch", MetadataValue::from_static("0"));
        Ok(req)
    }
}

type Peer = PeerClient<InterceptedService<Channel, Creds>>;

async fn peer(addr: &str, token: &str) -> Peer {
    let ch = Endpoint::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    PeerClient::with_interceptor(ch, Creds(format!("Bearer {token}").parse().unwrap()))
}

/// A node's join request, as a follower sends it: with its reservation
/// timeout (the default, 10 s) as field 5 `reservation_timeout_ms` where the
/// proto has that field (decoded from the wire form: a proto without it
/// skips the field), so the request is the same before and after it exists.
fn join_req(name: &str, instance: u64, pool_uuid: &str) -> pp::JoinRequest {
    use prost::Message;
    let base = pp::JoinRequest { name: name.into(), instance, pool_uuid: pool_uuid.into(), ..Default::default() };
    let mut wire = base.encode_to_vec();
    wire.extend([5 << 3, 0x90, 0x4e]); // field 5, varint 10000
    pp::JoinRequest::decode(&wire[..]).unwrap()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// A config with the tokens file (operator and alice) and `token` as the
/// follower's own credential for the peer port.
fn config(dir: &Path, name: &str, token: &str) -> String {
    let tokens = write(dir, "tokens", &format!("{OPERATOR} *\n{ALICE} alice\n"));
    let own = write(dir, &format!("{name}.token"), &format!("{token}\n"));
    let text = format!(
        "[auth]\ntokens_file = {:?}\n[cluster]\ntoken_file = {:?}\nheartbeat_ms = 100\nlease_ms = 1500\n\
         dead_after_ms = 3000\nforward_timeout_ms = 2000\n",
        tokens.display().to_string(),
        own.display().to_string()
    );
    write(dir, name, &text).display().to_string()
}

/// The arguments of cluster node `name` (a is the primary, on `peer`).
fn args(cfg: &str, name: &str, peer: &str) -> Vec<String> {
    let mut a: Vec<String> =
        ["--config", cfg, "--node-name", name, "--primary", "a", "--pool-size", "16MiB"].map(String::from).into();
    a.extend([if name == "a" { "--peer-addr" } else { "--primary-addr" }.to_string(), peer.to_string()]);
    a
}

fn start(dir: &Path, cfg: &str, name: &str, peer: &str) -> Sidecar {
    let a = args(cfg, name, peer);
    Sidecar::start(dir, name, &a.iter().map(String::as_str).collect::<Vec<_>>())
}

fn start_unchecked(dir: &Path, cfg: &str, name: &str, peer: &str) -> Sidecar {
    let a = args(cfg, name, peer);
    Sidecar::start_unchecked(dir, name, &a.iter().map(String::as_str).collect::<Vec<_>>())
}

/// What the primary's client API shows of the cluster: node names and ids,
/// the region table, the key count.
async fn snapshot(c: &mut cxlkv::client::Client) -> (Vec<(String, u32)>, Vec<(u32, String, u32, u64)>, u64) {
    let s = stats(c).await;
    let mut nodes: Vec<(String, u32)> = s.cluster_nodes.iter().map(|n| (n.name.clone(), n.node)).collect();
    nodes.sort();
    let regions = s.regions.iter().map(|r| (r.region, r.state.clone(), r.owner_node, r.generation)).collect();
    (nodes, regions, s.keys)
}

fn code<T>(r: &Result<tonic::Response<T>, tonic::Status>) -> Code {
    r.as_ref().map_or_else(|s| s.code(), |_| Code::Ok)
}

/// Every peer RPC made with tenant alice's token is refused with
/// PERMISSION_DENIED, and none of them changes anything: no node joins, no
/// region moves, bob's keys stay with their bytes, nothing is removed.
#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_token_is_refused_on_every_peer_rpc_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "node.toml", OPERATOR);
    let peer_addr = format!("127.0.0.1:{}", free_port());
    let a = start(dir.path(), &cfg, "a", &peer_addr);
    let b = start(dir.path(), &cfg, "b", &peer_addr);
    let c = start(dir.path(), &cfg, "c", &peer_addr);
    let (mut ca, mut cb, mut cc) = (a.client().await, b.client().await, c.client().await);
    let (mut mb, mc) = (PoolMap::open(&mut cb).await, PoolMap::open(&mut cc).await);
    let bobs: Vec<(String, Vec<u8>)> = (0..3u64).map(|i| (format!("bob{i}"), pattern(500 + i, 40_000))).collect();
    for (k, v) in &bobs {
        assert_eq!(store(&mut cb, &mut mb, "bob", &[(k, v.clone())]).await, [OK], "{k}");
    }
    let uuid = pool_info(&mut ca).await.pool_uuid;
    let nb = pool_info(&mut cb).await.node_id;
    let before = snapshot(&mut ca).await;
    let removed_before = ca.removed(proto::RemovedRequest { since: 0, max: 0 }).await.unwrap().into_inner().keys.len();

    // The operator's token works on the peer port (the client is right).
    let mut op = peer(&peer_addr, OPERATOR).await;
    let st = op.nodes(pp::NodesRequest::default()).await.expect("the operator's token on the peer port").into_inner();
    assert_eq!(st.nodes.len(), 3, "{:?}", st.nodes);

    let mut alice = peer(&peer_addr, ALICE).await;
    let join = alice.join(join_req("mallory", 0x77, &uuid)).await;
    // Had the join been taken, the rest acts as the node it made.
    let (node, instance) = join.as_ref().map_or((nb, 1), |r| (r.get_ref().node, 0x77));
    let heartbeat = alice.heartbeat(pp::HeartbeatRequest { node, instance, ..Default::default() }).await;
    let claim = alice.claim_region(pp::ClaimRegionRequest { node, instance, ..Default::default() }).await;
    let owner = ((node as u64) << 40) | 1;
    let bob0 = || pp::Keys { keys: vec![key("bob0")] };
    let ops = vec![
        pp::Op { owner, op: Some(pp::op::Op::Delete(bob0())), ..Default::default() },
        pp::Op { owner, op: Some(pp::op::Op::Exists(bob0())), ..Default::default() },
        pp::Op {
            owner,
            op: Some(pp::op::Op::Lookup(pp::Lookup { keys: vec![key("bob1")], ..Default::default() })),
            ..Default::default()
        },
    ];
    let batch = alice.batch(pp::BatchRequest { node, instance, ops, ..Default::default() }).await;
    // Listings, figures and the removal log are ops of a batch too.
    let reads = vec![
        pp::Op {
            owner,
            op: Some(pp::op::Op::List(pp::ListKeys { limit: 100, all_tenants: true, ..Default::default() })),
            ..Default::default()
        },
        pp::Op { owner, op: Some(pp::op::Op::Stats(pp::StatsRequest::default())), ..Default::default() },
        pp::Op { owner, op: Some(pp::op::Op::Removed(pp::RemovedRequest::default())), ..Default::default() },
    ];
    let list = alice.batch(pp::BatchRequest { node, instance, ops: reads, ..Default::default() }).await;
    let nodes = alice.nodes(pp::NodesRequest::default()).await;
    let got = vec![
        ("Join", code(&join)),
        ("Heartbeat", code(&heartbeat)),
        ("ClaimRegion", code(&claim)),
        ("Batch", code(&batch)),
        ("Batch of List, Stats, Removed", code(&list)),
        ("Nodes", code(&nodes)),
    ];
    let want: Vec<(&str, Code)> = got.iter().map(|(rpc, _)| (*rpc, Code::PermissionDenied)).collect();
    assert_eq!(got, want, "peer RPCs with tenant alice's token (List returned {:?})", list.map(|l| l.into_inner()));

    // Nothing changed.
    assert_eq!(snapshot(&mut ca).await, before, "nodes, regions or keys changed");
    let removed_after = ca.removed(proto::RemovedRequest { since: 0, max: 0 }).await.unwrap().into_inner().keys.len();
    assert_eq!(removed_after, removed_before, "something was removed");
    for (k, v) in &bobs {
        let hit = lookup(&mut cc, &[k]).await.remove(0).unwrap_or_else(|| panic!("{k} is gone"));
        assert_eq!(&mc.read(&hit), v, "{k} through c");
        assert_eq!(mc.version(&hit), hit.version, "{k}");
        assert_eq!(inline_get(&mut ca, k).await.as_ref(), Some(v), "{k} through a");
    }
}

/// A follower whose cluster credential is a tenant's token is refused: it
/// never becomes ready, and its log gives the primary's reason (the
/// refusal's message), not "did not answer".
#[tokio::test(flavor = "multi_thread")]
async fn a_follower_presenting_a_tenant_token_is_refused_and_logs_the_primarys_reason() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "node.toml", OPERATOR);
    let tenant_cfg = config(dir.path(), "tenant.toml", ALICE);
    let peer_addr = format!("127.0.0.1:{}", free_port());
    let a = start(dir.path(), &cfg, "a", &peer_addr);
    let mut ca = a.client().await;
    let uuid = pool_info(&mut ca).await.pool_uuid;

    let d = start_unchecked(dir.path(), &tenant_cfg, "d", &peer_addr);
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(3) {
        assert!(!ready(&d.socket), "a follower presenting tenant alice's token joined and serves:\n{}", d.logs());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!stats(&mut ca).await.cluster_nodes.iter().any(|n| n.name == "d"), "d is in the cluster");

    // The refusal d got, as the primary words it.
    let mut alice = peer(&peer_addr, ALICE).await;
    let refusal = alice.join(join_req("d", 5, &uuid)).await.expect_err("a join with a tenant's token");
    assert_eq!(refusal.code(), Code::PermissionDenied, "{refusal:?}");
    let reason = refusal.message().to_owned();
    assert!(!reason.is_empty());
    // The refusal's message, or at least what it is (permission denied).
    eventually(&format!("d logs the primary's reason ({reason:?})"), Duration::from_secs(5), async || {
        let log = d.logs();
        log.contains(&reason) || log.to_lowercase().contains("permission")
    })
    .await;
    assert!(!d.logs().contains("did not answer"), "the primary answered; d says it did not:\n{}", d.logs());
    assert!(!ready(&d.socket));
}

/// 48 junk joins (with the operator's token) fill the pool's node table;
/// after a primary restart none of those nodes is alive and none owns a
/// region, so a real follower still joins (reusing an entry) and serves.
#[tokio::test(flavor = "multi_thread")]
async fn junk_entries_of_a_full_node_table_do_not_keep_a_follower_out_after_a_primary_restart() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "node.toml", OPERATOR);
    let peer_addr = format!("127.0.0.1:{}", free_port());
    let mut a = start(dir.path(), &cfg, "a", &peer_addr);
    let mut ca = a.client().await;
    let uuid = pool_info(&mut ca).await.pool_uuid;
    let mut op = peer(&peer_addr, OPERATOR).await;
    let mut joined = 0;
    for i in 0..48u64 {
        let r = op.join(join_req(&format!("junk{i}"), i + 1, &uuid)).await;
        joined += r.is_ok() as usize;
    }
    // With the primary's own entry the table (48 entries) is full.
    assert!(joined >= 47, "only {joined} junk joins were taken: the table is not full");
    drop((op, ca));

    let (st, _) = a.stop();
    assert!(st.success(), "the primary's shutdown: {st}");
    a.spawn(&args(&cfg, "a", &peer_addr).iter().map(String::as_str).collect::<Vec<_>>());
    let mut b = start_unchecked(dir.path(), &cfg, "b", &peer_addr);
    // A real follower joins a table full of dead junk entries.
    b.wait_ready(Duration::from_secs(10));
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    let (ma, mut mb) = (PoolMap::open(&mut ca).await, PoolMap::open(&mut cb).await);
    let v = pattern(3, 50_000);
    assert_eq!(store(&mut cb, &mut mb, "t", &[("real", v.clone())]).await, [OK]);
    let hit = lookup(&mut ca, &["real"]).await.remove(0).expect("b's key through a");
    assert_eq!(ma.read(&hit), v);
    let nodes = stats(&mut ca).await.cluster_nodes;
    assert!(nodes.iter().any(|n| n.name == "b" && n.alive), "{nodes:?}");
}
