"""A batch's copies spread over several threads.

One CPU thread copying into the pool moves a fraction of what the memory
system (or a GPU's DMA engine) can: on a 16-CPU GPU host ~5.5 GB/s alone, and
a whole batch's copies kept up with the GPU's DMA over PCIe gen 5 (~55 GB/s)
only from 12 threads on (docs/BENCHMARKS.md, "GPU host"). A batch is therefore cut into groups of about equal bytes, one
per copy thread; an object larger than a group is cut into slices (at least
`SLICE` bytes, ends 128-byte aligned in the destination so streaming stores
stay aligned and no two threads write the same cache line), so a single
32 MiB object also uses every thread. The calling thread copies one group
itself; the copy routine releases the GIL, so the others run truly in parallel.

Each group ends with one `fence` (when given) on the thread that copied it:
an sfence orders only its own thread's streaming stores and write-backs, so
every copying thread fences once after its last slice, and the caller
publishes (Commit) only after all groups returned.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

SLICE = 1 << 20
ALIGN = 128
MAX_THREADS = 64

# Debug hook (tests): called as HOOK(event, nbytes) on the thread doing it,
# event "copy" per slice and "fence" per group. None on the hot path.
HOOK: Callable[[str, int], None] | None = None

Job = tuple[int, int, int]  # (dst, src, n)


#: The most threads the default takes: on a 16-CPU host with one GPU on PCIe
#: gen 5 x16, 16 threads came closest to the GPU's DMA rate and more cannot
#: add to it (figures in docs/BENCHMARKS.md, "GPU host").
DEFAULT_MAX = 16


def _cgroup_cpus(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> float | None:
    """The CPU quota of this process's cgroup in CPUs (a container's
    `--cpus`), or None when there is none: cgroup v2 `cpu.max`, else v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`."""

    def read(*parts: str) -> str:
        with open(os.path.join(root, *parts)) as f:
            return f.read().strip()

    try:
        with open(own) as f:
            paths = {c: p.lstrip("/") for _, c, p in (line.rstrip("\n").split(":", 2) for line in f)}
        if "" in paths and os.path.exists(os.path.join(root, paths[""], "cpu.max")):
            quota, period = read(paths[""], "cpu.max").split()[:2]
        else:
            ctrl = next(c for c in paths if "cpu" in c.split(","))
            d = next(d for d in ("cpu,cpuacct", "cpu") if os.path.isdir(os.path.join(root, d)))
            quota, period = read(d, paths[ctrl], "cpu.cfs_quota_us"), read(d, paths[ctrl], "cpu.cfs_period_us")
        if quota in ("max", "-1") or int(period) <= 0:
            return None
        return int(quota) / int(period)
    except (OSError, StopIteration, ValueError):
        return None


def usable_cpus(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> int:
    """CPUs this process may run on: its affinity, bounded by its cgroup's
    CPU quota (rounded up) when it has one."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_cpus(root, own)
    if quota is not None:
        n = min(n, max(1, -int(-quota // 1)))
    return n


def default_threads(cpus: int | None = None) -> int:
    """Three quarters of the usable CPUs (`cpus`, else `usable_cpus()`), at
    least 1 and at most `DEFAULT_MAX`.

    A quarter of the CPUs, and at least one, stays with everything else in
    the serving process and beside it: the engine's scheduler loop, the API
    server, tokenizers, the gRPC threads. The copy threads run only while a
    batch is being copied, and that batch is what the engine waits for (a
    load before a prefill; a store that frees L1 for the next offload): on
    a 16-CPU GPU host 12 threads copy 32 MiB objects at most of the GPU's
    DMA rate (the host's memory, not the thread count, bounds the rest;
    docs/BENCHMARKS.md, "GPU host") while 4 CPUs stay free; on a 2-CPU host one thread copies, as before
    (a second one made small batches slower there)."""
    n = usable_cpus() if cpus is None else cpus
    return max(1, min(n - max(1, n // 4), DEFAULT_MAX))


def plan(jobs: list[Job], threads: int) -> list[list[tuple[int, int, int, int]]]:
    """Cut jobs into at most `threads` groups of (job index, dst, src, n)
    slices of about equal bytes."""
    total = sum(n for _, _, n in jobs)
    if threads <= 1 or total < 2 * SLICE:
        return [[(i, d, s, n) for i, (d, s, n) in enumerate(jobs) if n]] if total else []
    target = max(SLICE, -(-total // threads))
    groups: list[list[tuple[int, int, int, int]]] = [[]]
    room = target
    for i, (d, s, n) in enumerate(jobs):
        off = 0
        while off < n:
            if room <= 0:
                groups.append([])
                room = target
            take = min(n - off, room)
            if off + take < n:  # a cut inside the object: align it in the destination
                take += -(d + off + take) % ALIGN
                if n - off - take < SLICE:  # no short tail slice
                    take = n - off
            groups[-1].append((i, d + off, s + off, take))
            off += take
            room -= take
    return groups


class Copier:
    """`threads - 1` copy threads (the caller is the last one). Each has its
    own queue and group k of a batch goes to thread k, so a batch really uses
    every thread (a shared work queue lets one early thread take them all)."""

    def __init__(self, threads: int):
        if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= MAX_THREADS:
            raise ValueError(f"copy_threads must be 1..{MAX_THREADS}, got {threads!r}")
        self.threads = threads
        self._queues = [queue.SimpleQueue() for _ in range(threads - 1)]
        self._workers = [threading.Thread(target=_worker, args=(q,), name=f"cxlkv-copy-{i}", daemon=True)
                         for i, q in enumerate(self._queues)]
        for t in self._workers:
            t.start()
        self._closed = False

    def run(self, jobs: list[Job], fn: Callable[[int, int, int], None], fence: Callable[[], None] | None = None,
            until: float | None = None) -> set[int]:
        """Copy every job with fn(dst, src, n); the indices of jobs not fully
        copied because time.time() passed `until` before one of their slices
        began (their bytes are partial: never publish them)."""
        groups = plan(jobs, self.threads)
        if not groups:
            return set()
        if self._closed:  # closing: copy everything here
            groups = [[s for g in groups for s in g]]
        futs = []
        for q, g in zip(self._queues, groups[1:]):
            f: Future = Future()
            q.put((f, g, fn, fence, until))
            futs.append(f)
        skipped = _group(groups[0], fn, fence, until)
        err = None
        for f in futs:  # wait for all, even after a failure: no copy may outlive the call
            try:
                skipped |= f.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                err = err or e
        if err is not None:
            raise err
        return skipped

    def close(self) -> None:
        self._closed = True
        for q in self._queues:
            q.put(None)
        for t in self._workers:
            t.join()


def _worker(q: queue.SimpleQueue) -> None:
    while (item := q.get()) is not None:
        f, g, fn, fence, until = item
        try:
            f.set_result(_group(g, fn, fence, until))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            f.set_exception(e)


def _group(group, fn, fence, until) -> set[int]:
    skipped: set[int] = set()
    hook = HOOK
    for i, d, s, n in group:
        if i in skipped or (until is not None and time.time() > until):
            skipped.add(i)
            continue
        fn(d, s, n)
        if hook is not None:
            hook("copy", n)
    if fence is not None:
        fence()
        if hook is not None:
            hook("fence", 0)
    return skipped
