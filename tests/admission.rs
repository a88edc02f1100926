//! Admission against the real binary: a declined store (mapped Reserve or
//! inline put) is a skipped store that reserves, places and writes nothing;
//! the next store of the key is admitted; exempt buffers are not judged;
//! followers follow their primary's decision whatever their own setting;
//! what admission remembers stays bounded under a stream of unique keys.
mod common;

use std::time::Duration;

use common::*;
use cxlkv::proto;

/// The status code of a declined store.
const NOT_ADMITTED: u32 = tonic::Code::Aborted as u32;
/// The fixed gate: it refuses keys not seen lately while the pool is full.
const GATE: &str = "[registry]\nadmission = \"second_touch\"\n";

/// Store one-page keys `fill-*` (nothing copied: their bytes are never
/// read) until the pool evicts: from then on it is full, and gated.
async fn fill(c: &mut cxlkv::client::Client) {
    for i in 0.. {
        let keys: Vec<String> = (0..16).map(|j| format!("fill-{}", 16 * i + j)).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let ids: Vec<u64> =
            reserve(c, &refs, 1000, false).await.reservations.iter().map(|x| x.reservation_id).collect();
        c.commit(proto::CommitRequest { reservation_ids: ids, crc32: vec![], keys: vec![] }).await.unwrap();
        if stats(c).await.evictions > 0 {
            return;
        }
    }
}

async fn reserve(c: &mut cxlkv::client::Client, keys: &[&str], size: u64, exempt: bool) -> proto::ReserveReply {
    let mut req = tonic::Request::new(proto::ReserveRequest {
        tenant: "t".into(),
        items: keys.iter().map(|k| proto::ReserveItem { key: key(k), size, ..Default::default() }).collect(),
        ..Default::default()
    });
    if exempt {
        req.metadata_mut().insert(cxlkv::wire::ADMISSION_HEADER, "exempt".parse().unwrap());
    }
    c.reserve(req).await.unwrap().into_inner()
}

fn codes(r: &proto::ReserveReply) -> Vec<u32> {
    r.reservations.iter().map(|x| x.status.as_ref().unwrap().code).collect()
}

/// Pages in use, keys being written and committed, as Stats says.
async fn footprint(c: &mut cxlkv::client::Client) -> (u64, u64, u64) {
    let s = stats(c).await;
    (s.pages_used, s.reserved, s.keys)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_declined_store_reserves_nothing_and_the_second_store_of_the_key_is_admitted() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = format!("127.0.0.1:{}", free_port());
    let s = Sidecar::with_config(dir.path(), "a", GATE, &["--metrics-addr", &metrics]);
    let mut c = s.client().await;
    let mut m = PoolMap::open(&mut c).await;
    // A pool with room admits everything, whatever the mode.
    assert_eq!(codes(&reserve(&mut c, &["early"], 1000, false).await), vec![OK]);
    fill(&mut c).await;
    let start = stats(&mut c).await.admission.unwrap();
    assert!(start.gating && start.refused == 0, "{start:?}");
    let before = footprint(&mut c).await;

    // Mapped: the first Reserve of each key is declined per item, nothing
    // placed or reserved, no location handed out.
    let r = reserve(&mut c, &["m1", "m2"], 100_000, false).await;
    assert_eq!(codes(&r), vec![NOT_ADMITTED; 2]);
    assert!(r.reservations.iter().all(|x| x.reservation_id == 0 && x.location.is_none()));
    assert!(r.reservations[0].status.as_ref().unwrap().message.starts_with("not admitted"));
    assert_eq!(footprint(&mut c).await, before, "nothing placed, reserved or committed");
    assert_eq!(exists(&mut c, &["m1"]).await, vec![false]);
    // The second store of a key is admitted, and is a hit with its bytes.
    let data = pattern(3, 100_000);
    assert_eq!(store(&mut c, &mut m, "t", &[("m1", data.clone())]).await, vec![OK]);
    let hit = lookup(&mut c, &["m1"]).await.remove(0).expect("stored");
    assert_eq!(m.read(&hit), data);

    // Inline: declined right after the header, none of the bytes written.
    let bytes = pattern(5, 150_000);
    let chunks = || bytes.chunks(64 << 10).map(<[u8]>::to_vec).collect();
    let before = footprint(&mut c).await;
    let rep = inline_put(&mut c, "i1", bytes.len() as u64, chunks()).await.unwrap();
    assert_eq!((rep.status.unwrap().code, rep.location), (NOT_ADMITTED, None));
    assert_eq!(footprint(&mut c).await, before);
    assert_eq!(inline_get(&mut c, "i1").await, None);
    let rep = inline_put(&mut c, "i1", bytes.len() as u64, chunks()).await.unwrap();
    assert_eq!(rep.status.unwrap().code, OK, "the second store is admitted");
    assert_eq!(inline_get(&mut c, "i1").await, Some(bytes.clone()));

    // Buffers under placeholder keys are exempt: reserved at the first ask.
    let r = reserve(&mut c, &["anon-1"], 10_000, true).await;
    assert_eq!(codes(&r), vec![OK]);

    // Visible: Stats, metrics, `cxlkv status`.
    let a = stats(&mut c).await.admission.expect("admission figures");
    assert_eq!((a.mode.as_str(), a.gating, a.refused, a.admitted - start.admitted), ("second_touch", true, 3, 2));
    let admitted = a.admitted;
    // The registry's figures reach /metrics at the next housekeeping tick.
    eventually("admission figures on /metrics", Duration::from_secs(5), async || {
        metric::<f64>(&metrics, "cxlkv_admissions_total{decision=\"refused\"}") == Some(3.0)
            && metric::<f64>(&metrics, "cxlkv_admissions_total{decision=\"admitted\"}") == Some(admitted as f64)
            && metric::<f64>(&metrics, "cxlkv_admission_gating{mode=\"second_touch\"}") == Some(1.0)
    })
    .await;
    assert_eq!(metric::<f64>(&metrics, "cxlkv_keys_total{op=\"reserve\",result=\"not_admitted\"}"), Some(2.0));
    assert_eq!(metric::<f64>(&metrics, "cxlkv_keys_total{op=\"inline_put\",result=\"not_admitted\"}"), Some(1.0));
    let out = run_cxlkv(["status", "--socket", s.socket.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    let want =
        format!("admission: second_touch (gating: keys not seen before are refused); {admitted} admitted, 3 refused");
    assert!(text.contains(&want), "{text}");
}

/// The default: every store of a sidecar with room is admitted (a store
/// once and a hit after it, as before admission).
#[tokio::test(flavor = "multi_thread")]
async fn by_default_a_sidecar_with_room_admits_every_store() {
    let (_dir, _s, mut c, mut m) = one_sidecar(&[]).await;
    let data = pattern(1, 70_000);
    assert_eq!(store(&mut c, &mut m, "t", &[("once", data.clone())]).await, vec![OK]);
    assert_eq!(m.read(&lookup(&mut c, &["once"]).await.remove(0).unwrap()), data);
    let a = stats(&mut c).await.admission.unwrap();
    assert_eq!((a.mode.as_str(), a.gating, a.refused), ("adaptive", false, 0));
}

/// The primary gates; a follower configured to admit everything follows
/// the primary: its first store of a key is declined (and the pages it
/// placed for it are given back), the next store of the key through any
/// node is admitted, pool-wide.
#[tokio::test(flavor = "multi_thread")]
async fn followers_follow_the_primary_s_decision() {
    let dir = tempfile::tempdir().unwrap();
    let timings = "[cluster]\nheartbeat_ms = 100\nlease_ms = 600\ndead_after_ms = 1000\nforward_timeout_ms = 500\n";
    let peer = format!("127.0.0.1:{}", free_port());
    let node = |name: &str, toml: String| {
        let args = cluster_args(dir.path(), name, &peer, &toml, "16MiB");
        Sidecar::start(dir.path(), name, &strs(&args))
    };
    // The primary owns one region: filling it makes the pool's registry
    // evict, and so gate.
    let a = node("a", format!("{timings}{GATE}max_regions_per_instance = 1\n"));
    let b = node("b", format!("{timings}[registry]\nadmission = \"off\"\n"));
    let c = node("c", timings.to_string());
    let (mut ca, mut cb, mut cc) = (a.client().await, b.client().await, c.client().await);
    let mut mc = PoolMap::open(&mut cc).await;
    fill(&mut ca).await;
    let start = stats(&mut ca).await.admission.unwrap();
    let free = stats(&mut cb).await.pages_free;

    let r = reserve(&mut cb, &["f1", "f2"], 100_000, false).await;
    assert_eq!(codes(&r), vec![NOT_ADMITTED; 2], "the primary declined the follower's stores");
    let (s_b, s_a) = (stats(&mut cb).await, stats(&mut ca).await);
    assert_eq!((s_b.pages_free, s_a.reserved), (free, 0), "the follower gave the placed pages back");
    let rep = inline_put(&mut cb, "f3", 1000, vec![vec![7; 1000]]).await.unwrap();
    assert_eq!(rep.status.unwrap().code, NOT_ADMITTED, "an inline put through the follower too");
    // Pool-wide: the key refused through b is admitted through c.
    let data = pattern(9, 100_000);
    assert_eq!(store(&mut cc, &mut mc, "t", &[("f1", data.clone())]).await, vec![OK]);
    assert_eq!(mc.read(&lookup(&mut cb, &["f1"]).await.remove(0).unwrap()), data);
    let rep = inline_put(&mut cb, "f3", 1000, vec![vec![7; 1000]]).await.unwrap();
    assert_eq!(rep.status.unwrap().code, OK);
    // Every node shows the primary's figures.
    for cl in [&mut ca, &mut cb, &mut cc] {
        let adm = stats(cl).await.admission.unwrap();
        assert_eq!((adm.mode.as_str(), adm.refused, adm.admitted - start.admitted), ("second_touch", 3, 2));
    }
}

/// Resident memory of `pid` in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS");
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// 100 000 stores of unique 300-byte keys, 40 a call, into a full pool
/// whose eight hot keys are read between calls (the default, adaptive
/// admission, gates once it has the evidence): the sidecar's memory grows
/// by less than 8 MiB, where keeping the keys would take 30 MB. What admission holds is its history (8 slots of 2 B per
/// entry, at least 1 024 slots: 2 KiB here, 16 MiB at most) and its
/// simulations (under 1 MiB).
#[tokio::test(flavor = "multi_thread")]
async fn what_admission_remembers_stays_bounded_under_a_stream_of_unique_keys() {
    let (_dir, s, mut c, mut m) = one_sidecar(&[]).await;
    let pid = s.child.as_ref().unwrap().id();
    let hot: Vec<String> = (0..8).map(|i| format!("hot-{i}")).collect();
    let hot: Vec<&str> = hot.iter().map(String::as_str).collect();
    // As large as the stream's chunks (`gd` evicts smaller chunks first),
    // which with their 300-byte names fit a 64 KiB page each.
    const CHUNK: u64 = 60 << 10;
    for k in &hot {
        assert_eq!(store(&mut c, &mut m, "t", &[(k, pattern(1, CHUNK as usize))]).await, vec![OK]);
    }
    let name = |i: u64| format!("{i:0>300}");
    let mut next = 0u64;
    let mut stream = async |c: &mut cxlkv::client::Client, n: u64| {
        for _ in 0..n / 40 {
            let found = lookup(c, &hot).await;
            let held: Vec<&str> = hot.iter().zip(&found).filter(|(_, f)| f.is_some()).map(|(k, _)| *k).collect();
            unlock(c, &held).await;
            let keys: Vec<String> = (next..next + 40).map(name).collect();
            next += 40;
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let r = reserve(c, &refs, CHUNK, false).await;
            let ids: Vec<u64> =
                r.reservations.iter().filter(|x| x.reservation_id != 0).map(|x| x.reservation_id).collect();
            c.commit(proto::CommitRequest { reservation_ids: ids, crc32: vec![], keys: vec![] }).await.unwrap();
        }
    };
    // Fill the pool (evictions from there on) and let admission settle.
    stream(&mut c, 20_000).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (before, a) = (rss(pid), stats(&mut c).await.admission.unwrap());
    assert!(a.gating, "one-hit keys into a full pool that is read: {a:?}");
    stream(&mut c, 100_000).await;
    let (after, a) = (rss(pid), stats(&mut c).await.admission.unwrap());
    assert!(a.refused > 95_000, "{a:?}");
    assert_eq!(a.history_bytes, 2048, "1 024 slots: the pool holds 128 one-page keys");
    assert!(a.shadow_bytes < 1 << 20, "{a:?}");
    assert!(after < before + 8 * MIB, "resident memory grew {} KiB", (after - before) / 1024);
}
