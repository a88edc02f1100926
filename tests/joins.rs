//! Joins that reach the primary at once. A follower whose joins queue
//! behind a flooded peer port, or two sidecars started with one node name,
//! deliver several joins of one name together; the primary answers them
//! one at a time, so one instance holds the name and the node table
//! records it once.
use cxlkv::cluster::follower;
use cxlkv::config::ClusterConfig;
use cxlkv::error::ErrorKind;

mod common;
use common::loopback;

/// Sixteen joins of one node name at once, each a different instance: one
/// is let in, the others are refused as a name in use by a live node
/// (ALREADY_EXISTS); for forty names, each given an id of its own that the
/// node table records once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_joins_of_one_name_let_one_instance_in() {
    let cfg = ClusterConfig { node_name: "f".into(), primary: "p".into(), ..ClusterConfig::default() };
    let lb = loopback::primary(&cfg).await;
    let uuid = lb.pool.superblock().uuid_string();
    let mut ids = vec![];
    for round in 0..40 {
        let cfg = ClusterConfig { node_name: format!("f{round}"), ..cfg.clone() };
        let joins: Vec<_> = (1..=16u64)
            .map(|instance| {
                let (mut client, cfg, uuid) = (lb.client.clone(), cfg.clone(), uuid.clone());
                tokio::spawn(async move { follower::join(&mut client, &cfg, &uuid, instance, 10_000).await })
            })
            .collect();
        let mut let_in = vec![];
        for j in joins {
            match j.await.unwrap() {
                Ok((joined, _)) => let_in.push(joined.node.0),
                Err(e) => assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{}: {e}", cfg.node_name),
            }
        }
        assert_eq!(let_in.len(), 1, "{}: instances let in with ids {let_in:?}", cfg.node_name);
        ids.push(let_in[0]);
    }
    let table = lb.pool.nodes().unwrap();
    assert_eq!(table.len(), 41, "the primary and forty names: {table:?}");
    for (round, id) in ids.iter().enumerate() {
        assert!(table.contains(&(*id, format!("f{round}"))), "f{round} as {id}: {table:?}");
    }
}
