//! Prometheus metrics. Handles are resolved once at start (arrays indexed by
//! op and result), so the request path never looks a metric up by name.
use metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Counter, Gauge, Histogram, Unit,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::error::{Error, ErrorKind};
use crate::handler::Stats;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    PoolInfo,
    Reserve,
    Commit,
    Abort,
    Lookup,
    Unlock,
    Delete,
    Exists,
    ListKeys,
    Stats,
    InlinePut,
    InlineGet,
    Removed,
}

impl Op {
    pub const ALL: [Op; 13] = [
        Op::PoolInfo,
        Op::Reserve,
        Op::Commit,
        Op::Abort,
        Op::Lookup,
        Op::Unlock,
        Op::Delete,
        Op::Exists,
        Op::ListKeys,
        Op::Stats,
        Op::InlinePut,
        Op::InlineGet,
        Op::Removed,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Op::PoolInfo => "pool_info",
            Op::Reserve => "reserve",
            Op::Commit => "commit",
            Op::Abort => "abort",
            Op::Lookup => "lookup_and_lock",
            Op::Unlock => "unlock",
            Op::Delete => "delete",
            Op::Exists => "exists",
            Op::ListKeys => "list_keys",
            Op::Stats => "stats",
            Op::InlinePut => "inline_put",
            Op::InlineGet => "inline_get",
            Op::Removed => "removed",
        }
    }
}

/// Outcome of a whole request.
pub const REQUEST_RESULTS: [&str; 4] = ["ok", "invalid", "unavailable", "error"];
/// Outcome per key inside a batch.
pub const KEY_RESULTS: [&str; 8] = ["ok", "hit", "miss", "exists", "not_found", "exhausted", "precondition", "denied"];

#[derive(Debug, Clone, Copy)]
pub enum KeyResult {
    Ok = 0,
    Hit = 1,
    Miss = 2,
    Exists = 3,
    NotFound = 4,
    Exhausted = 5,
    Precondition = 6,
    Denied = 7,
}

impl KeyResult {
    pub fn of_error(e: &Error) -> Self {
        match e.kind() {
            ErrorKind::AlreadyExists => KeyResult::Exists,
            ErrorKind::NotFound => KeyResult::NotFound,
            ErrorKind::ResourceExhausted => KeyResult::Exhausted,
            ErrorKind::PermissionDenied => KeyResult::Denied,
            _ => KeyResult::Precondition,
        }
    }
}

pub struct Metrics {
    requests: Vec<[Counter; 4]>,
    keys: Vec<[Counter; 8]>,
    latency: Vec<Histogram>,
    pub bytes_committed: Counter,
    pub bytes_loaded: Counter,
    pub inline_in: Counter,
    pub inline_out: Counter,
    pub payload_mismatch: Counter,
    /// By reason: capacity (space on a node), quota (a tenant at its quota).
    evictions: [Counter; 2],
    eviction_visits: Counter,
    reservations_expired: Counter,
    locks_expired: Counter,
    pages: [Gauge; 3],
    regions: [Gauge; 3],
    entries: Gauge,
    reserved: Gauge,
    locked: Gauge,
    bytes: Gauge,
    pool_bytes: Gauge,
    tenant_series: std::sync::Mutex<TenantSeries>,
}

/// Per-tenant series, at most `max` of them plus `_other`: the first `max`
/// tenants seen keep their own label for the life of the process (an exported
/// series cannot be taken back, so labels are never reused); a label whose
/// tenant went away reads 0; later tenants add up in `tenant="_other"`.
struct TenantSeries {
    max: usize,
    /// Per labelled tenant: stored bytes and quota bytes.
    gauges: hashbrown::HashMap<String, [Gauge; 2]>,
    other: Gauge,
}

/// Label of the series that sums tenants beyond the cap.
pub const OTHER_TENANTS: &str = "_other";

impl TenantSeries {
    fn refresh(&mut self, tenants: &[crate::registry::TenantUsage]) {
        let live: hashbrown::HashSet<&str> = tenants.iter().map(|t| t.tenant.as_str()).collect();
        for (k, g) in &self.gauges {
            if !live.contains(k.as_str()) {
                g[0].set(0.0);
            }
        }
        let mut other = 0u64;
        for t in tenants {
            // Only tenants with bytes take a label: not one still writing its first key.
            if t.bytes > 0 && !self.gauges.contains_key(&t.tenant) && self.gauges.len() < self.max {
                let g = ["cxlkv_tenant_stored_bytes", "cxlkv_tenant_quota_bytes"]
                    .map(|name| gauge!(name, "tenant" => t.tenant.clone()));
                self.gauges.insert(t.tenant.clone(), g);
            }
            match self.gauges.get(&t.tenant) {
                Some(g) => {
                    g[0].set(t.bytes as f64);
                    g[1].set(t.quota_bytes as f64);
                }
                None => other += t.bytes,
            }
        }
        self.other.set(other as f64);
    }
}

/// Install the global Prometheus recorder; call before `Metrics::new`.
pub fn install_recorder() -> Result<PrometheusHandle, Error> {
    let buckets: Vec<f64> = (0..20).map(|i| 10e-6 * 2f64.powi(i)).collect();
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &buckets)
        .and_then(|b| b.install_recorder())
        .map_err(|e| Error::new(ErrorKind::Internal, format!("install metrics recorder: {e}")))
}

fn describe() {
    describe_gauge!("cxlkv_build_info", "Always 1; the version label names the running build.");
    describe_gauge!("cxlkv_cluster_role", "Always 1; the role label: single, primary or follower.");
    describe_gauge!("cxlkv_cluster_peers_alive", "Primary: followers heard from within dead_after_ms.");
    describe_counter!("cxlkv_cluster_nodes_declared_dead_total", "Primary: followers declared dead.");
    describe_gauge!("cxlkv_cluster_lease_held", "Follower: 1 while the primary answers heartbeats, 0 when fenced.");
    describe_counter!("cxlkv_cluster_forwarded_calls_total", "Follower: forwarded batches sent to the primary.");
    describe_counter!("cxlkv_cluster_forwarded_ops_total", "Follower: client registry calls inside forwarded batches.");
    describe_histogram!("cxlkv_cluster_forwarded_seconds", Unit::Seconds, "Follower: round trip of a forwarded batch.");
    describe_gauge!("cxlkv_cluster_epoch", "The election epoch of this node's current role (static: 0).");
    describe_counter!("cxlkv_cluster_elections_won_total", "Elections this node won (it became the primary).");
    describe_gauge!(
        "cxlkv_cluster_takeover_seconds",
        Unit::Seconds,
        "Primary: time to rebuild the pool-wide registry when it took the role."
    );
    describe_counter!(
        "cxlkv_cluster_region_reclaims_total",
        "Primary: phase 3 region reclaims by result (acked, owner_dead, gave_up, no_victim)."
    );
    describe_counter!("cxlkv_cluster_reclaimed_entries_total", "Primary: entries removed with their reclaimed region.");
    describe_counter!("cxlkv_cluster_cross_node_hits_total", "Lookup hits whose bytes are in another node's region.");
    describe_counter!("cxlkv_requests_total", "Requests by RPC and outcome (ok, invalid, unavailable, error).");
    describe_counter!("cxlkv_keys_total", "Keys inside requests by RPC and per-key outcome.");
    describe_histogram!("cxlkv_request_duration_seconds", Unit::Seconds, "Time to serve a request inside the sidecar.");
    describe_counter!(
        "cxlkv_committed_bytes_total",
        Unit::Bytes,
        "Bytes of objects made visible by commits and inline puts."
    );
    describe_counter!(
        "cxlkv_loaded_bytes_total",
        Unit::Bytes,
        "Bytes of objects handed out for loading (lookup hits, inline gets)."
    );
    describe_counter!(
        "cxlkv_inline_bytes_total",
        Unit::Bytes,
        "Bytes that crossed gRPC on the inline path, by direction."
    );
    describe_counter!("cxlkv_evictions_total", "Entries evicted, by reason.");
    describe_counter!(
        "cxlkv_reservations_expired_total",
        "Reservations reclaimed because they were not committed in time."
    );
    describe_counter!("cxlkv_locks_expired_total", "Lookup locks that reached their TTL without being released.");
    describe_gauge!("cxlkv_pool_bytes", Unit::Bytes, "Size of the mapped pool.");
    describe_gauge!("cxlkv_regions", "Regions in the pool: total, owned by this node, free.");
    describe_gauge!("cxlkv_pages", "Pages in this node's regions: total, used, free.");
    describe_gauge!("cxlkv_stored_keys", "Committed keys.");
    describe_gauge!("cxlkv_stored_bytes", Unit::Bytes, "Bytes of committed keys.");
    describe_gauge!("cxlkv_reservations", "Open reservations (keys being written).");
    describe_gauge!("cxlkv_locked_keys", "Keys with at least one live lookup lock.");
    describe_gauge!(
        "cxlkv_tenant_stored_bytes",
        Unit::Bytes,
        "Bytes of committed keys per tenant (the first metrics.max_tenant_series tenants; the rest as _other)."
    );
    describe_gauge!(
        "cxlkv_tenant_quota_bytes",
        Unit::Bytes,
        "Byte quota of each tenant with a series of its own (0 = none)."
    );
    describe_counter!(
        "cxlkv_payload_mismatches_total",
        "Inline reads refused because the bytes did not match the checksum given at commit."
    );
    describe_counter!(
        "cxlkv_rebuild_records_total",
        "Object records read back from the pool at start-up: restored, quarantined (being written at the crash), damaged, stale."
    );
    describe_counter!(
        "cxlkv_eviction_visits_total",
        "Entries the victim search looked at; entries in use are held out of the search, so this equals evictions."
    );
}

impl Metrics {
    /// `max_tenant_series`: per-tenant gauges beyond this go to `_other` (0 = all in `_other`).
    pub fn new(backend: &'static str, max_tenant_series: usize) -> Self {
        describe();
        let requests = Op::ALL
            .iter()
            .map(|op| REQUEST_RESULTS.map(|r| counter!("cxlkv_requests_total", "op" => op.name(), "result" => r)))
            .collect();
        let keys = Op::ALL
            .iter()
            .map(|op| KEY_RESULTS.map(|r| counter!("cxlkv_keys_total", "op" => op.name(), "result" => r)))
            .collect();
        let latency =
            Op::ALL.iter().map(|op| histogram!("cxlkv_request_duration_seconds", "op" => op.name())).collect();
        gauge!("cxlkv_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
        Self {
            requests,
            keys,
            latency,
            bytes_committed: counter!("cxlkv_committed_bytes_total"),
            bytes_loaded: counter!("cxlkv_loaded_bytes_total"),
            inline_in: counter!("cxlkv_inline_bytes_total", "direction" => "in"),
            inline_out: counter!("cxlkv_inline_bytes_total", "direction" => "out"),
            payload_mismatch: counter!("cxlkv_payload_mismatches_total"),
            evictions: ["capacity", "quota"].map(|r| counter!("cxlkv_evictions_total", "reason" => r)),
            eviction_visits: counter!("cxlkv_eviction_visits_total"),
            reservations_expired: counter!("cxlkv_reservations_expired_total"),
            locks_expired: counter!("cxlkv_locks_expired_total"),
            pages: ["total", "used", "free"].map(|s| gauge!("cxlkv_pages", "state" => s, "backend" => backend)),
            regions: ["total", "owned", "free"].map(|s| gauge!("cxlkv_regions", "state" => s, "backend" => backend)),
            entries: gauge!("cxlkv_stored_keys"),
            reserved: gauge!("cxlkv_reservations"),
            locked: gauge!("cxlkv_locked_keys"),
            bytes: gauge!("cxlkv_stored_bytes"),
            pool_bytes: gauge!("cxlkv_pool_bytes", "backend" => backend),
            tenant_series: std::sync::Mutex::new(TenantSeries {
                max: max_tenant_series,
                gauges: hashbrown::HashMap::new(),
                other: gauge!("cxlkv_tenant_stored_bytes", "tenant" => OTHER_TENANTS),
            }),
        }
    }

    pub fn request(&self, op: Op, result: Result<(), &Error>, seconds: f64) {
        let r = match result {
            Ok(()) => 0,
            Err(e) => match e.kind() {
                ErrorKind::InvalidArgument => 1,
                ErrorKind::Unavailable | ErrorKind::DeadlineExceeded => 2,
                _ => 3,
            },
        };
        self.requests[op as usize][r].increment(1);
        self.latency[op as usize].record(seconds);
    }

    pub fn key(&self, op: Op, r: KeyResult, n: u64) {
        if n > 0 {
            self.keys[op as usize][r as usize].increment(n);
        }
    }

    /// What the start-up rebuild found, once.
    pub fn rebuilt(&self, r: &crate::rebuild::RebuildReport) {
        for (what, n) in
            [("restored", r.restored), ("quarantined", r.quarantined), ("damaged", r.damaged), ("stale", r.stale)]
        {
            counter!("cxlkv_rebuild_records_total", "result" => what).absolute(n);
        }
    }

    /// Refresh gauges and registry-owned counters from a stats snapshot.
    pub fn refresh(&self, s: &Stats) {
        self.pool_bytes.set(s.pool_bytes as f64);
        self.pages[0].set(s.pages_total as f64);
        self.pages[1].set((s.pages_total - s.pages_free) as f64);
        self.pages[2].set(s.pages_free as f64);
        let free = s.regions.iter().filter(|r| r.owner.is_none()).count();
        self.regions[0].set(s.regions.len() as f64);
        self.regions[1].set(s.owned_regions as f64);
        self.regions[2].set(free as f64);
        self.entries.set(s.registry.keys as f64);
        self.reserved.set(s.registry.reserved as f64);
        self.locked.set(s.registry.locked_keys as f64);
        self.bytes.set(s.registry.bytes_stored as f64);
        self.evictions[0].absolute(s.registry.evictions - s.registry.quota_evictions);
        self.evictions[1].absolute(s.registry.quota_evictions);
        self.reservations_expired.absolute(s.registry.reservations_expired);
        self.locks_expired.absolute(s.registry.locks_expired);
        self.eviction_visits.absolute(s.registry.eviction_visits);
        self.tenant_series.lock().unwrap_or_else(|p| p.into_inner()).refresh(&s.registry.tenants);
    }
}
