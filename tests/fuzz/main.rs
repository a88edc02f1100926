//! Fuzz targets for every decoder of untrusted bytes: the pool superblock,
//! the region and page tables of a pool file someone else wrote, its node
//! table, and gRPC
//! requests through the real codec, validation and handler. See
//! docs/FUZZING.md. `cargo test` runs a short smoke run of each (fixed seed);
//! `scripts/fuzz.sh` runs the long ones (`CXLKV_FUZZ_INPUTS`).
#![deny(unsafe_code)]

mod driver;
mod nodes;
mod pool;
mod request;
mod superblock;

use driver::{run, Settings};

/// Scratch space on tmpfs when there is one, like a real pool.
pub fn scratch_dir() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        if let Ok(d) = tempfile::Builder::new().prefix("cxlkv-fuzz").tempdir_in(shm) {
            return d;
        }
    }
    tempfile::tempdir().unwrap()
}

#[test]
fn superblock() {
    run(&mut superblock::SuperblockTarget, &Settings::from_env(1_000_000));
}

#[test]
fn nodes() {
    run(&mut nodes::NodesTarget::new(), &Settings::from_env(50_000));
}

#[test]
fn pool() {
    run(&mut pool::PoolTarget::new(), &Settings::from_env(40_000));
}

#[test]
fn request() {
    run(&mut request::RequestTarget::new(), &Settings::from_env(100_000));
}
