"""The client maps the regions its node owns into its own process ahead of
need (populate.py): a copy into a region the sidecar just claimed finds its
pages mapped instead of faulting on each 4 KiB page in the engine's thread.
What is checked is the process's page tables (the mapping's Rss in
/proc/self/smaps), not a flag."""

import threading
import time

import pytest

from cxlkv_lmcache import client as cl
from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_testkit import Sidecar

REGION = 4 << 20


@pytest.fixture
def node(tmp_path):
    s = Sidecar(tmp_path, pool_size="64MiB", region_size="4MiB").start()
    yield s
    s.kill()


def rss_of_mapping(base: int) -> int:
    """Bytes of the mapping starting at `base` present in this process's
    page tables."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            inside = int(head.split("-")[0], 16) == base
        elif inside and head == "Rss:":
            return int(line.split()[1]) << 10
    raise AssertionError(f"no mapping at {base:#x}")


def owned(pm: cl.PoolMap, node_id: int) -> list[int]:
    return [r for r, w in enumerate(pm._owner_words()) if w == (1 << 32) | node_id]


def wait_mapped(pm: cl.PoolMap, regions: list[int]) -> None:
    wait_mapped_in(pm._populator, regions)


def test_a_region_the_sidecar_claims_is_mapped_into_the_client_before_any_copy_touches_it(node):
    ch = cl.channel(node.socket)
    stub = cl.stub(ch)
    info = stub.PoolInfo(pb.PoolInfoRequest(), timeout=5)
    pm = cl.PoolMap(info)
    try:
        first = owned(pm, info.node_id)
        assert first, "the sidecar owns a region from the start"
        wait_mapped(pm, first)
        assert rss_of_mapping(pm.base) >= len(first) * REGION, "the owned regions are in the page tables"

        # More than the owned regions hold: the sidecar claims another one;
        # a store batch (put_many) wakes the thread.
        page = info.page_size
        n = len(first) * REGION // page
        items = [pb.ReserveItem(key=b"k%d" % i, size=page) for i in range(n + 8)]
        rep = stub.Reserve(pb.ReserveRequest(items=items), timeout=10)
        placed = [r for r in rep.reservations if r.status.code == cl.OK]
        buf = bytearray(b"x" * page)
        src = (cl.ctypes.c_char * page).from_buffer(buf)
        pm.put_many(_Serial(), [(placed[0].location, cl.ctypes.addressof(src), page)])
        new = [r for r in owned(pm, info.node_id) if r not in first]
        assert new, "the sidecar claimed another region"
        wait_mapped(pm, new)
        # Nothing touched the new regions: the thread mapped them.
        assert rss_of_mapping(pm.base) >= (len(first) + len(new)) * REGION
        assert rss_of_mapping(pm.base) < (len(first) + len(new) + 1) * REGION, "no region of no one is mapped"
        del src
    finally:
        pm.close()
        ch.close()


class _Serial:
    def run(self, jobs, fn, fence, until):
        for dst, src, n in jobs:
            fn(dst, src, n)
        return set()


def test_close_stops_the_thread_and_unmaps(node):
    ch = cl.channel(node.socket)
    info = cl.stub(ch).PoolInfo(pb.PoolInfoRequest(), timeout=5)
    pm = cl.PoolMap(info)
    thread = pm._populator._thread
    pm.close()  # perhaps while it maps a region: close waits for that call
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert pm._mm.closed
    assert not any(t.name == "cxlkv-populate" and t is thread for t in threading.enumerate())
    ch.close()


def test_the_thread_maps_the_regions_of_the_node_it_follows_and_only_those():
    """On anonymous memory standing in for a pool of four regions: the
    regions node 1 owns are mapped; once it follows node 2 (a sidecar
    restarted on the same pool under another id), node 2's too, and a free
    region never."""
    import mmap

    from cxlkv_lmcache.populate import Populator

    size = 1 << 20
    mem = mmap.mmap(-1, 4 * size)
    anchor = cl.ctypes.c_char.from_buffer(mem)
    base = cl.ctypes.addressof(anchor)
    words = [(1 << 32) | 1, 0, (1 << 32) | 2, (1 << 32) | 1]
    p = Populator(1, size, lambda r: base + r * size, lambda: list(words))
    try:
        wait_mapped_in(p, [0, 3])
        assert not p.is_mapped(2) and not p.is_mapped(1)
        assert rss_of_mapping(base) >= 2 * size
        p.follow(2)
        wait_mapped_in(p, [2])
        assert not p.is_mapped(1), "a region of no one is never mapped ahead"
        assert rss_of_mapping(base) >= 3 * size
        assert rss_of_mapping(base) < 4 * size
        p.ensure(1)  # what a copy into it calls: mapped by the caller
        assert p.is_mapped(1) and rss_of_mapping(base) >= 4 * size
    finally:
        p.close()
        del anchor
        mem.close()


def wait_mapped_in(p, regions: list[int]) -> None:
    end = time.monotonic() + 20
    while not all(p.is_mapped(r) for r in regions):
        assert time.monotonic() < end, f"regions {regions} not mapped ahead: {p._state}"
        time.sleep(0.01)


def test_a_forked_child_maps_the_regions_again_with_a_thread_of_its_own():
    """A fork copies no page tables of a shared mapping and no threads: the
    child's populator starts afresh rather than take the parent's regions as
    mapped (or wait for ever on one the parent's thread was mapping)."""
    import mmap
    import os

    from cxlkv_lmcache.populate import Populator

    size = 1 << 20
    mem = mmap.mmap(-1, 4 * size)
    anchor = cl.ctypes.c_char.from_buffer(mem)
    base = cl.ctypes.addressof(anchor)
    p = Populator(1, size, lambda r: base + r * size, lambda: [(1 << 32) | 1, 0, (1 << 32) | 1, 0])
    try:
        wait_mapped_in(p, [0, 2])
        parent_thread = p._thread
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                wait_mapped_in(p, [0, 2])
                if p._thread is not parent_thread and p._thread.is_alive() and rss_of_mapping(base) >= 2 * size:
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child mapped its regions with its own thread"
    finally:
        p.close()
        del anchor
        mem.close()
