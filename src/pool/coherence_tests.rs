//! The coherence rules on the non-coherent test backend: two `Pool`s in one
//! process are two hosts, each with its own "cache" (a private copy of the
//! pool). What one writes reaches the other only if the writer flushes and
//! the reader invalidates; these tests fail when either step is left out.
use super::record::{ObjectRecord, RecordState};
use super::*;
use crate::rebuild::{scan_region, RebuildReport};

const REGION: u64 = 2 << 20;
const PAGE: u64 = 64 << 10;

fn host(path: &std::path::Path) -> Pool {
    let g = Geometry::for_capacity(2 * REGION, REGION, PAGE, backend::DAX_ALIGN).unwrap();
    let b = NoncoherentTestBackend::open(path, g.pool_size, false).unwrap();
    Pool::open(Box::new(b), &PoolOptions { region_size: REGION, page_size: PAGE, format: false }).unwrap().0
}

fn rec(key: &str, state: RecordState, generation: u64) -> ObjectRecord {
    ObjectRecord {
        state,
        tenant: "t".into(),
        key: key.as_bytes().to_vec(),
        generation,
        seq: 0,
        length: 3 * PAGE + 100,
        payload_crc: None,
    }
}

fn read(m: &Mapping, off: u64, n: usize) -> Vec<u8> {
    let mut b = vec![0; n];
    m.read(off, &mut b).unwrap();
    b
}

#[test]
fn the_test_backend_is_not_coherent() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool");
    let (a, b) = (host(&path), host(&path));
    let r = a.claim_region(NodeId(1)).unwrap().unwrap();
    let (w, ro) = (a.map_region(r, true).unwrap(), b.map_region(r, false).unwrap());
    w.write(64, b"new").unwrap();
    ro.invalidate(64, 3).unwrap();
    assert_eq!(read(&ro, 64, 3), [0; 3], "a write not flushed stays with its writer");
    w.flush(64, 3).unwrap();
    assert_eq!(read(&ro, 64, 3), [0; 3], "a reader that does not invalidate keeps its stale copy");
    ro.invalidate(64, 3).unwrap();
    assert_eq!(read(&ro, 64, 3), b"new");
    // Flushes and invalidations cover whole 64-byte lines, as the CPU's do.
    w.write(130, b"xy").unwrap();
    w.flush(191, 1).unwrap();
    ro.invalidate(128, 1).unwrap();
    assert_eq!(read(&ro, 130, 2), b"xy");
    // The backend cannot be told it is coherent.
    let g = Geometry::for_capacity(2 * REGION, REGION, PAGE, backend::DAX_ALIGN).unwrap();
    let nc = NoncoherentTestBackend::open(&path, g.pool_size, false).unwrap();
    assert_eq!(nc.with_coherence(Coherence::Hardware).unwrap_err().kind(), ErrorKind::InvalidArgument);
}

#[test]
fn region_table_changes_reach_the_other_host() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool");
    let (a, b) = (host(&path), host(&path));
    let (r0, r1) = (RegionId(0), RegionId(1));
    assert_eq!(b.region_state(r0).unwrap(), RegionState { owner: None, generation: 0 }, "b has cached the entry");
    assert_eq!(a.claim_region(NodeId(1)).unwrap(), Some(r0));
    assert_eq!(b.region_state(r0).unwrap(), RegionState { owner: Some(NodeId(1)), generation: 1 });
    assert_eq!(b.claim_region(NodeId(2)).unwrap(), Some(r1), "b does not take a's region");
    assert_eq!(a.region_state(r1).unwrap().owner, Some(NodeId(2)));
    assert!(!a.has_unowned_region().unwrap() && !b.has_unowned_region().unwrap(), "both regions are owned");
    assert_eq!(a.renew_region(r0, NodeId(1)).unwrap().generation, 2);
    assert_eq!(b.region_state(r0).unwrap().generation, 2);
    b.release_region(r1, NodeId(2)).unwrap();
    // a has r1's entry cached as b's: the check reads the table afresh.
    assert!(a.has_unowned_region().unwrap(), "b's release reached a");
    assert_eq!(a.claim_region(NodeId(3)).unwrap(), Some(r1));
    assert!(!b.has_unowned_region().unwrap(), "a's claim reached b");
    assert_eq!(b.regions_owned_by(NodeId(3)), vec![r1]);
}

#[test]
fn a_reader_on_another_host_sees_an_object_go() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool");
    let (a, b) = (host(&path), host(&path));
    let r = a.claim_region(NodeId(1)).unwrap().unwrap();
    a.record_batch().write(r, 0, &rec("k", RecordState::Writing, 1)).unwrap();
    a.record_batch().commit(r, 0, 7, Some(0xC0FFEE)).unwrap();
    b.refresh_slot(r, 0).unwrap();
    let v = b.page_version(r, 0).unwrap();
    assert_eq!(b.page_crc(r, 0).unwrap(), Some(0xC0FFEE));
    a.retire_pages(r, 0, 4).unwrap();
    assert_eq!(b.page_version(r, 0).unwrap(), v, "without an invalidation b reads its stale copy");
    b.refresh_slot(r, 0).unwrap();
    assert_eq!(b.page_version(r, 0).unwrap(), v.wrapping_add(1), "the retirement reached b");
    assert_eq!(b.page_crc(r, 0).unwrap(), None);
    assert_eq!(b.read_record(r, 0).unwrap(), None, "a tombstone");
}

/// A node that takes over another host's region (failover) rebuilds it from
/// the records that host flushed: b looked at the pool before a wrote
/// anything, so every record it finds came through a flush and an
/// invalidation.
#[test]
fn a_node_taking_over_a_region_reads_the_records_its_writer_flushed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool");
    let (a, b) = (host(&path), host(&path));
    let r = a.claim_region(NodeId(1)).unwrap().unwrap();
    for p in 0..REGION / PAGE {
        assert_eq!(b.read_record(r, p).unwrap(), None); // b caches every empty slot
    }
    assert_eq!(read(&b.map_region(r, false).unwrap(), 0, REGION as usize), vec![0; REGION as usize], "and page");
    let long = format!("long-{}", "n".repeat(200)); // its name follows the payload
    let keys = ["c0", "w1", long.as_str(), "gone", "c4"];
    for (i, k) in keys.iter().enumerate() {
        let page = i as u64 * 4;
        a.record_batch().write(r, page, &rec(k, RecordState::Writing, 1)).unwrap();
        if !k.starts_with('w') {
            a.record_batch().commit(r, page, 10 + i as u64, None).unwrap();
        }
    }
    a.retire_pages(r, 12, 4).unwrap(); // "gone" was deleted
    let before = b.region_state(r).unwrap().generation;
    assert_eq!(before, 1);
    let renewal = b.renew_region(r, NodeId(1)).unwrap();
    let generation = renewal.generation;
    let mut report = RebuildReport::default();
    let mut committed = vec![];
    let scan = scan_region(&b, (NodeId(1), r), renewal, &mut committed, &mut report).unwrap();
    let found: Vec<(String, u64, u64)> = committed
        .iter()
        .map(|f| (String::from_utf8(f.key.as_slice().to_vec()).unwrap(), f.seq, f.loc.offset))
        .collect();
    assert_eq!(
        found,
        vec![("c0".into(), 10, 0), (long.clone(), 12, 8 * PAGE), ("c4".into(), 14, 16 * PAGE)],
        "committed records as their writer flushed them"
    );
    assert_eq!(scan.writing.iter().map(|l| l.offset).collect::<Vec<_>>(), vec![4 * PAGE]);
    assert_eq!(report, RebuildReport { restored: 3, quarantined: 1, damaged: 0, stale: 0 });
    // b restamped them with the new generation and flushed: a sees that.
    a.refresh_records(r).unwrap();
    assert_eq!(a.read_record(r, 0).unwrap().unwrap().generation, generation);
}

/// `Mapping::write_through` in every cache mode, at line-unaligned heads and
/// tails and at sizes around the streaming threshold: the mapping and the
/// pool file (memory) hold exactly the bytes written, and nothing around
/// them changed. On the test backend the file has them with no `flush`: the
/// streamed body and the written-back partial lines reach it only through
/// the write's own fence, so this fails without it or with a line range
/// that is stored but neither streamed nor written back.
#[test]
fn write_through_puts_exact_bytes_in_memory_without_a_flush() {
    use super::mapping::{CacheMode, STREAM_MIN};
    use std::os::unix::fs::FileExt;
    const LEN: usize = 256 << 10;
    let sizes = [0, 1, 63, 64, 65, 127, 128, 129, STREAM_MIN - 1, STREAM_MIN, STREAM_MIN + 1, 4096 + 13, 100_003];
    let dir = tempfile::tempdir().unwrap();
    let f = std::fs::File::options().read(true).write(true).create(true).truncate(true).open(dir.path().join("p"));
    let f = f.unwrap();
    f.set_len(LEN as u64).unwrap();
    for mode in [CacheMode::Coherent, CacheMode::Lines, CacheMode::Private] {
        for off in [0u64, 1, 63, 64 + 17, 4095] {
            for n in sizes {
                f.write_all_at(&vec![0xa5; LEN], 0).unwrap();
                let m = Mapping::map(&f, 0, LEN, true, mode).unwrap();
                let src: Vec<u8> = (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(n as u8) | 1).collect();
                m.write_through(off, &src).unwrap();
                let mut want = vec![0xa5; LEN];
                want[off as usize..off as usize + n].copy_from_slice(&src);
                let mut file = vec![0; LEN];
                f.read_exact_at(&mut file, 0).unwrap();
                assert!(file == want, "{mode:?} at {off}, {n} bytes: memory differs");
                assert!(read(&m, 0, LEN) == want, "{mode:?} at {off}, {n} bytes: the mapping differs");
            }
        }
    }
    let ro = Mapping::map(&f, 0, LEN, false, CacheMode::Lines).unwrap();
    assert_eq!(ro.write_through(0, b"x").unwrap_err().kind(), crate::error::ErrorKind::FailedPrecondition);
    let m = Mapping::map(&f, 0, LEN, true, CacheMode::Lines).unwrap();
    assert_eq!(m.write_through(LEN as u64 - 1, b"xy").unwrap_err().kind(), crate::error::ErrorKind::InvalidArgument);
}
