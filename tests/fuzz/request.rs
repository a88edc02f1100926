//! Target `request`: arbitrary bytes as a gRPC request to the real service,
//! in process: the generated `CxlkvServer` routes it, the project's codec
//! decodes it, `rpc.rs` translates it and the `Handler` validates and runs
//! it, over a small shm pool (one node, 4 regions of 2 MiB, 64 KiB pages)
//! whose state carries over from input to input.
//!
//! Input: `[sel][payload]`. `sel % 16` picks the call: 0..=12 one of the 13
//! methods with the payload as its one message (InlinePut: the payload is a
//! sequence of `[len u16][message]`, each a message of the stream); 13 and 14
//! Commit and Abort of reservations this target was handed earlier (the
//! payload picks which and gives the crc32s, since reservation ids are 64
//! random bits no input could guess); 15 the method `(sel >> 4) % 13` with
//! the payload as the raw HTTP/2 body, gRPC framing included. Otherwise bit
//! 4 of `sel` picks which of two client connections (sessions) calls.
//! Checks: no panic; every call ends within the hang limit (the response,
//! streams included, is read to its end); a well-framed request never gets
//! INTERNAL or UNKNOWN (those blame the server for the client's bytes); a
//! successful Reserve's reply decodes.
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use prost::Message;
use tonic::codegen::http;
use tower::ServiceExt;

use cxlkv::conn::ConnInfo;
use cxlkv::handler::{Handler, Limits};
use cxlkv::metrics::Metrics;
use cxlkv::pool::{Geometry, NodeId, Pool, PoolOptions, ShmBackend};
use cxlkv::proto::{self, cxlkv_server::CxlkvServer};
use cxlkv::registry::{LocalRegistry, Session};
use cxlkv::rpc::Service;

use crate::driver::{norm, Cursor, Target};

const METHODS: [&str; 13] = [
    "PoolInfo",
    "Reserve",
    "Commit",
    "Abort",
    "LookupAndLock",
    "Unlock",
    "Delete",
    "Exists",
    "ListKeys",
    "Stats",
    "Removed",
    "InlinePut",
    "InlineGet",
];
const INLINE_PUT: usize = 11;
/// A fresh sidecar state every this many inputs (a restart, in effect).
const RESTART_EVERY: u64 = 50_000;
/// Housekeeping (expired reservations and locks) every this many inputs.
const REAP_EVERY: u64 = 64;

pub struct RequestTarget {
    rt: tokio::runtime::Runtime,
    dir: tempfile::TempDir,
    state: Option<(Arc<Handler>, CxlkvServer<Service>)>,
    inputs: u64,
    /// Reservation ids from recent Reserve replies.
    ids: Vec<u64>,
}

impl RequestTarget {
    pub fn new() -> Self {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        Self { rt, dir: crate::scratch_dir(), state: None, inputs: 0, ids: vec![] }
    }

    fn server(&mut self) -> (Arc<Handler>, CxlkvServer<Service>) {
        if self.inputs.is_multiple_of(RESTART_EVERY) {
            self.state = None; // releases the pool and its node id
            self.ids.clear();
            // Once the aborts that dropped inline puts left behind have run
            // (they hold the old handler).
            self.rt.block_on(async {
                for _ in 0..16 {
                    tokio::task::yield_now().await;
                }
            });
        }
        self.inputs += 1;
        let dir = self.dir.path();
        let (h, s) = self.state.get_or_insert_with(|| {
            let g = Geometry::for_capacity(8 << 20, 2 << 20, 64 << 10, 2 << 20).unwrap();
            let backend = ShmBackend::open(&dir.join("pool"), g.pool_size, false).unwrap();
            let opts = PoolOptions { region_size: 2 << 20, page_size: 64 << 10, format: true };
            let (pool, _) = Pool::open(Box::new(backend), &opts).unwrap();
            let node = pool.lock_node(Some(1)).unwrap();
            // The defaults, except: no prefault (cheap restarts), and limits
            // small enough that fuzz inputs reach them.
            let limits = Limits {
                prefault: false,
                max_batch: 64,
                reservation_timeout_ms: 200,
                default_lock_ttl_ms: 50,
                max_lock_ttl_ms: 2_000,
                ..Limits::default()
            };
            let registry = Arc::new(LocalRegistry::new("lru", 32).unwrap());
            let h = Arc::new(Handler::new(Arc::new(pool), NodeId(node), registry, limits).unwrap());
            let ops = cxlkv::rpc::Op::ALL.map(cxlkv::rpc::Op::label);
            let metrics = Arc::new(Metrics::new("shm", 16, &ops));
            let svc = CxlkvServer::new(Service::new(h.clone(), metrics))
                .max_decoding_message_size(cxlkv::wire::MAX_MESSAGE)
                .max_encoding_message_size(cxlkv::wire::MAX_MESSAGE);
            (h, svc)
        });
        (h.clone(), s.clone())
    }
}

fn frame(out: &mut BytesMut, msg: &[u8]) {
    out.put_u8(0);
    out.put_u32(msg.len() as u32);
    out.put_slice(msg);
}

/// The messages of a gRPC body (as far as it is well framed).
fn unframe(mut b: &[u8]) -> Vec<&[u8]> {
    let mut out = vec![];
    while b.len() >= 5 {
        let n = u32::from_be_bytes(b[1..5].try_into().unwrap()) as usize;
        if b.len() < 5 + n {
            break;
        }
        out.push(&b[5..5 + n]);
        b = &b[5 + n..];
    }
    out
}

impl Target for RequestTarget {
    fn name(&self) -> &'static str {
        "request"
    }
    fn max_len(&self) -> usize {
        4096
    }
    fn seeds(&self) -> Vec<Vec<u8>> {
        let b = |s: &str| Bytes::copy_from_slice(s.as_bytes());
        let item = |k: &str, size| proto::ReserveItem { key: b(k), size, ..Default::default() };
        let keys = |ks: &[&str]| ks.iter().map(|k| b(k)).collect::<Vec<_>>();
        let mut seeds: Vec<Vec<u8>> = vec![
            vec![0],
            [
                vec![1],
                proto::ReserveRequest {
                    tenant: "t".into(),
                    items: vec![item("a", 100), item("b", 70_000)],
                    deadline_unix_ms: 0,
                    commit_first: vec![1, u64::MAX],
                    commit_first_crc32: vec![7],
                    runs: true,
                    no_evict: true,
                    packed_keys: Bytes::new(),
                    key_lengths: vec![],
                    sizes: vec![],
                }
                .encode_to_vec(),
            ]
            .concat(),
            [
                vec![1],
                proto::ReserveRequest {
                    tenant: "t".into(),
                    packed_keys: b("abcde"),
                    key_lengths: vec![2, 3, 0],
                    sizes: vec![100, 70_000],
                    ..Default::default()
                }
                .encode_to_vec(),
            ]
            .concat(),
            [
                vec![1],
                proto::ReserveRequest {
                    tenant: "".into(),
                    items: vec![item("c", 2 << 20), item("", 1), item("d", 0)],
                    deadline_unix_ms: 1,
                    ..Default::default()
                }
                .encode_to_vec(),
            ]
            .concat(),
            [
                vec![1],
                proto::ReserveRequest {
                    tenant: "x".repeat(257),
                    items: vec![item("e", 1)],
                    deadline_unix_ms: 0,
                    ..Default::default()
                }
                .encode_to_vec(),
            ]
            .concat(),
            [
                vec![2],
                proto::CommitRequest { reservation_ids: vec![1, 2], crc32: vec![7], keys: vec![] }.encode_to_vec(),
            ]
            .concat(),
            [vec![3], proto::AbortRequest { reservation_ids: vec![u64::MAX] }.encode_to_vec()].concat(),
            [
                vec![4],
                proto::LookupRequest {
                    keys: keys(&["a", "b"]),
                    lock_ttl_ms: 0,
                    deadline_unix_ms: 0,
                    unlock_first: keys(&["a"]),
                }
                .encode_to_vec(),
            ]
            .concat(),
            [
                vec![4],
                proto::LookupRequest {
                    keys: keys(&["c"]),
                    lock_ttl_ms: 5_000,
                    deadline_unix_ms: u64::MAX,
                    unlock_first: vec![],
                }
                .encode_to_vec(),
            ]
            .concat(),
            [vec![5], proto::UnlockRequest { keys: keys(&["a", "b"]) }.encode_to_vec()].concat(),
            [vec![6], proto::DeleteRequest { keys: keys(&["a", "c"]) }.encode_to_vec()].concat(),
            [vec![7], proto::ExistsRequest { keys: keys(&["a", "zz"]) }.encode_to_vec()].concat(),
            [vec![8], proto::ListKeysRequest { page_size: 0, cursor: 0, tenant: "t".into() }.encode_to_vec()].concat(),
            [vec![8], proto::ListKeysRequest { page_size: 20_000, cursor: 3, tenant: "".into() }.encode_to_vec()]
                .concat(),
            vec![9],
            [vec![10], proto::RemovedRequest { since: 0, max: 0 }.encode_to_vec()].concat(),
            [vec![10], proto::RemovedRequest { since: 5, max: 10_001 }.encode_to_vec()].concat(),
            [vec![12], proto::InlineGetRequest { key: b("a") }.encode_to_vec()].concat(),
            [vec![12], proto::InlineGetRequest { key: b("p") }.encode_to_vec()].concat(),
            [vec![7], proto::ExistsRequest { keys: (0..70u8).map(|i| Bytes::from(vec![i])).collect() }.encode_to_vec()]
                .concat(),
            [
                vec![1],
                proto::ReserveRequest {
                    tenant: "t".into(),
                    items: (0..65u8)
                        .map(|i| proto::ReserveItem { key: Bytes::from(vec![i]), size: 70_000, ..Default::default() })
                        .collect(),
                    deadline_unix_ms: 0,
                    ..Default::default()
                }
                .encode_to_vec(),
            ]
            .concat(),
            vec![13, 0xff, 1, 0, 0, 0, 2, 0, 0, 0],
            vec![13, 0x01],
            vec![14, 0x03],
            vec![13 | 0x10, 0xff, 0],
        ];
        use proto::inline_put_chunk::Part;
        let header = |k: &str, size| proto::InlinePutChunk {
            part: Some(Part::Header(proto::InlinePutHeader { key: b(k), tenant: "t".into(), size })),
        };
        let data = |n: usize| proto::InlinePutChunk { part: Some(Part::Data(Bytes::from(vec![0x42; n]))) };
        for msgs in [
            vec![header("p", 6), data(3), data(3)],
            vec![header("q", 4), data(5)],
            vec![data(1)],
            vec![header("r", 9), data(2)],
        ] {
            let mut s = vec![INLINE_PUT as u8];
            for m in msgs {
                let m = m.encode_to_vec();
                s.extend_from_slice(&(m.len() as u16).to_le_bytes());
                s.extend_from_slice(&m);
            }
            seeds.push(s);
        }
        // Raw bodies: a good frame, a compressed flag, a truncated frame.
        seeds.push([vec![15 | 4 << 4], vec![0, 0, 0, 0, 3, 10, 1, 0x61]].concat());
        seeds.push([vec![15 | 7 << 4], vec![1, 0, 0, 0, 3, 10, 1, 0x61]].concat());
        seeds.push([vec![15 | 1 << 4], vec![0, 0, 0, 0, 9, 10, 1]].concat());
        seeds
    }

    fn run(&mut self, data: &[u8]) -> String {
        let (handler, svc) = self.server();
        if self.inputs.is_multiple_of(REAP_EVERY) {
            let _ = self.rt.block_on(handler.reap());
        }
        let mut c = Cursor::new(data);
        let sel = c.u8() as usize;
        let (method, raw) = match sel % 16 {
            15 => ((sel >> 4) % METHODS.len(), true),
            m => (m, false),
        };
        let mut body = BytesMut::new();
        let method = match method {
            _ if raw => {
                body.put_slice(c.rest());
                method
            }
            13 | 14 => {
                // Commit or abort reservations handed out before.
                let pick = c.u8();
                let ids: Vec<u64> =
                    self.ids.iter().enumerate().filter(|(i, _)| pick >> (i % 8) & 1 == 1).map(|(_, id)| *id).collect();
                let msg = if method == 13 {
                    let n = c.u8() as usize % (ids.len() + 2);
                    let crc32 = (0..n).map(|_| c.u32()).collect();
                    // Some commits bind reservations to other keys (leases).
                    let keys = if c.u8() & 1 == 1 {
                        let lens: Vec<usize> = ids.iter().map(|_| c.u8() as usize % 90).collect();
                        lens.into_iter().map(|n| (0..n).map(|_| c.u8()).collect::<Vec<u8>>().into()).collect()
                    } else {
                        vec![]
                    };
                    proto::CommitRequest { reservation_ids: ids, crc32, keys }.encode_to_vec()
                } else {
                    proto::AbortRequest { reservation_ids: ids }.encode_to_vec()
                };
                frame(&mut body, &msg);
                method - 11
            }
            INLINE_PUT => {
                while !c.is_empty() {
                    let n = c.u16() as usize;
                    frame(&mut body, c.bytes(n));
                }
                method
            }
            _ => {
                frame(&mut body, c.rest());
                method
            }
        };
        let name = METHODS[method];
        // Two client connections: reservations belong to the one that made them.
        let session = Session(1 + (!raw && sel & 0x10 != 0) as u64);
        let req = http::Request::builder()
            .method("POST")
            .uri(format!("/cxlkv.v1.Cxlkv/{name}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .extension(ConnInfo::new(session, None))
            .body(tonic::body::Body::new(Full::new(body.freeze())))
            .unwrap();
        let call = async move {
            let resp = svc.oneshot(req).await.expect("the service is infallible");
            let (parts, body) = resp.into_parts();
            let collected = body.collect().await;
            (parts, collected)
        };
        let (parts, collected) = self
            .rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(10), call).await })
            .unwrap_or_else(|_| panic!("{name}: no complete response within 10 s"));
        let (bytes, trailers) = match collected {
            Ok(c) => {
                let t = c.trailers().cloned();
                (c.to_bytes(), t)
            }
            Err(e) => return format!("{name}: body error {:?} {}", e.code(), norm(e.message())),
        };
        let status = tonic::Status::from_header_map(&parts.headers)
            .or_else(|| trailers.as_ref().and_then(tonic::Status::from_header_map));
        let (code, msg) = status.map_or((-1, String::new()), |s| (s.code() as i32, s.message().to_owned()));
        if !raw && (code == tonic::Code::Internal as i32 || code == tonic::Code::Unknown as i32) {
            panic!("{name}: the server blamed itself for a client's request: {code} {msg}");
        }
        let mut detail = String::new();
        if code == 0 {
            // The per-key outcomes, so inputs that reach new ones are kept.
            let msg = *unframe(&bytes).first().expect("a successful call has a reply");
            let codes = |st: &mut dyn Iterator<Item = u32>| {
                let mut v: Vec<u32> = st.collect();
                v.sort_unstable();
                v.dedup();
                format!(" keys {v:?}")
            };
            match name {
                "Reserve" => {
                    let reply = proto::ReserveReply::decode(msg).expect("reply decodes");
                    for r in &reply.reservations {
                        if r.status.as_ref().is_some_and(|s| s.code == 0) {
                            self.ids.push(r.reservation_id);
                        }
                    }
                    let n = self.ids.len().saturating_sub(8);
                    self.ids.drain(..n);
                    detail = codes(&mut reply.reservations.iter().map(|r| r.status.as_ref().map_or(99, |s| s.code)));
                }
                "Commit" | "Abort" | "Unlock" | "Delete" => {
                    // The four replies share field 1: repeated KeyStatus.
                    let reply = proto::UnlockReply::decode(msg).expect("reply decodes");
                    detail = codes(&mut reply.statuses.iter().map(|s| s.code));
                }
                "LookupAndLock" => {
                    let reply = proto::LookupReply::decode(msg).expect("reply decodes");
                    let hit = reply.results.iter().any(|r| r.found);
                    detail = format!(" hit {hit}{}", codes(&mut reply.unlock_statuses.iter().map(|s| s.code)));
                }
                "InlinePut" => {
                    let reply = proto::InlinePutReply::decode(msg).expect("reply decodes");
                    detail = format!(" key {}", reply.status.map_or(99, |s| s.code));
                }
                "InlineGet" => detail = format!(" messages {}", unframe(&bytes).len().min(3)),
                _ => {}
            }
        }
        format!("{}{name}: {code} {}{detail}", if raw { "raw " } else { "" }, norm(&msg))
    }
}
