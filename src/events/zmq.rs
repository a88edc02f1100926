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
//! The sockets are the pure-Rust `zeromq` crate's: a PUB socket keeps a
//! bounded queue per subscriber and drops for one that does not read (as
//! libzmq's high-water mark does), so no subscriber holds memory or slows
//! the others; nothing to link or ship besides the binary.
use std::sync::Arc;

use bytes::Bytes;
use rmp::encode as mp;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

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

/// End of a replay (vLLM's `END_SEQ`).
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// Batches a publisher or a replay takes from the log at once.
const READ_BATCHES: usize = 64;

/// Publish `log` on `at` until `shutdown`; bound first (an error if either
/// endpoint cannot be bound).
pub async fn serve(log: Arc<EventLog>, at: Endpoints, f: Format, shutdown: CancellationToken) -> Result<()> {
    let mut publisher = zeromq::PubSocket::new();
    bind(&mut publisher, &at.publish).await?;
    let mut replay = zeromq::RouterSocket::new();
    bind(&mut replay, &at.replay).await?;
    tracing::info!(publish = %at.publish, replay = %at.replay, "KV events published (vLLM's ZMQ format)");
    let f = Arc::new(f);
    let (l, ff, sd) = (log.clone(), f.clone(), shutdown.clone());
    tokio::spawn(async move {
        let mut sub = l.subscribe(l.next_seq(), "zmq");
        loop {
            let batches = tokio::select! {
                _ = sd.cancelled() => return,
                b = sub.next(READ_BATCHES) => match b { Some(b) => b, None => return },
            };
            for b in batches {
                let frames =
                    vec![Bytes::from(ff.topic.clone()), Bytes::copy_from_slice(&b.seq.to_be_bytes()), payload(&b, &ff)];
                let msg = ZmqMessage::try_from(frames).expect("three frames");
                if let Err(e) = publisher.send(msg).await {
                    tracing::debug!(error = %e, "KV events: publishing a batch failed");
                }
            }
        }
    });
    tokio::spawn(async move {
        loop {
            let req = tokio::select! {
                _ = shutdown.cancelled() => return,
                r = replay.recv() => r,
            };
            match req {
                Ok(m) => {
                    if let Err(e) = replay_to(&mut replay, &log, &f, m).await {
                        tracing::debug!(error = %e, "KV events: a replay's answer failed");
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "KV events: a replay request failed");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            }
        }
    });
    Ok(())
}

/// Bind `socket` to `at`, waiting up to 2 s for the last term's socket on
/// the same address to close.
async fn bind(socket: &mut impl Socket, at: &str) -> Result<()> {
    let mut tries = 0;
    loop {
        match socket.bind(at).await {
            Ok(_) => return Ok(()),
            Err(_) if tries < 20 => tries += 1,
            Err(e) => return Err(zmq_error(at, e)),
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

fn zmq_error(at: &str, e: impl std::fmt::Display) -> Error {
    Error::invalid(format!("cannot bind the KV events endpoint {at}: {e}"))
}

/// Answer a replay request (identity, empty delimiter, 8-byte start
/// sequence): every batch held from that sequence, then the end marker;
/// read from the ring a few batches at a time, so a long replay holds
/// little memory.
async fn replay_to(
    replay: &mut zeromq::RouterSocket,
    log: &EventLog,
    f: &Format,
    m: ZmqMessage,
) -> std::result::Result<(), zeromq::ZmqError> {
    let frames: Vec<Bytes> = m.into_vec();
    let (Some(id), Some(start)) = (frames.first(), frames.last()) else { return Ok(()) };
    let Ok(start) = <[u8; 8]>::try_from(&start[..]) else { return Ok(()) };
    let reply = |seq: &[u8], payload: Bytes| {
        ZmqMessage::try_from(vec![id.clone(), Bytes::new(), Bytes::copy_from_slice(seq), payload]).expect("frames")
    };
    let mut since = u64::from_be_bytes(start);
    loop {
        let (batches, _) = log.read(since, READ_BATCHES);
        let Some(last) = batches.last() else { break };
        since = last.seq + 1;
        for b in &batches {
            replay.send(reply(&b.seq.to_be_bytes(), payload(b, f))).await?;
        }
    }
    replay.send(reply(&END_SEQ, Bytes::new())).await
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
