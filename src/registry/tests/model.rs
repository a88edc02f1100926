//! Model-based property test: random operations go to the registry and to a
//! model of what it should do, key by key; after every operation the
//! registry's answers and counts must match the model's.
use super::*;
use proptest::prelude::*;
use std::collections::HashMap;

#[derive(Debug, Clone)]
enum Op {
    Reserve(u8, u8),
    Commit(u8),
    Abort(u8),
    Lookup(u8),
    /// A batch of two, applied in order (may repeat a key).
    Lookup2(u8, u8),
    Unlock(u8),
    Delete(u8),
    /// (node, pages)
    Evict(u32, u8),
    Advance(u8),
}

/// Keys are 0..KEYS, one byte each.
const KEYS: u8 = 12;

fn op() -> impl Strategy<Value = Op> {
    let k = 0u8..KEYS;
    prop_oneof![
        (k.clone(), 1u8..4).prop_map(|(k, p)| Op::Reserve(k, p)),
        k.clone().prop_map(Op::Commit),
        k.clone().prop_map(Op::Abort),
        k.clone().prop_map(Op::Lookup),
        (k.clone(), k.clone()).prop_map(|(a, b)| Op::Lookup2(a, b)),
        k.clone().prop_map(Op::Unlock),
        k.clone().prop_map(Op::Delete),
        (1u32..3, 1u8..6).prop_map(|(n, p)| Op::Evict(n, p)),
        (1u8..40).prop_map(Op::Advance),
    ]
}

#[derive(Debug, Clone)]
struct M {
    res: ReservationId,
    committed: bool,
    pages: u64,
    locks: u32,
    expiry: u64,
}

const TTL: u64 = 30;
const RES_TIMEOUT: u64 = 50;

/// Odd keys live on node 2, even ones on node 1.
fn node(k: u8) -> u32 {
    1 + (k % 2) as u32
}

fn key(k: u8) -> Vec<u8> {
    vec![k]
}

/// The key a freed location belonged to (`loc` puts key k at offset k).
fn op_key(l: &Location) -> u8 {
    (l.offset / (PAGE * 16)) as u8
}

/// What the registry should do, key by key. `lru` holds the victim order of
/// committed keys that are not locked (front = least recent): a locked key is
/// out of it and comes back as most recent when its last lock goes.
#[derive(Default)]
struct Model {
    m: HashMap<u8, M>,
    deadline: HashMap<u8, u64>,
    lru: Vec<u8>,
    /// The clock both sides are called with.
    now: u64,
}

impl Model {
    /// Apply `o` to the registry and to the model, checking the registry's
    /// answer against the model's on the way.
    fn apply(&mut self, r: &LocalRegistry, o: Op) -> Result<(), TestCaseError> {
        match o {
            Op::Reserve(k, p) => self.reserve(r, k, p),
            Op::Commit(k) => self.commit(r, k),
            Op::Abort(k) => self.abort(r, k),
            Op::Lookup(k) => {
                let out = r.lookup_and_lock(&[&key(k)], TTL, self.now);
                self.expect_lookup(k, out[0].is_some())
            }
            Op::Lookup2(a, b) => {
                let out = r.lookup_and_lock(&[&key(a), &key(b)], TTL, self.now);
                self.expect_lookup(a, out[0].is_some())?;
                self.expect_lookup(b, out[1].is_some())
            }
            Op::Unlock(k) => {
                let out = r.unlock(&[&key(k)], self.now);
                self.expect_unlock(k, &out[0])
            }
            Op::Delete(k) => self.delete(r, k),
            Op::Evict(n, p) => self.evict(r, n, p),
            Op::Advance(d) => self.advance(r, d),
        }
    }

    /// Counts and presence of every key agree with the model.
    fn check(&self, r: &LocalRegistry) -> Result<(), TestCaseError> {
        let s = r.stats();
        let committed: Vec<&M> = self.m.values().filter(|e| e.committed).collect();
        prop_assert_eq!(s.keys, committed.len() as u64);
        prop_assert_eq!(s.reserved, (self.m.len() - committed.len()) as u64);
        prop_assert_eq!(s.bytes_stored, committed.iter().map(|e| e.pages * PAGE).sum::<u64>());
        prop_assert_eq!(s.locked_keys, self.m.values().filter(|e| e.locks > 0).count() as u64, "locked count");
        for k in 0..KEYS {
            let want = self.m.get(&k).is_some_and(|e| e.committed);
            prop_assert_eq!(r.exists(&[&[k]])[0], want, "exists({}) disagrees", k);
        }
        Ok(())
    }

    fn reserve(&mut self, r: &LocalRegistry, k: u8, p: u8) -> Result<(), TestCaseError> {
        let now = self.now;
        let out = r.res("t", vec![(key(k), loc(node(k), k as u64, p as u64 * PAGE))], now + RES_TIMEOUT);
        if let std::collections::hash_map::Entry::Vacant(e) = self.m.entry(k) {
            let res = out[0].clone().unwrap();
            e.insert(M { res, committed: false, pages: p as u64, locks: 0, expiry: 0 });
            self.deadline.insert(k, now + RES_TIMEOUT);
        } else {
            prop_assert_eq!(out[0].as_ref().unwrap_err().kind(), ErrorKind::AlreadyExists);
        }
        Ok(())
    }

    fn commit(&mut self, r: &LocalRegistry, k: u8) -> Result<(), TestCaseError> {
        let res = self.m.get(&k).map(|e| e.res).unwrap_or(ReservationId(1));
        let out = r.com(&[res]).0;
        match self.m.get_mut(&k) {
            Some(e) if !e.committed => {
                prop_assert!(out[0].is_ok());
                e.committed = true;
                self.lru.push(k);
            }
            _ => prop_assert_eq!(out[0].as_ref().unwrap_err().kind(), ErrorKind::NotFound),
        }
        Ok(())
    }

    fn abort(&mut self, r: &LocalRegistry, k: u8) -> Result<(), TestCaseError> {
        let res = self.m.get(&k).map(|e| e.res).unwrap_or(ReservationId(1));
        let out = r.ab(&[res]);
        if self.m.get(&k).is_some_and(|e| !e.committed) {
            prop_assert!(out[0].is_ok());
            self.m.remove(&k);
        } else {
            prop_assert_eq!(out[0].as_ref().unwrap_err().kind(), ErrorKind::NotFound);
        }
        Ok(())
    }

    fn delete(&mut self, r: &LocalRegistry, k: u8) -> Result<(), TestCaseError> {
        let out = r.delete(&[&key(k)], self.now);
        match self.m.get(&k) {
            Some(e) if e.committed && !self.live_lock(k) => {
                prop_assert!(out[0].is_ok());
                self.remove(k);
            }
            Some(_) => prop_assert_eq!(out[0].as_ref().unwrap_err().kind(), ErrorKind::FailedPrecondition),
            None => prop_assert_eq!(out[0].as_ref().unwrap_err().kind(), ErrorKind::NotFound),
        }
        Ok(())
    }

    /// Victims are node `n`'s unlocked committed keys in LRU order, until
    /// `p` pages are freed, and the search visits nothing else.
    fn evict(&mut self, r: &LocalRegistry, n: u32, p: u8) -> Result<(), TestCaseError> {
        let now = self.now;
        let visits = r.stats().eviction_visits;
        let freed = r.evict(NodeId(n), p as u64, PAGE, now);
        self.sweep();
        let mut want = vec![];
        let mut got = 0;
        for &k in self.lru.iter().filter(|&&k| node(k) == n) {
            if got >= p as u64 {
                break;
            }
            got += self.m[&k].pages;
            want.push(k);
        }
        let freed_keys: Vec<u8> = freed.iter().map(op_key).collect();
        prop_assert_eq!(&freed_keys, &want, "victims differ from LRU order");
        prop_assert_eq!(r.stats().eviction_visits - visits, want.len() as u64, "the search visits victims only");
        for k in want {
            self.remove(k);
            prop_assert_eq!(r.lookup_and_lock(&[&key(k)], TTL, now), vec![None]);
        }
        Ok(())
    }

    /// Time passes: reservations past their deadline are reclaimed, locks
    /// past their TTL released.
    fn advance(&mut self, r: &LocalRegistry, d: u8) -> Result<(), TestCaseError> {
        self.now += d as u64;
        let now = self.now;
        let freed = r.expire(now);
        let mut want: Vec<u8> =
            self.m.iter().filter(|(k, e)| !e.committed && self.deadline[*k] <= now).map(|(k, _)| *k).collect();
        want.sort();
        let mut got: Vec<u8> = freed.iter().map(op_key).collect();
        got.sort();
        prop_assert_eq!(&got, &want);
        for k in want {
            self.m.remove(&k);
        }
        self.sweep();
        Ok(())
    }

    fn live_lock(&self, k: u8) -> bool {
        self.m.get(&k).is_some_and(|e| e.locks > 0 && e.expiry > self.now)
    }

    fn release(&mut self, k: u8) {
        self.m.get_mut(&k).unwrap().locks = 0;
        self.lru.push(k);
    }

    /// Locks past their TTL come back in (expiry, key) order.
    fn sweep(&mut self) {
        let now = self.now;
        let mut stale: Vec<(u64, u8)> =
            self.m.iter().filter(|(_, e)| e.locks > 0 && e.expiry <= now).map(|(k, e)| (e.expiry, *k)).collect();
        stale.sort();
        for (_, k) in stale {
            self.release(k);
        }
    }

    /// A lookup of `k` found it (`found`) exactly when it is committed; a hit
    /// takes a lock.
    fn expect_lookup(&mut self, k: u8, found: bool) -> Result<(), TestCaseError> {
        let now = self.now;
        let Some(e) = self.m.get(&k).filter(|e| e.committed) else {
            prop_assert!(!found, "missing or reserved key {} was returned", k);
            return Ok(());
        };
        prop_assert!(found);
        if e.locks > 0 && e.expiry <= now {
            self.release(k);
        }
        let e = self.m.get_mut(&k).unwrap();
        if e.locks == 0 {
            self.lru.retain(|&x| x != k);
        }
        e.locks += 1;
        e.expiry = e.expiry.max(now + TTL);
        Ok(())
    }

    /// An unlock of `k` succeeds only on a live lock.
    fn expect_unlock(&mut self, k: u8, out: &Result<()>) -> Result<(), TestCaseError> {
        let now = self.now;
        match self.m.get_mut(&k) {
            Some(e) if e.locks > 0 && e.expiry > now => {
                prop_assert!(out.is_ok());
                e.locks -= 1;
                if e.locks == 0 {
                    self.lru.push(k);
                }
            }
            Some(e) => {
                if e.locks > 0 {
                    self.release(k);
                }
                prop_assert_eq!(out.as_ref().unwrap_err().kind(), ErrorKind::FailedPrecondition);
            }
            None => prop_assert_eq!(out.as_ref().unwrap_err().kind(), ErrorKind::NotFound),
        }
        Ok(())
    }

    fn remove(&mut self, k: u8) {
        self.m.remove(&k);
        self.lru.retain(|&x| x != k);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn registry_matches_model(ops in proptest::collection::vec(op(), 1..150)) {
        let r = reg();
        let mut model = Model::default();
        for o in ops {
            model.apply(&r, o)?;
            model.check(&r)?;
        }
    }
}
