//! Storage behind a pool file. A pool file on tmpfs is sparse: its pages get
//! memory only when first touched, and a store into a page the filesystem
//! has no room for raises SIGBUS — in the sidecar, and in every client that
//! maps the pool (the LLM server itself). A pool larger than its filesystem
//! (a container's 64 MiB /dev/shm is the common case) must therefore get its
//! storage before any page of a region is handed out: `back` allocates a
//! range up front, so running out of room is an answer, never a signal.
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{fallocate, FallocateFlags};

use crate::error::{Error, Result};

/// Make sure `len` bytes at `offset` of `file` have storage: true when they
/// do (or cannot lack it: a device, or a filesystem that does not allocate
/// ahead), false when the filesystem has no room for them.
pub fn back(file: &File, path: &Path, offset: u64, len: u64) -> Result<bool> {
    if !file.metadata().map_err(|e| Error::io("stat pool file", e))?.file_type().is_file() {
        return Ok(true); // a device: its memory is all there
    }
    match fallocate(file, FallocateFlags::empty(), offset as i64, len as i64) {
        Ok(()) | Err(Errno::EOPNOTSUPP) => Ok(true),
        Err(Errno::ENOSPC) => Ok(false),
        Err(e) => Err(Error::io(format!("allocate {len} bytes at {offset} of pool file {}", path.display()), e)),
    }
}

/// Bytes of a pool file that have no storage yet, against what its
/// filesystem has free: `Some((unbacked, free))` when the file cannot grow
/// into all of its size. None for devices and files that can.
pub fn shortfall(file: &File) -> Result<Option<(u64, u64)>> {
    let meta = file.metadata().map_err(|e| Error::io("stat pool file", e))?;
    if !meta.file_type().is_file() {
        return Ok(None);
    }
    let unbacked = meta.len().saturating_sub(meta.blocks() * 512);
    let fs = nix::sys::statvfs::fstatvfs(file).map_err(|e| Error::io("statvfs of the pool file", e))?;
    let free = fs.blocks_available() as u64 * fs.fragment_size() as u64;
    Ok((unbacked > free).then_some((unbacked, free)))
}
