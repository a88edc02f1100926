//! Durable sessions against the real binary: a session a client names
//! (`x-cxlkv-session`) keeps its locks when its connection closes and a new
//! connection naming it carries on, while a connection's own session's locks
//! go with it; a sidecar restarted under such locks removes nothing until
//! they could have lapsed (the pool's view-lock mark), and one restarted
//! without any removes at once; names are bounded per connection and per
//! sidecar, and malformed ones refused.
mod common;

use std::time::{Duration, Instant};

use common::*;
use cxlkv::client::{connect_uds, Client};
use cxlkv::proto;

const NAME: &str = "0123456789abcdef0123456789abcdef";
const FAILED_PRECONDITION: u32 = tonic::Code::FailedPrecondition as u32;

fn named<T>(msg: T, name: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut().insert("x-cxlkv-session", name.parse().unwrap());
    r
}

fn keys(ks: &[&str]) -> Vec<bytes::Bytes> {
    ks.iter().map(|k| key(k)).collect()
}

/// A lookup that locks `ks` for `ttl_ms` under session `name`: hits.
async fn lock_as(c: &mut Client, name: &str, ks: &[&str], ttl_ms: u32) -> Result<usize, tonic::Status> {
    let req = proto::LookupRequest { keys: keys(ks), lock_ttl_ms: ttl_ms, ..Default::default() };
    let rep = c.lookup_and_lock(named(req, name)).await?.into_inner();
    Ok(rep.results.iter().filter(|r| r.found).count())
}

async fn delete_codes(c: &mut Client, ks: &[&str]) -> Result<Vec<u32>, tonic::Status> {
    let rep = c.delete(proto::DeleteRequest { keys: keys(ks) }).await?.into_inner();
    Ok(rep.statuses.iter().map(|s| s.code).collect())
}

/// Wait until the sidecar has handled a closed connection (its release runs
/// on its own task): a bounded poll, not a sleep.
async fn settled(c: &mut Client, want_locked: u64) {
    eventually("the closed connection's locks settle", Duration::from_secs(5), async || {
        stats(c).await.locked_keys == want_locked
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_sessions_locks_outlive_its_connection_and_a_new_connection_carries_them_on() {
    let (_dir, s, mut c, mut m) = one_sidecar(&[]).await;
    store(&mut c, &mut m, "t", &[("durable", pattern(1, 1000)), ("plain", pattern(2, 1000))]).await;
    {
        let mut a = s.client().await;
        assert_eq!(lock_as(&mut a, NAME, &["durable"], 60_000).await.unwrap(), 1);
        let mut p = s.client().await;
        assert_eq!(lookup(&mut p, &["plain"]).await.iter().flatten().count(), 1);
        assert_eq!(stats(&mut c).await.locked_keys, 2);
    } // both connections close
    settled(&mut c, 1).await;
    assert_eq!(delete_codes(&mut c, &["durable"]).await.unwrap(), vec![FAILED_PRECONDITION]);
    assert_eq!(delete_codes(&mut c, &["plain"]).await.unwrap(), vec![0], "a connection's own locks go with it");
    // A new connection naming the session unlocks the lock it took before.
    let mut b = s.client().await;
    let rep = b.unlock(named(proto::UnlockRequest { keys: keys(&["durable"]) }, NAME)).await.unwrap().into_inner();
    assert_eq!(rep.statuses[0].code, 0);
    assert_eq!(delete_codes(&mut c, &["durable"]).await.unwrap(), vec![0]);
    // Without the name it is another session: its unlock releases nothing.
    store(&mut c, &mut m, "t", &[("again", pattern(3, 1000))]).await;
    assert_eq!(lock_as(&mut b, NAME, &["again"], 60_000).await.unwrap(), 1);
    let mut other = s.client().await;
    assert_eq!(unlock(&mut other, &["again"]).await, vec![tonic::Code::PermissionDenied as u32]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_removes_nothing_until_view_locks_could_have_lapsed() {
    let (_dir, mut s, mut c, mut m) = one_sidecar(&[]).await;
    store(&mut c, &mut m, "t", &[("viewed", pattern(4, 1000)), ("other", pattern(5, 1000))]).await;
    let mut a = s.client().await;
    let locked_at = Instant::now();
    assert_eq!(lock_as(&mut a, NAME, &["viewed"], 3_000).await.unwrap(), 1);
    s.kill9();
    s.spawn(&[]);
    let mut c = s.client().await;
    // Nothing committed goes while the lock could still be read under: the
    // key it covered, nor any other (the new instance knows no locks).
    let refused = c.delete(proto::DeleteRequest { keys: keys(&["other"]) }).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(refused.message().contains("started moments ago"), "{refused:?}");
    eventually("the grace ends", Duration::from_secs(10), async || delete_codes(&mut c, &["other"]).await.is_ok())
        .await;
    // Not before the lock's TTL (3 s) from its grant: 1 s of step is allowed.
    assert!(locked_at.elapsed() >= Duration::from_millis(3_000), "{:?}", locked_at.elapsed());
    assert_eq!(delete_codes(&mut c, &["viewed"]).await.unwrap(), vec![0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_after_connection_locks_only_removes_at_once() {
    let (_dir, mut s, mut c, mut m) = one_sidecar(&[]).await;
    store(&mut c, &mut m, "t", &[("read", pattern(6, 1000))]).await;
    assert_eq!(lookup(&mut c, &["read"]).await.iter().flatten().count(), 1);
    s.kill9();
    s.spawn(&[]);
    let mut c = s.client().await;
    assert_eq!(delete_codes(&mut c, &["read"]).await.unwrap(), vec![0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_sessions_are_bounded_per_connection_and_per_sidecar_and_malformed_names_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s = Sidecar::with_config(dir.path(), "a", "[server]\nmax_sessions = 10\n", &[]);
    let mut c = s.client().await;
    let mut m = PoolMap::open(&mut c).await;
    store(&mut c, &mut m, "t", &[("k", pattern(7, 100))]).await;
    let name = |i: usize| format!("{i:032x}");
    let mut one = s.client().await;
    for i in 0..8 {
        assert_eq!(lock_as(&mut one, &name(i), &["k"], 60_000).await.unwrap(), 1);
    }
    let ninth = lock_as(&mut one, &name(8), &["k"], 60_000).await.unwrap_err();
    assert_eq!(ninth.code(), tonic::Code::ResourceExhausted, "{ninth:?}");
    let mut two = s.client().await;
    for i in 8..10 {
        assert_eq!(lock_as(&mut two, &name(i), &["k"], 60_000).await.unwrap(), 1);
    }
    let full = lock_as(&mut two, &name(10), &["k"], 60_000).await.unwrap_err();
    assert_eq!(full.code(), tonic::Code::ResourceExhausted, "{full:?}");
    for bad in ["", "0123", "0123456789abcdef0123456789abcdeg"] {
        let e = lock_as(&mut two, bad, &["k"], 60_000).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad:?}: {e:?}");
    }
    // Refusals change nothing: the ten sessions hold their ten locks.
    let rep = stats(&mut c).await;
    assert_eq!(rep.locked_keys, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_named_sessions_cost_the_sidecar_little_memory() {
    let (_dir, s, _c, _m) = one_sidecar(&[]).await;
    let pid = s.child.as_ref().unwrap().id();
    let rss = || {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap().to_string();
        line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
    };
    let lookup_as = async |client: &mut Client, name: Option<String>| {
        let req = proto::LookupRequest { keys: keys(&["x"]), ..Default::default() };
        match name {
            Some(n) => client.lookup_and_lock(named(req, &n)).await.unwrap(),
            None => client.lookup_and_lock(req).await.unwrap(),
        };
    };
    // 125 connections, each used once without a name: the baseline.
    let mut conns = vec![];
    for _ in 0..125 {
        let mut client = connect_uds(&s.socket).await.unwrap();
        lookup_as(&mut client, None).await;
        conns.push(client);
    }
    let before = rss();
    for (c, client) in conns.iter_mut().enumerate() {
        for i in 0..8 {
            lookup_as(client, Some(format!("{:032x}", c * 8 + i))).await;
        }
    }
    // 1,000 names: a table row each (< 100 B) and an entry in their
    // connection's list; well under 1 MiB.
    let grew = rss().saturating_sub(before);
    assert!(grew < 1 << 20, "RSS grew {grew} bytes for 1,000 named sessions");
}
