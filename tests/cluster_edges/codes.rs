//! Defect 11: Unlock, Commit and Abort answer the same codes through every
//! node; a flipped owner word naming no node is repaired; a hold whose
//! give-back was lost is given back.
use std::os::unix::fs::FileExt;

use super::*;

/// Defect 11: Unlock of a key nobody stored is NOT_FOUND through the
/// primary and through a follower (holds on, the default).
#[tokio::test(flavor = "multi_thread")]
async fn unlock_of_an_unknown_key_is_not_found_through_the_primary_and_through_a_follower() {
    let dir = tempfile::tempdir().unwrap();
    let cl = cluster(dir.path(), "16MiB");
    let (mut ca, mut cb, mut cc) = (cl.a.client().await, cl.b.client().await, cl.c.client().await);
    // A stored key read and unlocked through b works as before (b holds it).
    let mut mc = PoolMap::open(&mut cc).await;
    let mb = PoolMap::open(&mut cb).await;
    let v = pattern(33, 10_000);
    assert_eq!(store(&mut cc, &mut mc, "t", &[("known", v.clone())]).await, [OK]);
    let hit = lookup(&mut cb, &["known"]).await.remove(0).expect("known is a hit through b");
    assert_eq!(mb.read(&hit), v);
    assert_eq!(unlock(&mut cb, &["known"]).await, [OK]);

    let got = [
        ("primary", unlock(&mut ca, &["never-stored"]).await),
        ("follower b", unlock(&mut cb, &["never-stored"]).await),
        ("follower c", unlock(&mut cc, &["never-stored", "nor-this"]).await),
    ];
    let want = [("primary", vec![NOT_FOUND]), ("follower b", vec![NOT_FOUND]), ("follower c", vec![NOT_FOUND; 2])];
    assert_eq!(got, want, "Unlock of an unknown key (5 = NOT_FOUND, 9 = FAILED_PRECONDITION)");
}

/// Defect 11: Commit and Abort of another node's reservation answer the
/// same code, NOT_FOUND, through the primary and through a follower; the
/// owner then commits it as usual.
#[tokio::test(flavor = "multi_thread")]
async fn commit_and_abort_of_another_nodes_reservation_are_not_found_through_either_node() {
    let dir = tempfile::tempdir().unwrap();
    let cl = cluster(dir.path(), "16MiB");
    let (mut ca, mut cb, mut cc) = (cl.a.client().await, cl.b.client().await, cl.c.client().await);
    let (mut ma, mut mb, mc) =
        (PoolMap::open(&mut ca).await, PoolMap::open(&mut cb).await, PoolMap::open(&mut cc).await);
    let reserve = async |c: &mut Client, k: &str| {
        let req = proto::ReserveRequest {
            tenant: "t".into(),
            items: vec![proto::ReserveItem { key: key(k), size: 5000, ..Default::default() }],
            ..Default::default()
        };
        let r = c.reserve(req).await.unwrap().into_inner().reservations.remove(0);
        assert_eq!(status_code(&r.status), OK, "reserve {k}");
        (r.reservation_id, r.location.unwrap())
    };
    let (id_b, loc_b) = reserve(&mut cb, "kb").await;
    let (id_a, loc_a) = reserve(&mut ca, "ka").await;
    let commit = async |c: &mut Client, id: u64| {
        let r = c.commit(proto::CommitRequest { reservation_ids: vec![id], crc32: vec![], keys: vec![] }).await;
        r.unwrap().into_inner().statuses[0].code
    };
    let abort = async |c: &mut Client, id: u64| {
        c.abort(proto::AbortRequest { reservation_ids: vec![id] }).await.unwrap().into_inner().statuses[0].code
    };
    let got = vec![
        ("commit of b's through c", commit(&mut cc, id_b).await),
        ("abort of b's through c", abort(&mut cc, id_b).await),
        ("commit of b's through the primary", commit(&mut ca, id_b).await),
        ("abort of b's through the primary", abort(&mut ca, id_b).await),
        ("commit of the primary's through b", commit(&mut cb, id_a).await),
        ("abort of the primary's through b", abort(&mut cb, id_a).await),
    ];
    let want: Vec<(&str, u32)> = got.iter().map(|(w, _)| (*w, NOT_FOUND)).collect();
    assert_eq!(got, want, "another node's reservation (5 = NOT_FOUND, 7 = PERMISSION_DENIED)");

    // Nothing was taken from the owners: they write and commit as usual.
    let (vb, va) = (pattern(41, 5000), pattern(42, 5000));
    mb.write(&loc_b, &vb);
    ma.write(&loc_a, &va);
    assert_eq!(commit(&mut cb, id_b).await, OK);
    assert_eq!(commit(&mut ca, id_a).await, OK);
    let found = check_hits(&mut cc, &mc, &[("kb".into(), vb.clone()), ("ka".into(), va.clone())], "c").await;
    assert_eq!(found, ["kb", "ka"]);
    assert_eq!(inline_get(&mut cc, "kb").await, Some(vb));
}

/// Defect 11: one bit flipped in a region-table owner word so that it names
/// a node that does not exist: the primary notices within a few seconds,
/// the region is free (or owned by a live node) again in Stats, stores
/// through every node keep working, and whatever is found has its bytes.
#[tokio::test(flavor = "multi_thread")]
async fn a_flipped_owner_word_naming_no_node_is_noticed_and_the_region_recovered() {
    let dir = tempfile::tempdir().unwrap();
    let cl = cluster(dir.path(), "16MiB");
    let (mut ca, mut cb, mut cc) = (cl.a.client().await, cl.b.client().await, cl.c.client().await);
    let mut mc = PoolMap::open(&mut cc).await;
    let nc = pool_info(&mut cc).await.node_id;
    let old: Vec<(String, Vec<u8>)> = (0..4u64).map(|i| (format!("old{i}"), pattern(60 + i, 100_000))).collect();
    for (k, v) in &old {
        assert_eq!(store(&mut cc, &mut mc, "t", &[(k, v.clone())]).await, [OK], "{k}");
    }
    let hit = lookup(&mut cc, &["old0"]).await.remove(0).unwrap();
    unlock(&mut cc, &["old0"]).await;
    let s = stats(&mut ca).await;
    let live: Vec<u32> = s.cluster_nodes.iter().filter(|n| n.alive).map(|n| n.node).collect();
    assert_eq!(live.len(), 3, "{:?}", s.cluster_nodes);
    let r = s.regions.iter().find(|r| r.region == hit.region).unwrap();
    assert_eq!((r.state.as_str(), r.owner_node), ("owned", nc), "old0 is in a region of c");

    // Flip one bit of the owner's id: it now names a node that does not exist.
    let bit = (4..31).map(|b| 1u64 << b).find(|b| !live.contains(&(nc ^ *b as u32))).unwrap();
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&cl.a.pool).unwrap();
    let at = 4096 + 32 * hit.region as u64;
    let mut w = [0u8; 8];
    f.read_exact_at(&mut w, at).unwrap();
    assert_eq!(u64::from_le_bytes(w), (1 << 32) | nc as u64, "the owner word of region {}", hit.region);
    f.write_all_at(&((1u64 << 32) | (nc as u64 ^ bit)).to_le_bytes(), at).unwrap();
    f.sync_data().unwrap();
    let ghost = nc ^ bit as u32;
    let region = hit.region;
    assert_eq!(
        stats(&mut ca).await.regions.iter().find(|r| r.region == region).unwrap().owner_node,
        ghost,
        "the primary reads the flipped word"
    );

    eventually(
        &format!("region {region}, flipped to node {ghost} (no such node), is free or a live node's again"),
        Duration::from_secs(10),
        async || {
            let r = stats(&mut ca).await.regions.into_iter().find(|r| r.region == region).unwrap();
            r.state == "free" || live.contains(&r.owner_node)
        },
    )
    .await;

    // Stores through every node keep working; each is read through b.
    let mut ma = PoolMap::open(&mut ca).await;
    let mut mb = PoolMap::open(&mut cb).await;
    let mut reader = cl.b.client().await;
    let mr = PoolMap::open(&mut reader).await;
    for (name, c, m) in [("a", &mut ca, &mut ma), ("b", &mut cb, &mut mb), ("c", &mut cc, &mut mc)] {
        let items: Vec<(String, Vec<u8>)> =
            (0..3u64).map(|i| (format!("after-{name}-{i}"), pattern(70 + i, 100_000))).collect();
        let refs: Vec<(&str, Vec<u8>)> = items.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        let codes = store(c, m, "t", &refs).await;
        assert_eq!(codes, [OK; 3], "a store through {name} after the owner word of region {region} was repaired");
        let found = check_hits(&mut reader, &mr, &items, "b").await;
        assert_eq!(found.len(), 3, "{name}'s new keys through b");
    }
    // c's old keys may be lost with the region; any that is found is intact.
    check_hits(&mut ca, &ma, &old, "a").await;
}

/// A follower whose give-back of an idle hold does not reach the primary
/// (the primary stopped past the follower's lease, so the follower refuses
/// every call meanwhile) sends it again once the primary answers: the key
/// is unlocked at the primary within a few seconds, not when the hold's own
/// lifetime (the client's 60 s lock TTL and more, for an InlineGet) runs out.
#[tokio::test(flavor = "multi_thread")]
async fn a_hold_whose_give_back_did_not_arrive_is_given_back_once_the_primary_answers() {
    let dir = tempfile::tempdir().unwrap();
    let cl = cluster(dir.path(), "16MiB");
    let (mut a, mut c) = (cl.a.client().await, cl.c.client().await);
    let mut mc = PoolMap::open(&mut c).await;
    let data = pattern(77, 100_000);
    assert_eq!(store(&mut c, &mut mc, "t", &[("h", data.clone())]).await, vec![OK]);
    // An InlineGet through c: c takes a hold on the key (60 s lock TTL).
    assert_eq!(inline_get(&mut c, "h").await.as_deref(), Some(&data[..]));
    // The primary stops past c's lease (1.5 s), short of declaring it dead
    // (3 s): c's give-back of the idle hold (after 500 ms) cannot be sent.
    sigstop(cl.a.pid());
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    sigcont(cl.a.pid());
    let t = Instant::now();
    eventually("the key is deletable again", Duration::from_secs(8), async || {
        let d = a.delete(proto::DeleteRequest { keys: vec![key("h")] }).await;
        matches!(d, Ok(r) if r.get_ref().statuses[0].code == OK)
    })
    .await;
    assert!(t.elapsed() < Duration::from_secs(8), "held for {:?} after the primary came back", t.elapsed());
    assert_eq!(exists(&mut c, &["h"]).await, vec![false]);
}
