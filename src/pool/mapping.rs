//! The only place in cxlkv with `unsafe`: memory mappings of the pool and the
//! OS calls around them. Everything above this module works with offsets and
//! bounds-checked copies.
use std::fs::File;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU32, AtomicU64};

use memmap2::{Advice, MmapOptions, MmapRaw};
use nix::fcntl::{fcntl, FcntlArg};
use nix::libc;

use crate::error::{Error, ErrorKind, Result};

/// One mapping of a byte range of the pool (a region or the metadata area).
#[derive(Debug)]
pub struct Mapping {
    map: MmapRaw,
    writable: bool,
}

impl Mapping {
    pub fn map(file: &File, pool_offset: u64, len: usize, writable: bool) -> Result<Self> {
        let mut opts = MmapOptions::new();
        opts.offset(pool_offset).len(len);
        let map = if writable { opts.map_raw(file) } else { opts.map_raw_read_only(file) }
            .map_err(|e| Error::io(format!("mmap {len} bytes at offset {pool_offset}"), e))?;
        Ok(Self { map, writable })
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }
    pub fn writable(&self) -> bool {
        self.writable
    }

    fn check(&self, off: u64, len: usize) -> Result<usize> {
        let end = off.checked_add(len as u64).ok_or_else(|| Error::invalid("offset overflow"))?;
        if end > self.map.len() as u64 {
            return Err(Error::invalid(format!("range {off}+{len} outside mapping of {} bytes", self.map.len())));
        }
        Ok(off as usize)
    }

    /// Copy `src` into the mapping at `off`.
    pub fn write(&self, off: u64, src: &[u8]) -> Result<()> {
        if !self.writable {
            return Err(Error::precondition("mapping is read-only"));
        }
        let off = self.check(off, src.len())?;
        // SAFETY: `check` proved off+len is inside the live mapping, which is
        // writable; `src` is a separate Rust allocation, so no overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.map.as_mut_ptr().add(off), src.len()) };
        Ok(())
    }

    /// Copy bytes at `off` into `dst`.
    pub fn read(&self, off: u64, dst: &mut [u8]) -> Result<()> {
        let off = self.check(off, dst.len())?;
        // SAFETY: `check` proved the source range is inside the live mapping;
        // `dst` is an exclusive Rust buffer outside it.
        unsafe { std::ptr::copy_nonoverlapping(self.map.as_ptr().add(off), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Shared 8-byte word used for cross-process state (region table).
    pub fn atomic_u64(&self, off: u64) -> Result<&AtomicU64> {
        let o = self.check(off, 8)?;
        if !self.writable || o % 8 != 0 || !(self.map.as_ptr() as usize + o).is_multiple_of(8) {
            return Err(Error::new(ErrorKind::Internal, "atomic word misaligned or read-only"));
        }
        // SAFETY: in bounds, 8-byte aligned, writable, and it lives as long as
        // `&self` (the mapping is unmapped only on drop). Other processes only
        // touch it atomically too.
        Ok(unsafe { &*(self.map.as_mut_ptr().add(o) as *const AtomicU64) })
    }

    /// Shared 4-byte word (page-table slots).
    pub fn atomic_u32(&self, off: u64) -> Result<&AtomicU32> {
        let o = self.check(off, 4)?;
        if !self.writable || !(self.map.as_ptr() as usize + o).is_multiple_of(4) {
            return Err(Error::new(ErrorKind::Internal, "atomic word misaligned or read-only"));
        }
        // SAFETY: in bounds, 4-byte aligned, writable, and it lives as long as
        // `&self`. Other processes only touch it atomically too.
        Ok(unsafe { &*(self.map.as_mut_ptr().add(o) as *const AtomicU32) })
    }

    /// Fault every page in now so the first store does not pay for it.
    pub fn prefault(&self) -> Result<()> {
        if self.map.advise(Advice::PopulateWrite).is_ok() {
            return Ok(());
        }
        // Older kernels: touch one byte per 4 KiB page (read, then write back).
        let base = self.map.as_mut_ptr();
        for o in (0..self.map.len()).step_by(4096) {
            // SAFETY: o < len, inside the mapping; volatile so the touch stays.
            unsafe {
                let p = base.add(o);
                p.write_volatile(p.read_volatile());
            }
        }
        Ok(())
    }
}

/// Take an open-file-description lock on byte `slot` of `file`. It is held
/// while `file` stays open and dropped by the kernel when the process dies,
/// which is how a node id is kept unique on one host.
pub fn try_lock_slot(file: &File, slot: u64) -> Result<bool> {
    // SAFETY: `flock` is a plain C struct; all-zero is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as _;
    fl.l_whence = libc::SEEK_SET as _;
    fl.l_start = slot as _;
    fl.l_len = 1;
    match fcntl(file.as_fd(), FcntlArg::F_OFD_SETLK(&fl)) {
        Ok(_) => Ok(true),
        Err(nix::errno::Errno::EAGAIN) | Err(nix::errno::Errno::EACCES) => Ok(false),
        Err(e) => Err(Error::io("lock node slot", e)),
    }
}

/// Start loading the cache lines of `*r` without waiting for them (a hint).
/// Batched registry lookups issue these for every key before touching any, so
/// the misses overlap; a plain load would hold its place in the CPU's window
/// until the data arrives. Kept here with the crate's other `unsafe`.
#[inline(always)]
pub fn prefetch<T>(r: &T) {
    let p = (r as *const T).cast::<u8>();
    let len = std::mem::size_of::<T>().max(1);
    let mut off = 0;
    while off < len {
        prefetch_line(p.wrapping_add(off));
        off += 64;
    }
    prefetch_line(p.wrapping_add(len - 1)); // an unaligned value's last line
}

#[inline(always)]
fn prefetch_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch only hints the cache: it reads nothing into the
    // program and cannot fault, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
