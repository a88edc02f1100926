//! Operability: metrics match their documentation, `cxlkv status`, JSON logs,
//! graceful shutdown.
mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::*;
use cxlkv::proto;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exported_metrics_match_docs_metrics_md() {
    let maddr = format!("127.0.0.1:{}", free_port());
    let (_dir, _s, mut c, mut m) =
        one_sidecar(&["--metrics-addr", &maddr, "--max-regions", "1", "--max-tenant-series", "100"]).await;
    // Touch every path that creates a labelled series, including evictions.
    for i in 0..40 {
        store(&mut c, &mut m, "alice", &[(&format!("k{i}"), pattern(i, 100_000))]).await;
    }
    lookup(&mut c, &["k39", "nope"]).await;
    unlock(&mut c, &["k39"]).await;
    store(&mut c, &mut m, "bob", &[("gone", pattern(9, 777))]).await;
    // A housekeeping tick sees bob with bytes before his last key goes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(http_get(&maddr, "/metrics").contains("cxlkv_tenant_stored_bytes{tenant=\"bob\"} 777\n"));
    delete(&mut c, &["gone"]).await;
    inline_put(&mut c, "inl", 10, vec![vec![1; 10]]).await.unwrap();
    inline_get(&mut c, "inl").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let body = http_get(&maddr, "/metrics");
    let exported: BTreeSet<(String, String)> =
        exported_metrics(&body).into_iter().filter(|(n, _)| n.starts_with("cxlkv_")).collect();
    // Metrics of a cluster are in their own section, after the single node's.
    let doc = documented_metrics(false);
    assert!(doc.len() > 10, "docs table not parsed");
    let missing: Vec<_> = doc.difference(&exported).collect();
    let undocumented: Vec<_> = exported.difference(&doc).collect();
    assert!(
        missing.is_empty() && undocumented.is_empty(),
        "documented but not exported: {missing:?}\nexported but not documented: {undocumented:?}"
    );
    assert!(body.contains("cxlkv_tenant_stored_bytes{tenant=\"alice\"}"));
    assert!(body.contains("cxlkv_tenant_stored_bytes{tenant=\"bob\"} 0\n"), "an emptied tenant's gauge must read 0");
    assert!(body.contains("cxlkv_evictions_total{reason=\"capacity\"}"));
    assert!(!body.contains("cxlkv_evictions_total{reason=\"capacity\"} 0\n"), "evictions did happen");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_prints_a_table_and_json() {
    let (dir, s, mut c, mut m) = one_sidecar(&[]).await;
    store(&mut c, &mut m, "alice", &[("a", pattern(1, 3000)), ("b", pattern(2, 70_000))]).await;
    store(&mut c, &mut m, "", &[("c", pattern(3, 10))]).await;
    lookup(&mut c, &["a"]).await;
    let run = |extra: &[&str]| {
        let out = run_cxlkv(["status", "--socket", s.socket.to_str().unwrap()].iter().chain(extra));
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let table = run(&[]);
    for needle in [
        "cxlkv node 1 on shm pool",
        "hardware coherence",
        "regions by owner: node 1: 1",
        "keys: 3 stored",
        "1 locked",
        "alice",
        "(none)",
    ] {
        assert!(table.contains(needle), "missing {needle:?} in\n{table}");
    }
    // 3000 B -> 1 page, 70000 B -> 2 pages, 10 B -> 1 page of 64 KiB.
    assert!(table.contains("pages: 4 used"), "{table}");
    let j: serde_json::Value = serde_json::from_str(&run(&["--json"])).unwrap();
    assert_eq!(j["keys"], 3);
    assert_eq!(j["coherence"], "hardware");
    assert_eq!(j["bytes_stored"], 73_010);
    assert_eq!(j["locked_keys"], 1);
    assert_eq!(j["pages_used"], 4);
    assert_eq!(j["regions_by_owner"]["1"], 1);
    let alice = j["tenants"].as_array().unwrap().iter().find(|t| t["tenant"] == "alice").unwrap();
    assert_eq!((alice["keys"].as_u64(), alice["bytes"].as_u64()), (Some(2), Some(73_000)));

    let out = run_cxlkv(["status", "--socket", dir.path().join("absent.sock").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach cxlkv"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_by_flag() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Sidecar::start(dir.path(), "a", &["--log-format", "json"]);
    s.stop();
    let logs = s.logs();
    let lines: Vec<&str> = logs.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() >= 3, "{logs}");
    for l in &lines {
        let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(v["level"].is_string() && v["fields"].is_object(), "{l}");
    }
    assert!(lines.iter().any(|l| l.contains("cxlkv serving")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_requests_and_keeps_committed_bytes() {
    use proto::inline_put_chunk::Part;
    let dir = tempfile::tempdir().unwrap();
    let maddr = format!("127.0.0.1:{}", free_port());
    let mut s = Sidecar::start(dir.path(), "a", &["--metrics-addr", &maddr]);
    let mut c = s.client().await;
    let info = pool_info(&mut c).await;
    let data = pattern(5, 300_000);
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut c2 = s.client().await;
    let call = tokio::spawn(async move { c2.inline_put(tokio_stream::wrappers::ReceiverStream::new(rx)).await });
    let header = proto::InlinePutHeader { key: key("slow"), tenant: "t".into(), size: data.len() as u64 };
    tx.send(proto::InlinePutChunk { part: Some(Part::Header(header)) }).await.unwrap();
    tx.send(proto::InlinePutChunk { part: Some(Part::Data(data[..100_000].to_vec().into())) }).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;

    s.sigterm();
    let t = Instant::now();
    while !http_get(&maddr, "/ready").starts_with("HTTP/1.1 503") {
        assert!(t.elapsed() < Duration::from_secs(5), "readiness did not drop on SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The in-flight stream still completes after the signal.
    tx.send(proto::InlinePutChunk { part: Some(Part::Data(data[100_000..].to_vec().into())) }).await.unwrap();
    drop(tx);
    let rep = call.await.unwrap().unwrap().into_inner();
    assert_eq!(rep.status.unwrap().code, OK);
    let loc = rep.location.unwrap();
    let mut child = s.child.take().unwrap();
    let t = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(t.elapsed() < Duration::from_secs(15), "no exit after draining");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status}");
    // Committed bytes are still in the pool after the process is gone.
    let pool = std::fs::read(&s.pool).unwrap();
    let at = (info.data_offset + loc.region as u64 * info.region_size + loc.offset) as usize;
    assert_eq!(&pool[at..at + data.len()], &data[..]);
}
