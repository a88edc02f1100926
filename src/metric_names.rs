//! Every metric the sidecar exports, by name, in one place: what each
//! counts is in docs/METRICS.md (the tests compare what `/metrics` exports
//! with it). A leaf every layer may use.

/// Accepts that failed.
pub const ACCEPT_ERRORS: &str = "cxlkv_accept_errors_total";
/// Stores admission judged, by decision (admitted, refused).
pub const ADMISSIONS: &str = "cxlkv_admissions_total";
/// 1 while admission refuses keys it has not seen before; the mode label is the configured one.
pub const ADMISSION_GATING: &str = "cxlkv_admission_gating";
/// Bytes admission's history and simulations hold.
pub const ADMISSION_BYTES: &str = "cxlkv_admission_bytes";
/// Requests and connections refused for their credentials.
pub const AUTH_REFUSALS: &str = "cxlkv_auth_refusals_total";
/// Always 1; the version label names the running build.
pub const BUILD_INFO: &str = "cxlkv_build_info";
/// Lookup hits whose bytes are in another node's region.
pub const CLUSTER_CROSS_NODE_HITS: &str = "cxlkv_cluster_cross_node_hits_total";
/// Elections this node won.
pub const CLUSTER_ELECTIONS_WON: &str = "cxlkv_cluster_elections_won_total";
/// The election epoch of this node's current role.
pub const CLUSTER_EPOCH: &str = "cxlkv_cluster_epoch";
/// Peer calls the primary refused for their epoch.
pub const CLUSTER_EPOCH_REFUSALS: &str = "cxlkv_cluster_epoch_refusals_total";
/// Follower: forwarded batches sent to the primary.
pub const CLUSTER_FORWARDED_CALLS: &str = "cxlkv_cluster_forwarded_calls_total";
/// Follower: client registry calls inside forwarded batches.
pub const CLUSTER_FORWARDED_OPS: &str = "cxlkv_cluster_forwarded_ops_total";
/// Follower: round trip of a forwarded batch.
pub const CLUSTER_FORWARDED_SECONDS: &str = "cxlkv_cluster_forwarded_seconds";
/// Follower: keys the primary has locked for this node (holds).
pub const CLUSTER_HELD_KEYS: &str = "cxlkv_cluster_held_keys";
/// Follower: keys looked up and locked from its holds, without a forwarded call.
pub const CLUSTER_HELD_LOOKUPS: &str = "cxlkv_cluster_held_lookups_total";
/// Follower: 1 while the primary answers heartbeats, 0 when fenced.
pub const CLUSTER_LEASE_HELD: &str = "cxlkv_cluster_lease_held";
/// Primary: followers declared dead.
pub const CLUSTER_NODES_DECLARED_DEAD: &str = "cxlkv_cluster_nodes_declared_dead_total";
/// Primary: forwarded ops refused, unapplied, for reaching it after their follower stopped waiting.
pub const CLUSTER_STALE_OPS: &str = "cxlkv_cluster_stale_ops_total";
/// Primary: followers heard from within dead_after_ms.
pub const CLUSTER_PEERS_ALIVE: &str = "cxlkv_cluster_peers_alive";
/// Primary: entries removed with their reclaimed region.
pub const CLUSTER_RECLAIMED_ENTRIES: &str = "cxlkv_cluster_reclaimed_entries_total";
/// Primary: regions taken back from another node (phase 3), by result.
pub const CLUSTER_REGION_RECLAIMS: &str = "cxlkv_cluster_region_reclaims_total";
/// Primary: region-table entries that named no node, freed.
pub const CLUSTER_REGION_REPAIRS: &str = "cxlkv_cluster_region_repairs_total";
/// Always 1; the role label: single, primary or follower.
pub const CLUSTER_ROLE: &str = "cxlkv_cluster_role";
/// Primary: time to rebuild the pool-wide registry when it took the role.
pub const CLUSTER_TAKEOVER_SECONDS: &str = "cxlkv_cluster_takeover_seconds";
/// Bytes of objects made visible by commits and inline puts.
pub const COMMITTED_BYTES: &str = "cxlkv_committed_bytes_total";
/// Connections the sidecar closed.
pub const CONNECTIONS_CLOSED: &str = "cxlkv_connections_closed_total";
/// Connections accepted and closed at once: the listener had max_connections.
pub const CONNECTIONS_REFUSED: &str = "cxlkv_connections_refused_total";
/// Entries the victim search looked at.
pub const EVICTION_VISITS: &str = "cxlkv_eviction_visits_total";
/// Entries evicted.
pub const EVICTIONS: &str = "cxlkv_evictions_total";
/// Bytes that crossed gRPC on the inline path.
pub const INLINE_BYTES: &str = "cxlkv_inline_bytes_total";
/// Keys inside requests by outcome.
pub const KEYS: &str = "cxlkv_keys_total";
/// Bytes of objects handed out for loading.
pub const LOADED_BYTES: &str = "cxlkv_loaded_bytes_total";
/// Keys with at least one live lookup lock.
pub const LOCKED_KEYS: &str = "cxlkv_locked_keys";
/// Lookup locks that reached their TTL without being released.
pub const LOCKS_EXPIRED: &str = "cxlkv_locks_expired_total";
/// Pages in this node's regions.
pub const PAGES: &str = "cxlkv_pages";
/// Inline reads refused because the bytes did not match the checksum given at commit.
pub const PAYLOAD_MISMATCHES: &str = "cxlkv_payload_mismatches_total";
/// Size of the mapped pool.
pub const POOL_BYTES: &str = "cxlkv_pool_bytes";
/// Bytes of the pool file its filesystem has no room for.
pub const POOL_ROOM_SHORT_BYTES: &str = "cxlkv_pool_room_short_bytes";
/// Object records read back from the pool at start-up.
pub const REBUILD_RECORDS: &str = "cxlkv_rebuild_records_total";
/// Regions in the pool.
pub const REGIONS: &str = "cxlkv_regions";
/// Time to serve a request inside the sidecar.
pub const REQUEST_DURATION_SECONDS: &str = "cxlkv_request_duration_seconds";
/// Requests by RPC and outcome.
pub const REQUESTS: &str = "cxlkv_requests_total";
/// Open reservations.
pub const RESERVATIONS: &str = "cxlkv_reservations";
/// Reservations reclaimed because they were not committed in time.
pub const RESERVATIONS_EXPIRED: &str = "cxlkv_reservations_expired_total";
/// Bytes of committed keys.
pub const STORED_BYTES: &str = "cxlkv_stored_bytes";
/// Committed keys.
pub const STORED_KEYS: &str = "cxlkv_stored_keys";
/// The `[quotas]` byte quota of each tenant that has a series of its own.
pub const TENANT_QUOTA_BYTES: &str = "cxlkv_tenant_quota_bytes";
/// Bytes of committed keys per tenant.
pub const TENANT_STORED_BYTES: &str = "cxlkv_tenant_stored_bytes";
/// Events the pool's event source put into batches.
pub const EVENTS_PUBLISHED: &str = "cxlkv_events_published_total";
/// Event batches made.
pub const EVENT_BATCHES: &str = "cxlkv_event_batches_total";
/// Events lost to subscribers: the source's buffer overflowed, or a subscriber fell behind the ring.
pub const EVENTS_DROPPED: &str = "cxlkv_events_dropped_total";
/// The oldest event batch still held for replay.
pub const EVENTS_OLDEST_SEQ: &str = "cxlkv_events_oldest_seq";
/// Subscribers of the event stream, by transport.
pub const EVENT_SUBSCRIBERS: &str = "cxlkv_event_subscribers";
