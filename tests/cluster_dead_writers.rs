//! Issue 33, defects 1 and 6: writers of a node that stops answering.
//!
//! Three sidecar processes on one pool (a the primary, b and c followers).
//! A node declared dead still has clients that hold the pool mapped and a
//! reservation's time left to write: its region must not go to another node
//! before every reservation open in it has passed its deadline, and the node
//! itself, when it resumes, must never write into a region it lost. And a
//! reservation a follower's sidecar made for an inline put must end at the
//! primary even when the put's commit and abort could not reach it.
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use cxlkv::client::Client;
use cxlkv::proto;
use tokio::sync::mpsc;

/// Short cluster timings (a node is dead 1 s after its last heartbeat);
/// reservations last 4 s, so a dead node's client has ~3 s left to write.
/// One client here locks a whole region of a 6 MiB pool and more (to make
/// the next store need another node's region): past the default bound of
/// half the pool per client, so the bound is the pool.
const DEAD: &str = "[cluster]\nheartbeat_ms = 100\nlease_ms = 600\ndead_after_ms = 1000\nforward_timeout_ms = 1000\n\
                    [registry]\nreservation_timeout_ms = 4000\nmax_client_pinned_bytes = \"6MiB\"\n";
const RESERVATION_MS: u64 = 4000;
/// Four 64 KiB pages: eight fill a 2 MiB region.
const OBJ: usize = 256 << 10;
const SETTLE: Duration = Duration::from_secs(20);

/// A node of a cluster on a pool of `pool_size` whose config file is `cfg`.
fn node(dir: &Path, name: &str, peer: &str, cfg: &str, pool_size: &str) -> Sidecar {
    Sidecar::start(dir, name, &strs(&cluster_args(dir, name, peer, cfg, pool_size)))
}

/// region → owner node id (None: free), as the primary's Stats shows it.
async fn owners(c: &mut Client) -> Vec<Option<u32>> {
    stats(c).await.regions.iter().map(|r| (r.state == "owned").then_some(r.owner_node)).collect()
}

async fn node_id(c: &mut Client, name: &str) -> u32 {
    stats(c).await.cluster_nodes.iter().find(|n| n.name == name).unwrap().node
}

async fn alive(c: &mut Client, name: &str) -> bool {
    stats(c).await.cluster_nodes.iter().any(|n| n.name == name && n.alive)
}

/// Three regions, one per node; a's holds a lock (never a victim of phase 3)
/// and c's is full of entries c's client keeps locked, so c's next store
/// needs b's region. Returns the three nodes, a client of each and the
/// pool mapped, and the keys stored so far with their bytes.
async fn three_full_regions(
    dir: &Path,
) -> ((Sidecar, Sidecar, Sidecar), (Client, Client, Client), PoolMap, Vec<(String, Vec<u8>)>) {
    let peer = format!("127.0.0.1:{}", free_port());
    let a = node(dir, "a", &peer, DEAD, "6MiB");
    let b = node(dir, "b", &peer, DEAD, "6MiB");
    let c = node(dir, "c", &peer, DEAD, "6MiB");
    let (mut ca, cb, mut cc) = (a.client().await, b.client().await, c.client().await);
    let mut m = PoolMap::open(&mut ca).await;
    eventually("every region is owned", SETTLE, async || owners(&mut ca).await.iter().all(Option::is_some)).await;
    assert_eq!(owners(&mut ca).await.len(), 3, "the test wants three regions");
    let mut stored = vec![("a0".to_string(), pattern(900, OBJ))];
    assert_eq!(store(&mut ca, &mut m, "t", &[("a0", stored[0].1.clone())]).await, [OK]);
    assert!(lookup(&mut ca, &["a0"]).await[0].is_some());
    for i in 0..8u64 {
        let (k, v) = (format!("c{i}"), pattern(100 + i, OBJ));
        assert_eq!(store(&mut cc, &mut m, "t", &[(&k, v.clone())]).await, [OK], "{k}");
        assert!(lookup(&mut cc, &[&k]).await[0].is_some(), "{k}");
        stored.push((k, v));
    }
    ((a, b, c), (ca, cb, cc), m, stored)
}

/// Store through `c` every key of `todo` not stored yet (moved to `stored`
/// when OK, and kept locked by `c`'s client like c's other entries, so no
/// store evicts it); each item is OK or RESOURCE_EXHAUSTED (the region it
/// needs is held back), nothing else. True when none is left.
async fn store_rest(
    c: &mut Client,
    m: &mut PoolMap,
    todo: &mut Vec<(String, Vec<u8>)>,
    stored: &mut Vec<(String, Vec<u8>)>,
) -> bool {
    if todo.is_empty() {
        return true;
    }
    let items: Vec<(&str, Vec<u8>)> = todo.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let codes = store(c, m, "t", &items).await;
    assert!(codes.iter().all(|c| *c == OK || *c == RESOURCE_EXHAUSTED), "c's store: {codes:?}");
    let mut left = vec![];
    for (kv, code) in todo.drain(..).zip(codes) {
        if code == OK {
            assert!(lookup(c, &[&kv.0]).await[0].is_some(), "{} was just stored", kv.0);
            stored.push(kv);
        } else {
            left.push(kv);
        }
    }
    *todo = left;
    todo.is_empty()
}

fn kcs() -> Vec<(String, Vec<u8>)> {
    (0..8u64).map(|i| (format!("kc{i}"), pattern(200 + i, OBJ))).collect()
}

/// Defect 1: b's client reserves KB; b stops and is declared dead; c needs
/// a region and the only candidate is b's; b's client, still before its
/// reservation's `expires_unix_ms`, copies KB's payload into its location.
/// No key may then read as KB's bytes: b's region stays out of phase 3 until
/// KB's deadline (c's stores fail per item meanwhile) and goes to c after it.
#[tokio::test(flavor = "multi_thread")]
async fn a_dead_followers_region_is_not_handed_over_while_its_writers_may_still_write() {
    let dir = tempfile::tempdir().unwrap();
    let ((a, b, _c), (mut ca, mut cb, mut cc), mut m, mut stored) = three_full_regions(dir.path()).await;
    let nb = node_id(&mut ca, "b").await;

    let kb = pattern(300, OBJ);
    let req = proto::ReserveRequest {
        tenant: "t".into(),
        items: vec![proto::ReserveItem { key: key("kb"), size: OBJ as u64, ..Default::default() }],
        ..Default::default()
    };
    let r = cb.reserve(req).await.unwrap().into_inner();
    assert_eq!(r.reservations[0].status.as_ref().unwrap().code, OK);
    let l = r.reservations[0].location.unwrap();
    let expires = r.expires_unix_ms;
    assert_eq!(owners(&mut ca).await[l.region as usize], Some(nb), "KB is placed in b's region");

    // b stops; its client does not (it is not known to be dead).
    sigstop(b.pid());
    eventually("the primary declares b dead", SETTLE, async || a.logs().contains("node declared dead")).await;

    // c needs b's region now.
    let mut todo = kcs();
    let mut known = stored.clone();
    known.extend(todo.clone());
    known.push(("kb".into(), kb.clone()));
    store_rest(&mut cc, &mut m, &mut todo, &mut stored).await;

    // b's client, inside its reservation's time, copies KB's payload.
    let left = expires.saturating_sub(unix_ms());
    assert!(left > 300, "too slow to test: KB's reservation has {left} ms left");
    m.write(&l, &kb);

    let mut wrong = misreads("a", &mut ca, &m, &stored, &["kb"], &known).await;
    wrong.extend(misreads("c", &mut cc, &m, &stored, &["kb"], &known).await);
    assert!(wrong.is_empty(), "after b's client wrote KB into its reservation (b dead, {left} ms left): {wrong:#?}");

    // After KB's deadline the region may go: c's stores succeed again.
    tokio::time::sleep(Duration::from_millis(expires.saturating_sub(unix_ms()) + 200)).await;
    eventually("c stores again after KB's deadline", Duration::from_secs(10), async || {
        store_rest(&mut cc, &mut m, &mut todo, &mut stored).await
    })
    .await;
    let mut wrong = misreads("a", &mut ca, &m, &stored, &["kb"], &known).await;
    wrong.extend(misreads("c", &mut cc, &m, &stored, &["kb"], &known).await);
    assert!(wrong.is_empty(), "after KB's deadline: {wrong:#?}");
}

fn put_header(k: &str, size: u64) -> proto::InlinePutChunk {
    use proto::inline_put_chunk::Part;
    proto::InlinePutChunk { part: Some(Part::Header(proto::InlinePutHeader { key: key(k), tenant: "t".into(), size })) }
}

fn put_data(d: &[u8]) -> proto::InlinePutChunk {
    proto::InlinePutChunk { part: Some(proto::inline_put_chunk::Part::Data(d.to_vec().into())) }
}

type PutTask = tokio::task::JoinHandle<Result<tonic::Response<proto::InlinePutReply>, tonic::Status>>;

/// An InlinePut through `c` whose messages the test sends one by one.
fn open_put(mut c: Client) -> (mpsc::Sender<proto::InlinePutChunk>, PutTask) {
    let (tx, rx) = mpsc::channel(64);
    let task = tokio::spawn(async move { c.inline_put(tokio_stream::wrappers::ReceiverStream::new(rx)).await });
    (tx, task)
}

fn put_ok(r: &Result<tonic::Response<proto::InlinePutReply>, tonic::Status>) -> bool {
    matches!(r, Ok(rep) if rep.get_ref().status.as_ref().is_some_and(|s| s.code == OK))
}

/// Defect 1, variant: b's own InlinePut stream (the sidecar writes the
/// bytes) is cut by SIGSTOP of b; b is declared dead; c takes b's region
/// (after the put's deadline at the earliest); b resumes and the stream goes
/// on. b must not write into the region it lost: c's objects keep their
/// bytes and the put fails.
#[tokio::test(flavor = "multi_thread")]
async fn a_resumed_follower_never_writes_into_a_region_it_no_longer_owns() {
    const CHUNK: usize = 64 << 10;
    let dir = tempfile::tempdir().unwrap();
    let ((a, b, _c), (mut ca, cb, mut cc), mut m, mut stored) = three_full_regions(dir.path()).await;
    let nb = node_id(&mut ca, "b").await;
    let b_region = owners(&mut ca).await.iter().position(|o| *o == Some(nb)).unwrap();

    // 1 MiB through b: the header and two chunks, then b stops.
    let data = pattern(400, 16 * CHUNK);
    let (tx, put) = open_put(cb);
    tx.send(put_header("kb", data.len() as u64)).await.unwrap();
    for d in data.chunks(CHUNK).take(2) {
        tx.send(put_data(d)).await.unwrap();
    }
    eventually("b's inline put holds its reservation", SETTLE, async || stats(&mut ca).await.reserved == 1).await;
    let reserved = Instant::now();
    sigstop(b.pid());
    eventually("the primary declares b dead", SETTLE, async || a.logs().contains("node declared dead")).await;

    // c fills b's region (as soon as it is allowed to have it).
    let mut todo = kcs();
    let mut known = stored.clone();
    known.extend(todo.clone());
    known.push(("kb".into(), data.clone()));
    let within = Duration::from_millis(RESERVATION_MS + 6000);
    eventually("c takes b's region", within, async || store_rest(&mut cc, &mut m, &mut todo, &mut stored).await).await;
    assert_ne!(owners(&mut ca).await[b_region], Some(nb), "b's region went to c");
    let took = reserved.elapsed();

    // b resumes; its client's stream goes on to the end.
    sigcont(b.pid());
    for d in data.chunks(CHUNK).skip(2) {
        if tx.send(put_data(d)).await.is_err() {
            break; // the stream is over already
        }
    }
    drop(tx);
    let r = tokio::time::timeout(Duration::from_secs(15), put).await.expect("the put ends").unwrap();
    let mut wrong = misreads("a", &mut ca, &m, &stored, &["kb"], &known).await;
    wrong.extend(misreads("c", &mut cc, &m, &stored, &["kb"], &known).await);
    assert!(
        wrong.is_empty(),
        "b resumed {took:?} after its put reserved and streamed on into the region c took: {wrong:#?}"
    );
    assert!(!put_ok(&r), "the interrupted put of a node that lost its region must fail: {r:?}");

    // Through b too, once it is back in the cluster.
    eventually("b joined again", SETTLE, async || alive(&mut ca, "b").await).await;
    let mut cb = b.client().await;
    let wrong = misreads("b", &mut cb, &m, &stored, &["kb"], &known).await;
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// Timings of the shipped defaults' shape: b stays alive (not declared
/// dead) while the primary is stopped for 2.5 s; reservations last 3 s.
const STOP: &str = "[cluster]\nheartbeat_ms = 200\nlease_ms = 2000\ndead_after_ms = 4000\nforward_timeout_ms = 1000\n\
                    [registry]\nreservation_timeout_ms = 3000\n";

/// Defect 6: an inline put through b whose last chunk comes while the
/// primary is stopped (2.5 s): the commit and b's own abort both time out
/// and the put fails. The reservation must still end at the primary: within
/// reservation_timeout_ms plus a few seconds the key can be stored again
/// (not ALREADY_EXISTS "being written") and the primary's `reserved` is 0.
#[tokio::test(flavor = "multi_thread")]
async fn an_inline_put_cut_off_from_the_primary_leaves_no_reservation_behind() {
    const CHUNK: usize = 64 << 10;
    let dir = tempfile::tempdir().unwrap();
    let peer = format!("127.0.0.1:{}", free_port());
    let a = node(dir.path(), "a", &peer, STOP, "16MiB");
    let b = node(dir.path(), "b", &peer, STOP, "16MiB");
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    let m = PoolMap::open(&mut ca).await;
    eventually("b joined", SETTLE, async || alive(&mut ca, "b").await).await;

    let data = pattern(600, 4 * CHUNK);
    let (tx, put) = open_put(b.client().await);
    tx.send(put_header("k6", data.len() as u64)).await.unwrap();
    for d in data.chunks(CHUNK).take(3) {
        tx.send(put_data(d)).await.unwrap();
    }
    eventually("the put's reservation is open at the primary", SETTLE, async || stats(&mut ca).await.reserved == 1)
        .await;

    // The primary stops just before the last chunk.
    sigstop(a.pid());
    let stopped = Instant::now();
    tx.send(put_data(data.chunks(CHUNK).last().unwrap())).await.unwrap();
    drop(tx);
    let r = tokio::time::timeout(Duration::from_secs(10), put).await.expect("the put returns").unwrap();
    assert!(!put_ok(&r), "a put whose commit could not reach the primary cannot have succeeded: {r:?}");
    eprintln!("the put through b failed {:?} after the primary stopped: {:?}", stopped.elapsed(), r.err());
    tokio::time::sleep(Duration::from_millis(2500).saturating_sub(stopped.elapsed())).await;
    sigcont(a.pid());
    let resumed = Instant::now();

    // The key can be stored again within reservation_timeout_ms + 5 s.
    let v2 = pattern(601, 100_000);
    let within = Duration::from_millis(3000 + 5000);
    let req = || proto::ReserveRequest {
        tenant: "t".into(),
        items: vec![proto::ReserveItem { key: key("k6"), size: v2.len() as u64, ..Default::default() }],
        ..Default::default()
    };
    let mut mb = PoolMap::open(&mut cb).await;
    let id = loop {
        let rep = match cb.reserve(req()).await {
            Ok(rep) => rep.into_inner(),
            // b's lease may still be renewing right after the stop.
            Err(s) if s.code() == tonic::Code::Unavailable => {
                assert!(resumed.elapsed() < within, "reserve through b still UNAVAILABLE: {s:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            Err(s) => panic!("reserve through b: {s:?}"),
        };
        let res = &rep.reservations[0];
        let st = res.status.clone().unwrap();
        if st.code == OK {
            mb.write(res.location.as_ref().unwrap(), &v2);
            break res.reservation_id;
        }
        assert_eq!(st.code, ALREADY_EXISTS, "{st:?}");
        let reserved = stats(&mut ca).await.reserved;
        assert!(
            resumed.elapsed() < within,
            "k6 is still ALREADY_EXISTS ({:?}) {within:?} after the primary resumed; the primary's reserved = \
             {reserved}",
            st.message
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let cr = cb.commit(proto::CommitRequest { reservation_ids: vec![id], crc32: vec![], keys: vec![] }).await.unwrap();
    assert_eq!(cr.into_inner().statuses[0].code, OK);
    eprintln!("k6 stored again {:?} after the primary resumed", resumed.elapsed());
    eventually("the primary's reserved is back to 0", Duration::from_secs(3), async || {
        stats(&mut ca).await.reserved == 0
    })
    .await;
    let known = vec![("k6 (the failed put)".to_string(), data), ("k6".to_string(), v2.clone())];
    let want = [("k6".to_string(), v2)];
    let mut wrong = misreads("a", &mut ca, &m, &want, &[], &known).await;
    wrong.extend(misreads("b", &mut cb, &m, &want, &[], &known).await);
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// The primary keeps a dead node's regions from every other node for its
/// own reservation time, so a node whose clients may write longer is
/// refused at its join: it stops with the primary's reason, and is never
/// listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_reservations_outlast_the_primarys_is_refused_at_join() {
    let dir = tempfile::tempdir().unwrap();
    let peer = format!("127.0.0.1:{}", free_port());
    let a = node(dir.path(), "a", &peer, DEAD, "6MiB");
    let mut args = cluster_args(dir.path(), "b", &peer, DEAD, "6MiB");
    args.extend(["--reservation-timeout-ms".to_string(), (2 * RESERVATION_MS).to_string()]);
    let mut b = Sidecar::start_unchecked(dir.path(), "b", &strs(&args));
    assert!(!b.wait_exit(SETTLE).success(), "b must not serve: {}", b.logs());
    assert!(b.logs().contains("reservation_timeout_ms = 8000, more than the primary's 4000"), "{}", b.logs());
    let mut ca = a.client().await;
    assert!(stats(&mut ca).await.cluster_nodes.iter().all(|n| n.name != "b"), "b is not a node of the cluster");
}
