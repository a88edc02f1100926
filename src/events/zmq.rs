//! The event stream in vLLM's KV-events wire format, which KV-aware
//! routers and indexers consume as they are (vLLM's own subscriber,
//! Dynamo's router through its ZMQ relay, llm-d's indexer): a ZMQ PUB
//! socket sends each batch as three frames — topic, the batch's sequence as
//! 8 big-endian bytes, the msgpack `KVEventBatch` `[ts, events, 0]` — and a
//! ROUTER socket replays the batches still held from a sequence a
//! subscriber asks for (8 big-endian bytes), ending with sequence -1 and an
//! empty payload. Events (msgspec's tagged arrays):
//! `["BlockStored", [hash], null, [], block_size, null, medium, null]`,
//! `["BlockRemoved", [hash], medium]`, `["AllBlocksCleared"]`. BlockStored
//! ends with `lora_name` (null): vLLM's array-like `BlockStored` made it a
//! field without a default when it added it, so there a 7-element array
//! fails to decode ("Expected `array` of at least length 8"), while the
//! releases before it skip the extra trailing field. (vLLM later dropped
//! `array_like` from its events, vllm-project/vllm#42892: those releases
//! publish events as maps; consumers such as llm-d's accept both.)
//!
//! A key's block hash (`block_hash`) is the LMCache chunk hash its key
//! names: the plugin's binary keys (a multiprocess server's `0x01 …`, the
//! in-process engine's `0x02 …`) carry it — a hash LMCache made from a
//! Python int is that int again, one made of bytes is its first 8 bytes,
//! big-endian, signed — and any other key is its 64-bit FNV-1a. The
//! sidecar knows no tokens: `token_ids` is empty, `parent_block_hash`,
//! `lora_id` and `lora_name` are null, `block_size` is `[events]
//! block_size` (LMCache's chunk size), `medium` is `[events] medium`
//! ("cxl").
//!
//! The sockets speak ZMTP 3.0 themselves (`zmtp`), in Rust, nothing to
//! link or ship besides the binary: the PUB side keeps a queue per
//! subscriber bounded in batches and bytes and drops a batch that does not
//! fit for that subscriber alone, counted (as libzmq's high-water mark
//! drops, which it does not count); the replay side answers each peer on
//! its own connection at the pace it reads. (The `zeromq` crate's sockets,
//! used first, queue 100,000 messages per peer, not configurable: a
//! stalled subscriber held everything published meanwhile, and a replay
//! peer that did not read blocked every replay.)
use std::sync::Arc;

use bytes::Bytes;
use rmp::encode as mp;
use tokio_util::sync::CancellationToken;

use super::zmtp;
use super::{Batch, Event, EventLog};
use crate::error::{Error, Result};

/// What the vLLM-format events say besides the keys (`[events]`).
#[derive(Debug, Clone)]
pub struct Format {
    pub topic: String,
    pub medium: String,
    pub block_size: u32,
}

/// The ZMQ PUB endpoint and the replay ROUTER endpoint (`tcp://host:port`).
#[derive(Debug, Clone)]
pub struct Endpoints {
    pub publish: String,
    pub replay: String,
}

/// Batches the publisher takes from the log at once.
const READ_BATCHES: usize = 64;

/// Publish `log` on `at` until `shutdown`; bound first (an error if either
/// endpoint cannot be bound).
pub async fn serve(log: Arc<EventLog>, at: Endpoints, f: Format, shutdown: CancellationToken) -> Result<()> {
    let publish = bind_tcp(&at.publish).await?;
    let replay = bind_tcp(&at.replay).await?;
    tracing::info!(publish = %at.publish, replay = %at.replay, "KV events published (vLLM's ZMQ format)");
    let f = Arc::new(f);
    let peers = Arc::new(zmtp::Peers::default());
    tokio::spawn(zmtp::accept_subscribers(publish, peers.clone(), shutdown.clone()));
    let encode: zmtp::Encode = {
        let f = f.clone();
        Arc::new(move |b: &Batch| payload(b, &f))
    };
    tokio::spawn(zmtp::accept_replays(replay, log.clone(), encode, shutdown.clone()));
    tokio::spawn(async move {
        let mut sub = log.subscribe(log.next_seq(), "zmq");
        let topic = Bytes::from(f.topic.clone());
        loop {
            let batches = tokio::select! {
                _ = shutdown.cancelled() => return,
                b = sub.next(READ_BATCHES) => match b { Some(b) => b, None => return },
            };
            for b in batches {
                let frames = [topic.clone(), Bytes::copy_from_slice(&b.seq.to_be_bytes()), payload(&b, &f)];
                peers.publish(Arc::new(frames));
            }
        }
    });
    Ok(())
}

/// Bind an endpoint's TCP listener, waiting up to 2 s for the last term's
/// socket on the same address to close.
async fn bind_tcp(at: &str) -> Result<tokio::net::TcpListener> {
    let addr: std::net::SocketAddr = at
        .strip_prefix("tcp://")
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| Error::invalid(format!("events endpoint {at:?} is not tcp://ip:port")))?;
    let mut tries = 0;
    loop {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => return Ok(l),
            Err(_) if tries < 20 => tries += 1,
            Err(e) => return Err(zmq_error(at, e)),
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

fn zmq_error(at: &str, e: impl std::fmt::Display) -> Error {
    Error::invalid(format!("cannot bind the KV events endpoint {at}: {e}"))
}

/// The batch as vLLM's msgpack `KVEventBatch`, encoded once.
fn payload(b: &Batch, f: &Format) -> Bytes {
    b.vllm.get_or_init(|| encode(b, f)).clone()
}

/// `[ts, [events...], data_parallel_rank]` (msgspec's array-like structs).
pub fn encode(b: &Batch, f: &Format) -> Bytes {
    let mut w = Vec::with_capacity(32 + b.events.len() * 24);
    mp::write_array_len(&mut w, 3).expect("vec");
    mp::write_f64(&mut w, b.ts_unix_ms as f64 / 1e3).expect("vec");
    mp::write_array_len(&mut w, b.events.len() as u32).expect("vec");
    for e in &b.events {
        match e {
            Event::Stored { key, .. } => {
                mp::write_array_len(&mut w, 8).expect("vec");
                mp::write_str(&mut w, "BlockStored").expect("vec");
                mp::write_array_len(&mut w, 1).expect("vec");
                mp::write_sint(&mut w, block_hash(key)).expect("vec");
                mp::write_nil(&mut w).expect("vec");
                mp::write_array_len(&mut w, 0).expect("vec");
                mp::write_uint(&mut w, u64::from(f.block_size)).expect("vec");
                mp::write_nil(&mut w).expect("vec");
                mp::write_str(&mut w, &f.medium).expect("vec");
                mp::write_nil(&mut w).expect("vec"); // lora_name
            }
            Event::Removed { key, .. } => {
                mp::write_array_len(&mut w, 3).expect("vec");
                mp::write_str(&mut w, "BlockRemoved").expect("vec");
                mp::write_array_len(&mut w, 1).expect("vec");
                mp::write_sint(&mut w, block_hash(key)).expect("vec");
                mp::write_str(&mut w, &f.medium).expect("vec");
            }
            Event::AllCleared => {
                mp::write_array_len(&mut w, 1).expect("vec");
                mp::write_str(&mut w, "AllBlocksCleared").expect("vec");
            }
        }
    }
    mp::write_uint(&mut w, 0).expect("vec");
    Bytes::from(w)
}

/// The block hash of a key (see the module's doc).
pub fn block_hash(key: &[u8]) -> i64 {
    chunk_hash(key).map_or_else(|| fnv1a(key) as i64, |(h, int)| hash_value(h, int))
}

/// The chunk hash a plugin key carries, and whether LMCache made it from
/// a Python int (an in-process key whose flags say so).
fn chunk_hash(k: &[u8]) -> Option<(&[u8], bool)> {
    let at = |i: usize| k.get(i).copied().map(usize::from);
    let hash = |o: usize| {
        let n = at(o)?;
        k.get(o + 1..o + 1 + n)
    };
    match *k.first()? {
        // 0x01 | len(model) | model | i32 kv_rank | u32 group | len(hash) | hash | salt
        0x01 => Some((hash(2 + at(1)? + 8)?, false)),
        // 0x02 | flags | len(model) | model | u32 world | u32 worker | dtype
        //      | [u32 layer] | len(hash) | hash | tags
        0x02 => {
            let flags = at(1)?;
            let o = 3 + at(2)? + 9 + if flags & 1 != 0 { 4 } else { 0 };
            Some((hash(o)?, flags & 2 == 0))
        }
        _ => None,
    }
}

/// An int's big-endian signed bytes back to the int (LMCache's own hash
/// when it fits 64 bits); bytes: their first 8, big-endian.
fn hash_value(h: &[u8], int: bool) -> i64 {
    if int && h.len() <= 8 {
        let fill = if h.first().is_some_and(|b| b & 0x80 != 0) { 0xff } else { 0 };
        let mut b = [fill; 8];
        b[8 - h.len()..].copy_from_slice(h);
        return i64::from_be_bytes(b);
    }
    let mut b = [0u8; 8];
    if h.len() >= 8 {
        b.copy_from_slice(&h[..8]);
    } else {
        b[8 - h.len()..].copy_from_slice(h);
    }
    i64::from_be_bytes(b)
}

fn fnv1a(k: &[u8]) -> u64 {
    k.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_vllms_tagged_arrays_block_stored_with_lora_name() {
        let f = Format { topic: String::new(), medium: "cxl".into(), block_size: 256 };
        let stored = Event::Stored {
            key: b"k".to_vec().into(),
            tenant: "t".into(),
            size: 1,
            node: crate::ids::NodeId(1),
            commit_seq: 1,
        };
        let removed = Event::Removed {
            key: b"k".to_vec().into(),
            tenant: "t".into(),
            size: 1,
            reason: super::super::Reason::Deleted,
        };
        let events = vec![Event::AllCleared, stored, removed];
        let b = Batch { epoch: 1, seq: 7, ts_unix_ms: 1500, events, vllm: Default::default() };
        let h = block_hash(b"k");
        let mut want = vec![0x93, 0xcb];
        want.extend_from_slice(&1.5f64.to_be_bytes());
        want.push(0x93);
        want.extend_from_slice(b"\x91\xb0AllBlocksCleared");
        // BlockStored: 8 elements, lora_name (nil) last.
        want.extend_from_slice(b"\x98\xabBlockStored\x91\xd3");
        want.extend_from_slice(&h.to_be_bytes());
        want.extend_from_slice(b"\xc0\x90\xcd\x01\x00\xc0\xa3cxl\xc0");
        want.extend_from_slice(b"\x93\xacBlockRemoved\x91\xd3");
        want.extend_from_slice(&h.to_be_bytes());
        want.extend_from_slice(b"\xa3cxl\x00");
        assert_eq!(&encode(&b, &f)[..], &want[..]);
    }

    #[test]
    fn block_hashes_are_the_chunk_hashes_plugin_keys_carry() {
        // A multiprocess key: model "m", rank 0, group 0, hash 01..08, salt.
        let mut k = vec![0x01, 1, b'm', 0, 0, 0, 0, 0, 0, 0, 0, 8];
        k.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        k.extend_from_slice(b"salt");
        assert_eq!(block_hash(&k), 0x0102_0304_0506_0708);
        // An in-process key whose hash LMCache made from the int -5.
        let mut k = vec![0x02, 0, 1, b'm', 0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0xfb];
        k.extend_from_slice(b"\x0acache_salt\x00\x01x");
        assert_eq!(block_hash(&k), -5);
        // The same, a layer key (a u32 layer id before the hash).
        let k = vec![0x02, 1, 1, b'm', 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 7, 2, 0x01, 0x00];
        assert_eq!(block_hash(&k), 256);
        // Anything else: FNV-1a.
        assert_eq!(block_hash(b"plain"), fnv1a(b"plain") as i64);
        // A key that claims a plugin form but is cut short: FNV-1a too.
        assert_eq!(block_hash(&[0x01, 200]), fnv1a(&[0x01, 200]) as i64);
    }
}
