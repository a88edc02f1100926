//! The few low-level helpers every layer may use, and nothing else: a
//! wall clock in Unix milliseconds (deadlines on the wire, pool stamps),
//! the CPU's prefetch hint (the registry and the eviction policies overlap a
//! batch's cache misses with it) and a thread's scheduling priority (work
//! that must not compete with the request path on equal terms). Kept apart
//! from the pool so the registry and eviction depend on this small module,
//! not on the pool.
use std::time::{SystemTime, UNIX_EPOCH};

use crate::cpu::{prefetch_line, LINE};

pub fn now_unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Start loading the cache lines of `*r` without waiting for them (a hint).
/// Batched registry lookups issue these for every key before touching any, so
/// the misses overlap; a plain load would hold its place in the CPU's window
/// until the data arrives.
#[inline(always)]
pub fn prefetch<T>(r: &T) {
    let p = (r as *const T).cast::<u8>();
    let len = std::mem::size_of::<T>().max(1);
    let mut off = 0;
    while off < len {
        prefetch_line(p.wrapping_add(off));
        off += LINE;
    }
    prefetch_line(p.wrapping_add(len - 1)); // an unaligned value's last line
}

/// Lower the calling thread's scheduling priority by `steps` nice steps
/// from where it is (a sidecar already run niced goes lower still, never
/// higher). On Linux `nice` moves the calling thread only. Lowering needs
/// no privilege.
#[allow(unsafe_code)]
pub fn lower_thread_priority(steps: i32) -> std::io::Result<()> {
    nix::errno::Errno::clear();
    // SAFETY: nice takes an integer and touches no memory of ours; a bad
    // argument is an error return, not undefined behaviour.
    let r = unsafe { nix::libc::nice(steps.max(0)) };
    // -1 is also a valid new nice value: only errno tells a failure.
    if r == -1 && nix::errno::Errno::last_raw() != 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}
