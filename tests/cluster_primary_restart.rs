//! Issue 33, defects 2, 3 and 10: what a primary restart (kill -9, then
//! the same arguments again) must not undo or hide.
//!
//! Three sidecar processes on one pool (a the primary, b and c followers).
//! A delete acknowledged before the crash stays deleted, and the newest
//! commit of a key is the one served after it; a follower's holds end with
//! the primary instance they were taken under; a consumer of the Removed
//! log whose cursor predates the restart is told so.
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use cxlkv::client::Client;
use cxlkv::proto;

const SETTLE: Duration = Duration::from_secs(20);

/// A node of a cluster whose config file holds `cfg`; returns it with the
/// arguments it was started with (to start it again).
fn node(dir: &Path, name: &str, peer: &str, cfg: &str) -> (Sidecar, Vec<String>) {
    let args = cluster_args(dir, name, peer, cfg, "16MiB");
    (Sidecar::start(dir, name, &strs(&args)), args)
}

/// kill -9 the primary and start it again with the same arguments.
fn crash_and_restart(a: &mut Sidecar, args: &[String]) {
    a.kill9();
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    a.spawn(&refs);
}

/// The primary's view of follower `name`: (alive, ms since its last heartbeat).
async fn follower(c: &mut Client, name: &str) -> Option<(bool, u64)> {
    stats(c).await.cluster_nodes.iter().find(|n| n.name == name).map(|n| (n.alive, n.silent_ms))
}

async fn joined(c: &mut Client, names: &[&str]) -> bool {
    for n in names {
        if !follower(c, n).await.is_some_and(|(alive, _)| alive) {
            return false;
        }
    }
    true
}

/// What a node's clients see as its instance (PoolInfo.instance_id).
async fn instance(c: &mut Client) -> u64 {
    c.pool_info(proto::PoolInfoRequest {}).await.unwrap().into_inner().instance_id
}

/// A follower is done rejoining a restarted primary once the instance its
/// clients see changed from `before`: it takes the new primary's node
/// instance first, then a new instance of its own. The primary lists it
/// alive a moment earlier (at the join, before the follower reconciled its
/// regions), while its forwarded calls still name its old node instance
/// and are refused ("join again").
async fn rejoined(c: &mut Client, before: u64) -> bool {
    c.pool_info(proto::PoolInfoRequest {}).await.is_ok_and(|r| r.into_inner().instance_id != before)
}

/// Wait until one of `name`'s heartbeats has just reached the primary: the
/// next one is a whole heartbeat period away.
async fn just_after_a_heartbeat_of(c: &mut Client, name: &str) {
    eventually("a heartbeat just arrived", SETTLE, async || {
        follower(c, name).await.is_some_and(|(alive, silent)| alive && silent < 60)
    })
    .await;
}

fn owned(items: &[(&str, Vec<u8>)]) -> Vec<(String, Vec<u8>)> {
    items.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}

/// Heartbeats 1 s apart: a free notice the primary queues for b just after
/// one of b's heartbeats reaches b no sooner than 1 s later.
const SLOW_BEATS: &str =
    "[cluster]\nheartbeat_ms = 1000\nlease_ms = 2000\ndead_after_ms = 3000\nforward_timeout_ms = 500\n";

/// Defect 2: v1 of `k` (and `gone`) stored through b, both deleted through
/// c (OK), v2 of `k` stored through c, the primary killed within a few ms
/// and started again: every node serves v2 of `k`, and `gone` is a miss
/// everywhere. b's v1 is its first commit, c's v2 comes after three of c's
/// own, so a rebuild that keeps the lowest per-node sequence would pick v1.
#[tokio::test(flavor = "multi_thread")]
async fn a_delete_acknowledged_before_a_primary_crash_stays_deleted_and_the_newest_commit_wins() {
    let dir = tempfile::tempdir().unwrap();
    let peer = format!("127.0.0.1:{}", free_port());
    let (mut a, a_args) = node(dir.path(), "a", &peer, SLOW_BEATS);
    let (b, _) = node(dir.path(), "b", &peer, SLOW_BEATS);
    let (c, _) = node(dir.path(), "c", &peer, SLOW_BEATS);
    let (mut ca, mut cb, mut cc) = (a.client().await, b.client().await, c.client().await);
    let mut m = PoolMap::open(&mut ca).await;
    eventually("b and c joined", SETTLE, async || joined(&mut ca, &["b", "c"]).await).await;

    let fillers: Vec<(&str, Vec<u8>)> =
        (0..3u64).map(|i| (["f0", "f1", "f2"][i as usize], pattern(10 + i, 5000))).collect();
    for f in &fillers {
        assert_eq!(store(&mut cc, &mut m, "t", std::slice::from_ref(f)).await, [OK]);
    }
    let (v1, gone_v1, v2) = (pattern(21, 70_000), pattern(22, 70_000), pattern(23, 90_000));
    assert_eq!(store(&mut cb, &mut m, "t", &[("k", v1.clone()), ("gone", gone_v1.clone())]).await, [OK, OK]);

    // A primary that just started may refuse deletes for a while (holds of
    // a previous instance); wait until it takes them, then delete just
    // after one of b's heartbeats.
    eventually("the primary accepts deletes", SETTLE, async || {
        cc.delete(proto::DeleteRequest { keys: vec![key("no-such-key")] }).await.is_ok()
    })
    .await;
    just_after_a_heartbeat_of(&mut ca, "b").await;
    let (ib, ic) = (instance(&mut cb).await, instance(&mut cc).await);
    let t = Instant::now();
    let d = cc.delete(proto::DeleteRequest { keys: vec![key("k"), key("gone")] }).await.expect("delete through c");
    let d = d.into_inner();
    assert!(d.statuses.iter().all(|s| s.code == OK), "{d:?}");
    let deleted = t.elapsed();
    assert_eq!(store(&mut cc, &mut m, "t", &[("k", v2.clone())]).await, [OK]);
    crash_and_restart(&mut a, &a_args);
    let killed = t.elapsed();

    let mut ca = a.client().await;
    eventually("b and c joined the restarted primary", SETTLE, async || joined(&mut ca, &["b", "c"]).await).await;
    eventually("b and c rejoined", SETTLE, async || rejoined(&mut cb, ib).await && rejoined(&mut cc, ic).await).await;
    let mut want = owned(&fillers);
    want.push(("k".into(), v2.clone()));
    let mut known = want.clone();
    known.extend([("k's deleted v1".into(), v1), ("gone (deleted)".into(), gone_v1)]);
    let mut wrong = misreads("a", &mut ca, &m, &want, &["gone"], &known).await;
    wrong.extend(misreads("b", &mut cb, &m, &want, &["gone"], &known).await);
    wrong.extend(misreads("c", &mut cc, &m, &want, &["gone"], &known).await);
    assert!(
        wrong.is_empty(),
        "delete acknowledged after {deleted:?}, v2 stored, primary killed {killed:?} after the delete began; \
         after its restart: {wrong:#?}"
    );
}

/// Heartbeats 1 s apart and holds kept for 30 s idle: after the primary's
/// crash b still holds `k` (and would answer from it) until it reaches the
/// restarted primary or its lease (2 s) lapses.
const HOLDS: &str = "[cluster]\nheartbeat_ms = 1000\nlease_ms = 2000\ndead_after_ms = 3000\nforward_timeout_ms = 500\n\
                     hold_idle_ms = 30000\n";

/// Defect 3: b holds `k` (a lookup and unlock through b), the primary is
/// killed and started again, `k` is deleted through it (retried until the
/// restarted primary accepts deletes) and stored again with new bytes.
/// From then on a lookup of `k` through b is a miss or the new object
/// (mapped read, version unchanged after the copy), never the old location.
#[tokio::test(flavor = "multi_thread")]
async fn a_followers_holds_end_with_the_primary_instance_they_were_taken_under() {
    let dir = tempfile::tempdir().unwrap();
    let peer = format!("127.0.0.1:{}", free_port());
    let (mut a, a_args) = node(dir.path(), "a", &peer, HOLDS);
    let (b, _) = node(dir.path(), "b", &peer, HOLDS);
    let (c, _) = node(dir.path(), "c", &peer, HOLDS);
    let (mut ca, mut cb, mut cc) = (a.client().await, b.client().await, c.client().await);
    let mut m = PoolMap::open(&mut ca).await;
    eventually("b and c joined", SETTLE, async || joined(&mut ca, &["b", "c"]).await).await;

    let (old, new) = (pattern(31, 80_000), pattern(32, 80_000));
    assert_eq!(store(&mut cc, &mut m, "t", &[("k", old.clone())]).await, [OK]);
    match mapped_get(&mut cb, &m, "k").await {
        Mapped::Bytes(got) => assert!(got == old, "k through b before the crash"),
        _ => panic!("k through b before the crash: not found"),
    }
    // b now holds k (lookup and unlock through b).

    just_after_a_heartbeat_of(&mut ca, "b").await;
    let t = Instant::now();
    crash_and_restart(&mut a, &a_args);
    let up = t.elapsed();
    let mut ca = a.client().await;
    let within = Duration::from_secs(2 + 6);
    let mut tries = 0;
    loop {
        tries += 1;
        match ca.delete(proto::DeleteRequest { keys: vec![key("k")] }).await {
            Ok(r) if r.get_ref().statuses[0].code == OK => break,
            Ok(r) => assert!(t.elapsed() < within, "delete of k through the restarted primary: {:?}", r.get_ref()),
            Err(s) => assert!(t.elapsed() < within, "delete of k through the restarted primary: {s:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let deleted = t.elapsed();
    assert_eq!(store(&mut ca, &mut m, "t", &[("k", new.clone())]).await, [OK]);
    let stored = t.elapsed();

    let known = vec![("k (old)".to_string(), old), ("k (new)".to_string(), new.clone())];
    let when = format!(
        "primary up {up:?} after the kill, k deleted after {tries} tries at {deleted:?} and stored again at {stored:?}"
    );
    let until = Instant::now() + Duration::from_millis(1500);
    let mut n = 0;
    while Instant::now() < until {
        let at = t.elapsed();
        match mapped_get(&mut cb, &m, "k").await {
            Mapped::Miss => {}
            Mapped::Bytes(got) if got == new => {}
            Mapped::Bytes(got) => {
                panic!("lookup {n} of k through b at {at:?}: found=true, {} ({when})", whose(&got, &known))
            }
            Mapped::Moved(l) => {
                panic!("lookup {n} of k through b at {at:?}: found=true at a location that is not k's any more {l:?} ({when})")
            }
        }
        match inline_get_result(&mut cb, "k").await {
            Ok(None) => {}
            Ok(Some(got)) if got == new => {}
            Ok(Some(got)) => panic!("InlineGet {n} of k through b at {at:?}: {} ({when})", whose(&got, &known)),
            // Discard what arrived: a miss.
            Err(s) if s.code() == tonic::Code::Aborted => {}
            Err(s) => panic!("InlineGet {n} of k through b at {at:?}: {s:?} ({when})"),
        }
        n += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // And b serves the new object once it is back with the new primary.
    eventually(
        "b serves the new k",
        SETTLE,
        async || matches!(mapped_get(&mut cb, &m, "k").await, Mapped::Bytes(g) if g == new),
    )
    .await;
    drop(cc);
}

/// Short timings (cluster.rs's).
const FAST: &str = "[cluster]\nheartbeat_ms = 100\nlease_ms = 600\ndead_after_ms = 1000\nforward_timeout_ms = 500\n";

/// Delete `keys` through `c`, retrying while the call fails as a whole (a
/// restarted primary may refuse deletes for a while); every key must be OK.
async fn delete_all(c: &mut Client, keys: &[String]) {
    let t = Instant::now();
    loop {
        match c.delete(proto::DeleteRequest { keys: keys.iter().map(|k| key(k)).collect() }).await {
            Ok(r) => {
                assert!(r.get_ref().statuses.iter().all(|s| s.code == OK), "{:?}", r.get_ref());
                return;
            }
            Err(s) => assert!(t.elapsed() < Duration::from_secs(10), "delete: {s:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn store_keys(c: &mut Client, m: &mut PoolMap, keys: &[String], seed: u64) {
    let items: Vec<(&str, Vec<u8>)> = keys.iter().map(|k| (k.as_str(), pattern(seed, 1000))).collect();
    assert!(store(c, m, "t", &items).await.iter().all(|c| *c == OK));
}

async fn removed(c: &mut Client, since: u64, max: u32) -> proto::RemovedReply {
    c.removed(proto::RemovedRequest { since, max }).await.unwrap().into_inner()
}

fn names(r: &proto::RemovedReply) -> Vec<String> {
    r.keys.iter().map(|k| String::from_utf8_lossy(&k.key).into_owned()).collect()
}

/// Defect 10: a consumer of the Removed log through follower b holds a
/// cursor from before the primary's restart (one at the end of the old log,
/// one in its middle); removals happen after the restart. Asked with either
/// cursor, b must tell it (truncated, or another instance_id), never answer
/// as if its cursor still meant what it did.
#[tokio::test(flavor = "multi_thread")]
async fn the_removed_log_through_a_follower_tells_a_consumer_whose_cursor_predates_a_primary_restart() {
    let dir = tempfile::tempdir().unwrap();
    let peer = format!("127.0.0.1:{}", free_port());
    let (mut a, a_args) = node(dir.path(), "a", &peer, FAST);
    let (b, _) = node(dir.path(), "b", &peer, FAST);
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    let mut m = PoolMap::open(&mut cb).await;
    eventually("b joined", SETTLE, async || joined(&mut ca, &["b"]).await).await;

    let before: Vec<String> = (0..20).map(|i| format!("r{i}")).collect();
    store_keys(&mut cb, &mut m, &before, 1).await;
    delete_all(&mut cb, &before).await;
    let early = removed(&mut cb, 0, 2).await;
    let all = removed(&mut cb, 0, 0).await;
    assert_eq!(names(&all), before, "the log through b before the restart");
    assert!(all.keys.iter().all(|k| k.reason == "deleted"));
    let (i0, cursors) =
        (all.instance_id, [("at the end of the old log", all.next), ("in the middle of the old log", early.next)]);

    let ib = instance(&mut cb).await;
    crash_and_restart(&mut a, &a_args);
    let mut ca = a.client().await;
    eventually("b joined the restarted primary", SETTLE, async || joined(&mut ca, &["b"]).await).await;
    eventually("b rejoined", SETTLE, async || rejoined(&mut cb, ib).await).await;
    let after: Vec<String> = (0..10).map(|i| format!("s{i}")).collect();
    store_keys(&mut cb, &mut m, &after, 2).await;
    delete_all(&mut cb, &after).await;

    let mut silent = vec![];
    for (what, since) in cursors {
        let r = removed(&mut cb, since, 0).await;
        if !r.truncated && r.instance_id == i0 {
            silent.push(format!(
                "Removed(since={since}, a cursor {what}): {} events {:?}, next {}, \
                 truncated=false, instance_id unchanged",
                r.keys.len(),
                names(&r),
                r.next
            ));
        }
    }
    assert!(silent.is_empty(), "through b, after the primary restarted and {after:?} were deleted: {silent:#?}");
    // Starting over, the consumer sees every removal since the restart.
    let r = removed(&mut cb, 0, 0).await;
    for k in &after {
        assert!(names(&r).contains(k), "{k} is not in the log through b: {:?}", names(&r));
    }
}
