//! Regression tests for hostile and unlucky clients, against the real binary:
//! a stalled inline writer, a guessed commit, a reader whose lock ran out,
//! a flood of tenants, undecodable requests, a listener that cannot bind, a
//! commit without written bytes, and an inline read of pages let go. Each
//! one handed out wrong bytes, let one client harm another, or answered with
//! a misleading code before.
mod common;

use std::time::Duration;

use common::*;
use cxlkv::proto;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

fn reserve_req(tenant: &str, items: &[(&str, u64)]) -> proto::ReserveRequest {
    proto::ReserveRequest {
        tenant: tenant.into(),
        items: items.iter().map(|(k, n)| proto::ReserveItem { key: key(k), size: *n, ..Default::default() }).collect(),
        ..Default::default()
    }
}

fn data(d: Vec<u8>) -> proto::InlinePutChunk {
    proto::InlinePutChunk { part: Some(proto::inline_put_chunk::Part::Data(d.into())) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_inline_put_never_writes_into_pages_of_another_key() {
    let dir = tempfile::tempdir().unwrap();
    // One region of 32 pages; reservations live 300 ms.
    let s = Sidecar::start(dir.path(), "a", &["--max-regions", "1", "--reservation-timeout-ms", "300"]);
    let (mut writer, mut other) = (s.client().await, s.client().await);
    let mut m = PoolMap::open(&mut other).await;

    // The inline writer sends its header and a quarter of 1 MiB, then stalls.
    let (tx, rx) = mpsc::channel(8);
    let header = proto::InlinePutHeader { key: key("stalled"), tenant: "t".into(), size: 1 << 20 };
    tx.send(proto::InlinePutChunk { part: Some(proto::inline_put_chunk::Part::Header(header)) }).await.unwrap();
    tx.send(data(vec![0xEE; 256 << 10])).await.unwrap();
    let put = tokio::spawn(async move { writer.inline_put(ReceiverStream::new(rx)).await });
    tokio::time::sleep(Duration::from_millis(900)).await;

    // Meanwhile another client fills the region: 31 free pages (one page
    // holds nothing: the writer's 16 pages are either reclaimed or still its).
    let items: Vec<(String, Vec<u8>)> = (0..8).map(|i| (format!("k{i}"), pattern(i, 192 << 10))).collect();
    for (k, v) in &items {
        let rep = other.reserve(reserve_req("t", &[(k, v.len() as u64)])).await.unwrap().into_inner();
        let r = &rep.reservations[0];
        if r.status.as_ref().unwrap().code == OK {
            m.write(r.location.as_ref().unwrap(), v);
            let ids = vec![r.reservation_id];
            other.commit(proto::CommitRequest { reservation_ids: ids, crc32: vec![], keys: vec![] }).await.unwrap();
        }
    }
    // The writer wakes up and sends the rest.
    for _ in 0..3 {
        let _ = tx.send(data(vec![0xEE; 256 << 10])).await;
    }
    drop(tx);
    let reply = put.await.unwrap();
    let e = reply.expect_err("an inline put that outlived its reservation must fail");
    assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");

    // Every key that was committed holds exactly its own bytes.
    let mut seen = 0;
    for (k, v) in &items {
        if let Some(loc) = lookup(&mut other, &[k]).await[0] {
            assert_eq!(&m.read(&loc), v, "{k} holds another key's bytes");
            seen += 1;
        }
    }
    assert!(seen >= 4, "the other client could store only {seen} keys");
    assert_eq!(exists(&mut other, &["stalled"]).await, vec![false]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_connection_that_reserved_may_commit_or_abort() {
    let dir = tempfile::tempdir().unwrap();
    let s = Sidecar::start(dir.path(), "a", &[]);
    let (mut dead, mut guesser) = (s.client().await, s.client().await);
    let mut m = PoolMap::open(&mut dead).await;
    let rep = dead.reserve(reserve_req("t", &[("torn", 4096)])).await.unwrap().into_inner();
    let r = &rep.reservations[0];
    assert!(rep.expires_unix_ms > cxlkv::pool::now_unix_ms(), "the reply says until when the pages are ours");
    let mut half = vec![0u8; 4096];
    half[..2048].fill(7);
    m.write(r.location.as_ref().unwrap(), &half); // the writer dies here
    let id = r.reservation_id;
    let c =
        guesser.commit(proto::CommitRequest { reservation_ids: vec![id], crc32: vec![], keys: vec![] }).await.unwrap();
    assert_eq!(c.into_inner().statuses[0].code, tonic::Code::PermissionDenied as u32);
    let a = guesser.abort(proto::AbortRequest { reservation_ids: vec![id] }).await.unwrap();
    assert_eq!(a.into_inner().statuses[0].code, tonic::Code::PermissionDenied as u32);
    assert_eq!(exists(&mut guesser, &["torn"]).await, vec![false], "a torn object became visible");
    assert_eq!(stats(&mut guesser).await.reserved, 1, "the refused calls changed nothing");
    // Guessing is hopeless too: ids are 64 random bits, not a counter.
    let rep2 = dead.reserve(reserve_req("t", &[("next", 10)])).await.unwrap().into_inner();
    let id2 = rep2.reservations[0].reservation_id;
    assert!(id2.abs_diff(id) > 1 << 32, "consecutive ids {id:#x} {id2:#x}");
    // The owner's own commit still works.
    let c = dead.commit(proto::CommitRequest { reservation_ids: vec![id], crc32: vec![], keys: vec![] }).await.unwrap();
    assert_eq!(c.into_inner().statuses[0].code, OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_whose_lock_ran_out_sees_that_its_copy_is_void() {
    let dir = tempfile::tempdir().unwrap();
    // LRU, so that the read victim goes before the new keys that evict it.
    let s = Sidecar::start(dir.path(), "a", &["--max-regions", "1", "--eviction-policy", "lru"]);
    let mut c = s.client().await;
    let mut m = PoolMap::open(&mut c).await;
    store(&mut c, &mut m, "t", &[("victim", pattern(1, 256 << 10)), ("kept", pattern(2, 64 << 10))]).await;
    let short = |k: &str| proto::LookupRequest { keys: vec![key(k)], lock_ttl_ms: 300, ..Default::default() };
    let victim = c.lookup_and_lock(short("victim")).await.unwrap().into_inner().results[0].location.unwrap();
    let kept = lookup(&mut c, &["kept"]).await[0].unwrap(); // default TTL: still locked below
    assert_eq!(m.version(&victim), victim.version);
    // The reader stalls past its 300 ms lock; the pages go to other keys.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    for i in 0..12 {
        store(&mut c, &mut m, "t", &[(&format!("f{i}"), pattern(100 + i, 256 << 10))]).await;
    }
    assert_eq!(exists(&mut c, &["victim"]).await, vec![false], "the victim was evicted");
    // Its copy now holds other bytes, and the version word says so.
    assert_ne!(m.read(&victim), pattern(1, 256 << 10));
    assert_ne!(m.version(&victim), victim.version, "the reader cannot tell its copy is void");
    // A reader whose lock held sees its own object, version unchanged.
    assert_eq!(m.read(&kept), pattern(2, 64 << 10));
    assert_eq!(m.version(&kept), kept.version);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_tenants_leave_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let maddr = format!("127.0.0.1:{}", free_port());
    let cfg = dir.path().join("cxlkv.toml");
    std::fs::write(&cfg, "[server]\nmax_tenant_series = 5\n[registry]\nmax_tenants = 50\n").unwrap();
    let s = Sidecar::start(dir.path(), "a", &["--config", cfg.to_str().unwrap(), "--metrics-addr", &maddr]);
    let mut c = s.client().await;
    let mut m = PoolMap::open(&mut c).await;
    store(&mut c, &mut m, "owner", &[("k", vec![1; 100])]).await;
    let before = http_get(&maddr, "/metrics").len();
    for i in 0..20_000 {
        // Refused reserves (the key exists) and aborted ones.
        let rep = c.reserve(reserve_req(&format!("t{i}"), &[("k", 10)])).await.unwrap().into_inner();
        assert_eq!(rep.reservations[0].status.as_ref().unwrap().code, ALREADY_EXISTS);
        if i % 10 == 0 {
            let rep = c.reserve(reserve_req(&format!("t{i}"), &[(&format!("a{i}"), 10)])).await.unwrap();
            let ids = vec![rep.into_inner().reservations[0].reservation_id];
            c.abort(proto::AbortRequest { reservation_ids: ids }).await.unwrap();
        }
    }
    // 60 tenants with keys: 49 fit beside "owner", then the limit says so.
    let mut codes = vec![];
    for i in 0..60 {
        let rep = c.reserve(reserve_req(&format!("s{i}"), &[(&format!("s{i}"), 10)])).await.unwrap().into_inner();
        let r = &rep.reservations[0];
        codes.push(r.status.as_ref().unwrap().code);
        if r.status.as_ref().unwrap().code == OK {
            c.commit(proto::CommitRequest { reservation_ids: vec![r.reservation_id], crc32: vec![], keys: vec![] })
                .await
                .unwrap();
        }
    }
    assert_eq!(codes.iter().filter(|&&c| c == OK).count(), 49);
    assert!(codes[49..].iter().all(|&c| c == RESOURCE_EXHAUSTED), "{codes:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let st = stats(&mut c).await;
    assert_eq!(st.tenants.len(), 50);
    let body = http_get(&maddr, "/metrics");
    let series = body.lines().filter(|l| l.starts_with("cxlkv_tenant_stored_bytes{")).count();
    assert_eq!(series, 6, "five tenants of their own plus _other");
    assert!(body.contains("cxlkv_tenant_stored_bytes{tenant=\"_other\"} "));
    assert!(body.len() < before + 8192, "/metrics grew from {before} to {} bytes", body.len());
}

/// A ReserveRequest whose tenant (field 1) is not UTF-8.
#[derive(Clone, PartialEq, prost::Message)]
struct RawReserve {
    #[prost(bytes = "vec", tag = "1")]
    tenant: Vec<u8>,
}

/// An InlinePutChunk whose `data` (field 2) is sent as a varint: undecodable.
#[derive(Clone, PartialEq, prost::Message)]
struct RawChunk {
    #[prost(uint64, tag = "2")]
    data: u64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_requests_are_invalid_arguments() {
    use tonic::codegen::http::uri::PathAndQuery;
    let dir = tempfile::tempdir().unwrap();
    let s = Sidecar::start(dir.path(), "a", &[]);
    let ch = cxlkv::client::channel_uds(s.socket.clone()).await.unwrap();
    let mut g = tonic::client::Grpc::new(ch);
    g.ready().await.unwrap();
    let codec = tonic_prost::ProstCodec::<RawReserve, proto::ReserveReply>::default();
    let req = tonic::Request::new(RawReserve { tenant: vec![0xff, 0xfe, b'x'] });
    let e = g.unary(req, PathAndQuery::from_static("/cxlkv.v1.Cxlkv/Reserve"), codec).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");

    // A broken InlinePut stream: a header, then a message that does not decode.
    let mut c = s.client().await;
    let header = proto::InlinePutChunk {
        part: Some(proto::inline_put_chunk::Part::Header(proto::InlinePutHeader {
            key: key("x"),
            tenant: "t".into(),
            size: 8,
        })),
    };
    let mut raw = vec![];
    prost::Message::encode(&header, &mut raw).unwrap();
    let garbage = RawChunk { data: 5 };
    let codec = tonic_prost::ProstCodec::<RawFrame, proto::InlinePutReply>::default();
    let frames =
        tokio_stream::iter(vec![RawFrame { bytes: raw }, RawFrame { bytes: prost::Message::encode_to_vec(&garbage) }]);
    g.ready().await.unwrap();
    let e = g
        .client_streaming(tonic::Request::new(frames), PathAndQuery::from_static("/cxlkv.v1.Cxlkv/InlinePut"), codec)
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert_eq!(stats(&mut c).await.reserved, 0, "the broken put's reservation was given back");
}

/// Sends already-encoded message bytes as they are.
#[derive(Clone, PartialEq, Default)]
struct RawFrame {
    bytes: Vec<u8>,
}

impl prost::Message for RawFrame {
    fn encode_raw(&self, buf: &mut impl bytes::BufMut) {
        buf.put_slice(&self.bytes);
    }
    fn merge_field(
        &mut self,
        _: u32,
        _: prost::encoding::WireType,
        _: &mut impl bytes::Buf,
        _: prost::encoding::DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        unreachable!("only sent")
    }
    fn encoded_len(&self) -> usize {
        self.bytes.len()
    }
    fn clear(&mut self) {
        self.bytes.clear();
    }
}

impl std::fmt::Debug for RawFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RawFrame({} bytes)", self.bytes.len())
    }
}

#[test]
fn the_socket_appears_only_once_every_listener_is_bound() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let mut s = Sidecar::start_unchecked(dir.path(), "a", &["--tcp", &addr]);
    let status = s.wait_exit(Duration::from_secs(30));
    assert!(!status.success(), "a TCP port in use must fail the start");
    assert!(s.logs().contains(&addr), "the error names the address: {}", s.logs());
    assert!(!s.socket.exists(), "the Unix socket was up although the TCP listener never was");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_reads_never_serve_bytes_their_writer_did_not_vouch_for() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("cxlkv.toml");
    std::fs::write(&cfg, "[registry]\nrequire_checksum = true\n").unwrap();
    let s = Sidecar::start(dir.path(), "a", &["--config", cfg.to_str().unwrap(), "--max-regions", "1"]);
    let mut c = s.client().await;
    let secret = pattern(42, 64 << 10);
    // Tenant X stores a value inline and deletes it; its bytes stay in the pages.
    inline_put(&mut c, "x-secret", secret.len() as u64, vec![secret.clone()]).await.unwrap();
    assert_eq!(inline_get(&mut c, "x-secret").await.unwrap(), secret);
    c.delete(proto::DeleteRequest { keys: vec![key("x-secret")] }).await.unwrap();
    // A client that cannot map the pool reserves the same pages and commits
    // without writing: without a checksum it is refused outright...
    let rep = c.reserve(reserve_req("y", &[("y-key", secret.len() as u64)])).await.unwrap().into_inner();
    let id = rep.reservations[0].reservation_id;
    let e =
        c.commit(proto::CommitRequest { reservation_ids: vec![id], crc32: vec![], keys: vec![] }).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    // ...and with a made-up one the read is a miss, never X's bytes.
    let c2 = c
        .commit(proto::CommitRequest { reservation_ids: vec![id], crc32: vec![0xDEAD_BEEF], keys: vec![] })
        .await
        .unwrap();
    assert_eq!(c2.into_inner().statuses[0].code, OK);
    assert_eq!(inline_get(&mut c, "y-key").await, None, "another tenant's deleted bytes were served");
    // An honest mapped writer's checksum verifies.
    let mut m = PoolMap::open(&mut c).await;
    let v = pattern(7, 100_000);
    let rep = c.reserve(reserve_req("y", &[("honest", v.len() as u64)])).await.unwrap().into_inner();
    m.write(rep.reservations[0].location.as_ref().unwrap(), &v);
    let ids = vec![rep.reservations[0].reservation_id];
    c.commit(proto::CommitRequest { reservation_ids: ids, crc32: vec![crc32fast::hash(&v)], keys: vec![] })
        .await
        .unwrap();
    assert_eq!(inline_get(&mut c, "honest").await.unwrap(), v);
    // An inline put that ends short of its declared size never commits.
    let e = inline_put(&mut c, "short", 1000, vec![vec![1; 999]]).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert_eq!(exists(&mut c, &["short"]).await, vec![false]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_belong_to_their_connection_and_end_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let s = Sidecar::start(dir.path(), "a", &[]);
    let (mut reader, mut other) = (s.client().await, s.client().await);
    let mut m = PoolMap::open(&mut other).await;
    store(&mut other, &mut m, "t", &[("k", vec![7; 1000])]).await;
    assert!(lookup(&mut reader, &["k"]).await[0].is_some());
    // Another client can neither unlock nor delete the reader's key.
    assert_eq!(unlock(&mut other, &["k"]).await, vec![tonic::Code::PermissionDenied as u32]);
    let d = other.delete(proto::DeleteRequest { keys: vec![key("k")] }).await.unwrap().into_inner();
    assert_eq!(d.statuses[0].code, FAILED_PRECONDITION);
    assert_eq!(stats(&mut other).await.locked_keys, 1);
    // The reader goes away: its lock goes with its connection, not its TTL.
    drop(reader);
    let t = std::time::Instant::now();
    while stats(&mut other).await.locked_keys != 0 {
        assert!(t.elapsed() < Duration::from_secs(10), "the closed connection's lock stayed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let d = other.delete(proto::DeleteRequest { keys: vec![key("k")] }).await.unwrap().into_inner();
    assert_eq!(d.statuses[0].code, OK);
}

/// An entry whose object its owner already let go of (the first page's
/// version moved behind the registry, as a node's rejoin once did to
/// objects the primary still listed): InlineGet answers a plain miss, not a
/// header that promises the object followed by an abort.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inline_get_of_an_object_whose_pages_were_let_go_is_a_plain_miss() {
    let (_dir, _s, mut c, mut m) = one_sidecar(&[]).await;
    let v = pattern(3, 64 << 10);
    store(&mut c, &mut m, "t", &[("k", v.clone())]).await;
    assert_eq!(inline_get_result(&mut c, "k").await.unwrap(), Some(v));
    let l = lookup(&mut c, &["k"]).await.remove(0).unwrap();
    unlock(&mut c, &["k"]).await;
    m.set_version(&l, l.version.wrapping_add(1));
    assert_eq!(inline_get_result(&mut c, "k").await.map_err(|s| s.code()), Ok(None));
}
