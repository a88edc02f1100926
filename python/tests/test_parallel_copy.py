"""A batch's copies spread over copy threads (cxlkv_lmcache.copies)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time

import pytest
import torch

from cxlkv_lmcache import client as cl
from cxlkv_lmcache import copies
from cxlkv_lmcache.copies import SLICE, Copier, plan
from cxlkv_testkit import Sidecar, make_adapter

from cxlkv_testkit.l2 import bits, key, load, obj, store

GUARD = 256


@contextlib.contextmanager
def recorded():
    """Every (event, thread id, nbytes) the copy routine reports."""
    events, lock = [], threading.Lock()

    def hook(event, n):
        with lock:
            events.append((event, threading.get_ident(), n))

    copies.HOOK = hook
    try:
        yield events
    finally:
        copies.HOOK = None


def buffers(sizes, dst_off, src_off):
    """One source and one guarded destination per size."""
    out = []
    for n in sizes:
        src = ctypes.create_string_buffer(os.urandom(n + src_off + GUARD), n + src_off + GUARD)
        dst = ctypes.create_string_buffer(b"\xa5" * (n + dst_off + 2 * GUARD), n + dst_off + 2 * GUARD)
        out.append((src, dst, ctypes.addressof(dst) + GUARD + dst_off, ctypes.addressof(src) + src_off, n))
    return out


def assert_exact(bufs, dst_off, src_off):
    for src, dst, _, _, n in bufs:
        raw = dst.raw
        assert raw[GUARD + dst_off:GUARD + dst_off + n] == src.raw[src_off:src_off + n], f"{n}: other bytes"
        assert raw[:GUARD + dst_off] == b"\xa5" * (GUARD + dst_off), f"{n}: wrote before the destination"
        assert raw[GUARD + dst_off + n:] == b"\xa5" * (len(raw) - GUARD - dst_off - n), f"{n}: wrote past it"


# Sizes around the slice boundaries (and the 2-slice threshold) of 1..4 threads.
SIZES = [[SLICE - 1], [2 * SLICE - 1], [2 * SLICE], [2 * SLICE + 1], [3 * SLICE + 129], [(8 << 20) + 13],
         [SLICE + 7, 3, 2 * SLICE - 5, 64 << 10, SLICE]]


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("dst_off,src_off", [(0, 0), (1, 0), (0, 3), (63, 17), (96, 1)])
def test_parallel_copy_is_exact_around_slice_boundaries(threads, sizes, dst_off, src_off):
    bufs = buffers(sizes, dst_off, src_off)
    c = Copier(threads)
    try:
        assert c.run([(d, s, n) for _, _, d, s, n in bufs], cl.copy) == set()
    finally:
        c.close()
    assert_exact(bufs, dst_off, src_off)


@pytest.mark.skipif(cl.FLUSH is None, reason="built without cache-line flushes")
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("dst_off,src_off", [(0, 0), (63, 17), (96, 1)])
def test_parallel_store_with_write_back_is_exact(sizes, dst_off, src_off):
    from cxlkv_lmcache import _copy

    bufs = buffers(sizes, dst_off, src_off)
    c = Copier(3)
    try:
        c.run([(d, s, n) for _, _, d, s, n in bufs], _copy.store, _copy.fence)
    finally:
        c.close()
    assert_exact(bufs, dst_off, src_off)


def test_slices_cover_every_byte_once_and_cuts_are_aligned():
    jobs = [(4096 * 7 + 3, 1 << 40, (32 << 20) + 5), (1 << 30, 1 << 41, 100), (1 << 31, 1 << 42, 3 << 20)]
    for threads in (1, 2, 4, 8):
        groups = plan(jobs, threads)
        assert 1 <= len(groups) <= threads
        for i, (d, s, n) in enumerate(jobs):
            parts = sorted((sd, ss, sn) for g in groups for j, sd, ss, sn in g if j == i)
            at = d
            for sd, ss, sn in parts:
                assert sd == at and ss - s == sd - d, "a gap or an overlap"
                if sd != d:  # a cut inside the object: aligned, never a short slice
                    assert sd % 128 == 0 and sn >= SLICE or sd + sn == d + n
                at += sn
            assert at == d + n


def test_a_large_object_is_copied_by_several_threads_and_each_fences_after_its_last_slice():
    n = 32 << 20
    bufs = buffers([n], 0, 0)
    fences = []
    c = Copier(4)
    try:
        with recorded() as ev:
            c.run([(d, s, n) for _, _, d, s, n in bufs], cl.copy, lambda: fences.append(threading.get_ident()))
    finally:
        c.close()
    assert_exact(bufs, 0, 0)
    copiers = {t for e, t, _ in ev if e == "copy"}
    assert len(copiers) == 4, f"{len(copiers)} threads copied a 32 MiB object with copy_threads=4"
    assert sum(b for e, _, b in ev if e == "copy") == n
    assert sorted(fences) == sorted(copiers), "every copying thread fences exactly once"
    for t in copiers:  # a thread's fence comes after its last slice
        mine = [e for e, tt, _ in ev if tt == t]
        assert mine[-1] == "fence" and mine.count("fence") == 1, mine


def test_one_copy_thread_copies_everything_on_the_caller():
    bufs = buffers([8 << 20, 3 << 20], 0, 0)
    c = Copier(1)
    try:
        with recorded() as ev:
            c.run([(d, s, n) for _, _, d, s, n in bufs], cl.copy)
    finally:
        c.close()
    assert {t for _, t, _ in ev} == {threading.get_ident()}


def test_slices_not_started_before_the_deadline_are_reported_and_not_written():
    bufs = buffers([4 << 20, 100], 0, 0)
    c = Copier(2)
    try:
        late = c.run([(d, s, n) for _, _, d, s, n in bufs], cl.copy, until=time.time() - 1)
    finally:
        c.close()
    assert late == {0, 1}
    for _, dst, _, _, _ in bufs:
        assert dst.raw == b"\xa5" * len(dst.raw)


@pytest.mark.parametrize("bad", [0, 65, -1, "2", 2.0, True])
def test_bad_copy_threads_are_refused(bad):
    with pytest.raises(ValueError) as e:
        make_adapter("/tmp/none.sock", copy_threads=bad)
    assert "copy_threads" in str(e.value)


@pytest.mark.parametrize("cpus, threads", [(1, 1), (2, 1), (3, 2), (4, 3), (8, 6), (16, 12), (20, 15), (24, 16),
                                            (64, 16)])
def test_the_default_leaves_a_quarter_of_the_cpus_and_takes_at_most_16(cpus, threads):
    # 16 CPUs: 12 threads, leaving 4 to the engine (the GPU host's figures:
    # docs/BENCHMARKS.md, "GPU host");
    # 2 CPUs: the one thread this VM's figures were measured with.
    assert copies.default_threads(cpus) == threads


def test_the_adapters_default_is_the_policy_on_this_host():
    from cxlkv_lmcache.config import CxlKvL2AdapterConfig

    assert CxlKvL2AdapterConfig.from_dict({}).copy_threads == copies.default_threads(copies.usable_cpus())
    assert "copy_threads" in CxlKvL2AdapterConfig.help()


def _cgroup(tmp_path, own: str, files: dict[str, str]) -> tuple[str, str]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp_path / "self").write_text(own)
    return str(root), str(tmp_path / "self")


@pytest.mark.parametrize("own, files, quota", [
    # cgroup v2: the process's own cgroup's cpu.max
    ("0::/pod/engine\n", {"pod/engine/cpu.max": "250000 100000\n"}, 2.5),
    ("0::/pod/engine\n", {"pod/engine/cpu.max": "max 100000\n"}, None),
    # cgroup v1: the cpu controller's quota and period
    ("4:memory:/x\n3:cpu,cpuacct:/docker/c1\n", {"cpu,cpuacct/docker/c1/cpu.cfs_quota_us": "400000\n",
                                                  "cpu,cpuacct/docker/c1/cpu.cfs_period_us": "100000\n"}, 4.0),
    ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ("1:cpu:/\n", {}, None),  # no controller mounted: no quota known
])
def test_a_cgroup_cpu_quota_is_read(tmp_path, own, files, quota):
    root, self_ = _cgroup(tmp_path, own, files)
    assert copies._cgroup_cpus(root, self_) == quota


def test_a_containers_cpu_quota_bounds_the_cpus_the_default_counts(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    root, self_ = _cgroup(tmp_path, "0::/c\n", {"c/cpu.max": "50000 100000\n"})  # half a CPU
    assert copies.usable_cpus(root, self_) == 1
    root, self_ = _cgroup(tmp_path, "0::/c\n", {"c/cpu.max": "max 100000\n"})
    assert copies.usable_cpus(root, self_) == affinity


@pytest.mark.parametrize("threads", [1, 3])
def test_adapter_stores_and_loads_a_batch_over_the_copy_threads(tmp_path, threads):
    """Through the adapter: a batch with a 32 MiB object is copied (both
    ways) by `copy_threads` threads and round-trips exactly."""
    sc = Sidecar(tmp_path, pool_size="256MiB", extra=("--region-size", "64MiB")).start()
    a = make_adapter(sc.socket, copy_threads=threads)
    try:
        sizes = [32 << 20, 256 << 10, (2 << 20) + 3]
        keys = [key(100 + i) for i in range(len(sizes))]
        objs = [obj(n, seed=i) for i, n in enumerate(sizes)]
        with recorded() as ev:
            r = store(a, keys, objs)
        assert r.is_successful() and r.bytes_transferred() == sum(sizes)
        stored_by = {t for e, t, _ in ev if e == "copy"}
        outs = [obj(n, seed=999) for n in sizes]
        with recorded() as ev:
            assert bits(load(a, keys, outs), len(keys)) == [True] * len(keys)
        loaded_by = {t for e, t, _ in ev if e == "copy"}
        a.submit_unlock(keys)
        for want, got in zip(objs, outs):
            assert torch.equal(got.tensor, want.tensor)
        assert len(stored_by) == threads and len(loaded_by) == threads
    finally:
        a.close()
        sc.kill()


def test_a_store_reports_the_time_of_its_reserve_copies_and_commit(tmp_path):
    """`report_status()["store_phase_s"]`: per batch that reached its
    commit, the Reserve call, the copies and the Commit, each timed; together
    no more than the task took, and a larger batch's copies take longer. A
    batch of keys that all exist commits nothing and is not counted."""
    sc = Sidecar(tmp_path, pool_size="256MiB", extra=("--region-size", "128MiB")).start()
    a = make_adapter(sc.socket, copy_threads=1)
    phases = ("reserve", "copy", "commit")
    try:
        assert a.report_status()["store_phase_s"] == {"batches": 0, "reserve": 0.0, "copy": 0.0, "commit": 0.0}
        t = time.perf_counter()
        assert store(a, [key(1)], [obj(4096)]).is_successful()
        took = time.perf_counter() - t
        first = a.report_status()["store_phase_s"]
        assert first["batches"] == 1
        assert all(first[p] > 0 for p in phases), first
        assert sum(first[p] for p in phases) <= took
        # Past the first batch's start-up costs: one page, then 96 MiB (tens
        # of ms to copy, longer than any scheduling hiccup of the first).
        assert store(a, [key(2)], [obj(4096)]).is_successful()
        small = a.report_status()["store_phase_s"]
        assert store(a, [key(3)], [obj(96 << 20)]).is_successful()
        big = a.report_status()["store_phase_s"]
        assert big["batches"] == 3
        assert big["copy"] - small["copy"] > small["copy"] - first["copy"], (first, small, big)
        assert store(a, [key(1)], [obj(4096)]).is_successful()
        assert a.report_status()["store_phase_s"] == big
    finally:
        a.close()
        sc.kill()
