//! Admission through the registry and the local directory: the gate, its
//! history, the adaptive mode's choice, and what a declined store leaves
//! (nothing reserved, nothing evicted).
use std::sync::Arc;

use super::ops::ReserveCall;
use super::*;
use crate::error::ErrorKind;

const PAGE: u64 = 4096;
const NODE: NodeId = NodeId(1);

fn loc(i: u64) -> Location {
    Location { node: NODE, region: RegionId(0), offset: i * PAGE, length: PAGE, generation: 1, version: 0 }
}

fn key(i: u64) -> Vec<u8> {
    format!("k{i}").into_bytes()
}

fn registry(mode: AdmissionMode) -> LocalRegistry {
    LocalRegistry::new("lru", 64).unwrap().with_admission(AdmissionConfig { mode, ..AdmissionConfig::default() })
}

/// A fixed gate on a full registry: 100 keys held, one evicted (the gate
/// applies while the cache evicts; the evicted key is remembered).
fn gated() -> LocalRegistry {
    let r = registry(AdmissionMode::SecondTouch);
    (0..100).for_each(|i| store(&r, 1_000_000_000 + i));
    assert_eq!(r.evict(NODE, 1, PAGE, 0).len(), 1);
    r
}

/// Admission's verdict on storing key `i`.
fn judge(r: &LocalRegistry, i: u64) -> Admit {
    r.admit(&[(&key(i), PAGE)])[0]
}

/// Store key `i` outright (reserve and commit, no judgement).
fn store(r: &LocalRegistry, i: u64) {
    let id = r.reserve("t", vec![(key(i), loc(i))], ReserveOpts::local(u64::MAX)).remove(0).unwrap();
    r.commit(&[id], Session::LOCAL, &mut |_, _| {}).0.remove(0).unwrap();
}

#[test]
fn a_fixed_gate_admits_a_key_on_its_second_store_and_an_evicted_key_at_once() {
    // A registry with room admits everything, the fixed gate too.
    let r = registry(AdmissionMode::SecondTouch);
    assert_eq!((judge(&r, 50), r.stats().admission.gating), (Admit::Admitted, false));
    let r = gated();
    assert_eq!(judge(&r, 1), Admit::Refused, "never seen");
    assert_eq!(judge(&r, 1), Admit::Admitted, "seen once before");
    store(&r, 1);
    assert_eq!(judge(&r, 1), Admit::Present, "present keys are not judged");
    // An evicted key was stored once: its next store is a second touch
    // (the oldest of `gated`'s keys, LRU's victim there).
    assert_eq!(judge(&r, 1_000_000_000), Admit::Admitted);
    let a = r.stats().admission;
    assert_eq!((a.mode, a.gating, a.admitted, a.refused), (AdmissionMode::SecondTouch, true, 2, 1));
    // A lookup is no touch of its own: the store after its miss is judged
    // as the first.
    assert!(r.lookup_and_lock(&[&key(2)], 1000, 0)[0].is_none());
    assert_eq!(judge(&r, 2), Admit::Refused);
}

#[test]
fn off_admits_everything_and_keeps_no_history() {
    let r = registry(AdmissionMode::Off);
    for i in 0..1000 {
        assert_eq!(judge(&r, i), Admit::Admitted);
    }
    let a = r.stats().admission;
    assert_eq!((a.gating, a.admitted, a.refused, a.history_bytes, a.shadow_bytes), (false, 1000, 0, 0, 0));
    // A registry built without admission is off.
    let plain = LocalRegistry::new("lru", 64).unwrap();
    assert_eq!(plain.admit(&[(b"x", 1)]), vec![Admit::Admitted]);
    assert_eq!(plain.stats().admission.mode, AdmissionMode::Off);
}

/// A cache of `cap` entries under a workload: each step looks `keys` up,
/// then judges the misses and stores the admitted ones, evicting the
/// shortfall first (as the handler does). Returns the lookups' hits.
fn run(r: &LocalRegistry, cap: u64, steps: impl Iterator<Item = Vec<u64>>) -> u64 {
    let (mut hits, mut held) = (0, 0u64);
    for (now, keys) in steps.enumerate() {
        let ks: Vec<Vec<u8>> = keys.iter().map(|&k| key(k)).collect();
        let refs: Vec<&[u8]> = ks.iter().map(|k| k.as_slice()).collect();
        let found = r.lookup_and_lock(&refs, 1000, now as u64);
        let hit: Vec<&[u8]> = refs.iter().zip(&found).filter(|(_, f)| f.is_some()).map(|(k, _)| *k).collect();
        hits += hit.len() as u64;
        r.unlock(&hit, now as u64);
        for (&k, f) in keys.iter().zip(&found) {
            if f.is_some() || judge(r, k) != Admit::Admitted {
                continue;
            }
            if held == cap {
                held -= r.evict(NODE, 1, PAGE, now as u64).len() as u64;
            }
            store(r, k);
            held += 1;
        }
    }
    hits
}

/// A hot set of 40 keys read in turn, each step also bringing 2 keys
/// never seen again: a cache of 50 that admits everything keeps washing
/// the hot set out; one that admits second touches keeps it.
fn one_hit_stream(steps: u64) -> impl Iterator<Item = Vec<u64>> {
    (0..steps).map(|s| vec![s % 40, 1_000_000 + 2 * s, 1_000_001 + 2 * s])
}

#[test]
fn adaptive_gates_where_the_gate_keeps_more_hits_and_admits_all_where_it_loses_them() {
    let steps = 20_000;
    let gated = registry(AdmissionMode::Adaptive);
    let with = run(&gated, 50, one_hit_stream(steps));
    let a = gated.stats().admission;
    assert!(a.gating && a.refused > steps, "one-hit keys are refused: {a:?}");
    let without = run(&registry(AdmissionMode::Off), 50, one_hit_stream(steps));
    assert!(with > without + steps / 2, "the gate keeps the hot set: {with} hits vs {without}");
    // Keys read exactly twice, the second time soon: the gate would lose
    // every hit, so the adaptive mode admits everything.
    let twice = |steps: u64| (0..steps).map(|s| vec![s, s.saturating_sub(3)]);
    let adaptive = registry(AdmissionMode::Adaptive);
    let adaptive_hits = run(&adaptive, 50, twice(steps));
    let all_hits = run(&registry(AdmissionMode::Off), 50, twice(steps));
    let gate_hits = run(&registry(AdmissionMode::SecondTouch), 50, twice(steps));
    assert!(!adaptive.stats().admission.gating);
    assert!(gate_hits < all_hits / 2, "{gate_hits} vs {all_hits}");
    assert!(adaptive_hits * 100 >= all_hits * 98, "never much worse than admitting all: {adaptive_hits} vs {all_hits}");
}

#[test]
fn adaptive_admits_everything_while_the_cache_has_room() {
    // Nothing evicted: no pressure, whatever the simulations say.
    let r = registry(AdmissionMode::Adaptive);
    assert_eq!(run(&r, u64::MAX, one_hit_stream(5_000)), 4_960);
    let a = r.stats().admission;
    assert_eq!((a.gating, a.refused), (false, 0));
}

#[test]
fn the_history_stays_within_its_bound_under_a_stream_of_unique_keys() {
    // Every store refused and remembered, the registry holding 100 keys:
    // the history is its smallest table (1024 slots, 2 KiB), whatever the
    // stream's length; at 10 M entries it would be 16 MiB at most. A key
    // never seen passes only on a fingerprint's false match (a bucket's 32
    // slots against 8 192 fingerprints: 0.4 %).
    let r = gated();
    let n = 200_000;
    run(&r, 100, (0..n).map(|k| vec![k]));
    let a = r.stats().admission;
    assert!(a.admitted * 1000 < n * 6, "false matches: {}", a.admitted);
    assert_eq!((a.refused + a.admitted, a.history_bytes), (n, 2048));
    assert_eq!(admission::HISTORY_MAX_BYTES, 16 << 20);
}

/// A follower's reserve, judged by the registry the directory holds (the
/// primary's): declined items reserve nothing and evict nothing.
#[tokio::test]
async fn a_judged_reserve_declines_items_alone_and_evicts_nothing_for_them() {
    let r = Arc::new(gated());
    let d = LocalDirectory::new(r.clone());
    (100..110).for_each(|i| store(&r, i));
    assert_eq!(judge(&r, 2), Admit::Refused, "key 2 seen once");
    let call = |items: Vec<u64>, shortfall| {
        ReserveCall::local(NODE, "t", items.iter().map(|&i| (key(i), loc(i))).collect(), shortfall, PAGE)
    };
    let out = d.reserve_judging(call(vec![2, 1, 100], 0), true).await.unwrap();
    let kinds: Vec<Option<ErrorKind>> = out.ids.iter().map(|r| r.as_ref().err().map(|e| e.kind())).collect();
    assert_eq!(kinds, vec![None, Some(ErrorKind::NotAdmitted), Some(ErrorKind::AlreadyExists)]);
    assert_eq!((out.seqs[1], out.seqs[2]), (0, 0));
    assert!(out.seqs[0] > 0);
    let s = r.stats();
    assert_eq!((s.reserved, s.keys), (1, 109), "only the admitted item is being written");
    // Declined alone: the shortfall is evicted for what was admitted only.
    let out = d.reserve_judging(call(vec![3, 4], 0), true).await.unwrap();
    assert!(out.ids.iter().all(|r| r.as_ref().is_err_and(|e| e.kind() == ErrorKind::NotAdmitted)));
    assert!(out.freed.is_empty() && r.stats().reserved == 1);
    // Not judged (a node's own handler judged, or the client's buffers are
    // exempt): stored whatever the history says.
    let out = d.reserve(call(vec![5], 0)).await.unwrap();
    assert!(out.ids[0].is_ok());
}

#[test]
fn not_admitted_is_answered_as_aborted_and_read_back_as_itself() {
    let e = crate::error::Error::not_admitted();
    let status = convert::key_status(&e);
    assert_eq!(status.code, tonic::Code::Aborted as u32);
    assert_eq!(convert::reserve_result_of(&status).unwrap_err().kind(), ErrorKind::NotAdmitted);
    // Elsewhere ABORTED keeps its meaning.
    assert_eq!(convert::result_of(&status).unwrap_err().kind(), ErrorKind::Aborted);
    assert!(convert::reserve_result_of(&crate::proto::KeyStatus::default()).is_ok());
}

#[test]
fn adaptive_gates_a_cache_that_is_read_and_only_after_a_burst() {
    // Unique keys into a full cache nobody reads: no evidence of what is
    // worth keeping (it may be filled ahead of its readers), every store
    // admitted however long the stream.
    let r = registry(AdmissionMode::Adaptive);
    run(&r, 16, (0..4 * admission::EVIDENCE).map(|k| vec![k]));
    let a = r.stats().admission;
    assert_eq!((a.gating, a.refused), (false, 0));
    // Four hot keys read at every step beside a new key: both simulations
    // hit them, a tie the gate wins (it saves every write), but only once
    // `EVIDENCE` stores were judged full; before that all are admitted.
    let r = registry(AdmissionMode::Adaptive);
    let steps = |from: u64, to: u64| (from..to).map(|s| vec![1_000_000 + s % 4, s]);
    run(&r, 16, steps(0, admission::EVIDENCE / 2));
    let a = r.stats().admission;
    assert_eq!((a.gating, a.refused), (false, 0));
    run(&r, 16, steps(admission::EVIDENCE / 2, 4 * admission::EVIDENCE));
    let a = r.stats().admission;
    assert!(a.gating && a.refused > 2 * admission::EVIDENCE, "{a:?}");
}

#[test]
fn a_store_batch_is_cut_at_its_first_refused_chunk() {
    // A request's chunks in prefix order: one refused, and the chunks after
    // it would be unusable to a reader that loads up to its first miss.
    let r = gated();
    for i in [1, 3] {
        assert_eq!(judge(&r, i), Admit::Refused, "seen once now");
    }
    let batch: Vec<Vec<u8>> = [1, 2, 3].map(key).into();
    let items: Vec<(&[u8], u64)> = batch.iter().map(|k| (k.as_slice(), PAGE)).collect();
    assert_eq!(r.admit(&items), vec![Admit::Admitted, Admit::Refused, Admit::Refused]);
    // The chunk refused for its run kept its place: its own store passes;
    // the first touch was remembered.
    assert_eq!(judge(&r, 3), Admit::Admitted);
    assert_eq!(judge(&r, 2), Admit::Admitted);
    // A batch split in parts keeps its cut across them.
    let mut run = admission::Run::default();
    let (k4, k1) = (key(4), key(1));
    assert_eq!(r.admit_run(&[(&k4, PAGE)], &mut run), vec![Admit::Refused]);
    assert_eq!(r.admit_run(&[(&k1, PAGE)], &mut run), vec![Admit::Refused], "1 is seen, but after a refused chunk");
}
