//! `cxlkv-bench scale`: the registry in process at N entries — bytes per
//! entry (stored, then evicting), inserts/s and lookup-and-unlock rate,
//! against a bare HashMap of as many entries (what memory alone allows).
use std::time::{Duration, Instant};

use cxlkv::registry::{Admit, LocalRegistry, Location, ReserveOpts, Session};

use crate::figures::{bench, count_tag};
use crate::fixtures::location;
use crate::keys::lmcache_key;

fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap();
    s.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 4096
}

pub fn scale(n: usize, secs: f64, policy: &str) {
    // As a sidecar builds it: admission (the default, adaptive) judges each
    // store before it is reserved, its simulations holding sampled keys.
    let reg = LocalRegistry::new(policy, 1024).unwrap().with_admission(Default::default());
    let before = rss_bytes();
    let loc = |i: usize| location(i, 4096, 4096);
    let t = Instant::now();
    let mut i = 0;
    while i < n {
        let end = (i + 4096).min(n);
        let items: Vec<(Vec<u8>, Location)> = (i..end).map(|j| (lmcache_key(j), loc(j))).collect();
        let judged: Vec<(&[u8], u64)> = items.iter().map(|(k, l)| (k.as_slice(), l.length)).collect();
        assert!(reg.admit(&judged).iter().all(|v| *v == Admit::Admitted), "a registry with room admits all");
        let ids: Vec<_> = reg.reserve("bench", items, ReserveOpts::local(1)).into_iter().map(|r| r.unwrap()).collect();
        reg.commit(&ids, Session::LOCAL, &mut |_, _| {});
        reg.expire(2); // steady state: committed reservations leave the deadline queue
        i = end;
    }
    let insert_s = t.elapsed().as_secs_f64();
    let per_entry = (rss_bytes() - before) as f64 / n as f64;
    let tag = count_tag(n);
    bench(&format!("registry_bytes_per_entry_{tag}"), per_entry);
    bench(&format!("registry_inserts_per_s_{tag}"), n as f64 / insert_s);
    // Lookup rate: batches of 32 random existing keys, lock + unlock.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let (mut done, t, mut now) = (0u64, Instant::now(), 3u64);
    let mut batch: Vec<Vec<u8>> = Vec::with_capacity(32);
    while Instant::now() < deadline {
        for _ in 0..64 {
            batch.clear();
            for _ in 0..32 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                batch.push(lmcache_key(x as usize % n));
            }
            let refs: Vec<&[u8]> = batch.iter().map(|k| k.as_slice()).collect();
            let hits = reg.lookup_and_lock(&refs, 60_000, now);
            assert!(hits.iter().all(|h| h.is_some()));
            reg.unlock(&refs, now);
            now += 1;
            done += 32;
        }
    }
    bench(&format!("registry_lookups_per_s_{tag}"), done as f64 / t.elapsed().as_secs_f64());
    // Once it evicts, the policy's ghost and admission's history fill (each
    // at most 16 MiB): a tenth of the entries evicted, memory per entry
    // stored at the start.
    reg.evict(cxlkv::ids::NodeId(1), (n / 10) as u64, 2 << 20, now);
    bench(&format!("registry_bytes_per_entry_evicting_{tag}"), (rss_bytes() - before) as f64 / n as f64);
    drop(reg);
    // The floor: a bare HashMap<u64, u64> with the same number of entries and
    // random lookups shows what the memory hierarchy alone costs at this size.
    let m: std::collections::HashMap<u64, u64> =
        (0..n as u64).map(|i| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15), i)).collect();
    let (mut sum, mut done, t) = (0u64, 0u64, Instant::now());
    while t.elapsed().as_secs_f64() < secs / 2.0 {
        for _ in 0..4096 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            sum = sum.wrapping_add(m[&((x % n as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))]);
        }
        done += 4096;
    }
    std::hint::black_box(sum);
    bench(&format!("hashmap_lookups_per_s_{tag}"), done as f64 / t.elapsed().as_secs_f64());
}
