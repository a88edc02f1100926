//! End-to-end tests against the real `cxlkv` binary over gRPC on a Unix socket.
mod common;

use std::time::Duration;

use common::*;
use cxlkv::proto;

const OBJ: usize = 256 << 10; // 4 pages of 64 KiB; 16 fit in 2 regions

fn names(prefix: &str, r: std::ops::Range<usize>) -> Vec<String> {
    r.map(|i| format!("{prefix}{i}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_lookup_load_roundtrip() {
    let (_dir, _s, mut c, mut m) = one_sidecar(&[]).await;
    let items =
        vec![("full", pattern(1, 2 * MIB as usize)), ("tail", pattern(2, MIB as usize + 13)), ("tiny", pattern(3, 1))];
    let codes = store(&mut c, &mut m, "alice", &items).await;
    assert_eq!(codes, vec![OK; 3]);
    let hits = lookup(&mut c, &["full", "tail", "tiny", "absent"]).await;
    assert!(hits[3].is_none(), "a miss is a result, not an error");
    for ((_, want), loc) in items.iter().zip(&hits) {
        assert_eq!(&m.read(loc.as_ref().unwrap()), want, "bytes through the mapping differ");
    }
    assert_eq!(inline_get(&mut c, "tail").await.unwrap(), items[1].1, "inline path sees the same bytes");
    assert_eq!(inline_get(&mut c, "absent").await, None);
    assert_eq!(unlock(&mut c, &["full", "tail", "tiny"]).await, vec![OK; 3]);
    let st = stats(&mut c).await;
    assert_eq!(st.keys, 3);
    assert_eq!(st.bytes_stored, 3 * MIB + 14);
    assert_eq!(st.tenants.len(), 1);
    assert_eq!((st.tenants[0].tenant.as_str(), st.tenants[0].bytes), ("alice", 3 * MIB + 14));
    // Pages are whole: 32 + 17 + 1 = 50 pages of 64 KiB.
    assert_eq!(st.pages_used, 50);

    // Inline put, then read back both ways.
    let data = pattern(9, 3 * (1 << 20) / 2);
    let rep =
        inline_put(&mut c, "inl", data.len() as u64, data.chunks(100_000).map(|c| c.to_vec()).collect()).await.unwrap();
    assert_eq!(rep.status.unwrap().code, OK);
    assert_eq!(m.read(&rep.location.unwrap()), data);
    assert_eq!(inline_get(&mut c, "inl").await.unwrap(), data);
    let rep = delete(&mut c, &["inl"]).await;
    assert_eq!((rep.statuses[0].code, rep.sizes[0]), (OK, data.len() as u64));
    assert_eq!(exists(&mut c, &["inl", "full"]).await, vec![false, true]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_once_first_writer_wins() {
    let (_dir, _s, mut c, mut m) = one_sidecar(&[]).await;
    assert_eq!(store(&mut c, &mut m, "t", &[("k", pattern(1, 1000))]).await, vec![OK]);
    // A second writer, of another size, is told "exists" and writes nothing.
    assert_eq!(store(&mut c, &mut m, "t", &[("k", pattern(2, 5000))]).await, vec![ALREADY_EXISTS]);
    let rep = inline_put(&mut c, "k", 10, vec![vec![0; 10]]).await.unwrap();
    assert_eq!(rep.status.unwrap().code, ALREADY_EXISTS);
    let loc = lookup(&mut c, &["k"]).await.remove(0).unwrap();
    assert_eq!(m.read(&loc), pattern(1, 1000));
    // Two reservations of one key in flight: the second is refused until the first ends.
    let r = c
        .reserve(proto::ReserveRequest {
            tenant: "t".into(),
            items: vec![
                proto::ReserveItem { key: key("p"), size: 10, ..Default::default() },
                proto::ReserveItem { key: key("p"), size: 10, ..Default::default() },
            ],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let codes: Vec<u32> = r.reservations.iter().map(|x| x.status.as_ref().unwrap().code).collect();
    assert_eq!(codes, vec![OK, ALREADY_EXISTS]);
    assert_eq!(stats(&mut c).await.bytes_stored, 1000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_keeps_storing_in_lru_order() {
    let (_dir, _s, mut c, mut m) = one_sidecar(&["--max-regions", "2", "--eviction-policy", "lru"]).await;
    let first = names("k", 0..16);
    for (i, k) in first.iter().enumerate() {
        assert_eq!(store(&mut c, &mut m, "t", &[(k, pattern(i as u64, OBJ))]).await, vec![OK]);
    }
    let st = stats(&mut c).await;
    assert_eq!((st.pages_free, st.owned_regions, st.evictions), (0, 2, 0), "the cap of 2 regions is full");
    // Touch k0..k3 so they become most recently used.
    let touched: Vec<&str> = first[..4].iter().map(|s| s.as_str()).collect();
    assert!(lookup(&mut c, &touched).await.iter().all(|h| h.is_some()));
    assert_eq!(unlock(&mut c, &touched).await, vec![OK; 4]);
    // One batch of 4 more: the shortfall is worked out once and k4..k7 go.
    let more: Vec<(String, Vec<u8>)> = (16..20).map(|i| (format!("k{i}"), pattern(i, OBJ))).collect();
    let items: Vec<(&str, Vec<u8>)> = more.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    assert_eq!(store(&mut c, &mut m, "t", &items).await, vec![OK; 4]);
    let all = names("k", 0..20);
    let refs: Vec<&str> = all.iter().map(|s| s.as_str()).collect();
    let ex = exists(&mut c, &refs).await;
    let want: Vec<bool> = (0..20).map(|i| !(4..8).contains(&i)).collect();
    assert_eq!(ex, want, "least recently used k4..k7 must be the victims");
    assert_eq!(stats(&mut c).await.evictions, 4);
    // Survivors still hold their own bytes (no page was handed out twice).
    for (i, k) in refs.iter().enumerate().filter(|(i, _)| want[*i]) {
        let loc = lookup(&mut c, &[k]).await.remove(0).unwrap();
        assert_eq!(m.read(&loc), pattern(i as u64, OBJ), "{k} corrupted");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_keys_survive_eviction_pressure() {
    let (_dir, _s, mut c, mut m) = one_sidecar(&["--max-regions", "2"]).await;
    let ks = names("k", 0..16);
    for (i, k) in ks.iter().enumerate() {
        store(&mut c, &mut m, "t", &[(k, pattern(i as u64, OBJ))]).await;
    }
    let locked: Vec<&str> = ks[..14].iter().map(|s| s.as_str()).collect();
    assert!(lookup(&mut c, &locked).await.iter().all(|h| h.is_some()));
    // 4 new objects but only k14, k15 are evictable: 2 succeed, 2 are exhausted.
    let items: Vec<(&str, Vec<u8>)> = ["n0", "n1", "n2", "n3"].iter().map(|k| (*k, pattern(7, OBJ))).collect();
    let codes = store(&mut c, &mut m, "t", &items).await;
    assert_eq!(codes, vec![OK, OK, RESOURCE_EXHAUSTED, RESOURCE_EXHAUSTED]);
    assert!(exists(&mut c, &locked).await.iter().all(|e| *e), "a locked key was evicted");
    assert_eq!(exists(&mut c, &["k14", "k15", "n0", "n1", "n2"]).await, vec![false, false, true, true, false]);
    for (i, k) in locked.iter().enumerate() {
        let loc = lookup(&mut c, &[k]).await.remove(0).unwrap();
        assert_eq!(m.read(&loc), pattern(i as u64, OBJ));
    }
    // Locked keys cannot be deleted either.
    let rep = delete(&mut c, &["k0"]).await;
    assert_eq!(rep.statuses[0].code, FAILED_PRECONDITION);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_clear_status_and_changes_nothing() {
    let (_dir, s, mut c, mut m) = one_sidecar(&[]).await;
    store(&mut c, &mut m, "t", &[("good", pattern(1, 4096))]).await;
    let before = stats(&mut c).await;
    let reserve = |items: Vec<(Vec<u8>, u64)>| proto::ReserveRequest {
        tenant: "t".into(),
        items: items
            .into_iter()
            .map(|(k, size)| proto::ReserveItem { key: k.into(), size, ..Default::default() })
            .collect(),
        ..Default::default()
    };
    let invalid = tonic::Code::InvalidArgument;
    for (what, req) in [
        ("oversized key", reserve(vec![(b"ok".to_vec(), 10), (vec![b'x'; 1025], 10)])),
        ("empty key", reserve(vec![(vec![], 10)])),
        ("zero size", reserve(vec![(b"z".to_vec(), 0)])),
        ("larger than a region", reserve(vec![(b"big".to_vec(), 2 * MIB + 1)])),
    ] {
        let e = c.reserve(req).await.unwrap_err();
        assert_eq!(e.code(), invalid, "{what}: {e:?}");
        assert!(!e.message().is_empty());
    }
    let e = c
        .lookup_and_lock(proto::LookupRequest { keys: vec![key("good")], lock_ttl_ms: u32::MAX, ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), invalid, "lock TTL beyond the limit");
    let e = c.list_keys(proto::ListKeysRequest { page_size: 1_000_000, ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code(), invalid);

    // Work whose client deadline has passed is refused and takes nothing.
    let past = cxlkv::pool::now_unix_ms() - 1;
    let e = c
        .lookup_and_lock(proto::LookupRequest {
            keys: vec![key("good")],
            lock_ttl_ms: 0,
            deadline_unix_ms: past,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::DeadlineExceeded);
    let mut late = reserve(vec![(b"late".to_vec(), 10)]);
    late.deadline_unix_ms = past;
    assert_eq!(c.reserve(late).await.unwrap_err().code(), tonic::Code::DeadlineExceeded);
    assert_eq!(stats(&mut c).await.locked_keys, 0);

    // Commit of an unknown reservation, double commit, abort after commit.
    let r = c
        .commit(proto::CommitRequest { reservation_ids: vec![12345], ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.statuses[0].code, NOT_FOUND);
    let rr = c.reserve(reserve(vec![(b"two".to_vec(), 100)])).await.unwrap().into_inner();
    let id = rr.reservations[0].reservation_id;
    m.write(rr.reservations[0].location.as_ref().unwrap(), &[5; 100]);
    let r = c
        .commit(proto::CommitRequest { reservation_ids: vec![id, id], ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    // Once committed, a reservation is no longer open: its id is unknown.
    assert_eq!((r.statuses[0].code, r.statuses[1].code), (OK, NOT_FOUND));
    let r = c.abort(proto::AbortRequest { reservation_ids: vec![id] }).await.unwrap().into_inner();
    assert_eq!(r.statuses[0].code, NOT_FOUND);
    assert_eq!(exists(&mut c, &["two"]).await, vec![true], "a refused abort must not drop the key");

    // Unlock of a never-locked and of an unknown key.
    assert_eq!(unlock(&mut c, &["good", "nope"]).await, vec![FAILED_PRECONDITION, NOT_FOUND]);
    let r = delete(&mut c, &["nope"]).await;
    assert_eq!(r.statuses[0].code, NOT_FOUND);

    // Inline put whose bytes do not match the declared size.
    let e = inline_put(&mut c, "short", 1000, vec![vec![1; 999]]).await.unwrap_err();
    assert_eq!(e.code(), invalid, "{e:?}");
    let e = inline_put(&mut c, "long", 1000, vec![vec![1; 600], vec![1; 600]]).await.unwrap_err();
    assert_eq!(e.code(), invalid, "{e:?}");
    assert_eq!(exists(&mut c, &["short", "long"]).await, vec![false, false]);

    // Garbage on the socket: the connection dies, the server does not.
    for junk in
        [&b"GET / HTTP/1.1\r\n\r\n"[..], &[0xffu8; 4096][..], b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x04\x08\x00"]
    {
        use std::io::{Read, Write};
        let mut sock = std::os::unix::net::UnixStream::connect(&s.socket).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let _ = sock.write_all(junk);
        let _ = sock.read(&mut [0u8; 1024]);
    }
    let after = stats(&mut c).await;
    assert_eq!(after.keys, before.keys + 1, "only the one good commit changed the registry");
    assert_eq!(after.reserved, 0, "failed requests left reservations behind");
    assert_eq!(after.pages_used, before.pages_used + 1, "failed requests leaked pages");
    let loc = lookup(&mut c, &["good"]).await.remove(0).unwrap();
    assert_eq!(m.read(&loc), pattern(1, 4096));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vanished_clients_give_pages_back() {
    let dir = tempfile::tempdir().unwrap();
    let s = Sidecar::start(dir.path(), "a", &["--max-regions", "2", "--reservation-timeout-ms", "300"]);
    {
        // Reserve the whole capacity and disappear without committing.
        let mut c = s.client().await;
        let items = (0..16)
            .map(|i| proto::ReserveItem { key: key(&format!("r{i}")), size: OBJ as u64, ..Default::default() })
            .collect();
        let r = c
            .reserve(proto::ReserveRequest { tenant: "t".into(), items, ..Default::default() })
            .await
            .unwrap()
            .into_inner();
        assert!(r.reservations.iter().all(|x| x.status.as_ref().unwrap().code == OK));
        let mut c2 = s.client().await;
        let r = c2
            .reserve(proto::ReserveRequest {
                tenant: "t".into(),
                items: vec![proto::ReserveItem { key: key("x"), size: OBJ as u64, ..Default::default() }],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            r.reservations[0].status.as_ref().unwrap().code,
            RESOURCE_EXHAUSTED,
            "reservations are never evicted"
        );
    }
    let mut c = s.client().await;
    let t = std::time::Instant::now();
    loop {
        let st = stats(&mut c).await;
        if st.reserved == 0 {
            assert_eq!((st.pages_used, st.reservations_expired), (0, 16));
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "reservations were never reclaimed: {st:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut m = PoolMap::open(&mut c).await;
    assert_eq!(store(&mut c, &mut m, "t", &[("r0", pattern(1, OBJ))]).await, vec![OK], "the key is free again");

    // A client that vanishes mid inline put gets its pages back at once.
    use proto::inline_put_chunk::Part;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut c2 = s.client().await;
    let call = tokio::spawn(async move { c2.inline_put(tokio_stream::wrappers::ReceiverStream::new(rx)).await });
    let header = proto::InlinePutHeader { key: key("half"), tenant: "t".into(), size: OBJ as u64 };
    tx.send(proto::InlinePutChunk { part: Some(Part::Header(header)) }).await.unwrap();
    tx.send(proto::InlinePutChunk { part: Some(Part::Data(vec![1u8; 1000].into())) }).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(stats(&mut c).await.reserved, 1);
    call.abort();
    drop(tx);
    let t = std::time::Instant::now();
    while stats(&mut c).await.reserved != 0 {
        assert!(t.elapsed() < Duration::from_secs(5), "mid-stream abort did not release the reservation");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(exists(&mut c, &["half"]).await, vec![false]);
    assert_eq!(stats(&mut c).await.pages_used, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_reattaches_and_damaged_pool_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Sidecar::start(dir.path(), "a", &[]);
    let mut c = s.client().await;
    let info1 = pool_info(&mut c).await;
    let st1 = stats(&mut c).await;
    drop(c);
    let (status, took) = s.stop();
    assert!(status.success(), "SIGTERM must exit cleanly: {status}");
    assert!(took < Duration::from_secs(10));
    assert!(!s.socket.exists(), "socket file removed on shutdown");

    s.spawn(&[]);
    let mut c = s.client().await;
    let info2 = pool_info(&mut c).await;
    assert_eq!(info1.pool_uuid, info2.pool_uuid, "restart must re-attach, not format");
    assert_eq!(info2.node_id, info1.node_id);
    let st2 = stats(&mut c).await;
    let owned = |st: &proto::StatsReply| {
        st.regions.iter().filter(|r| r.state == "owned").map(|r| (r.region, r.generation)).collect::<Vec<_>>()
    };
    let (o1, o2) = (owned(&st1), owned(&st2));
    assert_eq!(o1.len(), 1);
    assert_eq!(o2, vec![(o1[0].0, o1[0].1 + 1)], "same region re-adopted with a new generation");
    assert!(s.logs().contains("Attached"));
    drop(c);
    s.stop();

    // Damage the superblock: start-up refuses, says how to fix, changes nothing.
    let mut bytes = std::fs::read(&s.pool).unwrap();
    bytes[..8].copy_from_slice(b"NOTAPOOL");
    std::fs::write(&s.pool, &bytes).unwrap();
    let out = run_cxlkv(s.args(&[]));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad magic") && err.contains("--format"), "{err}");
    assert!(std::fs::read(&s.pool).unwrap() == bytes, "a refused pool must not be modified");
    s.spawn(&["--format"]);
    let mut c = s.client().await;
    let info3 = pool_info(&mut c).await;
    assert_ne!(info3.pool_uuid, info1.pool_uuid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_instance_beside_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let a = Sidecar::start(dir.path(), "a", &[]);
    let b = Sidecar::start(dir.path(), "b", &[]);
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    let ia = pool_info(&mut ca).await;
    let ib = pool_info(&mut cb).await;
    assert_eq!(ia.pool_uuid, ib.pool_uuid);
    assert_ne!(ia.node_id, ib.node_id, "each process gets its own node id");
    let mut ma = PoolMap::open(&mut ca).await;
    let mut mb = PoolMap::open(&mut cb).await;
    store(&mut ca, &mut ma, "t", &[("x", pattern(1, OBJ))]).await;
    store(&mut cb, &mut mb, "t", &[("x", pattern(2, OBJ))]).await;
    let la = lookup(&mut ca, &["x"]).await.remove(0).unwrap();
    let lb = lookup(&mut cb, &["x"]).await.remove(0).unwrap();
    assert_ne!(la.region, lb.region, "the two nodes write into different regions");
    assert_eq!(ma.read(&la), pattern(1, OBJ));
    assert_eq!(mb.read(&lb), pattern(2, OBJ));
    // A third process asking for a taken node id is refused.
    let taken = ia.node_id.to_string();
    let out = run_cxlkv(a.args(&["--node-id", &taken, "--socket", dir.path().join("c.sock").to_str().unwrap()]));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("in use"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_tcp_and_metrics_endpoints() {
    let dir = tempfile::tempdir().unwrap();
    let (gport, mport) = (free_port(), free_port());
    let tcp = format!("127.0.0.1:{gport}");
    let maddr = format!("127.0.0.1:{mport}");
    let s = Sidecar::start(dir.path(), "a", &["--tcp", &tcp, "--metrics-addr", &maddr]);
    let mode = std::fs::metadata(&s.socket).map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions())).unwrap();
    assert_eq!(mode & 0o777, 0o660);
    let chan = tonic::transport::Endpoint::from_shared(format!("http://{tcp}")).unwrap().connect().await.unwrap();
    let mut h = tonic_health::pb::health_client::HealthClient::new(chan);
    for service in ["cxlkv.v1.Cxlkv", ""] {
        let r = h.check(tonic_health::pb::HealthCheckRequest { service: service.into() }).await.unwrap();
        assert_eq!(r.into_inner().status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32);
    }
    // The health stream of an open connection turns NOT_SERVING on SIGTERM.
    let mut watch =
        h.watch(tonic_health::pb::HealthCheckRequest { service: String::new() }).await.unwrap().into_inner();
    assert_eq!(watch.message().await.unwrap().unwrap().status, 1);
    let mut c = cxlkv::client::connect_tcp(&tcp).await.unwrap();
    let mut m = PoolMap::open(&mut c).await;
    store(&mut c, &mut m, "t", &[("k", pattern(1, 5000))]).await;
    lookup(&mut c, &["k", "missing"]).await;
    let get = |path: &str| http_get(&maddr, path);
    assert!(get("/live").starts_with("HTTP/1.1 200"));
    assert!(get("/ready").starts_with("HTTP/1.1 200"));
    let body = get("/metrics");
    for line in [
        "cxlkv_requests_total{op=\"reserve\",result=\"ok\"} 1",
        "cxlkv_keys_total{op=\"lookup_and_lock\",result=\"hit\"} 1",
        "cxlkv_keys_total{op=\"lookup_and_lock\",result=\"miss\"} 1",
        "cxlkv_committed_bytes_total 5000",
    ] {
        assert!(body.contains(line), "missing {line} in\n{body}");
    }
    s.sigterm();
    let next = tokio::time::timeout(Duration::from_secs(5), watch.message()).await.expect("no health update");
    assert_eq!(next.unwrap().unwrap().status, 2, "NOT_SERVING while draining");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unlocks_ride_on_the_next_lookup_all_or_nothing() {
    let (_dir, _s, mut c, mut m) = one_sidecar(&[]).await;
    store(&mut c, &mut m, "t", &[("a", pattern(1, 4096)), ("b", pattern(2, 4096))]).await;
    assert!(lookup(&mut c, &["a"]).await[0].is_some());
    let req = |unlock: &[&str], keys: &[&str], deadline_unix_ms| proto::LookupRequest {
        keys: keys.iter().map(|k| key(k)).collect(),
        unlock_first: unlock.iter().map(|k| key(k)).collect(),
        deadline_unix_ms,
        ..Default::default()
    };
    // A refused call applies nothing: a stays locked, b is not locked.
    let stale = c.lookup_and_lock(req(&["a"], &["b"], 1)).await.unwrap_err();
    assert_eq!(stale.code(), tonic::Code::DeadlineExceeded);
    let mut bad = req(&["a"], &["b"], 0);
    bad.unlock_first.push(bytes::Bytes::new());
    assert_eq!(c.lookup_and_lock(bad).await.unwrap_err().code(), tonic::Code::InvalidArgument);
    assert_eq!(stats(&mut c).await.locked_keys, 1);
    // Applied in order: unlocks first (b was not locked yet), then the lookup.
    let rep = c.lookup_and_lock(req(&["a", "b"], &["b"], 0)).await.unwrap().into_inner();
    assert_eq!(rep.unlock_statuses.iter().map(|s| s.code).collect::<Vec<_>>(), vec![OK, FAILED_PRECONDITION]);
    assert!(rep.results[0].found);
    assert_eq!(stats(&mut c).await.locked_keys, 1, "only b is locked now");
    let del = delete(&mut c, &["a", "b"]).await;
    assert_eq!(del.statuses.iter().map(|s| s.code).collect::<Vec<_>>(), vec![OK, FAILED_PRECONDITION]);
}

/// Per item, (code, message) from a reply that may carry runs.
fn per_item(rep: &proto::ReserveReply) -> Vec<(u32, String)> {
    let mut out = vec![];
    for r in &rep.reservations {
        let s = r.status.clone().unwrap();
        out.extend(std::iter::repeat_n((s.code, s.message), 1 + r.repeat as usize));
    }
    out
}

/// The same Reserve on a fresh sidecar holding k1..k3: two that fit
/// around the three present, then more objects of the largest size than
/// the pool holds, then a present one again.
async fn reserve_beside_three(runs: bool) -> (usize, proto::ReserveReply) {
    let (_dir, _s, mut c, mut m) = one_sidecar(&[]).await;
    let stored = [("k1", pattern(1, 100)), ("k2", pattern(2, 100)), ("k3", pattern(3, 100))];
    assert_eq!(store(&mut c, &mut m, "t", &stored).await, vec![OK; 3]);
    let info = pool_info(&mut c).await;
    let mut items: Vec<(String, u64)> = vec![("n1".into(), 100)];
    items.extend(["k1", "k2", "k3"].map(|k| (k.to_string(), 100)));
    items.push(("n2".into(), 100));
    let big = (info.capacity_bytes / info.max_object_size + 3) as usize;
    items.extend((0..big).map(|i| (format!("big{i}"), info.max_object_size)));
    items.push(("k1".into(), 100));
    let req = proto::ReserveRequest {
        tenant: "t".into(),
        items: items.iter().map(|(k, n)| proto::ReserveItem { key: key(k), size: *n, ..Default::default() }).collect(),
        runs,
        ..Default::default()
    };
    (items.len(), c.reserve(req).await.unwrap().into_inner())
}

/// A client that reads runs gets each stretch of items refused alike as one
/// entry, in order (a refused batch of thousands is a few entries); one
/// that does not gets one entry per item, as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_come_back_as_runs_to_a_client_that_reads_them() {
    let (n, runs) = reserve_beside_three(true).await;
    let (_, each) = reserve_beside_three(false).await;
    assert_eq!(each.reservations.len(), n);
    assert!(each.reservations.iter().all(|r| r.repeat == 0), "no runs unless asked");
    assert_eq!(per_item(&runs), per_item(&each), "the same outcome, item by item");
    let codes: Vec<u32> = per_item(&runs).into_iter().map(|(c, _)| c).collect();
    assert_eq!(codes[..6], [OK, ALREADY_EXISTS, ALREADY_EXISTS, ALREADY_EXISTS, OK, OK]);
    assert_eq!(codes[n - 2..], [RESOURCE_EXHAUSTED, ALREADY_EXISTS]);
    // Runs are maximal and never hold an OK.
    assert!(runs.reservations.len() < n - 3, "{:?}", runs.reservations);
    for w in runs.reservations.windows(2) {
        let (a, b) = (w[0].status.as_ref().unwrap(), w[1].status.as_ref().unwrap());
        assert!(a.code == OK || a != b, "two neighbouring entries refused alike: {a:?}");
    }
    assert!(runs.reservations.iter().all(|r| r.status.as_ref().unwrap().code != OK || r.repeat == 0));
}

/// A Reserve with its items packed (keys in one buffer, their lengths, the
/// sizes) reserves what the same items as messages would, and malformed
/// packing is INVALID_ARGUMENT with nothing reserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packed_reserve_items_store_as_item_messages_do_and_malformed_packing_is_refused() {
    let (_dir, _s, mut c, mut m) = one_sidecar(&[]).await;
    let packed = |keys: &[&str], sizes: Vec<u64>| proto::ReserveRequest {
        tenant: "t".into(),
        packed_keys: keys.concat().into_bytes().into(),
        key_lengths: keys.iter().map(|k| k.len() as u32).collect(),
        sizes,
        ..Default::default()
    };
    let invalid = tonic::Code::InvalidArgument;
    let mut both = packed(&["a"], vec![10]);
    both.items = vec![proto::ReserveItem { key: key("b"), size: 10, ..Default::default() }];
    let mut short = packed(&["abc", "de"], vec![10]);
    short.key_lengths = vec![3, 3];
    // Counted before any key is sliced out: a million one-byte lengths.
    let mut many = packed(&[], vec![1]);
    (many.packed_keys, many.key_lengths) = (vec![b'k'; 1 << 20].into(), vec![1; 1 << 20]);
    for (what, req) in [
        ("items and packed keys", both),
        ("lengths past the buffer", short),
        ("two sizes for three keys", packed(&["x", "y", "z"], vec![10, 20])),
        ("an empty key", packed(&["x", ""], vec![10])),
        ("more keys than max_batch", many),
    ] {
        let e = c.reserve(req).await.unwrap_err();
        assert_eq!(e.code(), invalid, "{what}: {e:?}");
    }
    assert_eq!(stats(&mut c).await.pages_used, 0, "a refused call reserves nothing");

    // One size for all, then one size each: keys and sizes as sent.
    let data = [pattern(1, 1000), pattern(2, 1000), pattern(3, 70_000), pattern(4, 5)];
    let mut ids = vec![];
    for req in [packed(&["one", "two"], vec![1000]), packed(&["three", "four", "one"], vec![70_000, 5, 1000])] {
        ids.push(c.reserve(req).await.unwrap().into_inner().reservations);
    }
    let codes: Vec<Vec<u32>> =
        ids.iter().map(|rs| rs.iter().map(|r| r.status.as_ref().unwrap().code).collect()).collect();
    assert_eq!(codes, vec![vec![OK, OK], vec![OK, OK, ALREADY_EXISTS]]);
    let placed: Vec<&proto::Reservation> =
        ids.iter().flatten().filter(|r| r.status.as_ref().unwrap().code == OK).collect();
    for (r, want) in placed.iter().zip(&data) {
        assert_eq!(r.location.as_ref().unwrap().length, want.len() as u64);
        m.write(r.location.as_ref().unwrap(), want);
    }
    let commit = proto::CommitRequest {
        reservation_ids: placed.iter().map(|r| r.reservation_id).collect(),
        ..Default::default()
    };
    let cr = c.commit(commit).await.unwrap().into_inner();
    assert!(cr.statuses.iter().all(|s| s.code == OK), "{cr:?}");
    let hits = lookup(&mut c, &["one", "two", "three", "four"]).await;
    for (loc, want) in hits.iter().zip(&data) {
        assert_eq!(&m.read(loc.as_ref().unwrap()), want);
    }
}
