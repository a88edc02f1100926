//! The event plane against the real binary, through the gRPC stream
//! (`WatchEvents`): a subscriber that applies the events rebuilds exactly
//! the keys the sidecar holds (stores, deletes, evictions, in order, with
//! reasons); `since` replays what the ring holds and anything else is
//! OUT_OF_RANGE with the way to resynchronise; a tenant-bound client sees
//! only its tenants' events; a warm restart is a new epoch that clears and
//! lists what survived; `cxlkv status` and `cxlkv events` show the source.
mod common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::time::Duration;

use common::*;
use cxlkv::auth::ClientAuth;
use cxlkv::client::Client;
use cxlkv::proto::{self, event::Kind};
use tonic::Streaming;

/// (tenant, key) as the events and ListKeys name them.
type Keys = BTreeSet<(String, Vec<u8>)>;

/// A subscriber's view: the key set rebuilt from the events, and where it is.
#[derive(Default)]
struct Model {
    keys: Keys,
    epoch: u64,
    next: u64,
    reasons: BTreeSet<String>,
    stored: usize,
    commit_seqs: Vec<u64>,
}

impl Model {
    /// Apply one batch; panics on a gap or a repeat (nothing may be lost or
    /// reordered), or on a removal of a key it never saw stored.
    fn apply(&mut self, b: &proto::EventBatch) {
        if b.epoch != self.epoch {
            self.epoch = b.epoch;
        } else {
            assert_eq!(b.seq, self.next, "batches of one epoch are consecutive (no gap, no repeat)");
        }
        self.next = b.seq + 1;
        for e in &b.events {
            let k = (e.tenant.clone(), e.key.to_vec());
            match Kind::try_from(e.kind).unwrap() {
                Kind::AllCleared => self.keys.clear(),
                Kind::Stored => {
                    assert!(self.keys.insert(k.clone()), "{k:?} stored twice without a removal between");
                    assert!(e.size > 0 && e.commit_seq > 0, "a stored event names its size and commit: {e:?}");
                    self.stored += 1;
                    self.commit_seqs.push(e.commit_seq);
                }
                Kind::Removed => {
                    assert!(self.keys.remove(&k), "{k:?} removed ({}) but never stored", e.reason);
                    self.reasons.insert(e.reason.clone());
                }
            }
        }
    }
}

async fn watch(c: &mut Client, epoch: u64, since: u64) -> Result<Streaming<proto::EventBatch>, tonic::Status> {
    Ok(c.watch_events(proto::WatchEventsRequest { epoch, since }).await?.into_inner())
}

/// Read batches into `m` until `done(m)`, within 10 s.
async fn read_until(s: &mut Streaming<proto::EventBatch>, m: &mut Model, done: impl Fn(&Model) -> bool) {
    let t = tokio::time::Instant::now() + Duration::from_secs(10);
    while !done(m) {
        let b = tokio::time::timeout_at(t, s.message()).await.expect("events within 10 s").unwrap();
        m.apply(&b.expect("the stream stays open"));
    }
}

/// Every key the sidecar holds, paged through ListKeys.
async fn listed(c: &mut Client) -> Keys {
    let (mut out, mut cursor) = (Keys::new(), 0);
    loop {
        let r = c.list_keys(proto::ListKeysRequest { page_size: 7, cursor, tenant: String::new() }).await.unwrap();
        let r = r.into_inner();
        out.extend(r.keys.iter().map(|k| (k.tenant.clone(), k.key.to_vec())));
        if r.next_cursor == 0 {
            return out;
        }
        cursor = r.next_cursor;
    }
}

async fn source(c: &mut Client) -> proto::EventSource {
    stats(c).await.events.expect("stats name the event source")
}

/// 200 one-page stores into a pool of far fewer pages (evictions), 30
/// deletes among them: the subscriber's set is the sidecar's, every
/// removal has its reason, commit sequences only grow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_rebuilds_the_key_set_from_stores_deletes_and_evictions() {
    let (_dir, s, mut c, mut m) = one_sidecar(&[]).await;
    let mut sub = watch(&mut s.client().await, 0, 0).await.unwrap();
    let mut model = Model::default();
    read_until(&mut sub, &mut model, |m| m.epoch != 0).await;
    for i in 0..200 {
        let k = format!("k{i}");
        assert_eq!(store(&mut c, &mut m, "t", &[(&k, pattern(i, 40_000))]).await, [0], "{k}");
        if i % 7 == 3 {
            let d = delete(&mut c, &[&format!("k{}", i - 1)]).await;
            assert!(d.statuses[0].code == 0 || d.statuses[0].code == tonic::Code::NotFound as u32);
        }
    }
    let want = listed(&mut c).await;
    assert!(want.len() < 150, "the pool evicted: it holds {} of 200", want.len());
    read_until(&mut sub, &mut model, |m| m.stored == 200 && m.keys == want).await;
    assert_eq!(model.reasons, BTreeSet::from(["deleted".to_string(), "evicted".to_string()]));
    assert!(model.commit_seqs.windows(2).all(|w| w[0] < w[1]), "stored in the order committed");
    let src = source(&mut c).await;
    assert_eq!((src.kind.as_str(), src.epoch, src.subscribers), ("source", model.epoch, 1));
    assert_eq!(src.next_seq, model.next, "the subscriber has every batch published");
}

/// A small ring (4 batches): `since` inside it replays from there; before
/// it, after the next batch, or in another epoch is OUT_OF_RANGE saying
/// how to resynchronise, and a replay from the oldest held continues live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn since_replays_what_the_ring_holds_and_anything_else_is_out_of_range() {
    let dir = tempfile::tempdir().unwrap();
    let s = Sidecar::with_config(dir.path(), "a", "[events]\nring_batches = 4\nbatch_delay_ms = 1\n", &[]);
    let (mut c, mut m) = (s.client().await, PoolMap::open(&mut s.client().await).await);
    let first = source(&mut c).await;
    // Past the batch delay each store is (nearly always) its own batch:
    // store until twice the ring's batches are published.
    let mut src = first.clone();
    for i in 0..100 {
        assert_eq!(store(&mut c, &mut m, "", &[(&format!("r{i}"), pattern(i, 1000))]).await, [0]);
        tokio::time::sleep(Duration::from_millis(15)).await;
        src = source(&mut c).await;
        if src.next_seq >= first.next_seq + 8 {
            break;
        }
    }
    assert!(src.next_seq >= first.next_seq + 8, "{first:?} → {src:?}: stores published as batches");
    assert_eq!(src.next_seq - src.oldest_seq, 4, "the ring holds 4 batches: {src:?}");

    let mut model = Model::default();
    // Two batches back: still held even if the last store's batch is
    // published after `src` was read.
    let since = src.next_seq - 2;
    let mut replay = watch(&mut c, src.epoch, since).await.unwrap();
    let b = replay.message().await.unwrap().unwrap();
    assert_eq!((b.epoch, b.seq), (src.epoch, since), "a replay starts where asked");
    model.apply(&b);
    read_until(&mut replay, &mut model, |m| m.next == src.next_seq).await;
    assert_eq!(store(&mut c, &mut m, "", &[("live", pattern(99, 1000))]).await, [0]);
    read_until(&mut replay, &mut model, |m| m.keys.contains(&(String::new(), b"live".to_vec()))).await;

    for (epoch, since, why) in [
        (src.epoch, first.next_seq, "is no longer held"),
        (src.epoch, src.next_seq + 100, "was never published"),
        (src.epoch + 1, since, "is over"),
    ] {
        let e = watch(&mut c, epoch, since).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::OutOfRange, "epoch {epoch} since {since}: {e:?}");
        assert!(e.message().contains(why) && e.message().contains("resynchronise"), "{}", e.message());
    }
}

const OPERATOR: &str = "op-0123456789abcdef";
const ALICE: &str = "alice-0123456789abcdef";

/// Alice's token binds her to tenant `alice`: her stream has the same
/// batches as the operator's (sequences agree) with only her events in them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_bound_subscriber_sees_only_its_tenants_events() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, format!("{OPERATOR} *\n{ALICE} alice\n")).unwrap();
    let toml = format!("[auth]\ntokens_file = {:?}\nsocket_requires_token = true\n", tokens.display().to_string());
    let s = Sidecar::with_config(dir.path(), "a", &toml, &[]);
    let connect = async |name: &str, token: &str| {
        let file = dir.path().join(name);
        std::fs::write(&file, token).unwrap();
        ClientAuth { token_file: Some(file), ..Default::default() }.connect_uds(&s.socket).await.unwrap()
    };
    let (mut op, mut alice) = (connect("op", OPERATOR).await, connect("alice", ALICE).await);
    let w = |epoch, since| proto::WatchEventsRequest { epoch, since };
    let mut op_sub = op.watch_events(w(0, 0)).await.unwrap().into_inner();
    let mut alice_sub = alice.watch_events(w(0, 0)).await.unwrap().into_inner();
    for (i, tenant) in ["bob", "alice", "bob", "alice", "bob"].into_iter().enumerate() {
        let h = proto::InlinePutHeader { key: key(&format!("k{i}")), tenant: tenant.into(), size: 3 };
        let msgs = vec![
            proto::InlinePutChunk { part: Some(proto::inline_put_chunk::Part::Header(h)) },
            proto::InlinePutChunk {
                part: Some(proto::inline_put_chunk::Part::Data(bytes::Bytes::from_static(b"abc"))),
            },
        ];
        let r = op.inline_put(tokio_stream::iter(msgs)).await.unwrap().into_inner();
        assert_eq!(r.status.unwrap().code, 0);
    }
    assert_eq!(
        op.delete(proto::DeleteRequest { keys: vec![key("k0"), key("k1")] }).await.unwrap().into_inner().sizes.len(),
        2
    );
    let (mut all, mut hers) = (Model::default(), Model::default());
    read_until(&mut op_sub, &mut all, |m| m.stored == 5 && m.keys.len() == 3).await;
    let end = all.next;
    read_until(&mut alice_sub, &mut hers, |m| m.next == end).await;
    let tenants = |m: &Model| m.keys.iter().map(|k| k.0.clone()).collect::<BTreeSet<_>>();
    assert_eq!(tenants(&all), BTreeSet::from(["alice".to_string(), "bob".to_string()]));
    assert_eq!(hers.keys, all.keys.iter().filter(|k| k.0 == "alice").cloned().collect::<Keys>());
    assert_eq!((hers.stored, hers.reasons.len()), (2, 1), "her two stores and her key's deletion, nothing of bob's");
}

/// Stop (SIGTERM) and start again on the same pool: a new epoch whose first
/// batch clears everything and then lists every key that survived, numbered
/// after the old epoch's batches; the old epoch is OUT_OF_RANGE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_restart_is_a_new_epoch_that_clears_then_lists_what_survived() {
    let (_dir, mut s, mut c, mut m) = one_sidecar(&[]).await;
    for i in 0..6 {
        assert_eq!(store(&mut c, &mut m, "t", &[(&format!("w{i}"), pattern(i, 70_000))]).await, [0]);
    }
    assert_eq!(delete(&mut c, &["w2"]).await.statuses[0].code, 0);
    let before = listed(&mut c).await;
    let old = source(&mut c).await;
    drop((c, m));
    s.stop();
    s.spawn(&[]);
    let mut c = s.client().await;
    let mut sub = watch(&mut c, 0, 0).await.unwrap();
    let first = sub.message().await.unwrap().unwrap();
    assert_ne!(first.epoch, old.epoch, "a restart starts a new epoch");
    assert_eq!(first.seq, 0, "numbered from 0 again, as vLLM numbers a publisher's batches");
    assert_eq!(Kind::try_from(first.events[0].kind).unwrap(), Kind::AllCleared, "the new epoch clears first");
    let mut model = Model::default();
    model.apply(&first);
    read_until(&mut sub, &mut model, |m| m.keys.len() >= before.len()).await;
    assert_eq!(model.keys, before, "the restored keys, as stored events");
    let e = watch(&mut c, old.epoch, old.next_seq - 1).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::OutOfRange, "{e:?}");
}

/// `[events] enabled = false`: WatchEvents is FAILED_PRECONDITION, stats
/// name no source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_events_off_watching_is_a_failed_precondition() {
    let dir = tempfile::tempdir().unwrap();
    let s = Sidecar::with_config(dir.path(), "a", "[events]\nenabled = false\n", &[]);
    let mut c = s.client().await;
    let e = watch(&mut c, 0, 0).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(stats(&mut c).await.events.is_none());
}

/// `cxlkv status` names the source; `cxlkv events` prints each event as a
/// line (a stored key by name).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_names_the_source_and_cxlkv_events_prints_the_stream() {
    let (_dir, s, mut c, mut m) = one_sidecar(&[]).await;
    let out = run_cxlkv(["status", "--socket", s.socket.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("events: this node is the source"), "{text}");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_cxlkv"))
        .args(["events", "--socket", s.socket.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let reader = std::thread::spawn(move || {
        let mut seen = vec![];
        for l in lines.map_while(Result::ok) {
            let done = l.contains("key=printed-key");
            seen.push(l);
            if done {
                break;
            }
        }
        seen
    });
    eventually("cxlkv events subscribed", Duration::from_secs(10), async || source(&mut c).await.subscribers == 1)
        .await;
    assert_eq!(store(&mut c, &mut m, "t", &[("printed-key", pattern(1, 100))]).await, [0]);
    let seen = reader.join().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(seen[0].contains("all_cleared"), "{seen:?}");
    let last = seen.last().unwrap();
    assert!(last.contains("stored") && last.contains("tenant=\"t\"") && last.contains("size=100"), "{last}");
}
