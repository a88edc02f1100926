//! Reservations committed under another key (`CommitRequest.keys`): a
//! client leases pages ahead of need and binds them to a chunk's key at
//! commit. End to end against the real `cxlkv` binary.
mod common;

use common::*;
use cxlkv::client::Client;
use cxlkv::proto;

const PERMISSION_DENIED: u32 = tonic::Code::PermissionDenied as u32;

/// Lease `names` (size bytes each), write `pattern(seed + i)` into each:
/// (id, location, bytes) per lease.
async fn leased(
    c: &mut Client,
    m: &mut PoolMap,
    names: &[&str],
    size: usize,
    seed: u64,
) -> Vec<(u64, proto::Location, Vec<u8>)> {
    let req = proto::ReserveRequest {
        tenant: "t".into(),
        items: names
            .iter()
            .map(|k| proto::ReserveItem { key: key(k), size: size as u64, ..Default::default() })
            .collect(),
        ..Default::default()
    };
    let rep = c.reserve(req).await.unwrap().into_inner();
    let mut out = vec![];
    for (i, r) in rep.reservations.iter().enumerate() {
        assert_eq!(r.status.as_ref().unwrap().code, OK);
        let (loc, data) = (r.location.unwrap(), pattern(seed + i as u64, size));
        m.write(&loc, &data);
        out.push((r.reservation_id, loc, data));
    }
    out
}

async fn bind(c: &mut Client, ids: Vec<u64>, keys: &[&str]) -> Result<Vec<u32>, tonic::Status> {
    let keys = keys.iter().map(|k| if k.is_empty() { Default::default() } else { key(k) }).collect();
    let rep = c.commit(proto::CommitRequest { reservation_ids: ids, crc32: vec![], keys }).await?;
    Ok(rep.into_inner().statuses.iter().map(|s| s.code).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_stored_under_the_key_it_is_bound_to_and_a_restart_keeps_that_key() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Sidecar::start(dir.path(), "a", &[]);
    let mut c = s.client().await;
    assert!(pool_info(&mut c).await.commit_as_name_bytes > 0, "a single node offers binding");
    let mut m = PoolMap::open(&mut c).await;
    let l = leased(&mut c, &mut m, &["lease-1", "lease-2", "plain"], 5000, 1).await;
    let codes = bind(&mut c, l.iter().map(|x| x.0).collect(), &["k1", "k2", ""]).await.unwrap();
    assert_eq!(codes, vec![OK, OK, OK]);
    assert_eq!(
        exists(&mut c, &["k1", "k2", "plain", "lease-1", "lease-2"]).await,
        vec![true, true, true, false, false]
    );
    let hits = lookup(&mut c, &["k1", "k2", "plain"]).await;
    for ((_, leased_at, want), hit) in l.iter().zip(&hits) {
        let hit = hit.unwrap();
        assert_eq!((hit.region, hit.offset), (leased_at.region, leased_at.offset), "the lease's pages, not a copy");
        assert_eq!(&m.read(&hit), want);
    }
    unlock(&mut c, &["k1", "k2", "plain"]).await;
    assert_eq!(stats(&mut c).await.reserved, 0);
    // The pool's records say k1 and k2: a restart rebuilds them, and no lease name.
    s.stop();
    s.spawn(&[]);
    let mut c = s.client().await;
    assert_eq!(
        exists(&mut c, &["k1", "k2", "plain", "lease-1", "lease-2"]).await,
        vec![true, true, true, false, false]
    );
    let m = PoolMap::open(&mut c).await;
    let hit = lookup(&mut c, &["k2"]).await[0].unwrap();
    assert_eq!(m.read(&hit), l[1].2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_already_stored_gives_the_lease_back_and_each_id_has_its_own_status() {
    let (_dir, s, mut c, mut m) = one_sidecar(&[]).await;
    let mut other = s.client().await;
    store(&mut c, &mut m, "t", &[("stored", pattern(7, 5000))]).await;
    let used_before = stats(&mut c).await.pages_used;
    let mine = leased(&mut c, &mut m, &["l-a", "l-b", "l-c"], 5000, 10).await;
    let theirs = leased(&mut other, &mut m, &["l-x"], 5000, 20).await;
    let ids = vec![mine[0].0, mine[1].0, mine[2].0, theirs[0].0, 0x1234_5678];
    // "dup" twice in one call: the first binds, the second is present.
    let codes = bind(&mut c, ids, &["stored", "dup", "dup", "x", "y"]).await.unwrap();
    assert_eq!(codes, vec![ALREADY_EXISTS, OK, ALREADY_EXISTS, PERMISSION_DENIED, NOT_FOUND]);
    // The stored key kept its own bytes; the refused leases' pages are free.
    let hit = lookup(&mut c, &["stored", "dup"]).await;
    assert_eq!(m.read(&hit[0].unwrap()), pattern(7, 5000));
    assert_eq!(m.read(&hit[1].unwrap()), mine[1].2);
    unlock(&mut c, &["stored", "dup"]).await;
    let st = stats(&mut c).await;
    assert_eq!(st.reserved, 1, "only the other session's lease is still open");
    let pages = 5000u64.div_ceil(pool_info(&mut c).await.page_size);
    assert_eq!(st.pages_used, used_before + 2 * pages, "\"dup\" and the other session's lease: no more");
    // The other session binds its own.
    assert_eq!(bind(&mut other, vec![theirs[0].0], &["x"]).await.unwrap(), vec![OK]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_bind_refuses_the_whole_call_and_applies_nothing() {
    let (_dir, _s, mut c, mut m) = one_sidecar(&[]).await;
    let l = leased(&mut c, &mut m, &["l-1", "l-2"], 4096, 3).await;
    let room = pool_info(&mut c).await.commit_as_name_bytes as usize;
    let long = "k".repeat(room); // with tenant "t": one byte too many for the record
    let e = bind(&mut c, vec![l[0].0, l[1].0], &["fine", &long]).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let e = bind(&mut c, vec![l[0].0, l[1].0], &["only-one"]).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert_eq!(exists(&mut c, &["fine"]).await, vec![false]);
    // Nothing was applied: both leases still bind.
    let fits = "k".repeat(room - 1);
    assert_eq!(bind(&mut c, vec![l[0].0, l[1].0], &["fine", &fits]).await.unwrap(), vec![OK, OK]);
    let hits = lookup(&mut c, &["fine", &fits]).await;
    assert_eq!(m.read(&hits[1].unwrap()), l[1].2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_binds_nothing() {
    let (_dir, _s, mut c, mut m) = one_sidecar(&["--reservation-timeout-ms", "300"]).await;
    let l = leased(&mut c, &mut m, &["l-1"], 4096, 5).await;
    eventually("the lease to lapse", std::time::Duration::from_secs(10), async || stats(&mut c).await.reserved == 0)
        .await;
    assert_eq!(bind(&mut c, vec![l[0].0], &["late"]).await.unwrap(), vec![NOT_FOUND]);
    assert_eq!(exists(&mut c, &["late"]).await, vec![false]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserve_that_may_not_evict_takes_only_free_room_and_evicts_nothing() {
    let (_dir, _s, mut c, mut m) = one_sidecar(&[]).await;
    let size = 7 * pool_info(&mut c).await.page_size;
    let one = |k: &str, no_evict: bool| proto::ReserveRequest {
        tenant: "t".into(),
        items: vec![proto::ReserveItem { key: key(k), size, ..Default::default() }],
        no_evict,
        ..Default::default()
    };
    // Fill the pool with committed keys through reserves that may not evict:
    // each takes free room until there is none.
    let mut stored = 0;
    loop {
        let k = format!("k{stored}");
        let r = c.reserve(one(&k, true)).await.unwrap().into_inner();
        assert_eq!(r.evicted, 0);
        let code = r.reservations[0].status.as_ref().unwrap().code;
        if code == RESOURCE_EXHAUSTED {
            break;
        }
        assert_eq!(code, OK);
        assert_eq!(store(&mut c, &mut m, "t", &[(&k, pattern(stored, size as usize))]).await, vec![ALREADY_EXISTS]);
        let id = r.reservations[0].reservation_id;
        m.write(r.reservations[0].location.as_ref().unwrap(), &pattern(stored, size as usize));
        let cr = c.commit(proto::CommitRequest { reservation_ids: vec![id], crc32: vec![], keys: vec![] }).await;
        assert_eq!(cr.unwrap().into_inner().statuses[0].code, OK);
        stored += 1;
        assert!(stored < 1000, "the pool never filled");
    }
    assert!(stored > 4);
    // Full: nothing was evicted for the refused one, every key is there.
    assert_eq!(stats(&mut c).await.keys, stored);
    // The same item in a reserve that may evict gets its room.
    let r = c.reserve(one("more", false)).await.unwrap().into_inner();
    assert_eq!(r.reservations[0].status.as_ref().unwrap().code, OK);
    assert!(r.evicted > 0);
}
