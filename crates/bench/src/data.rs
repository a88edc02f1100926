//! The bytes the data-path figures copy: batches of filled buffers, the
//! pool mapped as a client of the mapped data path maps it, and a client
//! that stores through that path.
use std::path::Path;

use bytes::Bytes;
use cxlkv::client::{connect_uds, Client};
use cxlkv::proto;

/// Objects per batch in every data-path figure.
pub const BATCH: usize = 32;

/// `n` bytes, every page written (so no timing pays a first touch).
pub fn touched(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// The pool mapped read-write, as a client of the mapped data path maps it.
pub fn map_pool(info: &proto::PoolInfoReply) -> memmap2::MmapMut {
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&info.path).unwrap();
    // SAFETY: the pool file stays mapped and sized while the bench runs; the
    // bench writes only ranges the sidecar reserved for it and reads only
    // objects it holds locks on.
    #[allow(unsafe_code)]
    unsafe {
        memmap2::MmapOptions::new().len(info.pool_size as usize).map_mut(&f).unwrap()
    }
}

/// A Reserve item's status when admission declined it (google.rpc ABORTED).
pub const NOT_ADMITTED: u32 = 10;

/// A client storing objects of one size as LMCache's adapter does: Reserve
/// a batch, copy each reserved object into its pages, Commit what it copied.
pub struct Writer {
    pub c: Client,
    map: memmap2::MmapMut,
    pub info: proto::PoolInfoReply,
    src: Vec<u8>,
    pub object: usize,
}

/// What one store call did.
pub struct Stored {
    /// Bytes copied into the pool (the objects admitted).
    pub copied: u64,
    /// Objects admission declined (nothing reserved for them).
    pub refused: usize,
    /// Entries the Reserve evicted.
    pub evicted: u32,
}

impl Writer {
    /// Connected to the sidecar at `socket`, its pool mapped; every object
    /// stored is `touched(object, seed)`.
    pub async fn open(socket: &Path, object: usize, seed: u8) -> Self {
        let mut c = connect_uds(socket).await.unwrap();
        let info = c.pool_info(proto::PoolInfoRequest {}).await.unwrap().into_inner();
        let map = map_pool(&info);
        Self { c, map, info, src: touched(object, seed), object }
    }

    /// One store call of `keys` (tenant "b"); any other failure panics.
    pub async fn store(&mut self, keys: Vec<Bytes>) -> Stored {
        let items =
            keys.into_iter().map(|key| proto::ReserveItem { key, size: self.object as u64, ..Default::default() });
        let req = proto::ReserveRequest { tenant: "b".into(), items: items.collect(), ..Default::default() };
        let r = self.c.reserve(req).await.unwrap().into_inner();
        let (mut ids, mut refused) = (vec![], 0);
        for x in &r.reservations {
            let code = x.status.as_ref().unwrap().code;
            if code == NOT_ADMITTED {
                refused += 1; // a skipped store
                continue;
            }
            assert_eq!(code, 0, "reserve failed: {x:?}");
            let l = x.location.as_ref().unwrap();
            let at = (self.info.data_offset + l.region as u64 * self.info.region_size + l.offset) as usize;
            self.map[at..at + self.object].copy_from_slice(&self.src);
            ids.push(x.reservation_id);
        }
        let copied = (ids.len() * self.object) as u64;
        if !ids.is_empty() {
            self.c.commit(proto::CommitRequest { reservation_ids: ids, crc32: vec![], keys: vec![] }).await.unwrap();
        }
        Stored { copied, refused, evicted: r.evicted }
    }
}
