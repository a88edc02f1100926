//! cxlkv's events as Dynamo's KV router reads them, with Dynamo's own code
//! (the `dynamo-kv-router` crate, 1.6.1): each ZMQ payload decoded by
//! `zmq_wire::decode_event_batch`, normalised and converted into router
//! events by `zmq_wire::ZmqEventNormalizer` (its `convert_event`), applied to
//! its radix-tree indexer (`radix_tree::RadixTree`), which is then asked
//! which blocks of a request's token sequence are cached
//! (`find_matches` over `protocols::compute_block_hash_for_seq`), as
//! Dynamo's router asks. cxlkv's events come in under a worker id of their
//! own (`CXLKV`), as a Dynamo ZMQ relay of a cxlkv node would file them.
//!
//! Chunks are stored through LMCache 0.5.6's in-process engine with the
//! cxlkv backend (a real LMCacheEngine on CPU, its kv events on, the token
//! sequences known): Dynamo finds every block of them; after their deletion,
//! and after eviction, it finds exactly the blocks whose chunks the sidecar
//! still holds; after a cxlkv kill -9 and restart, cxlkv's "all cleared"
//! clears cxlkv's worker only — another worker's entries stay.
use std::time::Duration;

use dynamo_check::{engine, replay, Sidecar, Sub};
use dynamo_kv_router::indexer::radix_tree::RadixTree;
use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, BlockHashOptions, KvCacheEvent, KvCacheEventData, KvCacheEventError, RouterEvent,
    StorageTier, WorkerWithDpRank,
};
use dynamo_kv_router::zmq_wire::{decode_event_batch, RawKvEvent, ZmqEventNormalizer};

const BLOCK: u32 = 16;
/// LMCache's chunk in the test engine (cxlkv_testkit.ENGINE_CHUNK_TOKENS).
const CHUNK: usize = 64;
const CXLKV: u64 = 1;
const OTHER: u64 = 2;

struct Router {
    tree: RadixTree,
    norm: ZmqEventNormalizer,
    next_id: u64,
    /// Each message's sequence, and its events' kinds.
    seen: Vec<(u64, Vec<&'static str>)>,
    late_removals: usize,
    last: Option<u64>,
}

impl Router {
    fn new() -> Self {
        Self {
            tree: RadixTree::new(),
            norm: ZmqEventNormalizer::new(BLOCK),
            next_id: 0,
            seen: vec![],
            late_removals: 0,
            last: None,
        }
    }

    /// Apply every message that comes until none has for `quiet`.
    fn pump(&mut self, sub: &mut Sub, quiet: Duration) {
        while let Some(frames) = sub.recv(quiet) {
            self.apply(frames);
        }
    }

    /// A subscriber's start (vLLM 0.26's protocol): subscribed first, then
    /// every message the source still holds from 0 replayed; a live message
    /// already replayed is skipped.
    fn join(&mut self, port: u16) -> Sub {
        let sub = Sub::connect(port, b"kv@").unwrap();
        self.last = None;
        for m in replay(port + 1, 0) {
            self.apply(m);
        }
        sub
    }

    fn apply(&mut self, frames: Vec<Vec<u8>>) {
        {
            assert_eq!(frames.len(), 3, "[topic, seq, payload]");
            assert!(frames[0].starts_with(b"kv@pool:cxlkv@"), "an llm-d pool topic");
            let seq = u64::from_be_bytes(frames[1][..8].try_into().unwrap());
            if self.last.is_some_and(|l| seq <= l) {
                return;
            }
            self.last = Some(seq);
            let batch = decode_event_batch(&frames[2]).expect("Dynamo decodes cxlkv's batch");
            let kinds = batch.events.iter().map(RawKvEvent::event_type_label).collect();
            self.seen.push((seq, kinds));
            for raw in batch.events {
                let worker = WorkerWithDpRank::new(CXLKV, batch.data_parallel_rank.unwrap_or(0) as u32);
                let removal = matches!(raw, RawKvEvent::BlockRemoved { .. });
                let cleared = matches!(raw, RawKvEvent::AllBlocksCleared { .. });
                self.next_id += 1;
                let placed = self.norm.normalize(raw, self.next_id, worker).expect("every event is kept");
                let ev = placed.into_router_event().expect("a worker's event");
                if !cleared {
                    assert_eq!(ev.storage_tier, StorageTier::External, "cxlkv's medium is a shared tier to Dynamo");
                }
                match self.tree.apply_event(ev) {
                    Ok(()) => {}
                    // A chunk evicted after its parent: the tree dropped its
                    // blocks with the parent's (Dynamo's router logs this and
                    // goes on).
                    Err(KvCacheEventError::BlockNotFound) if removal => self.late_removals += 1,
                    Err(e) => panic!("the indexer refused cxlkv's event: {e:?}"),
                }
            }
        }
    }

    /// How many leading blocks of `tokens` each worker holds.
    fn matches(&self, tokens: &[u32]) -> (u32, u32) {
        let local = compute_block_hash_for_seq(tokens, BLOCK, BlockHashOptions::default());
        let s = self.tree.find_matches(local, false).scores;
        let of = |w| s.get(&WorkerWithDpRank::new(w, 0)).copied().unwrap_or(0);
        (of(CXLKV), of(OTHER))
    }
}

fn tokens(base: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| base + i).collect()
}

/// Another worker (a vLLM engine of the fleet) that holds `seq`'s blocks.
fn other_worker_holds(r: &mut Router, seq: &[u32]) {
    let blocks = dynamo_kv_router::zmq_wire::create_stored_blocks(
        BLOCK,
        seq,
        &vec![BLOCK as u64; seq.len() / BLOCK as usize],
        &(0..(seq.len() / BLOCK as usize) as u64).map(|i| 0xaaaa_0000 + i).collect::<Vec<_>>(),
        None,
        None,
        &Default::default(),
        None,
        None,
        None,
        None,
    );
    let data = KvCacheEventData::Stored(dynamo_kv_router::protocols::KvCacheStoreData {
        parent_hash: None,
        start_position: None,
        blocks,
    });
    r.tree.apply_event(RouterEvent::new(OTHER, KvCacheEvent { event_id: 1, data, dp_rank: 0 })).unwrap();
}

#[test]
fn dynamo_finds_the_blocks_cxlkv_holds_and_a_restart_touches_no_other_worker() {
    let dir = std::env::temp_dir().join(format!("dynamo-check-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    // 16 MiB of 64 KiB chunks: room for about 200.
    let mut sc = Sidecar::start(&dir, port, "16MiB");
    let mut r = Router::new();
    let mut sub = r.join(port);
    let quiet = Duration::from_millis(1500);
    r.pump(&mut sub, quiet);
    assert_eq!(r.seen.first().map(|s| (s.0, s.1[0])), Some((0, "cleared")), "a source's message 0: all cleared");

    // Three full chunks and a partial one (not stored by LMCache).
    let a = tokens(1000, 3 * CHUNK + 10);
    assert_eq!(engine(&sc.socket, "store", &[&a]), "STORED 3");
    r.pump(&mut sub, quiet);
    assert_eq!(r.matches(&a).0, 3 * (CHUNK as u32 / BLOCK), "every block of the stored chunks");
    assert_eq!(r.matches(&tokens(5000, 3 * CHUNK)).0, 0, "nothing of a sequence never stored");

    let c = tokens(90_000, 2 * CHUNK);
    other_worker_holds(&mut r, &c);
    assert_eq!(r.matches(&c), (0, 2 * CHUNK as u32 / BLOCK));

    // Deleted: gone from Dynamo's index.
    assert_eq!(engine(&sc.socket, "delete", &[&a]), "DELETED 3");
    r.pump(&mut sub, quiet);
    assert_eq!(r.matches(&a).0, 0, "deleted chunks are not found");
    assert_eq!(r.late_removals, 0, "one Delete's removals are one BlockRemoved: every hash found");

    // Evicted: stored again, then the pool flooded with other sequences.
    assert_eq!(engine(&sc.socket, "store", &[&a]), "STORED 3");
    r.pump(&mut sub, quiet);
    assert_eq!(r.matches(&a).0, 12);
    // FIFO eviction (the test sidecar's policy): the oldest chunks go first.
    let flood: Vec<Vec<u32>> = (0..80).map(|i| tokens(200_000 + i * 10_000, 4 * CHUNK)).collect();
    let refs: Vec<&[u32]> = flood.iter().map(Vec::as_slice).collect();
    engine(&sc.socket, "store", &refs);
    r.pump(&mut sub, quiet);
    let present: u32 = engine(&sc.socket, "present", &[&a]).split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(present < 3, "the flood evicted some of the first sequence");
    assert_eq!(r.matches(&a).0, present * (CHUNK as u32 / BLOCK), "exactly the blocks still held");
    let last = flood.last().unwrap();
    assert_eq!(r.matches(last).0, 4 * (CHUNK as u32 / BLOCK), "the newest sequence is found whole");

    // A cxlkv crash and restart: its stream starts again at 0 with "all
    // cleared", which Dynamo applies to cxlkv's worker alone.
    sc.kill();
    r.seen.clear();
    sc.spawn("16MiB");
    let mut sub = r.join(port);
    r.pump(&mut sub, quiet);
    let (seq, kinds) = r.seen.first().expect("the restarted source's stream");
    assert_eq!((*seq, kinds.first().copied()), (0, Some("cleared")), "numbered from 0, all cleared first");
    assert_eq!(r.matches(&c), (0, 2 * CHUNK as u32 / BLOCK), "the other worker's entries are untouched");
    assert_eq!(r.matches(last).0, 0, "cxlkv's restored chunks carry no tokens: Dynamo credits none of them");
    let _ = std::fs::remove_dir_all(&dir);
}
