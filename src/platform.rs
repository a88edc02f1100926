//! The few low-level helpers every layer may use, and nothing else: a
//! wall clock in Unix milliseconds (deadlines on the wire, pool stamps) and
//! the CPU's prefetch hint (the registry and the eviction policies overlap a
//! batch's cache misses with it). Kept apart from the pool so the registry
//! and eviction depend on this small module, not on the pool.
use std::time::{SystemTime, UNIX_EPOCH};

pub fn now_unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Start loading the cache lines of `*r` without waiting for them (a hint).
/// Batched registry lookups issue these for every key before touching any, so
/// the misses overlap; a plain load would hold its place in the CPU's window
/// until the data arrives. The one `unsafe` outside the pool's mappings.
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
