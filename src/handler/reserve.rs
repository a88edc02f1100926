//! A reserve, in rounds: validate, find keys present (or ask admission),
//! place what fits in this node's pages, record with the registry (which
//! evicts the shortfall among this node's entries in the same call), place
//! what now fits.

use super::{Handler, How, Outcome, Pending, Placed, ReserveResult, Writer, SETTLES, SETTLE_WAIT};
use crate::error::{Error, ErrorKind, Result};
use crate::ids::ReservationId;
use crate::peer_proto::TokenHint;
use crate::registry::ops::ReserveCall;
use crate::registry::Ops;
use crate::registry::{Admit, Location, Session};
use bytes::Bytes;

impl Handler {
    /// Reserve pages for each item; evicts inside the call when short.
    /// `owner` alone may commit or abort the reservations; with
    /// `server_writes` the sidecar writes the bytes itself (inline put).
    ///
    /// Stages: validate → find keys present → place what fits (claiming a
    /// region when the owned ones are full) → record, asking the registry
    /// to evict the shortfall among this node's entries in the same call →
    /// place what now fits, and so on while evictions free pages. No lock
    /// is held across stages; one registry call per round.
    pub async fn reserve<K: Into<Bytes>>(
        &self,
        tenant: &str,
        items: Vec<(K, u64)>,
        owner: Session,
        server_writes: bool,
    ) -> Result<ReserveResult> {
        let items = items.into_iter().map(|(k, n)| (k.into(), n)).collect();
        self.reserve_with(tenant, items, &[], owner, server_writes, How::STORE).await
    }

    /// `reserve`, with the token ids a client handed for some items
    /// (`hints`, one per item or none), carried with each reservation to
    /// the registry for its commit's event; and as `how` says: judged,
    /// admission decides first which items are worth a place (those it
    /// declines are NotAdmitted: nothing placed, reserved or evicted for
    /// them), else every item is stored (a client's buffers that no reader
    /// will ask for); not evicting, an item without free room is
    /// ResourceExhausted.
    pub async fn reserve_with(
        &self,
        tenant: &str,
        items: Vec<(Bytes, u64)>,
        hints: &[TokenHint],
        owner: Session,
        server_writes: bool,
        how: How,
    ) -> Result<ReserveResult> {
        let judged = how.judged;
        self.check_items(tenant, &items)?;
        if !self.dir.may_write() {
            // Its lease is shorter than the time after which the primary
            // declares it dead and may hand its regions to another node.
            return Err(Error::new(ErrorKind::Unavailable, "cut off from the cluster's primary: not writing"));
        }
        let wanted = self.wanted(&items, judged).await?;
        let mut results: Vec<Option<Result<(ReservationId, Location)>>> = (0..items.len()).map(|_| None).collect();
        let mut todo = Vec::with_capacity(items.len());
        for (idx, ((key, size), want)) in items.into_iter().zip(wanted).enumerate() {
            match want {
                Admit::Admitted => todo.push((idx, key, size)),
                Admit::Present => {
                    results[idx] =
                        Some(Err(Error::new(ErrorKind::AlreadyExists, "key is already stored or being written")))
                }
                Admit::Refused => results[idx] = Some(Err(Error::not_admitted())),
            }
        }
        // Where the registry is remote, its reserve judges (the primary
        // decides for the pool).
        let who =
            Writer { tenant, hints, owner, server_writes, judge: judged && !self.dir.is_local(), evict: how.evict };
        let mut evicted = 0u32;
        for settle in 0..=SETTLES {
            let (mark, evicted_before) = (self.regions.placing_mark(), evicted);
            todo = self.place_and_reserve(&who, todo, &mut results, &mut evicted).await?;
            // Pages another reserve placed and has not yet reserved or given
            // back (a client past its pin limit places all it asks for
            // before the registry refuses the rest) come back in a moment:
            // when another reserve was placing during this one, wait for it
            // and try again, a few times, before calling the pool full; and
            // go on while evicting still frees pages. Otherwise the room
            // there is was all there is: trying again would repeat the same
            // failures (a storm of reserves that cannot be placed would
            // cost each one that many times over).
            let progress = evicted > evicted_before;
            if todo.is_empty() || settle == SETTLES || !(progress || mark.others_since(&self.regions)) {
                break;
            }
            self.regions.settled(SETTLE_WAIT).await;
        }
        for (idx, _, _) in todo {
            results[idx] = Some(Err(Error::new(
                ErrorKind::ResourceExhausted,
                "no space: no free region, and every entry left is in use (locked or being written)",
            )));
        }
        Ok(ReserveResult { results: results.into_iter().map(|r| r.expect("every item answered")).collect(), evicted })
    }

    /// Reserve what was placed (evicting `shortfall` pages of this node's
    /// entries on the way); returns what was evicted, for the caller to
    /// release (or place into).
    pub(super) async fn reserve_placed(
        &self,
        who: &Writer<'_>,
        placed: Vec<Placed>,
        shortfall: u64,
        results: &mut [Outcome],
    ) -> Result<Vec<Location>> {
        let Writer { tenant, hints, owner, server_writes, judge, .. } = *who;
        if placed.is_empty() && shortfall == 0 {
            // Nothing to record or evict: on a follower that call was a
            // round trip to the primary for each Reserve that found no room.
            return Ok(vec![]);
        }
        let call = ReserveCall {
            node: self.node,
            tenant,
            items: placed.iter().map(|(_, k, l)| (k.to_vec(), *l)).collect(),
            owner,
            server_writes,
            timeout_ms: self.limits.reservation_timeout_ms,
            shortfall_pages: shortfall,
            page_size: self.page_size,
            hints: if hints.is_empty() {
                vec![]
            } else {
                placed.iter().map(|(i, _, _)| hints.get(*i).cloned().unwrap_or_default()).collect()
            },
        };
        // On the cluster's primary the registry passes it through the gate
        // a phase 3 victim choice shares (a region being taken back refuses
        // its items).
        let out = self.dir.reserve_judging(call, judge).await;
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                self.regions.release(&placed.iter().map(|p| p.2).collect::<Vec<_>>());
                return Err(e);
            }
        };
        if out.ids.iter().any(|r| r.as_ref().is_err_and(|e| e.kind() == ErrorKind::ResourceExhausted)) {
            self.drop_lost_regions();
        }
        self.record_reserved(placed, out.ids, out.seqs, owner, results);
        Ok(out.freed)
    }

    /// Pages to evict ahead of need where the registry is remote and no
    /// region can be claimed: keeping a low-water mark of free pages (an
    /// eighth of a region) lets the next reserve place everything at once,
    /// so a store stays one forwarded call even on a full node.
    pub(super) fn evict_ahead(&self) -> u64 {
        if self.dir.is_local() {
            return 0;
        }
        let claimable = !self.regions.at_cap() && self.pool.has_unowned_region().unwrap_or(false);
        if claimable {
            return 0;
        }
        (self.regions.pages_per_region() as u64 / 8).saturating_sub(self.regions.free_pages())
    }

    /// Per item: present (stored or being written, or repeated earlier in
    /// the batch), declined by admission (when `judged`), or to store.
    /// Asked only where the registry is in this process (each key once:
    /// a judgement is a touch admission remembers); a primary answers it
    /// in the reserve itself.
    pub(super) async fn wanted(&self, items: &[(Bytes, u64)], judged: bool) -> Result<Vec<Admit>> {
        let mut seen = hashbrown::HashSet::with_capacity(items.len());
        let first: Vec<bool> = items.iter().map(|i| seen.insert(&i.0[..])).collect();
        if !self.dir.is_local() {
            return Ok(first.iter().map(|&f| if f { Admit::Admitted } else { Admit::Present }).collect());
        }
        let mut asked: Vec<(&[u8], u64)> = Vec::with_capacity(items.len());
        asked.extend(items.iter().zip(&first).filter(|(_, &f)| f).map(|(i, _)| (&i.0[..], i.1)));
        let mut answers = if judged {
            self.dir.admit(&asked).await?
        } else {
            let keys: Vec<&[u8]> = asked.iter().map(|a| a.0).collect();
            self.dir
                .present(&keys)
                .await?
                .into_iter()
                .map(|p| if p { Admit::Present } else { Admit::Admitted })
                .collect()
        }
        .into_iter();
        Ok(first.iter().map(|&f| if f { answers.next().unwrap_or(Admit::Present) } else { Admit::Present }).collect())
    }

    pub(super) fn record_reserved(
        &self,
        placed: Vec<Placed>,
        ids: Vec<Result<ReservationId>>,
        seqs: Vec<u64>,
        owner: Session,
        results: &mut [Outcome],
    ) {
        let now = self.now_ms();
        let mut lost = vec![];
        let mut pending = self.pending.lock().unwrap();
        for (((idx, _, loc), r), seq) in placed.into_iter().zip(ids).zip(seqs) {
            match r {
                Ok(id) => {
                    pending.insert(id, Pending { loc, owner, since_ms: now, seq });
                    results[idx] = Some(Ok((id, loc)));
                }
                Err(e) => {
                    lost.push(loc);
                    results[idx] = Some(Err(e));
                }
            }
        }
        drop(pending);
        self.regions.release(&lost);
    }
}
