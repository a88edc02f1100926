//! Per-tenant quotas and guaranteed shares against the real binary: a tenant
//! at its quota evicts its own keys and never another's; a tenant's
//! guaranteed share survives another tenant filling the node; usage against
//! quota shows in Stats, `cxlkv status` and /metrics.
mod common;

use std::time::{Duration, Instant};

use common::*;
use cxlkv::client::Client;

/// Payload of every object: one 64 KiB page each.
const OBJ: usize = 50_000;

/// Store `tenant`'s objects `ns` one call each (so LRU order is store order).
async fn store_each(c: &mut Client, m: &mut PoolMap, tenant: &str, ns: std::ops::Range<u64>) -> Vec<u32> {
    let mut codes = vec![];
    for n in ns {
        let k = format!("{tenant}{n}");
        codes.extend(store(c, m, tenant, &[(&k, pattern(n + 1000 * tenant.len() as u64, OBJ))]).await);
    }
    codes
}

/// Which of `tenant`'s objects `ns` read back inline with their own bytes
/// (a miss is false; other bytes fail the test).
async fn readable(c: &mut Client, tenant: &str, ns: std::ops::Range<u64>) -> Vec<u64> {
    let mut out = vec![];
    for n in ns {
        if let Some(bytes) = inline_get(c, &format!("{tenant}{n}")).await {
            assert!(bytes == pattern(n + 1000 * tenant.len() as u64, OBJ), "{tenant}{n}: other bytes");
            out.push(n);
        }
    }
    out
}

fn tenant(s: &cxlkv::proto::StatsReply, name: &str) -> cxlkv::proto::TenantUsage {
    s.tenants.iter().find(|t| t.tenant == name).cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_quota_evicts_its_own_keys_and_shows_it() {
    let dir = tempfile::tempdir().unwrap();
    let maddr = format!("127.0.0.1:{}", free_port());
    // LRU: the test names which keys go first.
    let toml =
        "[server]\nmax_tenant_series = 4\n[registry]\neviction_policy = \"lru\"\n[quotas.tenants.a]\nbytes = 200000\n";
    let s = Sidecar::with_config(dir.path(), "q", toml, &["--metrics-addr", &maddr]);
    let mut c = s.client().await;
    let mut m = PoolMap::open(&mut c).await;
    // b's keys are the oldest: plain LRU would evict them first.
    assert!(store_each(&mut c, &mut m, "b", 0..4).await.iter().all(|&x| x == OK));
    assert!(store_each(&mut c, &mut m, "a", 0..6).await.iter().all(|&x| x == OK));
    assert_eq!(readable(&mut c, "b", 0..4).await, [0, 1, 2, 3], "b lost nothing");
    assert_eq!(readable(&mut c, "a", 0..6).await, [2, 3, 4, 5], "a's two oldest made room");
    // More than the whole quota can never be stored, and evicts nothing.
    let big = [("a-big", pattern(7, 200_001))];
    assert_eq!(store(&mut c, &mut m, "a", &big).await, [RESOURCE_EXHAUSTED]);
    let st = stats(&mut c).await;
    let a = tenant(&st, "a");
    assert_eq!((a.keys, a.bytes, a.quota_bytes, a.reserving_bytes), (4, 200_000, 200_000, 0));
    assert_eq!(tenant(&st, "b").quota_bytes, 0, "b has no quota");
    assert_eq!((st.evictions, st.quota_evictions), (2, 2));

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cxlkv"))
        .args(["status", "--socket", s.socket.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("QUOTA") && text.contains("2 to keep tenants under quota"), "{text}");
    let row = text.lines().find(|l| l.starts_with("a ")).unwrap_or_else(|| panic!("no row for a: {text}"));
    assert!(row.contains("100%"), "a uses all of its quota: {row}");

    // /metrics: quota evictions by reason and the tenant's quota.
    let want = ["cxlkv_evictions_total{reason=\"quota\"} 2\n", "cxlkv_tenant_quota_bytes{tenant=\"a\"} 200000\n"];
    let t = Instant::now();
    loop {
        let body = http_get(&maddr, "/metrics");
        if want.iter().all(|w| body.contains(w)) {
            assert!(body.contains("cxlkv_evictions_total{reason=\"capacity\"} 0\n"), "{body}");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "metrics never showed {want:?}:\n{body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guaranteed_share_survives_another_tenant_filling_the_node() {
    let dir = tempfile::tempdir().unwrap();
    // One region of 32 pages; b is guaranteed 16 objects' worth.
    let toml = "[registry]\nmax_regions_per_instance = 1\neviction_policy = \"lru\"\n[quotas.tenants.b]\nguaranteed_bytes = 800000\n";
    let s = Sidecar::with_config(dir.path(), "g", toml, &[]);
    let mut c = s.client().await;
    let mut m = PoolMap::open(&mut c).await;
    assert!(store_each(&mut c, &mut m, "b", 0..20).await.iter().all(|&x| x == OK));
    // a fills the node twice over: it may take b's 4 objects above b's
    // share, then only its own.
    assert!(store_each(&mut c, &mut m, "a", 0..32).await.iter().all(|&x| x == OK));
    assert_eq!(readable(&mut c, "b", 0..20).await, (4..20).collect::<Vec<_>>(), "b keeps its newest 16");
    assert_eq!(readable(&mut c, "a", 0..32).await, (16..32).collect::<Vec<_>>());
    let st = stats(&mut c).await;
    assert_eq!(tenant(&st, "b").bytes, 800_000);
    assert_eq!((st.evictions, st.quota_evictions), (20, 0));
}
