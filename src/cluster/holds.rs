//! A follower's node-held locks: how a lookup through a follower is
//! answered without a hop to the primary.
//!
//! When a follower forwards a lookup, the primary locks each hit for the
//! node (`Session::HOLD`), not for the client, for at least
//! `HOLD_TTL_FACTOR × hold_idle_ms`. The follower keeps the location, the
//! key's tenant and its clients' own locks ("readers") here; later lookups
//! of the key through this node are answered from this table, each a reader
//! lock counted here only. To the primary's eviction, reclaim and delete the
//! key is locked exactly as if a client of this node were reading it, which
//! it may be. A hold goes back (one forwarded `Release`, with the reads
//! counted here so the eviction order learns of them) once it has had no
//! reader for `hold_idle_ms`; at once when its last reader's session closes
//! or a client of this node deletes the key; and all of them are void when
//! this node joins the primary again (a new primary, or this node declared
//! dead), because the primary's locks went with it.
//!
//! Each hold belongs to the registration (join instance) under which the
//! primary granted it: a lookup's answer is adopted only if the node has not
//! joined again since it was sent (the primary applies the lookup only under
//! the registration it names, and a new registration starts with an empty
//! table), and a release names the registration too. So the table and the
//! primary's locks for the node count the same locks, but for a lookup
//! whose answer is lost after the primary applied it in time (one that
//! reaches the primary after the node gave up is refused, `clock.rs`):
//! that lock lapses with its TTL.
//!
//! A reader's lock never outlasts the primary's: a lookup that would need a
//! longer lock than the hold has left goes to the primary and renews it.
//! Times are this node's clock, taken before the forwarded call left, so
//! they err early: the primary's lock always lasts at least as long.
use std::time::Instant;

use dashmap::DashMap;

use crate::error::{Error, ErrorKind, Result};
use crate::registry::{Location, Scope, Session};

/// A hold lasts the client's lock TTL, plus twice the longest forwarded
/// call, plus this many `hold_idle_ms` at the primary: clients of the node
/// lock the key from the table for that last part after the hold was taken
/// (or renewed), then a lookup renews it while the old lock is sure to be
/// alive, so the renewal can release it in the same call.
pub const HOLD_TTL_FACTOR: u64 = 8;
/// Holds kept while they have readers or were used recently; past this,
/// holds without readers are released at the next sweep however recent.
pub const MAX_HOLDS: usize = 65_536;

/// A client's lock on a held key: session, count, expiry (ms).
type Reader = (Session, u32, u64);

struct Held {
    loc: Location,
    tenant: String,
    /// The node's locks on the key at the primary last at least this long.
    until_ms: u64,
    /// How many locks the node holds on the key at the primary (concurrent
    /// lookups of a key not yet held each take one; renewals add one).
    locks: u32,
    last_ms: u64,
    /// Reads answered here since the hold was taken.
    uses: u32,
    readers: Vec<Reader>,
    /// Readers that left since the table last counted them (`Holds::settle`).
    left: Vec<Session>,
}

impl Held {
    fn active(&mut self, now: u64) -> bool {
        let left = &mut self.left;
        self.readers.retain(|r| {
            let stays = r.1 > 0 && r.2 > now;
            if !stays {
                left.push(r.0);
            }
            stays
        });
        !self.readers.is_empty()
    }

    fn is_reader(&self, owner: Session) -> bool {
        self.readers.iter().any(|r| r.0 == owner && r.1 > 0)
    }

    /// True when `owner` was not a reader yet (its bytes start counting).
    fn add_reader(&mut self, owner: Session, expiry: u64, now: u64) -> bool {
        self.active(now);
        self.last_ms = now;
        match self.readers.iter_mut().find(|r| r.0 == owner) {
            Some(r) => {
                (r.1, r.2) = (r.1 + 1, r.2.max(expiry));
                false
            }
            None => {
                self.readers.push((owner, 1, expiry));
                true
            }
        }
    }

    /// Every reader leaves (the hold goes, or lapsed).
    fn drop_readers(&mut self) {
        let gone: Vec<Session> = self.readers.drain(..).map(|r| r.0).collect();
        self.left.extend(gone);
    }
}

/// A hold given back to the primary: the key once per node lock, and the
/// reads answered here.
pub struct Release {
    /// The registration the locks were granted under (`Holds::registration`).
    pub registration: u64,
    pub key: Vec<u8>,
    pub locks: u32,
    pub uses: u32,
    /// The node's locks on the key last at least this long at the primary.
    pub until_ms: u64,
}

pub struct Holds {
    map: DashMap<Vec<u8>, Held>,
    epoch: Instant,
    idle_ms: u64,
    /// Longer than any forwarded call may take.
    margin_ms: u64,
    /// Bytes of held keys each client of this node reads (locks), and the
    /// most one may (`[registry] max_client_pinned_bytes`): the primary
    /// counts only the node's hold, so the bound is kept here.
    pinned: DashMap<Session, u64>,
    pin_limit: u64,
    /// Releases that did not reach the primary (it did not answer, or this
    /// node's lease had lapsed): sent again with the next ones, while their
    /// locks are sure to be alive there; dropped when this node joins again.
    unsent: std::sync::Mutex<Vec<Release>>,
    /// The node's current registration with the primary (its join
    /// instance; 0 between a rejoin's start and its end). Every hold in
    /// `map` was granted under it: `void` empties the table under the write
    /// lock, `adopt` checks it under the read lock.
    registration: std::sync::RwLock<u64>,
}

impl Holds {
    /// `call_ms`: the longest a forwarded call may take.
    pub fn new(idle_ms: u64, call_ms: u64) -> Self {
        Self {
            map: DashMap::new(),
            epoch: Instant::now(),
            idle_ms,
            margin_ms: 2 * call_ms,
            pinned: DashMap::new(),
            pin_limit: u64::MAX,
            unsent: Default::default(),
            registration: Default::default(),
        }
    }

    /// The node joined the primary with `instance`: lookups sent from now
    /// on take holds under it.
    pub fn registered(&self, instance: u64) {
        *self.registration.write().unwrap() = instance;
    }

    /// The registration lookups and releases sent now are made under (0:
    /// none; take no holds).
    pub fn registration(&self) -> u64 {
        *self.registration.read().unwrap()
    }

    /// Bytes one client may hold locked through this table.
    pub fn with_pin_limit(mut self, bytes: u64) -> Self {
        self.pin_limit = bytes;
        self
    }

    /// Count the readers that left `h` since last time.
    fn settle(&self, h: &mut Held) {
        for s in h.left.drain(..) {
            if let dashmap::Entry::Occupied(mut e) = self.pinned.entry(s) {
                *e.get_mut() = e.get().saturating_sub(h.loc.length);
                if *e.get() == 0 {
                    e.remove();
                }
            }
        }
    }

    /// Make `owner` a reader of `h` (expiring at `expiry`) if its bytes
    /// stay within the bound: RESOURCE_EXHAUSTED otherwise.
    fn add_reader(&self, h: &mut Held, owner: Session, expiry: u64, now: u64) -> Result<()> {
        h.active(now);
        self.settle(h);
        if !h.is_reader(owner) {
            let held = self.pinned.get(&owner).map_or(0, |n| *n);
            if held + h.loc.length > self.pin_limit {
                return Err(Error::new(
                    ErrorKind::ResourceExhausted,
                    format!(
                        "this client holds {held} bytes locked; {} more would pass the limit of {} \
                         (registry.max_client_pinned_bytes): unlock first",
                        h.loc.length, self.pin_limit
                    ),
                ));
            }
        }
        if h.add_reader(owner, expiry, now) {
            *self.pinned.entry(owner).or_default() += h.loc.length;
        }
        Ok(())
    }

    /// `h` leaves the table: its readers stop counting.
    fn gone(&self, h: &mut Held) {
        h.drop_readers();
        self.settle(h);
    }

    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// The lock TTL a forwarded lookup asks for on the node's behalf.
    pub fn hold_ttl_ms(&self, client_ttl_ms: u64) -> u64 {
        client_ttl_ms + self.margin_ms + self.idle_ms * HOLD_TTL_FACTOR
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Lock a held key for `owner` until `now + ttl_ms`: None when the key
    /// is not held here or its hold might end first (ask the primary).
    pub fn lock(&self, key: &[u8], owner: Session, ttl_ms: u64, scope: &Scope, now: u64) -> Option<Result<Location>> {
        let mut h = self.map.get_mut(key)?;
        if !scope.allows(&h.tenant) {
            return Some(Err(Scope::denied("key")));
        }
        if h.until_ms < now + ttl_ms + self.margin_ms {
            return None;
        }
        if let Err(e) = self.add_reader(&mut h, owner, now + ttl_ms, now) {
            return Some(Err(e));
        }
        h.uses = h.uses.saturating_add(1);
        Some(Ok(h.loc))
    }

    /// Whether a renewal of `key` may release one of the node's locks in
    /// the same call (its `unlock_first`), so the node's lock count stays
    /// put however long the key is in use: it holds two or more (the
    /// primary unlocks before it locks again, and the key must never be
    /// left unlocked in between) and they are sure to be alive at the
    /// primary when a call sent now arrives.
    pub fn renewable(&self, key: &[u8], now: u64) -> bool {
        self.map.get(key).is_some_and(|h| h.locks >= 2 && h.until_ms > now + self.margin_ms)
    }

    /// `key` missed at the primary although held (a primary that forgot
    /// this node's locks): the hold is void.
    pub fn forget(&self, key: &[u8]) {
        if let Some((_, mut h)) = self.map.remove(key) {
            self.gone(&mut h);
        }
    }

    /// The primary locked `key` (at `loc`, of `tenant`) for this node until
    /// at least `until_ms`, on a lookup of `owner` whose lock lasts until
    /// `expiry_ms`; `renewal`: in the same call it released one lock the
    /// node held on the key (`renewable`). The hold is taken in any case;
    /// `owner`'s own lock only within its bound (RESOURCE_EXHAUSTED: the
    /// lookup is a miss for it, and the hold lapses unread). `registration`:
    /// the one the lookup was sent under; the node joined again since
    /// (ABORTED): the primary dropped that lock, nothing is taken, and the
    /// hit is a miss.
    #[allow(clippy::too_many_arguments)]
    pub fn adopt(
        &self,
        registration: u64,
        key: &[u8],
        loc: Location,
        tenant: &str,
        until_ms: u64,
        owner: Session,
        expiry_ms: u64,
        renewal: bool,
    ) -> Result<()> {
        let current = self.registration.read().unwrap();
        if *current != registration || registration == 0 {
            return Err(Error::new(
                ErrorKind::Aborted,
                "this node joined the primary again while the lookup was answered: its lock went with the old registration",
            ));
        }
        let now = self.now_ms();
        let mut h = self.map.entry(key.to_vec()).or_insert_with(|| Held {
            loc,
            tenant: tenant.to_owned(),
            until_ms: 0,
            locks: 0,
            last_ms: now,
            uses: 0,
            readers: vec![],
            left: vec![],
        });
        if h.loc != loc || h.until_ms <= now {
            // A hold that lapsed at the primary (its readers with it): the
            // key may have been stored again since.
            self.gone(&mut h);
            (h.loc, h.tenant, h.locks, h.uses) = (loc, tenant.to_owned(), 0, 0);
        }
        if !renewal || h.locks == 0 {
            h.locks += 1;
        }
        h.until_ms = h.until_ms.max(until_ms);
        let until = h.until_ms;
        self.add_reader(&mut h, owner, expiry_ms.min(until), now)
    }

    /// Whether `key` is held here (its client locks are in this table).
    pub fn knows(&self, key: &[u8]) -> bool {
        self.map.contains_key(key)
    }

    /// Release one of `owner`'s locks on `key`, as the primary would
    /// answer: not locked, or locked by other clients only.
    pub fn unlock(&self, key: &[u8], owner: Session, now: u64) -> Result<()> {
        let not_locked = || Error::precondition("key is not locked");
        let mut h = self.map.get_mut(key).ok_or_else(not_locked)?;
        let active = h.active(now);
        self.settle(&mut h);
        if !active {
            return Err(not_locked());
        }
        let Some(r) = h.readers.iter_mut().find(|r| r.0 == owner) else {
            return Err(Error::new(ErrorKind::PermissionDenied, "the key's locks belong to other clients"));
        };
        r.1 -= 1;
        h.last_ms = now;
        h.active(now);
        self.settle(&mut h);
        Ok(())
    }

    /// `owner` is gone: drop its locks (returns how many), and take the
    /// holds it leaves without readers, to be released now.
    pub fn release_session(&self, owner: Session, now: u64) -> (u64, Vec<Release>) {
        let mut n = 0;
        let mut freed = vec![];
        for mut h in self.map.iter_mut() {
            h.active(now);
            if let Some(i) = h.readers.iter().position(|r| r.0 == owner) {
                n += h.readers.swap_remove(i).1 as u64;
                h.left.push(owner);
                if h.readers.is_empty() {
                    freed.push(h.key().clone());
                }
            }
            self.settle(&mut h);
        }
        (n, self.take(freed.iter().map(Vec::as_slice), now))
    }

    /// Holds of `keys` without readers, taken out (before a delete).
    pub fn take<'a>(&self, keys: impl IntoIterator<Item = &'a [u8]>, now: u64) -> Vec<Release> {
        // Held while the table is read (as `void` and `adopt` take it first).
        let registration = self.registration.read().unwrap();
        keys.into_iter()
            .filter_map(|k| self.map.remove_if_mut(k, |_, h| !h.active(now)))
            .filter_map(|(key, mut h)| {
                self.gone(&mut h);
                self.release_of(*registration, &key, &h, now)
            })
            .collect()
    }

    /// Holds without readers for `idle_ms` (every hold without readers
    /// while there are more than `MAX_HOLDS`), taken out to be released.
    pub fn sweep(&self, now: u64) -> Vec<Release> {
        let crowded = self.map.len() > MAX_HOLDS;
        let idle = self.idle_ms;
        let registration = self.registration.read().unwrap();
        let mut out = vec![];
        self.map.retain(|key, h| {
            if h.active(now) || (!crowded && h.last_ms + idle > now) {
                self.settle(h);
                return true;
            }
            self.gone(h);
            out.extend(self.release_of(*registration, key, h, now));
            false
        });
        out
    }

    /// Every hold is void (the primary forgot them): nothing to release,
    /// and no answer to a lookup sent before is adopted (`registration` 0
    /// until the node joins again).
    pub fn void(&self) {
        let mut current = self.registration.write().unwrap();
        *current = 0;
        self.map.clear();
        self.pinned.clear();
        self.unsent.lock().unwrap().clear();
    }

    /// `r` did not reach the primary: to be sent again (`resend`).
    pub fn unsent(&self, r: Vec<Release>) {
        self.unsent.lock().unwrap().extend(r);
    }

    /// The releases to send again now: those whose locks are sure to be
    /// alive at the primary when a call sent now arrives (the others lapse
    /// there on their own; a late one could take a lock taken again since).
    pub fn resend(&self, now: u64) -> Vec<Release> {
        let current = self.registration();
        let mut u = self.unsent.lock().unwrap();
        u.retain(|r| r.until_ms > now + self.margin_ms && r.registration == current);
        std::mem::take(&mut *u)
    }

    /// A hold whose lock at the primary is sure to outlast the release
    /// call is released; one about to lapse there is left to lapse, so a
    /// late release never takes a lock the node took again since.
    fn release_of(&self, registration: u64, key: &[u8], h: &Held, now: u64) -> Option<Release> {
        let r = Release { registration, key: key.to_vec(), locks: h.locks, uses: h.uses, until_ms: h.until_ms };
        (h.until_ms > now + self.margin_ms).then_some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{NodeId, RegionId};

    fn loc(offset: u64) -> Location {
        Location { node: NodeId(2), region: RegionId(1), offset, length: 10, generation: 1, version: 1 }
    }

    /// The registration the tests' holds are granted under.
    const R: u64 = 7;

    fn held(h: Holds) -> Holds {
        h.registered(R);
        h
    }

    const A: Session = Session(1);
    const B: Session = Session(2);

    #[test]
    fn a_readers_lock_never_outlasts_the_hold() {
        let h = held(Holds::new(100, 50));
        let now = h.now_ms();
        h.adopt(R, b"k", loc(0), "t", now + 1_000, A, now + 500, false).unwrap();
        assert_eq!(h.lock(b"k", B, 900, &Scope::All, now).unwrap().unwrap(), loc(0));
        assert!(h.lock(b"k", B, 1_100, &Scope::All, now).is_none(), "longer than the hold: ask the primary");
        assert!(h.lock(b"k", B, 100, &Scope::All, now + 950).is_none());
        let denied = h.lock(b"k", B, 10, &Scope::tenants(["u"]), now).unwrap().unwrap_err();
        assert_eq!(denied.kind(), ErrorKind::PermissionDenied);
    }

    #[test]
    fn holds_go_back_with_one_unlock_per_node_lock_unless_about_to_lapse() {
        let h = held(Holds::new(100, 50));
        let now = h.now_ms();
        // Two concurrent lookups of a key not yet held: two node locks.
        h.adopt(R, b"k", loc(0), "t", now + 10_000, A, now + 10, false).unwrap();
        h.adopt(R, b"k", loc(0), "t", now + 10_000, B, now + 10, false).unwrap();
        h.lock(b"k", A, 5, &Scope::All, now).unwrap().unwrap();
        // Lapsing soon (within twice the call timeout): left to lapse.
        h.adopt(R, b"j", loc(1), "t", now + 150, A, now + 10, false).unwrap();
        assert!(h.sweep(now + 50).is_empty(), "readers, and recently read");
        let out = h.sweep(now + 200);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].key.as_slice(), out[0].locks, out[0].uses), (b"k".as_slice(), 2, 1));
        assert!(h.is_empty(), "j dropped without a release");
    }

    #[test]
    fn renewals_release_a_lock_only_while_the_node_holds_two() {
        let h = held(Holds::new(100, 50));
        let now = h.now_ms();
        h.adopt(R, b"k", loc(0), "t", now + 1_000, A, now + 10, false).unwrap();
        assert!(!h.renewable(b"k", now), "one lock: unlocking it first would leave the key unlocked");
        h.adopt(R, b"k", loc(0), "t", now + 2_000, A, now + 10, false).unwrap();
        assert!(h.renewable(b"k", now));
        assert!(!h.renewable(b"k", now + 1_950), "may lapse before the call arrives");
        for i in 0..5 {
            h.adopt(R, b"k", loc(0), "t", now + 3_000 + i, A, now + 10, true).unwrap();
        }
        assert_eq!(h.sweep(now + 500)[0].locks, 2);
    }

    #[test]
    fn a_hold_that_lapsed_is_taken_again_from_scratch() {
        let h = held(Holds::new(100, 50));
        let now = h.now_ms();
        h.adopt(R, b"k", loc(0), "t", now, A, now, false).unwrap();
        h.adopt(R, b"k", loc(7), "u", now + 10_000, B, now + 5_000, false).unwrap();
        let out = h.take([b"k".as_slice()], now + 6_000);
        assert_eq!(out[0].locks, 1, "the lapsed lock is not released again");
        assert!(h.lock(b"k", A, 1, &Scope::All, now + 6_000).is_none());
    }

    #[test]
    fn a_clients_locks_through_held_keys_are_bounded_and_counted_down_as_they_go() {
        // Locations of 10 bytes: a bound of 25 lets a client lock two keys.
        let h = held(Holds::new(100, 50).with_pin_limit(25));
        let now = h.now_ms();
        for (i, k) in [b"a", b"b", b"c"].iter().enumerate() {
            h.adopt(R, *k, loc(i as u64), "t", now + 10_000, Session(10 + i as u64), now + 5_000, false).unwrap();
        }
        assert!(h.lock(b"a", A, 100, &Scope::All, now).unwrap().is_ok());
        assert!(h.lock(b"a", A, 100, &Scope::All, now).unwrap().is_ok(), "the same key again costs nothing");
        assert!(h.lock(b"b", A, 100, &Scope::All, now).unwrap().is_ok());
        let over = h.lock(b"c", A, 100, &Scope::All, now).unwrap().unwrap_err();
        assert_eq!(over.kind(), ErrorKind::ResourceExhausted);
        // A key not held yet: the hold is taken, the client's lock refused.
        let refused = h.adopt(R, b"d", loc(3), "t", now + 10_000, A, now + 5_000, false).unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::ResourceExhausted);
        assert!(h.knows(b"d"));
        // Unlocking one key (both of its locks) makes room again.
        h.unlock(b"a", A, now).unwrap();
        h.unlock(b"a", A, now).unwrap();
        assert!(h.lock(b"c", A, 100, &Scope::All, now).unwrap().is_ok());
        // Expired locks stop counting too (the sweep prunes them).
        assert!(h.lock(b"a", A, 100, &Scope::All, now + 50).unwrap().is_err(), "b and c still locked");
        h.sweep(now + 200);
        assert!(h.lock(b"a", A, 100, &Scope::All, now + 200).unwrap().is_ok());
        assert!(h.lock(b"b", A, 100, &Scope::All, now + 200).unwrap().is_ok());
        // Another client is bounded on its own.
        assert!(h.lock(b"c", B, 100, &Scope::All, now).unwrap().is_ok());
    }

    #[test]
    fn releases_that_did_not_arrive_are_sent_again_while_their_locks_live() {
        let h = held(Holds::new(100, 50));
        let now = h.now_ms();
        let r = |key: &[u8], until_ms| Release { registration: R, key: key.to_vec(), locks: 1, uses: 0, until_ms };
        h.unsent(vec![r(b"a", now + 1_000), r(b"b", now + 80)]);
        let again: Vec<Vec<u8>> = h.resend(now).into_iter().map(|r| r.key).collect();
        assert_eq!(again, vec![b"a".to_vec()], "b's locks may lapse before the call arrives");
        assert!(h.resend(now).is_empty(), "taken once");
        h.unsent(vec![r(b"c", now + 1_000)]);
        h.void();
        assert!(h.resend(now).is_empty(), "the primary forgot this node's locks: nothing to give back");
    }

    #[test]
    fn a_closed_session_lets_go_of_the_holds_only_it_read() {
        let h = held(Holds::new(100, 50));
        let now = h.now_ms();
        h.adopt(R, b"a", loc(0), "t", now + 10_000, A, now + 5_000, false).unwrap();
        h.adopt(R, b"b", loc(1), "t", now + 10_000, A, now + 5_000, false).unwrap();
        h.lock(b"b", B, 100, &Scope::All, now).unwrap().unwrap();
        h.lock(b"a", A, 100, &Scope::All, now).unwrap().unwrap();
        let (n, out) = h.release_session(A, now);
        assert_eq!(n, 3);
        assert_eq!(out.iter().map(|r| r.key.as_slice()).collect::<Vec<_>>(), vec![b"a".as_slice()]);
        assert_eq!(h.unlock(b"b", A, now).unwrap_err().kind(), ErrorKind::PermissionDenied);
        assert!(h.unlock(b"b", B, now).is_ok());
        assert_eq!(h.unlock(b"b", B, now).unwrap_err().kind(), ErrorKind::FailedPrecondition);
    }

    #[test]
    fn an_answer_granted_before_the_node_joined_again_is_not_adopted_nor_given_back() {
        let h = held(Holds::new(100, 50));
        let now = h.now_ms();
        h.adopt(R, b"k", loc(0), "t", now + 10_000, A, now + 5_000, false).unwrap();
        h.unsent(vec![Release { registration: R, key: b"j".to_vec(), locks: 1, uses: 0, until_ms: now + 10_000 }]);
        // The primary declared the node dead: its locks went with it.
        h.void();
        let late = h.adopt(R, b"a", loc(1), "t", now + 10_000, A, now + 5_000, false).unwrap_err();
        assert_eq!(late.kind(), ErrorKind::Aborted, "no registration: nothing adopted");
        h.registered(R + 2);
        let late = h.adopt(R, b"a", loc(1), "t", now + 10_000, A, now + 5_000, false).unwrap_err();
        assert_eq!(late.kind(), ErrorKind::Aborted, "granted under the old registration");
        assert!(!h.knows(b"a") && !h.knows(b"k"));
        assert!(h.resend(now).is_empty(), "the old registration's releases are not sent");
        h.adopt(R + 2, b"a", loc(1), "t", now + 10_000, A, now + 10, false).unwrap();
        let out = h.sweep(now + 500);
        assert_eq!((out.len(), out[0].registration), (1, R + 2), "released under the registration that took it");
    }
}
