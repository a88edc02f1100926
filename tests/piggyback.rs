//! A store batch's Commit riding on the next Reserve (`ReserveRequest.commit_first`),
//! end to end against the real `cxlkv` binary.
mod common;

use common::*;
use cxlkv::client::Client;
use cxlkv::proto;

const PERMISSION_DENIED: u32 = tonic::Code::PermissionDenied as u32;

fn reserve_req(items: &[(&str, u64)], commit_first: Vec<u64>) -> proto::ReserveRequest {
    proto::ReserveRequest {
        tenant: "t".into(),
        items: items.iter().map(|(k, n)| proto::ReserveItem { key: key(k), size: *n, ..Default::default() }).collect(),
        commit_first,
        ..Default::default()
    }
}

/// Reserve `keys` (4 KiB each, no commit) and write their bytes: (id, bytes) per key.
async fn written(c: &mut Client, m: &mut PoolMap, keys: &[&str], seed: u64) -> Vec<(u64, Vec<u8>)> {
    let items: Vec<(&str, u64)> = keys.iter().map(|k| (*k, 4096)).collect();
    let rep = c.reserve(reserve_req(&items, vec![])).await.unwrap().into_inner();
    let mut out = vec![];
    for (i, r) in rep.reservations.iter().enumerate() {
        assert_eq!(r.status.as_ref().unwrap().code, OK);
        let data = pattern(seed + i as u64, 4096);
        m.write(r.location.as_ref().unwrap(), &data);
        out.push((r.reservation_id, data));
    }
    out
}

fn codes(s: &[proto::KeyStatus]) -> Vec<u32> {
    s.iter().map(|s| s.code).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_ride_on_the_next_reserve_each_with_its_own_status() {
    let dir = tempfile::tempdir().unwrap();
    let s = Sidecar::start(dir.path(), "a", &[]);
    let (mut c, mut other) = (s.client().await, s.client().await);
    let mut m = PoolMap::open(&mut c).await;
    let ab = written(&mut c, &mut m, &["a", "b"], 1).await;
    let x = written(&mut other, &mut m, &["x"], 9).await;
    // Written but not committed: invisible.
    assert_eq!(exists(&mut c, &["a", "b", "x"]).await, vec![false; 3]);

    let ids = vec![ab[0].0, ab[1].0, 0x1234_5678, x[0].0];
    let rep = c.reserve(reserve_req(&[("c", 4096)], ids)).await.unwrap().into_inner();
    // Applied per id: another session's reservation and an unknown id fail
    // alone, and the reserve that carried them still happens.
    assert_eq!(codes(&rep.commit_statuses), vec![OK, OK, NOT_FOUND, PERMISSION_DENIED]);
    assert_eq!(rep.reservations[0].status.as_ref().unwrap().code, OK);
    assert_eq!(exists(&mut c, &["a", "b", "x", "c"]).await, vec![true, true, false, false]);
    let hits = lookup(&mut c, &["a", "b"]).await;
    for ((_, want), loc) in ab.iter().zip(&hits) {
        assert_eq!(&m.read(loc.as_ref().unwrap()), want, "committed bytes differ");
    }
    // The other session can still commit its own reservation.
    let cr = other
        .commit(proto::CommitRequest { reservation_ids: vec![x[0].0], crc32: vec![], keys: vec![] })
        .await
        .unwrap();
    assert_eq!(codes(&cr.into_inner().statuses), vec![OK]);
    // Committing an id twice: the second time it is no open reservation.
    let rep = c.reserve(reserve_req(&[("d", 4096)], vec![ab[0].0])).await.unwrap().into_inner();
    assert_eq!(codes(&rep.commit_statuses), vec![NOT_FOUND]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_part_refuses_the_whole_call_and_applies_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let s = Sidecar::start(dir.path(), "a", &[]);
    let mut c = s.client().await;
    let mut m = PoolMap::open(&mut c).await;
    let p = written(&mut c, &mut m, &["p"], 3).await;
    let id = p[0].0;

    // A bad item (size 0) next to a good commit: refused whole, p stays invisible.
    let bad_item = c.reserve(reserve_req(&[("q", 0)], vec![id])).await.unwrap_err();
    assert_eq!(bad_item.code(), tonic::Code::InvalidArgument);
    // Checksums that do not match the ids next to a good item: q is not reserved.
    let mut bad_crc = reserve_req(&[("q", 4096)], vec![id]);
    bad_crc.commit_first_crc32 = vec![1, 2];
    assert_eq!(c.reserve(bad_crc).await.unwrap_err().code(), tonic::Code::InvalidArgument);
    // A stale deadline: nothing applied either.
    let mut stale = reserve_req(&[("q", 4096)], vec![id]);
    stale.deadline_unix_ms = 1;
    assert_eq!(c.reserve(stale).await.unwrap_err().code(), tonic::Code::DeadlineExceeded);
    assert_eq!(exists(&mut c, &["p", "q"]).await, vec![false, false], "nothing visible before its commit");

    // The reservation is still open and q was never reserved: both succeed now.
    let rep = c.reserve(reserve_req(&[("q", 4096)], vec![id])).await.unwrap().into_inner();
    assert_eq!(codes(&rep.commit_statuses), vec![OK]);
    assert_eq!(rep.reservations[0].status.as_ref().unwrap().code, OK, "q was reserved only now");
    let loc = lookup(&mut c, &["p"]).await.remove(0).unwrap();
    assert_eq!(m.read(&loc), p[0].1);
}
