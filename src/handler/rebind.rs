//! A reservation committed under another key than the one it was reserved
//! with (`CommitRequest.keys`). A client leases reservations ahead of need
//! under names of its own and binds each to a chunk's key when it commits
//! it: a store is then copy → Commit, its Reserve off the critical path.
//!
//! A bind is the steps a store already takes, in the order they keep every
//! rule (write-once, admission, quotas, pin budgets, events): judge the key
//! as a Reserve of it would be (present, or declined: the lease is given
//! back); take the lease out of the registry (its pages stay this node's,
//! placed, as between placing and recording in a reserve); rewrite the
//! object's "writing" record under the key; reserve the key at those pages;
//! commit. A crash in between leaves a "writing" record, quarantined on
//! restart as any reservation's is. Offered on a single node, where the
//! registry is in this process and an abort frees nothing by itself
//! (`Directory::rebinds`): a follower's bind would be three forwarded
//! calls, and a cluster's primary tells a reservation's owner to free what
//! an abort lets go of, which would free the bound object's pages.
use bytes::Bytes;

use super::{Handler, Outcome, Placed, Writer};
use crate::error::{Error, ErrorKind, Result};
use crate::ids::ReservationId;
use crate::pool::record::{overflow_len, RecordRef, RecordState, NAME_INLINE};
use crate::registry::{Admit, Location, Ops, Session};

/// Per id of a commit, its outcome once known.
type Slot = Option<Result<Location>>;

/// A lease to bind: its position in the commit, id, key, crc, tenant, pages.
struct Bind {
    at: usize,
    id: ReservationId,
    key: Bytes,
    crc: Option<u32>,
    tenant: String,
    loc: Location,
}

impl Handler {
    /// Tenant plus key bytes a bound key may take (0: not offered here).
    pub fn commit_as_name_bytes(&self) -> u32 {
        if self.dir.rebinds() {
            NAME_INLINE as u32
        } else {
            0
        }
    }

    /// `commit`, with `keys` empty or one per id: a non-empty key commits
    /// that reservation under it instead.
    pub async fn commit_keyed(
        &self,
        ids: &[ReservationId],
        crc32: &[u32],
        keys: &[Bytes],
        owner: Session,
    ) -> Result<(Vec<Result<Location>>, u64)> {
        if keys.iter().all(|k| k.is_empty()) {
            return self.commit(ids, crc32, owner).await;
        }
        self.check_commit(ids, crc32)?;
        if self.commit_as_name_bytes() == 0 {
            return Err(Error::precondition("this sidecar does not commit reservations under other keys"));
        }
        if keys.len() != ids.len() {
            return Err(Error::invalid(format!("{} keys for {} reservations", keys.len(), ids.len())));
        }
        self.check_keys(&keys.iter().filter(|k| !k.is_empty()).collect::<Vec<_>>())?;
        let mut out: Vec<Slot> = vec![None; ids.len()];
        let binds = self.binds(ids, crc32, keys, owner, &mut out)?;
        let plain: Vec<usize> = (0..ids.len()).filter(|&i| keys[i].is_empty()).collect();
        let mut seq = u64::MAX;
        if !plain.is_empty() {
            let crcs: Vec<u32> = if crc32.is_empty() { vec![] } else { plain.iter().map(|&i| crc32[i]).collect() };
            let (done, s) = self.commit(&plain.iter().map(|&i| ids[i]).collect::<Vec<_>>(), &crcs, owner).await?;
            for (i, r) in plain.into_iter().zip(done) {
                out[i] = Some(r);
            }
            seq = s;
        }
        if !binds.is_empty() {
            seq = seq.min(self.bind(binds, owner, &mut out).await?);
        }
        let seq = if seq == u64::MAX { 0 } else { seq };
        Ok((out.into_iter().map(|r| r.expect("every id answered")).collect(), seq))
    }

    /// The leases to bind, each checked to be `owner`'s; a key whose name
    /// would not fit its record refuses the whole call (nothing applied).
    fn binds(
        &self,
        ids: &[ReservationId],
        crc32: &[u32],
        keys: &[Bytes],
        owner: Session,
        out: &mut [Slot],
    ) -> Result<Vec<Bind>> {
        let pending = self.pending.lock().unwrap();
        let mut binds = vec![];
        for (at, (id, key)) in ids.iter().zip(keys).enumerate().filter(|(_, (_, k))| !k.is_empty()) {
            let p = match Self::own_reservation(pending.get(id), owner) {
                Ok(p) => *p,
                Err(e) => {
                    out[at] = Some(Err(e));
                    continue;
                }
            };
            // The tenant is the one its "writing" record names (read here,
            // not kept per reservation: the commit path stays free of
            // reference counts, each a locked instruction).
            let Some(tenant) = self.writing_tenant(&p.loc) else {
                out[at] = Some(Err(Error::new(ErrorKind::NotFound, "reservation's record is gone")));
                continue;
            };
            if overflow_len(&tenant, key) > 0 {
                return Err(Error::invalid(format!(
                    "key #{at}: tenant and key take {} bytes; a bound key may take {NAME_INLINE}",
                    tenant.len() + key.len()
                )));
            }
            binds.push(Bind { at, id: *id, key: key.clone(), crc: crc32.get(at).copied(), tenant, loc: p.loc });
        }
        Ok(binds)
    }

    /// The tenant of the object being written at `loc`, from its record.
    fn writing_tenant(&self, loc: &Location) -> Option<String> {
        match self.pool.read_record(loc.region, loc.offset / self.page_size) {
            Ok(Some(r)) if r.state == RecordState::Writing && r.generation == loc.generation => Some(r.tenant),
            _ => None,
        }
    }

    /// Judge, take the leases out, rewrite, reserve and commit under the
    /// keys; the removal-log position of the commit.
    async fn bind(&self, binds: Vec<Bind>, owner: Session, out: &mut [Slot]) -> Result<u64> {
        let items: Vec<(Bytes, u64)> = binds.iter().map(|b| (b.key.clone(), b.loc.length)).collect();
        let verdicts = self.wanted(&items, true).await?;
        let (mut admitted, mut refused) = (vec![], vec![]);
        for (b, v) in binds.into_iter().zip(verdicts) {
            match v {
                Admit::Admitted => admitted.push(b),
                Admit::Present => {
                    refused.push((b, Error::new(ErrorKind::AlreadyExists, "key is already stored or being written")))
                }
                Admit::Refused => refused.push((b, Error::not_admitted())),
            }
        }
        if !refused.is_empty() {
            self.abort(&refused.iter().map(|(b, _)| b.id).collect::<Vec<_>>(), owner).await?;
            for (b, e) in refused {
                out[b.at] = Some(Err(e));
            }
        }
        if admitted.is_empty() {
            return Ok(u64::MAX);
        }
        let _placing = self.regions.placing();
        let taken = self.take_leases(admitted, owner, out).await?;
        let placed = self.rewrite(taken, out)?;
        self.reserve_and_commit(placed, owner, out).await
    }

    /// The leases out of the registry; their pages stay placed.
    async fn take_leases(&self, binds: Vec<Bind>, owner: Session, out: &mut [Slot]) -> Result<Vec<Bind>> {
        let taken = self.dir.abort(&binds.iter().map(|b| b.id).collect::<Vec<_>>(), owner).await?;
        let mut pending = self.pending.lock().unwrap();
        let mut kept = vec![];
        for (b, r) in binds.into_iter().zip(taken) {
            pending.remove(&b.id);
            match r {
                Ok(loc) if loc == b.loc => kept.push(b),
                Ok(loc) => {
                    // Not what this node handed out: never written under a key.
                    self.regions.release(&[loc]);
                    out[b.at] = Some(Err(Error::new(ErrorKind::Internal, "reservation moved")));
                }
                Err(e) => out[b.at] = Some(Err(e)),
            }
        }
        Ok(kept)
    }

    /// Each object's record rewritten "writing" under its new key, fenced
    /// before any of them is reserved.
    fn rewrite(&self, binds: Vec<Bind>, out: &mut [Slot]) -> Result<Vec<Bind>> {
        let records = self.pool.record_batch();
        let held = self.regions.hold(); // dropped first: the fence comes after the unlock
        let mut kept = vec![];
        for b in binds {
            let rec = RecordRef {
                state: RecordState::Writing,
                tenant: &b.tenant,
                key: &b.key,
                generation: b.loc.generation,
                seq: 0,
                length: b.loc.length,
                payload_crc: None,
            };
            let page = b.loc.offset / self.page_size;
            if held.if_current(&b.loc, || records.write(b.loc.region, page, rec))? {
                kept.push(b);
            } else {
                out[b.at] = Some(Err(Error::new(ErrorKind::NotFound, "reservation's pages were freed")));
            }
        }
        Ok(kept)
    }

    /// Reserve each key at its lease's pages (per tenant), then commit.
    async fn reserve_and_commit(&self, binds: Vec<Bind>, owner: Session, out: &mut [Slot]) -> Result<u64> {
        let mut ids: Vec<(usize, ReservationId, Option<u32>)> = vec![];
        let mut tenants: Vec<&str> = vec![];
        for b in &binds {
            if !tenants.contains(&b.tenant.as_str()) {
                tenants.push(&b.tenant);
            }
        }
        for tenant in tenants {
            let group: Vec<&Bind> = binds.iter().filter(|b| b.tenant == tenant).collect();
            let placed: Vec<Placed> = group.iter().enumerate().map(|(i, b)| (i, b.key.clone(), b.loc)).collect();
            let mut results: Vec<Outcome> = vec![None; group.len()];
            let who = Writer { tenant, hints: &[], owner, server_writes: false, judge: false, evict: false };
            let freed = self.reserve_placed(&who, placed, 0, &mut results).await?;
            self.regions.release(&freed);
            for (b, r) in group.iter().zip(results) {
                match r.expect("every item answered") {
                    Ok((id, _)) => ids.push((b.at, id, b.crc)),
                    Err(e) => out[b.at] = Some(Err(e)),
                }
            }
        }
        if ids.is_empty() {
            return Ok(u64::MAX);
        }
        let crcs: Vec<u32> = ids.iter().map_while(|i| i.2).collect();
        let crcs = if crcs.len() == ids.len() { crcs } else { vec![] };
        let (done, seq) = self.commit(&ids.iter().map(|i| i.1).collect::<Vec<_>>(), &crcs, owner).await?;
        for ((at, _, _), r) in ids.into_iter().zip(done) {
            out[at] = Some(r);
        }
        Ok(seq)
    }
}
