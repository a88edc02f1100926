//! The registry's types in messages, one module for the client API
//! (`rpc`) and the registry's operations (`directory.rs` encodes each `Op`
//! and reads its result, `local_directory.rs` answers it): locations,
//! reservation ids, per-key outcomes, listings, removals and figures, both
//! ways.
use super::Location;
use crate::error::{Error, ErrorKind, Result};
use crate::ids::{NodeId, RegionId, ReservationId};
use crate::peer_proto::{Ids, PeerLocation};
use crate::proto::KeyStatus;

pub fn to_peer(l: &Location) -> PeerLocation {
    PeerLocation {
        node: l.node.0,
        region: l.region.0,
        offset: l.offset,
        length: l.length,
        generation: l.generation,
        version: l.version,
    }
}

pub fn from_peer(p: &PeerLocation) -> Location {
    Location {
        node: NodeId(p.node),
        region: RegionId(p.region),
        offset: p.offset,
        length: p.length,
        generation: p.generation,
        version: p.version,
    }
}

/// Reservation ids are plain `u64`s on the peer wire.
pub fn ids_to_peer(ids: &[ReservationId]) -> Ids {
    Ids { ids: ids.iter().map(|r| r.0).collect() }
}

pub fn ids_from_peer(ids: &Ids) -> Vec<ReservationId> {
    ids.ids.iter().copied().map(ReservationId).collect()
}

pub fn status_of<T>(r: &Result<T>) -> KeyStatus {
    match r {
        Ok(_) => KeyStatus::default(),
        Err(e) => key_status(e),
    }
}

/// The error a per-key status stands for (None for OK).
pub fn error_of(s: &KeyStatus) -> Option<Error> {
    let kind = ErrorKind::from_code(tonic::Code::from(s.code as i32))?;
    Some(Error::new(kind, s.message.clone()))
}

pub fn result_of(s: &KeyStatus) -> Result<()> {
    error_of(s).map_or(Ok(()), Err)
}

/// A reserve item's status: as `result_of`, except that ABORTED, which no
/// reserve item is answered with but a store admission declined, is that.
pub fn reserve_result_of(s: &KeyStatus) -> Result<()> {
    match error_of(s) {
        Some(e) if e.kind() == ErrorKind::Aborted => Err(Error::new(ErrorKind::NotAdmitted, e.message().to_owned())),
        e => e.map_or(Ok(()), Err),
    }
}

/// Statuses and locations (one per status) → per-key results.
pub fn loc_results(statuses: &[KeyStatus], locs: &[PeerLocation]) -> Result<Vec<Result<Location>>> {
    if statuses.len() != locs.len() {
        return Err(Error::new(ErrorKind::Internal, "primary sent mismatched statuses and locations"));
    }
    Ok(statuses.iter().zip(locs).map(|(s, l)| result_of(s).map(|_| from_peer(l))).collect())
}

pub fn key_status(e: &Error) -> crate::proto::KeyStatus {
    crate::proto::KeyStatus { code: e.kind().code() as u32, message: e.message().to_owned() }
}

pub fn to_proto(l: &Location) -> crate::proto::Location {
    crate::proto::Location {
        region: l.region.0,
        offset: l.offset,
        length: l.length,
        generation: l.generation,
        version: l.version,
    }
}

/// A tenant's usage row of Stats.
pub fn tenant_usage(t: &super::TenantUsage) -> crate::proto::TenantUsage {
    crate::proto::TenantUsage {
        tenant: t.tenant.clone(),
        bytes: t.bytes,
        keys: t.keys,
        reserving_bytes: t.reserving_bytes,
        quota_bytes: t.quota_bytes,
        guaranteed_bytes: t.guaranteed_bytes,
    }
}

/// Admission's figures in Stats (the client API's and the peer's).
pub fn admission_to_proto(a: &super::AdmissionStats) -> crate::proto::AdmissionStats {
    crate::proto::AdmissionStats {
        mode: a.mode.as_str().into(),
        gating: a.gating,
        admitted: a.admitted,
        refused: a.refused,
        history_bytes: a.history_bytes,
        shadow_bytes: a.shadow_bytes,
    }
}

/// The figures back (a follower's Stats, from its primary's).
pub fn admission_from_proto(a: &crate::proto::AdmissionStats) -> super::AdmissionStats {
    super::AdmissionStats {
        mode: a.mode.parse().unwrap_or_default(),
        gating: a.gating,
        admitted: a.admitted,
        refused: a.refused,
        history_bytes: a.history_bytes,
        shadow_bytes: a.shadow_bytes,
    }
}

/// Per-key results and their locations, as a commit, abort or delete
/// answers them.
pub fn loc_results_to_peer(out: &[Result<Location>]) -> crate::peer_proto::LocResults {
    crate::peer_proto::LocResults {
        statuses: out.iter().map(status_of).collect(),
        locations: out.iter().map(|r| r.as_ref().map(to_peer).unwrap_or_default()).collect(),
    }
}

/// A lookup's answer: per-key unlock results, hits, and (when the lookup
/// holds its keys) each hit's tenant. Decoded by `directory::looked`.
pub fn lookup_result(
    unlocked: &[Result<()>],
    hits: &[Result<Option<Location>>],
    tenants: Vec<String>,
) -> crate::peer_proto::LookupResult {
    crate::peer_proto::LookupResult {
        tenants,
        unlock_statuses: unlocked.iter().map(status_of).collect(),
        found: hits.iter().map(|h| matches!(h, Ok(Some(_)))).collect(),
        locations: hits
            .iter()
            .map(|h| h.as_ref().ok().and_then(|x| x.as_ref()).map(to_peer).unwrap_or_default())
            .collect(),
        statuses: hits.iter().map(status_of).collect(),
    }
}

pub fn key_info_to_proto(k: super::KeyInfo) -> crate::proto::KeyInfo {
    crate::proto::KeyInfo { key: k.key.into(), tenant: k.tenant, size: k.size }
}

pub fn key_info_from_proto(k: crate::proto::KeyInfo) -> super::KeyInfo {
    super::KeyInfo { key: k.key.to_vec(), tenant: k.tenant, size: k.size }
}

pub fn removed_to_proto(e: super::Removed) -> crate::proto::RemovedKey {
    crate::proto::RemovedKey {
        key: e.key.into(),
        tenant: e.tenant,
        size: e.size,
        reason: e.reason.as_str().into(),
        seq: e.seq,
    }
}

pub fn removed_from_proto(k: crate::proto::RemovedKey) -> super::Removed {
    super::Removed {
        seq: k.seq,
        key: k.key.to_vec(),
        tenant: k.tenant,
        size: k.size,
        reason: super::Removal::parse(&k.reason),
    }
}

fn tenant_usage_from_proto(t: crate::proto::TenantUsage) -> super::TenantUsage {
    super::TenantUsage {
        tenant: t.tenant,
        bytes: t.bytes,
        keys: t.keys,
        reserving_bytes: t.reserving_bytes,
        quota_bytes: t.quota_bytes,
        guaranteed_bytes: t.guaranteed_bytes,
    }
}

pub fn stats_to_peer(s: &super::RegistryStats) -> crate::peer_proto::RegistryStats {
    crate::peer_proto::RegistryStats {
        keys: s.keys,
        reserved: s.reserved,
        bytes_stored: s.bytes_stored,
        locked_keys: s.locked_keys,
        evictions: s.evictions,
        reservations_expired: s.reservations_expired,
        tenants: s.tenants.iter().map(tenant_usage).collect(),
        locks_expired: s.locks_expired,
        eviction_visits: s.eviction_visits,
        quota_evictions: s.quota_evictions,
        admission: Some(admission_to_proto(&s.admission)),
    }
}

pub fn stats_from_peer(r: crate::peer_proto::RegistryStats) -> super::RegistryStats {
    super::RegistryStats {
        keys: r.keys,
        reserved: r.reserved,
        bytes_stored: r.bytes_stored,
        locked_keys: r.locked_keys,
        evictions: r.evictions,
        reservations_expired: r.reservations_expired,
        locks_expired: r.locks_expired,
        eviction_visits: r.eviction_visits,
        quota_evictions: r.quota_evictions,
        admission: r.admission.as_ref().map(admission_from_proto).unwrap_or_default(),
        tenants: r.tenants.into_iter().map(tenant_usage_from_proto).collect(),
    }
}
