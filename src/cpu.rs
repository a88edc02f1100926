//! Every CPU-specific instruction of the sidecar, in one module (a test in
//! tests/layering.rs keeps it so): the cache-line write-backs, evictions
//! and fences that software coherence needs (`pool/mapping.rs` applies
//! them to the pool's mappings), streaming stores, and the prefetch hint
//! (`platform::prefetch`). x86-64 has them all; on other architectures
//! only the fences are issued and the rest are plain code or nothing.
//! A leaf: it imports nothing from the crate.

/// A cache line, the unit every instruction here works on.
pub const LINE: usize = 64;

/// Cache-line write-back and eviction for memory that is not coherent across
/// hosts. `clwb` writes a line back and may keep it cached (a writer reads
/// its own lines again); `clflushopt` writes back if dirty and evicts (a
/// reader must not keep a stale copy); both need CPUID checks, and `clflush`
/// (every x86-64 CPU has it, serialising and slower) is the fallback. The
/// stable `core::arch` has no intrinsics for the first two, hence `asm!`.
#[cfg(target_arch = "x86_64")]
mod x86_64 {
    use std::arch::asm;
    use std::arch::x86_64::{
        __cpuid, __cpuid_count, _mm256_loadu_si256, _mm256_stream_si256, _mm_clflush, _mm_loadu_si128, _mm_mfence,
        _mm_prefetch, _mm_sfence, _mm_stream_si128, _MM_HINT_T0,
    };
    use std::sync::OnceLock;

    use super::LINE;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Insn {
        Clwb,
        Clflushopt,
        Clflush,
    }

    /// (write-back, evict) instructions this CPU has.
    pub fn insns() -> (Insn, Insn) {
        static CHOSEN: OnceLock<(Insn, Insn)> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            // SAFETY: CPUID exists on every x86-64 CPU; leaf 7 is asked only
            // when leaf 0 says it exists. (These are safe functions in newer
            // Rust, unsafe in the oldest release this crate supports.)
            #[allow(unused_unsafe)]
            let ebx = unsafe {
                if __cpuid(0).eax >= 7 {
                    __cpuid_count(7, 0).ebx
                } else {
                    0
                }
            };
            let (opt, wb) = (ebx & (1 << 23) != 0, ebx & (1 << 24) != 0);
            let evict = if opt { Insn::Clflushopt } else { Insn::Clflush };
            (if wb { Insn::Clwb } else { evict }, evict)
        })
    }

    fn each_line(p: *const u8, len: usize, insn: Insn) {
        let mut off = 0;
        while off < len {
            let l = p.wrapping_add(off);
            // SAFETY: callers pass a range inside a live mapping. These
            // instructions only move cache lines between this CPU's caches
            // and memory; they change no byte's value, and `insns` chose
            // only instructions CPUID reports. Without `nomem` the asm is
            // also a compiler barrier: stores before it are not moved after.
            unsafe {
                match insn {
                    Insn::Clwb => asm!("clwb [{0}]", in(reg) l, options(nostack, preserves_flags)),
                    Insn::Clflushopt => asm!("clflushopt [{0}]", in(reg) l, options(nostack, preserves_flags)),
                    Insn::Clflush => _mm_clflush(l),
                }
            }
            off += LINE;
        }
    }

    /// Write back every line of `p..p + len`, unfenced: an `sfence` after
    /// them completes the write-backs before any later store (a commit word)
    /// becomes visible.
    pub fn write_back_lines(p: *const u8, len: usize) {
        each_line(p, len, insns().0);
    }

    pub fn sfence() {
        // SAFETY: a fence has no memory operands.
        unsafe { _mm_sfence() };
    }

    /// Copy `src` to `d` with streaming (non-temporal) stores, unfenced.
    ///
    /// # Safety
    /// `d..d + src.len()` is writable, outside `src`, and `d` and the length
    /// are multiples of 64.
    pub unsafe fn stream(d: *mut u8, src: &[u8]) {
        static AVX: OnceLock<bool> = OnceLock::new();
        if *AVX.get_or_init(|| std::arch::is_x86_feature_detected!("avx")) {
            // SAFETY: the CPU has AVX (checked above); the caller's promise.
            unsafe { stream_avx(d, src) }
        } else {
            // SAFETY: the caller's promise.
            unsafe { stream_sse2(d, src) }
        }
    }

    #[target_feature(enable = "avx")]
    unsafe fn stream_avx(d: *mut u8, src: &[u8]) {
        let s = src.as_ptr();
        let mut i = 0;
        while i < src.len() {
            // SAFETY: i + 64 <= len (a multiple of 64); the loads are
            // unaligned, the stores 32-byte aligned as `stream` requires.
            unsafe {
                let a = _mm256_loadu_si256(s.add(i).cast());
                let b = _mm256_loadu_si256(s.add(i + 32).cast());
                _mm256_stream_si256(d.add(i).cast(), a);
                _mm256_stream_si256(d.add(i + 32).cast(), b);
            }
            i += 64;
        }
    }

    unsafe fn stream_sse2(d: *mut u8, src: &[u8]) {
        let s = src.as_ptr();
        let mut i = 0;
        while i < src.len() {
            // SAFETY: as in `stream_avx`, 16-byte aligned stores.
            unsafe {
                for j in (0..64).step_by(16) {
                    _mm_stream_si128(d.add(i + j).cast(), _mm_loadu_si128(s.add(i + j).cast()));
                }
            }
            i += 64;
        }
    }

    /// Evict every line of `p..p + len`, then `mfence`: later loads of the
    /// range miss the cache and read memory.
    pub fn evict(p: *const u8, len: usize) {
        each_line(p, len, insns().1);
        // SAFETY: a fence has no memory operands.
        unsafe { _mm_mfence() };
    }

    #[inline(always)]
    pub fn prefetch_line(p: *const u8) {
        // SAFETY: a prefetch only hints the cache: it reads nothing into the
        // program and cannot fault, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
    }
}

#[cfg(target_arch = "x86_64")]
pub use x86_64::*;

/// Other architectures: no cache maintenance is implemented, only the
/// ordering (software coherence there is not supported yet).
#[cfg(not(target_arch = "x86_64"))]
mod other {
    use std::sync::atomic::{fence, Ordering};
    pub fn evict(_p: *const u8, _len: usize) {
        fence(Ordering::SeqCst);
    }
    pub fn write_back_lines(_p: *const u8, _len: usize) {}
    pub fn sfence() {
        fence(Ordering::SeqCst);
    }
    /// # Safety
    /// `d..d + src.len()` is writable and outside `src`.
    pub unsafe fn stream(d: *mut u8, src: &[u8]) {
        // SAFETY: the caller's promise.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), d, src.len()) };
    }
    #[inline(always)]
    pub fn prefetch_line(_p: *const u8) {}
}

#[cfg(not(target_arch = "x86_64"))]
pub use other::*;

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn flush_instructions_match_cpuid() {
        let (wb, evict) = insns();
        // An evicting instruction is never clwb, and clwb is preferred for
        // write-back only where the CPU has it (checked with /proc/cpuinfo).
        assert_ne!(evict, Insn::Clwb);
        let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let has = |f: &str| flags.split_whitespace().any(|w| w == f);
        if !flags.is_empty() {
            assert_eq!(wb == Insn::Clwb, has("clwb"));
            assert_eq!(evict == Insn::Clflushopt, has("clflushopt"));
        }
    }
}
