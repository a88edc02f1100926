//! Criterion benches for the per-request hot paths: page allocation, the
//! registry's store/lookup path and eviction inside reserve.
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use cxlkv::allocator::PageAllocator;
use cxlkv::eviction;
use cxlkv::registry::{LocalRegistry, Location, ReserveOpts, Session};

fn key(i: usize) -> Vec<u8> {
    let mut k = b"\x01\x17meta-llama/Llama-3.1-8B\x02\x01\x02\x01\x00\x00\x00\x00\x20".to_vec();
    k.extend_from_slice(&(i as u64).to_le_bytes());
    k.extend_from_slice(&[7u8; 24]);
    k
}

// The benchmark driver's fixture (crates/bench): entries placed the same way.
#[path = "../crates/bench/src/fixtures.rs"]
mod fixtures;

fn loc(i: usize) -> Location {
    fixtures::location(i, 64, 1024)
}

fn filled(n: usize) -> LocalRegistry {
    let r = LocalRegistry::new("lru", 1024).unwrap();
    for chunk in (0..n).collect::<Vec<_>>().chunks(4096) {
        let ids: Vec<_> = r
            .reserve("t", chunk.iter().map(|&i| (key(i), loc(i))).collect(), ReserveOpts::local(1))
            .into_iter()
            .map(|x| x.unwrap())
            .collect();
        r.commit(&ids, Session::LOCAL, &mut |_, _| {});
    }
    r.expire(2);
    r
}

fn allocator(c: &mut Criterion) {
    c.bench_function("allocator/alloc_free_32_pages_fragmented", |b| {
        let mut a = PageAllocator::new(4096);
        // Leave every other 32-page block allocated: free space is fragmented.
        let held: Vec<u32> = (0..64).map(|_| a.alloc(32).unwrap()).collect();
        for (i, p) in held.iter().enumerate() {
            if i % 2 == 0 {
                a.free(*p, 32).unwrap();
            }
        }
        b.iter(|| {
            let p = a.alloc(black_box(32)).unwrap();
            a.free(p, 32).unwrap();
        })
    });
}

fn registry(c: &mut Criterion) {
    let r = filled(100_000);
    let keys: Vec<Vec<u8>> = (0..32).map(|i| key(i * 3001 % 100_000)).collect();
    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
    c.bench_function("registry/lookup_and_lock_unlock_32_of_100k", |b| {
        b.iter(|| {
            black_box(r.lookup_and_lock(&refs, 60_000, 3));
            r.unlock(&refs, 3);
        })
    });
    let mut next = 1_000_000usize;
    c.bench_function("registry/reserve_commit_delete_32", |b| {
        b.iter(|| {
            let items: Vec<(Vec<u8>, Location)> = (0..32).map(|i| (key(next + i), loc(i))).collect();
            next += 32;
            let ks: Vec<Vec<u8>> = items.iter().map(|x| x.0.clone()).collect();
            let ids: Vec<_> = r.reserve("t", items, ReserveOpts::local(10)).into_iter().map(|x| x.unwrap()).collect();
            r.commit(&ids, Session::LOCAL, &mut |_, _| {});
            let refs: Vec<&[u8]> = ks.iter().map(|k| k.as_slice()).collect();
            black_box(r.delete(&refs, 3));
        })
    });
}

fn evict(c: &mut Criterion) {
    c.bench_function("eviction/evict_one_then_refill_100k", |b| {
        let r = filled(100_000);
        let mut next = 200_000usize;
        b.iter_batched(
            || {
                next += 1;
                next
            },
            |i| {
                let freed = r.evict(cxlkv::ids::NodeId(1), 32, 65536, 3);
                assert_eq!(freed.len(), 1);
                let ids: Vec<_> = r
                    .reserve("t", vec![(key(i), loc(i))], ReserveOpts::local(10))
                    .into_iter()
                    .map(|x| x.unwrap())
                    .collect();
                r.commit(&ids, Session::LOCAL, &mut |_, _| {});
            },
            BatchSize::SmallInput,
        )
    });
    c.bench_function("eviction/lru_touch", |b| {
        let mut p = eviction::by_name("lru").unwrap();
        for id in 0..100_000 {
            p.insert(1, eviction::EntryId(id), eviction::Obj { size: 1 << 20, hash: id as u64 });
        }
        let mut i = 0u32;
        b.iter(|| {
            i = (i + 7919) % 100_000;
            p.touch(1, black_box(eviction::EntryId(i)));
        })
    });
}

criterion_group!(benches, allocator, registry, evict);
criterion_main!(benches);
