//! One conformance suite for every policy (what the registry relies on),
//! then a model-based property test per policy (victim order).
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use proptest::prelude::*;

use super::*;

#[derive(Debug, Clone)]
enum Op {
    Insert(EntryId, u32, u64),
    Touch(EntryId),
    Hold(EntryId),
    Release(EntryId),
    Remove(EntryId),
    Pop(u32),
    /// Pop a victim, then give it back (hold + release) instead of removing it.
    PopKeep(u32),
    Tick(u64),
}

const IDS: u32 = 24;

fn op() -> impl Strategy<Value = Op> {
    let id = (0..IDS).prop_map(EntryId);
    prop_oneof![
        4 => (id.clone(), 1u32..3, prop_oneof![Just(4096u64), Just(1000)]).prop_map(|(i, n, s)| Op::Insert(i, n, s)),
        3 => id.clone().prop_map(Op::Touch),
        2 => id.clone().prop_map(Op::Hold),
        2 => id.clone().prop_map(Op::Release),
        1 => id.clone().prop_map(Op::Remove),
        3 => (1u32..3).prop_map(Op::Pop),
        1 => (1u32..3).prop_map(Op::PopKeep),
        1 => (1u64..50).prop_map(Op::Tick),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum St {
    Cand(u32),
    Held(u32),
}

fn hash(id: EntryId) -> u64 {
    (id.0 as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// What every policy must do, whatever its order: victims are candidates of
/// the node asked (never held, never twice), `None` only when the node has
/// none, and after any history every candidate can still be evicted.
fn conformance(p: &mut dyn EvictionPolicy, ops: &[Op], clock: &AtomicU64) -> Result<(), TestCaseError> {
    let mut st: HashMap<EntryId, St> = HashMap::new();
    let node_of = |st: &HashMap<EntryId, St>, id: EntryId| match st.get(&id) {
        Some(St::Cand(n) | St::Held(n)) => *n,
        None => 1 + id.0 % 2,
    };
    for o in ops {
        match *o {
            Op::Insert(id, n, size) => {
                if let std::collections::hash_map::Entry::Vacant(e) = st.entry(id) {
                    p.insert(n, id, Obj { size, hash: hash(id) });
                    e.insert(St::Cand(n));
                }
            }
            Op::Touch(id) => p.touch(node_of(&st, id), id),
            Op::Hold(id) => {
                p.hold(node_of(&st, id), id);
                if let Some(St::Cand(n)) = st.get(&id).copied() {
                    st.insert(id, St::Held(n));
                }
            }
            Op::Release(id) => {
                p.release(node_of(&st, id), id);
                if let Some(St::Held(n)) = st.get(&id).copied() {
                    st.insert(id, St::Cand(n));
                }
            }
            Op::Remove(id) => {
                p.remove(node_of(&st, id), id, hash(id));
                st.remove(&id);
            }
            Op::Pop(n) | Op::PopKeep(n) => {
                let has = st.values().any(|s| *s == St::Cand(n));
                match p.pop_victim(n) {
                    Some(v) => {
                        prop_assert_eq!(st.get(&v), Some(&St::Cand(n)), "victim {} of node {} is no candidate", v, n);
                        if matches!(o, Op::Pop(_)) {
                            p.remove(n, v, hash(v));
                            st.remove(&v);
                        } else {
                            p.hold(n, v);
                            p.release(n, v);
                        }
                    }
                    None => prop_assert!(!has, "node {} has candidates but no victim", n),
                }
            }
            Op::Tick(ms) => {
                clock.fetch_add(ms, Ordering::Relaxed);
            }
        }
    }
    // Release everything: every entry is then evicted exactly once.
    for (&id, s) in st.clone().iter() {
        if let St::Held(n) = *s {
            p.release(n, id);
            st.insert(id, St::Cand(n));
        }
    }
    for n in [1, 2] {
        let mut seen = HashSet::new();
        while let Some(v) = p.pop_victim(n) {
            prop_assert!(seen.insert(v), "{} returned twice", v);
            prop_assert_eq!(st.get(&v), Some(&St::Cand(n)));
            p.remove(n, v, hash(v));
        }
        let want: HashSet<EntryId> = st.iter().filter(|(_, s)| **s == St::Cand(n)).map(|(&i, _)| i).collect();
        prop_assert_eq!(seen, want, "node {} did not drain", n);
    }
    Ok(())
}

fn clocked(name: &str, clock: &Arc<AtomicU64>) -> Box<dyn EvictionPolicy> {
    if name == "ttl" {
        let c = clock.clone();
        Box::new(Ttl::with_clock(TtlConfig { max_age_ms: 100 }, Arc::new(move || c.load(Ordering::Relaxed))))
    } else {
        by_name(name).unwrap()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn every_policy_conforms(ops in proptest::collection::vec(op(), 1..200)) {
        for name in POLICIES {
            let clock = Arc::new(AtomicU64::new(0));
            let mut p = clocked(name, &clock);
            conformance(p.as_mut(), &ops, &clock).map_err(|e| TestCaseError::fail(format!("{name}: {e}")))?;
        }
    }
}

#[test]
fn names_and_default() {
    for name in POLICIES {
        assert_eq!(by_name(name).unwrap().name(), *name);
    }
    assert_eq!(by_name("DEFAULT").unwrap().name(), DEFAULT_POLICY);
    assert!(by_name("random").is_err());
}

#[test]
fn each_node_has_its_own_order() {
    for name in POLICIES {
        let mut p = by_name(name).unwrap();
        for (node, id) in [(1, 0), (2, 1), (1, 2), (2, 3), (1, 4)] {
            let id = EntryId(id);
            p.insert(node, id, Obj { size: 10, hash: hash(id) });
        }
        let drained = |p: &mut Box<dyn EvictionPolicy>, n: u32| {
            let mut v = vec![];
            while let Some(x) = p.pop_victim(n) {
                p.remove(n, x, hash(x));
                v.push(x.0);
            }
            v.sort();
            v
        };
        assert_eq!(drained(&mut p, 2), vec![1, 3], "{name}");
        assert!(drained(&mut p, 9).is_empty(), "{name}: a node never seen");
        assert_eq!(drained(&mut p, 1), vec![0, 2, 4], "{name}");
    }
}

/// Pop node 1's victim, which must be `want`, and remove it from the policy.
fn pop_expect<P: EvictionPolicy + ?Sized>(p: &mut P, want: Option<EntryId>) -> Result<Option<EntryId>, TestCaseError> {
    let v = p.pop_victim(1);
    prop_assert_eq!(v, want);
    if let Some(v) = v {
        p.remove(1, v, hash(v));
    }
    Ok(v)
}

/// Pop node 1's victim, which must be the front of `order`, and remove it
/// from both.
fn pop_front(p: &mut dyn EvictionPolicy, order: &mut Vec<EntryId>) -> Result<(), TestCaseError> {
    if pop_expect(p, order.first().copied())?.is_some() {
        order.remove(0);
    }
    Ok(())
}

/// An LRU list model beside the policy under test: `order` holds the
/// candidates least recently used first; held entries are out of it.
#[derive(Default)]
struct LruModel {
    order: Vec<EntryId>,
    held: HashSet<EntryId>,
}

/// What `LruModel::step` did to the candidates.
enum Step {
    Inserted(EntryId),
    Released(EntryId),
    Out(EntryId),
    Other,
}

impl LruModel {
    /// Apply an insert, touch, hold, release or remove to `p` and to the
    /// model (one that does not apply leaves both alone); pops and ticks are
    /// the caller's.
    fn step<P: EvictionPolicy + ?Sized>(&mut self, p: &mut P, o: &Op) -> Step {
        match *o {
            Op::Insert(id, _, size) if !self.order.contains(&id) && !self.held.contains(&id) => {
                p.insert(1, id, Obj { size, hash: hash(id) });
                self.order.push(id);
                Step::Inserted(id)
            }
            Op::Touch(id) => {
                p.touch(1, id);
                if self.order.contains(&id) {
                    self.order.retain(|&x| x != id);
                    self.order.push(id);
                }
                Step::Other
            }
            Op::Hold(id) if self.order.contains(&id) => {
                p.hold(1, id);
                self.order.retain(|&x| x != id);
                self.held.insert(id);
                Step::Out(id)
            }
            Op::Release(id) if self.held.remove(&id) => {
                p.release(1, id);
                self.order.push(id);
                Step::Released(id)
            }
            Op::Remove(id) => {
                p.remove(1, id, hash(id));
                self.order.retain(|&x| x != id);
                self.held.remove(&id);
                Step::Out(id)
            }
            _ => Step::Other,
        }
    }
}

/// LRU against a list model: front = least recent.
fn lru_model(ops: &[Op]) -> Result<(), TestCaseError> {
    let mut p = by_name("lru").unwrap();
    let mut m = LruModel::default();
    for o in ops {
        if let Op::Pop(_) | Op::PopKeep(_) = o {
            pop_front(&mut *p, &mut m.order)?;
        } else {
            m.step(&mut *p, o);
        }
    }
    Ok(())
}

/// FIFO against a list model: entries in use keep their place; one passed
/// over while in use goes back to the old end when released.
fn fifo_model(ops: &[Op]) -> Result<(), TestCaseError> {
    let mut p = by_name("fifo").unwrap();
    let (mut order, mut held, mut parked) =
        (Vec::<EntryId>::new(), HashSet::<EntryId>::new(), HashSet::<EntryId>::new());
    for o in ops {
        match *o {
            Op::Insert(id, _, size) if !order.contains(&id) && !parked.contains(&id) => {
                p.insert(1, id, Obj { size, hash: hash(id) });
                order.push(id);
            }
            Op::Touch(id) => p.touch(1, id),
            Op::Hold(id) if order.contains(&id) => {
                p.hold(1, id);
                held.insert(id);
            }
            Op::Release(id) if held.remove(&id) => {
                p.release(1, id);
                if parked.remove(&id) {
                    order.insert(0, id);
                }
            }
            Op::Remove(id) => {
                p.remove(1, id, hash(id));
                order.retain(|&x| x != id);
                held.remove(&id);
                parked.remove(&id);
            }
            Op::Pop(_) | Op::PopKeep(_) => {
                while order.first().is_some_and(|x| held.contains(x)) {
                    parked.insert(order.remove(0));
                }
                pop_front(&mut *p, &mut order)?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// SIEVE against a list model with visited bits and a hand.
fn sieve_model(ops: &[Op]) -> Result<(), TestCaseError> {
    let mut p = by_name("sieve").unwrap();
    // Oldest first; the hand is an index into `order`.
    let (mut order, mut held, mut visited) =
        (Vec::<EntryId>::new(), HashSet::<EntryId>::new(), HashSet::<EntryId>::new());
    let mut hand: Option<EntryId> = None;
    let unlink = |order: &mut Vec<EntryId>, hand: &mut Option<EntryId>, id: EntryId| {
        let i = order.iter().position(|&x| x == id).unwrap();
        if *hand == Some(id) {
            *hand = order.get(i + 1).copied();
        }
        order.remove(i);
    };
    for o in ops {
        match *o {
            Op::Insert(id, _, size) if !order.contains(&id) && !held.contains(&id) => {
                p.insert(1, id, Obj { size, hash: hash(id) });
                visited.remove(&id);
                order.push(id);
            }
            Op::Touch(id) => {
                p.touch(1, id);
                if order.contains(&id) || held.contains(&id) {
                    visited.insert(id);
                }
            }
            Op::Hold(id) if order.contains(&id) => {
                p.hold(1, id);
                unlink(&mut order, &mut hand, id);
                held.insert(id);
            }
            Op::Release(id) if held.remove(&id) => {
                p.release(1, id);
                order.push(id);
            }
            Op::Remove(id) => {
                p.remove(1, id, hash(id));
                if order.contains(&id) {
                    unlink(&mut order, &mut hand, id);
                }
                held.remove(&id);
            }
            Op::Pop(_) | Op::PopKeep(_) => {
                let want = if order.is_empty() {
                    None
                } else {
                    let mut i = hand.and_then(|h| order.iter().position(|&x| x == h)).unwrap_or(0);
                    while visited.remove(&order[i]) {
                        i = (i + 1) % order.len();
                    }
                    // The hand stops on the victim, then moves past it.
                    hand = Some(order[i]);
                    Some(order[i])
                };
                if let Some(v) = pop_expect(&mut *p, want)? {
                    unlink(&mut order, &mut hand, v);
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// TTL against a model: by-age list (young end = back of the vec) and LRU list.
fn ttl_model(ops: &[Op]) -> Result<(), TestCaseError> {
    let clock = Arc::new(AtomicU64::new(0));
    let c = clock.clone();
    let mut p = Ttl::with_clock(TtlConfig { max_age_ms: 100 }, Arc::new(move || c.load(Ordering::Relaxed)));
    let (mut used, mut age) = (LruModel::default(), Vec::<EntryId>::new());
    let mut stamp: HashMap<EntryId, u64> = HashMap::new();
    for o in ops {
        let now = clock.load(Ordering::Relaxed);
        match *o {
            Op::Pop(_) | Op::PopKeep(_) => {
                let want = match age.first() {
                    Some(&o) if now - stamp[&o] > 100 => Some(o),
                    _ => used.order.first().copied(),
                };
                if let Some(v) = pop_expect(&mut p, want)? {
                    age.retain(|&x| x != v);
                    used.order.retain(|&x| x != v);
                }
            }
            Op::Tick(ms) => {
                clock.fetch_add(ms, Ordering::Relaxed);
            }
            _ => match used.step(&mut p, o) {
                Step::Inserted(id) => {
                    stamp.insert(id, now);
                    age.push(id);
                }
                Step::Released(id) => age.push(id),
                Step::Out(id) => age.retain(|&x| x != id),
                Step::Other => {}
            },
        }
    }
    Ok(())
}

/// Priority policies: the victim has the lowest priority of the node's
/// candidates (`rank` reads the policy's own priority; a model of their
/// arithmetic would only repeat it). For `kv`, partial chunks that were
/// never read go first, oldest first.
fn ranked_model<P: EvictionPolicy>(
    mut p: P,
    rank: impl Fn(&mut P, EntryId) -> u32,
    partials: bool,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let (mut cands, mut held) = (HashSet::<EntryId>::new(), HashSet::<EntryId>::new());
    let mut partial: Vec<EntryId> = vec![];
    let mut largest = 0u64;
    for o in ops {
        match *o {
            Op::Insert(id, _, size) if !cands.contains(&id) && !held.contains(&id) => {
                p.insert(1, id, Obj { size, hash: hash(id) });
                if partials && size < largest {
                    partial.push(id);
                }
                largest = largest.max(size);
                cands.insert(id);
            }
            Op::Touch(id) => {
                p.touch(1, id);
                partial.retain(|&x| x != id);
            }
            Op::Hold(id) if cands.remove(&id) => {
                p.hold(1, id);
                partial.retain(|&x| x != id);
                held.insert(id);
            }
            Op::Release(id) if held.remove(&id) => {
                p.release(1, id);
                cands.insert(id);
            }
            Op::Remove(id) => {
                p.remove(1, id, hash(id));
                cands.remove(&id);
                held.remove(&id);
                partial.retain(|&x| x != id);
            }
            Op::Pop(_) | Op::PopKeep(_) => {
                let ranks: HashMap<EntryId, u32> = cands.iter().map(|&c| (c, rank(&mut p, c))).collect();
                let v = p.pop_victim(1);
                prop_assert_eq!(v.is_some(), !cands.is_empty());
                if let Some(v) = v {
                    if let Some(&first) = partial.first() {
                        prop_assert_eq!(v, first, "partial chunks go first, oldest first");
                        partial.remove(0);
                    } else {
                        let min = ranks.values().min().copied().unwrap();
                        prop_assert_eq!(ranks[&v], min, "victim {} is not of the lowest rank", v);
                    }
                    cands.remove(&v);
                    p.remove(1, v, hash(v));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn lru_matches_its_model(ops in proptest::collection::vec(op(), 1..200)) { lru_model(&ops)?; }
    #[test]
    fn fifo_matches_its_model(ops in proptest::collection::vec(op(), 1..200)) { fifo_model(&ops)?; }
    #[test]
    fn sieve_matches_its_model(ops in proptest::collection::vec(op(), 1..200)) { sieve_model(&ops)?; }
    #[test]
    fn ttl_matches_its_model(ops in proptest::collection::vec(op(), 1..200)) { ttl_model(&ops)?; }
    #[test]
    fn lfu_evicts_the_lowest_priority(ops in proptest::collection::vec(op(), 1..200)) {
        ranked_model(Lfu::new(LfuConfig::default()), |p, id| p.priority(id), false, &ops)?;
    }
    #[test]
    fn gd_evicts_partials_then_the_lowest_priority(ops in proptest::collection::vec(op(), 1..300)) {
        ranked_model(Gd::new(GdConfig::default()), |p, id| p.rank(1, id) as u32, true, &ops)?;
    }
    #[test]
    fn kv_evicts_partials_then_the_lowest_bucket(ops in proptest::collection::vec(op(), 1..300)) {
        ranked_model(Kv::new(KvConfig::default()), |p, id| p.rank(1, id) as u32, true, &ops)?;
    }
}

#[test]
fn s3fifo_keeps_read_entries_over_one_hit_wonders() {
    let mut p = by_name("s3fifo").unwrap();
    for id in (0..20).map(EntryId) {
        p.insert(1, id, Obj { size: 10, hash: hash(id) });
    }
    for id in [3, 7].map(EntryId) {
        p.touch(1, id);
    }
    let mut order = vec![];
    while let Some(v) = p.pop_victim(1) {
        p.remove(1, v, hash(v));
        order.push(v.0);
    }
    assert_eq!(&order[18..], &[3, 7], "read entries leave last: {order:?}");
    // Evicted from the small queue, so remembered: back in, it goes to main.
    p.insert(1, EntryId(0), Obj { size: 10, hash: hash(EntryId(0)) });
    p.insert(1, EntryId(21), Obj { size: 10, hash: hash(EntryId(21)) });
    assert_eq!(p.pop_victim(1), Some(EntryId(21)), "a one-hit wonder leaves before a remembered key");
}

#[test]
fn kv_scores_survive_wrapping_time() {
    // Push a node's clock around the 15-bit score circle several times:
    // recently read entries must keep outranking stale ones.
    let mut p = Kv::new(KvConfig { partial_first: false, ..KvConfig::default() });
    p.insert(1, EntryId(0), Obj { size: 10, hash: hash(EntryId(0)) });
    for round in 0..300_000u32 {
        let id = EntryId(1 + round % 64);
        p.insert(1, id, Obj { size: 10, hash: hash(id) });
        p.touch(1, EntryId(0));
        let v = p.pop_victim(1).unwrap();
        assert_ne!(v, EntryId(0), "the entry read every step was evicted at round {round}");
        p.remove(1, v, hash(v));
    }
}

mod gd;
