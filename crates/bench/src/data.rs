//! The bytes the data-path figures copy: batches of filled buffers, and
//! the pool mapped as a client of the mapped data path maps it.
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
