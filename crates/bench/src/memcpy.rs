//! `cxlkv-bench memcpy`: the physical limit every data-path figure is a
//! ratio to — single-thread copies of a batch of distinct objects between
//! prefaulted buffers.
use std::time::Instant;

use crate::data::{touched, BATCH};
use crate::figures::{bench, label, pct};

pub fn memcpy(sizes: &[usize], bytes: usize, reps: usize) {
    for &size in sizes {
        let count = (bytes / size).max(BATCH);
        // A batch of distinct objects, as the data path copies them.
        let src: Vec<Vec<u8>> = (0..BATCH).map(|i| touched(size, i as u8)).collect();
        let mut dst: Vec<Vec<u8>> = (0..BATCH).map(|_| touched(size, 0)).collect();
        let mut rates = vec![];
        for _ in 0..reps {
            let t = Instant::now();
            for i in 0..count {
                let j = i % src.len();
                dst[j].copy_from_slice(&src[j]);
            }
            rates.push((count * size) as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        std::hint::black_box(&dst);
        bench(&format!("memcpy_gbps_{}", label(size)), pct(&mut rates, 0.5));
    }
}
