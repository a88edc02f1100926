//! A store batch's Commit riding on the client's next Reserve
//! (`ReserveRequest.commit_first`), as unlocks ride on a lookup: one round
//! trip fewer per batch when batches follow each other.
//!
//! Order and failure rules: both parts are validated first (a malformed part
//! refuses the whole call and applies nothing); then the commits are applied
//! exactly as a Commit call would (each id its own status: a bad id fails only
//! itself); then the items are reserved. Once commits are applied their
//! statuses must reach the client, so a reserve that fails as a whole is
//! kept as a value for the caller to report per item, not returned as the
//! call's error.
use super::{Handler, ReserveResult};
use crate::error::Result;
use crate::ids::ReservationId;
use crate::registry::{Location, Session};
use bytes::Bytes;

pub struct CommitThenReserve {
    /// Per commit_first id, and the removal-log position at commit time.
    pub committed: (Vec<Result<Location>>, u64),
    pub reserved: Result<ReserveResult>,
}

impl Handler {
    /// Commit `commits` (reservation ids and their crc32s), then reserve
    /// as `reserve_with` does.
    pub async fn commit_then_reserve(
        &self,
        (ids, crc32): (&[ReservationId], &[u32]),
        tenant: &str,
        items: Vec<(Bytes, u64)>,
        hints: &[crate::peer_proto::TokenHint],
        owner: Session,
        how: super::How,
    ) -> Result<CommitThenReserve> {
        self.check_items(tenant, &items)?;
        self.check_commit(ids, crc32)?;
        let committed = self.commit(ids, crc32, owner).await?;
        let reserved = self.reserve_with(tenant, items, hints, owner, false, how).await;
        Ok(CommitThenReserve { committed, reserved })
    }
}
