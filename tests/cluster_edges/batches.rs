//! Defect 9: batches as large as the client API accepts pass through a
//! follower.
use std::sync::Arc;

use super::*;

/// A key of exactly 1 KiB (the largest the client API accepts).
fn kib_key(set: &str, i: usize) -> String {
    let head = format!("{set}-{i:06}-");
    format!("{head}{}", "x".repeat(1024 - head.len()))
}

fn keys_of(names: &[String]) -> Vec<bytes::Bytes> {
    names.iter().map(|k| key(k)).collect()
}

/// Store `every`-th key of `names` through `c` (small values); returns
/// which indices were stored and their bytes.
async fn store_some(c: &mut Client, m: &mut PoolMap, names: &[String], every: usize) -> Vec<(usize, Vec<u8>)> {
    let mut out = vec![];
    for i in (0..names.len()).step_by(every) {
        let v = pattern(i as u64 + 1, 1000);
        assert_eq!(store(c, m, "t", &[(&names[i], v.clone())]).await, [OK], "store #{i}");
        out.push((i, v));
    }
    out
}

/// Defect 9: Exists, LookupAndLock and Delete of 4096 keys of 1 KiB each
/// (the client API's largest batch of its largest keys) succeed through a
/// follower, with the right answers.
#[tokio::test(flavor = "multi_thread")]
async fn exists_lookup_and_delete_of_4096_one_kib_keys_succeed_through_a_follower() {
    let dir = tempfile::tempdir().unwrap();
    let cl = cluster(dir.path(), "16MiB");
    let (mut ca, mut cb) = (cl.a.client().await, cl.b.client().await);
    let mut mb = PoolMap::open(&mut cb).await;
    // Two sets: one read (and so held by b), one deleted.
    let read: Vec<String> = (0..4096).map(|i| kib_key("r", i)).collect();
    let del: Vec<String> = (0..4096).map(|i| kib_key("d", i)).collect();
    let read_stored = store_some(&mut cb, &mut mb, &read, 512).await;
    let del_stored = store_some(&mut cb, &mut mb, &del, 512).await;
    let is_stored = |s: &[(usize, Vec<u8>)], i: usize| s.iter().any(|(j, _)| *j == i);

    let ex = cb.exists(proto::ExistsRequest { keys: keys_of(&read) }).await;
    let ex = ex.unwrap_or_else(|s| panic!("Exists of 4096 1 KiB keys through a follower: {s:?}")).into_inner();
    let want: Vec<bool> = (0..4096).map(|i| is_stored(&read_stored, i)).collect();
    assert!(ex.exists == want, "Exists through b: wrong answers");

    let look = proto::LookupRequest { keys: keys_of(&read), ..Default::default() };
    let rep = cb.lookup_and_lock(look).await;
    let rep = rep.unwrap_or_else(|s| panic!("LookupAndLock of 4096 1 KiB keys through a follower: {s:?}")).into_inner();
    assert_eq!(rep.results.len(), 4096);
    let mut hits = vec![];
    for (i, r) in rep.results.iter().enumerate() {
        assert_eq!(r.found, is_stored(&read_stored, i), "key #{i}: {r:?}");
        if let Some((_, v)) = read_stored.iter().find(|(j, _)| *j == i) {
            let l = r.location.as_ref().unwrap();
            assert_eq!(&mb.read(l), v, "key #{i} through b");
            assert_eq!(mb.version(l), l.version, "key #{i}");
            hits.push(read[i].as_str());
        }
    }
    assert!(unlock(&mut cb, &hits).await.iter().all(|s| *s == OK));

    let d = cb.delete(proto::DeleteRequest { keys: keys_of(&del) }).await;
    let d = d.unwrap_or_else(|s| panic!("Delete of 4096 1 KiB keys through a follower: {s:?}")).into_inner();
    let codes: Vec<u32> = d.statuses.iter().map(|s| s.code).collect();
    let want: Vec<u32> = (0..4096).map(|i| if is_stored(&del_stored, i) { OK } else { NOT_FOUND }).collect();
    assert!(codes == want, "Delete through b: per-key codes {:?}", codes.iter().filter(|c| **c != NOT_FOUND).count());
    let gone: Vec<&str> = del_stored.iter().map(|(i, _)| del[*i].as_str()).collect();
    assert_eq!(exists(&mut ca, &gone).await, vec![false; gone.len()], "deleted through b, seen on a");
}

/// Defect 9: four clients each sending 3000-key calls (1 KiB keys) at once
/// through one follower: every call succeeds, with the right answers (the
/// follower must never coalesce them into a batch the primary refuses).
#[tokio::test(flavor = "multi_thread")]
async fn four_clients_sending_3000_key_calls_at_once_through_one_follower_all_succeed() {
    let dir = tempfile::tempdir().unwrap();
    let cl = cluster(dir.path(), "16MiB");
    let mut cb = cl.b.client().await;
    let mut mb = PoolMap::open(&mut cb).await;
    let sets: Vec<Vec<String>> = (0..4).map(|s| (0..3000).map(|i| kib_key(&format!("s{s}"), i)).collect()).collect();
    let mut stored = vec![];
    for set in &sets {
        stored.push(store_some(&mut cb, &mut mb, set, 500).await);
    }
    let mut clients = vec![];
    for _ in 0..4 {
        clients.push(cl.b.client().await);
    }
    let stored = Arc::new(stored);
    let sets = Arc::new(sets);
    // Several rounds of each kind of call, all four clients at once.
    for round in 0..3 {
        for kind in ["exists", "lookup"] {
            let barrier = Arc::new(tokio::sync::Barrier::new(4));
            let mut tasks = vec![];
            for (s, mut c) in clients.drain(..).enumerate() {
                let (barrier, sets, stored) = (barrier.clone(), sets.clone(), stored.clone());
                let m = PoolMap::open(&mut c).await;
                tasks.push(tokio::spawn(async move {
                    let keys = keys_of(&sets[s]);
                    let want: Vec<bool> = (0..3000).map(|i| stored[s].iter().any(|(j, _)| *j == i)).collect();
                    barrier.wait().await;
                    if kind == "exists" {
                        let r = c.exists(proto::ExistsRequest { keys }).await;
                        let r = r.unwrap_or_else(|e| panic!("round {round}, client {s}: Exists of 3000 keys: {e:?}"));
                        assert!(r.into_inner().exists == want, "round {round}, client {s}: wrong Exists answers");
                    } else {
                        let r = c.lookup_and_lock(proto::LookupRequest { keys, ..Default::default() }).await;
                        let r = r.unwrap_or_else(|e| panic!("round {round}, client {s}: LookupAndLock: {e:?}"));
                        let mut hits = vec![];
                        for (i, res) in r.into_inner().results.iter().enumerate() {
                            assert_eq!(res.found, want[i], "round {round}, client {s}, key #{i}");
                            if let Some((_, v)) = stored[s].iter().find(|(j, _)| *j == i) {
                                assert_eq!(&m.read(res.location.as_ref().unwrap()), v, "client {s}, key #{i}");
                                hits.push(sets[s][i].as_str());
                            }
                        }
                        assert!(unlock(&mut c, &hits).await.iter().all(|x| *x == OK));
                    }
                    c
                }));
            }
            for t in tasks {
                clients.push(t.await.unwrap());
            }
        }
    }
}
