//! `cxlkv-bench rebuild`: warm restart — N one-page objects stored, then
//! the start-up that rebuilds the registry from their records, timed.
use std::path::Path;
use std::time::Instant;

use cxlkv::registry::Session;

use crate::figures::{bench, count_tag};
use crate::keys::lmcache_key;

/// The objects' regions and one more.
fn open_handler(path: &Path, objects: usize) -> cxlkv::handler::Handler {
    crate::node::open(path, crate::node::regions_for(objects) + 1)
}

pub async fn rebuild(path: &Path, objects: usize) {
    let _ = std::fs::remove_file(path);
    let h = open_handler(path, objects);
    let t = Instant::now();
    for start in (0..objects).step_by(4096) {
        let items = (start..(start + 4096).min(objects)).map(|i| (lmcache_key(i), 4096u64)).collect();
        let rr = h.reserve("bench", items, Session::LOCAL, false).await.unwrap();
        let ids: Vec<_> = rr.results.into_iter().map(|r| r.unwrap().0).collect();
        h.commit(&ids, &[], Session::LOCAL).await.unwrap();
    }
    let store_s = t.elapsed().as_secs_f64();
    drop(h);
    // Three restarts, the median: on a VM whose host backs guest memory
    // lazily, the first touch of pages the guest never used costs a host
    // fault, and which pages a rebuild's registry gets is luck.
    let mut runs = vec![];
    for _ in 0..3 {
        let t = Instant::now();
        let h = open_handler(path, objects);
        runs.push(t.elapsed().as_secs_f64());
        assert_eq!(h.rebuilt().restored, objects as u64, "not every object came back");
    }
    let first_s = runs[0];
    runs.sort_by(f64::total_cmp);
    let rebuild_s = runs[1];
    let tag = count_tag(objects);
    bench(&format!("rebuild_s_first_{tag}"), first_s);
    bench(&format!("rebuild_s_{tag}"), rebuild_s);
    bench(&format!("rebuild_s_per_million_{tag}"), rebuild_s * 1e6 / objects as f64);
    bench(&format!("store_records_per_s_{tag}"), objects as f64 / store_s);
    let _ = std::fs::remove_file(path);
}
