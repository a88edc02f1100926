//! Defect 8: two followers with one name; the second is refused and the
//! first keeps serving.
use cxlkv::peer_proto::peer_client::PeerClient;

use super::*;

/// Store one key (reserve, write, commit); any failure, of the whole call
/// or of the item, as a message.
async fn try_store(c: &mut Client, m: &mut PoolMap, k: &str, v: &[u8]) -> Result<(), String> {
    let req = proto::ReserveRequest {
        tenant: "t".into(),
        items: vec![proto::ReserveItem { key: key(k), size: v.len() as u64, ..Default::default() }],
        ..Default::default()
    };
    let r = c.reserve(req).await.map_err(|s| format!("reserve: {s:?}"))?.into_inner().reservations.remove(0);
    if status_code(&r.status) != OK {
        return Err(format!("reserve: {:?}", r.status));
    }
    m.write(r.location.as_ref().unwrap(), v);
    let cr =
        c.commit(proto::CommitRequest { reservation_ids: vec![r.reservation_id], crc32: vec![], keys: vec![] }).await;
    let s = cr.map_err(|s| format!("commit: {s:?}"))?.into_inner().statuses.remove(0);
    if s.code != OK {
        return Err(format!("commit: {s:?}"));
    }
    Ok(())
}

/// Defect 8: a second follower started with the `--node-name` of a live one
/// is refused (it never becomes ready; its log names the reason: the name
/// is in use by a live node); the first keeps serving without rejoining
/// and every acknowledged key stays readable with its own bytes.
#[tokio::test(flavor = "multi_thread")]
async fn a_second_follower_with_a_live_nodes_name_is_refused_and_the_first_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let cl = cluster(dir.path(), "16MiB");
    let (mut ca, mut cb, mut cc) = (cl.a.client().await, cl.b.client().await, cl.c.client().await);
    let mut mb = PoolMap::open(&mut cb).await;
    let mc = PoolMap::open(&mut cc).await;
    let nb = pool_info(&mut cb).await.node_id;
    let mut stored: Vec<(String, Vec<u8>)> = vec![];
    for i in 0..10u64 {
        let (k, v) = (format!("pre{i}"), pattern(800 + i, 30_000));
        assert_eq!(store(&mut cb, &mut mb, "t", &[(&k, v.clone())]).await, [OK], "{k}");
        stored.push((k, v));
    }

    // b2 claims b's name while b is alive.
    let b2 = spawn_node(dir.path(), "b2", "b", &cl.peer, "16MiB", &[]);
    let t = Instant::now();
    let mut i = 0u64;
    while t.elapsed() < Duration::from_secs(3) {
        assert!(!ready(&b2.socket), "a second follower named \"b\" came up while b is alive:\n{}", b2.logs());
        // b keeps storing; each store is read back through c.
        let (k, v) = (format!("during{i}"), pattern(900 + i, 30_000));
        let stored_by_b = try_store(&mut cb, &mut mb, &k, &v).await;
        assert_eq!(stored_by_b, Ok(()), "{k}: b stopped serving while b2 tried to join with its name:\n{}", b2.logs());
        let hit = lookup(&mut cc, &[&k]).await.remove(0).unwrap_or_else(|| panic!("{k} acknowledged, not found on c"));
        assert_eq!(mc.read(&hit), v, "{k} through c");
        unlock(&mut cc, &[&k]).await;
        stored.push((k, v));
        i += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!ready(&b2.socket), "a second follower named \"b\" came up while b is alive:\n{}", b2.logs());
    // The primary's refusal of the name, as b2 got it.
    let uuid = pool_info(&mut ca).await.pool_uuid;
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", cl.peer)).unwrap().connect().await.unwrap();
    let mut peer = PeerClient::with_interceptor(ch, |mut r: tonic::Request<()>| {
        r.metadata_mut().insert("x-cxlkv-epoch", tonic::metadata::MetadataValue::from_static("0"));
        Ok(r)
    });
    let join = join_req("b", 3, &uuid);
    let refusal = peer.join(join).await.expect_err("a join with a live node's name");
    let reason = refusal.message().to_owned();
    eventually(
        &format!("b2's log names the reason: the name is in use by a live node ({reason:?})"),
        Duration::from_secs(5),
        async || {
            let log = b2.logs();
            log.contains(&reason) || log.to_lowercase().contains("in use")
        },
    )
    .await;

    // b never had to join again and kept its id; the primary never buried it.
    assert!(!cl.b.logs().contains("joined the primary again"), "b rejoined:\n{}", cl.b.logs());
    assert!(!cl.a.logs().contains("node restarted"), "the primary replaced b:\n{}", cl.a.logs());
    assert_eq!(pool_info(&mut cb).await.node_id, nb);
    let nodes = stats(&mut ca).await.cluster_nodes;
    assert!(nodes.iter().any(|n| n.name == "b" && n.node == nb && n.alive), "{nodes:?}");
    // Every acknowledged key, through every node, with its own bytes.
    let ma = PoolMap::open(&mut ca).await;
    for (via, c, m) in [("a", &mut ca, &ma), ("b", &mut cb, &mb), ("c", &mut cc, &mc)] {
        let found = check_hits(c, m, &stored, via).await;
        assert_eq!(found.len(), stored.len(), "acknowledged keys unreadable through {via}");
        for (k, v) in stored.iter().take(3) {
            assert_eq!(inline_get(c, k).await.as_ref(), Some(v), "{k} inline through {via}");
        }
    }
}
