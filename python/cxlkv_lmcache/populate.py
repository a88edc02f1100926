"""Page tables for the pool's regions in this process, made before a copy
needs them.

A copy into pages this process has not mapped yet takes a page fault per
4 KiB page (on a pool file in tmpfs, the default): a whole region's worth is
tens of milliseconds on one CPU, which the first store into each new region
paid in the engine's thread. The sidecar claims its next region before the
owned ones run out (and prefaults its own mapping); `Populator` follows it
here: a thread of its own maps every region the node owns into this process
as soon as the pool's region table shows it owned, so a store finds its
pages mapped. A region first touched before the thread got to it (another
node's, read across nodes) is mapped by the caller, once.

What it costs: the page tables a process would build anyway once its
stores had touched every region its node owns (8 bytes per 4 KiB page, 2 MiB
per GiB owned; 4 KiB per GiB on a DAX device's 2 MiB pages), built earlier.
No memory of the pool: the sidecar gives a region's pages their storage
before it owns the region (`Pool::claim_region`), so mapping it here
allocates nothing the engine's memory limit would be charged for.

`madvise(MADV_POPULATE_WRITE)` goes through ctypes, which releases the GIL
for the call: mapping a region never stalls the engine's Python threads.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import weakref

log = logging.getLogger("cxlkv_lmcache")

MADV_POPULATE_WRITE = 23
STATE_OWNED = 1  # region-table owner word: STATE_OWNED << 32 | node id
# Region-table scans at most this often, and never more than 1/SCAN_SHARE of
# the time (a pool of tens of thousands of regions takes milliseconds of
# Python, holding the GIL, to scan): a wake per store batch costs a flag,
# not a scan of the table.
SCAN_EVERY_S = 0.02
SCAN_SHARE = 200

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def populate(addr: int, n: int) -> bool:
    """Map [addr, addr+n) writable into this process now (the GIL released
    meanwhile); False where the kernel has no MADV_POPULATE_WRITE (pages
    then fault in on first touch, as before)."""
    return _libc.madvise(addr, n, MADV_POPULATE_WRITE) == 0


def _restart(p: "Populator | None") -> None:
    if p is not None:
        p._start()


class Populator:
    """Which regions this process has mapped, and the thread that maps the
    node's own regions ahead of need.

    `owners()` returns the region table's owner words (one per region);
    `region_addr(r)` the address of region r in this process. `ensure(r)`
    is what a copy calls before touching region r: it returns at once when
    the region is mapped, waits when the thread is mapping it, else maps it
    itself. `wake()` (each store batch) asks the thread to look for newly
    owned regions; `close()` stops it before the mapping goes away."""

    def __init__(self, node: int, region_bytes: int, region_addr, owners, ahead: bool = True):
        self._owned = (STATE_OWNED << 32) | node
        self._bytes = region_bytes
        self._addr = region_addr
        self._owners = owners
        self._ahead = ahead
        self._closed = False
        self._start()
        # A child forked meanwhile has neither the thread nor the parent's page
        # tables of a shared mapping (and would wait for ever on a region the
        # parent's thread was mapping): it starts afresh.
        me = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _restart(me()))

    def _start(self) -> None:
        self._cond = threading.Condition()  # guards what follows
        self._state: dict[int, threading.Event] = {}  # set once mapped
        self._active = 0  # madvise calls and table scans under way: close waits for them
        self._wakeup = threading.Event()
        self._thread = None
        if self._ahead and not self._closed:
            self._thread = threading.Thread(target=self._run, name="cxlkv-populate", daemon=True)
            self._thread.start()
            self._wakeup.set()  # the regions already owned, first

    def ensure(self, region: int) -> None:
        if not self.is_mapped(region):
            self._map(region)

    def is_mapped(self, region: int) -> bool:
        ev = self._state.get(region)
        return ev is not None and ev.is_set()

    def follow(self, node: int) -> None:
        """Map the regions `node` owns from now on (a sidecar restarted on
        the same pool under another node id keeps this mapping)."""
        with self._cond:
            self._owned = (STATE_OWNED << 32) | node
        self.wake()

    def wake(self) -> None:
        if self._thread is not None:
            self._wakeup.set()

    def close(self) -> None:
        """Stop the thread; returns once no madvise or scan of this mapping
        runs (the mapping may then go)."""
        with self._cond:
            self._closed = True
            self._wakeup.set()
            self._cond.wait_for(lambda: self._active == 0)

    def _enter(self) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._active += 1
            return True

    def _leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def _map(self, region: int) -> None:
        """Map `region` unless mapped or being mapped (then wait for it)."""
        with self._cond:
            if self._closed:
                return
            ev = self._state.get(region)
            mine = ev is None
            if mine:
                ev = self._state[region] = threading.Event()
                self._active += 1
        if not mine:
            ev.wait()
            return
        try:
            populate(self._addr(region), self._bytes)
        finally:
            ev.set()
            self._leave()

    def _owned_unmapped(self) -> list[int]:
        if not self._enter():
            return []
        try:
            return [r for r, owner in enumerate(self._owners()) if owner == self._owned and r not in self._state]
        finally:
            self._leave()

    def _run(self) -> None:
        while not self._closed:
            self._wakeup.wait()
            self._wakeup.clear()
            t = time.monotonic()
            try:
                todo = self._owned_unmapped()
                scanned = time.monotonic() - t
                for r in todo:
                    self._map(r)
            except Exception as e:  # a hint only: the caller maps what it touches
                log.debug("cxlkv: mapping owned regions ahead failed: %s", e)
                scanned = time.monotonic() - t
            time.sleep(max(SCAN_EVERY_S, SCAN_SHARE * scanned))
