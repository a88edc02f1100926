//! One conformance suite for every policy (what the registry relies on),
//! then a model-based property test per policy (victim order).
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use proptest::prelude::*;

use super::*;

#[derive(Debug, Clone)]
enum Op {
    Insert(u32, u32, u64),
    Touch(u32),
    Hold(u32),
    Release(u32),
    Remove(u32),
    Pop(u32),
    /// Pop a victim, then give it back (hold + release) instead of removing it.
    PopKeep(u32),
    Tick(u64),
}

const IDS: u32 = 24;

fn op() -> impl Strategy<Value = Op> {
    let id = 0..IDS;
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

fn hash(id: u32) -> u64 {
    (id as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// What every policy must do, whatever its order: victims are candidates of
/// the node asked (never held, never twice), `None` only when the node has
/// none, and after any history every candidate can still be evicted.
fn conformance(p: &mut dyn EvictionPolicy, ops: &[Op], clock: &AtomicU64) -> Result<(), TestCaseError> {
    let mut st: HashMap<u32, St> = HashMap::new();
    let node_of = |st: &HashMap<u32, St>, id: u32| match st.get(&id) {
        Some(St::Cand(n) | St::Held(n)) => *n,
        None => 1 + id % 2,
    };
    for o in ops {
        match *o {
            Op::Insert(id, n, size) => {
                if !st.contains_key(&id) {
                    p.insert(n, id, Obj { size, hash: hash(id) });
                    st.insert(id, St::Cand(n));
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
        let want: HashSet<u32> = st.iter().filter(|(_, s)| **s == St::Cand(n)).map(|(&i, _)| i).collect();
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
            p.insert(node, id, Obj { size: 10, hash: hash(id) });
        }
        let drained = |p: &mut Box<dyn EvictionPolicy>, n: u32| {
            let mut v = vec![];
            while let Some(x) = p.pop_victim(n) {
                p.remove(n, x, hash(x));
                v.push(x);
            }
            v.sort();
            v
        };
        assert_eq!(drained(&mut p, 2), vec![1, 3], "{name}");
        assert!(drained(&mut p, 9).is_empty(), "{name}: a node never seen");
        assert_eq!(drained(&mut p, 1), vec![0, 2, 4], "{name}");
    }
}

/// Runs `ops` on one node against a reference model: `check(model state,
/// policy, victim)` says whether the victim is one the policy may pick.
struct Harness {
    /// Candidates in insertion/use order (front = oldest) with model data.
    order: Vec<u32>,
    held: HashSet<u32>,
    touched: HashSet<u32>,
}

fn lru_model(ops: &[Op], touch_moves: bool) -> Result<(), TestCaseError> {
    let mut p = by_name(if touch_moves { "lru" } else { "fifo" }).unwrap();
    let mut h = Harness { order: vec![], held: HashSet::new(), touched: HashSet::new() };
    for o in ops {
        match *o {
            Op::Insert(id, _, size) if !h.order.contains(&id) && !h.held.contains(&id) => {
                p.insert(1, id, Obj { size, hash: hash(id) });
                h.order.push(id);
            }
            Op::Touch(id) => {
                p.touch(1, id);
                if touch_moves && h.order.contains(&id) {
                    h.order.retain(|&x| x != id);
                    h.order.push(id);
                }
            }
            Op::Hold(id) if h.order.contains(&id) => {
                p.hold(1, id);
                h.order.retain(|&x| x != id);
                h.held.insert(id);
            }
            Op::Release(id) if h.held.remove(&id) => {
                p.release(1, id);
                h.order.push(id);
            }
            Op::Remove(id) => {
                p.remove(1, id, hash(id));
                h.order.retain(|&x| x != id);
                h.held.remove(&id);
            }
            Op::Pop(_) | Op::PopKeep(_) => {
                let v = p.pop_victim(1);
                prop_assert_eq!(v, h.order.first().copied());
                if let Some(v) = v {
                    h.order.remove(0);
                    p.remove(1, v, hash(v));
                }
            }
            _ => {}
        }
    }
    let _ = &h.touched;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn lru_and_fifo_match_their_model(ops in proptest::collection::vec(op(), 1..200)) {
        lru_model(&ops, true)?;
        lru_model(&ops, false)?;
    }
}
