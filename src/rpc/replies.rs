//! The replies built from the node's state rather than from a registry
//! call's outcome: PoolInfo (the pool's geometry and this node's limits)
//! and Stats (pages, regions and the registry's figures; the event source).
use super::tenant_usage;
use crate::error::Result;
use crate::handler::Handler;
use crate::proto;
use crate::registry::Scope;

pub fn pool_info(h: &Handler) -> proto::PoolInfoReply {
    let p = h.pool();
    let sb = p.superblock();
    proto::PoolInfoReply {
        backend: p.backend().kind().as_str().into(),
        path: p.backend().path().display().to_string(),
        pool_size: sb.pool_size,
        layout_version: sb.layout_version,
        pool_uuid: sb.uuid_string(),
        region_size: sb.region_size,
        region_count: sb.region_count,
        data_offset: sb.data_offset,
        page_size: sb.page_size,
        map_alignment: p.backend().map_alignment(),
        node_id: h.node().0,
        max_object_size: h.max_object_size(),
        max_key_bytes: h.limits().max_key_bytes as u32,
        max_batch: h.limits().max_batch as u32,
        capacity_bytes: h.capacity_bytes(),
        instance_id: h.instance_id(),
        page_table_offset: p.geometry().page_table_offset,
        page_slot_bytes: crate::pool::layout::PAGE_SLOT_BYTES as u32,
        reservation_timeout_ms: h.limits().reservation_timeout_ms,
        require_checksum: h.limits().require_checksum,
        coherence: p.coherence().as_str().into(),
        region_table_offset: crate::pool::layout::SUPERBLOCK_BYTES,
        region_entry_bytes: crate::pool::layout::REGION_ENTRY_BYTES as u32,
        max_client_pinned_bytes: h.limits().max_client_pinned_bytes,
        max_lock_ttl_ms: h.limits().max_lock_ttl_ms,
        commit_as_name_bytes: h.commit_as_name_bytes(),
        packed_reserve: true,
    }
}

pub async fn stats_reply(h: &Handler, scope: &Scope) -> Result<proto::StatsReply> {
    let s = h.stats().await?;
    let r = &s.registry;
    Ok(proto::StatsReply {
        keys: r.keys,
        reserved: r.reserved,
        bytes_stored: r.bytes_stored,
        locked_keys: r.locked_keys,
        pages_total: s.pages_total,
        pages_used: s.pages_total - s.pages_free,
        pages_free: s.pages_free,
        evictions: r.evictions,
        owned_regions: s.owned_regions,
        max_regions: h.limits().max_regions,
        tenants: r.tenants.iter().filter(|t| t.keys > 0 && scope.allows(&t.tenant)).map(tenant_usage).collect(),
        regions: s
            .regions
            .iter()
            .map(|v| proto::RegionInfo {
                region: v.region.0,
                state: if v.owner.is_some() { "owned" } else { "free" }.into(),
                owner_node: v.owner.map_or(0, |n| n.0),
                generation: v.generation,
                pages_total: v.pages_total,
                pages_free: v.pages_free,
            })
            .collect(),
        eviction_policy: h.policy_name(),
        reservations_expired: r.reservations_expired,
        quota_evictions: r.quota_evictions,
        admission: Some(crate::registry::convert::admission_to_proto(&r.admission)),
        cluster_role: String::new(),
        cluster_nodes: vec![],
        election: String::new(),
        epoch: 0,
        events: None,
    })
}

pub(super) fn event_source(f: &crate::events::Feed) -> proto::EventSource {
    let (zmq_publish, zmq_replay) = f.zmq.as_ref().map(|z| (z.publish.clone(), z.replay.clone())).unwrap_or_default();
    proto::EventSource {
        kind: if f.relay { "relay" } else { "source" }.into(),
        epoch: f.log.epoch(),
        next_seq: f.log.next_seq(),
        oldest_seq: f.log.oldest_seq(),
        subscribers: f.log.subscribers() as u64,
        zmq_publish,
        zmq_replay,
    }
}
