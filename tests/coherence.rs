//! The real binary on the non-coherent test backend: every process keeps a
//! private copy of the pool, so the sidecar's writes reach the pool file only
//! where it flushes them and it sees other processes' writes only where it
//! invalidates. A restarted sidecar is a fresh process that knows only what
//! was flushed: every record, region-table entry and inline-put payload that
//! the old one published must be there, with identical bytes.
mod common;

use common::*;
use cxlkv::proto;

const ARGS: &[&str] = &["--backend", "noncoherent-test", "--pool-size", "16MiB"];

/// Keys with names that fit a record and names that follow the payload,
/// sizes from one line to several inline chunks and whole regions' worth.
fn objects() -> Vec<(String, Vec<u8>)> {
    let sizes = [1usize, 63, 65, 4096, 100_000, (1 << 20) + 17, 1_500_000];
    sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let k = if i % 3 == 1 { format!("obj-{i}-{}", "n".repeat(120)) } else { format!("obj-{i}") };
            (k, pattern(1000 + i as u64, n))
        })
        .collect()
}

fn kill9(s: &mut Sidecar) {
    let mut c = s.child.take().expect("running");
    c.kill().unwrap();
    c.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_puts_survive_a_restart_on_a_noncoherent_pool() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Sidecar::start(dir.path(), "a", ARGS);
    let mut c = s.client().await;
    let info = c.pool_info(proto::PoolInfoRequest {}).await.unwrap().into_inner();
    assert_eq!((info.backend.as_str(), info.coherence.as_str()), ("noncoherent-test", "software"));
    let objs = objects();
    for (k, v) in &objs {
        let chunks = v.chunks(300_000).map(|c| c.to_vec()).collect();
        let rep = inline_put(&mut c, k, v.len() as u64, chunks).await.unwrap();
        assert_eq!(rep.status.unwrap().code, OK, "{k}");
    }
    let deleted = &objs[2].0;
    let del = c.delete(proto::DeleteRequest { keys: vec![key(deleted)] }).await.unwrap().into_inner();
    assert_eq!(del.statuses[0].code, OK);
    // kill -9: nothing is written at exit; the pool file holds only what was flushed.
    kill9(&mut s);
    s.spawn(ARGS);
    assert!(s.logs().contains("rebuilt the registry"), "{}", s.logs());
    let mut c = s.client().await;
    for (k, v) in &objs {
        let got = inline_get(&mut c, k).await;
        if k == deleted {
            assert_eq!(got, None, "{k} was deleted before the restart but came back");
        } else {
            let got = got.unwrap_or_else(|| panic!("{k} committed before the restart is gone"));
            assert!(got == *v, "{k} has other bytes after the restart");
        }
    }
    // The rebuilt regions are still this node's in the region table.
    let st = stats(&mut c).await;
    assert_eq!(st.keys, objs.len() as u64 - 1);
    assert!(st.regions.iter().any(|r| r.owner_node == info.node_id), "{st:?}");
}

/// A client writes through its own mapping of the pool file; the sidecar,
/// whose private copy was taken when it claimed the region, reads the
/// object inline only because it invalidates the object first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mapped_stores_are_read_inline_with_identical_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Sidecar::start(dir.path(), "a", ARGS);
    let mut c = s.client().await;
    let mut m = PoolMap::open(&mut c).await;
    let objs = objects();
    let items: Vec<(&str, Vec<u8>)> = objs.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    assert!(store(&mut c, &mut m, "t", &items).await.iter().all(|&code| code == OK));
    for (k, v) in &objs {
        let got = inline_get(&mut c, k).await.unwrap_or_else(|| panic!("{k} not found"));
        assert!(got == *v, "{k}: the inline read returned other bytes than the client wrote");
    }
    s.stop();
    s.spawn(ARGS);
    let mut c = s.client().await;
    for (k, v) in &objs {
        let got = inline_get(&mut c, k).await.unwrap_or_else(|| panic!("{k} committed before the restart is gone"));
        assert!(got == *v, "{k} has other bytes after the restart");
    }
}

#[test]
fn the_test_backend_refuses_hardware_coherence() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Sidecar::start_unchecked(dir.path(), "a", &[ARGS, &["--coherence", "hardware"]].concat());
    assert!(!s.wait_exit(std::time::Duration::from_secs(30)).success());
    assert!(s.logs().contains("is not coherent"), "{}", s.logs());
}
