"""The cache survives a sidecar restart, seen from LMCache's StorageManager
(the L1/L2 core that `lmcache server` runs): chunks stored before a kill -9
are prefetch hits afterwards, in the same process and in a fresh one."""

from __future__ import annotations


import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc

from cxlkv_testkit import storage_manager, upstream, wait_for
from cxlkv_testkit.l2 import key

SHAPE, DTYPE = torch.Size([2, 4, 256]), torch.bfloat16


def prefetch_hits(sm, keys, layout) -> int:
    single_row_spec = upstream("tests.v1.distributed.utils").single_row_spec

    handle = sm.submit_prefetch_task(single_row_spec(keys, layout))
    assert sm.wait_prefetch_status(handle, timeout=10.0)
    hits = sm.query_prefetch_status(handle).l2_hit_cells[0].count_leading_ones()
    if hits:
        with sm.read_prefetched_results(keys[:hits]) as results:
            for i, r in enumerate(results):
                assert torch.all(r.tensor == float(i + 1)), f"chunk {i} came back with other bytes"
        sm.finish_read_prefetched(keys[:hits])
    return hits


def test_chunks_stored_before_a_kill_9_are_hits_after_the_restart(sidecar):
    layout = MemoryLayoutDesc(shapes=[SHAPE], dtypes=[DTYPE])
    keys = [key(i) for i in range(6)]
    sm = storage_manager(sidecar.socket, poll_interval_ms=100)
    try:
        adapter = sm._l2_adapters[0]
        reserved = sm.reserve_write(keys, layout)
        for i, k in enumerate(keys):
            reserved[k].tensor.copy_(torch.full(SHAPE, float(i + 1), dtype=DTYPE))
        sm.finish_write(keys)
        size = SHAPE.numel() * 2
        assert wait_for(lambda: adapter.get_usage().total_bytes_used == 6 * size, timeout=10)
        sidecar.kill()
        assert wait_for(lambda: not adapter.report_status()["is_healthy"], timeout=10)
        sidecar.start()
        assert wait_for(lambda: adapter.report_status()["is_healthy"], timeout=10)
        # The same LMCache process: its chunks are hits again, byte for byte,
        # and its accounting kept them.
        assert prefetch_hits(sm, keys, layout) == 6
        assert adapter.get_usage().total_bytes_used == 6 * size
    finally:
        sm.close()
    # A fresh LMCache process finds them too.
    fresh = storage_manager(sidecar.socket)
    try:
        assert prefetch_hits(fresh, keys, layout) == 6
    finally:
        fresh.close()
