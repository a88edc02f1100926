//! Prometheus metrics. Handles are resolved once at start (arrays indexed by
//! the label enums below: op, result, reason, state), so the request path
//! never looks a metric up by name.
use crate::metric_names as n;
use metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Counter, Gauge, Histogram, Unit,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::error::{Error, ErrorKind};
use crate::handler::Stats;

/// A label enum: the variants in the order of `ALL` (so `index` is the
/// position of a value's handle in an array built from `ALL`), each with the
/// label value it exports. Handle arrays are reached by these values only,
/// so no label list can drift out of step with the array it names.
macro_rules! label_enum {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident => $label:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $name {
            $($(#[$vdoc])* $variant),+
        }

        impl $name {
            pub const ALL: [$name; [$(stringify!($variant)),+].len()] = [$($name::$variant),+];
            pub fn label(self) -> &'static str {
                match self {
                    $($name::$variant => $label),+
                }
            }
            /// Position in `ALL`, and so in every handle array built from it.
            fn index(self) -> usize {
                self as usize
            }
        }
    };
}
pub(crate) use label_enum;

label_enum! {
    /// Outcome of a whole request.
    RequestResult {
        Ok => "ok",
        Invalid => "invalid",
        Unavailable => "unavailable",
        Error => "error",
    }
}

impl RequestResult {
    pub fn of(result: Result<(), &Error>) -> Self {
        match result {
            Ok(()) => RequestResult::Ok,
            Err(e) => match e.kind() {
                ErrorKind::InvalidArgument => RequestResult::Invalid,
                ErrorKind::Unavailable | ErrorKind::DeadlineExceeded => RequestResult::Unavailable,
                _ => RequestResult::Error,
            },
        }
    }
}

label_enum! {
    /// Outcome per key inside a batch.
    KeyResult {
        Ok => "ok",
        Hit => "hit",
        Miss => "miss",
        Exists => "exists",
        NotFound => "not_found",
        Exhausted => "exhausted",
        Precondition => "precondition",
        Denied => "denied",
        /// A store admission declined (skipped by its client; not an error).
        NotAdmitted => "not_admitted",
    }
}

impl KeyResult {
    pub fn of_error(e: &Error) -> Self {
        match e.kind() {
            ErrorKind::AlreadyExists => KeyResult::Exists,
            ErrorKind::NotFound => KeyResult::NotFound,
            ErrorKind::ResourceExhausted => KeyResult::Exhausted,
            ErrorKind::PermissionDenied => KeyResult::Denied,
            ErrorKind::NotAdmitted => KeyResult::NotAdmitted,
            _ => KeyResult::Precondition,
        }
    }
}

label_enum! {
    /// Why entries were evicted (the `reason` of `cxlkv_evictions_total`).
    EvictionReason {
        /// A reserve found no free pages on this node.
        Capacity => "capacity",
        /// A tenant's own keys, to keep it under its quota.
        Quota => "quota",
    }
}

impl EvictionReason {
    /// Evictions for this reason so far; the registry counts all evictions
    /// and, of them, the quota ones.
    fn count(self, r: &crate::registry::RegistryStats) -> u64 {
        match self {
            EvictionReason::Capacity => r.evictions - r.quota_evictions,
            EvictionReason::Quota => r.quota_evictions,
        }
    }
}

label_enum! {
    /// The `state` of `cxlkv_pages`: pages in this node's regions.
    PageState {
        Total => "total",
        Used => "used",
        Free => "free",
    }
}

impl PageState {
    fn count(self, s: &Stats) -> u64 {
        match self {
            PageState::Total => s.pages_total,
            PageState::Used => s.pages_total - s.pages_free,
            PageState::Free => s.pages_free,
        }
    }
}

label_enum! {
    /// The `state` of `cxlkv_regions`: regions of the whole pool.
    RegionState {
        Total => "total",
        /// Owned by this node.
        Owned => "owned",
        /// Unclaimed.
        Free => "free",
    }
}

impl RegionState {
    fn count(self, s: &Stats) -> u64 {
        match self {
            RegionState::Total => s.regions.len() as u64,
            RegionState::Owned => s.owned_regions.into(),
            RegionState::Free => s.regions.iter().filter(|r| r.owner.is_none()).count() as u64,
        }
    }
}

pub struct Metrics {
    /// By `Op`, then by `RequestResult`.
    requests: Vec<[Counter; RequestResult::ALL.len()]>,
    /// By `Op`, then by `KeyResult`.
    keys: Vec<[Counter; KeyResult::ALL.len()]>,
    /// By `Op`.
    latency: Vec<Histogram>,
    pub bytes_committed: Counter,
    pub bytes_loaded: Counter,
    pub inline_in: Counter,
    pub inline_out: Counter,
    pub payload_mismatch: Counter,
    /// Lookup hits whose bytes are in another node's region: resolved at
    /// the first (a single node, which has none, exports no cluster series).
    cross_node_hits: std::sync::OnceLock<Counter>,
    evictions: [Counter; EvictionReason::ALL.len()],
    /// Admitted, refused.
    admissions: [Counter; 2],
    admission_bytes: Gauge,
    eviction_visits: Counter,
    reservations_expired: Counter,
    locks_expired: Counter,
    pages: [Gauge; PageState::ALL.len()],
    regions: [Gauge; RegionState::ALL.len()],
    entries: Gauge,
    reserved: Gauge,
    locked: Gauge,
    bytes: Gauge,
    pool_bytes: Gauge,
    pool_room_short: Gauge,
    tenant_series: std::sync::Mutex<TenantSeries>,
}

/// Per-tenant series, at most `max` of them plus `_other`: the first `max`
/// tenants seen keep their own label for the life of the process (an exported
/// series cannot be taken back, so labels are never reused); a label whose
/// tenant went away reads 0; later tenants add up in `tenant="_other"`.
struct TenantSeries {
    max: usize,
    /// The labelled tenants, in the order they got their label.
    labelled: Vec<TenantGauges>,
    /// Tenant name to its position in `labelled`; consulted only when a
    /// tenant is not where `last` saw it.
    by_name: hashbrown::HashMap<String, usize>,
    /// The previous tick's tenants in order, each with its position in
    /// `labelled` (None: summed in `_other`). The registry lists tenants in
    /// slot order, which changes only when tenants come and go, so most ticks
    /// match every tenant here by position and never hash a name.
    last: Vec<(String, Option<usize>)>,
    /// Counts refreshes; a labelled tenant not seen in this one went away.
    tick: u64,
    other: Gauge,
}

struct TenantGauges {
    stored: Gauge,
    quota: Gauge,
    /// The last tick that listed this tenant.
    seen: u64,
}

/// Label of the series that sums tenants beyond the cap.
pub const OTHER_TENANTS: &str = "_other";

impl TenantSeries {
    fn refresh(&mut self, tenants: &[crate::registry::TenantUsage]) {
        self.tick += 1;
        let mut other = 0u64;
        for (i, t) in tenants.iter().enumerate() {
            let series = self.series_of(i, t);
            match series.map(|at| &mut self.labelled[at]) {
                Some(g) => {
                    g.stored.set(t.bytes as f64);
                    g.quota.set(t.quota_bytes as f64);
                    g.seen = self.tick;
                }
                None => other += t.bytes,
            }
        }
        self.last.truncate(tenants.len());
        for g in &self.labelled {
            if g.seen != self.tick {
                g.stored.set(0.0);
            }
        }
        self.other.set(other as f64);
    }

    /// Where `t`, at position `i` of this tick's list, has its series
    /// (None: `_other`), and remember it for the next tick.
    fn series_of(&mut self, i: usize, t: &crate::registry::TenantUsage) -> Option<usize> {
        match self.last.get(i) {
            Some(&(ref name, known)) if *name == t.tenant => {
                // Unlabelled at this position last tick means unlabelled
                // anywhere (labels are only given here), so no lookup.
                let at = known.or_else(|| self.label(t));
                self.last[i].1 = at;
                at
            }
            _ => {
                let at = self.by_name.get(&t.tenant).copied().or_else(|| self.label(t));
                let seen = (t.tenant.clone(), at);
                match self.last.get_mut(i) {
                    Some(last) => *last = seen,
                    None => self.last.push(seen),
                }
                at
            }
        }
    }

    /// A label of its own for `t`, while there is room. Only tenants with
    /// bytes take one: not one still writing its first key.
    fn label(&mut self, t: &crate::registry::TenantUsage) -> Option<usize> {
        if t.bytes == 0 || self.labelled.len() >= self.max {
            return None;
        }
        let [stored, quota] =
            [n::TENANT_STORED_BYTES, n::TENANT_QUOTA_BYTES].map(|name| gauge!(name, "tenant" => t.tenant.clone()));
        self.labelled.push(TenantGauges { stored, quota, seen: 0 });
        self.by_name.insert(t.tenant.clone(), self.labelled.len() - 1);
        Some(self.labelled.len() - 1)
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
    describe_gauge!(n::BUILD_INFO, "Always 1; the version label names the running build.");
    describe_counter!(n::ACCEPT_ERRORS, "Failed accepts per listener (no descriptor left: the listener pauses).");
    describe_counter!(n::CONNECTIONS_CLOSED, "Connections closed by the sidecar per listener and reason.");
    describe_counter!(n::CONNECTIONS_REFUSED, "Connections closed at once per listener: max_connections reached.");
    describe_counter!(n::EVENTS_PUBLISHED, "Events added to this node's event stream (its own or relayed).");
    describe_counter!(n::EVENT_BATCHES, "Batches of events, each a sequence number.");
    describe_counter!(n::EVENTS_DROPPED, "Events or batches subscribers will not see, by reason (overflow, lagging).");
    describe_gauge!(n::EVENTS_OLDEST_SEQ, "The oldest batch still held for replay.");
    describe_gauge!(n::EVENT_SUBSCRIBERS, "Subscribers reading this node's event stream, per transport.");
    describe_gauge!(n::CLUSTER_ROLE, "Always 1; the role label: single, primary or follower.");
    describe_gauge!(n::CLUSTER_PEERS_ALIVE, "Primary: followers heard from within dead_after_ms.");
    describe_counter!(n::CLUSTER_NODES_DECLARED_DEAD, "Primary: followers declared dead.");
    describe_gauge!(n::CLUSTER_LEASE_HELD, "Follower: 1 while the primary answers heartbeats, 0 when fenced.");
    describe_counter!(n::CLUSTER_FORWARDED_CALLS, "Follower: forwarded batches sent to the primary.");
    describe_counter!(n::CLUSTER_FORWARDED_OPS, "Follower: client registry calls inside forwarded batches.");
    describe_counter!(
        n::CLUSTER_HELD_LOOKUPS,
        "Follower: keys looked up and locked from its holds, without a forwarded call."
    );
    describe_gauge!(n::CLUSTER_HELD_KEYS, "Follower: keys the primary has locked for this node (holds).");
    describe_histogram!(n::CLUSTER_FORWARDED_SECONDS, Unit::Seconds, "Follower: round trip of a forwarded batch.");
    describe_gauge!(n::CLUSTER_EPOCH, "The election epoch of this node's current role (static: 0).");
    describe_counter!(n::CLUSTER_ELECTIONS_WON, "Elections this node won (it became the primary).");
    describe_gauge!(
        n::CLUSTER_TAKEOVER_SECONDS,
        Unit::Seconds,
        "Primary: time to rebuild the pool-wide registry when it took the role."
    );
    describe_counter!(
        n::CLUSTER_REGION_RECLAIMS,
        "Primary: phase 3 region reclaims by result (acked, owner_dead, gave_up, no_victim)."
    );
    describe_counter!(n::CLUSTER_RECLAIMED_ENTRIES, "Primary: entries removed with their reclaimed region.");
    describe_counter!(n::CLUSTER_CROSS_NODE_HITS, "Lookup hits whose bytes are in another node's region.");
    describe_counter!(n::REQUESTS, "Requests by RPC and outcome (ok, invalid, unavailable, error).");
    describe_counter!(n::KEYS, "Keys inside requests by RPC and per-key outcome.");
    describe_histogram!(n::REQUEST_DURATION_SECONDS, Unit::Seconds, "Time to serve a request inside the sidecar.");
    describe_counter!(n::COMMITTED_BYTES, Unit::Bytes, "Bytes of objects made visible by commits and inline puts.");
    describe_counter!(
        n::LOADED_BYTES,
        Unit::Bytes,
        "Bytes of objects handed out for loading (lookup hits, inline gets)."
    );
    describe_counter!(n::INLINE_BYTES, Unit::Bytes, "Bytes that crossed gRPC on the inline path, by direction.");
    describe_counter!(n::EVICTIONS, "Entries evicted, by reason.");
    describe_counter!(
        n::ADMISSIONS,
        "Stores admission judged, by decision (admitted, refused: skipped by the client)."
    );
    describe_gauge!(
        n::ADMISSION_GATING,
        "1 while admission refuses stores of keys not seen before; mode: the configured one (off, second_touch, adaptive)."
    );
    describe_gauge!(n::ADMISSION_BYTES, Unit::Bytes, "Bytes admission's history and simulations hold.");
    describe_counter!(n::RESERVATIONS_EXPIRED, "Reservations reclaimed because they were not committed in time.");
    describe_counter!(n::LOCKS_EXPIRED, "Lookup locks that reached their TTL without being released.");
    describe_gauge!(n::POOL_BYTES, Unit::Bytes, "Size of the mapped pool.");
    describe_gauge!(
        n::POOL_ROOM_SHORT_BYTES,
        Unit::Bytes,
        "Bytes of the pool file its filesystem has no room for (regions past them are never claimed); 0 when it fits."
    );
    describe_gauge!(n::REGIONS, "Regions in the pool: total, owned by this node, free.");
    describe_gauge!(n::PAGES, "Pages in this node's regions: total, used, free.");
    describe_gauge!(n::STORED_KEYS, "Committed keys.");
    describe_gauge!(n::STORED_BYTES, Unit::Bytes, "Bytes of committed keys.");
    describe_gauge!(n::RESERVATIONS, "Open reservations (keys being written).");
    describe_gauge!(n::LOCKED_KEYS, "Keys with at least one live lookup lock.");
    describe_gauge!(
        n::TENANT_STORED_BYTES,
        Unit::Bytes,
        "Bytes of committed keys per tenant (the first metrics.max_tenant_series tenants; the rest as _other)."
    );
    describe_gauge!(
        n::TENANT_QUOTA_BYTES,
        Unit::Bytes,
        "Byte quota of each tenant with a series of its own (0 = none)."
    );
    describe_counter!(
        n::PAYLOAD_MISMATCHES,
        "Inline reads refused because the bytes did not match the checksum given at commit."
    );
    describe_counter!(
        n::REBUILD_RECORDS,
        "Object records read back from the pool at start-up: restored, quarantined (being written at the crash), damaged, stale."
    );
    describe_counter!(
        n::EVICTION_VISITS,
        "Entries the victim search looked at; entries in use are held out of the search, so this equals evictions."
    );
}

impl Metrics {
    /// `max_tenant_series`: per-tenant gauges beyond this go to `_other` (0 = all in `_other`).
    /// `ops`: the `op` label of each RPC, by position (`rpc::Op`, where
    /// the client API's RPCs are served).
    pub fn new(backend: &'static str, max_tenant_series: usize, ops: &[&'static str]) -> Self {
        describe();
        let requests = ops
            .iter()
            .map(|&op| RequestResult::ALL.map(|r| counter!(n::REQUESTS, "op" => op, "result" => r.label())))
            .collect();
        let keys = ops
            .iter()
            .map(|&op| KeyResult::ALL.map(|r| counter!(n::KEYS, "op" => op, "result" => r.label())))
            .collect();
        let latency = ops.iter().map(|&op| histogram!(n::REQUEST_DURATION_SECONDS, "op" => op)).collect();
        gauge!(n::BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
        Self {
            requests,
            keys,
            latency,
            bytes_committed: counter!(n::COMMITTED_BYTES),
            bytes_loaded: counter!(n::LOADED_BYTES),
            inline_in: counter!(n::INLINE_BYTES, "direction" => "in"),
            inline_out: counter!(n::INLINE_BYTES, "direction" => "out"),
            payload_mismatch: counter!(n::PAYLOAD_MISMATCHES),
            cross_node_hits: std::sync::OnceLock::new(),
            evictions: EvictionReason::ALL.map(|r| counter!(n::EVICTIONS, "reason" => r.label())),
            admissions: ["admitted", "refused"].map(|d| counter!(n::ADMISSIONS, "decision" => d)),
            admission_bytes: gauge!(n::ADMISSION_BYTES),
            eviction_visits: counter!(n::EVICTION_VISITS),
            reservations_expired: counter!(n::RESERVATIONS_EXPIRED),
            locks_expired: counter!(n::LOCKS_EXPIRED),
            pages: PageState::ALL.map(|s| gauge!(n::PAGES, "state" => s.label(), "backend" => backend)),
            regions: RegionState::ALL.map(|s| gauge!(n::REGIONS, "state" => s.label(), "backend" => backend)),
            entries: gauge!(n::STORED_KEYS),
            reserved: gauge!(n::RESERVATIONS),
            locked: gauge!(n::LOCKED_KEYS),
            bytes: gauge!(n::STORED_BYTES),
            pool_bytes: gauge!(n::POOL_BYTES, "backend" => backend),
            pool_room_short: gauge!(n::POOL_ROOM_SHORT_BYTES),
            tenant_series: std::sync::Mutex::new(TenantSeries {
                max: max_tenant_series,
                labelled: Vec::new(),
                by_name: hashbrown::HashMap::new(),
                last: Vec::new(),
                tick: 0,
                other: gauge!(n::TENANT_STORED_BYTES, "tenant" => OTHER_TENANTS),
            }),
        }
    }

    /// `op`: the RPC's position among the labels given to `new`.
    pub fn request(&self, op: impl Into<usize>, result: Result<(), &Error>, seconds: f64) {
        let op = op.into();
        self.requests[op][RequestResult::of(result).index()].increment(1);
        self.latency[op].record(seconds);
    }

    /// `hits` lookup hits whose bytes are in another node's region.
    pub fn cross_node_hits(&self, hits: u64) {
        self.cross_node_hits.get_or_init(|| counter!(n::CLUSTER_CROSS_NODE_HITS)).increment(hits);
    }

    pub fn key(&self, op: impl Into<usize>, r: KeyResult, n: u64) {
        if n > 0 {
            self.keys[op.into()][r.index()].increment(n);
        }
    }

    /// What the start-up rebuild found, once.
    pub fn rebuilt(&self, r: &crate::rebuild::RebuildReport) {
        for (what, n) in
            [("restored", r.restored), ("quarantined", r.quarantined), ("damaged", r.damaged), ("stale", r.stale)]
        {
            counter!(n::REBUILD_RECORDS, "result" => what).absolute(n);
        }
    }

    /// Refresh gauges and registry-owned counters from a stats snapshot.
    pub fn refresh(&self, s: &Stats) {
        self.pool_bytes.set(s.pool_bytes as f64);
        self.pool_room_short.set(s.pool_room_short_bytes as f64);
        for state in PageState::ALL {
            self.pages[state.index()].set(state.count(s) as f64);
        }
        for state in RegionState::ALL {
            self.regions[state.index()].set(state.count(s) as f64);
        }
        self.entries.set(s.registry.keys as f64);
        self.reserved.set(s.registry.reserved as f64);
        self.locked.set(s.registry.locked_keys as f64);
        self.bytes.set(s.registry.bytes_stored as f64);
        for reason in EvictionReason::ALL {
            self.evictions[reason.index()].absolute(reason.count(&s.registry));
        }
        let a = &s.registry.admission;
        self.admissions[0].absolute(a.admitted);
        self.admissions[1].absolute(a.refused);
        self.admission_bytes.set((a.history_bytes + a.shadow_bytes) as f64);
        // Labelled with the mode the registry (the primary's, in a cluster) runs.
        gauge!(n::ADMISSION_GATING, "mode" => a.mode.as_str()).set(if a.gating { 1.0 } else { 0.0 });
        self.reservations_expired.absolute(s.registry.reservations_expired);
        self.locks_expired.absolute(s.registry.locks_expired);
        self.eviction_visits.absolute(s.registry.eviction_visits);
        self.tenant_series.lock().unwrap_or_else(|p| p.into_inner()).refresh(&s.registry.tenants);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::TenantUsage;

    fn usage(tenant: &str, bytes: u64) -> TenantUsage {
        TenantUsage { tenant: tenant.into(), bytes, ..Default::default() }
    }

    fn series(max: usize) -> TenantSeries {
        TenantSeries {
            max,
            labelled: vec![],
            by_name: Default::default(),
            last: vec![],
            tick: 0,
            other: gauge!(n::TENANT_STORED_BYTES, "tenant" => OTHER_TENANTS),
        }
    }

    /// Which labelled series each tenant of the list lands in.
    fn resolve(s: &mut TenantSeries, tenants: &[TenantUsage]) -> Vec<Option<usize>> {
        s.refresh(tenants);
        tenants.iter().map(|t| s.by_name.get(&t.tenant).copied()).collect()
    }

    #[test]
    fn tenant_labels_are_kept_wherever_the_tenant_is_listed() {
        let mut s = series(2);
        // An empty tenant takes no label; the first two with bytes do.
        assert_eq!(resolve(&mut s, &[usage("a", 0), usage("b", 5)]), vec![None, Some(0)]);
        assert_eq!(resolve(&mut s, &[usage("a", 7), usage("b", 5), usage("c", 1)]), vec![Some(1), Some(0), None]);
        // Reordered and with one gone: labels follow the names, the gone one
        // is not seen this tick (its gauge reads 0).
        assert_eq!(resolve(&mut s, &[usage("c", 1), usage("a", 7)]), vec![None, Some(1)]);
        assert_eq!((s.labelled[0].seen, s.labelled[1].seen), (2, 3));
        assert_eq!(s.last, vec![("c".to_string(), None), ("a".to_string(), Some(1))]);
    }

    #[test]
    fn label_values_and_positions_agree() {
        assert_eq!(RequestResult::ALL.map(RequestResult::label), ["ok", "invalid", "unavailable", "error"]);
        assert_eq!(EvictionReason::ALL.map(EvictionReason::label), ["capacity", "quota"]);
        for (i, r) in KeyResult::ALL.into_iter().enumerate() {
            assert_eq!(r.index(), i);
        }
    }
}
