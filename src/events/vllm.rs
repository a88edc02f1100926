//! The event stream in vLLM's KV-events wire format, which KV-aware routers
//! and indexers consume (vLLM's own subscriber, Dynamo's `dynamo-kv-router`
//! `zmq_wire` decoder, llm-d's `pkg/kvevents` vLLM adapter): each message
//! is a topic and the msgpack `KVEventBatch` `[ts, events, 0]`.
//!
//! Events, in vLLM 0.26's form (`Form::Map`, the default: msgspec structs
//! tagged by `type`, vllm-project/vllm#42892) or the form before it
//! (`Form::Array`, msgspec's tagged arrays):
//! - `BlockStored{block_hashes, parent_block_hash, token_ids, block_size,
//!   lora_id: null, medium, lora_name: null}`, for the first live key of a
//!   block hash;
//! - `BlockRemoved{block_hashes, medium}`, for the last;
//! - `AllBlocksCleared{}`, a source's start.
//!
//! A key whose hash another live key carries changes nothing a router
//! indexes, so it is not sent. A chunk stored with its token ids is split
//! into `block_size`-token blocks (the router's), `floor(tokens /
//! block_size)` of them, each with its own hash (`hash::BlockHash::block`:
//! the last is the chunk's hash, so the next chunk's `parent_block_hash`
//! — the chunk before it — chains on), and `token_ids` the tokens they
//! cover; its removal names the same blocks. A chunk stored without tokens
//! (or with fewer than a block) is one block, the chunk's hash, with no
//! tokens: routers that index by tokens (Dynamo, llm-d) credit nothing for
//! it.
//!
//! Topics: `[events] topic` with `{model}` replaced by the model the key
//! names (llm-d's `kv@<pod>@<model>`; the default names a shared pool,
//! `kv@pool:cxlkv@{model}`, never a pod). A batch whose events name
//! several models is sent as one message per run of one model, in order.
use bytes::Bytes;
use rmp::encode as mp;

use super::hash::{self, BlockHash};
use super::{Batch, Event, Tokens};

/// The shape of events on the wire (`[events] format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// vLLM 0.26 and later: events as maps tagged by `type`; replays as
    /// `[topic, seq, payload]`.
    Map,
    /// Before vLLM 0.26: events as tagged arrays; replays as `[seq, payload]`.
    Array,
}

/// What the vLLM-format events say besides the keys (`[events]`).
#[derive(Debug, Clone)]
pub struct Format {
    pub form: Form,
    /// With `{model}` where the key's model goes.
    pub topic: String,
    pub medium: String,
    pub block_size: u32,
}

impl Format {
    pub fn per_model(&self) -> bool {
        self.topic.contains("{model}")
    }

    fn topic_of(&self, model: &[u8]) -> Bytes {
        match self.topic.split_once("{model}") {
            Some((a, b)) => {
                let mut t = Vec::with_capacity(a.len() + model.len() + b.len());
                t.extend_from_slice(a.as_bytes());
                t.extend_from_slice(model);
                t.extend_from_slice(b.as_bytes());
                Bytes::from(t)
            }
            None => Bytes::from(self.topic.clone()),
        }
    }
}

/// One message: its topic and payload.
pub type Message = (Bytes, Bytes);

/// A batch as the messages it is sent as (none when nothing in it changes
/// the set of block hashes).
pub fn encode(b: &Batch, f: &Format) -> Vec<Message> {
    let mut out = vec![];
    let mut run: Option<(&[u8], Vec<&Event>)> = None;
    let per_model = f.per_model();
    for e in b.events.iter().filter(|e| announced(e)) {
        let model = if per_model { e.key().map_or(&[][..], hash::model) } else { &[] };
        match &mut run {
            Some((m, events)) if same_model(m, model) => events.push(e),
            _ => {
                if let Some((m, events)) = run.take() {
                    out.push((f.topic_of(m), payload(b.ts_unix_ms, &events, f)));
                }
                run = Some((model, vec![e]));
            }
        }
    }
    if let Some((m, events)) = run {
        out.push((f.topic_of(m), payload(b.ts_unix_ms, &events, f)));
    }
    out
}

/// `a == b`, without a call to `memcmp` for two empty models (a key of no
/// plugin form has none): glibc's AVX-512 `memcmp` reads an empty slice's
/// dangling pointer through a masked load, which costs a microcode assist
/// each time (a few percent of a sidecar's time under 4 KiB stores).
fn same_model(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && (a.is_empty() || a == b)
}

fn announced(e: &Event) -> bool {
    match e {
        Event::Stored { announce, .. } | Event::Removed { announce, .. } => announce.is_some(),
        Event::AllCleared => true,
    }
}

/// `[ts, [events...], data_parallel_rank]` (msgspec's array-like batch).
/// Consecutive removals are one `BlockRemoved`: a router that drops a
/// block's descendants with it (Dynamo's radix tree truncates the rest of
/// a chain) then finds each hash in the one event, not missing in the next.
fn payload(ts_unix_ms: u64, events: &[&Event], f: &Format) -> Bytes {
    let runs = runs(events);
    let mut w = Vec::with_capacity(32 + events.len() * 48);
    mp::write_array_len(&mut w, 3).expect("vec");
    mp::write_f64(&mut w, ts_unix_ms as f64 / 1e3).expect("vec");
    mp::write_array_len(&mut w, runs.len() as u32).expect("vec");
    for run in runs {
        match run[0] {
            Event::Stored { hash, tokens, .. } => stored(&mut w, *hash, tokens.as_deref(), f),
            Event::Removed { .. } => {
                let blocks = run.iter().flat_map(|e| match e {
                    Event::Removed { hash, announce, .. } => {
                        let (h, n) = (*hash, blocks(announce.unwrap_or(0), f.block_size));
                        (0..n).map(move |i| h.block(i, n))
                    }
                    _ => unreachable!("a run of removals"),
                });
                removed(&mut w, blocks.collect(), f)
            }
            Event::AllCleared => head(&mut w, f.form, "AllBlocksCleared", 0),
        }
    }
    mp::write_uint(&mut w, 0).expect("vec");
    Bytes::from(w)
}

/// Events as they are sent: each alone, but consecutive removals together.
fn runs<'a>(events: &[&'a Event]) -> Vec<Vec<&'a Event>> {
    let mut out: Vec<Vec<&Event>> = vec![];
    for &e in events {
        match (out.last_mut(), e) {
            (Some(run), Event::Removed { .. }) if matches!(run[0], Event::Removed { .. }) => run.push(e),
            _ => out.push(vec![e]),
        }
    }
    out
}

/// The router blocks a chunk of `tokens` tokens is split into (at least
/// one: a chunk with no full block is one block without tokens).
fn blocks(tokens: u32, block_size: u32) -> u32 {
    (tokens / block_size.max(1)).max(1)
}

/// An event's tag and, in the map form, the map's length (fields + tag).
fn head(w: &mut Vec<u8>, form: Form, tag: &str, fields: u32) {
    match form {
        Form::Map => {
            mp::write_map_len(w, fields + 1).expect("vec");
            mp::write_str(w, "type").expect("vec");
        }
        Form::Array => {
            mp::write_array_len(w, fields + 1).expect("vec");
        }
    }
    mp::write_str(w, tag).expect("vec");
}

fn field(w: &mut Vec<u8>, form: Form, name: &str) {
    if form == Form::Map {
        mp::write_str(w, name).expect("vec");
    }
}

fn write_hash(w: &mut Vec<u8>, h: BlockHash) {
    match h {
        BlockHash::Negative(v) => mp::write_sint(w, v).expect("vec"),
        BlockHash::NonNegative(v) => mp::write_uint(w, v).expect("vec"),
    };
}

fn stored(w: &mut Vec<u8>, h: BlockHash, tokens: Option<&Tokens>, f: &Format) {
    let bs = f.block_size.max(1) as usize;
    let full = tokens.map_or(0, |t| t.ids.len() / bs);
    let (n, ids, parent) = match tokens {
        Some(t) if full > 0 => (full as u32, &t.ids[..full * bs], t.parent),
        _ => (1, &[][..], None),
    };
    head(w, f.form, "BlockStored", 7);
    field(w, f.form, "block_hashes");
    mp::write_array_len(w, n).expect("vec");
    for i in 0..n {
        write_hash(w, h.block(i, n));
    }
    field(w, f.form, "parent_block_hash");
    match parent {
        Some(p) => write_hash(w, p),
        None => mp::write_nil(w).expect("vec"),
    }
    field(w, f.form, "token_ids");
    mp::write_array_len(w, ids.len() as u32).expect("vec");
    for &t in ids {
        mp::write_uint(w, u64::from(t)).expect("vec");
    }
    field(w, f.form, "block_size");
    mp::write_uint(w, u64::from(f.block_size)).expect("vec");
    field(w, f.form, "lora_id");
    mp::write_nil(w).expect("vec");
    field(w, f.form, "medium");
    mp::write_str(w, &f.medium).expect("vec");
    field(w, f.form, "lora_name");
    mp::write_nil(w).expect("vec");
}

fn removed(w: &mut Vec<u8>, hashes: Vec<BlockHash>, f: &Format) {
    head(w, f.form, "BlockRemoved", 2);
    field(w, f.form, "block_hashes");
    mp::write_array_len(w, hashes.len() as u32).expect("vec");
    for h in hashes {
        write_hash(w, h);
    }
    field(w, f.form, "medium");
    mp::write_str(w, &f.medium).expect("vec");
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::events::Reason;
    use crate::ids::NodeId;

    fn format(form: Form, topic: &str) -> Format {
        Format { form, topic: topic.into(), medium: "SHARED".into(), block_size: 2 }
    }

    fn stored(key: &[u8], announce: Option<u32>, tokens: Option<Tokens>) -> Event {
        Event::Stored {
            key: key.into(),
            tenant: "t".into(),
            size: 1,
            node: NodeId(1),
            commit_seq: 1,
            hash: hash::block_hash(key),
            announce,
            tokens: tokens.map(Arc::new),
        }
    }

    fn removed(key: &[u8], announce: Option<u32>) -> Event {
        let hash = hash::block_hash(key);
        Event::Removed { key: key.into(), tenant: "t".into(), size: 1, reason: Reason::Deleted, hash, announce }
    }

    /// An in-process key of model `m` whose hash is the int `h`.
    fn key(m: &[u8], h: i8) -> Vec<u8> {
        let mut k = vec![0x02, 0, m.len() as u8];
        k.extend_from_slice(m);
        k.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 1, 1, h as u8]);
        k
    }

    #[test]
    fn the_map_form_is_vllm_026s_tagged_maps_and_the_array_form_the_older_arrays() {
        let t = Tokens { ids: vec![7, 8, 9, 10, 11].into(), parent: Some(BlockHash::Negative(-3)) };
        let events = vec![Event::AllCleared, stored(&key(b"m", 5), Some(5), Some(t)), removed(&key(b"m", 5), Some(5))];
        let b = Batch::new(1, 0, 1500, events);
        let h1 = BlockHash::NonNegative(5).block(0, 2);
        let msgs = encode(&b, &format(Form::Map, ""));
        assert_eq!(msgs.len(), 1);
        let mut want = vec![0x93, 0xcb];
        want.extend_from_slice(&1.5f64.to_be_bytes());
        want.push(0x93);
        want.extend_from_slice(b"\x81\xa4type\xb0AllBlocksCleared");
        want.extend_from_slice(b"\x88\xa4type\xabBlockStored\xacblock_hashes\x92\xcf");
        want.extend_from_slice(&h1.bits().to_be_bytes());
        want.extend_from_slice(b"\x05\xb1parent_block_hash\xfd\xa9token_ids\x94\x07\x08\x09\x0a\xaablock_size\x02");
        want.extend_from_slice(b"\xa7lora_id\xc0\xa6medium\xa6SHARED\xa9lora_name\xc0");
        want.extend_from_slice(b"\x83\xa4type\xacBlockRemoved\xacblock_hashes\x92\xcf");
        want.extend_from_slice(&h1.bits().to_be_bytes());
        want.extend_from_slice(b"\x05\xa6medium\xa6SHARED\x00");
        assert_eq!(&msgs[0].1[..], &want[..]);

        let msgs = encode(&b, &format(Form::Array, ""));
        let mut want = vec![0x93, 0xcb];
        want.extend_from_slice(&1.5f64.to_be_bytes());
        want.extend_from_slice(b"\x93\x91\xb0AllBlocksCleared\x98\xabBlockStored\x92\xcf");
        want.extend_from_slice(&h1.bits().to_be_bytes());
        want.extend_from_slice(b"\x05\xfd\x94\x07\x08\x09\x0a\x02\xc0\xa6SHARED\xc0\x93\xacBlockRemoved\x92\xcf");
        want.extend_from_slice(&h1.bits().to_be_bytes());
        want.extend_from_slice(b"\x05\xa6SHARED\x00");
        assert_eq!(&msgs[0].1[..], &want[..]);
    }

    #[test]
    fn keys_that_change_no_hash_are_not_sent_and_a_chunk_without_tokens_is_one_block() {
        let events = vec![stored(b"plain", Some(0), None), stored(b"again", None, None), removed(b"x", None)];
        let b = Batch::new(1, 0, 0, events);
        let msgs = encode(&b, &format(Form::Array, ""));
        let h = hash::block_hash(b"plain");
        let mut want = b"\x91\x98\xabBlockStored\x91".to_vec();
        write_hash(&mut want, h);
        want.extend_from_slice(b"\xc0\x90\x02\xc0\xa6SHARED\xc0");
        assert!(msgs[0].1.windows(want.len()).any(|w| w == want), "one block, no tokens, no parent");
        assert!(encode(&Batch::new(1, 0, 0, vec![removed(b"x", None)]), &format(Form::Map, "")).is_empty());
    }

    #[test]
    fn consecutive_removals_are_one_block_removed() {
        let t = Tokens { ids: vec![0; 4].into(), parent: None };
        let events = vec![stored(b"s", Some(4), Some(t)), removed(b"x", Some(4)), removed(b"y", Some(0))];
        let msgs = encode(&Batch::new(1, 0, 0, events), &format(Form::Array, ""));
        let (x, y) = (hash::block_hash(b"x"), hash::block_hash(b"y"));
        let mut want = b"\x92".to_vec(); // two events: BlockStored, one BlockRemoved
        want.extend_from_slice(b"\x98\xabBlockStored");
        assert!(msgs[0].1[10..].starts_with(&want));
        let mut want = b"\x93\xacBlockRemoved\x93".to_vec();
        for h in [x.block(0, 2), x, y] {
            write_hash(&mut want, h);
        }
        assert!(msgs[0].1.windows(want.len()).any(|w| w == want), "x's two blocks and y's one, in one event");
    }

    #[test]
    fn topics_name_each_run_of_one_model_in_order() {
        let events = vec![
            Event::AllCleared,
            stored(&key(b"a", 1), Some(0), None),
            stored(&key(b"a", 2), Some(0), None),
            stored(&key(b"b", 3), Some(0), None),
            removed(&key(b"a", 1), Some(0)),
        ];
        let f = format(Form::Map, "kv@pool:cxlkv@{model}");
        let topics: Vec<Bytes> = encode(&Batch::new(1, 0, 0, events), &f).into_iter().map(|m| m.0).collect();
        let want = ["kv@pool:cxlkv@", "kv@pool:cxlkv@a", "kv@pool:cxlkv@b", "kv@pool:cxlkv@a"];
        assert_eq!(topics, want.map(|t| Bytes::from(t.as_bytes())));
    }
}
