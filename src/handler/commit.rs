//! Commits and aborts: each reservation's record written "committed" in
//! the pool before the registry publishes the key, and aborted pages freed.
use std::collections::HashMap;

use super::{Handler, Pending};
use crate::error::{Error, ErrorKind, Result};
use crate::ids::ReservationId;
use crate::pool::RecordBatch;
use crate::regions::Held;
use crate::registry::Ops;
use crate::registry::{Location, Session};

impl Handler {
    /// Per-id outcome plus the removal-log position at commit time.
    /// `crc32`: empty, or the payload's crc32 (IEEE) per id, recorded in the
    /// pool so inline reads (and mapped readers that ask) can verify bytes.
    ///
    /// The record says "committed" before the key becomes visible (a
    /// restart keeps exactly what was published, and nothing half written);
    /// it is written only while the reservation's pages are still its own.
    pub async fn commit(
        &self,
        ids: &[ReservationId],
        crc32: &[u32],
        owner: Session,
    ) -> Result<(Vec<Result<Location>>, u64)> {
        self.check_commit(ids, crc32)?;
        let (send, early) = self.publish_records(ids, crc32, owner);
        let (out, removed_seq) = self.dir.commit(&send.iter().map(|s| s.0).collect::<Vec<_>>(), owner).await?;
        // The registry refused these (their reservation expired, or the
        // primary restarted and never knew them): their records must not
        // say "committed", or a rebuild would bring back a version no client
        // was told was stored. Their pages are freed with them.
        let refused: Vec<Location> = send.iter().zip(&out).filter(|(_, r)| r.is_err()).map(|(s, _)| s.1).collect();
        self.regions.release(&refused);
        let mut out = out.into_iter();
        let merged = early.into_iter().map(|e| match e {
            Some(e) => Err(e),
            None => out.next().expect("one result per id sent"),
        });
        Ok((merged.collect(), removed_seq))
    }

    /// Write the batch's records as committed, fenced once before this
    /// returns (so before any key is published): the ids to send to the
    /// registry, and the errors of the others by position. The locks are
    /// taken once for the batch (see `Regions::hold`).
    pub(super) fn publish_records(
        &self,
        ids: &[ReservationId],
        crc32: &[u32],
        owner: Session,
    ) -> (Vec<(ReservationId, Location)>, Vec<Option<Error>>) {
        let mut early: Vec<Option<Error>> = vec![None; ids.len()];
        let mut send = vec![];
        let records = self.pool.record_batch();
        let mut pending = self.pending.lock().unwrap();
        let held = self.regions.hold();
        for (i, id) in ids.iter().enumerate() {
            let crc = crc32.get(i).copied();
            match self.publish_record(&records, &mut pending, &held, *id, owner, crc) {
                Ok(loc) => send.push((*id, loc)),
                Err(e) => early[i] = Some(e),
            }
        }
        (send, early)
    }

    /// A commit batch is well formed (checked before anything is applied).
    pub(super) fn check_commit(&self, ids: &[ReservationId], crc32: &[u32]) -> Result<()> {
        self.check_batch(ids.len())?;
        if !crc32.is_empty() && crc32.len() != ids.len() {
            return Err(Error::invalid(format!("{} checksums for {} reservations", crc32.len(), ids.len())));
        }
        if crc32.is_empty() && self.limits.require_checksum && !ids.is_empty() {
            return Err(Error::invalid("this sidecar requires a payload checksum with every commit"));
        }
        Ok(())
    }

    /// Write reservation `id`'s record as committed. Only reservations made
    /// through this node can be committed here; another session's is
    /// refused before its record could be touched.
    pub(super) fn publish_record(
        &self,
        records: &RecordBatch<'_>,
        pending: &mut HashMap<ReservationId, Pending>,
        held: &Held<'_>,
        id: ReservationId,
        owner: Session,
        crc: Option<u32>,
    ) -> Result<Location> {
        let p = *Self::own_reservation(pending.get(&id), owner)?;
        pending.remove(&id);
        let page = p.loc.offset / self.page_size;
        // Pages freed meanwhile (the reservation expired): leave their
        // record alone; the registry answers NOT_FOUND.
        held.if_current(&p.loc, || records.commit(p.loc.region, page, p.seq, crc))?;
        Ok(p.loc)
    }

    /// Abort reservations made through this node by `owner`; as for a
    /// commit, an id this node did not hand out is NOT_FOUND (another
    /// node's reservation included) and another session's PERMISSION_DENIED,
    /// before anything is asked of the registry.
    pub async fn abort(&self, ids: &[ReservationId], owner: Session) -> Result<Vec<Result<Location>>> {
        self.check_batch(ids.len())?;
        let early: Vec<Option<Error>> = {
            let pending = self.pending.lock().unwrap();
            ids.iter().map(|id| Self::own_reservation(pending.get(id), owner).err()).collect()
        };
        let send: Vec<ReservationId> = ids.iter().zip(&early).filter(|(_, e)| e.is_none()).map(|(id, _)| *id).collect();
        let out = if send.is_empty() { vec![] } else { self.dir.abort(&send, owner).await? };
        {
            let mut pending = self.pending.lock().unwrap();
            for (id, r) in send.iter().zip(&out) {
                if r.is_ok() {
                    pending.remove(id);
                }
            }
        }
        self.regions.release(&out.iter().filter_map(|r| r.as_ref().ok().copied()).collect::<Vec<_>>());
        let mut out = out.into_iter();
        Ok(early.into_iter().map(|e| e.map_or_else(|| out.next().expect("one result per id sent"), Err)).collect())
    }

    /// A reservation made through this node, by `owner`.
    pub(super) fn own_reservation(p: Option<&Pending>, owner: Session) -> Result<&Pending> {
        let p = p.ok_or_else(|| {
            Error::new(ErrorKind::NotFound, "no open reservation with this id (expired or never made)")
        })?;
        if p.owner != owner {
            return Err(Error::new(ErrorKind::PermissionDenied, "reservation belongs to another session"));
        }
        Ok(p)
    }
}
