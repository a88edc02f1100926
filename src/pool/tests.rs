//! Backend conformance suite: every test runs against every backend (the DAX
//! backend on a regular file, since no device exists in CI; the non-coherent
//! test backend, where two `Pool`s in one process act as two hosts, so the
//! tests flush and invalidate as the coherence rules say).
use super::*;
use std::path::Path;

const REGION: u64 = 2 << 20;
const PAGE: u64 = 64 << 10;

fn opts(format: bool) -> PoolOptions {
    PoolOptions { region_size: REGION, page_size: PAGE, format }
}

trait Maker {
    const KIND: BackendKind;
    fn make(path: &Path, regions: u64) -> Box<dyn PoolBackend>;
}

struct Shm;
impl Maker for Shm {
    const KIND: BackendKind = BackendKind::Shm;
    fn make(path: &Path, regions: u64) -> Box<dyn PoolBackend> {
        let g = Geometry::for_capacity(regions * REGION, REGION, PAGE, backend::DAX_ALIGN).unwrap();
        Box::new(ShmBackend::open(path, g.pool_size, false).unwrap())
    }
}

struct Noncoherent;
impl Maker for Noncoherent {
    const KIND: BackendKind = BackendKind::NoncoherentTest;
    fn make(path: &Path, regions: u64) -> Box<dyn PoolBackend> {
        let g = Geometry::for_capacity(regions * REGION, REGION, PAGE, backend::DAX_ALIGN).unwrap();
        Box::new(NoncoherentTestBackend::open(path, g.pool_size, false).unwrap())
    }
}

struct Dax;
impl Maker for Dax {
    const KIND: BackendKind = BackendKind::Dax;
    fn make(path: &Path, regions: u64) -> Box<dyn PoolBackend> {
        let g = Geometry::for_capacity(regions * REGION, REGION, PAGE, backend::DAX_ALIGN).unwrap();
        if !path.exists() {
            std::fs::File::create(path).unwrap().set_len(g.pool_size).unwrap();
        }
        Box::new(DaxBackend::open(path).unwrap())
    }
}

fn open<M: Maker>(path: &Path, regions: u64, format: bool) -> Result<(Pool, OpenOutcome)> {
    Pool::open(M::make(path, regions), &opts(format))
}

/// The suite: each test is defined once, generic over the backend, and
/// run once per backend of the list at its head (a module per backend, a
/// test per function in each), so a test added here runs on every backend;
/// `every_backend_kind_is_in_the_suite` keeps the list complete.
macro_rules! conformance {
    ([$($m:ident => $backend:ty),* $(,)?] $($(#[$doc:meta])* fn $name:ident<M>() $body:block)*) => {
        $($(#[$doc])* fn $name<M: Maker>() $body)*
        /// The backends the suite runs on.
        const SUITE: &[BackendKind] = &[$(<$backend as Maker>::KIND),*];
        conformance!(@each [$($m => $backend),*] [$($name)*]);
    };
    (@each [$($m:ident => $backend:ty),*] $names:tt) => {
        $(conformance!(@one $m $backend $names);)*
    };
    (@one $m:ident $backend:ty [$($name:ident)*]) => {
        mod $m {
            use super::*;
            $(#[test] fn $name() { super::$name::<$backend>() })*
        }
    };
}

conformance! {
    [shm => Shm, dax => Dax, noncoherent => Noncoherent]

    fn fresh_formats_then_reattaches<M>() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool");
        let (p, out) = open::<M>(&path, 4, false).unwrap();
        assert_eq!(out, OpenOutcome::Formatted);
        assert_eq!(p.region_count(), 4);
        let uuid = p.superblock().pool_uuid;
        let r = p.claim_region(NodeId(3)).unwrap().unwrap();
        let w = p.map_region(r, true).unwrap();
        w.write(100, b"kept").unwrap();
        w.flush(100, 4).unwrap();
        drop((w, p));
        let (p, out) = open::<M>(&path, 4, false).unwrap();
        assert_eq!(out, OpenOutcome::Attached);
        assert_eq!(p.superblock().pool_uuid, uuid);
        assert_eq!(p.region_state(r).unwrap().owner, Some(NodeId(3)));
        let mut buf = [0u8; 4];
        p.map_region(r, false).unwrap().read(100, &mut buf).unwrap();
        assert_eq!(&buf, b"kept");
    }

    fn damaged_header_is_refused_and_untouched<M>() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool");
        drop(open::<M>(&path, 2, false).unwrap());
        for (what, off) in [("magic", 0usize), ("version", 8), ("checksum-covered field", 40)] {
            let mut bytes = std::fs::read(&path).unwrap();
            bytes[off] ^= 0xff;
            std::fs::write(&path, &bytes).unwrap();
            let err = open::<M>(&path, 2, false).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupt, "{what}: {err}");
            assert!(err.message().contains("--format"), "{what}: hint missing: {err}");
            assert_eq!(std::fs::read(&path).unwrap(), bytes, "{what}: refused pool was modified");
            bytes[off] ^= 0xff;
            std::fs::write(&path, &bytes).unwrap();
        }
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[..8].copy_from_slice(b"GARBAGE!");
        std::fs::write(&path, &bytes).unwrap();
        let (_, out) = open::<M>(&path, 2, true).unwrap();
        assert_eq!(out, OpenOutcome::Formatted);
    }

    fn geometry_mismatch_is_refused<M>() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool");
        drop(open::<M>(&path, 4, false).unwrap());
        let mut o = opts(false);
        o.page_size = 128 << 10;
        let err = Pool::open(M::make(&path, 4), &o).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
        o.format = true;
        let (p, out) = Pool::open(M::make(&path, 4), &o).unwrap();
        assert_eq!((out, p.superblock().page_size), (OpenOutcome::Formatted, 128 << 10));
    }

    fn claims_are_exclusive_across_openers<M>() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool");
        let (a, _) = open::<M>(&path, 3, false).unwrap();
        let (b, _) = open::<M>(&path, 3, false).unwrap();
        let mut got = vec![];
        for i in 0..4 {
            let (p, node) = if i % 2 == 0 { (&a, NodeId(1)) } else { (&b, NodeId(2)) };
            if let Some(r) = p.claim_region(node).unwrap() {
                got.push(r);
                assert_eq!(p.region_state(r).unwrap().generation, 1);
            }
        }
        got.sort();
        assert_eq!(got, vec![RegionId(0), RegionId(1), RegionId(2)], "every region claimed exactly once");
        assert_eq!(a.regions_owned_by(NodeId(1)).len() + b.regions_owned_by(NodeId(2)).len(), 3);
        assert!(a.release_region(got[0], NodeId(99)).is_err(), "release by a non-owner must fail");
        let owner = a.region_state(got[0]).unwrap().owner.unwrap();
        a.release_region(got[0], owner).unwrap();
        assert_eq!(b.claim_region(NodeId(7)).unwrap(), Some(got[0]));
        assert_eq!(b.region_state(got[0]).unwrap().generation, 2);
    }

    /// A deposed primary (its epoch below the pool's) may not write pool-wide
    /// metadata, and cannot take an epoch back.
    fn a_later_epoch_fences_the_earlier_primary<M>() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool");
        let (old, _) = open::<M>(&path, 3, false).unwrap();
        let (new, _) = open::<M>(&path, 3, false).unwrap();
        assert_eq!(old.epoch().unwrap(), 0);
        old.take_epoch(5).unwrap();
        let r = old.claim_region(NodeId(1)).unwrap().unwrap();
        new.take_epoch(9).unwrap();
        assert_eq!(old.epoch().unwrap(), 9);
        let kind = |e: crate::error::Error| e.kind();
        let (n1, n2) = (NodeId(1), NodeId(2));
        assert_eq!(old.claim_region(n1).map_err(kind).unwrap_err(), ErrorKind::FailedPrecondition);
        assert_eq!(old.release_region(r, n1).map_err(kind).unwrap_err(), ErrorKind::FailedPrecondition);
        assert_eq!(old.reassign_region(r, n1, n2).map_err(kind).unwrap_err(), ErrorKind::FailedPrecondition);
        assert_eq!(old.node_id_for("x").map_err(kind).unwrap_err(), ErrorKind::FailedPrecondition);
        assert_eq!(old.take_epoch(5).map_err(kind).unwrap_err(), ErrorKind::FailedPrecondition);
        assert_eq!(new.region_state(r).unwrap().owner, Some(n1), "nothing changed");
        // The current primary goes on.
        assert_eq!(new.reassign_region(r, n1, n2).unwrap(), 2);
        assert!(new.claim_region(NodeId(3)).unwrap().is_some());
    }

    fn mappings_share_bytes_and_check_bounds<M>() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool");
        let (a, _) = open::<M>(&path, 2, false).unwrap();
        let (b, _) = open::<M>(&path, 2, false).unwrap();
        let r = a.claim_region(NodeId(1)).unwrap().unwrap();
        let w = a.map_region(r, true).unwrap();
        w.prefault().unwrap();
        // The reader maps first: whatever it cached before the write is stale.
        let ro = b.map_region(r, false).unwrap();
        w.write(REGION - 3, b"end").unwrap();
        w.flush(REGION - 3, 3).unwrap();
        let mut buf = [0u8; 3];
        ro.invalidate(REGION - 3, 3).unwrap();
        ro.read(REGION - 3, &mut buf).unwrap();
        assert_eq!(&buf, b"end");
        assert_eq!(ro.write(0, b"x").unwrap_err().kind(), ErrorKind::FailedPrecondition);
        assert_eq!(w.write(REGION - 2, b"abc").unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(ro.read(u64::MAX, &mut buf).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(a.map_region(RegionId(2), false).unwrap_err().kind(), ErrorKind::InvalidArgument);
    }

    fn node_ids_are_exclusive<M>() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool");
        let (a, _) = open::<M>(&path, 2, false).unwrap();
        let (b, _) = open::<M>(&path, 2, false).unwrap();
        assert_eq!(a.lock_node(Some(5)).unwrap(), 5);
        assert_eq!(b.lock_node(Some(5)).unwrap_err().kind(), ErrorKind::FailedPrecondition);
        assert_eq!(a.lock_node(None).unwrap(), 1);
        assert_eq!(b.lock_node(None).unwrap(), 2);
        drop(a);
        let (c, _) = open::<M>(&path, 2, false).unwrap();
        assert_eq!(c.lock_node(Some(5)).unwrap(), 5, "a closed opener's node id is free again");
    }

    /// Eight threads recording two names at once, four each (the primary
    /// answering two followers' joins, and the retries a slow answer made
    /// each send), for 20 pairs of names: each name gets one id, every
    /// thread recording it sees that id, two names never share one, and the
    /// table reads back with each name once.
    fn racing_records_give_each_name_one_id_of_its_own<M>() {
        let dir = tempfile::tempdir().unwrap();
        let (p, _) = open::<M>(&dir.path().join("pool"), 2, false).unwrap();
        let barrier = std::sync::Barrier::new(8);
        let mut seen = std::collections::HashMap::new();
        for round in 0..20 {
            let names = [format!("a{round}"), format!("b{round}")];
            let ids: Vec<(usize, u32)> = std::thread::scope(|s| {
                let racers: Vec<_> = (0..8)
                    .map(|t| {
                        let (p, barrier, name) = (&p, &barrier, &names[t % 2]);
                        s.spawn(move || {
                            barrier.wait();
                            (t % 2, p.node_id_for(name).unwrap())
                        })
                    })
                    .collect();
                racers.into_iter().map(|r| r.join().unwrap()).collect()
            });
            for (which, id) in ids {
                let first = *seen.entry(names[which].clone()).or_insert(id);
                assert_eq!(first, id, "{} got two ids", names[which]);
            }
            assert_ne!(seen[&names[0]], seen[&names[1]], "{names:?} share an id");
        }
        let mut table = p.nodes().unwrap();
        table.sort();
        let mut want: Vec<(u32, String)> = seen.into_iter().map(|(n, i)| (i, n)).collect();
        want.sort();
        assert_eq!(table, want);
    }

    /// A table where an entry repeats an earlier one (same id and name, as
    /// racing joins of one name wrote before records were serialised) reads as
    /// one node, and the next record clears the repeat, so the slot serves
    /// again and the table never fills with repeats.
    fn a_repeated_entry_is_one_node_and_the_next_record_clears_it<M>() {
        let dir = tempfile::tempdir().unwrap();
        let (p, _) = open::<M>(&dir.path().join("pool"), 2, false).unwrap();
        let b = p.node_id_for("b").unwrap();
        let mut entry = [0u8; 64];
        p.meta.read(1024 + (b as u64 - 1) * 64, &mut entry).unwrap();
        p.meta.write(1024 + b as u64 * 64, &entry).unwrap();
        p.meta.flush(1024, 4096 - 1024).unwrap();
        assert_eq!(p.nodes().unwrap(), vec![(b, "b".to_owned())]);
        assert_eq!(p.node_id_for("b").unwrap(), b);
        let c = p.node_id_for("c").unwrap();
        assert_ne!(c, b);
        let mut id = [0u8; 4];
        p.meta.read(1024 + b as u64 * 64, &mut id).unwrap();
        assert_eq!(u32::from_le_bytes(id), c, "the repeat's slot holds the next node");
        assert_eq!(p.nodes().unwrap(), vec![(b, "b".to_owned()), (c, "c".to_owned())]);
    }
}

/// Every backend kind is in the suite's list: a kind added to `BackendKind`
/// fails to compile here until it is named, and then fails this test until
/// the suite runs on it.
#[test]
fn every_backend_kind_is_in_the_suite() {
    for k in [BackendKind::Shm, BackendKind::Dax, BackendKind::NoncoherentTest] {
        match k {
            BackendKind::Shm | BackendKind::Dax | BackendKind::NoncoherentTest => {
                assert!(SUITE.contains(&k), "the conformance suite does not run on {}", k.as_str())
            }
        }
    }
}

#[test]
fn coherence_defaults_follow_the_backend() {
    let dir = tempfile::tempdir().unwrap();
    let modes = |p: &Pool| (p.coherence(), p.cache_mode());
    let (shm, _) = open::<Shm>(&dir.path().join("shm"), 1, false).unwrap();
    assert_eq!(modes(&shm), (Coherence::Hardware, CacheMode::Coherent));
    let (dax, _) = open::<Dax>(&dir.path().join("dax"), 1, false).unwrap();
    assert_eq!(modes(&dax), (Coherence::Software, CacheMode::Lines));
    let (nc, _) = open::<Noncoherent>(&dir.path().join("nc"), 1, false).unwrap();
    assert_eq!(modes(&nc), (Coherence::Software, CacheMode::Private));
    let g = Geometry::for_capacity(REGION, REGION, PAGE, backend::DAX_ALIGN).unwrap();
    let shm_sw =
        ShmBackend::open(&dir.path().join("shm"), g.pool_size, false).unwrap().with_coherence(Coherence::Software);
    assert_eq!(modes(&Pool::open(Box::new(shm_sw), &opts(false)).unwrap().0), (Coherence::Software, CacheMode::Lines));
    let dax_hw = DaxBackend::open(&dir.path().join("dax")).unwrap().with_coherence(Coherence::Hardware);
    assert_eq!(
        modes(&Pool::open(Box::new(dax_hw), &opts(false)).unwrap().0),
        (Coherence::Hardware, CacheMode::Coherent)
    );
    let dax_auto = DaxBackend::open(&dir.path().join("dax")).unwrap().with_coherence(Coherence::Auto);
    assert_eq!(dax_auto.coherence(), Coherence::Software);
}

#[test]
fn shm_refuses_size_change_without_format() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool");
    drop(ShmBackend::open(&path, 8 << 20, false).unwrap());
    assert_eq!(ShmBackend::open(&path, 16 << 20, false).unwrap_err().kind(), ErrorKind::FailedPrecondition);
    assert_eq!(ShmBackend::open(&path, 16 << 20, true).unwrap().size(), 16 << 20);
}

#[test]
fn dax_never_creates() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(DaxBackend::open(&dir.path().join("nope")).unwrap_err().kind(), ErrorKind::Io);
}

#[test]
fn renewing_a_region_at_the_last_generation_wraps() {
    // Found by the `pool` fuzz target: a pool file whose region table gives
    // one of this node's regions generation u64::MAX made the renewal at
    // start-up overflow (a panic with overflow checks).
    let dir = tempfile::tempdir().unwrap();
    let (p, _) = open::<Shm>(&dir.path().join("pool"), 2, false).unwrap();
    let r = p.claim_region(NodeId(1)).unwrap().unwrap();
    p.entry(r.0, 1).unwrap().store(u64::MAX, Ordering::Release);
    assert_eq!(p.renew_region(r, NodeId(1)).unwrap().generation, 0);
    assert_eq!(p.region_state(r).unwrap(), RegionState { owner: Some(NodeId(1)), generation: 0 });
}
