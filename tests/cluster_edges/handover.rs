//! Defect 4: a phase-3 handover is fenced by the region's generation;
//! reclaim churn never fails a Reserve as a whole call and leaves every
//! node able to store.
use std::sync::{Arc, Mutex};

use super::*;

/// Four 64 KiB pages: eight fill a 2 MiB region.
const OBJ: usize = 256 << 10;
/// Objects per churn store: more than one region's worth, so a node can
/// place them only by taking a region from another node (phase 3).
const CHURN_BATCH: usize = 10;

/// A Reserve of one `OBJ`-sized object per key, for tenant "t".
fn reserve_objects<'a>(keys: impl Iterator<Item = &'a str>) -> proto::ReserveRequest {
    let items = keys.map(|k| proto::ReserveItem { key: key(k), size: OBJ as u64, ..Default::default() }).collect();
    proto::ReserveRequest { tenant: "t".into(), items, ..Default::default() }
}

/// The bytes of churn object `seed`: cheap to build in a debug build, and
/// every 4 KiB block names its object and its place in it.
fn obj(seed: u64) -> Vec<u8> {
    let block = pattern(seed, 4096);
    let mut out = Vec::with_capacity(OBJ);
    for i in 0..(OBJ / 4096) as u64 {
        let start = out.len();
        out.extend_from_slice(&block);
        out[start..start + 8].copy_from_slice(&seed.to_le_bytes());
        out[start + 8..start + 16].copy_from_slice(&i.to_le_bytes());
    }
    out
}

#[derive(Default, Debug)]
struct ChurnLog {
    stores: u64,
    items_ok: u64,
    items_exhausted: u64,
    /// Reserves that failed as a whole call with RESOURCE_EXHAUSTED.
    whole_call_exhausted: Vec<String>,
    /// Other whole-call failures (reported, not asserted: a forwarded call
    /// may time out on a loaded host).
    other_failures: Vec<String>,
    hits_checked: u64,
    /// Locked reads whose bytes were not the key's own, or whose version
    /// moved under the lock.
    wrong: Vec<String>,
}

/// One node's client for `until`: stores batches larger than a region, each
/// followed by a locked, byte-checked read (through the primary, `reader`:
/// a follower's read would hold the keys, and their region, for
/// `hold_idle_ms`) of the batch and of the newest keys other nodes
/// acknowledged; every acknowledged key goes to `acked`.
async fn churn(
    mut c: Client,
    mut reader: Client,
    mut m: PoolMap,
    name: &'static str,
    tag: u64,
    until: Instant,
    acked: Arc<Mutex<Vec<(String, u64)>>>,
) -> ChurnLog {
    let mut log = ChurnLog::default();
    let mut n = 0u64;
    while Instant::now() < until {
        n += 1;
        log.stores += 1;
        let batch: Vec<(String, u64)> =
            (0..CHURN_BATCH as u64).map(|j| (format!("{name}-{n}-{j}"), (tag << 40) | (n << 8) | j)).collect();
        let req = reserve_objects(batch.iter().map(|(k, _)| k.as_str()));
        let rep = match c.reserve(req).await {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == tonic::Code::ResourceExhausted => {
                log.whole_call_exhausted.push(format!("{name} store #{n}: {}", s.message()));
                continue;
            }
            Err(s) => {
                log.other_failures.push(format!("{name} reserve #{n}: {s:?}"));
                continue;
            }
        };
        let mut ids = vec![];
        let mut placed = vec![];
        for (r, (k, seed)) in rep.reservations.iter().zip(&batch) {
            match status_code(&r.status) {
                OK => {
                    m.write(r.location.as_ref().unwrap(), &obj(*seed));
                    ids.push(r.reservation_id);
                    placed.push((k.clone(), *seed));
                }
                RESOURCE_EXHAUSTED => log.items_exhausted += 1,
                other => log.other_failures.push(format!("{name} item {k}: code {other} {:?}", r.status)),
            }
        }
        if !ids.is_empty() {
            match c.commit(proto::CommitRequest { reservation_ids: ids, crc32: vec![], keys: vec![] }).await {
                Ok(cr) => {
                    for (s, kv) in cr.into_inner().statuses.iter().zip(&placed) {
                        if s.code == OK {
                            log.items_ok += 1;
                            acked.lock().unwrap().push(kv.clone());
                        } else {
                            log.other_failures.push(format!("{name} commit {}: {s:?}", kv.0));
                        }
                    }
                }
                Err(s) => log.other_failures.push(format!("{name} commit #{n}: {s:?}")),
            }
        }
        // Read back this batch and the newest keys of the other nodes.
        let mut check: Vec<(String, u64)> = placed;
        check.extend(acked.lock().unwrap().iter().rev().filter(|(k, _)| !k.starts_with(name)).take(6).cloned());
        let names: Vec<&str> = check.iter().map(|(k, _)| k.as_str()).collect();
        let look = proto::LookupRequest { keys: names.iter().map(|k| key(k)).collect(), ..Default::default() };
        let rep = match reader.lookup_and_lock(look).await {
            Ok(r) => r.into_inner(),
            Err(s) => {
                log.other_failures.push(format!("{name} lookup #{n}: {s:?}"));
                continue;
            }
        };
        let mut locked = vec![];
        for (r, (k, seed)) in rep.results.iter().zip(&check) {
            if !r.found {
                continue;
            }
            let l = r.location.as_ref().unwrap();
            let (same, version) = (m.read(l) == obj(*seed), m.version(l));
            if !same || version != l.version {
                log.wrong.push(format!(
                    "{k}, read through a after {name}'s store #{n}: {}, page version {version} (the lookup said {})",
                    if same { "its own bytes" } else { "NOT its own bytes" },
                    l.version
                ));
            }
            log.hits_checked += 1;
            locked.push(k.as_str());
        }
        if !locked.is_empty() {
            let codes = unlock(&mut reader, &locked).await;
            assert!(codes.iter().all(|s| *s == OK), "{name}: unlock after a read: {codes:?}");
        }
    }
    log
}

/// Defect 4: 20 s of reclaim churn (three nodes on a pool of three regions,
/// each storing batches larger than a region, so phase 3 runs all the
/// time); no Reserve ever fails as a whole call with RESOURCE_EXHAUSTED, and
/// afterwards, with the cluster idle, every node stores a fresh batch
/// (per-item OK) and every key found anywhere has its own bytes.
///
/// Not deterministic by nature: the race (a region handed to a node taken
/// back before that node adopted it) needs a phase 3 of another node to hit
/// the window between handover and adoption. 20 s of churn with every store
/// needing phase 3 makes that very likely; the whole-call check catches the
/// race's short form too (a reserve into a region being taken back).
#[tokio::test(flavor = "multi_thread")]
async fn reclaim_churn_never_fails_a_reserve_as_a_whole_call_and_leaves_every_node_able_to_store() {
    let dir = tempfile::tempdir().unwrap();
    let cl = cluster(dir.path(), "6MiB");
    let mut ca = cl.a.client().await;
    let regions = stats(&mut ca).await.regions.len();
    assert_eq!(regions, 3, "the test wants a pool of three regions");
    eventually("b and c joined", Duration::from_secs(10), async || stats(&mut ca).await.cluster_nodes.len() == 3).await;

    let acked: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let until = Instant::now() + Duration::from_secs(20);
    let mut workers = vec![];
    for (i, (name, s)) in [("a", &cl.a), ("b", &cl.b), ("c", &cl.c)].into_iter().enumerate() {
        let mut c = s.client().await;
        let m = PoolMap::open(&mut c).await;
        let reader = cl.a.client().await;
        workers.push(tokio::spawn(churn(c, reader, m, name, i as u64 + 1, until, acked.clone())));
    }
    let mut logs = vec![];
    for w in workers {
        logs.push(w.await.unwrap());
    }
    let summary: Vec<String> = logs
        .iter()
        .zip(["a", "b", "c"])
        .map(|(l, n)| {
            format!(
                "{n}: {} stores, {} items ok, {} items RESOURCE_EXHAUSTED, {} hits checked ({} wrong), {} \
                 whole-call RESOURCE_EXHAUSTED, {} other failures",
                l.stores,
                l.items_ok,
                l.items_exhausted,
                l.hits_checked,
                l.wrong.len(),
                l.whole_call_exhausted.len(),
                l.other_failures.len()
            )
        })
        .collect();
    eprintln!("reclaim churn:\n  {}", summary.join("\n  "));
    for l in &logs {
        for f in l.other_failures.iter().take(5) {
            eprintln!("  (not asserted) {f}");
        }
        for f in l.wrong.iter().take(5) {
            eprintln!("  wrong: {f}");
        }
    }
    let taken = |result: &str| {
        metric::<u64>(&cl.metrics, &format!("cxlkv_cluster_region_reclaims_total{{result=\"{result}\"}}")).unwrap_or(0)
    };
    let reclaims = taken("acked") + taken("owner_dead");
    eprintln!("  regions taken back (primary's metrics): {reclaims}");
    assert!(reclaims >= 5, "the churn must keep phase 3 busy; {reclaims} handovers:\n{}", summary.join("\n"));
    let whole: Vec<&String> = logs.iter().flat_map(|l| &l.whole_call_exhausted).collect();
    assert!(
        whole.is_empty(),
        "{} Reserves failed as a whole call with RESOURCE_EXHAUSTED (only per-item statuses are in the error \
         model), first: {:?}\n{}",
        whole.len(),
        whole.iter().take(3).collect::<Vec<_>>(),
        summary.join("\n")
    );
    let wrong: Vec<&String> = logs.iter().flat_map(|l| &l.wrong).collect();
    assert!(
        wrong.is_empty(),
        "{} locked reads during the churn were not the key's own object, first: {:?}\n{}",
        wrong.len(),
        wrong.iter().take(3).collect::<Vec<_>>(),
        summary.join("\n")
    );

    // Idle: the last reads' node holds lapse (hold_idle_ms 500). Then each
    // node stores a fresh batch, read back at once through the primary (no
    // node hold there, so the next node's store may take any region).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ma = PoolMap::open(&mut ca).await;
    let mut fresh: Vec<(String, Vec<u8>)> = vec![];
    for (i, (name, s)) in [("a", &cl.a), ("b", &cl.b), ("c", &cl.c)].into_iter().enumerate() {
        let mut c = s.client().await;
        let mut m = PoolMap::open(&mut c).await;
        let items: Vec<(String, Vec<u8>)> =
            (0..4u64).map(|j| (format!("fresh-{name}-{j}"), obj((9 << 40) | ((i as u64) << 8) | j))).collect();
        let req = reserve_objects(items.iter().map(|(k, _)| k.as_str()));
        let rep = match c.reserve(req).await {
            Ok(r) => r.into_inner(),
            Err(s) => panic!("node {name} cannot store on the idle cluster after the churn (whole call): {s:?}"),
        };
        let codes: Vec<u32> = rep.reservations.iter().map(|r| status_code(&r.status)).collect();
        assert_eq!(codes, [OK; 4], "node {name}: a fresh batch on the idle cluster: {:?}", rep.reservations);
        for (r, (_, v)) in rep.reservations.iter().zip(&items) {
            m.write(r.location.as_ref().unwrap(), v);
        }
        let ids = rep.reservations.iter().map(|r| r.reservation_id).collect();
        let cr = c
            .commit(proto::CommitRequest { reservation_ids: ids, crc32: vec![], keys: vec![] })
            .await
            .unwrap()
            .into_inner();
        assert!(cr.statuses.iter().all(|s| s.code == OK), "node {name}: commit of the fresh batch: {cr:?}");
        let found = check_hits(&mut ca, &ma, &items, "a").await;
        assert_eq!(found.len(), items.len(), "{name}'s fresh batch through a: found only {found:?}");
        for (k, v) in &items {
            assert_eq!(inline_get(&mut ca, k).await.as_ref(), Some(v), "{k} inline through a");
        }
        fresh.extend(items);
    }

    // Every key ever acknowledged that is still found anywhere (a later
    // node's fresh batch may have taken an earlier one's region), with its
    // own bytes, mapped and inline.
    let mut all: Vec<(String, Vec<u8>)> = acked.lock().unwrap().iter().map(|(k, s)| (k.clone(), obj(*s))).collect();
    all.extend(fresh);
    for (name, s) in [("a", &cl.a), ("b", &cl.b), ("c", &cl.c)] {
        let mut c = s.client().await;
        let m = PoolMap::open(&mut c).await;
        for chunk in all.chunks(1000) {
            for k in check_hits(&mut c, &m, chunk, name).await {
                let v = &chunk.iter().find(|(x, _)| *x == k).unwrap().1;
                let got = inline_get(&mut c, &k).await;
                assert!(got.as_ref() == Some(v), "{k} inline through {name}: not its own bytes (or gone)");
            }
        }
    }
}
