//! Memory mappings of the pool, the OS calls around them, and where the
//! cache-line flushes that make writes visible to other hosts when the pool
//! memory is not coherent are applied (the instructions themselves are
//! `cpu.rs`'s). With `cpu.rs`, the only place in cxlkv with `unsafe`;
//! everything above this module works with offsets and bounds-checked
//! copies.
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicU32, AtomicU64};

use memmap2::{Advice, MmapOptions, MmapRaw};
use nix::fcntl::{fcntl, FcntlArg};
use nix::libc;

use crate::cpu;
use crate::error::{Error, ErrorKind, Result};

/// Cache lines are 64 bytes on every CPU cxlkv runs on; flushes and
/// invalidations work on whole lines.
pub const LINE: u64 = cpu::LINE as u64;

/// How a mapping's cached lines are kept in agreement with pool memory that
/// other hosts read and write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheMode {
    /// The hardware keeps every host's caches coherent: `flush` and
    /// `invalidate` do nothing.
    Coherent,
    /// Not coherent across hosts: `flush` writes lines back (`clwb`, else
    /// `clflushopt`, else `clflush`) and fences; `invalidate` evicts them
    /// (`clflushopt`, else `clflush`) and fences.
    Lines,
    /// The test backend: a private copy-on-write mapping stands for this
    /// process's cache. It starts as a copy of the file; `flush` writes lines
    /// from it to the file, `invalidate` reads lines from the file into it
    /// (and so drops unflushed writes of this process in those lines).
    Private,
}

/// One mapping of a byte range of the pool (a region or the metadata area).
#[derive(Debug)]
pub struct Mapping {
    map: MmapRaw,
    writable: bool,
    mode: CacheMode,
    /// Private mode: the pool file (own descriptor) and where this mapping
    /// starts in it.
    backing: Option<(File, u64)>,
}

impl Mapping {
    pub fn map(file: &File, pool_offset: u64, len: usize, writable: bool, mode: CacheMode) -> Result<Self> {
        let mut opts = MmapOptions::new();
        opts.offset(pool_offset).len(len);
        let what = || format!("mmap {len} bytes at offset {pool_offset}");
        if mode == CacheMode::Private {
            // SAFETY: a private mapping: changes others make to the file are
            // not promised to show, which is its purpose here. The bytes are
            // only reached through raw pointers below, never as Rust slices,
            // so later changes to the file cannot break aliasing rules.
            let map = MmapRaw::from(unsafe { opts.map_copy(file) }.map_err(|e| Error::io(what(), e))?);
            let backing = file.try_clone().map_err(|e| Error::io("duplicate the pool file descriptor", e))?;
            let m = Self { map, writable, mode, backing: Some((backing, pool_offset)) };
            // Own every page now (copy-on-write), so this "cache" holds the
            // pool as it was when mapped and never sees later writes to the
            // file unless it invalidates: untouched private pages would
            // otherwise still show the file.
            m.copy_in(0, len)?;
            return Ok(m);
        }
        let map = if writable { opts.map_raw(file) } else { opts.map_raw_read_only(file) }
            .map_err(|e| Error::io(what(), e))?;
        Ok(Self { map, writable, mode, backing: None })
    }

    pub fn mode(&self) -> CacheMode {
        self.mode
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

    /// Copy `src` into the mapping at `off` so that, when this returns, the
    /// bytes are in memory for other hosts and ordered before any later store
    /// of this thread (the commit word): `write` + `flush` in one pass. With
    /// software coherence, objects of `STREAM_MIN` bytes and more go out with
    /// streaming stores (no read-for-ownership, nothing left to write back)
    /// and only their partial head and tail lines are written back; then one
    /// `sfence`. With hardware coherence it is a plain `write`.
    pub fn write_through(&self, off: u64, src: &[u8]) -> Result<()> {
        self.write_streaming(off, src)?;
        self.fence();
        Ok(())
    }

    /// `write_through` without its fence, for a writer that copies a batch
    /// of objects and then fences once (as the plugin does): the bytes are
    /// on their way to memory, and this thread's next `fence` orders them
    /// before its later stores. Until then they are not in memory: fence
    /// before the records that commit them are written.
    pub fn write_streaming(&self, off: u64, src: &[u8]) -> Result<()> {
        if self.mode == CacheMode::Coherent {
            return self.write(off, src);
        }
        if !self.writable {
            return Err(Error::precondition("mapping is read-only"));
        }
        let at = self.check(off, src.len())?;
        match self.mode {
            // The test backend copies out at once, as its `write_back` does.
            CacheMode::Private => {
                let mut model = Model { map: self, pending: vec![] };
                through(&mut model, at, src);
                model.copy_out()
            }
            _ => {
                through(&mut Cpu { base: self.map.as_mut_ptr() }, at, src);
                Ok(())
            }
        }
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

    /// Make this process's writes to the lines of `off..off + len` visible
    /// to other hosts, and order them before any later store (the commit
    /// word that publishes them).
    pub fn flush(&self, off: u64, len: usize) -> Result<()> {
        self.write_back(off, len)?;
        self.fence();
        Ok(())
    }

    /// `flush` without its fence: the lines are on their way to memory, and
    /// a later `fence` of this thread orders them before its next store.
    /// For many small writes that one fence covers (object records).
    pub fn write_back(&self, off: u64, len: usize) -> Result<()> {
        let (lo, hi) = self.lines(off, len)?;
        match self.mode {
            CacheMode::Coherent => {}
            CacheMode::Lines => cpu::write_back_lines(self.map.as_ptr().wrapping_add(lo), hi - lo),
            // A read-only mapping has no dirty lines: writing its (possibly
            // stale) copy back would undo other hosts' writes.
            CacheMode::Private if !self.writable => {}
            CacheMode::Private => self.copy_out(lo, hi - lo)?,
        }
        Ok(())
    }

    /// Order this thread's write-backs (`write_back`) and streaming stores
    /// before its later stores. (The test backend copies out at once.)
    pub fn fence(&self) {
        if self.mode == CacheMode::Lines {
            cpu::sfence();
        }
    }

    /// Drop this process's cached copy of the lines of `off..off + len`, so
    /// the reads after it see what other hosts flushed. Never call it on
    /// lines with own writes not yet flushed: the test backend loses them.
    pub fn invalidate(&self, off: u64, len: usize) -> Result<()> {
        let (lo, hi) = self.lines(off, len)?;
        match self.mode {
            CacheMode::Coherent => {}
            CacheMode::Lines => cpu::evict(self.map.as_ptr().wrapping_add(lo), hi - lo),
            CacheMode::Private => self.copy_in(lo, hi - lo)?,
        }
        Ok(())
    }

    /// The whole cache lines that cover `off..off + len`, clipped to the
    /// mapping (which starts and ends on a page boundary).
    fn lines(&self, off: u64, len: usize) -> Result<(usize, usize)> {
        let start = self.check(off, len)?;
        let lo = start & !(LINE as usize - 1);
        let hi = (start + len).next_multiple_of(LINE as usize).min(self.map.len());
        Ok((lo, hi))
    }

    /// Private mode: the file's bytes at `at..at + n` (mapping offsets) into
    /// the private mapping.
    fn copy_in(&self, at: usize, n: usize) -> Result<()> {
        let Some((file, base)) = &self.backing else { return Ok(()) };
        let mut done = 0;
        while done < n {
            // SAFETY: at + n is inside the live mapping (callers clip to it)
            // and the private mapping is always writable (map_copy); the
            // kernel copies into it, no Rust reference to it exists.
            let r = unsafe {
                libc::pread(
                    file.as_raw_fd(),
                    self.map.as_mut_ptr().add(at + done).cast(),
                    n - done,
                    (*base + (at + done) as u64) as libc::off_t,
                )
            };
            match r {
                r if r > 0 => done += r as usize,
                0 => return Err(Error::new(ErrorKind::Internal, "pool file ends inside a mapping")),
                _ => {
                    return Err(Error::io("read the pool file into a private mapping", std::io::Error::last_os_error()))
                }
            }
        }
        Ok(())
    }

    /// Private mode: the private mapping's bytes at `at..at + n` into the file.
    fn copy_out(&self, at: usize, n: usize) -> Result<()> {
        let Some((file, base)) = &self.backing else { return Ok(()) };
        let mut done = 0;
        while done < n {
            // SAFETY: at + n is inside the live mapping (callers clip to it);
            // the kernel reads from it, no Rust reference to it exists.
            let r = unsafe {
                libc::pwrite(
                    file.as_raw_fd(),
                    self.map.as_ptr().add(at + done).cast(),
                    n - done,
                    (*base + (at + done) as u64) as libc::off_t,
                )
            };
            if r <= 0 {
                return Err(Error::io(
                    "write a private mapping back to the pool file",
                    std::io::Error::last_os_error(),
                ));
            }
            done += r as usize;
        }
        Ok(())
    }

    /// Fault every page in now so the first store does not pay for it.
    pub fn prefault(&self) -> Result<()> {
        if self.mode == CacheMode::Private {
            return Ok(()); // every page was copied in when mapped
        }
        match self.map.advise(Advice::PopulateWrite) {
            Ok(()) => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {} // a kernel before 5.14
            // Pages that cannot be had (no room, a memory limit): touching
            // them would raise SIGBUS or wake the OOM killer instead.
            Err(e) => return Err(Error::io("prefault a region of the pool", e)),
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

/// From this size on, a software-coherent `write_through` streams. Every line
/// must reach memory anyway; streaming stores get it there without reading
/// it first, and on the reference VM they beat plain stores + `clwb` at every
/// size measured (docs/benchmark-findings.md, "Software coherence"). Below
/// two lines a whole aligned line may not exist, so the cut sits where a
/// streamed line first can.
pub const STREAM_MIN: usize = 2 * LINE as usize;

/// The steps of a `write_through`, so that the test backend runs the same
/// sequence as the CPU path (`Model`): leaving out the fence or a write-back
/// there leaves bytes out of the pool file, which tests/coherence.rs sees.
trait Steps {
    /// Plain stores: the bytes sit in this host's cache.
    fn store(&mut self, at: usize, src: &[u8]);
    /// Streaming stores of whole, aligned lines: on their way to memory,
    /// ordered by the next fence.
    fn stream(&mut self, at: usize, src: &[u8]);
    /// Start writing back the lines that cover `at..at + len`.
    fn write_back(&mut self, at: usize, len: usize);
}

/// `at..at + src.len()` is inside the mapping (checked by the caller).
/// Unfenced: the caller fences.
fn through(s: &mut impl Steps, at: usize, src: &[u8]) {
    let n = src.len();
    let line = LINE as usize;
    // Streaming stores write whole aligned lines: the partial lines around
    // them are plain stores that must be written back.
    let head = if n < STREAM_MIN { n } else { ((line - at % line) % line).min(n) };
    let body = (n - head) & !(line - 1);
    s.store(at, &src[..head]);
    s.write_back(at, head);
    s.stream(at + head, &src[head..head + body]);
    s.store(at + head + body, &src[head + body..]);
    s.write_back(at + head + body, n - head - body);
}

/// The CPU's instructions on a shared mapping (`CacheMode::Lines`).
struct Cpu {
    base: *mut u8,
}

impl Steps for Cpu {
    fn store(&mut self, at: usize, src: &[u8]) {
        // SAFETY: `through` passes ranges inside the live, writable mapping
        // (its caller checked them); `src` is a separate Rust allocation.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.base.add(at), src.len()) };
    }
    fn stream(&mut self, at: usize, src: &[u8]) {
        // SAFETY: as in `store`; `at` and the length are whole lines (the
        // mapping starts on a page), as `cpu::stream` needs.
        unsafe { cpu::stream(self.base.add(at), src) };
    }
    fn write_back(&mut self, at: usize, len: usize) {
        if len > 0 {
            let lo = at & !(LINE as usize - 1);
            cpu::write_back_lines(self.base.wrapping_add(lo), at + len - lo);
        }
    }
}

/// The test backend (`CacheMode::Private`): stores land in the private
/// mapping (the "cache"); streamed and written-back lines reach the pool file
/// when the write ends (the backend's `write_back` copies out at once too),
/// never before: a write that skipped its write-backs leaves the file stale.
struct Model<'a> {
    map: &'a Mapping,
    pending: Vec<(usize, usize)>,
}

impl Steps for Model<'_> {
    fn store(&mut self, at: usize, src: &[u8]) {
        Cpu { base: self.map.map.as_mut_ptr() }.store(at, src);
    }
    fn stream(&mut self, at: usize, src: &[u8]) {
        self.store(at, src);
        self.pending.push((at, src.len()));
    }
    fn write_back(&mut self, at: usize, len: usize) {
        self.pending.push((at, len));
    }
}

impl Model<'_> {
    /// What a fence does to the streamed and written-back lines.
    fn copy_out(&mut self) -> Result<()> {
        for (at, len) in std::mem::take(&mut self.pending) {
            if len > 0 {
                let (lo, hi) = self.map.lines(at as u64, len)?;
                self.map.copy_out(lo, hi - lo)?;
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

/// Whether another open file description holds a lock on a byte of
/// `start..start + len` of `file`: another process's node id on the pool.
pub fn locked_elsewhere(file: &File, start: u64, len: u64) -> Result<bool> {
    // SAFETY: `flock` is a plain C struct; all-zero is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as _;
    fl.l_whence = libc::SEEK_SET as _;
    fl.l_start = start as _;
    fl.l_len = len as _;
    fcntl(file.as_fd(), FcntlArg::F_OFD_GETLK(&mut fl)).map_err(|e| Error::io("query node locks", e))?;
    Ok(fl.l_type != libc::F_UNLCK as libc::c_short)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_flushes_keep_bytes_and_stay_in_bounds() {
        let dir = tempfile::tempdir().unwrap();
        let f = File::options().read(true).write(true).create(true).truncate(true).open(dir.path().join("p")).unwrap();
        f.set_len(8192).unwrap();
        let m = Mapping::map(&f, 0, 8192, true, CacheMode::Lines).unwrap();
        m.write(100, b"payload").unwrap();
        m.flush(100, 7).unwrap();
        m.invalidate(0, 8192).unwrap();
        let mut b = [0u8; 7];
        m.read(100, &mut b).unwrap();
        assert_eq!(&b, b"payload");
        assert_eq!(m.flush(8190, 7).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(m.invalidate(u64::MAX, 1).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(m.lines(65, 1).unwrap(), (64, 128));
        assert_eq!(m.lines(8191, 1).unwrap(), (8128, 8192));
    }
}
