//! `cxlkv status`: ask a running sidecar for its pool and registry state and
//! print it as a table, or as JSON for scripts; `cxlkv events`: print its
//! event stream as it comes, a line per event.
use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

use serde::Serialize;

use crate::auth::ClientAuth;
use crate::error::{Error, ErrorKind, Result};
use crate::proto;

#[derive(Serialize)]
pub struct Status {
    pub node_id: u32,
    pub backend: String,
    /// "hardware" or "software" (see PoolInfoReply.coherence).
    pub coherence: String,
    pub path: String,
    pub pool_uuid: String,
    pub pool_size: u64,
    pub region_size: u64,
    pub page_size: u64,
    pub regions_total: u32,
    pub regions_free: u32,
    /// owner node id → region count
    pub regions_by_owner: BTreeMap<u32, u32>,
    pub regions: Vec<Region>,
    pub pages_total: u64,
    pub pages_used: u64,
    pub pages_free: u64,
    pub keys: u64,
    pub reserved: u64,
    pub locked_keys: u64,
    pub bytes_stored: u64,
    pub evictions: u64,
    /// Of `evictions`: a tenant's own keys evicted to keep it under its quota.
    pub quota_evictions: u64,
    pub reservations_expired: u64,
    pub eviction_policy: String,
    pub tenants: Vec<Tenant>,
    /// "single", "primary" or "follower".
    pub cluster_role: String,
    pub cluster_nodes: Vec<ClusterNode>,
    /// In a cluster: "static" or "etcd", and the election's epoch.
    pub election: String,
    pub epoch: u64,
    /// Its event stream (none: `[events]` off).
    pub events: Option<EventSource>,
    /// What admission decided (pool-wide: the primary's registry).
    pub admission: Option<Admission>,
}

#[derive(Serialize)]
pub struct Admission {
    /// The configured mode: off, second_touch or adaptive.
    pub mode: String,
    /// Stores of keys not seen before are refused now.
    pub gating: bool,
    pub admitted: u64,
    pub refused: u64,
    pub history_bytes: u64,
    pub shadow_bytes: u64,
}

#[derive(Serialize)]
pub struct EventSource {
    /// "source" or "relay" (a follower's copy of its primary's).
    pub kind: String,
    pub epoch: u64,
    pub next_seq: u64,
    pub oldest_seq: u64,
    pub subscribers: u64,
    pub zmq_publish: String,
    pub zmq_replay: String,
}

/// A node of the cluster as the primary sees it (the client API's message:
/// one definition, printed as it comes).
pub use proto::ClusterNode;

#[derive(Serialize)]
pub struct Region {
    pub region: u32,
    pub state: String,
    pub owner_node: Option<u32>,
    pub generation: u64,
    pub pages_total: u64,
    pub pages_free: u64,
}

#[derive(Serialize)]
pub struct Tenant {
    pub tenant: String,
    pub keys: u64,
    pub bytes: u64,
    pub reserving_bytes: u64,
    /// 0 = none.
    pub quota_bytes: u64,
    pub guaranteed_bytes: u64,
}

/// Ask the sidecar behind `socket` (or `tcp`, host:port), presenting `auth`.
pub async fn fetch(socket: &str, tcp: Option<&str>, auth: &ClientAuth) -> Result<Status> {
    let mut c = match tcp {
        Some(addr) => auth.connect_tcp(addr).await?,
        None => auth.connect_uds(Path::new(socket)).await?,
    };
    let failed = |e: tonic::Status| {
        let kind = if e.code() == tonic::Code::Unavailable { ErrorKind::Unavailable } else { ErrorKind::Internal };
        Error::new(kind, format!("cxlkv answered {:?}: {}", e.code(), e.message()))
    };
    let info = c.pool_info(proto::PoolInfoRequest {}).await.map_err(failed)?.into_inner();
    let s = c.stats(proto::StatsRequest {}).await.map_err(failed)?.into_inner();
    let mut by_owner = BTreeMap::new();
    for r in s.regions.iter().filter(|r| r.state == "owned") {
        *by_owner.entry(r.owner_node).or_insert(0) += 1;
    }
    Ok(Status {
        node_id: info.node_id,
        backend: info.backend,
        coherence: info.coherence,
        path: info.path,
        pool_uuid: info.pool_uuid,
        pool_size: info.pool_size,
        region_size: info.region_size,
        page_size: info.page_size,
        regions_total: info.region_count,
        regions_free: s.regions.iter().filter(|r| r.state == "free").count() as u32,
        regions_by_owner: by_owner,
        regions: s
            .regions
            .iter()
            .map(|r| Region {
                region: r.region,
                state: r.state.clone(),
                owner_node: (r.state == "owned").then_some(r.owner_node),
                generation: r.generation,
                pages_total: r.pages_total,
                pages_free: r.pages_free,
            })
            .collect(),
        pages_total: s.pages_total,
        pages_used: s.pages_used,
        pages_free: s.pages_free,
        keys: s.keys,
        reserved: s.reserved,
        locked_keys: s.locked_keys,
        bytes_stored: s.bytes_stored,
        evictions: s.evictions,
        reservations_expired: s.reservations_expired,
        eviction_policy: s.eviction_policy,
        tenants: s
            .tenants
            .into_iter()
            .map(|t| Tenant {
                tenant: t.tenant,
                keys: t.keys,
                bytes: t.bytes,
                reserving_bytes: t.reserving_bytes,
                quota_bytes: t.quota_bytes,
                guaranteed_bytes: t.guaranteed_bytes,
            })
            .collect(),
        quota_evictions: s.quota_evictions,
        cluster_role: s.cluster_role,
        election: s.election,
        epoch: s.epoch,
        admission: s.admission.map(|a| Admission {
            mode: a.mode,
            gating: a.gating,
            admitted: a.admitted,
            refused: a.refused,
            history_bytes: a.history_bytes,
            shadow_bytes: a.shadow_bytes,
        }),
        events: s.events.map(|e| EventSource {
            kind: e.kind,
            epoch: e.epoch,
            next_seq: e.next_seq,
            oldest_seq: e.oldest_seq,
            subscribers: e.subscribers,
            zmq_publish: e.zmq_publish,
            zmq_replay: e.zmq_replay,
        }),
        cluster_nodes: s.cluster_nodes,
    })
}

pub fn human(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

pub fn render(s: &Status) -> String {
    let mut o = String::new();
    let pct = |a: u64, b: u64| if b == 0 { 0.0 } else { 100.0 * a as f64 / b as f64 };
    let _ = writeln!(o, "cxlkv node {} on {} pool {} ({})", s.node_id, s.backend, s.path, human(s.pool_size));
    let _ = write!(o, "pool uuid {}, {} coherence, role {}", s.pool_uuid, s.coherence, s.cluster_role);
    let _ =
        if s.election.is_empty() { writeln!(o) } else { writeln!(o, " (election {}, epoch {})", s.election, s.epoch) };
    render_cluster(&mut o, s);
    render_events(&mut o, s);
    let _ = writeln!(
        o,
        "regions: {} total, {} free, region {}, page {}",
        s.regions_total,
        s.regions_free,
        human(s.region_size),
        human(s.page_size)
    );
    let owners: Vec<String> = s.regions_by_owner.iter().map(|(n, c)| format!("node {n}: {c}")).collect();
    let _ = writeln!(o, "regions by owner: {}", if owners.is_empty() { "none".into() } else { owners.join(", ") });
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "{:<8} {:<7} {:>6} {:>6} {:>12} {:>12}",
        "REGION", "STATE", "OWNER", "GEN", "PAGES USED", "PAGES FREE"
    );
    for r in s.regions.iter().filter(|r| r.state != "free") {
        let owner = r.owner_node.map(|n| n.to_string()).unwrap_or_else(|| "-".into());
        let (used, free) = if r.pages_total > 0 {
            ((r.pages_total - r.pages_free).to_string(), r.pages_free.to_string())
        } else {
            ("-".into(), "-".into())
        };
        let _ =
            writeln!(o, "{:<8} {:<7} {:>6} {:>6} {:>12} {:>12}", r.region, r.state, owner, r.generation, used, free);
    }
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "pages: {} used, {} free of {} ({:.1}% used)",
        s.pages_used,
        s.pages_free,
        s.pages_total,
        pct(s.pages_used, s.pages_total)
    );
    let _ = writeln!(
        o,
        "keys: {} stored ({}), {} being written, {} locked",
        s.keys,
        human(s.bytes_stored),
        s.reserved,
        s.locked_keys
    );
    let _ = writeln!(
        o,
        "evictions: {} (policy {}; {} to keep tenants under quota), expired reservations: {}",
        s.evictions, s.eviction_policy, s.quota_evictions, s.reservations_expired
    );
    render_admission(&mut o, s);
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "{:<24} {:>10} {:>12} {:>12} {:>7} {:>12}",
        "TENANT", "KEYS", "BYTES", "QUOTA", "USED", "GUARANTEED"
    );
    for t in &s.tenants {
        let name = if t.tenant.is_empty() { "(none)" } else { t.tenant.as_str() };
        let limit = |b: u64| if b == 0 { "-".to_string() } else { human(b) };
        let used = if t.quota_bytes == 0 {
            "-".to_string()
        } else {
            format!("{:.0}%", pct(t.bytes + t.reserving_bytes, t.quota_bytes))
        };
        let _ = writeln!(
            o,
            "{:<24} {:>10} {:>12} {:>12} {:>7} {:>12}",
            name,
            t.keys,
            human(t.bytes),
            limit(t.quota_bytes),
            used,
            limit(t.guaranteed_bytes)
        );
    }
    o
}

/// What admission decided, and what its evidence holds.
fn render_admission(o: &mut String, s: &Status) {
    let Some(a) = &s.admission else { return };
    let judged = a.admitted + a.refused;
    let state = match (a.mode.as_str(), a.gating) {
        ("off", _) => "every store admitted".to_string(),
        (_, true) => "gating: keys not seen before are refused".to_string(),
        (_, false) => "admitting everything now".to_string(),
    };
    let pct = if judged == 0 { 0.0 } else { 100.0 * a.refused as f64 / judged as f64 };
    let per_key = (a.history_bytes + a.shadow_bytes) as f64 / s.keys.max(1) as f64;
    let _ = writeln!(
        o,
        "admission: {} ({state}); {} admitted, {} refused ({pct:.1}%); history {}, simulations {} \
         ({per_key:.1} B per key)",
        a.mode,
        a.admitted,
        a.refused,
        human(a.history_bytes),
        human(a.shadow_bytes)
    );
}

/// The cluster's nodes (nothing on a single node).
fn render_cluster(o: &mut String, s: &Status) {
    if s.cluster_nodes.is_empty() {
        return;
    }
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "{:<6} {:<20} {:<9} {:<6} {:>9} {:>8} {:>11} {:>11} {:>10} {:>9}",
        "NODE", "NAME", "ROLE", "ALIVE", "SILENT", "REGIONS", "PAGES USED", "PAGES FREE", "FWD P50", "HELD KEYS"
    );
    for n in &s.cluster_nodes {
        let follower = n.role == "follower";
        let fwd = if follower { format!("{} us", n.forwarded_p50_us) } else { "-".into() };
        let held = if follower { n.held_keys.to_string() } else { "-".into() };
        let _ = writeln!(
            o,
            "{:<6} {:<20} {:<9} {:<6} {:>6} ms {:>8} {:>11} {:>11} {:>10} {:>9}",
            n.node,
            n.name,
            n.role,
            if n.alive { "yes" } else { "no" },
            n.silent_ms,
            n.regions,
            n.pages_total - n.pages_free,
            n.pages_free,
            fwd,
            held
        );
    }
}

/// Where this node's event stream is, and how much of it is held.
fn render_events(o: &mut String, s: &Status) {
    let Some(e) = &s.events else {
        let _ = writeln!(o, "events: off");
        return;
    };
    let what = if e.kind == "relay" { "relayed from the primary" } else { "this node is the source" };
    let held = e.next_seq.saturating_sub(e.oldest_seq);
    let _ = write!(
        o,
        "events: {what}, epoch {}, next batch {}, {held} batches held for replay, {} subscribers",
        e.epoch, e.next_seq, e.subscribers
    );
    let _ = if e.zmq_publish.is_empty() {
        writeln!(o, "; zmq off")
    } else {
        writeln!(o, "; zmq {} (replay {})", e.zmq_publish, e.zmq_replay)
    };
}

/// Print the event stream of the sidecar behind `socket` (or `tcp`) from
/// (`epoch`, `since`), a line per event (JSON lines with `json`), until it
/// ends or `out` fails.
pub async fn watch(
    socket: &str,
    tcp: Option<&str>,
    auth: &ClientAuth,
    (epoch, since): (u64, u64),
    json: bool,
    out: &mut impl std::io::Write,
) -> Result<()> {
    let mut c = match tcp {
        Some(addr) => auth.connect_tcp(addr).await?,
        None => auth.connect_uds(Path::new(socket)).await?,
    };
    let mut stream =
        c.watch_events(proto::WatchEventsRequest { epoch, since }).await.map_err(Error::from)?.into_inner();
    while let Some(b) = stream.message().await.map_err(Error::from)? {
        let io = |e: std::io::Error| Error::io("write the events", e);
        for e in &b.events {
            let line = if json { event_json(&b, e) } else { event_line(&b, e) };
            writeln!(out, "{line}").map_err(io)?;
        }
        out.flush().map_err(io)?;
    }
    Ok(())
}

fn kind_name(e: &proto::Event) -> &'static str {
    match proto::event::Kind::try_from(e.kind) {
        Ok(proto::event::Kind::Stored) => "stored",
        Ok(proto::event::Kind::Removed) => "removed",
        Ok(proto::event::Kind::AllCleared) => "all_cleared",
        Err(_) => "unknown",
    }
}

/// A key as a person reads it: printable ASCII as it is, else hex.
fn key_text(k: &[u8]) -> String {
    if !k.is_empty() && k.iter().all(|b| b.is_ascii_graphic()) {
        return String::from_utf8_lossy(k).into_owned();
    }
    k.iter().fold(String::from("0x"), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn event_line(b: &proto::EventBatch, e: &proto::Event) -> String {
    let head = format!("{} {} {:<11}", b.seq, b.ts_unix_ms, kind_name(e));
    match proto::event::Kind::try_from(e.kind) {
        Ok(proto::event::Kind::Stored) => format!(
            "{head} tenant={:?} size={} node={} commit={} key={}",
            e.tenant,
            e.size,
            e.node,
            e.commit_seq,
            key_text(&e.key)
        ),
        Ok(proto::event::Kind::Removed) => {
            format!("{head} tenant={:?} size={} reason={} key={}", e.tenant, e.size, e.reason, key_text(&e.key))
        }
        _ => format!("{head} epoch={}", b.epoch),
    }
}

fn event_json(b: &proto::EventBatch, e: &proto::Event) -> String {
    serde_json::json!({
        "epoch": b.epoch, "seq": b.seq, "ts_unix_ms": b.ts_unix_ms, "kind": kind_name(e),
        "key": key_text(&e.key), "tenant": e.tenant, "size": e.size, "node": e.node,
        "commit_seq": e.commit_seq, "reason": e.reason,
    })
    .to_string()
}

pub fn to_json(s: &Status) -> String {
    serde_json::to_string_pretty(s).expect("status serializes")
}
