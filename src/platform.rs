//! The few low-level helpers every layer may use, and nothing else: a
//! wall clock in Unix milliseconds (deadlines on the wire, pool stamps),
//! the CPU's prefetch hint (the registry and the eviction policies overlap a
//! batch's cache misses with it) and a thread's scheduling priority (work
//! that must not compete with the request path on equal terms). Kept apart from the pool so the registry
//! and eviction depend on this small module, not on the pool.
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

/// Lower the calling thread's scheduling priority by `nice` steps (Linux's
/// nice value is per thread). Lowering needs no privilege.
#[allow(unsafe_code)]
pub fn lower_thread_priority(nice: i32) -> std::io::Result<()> {
    let tid = nix::unistd::gettid().as_raw() as nix::libc::id_t;
    // SAFETY: setpriority takes three integers and touches no memory of
    // ours; a bad argument is an error return, not undefined behaviour.
    if unsafe { nix::libc::setpriority(nix::libc::PRIO_PROCESS, tid, nice) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
