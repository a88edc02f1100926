//! The two-phase store: what is present or admitted, reservations recorded
//! (with their commit sequence), commits that publish them, aborts.
use std::hash::BuildHasher;

use super::LocalRegistry;
use crate::error::{Error, ErrorKind, Result};
use crate::eviction::Obj;
use crate::ids::ReservationId;
use crate::registry::admission::Run;
use crate::registry::entry::Entry;
use crate::registry::inner::Open;
use crate::registry::{Admit, Location, ReserveOpts, Scope, Session};

impl LocalRegistry {
    /// Committed or being written (a reserve of these would report "exists").
    pub fn present(&self, keys: &[&[u8]]) -> Vec<bool> {
        let g = self.lock();
        g.find_many(keys, false).into_iter().map(|id| id.is_some()).collect()
    }

    /// Per key to store (with its size), one store's batch in its order:
    /// present (committed or being written), or admitted or refused by
    /// admission. Each judgement is a touch the admission remembers: ask
    /// once per store.
    pub fn admit(&self, items: &[(&[u8], u64)]) -> Vec<Admit> {
        self.admit_run(items, &mut Run::default())
    }

    /// `admit` for a part of a batch (`run`: what the parts before it left).
    pub fn admit_run(&self, items: &[(&[u8], u64)], run: &mut Run) -> Vec<Admit> {
        let mut g = self.lock();
        let live = g.keys as usize;
        // Every key's slot and entry loaded in one round (overlapped misses).
        let keys: Vec<&[u8]> = items.iter().map(|i| i.0).collect();
        let (found, hashes) = g.find_many_hashed(&keys, false);
        found
            .into_iter()
            .zip(hashes)
            .zip(items)
            .map(|((id, h), &(_, size))| {
                if id.is_some() {
                    Admit::Present
                } else if g.admission.judge(h, size, live, run) {
                    Admit::Admitted
                } else {
                    Admit::Refused
                }
            })
            .collect()
    }

    /// Committed keys of `scope`'s tenants (another tenant's key is false).
    pub fn exists_in(&self, keys: &[&[u8]], scope: &Scope) -> Vec<bool> {
        let g = self.lock();
        let allowed = g.scope_ids(scope);
        keys.iter()
            .map(|k| {
                g.find(k).is_some_and(|id| {
                    g.slab[id.index()].as_ref().unwrap().committed && g.check_scope(id, &allowed).is_ok()
                })
            })
            .collect()
    }

    /// As `reserve`, with each reservation's commit sequence: the order of
    /// a key's versions pool-wide (a key is reserved again only after its
    /// previous version left the registry, so a later version always has a
    /// larger sequence). The writer records it in the object's record; a
    /// rebuild that finds two committed records of one key keeps the larger.
    pub fn reserve_seq(
        &self,
        tenant: &str,
        items: Vec<(Vec<u8>, Location)>,
        opts: ReserveOpts,
    ) -> Vec<Result<(ReservationId, u64)>> {
        let mut g = self.lock();
        items
            .into_iter()
            .map(|(key, loc)| {
                if let Some(id) = g.find(&key) {
                    let what = if g.entry(id).committed { "is already stored" } else { "is being written" };
                    return Err(Error::new(ErrorKind::AlreadyExists, format!("key {what}")));
                }
                let Some(t) = g.tenant_ref(tenant, false) else {
                    return Err(Error::new(
                        ErrorKind::ResourceExhausted,
                        format!("tenant limit reached: {} tenants hold keys or reservations", g.max_tenants),
                    ));
                };
                if let Err(e) = g.check_pin(opts.owner, loc.length) {
                    g.tenant_unref(t);
                    return Err(e);
                }
                let tn = g.tenant(t);
                if !tn.limit.admits(tn.bytes + tn.reserving, loc.length) {
                    let (used, quota) = (tn.bytes + tn.reserving, tn.limit.quota);
                    g.tenant_unref(t);
                    return Err(Error::new(
                        ErrorKind::ResourceExhausted,
                        format!(
                            "tenant {tenant:?} is at its quota: {used} of {quota} bytes in use and nothing more \
                             of its own can be evicted now; this object needs {}",
                            loc.length
                        ),
                    ));
                }
                tn.reserving += loc.length;
                let entry = Entry::new(&key, loc, t).inspect_err(|_| {
                    g.tenant(t).reserving -= loc.length;
                    g.tenant_unref(t);
                })?;
                let seq = self.next_seq(&mut g).inspect_err(|_| {
                    g.tenant(t).reserving -= loc.length;
                    g.tenant_unref(t);
                })?;
                let id = g.insert(entry);
                let res = g.new_reservation_id();
                let open =
                    Open { id, owner: opts.owner, server_writes: opts.server_writes, deadline: opts.deadline, seq };
                g.open.insert(res, open);
                g.pin(opts.owner, loc.length);
                g.reserved += 1;
                g.deadlines.push_back((opts.deadline, res));
                Ok((res, seq))
            })
            .collect()
    }

    /// Publish reservations of `owner` (PermissionDenied for another
    /// session's). `publish` runs for each one just before it becomes
    /// visible, under the registry's lock, while its pages are still the
    /// reservation's: it must be short. Also returns the removal log's next
    /// seq, read atomically with the commits.
    pub fn commit(
        &self,
        ids: &[ReservationId],
        owner: Session,
        publish: &mut dyn FnMut(usize, &Location),
    ) -> (Vec<Result<Location>>, u64) {
        let mut g = self.lock();
        let out = ids
            .iter()
            .enumerate()
            .map(|(i, res)| {
                let id = g.open_of(*res, owner)?;
                let seq = g.close_reservation(*res).map_or(0, |o| o.seq);
                g.reserved -= 1;
                let e = g.entry(id);
                let (loc, t) = (e.loc(), e.tenant);
                publish(i, &loc);
                g.mark_committed(id);
                g.keys += 1;
                g.bytes += loc.length;
                let tn = g.tenant(t);
                tn.reserving -= loc.length;
                tn.bytes += loc.length;
                tn.keys += 1;
                let hash = g.hasher.hash_one(g.slab[id.index()].as_ref().expect("live entry id").key.as_slice());
                g.orders.insert(loc.node, t, id, Obj { size: loc.length, hash });
                g.announce_stored(id, seq);
                Ok(loc)
            })
            .collect();
        (out, g.removed_next)
    }

    /// Hand out commit sequences above `floor` only (the largest a rebuild
    /// found in the pool).
    pub fn raise_seq(&self, floor: u64) {
        let mut g = self.lock();
        g.seq_next = g.seq_next.max(floor + 1);
    }

    /// Drop reservations of `owner`; the freed locations are returned per id.
    pub fn abort(&self, ids: &[ReservationId], owner: Session) -> Vec<Result<Location>> {
        let mut g = self.lock();
        ids.iter()
            .map(|res| {
                let id = g.open_of(*res, owner)?;
                g.close_reservation(*res);
                Ok(g.remove(id))
            })
            .collect()
    }
}
