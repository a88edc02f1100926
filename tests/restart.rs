//! The cache survives restarts: the registry is rebuilt from the object
//! records in the pool. Against the real binary: kill -9 and SIGTERM in the
//! middle of stores, torn writes, deletes and evictions, a damaged record, a
//! pool of the previous layout.
mod common;

use std::time::Duration;

use common::*;
use cxlkv::proto;

fn req(items: &[(String, u64)]) -> proto::ReserveRequest {
    proto::ReserveRequest {
        tenant: "t".into(),
        items: items.iter().map(|(k, n)| proto::ReserveItem { key: key(k), size: *n, ..Default::default() }).collect(),
        ..Default::default()
    }
}

/// What a client did before the sidecar went away.
#[derive(Default)]
struct History {
    /// Commit returned OK: must be readable after the restart.
    committed: Vec<(String, Vec<u8>)>,
    /// Written (maybe half) but never committed: must never be readable.
    torn: Vec<String>,
    /// Commit sent, no answer: may be readable, then with exactly its bytes.
    in_flight: Vec<(String, Vec<u8>)>,
    deleted: Vec<String>,
}

/// Store keys one by one (some torn, some deleted) until the sidecar dies;
/// `kill` is called once `after` keys are committed.
async fn store_until_gone(s: &Sidecar, after: usize, kill: impl FnOnce()) -> History {
    let mut c = s.client().await;
    let mut m = PoolMap::open(&mut c).await;
    let mut h = History::default();
    let mut kill = Some(kill);
    // A long name (past what a record holds inline) every 7th key.
    let name = |i: usize| if i % 7 == 3 { format!("key-{i}-{}", "x".repeat(150)) } else { format!("key-{i}") };
    for i in 0..400usize {
        if h.committed.len() == after {
            if let Some(k) = kill.take() {
                k();
            }
        }
        let (k, v) = (name(i), pattern(i as u64, 10_000 + (i * 7919) % 200_000));
        let Ok(rep) = c.reserve(req(&[(k.clone(), v.len() as u64)])).await else { break };
        let r = &rep.into_inner().reservations[0];
        assert_eq!(r.status.as_ref().unwrap().code, OK, "{k}");
        let loc = r.location.unwrap();
        if i % 5 == 4 {
            m.write(&loc, &[&v[..v.len() / 2], &vec![0; v.len() - v.len() / 2]].concat());
            h.torn.push(k); // the writer "dies" here: no commit
            continue;
        }
        m.write(&loc, &v);
        let commit = proto::CommitRequest { reservation_ids: vec![r.reservation_id], crc32: vec![], keys: vec![] };
        match c.commit(commit).await {
            Ok(rep) if rep.get_ref().statuses[0].code == OK => h.committed.push((k, v)),
            Ok(rep) => panic!("commit of {k}: {:?}", rep.into_inner()),
            Err(_) => {
                h.in_flight.push((k, v));
                break;
            }
        }
        if i % 11 == 10 {
            let (k, _) = h.committed.pop().unwrap();
            match c.delete(proto::DeleteRequest { keys: vec![key(&k)] }).await {
                Ok(rep) if rep.get_ref().statuses[0].code == OK => h.deleted.push(k),
                _ => break, // unknown: the key may or may not be gone
            }
        }
    }
    h
}

/// After the restart: every committed key with identical bytes, no torn or
/// deleted key, in-flight ones only with their own bytes.
async fn check(s: &Sidecar, h: &History) -> usize {
    let mut c = s.client().await;
    let m = PoolMap::open(&mut c).await;
    for (k, v) in &h.committed {
        let loc = lookup(&mut c, &[k]).await[0].unwrap_or_else(|| panic!("{k} committed before the crash is gone"));
        assert_eq!(&m.read(&loc), v, "{k} has other bytes");
        assert_eq!(m.version(&loc), loc.version);
    }
    for k in h.torn.iter().chain(&h.deleted) {
        assert_eq!(exists(&mut c, &[k]).await, vec![false], "{k} came back");
    }
    for (k, v) in &h.in_flight {
        if let Some(loc) = lookup(&mut c, &[k]).await[0] {
            assert_eq!(&m.read(&loc), v, "{k} (commit in flight) has other bytes");
        }
    }
    h.committed.len()
}

fn kill9(s: &Sidecar) {
    let pid = nix::unistd::Pid::from_raw(s.child.as_ref().unwrap().id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
}

const ARGS: &[&str] = &["--pool-size", "64MiB", "--reservation-timeout-ms", "1500"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_store_loses_nothing_committed() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Sidecar::start(dir.path(), "a", ARGS);
    let h = store_until_gone(&s, 60, || kill9(&s)).await;
    let _ = s.child.as_mut().unwrap().wait();
    assert!(h.committed.len() >= 50 && !h.torn.is_empty() && !h.deleted.is_empty());
    s.spawn(ARGS);
    assert!(s.logs().contains("rebuilt the registry"), "{}", s.logs());
    let n = check(&s, &h).await;
    assert_eq!(n, h.committed.len());
    // The torn writes' pages are quarantined, then freed.
    let mut c = s.client().await;
    let used = stats(&mut c).await.pages_used;
    tokio::time::sleep(Duration::from_millis(2000)).await;
    assert!(stats(&mut c).await.pages_used < used, "quarantined pages were never freed");
    assert_eq!(check(&s, &h).await, n);
    // And a second restart finds the same.
    s.stop();
    s.spawn(ARGS);
    assert_eq!(check(&s, &h).await, n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_store_loses_nothing_committed() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Sidecar::start(dir.path(), "a", ARGS);
    let pid = nix::unistd::Pid::from_raw(s.child.as_ref().unwrap().id() as i32);
    let h = store_until_gone(&s, 40, || nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap()).await;
    let _ = s.child.as_mut().unwrap().wait();
    s.spawn(ARGS);
    assert_eq!(check(&s, &h).await, h.committed.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_keys_do_not_come_back() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["--max-regions", "1"];
    let mut s = Sidecar::start(dir.path(), "a", &args);
    let mut c = s.client().await;
    let mut m = PoolMap::open(&mut c).await;
    for i in 0..20u64 {
        store(&mut c, &mut m, "t", &[(&format!("e{i}"), pattern(i, 256 << 10))]).await;
    }
    let gone = c.removed(proto::RemovedRequest::default()).await.unwrap().into_inner().keys;
    assert!(gone.len() >= 12, "{} evictions", gone.len());
    kill9(&s);
    let _ = s.child.as_mut().unwrap().wait();
    s.spawn(&args);
    let mut c = s.client().await;
    let m = PoolMap::open(&mut c).await;
    for i in 0..20u64 {
        let k = format!("e{i}");
        let evicted = gone.iter().any(|g| g.key == k.as_bytes());
        match lookup(&mut c, &[&k]).await[0] {
            Some(loc) => {
                assert!(!evicted, "{k} was evicted but came back");
                assert_eq!(m.read(&loc), pattern(i, 256 << 10));
            }
            None => assert!(evicted, "{k} was not evicted but is gone"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_record_is_discarded_with_a_log_line_and_a_metric() {
    let dir = tempfile::tempdir().unwrap();
    let maddr = format!("127.0.0.1:{}", free_port());
    let args = ["--metrics-addr", maddr.as_str()];
    let mut s = Sidecar::start(dir.path(), "a", &args);
    let mut c = s.client().await;
    let mut m = PoolMap::open(&mut c).await;
    let info = c.pool_info(proto::PoolInfoRequest {}).await.unwrap().into_inner();
    store(&mut c, &mut m, "t", &[("a", pattern(1, 5000)), ("b", pattern(2, 5000)), ("c", pattern(3, 5000))]).await;
    let b = lookup(&mut c, &["b"]).await[0].unwrap();
    unlock(&mut c, &["b"]).await;
    s.stop();
    // One bit of b's record (its length field) flips while no one runs.
    let page = b.region as u64 * (info.region_size / info.page_size) + b.offset / info.page_size;
    let at = info.page_table_offset + page * info.page_slot_bytes as u64 + 40;
    let mut bytes = std::fs::read(&s.pool).unwrap();
    bytes[at as usize] ^= 0x10;
    std::fs::write(&s.pool, bytes).unwrap();
    s.spawn(&args);
    let mut c = s.client().await;
    assert_eq!(exists(&mut c, &["a", "b", "c"]).await, vec![true, false, true]);
    assert!(s.logs().contains("discarding a damaged object record"), "{}", s.logs());
    let body = http_get(&maddr, "/metrics");
    assert!(body.contains("cxlkv_rebuild_records_total{result=\"damaged\"} 1"), "{body}");
    assert!(body.contains("cxlkv_rebuild_records_total{result=\"restored\"} 2"), "{body}");
}

#[test]
fn a_pool_of_the_previous_layout_is_refused_with_a_way_out() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Sidecar::start(dir.path(), "a", &[]);
    s.stop();
    // Rewrite the superblock as layout version 2 (with a valid checksum).
    let mut bytes = std::fs::read(&s.pool).unwrap();
    bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
    let crc = crc32fast::hash(&bytes[..124]);
    bytes[124..128].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&s.pool, &bytes).unwrap();
    let mut old = Sidecar::start_unchecked(dir.path(), "b", &[]);
    assert!(!old.wait_exit(Duration::from_secs(30)).success());
    let log = old.logs();
    assert!(log.contains("layout version 2 is not supported") && log.contains("--format"), "{log}");
    assert_eq!(std::fs::read(&s.pool).unwrap(), bytes, "the refused pool was changed");
    // With --format it starts, empty.
    let f = Sidecar::start(dir.path(), "c", &["--format"]);
    drop(f);
}
